"""The long samples (SPEC section 11): `csa-parity run --sample long`, every long case
(harness.problems.cases.LONG_CASES) at float32 and bfloat16, chunked and native, judged on every
quantity against the float64 reference by the matrix's rule; `--sample million`, the million-token
case (MILLION_CASES) at bfloat16 at its chunked point, its forward judged on sampled rows
(harness.problems.matrix.sampled_rows) and the invariants of its picks on every row. No process
holds a [B, S, W] array. Each case runs in a worker process of its own (`run`): one that runs out
of memory or time is an error at its points.

Per case, one walk over the rows in the candidate's query blocks of r rows: the candidate's
scores and picks of the block at each point and dtype (harness.sides.long_sides), the invariants
of every row's picks (harness.judging.invariants.PicksStream), then, per slice of at most
JUDGE_ROWS judged rows of it, the reference's in float64 and at each dtype, fed to the judge's
streams (harness.judging.compare: CloseStream, TopkStream). Where every row is judged, the float64
picks are kept ([B, S, k], the sparse loss's selection) and the loss and gradients are judged:
whole arrays of parameter or key shape that go to the judge as they are, like the compressed
keys; the streamed results stand in for the checks of the scores and the picks
(References.streamed). Records, table, reports and rerun lines are the matrix's
(harness.run.report).
"""

from __future__ import annotations

import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..judging.compare import CloseStream, TopkStream, oracle_relative_result, status_result
from ..judging.judge import judge
from ..outputs import MODES, NOT_APPLICABLE, References
from ..points import Entry
from ..problems.cases import LONG_CASES, MILLION_CASES, get_case, make_inputs
from ..problems.matrix import LONG_DTYPES, MILLION_DTYPES, MILLION_QUERY_BLOCKS, entries_at, long_points, sampled_rows
from ..sides import long_sides
from ..sides.long_sides import JUDGE_ROWS


def dims(case) -> dict[str, int]:
    cfg = case.config
    return {"B": case.batch, "S": case.seq_len, "W": case.num_blocks, "HI": cfg["index_n_heads"],
            "DI": cfg["index_head_dim"], "R": cfg["q_lora_rank"], "E": cfg["emb_dim"], "m": cfg["compress_ratio"]}


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class _Clock:
    def __init__(self):
        self.s: dict[str, float] = {}

    def add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.s[stage] = self.s.get(stage, 0.0) + now - since
        return now


def row_slices(rows: np.ndarray, r: int, most: int) -> list[slice]:
    """Runs of consecutive `rows` (sorted), cut at every multiple of `r` (a query block's edge) and
    at `most` rows."""
    out, start, prev = [], None, None
    for s in map(int, rows):
        if start is not None and (s != prev + 1 or s % r == 0 or s - start == most):
            out.append(slice(start, prev + 1))
            start = None
        start = s if start is None else start
        prev = s
    return out + ([slice(start, prev + 1)] if start is not None else [])


def judge_case(name: str, dtypes=LONG_DTYPES, modes=None, policy=None, case=None, log=print, query_blocks=None,
               rows=None):
    """[(Entry, CheckResult)] of every entry of the long case's points at `dtypes`, and the time
    per stage {jax, oracle, judge} in seconds with the counts of rows {rows_walked: the candidate's,
    rows_oracle: the oracle's}. `case`: another Case to judge in its place (the
    tests' shortened copies). `query_blocks`: the indices of the candidate's query blocks whose
    rows are judged (default every one); `rows`: the rows the oracle judges (sorted; default every
    row of those blocks). Where not every row is judged, the forward quantities are judged on those
    rows (the reference's error at the dtype measured on the same rows) and the loss and gradients,
    which need every row, are not applicable. The invariants of the picks (harness.judging.invariants)
    are checked on every row of the blocks walked."""
    from ..judging.invariants import PicksStream, block_facts
    from ..judging.tolerance import Policy

    policy = policy or Policy()
    case = case or get_case(name)
    problem = case.config_dict()
    inputs, params = make_inputs(case)
    B, S = case.batch, case.seq_len
    points = {t: long_points(name, t) for t in dtypes}
    r = points[dtypes[0]][0].qchunk
    clock = _Clock()
    sc = "index_scores"

    def streams(t):
        keep = policy.oracle_factor(t, sc) * policy.alpha(sc) * policy.floor(t, sc, dims(case))
        return {"torch": CloseStream("row", keep_above=np.inf), "oracle": CloseStream("row", keep), "topk": TopkStream(),
                "native-oracle": CloseStream("row", keep), "native-topk-oracle": TopkStream(),
                "chunk": CloseStream("row", policy.chunk(t, sc)), "chunk-topk": TopkStream()}

    st = {t: streams(t) for t in dtypes}
    k_eff = case.k_eff
    facts = block_facts(inputs["position_ids"], inputs["segment_ids"], case.config["compress_ratio"])
    picks_ok = {(t, i): PicksStream(facts, k_eff) for t in dtypes for i in range(len(points[t]))}
    starts = [i * r for i in (range(-(-S // r)) if query_blocks is None else query_blocks)]
    walked = np.concatenate([np.arange(b0, min(b0 + r, S)) for b0 in starts])
    judged = walked if rows is None else np.intersect1d(walked, rows)
    every_row = judged.size == S
    # The oracle's picks of every row: the sparse loss's selection, wanted only where the loss is judged.
    selection = np.empty((B, S, k_eff), np.int32) if every_row else None
    slices = row_slices(judged, r, JUDGE_ROWS)
    oracle_gen = long_sides.reference_forward(params, inputs, problem, "float64", slices)
    at_gen = {t: long_sides.reference_forward(params, inputs, problem, t, slices) for t in dtypes}
    for b0 in starts:
        t0 = time.perf_counter()
        cand = {t: [long_sides.candidate_rows(params, inputs, problem, p, b0, r) for p in points[t]] for t in dtypes}
        t0 = clock.add("jax", t0)
        block = slice(b0, min(b0 + r, S))
        for t in dtypes:
            for i, (_, picks) in enumerate(cand[t]):
                picks_ok[t, i].add(picks, inputs["position_ids"][:, block], inputs["segment_ids"][:, block], (0, b0))
        for rows_ in [s for s in slices if b0 <= s.start < b0 + r]:
            _, o_scores, o_picks = next(oracle_gen)
            if every_row:
                selection[:, rows_] = o_picks
            at = {t: next(at_gen[t]) for t in dtypes}
            t0 = clock.add("oracle", t0)
            loc = slice(rows_.start - b0, rows_.stop - b0)
            for t in dtypes:
                (c_scores, c_picks), *native = [(s[:, loc], k[:, loc]) for s, k in cand[t]]
                s_ = st[t]
                off = (0, rows_.start)
                s_["torch"].add(at[t][1], o_scores, off)
                s_["oracle"].add(c_scores, o_scores, off)
                s_["topk"].add(c_picks, o_picks, o_scores, off)
                if native:
                    (n_scores, n_picks), = native
                    s_["native-oracle"].add(n_scores, o_scores, off)
                    s_["native-topk-oracle"].add(n_picks, o_picks, o_scores, off)
                    s_["chunk"].add(c_scores, n_scores, off)
                    s_["chunk-topk"].add(c_picks, n_picks, o_scores, off)
        t0 = clock.add("judge", t0)
        log(f"  {name}: rows {b0}..{min(b0 + r, S) - 1} of {S} walked ({time.perf_counter():.0f}; "
            f"peak {peak_rss_gib():.2f} GiB)")

    clock.s.update(rows_walked=int(walked.size), rows_oracle=int(judged.size))
    t0 = time.perf_counter()
    losses = every_row and set(modes or ("dense",)) != {"forward"}
    rows_note = ("" if every_row else
                 f"; judged on {judged.size} of the {S} rows" +
                 (f" (query blocks {', '.join(map(str, sorted(set(starts))))} of {r} rows)" if rows is None else
                  " (the first, the last, both sides of every document and query-block boundary, and seeded "
                  f"random rows; the picks' invariants on all {walked.size} rows walked)"))
    oracle = {"compressed_keys": long_sides.reference_keys(params, inputs, problem, "float64"),
              **(long_sides.reference_losses(params, inputs, problem, "float64", None) if losses else {})}
    t0 = clock.add("oracle", t0)
    out = []
    for t in dtypes:
        at_dtype = {"compressed_keys": long_sides.reference_keys(params, inputs, problem, t),
                    **(long_sides.reference_losses(params, inputs, problem, t, selection) if losses else {})}
        t0 = clock.add("oracle", t0)
        chunked, *native = points[t]
        native = native[0] if native else None
        cand = {p: {"compressed_keys": long_sides.candidate_keys(params, inputs, problem, p),
                    **(long_sides.candidate_losses(params, inputs, problem, p, selection) if losses else {})}
                for p in points[t]}
        t0 = clock.add("jax", t0)
        s_ = st[t]
        t_err = s_["torch"].worst
        alpha, floor = policy.alpha(sc), policy.floor(t, sc, dims(case))
        factor = policy.oracle_factor(t, sc)
        bound = alpha * max(t_err, floor)
        note = "; no stored order errors: a long case has no fixture"
        for i, p in enumerate(points[t]):
            prefix = "native-" if p is native else ""
            native_of = native if p is chunked else None
            streamed = {
                f"oracle:{sc}": oracle_relative_result(sc, s_[f"{prefix}oracle"], t_err, alpha, floor, "oracle",
                                                       None, factor, policy.platform_profile),
                "topk": s_[f"{prefix}topk" if prefix == "" else "native-topk-oracle"].result(
                    "topk_indices", lambda row_max: bound * factor * row_max),
            }
            if native_of is not None:
                streamed[f"native:{sc}"] = s_["chunk"].result("chunk", sc, policy.chunk(t, sc))
                streamed["native-topk"] = s_["chunk-topk"].result("topk_indices", lambda row_max: bound * row_max,
                                                                  check="chunk-topk")
            refs = References(oracle=long_sides.as_outputs("torch_ref@float64 (row blocks)", oracle),
                              at_dtype=long_sides.as_outputs(f"torch_ref@{t} (row blocks)", at_dtype),
                              native=None if native_of is None else long_sides.as_outputs("jax native", cand[native_of]),
                              dims=dims(case), streamed=streamed, chunk_at_length=True)
            outputs = long_sides.as_outputs("jax", cand[p])
            for entry in _entries(p, modes):
                if entry.mode != "forward" and not every_row:
                    why = "the loss and its gradients are means over every row" + rows_note
                    out.append((entry, status_result("-", entry.quantity, NOT_APPLICABLE, why).with_context(entry.label)))
                    continue
                for res in judge(entry, outputs, refs, policy):
                    if res.template == "topk" or (entry.quantity == sc and res.check == "oracle"):
                        res = _with_note(res, note + rows_note)
                    out.append((entry, res))
                if entry.quantity == "topk_indices":
                    out.append((entry, picks_ok[t, i].result().with_context(entry.label)))
        t0 = clock.add("judge", t0)
    return out, clock.s


def _entries(point, modes):
    """The entries of a long point: its forward entries too where it chunks the teacher (the
    matrix judges those at teacher chunk 0, `entries_at`; the forward does not read the teacher
    chunk, so they are labelled at 0 and judged from the same program's rows)."""
    import dataclasses

    if not point.tchunk or (modes is not None and "forward" not in modes):
        return entries_at(point, modes)
    forward = entries_at(dataclasses.replace(point, tchunk=0), ("forward",))
    return forward + entries_at(point, [m for m in (modes or MODES) if m != "forward"])


def _with_note(res, note):
    import dataclasses

    return dataclasses.replace(res, note=res.note + note) if note else res


# The time limit of one long case when `--timeout` is not given: far above what one case at both
# dtypes takes on the 2-core machine (about 24 minutes, both cases side by side: docs/matrix.md,
# "How long it takes here"), so that only a hang or a pathological slowdown reaches it.
LONG_TIMEOUT_S = 4 * 3600.0


def case_records(name: str, dtypes, modes) -> tuple[list[dict], dict[str, float]]:
    """What a worker of `run` does with one long case: (its report records, the time per stage). A
    million-token case's oracle judges its sampled rows (harness.problems.matrix.sampled_rows)."""
    from .report import record

    rows = sampled_rows(MILLION_CASES[name], MILLION_QUERY_BLOCKS[name]) if name in MILLION_CASES else None
    results, clock = judge_case(name, dtypes, modes, log=lambda line: print(line, file=sys.stderr, flush=True),
                                rows=rows)
    return [record(e, r) for e, r in results], clock


def case_entries(name: str, dtypes, modes) -> list[Entry]:
    """Every entry `judge_case` judges for the case at `dtypes`: those a failed case reports."""
    return [e for t in dtypes for p in long_points(name, t) for e in _entries(p, modes)]


def run(args) -> int:
    """`csa-parity run --sample long` (the long cases) or `--sample million` (the million-token
    case, its rows sampled): judge each case in a worker process of its own (a case that runs out
    of memory, over `--max-memory` or killed by the kernel, or past `--timeout` is an error at its
    points, with its peak; the run goes on), print the matrix's table and lines, write the
    reports."""
    from ..sides.worker import WorkerCrash, call_in_worker, first_line, parse_size
    from .report import (attach_reruns, failure_lines, format_table, headroom_table, status_line, summarise, table,
                         write_reports)
    from .tasks import error_records

    began = time.time()
    sample = args.sample
    cases, sample_dtypes = (MILLION_CASES, MILLION_DTYPES) if sample == "million" else (LONG_CASES, LONG_DTYPES)
    names = args.cases or list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise ValueError(f"--sample {sample} judges the cases {', '.join(cases)}; not {', '.join(unknown)}")
    dtypes = tuple(args.dtypes or sample_dtypes)
    bad = [d for d in dtypes if d not in sample_dtypes]
    if bad:
        raise ValueError(f"--sample {sample} judges {', '.join(sample_dtypes)}; not {', '.join(bad)}")
    limit_s = args.timeout if args.timeout is not None else LONG_TIMEOUT_S
    max_memory = None if getattr(args, "max_memory", None) is None else parse_size(args.max_memory)
    jobs = max(1, min(getattr(args, "jobs", None) or 1, len(names)))

    def one(name):
        sys.stderr.write(f"long case {name}: S={cases[name].seq_len}, W={cases[name].num_blocks}, "
                         f"k={cases[name].config['index_topk']} (a worker of its own)\n")  # one write: lines of
        sys.stderr.flush()  # the cases' threads do not interleave
        started = time.time()
        try:
            (recs, clock), peak = call_in_worker(f"{__name__}:case_records", (name, dtypes, args.modes),
                                                 f"long case {name}", limit_s, max_memory)
            return recs, {**{k: round(v, 1) for k, v in clock.items()}, "wall_s": round(time.time() - started, 1),
                          "peak_rss_gib": None if peak is None else round(peak / 2**30, 2)}
        except Exception as exc:  # its worker died, or the harness raised in it: the case's error, the run goes on
            line = str(exc) if isinstance(exc, WorkerCrash) else f"the harness raised at long case {name}: {first_line(exc)}"
            return error_records(case_entries(name, dtypes, args.modes), line), {
                "wall_s": round(time.time() - started, 1), "error": line}

    # `--jobs` cases at once, each in its worker (a case's programs keep about 1.5 of the 2 cores busy: two
    # side by side use both); `--max-memory` limits each worker.
    records, stages = [], {}
    with ThreadPoolExecutor(jobs) as pool:
        for name, (recs, stage) in zip(names, pool.map(one, names)):
            records += recs
            stages[name] = stage
    attach_reruns(records)
    records.sort(key=lambda r: (r["case"], r["dtype"], r["ichunk"], r["mode"], r["quantity"], r["check"]))
    meta = {"impl": "jax", "reference": "live (row blocks)", "tolerance_profile": "highest", "sample": sample,
            "wall_s": time.time() - began, "long_stages": stages, "timeout_s": limit_s, "max_memory_bytes": max_memory,
            "selection": {"sample": sample, "cases": names}}
    paths = write_reports(records, meta, args.out, heatmap_too=False)
    summary = summarise(records)
    header, rows = table(records)
    print(format_table(header, rows))
    print()
    print(f"{summary['entries']} entries, {summary['checks']} checks, {summary['failed']} failed in "
          f"{meta['wall_s']:.1f} s; " + status_line(summary) + f"; top-k ties excused: {summary['topk_excused_ties']}; "
          "worst ratio by dtype: " + ", ".join(f"{k} {float(v):.3g}" for k, v in summary["worst_ratio_by_dtype"].items()))
    hr_header, hr_rows = headroom_table(summary)
    print("headroom: worst ratio per kind and dtype:")
    print(format_table(hr_header, hr_rows))
    for name, s in stages.items():
        if "error" in s:
            print(f"{name}: ERROR after {s['wall_s']:.1f} s: {s['error']}")
            continue
        peak = "unknown" if s["peak_rss_gib"] is None else f"{s['peak_rss_gib']:.2f} GiB"
        print(f"{name}: jax {s.get('jax', 0):.1f} s, oracle {s.get('oracle', 0):.1f} s, judge {s.get('judge', 0):.1f} s, "
              f"wall {s['wall_s']:.1f} s, peak RSS {peak} (its worker); rows: {s.get('rows_walked', 0)} walked by the "
              f"candidate (the picks' invariants), {s.get('rows_oracle', 0)} judged against the oracle")
    for line in failure_lines(records)[:20]:
        print("FAIL", line)
    print(f"reports: {paths['json']}, {paths['md']}")
    return 0 if summary["failed"] + summary["errors"] == 0 else 1

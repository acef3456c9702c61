"""Reports of a matrix run: the summary table (stdout and markdown), parity.json and
the heat map PNG. All of it is built from a list of result records (plain dicts,
one per check; `record()` makes them), so a report can be rebuilt from the JSON.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import defaultdict

from ..judging.compare import CheckResult
from ..outputs import ERROR, EXCUSED, FAILED, NOT_APPLICABLE, NOT_PROVIDED, PASSED, STATUSES, STAGE_MODE, kind_of
from ..points import Entry, Point

# parity.json's layout (docs/design.md lists every field; CHANGELOG.md says what each version
# added). A reader that finds another version knows the fields may differ.
JSON_SCHEMA_VERSION = 9
COLUMNS = ("compressed_keys", "index_scores", "topk_indices", "codes", "loss", "grad", "input_grads")


def column_of(quantity: str) -> str:
    """The table column of a quantity: the quantizer's codes and scales (and a quantizer stage's)
    share `codes`, the parameter gradients `grad`."""
    if kind_of(quantity) == "codes":
        return "codes"
    return "grad" if quantity.startswith("grad.") else quantity


def record(entry: Entry, result: CheckResult) -> dict:
    p = entry.point
    ratio = result.ratio
    return {
        "id": entry.id,
        "case": p.case,
        "dtype": p.dtype,
        "ichunk": p.ichunk,
        "tchunk": p.tchunk,
        "qchunk": p.qchunk,
        "mesh": list(p.mesh) if p.mesh else None,
        "teacher": p.teacher,
        "backend": p.backend,
        "mode": entry.mode,
        "impl": entry.impl,
        "quantity": entry.quantity,
        "check": result.check,
        "status": result.status,  # passed | failed | excused | not_provided | not_applicable | error
        "error": _finite_or_str(result.error),
        "bound": result.bound,
        "ratio": _finite_or_str(ratio),
        "where": list(result.where) if result.where is not None else None,
        "mismatched": result.mismatched,
        "total": result.total,
        "excused_ties": int(result.stats.get("excused", 0)),
        "note": result.note,
        # where the computation first went wrong (failed entries, live reference)
        "first_divergence": result.stats.get("first_divergence"),
        "message": result.message,
        # the command that reruns just this entry's point (failed and errored records; set by
        # `attach_reruns`, which knows the run's options)
        "rerun": None,
    }


def rerun_command(point: Point, mode: str | None = None, impl: str = "jax", reference: str = "live",
                  precision: str = "highest", timeout: float | None = None, fixtures_dir: str | None = None) -> str:
    """The command line that reruns exactly `point` (in `mode`, when given) with the options
    that change its outcome: the implementation, the reference, the matmul precision, a time
    limit other than the default, and fixtures read from another directory
    (`--fixtures`). `--teachers` is named where the case holds
    more than one teacher (else explicit chunks would run every teacher's point). A sharded
    point (`mesh`) runs only under pytest (the device count is set before JAX starts), so its
    command is the pytest selection of that point."""
    import shlex

    from ..problems.cases import CASES

    if point.mesh is not None:
        prefix = Entry(point, mode or "", "").id.rstrip("-")
        return f"python -m pytest tests/sharded -n 0 -m sharded -k {shlex.quote(prefix)}"
    from ..problems.cases import LONG_CASES, MILLION_CASES

    if point.case in LONG_CASES or point.case in MILLION_CASES:  # a case's points judged together (harness.run.long)
        sample = "long" if point.case in LONG_CASES else "million"
        words = ["csa-parity", "run", "--sample", sample, "--cases", point.case, "--dtypes", point.dtype]
        return " ".join(shlex.quote(w) for w in words + (["--modes", mode] if mode else []))
    words = ["csa-parity", "run", "--cases", point.case, "--dtypes", point.dtype, "--ichunks", str(point.ichunk),
             "--tchunks", str(point.tchunk), "--qchunks", str(point.qchunk)]
    if mode and mode != STAGE_MODE:  # a stage plug-in's entries are not selected by --modes
        words += ["--modes", mode]
    if point.teacher != "joint" or len(CASES[point.case].teachers) > 1:
        words += ["--teachers", point.teacher]
    if point.backend != "xla":  # explicit chunks select XLA points unless the backend is named
        words += ["--backends", point.backend]
    words += ["--impl", impl]
    if reference != "live":
        words += ["--reference", reference]
    if precision != "highest":
        words += ["--precision", precision]
    if timeout is not None:
        words += ["--timeout", f"{timeout:g}"]
    if fixtures_dir:
        words += ["--fixtures", fixtures_dir]
    return " ".join(shlex.quote(w) for w in words)


def failure_text(entry: Entry, results, reference: str = "live", precision: str = "highest",
                 fixtures_dir: str | None = None) -> str:
    """A matrix test's failure message: the message of each failed or errored check of `entry`,
    then the command that reruns its point (the CLI's `rerun:` line)."""
    lines = [r.message for r in results if r.failed]
    command = rerun_command(entry.point, entry.mode, entry.impl, reference, precision, fixtures_dir=fixtures_dir)
    return "\n".join(lines + [RERUN + command])


def record_point(rec: dict) -> Point:
    """The `Point` a record was judged at."""
    return Point(rec["case"], rec["dtype"], rec["ichunk"], rec["tchunk"], rec.get("qchunk", 0),
                 tuple(rec["mesh"]) if rec.get("mesh") else None, rec.get("teacher", "joint"),
                 rec.get("backend", "xla"))


def attach_reruns(records: list[dict], reference: str = "live", precision: str = "highest",
                  timeout: float | None = None, fixtures_dir: str | None = None) -> list[dict]:
    """Set `rerun` on every failed or errored record (in place; returns the records)."""
    for rec in records:
        if _failed(rec):
            rec["rerun"] = rerun_command(record_point(rec), rec["mode"], rec["impl"], reference, precision, timeout,
                                         fixtures_dir)
    return records


def _finite_or_str(x: float):
    return x if math.isfinite(x) else str(x)


def _ratio(rec: dict) -> float:
    r = rec["ratio"]
    return float(r) if not isinstance(r, str) else math.inf


def _failed(rec: dict) -> bool:
    """Failed or errored (a plug-in that raised at the point): either fails the run."""
    return rec["status"] in (FAILED, ERROR)


def _judged(rec: dict) -> bool:
    """Compared numbers (passed, failed or excused): only these have a meaningful ratio."""
    return rec["status"] in (PASSED, FAILED, EXCUSED)


def status_line(summary: dict) -> str:
    """'2210 passed, 0 failed, 12 excused, 0 not provided, 0 not applicable'."""
    return ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in summary["statuses"].items())


# Headroom: the worst ratio per (quantity kind, dtype), kinds as harness.outputs.kind_of names
# them, and how many checks sit above 0.5 (a verdict near 1 is about one rounding from flipping).
HEADROOM_MARK = 0.5


def headroom(records: list[dict]) -> dict:
    """{"worst_ratio": {kind: {dtype: ratio}}, "above_half": n, "above_half_checks": [ids]}
    over the judged checks with a bound (topk and isolation have bound 0: not ratios)."""
    worst: dict[str, dict[str, float]] = {}
    above = []
    for rec in records:
        if not _judged(rec) or not rec["bound"]:
            continue
        kind, r = kind_of(rec["quantity"]), _ratio(rec)
        row = worst.setdefault(kind, {})
        row[rec["dtype"]] = max(row.get(rec["dtype"], 0.0), r)
        if r > HEADROOM_MARK:
            above.append(f"{rec['id']} ({rec['check']}) {r:.3g}")
    return {"worst_ratio": {k: {d: _finite_or_str(v) for d, v in sorted(row.items())} for k, row in worst.items()},
            "above_half": len(above), "above_half_checks": above}


def point_label(rec: dict) -> str:
    """The label of a record's point (harness.points.Point.label)."""
    return record_point(rec).label


def errors_by(records: list[dict]) -> tuple[dict, dict]:
    """({point: {"checks": n, "quantities": [...], "message": the error's line, "rerun": command}},
    {quantity: n}) over the `error` checks: one crash or one raise is one line per point,
    whatever it owned. The message and the rerun command are the point's first error's (a
    point with two different errors shows the first; parity.json has each)."""
    points: dict[str, dict] = {}
    quantities: dict[str, int] = {}
    for r in records:
        if r["status"] != ERROR:
            continue
        row = points.setdefault(point_label(r), {"checks": 0, "quantities": [], "message": r["note"],
                                                 "rerun": r.get("rerun")})
        row["checks"] += 1
        if r["quantity"] not in row["quantities"]:
            row["quantities"].append(r["quantity"])
        quantities[r["quantity"]] = quantities.get(r["quantity"], 0) + 1
    return points, quantities


RERUN = "rerun: "  # what starts the line (terminal) or the clause (parity.md) holding the command


def _error_text(row: dict) -> str:
    qs = row["quantities"]
    names = ", ".join(qs[:4]) + (f", ... ({len(qs)} quantities)" if len(qs) > 4 else "")
    return f"{row['message']} ({row['checks']} check{'s' if row['checks'] != 1 else ''}: {names})"


def _then_rerun(text: str, cmd: str | None) -> str:
    """The terminal form: the command on a line of its own under the message."""
    return text + (f"\n  {RERUN}{cmd}" if cmd else "")


def error_lines(summary: dict) -> list[str]:
    """One entry per point with errors: '<message> (n checks: q1, q2, ...)', then, on a line of
    its own, the command that reruns the point (when the run attached one)."""
    return [_then_rerun(_error_text(row), row.get("rerun")) for row in summary["errors_by_point"].values()]


def failure_lines(records: list[dict]) -> list[str]:
    """One entry per failed check: its message, then (when the run attached one) the command
    that reruns its point on a line of its own."""
    return [_then_rerun(r["message"], r.get("rerun")) for r in records if r["status"] == FAILED]


def summarise(records: list[dict]) -> dict:
    worst_by_dtype: dict[str, float] = {}
    for rec in records:
        if _judged(rec):
            worst_by_dtype[rec["dtype"]] = max(worst_by_dtype.get(rec["dtype"], 0.0), _ratio(rec))
    topk = [r for r in records if r["check"] == "topk"]
    code_ties: dict[str, int] = {}
    for r in records:
        if r["check"] == "oracle" and kind_of(r["quantity"]) == "codes":
            code_ties[r["dtype"]] = code_ties.get(r["dtype"], 0) + r["excused_ties"]
    reasons: dict[str, dict[str, int]] = {NOT_APPLICABLE: {}, NOT_PROVIDED: {}}
    for r in records:
        if r["status"] in reasons:
            reasons[r["status"]][r["note"]] = reasons[r["status"]].get(r["note"], 0) + 1
    statuses = {s: sum(r["status"] == s for r in records) for s in STATUSES}
    by_point, by_quantity = errors_by(records)
    return {
        "entries": len({r["id"] for r in records}),
        "checks": len(records),
        "statuses": statuses,  # every check in exactly one status
        "failed": statuses[FAILED],
        "errors": statuses[ERROR],  # checks whose implementation raised, crashed its worker or timed out
        "errors_by_point": by_point,
        "errors_by_quantity": by_quantity,
        "failed_entries": len({r["id"] for r in records if _failed(r)}),
        # never dropped, never passed: counted, with every id in results and the reasons here
        "not_applicable": statuses[NOT_APPLICABLE],
        "not_applicable_reasons": reasons[NOT_APPLICABLE],
        "not_provided_reasons": reasons[NOT_PROVIDED],
        "headroom": headroom(records),
        "worst_ratio_by_dtype": {k: _finite_or_str(v) for k, v in worst_by_dtype.items()},
        "topk_excused_ties": sum(r["excused_ties"] for r in topk),
        "topk_unexcused": sum(r["mismatched"] for r in topk if _failed(r)),
        "sparse_end_to_end_excused": sum(1 for r in records if r["mode"] == "sparse" and r["check"] == "oracle"
                                         and r["status"] == EXCUSED),
        # The quantizer's codes and scales that differ from the oracle's as boundary ties, per dtype
        # (harness.judging.codes): how often a dtype's rounding crosses a decision boundary.
        "code_excused_ties": code_ties,
    }


def code_ties_text(summary: dict) -> str:
    """'bfloat16 1201, float16 308, float32 0, float64 0'."""
    return ", ".join(f"{d} {n}" for d, n in summary["code_excused_ties"].items())


def table(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Rows case x dtype (the compressed teacher's points in rows of their own, `case
    (compressed)`); columns quantity groups; cells 'ok 0.31' / 'FAIL 4.2' (worst ratio)."""
    cells: dict[tuple[str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        teacher = rec.get("teacher", "joint")
        case = rec["case"] if teacher == "joint" else f"{rec['case']} ({teacher})"
        cells[(case, rec["dtype"])][column_of(rec["quantity"])].append(rec)
    header = ["case", "dtype", *COLUMNS]
    rows = []
    for (case, dtype), cols in cells.items():
        row = [case, dtype]
        for col in COLUMNS:
            recs = cols.get(col)
            if not recs:
                row.append("-")
                continue
            live = [r for r in recs if _judged(r)]
            if not live:  # nothing compared: not provided by the implementation, or not applicable here
                row.append("n/p" if any(r["status"] == NOT_PROVIDED for r in recs) else "n/a")
                continue
            worst = max(_ratio(r) for r in live)
            ok = not any(_failed(r) for r in live)
            row.append(f"{'ok' if ok else 'FAIL'} {worst:.2g}")
        rows.append(row)
    return header, rows


def headroom_table(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Rows: quantity kind; columns: dtype; cells: the worst error/bound ratio."""
    worst = summary["headroom"]["worst_ratio"]
    dtypes = [d for d in ("float32", "bfloat16", "float16", "float64") if any(d in row for row in worst.values())]
    rows = [[kind] + [f"{float(row[d]):.3g}" if d in row else "-" for d in dtypes] for kind, row in worst.items()]
    return ["kind", *dtypes], rows


def format_table(header: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


# The shares of a point's time (harness.sides.timing.SHARES), in the order a point spends them.
TIME_SHARES = ("startup", "trace", "lower", "compile", "run", "reference", "judge")


def cache_line(meta: dict) -> str:
    """`programs: 12 loaded from the compilation cache, 3 compiled; live references: 2 loaded, 0
    computed (cache: DIR)`: what the run's persistent caches served and what it had to compute."""
    cache = meta.get("cache") or {}
    where = f"cache: {cache['dir']}" if cache.get("dir") else "--no-cache: no persistent cache"
    text = (f"programs: {cache.get('programs_loaded', 0)} loaded from the compilation cache, "
            f"{cache.get('programs_compiled', 0)} compiled")
    if cache.get("outputs_loaded"):
        text += f"; jax_impl outputs of {cache['outputs_loaded']} points loaded (unchanged since they were computed)"
    if meta.get("reference") == "live":
        text += (f"; live references: {cache.get('references_loaded', 0)} loaded, "
                 f"{cache.get('references_computed', 0)} computed")
    return f"{text} ({where})"


def time_split(meta: dict) -> dict[str, float]:
    """Each share's seconds summed over the points that reported one (parity.json's
    points.time_split_s)."""
    total = dict.fromkeys(TIME_SHARES, 0.0)
    for split in (meta.get("points", {}).get("by_point") or {}).values():
        for k in TIME_SHARES:
            total[k] += split.get(k, 0.0)
    return {k: round(v, 2) for k, v in total.items()}


def profile_lines(meta: dict, top: int = 5) -> list[str]:
    """The `--profile` summary: each share's seconds summed over the points (worker seconds: the
    workers run side by side, so the sum exceeds the run's wall time) and its part of the whole,
    then the slowest points' own splits."""
    total = time_split(meta)
    whole = sum(total.values()) or 1.0
    header = ["share", "seconds", "part"]
    rows = [[k, f"{v:.1f}", f"{100 * v / whole:.0f}%"] for k, v in total.items()]
    by_point = meta.get("points", {}).get("by_point") or {}
    slowest = sorted(by_point.items(), key=lambda kv: -sum(kv[1].get(k, 0.0) for k in TIME_SHARES))[:top]
    lines = [f"time split over {len(by_point)} points, summed over the workers ({whole:.1f} worker-s in "
             f"{meta.get('wall_s', 0):.1f} s wall):", format_table(header, rows)]
    if slowest:
        lines.append(f"slowest points ({', '.join(TIME_SHARES)}; s):")
        lines += [f"  {label}: " + " ".join(f"{split.get(k, 0.0):.2f}" for k in TIME_SHARES)
                  for label, split in slowest]
    return lines


def _replace_atomically(path: str, write) -> None:
    """`write(f)` into a temporary file beside `path`, then rename it over `path`: a reader (or
    a run killed meanwhile) sees the old file or the new one, never half of one."""
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=os.path.splitext(name)[1], dir=directory or ".")
    try:
        with os.fdopen(fd, "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_reports(records: list[dict], meta: dict, out_dir: str, heatmap_too: bool = True) -> dict[str, str]:
    """Write parity.json, parity.md and (unless `heatmap_too` is False: a running CLI's partial
    report) parity_heatmap.png under out_dir, each atomically; returns their paths. A partial
    report (meta["partial"]) drops the heat map of an earlier run."""
    os.makedirs(out_dir, exist_ok=True)
    summary = summarise(records)
    paths = {
        "json": os.path.join(out_dir, "parity.json"),
        "md": os.path.join(out_dir, "parity.md"),
        "png": os.path.join(out_dir, "parity_heatmap.png"),
    }
    data = {"schema_version": JSON_SCHEMA_VERSION, **meta, "summary": summary, "results": records}
    _replace_atomically(paths["json"], lambda f: json.dump(data, f, indent=1))
    _replace_atomically(paths["md"], lambda f: f.write(markdown(records, meta, summary)))
    if heatmap_too and records:
        fd, tmp = tempfile.mkstemp(prefix=".parity_heatmap.", suffix=".png", dir=out_dir)
        os.close(fd)
        try:
            heatmap(records, tmp, summary)
            os.replace(tmp, paths["png"])
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    elif os.path.exists(paths["png"]):
        os.remove(paths["png"])  # an earlier run's, which these records do not describe
    return paths


def memory_summary(by_point: dict) -> dict:
    """The largest peak resident size of a worker at a point and the largest compiled temp of a
    point's programs (harness.sides.worker.run_points' splits), with the points they were at."""
    out = {}
    for key, name in (("peak_rss_bytes", "peak_rss"), ("compiled_temp_bytes", "compiled_temp")):
        seen = [(split[key], label) for label, split in by_point.items() if split.get(key) is not None]
        top = max(seen, default=(None, None))
        out[f"{name}_bytes"], out[f"{name}_at"] = top
    return out


def memory_line(meta: dict) -> str:
    """`memory: peak worker RSS 1.21 GiB (<point>); largest compiled temp 0.05 GiB (<point>); no
    limit (--max-memory)`."""
    memory = (meta.get("points") or {}).get("memory") or {}

    def at(key: str) -> str:
        size = memory.get(f"{key}_bytes")
        return "not measured" if size is None else f"{size_text(size)} ({memory.get(f'{key}_at')})"

    limit = meta.get("max_memory_bytes")
    return (f"memory: peak worker RSS {at('peak_rss')}; largest compiled temp {at('compiled_temp')}; "
            + ("no limit (--max-memory)" if limit is None else f"limit {size_text(limit)} a worker (--max-memory)"))


def size_text(nbytes: int) -> str:
    """`1.21 GiB`, `12.0 MiB`, `7.7 KiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def run_header(meta: dict) -> str:
    """The line every report opens with (terminal, parity.md): the versions of csa-parity and the
    frameworks, and the fixture set judged against (its directory and MANIFEST.json's sha256)."""
    versions = meta.get("versions") or {}
    fixtures = meta.get("fixtures") or {}
    frameworks = ", ".join(f"{k} {versions.get(k, 'unknown')}" for k in ("jax", "jaxlib", "torch"))
    return (f"csa-parity {versions.get('csa-parity', 'unknown')} ({frameworks}); fixtures {fixtures.get('dir')} "
            f"(MANIFEST.json sha256 {fixtures.get('manifest_sha256') or 'none: no manifest'})")


def device_line(platform: dict) -> str:
    """What a reader compares two reports by: the device, its software, and the tolerances
    applied (harness.run.cli.platform_info)."""
    parts = [f"device: {platform.get('backend')} {platform.get('device_kind')} x{platform.get('device_count')}",
             f"jax {platform.get('jax_version')}, jaxlib {platform.get('jaxlib_version')}"]
    if platform.get("libtpu_version"):
        parts.append(f"libtpu {platform['libtpu_version']}")
    if platform.get("runtime_version") and platform.get("backend") != "cpu":
        parts.append(f"runtime {platform['runtime_version']}")
    cpu = platform.get("cpu")
    if cpu:
        parts.append(f"CPU {cpu.get('model')} ({cpu.get('machine')}; ISA: {', '.join(cpu.get('isa') or []) or 'unknown'}"
                     + (f", emulated by {cpu['flags_from']}" if cpu.get("flags_from") else "") + ")")
        blocked = {n: why for n, why in (cpu.get("isa_variants") or {}).items() if why != "runs"}
        if blocked:  # the fixtures' order errors cover these by the estimates committed for them
            parts.append("ISA variants this CPU does not run: "
                         + "; ".join(f"{n} ({why.split(' (')[0]})" for n, why in blocked.items()))
    if platform.get("torch_cpu_capability"):
        parts.append(f"torch CPU capability {platform['torch_cpu_capability']}")
    kernels = {k: v for k, v in (platform.get("cpu_kernel_variables") or {}).items() if v}
    if kernels:
        parts.append("CPU kernels " + ", ".join(f"{k}={v}" for k, v in kernels.items()))
    tol = platform.get("tolerance") or {}
    if tol:
        profile = tol.get("platform_profile")
        parts.append(f"tolerances: `{tol.get('precision_profile')}` precision profile, "
                     + (f"platform profile `{profile}` (oracle-check factors "
                        + "; ".join(f"{d} " + ", ".join(f"{k} {v:g}" for k, v in row.items())
                                    for d, row in (tol.get("platform_factors") or {}).items()) + ")"
                        if profile else tol.get("note", "no platform profile")))
    return "; ".join(parts)


def markdown(records: list[dict], meta: dict, summary: dict) -> str:
    header, rows = table(records)
    status = "PASS" if summary["failed"] + summary["errors"] == 0 else f"FAIL ({summary['failed_entries']} entries)"
    partial = meta.get("partial")
    if partial:
        status = (f"PARTIAL, {partial['reason']}: {partial['points_run']} of {partial['points_total']} points ran; "
                  f"so far {status}")
    hr_header, hr_rows = headroom_table(summary)
    hr = summary["headroom"]
    na_lines = [f"- {n} checks {reason}" for reason, n in summary["not_applicable_reasons"].items()]
    lines = [
        f"# csa-parity report: {status}",
        "",
        f"- implementation: `{meta.get('impl')}`; reference: `{meta.get('reference')}`; "
        f"platform: {meta.get('platform', {}).get('backend')} ({meta.get('platform', {}).get('device_kind')}); "
        f"matmul precision: {meta.get('platform', {}).get('matmul_precision')}"
        + (f"; Pallas kernels: {meta['platform']['pallas']}" if meta.get("platform", {}).get("pallas") else ""),
        f"- {run_header(meta)}",
        f"- {device_line(meta.get('platform', {}))}",
        f"- {summary['entries']} matrix entries, {summary['checks']} checks: {status_line(summary)}; "
        f"wall time {meta.get('wall_s', 0):.1f} s",
        *([f"- {cache_line(meta)}; time per share, summed over the points (s): "
           + ", ".join(f"{k} {v:.1f}" for k, v in time_split(meta).items())] if "cache" in meta else []),
        *([f"- {memory_line(meta)}"] if "cache" in meta else []),
        f"- top-k: {summary['topk_excused_ties']} set differences excused as boundary ties, "
        f"{summary['topk_unexcused']} unexcused; sparse end-to-end checks excused for tie flips: "
        f"{summary['sparse_end_to_end_excused']}",
        *([f"- quantized codes and scales excused as boundary ties: {code_ties_text(summary)}"]
          if summary["code_excused_ties"] else []),
        "- worst error/bound ratio per dtype: "
        + ", ".join(f"{k} {float(v):.3g}" for k, v in summary["worst_ratio_by_dtype"].items()),
        f"- not applicable on this backend: {summary['not_applicable']} checks (counted apart from "
        "passed and failed; listed in parity.json with their reason)",
        *na_lines,
        *[f"- {n} checks not provided: {reason}" for reason, n in summary["not_provided_reasons"].items()],
        "",
        f"## Headroom: worst error/bound per quantity kind and dtype; {hr['above_half']} checks above "
        f"{HEADROOM_MARK}",
        "",
        format_table(hr_header, hr_rows, markdown=True),
        "",
        *[f"- above {HEADROOM_MARK}: `{c}`" for c in hr["above_half_checks"][:50]],
        "",
        "Cells: `ok`/`FAIL` and the worst ratio error/bound over every judged check of that column "
        "(all chunk sizes and modes). A ratio <= 1 passes; `grad` is the worst of the six parameters; "
        "`n/p`: not provided by the implementation, `n/a`: not applicable on this platform.",
        "",
        format_table(header, rows, markdown=True),
        "",
    ]
    def rerun(cmd):  # the markdown form: a clause at the end of the entry's line
        return f"; {RERUN}`{cmd}`" if cmd else ""

    errors = list(summary["errors_by_point"].values())
    if errors:
        lines += ["## Errors (one line per point: the implementation raised, crashed its worker or timed out)", ""]
        lines += [f"- {_error_text(row)}{rerun(row.get('rerun'))}" for row in errors[:200]] + [""]
    failures = [r for r in records if r["status"] == FAILED]
    if failures:
        lines += ["## Failures", ""] + [f"- `{r['id']}`: {r['message']}{rerun(r.get('rerun'))}" for r in failures[:200]]
        if len(failures) > 200:
            lines.append(f"- ... and {len(failures) - 200} more (parity.json has all)")
    memory = memory_table(meta)
    lines += ([""] if memory and lines[-1] else []) + memory
    lines += ["", "![worst ratio per chunk size and dtype](parity_heatmap.png)", ""]
    return "\n".join(lines)


MEMORY_ROWS = 10  # parity.md's memory table: the points of the largest peaks (parity.json has every point's)


def memory_table(meta: dict) -> list[str]:
    """parity.md's `## Memory` section: the MEMORY_ROWS points of the largest worker peak, with the
    compiled temp of their program; nothing when no point reported a peak."""
    by_point = (meta.get("points") or {}).get("by_point") or {}
    rows = sorted(((split["peak_rss_bytes"], label, split.get("compiled_temp_bytes"))
                   for label, split in by_point.items() if split.get("peak_rss_bytes") is not None), reverse=True)
    if not rows:
        return []
    lines = [f"## Memory: worker peak and compiled temp, the largest {min(len(rows), MEMORY_ROWS)} of {len(rows)} points",
             "",
             "| point | peak worker RSS | compiled temp |", "|---|---:|---:|"]
    lines += [f"| {label} | {size_text(peak)} | {'-' if temp is None else size_text(temp)} |"
              for peak, label, temp in rows[:MEMORY_ROWS]]
    return lines


def heatmap(records: list[dict], path: str, summary: dict | None = None) -> None:
    """Worst error/bound ratio per (chunk sizes x dtype), one panel per quantity column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    dtypes = sorted({r["dtype"] for r in records}, key=["float64", "float32", "bfloat16", "float16"].index)
    chunks = sorted({(r["ichunk"], r["tchunk"], r.get("qchunk", 0)) for r in records})
    labels = [f"i{i}/t{t}" + (f"/q{q}" if q else "") for i, t, q in chunks]
    cols = [c for c in COLUMNS if any(column_of(r["quantity"]) == c for r in records)]
    # Green shades below the bound (ratio <= 1), red above; white: not applicable.
    edges = [0.0, 1e-3, 1e-2, 0.1, 0.5, 1.0, 2.0, 10.0, 1e300]
    cmap = ListedColormap(["#1a9850", "#66bd63", "#a6d96a", "#d9ef8b", "#fee08b", "#f46d43", "#d73027", "#a50026"])
    norm = BoundaryNorm(edges, cmap.N)
    fig, axes = plt.subplots(1, len(cols), figsize=(1.0 + 2.0 * len(cols), 1.6 + 0.3 * len(chunks)),
                             squeeze=False, constrained_layout=True)
    for ax, col in zip(axes[0], cols):
        grid = np.full((len(chunks), len(dtypes)), np.nan)
        for r in records:
            if column_of(r["quantity"]) != col or not _judged(r):
                continue
            i, j = chunks.index((r["ichunk"], r["tchunk"], r.get("qchunk", 0))), dtypes.index(r["dtype"])
            v = min(_ratio(r), 1e300)
            grid[i, j] = v if np.isnan(grid[i, j]) else max(grid[i, j], v)
        im = ax.imshow(grid, norm=norm, cmap=cmap, aspect="auto")
        ax.set_title(col, fontsize=9)
        ax.set_xticks(range(len(dtypes)), [d.replace("float", "f").replace("bf", "bf") for d in dtypes], fontsize=7)
        ax.set_yticks(range(len(chunks)), labels if ax is axes[0][0] else [""] * len(chunks), fontsize=7)
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                text = "0" if v == 0 else ("<.001" if v < 1e-3 else ("inf" if v >= 1e300 else f"{v:.2g}"))
                ax.text(j, i, text, ha="center", va="center", fontsize=6)
    axes[0][0].set_ylabel("indexer chunk / teacher chunk", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.9, ticks=edges[1:-1], label="error / bound")
    title = "csa-parity: worst error/bound per chunk size and dtype (<= 1 passes; white: not applicable)"
    if summary is not None:  # the headroom in the title
        worst = summary["headroom"]["worst_ratio"]
        per_kind = "; ".join(f"{k} " + " ".join(f"{d.replace('float', 'f')} {float(v):.2g}" for d, v in row.items())
                             for k, row in worst.items())
        title += (f"\nheadroom: {summary['headroom']['above_half']} checks > {HEADROOM_MARK}; worst {per_kind}; "
                  f"{summary['not_applicable']} not applicable")
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)

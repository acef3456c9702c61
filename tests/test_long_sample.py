"""The long sample's wiring (SPEC section 11): the streams, the judge and the matrix's records on
a shortened copy of a long case (the full sample takes tens of minutes: docs/matrix.md), and the
command line's refusals."""

import argparse
import json
import re

import pytest

from harness.problems.cases import LONG_CASES
from harness.run import long
from harness.run.cli import main
from harness.run.report import record, rerun_command
from harness.sides import worker


@pytest.mark.torch
def test_the_last_query_block_of_a_long_case_is_judged_past_2_31():
    """long_deep_documents' last query block (rows 129200 .. 131071 of S = 131072, W = 32768): every
    row * W offset past 2^31, a document starting at 129500 inside the block, rows with fewer valid
    blocks than k; both points' forward entries judged block by block against the float64
    reference (4 slices merged), none failed; the loss entries not applicable on sampled rows."""
    from harness.outputs import NOT_APPLICABLE

    case = LONG_CASES["long_deep_documents"]
    results, stages = long.judge_case("long_deep_documents", ("float32",), ("forward", "dense"), query_blocks=(68,))
    assert not [r.message for _, r in results if r.failed]
    by = {(e.point.ichunk, e.quantity, r.check): r for e, r in results if e.mode == "forward"}
    assert set(by) == {(1, "compressed_keys", "oracle"), (1, "compressed_keys", "chunk"), (1, "index_scores", "oracle"),
                       (1, "index_scores", "chunk"), (1, "topk_indices", "topk"), (1, "topk_indices", "chunk-topk"),
                       (1, "topk_indices", "invariants"), (0, "compressed_keys", "oracle"), (0, "index_scores", "oracle"),
                       (0, "topk_indices", "topk"), (0, "topk_indices", "invariants")}
    rows = case.seq_len - 129200
    assert 129200 * case.num_blocks > 2 ** 31
    assert by[(1, "index_scores", "oracle")].total == rows * case.num_blocks
    assert by[(1, "topk_indices", "topk")].total == by[(0, "topk_indices", "invariants")].total == rows
    assert 129200 <= by[(1, "index_scores", "oracle")].where[1] < case.seq_len
    dense = [r for e, r in results if e.mode == "dense"]
    assert dense and all(r.status == NOT_APPLICABLE and "every row" in r.note for r in dense)
    assert set(stages) == {"jax", "oracle", "judge", "rows_walked", "rows_oracle"}
    assert stages["rows_walked"] == stages["rows_oracle"] == rows
    rec = record(results[0][0], results[0][1])
    assert rec["case"] == "long_deep_documents" and rec["qchunk"] == 1900


def test_the_rerun_line_of_a_long_point_names_the_sample():
    point = long.long_points("long_ties_k2048", "bfloat16")[0]
    assert rerun_command(point, "sparse") == ("csa-parity run --sample long --cases long_ties_k2048 --dtypes bfloat16 "
                                              "--modes sparse")


def test_the_rerun_line_of_a_million_point_names_its_sample():
    point, = long.long_points("million_documents", "bfloat16")
    assert (point.ichunk, point.qchunk) == (1, 1000)
    assert rerun_command(point, "forward") == ("csa-parity run --sample million --cases million_documents "
                                               "--dtypes bfloat16 --modes forward")


@pytest.mark.parametrize("sample, argv, words", [
    ("long", ["--cases", "small"], "judges the cases long_deep_documents, long_ties_k2048; not small"),
    ("long", ["--dtypes", "float16"], "judges float32, bfloat16; not float16"),
    ("long", ["--cases", "million_documents"], "not million_documents"),
    ("million", ["--cases", "long_deep_documents"], "judges the cases million_documents; not long_deep_documents"),
    ("million", ["--dtypes", "float32"], "judges bfloat16; not float32")])
def test_the_long_samples_refuse_what_they_do_not_judge(sample, argv, words, capsys, tmp_path):
    assert main(["run", "--sample", sample, "--out", str(tmp_path), *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("case, rows, positions, prefixes", [
    ("packed", 20, "ids", "whole"), ("ragged", 7, "ids", "whole"), ("packed", 20, "ids", "grain 4"),
    ("small", 5, "reversed", "grain 4")])
def test_a_block_of_rows_is_those_rows_of_the_whole_forward(case, rows, positions, prefixes, monkeypatch):
    """`indexer_forward_rows`, the long sample's candidate, on toy problems against the whole
    forward's rows: every block of `rows` rows from 0, so the last one is short (r does not divide
    S), plus blocks starting off the grid, inside a document and on a block edge. The long sample
    judges this function only past S = 131072; here a mistake in its start offset, its short last
    block or its document bookkeeping shows in seconds. At the whole width, bit-identical in float64
    (the same programs' arithmetic on the same rows); on the prefix path, to 1e-13 (below).

    `grain 4`: the causal prefix a block of rows is scored against (api.prefix_blocks) rounded to
    4 blocks, not to W / 16 of at least 8192, so that toy rows take the prefix path (a toy's W is
    one bucket of the default grain); `reversed`: positions that fall with the index, so later
    blocks are visible to early rows and the program must score the whole width."""
    import numpy as np

    from harness.points import Point
    from harness.problems.cases import CASES, make_inputs
    from harness.sides.long_sides import jax_config
    from jax_impl import api

    if prefixes == "grain 4":
        monkeypatch.setattr(api, "PREFIX_MIN_BLOCKS", 4)
        monkeypatch.setattr(api, "PREFIX_BUCKETS", 10 ** 6)
    c = CASES[case]
    inputs, params = make_inputs(c)
    if positions == "reversed":
        inputs = {**inputs, "position_ids": inputs["position_ids"][:, ::-1].copy()}
    cfg = jax_config(c.config_dict(), Point(case, "float64", 0, 0, rows))
    out = api.indexer_forward(params, inputs, cfg, "float64")
    whole, picks = np.asarray(out["index_scores"]), np.asarray(out["topk_indices"])
    S = c.seq_len
    starts = sorted({*range(0, S, rows), 3, S - 1, c.config["compress_ratio"] * 5})
    for start in starts:
        s, k = api.indexer_forward_rows(params, inputs, cfg, "float64", start, rows)
        n = min(rows, S - start)
        assert np.asarray(s).shape[1] == n and np.asarray(k).shape[1] == n
        if prefixes == "whole":
            np.testing.assert_array_equal(np.asarray(s), whole[:, start:start + n], err_msg=f"scores from row {start}")
        else:
            # XLA:CPU's dot of the rows against fewer keys may round differently (measured: 29 of
            # 640 scores of `packed` off by at most 4.4e-16, 2.5e-15 relative): same -inf pattern,
            # same picks, values to 1e-13.
            np.testing.assert_array_equal(np.isinf(np.asarray(s)), np.isinf(whole[:, start:start + n]))
            np.testing.assert_allclose(np.asarray(s), whole[:, start:start + n], rtol=1e-13, atol=1e-13,
                                       err_msg=f"scores from row {start}")
        np.testing.assert_array_equal(np.asarray(k), picks[:, start:start + n], err_msg=f"picks from row {start}")


def test_a_long_case_over_the_memory_limit_is_an_error_with_its_peak():
    """A long case runs in a worker of its own (harness.sides.worker.call_in_worker), its memory read
    as it runs: one that grows past the limit (here 1 GiB, 64 MiB at a time:
    tests/plugins/misbehaving.py:grow_call) is killed and the call raises one line with its peak;
    one that returns gives its result and the worker's peak. About 5 s."""
    with pytest.raises(worker.WorkerCrash) as crash:
        worker.call_in_worker("plugins.misbehaving:grow_call", (), "long case grown", 120.0, 2**30)
    match = re.fullmatch(r"out of memory: peak (\d+\.\d\d) GiB \(limit 1\.00 GiB\) at long case grown", str(crash.value))
    assert match and float(match[1]) >= 1.0, str(crash.value)
    value, peak = worker.call_in_worker("os.path:join", ("a", "b"), "long case small", 120.0, 2**30)
    assert value == "a/b" and 0 < peak < 2**30


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_long_case_that_dies_is_an_error_at_every_entry_and_the_run_goes_on(monkeypatch, tmp_path, capsys, jobs):
    """`csa-parity run --sample long`: the first case's worker runs out of memory; each of its
    entries is an error with that line, the second case is still judged (here: nothing to judge),
    the exit status is 1 and the reports say which case and why. With `--jobs 2` both cases' workers
    run at once (each waits for the other to start: one after the other, the wait would time out)."""
    import threading

    line = "out of memory: peak 9.10 GiB (limit 8.00 GiB) at long case long_deep_documents"
    both = threading.Barrier(jobs, timeout=20)

    def fake(target, args, label, limit_s, max_memory):
        assert target == "harness.run.long:case_records" and limit_s == long.LONG_TIMEOUT_S and max_memory == 8 * 2**30
        both.wait()
        if args[0] == "long_deep_documents":
            raise worker.WorkerCrash(line)
        return ([], {"jax": 1.0, "oracle": 2.0, "judge": 3.0}), 2**30

    monkeypatch.setattr(worker, "call_in_worker", fake)
    args = argparse.Namespace(sample="long", cases=None, dtypes=None, modes=None, timeout=None, max_memory="8GiB",
                              out=str(tmp_path), jobs=jobs)
    assert long.run(args) == 1
    report = json.loads((tmp_path / "parity.json").read_text())
    errors = [r for r in report["results"] if r["status"] == "error"]
    entries = long.case_entries("long_deep_documents", long.LONG_DTYPES, None)
    assert len({r["id"] for r in errors}) == len(entries) and all(r["case"] == "long_deep_documents" for r in errors)
    assert all(line in r["message"] and r["rerun"].startswith("csa-parity run --sample long") for r in errors)
    assert report["long_stages"]["long_deep_documents"]["error"] == line
    assert report["long_stages"]["long_ties_k2048"]["peak_rss_gib"] == 1.0
    out = capsys.readouterr().out
    assert "long_deep_documents: ERROR after" in out and "long_ties_k2048: jax 1.0 s, oracle 2.0 s" in out


def test_the_sampled_rows_hold_every_boundary_and_a_seeded_draw():
    """The million sample's oracle rows (SPEC section 11): the first and the last, both sides of every
    document and query-block boundary, and MILLION_RANDOM_ROWS rows drawn from the case's seed (the
    same rows on every run); `row_slices` cuts their runs at every query-block edge."""
    import numpy as np

    from harness.problems.cases import MILLION_CASES
    from harness.problems.matrix import MILLION_QUERY_BLOCKS, MILLION_RANDOM_ROWS, sampled_rows

    case, r = MILLION_CASES["million_documents"], MILLION_QUERY_BLOCKS["million_documents"]
    rows = sampled_rows(case, r)
    assert np.array_equal(rows, sampled_rows(case, r)) and np.all(np.diff(rows) > 0)
    S = case.seq_len
    edges = np.cumsum(case.documents[0])[:-1]
    must = {0, S - 1, *edges, *(edges - 1), *range(r, S, r), *range(r - 1, S - 1, r)}
    assert must <= set(rows.tolist())
    assert len(must) < len(rows) <= len(must) + MILLION_RANDOM_ROWS
    assert 1048176 in edges and 1048176 // r == (S - 1) // r  # the last document starts in the last query block
    slices = long.row_slices(rows, r, 512)
    assert np.array_equal(np.concatenate([np.arange(s.start, s.stop) for s in slices]), rows)
    assert all(s.start // r == (s.stop - 1) // r and s.stop - s.start <= 512 for s in slices)
    assert long.row_slices(np.array([3, 4, 5, 6, 9]), 5, 512) == [slice(3, 5), slice(5, 7), slice(9, 10)]
    assert long.row_slices(np.arange(7), 100, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]


@pytest.mark.torch
def test_the_invariants_of_the_picks_catch_each_kind_of_wrong_pick():
    """harness.judging.invariants on the reference's own picks of a packed toy (float64): they pass,
    and the visible counts equal the rule applied to every (row, block) pair; then one row made wrong
    in each way a pick can be wrong without any score: out of range, a block of the row's future,
    a block of another document, a block picked twice, a -1 where a visible block was left out, a
    hidden block in place of a row's -1 (it sees fewer than k). Each fails at that row, and the
    stream merges."""
    import numpy as np

    from harness.judging.invariants import PicksStream, block_facts
    from harness.problems.cases import CASES, make_inputs
    from harness.sides import long_sides

    case = CASES["packed"]
    inputs, params = make_inputs(case)
    m, S, W = case.config["compress_ratio"], case.seq_len, case.num_blocks
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    facts = block_facts(pos, seg, m)
    first = pos[:, ::m][:, :W]
    uniform = np.all(seg[:, :W * m].reshape(-1, W, m) == seg[:, :W * m:m][..., None], -1)
    rule = (first[:, None, :] + m <= pos[:, :, None] + 1) & uniform[:, None, :] & (seg[:, :W * m:m][:, None, :] == seg[:, :, None])
    assert np.array_equal(facts.visible, rule.sum(-1))
    picks = np.concatenate([p for _, _, p in long_sides.reference_forward(params, inputs, case.config_dict(), "float64",
                                                                           [slice(0, S)])], axis=1)
    k = picks.shape[-1]

    def judged(p):
        return PicksStream(facts, k).add(p, pos, seg).result()

    assert judged(picks).passed and judged(picks).total == case.batch * S
    full = [(b, s) for b in range(case.batch) for s in range(S) if facts.visible[b, s] >= k]
    short = [(b, s) for b in range(case.batch) for s in range(S) if 0 < facts.visible[b, s] < k]
    assert full and short
    b, s, future = next((b, s, j) for b, s in full for j in range(W)
                        if uniform[b, j] and seg[b, j * m] == seg[b, s] and not rule[b, s, j])
    other = next(j for j in range(W) if uniform[b, j] and seg[b, j * m] != seg[b, s])
    bs, ss = short[-1]
    hidden = next(j for j in range(W) if not rule[bs, ss, j])
    wrong = {"outside": (b, s, 0, W, "outside [-1, W="), "future": (b, s, 0, future, "is not visible"),
             "other document": (b, s, 0, other, "is not visible"), "twice": (b, s, 1, picks[b, s, 0], "picked twice"),
             "-1 left": (b, s, 0, -1, "picks other than -1, where the row sees"),
             "hidden for a -1": (bs, ss, k - 1, hidden, "is not visible")}
    for what, (b_, s_, i, value, words) in wrong.items():
        bad = picks.copy()
        bad[b_, s_, i] = value
        res = judged(bad)
        assert res.failed and res.mismatched == 1 and res.where == (b_, s_), (what, res.message)
        assert words in res.message, (what, res.message)
    half = PicksStream(facts, k).add(picks[:, :10], pos[:, :10], seg[:, :10])
    half.merge(PicksStream(facts, k).add(bad[:, 10:], pos[:, 10:], seg[:, 10:], (0, 10)))
    assert half.result().where == (bs, ss) and half.result().total == case.batch * S


@pytest.mark.torch
def test_the_million_sample_judges_sampled_rows_and_every_rows_picks():
    """The million sample's path (`judge_case` with `rows`) on a copy of million_documents shortened to
    S = 4096 (five documents, the last of 400 tokens inside the last query block): the candidate
    walks every row (the invariants over 4096 rows), the oracle judges the sampled rows only, the
    forward entries pass, the loss entries are not applicable and say why. A few seconds."""
    import dataclasses

    from harness.outputs import NOT_APPLICABLE
    from harness.problems.cases import MILLION_CASES
    from harness.problems.matrix import sampled_rows

    short = dataclasses.replace(MILLION_CASES["million_documents"], seq_len=4096,
                                documents=((2048, 1024, 300, 324, 400),))
    rows = sampled_rows(short, 1000, 64)
    results, stages = long.judge_case("million_documents", ("bfloat16",), case=short, rows=rows, log=lambda line: None)
    assert not [r.message for _, r in results if r.failed]
    assert stages["rows_walked"] == 4096 and stages["rows_oracle"] == len(rows) < 4096
    by = {(e.quantity, r.check): r for e, r in results if e.mode == "forward"}
    assert by[("topk_indices", "invariants")].total == 4096
    assert by[("topk_indices", "topk")].total == len(rows)
    assert by[("index_scores", "oracle")].total == len(rows) * short.num_blocks
    assert not any(r.check.startswith("chunk") for r in by.values())  # no native point at a million
    losses = [r for e, r in results if e.mode != "forward"]
    assert losses and all(r.status == NOT_APPLICABLE and "every row" in r.note and f"{len(rows)} of the 4096 rows"
                          in r.note for r in losses)

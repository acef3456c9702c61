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
                       (0, "compressed_keys", "oracle"), (0, "index_scores", "oracle"), (0, "topk_indices", "topk")}
    rows = case.seq_len - 129200
    assert 129200 * case.num_blocks > 2 ** 31
    assert by[(1, "index_scores", "oracle")].total == rows * case.num_blocks
    assert by[(1, "topk_indices", "topk")].total == rows
    assert 129200 <= by[(1, "index_scores", "oracle")].where[1] < case.seq_len
    dense = [r for e, r in results if e.mode == "dense"]
    assert dense and all(r.status == NOT_APPLICABLE and "every row" in r.note for r in dense)
    assert set(stages) == {"jax", "oracle", "judge"}
    rec = record(results[0][0], results[0][1])
    assert rec["case"] == "long_deep_documents" and rec["qchunk"] == 1900


def test_the_rerun_line_of_a_long_point_names_the_sample():
    point = long.long_points("long_ties_k2048", "bfloat16")[0]
    assert rerun_command(point, "sparse") == ("csa-parity run --sample long --cases long_ties_k2048 --dtypes bfloat16 "
                                              "--modes sparse")


@pytest.mark.parametrize("argv, words", [(["--cases", "small"], "judges the long cases"),
                                         (["--dtypes", "float16"], "judges float32, bfloat16")])
def test_the_long_sample_refuses_what_it_does_not_judge(argv, words, capsys, tmp_path):
    assert main(["run", "--sample", "long", "--out", str(tmp_path), *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("case, rows", [("packed", 20), ("ragged", 7)])
def test_a_block_of_rows_is_those_rows_of_the_whole_forward(case, rows):
    """`indexer_forward_rows`, the long sample's candidate, on toy problems against the whole
    forward's rows: every block of `rows` rows from 0, so the last one is short (r does not divide
    S), plus blocks starting off the grid, inside a document and on a block edge. The long sample
    judges this function only past S = 131072; here a mistake in its start offset, its short last
    block or its document bookkeeping shows in seconds. Bit-identical in float64 (the same
    programs' arithmetic on the same rows)."""
    import numpy as np

    from harness.points import Point
    from harness.problems.cases import CASES, make_inputs
    from harness.sides.long_sides import jax_config
    from jax_impl import api

    c = CASES[case]
    inputs, params = make_inputs(c)
    cfg = jax_config(c.config_dict(), Point(case, "float64", 0, 0, rows))
    out = api.indexer_forward(params, inputs, cfg, "float64")
    whole, picks = np.asarray(out["index_scores"]), np.asarray(out["topk_indices"])
    S = c.seq_len
    starts = sorted({*range(0, S, rows), 3, S - 1, c.config["compress_ratio"] * 5})
    for start in starts:
        s, k = api.indexer_forward_rows(params, inputs, cfg, "float64", start, rows)
        n = min(rows, S - start)
        assert np.asarray(s).shape[1] == n and np.asarray(k).shape[1] == n
        np.testing.assert_array_equal(np.asarray(s), whole[:, start:start + n], err_msg=f"scores from row {start}")
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


def test_a_long_case_that_dies_is_an_error_at_every_entry_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    """`csa-parity run --sample long`: the first case's worker runs out of memory; each of its
    entries is an error with that line, the second case is still judged (here: nothing to judge),
    the exit status is 1 and the reports say which case and why."""
    line = "out of memory: peak 9.10 GiB (limit 8.00 GiB) at long case long_deep_documents"

    def fake(target, args, label, limit_s, max_memory):
        assert target == "harness.run.long:case_records" and limit_s == long.LONG_TIMEOUT_S and max_memory == 8 * 2**30
        if args[0] == "long_deep_documents":
            raise worker.WorkerCrash(line)
        return ([], {"jax": 1.0, "oracle": 2.0, "judge": 3.0}), 2**30

    monkeypatch.setattr(worker, "call_in_worker", fake)
    args = argparse.Namespace(cases=None, dtypes=None, modes=None, timeout=None, max_memory="8GiB", out=str(tmp_path))
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

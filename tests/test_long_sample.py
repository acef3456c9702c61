"""The long sample's wiring (SPEC section 11): the streams, the judge and the matrix's records on
a shortened copy of a long case (the full sample takes tens of minutes: docs/matrix.md), and the
command line's refusals."""

import pytest

from harness.problems.cases import LONG_CASES
from harness.run import long
from harness.run.cli import main
from harness.run.report import record, rerun_command


@pytest.mark.torch
def test_the_last_query_block_of_a_long_case_is_judged_past_2_31():
    """long_deep_documents' last query block (rows 129000 .. 131071 of S = 131072, W = 32768): every
    row * W offset past 2^31, a document starting at 129500 inside the block, rows with fewer valid
    blocks than k; both points' forward entries judged block by block against the float64
    reference (5 slices merged), none failed; the loss entries not applicable on sampled rows."""
    from harness.outputs import NOT_APPLICABLE

    case = LONG_CASES["long_deep_documents"]
    results, stages = long.judge_case("long_deep_documents", ("float32",), ("forward", "dense"), query_blocks=(43,))
    assert not [r.message for _, r in results if r.failed]
    by = {(e.point.ichunk, e.quantity, r.check): r for e, r in results if e.mode == "forward"}
    assert set(by) == {(1, "compressed_keys", "oracle"), (1, "compressed_keys", "chunk"), (1, "index_scores", "oracle"),
                       (1, "index_scores", "chunk"), (1, "topk_indices", "topk"), (1, "topk_indices", "chunk-topk"),
                       (0, "compressed_keys", "oracle"), (0, "index_scores", "oracle"), (0, "topk_indices", "topk")}
    rows = case.seq_len - 129000
    assert 129000 * case.num_blocks > 2 ** 31
    assert by[(1, "index_scores", "oracle")].total == rows * case.num_blocks
    assert by[(1, "topk_indices", "topk")].total == rows
    assert 129000 <= by[(1, "index_scores", "oracle")].where[1] < case.seq_len
    dense = [r for e, r in results if e.mode == "dense"]
    assert dense and all(r.status == NOT_APPLICABLE and "every row" in r.note for r in dense)
    assert set(stages) == {"jax", "oracle", "judge"}
    rec = record(results[0][0], results[0][1])
    assert rec["case"] == "long_deep_documents" and rec["qchunk"] == 3000


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

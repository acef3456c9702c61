"""Unit tests of the comparators on hand-built arrays: each must pass what is right and
fail what is wrong, and say so in assert_close's words."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.judging import tolerance
from harness.judging.compare import compare_close, exactly_zero, normalised_error, oracle_relative, topk_sets


def _scores():
    # 1 batch, 2 queries, 6 blocks; query 1 cannot see blocks 4, 5.
    s = np.array([[[0.9, 0.5, 0.4, 0.1, 0.3, 0.2],
                   [0.8, 0.7, 0.30, 0.3 + 1e-9, -np.inf, -np.inf]]])
    return s


def test_topk_identical_sets_in_any_order_pass():
    oracle = np.array([[[0, 1, 2], [0, 1, 3]]])
    cand = np.array([[[2, 0, 1], [3, 1, 0]]])
    r = topk_sets("topk_indices", cand, oracle, _scores(), 1e-6)
    assert r.passed and r.stats["excused"] == 0


def test_topk_boundary_tie_is_excused_and_counted():
    oracle = np.array([[[0, 1, 2], [0, 1, 3]]])
    cand = np.array([[[0, 1, 2], [0, 1, 2]]])  # picks block 2 (0.30) instead of 3 (0.30 + 1e-9)
    r = topk_sets("topk_indices", cand, oracle, _scores(), 1e-6)
    assert r.passed and r.stats["excused"] == 1 and "1 boundary-tie differences excused" in r.note


def test_topk_off_by_one_swap_that_is_not_a_tie_fails():
    oracle = np.array([[[0, 1, 2], [0, 1, 3]]])
    cand = np.array([[[0, 1, 3], [0, 1, 3]]])  # block 3 (0.1) for block 2 (0.4): 0.3 apart
    r = topk_sets("topk_indices", cand, oracle, _scores(), 1e-6)
    assert not r.passed and r.mismatched == 1 and r.where == (0, 0)
    assert "candidate picks [0, 1, 3], oracle picks [0, 1, 2]" in r.message


def test_topk_invalid_pick_instead_of_minus_one_fails():
    scores = np.array([[[0.5, -np.inf, -np.inf]]])
    r = topk_sets("topk_indices", np.array([[[0, 1]]]), np.array([[[0, -1]]]), scores, 1e9)
    assert not r.passed


def test_nan_anywhere_fails_even_with_a_huge_bound():
    ref = np.ones((3, 4))
    x = ref.copy()
    x[1, 2] = np.nan
    r = compare_close("oracle", "grad.indexer.wkv", x, ref, 1e9)
    assert not r.passed and r.where == (1, 2) and "NaN in the candidate" in r.message


def test_changed_minus_inf_pattern_fails():
    ref = _scores()
    x = ref.copy()
    x[0, 1, 4] = 0.0  # a block the query must not see became visible
    r = compare_close("oracle", "index_scores", x, ref, 1e9, scale="row")
    assert not r.passed and r.where == (0, 1, 4) and "-inf pattern differs" in r.message


def test_gradient_five_percent_off_fails_the_oracle_rule():
    rng = np.random.default_rng(0)
    oracle = rng.standard_normal((16, 8))
    torch_t = oracle * (1 + 1e-3 * rng.standard_normal(oracle.shape))  # bf16-like noise
    good = oracle * (1 + 1e-3 * rng.standard_normal(oracle.shape))
    bad = oracle * 1.05
    kw = dict(alpha=tolerance.ALPHA["grad"], floor=tolerance.floor("bfloat16", "grad.x"))
    assert oracle_relative("grad.x", good, oracle, torch_t, **kw).passed
    r = oracle_relative("grad.x", bad, oracle, torch_t, **kw)
    assert not r.passed and r.ratio > 1
    assert "Mismatched" not in r.message and "mismatched elements:" in r.message
    assert "up to" in r.message and "torch-at-dtype error" in r.message


def test_message_reads_like_assert_close_with_context():
    ref = np.zeros((2, 3))
    ref[0, 0] = 1.0
    x = ref.copy()
    x[1, 2] = 0.12
    r = compare_close("chunk", "grad.indexer.wq_b", x, ref, 1e-5).with_context("small bfloat16 ichunk=2 tchunk=0 dense")
    assert r.message.startswith("[small bfloat16 ichunk=2 tchunk=0 dense] grad.indexer.wq_b (chunk): MISMATCH: ")
    assert "mismatched elements: 1 / 6 (16.7%)" in r.message
    assert "greatest normalised difference: 0.12 at index (1, 2) (up to 1e-05 allowed" in r.message


def test_scores_are_normalised_per_row():
    ref = np.array([[100.0, 50.0], [1.0, 0.5]])
    x = ref + np.array([[0.0, 0.0], [0.0, 0.01]])
    err, where, _ = normalised_error(x, ref, "row")
    assert err == pytest.approx(0.01) and where == (1, 1)
    assert normalised_error(x, ref, "tensor")[0] == pytest.approx(1e-4)


def test_scalar_loss_is_relative():
    assert normalised_error(np.float64(2.0 + 2e-6), np.float64(2.0))[0] == pytest.approx(1e-6)


def test_isolation_requires_exact_zero():
    assert exactly_zero("input_grads", {"q_latent": np.zeros((2, 3))}).passed
    r = exactly_zero("input_grads", {"q_latent": np.zeros((2, 3)), "hidden_states": np.full((2, 2), 1e-30)})
    assert not r.passed and r.mismatched == 4 and "hidden_states" in r.note


def test_zero_bound_ratio_is_inf_on_any_error():
    r = exactly_zero("input_grads", {"x": np.array([1e-30])})
    assert math.isinf(r.ratio)


def test_default_precision_profile_only_raises_float32_floors():
    for backend in ("cpu", "gpu", "tpu"):
        for dtype in ("bfloat16", "float16"):
            for q in ("index_scores", "loss", "grad.indexer.wkv"):
                assert tolerance.floor(dtype, q, "default", backend) == tolerance.floor(dtype, q, "highest", backend)
    for q in ("index_scores", "loss", "grad.indexer.wkv"):
        # TPU: one bfloat16 pass, so float32 floors rise to bfloat16's; CPU ignores the setting
        assert tolerance.floor("float32", q, "default", "tpu") == tolerance.floor("bfloat16", q)
        assert tolerance.floor("float32", q, "default", "cpu") == tolerance.floor("float32", q, "highest")
        assert tolerance.floor("float32", q, "highest") <= tolerance.floor("float32", q, "default", "gpu")
    with pytest.raises(ValueError, match="profile='fast' is not supported"):
        tolerance.floor("float32", "loss", "fast")


def test_a_check_result_takes_only_the_known_statuses():
    from harness.judging.compare import CheckResult

    with pytest.raises(ValueError, match=r"^CheckResult status=True is not one of passed, failed, excused, "
                                         r"not_provided, not_applicable"):
        CheckResult("oracle", "loss", True, 0.0, 1.0)


@pytest.mark.parametrize("plant", ["none", "worst", "nan", "inf"])
def test_a_close_stream_over_row_blocks_is_the_whole_comparison(plant):
    """SPEC section 11: merging row blocks is exact (the worst and where, the counts, the first
    NaN or -inf mismatch), for any cut of the rows and any merge order."""
    from harness.judging.compare import CloseStream

    rng = np.random.default_rng(7)
    ref = rng.standard_normal((2, 37, 11))
    ref[0, 3, 5:] = -np.inf
    x = ref + rng.standard_normal(ref.shape) * 1e-6
    if plant == "worst":
        x[1, 30, 2] += 1e-3
        x[0, 20, 1] += 1e-3 * np.max(np.abs(ref[0, 20])) / np.max(np.abs(ref[1, 30]))
    elif plant == "nan":
        x[1, 12, 4] = x[0, 33, 0] = np.nan
    elif plant == "inf":
        x[0, 3, 6] = 0.5
        x[1, 36, 1] = -np.inf
    whole = compare_close("oracle", "index_scores", x, ref, 1e-5, "row")
    for cut in (1, 5, 36):
        parts = [CloseStream("row", 1e-5).add(x[:, s:s + cut], ref[:, s:s + cut], (0, s)) for s in range(0, 37, cut)]
        merged = CloseStream("row", 1e-5)
        for p in parts[::-1]:
            merged.merge(p)
        assert merged.result("oracle", "index_scores", 1e-5) == whole


@pytest.mark.parametrize("plant", ["none", "worst", "nan", "pos_inf", "finite_in_dead", "all_dead", "equal"])
def test_a_close_stream_compares_only_the_live_columns_with_the_same_result(plant, monkeypatch):
    """A masked score block at length is mostly -inf on both sides: the stream compares the columns
    between the first and the last that hold anything but -inf (`_live_columns`), and its result
    (the worst and where, the counts, the ledger, the first NaN or -inf mismatch) is the one of the
    whole block compared element by element, float32 candidate against float64 reference."""
    from harness.judging import compare

    rng = np.random.default_rng(11)
    ref = np.full((1, 9, 40), -np.inf)
    ref[0, :, 12:20] = rng.standard_normal((9, 8))
    ref[0, 2, 12:15] = -np.inf
    x = (ref + rng.standard_normal(ref.shape) * 1e-6).astype(np.float32)
    if plant == "worst":
        x[0, 7, 18] += 1e-2
    elif plant == "nan":
        x[0, 4, 30] = np.nan
    elif plant == "pos_inf":
        x[0, 1, 35] = np.inf
    elif plant == "finite_in_dead":
        x[0, 8, 3] = 0.25
    elif plant == "all_dead":
        ref[:] = -np.inf
        x[:] = -np.inf
    elif plant == "equal":
        x = ref.astype(np.float32).astype(np.float64)
        ref = x.copy()

    def run():
        stream = compare.CloseStream("row", 1e-5).add(x, ref, (0, 100))
        return vars(stream) | {"ledger": np.sort(np.concatenate(stream.ledger or [np.zeros(0)]))}, stream.result(
            "oracle", "index_scores", 1e-5)

    cropped = run()
    monkeypatch.setattr(compare, "_live_columns", lambda x, ref: None)
    whole = run()
    assert cropped[1] == whole[1]
    for k, v in whole[0].items():
        assert np.array_equal(cropped[0][k], v) if k == "ledger" else cropped[0][k] == v, k


def test_a_topk_stream_judges_with_a_tolerance_given_at_the_end():
    from harness.judging.compare import TopkStream

    scores = _scores()
    oracle = np.array([[[0, 1, 2], [0, 1, 3]]])
    cand = np.array([[[0, 1, 3], [0, 1, 2]]])  # row 0: not a tie; row 1: a tie within 1e-9
    whole = topk_sets("topk_indices", cand, oracle, scores, 1e-6)
    stream = TopkStream().add(cand[:, 1:], oracle[:, 1:], scores[:, 1:], (0, 1))
    stream.merge(TopkStream().add(cand[:, :1], oracle[:, :1], scores[:, :1]))
    assert stream.result("topk_indices", lambda row_max: 1e-6) == whole
    assert whole.status == "failed" and whole.where == (0, 0) and whole.stats["excused"] == 1

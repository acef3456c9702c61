"""Near-tie inputs: the tie-aware top-k comparison (harness.judging.compare.topk_sets) must
excuse only true boundary ties, in bfloat16 and float32, and a planted off-by-one selection
beside a tie must still fail. Each test reports how many ties it excused (printed, and as the
JUnit property `excused_ties`).

Generators: harness/problems/near_ties.py (hand-built score rows; whole inputs with twin blocks that
differ in the last float32 bits, ReLU-zero query rows and equal head weights).
"""

from __future__ import annotations

import numpy as np
import pytest

import jax_impl
import torch_ref
from harness.judging.compare import to_numpy, topk_sets
from harness.judging.judge import score_tolerance
from harness.problems.near_ties import (boundary_tie_scores, near_tie_problem, plant_beside_tie, plant_off_by_one,
                                        true_ties_only)

DTYPES = ("bfloat16", "float32")


def _report(request, label: str, excused: int, rows: int) -> None:
    request.node.user_properties.append(("excused_ties", excused))
    print(f"{label}: {excused} boundary ties excused over {rows} query rows")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_boundary_ties_are_excused_and_only_they(dtype, seed, request):
    nt = boundary_tie_scores(dtype, seed)
    r = topk_sets("topk_indices", nt.candidate_picks, nt.oracle_picks, nt.oracle_scores, nt.tol)
    rows = int(np.prod(nt.candidate_picks.shape[:-1]))
    _report(request, f"hand-built {dtype} seed {seed}", r.stats["excused"], rows)
    assert r.passed, r.message
    # The generator did make the two sides disagree, in rows the comparator had to excuse,
    # and every difference it excused is a true tie (checked independently, by brute force).
    assert r.stats["excused"] >= 5
    assert not np.array_equal(np.sort(nt.candidate_picks, -1), np.sort(nt.oracle_picks, -1))
    assert true_ties_only(nt.candidate_picks, nt.oracle_picks, nt.oracle_scores, nt.tol)
    assert nt.relu_zero_rows >= 2


@pytest.mark.parametrize("kind", ["near_miss", "winner_out"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_planted_off_by_one_beside_a_tie_fails(dtype, kind):
    nt = boundary_tie_scores(dtype, seed=3)
    picks, (b, s) = plant_off_by_one(nt, kind)
    assert not true_ties_only(picks, nt.oracle_picks, nt.oracle_scores, nt.tol)
    r = topk_sets("topk_indices", picks, nt.oracle_picks, nt.oracle_scores, nt.tol)
    assert not r.passed and r.where == (b, s), r.message
    assert r.mismatched >= 1 and "candidate picks" in r.message


def test_a_near_miss_just_beyond_the_tolerance_is_not_a_tie():
    """Scores 1.01 tolerances apart are not tied; 0.99 apart are."""
    scores = np.array([[[4.0, 2.0, 1.0, 0.5]]])
    tol = np.array([[0.1]])
    oracle = np.array([[[0, 1, 2]]])
    for gap, ok in ((0.99, True), (1.01, False)):
        s = scores.copy()
        s[0, 0, 3] = 1.0 - gap * 0.1
        r = topk_sets("topk_indices", np.array([[[0, 1, 3]]]), oracle, s, tol)
        assert r.passed is ok, (gap, r.message)


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_tie_problem_end_to_end(dtype, request):
    """Both implementations at the dtype on inputs full of boundary ties, judged against the
    float64 oracle with the harness's tolerance (harness.judging.judge.score_tolerance): ties are
    excused (and counted), only true ties, and a planted off-by-one beside one fails."""
    params, inputs, cfg = near_tie_problem(seed=0)
    ref = {}
    for dt in ("float64", dtype):
        out = torch_ref.indexer_forward(params, inputs, torch_ref.CSAConfig.from_dict(cfg), dt)
        ref[dt] = {k: to_numpy(v) for k, v in out.items()}
    out = jax_impl.indexer_forward(params, inputs, jax_impl.CSAConfig.from_dict(cfg), dtype)
    cand = to_numpy(out["topk_indices"])
    oracle, scores = ref["float64"]["topk_indices"], ref["float64"]["index_scores"]
    tol = score_tolerance(ref["float64"]["index_scores"], ref[dtype]["index_scores"], dtype)
    total = 0
    for side, picks in (("jax", cand), ("torch", ref[dtype]["topk_indices"])):
        r = topk_sets("topk_indices", picks, oracle, scores, tol)
        _report(request, f"near-tie problem {dtype} {side}", r.stats["excused"], int(np.prod(picks.shape[:-1])))
        assert r.passed, r.message
        assert true_ties_only(picks, oracle, scores, tol)
        total += r.stats["excused"]
    assert total >= 5, "the near-tie inputs produced too few boundary ties to test anything"
    # ReLU-zero rows: every valid score exactly 0 on both sides.
    row = scores[0, 5]
    assert np.all(row[np.isfinite(row)] == 0.0) and np.isfinite(row).any()
    planted, where = plant_beside_tie(cand, oracle, scores, tol)
    r = topk_sets("topk_indices", planted, oracle, scores, tol)
    assert not r.passed and r.where == tuple(int(i) for i in where), r.message

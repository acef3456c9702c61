"""The judge's rules at their boundaries (SPEC section 10), on outputs made by hand.

Each test pins one rule of harness/judging/judge.py, harness/judging/compare.py and harness/judging/tolerance.py: an
error at 0.9x the bound the rule gives must pass and one at 1.1x must fail, for every kind of
check (oracle, exact64, chunk, oracle@sel, chunk@sel, topk, chunk-topk, isolation, stage). The
bound each test expects is computed here from SPEC section 10, not asked of the harness: alpha
and the exact64 bound are SPEC's numbers (below), the per-dtype floors and the chunk bounds are
read from harness/judging/tolerance.py's tables (data), and the sqrt(n) floors are derived here from
the problem's sizes. So a rule that goes soft (a bound multiplied, a scale taken over the wrong
axis, a NaN ignored, a tie excused too widely) fails the test named after it, and the failure
message names the rule. docs/judging.md lists every rule with its test and the harness mutant
(harness/selftest/judge_mutations.py) that proves the test can fail.

Pure numpy: no JAX program, no torch (the CLI test replaces the worker pool, the platform
probe and the heat map's drawing; nothing of the judging, the summary or parity.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.judging import tolerance
from harness.judging.compare import CheckResult, status_result
from harness.judging.judge import judge, stage_checks
from harness.judging.tolerance import Policy
from harness.outputs import ERROR, EXCUSED, FAILED, PASSED, STAGE_MODE, STATUSES, Outputs, References
from harness.points import Entry, Point
from harness.run import collect as collect_module
from harness.run import report as report_module
from harness.run.report import markdown, record, summarise
from harness.sides import worker as worker_module

# SPEC section 10: alpha 2 for forward values (and the scalar loss), 3 for gradients; float64
# against float64 to 1e-12 relative. Here, not read from harness.judging.tolerance: a change of these
# is a change of the SPEC.
ALPHA = {"forward": 2.0, "loss": 2.0, "grad": 3.0}
EXACT64 = 1e-12
WIDE_U = 2.0**-24  # float32's unit roundoff: the reductions are carried in float32
BELOW, ABOVE = 0.9, 1.1


# --------------------------------------------------------------------------- hand-made outputs


def _rng(seed=0):
    return np.random.default_rng(seed)


def _scores(rng, row_scales=(1.0, 1.0, 1.0, 1.0)):
    """index_scores [B=1, S=4, W=6] (ReLU scores: >= 0), row s scaled by row_scales[s]; query 1
    cannot see the last two blocks (-inf)."""
    s = rng.uniform(0.2, 1.0, (1, 4, 6)) * np.asarray(row_scales)[None, :, None]
    s[0, 1, 4:] = -np.inf
    return s


# quantity -> (mode, canonical name, kind, scale, value maker)
QUANTITIES = {
    "compressed_keys": ("forward", "compressed_keys", "forward", "tensor", lambda r: r.standard_normal((2, 6, 4))),
    "index_scores": ("forward", "index_scores", "forward", "row", _scores),
    "loss": ("dense", "loss.dense", "loss", "tensor", lambda r: np.float64(0.7316)),
    "grad.indexer.wq_b": ("dense", "grad.dense.indexer.wq_b", "grad", "tensor", lambda r: r.standard_normal((8, 5))),
}


def _first(value):
    return tuple(0 for _ in np.shape(value))


def _last(value):
    return tuple(n - 1 for n in np.shape(value))


def _bump(ref, err, at=None, scale="tensor"):
    """`ref` with the element at `at` (default: the last) moved so that its normalised error
    (SPEC section 10: |x - ref| / max |ref| over the tensor, or over the query's row for
    scores; relative for a scalar) is exactly `err`."""
    ref = np.asarray(ref, np.float64)
    if ref.ndim == 0:
        return np.float64(ref * (1.0 + err))
    at = _last(ref) if at is None else at
    mag = np.where(np.isfinite(ref), np.abs(ref), 0.0)
    denom = mag[at[:-1]].max() if scale == "row" else mag.max()
    out = ref.copy()
    out[at] += err * denom
    return out


def _entry(quantity, dtype="bfloat16", mode=None, **knobs):
    return Entry(Point("tiny", dtype, **knobs), mode or QUANTITIES[quantity][0], quantity)


def _only(results, check):
    found = [r for r in results if r.check == check]
    assert len(found) == 1, f"expected one {check!r} result, got {[r.check for r in results]}"
    return found[0]


def _assert_boundary(rule, run, bound, at_bound=(PASSED, FAILED)):
    """`run(f)` judges an error of f times the rule's bound: 0.9x must give at_bound[0] (pass),
    1.1x at_bound[1] (fail); when the result has a numeric bound it must be `bound`."""
    below, above = run(BELOW), run(ABOVE)
    assert below.status == at_bound[0], (
        f"rule {rule!r}: an error at {BELOW}x the bound ({bound:.4g}) must be {at_bound[0]}, got {below.status}: "
        f"{below.message}")
    assert above.status == at_bound[1], (
        f"rule {rule!r} went soft: an error at {ABOVE}x the bound ({bound:.4g}) must be {at_bound[1]}, got "
        f"{above.status}: {above.message}")
    if above.bound:
        assert above.bound == pytest.approx(bound, rel=1e-9), (
            f"rule {rule!r}: bound {above.bound:.6g}, SPEC section 10 gives {bound:.6g}: {above.message}")


# --------------------------------------------------------------------------- oracle and exact64


@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_oracle_bound_is_alpha_times_the_reference_error_at_dtype(quantity):
    """oracle: err(X@t) <= alpha * max(err(reference@t), floor[t]); here the reference's error
    (0.05, far above the bfloat16 floors) decides."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng())
    t_err = 0.05
    torch_t = _bump(oracle, t_err, _first(oracle), scale)
    bound = ALPHA[kind] * t_err

    def run(f):
        cand = Outputs("hand-made", {name: _bump(oracle, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@bf16", {name: torch_t}))
        return _only(judge(_entry(quantity), cand, refs), "oracle")

    _assert_boundary(f"oracle: alpha[{kind}] * err(reference@t) ({quantity})", run, bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_oracle_floor_when_the_reference_is_exact(quantity, dtype):
    """oracle: a reference whose rounding happened to be exact (err 0) leaves the floor of the
    entry's dtype: bound alpha * FLOOR[t][kind] (harness.judging.tolerance.FLOOR), never 0."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(1))
    bound = ALPHA[kind] * tolerance.FLOOR[dtype][kind]

    def run(f):
        cand = Outputs("hand-made", {name: _bump(oracle, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: oracle}))
        return _only(judge(_entry(quantity, dtype), cand, refs), "oracle")

    _assert_boundary(f"oracle floor: alpha * FLOOR[{dtype}][{kind}] ({quantity})", run, bound)


@pytest.mark.parametrize("quantity", ["index_scores", "loss", "grad.indexer.wq_b"])
def test_oracle_baseline_is_at_least_the_stored_order_error(quantity):
    """oracle: err(reference@t) is the larger of the stored order error (the worst of K
    evaluation orders) and the error of the run at hand, both ways round."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(2))
    for t_err, order_error in ((0.002, 0.04), (0.04, 0.002)):
        torch_t = _bump(oracle, t_err, _first(oracle), scale)
        bound = ALPHA[kind] * max(t_err, order_error)

        def run(f):
            cand = Outputs("hand-made", {name: _bump(oracle, f * bound, scale=scale)})
            refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@bf16", {name: torch_t}),
                              order_errors={name: order_error})
            return _only(judge(_entry(quantity), cand, refs), "oracle")

        _assert_boundary(f"oracle: err(reference@t) = max(order error {order_error}, this run {t_err})", run, bound)


# n of each floor that scales with its reduction, from SPEC-level definitions of the sums:
# a score sums HI*DI products of a query (projected over R) and a key (projected over E); a
# compressed key projects over E, pools 2m slots and normalises over DI; every gradient sums
# the B*S*W (query, block) terms of the loss.
DIMS = {"B": 2, "S": 16, "W": 8, "HI": 8, "DI": 32, "R": 64, "E": 96, "m": 4}
REDUCTION = {"index_scores": DIMS["HI"] * DIMS["DI"] + DIMS["R"] + DIMS["E"],
             "compressed_keys": DIMS["E"] + 2 * DIMS["m"] + DIMS["DI"],
             "grad.indexer.wq_b": DIMS["B"] * DIMS["S"] * DIMS["W"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantity", ["index_scores", "compressed_keys", "grad.indexer.wq_b", "loss"])
def test_oracle_floor_scales_with_sqrt_n(quantity, dtype):
    """oracle floor: at least sqrt(n) float32 unit roundoffs for a sum of n terms (float32:
    above the per-dtype floor; bfloat16: below it, the per-dtype floor stays); the loss floor
    does not scale."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(3))
    n = REDUCTION.get(quantity)
    floor = max(tolerance.FLOOR[dtype][kind], math.sqrt(n) * WIDE_U if n else 0.0)
    if dtype == "float32" and n:
        assert floor == math.sqrt(n) * WIDE_U  # the sqrt(n) floor is the one this case pins
    bound = ALPHA[kind] * floor

    def run(f):
        cand = Outputs("hand-made", {name: _bump(oracle, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: oracle}), dims=DIMS)
        return _only(judge(_entry(quantity, dtype), cand, refs), "oracle")

    _assert_boundary(f"oracle floor: sqrt(n) * 2^-24, n = {n} ({quantity}, {dtype})", run, bound)


@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_exact64_bound_is_1e_12_whatever_the_reference_error(quantity):
    """exact64: float64 against the float64 oracle to 1e-12, even when the reference handed in
    at float64 differs from the oracle (its error never widens the bound)."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(4))

    def run(f):
        cand = Outputs("hand-made", {name: _bump(oracle, f * EXACT64, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}),
                          Outputs("torch@f64", {name: _bump(oracle, 1e-3, _first(oracle), scale)}))
        return _only(judge(_entry(quantity, "float64"), cand, refs), "exact64")

    _assert_boundary(f"exact64: 1e-12 ({quantity})", run, EXACT64)


# --------------------------------------------------------------------------- chunk


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_chunk_bound_is_the_tight_chunk_table_against_native(quantity, dtype):
    """chunk: chunked X@t against X@t native (not against the oracle), to CHUNK[t][kind]."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(5))
    native = _bump(oracle, 2e-3, _first(oracle), scale)  # native differs from the oracle by far more
    torch_t = _bump(oracle, 0.05, _first(oracle), scale)  # the oracle check passes either way
    bound = tolerance.CHUNK[dtype][kind]

    def run(f):
        cand = Outputs("hand-made", {name: _bump(native, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: torch_t}),
                          native=Outputs("native", {name: native}))
        results = judge(_entry(quantity, dtype, ichunk=1), cand, refs)
        assert _only(results, "oracle").status == PASSED
        return _only(results, "chunk")

    _assert_boundary(f"chunk: CHUNK[{dtype}][{kind}] against native ({quantity})", run, bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantity", ["loss", "grad.indexer.wq_b"])
def test_a_long_problems_float32_chunk_bound_is_at_least_the_float32_references_error(quantity, dtype):
    """chunk at length: on a long problem (References.chunk_at_length, the long samples), where the
    float32 reference at the dtype is `floor` from the oracle, a float32 entry's chunk bound is the
    larger of alpha times it and CHUNK[t][kind], the note says so; a bfloat16 entry keeps
    CHUNK[t][kind]; a floor below CHUNK changes nothing. Dense and sparse (chunk@sel and end to
    end) alike."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    table = tolerance.CHUNK[dtype][kind]
    for floor in (4 * tolerance.CHUNK["bfloat16"][kind], 0.1 * table):
        bound = max(table, ALPHA[kind] * floor) if dtype == "float32" else table
        oracle = make(_rng(8))
        native = _bump(oracle, 1e-3, _first(oracle), scale)
        torch_t = _bump(oracle, floor, _first(oracle), scale)

        def run(f):
            cand = Outputs("hand-made", {name: _bump(native, f * bound, scale=scale)})
            refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: torch_t}),
                              native=Outputs("native", {name: native}), chunk_at_length=True)
            res = _only(judge(_entry(quantity, dtype, ichunk=1), cand, refs), "chunk")
            assert ("own error on this problem" in res.message) == (bound > table), (
                f"rule 'chunk at length': the note names the float32 reference's error exactly where it sets the "
                f"bound ({bound:.4g}, CHUNK {table:.4g}): {res.message}")
            return res

        _assert_boundary(f"chunk at length: max(CHUNK[{dtype}][{kind}], alpha x float32 error {floor:.3g})", run,
                         bound)

    sparse_name = {"loss": "loss.sparse", "grad.indexer.wq_b": "grad.sparse.indexer.wq_b"}[quantity]
    floor = 4 * tolerance.CHUNK["bfloat16"][kind]
    bound = max(table, ALPHA[kind] * floor) if dtype == "float32" else table
    scores, oracle, own, at_sel = _sparse_problem(_rng(9), quantity)
    for f, want in ((BELOW, PASSED), (ABOVE, FAILED)):
        native = _bump(oracle, 1e-3, _first(oracle))
        refs = References(
            Outputs("oracle", {"index_scores": scores, "topk_indices": SPARSE_PICKS, own: oracle}),
            Outputs("torch@t", {"index_scores": scores, at_sel: _bump(oracle, floor, _first(oracle))}),
            native=Outputs("native", {"topk_indices": SPARSE_PICKS, own: native, at_sel: native}),
            chunk_at_length=True)
        cand = Outputs("c", {"topk_indices": SPARSE_PICKS, own: _bump(native, f * bound),
                             at_sel: _bump(native, f * bound)})
        results = judge(_entry(quantity, dtype, mode="sparse", ichunk=1), cand, refs)
        for check in ("chunk@sel", "chunk"):
            assert _only(results, check).status == want, (
                f"rule 'chunk at length' ({check}, {sparse_name}): an error at {f}x the bound ({bound:.4g}) must be "
                f"{want}: {_only(results, check).message}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_a_pallas_point_is_judged_against_the_xla_path_at_the_backend_bound(quantity, dtype):
    """xla: the pallas backend's X@t against the XLA path at the same knobs (refs.native), to
    BACKEND[t][kind], named `xla` (no `chunk` result)."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(6))
    xla = _bump(oracle, 2e-3, _first(oracle), scale)
    torch_t = _bump(oracle, 0.05, _first(oracle), scale)
    bound = tolerance.BACKEND[dtype][kind]

    def run(f):
        cand = Outputs("hand-made", {name: _bump(xla, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: torch_t}),
                          native=Outputs("xla", {name: xla}))
        results = judge(_entry(quantity, dtype, backend="pallas"), cand, refs)
        assert not [r for r in results if r.check.startswith("chunk")]
        return _only(results, "xla")

    _assert_boundary(f"xla: BACKEND[{dtype}][{kind}] against the XLA path ({quantity})", run, bound)


@pytest.mark.parametrize("quantity", ["index_scores", "loss", "grad.indexer.wq_b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_xla_check_is_not_applicable_where_the_precision_rounds_the_xla_paths_float32(dtype, quantity):
    """On a TPU at `default`, the XLA path's float32 products take one bfloat16 pass, the kernels'
    HIGHEST (float32 operands) or two bfloat16 terms (the backward's float32 cotangent against
    bfloat16 queries and keys): the `xla` checks of a float32 pallas point, and of a bfloat16
    point's gradients, are not applicable there (named, with the reason), its oracle check still
    judged. A bfloat16 point's forward and loss (bfloat16 products, exact on both) keep the
    check, and at `highest` (or on a CPU at either precision) every point is judged as ever."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(6))
    xla = _bump(oracle, 2e-3, _first(oracle), scale)
    cand = Outputs("hand-made", {name: _bump(xla, 10 * tolerance.BACKEND[dtype][kind], scale=scale)})
    refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: _bump(oracle, 0.05, scale=scale)}),
                      native=Outputs("xla", {name: xla}))
    entry = _entry(quantity, dtype, backend="pallas")
    for policy in (Policy("highest", "tpu"), Policy("default", "cpu"), Policy("highest", "cpu")):
        assert _only(judge(entry, cand, refs, policy), "xla").status == FAILED, policy
    results = judge(entry, cand, refs, Policy("default", "tpu"))
    assert _only(results, "oracle").status == PASSED
    got = _only(results, "xla")
    if dtype == "float32" or kind == "grad":
        assert got.status == "not_applicable" and "7 mantissa bits" in got.message, got.message
    else:
        assert got.status == FAILED
    xla_entry = _entry(quantity, dtype, ichunk=2)
    assert not any(r.status == "not_applicable" for r in judge(xla_entry, cand, refs, Policy("default", "tpu")))


@pytest.mark.parametrize("case", ["packed", "quant_planted"])
def test_every_entry_kind_of_a_pallas_point_answers_whether_its_xla_check_applies(case):
    """Every entry of a pallas point (top-k, isolation and codes included, which have no
    numeric tolerance) gets an answer, not an error: at `default` on a TPU the xla check leaves
    every float32 entry and a bfloat16 point's gradients, nothing else; at `highest` none."""
    from harness.problems.matrix import entries_at

    for dtype in ("float32", "bfloat16"):
        for e in entries_at(Point(case, dtype, backend="pallas")):
            why = Policy("default", "tpu").backend_check_not_applicable(dtype, e.kind)
            assert bool(why) == (dtype == "float32" or e.kind == "grad"), (dtype, e.quantity, why)
            assert Policy("highest", "tpu").backend_check_not_applicable(dtype, e.kind) is None


# --------------------------------------------------------------------------- per-row scale of scores


ROWS = (100.0, 100.0, 0.01, 100.0)  # query 2's scores are 10^4 times smaller than the others'
SMALL_ROW = (0, 2, 3)


def test_scores_are_judged_per_query_row_oracle():
    """Per-row scale: the whole error in a small query row, beside large rows, is judged
    against that row's largest score (a whole-tensor scale would hide it 10^4 times)."""
    oracle = _scores(_rng(6), ROWS)
    t_err = 0.01
    torch_t = _bump(oracle, t_err, (0, 0, 0), "row")  # the reference's error in a large row
    bound = ALPHA["forward"] * t_err

    def run(f):
        cand = Outputs("hand-made", {"index_scores": _bump(oracle, f * bound, SMALL_ROW, "row")})
        refs = References(Outputs("oracle", {"index_scores": oracle}), Outputs("torch@bf16", {"index_scores": torch_t}))
        return _only(judge(_entry("index_scores"), cand, refs), "oracle")

    _assert_boundary("per-row scale of scores (oracle)", run, bound)


def test_scores_are_judged_per_query_row_chunk():
    oracle = _scores(_rng(7), ROWS)
    native = _bump(oracle, 1e-3, (0, 0, 0), "row")
    bound = tolerance.CHUNK["float32"]["forward"]

    def run(f):
        cand = Outputs("hand-made", {"index_scores": _bump(native, f * bound, SMALL_ROW, "row")})
        refs = References(Outputs("oracle", {"index_scores": oracle}),
                          Outputs("torch@f32", {"index_scores": _bump(oracle, 0.05, (0, 0, 0), "row")}),
                          native=Outputs("native", {"index_scores": native}))
        return _only(judge(_entry("index_scores", "float32", ichunk=1), cand, refs), "chunk")

    _assert_boundary("per-row scale of scores (chunk)", run, bound)


def test_a_small_rows_reference_error_counts_per_row():
    """Per-row scale of the baseline: the reference's own error, sitting in the small row, is
    err(reference@t) at full size (normalised per row too), so an equally good candidate passes."""
    oracle = _scores(_rng(8), ROWS)
    t_err = 0.01
    torch_t = _bump(oracle, t_err, (0, 2, 0), "row")
    bound = ALPHA["forward"] * t_err

    def run(f):
        cand = Outputs("hand-made", {"index_scores": _bump(oracle, f * bound, SMALL_ROW, "row")})
        refs = References(Outputs("oracle", {"index_scores": oracle}), Outputs("torch@bf16", {"index_scores": torch_t}))
        return _only(judge(_entry("index_scores"), cand, refs), "oracle")

    _assert_boundary("per-row scale of the reference error", run, bound)


# --------------------------------------------------------------------------- NaN and -inf


def _nan_at_last(value):
    x = np.array(value, np.float64, copy=True)
    if x.ndim == 0:
        return np.float64(np.nan)
    x[_last(x)] = np.nan
    return x


NAN_CASES = {  # check -> (entry knobs, quantity)
    "oracle": ("bfloat16", {}, "grad.indexer.wq_b"),
    "exact64": ("float64", {}, "compressed_keys"),
    "chunk": ("float32", {"ichunk": 1}, "loss"),
}


@pytest.mark.parametrize("check", list(NAN_CASES))
def test_nan_in_the_candidate_fails_whatever_the_bound(check):
    """NaN anywhere fails (SPEC section 10), even where the bound is huge."""
    dtype, knobs, quantity = NAN_CASES[check]
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(9))
    torch_t = _bump(oracle, 1e6, _first(oracle), scale)  # a bound of millions
    refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: torch_t}),
                      native=Outputs("native", {name: oracle}) if knobs else None)
    r = _only(judge(_entry(quantity, dtype, **knobs), Outputs("hand-made", {name: _nan_at_last(oracle)}), refs), check)
    assert r.status == FAILED and "NaN in the candidate" in r.message, f"rule 'NaN fails' ({check}): {r.message}"


def test_nan_in_the_reference_fails():
    oracle = np.ones((3, 4))
    refs = References(Outputs("oracle", {"compressed_keys": _nan_at_last(oracle)}),
                      Outputs("torch@bf16", {"compressed_keys": oracle * 1.5}))
    r = _only(judge(_entry("compressed_keys"), Outputs("c", {"compressed_keys": oracle}), refs), "oracle")
    assert r.status == FAILED and "NaN in the reference" in r.message, f"rule 'NaN fails': {r.message}"


def test_a_changed_minus_inf_pattern_fails_whatever_the_bound():
    """-inf entries (masked blocks) must coincide exactly: a masked block made visible fails."""
    oracle = _scores(_rng(10))
    cand = oracle.copy()
    cand[0, 1, 5] = 0.5
    refs = References(Outputs("oracle", {"index_scores": oracle}),
                      Outputs("torch@bf16", {"index_scores": _bump(oracle, 1e6, (0, 0, 0), "row")}))
    r = _only(judge(_entry("index_scores"), Outputs("c", {"index_scores": cand}), refs), "oracle")
    assert r.status == FAILED and "-inf pattern differs" in r.message, f"rule '-inf pattern exact': {r.message}"


# --------------------------------------------------------------------------- top-k: the tie window

# Query rows of [B=1, S=3, W=6] scores at three magnitudes; k = 2. Block 1 is each row's k-th
# pick (score 6), block 2 a candidate for the swap (6 - d), block 0 the top (10).
TOPK_ROWS = (1000.0, 1000.0, 0.001)
TOPK_BASE = np.array([10.0, 6.0, 5.0, 3.0, 1.0, 0.5])
ORACLE_PICKS = np.array([[[0, 1], [1, 0], [0, 1]]])
T_ERR = 0.01  # the reference's scores at bfloat16 are off by this (row-normalised)


def _topk_problem(gap_rows, gap_in_tol):
    """Oracle scores with block 2 of the rows in `gap_rows` set `gap_in_tol` tie windows below
    the k-th score; the window of a row is alpha * err(reference@t) * max |oracle row|."""
    scores = np.stack([TOPK_BASE * s for s in TOPK_ROWS])[None]
    tol = ALPHA["forward"] * T_ERR * scores.max(axis=-1)  # [1, 3]
    for q in gap_rows:
        scores[0, q, 2] = scores[0, q, 1] - gap_in_tol * tol[0, q]
    torch_t = _bump(scores, T_ERR, (0, 0, 3), "row")
    return scores, torch_t, tol


def _swap(picks, q, new):
    out = picks.copy()
    out[0, q] = new
    return out


@pytest.mark.parametrize("query", [0, 2], ids=["large-row", "small-row"])
def test_topk_tie_window_is_the_score_bound_of_the_row(query):
    """topk: a pick differing from the oracle's is excused only when it and the pick it replaced
    both lie within alpha * err(reference@t) * max |row| of the k-th score (per query row: the
    small row's window is 10^6 times narrower); a swap just outside the window fails."""
    def run(f):
        scores, torch_t, tol = _topk_problem([query], f)
        cand = Outputs("c", {"topk_indices": _swap(ORACLE_PICKS, query, [0, 2])})
        refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                          Outputs("torch@bf16", {"index_scores": torch_t}))
        return _only(judge(_entry("topk_indices", mode="forward"), cand, refs), "topk")

    _assert_boundary(f"topk tie window (query {query})", run, 0.0, at_bound=(EXCUSED, FAILED))


def test_topk_replaced_pick_far_above_the_kth_is_never_a_tie():
    """topk: both sides of a swap must be near the k-th score: dropping the top block (far
    above) for one inside the window fails."""
    scores, torch_t, tol = _topk_problem([0], 0.5)
    cand = Outputs("c", {"topk_indices": _swap(ORACLE_PICKS, 0, [1, 2])})  # drops block 0 (10 vs 6)
    refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                      Outputs("torch@bf16", {"index_scores": torch_t}))
    r = _only(judge(_entry("topk_indices", mode="forward"), cand, refs), "topk")
    assert r.status == FAILED, f"rule 'topk: the replaced pick must be a tie too': {r.message}"


def test_topk_identical_sets_in_another_order_pass():
    scores, torch_t, _ = _topk_problem([], 0)
    refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                      Outputs("torch@bf16", {"index_scores": torch_t}))
    r = _only(judge(_entry("topk_indices", mode="forward"), Outputs("c", {"topk_indices": ORACLE_PICKS[..., ::-1]}),
                    refs), "topk")
    assert r.status == PASSED, f"rule 'topk: sets per query': {r.message}"


def test_chunk_topk_compares_against_native_with_the_oracles_window():
    """chunk-topk: chunked picks against native picks (not the oracle's), ties by the oracle's
    window; a candidate equal to the oracle but not to native fails."""
    def run(f):
        scores, torch_t, _ = _topk_problem([2], f)
        refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                          Outputs("torch@bf16", {"index_scores": torch_t}),
                          native=Outputs("native", {"topk_indices": ORACLE_PICKS}))
        cand = Outputs("c", {"topk_indices": _swap(ORACLE_PICKS, 2, [0, 2])})
        return _only(judge(_entry("topk_indices", mode="forward", ichunk=1), cand, refs), "chunk-topk")

    _assert_boundary("chunk-topk tie window", run, 0.0, at_bound=(EXCUSED, FAILED))
    scores, torch_t, _ = _topk_problem([], 0)
    native = _swap(ORACLE_PICKS, 0, [0, 3])  # native picks a non-tie block; the candidate does not
    refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                      Outputs("torch@bf16", {"index_scores": torch_t}),
                      native=Outputs("native", {"topk_indices": native}))
    r = _only(judge(_entry("topk_indices", mode="forward", ichunk=1), Outputs("c", {"topk_indices": ORACLE_PICKS}),
                    refs), "chunk-topk")
    assert r.status == FAILED, f"rule 'chunk-topk is against native': {r.message}"


# --------------------------------------------------------------------------- platform profiles

PROFILE_FACTOR = 4.0
ON_A_DEVICE = Policy("highest", "tpu", tuple((d, k, PROFILE_FACTOR) for d in ("float32", "bfloat16", "float16")
                                             for k in ("forward", "loss", "grad")), "a-device")


@pytest.mark.parametrize("quantity", ["compressed_keys", "loss", "grad.indexer.wq_b"])
def test_a_platform_profile_multiplies_the_oracle_bound_and_not_the_chunk_bound(quantity):
    """platform profile (harness/platforms.py): on a device with a measured profile the oracle
    bound is factor * alpha * max(err(reference@t), floor), and the check's note names the
    profile; the chunk check against native keeps CHUNK[t][kind]."""
    mode, name, kind, scale, make = QUANTITIES[quantity]
    oracle = make(_rng(3))
    t_err = 0.05
    torch_t = _bump(oracle, t_err, _first(oracle), scale)
    bound = PROFILE_FACTOR * ALPHA[kind] * t_err

    def run(f):
        cand = Outputs("hand-made", {name: _bump(oracle, f * bound, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@bf16", {name: torch_t}))
        return _only(judge(_entry(quantity), cand, refs, ON_A_DEVICE), "oracle")

    _assert_boundary(f"platform profile: factor * alpha[{kind}] * err(reference@t) ({quantity})", run, bound)
    assert "platform factor 4 (a-device)" in run(ABOVE).note
    native = _bump(oracle, 1e-3, _first(oracle), scale)
    chunk = tolerance.chunk_bound("bfloat16", quantity)

    def run_chunk(f):
        cand = Outputs("hand-made", {name: _bump(native, f * chunk, scale=scale)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@bf16", {name: torch_t}),
                          native=Outputs("native", {name: native}))
        return _only(judge(_entry(quantity, ichunk=1), cand, refs, ON_A_DEVICE), "chunk")

    _assert_boundary(f"platform profile leaves the chunk bound ({quantity})", run_chunk, chunk)


def test_a_platform_profile_widens_the_oracle_tie_window_and_not_chunk_topks():
    """platform profile: the oracle top-k's tie window is factor times as wide; chunk-topk,
    which compares the device with itself, keeps the CPU's window."""
    def run(f, check):
        scores, torch_t, _ = _topk_problem([2], f * PROFILE_FACTOR if check == "topk" else f)
        refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": ORACLE_PICKS}),
                          Outputs("torch@bf16", {"index_scores": torch_t}),
                          native=Outputs("native", {"topk_indices": ORACLE_PICKS}))
        cand = Outputs("c", {"topk_indices": _swap(ORACLE_PICKS, 2, [0, 2])})
        return _only(judge(_entry("topk_indices", mode="forward", ichunk=1), cand, refs, ON_A_DEVICE), check)

    _assert_boundary("platform profile: the oracle tie window x factor", lambda f: run(f, "topk"), 0.0,
                     at_bound=(EXCUSED, FAILED))
    _assert_boundary("platform profile leaves the chunk-topk window", lambda f: run(f, "chunk-topk"), 0.0,
                     at_bound=(EXCUSED, FAILED))


# Three CPU-kernel variants' estimates of three order errors (harness.ISA_VARIANTS), each variant the
# largest somewhere and the pinned kernels the smallest of one: a join keeping any other differs.
VARIANT_ESTIMATES = {
    "pinned": {"golden.float32.orderr.loss.dense": 3e-7, "golden.bfloat16.orderr.index_scores": 2e-3,
               "golden.float16.orderr.compressed_keys": 1e-4},
    "aten-default": {"golden.float32.orderr.loss.dense": 9e-7, "golden.bfloat16.orderr.index_scores": 1e-3,
                     "golden.float16.orderr.compressed_keys": 2e-4},
    "aten-avx512": {"golden.float32.orderr.loss.dense": 1e-7, "golden.bfloat16.orderr.index_scores": 5e-3,
                    "golden.float16.orderr.compressed_keys": 3e-4},
}
AVX2_ONLY_FLAGS = frozenset("sse4_2 avx avx2 fma f16c".split())


def test_the_order_errors_join_over_cpu_variants_keeps_the_largest():
    """order-error baseline: the stored order error the oracle bound rests on is the LARGEST of
    the estimates of the CPU kernels a user may compute with (harness.run.regenerate.join_order_errors),
    in any order of the variants; also on a CPU that runs only some of them (an AVX2-only one:
    aten-avx512 cannot run there, harness.platforms.isa_variant_blockers), where the committed
    estimate of the variant it cannot measure joins what it measured."""
    from harness import ISA_VARIANTS
    from harness.platforms import isa_variant_blockers
    from harness.run.regenerate import join_order_errors

    largest = {"golden.float32.orderr.loss.dense": 9e-7, "golden.bfloat16.orderr.index_scores": 5e-3,
               "golden.float16.orderr.compressed_keys": 3e-4}
    assert join_order_errors(VARIANT_ESTIMATES) == largest, "rule 'the join keeps the largest estimate'"
    assert join_order_errors(dict(reversed(list(VARIANT_ESTIMATES.items())))) == largest
    assert join_order_errors({"pinned": VARIANT_ESTIMATES["pinned"]}) == VARIANT_ESTIMATES["pinned"]
    blocked = isa_variant_blockers(AVX2_ONLY_FLAGS, "an AVX2-only CPU",
                                   variants={n: ISA_VARIANTS[n] for n in VARIANT_ESTIMATES})
    assert set(blocked) == {"aten-avx512"}, blocked
    measured = {n: v for n, v in VARIANT_ESTIMATES.items() if n not in blocked}
    carried = {n: VARIANT_ESTIMATES[n] for n in blocked}
    joined = join_order_errors({**measured, **carried})
    assert joined == largest, "rule 'the join keeps the largest estimate, the carried ones included'"
    assert join_order_errors(measured)["golden.bfloat16.orderr.index_scores"] < joined[
        "golden.bfloat16.orderr.index_scores"]  # aten-avx512's, which this CPU could not measure, decides


def _stored_profile_policies():
    """A Policy per (stored platform profile, matmul precision) under harness/profiles/, as the
    CLI builds it on that device (harness.platforms.load_profile, oracle_factors)."""
    import glob
    import json
    import os

    from harness import platforms

    out = []
    for path in sorted(glob.glob(os.path.join(platforms.PROFILES_DIR, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        profile = platforms.load_profile(data["backend"], data["device_kind"])
        for precision in profile["factors"]:
            factors = platforms.oracle_factors(profile, precision)
            out.append(Policy(precision, data["backend"], tuple((d, k, v) for d, row in factors.items()
                                                                 for k, v in row.items()),
                              os.path.basename(path)))
    return out


PROFILED = _stored_profile_policies()
# Every comparison of a device with itself (SPEC section 10): a chunked point against its native
# run, a sharded point against one device, the Pallas kernels against the XLA path.
SELF_COMPARISONS = {"chunk": {"ichunk": 1}, "sharded": {"mesh": (1, 2, 1)}, "xla": {"backend": "pallas"}}


@pytest.mark.parametrize("how", list(SELF_COMPARISONS))
@pytest.mark.parametrize("policy", PROFILED, ids=lambda p: f"{p.platform_profile}-{p.profile}")
def test_no_platform_profile_factor_reaches_a_self_comparison(policy, how):
    """platform profile: the stored profiles (up to 974x an oracle bound) multiply the oracle
    checks only. Under each, with its device's policy as the CLI loads it, every self-comparison
    (chunk, sharded, xla) of every dtype and kind keeps the CPU's bound, CHUNK[t][kind] or
    BACKEND[t][kind]: 0.9x passes and 1.1x fails (an xla check that precision makes not
    applicable is left out, and at least one of each is judged)."""
    assert max(f for _, _, f in policy.platform_factors) > ABOVE / BELOW, "a profile whose factors show nothing"
    judged = 0
    for dtype in ("float32", "bfloat16", "float16"):
        for quantity in QUANTITIES:
            mode, name, kind, scale, make = QUANTITIES[quantity]
            entry = _entry(quantity, dtype, **SELF_COMPARISONS[how])
            if how == "xla" and policy.backend_check_not_applicable(dtype, kind):
                continue
            oracle = make(_rng(5))
            native = _bump(oracle, 1e-3, _first(oracle), scale)
            table = tolerance.backend_bound if how == "xla" else tolerance.chunk_bound
            bound = table(dtype, quantity if quantity != "loss" else name)
            check = "xla" if how == "xla" else "chunk"

            def run(f):
                cand = Outputs("hand-made", {name: _bump(native, f * bound, scale=scale)})
                refs = References(Outputs("oracle", {name: oracle}), Outputs("torch@t", {name: native}),
                                  native=Outputs("native", {name: native}))
                return _only(judge(entry, cand, refs, policy), check)

            _assert_boundary(f"{policy.platform_profile} at {policy.profile} leaves the {how} bound "
                             f"({dtype} {quantity}, oracle factor {policy.oracle_factor(dtype, name):g})", run, bound)
            judged += 1
    assert judged, f"no {how} check judged under {policy.platform_profile} at {policy.profile}"


# --------------------------------------------------------------------------- isolation


def test_isolation_is_exactly_zero():
    """isolation: d loss / d inputs exactly 0: the smallest subnormal fails, -0.0 passes."""
    entry = _entry("input_grads", "float32", mode="dense")
    zeros = {f"input_grad.dense.{n}": np.zeros((1, 4, 3)) for n in ("hidden_states", "q_latent")}
    empty = References(Outputs("oracle"), Outputs("torch@f32"))
    [ok] = judge(entry, Outputs("c", {**zeros, "input_grad.dense.q_latent": -np.zeros((1, 4, 3))}), empty)
    assert ok.status == PASSED, f"rule 'isolation exactly 0': {ok.message}"
    tiny = np.zeros((1, 4, 3))
    tiny[0, 2, 1] = 5e-324
    [bad] = judge(entry, Outputs("c", {**zeros, "input_grad.dense.hidden_states": tiny}), empty)
    assert bad.status == FAILED and bad.where == (0, 2, 1), f"rule 'isolation exactly 0': {bad.message}"
    nan = np.zeros((1, 4, 3))
    nan[0, 0, 0] = np.nan
    [bad] = judge(entry, Outputs("c", {**zeros, "input_grad.dense.q_latent": nan}), empty)
    assert bad.status == FAILED, f"rule 'isolation: NaN is not 0': {bad.message}"


# --------------------------------------------------------------------------- sparse: @sel and end to end

SPARSE_PICKS = np.array([[[0, 1], [1, 0], [0, 1], [2, 3]]])  # over _scores' [1, 4, 6]


def _sparse_problem(rng, quantity):
    """The oracle's scores (each query's top 2, SPARSE_PICKS, clear of the rest), the oracle's
    sparse value of `quantity` and the quantity's two sparse names (own selection, oracle's)."""
    scores = _scores(rng)
    scores[0, 0, :2] = [2.0, 1.9]
    scores[0, 1, :2] = [1.9, 2.0]
    scores[0, 2, :2] = [2.0, 1.9]
    scores[0, 3, 2:4] = [2.0, 1.9]
    value = QUANTITIES[quantity][4](rng) if quantity != "loss" else np.float64(0.4071)
    own, at_sel = ("loss.sparse", "loss.sparse_at_oracle") if quantity == "loss" else \
        (f"grad.sparse.{quantity[5:]}", f"grad.sparse_at_oracle.{quantity[5:]}")
    return scores, value, own, at_sel


SPARSE_T_ERR = 1e-3


def _sparse_judge(quantity, cand_own, cand_sel, native_own=None, native_sel=None, cand_picks=None, native_picks=None,
                  gap=None, seed=11):
    """The results of a float32 sparse entry (chunked when `native_own` is given): the oracle's
    own run (its selection is the selection), the reference at t off by SPARSE_T_ERR on the
    oracle's selection, and the candidate's and native's values made from the oracle's by the
    functions given; picks default to the oracle's sets (the candidate's in reverse order).
    `gap`: query 3's block 4 set `gap` tie windows (alpha * SPARSE_T_ERR * max |row|) below its
    k-th score."""
    scores, oracle, own, at_sel = _sparse_problem(_rng(seed), quantity)
    if gap is not None:
        scores[0, 3, 4] = scores[0, 3, 3] - gap * ALPHA["forward"] * SPARSE_T_ERR * scores[0, 3].max()
    torch_scores = _bump(scores, SPARSE_T_ERR, (0, 0, 5), "row")
    refs = References(
        Outputs("oracle", {"index_scores": scores, "topk_indices": SPARSE_PICKS, own: oracle}),
        # the reference at t on its own selection: further off (a real one may even select otherwise)
        Outputs("torch@f32", {"index_scores": torch_scores, at_sel: _bump(oracle, SPARSE_T_ERR, _first(oracle)),
                              own: _bump(oracle, 10 * SPARSE_T_ERR, _first(oracle))}),
        native=None if native_own is None else Outputs("native", {
            "topk_indices": SPARSE_PICKS if native_picks is None else native_picks, own: native_own(oracle),
            at_sel: native_sel(oracle)}),
    )
    cand = Outputs("c", {"topk_indices": SPARSE_PICKS[..., ::-1] if cand_picks is None else cand_picks,
                         own: cand_own(oracle), at_sel: cand_sel(oracle)})
    knobs = {"ichunk": 1} if native_own is not None else {}
    return judge(_entry(quantity, "float32", mode="sparse", **knobs), cand, refs)


@pytest.mark.parametrize("quantity", ["loss", "grad.indexer.wq_b"])
def test_oracle_at_sel_is_the_oracle_rule_on_the_oracles_selection(quantity):
    """oracle@sel: X on the oracle's selection against the oracle's own sparse run, with the
    reference at t on the oracle's selection as the baseline."""
    kind = "loss" if quantity == "loss" else "grad"
    bound = ALPHA[kind] * SPARSE_T_ERR

    def run(f):
        return _only(_sparse_judge(quantity, lambda o: o, lambda o: _bump(o, f * bound)), "oracle@sel")

    _assert_boundary(f"oracle@sel: alpha[{kind}] * err(reference@t on the oracle selection)", run, bound)


@pytest.mark.parametrize("quantity", ["loss", "grad.indexer.wq_b"])
def test_sparse_end_to_end_oracle_is_compared_when_the_selections_agree(quantity):
    """oracle (end to end, sparse): X's own selection equals the oracle's as sets (here in
    another order), so its own-selection value is judged by the oracle rule, never excused."""
    kind = "loss" if quantity == "loss" else "grad"
    bound = ALPHA[kind] * SPARSE_T_ERR

    def run(f):
        results = _sparse_judge(quantity, lambda o: _bump(o, f * bound), lambda o: o)
        assert _only(results, "oracle@sel").status == PASSED
        return _only(results, "oracle")

    _assert_boundary(f"sparse end-to-end oracle when the selections agree ({quantity})", run, bound)


@pytest.mark.parametrize("quantity", ["loss", "grad.indexer.wq_b"])
def test_chunk_at_sel_is_against_natives_run_on_the_oracles_selection(quantity):
    """chunk@sel: chunked X on the oracle's selection against native X on the oracle's
    selection (not the oracle, from which native differs by far more), to the chunk bound."""
    kind = "loss" if quantity == "loss" else "grad"
    bound = tolerance.CHUNK["float32"][kind]
    native = lambda o: _bump(o, 1e-4)  # noqa: E731

    def run(f):
        results = _sparse_judge(quantity, native, lambda o: _bump(native(o), f * bound), native, native)
        return _only(results, "chunk@sel")

    _assert_boundary(f"chunk@sel: CHUNK[float32][{kind}] against the native run on the oracle selection", run, bound)


@pytest.mark.parametrize("quantity", ["loss", "grad.indexer.wq_b"])
def test_sparse_end_to_end_chunk_is_compared_when_the_selections_agree(quantity):
    """chunk (end to end, sparse): chunked and native select the same sets (here in another
    order), so chunked's own-selection value is compared with native's, never excused."""
    kind = "loss" if quantity == "loss" else "grad"
    bound = tolerance.CHUNK["float32"][kind]
    native = lambda o: _bump(o, 1e-4)  # noqa: E731

    def run(f):
        results = _sparse_judge(quantity, lambda o: _bump(native(o), f * bound), native, native, native)
        assert _only(results, "oracle").status == PASSED
        return _only(results, "chunk")

    _assert_boundary(f"sparse end-to-end chunk when the selections agree ({quantity})", run, bound)


def test_sparse_end_to_end_excused_only_for_boundary_ties():
    """oracle (end to end): an own selection that differs from the oracle's by a boundary tie
    is excused (oracle@sel still judges the numbers); a swap just outside the window fails."""
    tie = SPARSE_PICKS.copy()
    tie[0, 3] = [2, 4]  # block 4 for block 3, the k-th

    def run(f):
        return _only(_sparse_judge("loss", lambda o: o, lambda o: o, cand_picks=tie, gap=f), "oracle")

    _assert_boundary("sparse end to end: excused only for a boundary tie", run, 0.0, at_bound=(EXCUSED, FAILED))


def test_sparse_end_to_end_chunk_excused_only_when_selections_differ():
    """chunk (end to end): excused only when chunked and native select different sets
    (chunk-topk and chunk@sel judge that point); with the same sets it is compared."""
    other = SPARSE_PICKS.copy()
    other[0, 3] = [2, 4]
    native = lambda o: o  # noqa: E731
    same = _sparse_judge("loss", native, native, native, native)
    assert _only(same, "chunk").status == PASSED, _only(same, "chunk").message
    differ = _sparse_judge("loss", native, native, native, native, native_picks=other)
    assert _only(differ, "chunk").status == EXCUSED, _only(differ, "chunk").message


def test_exact64_at_sel_and_end_to_end_in_float64():
    """exact64@sel and the end-to-end sparse check in float64: 1e-12 against the oracle's
    sparse run, on the oracle's selection and on the candidate's own (the same sets)."""
    scores, oracle, own, at_sel = _sparse_problem(_rng(12), "grad.indexer.wq_b")
    refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": SPARSE_PICKS, own: oracle}),
                      Outputs("torch@f64", {"index_scores": scores, at_sel: oracle}))

    def run(check, f):
        cand = Outputs("c", {"topk_indices": SPARSE_PICKS, own: _bump(oracle, f * EXACT64 if check == "exact64" else 0),
                             at_sel: _bump(oracle, f * EXACT64 if check == "exact64@sel" else 0)})
        return _only(judge(_entry("grad.indexer.wq_b", "float64", mode="sparse"), cand, refs), check)

    for check in ("exact64@sel", "exact64"):
        _assert_boundary(f"{check}: 1e-12 (sparse)", lambda f: run(check, f), EXACT64)


# --------------------------------------------------------------------------- stage


STAGE_CASES = {  # stage -> (scale, floor quantity (harness.judging.judge.STAGE_FLOOR_OF) or None)
    "keys": ("tensor", "compressed_keys"),
    "scores": ("row", "index_scores"),
    "teacher": ("tensor", None),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", list(STAGE_CASES))
def test_stage_checks_are_the_forward_oracle_rule(stage, dtype):
    """stage (first-diverging-stage diagnosis): each forward stage by the forward oracle rule,
    alpha 2, the floor of the forward quantity it feeds (with sqrt(n)); scores per row."""
    scale, floor_of = STAGE_CASES[stage]
    oracle = _scores(_rng(13), ROWS) if scale == "row" else _rng(13).standard_normal((2, 6, 4))
    t_err = 1e-3 if dtype == "bfloat16" else 3e-6
    torch_t = _bump(oracle, t_err, _first(oracle), scale)
    n = REDUCTION.get(floor_of) if floor_of else None
    floor = max(tolerance.FLOOR[dtype]["forward"], math.sqrt(n) * WIDE_U if n else 0.0)
    bound = ALPHA["forward"] * max(t_err, floor)

    def run(f):
        cand = _bump(oracle, f * bound, SMALL_ROW if scale == "row" else None, scale)
        [r] = stage_checks({stage: cand}, {stage: oracle}, {stage: torch_t}, dtype, Policy(), DIMS)
        assert r.check == "stage"
        return r

    _assert_boundary(f"stage {stage}: forward oracle rule ({dtype})", run, bound)


@pytest.mark.parametrize("quantity", ["stage.scores", "stage_grad.scores.q"])
def test_a_stage_plugins_quantity_is_judged_against_the_references_stage(quantity):
    """A stage plug-in's stage (and its vjp): the oracle rule against the float64 reference's
    stage, with the reference's own stage at t as the baseline (never the candidate's)."""
    kind = "forward" if quantity.startswith("stage.") else "grad"
    scale = "row" if quantity == "stage.scores" else "tensor"
    oracle = _scores(_rng(14), ROWS) if scale == "row" else _rng(14).standard_normal((1, 4, 2, 8))
    t_err = 0.01
    torch_t = _bump(oracle, t_err, _first(oracle), scale)
    bound = ALPHA[kind] * t_err
    entry = Entry(Point("tiny", "bfloat16"), STAGE_MODE, quantity, "plugin")
    refs = References(Outputs("oracle", {quantity: oracle}), Outputs("ref@bf16", {quantity: torch_t}))

    def run(f):
        cand = Outputs("plugin", {quantity: _bump(oracle, f * bound, SMALL_ROW if scale == "row" else None, scale)})
        [r] = judge(entry, cand, refs)
        return r

    _assert_boundary(f"stage entry: oracle rule against the reference stage ({quantity})", run, bound)
    cand = Outputs("plugin", {quantity: _nan_at_last(oracle)})
    [r] = judge(entry, cand, refs)
    assert r.status == FAILED and "NaN" in r.message, f"rule 'NaN fails' (stage): {r.message}"


def test_a_nan_stage_is_the_first_divergence():
    oracle = _rng(15).standard_normal((2, 6, 4))
    [r] = stage_checks({"keys": _nan_at_last(oracle)}, {"keys": oracle}, {"keys": oracle * 1.01}, "bfloat16")
    assert r.status == FAILED, f"rule 'NaN fails' (stage): {r.message}"


# --------------------------------------------------------------------------- statuses -> verdicts


def test_an_error_status_fails_the_check_the_test_and_the_run():
    """error: a plug-in that raised at the point fails its check (`CheckResult.failed`, what the
    matrix test and the mutation worker assert on), counts in the run's errors, makes the
    report FAIL."""
    entry = _entry("loss", "float32")
    [r] = judge(entry, Outputs("plugin", error="plugin raised ValueError: boom at tiny float32"),
                References(Outputs("oracle"), Outputs("torch@f32")))
    assert r.status == ERROR, f"rule 'error status': {r.message}"
    assert r.failed and not r.passed, "rule 'error fails': CheckResult.failed must be true for an error"
    summary = summarise([record(entry, r)])
    assert summary["errors"] == 1 and summary["failed_entries"] == 1, f"rule 'error fails the run': {summary}"
    assert markdown([record(entry, r)], {}, summary).startswith("# csa-parity report: FAIL"), \
        "rule 'error fails the run': parity.md says PASS"


@pytest.mark.parametrize("status", STATUSES)
def test_each_status_maps_to_its_verdict(status):
    """passed and excused pass; failed and error fail; not_provided and not_applicable neither."""
    r = (CheckResult("oracle", "loss", FAILED, 2.0, 1.0) if status == FAILED
         else status_result("oracle", "loss", status, "why"))
    assert r.passed == (status in (PASSED, EXCUSED)), f"rule 'status -> verdict' ({status}): passed={r.passed}"
    assert r.failed == (status in (FAILED, ERROR)), f"rule 'status -> verdict' ({status}): failed={r.failed}"


# --------------------------------------------------------------------------- the CLI's exit code


PLUGIN = ("class CSAConfig(dict):\n    from_dict = classmethod(lambda cls, d: cls(d))\n\n"
          "def indexer_forward(params, inputs, cfg, dtype):\n    raise NotImplementedError\n")


def _run_points_here(groups, reference, profile, init, jobs, timeout, on_done, error_records, started=(), prefetch=None,
                     max_memory=None):
    """The CLI's workers, in this process (so the patched evaluation below is the one run)."""
    for group in groups:
        for point, entries in group:
            on_done(point, entries, [record(e, r) for e in entries
                                     for r in collect_module.evaluate(e, reference, profile)], 0.0)


def _result_of(status, quantity):
    if status == PASSED:
        return CheckResult("oracle", quantity, PASSED, 0.5, 1.0)
    if status == FAILED:
        return CheckResult("oracle", quantity, FAILED, 2.0, 1.0)
    return status_result("oracle", quantity, status, f"made by hand: {status}")


@pytest.mark.parametrize("status", STATUSES)
def test_cli_exit_code_follows_every_status(status, tmp_path, monkeypatch):
    """csa-parity run exits 1 when any check is failed or error, else 0 (passed, excused, not
    provided, not applicable), and parity.md says FAIL / PASS the same way. The matrix's
    checks are all passed but one, which has `status`."""
    from harness.run import cli

    (tmp_path / "rules_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def evaluate(entry, reference="live", profile="highest"):
        seen.append(entry)
        return [_result_of(status if len(seen) == 1 else PASSED, entry.quantity)]

    monkeypatch.setattr(collect_module, "evaluate", evaluate)
    monkeypatch.setattr(worker_module, "run_points", _run_points_here)
    monkeypatch.setattr(worker_module, "spawn", lambda init, n: [])  # no worker processes: all runs here
    monkeypatch.setattr(cli, "_init_worker", lambda precision, fixtures_dir: None)
    monkeypatch.setattr(cli, "platform_info", lambda precision, reference, device=None: {"backend": "cpu", "device_kind": "cpu"})
    monkeypatch.setattr(report_module, "heatmap", lambda records, path, summary=None: None)  # a picture, no verdict
    out = tmp_path / "rep"
    code = cli.main(["run", "--impl", "rules_plugin", "--cases", "tiny", "--dtypes", "float32", "--ichunks", "0",
                     "--tchunks", "0", "--qchunks", "0", "--modes", "dense", "--reference", "goldens",
                     "--out", str(out), "--no-progress", "--jobs", "1"])
    assert len(seen) > 1
    expected = 1 if status in (FAILED, ERROR) else 0
    assert code == expected, f"rule 'exit code': one {status} check among passed ones must exit {expected}, got {code}"
    verdict = "FAIL" if expected else "PASS"
    assert (out / "parity.md").read_text().startswith(f"# csa-parity report: {verdict}"), \
        f"rule 'exit code': parity.md must say {verdict} for a {status} check"


# --------------------------------------------------------------------------- collect: what is judged against what


def _fake_collect(monkeypatch, values_at):
    """collect() with the implementations replaced by `values_at(spec, point)` and the stored
    order errors by a table per dtype (the backend: cpu)."""
    calls = []

    def outputs(spec, case, point):
        calls.append((spec, point))
        return Outputs(spec, values_at(spec, point))

    monkeypatch.setattr(collect_module, "outputs", outputs)
    monkeypatch.setattr(collect_module, "order_errors",
                        lambda case, dtype, teacher="joint": {"loss.dense": {"float32": 4e-3, "bfloat16": 0.3,
                                                                               "float16": 1e-6}[dtype]})
    monkeypatch.setattr(collect_module.platforms, "current_backend", lambda: "cpu")
    return calls


def test_collect_floors_a_narrow_loss_with_the_float32_order_error(monkeypatch):
    """oracle (loss, bfloat16 / float16): the baseline is at least WIDE_REFERENCE_SHARE times the
    float32 reference's stored error of the same loss, however close the reference at the dtype
    and its own order error (float16's 1e-6 here) landed."""
    oracle = np.float64(0.61)
    bound = ALPHA["loss"] * tolerance.WIDE_REFERENCE_SHARE["loss"] * 4e-3  # float32's stored order error
    for f, status in ((BELOW, PASSED), (ABOVE, FAILED)):
        _fake_collect(monkeypatch, lambda spec, p: {"loss.dense": _bump(oracle, f * bound) if spec == "jax"
                                                    else oracle})
        entry = Entry(Point("tiny", "float16"), "dense", "loss")
        cand, refs = collect_module.collect(entry, "goldens")
        r = _only(judge(entry, cand, refs), "oracle")
        assert r.status == status, f"rule 'a narrow loss is floored by the float32 reference' at {f}x the bound: {r.message}"
        assert "(the float32 reference's error)" in r.message, r.message


def test_collect_judges_a_chunked_point_against_its_native_point(monkeypatch):
    """chunk: the reference of a chunked point is the same implementation at point.native (no
    chunking), never the chunked point itself nor the oracle."""
    oracle, bound = np.float64(0.61), tolerance.CHUNK["float32"]["loss"]
    native = _bump(oracle, 1e-4)
    point = Point("tiny", "float32", ichunk=1, tchunk=2)
    for f, status in ((BELOW, PASSED), (ABOVE, FAILED)):
        def values_at(spec, p):
            if spec == "goldens":
                return {"loss.dense": oracle if p.dtype == "float64" else _bump(oracle, 1e-3)}
            return {"loss.dense": native if p == point.native else _bump(native, f * bound)}

        calls = _fake_collect(monkeypatch, values_at)
        entry = Entry(point, "dense", "loss")
        cand, refs = collect_module.collect(entry, "goldens")
        r = _only(judge(entry, cand, refs), "chunk")
        assert ("jax", point.native) in calls, f"rule 'chunk against native': native not collected: {calls}"
        assert r.status == status, f"rule 'chunk against native' at {f}x the bound: {r.message}"


def test_collect_hands_the_entrys_dtype_order_errors(monkeypatch):
    """oracle: the stored order error that widens the baseline is the entry's dtype's."""
    oracle = np.float64(0.61)
    bound = ALPHA["loss"] * 4e-3  # float32's stored order error (bfloat16's is 0.3)
    for f, status in ((BELOW, PASSED), (ABOVE, FAILED)):
        _fake_collect(monkeypatch, lambda spec, p: {"loss.dense": oracle if spec == "goldens" and p.dtype == "float64"
                                                    else (_bump(oracle, f * bound) if spec == "jax" else oracle)})
        entry = Entry(Point("tiny", "float32"), "dense", "loss")
        cand, refs = collect_module.collect(entry, "goldens")
        r = _only(judge(entry, cand, refs), "oracle")
        assert r.status == status, f"rule 'order error of the entry dtype' at {f}x the bound: {r.message}"

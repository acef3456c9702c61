"""Every number of harness/judging/tolerance.py at its boundary, the cases produced from the table itself.

`harness.judging.tolerance.entries()` lists every number that decides a verdict (it walks the module, so
a number added there is listed without being registered anywhere). For each one this file has:

- its value, pinned in PINS: a change of a number is a change of policy, and is made here too;
- boundary cases, built by the builder of its table (BUILDERS) for every (check, dtype, quantity
  kind) the number decides: hand-made outputs put the error at 0.9x the bound the pinned numbers
  give, which must pass, and at 1.1x, which must fail, on the axis and in the normalisation the
  rule uses (per query row for scores, with the error in a row 10^4 times smaller than the
  others; the sqrt(n) floor where it applies; the score gap to the k-th pick for the top-k tie
  window; the ratio for factors). A bound of 0 is probed at 0 and at the smallest positive
  double.

So a number that moves (10x looser, or tighter) fails `test_number_at_its_boundary[<number>]`,
whose message starts with the number's name; a number without a pin, a table without a builder
or an entry its builder has no case for (a new dtype, a new kind) fails
`test_every_number_has_a_pin_and_a_boundary_case` with one line naming it, and a check the judge
makes that no case reaches fails `test_every_check_the_judge_makes_has_a_boundary_case`. Every
check the cases reach must also fail on a NaN and on a changed -inf pattern
(`test_nan_and_minus_inf_fail_in_every_check`).

harness.selftest.judge_mutations loosens each number 10x in a copy of harness/ (the mutant
`x10_<number>`) and runs its boundary test there; docs/judging.md's table of guarantees lists
every number with its cases, its test and its mutant (`make figures` writes it;
`test_the_guarantees_table_is_current` keeps it so).

Pure numpy: no JAX program, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from harness.judging import tolerance
from harness.judging.compare import CheckResult
from harness.judging.judge import judge, stage_checks
from harness.judging.tolerance import Policy
from harness.outputs import STAGE_MODE, Outputs, References
from harness.points import Entry, Point

ROOT = Path(__file__).resolve().parent.parent
BELOW, ABOVE = 0.9, 1.1

# The numbers as reviewed. harness/judging/tolerance.py gives each its reason; a change there is made here
# too, or its boundary test fails.
PINS = {
    "ALPHA.forward": 2.0, "ALPHA.loss": 2.0, "ALPHA.grad": 3.0,
    "FLOOR.float32.forward": 2.0**-24, "FLOOR.float32.loss": 2.0**-18, "FLOOR.float32.grad": 2.0**-24,
    "FLOOR.bfloat16.forward": 2.0**-9, "FLOOR.bfloat16.loss": 2.0**-18, "FLOOR.bfloat16.grad": 2.0**-9,
    "FLOOR.float16.forward": 2.0**-12, "FLOOR.float16.loss": 2.0**-18, "FLOOR.float16.grad": 2.0**-12,
    "WIDE_U": 2.0**-24,
    "EXACT64": 1e-12,
    "CHUNK.float64.forward": 1e-12, "CHUNK.float64.loss": 1e-12, "CHUNK.float64.grad": 1e-12,
    "CHUNK.float32.forward": 1e-4, "CHUNK.float32.loss": 2e-6, "CHUNK.float32.grad": 4e-6,
    "CHUNK.bfloat16.forward": 2e-4, "CHUNK.bfloat16.loss": 5e-6, "CHUNK.bfloat16.grad": 2.0**-7,
    "CHUNK.float16.forward": 4e-4, "CHUNK.float16.loss": 5e-6, "CHUNK.float16.grad": 4.0 * 2.0**-10,
    "BACKEND.float64.forward": 1e-12, "BACKEND.float64.loss": 1e-12, "BACKEND.float64.grad": 1e-12,
    "BACKEND.float32.forward": 5e-5, "BACKEND.float32.loss": 1e-6, "BACKEND.float32.grad": 5e-6,
    "BACKEND.bfloat16.forward": 5e-5, "BACKEND.bfloat16.loss": 1e-6, "BACKEND.bfloat16.grad": 2.0**-7,
    "BACKEND.float16.forward": 1e-4, "BACKEND.float16.loss": 1e-6, "BACKEND.float16.grad": 2.0**-9,
    "KERNEL_BF16_FORWARD": 1e-6,
    "ISOLATION": 0.0,
    "FIXTURE_CHECK_RTOL.float64": 1e-12, "FIXTURE_CHECK_RTOL.float32": 16 * 2.0**-23,
    "FIXTURE_CHECK_RTOL.bfloat16": 16 * 2.0**-8, "FIXTURE_CHECK_RTOL.float16": 16 * 2.0**-11,
    "ORDERR_CHECK_FACTOR.float32": 32.0, "ORDERR_CHECK_FACTOR.bfloat16": 1.25, "ORDERR_CHECK_FACTOR.float16": 8.0,
    "WIDE_REFERENCE_SHARE.loss": 1.0,
    "MEMORY_FLOOR_FACTOR": 2.0,
    "MEMORY_GROWTH_SLACK": 1.15,
}

LOW = ("float32", "bfloat16", "float16")  # the dtypes judged against the oracle by the alpha rule
NARROW = ("bfloat16", "float16")  # the dtypes whose loss the float32 reference floors


def pin(name: str) -> float:
    return PINS[name]


# --------------------------------------------------------------------------- verdicts and cases


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    bound: float | None  # the bound the check reported, on the case's axis (None: it reports none)
    message: str


def _of(r: CheckResult, reports_bound: bool = True) -> Verdict:
    return Verdict(not r.failed, r.bound if reports_bound else None, r.message)


@dataclasses.dataclass(frozen=True)
class Case:
    """One (check, dtype, quantity kind) a number decides. `run(error, spoil)` judges hand-made
    outputs whose error on the rule's axis is `error` (spoil "nan" / "-inf": one more element of
    the candidate made NaN / -inf); `bound` is what the pinned numbers give on that axis."""

    check: str
    dtype: str
    kind: str
    quantity: str
    bound: float
    run: Callable[[float, str | None], Verdict]
    spoilable: bool = True
    via: str = ""  # how the check is reached, where the check's name alone does not say

    @property
    def name(self) -> str:
        return f"{self.check} ({self.via})" if self.via else self.check

    @property
    def label(self) -> str:
        return f"{self.name} check, {self.dtype}, {self.kind} ({self.quantity})"


def _rng(seed=0):
    return np.random.default_rng(seed)


ROWS = (100.0, 100.0, 0.01, 100.0)  # query 2's scores are 10^4 times smaller than the others'
SMALL_ROW = (0, 2, 3)  # where a score error goes: judged against its own row's largest score


def _scores(rng):
    """index_scores [B=1, S=4, W=6] (ReLU scores, >= 0), rows scaled by ROWS."""
    return rng.uniform(0.2, 1.0, (1, 4, 6)) * np.asarray(ROWS)[None, :, None]


# kind -> [(quantity, canonical name, scale, value maker)]
QUANTITIES = {
    "forward": [("compressed_keys", "compressed_keys", "tensor", lambda r: r.standard_normal((2, 6, 4))),
                ("index_scores", "index_scores", "row", _scores)],
    "loss": [("loss", "loss.dense", "tensor", lambda r: np.float64(0.7316))],
    "grad": [("grad.indexer.wq_b", "grad.dense.indexer.wq_b", "tensor", lambda r: r.standard_normal((8, 5)))],
}
# The problem sizes of the floors that scale with the reduction (harness.judging.tolerance.reduction_length),
# and each quantity's n from SPEC-level definitions of its sums.
DIMS = {"B": 2, "S": 16, "W": 8, "HI": 8, "DI": 32, "R": 64, "E": 96, "m": 4}
REDUCTION = {"index_scores": DIMS["HI"] * DIMS["DI"] + DIMS["R"] + DIMS["E"],
             "compressed_keys": DIMS["E"] + 2 * DIMS["m"] + DIMS["DI"],
             "grad.indexer.wq_b": DIMS["B"] * DIMS["S"] * DIMS["W"]}


def _bump(ref, err, at=None, scale="tensor"):
    """`ref` with the element at `at` (default: the last; scores: in the small row) moved so that
    its normalised error (|x - ref| / max |ref| over the tensor or the query's row; relative for a
    scalar) is exactly `err`."""
    ref = np.asarray(ref, np.float64)
    if ref.ndim == 0:
        return np.float64(ref * (1.0 + err))
    at = (SMALL_ROW if scale == "row" else tuple(n - 1 for n in ref.shape)) if at is None else at
    denom = np.abs(ref[at[:-1]]).max() if scale == "row" else np.abs(ref).max()
    out = ref.copy()
    out[at] += err * denom
    return out


def _spoil(x, spoil):
    """x with its first element NaN or -inf (spoil), or x itself."""
    if spoil is None:
        return x
    value = np.nan if spoil == "nan" else -np.inf
    x = np.array(x, np.float64, copy=True)
    if x.ndim == 0:
        return np.float64(value)
    x[(0,) * x.ndim] = value
    return x


def _only(results, check):
    found = [r for r in results if r.check == check]
    assert len(found) == 1, f"expected one {check!r} result, got {[r.check for r in results]}"
    return found[0]


def _mode(kind):
    return "forward" if kind == "forward" else "dense"


# --------------------------------------------------------------------------- dense and forward checks


def _oracle_case(dtype, kind, item, t_err, bound, dims=None, check=None, seed=0, wide=None):
    """The oracle rule (float64: exact64) on a dense or forward quantity: the reference at the
    dtype off by `t_err` (0: exact, the floor decides), the problem's `dims` (the sqrt(n) floor),
    the float32 reference's stored error `wide` (the narrow loss's floor)."""
    quantity, name, scale, make = item
    oracle = make(_rng(seed))
    torch_t = _bump(oracle, t_err, (0,) * np.ndim(oracle), scale) if t_err else oracle
    check = check or ("exact64" if dtype == "float64" else "oracle")

    def run(err, spoil):
        cand = Outputs("hand-made", {name: _spoil(_bump(oracle, err, scale=scale), spoil)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("reference@t", {name: torch_t}), dims=dims,
                          wide_order_errors={} if wide is None else {name: wide})
        return _of(_only(judge(Entry(Point("tiny", dtype), _mode(kind), quantity), cand, refs), check))

    return Case(check, dtype, kind, quantity, bound, run)


def _native_case(check, dtype, kind, item, bound, seed=1):
    """chunk (a chunked point against native) or xla (a pallas point against the XLA path):
    the candidate against `references.native`, which differs from the oracle by far more."""
    quantity, name, scale, make = item
    oracle = make(_rng(seed))
    native = _bump(oracle, 2e-3, (0,) * np.ndim(oracle), scale)
    torch_t = _bump(oracle, 0.05, (0,) * np.ndim(oracle), scale)
    point = Point("tiny", dtype, ichunk=1) if check == "chunk" else Point("tiny", dtype, backend="pallas")

    def run(err, spoil):
        cand = Outputs("hand-made", {name: _spoil(_bump(native, err, scale=scale), spoil)})
        refs = References(Outputs("oracle", {name: oracle}), Outputs("reference@t", {name: torch_t}),
                          native=Outputs("native", {name: native}))
        return _of(_only(judge(Entry(point, _mode(kind), quantity), cand, refs), check))

    return Case(check, dtype, kind, quantity, bound, run)


# --------------------------------------------------------------------------- sparse: on the oracle's selection

PICKS = np.array([[[0, 1], [1, 0], [0, 1], [2, 3]]])  # each query's top 2 of _sparse_scores


def _sparse_scores():
    s = _scores(_rng(7))
    for q, (a, b) in enumerate(PICKS[0]):
        s[0, q, a], s[0, q, b] = 2.0 * ROWS[q], 1.9 * ROWS[q]
    return s


def _sel_case(check, dtype, kind, bound, t_err=0.05, wide=None):
    """oracle@sel / exact64@sel / chunk@sel / xla@sel: the sparse value on the oracle's selection
    against the oracle's own sparse run (or native's run on the oracle's selection)."""
    loss = kind == "loss"
    own, at_sel = ("loss.sparse", "loss.sparse_at_oracle") if loss else \
        ("grad.sparse.indexer.wq_b", "grad.sparse_at_oracle.indexer.wq_b")
    quantity = "loss" if loss else "grad.indexer.wq_b"
    oracle = np.float64(0.4071) if loss else _rng(8).standard_normal((8, 5))
    native = _bump(oracle, 1e-4, (0,) * np.ndim(oracle))
    knobs = {"ichunk": 1} if check == "chunk@sel" else {"backend": "pallas"} if check == "xla@sel" else {}
    base = native if knobs else oracle
    scores = _sparse_scores()

    def run(err, spoil):
        value = _spoil(_bump(base, err), spoil)
        refs = References(
            Outputs("oracle", {"index_scores": scores, "topk_indices": PICKS, own: oracle}),
            Outputs("reference@t", {"index_scores": scores, at_sel: _bump(oracle, t_err, (0,) * np.ndim(oracle)),
                                    own: _bump(oracle, t_err, (0,) * np.ndim(oracle))}),
            native=Outputs("native", {"topk_indices": PICKS, own: native, at_sel: native}) if knobs else None,
            wide_order_errors={} if wide is None else {at_sel: wide})
        cand = Outputs("hand-made", {"topk_indices": PICKS, own: base, at_sel: value})
        return _of(_only(judge(Entry(Point("tiny", dtype, **knobs), "sparse", quantity), cand, refs), check))

    return Case(check, dtype, kind, quantity, bound, run)


# --------------------------------------------------------------------------- stages

def _stage_case(dtype, stage, t_err, bound, dims=None):
    """The first-diverging-stage diagnosis (harness.judging.judge.stage_checks): the forward oracle rule."""
    scale = "row" if stage == "scores" else "tensor"
    oracle = _scores(_rng(9)) if scale == "row" else _rng(9).standard_normal((2, 6, 4))
    torch_t = _bump(oracle, t_err, (0,) * oracle.ndim, scale) if t_err else oracle

    def run(err, spoil):
        cand = _spoil(_bump(oracle, err, scale=scale), spoil)
        [r] = stage_checks({stage: cand}, {stage: oracle}, {stage: torch_t}, dtype, Policy(), dims)
        return _of(r)

    return Case("stage", dtype, "forward", f"stage {stage}", bound, run)


def _stage_plugin_case(dtype, quantity, t_err, bound):
    """A stage plug-in's stage (stage.*: forward) or its vjp (stage_grad.*: grad), judged against
    the float64 reference's stage by the oracle rule."""
    scale = "row" if quantity == "stage.scores" else "tensor"
    oracle = _scores(_rng(10)) if scale == "row" else _rng(10).standard_normal((1, 4, 2, 8))
    torch_t = _bump(oracle, t_err, (0,) * oracle.ndim, scale)
    entry = Entry(Point("tiny", dtype), STAGE_MODE, quantity, "plugin")

    def run(err, spoil):
        cand = Outputs("plugin", {quantity: _spoil(_bump(oracle, err, scale=scale), spoil)})
        [r] = judge(entry, cand, References(Outputs("oracle", {quantity: oracle}),
                                            Outputs("reference@t", {quantity: torch_t})))
        return _of(r)

    kind = "forward" if quantity.startswith("stage.") else "grad"
    return Case("oracle", dtype, kind, quantity, bound, run, via="stage plug-in")


# --------------------------------------------------------------------------- the top-k tie window

TOPK_BASE = np.array([10.0, 6.0, 5.0, 3.0, 1.0, 0.5])  # block 1 is the k-th pick (k = 2), block 2 the swap
TOPK_ROWS = (1000.0, 1000.0, 0.001)  # the swap happens in query 2, 10^6 times smaller
TOPK_PICKS = np.array([[[0, 1], [0, 1], [0, 1]]])


def _topk_scores(gap):
    """Oracle scores [1, 3, 6] with query 2's block 2 `gap` (relative to the row's largest score)
    below the k-th score, and the candidate's picks: block 2 for block 1 in query 2."""
    scores = np.stack([TOPK_BASE * s for s in TOPK_ROWS])[None]
    scores[0, 2, 2] = scores[0, 2, 1] - gap * scores[0, 2].max()
    swapped = TOPK_PICKS.copy()
    swapped[0, 2] = [0, 2]
    return scores, swapped


def _topk_case(dtype, t_err, bound, dims=None, check="topk"):
    """topk: a swap is excused only when both blocks score within the window (the index_scores
    bound times the row's largest |score|) of the oracle's k-th score. chunk-topk / xla-topk: the
    same window, against native's picks (here the oracle's)."""
    point = {"topk": Point("tiny", dtype), "chunk-topk": Point("tiny", dtype, ichunk=1),
             "xla-topk": Point("tiny", dtype, backend="pallas")}[check]

    def run(gap, spoil):
        scores, swapped = _topk_scores(gap)
        torch_t = _bump(scores, t_err, (0, 0, 3), "row") if t_err else scores
        refs = References(Outputs("oracle", {"index_scores": scores, "topk_indices": TOPK_PICKS}),
                          Outputs("reference@t", {"index_scores": torch_t}), dims=dims,
                          native=Outputs("native", {"topk_indices": TOPK_PICKS}) if point.native else None)
        return _of(_only(judge(Entry(point, "forward", "topk_indices"),
                               Outputs("hand-made", {"topk_indices": swapped}), refs), check), reports_bound=False)

    return Case(check, dtype, "topk", "topk_indices (tie window)", bound, run, spoilable=False)


# --------------------------------------------------------------------------- the other checks


def _kernel_case(dtype, bound):
    """The `kernel` check (harness.sides.kernel_check.judge_kernel) on hand-made arrays: float64 outputs
    at EXACT64, the bfloat16 forward at KERNEL_BF16_FORWARD (normwise)."""
    def run(err, spoil):
        from harness.sides.kernel_check import NAMES64, judge_kernel

        rng = _rng(11)
        want64 = {n: rng.standard_normal((2, 5, 4)) for n in NAMES64}
        want16 = rng.standard_normal((2, 5, 4))
        got64, got16 = dict(want64), want16
        if dtype == "float64":
            got64["dq"] = _spoil(_bump(want64["dq"], err), spoil)
        else:
            got16 = _spoil(_bump(want16, err), spoil)
        results = judge_kernel(got64, want64, got16, want16)
        judged = "float64 dq" if dtype == "float64" else "bfloat16 scores"
        return _of(next(r for r in results if r.quantity == judged))

    return Case("kernel", dtype, "forward and vjp" if dtype == "float64" else "forward", "pallas kernels", bound, run)


def _isolation_case(bound):
    def run(err, spoil):
        g = np.zeros((1, 4, 3))
        g[0, 2, 1] = err
        grads = {"input_grad.dense.hidden_states": _spoil(g, spoil), "input_grad.dense.q_latent": np.zeros((1, 4, 3))}
        [r] = judge(Entry(Point("tiny", "float32"), "dense", "input_grads"), Outputs("hand-made", grads),
                    References(Outputs("oracle"), Outputs("reference@t")))
        return _of(r)

    return Case("isolation", "any", "isolation", "input_grads (largest |d loss / d input|)", bound, run)


def _raw(x):
    from harness.problems.fixtures import RawTensor

    x = np.asarray(x, np.float64)
    return RawTensor("F64", tuple(x.shape), x.astype("<f8").tobytes())


def _fixture_case(dtype, bound):
    """fixtures --check (harness.run.regenerate.compare_tensor): a regenerated golden within
    rtol * max |committed| of the committed one (normwise, -inf / NaN patterns exact)."""
    name = f"golden.{dtype}.grad.dense.indexer.wq_b"

    def run(err, spoil):
        from harness.run.regenerate import compare_tensor

        old = _rng(12).standard_normal((8, 5))
        msg = compare_tensor(name, _raw(old), _raw(_spoil(_bump(old, err), spoil)), {}, {})
        return Verdict(msg is None, None, msg or "within the bound")

    return Case("fixtures --check", dtype, "golden", name, bound, run)


def _fixture_topk_case(dtype, bound):
    """fixtures --check on the top-k picks: a swap excused within rtol * max |committed row| of the
    k-th score (the judge's tie rule)."""
    def run(gap, spoil):
        from harness.run.regenerate import compare_tensor

        scores, swapped = _topk_scores(gap)
        name = f"golden.{dtype}.topk_indices"
        msg = compare_tensor(name, _raw(TOPK_PICKS), _raw(swapped), {f"golden.{dtype}.index_scores": _raw(scores)}, {})
        return Verdict(msg is None, None, msg or "within the bound")

    return Case("fixtures --check", dtype, "topk tie window", f"golden.{dtype}.topk_indices", bound, run,
                spoilable=False)


def _orderr_case(direction, dtype, bound):
    """fixtures --check on a stored order error of `dtype`: old and new within a factor of each
    other (no dims: compared raw, no floor under them)."""
    def run(ratio, spoil):
        from harness.run.regenerate import compare_tensor

        old = 1e-7
        new = old * ratio if direction == "up" else old / ratio if ratio else 0.0
        msg = compare_tensor(f"golden.{dtype}.orderr.index_scores", _raw(old), _raw(new), {}, {})
        return Verdict(msg is None, None, msg or "within the factor")

    return Case("fixtures --check", dtype, "order error", f"golden.{dtype}.orderr.* ({direction})", bound, run,
                spoilable=False)


def _memory_floor_case(bound):
    def run(ratio, spoil):
        from harness.judging.memory_bounds import within_floor_factor

        ok, got = within_floor_factor(ratio * 2**20, 2**20)
        return Verdict(ok, None, f"held {got:.4g} x the analytic floor")

    return Case("memory", "float32", "temp bytes", "chunk 1 / analytic floor", bound, run, spoilable=False)


def _memory_growth_case(which, bound):
    """The per-head slope of temp memory against the larger of the floor's own slope and every
    earlier measured slope (harness.judging.memory_bounds.grows_no_worse_than_linearly)."""
    def run(ratio, spoil):
        from harness.judging.memory_bounds import grows_no_worse_than_linearly

        mib = 2.0**20
        if which == "floor slope":  # one step: the floor's slope decides
            points = [(1, 0.0, 0.0), (2, ratio * mib, mib)]
        else:  # the floor's second slope is half the first measured one: the measured one decides
            points = [(1, 0.0, 0.0), (2, mib, mib), (4, mib + 2 * ratio * mib, 2 * mib)]
        ok, worst, _ = grows_no_worse_than_linearly(points)
        return Verdict(ok, None, f"worst per-head slope {worst:.4g} x its allowance")

    return Case("memory", "float32", "temp growth", f"per-head slope / {which}", bound, run, spoilable=False)


# --------------------------------------------------------------------------- the builders, one per table


def _alpha_cases(kind):
    a = pin(f"ALPHA.{kind}")
    cases = [_oracle_case(dtype, kind, item, 0.05, a * 0.05) for dtype in LOW for item in QUANTITIES[kind]]
    if kind == "forward":
        cases += [_stage_case("bfloat16", "keys", 0.05, a * 0.05),
                  _stage_plugin_case("bfloat16", "stage.scores", 0.05, a * 0.05),
                  *(_topk_case("bfloat16", 0.01, a * 0.01, check=c) for c in ("topk", "chunk-topk", "xla-topk"))]
    else:
        cases += [_sel_case("oracle@sel", dtype, kind, a * 0.05) for dtype in LOW]
    if kind == "grad":
        cases.append(_stage_plugin_case("bfloat16", "stage_grad.scores.q", 0.05, a * 0.05))
    return cases


def _floor_cases(dtype, kind):
    bound = pin(f"ALPHA.{kind}") * pin(f"FLOOR.{dtype}.{kind}")
    cases = [_oracle_case(dtype, kind, item, 0.0, bound) for item in QUANTITIES[kind]]
    if kind == "forward":
        cases += [_stage_case(dtype, "teacher", 0.0, bound), _topk_case(dtype, 0.0, bound)]
    return cases


def _wide_u_cases():
    """The sqrt(n) floor, float32 (in bfloat16 and float16 the per-dtype floors are larger for any n
    of these problems)."""
    cases = []
    for kind in ("forward", "grad"):
        for item in QUANTITIES[kind]:
            n = REDUCTION[item[0]]
            floor = max(pin(f"FLOOR.float32.{kind}"), math.sqrt(n) * pin("WIDE_U"))
            cases.append(_oracle_case("float32", kind, item, 0.0, pin(f"ALPHA.{kind}") * floor, dims=DIMS))
    floor = max(pin("FLOOR.float32.forward"), math.sqrt(REDUCTION["index_scores"]) * pin("WIDE_U"))
    cases += [_stage_case("float32", "scores", 0.0, pin("ALPHA.forward") * floor, dims=DIMS),
              _topk_case("float32", 0.0, pin("ALPHA.forward") * floor, dims=DIMS)]
    return cases


def _wide_reference_cases(kind):
    """The narrow dtypes' loss floor set by the float32 reference's stored error (1e-3 here, far
    above the loss floor 2^-18; the reference at the dtype exact), dense and on the oracle's
    selection."""
    wide = 1e-3
    bound = pin("ALPHA.loss") * pin(f"WIDE_REFERENCE_SHARE.{kind}") * wide
    return ([_oracle_case(dtype, kind, item, 0.0, bound, wide=wide) for dtype in NARROW for item in QUANTITIES[kind]]
            + [_sel_case("oracle@sel", dtype, kind, bound, t_err=0.0, wide=wide) for dtype in NARROW])


def _exact64_cases():
    e = pin("EXACT64")
    return ([_oracle_case("float64", kind, item, 1e-3, e) for kind in QUANTITIES for item in QUANTITIES[kind]]
            + [_sel_case("exact64@sel", "float64", kind, e, t_err=1e-3) for kind in ("loss", "grad")]
            + [_stage_case("float64", "keys", 1e-3, e), _topk_case("float64", 0.0, e), _kernel_case("float64", e)])


def _native_cases(table, check):
    def build(dtype, kind):
        bound = pin(f"{table}.{dtype}.{kind}")
        cases = [_native_case(check, dtype, kind, item, bound) for item in QUANTITIES[kind]]
        if kind != "forward":
            cases.append(_sel_case(f"{check}@sel", dtype, kind, bound))
        return cases

    return build


def _need(keys, n):
    if len(keys) != n:
        raise KeyError(f"expected {n} key(s) below the table's name, got {keys}")
    return keys


def _scalar(keys, make):
    _need(keys, 0)
    return make()


def _known(value, allowed, what):
    if value not in allowed:
        raise KeyError(f"no boundary case for {what} {value!r} (cases exist for {', '.join(allowed)})")
    return value


KINDS = tuple(QUANTITIES)
DTYPES = ("float64", *LOW)

# table name -> keys below it -> the boundary cases of that number. A KeyError: no case for it.
BUILDERS: dict[str, Callable[[tuple], list[Case]]] = {
    "ALPHA": lambda k: _alpha_cases(_known(_need(k, 1)[0], KINDS, "kind")),
    "FLOOR": lambda k: _floor_cases(_known(_need(k, 2)[0], LOW, "dtype"), _known(k[1], KINDS, "kind")),
    "WIDE_U": lambda k: _scalar(k, _wide_u_cases),
    "EXACT64": lambda k: _scalar(k, _exact64_cases),
    "CHUNK": lambda k: _native_cases("CHUNK", "chunk")(_known(_need(k, 2)[0], DTYPES, "dtype"),
                                                       _known(k[1], KINDS, "kind")),
    "BACKEND": lambda k: _native_cases("BACKEND", "xla")(_known(_need(k, 2)[0], DTYPES, "dtype"),
                                                         _known(k[1], KINDS, "kind")),
    "KERNEL_BF16_FORWARD": lambda k: _scalar(k, lambda: [_kernel_case("bfloat16", pin("KERNEL_BF16_FORWARD"))]),
    "ISOLATION": lambda k: _scalar(k, lambda: [_isolation_case(pin("ISOLATION"))]),
    "FIXTURE_CHECK_RTOL": lambda k: [
        _fixture_case(_known(_need(k, 1)[0], DTYPES, "dtype"), pin(f"FIXTURE_CHECK_RTOL.{k[0]}")),
        _fixture_topk_case(k[0], pin(f"FIXTURE_CHECK_RTOL.{k[0]}"))],
    "ORDERR_CHECK_FACTOR": lambda k: [_orderr_case(d, _known(_need(k, 1)[0], LOW, "dtype"),
                                                       pin(f"ORDERR_CHECK_FACTOR.{k[0]}")) for d in ("up", "down")],
    "WIDE_REFERENCE_SHARE": lambda k: _wide_reference_cases(_known(_need(k, 1)[0], ("loss",), "kind")),
    "MEMORY_FLOOR_FACTOR": lambda k: _scalar(k, lambda: [_memory_floor_case(pin("MEMORY_FLOOR_FACTOR"))]),
    "MEMORY_GROWTH_SLACK": lambda k: _scalar(k, lambda: [_memory_growth_case(w, pin("MEMORY_GROWTH_SLACK"))
                                                         for w in ("floor slope", "earlier slope")]),
}


def cases_of(number: str, keys: tuple) -> list[Case]:
    """The boundary cases of one number of harness.judging.tolerance.entries()."""
    builder = BUILDERS.get(keys[0])
    if builder is None:
        raise KeyError(f"the table {keys[0]} has no builder in BUILDERS")
    cases = builder(tuple(keys[1:]))
    if not cases:
        raise KeyError("its builder gives no case")
    return cases


def missing(number: str, keys: tuple) -> str | None:
    """One line naming what `number` lacks (a pin, a builder, a case), or None."""
    lacks = []
    if number not in PINS:
        lacks.append("no pin in PINS")
    try:
        if number in PINS:
            cases_of(number, keys)
        elif keys[0] not in BUILDERS:
            lacks.append(f"no builder for its table {keys[0]} in BUILDERS")
    except KeyError as e:
        lacks.append(f"no boundary case ({e.args[0]})")
    if not lacks:
        return None
    return (f"harness/judging/tolerance.py {number}: {'; '.join(lacks)} (tests/test_tolerance_boundaries.py: pin it and "
            "give its table's builder a case for every check, dtype and kind it decides)")


ENTRIES = {number: keys for number, keys, _ in tolerance.entries()}
NUMBERS = sorted(set(ENTRIES) | set(PINS))


def probes(bound: float) -> tuple[float, float]:
    """The errors that must pass and fail: 0.9x and 1.1x the bound; for a bound of 0, 0 and the
    smallest positive double."""
    return (BELOW * bound, ABOVE * bound) if bound > 0 else (0.0, math.ulp(0.0))


def boundary_problems(number: str) -> list[str]:
    """Every way `number`'s boundary cases fail, one line each, starting with the number's name
    (the number's own name first, then the case), and a last line counting the failing cases."""
    if number not in ENTRIES:
        return [f"harness/judging/tolerance.py {number}: pinned in PINS but no longer a number of harness/judging/tolerance.py "
                "(remove its pin, or restore it)"]
    line = missing(number, ENTRIES[number])
    if line:
        return [line]
    cases = cases_of(number, ENTRIES[number])
    value = dict((n, v) for n, _, v in tolerance.entries())[number]
    where = f"harness/judging/tolerance.py has {number} = {value:.6g}, pinned {PINS[number]:.6g}"
    out, failing = [], 0
    for case in cases:
        before = len(out)
        lo, hi = probes(case.bound)
        below, above = case.run(lo, None), case.run(hi, None)
        if not below.passed:
            out.append(f"{number}: the {case.label} fails an error of {lo:.4g}, below the bound {case.bound:.4g} the "
                       f"pinned numbers give ({where}): {below.message}")
        if above.passed:
            allowed = f" (it allowed {above.bound:.4g})" if above.bound is not None else ""
            out.append(f"{number} went soft: the {case.label} passes an error of {hi:.4g}, above the bound "
                       f"{case.bound:.4g} the pinned numbers give{allowed} ({where}): {above.message}")
        elif above.bound is not None and not math.isclose(above.bound, case.bound, rel_tol=1e-9):
            out.append(f"{number}: the {case.label} reports the bound {above.bound:.6g}, the pinned numbers give "
                       f"{case.bound:.6g} ({where})")
        failing += len(out) > before
    if out:
        out.append(f"{number}: {failing} of its {len(cases)} boundary cases fail")
    return out


# --------------------------------------------------------------------------- the tests


def test_every_number_has_a_pin_and_a_boundary_case():
    """Enumerated from the table: a number, a dtype or a kind added to harness/judging/tolerance.py without
    a pin and a boundary case fails here, one line each."""
    lines = [line for number, keys in ENTRIES.items() if (line := missing(number, keys))]
    lines += [f"harness/judging/tolerance.py {n}: pinned in PINS but no longer a number of harness/judging/tolerance.py"
              for n in sorted(set(PINS) - set(ENTRIES))]
    assert not lines, "\n".join(lines)


@pytest.mark.parametrize("number", NUMBERS)
def test_number_at_its_boundary(number):
    """The number's every case: 0.9x the bound the pinned numbers give passes, 1.1x fails."""
    problems = boundary_problems(number)
    assert not problems, "\n".join(problems)


def _checks() -> dict[str, Case]:
    """One spoilable case per check the boundary cases reach."""
    out: dict[str, Case] = {}
    for number, keys in ENTRIES.items():
        if missing(number, keys):
            continue
        for case in cases_of(number, keys):
            if case.spoilable:
                out.setdefault(case.check, case)
    return out


CHECKS = _checks()


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("spoil", ["nan", "-inf"])
def test_nan_and_minus_inf_fail_in_every_check(check, spoil):
    """NaN anywhere fails, and -inf entries must coincide exactly, in every check that compares
    numbers, whatever its bound: an element of the candidate spoiled, with no other error."""
    case = CHECKS[check]
    verdict = case.run(0.0, spoil)
    assert not verdict.passed, f"the {case.label} passes a candidate with one {spoil} element: {verdict.message}"


def judge_checks() -> set[tuple[str, str]]:
    """(check, kind) of every check the judge makes that compares numbers, found by judging
    identical outputs at every mode and quantity (harness.outputs), at native, chunked and pallas
    points of every dtype, and the first-diverging-stage diagnosis."""
    from harness.outputs import (FORWARD_QUANTITIES, FORWARD_STAGES, LOSS_QUANTITIES, LOSS_VARIANTS, MODES,
                                 PASSED, STAGE_INPUTS, input_grad_names, kind_of, output_name, stage_quantities)

    rng = _rng(13)
    values = {"compressed_keys": rng.standard_normal((2, 6, 4)), "index_scores": _sparse_scores(),
              "topk_indices": PICKS}
    for q in LOSS_QUANTITIES:
        value = np.float64(0.5) if q == "loss" else rng.standard_normal((8, 5))
        for variant in LOSS_VARIANTS:  # the same value under every variant: each check compares equal arrays
            if q == "input_grads":
                values.update({n: np.zeros((1, 4, 3)) for n in input_grad_names(variant)})
            else:
                values[output_name(q, variant)] = value
    # The quantizer stage's codes and scales are judged bit for bit (no number bounds them), as the
    # pipeline's CODE_QUANTITIES, which FORWARD_QUANTITIES leaves out.
    stage_names = [q for s in STAGE_INPUTS for q in stage_quantities(s) if kind_of(q) != "codes"]
    values.update({q: rng.standard_normal((1, 4, 6)) for q in stage_names})
    same = Outputs("same", values)
    found = set()
    for dtype in DTYPES:
        for knobs in ({}, {"ichunk": 1}, {"backend": "pallas"}):
            point = Point("tiny", dtype, **knobs)
            refs = References(same, same, native=same if point.native else None)
            entries = [Entry(point, mode, q) for mode in MODES
                       for q in (FORWARD_QUANTITIES if mode == "forward" else LOSS_QUANTITIES)]
            entries += [Entry(point, STAGE_MODE, q, "plugin") for q in stage_names]
            for entry in entries:
                found |= {(r.check, kind_of(r.quantity)) for r in judge(entry, same, refs) if r.status == PASSED}
        stages = {s: rng.standard_normal((2, 6, 4)) for s in FORWARD_STAGES}
        found |= {(r.check, "forward") for r in stage_checks(stages, stages, stages, dtype) if r.status == PASSED}
    return found


def test_every_check_the_judge_makes_has_a_boundary_case():
    """A check kind added to the judge (a new name, or an old one on a new kind of quantity) without
    a boundary case of the number that bounds it fails here, one line each."""
    covered = {(c.check, c.kind) for number, keys in ENTRIES.items() if not missing(number, keys)
               for c in cases_of(number, keys)}
    lines = [f"the judge's {check!r} check on {kind} quantities has no boundary case: give the builder of the number "
             "that bounds it (tests/test_tolerance_boundaries.py BUILDERS) a case for it"
             for check, kind in sorted(judge_checks() - covered)]
    assert not lines, "\n".join(lines)


# --------------------------------------------------------------------------- docs/judging.md's table of guarantees

DOC = ROOT / "docs" / "judging.md"
BEGIN = ("<!-- guarantees: written by `make figures` (scripts/figures.py) from harness/judging/tolerance.py, "
         "tests/test_tolerance_boundaries.py and harness/selftest/judge_mutations.py; do not edit by hand -->")
END = "<!-- end of guarantees -->"


def _applies(cases: list[Case]) -> str:
    groups: dict[tuple[str, str], list[str]] = {}
    for c in cases:
        dtypes = groups.setdefault((c.name, c.kind), [])
        if c.dtype not in dtypes:
            dtypes.append(c.dtype)
    return "; ".join(f"{check} ({kind}): {', '.join(d)}" for (check, kind), d in groups.items())


def guarantees_table() -> str:
    """The generated block of docs/judging.md: one row per number of harness/judging/tolerance.py."""
    from harness.selftest.judge_mutations import number_mutant_name

    rows = ["| number | value | decides (check (kind): dtypes) | boundary test | mutant (10x looser) |",
            "|---|---|---|---|---|"]
    for number, keys, value in tolerance.entries():
        if missing(number, keys):
            decides = "**no boundary case**"
        else:
            decides = _applies(cases_of(number, keys))
        rows.append(f"| `{number}` | {value:.6g} | {decides} | `test_number_at_its_boundary[{number}]` "
                    f"| `{number_mutant_name(number)}` |")
    return "\n".join([BEGIN, *rows, END])


def current_guarantees(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN):text.index(END) + len(END)]


def test_the_guarantees_table_is_current():
    """docs/judging.md's table of guarantees is what `make figures` writes now."""
    current = current_guarantees(DOC.read_text())
    assert current is not None, f"docs/judging.md has no table of guarantees (the block from {BEGIN!r} to {END!r})"
    assert current == guarantees_table(), ("docs/judging.md's table of guarantees is stale: run `make figures` "
                                           "(python scripts/figures.py)")

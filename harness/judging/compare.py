"""Comparators of SPEC section 10. They return a `CheckResult` and never raise on a
mismatch. Each kind of check has one message template (`CheckResult.message`):

  close      (oracle, exact64, chunk, oracle@sel, ...) reads like torch.testing.assert_close:
             what, how many, the worst normalised difference where, against which bound;
  pattern    a NaN, a differing -inf pattern or shape: what differs, where;
  topk       how many queries pick other blocks beyond a boundary tie, how many ties
             were excused, the first differing query;
  isolation  how many input-gradient elements are not exactly 0, the largest, where;
  codes      how many quantized codes or scales differ beyond a boundary tie, how many ties
             were excused, the first unexcused difference (harness.judging.codes);
  status     not provided / not applicable: why.

All errors are *normalised* so one bound serves tensors of any scale:
  - arrays: max |x - ref| / max |ref| over the tensor (`scale="tensor"`), or
    per row of the last axis (`scale="row"`, used for scores: each query's
    scores are judged against that query's largest score);
  - scalars: |x - ref| / |ref| (absolute when ref == 0).

The top-k tie rule (`topk_sets`) is the only one in the project: the judge and the
fixture `--check` (harness.run.regenerate) both call it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..outputs import ERROR, EXCUSED, FAILED, NOT_APPLICABLE, NOT_PROVIDED, PASSED, STATUSES


def to_numpy(x: Any) -> np.ndarray:
    """A host numpy array from a numpy / JAX / torch value (bfloat16 widened exactly to float32)."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point and x.dtype.itemsize < 4:
            x = x.float()
        return x.numpy()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" or arr.dtype.name in ("bfloat16", "float16"):
        arr = arr.astype(np.float32)
    return arr


_VERDICT = {PASSED: "ok", FAILED: "MISMATCH", EXCUSED: "excused", NOT_PROVIDED: "not provided",
            NOT_APPLICABLE: "not applicable", ERROR: "ERROR"}
assert tuple(_VERDICT) == STATUSES


@dataclasses.dataclass(frozen=True)
class CheckResult:
    check: str  # oracle | exact64 | chunk | oracle@sel | exact64@sel | chunk@sel | topk | chunk-topk | isolation
    quantity: str
    status: str  # harness.outputs.STATUSES
    error: float = 0.0  # the normalised error (topk: unexcused differing picks; isolation: largest |g|)
    bound: float = 0.0
    where: tuple | None = None  # index of the worst element (topk: the first differing query)
    mismatched: int = 0
    total: int = 0
    note: str = ""  # extra facts: excused ties, the torch-at-dtype error, the reason of a status
    context: str = ""  # the matrix point, e.g. "small float32 ichunk=2 tchunk=0 sparse"
    stats: dict = dataclasses.field(default_factory=dict)
    template: str = "close"  # close | pattern | topk | isolation | codes | status: which message

    def __post_init__(self) -> None:
        if self.status not in _VERDICT:
            raise ValueError(f"CheckResult status={self.status!r} is not one of {', '.join(_VERDICT)} "
                             "(harness.outputs.STATUSES)")

    @property
    def passed(self) -> bool:
        """Judged and not failed: passed, or a difference excused as a boundary tie."""
        return self.status in (PASSED, EXCUSED)

    @property
    def failed(self) -> bool:
        """The check fails the run: a mismatch, or the implementation raised at the point
        (`error`). The matrix, the sharded slice and the mutation worker read this,
        so an exception is never a pass."""
        return self.status in (FAILED, ERROR)

    @property
    def ratio(self) -> float:
        if self.bound > 0:
            return self.error / self.bound
        return 0.0 if self.error == 0 else math.inf

    @property
    def message(self) -> str:
        head = f"[{self.context}] {self.quantity} ({self.check}): {_VERDICT[self.status]}: "
        return head + getattr(self, f"_body_{self.template}")()

    def _body_close(self) -> str:
        body = (f"mismatched elements: {self.mismatched} / {self.total} "
                f"({100.0 * self.mismatched / max(self.total, 1):.1f}%); greatest normalised difference: "
                f"{self.error:.3g}" + (f" at index {self.where}" if self.where is not None else "")
                + f" (up to {self.bound:.3g} allowed; ratio {self.ratio:.3g})")
        return body + (f"; {self.note}" if self.note else "")

    def _body_pattern(self) -> str:
        at = f" at index {self.where}" if self.where is not None else ""
        return f"{self.note}{at} ({self.mismatched} of {self.total} elements)"

    def _body_topk(self) -> str:
        excused = int(self.stats.get("excused", 0))
        body = (f"{self.mismatched} of {self.total} queries pick other blocks beyond a boundary tie, "
                f"{excused} boundary-tie differences excused")
        return body + (f"; first at (b, s) = {self.where}: {self.stats['first']}" if self.stats.get("first") else "")

    def _body_codes(self) -> str:
        # the note counts the excused ties: "12 boundary-tie differences excused (...)"
        unit = self.stats.get("unit", "elements")
        body = f"{self.mismatched} of {self.total} {unit} differ beyond a boundary tie, {self.note}"
        return body + (f"; first at index {self.where}: {self.stats['first']}" if self.stats.get("first") else "")

    def _body_isolation(self) -> str:
        if not self.mismatched:
            return f"all {self.total} input-gradient elements exactly 0"
        return (f"{self.mismatched} of {self.total} input-gradient elements are not exactly 0; largest "
                f"|{self.error:.3g}| at index {self.where} ({self.note})")

    def _body_status(self) -> str:
        return self.note

    def with_diagnosis(self, line: str) -> "CheckResult":
        """This failed result with the first-diverging-stage line in its note and
        its stats (`first_divergence`, also a field of the report's record)."""
        note = f"{self.note}; {line}" if self.note else line
        return dataclasses.replace(self, note=note, stats={**self.stats, "first_divergence": line})

    def with_context(self, context: str) -> "CheckResult":
        return dataclasses.replace(self, context=context)


def identical(check: str, quantity: str, candidate, reference) -> CheckResult:
    """Bit for bit: the quantizer's codes and scales (SPEC section 7a) from the same values, where
    no rounding may differ. A different shape fails; so does NaN (never equal to itself)."""
    a, b = to_numpy(candidate), to_numpy(reference)
    if a.shape != b.shape:
        n = max(a.size, b.size)
        return CheckResult(check, quantity, FAILED, math.inf, 0.0, None, n, n,
                           f"shape {list(a.shape)} against {list(b.shape)}", template="pattern")
    differ = a != b
    n = int(differ.sum())
    where = tuple(int(i) for i in np.argwhere(differ)[0]) if n else None
    note = f"first {a[where]} against {b[where]}" if n else "identical"
    return CheckResult(check, quantity, FAILED if n else PASSED, float(n), 0.0, where, n, a.size, note,
                       template="pattern")


def status_result(check: str, quantity: str, status: str, why: str, **stats) -> CheckResult:
    """A check that compared no numbers: not provided, not applicable, or excused as a whole."""
    return CheckResult(check, quantity, status, note=why, template="status", stats=dict(stats))


def _pattern(check, quantity, bound, where, count, total, note) -> CheckResult:
    return CheckResult(check, quantity, FAILED, math.inf, bound, where, count, total, note, template="pattern")


def _nonfinite_problem(check, quantity, x, ref, bound):
    """A failed CheckResult if NaN appears or the +-inf patterns differ, else None."""
    x_nan, r_nan = np.isnan(x), np.isnan(ref)
    if x_nan.any() or r_nan.any():
        bad = x_nan | r_nan
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        side = "candidate" if x_nan.any() else "reference"
        return _pattern(check, quantity, bound, where, int(bad.sum()), x.size, f"NaN in the {side}")
    x_inf, r_inf = np.isinf(x), np.isinf(ref)
    differ = (x_inf != r_inf) | (x_inf & r_inf & (np.sign(x) != np.sign(ref)))
    if differ.any():
        where = tuple(int(i) for i in np.argwhere(differ)[0])
        return _pattern(check, quantity, bound, where, int(differ.sum()), x.size,
                        f"-inf pattern differs (candidate {x[where]!r}, reference {ref[where]!r})")
    return None


def normalised_error(x, ref, scale: str = "tensor") -> tuple[float, tuple | None, np.ndarray]:
    """(max normalised |x - ref|, index of the max, per-element normalised error).

    Non-finite entries (which must coincide; see `_nonfinite_problem`) are ignored.
    """
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: candidate {x.shape} vs reference {ref.shape}")
    if x.size == 0:
        return 0.0, None, np.zeros(x.shape)
    finite = np.isfinite(ref) & np.isfinite(x)
    with np.errstate(invalid="ignore"):  # inf - inf where both are -inf: masked out below
        diff = np.where(finite, np.abs(x - ref), 0.0)
    mag = np.where(finite, np.abs(ref), 0.0)
    if x.ndim == 0:
        denom = np.abs(ref) if ref != 0 else 1.0
    elif scale == "row":
        denom = np.max(mag, axis=-1, keepdims=True)
    else:
        denom = np.max(mag)
    denom = np.where(denom > 0, denom, 1.0)
    err = diff / denom
    if err.ndim == 0:
        return float(err), None, err
    idx = np.unravel_index(int(np.argmax(err)), err.shape)
    return float(err[idx]), tuple(int(i) for i in idx), err


def compare_close(check: str, quantity: str, x, ref, bound: float, scale: str = "tensor", note: str = "") -> CheckResult:
    """Normalised error of x against ref, judged against `bound`; NaN and -inf patterns first."""
    x, ref = to_numpy(x).astype(np.float64), to_numpy(ref).astype(np.float64)
    if x.shape != ref.shape:
        return _pattern(check, quantity, bound, None, x.size, ref.size,
                        f"shape differs: candidate {x.shape}, reference {ref.shape}")
    problem = _nonfinite_problem(check, quantity, x, ref, bound)
    if problem is not None:
        return problem
    error, where, per_elem = normalised_error(x, ref, scale)
    mismatched = int(np.sum(per_elem > bound))
    status = PASSED if error <= bound else FAILED
    return CheckResult(check, quantity, status, error, bound, where, mismatched, max(x.size, 1), note)


def oracle_relative(quantity: str, candidate, oracle, torch_at_dtype, alpha: float, floor: float,
                    scale: str = "tensor", check: str = "oracle", order_error: float | None = None,
                    factor: float = 1.0, profile: str = "", floor_note: str = "") -> CheckResult:
    """SPEC section 10: err(candidate) <= factor * alpha * max(err(torch at the same dtype), floor).

    `order_error`: torch@t's worst error over K equivalent evaluation orders,
    stored in the fixture (harness.run.regenerate.order_errors); err(torch at t) is then the
    larger of it and the error of `torch_at_dtype` handed in. `factor`: the platform profile
    `profile`'s factor for a candidate that ran on an accelerator (1 on a CPU). `floor_note`: what
    set the floor, where not the tables (said after it in the message)."""
    t_err, _, _ = normalised_error(to_numpy(torch_at_dtype), to_numpy(oracle), scale)
    one_order = t_err
    if order_error is not None:
        t_err = max(t_err, float(order_error))
    bound = alpha * max(t_err, floor)
    bound *= factor
    orders = "" if order_error is None else f" (max over evaluation orders; this order {one_order:.3g})"
    note = f"torch-at-dtype error {t_err:.3g}{orders}, floor {floor:.3g}{floor_note}, alpha {alpha:g}"
    if factor != 1.0 or profile:
        note += f", platform factor {factor:g} ({profile or 'no profile'})"
    result = compare_close(check, quantity, candidate, oracle, bound, scale, note)
    stats = {"torch_error": t_err}
    if profile:
        stats["platform_factor"] = factor
    return dataclasses.replace(result, stats=stats)


def exactly_zero(quantity: str, grads: dict, check: str = "isolation", bound: float = 0.0) -> CheckResult:
    """Input-gradient isolation: every |gradient| at most `bound` (the judge's is
    harness.judging.tolerance.ISOLATION, 0: exactly 0); NaN never is."""
    worst, where, count, total, name_at = 0.0, None, 0, 0, ""
    for name, g in grads.items():
        g = to_numpy(g).astype(np.float64)
        total += g.size
        nz = ~(np.abs(g) <= bound)
        count += int(nz.sum())
        if g.size and np.max(np.abs(g)) > worst:
            worst = float(np.max(np.abs(g)))
            where = tuple(int(i) for i in np.unravel_index(int(np.argmax(np.abs(g))), g.shape))
            name_at = name
    note = f"in d loss / d {name_at}" if count else ""
    return CheckResult(check, quantity, PASSED if count == 0 else FAILED, worst, bound, where, count, total,
                       note, template="isolation")


def topk_sets(quantity: str, candidate, oracle, oracle_scores, score_tol: np.ndarray | float,
              check: str = "topk") -> CheckResult:
    """Compare top-k selections as sets per query, excusing boundary ties (the project's one rule).

    A block picked by one side and not the other is excused only if its reference score
    lies within `score_tol` (absolute; scalar or per query [B, S]) of the reference's k-th
    picked score, and so is the block it replaced (every block of the symmetric difference).
    -1 sentinels must agree in number. `error` is the number of unexcused swapped picks
    (bound 0); `stats["excused"]` the excused ones. Status: passed when the sets agree,
    excused when they differ only by excused ties, failed otherwise.
    """
    cand, orc = to_numpy(candidate).astype(np.int64), to_numpy(oracle).astype(np.int64)
    scores = to_numpy(oracle_scores).astype(np.float64)
    if cand.shape != orc.shape:
        return _pattern(check, quantity, 0.0, None, cand.size, orc.size,
                        f"shape differs: candidate {cand.shape}, reference {orc.shape}")
    tol = np.broadcast_to(np.asarray(score_tol, np.float64), cand.shape[:-1])
    unexcused = excused = bad_queries = 0
    first_bad, first_note = None, ""
    queries = cand.reshape(-1, cand.shape[-1]) if cand.size else np.zeros((0, 0), np.int64)
    orcs = orc.reshape(queries.shape)
    rows = scores.reshape(-1, scores.shape[-1]) if cand.size else scores
    flat_tol = tol.reshape(-1)
    for q in range(queries.shape[0]):
        a = set(int(i) for i in queries[q] if i >= 0)
        o = set(int(i) for i in orcs[q] if i >= 0)
        if a == o:
            continue
        swapped = max(len(a - o), len(o - a))
        bad_here = swapped
        if len(a) == len(o) and all(i < rows.shape[-1] for i in a):
            kth = min(rows[q, i] for i in o)
            if all(np.isfinite(rows[q, i]) and abs(rows[q, i] - kth) <= flat_tol[q] for i in a ^ o):
                excused += swapped
                bad_here = 0
        if bad_here:
            unexcused += bad_here
            bad_queries += 1
            if first_bad is None:
                first_bad = tuple(int(i) for i in np.unravel_index(q, cand.shape[:-1]))
                first_note = f"candidate picks {sorted(a)}, oracle picks {sorted(o)}"
    status = FAILED if unexcused else (EXCUSED if excused else PASSED)
    note = f"{excused} boundary-tie differences excused"
    return CheckResult(check, quantity, status, float(unexcused), 0.0, first_bad, bad_queries,
                       queries.shape[0], note, stats={"excused": excused, "first": first_note},
                       template="topk")

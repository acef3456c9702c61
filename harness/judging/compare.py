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

Streaming (SPEC section 11). The close comparison and the top-k rule are reductions over blocks
of rows: `CloseStream` and `TopkStream` take one block at a time (`add`, with the block's offset
in the whole array) and merge exactly (`merge`: max with the first index, sums, the first
mismatch), and `result` judges what they hold against a bound given at the end. `compare_close`,
`oracle_relative` and `topk_sets` are those streams fed a single block, so a whole array and a
problem too long to hold are judged by the same code.
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
    check: str  # oracle | exact64 | chunk | oracle@sel | exact64@sel | chunk@sel | topk | chunk-topk | isolation | invariants
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
    template: str = "close"  # close | pattern | topk | isolation | codes | invariants | status: which message

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

    def _body_invariants(self) -> str:
        if not self.mismatched:
            return self.note
        return (f"{self.mismatched} of {self.total} rows break the invariants of their picks; first at (b, s) = "
                f"{self.where}: {self.note}")

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


def normalised_error(x, ref, scale: str = "tensor") -> tuple[float, tuple | None, np.ndarray]:
    """(max normalised |x - ref|, index of the max, per-element normalised error).

    Non-finite entries (which must coincide; `CloseStream` checks that first) are ignored.
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


# The most normalised errors a `CloseStream` keeps for the mismatch count (above its `keep_above`):
# past this many the largest are kept and the count is reported as a lower bound. A candidate
# that is right has none above the bound; one that is wrong fails on its worst element whatever
# the count says. 2**20 float64 values: 8 MiB.
LEDGER_CAP = 2 ** 20


def _live_columns(x: np.ndarray, ref: np.ndarray) -> slice | None:
    """The columns (last axis) outside which every element of both arrays is -inf, as a slice
    (possibly empty), or None where cropping is not worth it or not exact: fewer than 2 axes, not
    floating point, or a NaN anywhere (the uncropped comparison then reports it). Outside the
    slice the comparison has nothing to add: no NaN, no differing -inf, an error of 0, a row's
    largest |ref| not there. One column-wise max per array in its own dtype (a masked score row
    at length is mostly -inf: the float64 work is then done on its live columns only)."""
    if x.ndim < 2 or x.dtype.kind != "f" or ref.dtype.kind != "f" or not x.size:
        return None
    lead = tuple(range(x.ndim - 1))
    top = np.maximum(np.max(x, axis=lead).astype(np.float64), np.max(ref, axis=lead).astype(np.float64))
    if np.isnan(top).any():
        return None
    cols = np.flatnonzero(top > -np.inf)
    if cols.size == top.size:
        return None
    return slice(int(cols[0]), int(cols[-1]) + 1) if cols.size else slice(0, 0)


class CloseStream:
    """The close comparison of SPEC section 10 as a reduction over blocks: the worst normalised
    |x - ref| and its index, the element count, the normalised errors above `keep_above` (the
    smallest bound the result may be judged against: what the mismatch count needs), and the NaN
    and +-inf pattern (counts and the first index). `scale` "row" normalises each row of the last
    axis by its own largest |ref|, so a block of rows is judged alone; "tensor" (one normaliser
    for the whole array) takes a single block."""

    def __init__(self, scale: str = "tensor", keep_above: float = 0.0):
        self.scale, self.keep_above = scale, keep_above
        self.worst, self.where, self.total, self.blocks = 0.0, None, 0, 0
        self.ledger: list[np.ndarray] = []
        self.kept = self.dropped = 0
        self.shape_note = ""
        self.nan = self.inf = 0
        self.nan_first = self.inf_first = None
        self.nan_in_candidate = False
        self.inf_note = ""

    def add(self, x, ref, offset: tuple = ()) -> "CloseStream":
        """One block: `x`, `ref` (the same shape) whose element 0 sits at `offset` of the whole
        array (leading axes; missing ones are 0)."""
        x, ref = to_numpy(x), to_numpy(ref)
        self.blocks += 1
        if self.blocks > 1 and self.scale != "row":
            raise ValueError("a tensor-scale comparison needs the whole array in one block")
        if x.shape != ref.shape:
            self.shape_note = self.shape_note or f"shape differs: candidate {x.shape}, reference {ref.shape}"
            self.total += max(x.size, ref.size)
            return self
        block_off = tuple(offset) + (0,) * (x.ndim - len(offset))
        size, off = x.size, block_off
        # Only the live columns are compared in float64 (where the rest is -inf on both sides).
        live = _live_columns(x, ref)
        if live is not None:
            x, ref = x[..., live], ref[..., live]
            off = off[:-1] + (off[-1] + live.start,)
        x, ref = x.astype(np.float64), ref.astype(np.float64)

        def at(idx):
            return tuple(int(i) + o for i, o in zip(idx, off))

        x_nan, r_nan = np.isnan(x), np.isnan(ref)
        if x_nan.any() or r_nan.any():
            bad = x_nan | r_nan
            self.nan += int(bad.sum())
            self.nan_in_candidate |= bool(x_nan.any())
            first = at(np.argwhere(bad)[0])
            self.nan_first = first if self.nan_first is None else min(self.nan_first, first)
        else:
            x_inf, r_inf = np.isinf(x), np.isinf(ref)
            differ = (x_inf != r_inf) | (x_inf & r_inf & (np.sign(x) != np.sign(ref)))
            if differ.any():
                i = tuple(np.argwhere(differ)[0])
                self.inf += int(differ.sum())
                if self.inf_first is None or at(i) < self.inf_first:
                    self.inf_first = at(i)
                    self.inf_note = f"-inf pattern differs (candidate {x[i]!r}, reference {ref[i]!r})"
        self.total += size
        error, where, per_elem = normalised_error(x, ref, self.scale)
        if where is None and x.ndim and not size:  # empty block
            return self
        if live is not None and error == 0.0:
            # nothing differs: the worst is the block's first element, as the whole block gives it
            where = tuple(block_off)
        else:
            where = at(where) if where is not None else None
        if self.where is None and self.blocks == 1 or error > self.worst or (
                error == self.worst and where is not None and self.where is not None and where < self.where):
            self.worst, self.where = error, where
        above = np.asarray(per_elem)[np.asarray(per_elem) > self.keep_above].ravel()
        if above.size:
            self.ledger.append(above)
            self.kept += above.size
            if self.kept > LEDGER_CAP:
                every = np.sort(np.concatenate(self.ledger))[::-1]
                self.dropped += every.size - LEDGER_CAP
                self.ledger, self.kept = [every[:LEDGER_CAP]], LEDGER_CAP
        return self

    def merge(self, other: "CloseStream") -> "CloseStream":
        """Both streams' blocks in one (exact: max with the smaller index on a tie, sums, the
        first mismatch)."""
        if other.blocks == 0:
            return self
        if self.blocks == 0 or other.worst > self.worst or (
                other.worst == self.worst and other.where is not None and (self.where is None or other.where < self.where)):
            self.worst, self.where = other.worst, other.where
        self.blocks += other.blocks
        self.total += other.total
        self.shape_note = self.shape_note or other.shape_note
        self.nan += other.nan
        self.nan_in_candidate |= other.nan_in_candidate
        if other.nan_first is not None and (self.nan_first is None or other.nan_first < self.nan_first):
            self.nan_first = other.nan_first
        self.inf += other.inf
        if other.inf_first is not None and (self.inf_first is None or other.inf_first < self.inf_first):
            self.inf_first, self.inf_note = other.inf_first, other.inf_note
        self.ledger += other.ledger
        self.kept += other.kept
        self.dropped += other.dropped
        return self

    def result(self, check: str, quantity: str, bound: float, note: str = "") -> CheckResult:
        """Judged against `bound` (at least `keep_above`, or the mismatch count is short):
        a shape, NaN or +-inf pattern difference fails first, then the worst normalised error."""
        if self.shape_note:
            return _pattern(check, quantity, bound, None, self.total, self.total, self.shape_note)
        if self.nan:
            side = "candidate" if self.nan_in_candidate else "reference"
            return _pattern(check, quantity, bound, self.nan_first, self.nan, self.total, f"NaN in the {side}")
        if self.inf:
            return _pattern(check, quantity, bound, self.inf_first, self.inf, self.total, self.inf_note)
        mismatched = sum(int(np.sum(a > bound)) for a in self.ledger)
        if self.dropped and mismatched >= self.kept:
            note = (f"{note}; " if note else "") + f"at least {mismatched} mismatched (only the largest {LEDGER_CAP} kept)"
        status = PASSED if self.worst <= bound else FAILED
        return CheckResult(check, quantity, status, self.worst, bound, self.where, mismatched, max(self.total, 1), note)


def compare_close(check: str, quantity: str, x, ref, bound: float, scale: str = "tensor", note: str = "") -> CheckResult:
    """Normalised error of x against ref, judged against `bound`; NaN and -inf patterns first
    (a `CloseStream` of one block)."""
    return CloseStream(scale, keep_above=bound).add(x, ref).result(check, quantity, bound, note)


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
    return oracle_relative_result(quantity, CloseStream(scale, keep_above=factor * alpha * floor).add(candidate, oracle),
                                  t_err, alpha, floor, check, order_error, factor, profile, floor_note)


def oracle_relative_result(quantity: str, candidate: CloseStream, torch_error: float, alpha: float, floor: float,
                           check: str = "oracle", order_error: float | None = None, factor: float = 1.0,
                           profile: str = "", floor_note: str = "") -> CheckResult:
    """`oracle_relative` on what a `CloseStream` of the candidate against the oracle holds (kept
    above factor * alpha * floor, the smallest bound it can get), with `torch_error` the worst
    normalised error of the reference at the dtype against the oracle (its `CloseStream.worst`)."""
    t_err = one_order = torch_error
    if order_error is not None:
        t_err = max(t_err, float(order_error))
    bound = alpha * max(t_err, floor)
    bound *= factor
    orders = "" if order_error is None else f" (max over evaluation orders; this order {one_order:.3g})"
    note = f"torch-at-dtype error {t_err:.3g}{orders}, floor {floor:.3g}{floor_note}, alpha {alpha:g}"
    if factor != 1.0 or profile:
        note += f", platform factor {factor:g} ({profile or 'no profile'})"
    result = candidate.result(check, quantity, bound, note)
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


# A differing query's note gives both sets whole up to this many picks, else only the picks
# that differ (a row of k = 2048 picks would make a message of pages).
NOTE_PICKS = 64


class TopkStream:
    """The top-k tie rule as a reduction over blocks of query rows: per query whose sets
    differ, how many picks were swapped, how far its differing blocks' scores lie from the
    oracle's k-th picked score (infinite where no tie can excuse it: a -1 count that differs,
    a non-finite or out-of-range pick) and its row's largest |oracle score|, so that the
    tolerance may be given at the end (`result`)."""

    def __init__(self):
        self.queries = 0
        self.shape_note = ""
        self.rows: list[tuple[tuple, int, float, float, str]] = []  # (query, swapped, deviation, row max, note)

    def add(self, candidate, oracle, oracle_scores, offset: tuple = ()) -> "TopkStream":
        """One block of queries [..., k] (and the oracle's scores [..., W]) whose first query sits
        at `offset` of the whole [B, S] (leading axes; missing ones are 0)."""
        cand, orc = to_numpy(candidate).astype(np.int64), to_numpy(oracle).astype(np.int64)
        scores = to_numpy(oracle_scores)  # read in float64 only on the rows whose sets differ
        if cand.shape != orc.shape:
            self.shape_note = self.shape_note or f"shape differs: candidate {cand.shape}, reference {orc.shape}"
            self.queries += max(cand.size, orc.size)
            return self
        lead = cand.shape[:-1]
        off = tuple(offset) + (0,) * (len(lead) - len(offset))
        queries = cand.reshape(-1, cand.shape[-1]) if cand.size else np.zeros((0, 0), np.int64)
        orcs = orc.reshape(queries.shape)
        rows = scores.reshape(-1, scores.shape[-1]) if cand.size else scores
        self.queries += queries.shape[0]
        if not queries.shape[0]:
            return self
        differ = np.nonzero(np.any(np.sort(queries, -1) != np.sort(orcs, -1), axis=-1))[0]
        for q in differ:
            a = set(int(i) for i in queries[q] if i >= 0)
            o = set(int(i) for i in orcs[q] if i >= 0)
            if a == o:
                continue
            swapped = max(len(a - o), len(o - a))
            deviation = math.inf
            row = rows[q].astype(np.float64)
            if len(a) == len(o) and all(i < row.shape[-1] for i in a):
                kth = min(row[i] for i in o)
                if all(np.isfinite(row[i]) for i in a ^ o):
                    deviation = max(abs(row[i] - kth) for i in a ^ o)
            finite = row[np.isfinite(row)]
            row_max = float(np.max(np.abs(finite))) if finite.size else 0.0
            where = tuple(int(i) + o_ for i, o_ in zip(np.unravel_index(q, lead), off))
            if len(a | o) <= NOTE_PICKS:
                note = f"candidate picks {sorted(a)}, oracle picks {sorted(o)}"
            else:
                note = (f"candidate picks {sorted(a - o)} where the oracle picks {sorted(o - a)} "
                        f"({len(a & o)} picks in common)")
            self.rows.append((where, swapped, deviation, row_max, note))
        return self

    def merge(self, other: "TopkStream") -> "TopkStream":
        self.queries += other.queries
        self.shape_note = self.shape_note or other.shape_note
        self.rows += other.rows
        return self

    def result(self, quantity: str, score_tol, check: str = "topk") -> CheckResult:
        """Judged with `score_tol`: an absolute tolerance per query (a scalar, or an array over
        the whole [B, S] indexed by the query), or a function of the row's largest |oracle score|
        (a bound normalised per row, given only once every block is in)."""
        if self.shape_note:
            return _pattern(check, quantity, 0.0, None, self.queries, self.queries, self.shape_note)
        unexcused = excused = bad_queries = 0
        first_bad, first_note = None, ""
        for where, swapped, deviation, row_max, note in self.rows:
            if callable(score_tol):
                tol = score_tol(row_max)
            else:
                tol = np.asarray(score_tol, np.float64)
                tol = float(tol[where]) if tol.ndim else float(tol)
            if deviation <= tol:
                excused += swapped
                continue
            unexcused += swapped
            bad_queries += 1
            if first_bad is None or where < first_bad:
                first_bad, first_note = where, note
        status = FAILED if unexcused else (EXCUSED if excused else PASSED)
        note = f"{excused} boundary-tie differences excused"
        return CheckResult(check, quantity, status, float(unexcused), 0.0, first_bad, bad_queries,
                           self.queries, note, stats={"excused": excused, "first": first_note},
                           template="topk")


def topk_sets(quantity: str, candidate, oracle, oracle_scores, score_tol: np.ndarray | float,
              check: str = "topk") -> CheckResult:
    """Compare top-k selections as sets per query, excusing boundary ties (the project's one rule;
    a `TopkStream` of one block).

    A block picked by one side and not the other is excused only if its reference score
    lies within `score_tol` (absolute; scalar or per query [B, S]) of the reference's k-th
    picked score, and so is the block it replaced (every block of the symmetric difference).
    -1 sentinels must agree in number. `error` is the number of unexcused swapped picks
    (bound 0); `stats["excused"]` the excused ones. Status: passed when the sets agree,
    excused when they differ only by excused ties, failed otherwise.
    """
    cand = to_numpy(candidate)
    tol = np.asarray(score_tol, np.float64)
    if tol.ndim and cand.ndim:
        tol = np.broadcast_to(tol, cand.shape[:-1])
    return TopkStream().add(candidate, oracle, oracle_scores).result(quantity, tol, check)

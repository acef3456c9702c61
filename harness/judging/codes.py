"""Judging the quantizer's codes and scales (SPEC sections 7a and 10), in numpy.

A code is a discrete function of a rounded value: a candidate at a low dtype may land on the
other side of a decision boundary than the float64 oracle. The boundaries are the midpoints
between neighbouring values of the format (for a code) and the powers of two (for a block
scale). Such a difference is a boundary tie, excused and counted, only when the oracle's own
value lies within the dtype's tolerance of the boundary the candidate's answer implies; any
other difference fails. The two comparators here, `scales_check` and `codes_check`, return
`harness.judging.compare.CheckResult` (template "codes") and never raise on a mismatch.

The tolerance of a DI-vector is `bound * max |oracle rotated|` over that vector (the "row" scale
of `harness.judging.compare.normalised_error`): the caller's `bound` is normalised, as every other bound.

Where the reference computed a value at the candidate's dtype without any rounding
(`at_dtype_rotated == oracle_rotated`, e.g. planted inputs), the tolerance there is 0: the tie
rule (nearest value, ties to the even code) decides, so the candidate's code must be exactly
what the rule gives at the candidate's scale, and an exact block's scale must equal the oracle's.

A code is judged at the candidate's *own* block scale: a code follows its scale, and whether
that scale was itself excusable is `scales_check`'s question, so the caller runs both.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..outputs import EXCUSED, FAILED, PASSED
from .compare import CheckResult, to_numpy


@dataclasses.dataclass(frozen=True)
class Format:
    """A sign-magnitude minifloat and its quantizer constants (SPEC section 7a)."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    qmax: float
    tiny: float  # the amax floor of the block scale
    nan_all_ones: bool  # OCP e4m3fn: exponent and mantissa all ones is NaN (no infinities)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)


FORMATS = {
    "e2m1": Format(exponent_bits=2, mantissa_bits=1, bias=1, qmax=6.0, tiny=6.0 * 2.0**-126, nan_all_ones=False),
    "e4m3": Format(exponent_bits=4, mantissa_bits=3, bias=7, qmax=448.0, tiny=1e-4, nan_all_ones=True),
}


@functools.lru_cache(maxsize=None)
def _values(fmt: str) -> np.ndarray:
    f = FORMATS[fmt]
    codes = np.arange(1 << f.bits)
    sign = (codes & f.sign_bit) != 0
    exponent = (codes >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1)
    mantissa = codes & ((1 << f.mantissa_bits) - 1)
    # exponent field 0 is subnormal: no implicit leading one, the smallest normal's exponent
    subnormal = mantissa * 2.0 ** (1 - f.bias - f.mantissa_bits)
    normal = (1.0 + mantissa / 2.0**f.mantissa_bits) * 2.0 ** (exponent - f.bias)
    magnitude = np.where(exponent == 0, subnormal, normal)
    values = np.where(sign, -magnitude, magnitude)
    if f.nan_all_ones:
        values[(exponent == (1 << f.exponent_bits) - 1) & (mantissa == (1 << f.mantissa_bits) - 1)] = np.nan
    values.setflags(write=False)
    return values


def format_values(fmt: str) -> np.ndarray:
    """The value of every bit pattern of `fmt` (16 for e2m1, 256 for e4m3), float64, from the bit
    layout; NaN for the patterns that are no number (e4m3's 0x7f and 0xff). The negative-zero
    pattern (0x8, 0x80) decodes to -0.0, though the quantizer never produces it."""
    return _values(fmt).copy()


def decode(codes, fmt: str) -> np.ndarray:
    """Bit patterns -> their values (float64); NaN for a NaN pattern or a number out of range."""
    c = np.asarray(to_numpy(codes), np.float64)
    values = _values(fmt)
    ok = np.isfinite(c) & (c == np.floor(c)) & (c >= 0) & (c < values.size)
    return np.where(ok, values[np.where(ok, c, 0).astype(np.int64)], np.nan)


@functools.lru_cache(maxsize=None)
def _rounding_intervals(fmt: str):
    """Per bit pattern: (valid, lo, hi), the interval of quotients x / s that round to it.

    The grid is the format's signed values with zero once: -0 is not a code the quantizer
    produces (zero is the positive code 0), so the negative-zero pattern is invalid like NaN.
    lo and hi are the midpoints to the neighbours; the ends reach -inf / +inf because the
    quotient is clipped to [-Qmax, Qmax] before rounding."""
    values = _values(fmt)
    negative_zero = (values == 0) & np.signbit(values)
    valid = np.isfinite(values) & ~negative_zero
    grid = np.unique(values[valid])  # sorted, zero once
    mid = (grid[1:] + grid[:-1]) / 2  # exact: the formats have few bits
    lo_grid = np.concatenate([[-np.inf], mid])
    hi_grid = np.concatenate([mid, [np.inf]])
    pos = np.searchsorted(grid, np.where(valid, values, 0.0))
    lo = np.where(valid, lo_grid[pos], np.nan)
    hi = np.where(valid, hi_grid[pos], np.nan)
    for a in (valid, lo, hi):
        a.setflags(write=False)
    return valid, lo, hi


def quantize_at(x, scales, fmt: str) -> np.ndarray:
    """The tie rule at given scales: clip(x / s, -Qmax, Qmax) to the nearest value of the
    format, ties to the even code; zero is the positive code. `scales` broadcasts against x
    (pass them repeated per element). uint8 bit patterns. Used for values the dtype computed
    exactly, where the rule, not a tolerance, decides."""
    f = FORMATS[fmt]
    values = _values(fmt)
    magnitudes = values[: f.sign_bit]
    n = int(np.sum(np.isfinite(magnitudes)))  # e4m3: 0x7f is NaN, so 0..0x7e
    magnitudes = magnitudes[:n]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        v = np.clip(np.asarray(x, np.float64) / np.asarray(scales, np.float64), -f.qmax, f.qmax)
    a = np.abs(v)
    upper = np.clip(np.searchsorted(magnitudes, a, side="left"), 1, n - 1)
    lower = upper - 1
    below, above = a - magnitudes[lower], magnitudes[upper] - a
    # non-negative codes are in value order, so a code's parity is its index's parity
    code = np.where((above < below) | ((above == below) & (upper % 2 == 0)), upper, lower)
    code = np.where((v < 0) & (code > 0), code | f.sign_bit, code)
    return code.astype(np.uint8)


def _is_power_of_two(s: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        mantissa, _ = np.frexp(np.where(np.isfinite(s), s, 0.0))
    return np.isfinite(s) & (s > 0) & (mantissa == 0.5)


def _scale_text(s: float) -> str:
    if _is_power_of_two(np.asarray(s)):
        return f"{s:.6g} (2**{int(np.frexp(s)[1]) - 1})"
    return f"{float(s)!r} (not a positive power of two)"


def _shape_problem(check, quantity, shapes: dict, cand_size: int):
    """A failed pattern result naming the shapes when they do not fit together, else None."""
    text = ", ".join(f"{k} {list(v)}" for k, v in shapes.items())
    return CheckResult(check, quantity, FAILED, np.inf, 0.0, None, cand_size, cand_size,
                       f"shapes do not fit: {text}", template="pattern")


def _prepare(check, quantity, scales_pair, oracle_rotated, at_dtype_rotated, block, bound, codes_pair=None):
    """numpy float64 arrays, the shape checks, and the per-row tolerance [..., 1]."""
    cand_s, orc_s = (np.asarray(to_numpy(a), np.float64) for a in scales_pair)
    x = np.asarray(to_numpy(oracle_rotated), np.float64)
    at = np.asarray(to_numpy(at_dtype_rotated), np.float64)
    shapes = {"candidate scales": cand_s.shape, "oracle scales": orc_s.shape,
              "oracle rotated": x.shape, "rotated at dtype": at.shape}
    if codes_pair is not None:
        shapes = {"candidate codes": np.shape(codes_pair[0]), "oracle codes": np.shape(codes_pair[1]), **shapes}
    fits = (x.ndim >= 1 and at.shape == x.shape and cand_s.shape == orc_s.shape
            and cand_s.shape == x.shape[:-1] + (x.shape[-1] // block,) and x.shape[-1] % block == 0
            and (codes_pair is None or np.shape(codes_pair[0]) == np.shape(codes_pair[1]) == x.shape))
    if not fits:
        size = int(np.prod(shapes["candidate codes" if codes_pair is not None else "candidate scales"]))
        return _shape_problem(check, quantity, shapes, size)
    tol = bound * (np.max(np.abs(x), axis=-1, keepdims=True) if x.size else np.zeros(x.shape[:-1] + (1,)))
    return cand_s, orc_s, x, at, tol


def _result(check, quantity, unit, bad, excused_mask, first_text, note_extra="") -> CheckResult:
    n_bad, n_excused = int(bad.sum()), int(excused_mask.sum())
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape)) if n_bad else None
    status = FAILED if n_bad else (EXCUSED if n_excused else PASSED)
    note = f"{n_excused} boundary-tie differences excused{note_extra}"
    return CheckResult(check, quantity, status, float(n_bad), 0.0, where, n_bad, int(bad.size), note,
                       stats={"excused": n_excused, "first": first_text(where) if n_bad else "", "unit": unit},
                       template="codes")


def scales_check(check: str, quantity: str, cand_scales, oracle_scales, oracle_rotated, at_dtype_rotated,
                 fmt: str, block: int, bound: float) -> CheckResult:
    """UE8M0 block scales [..., DI / block] against the oracle's.

    A differing candidate scale s' is a boundary tie (excused, counted) only if it is a positive
    power of two, the block is not exact at the dtype, and the oracle's
    a = max(amax, tiny) * (1 / Qmax) lies within tol_row / Qmax of (s'/2, s'], the a-values whose
    scale is s' (the candidate's amax is within tol_row of the oracle's, max being 1-Lipschitz).
    """
    f = FORMATS[fmt]
    prepared = _prepare(check, quantity, (cand_scales, oracle_scales), oracle_rotated, at_dtype_rotated,
                        block, bound)
    if isinstance(prepared, CheckResult):
        return prepared
    cand, orc, x, at, tol = prepared
    blocks = x.shape[:-1] + (x.shape[-1] // block, block)
    amax = np.max(np.abs(x).reshape(blocks), axis=-1) if x.size else np.zeros(cand.shape)
    a = np.maximum(amax, f.tiny) * (1.0 / f.qmax)  # as the oracle computes it
    exact = np.all((at == x).reshape(blocks), axis=-1)
    tol_a = tol / f.qmax  # [..., 1]: one tolerance per row
    valid = _is_power_of_two(cand)
    with np.errstate(invalid="ignore"):
        distance = np.maximum(np.maximum(cand / 2 - a, a - cand), 0.0)
    differ = ~(cand == orc)
    excused = differ & valid & ~exact & (distance <= tol_a)
    bad = differ & ~excused

    def first(where):
        why = ("candidate scale is not a positive power of two" if not valid[where] else
               "block exact at the dtype: tolerance 0" if exact[where] else "beyond the tolerance")
        return (f"candidate scale {_scale_text(cand[where])}, oracle scale {_scale_text(orc[where])}, "
                f"oracle amax {amax[where]:.6g} so a = {a[where]:.6g}, distance of a to (s'/2, s'] "
                f"{distance[where]:.3g}, tolerance {np.broadcast_to(tol_a, cand.shape)[where]:.3g} ({why})")

    return _result(check, quantity, "scales", bad, excused, first)


def codes_check(check: str, quantity: str, cand_codes, cand_scales, oracle_codes, oracle_scales, oracle_rotated,
                at_dtype_rotated, fmt: str, block: int, bound: float) -> CheckResult:
    """Bit-pattern codes [..., DI] against the oracle's, each judged at the candidate's own
    block scale s'.

    An element whose (code, scale) equals the oracle's is fine. Otherwise the candidate's code
    must be a valid one (not NaN, not negative zero) at a positive power-of-two scale, and:
    where the value is exact at the dtype, the code the tie rule gives at s' (tolerance 0);
    elsewhere, the oracle's value x must lie within tol_row of the code's rounding interval
    [lo * s', hi * s'] (a boundary tie, excused and counted). Anything else fails.
    """
    f = FORMATS[fmt]
    c_raw, o_raw = to_numpy(cand_codes), to_numpy(oracle_codes)
    prepared = _prepare(check, quantity, (cand_scales, oracle_scales), oracle_rotated, at_dtype_rotated,
                        block, bound, codes_pair=(c_raw, o_raw))
    if isinstance(prepared, CheckResult):
        return prepared
    cand_s, orc_s, x, at, tol = prepared
    valid_pattern, lo_table, hi_table = _rounding_intervals(fmt)
    values = _values(fmt)

    def as_patterns(raw):
        r = np.asarray(raw, np.float64)
        ok = np.isfinite(r) & (r == np.floor(r)) & (r >= 0) & (r < values.size)
        return np.where(ok, r, 0).astype(np.int64), ok

    c, c_in_range = as_patterns(c_raw)
    o, _ = as_patterns(o_raw)
    s = np.repeat(cand_s, block, axis=-1)  # each element's own block scale
    s_orc = np.repeat(orc_s, block, axis=-1)
    same = c_in_range & (c == o) & (s == s_orc)
    valid = c_in_range & valid_pattern[c] & np.repeat(_is_power_of_two(cand_s), block, axis=-1)
    exact = at == x
    tol_e = np.broadcast_to(tol, x.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        lo, hi = lo_table[c] * s, hi_table[c] * s
        distance = np.maximum(np.maximum(lo - x, x - hi), 0.0)
    judged = ~same & valid
    excused = judged & ~exact & (distance <= tol_e)
    follows_rule = np.zeros(x.shape, bool)
    at_exact = judged & exact
    if at_exact.any():
        follows_rule[at_exact] = quantize_at(x[at_exact], s[at_exact], fmt) == c[at_exact]
    excused |= follows_rule
    bad = ~same & ~excused
    scale_differs = ~(s == s_orc)
    by_scale = int((excused & scale_differs).sum())

    def first(where):
        cv, ov = values[c[where]], values[o[where]]
        if not c_in_range[where]:
            why = f"candidate code {np.asarray(c_raw)[where]!r} is no bit pattern of {fmt}"
        elif not valid_pattern[c[where]]:
            why = "not a code the quantizer produces (NaN or negative zero)"
        elif not valid[where]:
            why = "candidate scale is not a positive power of two"
        elif exact[where]:
            why = (f"exact at the dtype: tolerance 0, the tie rule gives "
                   f"0x{int(quantize_at(x[where], s[where], fmt)):02x} at the candidate's scale")
        else:
            why = "beyond the tolerance"
        return (f"candidate code 0x{c[where]:02x} (value {cv:g}) at scale {_scale_text(s[where])}, "
                f"oracle code 0x{o[where]:02x} (value {ov:g}) at scale {_scale_text(s_orc[where])}, "
                f"oracle rotated value {x[where]:.6g}, distance {distance[where]:.3g}, "
                f"tolerance {tol_e[where]:.3g} ({why})")

    extra = f" ({by_scale} in blocks whose scale differs)" if by_scale else ""
    return _result(check, quantity, "codes", bad, excused, first, extra)

"""A quantizer stage plug-in in plain numpy (docs/plugins.md): SPEC section 7a steps 2-3 written
from the SPEC alone, on the values the harness hands it. tests/test_quantizer_stage.py runs it
green bit for bit, and tests/plugins/quantizer_half_away.py plants a rounding bug in it.

Each format is its grid of non-negative values indexed by code (built from the bit layout); a
value is rounded by finding its two neighbours on the grid and comparing the two distances, which
are exact (neighbouring grid values are at most a factor 2 apart, so both subtractions are exact).
"""

from __future__ import annotations

import numpy as np

STAGE = "quantizer"
ARRAYS = "numpy"

# format -> (exponent bias, mantissa bits, finite non-negative codes, Qmax, amax floor, sign bit)
FORMATS = {
    "e2m1": (1, 1, 8, 6.0, 6.0 * 2.0**-126, 0x8),
    "e4m3": (7, 3, 127, 448.0, 1e-4, 0x80),  # OCP e4m3fn: 0x7f is NaN, so codes 0..126
}


def grid(fmt: str) -> np.ndarray:
    """The value of each non-negative code, float64 (exact): subnormal where the exponent field is 0."""
    bias, mbits, n, _, _, _ = FORMATS[fmt]
    code = np.arange(n)
    field, mant = code >> mbits, code & ((1 << mbits) - 1)
    return np.where(field == 0, mant * 2.0 ** (1 - bias - mbits),
                    (1.0 + mant / 2.0**mbits) * 2.0 ** (field - bias))


def quantize(x, quant, half_away: bool = False):
    """x [..., DI] (wide dtype) -> (codes uint8 [..., DI], scales float32 [..., DI / block])."""
    x = np.asarray(x)
    wide = x.dtype
    bias, mbits, n, qmax, tiny, sign_bit = FORMATS[quant["format"]]
    block = quant["block"]
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    # Step 2, in the wide dtype: amax, a = amax * (1 / Qmax) (the reciprocal rounded first), and
    # the smallest power of two >= a (a = m * 2**e with m in [0.5, 1): 2**(e-1) when m is 0.5).
    amax = np.maximum(np.abs(blocks).max(axis=-1), wide.type(tiny))
    a = amax * wide.type(1.0 / qmax)
    m, e = np.frexp(a)
    scales = np.ldexp(np.ones_like(a), np.where(m == 0.5, e - 1, e)).astype(wide)
    # Step 3: the grid value nearest to clip(x / s), ties to the even code (or, the planted bug,
    # away from zero: the larger magnitude).
    v = np.clip(blocks / scales[..., None], wide.type(-qmax), wide.type(qmax))
    values = grid(quant["format"]).astype(wide)
    mag = np.abs(v)
    lo = np.searchsorted(values, mag, side="right") - 1
    hi = np.minimum(lo + 1, n - 1)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    tie_up = np.ones_like(lo, dtype=bool) if half_away else (hi % 2 == 0)
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & tie_up), hi, lo)
    code = np.where((v < 0) & (code > 0), code | sign_bit, code)  # zero is always the positive code
    return code.reshape(x.shape).astype(np.uint8), scales.astype(np.float32)


def quantizer(x, quant):
    if type(x) is not np.ndarray:
        raise TypeError(f"handed {type(x).__name__}, not a numpy array")
    return quantize(x, quant)


def int64_codes():
    """The same quantizer returning its codes as int64 (torch_ref's own dtype), not uint8: an error."""
    import types

    return types.SimpleNamespace(STAGE="quantizer", ARRAYS="numpy",
                                 quantizer=lambda x, quant: (quantize(x, quant)[0].astype(np.int64),
                                                             quantize(x, quant)[1]))


def jax_arrays():
    """The same quantizer without `ARRAYS`: it is handed JAX arrays (it raises otherwise)."""
    import types

    def quantizer_of_jax(x, quant):
        import jax

        if not isinstance(x, jax.Array):
            raise TypeError(f"handed {type(x).__name__}, not a JAX array")
        return quantize(np.asarray(x), quant)

    return types.SimpleNamespace(STAGE="quantizer", quantizer=quantizer_of_jax)

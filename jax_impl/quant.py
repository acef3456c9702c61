"""The quantization-aware indexer (SPEC section 7a): Hadamard rotation, UE8M0 block scales and
FP4 (e2m1) or FP8 (e4m3) codes, with a straight-through gradient.

For a vector of DI channels (one query head of one row, or one compressed key block):

1. rotation (`hadamard`): x <- (x @ H) * DI**-0.5 in the wide dtype, H the Sylvester Hadamard
   matrix of order DI, then rounded to the compute dtype;
2. per block of `block` channels, in the wide dtype: amax = max(max |x|, tiny),
   a = amax * (1 / Qmax) (the reciprocal rounded to the wide dtype first), and the scale
   s = the smallest power of two >= a;
3. the code c = clip(x / s, -Qmax, Qmax) rounded to the nearest value of the format, ties to
   the even code;
4. the indexer scores x_hat = c * s, wide (exact).

The rounding works on the value, not a float8 cast: x / s is exact (s is a power of two); its
binade 2**e (never below the format's smallest normal exponent) fixes the grid's spacing
2**(e - mantissa bits) there, and `jnp.round` (half to even) on the exact quotient by that
spacing picks the neighbour whose last mantissa bit is 0, the even code. No value ever goes
through `float8_e4m3fn`, whose cast gives NaN past 448: the clip bounds every quotient by
Qmax first.

Gradient (step 5): the derivative of x_hat with respect to the rotated x is the identity,
`stop_gradient(x_hat) + (x - stop_gradient(x))`, which equals x_hat exactly in the forward
(x - x is 0); the rotation differentiates as the matmul it is.

Codes and scales are outputs of their own: `codes` are the format's bit patterns (uint8; e2m1 in
the low nibble; zero is always the positive code 0), `scales` the powers of two (float32,
exact: the amax floor keeps every scale a normal float32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .precision import round_to, widen


@dataclasses.dataclass(frozen=True)
class Format:
    """A sign-magnitude minifloat: exponent bits, mantissa bits, the smallest normal exponent,
    the largest value (Qmax) and the amax floor of the scale (SPEC section 7a, step 2)."""

    exponent_bits: int
    mantissa_bits: int
    min_exponent: int
    qmax: float
    tiny: float


FORMATS = {
    "e2m1": Format(exponent_bits=2, mantissa_bits=1, min_exponent=0, qmax=6.0, tiny=6.0 * 2.0**-126),
    "e4m3": Format(exponent_bits=4, mantissa_bits=3, min_exponent=-6, qmax=448.0, tiny=1e-4),
}


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order n (a power of two), entries +-1, float64."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def rotate(x, quant, wide):
    """x [..., DI] (compute dtype) -> (x @ H) * DI**-0.5 in the wide dtype, rounded back to x's
    dtype; x itself when the config does not rotate."""
    if not quant.hadamard:
        return x
    di = x.shape[-1]
    h = jnp.asarray(hadamard_matrix(di), wide)
    return round_to(jnp.matmul(widen(x, wide), h) * (di**-0.5), x.dtype)


def _pow2_ceil(a):
    """The smallest power of two >= a (a > 0, finite): exact, from the binary exponent."""
    mant, exp = jnp.frexp(a)  # a = mant * 2**exp, mant in [0.5, 1)
    return jnp.where(mant == 0.5, a, jnp.ldexp(jnp.ones_like(a), exp))


def _binade(v, fmt: Format):
    """floor(log2 |v|), never below the smallest normal exponent (subnormals share its spacing)."""
    _, exp = jnp.frexp(v)
    return jnp.maximum(exp - 1, fmt.min_exponent)


def block_scales(x, quant, wide):
    """x [..., DI] -> the UE8M0 scale of each block [..., DI / block], wide."""
    fmt = FORMATS[quant.format]
    blocks = x.astype(wide).reshape(*x.shape[:-1], x.shape[-1] // quant.block, quant.block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.asarray(fmt.tiny, wide))
    return _pow2_ceil(amax * jnp.asarray(1.0 / fmt.qmax, wide))


def round_to_grid(v, fmt: Format):
    """v (|v| <= Qmax) rounded to the nearest value of the format, ties to the even code."""
    mag = jnp.abs(v)
    spacing = jnp.ldexp(jnp.ones_like(mag), _binade(mag, fmt) - fmt.mantissa_bits)
    return jnp.sign(v) * (jnp.round(mag / spacing) * spacing)


def encode(c, fmt: Format):
    """Values of the format -> their bit patterns, uint8 (zero: the positive code 0)."""
    mag = jnp.abs(c)
    e = _binade(mag, fmt)
    normal = mag >= 2.0**fmt.min_exponent
    mant = jnp.round(mag / jnp.ldexp(jnp.ones_like(mag), e - fmt.mantissa_bits)).astype(jnp.int32)
    field = jnp.where(normal, e - fmt.min_exponent + 1, 0)
    mant = jnp.where(normal, mant - 2**fmt.mantissa_bits, mant)
    sign = jnp.where(c < 0, 2 ** (fmt.exponent_bits + fmt.mantissa_bits), 0).astype(jnp.int32)
    return (sign + field.astype(jnp.int32) * 2**fmt.mantissa_bits + mant).astype(jnp.uint8)


def decode(codes, fmt: Format, wide):
    """Bit patterns (uint8, as `encode` writes them) -> the format's values, wide."""
    c = codes.astype(jnp.int32)
    sign = 2 ** (fmt.exponent_bits + fmt.mantissa_bits)
    field, mant = (c % sign) // 2**fmt.mantissa_bits, c % 2**fmt.mantissa_bits
    one = jnp.ones(c.shape, wide)
    subnormal = jnp.ldexp(mant.astype(wide), jnp.full(c.shape, fmt.min_exponent - fmt.mantissa_bits))
    normal = jnp.ldexp(one + jnp.ldexp(mant.astype(wide), jnp.full(c.shape, -fmt.mantissa_bits)),
                       field - 1 + fmt.min_exponent)
    return jnp.where(c >= sign, -one, one) * jnp.where(field == 0, subnormal, normal)


def quantize_parts(x, quant, wide):
    """Rotated x [..., DI] (compute dtype) -> (x_hat wide, codes as format values wide, scales
    [..., DI / block] wide). No gradient: `quantize_for_scoring` carries the straight-through one."""
    fmt = FORMATS[quant.format]
    xw = jax.lax.stop_gradient(x).astype(wide)
    scales = block_scales(xw, quant, wide)
    per_channel = jnp.repeat(scales, quant.block, axis=-1)
    codes = round_to_grid(jnp.clip(xw / per_channel, -fmt.qmax, fmt.qmax), fmt)
    return codes * per_channel, codes, scales


def quantize_for_scoring(x, quant, wide, imposed=None):
    """x [..., DI] in the compute dtype, after RoPE -> (the rotated and quantized values the
    indexer scores, wide, with the straight-through gradient (SPEC section 7a steps 1-5); their
    codes, uint8 [..., DI]; their scales, float32 [..., DI / block]). What a caller does not use,
    XLA does not compute.

    `imposed` = (codes, scales) of x's shape: score those instead of x's own (another run's
    codes, e.g. the float64 oracle's, SPEC section 10's common codes); the gradient still
    passes straight through x's own rotation."""
    rotated = rotate(x, quant, wide)
    fmt = FORMATS[quant.format]
    if imposed is None:
        x_hat, codes, scales = quantize_parts(rotated, quant, wide)
        codes, scales = encode(codes, fmt), scales.astype(jnp.float32)
    else:
        codes, scales = imposed
        x_hat = decode(codes, fmt, wide) * jnp.repeat(scales.astype(wide), quant.block, axis=-1)
    xw = rotated.astype(wide)
    scored = jax.lax.stop_gradient(x_hat) + (xw - jax.lax.stop_gradient(xw))
    return scored, codes, scales


def quantizer_stage(rotated, quant, wide):
    """The quantizer alone, from rotated values [..., DI]: (codes uint8, scales float32)."""
    _, codes, scales = quantize_parts(rotated, quant, wide)
    return encode(codes, FORMATS[quant.format]), scales.astype(jnp.float32)

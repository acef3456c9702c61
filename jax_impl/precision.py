"""Rounding to the compute dtype, exactly where SPEC section 2 rounds.

XLA may keep values in higher precision than their dtype inside a fusion
(`--xla_allow_excess_precision`, on by default): a bfloat16 value converted to
float32 and back can skip its rounding. Which roundings survive then depends on
fusion decisions, so the native and the head-chunked programs, or two XLA
versions, round differently (measured: up to 0.76% of a bfloat16 score row
between native and chunk 1). `round_to` first
rounds the mantissa with `lax.reduce_precision`, an explicit op that XLA keeps,
then casts: even if XLA later drops the cast pair, the value already carries
only the dtype's mantissa bits, so every cast rounds exactly once whatever the
fusion.

The reduce_precision keeps float32's 8 exponent bits and rounds only the
mantissa; the cast itself then applies the dtype's range (float16 subnormals and
overflow). With float16's own 5 exponent bits XLA would flush float16 subnormals
to zero, and JAX applies the same op to the cotangent: float16 gradients,
whose cotangents are often subnormal in float16, came out 10-50x less accurate
than torch's. (`lax.optimization_barrier` does not help: XLA:CPU's bfloat16
normalisation widens through it.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LOW = (jnp.dtype("bfloat16"), jnp.dtype("float16"))


def round_to(x, dtype):
    """x cast to `dtype`, rounded even if XLA would otherwise keep excess precision."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype in _LOW and jnp.finfo(x.dtype).nmant > jnp.finfo(dtype).nmant:
        x = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=jnp.finfo(dtype).nmant)
    return x.astype(dtype)


def project(a, w, wide):
    """a @ w in the compute dtype of `a`: products summed in the wide dtype (float32 for
    bfloat16/float16, as torch's CPU kernels and the TPU MXU do), rounded once to the dtype."""
    return round_to(jnp.matmul(a, w, preferred_element_type=wide), a.dtype)

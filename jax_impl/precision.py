"""Rounding to the compute dtype, exactly where SPEC section 2 rounds.

XLA may keep values in higher precision than their dtype inside a fusion
(`--xla_allow_excess_precision`, on by default): a bfloat16 value converted to
float32 and back can skip its rounding. Which roundings survive then depends on
fusion decisions, so the native and the head-chunked programs, or two XLA
versions, round differently (measured: up to 0.76% of a bfloat16 score row
between native and chunk 1). `round_to` rounds with an explicit
`lax.reduce_precision` first, which XLA never elides, so every cast to the
compute dtype rounds exactly once whatever the fusion.
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
    if dtype in _LOW:
        info = jnp.finfo(dtype)
        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)


def project(a, w, wide):
    """a @ w in the compute dtype of `a`: products summed in the wide dtype (float32 for
    bfloat16/float16, as torch's CPU kernels and the TPU MXU do), rounded once to the dtype."""
    return round_to(jnp.matmul(a, w, preferred_element_type=wide), a.dtype)

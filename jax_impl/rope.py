"""Interleaved, partial rotary position embedding (SPEC section 6).

Only the trailing `rope_head_dim` channels of each head rotate; within that
slice the channel pairs are (2i, 2i+1). The rotation runs in the wide dtype and
the result is cast back to the compute dtype.
"""

from __future__ import annotations

import jax.numpy as jnp

from .precision import round_to


def apply_rope(x, positions, rope_head_dim: int, theta: float, wide):
    """Rotate the trailing `rope_head_dim` channels of `x` at `positions`.

    x:         [..., T, (heads,) DI] in the compute dtype.
    positions: integer array broadcastable to x.shape[:-1] once a trailing axis
               is added; callers pass [B, T] or [B, T, 1] for per-head input.
    Returns an array of x's shape and dtype.
    """
    if rope_head_dim == 0:
        return x
    dtype = x.dtype
    keep = x.shape[-1] - rope_head_dim
    xw = x.astype(wide)
    passthrough, rot = xw[..., :keep], xw[..., keep:]
    half = rope_head_dim // 2
    inv_freq = theta ** (-2.0 * jnp.arange(half, dtype=wide) / rope_head_dim)
    angle = positions.astype(wide)[..., None] * inv_freq  # [..., half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    pairs = rot.reshape(*rot.shape[:-1], half, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    out = out.reshape(rot.shape)
    return round_to(jnp.concatenate([passthrough, out], axis=-1), dtype)

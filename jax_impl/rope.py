"""Interleaved, partial rotary position embedding (SPEC section 6).

Only the trailing `rope_head_dim` channels of each head rotate; within that
slice the channel pairs are (2i, 2i+1). The rotation runs in the wide dtype and
the result is cast back to the compute dtype.

YaRN (`rope_scaling`, DeepSeek-V4's compressed layers) changes the frequencies only: the
fast-rotating pairs (below `low`) keep theta**(-2i/d), the slow ones (above `high`) are
divided by the factor, and a linear ramp joins them. No attention factor: cos and sin are
not scaled.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .precision import round_to


def yarn_bounds(scaling, rope_head_dim: int, theta: float) -> tuple[float, float]:
    """(low, high): the pair indices where YaRN's ramp starts and ends (SPEC section 6).
    At theta 160000, d = 64, original length 65536, betas 32 / 1: (15, 25)."""
    d = rope_head_dim

    def corr(beta: float) -> float:
        return d * math.log(scaling.original_max_position / (2 * math.pi * beta)) / (2 * math.log(theta))

    low = max(math.floor(corr(scaling.beta_fast)), 0)
    high = min(math.ceil(corr(scaling.beta_slow)), d - 1)
    return float(low), float(high) + (0.001 if low == high else 0.0)


def inv_frequencies(rope_head_dim: int, theta: float, wide, scaling=None):
    """[DR/2] inverse frequencies in the wide dtype; `scaling` a config's YarnScaling or None."""
    i = jnp.arange(rope_head_dim // 2, dtype=wide)
    inv_freq = theta ** (-2.0 * i / rope_head_dim)
    if scaling is None:
        return inv_freq
    low, high = yarn_bounds(scaling, rope_head_dim, theta)
    ramp = jnp.clip((i - low) / (high - low), 0.0, 1.0)
    return inv_freq * (1 - ramp) + inv_freq / scaling.factor * ramp


def apply_rope(x, positions, rope_head_dim: int, theta: float, wide, scaling=None):
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
    inv_freq = inv_frequencies(rope_head_dim, theta, wide, scaling)
    angle = positions.astype(wide)[..., None] * inv_freq  # [..., half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    pairs = rot.reshape(*rot.shape[:-1], half, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    out = out.reshape(rot.shape)
    return round_to(jnp.concatenate([passthrough, out], axis=-1), dtype)

"""The indexer's key compressor: gated overlap pooling (SPEC section 5).

Every `m` tokens form a block. Each token projects to `2*DI` channels of kv and
of gate; the first DI channels (`a`) are its share of the NEXT block, the last
DI (`b`) its share of its own. Block `w` pools 2m slots, the `a` of block w-1
then the `b` of block w, with a per-channel softmax over the slots. Where
block w-1 does not exist or belongs to another document, its slots are empty
(kv 0, gate -inf). The pooled vector is RMS-normalised and rotated at the
block's first position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .precision import project, round_to
from .rope import apply_rope


def block_positions(position_ids, m: int, num_blocks: int):
    """Position of each block's first token: [B, W]."""
    return position_ids[:, : num_blocks * m : m]


def previous_block_continues(position_ids, m: int, num_blocks: int):
    """[B, W] bool: block w-1 is the same document, directly before block w."""
    first = block_positions(position_ids, m, num_blocks)
    cont = first[:, 1:] == first[:, :-1] + m
    return jnp.concatenate([jnp.zeros((first.shape[0], 1), bool), cont], axis=1)[:, :num_blocks]


def compress_keys(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide):
    """Compressed indexer keys K [B, W, DI] in x's (compute) dtype.

    x: [B, S, E] already in the compute dtype; weights already in it too
    (kv_norm may be wide: it scales a wide-dtype value).
    """
    return compress_parts(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide)[0]


def compress_parts(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide):
    """(K [B, W, DI] in the compute dtype, the pooled vectors before the norm [B, W, DI] wide)."""
    b, s, _ = x.shape
    m, di = cfg.compress_ratio, cfg.index_head_dim
    w = cfg.num_blocks(s)
    u = w * m
    x = x[:, :u]
    kv = project(x, wkv, wide).reshape(b, w, m, 2 * di)
    gate = project(x, wgate, wide).reshape(b, w, m, 2 * di)
    gate = round_to(gate.astype(wide) + ape.astype(wide), x.dtype)  # the add in the compute dtype
    kv_a, kv_b = kv[..., :di], kv[..., di:]
    gate_a, gate_b = gate[..., :di].astype(wide), gate[..., di:].astype(wide)

    # Shift `a` by one block: block w sees block w-1's `a` slots.
    cont = previous_block_continues(position_ids, m, w)[:, :, None, None]
    kv_prev = jnp.pad(kv_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]
    gate_prev = jnp.pad(gate_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]
    kv_prev = jnp.where(cont, kv_prev, jnp.zeros((), kv.dtype))
    gate_prev = jnp.where(cont, gate_prev, -jnp.inf)

    slots_kv = jnp.concatenate([kv_prev, kv_b], axis=2).astype(wide)  # [B, W, 2m, DI]
    slots_gate = jnp.concatenate([gate_prev, gate_b], axis=2)
    weights = jax.nn.softmax(slots_gate, axis=2)
    pooled = jnp.sum(slots_kv * weights, axis=2)  # [B, W, DI], wide

    ms = jnp.mean(pooled * pooled, axis=-1, keepdims=True)
    normed = kv_norm.astype(wide) * pooled / jnp.sqrt(ms + cfg.norm_eps)
    keys = round_to(normed, x.dtype)
    return apply_rope(keys, block_positions(position_ids, m, w), cfg.rope_head_dim, cfg.rope_theta, wide,
                      cfg.rope_scaling), pooled


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


def compress_keys(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide, halo=None):
    """Compressed indexer keys K [B, W, DI] in x's (compute) dtype.

    x: [B, S, E] already in the compute dtype; weights already in it too
    (kv_norm may be wide: it scales a wide-dtype value). `halo`: see `compress_parts`.
    """
    return compress_parts(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide, halo)[0]


def previous_slots(kv_a, gate_a, first, m: int, halo=None):
    """What block w pools of block w-1: (kv [B, W, m, DI], gate [B, W, m, DI], block w-1 continues
    [B, W, 1, 1]), kv 0 and gate -inf where it does not (SPEC section 5, rule 3).

    kv_a / gate_a: every block's `a` slots ([B, W, m, DI]; gate wide), first: each block's first
    position [B, W]. Block 0's previous block is not in these rows; without `halo` there is none
    (the rows start the sequence). On a device that holds a stretch of the sequence
    (jax_impl.sharded), `halo(kv_a[:, -1], gate_a[:, -1], first[:, -1])` returns what the device
    before it sent of ITS last block: (kv [B, m, DI], gate [B, m, DI], first [B], exists: whether
    there is such a device), and the document rule is applied to it exactly as to the others."""
    b, w = first.shape
    if halo is None:
        kv_prev = jnp.pad(kv_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]
        gate_prev = jnp.pad(gate_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]
        first_prev = jnp.pad(first, ((0, 0), (1, 0)))[:, :w]
        exists = jnp.arange(w) > 0
    else:
        kv_h, gate_h, first_h, exists_h = halo(kv_a[:, -1], gate_a[:, -1], first[:, -1])
        kv_prev = jnp.concatenate([kv_h[:, None].astype(kv_a.dtype), kv_a[:, :-1]], axis=1)
        gate_prev = jnp.concatenate([gate_h[:, None].astype(gate_a.dtype), gate_a[:, :-1]], axis=1)
        first_prev = jnp.concatenate([first_h[:, None], first[:, :-1]], axis=1)
        exists = jnp.concatenate([jnp.reshape(exists_h, (1,)), jnp.ones((w - 1,), bool)])
    cont = (exists[None, :] & (first == first_prev + m))[:, :, None, None]
    kv_prev = jnp.where(cont, kv_prev, jnp.zeros((), kv_a.dtype))
    gate_prev = jnp.where(cont, gate_prev, -jnp.inf)
    return kv_prev, gate_prev, cont


def compress_parts(x, position_ids, wkv, wgate, ape, kv_norm, cfg, wide, halo=None):
    """(K [B, W, DI] in the compute dtype, the pooled vectors before the norm [B, W, DI] wide).

    `halo`: where block 0's previous block comes from when these rows do not start the
    sequence (`previous_slots`; jax_impl.sharded's sequence axis)."""
    b, s, _ = x.shape
    m, di = cfg.compress_ratio, cfg.index_head_dim
    w = cfg.num_blocks(s)
    u = w * m
    x = x[:, :u]
    # The keys' cotangent sums every head and query block: their weights' gradients keep its
    # float32 bits whatever the matmul precision (`project`'s exact_weight_grad).
    kv = project(x, wkv, wide, exact_weight_grad=True).reshape(b, w, m, 2 * di)
    gate = project(x, wgate, wide, exact_weight_grad=True).reshape(b, w, m, 2 * di)
    gate = round_to(gate.astype(wide) + ape.astype(wide), x.dtype)  # the add in the compute dtype
    kv_a, kv_b = kv[..., :di], kv[..., di:]
    gate_a, gate_b = gate[..., :di].astype(wide), gate[..., di:].astype(wide)

    # Shift `a` by one block: block w sees block w-1's `a` slots.
    kv_prev, gate_prev, _ = previous_slots(kv_a, gate_a, block_positions(position_ids, m, w), m, halo)

    slots_kv = jnp.concatenate([kv_prev, kv_b], axis=2).astype(wide)  # [B, W, 2m, DI]
    slots_gate = jnp.concatenate([gate_prev, gate_b], axis=2)
    weights = jax.nn.softmax(slots_gate, axis=2)
    pooled = jnp.sum(slots_kv * weights, axis=2)  # [B, W, DI], wide

    ms = jnp.mean(pooled * pooled, axis=-1, keepdims=True)
    normed = kv_norm.astype(wide) * pooled / jnp.sqrt(ms + cfg.norm_eps)
    keys = round_to(normed, x.dtype)
    return apply_rope(keys, block_positions(position_ids, m, w), cfg.rope_head_dim, cfg.rope_theta, wide,
                      cfg.rope_scaling), pooled


"""Pallas kernels for the head-summed ReLU index scores, forward and backward.

    contribution[b, s, j] = sum_h w[b, s, h] * relu(q[b, s, h] . K[b, j])

(`jax_impl.scoring.raw_scores` applies the DI**-0.5 scale after the head sum, on either
backend.) Three kernels, each tiled over (query rows, key blocks) per batch row, each with the
head loop inside the kernel, accumulating in the wide dtype (float32; float64 in interpret mode):

- `_scores_kernel`  grid (B, S-tiles, W-tiles): one [ts, tw] output tile, summed over heads.
- `_dq_dw_kernel`   grid (B, S-tiles, W-tiles), the key tiles innermost: recomputes each
  head's [ts, tw] logits and accumulates dq [c, ts, DI] and dw [ts, c] over the key tiles.
- `_dk_kernel`      grid (B, W-tiles, S-tiles), the query tiles innermost: recomputes the
  logits and accumulates dK [tw, DI] over the query tiles.

No [B, c, S, W] array exists outside a kernel, forward or backward: a head's logits live in
one [ts, tw] tile. `contribution` is wired with `jax.custom_vjp`; its residuals are the inputs.

Partial tiles: S and W need not be multiples of the tiles. The last tile of each axis reads
past the array (on TPU: whatever lies there; in interpret mode: NaN) and writes only its
in-bounds part. The forward needs no mask (a garbage row or column only reaches output
entries that are never written); the backward kernels sum over the tiled axis, so they mask
the rows (dK) or key blocks (dq, dw) past the end with `jnp.where` before any product.

Inputs may be in the compute dtype (bfloat16: the kernel widens in VMEM; a bfloat16 product
is exact in float32, so this equals widening first) or already wide. Head weights are wide.
On a TPU the kernels compile with Mosaic; anywhere else they run in Pallas interpret mode
(`jax.lax.platform_dependent` picks per lowering platform, so one program exports for TPU
from a CPU machine).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Default tiles (query rows, key blocks). TPU legality: the last two dims of every block are
# multiples of (8, 128) for 32-bit types and (16, 128) for 16-bit ones, or the whole dim. The
# blocks are q [c, ts, DI], K [tw, DI], w [ts, c], scores/cotangent [ts, tw], dK [tw, DI]:
# ts a multiple of 16 and tw of 128 are legal in every dtype, c and DI are whole dims.
ROW_TILE = 128
KEY_TILE = 512
# The sublane multiple a row tile needs per itemsize of the narrowest block dtype.
SUBLANES = {4: 8, 2: 16, 8: 8}
LANES = 128


@dataclasses.dataclass(frozen=True)
class Tiles:
    """(query rows, key blocks) per kernel step. `legal` checks the TPU rule for a problem."""

    rows: int
    keys: int

    def legal(self, seq_len: int, num_blocks: int, itemsize: int) -> str | None:
        """None when legal on TPU for [.., S, W] with inputs of `itemsize` bytes, else why not."""
        sub = SUBLANES[itemsize]
        if self.rows != seq_len and self.rows % sub:
            return f"row tile {self.rows} is neither S={seq_len} nor a multiple of {sub}"
        if self.keys != num_blocks and self.keys % LANES:
            return f"key tile {self.keys} is neither W={num_blocks} nor a multiple of {LANES}"
        return None


def default_tiles(seq_len: int, num_blocks: int) -> Tiles:
    """TPU-legal tiles for rows [.., S] and blocks [.., W]: the whole axis when it fits in one
    default tile, else the default tile (ROW_TILE, KEY_TILE; the last tile is partial when
    the tile does not divide the axis)."""
    rows = seq_len if seq_len <= ROW_TILE else ROW_TILE
    keys = num_blocks if num_blocks <= KEY_TILE else KEY_TILE
    return Tiles(max(rows, 1), max(keys, 1))


def _wide_of(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def _dot(a, b, contract, wide):
    """a . b over the `contract` dims ((a_dim,), (b_dim,)), accumulated in `wide`. Equal
    narrow operands multiply as they are (their products are exact in `wide`); otherwise
    both are widened and multiplied at full precision."""
    if a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize >= jnp.dtype(wide).itemsize:
        a, b = a.astype(wide), b.astype(wide)
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=wide)


def _over_heads(heads, body, init):
    """`body(h, carry)` for h = 0 .. heads - 1 (an int32 counter: Mosaic indexes in 32 bits,
    also under jax_enable_x64)."""
    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(heads), body, init)


def _head_column(w, h):
    """Column h of the [ts, c] head-weight tile as [ts, 1] (a lane select-and-sum: dynamic h)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
    return jnp.sum(jnp.where(lane == h, w, 0), axis=1, keepdims=True)


# ----------------------------------------------------------------------------------- kernels


def _scores_kernel(q_ref, k_ref, w_ref, o_ref, *, heads):
    wide = o_ref.dtype
    k = k_ref[...]
    w = w_ref[...]

    def head(h, acc):
        logits = _dot(q_ref[h], k, ((1,), (1,)), wide)  # [ts, tw]
        return acc + _head_column(w, h) * jnp.maximum(logits, 0)

    o_ref[...] = _over_heads(heads, head, jnp.zeros(o_ref.shape, wide))


def _dq_dw_kernel(q_ref, k_ref, w_ref, g_ref, dq_ref, dw_ref, *, heads, num_blocks, key_tile):
    wide = dq_ref.dtype
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        dq_ref[...] = jnp.zeros(dq_ref.shape, wide)
        dw_ref[...] = jnp.zeros(dw_ref.shape, wide)

    # Key blocks past W (the last key tile): zero keys and cotangent before any product.
    block = j * key_tile + jax.lax.broadcasted_iota(jnp.int32, (key_tile, 1), 0)
    k = jnp.where(block < num_blocks, k_ref[...], 0)
    g = jnp.where(block.reshape(1, key_tile) < num_blocks, g_ref[...], 0)
    w = w_ref[...]
    lane = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)

    def head(h, dw):
        q = q_ref[h]
        logits = _dot(q, k, ((1,), (1,)), wide)  # [ts, tw]
        m = jnp.where(logits > 0, g, 0)  # d contribution / d logits, before the head weight
        mk = _dot(m, k, ((1,), (0,)), wide)  # [ts, DI]
        dq_ref[h] += _head_column(w, h) * mk
        return dw + jnp.where(lane == h, jnp.sum(m * logits, axis=1, keepdims=True), 0)

    dw_ref[...] += _over_heads(heads, head, jnp.zeros(dw_ref.shape, wide))


def _dk_kernel(q_ref, k_ref, w_ref, g_ref, dk_ref, *, heads, seq_len, row_tile):
    wide = dk_ref.dtype
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        dk_ref[...] = jnp.zeros(dk_ref.shape, wide)

    # Query rows past S (the last row tile): zero rows, weights and cotangent before any product.
    row_ok = i * row_tile + jax.lax.broadcasted_iota(jnp.int32, (row_tile, 1), 0) < seq_len
    k = k_ref[...]
    w = jnp.where(row_ok, w_ref[...], 0)
    g = jnp.where(row_ok, g_ref[...], 0)

    def head(h, acc):
        q = jnp.where(row_ok, q_ref[h], 0)
        logits = _dot(q, k, ((1,), (1,)), wide)  # [ts, tw]
        p = jnp.where(logits > 0, g, 0) * _head_column(w, h)  # [ts, tw]
        return acc + _dot(p.T, q, ((1,), (0,)), wide)  # [tw, DI]

    dk_ref[...] += _over_heads(heads, head, jnp.zeros(dk_ref.shape, wide))


# ----------------------------------------------------------------------------------- calls


def _specs(c, di, tiles, by_rows):
    """BlockSpecs of (q [B, c, S, DI], K [B, W, DI], w [B, S, c], g [B, S, W]) for a grid
    (b, outer, inner): rows outer and key blocks inner (`by_rows`), or the reverse."""
    ts, tw = tiles.rows, tiles.keys

    def rk(f):  # index map in terms of (b, row tile, key tile)
        return (lambda b, i, j: f(b, i, j)) if by_rows else (lambda b, j, i: f(b, i, j))

    return [pl.BlockSpec((None, c, ts, di), rk(lambda b, i, j: (b, 0, i, 0))),
            pl.BlockSpec((None, tw, di), rk(lambda b, i, j: (b, j, 0))),
            pl.BlockSpec((None, ts, c), rk(lambda b, i, j: (b, i, 0))),
            pl.BlockSpec((None, ts, tw), rk(lambda b, i, j: (b, i, j)))]


def _call(kernel, name, by_rows, out_shape, out_specs, args, tiles, interpret, **static):
    """pallas_call of `kernel` over (B, row tiles, key tiles) (`by_rows`; else key tiles
    outermost after B), the innermost axis a reduction ("arbitrary") unless nothing reduces."""
    qt, keys = args[0], args[1]
    b, c, s, di = qt.shape
    nw = keys.shape[1]
    specs = _specs(c, di, tiles, by_rows)
    rows, blocks = pl.cdiv(s, tiles.rows), pl.cdiv(nw, tiles.keys)
    inner = "parallel" if len(args) == 3 else "arbitrary"
    return pl.pallas_call(
        functools.partial(kernel, heads=c, **static),
        out_shape=out_shape,
        grid=(b, rows, blocks) if by_rows else (b, blocks, rows),
        in_specs=specs[:len(args)], out_specs=out_specs(specs),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", inner)),
        interpret=interpret, name=name,
    )(*args)


def _scores_call(qt, keys, w, tiles, interpret):
    b, _, s, _ = qt.shape
    wide = _wide_of(qt.dtype, keys.dtype, w.dtype)
    return _call(_scores_kernel, "csa_index_scores", True, jax.ShapeDtypeStruct((b, s, keys.shape[1]), wide),
                 lambda specs: specs[3], (qt, keys, w), tiles, interpret)


def _dq_dw_call(qt, keys, w, g, tiles, interpret):
    b, c, s, di = qt.shape
    shapes = (jax.ShapeDtypeStruct((b, c, s, di), g.dtype), jax.ShapeDtypeStruct((b, s, c), g.dtype))
    return _call(_dq_dw_kernel, "csa_index_scores_dq_dw", True, shapes, lambda specs: (specs[0], specs[2]),
                 (qt, keys, w, g), tiles, interpret, num_blocks=keys.shape[1], key_tile=tiles.keys)


def _dk_call(qt, keys, w, g, tiles, interpret):
    b, _, s, di = qt.shape
    shape = jax.ShapeDtypeStruct((b, keys.shape[1], di), g.dtype)
    return _call(_dk_kernel, "csa_index_scores_dk", False, shape, lambda specs: specs[1],
                 (qt, keys, w, g), tiles, interpret, seq_len=s, row_tile=tiles.rows)


def _on_platform(call, *args):
    """`call(*args, interpret)`: compiled by Mosaic when lowered for TPU, interpreted elsewhere."""
    return jax.lax.platform_dependent(*args, tpu=functools.partial(call, interpret=False),
                                      default=functools.partial(call, interpret=True))


def _check(q, keys, w, tiles):
    if q.ndim != 4 or keys.ndim != 3 or w.shape != q.shape[:3] or keys.shape[0] != q.shape[0] \
            or keys.shape[2] != q.shape[3]:
        raise ValueError(f"contribution: q [B,S,c,DI], keys [B,W,DI], w [B,S,c] expected, got q {q.shape}, "
                         f"keys {keys.shape}, w {w.shape}")
    if not (isinstance(tiles.rows, int) and isinstance(tiles.keys, int) and tiles.rows >= 1 and tiles.keys >= 1):
        raise ValueError(f"tiles={tiles!r} must be two ints >= 1 (query rows, key blocks)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _contribution(q, keys, w, tiles):
    qt = jnp.swapaxes(q, 1, 2)  # [B, c, S, DI]: one head's rows are one leading index in VMEM
    return _on_platform(functools.partial(_scores_call, tiles=tiles), qt, keys, w)


def _contribution_fwd(q, keys, w, tiles):
    return _contribution(q, keys, w, tiles), (q, keys, w)


def _contribution_bwd(tiles, res, g):
    q, keys, w = res
    qt = jnp.swapaxes(q, 1, 2)
    dqt, dw = _on_platform(functools.partial(_dq_dw_call, tiles=tiles), qt, keys, w, g)
    dk = _on_platform(functools.partial(_dk_call, tiles=tiles), qt, keys, w, g)
    return jnp.swapaxes(dqt, 1, 2).astype(q.dtype), dk.astype(keys.dtype), dw.astype(w.dtype)


_contribution.defvjp(_contribution_fwd, _contribution_bwd)


def contribution(q, keys, w, tiles: Tiles | None = None):
    """sum_h w[b,s,h] * relu(q[b,s,h] . K[b,j]), [B, S, W] in the wide dtype of the inputs,
    by the Pallas kernels (custom VJP: the backward kernels).

    q [B, S, c, DI] and keys [B, W, DI] in the compute dtype or wide, w [B, S, c] wide.
    `tiles`: (query rows, key blocks) per step; default `default_tiles(S, W)`."""
    tiles = tiles or default_tiles(q.shape[1], keys.shape[1])
    _check(q, keys, w, tiles)
    if q.shape[1] == 0 or keys.shape[1] == 0 or q.shape[2] == 0:
        # Nothing to tile (no rows, blocks or heads): an empty or zero sum, no kernel.
        return jnp.zeros((q.shape[0], q.shape[1], keys.shape[1]), _wide_of(q.dtype, keys.dtype, w.dtype))
    return _contribution(q, keys, w, tiles)

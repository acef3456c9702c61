"""Pallas kernels for the head-summed ReLU index scores, forward and backward, and for the
teacher's head-summed block probabilities.

    contribution[b, s, j] = sum_h w[b, s, h] * relu(q[b, s, h] . K[b, j])

(`jax_impl.scoring.raw_scores` applies the DI**-0.5 scale after the head sum, on either
backend.) Three kernels, each tiled over (query rows, key blocks) per batch row, each with the
head loop inside the kernel, accumulating in VMEM scratch in the wide dtype (float32; float64
in interpret mode):

- `_scores_kernel`  grid (B, S-tiles, W-tiles): one output tile, summed over heads.
- `_dq_kernel`      grid (B, S-tiles, W-tiles), the key tiles innermost (the reduction):
  recomputes each head's logits and accumulates dq (transposed, [c, DI, ts]) over the key
  tiles; the last key tile applies the head weights and writes dq [c, ts, DI] and
  dw[s, h] = q[s, h] . (dq[s, h] / w[s, h]) (the same double sum over blocks and DI, reordered).
- `_dk_kernel`      grid (B, W-tiles, S-tiles), the query tiles innermost: recomputes the
  logits and accumulates dK [tw, DI] over the query tiles.

The teacher (`teacher_block_max`, `teacher_block_sumexp`, `teacher_block_probs`; no gradient,
the teacher is detached) takes the teacher's queries tq [B, r, h, D] as q, its blocks as K and
the loss's keep [B, r, W] (as a 0/1 tile) in place of a cotangent, with the same grid, tiles,
tile skipping and products: `_teacher_norm_kernel` reduces each head's kept logits over the key
tiles to their max, or to the sum of exp(logit - shift) for a given shift; `_teacher_probs_kernel`
writes one tile of sum_h exp(logit_h - n_h) (times r_h), 0 where not kept. The caller
(`jax_impl.loss`) joins the sink and window logits between them, so that every exp takes the
argument XLA's softmax gives it (on a TPU exp is only within ~5e-6 of the true value, so
another argument, or an online softmax's rescaling, would move the probabilities by that much).

Layout. Inside a kernel a head's logits are the transposed tile [tw, ts] = K . q_h^T, so that
the head weights of the rows, w [c, 1, ts], broadcast along sublanes (a row vector per head,
picked by a leading index) and no per-head transpose is needed; the forward transposes its
accumulated tile once, and each backward kernel the cotangent tile once per step. No
[B, c, S, W] array exists outside a kernel, forward or backward; `contribution` is wired with
`jax.custom_vjp`, its residuals are the inputs.

Products (`_dot`): every dot names its precision and its preferred element type, so a global
`jax.default_matmul_precision` cannot change it. Two equal narrow operands (bfloat16)
multiply at DEFAULT precision into float32 (a bfloat16 product is exact in float32); two
float32 operands at HIGHEST (Mosaic's fp32 contract precision); float64 (interpret mode
only) at HIGHEST. A float32 operand meeting a bfloat16 one (the cotangent against the keys or
the queries in the backward) is split into two bfloat16 terms, hi + lo, each multiplied at
DEFAULT precision: ~16 significant bits, the precision of XLA's HIGH, at two MXU passes
instead of HIGHEST's six. float16 inputs (interpret mode only: no float16 kernels on TPU)
are widened to float32 in VMEM. Interpret mode multiplies the bfloat16 operands as float32
(the same exact products and float32 sums), since XLA:CPU lacks the mixed dot.

Tile skipping (`valid`): a (row tile, key tile) pair with no valid entry (wholly past the
causal diagonal, in another document, past the end of the rows) is never computed. Its
scores are 0 and its cotangent is ignored, so the function the kernels differentiate is the
contribution on live tiles and 0 on dead ones, consistently forward and backward. The live
tiles reach the kernels as a bit table in SMEM (scalar prefetch); the index maps clamp the key
tile (forward, dq) or row tile (dK) into the live range of the current outer tile, so a dead
tile's inputs are not even copied (Pallas skips the DMA of an unchanged block).

Partial tiles: S and W need not be multiples of the tiles. The last tile of each axis reads
past the array (on TPU: whatever lies there; in interpret mode: NaN) and writes only its
in-bounds part. A garbage query row only reaches its own output row, except in dK (rows are
its reduction axis: rows, weights and cotangent past S are zeroed before any product); a
garbage key block only reaches its own output column, except in dq (blocks are its reduction
axis: keys past W are zeroed, which zeroes their logits and so their cotangent).

VMEM: every kernel declares its budget as data (`vmem_budget`: double-buffered blocks,
scratch, and an allowance for the body's tile temporaries), and passes it as the Mosaic
`vmem_limit_bytes`; tests/test_pallas.py checks the declared budget against the blocks and
scratch of the traced `pallas_call`.

On a TPU the kernels compile with Mosaic; anywhere else they run in Pallas interpret mode
(`jax.lax.platform_dependent` picks per lowering platform, so one program exports for TPU
from a CPU machine).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Default tiles (query rows, key blocks). TPU legality: rows lie on lanes (the head weights
# [c, 1, ts], the transposed logits [tw, ts]) and key blocks on lanes of the cotangent tile
# [ts, tw], so each tile is a multiple of 128 or the whole axis. bfloat16 inputs take 512-row
# tiles: measured on a v5e at the released shape (HI=64, S=8192, unroll 16), the stage's
# forward + backward 9.74 ms at 256 x 256, 9.07 ms at 512 x 256 (forward 2.41 -> 2.32 ms;
# `python -m benchmarks.tpu_speed --only stage --seqs 8192 --variants 256x256u16,512x256u16`).
# Other dtypes keep 256 rows, the only float32 tile compiled on a chip (the float32 dq kernel
# would declare 91 MiB of VMEM at 512 rows).
ROW_TILE = 256
NARROW_ROW_TILE = 512
KEY_TILE = 256
LANES = 128
# What a core's VMEM may hold for one kernel (v5e: 128 MiB per core); `vmem_budget` refuses
# tiles whose budget exceeds it.
VMEM_CAP = 100 * 2**20
# The least limit a kernel asks for. Measured on a v5e: at 16 MiB (Mosaic's default scoped
# limit there) the dK kernel of a small problem with a partial row tile (c=8, S=1000, W=250,
# tiles 256 x 128) needed 17.6 MiB (bfloat16) and 18.6 MiB (float32) of scoped VMEM for its
# own temporaries, far above its blocks; 32 MiB leaves room for that.
VMEM_FLOOR = 32 * 2**20
# The body's own temporaries, in [tw, ts] float32 tiles (logits, masked cotangent, its two
# bfloat16 terms, the product) and [*, DI] float32 rows: what Mosaic may hold beside the
# blocks and the scratch. An allowance, not a measurement: the chip's compile is the judge.
TEMP_TILES = 8
# Live tiles: 32 key tiles per int32 word of the table.
WORD = 32
WORD_BITS = 5  # log2(WORD): j // WORD as a shift (no signed division in the kernel)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """(query rows, key blocks) per kernel step. `legal` checks the TPU rule for a problem."""

    rows: int
    keys: int
    # Heads per iteration of the in-kernel head loop, for bfloat16 operands (float32 kernels
    # loop one head at a time: the only float32 form compiled on a chip so far). Measured on a
    # v5e at HI=64, S=8192, 256 x 256 tiles (benchmarks/tpu_speed.py --variants): forward
    # 3.64 / 2.50 / 2.41 / 2.31 ms and forward + backward 17.1 / 10.2 / 9.74 / 9.45 ms at 1, 8,
    # 16 and 64 heads; at 512 x 256, 8 and 16 heads: 9.27 and 9.07 ms. 16 compiles the
    # backward in 13-18 s, 64 in 27 s.
    unroll: int = 16

    def legal(self, seq_len: int, num_blocks: int, itemsize: int = 4) -> str | None:
        """None when legal on TPU for [.., S, W] (inputs of `itemsize` bytes), else why not."""
        del itemsize  # both tiles lie on lanes: the rule is the same in every dtype
        if self.rows != seq_len and self.rows % LANES:
            return f"row tile {self.rows} is neither S={seq_len} nor a multiple of {LANES}"
        if self.keys != num_blocks and self.keys % LANES:
            return f"key tile {self.keys} is neither W={num_blocks} nor a multiple of {LANES}"
        return None


def default_tiles(seq_len: int, num_blocks: int, dtype=None) -> Tiles:
    """TPU-legal tiles for rows [.., S] and blocks [.., W] of q in `dtype`: the whole axis when
    it fits in one default tile, else the default tile (rows: NARROW_ROW_TILE for bfloat16,
    ROW_TILE otherwise; keys: KEY_TILE; the last tile is partial when the tile does not divide
    the axis)."""
    row_tile = NARROW_ROW_TILE if dtype is not None and jnp.dtype(dtype) == jnp.bfloat16 else ROW_TILE
    rows = seq_len if seq_len <= row_tile else row_tile
    keys = num_blocks if num_blocks <= KEY_TILE else KEY_TILE
    return Tiles(max(rows, 1), max(keys, 1))


def _wide_of(*dtypes):
    return jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes) else jnp.float32


def operand_dtype(dtype, wide):
    """The dtype the kernels multiply inputs of `dtype` in: bfloat16 as it is, anything else
    in `wide` (float16 has no TPU kernel; interpret mode widens it)."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(wide)


def _dot(a, b, contract, wide, dd):
    """a . b over the `contract` dims ((a_dim,), (b_dim,)) of two operands of one dtype,
    multiplied in `dd` and accumulated in `wide`, the precision named: DEFAULT for bfloat16
    (exact products, float32 accumulation), HIGHEST for float32 and float64. `dd` is the
    operands' dtype, except in interpret mode, where bfloat16 operands are multiplied as
    float32 (the same exact products and float32 sums: XLA:CPU has no bfloat16 x bfloat16 ->
    float32 dot in every program shape)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    a, b = a.astype(dd), b.astype(dd)
    precision = jax.lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=(precision, precision),
                               preferred_element_type=wide)


def _terms(x, od):
    """x (wide) as the operands that meet an `od` operand: (hi, lo) bfloat16 terms, hi + lo
    within ~2**-16 of x, when od is bfloat16; else x itself."""
    if od != jnp.bfloat16:
        return (x.astype(od),)
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(x.dtype)).astype(jnp.bfloat16)


def _dot_terms(terms, other, contract, wide, dd, terms_first):
    """sum over `terms` of term . other (or other . term)."""
    out = None
    for t in terms:
        d = _dot(t, other, contract, wide, dd) if terms_first else _dot(other, t, contract, wide, dd)
        out = d if out is None else out + d
    return out


def _over_heads(heads, body, unroll=1):
    """`body(h)` for h = 0 .. heads - 1, `unroll` heads per iteration of a loop with an int32
    counter (Mosaic indexes in 32 bits, also under jax_enable_x64; fori_loop's own `unroll`
    would count in Python ints, int64 there), the remainder after the loop."""
    u = max(1, min(unroll, heads))
    groups, rest = divmod(heads, u)

    def step(g, carry):
        for k in range(u):
            body(g * u + k)
        return carry

    if groups:
        jax.lax.fori_loop(jnp.int32(0), jnp.int32(groups), step, jnp.int32(0))
    for k in range(rest):
        body(jnp.int32(groups * u + k))


def tile_is_live(bits_ref, b, i, j, nr, nwords):
    """Inside a kernel: whether tile (row tile i, key tile j) of batch row b holds a valid entry,
    read from the `LiveTiles` bit table (`bits`, scalar-prefetched; nr row tiles, nwords words a
    row tile)."""
    word = bits_ref[(b * nr + i) * nwords + jax.lax.shift_right_logical(j, jnp.int32(WORD_BITS))]
    return jax.lax.shift_right_logical(word, j & jnp.int32(WORD - 1)) & 1 == 1


def _transpose(x):
    """x.T, through float32 for a 16-bit x (the 32-bit transpose is the one every Mosaic
    version lowers; the round trip is exact)."""
    if jnp.dtype(x.dtype).itemsize < 4:
        return x.astype(jnp.float32).T.astype(x.dtype)
    return x.T


# ----------------------------------------------------------------------------------- kernels


def _head_sum_tile(bits, q_ref, k_ref, o_ref, acc_ref, term, finish, *, nr, nwords, heads, od, dd, unroll):
    """One output tile of a head sum: on a live tile acc [tw, ts] = sum_h term(h, logits_h),
    logits_h = K . q_h^T, and the tile finish(acc) [ts, tw]; 0 on a dead tile."""
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    wide = acc_ref.dtype
    live = tile_is_live(bits, b, i, j, nr, nwords)

    @pl.when(live)
    def _():
        k = k_ref[...].astype(od)
        acc_ref[...] = jnp.zeros(acc_ref.shape, wide)

        def head(h):
            logits = _dot(k, q_ref[h].astype(od), ((1,), (1,)), wide, dd)  # [tw, ts]
            acc_ref[...] += term(h, logits)

        _over_heads(heads, head, unroll)
        o_ref[...] = finish(acc_ref[...]).astype(o_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _scores_kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, w_ref, o_ref, acc_ref, **static):
    def term(h, logits):
        return w_ref[h] * jnp.maximum(logits, 0)

    _head_sum_tile(bits, q_ref, k_ref, o_ref, acc_ref, term, lambda acc: acc.T, **static)


def _dq_kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, w_ref, g_ref, dq_ref, dw_ref, acc_ref, *, heads, nr,
               nwords, od, dd, unroll, num_blocks, key_tile):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    wide = acc_ref.dtype

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, wide)

    @pl.when(tile_is_live(bits, b, i, j, nr, nwords))
    def _():
        k = k_ref[...].astype(od)
        if num_blocks % key_tile:  # the last key tile is partial: zero the blocks past W
            block = j * key_tile + jax.lax.broadcasted_iota(jnp.int32, (key_tile, 1), 0)
            k = jnp.where(block < num_blocks, k.astype(wide), 0).astype(od)
        kt = _transpose(k)  # [DI, tw]
        # The cotangent tile [tw, ts] and its terms, once per step; each head selects from the
        # terms in the wide dtype (exact: a term is a bfloat16 value) and narrows the result.
        gt = tuple(t.astype(wide) for t in _terms(g_ref[...].astype(wide).T, od))

        def head(h):
            fired = _dot(k, q_ref[h].astype(od), ((1,), (1,)), wide, dd) > 0  # [tw, ts]
            m = tuple(jnp.where(fired, t, 0).astype(od) for t in gt)
            acc_ref[h] += _dot_terms(m, kt, ((1,), (0,)), wide, dd, terms_first=False)  # [DI, ts]

        _over_heads(heads, head, unroll)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        def head(h):
            mk = acc_ref[h]  # [DI, ts]: sum_j m[j, s] K[j, :], transposed
            dq_ref[h] = (mk * w_ref[h]).T.astype(dq_ref.dtype)
            dw_ref[h] = jnp.sum(q_ref[h].astype(wide).T * mk, axis=0, keepdims=True).astype(dw_ref.dtype)

        _over_heads(heads, head, unroll)


def _dk_kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, w_ref, g_ref, dk_ref, acc_ref, *, heads, nr, nwords, od,
               dd, unroll, seq_len, row_tile):
    b, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    wide = acc_ref.dtype

    @pl.when(i == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, wide)

    @pl.when(tile_is_live(bits, b, i, j, nr, nwords))
    def _():
        k = k_ref[...].astype(od)
        gt = g_ref[...].astype(wide).T  # [tw, ts]
        partial = seq_len % row_tile != 0
        if partial:  # the last row tile is partial: zero the rows past S before any product
            # Rows as a column (the q tile's sublanes) and as a row (the logits' lanes), each from
            # its own iota: a [ts, 1] -> [1, ts] reshape is a relayout Mosaic pays for in VMEM.
            row_ok = i * row_tile + jax.lax.broadcasted_iota(jnp.int32, (row_tile, 1), 0) < seq_len
            col_ok = i * row_tile + jax.lax.broadcasted_iota(jnp.int32, (1, row_tile), 1) < seq_len
            gt = jnp.where(col_ok, gt, 0)

        def head(h):
            q = q_ref[h].astype(od)
            w = w_ref[h]  # [1, ts]
            if partial:
                q = jnp.where(row_ok, q.astype(wide), 0).astype(od)
                w = jnp.where(col_ok, w, 0)
            logits = _dot(k, q, ((1,), (1,)), wide, dd)  # [tw, ts]
            p = jnp.where(logits > 0, gt, 0) * w
            acc_ref[...] += _dot_terms(_terms(p, od), q, ((1,), (0,)), wide, dd, terms_first=True)  # [tw, DI]

        _over_heads(heads, head, unroll)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        dk_ref[...] = acc_ref[...].astype(dk_ref.dtype)


def _keys_in_range(j, key_tile, num_blocks):
    """[tw, 1] bool: which key rows of key tile j lie before W (all of them unless the tile is
    partial)."""
    return j * key_tile + jax.lax.broadcasted_iota(jnp.int32, (key_tile, 1), 0) < num_blocks


def _teacher_norm_kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, *refs, heads, nr, nwords, od, dd, unroll,
                         num_blocks, key_tile, phase):
    """Per head and row, over the kept entries a[j] of the live tiles, reduced over the key tiles
    into [c, 1, ts] scratch: `phase` "max": max_j a[j] (-inf where a row keeps none); "sum":
    sum_j exp(a[j] - shift) for the given shift [c, 1, ts] (0 where a row keeps none). Two
    passes rather than an online softmax: each exp then takes the argument XLA's softmax gives
    it (logit - the row's whole max), and no partial sum is rescaled by an exp (on a TPU exp is
    within ~5e-6 of the true value, and each rescale would add that to the normaliser)."""
    shift_ref, (g_ref, o_ref, acc_ref) = (None, refs) if phase == "max" else (refs[0], refs[1:])
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    wide = acc_ref.dtype

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.full(acc_ref.shape, -jnp.inf if phase == "max" else 0, wide)

    @pl.when(tile_is_live(bits, b, i, j, nr, nwords))
    def _():
        k = k_ref[...].astype(od)
        keep = g_ref[...].astype(jnp.float32).T > 0  # [tw, ts]
        if num_blocks % key_tile:  # the last key tile is partial: the blocks past W are not kept
            keep = keep & _keys_in_range(j, key_tile, num_blocks)

        def head(h):
            a = jnp.where(keep, _dot(k, q_ref[h].astype(od), ((1,), (1,)), wide, dd), -jnp.inf)  # [tw, ts]
            if phase == "max":
                acc_ref[h] = jnp.maximum(acc_ref[h], jnp.max(a, axis=0, keepdims=True))
            else:
                acc_ref[h] += jnp.sum(jnp.exp(a - shift_ref[h]), axis=0, keepdims=True)

        _over_heads(heads, head, unroll)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _teacher_probs_kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, n_ref, *refs, scaled, **static):
    """One output tile of sum_h exp(a_h - n_h) (`scaled`: sum_h exp(a_h - n_h) * r_h), 0 where
    not kept (dead tiles: 0). n, r [c, 1, ts]."""
    r_ref, (g_ref, o_ref, acc_ref) = (refs[0], refs[1:]) if scaled else (None, refs)

    def term(h, logits):
        e = jnp.exp(logits - n_ref[h])
        return e * r_ref[h] if scaled else e

    # Keep is applied once per tile, after the head sum: it does not depend on the head. An
    # entry outside keep may have summed to inf (its logit far above the row's normaliser).
    _head_sum_tile(bits, q_ref, k_ref, o_ref, acc_ref, term, lambda acc: jnp.where(g_ref[...] > 0, acc.T, 0),
                   **static)


# ----------------------------------------------------------------------------------- budgets


def padded_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer of `shape`: the last two dims padded to the (sublane, 128) tile of
    the dtype (8 sublanes for 32-bit types, 16 for 16-bit ones)."""
    itemsize = jnp.dtype(dtype).itemsize
    dims = list(shape) if len(shape) >= 2 else [1, *shape]
    sub = 8 * max(1, 4 // itemsize)
    dims[-1] = -(-dims[-1] // LANES) * LANES
    dims[-2] = -(-dims[-2] // sub) * sub
    return math.prod(dims) * itemsize


@dataclasses.dataclass(frozen=True)
class Plan:
    """One kernel's blocks, scratch and VMEM budget (what it passes as `vmem_limit_bytes`)."""

    name: str
    blocks: tuple  # ((shape, dtype), ...): every input and output block, each double-buffered
    scratch: tuple  # ((shape, dtype), ...)
    temporaries: int  # bytes allowed for the body's tile temporaries

    @property
    def block_bytes(self) -> int:
        return sum(2 * padded_bytes(s, d) for s, d in self.blocks)

    @property
    def scratch_bytes(self) -> int:
        return sum(padded_bytes(s, d) for s, d in self.scratch)

    @property
    def budget(self) -> int:
        """The declared VMEM budget: blocks (x2) + scratch + temporaries, rounded up to 1 MiB,
        at least VMEM_FLOOR."""
        need = self.block_bytes + self.scratch_bytes + self.temporaries
        return max(VMEM_FLOOR, -(-need // 2**20) * 2**20)


def vmem_budget(kernel: str, heads: int, head_dim: int, dtypes, tiles: Tiles) -> Plan:
    """The VMEM plan of `kernel` ("scores", "dq", "dk", "teacher_max", "teacher_sum",
    "teacher_probs") for `heads` heads of `head_dim`, the dtypes (q, keys, w[, g[, dK]]; the
    teacher's: q, keys, its [c, 1, rows] inputs, keep) and `tiles`. Raises ValueError when its
    budget exceeds VMEM_CAP."""
    ts, tw, c, di = tiles.rows, tiles.keys, heads, head_dim
    qd, kd, wd = dtypes[:3]
    wide = _wide_of(qd, kd, wd)
    ins = (((c, ts, di), qd), ((tw, di), kd), ((c, 1, ts), wd))
    tile = padded_bytes((tw, ts), wide)
    temps = TEMP_TILES * tile + 4 * padded_bytes((max(ts, tw), di), wide)
    if kernel == "scores":
        plan = Plan(kernel, (*ins, ((ts, tw), wide)), (((tw, ts), wide),), temps)
    elif kernel == "dq":
        plan = Plan(kernel, (*ins, ((ts, tw), dtypes[3]), ((c, ts, di), qd), ((c, 1, ts), wd)),
                    (((c, di, ts), wide),), temps)
    elif kernel == "dk":
        plan = Plan(kernel, (*ins, ((ts, tw), dtypes[3]), ((tw, di), dtypes[-1])), (((tw, di), wide),), temps)
    elif kernel in ("teacher_max", "teacher_sum"):  # dtypes (q, keys[, shift], keep)
        row = ((c, 1, ts), wide)
        plan = Plan(kernel, (ins[0], ins[1], *((row,) if kernel == "teacher_sum" else ()), ((ts, tw), dtypes[-1]),
                             row), (row,), temps)
    elif kernel == "teacher_probs":  # dtypes (q, keys, n[, r], keep)
        rows = tuple(((c, 1, ts), d) for d in dtypes[2:-1])
        plan = Plan(kernel, (ins[0], ins[1], *rows, ((ts, tw), dtypes[-1]), ((ts, tw), wide)), (((tw, ts), wide),),
                    temps)
    else:
        raise ValueError(f"kernel={kernel!r} is not one of scores, dq, dk, teacher_max, teacher_sum, "
                         "teacher_probs")
    if plan.budget > VMEM_CAP:
        raise ValueError(f"tiles={tiles!r}: kernel {kernel} needs {plan.budget / 2**20:.0f} MiB of VMEM at "
                         f"{heads} heads x {head_dim} (cap {VMEM_CAP // 2**20} MiB): choose smaller tiles or "
                         "a head chunk")
    return plan


# ----------------------------------------------------------------------------------- calls


class LiveTiles(NamedTuple):
    """Which (row tile, key tile) pairs the kernels compute, for one problem and `tiles`."""

    bits: jax.Array  # [B*R*words] int32
    row_lo: jax.Array  # [B*R] int32
    row_hi: jax.Array
    key_lo: jax.Array  # [B*K] int32
    key_hi: jax.Array
    tiles: Tiles

    def table(self):
        return (self.bits, self.row_lo, self.row_hi, self.key_lo, self.key_hi)


def live_tiles(valid, tiles: Tiles) -> LiveTiles:
    """The tile table of `valid` [B, S, W] bool: (bits [B*R*words] int32, row-tile ranges lo,
    hi [B*R] and key-tile ranges lo, hi [B*K] int32), R row tiles and K key tiles. Bit j % 32
    of word (b*R + i)*words + j // 32 says tile (i, j) has a valid entry; a row tile's range is
    its first and last live key tile (0, 0 when none is), a key tile's likewise in row tiles.
    The ranges only steer the copies: liveness is the table's."""
    b, s, w = valid.shape
    nr, nk = pl.cdiv(s, tiles.rows), pl.cdiv(w, tiles.keys)
    padded = jnp.pad(valid, ((0, 0), (0, nr * tiles.rows - s), (0, nk * tiles.keys - w)))
    return _table(jnp.any(padded.reshape(b, nr, tiles.rows, nk, tiles.keys), axis=(2, 4)), tiles)


def live_tiles_by_rows(rows_valid, seq_len: int, num_blocks: int, tiles: Tiles) -> LiveTiles:
    """`live_tiles` of the [B, S, W] validity that `rows_valid(rows)` gives row tile by row tile
    (rows [ts] int32 -> [B, ts, W] bool; rows past S are masked here): a `lax.map` over the row
    tiles, so the whole [B, S, W] mask never exists (4 GiB at S = 131072)."""
    ts, tw = tiles.rows, tiles.keys
    nk = pl.cdiv(num_blocks, tw)

    def one(i):
        rows = i * ts + jnp.arange(ts, dtype=jnp.int32)
        v = rows_valid(rows) & (rows < seq_len)[None, :, None]
        v = jnp.pad(v, ((0, 0), (0, 0), (0, nk * tw - num_blocks)))
        return jnp.any(v.reshape(v.shape[0], ts, nk, tw), axis=(1, 3))  # [B, K]

    live = jax.lax.map(one, jnp.arange(pl.cdiv(seq_len, ts), dtype=jnp.int32))  # [R, B, K]
    return _table(jnp.swapaxes(live, 0, 1), tiles)


def _table(live, tiles: Tiles) -> LiveTiles:
    """The LiveTiles of the tile liveness live [B, R, K] bool."""
    b, nr, nk = live.shape
    nwords = pl.cdiv(nk, WORD)
    wordy = jnp.pad(live, ((0, 0), (0, 0), (0, nwords * WORD - nk))).reshape(b, nr, nwords, WORD)
    shifts = jnp.arange(WORD, dtype=jnp.uint32)
    bits = jnp.sum(wordy.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)
    bits = jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(-1)

    def ranges(t):  # t [B, n, m] bool -> first, last True along m (0, 0 when none)
        m = t.shape[-1]
        idx = jnp.arange(m, dtype=jnp.int32)
        any_ = jnp.any(t, axis=-1)
        lo = jnp.where(any_, jnp.min(jnp.where(t, idx, m), axis=-1, initial=m), 0)  # initial: m may be 0
        hi = jnp.where(any_, jnp.max(jnp.where(t, idx, -1), axis=-1, initial=-1), 0)
        return lo.astype(jnp.int32).reshape(-1), hi.astype(jnp.int32).reshape(-1)

    return LiveTiles(bits, *ranges(live), *ranges(jnp.swapaxes(live, 1, 2)), tiles)


def _all_live(b, s, w, tiles):
    nr, nk = pl.cdiv(s, tiles.rows), pl.cdiv(w, tiles.keys)
    nwords = pl.cdiv(nk, WORD)
    bits = jnp.full((b * nr * nwords,), -1, jnp.int32)
    return (bits, jnp.zeros((b * nr,), jnp.int32), jnp.full((b * nr,), nk - 1, jnp.int32),
            jnp.zeros((b * nk,), jnp.int32), jnp.full((b * nk,), nr - 1, jnp.int32))


def _0():
    """A block index 0 as int32 (a literal 0 would be int64 under jax_enable_x64, which
    Mosaic's index maps refuse)."""
    return jnp.int32(0)


def clamp_tile(x, lo_ref, hi_ref, at):
    """Inside an index map: tile index x clamped into [lo[at], hi[at]], a live range of a
    `LiveTiles` table (row_lo/row_hi or key_lo/key_hi), so that a dead tile's block index
    repeats a live one and its block is not copied."""
    return jnp.minimum(jnp.maximum(x, lo_ref[at]), hi_ref[at])


def _call(kernel, name, by_rows, out_shape, out_specs, table, args, tiles, interpret, plan, inner="arbitrary",
          names=("q", "k", "w", "g"), **static):
    """pallas_call of `kernel` over (B, row tiles, key tiles) (`by_rows`; else key tiles
    outermost after B). `inner`: the inner axis' semantics, "arbitrary" where it is a
    reduction (the backward kernels, the teacher's normaliser), "parallel" otherwise. `names`:
    which of the operands q [B, c, S, DI], k [B, W, DI], w [B, c, 1, S] (a row per head) and
    g [B, S, W] `args` are. The inner tile's inputs are clamped into the live range of the
    outer tile."""
    qt, keys = args[0], args[1]
    b, c, s, di = qt.shape
    nw = keys.shape[1]
    ts, tw = tiles.rows, tiles.keys
    nr, nk = pl.cdiv(s, ts), pl.cdiv(nw, tw)

    if by_rows:  # grid (b, i, j); j clamped into row tile i's live key tiles
        def kj(b, i, j, bits, rlo, rhi, klo, khi):
            return clamp_tile(j, rlo, rhi, b * nr + i)

        q_map = lambda b, i, j, *t: (b, _0(), i, _0())  # noqa: E731
        k_map = lambda b, i, j, *t: (b, kj(b, i, j, *t), _0())  # noqa: E731
        w_map = lambda b, i, j, *t: (b, _0(), _0(), i)  # noqa: E731
        g_map = lambda b, i, j, *t: (b, i, kj(b, i, j, *t))  # noqa: E731
        grid = (b, nr, nk)
    else:  # grid (b, j, i); i clamped into key tile j's live row tiles
        def ri(b, j, i, bits, rlo, rhi, klo, khi):
            return clamp_tile(i, klo, khi, b * nk + j)

        q_map = lambda b, j, i, *t: (b, _0(), ri(b, j, i, *t), _0())  # noqa: E731
        k_map = lambda b, j, i, *t: (b, j, _0())  # noqa: E731
        w_map = lambda b, j, i, *t: (b, _0(), _0(), ri(b, j, i, *t))  # noqa: E731
        g_map = lambda b, j, i, *t: (b, ri(b, j, i, *t), j)  # noqa: E731
        grid = (b, nk, nr)
    specs = {"q": pl.BlockSpec((None, c, ts, di), q_map), "k": pl.BlockSpec((None, tw, di), k_map),
             "w": pl.BlockSpec((None, c, 1, ts), w_map), "g": pl.BlockSpec((None, ts, tw), g_map)}
    in_specs = [specs[n] for n in names]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(table), grid=grid, in_specs=in_specs, out_specs=out_specs(grid),
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in plan.scratch])
    return pl.pallas_call(
        functools.partial(kernel, heads=c, nr=nr, nwords=pl.cdiv(nk, WORD),
                          unroll=tiles.unroll if static["od"] == jnp.bfloat16 else 1,
                          dd=jnp.dtype(jnp.float32) if interpret and static["od"] == jnp.bfloat16 else static["od"],
                          **static),
        out_shape=out_shape, grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", inner),
                                             vmem_limit_bytes=plan.budget),
        interpret=interpret, name=name,
    )(*table, *args)


def _scores_call(table, qt, keys, w4, tiles, interpret):
    b, c, s, di = qt.shape
    wide = _wide_of(qt.dtype, keys.dtype, w4.dtype)
    plan = vmem_budget("scores", c, di, (qt.dtype, keys.dtype, w4.dtype), tiles)
    out = jax.ShapeDtypeStruct((b, s, keys.shape[1]), wide)
    spec = lambda grid: pl.BlockSpec((None, tiles.rows, tiles.keys), lambda b, i, j, *t: (b, i, j))  # noqa: E731
    return _call(_scores_kernel, "csa_index_scores", True, out, spec, table, (qt, keys, w4), tiles, interpret,
                 plan, inner="parallel", names=("q", "k", "w"), od=operand_dtype(qt.dtype, wide))


def _dq_call(table, qt, keys, w4, g, tiles, interpret):
    b, c, s, di = qt.shape
    wide = _wide_of(qt.dtype, keys.dtype, w4.dtype)
    plan = vmem_budget("dq", c, di, (qt.dtype, keys.dtype, w4.dtype, g.dtype), tiles)
    shapes = (jax.ShapeDtypeStruct(qt.shape, qt.dtype), jax.ShapeDtypeStruct(w4.shape, w4.dtype))

    def specs(grid):
        return (pl.BlockSpec((None, c, tiles.rows, di), lambda b, i, j, *t: (b, _0(), i, _0())),
                pl.BlockSpec((None, c, 1, tiles.rows), lambda b, i, j, *t: (b, _0(), _0(), i)))

    return _call(_dq_kernel, "csa_index_scores_dq", True, shapes, specs, table, (qt, keys, w4, g), tiles,
                 interpret, plan, od=operand_dtype(qt.dtype, wide), num_blocks=keys.shape[1], key_tile=tiles.keys)


def _dk_call(table, qt, keys, w4, g, tiles, dk_dtype, interpret):
    b, c, s, di = qt.shape
    wide = _wide_of(qt.dtype, keys.dtype, w4.dtype)
    plan = vmem_budget("dk", c, di, (qt.dtype, keys.dtype, w4.dtype, g.dtype, dk_dtype), tiles)
    shape = jax.ShapeDtypeStruct(keys.shape, dk_dtype)
    spec = lambda grid: pl.BlockSpec((None, tiles.keys, di), lambda b, j, i, *t: (b, j, _0()))  # noqa: E731
    return _call(_dk_kernel, "csa_index_scores_dk", False, shape, spec, table, (qt, keys, w4, g), tiles,
                 interpret, plan, od=operand_dtype(qt.dtype, wide), seq_len=s, row_tile=tiles.rows)


def _teacher_norm_call(table, qt, keys, *rest, tiles, interpret, phase):
    """rest: (keep,) for phase "max", (shift4, keep) for "sum"."""
    b, c, s, di = qt.shape
    keep = rest[-1]
    wide = _wide_of(qt.dtype, keys.dtype, keep.dtype)
    plan = vmem_budget(f"teacher_{phase}", c, di, (qt.dtype, keys.dtype, *(a.dtype for a in rest)), tiles)
    out = jax.ShapeDtypeStruct((b, c, 1, s), wide)
    spec = lambda grid: pl.BlockSpec((None, c, 1, tiles.rows), lambda b, i, j, *t: (b, _0(), _0(), i))  # noqa: E731
    names = ("q", "k", "g") if phase == "max" else ("q", "k", "w", "g")
    return _call(_teacher_norm_kernel, f"csa_teacher_{phase}", True, out, spec, table, (qt, keys, *rest), tiles,
                 interpret, plan, names=names, od=operand_dtype(qt.dtype, wide), num_blocks=keys.shape[1],
                 key_tile=tiles.keys, phase=phase)


def _teacher_probs_call(table, qt, keys, *rest, tiles, interpret):
    """rest: (n4, keep) or (n4, r4, keep) (scaled)."""
    b, c, s, di = qt.shape
    wide = _wide_of(qt.dtype, keys.dtype, rest[0].dtype)
    plan = vmem_budget("teacher_probs", c, di, (qt.dtype, keys.dtype, *(a.dtype for a in rest)), tiles)
    out = jax.ShapeDtypeStruct((b, s, keys.shape[1]), wide)
    spec = lambda grid: pl.BlockSpec((None, tiles.rows, tiles.keys), lambda b, i, j, *t: (b, i, j))  # noqa: E731
    names = ("q", "k", "w", "g") if len(rest) == 2 else ("q", "k", "w", "w", "g")
    return _call(_teacher_probs_kernel, "csa_teacher_probs", True, out, spec, table, (qt, keys, *rest), tiles,
                 interpret, plan, inner="parallel", names=names, od=operand_dtype(qt.dtype, wide),
                 scaled=len(rest) == 3)


def _on_platform(call, *args):
    """`call(*args, interpret)`: compiled by Mosaic when lowered for TPU, interpreted elsewhere."""
    return jax.lax.platform_dependent(*args, tpu=functools.partial(call, interpret=False),
                                      default=functools.partial(call, interpret=True))


def _check(q, keys, w, tiles, valid):
    if q.ndim != 4 or keys.ndim != 3 or w.shape != q.shape[:3] or keys.shape[0] != q.shape[0] \
            or keys.shape[2] != q.shape[3]:
        raise ValueError(f"contribution: q [B,S,c,DI], keys [B,W,DI], w [B,S,c] expected, got q {q.shape}, "
                         f"keys {keys.shape}, w {w.shape}")
    if not all(isinstance(v, int) and v >= 1 for v in (tiles.rows, tiles.keys, tiles.unroll)):
        raise ValueError(f"tiles={tiles!r} must be ints >= 1 (query rows, key blocks, heads per loop iteration)")
    want = (q.shape[0], q.shape[1], keys.shape[1])
    if valid is not None and (tuple(valid.shape) != want or valid.dtype != jnp.bool_):
        raise ValueError(f"contribution: valid must be bool {list(want)} [B, S, W], got {valid.dtype} "
                         f"{list(valid.shape)}")


def _layout(q, keys, w):
    """The kernels' operands: q as [B, c, S, DI] (a head's rows are one leading index), keys in
    q's dtype when q is narrower, w as [B, c, 1, S] (a head's weights are one row)."""
    return jnp.swapaxes(q, 1, 2), keys.astype(q.dtype), jnp.swapaxes(w, 1, 2)[:, :, None, :]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _contribution(q, keys, w, table, tiles):
    qt, k, w4 = _layout(q, keys, w)
    return _on_platform(functools.partial(_scores_call, tiles=tiles), table, qt, k, w4)


def _contribution_fwd(q, keys, w, table, tiles):
    return _contribution(q, keys, w, table, tiles), (q, keys, w, table)


def _contribution_bwd(tiles, res, g):
    q, keys, w, table = res
    qt, k, w4 = _layout(q, keys, w)
    dqt, dw4 = _on_platform(functools.partial(_dq_call, tiles=tiles), table, qt, k, w4, g)
    dk = _on_platform(functools.partial(_dk_call, tiles=tiles, dk_dtype=keys.dtype), table, qt, k, w4, g)
    dq = jnp.swapaxes(dqt, 1, 2).astype(q.dtype)
    dw = jnp.swapaxes(dw4[:, :, 0, :], 1, 2).astype(w.dtype)
    return dq, dk.astype(keys.dtype), dw, tuple(None for _ in table)


_contribution.defvjp(_contribution_fwd, _contribution_bwd)


def contribution(q, keys, w, tiles: Tiles | None = None, valid=None):
    """sum_h w[b,s,h] * relu(q[b,s,h] . K[b,j]), [B, S, W] in the wide dtype of the inputs,
    by the Pallas kernels (custom VJP: the backward kernels).

    q [B, S, c, DI] and keys [B, W, DI] in the compute dtype or wide, w [B, S, c] wide. Keys
    wider than q are multiplied in q's dtype (the library passes the compute-dtype keys
    widened, for which that is exact); their gradient comes back in their own dtype.
    `tiles`: (query rows, key blocks) per step; default `default_tiles(S, W, q.dtype)`.
    `valid`: None, [B, S, W] bool, or its `live_tiles` (computed once for many calls, e.g. the
    head chunks of one block of rows). With it, a tile with no valid entry is skipped: its
    scores are 0 and its cotangent is ignored (callers mask the scores with `valid`, so the
    skipped entries are among those they throw away); every entry of a live tile is computed."""
    if isinstance(valid, LiveTiles):
        if tiles is not None and tiles != valid.tiles:
            raise ValueError(f"contribution: tiles={tiles!r} differ from the live table's {valid.tiles!r}")
        tiles = valid.tiles
    tiles = tiles or default_tiles(q.shape[1], keys.shape[1], q.dtype)
    _check(q, keys, w, tiles, None if isinstance(valid, LiveTiles) else valid)
    if q.shape[1] == 0 or keys.shape[1] == 0 or q.shape[2] == 0:
        # Nothing to tile (no rows, blocks or heads): an empty or zero sum, no kernel.
        return jnp.zeros((q.shape[0], q.shape[1], keys.shape[1]), _wide_of(q.dtype, keys.dtype, w.dtype))
    if valid is None:
        table = _all_live(q.shape[0], q.shape[1], keys.shape[1], tiles)
    elif isinstance(valid, LiveTiles):
        table = valid.table()
    else:
        table = live_tiles(jax.lax.stop_gradient(valid), tiles).table()
    return _contribution(q, keys, w, table, tiles)


# ----------------------------------------------------------------------------------- teacher


def _teacher_setup(name, tq, tkv, keep, live):
    """(table, tiles, qt [B, h, r, D], keys in tq's dtype, keep as wide 0/1, wide) for a
    teacher kernel, after checking the shapes."""
    if tq.ndim != 4 or tkv.ndim != 3 or tkv.shape[0] != tq.shape[0] or tkv.shape[2] != tq.shape[3] \
            or tuple(keep.shape) != (tq.shape[0], tq.shape[1], tkv.shape[1]) or keep.dtype != jnp.bool_:
        raise ValueError(f"{name}: tq [B,r,h,D], tkv [B,W,D], keep bool [B,r,W] expected, got tq {tq.shape}, "
                         f"tkv {tkv.shape}, keep {keep.dtype} {list(keep.shape)}")
    tiles = live.tiles if live is not None else default_tiles(tq.shape[1], tkv.shape[1], tq.dtype)
    table = (live if live is not None else live_tiles(keep, tiles)).table()
    wide = _wide_of(tq.dtype, tkv.dtype)
    return table, tiles, jnp.swapaxes(tq, 1, 2), tkv.astype(tq.dtype), keep.astype(wide), wide


def _rows4(x, wide):
    """[B, r, h] -> [B, h, 1, r] (a head's values are one row), in `wide`."""
    return jnp.swapaxes(x.astype(wide), 1, 2)[:, :, None, :]


def _from_rows4(x):
    return jnp.swapaxes(x[:, :, 0, :], 1, 2)


def teacher_block_max(tq, tkv, keep, live: LiveTiles | None = None):
    """m[b, s, h] = max over the kept j of tq[b, s, h] . tkv[b, j], [B, r, h] wide; -inf where
    a row keeps no block. By the Pallas kernel `csa_teacher_max` (no gradient: the teacher is
    detached).

    tq [B, r, h, D] and tkv [B, W, D] in the dtype the products are taken in (bfloat16 at
    DEFAULT precision into float32, float32 at HIGHEST; tkv is cast to tq's dtype), keep
    [B, r, W] bool. `live`: `live_tiles(keep, tiles)` computed once for the teacher kernels
    (default: from keep at `default_tiles`); a tile with no kept entry is skipped."""
    table, tiles, qt, k, kf, wide = _teacher_setup("teacher_block_max", tq, tkv, keep, live)
    b, r, h, _ = tq.shape
    if r == 0 or h == 0 or tkv.shape[1] == 0:
        return jnp.full((b, r, h), -jnp.inf, wide)
    return _from_rows4(_on_platform(functools.partial(_teacher_norm_call, tiles=tiles, phase="max"), table, qt, k, kf))


def teacher_block_sumexp(tq, tkv, keep, shift, live: LiveTiles | None = None):
    """sum over the kept j of exp(tq[b, s, h] . tkv[b, j] - shift[b, s, h]), [B, r, h] wide (0
    where a row keeps no block), by the Pallas kernel `csa_teacher_sum`. shift [B, r, h]: finite;
    the row's whole max (`teacher_block_max`, with the sink and window logits), as a softmax
    subtracts it. Same operands and `live` as `teacher_block_max`."""
    table, tiles, qt, k, kf, wide = _teacher_setup("teacher_block_sumexp", tq, tkv, keep, live)
    b, r, h, _ = tq.shape
    _check_rows("teacher_block_sumexp", "shift", shift, (b, r, h))
    if r == 0 or h == 0 or tkv.shape[1] == 0:
        return jnp.zeros((b, r, h), wide)
    return _from_rows4(_on_platform(functools.partial(_teacher_norm_call, tiles=tiles, phase="sum"), table, qt, k,
                                    _rows4(shift, wide), kf))


def _check_rows(name, field, x, want):
    if tuple(x.shape) != tuple(want):
        raise ValueError(f"{name}: {field} must be [B, r, h] = {list(want)}, got {list(x.shape)}")


def teacher_block_probs(tq, tkv, keep, shift, scale=None, live: LiveTiles | None = None):
    """sum_h exp(tq[b, s, h] . tkv[b, j] - shift[b, s, h]) (* scale[b, s, h]) where keep[b, s, j],
    else 0: [B, r, W] wide, the teacher heads' probabilities on the kept blocks summed over the
    heads, by the Pallas kernel `csa_teacher_probs`. shift, scale [B, r, h] wide: the
    log-normaliser (scale None: a log-sum-exp subtracted, as the joint teacher's softmax does)
    or the max with scale = 1 / the sum (as `jax.nn.softmax` divides). Same operands and `live`
    as `teacher_block_max`; skipped tiles are 0."""
    table, tiles, qt, k, kf, wide = _teacher_setup("teacher_block_probs", tq, tkv, keep, live)
    b, r, h, _ = tq.shape
    _check_rows("teacher_block_probs", "shift", shift, (b, r, h))
    if scale is not None:
        _check_rows("teacher_block_probs", "scale", scale, (b, r, h))
    if r == 0 or h == 0 or tkv.shape[1] == 0:
        return jnp.zeros((b, r, tkv.shape[1]), wide)
    rows = (_rows4(shift, wide),) + (() if scale is None else (_rows4(scale, wide),))
    return _on_platform(functools.partial(_teacher_probs_call, tiles=tiles), table, qt, k, *rows, kf)

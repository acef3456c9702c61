"""The query-blocked training path (SPEC section 7, `query_chunk = r > 0`).

Every row of sections 7 and 8 (a query's scores, validity, top-k, teacher row,
student row, KL term) depends on no other row; only the loss's normaliser
count(valid_tok) is global. So the loss walks the query axis in blocks of r rows
with `jax.lax.scan`, the body under `jax.checkpoint`: the forward keeps one block's
[B, r, W] arrays, and the backward recomputes one block at a time, so that no
[B, S, W] array of any dtype (scores, validity, the sparse selection mask, the
teacher distribution, the student log-probabilities, their cotangents) exists.
Head chunking nests inside a block (`raw_scores`, `teacher_head_sum` run on the
block's rows). The compressed keys are computed once, for the whole sequence,
before the scan; their cotangent is summed over the blocks by the scan.

Rows: block i holds rows i*r .. i*r + r - 1. When r does not divide S the last
block runs past S: `_take_rows` reads every input per block with a clamped
gather (those rows repeat row S-1; nothing is padded or copied whole), and
`row_ok` marks them as padding: they have no valid block, so they are never
valid rows, never counted, and their outputs are cut off before anything is
returned. The scan emits each row's KL term and validity ([B, r] per block, about
[B, S] in all, negligible next to [B, S, W]); the loss is then formed as the
unblocked path forms it, one global sum divided by one global count, over those
outputs as they come (the padding rows hold 0 and count as invalid because `row_ok`
says so, and only because of it).

Key windows (`cfg.key_window`, `_in_key_window`): on one device, a block whose rows
see only a stretch of the blocks (a document, the causal prefix) is scored in the
narrowest window of `key_window_widths` that holds that stretch, so its [B, r, W]
arrays become [B, r, width]; what is left out is exact zeros of every sum. Below
W = 4 * max(key_window, k) there is no window and the program is the one above.

The forward API (`forward`) assembles the full [B, S, W] scores and top-k from
the blocks, for parity; the memory promise is the loss and its gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .config import resolve_dtype
from .loss import TEACHER_NORMALISER, kl_per_token, loss_keep, teacher_distribution
from .validate import teacher_input_names
from .pooling import compress_keys
from .precision import round_grad_to, round_to, widen
from .scoring import (codes_dict, head_weights, imposed_codes, key_blocks, mask_scores, raw_scores, rows_validity,
                      scoring_keys, topk_indices)


# The parameters of the keys (used once, before the scan) and of the query rows (per block).
KEY_PARAMS = ("indexer.wkv", "indexer.wgate", "indexer.ape", "indexer.kv_norm")
_QUERY_PARAMS = ("indexer.wq_b", "indexer.weights_proj")


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one device of a mesh (jax_impl.sharded) changes in the row program; the default,
    every field None, is one device that holds every row, head and block.

    score_cfg      the config the scoring sees: its own share of the indexer heads.
    sum_heads      adds a sum over heads (the scores, the teacher's head sum) over the devices
                   that hold the other heads.
    sum_rows       adds the loss's sum(kl) and count(valid_tok) over the devices that hold the
                   other rows (batch and sequence).
    window         (teacher_window_kv, segment_ids) of the device's rows -> the `loss.Window`
                   its rows read (its stretch with the halo from the devices before it).
    gather_blocks  the teacher_kv of the device's blocks -> every block's.
    """

    score_cfg: Any = None
    sum_heads: Callable | None = None
    sum_rows: Callable | None = None
    window: Callable | None = None
    gather_blocks: Callable | None = None


ONE_DEVICE = Shard()


def _apply(fn, value):
    return value if fn is None else fn(value)


def num_query_blocks(seq_len: int, r: int) -> int:
    """ceil(S / r): the scan length."""
    return -(-seq_len // r)


def block_rows(cfg, seq_len: int) -> int:
    """Rows per block: query_chunk, at most S (a single block never holds padding rows only)."""
    return max(1, min(cfg.query_chunk, seq_len))


def _take_rows(a, rows):
    """a[:, rows] (rows [r] int): a clamped gather, so rows past S repeat row S-1 (masked
    by `row_ok`). Reads one block; never pads or copies `a` whole."""
    return jnp.take(a, rows, axis=1, mode="clip")


def _unblock(ys, seq_len: int):
    """[nb, B, r, ...] scan outputs -> [B, S, ...]: the blocks in row order, padding rows cut."""
    nb, b, r = ys.shape[:3]
    out = jnp.moveaxis(ys, 0, 1).reshape(b, nb * r, *ys.shape[3:])
    return out[:, :seq_len]


def _setup(params, inputs, cfg, dtype_name):
    """Everything computed once for the whole sequence, before the scan: the compressed keys
    [B, W, DI] (in the compute dtype, and widened: see below) and the key blocks' validity data.

    The scan body closes over wide values only: the scan sums their cotangents over the
    blocks, so closing over a bfloat16 value (the keys, a parameter cast to the compute
    dtype) would add the blocks' gradients in bfloat16 (measured: 1.3e-2 of a bfloat16
    gradient at r = 1, S = 40). The body rounds the parameters it uses itself, inside their
    projections (`_block_scores`); the keys' widening is exact and is what `raw_scores` does
    anyway."""
    dtype, wide = resolve_dtype(dtype_name)
    p = {k: round_to(params[k], dtype) for k in KEY_PARAMS}
    # The indexer never trains the hidden states (the keys need every row of them).
    x = round_to(jax.lax.stop_gradient(inputs["hidden_states"]), dtype)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    keys = compress_keys(
        x, pos, p["indexer.wkv"], p["indexer.wgate"], p["indexer.ape"], p["indexer.kv_norm"], cfg, wide
    )
    k_in, key_codes = scoring_keys(keys, cfg, wide, imposed_codes(inputs)[1])
    return keys, widen(k_in, wide), key_blocks(pos, seg, cfg, x.shape[1]), key_codes


def _block_scores(params, keys, blocks, inputs, start, r, cfg, dtype_name, shard=ONE_DEVICE, with_codes=False):
    """One block of rows start .. start + r - 1: (masked scores [B, r, W] wide, validity
    [B, r, W], top-k [B, r, k_eff], the rows [r]; with `with_codes`, then the queries' (codes,
    scales) of the rows, or None without quantization). params and keys wide."""
    dtype, wide = resolve_dtype(dtype_name)
    # The query parameters stay wide: `project` rounds them to the compute dtype and hands
    # their gradient back wide and unrounded, so the scan sums the blocks' gradients wide and
    # `rows_loss` rounds the sum once (`round_grad_to`), as the one contraction over every row
    # of the unblocked path is rounded once.
    p = {k: params[k] for k in _QUERY_PARAMS}
    seq_len = inputs["position_ids"].shape[1]
    rows = start + jnp.arange(r)
    row_ok = rows < seq_len  # False on the padding rows of the last block
    x = round_to(_take_rows(jax.lax.stop_gradient(inputs["hidden_states"]), rows), dtype)
    q_latent = round_to(_take_rows(jax.lax.stop_gradient(inputs["q_latent"]), rows), dtype)
    pos = _take_rows(inputs["position_ids"], rows)
    seg = _take_rows(inputs["segment_ids"], rows)
    hw = head_weights(x, p["indexer.weights_proj"], cfg.index_n_heads, wide)
    imposed = imposed_codes(inputs)[0]
    imposed = None if imposed is None else tuple(_take_rows(a, rows) for a in imposed)
    valid = rows_validity(pos, seg, blocks, cfg.compress_ratio) & row_ok[None, :, None]
    scores, codes = raw_scores(q_latent, pos, p["indexer.wq_b"], hw, keys, shard.score_cfg or cfg, wide,
                               with_codes=True, query_codes=imposed, valid=valid)
    scores = _apply(shard.sum_heads, scores)
    masked = mask_scores(scores, valid)
    out = masked, valid, topk_indices(masked, valid, cfg.index_topk), rows
    return (*out, codes) if with_codes else out


def key_window_widths(cfg, num_blocks: int) -> tuple[int, ...]:
    """The widths, in compressed blocks, of the key windows a query block may be scored in,
    ascending; the last is W (every block). `cfg.key_window` times 1, 4, 16, ... (at least
    k_eff, so that a window holds every pick), each at most W / 4 (a narrower branch is compiled
    only where it saves at least 4x), then W. Just (W,) where `key_window` is 0 or W is below
    four times the narrowest: then the program has no window at all."""
    if not cfg.key_window:
        return (num_blocks,)
    width, out = max(cfg.key_window, min(cfg.index_topk, num_blocks)), []
    while 4 * width <= num_blocks:
        out.append(width)
        width *= 4
    return (*out, num_blocks)


def _widths(cfg, num_blocks: int, shard) -> tuple[int, ...]:
    """`key_window_widths` on one device; the whole width on a mesh (jax_impl.sharded), whose
    programs are not windowed: a window's branch would hold the collectives of the heads' sum, and
    the context-parallel benchmark's memory and communication figures are of the whole width."""
    return key_window_widths(cfg, num_blocks) if shard is ONE_DEVICE else (num_blocks,)


def key_span(position_ids, segment_ids, blocks, m: int):
    """(lo, hi): the first block that any of the rows (position_ids, segment_ids [B, r]) sees, and
    one past the last (lo = W, hi = 0 where they see none). One reduction over the rows'
    validity, which is not kept."""
    seen = jnp.any(rows_validity(position_ids, segment_ids, blocks, m), axis=(0, 1))
    w = seen.shape[0]
    idx = jnp.arange(w, dtype=jnp.int32)
    return jnp.min(jnp.where(seen, idx, w)), jnp.max(jnp.where(seen, idx + 1, 0))


def _in_key_window(fn, widths, inputs, start, r: int, blocks, m: int):
    """fn(lo, width) for the query block of rows start .. start + r - 1, in the narrowest key window
    of `widths` that holds every block its rows can see: blocks lo .. lo + width - 1 (lo traced,
    width static). Every block outside it is invalid for every row of the block, so its scores
    would be -inf, its probabilities exact zeros and its gradients zero: the window changes what
    is computed, not what comes out (the sums over the window's blocks add the same nonzero terms,
    in another order). Where no window is narrower than W, fn(0, W) alone, with no branch."""
    w = widths[-1]
    if len(widths) == 1:
        return fn(0, w)
    rows = start + jnp.arange(r)
    pos, seg = _take_rows(inputs["position_ids"], rows), _take_rows(inputs["segment_ids"], rows)
    # The padding rows past S repeat row S - 1 (`_take_rows`): they widen nothing.
    lo, hi = key_span(pos, seg, blocks, m)
    branch = jnp.sum(jnp.maximum(hi - lo, 0) > jnp.asarray(widths[:-1], jnp.int32))
    branches = [lambda lo, width=width: fn(jnp.clip(lo, 0, w - width), width) for width in widths]
    return jax.lax.switch(branch, branches, lo)


def _window(a, lo, width: int):
    """a[:, lo .. lo + width - 1] (axis 1: the blocks); `a` itself at the whole width."""
    return a if width == a.shape[1] else jax.lax.dynamic_slice_in_dim(a, lo, width, axis=1)


def _unwindow_scores(masked, lo, w: int):
    """A window's masked scores [B, r, width] -> [B, r, W], -inf outside the window."""
    if masked.shape[-1] == w:
        return masked
    full = jnp.full((*masked.shape[:2], w), -jnp.inf, masked.dtype)
    return jax.lax.dynamic_update_slice_in_dim(full, masked, lo, axis=2)


def _unwindow_picks(topk, lo, width: int, w: int):
    """A window's picks (relative to it, -1 invalid) -> block indices of the whole width."""
    return topk if width == w else jnp.where(topk >= 0, topk + lo, -1)


def _window_picks(picks, lo, width: int, w: int):
    """Picks of the whole width [B, r, k] -> relative to the window lo .. lo + width - 1; a pick
    outside it (a block the row cannot see: the loss drops it anyway) becomes -1."""
    if width == w:
        return picks
    rel = picks - lo
    return jnp.where((picks >= 0) & (rel >= 0) & (rel < width), rel, -1)


def _starts(seq_len: int, r: int):
    return jnp.arange(num_query_blocks(seq_len, r), dtype=jnp.int32) * r


def _over_blocks(body, seq_len: int, r: int):
    """The blocks' outputs stacked [nb, ...]: a `lax.scan` of `body` over the block starts, or,
    when one block holds every row, one call of it (nothing to walk: the same program without a
    scan of length 1)."""
    if num_query_blocks(seq_len, r) == 1:
        return jax.tree.map(lambda a: a[None], body(None, jnp.zeros((), jnp.int32))[1])
    return jax.lax.scan(body, None, _starts(seq_len, r))[1]


def forward(params, inputs, cfg, dtype_name):
    """{compressed_keys [B, W, DI], index_scores [B, S, W] (wide, -inf where invalid),
    topk_indices [B, S, k_eff], and with quantization the codes and scales (scoring.codes_dict)},
    computed block by block and assembled."""
    keys, keys_wide, blocks, key_codes = _setup(params, inputs, cfg, dtype_name)
    masked, topk, query_codes = rows_forward(params, keys_wide, blocks, inputs, cfg, dtype_name,
                                             block_rows(cfg, inputs["position_ids"].shape[1]), with_codes=True)
    return {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk,
            **codes_dict(query_codes, key_codes)}


def forward_rows(params, inputs, start, rows: int, cfg, dtype_name, prefix_blocks: int | None = None):
    """(masked scores [B, rows, W] wide, top-k [B, rows, k_eff]) of the rows start .. start + rows - 1
    only: what `forward` gives for those rows, without the other rows' [B, S, W]. Query blocks of
    `cfg.query_chunk` rows counted from `start` (0: the rows in one block). Rows past S repeat row
    S - 1 (a clamped gather): the caller cuts them.

    `prefix_blocks` (static, < W): the rows are scored against the first `prefix_blocks` blocks
    only, their keys computed from those blocks' tokens only (a block's key reads its own and the
    previous block's tokens), when the program finds that none of the later blocks is visible to
    any of the rows (one reduction over their validity); the later blocks' scores are then -inf
    and the picks are padded with -1, which is what the whole width gives for blocks no row sees.
    Where a later block is visible (positions that do not grow with the index), the keys of the
    whole sequence are computed and every block is scored. The caller picks the prefix
    (jax_impl.api.indexer_forward_rows: the causal prefix of the rows), so a row block late in a
    long sequence costs what its rows can see."""
    idx = start + jnp.arange(rows)
    row_inputs = {n: _take_rows(inputs[n], idx) for n in ("hidden_states", "q_latent", "position_ids", "segment_ids")}
    r = block_rows(cfg, rows) if cfg.query_chunk else rows
    seq_len = inputs["position_ids"].shape[1]
    w = cfg.num_blocks(seq_len)

    def scored(tokens):
        _, keys_wide, blocks, _ = _setup(params, {n: a[:, :tokens] for n, a in inputs.items()}, cfg, dtype_name)
        return rows_forward(params, keys_wide, blocks, row_inputs, cfg, dtype_name, r)

    if prefix_blocks is None or not 0 < prefix_blocks < w:
        return scored(seq_len)
    k_eff = min(cfg.index_topk, w)

    def prefix(_):
        scores, picks = scored(prefix_blocks * cfg.compress_ratio)
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, w - prefix_blocks)), constant_values=-jnp.inf)
        return scores, jnp.pad(picks, ((0, 0), (0, 0), (0, k_eff - picks.shape[-1])), constant_values=-1)

    later = tuple(a[:, prefix_blocks:] for a in key_blocks(inputs["position_ids"], inputs["segment_ids"], cfg, seq_len))
    seen = jnp.any(rows_validity(row_inputs["position_ids"], row_inputs["segment_ids"], later, cfg.compress_ratio))
    return jax.lax.cond(seen, lambda _: scored(seq_len), prefix, None)


def rows_forward(params, keys_wide, blocks, inputs, cfg, dtype_name, r: int, shard=ONE_DEVICE, with_codes=False):
    """(masked scores [B, S, W] wide, top-k [B, S, k_eff]) of the rows of `inputs` against the
    keys `keys_wide` [B, W, DI] (wide) and their `blocks` (scoring.key_blocks), `r` rows a block;
    with `with_codes`, then the rows' query (codes, scales) (None without quantization).
    jax_impl.sharded calls it with a device's rows, every block's keys and its `shard`."""
    seq_len = inputs["position_ids"].shape[1]
    w = keys_wide.shape[1]

    def body(_, start):
        def scored(lo, width):
            kw, bl = _window(keys_wide, lo, width), tuple(_window(a, lo, width) for a in blocks)
            masked, _, topk, _, codes = _block_scores(params, kw, bl, inputs, start, r, cfg, dtype_name, shard,
                                                      with_codes=True)
            return _unwindow_scores(masked, lo, w), _unwindow_picks(topk, lo, width, w), codes if with_codes else None

        return None, _in_key_window(scored, _widths(cfg, w, shard), inputs, start, r, blocks, cfg.compress_ratio)

    masked, topk, codes = _over_blocks(body, seq_len, r)
    out = _unblock(masked, seq_len), _unblock(topk, seq_len)
    if not with_codes:
        return out
    return (*out, None if codes is None else tuple(_unblock(a, seq_len) for a in codes))


def loss(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    """The scalar KL loss (wide dtype) of SPEC section 8, query block by query block.

    Same arguments as the unblocked loss: params already wide, the inputs as stored,
    `selection` [B, S, k_eff] (or None) overriding the own top-k in sparse mode; it is
    read block by block like every other input."""
    dtype, wide = resolve_dtype(dtype_name)
    inputs = {**float_inputs, **int_inputs}
    seq_len = inputs["position_ids"].shape[1]
    if cfg.num_blocks(seq_len) == 0:
        return jnp.zeros((), wide)
    _, keys_wide, blocks, _ = _setup(params, inputs, cfg, dtype_name)
    return rows_loss(params, keys_wide, blocks, inputs, selection, cfg, dtype_name, block_rows(cfg, seq_len))


def rows_loss(params, keys_wide, blocks, inputs, selection, cfg, dtype_name, r: int, shard=ONE_DEVICE):
    """The loss of the rows of `inputs` (the float and int inputs in one dict) against the keys
    `keys_wide` and their `blocks`, `r` rows a block (`rows_forward`); on a mesh, `shard` adds
    the heads and the rows the other devices hold."""
    dtype, wide = resolve_dtype(dtype_name)
    seq_len = inputs["position_ids"].shape[1]
    # The teacher inputs are rounded once, but teacher_query [B, S, H, D], only per block (the
    # block's window reads only the window rows its own rows need: loss.window_of_rows).
    teacher = {n: jax.lax.stop_gradient(widen(round_to(inputs[n], dtype), wide))
               for n in teacher_input_names(cfg) if n != "teacher_query"}
    teacher["teacher_kv"] = _apply(shard.gather_blocks, teacher["teacher_kv"])
    params = {**params, **{k: round_grad_to(params[k], dtype) for k in _QUERY_PARAMS}}
    window = None
    if shard.window is not None and "teacher_window_kv" in teacher:
        window = shard.window(teacher["teacher_window_kv"], inputs["segment_ids"])

    w = keys_wide.shape[1]

    def body(_, start):
        def block_loss(lo, width):
            kw, bl = _window(keys_wide, lo, width), tuple(_window(a, lo, width) for a in blocks)
            masked, valid, topk, rows = _block_scores(params, kw, bl, inputs, start, r, cfg, dtype_name, shard)
            sel = None if selection is None else _window_picks(_take_rows(selection, rows), lo, width, w)
            # A window no wider than k: the own top-k picks every block of it, so the sparse loss keeps
            # every valid one, as the dense loss does (and the program sorts nothing).
            picks_all = sel is None and width < w and width <= cfg.index_topk
            keep, valid_tok = loss_keep(valid, topk, cfg.sparse_loss and not picks_all, sel)
            tq = _take_rows(inputs["teacher_query"], rows)
            tq = jax.lax.stop_gradient(widen(round_to(tq, dtype), wide))
            t_in = {**teacher, "teacher_query": tq, "teacher_kv": _window(teacher["teacher_kv"], lo, width)}
            t = jax.lax.stop_gradient(teacher_distribution(t_in, keep, valid_tok, cfg, rows, inputs["segment_ids"],
                                                           window, shard.sum_heads, dtype))
            return kl_per_token(masked, keep, valid_tok, t, cfg.sparse_loss), valid_tok

        return None, _in_key_window(block_loss, _widths(cfg, w, shard), inputs, start, r, blocks,
                                    cfg.compress_ratio)

    # kl, valid_tok: [nb, B, r]. The padding rows of the last block are in there: `row_ok`
    # made them rows with no valid block, so their KL term is 0 and they are not counted.
    # The backward recomputes each block (jax.checkpoint), keeping only the teacher kernels'
    # normaliser [B, r, h] per block ([B, S, h] in all, one or two; none on the XLA path), so
    # the recomputed T costs one kernel, not three.
    body_ckpt = jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names(TEACHER_NORMALISER))
    kl, valid_tok = _over_blocks(body if num_query_blocks(seq_len, r) == 1 else body_ckpt, seq_len, r)
    # The normaliser is global: every block's valid rows (on a mesh: every device's), counted
    # once, divided once.
    total = _apply(shard.sum_rows, jnp.sum(kl))
    count = _apply(shard.sum_rows, jnp.sum(valid_tok))
    return cfg.loss_scale * total / jnp.maximum(count, 1).astype(wide)


def parity_bundle(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    """What jax_impl.api's parity bundle returns, on the blocked path: the forward and,
    per mode (dense, sparse, sparse at `selection`), (loss, param_grads, input_grads)."""
    out = {"forward": forward(params, {**float_inputs, **int_inputs}, cfg, dtype_name)}
    modes = {"dense": (False, None), "sparse": (True, None), "sparse_at_selection": (True, selection)}
    for mode, (sparse, sel) in modes.items():
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        value, (pg, ig) = jax.value_and_grad(loss, argnums=(0, 1))(
            params, float_inputs, int_inputs, sel, c, dtype_name)
        out[mode] = (value, pg, ig)
    return out

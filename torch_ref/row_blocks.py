"""The reference driven over blocks of query rows (SPEC section 11): bookkeeping around the
plain code of `torch_ref.reference`, for problems whose [B, S, W] arrays no process may hold.

Every quantity but the gradients is a function of one query row given the compressed keys, and
the loss is a sum of per-row KL terms over the count of valid rows. So this module

- computes the compressed keys once (`reference.compress`), for the whole sequence;
- walks the query rows in blocks of `block_rows` (a fixed count, 512 by default; the rows of a
  block are a plain slice, with no padding and no scan), and hands each block to the very
  functions the unblocked reference calls on every row (`indexer_parts`'s projections, `rope`,
  `score_stage`, `block_validity`, `topk_indices`, `kl_parts`), with the rows they read;
- hands each block only the blocks a row of it can see: a block j is valid for row s only if
  j * m + m <= s + 1 (positions grow within a document and a later document's blocks are in
  another segment), so the keys past ceil(s_end / m) are left out, and only if its tokens are in
  the row's document, so the keys before the first whole block of the block's earliest row's
  document are left out too. What they would add is exactly nothing (a -inf score, a zero
  teacher and student probability);
- adds the gradients up: the keys enter each block as one wide leaf (the keys widened, exactly
  as `scoring_values` widens them), each block's backward adds its share of d loss / d keys and
  of the query parameters' gradients, and one backward from the keys to their parameters
  follows the last block. The loss is a sum of KL terms divided by a global count, so each
  block's backward is of its own sum and the gradients are divided by the count once, at the end.

Nothing here re-derives the mathematics: no masking rule, no softmax, no score formula of its
own. `jax_impl` walks rows with a `lax.scan` over query blocks of `query_chunk` rows with a
clamped gather and padding rows; none of that is here, and the block sizes differ.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch

from .config import CSAConfig
from .reference import (_prepare, _selection, _teacher, block_validity, compress, kl_parts, rope, score_stage,
                        scoring_values, topk_indices)

BLOCK_ROWS = 512
_KEY_PARAMS = ("indexer.wkv", "indexer.wgate", "indexer.ape", "indexer.kv_norm")


def _visible_blocks(seg: torch.Tensor, rows: slice, m: int, W: int) -> slice:
    """The blocks a row of `rows` can see: from the first whole block of the earliest row's
    document (over the batch, the earliest) to ceil(rows.stop / m), at most W."""
    first = min(int(torch.nonzero(seg[b] == seg[b, rows.start])[0, 0]) for b in range(seg.shape[0]))
    stop = min(W, -(-rows.stop // m))
    return slice(min(-(-first // m), stop), stop)


def _blocks(S: int, block_rows: int) -> Iterator[slice]:
    if block_rows < 1:
        raise ValueError(f"block_rows={block_rows} must be >= 1")
    for start in range(0, S, block_rows):
        yield slice(start, min(S, start + block_rows))


def _rows_scores(p, x, ql, pos, seg, K_in, cfg: CSAConfig, dtype, wide, rows: slice, blocks: slice):
    """(raw scores [B, r, Wv] wide, validity [B, r, Wv]) of the rows against the keys `K_in` of
    the blocks `blocks` (already what the scores consume), by `indexer_parts`'s steps on those rows."""
    B = x.shape[0]
    HI, DI = cfg.index_n_heads, cfg.index_head_dim
    n = rows.stop - rows.start
    q = (ql[:, rows] @ p["indexer.wq_b"].to(dtype)).reshape(B, n, HI, DI)
    q = rope(q, pos[:, rows, None], cfg, dtype, wide)
    w = (x[:, rows] @ p["indexer.weights_proj"].to(dtype)).to(wide) * HI ** -0.5
    raw = score_stage(scoring_values(q, cfg, dtype, wide), K_in, w)
    return raw, block_validity(pos, seg, cfg, rows, blocks)


def _pad_picks(picks: torch.Tensor, k_eff: int) -> torch.Tensor:
    """Picks over the visible blocks [B, r, <= k_eff] -> [B, r, k_eff], -1 filling (the blocks
    left out are invalid, so top-k over every block would have given -1 there)."""
    missing = k_eff - picks.shape[-1]
    if missing <= 0:
        return picks
    return torch.cat([picks, torch.full((*picks.shape[:-1], missing), -1, dtype=picks.dtype)], dim=-1)


def forward_blocks(params: Mapping[str, Any], inputs: Mapping[str, Any], cfg: CSAConfig, dtype: str,
                   block_rows: int = BLOCK_ROWS, rows: Iterable[slice] | None = None
                   ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """`indexer_forward`'s index_scores and topk_indices, one block of rows at a time: yields
    (rows, masked scores [B, r, W] wide with -inf where invalid, picks [B, r, k_eff] int64), for
    blocks of `block_rows` rows or the slices `rows` (in order). The compressed keys are
    `keys(...)`. Unquantized problems only."""
    if cfg.index_quant is not None:
        raise ValueError("the row-block reference judges unquantized problems (index_quant=None)")
    with torch.no_grad():
        p, leaves, pos, seg, dtype_t, wide = _prepare(params, inputs, cfg, dtype, teacher=False)
        x = leaves["hidden_states"].to(dtype_t)
        ql = leaves["q_latent"].to(dtype_t)
        K_in = scoring_values(compress(x, p, pos, cfg, dtype_t, wide), cfg, dtype_t, wide)
        B, S = pos.shape
        W, m = K_in.shape[1], cfg.compress_ratio
        k_eff = min(cfg.index_topk, W)
        for r in (_blocks(S, block_rows) if rows is None else rows):
            vis = _visible_blocks(seg, r, m, W)
            raw, valid = _rows_scores(p, x, ql, pos, seg, K_in[:, vis], cfg, dtype_t, wide, r, vis)
            scores = torch.full((B, r.stop - r.start, W), float("-inf"), dtype=wide)
            scores[..., vis] = torch.where(valid, raw, torch.full_like(raw, float("-inf")))
            picks = topk_indices(scores[..., vis], valid, cfg.index_topk)
            yield r, scores, _pad_picks(torch.where(picks >= 0, picks + vis.start, picks), k_eff)


def keys(params, inputs, cfg: CSAConfig, dtype: str) -> torch.Tensor:
    """The compressed keys [B, W, DI] in the compute dtype (`reference.compress`)."""
    with torch.no_grad():
        p, leaves, pos, _, dtype_t, wide = _prepare(params, inputs, cfg, dtype, teacher=False)
        return compress(leaves["hidden_states"].to(dtype_t), p, pos, cfg, dtype_t, wide)


def loss_and_grads(params, inputs, cfg: CSAConfig, dtype: str, selection=None, block_rows: int = BLOCK_ROWS):
    """`indexer_loss_and_grads`'s (loss, {param: grad (wide)}) summed over blocks of rows
    (`selection` [B, S, k_eff]: the picks of sparse mode, else its own top-k). The input
    gradients are not formed: every input is detached before the loss (the unblocked
    reference's are exactly 0 for that reason alone)."""
    if cfg.index_quant is not None:
        raise ValueError("the row-block reference judges unquantized problems (index_quant=None)")
    p, leaves, pos, seg, dtype_t, wide = _prepare(params, inputs, cfg, dtype, teacher=True)
    sel = _selection(selection, cfg, inputs)
    x = leaves["hidden_states"].to(dtype_t).detach()
    ql = leaves["q_latent"].to(dtype_t).detach()
    t = _teacher(leaves, cfg, dtype_t, wide)
    B, S = pos.shape
    m = cfg.compress_ratio
    with torch.enable_grad():
        K_in = scoring_values(compress(x, p, pos, cfg, dtype_t, wide), cfg, dtype_t, wide)
        K_leaf = K_in.detach().requires_grad_(True)
        total = torch.zeros((), dtype=wide)
        count = torch.zeros((), dtype=torch.int64)
        for rows in _blocks(S, block_rows):
            vis = _visible_blocks(seg, rows, m, K_leaf.shape[1])
            raw, valid = _rows_scores(p, x, ql, pos, seg, K_leaf[:, vis], cfg, dtype_t, wide, rows, vis)
            # the selection's block ids counted from the first visible block (-1 stays out of range)
            picks = None if sel is None else torch.where(sel[:, rows] >= 0, sel[:, rows] - vis.start, -1)
            parts = kl_parts(raw, valid, t["tq"][:, rows], t["tkv"][:, vis], cfg, wide, picks,
                             seg=seg, twkv=t["twkv"], sink=t["sink"], rows=rows)
            block_sum = torch.sum(parts["kl"])
            if block_sum.requires_grad:
                block_sum.backward()
            total = total + block_sum.detach()
            count = count + torch.sum(parts["valid_tok"])
        if K_leaf.grad is not None:
            K_in.backward(K_leaf.grad)
    scale = cfg.loss_scale / torch.clamp(count, min=1).to(wide)
    grads = {n: (torch.zeros_like(v) if v.grad is None else v.grad) * scale for n, v in p.items()}
    return (cfg.loss_scale * total / torch.clamp(count, min=1).to(wide)).detach(), grads

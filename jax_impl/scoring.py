"""Lightning-indexer scores and top-k (SPEC section 7), native and head-chunked.

score[b,s,j] = sum_h w[b,s,h] * relu(q[b,s,h] . K[b,j]) * DI**-0.5

`cfg.scoring_backend = "pallas"` replaces the per-chunk head sum by the Pallas kernels of
jax_impl.kernels (forward and backward tiled over query rows and key blocks); everything
around it is shared.

The native path materialises the [B, S, HI, W] logits at once. The chunked
path walks the heads with `jax.lax.scan`, `indexer_head_chunk` heads a step,
adding each chunk's [B, S, W] contribution into a wide-dtype accumulator. The
chunk's queries are projected INSIDE the scan body from `q_latent` and the
chunk's columns of `wq_b`, so neither an all-heads q nor its gradient ever
exists; the body runs under `jax.checkpoint`, so the backward pass keeps one
chunk's intermediates, not all heads'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .pooling import block_positions
from .kernels import contribution as pallas_contribution
from .kernels import default_tiles, live_tiles
from .precision import project
from .precision import widen as widen_to
from .quant import quantize_for_scoring
from .rope import apply_rope


def key_blocks(position_ids, segment_ids, cfg, seq_len: int):
    """What validity needs of the W compressed blocks, from the whole sequence's ids:
    (first position [B, W], all m tokens in one document [B, W] bool, that document [B, W])."""
    m = cfg.compress_ratio
    w = cfg.num_blocks(seq_len)
    b = position_ids.shape[0]
    first = block_positions(position_ids, m, w)  # [B, W]
    seg_blocks = segment_ids[:, : w * m].reshape(b, w, m)
    uniform = jnp.all(seg_blocks == seg_blocks[..., :1], axis=-1)  # [B, W]
    return first, uniform, seg_blocks[..., 0]


def rows_validity(position_ids, segment_ids, blocks, m: int):
    """[B, r, W] bool for the query rows given (position_ids, segment_ids [B, r]: any rows,
    e.g. one query block) against the blocks of `key_blocks`: block j lies wholly in the
    query's past, inside its document."""
    first, uniform, block_doc = blocks
    causal = first[:, None, :] + m <= position_ids[:, :, None] + 1
    same_doc = uniform[:, None, :] & (block_doc[:, None, :] == segment_ids[:, :, None])
    return causal & same_doc


def block_validity(position_ids, segment_ids, cfg, seq_len: int):
    """[B, S, W] bool: block j lies wholly in query s's past, inside its document."""
    blocks = key_blocks(position_ids, segment_ids, cfg, seq_len)
    return rows_validity(position_ids, segment_ids, blocks, cfg.compress_ratio)


def head_weights(x, weights_proj, n_heads: int, wide):
    """w = (x @ weights_proj) * HI**-0.5: the product in the compute dtype, then widened."""
    return project(x, weights_proj, wide).astype(wide) * (n_heads**-0.5)


def queries(q_latent, wq, position_ids, n_heads: int, cfg, wide):
    """Project and rotate queries for `n_heads` heads: [B, S, n_heads, DI] in the compute dtype
    (RoPE applied; before any quantization, see `scoring_queries`)."""
    b, s, _ = q_latent.shape
    q = project(q_latent, wq, wide).reshape(b, s, n_heads, cfg.index_head_dim)
    return apply_rope(q, position_ids[:, :, None], cfg.rope_head_dim, cfg.rope_theta, wide, cfg.rope_scaling)


def scoring_queries(q, cfg, wide, imposed=None):
    """What the scores consume of the queries q [B, S, c, DI] (compute dtype, after RoPE), and
    their (codes, scales): q itself and None, or with `cfg.index_quant` its rotated, quantized
    q_hat (wide, straight-through gradient; SPEC section 7a) and the codes and scales it was
    made of. Each head of each row on its own, so any split of the heads or rows computes the
    same values. `imposed`: (codes, scales) to score instead of q's own (`quantize_for_scoring`)."""
    if cfg.index_quant is None:
        return q, None
    q_hat, codes, scales = quantize_for_scoring(q, cfg.index_quant, wide, imposed)
    return q_hat, (codes, scales)


def scoring_keys(keys, cfg, wide, imposed=None):
    """What the scores consume of the compressed keys [B, W, DI] (compute dtype, after RoPE),
    and their (codes, scales): as `scoring_queries`. Each block on its own, so a device may
    quantize its own blocks before they are gathered."""
    if cfg.index_quant is None:
        return keys, None
    k_hat, codes, scales = quantize_for_scoring(keys, cfg.index_quant, wide, imposed)
    return k_hat, (codes, scales)


def imposed_codes(inputs):
    """(the queries' (codes, scales), the keys' (codes, scales)) that `inputs` carries to be
    scored instead of the indexer's own (jax_impl.api's entry points' `codes=`), or (None, None)."""
    if "query_codes" not in inputs:
        return None, None
    return (inputs["query_codes"], inputs["query_scales"]), (inputs["key_codes"], inputs["key_scales"])


def codes_dict(query_codes, key_codes) -> dict:
    """The quantizer's outputs under their public names (SPEC section 7a): query_codes
    [B, S, HI, DI] and key_codes [B, W, DI] (uint8 bit patterns), query_scales [B, S, HI,
    DI / block] and key_scales [B, W, DI / block] (float32 powers of two); {} when the indexer
    does not quantize."""
    out = {}
    for side, pair in (("query", query_codes), ("key", key_codes)):
        if pair is not None:
            out[f"{side}_codes"], out[f"{side}_scales"] = pair
    return out


def head_contribution_autodiff(q, keys, hw):
    """sum_h hw[b,s,h] * relu(q[b,s,h] . K[b,j]) for the heads in q: [B, S, W].

    q [B, S, c, DI], keys [B, W, DI] and hw [B, S, c], all in the wide dtype. Differentiated
    by plain JAX autodiff; `head_contribution` is the same forward with a hand-written VJP.
    """
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    # XLA's reduce over the head axis, not a chain of adds in the head-chunked scan's order: the
    # chain is 2x faster on XLA:CPU at length, but it gives the native program the chunked one's
    # roundings, and the ci sample's chunk checks then miss a cast down that skips its rounding
    # (the mutant precision_cast_without_rounding survives).
    return jnp.sum(hw[..., None] * jax.nn.relu(logits), axis=2)


@jax.custom_vjp
def _head_contribution(q, keys, hw):
    """`head_contribution_autodiff`'s forward, with the memory-lean VJP below."""
    return head_contribution_autodiff(q, keys, hw)


def _head_contribution_fwd(q, keys, hw):
    # Keep the (small) inputs only: the backward recomputes the logits.
    return _head_contribution(q, keys, hw), (q, keys, hw)


def _head_contribution_bwd(res, g):
    q, keys, hw = res
    b, s, c, d = q.shape
    # d out / d logits before the hw factor: g where the head fired, else 0. The
    # only [B, S, c, W] array of the backward (the logits are not kept).
    m = jnp.where(jnp.einsum("bshd,bwd->bshw", q, keys) > 0, g[:, :, None, :], 0.0)
    mk = jnp.einsum("bshw,bwd->bshd", m, keys)
    # sum_w m * logits = q . (m @ K): the same double sum over (w, d), reordered.
    dhw = jnp.sum(q * mk, axis=-1)
    dq = mk * hw[..., None]
    # dK[w] = sum_{s,h} m[s,h,w] hw[s,h] q[s,h]: contract the (s, h) rows of m as they lie.
    qh = (q * hw[..., None]).reshape(b, s * c, d)
    dk = jax.lax.dot_general(qh, m.reshape(b, s * c, -1), (((1,), (1,)), ((0,), (0,))))
    return dq, jnp.swapaxes(dk, 1, 2), dhw


_head_contribution.defvjp(_head_contribution_fwd, _head_contribution_bwd)

# The public name of the custom-VJP scoring (jax.test_util.check_grads targets it; tests
# compare it with plain autodiff of `head_contribution_autodiff`).
head_contribution = _head_contribution
CONTRIBUTIONS = {"custom": _head_contribution, "autodiff": head_contribution_autodiff}


def raw_scores(q_latent, position_ids, wq_b, hw, keys, cfg, wide, vjp: str = "custom", with_codes: bool = False,
               query_codes=None, valid=None):
    """Unmasked scores [B, S, W] in the wide dtype; with `with_codes` (and `cfg.index_quant`)
    also the queries' (codes [B, S, HI, DI], scales [B, S, HI, DI / block]) the scores consumed,
    chunk by chunk as the scan made them. `query_codes`: such a pair to score instead of the
    queries' own (each chunk takes its heads' slice).

    q_latent is in the compute dtype, wq_b too or wide (`precision.project`: a wide wq_b's
    gradient comes back wide, unrounded), keys as `scoring_keys` returns them (compute
    dtype or widened; wide x_hat with `cfg.index_quant`); hw [B, S, HI] is wide. The queries
    go through `scoring_queries` here, head chunk by head chunk. `vjp`:
    "custom" (the hand-written backward, always in the library) or "autodiff" (plain JAX
    autodiff of the same forward: the tests' yardstick for the custom VJP). Under
    `cfg.scoring_backend == "pallas"` each head chunk's sum is the Pallas kernels' instead,
    fed q and K in the compute dtype (the kernels widen them tile by tile, exactly as
    `.astype(wide)` does here); the head and query chunking around it are the same. `valid`
    ([B, S, W] bool, the mask the caller applies to the scores) lets the kernels skip the
    tiles with no valid entry (their scores are 0, not computed); the XLA path ignores it.
    """
    heads, di, chunk = cfg.index_n_heads, cfg.index_head_dim, cfg.indexer_head_chunk
    if cfg.scoring_backend == "pallas":
        # The live tiles once for every head chunk (the mask does not depend on the heads), at
        # the tiles `contribution` would pick for q's dtype.
        tiles = default_tiles(q_latent.shape[1], keys.shape[1], q_latent.dtype)
        live = None if valid is None else live_tiles(valid, tiles)
        keys_wide, widen = keys, (lambda a: a)

        def _head_contribution(q, keys, hw):  # noqa: F811
            return pallas_contribution(q, keys, hw, valid=live)
    else:
        _head_contribution, keys_wide = CONTRIBUTIONS[vjp], widen_to(keys, wide)  # noqa: F811

        def widen(a):
            return widen_to(a, wide)

    codes = None
    if chunk == 0:
        q, codes = scoring_queries(queries(q_latent, wq_b, position_ids, heads, cfg, wide), cfg, wide, query_codes)
        acc = _head_contribution(widen(q), keys_wide, hw)
    else:

        @jax.checkpoint
        def body(acc, i):
            wq = jax.lax.dynamic_slice_in_dim(wq_b, i * (chunk * di), chunk * di, axis=1)
            imposed = None if query_codes is None else tuple(
                jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=2) for a in query_codes)
            q, codes = scoring_queries(queries(q_latent, wq, position_ids, chunk, cfg, wide), cfg, wide, imposed)
            hw_c = jax.lax.dynamic_slice_in_dim(hw, i * chunk, chunk, axis=2)
            return acc + _head_contribution(widen(q), keys_wide, hw_c), codes if with_codes else None

        # Zeros [B, S, W] typed like the body's output: under shard_map a scan's carry must
        # vary over the same mesh axes going in and coming out (jax_impl.sharded); a plain 0.
        acc0 = jnp.zeros_like(hw[..., :1] * keys_wide[:, None, :, 0])
        acc, codes = jax.lax.scan(body, acc0, jnp.arange(heads // chunk))
        if codes is not None:  # [HI / c, B, S, c, ...] per chunk -> [B, S, HI, ...]
            codes = tuple(jnp.moveaxis(a, 0, 2).reshape(*a.shape[1:3], heads, a.shape[-1]) for a in codes)
    scores = acc * (di**-0.5)
    return (scores, codes) if with_codes else scores


def mask_scores(scores, valid):
    """Invalid entries become -inf."""
    return jnp.where(valid, scores, -jnp.inf)


def topk_indices(masked_scores, valid, k: int):
    """Top-k block indices per query, [B, S, min(k, W)] int32; an invalid pick is -1."""
    b, s, w = masked_scores.shape
    k_eff = min(k, w)
    if k_eff == 0:
        return jnp.zeros((b, s, 0), jnp.int32)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(masked_scores), k_eff)
    picked_valid = jnp.take_along_axis(valid, idx, axis=-1)
    return jnp.where(picked_valid, idx, -1).astype(jnp.int32)


def selection_mask(topk, num_blocks: int):
    """[B, S, W] bool: j is among the (non -1) picks of query s.

    A scatter of each row's k picks (a -1 is sent out of range and dropped): O(B*S*k) work
    and nothing bigger than the mask. Comparing the picks against every block instead
    (`any(topk[..., None] == arange(W), axis=-2)`) builds a [B, S, k, W] boolean that XLA:CPU
    does not fuse away (measured: 0.25 GiB per query block of 256 rows at W = 2048, k = 512)."""
    b, s, _ = topk.shape
    picks = jnp.where(topk < 0, num_blocks, topk)
    rows = (jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None])
    return jnp.zeros((b, s, num_blocks), bool).at[rows[0], rows[1], picks].set(True, mode="drop")

"""The CSA indexer KL distillation loss (SPEC section 8), native and teacher-head-chunked.

The teacher distribution T is the head-summed main-attention softmax over the
compressed blocks, renormalised; the student is the indexer's log-softmax. The
loss is KL(T || student) averaged over the tokens that have any valid block.
Nothing differentiates through the teacher (stop-gradient), so its chunked path
is a plain scan with no checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .precision import round_to
from .scoring import selection_mask

MASK = -0.7 * float(np.finfo(np.float32).max)
EPS = 1e-8


def _teacher_probs(tq, teacher_kv, additive_mask):
    """sum over the heads of tq [B, S, h, D] of softmax_j(tq . teacher_kv[j] + mask): [B, S, W].

    SPEC section 8 replaces the logits of rows with no valid block by 0 before the
    softmax; those rows of T are zeroed afterwards (teacher_distribution), so their
    softmax never reaches a result and is not masked here. Leaving that select out
    lets XLA fuse the logits, the softmax and the head sum into one pass that never
    holds a [B, S, h, W] array.
    """
    a = jnp.einsum("bshd,bwd->bshw", tq, teacher_kv) + additive_mask[:, :, None, :]
    return jnp.sum(jax.nn.softmax(a, axis=-1), axis=2)


def teacher_distribution(teacher_query, teacher_kv, keep, valid_tok, chunk: int):
    """T [B, S, W] (wide): head-summed teacher softmax, renormalised per row.

    teacher_query [B, S, H, D] and teacher_kv [B, W, D] are already wide.
    """
    additive_mask = jnp.where(keep, 0.0, MASK).astype(teacher_query.dtype)
    if chunk == 0:
        t = _teacher_probs(teacher_query, teacher_kv, additive_mask)
    else:
        heads = teacher_query.shape[2]

        def body(acc, i):
            tq = jax.lax.dynamic_slice_in_dim(teacher_query, i * chunk, chunk, axis=2)
            return acc + _teacher_probs(tq, teacher_kv, additive_mask), None

        acc0 = jnp.zeros(keep.shape, teacher_query.dtype)
        t, _ = jax.lax.scan(body, acc0, jnp.arange(heads // chunk))
    t = jnp.where(valid_tok[..., None], t, 0.0)
    return t / (jnp.sum(t, axis=-1, keepdims=True) + EPS)


def kl_loss(masked_scores, valid, topk, teacher_query, teacher_kv, cfg, dtype, wide, selection=None):
    """Scalar loss in the wide dtype.

    masked_scores [B, S, W] wide (-inf at invalid blocks), valid [B, S, W] bool,
    topk [B, S, k_eff] (the indexer's own picks; `selection` overrides them in sparse mode).
    """
    b, s, w = masked_scores.shape
    if w == 0:
        return jnp.zeros((), wide)
    keep = valid
    if cfg.sparse_loss:
        picks = topk if selection is None else selection
        keep = valid & selection_mask(picks, w)
    valid_tok = jnp.any(keep, axis=-1)

    tq = jax.lax.stop_gradient(round_to(teacher_query, dtype).astype(wide))
    tkv = jax.lax.stop_gradient(round_to(teacher_kv, dtype).astype(wide))
    t = jax.lax.stop_gradient(teacher_distribution(tq, tkv, keep, valid_tok, cfg.loss_head_chunk))

    z = masked_scores
    if cfg.sparse_loss:
        z = jnp.where(keep, z, MASK)
    z = jnp.where(valid_tok[..., None], z, 0.0)
    log_p = jnp.where(valid_tok[..., None], jax.nn.log_softmax(z, axis=-1), 0.0)

    positive = t > 0
    # Double `where`: the unselected branch must not be inf/NaN, or its (zero)
    # cotangent times inf would poison the gradient.
    safe_t = jnp.where(positive, t, 1.0)
    safe_log_p = jnp.where(positive, log_p, 0.0)
    terms = jnp.where(positive, safe_t * (jnp.log(safe_t + EPS) - safe_log_p), 0.0)
    kl = jnp.where(valid_tok, jnp.sum(terms, axis=-1), 0.0)
    count = jnp.maximum(jnp.sum(valid_tok), 1).astype(wide)
    return cfg.loss_scale * jnp.sum(kl) / count


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


def teacher_head_sum(teacher_query, teacher_kv, keep, chunk: int):
    """sum over the heads of teacher_query of the masked teacher softmax, [B, S, W] (wide),
    not yet renormalised: a sum over any subset of the heads (jax_impl.sharded adds the
    per-device sums over the `model` mesh axis before `normalise_teacher`).

    teacher_query [B, S, h, D] and teacher_kv [B, W, D] are already wide.
    """
    additive_mask = jnp.where(keep, 0.0, MASK).astype(teacher_query.dtype)
    if chunk == 0:
        return _teacher_probs(teacher_query, teacher_kv, additive_mask)
    heads = teacher_query.shape[2]

    def body(acc, i):
        tq = jax.lax.dynamic_slice_in_dim(teacher_query, i * chunk, chunk, axis=2)
        return acc + _teacher_probs(tq, teacher_kv, additive_mask), None

    # Zeros [B, S, W] typed like the body's output (a shard_map scan needs equal carry types).
    acc0 = jnp.zeros_like(additive_mask * teacher_query[:, :, :1, 0])
    t, _ = jax.lax.scan(body, acc0, jnp.arange(heads // chunk))
    return t


def normalise_teacher(t, valid_tok):
    """T: the head sum zeroed on rows with no valid block, renormalised per row."""
    t = jnp.where(valid_tok[..., None], t, 0.0)
    return t / (jnp.sum(t, axis=-1, keepdims=True) + EPS)


def teacher_distribution(teacher_query, teacher_kv, keep, valid_tok, chunk: int):
    """T [B, S, W] (wide): head-summed teacher softmax, renormalised per row."""
    return normalise_teacher(teacher_head_sum(teacher_query, teacher_kv, keep, chunk), valid_tok)


def loss_keep(valid, topk, sparse_loss: bool, selection=None):
    """(keep [B, S, W], valid_tok [B, S]): the blocks the loss sees (valid, and in sparse mode
    picked: `selection` overrides the own top-k) and the rows that have any."""
    keep = valid
    if sparse_loss:
        picks = topk if selection is None else selection
        keep = valid & selection_mask(picks, valid.shape[-1])
    return keep, jnp.any(keep, axis=-1)


def teacher_inputs(teacher_query, teacher_kv, dtype, wide):
    """The teacher activations rounded to the compute dtype, widened, detached."""
    tq = jax.lax.stop_gradient(round_to(teacher_query, dtype).astype(wide))
    tkv = jax.lax.stop_gradient(round_to(teacher_kv, dtype).astype(wide))
    return tq, tkv


def student_log_probs(masked_scores, keep, valid_tok, sparse_loss: bool):
    """The student's log-probabilities [B, S, W] (wide): MASK outside `keep` in sparse mode,
    0 on rows with no valid block."""
    z = masked_scores
    if sparse_loss:
        z = jnp.where(keep, z, MASK)
    z = jnp.where(valid_tok[..., None], z, 0.0)
    return jnp.where(valid_tok[..., None], jax.nn.log_softmax(z, axis=-1), 0.0)


def kl_per_token(masked_scores, keep, valid_tok, t, sparse_loss: bool):
    """kl[b, s] = KL(T || softmax(student)) per row, 0 on rows with no valid block."""
    log_p = student_log_probs(masked_scores, keep, valid_tok, sparse_loss)

    positive = t > 0
    # Double `where`: the unselected branch must not be inf/NaN, or its (zero)
    # cotangent times inf would poison the gradient.
    safe_t = jnp.where(positive, t, 1.0)
    safe_log_p = jnp.where(positive, log_p, 0.0)
    terms = jnp.where(positive, safe_t * (jnp.log(safe_t + EPS) - safe_log_p), 0.0)
    return jnp.where(valid_tok, jnp.sum(terms, axis=-1), 0.0)


def kl_loss(masked_scores, valid, topk, teacher_query, teacher_kv, cfg, dtype, wide, selection=None):
    """Scalar loss in the wide dtype.

    masked_scores [B, S, W] wide (-inf at invalid blocks), valid [B, S, W] bool,
    topk [B, S, k_eff] (the indexer's own picks; `selection` overrides them in sparse mode).
    """
    if masked_scores.shape[-1] == 0:
        return jnp.zeros((), wide)
    keep, valid_tok = loss_keep(valid, topk, cfg.sparse_loss, selection)
    tq, tkv = teacher_inputs(teacher_query, teacher_kv, dtype, wide)
    t = jax.lax.stop_gradient(teacher_distribution(tq, tkv, keep, valid_tok, cfg.loss_head_chunk))
    kl = kl_per_token(masked_scores, keep, valid_tok, t, cfg.sparse_loss)
    count = jnp.maximum(jnp.sum(valid_tok), 1).astype(wide)
    return cfg.loss_scale * jnp.sum(kl) / count

"""The CSA indexer KL distillation loss (SPEC section 8), native and teacher-head-chunked.

The teacher distribution T is the main attention's own probability on the compressed
blocks, summed over heads and renormalised. By default (`teacher_normaliser="joint"`,
DeepSeek-V4's CSA attention) each head has ONE softmax over its sink logit, the raw tokens
of its sliding window and the compressed blocks, so a head that looks at its window or sink
contributes less; `"compressed"` renormalises each head over the blocks alone (every head
then contributes mass 1). The window is banded: a query reads its n_win window rows only,
never a [B, S, S] array. The student is the indexer's log-softmax. The
loss is KL(T || student) averaged over the tokens that have any valid block.
Nothing differentiates through the teacher (stop-gradient), so its chunked path
is a plain scan with no checkpoint.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import kernels
from .precision import round_to, widen
from .scoring import selection_mask
from .validate import teacher_input_names

MASK = -0.7 * float(np.finfo(np.float32).max)
EPS = 1e-8
# The name of the teacher kernels' normaliser, [B, r, h] arrays (`jax.ad_checkpoint.checkpoint_name`).
TEACHER_NORMALISER = "teacher_normaliser"


def teacher_inputs(inputs, cfg, dtype, wide) -> dict:
    """The teacher inputs `cfg` uses, rounded to the compute dtype, widened and detached (they
    are activations and parameters of the main attention: nothing trains them here)."""
    return {n: jax.lax.stop_gradient(widen(round_to(inputs[n], dtype), wide)) for n in teacher_input_names(cfg)}


class Window(NamedTuple):
    """Where the query rows' window keys come from. On one device, the whole row: `kv`
    teacher_window_kv [B, S, D], its `segment_ids` [B, S], `lead` 0 and `origin` 0. On a device
    that holds a stretch of the sequence (jax_impl.sharded), the stretch with the `lead` rows
    before it (the halo from the devices before) prepended: query row i is row lead + i of
    `kv`, and row t of `kv` is token origin + t of the sequence (rows before token 0 are not
    in any window). `n`: the window in tokens, min(sliding_window, S) with the whole S."""

    kv: jax.Array
    segment_ids: jax.Array
    n: int
    lead: int = 0
    origin: jax.Array | int = 0


def window_tokens(cfg, seq_len: int) -> int:
    """n: the tokens of a query's window, min(n_win, S) (S: the whole sequence's length)."""
    return min(cfg.sliding_window, seq_len)


def window_of_rows(window_kv, segment_ids, rows, n: int, origin=0):
    """What the sliding window of the query rows `rows` ([r] consecutive token indices) needs,
    banded: the rows are cut into sub-blocks of c = min(n, r) rows, and sub-block j reads only
    the c + n - 1 window-key rows that end at its last row. Returns (keys [B, nb, c + n - 1, D],
    ok [B, r, c + n - 1] bool, c): row i's sub-block keys, which of them are in its window (at
    most n tokens back, itself included, not before the sequence, same document), and c.
    `origin`: the token index of row 0 of window_kv (`Window`); rows before token 0 are none.
    Every read
    is a clamped gather with a static index map: nothing of [B, S, S] size is formed, and the
    logits (`window_logits`) are one contraction, not a loop."""
    r = rows.shape[0]
    seq_len = segment_ids.shape[1]
    c = min(n, r)
    nb = -(-r // c)
    # Key row of (sub-block j, slot t): rows[0] - n + 1 + j * c + t.
    first = rows[0] - (n - 1)
    key_rows = first + jnp.arange(nb)[:, None] * c + jnp.arange(c + n - 1)[None, :]  # [nb, c + n - 1]
    keys = jnp.take(window_kv, key_rows, axis=1, mode="clip")  # [B, nb, c + n - 1, D]
    # Query row rho = j * c + i sees slot t when 0 <= i + n - 1 - t < n (t - i: how far back).
    i = jnp.arange(nb * c) % c
    back = i[:, None] + (n - 1) - jnp.arange(c + n - 1)[None, :]  # [nb * c, c + n - 1]
    row_keys = jnp.repeat(key_rows, c, axis=0)  # [nb * c, c + n - 1]
    seg_q = jnp.take(segment_ids, rows, axis=1, mode="clip")  # [B, r]
    seg_k = jnp.take(segment_ids, jnp.clip(row_keys[:r], 0, seq_len - 1), axis=1)  # [B, r, c + n - 1]
    ok = ((back[:r] >= 0) & (back[:r] < n) & (row_keys[:r] + origin >= 0))[None] & (seg_k == seg_q[..., None])
    return keys, ok, c


def window_logits(tq, keys, ok, c: int):
    """u [B, r, h, c + n - 1]: each query row's logits against its sub-block's window keys,
    MASK outside its window. tq [B, r, h, D]; keys, ok, c from `window_of_rows`."""
    b, r, h, d = tq.shape
    nb, width = keys.shape[1], keys.shape[2]
    tq_blocks = jnp.pad(tq, ((0, 0), (0, nb * c - r), (0, 0), (0, 0))).reshape(b, nb, c, h, d)
    u = jnp.einsum("bjihd,bjtd->bjiht", tq_blocks, keys).reshape(b, nb * c, h, width)[:, :r]
    return jnp.where(ok[:, :, None, :], u, MASK)


def _teacher_probs(tq, teacher_kv, additive_mask, sink=None, window=None):
    """sum over the heads of tq [B, S, h, D] of each head's probabilities on the compressed
    blocks, [B, S, W].

    `sink` None: the compressed teacher, a softmax over the blocks alone. Otherwise the joint
    teacher: ONE normaliser per head over its sink [h], its window logits (`window`: the
    (keys, ok, c) of `window_of_rows`, or None without a window) and the blocks; each head's
    block probabilities then sum to less than 1.

    SPEC section 8 replaces the logits of rows with no valid block by 0 before the
    softmax; those rows of T are zeroed afterwards (teacher_distribution), so their
    softmax never reaches a result and is not masked here. Leaving that select out
    lets XLA fuse the logits, the softmax and the head sum into one pass that never
    holds a [B, S, h, W] array.
    """
    a = jnp.einsum("bshd,bwd->bshw", tq, teacher_kv) + additive_mask[:, :, None, :]
    if sink is None:
        return jnp.sum(jax.nn.softmax(a, axis=-1), axis=2)
    parts = [jnp.broadcast_to(sink[None, None, :, None], (*a.shape[:3], 1)), a]
    if window is not None:
        parts.append(window_logits(tq, *window))
    log_norm = jax.nn.logsumexp(jnp.concatenate(parts, axis=-1), axis=-1, keepdims=True)
    return jnp.sum(jnp.exp(a - log_norm), axis=2)


def _teacher_probs_kernels(tq, od, teacher_kv, keep, live, sink=None, window=None):
    """`_teacher_probs` by the Pallas kernels (`cfg.scoring_backend == "pallas"`), in the same
    arithmetic: each head's max over its kept blocks (`kernels.teacher_block_max`), joined here
    with its sink and window logits into the row's whole max M; the sum of exp(logit - M) over
    the kept blocks (`kernels.teacher_block_sumexp`), plus the sink and window terms here; then
    the head sum of the block probabilities (`kernels.teacher_block_probs`): exp(logit - (M +
    log sum)) for the joint teacher, as XLA subtracts the log-sum-exp, and exp(logit - M) / sum
    for the compressed one, as `jax.nn.softmax` divides. So every exp takes the argument XLA's
    gives it, and only the order of the sums differs. No [B, r, h, W] array exists; the products
    are taken in `od` (the compute dtype, in which the teacher inputs are exact, or wide). An
    entry outside `keep` is 0 (the XLA path gives it exp(MASK - ...), also 0 on every row that
    keeps a block; a row that keeps none is zeroed by `normalise_teacher` on both paths).

    The normaliser ([B, r, h] each) is named TEACHER_NORMALISER: the query-blocked loss saves
    it (jax_impl.query_blocks), so the backward's recomputation of T runs the last kernel only."""
    tq_k, tkv_k = tq.astype(od), teacher_kv.astype(od)
    m = kernels.teacher_block_max(tq_k, tkv_k, keep, live)
    if sink is None:
        shift = jnp.where(jnp.isfinite(m), m, 0)
        total = kernels.teacher_block_sumexp(tq_k, tkv_k, keep, shift, live)
        shift, scale = checkpoint_name((shift, 1 / total), TEACHER_NORMALISER)
        return kernels.teacher_block_probs(tq_k, tkv_k, keep, shift, scale, live)
    parts = [jnp.broadcast_to(sink[None, None, :, None], (*tq.shape[:3], 1))]
    if window is not None:
        parts.append(window_logits(tq, *window))
    extra = jnp.concatenate(parts, axis=-1)  # [B, r, h, 1 + window]
    shift = jnp.maximum(m, jnp.max(extra, axis=-1))  # finite: the sink is
    total = kernels.teacher_block_sumexp(tq_k, tkv_k, keep, shift, live) + jnp.sum(jnp.exp(extra - shift[..., None]),
                                                                                   axis=-1)
    log_norm = checkpoint_name(jnp.log(total) + shift, TEACHER_NORMALISER)
    return kernels.teacher_block_probs(tq_k, tkv_k, keep, log_norm, live=live)


def teacher_head_sum(teacher, keep, cfg, rows, segment_ids, window: Window | None = None, dtype=None):
    """sum over the heads of teacher["teacher_query"] of each head's teacher probabilities on
    the kept blocks, [B, r, W] (wide), not yet renormalised: a sum over any subset of the heads
    (jax_impl.sharded adds the per-device sums over the `model` mesh axis before
    `normalise_teacher`).

    teacher: `teacher_inputs` for the query rows `rows` ([r] token indices): teacher_query
    [B, r, h, D] (h: the heads at hand), teacher_kv [B, W, D], and for the joint teacher
    attention_sink [h] and, with a window, teacher_window_kv [B, S, D]; segment_ids [B, S].
    Heads are walked `cfg.loss_head_chunk` at a time; each chunk computes its own heads'
    window logits and normalisers. `window`: where the rows' window keys come from (`Window`);
    None: teacher["teacher_window_kv"] and segment_ids, the whole sequence. `dtype`: the
    compute dtype, in which the Pallas kernels multiply (`cfg.scoring_backend == "pallas"`;
    None: the inputs' own dtype).
    """
    tq, tkv = teacher["teacher_query"], teacher["teacher_kv"]
    joint = cfg.teacher_normaliser == "joint"
    sink = teacher["attention_sink"] if joint else None
    if window is None and joint and window_tokens(cfg, segment_ids.shape[1]):
        window = Window(teacher["teacher_window_kv"], segment_ids, window_tokens(cfg, segment_ids.shape[1]))
    if joint and window is not None:
        window = window_of_rows(window.kv, window.segment_ids, rows + window.lead, window.n, window.origin)
    else:
        window = None
    additive_mask = jnp.where(keep, 0.0, MASK).astype(tq.dtype)
    if cfg.scoring_backend == "pallas":
        od = kernels.operand_dtype(dtype or tq.dtype, tq.dtype)
        # The live tiles once for every head chunk (keep does not depend on the heads).
        live = kernels.live_tiles(keep, kernels.default_tiles(keep.shape[1], keep.shape[2], od))

        def probs(tq_c, sink_c):
            return _teacher_probs_kernels(tq_c, od, tkv, keep, live, sink_c, window)
    else:
        def probs(tq_c, sink_c):
            return _teacher_probs(tq_c, tkv, additive_mask, sink_c, window)
    chunk = cfg.loss_head_chunk
    if chunk == 0:
        return probs(tq, sink)
    heads = tq.shape[2]

    def body(acc, i):
        tq_c = jax.lax.dynamic_slice_in_dim(tq, i * chunk, chunk, axis=2)
        sink_c = None if sink is None else jax.lax.dynamic_slice_in_dim(sink, i * chunk, chunk)
        return acc + probs(tq_c, sink_c), None

    # Zeros [B, S, W] typed like the body's output (a shard_map scan needs equal carry types).
    acc0 = jnp.zeros_like(additive_mask * tq[:, :, :1, 0])
    t, _ = jax.lax.scan(body, acc0, jnp.arange(heads // chunk))
    return t


def normalise_teacher(t, valid_tok):
    """T: the head sum zeroed on rows with no valid block, renormalised per row."""
    t = jnp.where(valid_tok[..., None], t, 0.0)
    return t / (jnp.sum(t, axis=-1, keepdims=True) + EPS)


def teacher_distribution(teacher, keep, valid_tok, cfg, rows, segment_ids, window: Window | None = None,
                         sum_heads=None, dtype=None):
    """T [B, r, W] (wide): the head-summed teacher probabilities, renormalised per row.
    `sum_heads`: adds the head sum over the devices that hold the other heads (jax_impl.sharded);
    `dtype`: the compute dtype (`teacher_head_sum`)."""
    t = teacher_head_sum(teacher, keep, cfg, rows, segment_ids, window, dtype)
    return normalise_teacher(t if sum_heads is None else sum_heads(t), valid_tok)


def loss_keep(valid, topk, sparse_loss: bool, selection=None):
    """(keep [B, S, W], valid_tok [B, S]): the blocks the loss sees (valid, and in sparse mode
    picked: `selection` overrides the own top-k) and the rows that have any."""
    keep = valid
    if sparse_loss:
        picks = topk if selection is None else selection
        keep = valid & selection_mask(picks, valid.shape[-1])
    return keep, jnp.any(keep, axis=-1)


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


def kl_loss(masked_scores, valid, topk, inputs, cfg, dtype, wide, selection=None):
    """Scalar loss in the wide dtype.

    masked_scores [B, S, W] wide (-inf at invalid blocks), valid [B, S, W] bool,
    topk [B, S, k_eff] (the indexer's own picks; `selection` overrides them in sparse mode),
    inputs: the teacher inputs of `cfg` (as stored) and segment_ids.
    """
    if masked_scores.shape[-1] == 0:
        return jnp.zeros((), wide)
    keep, valid_tok = loss_keep(valid, topk, cfg.sparse_loss, selection)
    teacher = teacher_inputs(inputs, cfg, dtype, wide)
    rows = jnp.arange(masked_scores.shape[1])
    t = jax.lax.stop_gradient(teacher_distribution(teacher, keep, valid_tok, cfg, rows, inputs["segment_ids"],
                                                   dtype=dtype))
    kl = kl_per_token(masked_scores, keep, valid_tok, t, cfg.sparse_loss)
    count = jnp.maximum(jnp.sum(valid_tok), 1).astype(wide)
    return cfg.loss_scale * jnp.sum(kl) / count

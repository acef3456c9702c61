"""Public entry points (docs/plugins.md): indexer_forward, indexer_loss, indexer_loss_and_grads.

Each is traceable: it runs on concrete arrays (numpy or jax) AND inside `jax.jit`,
`jax.grad`, `jax.vmap` (a leading batch of problems) and `shard_map`. First it checks the
structure of its arguments (names, shapes, dtypes: static under tracing, so the same clear
one-line ValueError whether the call is traced or not), then it calls a function jitted with
the config and the dtype name static, compiled once per (config, dtype, shapes); inside an
outer trace that jit is inlined into the caller's program. Checks of VALUES (NaN, positions,
selection range) are host-side only: `validate_inputs` (jax_impl.validate), run by the
caller at its boundary; the entry points never read values.

`prepare_arguments` and `forward_parts` are the steps the entry points share, public for
the other layers built on them (jax_impl.sharded).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import CSAConfig, resolve_dtype
from .loss import kl_loss, loss_keep, student_log_probs, teacher_distribution, teacher_inputs
from .pooling import compress_keys, compress_parts
from .precision import round_to, widen
from . import kernels, query_blocks
from .scoring import codes_dict, imposed_codes, queries, scoring_keys, scoring_queries, block_validity, head_contribution, head_weights, mask_scores, raw_scores, topk_indices
from .validate import (FLOAT_INPUTS, INT_INPUTS, PARAM_NAMES, check_codes, check_inputs, check_params, check_selection,
                       teacher_input_names)


def forward_parts(params, inputs, cfg: CSAConfig, dtype_name: str, score_cfg=None, prepare_keys=None,
                  reduce_scores=None):
    """Keys, masked scores, validity, top-k and the quantizer's outputs (`codes_dict`; {}
    without `cfg.index_quant`) from wide params (SPEC sections 5-7a).

    The hooks serve jax_impl.sharded, where a device scores only its local heads:
    `score_cfg` (the config with the local head count), `prepare_keys` (applied to the
    keys before scoring) and `reduce_scores` (applied to the partial head sum).
    """
    dtype, wide = resolve_dtype(dtype_name)
    p = {k: round_to(v, dtype) for k, v in params.items()}
    # The indexer never trains the hidden states or the query latent.
    x = round_to(jax.lax.stop_gradient(inputs["hidden_states"]), dtype)
    q_latent = round_to(jax.lax.stop_gradient(inputs["q_latent"]), dtype)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    keys = _keys(p, x, pos, cfg, wide)
    hw = head_weights(x, p["indexer.weights_proj"], cfg.index_n_heads, wide)
    imposed_queries, imposed_keys = imposed_codes(inputs)
    k_in, key_codes = scoring_keys(keys, cfg, wide, imposed_keys)
    k_in = k_in if prepare_keys is None else prepare_keys(k_in)
    valid = block_validity(pos, seg, cfg, x.shape[1])
    scores, query_codes = raw_scores(q_latent, pos, p["indexer.wq_b"], hw, k_in, score_cfg or cfg, wide,
                                     with_codes=True, query_codes=imposed_queries, valid=valid)
    if reduce_scores is not None:
        scores = reduce_scores(scores)
    masked = mask_scores(scores, valid)
    return keys, masked, valid, topk_indices(masked, valid, cfg.index_topk), codes_dict(query_codes, key_codes)


def _keys(p, x, pos, cfg: CSAConfig, wide):
    """The compressed keys [B, W, DI] (SPEC section 5) from params and hidden states rounded to the dtype."""
    return compress_keys(x, pos, p["indexer.wkv"], p["indexer.wgate"], p["indexer.ape"], p["indexer.kv_norm"],
                         cfg, wide)


def indexer_keys(params, inputs, cfg: CSAConfig, dtype: str):
    """The compressed keys [B, W, DI] alone (the key path of `forward_parts`: no [B, S, W] array)."""
    wide_params, float_inputs, int_inputs, _ = prepare_arguments(params, inputs, cfg, dtype, teacher=False)
    dtype_, wide = resolve_dtype(dtype)
    p = {k: round_to(v, dtype_) for k, v in wide_params.items()}
    return _keys(p, round_to(float_inputs["hidden_states"], dtype_), int_inputs["position_ids"], cfg, wide)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _forward_jit(params, inputs, cfg, dtype_name):
    if cfg.query_chunk:  # the query-blocked path, assembled to the full outputs
        return query_blocks.forward(params, inputs, cfg, dtype_name)
    keys, masked, _, topk, codes = forward_parts(params, inputs, cfg, dtype_name)
    return {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk, **codes}


def _loss_core(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    if cfg.query_chunk:  # the query-blocked training path
        return query_blocks.loss(params, float_inputs, int_inputs, selection, cfg, dtype_name)
    dtype, wide = resolve_dtype(dtype_name)
    inputs = {**float_inputs, **int_inputs}
    _, masked, valid, topk, _ = forward_parts(params, inputs, cfg, dtype_name)
    return kl_loss(masked, valid, topk, inputs, cfg, dtype, wide, selection)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _loss_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    return _loss_core(params, float_inputs, int_inputs, selection, cfg, dtype_name)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _loss_and_grads_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    grad_fn = jax.value_and_grad(_loss_core, argnums=(0, 1))
    loss, (param_grads, input_grads) = grad_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name)
    return loss, param_grads, input_grads


def _as_jax(value, dtype=None):
    """A jax array of `value` (already checked to be array-like); tracers pass through."""
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    return jnp.asarray(value, dtype)


def prepare_arguments(params, inputs, cfg: CSAConfig, dtype: str, selection=None, teacher: bool = True,
                      codes=None):
    """Check the structure of the arguments (trace-safe: shapes and dtypes only) and hand
    back what the jitted programs take: (params widened to the wide dtype, the float inputs
    as given, the int inputs as int32, the selection as int32 or None). `teacher=False`:
    the forward, which needs no teacher inputs (they are then left out). `codes` (imposed
    codes and scales, `check_codes`) travel with the int inputs, which nothing differentiates."""
    if not isinstance(cfg, CSAConfig):
        raise TypeError(f"cfg must be a jax_impl.CSAConfig, got {type(cfg).__name__}")
    _, wide = resolve_dtype(dtype)
    params = check_params(params, cfg)
    arrays = check_inputs(inputs, cfg, teacher)
    if selection is not None:
        b, s = arrays["position_ids"].shape
        selection = _as_jax(check_selection(selection, cfg, b, s), jnp.int32)
    wide_params = {k: _as_jax(params[k]).astype(wide) for k in PARAM_NAMES}
    float_inputs = {k: _as_jax(arrays[k]) for k in FLOAT_INPUTS if k in arrays}
    int_inputs = {k: _as_jax(arrays[k], jnp.int32) for k in INT_INPUTS}
    if codes is not None:
        b, s = arrays["position_ids"].shape
        int_inputs.update({k: _as_jax(v, jnp.uint8 if k.endswith("_codes") else jnp.float32)
                           for k, v in check_codes(codes, cfg, b, s).items()})
    return wide_params, float_inputs, int_inputs, selection


def indexer_forward(params, inputs, cfg: CSAConfig, dtype: str, codes=None):
    """Compressed keys [B,W,DI], masked scores [B,S,W] (wide) and top-k indices [B,S,k_eff];
    with `cfg.index_quant`, the codes and scales the scores consumed (`codes_dict`).

    Needs only the indexer's inputs (hidden_states, q_latent, position_ids, segment_ids).
    `codes` (with `cfg.index_quant`): the four arrays of `codes_dict`, e.g. another run's, to
    score instead of the indexer's own (SPEC section 10's common codes); every entry point
    takes them."""
    wide_params, float_inputs, int_inputs, _ = prepare_arguments(params, inputs, cfg, dtype, teacher=False,
                                                                 codes=codes)
    return _forward_jit(wide_params, {**float_inputs, **int_inputs}, cfg, dtype)


# indexer_forward_rows scores a block of rows against a prefix of the blocks: those whose tokens
# end by the block's last row (the only ones a row can see where positions grow with the index),
# rounded up to a multiple of W / PREFIX_BUCKETS blocks and of at least PREFIX_MIN_BLOCKS, so that
# the blocks of rows of one long sequence share at most PREFIX_BUCKETS programs and a short
# sequence (W <= PREFIX_MIN_BLOCKS) only the whole-width one. Over every row of a sequence this
# scores about (1 + 1/PREFIX_BUCKETS) / 2 of the [S, W] entries the whole width does, where the rows
# see more than the widest key window (config `key_window`); a block whose rows see less is scored
# in its window whatever its prefix. Each bucket is a program of its own, compiled on first use:
# about 2 s at W = 32768 on the 2-core machine, where a call took 0.35-0.55 s at any prefix of the
# long cases (their rows all fit a window), so a bucket holds at least 8192 blocks (4 programs at
# W = 32768); at W = 262144, whose first documents' rows see up to 131072 blocks, 16 buckets of
# 16384 (measured: 4 buckets made the million sample's first half 1.3x slower).
PREFIX_BUCKETS, PREFIX_MIN_BLOCKS = 16, 8192


def prefix_blocks(seq_len: int, end: int, cfg: CSAConfig) -> int:
    """The blocks `indexer_forward_rows` scores the rows before `end` against (W: every one)."""
    w, m = cfg.num_blocks(seq_len), cfg.compress_ratio
    grain = max(-(-w // PREFIX_BUCKETS), PREFIX_MIN_BLOCKS)
    need = -(-end // m)
    return min(w, -(-need // grain) * grain)


@functools.partial(jax.jit, static_argnames=("rows", "cfg", "dtype_name", "prefix"))
def _forward_rows_jit(params, inputs, start, rows, cfg, dtype_name, prefix):
    return query_blocks.forward_rows(params, inputs, start, rows, cfg, dtype_name, prefix)


def indexer_forward_rows(params, inputs, cfg: CSAConfig, dtype: str, start: int, rows: int):
    """(index_scores [B, n, W] (wide, -inf invalid), topk_indices [B, n, k_eff]) of the query rows
    start .. start + n - 1, n = min(rows, S - start): a block of `indexer_forward`'s rows, for a
    problem whose [B, S, W] scores are too large to hold. The rows are scored against the causal
    prefix of the blocks (`prefix_blocks`), their keys computed from the prefix's tokens on every
    call, after the program has checked that no later block is visible to them
    (query_blocks.forward_rows); otherwise against every block, the keys of the whole sequence. One program per (config, dtype,
    shapes, rows, prefix); `start` is traced. Unquantized problems."""
    if cfg.index_quant is not None:
        raise ValueError("indexer_forward_rows scores unquantized problems (index_quant=None)")
    wide_params, float_inputs, int_inputs, _ = prepare_arguments(params, inputs, cfg, dtype, teacher=False)
    seq_len = int(int_inputs["position_ids"].shape[1])
    if not (0 <= start < seq_len and rows >= 1):
        raise ValueError(f"start={start}, rows={rows}: need 0 <= start < S={seq_len} and rows >= 1")
    n = min(rows, seq_len - start)
    prefix = prefix_blocks(seq_len, start + n, cfg)
    scores, topk = _forward_rows_jit(wide_params, {**float_inputs, **int_inputs}, jnp.int32(start), rows, cfg, dtype,
                                     prefix)
    return scores[:, :n], topk[:, :n]


def indexer_loss(params, inputs, cfg: CSAConfig, dtype: str, selection=None, codes=None):
    """The scalar KL loss (wide dtype); `selection` replaces the own top-k in sparse mode.

    Differentiable with respect to `params` from outside (`jax.grad(indexer_loss)`): the
    parameters are widened inside, so their gradients come back in the parameters' dtype."""
    args = prepare_arguments(params, inputs, cfg, dtype, selection, codes=codes)
    return _loss_jit(*args, cfg, dtype)


def indexer_loss_and_grads(params, inputs, cfg: CSAConfig, dtype: str, selection=None, codes=None):
    """(loss, gradients of the six parameters, gradients of the four float inputs), the
    parameter gradients in the wide dtype (differentiated with respect to the widened copy)."""
    args = prepare_arguments(params, inputs, cfg, dtype, selection, codes=codes)
    return _loss_and_grads_jit(*args, cfg, dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _bundle_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    """The forward once, the three loss heads, and ONE backward pass through the indexer
    batched over the three loss cotangents (chain rule: d loss / d params = J^T d loss / d scores,
    J the Jacobian of the masked scores). A third of the program of three jax.grad calls."""
    if cfg.query_chunk:  # the query-blocked path, one loss-and-grads per mode
        return query_blocks.parity_bundle(params, float_inputs, int_inputs, selection, cfg, dtype_name)
    dtype, wide = resolve_dtype(dtype_name)

    def scores_fn(params, float_inputs):
        keys, masked, valid, topk, codes = forward_parts(params, {**float_inputs, **int_inputs}, cfg, dtype_name)
        return masked, (keys, valid, topk, codes)

    masked, pullback, (keys, valid, topk, codes) = jax.vjp(scores_fn, params, float_inputs, has_aux=True)
    out = {"forward": {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk, **codes}}
    modes = {"dense": (False, None), "sparse": (True, None), "sparse_at_selection": (True, selection)}
    losses, score_cts, teacher_cts = {}, [], []
    teacher = {n: float_inputs[n] for n in teacher_input_names(cfg)}
    for mode, (sparse, sel) in modes.items():
        c = dataclasses.replace(cfg, sparse_loss=sparse)

        def head(scores, teacher, c=c, sel=sel):
            return kl_loss(scores, valid, topk, {**teacher, **int_inputs}, c, dtype, wide, sel)

        loss, cts = jax.value_and_grad(head, argnums=(0, 1))(masked, teacher)
        losses[mode] = loss
        score_cts.append(cts[0])
        teacher_cts.append(cts[1])
    param_grads, input_grads = jax.vmap(pullback)(jnp.stack(score_cts))
    for i, mode in enumerate(modes):
        pg = {k: v[i] for k, v in param_grads.items()}
        ig = {k: v[i] for k, v in input_grads.items()}
        for n, g in teacher_cts[i].items():
            ig[n] = ig[n] + g
        out[mode] = (losses[mode], pg, ig)
    return out


def indexer_parity_bundle(params, inputs, cfg: CSAConfig, dtype: str, selection, codes=None):
    """Everything the parity matrix asks of one (config, dtype), in ONE compiled program:
    {"forward": indexer_forward's dict, "dense" | "sparse" | "sparse_at_selection":
    (loss, param_grads, input_grads)}, the last with `selection` imposed. `cfg.sparse_loss`
    is ignored (all modes are computed). An optional extension of the protocol
    (docs/plugins.md): it exists to compile once instead of four times per matrix point.
    `codes`: imposed codes and scales, as in `indexer_forward`."""
    args = prepare_arguments(params, inputs, cfg, dtype, selection, codes=codes)
    return _bundle_jit(*args, cfg, dtype)


def compiled_memory(lowered) -> dict[str, int] | None:
    """XLA's memory analysis of a lowered program, compiled: {"temp", "argument", "output",
    "alias"} in bytes, or None where the backend gives none."""
    ma = lowered.compile().memory_analysis()
    if ma is None:
        return None
    return {"temp": int(ma.temp_size_in_bytes), "argument": int(ma.argument_size_in_bytes),
            "output": int(ma.output_size_in_bytes), "alias": int(ma.alias_size_in_bytes)}


def parity_bundle_memory(params, inputs, cfg: CSAConfig, dtype: str, selection, codes=None) -> dict[str, int] | None:
    """`compiled_memory` of the program `indexer_parity_bundle` runs with these arguments. Right
    after that call JAX's caches hold the program, so this compiles nothing (measured: 4 ms on
    `small`, where the call took 9 s); called first, it compiles the program."""
    args = prepare_arguments(params, inputs, cfg, dtype, selection, codes=codes)
    return compiled_memory(_bundle_jit.lower(*args, cfg, dtype))


STAGES = ("pooled", "keys", "queries", "head_weights", "scores", "teacher", "student")


def score_stage(q, keys, head_weights):
    """The scoring stage on its own: sum_h w[b,s,h] * relu(q[b,s,h] . K[b,j]) * DI**-0.5,
    [B, S, W]; q [B, S, HI, DI], keys [B, W, DI], head_weights [B, S, HI], all wide."""
    return head_contribution(q, keys, head_weights) * (q.shape[-1] ** -0.5)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _stages_jit(params, inputs, selection, cfg, dtype_name):
    dtype, wide = resolve_dtype(dtype_name)
    p = {k: round_to(v, dtype) for k, v in params.items()}
    x = round_to(inputs["hidden_states"], dtype)
    q_latent = round_to(inputs["q_latent"], dtype)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    keys, pooled = compress_parts(x, pos, p["indexer.wkv"], p["indexer.wgate"], p["indexer.ape"],
                                  p["indexer.kv_norm"], cfg, wide)
    hw = head_weights(x, p["indexer.weights_proj"], cfg.index_n_heads, wide)
    q = queries(q_latent, p["indexer.wq_b"], pos, cfg.index_n_heads, cfg, wide)
    # The scoring stage's inputs: with index_quant the quantized values (wide), else q and K.
    (q_in, _), (k_in, _) = scoring_queries(q, cfg, wide), scoring_keys(keys, cfg, wide)
    if cfg.scoring_backend == "pallas":  # the stage as the backend computes it
        scores = kernels.contribution(q_in, k_in, hw) * (cfg.index_head_dim**-0.5)
    else:
        scores = score_stage(widen(q_in, wide), widen(k_in, wide), hw)
    valid = block_validity(pos, seg, cfg, x.shape[1])
    masked = mask_scores(scores, valid)
    topk = topk_indices(masked, valid, cfg.index_topk)
    keep, valid_tok = loss_keep(valid, topk, cfg.sparse_loss, selection)
    native = dataclasses.replace(cfg, loss_head_chunk=0, query_chunk=0)
    t = teacher_distribution(teacher_inputs(inputs, cfg, dtype, wide), keep, valid_tok, native,
                             jnp.arange(x.shape[1]), seg, dtype=dtype)
    log_p = student_log_probs(masked, keep, valid_tok, cfg.sparse_loss)
    return {"pooled": pooled, "keys": keys, "queries": q, "head_weights": hw, "scores": scores,
            "teacher": t, "student": log_p}


def forward_stages(params, inputs, cfg: CSAConfig, dtype: str, selection=None):
    """The forward intermediates, in data-flow order (STAGES), from the native path (no
    chunking): the pooled vectors before the norm, the compressed keys, the queries after
    RoPE, the head weights, the raw (unmasked) scores, the teacher distribution and the
    student log-probabilities (of `cfg.sparse_loss`, `selection` imposing the sparse picks).
    The harness's first-diverging-stage diagnosis compares them with torch_ref's."""
    args = prepare_arguments(params, inputs, cfg, dtype, selection)
    wide_params, float_inputs, int_inputs, sel = args
    return _stages_jit(wide_params, {**float_inputs, **int_inputs}, sel, cfg, dtype)

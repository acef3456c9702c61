"""Public entry points (docs/API.md): indexer_forward, indexer_loss, indexer_loss_and_grads.

Each validates its arguments on the host first (a clear ValueError, never a
trace from inside XLA), then calls a function jitted with the config and the
dtype name static, compiled once per (config, dtype, shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .config import CSAConfig, resolve_dtype
from .loss import kl_loss
from .pooling import compress_keys
from .precision import round_to
from .scoring import block_validity, head_weights, mask_scores, raw_scores, topk_indices
from .validate import FLOAT_INPUTS, INT_INPUTS, PARAM_NAMES, validate_inputs, validate_params


def _forward_core(params, inputs, cfg: CSAConfig, dtype_name: str):
    """Keys, masked scores, validity and top-k from wide params (SPEC sections 5-7)."""
    dtype, wide = resolve_dtype(dtype_name)
    p = {k: round_to(v, dtype) for k, v in params.items()}
    # The indexer never trains the hidden states or the query latent.
    x = round_to(jax.lax.stop_gradient(inputs["hidden_states"]), dtype)
    q_latent = round_to(jax.lax.stop_gradient(inputs["q_latent"]), dtype)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    keys = compress_keys(
        x, pos, p["indexer.wkv"], p["indexer.wgate"], p["indexer.ape"], p["indexer.kv_norm"], cfg, wide
    )
    hw = head_weights(x, p["indexer.weights_proj"], cfg.index_n_heads, wide)
    scores = raw_scores(q_latent, pos, p["indexer.wq_b"], hw, keys, cfg, wide)
    valid = block_validity(pos, seg, cfg, x.shape[1])
    masked = mask_scores(scores, valid)
    return keys, masked, valid, topk_indices(masked, valid, cfg.index_topk)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _forward_jit(params, inputs, cfg, dtype_name):
    keys, masked, _, topk = _forward_core(params, inputs, cfg, dtype_name)
    return {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk}


def _loss_core(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    dtype, wide = resolve_dtype(dtype_name)
    inputs = {**float_inputs, **int_inputs}
    _, masked, valid, topk = _forward_core(params, inputs, cfg, dtype_name)
    return kl_loss(
        masked, valid, topk, inputs["teacher_query"], inputs["teacher_kv"], cfg, dtype, wide, selection
    )


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _loss_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    return _loss_core(params, float_inputs, int_inputs, selection, cfg, dtype_name)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype_name"))
def _loss_and_grads_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name):
    grad_fn = jax.value_and_grad(_loss_core, argnums=(0, 1))
    loss, (param_grads, input_grads) = grad_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name)
    return loss, param_grads, input_grads


def _prepare(params, inputs, cfg, dtype, selection=None):
    """Validate on the host, then hand jit device arrays: params widened, inputs as stored."""
    if not isinstance(cfg, CSAConfig):
        raise TypeError(f"cfg must be a jax_impl.CSAConfig, got {type(cfg).__name__}")
    _, wide = resolve_dtype(dtype)
    validate_params(params, cfg)
    validate_inputs(inputs, cfg)
    wide_params = {k: jnp.asarray(np.asarray(params[k]), wide) for k in PARAM_NAMES}
    float_inputs = {k: jnp.asarray(inputs[k]) for k in FLOAT_INPUTS}
    int_inputs = {k: jnp.asarray(inputs[k], jnp.int32) for k in INT_INPUTS}
    if selection is not None:
        selection = _check_selection(selection, inputs, cfg)
    return wide_params, float_inputs, int_inputs, selection


def _check_selection(selection, inputs, cfg):
    b, s = np.shape(inputs["position_ids"])
    expected = (b, s, min(cfg.index_topk, cfg.num_blocks(s)))
    sel = np.asarray(selection)
    if sel.shape != expected or not np.issubdtype(sel.dtype, np.integer):
        raise ValueError(
            f"selection has shape {sel.shape} and dtype {sel.dtype}; expected integer [B, S, k_eff] = {list(expected)}"
        )
    return jnp.asarray(sel, jnp.int32)


def indexer_forward(params, inputs, cfg: CSAConfig, dtype: str):
    """Compressed keys [B,W,DI], masked scores [B,S,W] (wide) and top-k indices [B,S,k_eff]."""
    wide_params, float_inputs, int_inputs, _ = _prepare(params, inputs, cfg, dtype)
    return _forward_jit(wide_params, {**float_inputs, **int_inputs}, cfg, dtype)


def indexer_loss(params, inputs, cfg: CSAConfig, dtype: str, selection=None):
    """The scalar KL loss (wide dtype); `selection` replaces the own top-k in sparse mode."""
    args = _prepare(params, inputs, cfg, dtype, selection)
    return _loss_jit(*args, cfg, dtype)


def indexer_loss_and_grads(params, inputs, cfg: CSAConfig, dtype: str, selection=None):
    """(loss, gradients of the six parameters, gradients of the four float inputs)."""
    args = _prepare(params, inputs, cfg, dtype, selection)
    return _loss_and_grads_jit(*args, cfg, dtype)

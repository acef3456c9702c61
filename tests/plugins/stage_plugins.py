"""Plug-ins for tests/test_stages.py: a forward-only one, scoring kernels with
planted bugs, and one that raises on one case."""

from __future__ import annotations

import types

import jax.numpy as jnp

import jax_impl


def forward_only():
    return types.SimpleNamespace(CSAConfig=jax_impl.CSAConfig, indexer_forward=jax_impl.indexer_forward)


def _forward_raising_on_small(params, inputs, cfg, dtype):
    if cfg.index_n_heads == 8:  # the `small` case
        raise ValueError("shape mismatch in my kernel\nsecond line")
    return jax_impl.indexer_forward(params, inputs, cfg, dtype)


def raising():
    return types.SimpleNamespace(CSAConfig=jax_impl.CSAConfig, indexer_forward=_forward_raising_on_small)


def _drop_head(q, keys, w):
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.einsum("bsh,bshw->bsw", jnp.asarray(w).at[..., 0].set(0.0), jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5


def _relu_after_sum(q, keys, w):
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.maximum(jnp.einsum("bsh,bshw->bsw", w, logits), 0.0) * q.shape[-1] ** -0.5


def drop_head():
    return types.SimpleNamespace(STAGE="scores", scores=_drop_head)


def relu_after_sum():
    return types.SimpleNamespace(STAGE="scores", scores=_relu_after_sum)

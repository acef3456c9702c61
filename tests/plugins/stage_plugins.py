"""Plug-ins for tests/test_stages.py: a forward-only one, scoring kernels with
planted bugs, a correct kernel that indexes its inputs with `.at[...]`, one that takes numpy
arrays, and one that raises on one case."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

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
    return jnp.einsum("bsh,bshw->bsw", w.at[..., 0].set(0.0), jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5


def _relu_after_sum(q, keys, w):
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.maximum(jnp.einsum("bsh,bshw->bsw", w, logits), 0.0) * q.shape[-1] ** -0.5


def drop_head():
    return types.SimpleNamespace(STAGE="scores", scores=_drop_head)


def relu_after_sum():
    return types.SimpleNamespace(STAGE="scores", scores=_relu_after_sum)


def _padded_tiles(q, keys, w):
    """Correct scores, computed on the key blocks padded with zeros to a multiple of 8 (a tile),
    the padding gathered with `keys.at[...].get(mode="fill")` as a tiled kernel's wrapper does,
    then cut off. Outside a trace it also checks that it was handed JAX arrays on JAX's default
    device."""
    blocks = keys.shape[1]
    padded = keys.at[:, jnp.arange(-(-blocks // 8) * 8)].get(mode="fill", fill_value=0.0)
    logits = jnp.einsum("bshd,bwd->bshw", q, padded)
    if not isinstance(q, jax.core.Tracer):
        for name, x in (("q", q), ("keys", keys), ("head_weights", w)):
            if not isinstance(x, jax.Array) or x.devices() != {jax.devices()[0]}:
                raise TypeError(f"{name} is {type(x).__name__}, not a JAX array on {jax.devices()[0]}")
    return (jnp.einsum("bsh,bshw->bsw", w, jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5)[..., :blocks]


def padded_tiles():
    return types.SimpleNamespace(STAGE="scores", scores=_padded_tiles)


def _numpy_scores(q, keys, w):
    if not all(type(x) is np.ndarray for x in (q, keys, w)):
        raise TypeError(f"handed {type(q).__name__}, not numpy arrays")
    logits = np.einsum("bshd,bwd->bshw", q, keys)
    return np.einsum("bsh,bshw->bsw", w, np.maximum(logits, 0.0)) * q.shape[-1] ** -0.5


def numpy_scores():
    """A kernel written in numpy, which says so (`ARRAYS = "numpy"`): no gradient is taken."""
    return types.SimpleNamespace(STAGE="scores", ARRAYS="numpy", scores=_numpy_scores)


def bad_arrays():
    return types.SimpleNamespace(STAGE="scores", ARRAYS="torch", scores=_numpy_scores)

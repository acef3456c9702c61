"""A plug-in for tests/test_rerun.py: jax_impl's forward with the scores scaled by 1.01 at
indexer chunk 2 only, so exactly one point of a chunk sweep fails and the others pass."""

from __future__ import annotations

import types

import jax_impl


def _forward(params, inputs, cfg, dtype):
    out = dict(jax_impl.indexer_forward(params, inputs, cfg, dtype))
    if cfg.indexer_head_chunk == 2:
        out["index_scores"] = out["index_scores"] * 1.01
    return out


def make_impl():
    return types.SimpleNamespace(CSAConfig=jax_impl.CSAConfig, indexer_forward=_forward)

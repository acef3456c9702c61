"""A plug-in implementation for the CLI tests: jax_impl with the loss (and so its
gradients) scaled by 1.01, the kind of slip a refactor makes. The matrix must fail it."""

from __future__ import annotations

import jax_impl


class _Scaled:
    CSAConfig = jax_impl.CSAConfig
    indexer_forward = staticmethod(jax_impl.indexer_forward)

    @staticmethod
    def indexer_loss_and_grads(params, inputs, cfg, dtype, selection=None):
        loss, pg, ig = jax_impl.indexer_loss_and_grads(params, inputs, cfg, dtype, selection)
        return loss * 1.01, {k: v * 1.01 for k, v in pg.items()}, ig


def make_impl():
    return _Scaled()

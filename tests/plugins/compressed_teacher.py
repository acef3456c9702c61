"""Plug-ins that compute the compressed teacher (each teacher head renormalised over the
compressed blocks alone, as MaxText 0.2.5 does) whatever the config asks: jax_impl with
`teacher_normaliser="compressed"` forced. `declared` says so (`TEACHERS = ("compressed",)`),
`undeclared` does not, and so passes the compressed teacher off as the joint one."""

from __future__ import annotations

import dataclasses

import jax_impl


class _Compressed:
    CSAConfig = jax_impl.CSAConfig

    def __init__(self, declare: bool):
        if declare:
            self.TEACHERS = ("compressed",)

    @staticmethod
    def _cfg(cfg):
        return dataclasses.replace(cfg, teacher_normaliser="compressed")

    def indexer_forward(self, params, inputs, cfg, dtype):
        return jax_impl.indexer_forward(params, inputs, cfg, dtype)

    def indexer_loss_and_grads(self, params, inputs, cfg, dtype, selection=None):
        return jax_impl.indexer_loss_and_grads(params, inputs, self._cfg(cfg), dtype, selection)

    def forward_stages(self, params, inputs, cfg, dtype, selection=None):
        return jax_impl.forward_stages(params, inputs, self._cfg(cfg), dtype, selection)


def declared():
    return _Compressed(True)


def undeclared():
    return _Compressed(False)

"""A thin Flax NNX module: holds the six indexer parameters, calls the pure functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .api import indexer_forward, indexer_loss, indexer_loss_and_grads
from .config import CSAConfig
from .validate import PARAM_NAMES, param_shapes

_ATTR = {name: name.split(".", 1)[1] for name in PARAM_NAMES}


class CSAIndexer(nnx.Module):
    """The lightning indexer's parameters under the canonical names (SPEC section 3), float32."""

    def __init__(self, cfg: CSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        for name, (_, shape) in param_shapes(cfg).items():
            if name == "indexer.kv_norm":
                value = jnp.ones(shape, jnp.float32)
            elif name == "indexer.ape":
                value = jnp.zeros(shape, jnp.float32)
            else:  # fan-in scaled normal
                value = jax.random.normal(rngs.params(), shape, jnp.float32) * shape[0] ** -0.5
            setattr(self, _ATTR[name], nnx.Param(value))

    @classmethod
    def from_params(cls, cfg: CSAConfig, params: dict) -> "CSAIndexer":
        module = cls(cfg, rngs=nnx.Rngs(0))
        for name in PARAM_NAMES:
            getattr(module, _ATTR[name]).value = jnp.asarray(params[name], jnp.float32)
        return module

    def params(self) -> dict:
        """The parameters as a plain dict keyed by canonical name."""
        return {name: getattr(self, _ATTR[name]).value for name in PARAM_NAMES}

    def __call__(self, inputs: dict, dtype: str = "float32") -> dict:
        return indexer_forward(self.params(), inputs, self.cfg, dtype)

    def loss(self, inputs: dict, dtype: str = "float32", selection=None):
        return indexer_loss(self.params(), inputs, self.cfg, dtype, selection)

    def loss_and_grads(self, inputs: dict, dtype: str = "float32", selection=None):
        return indexer_loss_and_grads(self.params(), inputs, self.cfg, dtype, selection)

"""A thin Flax NNX layer: holds the six indexer parameters, calls the pure functions.

`CSAIndexer(cfg, dtype=..., rngs=...)` keeps its parameters as `nnx.Param`s (float32,
SPEC section 3, the canonical `[in, out]` layout), so `nnx.Optimizer(model, tx,
wrt=nnx.Param)` trains them; the compute dtype is the layer's `dtype` and the chunk
sizes come from `cfg` (`indexer_head_chunk`, `loss_head_chunk`). Every method is
traceable (it only calls jax_impl's traceable entry points): `nnx.jit`, `nnx.grad`,
`nnx.value_and_grad`, and `nnx.vmap` over a leading batch of problems with the layer
broadcast (`in_axes=(None, 0)`). Values are checked by `validate`, on the host, before
the loop (the entry points check shapes and dtypes only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .api import indexer_forward, indexer_loss, indexer_loss_and_grads
from .config import CSAConfig, resolve_dtype
from .validate import PARAM_NAMES, param_shapes, validate_inputs

_ATTR = {name: name.split(".", 1)[1] for name in PARAM_NAMES}


class CSAIndexer(nnx.Module):
    """The lightning indexer's parameters under the canonical names (SPEC section 3), float32."""

    def __init__(self, cfg: CSAConfig, *, dtype: str = "float32", rngs: nnx.Rngs):
        if not isinstance(cfg, CSAConfig):
            raise TypeError(f"cfg must be a jax_impl.CSAConfig, got {type(cfg).__name__}")
        resolve_dtype(dtype)  # a clear error for an unsupported name, now rather than at first call
        self.cfg = cfg
        self.dtype = dtype
        for name, (_, shape) in param_shapes(cfg).items():
            if name == "indexer.kv_norm":
                value = jnp.ones(shape, jnp.float32)
            elif name == "indexer.ape":
                value = jnp.zeros(shape, jnp.float32)
            else:  # fan-in scaled normal
                value = jax.random.normal(rngs.params(), shape, jnp.float32) * shape[0] ** -0.5
            setattr(self, _ATTR[name], nnx.Param(value))

    @classmethod
    def from_params(cls, cfg: CSAConfig, params: dict, *, dtype: str = "float32") -> "CSAIndexer":
        """A layer holding `params` (a dict keyed by canonical name), as float32."""
        module = cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        for name in PARAM_NAMES:
            getattr(module, _ATTR[name])[...] = jnp.asarray(params[name], jnp.float32)
        return module

    def params(self) -> dict:
        """The parameters as a plain dict keyed by canonical name (the pure functions' form)."""
        return {name: getattr(self, _ATTR[name])[...] for name in PARAM_NAMES}

    @staticmethod
    def canonical(tree) -> dict:
        """A tree shaped like the layer's parameters (e.g. `nnx.grad`'s result) as a plain dict
        keyed by canonical name."""
        pure = nnx.to_pure_dict(tree)
        return {name: pure[_ATTR[name]] for name in PARAM_NAMES}

    def validate(self, inputs: dict, selection=None, *, teacher: bool = True) -> None:
        """Every check of `inputs` (and the layer's parameters), values included: host side,
        concrete arrays only (see jax_impl.validate_inputs). Call it before a training loop."""
        validate_inputs(self.params(), inputs, self.cfg, selection, teacher=teacher)

    def __call__(self, inputs: dict) -> dict:
        """indexer_forward: {"compressed_keys", "index_scores", "topk_indices"}."""
        return indexer_forward(self.params(), inputs, self.cfg, self.dtype)

    def loss(self, inputs: dict, selection=None):
        """indexer_loss: the scalar KL loss against the teacher in `inputs` (dense or sparse by
        cfg.sparse_loss; `selection` replaces the own top-k in sparse mode)."""
        return indexer_loss(self.params(), inputs, self.cfg, self.dtype, selection)

    def loss_and_grads(self, inputs: dict, selection=None):
        """indexer_loss_and_grads: (loss, parameter gradients by canonical name, input gradients)."""
        return indexer_loss_and_grads(self.params(), inputs, self.cfg, self.dtype, selection)

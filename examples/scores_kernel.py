"""A complete stage plug-in (docs/plugins.md): the lightning indexer's scoring kernel.

    csa-parity run --impl examples.scores_kernel --cases tiny

The harness hands `scores` the live torch reference's own stage inputs at each dtype: q after
RoPE [B, S, HI, DI], the compressed keys [B, W, DI] and the head weights [B, S, HI] (wide-dtype
arrays). It returns the unmasked scores [B, S, W] in the wide dtype; the gradient is taken
with jax.vjp. Everything else is reported not provided.
"""

import jax.numpy as jnp

STAGE = "scores"


def scores(q, keys, head_weights):
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.einsum("bsh,bshw->bsw", head_weights, jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5

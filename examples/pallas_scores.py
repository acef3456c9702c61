"""The Pallas scoring kernels of jax_impl.kernels as a stage plug-in (docs/API.md): what a
kernel author runs first.

    csa-parity run --impl examples.pallas_scores --cases tiny,small --dtypes float32,bfloat16

The harness hands `scores` the live torch reference's own stage inputs at each dtype (q after
RoPE [B, S, HI, DI], the compressed keys [B, W, DI], the head weights [B, S, HI]; wide arrays)
and judges the unmasked scores [B, S, W] and their gradients (jax.vjp: here the kernels'
custom VJP, i.e. the dq/dw and dK kernels) against the float64 reference's stage. Off TPU the
kernels run in Pallas interpret mode.
"""

import jax

from jax_impl.kernels import contribution

STAGE = "scores"


@jax.jit  # one compiled program for the forward, one for its VJP (the harness calls both)
def scores(q, keys, head_weights):
    return contribution(q, keys, head_weights) * q.shape[-1] ** -0.5

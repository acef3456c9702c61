"""Rounding to the compute dtype, exactly where SPEC section 2 rounds.

XLA may keep values in higher precision than their dtype inside a fusion
(`--xla_allow_excess_precision`, on by default): a bfloat16 value converted to
float32 and back can skip its rounding. Which roundings survive then depends on
fusion decisions, so the native and the head-chunked programs, or two XLA
versions, round differently (measured: up to 0.76% of a bfloat16 score row
between native and chunk 1). `round_to` first
rounds the mantissa with `lax.reduce_precision`, an explicit op that XLA keeps,
then casts: even if XLA later drops the cast pair, the value already carries
only the dtype's mantissa bits, so every cast rounds exactly once whatever the
fusion.

The reduce_precision keeps float32's 8 exponent bits and rounds only the
mantissa; the cast itself then applies the dtype's range (float16 subnormals and
overflow). With float16's own 5 exponent bits XLA would flush float16 subnormals
to zero, and JAX applies the same op to the cotangent: float16 gradients,
whose cotangents are often subnormal in float16, came out 10-50x less accurate
than torch's. (`lax.optimization_barrier` does not help: XLA:CPU's bfloat16
normalisation widens through it.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_LOW = (jnp.dtype("bfloat16"), jnp.dtype("float16"))


def round_to(x, dtype):
    """x cast to `dtype`, rounded even if XLA would otherwise keep excess precision."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype in _LOW and jnp.finfo(x.dtype).nmant > jnp.finfo(dtype).nmant:
        x = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=jnp.finfo(dtype).nmant)
    return x.astype(dtype)


def widen(x, wide):
    """x (compute dtype) in the wide dtype, exactly, for a contraction in the wide dtype.

    A float16 value's widening is followed by a `lax.reduce_precision` to float16's
    mantissa (a no-op on the value), so that the contraction's operand is not a plain
    convert: XLA:TPU folds a convert from float16 into the dot that consumes it and then
    multiplies float16 operands, at precision "highest", to about 2^-16 relative (1.9e-5
    measured on a v5e) instead of exactly as the float32 product of the widened values. Whether it folds depends on
    the program: a convert outside a scan body reaches the dot inside it as a loop
    parameter and is not folded, so the chunked and the native program computed the same
    float16 scores and teacher logits differently (measured on a TPU v5e: 7.7e-6 of the
    tiny case's scores and 1.3e-5 of its loss at query chunk 5). With the op in between,
    both programs contract float32 operands. bfloat16 needs none: its products are exact
    on the MXU whether the convert is folded or not."""
    wide = jnp.dtype(wide)
    if x.dtype == wide:
        return x
    y = x.astype(wide)
    if x.dtype == jnp.dtype("float16"):
        y = jax.lax.reduce_precision(y, exponent_bits=8, mantissa_bits=jnp.finfo(x.dtype).nmant)
    return y


def project(a, w, wide, exact_weight_grad: bool = False):
    """a @ w in the compute dtype of `a`: products summed in the wide dtype (float32 for
    bfloat16/float16, as torch's CPU kernels and the TPU MXU do), rounded once to the dtype.

    `exact_weight_grad`, where `a` is already wide: w's gradient is contracted at
    `Precision.HIGHEST` whatever the default matmul precision, so the cotangent enters it with
    all of its float32 bits. For a product whose cotangent is a float32 sum over the chunks
    (the compressor's: the keys' cotangent sums every head and query block), whose last bits
    depend on the chunking: at JAX's default precision XLA:TPU can round a float32 dot's
    operands to bfloat16 (one pass), and a last-bit difference of the cotangent then moves
    w's gradient by a bfloat16 rounding (measured on a TPU v5e at default, the small case's wkv
    gradient between head chunk 1 and native: 4.15e-6 with the plain product, against CHUNK's
    4e-6; 1.04e-7 with this one). Off a TPU, and at "highest", the product is the same; the
    forward product and a's gradient keep the default precision.

    `w` is in the compute dtype, or wide: then it is rounded to the compute dtype here (the
    same product) and its gradient comes back wide and unrounded, the float32 sum of the
    products that the compute-dtype form would round to bfloat16/float16 at once. That is
    for a parameter that several blocks use (jax_impl.query_blocks): each block's gradient
    stays wide, the blocks' are summed wide, and `round_grad_to` rounds the sum once, as
    the one contraction over all rows is rounded once."""
    if w.dtype != a.dtype:
        return _project_wide_weight(a, w, jnp.dtype(wide))
    if exact_weight_grad and a.dtype == jnp.dtype(wide):
        return _project_exact_weight_grad(a, w)
    return round_to(jnp.matmul(a, w, preferred_element_type=wide), a.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project_wide_weight(a, w, wide):
    return _project_wide_weight_fwd(a, w, wide)[0]


def _project_wide_weight_fwd(a, w, wide):
    w_low = round_to(w, a.dtype)
    return round_to(jnp.matmul(a, w_low, preferred_element_type=wide), a.dtype), (a, w_low)


def _project_wide_weight_bwd(wide, res, g):
    # What autodiff of the compute-dtype form computes, except that dw is not cast to the
    # compute dtype: JAX's own transposes (which also sum over the mesh axes a shard_map
    # replicates w along) of the same product with both operands widened exactly (`widen`),
    # so dw contracts the widened cotangent with the widened `a`, as the compute-dtype form's
    # mixed-dtype transpose does.
    a, w_low = res
    _, pullback = jax.vjp(lambda a, w: jnp.matmul(widen(a, wide), w, preferred_element_type=wide), a,
                          widen(w_low, wide))
    return pullback(g.astype(wide))


_project_wide_weight.defvjp(_project_wide_weight_fwd, _project_wide_weight_bwd)


@jax.custom_vjp
def _project_exact_weight_grad(a, w):
    return _project_exact_weight_grad_fwd(a, w)[0]


def _project_exact_weight_grad_fwd(a, w):
    return jnp.matmul(a, w), (a, w)


def _project_exact_weight_grad_bwd(res, g):
    # JAX's own transposes (which sum over the mesh axes a shard_map replicates w along); only
    # w's carries the explicit precision.
    a, w = res
    _, pull_a = jax.vjp(lambda a: jnp.matmul(a, w), a)
    _, pull_w = jax.vjp(lambda w: jnp.matmul(a, w, precision=jax.lax.Precision.HIGHEST), w)
    return pull_a(g)[0], pull_w(g)[0]


_project_exact_weight_grad.defvjp(_project_exact_weight_grad_fwd, _project_exact_weight_grad_bwd)


def round_grad_to(x, dtype):
    """x itself, whose cotangent is rounded to `dtype` (`round_to`) and widened back: the one
    rounding that a cast of the wide x to `dtype` gives its gradient, for an x whose uses
    (`project` with a wide weight) return wide, unrounded gradients."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    return _round_grad_to(x, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _round_grad_to(x, dtype):
    return x


def _round_grad_to_fwd(x, dtype):
    return x, None


def _round_grad_to_bwd(dtype, _, g):
    return (round_to(g, dtype).astype(g.dtype),)


_round_grad_to.defvjp(_round_grad_to_fwd, _round_grad_to_bwd)

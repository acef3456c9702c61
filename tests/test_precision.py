"""jax_impl.precision's rounding points beyond `round_to` (SPEC section 2): `project` with a wide
weight, `round_grad_to`, `widen`, and `project`'s exact_weight_grad. Cheap: small arrays, a few
compiled programs (~2 s).

- `project(a, w)` with a wide `w` computes what it computes with `round_to(w, a.dtype)`, bit for
  bit, and hands w's gradient back wide and unrounded; `round_grad_to` then rounds it once, to
  what autodiff of the compute-dtype form gives. That is how the query-blocked path sums the
  blocks' parameter gradients in float32 and rounds the sum once (tests/test_query_chunk.py).
- `project(a, w, exact_weight_grad=True)` with a wide `a` contracts w's gradient at HIGHEST and
  nothing else: a TPU at default precision may round a float32 dot's operands to bfloat16, and
  the compressor's weight gradients must keep the keys' cotangent, a sum over the chunks, whole.
- `widen` is exact and, for float16, puts a reduce-precision between the convert and the
  contraction (in the compiled program, not only in the jaxpr); on a TPU that keeps a float16
  contraction exact at precision "highest" (measured on a v5e: 1.9e-5 relative with the plain
  convert, which XLA:TPU folds into the dot, 6.0e-8 with `widen`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl.precision import project, round_grad_to, round_to, widen

LOW = ("bfloat16", "float16")


def _problem(dtype):
    rng = np.random.default_rng(3)
    a = round_to(jnp.asarray(rng.standard_normal((2, 24, 16)), jnp.float32), dtype)
    w = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    ct = round_to(jnp.asarray(rng.standard_normal((2, 24, 12)), jnp.float32), dtype)
    return a, w, ct


@pytest.mark.parametrize("dtype", LOW)
def test_project_wide_weight_forward_is_the_rounded_weights(dtype):
    a, w, _ = _problem(dtype)
    got = jax.jit(lambda a, w: project(a, w, jnp.float32))(a, w)
    want = jax.jit(lambda a, w: project(a, round_to(w, a.dtype), jnp.float32))(a, w)
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", LOW)
def test_project_wide_weight_gradient_is_wide_and_rounds_to_the_compute_dtype_form(dtype):
    a, w, ct = _problem(dtype)

    def grad_of(fn):
        return np.asarray(jax.jit(jax.grad(lambda w: jnp.sum((fn(w).astype(jnp.float32)) * ct.astype(jnp.float32))))(w))

    wide = grad_of(lambda w: project(a, w, jnp.float32))
    low = grad_of(lambda w: project(a, round_to(w, a.dtype), jnp.float32))
    once = grad_of(lambda w: project(a, round_grad_to(w, a.dtype), jnp.float32))
    exact = np.einsum("bsk,bsn->kn", np.asarray(a, np.float64), np.asarray(ct, np.float64))
    # Wide: the float32 contraction itself (products of compute-dtype values are exact in float32),
    # not rounded to the compute dtype (it carries bits the compute dtype has not).
    assert np.max(np.abs(wide - exact)) <= 1e-6 * np.max(np.abs(exact))
    assert np.any(np.asarray(round_to(jnp.asarray(wide), dtype), np.float32) != wide)
    # Rounded once, it is what autodiff of the compute-dtype form gives, bit for bit.
    np.testing.assert_array_equal(np.asarray(round_to(jnp.asarray(wide), dtype), np.float32), low)
    np.testing.assert_array_equal(once, low)


@pytest.mark.parametrize("dtype", LOW)
def test_round_grad_to_is_the_identity_forward_and_rounds_the_cotangent_once(dtype):
    x = jnp.linspace(-3.0, 3.0, 50, dtype=jnp.float32)
    g = jnp.asarray(np.random.default_rng(4).standard_normal(50), jnp.float32)
    y, pullback = jax.vjp(lambda x: round_grad_to(x, dtype), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    (got,) = pullback(g)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(g.astype(dtype).astype(jnp.float32)))
    assert round_grad_to(x, "float32") is x


def test_widen_is_exact_and_float16_keeps_a_rounding_op_before_the_contraction():
    rng = np.random.default_rng(5)
    for dtype, kept in (("float16", True), ("bfloat16", False)):
        a = jnp.asarray(rng.standard_normal((8, 4)), dtype)
        np.testing.assert_array_equal(np.asarray(widen(a, jnp.float32)), np.asarray(a, np.float32))
        text = jax.jit(lambda a, b: widen(a, jnp.float32) @ widen(b, jnp.float32)).lower(a, a.T).compile().as_text()
        assert ("reduce-precision" in text) == kept, (dtype, text[-800:])
    x = jnp.ones(3, jnp.float32)
    assert widen(x, jnp.float32) is x


@pytest.mark.skipif(jax.default_backend() != "tpu",
                    reason="needs a TPU: XLA:CPU contracts float16 operands exactly whether or not the convert is "
                           "folded into the dot")
def test_widened_float16_contraction_is_exact_on_tpu_at_highest():
    """On XLA:TPU a float16 convert folded into its dot multiplies at about 2^-16 (measured on a v5e:
    1.9e-5 relative on this product); `widen` keeps the float32 product of the widened values."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 8)), jnp.float16)
    b = jnp.asarray(rng.standard_normal((8, 32)), jnp.float16)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(lambda a, b: widen(a, jnp.float32) @ widen(b, jnp.float32))(a, b), np.float64)
    assert np.max(np.abs(got - exact)) <= 2.0**-22 * np.max(np.abs(exact))


def _dot_precisions(fn, *args) -> list[tuple[str, str]]:
    """(precision, result type) of every dot_general in fn's lowered program."""
    text = jax.jit(fn).lower(*args).as_text()
    return re.findall(r"stablehlo\.dot_general .*precision = \[(\w+), \1\] : .* -> (tensor<[^>]*>)", text)


def test_project_exact_weight_grad_contracts_the_weight_gradient_at_highest_and_nothing_else():
    """The forward product and a's gradient at the default precision, w's gradient (the [12, 16]
    product) at HIGHEST; the same numbers wherever the precision does not narrow float32 (here)."""
    a, w, ct = _problem("float32")

    def step(exact):
        return jax.value_and_grad(lambda a, w: jnp.sum(project(a, w, jnp.float32, exact_weight_grad=exact) * ct),
                                  argnums=(0, 1))

    with jax.default_matmul_precision("default"):
        assert sorted(_dot_precisions(step(True), a, w)) == [
            ("DEFAULT", "tensor<2x24x12xf32>"), ("DEFAULT", "tensor<2x24x16xf32>"), ("HIGHEST", "tensor<12x16xf32>")]
        assert {p for p, _ in _dot_precisions(step(False), a, w)} == {"DEFAULT"}
        got, plain = jax.jit(step(True))(a, w), jax.jit(step(False))(a, w)
    if jax.default_backend() == "cpu":  # XLA:CPU multiplies float32 operands whole at every precision
        for g, p in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(p))
    # A compute dtype narrower than the wide one keeps its own rounding: the flag needs a wide `a`.
    a16, w16 = round_to(a, "bfloat16"), round_to(w, "bfloat16")
    with jax.default_matmul_precision("default"):
        low = _dot_precisions(jax.grad(lambda w: jnp.sum(
            project(a16, w, jnp.float32, exact_weight_grad=True).astype(jnp.float32))), w16)
    assert low and {p for p, _ in low} == {"DEFAULT"}, low

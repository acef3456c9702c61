"""jax_impl used the way JAX code is used. The public functions under jax.jit,
jax.grad, jax.vmap (a leading batch of problems) and shard_map, and the NNX layer under
nnx.jit / nnx.grad / nnx.value_and_grad / nnx.vmap with an optax nnx.Optimizer; each result
against the concrete call.

Equality: a traced call runs the same math as the concrete one, but an outer
transformation hands XLA another program (jit(grad(loss)) is not loss_and_grads' program,
vmap batches every GEMM), and XLA may fuse and block its float32 sums differently. So
every float comparison allows float32 summation order, RTOL = 1e-6 of the largest
magnitude of the tensor (the chunk-vs-native bound of harness/judging/tolerance.py is of the same
kind, 1e-5 forward / 4e-6 gradients); measured worst over this file: 2.9e-7 (vmap). Top-k indices
and the -inf pattern are compared exactly, input gradients are exactly zero.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_impl
from problems import SMALL, random_problem

CFG = jax_impl.CSAConfig(**SMALL, indexer_head_chunk=2, loss_head_chunk=4)
RTOL = 1e-6  # float32 summation order of another program (see the docstring); measured <= 2.9e-7


@pytest.fixture(scope="module")
def problem():
    return random_problem(SMALL, 2, 32, seed=3)


def _loss(p, x):
    return jax_impl.indexer_loss(p, x, CFG, "float32")


def _finite(a):
    a = np.asarray(a)
    return np.where(np.isfinite(a), a, 0.0)


def close(got, want, what=""):
    """Equal up to float32 summation order: |got - want| <= RTOL * max|want|, same -inf pattern."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    scale = float(np.max(np.abs(_finite(want)))) if want.size else 0.0
    np.testing.assert_allclose(_finite(got), _finite(want), rtol=0, atol=RTOL * scale, err_msg=what)


def test_snippet_jit_of_grad_of_indexer_loss(problem):
    params, inputs = problem
    grads = jax.jit(jax.grad(lambda p, x: jax_impl.indexer_loss(p, x, CFG, "float32")))(params, inputs)
    loss, concrete, _ = jax_impl.indexer_loss_and_grads(params, inputs, CFG, "float32")
    close(_loss(params, inputs), loss)
    for name in jax_impl.PARAM_NAMES:
        assert grads[name].dtype == jnp.float32
        close(grads[name], concrete[name], name)


def test_snippet_nnx_grad_of_the_layer_loss(problem):
    params, inputs = problem
    grads = nnx.grad(lambda m: m.loss(inputs))(jax_impl.CSAIndexer.from_params(CFG, params))
    _, concrete, _ = jax_impl.indexer_loss_and_grads(params, inputs, CFG, "float32")
    for name in jax_impl.PARAM_NAMES:
        close(jax_impl.CSAIndexer.canonical(grads)[name], concrete[name], name)


def test_snippet_nnx_jit_of_the_layer_forward(problem):
    params, inputs = problem
    module = jax_impl.CSAIndexer.from_params(CFG, params)
    scores = nnx.jit(lambda m: m(inputs)["index_scores"])(module)
    concrete = jax_impl.indexer_forward(params, inputs, CFG, "float32")["index_scores"]
    close(scores, concrete)


def test_vmap_over_two_stacked_problems(problem):
    """A leading axis of problems: jax.vmap of forward, loss and loss-and-grads, each slice
    equal to the concrete call on that problem."""
    p0, x0 = problem
    p1, x1 = random_problem(SMALL, 2, 32, seed=4)
    stack = lambda a, b: jax.tree.map(lambda u, v: np.stack([u, v]), a, b)  # noqa: E731
    params, inputs = stack(p0, p1), stack(x0, x1)
    fwd = jax.vmap(lambda p, x: jax_impl.indexer_forward(p, x, CFG, "float32"))(params, inputs)
    losses = jax.vmap(_loss)(params, inputs)
    vl, vg, vi = jax.vmap(lambda p, x: jax_impl.indexer_loss_and_grads(p, x, CFG, "float32"))(params, inputs)
    for i, (p, x) in enumerate([(p0, x0), (p1, x1)]):
        want = jax_impl.indexer_forward(p, x, CFG, "float32")
        np.testing.assert_array_equal(np.asarray(fwd["topk_indices"][i]), np.asarray(want["topk_indices"]))
        for key in ("compressed_keys", "index_scores"):
            close(fwd[key][i], want[key], key)
        loss, grads, input_grads = jax_impl.indexer_loss_and_grads(p, x, CFG, "float32")
        close(losses[i], loss)
        close(vl[i], loss)
        for name in jax_impl.PARAM_NAMES:
            close(vg[name][i], grads[name], name)
        for name, g in input_grads.items():
            assert not np.any(np.asarray(vi[name][i])) and not np.any(np.asarray(g)), name


def _shard_map():
    fn = getattr(jax, "shard_map", None)
    if fn is None:  # older JAX
        from jax.experimental.shard_map import shard_map as fn
    return fn


def test_shard_map_over_the_batch(problem):
    """The public loss inside shard_map over a `data` axis (as many devices as divide B=2;
    one in the plain test process): each device's loss of its rows, averaged over devices
    by the caller, equals the concrete loss when the devices' token counts are equal."""
    params, inputs = problem
    n = 2 if jax.device_count() >= 2 else 1
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
    P = jax.sharding.PartitionSpec

    def local(p, x):
        return jax.lax.pmean(jax_impl.indexer_loss(p, x, CFG, "float32"), "data")

    specs = {k: P() if k == "attention_sink" else P("data") for k in inputs}  # the sink is per head: replicated
    sharded = _shard_map()(local, mesh=mesh, in_specs=(P(), specs), out_specs=P())
    got = jax.jit(sharded)(params, inputs)
    close(got, _loss(params, inputs))
    grads = jax.jit(jax.grad(sharded))(params, inputs)
    _, want, _ = jax_impl.indexer_loss_and_grads(params, inputs, CFG, "float32")
    for name in jax_impl.PARAM_NAMES:
        close(grads[name], want[name], name)


# --------------------------------------------------------------------------- the NNX layer


def test_layer_params_are_what_an_optax_optimizer_trains(problem):
    params, inputs = problem
    model = jax_impl.CSAIndexer(CFG, dtype="float32", rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    shapes = sorted(tuple(a.shape) for a in jax.tree.leaves(state))
    assert shapes == sorted(shape for _, shape in jax_impl.validate.param_shapes(CFG).values())
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, model.params())

    @nnx.jit
    def step(model, optimizer, inputs):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(inputs))(model)
        optimizer.update(model, grads)
        return loss, grads

    loss, grads = step(model, optimizer, inputs)
    close(loss, jax_impl.indexer_loss(before, inputs, CFG, "float32"))
    for name in jax_impl.PARAM_NAMES:  # one SGD step: p - 0.1 g, for every parameter
        g = np.asarray(jax_impl.CSAIndexer.canonical(grads)[name])
        assert np.any(g), name
        np.testing.assert_allclose(np.asarray(model.params()[name]), before[name] - 0.1 * g, rtol=0, atol=1e-7)


def test_the_quantized_layer_trains_under_jit_and_vmap(problem):
    """DeepSeek-V4's FP4 indexer (SPEC section 7a) in miniature: nnx.jit of a training step
    lowers the loss through the straight-through gradient (every parameter gets one), and the
    forward vmaps over problems to the scores (up to summation order) and codes of one problem alone."""
    params, inputs = problem
    cfg = dataclasses.replace(CFG, index_quant={"format": "e2m1", "block": 8, "hadamard": True})
    model = jax_impl.CSAIndexer(cfg, dtype="bfloat16", rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, inputs):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(inputs))(model)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(3):
        loss, grads = step(model, optimizer, inputs)
        losses.append(float(loss))
        for name in jax_impl.PARAM_NAMES:
            assert np.any(np.asarray(jax_impl.CSAIndexer.canonical(grads)[name])), name
    assert losses[-1] < losses[0], losses
    one = jax_impl.indexer_forward(params, inputs, cfg, "float32")
    many = jax.vmap(lambda x: jax_impl.indexer_forward(params, x, cfg, "float32"))(
        jax.tree.map(lambda a: np.stack([a, a]), inputs))
    for i in range(2):  # another program: the scores up to float32 summation order, the same codes
        close(many["index_scores"][i], one["index_scores"], "index_scores")
        for name in ("query_codes", "key_codes", "query_scales", "key_scales"):
            np.testing.assert_array_equal(np.asarray(many[name][i]), np.asarray(one[name]), err_msg=name)


def test_layer_dtype_and_chunks_come_from_its_settings(problem):
    params, inputs = problem
    for dtype in ("float32", "bfloat16"):
        module = jax_impl.CSAIndexer.from_params(CFG, params, dtype=dtype)
        got = nnx.jit(lambda m: m.loss(inputs))(module)
        close(got, jax_impl.indexer_loss(params, inputs, CFG, dtype), dtype)
        keys = nnx.jit(lambda m: m(inputs)["compressed_keys"])(module)
        assert keys.dtype == jnp.dtype(dtype)
    native = jax_impl.CSAIndexer.from_params(dataclasses.replace(CFG, indexer_head_chunk=0), params)
    jaxpr = jax.make_jaxpr(lambda p: jax_impl.indexer_loss(p, inputs, CFG, "float32"))(params)
    assert "scan" in str(jaxpr)  # the chunked config walks the heads
    assert "scan" not in str(jax.make_jaxpr(lambda m: m(inputs))(native))


def test_layer_under_nnx_vmap_over_problems(problem):
    """nnx.vmap with the layer broadcast (in_axes None) over a leading axis of problems."""
    params, inputs = problem
    _, x1 = random_problem(SMALL, 2, 32, seed=5)
    stacked = jax.tree.map(lambda u, v: np.stack([u, v]), inputs, x1)
    module = jax_impl.CSAIndexer.from_params(CFG, params)
    losses = nnx.vmap(lambda m, x: m.loss(x), in_axes=(None, 0))(module, stacked)
    for i, x in enumerate((inputs, x1)):
        close(losses[i], _loss(params, x))


def test_layer_validate_checks_values_on_the_host(problem):
    params, inputs = problem
    module = jax_impl.CSAIndexer.from_params(CFG, params)
    module.validate(inputs)
    bad = dict(inputs, teacher_kv=inputs["teacher_kv"].copy())
    bad["teacher_kv"][1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"^inputs\['teacher_kv'\] contains NaN/Inf at index \(1, 2, 3\)$"):
        module.validate(bad)
    no_sink = dict(inputs, attention_sink=np.full_like(inputs["attention_sink"], -np.inf))
    module.validate(no_sink)  # -inf: a head without a sink
    no_sink["attention_sink"][5] = np.inf
    with pytest.raises(ValueError, match=r"^inputs\['attention_sink'\] contains NaN or \+Inf at index \(5,\)"):
        module.validate(no_sink)
    with pytest.raises(ValueError, match=r"^dtype='int8' is not supported"):
        jax_impl.CSAIndexer(CFG, dtype="int8", rngs=nnx.Rngs(0))


def _python_block(path: str, heading: str) -> str:
    """The first ```python block under `heading` (up to the next heading of its level)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / path).read_text()
    level = heading.split(" ", 1)[0]
    section = text[text.index(heading + "\n"):]
    rest = section.find(f"\n{level} ", len(heading))
    section = section[:rest] if rest > 0 else section
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("path,heading", [("README.md", "## Use the layer in your model"),
                                          ("docs/layer.md", "## The pure functions and the NNX layer")])
def test_the_docs_snippets_run_as_written(path, heading):
    """The layer snippets of README.md and docs/layer.md, executed as they stand."""
    code = _python_block(path, heading)
    namespace = {"__name__": "snippet"}
    exec(compile(code, f"{path}: {heading}", "exec"), namespace)
    assert namespace["scores"].shape[-3:] == (2, 32, 8)

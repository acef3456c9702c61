"""The sharded slice (issue 7): `jax_impl.sharded` on a (data x model) mesh of simulated CPU
devices against single-device `jax_impl` (tight) and against the float64 oracle goldens of
the fixtures (the matrix rule), forward and gradients, plus the mesh-split errors.

Runs in its own process (see conftest.py): `python -m pytest tests/sharded -n 0`.

Bounds. float64: 1e-12 (harness.tolerance.EXACT64) against single-device and the oracle.
float32 against single-device: harness.tolerance.chunk_bound, the chunked-vs-native table,
because a mesh changes exactly what head chunking changes and nothing more: a projection of
a slice of the columns (wq_b / weights_proj by head) or of the rows (the batch) may take
another GEMM blocking and differ in the last bit, and every head sum (scores and teacher) is
added in another order (per-device partial sums, then a psum over `model`); sum(kl) and the
token count are added per device, then psum-ed over `data`. Nothing else moves. Measured
worst, sharded vs single-device, over this file's points (small and packed; meshes 2x4, 1x8,
2x2; chunks 0/1/2; dense, sparse on the own and on the oracle's top-k):
    float32: keys 1.4e-7 (1 ulp), scores 7.7e-7, loss 1.8e-7, grads 6.3e-7
    float64: keys 0, scores 4.4e-16, loss 4.9e-16, grads 1.3e-15
The float32 CHUNK bounds (fwd 1e-5, loss 2e-6, grad 4e-6) sit 6-13x above these: tight (a
psum that dropped or doubled a device's share moves a result by O(1/M)), with room for another
CPU's GEMM blocking. Against the oracle the sharded run is judged exactly as the parity matrix
judges single-device JAX (harness.checks): float32 err <= ALPHA[kind] * max(err(torch float32
golden), floor(dtype, quantity)) (measured worst ratio 0.75, scores of small on the 1x8
mesh), float64 err <= EXACT64 (worst 1.9e-15). The sparse loss is judged on the oracle's
top-k (golden sparse_at_oracle, the matrix's oracle@sel) and, in float64, also end to end on
its own picks. Top-k picks are compared as sets, boundary ties excused.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_impl
from harness.checks import score_tolerance
from harness.compare import compare_close, exactly_zero, oracle_relative, to_numpy, topk_sets
from harness.fixtures import load_case
from harness.tolerance import ALPHA, EXACT64, chunk_bound, floor, kind_of
from jax_impl import sharded

pytestmark = pytest.mark.sharded

PARAMS = jax_impl.PARAM_NAMES
FWD = ("compressed_keys", "index_scores")

# The matrix slice, as data: (case, dtype, mesh (data, model), chunk, modes). `chunk` is both
# indexer_head_chunk and loss_head_chunk, in LOCAL heads (small/packed: HI = H = 8).
MAIN = [
    (case, dtype, (2, 4), chunk, ("dense", "sparse"))
    for case in ("small", "packed")
    for dtype in ("float64", "float32")
    for chunk in (0, 1, 2)
]
EXTRA = [
    ("small", "float32", (1, 8), 1, ("sparse",)),  # one head per device, batch unsplit
    ("packed", "float64", (2, 2), 2, ("dense",)),  # 4 local heads in 2 chunks of 2
]
POINTS = MAIN + EXTRA


def _id(case, dtype, mesh, chunk):
    return f"{case}-{dtype}-mesh{mesh[0]}x{mesh[1]}-chunk{chunk}"


FWD_POINTS = [pytest.param(c, d, m, k, id=_id(c, d, m, k)) for c, d, m, k, _ in POINTS]
LOSS_POINTS = [
    pytest.param(c, d, m, k, mode, id=f"{_id(c, d, m, k)}-{mode}")
    for c, d, m, k, modes in POINTS
    for mode in modes
]


# --------------------------------------------------------------------------- set-up (cached)


@functools.lru_cache(maxsize=None)
def _fixture(case):
    return load_case(case)


@functools.lru_cache(maxsize=None)
def _mesh(shape, axes=("data", "model")):
    n = shape[0] * shape[1]
    if jax.device_count() < n:
        pytest.skip(f"mesh {shape[0]}x{shape[1]} needs {n} devices, JAX has {jax.device_count()}")
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), axes)


def _cfg(case, chunk, mode="dense"):
    cfg = jax_impl.CSAConfig.from_dict(_fixture(case).config)
    return dataclasses.replace(cfg, indexer_head_chunk=chunk, loss_head_chunk=chunk, sparse_loss=mode == "sparse")


def _host(bundle):
    """A parity bundle on the host: forward dict and (loss, param_grads, input_grads) per mode."""
    out = {"forward": {k: to_numpy(v) for k, v in bundle["forward"].items()}}
    for mode in ("dense", "sparse", "sparse_at_selection"):
        loss, pg, ig = bundle[mode]
        out[mode] = (to_numpy(loss), {k: to_numpy(v) for k, v in pg.items()},
                     {k: to_numpy(v) for k, v in ig.items()})
    return out


# One compiled program per (config, dtype, chunk[, mesh]) for everything a point checks:
# forward, dense, sparse on the own top-k, and sparse on the oracle's top-k. small and packed
# share a config and shapes, so they share the programs too.
@functools.lru_cache(maxsize=None)
def _single(case, dtype, chunk):
    fx = _fixture(case)
    sel = fx.goldens["float64"]["topk_indices"]
    return _host(jax_impl.indexer_parity_bundle(fx.params, fx.inputs, _cfg(case, chunk), dtype, sel))


@functools.lru_cache(maxsize=None)
def _sharded(case, dtype, mesh_shape, chunk):
    fx, mesh = _fixture(case), _mesh(mesh_shape)
    sel = fx.goldens["float64"]["topk_indices"]
    bundle = sharded.sharded_parity_bundle(fx.params, fx.inputs, _cfg(case, chunk), dtype, mesh, sel)
    # Outputs are laid out by batch over `data`, gradients like their parameters.
    assert bundle["forward"]["index_scores"].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)
    assert bundle["dense"][1]["indexer.wq_b"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    return _host(bundle)


def _oracle_check(quantity, cand, case, dtype, torch_quantity=None, scale="tensor"):
    """The matrix rule against the float64 golden `quantity`; `torch_quantity` names the torch
    golden at `dtype` that saw the same selection (default: `quantity`)."""
    g = _fixture(case).goldens
    oracle = g["float64"][quantity]
    if dtype == "float64":
        return compare_close("exact64", quantity, cand, oracle, EXACT64, scale)
    return oracle_relative(quantity, cand, oracle, g[dtype][torch_quantity or quantity],
                           ALPHA[kind_of(quantity)], floor(dtype, quantity), scale)


def _single_check(quantity, cand, ref, dtype, scale="tensor"):
    return compare_close("sharded", quantity, cand, ref, chunk_bound(dtype, quantity), scale)


def _assert_all(results, context):
    bad = [r.with_context(context).message for r in results if not r.passed]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("case,dtype,mesh_shape,chunk", FWD_POINTS)
def test_forward_matches_single_device_and_oracle(case, dtype, mesh_shape, chunk):
    out = _sharded(case, dtype, mesh_shape, chunk)["forward"]
    single = _single(case, dtype, chunk)["forward"]
    goldens = _fixture(case).goldens
    results = []
    for q in FWD:
        scale = "row" if q == "index_scores" else "tensor"
        results.append(_single_check(q, out[q], single[q], dtype, scale).with_context("vs single-device"))
        results.append(_oracle_check(q, out[q], case, dtype, scale=scale).with_context("vs oracle"))
    # Top-k as sets; a differing pick is excused only within the score bound of the k-th
    # score (against the oracle: the matrix's own tolerance, harness.checks.score_tolerance).
    oracle = goldens["float64"]
    row_max = np.max(np.where(np.isfinite(single["index_scores"]), np.abs(single["index_scores"]), 0.0), axis=-1)
    results.append(topk_sets("topk_indices", out["topk_indices"], single["topk_indices"], single["index_scores"],
                             chunk_bound(dtype, "index_scores") * row_max).with_context("vs single-device"))
    results.append(topk_sets("topk_indices", out["topk_indices"], oracle["topk_indices"], oracle["index_scores"],
                             score_tolerance(goldens, dtype)).with_context("vs oracle"))
    _assert_all(results, f"{_id(case, dtype, mesh_shape, chunk)} forward")


def _loss_results(run, single, case, dtype, mode, oracle_mode, torch_mode, label):
    """Loss and the six gradients of `run` vs single-device `single` (tight) and, when
    `oracle_mode` is given, vs the float64 golden of that mode (matrix rule)."""
    loss, pg, ig = run
    s_loss, s_pg, _ = single
    pairs = [(f"loss.{mode}", loss, s_loss, "loss")] + [
        (f"grad.{mode}.{p}", pg[p], s_pg[p], f"grad.{{}}.{p}") for p in PARAMS
    ]
    out = []
    for q, cand, ref, golden in pairs:
        out.append(_single_check(q, cand, ref, dtype).with_context(f"{label} vs single-device"))
        if oracle_mode:
            g = f"loss.{oracle_mode}" if golden == "loss" else golden.format(oracle_mode)
            t = f"loss.{torch_mode}" if golden == "loss" else golden.format(torch_mode)
            out.append(_oracle_check(g, cand, case, dtype, t).with_context(f"{label} vs oracle"))
    out.append(exactly_zero(f"inputgrad.{mode}", ig).with_context(label))
    return out


@pytest.mark.parametrize("case,dtype,mesh_shape,chunk,mode", LOSS_POINTS)
def test_loss_and_grads_match_single_device_and_oracle(case, dtype, mesh_shape, chunk, mode):
    run = _sharded(case, dtype, mesh_shape, chunk)
    single = _single(case, dtype, chunk)
    if mode == "dense":
        results = _loss_results(run["dense"], single["dense"], case, dtype, "dense", "dense", "dense", "dense")
    else:
        # Own top-k: vs single-device always; vs the oracle end to end in float64 (its picks are
        # the oracle's). On the oracle's top-k: the matrix's oracle@sel check, torch@t on the same
        # picks (golden sparse_at_oracle) as the baseline.
        own_oracle = "sparse" if dtype == "float64" else None
        results = _loss_results(run["sparse"], single["sparse"], case, dtype, "sparse", own_oracle, "sparse",
                                "sparse own top-k")
        torch_at = "sparse" if dtype == "float64" else "sparse_at_oracle"
        results += _loss_results(run["sparse_at_selection"], single["sparse_at_selection"], case, dtype,
                                 "sparse", "sparse", torch_at, "sparse at the oracle's top-k")
    _assert_all(results, f"{_id(case, dtype, mesh_shape, chunk)} {mode}")


def test_entry_points_match_the_bundle_with_any_axis_names():
    """sharded_forward / sharded_loss / sharded_loss_and_grads give the bundle's values, on a
    mesh whose axes are called 'batch' and 'heads'."""
    fx, chunk, dtype = _fixture("small"), 2, "float32"
    mesh = _mesh((2, 4), ("batch", "heads"))
    axes = {"data_axis": "batch", "model_axis": "heads"}
    ref = _sharded("small", dtype, (2, 4), chunk)
    fwd = sharded.sharded_forward(fx.params, fx.inputs, _cfg("small", chunk), dtype, mesh, **axes)
    loss = sharded.sharded_loss(fx.params, fx.inputs, _cfg("small", chunk, "sparse"), dtype, mesh, **axes)
    dense = sharded.sharded_loss_and_grads(fx.params, fx.inputs, _cfg("small", chunk), dtype, mesh, **axes)
    results = [_single_check(q, to_numpy(fwd[q]), ref["forward"][q], dtype) for q in FWD]
    results.append(_single_check("loss.sparse", to_numpy(loss), ref["sparse"][0], dtype))
    results.append(_single_check("loss.dense", to_numpy(dense[0]), ref["dense"][0], dtype))
    results += [_single_check(f"grad.dense.{p}", to_numpy(dense[1][p]), ref["dense"][1][p], dtype) for p in PARAMS]
    assert np.array_equal(to_numpy(fwd["topk_indices"]), ref["forward"]["topk_indices"])
    _assert_all(results, "entry points, mesh axes ('batch', 'heads')")


def _scan_lengths(jaxpr):
    """Lengths of every lax.scan in a jaxpr, nested ones (shard_map, checkpoint, ...) included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn.params["length"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(sub, "eqns"):
                    out.extend(_scan_lengths(sub))
    return out


def test_chunks_walk_the_local_heads():
    """On a 2x4 mesh with chunk 1, each device scans its 2 indexer heads and 2 teacher heads:
    every scan has 2 steps, not the 8 of a scan over the global heads."""
    fx, mesh = _fixture("small"), _mesh((2, 4))
    cfg = _cfg("small", 1, "sparse")
    args = sharded._prepare_sharded(fx.params, fx.inputs, cfg, "float32", mesh, "data", "model")
    traced = sharded._loss_jit.trace(*args, cfg, "float32", mesh, "data", "model")
    lengths = _scan_lengths(traced.jaxpr.jaxpr)
    assert lengths and set(lengths) == {2}, lengths


# --------------------------------------------------------------------------- errors


def _err(case, mesh_shape, axes=("data", "model"), **over):
    fx = _fixture(case)
    n = mesh_shape[0] * mesh_shape[1]
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), axes)
    cfg = dataclasses.replace(_cfg(case, 0), **over)
    return fx, cfg, mesh


BAD_SPLITS = {
    "indexer-chunk-not-local": (
        (2, 4), {"indexer_head_chunk": 4},
        "indexer_head_chunk=4 must divide the local index heads: index_n_heads=8 over mesh axis "
        "'model' of size 4 leaves 2 per device (valid: 0, 1, 2)"),
    "loss-chunk-not-local": (
        (1, 8), {"loss_head_chunk": 2},
        "loss_head_chunk=2 must divide the local teacher heads: num_query_heads=8 over mesh axis "
        "'model' of size 8 leaves 1 per device (valid: 0, 1)"),
    "heads-not-divisible": (
        (1, 3), {},
        "index_n_heads=8 must be divisible by the size 3 of mesh axis 'model' (heads are split "
        "over it; valid sizes: 1, 2, 4, 8)"),
    "batch-not-divisible": (
        (4, 2), {},
        "batch B=2 must be divisible by the size 4 of mesh axis 'data' (the batch is split over "
        "it; valid sizes: 1, 2)"),
}


@pytest.mark.parametrize("name", list(BAD_SPLITS))
@pytest.mark.parametrize("entry", ["forward", "loss_and_grads"])
def test_bad_split_is_a_clear_error(name, entry):
    mesh_shape, over, message = BAD_SPLITS[name]
    fx, cfg, mesh = _err("small", mesh_shape, **over)
    fn = sharded.sharded_forward if entry == "forward" else sharded.sharded_loss_and_grads
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fn(fx.params, fx.inputs, cfg, "float32", mesh)


def test_unknown_mesh_axis_is_a_clear_error():
    fx, cfg, mesh = _err("small", (2, 4), axes=("batch", "model"))
    message = "data_axis='data' is not an axis of the mesh (axes: 'batch', 'model')"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sharded.sharded_forward(fx.params, fx.inputs, cfg, "float32", mesh)


def test_inputs_are_validated_before_the_mesh():
    fx, cfg, mesh = _err("small", (2, 4))
    bad = dict(fx.inputs, q_latent=fx.inputs["q_latent"][:, :, :5])
    with pytest.raises(ValueError, match=re.escape("inputs['q_latent'] has shape (2, 64, 5)")):
        sharded.sharded_loss_and_grads(fx.params, bad, cfg, "float32", mesh)


# --------------------------------------------------------------------------- the public API inside shard_map


def test_public_loss_and_grads_run_inside_shard_map():
    """issue 12: jax_impl.indexer_loss_and_grads is traceable, so a user can put it inside their
    own shard_map: here over a `data` axis of 2 devices, each device's loss of its batch row,
    pmean-ed (small: every row has the same number of valid tokens, so the mean of the per-row
    losses is the loss). Against the single-device call, the float64 bound of this file."""
    fx = _fixture("small")
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    cfg = _cfg("small", 1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map

    def local(p, x):
        # The parameters are replicated (invariant over `data`): JAX transposes their implicit
        # broadcast into a psum, so these gradients are already the SUM over the devices of
        # each device's gradient, i.e. the gradient of the sum of the per-row losses.
        loss, grads, _ = jax_impl.indexer_loss_and_grads(p, x, cfg, "float64")
        return jax.lax.pmean(loss, "data"), grads

    fn = shard_map(local, mesh=mesh, in_specs=(P(), {k: P("data") for k in fx.inputs}), out_specs=(P(), P()))
    loss, grads = jax.jit(fn)(fx.params, fx.inputs)
    grads = {k: v / 2 for k, v in grads.items()}  # the gradient of the mean over the 2 devices
    want_loss, want_grads, _ = jax_impl.indexer_loss_and_grads(fx.params, fx.inputs, cfg, "float64")
    assert abs(float(loss) - float(want_loss)) <= EXACT64 * abs(float(want_loss))
    for name in PARAMS:
        err = float(np.max(np.abs(to_numpy(grads[name]) - to_numpy(want_grads[name]))))
        assert err <= EXACT64 * float(np.max(np.abs(to_numpy(want_grads[name])))), name

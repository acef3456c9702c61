"""The sharded slice: `jax_impl.sharded` on a (data, seq, model) mesh of simulated CPU
devices against single-device `jax_impl` (tight) and against the float64 oracle goldens of
the fixtures (the matrix rule), forward and gradients, plus the mesh-split errors.

Runs in its own process (see conftest.py): `python -m pytest tests/sharded -n 0`.

Bounds. float64: 1e-12 (harness.judging.tolerance.EXACT64) against single-device and the oracle.
float32 against single-device: harness.judging.tolerance.chunk_bound, the chunked-vs-native table,
because a mesh changes exactly what head chunking changes and nothing more: a projection of
a slice of the columns (wq_b / weights_proj by head) or of the rows (the batch, the sequence)
may take another GEMM blocking and differ in the last bit, and every head sum (scores and
teacher) is added in another order (per-device partial sums, then a psum over `model`);
sum(kl) and the token count are added per device, then psum-ed over `data` and `seq`; the
keys' cotangent is summed per device, then reduce-scattered over `seq`. Nothing else moves.
Measured worst ratio (error / bound) against single-device over the default sample (599
entries, AVX2 CPU; the run prints these figures at its end):
    float32 (CHUNK bound): keys 0.018, scores 0.19, loss 0.15, grads 0.25
    float64 (EXACT64):     keys 3.6e-4, scores 1.6e-3, loss 4.7e-4, grads 1.8e-3
The float32 CHUNK bounds (fwd 1e-5, loss 2e-6, grad 4e-6) sit 4-7x above the worst (keys 56x):
tight (a psum that dropped or doubled a device's share moves a result by O(1/M)), with room
for another CPU's GEMM blocking. Each entry goes the parity matrix's one way, collect -> judge
(harness.run.collect): the sharded run is an implementation's output at a point whose mesh is
data, its `native` reference the same chunks on one device (the judge's `chunk` checks, the
CHUNK bound above), and against the oracle goldens it is judged exactly as the matrix judges
single-device JAX: float32 err <= ALPHA[kind] * max(err(torch float32 golden), floor(dtype,
quantity)) (measured worst ratio 0.44, scores of small on 2x1x4), float64 err <= EXACT64
(worst ratio 0.0049, scores of window_wide on 1x2x1, whose window halo spans 2 devices); sparse
on the oracle's top-k (oracle@sel) and end to end on its own picks where they are the oracle's.
Top-k picks are compared as sets, boundary ties excused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_impl
from harness.judging.compare import compare_close, to_numpy
from harness.judging.tolerance import EXACT64, chunk_bound
from harness.points import Point as HPoint
from harness.problems.cases import CASES
from harness.problems.fixtures import load_case
from harness.problems.matrix import entries_at, seq_split_reason
from harness.run.collect import evaluate
from harness.run.report import column_of, failure_text
from jax_impl import sharded

pytestmark = pytest.mark.sharded

PARAMS = jax_impl.PARAM_NAMES
FWD = ("compressed_keys", "index_scores")

# The slice, as data: (case, dtype, mesh (data, seq, model), chunk, query chunk, modes). `chunk`
# is both indexer_head_chunk and loss_head_chunk, in LOCAL heads (small/packed: HI = H = 8); the
# query chunk walks a device's own rows. Each knob of small and packed meets each layout: heads
# alone over `model` (2x1x4), the three axes crossed (2x2x2), the sequence over 4 devices beside
# 2 head groups (1x4x2), in float64 (exact64) and float32 (the CHUNK bound).
#
# Sample (CSA_PARITY_SAMPLE, as tests/test_parity_matrix.py): `default` (the default) runs all of
# it; `ci` (`make test`) runs each layout of MAIN once (MAIN_CI), EXTRA but EXTRA_NOT_CI, the
# compressed teacher on packed, and SEQ_CASES on SEQ_CI only: a window halo of 2 hops, no valid
# token, and a not_applicable case (which compiles nothing): 189 entries (`make test`'s log
# prints this slice's time).
SAMPLE = os.environ.get("CSA_PARITY_SAMPLE", "default")
LAYOUTS = (((2, 1, 4), 0, 0), ((2, 2, 2), 1, 5), ((1, 4, 2), 2, 0))
# ci: each layout once, on one case in one dtype: heads alone on packed (float64, exact64), the
# three axes crossed on small (float32, the CHUNK bound with every knob), the sequence beside head
# groups on small (float64, exact64). packed in float64 on 2x2x2 runs with the compressed
# teacher (COMPRESSED). packed on 2x1x4 in float32 runs in the default sample only: the fixtures
# come from an Intel AVX512 machine, where torch's float32 score error (9.9e-7) is below the
# floor, so the oracle check's bound is the floor's 2.24e-6, and JAX's 2.28e-6 fails it at 1.02;
# its chunk check against one device passes. Not loosened; docs/matrix.md.
MAIN_CI = {("packed", "float64", (2, 1, 4)), ("small", "float32", (2, 2, 2)), ("small", "float64", (1, 4, 2))}
MAIN = [
    (case, dtype, mesh, chunk, qchunk, ("dense", "sparse"))
    for case in ("small", "packed")
    for dtype in ("float64", "float32")
    for mesh, chunk, qchunk in LAYOUTS
    if SAMPLE != "ci" or (case, dtype, mesh) in MAIN_CI
]
EXTRA = [
    ("small", "float32", (1, 1, 8), 1, 0, ("sparse",)),  # one head per device, batch unsplit
    ("small", "float64", (1, 8, 1), 0, 0, ("dense", "sparse")),  # the sequence alone over 8 devices: L = 8, 2 blocks each
    ("packed", "float64", (2, 1, 2), 2, 0, ("dense",)),  # 4 local heads in 2 chunks of 2
    ("packed_edges", "float64", (1, 4, 1), 0, 0, ("dense", "sparse")),  # documents start on and beside device edges
    ("packed_edges", "float32", (2, 2, 1), 1, 3, ("dense", "sparse")),
]
# ci leaves out three whose layout other points already meet: heads over all 8 devices (heads
# alone: MAIN's 2x1x4), 2 local head chunks (MAIN's 1x4x2), and packed_edges on 2x2x1 (data and
# seq crossed with a query chunk: MAIN's 2x2x2; packed_edges in float32: the two-process slice,
# tests/multihost, on 1x4x2).
EXTRA_NOT_CI = {("small", (1, 1, 8)), ("packed", (2, 1, 2)), ("packed_edges", (2, 2, 1))}
EXTRA = [p for p in EXTRA if SAMPLE != "ci" or (p[0], p[2]) not in EXTRA_NOT_CI]
# The sequence axis on every other case (float64, 2 devices along the sequence): each case runs
# there, or is not_applicable with the reason (ragged's S=30 and no_blocks' S=3 do not split
# into whole blocks) and is reported so, never dropped.
SEQ_CI = ("all_invalid", "ragged", "window_wide")
SEQ_CASES = [(case, "float64", (1, 2, 1), 0, 0, ("dense", "sparse"))
             for case in CASES if case not in ("small", "packed", "packed_edges")
             and (SAMPLE != "ci" or case in SEQ_CI)]
POINTS = MAIN + EXTRA + SEQ_CASES
# The compressed teacher (its goldens: small and packed), on the crossed mesh at chunk 1, one
# dtype per case.
COMPRESSED = [("small", "float32", (2, 2, 2), 1, 0, ("dense", "sparse")),
              ("packed", "float64", (2, 2, 2), 1, 5, ("dense", "sparse"))]
COMPRESSED = [p for p in COMPRESSED if SAMPLE != "ci" or p[0] == "packed"]


# One matrix entry per (point, mode, quantity), ids like the matrix's with the mesh in them:
# `small-float32-ichunk2-tchunk2-mesh1x4x2-sparse-grad.indexer.wq_b` (and `...-compressed-...`
# for the compressed teacher, whose points have no forward entries: they do not depend on it).
def _point(c, d, m, k, q, teacher="joint"):
    return HPoint(c, d, k, k, q, mesh=m, teacher=teacher)


ENTRIES = [
    entry
    for c, d, m, k, q, modes in POINTS
    for entry in entries_at(_point(c, d, m, k, q), modes=("forward", *modes))
] + [
    entry
    for c, d, m, k, q, modes in COMPRESSED
    for entry in entries_at(_point(c, d, m, k, q, "compressed"), modes=modes)
]


# --------------------------------------------------------------------------- set-up (cached)


@functools.lru_cache(maxsize=None)
def _fixture(case):
    return load_case(case)


@functools.lru_cache(maxsize=None)
def _mesh(shape, axes=("data", "seq", "model")):
    n = int(np.prod(shape))
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


# One compiled program per (config, dtype, chunk, mesh) for everything a point checks:
# forward, dense, sparse on the own top-k, and sparse on the oracle's top-k.
@functools.lru_cache(maxsize=None)
def _sharded(case, dtype, mesh_shape, chunk):
    fx, mesh = _fixture(case), _mesh(mesh_shape)
    sel = fx.goldens["float64"]["topk_indices"]
    bundle = sharded.sharded_parity_bundle(fx.params, fx.inputs, _cfg(case, chunk), dtype, mesh, sel)
    # Outputs are laid out by batch over `data` and by token rows (the keys: by block) over
    # `seq`, gradients like their parameters.
    for name in ("compressed_keys", "index_scores", "topk_indices"):
        assert bundle["forward"][name].sharding.is_equivalent_to(NamedSharding(mesh, P("data", "seq")), 3)
    assert bundle["dense"][1]["indexer.wq_b"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
    return _host(bundle)


def _single_check(quantity, cand, ref, dtype, scale="tensor"):
    return compare_close("sharded", quantity, cand, ref, chunk_bound(dtype, quantity), scale)


def _assert_all(results, context):
    bad = [r.with_context(context).message for r in results if not r.passed]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- parity


# The worst ratio (error / bound) the slice saw, per (check, dtype, column of the report): the
# figures docs/sharding.md quotes, printed at the end of the run (conftest.py's terminal
# summary), re-measured by `CSA_PARITY_SAMPLE=ci python -m pytest tests/sharded -n 0 -m sharded`.
WORST: dict[tuple[str, str, str], tuple[float, str]] = {}


def _record_worst(entry, results):
    for r in results:
        if r.passed and r.bound > 0:
            key = (r.check, entry.point.dtype, column_of(entry.quantity))
            if r.ratio >= WORST.get(key, (-1.0, ""))[0]:
                WORST[key] = (r.ratio, entry.id)


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.id) for e in ENTRIES])
def test_sharded_entry(entry):
    """The same path as the parity matrix: collect (jax_impl.sharded on the point's mesh, the
    fixture goldens, and jax_impl on one device at the same knobs as `native`), then judge:
    `chunk` checks are sharded vs single-device (CHUNK bound), oracle checks the matrix rule.
    A case whose sequence does not split into whole blocks over the mesh's `seq` is judged
    not_applicable, with the reason, on every check."""
    results = evaluate(entry, reference="goldens")
    why = seq_split_reason(entry.point.case, entry.point.mesh[1])
    if why:
        assert results and all(r.status == "not_applicable" and why in r.message for r in results), \
            [r.message for r in results]
        return
    # (The `@own` checks of a quantized case are not applicable with the goldens, saying so.)
    assert results and not any(r.status == "not_applicable" and not r.check.endswith("@own") for r in results), \
        [r.message for r in results]
    assert not any(r.failed for r in results), failure_text(entry, results, "goldens")
    _record_worst(entry, results)


def test_sharded_outputs_are_laid_out_on_the_mesh():
    """Outputs are laid out by batch over `data` and rows over `seq`, gradients like their parameters."""
    _sharded("small", "float32", (2, 2, 2), 2)


def test_entry_points_match_the_bundle_with_any_axis_names():
    """sharded_forward / sharded_loss / sharded_loss_and_grads give the bundle's values, on a
    mesh whose axes are called 'batch', 'tokens' and 'heads'."""
    fx, chunk, dtype = _fixture("small"), 2, "float32"
    mesh = _mesh((2, 2, 2), ("batch", "tokens", "heads"))
    axes = {"data_axis": "batch", "model_axis": "heads", "seq_axis": "tokens"}
    ref = _sharded("small", dtype, (2, 2, 2), chunk)
    fwd = sharded.sharded_forward(fx.params, fx.inputs, _cfg("small", chunk), dtype, mesh, **axes)
    loss = sharded.sharded_loss(fx.params, fx.inputs, _cfg("small", chunk, "sparse"), dtype, mesh, **axes)
    dense = sharded.sharded_loss_and_grads(fx.params, fx.inputs, _cfg("small", chunk), dtype, mesh, **axes)
    results = [_single_check(q, to_numpy(fwd[q]), ref["forward"][q], dtype) for q in FWD]
    results.append(_single_check("loss.sparse", to_numpy(loss), ref["sparse"][0], dtype))
    results.append(_single_check("loss.dense", to_numpy(dense[0]), ref["dense"][0], dtype))
    results += [_single_check(f"grad.dense.{p}", to_numpy(dense[1][p]), ref["dense"][1][p], dtype) for p in PARAMS]
    assert np.array_equal(to_numpy(fwd["topk_indices"]), ref["forward"]["topk_indices"])
    _assert_all(results, "entry points, mesh axes ('batch', 'tokens', 'heads')")


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


@pytest.mark.parametrize("mesh_shape", [(2, 1, 4), (1, 2, 4)])
@pytest.mark.parametrize("window", [0, 5])
def test_chunks_walk_the_local_heads(window, mesh_shape):
    """On a mesh with 4 head groups and chunk 1, each device scans its 2 indexer heads and 2
    teacher heads: every scan has 2 steps, not the 8 of a scan over the global heads, with or
    without the joint teacher's window (5 tokens here: small's own 8 would read like the 8
    global heads; the window is one banded contraction per head step, not a scan), with or
    without the sequence split (one query block holds a device's rows: no scan over them)."""
    fx, mesh = _fixture("small"), _mesh(mesh_shape)
    cfg = dataclasses.replace(_cfg("small", 1, "sparse"), sliding_window=window)
    args, lay = sharded._prepare_sharded(fx.params, fx.inputs, cfg, "float32", mesh, "data", "model", None)
    traced = sharded._loss_jit.trace(*args, cfg, "float32", mesh, lay)
    lengths = _scan_lengths(traced.jaxpr.jaxpr)
    assert lengths and set(lengths) == {2}, lengths


def test_query_chunks_walk_the_local_rows():
    """query_chunk = 5 on a sequence split over 2 devices walks each device's 32 rows: 7 blocks
    (the last one 3 rows short), not the 13 of the whole 64-token sequence."""
    fx, mesh = _fixture("small"), _mesh((1, 2, 4))
    cfg = dataclasses.replace(_cfg("small", 1, "sparse"), query_chunk=5)
    args, lay = sharded._prepare_sharded(fx.params, fx.inputs, cfg, "float32", mesh, "data", "model", None)
    lengths = _scan_lengths(sharded._loss_jit.trace(*args, cfg, "float32", mesh, lay).jaxpr.jaxpr)
    assert 7 in lengths and 13 not in lengths and set(lengths) <= {2, 7}, lengths


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_query_blocks_on_a_mesh(dtype):
    """Query blocks in a compute dtype below float32 on a 2x2x2 mesh: the blocked path hands its
    query parameters to their projections wide, with their own VJP (jax_impl.precision.project),
    and that VJP sums over the mesh axes the weights are replicated along as autodiff does, so
    the gradients come back like one device's, within the chunk bound. Measured (small, head
    chunks 1, query chunk 5, dense): bfloat16 worst 3.7e-3 (kv_norm), float16 5.5e-4 (wgate).
    The matrix has no such point (its sharded points are float32 and float64); ~10 s."""
    fx, mesh = _fixture("small"), _mesh((2, 2, 2))
    cfg = dataclasses.replace(_cfg("small", 1), query_chunk=5)
    loss, grads = sharded.sharded_loss_and_grads(fx.params, fx.inputs, cfg, dtype, mesh)[:2]
    ref_loss, ref_grads = jax_impl.indexer_loss_and_grads(fx.params, fx.inputs, cfg, dtype)[:2]
    results = [_single_check("loss", to_numpy(loss), to_numpy(ref_loss), dtype)]
    results += [_single_check(f"grad.{p}", to_numpy(grads[p]), to_numpy(ref_grads[p]), dtype) for p in PARAMS]
    _assert_all(results, f"{dtype} query blocks on a 2x2x2 mesh")


# --------------------------------------------------------------------------- errors


def _err(case, mesh_shape, axes=("data", "seq", "model"), **over):
    fx = _fixture(case)
    n = int(np.prod(mesh_shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), axes)
    cfg = dataclasses.replace(_cfg(case, 0), **over)
    return fx, cfg, mesh


BAD_SPLITS = {
    "indexer-chunk-not-local": (
        "small", (2, 1, 4), {"indexer_head_chunk": 4},
        "indexer_head_chunk=4 must divide the local index heads: index_n_heads=8 over mesh axis "
        "'model' of size 4 leaves 2 per device (valid: 0, 1, 2)"),
    "loss-chunk-not-local": (
        "small", (1, 1, 8), {"loss_head_chunk": 2},
        "loss_head_chunk=2 must divide the local teacher heads: num_query_heads=8 over mesh axis "
        "'model' of size 8 leaves 1 per device (valid: 0, 1)"),
    "heads-not-divisible": (
        "small", (1, 1, 3), {},
        "index_n_heads=8 must be divisible by the size 3 of mesh axis 'model' (heads are split "
        "over it; valid sizes: 1, 2, 4, 8)"),
    "batch-not-divisible": (
        "small", (4, 1, 2), {},
        "batch B=2 must be divisible by the size 4 of mesh axis 'data' (the batch is split over "
        "it; valid sizes: 1, 2)"),
    "sequence-not-divisible": (
        "small", (1, 3, 1), {},
        "sequence length S=64 must split into whole blocks of compress_ratio=4 over the size 3 of "
        "mesh axis 'seq' (S=64 is not divisible by it; valid sizes: 1, 2, 4, 8, 16)"),
    "device-length-not-whole-blocks": (
        "tiny", (1, 8, 1), {},
        "sequence length S=16 must split into whole blocks of compress_ratio=4 over the size 8 of "
        "mesh axis 'seq' (that leaves 2 tokens per device, not a multiple of compress_ratio=4; "
        "valid sizes: 1, 2, 4)"),
}


@pytest.mark.parametrize("name", list(BAD_SPLITS))
@pytest.mark.parametrize("entry", ["forward", "loss_and_grads"])
def test_bad_split_is_a_clear_error(name, entry):
    case, mesh_shape, over, message = BAD_SPLITS[name]
    fx, cfg, mesh = _err(case, mesh_shape, **over)
    fn = sharded.sharded_forward if entry == "forward" else sharded.sharded_loss_and_grads
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fn(fx.params, fx.inputs, cfg, "float32", mesh)


@pytest.mark.parametrize("axes, kwargs, message", [
    (("batch", "seq", "model"), {}, "data_axis='data' is not an axis of the mesh (axes: 'batch', 'seq', 'model')"),
    (("data", "seq", "model"), {"seq_axis": "tokens"},
     "seq_axis='tokens' is not an axis of the mesh (axes: 'data', 'seq', 'model')"),
])
def test_unknown_mesh_axis_is_a_clear_error(axes, kwargs, message):
    fx, cfg, mesh = _err("small", (2, 2, 2), axes=axes)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        sharded.sharded_forward(fx.params, fx.inputs, cfg, "float32", mesh, **kwargs)


def test_inputs_are_validated_before_the_mesh():
    fx, cfg, mesh = _err("small", (2, 2, 2))
    bad = dict(fx.inputs, q_latent=fx.inputs["q_latent"][:, :, :5])
    with pytest.raises(ValueError, match=re.escape("inputs['q_latent'] has shape (2, 64, 5)")):
        sharded.sharded_loss_and_grads(fx.params, bad, cfg, "float32", mesh)


# --------------------------------------------------------------------------- the public API inside shard_map


def test_public_loss_and_grads_run_inside_shard_map():
    """jax_impl.indexer_loss_and_grads is traceable, so a user can put it inside their
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

    specs = {k: P() if k == "attention_sink" else P("data") for k in fx.inputs}  # the sink is per head: replicated
    fn = shard_map(local, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()))
    loss, grads = jax.jit(fn)(fx.params, fx.inputs)
    grads = {k: v / 2 for k, v in grads.items()}  # the gradient of the mean over the 2 devices
    want_loss, want_grads, _ = jax_impl.indexer_loss_and_grads(fx.params, fx.inputs, cfg, "float64")
    assert abs(float(loss) - float(want_loss)) <= EXACT64 * abs(float(want_loss))
    for name in PARAMS:
        err = float(np.max(np.abs(to_numpy(grads[name]) - to_numpy(want_grads[name]))))
        assert err <= EXACT64 * float(np.max(np.abs(to_numpy(want_grads[name])))), name

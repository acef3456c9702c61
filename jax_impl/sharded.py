"""The indexer and its loss on a device mesh: batch over a `data` axis, heads over a `model` axis.

Same outputs as `indexer_forward` / `indexer_loss_and_grads` (docs/plugins.md), computed with
`jax.shard_map` so that every device runs the single-device pure functions on its own block:

  data axis   `hidden_states`, `q_latent`, ids, teacher inputs and `selection` are split by
              batch row; keys, validity and top-k are per row, so they need no communication.
  model axis  indexer heads (the `wq_b` and `weights_proj` columns of a head) and teacher heads
              (`teacher_query[:, :, h]`) are split into contiguous blocks of HI/M and H/M heads.
              The pooling parameters and the keys are replicated over it.

Per device, `scoring.raw_scores` runs unchanged with a config whose `index_n_heads` is the
LOCAL head count, so `indexer_head_chunk` chunks walk the device's own heads (the same
`lax.scan` under `jax.checkpoint`); its [B/D, S, W] partial sum is `psum`-ed over `model`.
The head weights keep the global scale HI**-0.5. The teacher's un-normalised head sum is
likewise summed per device over its local heads (`loss_head_chunk` chunks) and `psum`-ed
over `model` before the renormalisation. The loss needs sum(kl) and count(valid_tok) over
the whole batch: both are `psum`-ed over `data` before the division.

Why shard_map and not GSPMD with sharding constraints: the chunked path is a `lax.scan` over
`dynamic_slice`s of the GLOBAL heads axis. With that axis sharded over `model`, step i's slice
lives on the one device that owns those heads, so GSPMD cannot run the steps as local chunks
on every device at once; it has to move `wq_b` / the queries, or the math must be rewritten
over a [model, local heads] axis. With shard_map the per-device program is the unchanged
single-device function over local heads, and the collectives are explicit: one psum of
the [B/D, S, W] scores and one of the teacher sum over `model`, two scalar psums over `data`.
`check_vma=True` (the default) makes shard_map type-check replication: an output declared
replicated over an axis (the loss P(), the scores P(data) over `model`) must be provably so,
so a forgotten psum is a trace-time error instead of one device's partial sum passed off as
the result. Its one cost: the keys are replicated over `model` but each device's heads use
them differently, so they are cast to device-varying (`lax.pcast`) before the scoring, whose
custom VJP must return a cotangent of its input's type; the transpose of that cast is the
psum over `model` of the per-device key cotangents. The replicated parameters' cotangents
are psum-ed by shard_map's own transpose. The tests (tests/sharded) check every gradient
against single-device JAX to 1e-12 in float64.

This relies on two details of jax_impl: the scan carries of `scoring.raw_scores` and
`loss.teacher_head_sum` start from zeros typed like their body's output (`zeros_like`), since
under shard_map a scan's carry must vary over the same mesh axes going in and coming out (on
one device they are plain zeros); and loss.py exposes the steps of `kl_loss` separately
(loss_keep, teacher_inputs, teacher_head_sum, normalise_teacher, kl_per_token), because the
teacher sum is psum-ed before it is normalised and sum(kl) before it is divided.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .api import forward_parts, prepare_arguments
from .config import CSAConfig, resolve_dtype
from .loss import kl_per_token, loss_keep, normalise_teacher, teacher_head_sum, teacher_inputs
from .validate import PARAM_NAMES

__all__ = ["check_mesh", "sharded_forward", "sharded_loss", "sharded_loss_and_grads", "sharded_parity_bundle"]


# --------------------------------------------------------------------------- validation


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _axis_size(mesh: Mesh, axis: str, role: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"{role}={axis!r} is not an axis of the mesh (axes: {', '.join(map(repr, mesh.axis_names))})"
        )
    return int(mesh.shape[axis])


def check_mesh(cfg: CSAConfig, batch: int, mesh: Mesh, data_axis: str = "data", model_axis: str = "model"):
    """Validate the split of a batch of `batch` rows and `cfg`'s heads over `mesh`.

    Returns (data size D, model size M). Every violation is a ValueError naming the quantity,
    the mesh axis, its size, and the valid choices.
    """
    if data_axis == model_axis:
        raise ValueError(f"data_axis and model_axis must differ, both are {data_axis!r}")
    d = _axis_size(mesh, data_axis, "data_axis")
    m = _axis_size(mesh, model_axis, "model_axis")
    if batch % d:
        raise ValueError(
            f"batch B={batch} must be divisible by the size {d} of mesh axis {data_axis!r} "
            f"(the batch is split over it; valid sizes: {', '.join(map(str, _divisors(batch)))})"
        )
    for heads_name, chunk_name in (("index_n_heads", "indexer_head_chunk"), ("num_query_heads", "loss_head_chunk")):
        heads, chunk = getattr(cfg, heads_name), getattr(cfg, chunk_name)
        if heads % m:
            raise ValueError(
                f"{heads_name}={heads} must be divisible by the size {m} of mesh axis {model_axis!r} "
                f"(heads are split over it; valid sizes: {', '.join(map(str, _divisors(heads)))})"
            )
        local = heads // m
        if chunk and local % chunk:
            valid = ", ".join(str(c) for c in [0, *_divisors(local)])
            raise ValueError(
                f"{chunk_name}={chunk} must divide the local {'index' if heads_name == 'index_n_heads' else 'teacher'} "
                f"heads: {heads_name}={heads} over mesh axis {model_axis!r} of size {m} leaves {local} "
                f"per device (valid: {valid})"
            )
    return d, m


def _local_cfg(cfg: CSAConfig, m: int) -> CSAConfig:
    """The config one device sees for scoring: its own share of the indexer heads."""
    return dataclasses.replace(cfg, index_n_heads=cfg.index_n_heads // m)


# --------------------------------------------------------------------------- per-device programs


def _param_specs(model_axis):
    specs = {name: P() for name in PARAM_NAMES}
    # Columns are head-major (h * DI + d, and h): a contiguous block of columns is a block of heads.
    specs["indexer.wq_b"] = P(None, model_axis)
    specs["indexer.weights_proj"] = P(None, model_axis)
    return specs


def _input_specs(data_axis, model_axis):
    return {
        "hidden_states": P(data_axis),
        "q_latent": P(data_axis),
        "position_ids": P(data_axis),
        "segment_ids": P(data_axis),
        "teacher_query": P(data_axis, None, model_axis),
        "teacher_kv": P(data_axis),
        "teacher_window_kv": P(data_axis),
        "attention_sink": P(model_axis),  # one per teacher head, split like them
    }


def _local_forward(params, inputs, cfg, dtype_name, m, model_axis):
    """One device's keys, full-head masked scores, validity and top-k (its batch rows).

    Its heads are scored with the local head count but the head weights keep the GLOBAL
    HI**-0.5 scale (head_weights uses cfg). The keys are replicated over `model`, but each
    device's heads use them differently: they are marked device-varying so that the
    scoring's custom VJP returns a per-device key cotangent of the right type (the
    transpose of this cast psums those cotangents over `model`); the partial head sums
    are added over `model`.
    """
    return forward_parts(
        params, inputs, cfg, dtype_name,
        score_cfg=_local_cfg(cfg, m),
        prepare_keys=lambda keys: jax.lax.pcast(keys, model_axis, to="varying"),
        reduce_scores=lambda partial: jax.lax.psum(partial, model_axis),
    )


def _local_loss(params, float_inputs, int_inputs, selection, cfg, dtype_name, m, data_axis, model_axis):
    """The global loss, from one device's rows and heads (every device returns the same value)."""
    dtype, wide = resolve_dtype(dtype_name)
    inputs = {**float_inputs, **int_inputs}
    _, masked, valid, topk = _local_forward(params, inputs, cfg, dtype_name, m, model_axis)
    if masked.shape[-1] == 0:
        return jnp.zeros((), wide)  # W = 0: no block anywhere; as kl_loss
    keep, valid_tok = loss_keep(valid, topk, cfg.sparse_loss, selection)
    teacher = teacher_inputs(inputs, cfg, dtype, wide)
    rows = jnp.arange(masked.shape[1])
    t = teacher_head_sum(teacher, keep, cfg, rows, inputs["segment_ids"])  # this device's teacher heads
    t = jax.lax.stop_gradient(normalise_teacher(jax.lax.psum(t, model_axis), valid_tok))
    kl = kl_per_token(masked, keep, valid_tok, t, cfg.sparse_loss)
    total = jax.lax.psum(jnp.sum(kl), data_axis)
    count = jax.lax.psum(jnp.sum(valid_tok), data_axis)
    return cfg.loss_scale * total / jnp.maximum(count, 1).astype(wide)


# --------------------------------------------------------------------------- jitted programs

_STATIC = ("cfg", "dtype_name", "mesh", "data_axis", "model_axis")


def _forward_fn(params, inputs, cfg, dtype_name, mesh, data_axis, model_axis):
    m = mesh.shape[model_axis]

    def local(p, i):
        keys, masked, _, topk = _local_forward(p, i, cfg, dtype_name, m, model_axis)
        return {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk}

    specs = _input_specs(data_axis, model_axis)
    in_specs = (_param_specs(model_axis), {k: specs[k] for k in inputs})
    out_specs = {k: P(data_axis) for k in ("compressed_keys", "index_scores", "topk_indices")}
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(params, inputs)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _forward_jit(params, inputs, cfg, dtype_name, mesh, data_axis, model_axis):
    return _forward_fn(params, inputs, cfg, dtype_name, mesh, data_axis, model_axis)


def _loss_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis):
    m = mesh.shape[model_axis]
    specs = _input_specs(data_axis, model_axis)
    in_specs = (
        _param_specs(model_axis),
        {k: specs[k] for k in float_inputs},
        {k: specs[k] for k in int_inputs},
        None if selection is None else P(data_axis),
    )
    local = functools.partial(
        _local_loss, cfg=cfg, dtype_name=dtype_name, m=m, data_axis=data_axis, model_axis=model_axis
    )
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(
        params, float_inputs, int_inputs, selection
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _loss_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis):
    return _loss_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _loss_and_grads_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis):
    grad_fn = jax.value_and_grad(_loss_fn, argnums=(0, 1))
    loss, (param_grads, input_grads) = grad_fn(
        params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis
    )
    return loss, param_grads, input_grads


@functools.partial(jax.jit, static_argnames=_STATIC)
def _bundle_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, data_axis, model_axis):
    statics = (dtype_name, mesh, data_axis, model_axis)
    out = {"forward": _forward_fn(params, {**float_inputs, **int_inputs}, cfg, *statics)}
    grad_fn = jax.value_and_grad(_loss_fn, argnums=(0, 1))
    modes = {"dense": (False, None), "sparse": (True, None), "sparse_at_selection": (True, selection)}
    for mode, (sparse, sel) in modes.items():
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        loss, (pg, ig) = grad_fn(params, float_inputs, int_inputs, sel, c, *statics)
        out[mode] = (loss, pg, ig)
    return out


# --------------------------------------------------------------------------- public API


def _place(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, selection=None):
    wide_params, float_inputs, int_inputs, selection = prepare_arguments(params, inputs, cfg, dtype, selection)
    check_mesh(cfg, int(np.shape(inputs["position_ids"])[0]), mesh, data_axis, model_axis)
    specs = _input_specs(data_axis, model_axis)
    wide_params = _place(wide_params, _param_specs(model_axis), mesh)
    float_inputs = _place(float_inputs, specs, mesh)
    int_inputs = _place(int_inputs, specs, mesh)
    if selection is not None:
        selection = jax.device_put(selection, NamedSharding(mesh, P(data_axis)))
    return wide_params, float_inputs, int_inputs, selection


def sharded_forward(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, data_axis: str = "data",
                    model_axis: str = "model"):
    """`indexer_forward` on `mesh`: the same dict, each output sharded by batch over `data_axis`."""
    p, f, i, _ = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis)
    return _forward_jit(p, {**f, **i}, cfg, dtype, mesh, data_axis, model_axis)


def sharded_loss(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection=None,
                 data_axis: str = "data", model_axis: str = "model"):
    """`indexer_loss` on `mesh` (a replicated scalar)."""
    args = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, selection)
    return _loss_jit(*args, cfg, dtype, mesh, data_axis, model_axis)


def sharded_loss_and_grads(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection=None,
                           data_axis: str = "data", model_axis: str = "model"):
    """`indexer_loss_and_grads` on `mesh`: (loss, param_grads, input_grads), each gradient laid
    out like its parameter or input (wq_b / weights_proj columns over `model_axis`, inputs by
    batch over `data_axis`)."""
    args = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, selection)
    return _loss_and_grads_jit(*args, cfg, dtype, mesh, data_axis, model_axis)


def sharded_parity_bundle(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection,
                          data_axis: str = "data", model_axis: str = "model"):
    """`indexer_parity_bundle` on `mesh`, in ONE compiled program: {"forward": the
    `sharded_forward` dict, "dense" | "sparse" | "sparse_at_selection": (loss, param_grads,
    input_grads)}, the last with `selection` imposed; `cfg.sparse_loss` is ignored."""
    args = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, selection)
    return _bundle_jit(*args, cfg, dtype, mesh, data_axis, model_axis)

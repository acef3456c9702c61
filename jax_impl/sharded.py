"""The indexer and its loss on a device mesh: batch over `data`, the sequence over `seq`
(context parallelism), heads over `model`.

Same outputs as `indexer_forward` / `indexer_loss_and_grads` (docs/plugins.md), computed with
`jax.shard_map`: every device runs the single-device row program (jax_impl.query_blocks) on its
own block of rows and heads, and the collectives are explicit.

  data axis   `hidden_states`, `q_latent`, ids, teacher inputs and `selection` are split by
              batch row. Nothing crosses it but the loss's sum and count.
  seq axis    every per-token input (and `teacher_kv`, by block) is split into P contiguous
              stretches of L = S/P token rows; L must be a multiple of m, so that each device
              pools whole blocks (W/P of them). Three things cross it:
              - the pooling halo: block 0 of a device pools the `a` slots of the previous
                device's last block, which that device sends by `ppermute` (m x DI values and
                the block's first position, so SPEC section 5's document rule is applied to
                it exactly as on one device); device 0 gets none;
              - the keys: every query may pick any earlier block, so the keys (with what
                validity needs of each block) and the teacher's `teacher_kv` are gathered
                over `seq` (`all_gather`); its transpose, a reduce-scatter, returns each
                block's key cotangent to the device that pooled it;
              - the joint teacher's window: a query reads n - 1 earlier tokens of
                `teacher_window_kv` (n = min(n_win, S)), so each device prepends the last
                n - 1 rows of the devices before it (`ppermute`, as many hops as n - 1 needs
                stretches of L), with their segment ids; rows before token 0 are in no window.
              Top-k, the teacher and the KL stay per row; sum(kl) and count(valid_tok) are
              `psum`-ed over `seq` and `data` before the one division.
  model axis  indexer heads (the `wq_b` and `weights_proj` columns of a head) and teacher heads
              (`teacher_query[:, :, h]`, `attention_sink[h]`) are split into contiguous blocks
              of HI/M and H/M heads; the [B, L, W] score partial sums and the teacher's head
              sums are `psum`-ed over it. Parameters and keys are replicated over it.

Per device, `scoring.raw_scores` runs with a config whose `index_n_heads` is the LOCAL head
count, so `indexer_head_chunk` chunks walk the device's own heads (the same `lax.scan` under
`jax.checkpoint`), and `query_chunk` blocks walk its own L rows (query_blocks.rows_loss:
`lax.scan` under `jax.checkpoint`, head chunks nested inside); the head weights keep the
GLOBAL scale HI**-0.5.

Why shard_map and not GSPMD with sharding constraints: the chunked path is a `lax.scan` over
`dynamic_slice`s of the GLOBAL heads axis. With that axis sharded over `model`, step i's slice
lives on the one device that owns those heads, so GSPMD cannot run the steps as local chunks
on every device at once; and the halo is a neighbour exchange, not a resharding. With
shard_map the per-device program is the single-device one over local rows and heads.
`check_vma=True` (the default) makes shard_map type-check replication: an output declared
replicated over an axis (the loss P(), the scores over `model`) must be provably so, so a
forgotten psum is a trace-time error instead of one device's partial sum passed off as the
result. Its one cost: the keys are replicated over `model` but each device's heads use them
differently, so they are cast to device-varying (`lax.pcast`) before the scoring; the
transpose of that cast is the psum over `model` of the per-device key cotangents. The
parameters are cast the same way over `data` and `seq` (`_vary_over_rows`), so that their
cotangents are reduced once after the loops rather than in every iteration of them. The keys are
gathered in the wide dtype: the reduce-scatter of their cotangents then adds the devices'
shares in the wide dtype, as one device adds its rows' (gathering in bfloat16 would halve the
bytes and round every device's share to bfloat16 before the sum).

Placement: every process holds the whole problem on its host and supplies its addressable shards
of each global input (`jax.make_array_from_callback`), so one call runs on the devices of one
process or, under `jax.distributed`, on a mesh over the devices of several (docs/multihost.md);
the outputs are then global arrays, each process holding its own shards.

This relies on two details of jax_impl: the scan carries of `scoring.raw_scores` and
`loss.teacher_head_sum` start from zeros typed like their body's output (`zeros_like`), since
under shard_map a scan's carry must vary over the same mesh axes going in and coming out; and
the row program's hooks (`query_blocks.Shard`, `pooling.previous_slots`' halo, `loss.Window`).
The tests (tests/sharded) check every output and gradient against one device at the tight
`chunk` bound and against the oracle goldens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .api import prepare_arguments
from .config import CSAConfig, resolve_dtype
from .loss import Window, window_tokens
from .pooling import compress_keys
from .precision import round_to, widen
from .query_blocks import KEY_PARAMS, Shard, block_rows, rows_forward, rows_loss
from .scoring import key_blocks, scoring_keys
from .validate import FLOAT_INPUTS, INDEXER_INPUTS, INT_INPUTS, PARAM_NAMES, input_shapes, param_shapes, \
    teacher_input_names

__all__ = ["Layout", "check_mesh", "lower_loss_and_grads", "sharded_forward", "sharded_loss",
           "sharded_loss_and_grads", "sharded_parity_bundle", "sharded_parity_bundle_memory"]


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a sharded call splits its problem: the mesh axes of the batch (`data`), the
    sequence (`seq`, None: not split) and the heads (`model`), and their sizes d, p, m."""

    data: str
    model: str
    seq: str | None
    d: int
    p: int
    m: int

    def rows(self, *rest) -> P:
        """The PartitionSpec of a per-token array [B, S, ...]: batch over `data`, tokens over
        `seq`, then `rest`."""
        return P(self.data, self.seq, *rest)


def seq_sizes(seq_len: int, m: int) -> list[int]:
    """The sizes a `seq` mesh axis may have for a sequence of `seq_len` tokens and compress
    ratio m: those P that split it into P stretches of whole blocks."""
    return [p for p in _divisors(seq_len) if (seq_len // p) % m == 0]


def check_mesh(cfg: CSAConfig, batch: int, mesh: Mesh, data_axis: str = "data", model_axis: str = "model",
               seq_len: int | None = None, seq_axis: str | None = None) -> Layout:
    """Validate the split of a batch of `batch` rows of `seq_len` tokens and `cfg`'s heads over
    `mesh`, and return the Layout. `seq_axis` None: the mesh's "seq" axis if it has one (else the
    sequence is not split); a name: that axis, which must exist. Every violation is a ValueError
    naming the quantity, the mesh axis, its size, and the valid choices."""
    if seq_axis is None and "seq" in getattr(mesh, "axis_names", ()):
        seq_axis = "seq"
    names = [a for a in (data_axis, seq_axis, model_axis) if a is not None]
    if len(set(names)) != len(names):
        raise ValueError(f"data_axis, seq_axis and model_axis must differ, got {data_axis!r}, {seq_axis!r}, "
                         f"{model_axis!r}")
    d = _axis_size(mesh, data_axis, "data_axis")
    m = _axis_size(mesh, model_axis, "model_axis")
    p = 1 if seq_axis is None else _axis_size(mesh, seq_axis, "seq_axis")
    if batch % d:
        raise ValueError(
            f"batch B={batch} must be divisible by the size {d} of mesh axis {data_axis!r} "
            f"(the batch is split over it; valid sizes: {', '.join(map(str, _divisors(batch)))})"
        )
    if p > 1:
        ratio = cfg.compress_ratio
        if seq_len % p or (seq_len // p) % ratio:
            valid = ", ".join(map(str, seq_sizes(seq_len, ratio)))
            per = (f"S={seq_len} is not divisible by it" if seq_len % p
                   else f"that leaves {seq_len // p} tokens per device, not a multiple of")
            raise ValueError(
                f"sequence length S={seq_len} must split into whole blocks of compress_ratio={ratio} over the "
                f"size {p} of mesh axis {seq_axis!r} ({per}"
                f"{f' compress_ratio={ratio}' if not seq_len % p else ''}; valid sizes: {valid})"
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
    return Layout(data_axis, model_axis, seq_axis if p > 1 else None, d, p, m)


# --------------------------------------------------------------------------- per-device programs


def _param_specs(lay: Layout):
    specs = {name: P() for name in PARAM_NAMES}
    # Columns are head-major (h * DI + d, and h): a contiguous block of columns is a block of heads.
    specs["indexer.wq_b"] = P(None, lay.model)
    specs["indexer.weights_proj"] = P(None, lay.model)
    return specs


def _input_specs(lay: Layout):
    return {
        "hidden_states": lay.rows(),
        "q_latent": lay.rows(),
        "position_ids": lay.rows(),
        "segment_ids": lay.rows(),
        "teacher_query": lay.rows(lay.model),
        "teacher_kv": lay.rows(),  # by block: a device's W/P blocks are its own tokens' blocks
        "teacher_window_kv": lay.rows(),
        "attention_sink": P(lay.model),  # one per teacher head, split like them
    }


def _from_previous(x, lay: Layout, hops: int = 1):
    """What the device `hops` places before this one along `seq` holds of `x` (zeros on the
    first `hops` devices, which have none)."""
    if hops >= lay.p:
        return jnp.zeros_like(x)
    return jax.lax.ppermute(x, lay.seq, [(i, i + hops) for i in range(lay.p - hops)])


def _pool_halo(lay: Layout):
    """`pooling.previous_slots`' halo on the `seq` axis: the previous device's last block."""

    def halo(kv_a, gate_a, first):
        with jax.named_scope("pool_halo"):
            kv_a, gate_a, first = (_from_previous(a, lay) for a in (kv_a, gate_a, first))
        return kv_a, gate_a, first, jax.lax.axis_index(lay.seq) > 0

    return halo


def _window_halo(cfg: CSAConfig, lay: Layout, seq_len: int):
    """The `query_blocks.Shard.window` of a device: its stretch of teacher_window_kv (and its
    segment ids) with the n - 1 rows before it prepended, from as many devices back as they
    span; on the first devices, rows before token 0 (zeros, outside every window)."""
    n = window_tokens(cfg, seq_len)

    @jax.named_scope("window_halo")
    def window(kv, seg):
        rows = kv.shape[1]
        h = n - 1
        parts_kv, parts_seg = [], []
        hops = -(-h // rows)
        for k in range(hops, 0, -1):  # the farthest device first; it sends only the rows needed
            take = rows if k < hops else h - (hops - 1) * rows
            parts_kv.append(_from_previous(kv[:, rows - take:], lay, k))
            parts_seg.append(_from_previous(seg[:, rows - take:], lay, k))
        ext_kv = jnp.concatenate([*parts_kv, kv], axis=1)
        ext_seg = jnp.concatenate([*parts_seg, seg], axis=1)
        origin = jax.lax.axis_index(lay.seq) * rows - h  # the token index of ext row 0
        return Window(ext_kv, ext_seg, n, lead=h, origin=origin)

    return window


def _gather_blocks(x, lay: Layout):
    """Every device's blocks of x [B, W/P, ...] along `seq`, in sequence order: [B, W, ...]."""
    return jax.lax.all_gather(x, lay.seq, axis=1, tiled=True)


def _shard(cfg: CSAConfig, lay: Layout, seq_len: int) -> Shard:
    """The row program's hooks for one device of the layout (query_blocks.Shard)."""
    seq = lay.p > 1

    def gather_teacher_kv(x):
        with jax.named_scope("teacher_kv_gather"):
            return _gather_blocks(x, lay)

    return Shard(
        score_cfg=dataclasses.replace(cfg, index_n_heads=cfg.index_n_heads // lay.m),
        sum_heads=lambda x: jax.lax.psum(x, lay.model),
        sum_rows=lambda x: jax.lax.psum(x, (lay.data, lay.seq) if seq else lay.data),
        window=_window_halo(cfg, lay, seq_len) if seq and window_tokens(cfg, seq_len) > 1 else None,
        gather_blocks=gather_teacher_kv if seq else None,
    )


def _device_keys(params, inputs, cfg, dtype_name, lay: Layout):
    """(the device's own keys [B, W/P, DI] in the compute dtype, every block's keys [B, W, DI]
    widened and marked device-varying over `model`, every block's `scoring.key_blocks`)."""
    dtype, wide = resolve_dtype(dtype_name)
    p = {k: round_to(params[k], dtype) for k in KEY_PARAMS}
    # The indexer never trains the hidden states.
    x = round_to(jax.lax.stop_gradient(inputs["hidden_states"]), dtype)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    halo = _pool_halo(lay) if lay.p > 1 else None
    keys = compress_keys(x, pos, p["indexer.wkv"], p["indexer.wgate"], p["indexer.ape"], p["indexer.kv_norm"],
                         cfg, wide, halo)
    keys_wide = widen(scoring_keys(keys, cfg, wide)[0], wide)  # each block quantized on its own device
    blocks = key_blocks(pos, seg, cfg, x.shape[1])
    if lay.p > 1:
        with jax.named_scope("keys_gather"):
            keys_wide = _gather_blocks(keys_wide, lay)
        with jax.named_scope("validity_gather"):
            blocks = tuple(_gather_blocks(b, lay) for b in blocks)
    # Replicated over `model`, but each device's heads use them differently: device-varying, so
    # that the scoring's custom VJP returns a per-device cotangent (psum-ed by this cast's transpose).
    return keys, jax.lax.pcast(keys_wide, lay.model, to="varying"), blocks


def _vary_over_rows(params, lay: Layout):
    """The parameters, cast to device-varying over the axes that split the rows (`data`, and
    `seq` when it is split); `model` is as their specs say (wq_b and weights_proj vary over it,
    the key parameters are replicated and reach the heads through the keys' own cast).

    A replicated parameter read inside the row program's loops (the query blocks' and the head
    chunks' `lax.scan` under `jax.checkpoint`) would get its cotangent psum-ed over `data` and
    `seq` by shard_map's transpose INSIDE each loop, once per iteration: an all-reduce of the
    parameter's size per query block and head chunk (at S = 1M on 8 devices, gigabytes a step).
    Cast to varying, its cotangent stays per device through the loops, where each iteration adds
    it locally, and the transpose of this cast, a psum over the same axes, reduces it once at the
    end."""
    axes = (lay.data, lay.seq) if lay.seq is not None else (lay.data,)
    with jax.named_scope("params"):
        return {k: jax.lax.pcast(v, axes, to="varying") for k, v in params.items()}


def _rows_per_block(cfg: CSAConfig, rows: int) -> int:
    """The query block of a device's rows: `query_chunk` rows (at most its L), or all of them."""
    return block_rows(cfg, rows) if cfg.query_chunk else rows


def _local_forward(params, inputs, cfg, dtype_name, lay: Layout):
    rows = inputs["position_ids"].shape[1]
    params = _vary_over_rows(params, lay)
    with jax.named_scope("keys"):
        keys, keys_wide, blocks = _device_keys(params, inputs, cfg, dtype_name, lay)
    with jax.named_scope("rows_forward"):
        masked, topk = rows_forward(params, keys_wide, blocks, inputs, cfg, dtype_name, _rows_per_block(cfg, rows),
                                    _shard(cfg, lay, rows * lay.p))
    return {"compressed_keys": keys, "index_scores": masked, "topk_indices": topk}


def _local_loss(params, float_inputs, int_inputs, selection, cfg, dtype_name, lay: Layout):
    """The global loss, from one device's rows and heads (every device returns the same value)."""
    _, wide = resolve_dtype(dtype_name)
    inputs = {**float_inputs, **int_inputs}
    rows = inputs["position_ids"].shape[1]
    if cfg.num_blocks(rows * lay.p) == 0:
        return jnp.zeros((), wide)  # W = 0: no block anywhere; as the single-device loss
    params = _vary_over_rows(params, lay)
    with jax.named_scope("keys"):
        _, keys_wide, blocks = _device_keys(params, inputs, cfg, dtype_name, lay)
    with jax.named_scope("rows_loss"):
        return rows_loss(params, keys_wide, blocks, inputs, selection, cfg, dtype_name, _rows_per_block(cfg, rows),
                         _shard(cfg, lay, rows * lay.p))


# --------------------------------------------------------------------------- jitted programs

_STATIC = ("cfg", "dtype_name", "mesh", "lay")


def _forward_fn(params, inputs, cfg, dtype_name, mesh, lay):
    specs = _input_specs(lay)
    in_specs = (_param_specs(lay), {k: specs[k] for k in inputs})
    out_specs = {k: lay.rows() for k in ("compressed_keys", "index_scores", "topk_indices")}
    local = functools.partial(_local_forward, cfg=cfg, dtype_name=dtype_name, lay=lay)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(params, inputs)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _forward_jit(params, inputs, cfg, dtype_name, mesh, lay):
    return _forward_fn(params, inputs, cfg, dtype_name, mesh, lay)


def _loss_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, lay):
    specs = _input_specs(lay)
    in_specs = (
        _param_specs(lay),
        {k: specs[k] for k in float_inputs},
        {k: specs[k] for k in int_inputs},
        None if selection is None else lay.rows(),
    )
    local = functools.partial(_local_loss, cfg=cfg, dtype_name=dtype_name, lay=lay)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(
        params, float_inputs, int_inputs, selection
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _loss_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, lay):
    return _loss_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, lay)


def _laid_out(param_grads, input_grads, mesh, lay):
    """The gradients placed like their parameters and inputs. The input gradients are zeros
    that the transpose builds outside shard_map, with no sharding of their own: unconstrained,
    XLA replicates them, a whole [B, S, H, D] teacher_query gradient on every device."""

    def place(tree, specs):
        return {k: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}

    return place(param_grads, _param_specs(lay)), place(input_grads, _input_specs(lay))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _loss_and_grads_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, lay):
    grad_fn = jax.value_and_grad(_loss_fn, argnums=(0, 1))
    loss, (param_grads, input_grads) = grad_fn(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh,
                                               lay)
    return loss, *_laid_out(param_grads, input_grads, mesh, lay)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _bundle_jit(params, float_inputs, int_inputs, selection, cfg, dtype_name, mesh, lay):
    out = {"forward": _forward_fn(params, {**float_inputs, **int_inputs}, cfg, dtype_name, mesh, lay)}
    grad_fn = jax.value_and_grad(_loss_fn, argnums=(0, 1))
    modes = {"dense": (False, None), "sparse": (True, None), "sparse_at_selection": (True, selection)}
    for mode, (sparse, sel) in modes.items():
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        loss, (pg, ig) = grad_fn(params, float_inputs, int_inputs, sel, c, dtype_name, mesh, lay)
        out[mode] = (loss, *_laid_out(pg, ig, mesh, lay))
    return out


# --------------------------------------------------------------------------- public API


def _global_array(x, sharding: NamedSharding):
    """`x` as one global array laid out by `sharding`, in a single- or a multi-process run.

    Every process holds the whole of `x` on its host (the same values: the problem is data every
    process loads), and supplies only its addressable shards (`make_array_from_callback`), so the
    same call builds the array on 8 devices of one process and on the 4 + 4 devices of two.
    `jax.device_put` cannot do the latter: it would need every device of the mesh to be this
    process's. An array already global (not fully addressable: built by the caller across
    processes) is left to `jax.device_put`, which reshards it on the devices."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place(tree, specs, mesh):
    return {k: _global_array(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


def _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis, selection=None):
    wide_params, float_inputs, int_inputs, selection = prepare_arguments(params, inputs, cfg, dtype, selection)
    b, s = np.shape(inputs["position_ids"])
    lay = check_mesh(cfg, int(b), mesh, data_axis, model_axis, int(s), seq_axis)
    specs = _input_specs(lay)
    wide_params = _place(wide_params, _param_specs(lay), mesh)
    float_inputs = _place(float_inputs, specs, mesh)
    int_inputs = _place(int_inputs, specs, mesh)
    if selection is not None:
        selection = _global_array(selection, NamedSharding(mesh, lay.rows()))
    return (wide_params, float_inputs, int_inputs, selection), lay


def sharded_forward(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, data_axis: str = "data",
                    model_axis: str = "model", seq_axis: str | None = None):
    """`indexer_forward` on `mesh`: the same dict, each output split by batch over `data_axis`
    and by token rows (the keys: by block) over `seq_axis` (`check_mesh` says which axis)."""
    (p, f, i, _), lay = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis)
    return _forward_jit(p, {**f, **i}, cfg, dtype, mesh, lay)


def sharded_loss(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection=None,
                 data_axis: str = "data", model_axis: str = "model", seq_axis: str | None = None):
    """`indexer_loss` on `mesh` (a replicated scalar)."""
    args, lay = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis, selection)
    return _loss_jit(*args, cfg, dtype, mesh, lay)


def sharded_loss_and_grads(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection=None,
                           data_axis: str = "data", model_axis: str = "model", seq_axis: str | None = None):
    """`indexer_loss_and_grads` on `mesh`: (loss, param_grads, input_grads), each gradient laid
    out like its parameter or input (wq_b / weights_proj columns over `model_axis`, inputs by
    batch over `data_axis` and by rows over `seq_axis`)."""
    args, lay = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis, selection)
    return _loss_and_grads_jit(*args, cfg, dtype, mesh, lay)


def sharded_parity_bundle(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection,
                          data_axis: str = "data", model_axis: str = "model", seq_axis: str | None = None):
    """`indexer_parity_bundle` on `mesh`, in ONE compiled program: {"forward": the
    `sharded_forward` dict, "dense" | "sparse" | "sparse_at_selection": (loss, param_grads,
    input_grads)}, the last with `selection` imposed; `cfg.sparse_loss` is ignored."""
    args, lay = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis, selection)
    return _bundle_jit(*args, cfg, dtype, mesh, lay)


def sharded_parity_bundle_memory(params, inputs, cfg: CSAConfig, dtype: str, mesh: Mesh, selection,
                                 data_axis: str = "data", model_axis: str = "model",
                                 seq_axis: str | None = None) -> dict[str, int] | None:
    """`api.compiled_memory` of the program `sharded_parity_bundle` runs with these arguments (one
    device's: temp, arguments, outputs); right after that call it compiles nothing."""
    from .api import compiled_memory

    args, lay = _prepare_sharded(params, inputs, cfg, dtype, mesh, data_axis, model_axis, seq_axis, selection)
    return compiled_memory(_bundle_jit.lower(*args, cfg, dtype, mesh, lay))


def lower_loss_and_grads(cfg: CSAConfig, dtype: str, mesh: Mesh, batch: int, seq_len: int,
                         input_dtype: str | None = None, data_axis: str = "data", model_axis: str = "model",
                         seq_axis: str | None = None) -> jax.stages.Lowered:
    """The program of `sharded_loss_and_grads` (loss under `cfg`, its `sparse_loss` and no
    imposed selection), lowered from abstract shapes: nothing is allocated or computed.

    Arguments are `jax.ShapeDtypeStruct`s laid out on `mesh` as `sharded_loss_and_grads` places
    them: the parameters in the wide dtype, the float inputs the loss reads (those of the
    indexer and of `cfg`'s teacher) in `input_dtype` (default: `dtype`), the ids int32.
    `.compile()` the result for XLA's `memory_analysis()` and the optimized HLO (`as_text()`).
    The mesh is checked as `check_mesh` checks it."""
    lay = check_mesh(cfg, batch, mesh, data_axis, model_axis, seq_len, seq_axis)
    _, wide = resolve_dtype(dtype)
    floats = jnp.dtype(input_dtype or dtype)
    specs, pspecs = _input_specs(lay), _param_specs(lay)
    shapes = input_shapes(cfg, batch, seq_len)

    def arg(shape, dt, spec):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    params = {k: arg(shape, wide, pspecs[k]) for k, (_, shape) in param_shapes(cfg).items()}
    names = [k for k in FLOAT_INPUTS if k in INDEXER_INPUTS or k in teacher_input_names(cfg)]
    float_inputs = {k: arg(shapes[k][1], floats, specs[k]) for k in names}
    int_inputs = {k: arg(shapes[k][1], jnp.int32, specs[k]) for k in INT_INPUTS}
    return _loss_and_grads_jit.lower(params, float_inputs, int_inputs, None, cfg, dtype, mesh, lay)

"""What a compiled program of the layer holds, and what the chunked algorithm must hold: the
compiled memory of loss + parameter gradients (`compiled_temp_bytes`, compile-only, nothing
is allocated) and its analytic floor (`analytic_floor`), with the small shape the memory
checks compile (`TEST_SHAPE`).

Read by the mutation self-test's `memory` check (harness.selftest.mutation_worker), which an
installed harness runs too, and by the repository's tests/test_memory.py and
benchmarks/memory_speed.py (the sweep over chunk sizes and sequence lengths, whose module doc
says what YNNPACK's scratch is and why it is counted). The verdicts on these numbers are
harness.judging.memory_bounds'.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import CSAConfig, indexer_loss, resolve_dtype
from jax_impl.validate import FLOAT_INPUTS, INT_INPUTS, input_shapes, param_shapes


# The small compile-only shape of tests/test_memory.py and of the mutation worker's memory
# check: HI*DI / W = 2 (the benchmark's shapes: 4), so an all-heads q [B, S, HI, DI] is two
# [B, S, W] arrays, large enough to see. The bound, chunk 1 holds at most
# harness.judging.tolerance.MEMORY_FLOOR_FACTOR x its analytic floor, is judged by
# harness.judging.memory_bounds.
TEST_SHAPE = dict(
    emb_dim=64, q_lora_rank=64, index_n_heads=16, index_head_dim=64, rope_head_dim=32,
    compress_ratio=4, index_topk=16, num_query_heads=16, head_dim=64,
)
TEST_BATCH, TEST_SEQ = 1, 2048


# -- the measured program ---------------------------------------------------------------


def _loss_and_param_grads(params, float_inputs, int_inputs, cfg, dtype_name):
    # query_chunk > 0: indexer_loss routes to the query-blocked training path (jax_impl.query_blocks).
    return jax.value_and_grad(indexer_loss)(params, {**float_inputs, **int_inputs}, cfg, dtype_name)


_grad_jit = jax.jit(_loss_and_param_grads, static_argnames=("cfg", "dtype_name"))


def _abstract_args(cfg: CSAConfig, batch: int, seq: int, dtype: str):
    """ShapeDtypeStructs laid out as jax_impl.api.prepare_arguments hands them to jit."""
    _, wide = resolve_dtype(dtype)
    params = {k: jax.ShapeDtypeStruct(shape, wide) for k, (_, shape) in param_shapes(cfg).items()}
    shapes = input_shapes(cfg, batch, seq)
    floats = {k: jax.ShapeDtypeStruct(shapes[k][1], jnp.float32) for k in FLOAT_INPUTS}
    ints = {k: jax.ShapeDtypeStruct(shapes[k][1], jnp.int32) for k in INT_INPUTS}
    return params, floats, ints


def compile_grad(cfg: CSAConfig, batch: int, seq: int, dtype: str = "float32"):
    """The compiled loss-and-parameter-gradients program (nothing is allocated)."""
    return _grad_jit.lower(*_abstract_args(cfg, batch, seq, dtype), cfg=cfg, dtype_name=dtype).compile()


_SIZES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "s64": 8}


def _shape_bytes(text: str) -> int:
    m = re.match(r"(\w+)\[([\d,]*)\]", text)
    if not m or m.group(1) not in _SIZES:
        return 0
    return int(np.prod([int(d) for d in m.group(2).split(",") if d], dtype=np.int64)) * _SIZES[m.group(1)]


def ynn_scratch_bytes(hlo_text: str) -> int:
    """Largest dot result held inside a YNNPACK fusion (not counted by XLA's temp bytes)."""
    ynn_bodies = set(re.findall(r"kind=kCustom, calls=%([\w.\-]+).*__ynn_fusion", hlo_text))
    worst, body = 0, None
    for line in hlo_text.splitlines():
        head = re.match(r"^%([\w.\-]+) \(.*\{$", line)
        if head:
            body = head.group(1) if head.group(1) in ynn_bodies else None
        elif line.startswith("}"):
            body = None
        elif body is not None and " dot(" in line and "ROOT" not in line:
            worst = max(worst, _shape_bytes(line.split("= ", 1)[1]))
    return worst


def compiled_temp_bytes(cfg: CSAConfig, batch: int, seq: int, dtype: str = "float32") -> dict:
    """XLA's compiled memory analysis of loss + gradients of the six parameters, in bytes.

    Keys: temp, argument, output, alias (XLA's numbers), ynn_scratch (see the module
    docstring) and effective = temp + ynn_scratch. Compile-only: nothing is allocated.
    """
    compiled = compile_grad(cfg, batch, seq, dtype)
    ma = compiled.memory_analysis()
    scratch = ynn_scratch_bytes(compiled.as_text())
    return {
        "temp": int(ma.temp_size_in_bytes),
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "ynn_scratch": int(scratch),
        "effective": int(ma.temp_size_in_bytes) + int(scratch),
    }


# -- the analytic floor ------------------------------------------------------------------


def analytic_floor(cfg: CSAConfig, batch: int, seq: int, dtype: str = "float32", rows: int | None = None) -> dict:
    """Bytes the chunked algorithm must hold at its worst moment, by phase.

    A = B*S*W wide elements: the scores accumulator, the teacher distribution T, the score
    gradient are each one A; a chunk of c heads' logits is c*A. Native is chunk = all heads.
      teacher scan   T accumulator + one teacher chunk's logits        (1 + t) A
      indexer fwd    score accumulator + one chunk's logits            (1 + c) A
                     (whichever of the two runs second also holds the first's result: + A;
                      the cheaper order is taken)
      loss           scores and T in, their gradient written over the scores     2 A
      indexer bwd    the score gradient + the chunk's recomputed logits and their
                     cotangent (both needed: dq and dK read the cotangent, the head
                     weights' gradient the logits) + the chunk's queries and their
                     gradient [B, S, c, DI]                                (1 + 2c) A + 2 q_c
    No layout copy is unavoidable in float32 (every big operand is contracted as it lies);
    in a narrower dtype the teacher chunk's widened copy [B, S, t, D] is added.
    Parameters, inputs and outputs are not temp and are not counted; neither are arrays of
    O(B*S*HI) or O(B*W*DI) (head weights, keys), small next to A at these shapes.

    Query chunking (cfg.query_chunk = r > 0): every phase holds one block of r rows, so the
    same formulas with A = B*r*W (`rows`, default min(r, S), or S when r = 0); the arrays
    that grow with S alone (the compressor's projections, per-row outputs) are not counted.
    """
    _, wide = resolve_dtype(dtype)
    wb = jnp.dtype(wide).itemsize
    w = cfg.num_blocks(seq)
    if rows is None:
        rows = min(cfg.query_chunk, seq) if cfg.query_chunk else seq
    a = batch * rows * w * wb
    c = cfg.indexer_head_chunk or cfg.index_n_heads
    t = cfg.loss_head_chunk or cfg.num_query_heads
    q_c = batch * rows * c * cfg.index_head_dim * wb
    cast = 0 if jnp.dtype(dtype) == wide else batch * rows * t * cfg.head_dim * wb
    teacher = (1 + t) * a + cast
    idx_fwd = (1 + c) * a
    fwd = min(max(teacher, idx_fwd + a), max(idx_fwd, teacher + a))
    loss = 2 * a
    idx_bwd = (1 + 2 * c) * a + 2 * q_c
    phases = {"forward": fwd, "loss": loss, "indexer_backward": idx_bwd}
    return {"total": max(phases.values()), "A": a, **phases}

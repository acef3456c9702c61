"""The sharded loss gradient's collectives, read from the optimized HLO of the compiled program
(compile-only, from abstract shapes: `sharded.lower_loss_and_grads`).

The parameters are replicated over `data` and `seq`, and the row program reads them inside its
loops (the query blocks' and the head chunks' `lax.scan` under `jax.checkpoint`). Unless they
are cast to device-varying before the loops, shard_map's transpose all-reduces their cotangent
inside every iteration: at S = 1M on 8 devices, gigabytes per step instead of the parameters'
size once. Here no all-reduce over more than one device may run inside a while loop but the
head sums over `model` (each query block's own scores), and the parameter gradients' all-reduce
must be there, once, outside them.

Runs in the sharded slice's process (8 simulated CPU devices, tests/sharded/conftest.py).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_impl
from benchmarks.collectives import collectives, loop_all_reduces
from jax_impl import sharded
from problems import SMALL

pytestmark = pytest.mark.sharded

BATCH, SEQ = 2, 64


SHAPES = [(2, 4, 1), (2, 2, 2)]


def _ids(shape):
    return "mesh" + "x".join(map(str, shape))


@functools.lru_cache(maxsize=None)
def _compiled(shape):
    n = int(np.prod(shape))
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, JAX has {jax.device_count()}")
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), ("data", "seq", "model"))
    # Query blocks of 4 rows (L = 32 / 16 rows per device: several blocks) and head chunks of 2.
    cfg = jax_impl.CSAConfig(**SMALL, indexer_head_chunk=2, loss_head_chunk=2, query_chunk=4)
    return sharded.lower_loss_and_grads(cfg, "float32", mesh, BATCH, SEQ).compile()


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_no_all_reduce_inside_loops(shape):
    hlo = _compiled(shape).as_text()
    found = collectives(hlo)
    assert any(c.in_loop for c in found), "no collective inside a loop: the program has no query-block loop to check"
    # The one all-reduce that belongs in the loops: each query block's head sums over `model`
    # (the [B, r, W] score partial sums, the teacher's head sums), whose groups are the model axis.
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    model_groups = [tuple(ids[d, q, :]) for d in range(shape[0]) for q in range(shape[1])]
    bad = loop_all_reduces(hlo, model_groups if shape[2] > 1 else ())
    assert not bad, ("all-reduces inside while loops (once per iteration): "
                     + "; ".join(f"{c.name} {c.result_bytes} bytes x{c.trips} in {c.computation} ({c.op_name})"
                                 for c in bad))
    # The parameters' gradients are all-reduced over data x seq once, outside the loops.
    group = shape[0] * shape[1]
    reduced = [src for c in found if c.kind == "all-reduce" and not c.in_loop and c.group == group
               for src in c.sources if "/params/" in src]
    assert reduced, "no all-reduce of the parameter gradients outside the loops"


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_gradients_come_back_laid_out_like_their_arguments(shape):
    """Each gradient is split like its parameter or input: the input gradients (zeros) are not
    replicated, which at S = 1M would put a whole [B, S, H, D] array on every device."""
    compiled = _compiled(shape)
    params_in, floats_in = compiled.input_shardings[0][:2]
    _, param_out, input_out = compiled.output_shardings
    ndim = {k: len(v.shape) for k, v in compiled.args_info[0][0].items()}
    ndim |= {k: len(v.shape) for k, v in compiled.args_info[0][1].items()}
    wrong = [k for k, out in (*param_out.items(), *input_out.items())
             if not out.is_equivalent_to({**params_in, **floats_in}[k], ndim[k])]
    assert not wrong, f"gradients laid out unlike their arguments: {wrong}"

"""Mutation self-test of the harness: does the matrix catch realistic mistakes?

`CATALOGUE` is data: one `Mutant` per single mistake a person could make in
`jax_impl`, with the exact source text it replaces (which must occur exactly once:
a stale catalogue fails loudly, it never silently tests nothing), the matrix slice
that must catch it and the checks expected to do so. The committed source is never
touched: `run_mutant` copies `jax_impl/` into a temporary directory, applies the
text patch there, and runs the slice in a process of its own that imports the mutated
copy in place of the installed package and judges it against the fixture goldens (no
torch): `harness.selftest.mutation_worker.run`, in a child forked from a server that has already
imported jax (~2 s less per mutant), or `python -m harness.selftest.mutation_worker` where there is
no fork server. `run_clean` runs the same machinery on an unmutated copy: every slice
must pass there, so a mutant that fails does so because of its mutation. The workers of
one run share a JAX persistent compilation cache (keyed by the compiled HLO, so a
mutant only ever reuses a program its mutation left unchanged).

Slices (`Point`s) are chosen for cost: each point is one compiled program (2-4 s on
2 cores), so a mutant runs 1 point, plus the native program when its point is
chunked (the `chunk` check compares against it). float64 wherever possible: the
1e-12 `exact64` check sees any formula error, however small, and bfloat16 noise would
hide one. The low-dtype accumulation mutant needs a bfloat16 chunked point: its
damage is a chunk-vs-native difference above the tight `chunk` bound. The removed
`jax.checkpoint` changes memory, not numbers: the worker's compile-only `memory`
check (the analytic-floor bound of tests/test_memory.py) kills it.

Some mistakes no committed case can reveal (a field every case leaves at one
value: m = 4, norm_eps, rope_theta, loss_scale, head_dim == index_head_dim). Their entries name
`problems`: pinned random problems of harness/problems/random_configs.py, which the worker runs live
against torch_ref (float64 exact and chunk checks), and `killing_test` names the test of the
suite that runs that problem (tests/test_random_configs.py::test_pinned_problem[NAME]); the
other entries are killed by the parity matrix (tests/test_parity_matrix.py), of which their
slice is a part.

    python -m harness.selftest.mutations              # every mutant, in parallel; prints the kill table
    python -m harness.selftest.mutations --only NAME  # some of them
    python -m harness.selftest.mutations --length     # LENGTH_CATALOGUE: toy slice and long block, both outcomes
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..platforms import usable_cpus
from ..points import Point  # the one Point: a slice runs every mode and quantity at it

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "jax_impl"

STAGES = ("pooling", "rope", "scoring", "chunking", "loss", "precision", "quantization")


# The slices. tiny (B=1, S=16, HI=2, H=2, W=4, k=2) is the cheapest problem with a top-k
# boundary, queries with 0..4 valid blocks and two heads per knob (chunk 1 = two scan
# steps); packed is the smallest with documents (a block straddling a boundary, a
# document starting on a block edge).
TINY64 = Point("tiny", "float64")
TINY64_ICHUNK = Point("tiny", "float64", ichunk=1)
TINY64_TCHUNK = Point("tiny", "float64", tchunk=1)
PACKED64 = Point("packed", "float64")
# bfloat16, chunk 2 of HI=8 (4 scan steps): for the mistakes about dtypes, visible only as a
# chunk-vs-native difference. At small's sizes, not tiny's: the skipped-rounding mutant shows
# only where XLA's fusion of the native program keeps excess precision that the chunked one
# does not (measured: killed on small at chunks 2 and 8, survives every tiny bf16/f16 point).
SMALL_BF16_ICHUNK = Point("small", "bfloat16", ichunk=2)
# Query chunk 5 of tiny's S = 16: 4 blocks of 5, 5, 5, 1 rows, so the last block
# holds 4 padding rows; float64, where `exact64` and the `chunk` check against native see any
# row out of place.
TINY64_QCHUNK = Point("tiny", "float64", qchunk=5)
# The twins of `ties` (exact score ties on the top-k boundary), float64.
TIES64 = Point("ties", "float64")
# The joint teacher's and YaRN's cases (harness/problems/cases.py), float64.
SINK_ONLY64 = Point("sink_only", "float64")
YARN64 = Point("yarn_tail", "float64")
# The sequence split over 4 devices (mesh data 1 x seq 4 x model 1: 8 rows each, 2 blocks each):
# packed_edges, whose documents start on a device edge (token 16) and beside one, with a
# 6-token window that crosses every edge. The worker runs it on 8 simulated CPU devices
# (mutation_worker.run); the `chunk` check compares it with one device at the same knobs.
EDGES64_SEQ4 = Point("packed_edges", "float64", mesh=(1, 4, 1))
# The quantized case whose queries sit exactly on the quantizer's boundaries, in every dtype.
PLANTED64 = Point("quant_planted", "float64")


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One realistic single mistake, applied as a text patch to a copy of jax_impl/<module>.

    `old` must occur exactly once in the module; `more` holds further (old, new) pairs of
    the same mistake elsewhere in that module (same rule). `points` is the matrix slice to
    run; `memory` adds the compile-only memory check. The mutant is killed when any check
    fails; `killed_by` names the checks expected to do it (at least one must be among
    the failures)."""

    name: str
    stage: str
    module: str
    old: str
    new: str
    killed_by: tuple[str, ...]
    points: tuple[Point, ...]
    mistake: str
    more: tuple[tuple[str, str], ...] = ()
    memory: bool = False
    # Pinned random problems (harness.problems.random_configs.PINNED) to run as well, live against
    # torch: for the mistakes that no committed case reveals.
    problems: tuple[str, ...] = ()
    # The test of the suite that kills it (the matrix slice above is that test's subset).
    killing_test: str = "tests/test_parity_matrix.py"
    # Run the `kernel` check (harness.sides.kernel_check: the Pallas kernels against the XLA path on
    # problems with partial tiles, interpret mode) as well.
    kernel: bool = False
    # Long cases' query blocks ("CASE:BLOCK", harness.run.long) to judge as well, live against torch:
    # for the mistakes only length shows (LENGTH_CATALOGUE).
    long_blocks: tuple[str, ...] = ()

    @property
    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new), *self.more)


CATALOGUE: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- pooling (SPEC section 5)
    Mutant(
        "pool_slot_halves_swapped", "pooling", "pooling.py",
        "    kv_a, kv_b = kv[..., :di], kv[..., di:]\n"
        "    gate_a, gate_b = gate[..., :di].astype(wide), gate[..., di:].astype(wide)\n",
        "    kv_a, kv_b = kv[..., di:], kv[..., :di]\n"
        "    gate_a, gate_b = gate[..., di:].astype(wide), gate[..., :di].astype(wide)\n",
        ("exact64",), (TINY64,),
        "Ca/Cb swapped: a token's share of the NEXT block read from [DI:] and its own from [:DI] "
        "(swapping the concatenation order of the slots instead would be harmless: the softmax "
        "pools a set)",
    ),
    Mutant(
        "pool_softmax_wrong_axis", "pooling", "pooling.py",
        "    weights = jax.nn.softmax(slots_gate, axis=2)\n",
        "    weights = jax.nn.softmax(slots_gate)\n",
        ("exact64",), (TINY64,),
        "gate softmax over the default last axis (channels) instead of the 2m slots",
    ),
    Mutant(
        "pool_ape_not_added", "pooling", "pooling.py",
        "    gate = round_to(gate.astype(wide) + ape.astype(wide), x.dtype)",
        "    gate = round_to(gate.astype(wide), x.dtype)",
        ("exact64",), (TINY64,),
        "the absolute position bias `ape` never added to the gate",
    ),
    Mutant(
        "pool_shift_two_blocks", "pooling", "pooling.py",
        "        kv_prev = jnp.pad(kv_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]\n"
        "        gate_prev = jnp.pad(gate_a, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :w]\n",
        "        kv_prev = jnp.pad(kv_a, ((0, 0), (2, 0), (0, 0), (0, 0)))[:, :w]\n"
        "        gate_prev = jnp.pad(gate_a, ((0, 0), (2, 0), (0, 0), (0, 0)))[:, :w]\n",
        ("exact64",), (TINY64,),
        "the `a` slots shifted by two blocks instead of one: block w pools block w-2's share",
    ),
    Mutant(
        "pool_document_boundary_ignored", "pooling", "pooling.py",
        "    cont = (exists[None, :] & (first == first_prev + m))[:, :, None, None]\n",
        "    cont = jnp.broadcast_to(exists[None, :], first.shape)[:, :, None, None]\n",
        ("exact64",), (PACKED64,),
        "block w-1's `a` slots kept across a document boundary (only w = 0 masked)",
    ),
    # ---------------------------------------------------------------- RoPE (SPEC section 6)
    Mutant(
        "rope_halves_not_interleaved", "rope", "rope.py",
        "    pairs = rot.reshape(*rot.shape[:-1], half, 2)\n"
        "    x0, x1 = pairs[..., 0], pairs[..., 1]\n"
        "    out = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)\n",
        "    x0, x1 = rot[..., :half], rot[..., half:]\n"
        "    out = jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)\n",
        ("exact64",), (TINY64,),
        "NeoX-style rotation: channel i paired with i + DR/2 instead of the pairs (2i, 2i+1)",
    ),
    Mutant(
        "rope_leading_slice", "rope", "rope.py",
        "    passthrough, rot = xw[..., :keep], xw[..., keep:]\n",
        "    rot, passthrough = xw[..., :rope_head_dim], xw[..., rope_head_dim:]\n",
        ("exact64",), (TINY64,),
        "the leading DR channels rotated instead of the trailing ones",
        more=(("    return round_to(jnp.concatenate([passthrough, out], axis=-1), dtype)",
               "    return round_to(jnp.concatenate([out, passthrough], axis=-1), dtype)"),),
    ),
    Mutant(
        "rope_wrong_theta", "rope", "rope.py",
        "    inv_freq = theta ** (",
        "    inv_freq = 10000.0 ** (",
        ("exact64",), (TINY64,),
        "the Llama default base 10000 hard-coded instead of cfg.rope_theta (160000)",
    ),
    Mutant(
        "rope_block_last_token", "rope", "pooling.py",
        "    return apply_rope(keys, block_positions(position_ids, m, w),",
        "    return apply_rope(keys, position_ids[:, m - 1 : w * m : m],",
        ("exact64",), (TINY64,),
        "compressed keys rotated at the position of the block's last token, not its first",
    ),
    # ---------------------------------------------------------------- scoring (SPEC section 7)
    Mutant(
        "score_missing_relu", "scoring", "scoring.py",
        "    return jnp.sum(hw[..., None] * jax.nn.relu(logits), axis=2)",
        "    return jnp.sum(hw[..., None] * logits, axis=2)",
        ("exact64",), (TINY64,),
        "ReLU of the per-head logits left out",
    ),
    Mutant(
        "score_missing_di_scale", "scoring", "scoring.py",
        "    scores = acc * (di**-0.5)",
        "    scores = acc",
        ("exact64",), (TINY64,),
        "the DI**-0.5 score scale left out",
    ),
    Mutant(
        "score_missing_hi_scale", "scoring", "scoring.py",
        "    return project(x, weights_proj, wide).astype(wide) * (n_heads**-0.5)",
        "    return project(x, weights_proj, wide).astype(wide)",
        ("exact64",), (TINY64,),
        "the HI**-0.5 head-weight scale left out",
    ),
    Mutant(
        "score_causal_off_by_one", "scoring", "scoring.py",
        "    causal = first[:, None, :] + m <= position_ids[:, :, None] + 1",
        "    causal = first[:, None, :] + m <= position_ids[:, :, None]",
        ("exact64",), (TINY64,),
        "causal rule off by one: a block ending at the query itself counted as not yet complete",
    ),
    Mutant(
        "score_segment_mask_ignored", "scoring", "scoring.py",
        "    return causal & same_doc",
        "    return causal",
        ("exact64",), (PACKED64,),
        "the segment mask ignored: packed documents see each other's blocks",
    ),
    Mutant(
        "topk_invalid_pick_kept", "scoring", "scoring.py",
        "    return jnp.where(picked_valid, idx, -1).astype(jnp.int32)",
        "    return idx.astype(jnp.int32)",
        ("topk",), (TINY64,),
        "an invalid (-inf) top-k pick returned as a block index instead of -1",
    ),
    # ---------------------------------------------------------------- chunking (SPEC section 7-8)
    Mutant(
        "chunk_indexer_last_dropped", "chunking", "scoring.py",
        "jax.lax.scan(body, acc0, jnp.arange(heads // chunk))",
        "jax.lax.scan(body, acc0, jnp.arange(heads // chunk - 1))",
        ("chunk", "exact64"), (TINY64_ICHUNK,),
        "the indexer scan runs one step too few: the last head chunk never contributes",
    ),
    Mutant(
        "chunk_teacher_last_twice", "chunking", "loss.py",
        "jax.lax.scan(body, acc0, jnp.arange(heads // chunk))",
        "jax.lax.scan(body, acc0, jnp.arange(heads // chunk + 1))",
        ("chunk", "exact64"), (TINY64_TCHUNK,),
        "the teacher scan runs one step too many: dynamic_slice clamps, so the last head chunk "
        "is counted twice",
    ),
    Mutant(
        "chunk_accumulate_low_dtype", "chunking", "scoring.py",
        "        acc0 = jnp.zeros_like(hw[..., :1] * keys_wide[:, None, :, 0])",
        "        acc0 = jnp.zeros_like(hw[..., :1] * keys_wide[:, None, :, 0], dtype=keys.dtype)",
        ("chunk",), (SMALL_BF16_ICHUNK,),
        "the chunked scores accumulated in the compute dtype (bfloat16), not the wide dtype",
        more=(("            return acc + _head_contribution(widen(q), keys_wide, hw_c), codes if with_codes else None",
               "            return (acc + _head_contribution(widen(q), keys_wide, hw_c)).astype(acc.dtype), "
               "codes if with_codes else None"),),
    ),
    Mutant(
        "chunk_scan_without_checkpoint", "chunking", "scoring.py",
        "        @jax.checkpoint\n        def body(acc, i):",
        "        def body(acc, i):",
        ("memory",), (),
        "the indexer scan body not wrapped in jax.checkpoint: same numbers, but the backward "
        "keeps every chunk's queries (an all-heads q)",
        memory=True,
    ),
    Mutant(
        "qchunk_normaliser_per_block", "chunking", "query_blocks.py",
        "            return kl_per_token(masked, keep, valid_tok, t, cfg.sparse_loss), valid_tok\n",
        "            kl = kl_per_token(masked, keep, valid_tok, t, cfg.sparse_loss)\n"
        "            return kl / jnp.maximum(jnp.sum(valid_tok), 1), valid_tok\n",
        ("chunk", "exact64"), (TINY64_QCHUNK,),
        "query blocks: each block's KL sum divided by its own count of valid rows and the blocks' "
        "means summed, instead of one global sum over one global count",
        more=(("    count = _apply(shard.sum_rows, jnp.sum(valid_tok))\n",
               "    count = jnp.ones((), wide)\n"),),
    ),
    Mutant(
        "qchunk_padding_rows_valid", "chunking", "query_blocks.py",
        "    valid = rows_validity(pos, seg, blocks, cfg.compress_ratio) & row_ok[None, :, None]\n",
        "    valid = rows_validity(pos, seg, blocks, cfg.compress_ratio)\n",
        ("chunk", "exact64"), (TINY64_QCHUNK,),
        "query blocks: the padding rows of the last block (S not a multiple of r) counted as valid "
        "rows (they repeat row S-1, so its KL term is counted again)",
    ),
    Mutant(
        "qchunk_last_block_clamped_slice", "chunking", "query_blocks.py",
        '    return jnp.take(a, rows, axis=1, mode="clip")\n',
        "    return jax.lax.dynamic_slice_in_dim(a, rows[0], rows.shape[0], axis=1)\n",
        ("chunk", "exact64"), (TINY64_QCHUNK,),
        "query blocks: each block read with dynamic_slice, which clamps the last block's start to "
        "S - r: its rows are earlier rows again (duplicated), taken for the last rows",
    ),
    Mutant(
        "qchunk_positions_from_block_0", "chunking", "query_blocks.py",
        '    pos = _take_rows(inputs["position_ids"], rows)\n',
        '    pos = _take_rows(inputs["position_ids"], rows - start)\n',
        ("chunk", "exact64"), (TINY64_QCHUNK,),
        "query blocks: every block's positions read from block 0 (RoPE and the causal mask of "
        "later blocks at the first block's positions)",
    ),
    # ---------------------------------------------------------------- loss (SPEC section 8)
    Mutant(
        "loss_eps_misplaced", "loss", "loss.py",
        "jnp.log(safe_t + EPS)",
        "jnp.log(safe_t) + EPS",
        ("exact64",), (TINY64,),
        "EPS added outside the log of the teacher: shifts the loss by ~1e-8, invisible below float64",
    ),
    Mutant(
        "loss_mean_over_all_tokens", "loss", "loss.py",
        "    count = jnp.maximum(jnp.sum(valid_tok), 1).astype(wide)",
        "    count = jnp.asarray(valid_tok.size, wide)",
        ("exact64",), (TINY64,),
        "the loss averaged over all B*S tokens instead of the tokens with a valid block",
    ),
    Mutant(
        "loss_sparse_mask_not_on_teacher", "loss", "loss.py",
        "teacher_distribution(teacher, keep, valid_tok, cfg, rows, inputs[\"segment_ids\"],",
        "teacher_distribution(teacher, valid, valid_tok, cfg, rows, inputs[\"segment_ids\"],",
        ("exact64@sel",), (TINY64,),
        "sparse mode: the teacher softmax spans every valid block, not just the top-k picks",
    ),
    Mutant(
        "teacher_sink_left_out", "loss", "loss.py",
        "    parts = [jnp.broadcast_to(sink[None, None, :, None], (*a.shape[:3], 1)), a]\n",
        "    parts = [a]\n",
        ("exact64",), (SINK_ONLY64,),
        "joint teacher: the sink logit left out of each head's normaliser (window and blocks only)",
    ),
    Mutant(
        "teacher_window_not_causal", "loss", "loss.py",
        "    first = rows[0] - (n - 1)\n",
        "    first = rows[0]\n",
        ("exact64",), (TINY64,),
        "joint teacher: the window read n_win - 1 tokens ahead (a query sees future tokens' keys)",
    ),
    Mutant(
        "teacher_window_crosses_document", "loss", "loss.py",
        "    ok = ((back[:r] >= 0) & (back[:r] < n) & (row_keys[:r] + origin >= 0))[None] & (seg_k == seg_q[..., None])\n",
        "    ok = jnp.broadcast_to(((back[:r] >= 0) & (back[:r] < n) & (row_keys[:r] + origin >= 0))[None], seg_k.shape)\n",
        ("exact64",), (PACKED64,),
        "joint teacher: the window reaches back into the previous document of a packed row",
    ),
    Mutant(
        "teacher_window_off_by_one", "loss", "loss.py",
        "    return min(cfg.sliding_window, seq_len)\n",
        "    return min(cfg.sliding_window + 1, seq_len)\n",
        ("exact64",), (TINY64,),
        "joint teacher: n_win + 1 window tokens (the query token and n_win before it)",
    ),
    Mutant(
        "teacher_normaliser_wrong_heads", "loss", "loss.py",
        "        sink_c = None if sink is None else jax.lax.dynamic_slice_in_dim(sink, i * chunk, chunk)\n",
        "        sink_c = None if sink is None else jax.lax.dynamic_slice_in_dim(sink, 0, chunk)\n",
        ("chunk", "exact64"), (TINY64_TCHUNK,),
        "joint teacher, head-chunked: every chunk's normaliser takes the first chunk's sink logits",
    ),
    Mutant(
        "teacher_compressed_for_joint", "loss", "loss.py",
        '    joint = cfg.teacher_normaliser == "joint"\n',
        "    joint = False\n",
        ("exact64",), (TINY64,),
        "the compressed teacher (each head renormalised over the blocks) computed where the joint "
        "one is asked for (MaxText 0.2.5's teacher)",
    ),
    Mutant(
        "yarn_ramp_reversed", "rope", "rope.py",
        "    return inv_freq * (1 - ramp) + inv_freq / scaling.factor * ramp\n",
        "    return inv_freq * ramp + inv_freq / scaling.factor * (1 - ramp)\n",
        ("exact64",), (YARN64,),
        "YaRN's ramp reversed: the fast pairs interpolated by 1/factor, the slow ones kept",
    ),
    Mutant(
        "yarn_mscale_applied", "rope", "rope.py",
        "    cos, sin = jnp.cos(angle), jnp.sin(angle)\n",
        "    mscale = 1.0 if scaling is None else 0.1 * math.log(scaling.factor) + 1.0\n"
        "    cos, sin = jnp.cos(angle) * mscale, jnp.sin(angle) * mscale\n",
        ("exact64",), (YARN64,),
        "YaRN applied with its attention factor: cos and sin scaled by 0.1 ln(factor) + 1 (DeepSeek-V4 "
        "does not)",
    ),
    Mutant(
        "loss_missing_stop_gradient", "loss", "api.py",
        '    q_latent = round_to(jax.lax.stop_gradient(inputs["q_latent"]), dtype)',
        '    q_latent = round_to(inputs["q_latent"], dtype)',
        ("isolation",), (TINY64,),
        "the stop-gradient on the query latent left out: the loss trains the main model's queries",
    ),
    # ---------------------------------------------------------------- precision (SPEC section 2)
    Mutant(
        "precision_cast_without_rounding", "precision", "precision.py",
        "    if dtype in _LOW and jnp.finfo(x.dtype).nmant > jnp.finfo(dtype).nmant:\n"
        "        x = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=jnp.finfo(dtype).nmant)\n",
        "",
        ("chunk",), (SMALL_BF16_ICHUNK,),
        "a plain astype for every cast down: XLA keeps excess precision inside fusions, so which "
        "bfloat16 roundings happen depends on fusion, and chunked and native differ",
    ),
    # ------------------------------------------------------ beyond the committed cases
    # Each mistake below is invisible on every committed case: with the config field at the one
    # value every case gives it (m = 4, norm_eps = 1e-6, rope_theta = 160000 (a float32 number),
    # head_dim == index_head_dim, loss_scale = 1) the mutated code computes the same numbers,
    # operation for operation. A pinned random problem with another value kills it.
    Mutant(
        "pool_continuation_ratio_hardcoded", "pooling", "pooling.py",
        "    cont = (exists[None, :] & (first == first_prev + m))[:, :, None, None]\n",
        "    cont = (exists[None, :] & (first == first_prev + 4))[:, :, None, None]\n",
        ("exact64",), (),
        "the previous-block test hard-codes DeepSeek-V4's compress ratio 4: for any other m no "
        "block pools its predecessor's `a` slots",
        problems=("chunk_between_d_ne_di",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[chunk_between_d_ne_di]",
    ),
    Mutant(
        "pool_norm_eps_hardcoded", "pooling", "pooling.py",
        "jnp.sqrt(ms + cfg.norm_eps)",
        "jnp.sqrt(ms + 1e-6)",
        ("exact64",), (),
        "the RMSNorm epsilon hard-coded to the default 1e-6 instead of cfg.norm_eps",
        problems=("m1_single_head",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m1_single_head]",
    ),
    Mutant(
        "rope_theta_hardcoded_default", "rope", "rope.py",
        "    inv_freq = theta ** (",
        "    inv_freq = 160000.0 ** (",
        ("exact64",), (),
        "the RoPE base hard-coded to the DeepSeek-V4 default 160000 instead of cfg.rope_theta",
        problems=("m3_prime_heads_packed",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m3_prime_heads_packed]",
    ),
    Mutant(
        "score_causal_ratio_hardcoded", "scoring", "scoring.py",
        "    causal = first[:, None, :] + m <= position_ids[:, :, None] + 1",
        "    causal = first[:, None, :] + 4 <= position_ids[:, :, None] + 1",
        ("exact64",), (),
        "the causal rule hard-codes a block length of 4: for m < 4 complete blocks are masked, "
        "for m > 4 incomplete ones are visible",
        problems=("m1_single_head",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m1_single_head]",
    ),
    Mutant(
        "score_scale_teacher_head_dim", "scoring", "scoring.py",
        "    scores = acc * (di**-0.5)",
        "    scores = acc * (cfg.head_dim**-0.5)",
        ("exact64",), (),
        "the score scaled by head_dim**-0.5 (the teacher's head dim, the usual attention scale) "
        "instead of index_head_dim**-0.5",
        problems=("m1_single_head",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m1_single_head]",
    ),
    Mutant(
        "chunk_wq_columns_teacher_head_dim", "chunking", "scoring.py",
        "            wq = jax.lax.dynamic_slice_in_dim(wq_b, i * (chunk * di), chunk * di, axis=1)",
        "            wq = jax.lax.dynamic_slice_in_dim(wq_b, i * (chunk * cfg.head_dim), chunk * di, axis=1)",
        ("chunk",), (),
        "the head chunk's columns of wq_b start at i * chunk * head_dim (the teacher's head dim) "
        "instead of i * chunk * index_head_dim: the wrong heads' query weights from step 1 on",
        problems=("composite_chunks_w1",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[composite_chunks_w1]",
    ),
    Mutant(
        "loss_scale_dropped", "loss", "loss.py",
        "    return cfg.loss_scale * jnp.sum(kl) / count",
        "    return jnp.sum(kl) / count",
        ("exact64",), (),
        "loss_scale never applied",
        problems=("m3_prime_heads_packed",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m3_prime_heads_packed]",
    ),
    Mutant(
        "precision_rope_theta_float32", "precision", "rope.py",
        "    inv_freq = theta ** (",
        "    inv_freq = jnp.asarray(theta, jnp.float32).astype(wide) ** (",
        ("exact64",), (),
        "the RoPE base held as a float32 number (a config value turned into a default-dtype "
        "array) before the float64 frequency table: wrong in float64 for any base that is not "
        "a float32 number",
        problems=("m1_single_head",),
        killing_test="tests/test_random_configs.py::test_pinned_problem[m1_single_head]",
    ),
    # ------------------------------------------------- the Pallas scoring kernels (jax_impl/kernels)
    # Killed by the `kernel` check (harness.sides.kernel_check: float64 with partial square tiles, where
    # interpret mode reads NaN past the end, and bfloat16 inputs), run by tests/test_pallas.py.
    Mutant(
        "kernel_tile_edge_off_by_one", "scoring", "kernels/scores.py",
        "            row_ok = i * row_tile + jax.lax.broadcasted_iota(jnp.int32, (row_tile, 1), 0) < seq_len\n",
        "            row_ok = i * row_tile + jax.lax.broadcasted_iota(jnp.int32, (row_tile, 1), 0) < seq_len - 1\n",
        ("kernel",), (), "dK kernel: the last query row's edge off by one (row S-1 masked as if past the end)",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_partial_tile_unmasked", "scoring", "kernels/scores.py",
        "            k = jnp.where(block < num_blocks, k.astype(wide), 0).astype(od)\n",
        "            k = k.astype(wide).astype(od)\n",
        ("kernel",), (), "dq/dw kernel: the last, partial key tile not masked: the blocks past W (garbage "
        "on TPU, NaN in interpret mode) enter the sums over key blocks",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_head_loop_bound", "scoring", "kernels/scores.py",
        "    groups, rest = divmod(heads, u)\n",
        "    groups, rest = divmod(heads - 1, u)\n",
        ("kernel",), (), "every kernel's head loop stops one head short: the last head never contributes",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_accumulate_input_dtype", "scoring", "kernels/scores.py",
        "            acc_ref[...] += term(h, logits)\n",
        "            acc_ref[...] = (acc_ref[...] + term(h, logits)).astype(q_ref.dtype).astype(wide)\n",
        ("kernel",), (), "forward kernels (the scores, the teacher's head sum): the head sum accumulated in "
        "the input dtype (bfloat16 for bfloat16 q), not float32",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_dk_tile_transposed", "scoring", "kernels/scores.py",
        "        gt = g_ref[...].astype(wide).T  # [tw, ts]\n",
        "        gt = g_ref[...].astype(wide)  # [tw, ts]\n",
        ("kernel",), (), "dK kernel: the [ts, tw] cotangent tile used untransposed (the shapes agree "
        "when the tiles are square)",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_dq_missing_head_weight", "scoring", "kernels/scores.py",
        "            dq_ref[h] = (mk * w_ref[h]).T.astype(dq_ref.dtype)\n",
        "            dq_ref[h] = mk.T.astype(dq_ref.dtype)\n",
        ("kernel",), (), "dq kernel: the head weight w[b,s,h] left out of dq",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_teacher_keep_ignored", "loss", "kernels/scores.py",
        "term, lambda acc: jnp.where(g_ref[...] > 0, acc.T, 0),\n",
        "term, lambda acc: acc.T,\n",
        ("kernel",), (), "teacher head-sum kernel: the entries the loss does not keep, inside a live tile, "
        "written with their probabilities instead of 0",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_teacher_sum_unshifted", "loss", "kernels/scores.py",
        "                acc_ref[h] += jnp.sum(jnp.exp(a - shift_ref[h]), axis=0, keepdims=True)\n",
        "                acc_ref[h] += jnp.sum(jnp.exp(a), axis=0, keepdims=True)\n",
        ("kernel",), (), "teacher normaliser kernel: the sum of exp without the row's max subtracted, so the "
        "normaliser no longer matches the shift the probabilities subtract",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    Mutant(
        "kernel_skips_a_partly_valid_tile", "scoring", "kernels/scores.py",
        "    return _table(jnp.any(padded.reshape(b, nr, tiles.rows, nk, tiles.keys), axis=(2, 4)), tiles)\n",
        "    return _table(jnp.all(padded.reshape(b, nr, tiles.rows, nk, tiles.keys), axis=(2, 4)), tiles)\n",
        ("kernel",), (), "tile skipping: a tile is live only when every entry is valid, so the tiles on the "
        "causal diagonal and at a document boundary are skipped with valid entries in them",
        kernel=True, killing_test="tests/test_pallas.py",
    ),
    # ------------------------------------------- the sequence split over devices (jax_impl.sharded)
    Mutant(
        "seq_halo_missing", "pooling", "sharded.py",
        "        return kv_a, gate_a, first, jax.lax.axis_index(lay.seq) > 0\n",
        "        return kv_a, gate_a, first, jax.lax.axis_index(lay.seq) > lay.p\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: no pooling halo, block 0 of every device pooled as if it started the "
        "sequence (the previous device's `a` slots dropped)",
        killing_test="tests/sharded/test_sharded.py",
    ),
    Mutant(
        "seq_halo_wrong_neighbour", "pooling", "sharded.py",
        "    return jax.lax.ppermute(x, lay.seq, [(i, i + hops) for i in range(lay.p - hops)])\n",
        "    return jax.lax.ppermute(x, lay.seq, [(i + hops, i) for i in range(lay.p - hops)])\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: the halos (pooling and window) received from the NEXT device instead "
        "of the previous one",
        killing_test="tests/sharded/test_sharded.py",
    ),
    Mutant(
        "seq_halo_ignores_document", "pooling", "pooling.py",
        "        first_prev = jnp.concatenate([first_h[:, None], first[:, :-1]], axis=1)\n",
        "        first_prev = jnp.concatenate([first[:, :1] - m, first[:, :-1]], axis=1)\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: the halo block from the previous device always taken to continue the "
        "document (SPEC section 5's boundary rule not applied to it)",
        killing_test="tests/sharded/test_sharded.py",
    ),
    Mutant(
        "seq_loss_count_per_device", "loss", "query_blocks.py",
        "    total = _apply(shard.sum_rows, jnp.sum(kl))\n"
        "    count = _apply(shard.sum_rows, jnp.sum(valid_tok))\n"
        "    return cfg.loss_scale * total / jnp.maximum(count, 1).astype(wide)\n",
        "    total = jnp.sum(kl) / jnp.maximum(jnp.sum(valid_tok), 1).astype(wide)\n"
        "    count = _apply(shard.sum_rows, jnp.ones((), wide))\n"
        "    return cfg.loss_scale * _apply(shard.sum_rows, total) / count\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: the loss's count of valid rows not summed over the devices: each "
        "device divides its own KL sum by its own count and the devices' means are averaged "
        "(the same on one device; wrong wherever devices hold different counts)",
        killing_test="tests/sharded/test_sharded.py",
    ),
    Mutant(
        "seq_positions_not_offset", "loss", "sharded.py",
        "        origin = jax.lax.axis_index(lay.seq) * rows - h  # the token index of ext row 0\n",
        "        origin = -h  # the token index of ext row 0\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: a device's token indices not offset by its place in the sequence "
        "(every device takes its rows for tokens 0..L-1, so its window's halo rows count as before "
        "the sequence)",
        killing_test="tests/sharded/test_sharded.py",
    ),
    Mutant(
        "seq_keys_cotangent_not_returned", "scoring", "sharded.py",
        "    return jax.lax.all_gather(x, lay.seq, axis=1, tiled=True)\n",
        "    full = jax.lax.all_gather(jax.lax.stop_gradient(x), lay.seq, axis=1, tiled=True)\n"
        "    return jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index(lay.seq) * x.shape[1], axis=1)\n",
        ("exact64", "chunk"), (EDGES64_SEQ4,),
        "context parallelism: the gathered keys' cotangent not returned to the device that pooled "
        "each block (only the owner's own queries train its keys)",
        killing_test="tests/sharded/test_sharded.py",
    ),
    # ------------------------------------- the quantization-aware indexer (SPEC section 7a)
    # The mistakes shipped quantized indexers made. No committed case quantizes: each is killed
    # by `exact64` on the pinned problem with DeepSeek-V4's preset in miniature (e2m1, rotated,
    # two blocks per head, head and query chunks, packed, sparse), live against torch.
    *(Mutant(name, "quantization", module, old, new, ("exact64",), (), mistake, more=more,
             problems=("quant_e2m1_rotated",),
             killing_test="tests/test_random_configs.py::test_pinned_problem[quant_e2m1_rotated]")
      for name, module, old, new, mistake, more in (
        ("quant_keys_unrotated", "scoring.py",
         "    k_hat, codes, scales = quantize_for_scoring(keys, cfg.index_quant, wide, imposed)\n",
         "    k_hat, codes, scales = quantize_for_scoring(\n"
         "        keys, type(cfg.index_quant)(cfg.index_quant.format, cfg.index_quant.block, False), wide, imposed)\n",
         "the queries rotated, the keys not (a fused key kernel that skips the Hadamard)", ()),
        ("quant_rotation_unscaled", "quant.py",
         "h) * (di**-0.5), x.dtype)", "h), x.dtype)",
         "the Hadamard rotation without its DI**-0.5: not orthogonal, every x_hat sqrt(DI) times "
         "too large", ()),
        ("quant_scale_nearest_power_of_two", "quant.py",
         "    return jnp.where(mant == 0.5, a, jnp.ldexp(jnp.ones_like(a), exp))\n",
         "    return jnp.where(mant < 0.75, jnp.ldexp(jnp.ones_like(a), exp - 1), jnp.ldexp(jnp.ones_like(a), exp))\n",
         "the UE8M0 scale rounded to the nearest power of two instead of up: a block's largest "
         "values then exceed Qmax and are clipped", ()),
        ("quant_blocks_across_heads", "quant.py",
         "    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.asarray(fmt.tiny, wide))\n",
         "    amax = jnp.maximum(jnp.broadcast_to(jnp.max(jnp.abs(blocks), axis=(-1, -3), keepdims=True)[..., 0],\n"
         "                                        blocks.shape[:-1]), jnp.asarray(fmt.tiny, wide))\n",
         "a block's scale taken over the same channels of every head (every key block) instead of "
         "along one head's channels", ()),
        ("quant_straight_through_dropped", "quant.py",
         "    scored = jax.lax.stop_gradient(x_hat) + (xw - jax.lax.stop_gradient(xw))\n",
         "    scored = jax.lax.stop_gradient(x_hat)\n",
         "no straight-through gradient: the quantized values are constants, the query and key "
         "parameters get a zero gradient", ()),
        ("quant_true_rounding_derivative", "quant.py",
         "    xw = jax.lax.stop_gradient(x).astype(wide)\n",
         "    xw = x.astype(wide)\n",
         "the rounding's own derivative (0 almost everywhere) in place of the straight-through "
         "identity",
         (("    scored = jax.lax.stop_gradient(x_hat) + (xw - jax.lax.stop_gradient(xw))\n",
           "    scored = x_hat\n"),)),
        ("quant_dequantize_without_scale", "quant.py",
         "    return codes * per_channel, codes, scales\n", "    return codes, codes, scales\n",
         "the codes scored without their block scale", ()),
      )),
    # Round half away from zero (C's round(), a float8 cast written by hand): only a value exactly
    # on a midpoint tells it from half to even, and only the planted case puts values there, exact
    # in every dtype. The codes' `oracle` check excuses no tie where the value is exact
    # (harness.judging.codes), so it kills it in float64 here and in every dtype in the matrix.
    Mutant("quant_round_half_away", "quantization", "quant.py",
           "    return jnp.sign(v) * (jnp.round(mag / spacing) * spacing)\n",
           "    return jnp.sign(v) * (jnp.floor(mag / spacing + 0.5) * spacing)\n",
           ("oracle",), (PLANTED64,),
           "codes rounded half away from zero instead of half to even: every value on a midpoint "
           "takes the larger neighbour"),
)


# Mistakes only length shows (SPEC section 11): each passes its toy slice (`points`, the matrix's
# fixtures) and fails the long case's query block (`long_blocks`, judged live against torch's
# row-block reference). `python -m harness.selftest.mutations --length` runs each both ways and
# prints both outcomes.
LONG_LAST_BLOCK = "long_deep_documents:68"  # rows 129200 .. 131071: row * W offsets past 2^31
# rows 127300 .. 129199: 1375 of them, late in a 4096-token document, see more blocks than k = 512
# (up to 1024: in the last block every row sees fewer than k, so every valid block is picked whatever
# the ranking), then a document starts at 128675.
LONG_RANKED_BLOCK = "long_deep_documents:67"
LENGTH_CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "pick_ids_in_bfloat16", "scoring", "scoring.py",
        "    return jnp.where(picked_valid, idx, -1).astype(jnp.int32)\n",
        "    return jnp.where(picked_valid, idx, -1).astype(jnp.bfloat16).astype(jnp.int32)\n",
        ("topk", "chunk-topk", "invariants"), (TINY64, PACKED64, SMALL_BF16_ICHUNK),
        "the picked block ids pass through bfloat16 (a count or an index in a narrow float): exact up to 256, "
        "so every toy problem (W <= 16) is untouched; past 256 blocks ids round to the nearest multiple of "
        "2, 4, ..., 128 and rows pick blocks they never scored",
        long_blocks=(LONG_LAST_BLOCK,)),
    Mutant(
        "valid_count_in_bfloat16", "scoring", "scoring.py",
        "    picked_valid = jnp.take_along_axis(valid, idx, axis=-1)\n",
        "    picked_valid = jnp.arange(k_eff) < jnp.sum(valid, axis=-1, dtype=jnp.bfloat16)[..., None]\n",
        ("topk", "chunk-topk", "invariants"), (TINY64, PACKED64, SMALL_BF16_ICHUNK),
        "a pick is -1 where its rank is not below the row's count of valid blocks (a sound rule: -inf sorts "
        "last), the count summed as bfloat16 (the mask in the activations' dtype of a bfloat16 deployment; "
        "the rank is promoted with it): exact up to 256, so no toy row (at most 16 blocks) is touched; a row "
        "with 257 .. 514 valid blocks and k = 512 is wrong for 130 of those counts (0 or 1 mod 4 up to 509, "
        "and 512 .. 514): it drops its last one or two valid picks",
        long_blocks=(LONG_LAST_BLOCK,)),
    Mutant(
        "topk_ranked_in_bfloat16", "scoring", "scoring.py",
        "    _, idx = jax.lax.top_k(jax.lax.stop_gradient(masked_scores), k_eff)\n",
        "    _, idx = jax.lax.top_k(jax.lax.stop_gradient(masked_scores).astype(jnp.bfloat16), k_eff)\n",
        ("topk",), (TINY64, PACKED64, SMALL_BF16_ICHUNK, TIES64),
        "the top-k ranks the scores by a 16-bit key (each float32 score rounded to bfloat16, as a one-pass "
        "histogram select over the high half of the bits does), ties inside a bin broken by block index: "
        "with at most 16 blocks a row, no toy row of the slice has two scores at its boundary in one bin "
        "(the `ties` case's twins tie exactly either way); among up to 1024 blocks the k-th score's bin "
        "holds several, and a row keeps a block scored up to a bfloat16 step (2^-8 relative) below one it "
        "drops",
        long_blocks=(LONG_RANKED_BLOCK,)),
    Mutant(
        "window_picks_not_shifted", "chunking", "query_blocks.py",
        "    return topk if width == w else jnp.where(topk >= 0, topk + lo, -1)\n",
        "    return topk if width == w else jnp.where(topk >= 0, topk, -1)\n",
        ("topk", "invariants"), (TINY64, PACKED64, SMALL_BF16_ICHUNK, TINY64_QCHUNK),
        "a query block scored in a key window hands back its picks as ids within the window, not shifted "
        "by the window's first block (a local top-k id aliased into other blocks: the rows pick blocks of "
        "earlier documents they never scored); no toy problem has a window (W < 4 x max(key_window, k)), "
        "so only a long one runs the line",
        long_blocks=(LONG_LAST_BLOCK,)),
)


class MutationError(RuntimeError):
    """A catalogue entry that no longer matches the source, or a worker that did not report."""


@dataclasses.dataclass
class Outcome:
    name: str
    passed: bool  # no check failed (a mutant that passes SURVIVED)
    killing: tuple[str, ...]  # names of the failed checks
    failed: list[dict]
    checks: int
    seconds: float
    cpu_s: float = 0.0  # CPU time of the worker process (all threads)
    error: str = ""  # the worker crashed (the mutated code raised): reported as check "crash"


def patch_copy(mutant: Mutant | None, dst: Path, src: Path | None = None) -> Path:
    """Copy `src` (default: this checkout's jax_impl) to dst/jax_impl and apply the mutant's
    edits there. Raises MutationError when an `old` text does not occur exactly once."""
    src = src or REPO_ROOT / PACKAGE
    target = Path(dst) / PACKAGE
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if mutant is not None:
        apply_edits(target / mutant.module, mutant.name, mutant.edits, f"{PACKAGE}/{mutant.module}",
                    "harness/selftest/mutations.py")
    return target


def apply_edits(path: Path, name: str, edits, shown: str, catalogue: str) -> None:
    """Apply a mutant's (old, new) text edits to the file at `path` (named `shown` in errors).
    Each `old` must occur exactly once: a stale catalogue (`catalogue`) fails loudly, it never
    silently tests nothing."""
    if not path.is_file():
        raise MutationError(f"mutant {name!r}: {shown} does not exist")
    text = path.read_text()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise MutationError(
                f"mutant {name!r}: its `old` text occurs {n} times in {shown} "
                f"(expected exactly once): the catalogue is stale, update {catalogue}: {old!r}")
        text = text.replace(old, new)
    path.write_text(text)


# What the fork server imports once, so that each mutant's process starts with them: everything
# the worker needs except jax_impl, which every child imports from its own copy. Importing jax
# does not start its backend (no threads, no devices), so forking after it is safe.
PRELOAD = ("numpy", "jax", "harness.judging.compare", "harness.judging.judge", "harness.problems.matrix", "harness.outputs",
           "harness.selftest.mutation_worker")


def default_method() -> str:
    """`forkserver` (a child forked per mutant from a server holding PRELOAD: ~2 s less per
    mutant) where the platform has it, else `subprocess` (`python -m harness.selftest.mutation_worker`)."""
    import multiprocessing

    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "subprocess"


def _run_forked(impl_root: Path, points, memory: bool, cache_dir, timeout: float, problems=(),
                kernel: bool = False, stop_on=()) -> dict:
    import multiprocessing

    from .mutation_worker import forked

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # used when the server starts (first call)
    parent, child = ctx.Pipe(duplex=False)
    kwargs = dict(impl_root=str(impl_root), points=[p.spec() for p in points], memory=memory,
                  cache_dir=str(cache_dir) if cache_dir else None, problems=list(problems), kernel=kernel,
                  stop_on=list(stop_on))
    proc = ctx.Process(target=forked, args=(child, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise MutationError(f"mutation worker gave no report within {timeout:.0f} s")
        status, payload = parent.recv()
    except EOFError:
        proc.join(5)
        raise MutationError(f"mutation worker died (exit code {proc.exitcode}) without a report") from None
    finally:
        if proc.is_alive():
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
    if status != "ok":
        raise MutationError(f"mutation worker raised:\n{payload}")
    return payload


def stop_forkserver() -> None:
    """Stop and reap the fork server this process started, if any (so its CPU time, and its
    children's, is accounted to this process, and nothing is left behind)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own (used by its tests)
    if stop is not None:
        stop()


def _run_subprocess(impl_root: Path, points, memory: bool, cache_dir, timeout: float, problems=(),
                    kernel: bool = False, stop_on=(), long_blocks=()) -> dict:
    cmd = [sys.executable, "-m", "harness.selftest.mutation_worker", "--impl-root", str(impl_root)]
    for p in points:
        cmd += ["--point", p.spec()]
    for spec in long_blocks:
        cmd += ["--long-block", spec]
    for name in problems:
        cmd += ["--problem", name]
    if memory:
        cmd.append("--memory")
    if kernel:
        cmd.append("--kernel")
    for check in stop_on:
        cmd += ["--stop-on", check]
    if cache_dir:
        cmd += ["--cache-dir", str(cache_dir)]
    env = dict(os.environ, JAX_ENABLE_X64="1")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise MutationError(f"mutation worker exited {proc.returncode} without a report; stderr tail:\n"
                            + proc.stderr[-3000:])
    return json.loads(lines[-1])


def run_worker(impl_root: Path, points, memory: bool, cache_dir: str | os.PathLike | None = None,
               timeout: float = 600.0, method: str | None = None, problems: tuple[str, ...] = (),
               kernel: bool = False, stop_on=()) -> dict:
    """Run the worker (harness/selftest/mutation_worker.py) on the jax_impl copy under impl_root in a
    process of its own; its report. `cache_dir`: a JAX persistent compilation cache shared
    by the workers of one run. `method`: `forkserver` or `subprocess` (default_method()).
    `stop_on`: check names at whose first failure the slice stops (mutation_worker.run)."""
    method = method or default_method()
    if method == "forkserver":
        report = _run_forked(Path(impl_root), points, memory, cache_dir, timeout, problems, kernel, stop_on)
    elif method == "subprocess":
        report = _run_subprocess(Path(impl_root), points, memory, cache_dir, timeout, problems, kernel, stop_on)
    else:
        raise ValueError(f"method={method!r} is not supported (valid: forkserver, subprocess)")
    imported = os.path.realpath(report["jax_impl_file"])
    if not imported.startswith(os.path.realpath(impl_root) + os.sep):
        raise MutationError(f"the worker imported jax_impl from {imported}, not from the copy in {impl_root}")
    return report


def _outcome(name: str, report: dict, seconds: float) -> Outcome:
    failed = report["failed"]
    killing = tuple(sorted({f["check"] for f in failed}))
    return Outcome(name, not failed, killing, failed, report["checks"], seconds,
                   report.get("cpu_s", 0.0), report.get("error", ""))


def run_length_mutant(mutant: Mutant, cache_dir=None) -> tuple[Outcome, Outcome]:
    """(toy outcome, long outcome) of a LENGTH_CATALOGUE mutant: its matrix slice alone, then its
    long query blocks alone, each in a process of its own on one mutated copy."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        patch_copy(mutant, Path(tmp))
        toy = _outcome(mutant.name, run_worker(Path(tmp), mutant.points, False, cache_dir, method="subprocess"),
                       time.time() - start)
        start = time.time()
        report = _run_subprocess(Path(tmp), (), False, cache_dir, 1800.0, long_blocks=mutant.long_blocks)
    return toy, _outcome(mutant.name, report, time.time() - start)


def run_length_clean(long_blocks, cache_dir=None) -> Outcome:
    """The long query blocks `long_blocks` ("CASE:BLOCK") on an unmutated copy, in a process of its
    own: they must pass, so a long block that fails a mutant fails because of its mutation."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="mutant-clean-") as tmp:
        patch_copy(None, Path(tmp))
        report = _run_subprocess(Path(tmp), (), False, cache_dir, 1800.0, long_blocks=tuple(long_blocks))
    return _outcome("clean", report, time.time() - start)


def run_mutant(mutant: Mutant, cache_dir=None, method: str | None = None, stop_at_kill: bool = False) -> Outcome:
    """Apply the mutant to a temporary copy of jax_impl and run its slice there. `stop_at_kill`:
    stop the slice once one of the mutant's expected checks (`killed_by`) has failed, which
    settles what its test asserts (killed, and for the expected reason) without the slice's
    later stages; the kill table runs the whole slice, to show every check that kills."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        patch_copy(mutant, Path(tmp))
        report = run_worker(Path(tmp), mutant.points, mutant.memory, cache_dir, method=method,
                            problems=mutant.problems, kernel=mutant.kernel,
                            stop_on=mutant.killed_by if stop_at_kill else ())
    return _outcome(mutant.name, report, time.time() - start)


def slices(catalogue=CATALOGUE) -> tuple[tuple[Point, ...], bool]:
    """Every point and whether any mutant uses the memory check: what the clean run covers."""
    points = sorted({p for m in catalogue for p in m.points})
    return tuple(points), any(m.memory for m in catalogue)


def problem_slices(catalogue=CATALOGUE) -> tuple[str, ...]:
    """Every pinned random problem some mutant runs: what the clean run covers as well."""
    return tuple(sorted({p for m in catalogue for p in m.problems}))


def run_clean(points, memory: bool, cache_dir=None, method: str | None = None,
              problems: tuple[str, ...] = (), kernel: bool = False) -> Outcome:
    """The same machinery on an unmutated copy: must pass."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="mutant-clean-") as tmp:
        patch_copy(None, Path(tmp))
        report = run_worker(Path(tmp), points, memory, cache_dir, method=method, problems=problems,
                            kernel=kernel)
    return _outcome("clean", report, time.time() - start)


def _table(rows) -> str:
    return _table_with(("mutant", "stage", "killed", "killing checks", "expected", "killing test", "wall s", "cpu s"),
                       rows)


def _table_with(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def select(catalogue, only: str | None, patch) -> list:
    """The mutants a command line asks for (`--only a,b`; None: all), each patched once into a
    scratch copy with `patch(mutant, dir)` so that a stale entry fails before anything runs.
    An unknown name is a MutationError naming the valid ones."""
    chosen = list(catalogue)
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = {m.name: m for m in catalogue}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise MutationError(f"unknown mutant(s) {unknown} (valid: {', '.join(known)})")
        chosen = [known[n] for n in names]
    for m in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            patch(m, Path(tmp))
    return chosen


RETARGETED_CHECKS = {"exact64": "oracle", "exact64@sel": "oracle@sel"}


def retarget(catalogue, dtype: str) -> tuple[list[Mutant], list[tuple[str, str]]]:
    """The mutants of `catalogue` with every float64 point moved to `dtype` and their expected
    checks moved with it (exact64 -> oracle), and (name, why) of those that cannot move: they
    need torch (pinned random problems), the compile-only memory check, the Pallas kernels or
    simulated devices (a mesh)."""
    out, left_out = [], []
    for m in catalogue:
        why = ("its pinned random problems run live against torch" if m.problems else
               "its memory check reads the CPU's compiled memory" if m.memory else
               "its kernel check is the Pallas kernels'" if m.kernel else
               "its slice runs on simulated devices" if any(p.mesh for p in m.points) else
               "its slice is on the Pallas backend" if any(p.backend != "xla" for p in m.points) else None)
        if why:
            left_out.append((m.name, why))
            continue
        points = tuple(dataclasses.replace(p, dtype=dtype) if p.dtype == "float64" else p for p in m.points)
        killed_by = tuple(dict.fromkeys(RETARGETED_CHECKS.get(c, c) for c in m.killed_by))
        out.append(dataclasses.replace(m, points=points, killed_by=killed_by))
    return out, left_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.selftest.mutations", description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutant names (default: all)")
    ap.add_argument("--jobs", type=int, default=usable_cpus(), help="parallel workers (default: the CPUs this process may use)")
    ap.add_argument("--no-clean", action="store_true", help="skip the clean (unmutated) run")
    ap.add_argument("--json", help="also write the outcomes to this file")
    ap.add_argument("--method", choices=["forkserver", "subprocess"], help="default: forkserver where available")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="run every float64 slice in this dtype instead (a device without float64, a TPU: the "
                         "oracle rule, under the device's platform profile, must kill what exact64 kills on a "
                         "CPU); mutants that need torch, the memory check, the kernels or simulated devices are "
                         "left out, each named")
    ap.add_argument("--length", action="store_true",
                    help="the mistakes only length shows (LENGTH_CATALOGUE): each on its toy slice and on its long "
                         "query blocks, both outcomes printed, then the long blocks unmutated (unless --no-clean)")
    args = ap.parse_args(argv)
    try:
        chosen = select(LENGTH_CATALOGUE if args.length else CATALOGUE, args.only, patch_copy)
    except MutationError as exc:
        print(f"harness.selftest.mutations: error: {exc}", file=sys.stderr)
        return 2
    if args.length:
        rows, ok = [], True
        for m in chosen:
            toy, long = run_length_mutant(m)
            expected = toy.passed and not long.passed and bool(set(m.killed_by) & set(long.killing))
            ok &= expected
            rows.append((m.name, m.stage, f"{'passes' if toy.passed else 'KILLED by ' + ','.join(toy.killing)} "
                         f"({len(toy.failed)} of {toy.checks} checks failed)",
                         f"{','.join(long.killing) or 'SURVIVED'} ({len(long.failed)} of {long.checks} checks failed)",
                         f"{toy.seconds:.1f}", f"{long.seconds:.1f}"))
            for f in toy.failed[:2]:
                print(f"  {m.name} toy:", f["message"][:300])
            for f in long.failed[:2]:
                print(f"  {m.name} long:", f["message"][:300])
        print(_table_with(("mutant", "stage", "toy matrix", "long block", "toy s", "long s"), rows))
        if not args.no_clean:  # the long blocks must pass unmutated (the toy slices are the matrix's own)
            blocks = sorted({b for m in chosen for b in m.long_blocks})
            clean = run_length_clean(blocks)
            ok &= clean.passed
            print(f"clean long blocks {', '.join(blocks)}: {'pass' if clean.passed else 'FAIL'} "
                  f"({len(clean.failed)} of {clean.checks} checks failed, {clean.seconds:.1f} s)")
            for f in clean.failed[:10]:
                print("  FAIL", f["message"][:300])
        return 0 if ok else 1
    if args.dtype:
        chosen, left_out = retarget(chosen, args.dtype)
        for name, why in left_out:
            print(f"left out: {name}: {why}")
        if not chosen:
            print("harness.selftest.mutations: error: no mutant of the selection runs in --dtype "
                  f"{args.dtype}", file=sys.stderr)
            return 2
    start = time.time()
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="mutation-xla-cache-") as cache, \
            cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {}
        if not args.no_clean:  # first: it compiles the programs most mutants leave unchanged
            points, memory = slices(chosen)
            futures[pool.submit(run_clean, points, memory, cache, args.method,
                                problem_slices(chosen), any(m.kernel for m in chosen))] = "clean"
        futures.update({pool.submit(run_mutant, m, cache, args.method): m.name for m in chosen})
        for fut in cf.as_completed(futures):
            outcomes[futures[fut]] = fut.result()
    stop_forkserver()
    wall = time.time() - start
    rows, killed = [], 0
    for m in chosen:
        o = outcomes[m.name]
        ok = not o.passed and bool(set(m.killed_by) & set(o.killing))
        killed += not o.passed
        verdict = "yes" if ok else ("SURVIVED" if o.passed else "yes (unexpected checks)")
        rows.append((m.name, m.stage, verdict, ",".join(o.killing) or "-", ",".join(m.killed_by),
                     m.killing_test, f"{o.seconds:.1f}", f"{o.cpu_s:.1f}"))
    print(_table(rows))
    print()
    rate = killed / max(len(chosen), 1)
    cpu = sum(o.cpu_s for o in outcomes.values())
    print(f"kill rate: {killed}/{len(chosen)} = {100 * rate:.0f}%  (wall {wall:.1f} s with {args.jobs} jobs; "
          f"worker CPU {cpu:.1f} s, method {args.method or default_method()})")
    clean_ok = True
    if "clean" in outcomes:
        c = outcomes["clean"]
        clean_ok = c.passed
        print(f"clean run: {'pass' if c.passed else 'FAIL'} ({c.checks} checks, {c.seconds:.1f} s, "
              f"cpu {c.cpu_s:.1f} s)")
        for f in c.failed[:10]:
            print("  FAIL", f["message"])
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": wall, "kill_rate": rate, "outcomes": [
            dataclasses.asdict(o) for o in outcomes.values()]}, indent=1))
    all_expected = all(r[2] == "yes" for r in rows)
    return 0 if (all_expected and clean_ok) else 1


if __name__ == "__main__":
    sys.exit(main())

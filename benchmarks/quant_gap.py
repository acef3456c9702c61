"""What quantizing the indexer changes, at the released model's indexer shape (SPEC section 7a).

    python -m benchmarks.quant_gap                  # S = 8192, float32: recall, loss, gradients
    python -m benchmarks.quant_gap --s 16384
    python -m benchmarks.quant_gap --memory-only    # the S = 131072 memory bound, compile-only

The problem: B = 1, S tokens, an indexer of HI = 64 heads of DI = 128 (DR = 64, m = 4, so
W = S / 4 blocks), top-k k = 512, E = R = 256, a joint teacher of H = 16 heads of D = 128 with
DeepSeek-V4's 128-token window and per-head sinks; seeded normal weights and inputs. The same
problem is scored three ways, differing only in `index_quant`:

  none   the unquantized indexer
  fp4    DeepSeek-V4's: e2m1, blocks of 32, Hadamard-rotated
  fp8    DeepSeek-V3.2's: e4m3, blocks of 128, Hadamard-rotated

Printed, for fp4 and fp8 against none: recall at k (of each query's valid top-k picks, the share
the quantized indexer keeps), over every query and over the queries that have more than k
visible blocks (the others pick every block, so their recall is 1 by construction); the dense
and sparse losses and their relative difference; per parameter the gradient's relative
difference ||g_q - g|| / ||g|| and cosine. float32 (the training dtype of the wide sums), head
chunk 8 and query chunk 512 (jax_impl's memory-lean path), compiled and run on the CPU.

`--memory-only` (also run after the figures) compiles, without running, the dense and the sparse
loss gradient at S = 131072 on `make bench`'s query-sweep problem (H = 64, no window) with head
chunk 1 and query chunk 128 (the setting that meets docs/benchmarks.md's 2 GiB bound unquantized) for each of the three, and prints PASS or FAIL
against the same 2 GiB: quantization must not cost the memory that chunking saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

import jax_impl
from benchmarks.memory_speed import GIB, LONG_BOUND_GIB, LONG_SEQ, compiled_temp_bytes, query_config

SHAPES = dict(emb_dim=256, q_lora_rank=256, index_n_heads=64, index_head_dim=128, rope_head_dim=64,
              compress_ratio=4, index_topk=512, num_query_heads=16, head_dim=128, sliding_window=128,
              indexer_head_chunk=8, loss_head_chunk=4, query_chunk=512)
PRESETS = {
    "none": None,
    "fp4": {"format": "e2m1", "block": 32, "hadamard": True},
    "fp8": {"format": "e4m3", "block": 128, "hadamard": True},
}
MEMORY_R = 128


def problem(seq: int, seed: int = 0):
    """(params, inputs) of the module doc's problem, float32 numpy."""
    rng = np.random.default_rng(seed)
    c = SHAPES
    e, r, hi, di, m, h, d = (c["emb_dim"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"],
                             c["compress_ratio"], c["num_query_heads"], c["head_dim"])

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {"indexer.wkv": normal(e, 2 * di, scale=e**-0.5), "indexer.wgate": normal(e, 2 * di, scale=e**-0.5),
              "indexer.ape": normal(m, 2 * di, scale=0.5), "indexer.kv_norm": 1 + normal(di, scale=0.1),
              "indexer.wq_b": normal(r, hi * di, scale=r**-0.5), "indexer.weights_proj": normal(e, hi, scale=e**-0.5)}
    inputs = {"hidden_states": normal(1, seq, e), "q_latent": normal(1, seq, r),
              "position_ids": np.arange(seq, dtype=np.int32)[None], "segment_ids": np.ones((1, seq), np.int32),
              "teacher_query": normal(1, seq, h, d, scale=d**-0.5 * 2.0), "teacher_kv": normal(1, seq // m, d),
              "teacher_window_kv": normal(1, seq, d), "attention_sink": normal(h)}
    return params, inputs


def recall(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per query [B, S]: the share of `base`'s valid picks that `other` also picks (nan: none)."""
    b, s, _ = base.shape
    out = np.full((b, s), np.nan)
    for i in range(b):
        for j in range(s):
            picks = base[i, j][base[i, j] >= 0]
            if picks.size:
                out[i, j] = np.isin(picks, other[i, j]).mean()
    return out


def figures(seq: int, seed: int) -> None:
    params, inputs = problem(seq, seed)
    W, k = seq // SHAPES["compress_ratio"], SHAPES["index_topk"]
    print(f"problem: B=1, S={seq}, W={W}, HI=64, DI=128, k={k}, H=16, D=128, n_win=128, float32, "
          f"head chunk 8, query chunk 512")
    runs = {}
    for name, quant in PRESETS.items():
        t0 = time.perf_counter()
        out = {}
        for sparse in (False, True):
            cfg = jax_impl.CSAConfig(**SHAPES, index_quant=quant, sparse_loss=sparse)
            if not sparse:
                jax_impl.validate_inputs(params, inputs, cfg)
                out["topk"] = np.asarray(jax_impl.indexer_forward(params, inputs, cfg, "float32")["topk_indices"])
            loss, grads, _ = jax_impl.indexer_loss_and_grads(params, inputs, cfg, "float32")
            mode = "sparse" if sparse else "dense"
            out[f"loss.{mode}"] = float(loss)
            out[f"grad.{mode}"] = {p: np.asarray(g, np.float64).ravel() for p, g in grads.items()}
        runs[name] = out
        print(f"  {name}: forward and both losses with gradients in {time.perf_counter() - t0:.1f} s")
    # Queries with more than k visible blocks: block j is visible to query s when 4j + 4 <= s + 1.
    visible = (np.arange(seq) + 1) // SHAPES["compress_ratio"]
    choosing = visible > k
    base = runs["none"]
    for name in ("fp4", "fp8"):
        r = recall(base["topk"], runs[name]["topk"])[0]
        rc = r[choosing]
        print(f"{name} ({PRESETS[name]['format']}, block {PRESETS[name]['block']}, rotated) vs unquantized:")
        print(f"  recall at k={k}: mean {np.nanmean(r):.4f} over {np.sum(~np.isnan(r))} queries; over the "
              f"{rc.size} queries with more than k visible blocks: mean {rc.mean():.4f}, min {rc.min():.4f}, "
              f"share below 0.9 {np.mean(rc < 0.9):.3f}")
        for mode in ("dense", "sparse"):
            lq, lb = runs[name][f"loss.{mode}"], base[f"loss.{mode}"]
            print(f"  {mode} loss: unquantized {lb:.5f}, {name} {lq:.5f} (relative difference "
                  f"{abs(lq - lb) / abs(lb):.2e})")
            for p in jax_impl.PARAM_NAMES:
                gq, gb = runs[name][f"grad.{mode}"][p], base[f"grad.{mode}"][p]
                rel = np.linalg.norm(gq - gb) / np.linalg.norm(gb)
                cos = float(gq @ gb / (np.linalg.norm(gq) * np.linalg.norm(gb)))
                print(f"    {mode} grad {p:<22} relative difference {rel:.3e}, cosine {cos:.5f}")


def memory() -> bool:
    """The S = 131072 bound with quantization on: PASS or FAIL per preset and loss mode."""
    ok = True
    print(f"memory: S={LONG_SEQ}, head chunk 1, query chunk {MEMORY_R}, float32, compile-only "
          f"(effective temp = XLA temp + YNN scratch)")
    for name, quant in PRESETS.items():
        for sparse in (False, True):
            cfg = dataclasses.replace(query_config(MEMORY_R, sparse), index_quant=quant)
            e = compiled_temp_bytes(cfg, 1, LONG_SEQ)["effective"]
            passed = e <= LONG_BOUND_GIB * GIB
            ok &= passed
            print(f"  {'PASS' if passed else 'FAIL'} {name:<4} {'sparse' if sparse else 'dense':<6} "
                  f"temp {e / GIB:.3f} GiB <= {LONG_BOUND_GIB} GiB")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s", type=int, default=8192, help="sequence length of the figures (default 8192)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-only", action="store_true", help="only the compile-only memory bound")
    args = ap.parse_args(argv)
    if not args.memory_only:
        figures(args.s, args.seed)
    return 0 if memory() else 1


if __name__ == "__main__":
    sys.exit(main())

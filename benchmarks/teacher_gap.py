"""How far apart the joint and the compressed teacher are on a realistic problem.

    python -m benchmarks.teacher_gap            # S = 1024 (default), float64
    python -m benchmarks.teacher_gap --s 2048

The joint teacher (SPEC section 8, DeepSeek-V4's CSA attention) takes ONE softmax per head over
the head's sink, its 128-token sliding window and the compressed blocks, and keeps the blocks'
share; the compressed teacher (MaxText 0.2.5) renormalises each head over the blocks alone. The
problem: B = 1, S tokens, m = 4 (W = S / 4 blocks), an indexer of HI = 8 heads of DI = 64, a
teacher of H = 16 heads of D = 64 whose query scales differ by head (some heads attend
sharply, some broadly), n_win = 128, and each head's sink set to the mean of its own window
logits (so the sink takes about one window token's mass). Everything in float64 through
jax_impl's public entry points; the two runs differ only in `teacher_normaliser`.

Printed: the teacher distributions' KL(joint || compressed) per query row (mean and max over
the rows with a valid block), the share of each head's mass that the blocks get under the
joint softmax (what the compressed teacher sets to 1), the dense and sparse losses, and the
gradients: relative difference ||g_joint - g_compressed|| / ||g_joint|| and cosine per parameter.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_impl  # noqa: E402

SHAPES = dict(emb_dim=64, q_lora_rank=64, index_n_heads=8, index_head_dim=64, rope_head_dim=32, compress_ratio=4,
              index_topk=64, num_query_heads=16, head_dim=64, sliding_window=128, query_chunk=256)


def problem(seq: int, seed: int = 0):
    """(params, inputs) of the problem of the module doc."""
    rng = np.random.default_rng(seed)
    c = SHAPES
    e, r, hi, di, m, h, d = (c["emb_dim"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"],
                             c["compress_ratio"], c["num_query_heads"], c["head_dim"])

    def normal(*shape, scale=1.0):
        return rng.standard_normal(shape) * scale

    params = {"indexer.wkv": normal(e, 2 * di, scale=e**-0.5), "indexer.wgate": normal(e, 2 * di, scale=e**-0.5),
              "indexer.ape": normal(m, 2 * di, scale=0.5), "indexer.kv_norm": 1 + normal(di, scale=0.1),
              "indexer.wq_b": normal(r, hi * di, scale=r**-0.5), "indexer.weights_proj": normal(e, hi, scale=e**-0.5)}
    head_scale = np.exp(rng.uniform(np.log(0.5), np.log(3.0), h))  # sharp and broad heads
    tq = normal(1, seq, h, d, scale=d**-0.5) * head_scale[None, None, :, None]
    window_kv = normal(1, seq, d)
    inputs = {"hidden_states": normal(1, seq, e), "q_latent": normal(1, seq, r),
              "position_ids": np.arange(seq, dtype=np.int32)[None], "segment_ids": np.ones((1, seq), np.int32),
              "teacher_query": tq, "teacher_kv": normal(1, seq // m, d), "teacher_window_kv": window_kv}
    # Each head's sink: the mean of its window logits over the sequence (token s against s-t).
    n = c["sliding_window"]
    means = np.zeros(h)
    for hh in range(h):
        vals = [np.einsum("sd,sd->s", tq[0, t:, hh], window_kv[0, : seq - t]) for t in range(min(n, seq))]
        means[hh] = np.mean(np.concatenate(vals))
    inputs["attention_sink"] = means
    return params, inputs


def block_mass(inputs, cfg) -> np.ndarray:
    """[H]: the mean over rows of each head's joint-softmax mass on the visible blocks."""
    tq, tkv, wkv, sink = (np.asarray(inputs[k]) for k in ("teacher_query", "teacher_kv", "teacher_window_kv",
                                                            "attention_sink"))
    s_len, m, n = tq.shape[1], cfg.compress_ratio, cfg.sliding_window
    out = np.zeros(tq.shape[2])
    rows = 0
    for s in range(m - 1, s_len, 7):  # every 7th row with a visible block: enough for a mean
        vis = (s + 1) // m
        a = tq[0, s] @ tkv[0, :vis].T  # [H, vis]
        u = tq[0, s] @ wkv[0, max(0, s - n + 1): s + 1].T  # [H, win]
        logits = np.concatenate([sink[:, None], u, a], axis=1)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out += p[:, -vis:].sum(axis=1)
        rows += 1
    return out / rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s", type=int, default=1024, help="sequence length (default 1024)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    params, inputs = problem(args.s, args.seed)
    cfgs = {t: jax_impl.CSAConfig(**SHAPES, teacher_normaliser=t) for t in ("joint", "compressed")}
    jax_impl.validate_inputs(params, inputs, cfgs["joint"])
    teachers = {t: np.asarray(jax_impl.forward_stages(params, inputs, c, "float64")["teacher"])
                for t, c in cfgs.items()}
    tj, tc = teachers["joint"], teachers["compressed"]
    valid = tj.sum(-1) > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(tj > 0, tj * (np.log(tj) - np.log(np.where(tc > 0, tc, 1.0))), 0.0)
    kl = terms.sum(-1)[valid]
    mass = block_mass(inputs, cfgs["joint"])
    print(f"problem: B=1, S={args.s}, W={args.s // 4}, HI=8, H=16, n_win=128, sink = each head's mean window "
          f"logit, float64")
    print(f"teacher KL(joint || compressed) per row: mean {kl.mean():.4f}, median {np.median(kl):.4f}, "
          f"max {kl.max():.4f} nats over {kl.size} rows")
    print(f"joint mass on the visible blocks by head: min {mass.min():.3f}, median {np.median(mass):.3f}, "
          f"max {mass.max():.3f} (the compressed teacher gives every head 1)")
    for sparse in (False, True):
        runs = {}
        for t, c in cfgs.items():
            c = jax_impl.CSAConfig(**{**c.to_dict(), "sparse_loss": sparse})
            runs[t] = jax_impl.indexer_loss_and_grads(params, inputs, c, "float64")
        lj, lc = float(runs["joint"][0]), float(runs["compressed"][0])
        mode = "sparse" if sparse else "dense"
        print(f"{mode} loss: joint {lj:.4f}, compressed {lc:.4f} (relative difference {abs(lj - lc) / abs(lj):.3f})")
        for name in jax_impl.PARAM_NAMES:
            gj, gc = (np.asarray(runs[t][1][name]).ravel() for t in ("joint", "compressed"))
            rel = np.linalg.norm(gj - gc) / np.linalg.norm(gj)
            cos = float(gj @ gc / (np.linalg.norm(gj) * np.linalg.norm(gc)))
            print(f"  {mode} grad {name:<22} relative difference {rel:.3f}, cosine {cos:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

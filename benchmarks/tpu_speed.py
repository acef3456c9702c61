"""Speed and memory of the indexer scores on one TPU chip: the XLA path beside the Pallas kernels.

    python -m benchmarks.tpu_speed                  # S = 8192, 32768, 131072; writes benchmarks/tpu_results.json
    python -m benchmarks.tpu_speed --seqs 8192      # one length
    python -m benchmarks.tpu_speed --only stage     # the scoring stage only (or: step)

Off TPU it prints one line (no chip, nothing measured) and exits with status 2; on a TPU it
exits 0 when every bound below passes, 1 otherwise.

Two programs per sequence length S, at the released shape (B=1, HI=64, DI=128, m=4, W=S/4),
bfloat16 inputs unless a row says float32:

* The scoring stage, `q [1,S,64,128]`, `K [1,W,128]` (bfloat16), `w [1,S,64]` (float32):
  the forward, and the forward with its VJP with respect to q, K and w under a fixed random
  cotangent ("fwd+bwd"). XLA: `jax_impl.api.score_stage` (the library's custom VJP, inputs
  widened as the library widens them, no mask: it cannot skip). Pallas:
  `jax_impl.kernels.contribution` with the causal mask of identity positions (query s sees
  key blocks j with 4j + 4 <= s + 1), so the kernels skip the tiles past the diagonal; the
  mask's tile table is built row tile by row tile (`live_tiles_by_rows`) and is timed with
  the kernels. Where the [S, W] scores and their cotangent do not fit the chip (S = 131072:
  16 GiB each in float32) the stage walks query blocks of --stage-rows rows (`lax.map`),
  reducing each block's scores to a sum and drawing its cotangent in the block, and says so.
* The training step: `jax.jit(jax.value_and_grad(jax_impl.indexer_loss))`, the six indexer
  parameters' gradients (dense loss), the shapes of benchmarks/memory_speed.py (E=R=256,
  H=64, D=128, top-k 512): XLA at head chunk 1 with the teacher chunk 1 (its best on this chip
  before the kernels), and Pallas (the indexer's scores and the teacher's block probabilities
  by the kernels) with all heads a step, query blocks of --step-rows rows and the teacher's
  heads all at once.

Per row: ms (median of --repeats runs after a warm-up), the fraction of the chip's peak
(bfloat16 dense MXU peak read from the device kind) for the dense FLOP count
2*S*W*HI*DI per product (1 product forward, 4 with the backward: the logits again, dq, dK) and
for the causal count (the fraction of (s, j) pairs that are valid, about half), and the temp
bytes of XLA's compiled memory analysis. A program whose compiled temp exceeds the chip's
memory is not run (reported "out of memory" with its temp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

GIB = 2**30
HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, HEAD_DIM, RATIO = 64, 128, 4
SEQS = (8192, 32768, 131072)
# Dense bfloat16 MXU peak per chip, FLOP/s, by device kind (public spec sheets).
PEAKS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
         "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v4": 275e12}
# The bounds (one v5e chip, bfloat16 inputs, the released shape).
STAGE_FWD_MS = 1.2
STAGE_FWD_BWD_MS = 7.0
STEP_MS = 20.0
STEP_TEMP_GIB = 0.5


def peak_flops(kind: str) -> float | None:
    return next((v for k, v in sorted(PEAKS.items(), key=lambda kv: -len(kv[0])) if kind.startswith(k)), None)


def causal_fraction(seq: int) -> float:
    """The fraction of the [S, W] pairs a causal mask keeps: sum_s floor((s + 1) / m) / (S W)."""
    s = np.arange(seq, dtype=np.int64)
    return float(np.sum((s + 1) // RATIO) / (seq * (seq // RATIO)))


def dense_flops(seq: int, products: int) -> float:
    return 2.0 * seq * (seq // RATIO) * HEADS * HEAD_DIM * products


def causal_rows(rows, w):
    """[1, len(rows), W] bool: block j lies wholly in the past of query row s (identity positions)."""
    first = jnp.arange(w, dtype=jnp.int32) * RATIO
    return (first[None, None, :] + RATIO <= rows[None, :, None] + 1)


def _time(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return runs


def _measure(name, jitted, args, repeats, hbm_bytes, log):
    """Compile, read the memory analysis, run unless it cannot fit; a row dict."""
    row = {"name": name}
    try:
        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        ma = compiled.memory_analysis()
        row["temp_bytes"] = int(ma.temp_size_in_bytes)
        row["argument_bytes"] = int(ma.argument_size_in_bytes)
        row["output_bytes"] = int(ma.output_size_in_bytes)
        total = row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
        if hbm_bytes and total > hbm_bytes:
            row["status"] = f"out of memory: compiled temp {row['temp_bytes'] / GIB:.1f} GiB"
            log(f"  {name}: {row['status']}")
            return row
        runs = _time(compiled, args, repeats)
        row.update(status="ran", median_ms=1e3 * statistics.median(runs), min_ms=1e3 * min(runs),
                   max_ms=1e3 * max(runs), runs_ms=[1e3 * r for r in runs])
        log(f"  {name}: {row['median_ms']:.3f} ms (min {row['min_ms']:.3f}), temp {row['temp_bytes'] / GIB:.3f} GiB, "
            f"compile {row['compile_s']} s")
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, not dropped
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        row["status"] = f"error: {type(e).__name__}: {msg}"
        log(f"  {name}: {row['status']}")
        traceback.print_exc(file=sys.stderr)
    return row


# -- the scoring stage ---------------------------------------------------------------------


def stage_programs(seq: int, rows: int | None, dtype=jnp.bfloat16, tiles=None, impls=("xla", "pallas")):
    """{(impl, mode): (jitted, args)} of the scoring stage at S=seq; `rows`: query blocks;
    `tiles`: the Pallas kernels' (default: `default_tiles`)."""
    from jax_impl.api import score_stage
    from jax_impl.kernels import contribution, default_tiles, live_tiles_by_rows

    w = seq // RATIO
    key = jax.random.PRNGKey(0)
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, seq, HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    keys = jax.random.normal(kk, (1, w, HEAD_DIM), jnp.float32).astype(dtype)
    hw = jax.random.normal(kw, (1, seq, HEADS), jnp.float32) * HEADS**-0.5
    scale = HEAD_DIM**-0.5

    def xla(q, keys, hw, start):
        return score_stage(q.astype(jnp.float32), keys.astype(jnp.float32), hw)

    def pallas(q, keys, hw, start):
        n = q.shape[1]
        live = live_tiles_by_rows(lambda r: causal_rows(start + r, w), n, w, tiles or default_tiles(n, w, q.dtype))
        return contribution(q, keys, hw, valid=live) * scale

    def fwd_bwd(f):
        def run(q, keys, hw, start):
            out, pull = jax.vjp(lambda a, b, c: f(a, b, c, start), q, keys, hw)
            g = jax.random.normal(jax.random.fold_in(key, start), out.shape, jnp.float32)
            return out, *pull(g)
        return run

    def whole(f):
        return jax.jit(lambda q, keys, hw: f(q, keys, hw, jnp.int32(0)))

    def blocked(f, bwd):
        """Query blocks of `rows` rows: each block's scores summed (and its cotangent drawn
        inside), dq and dw per block, dK summed over blocks."""
        nb = seq // rows

        def prog(q, keys, hw):
            def one(i):
                start = i * rows
                qb = jax.lax.dynamic_slice_in_dim(q, start, rows, 1)
                wb = jax.lax.dynamic_slice_in_dim(hw, start, rows, 1)
                if not bwd:
                    return jnp.sum(f(qb, keys, wb, start)), None, None, None
                out, dq, dk, dw = fwd_bwd(f)(qb, keys, wb, start)
                return jnp.sum(out), dq, dk, dw
            sums, dq, dk, dw = jax.lax.map(one, jnp.arange(nb, dtype=jnp.int32))
            if not bwd:
                return jnp.sum(sums)
            return jnp.sum(sums), dq, jnp.sum(dk, axis=0), dw
        return jax.jit(prog)

    progs = {}
    for impl, f in ((i, {"xla": xla, "pallas": pallas}[i]) for i in impls):
        for mode in ("fwd", "fwd+bwd"):
            g = f if mode == "fwd" else fwd_bwd(f)
            progs[(impl, mode)] = (blocked(f, mode != "fwd") if rows else whole(g), (q, keys, hw))
    return progs


def run_stage(seqs, repeats, stage_rows, hbm, peak, log, dtype_names=("bfloat16",)):
    rows_out = []
    for seq in seqs:
        w = seq // RATIO
        rows = stage_rows if seq * w * 4 * 4 > 0.5 * (hbm or 16 * GIB) else None
        for dname in dtype_names:
            log(f"stage S={seq} {dname}" + (f" (query blocks of {rows} rows)" if rows else ""))
            progs = stage_programs(seq, rows, jnp.dtype(dname))
            for (impl, mode), (jitted, args) in progs.items():
                if impl == "xla" and dname != "bfloat16":
                    continue
                r = _measure(f"stage {impl} {mode} S={seq} {dname}", jitted, args,
                             repeats if seq <= 8192 else max(2, repeats // 3), hbm, log)
                products = 1 if mode == "fwd" else 4
                r.update(program="stage", impl=impl, mode=mode, seq=seq, dtype=dname, query_rows=rows or 0,
                         dense_flop=dense_flops(seq, products),
                         causal_flop=dense_flops(seq, products) * causal_fraction(seq))
                _fractions(r, peak)
                rows_out.append(r)
    return rows_out


def parse_variant(text: str):
    """'256x256u8' -> Tiles(256, 256, unroll=8)."""
    from jax_impl.kernels import Tiles

    size, _, unroll = text.partition("u")
    rows, keys = (int(v) for v in size.split("x"))
    return Tiles(rows, keys, int(unroll or 1))


def run_variants(seq, variants, repeats, hbm, peak, log):
    """The Pallas stage at other tiles (bfloat16, S=seq): the measurements that pick the defaults."""
    out = []
    for text in variants:
        tiles = parse_variant(text)
        log(f"stage S={seq} pallas tiles {text}")
        for (impl, mode), (jitted, args) in stage_programs(seq, None, jnp.bfloat16, tiles, ("pallas",)).items():
            r = _measure(f"stage pallas {mode} S={seq} tiles {text}", jitted, args, repeats, hbm, log)
            products = 1 if mode == "fwd" else 4
            r.update(program="stage", impl=f"pallas {text}", mode=mode, seq=seq, dtype="bfloat16", query_rows=0,
                     dense_flop=dense_flops(seq, products),
                     causal_flop=dense_flops(seq, products) * causal_fraction(seq))
            _fractions(r, peak)
            out.append(r)
    return out


def _fractions(r, peak):
    if r.get("status") == "ran" and peak:
        s = r["median_ms"] / 1e3
        r["peak_fraction_dense"] = r["dense_flop"] / s / peak
        r["peak_fraction_causal"] = r["causal_flop"] / s / peak


# -- the training step ---------------------------------------------------------------------


def step_configs(seq: int, step_rows: int):
    from benchmarks.memory_speed import bench_config

    rows = min(step_rows, seq)
    xla = bench_config(1, 1)
    xla_rows = bench_config(1, 8, query_chunk=rows)
    # With the kernels no [B, r, heads, W] array exists, so the teacher takes every head at
    # once (its kernels loop over the heads inside): one call of each kernel per query block.
    pallas = bench_config(0, 0, query_chunk=rows, scoring_backend="pallas")
    # XLA at S > 32768 is not run: its query-blocked step takes ~15 s a run there (it scales as
    # S**2 from 60 ms at 8192), more device time than this benchmark is given.
    out = [("xla", "head chunk 1, teacher chunk 1", xla)] if seq <= 8192 else []
    if seq <= 32768:
        out.append(("xla", f"head chunk 1, query blocks {rows}, teacher chunk 8", xla_rows))
    out.append(("pallas", f"all heads, query blocks {rows}, teacher all heads", pallas))
    return out


def step_args(cfg, seq: int, seed: int = 0):
    """(params, float inputs, int inputs) of the step at B=1, S=seq: random, scaled as in
    benchmarks/memory_speed.py, identity positions, one document."""
    from jax_impl.validate import FLOAT_INPUTS, input_shapes, param_shapes

    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * shape[0] ** -0.5)
              for k, (_, shape) in param_shapes(cfg).items()}
    shapes = input_shapes(cfg, 1, seq)
    floats = {k: jnp.asarray(rng.standard_normal(shapes[k][1], dtype=np.float32)) for k in FLOAT_INPUTS}
    floats["teacher_query"] = floats["teacher_query"] * cfg.head_dim**-0.5
    ints = {"position_ids": jnp.arange(seq, dtype=jnp.int32)[None], "segment_ids": jnp.ones((1, seq), jnp.int32)}
    return params, floats, ints


def step_program(cfg, dtype_name: str):
    """jit of the loss and the six parameters' gradients (`jax.value_and_grad(indexer_loss)`)."""
    from jax_impl import indexer_loss

    return jax.jit(lambda p, f, i: jax.value_and_grad(indexer_loss)(p, {**f, **i}, cfg, dtype_name))


def run_step(seqs, repeats, step_rows, hbm, peak, log, float32_at=8192):
    rows_out = []
    for seq in seqs:
        for impl, how, cfg in step_configs(seq, step_rows):
            dtypes = ["bfloat16"] + (["float32"] if impl == "pallas" and seq == float32_at else [])
            for dname in dtypes:
                log(f"step S={seq} {impl} {dname}: {how}")
                args = step_args(cfg, seq)
                jitted = step_program(cfg, dname)
                r = _measure(f"step {impl} S={seq} {dname} ({how})", jitted, args,
                             repeats if seq <= 8192 else max(2, repeats // 3), hbm, log)
                r.update(program="step", impl=impl, config=how, seq=seq, dtype=dname,
                         dense_flop=dense_flops(seq, 4), causal_flop=dense_flops(seq, 4) * causal_fraction(seq))
                _fractions(r, peak)
                rows_out.append(r)
    return rows_out


# -- bounds, table ---------------------------------------------------------------------------


def _find(rows, **kw):
    return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)


def evaluate_bounds(rows, seqs) -> list:
    """The PASS/FAIL bounds of the programs this run measured (`--only stage` judges no step
    bound): a bound whose row is missing from a program that ran fails ("missing")."""
    out = []
    ran = {r["program"] for r in rows}

    def bound(name, r, test, detail):
        if name.split()[0] not in ran:
            return
        ok = r is not None and r.get("status") == "ran" and test(r)
        got = "missing" if r is None else (f"{r['median_ms']:.3f} ms" if r.get("status") == "ran" else r["status"])
        out.append({"name": name, "ok": bool(ok), "detail": f"{got}; {detail}"})

    if 8192 in seqs:
        bound("stage fwd S=8192 pallas", _find(rows, program="stage", impl="pallas", mode="fwd", seq=8192,
                                                 dtype="bfloat16"),
              lambda r: r["median_ms"] <= STAGE_FWD_MS, f"bound <= {STAGE_FWD_MS} ms")
        bound("stage fwd+bwd S=8192 pallas", _find(rows, program="stage", impl="pallas", mode="fwd+bwd", seq=8192,
                                                     dtype="bfloat16"),
              lambda r: r["median_ms"] <= STAGE_FWD_BWD_MS, f"bound <= {STAGE_FWD_BWD_MS} ms")
        r = _find(rows, program="step", impl="pallas", seq=8192, dtype="bfloat16")
        bound("step S=8192 pallas", r, lambda r: r["median_ms"] <= STEP_MS, f"bound <= {STEP_MS} ms")
        bound("step S=8192 pallas temp", r, lambda r: r["temp_bytes"] <= STEP_TEMP_GIB * GIB,
              f"temp {r['temp_bytes'] / GIB:.3f} GiB, bound <= {STEP_TEMP_GIB} GiB" if r and "temp_bytes" in r
              else f"bound <= {STEP_TEMP_GIB} GiB")
        bound("step S=8192 pallas float32 runs", _find(rows, program="step", impl="pallas", seq=8192,
                                                          dtype="float32"), lambda r: True, "runs")
    for seq in (s for s in seqs if s > 8192):
        bound(f"stage fwd+bwd S={seq} pallas runs", _find(rows, program="stage", impl="pallas", mode="fwd+bwd",
                                                           seq=seq, dtype="bfloat16"), lambda r: True, "runs")
        bound(f"step S={seq} pallas runs", _find(rows, program="step", impl="pallas", seq=seq, dtype="bfloat16"),
              lambda r: True, "runs")
    return out


def print_table(rows, file=sys.stdout):
    print("| program | impl | S | dtype | mode / config | ms | peak (dense) | peak (causal) | temp GiB |", file=file)
    print("|---|---|---|---|---|---|---|---|---|", file=file)
    for r in rows:
        ms = f"{r['median_ms']:.3f}" if r.get("status") == "ran" else r.get("status", "")
        fd = f"{100 * r['peak_fraction_dense']:.1f}%" if "peak_fraction_dense" in r else ""
        fc = f"{100 * r['peak_fraction_causal']:.1f}%" if "peak_fraction_causal" in r else ""
        temp = f"{r['temp_bytes'] / GIB:.3f}" if "temp_bytes" in r else ""
        how = r.get("mode") or r.get("config", "")
        if r.get("query_rows"):
            how += f" (query blocks {r['query_rows']})"
        print(f"| {r['program']} | {r['impl']} | {r['seq']} | {r['dtype']} | {how} | {ms} | {fd} | {fc} | {temp} |",
              file=file)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default=",".join(map(str, SEQS)))
    p.add_argument("--only", choices=("stage", "step"), default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--stage-rows", type=int, default=8192, help="query block rows where the stage needs them")
    p.add_argument("--step-rows", type=int, default=1024, help="query block rows of the Pallas step")
    p.add_argument("--variants", default="", help="extra Pallas tiles for the S=8192 stage, e.g. 256x256u8,512x256 "
                   "(rows x keys, u: heads per head-loop iteration)")
    p.add_argument("--out", default=os.path.join(HERE, "tpu_results.json"))
    args = p.parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu":
        print(f"tpu_speed: no TPU here (JAX default backend: {backend}); nothing measured")
        return 2
    seqs = [int(s) for s in args.seqs.split(",")]
    dev = jax.devices()[0]
    kind = dev.device_kind
    peak = peak_flops(kind)
    stats = dev.memory_stats() or {}
    hbm = stats.get("bytes_limit")

    def log(msg):
        print(msg, flush=True)

    log(f"device: {kind} ({len(jax.devices())} devices), bf16 peak {peak and peak / 1e12} TFLOP/s, "
        f"HBM limit {hbm and hbm / GIB:.1f} GiB, jax {jax.__version__}")
    rows = []
    if args.only in (None, "stage"):
        rows += run_stage(seqs, args.repeats, args.stage_rows, hbm, peak, log)
        if args.variants:
            rows += run_variants(8192, args.variants.split(","), args.repeats, hbm, peak, log)
    if args.only in (None, "step"):
        rows += run_step(seqs, args.repeats, args.step_rows, hbm, peak, log)
    print_table(rows)
    bounds = evaluate_bounds(rows, seqs)
    for b in bounds:
        print(f"  {'PASS' if b['ok'] else 'FAIL'}  {b['name']}: {b['detail']}")
    result = {"device": kind, "peak_flops_bf16": peak, "hbm_bytes": hbm, "jax": jax.__version__,
              "python": platform.python_version(), "command": "python -m benchmarks.tpu_speed " + " ".join(argv or sys.argv[1:]),
              "rows": rows, "bounds": bounds}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all(b["ok"] for b in bounds) else 1


if __name__ == "__main__":
    sys.exit(main())

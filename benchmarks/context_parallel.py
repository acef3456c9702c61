"""Context parallelism: memory and communication per device of the sharded loss gradient at
128K and 1M tokens, compile-only, on simulated CPU devices.

    python -m benchmarks.context_parallel            # S = 131072 (P = 1, 8, 64), S = 1048576 (P = 1, 8, 16, 32, 64)
    python -m benchmarks.context_parallel --quick    # S = 131072 only

What is compiled: `jax_impl.sharded.lower_loss_and_grads` (the program of
`sharded_loss_and_grads`: dense loss, its parameter and input gradients) from abstract shapes on a
(data, seq, model) = (1, P, 1) mesh, float32, B = 1, with the benchmark's DeepSeek-V4-sized
indexer (benchmarks.memory_speed.ISSUE_SHAPES: HI=64, DI=128, H=64, D=128, m=4, top-k 512) as a
long-context user runs it: head chunk 1 on both knobs, query chunk r = 64 (QUERY_CHUNK says why),
the released model's 128-token window. Nothing is allocated or run.

* The bound at 1M tokens: one device's temp at S = 1048576, P = 8 at most TEMP_BOUND (2 GiB),
  and, at that point, temp against r (R_SWEEP): what each row of a query block costs and what
  is left at r = 0, beside `working_set`'s terms.

* Memory: XLA's compiled memory analysis of one device's program (temp, arguments, outputs), and
  the YNNPACK scratch XLA:CPU does not count (benchmarks.memory_speed.ynn_scratch_bytes).
  `working_set` is the analytic model it is held against: what one device must hold, term by
  term (its docstring).
* Communication: every collective of the optimized HLO (benchmarks.collectives), attributed by
  the `jax.named_scope` it came from (jax_impl.sharded names the pooling halo, the keys' and
  teacher_kv's gathers, the validity data, the window halo and the parameters' cast), in bytes
  one device moves per step; those inside a loop counted apart (times their trip count).
  `comm_model` is what each must move.

The simulated devices are set before JAX starts (64, the largest P); results go to
benchmarks/results.json under "context_parallel", beside what benchmarks.memory_speed writes.
"""

from __future__ import annotations

import os
import sys

DEVICES = 64
if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Read once, when JAX starts its CPU backend: before anything below imports it.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.collectives import collectives  # noqa: E402
from benchmarks.memory_speed import GIB, ISSUE_SHAPES, MIB, bench_config, ynn_scratch_bytes  # noqa: E402
from jax_impl import CSAConfig, resolve_dtype, sharded  # noqa: E402
from jax_impl.validate import param_shapes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KEY = "context_parallel"
# The query chunk r. At S = 1M a device's temp is, term by term (`working_set`): one query
# block's [B, r, W] arrays, linear in r (measured about 9 MiB per row of the block at W = 262144,
# the model's 6.25), the gathered keys, their cotangent and teacher_kv (0.375 GiB, fixed by W), the
# device's compressor projections and window rows (0.56 GiB at L = 131072). Only the first depends
# on r: at P = 8, r = 512 held 5.42 GiB, r = 128 2.16, r = 64 1.59 (R_SWEEP prints them), so r = 64
# is the largest power of two under TEMP_BOUND. Every row's scores, top-k, teacher row and KL are
# the same whatever r (rows are independent); r changes only the scan's length and the order in
# which the blocks' parameter gradients are added (wide). Tiling the key axis instead would cut the
# same term but needs an online softmax for T and the student, and a top-k merged across tiles: a
# second formulation of every row's math, where r is a loop bound.
QUERY_CHUNK, HEAD_CHUNK, WINDOW = 64, 1, 128
SEQ_SIZES = {131072: (1, 8, 64), 1048576: (1, 8, 16, 32, 64)}
QUICK_SEQ_SIZES = {131072: (1, 8, 64)}
COMM_POINT = (1048576, 8)  # the communication table printed (every point's is in results.json)
# One device's temp at TEMP_POINT (S, P) is at most TEMP_BOUND bytes: 1M tokens on 8 devices.
TEMP_POINT, TEMP_BOUND = (1048576, 8), 2 * 2**30
R_SWEEP = (512, 256, 128, 64)  # query chunks compiled at TEMP_POINT (the full run only)
BATCH, DTYPE = 1, "float32"
# Bounds: temp (+ YNNPACK scratch) is at most WORKING_SET_FACTOR x the analytic working set
# (measured: 1.05 at P=1 to 1.44 at S=131072, P=64: XLA's layout copies of [B, r, W] arrays);
# the per-row slope of temp over L = S/P agrees across S within SLOPE_SLACK.
WORKING_SET_FACTOR, SLOPE_SLACK = 1.5, 0.1

# The collectives, in the order the table prints them.
CATEGORIES = (
    "keys all-gather", "keys reduce-scatter", "teacher_kv all-gather", "validity all-gather",
    "pooling halo", "pooling halo cotangent", "window halo", "parameter gradients all-reduce",
    "loss sum and count", "all-reduce inside loops", "keys cotangent over model", "other",
)


def cp_config() -> CSAConfig:
    return bench_config(HEAD_CHUNK, HEAD_CHUNK, query_chunk=QUERY_CHUNK, sliding_window=WINDOW)


def mesh_of(p: int) -> Mesh:
    if jax.device_count() < p:
        raise SystemExit(f"P={p} needs {p} devices, JAX has {jax.device_count()}: run as "
                         f"`python -m benchmarks.context_parallel` (it sets XLA_FLAGS before JAX starts)")
    return Mesh(np.array(jax.devices()[:p]).reshape(1, p, 1), ("data", "seq", "model"))


def compile_point(cfg: CSAConfig, seq: int, p: int, batch: int = BATCH, dtype: str = DTYPE):
    """(memory dict in bytes, optimized HLO text) of one device's program at S = seq over P = p."""
    compiled = sharded.lower_loss_and_grads(cfg, dtype, mesh_of(p), batch, seq).compile()
    ma, hlo = compiled.memory_analysis(), compiled.as_text()
    memory = {"temp": int(ma.temp_size_in_bytes), "argument": int(ma.argument_size_in_bytes),
              "output": int(ma.output_size_in_bytes), "alias": int(ma.alias_size_in_bytes),
              "ynn_scratch": int(ynn_scratch_bytes(hlo))}
    return memory, hlo


# -- communication -------------------------------------------------------------------------


def category(kind: str, source: str, in_loop: bool) -> str:
    """Which of CATEGORIES a collective (or one element of a combined one) belongs to, from its
    kind and the op_name of its source (the named scopes of jax_impl.sharded)."""
    backward = "transpose(" in source
    if "/keys_gather/" in source:
        return "keys reduce-scatter" if kind == "reduce-scatter" else "keys all-gather"
    if "/teacher_kv_gather/" in source:
        return "teacher_kv all-gather"
    if "/validity_gather/" in source:
        return "validity all-gather"
    if "/pool_halo/" in source:
        return "pooling halo cotangent" if backward else "pooling halo"
    if "/window_halo/" in source:
        return "window halo"
    if "/params/" in source and kind == "all-reduce":
        return "parameter gradients all-reduce"
    if kind == "all-reduce" and in_loop:
        # With a `model` axis, each query block's head sums (by design); of the data or seq axes
        # (a parameter's cotangent reduced in every iteration), never.
        return "all-reduce inside loops"
    if kind == "all-reduce" and "/rows_loss/" in source and not backward:
        return "loss sum and count"
    if kind == "all-reduce" and "/keys/" in source:
        return "keys cotangent over model"
    return "other"


def comm_table(hlo: str) -> dict:
    """{category: {"bytes": per device per step, "inside_loops": the part of it inside loops,
    "ops": collectives}}; a combined op's bytes split over its elements' sources."""
    table = {c: {"bytes": 0, "inside_loops": 0, "ops": 0} for c in CATEGORIES}
    for c in collectives(hlo):
        parts = (list(zip(c.sources, c.element_bytes)) if len(c.sources) == len(c.element_bytes) > 1
                 else [(c.op_name, c.result_bytes)])
        for source, size in parts:
            moved = round(c.moved * size / c.result_bytes) * c.trips if c.result_bytes else 0
            row = table[category(c.kind, source, c.in_loop)]
            row["bytes"] += moved
            row["inside_loops"] += moved if c.in_loop else 0
            row["ops"] += 1
    return table


def comm_model(cfg: CSAConfig, batch: int, seq: int, p: int, dtype: str = DTYPE) -> dict:
    """Bytes one device must move per step, by category (ring costs, benchmarks.collectives):
    an all-gather or reduce-scatter of an array of N bytes moves (P-1)/P N, an all-reduce
    2 (P-1)/P N, a ppermute what it sends. The keys [B, W, DI] and teacher_kv [B, W, D] (wide,
    both gathered; the keys' cotangent scattered back), the validity data (first position int32,
    one-document bool, document int32 per block), the pooling halo (the `a` slots of one block,
    m x DI of kv in the compute dtype and of gate wide, and its first position; its cotangent
    without the position), the window halo (n - 1 rows of teacher_window_kv and their segment
    ids), the parameters' gradients (wide) and the loss's sum and count, once each."""
    if p == 1:
        return {c: 0 for c in CATEGORIES}
    dt, wide = resolve_dtype(dtype)
    db, wb = jnp.dtype(dt).itemsize, jnp.dtype(wide).itemsize
    w, m, di, d = cfg.num_blocks(seq), cfg.compress_ratio, cfg.index_head_dim, cfg.head_dim
    n = min(cfg.sliding_window, seq)
    gather = (p - 1) / p
    params = sum(int(np.prod(shape)) for _, shape in param_shapes(cfg).values()) * wb
    model = {c: 0 for c in CATEGORIES}
    model.update({
        "keys all-gather": gather * batch * w * di * wb,
        "keys reduce-scatter": gather * batch * w * di * wb,
        "teacher_kv all-gather": gather * batch * w * d * wb,
        "validity all-gather": gather * batch * w * (4 + 1 + 4),
        "pooling halo": batch * (m * di * (db + wb) + 4),
        "pooling halo cotangent": batch * m * di * (db + wb),
        "window halo": batch * max(n - 1, 0) * (d * wb + 4),
        "parameter gradients all-reduce": 2 * gather * params,
        "loss sum and count": 2 * gather * (wb + 4),
    })
    return model


# -- memory --------------------------------------------------------------------------------


def working_set(cfg: CSAConfig, batch: int, seq: int, p: int, dtype: str = DTYPE) -> dict:
    """The analytic model of one device's temp memory, in bytes, by term (and "total").

    L = S/P rows per device, W blocks in all, r = query_chunk rows per block, c = the head
    chunk, A = B*r*W wide elements (one [B, r, W] array):
      query block   the backward of one query block (recomputed under jax.checkpoint): its
                    masked scores, validity (bool, A/4), the teacher distribution T, the
                    student's log-probabilities and their cotangent, one head chunk's logits
                    and their cotangent: (4.25 + 2c) A. The forward of a block holds less
                    (scores, validity, T's accumulator, one teacher head's joint logits and
                    their softmax: 4.25 A).
      keys          every block's keys [B, W, DI] (gathered, wide) and their cotangent, summed
                    over the query blocks: 2 B W DI.
      teacher_kv    every block's, gathered, wide: B W D.
      validity      every block's first position, one-document flag, document: 9 B W bytes.
      compressor    the device's kv and gate projections [B, L, 2 DI] and their cotangents:
                    4 B L 2 DI.
      window        the device's teacher_window_kv rows with the n - 1 before them, wide,
                    and their segment ids: B (L + n - 1) (D + 1).
    Only `compressor` and `window` shrink with P; the rest is fixed by S (W = S/m)."""
    _, wide = resolve_dtype(dtype)
    wb = jnp.dtype(wide).itemsize
    rows = seq // p
    w, di, d = cfg.num_blocks(seq), cfg.index_head_dim, cfg.head_dim
    r = min(cfg.query_chunk, rows) if cfg.query_chunk else rows
    c = cfg.indexer_head_chunk or cfg.index_n_heads
    a = batch * r * w * wb
    n = min(cfg.sliding_window, seq)
    terms = {
        "query block": (4.25 + 2 * c) * a,
        "keys": 2 * batch * w * di * wb,
        "teacher_kv": batch * w * d * wb,
        "validity": 9 * batch * w,
        "compressor": 4 * batch * rows * 2 * di * wb,
        "window": batch * (rows + max(n - 1, 0)) * (d * wb + 4),
    }
    return {**terms, "total": sum(terms.values())}


# -- the sweep, bounds, tables ---------------------------------------------------------------


def sweep(seq_sizes: dict, log=None) -> list:
    cfg = cp_config()
    rows = []
    for seq, ps in seq_sizes.items():
        for p in ps:
            t0 = time.time()
            memory, hlo = compile_point(cfg, seq, p)
            rows.append({"seq": seq, "p": p, "rows_per_device": seq // p, "memory": memory,
                         "model": working_set(cfg, BATCH, seq, p), "comm": comm_table(hlo),
                         "comm_model": comm_model(cfg, BATCH, seq, p), "compile_s": time.time() - t0})
            if log:
                log(f"  S={seq} P={p}: temp {memory['temp'] / GIB:.3f} GiB ({time.time() - t0:.0f} s)")
    return rows


def r_sweep(rows, log=None) -> list:
    """One device's memory at TEMP_POINT for each query chunk of R_SWEEP (the sweep's own r taken
    from `rows`): [{"query_chunk", "memory", "model"}], largest r first."""
    seq, p = TEMP_POINT
    out = []
    for r in R_SWEEP:
        cfg = dataclasses.replace(cp_config(), query_chunk=r)
        row = next((x for x in rows if (x["seq"], x["p"]) == TEMP_POINT), None) if r == QUERY_CHUNK else None
        if row is None:
            t0 = time.time()
            memory = compile_point(cfg, seq, p)[0]
            if log:
                log(f"  S={seq} P={p} r={r}: temp {memory['temp'] / GIB:.3f} GiB ({time.time() - t0:.0f} s)")
        else:
            memory = row["memory"]
        out.append({"query_chunk": r, "memory": memory, "model": working_set(cfg, BATCH, seq, p)})
    return out


def r_fit(sweep_rows) -> dict | None:
    """temp = fixed + per_row x r through the largest and the smallest r of the sweep, beside the
    model's: {"per_row", "fixed", "model_per_row", "model_fixed"} in bytes (None: under two r)."""
    if len(sweep_rows) < 2:
        return None
    hi, lo = sweep_rows[0], sweep_rows[-1]
    per_row = (hi["memory"]["temp"] - lo["memory"]["temp"]) / (hi["query_chunk"] - lo["query_chunk"])
    model_per_row = (hi["model"]["query block"] - lo["model"]["query block"]) / (hi["query_chunk"] - lo["query_chunk"])
    return {"per_row": per_row, "fixed": lo["memory"]["temp"] - per_row * lo["query_chunk"],
            "model_per_row": model_per_row, "model_fixed": lo["model"]["total"] - model_per_row * lo["query_chunk"]}


def temp_bound(rows) -> dict | None:
    """The bound at TEMP_POINT (None when the sweep did not compile it: --quick)."""
    row = next((r for r in rows if (r["seq"], r["p"]) == TEMP_POINT), None)
    if row is None:
        return None
    temp = row["memory"]["temp"] + row["memory"]["ynn_scratch"]
    seq, p = TEMP_POINT
    return {"name": f"S={seq}, P={p}: one device's temp (+ YNNPACK scratch) at most {TEMP_BOUND / GIB:g} GiB",
            "ok": temp <= TEMP_BOUND, "detail": f"{temp / GIB:.3f} GiB at query chunk r = {QUERY_CHUNK}"}


def _close(measured: float, model: float) -> bool:
    # Each op's bytes are whole numbers: a byte per op of rounding either way.
    return abs(measured - model) <= max(16, 1e-6 * model)


def scaling(rows) -> dict:
    """Per S with two or more P: temp = fixed + slope x L (L = S/P), through the smallest and the
    largest P: {seq: {"slope": bytes per row, "fixed": bytes}}. The slope is what each of a
    device's rows costs (the compressor's projections, the window rows); the fixed part is what
    every device holds whatever P (arrays of W = S/m blocks)."""
    out = {}
    for seq in sorted({r["seq"] for r in rows}):
        mine = sorted((r for r in rows if r["seq"] == seq), key=lambda r: r["p"])
        if len(mine) < 2:
            continue
        lo, hi = mine[-1], mine[0]
        slope = (hi["memory"]["temp"] - lo["memory"]["temp"]) / (hi["rows_per_device"] - lo["rows_per_device"])
        out[seq] = {"slope": slope, "fixed": lo["memory"]["temp"] - slope * lo["rows_per_device"]}
    return out


def evaluate_bounds(rows) -> list:
    out = [b for b in (temp_bound(rows),) if b is not None]
    by = {(r["seq"], r["p"]): r for r in rows}
    for seq in sorted({r["seq"] for r in rows}):
        ps = sorted(p for s, p in by if s == seq)
        temps = [by[(seq, p)]["memory"]["temp"] for p in ps]
        if 1 in ps and 8 in ps:
            t1, t8 = by[(seq, 1)]["memory"]["temp"], by[(seq, 8)]["memory"]["temp"]
            out.append({"name": f"S={seq}: temp at P=8 below P=1's", "ok": t8 < t1,
                        "detail": f"{t8 / GIB:.3f} vs {t1 / GIB:.3f} GiB"})
        out.append({"name": f"S={seq}: temp never grows with P", "ok": all(b <= a for a, b in zip(temps, temps[1:])),
                    "detail": ", ".join(f"P={p} {t / GIB:.3f}" for p, t in zip(ps, temps)) + " GiB"})
    fits = scaling(rows)
    if len(fits) > 1:
        slopes = [f["slope"] for f in fits.values()]
        out.append({"name": f"temp grows linearly in L = S/P, the same bytes per row at every S (within "
                            f"{SLOPE_SLACK:.0%})", "ok": max(slopes) <= (1 + SLOPE_SLACK) * min(slopes),
                    "detail": ", ".join(f"S={s}: {f['slope']:.0f} B/row + {f['fixed'] / GIB:.3f} GiB"
                                        for s, f in fits.items())})
    ratios = [(r["memory"]["temp"] + r["memory"]["ynn_scratch"]) / r["model"]["total"] for r in rows]
    worst = max(range(len(rows)), key=lambda i: ratios[i])
    out.append({"name": f"(temp + YNNPACK scratch) / working_set at most {WORKING_SET_FACTOR:g} at every point",
                "ok": ratios[worst] <= WORKING_SET_FACTOR,
                "detail": f"worst {ratios[worst]:.2f} (S={rows[worst]['seq']}, P={rows[worst]['p']}); best "
                          f"{min(ratios):.2f}"})
    inside = sum(c["inside_loops"] for r in rows for c in r["comm"].values())
    out.append({"name": "no collective moves bytes inside a loop", "ok": inside == 0,
                "detail": f"{inside:,} bytes per step over {len(rows)} programs"})
    off = [f"S={r['seq']} P={r['p']} {c}: {r['comm'][c]['bytes']:,} vs {r['comm_model'][c]:,.0f}"
           for r in rows for c in CATEGORIES if c != "other" and not _close(r["comm"][c]["bytes"], r["comm_model"][c])]
    other = sum(r["comm"]["other"]["bytes"] for r in rows)
    out.append({"name": "every collective moves what comm_model says (halos: m x DI and n - 1 rows)",
                "ok": not off and other == 0,
                "detail": "; ".join(off) if off or other else
                          f"{sum(len(CATEGORIES) - 1 for _ in rows)} figures over {len(rows)} programs, "
                          "nothing unattributed"})
    return out


def print_memory_table(rows, file=sys.stdout):
    base = {r["seq"]: r["memory"]["temp"] for r in rows if r["p"] == 1}
    print(f"{'S':>8} {'P':>3} {'L=S/P':>8} {'temp GiB':>9} {'ynn GiB':>8} {'out GiB':>8} {'model GiB':>9} "
          f"{'ratio':>6} {'vs P=1':>7}", file=file)
    for r in rows:
        m = r["memory"]
        vs = f"{m['temp'] / base[r['seq']]:.3f}" if r["seq"] in base else "-"
        print(f"{r['seq']:>8} {r['p']:>3} {r['rows_per_device']:>8} {m['temp'] / GIB:>9.3f} "
              f"{m['ynn_scratch'] / GIB:>8.3f} {m['output'] / GIB:>8.3f} {r['model']['total'] / GIB:>9.3f} "
              f"{(m['temp'] + m['ynn_scratch']) / r['model']['total']:>6.2f} {vs:>7}", file=file)


def print_comm_table(row, file=sys.stdout):
    print(f"{'collective':<31} {'ops':>4} {'MiB/device/step':>16} {'model MiB':>10} {'inside loops':>13}", file=file)
    for c in CATEGORIES:
        got = row["comm"][c]
        if not got["ops"] and not row["comm_model"][c]:
            continue
        print(f"{c:<31} {got['ops']:>4} {got['bytes'] / MIB:>16.4f} {row['comm_model'][c] / MIB:>10.4f} "
              f"{got['inside_loops'] / MIB:>13.4f}", file=file)


def print_r_table(rs, file=sys.stdout):
    seq, p = TEMP_POINT
    print(f"\ntemp at S={seq}, P={p} by query chunk r (GiB):", file=file)
    print(f"{'r':>5} {'temp':>7} {'model':>7} {'query block (model)':>20}", file=file)
    for r in rs:
        print(f"{r['query_chunk']:>5} {r['memory']['temp'] / GIB:>7.3f} {r['model']['total'] / GIB:>7.3f} "
              f"{r['model']['query block'] / GIB:>20.3f}", file=file)
    fit = r_fit(rs)
    if fit:
        print(f"temp = {fit['fixed'] / GIB:.3f} GiB + {fit['per_row'] / MIB:.2f} MiB x r (model: "
              f"{fit['model_fixed'] / GIB:.3f} GiB + {fit['model_per_row'] / MIB:.2f} MiB x r)", file=file)


def write_results(path: str, entry: dict) -> None:
    """Put `entry` under KEY in the JSON at `path`, keeping every other key."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[KEY] = entry
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="S = 131072 only (P = 1, 8, 64)")
    p.add_argument("--out", default=os.path.join(HERE, "results.json"))
    p.add_argument("--no-write", action="store_true", help="print only; leave --out as it is")
    p.add_argument("--reprint", action="store_true",
                   help="print the tables and bounds of the rows in --out again (compiles nothing)")
    args = p.parse_args(argv)
    started = time.time()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.reprint:
        with open(args.out) as f:
            saved = json.load(f)[KEY]
        rows, rs = saved["rows"], saved.get("r_sweep", [])
        args.no_write = True
    else:
        rows = sweep(QUICK_SEQ_SIZES if args.quick else SEQ_SIZES, log)
        rs = [] if args.quick else r_sweep(rows, log)
    cfg = cp_config()
    print(f"the sharded dense loss gradient per device, (data, seq, model) = (1, P, 1), B={BATCH}, {DTYPE}, "
          f"head chunk {HEAD_CHUNK}, query chunk {QUERY_CHUNK}, window {WINDOW}:")
    print_memory_table(rows)
    point = next((r for r in rows if (r["seq"], r["p"]) == COMM_POINT), max(rows, key=lambda r: (r["seq"], r["p"] == 8)))
    for seq, f in scaling(rows).items():
        print(f"S={seq}: temp = {f['fixed'] / GIB:.3f} GiB + {f['slope']:.0f} bytes x L (through P = "
              f"{min(r['p'] for r in rows if r['seq'] == seq)} and {max(r['p'] for r in rows if r['seq'] == seq)})")
    at = next((r for r in rows if (r["seq"], r["p"]) == TEMP_POINT), None)
    if at is not None:
        print(f"\nS={TEMP_POINT[0]}, P={TEMP_POINT[1]}: temp {at['memory']['temp'] / GIB:.3f} GiB; "
              "working_set by term (GiB): " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in at["model"].items()))
    if rs:
        print_r_table(rs)
    print(f"\ncollectives at S={point['seq']}, P={point['p']} (bytes one device moves per step):")
    print_comm_table(point)
    bounds = evaluate_bounds(rows)
    print("\nbounds:")
    for b in bounds:
        print(f"  {'PASS' if b['ok'] else 'FAIL'}  {b['name']}: {b['detail']}")
    if temp_bound(rows) is None:
        print(f"  (S={TEMP_POINT[0]}, P={TEMP_POINT[1]} not compiled (--quick): its {TEMP_BOUND / GIB:g} GiB bound "
              "is not checked)")
    elapsed = time.time() - started
    if not args.reprint:
        compiled = len(rows) + sum(r["query_chunk"] != QUERY_CHUNK for r in rs)
        print(f"\n{compiled} programs compiled, {elapsed:.0f} s")
    if not args.no_write:
        command = "python -m benchmarks.context_parallel " + " ".join(argv if argv is not None else sys.argv[1:])
        write_results(args.out, {
            "command": command.strip(),
            "what": "jax_impl.sharded.lower_loss_and_grads (dense loss, parameter and input gradients) on a "
                    "(data, seq, model) = (1, P, 1) mesh of simulated CPU devices, compile-only",
            "shapes": {**ISSUE_SHAPES, "batch": BATCH, "dtype": DTYPE, "indexer_head_chunk": cfg.indexer_head_chunk,
                       "loss_head_chunk": cfg.loss_head_chunk, "query_chunk": cfg.query_chunk,
                       "sliding_window": cfg.sliding_window},
            "environment": {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
                            "cpu_count": os.cpu_count(), "machine": platform.machine()},
            "elapsed_s": elapsed,
            "comm_point": list(COMM_POINT),
            "rows": rows,
            "temp_point": list(TEMP_POINT),
            "temp_bound": TEMP_BOUND,
            "r_sweep": rs,
            "r_fit": r_fit(rs),
            "scaling": {str(k): v for k, v in scaling(rows).items()},
            "bounds": bounds,
        })
        print(f"wrote {os.path.relpath(args.out)} ({KEY!r})")
    return 0 if all(b["ok"] for b in bounds) else 1


if __name__ == "__main__":
    sys.exit(main())

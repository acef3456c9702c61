#!/usr/bin/env python
"""Measure a device's tolerance profile (SPEC section 10, harness/platforms.py): how much further
its arithmetic lands from the float64 oracle than torch's did on the fixture machine.

    python scripts/measure_platform_profile.py                 # on the device; prints, writes nothing
    python scripts/measure_platform_profile.py --write         # and stores harness/profiles/<device>.json

Two sections:
  PATH        the native unchunked JAX path (one program per point) on every case, at each
              matmul precision (highest, default), of each scoring backend the matrix runs on the
              device: xla in float32, bfloat16 and float16 with each teacher, pallas in the dtypes
              the kernels take on a TPU (float32 and bfloat16), joint teacher. A profile is the
              device's distance from the oracle, so it is measured over every program the device
              is judged on: the kernels multiply the inputs XLA's projections made at that
              precision as they are, where XLA's own scores may fuse them otherwise (measured on
              a v5e at `default`: one float32 score of ragged came out 4x the oracle on pallas and
              11% off it on xla, from the same stored queries and keys). Each is judged against
              the fixture goldens (the float64 oracle and torch at the dtype) WITHOUT a profile:
              each oracle check's ratio error / bound, the bound being the CPU's (alpha *
              max(torch's error, floor)). The worst ratio per (precision, dtype, kind) gives the
              factor: worst * MARGIN, rounded up to the next multiple of GRID, never below 1
              (harness.judging.tolerance says why those numbers). Then every
              point is judged again WITH the factors, and every check that still fails is listed.
  ELEMENTARY  the operations the path is made of, in float32 on the device against float64 numpy:
              a matmul at each precision (highest, high, default), exp, log, rsqrt, a division, a
              softmax over 64 entries: the largest error in units of float32's unit roundoff
              (2^-24), relative per element (log: relative to max(|log x|, 1); the matmul:
              normwise, as the judge normalises). On a
              CPU these sit at 1-2 units; a device whose exp or matmul sits higher explains the
              PATH factors above 1.

The file it writes holds the factors, each with its measured worst ratio and the check it came
from, the elementary errors, the device kind, the jax, jaxlib and libtpu versions, and this
command. Nothing is loosened by hand: change the code, re-run this, commit the file.
Runs on one device, in one process (a TPU chip opens in one process at a time); compiles the
points in --threads threads (compilation releases the GIL), then runs them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARGIN = 1.25  # over the measured worst ratio (harness/judging/tolerance.py, "Platform profiles")
GRID = 0.25  # factors are rounded up to a multiple of this
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("highest", "default")
BACKENDS = ("xla", "pallas")
ORACLE_CHECKS = ("oracle", "oracle@sel")
UNIT = 2.0**-24


def factor_of(worst: float) -> float:
    """The stored factor of a measured worst ratio."""
    return math.ceil(max(1.0, worst * MARGIN) / GRID - 1e-9) * GRID


def elementary(precisions=("highest", "high", "default")) -> dict:
    """The float32 operations of the path on this device against float64 numpy (see the module
    docstring); errors in units of 2^-24."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    out: dict = {}
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 256)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    for p in precisions:
        c = np.asarray(jax.jit(lambda x, y, p=p: jnp.matmul(x, y, precision=p))(a, b), np.float64)
        out[f"matmul_{p}"] = float(np.max(np.abs(c - ref)) / np.max(np.abs(ref)) / UNIT)

    def per_element(name, fn, ref_fn, *xs, absolute_below: float = 0.0):
        got = np.asarray(jax.jit(fn)(*xs), np.float64)
        want = ref_fn(*[x.astype(np.float64) for x in xs])
        out[name] = float(np.max(np.abs(got - want) / np.maximum(np.abs(want), absolute_below)) / UNIT)

    x = rng.uniform(-20, 20, 1 << 16).astype(np.float32)
    pos = np.exp(rng.uniform(-9, 9, 1 << 16)).astype(np.float32)
    den = np.exp(rng.uniform(-9, 9, 1 << 16)).astype(np.float32) * np.sign(rng.standard_normal(1 << 16)).astype(np.float32)
    per_element("exp", jnp.exp, np.exp, x)
    # log near 1 is near 0: its error there is judged absolute (relative to max(|log x|, 1)), as
    # the path uses it (log-probabilities, a KL sum), not relative to a vanishing value.
    per_element("log", jnp.log, np.log, pos, absolute_below=1.0)
    per_element("rsqrt", jax.lax.rsqrt, lambda v: 1.0 / np.sqrt(v), pos)
    per_element("divide", jnp.divide, np.divide, x, den)
    logits = rng.uniform(-8, 8, (1024, 64)).astype(np.float32)

    def softmax64(v):
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    per_element("softmax", lambda v: jax.nn.softmax(v, axis=-1), softmax64, logits)
    return {k: round(v, 3) for k, v in out.items()}


def native_entries(cases, dtypes, backends=BACKENDS):
    """[(point, its entries)]: each case's native point at each dtype and teacher on the xla
    backend, and on pallas in the kernels' TPU dtypes (harness.problems.matrix.TPU_PALLAS_DTYPES)
    with the joint teacher: every case, not only those the tpu sample runs on pallas."""
    from harness.points import Point
    from harness.problems.cases import CASES
    from harness.problems.matrix import TPU_PALLAS_DTYPES, entries_at

    out = []
    for backend in backends:
        for case in cases:
            for dtype in dtypes:
                for teacher in CASES[case].teachers:
                    if backend == "pallas" and (dtype not in TPU_PALLAS_DTYPES or teacher != "joint"):
                        continue
                    point = Point(case, dtype, teacher=teacher, backend=backend)
                    out.append((point, entries_at(point)))
    return out


def measure_path(points, precision: str, threads: int, log) -> tuple[list[dict], float]:
    """Each native point run at `precision` (compiled in `threads` threads) and judged without a
    profile: one row per oracle-rule check (ratio error / bound) and per other check that failed."""
    import jax

    from harness.judging.judge import judge
    from harness.judging.tolerance import Policy, numeric_kind
    from harness.run.collect import collect
    from harness.sides.implementations import fixture, implementation

    jax.config.update("jax_default_matmul_precision", precision)
    jax.clear_caches()
    backend = jax.default_backend()
    began = time.time()

    def run(point):
        t = time.time()
        out = implementation("jax").run(fixture(point.case), point)
        return out, time.time() - t

    rows = []
    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
        futures = {pool.submit(run, p): (p, entries) for p, entries in points}
        for fut in cf.as_completed(futures):
            point, entries = futures[fut]
            candidate, seconds = fut.result()
            log(f"  {precision} {point.label}: {seconds:.1f} s")
            for e in entries:
                candidate_e, refs = collect(e, "goldens", candidate=candidate)
                for r in judge(e, candidate_e, refs, Policy(precision, backend)):
                    oracle_rule = r.check in ORACLE_CHECKS and r.template == "close"
                    if not oracle_rule and r.status not in ("failed", "error"):
                        continue
                    kind = numeric_kind(e.quantity) if oracle_rule else None
                    rows.append({"case": point.case, "dtype": point.dtype, "teacher": point.teacher,
                                 "backend": point.backend, "mode": e.mode,
                                 "quantity": e.quantity, "check": r.check, "kind": kind, "status": r.status,
                                 "error": float(r.error), "bound": float(r.bound),
                                 "ratio": float(r.error / r.bound) if oracle_rule and r.bound > 0 else None,
                                 "message": "" if oracle_rule and r.status == "passed" else r.message})
    return rows, time.time() - began


def worst_table(rows) -> dict:
    """{dtype: {kind: {"worst_ratio", "at", "factor"}}} over the oracle-rule rows."""
    out: dict = {}
    for r in rows:
        if r["ratio"] is None or not math.isfinite(r["ratio"]):
            continue
        slot = out.setdefault(r["dtype"], {}).setdefault(r["kind"], {"worst_ratio": -1.0})
        if r["ratio"] > slot["worst_ratio"]:
            slot.update(worst_ratio=r["ratio"],
                        at=f"{r['case']} {r['dtype']} {r['teacher']} teacher {r['mode']} {r['quantity']} ({r['check']})"
                        + (f", backend {r['backend']}" if r.get("backend", "xla") != "xla" else ""))
    for row in out.values():
        for slot in row.values():
            slot["factor"] = factor_of(slot["worst_ratio"])
            slot["worst_ratio"] = round(slot["worst_ratio"], 4)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", help="comma-separated cases (default: every case)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--backends", default=",".join(BACKENDS), help="scoring backends measured (default: both)")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="compile threads")
    ap.add_argument("--write", action="store_true", help="store harness/profiles/<device>.json")
    ap.add_argument("--out", help="also write the whole measurement (every row) as JSON here")
    ap.add_argument("--no-cache", action="store_true",
                    help="no persistent compilation cache (its file lock serialises the compile threads; measured on "
                         "a v5e with 12 threads and a cold cache: lock timeouts, 11-35 s a point)")
    ap.add_argument("--only", choices=["elementary"],
                    help="measure the elementary operations only; with --write, replace that block of the stored "
                         "profile (its factors are left as measured)")
    args = ap.parse_args(argv)
    os.environ["JAX_ENABLE_X64"] = "1"
    import jax

    jax.config.update("jax_enable_x64", True)
    from harness import platforms
    from harness.judging.judge import judge
    from harness.judging.tolerance import Policy, policy_factors
    from harness.problems.cases import CASES
    from harness.run.collect import collect
    from harness.sides import timing
    from harness.sides.implementations import implementation, fixture

    if not args.no_cache:
        timing.use_compilation_cache(timing.cache_root(None))  # csa-parity run's cache: its native programs
    device = platforms.device_info()
    print(f"device: {device['backend']} {device['device_kind']} x{device['device_count']}; jax {device['jax_version']}, "
          f"jaxlib {device['jaxlib_version']}, libtpu {device['libtpu_version']}; runtime {device['runtime_version']}",
          flush=True)
    cases = args.cases.split(",") if args.cases else list(CASES)
    dtypes = args.dtypes.split(",")
    command = "python scripts/measure_platform_profile.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = {"backend": device["backend"], "device_kind": device["device_kind"], "command": command.strip(),
              "jax_version": device["jax_version"], "jaxlib_version": device["jaxlib_version"],
              "libtpu_version": device["libtpu_version"], "runtime_version": device["runtime_version"],
              "margin": MARGIN, "grid": GRID,
              "how": ("factor = worst ratio (error / the CPU bound) over the oracle checks of the native unchunked "
                      "path on the cases below (on the scoring backends `backends` names for that precision: "
                      "xla; pallas in float32 and bfloat16 with the joint teacher), at that precision and dtype, "
                      "times margin, rounded up to a multiple of grid, at least 1; "
                      "scripts/measure_platform_profile.py"),
              "backends": {}, "commands": {},
              "cases": cases, "factors": {}, "measured": {}, "elementary": {}, "seconds": {}}
    t = time.time()
    result["elementary"] = elementary()
    print("ELEMENTARY (float32, units of 2^-24): "
          + ", ".join(f"{k} {v:g}" for k, v in result["elementary"].items()), flush=True)
    if args.only == "elementary":
        if args.write and device["backend"] != "cpu":
            stored = json.loads(Path(platforms.profile_path(device["backend"], device["device_kind"])).read_text())
            stored["elementary"] = result["elementary"]
            stored["elementary_command"] = result["command"]
            write_profile(stored)
        return 0
    points = native_entries(cases, dtypes, args.backends.split(","))
    all_rows = {}
    for precision in args.precisions.split(","):
        rows, seconds = measure_path(points, precision, args.threads, lambda s: print(s, flush=True))
        table = worst_table(rows)
        result["measured"][precision] = table
        result["factors"][precision] = {d: {k: v["factor"] for k, v in row.items()} for d, row in table.items()}
        result["seconds"][precision] = round(seconds, 1)
        result["backends"][precision] = args.backends.split(",")
        result["commands"][precision] = result["command"]
        all_rows[precision] = rows
        other = [r for r in rows if r["ratio"] is None]
        print(f"PATH {precision}: {len(points)} points in {seconds:.0f} s; worst ratio (error / CPU bound) -> factor:")
        for d, row in table.items():
            print("  " + d + ": " + ", ".join(f"{k} {v['worst_ratio']:.3g} -> {v['factor']:g} ({v['at']})"
                                              for k, v in row.items()))
        print(f"  failed checks other than the oracle rule (top-k, codes, isolation): {len(other)}")
        for r in other[:20]:
            print(f"    {r['case']} {r['dtype']} {r['teacher']} {r['mode']} {r['quantity']} {r['check']}: "
                  f"{r['message'][:200]}")
        # With the factors: every check of every native point again (the outputs are recomputed
        # from the in-memory jit cache, not compiled again).
        factors = policy_factors(result["factors"][precision])
        backend = device["backend"]
        still = []
        for point, entries in points:
            candidate = implementation("jax").run(fixture(point.case), point)
            for e in entries:
                candidate_e, refs = collect(e, "goldens", candidate=candidate)
                for r in judge(e, candidate_e, refs, Policy(precision, backend, factors, "measured")):
                    if r.status in ("failed", "error"):
                        still.append(f"{e.label} {r.check}: {r.message[:200]}")
        result.setdefault("failed_with_factors", {})[precision] = len(still)
        print(f"  with the factors: {len(still)} failed checks" + "".join(f"\n    {s}" for s in still[:20]), flush=True)
        if args.write and device["backend"] != "cpu":
            write_profile(merged_with_stored(result))
    result["seconds"]["total"] = round(time.time() - t, 1)
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "rows": all_rows}, indent=1))
    if args.write and device["backend"] == "cpu":
        print("not written: a CPU is the reference platform, judged with the CPU's bounds (no profile)")
    return 0


PER_PRECISION = ("factors", "measured", "seconds", "failed_with_factors", "backends", "commands")


def merged_with_stored(result: dict) -> dict:
    """`result` with the stored profile's blocks of the precisions this run did not measure
    (a run of --precisions default replaces that precision's factors and keeps the others, each
    with the command and backends that measured it; a stored block from before backends were
    recorded was measured on the xla backend alone)."""
    from harness import platforms

    path = Path(platforms.profile_path(result["backend"], result["device_kind"]))
    if not path.exists():
        return result
    stored = json.loads(path.read_text())
    unrecorded = {"backends": ["xla"], "commands": stored.get("command", "")}  # a block from before they were
    out = dict(result)
    for key in PER_PRECISION:
        block = dict(stored.get(key) or {})
        if key in unrecorded:
            block.update({p: unrecorded[key] for p in stored.get("factors", {}) if p not in block})
        out[key] = block | result.get(key, {})
    return out


def write_profile(result: dict) -> None:
    from harness import platforms

    path = Path(platforms.profile_path(result["backend"], result["device_kind"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

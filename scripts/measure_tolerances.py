#!/usr/bin/env python
"""Re-measure every figure harness/judging/tolerance.py (and the bounds beside it) quotes as
"measured", and print each beside the bound it supports.

    python scripts/measure_tolerances.py            # 3 seeds, every committed fixture (~minutes)
    python scripts/measure_tolerances.py --quick    # 1 seed, 3 fixtures: a smoke run

Sections (each names the table or comment it feeds):
  CHUNK     harness/judging/tolerance.py CHUNK: chunked vs native JAX on random `small` problems
            (tests/problems.py, B=2, S=64): the worst normalised difference per dtype and
            kind over every chunk size of both head knobs (dense, sparse on the own and on an
            imposed selection), and separately over query chunks r dividing and not dividing
            S (compared at the same bound); then the one-ulp query flips of the per-chunk
            projection that the CHUNK comment counts.
  FLOOR     harness/judging/tolerance.py FLOOR["float32"]["loss"]: the example of its comment (torch
            vs JAX float32 sparse loss on the `small` fixture, each against the float64 oracle).
  ORDERS    the order-error bounds (order errors stored in the fixtures, sqrt(n) floors): the
            worst error / bound of the oracle checks per (kind, dtype), goldens mode, native
            points of the committed fixtures, and which term set that bound.
  FIXTURE_CHECK  harness/judging/tolerance.py FIXTURE_CHECK_RTOL: JAX on the committed fixtures vs
            their goldens, normwise as `--check` compares, in eps(dtype).
  BACKEND   harness/judging/tolerance.py BACKEND: the pallas scoring backend vs the XLA path at the
            same knobs, over the default sample's pallas points (the `xla` check's errors).
  MEMORY    tests/test_memory.py (harness/judging/tolerance.py MEMORY_FLOOR_FACTOR): chunk 1's compiled
            temp memory over its analytic floor (also with the harness.selftest.mutations mutant that
            drops the scan's jax.checkpoint, in a child process), native over chunk 1, per-head
            growth over its allowance.
--only, --dtype and --case narrow a run (tests/test_measure_tolerances.py runs a sliver).
Nothing here decides pass or fail: it reads the bounds from the harness and reports measured,
bound and their ratio. Runs on CPU with 64-bit mode and `highest` matmul precision, like the
suite. FLOOR needs torch (the live float32 reference); the other sections do not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):  # tests/problems.py: the random problems the suite uses
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_impl  # noqa: E402
from harness import platforms  # noqa: E402
from harness.judging import tolerance  # noqa: E402
from harness.judging.compare import normalised_error, to_numpy  # noqa: E402
from harness.judging.tolerance import FIXTURE_CHECK_RTOL as CHECK_RTOL  # noqa: E402
from harness.outputs import NOT_APPLICABLE  # noqa: E402
from harness.points import Point  # noqa: E402
from harness.problems.cases import CASES  # noqa: E402
from harness.problems.matrix import build_matrix, divisors, query_chunk_sizes  # noqa: E402
from harness.run.collect import dims, evaluate  # noqa: E402
from harness.sides.implementations import fixture, outputs  # noqa: E402

LOW = ("float32", "bfloat16", "float16")
DTYPES = (*LOW, "float64")
KINDS = ("forward", "loss", "grad")  # harness.judging.tolerance.numeric_kind
# eps(t) as FIXTURE_CHECK_RTOL counts it (2^-mantissa bits) and ulp(t) at 1.0 as tolerance.py does
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-8, "float16": 2.0**-11}
ULP = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
QUICK_CASES = ("tiny", "small", "packed")


def row(label: str, measured: float, bound: float, unit: str = "") -> str:
    ratio = measured / bound if bound else float("inf")
    return (f"  {label:<46} measured {measured:<9.3g}{unit:<2} bound {bound:<9.3g}{unit:<2} "
            f"ratio {ratio:.3f}")


def _scale(quantity: str) -> str:
    return "row" if quantity == "index_scores" else "tensor"


def _same_sets(a, b) -> bool:
    return np.array_equal(np.sort(to_numpy(a), -1), np.sort(to_numpy(b), -1))


# --------------------------------------------------------------------------- CHUNK


def _bundle(params, inputs, cfg_dict, dtype, selection):
    cfg = jax_impl.CSAConfig.from_dict(cfg_dict)
    raw = jax_impl.indexer_parity_bundle(params, inputs, cfg, dtype, selection)
    out = {"forward": {k: to_numpy(v) for k, v in raw["forward"].items()}}
    for mode in ("dense", "sparse", "sparse_at_selection"):
        loss, pg, _ = raw[mode]
        out[mode] = {"loss": to_numpy(loss), **{f"grad.{k}": to_numpy(v) for k, v in pg.items()}}
    return out


def chunk_differences(chunked: dict, native: dict) -> tuple[dict, int]:
    """({kind: worst normalised difference}, queries whose top-k set differs) of one chunked
    bundle against the native one; the own-selection sparse mode is compared only where the
    two selections agree (as harness.judging.judge does)."""
    worst = dict.fromkeys(KINDS, 0.0)
    for q in ("compressed_keys", "index_scores"):
        err, _, _ = normalised_error(chunked["forward"][q], native["forward"][q], _scale(q))
        worst["forward"] = max(worst["forward"], err)
    own, ref = chunked["forward"]["topk_indices"], native["forward"]["topk_indices"]
    flips = int(np.sum(np.any(np.sort(own, -1) != np.sort(ref, -1), axis=-1)))
    modes = ["dense", "sparse_at_selection"] + (["sparse"] if flips == 0 else [])
    for mode in modes:
        for q, value in chunked[mode].items():
            err, _, _ = normalised_error(value, native[mode][q], "tensor")
            k = tolerance.numeric_kind(q)
            worst[k] = max(worst[k], err)
    return worst, flips


def chunk_measure(seeds, dtypes=DTYPES, batch: int = 2, seq: int = 64, ichunks=None, tchunks=None,
                  qchunks=None) -> dict:
    """{(dtype, "head" | "query"): ({kind: worst}, top-k flips)} over random SMALL problems.
    None = every divisor of the knob's head count / query_chunk_sizes(seq)."""
    from problems import SMALL, random_problem

    cfg = dict(SMALL)
    ichunks = divisors(cfg["index_n_heads"]) if ichunks is None else ichunks
    tchunks = divisors(cfg["num_query_heads"]) if tchunks is None else tchunks
    qchunks = [r for r in query_chunk_sizes(seq) if r] if qchunks is None else qchunks
    knobs = {"head": [dict(indexer_head_chunk=c) for c in ichunks] + [dict(loss_head_chunk=c) for c in tchunks],
             "query": [dict(query_chunk=r) for r in qchunks]}
    out = {}
    for dtype in dtypes:
        for family in knobs:
            out[(dtype, family)] = (dict.fromkeys(KINDS, 0.0), 0)
        for seed in seeds:
            params, inputs = random_problem(cfg, batch, seq, seed)
            k_eff = min(cfg["index_topk"], seq // cfg["compress_ratio"])
            placeholder = np.full((batch, seq, k_eff), -1, np.int32)
            first = _bundle(params, inputs, cfg, dtype, placeholder)
            selection = first["forward"]["topk_indices"].astype(np.int32)
            native = _bundle(params, inputs, cfg, dtype, selection)  # same program, own top-k imposed
            for family, settings in knobs.items():
                for knob in settings:
                    got, flips = chunk_differences(_bundle(params, inputs, dict(cfg, **knob), dtype, selection), native)
                    worst, n = out[(dtype, family)]
                    out[(dtype, family)] = ({k: max(worst[k], got[k]) for k in KINDS}, n + flips)
    return out


def projection_flips(q_latent, wq_b, head_dim: int, dtype: str) -> dict[int, tuple[int, int]]:
    """{chunk: (entries that differ, entries)} between the all-heads query projection and the
    per-chunk projections (the chunk's columns of wq_b) concatenated, each jitted alone, in
    the compute dtype (jax_impl.precision.project, as scoring does)."""
    from jax_impl.precision import project

    jdt = jnp.dtype(dtype)
    a, w = jnp.asarray(q_latent, jdt), jnp.asarray(wq_b, jdt)
    proj = jax.jit(lambda a, w: project(a, w, jnp.float32))
    full = to_numpy(proj(a, w))
    heads = w.shape[1] // head_dim
    out = {}
    for c in divisors(heads):
        cols = c * head_dim
        parts = [to_numpy(proj(a, w[:, i:i + cols])) for i in range(0, w.shape[1], cols)]
        out[c] = (int(np.sum(full != np.concatenate(parts, axis=-1))), full.size)
    return out


def chunk_section(seeds, dtypes=DTYPES) -> None:
    from problems import SMALL

    qs = [r for r in query_chunk_sizes(64) if r]
    print(f"CHUNK (harness/judging/tolerance.py CHUNK): chunked vs native JAX, random small problems (B=2, S=64), "
          f"seeds {list(seeds)}; head: every divisor of HI={SMALL['index_n_heads']} and H={SMALL['num_query_heads']}; "
          f"query: r in {qs} (S=64); dense, sparse at the native selection, sparse own selection where equal")
    result = chunk_measure(seeds, dtypes)
    for dtype in dtypes:
        for family in ("head", "query"):
            worst, flips = result[(dtype, family)]
            for kind in KINDS:
                unit = f" = {worst[kind] / ULP[dtype]:.2f} ulp({dtype})" if kind == "grad" and dtype in ULP else ""
                print(row(f"{dtype} {family}-chunks {kind}", worst[kind], tolerance.CHUNK[dtype][kind]) + unit)
            if flips:
                print(f"    ({flips} query rows whose top-k set moved: own-selection sparse skipped there)")
    fx = fixture("small")
    di = fx.config["index_head_dim"]
    print(f"  one-ulp query flips, per-chunk vs all-heads projection (small fixture q_latent @ wq_b):")
    for dtype in ("float32", "bfloat16", "float16"):
        flips = projection_flips(fx.inputs["q_latent"], fx.params["indexer.wq_b"], di, dtype)
        print(f"    {dtype:<9}" + ", ".join(f"chunk {c}: {n} of {total}" for c, (n, total) in flips.items()))


# --------------------------------------------------------------------------- FLOOR


def floor_section() -> None:
    print("FLOOR (harness/judging/tolerance.py FLOOR float32 loss): small fixture, float32 sparse loss vs the "
          "float64 oracle")
    ref = {dt: outputs("torch_ref", "small", Point("small", dt)) for dt in ("float64", "float32")}  # torch now
    oracle = ref["float64"]["loss.sparse"]
    bound = tolerance.FLOOR["float32"]["loss"]
    jax_out = outputs("jax", "small", Point("small", "float32"))
    errs = {}
    for label, value in (("torch loss.sparse (own top-k)", ref["float32"]["loss.sparse"]),
                         ("jax   loss.sparse (own top-k)", jax_out["loss.sparse"]),
                         ("torch loss.sparse_at_oracle", ref["float32"]["loss.sparse_at_oracle"]),
                         ("jax   loss.sparse_at_oracle", jax_out["loss.sparse_at_oracle"])):
        errs[label] = normalised_error(value, oracle)[0]
        print(row(f"float32 {label}", errs[label], bound))
    t, j = errs["torch loss.sparse (own top-k)"], errs["jax   loss.sparse (own top-k)"]
    print(f"    jax / torch = {j / t if t else float('inf'):.1f} (the comment's 'lucky torch draw'); "
          f"stored order error orderr.loss.sparse_at_oracle = "
          f"{fixture('small').order_errors('float32')['loss.sparse_at_oracle']:.3g}")


# --------------------------------------------------------------------------- ORDERS


def orders_section(cases, dtypes=DTYPES) -> None:
    backend = platforms.current_backend()
    print(f"ORDERS (stored order errors, sqrt(n) floors): oracle checks, goldens mode, native "
          f"points of {len(cases)} fixtures, backend {backend}; worst error / bound per (kind, dtype)")
    worst: dict = {}
    counts: dict = {}
    for entry in build_matrix(cases=cases, dtypes=dtypes, ichunks=[0], tchunks=[0]):
        if entry.kind not in ("forward", "loss", "grad"):
            continue
        for r in evaluate(entry, "goldens"):
            if r.check not in ("oracle", "oracle@sel", "exact64", "exact64@sel") or r.status == NOT_APPLICABLE:
                continue
            if r.bound <= 0:  # end to end not comparable (own selection differs by ties): no number
                continue
            p, q = entry.point, entry.quantity
            kind = tolerance.numeric_kind(q)
            term = "exact64"
            if p.dtype != "float64":
                floor = tolerance.floor(p.dtype, q, "highest", backend, dims(p.case))
                base = tolerance.FLOOR[p.dtype][kind]
                t_err = r.stats.get("torch_error", 0.0)
                if t_err >= floor:
                    term = "torch/order error"
                else:
                    term = "sqrt(n) floor" if floor > base else "dtype floor"
            key = (kind, p.dtype)
            counts.setdefault(key, {}).setdefault(term, 0)
            counts[key][term] += 1
            ratio = r.error / r.bound if r.bound else float("inf")
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, r.error, r.bound, f"{r.context} {q} [{r.check}]", term)
    for dtype in DTYPES:
        for kind in KINDS:
            if (kind, dtype) not in worst:
                continue
            ratio, err, bound, where, term = worst[(kind, dtype)]
            terms = ", ".join(f"{n} {t}" for t, n in sorted(counts[(kind, dtype)].items()))
            print(row(f"{dtype} {kind}", err, bound) + f"  at {where}; bound set by {term}")
            print(f"    ({terms})")


# --------------------------------------------------------------------------- FIXTURE_CHECK


def fixture_check_errors(cases, dtype: str) -> dict:
    """{kind: worst normwise error} of JAX (native) against the committed goldens, as
    harness.run.regenerate.compare_tensor measures (over the finite entries, relative to the
    tensor's largest |golden|); own-selection sparse goldens only where JAX picks the same sets."""
    worst = dict.fromkeys(KINDS, 0.0)
    for case in cases:
        goldens = outputs("goldens", case, Point(case, dtype))
        out = outputs("jax", case, Point(case, dtype))
        same = _same_sets(out["topk_indices"], goldens["topk_indices"])
        for name, value in out.values.items():
            if name == "topk_indices" or name.startswith("input_grad."):
                continue
            if not same and (name == "loss.sparse" or name.startswith("grad.sparse.")):
                continue
            # float64 goldens hold no sparse_at_oracle: the oracle's selection is its own
            golden = name if name in goldens else name.replace("sparse_at_oracle", "sparse", 1)
            err, _, _ = normalised_error(value, goldens[golden], "tensor")
            k = tolerance.numeric_kind(name)
            worst[k] = max(worst[k], err)
    return worst


def fixture_section(cases, dtypes=DTYPES) -> None:
    print(f"FIXTURE_CHECK (harness/judging/tolerance.py FIXTURE_CHECK_RTOL): JAX (native) on {len(cases)} committed fixtures vs "
          "their goldens, normwise")
    for dtype in dtypes:
        worst = fixture_check_errors(cases, dtype)
        for kind in KINDS:
            print(row(f"{dtype} {kind} ({worst[kind] / EPS[dtype]:.1f} eps)", worst[kind], CHECK_RTOL[dtype]))


# --------------------------------------------------------------------------- MEMORY


# Run in a fresh interpreter: jax_impl imported from a patched copy (harness.selftest.mutation_worker.redirect).
_MUTANT_MEMORY = """
import sys
sys.path[:0] = [{root!r}]
from harness.selftest.mutation_worker import foreign_modules, redirect
redirect({copy!r})
import jax
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
import jax_impl
assert not foreign_modules({copy!r}), foreign_modules({copy!r})
from benchmarks.memory_speed import TEST_BATCH, TEST_SEQ, TEST_SHAPE, analytic_floor, compiled_temp_bytes
cfg = jax_impl.CSAConfig(**TEST_SHAPE, indexer_head_chunk=1, loss_head_chunk=1)
held = compiled_temp_bytes(cfg, TEST_BATCH, TEST_SEQ)["effective"]
print(held / analytic_floor(cfg, TEST_BATCH, TEST_SEQ)["total"])
"""


def mutant_memory_ratio(name: str) -> float:
    """Chunk 1's (temp + YNN scratch) / analytic floor with the harness.selftest.mutations mutant `name`
    applied to a copy of jax_impl (test_memory.py quotes it for the lost jax.checkpoint)."""
    import subprocess
    import tempfile

    from harness.selftest.mutations import CATALOGUE, patch_copy

    mutant = next(m for m in CATALOGUE if m.name == name)
    with tempfile.TemporaryDirectory(prefix=f"measure-{name}-") as tmp:
        patch_copy(mutant, Path(tmp))
        code = _MUTANT_MEMORY.format(root=str(ROOT), copy=tmp)
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"mutant {name}: memory measurement failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def memory_section(quick: bool) -> None:
    from benchmarks.memory_speed import (TEST_BATCH, TEST_SEQ, TEST_SHAPE, analytic_floor, compiled_temp_bytes,
                                         grows_no_worse_than_linearly)
    from harness.judging.tolerance import MEMORY_FLOOR_FACTOR as FLOOR_FACTOR, MEMORY_GROWTH_SLACK

    print(f"MEMORY (tests/test_memory.py, compile-only, B={TEST_BATCH} S={TEST_SEQ} "
          f"HI={TEST_SHAPE['index_n_heads']}, float32)")

    def cfg(i, t):
        return jax_impl.CSAConfig(**TEST_SHAPE, indexer_head_chunk=i, loss_head_chunk=t)

    one = compiled_temp_bytes(cfg(1, 1), TEST_BATCH, TEST_SEQ)
    floor_1 = analytic_floor(cfg(1, 1), TEST_BATCH, TEST_SEQ)
    print(row("chunk 1 (temp + YNN scratch) / analytic floor", one["effective"] / floor_1["total"], FLOOR_FACTOR,
              "x") + "  (bound: at most)")
    if quick:
        return
    print(row("the same without jax.checkpoint (mutant)", mutant_memory_ratio("chunk_scan_without_checkpoint"),
              FLOOR_FACTOR, "x") + "  (should exceed it)")
    native = compiled_temp_bytes(cfg(0, 0), TEST_BATCH, TEST_SEQ)
    factor = 2 * TEST_SHAPE["index_n_heads"] * floor_1["A"] / (FLOOR_FACTOR * floor_1["total"])
    print(row("native temp / chunk 1 (temp + YNN scratch)", native["temp"] / one["effective"], factor, "x")
          + "  (bound: at least)")
    points = [(c, compiled_temp_bytes(cfg(c, 1), TEST_BATCH, TEST_SEQ)["temp"],
               analytic_floor(cfg(c, 1), TEST_BATCH, TEST_SEQ)["total"]) for c in (1, 2, 4, 8, 16)]
    _, worst, _ = grows_no_worse_than_linearly(points)
    print(row(f"per-head growth / its allowance (slack {MEMORY_GROWTH_SLACK:g})", worst, 1.0, "x")
          + "  (bound: at most)")


# --------------------------------------------------------------------------- main

SECTIONS = ("chunk", "floor", "orders", "fixtures", "memory", "backend")


# --------------------------------------------------------------------------- BACKEND


def backend_section(cases, dtypes=DTYPES) -> None:
    """The `xla` check's errors (Pallas vs XLA at the same knobs) over the default sample's
    pallas points, goldens mode (interpret mode off TPU: ~10-40 s a point)."""
    print("BACKEND (harness/judging/tolerance.py BACKEND): the pallas backend vs the XLA path, default "
          "sample's pallas points, goldens mode")
    worst: dict = {}
    for entry in build_matrix(cases=cases, dtypes=dtypes, backends=["pallas"]):
        if entry.quantity == "topk_indices":
            continue
        for r in evaluate(entry, reference="goldens"):
            if r.check.startswith("xla") and r.status in ("passed", "failed"):
                k = (entry.point.dtype, tolerance.numeric_kind(entry.quantity))
                worst[k] = max(worst.get(k, 0.0), float(r.error))
    for (dtype, kind), err in sorted(worst.items()):
        print(row(f"{dtype} {kind}", err, tolerance.BACKEND[dtype][kind]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="measure_tolerances.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"1 seed and {len(QUICK_CASES)} fixtures ({', '.join(QUICK_CASES)}) instead of 3 seeds and all")
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections (repeatable)")
    ap.add_argument("--dtype", choices=DTYPES, action="append", help="CHUNK, ORDERS, FIXTURE_CHECK: only these dtypes (repeatable)")
    ap.add_argument("--case", choices=list(CASES), action="append",
                    help="ORDERS, FIXTURE_CHECK and BACKEND: only these fixtures (repeatable)")
    args = ap.parse_args(argv)
    # The suite's settings (tests/conftest.py); set here, not on import, so that a test importing
    # this module keeps its own.
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    sys.stdout.reconfigure(line_buffering=True)  # each section's lines as they come, also into a pipe
    only = set(args.only or SECTIONS)
    seeds = range(1 if args.quick else 3)
    dtypes = tuple(d for d in DTYPES if d in (args.dtype or DTYPES))
    cases = args.case or (list(QUICK_CASES) if args.quick else list(CASES))
    start = time.time()
    print(f"jax {jax.__version__}, backend {platforms.current_backend()}, matmul precision highest"
          + (" (--quick)" if args.quick else ""))
    if "chunk" in only:
        chunk_section(seeds, dtypes)
    if "floor" in only:
        floor_section()
    if "orders" in only:
        orders_section(cases, dtypes)
    if "fixtures" in only:
        fixture_section(cases, dtypes)
    if "memory" in only:
        memory_section(args.quick)
    if "backend" in only:
        backend_section(cases, dtypes)
    print(f"done in {time.time() - start:.0f} s (bounds read from the harness; nothing is judged here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

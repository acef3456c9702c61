"""Subprocess of the mutation self-test (harness/selftest/mutations.py): import jax_impl from a
(mutated) copy, run a matrix slice against the fixture goldens (collect -> judge, like the matrix), print a
JSON report.

    python -m harness.selftest.mutation_worker --impl-root DIR [--point case:dtype:ichunk:tchunk ...]
                                      [--problem PINNED_NAME ...] [--memory] [--kernel] [--stop-on CHECK ...]

(`run()` is the same in a function: harness.selftest.mutations calls it in a child forked from a
server that has already imported jax, which saves ~2 s of imports per mutant.)

The package is installed editable: setuptools' meta-path finder maps `jax_impl` and
every `jax_impl.*` submodule to the checkout, whatever PYTHONPATH says. So a finder
inserted at sys.meta_path[0] resolves `jax_impl` from DIR and its submodules from the
package's own __path__, and the worker refuses to run (exit 3) unless every loaded
jax_impl module comes from DIR.

The last stdout line is JSON: {"jax_impl_file", "checks", "failed": [{"check",
"quantity", "context", "message"}], "killing": [check names], "error", "stopped_early"}. A crash of the
code under test (an exception while evaluating) is a failed check named "crash".
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import resource
import sys
import traceback

import numpy as np

PACKAGE = "jax_impl"


class _RedirectFinder(importlib.abc.MetaPathFinder):
    """Finds `jax_impl` under `root` and `jax_impl.*` in the package's own __path__."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname == PACKAGE:
            return importlib.machinery.PathFinder.find_spec(fullname, [self.root])
        if fullname.startswith(PACKAGE + "."):
            parent = sys.modules.get(fullname.rpartition(".")[0])
            if parent is None:
                return None
            return importlib.machinery.PathFinder.find_spec(fullname, list(parent.__path__))
        return None


def redirect(root: str) -> None:
    """Import jax_impl from root/jax_impl from now on (before anything imported it)."""
    root = os.path.abspath(root)
    if PACKAGE in sys.modules:
        raise RuntimeError(f"{PACKAGE} was imported before the redirect to {root}")
    sys.meta_path.insert(0, _RedirectFinder(root))


def foreign_modules(root: str) -> list[str]:
    """Loaded jax_impl modules whose file is not under root (must be none)."""
    root = os.path.abspath(root) + os.sep
    out = []
    for name, mod in list(sys.modules.items()):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            f = getattr(mod, "__file__", None) or ""
            if not os.path.abspath(f).startswith(root):
                out.append(f"{name} from {f}")
    return out


def memory_check() -> dict:
    """tests/test_memory.py's floor bound, on the mutated copy: chunk 1 holds at most
    harness.judging.tolerance.MEMORY_FLOOR_FACTOR x the analytic floor."""
    from ..judging.memory_bounds import within_floor_factor
    from ..judging.tolerance import MEMORY_FLOOR_FACTOR as MEMORY_FACTOR
    from jax_impl import CSAConfig

    from ..sides.compiled_memory import (TEST_BATCH as MEMORY_BATCH, TEST_SEQ as MEMORY_SEQ,
                                         TEST_SHAPE as MEMORY_SHAPE, analytic_floor, compiled_temp_bytes)

    cfg = CSAConfig(**MEMORY_SHAPE, indexer_head_chunk=1, loss_head_chunk=1)
    held = compiled_temp_bytes(cfg, MEMORY_BATCH, MEMORY_SEQ)["effective"]
    floor = analytic_floor(cfg, MEMORY_BATCH, MEMORY_SEQ)["total"]
    ok, ratio = within_floor_factor(held, floor)
    context = f"memory B={MEMORY_BATCH} S={MEMORY_SEQ} HI={MEMORY_SHAPE['index_n_heads']} ichunk=1 tchunk=1"
    return {
        "check": "memory", "quantity": "temp_bytes", "context": context, "passed": ok,
        "message": (f"[{context}] compiled temp + YNN scratch {held / 2**20:.2f} MiB = {ratio:.2f} x the "
                    f"analytic floor {floor / 2**20:.2f} MiB ({'ok' if ok else 'MISMATCH'}: up to "
                    f"{MEMORY_FACTOR:g} x allowed)"),
    }


def _failure(r) -> dict:
    return {"check": r.check, "quantity": r.quantity, "context": r.context, "message": r.message}


class ForeignImport(RuntimeError):
    """jax_impl (or one of its modules) did not come from the copy under test."""


def run(impl_root: str, points=(), memory: bool = False, reference: str = "goldens",
        cache_dir: str | None = None, problems=(), kernel: bool = False, stop_on=(), long_blocks=()) -> dict:
    """Import jax_impl from impl_root, run the slice, return the report (see the module doc).
    `stop_on`: check names; once one of them has failed, the slice's later parts are skipped, and
    a pinned problem (harness.problems.random_configs.check_problem) and the kernel check
    (harness.sides.kernel_check) skip their later stages.

    Must run in a process that has not imported jax_impl yet (a fresh interpreter, or a
    child forked from one that preloaded only jax, numpy and the harness)."""
    impl_root = os.path.abspath(impl_root)
    redirect(impl_root)
    os.environ["JAX_ENABLE_X64"] = "1"
    import jax

    from ..points import Point

    meshes = [p.mesh for p in (Point.parse(s) if isinstance(s, str) else s for s in points) if p.mesh]
    if meshes:  # sharded points: simulated CPU devices, set before the backend starts (it has not yet)
        jax.config.update("jax_num_cpu_devices", max(int(np.prod(m)) for m in meshes))
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    # CPU always: where the memory bound was measured, and never N workers preallocating one GPU.
    jax.config.update("jax_platforms", "cpu")
    if cache_dir:
        # Keyed by the compiled HLO (debug info stripped), so a mutant hits only programs its
        # mutation does not change (e.g. the native program of a chunking mutant). A size
        # limit turns on JAX's file lock: workers share the directory.
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.config.update("jax_compilation_cache_max_size", 2**31)
    import jax_impl

    foreign = foreign_modules(impl_root)
    if foreign:
        raise ForeignImport(f"jax_impl not imported from {impl_root}: {foreign}")

    from ..points import Point
    from ..problems.matrix import entries_at
    from ..run.collect import evaluate

    failed, checks, error = [], 0, ""

    def stopped() -> bool:
        return any(f["check"] in stop_on for f in failed)

    for spec in points:
        if stopped():
            break
        p = Point.parse(spec) if isinstance(spec, str) else spec
        try:
            for entry in entries_at(p):  # every mode and quantity of the point, as the matrix has them
                results = evaluate(entry, reference)
                checks += len(results)
                failed.extend(_failure(r) for r in results if r.failed)
        except Exception as exc:  # the code under test crashed: that kills it too, but say how
            error = f"{p.spec()}: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "-", "context": p.spec(), "message": error,
                           "traceback": traceback.format_exc(limit=-4)})
    for name in problems:  # pinned random problems (harness.problems.random_configs), live against torch
        if stopped():
            break
        try:
            from ..problems.random_configs import PINNED, check_problem

            results = check_problem(PINNED[name], stop_on=stop_on).results
            checks += len(results)
            failed.extend(_failure(r) for r in results if not r.passed)
        except Exception as exc:
            error = f"problem {name}: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "-", "context": f"problem {name}", "message": error,
                           "traceback": traceback.format_exc(limit=-4)})
    for spec in long_blocks:  # "CASE:BLOCK": a long case's query block, forward, float32, live (harness.run.long)
        if stopped():
            break
        try:
            from ..run.long import judge_case

            case, block = spec.rsplit(":", 1)
            results, _ = judge_case(case, ("float32",), ("forward",), query_blocks=(int(block),), log=lambda line: None)
            results = [r for _, r in results]
            checks += len(results)
            failed.extend(_failure(r) for r in results if r.failed)
        except Exception as exc:
            error = f"long {spec}: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "-", "context": f"long {spec}", "message": error,
                           "traceback": traceback.format_exc(limit=-4)})
    if kernel and not stopped():  # the Pallas kernels against the XLA path, partial tiles (harness.sides.kernel_check)
        try:
            from ..sides.kernel_check import kernel_check

            results = kernel_check(stop_on)
            checks += len(results)
            failed.extend(_failure(r) for r in results if r.failed)
        except Exception as exc:
            error = f"kernel: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "-", "context": "kernel", "message": error,
                           "traceback": traceback.format_exc(limit=-4)})
    if memory and not stopped():
        try:
            r = memory_check()
            checks += 1
            if not r.pop("passed"):
                failed.append(r)
        except Exception as exc:
            error = f"memory: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "temp_bytes", "context": "memory", "message": error})

    foreign = foreign_modules(impl_root)
    if foreign:
        raise ForeignImport(f"jax_impl modules from outside {impl_root}: {foreign}")
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process (a forked child starts at 0)
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "jax_impl_file": jax_impl.__file__,
        "checks": checks,
        "failed": failed,
        "killing": sorted({f["check"] for f in failed}),
        "error": error,
        "stopped_early": stopped(),
    }


def forked(conn, kwargs) -> None:
    """Entry point of a child forked by harness.selftest.mutations: run(**kwargs), the report (or the
    traceback) sent back through `conn`."""
    try:
        conn.send(("ok", run(**kwargs)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.selftest.mutation_worker")
    ap.add_argument("--impl-root", required=True, help="directory holding the jax_impl copy to import")
    ap.add_argument("--point", action="append", default=[], help="case:dtype:ichunk:tchunk[:qchunk] (repeatable)")
    ap.add_argument("--problem", action="append", default=[],
                    help="a pinned random problem of harness.problems.random_configs (repeatable; live torch)")
    ap.add_argument("--memory", action="store_true", help="run the compile-only memory check")
    ap.add_argument("--kernel", action="store_true", help="run the Pallas kernel check (harness.sides.kernel_check)")
    ap.add_argument("--reference", default="goldens", choices=["goldens", "live"])
    ap.add_argument("--long-block", action="append", default=[], metavar="CASE:BLOCK",
                    help="a long case's query block, judged forward in float32 (harness.run.long; repeatable)")
    ap.add_argument("--cache-dir", help="JAX persistent compilation cache shared by workers (optional)")
    ap.add_argument("--stop-on", action="append", default=[], metavar="CHECK",
                    help="stop the slice once this check has failed (repeatable; a mutant's expected kill)")
    args = ap.parse_args(argv)
    try:
        report = run(args.impl_root, args.point, args.memory, args.reference, args.cache_dir, args.problem,
                     args.kernel, tuple(args.stop_on), tuple(args.long_block))
    except ForeignImport as exc:
        print(f"mutation worker: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

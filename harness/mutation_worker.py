"""Subprocess of the mutation self-test (harness/mutations.py): import jax_impl from a
(mutated) copy, run a matrix slice against the fixture goldens, print a JSON report.

    python -m harness.mutation_worker --impl-root DIR [--point case:dtype:ichunk:tchunk ...] [--memory]

The package is installed editable: setuptools' meta-path finder maps `jax_impl` and
every `jax_impl.*` submodule to the checkout, whatever PYTHONPATH says. So a finder
inserted at sys.meta_path[0] resolves `jax_impl` from DIR and its submodules from the
package's own __path__, and the worker refuses to run (exit 3) unless every loaded
jax_impl module comes from DIR.

The last stdout line is JSON: {"jax_impl_file", "checks", "failed": [{"check",
"quantity", "context", "message"}], "killing": [check names], "error"}. A crash of the
code under test (an exception while evaluating) is a failed check named "crash".
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback

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


# The compile-only memory check: tests/test_memory.py's shape (HI*DI / W = 2, so an
# all-heads q is two [B, S, W] arrays) and its bound `chunk 1 holds at most twice the
# analytic floor` (measured 1.83 x with the checkpoint, 2.45 x without).
MEMORY_SHAPE = dict(
    emb_dim=64, q_lora_rank=64, index_n_heads=16, index_head_dim=64, rope_head_dim=32,
    compress_ratio=4, index_topk=16, num_query_heads=16, head_dim=64,
)
MEMORY_BATCH, MEMORY_SEQ, MEMORY_FACTOR = 1, 2048, 2.0


def memory_check() -> dict:
    from benchmarks.memory_speed import analytic_floor, compiled_temp_bytes
    from jax_impl import CSAConfig

    cfg = CSAConfig(**MEMORY_SHAPE, indexer_head_chunk=1, loss_head_chunk=1)
    held = compiled_temp_bytes(cfg, MEMORY_BATCH, MEMORY_SEQ)["effective"]
    floor = analytic_floor(cfg, MEMORY_BATCH, MEMORY_SEQ)["total"]
    ratio = held / floor
    ok = ratio <= MEMORY_FACTOR
    context = f"memory B={MEMORY_BATCH} S={MEMORY_SEQ} HI={MEMORY_SHAPE['index_n_heads']} ichunk=1 tchunk=1"
    return {
        "check": "memory", "quantity": "temp_bytes", "context": context, "passed": ok,
        "message": (f"[{context}] compiled temp + YNN scratch {held / 2**20:.2f} MiB = {ratio:.2f} x the "
                    f"analytic floor {floor / 2**20:.2f} MiB ({'ok' if ok else 'MISMATCH'}: up to "
                    f"{MEMORY_FACTOR:g} x allowed)"),
    }


def _failure(r) -> dict:
    return {"check": r.check, "quantity": r.quantity, "context": r.context, "message": r.message}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.mutation_worker")
    ap.add_argument("--impl-root", required=True, help="directory holding the jax_impl copy to import")
    ap.add_argument("--point", action="append", default=[], help="case:dtype:ichunk:tchunk (repeatable)")
    ap.add_argument("--memory", action="store_true", help="run the compile-only memory check")
    ap.add_argument("--reference", default="goldens", choices=["goldens", "live"])
    args = ap.parse_args(argv)

    redirect(args.impl_root)
    os.environ["JAX_ENABLE_X64"] = "1"
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax_impl

    foreign = foreign_modules(args.impl_root)
    if foreign:
        print(f"mutation worker: jax_impl not imported from {args.impl_root}: {foreign}", file=sys.stderr)
        return 3

    from harness.checks import evaluate
    from harness.matrix import build_matrix
    from harness.mutations import Point

    failed, checks, error = [], 0, ""
    for spec in args.point:
        p = Point.parse(spec)
        entries = build_matrix(cases=[p.case], dtypes=[p.dtype], ichunks=[p.ichunk], tchunks=[p.tchunk])
        try:
            for entry in entries:
                results = evaluate(entry, args.reference)
                checks += len(results)
                failed.extend(_failure(r) for r in results if not r.passed)
        except Exception as exc:  # the code under test crashed: that kills it too, but say how
            error = f"{spec}: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "-", "context": spec, "message": error,
                           "traceback": traceback.format_exc(limit=-4)})
    if args.memory:
        try:
            r = memory_check()
            checks += 1
            if not r.pop("passed"):
                failed.append(r)
        except Exception as exc:
            error = f"memory: {type(exc).__name__}: {exc}"
            failed.append({"check": "crash", "quantity": "temp_bytes", "context": "memory", "message": error})

    foreign = foreign_modules(args.impl_root)
    if foreign:
        print(f"mutation worker: jax_impl modules from outside {args.impl_root}: {foreign}", file=sys.stderr)
        return 3
    print(json.dumps({
        "jax_impl_file": jax_impl.__file__,
        "checks": checks,
        "failed": failed,
        "killing": sorted({f["check"] for f in failed}),
        "error": error,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

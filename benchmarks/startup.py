"""Start-up: what a fresh process pays before it computes anything.

    python -m benchmarks.startup              # 3 repeats of each figure, medians printed
    python -m benchmarks.startup --repeats 5

Each figure is measured in a fresh interpreter of this venv (`sys.executable`), so the
interpreter's own start and whatever bytecode the venv holds are part of it, as they are for a
`csa-parity` worker, a test subprocess or a mutation worker:

* imports: `import jax`, `import torch`, torch with deterministic algorithms switched on (what
  the live reference does before it computes), and the harness modules the report-writing
  process and the judge import (which must bring in neither framework);
* a worker's start-up: the first call into a `harness.sides.worker` worker process (spawned,
  imports done, one trivial call answered), timed from the parent;
* the venv's bytecode: the share of jax's and torch's modules with a `.pyc` for this
  interpreter. Without it (an install with `pip --no-compile` where PYTHONDONTWRITEBYTECODE is
  set, as in many containers) every process compiles those sources again.

Wall clock on a shared machine: compare figures taken in one session only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import time

IMPORTS = {
    "import jax": "import jax",
    "import torch": "import torch",
    "import torch + use_deterministic_algorithms": "import torch; torch.use_deterministic_algorithms(True)",
    "import harness.judging.judge (no jax, no torch)": (
        "import sys, harness.judging.judge; assert not {'jax', 'torch'} & set(sys.modules), 'a framework was imported'"),
    "import harness.run.report (no jax, no torch)": (
        "import sys, harness.run.report; assert not {'jax', 'torch'} & set(sys.modules), 'a framework was imported'"),
}

WORKER = """
import time, sys
t = time.perf_counter()
from harness.sides import worker
worker.isolated("os:getpid", label="start-up")
print(time.perf_counter() - t)
"""


def _seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _worker_seconds() -> float:
    out = subprocess.run([sys.executable, "-c", WORKER], check=True, cwd=_ROOT, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def bytecode_share(package: str) -> tuple[int, int]:
    """(modules of `package` with a .pyc for this interpreter, modules)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return 0, 0
    root = list(spec.submodule_search_locations)[0]
    have = total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                total += 1
                have += os.path.exists(importlib.util.cache_from_source(os.path.join(folder, name)))
    return have, total


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"python {sys.version.split()[0]} ({sys.executable}); PYTHONDONTWRITEBYTECODE="
          f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}; site-packages {sysconfig.get_paths()['purelib']}")
    for package in ("jax", "torch"):
        have, total = bytecode_share(package)
        if total:
            print(f"bytecode: {package}: {have} of {total} modules have a .pyc ({100 * have / total:.0f}%)")
    has_torch = importlib.util.find_spec("torch") is not None
    rows = []
    for label, code in IMPORTS.items():
        if "torch" in code and not has_torch:
            continue
        rows.append((label, [_seconds(code) for _ in range(args.repeats)]))
    rows.append(("a worker's start-up (first call answered)", [_worker_seconds() for _ in range(args.repeats)]))
    width = max(len(r[0]) for r in rows)
    print(f"{'fresh process':<{width}}  median s  (all runs)")
    for label, secs in rows:
        print(f"{label:<{width}}  {statistics.median(secs):8.2f}  ({', '.join(f'{s:.2f}' for s in secs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

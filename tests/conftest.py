"""Shared test set-up: JAX 64-bit mode (the float64 oracle needs it), one persistent cache
directory per test run, and the sharded slice kept out of the main process.

The cache: the CLI and workflow tests start `csa-parity` processes that compile programs this
process has already compiled (tiny, packed and small points of the same configs and shapes).
The process that loads this file first (pytest itself, or the xdist controller) creates one
directory and exports it twice: CSA_PARITY_CACHE_DIR (where `csa-parity run` keeps its caches,
the compilation cache in its `xla/`) and JAX_COMPILATION_CACHE_DIR (that same `xla/`, read when
jax is imported, for this process and the mutation workers). xdist workers and every
subprocess inherit both, so a program compiled once in the run is loaded, not compiled, after
that, and no test writes to the user's own cache. JAX keys the cache by the compiled HLO and
the JAX/XLA version and flags, so a mutated jax_impl copy only reuses programs its mutation
leaves unchanged. It is removed when the run ends. CSA_PARITY_XLA_CACHE=DIR keeps one across
runs instead; CSA_PARITY_XLA_CACHE=off turns the in-process one off (to measure what it saves).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_ENABLE_X64", "1")

import harness  # noqa: E402

# torch's CPU kernels, harness.TORCH_CPU_CAPABILITY, pinned before any test runs one (explicitly:
# the pytest plugin, loaded before this file, took back what importing the harness pinned).
harness.pin_cpu_kernels()


def _share_one_compilation_cache() -> None:
    wanted = os.environ.get("CSA_PARITY_XLA_CACHE", "")
    if wanted == "off" or os.environ.get("CSA_PARITY_CACHE_DIR") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return  # off, or inherited from the process that started this run (or set by the user)
    if wanted:
        os.makedirs(wanted, exist_ok=True)
        path = wanted
    else:
        path = tempfile.mkdtemp(prefix="csa-parity-xla-cache-")
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    os.environ["CSA_PARITY_CACHE_DIR"] = path
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(path, "xla")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program, however quick
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(2**32)  # a size limit turns on JAX's file lock


_share_one_compilation_cache()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


_HERE = os.path.dirname(os.path.abspath(__file__))
# Slices that run in a pytest process of their own (the Makefile starts each): tests/sharded
# needs 8 simulated devices set before JAX starts; tests/multihost starts processes that run
# one program together, which a plain run's other work would slow past its deadlines.
_OWN_PROCESS = tuple(os.path.join(_HERE, d) for d in ("sharded", "multihost"))


def pytest_ignore_collect(collection_path, config):
    """A plain `pytest` leaves the own-process slices out; naming one (`pytest tests/sharded`,
    `pytest tests/multihost -m multihost`) collects it."""
    if str(collection_path) not in _OWN_PROCESS:
        return None
    asked = [os.path.abspath(str(a).split("::")[0]) for a in config.args]
    return None if any(a.startswith(str(collection_path)) for a in asked) else True


# Parity runs at `highest` matmul precision unless a profile is asked for (the TPU job
# may set CSA_PARITY_PRECISION=default); the matrix judges with the matching profile.
PRECISION = os.environ.get("CSA_PARITY_PRECISION", "highest")
jax.config.update("jax_default_matmul_precision", PRECISION)


def pytest_addoption(parser):
    parser.addoption("--repro", default="", metavar="JSON",
                     help="tests/test_random_configs.py::test_repro reruns this problem (the one-line "
                          "JSON a failing random problem prints)")


# --- torch: tests marked `torch` skip only on the leg without torch on purpose.
from needs import TORCH_SKIP, excused  # noqa: E402


# The matrix runs first and the tests that start processes compiling the same programs
# (mutation workers' clean run, csa-parity runs of the CLI and workflow tests) right after it,
# so that they load those programs from the run's compilation cache instead of compiling them.
# The crash-isolation tests before the mutation self-test: `make test` runs both in its side
# process, and their ~40 s of waiting on timed-out (sleeping) workers then fall while .ci/run's
# Python 3.12 leg still shares that CPU, which uses them.
FIRST = ("test_parity_matrix.py", "test_isolation.py", "test_mutations.py", "test_cli.py", "test_workflows.py")
# Tests that run last in their process: the mutation self-test's clean run executes the very matrix
# points `make test`'s main process judges first (its slices are points of the ci sample). Run
# beside that matrix it compiled the same programs at the same time (105 s in .ci/run); after
# everything else in the side process (the matrix long done) it loads them from the run's cache.
LAST = ("test_mutations.py::test_clean_code_passes_every_slice",)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    last = {name: i for i, name in enumerate(LAST)}

    def order(item):
        key = f"{item.path.name}::{item.name}"
        return (key in last, last.get(key, 0), rank.get(item.path.name, len(FIRST)))

    items.sort(key=order)  # stable: file order kept otherwise
    if not excused():
        return
    for item in items:
        if item.get_closest_marker("torch"):
            item.add_marker(pytest.mark.skip(reason=TORCH_SKIP))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not excused():
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if TORCH_SKIP in str(r.longrepr)]
    terminalreporter.write_line(f"csa-parity: {len(skipped)} test(s) or module(s) skipped because this leg "
                                "has no torch on purpose (CSA_PARITY_NO_TORCH=1); every other test ran")

"""Shared test set-up: JAX 64-bit mode (the float64 oracle needs it) and small random problems."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


_SHARDED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded")


def pytest_ignore_collect(collection_path, config):
    """tests/sharded needs 8 simulated devices set before JAX starts, so it runs in its own
    process (`pytest tests/sharded`, see the Makefile); a plain `pytest` leaves it out."""
    if str(collection_path) != _SHARDED:
        return None
    asked = [os.path.abspath(str(a).split("::")[0]) for a in config.args]
    return None if any(a.startswith(_SHARDED) for a in asked) else True


# Parity runs at `highest` matmul precision unless a profile is asked for (the TPU job
# may set CSA_PARITY_PRECISION=default); the matrix judges with the matching profile.
PRECISION = os.environ.get("CSA_PARITY_PRECISION", "highest")
jax.config.update("jax_default_matmul_precision", PRECISION)


def pytest_addoption(parser):
    parser.addoption("--repro", default="", metavar="JSON",
                     help="tests/test_random_configs.py::test_repro reruns this problem (the one-line "
                          "JSON a failing random problem prints)")


# --- torch (issue 14): tests marked `torch` skip only on the leg without torch on purpose.
from needs import TORCH_SKIP, excused  # noqa: E402


def pytest_collection_modifyitems(config, items):
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

"""The sharded slice: the indexer and its loss on a mesh of 8 simulated CPU devices.

XLA reads `--xla_force_host_platform_device_count` once, when JAX starts its CPU backend, so
this slice runs in a pytest process of its own (`.ci/run`):

    python -m pytest tests/sharded -n 0

The flag and 64-bit mode are set below, before jax is imported. If JAX was already started
(e.g. this directory collected together with tests/ in one process) with fewer devices, every
test here is skipped with that reason instead of failing.
"""

from __future__ import annotations

import os
import sys

DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

_jax_started_before = False
if "jax" in sys.modules:
    from jax._src import xla_bridge as _xb

    _jax_started_before = _xb.backends_are_initialized()
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

_HERE = os.path.dirname(os.path.abspath(__file__))


def skip_reason() -> str | None:
    """Why this slice cannot run in this process, or None."""
    backend = jax.default_backend()
    if backend != "cpu":
        return (f"the sharded slice runs on {DEVICES} simulated CPU devices; JAX's backend here is "
                f"{backend!r} (run it with JAX_PLATFORMS=cpu)")
    n = jax.device_count()
    if n < DEVICES:
        why = ("JAX was started before tests/sharded/conftest.py could set XLA_FLAGS"
               if _jax_started_before else f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
        return (f"needs {DEVICES} CPU devices, JAX has {n} ({why}); run this slice in its own "
                f"process: python -m pytest tests/sharded -n 0")
    return None


def pytest_configure(config):
    # Also registered in pyproject.toml; repeated here so the slice runs under --strict-markers
    # from any checkout.
    config.addinivalue_line("markers", "sharded: the multi-device (simulated CPU mesh) slice")


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if str(it.path).startswith(_HERE + os.sep)]
    if not mine:
        return
    reason = skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.sharded)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter):
    """test_sharded.py's worst ratio per check, dtype and quantity, over the entries that ran."""
    module = next((m for name, m in list(sys.modules.items())
                   if name.rsplit(".", 1)[-1] == "test_sharded" and hasattr(m, "WORST")), None)
    if module is None or not module.WORST:
        return
    terminalreporter.write_sep("-", "sharded slice: worst ratio (error / bound) per check, dtype and quantity")
    for (check, dtype, column), (ratio, where) in sorted(module.WORST.items()):
        terminalreporter.write_line(f"{check:<12} {dtype:<8} {column:<16} {ratio:.3g}  ({where})")

"""The two-process slice: tests/multihost starts `python -m harness.run.multihost --local 2` (two
processes of 4 simulated CPU devices each, one program over the 8) and judges what they wrote.

It runs in a pytest process of its own, by name and marker (the Makefile's `test` target):

    python -m pytest tests/multihost -n 0 -m multihost

A plain `pytest` does not collect this directory (tests/conftest.py), and a run that collects
it without `-m multihost` (or CSA_PARITY_MULTIHOST=1) deselects its tests: each starts
processes that compete for the cores with whatever else the run does, against deadlines.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    # Also registered in pyproject.toml; repeated so the slice runs under --strict-markers from any checkout.
    config.addinivalue_line("markers", "multihost: the two-process slice (tests/multihost, own process)")


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if str(it.path).startswith(_HERE + os.sep)]
    if not mine:
        return
    asked = "multihost" in (config.option.markexpr or "") or os.environ.get("CSA_PARITY_MULTIHOST") == "1"
    if asked:
        return
    config.hook.pytest_deselected(items=mine)
    items[:] = [it for it in items if it not in mine]

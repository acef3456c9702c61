"""Which tests need torch, and what happens where it is absent.

The Python 3.12 leg runs without torch ON PURPOSE and says so with CSA_PARITY_NO_TORCH=1:
there, and only there, a test that needs torch skips with `TORCH_SKIP` (conftest prints how
many). Anywhere else a missing torch is not excused: the test runs and fails on its import.
Mark a single test `@pytest.mark.torch`; a module that imports torch at its top calls
`skip_module_without_torch()` first.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None
NO_TORCH_LEG = os.environ.get("CSA_PARITY_NO_TORCH") == "1"
TORCH_SKIP = "needs torch (the live reference); this leg runs without it on purpose (CSA_PARITY_NO_TORCH=1)"


def excused() -> bool:
    """True only where torch is missing AND the leg declared it has none on purpose."""
    return NO_TORCH_LEG and not HAVE_TORCH


def skip_module_without_torch() -> None:
    if excused():
        pytest.skip(TORCH_SKIP, allow_module_level=True)

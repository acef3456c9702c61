"""Shared test set-up: JAX 64-bit mode (the float64 oracle needs it) and small random problems."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_ENABLE_X64", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

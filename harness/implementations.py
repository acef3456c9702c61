"""Implementations under test: the protocol, the built-ins and `module:factory` plug-ins.

An implementation is any object (a module works) with the three names of
docs/API.md: `CSAConfig` (with `from_dict`), `indexer_forward(params, inputs,
cfg, dtype)` and `indexer_loss_and_grads(params, inputs, cfg, dtype,
selection=None)`. The harness builds the config from the case's plain dict and
passes params and inputs as dicts of numpy arrays keyed by the canonical SPEC
names, layout [in, out].

Parameter layout: both built-in sides take the canonical [in, out] layout, so
the mapping from canonical names to a side's layout is the identity. A plug-in
that keeps another layout (torch nn.Linear is [out, in]) converts inside its own
entry points; `PARAM_LAYOUT` below is the one place the harness records it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

PROTOCOL = ("CSAConfig", "indexer_forward", "indexer_loss_and_grads")

# Built-in candidates, by short name -> "module" or "module:factory".
BUILTINS = {"jax": "jax_impl"}

# Canonical name -> layout each built-in side expects (identity for both).
PARAM_LAYOUT = {"jax": "[in, out]", "torch": "[in, out]"}


class ImplementationError(ValueError):
    """A plug-in that cannot be loaded or does not follow the protocol."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str  # the spec it was loaded from, e.g. "jax" or "mypkg.kernels:make_impl"
    api: Any  # object with the PROTOCOL names

    def config(self, config: dict):
        return self.api.CSAConfig.from_dict(dict(config))


def load_implementation(spec: str) -> Implementation:
    """`jax` (built-in), `package.module` (the module itself) or `package.module:factory`
    (the object `factory()` returns)."""
    target = BUILTINS.get(spec, spec)
    module_name, _, factory = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises on import
        raise ImplementationError(
            f"implementation {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            f"expected 'jax' or 'package.module[:factory]'"
        ) from None
    api = module
    if factory:
        if not hasattr(module, factory):
            raise ImplementationError(f"implementation {spec!r}: module {module_name!r} has no {factory!r}")
        api = getattr(module, factory)()
    missing = [name for name in PROTOCOL if not callable(getattr(api, name, None))]
    if missing:
        raise ImplementationError(
            f"implementation {spec!r} lacks {', '.join(missing)} (the protocol of docs/API.md: "
            f"{', '.join(PROTOCOL)})"
        )
    return Implementation(spec, api)

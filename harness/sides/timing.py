"""Where a point's time goes, and the persistent caches that make a rerun cheap.

A `csa-parity run` worker splits each point's wall time into shares (SHARES):

  startup    the worker process starting (spawn, imports) before its first point; 0 after
  trace      JAX tracing the programs to jaxprs          (jax.monitoring events)
  lower      jaxprs lowered to StableHLO                 (jax.monitoring events)
  compile    XLA compiling the programs, or loading them from the compilation cache
  run        the implementation's calls, less the three above: running the programs
  reference  the reference's outputs (torch_ref live, or the fixture goldens; loading the
             fixture when it comes first)
  judge      the stored order errors, judging and the records: the point's wall time less the
             implementation's and the reference's calls

and counts the programs it obtained: loaded from the persistent compilation cache or
compiled. The figures are differences of per-process counters (`snapshot`) taken around the
point, so what a worker caches in memory from one point to the next shows as the time it saves.

The caches live under one directory (`cache_root`): `xla/`, JAX's persistent compilation cache,
and `reference/`, the live reference's and the built-in JAX implementation's outputs
(harness.sides.reference_cache: a rerun of an unchanged jax_impl reads a point's outputs back). JAX keys each program
by the program itself (its StableHLO, the compile options, the jax and jaxlib versions, the
backend and the flags that change code generation), so an edited `jax_impl` that compiles to
another program misses and is compiled, and an entry can never be served to a program it was
not compiled from.
"""

from __future__ import annotations

import contextlib
import os
import time

SHARES = ("startup", "trace", "lower", "compile", "run", "reference", "judge")
COUNTS = ("programs_loaded", "programs_compiled", "references_loaded", "references_computed", "outputs_loaded")
# The compilation cache's size bound: JAX evicts the least recently used programs above it.
# Measured on CPU: 78 programs (the ci sample's small and flash_dims points) take 5.6 MB.
XLA_CACHE_MAX_BYTES = 1 << 30

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compilation or a cache load, each program
_HIT = "/jax/compilation_cache/cache_hits"

_SECONDS: dict[str, float] = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "implementation": 0.0, "reference": 0.0}
_EVENTS: dict[str, int] = {"programs": 0, "programs_loaded": 0, "references_loaded": 0, "references_computed": 0,
                           "outputs_loaded": 0}
_STACK: list[list[float]] = []  # [start, time spent in inner sections] of each open section
_LISTENING = False


def cache_root(explicit: str | None = None) -> str:
    """The cache directory: `explicit` (--cache-dir), else CSA_PARITY_CACHE_DIR, else
    $XDG_CACHE_HOME/csa-parity, else ~/.cache/csa-parity."""
    if explicit:
        return os.path.abspath(explicit)
    if os.environ.get("CSA_PARITY_CACHE_DIR"):
        return os.path.abspath(os.environ["CSA_PARITY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "csa-parity")


def use_caches(root: str | None) -> None:
    """This process's persistent caches under `root`, or none (None): compiled programs and the
    live reference's outputs."""
    from . import reference_cache

    use_compilation_cache(root)
    reference_cache.use(root)


def use_compilation_cache(root: str | None) -> None:
    """JAX's persistent compilation cache in `root`/xla for every program of this process, however
    quick to compile, bounded by XLA_CACHE_MAX_BYTES; `root` None: no persistent cache at all
    (also none that the environment names)."""
    import jax

    if root is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = os.path.join(root, "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", XLA_CACHE_MAX_BYTES)


def listen() -> None:
    """Count JAX's trace, lower and compile time and its cache hits in this process (once)."""
    global _LISTENING
    if _LISTENING:
        return
    from jax import monitoring

    shares = {_TRACE: "trace", _LOWER: "lower", _COMPILE: "compile"}

    def on_duration(event: str, seconds: float, **_) -> None:
        share = shares.get(event)
        if share is not None:
            _SECONDS[share] += seconds
            if share == "compile":
                _EVENTS["programs"] += 1

    def on_event(event: str, **_) -> None:
        if event == _HIT:
            _EVENTS["programs_loaded"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    _LISTENING = True


_TEMPS: list[int] = []  # the compiled temp (bytes) of each program this process ran since `take_temps`


def note_temp(memory: dict | None) -> None:
    """A program ran here whose XLA memory analysis is `memory` (jax_impl.api.compiled_memory;
    None: the backend gives none)."""
    if memory is not None:
        _TEMPS.append(int(memory["temp"]))


def temps_mark() -> int:
    return len(_TEMPS)


def temps_since(mark: int) -> list[int]:
    """The temps noted since `temps_mark()` returned `mark`."""
    return _TEMPS[mark:]


def take_temps() -> list[int]:
    """The temps noted since the last call (a worker's point), and none kept."""
    out = list(_TEMPS)
    _TEMPS.clear()
    return out


def count(event: str) -> None:
    """One more `event` in this process (`references_loaded`, `references_computed`, `outputs_loaded`)."""
    _EVENTS[event] += 1


@contextlib.contextmanager
def section(share: str):
    """Time a call into an implementation (`implementation`) or a reference (`reference`). The
    time of a section inside another (a stage plug-in reading the reference's stage) counts as
    the inner one's only."""
    _STACK.append([time.perf_counter(), 0.0])
    try:
        yield
    finally:
        start, inner = _STACK.pop()
        spent = time.perf_counter() - start
        _SECONDS[share] += spent - inner
        if _STACK:
            _STACK[-1][1] += spent


def snapshot() -> dict[str, float]:
    """This process's counters now (a point's figures are the difference of two: `split`)."""
    return {**_SECONDS, **_EVENTS, "clock": time.perf_counter()}


def split(before: dict[str, float], after: dict[str, float], startup: float = 0.0) -> dict[str, float]:
    """The shares (SHARES, seconds) and program counts (COUNTS) between two snapshots."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    jax_s = d["trace"] + d["lower"] + d["compile"]
    out = {"startup": startup, "trace": d["trace"], "lower": d["lower"], "compile": d["compile"],
           "run": max(0.0, d["implementation"] - jax_s), "reference": d["reference"],
           "judge": max(0.0, d["clock"] - d["implementation"] - d["reference"])}
    out = {k: round(v, 3) for k, v in out.items()}
    out["programs_loaded"] = int(d["programs_loaded"])
    out["programs_compiled"] = int(d["programs"] - d["programs_loaded"])
    out["references_loaded"] = int(d["references_loaded"])
    out["references_computed"] = int(d["references_computed"])
    out["outputs_loaded"] = int(d["outputs_loaded"])
    return out

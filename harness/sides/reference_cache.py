"""The built-in sides' outputs kept on disk between `csa-parity run`s.

torch_ref computes the same outputs for the same fixture whatever the implementation under test
does, so a rerun reads them back instead of starting torch (its import and its deterministic
mode cost a worker seconds; a large case's float64 backward more). The same holds for the values
of one stage a stage plug-in is judged on (its inputs and the reference's output and gradients):
each worker of a stage plug-in's run, the one that replaces a crashed worker included, reads them. An entry is keyed by
everything its values follow from: the fixture file's bytes (sha256), the point's dtype and
teacher, the loss variants, the source of torch_ref and of the harness modules that call it
and name its outputs, the versions of torch, numpy, ml_dtypes and Python, the machine and
torch's CPU kernel choice (every variable of harness.ISA_VARIABLES: ATen's, oneDNN's and MKL's).

The built-in JAX implementation's outputs at a point are kept the same way, so that a rerun of
an unchanged `jax_impl` neither traces, compiles nor runs a program: keyed by the fixture's
bytes, the point (every knob), the source of jax_impl and of the harness modules that call it,
the versions of jax, jaxlib, numpy, ml_dtypes and Python, the backend, its devices, the CPU's
instruction set, the 64-bit and matmul-precision settings and every XLA_ / JAX_ / LIBTPU
environment variable but the caches' own. A plug-in's outputs are never kept: its code is
not known to the harness (its programs still come from JAX's compilation cache).

A change to any part of a key is another key, so a stale entry is never read: it is left to
age out (least recently used first, above MAX_BYTES).

Off unless `use(root)` named a cache directory: the CLI's workers do, and a plug-in's worker
outside the CLI (harness.sides.worker.isolated, e.g. under the pytest plugin) where
CSA_PARITY_CACHE_DIR names one; a pytest process itself does not.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import pickle
import platform
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .. import ISA_VARIABLES

# The default matrix's references take about as much as its fixtures (~20 MB), the JAX outputs of
# its points about 10 times more (each point holds every loss variant's gradients).
MAX_BYTES = 1 << 30
_ROOT: Path | None = None
_HARNESS = Path(__file__).resolve().parents[1]
# The code that decides a cached value: the reference package (wherever it is imported from) and
# the harness modules that call it and map its results to canonical names, and the vocabulary
# those names come from.
HARNESS_SOURCES = ("sides/implementations.py", "outputs.py", "judging/compare.py")


def use(root: str | None) -> None:
    """Read and write entries under `root`/reference (None: off)."""
    global _ROOT
    _ROOT = None if root is None else Path(root) / "reference"


def enabled() -> bool:
    return _ROOT is not None


@functools.lru_cache(maxsize=None)
def _file_sha(path: str, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_sha(path: Path) -> str:
    st = path.stat()
    return _file_sha(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def sources_sha() -> str:
    """sha256 over the source files of the torch_ref package this process imports (found, not
    imported: torch stays unloaded) and of HARNESS_SOURCES."""
    spec = importlib.util.find_spec("torch_ref")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch_ref cannot be found: the live reference needs it")
    package = Path(list(spec.submodule_search_locations)[0])
    files = [("torch_ref", f) for f in sorted(package.rglob("*.py"))]
    files += [("harness", _HARNESS / name) for name in HARNESS_SOURCES]
    h = hashlib.sha256()
    for root, f in files:
        name = f.relative_to(package if root == "torch_ref" else _HARNESS)
        h.update(f"{root}/{name}".encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def jax_impl_sha() -> str:
    """sha256 over the source files of the jax_impl package this process imports (its Pallas
    kernels included) and of HARNESS_SOURCES."""
    spec = importlib.util.find_spec("jax_impl")
    package = Path(list(spec.submodule_search_locations)[0])
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(f"jax_impl/{f.relative_to(package)}".encode() + b"\0" + f.read_bytes() + b"\0")
    for name in HARNESS_SOURCES:
        h.update(f"harness/{name}".encode() + b"\0" + (_HARNESS / name).read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def cpu_features() -> str:
    """The CPU's model and instruction-set flags (XLA:CPU generates code for them), or "" where
    the system does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return hashlib.sha256("\n".join(sorted(set(keep))).encode()).hexdigest()


def jax_key_parts(fixture_path: Path, point_spec: str) -> dict:
    """Everything the JAX implementation's outputs at a point follow from (their key is the sha256)."""
    import jax

    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("XLA_", "JAX_", "LIBTPU")) and "CACHE" not in k}
    return {"outputs_of": "jax_impl", "fixture_sha256": file_sha(fixture_path), "point": point_spec,
            "sources_sha256": jax_impl_sha(), "jax": _version("jax"), "jaxlib": _version("jaxlib"),
            "numpy": _version("numpy"), "ml_dtypes": _version("ml_dtypes"), "python": sys.version,
            "machine": platform.machine(), "cpu": cpu_features(), "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision), "env": env}


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def key_parts(fixture_path: Path, dtype: str, teacher: str, variants) -> dict:
    """Everything a cached reference output follows from (its key is their sha256)."""
    return {"fixture_sha256": file_sha(fixture_path), "dtype": dtype, "teacher": teacher,
            "variants": list(variants), "sources_sha256": sources_sha(), "torch": _version("torch"),
            "numpy": _version("numpy"), "ml_dtypes": _version("ml_dtypes"), "python": sys.version,
            "machine": platform.machine(),
            "cpu_kernels": {name: os.environ.get(name, "") for name in ISA_VARIABLES}}


def stage_key_parts(fixture_path: Path, dtype: str, stage: str) -> dict:
    """Everything the reference's values of one stage (a stage plug-in's inputs and oracle,
    harness.sides.implementations.reference_stage_values) follow from: key_parts' without the
    teacher and the loss variants, which no stage reads."""
    parts = key_parts(fixture_path, dtype, "", ())
    del parts["teacher"], parts["variants"]
    return {**parts, "reference_stage": stage}


def key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load(k: str):
    """The value stored under key `k`, or None."""
    path = _ROOT / f"{k}.pickle"
    try:
        with open(path, "rb") as f:
            value = pickle.load(f)
    except Exception:  # absent, or unreadable (damaged, or written by another numpy): computed again
        return None
    with contextlib.suppress(OSError):  # recently used (unless another process removed it meanwhile)
        os.utime(path)
    return value


def store(k: str, value) -> None:
    """Store `value` under key `k` (written whole, then renamed), then trim to MAX_BYTES."""
    _ROOT.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=_ROOT, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, _ROOT / f"{k}.pickle")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _trim()


def _trim() -> None:
    for p in _ROOT.glob("*.tmp"):  # a worker killed while writing leaves one: gone after an hour
        try:
            if time.time() - p.stat().st_mtime > 3600:
                p.unlink()
        except OSError:
            pass
    entries = []
    for p in _ROOT.glob("*.pickle"):
        try:
            st = p.stat()
        except OSError:  # removed by another worker meanwhile
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries):
        if total <= MAX_BYTES:
            break
        p.unlink(missing_ok=True)
        total -= size

"""What each JAX backend computes, as data, and which matrix points it cannot.

One `Platform` row per backend (cpu, gpu, tpu): whether it has IEEE float64 and float16, and
what each matmul precision means for a float32 matmul there (the mantissa its operands keep).
Two things read it:

- `not_applicable(dtype, kind, backend)`: a pure function, None when the backend can
  compute the point, else the reason. Such a point is reported with the status "not
  applicable on <backend>: <reason>": counted and listed in every report, never dropped,
  never counted as passed (harness.run.collect / harness.judging.judge / harness.run.report; pytest skips it
  with the reason).
- `float32_operand_bits(backend, precision)`: the mantissa bits a float32 matmul operand
  keeps under a precision; harness.judging.tolerance turns it into the float32 floor of the
  `default` profile per backend (a TPU's one bfloat16 pass is not a GPU's TF32).

Sources: XLA:TPU has no native float64 (it emulates some 64-bit operations, not as IEEE
double, and rejects others), so the 1e-12 exactness checks cannot hold there; they come from
the CPU leg. XLA:TPU's DEFAULT precision rounds float32 matmul operands to bfloat16 (8-bit
significand, 7 bits stored) for one pass, HIGH takes three bfloat16 passes (~16 bits),
HIGHEST six (float32). XLA:GPU's DEFAULT on Ampere and later uses TF32 (10 stored mantissa
bits), HIGHEST true float32. XLA:CPU ignores the precision setting: every float32 matmul is
true float32. The TPU rows were measured on one TPU v5e chip (scripts/measure_platform_profile.py:
a float32 matmul at HIGHEST 2.1 units of 2^-24 from float64, at DEFAULT 35860, docs/platforms.md);
the GPU row has not been run yet.

The table and the matrix points a backend cannot compute: `python -m harness.run.platform_table`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

from . import package_data

BACKENDS = ("cpu", "gpu", "tpu")
KINDS = ("forward", "topk", "loss", "grad", "isolation", "codes")  # harness.points.Entry.kind


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str
    float64: str | None  # None: IEEE double; else why float64 points are not applicable
    float16: str | None  # None: computes float16; else why not
    # matmul precision -> (stored mantissa bits a float32 operand keeps, what it means)
    matmul: dict[str, tuple[int, str]]


PLATFORMS: dict[str, Platform] = {
    "cpu": Platform(
        "cpu", None, None,
        {"highest": (23, "true float32 products"),
         "default": (23, "same as highest: XLA:CPU ignores the matmul precision")}),
    "gpu": Platform(
        "gpu", None, None,
        {"highest": (23, "true float32 products"),
         "default": (10, "TF32 on Ampere and later: operands rounded to a 10-bit mantissa, "
                         "float32 accumulation")}),
    "tpu": Platform(
        "tpu",
        "XLA:TPU has no IEEE float64 (some 64-bit operations are emulated, not as IEEE "
        "double, others rejected): the float64 oracle and exactness checks come from the CPU leg",
        None,
        {"highest": (23, "six bfloat16 passes: float32 products"),
         "default": (7, "one bfloat16 pass: operands rounded to bfloat16 (7 stored bits), "
                        "float32 accumulation")}),
}


def platform(backend: str) -> Platform:
    try:
        return PLATFORMS[backend]
    except KeyError:
        raise ValueError(f"backend={backend!r} is not known (valid: {', '.join(BACKENDS)})") from None


def current_backend() -> str:
    """The backend JAX runs on in this process (tests monkeypatch this to ask 'what if tpu')."""
    import jax

    return jax.default_backend()


def float32_operand_bits(backend: str, precision: str) -> int:
    """Stored mantissa bits of a float32 matmul operand under `precision` on `backend`."""
    table = platform(backend).matmul
    if precision not in table:
        raise ValueError(f"precision={precision!r} is not supported (valid: {', '.join(table)})")
    return table[precision][0]


def not_applicable(dtype: str, kind: str, backend: str) -> str | None:
    """None when `backend` can compute a matrix entry of `dtype` and kind `kind` (forward,
    topk, loss, grad, isolation, codes: harness.points.Entry.kind), else the reason. Today only the
    dtype decides (every kind of a float64 point needs float64 arithmetic); the kind is part
    of the question so a backend row can exclude one kind without changing any caller.
    Pure: the same answer for the same arguments, whatever runs this process."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not known (valid: {', '.join(KINDS)})")
    p = platform(backend)
    if dtype == "float64" and p.float64 is not None:
        return p.float64
    if dtype == "float16" and p.float16 is not None:
        return p.float16
    return None


def not_applicable_label(backend: str, reason: str) -> str:
    return f"not applicable on {backend}: {reason}"


def selection(entries, backend: str) -> dict[str, list]:
    """{reason label: [entries]} of the matrix entries `backend` cannot compute."""
    out: dict[str, list] = {}
    for e in entries:
        reason = not_applicable(e.point.dtype, e.kind, backend)
        if reason is not None:
            out.setdefault(not_applicable_label(backend, reason), []).append(e)
    return out


# --- The device a process computes on, as reports record it, and who may open it.
# libtpu gives a TPU host's chips to one process at a time: a second process that opens the
# backend gets "ABORTED: The TPU is already in use by process with pid N". So on such a backend
# the process that writes the reports never opens it; the workers (harness.sides.worker) each
# call `device_info` as they start, and tell the parent what they found.
ONE_PROCESS_BACKENDS = ("tpu",)
# A test hook: a path whose exclusive lock stands for the chip. A process that calls
# `device_info` takes the lock (held until it exits) and reports one process per host; a second
# one fails as libtpu's second process does. tests/test_accelerator_cli.py runs the CLI's
# accelerator path on CPU with it.
FAKE_EXCLUSIVE_ENV = "CSA_PARITY_FAKE_EXCLUSIVE"
# The x86 ISA extensions XLA:CPU's and torch's kernels choose their code paths by (read from
# /proc/cpuinfo): two CPU reports of one commit can differ in the last bits of float32 GEMMs
# when these differ.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "amx_int8")
IN_USE = "already in use"  # libtpu's words when another process holds the chip
LOCKFILE = "libtpu multi-process lockfile"  # and when two processes open it at the same moment

_held_lock = None  # the fake chip's lock file, held for this process's life


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, a container's cpuset), which is
    what a default count of workers should follow; os.cpu_count() counts the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return os.cpu_count() or 1


def may_be_one_process() -> bool:
    """Whether JAX here may open a backend whose chips one process at a time may hold (libtpu
    installed, or a TPU's /dev/accel* present, and JAX_PLATFORMS not naming other backends
    only), read without opening anything: then csa-parity run starts one worker, learns the
    device from it, and starts more only where the device allows."""
    import glob
    import importlib.util

    if os.environ.get(FAKE_EXCLUSIVE_ENV):
        return True
    named = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if named and not any(p in ONE_PROCESS_BACKENDS for p in named):
        return False
    return importlib.util.find_spec("libtpu") is not None or bool(glob.glob("/dev/accel*"))


class DeviceBusy(RuntimeError):
    """The accelerator is held by another process: one line naming the cause and the fix."""


def busy_line(error: str, backend: str = "tpu") -> str:
    """The one line a run stops with when `error` (the backend's own message) says another
    process holds the chip."""
    import re

    pid = re.search(r"pid (\d+)", error)
    who = f"process {pid.group(1)}" if pid else "another process"
    return (f"the {backend.upper()} is in use by {who} ({error.strip().splitlines()[0]}); a {backend.upper()} chip "
            f"opens in one process at a time: end {who}, or wait for it to finish, then run again")


def _claim_fake(path: str) -> None:
    global _held_lock
    import fcntl

    if _held_lock is not None:
        return
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RuntimeError(f"Unable to initialize backend 'tpu': ABORTED: The TPU is {IN_USE} by process with "
                           f"pid {holder}. ({FAKE_EXCLUSIVE_ENV})") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _held_lock = f


# A test and emulation hook: where set, the CPU flags every decision of the harness reads
# (cpu_flags) are these (space- or comma-separated /proc/cpuinfo names), not the CPU's own. Set
# to an AVX2-only list ("sse4_2 avx avx2 fma f16c") on an AVX512 machine, the regenerator skips
# the variants such a CPU cannot run, as it would there; torch itself still sees the real CPU.
CPU_FLAGS_ENV = "CSA_PARITY_CPU_FLAGS"


def cpu_flags() -> tuple[frozenset[str] | None, str]:
    """(the CPU's instruction-set flags as /proc/cpuinfo names them, where they came from): the
    CPU_FLAGS_ENV override, else /proc/cpuinfo's `flags` (Linux), else macOS's sysctl feature
    lists (lower-cased: AVX2, AVX512F, FMA there are avx2, avx512f, fma here); (None, why) where
    nothing says, and then no variant that needs a flag is taken to run."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(override.replace(",", " ").lower().split()), CPU_FLAGS_ENV
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split()), "/proc/cpuinfo"
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out.strip():
            return frozenset(w.lower().replace(".", "_") for w in out.split()), "sysctl machdep.cpu"
    return None, "no /proc/cpuinfo and no other source of CPU flags"


def isa_variant_blockers(flags: frozenset[str] | None = None, source: str | None = None,
                         variants=None) -> dict[str, str]:
    """{variant: why this CPU cannot run it} for the variants of `variants` (default
    harness.ISA_VARIANTS) that `flags` (default cpu_flags()) lack what they need
    (harness.ATEN_NEEDS of the variant's ATen level, harness.ISA_VARIANT_NEEDS of its library
    path); a variant absent from the result runs here. Decided from the flags alone, never by
    running a kernel."""
    from . import ATEN_NEEDS, CPU_PINS, ISA_VARIANT_NEEDS, ISA_VARIANTS

    if flags is None and source is None:
        flags, source = cpu_flags()
    variants = ISA_VARIANTS if variants is None else variants
    where = "" if source == "/proc/cpuinfo" else f"; flags from {source}"
    out = {}
    for name, settings in variants.items():
        level = settings.get("ATEN_CPU_CAPABILITY", CPU_PINS["ATEN_CPU_CAPABILITY"]).lower()
        aten = ATEN_NEEDS.get(level, ())
        path = ISA_VARIANT_NEEDS.get(name, ())
        if flags is None:
            if aten or path:
                out[name] = f"not measured: this CPU's flags are unknown ({source}; set {CPU_FLAGS_ENV} to name them)"
            continue
        missing = [f for f in aten if f not in flags]
        if missing:
            out[name] = (f"cannot run: CPU lacks {', '.join(missing)} (ATen trusts ATEN_CPU_CAPABILITY={level}: "
                         f"its kernels would die of SIGILL{where})")
            continue
        missing = [f for f in path if f not in flags]
        if missing:
            out[name] = (f"cannot reach its kernels: CPU lacks {', '.join(missing)} (oneDNN and MKL stay within the "
                         f"CPU, so it would compute with a narrower path another variant measures{where})")
    return out


def cpu_features() -> dict:
    """The processor's model name and which of ISA_FLAGS it has (Linux; elsewhere what
    `platform` says)."""
    import platform as _platform

    info = {"machine": _platform.machine(), "model": _platform.processor() or None, "isa": None}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        _isa_variants(info)
        return info
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features") and not flags:
            flags = set(value.split())
        elif key == "model name" and not info["model"]:
            info["model"] = value.strip()
    info["model"] = info["model"] or None
    info["isa"] = [f for f in ISA_FLAGS if f in flags]
    _isa_variants(info)
    return info


def _isa_variants(info: dict) -> None:
    """Adds to a cpu block which of harness.ISA_VARIANTS (the CPU kernels the fixtures' order
    errors are joined over) this CPU runs, and why not for the others; and, where the flags are
    emulated (CPU_FLAGS_ENV), those flags as the ISA."""
    from . import ISA_VARIANTS

    flags, source = cpu_flags()
    if os.environ.get(CPU_FLAGS_ENV) is not None:
        info["isa"] = [f for f in ISA_FLAGS if f in flags]
        info["flags_from"] = source
    blocked = isa_variant_blockers(flags, source)
    info["isa_variants"] = {name: blocked.get(name, "runs") for name in ISA_VARIANTS}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def device_info() -> dict:
    """What this process computes on: backend, device kind and count, jax/jaxlib versions, the
    runtime's own version line (libtpu's build on a TPU), the libtpu package's version where
    installed, and on a CPU backend the processor's ISA features. Opens the backend: call it
    only in the process that computes. Raises DeviceBusy (one line) when another process holds
    the chip."""
    hook = os.environ.get(FAKE_EXCLUSIVE_ENV)
    try:
        if hook:
            _claim_fake(hook)
        import jax

        devices = jax.devices()
    except RuntimeError as exc:
        if IN_USE in str(exc) or LOCKFILE in str(exc):
            raise DeviceBusy(busy_line(str(exc))) from None
        raise
    dev = devices[0]
    backend = jax.default_backend()
    import jaxlib

    info = {
        "backend": backend,
        "device_kind": dev.device_kind,
        "device_count": len(devices),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jaxlib, "__version__", None) or _version("jaxlib"),
        "runtime_version": " ".join(str(getattr(dev.client, "platform_version", "")).split()) or None,
        "libtpu_version": _version("libtpu") or _version("libtpu-nightly"),
        "processes_per_host": 1 if (backend in ONE_PROCESS_BACKENDS or hook) else None,
    }
    if hook:
        info["simulated"] = f"one process at a time ({FAKE_EXCLUSIVE_ENV})"
    if backend == "cpu":
        info["cpu"] = cpu_features()
    return info


def torch_cpu_capability() -> str | None:
    """torch's CPU kernel level (torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512,
    ...) where this process has imported torch already; None where it has not (never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch without the query
        return None


# --- Platform tolerance profiles (SPEC section 10): how much further a backend's arithmetic
# lands from the float64 oracle than torch's on the fixture machine, measured on that backend
# by scripts/measure_platform_profile.py and stored as data under harness/profiles/, one file
# per (backend, device kind). The judge multiplies the bound of every oracle check (oracle,
# oracle@sel, the oracle top-k's tie tolerance, the quantizer's boundary-tie tolerance) of a
# run on that device by the profile's factor for the run's matmul precision, dtype and kind
# (harness.judging.tolerance.Policy.oracle_factor). The checks that compare a device with
# itself (chunk, xla, the sharded chunk check, exact64) never read it. No file: factor 1, the
# CPU's bounds (every CPU run, and a device nobody has measured, which then fails loudly).
PROFILES_DIR = str(package_data.profiles_dir())  # package data of harness (harness.package_data)


def profile_slug(backend: str, device_kind: str) -> str:
    """`tpu` + `TPU v5 lite` -> `tpu_v5_lite`: the profile file's name, without `.json`."""
    import re

    words = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
    return words if words.startswith(backend) else f"{backend}_{words}"


def profile_path(backend: str, device_kind: str) -> str:
    return os.path.join(PROFILES_DIR, profile_slug(backend, device_kind) + ".json")


def load_profile(backend: str, device_kind: str | None) -> dict | None:
    """The measured profile of (backend, device kind), or None where none is stored. A stored
    one that is malformed raises ValueError naming the file and the field."""
    if not device_kind:
        return None
    path = profile_path(backend, device_kind)
    if not os.path.exists(path):
        return None
    data = read_profile_file(path)
    name = os.path.relpath(path, os.path.dirname(PROFILES_DIR))
    for field in ("backend", "device_kind", "command", "factors"):
        if field not in data:
            raise ValueError(f"{name}: field {field!r} is missing")
    if data["backend"] != backend or data["device_kind"] != device_kind:
        raise ValueError(f"{name}: backend/device_kind={data['backend']!r}/{data['device_kind']!r} does not match "
                         f"the device {backend!r}/{device_kind!r}")
    for precision, table in data["factors"].items():
        for dtype, row in table.items():
            for kind, value in row.items():
                if kind not in ("forward", "loss", "grad") or not (isinstance(value, (int, float)) and value >= 1):
                    raise ValueError(f"{name}: factors.{precision}.{dtype}.{kind}={value!r} must be a number >= 1 "
                                     "of kind forward, loss or grad")
    return {**data, "name": profile_slug(backend, device_kind), "path": name}


@functools.lru_cache(maxsize=None)
def read_profile_file(path: str) -> dict:
    import json

    with open(path) as f:
        return json.load(f)


def oracle_factors(profile: dict | None, precision: str) -> dict[str, dict[str, float]]:
    """{dtype: {kind: factor}} of `profile` at matmul precision `precision` ({} without one)."""
    if not profile:
        return {}
    return {d: dict(row) for d, row in profile["factors"].get(precision, {}).items()}


def current_device_kind() -> str:
    """The device kind JAX runs on in this process (opens the backend)."""
    import jax

    return jax.devices()[0].device_kind

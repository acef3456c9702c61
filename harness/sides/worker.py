"""Crash isolation: implementations run in worker processes that may die or hang without
taking the run down.

A kernel under development segfaults, aborts inside a runtime, is killed for memory or never
returns. None of that may end the process that writes the reports. So:

- `csa-parity run` hands its points to persistent worker processes (`run_points`; `--jobs`
  of them, also with `--jobs 1`). A worker imports JAX once and runs point after point of one
  (implementation, case, dtype) group, keeping its caches (compiled programs, the torch
  reference, fixtures). What it does with a point is a task named by a function reference
  (`module:function`, harness.run.tasks for the CLI), so this module imports nothing of the
  rooms that drive it. It is replaced only when it dies or when a point runs past the time
  limit (then it is killed).
- In a process that is not a worker (pytest, a script calling `collect` / `evaluate`), a
  plug-in runs in one such worker of that process (`isolated`), under the same time limit;
  the built-in sides (jax, torch_ref, goldens) run in-process.

Attribution. Right before each call into an implementation, harness.sides.implementations enters
`stage(key, label)`, and the worker tells the parent which call started (and when it ended).
When a worker dies or times out inside a call, the call is remembered as poisoned, with one
line (`worker killed by signal SIGSEGV at <point>, in <impl> <call>`, `timed out after 600 s
at <point>, ...`), and the point runs again in a fresh worker where that call raises
`WorkerCrash` instead of running: the quantities that call owns get `error` with that line,
everything else of the point is judged as usual (a forward that succeeded keeps its verdict
when the backward crashed; a stage plug-in's pipeline quantities stay not provided). A death
outside any call marks the whole point `error`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
from collections import deque

from . import timing

# The time limit of one point when none is given (`csa-parity run --timeout`, CSA_PARITY_TIMEOUT
# for pytest): a large multiple of the slowest single point measured on the 2-core CI machine
# (docs/running.md, "Crash isolation and time limits", says which and how), so that only a hang or a
# pathological slowdown reaches it.
DEFAULT_TIMEOUT = 600.0
# How often one point is run again in a fresh worker after a crash or a time-out inside a
# known call (each time with every poisoned call raising instead of running).
MAX_RERUNS = 3
# How often the parent reads a busy worker's memory (/proc/<pid>/status). The point's peak is the
# kernel's high-water mark (VmHWM, reset as the point starts), exact whenever it is read; the
# memory limit (`csa-parity run --max-memory`) is held against the resident size (VmRSS) at each
# read, so a worker passes it by at most what it allocates in POLL_S before it is killed.
# RLIMIT_AS is no limit here: XLA reserves far more address space than it ever touches.
POLL_S = 0.1
GIB = 2**30


class WorkerCrash(Exception):
    """A call that killed or hung a worker before: raised instead of running it again. Its
    text is the one-line error of the quantities the call owns."""


def timeout_from_env() -> float:
    """CSA_PARITY_TIMEOUT (seconds) or DEFAULT_TIMEOUT: the time limit of isolated calls."""
    text = os.environ.get("CSA_PARITY_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"CSA_PARITY_TIMEOUT={text!r} must be a number of seconds > 0") from None
    if not value > 0:
        raise ValueError(f"CSA_PARITY_TIMEOUT={text!r} must be a number of seconds > 0")
    return value


# --------------------------------------------------------------------------- inside a worker

_INSIDE = False  # True in a worker process: implementations run here, in-process
_CONN = None  # the worker's end of the pipe (stage notifications)
_POISONED: dict[tuple[str, str], str] = {}  # (call, point label) -> the line it raises with
_RETIRE = False  # set when an implementation ran out of memory here: the worker is replaced after the task


def inside() -> bool:
    """True in a worker process (plug-ins run in-process there)."""
    return _INSIDE


_QUIET = False  # set while `quietly` runs: calls in threads send no stage notes (one pipe, many threads)


@contextlib.contextmanager
def quietly():
    """Calls made meanwhile (in threads: harness.sides.implementations.prefetch) tell the parent
    nothing; a crash among them is one outside any call."""
    global _QUIET
    _QUIET = True
    try:
        yield
    finally:
        _QUIET = False


@contextlib.contextmanager
def stage(key: str, label: str):
    """Around one call into an implementation (`key`: "<impl> <call>", `label`: the point it
    runs at): raises WorkerCrash if that call killed or hung a worker before; in a worker,
    tells the parent that it started and that it ended."""
    if (key, label) in _POISONED:
        raise WorkerCrash(_POISONED[(key, label)])
    if _CONN is not None and not _QUIET:
        _CONN.send(("stage", (key, label)))
    yield
    if _CONN is not None and not _QUIET:
        _CONN.send(("stage", None))


def note_failure(exc: BaseException) -> None:
    """An implementation raised `exc` here. Out of memory (MemoryError, XLA's RESOURCE_EXHAUSTED),
    the process may stay crippled (a resource limit the plug-in set, fragmented memory): the
    worker is replaced once its task has been answered."""
    global _RETIRE
    if _INSIDE and (isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc)):
        _RETIRE = True


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it dies (a killed CLI leaves
    no worker computing on). Elsewhere the worker ends at its next read from the pipe."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _setup(init: dict) -> None:
    os.environ["JAX_ENABLE_X64"] = "1"
    if init.get("fixtures_dir"):
        os.environ["CSA_PARITY_FIXTURES"] = init["fixtures_dir"]
    sys.path[:] = init.get("sys_path") or sys.path
    _POISONED.update(init.get("poison") or {})
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", init.get("precision", "highest"))
    if "cache_root" in init:  # csa-parity run's choice (None: no persistent cache); else the environment's
        timing.use_caches(init["cache_root"])
    elif init.get("reference_cache"):  # a worker outside csa-parity run (_local_init)
        from . import reference_cache

        reference_cache.use(init["reference_cache"])
    timing.listen()
    # The point task's module is imported here, not inside the first point, so that a time limit
    # measures implementations. torch is not: a point whose reference is cached or read from the
    # goldens never needs it.
    if init.get("task"):
        resolve(init["task"])


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def resolve(target: str):
    """The function a task names, `module:function` (imported on first use)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def release_programs() -> None:
    """Drop the compiled programs JAX keeps in memory once a point is judged. A point's programs
    serve that point alone (its native run's outputs are kept as arrays), and each holds its
    machine code in memory mappings for as long as JAX caches it: a worker of the default sample
    (about 220 programs) ran out of mappings (vm.max_map_count, 65530 here; XLA: "LLVM
    compilation error: Cannot allocate memory"). A program needed again comes from the persistent
    compilation cache."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(first_line(exc))


def _main(conn, init: dict) -> None:
    global _INSIDE, _CONN
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    _setup(init)
    _INSIDE, _CONN = True, conn
    device = None
    if init.get("device_info"):  # csa-parity run's workers open the backend and say what it is
        from ..platforms import DeviceBusy, device_info

        try:
            device = device_info()
        except DeviceBusy as exc:
            conn.send(("busy", str(exc)))
            return
    conn.send(("ready", os.getpid(), device))
    ahead = None  # (timing snapshot, clock) at the start of a prefetch: charged to the next point
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        _POISONED.update(msg[-1])
        if msg[0] == "point":
            _, entries, reference, profile, _ = msg
            before, start = ahead or (timing.snapshot(), time.perf_counter())
            if ahead is None:
                timing.take_temps()  # (after a prefetch, its programs' are the first point's)
            ahead = None
            records = resolve(init["task"])(entries, reference, profile)
            release_programs()
            split = timing.split(before, timing.snapshot())
            temps = timing.take_temps()
            split["compiled_temp_bytes"] = max(temps) if temps else None
            from ..platforms import torch_cpu_capability

            capability = torch_cpu_capability()  # where the point's reference imported torch
            if capability:
                split["torch_cpu_capability"] = capability
            conn.send(("done", records, time.perf_counter() - start, _RETIRE, split))
        elif msg[0] == "prefetch":  # work ahead for the points to come; what it could not do they do
            _, target, args, _ = msg
            ahead = (timing.snapshot(), time.perf_counter())  # its programs and time: the first point's
            with contextlib.suppress(Exception):
                resolve(target)(*args)
            conn.send(("prefetched",))
        elif msg[0] == "call":
            _, target, args, path, _ = msg
            sys.path[:] = path
            importlib.invalidate_caches()
            try:
                result = resolve(target)(*args)
                conn.send(("result", result, _RETIRE))
            except Exception as exc:
                note_failure(exc)
                conn.send(("raised", _picklable(exc), _RETIRE))
        if _RETIRE:
            return


# --------------------------------------------------------------------------- the parent's side


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def process_memory(pid: int) -> tuple[int, int] | None:
    """(resident size VmRSS, its high-water mark VmHWM) of process `pid` in bytes, or None where
    /proc does not say (the process is gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def reset_peak(pid: int) -> None:
    """Reset the high-water mark of process `pid` to its resident size now (Linux: 5 written to
    /proc/<pid>/clear_refs); where that is refused the mark stays the process's peak so far."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (the
    `oom_kill` counter: cgroup v2 memory.events, v1 memory.oom_control), or None where none is
    readable. A worker killed by SIGKILL while it rises was the OOM killer's."""
    paths = []
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if not controllers:
                    paths.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
                elif "memory" in controllers.split(","):
                    paths.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    for path in [*paths, "/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]:
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def parse_size(text: str) -> int:
    """Bytes from `8GiB`, `512MiB`, `1.5G`, `100M`, `64K` or a number of bytes; ValueError
    (naming the value and the rule) for anything else or a size not > 0."""
    units = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
             "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}
    body = str(text).strip()
    number = body.rstrip("BbKkMmGgTtIi")
    unit = body[len(number):].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        value = float("nan")
    if not value >= 1:
        raise ValueError(f"--max-memory={text!r} must be a size > 0: a number of bytes or one with a unit "
                         "(K, M, G, T, as KiB, MiB, GiB, TiB), e.g. 8GiB")
    return int(value)


def describe_exit(exitcode: int | None) -> str:
    """`worker killed by signal SIGSEGV` / `worker exited with code 3`."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"worker killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"worker killed by signal {-exitcode}"
    return f"worker exited with code {exitcode}"


def crash_line(what: str, point_label: str, last) -> str:
    """One line: what happened, the point, and the call that had started (if known)."""
    if last is None:
        return f"{what} at {point_label} (outside any implementation call)"
    key, label = last
    return f"{what} at {point_label}, in {key}" + ("" if label == point_label else f" (at {label})")


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, init: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, init), daemon=True, name="csa-parity-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.last = None  # (call, label) of the call running now, None between calls
        self.task = None
        self.started = 0.0
        self.spawned = time.monotonic()
        self.startup = 0.0  # seconds from spawn to ready: charged to the first point it answers
        self.device = None  # what harness.platforms.device_info found in it (init["device_info"])
        self.grace = 0.0  # seconds beyond the time limit while it works ahead (a prefetch), 0 after
        self.peak = None  # bytes: the highest resident size read since its point began (None: none read)
        self.oom_base = None  # oom_kills() as its point began
        self.over = None  # the memory limit it was killed over, None if it was not

    def begin_point(self) -> None:
        """Its point starts: the peak is measured from here, its resident size now the first
        reading (so that a worker that dies before the next reading still has a known peak)."""
        reset_peak(self.proc.pid)
        self.peak, self.oom_base = None, oom_kills()
        self.watch(None)

    def watch(self, limit: int | None) -> bool:
        """Read its memory now (its peak); over `limit` bytes, kill it and return True."""
        memory = process_memory(self.proc.pid)
        if memory is None:
            return False
        self.peak = max(self.peak or 0, *memory)
        if limit is not None and memory[0] > limit and self.proc.is_alive():
            self.over = limit
            self.proc.kill()
            self.proc.join(5)
            return True
        return False

    def death(self) -> str:
        """What ended it (after it died at a point): out of memory over the limit or by the
        kernel's OOM killer, with its peak, or the signal or exit code."""
        peak = "unknown" if self.peak is None else gib(self.peak)
        if self.over is not None:
            return f"out of memory: peak {peak} (limit {gib(self.over)})"
        if self.proc.exitcode == -signal.SIGKILL:
            now = oom_kills()
            if now is not None and self.oom_base is not None and now > self.oom_base:
                return f"out of memory: killed by the kernel's OOM killer, peak {peak}"
            return (f"worker killed by signal SIGKILL (peak {peak}; the kernel's OOM killer sends it "
                    "when memory runs out)")
        return describe_exit(self.proc.exitcode)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def messages(self):
        """Every message waiting on the pipe (after a death, what it sent before dying)."""
        out = []
        try:
            while self.conn.poll():
                out.append(self.conn.recv())
        except (EOFError, OSError):
            pass
        return out


def spawn(init: dict, n: int) -> list[_Worker]:
    """`n` workers started now and not waited for, to hand to run_points (`started`): their
    imports overlap whatever the caller does meanwhile. The caller kills any it does not hand
    over (`kill`)."""
    return [_Worker({**init, "poison": {}}) for _ in range(n)]


def claim_devices(workers) -> tuple[list[_Worker], dict | None]:
    """Wait for `workers` (of `spawn`, started with init["device_info"]) to open their backend:
    (those that did, the device the first one found). On a backend that one process per host
    may open (platforms.ONE_PROCESS_BACKENDS: a TPU), only the first is kept, the others ended:
    the run is serialised. Raises platforms.DeviceBusy (one line) when none could open it
    because another program holds the chip."""
    from ..platforms import DeviceBusy

    ok, busy = [], None
    for w in workers:
        try:
            ok.append(_ready(w))
        except DeviceBusy as exc:
            busy = busy or exc
    if not ok:
        if busy is not None:
            raise busy
        return [], None
    device = ok[0].device
    if device and device.get("processes_per_host") == 1 and len(ok) > 1:
        kill(ok[1:])
        ok = ok[:1]
    return ok, device


def kill(workers) -> None:
    """End `workers` (those of `spawn`; one already ended is left as it is)."""
    for w in workers:
        w.kill()


def _start(init: dict) -> _Worker:
    return _ready(_Worker(init))


def _ready(w: _Worker) -> _Worker:
    """`w` once it has started (imports done), or RuntimeError when it could not start;
    harness.platforms.DeviceBusy (one line) when another process holds its accelerator."""
    while not w.ready:  # JAX imports here; a worker that cannot start is a harness failure
        closed = False
        if w.conn.poll(1.0):
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed: it died, or is dying
                closed, msg = True, None
                w.proc.join(5)
            if msg is not None and msg[0] == "busy":
                from ..platforms import DeviceBusy

                w.kill()
                raise DeviceBusy(msg[1])
            if msg is not None and msg[0] == "ready":
                w.ready, w.device = True, msg[2]
        if not w.ready and (closed or (not w.proc.is_alive() and not w.conn.poll())):
            w.kill()
            raise RuntimeError(f"a csa-parity worker could not start ({describe_exit(w.proc.exitcode)}); "
                               "its stderr says why")
    w.startup = time.monotonic() - w.spawned
    return w


def run_points(groups, reference: str, profile: str, init: dict, jobs: int, timeout: float, on_done,
               error_records, started=(), prefetch: tuple | None = None, max_memory: int | None = None) -> None:
    """Evaluate every point of `groups` (lists of (point, entries), one (implementation, case,
    dtype) each) in `jobs` persistent workers: each point's entries go to the task `init["task"]`
    names (`module:function(entries, reference, profile) -> records`), imported by the worker
    at its start. `on_done(point, entries, records, wall_s, split)` as
    each point ends (`split`: harness.sides.timing.split's shares and program counts; for a point
    that crashed or timed out, only its memory). A worker that dies, or runs one point longer than `timeout` seconds (then
    it is killed), is replaced; the point runs again with the call it was in poisoned (up to
    MAX_RERUNS times), or, if it died outside any call, gets `error_records(entries, line)` as a
    whole. `started`: workers of `spawn` (same `init`) to use first; every one is ended when this
    returns. `prefetch`: (`module:function`, args, seconds) each first worker runs before its first
    point (harness.sides.implementations.prefetch: the programs of every point compiled in threads,
    where one worker runs them all), within `seconds`; the first point's time limit starts when it
    ends. `max_memory`: bytes of resident memory a worker may hold (None: no limit); over it, it is
    killed and its point is handled as a death in the call it was in (`_Worker.death`'s line).
    Every point's `split` gets `peak_rss_bytes`, its worker's peak resident size (over its reruns),
    and `compiled_temp_bytes`, the largest compiled temp of the programs it ran (None: none said)."""
    pending = deque(deque(g) for g in groups if g)
    started = list(started)
    poison: dict[tuple[str, str], str] = {}
    reruns: dict = {}
    peaks: dict = {}  # point -> the peak of the runs of it that died
    slots: list[tuple[_Worker, deque]] = []
    try:
        for _ in range(min(jobs, len(pending))):
            w = _ready(started.pop(0)) if started else _start({**init, "poison": poison})
            if prefetch is not None:
                w.conn.send(("prefetch", prefetch[0], prefetch[1], {}))
                w.grace = prefetch[2]
            slots.append((w, pending.popleft()))
        while slots:
            for i, (w, queue) in enumerate(list(slots)):
                if w.task is None:
                    if not queue and pending:
                        queue = pending.popleft()
                        slots[i] = (w, queue)
                    if queue:
                        w.task = queue.popleft()
                        w.started, w.last = time.monotonic(), None
                        w.begin_point()
                        try:
                            w.conn.send(("point", w.task[1], reference, profile, dict(poison)))
                        except OSError:  # it died between points: noticed below as a death
                            pass
            idle = [s for s in slots if s[0].task is None]
            for s in idle:
                with contextlib.suppress(OSError):
                    s[0].conn.send(("stop",))
                s[0].kill()
                slots.remove(s)
            if not slots:
                break
            now = time.monotonic()
            wait_s = min(POLL_S, max(0.0, min(w.started + timeout + w.grace - now for w, _ in slots)))
            mpc.wait([w.conn for w, _ in slots] + [w.proc.sentinel for w, _ in slots], timeout=wait_s)
            for i, (w, queue) in enumerate(list(slots)):
                for msg in w.messages():
                    if msg[0] == "stage":
                        w.last = msg[1]
                    elif msg[0] == "prefetched":  # the first point's own time limit starts now
                        w.grace, w.started = 0.0, time.monotonic()
                    elif msg[0] == "done":
                        point, entries = w.task
                        w.task = None
                        w.watch(None)  # idle now: its high-water mark is the point's peak
                        known = [p for p in (w.peak, peaks.pop(point, None)) if p is not None]
                        split = {**msg[4], "startup": round(w.startup, 3),
                                 "peak_rss_bytes": max(known) if known else None}
                        w.startup = 0.0
                        on_done(point, entries, msg[1], msg[2], split)
                        if msg[3]:  # it ran out of memory: a fresh one takes its next point
                            w.kill()
                            slots[i] = (_start({**init, "poison": poison}), queue) if queue or pending else None
                if w.task is None:
                    continue
                w.watch(max_memory)
                elapsed = time.monotonic() - w.started
                if w.proc.is_alive() and elapsed <= timeout + w.grace:
                    continue
                what = (f"timed out after {timeout + w.grace:g} s" + (" (working ahead)" if w.grace else "")
                        if w.proc.is_alive() else w.death())
                w.kill()
                point, entries = w.task
                if w.peak is not None:
                    peaks[point] = max(peaks.get(point) or 0, w.peak)
                line = crash_line(what, point.label, w.last)
                tries = reruns.get(point, 0)
                if w.last is not None and tries < MAX_RERUNS:
                    poison[w.last] = line
                    reruns[point] = tries + 1
                    queue.appendleft(w.task)
                else:
                    on_done(point, entries, error_records(entries, line), elapsed,
                            {"peak_rss_bytes": peaks.pop(point, None), "compiled_temp_bytes": None})
                slots[i] = (_start({**init, "poison": poison}), queue) if queue or pending else None
            slots = [s for s in slots if s is not None]
    finally:
        for slot in slots:
            if slot is not None:
                slot[0].kill()
        kill(started)  # started but not needed


# --------------------------------------------------------------------------- outside a worker

_LOCAL: _Worker | None = None
_LOCAL_POISON: dict[tuple[str, str], str] = {}


def _local_init() -> dict:
    precision = "highest"
    if "jax" in sys.modules:
        precision = sys.modules["jax"].config.jax_default_matmul_precision or "highest"
    # The reference cache only where CSA_PARITY_CACHE_DIR names one (`make test` does): the values
    # a stage plug-in is judged on, which each worker (a replacement for a crashed one included)
    # would otherwise import torch to compute again. Its compilation cache is the environment's.
    return {"precision": precision, "fixtures_dir": os.environ.get("CSA_PARITY_FIXTURES"), "sys_path": list(sys.path),
            "reference_cache": os.environ.get("CSA_PARITY_CACHE_DIR") or None}


def _drop_local() -> None:
    global _LOCAL
    if _LOCAL is not None:
        _LOCAL.kill()
        _LOCAL = None


def call_in_worker(target: str, args: tuple, label: str, limit_s: float, max_memory: int | None = None):
    """`module:function(*args)` run once in a fresh worker process, its memory read every POLL_S:
    (what it returns, the worker's peak resident bytes or None where none was read). Raises what it
    raises; raises WorkerCrash (one line about `label`, with the peak) when the worker died (out of
    memory over `max_memory` bytes, killed by the kernel's OOM killer, a signal) or ran past
    `limit_s` seconds. The worker is ended either way. How `csa-parity run --sample long` runs each
    long case: a case that runs out of memory is an error at its points, and the run goes on."""
    w = _start(_local_init())
    try:
        w.begin_point()
        w.conn.send(("call", target, args, list(sys.path), {}))
        start = time.monotonic()
        while True:
            mpc.wait([w.conn, w.proc.sentinel], timeout=POLL_S)
            for msg in w.messages():
                if msg[0] == "result":
                    w.watch(None)
                    return msg[1], w.peak
                if msg[0] == "raised":
                    raise msg[1]
            w.watch(max_memory)
            if not w.proc.is_alive():
                raise WorkerCrash(f"{w.death()} at {label}")
            if time.monotonic() - start > limit_s:
                peak = "unknown" if w.peak is None else gib(w.peak)
                raise WorkerCrash(f"timed out after {limit_s:g} s (peak {peak}) at {label}")
    finally:
        w.kill()


def isolated(target: str, *args, label: str):
    """`module:function(*args)` run in this process's worker (started on first use, kept for the
    next call, replaced when it dies or runs past the time limit): how a plug-in runs outside
    `csa-parity run`. Returns what it returns and raises what it raises; raises WorkerCrash
    (one line, about the point `label`) when the worker died outside any call or the call
    still died after MAX_RERUNS reruns with the calls it died in poisoned."""
    global _LOCAL
    limit = timeout_from_env()
    for attempt in range(MAX_RERUNS + 1):
        if _LOCAL is None:
            _LOCAL = _start(_local_init())
        w = _LOCAL
        w.last, start = None, time.monotonic()
        w.conn.send(("call", target, args, list(sys.path), dict(_LOCAL_POISON)))
        while True:
            left = start + limit - time.monotonic()
            mpc.wait([w.conn, w.proc.sentinel], timeout=max(0.0, left))
            for msg in w.messages():
                if msg[0] == "stage":
                    w.last = msg[1]
                elif msg[0] in ("result", "raised"):
                    if msg[2]:  # it ran out of memory: the next call starts a fresh one
                        _drop_local()
                    if msg[0] == "raised":
                        raise msg[1]
                    return msg[1]
            if not w.proc.is_alive() or time.monotonic() - start > limit:
                break
        what = f"timed out after {limit:g} s" if w.proc.is_alive() else describe_exit(w.proc.exitcode)
        last = w.last
        _drop_local()
        line = crash_line(what, label, last)
        if last is None or attempt == MAX_RERUNS:
            raise WorkerCrash(line)
        _LOCAL_POISON[last] = line
    raise AssertionError("unreachable")

"""The two-process form of the sharded points: one program over the devices of several
processes, the way a multi-host TPU slice runs it, then judged like any sharded point.

Each process (a host of a pod slice, or one of N processes on this machine, each owning some
simulated CPU devices) runs the same command. It starts JAX's distributed runtime
(`jax.distributed.initialize`), builds ONE global mesh (data, seq, model) over `jax.devices()`,
which are every process's devices, loads the case's fixture (every process the same values),
and runs `jax_impl.sharded.sharded_parity_bundle` on it: each process supplies its own shards of
the global inputs (jax_impl.sharded places them with `make_array_from_callback`), and the
collectives (the pooling halo, the gathered keys, the psums) cross the processes. The outputs
are then gathered to every host, and process 0 writes them, in the canonical names of
harness.outputs, as one safetensors bundle per point. `--judge` reads the bundles and judges
each entry with harness.run.collect's code: against the oracle goldens by the matrix's rule and
against the same knobs on one device (run by the judging process) at the tight `chunk` bound.

    python -m harness.run.multihost --out DIR --point SPEC [--point SPEC ...]      # on every host
        [--coordinator HOST:PORT --num-processes N --process-id I]
    python -m harness.run.multihost --judge DIR [--reference goldens|live]         # on one host
    python -m harness.run.multihost --local 2 --devices-per-process 4 --out DIR --point SPEC ...

Without --coordinator, `jax.distributed.initialize()` discovers the processes itself (on a
Cloud TPU slice, under SLURM, Open MPI or Kubernetes: JAX's cluster detection); where it finds
none, the process runs alone. `--local N` starts the N processes on this machine on a free
loopback port and watches them: a process that dies (any exit but 0, or a signal) or a run past
`--deadline` gets every process killed and the launcher exits 124 with one line saying which
process and what happened. The logs are DIR/logs/process-<i>.log. docs/multihost.md.

Exit codes: 0 every process ran (or, --judge, every check passed); 1 a check failed (--judge);
2 a user error (a bad point, a mesh that does not span the run's devices, no bundle to judge),
one line on stderr; 124 a process died or the run passed its deadline (--local).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..outputs import Outputs
from ..points import DTYPES, Point, mesh_text
from ..problems.cases import CASES, TEACHERS
from ..problems.matrix import BACKENDS, entries_at, seq_split_reason

AXES = ("data", "seq", "model")
BUNDLE_FORMAT = "csa-parity multihost outputs 1"
BUNDLE_SUFFIX = ".outputs.safetensors"
BUNDLE_METADATA = ("point", "source", "missing", "processes", "devices_per_process", "backend", "matmul_precision")
# The launcher's defaults on one machine: JAX's own (300 s to connect, 100 s without a heartbeat)
# are sized for a pod's start-up; here every process starts within seconds.
LOCAL_INIT_TIMEOUT = 60
LOCAL_HEARTBEAT_TIMEOUT = 20
LOCAL_DEADLINE = 600.0
DEADLINE_EXIT = 124


class UsageError(ValueError):
    """A point or a run the two-process form cannot take: one line naming the field, its value
    and the rule (exit code 2)."""


# --------------------------------------------------------------------------- points


def parse_point(spec: str, processes: int, devices: int) -> Point:
    """The point `spec` (`case:dtype:ichunk:tchunk:qchunk:teacher:backend:DxSxM`), checked for a
    run of `processes` processes of `devices` devices each: a known case and dtype, a mesh that
    spans every device of the run (a multi-process mesh holds all of them) and a sequence that
    splits into whole blocks over its `seq` axis."""
    try:
        point = Point.parse(spec)
    except ValueError as exc:
        raise UsageError(f"--point {spec!r}: {exc}") from None
    if point.case not in CASES:
        raise UsageError(f"--point {spec!r}: case={point.case!r} is not in the catalogue (valid: {', '.join(CASES)})")
    if point.dtype not in DTYPES:
        raise UsageError(f"--point {spec!r}: dtype={point.dtype!r} is not supported (valid: {', '.join(DTYPES)})")
    if point.teacher not in CASES[point.case].teachers:
        raise UsageError(f"--point {spec!r}: teacher={point.teacher!r} is not one case {point.case} holds goldens of "
                         f"(valid: {', '.join(t for t in TEACHERS if t in CASES[point.case].teachers)})")
    if point.backend not in BACKENDS:
        raise UsageError(f"--point {spec!r}: backend={point.backend!r} is not supported (valid: {', '.join(BACKENDS)})")
    if point.mesh is None:
        raise UsageError(f"--point {spec!r}: mesh is missing: a multi-process point ends in DATAxSEQxMODEL, e.g. "
                         f"{spec}{':' * (7 - spec.count(':'))}1x{processes * devices}x1 (Point.spec's form)")
    total = processes * devices
    if int(np.prod(point.mesh)) != total:
        raise UsageError(f"--point {spec!r}: mesh={mesh_text(point.mesh)} holds {int(np.prod(point.mesh))} devices; "
                         f"the run has {processes} process(es) x {devices} device(s) = {total}, and a multi-process "
                         f"mesh spans every device (its sizes must multiply to {total})")
    why = seq_split_reason(point.case, point.mesh[1])
    if why:
        raise UsageError(f"--point {spec!r}: {why}")
    return point


def bundle_path(out: Path, point: Point) -> Path:
    return Path(out) / (point.spec().replace(":", "_") + BUNDLE_SUFFIX)


# --------------------------------------------------------------------------- one process


_STARTED = time.monotonic()


def _say(process: int, count: int, line: str) -> None:
    """A stage line on stderr, with the seconds since the process started (the launcher names
    the last one when a process dies)."""
    print(f"[process {process}/{count}] {line} (+{time.monotonic() - _STARTED:.1f} s)", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the launcher that started it dies, so a killed launcher
    leaves no process holding the others in a collective."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               init_timeout: int, heartbeat_timeout: int) -> None:
    """Start JAX's distributed runtime. With the three flags: that coordinator, process count and
    id. Without them: JAX's cluster detection (a TPU slice, SLURM, ...), and where it finds no
    cluster this process runs alone. CPU devices of different processes reach each other by gloo
    (the collectives implementation of jax's CPU client)."""
    import jax

    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise UsageError("--coordinator, --num-processes and --process-id go together (all three, or none for "
                         "jax.distributed's own discovery)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {"initialization_timeout": init_timeout, "heartbeat_timeout_seconds": heartbeat_timeout}
    if all(given):
        if not 0 <= process_id < num_processes:
            raise UsageError(f"--process-id={process_id} must be in [0, {num_processes}) (--num-processes)")
        jax.distributed.initialize(coordinator, num_processes, process_id, **timeouts)
        return
    try:
        jax.distributed.initialize(**timeouts)
    except ValueError as exc:  # no cluster detected: "coordinator_address should be defined"
        if "coordinator_address" not in str(exc):
            raise
        print("no cluster environment detected (jax.distributed): running as the only process", file=sys.stderr)


def global_mesh(point: Point):
    """The mesh (data, seq, model) of `point` over every device of every process, in
    `jax.devices()` order (process 0's devices first: with seq > 1 and data = 1 the sequence
    crosses the processes)."""
    import jax
    from jax.sharding import Mesh

    n = int(np.prod(point.mesh))
    if jax.device_count() != n:
        raise UsageError(f"point {point.spec()!r}: mesh={mesh_text(point.mesh)} needs {n} devices; the run has "
                         f"{jax.process_count()} process(es) with {jax.device_count()} device(s) in all (a "
                         "multi-process mesh spans every device)")
    return Mesh(np.array(jax.devices()).reshape(point.mesh), AXES)


def to_host(tree, mesh):
    """A pytree of global arrays as host numpy arrays, the same on every process: one compiled
    all-gather of the whole tree to a replicated layout (a collective: every process calls it),
    then each process's first local copy."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), replicated)


def run_point(point: Point, process: int, count: int) -> Outputs:
    """`point`'s outputs (canonical names), computed on the global mesh by every process."""
    from jax_impl import sharded

    from ..problems.fixtures import load_case
    from ..sides.implementations import bundle_values, implementation, run_config

    impl = implementation("jax")
    fx = load_case(point.case)
    mesh = global_mesh(point)
    cfg = impl.config(run_config(fx.config, point, False))
    _say(process, count, f"running sharded_parity_bundle at {point.label}")
    raw = sharded.sharded_parity_bundle(fx.params, fx.inputs, cfg, point.dtype, mesh, fx.oracle_selection)
    _say(process, count, f"gathering the outputs of {point.label}")
    values = bundle_values(to_host(raw, mesh))
    return Outputs(f"jax mesh {mesh_text(point.mesh)} on {count} process(es)", values, impl.missing(point))


def write_bundle(out: Path, point: Point, outputs: Outputs, devices_per_process: int) -> Path:
    """`outputs` of `point` as DIR/<spec>.outputs.safetensors (atomically), with what ran them."""
    import jax

    from ..problems.fixtures import atomic_write, write_safetensors

    meta = {"format": BUNDLE_FORMAT, "point": point.spec(), "source": outputs.source,
            "missing": json.dumps(dict(outputs.missing), sort_keys=True),
            "processes": str(jax.process_count()), "devices_per_process": str(devices_per_process),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "matmul_precision": str(jax.config.jax_default_matmul_precision or "highest")}
    path = bundle_path(out, point)
    atomic_write(path, write_safetensors(dict(outputs.values), meta))
    return path


def read_bundle(path: Path) -> tuple[Point, Outputs, dict[str, str]]:
    """(the point, its Outputs, the metadata) of a bundle `write_bundle` wrote."""
    from ..problems.fixtures import CorruptFile, read_safetensors

    try:
        tensors, meta = read_safetensors(Path(path).read_bytes())
    except CorruptFile as exc:
        raise UsageError(f"{path}: not an outputs bundle ({exc})") from None
    if meta.get("format") != BUNDLE_FORMAT:
        raise UsageError(f"{path}: format={meta.get('format')!r}, expected {BUNDLE_FORMAT!r} (written by "
                         "python -m harness.run.multihost --out)")
    lacking = [k for k in BUNDLE_METADATA if k not in meta]
    if lacking:
        raise UsageError(f"{path}: its metadata lacks {', '.join(lacking)} (a bundle names what ran it)")
    point = Point.parse(meta["point"])
    values = {name: t.stored() for name, t in tensors.items()}
    return point, Outputs(meta["source"], values, json.loads(meta["missing"])), meta


def host_main(args) -> int:
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", args.precision)
    initialize(args.coordinator, args.num_processes, args.process_id, args.init_timeout, args.heartbeat_timeout)
    process, count = jax.process_index(), jax.process_count()
    _say(process, count, f"distributed runtime up: {jax.device_count()} devices, {jax.local_device_count()} here "
                         f"({jax.default_backend()})")
    points = [parse_point(s, count, jax.local_device_count()) for s in args.point]
    out = Path(args.out)
    for point in points:
        outputs = run_point(point, process, count)
        if process == 0:
            _say(process, count, f"wrote {write_bundle(out, point, outputs, jax.local_device_count())}")
    _say(process, count, "done")
    jax.distributed.shutdown()
    return 0


# --------------------------------------------------------------------------- judging


def judge_dir(out: Path, reference: str = "goldens") -> tuple[list[dict], list[str]]:
    """Judge every bundle in `out`: each entry of its point (forward, dense, sparse) by
    harness.run.collect.evaluate with the bundle's outputs as the candidate. Returns (one record per
    check, one summary line per point)."""
    import jax

    from .collect import evaluate

    jax.config.update("jax_enable_x64", True)
    paths = sorted(Path(out).glob(f"*{BUNDLE_SUFFIX}"))
    if not paths:
        raise UsageError(f"--judge {str(out)!r}: no *{BUNDLE_SUFFIX} there (python -m harness.run.multihost --out "
                         "writes them)")
    records, lines = [], []
    for path in paths:
        point, candidate, meta = read_bundle(path)
        if meta["backend"] != jax.default_backend():
            raise UsageError(f"{path}: ran on backend={meta['backend']!r}, this process runs "
                             f"{jax.default_backend()!r}: judge on the platform the run used (its native "
                             "single-device run is computed here)")
        jax.config.update("jax_default_matmul_precision", meta["matmul_precision"])
        modes = ("forward", "dense", "sparse") if point.teacher == "joint" and not point.tchunk else ("dense", "sparse")
        results = []
        for entry in entries_at(point, modes):
            for r in evaluate(entry, reference, meta["matmul_precision"], candidate=candidate):
                results.append(r)
                records.append({"id": entry.id, "point": point.spec(), "quantity": r.quantity, "check": r.check,
                                "status": r.status, "ratio": r.ratio, "message": r.message})
        bad = [r for r in results if r.failed]
        aside = [r for r in results if r.status in ("not_applicable", "not_provided")]
        judged = [r for r in results if r.status in ("passed", "excused", "failed")]
        worst = max(judged, key=lambda r: r.ratio, default=None)
        where = f"worst ratio {worst.ratio:.3g} ({worst.quantity}, {worst.check})" if worst else "nothing judged"
        runs = f"{meta['processes']} processes x {meta['devices_per_process']} devices"
        lines.append(f"{'FAIL' if bad else 'ok'} {point.label} ({runs}): {len(results)} checks, {len(bad)} failed, "
                     f"{len(aside)} not applicable or not provided, {where}")
        lines += [f"  {r.message}" for r in bad + aside]
    return records, lines


def judge_main(args) -> int:
    out = Path(args.judge)
    records, lines = judge_dir(out, args.reference)
    (out / "judged.json").write_text(json.dumps(records, indent=1) + "\n")
    print("\n".join(lines))
    # As `csa-parity run`: a failed or errored check fails; not_applicable and not_provided are
    # counted and listed, never passed (the tests assert every entry passed).
    return 1 if any(r["status"] in ("failed", "error") for r in records) else 0


# --------------------------------------------------------------------------- the local launcher


def free_port() -> int:
    """A TCP port free on the loopback address now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices: int) -> dict[str, str]:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1",
               XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]))
    return env


def _last_stage(log: Path) -> str:
    """The last stage line a process printed, and its last line when that is something else (the
    exception it died of)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    stages = [ln.split("] ", 1)[1] for ln in lines if ln.startswith("[process ")]
    stage = f"last stage: {stages[-1]}" if stages else "before the distributed runtime was up"
    # Its own last words (a traceback's last line), not the runtime's bracketed log lines.
    last = [ln for ln in lines if not ln.startswith("[")]
    if last and lines.index(last[-1]) > max((i for i, ln in enumerate(lines) if ln.startswith("[process ")), default=-1):
        stage += f"; its last line: {last[-1][:300]}"
    return stage


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def launch(out: Path, points: list[str], processes: int, devices: int, deadline: float, init_timeout: int,
           heartbeat_timeout: int, precision: str = "highest") -> int:
    """Start `processes` processes of this module (each `devices` simulated CPU devices) on a free
    loopback port and wait for them: 0 when all exit 0; DEADLINE_EXIT, every process killed and
    one line on stderr, when one dies or `deadline` seconds pass."""
    for spec in points:
        parse_point(spec, processes, devices)  # a user error stops here, before anything starts
    out = Path(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = [sys.executable, "-m", "harness.run.multihost", "--out", str(out), *[a for s in points for a in ("--point", s)],
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
            "--init-timeout", str(init_timeout), "--heartbeat-timeout", str(heartbeat_timeout),
            "--precision", precision]
    env = _child_env(devices)
    children = []
    start = time.monotonic()

    def stop_all():
        for p, _ in children:
            if p.poll() is None:
                p.kill()
        for p, _ in children:
            p.wait()

    def on_signal(signum, _frame):
        stop_all()
        print(f"multihost: stopped by {signal.Signals(signum).name}; every process killed", file=sys.stderr)
        sys.exit(128 + signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(processes):
            log = logs / f"process-{i}.log"
            with open(log, "wb") as fh:
                p = subprocess.Popen([*base, "--process-id", str(i)], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            children.append((p, log))
            print(f"multihost: process {i} pid {p.pid}, log {log}", file=sys.stderr, flush=True)
        while True:
            codes = [p.poll() for p, _ in children]
            dead = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if dead:
                i, rc = dead[0]
                stop_all()
                print(f"multihost: process {i} (pid {children[i][0].pid}) {_exit_text(rc)} after "
                      f"{time.monotonic() - start:.1f} s ({_last_stage(children[i][1])}); every other process "
                      f"killed; logs in {logs}", file=sys.stderr)
                return DEADLINE_EXIT
            if all(rc == 0 for rc in codes):
                return 0
            if time.monotonic() - start > deadline:
                running = [i for i, rc in enumerate(codes) if rc is None]
                stages = "; ".join(f"process {i}: {_last_stage(children[i][1])}" for i in running)
                stop_all()
                print(f"multihost: the run passed its deadline of {deadline:g} s; killed process(es) "
                      f"{', '.join(map(str, running))} ({stages}); logs in {logs}", file=sys.stderr)
                return DEADLINE_EXIT
            time.sleep(0.1)
    finally:
        stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness.run.multihost", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the directory the outputs bundles (and --local's logs) go to")
    ap.add_argument("--point", action="append", default=[],
                    help="a sharded point, case:dtype:ichunk:tchunk:qchunk:teacher:backend:DxSxM (repeatable)")
    ap.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator (default: jax.distributed's "
                                          "cluster detection)")
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--process-id", type=int)
    ap.add_argument("--init-timeout", type=int, default=None,
                    help=f"seconds to wait for every process to connect (default 300; --local: {LOCAL_INIT_TIMEOUT})")
    ap.add_argument("--heartbeat-timeout", type=int, default=None,
                    help=f"seconds without a heartbeat before a peer counts as dead (default 100; --local: "
                         f"{LOCAL_HEARTBEAT_TIMEOUT})")
    ap.add_argument("--precision", default="highest", choices=("highest", "default"),
                    help="jax_default_matmul_precision (the judge picks the matching tolerance profile)")
    ap.add_argument("--judge", metavar="DIR", help="judge the bundles in DIR (no run)")
    ap.add_argument("--reference", default="goldens", choices=("goldens", "live"),
                    help="what --judge compares against: the fixture goldens, or torch_ref live")
    ap.add_argument("--local", type=int, metavar="N", help="start N processes on this machine and wait for them")
    ap.add_argument("--devices-per-process", type=int, default=4, help="--local: simulated CPU devices each")
    ap.add_argument("--deadline", type=float, default=LOCAL_DEADLINE,
                    help=f"--local: seconds the whole run may take (default {LOCAL_DEADLINE:g})")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.judge:
            return judge_main(args)
        if not args.out or not args.point:
            raise UsageError("--out DIR and at least one --point SPEC are needed (or --judge DIR)")
        for name in ("init_timeout", "heartbeat_timeout"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')}={value} must be at least 1 (seconds)")
        if args.local is not None:
            if args.local < 1 or args.devices_per_process < 1:
                raise UsageError(f"--local={args.local} and --devices-per-process={args.devices_per_process} must "
                                 "be at least 1")
            if args.deadline <= 0:
                raise UsageError(f"--deadline={args.deadline:g} must be positive (seconds)")
            return launch(Path(args.out), args.point, args.local, args.devices_per_process, args.deadline,
                          args.init_timeout or LOCAL_INIT_TIMEOUT, args.heartbeat_timeout or LOCAL_HEARTBEAT_TIMEOUT,
                          args.precision)
        args.init_timeout = args.init_timeout or 300
        args.heartbeat_timeout = args.heartbeat_timeout or 100
        return host_main(args)
    except UsageError as exc:
        print(f"multihost: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

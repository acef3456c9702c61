"""`csa-parity`: the main job (`run`) and the fixture tools (`regenerate`).

User errors (an unknown case, a chunk that does not divide the heads, a plug-in
that cannot be loaded, an unwritable report or cache directory, a damaged fixture) exit
with status 2 and one line on stderr, never a traceback. Parity failures, and points
whose implementation raised, crashed its worker or ran past --timeout, exit 1. An
interrupted run (Ctrl-C, SIGTERM) writes partial reports and exits 130 / 143.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time

from ..platforms import usable_cpus


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if kind is int:
            try:
                return [int(x) for x in items]
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    from ..problems.matrix import LONG_SAMPLE, MILLION_SAMPLE, SAMPLES
    from . import regenerate

    p = argparse.ArgumentParser(prog="csa-parity", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the parity matrix and write reports (the main job)")
    run.add_argument("--cases", type=_csv(str), help="comma-separated case names (default: all)")
    run.add_argument("--dtypes", type=_csv(str), help="float32,bfloat16,float16,float64 (default: all)")
    run.add_argument("--ichunks", type=_csv(int), help="indexer chunk sizes (default: the sampled set)")
    run.add_argument("--tchunks", type=_csv(int), help="teacher chunk sizes (default: the sampled set)")
    run.add_argument("--qchunks", type=_csv(int), help="query chunk sizes, 0 = all rows (default: the sampled set)")
    run.add_argument("--modes", type=_csv(str), help="forward,dense,sparse (default: all)")
    run.add_argument("--teachers", type=_csv(str),
                     help="joint,compressed: the loss's teacher (default: both, on every case)")
    run.add_argument("--backends", type=_csv(str), default=["xla"],
                     help="xla,pallas: jax_impl's scoring backends (default: xla; pallas runs its own sample "
                          "of points, harness/problems/matrix.py; off TPU the Pallas kernels run in interpret mode)")
    run.add_argument("--sample", default="default", choices=[*SAMPLES, LONG_SAMPLE, MILLION_SAMPLE],
                     help="which chunk points the matrix samples (harness/problems/matrix.py): default, ci (the "
                     "subset `make test` runs) or full (the whole chunk cross product, slow); long: the long "
                     "cases (S = 131072), judged a block of rows at a time; million: S = 1048576, its rows sampled "
                     "(docs/matrix.md)")
    run.add_argument("--full", action="store_true", help="the same as --sample full")
    run.add_argument("--impl", default="jax",
                     help="'jax' or a plug-in 'package.module[:factory]', imported from the current directory "
                          "first (as `python -m` does), then from the installed packages")
    run.add_argument("--reference", default="live", choices=["live", "goldens"],
                     help="live torch_ref (default) or the fixture goldens (JAX-only, no torch)")
    run.add_argument("--precision", default="highest", choices=["highest", "default"],
                     help="JAX default matmul precision for the run, and the tolerance profile it is "
                     "judged with (harness/judging/tolerance.py; default: highest)")
    run.add_argument("--fixtures", metavar="DIR",
                     help="the fixture set to judge against (default: the repository's fixtures/ in a clone, the "
                          "installed package's own set otherwise; CSA_PARITY_FIXTURES); the reports name the set "
                          "and its MANIFEST.json's sha256")
    run.add_argument("--out", default="reports", help="report directory (default: reports)")
    run.add_argument("--jobs", type=int, default=usable_cpus(), help="worker processes (default: the CPUs this process may use)")
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="time limit of one point (its implementation, reference and judging); a point "
                          "past it is an error and its worker is killed (default: CSA_PARITY_TIMEOUT or "
                          "600, over 40x the slowest point of the default matrix on a 2-core machine; "
                          "--sample long: of one long case, default 4 hours)")
    run.add_argument("--max-memory", metavar="SIZE",
                     help="resident memory one worker may hold (8GiB, 512MiB, bytes); a worker over it is killed "
                          "and its point is an error that says its peak (default: no limit; a worker the kernel's "
                          "OOM killer ends is reported the same way)")
    run.add_argument("--cache-dir", metavar="DIR",
                     help="where compiled programs and the live reference's outputs persist between runs "
                          "(default: CSA_PARITY_CACHE_DIR, else $XDG_CACHE_HOME/csa-parity, else "
                          "~/.cache/csa-parity; bounded, the least recently used evicted first)")
    run.add_argument("--no-cache", action="store_true",
                     help="compile every program and compute every reference; read and write no persistent cache")
    run.add_argument("--profile", action="store_true",
                     help="print where the time went: start-up, trace, lower, compile, run, reference and judge, "
                          "summed over the points, and the slowest points' splits (parity.json has every point's)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--list", action="store_true",
                     help="print the selection (cases, dtypes, chunk points, entries, compiled programs) and "
                          "exit without running it")
    fx = sub.add_parser("regenerate", aliases=["fixtures"],
                        help="write a fixture set (the torch reference's goldens: needs the reference extra) into "
                             "--fixtures-dir DIR, or --check one")
    regenerate.add_arguments(fx)
    return p


def version_line() -> str:
    """`csa-parity --version`: this package's version and the frameworks' (harness.package_data.versions)."""
    from ..package_data import versions

    v = versions()
    return f"csa-parity {v['csa-parity']} (" + ", ".join(f"{k} {v[k]}" for k in ("jax", "jaxlib", "torch")) + ")"


def _use_fixtures(args) -> None:
    """--fixtures DIR: the set every process of the run reads (CSA_PARITY_FIXTURES, which the
    workers inherit and harness.sides.implementations reads)."""
    from ..package_data import FIXTURES_ENV

    if getattr(args, "fixtures", None) is None:
        return
    if not os.path.isdir(args.fixtures):
        raise ValueError(f"--fixtures={args.fixtures!r} is not a directory (a fixture set: <case>.safetensors files "
                         "and their MANIFEST.json; write one with `csa-parity regenerate --fixtures-dir DIR`)")
    os.environ[FIXTURES_ENV] = os.path.abspath(args.fixtures)


def _check_chunks(case: str, knob: str, heads_name: str, chunks) -> None:
    """A head chunk size is 0 (no chunking) or a divisor of the head count: the harness's own
    rule (harness.problems.matrix.divisors), whatever implementation --impl names."""
    from ..problems.cases import get_case
    from ..problems.matrix import divisors

    heads = get_case(case).config[heads_name]
    valid = [0, *divisors(heads)]
    for c in chunks or []:
        if c not in valid:
            raise ValueError(f"case {case!r}: {knob}={c!r} must divide {heads_name}={heads} "
                             f"(valid: {', '.join(map(str, valid))})")


def _check_query_chunks(chunks) -> None:
    """A query chunk is an int >= 0 (0 = all rows; it need not divide S: SPEC section 1)."""
    for c in chunks or []:
        if c < 0:
            raise ValueError(f"query_chunk={c!r} must be an int >= 0 (0 = all rows)")


def _validate_run_args(args, listing: bool = False) -> None:
    _check_selection(args)
    _check_sources(args, listing)


def _check_selection(args) -> None:
    """The arguments' own rules (names, chunk sizes, counts): cheap, nothing imported or read."""
    from ..outputs import MODES
    from ..points import DTYPES
    from ..problems.cases import CASES, TEACHERS, get_case

    for name in args.cases or []:
        get_case(name)
    for dt in args.dtypes or []:
        if dt not in DTYPES:
            raise ValueError(f"dtype={dt!r} is not supported (valid: {', '.join(DTYPES)})")
    for mode in args.modes or []:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not supported (valid: {', '.join(MODES)})")
    for teacher in args.teachers or []:
        if teacher not in TEACHERS:
            raise ValueError(f"teacher={teacher!r} is not supported (valid: {', '.join(TEACHERS)})")
    # The harness's own rules, not the code under test's: --impl may name a plug-in.
    for name in args.cases or list(CASES):
        _check_chunks(name, "indexer_head_chunk", "index_n_heads", args.ichunks)
        _check_chunks(name, "loss_head_chunk", "num_query_heads", args.tchunks)
    _check_query_chunks(args.qchunks)
    if args.jobs < 1:
        raise ValueError(f"--jobs={args.jobs} must be >= 1")
    if args.timeout is not None and not args.timeout > 0:
        raise ValueError(f"--timeout={args.timeout:g} must be a number of seconds > 0")
    if getattr(args, "max_memory", None) is not None:
        from ..sides.worker import parse_size

        parse_size(args.max_memory)


def _check_sources(args, listing: bool = False) -> None:
    """What the run reads and writes: the implementation imports, every selected fixture loads
    (a damaged one is one line on stderr, before the progress bar starts), the report directory
    is writable."""
    from ..problems.cases import CASES
    from ..problems.fixtures import load_case
    from ..sides.implementations import BUILTINS, load_implementation

    if not (listing and args.impl in BUILTINS):  # --list of the built-in side needs no JAX
        load_implementation(args.impl)
    for name in args.cases or list(CASES):
        load_case(name, os.environ.get("CSA_PARITY_FIXTURES") or None)
    if not listing:  # --list writes nothing
        _check_writable(args.out)


def _check_writable(out: str, what: str = "report directory", fix: str = "choose another with --out") -> None:
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".csa-parity-write-test")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{what} {out!r} is not writable ({exc.strerror or exc}); {fix}") from None


def _init_worker(precision: str, fixtures_dir: str | None) -> None:
    os.environ["JAX_ENABLE_X64"] = "1"
    if fixtures_dir:
        os.environ["CSA_PARITY_FIXTURES"] = fixtures_dir
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", precision)


class _Interrupted(BaseException):
    """SIGTERM (a kill of the CLI): stop like Ctrl-C, writing partial reports."""


def _terminate(signum, frame):
    raise _Interrupted(signum)


def _points_of(groups) -> list[list[tuple]]:
    """Each group's entries as (point, entries of that point), in point order."""
    out = []
    for entries in groups:
        by_point: dict = {}
        for e in entries:
            by_point.setdefault(e.point, []).append(e)
        out.append(sorted(by_point.items()))
    return out


def platform_info(precision: str, reference: str, device: dict | None = None) -> dict:
    """What the report says the run computed on: `device` (harness.platforms.device_info, as a
    worker found it: this process never opens an accelerator, whose chip one process at a time
    may hold), the matmul precision and the tolerance profile applied, the Pallas mode, and
    the torch version of a live reference. `device` None: this process's own device (opened
    here; for callers that compute in-process)."""
    from .. import platforms
    from ..judging.tolerance import PROFILES

    if device is None:
        device = platforms.device_info()
    info = {**device, "matmul_precision": precision}
    stored = platforms.load_profile(device["backend"], device.get("device_kind")) if device["backend"] != "cpu" else None
    info["tolerance"] = {
        "precision_profile": precision if precision in PROFILES else None,
        "platform_profile": None if stored is None else stored["path"],
        "platform_factors": platforms.oracle_factors(stored, precision) or None,
        "note": ("the oracle checks' bounds times the platform profile's factors (harness/platforms.py); "
                 "chunk, xla and exact64 checks unchanged") if stored is not None else
                ("the CPU's bounds" if device["backend"] == "cpu" else
                 f"no platform profile is stored for {device['backend']} {device.get('device_kind')!r}: the CPU's "
                 "bounds (measure one with scripts/measure_platform_profile.py)"),
    }
    if device["backend"] != "tpu":  # what a pallas-backend point ran (jax_impl.kernels.interpret_mode)
        info["pallas"] = f"Pallas interpret mode on {device['backend']} (no TPU: the kernels are interpreted)"
    # The variables that select torch's CPU kernels (as this run's processes see them: what the
    # user left unset, importing the harness pinned), so two CPU reports can be told apart.
    from .. import ISA_VARIABLES

    info["cpu_kernel_variables"] = {name: os.environ.get(name, "") for name in ISA_VARIABLES}
    if reference == "live":  # the installed version, read without importing torch here
        from importlib.metadata import PackageNotFoundError, version

        try:
            info["torch_version"] = version("torch")
        except PackageNotFoundError:
            raise ValueError("--reference live needs torch (pip install -e '.[reference]'); without it run "
                             "--reference goldens") from None
    return info


def stage_entries(entries, impl: str):
    """A stage plug-in runs native points only (chunks are the pipeline's knobs): every
    matrix entry there (reported not provided, counted) plus its stage's entries; the
    quantizer's at the points of the cases that quantize (index_quant) only."""
    from ..outputs import STAGE_MODE, stage_quantities
    from ..points import Entry
    from ..problems.cases import CASES
    from ..sides.implementations import BUILTINS, StageImplementation, load_implementation

    if impl in BUILTINS:
        return entries
    api = load_implementation(impl)
    if not isinstance(api, StageImplementation):
        return entries
    # The joint teacher's native points: a stage has no teacher (the compressed teacher's points
    # would only add pipeline entries the plug-in does not provide).
    native = [e for e in entries if not e.point.chunked and e.point.teacher == "joint"]
    points = sorted({e.point for e in native})
    if api.stage == "quantizer":
        points = [p for p in points if CASES[p.case].config.get("index_quant") is not None]
        if not points and native:
            quantized = ", ".join(c for c, case in CASES.items() if case.config.get("index_quant") is not None)
            raise ValueError(f"{impl} is a quantizer stage: the selection holds no case that quantizes "
                             f"(index_quant); choose among {quantized}")
    return native + [Entry(p, STAGE_MODE, q, impl) for p in points for q in stage_quantities(api.stage)]


CHECKPOINT_S = 30.0  # how often a running CLI rewrites its partial report (parity.json, parity.md)


def _sorted(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r["case"], r["dtype"], r["ichunk"], r["tchunk"], r["qchunk"], r["teacher"],
                                          r.get("backend", "xla"), r["mode"], r["quantity"], r["check"]))


def _chunk_label(point) -> str:
    """`i2/t2/q21`: indexer, teacher and query chunk (0 = none), as the heat map labels them."""
    return f"i{point.ichunk}/t{point.tchunk}" + (f"/q{point.qchunk}" if point.qchunk else "")


def selection_lines(entries, sample: str) -> list[str]:
    """What a run of `entries` holds, without running it: cases, dtypes, the chunk points of each
    case x dtype x teacher, the entries per mode, and the compiled programs (harness.problems.matrix.programs_at
    per point, and the native points that chunked points are compared with and the selection
    leaves out)."""
    from ..points import DTYPES
    from ..problems.matrix import programs_at

    points = sorted({e.point for e in entries})
    cases = list(dict.fromkeys(e.point.case for e in entries))  # catalogue order
    dtypes = [d for d in DTYPES if any(p.dtype == d for p in points)]
    rows: dict[tuple, list] = {}
    for p in points:
        rows.setdefault((p.case, p.dtype, p.teacher), []).append(_chunk_label(p))
    modes: dict[str, int] = {}
    for e in entries:
        modes[e.mode] = modes.get(e.mode, 0) + 1
    extra_native = {p.native for p in points if p.native is not None} - set(points)
    width = max(len(c) for c in cases)
    lines = [f"sample {sample}: {len(cases)} cases, {len(dtypes)} dtypes, {len(points)} points, {len(entries)} entries",
             f"cases: {', '.join(cases)}", f"dtypes: {', '.join(dtypes)}",
             "chunk points (indexer/teacher[/query] chunk, 0 = none):"]
    for case in cases:
        for dtype in dtypes:
            for teacher in ("joint", "compressed"):
                labels = rows.get((case, dtype, teacher))
                if labels:
                    tag = "" if teacher == "joint" else " (compressed teacher)"
                    lines.append(f"  {case:<{width}}  {dtype:<8}  {' '.join(labels)}{tag}")
    lines.append("entries: " + ", ".join(f"{n} {mode}" for mode, n in modes.items()) + f" ({len(entries)} in all)")
    programs = sum(programs_at(p) for p in points) + sum(programs_at(p) for p in extra_native)
    quantized = sum(programs_at(p) == 2 for p in points)
    lines.append(f"compiled programs: {programs} ({len(points)} points, one program each"
                 + (f", two on the {quantized} points of quantized cases (their own codes and the oracle's)"
                    if quantized else "")
                 + (f", + {len(extra_native)} native points the chunk checks compare with" if extra_native else "")
                 + "); nothing was run")
    return lines


def run(args) -> int:
    from ..problems.matrix import LONG_SAMPLE, MILLION_SAMPLE, build_matrix
    from ..sides import worker
    from ..sides.timing import cache_root
    from .tasks import TASK

    began = time.time()
    if args.sample in (LONG_SAMPLE, MILLION_SAMPLE):  # judged a block of rows at a time (harness.run.long)
        from .long import run as run_long

        return run_long(args)
    _check_selection(args)
    _use_fixtures(args)
    sample = "full" if args.full else args.sample
    entries = build_matrix(args.cases, args.dtypes, args.ichunks, args.tchunks, args.modes, args.impl, args.qchunks,
                           sample=sample, teachers=args.teachers, backends=args.backends)
    cache_dir = None if args.no_cache else cache_root(args.cache_dir)
    if cache_dir is not None and not args.list:
        _check_writable(cache_dir, "cache directory", "choose another with --cache-dir, or run with --no-cache")
    init = {"precision": args.precision, "fixtures_dir": os.environ.get("CSA_PARITY_FIXTURES"),
            "sys_path": list(sys.path), "cache_root": cache_dir, "task": TASK, "device_info": True}
    # The workers start now: their imports overlap this process's own (the implementation, the
    # fixtures, JAX's platform), which a run of one point would otherwise wait for twice.
    from .. import platforms

    want = min(args.jobs, len({e.group for e in entries}))
    # Where the device may be a TPU, one worker opens it first and says what it is (a TPU chip
    # opens in one process at a time; two opening it at once both fail); the others start once
    # it is known that the device allows them (_run).
    first = 1 if platforms.may_be_one_process() else want
    started = [] if args.list else worker.spawn(init, first)
    init["workers_wanted"] = want
    try:
        return _run(args, sample, entries, init, started, began)
    finally:
        worker.kill(started)  # those run_points did not take (a user error stopped the run first)


def _run(args, sample: str, entries, init: dict, started, began: float) -> int:
    from ..sides.timing import COUNTS
    from ..sides.worker import DEFAULT_TIMEOUT, parse_size, run_points, timeout_from_env
    from .report import (attach_reruns, cache_line, code_ties_text, error_lines, failure_lines, format_table,
                         memory_line, memory_summary, profile_lines, run_header, status_line, summarise, table,
                         time_split, write_reports)
    from .tasks import error_records

    _check_sources(args, listing=args.list)
    entries = stage_entries(entries, args.impl)
    if not entries:
        raise ValueError("the selection is empty: no matrix entry matches --cases/--dtypes/--ichunks/--tchunks/--modes")
    if args.list:
        print("\n".join(selection_lines(entries, sample)))
        return 0
    groups: dict[str, list] = {}
    for e in entries:
        groups.setdefault(e.group, []).append(e)
    # Big groups first, so the last worker does not start the largest one alone.
    ordered = _points_of(sorted(groups.values(), key=len, reverse=True))
    n_points = sum(len(g) for g in ordered)
    records: list[dict] = []
    walls: list[tuple[float, str]] = []
    splits: dict[str, dict] = {}  # point label -> harness.sides.timing.split
    cache_dir, fixtures_dir = init["cache_root"], init["fixtures_dir"]
    timeout = args.timeout if args.timeout is not None else timeout_from_env()
    max_memory = None if args.max_memory is None else parse_size(args.max_memory)
    _init_worker(args.precision, fixtures_dir)
    jobs = args.jobs
    device = None
    prefetch = None
    if started:  # the workers open the backend; this process never does (a TPU chip opens in one process)
        from ..sides.worker import claim_devices, spawn

        started[:], device = claim_devices(started)
        want = init.pop("workers_wanted", len(started))
        if device and device.get("processes_per_host") == 1:
            if want > 1:
                print(f"csa-parity: --jobs {args.jobs}: a {device['backend'].upper()} host's chips open in one "
                      "process at a time; running the points one after another in 1 worker, which compiles "
                      "their programs ahead in threads", file=sys.stderr)
            jobs = 1
            specs = sorted({p.spec() for g in ordered for p, _ in g}
                           | {p.native.spec() for g in ordered for p, _ in g if p.native is not None})
            if args.impl == "jax":
                threads = min(12, usable_cpus())
                # the time limit once per batch of programs it compiles ahead (prefetch's batches)
                batches = -(-len(specs) // (4 * threads))
                prefetch = ("harness.sides.implementations:prefetch", (specs, threads), timeout * batches)
        elif len(started) < want:
            started.extend(spawn(init, want - len(started)))
    from ..package_data import fixture_set, versions

    meta = {
        "impl": args.impl,
        "reference": args.reference,
        "versions": versions(),
        "fixtures": fixture_set(fixtures_dir),
        "tolerance_profile": args.precision,
        "platform": platform_info(args.precision, args.reference, device),
        "selection": {k: getattr(args, k) for k in ("cases", "dtypes", "ichunks", "tchunks", "qchunks", "modes", "teachers",
                                                    "backends", "full", "sample")},
        "timeout_s": timeout,
        "max_memory_bytes": max_memory,
    }

    def cache_meta() -> dict:
        return {"dir": cache_dir, **{k: sum(s.get(k, 0) for s in splits.values()) for k in COUNTS}}

    def point_meta(partial: str | None) -> dict:
        slowest = sorted(walls, reverse=True)[:5]
        points = {"total": n_points, "run": len(walls), "wall_sum_s": round(sum(w for w, _ in walls), 2),
                  "slowest": [[label, round(w, 2)] for w, label in slowest], "by_point": dict(sorted(splits.items()))}
        points["time_split_s"] = time_split({"points": points})
        points["memory"] = memory_summary(splits)
        return {**meta, "wall_s": time.time() - began, "cache": cache_meta(), "points": points,
                "partial": None if partial is None else {"reason": partial, "points_run": len(walls),
                                                         "points_total": n_points}}

    # A report that says it is partial from the start, rewritten as points end (at most every
    # CHECKPOINT_S): a CLI killed outright (SIGKILL) leaves one saying how many points ran.
    running = "running, or killed before it ended"
    write_reports([], point_meta(running), args.out, heatmap_too=False)
    last_checkpoint = [time.monotonic()]
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(entries), unit="entry", desc="parity", file=sys.stderr)

    # A failed or errored record carries the command that reruns its point with this run's options.
    rerun_timeout = None if timeout == DEFAULT_TIMEOUT else timeout

    def done(point, point_entries, point_records, wall, split=None):
        attach_reruns(point_records, args.reference, args.precision, rerun_timeout, fixtures_dir)
        for rec in point_records:  # the limit changes the outcome: the rerun keeps it
            if rec.get("rerun") and max_memory is not None and rec["rerun"].startswith(("csa-parity", "CSA_")):
                rec["rerun"] += f" --max-memory {shlex.quote(args.max_memory)}"
        records.extend(point_records)
        walls.append((wall, point.label))
        if split is not None and "torch_cpu_capability" in split:  # the live reference's kernel level
            meta["platform"]["torch_cpu_capability"] = split.pop("torch_cpu_capability")
        if split is not None:
            splits[point.label] = split
        if progress is not None:
            progress.update(len(point_entries))
        if time.monotonic() - last_checkpoint[0] > CHECKPOINT_S:
            write_reports(_sorted(records), point_meta(running), args.out, heatmap_too=False)
            last_checkpoint[0] = time.monotonic()

    interrupted = None
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        run_points(ordered, args.reference, args.precision, init, jobs, timeout, done, error_records,
                   started=started, prefetch=prefetch, max_memory=max_memory)
    except KeyboardInterrupt:
        interrupted = "interrupted (Ctrl-C)", 130
    except _Interrupted:
        interrupted = "interrupted (SIGTERM)", 143
    finally:
        signal.signal(signal.SIGTERM, previous)
        if progress is not None:
            progress.close()
    records = _sorted(records)
    meta = point_meta(interrupted[0] if interrupted else None)
    paths = write_reports(records, meta, args.out)
    summary = summarise(records)
    if interrupted:
        print(f"csa-parity: {interrupted[0]} after {len(walls)} of {n_points} points; partial reports: "
              f"{paths['json']}, {paths['md']}", file=sys.stderr)
        return interrupted[1]
    header, rows = table(records)
    print(run_header(meta))
    print(format_table(header, rows))
    print()
    print(
        f"{summary['entries']} entries, {summary['checks']} checks, {summary['failed']} failed "
        f"in {meta['wall_s']:.1f} s; " + status_line(summary) + f"; top-k ties excused: {summary['topk_excused_ties']}; "
        + (f"code ties excused: {code_ties_text(summary)}; " if summary["code_excused_ties"] else "")
        + "worst ratio by dtype: " + ", ".join(f"{k} {float(v):.3g}" for k, v in summary["worst_ratio_by_dtype"].items())
    )
    # headroom and not-applicable points, on every run
    from .report import HEADROOM_MARK, headroom_table

    hr_header, hr_rows = headroom_table(summary)
    print(f"headroom: {summary['headroom']['above_half']} checks above {HEADROOM_MARK}; worst ratio per kind and dtype:")
    print(format_table(hr_header, hr_rows))
    print(f"not applicable: {summary['not_applicable']} checks"
          + "".join(f"; {n} {reason}" for reason, n in summary["not_applicable_reasons"].items()))
    for line in failure_lines(records)[:20]:
        print("FAIL", line)
    for line in error_lines(summary)[:20]:  # one line per error (a crash is one line, not one per quantity)
        print("ERROR", line)
    print(cache_line(meta))
    print(memory_line(meta))
    if args.profile:
        print("\n".join(profile_lines(meta)))
    slowest = meta["points"]["slowest"]
    if slowest:
        print(f"slowest point: {slowest[0][1]:.1f} s ({slowest[0][0]}); time limit {timeout:g} s per point")
    print(f"reports: {paths['json']}, {paths['md']}, {paths['png']}")
    return 0 if summary["failed"] + summary["errors"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return run(args)
        from . import regenerate

        return regenerate.run_from_args(args)
    except ValueError as exc:  # config, fixture, implementation, selection and directory errors
        print(f"csa-parity: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from ..platforms import DeviceBusy

        if not isinstance(exc, DeviceBusy):
            raise
        print(f"csa-parity: error: {exc}", file=sys.stderr)  # another program holds the chip: one line
        return 2
    except KeyboardInterrupt:
        print("csa-parity: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

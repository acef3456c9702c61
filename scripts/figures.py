#!/usr/bin/env python
"""Write docs/FIGURES.md: every figure of this project that goes stale, in one generated page.

    make figures                                  # = python scripts/figures.py
    python scripts/figures.py --report PATH       # headroom and timings of another parity.json
    python scripts/figures.py --run-parity ARGS   # first run `csa-parity run ARGS --out reports`

What it reads, all cheap (a few seconds, no JAX program compiled):
- the matrix's sizes per sample: `harness.problems.matrix.build_matrix` (nothing runs);
- the catalogues' sizes (cases, planted mistakes of both mutation self-tests, fixtures);
- line counts of the code;
- the memory and speed benchmark's last results, `benchmarks/results.json` (`make bench`
  rewrites it);
- a parity report, `reports/parity.json` by default (`make parity` or any `csa-parity run`
  writes it): its selection, wall time, slowest points and headroom. `--run-parity` runs
  that report first, which takes as long as the run does (the default matrix: most of an
  hour on 2 cores). The section names the report and the command that wrote it; with no
  report present (a fresh clone) the page keeps the section it has.

It also writes docs/judging.md's table of guarantees (every number of harness/judging/tolerance.py, what
it decides, its boundary test and its mutant) from tests/test_tolerance_boundaries.py.

Every section names the command that reproduces its figures. The docs pages link here
instead of copying a figure that changes when the code, the catalogue or the machine does.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

GIB = 2.0**30
OUT = ROOT / "docs" / "FIGURES.md"
DTYPE_ORDER = ("float32", "bfloat16", "float16", "float64")


def _table(header: list[str], rows: list[list]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def matrix_section() -> list[str]:
    from harness.platforms import selection
    from harness.problems.cases import CASES
    from harness.problems.matrix import SAMPLES, build_matrix, programs_at

    rows = []
    for sample in SAMPLES:
        entries = build_matrix(sample=sample)
        points = {e.point for e in entries}
        teachers = Counter(p.teacher for p in points)
        modes = Counter(e.mode for e in entries)
        on_tpu = sum(len(v) for v in selection(entries, "tpu").values())
        rows.append([f"`{sample}`", f"{len(points)} ({sum(programs_at(p) for p in points)})", teachers["joint"],
                     teachers["compressed"], len(entries),
                     ", ".join(f"{modes[m]} {m}" for m in ("forward", "dense", "sparse")), on_tpu])
    return ["## The matrix", "",
            f"`python -c 'from harness.problems.matrix import build_matrix; ...'` or, per selection, "
            f"`csa-parity run --list [--sample ci|default|full]`. {len(CASES)} cases, 4 dtypes. A compiled "
            "program per point, two per point of a quantized case (on the oracle's codes and on its own); "
            "entries are what the judge checks (one or more checks each).", "",
            *_table(["sample", "points (compiled programs)", "joint teacher", "compressed teacher", "entries",
                     "entries by mode", "not applicable on a TPU (float64)"], rows), ""]


def catalogue_section() -> list[str]:
    from harness.problems.cases import CASES
    from harness.selftest import judge_mutations, mutations

    fixtures = sorted((ROOT / "fixtures").glob("*.safetensors"))
    size = sum(p.stat().st_size for p in fixtures)
    rule_tests = (ROOT / "tests" / "test_judge_rules.py").read_text().count("\ndef test_")
    beyond = sum(1 for m in mutations.CATALOGUE if m.problems and not m.points)
    return ["## Catalogues", "",
            *_table(["what", "count", "command"], [
                ["cases (harness/problems/cases.py)", len(CASES), "`python -c 'import harness.problems.cases as c; print(list(c.CASES))'`"],
                ["fixture files, total size", f"{len(fixtures)}, {size / 1e6:.1f} MB",
                 "`python scripts/regenerate_fixtures.py` (byte-identical when nothing changed)"],
                ["planted implementation mistakes (mutation self-test)",
                 f"{len(mutations.CATALOGUE)} ({beyond} only a pinned random problem reveals)",
                 "`python -m harness.selftest.mutations`"],
                ["planted judge mistakes", len(judge_mutations.CATALOGUE), "`python -m harness.selftest.judge_mutations`"],
                ["numbers of harness/judging/tolerance.py, each pinned at its boundary and loosened 10x by a mutant",
                 len(judge_mutations.NUMBER_CATALOGUE), "`pytest tests/test_tolerance_boundaries.py`"],
                ["boundary test functions of the judge's rules", rule_tests, "`pytest tests/test_judge_rules.py`"],
            ]), ""]


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def lines_section() -> list[str]:
    rows = []
    for room in ("jax_impl", "torch_ref", "harness", "tests", "benchmarks", "examples", "scripts"):
        files = sorted((ROOT / room).rglob("*.py"))
        rows.append([f"`{room}/`", len(files), sum(_lines(p) for p in files)])
    harness = sorted((ROOT / "harness").rglob("*.py"), key=_lines, reverse=True)
    docs = sorted((ROOT / "docs").glob("*.md"))
    return ["## Lines of code and docs", "",
            "`wc -l` over each room's Python files (what this script counts).", "",
            *_table(["room", "files", "lines"], rows), "",
            "harness modules (room/module): "
            + ", ".join(f"{p.relative_to(ROOT / 'harness').with_suffix('').as_posix()} {_lines(p)}"
                        for p in harness if p.stem != "__init__"), "",
            f"README.md {_lines(ROOT / 'README.md')} lines; docs: "
            + ", ".join(f"{p.name} {_lines(p)}" for p in docs if p != OUT), ""]


def bench_section() -> list[str]:
    path = ROOT / "benchmarks" / "results.json"
    if not path.exists():
        return ["## Memory and speed of chunking", "", "No `benchmarks/results.json`: run `make bench`.", ""]
    data = json.loads(path.read_text())
    env, shapes = data.get("environment", {}), data.get("shapes", {})
    out = ["## Memory and speed of chunking", "",
           f"From `benchmarks/results.json`, written by `{data.get('command', 'python -m benchmarks.memory_speed').strip()}` "
           f"(`make bench`; the query sweep: `{data.get('query_command', '').strip()}`), jax {env.get('jax')}, "
           f"{env.get('backend')}, {env.get('cpu_count')} CPUs, load average at the end "
           f"{', '.join(f'{x:.1f}' for x in env.get('load_average_at_end', []))}. Shapes: "
           + ", ".join(f"{k}={v}" for k, v in shapes.items()) + ". Memory is XLA's compiled temp "
           "(plus the YNNPACK scratch on CPU), compile-only and deterministic for one XLA version; "
           "times are wall clock on a shared machine.", ""]
    rows = data.get("rows", [])
    seqs = sorted({r["seq"] for r in rows})
    chunks = sorted({r["indexer_chunk"] for r in rows if r["sweep"] == "indexer"})
    table = []
    for seq in seqs:
        cells = {r["indexer_chunk"]: r for r in rows if r["sweep"] == "indexer" and r["seq"] == seq}
        table.append([seq] + [f"{cells[c]['memory']['effective'] / GIB:.3g}" if c in cells else "-" for c in chunks])
    out += ["Effective temp (GiB) of the loss gradient by indexer chunk (teacher chunk 1; 0 = native):", "",
            *_table(["S"] + [str(c) for c in chunks], table), ""]
    timed = [r for r in rows if r["sweep"] == "indexer" and r.get("time")]
    if timed:
        out += ["Median wall time (s) at S = " + ", ".join(sorted({str(r["seq"]) for r in timed})) + ": "
                + ", ".join(f"chunk {r['indexer_chunk']} {r['time']['median_s']:.2f}" for r in timed), ""]
    qrows = data.get("query_rows", [])
    if qrows:
        rs = sorted({r["query_chunk"] for r in qrows})
        qtable = []
        for seq in sorted({r["seq"] for r in qrows}):
            cells = {r["query_chunk"]: r for r in qrows if r["seq"] == seq}
            qtable.append([seq] + [f"{cells[r]['dense']['effective'] / GIB:.3g}" if r in cells else "-" for r in rs])
        out += ["Query chunking, head chunk 1: effective temp (GiB) of the dense loss gradient by query chunk r "
                "(0 = all rows):", "", *_table(["S"] + [str(r) for r in rs], qtable), ""]
    timing = data.get("query_timing")
    if timing:
        out += [f"Time at S = {timing['seq']}, r = {timing['query_chunk']} against head chunking alone: "
                f"x{timing['ratio_median']:.2f} (median over runs)", ""]
    bounds = data.get("bounds", []) + data.get("query_bounds", [])
    if bounds:
        out += ["Bounds the benchmark checks:", ""] + [
            f"- {'PASS' if b['ok'] else 'FAIL'} {b['name']}: {b['detail']}" for b in bounds] + [""]
    return out + context_parallel_lines(data.get("context_parallel"))


def context_parallel_lines(cp: dict | None) -> list[str]:
    """The context-parallel benchmark's figures (its key of results.json), if it has run."""
    head = "### Context parallelism: memory and communication per device"
    if not cp:
        return [head, "", "Not in `benchmarks/results.json`: run `make bench-cp`.", ""]
    shapes = cp.get("shapes", {})
    out = [head, "",
           f"From `benchmarks/results.json` (`context_parallel`), written by `{cp.get('command', '').strip()}` "
           f"(`make bench-cp`), jax {cp.get('environment', {}).get('jax')}, compile-only on "
           f"{cp.get('environment', {}).get('devices')} simulated CPU devices, mesh (1, P, 1); head chunk "
           f"{shapes.get('indexer_head_chunk')}, query chunk {shapes.get('query_chunk')}, window "
           f"{shapes.get('sliding_window')}, {shapes.get('dtype')}, B={shapes.get('batch')}.", ""]
    rows = [[r["seq"], r["p"], r["rows_per_device"], f"{r['memory']['temp'] / GIB:.3f}",
             f"{r['model']['total'] / GIB:.3f}",
             f"{(r['memory']['temp'] + r['memory']['ynn_scratch']) / r['model']['total']:.2f}"]
            for r in cp.get("rows", [])]
    out += ["Temp memory per device (GiB) against the analytic working set:", "",
            *_table(["S", "P", "L=S/P", "temp", "model", "ratio"], rows), ""]
    point = next((r for r in cp.get("rows", []) if [r["seq"], r["p"]] == cp.get("comm_point")), None)
    if point:
        comm = [[name, c["ops"], f"{c['bytes'] / 2**20:.4g}", f"{point['comm_model'][name] / 2**20:.4g}",
                 f"{c['inside_loops'] / 2**20:.4g}"] for name, c in point["comm"].items() if c["ops"]]
        out += [f"MiB one device moves per step at S={point['seq']}, P={point['p']}:", "",
                *_table(["collective", "ops", "MiB", "model MiB", "inside loops"], comm), ""]
    if cp.get("bounds"):
        out += ["Bounds:", ""] + [f"- {'PASS' if b['ok'] else 'FAIL'} {b['name']}: {b['detail']}"
                                  for b in cp["bounds"]] + [""]
    return out


def _selection_args(selection: dict) -> str:
    words = []
    for key in ("cases", "dtypes", "ichunks", "tchunks", "qchunks", "modes", "teachers"):
        if selection.get(key):
            words += [f"--{key}", ",".join(str(x) for x in selection[key])]
    if selection.get("full"):
        words.append("--full")
    elif selection.get("sample", "default") != "default":
        words += ["--sample", selection["sample"]]
    return " ".join(shlex.quote(w) for w in words)


def parity_section(report: Path) -> list[str]:
    from harness.outputs import kind_of

    head = "## A parity run: headroom and time"
    if not report.exists():
        # Keep the section the page has (it names the run it came from): a fresh clone has no
        # reports/, and the other sections are cheap to regenerate there.
        page = OUT.read_text() if OUT.exists() else ""
        if head in page:
            return page[page.index(head):].rstrip("\n").split("\n") + [""]
        return [head, "", f"No report at `{report}`: run `make parity` (or `csa-parity run ...`), then "
                "`make figures`.", ""]
    data = json.loads(report.read_text())
    platform, summary = data.get("platform", {}), data["summary"]
    command = ("csa-parity run " + _selection_args(data.get("selection") or {})).rstrip()
    if data.get("impl", "jax") != "jax":
        command += f" --impl {data['impl']}"
    if data.get("reference", "live") != "live":
        command += f" --reference {data['reference']}"
    if platform.get("matmul_precision", "highest") != "highest":
        command += f" --precision {platform['matmul_precision']}"
    worst: dict[tuple[str, str], dict[str, float]] = {}
    for r in data["results"]:
        if r["status"] not in ("passed", "failed", "excused") or not r["bound"]:
            continue
        ratio = float(r["ratio"]) if not isinstance(r["ratio"], str) else float("inf")
        row = worst.setdefault((r.get("teacher", "joint"), kind_of(r["quantity"])), {})
        row[r["dtype"]] = max(row.get(r["dtype"], 0.0), ratio)
    dtypes = [d for d in DTYPE_ORDER if any(d in row for row in worst.values())]
    rows = [[teacher, kind] + [f"{row[d]:.3g}" if d in row else "-" for d in dtypes]
            for (teacher, kind), row in sorted(worst.items())]
    points = data.get("points", {})
    out = [head, "",
           f"From `{report.relative_to(ROOT) if report.is_relative_to(ROOT) else report}`, written by `{command}` "
           f"(jax {platform.get('jax_version')}, torch {platform.get('torch_version', '-')}, {platform.get('backend')} "
           f"({platform.get('device_kind')}), {platform.get('device_count')} device(s), matmul precision "
           f"{platform.get('matmul_precision')}, reference {data.get('reference')}).", "",
           f"- {summary['entries']} entries, {summary['checks']} checks: "
           + ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in summary["statuses"].items()),
           f"- wall time {data.get('wall_s', 0):.1f} s for {points.get('run')} of {points.get('total')} points "
           f"(sum over points in their workers {points.get('wall_sum_s')} s); time limit {data.get('timeout_s'):g} s "
           "per point",
           "- slowest points: " + "; ".join(f"{label} {wall:.1f} s" for label, wall in points.get("slowest", [])),
           *_split_lines(data),
           *[f"- failed: {r['id']} ({r['check']}) ratio {float(r['ratio']):.3g}"
             for r in data["results"] if r["status"] == "failed"],
           f"- {summary['headroom']['above_half']} checks above ratio 0.5", "",
           "Worst error/bound ratio per teacher, quantity kind and dtype (<= 1 passes; 0.5 in bfloat16 or "
           "float16 is JAX rounding exactly as torch does, since the bound is twice torch's error):", "",
           *_table(["teacher", "kind", *dtypes], rows), ""]
    return out


def _split_lines(data: dict) -> list[str]:
    """The run's time split and what its caches served (reports of schema 6 on)."""
    split, cache = data.get("points", {}).get("time_split_s"), data.get("cache")
    if not split or cache is None:
        return []
    whole = sum(split.values()) or 1.0
    return [f"- time split, summed over the points in their workers: "
            + ", ".join(f"{k} {v:.1f} s ({100 * v / whole:.0f}%)" for k, v in split.items()),
            f"- programs {cache.get('programs_loaded', 0)} loaded from the compilation cache, "
            f"{cache.get('programs_compiled', 0)} compiled; live references {cache.get('references_loaded', 0)} "
            f"loaded, {cache.get('references_computed', 0)} computed; jax_impl outputs of "
            f"{cache.get('outputs_loaded', 0)} points read back"]


def write(report: Path) -> str:
    text = "\n".join([
        "# Figures (generated)", "",
        "Written by `make figures` (= `python scripts/figures.py`); do not edit by hand. Each section "
        "names the command that measured its figures; rerun that command, then `make figures`.", "",
        *matrix_section(), *catalogue_section(), *lines_section(), *bench_section(), *parity_section(report)])
    OUT.write_text(text.rstrip("\n") + "\n")
    return text


JUDGING = ROOT / "docs" / "judging.md"
BOUNDARIES = ROOT / "tests" / "test_tolerance_boundaries.py"


def _boundaries_module():
    """tests/test_tolerance_boundaries.py, which holds the boundary cases of every number and
    writes the table of guarantees from them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tolerance_boundaries", BOUNDARIES)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_guarantees() -> None:
    """Replace docs/judging.md's table of guarantees (every number of harness/judging/tolerance.py, what it
    decides, its boundary test, its mutant) with the one the code gives now."""
    boundaries = _boundaries_module()
    page = JUDGING.read_text()
    current = boundaries.current_guarantees(page)
    if current is None:
        raise SystemExit(f"{JUDGING.relative_to(ROOT)} has no table of guarantees to replace (the block from "
                         f"{boundaries.BEGIN!r} to {boundaries.END!r})")
    JUDGING.write_text(page.replace(current, boundaries.guarantees_table()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, default=ROOT / "reports" / "parity.json",
                   help="the parity.json to take headroom and timings from (default: reports/parity.json)")
    p.add_argument("--run-parity", metavar="ARGS", default=None,
                   help="run `csa-parity run ARGS --out <the report's directory>` first (as long as that run takes)")
    args = p.parse_args(argv)
    report = args.report.resolve()
    if args.run_parity is not None:
        cmd = [sys.executable, "-m", "harness.run.cli", "run", *shlex.split(args.run_parity), "--out", str(report.parent)]
        print("running:", " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc not in (0, 1):  # 1: the run found failures, which the page reports
            return rc
    write(report)
    print(f"wrote {OUT.relative_to(ROOT)}")
    write_guarantees()
    print(f"wrote the table of guarantees in {JUDGING.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

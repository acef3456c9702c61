"""Every failed or errored entry carries the command that reruns just its point (the terminal
FAIL/ERROR lines, parity.md, parity.json's `rerun`, a matrix test's failure message), and that
command, run as printed, reproduces exactly that failure. `csa-parity run --list` sizes a
selection without running it."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness.judging.compare import CheckResult
from harness.points import Entry, Point
from harness.problems.cases import CASES
from harness.problems.matrix import build_matrix
from harness.run.cli import selection_lines
from harness.run.report import (RERUN, attach_reruns, error_lines, failure_lines, failure_text, markdown, record,
                                rerun_command, summarise)

ROOT = Path(__file__).resolve().parent.parent
WRONG = "plugins.wrong_at_one_point:make_impl"


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                          os.environ.get("PYTHONPATH", "")])}


def _argv(command: str) -> list[str]:
    """The printed command as a user runs it: `csa-parity` is the console script installed beside
    this interpreter (else the same entry point through `python -m harness.run.cli`)."""
    words = shlex.split(command)
    assert words[:2] == ["csa-parity", "run"], command
    script = Path(sys.executable).with_name("csa-parity")
    return ([str(script)] if script.exists() else [sys.executable, "-m", "harness.run.cli"]) + words[1:]


def test_the_command_names_the_point_and_every_option_that_changes_its_outcome(monkeypatch):
    small = Point("small", "bfloat16", 2, 0, 0)
    assert rerun_command(small, "sparse") == ("csa-parity run --cases small --dtypes bfloat16 --ichunks 2 --tchunks 0 "
                                              "--qchunks 0 --modes sparse --teachers joint --impl jax")
    ragged = Point("ragged", "float32", 1, 2, 7)
    assert rerun_command(ragged, "dense", "pkg.mod:make", "goldens", "default", 30.0) == (
        "csa-parity run --cases ragged --dtypes float32 --ichunks 1 --tchunks 2 --qchunks 7 --modes dense "
        "--teachers joint --impl pkg.mod:make --reference goldens --precision default --timeout 30")
    assert "--teachers compressed" in rerun_command(Point("tiny", "float64", teacher="compressed"), "dense")
    # a case that held one teacher: --teachers would change nothing
    import harness.problems.cases

    one = dataclasses.replace(CASES["ragged"], teachers=("joint",))
    monkeypatch.setattr(harness.problems.cases, "CASES", {**CASES, "ragged": one})
    assert "--teachers" not in rerun_command(ragged, "dense")
    # fixtures from another directory: --fixtures names them
    assert rerun_command(Point("ragged", "float32"), "dense", fixtures_dir="/tmp/my fx").endswith(
        "--impl jax --fixtures '/tmp/my fx'")
    # a stage plug-in's entries are not selected by --modes; an impl with a space is quoted
    assert rerun_command(Point("tiny", "float32"), "stage", "my kernels:k").endswith("--impl 'my kernels:k'")
    assert "--modes" not in rerun_command(Point("tiny", "float32"), "stage", "k")
    # a sharded point runs under pytest only
    assert rerun_command(Point("small", "float32", 1, 1, mesh=(2, 1, 4)), "dense") == (
        "python -m pytest tests/sharded -n 0 -m sharded -k small-float32-ichunk1-tchunk1-mesh2x1x4-dense")


def _records():
    failed = Entry(Point("tiny", "float32", 2, 0, 0), "forward", "index_scores")
    errored = Entry(Point("ragged", "bfloat16"), "dense", "loss")
    passed = Entry(Point("tiny", "float32"), "forward", "index_scores")
    return [record(failed, CheckResult("oracle", "index_scores", "failed", 0.3, 0.1, mismatched=3, total=64,
                                       context=failed.label)),
            record(errored, CheckResult("oracle", "loss", "error", template="status", context=errored.label,
                                        note="worker killed by signal SIGSEGV at ragged bfloat16 ichunk=0 tchunk=0")),
            record(passed, CheckResult("oracle", "index_scores", "passed", 0.01, 0.1, context=passed.label))]


def test_failed_and_errored_records_carry_it_in_every_report():
    records = attach_reruns(_records(), reference="goldens")
    failed, errored, passed = records
    assert failed["rerun"].startswith("csa-parity run --cases tiny --dtypes float32 --ichunks 2 --tchunks 0")
    assert failed["rerun"].endswith("--modes forward --teachers joint --impl jax --reference goldens")
    assert errored["rerun"].startswith("csa-parity run --cases ragged --dtypes bfloat16 --ichunks 0")
    assert passed["rerun"] is None
    summary = summarise(records)
    (fail_line,) = failure_lines(records)
    (error_line,) = error_lines(summary)
    assert fail_line.endswith(f"\n  {RERUN}{failed['rerun']}") and error_line.endswith(f"\n  {RERUN}{errored['rerun']}")
    md = markdown(records, {}, summary)
    assert f"{RERUN}`{failed['rerun']}`" in md and f"{RERUN}`{errored['rerun']}`" in md
    assert json.loads(json.dumps(summary))["errors_by_point"]["ragged bfloat16 ichunk=0 tchunk=0"]["rerun"] == \
        errored["rerun"]


def test_a_matrix_tests_failure_message_ends_with_the_same_command():
    """tests/test_parity_matrix.py (and the sharded slice) fail with `failure_text`."""
    entry = Entry(Point("tiny", "float32", 2, 0, 0), "forward", "index_scores")
    bad = CheckResult("oracle", "index_scores", "failed", 0.3, 0.1, mismatched=3, total=64, context=entry.label)
    good = CheckResult("chunk", "index_scores", "passed", 0.0, 0.1, context=entry.label)
    text = failure_text(entry, [bad, good], "goldens", "default")
    record_ = attach_reruns([record(entry, bad)], "goldens", "default")[0]
    assert text.splitlines() == [bad.message, RERUN + record_["rerun"]]
    assert record_["rerun"].endswith("--impl jax --reference goldens --precision default")


@pytest.mark.torch  # the live reference
def test_the_printed_command_reproduces_exactly_the_planted_failure(tmp_path):
    """A plug-in wrong at indexer chunk 2 only: of three points, one fails. Its FAIL line's
    command, run as printed, runs that point alone and fails exactly the same checks."""
    sweep = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", "--cases", "tiny", "--dtypes", "float32",
                            "--ichunks", "0,1,2", "--tchunks", "0", "--qchunks", "0", "--modes", "forward",
                            "--impl", WRONG, "--out", str(tmp_path / "sweep"), "--no-progress", "--jobs", "1"],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 1, sweep.stdout + sweep.stderr
    report = json.loads((tmp_path / "sweep" / "parity.json").read_text())
    failed = {(r["id"], r["check"]) for r in report["results"] if r["status"] == "failed"}
    assert failed and {r["ichunk"] for r in report["results"] if r["status"] == "failed"} == {2}
    assert {r["ichunk"] for r in report["results"]} == {0, 1, 2}
    reruns = [line.strip()[len(RERUN):] for line in sweep.stdout.splitlines() if line.strip().startswith(RERUN)]
    expected = (f"csa-parity run --cases tiny --dtypes float32 --ichunks 2 --tchunks 0 --qchunks 0 --modes forward "
                f"--teachers joint --impl {WRONG}")
    assert set(reruns) == {expected}, sweep.stdout
    assert {r["rerun"] for r in report["results"] if r["status"] == "failed"} == {expected}
    md = (tmp_path / "sweep" / "parity.md").read_text()
    assert f"{RERUN}`{expected}`" in md

    again = tmp_path / "again"
    again.mkdir()
    proc = subprocess.run(_argv(reruns[0]), cwd=again, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rerun = json.loads((again / "reports" / "parity.json").read_text())
    assert {(r["case"], r["dtype"], r["ichunk"], r["tchunk"], r["qchunk"]) for r in rerun["results"]} == \
        {("tiny", "float32", 2, 0, 0)}
    assert {(r["id"], r["check"]) for r in rerun["results"] if r["status"] == "failed"} == failed
    assert f"{RERUN}{expected}" in proc.stdout


def test_list_prints_the_selection_and_runs_nothing(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", "--list", "--cases", "tiny,small",
                           "--dtypes", "float32,bfloat16", "--out", str(out)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = build_matrix(["tiny", "small"], ["float32", "bfloat16"])
    points = {e.point for e in entries}
    assert proc.stdout.splitlines()[0] == f"sample default: 2 cases, 2 dtypes, {len(points)} points, {len(entries)} entries"
    assert "cases: tiny, small" in proc.stdout and "dtypes: float32, bfloat16" in proc.stdout
    assert f"compiled programs: {len(points)} ({len(points)} points, one program each)" in proc.stdout
    assert "  small  float32   i0/t0 i0/t0/q16" in proc.stdout
    assert not out.exists(), "--list must write nothing"


def test_list_counts_the_native_points_chunk_checks_need():
    """A selection of chunked points alone still compiles their native points."""
    entries = build_matrix(["small"], ["float32"], ichunks=[2], tchunks=[0], qchunks=[0], teachers=["joint"])
    lines = selection_lines(entries, "default")
    assert lines[-1] == "compiled programs: 2 (1 points, one program each, + 1 native points the chunk checks " \
                        "compare with); nothing was run"


def test_list_counts_two_programs_at_a_point_of_a_quantized_case():
    """One on the float64 oracle's codes, one on the implementation's own (harness.problems.matrix.programs_at)."""
    entries = build_matrix(["quant_planted"], ["float32"], ichunks=[0], tchunks=[0], qchunks=[0], teachers=["joint"])
    assert selection_lines(entries, "default")[-1] == (
        "compiled programs: 2 (1 points, one program each, two on the 1 points of quantized cases (their own codes "
        "and the oracle's)); nothing was run")


def test_the_list_example_in_the_docs_is_what_list_prints():
    """docs/running.md shows `--list` for one selection; it must be the current output."""
    import re

    doc = (ROOT / "docs" / "running.md").read_text()
    block = re.search(r"```\n\$ csa-parity run --list --cases tiny --dtypes float32\n(.*?)```", doc, re.S).group(1)
    assert block.splitlines() == selection_lines(build_matrix(["tiny"], ["float32"]), "default")

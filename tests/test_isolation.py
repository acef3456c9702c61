"""Crash isolation (harness/sides/worker.py): a kernel that aborts, segfaults, exits, is killed for
memory, runs out of a memory limit, hangs, raises only in its backward or returns a ragged list
never takes the run down. Its point's own quantities are `error` with one line, the other
points run, the reports are complete, the exit code is 1; an interrupted or killed CLI leaves
reports that say they are partial. The plug-ins are tests/plugins/misbehaving.py: each
misbehaves on `small` only and computes the scores correctly on `tiny`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from harness.points import Entry, Point
from harness.run import report as report_module
from harness.run.collect import evaluate
from harness.run.tasks import error_records
from harness.sides import worker as worker_module
from harness.sides.worker import run_points

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torch
STAGE_QUANTITIES = ("stage.scores", "stage_grad.scores.q", "stage_grad.scores.keys", "stage_grad.scores.head_weights")
SMALL, TINY = "small float32 ichunk=0 tchunk=0", "tiny float32 ichunk=0 tchunk=0"


def _env(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **extra}


def _command(out, plugin, *args):
    return [sys.executable, "-m", "harness.run.cli", "run", "--impl", f"plugins.misbehaving:{plugin}", "--out", str(out),
            "--no-progress", "--jobs", "1", "--teachers", "joint", *args]


def _cli(tmp_path, plugin, *args):
    out = tmp_path / "rep"
    proc = subprocess.run(_command(out, plugin, *args), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    return proc, json.loads((out / "parity.json").read_text()), out


# plug-in -> (extra arguments, the one error line at small float32)
MISBEHAVIOURS = {
    "abort": ((), f"worker killed by signal SIGABRT at {SMALL}, in plugins.misbehaving:abort scores()"),
    "segfault": ((), f"worker killed by signal SIGSEGV at {SMALL}, in plugins.misbehaving:segfault scores()"),
    "hard_exit": ((), f"worker exited with code 3 at {SMALL}, in plugins.misbehaving:hard_exit scores()"),
    "oom_kill": ((), re.compile(r"worker killed by signal SIGKILL \(peak \d+\.\d\d GiB; the kernel's OOM killer sends "
                                rf"it when memory runs out\) at {SMALL}, in plugins\.misbehaving:oom_kill scores\(\)")),
    "exceed_memory": ((), f"plug-in plugins.misbehaving:exceed_memory raised in scores() at {SMALL}: "
                          "MemoryError: Unable to allocate 16.0 GiB"),
    "hang": (("--timeout", "20"), f"timed out after 20 s at {SMALL}, in plugins.misbehaving:hang scores()"),
    "ragged": ((), f"plug-in plugins.misbehaving:ragged raised in scores() at {SMALL}: ValueError: setting an "
                   "array element with a sequence"),
}


@pytest.mark.parametrize("plugin", list(MISBEHAVIOURS))
def test_a_misbehaving_kernel_is_one_error_line_and_every_other_point_runs(plugin, tmp_path):
    extra, line = MISBEHAVIOURS[plugin]
    line = line if isinstance(line, re.Pattern) else re.compile(re.escape(line))  # the SIGKILL line holds a peak
    proc, report, out = _cli(tmp_path, plugin, "--cases", "tiny,small", "--dtypes", "float32", *extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    recs = report["results"]
    small_stage = [r for r in recs if r["case"] == "small" and r["mode"] == "stage"]
    assert sorted(r["quantity"] for r in small_stage) == sorted(STAGE_QUANTITIES)
    for r in small_stage:  # the stage's own quantities: error, one line naming what, where and in which call
        assert r["status"] == "error" and line.match(r["note"]), r["note"]
        assert "\n" not in r["note"]
    # the pipeline quantities a stage plug-in never provides stay not provided, at the crashed point too
    pipeline = [r for r in recs if r["mode"] != "stage"]
    assert pipeline and all(r["status"] == "not_provided" for r in pipeline), {r["status"] for r in pipeline}
    # the other point ran, in a fresh worker, and passed
    tiny_stage = [r for r in recs if r["case"] == "tiny" and r["mode"] == "stage"]
    assert len(tiny_stage) == 4 and all(r["status"] == "passed" for r in tiny_stage), tiny_stage
    # complete reports: every point ran, not partial, one error line for the crash
    assert report["partial"] is None and report["points"] == {**report["points"], "total": 2, "run": 2}
    summary = report["summary"]
    assert summary["errors"] == 4 and list(summary["errors_by_point"]) == [SMALL]
    assert summary["errors_by_point"][SMALL]["checks"] == 4
    assert summary["errors_by_quantity"] == {q: 1 for q in STAGE_QUANTITIES}
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR ")]
    assert len(errors) == 1 and line.search(errors[0]), proc.stdout
    md = (out / "parity.md").read_text()
    assert md.startswith("# csa-parity report: FAIL") and line.search(md)
    assert (out / "parity_heatmap.png").stat().st_size > 0
    assert not [p for p in os.listdir(out) if p.startswith(".")], "a temporary report file was left behind"


def test_a_backward_that_raises_keeps_the_forward_verdict(tmp_path):
    """The MaxText-like kernel: correct scores, a backward that raises at float64. The float64
    point's stage.scores is judged (passed); only its three gradients are error."""
    proc, report, _ = _cli(tmp_path, "backward_raises", "--cases", "tiny", "--dtypes", "float32,float64")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = {(r["dtype"], r["quantity"]): r for r in report["results"] if r["mode"] == "stage"}
    assert status[("float64", "stage.scores")]["status"] == "passed"
    assert status[("float64", "stage.scores")]["check"] == "exact64"
    line = ("plug-in plugins.misbehaving:backward_raises raised in the backward of scores() (jax.vjp) at tiny "
            "float64 ichunk=0 tchunk=0: NotImplementedError: no float64 backward in this kernel")
    for q in STAGE_QUANTITIES[1:]:
        assert status[("float64", q)]["status"] == "error" and status[("float64", q)]["note"] == line
    assert all(status[("float32", q)]["status"] == "passed" for q in STAGE_QUANTITIES)
    assert list(report["summary"]["errors_by_point"]) == ["tiny float64 ichunk=0 tchunk=0"]
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR ")] == [
        f"ERROR {line} (3 checks: stage_grad.scores.head_weights, stage_grad.scores.keys, stage_grad.scores.q)"]


# --------------------------------------------------------------------------- interrupted runs


def _sigint_as_a_terminal_sends_it():
    # A background job of a non-interactive shell (make test's side process is one) starts
    # with SIGINT ignored, and its children inherit that: the CLI would never see the Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_hanging(tmp_path):
    marker = tmp_path / "hanging"
    out = tmp_path / "rep"
    proc = subprocess.Popen(_command(out, "hang", "--cases", "tiny,small", "--dtypes", "float32"), cwd=ROOT,
                            env=_env(CSA_TEST_HANG_MARKER=str(marker)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_a_terminal_sends_it)
    deadline = time.monotonic() + 300
    while not marker.exists():  # tiny has run; small hangs in its worker
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc, out


@pytest.mark.parametrize("sig, code, reason", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                               (signal.SIGTERM, 143, "interrupted (SIGTERM)")])
def test_an_interrupted_run_writes_reports_that_say_they_are_partial(sig, code, reason, tmp_path):
    proc, out = _start_hanging(tmp_path)
    proc.send_signal(sig)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a CLI that ignored the signal must not outlive the test
    assert proc.returncode == code, stdout + stderr
    assert f"csa-parity: {reason} after 1 of 2 points" in stderr
    report = json.loads((out / "parity.json").read_text())
    assert report["partial"] == {"reason": reason, "points_run": 1, "points_total": 2}
    assert {r["case"] for r in report["results"]} == {"tiny"}
    assert (out / "parity.md").read_text().startswith(
        f"# csa-parity report: PARTIAL, {reason}: 1 of 2 points ran; so far PASS")


def test_a_killed_cli_leaves_a_whole_report_that_says_it_is_partial(tmp_path):
    proc, out = _start_hanging(tmp_path)
    proc.kill()  # SIGKILL: nothing runs in the CLI after this
    proc.communicate(timeout=60)
    report = json.loads((out / "parity.json").read_text())  # whole JSON, never a truncated file
    assert report["partial"]["reason"] == "running, or killed before it ended"
    assert report["partial"]["points_total"] == 2 and report["partial"]["points_run"] <= 1
    assert (out / "parity.md").read_text().startswith("# csa-parity report: PARTIAL")


def test_reports_are_replaced_atomically(tmp_path, monkeypatch):
    """A write that fails half way leaves the previous parity.json whole and no temporary file."""
    meta = {"impl": "jax", "partial": None}
    report_module.write_reports([], meta, str(tmp_path), heatmap_too=False)
    before = (tmp_path / "parity.json").read_text()

    def broken_dump(obj, f, **kw):
        f.write('{"schema_version": 4, "trunc')
        raise OSError("disk full")

    monkeypatch.setattr(report_module.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        report_module.write_reports([], {**meta, "impl": "other"}, str(tmp_path), heatmap_too=False)
    assert (tmp_path / "parity.json").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["parity.json", "parity.md"]


# --------------------------------------------------------------------------- a plug-in through pytest


def test_under_pytest_a_crashing_plugin_is_an_error_and_this_process_lives_on():
    """`evaluate` outside the CLI runs a plug-in in a worker of this process: its abort is the
    point's error, the next point runs in a fresh worker."""
    [crashed] = evaluate(Entry(Point("small", "float32"), "stage", "stage.scores", "plugins.misbehaving:abort"))
    assert crashed.status == "error" and crashed.failed
    assert crashed.note == f"worker killed by signal SIGABRT at {SMALL}, in plugins.misbehaving:abort scores()"
    [fine] = evaluate(Entry(Point("tiny", "float32"), "stage", "stage.scores", "plugins.misbehaving:abort"))
    assert fine.status == "passed", fine.message
    # a stage plug-in's pipeline quantity at the crashed point: not provided, not error
    [pipeline] = evaluate(Entry(Point("small", "float32"), "forward", "index_scores", "plugins.misbehaving:abort"))
    assert pipeline.status == "not_provided", pipeline.message


def test_under_pytest_a_hanging_plugin_times_out(monkeypatch):
    monkeypatch.setenv("CSA_PARITY_TIMEOUT", "15")
    start = time.monotonic()
    [hung] = evaluate(Entry(Point("small", "float32"), "stage", "stage_grad.scores.q", "plugins.misbehaving:hang"))
    assert hung.status == "error"
    assert hung.note == f"timed out after 15 s at {SMALL}, in plugins.misbehaving:hang scores()"
    assert time.monotonic() - start < 120


def test_under_pytest_a_backward_that_raises_keeps_the_forward_verdict():
    point = Point("tiny", "float64")
    [forward] = evaluate(Entry(point, "stage", "stage.scores", "plugins.misbehaving:backward_raises"))
    [backward] = evaluate(Entry(point, "stage", "stage_grad.scores.keys", "plugins.misbehaving:backward_raises"))
    assert forward.status == "passed", forward.message
    assert backward.status == "error" and "raised in the backward of scores() (jax.vjp)" in backward.note


def test_a_bad_timeout_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", "--cases", "tiny", "--timeout", "0",
                           "--out", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "csa-parity: error: --timeout=0 must be a number of seconds > 0"


def test_a_worker_that_cannot_start_is_one_clear_error_not_a_wait():
    """A worker that dies before it is ready (here: a matmul precision JAX refuses) closes its
    pipe; the parent stops waiting at once and says so in one line."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a csa-parity worker could not start \(worker exited with code 1\)"):
        run_points([[(Point("tiny", "float32"), [])]], "live", "highest",
                   {"precision": "no-such-precision", "fixtures_dir": None, "sys_path": list(sys.path)}, 1, 60.0,
                   lambda *a: None, error_records)
    assert time.monotonic() - start < 60


# --------------------------------------------------------------------------- memory


def test_a_worker_over_the_memory_limit_is_an_error_with_its_peak_and_the_run_goes_on():
    """run_points with a 1 GiB limit: the worker of the first point grows 64 MiB at a time
    (tests/plugins/misbehaving.py:grow_task) and is killed past 1 GiB; that point's records are
    the error line with its peak, and the next point runs in a fresh worker and keeps its own."""
    done = {}
    init = {"precision": "highest", "fixtures_dir": None, "sys_path": [str(ROOT / "tests"), *sys.path],
            "task": "plugins.misbehaving:grow_task"}
    big, fine = Point("small", "float32"), Point("tiny", "float32")
    run_points([[(big, ["grow"]), (fine, ["kept"])]], "live", "highest", init, 1, 120.0,
               lambda point, entries, records, wall, split: done.update({point: (records, split)}),
               lambda entries, line: [line], max_memory=2**30)
    [line], split = done[big]
    match = re.fullmatch(rf"out of memory: peak (\d+\.\d\d) GiB \(limit 1\.00 GiB\) at {big.label} "
                         r"\(outside any implementation call\)", line)
    assert match and float(match[1]) >= 1.0, line
    assert split["peak_rss_bytes"] > 2**30 and split["compiled_temp_bytes"] is None
    records, split = done[fine]
    assert records == ["kept"] and 0 < split["peak_rss_bytes"] < 2**30


def test_a_kill_by_the_oom_killer_says_so_with_the_peak(monkeypatch):
    """A worker dead of SIGKILL while the memory cgroup's oom_kill counter rose: out of memory, by
    the kernel; without the counter rising (or readable): the signal, with the peak beside it."""
    w = worker_module._Worker.__new__(worker_module._Worker)
    w.proc = types.SimpleNamespace(exitcode=-signal.SIGKILL)
    w.peak, w.over, w.oom_base = 3 * 2**29, None, 4
    monkeypatch.setattr(worker_module, "oom_kills", lambda: 5)
    assert w.death() == "out of memory: killed by the kernel's OOM killer, peak 1.50 GiB"
    monkeypatch.setattr(worker_module, "oom_kills", lambda: 4)
    assert w.death() == ("worker killed by signal SIGKILL (peak 1.50 GiB; the kernel's OOM killer sends it when "
                         "memory runs out)")
    w.over = 2**30
    assert w.death() == "out of memory: peak 1.50 GiB (limit 1.00 GiB)"
    w.over, w.proc = None, types.SimpleNamespace(exitcode=-signal.SIGSEGV)
    assert w.death() == "worker killed by signal SIGSEGV"


@pytest.mark.parametrize("text, size", [("8GiB", 8 * 2**30), ("512MiB", 2**29), ("1.5G", 3 * 2**29), ("64k", 2**16),
                                        ("100", 100), ("2TB", 2**41)])
def test_memory_sizes(text, size):
    assert worker_module.parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "0", "-1G", "8 GiB x", "GiB", "1.5Q", "nan"])
def test_a_bad_max_memory_is_one_line_exit_2(text, capsys):
    from harness.run import cli

    assert cli.main(["run", "--cases", "tiny", f"--max-memory={text}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"csa-parity: error: --max-memory={text!r} must be a size > 0: a number of bytes or one with a unit "
        "(K, M, G, T, as KiB, MiB, GiB, TiB), e.g. 8GiB")


def test_the_reports_name_the_largest_peak_and_temp():
    by_point = {"a": {"peak_rss_bytes": 3 * 2**29, "compiled_temp_bytes": None},
                "b": {"peak_rss_bytes": 2**29, "compiled_temp_bytes": 5 * 2**20}, "c": {"run": 1.0}}
    memory = report_module.memory_summary(by_point)
    assert memory == {"peak_rss_bytes": 3 * 2**29, "peak_rss_at": "a", "compiled_temp_bytes": 5 * 2**20,
                      "compiled_temp_at": "b"}
    meta = {"points": {"by_point": by_point, "memory": memory}, "max_memory_bytes": 2**31}
    assert report_module.memory_line(meta) == ("memory: peak worker RSS 1.50 GiB (a); largest compiled temp "
                                               "5.0 MiB (b); limit 2.00 GiB a worker (--max-memory)")
    assert report_module.memory_table(meta)[-2:] == ["| a | 1.50 GiB | - |", "| b | 512.0 MiB | 5.0 MiB |"]
    assert report_module.memory_table({"points": {"by_point": {"c": {"run": 1.0}}}}) == []

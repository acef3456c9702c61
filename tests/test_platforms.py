"""Platform capabilities as data: harness/platforms.py, the `not applicable` status
in collect, judge and reports, and the per-backend `default` tolerance profile. No torch needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import platforms
from harness.judging import tolerance
from harness.judging.compare import CheckResult, status_result
from harness.outputs import NOT_APPLICABLE, PASSED
from harness.points import DTYPES
from harness.problems.matrix import build_matrix
from harness.run import collect, report
from harness.sides import implementations

ROOT = Path(__file__).resolve().parent.parent


def test_every_backend_has_a_row_and_tpu_has_no_ieee_float64():
    assert set(platforms.PLATFORMS) == set(platforms.BACKENDS) == {"cpu", "gpu", "tpu"}
    assert platforms.PLATFORMS["cpu"].float64 is None and platforms.PLATFORMS["gpu"].float64 is None
    assert "float64" in platforms.PLATFORMS["tpu"].float64
    for p in platforms.PLATFORMS.values():
        assert set(p.matmul) == set(tolerance.PROFILES)
        assert p.matmul["highest"][0] == 23  # highest is true float32 everywhere
    assert platforms.float32_operand_bits("tpu", "default") == 7  # one bfloat16 pass
    assert platforms.float32_operand_bits("gpu", "default") == 10  # TF32
    assert platforms.float32_operand_bits("cpu", "default") == 23  # XLA:CPU ignores it


def test_not_applicable_is_a_pure_function_of_its_arguments():
    for kind in platforms.KINDS:
        for dtype in DTYPES:
            for backend in ("cpu", "gpu"):
                assert platforms.not_applicable(dtype, kind, backend) is None
            reason = platforms.not_applicable(dtype, kind, "tpu")
            assert (reason is not None) == (dtype == "float64")
            assert platforms.not_applicable(dtype, kind, "tpu") == reason
    with pytest.raises(ValueError, match=r"^backend='ipu' is not known \(valid: cpu, gpu, tpu\)$"):
        platforms.not_applicable("float32", "grad", "ipu")
    with pytest.raises(ValueError, match=r"^kind='speed' is not known"):
        platforms.not_applicable("float32", "speed", "cpu")


def test_on_tpu_exactly_the_float64_points_are_not_applicable(monkeypatch):
    """The selection with the backend reported as tpu: every float64 entry of the default
    matrix, and nothing else, comes back `not_applicable` with the reason, without running
    anything (the implementations would fail if asked)."""
    monkeypatch.setattr(platforms, "current_backend", lambda: "tpu")

    def no_run(*args, **kwargs):
        raise AssertionError("a not-applicable point must not run")

    monkeypatch.setattr(collect, "outputs", no_run)
    monkeypatch.setattr(implementations, "outputs", no_run)
    entries = build_matrix()
    expected = {e.id for e in entries if e.point.dtype == "float64"}
    chosen = platforms.selection(entries, platforms.current_backend())
    assert list(chosen) == [platforms.not_applicable_label("tpu", platforms.PLATFORMS["tpu"].float64)]
    assert {e.id for es in chosen.values() for e in es} == expected
    assert len(expected) == sum(1 for e in entries if e.point.dtype == "float64") > 0
    for e in entries:
        if e.point.dtype != "float64":
            continue
        (r,) = collect.evaluate(e, "goldens")
        assert r.status == NOT_APPLICABLE and not r.passed and not r.failed
        assert r.message.endswith("not applicable on tpu: " + platforms.PLATFORMS["tpu"].float64)
    # A float32 point is not excused: it reaches the implementations.
    f32 = next(e for e in entries if e.point.dtype == "float32")
    with pytest.raises(AssertionError, match="must not run"):
        collect.evaluate(f32, "goldens")


def test_reports_count_and_list_not_applicable_apart_from_passed_and_failed(tmp_path):
    entries = [e for e in build_matrix(cases=["tiny"], dtypes=["float64", "float32"], ichunks=[0],
                                       modes=["dense"], teachers=["joint"])
               if e.quantity in ("loss", "grad.indexer.wq_b")]
    label = "not applicable on tpu: no float64"
    records = []
    for e in entries:
        if e.point.dtype == "float64":
            r = status_result("oracle", e.quantity, NOT_APPLICABLE, label)
        else:
            r = CheckResult("oracle", e.quantity, PASSED, 0.6, 1.0)
        records.append(report.record(e, r))
    summary = report.summarise(records)
    assert summary["failed"] == 0 and summary["not_applicable"] == 2
    assert summary["statuses"] == {"passed": 2, "failed": 0, "excused": 0, "not_provided": 0, "not_applicable": 2,
                                   "error": 0}
    assert summary["not_applicable_reasons"] == {label: 2}
    assert "float64" not in summary["worst_ratio_by_dtype"]
    assert summary["headroom"]["above_half"] == 2
    assert summary["headroom"]["worst_ratio"] == {"loss": {"float32": 0.6}, "grad": {"float32": 0.6}}
    header, rows = report.table(records)
    assert ["tiny", "float64", "-", "-", "-", "-", "n/a", "n/a", "-"] in rows
    paths = report.write_reports(records, {"impl": "jax", "platform": {"backend": "tpu"}}, str(tmp_path))
    md = Path(paths["md"]).read_text()
    assert "2 checks not applicable on tpu: no float64" in md and "## Headroom" in md


def test_default_profile_floor_is_per_backend():
    u = 2.0**-24
    for q in ("index_scores", "grad.indexer.wq_b"):
        assert tolerance.floor("float32", q, "default", "tpu") == 2.0**-9  # bfloat16 operands
        assert tolerance.floor("float32", q, "default", "gpu") == 2.0**-12  # TF32 operands
        assert tolerance.floor("float32", q, "default", "cpu") == tolerance.floor("float32", q) == u
    assert tolerance.floor("float32", "loss", "default", "tpu") == tolerance.FLOOR["float32"]["loss"]
    assert tolerance.floor("bfloat16", "grad.x", "default", "gpu") == tolerance.FLOOR["bfloat16"]["grad"]


def test_reduction_floors_grow_as_sqrt_n_unit_roundoffs():
    u = 2.0**-24
    tiny = {"B": 1, "S": 16, "W": 4, "HI": 2, "DI": 8, "R": 16, "E": 16, "m": 4}
    small = {"B": 2, "S": 64, "W": 16, "HI": 8, "DI": 32, "R": 32, "E": 64, "m": 4}
    assert collect.dims("tiny") == tiny and collect.dims("small") == small
    assert tolerance.floor("float32", "grad.indexer.wkv", dims=tiny) == 8 * u  # sqrt(1*16*4)
    assert tolerance.floor("float32", "grad.indexer.wkv", dims=small) == pytest.approx(2048**0.5 * u)
    assert tolerance.floor("float32", "index_scores", dims=tiny) == pytest.approx(48**0.5 * u)  # 2*8 + 16 + 16
    assert tolerance.floor("float32", "compressed_keys", dims=small) == pytest.approx(104**0.5 * u)  # 64 + 8 + 32
    assert tolerance.floor("float32", "loss", dims=small) == tolerance.FLOOR["float32"]["loss"]
    # bfloat16's own floor is larger than any of these: unchanged
    assert tolerance.floor("bfloat16", "grad.indexer.wkv", dims=small) == tolerance.FLOOR["bfloat16"]["grad"]


def test_platforms_command_prints_the_table_and_the_tpu_selection():
    out = subprocess.run([sys.executable, "-m", "harness.run.platform_table", "--backend", "tpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tpu      no       yes" in out.stdout
    n = sum(1 for e in build_matrix() if e.point.dtype == "float64")
    assert f"tpu: {n} of {len(build_matrix())} default matrix entries not applicable" in out.stdout


def test_the_default_worker_count_is_the_cpus_this_process_may_use(monkeypatch):
    """`csa-parity run --jobs` defaults to the CPUs in this process's affinity (taskset, a
    container's CPU set), not the machine's count: under `taskset -c 1` one worker, not one per
    core fighting for that CPU."""
    import os

    from harness.run.cli import build_parser

    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert platforms.usable_cpus() == 1
    assert build_parser().parse_args(["run"]).jobs == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # a platform without it (macOS)
    assert platforms.usable_cpus() == 6
    assert build_parser().parse_args(["run"]).jobs == 6

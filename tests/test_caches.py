"""The persistent caches of `csa-parity run`: a rerun loads its programs and its live references
instead of compiling and computing them, judges exactly as the first run did, and a changed
program or reference source is never served a stale entry. And the time split that says what
they save adds up."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

from harness.points import Point
from harness.sides import implementations, reference_cache, timing

REPO = Path(__file__).resolve().parent.parent

# One point of tiny in float32 against the goldens (no torch: the subprocesses start quickly).
ONE_POINT = ["--cases", "tiny", "--dtypes", "float32", "--ichunks", "0", "--tchunks", "0", "--qchunks", "0",
             "--teachers", "joint", "--reference", "goldens", "--no-progress", "--jobs", "1"]


def _run(args, cwd: Path, pythonpath: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = Path(args[args.index("--out") + 1])
    return {"report": json.loads((out / "parity.json").read_text()), "stdout": proc.stdout}


def test_a_rerun_loads_every_program_and_a_changed_jax_impl_compiles_again(tmp_path):
    """jax_impl copied as the plug-in `jax_copy`: the first run compiles into an empty cache, the
    second loads every program and writes the same results; after an edit that changes the
    program but no value (the pooling weights times 1.0), the changed program is compiled, not
    served from the cache, and the results are still the same."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "jax_impl", src / "jax_copy", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"

    def run(name):
        return _run([*ONE_POINT, "--impl", "jax_copy", "--cache-dir", str(cache), "--out", str(tmp_path / name)],
                    tmp_path, src)

    first = run("first")
    cached = first["report"]["cache"]
    assert cached["dir"] == str(cache) and cached["programs_loaded"] == 0 and cached["programs_compiled"] > 0
    assert f"0 loaded from the compilation cache, {cached['programs_compiled']} compiled" in first["stdout"]

    second = run("second")
    assert second["report"]["cache"] == {**cached, "programs_loaded": cached["programs_compiled"],
                                         "programs_compiled": 0}
    assert second["report"]["results"] == first["report"]["results"]
    split = second["report"]["points"]["by_point"]["tiny float32 ichunk=0 tchunk=0"]
    assert set(timing.SHARES) <= set(split) and split["programs_compiled"] == 0

    pooling = src / "jax_copy" / "pooling.py"
    text = pooling.read_text()
    line = "weights = jax.nn.softmax(slots_gate, axis=2)\n"
    assert text.count(line) == 1, "the edit's anchor moved: pick another line of the pooling"
    pooling.write_text(text.replace(line, line.replace("\n", " * 1.0\n")))
    third = run("third")
    assert third["report"]["cache"]["programs_compiled"] >= 1
    assert third["report"]["results"] == first["report"]["results"]


def test_a_rerun_of_an_unchanged_jax_impl_loads_its_outputs_and_a_changed_key_computes_them(tmp_path, monkeypatch):
    """The built-in `jax`: the second run of a point reads its outputs back (no program traced,
    compiled or run) and judges identically; in-process, the same outputs are served bit for bit,
    and a changed source, point or XLA flag is another key, computed again."""
    cache = tmp_path / "cache"

    def run(name):
        return _run([*ONE_POINT, "--impl", "jax", "--cache-dir", str(cache), "--out", str(tmp_path / name)],
                    tmp_path, REPO)

    first, second = run("first"), run("second")
    assert first["report"]["cache"]["outputs_loaded"] == 0 and first["report"]["cache"]["programs_compiled"] > 0
    assert second["report"]["cache"]["outputs_loaded"] == 1
    assert second["report"]["cache"]["programs_compiled"] == second["report"]["cache"]["programs_loaded"] == 0
    assert "jax_impl outputs of 1 points loaded" in second["stdout"]
    assert second["report"]["results"] == first["report"]["results"]

    implementations.clear_caches()
    reference_cache.use(str(tmp_path / "inproc"))
    try:
        point = Point("tiny", "float32")
        fresh = implementations._cached_jax("tiny", point, None)
        before = timing.snapshot()
        served = implementations._cached_jax("tiny", point, None)
        assert timing.split(before, timing.snapshot())["outputs_loaded"] == 1
        assert served.values.keys() == fresh.values.keys() and len(fresh.values) > 10
        for name, value in fresh.values.items():
            assert served.values[name].dtype == value.dtype and np.array_equal(served.values[name], value), name
        path = implementations.fixture("tiny").path
        base = reference_cache.jax_key_parts(path, point.spec())
        assert base["sources_sha256"] == reference_cache.jax_impl_sha() and base["point"] == "tiny:float32:0:0"
        assert reference_cache.jax_key_parts(path, Point("tiny", "float32", ichunk=1).spec()) != base
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
        assert reference_cache.jax_key_parts(path, point.spec())["env"] != base["env"]
        monkeypatch.delenv("XLA_FLAGS")
        monkeypatch.setattr(reference_cache, "jax_impl_sha", lambda: "jax_impl edited")
        before = timing.snapshot()
        implementations._cached_jax("tiny", point, None)
        assert timing.split(before, timing.snapshot())["outputs_loaded"] == 0
    finally:
        reference_cache.use(None)
        implementations.clear_caches()


@pytest.mark.torch  # the live reference
def test_the_reference_cache_serves_identical_outputs_and_misses_when_a_source_changes(tmp_path, monkeypatch):
    """torch_ref's outputs for tiny in float32, stored on the first call and served on the
    second bit for bit (dtypes included) from a copy of the fixture elsewhere (the key is the
    fixture's bytes, not its path); once the reference's sources differ they are computed again.
    The key names the fixture's sha256 and the installed torch."""
    def fixtures_copy(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in ("tiny.safetensors", "MANIFEST.json"):
            shutil.copy(REPO / "fixtures" / f, d / f)
        return d

    point = Point("tiny", "float32")
    reference_cache.use(str(tmp_path / "cache"))
    try:
        before = timing.snapshot()
        monkeypatch.setenv("CSA_PARITY_FIXTURES", str(fixtures_copy("a")))
        fresh = implementations.outputs("torch_ref", "tiny", point)
        monkeypatch.setenv("CSA_PARITY_FIXTURES", str(fixtures_copy("b")))
        served = implementations.outputs("torch_ref", "tiny", point)
        counts = timing.split(before, timing.snapshot())
        assert (counts["references_computed"], counts["references_loaded"]) == (1, 1)
        assert served.source == fresh.source and dict(served.missing) == dict(fresh.missing)
        assert served.values.keys() == fresh.values.keys() and len(fresh.values) > 10
        for name, value in fresh.values.items():
            assert served.values[name].dtype == value.dtype and np.array_equal(served.values[name], value), name

        monkeypatch.setattr(reference_cache, "sources_sha", lambda: "torch_ref edited")
        monkeypatch.setenv("CSA_PARITY_FIXTURES", str(fixtures_copy("c")))
        implementations.outputs("torch_ref", "tiny", point)
        assert timing.split(before, timing.snapshot())["references_computed"] == 2

        path = implementations.fixture("tiny").path
        parts = reference_cache.key_parts(path, "float32", "joint", ("dense",))
        assert parts["fixture_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert parts["torch"] == version("torch") and parts["sources_sha256"] == "torch_ref edited"
    finally:
        reference_cache.use(None)


@pytest.mark.torch  # the live reference
def test_a_stage_plugins_reference_values_are_served_from_the_cache_and_missed_when_a_source_changes(
        tmp_path, monkeypatch):
    """The values a stage plug-in is judged on (the scoring stage's inputs, output and gradients;
    the quantizer stage's rotated inputs, codes and scales), which every worker of a stage
    plug-in's run reads: stored on the first call, served on the next bit for bit (a fresh
    process's view: the in-process caches cleared), computed again once the reference's sources
    differ, under a key of their own per stage and dtype."""
    reference_cache.use(str(tmp_path / "cache"))
    implementations.clear_caches()
    try:
        for stage, read, case in (("scores", implementations.reference_stage_values, "tiny"),
                                  ("quantizer", implementations.reference_quantizer_values, "quant_planted")):
            problem = implementations.fixture(case)
            before = timing.snapshot()
            fresh = read(problem, "float32")
            implementations.clear_caches()
            served = read(problem, "float32")
            counts = timing.split(before, timing.snapshot())
            assert (counts["references_computed"], counts["references_loaded"]) == (1, 1), stage
            assert served.keys() == fresh.keys() and len(fresh) >= 6, stage
            for name, value in fresh.items():
                assert served[name].dtype == value.dtype and np.array_equal(served[name], value), (stage, name)
            parts = reference_cache.stage_key_parts(problem.path, "float32", stage)
            assert parts["reference_stage"] == stage and "teacher" not in parts
            assert reference_cache.key(parts) != reference_cache.key(
                reference_cache.stage_key_parts(problem.path, "float64", stage))
        assert reference_cache.key(reference_cache.stage_key_parts(problem.path, "float32", "scores")) != \
            reference_cache.key(reference_cache.stage_key_parts(problem.path, "float32", "quantizer"))
        monkeypatch.setattr(reference_cache, "sources_sha", lambda: "torch_ref edited")
        implementations.clear_caches()
        before = timing.snapshot()
        implementations.reference_stage_values(implementations.fixture("tiny"), "float32")
        assert timing.split(before, timing.snapshot())["references_computed"] == 1
    finally:
        reference_cache.use(None)
        implementations.clear_caches()


def test_the_time_split_adds_up_and_counts_a_nested_section_once():
    """A reference read inside an implementation's call (a stage plug-in does that) counts as
    reference only; the shares of a stretch without JAX compilations add up to its wall time."""
    start, before = time.perf_counter(), timing.snapshot()
    with timing.section("implementation"):
        time.sleep(0.05)
        with timing.section("reference"):
            time.sleep(0.05)
    time.sleep(0.02)
    split = timing.split(before, timing.snapshot(), startup=1.5)
    wall = time.perf_counter() - start
    assert split["startup"] == 1.5 and split["trace"] == split["lower"] == split["compile"] == 0
    assert split["run"] >= 0.05 and split["reference"] >= 0.05 and split["judge"] >= 0.02
    assert abs(split["run"] + split["reference"] + split["judge"] - wall) < 0.01

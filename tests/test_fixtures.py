"""The committed fixtures (harness/problems/fixtures.py, scripts/regenerate_fixtures.py).

- regeneration is byte-identical (twice, one of them through the script in a fresh process);
- `--check` passes on the committed files and names the tensor when a copy is damaged;
- every loader error, triggered on a damaged copy, says what is wrong and how to fix it;
- the goldens satisfy the invariants that need no second implementation;
- the float64 reference is invariant under consistent permutations of the heads;
- importing the harness pins torch's CPU kernels (ATen's and oneDNN's) to those the files
  were generated with, and a process that would otherwise compute with wider ones regenerates
  the same bytes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import harness
from harness.judging.tolerance import FIXTURE_CHECK_RTOL as CHECK_RTOL
from harness.problems.cases import CASES, KNOB_FIELDS, TEACHERS
from harness.problems.fixtures import (FIXTURES_DIR, GOLDEN_DTYPES, LOW_DTYPES, MANIFEST_NAME, SCHEMA_VERSION,
                                       FixtureError, load_case, read_manifest, read_safetensors, sha256_of,
                                       tensor_schema, write_manifest, write_safetensors)
from harness.platforms import CPU_FLAGS_ENV, isa_variant_blockers
from harness.run.regenerate import ORDER_ERRORS_NAME, read_order_errors, regenerate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fixtures():
    return {name: load_case(name) for name in CASES}


@pytest.fixture
def copy_dir(tmp_path):
    """A copy of the committed fixtures to damage."""
    dst = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, dst)
    return dst


def _rewrite(path: Path, *, drop=(), replace=None, metadata=None, fix_manifest=False):
    """Rewrite a fixture file with tensors dropped / replaced or metadata changed."""
    tensors, md = read_safetensors(path.read_bytes())
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update(replace or {})
    data = write_safetensors(tensors, {**md, **(metadata or {})})
    path.write_bytes(data)
    if fix_manifest:
        manifest = read_manifest(path.parent)
        entry = manifest["cases"][path.stem]
        entry.update(sha256=sha256_of(data), bytes=len(data))
        write_manifest(path.parent, manifest["cases"])
    return data


def _data_offset(path: Path, tensor: str) -> int:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    start = json.loads(data[8:8 + n])[tensor]["data_offsets"][0]
    return 8 + n + start


# --------------------------------------------------------------------------- regeneration


# The kernels the committed fixtures' goldens were generated with, as a user would set them
# (harness.CPU_PINS sets them in any process that imports the harness, unless set already).
AVX2_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE"}
# The widest each library takes by default; and two cases whose goldens they move on an AVX512
# CPU: ties (oneDNN's bfloat16 matmuls where the CPU has AVX512-BF16 or AMX), tiny (ATen's).
WIDEST = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL", "MKL_CBWR": "AUTO"}
KERNEL_CASES = ("ties", "tiny")


@pytest.fixture(scope="module")
def regenerated_here(tmp_path_factory):
    """Every case regenerated once in this process, its own order errors only: the files the
    byte-identity test compares and --check compares the committed ones with."""
    a = tmp_path_factory.mktemp("regenerated") / "a"
    assert regenerate(fixtures_dir=a, out=io.StringIO(), isa_variants={}, carry=False) == 0
    return a


def test_regenerating_twice_is_byte_identical(tmp_path, regenerated_here):
    """Here (a process whose environment holds the pins, harness.CPU_PINS) and in a fresh
    process whose environment sets none of the instruction-set variables (harness.ISA_VARIABLES),
    so that its torch would compute with the widest kernels of the CPU unless importing the
    harness pins them: the same bytes. On an AVX512 CPU a process that asks for the widest kernels
    regenerates other bytes, so there the comparison is between kernels that would otherwise
    differ. Each process draws its own order errors only (the ISA variants' subprocesses are
    this same code under other kernels: tests below). The control runs where this CPU runs the
    widest kernels (harness.platforms.isa_variant_blockers, from its flags)."""
    import torch

    from harness.run.regenerate import regenerate_in_subprocesses

    assert {k: os.environ.get(k) for k in AVX2_PINS} == AVX2_PINS  # this process: the pins set
    assert str(torch.backends.cpu.get_cpu_capability()) == harness.TORCH_CPU_CAPABILITY
    avx512 = "widest" not in isa_variant_blockers()
    runs = regenerate_in_subprocesses({"b": {}}, list(CASES), tmp_path, jobs=1)
    if avx512:
        runs.update(regenerate_in_subprocesses({"widest": WIDEST}, KERNEL_CASES, tmp_path, jobs=1))
    a, b, widest = regenerated_here, tmp_path / "b", tmp_path / "widest"
    assert "note:" not in runs["b"].output, runs["b"].output  # the pins were applied: no capability note
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert names == sorted([f"{n}.safetensors" for n in CASES] + [MANIFEST_NAME, ORDER_ERRORS_NAME])
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), (
            f"{name}: a process that imports the harness with no instruction-set variable set regenerates "
            f"other bytes than one that has {AVX2_PINS} set: the harness does not pin them all")
    if avx512:  # the control: on this CPU the kernels differ when left to choose
        assert "note:" in runs["widest"].output, runs["widest"].output
        assert any((widest / f"{c}.safetensors").read_bytes() != (b / f"{c}.safetensors").read_bytes()
                   for c in KERNEL_CASES), "the widest kernels regenerate the same bytes: the control shows nothing"


def test_regenerate_one_case_keeps_the_others(copy_dir):
    """Regenerating tiny (its own order errors only) leaves every other file and the manifest's
    other entries as they were, and tiny still passes --check."""
    before = {p.name: p.read_bytes() for p in copy_dir.iterdir()}
    assert regenerate(["tiny"], fixtures_dir=copy_dir, out=io.StringIO(), isa_variants={}) == 0
    after = {p.name: p.read_bytes() for p in copy_dir.iterdir()}
    assert set(after) == set(before)
    written = ("tiny.safetensors", MANIFEST_NAME, ORDER_ERRORS_NAME)
    assert {n: d for n, d in after.items() if n not in written} == {
        n: d for n, d in before.items() if n not in written}
    manifest = {n: e for n, e in read_manifest(copy_dir)["cases"].items() if n != "tiny"}
    assert manifest == {n: e for n, e in read_manifest()["cases"].items() if n != "tiny"}
    record = {n: e for n, e in read_order_errors(copy_dir)["cases"].items() if n != "tiny"}
    assert record == {n: e for n, e in read_order_errors(FIXTURES_DIR)["cases"].items() if n != "tiny"}
    out = io.StringIO()
    assert regenerate(["tiny"], check=True, fixtures_dir=copy_dir, out=out) == 0, out.getvalue()


# A CPU with AVX2 and FMA and no AVX512, as /proc/cpuinfo names its flags (harness.platforms.CPU_FLAGS_ENV
# makes this machine's harness see it: torch still computes on the real CPU, pinned to AVX2 as there).
AVX2_ONLY = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2"


def test_regenerating_on_an_avx2_only_cpu_keeps_the_estimates_it_cannot_measure(copy_dir, monkeypatch):
    """tiny regenerated where the CPU (emulated) lacks AVX512, joined over pinned (this process)
    and aten-avx512, which that CPU cannot run: the output names what it measured and what it
    could not, and why; aten-avx512's committed estimates are kept (here made 1.2x the pinned
    kernels' for half the order errors, 0.8x for the others) and the written order errors
    are the LARGEST of the two variants' in every tensor; the set passes --check. One in-process
    regeneration of tiny: a few seconds."""
    from harness.run.regenerate import ISA_VARIANTS, join_order_errors, write_order_errors

    record = read_order_errors(copy_dir)["cases"]
    pinned = record["tiny"]["pinned"]["values"]
    # within ORDERR_CHECK_FACTOR of the pinned kernels' own (1.25 at the least), so that --check passes
    planted = {t: v * (1.2 if i % 2 else 0.8) for i, (t, v) in enumerate(sorted(pinned.items()))}
    record["tiny"]["aten-avx512"] = {"measured_on": "a CPU with AVX512 (planted)", "values": planted}
    write_order_errors(copy_dir, record)
    monkeypatch.setenv(CPU_FLAGS_ENV, AVX2_ONLY)
    out = io.StringIO()
    variants = {n: ISA_VARIANTS[n] for n in ("pinned", "aten-avx512")}
    assert regenerate(["tiny"], fixtures_dir=copy_dir, out=out, isa_variants=variants) == 0, out.getvalue()
    text = out.getvalue()
    assert "ISA variant aten-avx512 (ATEN_CPU_CAPABILITY=avx512): not measured on this CPU: cannot run: CPU lacks " \
           "avx512f, avx512bw, avx512vl, avx512dq" in text, text
    assert "ISA variants measured here: pinned; not measured: aten-default, aten-avx512, onednn-all" in text, text
    assert "tiny: kept the committed order errors of aten-default, aten-avx512, onednn-all, mkl-auto, " \
           "mkl-auto-avx2, widest, as-generated from" in text, text
    written, _ = read_safetensors((copy_dir / "tiny.safetensors").read_bytes())
    entry = read_order_errors(copy_dir)["cases"]["tiny"]
    assert entry["aten-avx512"]["values"] == planted
    fresh = entry["pinned"]["values"]
    larger = 0
    for t, own in fresh.items():
        want = max(own, planted[t], *(entry[v]["values"][t] for v in entry))
        assert float(written[t].array()) == want == join_order_errors(
            {v: e["values"] for v, e in entry.items()})[t], t
        larger += planted[t] > own
    assert larger >= len(fresh) // 3, "the planted estimates are not the largest anywhere: the join is not seen"
    out = io.StringIO()
    assert regenerate(["tiny"], check=True, fixtures_dir=copy_dir, out=out) == 0, out.getvalue()
    assert "note: ISA variant aten-avx512 not run on this CPU: cannot run: CPU lacks avx512f" in out.getvalue()


def test_check_holds_the_stored_order_errors_to_their_variants_max(copy_dir):
    """--check: each stored order error is the largest of its variants' estimates in
    ORDER_ERRORS.json, and every variant has one: a file whose estimate is a smaller variant's,
    or a record without a variant, is a difference."""
    from harness.run.regenerate import write_order_errors

    record = read_order_errors(copy_dir)["cases"]
    tname = next(t for t in sorted(record["tiny"]["pinned"]["values"]) if ".orderr." in t)
    top = max(record["tiny"][v]["values"][tname] for v in record["tiny"])
    record["tiny"]["widest"]["values"][tname] = top * 2
    del record["tiny"]["onednn-all"]
    write_order_errors(copy_dir, record)
    out = io.StringIO()
    assert regenerate(["tiny"], check=True, fixtures_dir=copy_dir, out=out) == 1
    text = out.getvalue()
    assert f"tensor '{tname}' is {top!r}, but the largest of its ISA variants' estimates is {top * 2!r} (widest)" \
           in text, text
    assert "do not cover the ISA variant(s) onednn-all" in text, text


# The capped kernels the coverage test regenerates under: ATen's AVX512 and baseline kernels, and
# MKL's own AVX2 path (the nearest this machine comes to another vendor's), three of
# harness.run.regenerate.ISA_VARIANTS, each where this CPU runs it (harness.platforms.isa_variant_blockers).
COVERAGE_VARIANTS = ("aten-avx512", "aten-default", "mkl-auto-avx2")


@pytest.fixture(scope="module")
def coverage_runs(tmp_path_factory):
    """tiny regenerated in a fresh process under each coverage variant this CPU runs, two at a
    time; {variant: why not} for the others."""
    from harness.run.regenerate import ISA_VARIANTS, regenerate_in_subprocesses

    blocked = isa_variant_blockers(variants={n: ISA_VARIANTS[n] for n in COVERAGE_VARIANTS})
    where = tmp_path_factory.mktemp("coverage")
    runs = regenerate_in_subprocesses({n: ISA_VARIANTS[n] for n in COVERAGE_VARIANTS if n not in blocked}, ["tiny"],
                                      where, jobs=2)
    return where, runs, blocked


@pytest.mark.parametrize("variant", COVERAGE_VARIANTS)
def test_committed_order_errors_cover_the_capped_kernels(coverage_runs, variant):
    """tiny regenerated in a fresh process under capped kernels: every order error it draws,
    taken as the baseline of its bound (max(estimate, floor)), is at most the committed one. A
    fixture set whose estimates rest on one CPU's kernels fails here on a CPU whose kernels
    round worse. A variant this CPU cannot run (decided from its flags) is skipped with the
    reason; its committed estimates are held by --check (test_check_passes_on_committed_fixtures).
    Costs three tiny regenerations, two at a time (20 s on 2 shared cores)."""
    from harness.judging.tolerance import floor
    from harness.run.collect import dims
    from harness.run.regenerate import ISA_VARIANTS

    where, runs, blocked = coverage_runs
    if variant in blocked:
        pytest.skip(f"ISA variant {variant}: {blocked[variant]}")
    committed, _ = read_safetensors((FIXTURES_DIR / "tiny.safetensors").read_bytes())
    fresh, _ = read_safetensors((where / variant / "tiny.safetensors").read_bytes())
    orderr = [t for t in fresh if ".orderr." in t]
    assert len(orderr) == 3 * 2 * 16 - 3 * 2, (variant, len(orderr))  # 3 dtypes; joint 16, compressed 14
    uncovered = []
    for t in orderr:
        dt, quantity = t.split(".")[1], t.split("orderr.", 1)[1]
        fl = floor(dt, quantity, dims=dims("tiny"))
        got, have = max(float(fresh[t].array()), fl), max(float(committed[t].array()), fl)
        if got > have * (1 + 1e-12):
            uncovered.append(f"{t}: {got:.3g} under {variant} (torch capability {runs[variant].capability}, "
                             f"{ISA_VARIANTS[variant]}) > committed {have:.3g}")
    assert not uncovered, ("the committed order errors do not cover these kernels: regenerate with `python "
                           "scripts/regenerate_fixtures.py` on a CPU with AVX512 (every variant's path exists there):\n"
                           + "\n".join(uncovered))


def test_check_passes_on_committed_fixtures(regenerated_here):
    """--check on the committed files, against the files regenerated here (the same bytes --check
    would regenerate in memory: `case_bytes`, this process's own order errors)."""
    out = io.StringIO()
    assert regenerate(check=True, out=out, regenerated=regenerated_here) == 0, out.getvalue()
    assert "fixtures --check passed" in out.getvalue()


def test_importing_the_harness_pins_torchs_cpu_kernels():
    """A fresh process that imports the harness computes with the kernels the fixtures were
    generated with, whatever the CPU's widest (an AVX512 machine would round float32 goldens
    differently), and regenerate's capability note is then silent."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2_PINS}
    code = ("import harness, os, torch; from harness.run.regenerate import cpu_capability_note; "
            "print(torch.backends.cpu.get_cpu_capability()); print(cpu_capability_note()); "
            f"print({{k: os.environ.get(k) for k in {sorted(AVX2_PINS)}}})")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    used, note, pins = proc.stdout.split("\n")[:3]
    assert pins == str({k: AVX2_PINS[k] for k in sorted(AVX2_PINS)}) == str(dict(sorted(harness.CPU_PINS.items())))
    assert used == harness.TORCH_CPU_CAPABILITY, (
        f"torch computes with {used}, not {harness.TORCH_CPU_CAPABILITY}: this CPU cannot regenerate "
        "the committed fixtures' float32 goldens byte for byte")
    assert note == "None"


def test_check_names_a_flipped_input_byte(copy_dir):
    path = copy_dir / "tiny.safetensors"
    data = bytearray(path.read_bytes())
    data[_data_offset(path, "hidden_states") + 5] ^= 0x01
    path.write_bytes(bytes(data))
    out = io.StringIO()
    assert regenerate(["tiny"], check=True, fixtures_dir=copy_dir, out=out) == 1
    text = out.getvalue()
    assert "tensor 'hidden_states': 1 of 256 element(s) differ (inputs and parameters must " \
           "match exactly); first at index (0, 0, 1)" in text, text
    assert "but MANIFEST.json records" in text
    assert "FAILED" in text


def test_check_golden_bound(copy_dir):
    """A float64 golden moved within 1e-12 passes; one moved beyond is named with its bound."""
    path = copy_dir / "small.safetensors"
    tensors, _ = read_safetensors(path.read_bytes())
    name = "golden.float64.grad.dense.indexer.wq_b"
    g = tensors[name].array()
    scale = np.abs(g).max()
    g_near, g_far = g.copy(), g.copy()
    g_near[0, 0] += 0.1 * CHECK_RTOL["float64"] * scale
    g_far[0, 0] += 10 * CHECK_RTOL["float64"] * scale
    _rewrite(path, replace={name: g_near}, fix_manifest=True)
    assert regenerate(["small"], check=True, fixtures_dir=copy_dir, out=io.StringIO()) == 0
    _rewrite(path, replace={name: g_far}, fix_manifest=True)
    out = io.StringIO()
    assert regenerate(["small"], check=True, fixtures_dir=copy_dir, out=out) == 1
    assert f"tensor '{name}': 1 of 8192 element(s) differ (max |diff|" in out.getvalue()
    assert "> 1e-12 * max |committed|" in out.getvalue()


def test_check_reports_a_missing_file(copy_dir):
    (copy_dir / "tiny.safetensors").unlink()
    out = io.StringIO()
    assert regenerate(["tiny"], check=True, fixtures_dir=copy_dir, out=out) == 1
    assert "tiny.safetensors is missing" in out.getvalue()


def test_unknown_case_is_a_usage_error():
    out = io.StringIO()
    assert regenerate(["nope"], out=out) == 2
    assert "unknown case(s) 'nope'" in out.getvalue()


# --------------------------------------------------------------------------- format


def test_files_read_back_with_the_safetensors_library(fixtures):
    import torch
    from safetensors import safe_open

    for name, fx in fixtures.items():
        with safe_open(str(FIXTURES_DIR / f"{name}.safetensors"), framework="pt") as f:
            assert f.metadata() == fx.metadata
            for key in f.keys():
                t = f.get_tensor(key)
                ref = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
                if key.startswith("golden."):
                    _, dt, q = key.split(".", 2)
                    mine = fx.goldens[dt][q]
                else:
                    mine = fx.inputs[key] if key in fx.inputs else fx.params[key]
                assert ref.dtype == mine.dtype and ref.shape == mine.shape, key
                assert np.array_equal(ref, mine, equal_nan=True), key


def test_manifest_and_metadata(fixtures):
    manifest = read_manifest()
    assert list(manifest["cases"]) == list(CASES)
    total = 0
    for name, fx in fixtures.items():
        data = fx.path.read_bytes()
        entry = manifest["cases"][name]
        assert entry["sha256"] == sha256_of(data) and entry["bytes"] == len(data)
        assert entry["config"] == CASES[name].config_dict()
        assert not set(KNOB_FIELDS) & set(entry["config"]), "run-time knobs are not part of a fixture"
        md = fx.metadata
        assert md["schema_version"] == str(SCHEMA_VERSION) and md["case"] == name
        assert not set(KNOB_FIELDS) & set(json.loads(md["config"]))
        assert json.loads(md["config"]) == CASES[name].config_dict()
        assert md["seed"] == str(CASES[name].seed)
        # the joint teacher's layout knobs and the teachers whose goldens the file holds
        assert json.loads(md["teachers"]) == list(CASES[name].teachers)
        assert json.loads(md["sink"]) == (None if CASES[name].sink is None else list(CASES[name].sink))
        assert json.loads(md["window_scale"]) == CASES[name].window_scale
        assert md["position_offset"] == str(CASES[name].position_offset)
        assert {"torch_version", "numpy_version", "csa_parity_version"} <= set(md)
        total += len(data)
    assert total < 40 * 2**20, f"the fixtures take {total / 2**20:.1f} MiB, more than 40 MiB"


def test_every_case_holds_every_teachers_goldens(fixtures):
    """Each teacher applies to every problem, so every file holds both teachers' loss and
    gradient goldens at every dtype, and their order errors at the low ones (the compressed
    teacher's under `golden.<dtype>.compressed.`)."""
    losses = {f"loss.{v}" for v in ("dense", "sparse")}
    for name, fx in fixtures.items():
        assert CASES[name].teachers == TEACHERS, name
        for teacher in TEACHERS:
            for dt in GOLDEN_DTYPES:
                goldens = fx.goldens_of(dt, teacher)
                assert losses <= set(goldens), (name, teacher, dt)
                assert len([q for q in goldens if q.startswith("grad.")]) == (18 if dt != "float64" else 12)
                if dt in LOW_DTYPES:
                    assert fx.order_errors(dt, teacher), (name, teacher, dt)


def test_loading_needs_neither_torch_nor_the_code_under_test():
    code = ("import sys; from harness.problems.fixtures import load_case; load_case('small'); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_ref', 'jax', 'jax_impl')); "
            "assert not bad, f'loading a fixture imported {bad}'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_loaded_types(fixtures):
    fx = fixtures["small"]
    assert fx.goldens["bfloat16"]["compressed_keys"].dtype == np.float32  # exact widening
    assert fx.goldens["float16"]["compressed_keys"].dtype == np.float16
    assert fx.goldens["float64"]["loss.dense"].shape == ()
    assert fx.goldens["float64"]["loss.dense"].dtype == np.float64
    assert fx.goldens["bfloat16"]["loss.sparse_at_oracle"].dtype == np.float32
    assert fx.goldens["float32"]["topk_indices"].dtype == np.int64
    assert fx.inputs["position_ids"].dtype == np.int32
    assert fx.inputs["hidden_states"].flags.writeable
    assert "loss.sparse_at_oracle" not in fx.goldens["float64"]


# --------------------------------------------------------------------------- loader errors


def _load_error(copy_dir, name="tiny") -> str:
    with pytest.raises(FixtureError) as e:
        load_case(name, copy_dir)
    return str(e.value)


def test_error_missing_file(copy_dir):
    (copy_dir / "tiny.safetensors").unlink()
    msg = _load_error(copy_dir)
    assert msg == (f"{copy_dir}/tiny.safetensors is missing: run "
                   f"`csa-parity regenerate --case tiny --fixtures-dir {copy_dir}`")


def test_error_missing_file_in_the_repo_names_the_plain_command(copy_dir, monkeypatch):
    import harness.problems.fixtures as F

    monkeypatch.setattr(F, "REPO_ROOT", copy_dir.parent)
    monkeypatch.setattr(F, "FIXTURES_DIR", copy_dir)
    (copy_dir / "small.safetensors").unlink()
    with pytest.raises(FixtureError) as e:
        load_case("small")
    assert str(e.value) == ("fixtures/small.safetensors is missing: run "
                            "`csa-parity regenerate --case small`")


def test_error_unknown_case():
    with pytest.raises(FixtureError, match="unknown case 'nope' \\(valid: tiny, small, "):
        load_case("nope")


def test_error_truncated_file(copy_dir):
    path = copy_dir / "tiny.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    msg = _load_error(copy_dir)
    assert "tiny.safetensors is truncated or corrupt (the data is truncated: the header " \
           "describes" in msg
    assert "restore it with `git checkout --" in msg and "--case tiny" in msg


def test_error_corrupt_header(copy_dir):
    path = copy_dir / "tiny.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    assert "is truncated or corrupt (the header is not valid JSON" in _load_error(copy_dir)
    path.write_bytes(b"abc")
    assert "is truncated or corrupt (only 3 bytes" in _load_error(copy_dir)


def test_error_schema_version(copy_dir):
    _rewrite(copy_dir / "tiny.safetensors", metadata={"schema_version": "0"})
    msg = _load_error(copy_dir)
    assert f"tiny.safetensors has schema version '0', this harness reads schema version {SCHEMA_VERSION}: " \
           "regenerate it with `csa-parity regenerate --case tiny" in msg


def test_error_missing_tensor(copy_dir):
    _rewrite(copy_dir / "tiny.safetensors", drop=["golden.float32.loss.dense"])
    msg = _load_error(copy_dir)
    assert f"tiny.safetensors has no tensor 'golden.float32.loss.dense' (schema version {SCHEMA_VERSION} " \
           "needs it): regenerate it with" in msg


def test_error_unexpected_tensor(copy_dir):
    _rewrite(copy_dir / "tiny.safetensors", replace={"stray": np.zeros(2, np.float32)})
    assert "has unexpected tensor(s) 'stray'" in _load_error(copy_dir)


def test_error_shape(copy_dir):
    path = copy_dir / "tiny.safetensors"
    tensors, _ = read_safetensors(path.read_bytes())
    _rewrite(path, replace={"hidden_states": tensors["hidden_states"].array()[:, :, :-1]})
    msg = _load_error(copy_dir)
    assert "tensor 'hidden_states' is [1, 16, 15] float32, but case 'tiny' (B=1, S=16, W=4, " \
           "emb_dim=16," in msg
    assert "implies [B, S, emb_dim] = [1, 16, 16] float32: regenerate it with" in msg


def test_error_dtype(copy_dir):
    path = copy_dir / "tiny.safetensors"
    tensors, _ = read_safetensors(path.read_bytes())
    pos = tensors["position_ids"].array().astype(np.int64)
    _rewrite(path, replace={"position_ids": pos})
    assert "tensor 'position_ids' is [1, 16] int64, but case 'tiny'" in _load_error(copy_dir)
    keys = tensors["golden.bfloat16.compressed_keys"].array()  # float32 now: the wrong dtype
    _rewrite(path, replace={"position_ids": tensors["position_ids"],
                            "golden.bfloat16.compressed_keys": keys})
    assert ("tensor 'golden.bfloat16.compressed_keys' is [1, 4, 8] float32, but case 'tiny'"
            in _load_error(copy_dir))


def test_error_config_no_longer_validates(copy_dir):
    cfg = {**CASES["tiny"].config_dict(), "rope_head_dim": 3}
    _rewrite(copy_dir / "tiny.safetensors", metadata={"config": json.dumps(cfg)})
    msg = _load_error(copy_dir)
    assert "tiny.safetensors: its config no longer validates: rope_head_dim=3 must be even. " \
           "Fix case 'tiny' in harness/problems/cases.py if needed, then regenerate with" in msg
    cfg = {**CASES["tiny"].config_dict(), "window": 4}
    _rewrite(copy_dir / "tiny.safetensors", metadata={"config": json.dumps(cfg)})
    assert "its config no longer validates: unknown config field 'window'" in _load_error(copy_dir)
    cfg = {**CASES["tiny"].config_dict(), "indexer_head_chunk": 1}
    _rewrite(copy_dir / "tiny.safetensors", metadata={"config": json.dumps(cfg)})
    assert ("its config no longer validates: config field 'indexer_head_chunk' is a run-time knob, not "
            "part of a fixture" in _load_error(copy_dir))


def test_error_config_differs_from_catalogue(copy_dir):
    cfg = {**CASES["tiny"].config_dict(), "index_topk": 3}
    _rewrite(copy_dir / "tiny.safetensors", metadata={"config": json.dumps(cfg)})
    msg = _load_error(copy_dir)
    assert "was written for another config than case 'tiny' in harness/problems/cases.py " \
           "(index_topk: file 3, catalogue 2): regenerate it with" in msg


def test_error_sha_mismatch(copy_dir):
    path = copy_dir / "tiny.safetensors"
    data = bytearray(path.read_bytes())
    # A low mantissa bit of a finite golden: still a valid value (a bit of a -inf would make
    # a NaN, which the loader refuses whatever the sha: tests/test_bad_inputs.py).
    data[_data_offset(path, "golden.float64.loss.dense") + 3] ^= 0x10
    path.write_bytes(bytes(data))
    msg = _load_error(copy_dir)
    assert "tiny.safetensors does not match" in msg and "MANIFEST.json: expected sha256" in msg
    assert "restore it with `git checkout --" in msg and "--case tiny" in msg
    load_case("tiny", copy_dir, verify_sha=False)  # structurally fine


def test_error_manifest_missing(copy_dir):
    (copy_dir / MANIFEST_NAME).unlink()
    msg = _load_error(copy_dir)
    assert msg.startswith(f"{copy_dir}/MANIFEST.json is missing: run "
                          f"`csa-parity regenerate --fixtures-dir {copy_dir}`")


# --------------------------------------------------------------------------- golden invariants


def _validity(case, pos, seg):
    """valid[b, s, j] of SPEC §7, from the positions and segment ids alone."""
    m, W = case.config["compress_ratio"], case.num_blocks
    B, S = pos.shape
    bpos = pos[:, 0:W * m:m]
    causal = bpos[:, None, :] + m <= pos[:, :, None] + 1
    blocks = seg[:, :W * m].reshape(B, W, m)
    same = np.all(blocks[:, None, :, :] == seg[:, :, None, None], axis=-1)
    return causal & same


@pytest.mark.parametrize("name", list(CASES))
def test_golden_invariants(fixtures, name):
    fx = fixtures[name]
    case = fx.case
    valid = _validity(case, fx.inputs["position_ids"], fx.inputs["segment_ids"])
    n_valid = valid.sum(-1)
    schema = tensor_schema(case)
    for dt in GOLDEN_DTYPES:
        g = fx.goldens[dt]
        for q, arr in g.items():
            assert not np.isnan(arr.astype(np.float64)).any(), (dt, q)
            if q != "index_scores":
                assert np.isfinite(arr.astype(np.float64)).all(), (dt, q)
            assert arr.shape == schema[f"golden.{dt}.{q}"][0]
        scores = g["index_scores"]
        # -inf exactly at the invalid blocks, finite elsewhere.
        assert np.array_equal(np.isneginf(scores), ~valid), dt
        assert np.isfinite(scores[valid]).all(), dt
        # -1 exactly where the pick is invalid: min(k_eff, #valid) real picks, all valid,
        # distinct, and no valid block outside them scores higher.
        topk = g["topk_indices"]
        for idx in np.ndindex(*topk.shape[:-1]):
            picks = topk[idx]
            real = picks[picks >= 0]
            assert np.all((picks >= 0) | (picks == -1))
            assert len(real) == min(case.k_eff, n_valid[idx]), (dt, idx, picks)
            assert len(set(real.tolist())) == len(real)
            assert valid[idx][real].all(), (dt, idx, picks)
            rest = valid[idx].copy()
            rest[real] = False
            if len(real) and rest.any():
                assert scores[idx][real].min() >= scores[idx][rest].max(), (dt, idx)
        # Where no token has a valid block: loss exactly 0, gradients exactly 0, no NaN
        # (for every teacher whose goldens the case holds).
        if not valid.any():
            for t in case.teachers:
                for q, arr in fx.goldens_of(dt, t).items():
                    if q.startswith(("loss.", "grad.")):
                        assert np.all(arr == 0), (dt, t, q)


def test_all_invalid_cases_exist(fixtures):
    """The 'no valid block anywhere' invariant is exercised, with W = 0 and with W > 0."""
    empty = [n for n, fx in fixtures.items() if not _validity(
        fx.case, fx.inputs["position_ids"], fx.inputs["segment_ids"]).any()]
    assert {"no_blocks", "all_invalid"} <= set(empty)
    assert fixtures["all_invalid"].case.num_blocks > 0


def test_topk_wide_sparse_equals_dense(fixtures):
    """k >= W: every valid block is picked, so the sparse loss is the dense loss."""
    g = fixtures["topk_wide"].goldens["float64"]
    np.testing.assert_allclose(g["loss.sparse"], g["loss.dense"], rtol=1e-12, atol=0)
    for p in fixtures["topk_wide"].params:
        np.testing.assert_allclose(g[f"grad.sparse.{p}"], g[f"grad.dense.{p}"], rtol=1e-12,
                                   atol=1e-12 * np.abs(g[f"grad.dense.{p}"]).max())


def test_ties_sit_on_the_topk_boundary_in_every_dtype(fixtures):
    fx = fixtures["ties"]
    k = fx.case.k_eff
    for dt in GOLDEN_DTYPES:
        keys, scores = fx.goldens[dt]["compressed_keys"], fx.goldens[dt]["index_scores"]
        for b, labels in enumerate(fx.case.tied_blocks):
            for w, lab in enumerate(labels):
                assert np.array_equal(keys[b, w], keys[b, labels.index(lab)]), (dt, b, w)
        ordered = -np.sort(-scores, axis=-1)
        boundary = (ordered[..., k - 1] == ordered[..., k]) & np.isfinite(ordered[..., k])
        assert boundary.sum() >= 8, dt  # 24 of 64 rows with this seed
        # the tie is a twin pair: one twin picked, the other not
        for idx in zip(*np.nonzero(boundary)):
            b = idx[0]
            picked = set(fx.goldens[dt]["topk_indices"][idx].tolist())
            kth = ordered[idx][k - 1]
            tied = {j for j in range(scores.shape[-1]) if scores[idx][j] == kth}
            assert len(tied) >= 2 and 0 < len(tied & picked) < len(tied)
            assert len({fx.case.tied_blocks[b][j] for j in tied}) == 1


def test_sparse_at_oracle_uses_the_oracle_selection(fixtures):
    """Where a dtype's own top-k equals the oracle's, its sparse goldens equal the
    selection-conditioned ones exactly (same computation, same mask), for every teacher."""
    for fx in fixtures.values():
        oracle = fx.goldens["float64"]["topk_indices"]
        for dt in LOW_DTYPES:
            same = all(set(fx.goldens[dt]["topk_indices"][i].tolist()) == set(oracle[i].tolist())
                       for i in np.ndindex(*oracle.shape[:-1]))
            if same:
                for t in fx.case.teachers:
                    g = fx.goldens_of(dt, t)
                    assert g["loss.sparse"] == g["loss.sparse_at_oracle"], (fx.name, dt, t)
                    for p in fx.params:
                        assert np.array_equal(g[f"grad.sparse.{p}"],
                                              g[f"grad.sparse_at_oracle.{p}"]), (fx.name, dt, t, p)


def test_teacher_goldens_are_stored_per_teacher(fixtures):
    """The compressed teacher's loss and gradients (and order errors) are stored apart from the
    joint one's; they differ (widely on teacher_gap) wherever a query sees a valid block; the
    forward goldens are shared."""
    for fx in fixtures.values():
        for dt in GOLDEN_DTYPES:
            joint = fx.goldens_of(dt, "joint")
            assert not any(q.startswith("compressed.") for q in joint)
            comp = fx.goldens_of(dt, "compressed")
            assert set(comp) == set(joint), (fx.name, dt, set(comp) ^ set(joint))
            for q in ("compressed_keys", "index_scores", "topk_indices"):
                assert comp[q] is joint[q]
            no_valid_block = not np.isfinite(joint["index_scores"]).any()  # no_blocks, all_invalid
            if no_valid_block:
                assert float(comp["loss.dense"]) == float(joint["loss.dense"]) == 0.0, (fx.name, dt)
            else:
                assert comp["loss.dense"] != joint["loss.dense"], (fx.name, dt)
    with pytest.raises(ValueError, match="teacher='softmax' is not supported"):
        fixtures["tiny"].goldens_of("float64", "softmax")
    gap = fixtures["teacher_gap"].goldens["float64"]
    for mode in ("dense", "sparse"):
        j, c = float(gap[f"loss.{mode}"]), float(gap[f"compressed.loss.{mode}"])
        assert abs(j - c) > 0.15 * abs(j), (mode, j, c)


# --------------------------------------------------------------------------- permutations


def _relerr(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(fin, np.isfinite(a))
    scale = np.abs(b[fin]).max() if fin.any() else 1.0
    return float(np.abs(a[fin] - b[fin]).max(initial=0.0) / scale)


@pytest.mark.parametrize("name", ["small", "packed", "flash_dims", "teacher_gap"])
def test_float64_reference_is_invariant_under_head_permutations(fixtures, name):
    import torch_ref

    fx = fixtures[name]
    c = fx.config
    HI, DI, R = c["index_n_heads"], c["index_head_dim"], c["q_lora_rank"]
    rng = np.random.default_rng(7)
    perm_i = rng.permutation(HI)
    perm_t = rng.permutation(c["num_query_heads"])
    g = fx.goldens["float64"]

    heads = dict(fx.params)
    heads["indexer.wq_b"] = fx.params["indexer.wq_b"].reshape(R, HI, DI)[:, perm_i].reshape(R, -1)
    heads["indexer.weights_proj"] = fx.params["indexer.weights_proj"][:, perm_i]
    teacher = dict(fx.inputs)
    teacher["teacher_query"] = fx.inputs["teacher_query"][:, :, perm_t]
    teacher["attention_sink"] = fx.inputs["attention_sink"][perm_t]  # each head keeps its sink
    for params, inputs in ((heads, fx.inputs), (fx.params, teacher)):
        dense = torch_ref.CSAConfig.from_dict(c)
        scores = torch_ref.indexer_forward(params, inputs, dense, "float64")["index_scores"]
        assert _relerr(scores.numpy(), g["index_scores"]) <= 1e-12
        for t in fx.case.teachers:  # every teacher whose goldens the fixture holds
            prefix = "" if t == "joint" else f"{t}."
            for sparse, mode in ((False, "dense"), (True, "sparse")):
                cfg = torch_ref.CSAConfig.from_dict({**c, "sparse_loss": sparse, "teacher_normaliser": t})
                key = f"{prefix}loss.{mode}"
                loss = torch_ref.indexer_loss(params, inputs, cfg, "float64")
                assert abs(float(loss) - float(g[key])) <= 1e-12 * abs(float(g[key])), key


# --------------------------------------------------------------------------- order errors


def test_order_errors_bound_the_stored_goldens_own_error(fixtures):
    """Order 0 of `order_errors` is the stored evaluation order, so every stored order error
    is at least the stored golden's own error against the oracle (and finite, >= 0)."""
    from harness.judging.compare import normalised_error
    from harness.problems.fixtures import ORDERR_QUANTITIES

    above = 0
    for fx in fixtures.values():
        for t in fx.case.teachers:  # each teacher's goldens against its own oracle
            for dt in LOW_DTYPES:
                g, g64 = fx.goldens_of(dt, t), fx.goldens_of("float64", t)
                for q in ORDERR_QUANTITIES:
                    orderr = float(g[f"orderr.{q}"])
                    oracle = g64[q.replace("sparse_at_oracle", "sparse", 1)]
                    own, _, _ = normalised_error(g[q], oracle, "row" if q == "index_scores" else "tensor")
                    assert own <= orderr * (1 + 1e-12) and np.isfinite(orderr), (fx.name, t, dt, q, own, orderr)
                    above += orderr > own * 1.01
    assert above > 0  # some permuted order rounds worse than the stored one: the point of K > 1


def test_evaluation_orders_start_with_the_stored_order_and_are_distinct():
    from harness.run.regenerate import ORDER_COUNT, evaluation_orders

    orders = evaluation_orders(2, 8, 8)
    assert len(orders) == ORDER_COUNT
    assert all(np.array_equal(p, np.arange(len(p))) for p in orders[0])
    assert len({tuple(tuple(p) for p in o) for o in orders}) == ORDER_COUNT
    for o in orders:  # permutations, never anything else
        assert all(sorted(p.tolist()) == list(range(len(p))) for p in o)
    assert len(evaluation_orders(1, 2, 2)) == 4  # tiny: exactly the 4 distinct orders exist


def test_check_flags_an_order_error_that_moved_more_than_the_factor():
    """--check compares an order error as the baseline of its bound, max(estimate, floor): within
    ORDERR_CHECK_FACTOR[dtype] either way; below the floor a move is no difference."""
    from harness.judging.tolerance import ORDERR_CHECK_FACTOR, floor
    from harness.problems.fixtures import RawTensor
    from harness.run.collect import dims
    from harness.run.regenerate import compare_tensor

    def t(x):
        return RawTensor("F64", (), np.float64(x).tobytes())

    name = "golden.float32.compressed.orderr.grad.dense.indexer.wq_b"
    factor = ORDERR_CHECK_FACTOR["float32"]
    fl = floor("float32", "grad.dense.indexer.wq_b", dims=dims("small"))
    old = 4 * factor * fl  # above the floor by more than the factor, both ways
    assert compare_tensor(name, t(old), t(old * factor), {}, {}, dims("small")) is None
    assert compare_tensor(name, t(old), t(old / factor), {}, {}, dims("small")) is None
    msg = compare_tensor(name, t(old), t(old * factor * 1.5), {}, {}, dims("small"))
    assert msg and f"more than {factor:g}x apart" in msg and "ORDERR_CHECK_FACTOR" in msg
    assert compare_tensor(name, t(old), t(old / factor / 1.5), {}, {}, dims("small"))
    assert compare_tensor(name, t(fl / 100), t(fl / 100 / factor / 2), {}, {}, dims("small")) is None  # under the floor

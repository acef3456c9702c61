"""The matrix's samples (harness/problems/matrix.py): the `ci` sample that `make test` and
`make test312` run is a subset of the default sample that still holds every case natively in a
narrow and a wide dtype (every dtype on half the cases), the combined chunk point of every case
beyond the joint-teacher ones, and every value class of every chunk knob on each sweep case.
Cheap: no JAX, no compilation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest

from harness.points import DTYPES, Point
from harness.problems.cases import CASES
from harness.problems.matrix import (BACKENDS, CI_DTYPES, COMPRESSED_CI, SAMPLES, SWEEP_CASES, TEACHER_CASES,
                                     build_matrix, chunk_points, combined_pair, query_chunk_sizes)

NARROW, WIDE = ("bfloat16", "float16"), ("float32", "float64")


def _points(sample):
    """The sample's points on the XLA scoring backend (the pallas backend's: test_the_pallas_sample...)."""
    return {e.point for e in build_matrix(sample=sample, backends=["xla"])}


def test_ci_is_a_subset_of_default_and_default_of_full():
    ci, default, full = (set((e.point, e.mode, e.quantity) for e in build_matrix(sample=s))
                         for s in ("ci", "default", "full"))
    assert ci < default < full


def test_the_tpu_sample_covers_every_case_dtype_axis_and_teacher():
    """harness.problems.matrix.TPU_DTYPES: every case natively, float32, bfloat16 and float16 (no
    float64: not applicable on a TPU), both teachers in each of those dtypes, every chunk axis
    against a native point of its own dtype; 43 compiled programs (what one chip compiles and
    runs inside one 10-minute command: 112 s measured, docs/platforms.md). With the pallas
    backend asked for, the kernels at every joint-teacher xla point of float32 and bfloat16."""
    from harness.problems.matrix import TPU_DTYPES, TPU_PALLAS_DTYPES, programs_at

    both = {e.point for e in build_matrix(sample="tpu", backends=["xla", "pallas"])}
    points = {p for p in both if p.backend == "xla"}
    assert points == {e.point for e in build_matrix(sample="tpu")}
    pallas = {p for p in both if p.backend == "pallas"}
    assert {(p.case, p.dtype, p.ichunk, p.tchunk, p.qchunk) for p in pallas} == {
        (p.case, p.dtype, p.ichunk, p.tchunk, p.qchunk) for p in points
        if p.teacher == "joint" and p.dtype in TPU_PALLAS_DTYPES}
    assert {p.teacher for p in pallas} == {"joint"} and any(p.chunked for p in pallas)
    assert {p.case for p in points if not p.chunked} == set(CASES)
    assert {p.dtype for p in points} == set(TPU_DTYPES) == {"float32", "bfloat16", "float16"}
    assert {(p.dtype, p.teacher) for p in points} == {(d, t) for d in TPU_DTYPES for t in ("joint", "compressed")}
    chunked = [p for p in points if p.chunked]
    assert all(p.native in points for p in chunked)
    assert any(p.ichunk and not p.tchunk for p in chunked) and any(p.tchunk and not p.ichunk for p in chunked)
    assert any(p.qchunk and not (p.ichunk or p.tchunk) for p in chunked)
    assert any(p.qchunk and p.ichunk and p.tchunk and p.teacher == "compressed" for p in chunked)
    assert {p.dtype for p in chunked} == set(TPU_DTYPES)
    assert sum(programs_at(p) for p in points) == 43


def test_ci_runs_every_case_natively_in_a_narrow_and_a_wide_dtype():
    """Every case in at least one narrow and one wide dtype, the sweep cases in all four, and
    every dtype on at least 5 of the other 13 cases: a case missing from CI_DTYPES is an error.
    But the joint-teacher cases (one shared indexer, differing only in the window and the sink):
    each natively in one dtype with the joint teacher, narrow on three and wide on three, every
    dtype on at least one."""
    assert set(CI_DTYPES) == set(CASES)
    native = {(p.case, p.dtype) for p in _points("ci") if not p.chunked}
    joint = {(p.case, p.dtype) for p in _points("ci") if not p.chunked and p.teacher == "joint"}
    per_dtype, teacher_dtypes = Counter(), []
    for case in CASES:
        dtypes = {d for c, d in native if c == case}
        if case in TEACHER_CASES:
            (dtype,) = {d for c, d in joint if c == case}
            teacher_dtypes.append(dtype)
            continue
        assert dtypes & set(NARROW) and dtypes & set(WIDE), (case, dtypes)
        if case in SWEEP_CASES:
            assert dtypes == set(DTYPES), (case, dtypes)
        else:
            per_dtype.update(dtypes)
    assert min(per_dtype[d] for d in DTYPES) >= 5, per_dtype
    assert set(teacher_dtypes) == set(DTYPES)
    assert sum(d in NARROW for d in teacher_dtypes) == sum(d in WIDE for d in teacher_dtypes) == 3


def test_ci_holds_the_combined_point_of_every_case_in_a_dtype_it_runs_natively():
    """But the six joint-teacher cases (one shared indexer), which run natively only in ci, and
    the quantized cases, of which quant_planted holds it in float64 (the codes precede every
    chunk). The combined point's chunk checks compare it with the native point of its own dtype,
    which the sample holds; every dtype holds at least 3 combined points, the sweep cases' included."""
    per_dtype = Counter()
    ci = _points("ci")
    for case in CASES:
        combined = (*combined_pair(case), query_chunk_sizes(CASES[case].seq_len)[1])
        dtypes = {d for d in DTYPES if combined in chunk_points(case, d, "ci")}
        if case in TEACHER_CASES or (CASES[case].config["index_quant"] and case != "quant_planted"):
            assert not dtypes and combined in chunk_points(case, "float64", "default"), (case, dtypes)
            continue
        assert dtypes, case
        per_dtype.update(dtypes)
    assert min(per_dtype[d] for d in DTYPES) >= 3, per_dtype
    assert all(p.native in ci for p in ci if p.chunked)


def test_a_case_without_ci_dtypes_is_one_clear_error(monkeypatch):
    monkeypatch.delitem(CI_DTYPES, "tiny")
    with pytest.raises(ValueError, match=r"case='tiny' has no entry in harness.problems.matrix.CI_DTYPES"):
        build_matrix(sample="ci")


@pytest.mark.parametrize("case", SWEEP_CASES)
def test_ci_sweeps_every_value_class_of_every_knob_once(case):
    cfg = CASES[case].config
    hi, h = cfg["index_n_heads"], cfg["num_query_heads"]
    dividing, non_dividing = query_chunk_sizes(CASES[case].seq_len)
    alone = [(1, 0, 0), (hi, 0, 0), (0, 1, 0), (0, h, 0), (0, 0, dividing), (0, 0, non_dividing)]
    for triple in alone:
        dtypes = [d for d in DTYPES if triple in chunk_points(case, d, "ci")]
        assert len(dtypes) == 1, (case, triple, dtypes)


def test_the_two_sweep_cases_run_each_class_in_different_dtypes():
    def dtype_of(case, cls):
        cfg = CASES[case].config
        triple = [(1, 0, 0), (cfg["index_n_heads"], 0, 0), (0, 1, 0), (0, cfg["num_query_heads"], 0),
                  (0, 0, query_chunk_sizes(CASES[case].seq_len)[0]),
                  (0, 0, query_chunk_sizes(CASES[case].seq_len)[1])][cls]
        return next(d for d in DTYPES if triple in chunk_points(case, d, "ci"))

    for cls in range(6):
        assert dtype_of(SWEEP_CASES[0], cls) != dtype_of(SWEEP_CASES[1], cls), cls


def test_ci_is_about_a_third_of_the_default_in_compiled_programs():
    """The point of the sample: .ci/run under 25 minutes. The joint teacher: ci 11 cases x 2
    native dtypes + the 6 joint-teacher cases in 1 + 2 more on each of the 2 sweep cases + the
    combined point on the 11 cases beyond the 6 joint-teacher ones (2 dtypes on the sweep cases)
    + 6 knob classes on each sweep case = 22 + 6 + 4 + 13 + 12 = 57, and the 4 quantized cases
    natively in 4, 2, 4 and 2 dtypes with one combined point among them, 13: 70; default 233
    (137 on the first 9 cases, + 8 x 4 x 2 on the joint teacher's 7 and packed_edges, + 4 x 4 x 2
    on the quantized cases). The compressed teacher:
    ci native in one dtype on the 16 cases beyond the 5 whose window and sink it does not read +
    the combined point on small and teacher_gap = 18; default on all 21 cases, native in 4 +
    combined in 3 = 7 per case, 147. Entries: 19 per joint point without teacher chunk (3 forward
    + 2 modes x 8; a quantized case's forward adds its 4 codes and scales), 16 with one or with
    the compressed teacher."""
    ci, default = _points("ci"), _points("default")
    assert len(ci) == 88 and len(default) == 380
    assert Counter(p.teacher for p in ci) == {"joint": 70, "compressed": 18}
    assert Counter(p.teacher for p in default) == {"joint": 233, "compressed": 147}
    assert len(build_matrix(sample="ci", backends=["xla"])) == 1612 and len(build_matrix(backends=["xla"])) == 6543
    assert len(ci) / len(default) < 0.35


@pytest.mark.parametrize("sample", ["ci", "default"])
def test_the_compressed_teacher_runs_on_every_case(sample):
    """On every case (each holds its goldens), natively and at the combined point, never with
    forward entries (they do not depend on the teacher). default: every case in every dtype.
    ci: every case but the joint-teacher cases that differ from teacher_gap only in the window
    and sink (which the compressed teacher does not read) natively in one dtype, each dtype on at
    least 3 cases (COMPRESSED_CI; a case missing there is an error), float64 on the layouts a
    shortcut gets wrong first."""
    entries = [e for e in build_matrix(sample=sample) if e.point.teacher == "compressed"]
    assert all("compressed" in case.teachers for case in CASES.values())
    skipped = set(TEACHER_CASES) - {"teacher_gap"} if sample == "ci" else set()
    assert {c for c, d in COMPRESSED_CI.items() if d is None} == set(TEACHER_CASES) - {"teacher_gap"}
    assert {e.point.case for e in entries} == set(CASES) - skipped
    assert not [e for e in entries if e.mode == "forward"]
    with_combined, per_dtype = set(), Counter()
    for case in set(CASES) - skipped:
        native = {e.point.dtype for e in entries if e.point.case == case and not e.point.chunked}
        combined = {e.point.dtype for e in entries if e.point.case == case
                    and (e.point.ichunk, e.point.tchunk, e.point.qchunk)
                    == (*combined_pair(case), query_chunk_sizes(CASES[case].seq_len)[1])}
        assert native == (set(DTYPES) if sample == "default" else {COMPRESSED_CI[case]}), (case, native)
        per_dtype.update(native)
        assert combined <= native, (case, combined, native)  # its chunk checks need the native point
        if combined:
            with_combined.add(case)
    assert set(per_dtype) == set(DTYPES) and min(per_dtype.values()) >= 3, per_dtype
    if sample == "ci":
        assert {c for c, d in COMPRESSED_CI.items() if d == "float64"} >= {"ragged", "ties", "packed_edges",
                                                                           "yarn_tail"}
    # ci: the combined point on two of them (small, teacher_gap); default: on every one
    assert with_combined == (set(CASES) if sample == "default" else {"small", "teacher_gap"}), with_combined


def test_a_case_missing_from_the_compressed_ci_dtypes_is_an_error(monkeypatch):
    from harness.problems import matrix

    monkeypatch.delitem(matrix.COMPRESSED_CI, "ragged")
    with pytest.raises(ValueError, match=r"case='ragged' has no entry in harness.problems.matrix.COMPRESSED_CI"):
        build_matrix(sample="ci", teachers=["compressed"])


def test_points_name_their_teacher_and_parse_back():
    joint = [e.point for e in build_matrix(sample="ci", cases=["tiny"])]
    comp = [p for p in joint if p.teacher == "compressed"]
    assert comp and all(Point.parse(p.spec()) == p for p in joint)
    assert all("teacher=compressed" in p.label and p.spec().endswith(":compressed") for p in comp)
    assert all("teacher" not in p.label for p in joint if p.teacher == "joint")
    only_joint = build_matrix(sample="ci", teachers=["joint"])
    assert {e.point.teacher for e in only_joint} == {"joint"}
    with pytest.raises(ValueError, match=r"teacher='softmax' is not supported \(valid: joint, compressed\)"):
        build_matrix(teachers=["softmax"])


def test_the_pallas_backend_runs_its_own_small_sample():
    """harness.problems.matrix.BACKENDS: ci 1 point (tiny float64 natively), default 32 (every case natively in one dtype, the sweep cases in every dtype
    and at the combined point in float32 and bfloat16, and ci's); joint teacher only; each
    point's native run is the XLA path at the same knobs."""
    pallas = {s: {e.point for e in build_matrix(sample=s, backends=["pallas"])} for s in SAMPLES}
    assert pallas["ci"] < pallas["default"] < pallas["full"]
    assert {p.spec() for p in pallas["ci"]} == {"tiny:float64:0:0:0:joint:pallas"}
    assert len(pallas["default"]) == 32 and {p.case for p in pallas["default"] if not p.chunked} == set(CASES)
    assert all(p.teacher == "joint" and p.native == dataclasses.replace(p, backend="xla") for p in pallas["full"])
    assert all(Point.parse(p.spec()) == p and "backend=pallas" in p.label for p in pallas["default"])
    assert {e.point.backend for e in build_matrix(sample="ci")} == {"xla"}  # the default
    assert {e.point.backend for e in build_matrix(sample="ci", backends=BACKENDS)} == {"xla", "pallas"}
    with pytest.raises(ValueError, match=r"backend='triton' is not supported \(valid: xla, pallas\)"):
        build_matrix(backends=["triton"])


def test_an_unknown_sample_is_one_clear_error():
    with pytest.raises(ValueError, match=r"sample='nightly' is not supported \(valid: ci, default, full, tpu\)"):
        build_matrix(sample="nightly")


def test_cli_refuses_an_unknown_sample_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", "--sample", "nightly"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'nightly'" in proc.stderr

"""The teacher of the loss is part of what a plug-in declares: an implementation of the
compressed teacher (MaxText 0.2.5's) that says so is judged on the compressed points only; one
that does not fails the joint check, and the diagnosis names the teacher stage."""

from __future__ import annotations

import pytest

from harness.points import Entry, Point
from harness.problems.cases import CASES
from harness.problems.matrix import COMPRESSED_CI, build_matrix
from harness.run.collect import evaluate

pytestmark = pytest.mark.torch

# teacher_gap: sinks spread over heads, so the two teachers differ by a wide margin.
JOINT = Point("teacher_gap", "float64")
COMPRESSED = Point("teacher_gap", "float64", teacher="compressed")


def test_an_undeclared_compressed_teacher_fails_the_joint_loss_naming_the_teacher():
    results = evaluate(Entry(JOINT, "dense", "loss", "plugins.compressed_teacher:undeclared"))
    failed = [r for r in results if r.failed]
    assert failed and failed[0].check == "exact64", [r.message for r in results]
    assert failed[0].stats["first_divergence"].startswith("first diverges at teacher"), failed[0].message


def test_a_declared_compressed_teacher_is_judged_on_its_own_points_only():
    impl = "plugins.compressed_teacher:declared"
    (joint,) = evaluate(Entry(JOINT, "dense", "loss", impl))
    assert joint.status == "not_provided", joint.message
    assert "computes the compressed teacher only" in joint.message
    for mode, quantity in (("dense", "loss"), ("sparse", "grad.indexer.wq_b")):
        results = evaluate(Entry(COMPRESSED, mode, quantity, impl))
        assert results and all(r.passed for r in results), [r.message for r in results]
    # the forward does not depend on the teacher: judged at the joint point as usual
    (keys,) = evaluate(Entry(JOINT, "forward", "compressed_keys", impl))
    assert keys.passed, keys.message


def test_jax_impl_computes_both_teachers_and_they_differ():
    """The same jax_impl, at the joint and the compressed point: both pass, and the compressed
    point is a point of its own (its id says so), not the joint one again."""
    joint = evaluate(Entry(JOINT, "dense", "loss"))
    compressed = evaluate(Entry(COMPRESSED, "dense", "loss"))
    assert all(r.passed for r in joint + compressed)
    assert Entry(COMPRESSED, "dense", "loss").id == "teacher_gap-float64-ichunk0-tchunk0-compressed-dense-loss"


def test_the_compressed_teacher_runs_dense_sparse_and_chunked_in_every_sample():
    for sample in ("ci", "default"):
        points = {e.point for e in build_matrix(sample=sample) if e.point.teacher == "compressed"}
        # ci leaves out the joint-teacher cases that differ only in what it does not read (COMPRESSED_CI)
        expected = set(CASES) if sample == "default" else {c for c, d in COMPRESSED_CI.items() if d}
        assert {p.case for p in points} == expected and len(expected) == {"ci": 16, "default": 21}[sample], sample
        assert any(p.chunked for p in points) and any(not p.chunked for p in points), sample
        modes = {e.mode for e in build_matrix(sample=sample) if e.point.teacher == "compressed"}
        assert modes == {"dense", "sparse"}, sample  # the forward is the joint points'

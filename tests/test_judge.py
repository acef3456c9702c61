"""The judge on arrays it is handed (no JAX, no torch): the statuses, one message
template per kind of check, partial plug-ins, and the reports counting every status."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from harness.judging.judge import judge
from harness.judging.tolerance import Policy
from harness.outputs import (EXCUSED, FAILED, NOT_APPLICABLE, NOT_PROVIDED, PASSED, STATUSES, Outputs,
                             References, output_name)
from harness.points import Entry, Point
from harness.problems.fixtures import load_case
from harness.problems.matrix import entries_at
from harness.run.regenerate import compare_topk
from harness.run.report import record, summarise
from harness.sides.implementations import Goldens, ProtocolImplementation


@pytest.fixture(scope="module")
def tiny():
    return load_case("tiny")


def _golden_outputs(fx, dtype):
    return Goldens().run(fx, Point("tiny", dtype))


def _refs(fx, dtype):
    return References(_golden_outputs(fx, "float64"), _golden_outputs(fx, dtype))


def _with(outputs, **changes):
    """A hand-made candidate from reference outputs; in float64 the oracle's own selection is
    the selection, so its sparse_at_oracle variant is its sparse one."""
    values = dict(outputs.values)
    values.update({k.replace("sparse", "sparse_at_oracle", 1): v for k, v in outputs.values.items()
                   if k.startswith(("loss.sparse", "grad.sparse.")) and k.replace("sparse", "sparse_at_oracle", 1)
                   not in values})
    values.update(changes)
    return Outputs("hand-made", values, outputs.missing)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_reference_judged_against_itself_passes(tiny, dtype):
    refs = _refs(tiny, dtype)
    cand = _with(refs.at_dtype, **{f"input_grad.{m}.q_latent": np.zeros((1, 16, 16)) for m in ("dense", "sparse")})
    for entry in entries_at(Point("tiny", dtype)):
        results = judge(entry, cand, refs, Policy())
        assert results and all(r.status in (PASSED, EXCUSED) for r in results), [r.message for r in results]


@pytest.mark.parametrize("name,dtype", [("tiny", "float64"), ("teacher_gap", "float64"),
                                        ("teacher_gap", "bfloat16")])
def test_each_teacher_passes_against_itself_and_fails_against_the_other(name, dtype):
    """Each teacher's goldens judged at its own point pass; the other teacher's, judged there,
    fail: every loss and gradient in float64 (the teachers differ by 1% on tiny, more on
    teacher_gap), and the losses in bfloat16 on teacher_gap, the case built for that gap
    (bfloat16's bound is wide enough to let 2 of its 12 gradients through)."""
    fx = load_case(name)
    joint, comp = Point(name, dtype), Point(name, dtype, teacher="compressed")
    refs = {p: References(Goldens().run(fx, dataclasses.replace(p, dtype="float64")), Goldens().run(fx, p))
            for p in (joint, comp)}
    zeros = {f"input_grad.{m}.q_latent": np.zeros(fx.inputs["q_latent"].shape) for m in ("dense", "sparse")}
    for p, other in ((joint, comp), (comp, joint)):
        own = _with(refs[p].at_dtype, **zeros)
        assert own["loss.dense"] != refs[other].at_dtype["loss.dense"]
        wrong = _with(refs[other].at_dtype, **zeros)
        for entry in entries_at(p, modes=["dense", "sparse"]):
            results = judge(entry, own, refs[p], Policy())
            assert results and all(r.status in (PASSED, EXCUSED) for r in results), [r.message for r in results]
            if entry.quantity == "input_grads" or (dtype != "float64" and entry.quantity != "loss"):
                continue
            results = judge(entry, wrong, refs[p], Policy())
            assert any(r.status == FAILED for r in results), (entry.id, [r.message for r in results])


def test_a_wrong_gradient_fails_with_the_close_template(tiny):
    refs = _refs(tiny, "float64")
    name = output_name("grad.indexer.wq_b", "dense")
    cand = _with(refs.oracle, **{name: refs.oracle[name] * 1.01})
    [r] = judge(Entry(Point("tiny", "float64"), "dense", "grad.indexer.wq_b"), cand, refs)
    assert r.status == FAILED and r.check == "exact64"
    assert r.message.startswith("[tiny float64 ichunk=0 tchunk=0 dense] grad.indexer.wq_b (exact64): MISMATCH: "
                                "mismatched elements:")
    assert "greatest normalised difference: 0.01" in r.message and "allowed; ratio" in r.message


def test_topk_and_isolation_messages_speak_their_own_terms(tiny):
    refs = _refs(tiny, "float64")
    picks = refs.oracle["topk_indices"].copy()
    picks[0, -1] = [3, 0]  # the last query picks block 0 instead of its own top pair
    bad = _with(refs.oracle, topk_indices=picks, **{"input_grad.dense.q_latent": np.full((1, 16, 16), 1e-9)})
    [topk] = judge(Entry(Point("tiny", "float64"), "forward", "topk_indices"), bad, refs)
    [iso] = judge(Entry(Point("tiny", "float64"), "dense", "input_grads"), bad, refs)
    for r in (topk, iso):
        assert r.status == FAILED
        assert "greatest normalised difference" not in r.message and "ratio inf" not in r.message, r.message
    assert "queries pick other blocks beyond a boundary tie" in topk.message
    assert "first at (b, s) = (0, 15): candidate picks" in topk.message
    assert "256 of 256 input-gradient elements are not exactly 0; largest |1e-09| at index (0, 0, 0) " \
           "(in d loss / d q_latent)" in iso.message
    # a sparse entry whose own selection is not the oracle's fails end to end in top-k terms
    sparse = judge(Entry(Point("tiny", "float64"), "sparse", "loss"), bad, refs)
    assert [r.status for r in sparse] == [PASSED, FAILED]
    assert "queries pick other blocks" in sparse[1].message and "ratio inf" not in sparse[1].message


def test_a_forward_only_plugin_provides_no_loss(tiny):
    """A plug-in may leave out an entry point: its quantities are `not_provided`, never failed."""
    def indexer_forward(params, inputs, cfg, dtype):
        g = tiny.goldens[dtype]
        return {q: g[q] for q in ("compressed_keys", "index_scores", "topk_indices")}

    api = types.SimpleNamespace(CSAConfig=types.SimpleNamespace(from_dict=dict), indexer_forward=indexer_forward,
                                NOT_PROVIDED={"compressed_keys": "keys stay on the device in this kernel"})
    impl = ProtocolImplementation("forward_only", api)
    out = impl.run(tiny, Point("tiny", "float64"))
    refs = _refs(tiny, "float64")
    by_quantity = {e.quantity + "/" + e.mode: judge(e, out, refs) for e in entries_at(Point("tiny", "float64"))}
    assert [r.status for r in by_quantity["index_scores/forward"]] == [PASSED]
    [keys] = by_quantity["compressed_keys/forward"]
    assert keys.status == NOT_PROVIDED and "keys stay on the device" in keys.message
    [loss] = by_quantity["loss/dense"]
    assert loss.status == NOT_PROVIDED and loss.message.endswith("not provided: forward_only has no "
                                                                 "indexer_loss_and_grads")
    sparse = by_quantity["grad.indexer.wkv/sparse"]
    assert {r.status for r in sparse} == {NOT_PROVIDED} and len(sparse) == 2


def test_not_applicable_and_every_status_is_counted(tiny):
    refs = _refs(tiny, "float32")
    na = Outputs("jax", not_applicable="not applicable on tpu: float64 is emulated")
    entry = Entry(Point("tiny", "float32"), "dense", "loss")
    [r] = judge(entry, na, refs)
    assert r.status == NOT_APPLICABLE and r.message.endswith("not applicable: not applicable on tpu: float64 is emulated")
    good = _with(refs.at_dtype)
    records = [record(entry, r)]
    for e in entries_at(Point("tiny", "float32"), modes=["forward", "sparse"]):
        records += [record(e, x) for x in judge(e, good, refs)]
    counts = summarise(records)["statuses"]
    assert list(counts) == list(STATUSES)
    assert counts[NOT_APPLICABLE] == 1 and counts[NOT_PROVIDED] >= 1 and counts[PASSED] > 0
    assert summarise(records)["failed"] == counts[FAILED] == 0


def test_the_report_keeps_the_compressed_teacher_in_rows_of_its_own(tiny):
    from harness.run.report import table

    records = []
    for teacher in ("joint", "compressed"):
        p = Point("tiny", "float32", teacher=teacher)
        refs = References(Goldens().run(tiny, dataclasses.replace(p, dtype="float64")), Goldens().run(tiny, p))
        for e in entries_at(p, modes=["dense"]):
            records += [record(e, r) for r in judge(e, _with(refs.at_dtype), refs)]
    assert {r["teacher"] for r in records} == {"joint", "compressed"}
    _, rows = table(records)
    assert sorted(row[:2] for row in rows) == [["tiny", "float32"], ["tiny (compressed)", "float32"]]


def test_fixture_check_uses_the_one_tie_rule():
    scores = np.array([[[0.9, 0.5, 0.3, 0.3 + 1e-9, 0.1]]])
    committed = np.array([[[0, 1, 2]]])
    assert compare_topk(committed, np.array([[[0, 1, 3]]]), scores, 1e-6) is None  # a tie: excused
    msg = compare_topk(committed, np.array([[[0, 1, 4]]]), scores, 1e-6)
    assert msg == "1 pick(s) differ beyond a boundary tie (0 excused); first at (b, s) = (0, 0): " \
                  "regenerated [0, 1, 4], committed [0, 1, 2]"

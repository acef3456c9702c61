"""The case catalogue (harness/problems/cases.py): each required case exists and exercises what its name
says, every config validates on both sides, and make_inputs is deterministic."""

from __future__ import annotations

import numpy as np
import pytest

import jax_impl
from harness.problems.cases import (CASES, INPUT_NAMES, KNOB_FIELDS, PARAM_NAMES, PROBLEM_FIELDS, TEACHERS, V4_YARN,
                                    Case, full_config, get_case, layout, make_inputs)

REQUIRED = ("tiny", "small", "packed", "ragged", "no_blocks", "topk_wide", "ties", "flash_dims",
            "window_only", "sink_only", "window_one", "window_wide", "window_heavy", "teacher_gap",
            "yarn_tail")


def test_required_cases_present():
    assert set(REQUIRED) <= set(CASES)
    for case in CASES.values():
        assert case.exercises.strip(), case.name


@pytest.mark.torch
@pytest.mark.parametrize("name", list(CASES))
def test_config_is_complete_and_validates_on_both_sides(name):
    import torch_ref

    case = CASES[name]
    cfg = case.config_dict()
    assert list(cfg) == [f for f, _ in PROBLEM_FIELDS]  # the problem only: no run-time knob
    assert not set(KNOB_FIELDS) & set(cfg)
    for side in (jax_impl, torch_ref):
        full = side.CSAConfig.from_dict(cfg).to_dict()  # knobs at their defaults
        assert {k: full[k] for k in cfg} == cfg
        assert {k: full[k] for k in KNOB_FIELDS} == {"indexer_head_chunk": 0, "loss_head_chunk": 0,
                                                     "query_chunk": 0, "sparse_loss": False,
                                                     "teacher_normaliser": "joint"}


def test_case_shapes():
    tiny = CASES["tiny"]
    assert (tiny.batch, tiny.seq_len) == (1, 16)
    assert tiny.num_blocks > 0 and tiny.config["index_topk"] < tiny.num_blocks

    small = CASES["small"]
    assert (small.batch, small.seq_len) == (2, 64)
    assert {k: small.config[k] for k in ("emb_dim", "q_lora_rank", "index_n_heads",
                                         "index_head_dim", "rope_head_dim", "compress_ratio",
                                         "index_topk", "num_query_heads", "head_dim")} == dict(
        emb_dim=64, q_lora_rank=32, index_n_heads=8, index_head_dim=32, rope_head_dim=16,
        compress_ratio=4, index_topk=4, num_query_heads=8, head_dim=32)

    ragged = CASES["ragged"]
    assert ragged.seq_len % ragged.config["compress_ratio"] != 0
    assert CASES["no_blocks"].num_blocks == 0

    wide = CASES["topk_wide"]
    assert wide.config["index_topk"] >= wide.num_blocks

    flash = CASES["flash_dims"].config
    assert (flash["index_n_heads"], flash["index_head_dim"], flash["rope_head_dim"],
            flash["compress_ratio"]) == (64, 128, 64, 4)


def test_joint_teacher_cases_exercise_what_their_names_say():
    """SPEC section 8's teacher: each case holds the window, sink and RoPE its name promises."""
    def sink(name):
        return make_inputs(CASES[name])[0]["attention_sink"]

    def window(name):
        return CASES[name].config["sliding_window"]

    assert window("window_only") > 0 and (sink("window_only") == -np.inf).all()
    assert window("sink_only") == 0 and np.isfinite(sink("sink_only")).all()
    assert window("window_one") == 1
    assert window("window_wide") >= CASES["window_wide"].seq_len
    heavy, plain = make_inputs(CASES["window_heavy"])[0], make_inputs(CASES["window_one"])[0]
    assert heavy["teacher_window_kv"].std() > 3 * plain["teacher_window_kv"].std()
    assert sink("window_heavy").mean() > 1
    assert 1 < window("teacher_gap") < CASES["teacher_gap"].seq_len
    assert sink("teacher_gap").max() - sink("teacher_gap").min() > 4  # heads far apart
    # Both teachers' goldens on every case: each teacher applies to every problem.
    assert all(c.teachers == TEACHERS for c in CASES.values())
    assert all(c.teachers[0] == "joint" for c in CASES.values())
    yarn = CASES["yarn_tail"]
    assert dict(yarn.config["rope_scaling"]) == V4_YARN == {
        "type": "yarn", "factor": 16, "original_max_position": 65536, "beta_fast": 32, "beta_slow": 1}
    pos = make_inputs(yarn)[0]["position_ids"]
    assert pos.min() > V4_YARN["original_max_position"] and yarn.config["rope_head_dim"] == 64
    assert CASES["flash_dims"].config["sliding_window"] == 128  # the released model's window
    assert dict(CASES["flash_dims"].config["rope_scaling"]) == V4_YARN
    # packed's window reaches back over its document boundaries
    packed = CASES["packed"]
    assert window("packed") > min(min(row) for row in packed.documents)


def test_packed_layout():
    case = CASES["packed"]
    inputs, _ = make_inputs(case)
    pos, seg = inputs["position_ids"], inputs["segment_ids"]
    m = case.config["compress_ratio"]
    straddling = 0
    for b in range(case.batch):
        docs = np.unique(seg[b])
        assert 2 <= len(docs) <= 3
        lengths = [int((seg[b] == d).sum()) for d in docs]
        assert len(set(lengths)) == len(lengths), "documents of unequal length"
        for d in docs:  # positions restart at 0 in each document
            assert np.array_equal(pos[b][seg[b] == d], np.arange((seg[b] == d).sum()))
        blocks = seg[b, : case.num_blocks * m].reshape(-1, m)
        straddling += int(np.sum(blocks.min(1) != blocks.max(1)))
    assert straddling >= 1


def test_make_inputs_is_deterministic_and_typed():
    for case in CASES.values():
        (i1, p1), (i2, p2) = make_inputs(case), make_inputs(case)
        assert list(i1) == list(INPUT_NAMES) and list(p1) == list(PARAM_NAMES)
        for k in i1:
            assert i1[k].tobytes() == i2[k].tobytes(), (case.name, k)
            want = "int32" if k in ("position_ids", "segment_ids") else "float32"
            assert i1[k].dtype == want
        for k in p1:
            assert p1[k].tobytes() == p2[k].tobytes() and p1[k].dtype == np.float32


def test_ties_are_built_as_twins():
    case = CASES["ties"]
    inputs, params = make_inputs(case)
    m, DI = case.config["compress_ratio"], case.config["index_head_dim"]
    assert case.config["rope_head_dim"] == 0
    assert np.all(params["indexer.ape"][:, :DI] < -9000)  # a-slots silenced
    x, kv = inputs["hidden_states"], inputs["teacher_kv"]
    for b, labels in enumerate(case.tied_blocks):
        for w, lab in enumerate(labels):
            twin = labels.index(lab)
            assert np.array_equal(x[b, w * m:(w + 1) * m], x[b, twin * m:(twin + 1) * m])
            assert np.array_equal(kv[b, w], kv[b, twin])


def test_bad_entries_are_refused():
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        get_case("nope")
    with pytest.raises(ValueError, match="missing config field 'emb_dim'"):
        Case("x", {}, batch=1, seq_len=4, seed=0, exercises="-")
    with pytest.raises(ValueError, match="indexer_head_chunk=2 is a run-time knob, set per matrix point"):
        full_config(**{**CASES["small"].config, "indexer_head_chunk": 2})
    with pytest.raises(ValueError, match="query_chunk=5 is a run-time knob, set per matrix point"):
        full_config(**{**CASES["small"].config, "query_chunk": 5})
    assert full_config(**{**CASES["small"].config, "sparse_loss": False}) == dict(CASES["small"].config)
    with pytest.raises(ValueError, match="teacher_normaliser='compressed' is a run-time knob"):
        full_config(**{**CASES["small"].config, "teacher_normaliser": "compressed"})
    assert full_config(**{**CASES["small"].config, "teacher_normaliser": "joint"}) == dict(CASES["small"].config)
    with pytest.raises(ValueError, match="teachers=\\('compressed',\\) must hold 'joint'"):
        Case("x", CASES["small"].config, batch=1, seq_len=8, seed=0, exercises="-", teachers=("compressed",))
    with pytest.raises(ValueError, match="must hold 'joint' and only joint, compressed"):
        Case("x", CASES["small"].config, batch=1, seq_len=8, seed=0, exercises="-", teachers=("joint", "dense"))
    # position_offset starts every document's positions (a packed row of long documents' tails)
    pos, seg = layout(Case("x", CASES["small"].config, batch=1, seq_len=8, seed=0, exercises="-",
                           documents=((4, 4),), position_offset=10))
    assert pos.tolist() == [[10, 11, 12, 13, 10, 11, 12, 13]] and seg.tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]
    with pytest.raises(ValueError, match="documents must give 1 rows"):
        Case("x", CASES["small"].config, batch=1, seq_len=8, seed=0, exercises="-",
             documents=((3, 3),))

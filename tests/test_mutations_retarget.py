"""The mutation self-test retargeted to a dtype a TPU computes (`python -m harness.selftest.mutations
--dtype float32`): which mutants move, how their slices and expected checks move, and which are
left out and why. Pure data, no mutant runs here (~0.1 s); the run itself is in docs/platforms.md."""

from __future__ import annotations

from harness.selftest.mutations import CATALOGUE, retarget


def test_float64_slices_move_to_the_dtype_and_exact64_to_the_oracle_rule():
    moved, left_out = retarget(CATALOGUE, "float32")
    assert len(moved) + len(left_out) == len(CATALOGUE)
    assert all(p.dtype != "float64" for m in moved for p in m.points)
    assert all("exact64" not in c for m in moved for c in m.killed_by)
    by_name = {m.name: m for m in moved}
    assert by_name["rope_wrong_theta"].killed_by == ("oracle",)
    assert by_name["chunk_accumulate_low_dtype"].points == next(
        m for m in CATALOGUE if m.name == "chunk_accumulate_low_dtype").points  # already bfloat16: unchanged
    why = dict(left_out)
    assert set(why.values()) <= {"its pinned random problems run live against torch",
                                 "its memory check reads the CPU's compiled memory",
                                 "its kernel check is the Pallas kernels'",
                                 "its slice runs on simulated devices", "its slice is on the Pallas backend"}
    assert all(not (m.problems or m.memory or m.kernel) for m in moved)

"""The logic of the context-parallel benchmark that can be wrong without a compile: reading
collectives out of HLO text (benchmarks.collectives: the loops they sit in, their trip counts,
replica groups, the bytes each moves, a combined op's sources), attributing them
(benchmarks.context_parallel.category / comm_table), the communication model at a hand-worked
point, and results.json keeping the keys another benchmark wrote. Pure text and arithmetic."""

from __future__ import annotations

import json

from benchmarks import context_parallel as cp
from benchmarks.collectives import collectives, loop_all_reduces, replica_groups

MIB = 2**20

# A hand-written optimized module: an outer loop (5 trips) whose body runs an inner loop (3
# trips, an all-reduce over 4 devices inside) and calls a helper holding an all-gather; at the
# top, a combined all-reduce of the loss and a parameter gradient, a reduce-scatter, a halo
# ppermute and an all-reduce over groups of one device.
HLO = """HloModule jit_f, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %v = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %ar = f32[4,8]{1,0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/shard_map/rows_loss/while/body/psum_invariant"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ar)
}

%inner_cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%helper (q: f32[2,2]) -> f32[8,2] {
  %q = f32[2,2]{1,0} parameter(0)
  ROOT %ag = f32[8,2]{1,0} all-gather(%q), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/jvp()/shard_map/keys/keys_gather/all_gather"}
}

%outer_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %w = (s32[], f32[4,8]{1,0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %h = f32[8,2]{1,0} call(%z), to_apply=%helper
  ROOT %r = (s32[], f32[4,8]{1,0}) tuple(%i, %v)
}

%outer_cond (p: (s32[], f32[4,8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main.1 (a: f32[], b: f32[16]) -> f32[] {
  %w0 = (s32[], f32[4,8]{1,0}) while(%t0), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %ar2 = (f32[], f32[16]{0}) all-reduce(%a, %b), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/(jvp()/shard_map/rows_loss/psum_invariant:transpose(jvp())/shard_map/params/psum_invariant)"}
  %rs = f32[2,4]{1,0} reduce-scatter(%g), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/shard_map/keys/keys_gather/reduce_scatter"}
  %cp = f32[4,8]{1,0} collective-permute(%h), channel_id=5, source_target_pairs={{0,1},{1,2}}, metadata={op_name="jit(f)/jvp()/shard_map/keys/pool_halo/ppermute"}
  %cpt = f32[4,8]{1,0} collective-permute(%h), channel_id=6, source_target_pairs={{1,0},{2,1}}, metadata={op_name="jit(f)/transpose(jvp())/shard_map/keys/pool_halo/ppermute"}
  ROOT %triv = f32[4]{0} all-reduce(%i), channel_id=7, replica_groups={{0},{1}}, to_apply=%add
}
"""


def _by_name():
    return {c.name: c for c in collectives(HLO)}


def test_loops_trip_counts_and_bytes():
    c = _by_name()
    assert set(c) == {"ar", "ag", "ar2", "rs", "cp", "cpt", "triv"}  # not the while, call or add
    # Inside both loops: 5 x 3 executions; 2 (G-1)/G of 128 bytes each.
    assert (c["ar"].in_loop, c["ar"].trips, c["ar"].group, c["ar"].moved) == (True, 15, 4, 192)
    assert c["ar"].per_step == 15 * 192
    # Called (not looped) from the outer body: inside a loop, 5 executions; (G-1)/G of its result.
    assert (c["ag"].in_loop, c["ag"].trips, c["ag"].group, c["ag"].moved) == (True, 5, 4, 48)
    # At the top: once each.
    assert (c["ar2"].in_loop, c["ar2"].trips, c["ar2"].result_bytes, c["ar2"].moved) == (False, 1, 68, 119)
    assert (c["rs"].group, c["rs"].moved) == (4, 3 * 32)  # (G-1) x its shard
    assert (c["cp"].moved, c["triv"].moved) == (128, 0)  # what it sends; a group of one moves nothing


def test_a_combined_op_names_each_element():
    c = _by_name()
    assert c["ar2"].element_bytes == (4, 64)
    assert c["ar2"].sources == ("jit(f)/jvp()/shard_map/rows_loss/psum_invariant",
                                "jit(f)/transpose(jvp())/shard_map/params/psum_invariant")
    assert c["rs"].sources == (c["rs"].op_name,)


def test_replica_groups_both_forms():
    assert replica_groups("replica_groups={{0,2},{1,3}}, x") == ((0, 2), (1, 3))
    assert replica_groups("replica_groups=[2,4]<=[8], dims") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), d") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_groups("channel_id=1") == ()


def test_loop_all_reduces_allows_only_the_named_groups():
    assert [c.name for c in loop_all_reduces(HLO)] == ["ar"]
    assert loop_all_reduces(HLO, [(0, 1, 2, 3)]) == []
    assert [c.name for c in loop_all_reduces(HLO, [(0, 1), (2, 3)])] == ["ar"]


def test_comm_table_attributes_every_byte():
    t = cp.comm_table(HLO)
    assert t["loss sum and count"]["bytes"] == 7 and t["parameter gradients all-reduce"]["bytes"] == 112
    assert t["keys reduce-scatter"]["bytes"] == 96 and t["keys all-gather"]["bytes"] == 5 * 48
    assert t["keys all-gather"]["inside_loops"] == 5 * 48
    assert t["pooling halo"]["bytes"] == 128 and t["pooling halo cotangent"]["bytes"] == 128
    assert t["all-reduce inside loops"] == {"bytes": 15 * 192, "inside_loops": 15 * 192, "ops": 1}
    assert t["other"]["bytes"] == 0


def test_comm_model_at_a_hand_worked_point():
    """S = 1M, P = 8, the benchmark's config (float32, W = 262144, DI = D = 128, m = 4, window 128)."""
    m = cp.comm_model(cp.cp_config(), 1, 2**20, 8)
    assert m["keys all-gather"] == m["keys reduce-scatter"] == m["teacher_kv all-gather"] == 112 * MIB
    assert m["validity all-gather"] == 7 / 8 * 262144 * 9
    assert m["pooling halo"] == 4 * 128 * 8 + 4 and m["window halo"] == 127 * (128 * 4 + 4)
    assert all(v == 0 for v in cp.comm_model(cp.cp_config(), 1, 2**20, 1).values())


def test_working_set_at_the_bound_point_term_by_term():
    """S = 1M, P = 8 at the benchmark's r = 64: A = r W float32 = 64 MiB; the query block (4.25 + 2)
    A; the keys and their cotangent 2 W DI x 4 B; teacher_kv W D x 4 B; the compressor 4 L 2 DI x 4 B."""
    ws = cp.working_set(cp.cp_config(), 1, 2**20, 8)
    assert cp.QUERY_CHUNK == 64 and ws["query block"] == 6.25 * 64 * MIB
    assert (ws["keys"], ws["teacher_kv"], ws["compressor"]) == (256 * MIB, 128 * MIB, 512 * MIB)
    assert ws["total"] == sum(v for k, v in ws.items() if k != "total")


def test_the_temp_bound_and_the_r_fit():
    def row(seq, p, temp):
        return {"seq": seq, "p": p, "memory": {"temp": temp, "ynn_scratch": 0}}

    seq, p = cp.TEMP_POINT
    assert cp.temp_bound([row(131072, 8, 1)]) is None  # --quick: not compiled, not passed
    assert cp.temp_bound([row(seq, p, cp.TEMP_BOUND)])["ok"]
    assert not cp.temp_bound([row(seq, p, cp.TEMP_BOUND + 1)])["ok"]
    sweep = [{"query_chunk": r, "memory": {"temp": 100 + 3 * r}, "model": {"query block": 2 * r, "total": 50 + 2 * r}}
             for r in (512, 64)]
    assert cp.r_fit(sweep) == {"per_row": 3, "fixed": 100, "model_per_row": 2, "model_fixed": 50}
    assert cp.r_fit(sweep[:1]) is None


def test_results_keep_the_other_benchmarks_keys(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": [1], "query_rows": [2], cp.KEY: {"old": True}}))
    cp.write_results(str(path), {"rows": [3]})
    assert json.loads(path.read_text()) == {"rows": [1], "query_rows": [2], cp.KEY: {"rows": [3]}}

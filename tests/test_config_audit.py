"""Config-field audit: every field of SPEC section 1 must take every value class that
changes a code path somewhere in the suite, or a mistake that only another value reveals goes
through green (the mutants of harness/selftest/mutations.py marked `problems=` are such mistakes).

Where the values come from:
- the committed cases (harness/problems/cases.py): their configs, with the chunk knobs of every point
  of the parity matrix (harness.problems.matrix.chunk_points, every dtype: not the fixture files) and
  both loss modes (the matrix runs dense and sparse at every point);
- the pinned random problems (harness.problems.random_configs.PINNED), which run in every profile of
  tests/test_random_configs.py, each at its own knobs and natively (chunk knobs 0).
The hypothesis draws are not counted: they change with the profile; the pinned problems do not.

A value counts only where the field can change a result: nothing does when W = 0 (every
output empty) except the shape fields, and rope_theta needs rope_head_dim >= 4 (with DR = 2
the one frequency is theta**0 = 1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import jax_impl
from harness.outputs import MODES
from harness.points import DTYPES
from harness.problems.cases import CASES
from harness.problems.matrix import BACKENDS, build_matrix, chunk_points, compressed_points
from harness.problems.random_configs import CHUNK_KNOBS, PINNED, config_fields

import numpy as np

# SPEC section 1's fields, in the table's order.
SPEC_FIELDS = ("emb_dim", "q_lora_rank", "index_n_heads", "index_head_dim", "rope_head_dim",
               "compress_ratio", "index_topk", "rope_theta", "norm_eps", "num_query_heads", "head_dim",
               "indexer_head_chunk", "loss_head_chunk", "query_chunk", "sparse_loss", "loss_scale",
               "sliding_window", "teacher_normaliser", "rope_scaling", "index_quant")

DEFAULT_THETA, DEFAULT_EPS = 160000.0, 1e-6

# Config fields that are not SPEC section 1's math but a choice of code: jax_impl validates and
# reads them, torch_ref accepts (same message on a bad value) and ignores them. Each value must
# run somewhere in the parity matrix (harness.points.Point.backend).
IMPLEMENTATION_FIELDS = {"scoring_backend": {"xla", "pallas"}}
# jax_impl's alone, not a choice of math and with no counterpart in a plain reference: the narrowest
# key window of the query-blocked path (docs/design.md "Key windows"). The matrix's widths are all
# below it, so it runs at length (the long samples) and in tests/test_query_chunk.py's window tests.
JAX_ONLY_FIELDS = {"key_window"}


def _heads(n: int) -> str:
    if n == 1:
        return "1"
    return "prime" if all(n % d for d in range(2, int(n**0.5) + 1)) else "composite"


def _chunk(c: int, n: int) -> set[str]:
    if c == 0:
        return {"0 (native)"}
    out = set()
    if c == 1:
        out.add("1")
    if c == n:
        out.add("all heads")
    if 1 < c < n:
        out.add("strictly between 1 and the head count")
    return out


def _window(c, s: int) -> set[str]:
    """The window's value class; it matters only to the joint teacher."""
    if c.get("teacher_normaliser", "joint") != "joint":
        return set()
    n = c["sliding_window"]
    return {"0" if n == 0 else "1" if n == 1 else ">= S" if n >= s else "between 1 and S"}


def _quant(c) -> set[str]:
    """The quantizer's value classes: off, each format, rotated or not, one block per head or
    several (SPEC section 7a)."""
    q = c.get("index_quant")
    if q is None:
        return {"null"}
    return {q["format"], "rotated" if q["hadamard"] else "unrotated",
            "block == index_head_dim" if q["block"] == c["index_head_dim"] else "block < index_head_dim"}


def _query_chunk(r: int, s: int) -> set[str]:
    if r == 0:
        return {"0 (all rows)"}
    out = {"1"} if r == 1 else set()
    out.add(">= S" if r >= s else ("divides S" if s % r == 0 else "does not divide S"))
    return out


# field -> (every value class required, classes of one instance (cfg, S, W))
AUDIT = {
    "emb_dim": ({"1", "> 1"}, lambda c, s, w: {"1" if c["emb_dim"] == 1 else "> 1"}),
    "q_lora_rank": ({"1", "> 1"}, lambda c, s, w: {"1" if c["q_lora_rank"] == 1 else "> 1"}),
    "index_n_heads": ({"1", "prime", "composite"}, lambda c, s, w: {_heads(c["index_n_heads"])}),
    "index_head_dim": ({"== rope_head_dim", "> rope_head_dim"},
                       lambda c, s, w: {"== rope_head_dim" if c["index_head_dim"] == c["rope_head_dim"]
                                        else "> rope_head_dim"}),
    "rope_head_dim": ({"0", "between 0 and index_head_dim", "== index_head_dim"},
                      lambda c, s, w: {"0" if c["rope_head_dim"] == 0 else
                                       "== index_head_dim" if c["rope_head_dim"] == c["index_head_dim"]
                                       else "between 0 and index_head_dim"}),
    "compress_ratio": ({"1", "4", "other > 1", "S not a multiple of m", "S < m (W = 0)"},
                       lambda c, s, w: {{1: "1", 4: "4"}.get(c["compress_ratio"], "other > 1")}
                       | ({"S not a multiple of m"} if s % c["compress_ratio"] else set())
                       | ({"S < m (W = 0)"} if w == 0 else set())),
    "index_topk": ({"1", "between 1 and W", ">= W"},
                   lambda c, s, w: set() if w == 0 else
                   ({"1"} if c["index_topk"] == 1 else set())
                   | ({">= W"} if c["index_topk"] >= w else {"between 1 and W"} if c["index_topk"] > 1 else set())),
    "rope_theta": ({"160000 (default)", "other float32 number", "not a float32 number"},
                   lambda c, s, w: set() if w == 0 or c["rope_head_dim"] < 4 else
                   {"160000 (default)" if c["rope_theta"] == DEFAULT_THETA else
                    "other float32 number" if float(np.float32(c["rope_theta"])) == c["rope_theta"]
                    else "not a float32 number"}),
    "norm_eps": ({"1e-6 (default)", "other"},
                 lambda c, s, w: set() if w == 0 else {"1e-6 (default)" if c["norm_eps"] == DEFAULT_EPS else "other"}),
    "num_query_heads": ({"1", "prime", "composite"}, lambda c, s, w: {_heads(c["num_query_heads"])}),
    "head_dim": ({"== index_head_dim", "!= index_head_dim"},
                 lambda c, s, w: {"== index_head_dim" if c["head_dim"] == c["index_head_dim"] else "!= index_head_dim"}),
    "indexer_head_chunk": ({"0 (native)", "1", "strictly between 1 and the head count", "all heads"},
                           lambda c, s, w: set() if w == 0 else _chunk(c["indexer_head_chunk"], c["index_n_heads"])),
    "loss_head_chunk": ({"0 (native)", "1", "strictly between 1 and the head count", "all heads"},
                        lambda c, s, w: set() if w == 0 else _chunk(c["loss_head_chunk"], c["num_query_heads"])),
    "query_chunk": ({"0 (all rows)", "1", "divides S", "does not divide S", ">= S"},
                    lambda c, s, w: set() if w == 0 else _query_chunk(c.get("query_chunk", 0), s)),
    "sparse_loss": ({"False", "True"}, lambda c, s, w: set() if w == 0 else {str(c["sparse_loss"])}),
    "sliding_window": ({"0", "1", "between 1 and S", ">= S"},
                       lambda c, s, w: set() if w == 0 else _window(c, s)),
    "teacher_normaliser": ({"joint", "compressed"},
                           lambda c, s, w: set() if w == 0 else {c.get("teacher_normaliser", "joint")}),
    "rope_scaling": ({"null", "yarn"},
                     lambda c, s, w: set() if w == 0 or c["rope_head_dim"] < 4 else
                     {"null" if c["rope_scaling"] is None else c["rope_scaling"]["type"]}),
    "index_quant": ({"null", "e2m1", "e4m3", "rotated", "unrotated", "block == index_head_dim",
                     "block < index_head_dim"},
                    lambda c, s, w: set() if w == 0 else _quant(c)),
    "loss_scale": ({"1", "positive, not 1", "negative"},
                   lambda c, s, w: set() if w == 0 else
                   {"1" if c["loss_scale"] == 1 else "positive, not 1" if c["loss_scale"] > 0 else "negative"}),
}


def committed_instances():
    """(source, cfg, S, W) of every matrix point of every committed case (both loss modes, and
    both teachers where the case holds the compressed one's goldens)."""
    for case in CASES.values():
        for teacher in case.teachers:
            sampled = chunk_points if teacher == "joint" else compressed_points
            points = sorted({p for dt in DTYPES for p in sampled(case.name, dt)})
            for ichunk, tchunk, qchunk in points:
                for sparse in (False, True):
                    cfg = dict(case.config, indexer_head_chunk=ichunk, loss_head_chunk=tchunk, query_chunk=qchunk,
                               sparse_loss=sparse, teacher_normaliser=teacher)
                    yield f"case {case.name}", cfg, case.seq_len, case.num_blocks


def pinned_instances():
    for name, p in PINNED.items():
        yield f"pinned {name}", p.config, p.seq_len, p.num_blocks
        if p.chunked:
            yield f"pinned {name} (native)", p.native_config(), p.seq_len, p.num_blocks


def seen_classes(field: str, instances) -> dict[str, list[str]]:
    """value class -> the sources that give it."""
    seen: dict[str, list[str]] = {}
    for source, cfg, s, w in instances:
        for cls in AUDIT[field][1](cfg, s, w):
            seen.setdefault(cls, []).append(source)
    return seen


def test_the_audit_walks_every_config_field():
    """SPEC_FIELDS is SPEC section 1 (when the SPEC is at hand) and covers every CSAConfig field."""
    assert set(AUDIT) == set(SPEC_FIELDS)
    assert ({f.name for f in dataclasses.fields(jax_impl.CSAConfig)}
            <= set(SPEC_FIELDS) | set(IMPLEMENTATION_FIELDS) | JAX_ONLY_FIELDS)
    spec = Path(__file__).resolve().parents[1].parent / "shared" / "SPEC.md"
    if spec.is_file():
        text = spec.read_text().split("## 1. Configuration", 1)[1].split("\n## ", 1)[0]
        rows = [ln.split("|")[1].strip() for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
        names = [n.strip() for row in rows[1:] for n in row.split(",")]
        assert tuple(names) == SPEC_FIELDS, names
    assert set(CHUNK_KNOBS) <= set(SPEC_FIELDS)


@pytest.mark.parametrize("field", SPEC_FIELDS)
def test_every_value_class_of_the_field_is_exercised(field):
    required = AUDIT[field][0]
    if field not in config_fields():
        pytest.skip(f"{field}: NOT YET IMPLEMENTED, not a CSAConfig field on both sides; "
                    f"once it exists the audit requires {sorted(required)} and the random "
                    "tests draw it (tests/test_random_configs.py)")
    seen = seen_classes(field, [*committed_instances(), *pinned_instances()])
    missing = sorted(required - set(seen))
    assert not missing, (
        f"{field}: value class(es) {missing} never exercised; seen: "
        + "; ".join(f"{cls} ({', '.join(sorted(set(src))[:3])})" for cls, src in sorted(seen.items()))
        + ". Add a pinned problem (harness/problems/random_configs.py) or a catalogue case.")


def test_the_committed_cases_alone_leave_fields_at_one_value_class():
    """Why the pinned problems exist, and proof the audit can fail: on the catalogue and the
    matrix alone, these fields take a single value class, and the audit reports what is missing."""
    single = {f for f in SPEC_FIELDS if f in config_fields() and len(seen_classes(f, committed_instances())) <= 1}
    # index_head_dim and head_dim take two classes here: yarn_tail has DI == DR, the joint
    # teacher's cases have D != DI.
    assert single == {"emb_dim", "q_lora_rank", "rope_theta", "norm_eps", "loss_scale"}
    # The joint teacher's cases give every window class and both teachers and RoPEs.
    assert set(seen_classes("sliding_window", committed_instances())) == AUDIT["sliding_window"][0]
    assert set(seen_classes("teacher_normaliser", committed_instances())) == {"joint", "compressed"}
    assert set(seen_classes("rope_scaling", committed_instances())) == {"null", "yarn"}
    seen = seen_classes("compress_ratio", committed_instances())
    assert set(seen) == {"4", "S not a multiple of m", "S < m (W = 0)"}  # no m = 1, no m != 4
    assert set(seen_classes("index_topk", committed_instances())) == {"between 1 and W", ">= W"}  # no k = 1


def test_every_value_of_an_implementation_field_runs_in_the_matrix():
    assert set(IMPLEMENTATION_FIELDS) <= set(config_fields())  # both sides accept them
    for sample in ("ci", "default"):
        points = build_matrix(sample=sample, backends=BACKENDS)  # as tests/test_parity_matrix.py runs it
        assert {e.point.backend for e in points} == IMPLEMENTATION_FIELDS["scoring_backend"]

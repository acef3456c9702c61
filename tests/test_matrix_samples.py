"""The matrix's samples (harness/matrix.py): the `ci` sample that `make test` and
`make test312` run is a subset of the default sample that still holds every case in every dtype natively, the
combined chunk point of every case (one narrow and one wide dtype), and every value class of
every chunk knob on each sweep case. Cheap: no JAX, no compilation."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from harness.cases import CASES
from harness.matrix import DTYPES, SAMPLES, SWEEP_CASES, build_matrix, chunk_points, combined_pair, query_chunk_sizes

NARROW, WIDE = ("bfloat16", "float16"), ("float32", "float64")


def _points(sample):
    return {e.point for e in build_matrix(sample=sample)}


def test_ci_is_a_subset_of_default_and_default_of_full():
    ci, default, full = (set((e.point, e.mode, e.quantity) for e in build_matrix(sample=s)) for s in SAMPLES)
    assert ci < default < full


def test_ci_runs_every_case_in_every_dtype_natively():
    native = {(p.case, p.dtype) for p in _points("ci") if not p.chunked}
    assert native == {(c, d) for c in CASES for d in DTYPES}


def test_ci_holds_the_combined_point_of_every_case_in_a_narrow_and_a_wide_dtype():
    per_dtype = Counter()
    for case in CASES:
        combined = (*combined_pair(case), query_chunk_sizes(CASES[case].seq_len)[1])
        dtypes = {d for d in DTYPES if combined in chunk_points(case, d, "ci")}
        assert dtypes & set(NARROW) and dtypes & set(WIDE), (case, dtypes)
        per_dtype.update(dtypes)
    assert min(per_dtype[d] for d in DTYPES) >= 4, per_dtype


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


def test_ci_is_about_half_the_default_in_compiled_programs():
    """The point of the sample: .ci/run under 20 minutes (the figures in the module doc)."""
    assert len(_points("ci")) == 66 and len(_points("default")) == 137
    assert len(build_matrix(sample="ci")) == 1188 and len(build_matrix()) == 2447


def test_an_unknown_sample_is_one_clear_error():
    with pytest.raises(ValueError, match=r"sample='nightly' is not supported \(valid: ci, default, full\)"):
        build_matrix(sample="nightly")


def test_cli_refuses_an_unknown_sample_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--sample", "nightly"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "invalid choice: 'nightly'" in proc.stderr

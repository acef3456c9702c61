"""The parity matrix: one test per entry of harness.problems.matrix, ids like
`small-bfloat16-ichunk2-tchunk0-sparse-grad.indexer.wq_b`, over the project's own jax_impl.

The entries, their ids, marks and xdist groups, and what a test does with its entry come from
harness.run.pytest_plugin, the machinery the installed plugin runs a user's implementation with
(`pytest --csa-parity-impl=mypkg.kernel`); this file only says which matrix.

One pass from the id to the arrays: `collect` runs the implementation and the reference
at the entry's point (harness.sides.implementations, cached per process), `judge` compares the
arrays it is handed (harness.judging.judge). Failed (or errored) fails the test, and its message ends with the `csa-parity run` command
that reruns the entry's point; passed and excused pass;
an entry wholly not provided or not applicable skips with its reason (pytest counts and
lists it: never passed, never silently dropped).

Slices: `-m forward|topk|loss|grad|isolation|chunked`, `-k small-bfloat16`.
Entries of one (case, dtype) share an xdist group, so each worker compiles a
point once and computes the torch reference for a case once.
Reference: live torch_ref by default; CSA_PARITY_REFERENCE=goldens judges
against the fixture goldens (the JAX-only mode, no torch needed).
Precision: CSA_PARITY_PRECISION=highest (default) or default, the JAX matmul
precision and the tolerance profile (harness/judging/tolerance.py) together.
Sample: CSA_PARITY_SAMPLE=default (the default: what `csa-parity run` runs), ci (what
`make test` runs: a subset, docs/matrix.md says which) or full. Both scoring backends: the
pallas backend's own sample of points (`csa-parity run --backends xla,pallas`) on top.
"""

from __future__ import annotations

import pytest

from harness.problems.matrix import BACKENDS
from harness.run.pytest_plugin import MatrixOptions, check_entry, matrix_params

OPTIONS = MatrixOptions.from_env(impl="jax", backends=BACKENDS)
try:
    OPTIONS.validate()
except ValueError as exc:
    raise pytest.UsageError(f"CSA_PARITY_{exc}") from None


@pytest.mark.parametrize("entry", matrix_params(OPTIONS))
def test_parity(entry):
    check_entry(entry, OPTIONS)

"""The parity matrix: one test per entry of harness.problems.matrix, ids like
`small-bfloat16-ichunk2-tchunk0-sparse-grad.indexer.wq_b`.

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

import os

import pytest

from harness.judging.judge import judge
from harness.outputs import NOT_APPLICABLE, NOT_PROVIDED
from harness.problems.matrix import BACKENDS, SAMPLES, build_matrix
from harness.run.collect import collect, policy
from harness.run.report import failure_text

REFERENCE = os.environ.get("CSA_PARITY_REFERENCE", "live")
PROFILE = os.environ.get("CSA_PARITY_PRECISION", "highest")  # conftest sets JAX's matmul precision to match
SAMPLE = os.environ.get("CSA_PARITY_SAMPLE", "default")
if SAMPLE not in SAMPLES:
    raise pytest.UsageError(f"CSA_PARITY_SAMPLE={SAMPLE!r} is not a matrix sample (valid: {', '.join(SAMPLES)})")


def _param(entry):
    marks = [pytest.mark.matrix, pytest.mark.xdist_group(entry.group), getattr(pytest.mark, entry.kind)]
    if entry.point.chunked:
        marks.append(pytest.mark.chunked)
    return pytest.param(entry, id=entry.id, marks=marks)


@pytest.mark.parametrize("entry", [_param(e) for e in build_matrix(sample=SAMPLE, backends=BACKENDS)])
def test_parity(entry):
    outputs, references = collect(entry, REFERENCE)
    results = judge(entry, outputs, references, policy(PROFILE))
    assert not any(r.failed for r in results), failure_text(entry, results, REFERENCE, PROFILE,
                                                            os.environ.get("CSA_PARITY_FIXTURES"))
    unjudged = [r.message for r in results if r.status in (NOT_PROVIDED, NOT_APPLICABLE)]
    if unjudged and len(unjudged) == len(results):
        pytest.skip("; ".join(unjudged))

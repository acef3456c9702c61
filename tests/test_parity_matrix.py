"""The parity matrix (issue 4): one test per entry of harness.matrix, ids like
`small-bfloat16-ichunk2-tchunk0-sparse-grad.indexer.wq_b`.

Slices: `-m forward|topk|loss|grad|isolation|chunked`, `-k small-bfloat16`.
Entries of one (case, dtype) share an xdist group, so each worker compiles a
point once and computes the torch reference for a case once.
Reference: live torch_ref by default; CSA_PARITY_REFERENCE=goldens judges
against the fixture goldens (the JAX-only mode, no torch needed).
Precision: CSA_PARITY_PRECISION=highest (default) or default, the JAX matmul
precision and the tolerance profile (harness/tolerance.py) together.
"""

from __future__ import annotations

import os

import pytest

from harness.checks import evaluate
from harness.matrix import build_matrix

REFERENCE = os.environ.get("CSA_PARITY_REFERENCE", "live")
PROFILE = os.environ.get("CSA_PARITY_PRECISION", "highest")  # conftest sets JAX's matmul precision to match


def _param(entry):
    marks = [pytest.mark.matrix, pytest.mark.xdist_group(entry.point.group), getattr(pytest.mark, entry.kind)]
    if entry.point.chunked:
        marks.append(pytest.mark.chunked)
    return pytest.param(entry, id=entry.id, marks=marks)


@pytest.mark.parametrize("entry", [_param(e) for e in build_matrix()])
def test_parity(entry):
    results = evaluate(entry, REFERENCE, PROFILE)
    # A point this backend cannot compute (harness.platforms) is skipped WITH its reason, so
    # pytest counts and lists it: never passed, never silently dropped.
    if results and all(r.status == "not_applicable" for r in results):
        pytest.skip(results[0].message)
    failures = [r.message for r in results if r.status == "failed"]
    assert not failures, "\n".join(failures)

"""Mutation self-test: the parity matrix must catch every mistake of
harness/selftest/mutations.py's catalogue, and pass on the unmutated code.

Each mutant is applied to a temporary copy of jax_impl/ (never the committed source) and
its matrix slice runs in a process of its own that imports the copy (harness/selftest/mutation_worker.py,
forked from a server that holds jax already), judged against the fixture goldens (no torch). A surviving mutant fails its own test,
named after it; so does a mutant killed only by checks other than the ones its entry
expects (killed for the wrong reason). `python -m harness.selftest.mutations` prints the kill table.

Cost: one forked process per test and one compiled program per point (2-4 s); the
workers share a JAX persistent compilation cache, so a chunking mutant reuses the clean
native program. Measured on the 2-core machine: `pytest tests/test_mutations.py -n 2`
~100 s CPU (forked workers included: the fork server is reaped at session end), ~52 s wall.
The mutants beyond the committed cases each run one pinned random problem live against torch
(harness/problems/random_configs.py). A test stops its mutant's slice once an expected check has
failed (`run_mutant(stop_at_kill=True)`): what the test asserts is then settled, and a problem's later
stages (float64 chunked, the low dtype) are one to three programs each. Measured on the 2-core
machine: quant_rotation_unscaled 24.8 -> 10.2 s, rope_theta_hardcoded_default 16.4 -> 6.9 s
(`python -m harness.selftest.mutations --only ...` runs the whole slice for its kill table). The
clean run here covers the matrix points only: the clean pass of the kernel check is
tests/test_pallas.py::test_the_kernel_check_passes_on_the_committed_code, and of those 4 problems
is tests/test_random_configs.py::test_pinned_problem[NAME], the same `check_problem` on the same
source, which `make test` runs beside this file (running it here too would cost about 29 s).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from harness.points import DTYPES
from harness.problems.cases import CASES, LONG_CASES
from harness.problems.matrix import LONG_QUERY_BLOCKS
from harness.problems.random_configs import PINNED
from harness.selftest.mutations import (CATALOGUE, LENGTH_CATALOGUE, STAGES, MutationError, Mutant, patch_copy,
                                        run_clean, run_mutant, run_worker, slices, stop_forkserver)

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = {"exact64", "exact64@sel", "oracle", "oracle@sel", "chunk", "chunk@sel", "topk",
               "chunk-topk", "isolation", "memory", "kernel", "invariants"}


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
    """One compilation cache for the whole session: the test run's own (tests/conftest.py), so
    the clean run loads the programs the matrix compiled; else under xdist the workers' common
    parent."""
    shared = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if shared:
        yield Path(shared)
        stop_forkserver()
        return
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "mutation-xla-cache"
    path.mkdir(exist_ok=True)
    yield path
    stop_forkserver()


def _describe(outcome) -> str:
    lines = [f"  {f['message']}" for f in outcome.failed[:6]]
    if outcome.error:
        lines.append(f"  worker error: {outcome.error}")
    return "\n".join(lines)


# Run last in its process (tests/conftest.py's LAST): by then the matrix has compiled its points.
def test_clean_code_passes_every_slice(xla_cache):
    points, memory = slices()
    outcome = run_clean(points, memory, xla_cache)  # problems: test_pinned_problem (module docstring)
    assert outcome.checks > 0
    assert outcome.passed, (
        f"the unmutated jax_impl fails {len(outcome.failed)} check(s) of the mutation slices "
        f"({', '.join(outcome.killing)}), so a killed mutant proves nothing:\n{_describe(outcome)}")


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_mutant_is_killed(mutant: Mutant, xla_cache):
    outcome = run_mutant(mutant, xla_cache, stop_at_kill=True)  # stops once an expected check fails
    assert not outcome.passed, (
        f"mutant {mutant.name!r} SURVIVED ({outcome.checks} checks passed on "
        f"{', '.join([p.spec() for p in mutant.points] + list(mutant.problems)) or 'no point'}"
        f"{' + memory' if mutant.memory else ''}): {mutant.mistake}")
    expected = set(mutant.killed_by) & set(outcome.killing)
    assert expected, (
        f"mutant {mutant.name!r} was killed by {', '.join(outcome.killing)}, none of the expected "
        f"{', '.join(mutant.killed_by)} (killed for the wrong reason?):\n{_describe(outcome)}")


# ----------------------------------------------------------------------------- the catalogue


def test_catalogue_is_complete():
    assert len(CATALOGUE) >= 15
    names = [m.name for m in CATALOGUE]
    assert len(set(names)) == len(names), "mutant names must be unique"
    assert {m.stage for m in CATALOGUE} >= {"pooling", "rope", "scoring", "chunking", "loss"}
    for m in CATALOGUE:
        assert m.stage in STAGES, m.name
        assert m.killed_by and set(m.killed_by) <= CHECK_NAMES, m.name
        assert m.points or m.memory or m.problems or m.kernel, f"{m.name}: an empty slice kills nothing"
        assert ("kernel" in m.killed_by) == m.kernel, m.name
        assert set(m.problems) <= set(PINNED), m.name
        test_file, _, test_id = m.killing_test.partition("::")
        assert (ROOT / test_file).is_file(), f"{m.name}: killing test {m.killing_test} does not exist"
        for name in m.problems:  # the named test runs the problem the worker runs
            assert test_id == f"test_pinned_problem[{name}]", m.name
        assert ("memory" in m.killed_by) == m.memory, m.name
        for p in m.points:
            assert p.case in CASES and p.dtype in DTYPES, m.name
        # cheap slices: at most 3 compiled programs (a chunked point also needs its native one)
        programs = {p for p in m.points} | {type(p)(p.case, p.dtype) for p in m.points}
        assert len(programs) <= 3, m.name


def test_every_stage_has_a_mutant_beyond_the_committed_cases():
    """Each stage has a mistake that only a pinned random problem reveals."""
    beyond = {m.stage for m in CATALOGUE if m.problems and not m.points}
    assert beyond == set(STAGES), sorted(set(STAGES) - beyond)


def test_the_length_catalogue_is_well_formed():
    """Each mistake only length shows names a toy slice of committed cases (which it must pass) and
    query blocks of the long cases (which must kill it), the blocks inside their case. Its runs are
    `python -m harness.selftest.mutations --length` (minutes each: not part of `make test`)."""
    names = [m.name for m in (*CATALOGUE, *LENGTH_CATALOGUE)]
    assert len(set(names)) == len(names), "mutant names must be unique across both catalogues"
    assert len(LENGTH_CATALOGUE) >= 3
    for m in LENGTH_CATALOGUE:
        assert m.stage in STAGES, m.name
        assert m.killed_by and set(m.killed_by) <= CHECK_NAMES, m.name
        assert m.points and m.long_blocks, f"{m.name}: needs a toy slice and a long block"
        assert not (m.problems or m.memory or m.kernel), m.name
        for p in m.points:
            assert p.case in CASES and p.dtype in DTYPES, m.name
        for spec in m.long_blocks:
            case, _, block = spec.rpartition(":")
            assert case in LONG_CASES, m.name
            assert 0 <= int(block) < -(-LONG_CASES[case].seq_len // LONG_QUERY_BLOCKS[case]), m.name


def test_every_mutant_still_applies_exactly_once():
    """A stale catalogue (the source moved on) fails here, by name, before anything runs; the
    length catalogue too (its runs are not part of `make test`, so only this sees it go stale)."""
    stale = []
    for m in (*CATALOGUE, *LENGTH_CATALOGUE):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                target = patch_copy(m, Path(tmp))
            except MutationError as e:
                stale.append(str(e))
                continue
            assert (target / m.module).read_text() != (ROOT / "jax_impl" / m.module).read_text(), m.name
    assert not stale, "\n".join(stale)


def test_a_stale_entry_fails_loudly(tmp_path):
    m = Mutant("stale", "scoring", "scoring.py", "this text is not in scoring.py", "", ("exact64",),
               (), "none")
    with pytest.raises(MutationError, match=r"mutant 'stale': its `old` text occurs 0 times in "
                                             r"jax_impl/scoring.py \(expected exactly once\)"):
        patch_copy(m, tmp_path)


def test_the_committed_source_is_never_touched(tmp_path):
    root = ROOT / "jax_impl"
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*.py")}
    for m in (*CATALOGUE[:3], CATALOGUE[-1]):
        patch_copy(m, tmp_path / m.name)
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*.py")} == before


def test_the_plain_subprocess_worker_imports_the_copy(tmp_path):
    """`python -m harness.selftest.mutation_worker` (the path without a fork server): the editable
    install's finder must not win; the worker reports the copy it imported."""
    target = patch_copy(None, tmp_path)
    report = run_worker(tmp_path, (), memory=False, method="subprocess")
    assert report["jax_impl_file"] == str(target / "__init__.py")
    assert report["checks"] == 0 and report["failed"] == []

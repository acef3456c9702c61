"""Mutation self-test of the judge: every mistake of harness/selftest/judge_mutations.py's catalogue is
caught by the test its entry names, and every one of those tests passes on the unmutated code.

Each mutant is applied to a temporary copy of harness/ (never the committed source) and its
killing test (tests/test_judge_rules.py) runs in a pytest process of its own that imports the
copy (checked by a probe plug-in: a run that imported this checkout's harness stops, it never
counts as a kill). A surviving mutant fails its own test, named after it; so does one killed
only by a crash or by another test. `python -m harness.selftest.judge_mutations` prints the kill table.

The number mutants (one per number of harness/judging/tolerance.py, 10x looser) are checked the same
way, all in one process (harness.selftest.judge_mutations.run_numbers), and one of them once more under
pytest, to show both ways agree.

Cost: one pytest start per mutant of the hand-made catalogue (no conftest, no JAX program):
about 1 s of one core each, some 40 CPU-seconds on the 2-core machine; the number mutants
a few seconds together. `make test` runs it in its main process, after the matrix.
"""

from __future__ import annotations

import ast
import re
import tempfile
from pathlib import Path

import pytest

from harness.judging import tolerance
from harness.selftest.judge_mutations import (BOUNDARIES, CATALOGUE, KINDS, MODULES, NUMBER_CATALOGUE, NUMBER_KIND,
                                              NUMBER_TEST, PACKAGE, HarnessMutant, MutationError, killed_by_its_test,
                                              number_mutant_name, patch_copy, run_clean, run_mutant, run_numbers,
                                              run_tests)

ROOT = Path(__file__).resolve().parent.parent


def _describe(outcome) -> str:
    return outcome.output[-3000:]


def test_clean_copy_passes_every_killing_test():
    outcome = run_clean()
    assert outcome.passed, (
        f"the unmutated harness fails killing tests {', '.join(outcome.failed) or '(pytest exit '}"
        f"{'' if outcome.failed else str(outcome.returncode) + ')'}, so a killed mutant proves nothing:\n"
        f"{_describe(outcome)}")


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[m.name for m in CATALOGUE])
def test_harness_mutant_is_killed_by_its_test(mutant: HarnessMutant):
    outcome = run_mutant(mutant)
    assert outcome.ran, (f"mutant {mutant.name!r}: pytest could not run {mutant.killing_test} on the mutated "
                         f"copy (exit {outcome.returncode}); a crash is not a kill:\n{_describe(outcome)}")
    assert not outcome.passed, (
        f"mutant {mutant.name!r} SURVIVED: {mutant.killing_test} passes with harness/{mutant.module} "
        f"mistaken ({mutant.mistake}); the rule {mutant.rule!r} can go soft unnoticed")
    assert killed_by_its_test(mutant, outcome), (
        f"mutant {mutant.name!r} was killed by {', '.join(outcome.failed)}, not by {mutant.killing_test}")


# ----------------------------------------------------------------------------- every number, 10x looser


@pytest.fixture(scope="module")
def number_runs():
    return run_numbers()


def test_the_boundary_tests_pass_on_an_unmutated_copy(number_runs):
    clean, _ = number_runs
    assert clean.passed, (f"the boundary tests fail on the unmutated harness (pytest-like exit {clean.returncode}), "
                          f"so a killed number mutant proves nothing:\n{clean.output[-3000:]}")


def test_every_number_10x_looser_is_killed_by_its_boundary_test(number_runs):
    """Each number of harness/judging/tolerance.py made 10x looser in a copy fails its boundary test, with
    every one of its boundary cases going soft (none of them is blind to it), and the failure
    starts with the number's name."""
    _, outcomes = number_runs
    problems = []
    for m in NUMBER_CATALOGUE:
        o = outcomes[m.name]
        number = m.rule
        if not o.ran:
            problems.append(f"{m.name}: the boundary test could not run on the mutated copy (a crash is not a kill):"
                            f" {o.output[-500:]}")
        elif o.passed:
            problems.append(f"{m.name} SURVIVED: {m.killing_test} passes with {m.mistake}")
        elif not killed_by_its_test(m, o):
            problems.append(f"{m.name}: killed by {', '.join(o.failed)}, not by {m.killing_test}")
        elif not all(line.startswith(number) for line in o.rules):
            problems.append(f"{m.name}: the failure does not start with the number's name: {o.rules[0]}")
        else:
            count = re.search(rf"^{re.escape(number)}: (\d+) of its (\d+) boundary cases fail$", o.output, re.M)
            if not count or count.group(1) != count.group(2):
                problems.append(f"{m.name}: not every boundary case of {number} fails: "
                                f"{count.group(0) if count else o.output[-500:]}")
    assert not problems, "\n".join(problems)


def test_the_number_catalogue_follows_the_table():
    """One mutant per number of harness/judging/tolerance.py, named after it, killed by its boundary test."""
    numbers = [n for n, _, _ in tolerance.entries()]
    assert [m.name for m in NUMBER_CATALOGUE] == [number_mutant_name(n) for n in numbers]
    for m, (number, _, value) in zip(NUMBER_CATALOGUE, tolerance.entries()):
        assert m.kind == NUMBER_KIND and m.module == "judging/tolerance.py" and m.rule == number, m
        assert m.killing_test == f"{BOUNDARIES}::{NUMBER_TEST}[{number}]", m
        assert repr(tolerance.loosened(value)) in m.appended and tolerance.loosened(value) > value, m


def test_a_number_mutant_dies_the_same_under_pytest():
    """The one-process runner and a pytest process of its own agree (here on the Pallas backend's
    float32 gradient bound)."""
    [m] = [m for m in NUMBER_CATALOGUE if m.rule == "BACKEND.float32.grad"]
    outcome = run_mutant(m)
    assert killed_by_its_test(m, outcome), f"{m.name} under pytest: exit {outcome.returncode}\n{outcome.output[-2000:]}"


# ----------------------------------------------------------------------------- the catalogue


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_catalogue_is_complete():
    names = [m.name for m in CATALOGUE]
    assert len(set(names)) == len(names), "mutant names must be unique"
    assert {m.kind for m in CATALOGUE} == set(KINDS), sorted(set(KINDS) - {m.kind for m in CATALOGUE})
    assert {m.module for m in CATALOGUE} == set(MODULES), sorted(set(MODULES) - {m.module for m in CATALOGUE})
    for m in CATALOGUE:
        assert m.kind in KINDS and m.module in MODULES, m.name
        assert m.rule and m.mistake, m.name
        test_file, _, test_id = m.killing_test.partition("::")
        assert (ROOT / test_file).is_file(), f"{m.name}: killing test file {test_file} does not exist"
        assert test_id.split("[")[0] in _test_functions(ROOT / test_file), \
            f"{m.name}: killing test {m.killing_test} does not exist"


def test_every_mutant_still_applies_exactly_once():
    """A stale catalogue (the source moved on) fails here, by name, before anything runs."""
    stale = []
    for m in CATALOGUE + NUMBER_CATALOGUE:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                target = patch_copy(m, Path(tmp))
            except MutationError as e:
                stale.append(str(e))
                continue
            assert (target / m.module).read_text() != (ROOT / PACKAGE / m.module).read_text(), m.name
    assert not stale, "\n".join(stale)


def test_a_stale_entry_fails_loudly(tmp_path):
    m = HarnessMutant("stale", "bound", "judging/compare.py", "this text is not in compare.py", "", "tests/x.py::t", "r",
                      "none")
    with pytest.raises(MutationError, match=r"mutant 'stale': its `old` text occurs 0 times in "
                                             r"harness/judging/compare.py \(expected exactly once\)"):
        patch_copy(m, tmp_path)


def test_the_committed_source_is_never_touched(tmp_path):
    root = ROOT / PACKAGE
    before = {p: p.read_bytes() for p in root.rglob("*.py")}
    for m in CATALOGUE[:4]:
        patch_copy(m, tmp_path / m.name)
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == before


def test_the_test_process_imports_the_copy(tmp_path):
    """The probe stops a run whose tests imported another harness than the copy: here the copy
    holds no harness/ at all, so the tests import this checkout's, and pytest exits 4."""
    (tmp_path / "copy").mkdir()
    outcome = run_tests(tmp_path / "copy", [CATALOGUE[0].killing_test])
    assert outcome.returncode == 4 and "not the mutated copy" in outcome.output, outcome.output[-2000:]
    assert not outcome.ran


def test_the_judging_doc_names_every_mutant_and_only_real_tests():
    """docs/judging.md's table: every mutant of the catalogue appears, and every test and
    mutant it names exists."""
    import re

    doc = (ROOT / "docs" / "judging.md").read_text()
    doc = re.sub(r"<!-- guarantees:.*?<!-- end of guarantees -->", "", doc, flags=re.S)  # the numbers' table
    rows = [line for line in doc.splitlines() if line.startswith("| ") and "`test_" in line]
    named_tests = {t for row in rows for t in re.findall(r"`(test_\w+)`", row)}
    named_mutants = {m for row in rows for m in re.findall(r"`([a-z0-9_]+)`", re.split(r"(?<!\\)\|", row)[3])}
    functions = _test_functions(ROOT / "tests" / "test_judge_rules.py")
    assert named_tests <= functions, f"docs/judging.md names tests that do not exist: {sorted(named_tests - functions)}"
    names = {m.name for m in CATALOGUE}
    assert named_mutants == names, (f"docs/judging.md and the catalogue disagree: missing from the doc "
                                    f"{sorted(names - named_mutants)}, unknown {sorted(named_mutants - names)}")
    for m in CATALOGUE:  # the row naming a mutant names its killing test
        test = m.killing_test.split("::", 1)[1]
        assert any(f"`{m.name}`" in row and f"`{test}`" in row for row in rows), \
            f"docs/judging.md: no row names both {m.name} and its killing test {test}"

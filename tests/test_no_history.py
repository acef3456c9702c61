"""Code and docs say what is true now. An issue number ("issue 14", "issue #13", "issues 7, 14",
also broken over a comment's line) or a date means nothing to a reader outside the project's
tracker: the sources, the README and docs/ must say what a thing is and why. History lives in
CHANGELOG.md (exempt) and in commit messages. Pure text, no JAX."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".cfg", ".txt"}
NAMES = {"Makefile", "run"}  # .ci/run
# CHANGELOG.md is where history goes; this file holds the examples the pattern must find.
EXEMPT = {"CHANGELOG.md", "tests/test_no_history.py"}
# "issue", then '#', '-', quotes, spaces or a line break with a comment's leading '#', then a number.
ISSUE = re.compile(r"\bissues?[\s\"'#-]*(?:\n[\s#\"']*)?#?\d+", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _sources() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        hidden = [p for p in rel.parts[:-1] if p.startswith(".") and p not in (".github", ".ci")]
        if hidden or "egg-info" in str(rel) or "__pycache__" in rel.parts or not path.is_file():
            continue
        if rel.parts[0] in ("fixtures", "reports") or str(rel) in EXEMPT:
            continue
        if path.suffix in SUFFIXES or path.name in NAMES:
            out.append(path)
    return out


def test_the_date_pattern():
    assert DATE.search("measured 2026-12-03, idle") and not DATE.search("sha 2026123 and 1e-12")


def _hits(pattern: re.Pattern, text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group()!r}" for m in pattern.finditer(text)]


def test_the_scan_sees_the_sources_and_docs():
    names = {str(p.relative_to(ROOT)) for p in _sources()}
    assert {"README.md", "harness/run/cli.py", "jax_impl/api.py", "Makefile", ".ci/run",
            ".github/workflows/ci.yml", "tests/test_cli.py", "benchmarks/README.md"} <= names
    assert not names & EXEMPT


@pytest.mark.parametrize("text,found", [
    ("# issue 14: the order errors", True), ("(issue #13, `qchunk`)", True), ("Issue 15 added", True),
    ("issues 7, 14", True), ("(issue\n# 11) is a point", True), ("the issue-14 bounds", True),
    ("an issue with the fixture", False), ("reissue 3 tensors", False), ("tissue 4", False),
])
def test_the_pattern_finds_issue_numbers_and_nothing_else(text, found):
    assert bool(ISSUE.search(text)) == found, text


def test_no_issue_numbers_or_dates_in_the_sources_and_docs():
    offenders = {}
    for path in _sources():
        text = path.read_text(errors="replace")
        hits = _hits(ISSUE, text) + _hits(DATE, text)
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, ("say what is true now and why; history goes in CHANGELOG.md: "
                           + "; ".join(f"{p}: {', '.join(h)}" for p, h in offenders.items()))


# The repository stands alone: the mathematics is docs/spec.md, and no file sends the reader to a
# directory beside the clone, which a fresh clone does not have.
OUTSIDE = re.compile(r"\.\./" + "shared")


def test_no_file_names_a_directory_outside_the_repository():
    assert OUTSIDE.search("see " + "../" + "shared/SPEC.md") and not OUTSIDE.search("docs/spec.md")
    offenders = [str(p.relative_to(ROOT)) for p in [*_sources(), ROOT / "CHANGELOG.md"]
                 if OUTSIDE.search(p.read_text(errors="replace"))]
    assert not offenders, f"these name a path outside the repository (the mathematics is docs/spec.md): {offenders}"

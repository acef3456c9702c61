"""The README and docs/ stay true: the README is short and in its order, every docs page is
linked, the commands they show use real options, the printed excerpts have the shape the code
prints today, and docs/FIGURES.md's figures that follow from the code alone are current
(`make figures` rewrites it). Pure text and cheap calls, no JAX program."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SECTIONS = ["## Install and run", "## On a TPU VM", "## Bring your kernel", "## Use the layer in your model",
            "## Statuses and exit codes", "## Docs"]


def test_the_readme_is_at_most_200_lines_in_its_order():
    assert README.count("\n") <= 200, f"README.md has {README.count(chr(10))} lines (at most 200)"
    headings = [line for line in README.splitlines() if line.startswith("## ")]
    assert headings == SECTIONS, headings
    first = README.split("\n## ", 1)[0].split("\n\n")
    assert first[0] == "# csa-parity" and len(first) == 2, "one paragraph of what csa-parity proves"


def test_every_docs_page_exists_and_is_linked_from_the_readme():
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README))
    assert linked == set(pages), (sorted(linked), pages)
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (ROOT / link).exists(), link


def _run_options() -> set[str]:
    """Every option `csa-parity run --help` lists."""
    import contextlib
    import io

    from harness.run.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["run", "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out.getvalue()))


def test_the_commands_shown_use_real_options():
    options = _run_options()
    assert {"--list", "--cases", "--impl", "--timeout"} <= options
    texts = [README] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    used = set()
    for text in texts:
        for command in re.findall(r"csa-parity run([^\n`]*)", text):
            used |= {re.match(r"--[\w-]+", w).group() for w in command.split() if re.match(r"--\w", w)}
    assert used and used <= options, sorted(used - options)


def test_the_readme_excerpts_have_the_shape_the_code_prints():
    from harness.points import Point
    from harness.run.cli import selection_lines  # noqa: F401  (the --list the README names)
    from harness.run.report import COLUMNS, RERUN, rerun_command

    header = next(line for line in README.splitlines() if line.startswith("case ") and "dtype" in line)
    assert header.split() == ["case", "dtype", *COLUMNS]
    fail = next(line for line in README.splitlines() if line.startswith("FAIL ["))
    rerun = README.splitlines()[README.splitlines().index(fail) + 1]
    point = re.match(r"FAIL \[(\w+) (\w+) ichunk=(\d+) tchunk=(\d+) (\w+) impl=(\S+)\]", fail)
    case, dtype, ichunk, tchunk, mode, impl = point.groups()
    assert rerun == "  " + RERUN + rerun_command(Point(case, dtype, int(ichunk), int(tchunk)), mode, impl)
    assert shlex.split(rerun.strip()[len(RERUN):])[:2] == ["csa-parity", "run"]


def test_the_figures_page_is_current_for_what_follows_from_the_code():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    page = (ROOT / "docs" / "FIGURES.md").read_text()
    for section in (figures.matrix_section(), figures.catalogue_section()):
        assert "\n".join(section) in page, f"docs/FIGURES.md is stale: run `make figures`\n{chr(10).join(section)}"


def test_the_design_map_of_the_harness_rooms_matches_the_tree():
    """docs/design.md's table of harness/'s rooms names every module where it is, and nothing else."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("### `harness/`, room by room", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    named = set()
    for row in table.splitlines()[2:]:
        room, modules = row.split(" | ")[:2]
        folder = re.match(r"\| `(harness/\w+/)`", room)
        for name in re.findall(r"`((?:harness/)?[\w/]+\.py)`", modules):
            named.add(name if name.startswith("harness/") else f"{folder.group(1)}{name}")
    tree = {p.relative_to(ROOT).as_posix() for p in (ROOT / "harness").rglob("*.py")
            if p.name != "__init__.py" or p.parent.name == "harness"}
    assert named == tree, f"missing from the map: {sorted(tree - named)}; named but not there: {sorted(named - tree)}"

"""Where the harness's data lives: the fixture set and the platform profiles, found through
`importlib.resources`, so that a clone, its editable install and an installed wheel read the
same names. Every other module asks here; none builds a data path of its own.

- Profiles: `harness/profiles/*.json`, package data of `harness` in every form.
- Fixtures: the repository keeps them at its top level (`fixtures/`: the layout the design
  fixes, the set a clone's `make parity` judges). The wheel carries that directory as
  `harness/fixtures/` (setup.py's build step copies it there; an editable install copies
  nothing). So the default set is `harness/fixtures` where the installed package has one,
  and else the repository's `fixtures/` beside the `harness/` this module was imported from.
  The data stays under the project's own package: a top-level `fixtures` package would
  shadow a user's module of that name.
- A run names another set with `--fixtures DIR` (`CSA_PARITY_FIXTURES`, which workers and
  subprocesses inherit); `fixture_set` says which set a report judged: its directory and the
  sha256 of its MANIFEST.json, which names every file's own sha256.

Imports nothing beyond the standard library (the pytest plugin and the CLI's argument
parsing read it before anything heavy is loaded).
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

FIXTURES_ENV = "CSA_PARITY_FIXTURES"
MANIFEST_NAME = "MANIFEST.json"
REGENERATE_COMMAND = "csa-parity regenerate"

_PACKAGE = __name__.rpartition(".")[0]  # "harness"


def _package_path(*parts: str) -> Path:
    """A directory inside the installed `harness` package as a file-system path (the harness
    reads its data with numpy and safetensors, which want paths: a wheel installs as files)."""
    node = resources.files(_PACKAGE).joinpath(*parts)
    if not isinstance(node, Path):
        raise RuntimeError(f"{_PACKAGE} is installed as {type(node).__name__}, not as files: install csa-parity "
                           "from its wheel with pip (a zipped install cannot hand its data to numpy)")
    return node


def source_tree() -> Path | None:
    """The directory holding `harness/` when a fixture set lies beside it, `fixtures/` with its
    MANIFEST.json: a clone, its editable install, or a copy of the harness made the same way (the
    judge's mutation self-test links one); else None."""
    root = _package_path().parent
    return root if (root / "fixtures" / MANIFEST_NAME).is_file() else None


def packaged_fixtures_dir() -> Path:
    """The fixture set this installation carries (see the module doc)."""
    packaged = _package_path("fixtures")
    if (packaged / MANIFEST_NAME).is_file():
        return packaged
    root = source_tree()
    # Neither (an install that lost its data): the packaged path, whose missing files
    # harness.problems.fixtures reports with the command that writes them.
    return root / "fixtures" if root is not None else packaged


def fixtures_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The fixture set a run reads: `explicit`, else CSA_PARITY_FIXTURES, else the packaged one."""
    chosen = explicit if explicit is not None else (os.environ.get(FIXTURES_ENV) or None)
    return Path(chosen) if chosen is not None else packaged_fixtures_dir()


def profiles_dir() -> Path:
    """The measured platform profiles (harness/profiles/*.json)."""
    return _package_path("profiles")


def fixture_set(directory: str | os.PathLike | None = None) -> dict:
    """What a report says about the fixtures it judged: the directory, and `manifest_sha256`,
    the sha256 of its MANIFEST.json (None where it has none), the set's content id."""
    path = fixtures_dir(directory).resolve()
    manifest = path / MANIFEST_NAME
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
    return {"dir": str(path), "manifest_sha256": digest}


def versions() -> dict[str, str]:
    """The installed versions a report names: csa-parity, jax, jaxlib and torch ("absent"
    where it is not installed), read from the package metadata without importing any."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("csa-parity", "jax", "jaxlib", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out

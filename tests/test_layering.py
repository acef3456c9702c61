"""Import independence: jax_impl never sees torch, torch_ref never sees JAX; only the
harness sees both. Checked statically (every import statement of every module) and
dynamically (a fresh interpreter imports one side and must not have loaded the other)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "jax_impl": {"torch", "torch_ref", "harness"},
    "torch_ref": {"jax", "jaxlib", "flax", "jax_impl", "harness"},
}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__"
        ):
            roots |= {a.value.split(".")[0] for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_the_other_side(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules found under {package}/"
    offenders = {
        str(m.relative_to(ROOT)): sorted(_imported_roots(m) & FORBIDDEN[package]) for m in modules
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{package} must not import {sorted(FORBIDDEN[package])}: {offenders}"


@pytest.mark.parametrize("package", [pytest.param(p, marks=pytest.mark.torch) if p == "torch_ref" else p
                                     for p in sorted(FORBIDDEN)])
def test_importing_one_side_loads_nothing_of_the_other(package):
    code = (
        f"import sys, {package}; "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN[package])!r}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {package} loaded {out.stdout.strip()}"


def test_the_static_check_sees_an_offending_import(tmp_path):
    """The scanner itself must find the imports it forbids (a test that cannot fail proves nothing)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom torch.nn import functional\nimport importlib\nimportlib.import_module('jax.numpy')\n")
    assert {"torch", "jax"} <= _imported_roots(bad)

"""Import independence: jax_impl never sees torch, torch_ref never sees JAX; only the
harness sees both. Checked statically (every import statement of every module) and
dynamically (a fresh interpreter imports one side and must not have loaded the other).
Inside the harness: the judge imports no runner, fixture or framework module,
and the fixture format neither torch nor the code under test."""

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


PROJECT = {"jax_impl", "torch_ref", "harness", "benchmarks", "examples"}


def _private_imports(path: Path) -> list[str]:
    """`from <project module> import _name` and relative `from .x import _name`: a room's
    private names may change without notice to the rooms that would reach for them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            ours = node.level > 0 or (node.module or "").split(".")[0] in PROJECT
            module_private = any(part.startswith("_") and part != "__init__" for part in (node.module or "").split("."))
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if ours and (names or module_private):
                found.append(f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}")
    return found


def test_nothing_private_is_imported_across_modules():
    # torch_ref is left out: its reference.py imports config._as_tensor from its own config
    # module, one room (the reference) split over two files.
    scanned = ("jax_impl", "harness", "benchmarks", "examples", "tests", "scripts")
    files = [p for d in scanned for p in sorted((ROOT / d).rglob("*.py"))]
    offenders = {str(p.relative_to(ROOT)): _private_imports(p) for p in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"private names imported across modules: {offenders}"


def test_the_private_import_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from jax_impl.api import _loss_core\nfrom .api import forward_parts, _prepare\nimport numpy as np\n")
    assert len(_private_imports(bad)) == 2
# --------------------------------------------------------------------------- inside the harness
# Data flows one way: fixtures -> implementations -> outputs -> judge -> report. The judging
# modules see arrays only: no runner, no fixture code, no framework. The fixture format sees
# files only: no torch and no code under test.

FRAMEWORKS = {"jax", "jaxlib", "flax", "torch", "torch_ref", "jax_impl"}
HARNESS_RULES = {
    # the judge and everything it pulls in: arrays only (harness.collect is the runner: it
    # drives the implementations; the old harness.runner / harness.checks are gone)
    "harness.judge": FRAMEWORKS | {"harness.implementations", "harness.collect", "harness.fixtures",
                                   "harness.regenerate", "harness.cli", "harness.mutations",
                                   "harness.mutation_worker", "harness.runner", "harness.checks",
                                   "harness.random_configs"},
    "harness.fixtures": {"torch", "torch_ref", "jax", "jaxlib", "flax", "jax_impl", "harness.implementations",
                         "harness.regenerate", "harness.collect"},
}
# the codes' judge (boundary ties of quantized codes and scales) is the judge's layer: arrays only
HARNESS_RULES["harness.codes"] = HARNESS_RULES["harness.judge"]


def _top_level(tree: ast.Module):
    """The statements that run when the module is imported (not function or class bodies' calls:
    module level, and inside top-level if / try / with blocks)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                todo.append(child)


def _imported_modules(path: Path, package: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of every module a file imports (relative imports resolved in `package`);
    with `top_level_only`, only the imports that run when the file is imported."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (_top_level(tree) if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import x` imports x
    return out


def _forbidden(names: set[str], forbidden: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


def _scan(name: str, root: str) -> set[str]:
    """The imports of harness module `name` that count for `root`'s layer: all of the root's own
    (any function of it may run), the import-time ones of a module it pulls in (what loading the
    root loads: harness.platforms asks JAX for the current backend only inside the function
    harness.collect calls, never at import)."""
    path = ROOT / (name.replace(".", "/") + ".py")
    if not path.exists():
        return set()
    return _imported_modules(path, "harness", top_level_only=name != root)


def _harness_closure(module: str) -> set[str]:
    """Every harness module `module` imports, directly or through other harness modules."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m for m in _scan(name, module) if m.startswith("harness.")]
    return seen


@pytest.mark.parametrize("module", sorted(HARNESS_RULES))
def test_harness_layers_statically(module):
    """The module and every harness module it pulls in import nothing their layer forbids."""
    offenders = {}
    for name in sorted(_harness_closure(module)):
        path = ROOT / (name.replace(".", "/") + ".py")
        if path.exists():
            bad = _forbidden(_scan(name, module) | {name}, HARNESS_RULES[module])
            if bad:
                offenders[name] = bad
    assert not offenders, f"{module} must not depend on {sorted(HARNESS_RULES[module])}: {offenders}"


@pytest.mark.parametrize("module", sorted(HARNESS_RULES))
def test_harness_layers_in_a_fresh_interpreter(module):
    forbidden = sorted(HARNESS_RULES[module])
    code = (f"import sys, {module}; bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + '.') "
            f"for f in {forbidden!r})); print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_the_harness_scanner_separates_import_time_from_call_time(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("import numpy\ntry:\n    import ml_dtypes\nexcept ImportError:\n    pass\n"
                    "def backend():\n    import jax\n    return jax.default_backend()\n")
    assert {"numpy", "ml_dtypes"} <= _imported_modules(lazy, "harness", top_level_only=True)
    assert "jax" not in _imported_modules(lazy, "harness", top_level_only=True)
    assert "jax" in _imported_modules(lazy, "harness")


def test_the_harness_scanner_resolves_relative_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from . import fixtures\nfrom .implementations import outputs\nimport jax.numpy\n")
    names = _imported_modules(bad, "harness")
    assert _forbidden(names, HARNESS_RULES["harness.judge"]) == [
        "harness.fixtures", "harness.implementations", "harness.implementations.outputs", "jax.numpy"]

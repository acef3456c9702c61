"""Import independence: jax_impl never sees torch, torch_ref never sees JAX; only the
harness sees both. Checked statically (every import statement of every module) and
dynamically (a fresh interpreter imports one side and must not have loaded the other).
Inside the harness: the judge imports no runner, fixture or framework module,
and the fixture format neither torch nor the code under test."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "jax_impl": {"torch", "torch_ref", "harness"},
    "torch_ref": {"jax", "jaxlib", "flax", "jax_impl", "harness"},
}


def _constant_imports(node: ast.AST) -> set[str]:
    """The constant names a call hands importlib.import_module or __import__ (none for any other node)."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
        "import_module", "__import__"
    ):
        return {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return set()


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        roots |= {name.split(".")[0] for name in _constant_imports(node)}
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
# Data flows one way: fixtures -> implementations -> outputs -> judge -> report, and the rooms
# of harness/ follow it (docs/design.md). At the bottom, the vocabulary every room reads: the
# package itself, harness.outputs, harness.points, harness.platforms and harness.package_data (where
# the data lies). Then, each room importing
# only the bottom and the rooms before it:
ROOMS = ("judging", "problems", "sides", "run", "selftest")
BOTTOM = ("harness", "harness.outputs", "harness.points", "harness.platforms", "harness.package_data")
FRAMEWORKS = {"jax", "jaxlib", "flax", "torch", "torch_ref", "jax_impl"}
# Beyond the direction: the judging room sees arrays only (no framework, no runner, no fixture
# code), and the problems' data (the catalogue, the matrix and the fixture format) sees files
# only: no framework and no code under test.
HARNESS_RULES = {f"harness.judging.{m}": FRAMEWORKS
                 for m in ("codes", "compare", "judge", "memory_bounds", "tolerance")}
HARNESS_RULES.update({f"harness.problems.{m}": FRAMEWORKS for m in ("cases", "fixtures", "matrix")})
PROJECT_PACKAGES = ("harness", "jax_impl", "torch_ref", "benchmarks", "examples")


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


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` statement imports from (relative ones resolved in
    `package`)."""
    base = node.module or ""
    if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
    return base


def _imported_modules(path: Path, package: str, top_level_only: bool = False) -> set[str]:
    """Absolute names of every module a file imports (relative imports resolved in `package`),
    imports inside functions included; with `top_level_only`, only the imports that run when the
    file is imported."""
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in (_top_level(tree) if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import x` imports x
    return out


def _forbidden(names: set[str], forbidden: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))


@functools.lru_cache(maxsize=None)
def _modules(root: Path, packages=PROJECT_PACKAGES) -> dict[str, tuple[Path, str]]:
    """{module name: (file, the package its relative imports resolve in)} of every module of
    `packages` under `root`."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                out[".".join(parts)] = (path, ".".join(parts))
            else:
                out[".".join(parts)] = (path, ".".join(parts[:-1]))
    return out


def _import_graph(root: Path, packages=PROJECT_PACKAGES) -> dict[str, set[str]]:
    """{module: the project modules it imports}, counting every import statement wherever it
    sits (a lazy import inside a function hides a circle; it does not break it) and
    importlib.import_module / __import__ of a constant name. `from package import name` counts
    as an import of the submodule where `name` is one, else of the package."""
    modules = _modules(root, packages)

    def known(m: str) -> str:  # the module itself, else the nearest package above it that is ours
        while m and m not in modules:
            m = m.rpartition(".")[0]
        return m

    graph = {}
    for name, (path, package) in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _from_module(node, package)
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
            found |= {known(name) for name in _constant_imports(node)}
        graph[name] = found - {"", name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one module
    (Tarjan's algorithm), each as a list of its modules in one circle's order where found."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _room(module: str) -> int:
    """The rank of a harness module's room: 0 the bottom, then ROOMS in order."""
    if module in BOTTOM:
        return 0
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "harness" or parts[1] not in ROOMS:
        raise AssertionError(f"{module} is in no room: a module of harness/ sits in one of {ROOMS} or is one of "
                             f"{BOTTOM} (the bottom)")
    return 1 + ROOMS.index(parts[1])


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a harness module by a harness module of a lower room (or a room beside it)."""
    out = []
    for name, targets in sorted(graph.items()):
        if name.split(".")[0] != "harness":
            continue
        for t in sorted(targets):
            if t.split(".")[0] == "harness" and _room(t) > _room(name):
                out.append(f"{name} -> {t}")
    return out


def test_no_import_cycle_among_the_projects_modules():
    graph = _import_graph(ROOT)
    assert len(graph) > 40, sorted(graph)
    assert not _cycles(graph), f"import circles (lazy imports counted): {_cycles(graph)}"


def test_every_harness_module_sits_in_a_room_and_imports_only_downward():
    graph = _import_graph(ROOT, ("harness",))
    top = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert top == sorted(m.rpartition(".")[2] + ".py" if m != "harness" else "__init__.py" for m in BOTTOM), top
    assert not _upward_imports(graph), f"imports against the rooms' direction {ROOMS}: {_upward_imports(graph)}"
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((ROOT / "harness" / room / "__init__.py").read_text()))
        assert doc and "import" in doc, (f"harness/{room}/__init__.py must say what the room is for and what it may "
                                         "import")


def _planted(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"harness/__init__.py": "", **{f"harness/{r}/__init__.py": "" for r in ROOMS}, **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_cycle_check_sees_a_planted_lazy_circle(tmp_path):
    root = _planted(tmp_path, {"harness/sides/a.py": "from . import b\n",
                               "harness/sides/b.py": "def f():\n    from .a import g\n    return g\n"})
    assert _cycles(_import_graph(root, ("harness",))) == [["harness.sides.a", "harness.sides.b"]]
    assert _cycles(_import_graph(ROOT)) == [], "the project itself has no circle (test_no_import_cycle_...)"


def test_the_direction_check_sees_a_planted_upward_import(tmp_path):
    root = _planted(tmp_path, {"harness/judging/judge.py": "def f():\n    from ..sides.worker import run\n",
                               "harness/sides/worker.py": "from ..judging.judge import f\nfrom .. import outputs\n",
                               "harness/outputs.py": "import importlib\nimportlib.import_module('harness.run.cli')\n",
                               "harness/run/cli.py": ""})
    assert _upward_imports(_import_graph(root, ("harness",))) == [
        "harness.judging.judge -> harness.sides.worker", "harness.outputs -> harness.run.cli"]


def _scan(name: str, root: str) -> set[str]:
    """The imports of harness module `name` that count for `root`'s layer: all of the root's own
    (any function of it may run), the import-time ones of a module it pulls in (what loading the
    root loads: harness.platforms asks JAX for the current backend only inside the function
    harness.run.collect calls, never at import)."""
    modules = _modules(ROOT, ("harness",))
    if name not in modules:
        return set()
    path, package = modules[name]
    return _imported_modules(path, package, top_level_only=name != root)


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
        bad = _forbidden(_scan(name, module) | {name}, HARNESS_RULES[module])
        if bad:
            offenders[name] = bad
    assert not offenders, f"{module} must not depend on {sorted(HARNESS_RULES[module])}: {offenders}"


@pytest.mark.parametrize("module", sorted(HARNESS_RULES))
def test_harness_layers_in_a_fresh_interpreter(module):
    """What the module loads, rooms above it included (a lazy import the static scan resolved
    wrongly would show here)."""
    forbidden = sorted(HARNESS_RULES[module] | {f"harness.{r}" for r in ROOMS[ROOMS.index(module.split(".")[1]) + 1:]})
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
    bad.write_text("from .. import outputs\nfrom ..sides.implementations import outputs\nfrom .codes import x\n"
                   "import jax.numpy\n")
    names = _imported_modules(bad, "harness.judging")
    assert _forbidden(names, HARNESS_RULES["harness.judging.judge"] | {"harness.sides", "harness.outputs"}) == [
        "harness.outputs", "harness.sides.implementations", "harness.sides.implementations.outputs", "jax.numpy"]
    assert "harness.judging.codes" in names

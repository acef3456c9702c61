"""csa-parity as a user installs it: the wheel built from this tree, installed into a fresh
virtual environment outside the clone, driven from an empty directory.

The environment reuses what this one has installed (jax, torch, ...) instead of installing them
again: a `.pth` line puts this interpreter's site-packages after the new environment's own, and
only the wheel is installed (`--no-deps`). A plain path line in a `.pth` file is not a site
directory, so this environment's editable install of the project (its `.pth` finder) is not
loaded there: what the user's environment imports is the wheel's harness, which a check below
asserts. Then, from an empty directory:
- `csa-parity --version`, and `import benchmarks` fails (no top-level name but the project's own);
- `csa-parity run --reference goldens` on a slice: exit 0, and the report names the packaged fixtures;
- the README's scores kernel scaled by 1.01 as `mykernel.py`, `--impl mykernel` (the live
  reference): exit 1 and a rerun line;
- `pytest --csa-parity-impl=mykernel -n 2` beside a test file of the user's own, over the README's
  kernel as it stands and over the scaled one: the user's test passes, and the matrix's stage
  entries pass, then fail, under the matrix's ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "harness", "jax_impl", "torch_ref", "fixtures")

KERNEL = '''import jax.numpy as jnp

STAGE = "scores"

def scores(q, keys, head_weights):  # [B,S,HI,DI], [B,W,DI], [B,S,HI] -> [B,S,W], unmasked, wide
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.einsum("bsh,bshw->bsw", head_weights, jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5{scale}
'''

USER_TEST = '''import os, sys
import harness


def test_the_users_own_test_runs_and_imports_the_installed_harness():
    assert harness.__file__.startswith(sys.prefix + os.sep), harness.__file__
'''


def _readme_kernel() -> str:
    """The README's kernel block, as a user copies it (the test fails if the README's changes)."""
    text = (ROOT / "README.md").read_text()
    block = text.split('```python\nimport jax.numpy as jnp\n\nSTAGE = "scores"', 1)[1].split("```", 1)[0]
    kernel = 'import jax.numpy as jnp\n\nSTAGE = "scores"' + block
    assert kernel == KERNEL.format(scale=""), "the README's scores kernel changed: update KERNEL here"
    return kernel


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(run, home): `run(*argv)` runs a command of the user's environment in an empty directory
    outside the clone; `home` is that directory."""
    tmp = tmp_path_factory.mktemp("installed")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(tmp / "wheel")], check=True, cwd=tmp, capture_output=True)
    (wheel,) = (tmp / "wheel").glob("csa_parity-*.whl")
    assert f"dist/{wheel.name}[reference]" in (ROOT / "docs" / "running.md").read_text(), "the install command's name"
    names = zipfile.ZipFile(wheel).namelist()
    fixtures = sorted(p.name for p in (ROOT / "fixtures").iterdir())
    assert sorted(n.rpartition("/")[2] for n in names if n.startswith("harness/fixtures/")) == fixtures
    assert sorted(n for n in names if n.startswith("harness/profiles/")) == sorted(
        f"harness/profiles/{p.name}" for p in (ROOT / "harness" / "profiles").glob("*.json"))
    assert {n.split("/")[0] for n in names if not n.startswith("csa_parity-")} == {"harness", "jax_impl", "torch_ref"}

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bindir = venv / "bin"
    site = Path(subprocess.run([bindir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "reuse_installed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bindir / "python"), "install", "--no-deps", "-q",
                    str(wheel)], check=True, capture_output=True)

    home = tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CSA_PARITY_FIXTURES", "VIRTUAL_ENV")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"

    def run(*argv: str) -> subprocess.CompletedProcess:
        exe = bindir / argv[0] if (bindir / argv[0]).exists() else argv[0]
        return subprocess.run([str(exe), *argv[1:]], cwd=home, env=env, capture_output=True, text=True, timeout=600)

    return run, home, venv


def test_the_wheel_runs_from_an_empty_directory_outside_the_clone(user):
    run, home, venv = user
    where = run("python", "-c", "import harness, jax_impl, torch_ref; print(harness.__file__, jax_impl.__file__, "
                "torch_ref.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(venv) + os.sep) for p in where.stdout.split()), where.stdout
    assert run("python", "-c", "import benchmarks").returncode == 1  # no top-level name but the project's own
    version = run("csa-parity", "--version")
    assert version.returncode == 0 and version.stdout.startswith("csa-parity 0.") and "jax " in version.stdout

    # The ci sample's one point of tiny in float64: a program the matrix compiled into `make test`'s
    # shared compilation cache (JAX's key holds no source path: the wheel's copy loads it). Tiny's
    # four float32 points of the default sample cost 19 s of CPU on an empty cache, this one 9 s
    # (6 s loaded).
    main = run("csa-parity", "run", "--reference", "goldens", "--cases", "tiny", "--dtypes", "float64", "--sample",
               "ci", "--no-progress", "--jobs", "1", "--out", "goldens")
    assert main.returncode == 0, main.stdout + main.stderr
    report = json.loads((home / "goldens" / "parity.json").read_text())
    packaged = str(venv)
    assert report["fixtures"]["dir"].startswith(packaged) and report["fixtures"]["dir"].endswith("harness/fixtures")
    manifest = (ROOT / "fixtures" / "MANIFEST.json").read_bytes()
    import hashlib

    assert report["fixtures"]["manifest_sha256"] == hashlib.sha256(manifest).hexdigest()
    assert report["versions"]["csa-parity"] != "absent" and report["summary"]["failed"] == 0

    # a user's kernel through --impl: the scaled one, whose exit code and rerun line say it failed (the
    # README's own kernel passes under the plugin below, which judges the same entries)
    (home / "mykernel.py").write_text(KERNEL.format(scale=" * 1.01"))
    bad = run("csa-parity", "run", "--impl", "mykernel", "--cases", "tiny", "--dtypes", "float32", "--no-progress",
              "--jobs", "1", "--out", "bad")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert json.loads((home / "bad" / "parity.json").read_text())["summary"]["failed"] > 0
    assert "rerun: csa-parity run --cases tiny --dtypes float32 --ichunks 0 --tchunks 0 --qchunks 0 --teachers joint " \
           "--impl mykernel" in bad.stdout


@pytest.mark.parametrize("scale, verdict", [("", "passed"), (" * 1.01", "failed")])
def test_the_pytest_plugin_judges_a_users_kernel_beside_the_users_tests(user, scale, verdict):
    run, home, venv = user
    (home / "mykernel.py").write_text(_readme_kernel() if not scale else KERNEL.format(scale=scale))
    (home / "test_mine.py").write_text(USER_TEST)
    out = run("python", "-m", "pytest", "--csa-parity-impl=mykernel", "--csa-parity-cases=tiny",
              "--csa-parity-dtypes=float32", "-n", "2", "-p", "no:cacheprovider", "-rA", "--junitxml=junit.xml")
    ids = [f"csa-parity::test_parity[mykernel-tiny-float32-ichunk0-tchunk0-stage-{q}]"
           for q in ("stage.scores", "stage_grad.scores.q", "stage_grad.scores.keys", "stage_grad.scores.head_weights")]
    lines = out.stdout.splitlines()
    assert "PASSED test_mine.py::test_the_users_own_test_runs_and_imports_the_installed_harness" in lines, out.stdout
    for node in ids:
        assert f"{verdict.upper()} {node}" in "\n".join(lines), out.stdout
    assert (home / "junit.xml").exists()
    if verdict == "passed":
        assert out.returncode == 0, out.stdout
    else:
        assert out.returncode == 1 and "rerun: csa-parity run --cases tiny --dtypes float32" in out.stdout, out.stdout

"""What the package reads and says about itself, in a clone: where its data lies
(harness.package_data), `csa-parity --version`, `--fixtures`, and the pytest plugin left off.
The installed wheel is tests/test_installed.py's. No JAX program."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import CPU_PINS, package_data
from harness.run.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_a_clone_reads_its_own_fixtures_and_profiles():
    assert package_data.source_tree() == ROOT
    assert package_data.packaged_fixtures_dir() == ROOT / "fixtures"
    assert package_data.profiles_dir() == ROOT / "harness" / "profiles"
    found = package_data.fixture_set(ROOT / "fixtures")
    assert found == {"dir": str(ROOT / "fixtures"),
                     "manifest_sha256": hashlib.sha256((ROOT / "fixtures" / "MANIFEST.json").read_bytes()).hexdigest()}
    assert package_data.fixture_set("/nonexistent")["manifest_sha256"] is None


def test_version_names_the_package_and_the_frameworks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("csa-parity 0.1.0 (jax ") and ", torch " in out, out


def test_fixtures_names_a_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(package_data.FIXTURES_ENV, raising=False)
    assert main(["run", "--list", "--cases", "tiny", "--fixtures", str(tmp_path / "none")]) == 2
    assert f"--fixtures='{tmp_path / 'none'}' is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(package_data.FIXTURES_ENV, "")  # restored after the test: --fixtures sets it
    assert main(["run", "--list", "--cases", "tiny", "--fixtures", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "tiny.safetensors is missing: run `csa-parity regenerate --case tiny --fixtures-dir" in err, err


def test_the_plugin_left_off_changes_nothing(tmp_path):
    """A pytest run without --csa-parity-impl: the plugin is loaded (pytest11) but collects nothing,
    imports no framework and leaves torch's CPU-kernel variables as the user had them."""
    (tmp_path / "test_user.py").write_text(
        "import os, sys\n\n"
        "def test_untouched():\n"
        "    assert 'csa_parity' in [name for name, _ in __import__('pytest').__dict__.get('_plugins', [])] or True\n"
        f"    assert not [n for n in {sorted(CPU_PINS)!r} if n in os.environ], os.environ\n"
        "    assert 'jax' not in sys.modules and 'torch' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k not in CPU_PINS and k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--trace-config", "test_user.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "harness/run/pytest_plugin.py" in proc.stdout and "1 passed" in proc.stdout, proc.stdout
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--csa-parity-impl=jax", "--csa-parity-sample=huge", "test_user.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and "--csa-parity-sample='huge' is not supported (valid: ci, default, full, tpu)" \
        in bad.stderr, bad.stdout + bad.stderr

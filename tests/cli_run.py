"""`csa-parity run` in a subprocess, as a user types it, for the tests of plug-ins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(tmp_path, *args):
    """(the finished process, its parity.json or None): `csa-parity run --out tmp_path/rep
    --no-progress --jobs 1 ARGS` from the repository root, the tests' plug-ins importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "harness.run.cli", "run", "--out", str(out), "--no-progress",
                           "--jobs", "1", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    report = json.loads((out / "parity.json").read_text()) if (out / "parity.json").exists() else None
    return proc, report

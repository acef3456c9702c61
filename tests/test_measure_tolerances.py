"""scripts/measure_tolerances.py (the command harness/judging/tolerance.py cites for its measured
figures) keeps running: its CLI on the `tiny` fixture, and its CHUNK measurement on a small
random problem with two chunk sizes. Cheap by design (a few small compiles); the full
measurement is the script itself. It judges nothing, so neither do these tests beyond
"every figure is computed, finite and printed beside its bound"."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from harness.judging import tolerance

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "measure_tolerances.py"
ROW = re.compile(r"^  (\S+) (\S+).*measured (\S+) +bound (\S+) +ratio (\S+)", re.M)


def _module():
    spec = importlib.util.spec_from_file_location("measure_tolerances", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_orders_and_fixture_check_on_tiny():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--only", "orders", "--only", "fixtures",
                           "--case", "tiny", "--dtype", "float32"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = ROW.findall(proc.stdout)
    # 3 kinds in each of the two sections
    assert len(rows) == 6 and {r[0] for r in rows} == {"float32"}, proc.stdout
    for dtype, kind, measured, bound, ratio in rows:
        assert math.isfinite(float(measured)) and float(bound) > 0 and math.isfinite(float(ratio)), proc.stdout
    assert "ORDERS" in proc.stdout and "FIXTURE_CHECK" in proc.stdout


def test_chunk_measurement_on_a_small_problem():
    mod = _module()
    got = mod.chunk_measure([0], dtypes=("float32",), batch=1, seq=16, ichunks=[2], tchunks=[], qchunks=[5])
    assert set(got) == {("float32", "head"), ("float32", "query")}
    for (dtype, _), (worst, flips) in got.items():
        assert set(worst) == set(tolerance.CHUNK[dtype])
        assert all(math.isfinite(v) and v >= 0 for v in worst.values()), worst
        assert flips >= 0
    line = mod.row("float32 head-chunks grad", got[("float32", "head")][0]["grad"], tolerance.CHUNK["float32"]["grad"])
    assert "measured" in line and "bound" in line and "ratio" in line
    rng = np.random.default_rng(0)
    q_latent, wq_b = rng.standard_normal((1, 4, 8)), rng.standard_normal((8, 2 * 4))  # 2 heads of DI=4
    flips = mod.projection_flips(q_latent.astype(np.float32), wq_b.astype(np.float32), 4, "float32")
    assert set(flips) == {1, 2} and all(0 <= n <= total == 32 for n, total in flips.values())

"""`csa-parity run` on a device whose chip one process at a time may open (a TPU), simulated on CPU.

harness.platforms.FAKE_EXCLUSIVE_ENV names a lock file that stands for the chip: the process
that opens the backend takes it, and a second one fails with libtpu's own words ("The TPU is
already in use by process with pid N"). With it:

- the process that writes the reports never opens the device: the workers do, one first, and
  report what they found (parity.json's platform block);
- `--jobs 2` runs one worker and says so in one line;
- a chip held by another program stops the run with one line naming the cause and the fix, exit
  status 2, no traceback, no report of errored points.

Each run: tiny and small, float32, their native forward point, goldens (~5 s each, 3 runs). The
compiled programs are those the matrix tests leave in the shared compilation cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import platforms

REPO = Path(__file__).resolve().parent.parent
ARGS = ["run", "--cases", "tiny,small", "--dtypes", "float32", "--ichunks", "0", "--tchunks", "0", "--qchunks", "0",
        "--teachers", "joint", "--modes", "forward", "--reference", "goldens", "--no-progress"]


def _run(args, tmp_path, lock):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env[platforms.FAKE_EXCLUSIVE_ENV] = str(lock)
    return subprocess.run([sys.executable, "-m", "harness.run.cli", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)


def test_jobs_above_one_process_per_chip_are_serialised_and_the_report_names_the_device(tmp_path):
    out = tmp_path / "rep"
    proc = _run([*ARGS, "--jobs", "2", "--out", str(out)], tmp_path, tmp_path / "chip.lock")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("csa-parity:")]
    assert lines == ["csa-parity: --jobs 2: a CPU host's chips open in one process at a time; running the points one "
                     "after another in 1 worker, which compiles their programs ahead in threads"]
    data = json.loads((out / "parity.json").read_text())
    plat = data["platform"]
    assert plat["processes_per_host"] == 1 and plat["simulated"].startswith("one process at a time")
    assert plat["jaxlib_version"] and plat["device_kind"] == "cpu" and plat["matmul_precision"] == "highest"
    assert plat["tolerance"] == {"precision_profile": "highest", "platform_profile": None, "platform_factors": None,
                                 "note": "the CPU's bounds"}
    assert "avx2" in plat["cpu"]["isa"] or plat["cpu"]["isa"] == [] or plat["cpu"]["machine"] != "x86_64"
    # the kernel-selecting variables as the run saw them: the harness's pins where the user set none
    assert plat["cpu_kernel_variables"]["MKL_CBWR"] == os.environ.get("MKL_CBWR", "COMPATIBLE")
    assert data["summary"]["failed"] == 0 and data["summary"]["errors"] == 0
    md = (out / "parity.md").read_text().splitlines()
    assert any(line.startswith("- csa-parity ") and "fixtures " in line for line in md)  # the versions header
    [device] = [line for line in md if line.startswith("- device: ")]
    assert device.startswith("- device: cpu cpu x1; jax ") and "tolerances: `highest` precision profile" in device
    assert "MKL_CBWR=" in device


def test_a_chip_held_by_another_program_is_one_line(tmp_path):
    lock = tmp_path / "chip.lock"
    with open(lock, "a+") as held:  # this test process holds the chip
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(str(os.getpid()))
        held.flush()
        for jobs in ("1", "3"):
            proc = _run([*ARGS, "--jobs", jobs, "--out", str(tmp_path / "rep")], tmp_path, lock)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert "Traceback" not in proc.stderr, proc.stderr
            [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            assert line.startswith(f"csa-parity: error: the TPU is in use by process {os.getpid()} (")
            assert line.endswith("a TPU chip opens in one process at a time: end process "
                                 f"{os.getpid()}, or wait for it to finish, then run again")
            assert not (tmp_path / "rep" / "parity.json").exists() or \
                json.loads((tmp_path / "rep" / "parity.json").read_text())["summary"]["checks"] == 0


def test_which_hosts_start_one_worker_first(monkeypatch):
    monkeypatch.delenv(platforms.FAKE_EXCLUSIVE_ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not platforms.may_be_one_process()
    monkeypatch.setenv(platforms.FAKE_EXCLUSIVE_ENV, "/nonexistent/lock")
    assert platforms.may_be_one_process()
    line = platforms.busy_line("Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process "
                               "with pid 77. Not attempting to load libtpu.so in this process.")
    assert line.startswith("the TPU is in use by process 77 (") and "end process 77" in line


@pytest.mark.torch
def test_torch_capability_is_read_only_where_torch_is_imported():
    """parity.json's torch_cpu_capability comes from a worker whose reference imported torch;
    asking never imports it."""
    code = ("import sys; from harness import platforms; a = platforms.torch_cpu_capability(); "
            "assert 'torch' not in sys.modules; import torch; b = platforms.torch_cpu_capability(); "
            "print(a, b == torch.backends.cpu.get_cpu_capability(), b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    first, same, value = out.stdout.split()
    assert first == "None" and same == "True" and value

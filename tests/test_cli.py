"""The main job end to end: `csa-parity run` on a small selection, its reports, the
JAX-only mode (no torch importable), plug-ins, and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(args, tmp_path, env_extra=None, block_torch=False):
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "tests")]
    if block_torch:
        blocker = tmp_path / "blocker"
        blocker.mkdir(exist_ok=True)
        (blocker / "torch.py").write_text("raise ImportError('torch is blocked: JAX-only mode must not import it')\n")
        paths.insert(0, str(blocker))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "harness.run.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


@pytest.mark.torch  # the live reference
def test_run_writes_reports_and_passes(tmp_path):
    out = tmp_path / "rep"
    # The ci sample's points of tiny (float64 native, float16 native and combined): programs the
    # matrix tests compiled into `make test`'s shared compilation cache.
    proc = _run(["run", "--cases", "tiny", "--dtypes", "float64,float16", "--sample", "ci", "--out", str(out),
                 "--no-progress", "--jobs", "1"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny" in proc.stdout and "0 failed" in proc.stdout
    data = json.loads((out / "parity.json").read_text())
    assert data["schema_version"] == 9 and data["reference"] == "live"
    statuses = data["summary"]["statuses"]
    assert list(statuses) == ["passed", "failed", "excused", "not_provided", "not_applicable", "error"]
    assert sum(statuses.values()) == data["summary"]["checks"] and statuses["failed"] == 0
    assert {r["status"] for r in data["results"]} <= {"passed", "excused"}
    assert {r["rerun"] for r in data["results"]} == {None}  # only failed and errored records carry one
    assert data["platform"]["backend"] == "cpu" and data["platform"]["matmul_precision"] == "highest"
    assert data["summary"]["failed"] == 0 and data["summary"]["checks"] == len(data["results"])
    assert {r["dtype"] for r in data["results"]} == {"float64", "float16"}
    assert {"oracle", "exact64", "chunk", "topk", "isolation", "oracle@sel"} <= {r["check"] for r in data["results"]}
    md = (out / "parity.md").read_text()
    assert md.startswith("# csa-parity report: PASS") and "| tiny | float64 |" in md
    assert (out / "parity_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jax_only_mode_needs_no_torch(tmp_path):
    out = tmp_path / "rep"
    proc = _run(["run", "--cases", "tiny", "--dtypes", "float64", "--sample", "ci", "--reference", "goldens", "--out", str(out),
                 "--no-progress", "--jobs", "1"], tmp_path, block_torch=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "parity.json").read_text())
    assert data["reference"] == "goldens" and "torch_version" not in data["platform"]
    assert data["summary"]["failed"] == 0


@pytest.mark.torch  # the live reference
def test_a_wrong_plugin_fails_with_exit_1_and_says_where(tmp_path):
    proc = _run(["run", "--cases", "tiny", "--dtypes", "float64", "--ichunks", "0", "--modes", "dense",
                 "--impl", "plugins.scaled_loss:make_impl", "--out", str(tmp_path / "rep"), "--no-progress",
                 "--jobs", "1"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL [tiny float64 ichunk=0 tchunk=0 dense impl=plugins.scaled_loss:make_impl] loss (exact64)" in proc.stdout
    assert "greatest normalised difference: 0.01" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cases", "nope"], "unknown case 'nope' (valid: tiny, small,"),
        (["--cases", "small", "--ichunks", "3"],
         "case 'small': indexer_head_chunk=3 must divide index_n_heads=8 (valid: 0, 1, 2, 4, 8)"),
        (["--cases", "small", "--tchunks", "-1"],
         "case 'small': loss_head_chunk=-1 must divide num_query_heads=8 (valid: 0, 1, 2, 4, 8)"),
        (["--dtypes", "int8"], "dtype='int8' is not supported (valid: float32, bfloat16, float16, float64)"),
        (["--impl", "no_such_pkg.mod:make"], "implementation 'no_such_pkg.mod:make': cannot import module 'no_such_pkg.mod'"),
        (["--impl", "plugins.scaled_loss:nothing"], "implementation 'plugins.scaled_loss:nothing': module 'plugins.scaled_loss' has no 'nothing'"),
        (["--out", "/proc/csa-parity-cannot-write"], "report directory '/proc/csa-parity-cannot-write' is not writable"),
        (["--cache-dir", "/proc/csa-parity-cannot-write"],
         "cache directory '/proc/csa-parity-cannot-write' is not writable"),
    ],
    ids=["unknown-case", "ichunk-not-divisor", "tchunk-negative", "bad-dtype", "impl-missing-module",
         "impl-missing-factory", "unwritable-out", "unwritable-cache"],
)
def test_user_errors_exit_2_with_one_line(args, message, tmp_path):
    proc = _run(["run", "--no-progress", *args], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("csa-parity: error: ") and message in lines[0], lines[0]


def test_a_plugins_run_arguments_are_checked_without_jax_impl(tmp_path):
    """The CLI checks chunk sizes by the harness's own rule and loads fixtures by the format's
    own rules: for a plug-in that is not jax_impl, jax_impl is never imported (the code under
    test does not validate the fixtures or the plug-in's arguments)."""
    plugin = tmp_path / "numpy_plugin.py"
    plugin.write_text("class CSAConfig(dict):\n    from_dict = classmethod(lambda cls, d: cls(d))\n\n"
                      "def indexer_forward(params, inputs, cfg, dtype):\n    raise NotImplementedError\n")
    code = ("import sys; from harness.run import cli; "
            "args = cli.build_parser().parse_args(['run', '--impl', 'numpy_plugin', '--cases', 'small', '--ichunks', '2', "
            "'--qchunks', '5', '--no-progress', '--out', sys.argv[1]]); "
            "cli._validate_run_args(args); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'jax_impl'); "
            "assert not bad, f'checking the arguments imported {bad}'; "
            "args.ichunks = [3]\n"
            "try:\n    cli._validate_run_args(args)\nexcept ValueError as e:\n    print(e)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "reports")], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("case 'small': indexer_head_chunk=3 must divide index_n_heads=8 "
                                   "(valid: 0, 1, 2, 4, 8)")

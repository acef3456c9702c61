"""The GitHub workflows: .github/workflows/tpu-parity.yml and ci.yml.

- Structure: the triggers, paths, runner labels, permissions, pins and artifacts the workflows must have.
- Lint: the GitHub workflow JSON schema (check-jsonschema's vendored copy) and zizmor's
  security audits, offline; skipped with a reason where the tool is not installed.
- The TPU job's own shell steps, run here with JAX_PLATFORMS=cpu and tiny selections through
  the environment variables the steps read, so a typo in a command fails here, not on a TPU.
  Every step is syntax-checked with `bash -n`; all but the install step are executed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
TPU = WORKFLOWS / "tpu-parity.yml"
CI = WORKFLOWS / "ci.yml"
SHA = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")

# The TPU job's steps that are only syntax-checked here: installing would change this venv.
NOT_EXECUTED = {"install"}


def _load(path: Path) -> dict:
    wf = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as the boolean True.
    if True in wf:
        wf["on"] = wf.pop(True)
    return wf


def _job(wf: dict) -> dict:
    (job,) = wf["jobs"].values()
    return job


def _run_steps(job: dict) -> list[dict]:
    return [s for s in job["steps"] if "run" in s]


@pytest.fixture(scope="module")
def tpu() -> dict:
    return _load(TPU)


@pytest.fixture(scope="module")
def ci() -> dict:
    return _load(CI)


# --------------------------------------------------------------------------- structure


def test_tpu_triggers(tpu):
    on = tpu["on"]
    assert {"jax_impl/**", "harness/**"} <= set(on["pull_request"]["paths"])
    assert on["schedule"] and all("cron" in s for s in on["schedule"])
    assert "workflow_dispatch" in on


def test_tpu_runner_labels_are_an_input_with_a_default(tpu):
    inputs = tpu["on"]["workflow_dispatch"]["inputs"]
    labels = inputs["runner_labels"]
    default = json.loads(labels["default"])
    assert "self-hosted" in default and "tpu" in default and labels["description"]
    runs_on = _job(tpu)["runs-on"]
    assert "inputs.runner_labels" in runs_on
    # Schedules and pull requests have no inputs: the expression must fall back to the same default.
    fallback = re.search(r"\|\|\s*'([^']*)'", runs_on).group(1)
    assert json.loads(fallback) == default


def test_tpu_job_skips_fork_pull_requests(tpu):
    cond = _job(tpu)["if"]
    assert "github.event.pull_request.head.repo.full_name == github.repository" in cond


def test_tpu_commands(tpu):
    job = _job(tpu)
    assert "JAX_PLATFORMS" not in job["env"]  # unset: JAX picks the TPU
    runs = {s["id"]: s["run"] for s in _run_steps(job)}
    assert "-c constraints.txt -e '.[tpu,reference]'" in runs["install"]
    assert "python -m harness.run.platform_table" in runs["platform"]
    assert 'torch==2.13.0+cpu' in runs["install"]
    assert "scripts/regenerate_fixtures.py --check" in runs["check"]
    assert re.search(r'python -m pytest -n "\$PYTEST_WORKERS" --junitxml=', runs["matrix"])
    assert "csa-parity run" in runs["report"] and '--jobs "$PARITY_JOBS"' in runs["report"]
    assert '--sample "$CSA_PARITY_SAMPLE"' in runs["report"] and "'tpu'" in job["env"]["CSA_PARITY_SAMPLE"]
    # Random configurations: the nightly hypothesis profile except on pull requests.
    assert "$RANDOM_ARGS" in runs["random"] and "tests/test_random_configs.py" in job["env"]["RANDOM_ARGS"]
    assert "'nightly'" in job["env"]["HYPOTHESIS_PROFILE"] and "'ci'" in job["env"]["HYPOTHESIS_PROFILE"]
    assert "install -c constraints.txt hypothesis" in runs["install"]
    # One process owns the TPU (see the workflow's comment): one pytest worker, one CLI job.
    assert job["env"]["PARITY_JOBS"] == "1"
    assert tpu["on"]["workflow_dispatch"]["inputs"]["pytest_workers"]["default"] == "0"
    assert "|| '0'" in job["env"]["PYTEST_WORKERS"]


@pytest.mark.parametrize("name", ["tpu", "ci"])
def test_security_basics(name, request):
    wf = request.getfixturevalue(name)
    assert wf["permissions"] == {"contents": "read"}
    for job in wf["jobs"].values():
        assert "permissions" not in job or job["permissions"] == {"contents": "read"}
        for step in job["steps"]:
            if "uses" in step:
                assert SHA.match(step["uses"]), f"{step['uses']} is not pinned to a full commit SHA"
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False
            # Commands read only environment variables: no ${{ }} expansion inside a shell.
            assert "${{" not in step.get("run", ""), step.get("name")


@pytest.mark.parametrize("name,prefix", [("tpu", "tpu-parity"), ("ci", "cpu")])
def test_artifacts(name, prefix, request):
    job = _job(request.getfixturevalue(name))
    uploads = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@")]
    paths = {s["with"]["path"] for s in uploads}
    assert paths == {"${{ env.JUNIT_DIR }}", "${{ env.REPORTS_DIR }}"}
    assert all(s["if"] == "${{ !cancelled() }}" for s in uploads)
    assert all(s["with"]["name"].startswith(prefix) for s in uploads)
    runs = " ".join(s["run"] for s in _run_steps(job))
    assert '--junitxml="$JUNIT_DIR/' in runs or ".ci/run" in runs
    assert '--out "$REPORTS_DIR"' in runs


def test_ci_mirrors_ci_run(ci):
    job = _job(ci)
    assert job["runs-on"].startswith("ubuntu-")
    runs = {s["id"]: s["run"] for s in _run_steps(job)}
    assert ".ci/run" in runs["suite"]
    assert "scripts/regenerate_fixtures.py --check" in runs["check"]
    assert "csa-parity run" in runs["report"]
    assert "-c constraints.txt -e '.[dev,reference]'" in runs["install"]
    # both legs of .ci/run: Python 3.11 (default) and 3.12 on PATH
    assert job["steps"][1]["with"]["python-version"].split() == ["3.12", "3.11"]


# --------------------------------------------------------------------------- linters


def _tool(name: str) -> list[str]:
    exe = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install -c constraints.txt {name})")
    return [exe]


def test_workflows_match_the_github_schema():
    cmd = _tool("check-jsonschema") + ["--builtin-schema", "vendor.github-workflows", str(TPU), str(CI)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_zizmor_finds_nothing():
    # --offline: no network audits (this test must pass without network); the pedantic persona
    # reports code smells too. The one suppressed finding is the auditor-only note that the job
    # runs on a self-hosted runner, which is the point of the TPU workflow.
    cmd = _tool("zizmor") + ["--offline", "--no-progress", "--pedantic", "--color", "never", str(TPU), str(CI)]
    env = {k: v for k, v in os.environ.items() if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------- the TPU job's steps on CPU


def _step_params():
    job = _job(_load(TPU))
    return [pytest.param(s, id=s["id"]) for s in _run_steps(job)]


def test_every_run_step_has_an_id(tpu, ci):
    for wf in (tpu, ci):
        assert all("id" in s for s in _run_steps(_job(wf)))


@pytest.mark.parametrize("wf_path", [TPU, CI], ids=["tpu", "ci"])
def test_run_steps_are_valid_bash(wf_path):
    for step in _run_steps(_job(_load(wf_path))):
        out = subprocess.run(["bash", "-n", "-c", step["run"]], capture_output=True, text=True)
        assert out.returncode == 0, f"step {step['id']!r}: {out.stderr}"


def _cpu_env(job: dict, tmp_path: Path) -> dict[str, str]:
    """The job's env with the TPU replaced by CPU and every selection made tiny."""
    overrides = {
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",
        "PYTEST_WORKERS": "1",
        "PARITY_JOBS": "1",
        "CSA_PARITY_SAMPLE": "ci",
        "PYTEST_ARGS": "tests/test_cases.py -k test_required_cases_present -p no:cacheprovider",
        "CHECK_ARGS": "--case tiny",
        "PARITY_ARGS": "--cases tiny --dtypes float64 --sample ci",  # one point, compiled by the matrix tests
        "HYPOTHESIS_PROFILE": "ci",
        "RANDOM_ARGS": ("tests/test_random_configs.py -k round_trips -p no:cacheprovider"),
        "REPORTS_DIR": str(tmp_path / "reports"),
        "JUNIT_DIR": str(tmp_path / "junit"),
    }
    # Not this pytest's own settings (xdist worker ids, PYTEST_ADDOPTS with a --junitxml the
    # nested run would overwrite): the steps run as in a fresh shell on the runner.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    for key, value in job["env"].items():
        value = str(value)
        if "${{" in value:
            assert key in overrides, f"job env {key} is an expression: give it a CPU value in this test"
        env[key] = overrides.get(key, value)
    env.update(overrides)
    env.pop("XLA_FLAGS", None)
    env["GITHUB_PATH"] = str(tmp_path / "github_path")
    # `python` and `csa-parity` are this venv's, as .venv/bin on the runner's PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("step", _step_params())
def test_tpu_step_runs_on_cpu(step, tmp_path):
    if step["id"] in NOT_EXECUTED:
        pytest.skip(f"step {step['id']!r} is only syntax-checked here (it would install into this venv)")
    if step["id"] == "report" and importlib.util.find_spec("harness.run.cli") is None:
        pytest.skip("csa-parity CLI not available")
    job = _job(_load(TPU))
    env = _cpu_env(job, tmp_path)
    cmd = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"step {step['id']!r} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    if step["id"] == "matrix":
        assert (tmp_path / "junit" / "parity-tpu.xml").is_file()
    if step["id"] == "report":
        assert (tmp_path / "reports" / "parity.json").is_file()
    if step["id"] == "random":
        assert (tmp_path / "junit" / "random-configs-tpu.xml").is_file()


# --------------------------------------------------------------------------- .ci/run's 3.12 leg


def test_python312_leg_fails_with_one_line_when_no_python312_is_found(tmp_path):
    """The jax 0.12 leg must never pass silently for want of a Python 3.12."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    out = subprocess.run([make, "-s", "venv312", "PYTHON312=", f"VENV312={tmp_path / 'v'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    # make's own "*** [target] Error 1" line, "make[1]: ***" when this suite itself runs under make
    lines = [ln for ln in out.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", ln)]
    assert lines == ["make: no Python 3.12 found (PATH or pyenv): the jax 0.12 leg cannot run; install one "
                     "or set PYTHON312=/path/to/python3.12"], out.stderr
    assert not (tmp_path / "v").exists()


def test_ci_run_runs_both_legs():
    text = (ROOT / ".ci" / "run").read_text()
    assert "make test " in text + " " and "make test312" in text
    assert 'exit "$status"' in text  # a failed first leg still fails the run after the second

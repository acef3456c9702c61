"""Stage plug-ins, partial plug-ins, a plug-in that raises, and the first diverging
stage of planted mistakes in a copy of jax_impl."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli_run import run_cli
from harness.points import Entry, Point
from harness.run.collect import evaluate

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torch


def test_the_example_scoring_kernel_runs_green_through_the_cli(tmp_path):
    proc, report = run_cli(tmp_path, "--impl", "examples.scores_kernel", "--cases", "tiny", "--dtypes", "float32,bfloat16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report["summary"]["statuses"]
    # 2 dtypes x 4 stage quantities judged; every pipeline entry of the 2 native points not provided
    assert st["passed"] == 8 and st["failed"] == 0 and st["error"] == 0
    assert st["not_provided"] == 52


def test_a_forward_only_plugin_runs_green_with_the_losses_not_provided(tmp_path):
    proc, report = run_cli(tmp_path, "--impl", "plugins.stage_plugins:forward_only", "--cases", "tiny",
                        "--dtypes", "float32", "--ichunks", "0", "--tchunks", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report["summary"]["statuses"]
    assert st["failed"] == 0 and st["passed"] == 3  # keys, scores, top-k
    # per teacher (tiny holds both): 2 modes x (loss, 6 grads, input_grads) + sparse_at_oracle halves
    assert st["not_provided"] == 2 * 23


@pytest.mark.parametrize("bug", ["drop_head", "relu_after_sum"])
def test_a_scoring_kernel_with_a_planted_bug_fails_naming_the_stage(bug):
    entry = Entry(Point("tiny", "float32"), "stage", "stage.scores", f"plugins.stage_plugins:{bug}")
    (result,) = evaluate(entry)
    assert result.status == "failed", result.message
    assert "stage.scores (oracle): MISMATCH" in result.message


def test_a_jax_kernel_gets_jax_arrays_in_its_forward_call_and_its_gradient():
    """`keys.at[...]` on the inputs works in the forward call as under jax.vjp: the kernel is
    handed JAX arrays on JAX's default device in both (it raises otherwise)."""
    spec = "plugins.stage_plugins:padded_tiles"
    for quantity in ("stage.scores", "stage_grad.scores.keys"):
        (result,) = evaluate(Entry(Point("tiny", "float32"), "stage", quantity, spec))
        assert result.status == "passed", result.message


def test_a_numpy_kernel_says_so_and_gets_numpy_arrays():
    (forward,) = evaluate(Entry(Point("tiny", "float32"), "stage", "stage.scores", "plugins.stage_plugins:numpy_scores"))
    assert forward.status == "passed", forward.message
    (grad,) = evaluate(Entry(Point("tiny", "float32"), "stage", "stage_grad.scores.q",
                             "plugins.stage_plugins:numpy_scores"))
    assert grad.status == "not_provided" and "not a JAX array" in grad.message, grad.message


def test_an_unknown_array_kind_is_one_line(tmp_path):
    proc, _ = run_cli(tmp_path, "--impl", "plugins.stage_plugins:bad_arrays", "--cases", "tiny", "--list")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("csa-parity: error: implementation 'plugins.stage_plugins:bad_arrays': "
                                   "ARRAYS='torch' is not an array kind the harness hands a stage (valid: jax, "
                                   "numpy; default jax)"), proc.stderr


def test_a_plugin_that_raises_on_one_case_does_not_stop_the_run(tmp_path):
    proc, report = run_cli(tmp_path, "--impl", "plugins.stage_plugins:raising", "--cases", "tiny,small",
                        "--dtypes", "float32", "--modes", "forward", "--ichunks", "0", "--tchunks", "0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    recs = report["results"]
    assert all(r["status"] == "passed" for r in recs if r["case"] == "tiny")
    errors = [r for r in recs if r["case"] == "small"]
    assert errors and all(r["status"] == "error" for r in errors)
    assert ("plug-in plugins.stage_plugins:raising raised in indexer_forward at small float32 ichunk=0 tchunk=0: "
            "ValueError: shape mismatch in my kernel") in errors[0]["message"]
    rerun = ("csa-parity run --cases small --dtypes float32 --ichunks 0 --tchunks 0 --qchunks 0 --modes forward "
             "--teachers joint --impl plugins.stage_plugins:raising")
    assert {r["rerun"] for r in errors} == {rerun}
    assert "ERROR plug-in plugins.stage_plugins:raising raised in indexer_forward" in proc.stdout
    assert f"\n  rerun: {rerun}\n" in proc.stdout


# One planted mistake per stage in a copy of jax_impl: (file, old, new, entry mode, quantity, expected line).
PLANTED = {
    "pooling": ("pooling.py", "    gate = round_to(gate.astype(wide) + ape.astype(wide), x.dtype)",
                "    gate = round_to(gate.astype(wide), x.dtype)", "forward", "index_scores",
                "first diverges at pooled"),
    "rope": ("scoring.py", "apply_rope(q, position_ids[:, :, None],", "apply_rope(q, position_ids[:, :, None] + 1,",
             "forward", "index_scores", "first diverges at queries"),
    "head_weights": ("scoring.py", "* (n_heads**-0.5)", "* (n_heads**-1.0)", "forward", "index_scores",
                     "first diverges at head_weights"),
    "scores": ("scoring.py", "    return jnp.sum(hw[..., None] * jax.nn.relu(logits), axis=2)",
               "    return jnp.sum(hw[..., None] * logits, axis=2)", "forward", "index_scores",
               "first diverges at scores"),
    "teacher": ("loss.py", "    return t / (jnp.sum(t, axis=-1, keepdims=True) + EPS)",
                "    return t / (jnp.sum(t, axis=-1, keepdims=True) + 1.0)", "dense", "loss",
                "first diverges at teacher"),
    "student": ("loss.py", "jax.nn.log_softmax(z, axis=-1)", "jax.nn.log_softmax(1.01 * z, axis=-1)", "dense",
                "loss", "first diverges at student"),
    "backward": ("scoring.py", "    dhw = jnp.sum(q * mk, axis=-1)", "    dhw = 1.01 * jnp.sum(q * mk, axis=-1)",
                 "dense", "grad.indexer.weights_proj", "the forward agrees"),
}


@pytest.mark.parametrize("stage", list(PLANTED))
def test_a_planted_mistake_names_its_first_diverging_stage(stage, tmp_path, monkeypatch):
    file, old, new, mode, quantity, expected = PLANTED[stage]
    name = f"csa_planted_{stage}"
    shutil.copytree(ROOT / "jax_impl", tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    src = (tmp_path / name / file).read_text()
    assert src.count(old) == 1, old
    (tmp_path / name / file).write_text(src.replace(old, new))
    monkeypatch.syspath_prepend(str(tmp_path))
    results = evaluate(Entry(Point("tiny", "float64"), mode, quantity, name))
    failed = [r for r in results if r.failed]
    assert failed, [r.message for r in results]
    assert expected in failed[0].message, failed[0].message
    assert failed[0].stats["first_divergence"].startswith(expected)


def test_an_error_fails_the_matrix_like_a_mismatch():
    """A raising implementation is never a pass: `CheckResult.failed` is what the matrix test,
    the sharded slice and the mutation worker read, and it covers the error status."""
    results = evaluate(Entry(Point("small", "float32"), "forward", "index_scores", "plugins.stage_plugins:raising"))
    assert results and all(r.status == "error" and r.failed and not r.passed for r in results)

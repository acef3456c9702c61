"""A quantizer stage plug-in (`STAGE = "quantizer"`, docs/plugins.md): handed the live
reference's rotated queries and keys, its codes and scales must equal the reference's own
quantizer's on those values bit for bit (SPEC section 10), in every dtype. A numpy quantizer
written from the SPEC passes on the planted boundaries and the released V4 preset; the same
quantizer rounding half away from zero fails on the planted midpoints, naming the quantity and
the plug-in; a case that does not quantize is not applicable."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import run_cli
from harness.outputs import STAGE_MODE, stage_quantities
from harness.points import DTYPES, Entry, Point
from harness.run.collect import evaluate

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.torch

GOOD, HALF_AWAY = "plugins.quantizer_stage", "plugins.quantizer_half_away"
QUANTITIES = stage_quantities("quantizer")


def _results(impl: str, case: str, dtype: str) -> dict:
    return {q: evaluate(Entry(Point(case, dtype), STAGE_MODE, q, impl), "live") for q in QUANTITIES}


def test_the_quantizer_stage_has_four_quantities_and_no_gradients():
    assert QUANTITIES == ("stage.quantizer.query_codes", "stage.quantizer.query_scales",
                          "stage.quantizer.key_codes", "stage.quantizer.key_scales")


@pytest.mark.parametrize("case,dtype", [("quant_planted", d) for d in DTYPES] + [("quant_v4", "bfloat16")])
def test_a_correct_quantizer_is_identical_bit_for_bit(case, dtype):
    for q, results in _results(GOOD, case, dtype).items():
        assert [(r.check, r.status) for r in results] == [("identical", "passed")], [r.message for r in results]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_half_away_from_zero_fails_on_the_planted_midpoints(dtype):
    (result,) = _results(HALF_AWAY, "quant_planted", dtype)["stage.quantizer.query_codes"]
    assert result.status == "failed", result.message
    assert "stage.quantizer.query_codes (identical): MISMATCH" in result.message
    assert f"impl={HALF_AWAY}" in result.message


def test_a_case_that_does_not_quantize_is_not_applicable():
    for q, (result,) in _results(GOOD, "tiny", "float32").items():
        assert result.status == "not_applicable", result.message
        assert result.note == "case tiny does not quantize (index_quant is null)"


def test_the_quantizer_stage_needs_the_live_reference():
    (result,) = evaluate(Entry(Point("quant_planted", "float32"), STAGE_MODE, "stage.quantizer.query_codes", GOOD),
                         "goldens")
    assert result.status == "not_applicable" and "--reference live" in result.message, result.message


def test_codes_of_the_wrong_dtype_are_an_error_naming_the_quantizer():
    spec = f"{GOOD}:int64_codes"
    (result,) = evaluate(Entry(Point("quant_planted", "float32"), STAGE_MODE, "stage.quantizer.query_codes", spec))
    assert result.status == "error", result.message
    assert (f"plug-in {spec} raised in quantizer() (queries) at quant_planted float32 ichunk=0 tchunk=0: "
            "ValueError: quantizer() returned query codes of shape (1, 16, 2, 32) int64, expected (1, 16, 2, 32) "
            "uint8") in result.message, result.message


def test_a_quantizer_without_arrays_gets_jax_arrays():
    (result,) = evaluate(Entry(Point("quant_planted", "float32"), STAGE_MODE, "stage.quantizer.key_scales",
                               f"{GOOD}:jax_arrays"))
    assert result.status == "passed", result.message


def test_the_quantizer_runs_green_through_the_cli_on_the_quantized_cases(tmp_path):
    proc, report = run_cli(tmp_path, "--impl", GOOD, "--cases", "tiny,quant_planted", "--dtypes", "float32",
                        "--ichunks", "0", "--tchunks", "0", "--qchunks", "0", "--teachers", "joint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report["summary"]["statuses"]
    assert st["passed"] == 4 and st["failed"] == 0 and st["error"] == 0, st  # quant_planted's four
    stage = [r for r in report["results"] if r["mode"] == STAGE_MODE]
    assert {r["case"] for r in stage} == {"quant_planted"}


def test_a_quantizer_on_cases_that_do_not_quantize_is_one_line(tmp_path):
    proc, _ = run_cli(tmp_path, "--impl", GOOD, "--cases", "tiny", "--list")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"csa-parity: error: {GOOD} is a quantizer stage: the selection holds "
                                          "no case that quantizes (index_quant); choose among quant_v4"), proc.stderr

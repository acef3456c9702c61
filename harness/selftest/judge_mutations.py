"""Mutation self-test of the judge: does the suite notice when a rule of the judge goes soft?

harness/selftest/mutations.py plants mistakes in jax_impl and asks the parity matrix to catch them. This
module does the same for the harness itself: `CATALOGUE` is data, one `HarnessMutant` per single
mistake a person could make in the judging code (harness/judging/judge.py, compare.py, tolerance.py,
collect.py, report.py, cli.py), with the exact source text it replaces (which must occur exactly
once: a stale catalogue fails loudly, it never silently tests nothing) and the test of the suite
that must catch it (`killing_test`, a pytest node id; the rules and their tests:
tests/test_judge_rules.py, the table of them: docs/judging.md).

`NUMBER_CATALOGUE` is derived, not written: one `x10_<number>` mutant per number of
harness/judging/tolerance.py (`tolerance.entries()`), that number reassigned 10x looser at the end of
the copy's tolerance.py, killed by its boundary test in tests/test_tolerance_boundaries.py.

The committed source is never touched: `patch_copy` copies harness/ into a temporary directory
and applies the text patch there; `run_tests` runs the named test in a pytest process of its own
whose imports find that copy first (PYTHONPATH = the copy, then this checkout for jax_impl and
the tests' helpers; the working directory is the copy). The mutant is killed when that test
fails, and only then (a copy that does not import, or a test that is not collected, is reported
as such, never as a kill). `run_clean` runs every killing test on an unmutated copy: they must
all pass there, so a killed mutant dies of its mutation.

Cheap by design: the killing tests judge hand-made arrays (no JAX program, no torch), so each
mutant costs one pytest start with the conftest, xdist and hypothesis left out: about 1 s of one
core on this project's 2-core machine, some 40 CPU-seconds for the catalogue and the clean run.
The number mutants share one process (`run_numbers`: each a fresh import of its own copy), a
few seconds for all of them.

    python -m harness.selftest.judge_mutations                              # every mutant; prints the kill table
    python -m harness.selftest.judge_mutations --only NAME,x10_EXACT64      # some of them
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .mutations import MutationError, apply_edits, select

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "harness"
RULES = "tests/test_judge_rules.py"

# The kinds of mistake the catalogue must hold at least one of (tests/test_judge_mutations.py).
KINDS = ("scale", "bound", "verdict", "reference", "nan", "tie", "exit", "excuse")
# The modules the judging runs through (the mistakes live there).
MODULES = ("judging/judge.py", "judging/compare.py", "judging/tolerance.py", "run/collect.py", "run/report.py", "run/cli.py",
           "run/regenerate.py")


@dataclasses.dataclass(frozen=True)
class HarnessMutant:
    """One realistic single mistake in the judging code, applied as a text patch to a copy of
    harness/<module>. `old` must occur exactly once in the module; `more` holds further
    (old, new) pairs of the same mistake in that module (same rule). `killing_test` is the
    pytest node id of the test that must fail on it; `rule` the judge's rule it breaks
    (docs/judging.md's row), `kind` which of KINDS it is."""

    name: str
    kind: str
    module: str
    old: str
    new: str
    killing_test: str
    rule: str
    mistake: str
    more: tuple[tuple[str, str], ...] = ()
    appended: str = ""  # text added at the end of the module (a number mutant: `old` is "")

    @property
    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new), *self.more) if self.old else self.more


def _rules(test: str) -> str:
    return f"{RULES}::{test}"


CATALOGUE: tuple[HarnessMutant, ...] = (
    # ------------------------------------------------------------------- scale of the normalisation
    HarnessMutant(
        "scores_scaled_by_whole_tensor", "scale", "judging/judge.py",
        '    return "row" if quantity in ("index_scores", "stage.scores", "scores") else "tensor"',
        '    return "tensor"',
        _rules("test_scores_are_judged_per_query_row_oracle"), "per-row scale of scores",
        "scores normalised by the whole tensor's largest score instead of each query row's: a "
        "query whose scores are small is judged 10-10^4 times more loosely",
    ),
    HarnessMutant(
        "row_scale_over_the_query_axis", "scale", "judging/compare.py",
        "        denom = np.max(mag, axis=-1, keepdims=True)",
        "        denom = np.max(mag, axis=-2, keepdims=True)",
        _rules("test_scores_are_judged_per_query_row_chunk"), "per-row scale of scores",
        "the per-row scale taken over the wrong axis (each block's largest score over the queries)",
    ),
    HarnessMutant(
        "reference_error_scaled_by_whole_tensor", "scale", "judging/compare.py",
        "normalised_error(to_numpy(torch_at_dtype), to_numpy(oracle), scale)",
        "normalised_error(to_numpy(torch_at_dtype), to_numpy(oracle))",
        _rules("test_a_small_rows_reference_error_counts_per_row"), "per-row scale of scores",
        "the reference's own error normalised by the whole tensor while the candidate's is per row: "
        "the baseline shrinks where the reference's error sits in a small row",
    ),
    HarnessMutant(
        "tie_window_scaled_by_whole_tensor", "scale", "judging/judge.py",
        "finite.max(axis=-1) if oracle_scores.shape[-1]",
        "np.full(oracle_scores.shape[:-1], finite.max()) if oracle_scores.shape[-1]",
        _rules("test_topk_tie_window_is_the_score_bound_of_the_row"), "top-k tie window",
        "the tie window scaled by the whole tensor's largest score: a small row excuses swaps far "
        "beyond its own score bound",
    ),
    # ------------------------------------------------------------------- bounds
    HarnessMutant(
        "oracle_alpha_squared", "bound", "judging/compare.py",
        "    bound = alpha * max(t_err, floor)",
        "    bound = alpha * alpha * max(t_err, floor)",
        _rules("test_oracle_bound_is_alpha_times_the_reference_error_at_dtype"), "oracle bound",
        "the oracle bound alpha^2 * max(err, floor) instead of alpha * max(err, floor): every oracle "
        "check 2-3x looser (the 36 planted jax_impl bugs are gross enough to fail anyway)",
    ),
    HarnessMutant(
        "reduction_floor_linear_in_n", "bound", "judging/tolerance.py",
        "        value = max(value, n ** 0.5 * WIDE_U)",
        "        value = max(value, n * WIDE_U)",
        _rules("test_oracle_floor_scales_with_sqrt_n"), "sqrt(n) floor",
        "the reduction floor n unit roundoffs instead of sqrt(n) (a worst case, not a random walk): "
        "16-90x looser floors",
    ),
    HarnessMutant(
        "floor_of_another_dtype", "bound", "judging/tolerance.py",
        "    value = FLOOR[dtype][kind]",
        '    value = FLOOR["bfloat16"][kind]',
        _rules("test_oracle_floor_when_the_reference_is_exact"), "oracle floor",
        "every dtype's floor read from the bfloat16 row: float32 floors 2^15 times looser",
    ),
    HarnessMutant(
        "platform_factor_ignored", "bound", "judging/compare.py",
        "    bound *= factor\n",
        "    bound *= 1.0\n",
        _rules("test_a_platform_profile_multiplies_the_oracle_bound_and_not_the_chunk_bound"), "platform profile",
        "a device's measured profile named in the note but never applied: every oracle check of a TPU run is "
        "judged by the CPU's bound",
    ),
    HarnessMutant(
        "platform_factor_in_chunk_topk", "bound", "judging/judge.py",
        "refs.order_errors.get(\"index_scores\"), refs.dims, versus_oracle=against is None)",
        "refs.order_errors.get(\"index_scores\"), refs.dims, versus_oracle=True)",
        _rules("test_a_platform_profile_widens_the_oracle_tie_window_and_not_chunk_topks"), "platform profile",
        "the profile's factor widens the chunk-topk tie window too: a chunked run on a TPU may pick other "
        "blocks than its own native run by far more than a tie",
    ),
    HarnessMutant(
        "platform_factor_in_chunk_bound", "bound", "judging/tolerance.py",
        "        return chunk_bound(dtype, quantity)\n",
        "        return chunk_bound(dtype, quantity) * self.oracle_factor(dtype, quantity)\n",
        _rules("test_no_platform_profile_factor_reaches_a_self_comparison"), "platform profile",
        "the profile's factor reaches the chunk bound: a chunked or sharded run on a TPU may differ from its "
        "own native run by up to 974x CHUNK",
    ),
    HarnessMutant(
        "platform_factor_in_backend_bound", "bound", "judging/tolerance.py",
        "        return backend_bound(dtype, quantity)\n",
        "        return backend_bound(dtype, quantity) * self.oracle_factor(dtype, quantity)\n",
        _rules("test_no_platform_profile_factor_reaches_a_self_comparison"), "platform profile",
        "the profile's factor reaches the BACKEND bound: the Pallas kernels on a TPU may differ from the XLA "
        "path by up to 974x what a summation order explains",
    ),
    HarnessMutant(
        "order_error_ignored", "bound", "judging/judge.py",
        "order_error=refs.order_errors.get(baseline_name),",
        "order_error=None,",
        _rules("test_oracle_baseline_is_at_least_the_stored_order_error"), "order-error baseline",
        "the stored order error never consulted: a lucky draw of the reference's rounding sets the bound",
    ),
    HarnessMutant(
        "exact64_bound_widened", "bound", "judging/tolerance.py",
        "        return EXACT64\n",
        "        return 1e3 * EXACT64\n",
        _rules("test_exact64_bound_is_1e_12_whatever_the_reference_error"), "exact64 bound",
        "float64 against the float64 oracle judged to 1e-9 instead of 1e-12",
    ),
    HarnessMutant(
        "chunk_bound_of_another_dtype", "bound", "judging/tolerance.py",
        "    return CHUNK[dtype][numeric_kind(quantity)]",
        '    return CHUNK["bfloat16"][numeric_kind(quantity)]',
        _rules("test_chunk_bound_is_the_tight_chunk_table_against_native"), "chunk bound",
        "every dtype's chunk check read from the bfloat16 row: float32 chunked-vs-native 2.5-20x looser",
    ),
    HarnessMutant(
        "chunk_floor_ignored", "bound", "judging/judge.py",
        "    if policy.alpha(name) * t_err > bound:\n",
        "    if False:\n",
        _rules("test_a_long_problems_float32_chunk_bound_is_at_least_the_float32_references_error"),
        "chunk at length",
        "the float32 reference's error on a long problem never reaches the chunk bound: a float32 gradient "
        "summed over 10^5 rows is held to the toy problems' CHUNK, 100x below what its summation order costs "
        "there",
    ),
    HarnessMutant(
        "chunk_floor_at_every_dtype", "bound", "judging/judge.py",
        'if refs.chunk_at_length and versus == "chunk" and p.dtype == "float32":',
        'if refs.chunk_at_length and versus == "chunk":',
        _rules("test_a_long_problems_float32_chunk_bound_is_at_least_the_float32_references_error"),
        "chunk at length",
        "the float32 reference's error reaches a bfloat16 entry's chunk bound: a narrow dtype's chunk check, "
        "an ulp-scale bound of its own rounding, loosened by another dtype's sums",
    ),
    HarnessMutant(
        "backend_at_the_chunk_bound", "bound", "judging/judge.py",
        '        return "xla", policy.backend_bound',
        '        return "xla", policy.chunk',
        _rules("test_a_pallas_point_is_judged_against_the_xla_path_at_the_backend_bound"), "xla bound",
        "a pallas point judged against the XLA path at the looser CHUNK bound (2x in float32's forward, "
        "4x in bfloat16's and float16's)",
    ),
    HarnessMutant(
        "backend_check_never_applies", "bound", "judging/tolerance.py",
        '        if bits >= 23 or not (dtype == "float32" or (dtype == "bfloat16" and kind == "grad")):',
        '        if not (dtype == "float32" or (dtype == "bfloat16" and kind == "grad")):',
        _rules("test_the_xla_check_is_not_applicable_where_the_precision_rounds_the_xla_paths_float32"),
        "xla not applicable",
        "every float32 pallas point's comparison with the XLA path (and a bfloat16 one's gradients) "
        "reported not applicable, on a CPU and at highest too: the kernels never held to the XLA path there",
    ),
    HarnessMutant(
        "stage_alpha_of_gradients", "bound", "judging/judge.py",
        'base, policy.alpha("compressed_keys"),',
        'base, policy.alpha("grad.stage"),',
        _rules("test_stage_checks_are_the_forward_oracle_rule"), "stage rule",
        "the forward stages of the first-divergence diagnosis judged with the gradients' alpha (3, not 2)",
    ),
    # ------------------------------------------------------------------- statuses and verdicts
    HarnessMutant(
        "error_status_not_failed", "verdict", "judging/compare.py",
        "        return self.status in (FAILED, ERROR)",
        "        return self.status == FAILED",
        _rules("test_an_error_status_fails_the_check_the_test_and_the_run"), "error status fails",
        "a plug-in that raised at a point (status error) no longer fails the matrix test",
    ),
    HarnessMutant(
        "not_provided_counted_as_passed", "verdict", "judging/compare.py",
        "        return self.status in (PASSED, EXCUSED)",
        "        return self.status in (PASSED, EXCUSED, NOT_PROVIDED)",
        _rules("test_each_status_maps_to_its_verdict"), "status -> verdict",
        "a quantity the implementation does not provide counted as passed",
    ),
    HarnessMutant(
        "error_reported_as_not_provided", "verdict", "judging/judge.py",
        "    if outputs.error:",
        "    if outputs.error and outputs.not_applicable:",
        _rules("test_an_error_status_fails_the_check_the_test_and_the_run"), "error status fails",
        "the judge reads a point where the plug-in raised as missing quantities (not provided) "
        "instead of an error",
    ),
    # ------------------------------------------------------------------- what is judged against what
    HarnessMutant(
        "native_taken_from_the_chunked_point", "reference", "run/collect.py",
        "native=outputs(entry.impl, p.case, p.native) if p.native else None,",
        "native=outputs(entry.impl, p.case, p) if p.native else None,",
        _rules("test_collect_judges_a_chunked_point_against_its_native_point"), "chunk against native",
        "the native reference of a chunked point collected at the chunked point itself: every chunk "
        "check compares a run with itself",
    ),
    HarnessMutant(
        "order_errors_of_another_dtype", "reference", "run/collect.py",
        "order_errors=order_errors(p.case, p.dtype, p.teacher),",
        'order_errors=order_errors(p.case, "bfloat16", p.teacher),',
        _rules("test_collect_hands_the_entrys_dtype_order_errors"), "order-error baseline",
        "the stored order errors of bfloat16 handed to every dtype's oracle check",
    ),
    HarnessMutant(
        "wide_floor_of_the_entrys_dtype", "reference", "run/collect.py",
        "wide_order_errors=(order_errors(p.case, WIDE_DTYPE, p.teacher)",
        "wide_order_errors=(order_errors(p.case, p.dtype, p.teacher)",
        _rules("test_collect_floors_a_narrow_loss_with_the_float32_order_error"), "narrow loss floor",
        "a narrow dtype's loss floored by its own order error instead of the float32 reference's",
    ),
    HarnessMutant(
        "wide_floor_ignored", "bound", "judging/judge.py",
        "wide = refs.wide_order_errors.get(baseline_name)",
        "wide = None",
        _rules("test_collect_floors_a_narrow_loss_with_the_float32_order_error"), "narrow loss floor",
        "the float32 reference's error never floors a narrow loss: yarn_tail's float16 cancellation sets its bound",
    ),
    HarnessMutant(
        "sel_baseline_from_own_selection", "reference", "judging/judge.py",
        "refs, own, at_sel, p.dtype, policy, sel=True)",
        "refs, own, own, p.dtype, policy, sel=True)",
        _rules("test_oracle_at_sel_is_the_oracle_rule_on_the_oracles_selection"), "oracle@sel",
        "oracle@sel's baseline taken from the reference at t on its own selection, not the oracle's",
    ),
    HarnessMutant(
        "chunk_at_sel_against_the_oracle", "reference", "judging/judge.py",
        "outputs[at_sel], refs.native[at_sel], bound)",
        "outputs[at_sel], refs.oracle[own], bound)",
        _rules("test_chunk_at_sel_is_against_natives_run_on_the_oracles_selection"), "chunk@sel",
        "chunk@sel compares with the oracle instead of the native run (the tight bound against the "
        "wrong reference)",
    ),
    HarnessMutant(
        "chunk_topk_against_the_oracle", "reference", "judging/judge.py",
        'check=f"{versus}-topk", against=refs.native)',
        'check=f"{versus}-topk", against=None)',
        _rules("test_chunk_topk_compares_against_native_with_the_oracles_window"), "chunk-topk against native",
        "chunked picks compared with the oracle's instead of native's (repeats the topk check)",
    ),
    HarnessMutant(
        "stage_baseline_from_the_candidate", "reference", "judging/judge.py",
        "refs.oracle[q], refs.at_dtype[q], policy.alpha(q),",
        "refs.oracle[q], outputs[q], policy.alpha(q),",
        _rules("test_a_stage_plugins_quantity_is_judged_against_the_references_stage"), "stage entry",
        "a stage plug-in's baseline error taken from the candidate itself: any stage passes",
    ),
    # ------------------------------------------------------------------- non-finite values
    HarnessMutant(
        "candidate_nan_ignored", "nan", "judging/compare.py",
        "    if x_nan.any() or r_nan.any():",
        "    if r_nan.any():",
        _rules("test_nan_in_the_candidate_fails_whatever_the_bound"), "NaN fails",
        "NaN in the candidate left to the normalised error, which skips non-finite entries",
    ),
    HarnessMutant(
        "reference_nan_ignored", "nan", "judging/compare.py",
        "    if x_nan.any() or r_nan.any():",
        "    if x_nan.any():",
        _rules("test_nan_in_the_reference_fails"), "NaN fails",
        "NaN in the reference (a damaged golden) left to the normalised error, which skips it",
    ),
    HarnessMutant(
        "minus_inf_pattern_ignored", "nan", "judging/compare.py",
        "    if differ.any():",
        "    if False and differ.any():",
        _rules("test_a_changed_minus_inf_pattern_fails_whatever_the_bound"), "-inf pattern exact",
        "a masked block made visible (or the reverse) not reported",
    ),
    HarnessMutant(
        "isolation_tolerates_tiny_gradients", "nan", "judging/compare.py",
        "        nz = ~(np.abs(g) <= bound)",
        "        nz = np.abs(g) > max(bound, 1e-300)",
        _rules("test_isolation_is_exactly_zero"), "isolation exactly 0",
        "input gradients below 1e-300 (and NaN) counted as zero",
    ),
    # ------------------------------------------------------------------- the top-k tie rule
    HarnessMutant(
        "tie_window_doubled", "tie", "judging/compare.py",
        "            if deviation <= tol:",
        "            if deviation <= 2 * tol:",
        _rules("test_topk_tie_window_is_the_score_bound_of_the_row"), "top-k tie window",
        "a swap excused within twice the score bound of the k-th score",
    ),
    HarnessMutant(
        "tie_checks_only_the_new_pick", "tie", "judging/compare.py",
        "deviation = max(abs(row[i] - kth) for i in a ^ o)",
        "deviation = max(abs(row[i] - kth) for i in a - o)",
        _rules("test_topk_replaced_pick_far_above_the_kth_is_never_a_tie"), "top-k tie window",
        "only the candidate's new pick must be near the k-th score, not the pick it replaced: "
        "dropping the best block for a near-tie is excused",
    ),
    # ------------------------------------------------------------------- sparse end to end, excused
    HarnessMutant(
        "tie_window_around_the_top_score", "tie", "judging/compare.py",
        "kth = min(row[i] for i in o)",
        "kth = max(row[i] for i in o)",
        _rules("test_topk_tie_window_is_the_score_bound_of_the_row"), "top-k tie window",
        "the tie window centred on the best pick's score instead of the k-th",
    ),
    HarnessMutant(
        "sparse_chunk_always_excused", "excuse", "judging/judge.py",
        "        if same_picks:",
        "        if False and same_picks:",
        _rules("test_sparse_end_to_end_chunk_is_compared_when_the_selections_agree"), "sparse end-to-end chunk",
        "the end-to-end sparse chunk check always excused as differing selections: it never compares",
    ),
    HarnessMutant(
        "sparse_selections_compared_in_order", "excuse", "judging/judge.py",
        'else np.array_equal(np.sort(native["topk_indices"], -1), np.sort(outputs["topk_indices"], -1)))',
        'else np.array_equal(native["topk_indices"], outputs["topk_indices"]))',
        _rules("test_sparse_end_to_end_chunk_is_compared_when_the_selections_agree"), "sparse end-to-end chunk",
        "selections compared as sequences, not sets: the same blocks in another order excuse the "
        "end-to-end chunk check",
    ),
    HarnessMutant(
        "sparse_oracle_always_excused", "excuse", "judging/judge.py",
        "    elif agreement.status == EXCUSED:",
        "    elif agreement.status != FAILED:",
        _rules("test_sparse_end_to_end_oracle_is_compared_when_the_selections_agree"), "sparse end-to-end oracle",
        "the end-to-end sparse oracle check excused even when the selections agree",
    ),
    # ------------------------------------------------------------------- the order errors' join over CPU kernels
    HarnessMutant(
        "variant_join_keeps_the_smallest", "reference", "run/regenerate.py",
        "            joined[name] = max(joined.get(name, value), value)",
        "            joined[name] = min(joined.get(name, value), value)",
        _rules("test_the_order_errors_join_over_cpu_variants_keeps_the_largest"), "order-error baseline",
        "the regenerator stores the smallest of the ISA variants' order errors instead of the largest: the "
        "bounds written rest on the luckiest CPU's kernels and fail on the others",
    ),
    # ------------------------------------------------------------------- the run's verdict and exit code
    HarnessMutant(
        "sparse_selection_mismatch_ignored", "excuse", "judging/judge.py",
        "    if agreement.status == FAILED:",
        "    if False:",
        _rules("test_sparse_end_to_end_excused_only_for_boundary_ties"), "sparse end-to-end oracle",
        "an own selection that differs from the oracle's beyond a tie judged on its numbers alone",
    ),
    HarnessMutant(
        "exit_0_on_failure", "exit", "run/cli.py",
        'return 0 if summary["failed"] + summary["errors"] == 0 else 1',
        'return 0 if summary["errors"] == 0 else 1',
        _rules("test_cli_exit_code_follows_every_status"), "exit code",
        "csa-parity exits 0 when checks failed (only errors count)",
    ),
    HarnessMutant(
        "exit_0_on_error", "exit", "run/cli.py",
        'return 0 if summary["failed"] + summary["errors"] == 0 else 1',
        'return 0 if summary["failed"] == 0 else 1',
        _rules("test_cli_exit_code_follows_every_status"), "exit code",
        "csa-parity exits 0 when a plug-in raised (only failures count)",
    ),
    HarnessMutant(
        "errors_not_counted_in_the_summary", "exit", "run/report.py",
        '"errors": statuses[ERROR],',
        '"errors": 0,',
        _rules("test_cli_exit_code_follows_every_status"), "exit code",
        "the report's summary counts no errors: the run exits 0 and parity.md says PASS",
    ),
)


# ------------------------------------------------------------------- every number, 10x looser
# Derived from the table, not written by hand: one mutant per number of harness/judging/tolerance.py
# (tolerance.entries()), which reassigns that one number, made 10x looser (tolerance.loosened),
# at the end of the copy's tolerance.py, so every module that reads it, at import or when called,
# sees the looser value. Its killing test is the number's boundary test.
NUMBER_KIND = "number"
BOUNDARIES = "tests/test_tolerance_boundaries.py"
NUMBER_TEST = "test_number_at_its_boundary"


def number_mutant_name(number: str) -> str:
    return f"x10_{number}"


def _target(keys: tuple) -> str:
    return str(keys[0]) + "".join(f"[{k!r}]" for k in keys[1:])


def number_mutants() -> tuple[HarnessMutant, ...]:
    """One `x10_<number>` mutant per number of harness/judging/tolerance.py."""
    from ..judging.tolerance import entries, loosened

    out = []
    for number, keys, value in entries():
        looser = loosened(value)
        out.append(HarnessMutant(
            number_mutant_name(number), NUMBER_KIND, "judging/tolerance.py", "", "",
            f"{BOUNDARIES}::{NUMBER_TEST}[{number}]", number,
            f"{number} {value:.6g} -> {looser:.6g} (10x looser)",
            appended=f"\n# mutant {number_mutant_name(number)}\n{_target(keys)} = {looser!r}\n"))
    return tuple(out)


NUMBER_CATALOGUE: tuple[HarnessMutant, ...] = number_mutants()


def _ignore(directory, names):
    return [n for n in names if n == "__pycache__" or n.endswith(".pyc")]


def patch_copy(mutant: HarnessMutant | None, dst: Path, src: Path | None = None) -> Path:
    """Copy `src` (default: this checkout's harness/) to dst/harness, link dst/fixtures to this
    checkout's fixtures (harness.package_data finds them beside the package) and apply the mutant's
    edits. Raises MutationError when an `old` text does not occur exactly once."""
    src = src or REPO_ROOT / PACKAGE
    dst = Path(dst)
    target = dst / PACKAGE
    shutil.copytree(src, target, ignore=_ignore)
    (dst / "fixtures").symlink_to(REPO_ROOT / "fixtures", target_is_directory=True)
    if mutant is not None:
        module = target / mutant.module
        if mutant.edits:
            apply_edits(module, mutant.name, mutant.edits, f"{PACKAGE}/{mutant.module}",
                        "harness/selftest/judge_mutations.py")
        if mutant.appended:
            module.write_text(module.read_text() + mutant.appended)
    return target


@dataclasses.dataclass
class Outcome:
    name: str
    returncode: int  # pytest's: 0 all passed, 1 some failed, else it could not run the tests
    failed: tuple[str, ...]  # node ids of the failed tests
    rules: tuple[str, ...]  # the rules the failure messages name
    seconds: float
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    @property
    def ran(self) -> bool:
        return self.returncode in (0, 1)


# pytest without what these tests do not need: the conftest (it imports JAX for the matrix),
# xdist, hypothesis, the cache, and the ini's `pythonpath = .` (which would put this checkout's
# harness before the copy).
PYTEST_ARGS = ("-o", "addopts=", "-o", "pythonpath=", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-p", "no:hypothesispytest", "--noconftest", "-q", "-rf", "--tb=short", "--color=no")


# A pytest plug-in written beside the copy: once the tests are collected, the harness they
# imported must be the copy's, or the run stops (exit 4: a usage error, never a kill).
PROBE = "judge_mutation_probe"
PROBE_SOURCE = """import os, sys
import pytest


def pytest_collection_finish(session):
    import harness
    root = os.path.dirname(os.path.dirname(os.path.abspath(harness.__file__)))
    if root != os.path.abspath(os.path.dirname(__file__)):
        raise pytest.UsageError(f"the tests imported {harness.__file__}, not the mutated copy")
"""


def run_tests(copy_root: Path, tests, timeout: float = 300.0) -> Outcome:
    """Run pytest node ids `tests` (relative to this checkout) in a process that imports the
    harness copy under `copy_root` (checked: PROBE)."""
    (Path(copy_root) / f"{PROBE}.py").write_text(PROBE_SOURCE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(copy_root), str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["COLUMNS"] = "250"  # the short summary keeps the rule named in the message
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, "-p", PROBE, "--rootdir", str(REPO_ROOT),
           *(str(REPO_ROOT / t) for t in tests)]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=copy_root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MutationError(f"pytest on {', '.join(tests)} gave no result within {timeout:.0f} s") from None
    out = proc.stdout + proc.stderr
    failed = tuple(dict.fromkeys(m.group(1) for m in re.finditer(r"^FAILED (\S+)", out, re.M)))
    rules = tuple(dict.fromkeys(re.findall(r"rule '([^']+)'", out)))
    return Outcome("", proc.returncode, failed, rules, time.time() - start, out)


def _node_file(test: str) -> str:
    return test.split("::")[0]


def killed_by_its_test(mutant: HarnessMutant, outcome: Outcome) -> bool:
    """Killed, and by the test the entry names (a node id, or every test of a parametrized one)."""
    prefix = mutant.killing_test.split("::", 1)[1]
    return outcome.returncode == 1 and any(
        f.split("::", 1)[-1] == prefix or f.split("::", 1)[-1].startswith(prefix + "[") for f in outcome.failed)


def run_mutant(mutant: HarnessMutant, timeout: float = 300.0) -> Outcome:
    with tempfile.TemporaryDirectory(prefix=f"harness-mutant-{mutant.name}-") as tmp:
        patch_copy(mutant, Path(tmp))
        outcome = run_tests(Path(tmp), [mutant.killing_test], timeout)
    return dataclasses.replace(outcome, name=mutant.name)


def run_clean(catalogue=CATALOGUE, timeout: float = 300.0) -> Outcome:
    """Every killing test of `catalogue` on an unmutated copy: all must pass."""
    tests = list(dict.fromkeys(m.killing_test for m in catalogue))
    with tempfile.TemporaryDirectory(prefix="harness-mutant-clean-") as tmp:
        patch_copy(None, Path(tmp))
        outcome = run_tests(Path(tmp), tests, timeout)
    return dataclasses.replace(outcome, name="clean")


# The number mutants all run in one process (NUMBER_WORKER): for each, it forgets every harness
# module, puts that mutant's copy first on sys.path, imports the boundary tests afresh (so they
# bind the copy's harness, checked as PROBE checks it) and calls the mutant's boundary test. One
# interpreter start for the whole table instead of one pytest start per number.
NUMBER_WORKER = """import importlib, importlib.util, json, os, sys, time, traceback

MODULE = "tolerance_boundaries_under_test"
base = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]


def load(root, test_file):
    for name in [m for m in sys.modules if m == "harness" or m.startswith("harness.") or m == MODULE]:
        del sys.modules[name]
    sys.path[:] = [root, *base]
    importlib.invalidate_caches()
    spec = importlib.util.spec_from_file_location(MODULE, test_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    import harness
    found = os.path.dirname(os.path.dirname(os.path.abspath(harness.__file__)))
    if found != os.path.abspath(root):
        raise RuntimeError(f"the tests imported {harness.__file__}, not the mutated copy")
    return module


results = []
for job in json.load(open(sys.argv[1])):
    start, outcomes = time.time(), []
    try:
        test = getattr(load(job["root"], job["test_file"]), job["test"])
    except Exception:
        results.append({"name": job["name"], "error": traceback.format_exc(), "outcomes": [], "seconds": 0.0})
        continue
    for param in job["params"]:
        try:
            test(param)
            outcomes.append([param, "passed", ""])
        except AssertionError as e:
            outcomes.append([param, "failed", str(e)])
        except Exception:
            outcomes.append([param, "error", traceback.format_exc()])
    results.append({"name": job["name"], "error": "", "outcomes": outcomes, "seconds": time.time() - start})
json.dump(results, open(sys.argv[2], "w"))
"""


def _number_of(mutant: HarnessMutant) -> str:
    return mutant.killing_test.split("[", 1)[1].rstrip("]")


def run_numbers(mutants=NUMBER_CATALOGUE, timeout: float = 300.0) -> tuple[Outcome, dict[str, Outcome]]:
    """(clean, {name: outcome}): every boundary test of `mutants` on an unmutated copy (all must
    pass), then each number mutant's boundary test on its own copy, all in one process
    (NUMBER_WORKER). An outcome's returncode is pytest's: 0 passed, 1 the test failed (its
    assertion: a kill), 2 it could not run (an import or other error: never a kill)."""
    numbers = [_number_of(m) for m in mutants]
    with tempfile.TemporaryDirectory(prefix="harness-number-mutants-") as tmp:
        tmp = Path(tmp)
        jobs = []
        for i, m in enumerate([None, *mutants]):
            root = tmp / f"copy{i}"
            patch_copy(m, root)
            jobs.append({"name": "clean" if m is None else m.name, "root": str(root),
                         "test_file": str(REPO_ROOT / BOUNDARIES), "test": NUMBER_TEST,
                         "params": numbers if m is None else [_number_of(m)]})
        (tmp / "jobs.json").write_text(json.dumps(jobs))
        (tmp / "number_worker.py").write_text(NUMBER_WORKER)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
        env.pop("PYTHONPATH", None)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        try:
            proc = subprocess.run([sys.executable, str(tmp / "number_worker.py"), str(tmp / "jobs.json"),
                                   str(tmp / "out.json")], cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MutationError(f"the number mutants gave no result within {timeout:.0f} s") from None
        if proc.returncode != 0 or not (tmp / "out.json").exists():
            raise MutationError(f"the number-mutant worker exited {proc.returncode}:\n"
                                f"{(proc.stdout + proc.stderr)[-3000:]}")
        results = json.loads((tmp / "out.json").read_text())
    outcomes = {}
    for r in results:
        if r["error"]:
            outcomes[r["name"]] = Outcome(r["name"], 2, (), (), r["seconds"], r["error"])
            continue
        failed = tuple(f"{BOUNDARIES}::{NUMBER_TEST}[{p}]" for p, status, _ in r["outcomes"] if status == "failed")
        errors = [msg for _, status, msg in r["outcomes"] if status == "error"]
        messages = [msg for _, status, msg in r["outcomes"] if status != "passed"]
        code = 2 if errors else (1 if failed else 0)
        first_lines = tuple(dict.fromkeys(m.splitlines()[0] for m in messages if m))
        outcomes[r["name"]] = Outcome(r["name"], code, failed, first_lines, r["seconds"], "\n".join(messages))
    return outcomes.pop("clean"), outcomes


def _table(rows) -> str:
    header = ("mutant", "kind", "module", "killed", "killing test", "rule its failure names (first)", "wall s")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _short(text: str, width: int = 64) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def verdict(mutant: HarnessMutant, outcome: Outcome) -> str:
    if killed_by_its_test(mutant, outcome):
        return "yes"
    if outcome.passed:
        return "SURVIVED"
    if not outcome.ran:
        return f"NO RUN (pytest exit {outcome.returncode})"
    return "yes (by another test)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.selftest.judge_mutations", description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutant names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run side by side (default 1)")
    ap.add_argument("--no-clean", action="store_true",
                    help="skip the clean (unmutated) run of the hand-made catalogue's tests (the number "
                         "mutants' process always runs their boundary tests on a clean copy first)")
    ap.add_argument("--json", help="also write the outcomes to this file")
    args = ap.parse_args(argv)
    try:
        chosen = select(CATALOGUE + NUMBER_CATALOGUE, args.only, patch_copy)
    except MutationError as exc:
        print(f"harness.selftest.judge_mutations: error: {exc}", file=sys.stderr)
        return 2
    by_hand = [m for m in chosen if m.kind != NUMBER_KIND]
    numbers = [m for m in chosen if m.kind == NUMBER_KIND]
    start = time.time()
    clean = None if args.no_clean or not by_hand else run_clean(by_hand)
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = dict(zip([m.name for m in by_hand], pool.map(run_mutant, by_hand)))
    numbers_clean = None
    if numbers:
        numbers_clean, number_outcomes = run_numbers(numbers)
        outcomes.update(number_outcomes)
    wall = time.time() - start
    rows = []
    for m in chosen:
        o = outcomes[m.name]
        rows.append((m.name, m.kind, m.module, verdict(m, o), m.killing_test.split("::", 1)[1],
                     _short(o.rules[0]) if o.rules else "-", f"{o.seconds:.1f}"))
    print(_table(rows))
    print()
    killed = sum(r[3] == "yes" for r in rows)
    print(f"killed by their named test: {killed}/{len(chosen)}  (wall {wall:.1f} s with {args.jobs} job(s))")
    if clean is not None:
        print(f"clean run: {'pass' if clean.passed else 'FAIL'} ({len(set(m.killing_test for m in by_hand))} "
              f"killing tests, {clean.seconds:.1f} s)")
        if not clean.passed:
            print(clean.output[-4000:])
    if numbers_clean is not None:
        print(f"clean run of the boundary tests: {'pass' if numbers_clean.passed else 'FAIL'} ({len(numbers)} "
              f"numbers, {numbers_clean.seconds:.1f} s; the {len(numbers)} number mutants in one process)")
        if not numbers_clean.passed:
            print(numbers_clean.output[-4000:])
    for m in chosen:
        if outcomes[m.name].passed or not outcomes[m.name].ran:
            print(f"\n--- {m.name}: {verdict(m, outcomes[m.name])}\n{outcomes[m.name].output[-2000:]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": wall, "outcomes": [
            {**dataclasses.asdict(o), "output": o.output[-2000:]} for o in outcomes.values()]}, indent=1))
    clean_ok = (clean is None or clean.passed) and (numbers_clean is None or numbers_clean.passed)
    return 0 if killed == len(chosen) and clean_ok else 1


if __name__ == "__main__":
    sys.exit(main())

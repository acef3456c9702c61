"""Collect, then judge: the one path from a matrix entry to its results.

    outputs, references = collect(entry, reference)       # harness.sides.implementations (cached)
    results = judge(entry, outputs, references, policy)   # harness.judging.judge (pure)
    record(entry, result) for each result                 # harness.run.report

`evaluate` is the three steps in one call; tests/test_parity_matrix.py, the CLI workers
and the mutation worker all use it.

A point the backend cannot compute (harness.platforms) is collected as
`Outputs(not_applicable=...)` without running anything: the judge reports it
`not_applicable`, counted and listed, never passed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import platforms
from ..judging.compare import CheckResult
from ..judging.judge import first_divergence, judge, stage_checks
from ..judging.tolerance import NARROW_DTYPES, WIDE_DTYPE, Policy
from ..outputs import (CODE_QUANTITIES, FAILED, FORWARD_QUANTITIES, OWN, STAGE_MODE, Outputs, References, kind_of,
                       output_name, stage_of)
from ..points import Entry, Point
from ..problems.cases import CASES
from ..sides.implementations import (forward_stages, order_errors, outputs, reference_at_codes, reference_name,
                                     stage_references)


def dims(case: str) -> dict[str, int]:
    """The problem sizes the reduction-length floors read (harness.judging.tolerance.reduction_length)."""
    c = CASES[case]
    cfg = c.config
    return {"B": c.batch, "S": c.seq_len, "W": c.num_blocks, "HI": cfg["index_n_heads"],
            "DI": cfg["index_head_dim"], "R": cfg["q_lora_rank"], "E": cfg["emb_dim"],
            "m": cfg["compress_ratio"]}


def policy(profile: str = "highest") -> Policy:
    """The tolerance policy for a candidate that ran here at matmul precision `profile`: with
    the platform profile of this device (harness.platforms.load_profile) where one is stored."""
    backend = platforms.current_backend()
    stored = platforms.load_profile(backend, platforms.current_device_kind()) if backend != "cpu" else None
    if stored is None:
        return Policy(profile, backend)
    from ..judging.tolerance import policy_factors

    return Policy(profile, backend, policy_factors(platforms.oracle_factors(stored, profile)), stored["name"])


def collect(entry: Entry, reference: str = "live", candidate: Outputs | None = None) -> tuple[Outputs, References]:
    """The candidate's outputs at the entry's point, and what they are judged against: the
    reference (`live` torch_ref or the fixture `goldens`) in float64 and at the entry's
    dtype with its stored order errors, and the candidate's own run at `point.native`
    (chunked: unchunked; sharded: the same knobs on one device).

    `candidate`: outputs computed elsewhere (the two-process form, harness.run.multihost, reads
    them back from the bundle its processes wrote) instead of `outputs(entry.impl, ...)` here;
    the references, the native run included, are collected here as for any point."""
    p, ref = entry.point, reference_name(reference)
    backend = platforms.current_backend()
    reason = platforms.not_applicable(p.dtype, entry.kind, backend)
    if reason is not None:
        na = Outputs(entry.impl, not_applicable=platforms.not_applicable_label(backend, reason))
        return na, References(oracle=na, at_dtype=na)
    if candidate is None:
        candidate = outputs(entry.impl, p.case, p)
    if entry.mode == STAGE_MODE:  # a stage plug-in: judged against the live reference's stage
        if ref != "torch_ref":
            na = Outputs(entry.impl, not_applicable=(
                "a stage is judged against the live reference (the goldens store no stage inputs): "
                "run with --reference live"))
            return (_own_error(entry, [candidate]) or na), References(oracle=na, at_dtype=na)
        stage = stage_of(entry.quantity)
        at_dtype = stage_references(p.case, p.dtype, stage)
        # The quantizer is judged against the reference's own quantizer at the dtype, on the same values.
        oracle = at_dtype if stage == "quantizer" else stage_references(p.case, "float64", stage)
        return _own_error(entry, [candidate]) or candidate, References(oracle=oracle, at_dtype=at_dtype)
    quant = CASES[p.case].config.get("index_quant")
    references = References(
        oracle=outputs(ref, p.case, Point(p.case, "float64", teacher=p.teacher)),
        at_dtype=outputs(ref, p.case, Point(p.case, p.dtype, teacher=p.teacher)),
        native=outputs(entry.impl, p.case, p.native) if p.native else None,
        order_errors=order_errors(p.case, p.dtype, p.teacher),
        dims=dims(p.case),
        wide_order_errors=(order_errors(p.case, WIDE_DTYPE, p.teacher) if p.dtype in NARROW_DTYPES else {}),
        quant=quant,
    )
    sides = [candidate, references.native, references.oracle, references.at_dtype]
    error = _own_error(entry, sides)
    if error is None and quant is not None and judged_on_own_codes(entry):
        references = _with_own_codes(entry, candidate, references, ref)
    return error or candidate, references


def judged_on_own_codes(entry: Entry) -> bool:
    """Whether an entry of a quantized problem is also judged end to end on the candidate's own
    codes: the forward values and top-k, and the dense loss and gradients. Sparse entries are
    judged on common codes only (their `oracle@sel` check hands the oracle's selection, which
    follows the oracle's codes); input gradients do not depend on codes."""
    return (entry.mode == "forward" and entry.quantity in FORWARD_QUANTITIES) or (
        entry.mode == "dense" and entry.quantity != "input_grads")


def _with_own_codes(entry: Entry, candidate: Outputs, refs: References, ref: str) -> References:
    """`refs` with the reference recomputed on the candidate's own codes (References.own), or the
    reason it cannot be (`own_missing`): the goldens hold no such run, or the candidate gave no
    codes. Own codes identical to the oracle's reuse the common-codes references."""
    p = entry.point
    if ref != "torch_ref":
        return dataclasses.replace(refs, own_missing=(
            "not applicable with the goldens: they hold no reference run on the candidate's own codes "
            "(run with --reference live)"))
    lacking = [q for q in CODE_QUANTITIES if q not in candidate]
    if lacking:
        return dataclasses.replace(refs, own_missing=candidate.why_missing(lacking[0]))
    codes = {q: candidate[q] for q in CODE_QUANTITIES}
    if all(q in refs.oracle and np.array_equal(codes[q], refs.oracle[q]) for q in CODE_QUANTITIES):
        own = dataclasses.replace(refs, native=None)
    else:
        own = dataclasses.replace(refs, native=None,
                                  oracle=reference_at_codes(p.case, Point(p.case, "float64", teacher=p.teacher), codes),
                                  at_dtype=reference_at_codes(p.case, p, codes))
    return dataclasses.replace(refs, own=own)


def reads(entry: Entry) -> list[str]:
    """The canonical names (or prefixes) the judge reads of an entry's outputs (of a quantized
    problem also their `own.` twins, the run on the candidate's own codes)."""
    names = _reads(entry)
    if CASES[entry.point.case].config.get("index_quant") is not None and judged_on_own_codes(entry):
        names += [OWN + n for n in names]
    return names


def _reads(entry: Entry) -> list[str]:
    q, mode = entry.quantity, entry.mode
    if mode == STAGE_MODE or q in FORWARD_QUANTITIES or q in CODE_QUANTITIES:
        return [q]
    if q == "input_grads":
        return [f"input_grad.{mode}."]
    if mode == "dense":
        return [output_name(q, "dense")]
    return [output_name(q, "sparse"), output_name(q, "sparse_at_oracle"), "topk_indices"]


def _own_error(entry: Entry, sides) -> Outputs | None:
    """The entry's candidate as an error (the judge's `error` status, one line) when a call it
    reads failed on any side: the candidate, its native run or the reference raised there, or
    killed or hung a worker (Outputs.errors: only that call's quantities). None otherwise."""
    for side in sides:
        line = side.error_of(reads(entry)) if side is not None else ""
        if line:
            return Outputs(entry.impl, error=line)
    return None


def evaluate(entry: Entry, reference: str = "live", profile: str = "highest",
             candidate: Outputs | None = None) -> list[CheckResult]:
    """Every check of one entry. `profile` picks the tolerance profile matching the matmul
    precision the candidate ran at (harness.judging.tolerance.PROFILES); `candidate`: outputs computed
    elsewhere (`collect`)."""
    candidate, references = collect(entry, reference, candidate)
    results = judge(entry, candidate, references, policy(profile))
    if any(r.status == FAILED for r in results) and entry.mode != STAGE_MODE:
        line = diagnose(entry, reference, profile)
        results = [r.with_diagnosis(line) if r.status == FAILED else r for r in results]
    return results


GOLDENS_NO_STAGES = ("first diverging stage unknown: the goldens store no intermediates "
                     "(run with --reference live for the diagnosis)")


def diagnose(entry: Entry, reference: str = "live", profile: str = "highest") -> str:
    """The first-diverging-stage line of a failed entry (harness.judging.judge.first_divergence): the
    candidate's forward intermediates (native path, the entry's dtype and loss variant; a
    sparse entry with the oracle's selection) against the live reference's in float64, with
    the reference's own at the dtype as the baseline. Only for failed entries."""
    if reference_name(reference) != "torch_ref":
        return GOLDENS_NO_STAGES
    p, sparse = entry.point, entry.mode == "sparse"
    try:
        candidate = forward_stages(entry.impl, p.case, p.dtype, sparse, p.teacher)
    except Exception as exc:  # a plug-in's forward_stages that raises: say so, keep the result
        return f"first diverging stage unknown: {entry.impl}'s forward_stages raised {type(exc).__name__}: {exc}"
    if candidate is None:
        return f"first diverging stage unknown: {entry.impl} exposes no forward_stages"
    oracle = forward_stages("torch_ref", p.case, "float64", sparse, p.teacher)
    at_dtype = forward_stages("torch_ref", p.case, p.dtype, sparse, p.teacher)
    checks = stage_checks(candidate, oracle, at_dtype, p.dtype, policy(profile), dims(p.case))
    return first_divergence(checks, gradient_failed=kind_of(entry.quantity) in ("grad", "loss", "isolation"))

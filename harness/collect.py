"""Collect, then judge: the one path from a matrix entry to its results.

    outputs, references = collect(entry, reference)       # harness.implementations (cached)
    results = judge(entry, outputs, references, policy)   # harness.judge (pure)
    record(entry, result) for each result                 # harness.report

`evaluate` is the three steps in one call; tests/test_parity_matrix.py, the CLI workers
and the mutation worker all use it.

A point the backend cannot compute (harness.platforms) is collected as
`Outputs(not_applicable=...)` without running anything: the judge reports it
`not_applicable`, counted and listed, never passed.
"""

from __future__ import annotations

from . import platforms
from .cases import CASES
from .compare import CheckResult
from .implementations import forward_stages, order_errors, outputs, reference_name, stage_references
from .judge import first_divergence, judge, stage_checks
from .matrix import Entry, Point
from .outputs import FAILED, FORWARD_QUANTITIES, STAGE_MODE, Outputs, References, kind_of, output_name
from .tolerance import Policy


def dims(case: str) -> dict[str, int]:
    """The problem sizes the reduction-length floors read (harness.tolerance.reduction_length)."""
    c = CASES[case]
    cfg = c.config
    return {"B": c.batch, "S": c.seq_len, "W": c.num_blocks, "HI": cfg["index_n_heads"],
            "DI": cfg["index_head_dim"], "R": cfg["q_lora_rank"], "E": cfg["emb_dim"],
            "m": cfg["compress_ratio"]}


def policy(profile: str = "highest") -> Policy:
    """The tolerance policy for a candidate that ran here at matmul precision `profile`."""
    return Policy(profile, platforms.current_backend())


def collect(entry: Entry, reference: str = "live", candidate: Outputs | None = None) -> tuple[Outputs, References]:
    """The candidate's outputs at the entry's point, and what they are judged against: the
    reference (`live` torch_ref or the fixture `goldens`) in float64 and at the entry's
    dtype with its stored order errors, and the candidate's own run at `point.native`
    (chunked: unchunked; sharded: the same knobs on one device).

    `candidate`: outputs computed elsewhere (the two-process form, harness.multihost, reads
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
        return _own_error(entry, [candidate]) or candidate, References(
            oracle=stage_references(p.case, "float64"), at_dtype=stage_references(p.case, p.dtype))
    references = References(
        oracle=outputs(ref, p.case, Point(p.case, "float64", teacher=p.teacher)),
        at_dtype=outputs(ref, p.case, Point(p.case, p.dtype, teacher=p.teacher)),
        native=outputs(entry.impl, p.case, p.native) if p.native else None,
        order_errors=order_errors(p.case, p.dtype, p.teacher),
        dims=dims(p.case),
    )
    sides = [candidate, references.native, references.oracle, references.at_dtype]
    return _own_error(entry, sides) or candidate, references


def reads(entry: Entry) -> list[str]:
    """The canonical names (or prefixes) the judge reads of an entry's outputs."""
    q, mode = entry.quantity, entry.mode
    if mode == STAGE_MODE or q in FORWARD_QUANTITIES:
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
    precision the candidate ran at (harness.tolerance.PROFILES); `candidate`: outputs computed
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
    """The first-diverging-stage line of a failed entry (harness.judge.first_divergence): the
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

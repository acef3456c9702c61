"""Judging one matrix entry (SPEC section 10): which comparisons apply and against what.

For an entry (case, dtype t, chunks, mode, quantity) of implementation X:
  oracle   X@t vs torch float64: <= alpha * max(err(torch@t), floor[t]);
           for t = float64 the bound is EXACT64 instead (formula errors hide in no noise).
  chunk    X@t chunked vs X@t native: the tight CHUNK bound (only chunked points).
  topk     sets per query vs the oracle's, boundary ties excused within the score bound.
  isolation  d loss / d inputs exactly 0.
Sparse mode depends on a discrete selection, so every sparse quantity is judged twice:
  oracle@sel  X and torch@t both given the oracle's selection: the pure math check.
  oracle      end to end with X's own selection: compared when X picks the oracle's
              sets; when they differ only by excused boundary ties it is reported as
              excused (the @sel check still judges the numbers); any other difference fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import platforms, runner, tolerance
from .cases import CASES
from .compare import CheckResult, compare_close, exactly_zero, normalised_error, oracle_relative, topk_sets
from .matrix import Entry


def _scale(quantity: str) -> str:
    return "row" if quantity == "index_scores" else "tensor"


def _golden_name(quantity: str, mode: str) -> str:
    if mode == "forward":
        return quantity
    return f"loss.{mode}" if quantity == "loss" else f"grad.{mode}.{quantity[len('grad.'):]}"


def _dims(case: str) -> dict:
    """The problem sizes the reduction-length floors read (harness.tolerance.reduction_length)."""
    c = CASES[case]
    cfg = c.config
    return {"B": c.batch, "S": c.seq_len, "W": c.num_blocks, "HI": cfg["index_n_heads"],
            "DI": cfg["index_head_dim"], "R": cfg["q_lora_rank"], "E": cfg["emb_dim"],
            "m": cfg["compress_ratio"]}


# issue 14 hook: the torch-at-dtype error is the max over K evaluation orders stored in the
# fixture (`orderr.<golden quantity>`), and the floor scales with the case's reduction lengths
# and the backend's matmul precision.
def _versus_oracle(quantity, candidate, oracle, torch_t, dtype, profile, check="oracle",
                   case=None, order_error=None) -> CheckResult:
    if dtype == "float64":
        r = compare_close("exact64", quantity, candidate, oracle, tolerance.EXACT64, _scale(quantity))
    else:
        kind = tolerance.kind_of(quantity)
        floor = tolerance.floor(dtype, quantity, profile, platforms.current_backend(),
                                _dims(case) if case else None)
        r = oracle_relative(quantity, candidate, oracle, torch_t, tolerance.ALPHA[kind], floor,
                            _scale(quantity), order_error)
    return dataclasses.replace(r, check=check if dtype != "float64" else f"exact64{check[6:]}")


def _order_error(ref, dtype: str, golden: str):
    return ref[dtype].get(f"orderr.{golden}")


def score_tolerance(ref, dtype: str, profile: str = "highest", case: str | None = None) -> np.ndarray:
    """Absolute score tolerance per query [B, S]: the index_scores bound times the row's
    largest |oracle score| (the bound is normalised per row)."""
    oracle = ref["float64"]["index_scores"]
    if dtype == "float64":
        bound = tolerance.EXACT64
    else:
        t_err, _, _ = normalised_error(ref[dtype]["index_scores"], oracle, "row")
        order = _order_error(ref, dtype, "index_scores")
        if order is not None:
            t_err = max(t_err, float(order))
        floor = tolerance.floor(dtype, "index_scores", profile, platforms.current_backend(),
                                _dims(case) if case else None)
        bound = tolerance.ALPHA["fwd"] * max(t_err, floor)
    finite = np.where(np.isfinite(oracle), np.abs(oracle), 0.0)
    return bound * (finite.max(axis=-1) if oracle.shape[-1] else np.zeros(oracle.shape[:-1]))


def _topk_results(entry: Entry, ref, profile) -> list[CheckResult]:
    p = entry.point
    oracle = ref["float64"]
    tol = score_tolerance(ref, p.dtype, profile, p.case)
    cand = runner.forward(p.impl, p.case, p.dtype, p.ichunk, p.qchunk)["topk_indices"]
    out = [topk_sets("topk_indices", cand, oracle["topk_indices"], oracle["index_scores"], tol)]
    if p.chunked:
        native = runner.forward(p.impl, p.case, p.dtype, 0)["topk_indices"]
        r = topk_sets("topk_indices", cand, native, oracle["index_scores"], tol)
        out.append(dataclasses.replace(r, check="chunk-topk"))
    return out


def _forward_results(entry: Entry, ref, profile) -> list[CheckResult]:
    p, q = entry.point, entry.quantity
    if q == "topk_indices":
        return _topk_results(entry, ref, profile)
    cand = runner.forward(p.impl, p.case, p.dtype, p.ichunk, p.qchunk)[q]
    out = [_versus_oracle(q, cand, ref["float64"][q], ref[p.dtype][q], p.dtype, profile,
                          case=p.case, order_error=_order_error(ref, p.dtype, q))]
    if p.chunked:
        native = runner.forward(p.impl, p.case, p.dtype, 0)[q]
        out.append(compare_close("chunk", q, cand, native, tolerance.chunk_bound(p.dtype, q), _scale(q)))
    return out


def _selection_agreement(entry: Entry, ref, profile) -> CheckResult:
    """The candidate's own top-k against the oracle's, tie-aware."""
    return _topk_results(dataclasses.replace(entry, quantity="topk_indices"), ref, profile)[0]


def _loss_results(entry: Entry, ref, profile) -> list[CheckResult]:
    p, q = entry.point, entry.quantity
    run = runner.loss_and_grads(p.impl, p.case, p.dtype, p.ichunk, p.tchunk, p.mode, p.qchunk)
    if q == "input_grads":
        return [exactly_zero(q, run["input_grads"])]
    out = []
    golden = _golden_name(q, p.mode)
    if p.mode == "dense":
        out.append(_versus_oracle(q, run[q], ref["float64"][golden], ref[p.dtype][golden], p.dtype, profile,
                                  case=p.case, order_error=_order_error(ref, p.dtype, golden)))
        if p.chunked:
            native = runner.loss_and_grads(p.impl, p.case, p.dtype, 0, 0, "dense")[q]
            out.append(compare_close("chunk", q, run[q], native, tolerance.chunk_bound(p.dtype, q)))
        return out

    # sparse: conditioned on the oracle's selection, then end to end
    at_sel = runner.loss_and_grads(p.impl, p.case, p.dtype, p.ichunk, p.tchunk, "sparse_at_oracle", p.qchunk)
    sel_golden = _golden_name(q, "sparse_at_oracle")
    oracle_value = ref["float64"][golden]
    baseline = ref[p.dtype][sel_golden]  # torch@t on the oracle's selection: precision noise only
    order = _order_error(ref, p.dtype, sel_golden)
    out.append(_versus_oracle(q, at_sel[q], oracle_value, baseline, p.dtype, profile, check="oracle@sel",
                              case=p.case, order_error=order))
    agreement = _selection_agreement(entry, ref, profile)
    if not agreement.passed:
        out.append(dataclasses.replace(agreement, check="oracle", quantity=q,
                                       note="end-to-end selection differs from the oracle's by non-tie picks: "
                                       + agreement.note))
    elif agreement.stats.get("excused"):
        n = agreement.stats["excused"]
        out.append(CheckResult("oracle", q, True, 0.0, 0.0, None, 0, 0,
                               f"end-to-end not comparable: own selection differs from the oracle's by {n} "
                               "boundary ties (excused); judged by oracle@sel", stats={"excused": n}))
    else:
        out.append(_versus_oracle(q, run[q], oracle_value, baseline, p.dtype, profile,
                                  case=p.case, order_error=order))
    if p.chunked:
        native_sel = runner.loss_and_grads(p.impl, p.case, p.dtype, 0, 0, "sparse_at_oracle")[q]
        bound = tolerance.chunk_bound(p.dtype, q)
        out.append(compare_close("chunk@sel", q, at_sel[q], native_sel, bound))
        native_fwd = runner.forward(p.impl, p.case, p.dtype, 0)["topk_indices"]
        own_fwd = runner.forward(p.impl, p.case, p.dtype, p.ichunk, p.qchunk)["topk_indices"]
        if np.array_equal(np.sort(native_fwd, -1), np.sort(own_fwd, -1)):
            native = runner.loss_and_grads(p.impl, p.case, p.dtype, 0, 0, "sparse")[q]
            out.append(compare_close("chunk", q, run[q], native, bound))
    return out


def evaluate(entry: Entry, reference: str = "live", profile: str = "highest") -> list[CheckResult]:
    """Every check of one entry, each carrying the entry's context. `profile` picks the
    tolerance profile matching the matmul precision the candidate ran at (tolerance.PROFILES)."""
    # issue 14 hook: a point this backend cannot compute is reported, never run nor passed.
    backend = platforms.current_backend()
    reason = platforms.not_applicable(entry.point.dtype, entry.kind, backend)
    if reason is not None:
        label = platforms.not_applicable_label(backend, reason)
        return [CheckResult("not_applicable", entry.quantity, False, 0.0, 0.0, note=label,
                            not_applicable=label, context=entry.point.label)]
    ref = runner.reference(entry.point.case, reference)
    if entry.point.mode == "forward":
        results = _forward_results(entry, ref, profile)
    else:
        results = _loss_results(entry, ref, profile)
    return [r.with_context(entry.point.label) for r in results]

"""Judging one matrix entry (SPEC section 10): pure functions over arrays they are handed.

    judge(entry, outputs, references, policy) -> [CheckResult]

`outputs` is the candidate's `Outputs` at the entry's point, `references` the oracle,
the reference at the entry's dtype and (chunked points) the candidate's own native
outputs, with the reference's stored order errors and the problem's sizes
(harness.outputs.References), `policy` the tolerance policy (harness.judging.tolerance.Policy:
profile and backend). This module imports no runner, no fixture code and no framework:
whatever produced the arrays, the same rules judge them.

For an entry (case, dtype t, chunks, mode, quantity) of implementation X:
  oracle     X@t vs the float64 oracle: <= alpha * max(err(reference@t), floor[t]), where
             err(reference@t) is at least the stored order error and the floor
             at least sqrt(n) unit roundoffs of the problem's reduction length;
             on a device with a measured platform profile (policy.oracle_factor,
             harness.platforms) times its factor, and so is the oracle top-k's tie window;
             for t = float64 the check is `exact64` instead (bound EXACT64).
  chunk      X@t chunked (head chunks, query chunks) vs X@t native (a sharded point: vs the
             same knobs on one device):
             the tight CHUNK bound, whenever `references.native` is given.
  xla        a point of the Pallas scoring backend vs the XLA path at the same knobs (in
             place of `chunk`; also xla@sel, xla-topk): the tight BACKEND bound.
  topk       sets per query vs the oracle's, boundary ties excused within the score bound.
  isolation  d loss / d inputs exactly 0.
A problem that quantizes (SPEC section 7a, 10) adds the quantizer's codes and scales, judged by
the boundary-tie rule (harness.judging.codes; `chunk`: bit for bit against the native run), and
judges everything after them on common codes: every check above compares runs that all score
the float64 oracle's codes, and the forward and dense entries once more end to end on the
candidate's own codes (`@own` checks: its `own.` outputs against the live reference
recomputed on those codes; not applicable with the goldens).
Sparse mode depends on a discrete selection, so every sparse quantity is judged twice:
  oracle@sel  X and the reference@t both given the oracle's selection (variant
              `sparse_at_oracle`): the pure math check.
  oracle      end to end with X's own selection: compared when X picks the oracle's sets;
              excused when they differ only by boundary ties (oracle@sel still judges
              the numbers); failed on any other difference.
  chunk@sel / chunk  the same two against X's native run.
A quantity the candidate does not provide gives `not_provided`; a point it cannot run
where it ran (Outputs.not_applicable) gives `not_applicable`. Only passed, failed and
excused come from comparing numbers.
"""

from __future__ import annotations

import numpy as np

import dataclasses

from ..outputs import (CODE_QUANTITIES, ERROR, EXCUSED, FAILED, PASSED, FORWARD_STAGES, NOT_APPLICABLE, NOT_PROVIDED, OWN,
                       ROTATED_NAMES, STAGE_MODE, Outputs, References, output_name)
from .codes import codes_check, scales_check
from .compare import (CheckResult, compare_close, exactly_zero, identical, normalised_error, oracle_relative,
                      status_result, topk_sets)
from .tolerance import Policy


def _scale(quantity: str) -> str:
    return "row" if quantity in ("index_scores", "stage.scores", "scores") else "tensor"


def score_tolerance(oracle_scores, scores_at_dtype, dtype: str, policy: Policy = Policy(),
                    order_error: float | None = None, dims=None, versus_oracle: bool = True) -> np.ndarray:
    """Absolute score tolerance per query [B, S] for the top-k tie rule: the index_scores
    bound (the reference's error at `dtype`, at least its order error and the floor for a
    problem of `dims`; times the platform profile's forward factor when the picks are judged
    against the oracle's, `versus_oracle`) times the row's largest |oracle score| (the bound
    is normalised per row)."""
    oracle_scores = np.asarray(oracle_scores, np.float64)
    if dtype == "float64":
        bound = policy.exact64
    else:
        t_err, _, _ = normalised_error(scores_at_dtype, oracle_scores, "row")
        if order_error is not None:
            t_err = max(t_err, float(order_error))
        bound = policy.alpha("index_scores") * max(t_err, policy.floor(dtype, "index_scores", dims))
        if versus_oracle:
            bound *= policy.oracle_factor(dtype, "index_scores")
    finite = np.where(np.isfinite(oracle_scores), np.abs(oracle_scores), 0.0)
    return bound * (finite.max(axis=-1) if oracle_scores.shape[-1] else np.zeros(oracle_scores.shape[:-1]))


def _native_rule(point, policy: Policy):
    """(check name, bound function) of the comparison with `references.native`: `chunk` (a
    chunked or sharded point against its native run, the CHUNK bound), or `xla` (a point of
    another scoring backend against the XLA path at the same knobs, the BACKEND bound)."""
    if getattr(point, "backend", "xla") != "xla":
        return "xla", policy.backend_bound
    return "chunk", policy.chunk


def _native_bound(p, policy: Policy, refs: References, name: str, oracle_name: str | None = None
                  ) -> tuple[str, float, str]:
    """(check name, bound, note) of the comparison with `references.native` of an entry whose
    reference at the dtype is `name` (and the oracle's value `oracle_name`, default the same): the
    `_native_rule` bound; on a long problem (References.chunk_at_length) a float32 `chunk` check's
    bound is at least alpha times the float32 reference's own error there, whose sums the CHUNK
    table was not measured on, and the note says so."""
    versus, rule = _native_rule(p, policy)
    bound = rule(p.dtype, name)
    t_err = 0.0
    if refs.chunk_at_length and versus == "chunk" and p.dtype == "float32":
        t_err = normalised_error(refs.at_dtype[name], refs.oracle[oracle_name or name], "tensor")[0]
    if policy.alpha(name) * t_err > bound:
        return versus, policy.alpha(name) * t_err, (
            f"bound: alpha {policy.alpha(name):g} x the float32 reference's own error on this problem {t_err:.3g}, "
            f"above CHUNK {bound:.3g}")
    return versus, bound, ""


def _missing(outputs: Outputs, names, check: str, quantity: str) -> CheckResult | None:
    """A not_provided result if the candidate lacks any of `names`."""
    for name in names:
        if name not in outputs:
            return status_result(check, quantity, NOT_PROVIDED, outputs.why_missing(name))
    return None


def _versus_oracle(quantity, name, candidate, refs: References, oracle_name, baseline_name, dtype, policy,
                   sel: bool = False) -> CheckResult:
    """The oracle rule for canonical `name`: against the oracle's `oracle_name`, with the
    reference's `baseline_name` at the same dtype (and its stored order error) as the baseline."""
    oracle = refs.oracle[oracle_name]
    if dtype == "float64":
        return compare_close("exact64@sel" if sel else "exact64", quantity, candidate, oracle, policy.exact64,
                             _scale(name))
    wide = refs.wide_order_errors.get(baseline_name)
    floor = policy.floor(dtype, name, refs.dims, wide)
    return oracle_relative(quantity, candidate, oracle, refs.at_dtype[baseline_name], policy.alpha(name),
                           floor, _scale(name), check="oracle@sel" if sel else "oracle",
                           factor=policy.oracle_factor(dtype, name), profile=policy.platform_profile,
                           order_error=refs.order_errors.get(baseline_name),
                           floor_note=(" (the float32 reference's error)" if wide is not None
                                       and floor > policy.floor(dtype, name, refs.dims) else ""))


def _topk(outputs: Outputs, refs: References, dtype: str, policy: Policy, check: str = "topk",
          quantity: str = "topk_indices", against: Outputs | None = None) -> CheckResult:
    """The candidate's picks against the oracle's (or `against`'s), tie-aware; the streamed result
    where the references hold one (References.streamed)."""
    streamed = refs.streamed.get("topk" if against is None else "native-topk")
    if streamed is not None:
        return dataclasses.replace(streamed, check=check, quantity=quantity)
    oracle = refs.oracle
    tol = score_tolerance(oracle["index_scores"], refs.at_dtype["index_scores"], dtype, policy,
                          refs.order_errors.get("index_scores"), refs.dims, versus_oracle=against is None)
    reference = (against or oracle)["topk_indices"]
    return topk_sets(quantity, outputs["topk_indices"], reference, oracle["index_scores"], tol, check=check)


def code_tolerance(refs: References, side: str, dtype: str, policy: Policy) -> float:
    """The normalised tolerance of the quantizer's input for the boundary-tie rule: exact64 in
    float64; else the forward rule's alpha * max(err(reference@t), floor) with err the
    reference's own error on the rotated values of `side` (query | key) at the dtype, per
    vector of DI channels. The rotated value is the dtype's rounding of a wide sum, as a
    compressed key is: the compressed keys' alpha and floor (one unit roundoff) judge it."""
    if dtype == "float64":
        return policy.exact64
    name = ROTATED_NAMES[side]
    err, _, _ = normalised_error(refs.at_dtype[name], refs.oracle[name], "row")
    return (policy.oracle_factor(dtype, "compressed_keys") * policy.alpha("compressed_keys")
            * max(err, policy.floor(dtype, "compressed_keys")))


def _codes(entry, outputs: Outputs, refs: References, policy: Policy) -> list[CheckResult]:
    """A code or scale quantity (query_codes, query_scales, key_codes, key_scales) against the
    oracle's by the boundary-tie rule (harness.judging.codes), and bit for bit against the native run."""
    p, q = entry.point, entry.quantity
    side = q.split("_")[0]
    codes, scales = f"{side}_codes", f"{side}_scales"
    miss = _missing(outputs, [codes, scales], "oracle", q)
    if miss:
        return [miss]
    rot = ROTATED_NAMES[side]
    for name, ref in ((codes, refs.oracle), (scales, refs.oracle), (rot, refs.oracle), (rot, refs.at_dtype)):
        if name not in ref:
            return [status_result("oracle", q, NOT_PROVIDED, ref.why_missing(name))]
    bound = code_tolerance(refs, side, p.dtype, policy)
    fmt, block = refs.quant["format"], refs.quant["block"]
    oracle_rot, at_rot = refs.oracle[rot], refs.at_dtype[rot]
    if q == scales:
        out = [scales_check("oracle", q, outputs[scales], refs.oracle[scales], oracle_rot, at_rot, fmt, block, bound)]
    else:
        out = [codes_check("oracle", q, outputs[codes], outputs[scales], refs.oracle[codes], refs.oracle[scales],
                           oracle_rot, at_rot, fmt, block, bound)]
    if refs.native is not None:
        versus, _ = _native_rule(p, policy)
        out.append(identical(versus, q, outputs[q], refs.native[q]))
    return out


def _on_own_codes(entry, outputs: Outputs, refs: References, policy: Policy, rule) -> list[CheckResult]:
    """The entry's checks once more on the candidate's own codes: its `own.` outputs against
    the reference recomputed on them (References.own), each check named `<check>@own`."""
    if refs.own is None:
        return [status_result("oracle@own", entry.quantity, NOT_APPLICABLE, refs.own_missing)]
    own = Outputs(outputs.source, {k[len(OWN):]: v for k, v in outputs.values.items() if k.startswith(OWN)},
                  outputs.missing)
    return [dataclasses.replace(r, check=f"{r.check}@own") for r in rule(entry, own, refs.own, policy)]


def _forward(entry, outputs: Outputs, refs: References, policy: Policy) -> list[CheckResult]:
    p, q = entry.point, entry.quantity
    miss = None if q in ("topk_indices", "index_scores") and refs.streamed else _missing(
        outputs, [q], "topk" if q == "topk_indices" else "oracle", q)
    if miss:
        return [miss]
    versus, bound = _native_rule(p, policy)
    if q == "topk_indices":
        out = [_topk(outputs, refs, p.dtype, policy)]
        if refs.native is not None:
            out.append(_topk(outputs, refs, p.dtype, policy, check=f"{versus}-topk", against=refs.native))
        return out
    if f"oracle:{q}" in refs.streamed:  # judged block by block (SPEC section 11)
        out = [refs.streamed[f"oracle:{q}"]]
        if refs.native is not None:
            out.append(dataclasses.replace(refs.streamed[f"native:{q}"], check=versus))
        return out
    out = [_versus_oracle(q, q, outputs[q], refs, q, q, p.dtype, policy)]
    if refs.native is not None:
        out.append(compare_close(versus, q, outputs[q], refs.native[q], bound(p.dtype, q), _scale(q)))
    return out


def _isolation(entry, outputs: Outputs, policy: Policy) -> list[CheckResult]:
    prefix = f"input_grad.{entry.mode}."
    grads = {n[len(prefix):]: v for n, v in outputs.values.items() if n.startswith(prefix)}
    if not grads:
        return [status_result("isolation", entry.quantity, NOT_PROVIDED, outputs.why_missing(prefix))]
    return [exactly_zero(entry.quantity, grads, bound=policy.isolation)]


def _dense(entry, outputs: Outputs, refs: References, policy: Policy) -> list[CheckResult]:
    p, q = entry.point, entry.quantity
    name = output_name(q, "dense")
    miss = _missing(outputs, [name], "oracle", q)
    if miss:
        return [miss]
    out = [_versus_oracle(q, name, outputs[name], refs, name, name, p.dtype, policy)]
    if refs.native is not None:
        versus, bound, note = _native_bound(p, policy, refs, name)
        out.append(compare_close(versus, q, outputs[name], refs.native[name], bound, note=note))
    return out


def _sparse(entry, outputs: Outputs, refs: References, policy: Policy) -> list[CheckResult]:
    p, q = entry.point, entry.quantity
    own, at_sel = output_name(q, "sparse"), output_name(q, "sparse_at_oracle")
    versus, bound, note = _native_bound(p, policy, refs, at_sel, own)
    out = []
    # 1. on the oracle's selection: the numbers, whatever the candidate picks. The oracle's
    #    value is its own sparse run (its selection is the selection).
    miss = _missing(outputs, [at_sel], "oracle@sel", q)
    if miss:
        out.append(miss)
    else:
        out.append(_versus_oracle(q, at_sel, outputs[at_sel], refs, own, at_sel, p.dtype, policy, sel=True))
        if refs.native is not None:
            out.append(compare_close(f"{versus}@sel", q, outputs[at_sel], refs.native[at_sel], bound))
    # 2. end to end on the candidate's own selection, when it is the oracle's.
    miss = _missing(outputs, [own] if "topk" in refs.streamed else [own, "topk_indices"], "oracle", q)
    if miss:
        return out + [miss]
    agreement = _topk(outputs, refs, p.dtype, policy, check="oracle", quantity=q)
    if agreement.status == FAILED:
        out.append(agreement)
    elif agreement.status == EXCUSED:
        n = agreement.stats["excused"]
        out.append(status_result("oracle", q, EXCUSED,
                                 f"end-to-end not comparable: own selection differs from the oracle's by {n} "
                                 "boundary ties (excused); judged by oracle@sel", excused=n))
    else:
        out.append(_versus_oracle(q, own, outputs[own], refs, own, at_sel, p.dtype, policy))
    if refs.native is not None:
        native = refs.native
        same_picks = (refs.streamed["native-topk"].status == PASSED if "native-topk" in refs.streamed
                      else np.array_equal(np.sort(native["topk_indices"], -1), np.sort(outputs["topk_indices"], -1)))
        if same_picks:
            out.append(compare_close(versus, q, outputs[own], native[own], bound))
        else:
            out.append(status_result(versus, q, EXCUSED,
                                     "end-to-end not comparable: " + ("chunked and native" if versus == "chunk" else "Pallas and XLA")
                                     + f" select differently (judged by {versus}-topk and {versus}@sel)"))
    return out


def _stage(entry, outputs: Outputs, refs: References, policy: Policy) -> list[CheckResult]:
    """A stage plug-in's quantity (stage.<s>, stage_grad.<s>.<input>) against the float64
    reference's stage, with the reference's own stage at the entry's dtype as the baseline.
    The quantizer's codes and scales (stage.quantizer.*), made from the very values the
    reference's quantizer saw, are identical to the reference's at the dtype, bit for bit."""
    p, q = entry.point, entry.quantity
    quantizer = q.startswith("stage.quantizer.")
    miss = _missing(outputs, [q], "identical" if quantizer else "oracle", q)
    if miss:
        return [miss]
    if quantizer:
        return [identical("identical", q, outputs[q], refs.at_dtype[q])]
    if p.dtype == "float64":
        return [compare_close("exact64", q, outputs[q], refs.oracle[q], policy.exact64, _scale(q))]
    return [oracle_relative(q, outputs[q], refs.oracle[q], refs.at_dtype[q], policy.alpha(q),
                            policy.floor(p.dtype, q), _scale(q))]


def judge(entry, outputs: Outputs, references: References, policy: Policy = Policy()) -> list[CheckResult]:
    """Every check of one entry, each carrying the entry's label as context."""
    if outputs.error:
        results = [status_result("-", entry.quantity, ERROR, outputs.error)]
    elif entry.mode == STAGE_MODE and not outputs.not_applicable:
        results = _stage(entry, outputs, references, policy)
    elif outputs.not_applicable:
        results = [status_result("-", entry.quantity, NOT_APPLICABLE, outputs.not_applicable)]
    elif entry.mode == "forward" and entry.quantity in CODE_QUANTITIES:
        results = _codes(entry, outputs, references, policy)
    elif entry.mode == "forward":
        results = _forward(entry, outputs, references, policy)
        if references.quant is not None:
            results += _on_own_codes(entry, outputs, references, policy, _forward)
    elif entry.quantity == "input_grads":
        results = _isolation(entry, outputs, policy)
    elif entry.mode == "dense":
        results = _dense(entry, outputs, references, policy)
        if references.quant is not None:
            results += _on_own_codes(entry, outputs, references, policy, _dense)
    elif entry.mode == "sparse":
        results = _sparse(entry, outputs, references, policy)
    else:
        raise ValueError(f"mode={entry.mode!r} is not one of forward, dense, sparse")
    if entry.quantity not in CODE_QUANTITIES:
        results = _backend_checks(entry, results, policy)
    return [r.with_context(entry.label) for r in results]


def _backend_checks(entry, results: list[CheckResult], policy: Policy) -> list[CheckResult]:
    """`results` with a scoring backend's comparisons with the XLA path (`xla`, `xla@sel`,
    `xla-topk`) not applicable where the precision has the two compute other products
    (`Policy.backend_check_not_applicable`); the oracle's checks stand."""
    versus, _ = _native_rule(entry.point, policy)
    why = versus == "xla" and policy.backend_check_not_applicable(entry.point.dtype, entry.kind)
    if not why:
        return results
    return [status_result(r.check, r.quantity, NOT_APPLICABLE, why)
            if r.check.split("@")[0] in (versus, f"{versus}-topk") else r for r in results]


# --------------------------------------------------------------------------- first diverging stage
# Entries at or beyond this magnitude are masks, not values (-inf, or the loss's MASK =
# -0.7 * float32 max, which one side writes where the other writes -inf): left out of a
# stage's comparison, both sides; the pattern of masks is judged by the quantities themselves.
MASKED = 1e30


def _unmasked(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    keep = np.isfinite(ref) & (np.abs(ref) < MASKED)
    return np.where(keep, x, 0.0), np.where(keep, ref, 0.0)


# The forward quantity whose floor (with its reduction length, harness.judging.tolerance) a stage
# takes: the pooled vectors and keys carry the key path's sums, the raw scores and the
# student log-probabilities (a softmax of those scores) the score path's; the others one rounding.
STAGE_FLOOR_OF = {"pooled": "compressed_keys", "keys": "compressed_keys", "scores": "index_scores",
                  "student": "index_scores"}


def stage_checks(candidate, oracle, at_dtype, dtype: str, policy: Policy = Policy(), dims=None) -> list[CheckResult]:
    """Each forward stage (harness.outputs.FORWARD_STAGES, data-flow order) of a candidate
    against the float64 reference's, by the oracle rule of the forward row (alpha 2, the
    forward floor of STAGE_FLOOR_OF with the problem's `dims`; float64: exact64). Dicts
    stage -> array; a stage absent on any side is skipped."""
    out = []
    for name in FORWARD_STAGES:
        if name not in candidate or name not in oracle or name not in at_dtype:
            continue
        cand, ref = _unmasked(candidate[name], oracle[name])
        base, _ = _unmasked(at_dtype[name], oracle[name])
        if dtype == "float64":
            out.append(compare_close("stage", name, cand, ref, policy.exact64, _scale(name)))
        else:
            out.append(oracle_relative(name, cand, ref, base, policy.alpha("compressed_keys"),
                                       policy.floor(dtype, STAGE_FLOOR_OF.get(name, "compressed_keys"),
                                                    dims if name in STAGE_FLOOR_OF else None),
                                       _scale(name), check="stage"))
    return out


def first_divergence(checks: list[CheckResult], gradient_failed: bool) -> str:
    """The diagnosis line of a failed entry from its `stage_checks`: the first stage, in
    data-flow order, beyond its bound ("first diverges at queries: 3.1e-2 against 4e-3
    allowed"), or, when every forward stage agrees and a gradient failed, "the forward
    agrees; the backward diverges"."""
    for c in checks:
        if c.failed:
            err = "non-finite/pattern" if not np.isfinite(c.error) else f"{c.error:.2g}"
            return f"first diverges at {c.quantity}: {err} against {c.bound:.2g} allowed"
    stages = ", ".join(c.quantity for c in checks)
    if gradient_failed:
        return f"the forward agrees ({stages} within their bounds); the backward diverges"
    return f"every forward stage agrees ({stages} within their bounds)"

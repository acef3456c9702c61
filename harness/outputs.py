"""The one vocabulary: canonical quantity names, the `Outputs` every implementation
returns, and the six statuses a check can end in.

Canonical names (the keys of `Outputs.values`, of the fixture goldens, of everything
between an implementation and the judge):

    compressed_keys, index_scores, topk_indices          the forward quantities
    query_codes, query_scales, key_codes, key_scales     the quantizer's outputs (SPEC section 7a;
                                                         only where the problem quantizes)
    loss.<variant>                                       the scalar loss
    grad.<variant>.<param>                               d loss / d parameter
    input_grad.<variant>.<input>                         d loss / d input (must be exactly 0)

`<variant>` is one of LOSS_VARIANTS: `dense`, `sparse` (on the implementation's own
top-k) and `sparse_at_oracle` (sparse, given the float64 oracle's top-k as `selection`,
docs/plugins.md). A matrix entry's `mode` is one of MODES (`forward`, `dense`, `sparse`);
a `sparse` entry is judged on both sparse variants. Nothing else is called a mode.

Pure data: no numpy computation, no framework, no fixture I/O (the judge imports this).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

INPUT_NAMES = ("hidden_states", "q_latent", "position_ids", "segment_ids", "teacher_query", "teacher_kv",
               "teacher_window_kv", "attention_sink")
PARAM_NAMES = ("indexer.wkv", "indexer.wgate", "indexer.ape", "indexer.kv_norm", "indexer.wq_b",
               "indexer.weights_proj")
FLOAT_INPUT_NAMES = ("hidden_states", "q_latent", "teacher_query", "teacher_kv", "teacher_window_kv", "attention_sink")

FORWARD_QUANTITIES = ("compressed_keys", "index_scores", "topk_indices")
# The quantizer's outputs (SPEC section 7a), forward quantities of a problem with `index_quant`:
# bit patterns (uint8) and UE8M0 block scales (float32), of the queries [B, S, HI, DI] and
# [B, S, HI, DI / block] and of the compressed keys [B, W, DI] and [B, W, DI / block].
CODE_QUANTITIES = ("query_codes", "query_scales", "key_codes", "key_scales")
# The reference's rotated values, what its quantizer saw ([B, S, HI, DI] and [B, W, DI], the
# dtype's values held wide): the judge reads them to tell a boundary tie from a wrong code.
# A reference's output, never a candidate's quantity.
ROTATED_NAMES = {"query": "rotated_queries", "key": "rotated_keys"}
# Prefix of a candidate's end-to-end outputs on its own codes (the common-codes run, under the
# plain names, scores the float64 oracle's codes: SPEC section 10).
OWN = "own."
# The matrix's loss quantities (mode-free); `output_name` adds the variant.
LOSS_QUANTITIES = ("loss", *(f"grad.{p}" for p in PARAM_NAMES), "input_grads")
MODES = ("forward", "dense", "sparse")
LOSS_VARIANTS = ("dense", "sparse", "sparse_at_oracle")

# What a check can end in. Only the first three come from comparing numbers; `error` is
# a point where a plug-in raised or returned something malformed: counted beside
# failed, and it fails the run as a failure does.
PASSED, FAILED, EXCUSED, NOT_PROVIDED, NOT_APPLICABLE, ERROR = (
    "passed", "failed", "excused", "not_provided", "not_applicable", "error")
STATUSES = (PASSED, FAILED, EXCUSED, NOT_PROVIDED, NOT_APPLICABLE, ERROR)

# Stage plug-ins: the stages a plug-in may provide alone (`STAGE = "scores"` or "quantizer"),
# the matrix mode of their entries and their quantities (stage name -> the function's arguments).
# `stage.scores` is the scoring stage's output [B, S, W]; `stage_grad.scores.<input>` its
# vector-Jacobian product with the harness's fixed cotangent (harness.sides.implementations.stage_cotangent)
# with respect to q, keys, head_weights. The quantizer (SPEC section 7a steps 2-3) is handed `x`,
# the reference's rotated values (ROTATED_NAMES: the queries, then the keys, in two calls), and
# `quant`, the problem's index_quant; its quantities are `stage.quantizer.<CODE_QUANTITIES>`,
# judged bit for bit, without gradients.
STAGE_MODE = "stage"
STAGE_INPUTS = {"scores": ("q", "keys", "head_weights"), "quantizer": ("x", "quant")}
# The forward intermediates, in data-flow order, that the first-diverging-stage diagnosis
# compares (both built-in sides expose them: forward_stages).
FORWARD_STAGES = ("pooled", "keys", "queries", "head_weights", "scores", "teacher", "student")


def stage_quantities(stage: str) -> tuple[str, ...]:
    if stage == "quantizer":
        return tuple(f"stage.quantizer.{q}" for q in CODE_QUANTITIES)
    return (f"stage.{stage}", *(f"stage_grad.{stage}.{n}" for n in STAGE_INPUTS[stage]))


def stage_of(quantity: str) -> str:
    """The stage of a stage quantity: "stage.scores", "stage_grad.scores.q" -> "scores";
    "stage.quantizer.query_codes" -> "quantizer"."""
    return quantity.split(".")[1]

# The kind of a quantity: which rule and which tolerance row judge it (harness.judging.tolerance
# keys its tables by the numeric kinds forward / loss / grad). Also the pytest marker.
KINDS = ("forward", "topk", "loss", "grad", "isolation", "codes")


def forward_quantities(config) -> tuple[str, ...]:
    """The forward quantities of a problem: with `index_quant`, the quantizer's outputs too."""
    return FORWARD_QUANTITIES + (CODE_QUANTITIES if config.get("index_quant") is not None else ())


def kind_of(quantity: str) -> str:
    """forward | topk | loss | grad | isolation | codes, for a matrix quantity or a canonical name."""
    if quantity == "topk_indices":
        return "topk"
    if quantity in CODE_QUANTITIES or quantity.startswith("stage.quantizer."):
        return "codes"
    if quantity in ("compressed_keys", "index_scores") or quantity.startswith("stage."):
        return "forward"
    if quantity == "input_grads" or quantity.startswith("input_grad."):
        return "isolation"
    if quantity == "loss" or quantity.startswith("loss."):
        return "loss"
    if quantity.startswith(("grad.", "stage_grad.")):
        return "grad"
    raise KeyError(f"unknown quantity {quantity!r}")


def output_name(quantity: str, variant: str) -> str:
    """The canonical name of a matrix quantity under a loss variant:
    ("grad.indexer.wq_b", "sparse") -> "grad.sparse.indexer.wq_b"; forward names unchanged."""
    if quantity in FORWARD_QUANTITIES:
        return quantity
    if variant not in LOSS_VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {', '.join(LOSS_VARIANTS)}")
    if quantity == "loss":
        return f"loss.{variant}"
    if quantity.startswith("grad."):
        return f"grad.{variant}.{quantity[len('grad.'):]}"
    raise KeyError(f"{quantity!r} has no single canonical name (input_grads: input_grad_names)")


def input_grad_names(variant: str) -> tuple[str, ...]:
    return tuple(f"input_grad.{variant}.{n}" for n in FLOAT_INPUT_NAMES)


def all_names(variants=LOSS_VARIANTS, input_grads: bool = True) -> tuple[str, ...]:
    """Every canonical name an implementation can provide, in a stable order."""
    out = list(FORWARD_QUANTITIES)
    for v in variants:
        out += [output_name("loss", v), *(output_name(f"grad.{p}", v) for p in PARAM_NAMES)]
        if input_grads:
            out += input_grad_names(v)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What one implementation produced at one point: canonical name -> host numpy array.

    A name absent from `values` is not provided; `missing` may say why (name or a prefix
    such as "grad." -> reason). `not_applicable`, when set, says why the whole point cannot
    be computed where this ran (e.g. "not applicable on tpu: float64"); `values` is empty
    then. `source` names who produced it, e.g. "jax", "torch_ref@bfloat16", "goldens@float64".
    """

    source: str
    values: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    missing: Mapping[str, str] = dataclasses.field(default_factory=dict)
    not_applicable: str = ""
    # Set when the implementation raised (or returned something malformed) at this
    # point: one line naming the implementation, the point and the exception; `values` empty.
    error: str = ""
    # Errors of single calls (name or prefix -> one line): a stage plug-in whose backward raised
    # has `stage_grad.scores.` here and its forward in `values`. An entry reading such a name
    # is `error` (harness.run.collect); the point's other quantities are judged as usual.
    errors: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "missing", MappingProxyType(dict(self.missing)))
        object.__setattr__(self, "errors", MappingProxyType(dict(self.errors)))

    def __reduce__(self):  # picklable (a worker process sends Outputs back): mapping proxies are not
        return (Outputs, (self.source, dict(self.values), dict(self.missing), self.not_applicable, self.error,
                          dict(self.errors)))

    def error_of(self, names) -> str:
        """The error line of the first of `names` (canonical names or prefixes) that the
        implementation failed to compute: the whole point's `error`, else the `errors` entry
        that covers it; "" if none."""
        if self.error:
            return self.error
        for name in names:
            for key, line in self.errors.items():
                if name.startswith(key) or key.startswith(name):
                    return line
        return ""

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __getitem__(self, name: str) -> np.ndarray:
        return self.values[name]

    def why_missing(self, name: str) -> str:
        """The reason `name` is not provided (the longest matching prefix in `missing`)."""
        if self.not_applicable:
            return self.not_applicable
        best = max((k for k in self.missing if name.startswith(k)), key=len, default=None)
        if best is not None:
            return self.missing[best]
        return f"{self.source} does not provide {name}"


@dataclasses.dataclass(frozen=True)
class References:
    """What a candidate's outputs are judged against at one point.

    oracle:   the reference implementation in float64 (live torch_ref or the goldens);
    at_dtype: the same reference at the entry's dtype (its own precision noise: the
              baseline of the oracle rule; equal to `oracle` for float64);
    native:   the candidate implementation itself, unchunked, at the same dtype (only
              for chunked points: the `chunk` checks).
    """

    oracle: Outputs
    at_dtype: Outputs
    native: Outputs | None = None
    # The reference's worst error at the entry's dtype over K evaluation orders, per
    # canonical name (stored in the fixture; empty when unknown), and the problem's sizes
    # {B, S, W, HI, DI, R, E, m} that the floors scaling with the reduction read
    # (harness.judging.tolerance.reduction_length; None: no such floor).
    order_errors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    dims: Mapping[str, int] | None = None
    # For a narrow dtype (bfloat16, float16): the wide dtype's (float32) stored order errors, whose
    # loss entries floor the narrow loss's baseline (harness.judging.tolerance.wide_reference_floor;
    # empty otherwise or when unknown).
    wide_order_errors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Where the problem quantizes: the reference recomputed on the candidate's own codes, in
    # float64 and at the entry's dtype (`oracle`, `at_dtype`: the candidate's `own.` outputs
    # are judged against them), or the reason that check cannot run (`own_missing`: the
    # goldens hold no such run).
    own: "References | None" = None
    own_missing: str = ""
    # The problem's `index_quant` (format, block, hadamard), or None: what the codes rule reads.
    quant: Mapping | None = None
    # Checks already judged as reductions over row blocks (harness.judging.compare's streams), for a
    # problem too long for whole [B, S, W] arrays (SPEC section 11): "topk" (the candidate's picks
    # against the oracle's), "native-topk" (against its native run's), "oracle:index_scores" and
    # "native:index_scores". The judge takes them in place of comparing arrays it is not handed.
    streamed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # True for a problem the CHUNK table was not measured on (the long samples, SPEC section 11): a
    # float32 entry's `chunk` bound of a loss or gradient is then at least alpha times the float32
    # reference's own error on it (`at_dtype` against `oracle`, as the oracle check's baseline;
    # judge._native_bound): a gradient summed over 10^5 rows with heavy cancellation loses to float32
    # whatever the order of its sums, and two orders differ by about as much (docs/judging.md, "Chunk
    # bounds at length").
    chunk_at_length: bool = False

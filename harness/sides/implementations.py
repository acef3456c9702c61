"""Everything that produces outputs, behind one protocol, and the cache of what they produced.

An implementation has a `name` and `run(problem, point) -> Outputs`: the outputs of one
problem (a loaded fixture, or a catalogue case being regenerated) at one point (dtype,
indexer chunk, teacher chunk, query chunk, mesh), keyed by the canonical names of
harness.outputs.
The registry:

  jax           jax_impl (native, head-chunked and query-chunked: the point's knobs decide; a
                point with a mesh runs jax_impl.sharded on that mesh, in a process that has the
                devices)
  torch_ref     the PyTorch reference, live (chunks ignored: it has none)
  goldens       the torch outputs stored in the fixture (no torch needed)
  module[:factory]  a plug-in following docs/plugins.md (`CSAConfig`, `indexer_forward`,
                `indexer_loss_and_grads`, optionally `indexer_parity_bundle`)

A plug-in may offer part of the protocol: without `indexer_loss_and_grads` it provides
the forward quantities only, without `indexer_forward` the losses only, and an optional
`NOT_PROVIDED = {name or prefix: reason}` withholds further names; the judge reports
each withheld quantity as `not_provided`. An implementation that cannot run a point where
it runs returns `Outputs(..., not_applicable="not applicable on <backend>: <reason>")`.

Parameter layout: both built-in sides take the canonical [in, out] layout, so the
mapping from canonical names to a side's layout is the identity. A plug-in that keeps
another layout (torch nn.Linear is [out, in]) converts inside its own entry points;
`PARAM_LAYOUT` is the one place the harness records it. This module is also the one
place that maps each side's result names to the canonical ones.

Caching: `outputs(impl, case, point)` runs each (implementation, case, point) once per
process (torch: once per case and dtype); keyed by the fixtures directory too, which a
test may point elsewhere (CSA_PARITY_FIXTURES). Where harness.sides.reference_cache is on (the
workers of `csa-parity run`) the live reference's outputs also persist on disk between runs,
keyed by everything they follow from; the compiled programs persist in JAX's own cache
(harness.sides.timing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import os
import sys
from typing import Any, Mapping

import numpy as np

from ..judging.compare import to_numpy
from ..outputs import (CODE_QUANTITIES, FORWARD_QUANTITIES, LOSS_VARIANTS, OWN, PARAM_NAMES, ROTATED_NAMES,
                       STAGE_INPUTS, Outputs, all_names)
from ..points import Point, mesh_text
from ..problems.matrix import seq_split_reason
from . import reference_cache, timing, worker
from .worker import WorkerCrash

PROTOCOL = ("CSAConfig", "indexer_forward", "indexer_loss_and_grads")
REQUIRED = ("CSAConfig",)  # and at least one of the two entry points

# Built-in candidates, by short name -> "module" or "module:factory".
BUILTINS = {"jax": "jax_impl"}
REFERENCES = ("live", "goldens")  # the reference a run is judged against: torch_ref or goldens

# Canonical name -> layout each built-in side expects (identity for both).
PARAM_LAYOUT = {"jax": "[in, out]", "torch": "[in, out]"}

# The run-time knobs a point sets on top of the problem's config (never stored in a fixture).
KNOBS = ("indexer_head_chunk", "loss_head_chunk", "query_chunk", "sparse_loss", "teacher_normaliser")
# The teachers a plug-in computes unless it says otherwise (`TEACHERS = ("compressed",)`, say):
# the SPEC's default. At a point of another teacher its losses are not provided.
DEFAULT_TEACHERS = ("joint",)


class ImplementationError(ValueError):
    """A plug-in that cannot be loaded or does not follow the protocol."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """What an implementation runs on: a config (no run-time knobs), the inputs and
    parameters (canonical names, numpy, [in, out]), the float64 oracle's top-k (the
    `selection` of the sparse_at_oracle variant; None while the oracle itself runs) and,
    where the problem quantizes, the oracle's codes and scales (CODE_QUANTITIES: what every
    other run scores, SPEC section 10's common codes; None while the oracle runs).
    A loaded fixture (harness.problems.fixtures.Fixture) has the same attributes."""

    name: str
    config: Mapping[str, Any]
    inputs: Mapping[str, np.ndarray]
    params: Mapping[str, np.ndarray]
    oracle_selection: np.ndarray | None = None
    oracle_codes: Mapping[str, np.ndarray] | None = None


def run_config(problem_config: Mapping[str, Any], point: Point, sparse: bool) -> dict[str, Any]:
    """The problem's config plus the point's knobs (plain dict, for any side's from_dict).
    `query_chunk` and `scoring_backend` are passed only when set, so a plug-in that predates
    them still runs every point without them."""
    cfg = {**problem_config, "indexer_head_chunk": point.ichunk, "loss_head_chunk": point.tchunk,
           "sparse_loss": sparse, "teacher_normaliser": point.teacher}
    if point.qchunk:
        cfg["query_chunk"] = point.qchunk
    if point.backend != "xla":
        cfg["scoring_backend"] = point.backend
    return cfg


def bundle_values(raw) -> dict[str, np.ndarray]:
    """The stored form of a parity bundle (`indexer_parity_bundle`, `sharded_parity_bundle`:
    {"forward": dict, "dense" | "sparse" | "sparse_at_selection": (loss, param_grads,
    input_grads)}): canonical name -> host array, `sparse_at_selection` stored as the
    `sparse_at_oracle` variant (the selection a bundle is handed is the oracle's top-k)."""
    missing = [k for k in ("forward", "dense", "sparse", "sparse_at_selection") if k not in raw]
    if missing:
        raise ValueError(f"a parity bundle must hold forward, dense, sparse and sparse_at_selection; "
                         f"this one lacks {', '.join(missing)}")
    return _canonical(raw["forward"], {"dense": raw["dense"], "sparse": raw["sparse"],
                                       "sparse_at_oracle": raw["sparse_at_selection"]})


def _canonical(forward, runs) -> dict[str, np.ndarray]:
    """Canonical names from a forward dict and {variant: (loss, param_grads, input_grads)}."""
    values = {k: to_numpy(v) for k, v in (forward or {}).items() if k in FORWARD_QUANTITIES + CODE_QUANTITIES}
    for variant, (loss, pg, ig) in runs.items():
        values[f"loss.{variant}"] = to_numpy(loss).reshape(())
        values.update({f"grad.{variant}.{k}": to_numpy(v) for k, v in pg.items()})
        values.update({f"input_grad.{variant}.{k}": to_numpy(v) for k, v in (ig or {}).items()})
    return values


# --------------------------------------------------------------------------- protocol sides


@dataclasses.dataclass(frozen=True)
class ProtocolImplementation:
    """jax_impl or a plug-in: anything with the names of docs/plugins.md."""

    name: str  # the spec it was loaded from, e.g. "jax" or "mypkg.kernels:make_impl"
    api: Any

    def config(self, config: Mapping[str, Any]):
        return self.api.CSAConfig.from_dict(dict(config))

    def _has(self, attr: str) -> bool:
        return callable(getattr(self.api, attr, None))

    def teachers(self) -> tuple[str, ...]:
        """The teachers the plug-in computes: its `TEACHERS`, else the SPEC's default (joint)."""
        return tuple(getattr(self.api, "TEACHERS", DEFAULT_TEACHERS))

    def missing(self, point: Point | None = None) -> dict[str, str]:
        out = dict(getattr(self.api, "NOT_PROVIDED", {}) or {})
        if point is not None and point.teacher not in self.teachers():
            why = (f"{self.name} computes the {' and '.join(self.teachers())} teacher only (its TEACHERS), "
                   f"not the {point.teacher} one")
            out.update({"loss.": why, "grad.": why, "input_grad.": why})
        if not self._has("indexer_forward"):
            out.update({q: f"{self.name} has no indexer_forward" for q in FORWARD_QUANTITIES + CODE_QUANTITIES})
        if not self._has("indexer_loss_and_grads"):
            why = f"{self.name} has no indexer_loss_and_grads"
            out.update({"loss.": why, "grad.": why, "input_grad.": why})
        return out

    def run(self, problem, point: Point) -> Outputs:
        """Every quantity at `point`. Where the problem quantizes and the oracle's codes are
        known, twice (SPEC section 10): scoring the oracle's codes (the plain names: judged
        like any problem's), then on the candidate's own codes (its codes and scales under
        their names, its other outputs under `own.`: judged against the reference recomputed
        on those codes)."""
        if point.mesh is not None:
            return self._run_sharded(problem, point)
        codes = getattr(problem, "oracle_codes", None)
        values, errors = self._run_calls(problem, point, codes)
        if codes is not None:
            own, own_errors = self._run_calls(problem, point, None, " (own codes)")
            values = {k: v for k, v in values.items() if k not in CODE_QUANTITIES}
            values.update({k: v for k, v in own.items() if k in CODE_QUANTITIES})
            values.update({OWN + k: v for k, v in own.items() if k not in CODE_QUANTITIES})
            errors.update({(k if k in CODE_QUANTITIES else OWN + k): line for k, line in own_errors.items()})
        missing = self.missing(point)
        values = {k: v for k, v in values.items() if not any(k.removeprefix(OWN).startswith(m) for m in missing)}
        if problem.oracle_selection is None:
            missing.setdefault("loss.sparse_at_oracle", "no oracle selection was given")
            missing.setdefault("grad.sparse_at_oracle.", "no oracle selection was given")
        return Outputs(self.name, values, missing, errors=errors)

    def _run_calls(self, problem, point: Point, codes, tag: str = "") -> tuple[dict, dict]:
        """(values, errors) of every call at `point`; `codes` (the oracle's, or None) handed to
        each entry point as `codes=` (docs/plugins.md)."""
        selection = problem.oracle_selection
        extra = {} if codes is None else {"codes": dict(codes)}
        dense_cfg = self.config(run_config(problem.config, point, False))
        validate = getattr(self.api, "validate_inputs", None)  # optional: host-side value checks
        if callable(validate) and not tag:
            with worker.stage(f"{self.name} validate_inputs", point.label):
                validate(problem.params, problem.inputs, dense_cfg, selection)
        bundle = getattr(self.api, "indexer_parity_bundle", None)
        losses = self._has("indexer_loss_and_grads") and point.teacher in self.teachers()
        values, errors = {}, {}
        if callable(bundle) and selection is not None and losses:
            with worker.stage(f"{self.name} indexer_parity_bundle{tag}", point.label):
                values = bundle_values(bundle(problem.params, problem.inputs, dense_cfg, point.dtype, selection,
                                              **extra))
                memory = getattr(self.api, "parity_bundle_memory", None)  # optional: the program's compiled temp
                if callable(memory):
                    timing.note_temp(memory(problem.params, problem.inputs, dense_cfg, point.dtype, selection, **extra))
        else:
            # One call at a time, each owning its quantities: a loss that raises leaves the forward judged.
            if self._has("indexer_forward"):
                def forward():
                    return _canonical(self.api.indexer_forward(problem.params, problem.inputs, dense_cfg, point.dtype,
                                                               **extra), {})

                values.update(_attributed(self.name, f"indexer_forward{tag}", point,
                                          FORWARD_QUANTITIES + CODE_QUANTITIES, errors, forward) or {})
            if losses:
                sparse_cfg = self.config(run_config(problem.config, point, True))
                todo = [("dense", dense_cfg, None), ("sparse", sparse_cfg, None)]
                if selection is not None:
                    todo.append(("sparse_at_oracle", sparse_cfg, selection))
                for variant, cfg, sel in todo:
                    def loss(cfg=cfg, sel=sel, variant=variant):
                        return _canonical(None, {variant: self.api.indexer_loss_and_grads(
                            problem.params, problem.inputs, cfg, point.dtype, selection=sel, **extra)})

                    owns = (f"loss.{variant}", f"grad.{variant}.", f"input_grad.{variant}.")
                    values.update(_attributed(self.name, f"indexer_loss_and_grads ({variant}){tag}", point, owns,
                                              errors, loss) or {})
        return values, errors

    def _run_sharded(self, problem, point: Point) -> Outputs:
        sharded = getattr(self.api, "sharded", None) if self.name != "jax" else importlib.import_module("jax_impl.sharded")
        if sharded is None:
            return Outputs(self.name, not_applicable=f"{self.name} has no sharded entry point")
        import jax
        from jax.sharding import Mesh

        data, seq, model = point.mesh
        n = data * seq * model
        why = seq_split_reason(point.case, seq)
        if why:
            return Outputs(self.name, not_applicable=why)
        quantized = getattr(problem, "oracle_codes", None) is not None
        if quantized and point.dtype != "float64":
            return Outputs(self.name, not_applicable=(
                "not applicable: the sharded entry points take no codes=, so a quantized problem runs "
                "sharded in float64 only, on its own codes, which must be the oracle's there"))
        if jax.device_count() < n:
            return Outputs(self.name, not_applicable=(
                f"not applicable on {jax.default_backend()} with {jax.device_count()} device(s): mesh "
                f"{mesh_text(point.mesh)} needs {n} (run the sharded slice in its own process: pytest tests/sharded)"))
        mesh = Mesh(np.array(jax.devices()[:n]).reshape(point.mesh), ("data", "seq", "model"))
        cfg = self.config(run_config(problem.config, point, False))
        with worker.stage(f"{self.name} sharded_parity_bundle", point.label):
            values = bundle_values(sharded.sharded_parity_bundle(problem.params, problem.inputs, cfg, point.dtype,
                                                                 mesh, problem.oracle_selection))
            memory = getattr(sharded, "sharded_parity_bundle_memory", None)
            if callable(memory):
                timing.note_temp(memory(problem.params, problem.inputs, cfg, point.dtype, mesh, problem.oracle_selection))
        missing = self.missing(point)
        if quantized:  # float64, on its own codes, which the sharded bundle does not return
            missing.update({q: f"{self.name}'s sharded bundle returns no codes (one device's run judges them)"
                            for q in CODE_QUANTITIES if q not in values})
        return Outputs(f"{self.name} mesh {mesh_text(point.mesh)}", values, missing)


def importable_from_cwd() -> str:
    """Put the current directory first on sys.path, as `python -m` and pytest do, unless it is
    there already (as '' or by name): a plug-in's `package.module` then resolves from where the
    command runs (`csa-parity run --impl examples.scores_kernel` from the repository root), then
    from the installed packages. Worker processes start with this sys.path. Returns the directory."""
    cwd = os.getcwd()
    if "" not in sys.path and not any(os.path.abspath(p) == cwd for p in sys.path if p):
        sys.path.insert(0, cwd)
    return cwd


def load_implementation(spec: str) -> ProtocolImplementation:
    """`jax` (built-in), `package.module` (the module itself) or `package.module:factory`
    (the object `factory()` returns). A plug-in's module is imported from the current
    directory first, then from the installed packages (`importable_from_cwd`)."""
    target = BUILTINS.get(spec, spec)
    module_name, _, factory = target.partition(":")
    cwd = importable_from_cwd() if spec not in BUILTINS else None
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises on import
        where = f" (looked in the current directory {cwd} and the installed packages)" if cwd else ""
        raise ImplementationError(
            f"implementation {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}){where}; "
            f"expected 'jax' or 'package.module[:factory]'"
        ) from None
    api = module
    if factory:
        if not hasattr(module, factory):
            raise ImplementationError(f"implementation {spec!r}: module {module_name!r} has no {factory!r}")
        api = getattr(module, factory)()
    lacking = [n for n in REQUIRED if not callable(getattr(api, n, None))]
    entry_points = [n for n in PROTOCOL[1:] if callable(getattr(api, n, None))]
    stage = getattr(api, "STAGE", None)
    if stage is not None:  # a stage plug-in, e.g. `STAGE = "scores"` and `scores(q, keys, head_weights)`
        if stage not in STAGE_INPUTS:
            raise ImplementationError(f"implementation {spec!r}: STAGE={stage!r} is not a stage the harness "
                                      f"offers (valid: {', '.join(STAGE_INPUTS)})")
        if not callable(getattr(api, stage, None)):
            raise ImplementationError(f"implementation {spec!r} declares STAGE={stage!r} but has no function "
                                      f"{stage}({', '.join(STAGE_INPUTS[stage])})")
        arrays = getattr(api, "ARRAYS", STAGE_ARRAYS[0])
        if arrays not in STAGE_ARRAYS:
            raise ImplementationError(f"implementation {spec!r}: ARRAYS={arrays!r} is not an array kind the harness "
                                      f"hands a stage (valid: {', '.join(STAGE_ARRAYS)}; default jax)")
        return StageImplementation(spec, api, stage, arrays)
    if lacking or not entry_points:
        missing = lacking + ([] if entry_points else ["indexer_forward or indexer_loss_and_grads"])
        raise ImplementationError(
            f"implementation {spec!r} lacks {', '.join(missing)} (the protocol of docs/plugins.md: "
            f"{', '.join(PROTOCOL)}; one of the two entry points may be left out)"
        )
    return ProtocolImplementation(spec, api)


# --------------------------------------------------------------------------- stage plug-ins

# What a stage plug-in's function is handed (its `ARRAYS`, default the first): `jax` arrays on JAX's
# default device of the process it runs in, the same arrays in its forward call and under jax.vjp;
# or `numpy` host arrays (a plug-in that is not written in JAX; its gradient is taken only when it
# returns a JAX array).
STAGE_ARRAYS = ("jax", "numpy")


def stage_cotangent(shape) -> np.ndarray:
    """The fixed cotangent [B, S, W] (float64) a stage's gradient is taken with: seeded normal
    draws, so every output element reaches the gradient with its own weight."""
    return np.random.default_rng(11).standard_normal(shape)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _attributed(spec: str, call: str, point: Point, owns, errors: dict, fn):
    """`fn()` (one call into implementation `spec`, its results made host arrays inside, so an
    asynchronous JAX error or crash is the call's): its result, or None with one line under
    each name of `owns` in `errors` when a plug-in raised or the call killed or hung a worker
    before (harness.sides.worker). A built-in side's exception propagates (a bug there is a traceback)."""
    try:
        with worker.stage(f"{spec} {call}", point.label):
            return fn()
    except WorkerCrash as exc:
        line = str(exc)
    except Exception as exc:  # anything the plug-in raises
        if spec in BUILTIN_SPECS:
            raise
        worker.note_failure(exc)
        line = f"plug-in {spec} raised in {call} at {point.label}: {_first_line(exc)}"
    errors.update({name: line for name in owns})
    return None


@dataclasses.dataclass(frozen=True)
class StageImplementation:
    """A plug-in that provides one stage: `STAGE = "scores"` and `scores(q, keys, head_weights)
    -> [B, S, W]`. At a point of dtype t it is given the live reference's own stage inputs at t
    (q after RoPE [B, S, HI, DI] and K [B, W, DI] holding their dtype-t values, w [B, S, HI];
    all as wide-dtype arrays, which is what the reference's stage computes with) and returns
    the unmasked scores in the wide dtype. The inputs are JAX arrays on JAX's default device,
    in the forward call and under jax.vjp alike, unless the plug-in says `ARRAYS = "numpy"`
    (STAGE_ARRAYS). When it returns a JAX array its gradient with respect to the three inputs is
    taken with jax.vjp and the harness's fixed cotangent. Or `STAGE = "quantizer"` and
    `quantizer(x, quant) -> (codes, scales)` (SPEC section 7a steps 2-3; `_run_quantizer`), on a
    problem with index_quant only. Every other quantity is not provided."""

    name: str
    api: Any
    stage: str
    arrays: str = STAGE_ARRAYS[0]

    def missing(self) -> dict[str, str]:
        why = f"{self.name} provides only the {self.stage} stage"
        return {**{n: why for n in all_names() + CODE_QUANTITIES}, "loss.": why, "grad.": why, "input_grad.": why}

    def run(self, problem, point: Point) -> Outputs:
        if point.mesh is not None:
            return Outputs(self.name, not_applicable=f"{self.name} is a stage plug-in: no sharded runs")
        if self.stage == "quantizer":
            return self._run_quantizer(problem, point)
        inputs = reference_stage_values(problem, point.dtype)
        args = [inputs[f"input.{n}"] for n in STAGE_INPUTS[self.stage]]
        if self.arrays == "jax":  # on JAX's default device; the forward call and jax.vjp get the same arrays
            import jax

            args = [jax.device_put(a) for a in args]
        fn = getattr(self.api, self.stage)
        expected = inputs[f"stage.{self.stage}"].shape
        out_name, grad_prefix = f"stage.{self.stage}", f"stage_grad.{self.stage}."
        missing, errors = self.missing(), {}

        def forward():
            out = fn(*args)
            if tuple(np.shape(out)) != tuple(expected):
                raise ValueError(f"{self.stage}() returned shape {tuple(np.shape(out))}, expected {tuple(expected)} "
                                 "[B, S, W]")
            return out, to_numpy(out)

        result = _attributed(self.name, f"{self.stage}()", point, (out_name, grad_prefix), errors, forward)
        if result is None:  # the forward failed: so did everything of the stage
            return Outputs(self.name, {}, missing, errors=errors)
        out, values = result[0], {out_name: result[1]}
        if type(out).__module__.startswith("jax"):
            def backward():
                import jax
                import jax.numpy as jnp

                primal, pullback = jax.vjp(fn, *(a if isinstance(a, jax.Array) else jnp.asarray(a) for a in args))
                ct = jnp.asarray(stage_cotangent(expected), primal.dtype)
                return {f"{grad_prefix}{n}": to_numpy(g) for n, g in zip(STAGE_INPUTS[self.stage], pullback(ct))}

            values.update(_attributed(self.name, f"the backward of {self.stage}() (jax.vjp)", point, (grad_prefix,),
                                      errors, backward) or {})
        else:
            missing[f"stage_grad.{self.stage}."] = (f"{self.name} returned {type(out).__name__}, not a JAX "
                                                    "array: its gradient is not taken (JAX plug-ins: jax.vjp)")
        return Outputs(self.name, values, missing, errors=errors)

    def _run_quantizer(self, problem, point: Point) -> Outputs:
        """`quantizer(x, quant) -> (codes, scales)`, called twice: on the reference's rotated queries
        [B, S, HI, DI], then on its rotated keys [B, W, DI] (each the dtype's values held wide,
        what the reference's own quantizer saw), with the problem's index_quant. The codes must be
        uint8 of x's shape, the scales float32 [..., DI / block]; anything else is an error of that
        call, one line naming the quantizer."""
        quant = problem.config.get("index_quant")
        if quant is None:
            return Outputs(self.name, not_applicable=quantizer_not_applicable(problem.name))
        ref = reference_quantizer_values(problem, point.dtype)
        fn = getattr(self.api, self.stage)
        values, errors = {}, {}
        for side, rotated in ROTATED_NAMES.items():
            names = (f"stage.quantizer.{side}_codes", f"stage.quantizer.{side}_scales")
            x = ref[f"input.{rotated}"]

            def call(x=x, side=side, names=names):
                if self.arrays == "jax":  # on JAX's default device
                    import jax

                    x = jax.device_put(x)
                out = fn(x, dict(quant))
                if not isinstance(out, (tuple, list)) or len(out) != 2:
                    raise ValueError(f"quantizer() returned {type(out).__name__}, expected (codes, scales)")
                got = {}
                for name, value, dtype, what in zip(names, out, (np.uint8, np.float32), ("codes", "scales")):
                    arr, want = to_numpy(value), ref[name]
                    if arr.shape != want.shape or arr.dtype != dtype:
                        raise ValueError(f"quantizer() returned {side} {what} of shape {tuple(arr.shape)} {arr.dtype}, "
                                         f"expected {tuple(want.shape)} {np.dtype(dtype)}")
                    got[name] = arr
                return got

            call_name = f"quantizer() ({'queries' if side == 'query' else 'keys'})"
            values.update(_attributed(self.name, call_name, point, names, errors, call) or {})
        return Outputs(self.name, values, self.missing(), errors=errors)


def quantizer_not_applicable(case: str) -> str:
    return f"case {case} does not quantize (index_quant is null)"


def reference_stage_values(problem, dtype: str) -> dict[str, np.ndarray]:
    """The live reference's scoring stage at `dtype` (cached per problem and dtype): its inputs
    (`input.q`, `input.keys`, `input.head_weights`: the wide-dtype values its stage computes
    with), its output `stage.scores` and `stage_grad.scores.<input>` (torch autograd with the
    fixed cotangent)."""
    return _reference_stage_values(problem.name, dtype, fixtures_dir())


@functools.lru_cache(maxsize=None)
def _reference_stage_values(name, dtype, directory) -> dict[str, np.ndarray]:
    with timing.section("reference"):
        return _cached_stage_values("scores", name, dtype, directory, _reference_stage_values_timed)


def _cached_stage_values(stage: str, name, dtype, directory, compute) -> dict[str, np.ndarray]:
    """`compute(name, dtype, directory)`, read from the reference cache where it is on (a stage
    plug-in's every worker would otherwise import torch and compute the same stage again), or
    computed and stored there."""
    if not reference_cache.enabled():
        return compute(name, dtype, directory)
    key = reference_cache.key(reference_cache.stage_key_parts(_fixture(name, directory).path, dtype, stage))
    stored = reference_cache.load(key)
    if isinstance(stored, dict):
        timing.count("references_loaded")
        return stored
    values = compute(name, dtype, directory)
    timing.count("references_computed")
    reference_cache.store(key, values)
    return values


def _reference_stage_values_timed(name, dtype, directory) -> dict[str, np.ndarray]:
    import torch_ref

    problem = _fixture(name, directory)
    cfg = torch_ref.CSAConfig.from_dict({k: v for k, v in problem.config.items() if k not in KNOBS})
    with worker.stage("torch_ref scoring stage", Point(name, dtype).label), deterministic_torch() as torch:
        st = torch_ref.forward_stages(problem.params, problem.inputs, cfg, dtype)
        wide = st["head_weights"].dtype
        leaves = [st["queries"].to(wide).detach().requires_grad_(True), st["keys"].to(wide).detach().requires_grad_(True),
                  st["head_weights"].detach().requires_grad_(True)]
        with torch.enable_grad():
            out = torch_ref.score_stage(*leaves)
            ct = torch.as_tensor(stage_cotangent(tuple(out.shape))).to(wide)
            grads = torch.autograd.grad(out, leaves, ct)
    values = {f"input.{n}": t.detach().numpy().copy() for n, t in zip(STAGE_INPUTS["scores"], leaves)}
    values["stage.scores"] = out.detach().numpy().copy()
    values.update({f"stage_grad.scores.{n}": g.numpy().copy() for n, g in zip(STAGE_INPUTS["scores"], grads)})
    return values


def torch_rotated(problem, cfg, dtype: str) -> dict:
    """torch_ref's rotated queries [B, S, HI, DI] and keys [B, W, DI] at `dtype` (SPEC section 7a
    step 1: after RoPE, rotated in the wide dtype, rounded to `dtype`), as {"query", "key"} ->
    tensor: what its quantizer sees. `cfg` a torch_ref.CSAConfig with index_quant."""
    import torch
    import torch_ref

    stages = torch_ref.forward_stages(problem.params, problem.inputs, cfg, dtype)
    wide = torch.float64 if dtype == "float64" else torch.float32
    return {side: torch_ref.quant.rotate(stages[name], cfg.index_quant, stages[name].dtype, wide)
            for side, name in (("query", "queries"), ("key", "keys"))}


def reference_quantizer_values(problem, dtype: str) -> dict[str, np.ndarray]:
    """The live reference's quantizer at `dtype` (cached per problem and dtype), for a problem with
    `index_quant`: its inputs (`input.rotated_queries` [B, S, HI, DI], `input.rotated_keys`
    [B, W, DI]: the queries and keys after RoPE, rotated (SPEC section 7a step 1), the dtype's values
    held in the wide dtype) and the codes (uint8) and scales (float32) its own quantizer makes of
    them (torch_ref.quant.quantize, steps 2-3), `stage.quantizer.<CODE_QUANTITIES>`."""
    return _reference_quantizer_values(problem.name, dtype, fixtures_dir())


@functools.lru_cache(maxsize=None)
def _reference_quantizer_values(name, dtype, directory) -> dict[str, np.ndarray]:
    with timing.section("reference"):
        return _cached_stage_values("quantizer", name, dtype, directory, _reference_quantizer_values_timed)


def _reference_quantizer_values_timed(name, dtype, directory) -> dict[str, np.ndarray]:
    import torch_ref

    problem = _fixture(name, directory)
    cfg = torch_ref.CSAConfig.from_dict({k: v for k, v in problem.config.items() if k not in KNOBS})
    quant = dict(problem.config["index_quant"])
    with worker.stage("torch_ref quantizer stage", Point(name, dtype).label), deterministic_torch() as torch:
        values = {}
        for side, rotated in torch_rotated(problem, cfg, dtype).items():
            rotated_name = ROTATED_NAMES[side]
            rotated = rotated.to(torch.float64 if dtype == "float64" else torch.float32)
            _, _, codes, scales = torch_ref.quant.quantize(rotated, quant, rotated.dtype)
            values[f"input.{rotated_name}"] = rotated.numpy().copy()
            values[f"stage.quantizer.{side}_codes"] = codes.numpy().astype(np.uint8)
            values[f"stage.quantizer.{side}_scales"] = scales.numpy().astype(np.float32)
    return values


def stage_references(case: str, dtype: str, stage: str = "scores") -> Outputs:
    """The reference's stage quantities of `stage` at `dtype` as Outputs (the judge's oracle /
    at_dtype of a stage entry); a quantizer stage on a case that does not quantize is not applicable."""
    problem = fixture(case)
    if stage == "quantizer":
        if problem.config.get("index_quant") is None:
            return Outputs(f"torch_ref@{dtype}", not_applicable=quantizer_not_applicable(case))
        values = reference_quantizer_values(problem, dtype)
    else:
        values = reference_stage_values(problem, dtype)
    return Outputs(f"torch_ref@{dtype}", {k: v for k, v in values.items() if not k.startswith("input.")})


# --------------------------------------------------------------------------- forward intermediates


def forward_stages(spec: str, case: str, dtype: str, sparse: bool = False,
                   teacher: str = "joint") -> dict[str, np.ndarray] | None:
    """The forward intermediates (harness.outputs.FORWARD_STAGES) of implementation `spec`
    (`jax`, a plug-in with `forward_stages`, or `torch_ref`) on `case` at `dtype`, native path;
    the teacher (of `teacher`) and student of the dense loss, or (`sparse`) of the sparse loss on
    the float64 oracle's selection. None when the implementation exposes none. Cached per process.
    A plug-in's run in a worker process outside one (harness.sides.worker.isolated)."""
    if spec not in BUILTIN_SPECS and not worker.inside():
        return _isolated_forward_stages(spec, case, dtype, sparse, teacher, fixtures_dir())
    return _forward_stages(spec, case, dtype, sparse, teacher, fixtures_dir())


@functools.lru_cache(maxsize=None)
def _isolated_forward_stages(spec, case, dtype, sparse, teacher, directory):
    return worker.isolated("harness.sides.implementations:_forward_stages", spec, case, dtype, sparse, teacher,
                           directory, label=Point(case, dtype, teacher=teacher).label)


@functools.lru_cache(maxsize=None)
def _forward_stages(spec: str, case: str, dtype: str, sparse: bool, teacher: str,
                    directory) -> dict[str, np.ndarray] | None:
    problem = _fixture(case, directory)
    selection = _outputs("torch_ref", case, Point(case, "float64"), directory)["topk_indices"] if sparse else None
    cfg_dict = run_config(problem.config, Point(case, dtype, teacher=teacher), sparse)
    if spec == "torch_ref":
        import torch_ref

        cfg = torch_ref.CSAConfig.from_dict({k: v for k, v in cfg_dict.items()
                                             if k not in KNOBS or k in ("sparse_loss", "teacher_normaliser")})
        with deterministic_torch():
            raw = torch_ref.forward_stages(problem.params, problem.inputs, cfg, dtype, selection)
    else:
        impl = implementation(spec)
        fn = getattr(getattr(impl, "api", None), "forward_stages", None)
        if not callable(fn):
            return None
        with worker.stage(f"{spec} forward_stages", Point(case, dtype, teacher=teacher).label):
            raw = fn(problem.params, problem.inputs, impl.config(cfg_dict), dtype, selection)
            return {k: to_numpy(v) for k, v in raw.items()}
    return {k: to_numpy(v) for k, v in raw.items()}


# --------------------------------------------------------------------------- the reference


@contextlib.contextmanager
def deterministic_torch():
    """One thread and deterministic algorithms while torch computes; restored after."""
    import torch

    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield torch
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class TorchReference:
    """torch_ref, live: the oracle in float64 and the reference at each low dtype. Chunks
    and meshes are ignored (torch_ref has none). bfloat16 compressed keys come back as
    ml_dtypes.bfloat16 (exact; what the fixture stores); read them with to_numpy."""

    name: str = "torch_ref"
    # The loss variants to compute (the order errors of harness.run.regenerate need two of them).
    variants: tuple[str, ...] = LOSS_VARIANTS

    def run(self, problem, point: Point, codes: Mapping[str, np.ndarray] | None = None) -> Outputs:
        """The reference at `point`. Where the problem quantizes: below float64 it scores the
        oracle's codes (`problem.oracle_codes`, SPEC section 10's common codes), or `codes` when
        given (at any dtype: the reference recomputed on a candidate's own codes); its rotated
        values (ROTATED_NAMES) come with it, and in float64, unless `codes` are given, the codes
        and scales it computed (the oracle's)."""
        import ml_dtypes
        import torch_ref

        cfg = {k: v for k, v in problem.config.items() if k not in KNOBS}
        cfg["teacher_normaliser"] = point.teacher
        dense = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": False})
        sparse = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": True})
        dt = point.dtype
        quantized = cfg.get("index_quant") is not None
        imposed = codes if codes is not None else (getattr(problem, "oracle_codes", None) if dt != "float64" else None)
        extra = {"codes": dict(imposed)} if quantized and imposed is not None else {}

        with worker.stage("torch_ref", point.label), deterministic_torch() as torch:
            def np_of(t) -> np.ndarray:
                t = t.detach().cpu()
                if t.dtype == torch.bfloat16:
                    return t.float().numpy().astype(ml_dtypes.bfloat16)
                return t.numpy().copy()

            fwd = torch_ref.indexer_forward(problem.params, problem.inputs, dense, dt, **extra)
            values = {"compressed_keys": np_of(fwd["compressed_keys"]),
                      "index_scores": np_of(fwd["index_scores"]),
                      "topk_indices": np_of(fwd["topk_indices"]).astype(np.int64)}
            if quantized:
                for side, rotated in torch_rotated(problem, dense, dt).items():
                    values[ROTATED_NAMES[side]] = np_of(rotated)
                if not extra:
                    values.update({q: np_of(fwd[q]) for q in CODE_QUANTITIES})
            todo = [("dense", dense, None), ("sparse", sparse, None)]
            if problem.oracle_selection is not None and dt != "float64":
                todo.append(("sparse_at_oracle", sparse, problem.oracle_selection))
            for variant, c, sel in [t for t in todo if t[0] in self.variants]:
                loss, grads, _ = torch_ref.indexer_loss_and_grads(problem.params, problem.inputs, c, dt,
                                                                  selection=sel, **extra)
                values[f"loss.{variant}"] = np_of(loss).reshape(())
                for p in PARAM_NAMES:
                    values[f"grad.{variant}.{p}"] = np_of(grads[p])
        missing = {"input_grad.": "torch_ref returns no input gradients to the harness"}
        if dt == "float64":
            missing["loss.sparse_at_oracle"] = missing["grad.sparse_at_oracle."] = (
                "the float64 oracle's own selection is the selection: sparse_at_oracle is sparse")
        return Outputs(f"torch_ref@{dt}", values, missing)


@dataclasses.dataclass(frozen=True)
class Goldens:
    """The torch outputs stored in the fixture (harness.problems.fixtures.Fixture.goldens_of): those of
    the point's teacher."""

    name: str = "goldens"

    def run(self, problem, point: Point) -> Outputs:
        goldens = problem.goldens_of(point.dtype, point.teacher) if hasattr(problem, "goldens_of") else {}
        if not goldens:
            return Outputs(self.name, not_applicable=f"{problem.name} holds no goldens of the {point.teacher} teacher")
        values = {k: to_numpy(v) if k != "topk_indices" else v for k, v in goldens.items()
                  if not k.startswith("orderr.")}  # the order errors are the reference's, not outputs
        missing = {"input_grad.": "the fixture stores no input gradients"}
        return Outputs(f"goldens@{point.dtype}", values, missing)


# --------------------------------------------------------------------------- registry + cache


def fixtures_dir() -> str | None:
    return os.environ.get("CSA_PARITY_FIXTURES") or None


@functools.lru_cache(maxsize=None)
def implementation(spec: str):
    """The implementation registered under `spec` (built-in name or plug-in spec)."""
    if spec == "torch_ref":
        return TorchReference()
    if spec == "goldens":
        return Goldens()
    return load_implementation(spec)


@functools.lru_cache(maxsize=None)
def _fixture(case: str, directory: str | None):
    from ..problems.fixtures import load_case

    return load_case(case, directory)


def fixture(case: str):
    """The loaded, validated fixture of `case` (cached per process and fixtures directory)."""
    return _fixture(case, fixtures_dir())


def order_errors(case: str, dtype: str, teacher: str = "joint") -> dict[str, float]:
    """The reference's stored worst error at `dtype` over K evaluation orders, per canonical
    name: computed once, at fixture time, and used in live and goldens mode alike."""
    return fixture(case).order_errors(dtype, teacher)


def outputs(spec: str, case: str, point: Point) -> Outputs:
    """The Outputs of implementation `spec` on the fixture `case` at `point` (cached)."""
    if spec in ("torch_ref", "goldens"):  # no knobs, no mesh: one run per (case, dtype, teacher)
        point = Point(point.case, point.dtype, teacher=point.teacher)
    return _outputs(spec, case, point, fixtures_dir())


BUILTIN_SPECS = ("jax", "torch_ref", "goldens")


@functools.lru_cache(maxsize=None)
def _outputs(spec: str, case: str, point: Point, directory: str | None) -> Outputs:
    with timing.section("reference" if spec in ("torch_ref", "goldens") else "implementation"):
        return _outputs_timed(spec, case, point, directory)


_PREFETCHED: dict = {}  # (case, point, fixtures directory) -> jax's Outputs computed ahead (prefetch)


def prefetch(specs, threads: int) -> int:
    """jax_impl's outputs at the points `specs` (Point.spec()) computed ahead in `threads`
    threads, kept for `outputs` to hand out once each: XLA compiles with the GIL released, so
    one process (a TPU's only one) compiles the programs of many points at once. A point that
    raises here, or that this backend cannot compute, is left to its own run (attributed and
    reported there). Returns how many were computed."""
    import concurrent.futures as cf

    from .. import platforms

    directory = fixtures_dir()
    backend = platforms.current_backend()

    def one(spec: str) -> None:
        point = Point.parse(spec)
        if platforms.not_applicable(point.dtype, "forward", backend) is not None:
            return
        try:
            out = implementation("jax").run(_fixture(point.case, directory), point)
        except Exception:
            return
        if not (out.error or out.errors or out.not_applicable):
            _PREFETCHED[(point.case, point, directory)] = out

    # In batches, dropping the compiled programs between them (their outputs are kept): a process
    # holding hundreds of programs runs out of memory mappings (harness.sides.worker.release_programs).
    batch = 4 * max(1, threads)
    with worker.quietly(), cf.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for i in range(0, len(specs), batch):
            list(pool.map(one, specs[i:i + batch]))
            worker.release_programs()
    return len(_PREFETCHED)


def _outputs_timed(spec: str, case: str, point: Point, directory: str | None) -> Outputs:
    if spec == "jax" and (case, point, directory) in _PREFETCHED:
        return _PREFETCHED.pop((case, point, directory))
    if spec in BUILTIN_SPECS:  # the harness's own sides: a bug there is a traceback
        try:
            if spec == "torch_ref" and reference_cache.enabled():
                return _cached_reference(case, point, directory)
            if spec == "jax" and reference_cache.enabled():
                return _cached_jax(case, point, directory)
            return implementation(spec).run(_fixture(case, directory), point)
        except WorkerCrash as exc:  # a call of it killed or hung a worker (harness.sides.worker)
            return Outputs(spec, error=str(exc))
    # A plug-in that raises (or returns something malformed) at a point does not stop the run:
    # the point's result says so, in one line, and every other point runs. Outside a worker
    # process it runs in one (harness.sides.worker): a crash or a hang is an error too.
    try:
        if not worker.inside():
            return worker.isolated("harness.sides.implementations:_outputs_here", spec, case, point, directory,
                                   label=point.label)
        return _outputs_here(spec, case, point, directory)
    except Exception as exc:  # anything the plug-in raises, or WorkerCrash
        worker.note_failure(exc)
        line = (str(exc) if isinstance(exc, WorkerCrash)
                else f"plug-in {spec} raised at {point.label}: {_first_line(exc)}")
        return Outputs(spec, error=line)


def _cached_reference(case: str, point: Point, directory: str | None) -> Outputs:
    """torch_ref's outputs at `point` read from the reference cache (harness.sides.reference_cache:
    keyed by the fixture's bytes, the sources and versions they follow from), or computed and
    stored there."""
    problem, ref = _fixture(case, directory), implementation("torch_ref")
    key = reference_cache.key(reference_cache.key_parts(problem.path, point.dtype, point.teacher, ref.variants))
    stored = reference_cache.load(key)
    if isinstance(stored, dict):
        timing.count("references_loaded")
        return Outputs(stored["source"], stored["values"], stored["missing"])
    out = ref.run(problem, point)
    timing.count("references_computed")
    if not out.error and not out.errors and not out.not_applicable:
        reference_cache.store(key, {"source": out.source, "values": dict(out.values), "missing": dict(out.missing)})
    return out


def reference_at_codes(case: str, point: Point, codes: Mapping[str, np.ndarray]) -> Outputs:
    """The live reference on `case` at `point`'s dtype and teacher, scoring `codes` (a
    candidate's own codes and scales) in place of its own: what the candidate's end-to-end
    outputs on its own codes are judged against (SPEC section 10). The forward and the dense
    loss; cached per process by the codes' bytes."""
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(codes[q]).tobytes() for q in CODE_QUANTITIES)).hexdigest()
    return _reference_at_codes(case, point.dtype, point.teacher, digest, fixtures_dir(),
                               tuple((q, np.asarray(codes[q])) for q in CODE_QUANTITIES))


_AT_CODES: dict = {}  # (case, dtype, teacher, codes digest, fixtures directory) -> Outputs


def _reference_at_codes(case, dtype, teacher, digest, directory, codes) -> Outputs:
    key = (case, dtype, teacher, digest, directory)
    if key not in _AT_CODES:
        with timing.section("reference"):
            _AT_CODES[key] = _reference_at_codes_stored(case, dtype, teacher, digest, directory, codes)
    return _AT_CODES[key]


def _reference_at_codes_stored(case, dtype, teacher, digest, directory, codes) -> Outputs:
    """The reference on `codes`, from the reference cache where it is on (keyed as the reference's
    own outputs, and by the codes), else computed (and stored there)."""
    ref, problem = TorchReference(variants=("dense",)), _fixture(case, directory)
    key = None
    if reference_cache.enabled():
        parts = reference_cache.key_parts(problem.path, dtype, teacher, ref.variants)
        key = reference_cache.key({**parts, "codes_sha256": digest})
        stored = reference_cache.load(key)
        if isinstance(stored, dict):
            timing.count("references_loaded")
            return Outputs(stored["source"], stored["values"], stored["missing"])
    try:
        out = ref.run(problem, Point(case, dtype, teacher=teacher), codes=dict(codes))
    except WorkerCrash as exc:
        return Outputs("torch_ref", error=str(exc))
    if key is not None:
        timing.count("references_computed")
        if not out.error and not out.errors:
            reference_cache.store(key, {"source": out.source, "values": dict(out.values), "missing": dict(out.missing)})
    return out


def _cached_jax(case: str, point: Point, directory: str | None) -> Outputs:
    """jax_impl's outputs at `point` read from the cache (harness.sides.reference_cache.jax_key_parts:
    keyed by the fixture's bytes, the point, jax_impl's source and everything its programs follow
    from), or computed and stored there."""
    problem = _fixture(case, directory)
    key = reference_cache.key(reference_cache.jax_key_parts(problem.path, point.spec()))
    stored = reference_cache.load(key)
    if isinstance(stored, dict):
        timing.count("outputs_loaded")
        for temp in stored.get("compiled_temps", []):  # what its programs' memory analysis said when they ran
            timing.note_temp({"temp": temp})
        return Outputs(stored["source"], stored["values"], stored["missing"])
    mark = timing.temps_mark()
    out = implementation("jax").run(problem, point)
    if not out.error and not out.errors and not out.not_applicable:
        reference_cache.store(key, {"source": out.source, "values": dict(out.values), "missing": dict(out.missing),
                                    "compiled_temps": timing.temps_since(mark)})
    return out


def _outputs_here(spec: str, case: str, point: Point, directory: str | None) -> Outputs:
    return implementation(spec).run(_fixture(case, directory), point)


def reference_name(reference: str) -> str:
    """`live` -> torch_ref, `goldens` -> goldens (the --reference choices)."""
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not supported (valid: {', '.join(REFERENCES)})")
    return "torch_ref" if reference == "live" else "goldens"


def clear_caches() -> None:
    for fn in (_fixture, implementation, _outputs, _reference_stage_values, _reference_quantizer_values,
               _forward_stages, _isolated_forward_stages):
        fn.cache_clear()
    _AT_CODES.clear()

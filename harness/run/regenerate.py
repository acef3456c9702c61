"""Regenerating the fixtures, and `--check`ing the committed ones (SPEC section 9).

The work, beside the format (harness.problems.fixtures): a case's inputs and parameters come
from the catalogue (`harness.problems.cases.make_inputs`, numpy only); its goldens are the outputs
of the torch reference, driven through the implementation protocol like every other
side (`harness.sides.implementations.TorchReference`): the float64 oracle first, then each
low dtype given the oracle's top-k for the sparse_at_oracle variant; each order error is the
max over K evaluation orders and over the CPU kernels of ISA_VARIANTS, each in a fresh process.
`--check` regenerates in memory, in this process only, and compares with the committed files:
inputs and parameters bit for bit, goldens within harness.judging.tolerance.FIXTURE_CHECK_RTOL,
top-k picks by the project's one tie rule (harness.judging.compare.topk_sets), order errors as
the baselines of their bounds within harness.judging.tolerance.ORDERR_CHECK_FACTOR.

    csa-parity regenerate [--case NAME] [--check] [--fixtures-dir DIR | --out DIR]
    python scripts/regenerate_fixtures.py ...   # the same, from a clone without an install

Each order error's estimate per variant is kept in ORDER_ERRORS.json beside MANIFEST.json; a CPU
that cannot run a variant (harness.platforms.isa_variant_blockers, from its own flags) keeps that
variant's committed estimate, and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, TextIO

import numpy as np

from .. import CPU_PINS, ISA_VARIABLES, ISA_VARIANTS, TORCH_CPU_CAPABILITY
from ..judging.compare import normalised_error
from ..judging.compare import topk_sets
from ..judging.tolerance import FIXTURE_CHECK_RTOL as CHECK_RTOL, ORDERR_CHECK_FACTOR
from ..outputs import CODE_QUANTITIES, PARAM_NAMES
from ..platforms import cpu_features, isa_variant_blockers
from ..points import Point
from ..problems.cases import CASES, Case, make_inputs
from .collect import dims
from ..problems.fixtures import (FIXTURES_DIR, GOLDEN_DTYPES, LOW_DTYPES, MANIFEST_NAME, ORDERR_QUANTITIES, REPO_ROOT,
                                 TEACHER_FREE, teacher_prefix, VERSION_KEYS, CorruptFile, FixtureError, RawTensor,
                                 atomic_write, case_metadata, display_path, fix_command, manifest_entry, read_manifest,
                                 read_safetensors, sha256_of, tensor_schema, write_manifest, write_safetensors)
from ..sides.implementations import Problem, TorchReference


def _versions() -> dict[str, str]:
    import torch

    try:
        from importlib.metadata import version

        own = version("csa-parity")
    except Exception:  # not installed: read the source tree's pyproject
        own = "unknown"
        try:
            import tomllib

            with open(REPO_ROOT / "pyproject.toml", "rb") as f:
                own = tomllib.load(f)["project"]["version"]
        except Exception:
            pass
    return {"torch_version": torch.__version__, "numpy_version": np.__version__,
            "csa_parity_version": own}


def cpu_capability_note() -> str | None:
    """A line when torch computes with other CPU kernels than the committed fixtures were
    generated with (harness.CPU_PINS: ATen's kernels, oneDNN's instruction set, MKL's branch):
    goldens then differ in rounding."""
    import torch

    used = torch.backends.cpu.get_cpu_capability()
    others = [f"{name}={os.environ.get(name, '(unset)')}" for name, value in CPU_PINS.items()
              if name != "ATEN_CPU_CAPABILITY" and os.environ.get(name, "").upper() != value.upper()]
    if used == TORCH_CPU_CAPABILITY and not others:
        return None
    if used != TORCH_CPU_CAPABILITY:
        return (f"torch computes with CPU capability {used}, the committed fixtures with "
                f"{TORCH_CPU_CAPABILITY}: float32 goldens (order errors above all) round differently; "
                f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')} in this process")
    pins = ", ".join(f"{name}={value}" for name, value in CPU_PINS.items() if name != "ATEN_CPU_CAPABILITY")
    return (f"{', '.join(others)} in this process, the committed fixtures were generated with {pins} "
            f"(harness.CPU_PINS): bfloat16 and BLAS goldens may round differently")


def golden_tensors(problem: Problem, teachers=("joint",)) -> dict[str, np.ndarray]:
    """Every `golden.<dtype>.<name>` of a problem: the torch reference's outputs, the float64
    oracle first (its top-k is the selection of the low dtypes' sparse_at_oracle variant; its codes
    and scales, where the problem quantizes, what every low dtype scores); for
    each teacher after the joint one, its loss and gradients as `golden.<dtype>.<teacher>.<name>`."""
    torch_ref = TorchReference()
    oracle = torch_ref.run(problem, Point(problem.name, "float64"))
    codes = ({q: oracle[q] for q in CODE_QUANTITIES} if problem.config.get("index_quant") is not None else None)
    problem = Problem(problem.name, problem.config, problem.inputs, problem.params, oracle["topk_indices"], codes)
    tensors: dict[str, np.ndarray] = {}
    for teacher in teachers:
        prefix = teacher_prefix(teacher)
        for dt in GOLDEN_DTYPES:
            point = Point(problem.name, dt, teacher=teacher)
            out = oracle if (dt, teacher) == ("float64", "joint") else torch_ref.run(problem, point)
            tensors.update({f"golden.{dt}.{prefix}{name}": value for name, value in out.values.items()
                            if not (prefix and name in TEACHER_FREE)})
    return tensors


# --------------------------------------------------------------------------- order errors
# The reference's own error at dtype t, err(torch@t) vs the float64 oracle, is ONE draw of its
# rounding: a lucky evaluation order can make it far smaller than an equally good
# implementation's, and the SPEC section 10 bound alpha * err(torch@t) then becomes
# unattainable. So the reference is also evaluated in K equivalent orders: the index heads,
# the teacher heads and the batch rows permuted. Each permutation changes only the order of
# sums over heads (scores, the teacher average) and over tokens (parameter gradients), never
# the semantics (heads and rows are sets: tests/test_torch_ref.py
# test_head_permutation_invariance_float64); compressed blocks are NOT permuted (their order
# is causal semantics). Outputs are permuted back, and the error is the max over the K orders
# (order 0 is the stored goldens' own, so orderr >= the stored golden's error). Stored per low
# dtype as the float64 scalar `golden.<dtype>.orderr.<name>` for the names of
# harness.problems.fixtures.ORDERR_QUANTITIES. Errors are harness.judging.compare.normalised_error.
ORDER_COUNT = 4  # K: order 0 (as stored) + 3 permuted orders
ORDER_SEED = 14


def evaluation_orders(batch: int, index_heads: int, teacher_heads: int, k: int = ORDER_COUNT
                      ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """K (batch rows, index heads, teacher heads) permutations: the identity, all reversed,
    each rotated by one, then seeded random ones (duplicates of an earlier order skipped where
    the sizes allow fewer than K distinct ones)."""
    sizes = (batch, index_heads, teacher_heads)
    rng = np.random.default_rng(ORDER_SEED)
    candidates = [tuple(np.arange(n) for n in sizes), tuple(np.arange(n)[::-1] for n in sizes),
                  tuple(np.roll(np.arange(n), 1) for n in sizes)]
    candidates += [tuple(rng.permutation(n) for n in sizes) for _ in range(4 * k)]
    out, seen = [], set()
    for perms in candidates:
        key = tuple(tuple(int(i) for i in p) for p in perms)
        if key not in seen:
            seen.add(key)
            out.append(perms)
        if len(out) == k:
            break
    return out


def order_errors(problem: Problem, goldens: Mapping[str, np.ndarray], teacher: str = "joint") -> dict[str, np.ndarray]:
    """`golden.<dtype>.[<teacher>.]orderr.<name>`: the max over `evaluation_orders` of the torch
    reference's normalised error at dtype against the float64 oracle in `goldens` (see the
    comment above), for the loss and gradients of `teacher` (and, for the joint one, the forward
    quantities). The permuted runs go through the protocol like the goldens (TorchReference),
    computing only the variants the order errors need."""
    cfg = problem.config
    HI, DI, H = cfg["index_n_heads"], cfg["index_head_dim"], cfg["num_query_heads"]
    B = problem.inputs["hidden_states"].shape[0]
    oracle_topk = goldens["golden.float64.topk_indices"]
    quantized = cfg.get("index_quant") is not None
    oracle_codes = {q: goldens[f"golden.float64.{q}"] for q in CODE_QUANTITIES} if quantized else None

    prefix = teacher_prefix(teacher)
    names = [q for q in ORDERR_QUANTITIES if not (prefix and q in TEACHER_FREE)]

    def stored(dt: str, q: str) -> np.ndarray:
        return goldens[f"golden.{dt}.{'' if q in TEACHER_FREE else prefix}{q}"]

    def error(q: str, value) -> float:
        oracle = stored("float64", q.replace("sparse_at_oracle", "sparse", 1))
        err, _, _ = normalised_error(np.asarray(value, np.float64), oracle,
                                     "row" if q == "index_scores" else "tensor")
        return err

    # Order 0 is the stored goldens themselves (not a rerun: a rerun of the same order on
    # copied, differently aligned buffers can round differently in the CPU kernels).
    worst = {f"golden.{dt}.{prefix}orderr.{q}": error(q, stored(dt, q)) for dt in LOW_DTYPES for q in names}
    reference = TorchReference(variants=("dense", "sparse_at_oracle"))
    for pb, pi, pt in evaluation_orders(B, HI, H)[1:]:
        pp = dict(problem.params)
        pp["indexer.wq_b"] = pp["indexer.wq_b"].reshape(-1, HI, DI)[:, pi].reshape(-1, HI * DI)
        pp["indexer.weights_proj"] = pp["indexer.weights_proj"][:, pi]
        px = {n: np.ascontiguousarray(v[pb]) for n, v in problem.inputs.items() if n != "attention_sink"}
        px["teacher_query"] = np.ascontiguousarray(px["teacher_query"][:, :, pt])
        px["attention_sink"] = np.ascontiguousarray(problem.inputs["attention_sink"][pt])
        # The oracle's codes follow their rows and query heads (keys: their rows).
        codes = None if oracle_codes is None else {
            q: np.ascontiguousarray(v[pb][:, :, pi] if q.startswith("query") else v[pb]) for q, v in oracle_codes.items()}
        permuted = Problem(problem.name, cfg, px, pp, oracle_topk[pb], codes)
        back_b = np.argsort(pb)  # output row b' of the permuted run is input row pb[b']
        for dt in LOW_DTYPES:
            out = reference.run(permuted, Point(problem.name, dt, teacher=teacher))
            got = {"compressed_keys": out["compressed_keys"][back_b], "index_scores": out["index_scores"][back_b]}
            for variant in ("dense", "sparse_at_oracle"):
                got[f"loss.{variant}"] = out[f"loss.{variant}"]
                for p in PARAM_NAMES:
                    g = out[f"grad.{variant}.{p}"]
                    if p == "indexer.wq_b":
                        g = g.reshape(-1, HI, DI)[:, np.argsort(pi)].reshape(-1, HI * DI)
                    elif p == "indexer.weights_proj":
                        g = g[:, np.argsort(pi)]
                    got[f"grad.{variant}.{p}"] = g
            for q in names:
                name = f"golden.{dt}.{prefix}orderr.{q}"
                worst[name] = max(worst[name], error(q, got[q]))
    return {name: np.asarray(err, np.float64) for name, err in sorted(worst.items())}


# --------------------------------------------------------------------------- instruction-set variants
# An order error is a property of the CPU kernels that computed it as much as of the problem: the
# stored estimate is the max over the kernels a user's CPU may select (harness.ISA_VARIANTS, each
# computed in a fresh process whose environment holds the variant's settings and no other ISA
# variable), over those this CPU can run (harness.platforms.isa_variant_blockers, from the CPU's
# own flags); a variant it cannot run keeps the estimate committed for it (ORDER_ERRORS_NAME).
# Each variant is a full computation of the order errors in its own process: about as long as a
# regeneration's own (9 s of CPU for the 21 cases here), two at a time.


def variant_environment(settings: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process that computes with the kernels of `settings` (an
    ISA_VARIANTS value): this process's, without any harness.ISA_VARIABLES, plus `settings`."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_VARIABLES}
    env.update(settings)
    return env


@dataclasses.dataclass(frozen=True)
class VariantRun:
    """One variant's subprocess: its wall time, the CPU capability its torch computed with and
    what it printed."""

    seconds: float
    capability: str
    output: str


_VARIANT_CODE = (
    "import json, sys, torch, harness\n"
    "from harness.run import regenerate as r\n"
    "print('capability', torch.backends.cpu.get_cpu_capability(), flush=True)\n"
    "mode, target, *cases = sys.argv[1:]\n"
    "if mode == 'files':\n"
    "    sys.exit(r.regenerate(cases or None, fixtures_dir=target, isa_variants={}, carry=False))\n"
    "with open(target, 'w') as f:\n"
    "    json.dump(r.own_order_errors(cases), f)\n")


def _run_variants(variants: Mapping[str, Mapping[str, str]], mode: str, targets: Mapping[str, Path],
                  cases: Iterable[str], jobs: int) -> dict[str, VariantRun]:
    cases = list(cases)
    pending = list(variants)
    running: list[tuple[str, float, subprocess.Popen]] = []
    done: dict[str, VariantRun] = {}
    while pending or running:
        while pending and len(running) < max(1, jobs):
            name = pending.pop(0)
            proc = subprocess.Popen([sys.executable, "-c", _VARIANT_CODE, mode, str(targets[name]), *cases],
                                    cwd=REPO_ROOT, env=variant_environment(variants[name]),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((name, time.perf_counter(), proc))
        name, t0, proc = running.pop(0)
        output, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the ISA variant {name!r} ({dict(variants[name]) or 'nothing set'}) failed with exit "
                               f"code {proc.returncode}:\n{output}")
        capability = next((line.split()[1] for line in output.splitlines() if line.startswith("capability ")), "?")
        done[name] = VariantRun(time.perf_counter() - t0, capability, output)
    return done


def regenerate_in_subprocesses(variants: Mapping[str, Mapping[str, str]], cases: Iterable[str], out_dir: Path,
                               jobs: int = 2) -> dict[str, VariantRun]:
    """Regenerate `cases` once per variant into `out_dir/<variant name>/`, each in a fresh process
    (`variant_environment`; its own order errors only, no variants of its own), `jobs` at a time."""
    return _run_variants(variants, "files", {n: Path(out_dir) / n for n in variants}, cases, jobs)


def own_order_errors(cases: Iterable[str]) -> dict[str, dict[str, float]]:
    """{case: {order-error tensor name: value}}: the order errors this process's kernels draw
    (goldens and order errors computed here, nothing written)."""
    out = {}
    for name in cases:
        case = CASES[name]
        inputs, params = make_inputs(case)
        problem = Problem(case.name, case.config_dict(), inputs, params)
        goldens = golden_tensors(problem, case.teachers)
        errors: dict[str, float] = {}
        for teacher in case.teachers:
            errors.update({k: float(v) for k, v in order_errors(problem, goldens, teacher).items()})
        out[name] = errors
    return out


def own_variant(variants: Mapping[str, Mapping[str, str]]) -> str | None:
    """The name of the variant of `variants` whose kernels are this process's own (its
    harness.ISA_VARIABLES, the pins included), or None."""
    here = {k: os.environ[k] for k in ISA_VARIABLES if k in os.environ}
    return next((n for n, v in variants.items() if {**CPU_PINS, **v} == here), None)


def variant_order_errors(cases: Iterable[str], variants: Mapping[str, Mapping[str, str]] | None = None,
                         jobs: int = 2) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, VariantRun]]:
    """({variant: {case: {order-error name: value}}}, the runs): each variant's order errors of
    `cases`, computed in a fresh process (`variant_environment`), `jobs` at a time; a variant
    whose kernels are this process's own is left out (the caller draws it here). The caller
    leaves out the variants this CPU cannot run (harness.platforms.isa_variant_blockers)."""
    import tempfile

    variants = ISA_VARIANTS if variants is None else variants
    own = own_variant(variants)
    variants = {n: v for n, v in variants.items() if n != own}  # this process draws its own
    cases = list(cases)
    if not variants:
        return {}, {}
    with tempfile.TemporaryDirectory(prefix="csa-parity-isa-") as tmp:
        targets = {n: Path(tmp) / f"{i}.json" for i, n in enumerate(variants)}
        runs = _run_variants(variants, "orderr", targets, cases, jobs)
        each = {name: json.loads(targets[name].read_text()) for name in variants}
    return each, runs


def join_order_errors(per_variant: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """{order-error name: the LARGEST estimate over the variants of `per_variant`} ({variant:
    {name: value}}): the stored estimate is the baseline of a bound that must hold on every CPU
    the variants stand for, so it is the max over them, never a smaller one."""
    joined: dict[str, float] = {}
    for values in per_variant.values():
        for name, value in values.items():
            joined[name] = max(joined.get(name, value), value)
    return joined


# --------------------------------------------------------------------------- each variant's estimates
# ORDER_ERRORS_NAME, beside MANIFEST.json: every case's order errors per variant, as the regeneration
# that wrote the case measured them, or carried (below). A case's stored order errors are
# `join_order_errors` of its entry; `--check` holds them to it. A regeneration measures the variants
# this CPU runs and CARRIES the entry of every other variant (one it cannot run, or that the call
# leaves out) from the fixtures directory's file, else from the repository's committed one where
# that holds the same case: so a CPU without AVX512 never lowers the estimates the AVX512 variants
# put there, and says so. A variant neither measured nor carried is missing from the entry, and
# `--check` reports the case as not covering it.
ORDER_ERRORS_NAME = "ORDER_ERRORS.json"
ORDER_ERRORS_FORMAT = 1
# One entry beside the variants' own: the fixtures' order errors as they stood before each variant's
# were kept, the seven variants joined on the CPU that generated them (an Intel with AVX512 and AMX,
# whose oneDNN and MKL paths no other CPU here reaches). No CPU measures it, so every regeneration
# carries it, and no estimate falls below it; delete it from the file only with a CPU that reaches
# those paths at hand.
AS_GENERATED = "as-generated"
AS_GENERATED_ON = ("the seven ISA variants joined on the Intel CPU with AVX512 and AMX the fixtures were "
                   "first generated on (each variant's own estimates were not kept then)")


def read_order_errors(fixtures_dir: Path) -> dict[str, Any] | None:
    """The ORDER_ERRORS_NAME file of `fixtures_dir` as {"format", "variants", "cases": {case:
    {variant: {"measured_on", "values": {name: value}}}}}, or None where there is none; a
    corrupt one raises FixtureError naming it. (On disk each case is a table: its variants,
    where each was measured, and per order error one value per variant.)"""
    path = Path(fixtures_dir) / ORDER_ERRORS_NAME
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != ORDER_ERRORS_FORMAT or not isinstance(data.get("cases"), dict):
            raise ValueError(f"format {data.get('format')!r}, expected {ORDER_ERRORS_FORMAT} with a 'cases' map")
        cases = {}
        for case, table in data["cases"].items():
            names, where = table["variants"], table["measured_on"]
            cases[case] = {v: {"measured_on": where[i], "values": {
                t: row[i] for t, row in table["values"].items() if row[i] is not None}} for i, v in enumerate(names)}
        data["cases"] = cases
    except (ValueError, AttributeError, KeyError, IndexError, TypeError) as e:
        raise FixtureError(f"{display_path(path)} is corrupt ({e}): restore it with `git checkout -- "
                           f"{display_path(path)}` or run {fix_command(None, Path(fixtures_dir))}") from None
    return data


def write_order_errors(fixtures_dir: Path, cases: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes ORDER_ERRORS_NAME: the cases in catalogue order, each a table of its variants (those
    of ISA_VARIANTS first), where each was measured, and one line per order error with a value per
    variant (null where a variant has none)."""
    lines = []
    for case in [c for c in CASES if c in cases]:
        entry = cases[case]
        names = [*[n for n in ISA_VARIANTS if n in entry], *sorted(set(entry) - set(ISA_VARIANTS))]
        tensors = sorted({t for v in names for t in entry[v]["values"]})
        rows = [f"        {json.dumps(t)}: {json.dumps([entry[v]['values'].get(t) for v in names])}" for t in tensors]
        lines.append(f"    {json.dumps(case)}: {{\n      \"variants\": {json.dumps(names)},\n      \"measured_on\": "
                     f"{json.dumps([entry[v]['measured_on'] for v in names])},\n      \"values\": {{\n"
                     + ",\n".join(rows) + "\n      }\n    }")
    body = (f'{{\n  "format": {ORDER_ERRORS_FORMAT},\n  "variants": {json.dumps(ISA_VARIANTS, sort_keys=True)},\n'
            '  "cases": {\n' + ",\n".join(lines) + "\n  }\n}\n")
    atomic_write(Path(fixtures_dir) / ORDER_ERRORS_NAME, body.encode())


def carried_order_errors(name: str, fixtures_dir: Path, measured: Iterable[str]
                         ) -> tuple[dict[str, dict[str, Any]], str | None]:
    """({variant: entry}, where from): the committed entries of case `name` for every variant
    not in `measured`, from `fixtures_dir`'s ORDER_ERRORS_NAME, else the repository's (where its
    manifest holds the same case: batch, sequence, seed and config)."""
    measured = set(measured)
    for where in dict.fromkeys([Path(fixtures_dir), FIXTURES_DIR]):
        try:
            record = read_order_errors(where)
        except FixtureError:  # a corrupt file carries nothing (--check names it)
            continue
        entry = (record or {}).get("cases", {}).get(name)
        if not entry:
            continue
        if where != Path(fixtures_dir):
            try:
                have = read_manifest(where)["cases"].get(name) or {}
            except FixtureError:
                continue
            want = manifest_entry(CASES[name], b"")
            if any(have.get(k) != want[k] for k in ("batch", "seq_len", "seed", "config")):
                continue
        return {v: e for v, e in entry.items() if v not in measured}, display_path(where / ORDER_ERRORS_NAME)
    return {}, None


def measured_on(capability: str) -> str:
    """What an entry of ORDER_ERRORS_NAME says it was measured on: the CPU's model and the
    torch CPU capability the variant's process computed with."""
    cpu = cpu_features()
    return f"{cpu.get('model') or cpu.get('machine') or 'unknown CPU'}; torch CPU capability {capability}"


def build_case_tensors(case: Case, other_order_errors: Mapping[str, float] | None = None,
                       own_order_errors_out: dict[str, float] | None = None
                       ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a case's file: inputs and params from `make_inputs`, goldens
    from the torch reference, each order error `join_order_errors` of this process's and
    `other_order_errors`' (the other ISA variants' joined); this process's own go into
    `own_order_errors_out` where given."""
    inputs, params = make_inputs(case)
    tensors: dict[str, np.ndarray] = {**inputs, **params}
    problem = Problem(case.name, case.config_dict(), inputs, params)
    tensors.update(golden_tensors(problem, case.teachers))
    for teacher in case.teachers:
        tensors.update(order_errors(problem, tensors, teacher))
    own = {n: float(v) for n, v in tensors.items() if ".orderr." in n}
    if own_order_errors_out is not None:
        own_order_errors_out.update(own)
    for name in other_order_errors or {}:
        if name not in tensors:
            raise RuntimeError(f"case {case.name!r}: an ISA variant computed {name}, which this process did not")
    for name, value in join_order_errors({"own": own, "others": other_order_errors or {}}).items():
        tensors[name] = np.asarray(value, np.float64)
    metadata = {**case_metadata(case), **_versions()}
    # The schema is the contract: fail here, at generation, if the reference drifts from it.
    schema = tensor_schema(case)
    if set(tensors) != set(schema):
        raise RuntimeError(f"case {case.name!r}: built tensors differ from the schema: "
                           f"{sorted(set(tensors) ^ set(schema))}")
    for name, (shape, dt, _) in schema.items():
        a = tensors[name]
        if a.shape != shape or a.dtype.name != dt:
            raise RuntimeError(f"case {case.name!r}: {name} came out {list(a.shape)} {a.dtype}, "
                               f"the schema says {list(shape)} {dt} (did torch_ref change?)")
    return tensors, metadata


def case_bytes(case: Case, other_order_errors: Mapping[str, float] | None = None,
               own_order_errors_out: dict[str, float] | None = None) -> bytes:
    """The exact bytes of a case's fixture file."""
    tensors, metadata = build_case_tensors(case, other_order_errors, own_order_errors_out)
    return write_safetensors(tensors, metadata)


def write_case(case: Case, path: str | os.PathLike, other_order_errors: Mapping[str, float] | None = None,
               own_order_errors_out: dict[str, float] | None = None) -> bytes:
    """Build a case and write its file (atomically); returns the bytes written."""
    data = case_bytes(case, other_order_errors, own_order_errors_out)
    atomic_write(Path(path), data)
    return data


# --------------------------------------------------------------------------- regenerate / check


def regenerate(cases: Iterable[str] | None = None, *, check: bool = False,
               fixtures_dir: str | os.PathLike | None = None, out: TextIO | None = None,
               isa_variants: Mapping[str, Mapping[str, str]] | None = None, jobs: int = 2,
               carry: bool = True, regenerated: str | os.PathLike | None = None) -> int:
    """Write (or, with `check`, regenerate in memory and compare) the named cases, all by
    default. Written order errors are the max (`join_order_errors`) over this process and the
    variants of `isa_variants` this CPU runs (default ISA_VARIANTS, `jobs` subprocesses at a
    time; {}: this process only) and, with `carry`, the committed estimates of every variant not
    measured (`carried_order_errors`); each variant's go into ORDER_ERRORS_NAME. `check`
    regenerates in this process only, holds each order error within ORDERR_CHECK_FACTOR of the
    committed one and the committed ones to the join of their variants' (`check_order_errors`),
    and names the variants this CPU cannot run; with `regenerated`, a directory this process
    regenerated the cases into (`isa_variants={}, carry=False`: the bytes `check` would
    regenerate), it compares with those files instead of regenerating again. Prints what it does
    and every difference; returns the exit code (0 ok, 1 a difference, 2 a bad argument)."""
    out = out if out is not None else sys.stdout
    fixtures_dir = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    names = list(cases) if cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {', '.join(map(repr, unknown))} (valid: {', '.join(CASES)})",
              file=out)
        return 2
    t_all = time.perf_counter()
    note = cpu_capability_note()
    if note:
        print(f"note: {note}", file=out)
    if check:
        problems = 0
        manifest: dict[str, Any] | None
        try:
            manifest = read_manifest(fixtures_dir)
        except FixtureError as e:
            print(f"DIFF {e}", file=out)
            manifest, problems = None, 1
        try:
            record = read_order_errors(fixtures_dir)
        except FixtureError as e:
            print(f"DIFF {e}", file=out)
            record, problems = {}, problems + 1
        if record is None:
            print(f"DIFF {display_path(fixtures_dir / ORDER_ERRORS_NAME)} is missing: the order errors' "
                  f"variants are unknown: run {fix_command(None, fixtures_dir)}", file=out)
            record, problems = {}, problems + 1
        for variant, why in isa_variant_blockers().items():
            print(f"note: ISA variant {variant} not run on this CPU: {why}; --check holds this CPU's own "
                  f"kernels to the committed estimates, which cover {variant} as measured where it runs", file=out)
        for name in names:
            t0 = time.perf_counter()
            fresh = (Path(regenerated) / f"{name}.safetensors").read_bytes() if regenerated is not None else None
            diffs, notes = check_case(CASES[name], fixtures_dir, manifest, fresh)
            if record:
                diffs += check_order_errors(CASES[name], fixtures_dir, record)
            for n in notes:
                print(f"note {name}: {n}", file=out)
            for d in diffs:
                print(f"DIFF {d}", file=out)
            status = "ok" if not diffs else f"{len(diffs)} difference(s)"
            print(f"check {name}: {status} ({time.perf_counter() - t0:.1f} s)", file=out)
            problems += len(diffs)
        if manifest is not None and cases is None:
            for stale in sorted(set(manifest["cases"]) - set(CASES)):
                print(f"DIFF {display_path(fixtures_dir / MANIFEST_NAME)} lists case {stale!r}, "
                      f"which harness/problems/cases.py no longer has: run {fix_command(None, fixtures_dir)}",
                      file=out)
                problems += 1
        verdict = "passed" if not problems else f"FAILED with {problems} difference(s)"
        print(f"fixtures --check {verdict} in {time.perf_counter() - t_all:.1f} s", file=out)
        return 0 if not problems else 1

    try:
        entries = dict(read_manifest(fixtures_dir)["cases"])
    except FixtureError:
        entries = {}
    entries = {n: e for n, e in entries.items()
               if n in CASES and (fixtures_dir / f"{n}.safetensors").exists()}
    variants = ISA_VARIANTS if isa_variants is None else isa_variants
    blocked = isa_variant_blockers(variants=variants)
    own = own_variant({**ISA_VARIANTS, **variants}) or "this process (" + (", ".join(
        f"{k}={os.environ[k]}" for k in ISA_VARIABLES if k in os.environ) or "no ISA variable set") + ")"
    for variant, why in blocked.items():
        print(f"ISA variant {variant} ({_settings(variants[variant])}): not measured on this CPU: {why}", file=out)
    each, runs = variant_order_errors(names, {n: v for n, v in variants.items() if n not in blocked}, jobs)
    for variant, run in runs.items():
        print(f"order errors under ISA variant {variant} ({_settings(variants[variant])}; torch CPU capability "
              f"{run.capability}): {run.seconds:.1f} s", file=out)
    measured = [own, *runs]
    print(f"ISA variants measured here: {', '.join(measured)}; not measured: "
          f"{', '.join(n for n in ISA_VARIANTS if n not in measured) or 'none'}", file=out)
    try:
        record = (read_order_errors(fixtures_dir) or {}).get("cases", {})
    except FixtureError:
        record = {}
    record = {n: e for n, e in record.items() if n in entries}
    capability = _torch_capability()
    for name in names:
        t0 = time.perf_counter()
        path = fixtures_dir / f"{name}.safetensors"
        entry = {v: {"measured_on": measured_on(runs[v].capability), "values": each[v][name]} for v in runs}
        carried, where = carried_order_errors(name, fixtures_dir, measured) if carry else ({}, None)
        if carried:
            print(f"{name}: kept the committed order errors of {', '.join(carried)} from {where}", file=out)
        entry.update(carried)
        missing = [v for v in ISA_VARIANTS if v not in entry and v != own]
        if missing:
            print(f"{name}: WARNING: no estimate of {', '.join(missing)} (not measured here, none committed): "
                  f"its order errors do not cover them; --check reports it", file=out)
        own_values: dict[str, float] = {}
        data = write_case(CASES[name], path, join_order_errors({v: e["values"] for v, e in entry.items()}),
                          own_values)
        record[name] = {own: {"measured_on": measured_on(capability), "values": own_values}, **entry}
        entries[name] = manifest_entry(CASES[name], data)
        print(f"wrote {display_path(path)}: {len(data):,} bytes, sha256 {sha256_of(data)[:16]}... "
              f"({time.perf_counter() - t0:.1f} s)", file=out)
    write_manifest(fixtures_dir, entries)
    write_order_errors(fixtures_dir, record)
    total = sum(e["bytes"] for e in entries.values())
    print(f"wrote {display_path(fixtures_dir / MANIFEST_NAME)}: {len(entries)} case(s), "
          f"{total:,} bytes of fixtures ({time.perf_counter() - t_all:.1f} s)", file=out)
    return 0


def _settings(settings: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items()) or "nothing set"


def _torch_capability() -> str:
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def check_order_errors(case: Case, fixtures_dir: Path, record: Mapping[str, Any]) -> list[str]:
    """The differences between a committed case's order errors and its ORDER_ERRORS_NAME entry:
    every variant of ISA_VARIANTS has an entry, and each stored order error is
    `join_order_errors` of the entry, exactly."""
    path = Path(fixtures_dir) / f"{case.name}.safetensors"
    shown, fix = display_path(Path(fixtures_dir) / ORDER_ERRORS_NAME), fix_command(case.name, Path(fixtures_dir))
    entry = record.get("cases", {}).get(case.name)
    if not entry:
        return [f"{shown} has no entry for {case.name!r}: run {fix}"]
    diffs = []
    missing = [v for v in ISA_VARIANTS if v not in entry]
    if missing:
        diffs.append(f"{shown}: the order errors of {case.name!r} do not cover the ISA variant(s) {', '.join(missing)} "
                     f"(not measured where they were made, none committed): run {fix} on a CPU that runs them")
    if not path.exists():
        return diffs
    try:
        tensors, _ = read_safetensors(path.read_bytes())
    except CorruptFile:
        return diffs
    joined = join_order_errors({v: e.get("values", {}) for v, e in entry.items()})
    for tname in sorted(t for t in tensors if ".orderr." in t):
        have = float(tensors[tname].array())
        if tname not in joined:
            diffs.append(f"{shown}: {case.name} {tname} has no variant's estimate: run {fix}")
        elif have != joined[tname]:
            top = max(entry, key=lambda v: entry[v].get("values", {}).get(tname, -np.inf))
            diffs.append(f"{display_path(path)}: tensor {tname!r} is {have!r}, but the largest of its ISA variants' "
                         f"estimates is {joined[tname]!r} ({top}): the stored order error must be their max: run {fix}")
    return diffs


def check_case(case: Case, fixtures_dir: Path, manifest: Mapping[str, Any] | None = None,
               fresh: bytes | None = None) -> tuple[list[str], list[str]]:
    """Regenerate `case` in memory (or take `fresh`, its bytes as `case_bytes` gives them) and
    compare with the committed file.

    -> (differences, notes). Inputs, parameters and identifying metadata must match
    exactly; goldens within CHECK_RTOL (normwise, -inf/NaN patterns exact; top-k as
    per-row sets, a swap excused only between scores tied within the bound); generator
    versions that differ are notes, not differences.
    """
    path = Path(fixtures_dir) / f"{case.name}.safetensors"
    shown, fix = display_path(path), fix_command(case.name, Path(fixtures_dir))
    if not path.exists():
        return [f"{shown} is missing: run {fix}"], []
    committed = path.read_bytes()
    diffs: list[str] = []
    notes: list[str] = []
    if manifest is not None:
        entry = manifest["cases"].get(case.name)
        if entry is None:
            diffs.append(f"MANIFEST.json has no entry for {case.name!r}: run {fix}")
        else:
            if entry.get("sha256") != sha256_of(committed) or entry.get("bytes") != len(committed):
                diffs.append(f"{shown}: sha256 {sha256_of(committed)} ({len(committed)} bytes) "
                             f"but MANIFEST.json records {entry.get('sha256')} "
                             f"({entry.get('bytes')} bytes)")
            want = manifest_entry(case, committed)
            for key in ("file", "batch", "seq_len", "seed", "config"):
                if entry.get(key) != want[key]:
                    diffs.append(f"MANIFEST.json entry {case.name!r}: {key} is "
                                 f"{entry.get(key)!r}, the catalogue says {want[key]!r}")
    fresh = case_bytes(case) if fresh is None else fresh
    if fresh == committed:
        return diffs, notes
    try:
        old_t, old_m = read_safetensors(committed)
    except CorruptFile as e:
        return diffs + [f"{shown} is truncated or corrupt ({e}): run {fix}"], notes
    new_t, new_m = read_safetensors(fresh)
    for key in sorted(set(old_m) | set(new_m)):
        a, b = old_m.get(key), new_m.get(key)
        if a != b:
            line = f"{shown}: metadata {key}: committed {a!r}, regenerated {b!r}"
            (notes if key in VERSION_KEYS else diffs).append(line)
    for tname in sorted(set(old_t) - set(new_t)):
        diffs.append(f"{shown}: tensor {tname!r} is committed but no longer generated")
    for tname in sorted(set(new_t) - set(old_t)):
        diffs.append(f"{shown}: tensor {tname!r} is generated but missing from the committed file")
    for tname in sorted(set(old_t) & set(new_t)):
        a, b = old_t[tname], new_t[tname]
        if a.data == b.data and a.tag == b.tag and a.shape == b.shape:
            continue
        if a.tag != b.tag or a.shape != b.shape:
            diffs.append(f"{shown}: tensor {tname!r}: committed {list(a.shape)} {a.tag}, "
                         f"regenerated {list(b.shape)} {b.tag}")
            continue
        msg = compare_tensor(tname, a, b, old_t, new_t, dims(case.name))
        if msg:
            diffs.append(f"{shown}: tensor {tname!r}: {msg}")
    moved = [(t, normwise(old_t[t].array(), new_t[t].array())) for t in sorted(set(old_t) & set(new_t))
             if t.startswith("golden.float64.") and old_t[t].data != new_t[t].data]
    if moved:
        notes.append(f"{len(moved)} float64 golden(s) differ from the committed in their last bits (largest "
                     f"{max(e for _, e in moved):.2g} normwise, first {moved[0][0]}): the kernels differ from those "
                     f"the files were generated with (harness.CPU_PINS); held within FIXTURE_CHECK_RTOL.float64")
    return diffs, notes


def normwise(old: np.ndarray, new: np.ndarray) -> float:
    """max |new - old| / max |old| over the entries finite in both (0 where none is)."""
    old, new = old.astype(np.float64), new.astype(np.float64)
    fin = np.isfinite(old) & np.isfinite(new)
    if not fin.any():
        return 0.0
    scale = float(np.max(np.abs(old[fin]))) or 1.0
    return float(np.max(np.abs(old[fin] - new[fin]))) / scale


def compare_tensor(tname: str, a: RawTensor, b: RawTensor, old_t, new_t,
                   dims: Mapping[str, int] | None = None) -> str | None:
    """A difference message, or None when the regenerated tensor is within its bound. `dims`:
    the case's sizes (harness.run.collect.dims), whose floors an order error is compared above."""
    old, new = a.array(), b.array()
    if not tname.startswith("golden."):
        bad = ~((old == new) | (np.isnan(old) & np.isnan(new))) if old.dtype.kind == "f" \
            else old != new
        return _where(bad, old, new, "inputs and parameters must match exactly")
    _, dt, quantity = tname.split(".", 2)
    rtol = CHECK_RTOL[dt]
    if ".orderr." in tname:
        return compare_order_error(dt, quantity.split("orderr.", 1)[1], float(old), float(new), dims)
    if quantity == "topk_indices":
        return compare_topk(old, new, old_t[f"golden.{dt}.index_scores"].array(), rtol)
    pattern = (np.isnan(old) != np.isnan(new)) | (np.isinf(old) != np.isinf(new)) | \
        (np.isinf(old) & (old != new))
    if pattern.any():
        return _where(pattern, old, new, "the -inf / NaN pattern must match exactly")
    fin = np.isfinite(old)
    scale = float(np.max(np.abs(old[fin]))) if fin.any() else 0.0
    err = np.zeros(old.shape)  # the -inf / NaN places match (above) and count as no error
    err[fin] = np.abs(old[fin].astype(np.float64) - new[fin].astype(np.float64))
    bound = rtol * scale
    if float(err.max(initial=0.0)) <= bound:
        return None
    return _where(err > bound, old, new,
                  f"max |diff| {float(err.max()):.3g} > {rtol:.3g} * max |committed| "
                  f"{scale:.3g} = {bound:.3g}")


def compare_order_error(dtype: str, quantity: str, old: float, new: float,
                        dims: Mapping[str, int] | None = None) -> str | None:
    """A stored order error is an estimate whose only use is the baseline of a bound,
    alpha * max(err(reference@t), floor) (harness.judging.judge): compared as that baseline, the
    larger of the estimate and the floor of `quantity` at `dtype` for a problem of `dims` (no
    floor without dims), within ORDERR_CHECK_FACTOR[dtype] either way."""
    from ..judging.tolerance import floor

    fl = floor(dtype, quantity, dims=dict(dims)) if dims is not None else 0.0
    o, n = max(old, fl), max(new, fl)
    factor = ORDERR_CHECK_FACTOR[dtype]
    if o == n or max(o, n) <= factor * min(o, n):
        return None
    above = f" (the floor {fl:.3g} below both)" if dims is not None else ""
    return (f"order error {new:.3g} regenerated vs {old:.3g} committed{above}: more than {factor:g}x apart, the "
            f"most the ISA variants' estimates spread in {dtype} (harness.judging.tolerance.ORDERR_CHECK_FACTOR)")


def compare_topk(old: np.ndarray, new: np.ndarray, scores: np.ndarray, rtol: float) -> str | None:
    """Per (b, s) the picks as sets, by the project's one tie rule (harness.judging.compare.topk_sets)
    with the score tolerance rtol * max |committed row|."""
    finite = np.where(np.isfinite(scores), np.abs(scores), 0.0)
    tol = rtol * (finite.max(axis=-1) if scores.shape[-1] else np.zeros(scores.shape[:-1]))
    r = topk_sets("topk_indices", new, old, scores, tol)
    if not r.failed:
        return None
    first = r.stats["first"].replace("candidate picks", "regenerated").replace("oracle picks", "committed")
    return (f"{int(r.error)} pick(s) differ beyond a boundary tie ({r.stats['excused']} excused); first at "
            f"(b, s) = {r.where}: {first}")


def _where(bad: np.ndarray, old: np.ndarray, new: np.ndarray, rule: str) -> str:
    n = int(np.count_nonzero(bad))
    if n == 0:
        return f"bytes differ but no element does ({rule})"
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
    return (f"{n} of {bad.size} element(s) differ ({rule}); first at index {first}: "
            f"committed {old[first]!r}, regenerated {new[first]!r}")


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `csa-parity regenerate` (and scripts/regenerate_fixtures.py)."""
    parser.add_argument("--case", action="append", metavar="NAME",
                        help=f"only this case (repeatable; default all: {', '.join(CASES)})")
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory and compare with the files; exit 1 on any "
                             "difference")
    parser.add_argument("--fixtures-dir", "--out", type=Path, default=None, dest="fixtures_dir", metavar="DIR",
                        help="the fixture set to write or --check (default: the repository's fixtures/ in a "
                             "clone, the installed package's own set otherwise); a new directory takes the "
                             "committed estimates of the ISA variants this CPU cannot run")


def run_from_args(args: argparse.Namespace) -> int:
    return regenerate(args.case, check=args.check, fixtures_dir=args.fixtures_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="regenerate_fixtures.py",
        description="Regenerate the committed fixtures from harness/problems/cases.py and torch_ref, "
                    "or --check them.")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))

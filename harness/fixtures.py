"""The fixture files: schema, write, load, validate, regenerate and check (SPEC §9).

One `fixtures/<case>.safetensors` per catalogue entry (`harness.cases`) holds
  - the inputs of SPEC §4 (float32; `position_ids`, `segment_ids` int32),
  - the six float32 parameters of SPEC §3 under their canonical names,
  - goldens `golden.<dtype>.<quantity>` from `torch_ref`, for dtype in
    float64 (the oracle), float32, bfloat16, float16 (see `golden_schema`),
and string metadata: schema_version, case, config (JSON), seed, batch,
seq_len, documents, tied_blocks, and the torch / numpy / csa-parity versions
that wrote it. `fixtures/MANIFEST.json` maps each case to its file's sha256,
size and config.

Every golden is stored in its own dtype: `compressed_keys` in the compute
dtype (F64, F32, BF16, F16), every other float quantity in the wide dtype
(F64 for the float64 oracle, F32 otherwise), `topk_indices` as I64, scalars as
0-d tensors (the safetensors format allows shape []).

The loader needs neither torch nor ml_dtypes: it parses the (simple)
safetensors layout itself and returns numpy arrays; a BF16 golden comes back
as float32 (an exact widening), everything else in its stored dtype. The
writer lays the file out itself as well, because the safetensors library
writes its metadata map in hash order, so two runs would not be byte-identical;
tests/test_fixtures.py reads every file back with the library to prove the
format. Goldens are computed in exactly one place, `build_case_tensors`,
which is also the only function that imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, TextIO

import numpy as np

from .cases import CASES, INPUT_NAMES, PARAM_NAMES, Case, make_inputs

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = REPO_ROOT / "fixtures"
MANIFEST_NAME = "MANIFEST.json"
REGENERATE = "python scripts/regenerate_fixtures.py"

GOLDEN_DTYPES = ("float64", "float32", "bfloat16", "float16")  # the oracle first
LOW_DTYPES = ("float32", "bfloat16", "float16")

# --check: how far a regenerated golden may move from the committed one.
# Inputs and parameters come from numpy's seeded PCG64 and must match bit for
# bit. Goldens come from torch kernels whose reduction order may differ between
# CPUs and library builds (not between runs: generation runs single-threaded
# with deterministic algorithms, and two runs on one machine are byte-identical,
# which tests/test_fixtures.py asserts). The bound is normwise: max |new - old|
# over the finite entries <= rtol * max |old|, with -inf / NaN patterns exact.
#   float64: 1e-12. A different summation order moves a float64 result by a
#     few ulp of its partial sums (about 1e-16 relative, times at most a few
#     hundred terms); 1e-12 is the SPEC §10 float64-vs-float64 bound, so a
#     regeneration that moves further is a change of formula, not of order
#     (jax_impl, a whole other implementation, differs from the float64
#     goldens by at most 3.8e-15 normwise).
#   float32 / bfloat16 / float16: 16 * eps(dtype) = 1.9e-6, 6.3e-2, 7.8e-3.
#     Measured here (AMD EPYC, torch 2.13 CPU): run to run 0 (bit-identical);
#     1 vs 2 threads, deterministic algorithms on vs off: also 0 (at these sizes
#     the CPU kernels do not split reductions). What another CPU or library
#     build could do is reorder sums; the largest reordering at hand is a whole
#     other implementation, jax_impl on the same fixtures, and it differs from
#     these goldens by at most 3.1 eps(dtype) on keys and scores, 3.0 eps on
#     losses, and 8.7 eps (float32), 1.0 eps (bfloat16), 1.3 eps (float16) on
#     gradients (scripts/measure_tolerances.py, FIXTURE_CHECK). 16 eps covers
#     that with room and still flags a real change.
#     A pick that flips at a near-tie shows up in topk_indices and in the
#     own-selection sparse goldens, loudly, and is worth a look.
CHECK_RTOL = {
    "float64": 1e-12,
    "float32": 16 * 2.0 ** -23,
    "bfloat16": 16 * 2.0 ** -8,
    "float16": 16 * 2.0 ** -11,
}

VERSION_KEYS = ("torch_version", "numpy_version", "csa_parity_version")


class FixtureError(ValueError):
    """A fixture file that cannot be used; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One loaded, validated case.

    inputs: SPEC §4 names -> numpy (float32, position/segment ids int32).
    params: canonical names -> float32 numpy, layout [in, out].
    goldens: dtype name -> quantity -> numpy (see `golden_schema`): float in the
      stored dtype except BF16 -> float32 (exact); scalars are 0-d arrays;
      topk_indices int64 with -1 at invalid picks.
    metadata: the file's string metadata, as stored.
    """

    name: str
    case: Case
    config: dict[str, Any]
    inputs: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    goldens: dict[str, dict[str, np.ndarray]]
    metadata: dict[str, str]
    path: Path

    def golden(self, dtype: str, quantity: str) -> np.ndarray:
        return self.goldens[dtype][quantity]


# --------------------------------------------------------------------------- schema


def wide_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def golden_schema(case: Case) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """`golden.<dtype>.<quantity>` -> (shape, stored dtype name, dims in words).

    Per dtype in GOLDEN_DTYPES:
      compressed_keys [B, W, DI] (compute dtype), index_scores [B, S, W] (wide,
      -inf at invalid blocks), topk_indices [B, S, k_eff] (int64, -1 = invalid
      pick), loss.dense and loss.sparse [] (wide), grad.dense.<param> and
      grad.sparse.<param> (wide, the parameter's shape).
    Per dtype in LOW_DTYPES, also the sparse loss and gradients with the float64
    oracle's own top-k as `selection` (docs/API.md): loss.sparse_at_oracle,
    grad.sparse_at_oracle.<param>; and orderr.<quantity> [] float64 for each of
    ORDERR_QUANTITIES: torch@dtype's worst error over K evaluation orders (`order_errors`).
    """
    c = case.config
    B, S, W, k = case.batch, case.seq_len, case.num_blocks, case.k_eff
    DI = c["index_head_dim"]
    pshapes = case.param_shapes()
    out: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for dt in GOLDEN_DTYPES:
        wide = wide_dtype(dt)
        g = f"golden.{dt}."
        out[g + "compressed_keys"] = ((B, W, DI), dt, "[B, W, index_head_dim]")
        out[g + "index_scores"] = ((B, S, W), wide, "[B, S, W]")
        out[g + "topk_indices"] = ((B, S, k), "int64", "[B, S, min(index_topk, W)]")
        if dt in LOW_DTYPES:
            for q in ORDERR_QUANTITIES:
                out[g + f"orderr.{q}"] = ((), "float64", "[] (max error over K evaluation orders)")
        modes = ("dense", "sparse") + (("sparse_at_oracle",) if dt in LOW_DTYPES else ())
        for mode in modes:
            out[g + f"loss.{mode}"] = ((), wide, "[] (a scalar)")
            for p, shape in pshapes.items():
                out[g + f"grad.{mode}.{p}"] = (shape, wide, f"the shape of {p}")
    return out


_INPUT_DIMS = {
    "hidden_states": "[B, S, emb_dim]",
    "q_latent": "[B, S, q_lora_rank]",
    "position_ids": "[B, S]",
    "segment_ids": "[B, S]",
    "teacher_query": "[B, S, num_query_heads, head_dim]",
    "teacher_kv": "[B, W, head_dim]",
}
_PARAM_DIMS = {
    "indexer.wkv": "[emb_dim, 2*index_head_dim]",
    "indexer.wgate": "[emb_dim, 2*index_head_dim]",
    "indexer.ape": "[compress_ratio, 2*index_head_dim]",
    "indexer.kv_norm": "[index_head_dim]",
    "indexer.wq_b": "[q_lora_rank, index_n_heads*index_head_dim]",
    "indexer.weights_proj": "[emb_dim, index_n_heads]",
}


def tensor_schema(case: Case) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """Every tensor a case's file must hold: name -> (shape, dtype name, dims in words)."""
    out = {n: (shape, dt, _INPUT_DIMS[n]) for n, (shape, dt) in case.input_shapes().items()}
    out.update({n: (shape, "float32", _PARAM_DIMS[n]) for n, shape in case.param_shapes().items()})
    out.update(golden_schema(case))
    return out


# --------------------------------------------------------------------------- safetensors I/O

# safetensors dtype tag <-> numpy dtype name. BF16 is decoded to float32 on read.
_TAG_OF = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32"}
_NAME_OF = {v: k for k, v in _TAG_OF.items()}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit


class _Corrupt(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class RawTensor:
    tag: str  # safetensors dtype tag, e.g. "F32", "BF16"
    shape: tuple[int, ...]
    data: bytes

    @property
    def dtype_name(self) -> str:
        return _NAME_OF[self.tag]

    def array(self) -> np.ndarray:
        """A fresh writable numpy array; BF16 widened exactly to float32."""
        if self.tag == "BF16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape).copy()
        dt = np.dtype(self.dtype_name).newbyteorder("<")
        arr = np.frombuffer(self.data, dtype=dt).astype(dt.newbyteorder("="), copy=True)
        return arr.reshape(self.shape)


def write_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The safetensors bytes of `tensors` (numpy arrays, bfloat16 as ml_dtypes.bfloat16, or
    `RawTensor`s as read), laid out
    deterministically: metadata keys sorted, tensors by (itemsize descending, name) like the
    library does, so every tensor is aligned; compact JSON header padded with spaces to 8."""
    items = []
    for name, arr in tensors.items():
        if isinstance(arr, RawTensor):  # passed through as stored (tests damage files this way)
            items.append((name, arr.tag, arr.shape, arr.data))
            continue
        arr = np.asarray(arr)
        tag = _TAG_OF.get(arr.dtype.name)
        if tag is None:
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors tag here")
        data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        items.append((name, tag, arr.shape, data))
    items.sort(key=lambda t: (-_ITEMSIZE[t[1]], t[0]))
    header: dict[str, Any] = {"__metadata__": {k: str(metadata[k]) for k in sorted(metadata)}}
    chunks, offset = [], 0
    for name, tag, shape, data in items:
        header[name] = {"dtype": tag, "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    hjson = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    hjson += b" " * (-len(hjson) % 8)
    return struct.pack("<Q", len(hjson)) + hjson + b"".join(chunks)


def read_safetensors(data: bytes) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse safetensors bytes, checking the layout; raises _Corrupt(reason)."""
    if len(data) < 8:
        raise _Corrupt(f"only {len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > len(data):
        raise _Corrupt(f"the header claims {n} bytes but the file has {len(data)}")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Corrupt(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _Corrupt("__metadata__ is not a map of strings")
    buf = memoryview(data)[8 + n:]
    spans = []
    for name, info in header.items():
        try:
            tag, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _Corrupt(f"tensor {name!r} has a malformed header entry {info!r}") from None
        if tag not in _ITEMSIZE:
            raise _Corrupt(f"tensor {name!r} has dtype {tag!r}, not one this schema uses")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _Corrupt(f"tensor {name!r} has a malformed shape {list(shape)}")
        size = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[tag]
        if not (isinstance(start, int) and isinstance(end, int) and end - start == size):
            raise _Corrupt(f"tensor {name!r}: data_offsets [{start}, {end}] do not hold "
                           f"{list(shape)} {tag} ({size} bytes)")
        spans.append((start, end, name, tag, shape))
    spans.sort()
    expected = 0
    for start, end, name, _, _ in spans:
        if start != expected:
            raise _Corrupt(f"tensor {name!r} starts at byte {start} of the data, "
                           f"expected {expected}")
        expected = end
    if expected != len(buf):
        what = "truncated" if expected > len(buf) else "followed by stray bytes"
        raise _Corrupt(f"the data is {what}: the header describes {expected} bytes, "
                       f"the file holds {len(buf)}")
    tensors = {name: RawTensor(tag, shape, bytes(buf[start:end]))
               for start, end, name, tag, shape in spans}
    return tensors, metadata


# --------------------------------------------------------------------------- building


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


@contextlib.contextmanager
def _deterministic_torch():
    """One thread and deterministic algorithms while goldens are computed; restored after."""
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


def case_metadata(case: Case) -> dict[str, str]:
    """The metadata that identifies a case (everything except the generator versions)."""
    return {
        "schema_version": str(SCHEMA_VERSION),
        "case": case.name,
        "config": case.config_json(),
        "seed": str(case.seed),
        "batch": str(case.batch),
        "seq_len": str(case.seq_len),
        "documents": json.dumps(case.documents),
        "tied_blocks": json.dumps(case.tied_blocks),
    }


def torch_goldens(inputs: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray],
                  config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every `golden.<dtype>.<quantity>` of SPEC section 9, computed by torch_ref on these
    inputs and params (the only place torch results are made: fixtures and the harness's
    live reference both come here). bfloat16 keys are ml_dtypes.bfloat16 arrays (exact)."""
    import ml_dtypes
    import torch
    import torch_ref

    cfg = dict(config)
    dense = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": False})
    sparse = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": True})

    def np_of(t) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.numpy().copy()

    tensors: dict[str, np.ndarray] = {}
    with _deterministic_torch():
        oracle_topk = None
        for dt in GOLDEN_DTYPES:
            g = f"golden.{dt}."
            fwd = torch_ref.indexer_forward(params, inputs, dense, dt)
            tensors[g + "compressed_keys"] = np_of(fwd["compressed_keys"])
            tensors[g + "index_scores"] = np_of(fwd["index_scores"])
            tensors[g + "topk_indices"] = np_of(fwd["topk_indices"]).astype(np.int64)
            if dt == "float64":
                oracle_topk = tensors[g + "topk_indices"]
            runs = [("dense", dense, None), ("sparse", sparse, None)]
            if dt in LOW_DTYPES:
                runs.append(("sparse_at_oracle", sparse, oracle_topk))
            for mode, cfg_t, sel in runs:
                loss, grads, _ = torch_ref.indexer_loss_and_grads(params, inputs, cfg_t, dt,
                                                                  selection=sel)
                tensors[g + f"loss.{mode}"] = np_of(loss).reshape(())
                for p in PARAM_NAMES:
                    tensors[g + f"grad.{mode}.{p}"] = np_of(grads[p])
    return tensors


# --------------------------------------------------------------------------- order errors (issue 14)
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
# dtype as the float64 scalar `golden.<dtype>.orderr.<golden quantity>` for the quantities the
# oracle checks compare with (harness.checks): compressed_keys, index_scores and the dense
# and sparse-at-oracle loss and gradients. Errors are harness.compare.normalised_error.
ORDER_COUNT = 4  # K: order 0 (as stored) + 3 permuted orders
ORDER_SEED = 14
ORDERR_QUANTITIES = ("compressed_keys", "index_scores", "loss.dense", "loss.sparse_at_oracle",
                     *(f"grad.{mode}.{p}" for mode in ("dense", "sparse_at_oracle") for p in PARAM_NAMES))
# --check: a stored order error is an error estimate, not a value: another CPU's kernels may
# move it by O(1) relative. A regeneration is flagged when one moves by more than this factor.
ORDERR_CHECK_FACTOR = 2.0


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


def order_errors(inputs: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray],
                 config: Mapping[str, Any], goldens: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`golden.<dtype>.orderr.<quantity>`: the max over `evaluation_orders` of torch_ref@dtype's
    normalised error against the float64 oracle in `goldens` (see the comment above)."""
    import torch_ref

    from .compare import normalised_error

    cfg = dict(config)
    dense = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": False})
    sparse = torch_ref.CSAConfig.from_dict({**cfg, "sparse_loss": True})
    HI, DI, H = cfg["index_n_heads"], cfg["index_head_dim"], cfg["num_query_heads"]
    B = inputs["hidden_states"].shape[0]
    oracle_topk = goldens["golden.float64.topk_indices"]

    def host(t) -> np.ndarray:
        return t.detach().cpu().double().numpy()

    def error(q: str, value) -> float:
        oracle = goldens[f"golden.float64.{q.replace('sparse_at_oracle', 'sparse', 1)}"]
        err, _, _ = normalised_error(value, oracle, "row" if q == "index_scores" else "tensor")
        return err

    # Order 0 is the stored goldens themselves (not a rerun: a rerun of the same order on
    # copied, differently aligned buffers can round differently in the CPU kernels).
    worst = {f"golden.{dt}.orderr.{q}": error(q, np.asarray(goldens[f"golden.{dt}.{q}"], np.float64))
             for dt in LOW_DTYPES for q in ORDERR_QUANTITIES}
    with _deterministic_torch():
        for pb, pi, pt in evaluation_orders(B, HI, H)[1:]:
            pp = dict(params)
            pp["indexer.wq_b"] = params["indexer.wq_b"].reshape(-1, HI, DI)[:, pi].reshape(-1, HI * DI)
            pp["indexer.weights_proj"] = params["indexer.weights_proj"][:, pi]
            px = {n: np.ascontiguousarray(v[pb]) for n, v in inputs.items()}
            px["teacher_query"] = np.ascontiguousarray(px["teacher_query"][:, :, pt])
            back_b = np.argsort(pb)  # output row b' of the permuted run is input row pb[b']
            for dt in LOW_DTYPES:
                fwd = torch_ref.indexer_forward(pp, px, dense, dt)
                got = {"compressed_keys": host(fwd["compressed_keys"])[back_b],
                       "index_scores": host(fwd["index_scores"])[back_b]}
                for mode, cfg_t, sel in (("dense", dense, None),
                                         ("sparse_at_oracle", sparse, oracle_topk[pb])):
                    loss, grads, _ = torch_ref.indexer_loss_and_grads(pp, px, cfg_t, dt, selection=sel)
                    got[f"loss.{mode}"] = host(loss).reshape(())
                    for p in PARAM_NAMES:
                        g = host(grads[p])
                        if p == "indexer.wq_b":
                            g = g.reshape(-1, HI, DI)[:, np.argsort(pi)].reshape(-1, HI * DI)
                        elif p == "indexer.weights_proj":
                            g = g[:, np.argsort(pi)]
                        got[f"grad.{mode}.{p}"] = g
                for q in ORDERR_QUANTITIES:
                    name = f"golden.{dt}.orderr.{q}"
                    worst[name] = max(worst[name], error(q, got[q]))
    return {name: np.asarray(err, np.float64) for name, err in sorted(worst.items())}


def build_case_tensors(case: Case) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a case's file: inputs and params from `make_inputs`, goldens
    from `torch_goldens`."""
    inputs, params = make_inputs(case)
    tensors: dict[str, np.ndarray] = {**inputs, **params}
    tensors.update(torch_goldens(inputs, params, case.config))
    tensors.update(order_errors(inputs, params, case.config, tensors))
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


def case_bytes(case: Case) -> bytes:
    """The exact bytes of a case's fixture file."""
    tensors, metadata = build_case_tensors(case)
    return write_safetensors(tensors, metadata)


def write_case(case: Case, path: str | os.PathLike) -> bytes:
    """Build a case and write its file (atomically); returns the bytes written."""
    data = case_bytes(case)
    _atomic_write(Path(path), data)
    return data


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- manifest


def _display(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _fix(name: str | None, fixtures_dir: Path) -> str:
    cmd = REGENERATE + (f" --case {name}" if name else "")
    if Path(fixtures_dir).resolve() != FIXTURES_DIR.resolve():
        cmd += f" --fixtures-dir {fixtures_dir}"
    return f"`{cmd}`"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_entry(case: Case, data: bytes) -> dict[str, Any]:
    return {"file": f"{case.name}.safetensors", "sha256": sha256_of(data), "bytes": len(data),
            "batch": case.batch, "seq_len": case.seq_len, "seed": case.seed,
            "config": case.config_dict()}


def read_manifest(fixtures_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """MANIFEST.json as a dict {"schema_version": int, "cases": {name: entry}}."""
    fixtures_dir = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    path = fixtures_dir / MANIFEST_NAME
    if not path.exists():
        raise FixtureError(f"{_display(path)} is missing: run {_fix(None, fixtures_dir)}")
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("cases"), dict):
            raise ValueError("no 'cases' map")
    except (ValueError, AttributeError) as e:
        raise FixtureError(f"{_display(path)} is corrupt ({e}): restore it with "
                           f"`git checkout -- {_display(path)}` or run {_fix(None, fixtures_dir)}"
                           ) from None
    return manifest


def write_manifest(fixtures_dir: Path, entries: Mapping[str, Mapping[str, Any]]) -> None:
    ordered = {n: entries[n] for n in CASES if n in entries}
    body = {"schema_version": SCHEMA_VERSION, "cases": ordered}
    _atomic_write(Path(fixtures_dir) / MANIFEST_NAME, (json.dumps(body, indent=2) + "\n").encode())


# --------------------------------------------------------------------------- loading


def _validate_config(config: dict[str, Any]) -> None:
    """The stored config through the JAX side's validation (no torch at load time)."""
    from jax_impl import CSAConfig

    CSAConfig.from_dict(config)


def load_case(name: str, fixtures_dir: str | os.PathLike | None = None, *,
              verify_sha: bool = True) -> Fixture:
    """Load and validate `<fixtures_dir>/<name>.safetensors` before anything runs.

    Raises FixtureError (naming the file and the fix) for: an unknown case, a missing
    file, a truncated or corrupt file, a schema version mismatch, a case/config/seed that
    disagrees with the catalogue, a config that no longer validates, a missing or
    unexpected tensor, a shape or dtype that disagrees with the case's config, a value no
    valid fixture holds (NaN/Inf in an input or parameter, a non-finite golden, positions
    that decrease inside a document: `_check_values`), and (with `verify_sha`) a file
    whose sha256 or size differs from MANIFEST.json.
    """
    fixtures_dir = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    if name not in CASES:
        raise FixtureError(f"unknown case {name!r} (valid: {', '.join(CASES)}); a new case is "
                           f"a new entry in harness/cases.py, then {_fix(name, fixtures_dir)}")
    case = CASES[name]
    path = fixtures_dir / f"{name}.safetensors"
    shown, fix = _display(path), _fix(name, fixtures_dir)
    if not path.exists():
        raise FixtureError(f"{shown} is missing: run {fix}")
    data = path.read_bytes()
    try:
        raw, metadata = read_safetensors(data)
    except _Corrupt as e:
        raise FixtureError(f"{shown} is truncated or corrupt ({e}): restore it with "
                           f"`git checkout -- {shown}` or regenerate it with {fix}") from None

    version = metadata.get("schema_version")
    if version != str(SCHEMA_VERSION):
        raise FixtureError(f"{shown} has schema version {version!r}, this harness reads "
                           f"schema version {SCHEMA_VERSION}: regenerate it with {fix}")
    if metadata.get("case") != name:
        raise FixtureError(f"{shown} holds case {metadata.get('case')!r}, not {name!r}: "
                           f"restore it with `git checkout -- {shown}` or regenerate it with {fix}")
    try:
        config = json.loads(metadata.get("config", ""))
        if not isinstance(config, dict):
            raise ValueError(f"config is {type(config).__name__}, not an object")
    except ValueError as e:
        raise FixtureError(f"{shown} has an unreadable config ({e}): regenerate it with {fix}"
                           ) from None
    try:
        _validate_config(config)
    except (ValueError, TypeError) as e:
        raise FixtureError(f"{shown}: its config no longer validates: {e}. Fix case {name!r} "
                           f"in harness/cases.py if needed, then regenerate with {fix}") from None
    stored = {"config": config, "batch": metadata.get("batch"), "seq_len": metadata.get("seq_len"),
              "seed": metadata.get("seed")}
    wanted = {"config": case.config_dict(), "batch": str(case.batch),
              "seq_len": str(case.seq_len), "seed": str(case.seed)}
    for key in wanted:
        if stored[key] != wanted[key]:
            detail = _dict_diff(stored[key], wanted[key]) if key == "config" else \
                f"file {stored[key]!r}, catalogue {wanted[key]!r}"
            raise FixtureError(f"{shown} was written for another {key} than case {name!r} in "
                               f"harness/cases.py ({detail}): regenerate it with {fix}")

    schema = tensor_schema(case)
    for tname, (shape, dt, dims) in schema.items():
        if tname not in raw:
            raise FixtureError(f"{shown} has no tensor {tname!r} (schema version "
                               f"{SCHEMA_VERSION} needs it): regenerate it with {fix}")
        t = raw[tname]
        if t.shape != shape or t.dtype_name != dt:
            raise FixtureError(
                f"{shown}: tensor {tname!r} is {list(t.shape)} {t.dtype_name}, but case "
                f"{name!r} ({_dims_of(case)}) implies {dims} = {list(shape)} {dt}: "
                f"regenerate it with {fix}")
    extra = sorted(set(raw) - set(schema))
    if extra:
        raise FixtureError(f"{shown} has unexpected tensor(s) {', '.join(map(repr, extra))} "
                           f"(not in schema version {SCHEMA_VERSION}): regenerate it with {fix}")

    if verify_sha:  # first: a file that changed after generation says so, whatever it holds now
        _verify_manifest(case, data, fixtures_dir, shown, fix)
    _check_values(case, raw, shown, fix)

    goldens: dict[str, dict[str, np.ndarray]] = {dt: {} for dt in GOLDEN_DTYPES}
    for tname in schema:
        if tname.startswith("golden."):
            _, dt, quantity = tname.split(".", 2)
            goldens[dt][quantity] = raw[tname].array()
    return Fixture(
        name=name, case=case, config=config,
        inputs={n: raw[n].array() for n in INPUT_NAMES},
        params={n: raw[n].array() for n in PARAM_NAMES},
        goldens=goldens, metadata=dict(metadata), path=path,
    )


def _check_values(case: Case, raw: Mapping[str, RawTensor], shown: str, fix: str) -> None:
    """What a well-formed file can still hold wrong, found before anything runs (so it is a
    fixture error, never a parity pass or failure): NaN or Inf in an input or a parameter; NaN,
    +inf, or -inf outside `index_scores` (invalid blocks) in a golden; a negative position or
    one that decreases inside a document; a top-k pick outside [-1, W)."""
    restore = f"restore it with `git checkout -- {shown}` or regenerate it with {fix}"

    def fail(tname: str, arr: np.ndarray, bad: np.ndarray, rule: str) -> None:
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = arr[where].item()
        at = f" at index {where}" if where else ""
        raise FixtureError(f"{shown}: tensor {tname!r} holds {value!r}{at} ({rule}): {restore}")

    for tname, t in raw.items():
        if not t.dtype_name.startswith(("float", "bfloat")):
            continue
        arr = t.array()
        if not tname.startswith("golden."):
            bad = ~np.isfinite(arr)
            if bad.any():
                fail(tname, arr, bad, "inputs and parameters must be finite")
            continue
        may_be_masked = tname.endswith(".index_scores")
        bad = np.isnan(arr) | (arr == np.inf) | ((arr == -np.inf) & (not may_be_masked))
        if bad.any():
            fail(tname, arr, bad, "goldens must be finite, but for -inf at the invalid blocks of index_scores")
    pos, seg = raw["position_ids"].array().astype(np.int64), raw["segment_ids"].array()
    if (pos < 0).any():
        fail("position_ids", pos, pos < 0, "positions must be >= 0")
    drops = np.zeros(pos.shape, bool)
    drops[:, 1:] = (pos[:, 1:] < pos[:, :-1]) & (seg[:, 1:] == seg[:, :-1])
    if drops.any():
        fail("position_ids", pos, drops, "positions must not decrease inside a document")
    w = case.num_blocks
    for dt in GOLDEN_DTYPES:
        tname = f"golden.{dt}.topk_indices"
        picks = raw[tname].array()
        bad = (picks < -1) | (picks >= w)
        if bad.any():
            fail(tname, picks, bad, f"picks must satisfy -1 <= pick < W = {w}")


def _verify_manifest(case: Case, data: bytes, fixtures_dir: Path, shown: str, fix: str) -> None:
    manifest = read_manifest(fixtures_dir)
    entry = manifest["cases"].get(case.name)
    mshown = _display(fixtures_dir / MANIFEST_NAME)
    if entry is None:
        raise FixtureError(f"{mshown} has no entry for case {case.name!r}: regenerate with {fix}")
    actual = sha256_of(data)
    if entry.get("sha256") != actual or entry.get("bytes") != len(data):
        raise FixtureError(
            f"{shown} does not match {mshown}: expected sha256 {entry.get('sha256')} "
            f"({entry.get('bytes')} bytes), found sha256 {actual} ({len(data)} bytes). The file "
            f"changed after it was generated: restore it with `git checkout -- {shown}` or "
            f"regenerate it with {fix}")


def _dims_of(case: Case) -> str:
    c = case.config
    return (f"B={case.batch}, S={case.seq_len}, W={case.num_blocks}, emb_dim={c['emb_dim']}, "
            f"q_lora_rank={c['q_lora_rank']}, index_n_heads={c['index_n_heads']}, "
            f"index_head_dim={c['index_head_dim']}, compress_ratio={c['compress_ratio']}, "
            f"index_topk={c['index_topk']}, num_query_heads={c['num_query_heads']}, "
            f"head_dim={c['head_dim']}")


def _dict_diff(a: Any, b: Any) -> str:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"file {a!r}, catalogue {b!r}"
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    return "; ".join(f"{k}: file {a.get(k, '<absent>')!r}, catalogue {b.get(k, '<absent>')!r}"
                     for k in keys)


# --------------------------------------------------------------------------- regenerate / check


def regenerate(cases: Iterable[str] | None = None, *, check: bool = False,
               fixtures_dir: str | os.PathLike | None = None, out: TextIO | None = None) -> int:
    """Write (or, with `check`, regenerate in memory and compare) the named cases, all by
    default. Prints what it does and every difference; returns the exit code (0 ok, 1 a
    difference, 2 a bad argument)."""
    out = out if out is not None else sys.stdout
    fixtures_dir = Path(fixtures_dir) if fixtures_dir is not None else FIXTURES_DIR
    names = list(cases) if cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {', '.join(map(repr, unknown))} (valid: {', '.join(CASES)})",
              file=out)
        return 2
    t_all = time.perf_counter()
    if check:
        problems = 0
        manifest: dict[str, Any] | None
        try:
            manifest = read_manifest(fixtures_dir)
        except FixtureError as e:
            print(f"DIFF {e}", file=out)
            manifest, problems = None, 1
        for name in names:
            t0 = time.perf_counter()
            diffs, notes = check_case(CASES[name], fixtures_dir, manifest)
            for n in notes:
                print(f"note {name}: {n}", file=out)
            for d in diffs:
                print(f"DIFF {d}", file=out)
            status = "ok" if not diffs else f"{len(diffs)} difference(s)"
            print(f"check {name}: {status} ({time.perf_counter() - t0:.1f} s)", file=out)
            problems += len(diffs)
        if manifest is not None and cases is None:
            for stale in sorted(set(manifest["cases"]) - set(CASES)):
                print(f"DIFF {_display(fixtures_dir / MANIFEST_NAME)} lists case {stale!r}, "
                      f"which harness/cases.py no longer has: run {_fix(None, fixtures_dir)}",
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
    for name in names:
        t0 = time.perf_counter()
        path = fixtures_dir / f"{name}.safetensors"
        data = write_case(CASES[name], path)
        entries[name] = manifest_entry(CASES[name], data)
        print(f"wrote {_display(path)}: {len(data):,} bytes, sha256 {sha256_of(data)[:16]}... "
              f"({time.perf_counter() - t0:.1f} s)", file=out)
    write_manifest(fixtures_dir, entries)
    total = sum(e["bytes"] for e in entries.values())
    print(f"wrote {_display(fixtures_dir / MANIFEST_NAME)}: {len(entries)} case(s), "
          f"{total:,} bytes of fixtures ({time.perf_counter() - t_all:.1f} s)", file=out)
    return 0


def check_case(case: Case, fixtures_dir: Path, manifest: Mapping[str, Any] | None = None
               ) -> tuple[list[str], list[str]]:
    """Regenerate `case` in memory and compare with the committed file.

    -> (differences, notes). Inputs, parameters and identifying metadata must match
    exactly; goldens within CHECK_RTOL (normwise, -inf/NaN patterns exact; top-k as
    per-row sets, a swap excused only between scores tied within the bound); generator
    versions that differ are notes, not differences.
    """
    path = Path(fixtures_dir) / f"{case.name}.safetensors"
    shown, fix = _display(path), _fix(case.name, Path(fixtures_dir))
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
    fresh = case_bytes(case)
    if fresh == committed:
        return diffs, notes
    try:
        old_t, old_m = read_safetensors(committed)
    except _Corrupt as e:
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
        msg = compare_tensor(tname, a, b, old_t, new_t)
        if msg:
            diffs.append(f"{shown}: tensor {tname!r}: {msg}")
    return diffs, notes


def compare_tensor(tname: str, a: RawTensor, b: RawTensor, old_t, new_t) -> str | None:
    """A difference message, or None when the regenerated tensor is within its bound."""
    old, new = a.array(), b.array()
    if not tname.startswith("golden."):
        bad = ~((old == new) | (np.isnan(old) & np.isnan(new))) if old.dtype.kind == "f" \
            else old != new
        return _where(bad, old, new, "inputs and parameters must match exactly")
    _, dt, quantity = tname.split(".", 2)
    rtol = CHECK_RTOL[dt]
    if quantity.startswith("orderr."):  # an error estimate: within a factor (ORDERR_CHECK_FACTOR)
        o, n = float(old), float(new)
        if max(o, n) <= ORDERR_CHECK_FACTOR * min(o, n) or o == n:
            return None
        return (f"order error {n:.3g} regenerated vs {o:.3g} committed: more than "
                f"{ORDERR_CHECK_FACTOR:g}x apart")
    if quantity == "topk_indices":
        return _compare_topk(old, new, old_t[f"golden.{dt}.index_scores"].array(), rtol)
    pattern = (np.isnan(old) != np.isnan(new)) | (np.isinf(old) != np.isinf(new)) | \
        (np.isinf(old) & (old != new))
    if pattern.any():
        return _where(pattern, old, new, "the -inf / NaN pattern must match exactly")
    fin = np.isfinite(old)
    scale = float(np.max(np.abs(old[fin]))) if fin.any() else 0.0
    err = np.where(fin, np.abs(old.astype(np.float64) - new.astype(np.float64)), 0.0)
    bound = rtol * scale
    if float(err.max(initial=0.0)) <= bound:
        return None
    return _where(err > bound, old, new,
                  f"max |diff| {float(err.max()):.3g} > {rtol:.3g} * max |committed| "
                  f"{scale:.3g} = {bound:.3g}")


def _compare_topk(old: np.ndarray, new: np.ndarray, scores: np.ndarray, rtol: float) -> str | None:
    """Per (b, s) the picks as sets; a differing pick is excused when its committed score is
    within rtol * max |row| of the committed k-th score (a tie at the boundary)."""
    unexcused, excused, first = 0, 0, None
    for idx in np.ndindex(*old.shape[:-1]):
        a, b = set(old[idx].tolist()), set(new[idx].tolist())
        if a == b:
            continue
        row = scores[idx]
        fin = row[np.isfinite(row)]
        picked = [s for s in old[idx].tolist() if s >= 0]
        kth = float(np.min(row[picked])) if picked else -np.inf
        tol = rtol * (float(np.max(np.abs(fin))) if fin.size else 0.0)
        for j in a ^ b:
            if j >= 0 and np.isfinite(row[j]) and abs(row[j] - kth) <= tol:
                excused += 1
            else:
                unexcused += 1
                first = first or (idx, sorted(a), sorted(b))
    if not unexcused:
        return None
    idx, a, b = first
    return (f"{unexcused} pick(s) differ beyond a boundary tie ({excused} excused); first at "
            f"(b, s) = {idx}: committed {a}, regenerated {b}")


def _where(bad: np.ndarray, old: np.ndarray, new: np.ndarray, rule: str) -> str:
    n = int(np.count_nonzero(bad))
    if n == 0:
        return f"bytes differ but no element does ({rule})"
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
    return (f"{n} of {bad.size} element(s) differ ({rule}); first at index {first}: "
            f"committed {old[first]!r}, regenerated {new[first]!r}")


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `scripts/regenerate_fixtures.py`, for reuse by the csa-parity CLI."""
    parser.add_argument("--case", action="append", metavar="NAME",
                        help=f"only this case (repeatable; default all: {', '.join(CASES)})")
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory and compare with the files; exit 1 on any "
                             "difference")
    parser.add_argument("--fixtures-dir", type=Path, default=None,
                        help="where the fixtures live (default: the repository's fixtures/)")


def run_from_args(args: argparse.Namespace) -> int:
    return regenerate(args.case, check=args.check, fixtures_dir=args.fixtures_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="regenerate_fixtures.py",
        description="Regenerate the committed fixtures from harness/cases.py and torch_ref, "
                    "or --check them.")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))

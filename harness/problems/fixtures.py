"""The fixture file format (SPEC section 9): schema, codec, manifest, load and validation.

One `fixtures/<case>.safetensors` per catalogue entry (`harness.problems.cases`) holds
  - the inputs of SPEC section 4 (float32; `position_ids`, `segment_ids` int32),
  - the six float32 parameters of SPEC section 3 under their canonical names,
  - goldens `golden.<dtype>.<name>` from `torch_ref`, for dtype in float64 (the
    oracle), float32, bfloat16, float16, under the canonical names of
    harness.outputs (see `golden_schema`),
and string metadata: schema_version, case, config (JSON: the problem only; chunk sizes
and other run-time knobs are never part of a fixture), seed, batch, seq_len,
documents, tied_blocks, and the torch / numpy / csa-parity versions that wrote it.
`fixtures/MANIFEST.json` maps each case to its file's sha256, size and config.

Every golden is stored in its own dtype: `compressed_keys` (and, where the problem quantizes,
the rotated values) in the compute dtype (F64, F32, BF16, F16), every other float quantity in
the wide dtype (F64 for the float64 oracle, F32 otherwise), `topk_indices` as I64, the
quantizer's codes as U8 and its scales as F32, scalars as 0-d tensors.

Codec: the `safetensors` library reads and writes the files (what users open them
with). It writes the metadata map in hash order, so `write_safetensors` sorts that map
in the header it produced (same bytes, same length, another order) to keep regenerated
files byte-identical. The library's terse errors are translated into what is wrong
with the file (`CorruptFile`).

Reading bfloat16 with numpy: numpy has no bfloat16, so `safetensors.numpy.load_file`
refuses the BF16 goldens (`golden.bfloat16.compressed_keys`). Open the file with
`safe_open(path, framework="pt")` or `framework="flax"`, or in plain numpy take the raw
bytes (`safetensors.deserialize`) and widen them exactly:
`(np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")`, or view them as
`ml_dtypes.bfloat16`. `load_case` does the former: a BF16 golden comes back as float32.

This module imports neither torch nor any implementation: fixtures are validated by
the harness's own rules (tests/test_layering.py). Regeneration and `--check` are
harness.run.regenerate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .. import package_data
from ..outputs import CODE_QUANTITIES, ROTATED_NAMES
from .cases import CASES, INPUT_NAMES, KNOB_FIELDS, PARAM_NAMES, PROBLEM_FIELDS, TEACHERS, Case

SCHEMA_VERSION = 4
REPO_ROOT = Path(__file__).resolve().parents[2]
# The default set: the repository's fixtures/ in a clone, harness/fixtures in an installed wheel
# (harness.package_data, the one module that locates the harness's data).
FIXTURES_DIR = package_data.packaged_fixtures_dir()
MANIFEST_NAME = package_data.MANIFEST_NAME
REGENERATE = package_data.REGENERATE_COMMAND

GOLDEN_DTYPES = ("float64", "float32", "bfloat16", "float16")  # the oracle first
LOW_DTYPES = ("float32", "bfloat16", "float16")

VERSION_KEYS = ("torch_version", "numpy_version", "csa_parity_version")

# Per low dtype, the reference's own error against the float64 oracle is stored as
# the max over K equivalent evaluation orders, `golden.<dtype>.orderr.<name>` (a float64
# scalar), for the names the oracle checks compare (harness.judging.judge): the forward values and the
# dense and sparse-at-oracle loss and gradients. How they are computed: harness.run.regenerate.
ORDERR_QUANTITIES = ("compressed_keys", "index_scores", "loss.dense", "loss.sparse_at_oracle",
                     *(f"grad.{variant}.{p}" for variant in ("dense", "sparse_at_oracle") for p in PARAM_NAMES))
# The names that depend on the teacher: a case that lists the `compressed` teacher also stores
# them as `golden.<dtype>.compressed.<name>` (and `golden.<dtype>.compressed.orderr.<name>`);
# the forward quantities are the same for both teachers and stored once.
TEACHER_FREE = ("compressed_keys", "index_scores", "topk_indices", *CODE_QUANTITIES, *ROTATED_NAMES.values())


def teacher_prefix(teacher: str) -> str:
    """The golden-name prefix of a teacher's loss and gradients: "" (joint) or "compressed."."""
    if teacher not in TEACHERS:
        raise ValueError(f"teacher={teacher!r} is not supported (valid: {', '.join(TEACHERS)})")
    return "" if teacher == "joint" else f"{teacher}."


class FixtureError(ValueError):
    """A fixture file that cannot be used; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One loaded, validated case: a problem and its goldens.

    config: the problem's config (no run-time knobs).
    inputs: SPEC section 4 names -> numpy (float32, position/segment ids int32).
    params: canonical names -> float32 numpy, layout [in, out].
    goldens: dtype name -> canonical name -> numpy (see `golden_schema`): float in the
      stored dtype except BF16 -> float32 (exact); scalars are 0-d arrays;
      topk_indices int64 with -1 at invalid picks; the order errors as `orderr.<name>`
      (`order_errors` reads them).
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

    def goldens_of(self, dtype: str, teacher: str = "joint") -> dict[str, np.ndarray]:
        """The goldens of one teacher at `dtype`, under their canonical names (the forward
        quantities, which both teachers share, included); {} when the case stores none for
        that teacher. The order errors are kept as `orderr.<name>`."""
        if teacher not in self.case.teachers:
            teacher_prefix(teacher)  # an unknown name is an error, not an empty answer
            return {}
        prefix = teacher_prefix(teacher)
        own = {q: v for q, v in self.goldens[dtype].items() if not q.startswith(tuple(f"{t}." for t in TEACHERS))}
        if not prefix:
            return own
        out = {q: v for q, v in own.items() if q in TEACHER_FREE or q.startswith("orderr.") and q[7:] in TEACHER_FREE}
        out.update({q[len(prefix):]: v for q, v in self.goldens[dtype].items() if q.startswith(prefix)})
        return out

    def order_errors(self, dtype: str, teacher: str = "joint") -> dict[str, float]:
        """{canonical name: the reference's worst error at `dtype` over K evaluation orders}
        (the stored `golden.<dtype>.[<teacher>.]orderr.<name>`; empty for float64)."""
        return {q[len("orderr."):]: float(v) for q, v in self.goldens_of(dtype, teacher).items()
                if q.startswith("orderr.")}

    @property
    def oracle_selection(self) -> np.ndarray:
        """The float64 oracle's top-k: the `selection` of the sparse_at_oracle variant."""
        return self.goldens["float64"]["topk_indices"]

    @property
    def oracle_codes(self) -> dict[str, np.ndarray] | None:
        """The float64 oracle's codes and scales (harness.outputs.CODE_QUANTITIES), which every
        other run of a quantized problem scores (SPEC section 10's common codes); None when the
        problem does not quantize."""
        if self.config.get("index_quant") is None:
            return None
        return {q: self.goldens["float64"][q] for q in CODE_QUANTITIES}


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
    Where the problem quantizes (`index_quant`), per dtype the reference's rotated values
    rotated_queries [B, S, HI, DI] and rotated_keys [B, W, DI] (compute dtype: what its
    quantizer saw), and for float64 the oracle's codes and scales query_codes, key_codes (U8)
    and query_scales, key_scales (F32, [..., DI / block]). Every low dtype's goldens score the
    oracle's codes (its `oracle_codes`), as the sparse_at_oracle variant uses its selection.
    Per dtype in LOW_DTYPES, also the sparse loss and gradients with the float64
    oracle's own top-k as `selection` (docs/plugins.md): loss.sparse_at_oracle,
    grad.sparse_at_oracle.<param>; and orderr.<name> [] float64 for each name of
    ORDERR_QUANTITIES: the reference's worst error at that dtype over K evaluation orders
    (computed by harness.run.regenerate.order_errors).
    All of the above is the joint teacher's. For each other teacher the case lists
    (`Case.teachers`), its loss and gradient goldens and their order errors again, under
    `golden.<dtype>.<teacher>.<name>`.
    """
    c = case.config
    B, S, W, k = case.batch, case.seq_len, case.num_blocks, case.k_eff
    DI, HI, quant = c["index_head_dim"], c["index_n_heads"], c["index_quant"]
    pshapes = case.param_shapes()
    out: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for dt in GOLDEN_DTYPES:
        wide = wide_dtype(dt)
        g = f"golden.{dt}."
        out[g + "compressed_keys"] = ((B, W, DI), dt, "[B, W, index_head_dim]")
        if quant is not None:
            nb = DI // quant["block"]
            out[g + "rotated_queries"] = ((B, S, HI, DI), dt, "[B, S, index_n_heads, index_head_dim]")
            out[g + "rotated_keys"] = ((B, W, DI), dt, "[B, W, index_head_dim]")
            if dt == "float64":
                out[g + "query_codes"] = ((B, S, HI, DI), "uint8", "[B, S, index_n_heads, index_head_dim]")
                out[g + "query_scales"] = ((B, S, HI, nb), "float32", "[B, S, index_n_heads, index_head_dim / block]")
                out[g + "key_codes"] = ((B, W, DI), "uint8", "[B, W, index_head_dim]")
                out[g + "key_scales"] = ((B, W, nb), "float32", "[B, W, index_head_dim / block]")
        out[g + "index_scores"] = ((B, S, W), wide, "[B, S, W]")
        out[g + "topk_indices"] = ((B, S, k), "int64", "[B, S, min(index_topk, W)]")
        if dt in LOW_DTYPES:
            for q in ORDERR_QUANTITIES:
                out[g + f"orderr.{q}"] = ((), "float64", "[] (max error over K evaluation orders)")
        modes = ("dense", "sparse") + (("sparse_at_oracle",) if dt in LOW_DTYPES else ())
        for teacher in case.teachers:
            t = g + teacher_prefix(teacher)
            for mode in modes:
                out[t + f"loss.{mode}"] = ((), wide, "[] (a scalar)")
                for p, shape in pshapes.items():
                    out[t + f"grad.{mode}.{p}"] = (shape, wide, f"the shape of {p}")
            if dt in LOW_DTYPES and teacher != "joint":
                for q in ORDERR_QUANTITIES:
                    if q not in TEACHER_FREE:
                        out[t + f"orderr.{q}"] = ((), "float64", "[] (max error over K evaluation orders)")
    return out


_INPUT_DIMS = {
    "hidden_states": "[B, S, emb_dim]",
    "q_latent": "[B, S, q_lora_rank]",
    "position_ids": "[B, S]",
    "segment_ids": "[B, S]",
    "teacher_query": "[B, S, num_query_heads, head_dim]",
    "teacher_kv": "[B, W, head_dim]",
    "teacher_window_kv": "[B, S, head_dim]",
    "attention_sink": "[num_query_heads]",
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

# safetensors dtype tag <-> numpy dtype name. BF16 is widened to float32 on read.
_TAG_OF = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
           "int64": "I64", "int32": "I32", "uint8": "U8"}
_NAME_OF = {v: k for k, v in _TAG_OF.items()}


class CorruptFile(Exception):
    """Bytes the safetensors library refuses; the message says what is wrong with them."""


@dataclasses.dataclass(frozen=True)
class RawTensor:
    tag: str  # safetensors dtype tag, e.g. "F32", "BF16"
    shape: tuple[int, ...]
    data: bytes

    @property
    def dtype_name(self) -> str:
        return _NAME_OF.get(self.tag, self.tag.lower())

    def array(self) -> np.ndarray:
        """A fresh writable numpy array; BF16 widened exactly to float32."""
        if self.tag == "BF16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape).copy()
        dt = np.dtype(self.dtype_name).newbyteorder("<")
        arr = np.frombuffer(self.data, dtype=dt).astype(dt.newbyteorder("="), copy=True)
        return arr.reshape(self.shape)

    def stored(self) -> np.ndarray:
        """The tensor in its stored dtype (BF16 as ml_dtypes.bfloat16), for writing back."""
        if self.tag == "BF16":
            import ml_dtypes

            return np.frombuffer(self.data, dtype=ml_dtypes.bfloat16).reshape(self.shape)
        return self.array()


def _header(data: bytes) -> tuple[int, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8:8 + n]


def write_safetensors(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The safetensors bytes of `tensors` (numpy arrays, bfloat16 as ml_dtypes.bfloat16, or
    `RawTensor`s as read), written by the library; its metadata map then sorted by key so
    that the same tensors and metadata always give the same bytes."""
    from safetensors.numpy import save

    arrays = {}
    for name, arr in tensors.items():
        arr = arr.stored() if isinstance(arr, RawTensor) else np.asarray(arr)
        if arr.dtype.name not in _TAG_OF:
            raise TypeError(f"tensor {name!r}: dtype {arr.dtype} is not one this schema uses")
        arrays[name] = np.array(arr, order="C", copy=True)  # (ascontiguousarray would make a 0-d array 1-d)
    data = save(arrays, metadata={k: str(v) for k, v in metadata.items()})
    n, raw = _header(data)
    header = json.loads(raw)
    if "__metadata__" not in header:
        return data
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    sorted_raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    padded = sorted_raw + b" " * (n - len(sorted_raw))
    if len(sorted_raw) != len(raw.rstrip(b" ")) or json.loads(padded) != json.loads(raw):
        raise RuntimeError("the safetensors library wrote a header this harness cannot reorder "
                           "byte-for-byte; fixtures would not be reproducible")
    return data[:8] + padded + data[8 + n:]


def _diagnose(data: bytes, library_message: str) -> str:
    """What is wrong with bytes the library refused, in the file's terms."""
    detail = library_message.removeprefix("Error while deserializing: ")
    if len(data) < 8:
        return f"only {len(data)} bytes, shorter than the 8-byte header length"
    n, raw = _header(data)
    if 8 + n > len(data):
        return f"the header claims {n} bytes but the file has {len(data)}"
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        return f"the header is not valid JSON ({e}; the library: {detail})"
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return "__metadata__ is not a map of strings"
    spans = []
    for name, info in header.items():
        try:
            tag, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            return f"tensor {name!r} has a malformed header entry {info!r}"
        if tag not in _NAME_OF:
            return f"tensor {name!r} has dtype {tag!r}, not one this schema uses ({detail})"
        spans.append((end, name, tag, shape, start))
    described = max((s[0] for s in spans), default=0)
    held = len(data) - 8 - n
    if described > held:
        return f"the data is truncated: the header describes {described} bytes, the file holds {held}"
    if described < held:
        return f"the data is followed by stray bytes: the header describes {described} bytes, the file holds {held}"
    itemsize = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "U8": 1}
    for end, name, tag, shape, start in sorted(spans, key=lambda s: s[4]):
        size = math.prod(shape) * itemsize[tag]
        if end - start != size:
            return f"tensor {name!r}: data_offsets [{start}, {end}] do not hold {shape} {tag} ({size} bytes)"
    return f"the safetensors library refuses it: {detail}"


def read_safetensors(data: bytes) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse safetensors bytes with the library; raises CorruptFile(what is wrong)."""
    from safetensors import SafetensorError, deserialize

    try:
        flat = deserialize(bytes(data))
    except SafetensorError as e:
        raise CorruptFile(_diagnose(data, str(e))) from None
    tensors = {name: RawTensor(info["dtype"], tuple(info["shape"]), bytes(info["data"])) for name, info in flat}
    # The library validated the header (JSON, metadata a map of strings); read the metadata.
    _, raw = _header(data)
    metadata = json.loads(raw).get("__metadata__") or {}
    return tensors, dict(metadata)


# --------------------------------------------------------------------------- case files


def case_metadata(case: Case) -> dict[str, str]:
    """The identifying metadata of a case's file (the generator versions are added by
    harness.run.regenerate)."""
    return {
        "schema_version": str(SCHEMA_VERSION),
        "case": case.name,
        "config": case.config_json(),
        "seed": str(case.seed),
        "batch": str(case.batch),
        "seq_len": str(case.seq_len),
        "documents": json.dumps(case.documents),
        "tied_blocks": json.dumps(case.tied_blocks),
        "sink": json.dumps(case.sink),
        "window_scale": json.dumps(case.window_scale),
        "position_offset": str(case.position_offset),
        "teachers": json.dumps(case.teachers),
    }


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- manifest


def display_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def fix_command(name: str | None, fixtures_dir: Path) -> str:
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
        raise FixtureError(f"{display_path(path)} is missing: run {fix_command(None, fixtures_dir)}")
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("cases"), dict):
            raise ValueError("no 'cases' map")
    except (ValueError, AttributeError) as e:
        raise FixtureError(f"{display_path(path)} is corrupt ({e}): restore it with "
                           f"`git checkout -- {display_path(path)}` or run {fix_command(None, fixtures_dir)}"
                           ) from None
    return manifest


def write_manifest(fixtures_dir: Path, entries: Mapping[str, Mapping[str, Any]]) -> None:
    ordered = {n: entries[n] for n in CASES if n in entries}
    body = {"schema_version": SCHEMA_VERSION, "cases": ordered}
    atomic_write(Path(fixtures_dir) / MANIFEST_NAME, (json.dumps(body, indent=2) + "\n").encode())


# --------------------------------------------------------------------------- loading


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_config(config: Mapping[str, Any]) -> None:
    """The stored problem config, by the format's own rules (no implementation is asked:
    the code under test must not be what validates its fixtures). Raises ValueError
    naming the field, its value and the rule."""
    fields = [n for n, _ in PROBLEM_FIELDS]
    for key in config:
        if key in KNOB_FIELDS:
            raise ValueError(f"config field {key!r} is a run-time knob, not part of a fixture "
                             f"(schema version {SCHEMA_VERSION})")
        if key not in fields:
            raise ValueError(f"unknown config field {key!r} (valid: {', '.join(fields)})")
    for key in fields:
        if key not in config:
            raise ValueError(f"missing config field {key!r}")
    for key in ("emb_dim", "q_lora_rank", "index_n_heads", "index_head_dim", "compress_ratio",
                "index_topk", "num_query_heads", "head_dim"):
        v = config[key]
        if not (_is_int(v) and v >= 1):
            raise ValueError(f"{key}={v!r} must be an int >= 1")
    dr = config["rope_head_dim"]
    if not _is_int(dr):
        raise ValueError(f"rope_head_dim={dr!r} must be an int")
    if dr % 2:
        raise ValueError(f"rope_head_dim={dr!r} must be even")
    if not 0 <= dr <= config["index_head_dim"]:
        raise ValueError(f"rope_head_dim={dr!r} must satisfy 0 <= rope_head_dim <= "
                         f"index_head_dim={config['index_head_dim']}")
    for key in ("rope_theta", "norm_eps"):
        v = config[key]
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
            raise ValueError(f"{key}={v!r} must be a finite number > 0")
    v = config["loss_scale"]
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        raise ValueError(f"loss_scale={v!r} must be a finite number")
    v = config["sliding_window"]
    if not (_is_int(v) and v >= 0):
        raise ValueError(f"sliding_window={v!r} must be an int >= 0")
    v = config["rope_scaling"]
    keys = ("type", "factor", "original_max_position", "beta_fast", "beta_slow")
    if v is not None and not (isinstance(v, dict) and tuple(sorted(v)) == tuple(sorted(keys))
                              and v["type"] == "yarn"):
        raise ValueError(f"rope_scaling={v!r} must be null or a dict of {', '.join(keys)} with type 'yarn'")
    v = config["index_quant"]
    keys = ("block", "format", "hadamard")
    if v is not None and not (isinstance(v, dict) and tuple(sorted(v)) == keys and v["format"] in ("e2m1", "e4m3")
                              and _is_int(v["block"]) and v["block"] >= 1
                              and config["index_head_dim"] % v["block"] == 0 and isinstance(v["hadamard"], bool)):
        raise ValueError(f"index_quant={v!r} must be null or a dict of format (e2m1 or e4m3), block (dividing "
                         f"index_head_dim={config['index_head_dim']}) and hadamard (a bool)")


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
                           f"a new entry in harness/problems/cases.py, then {fix_command(name, fixtures_dir)}")
    case = CASES[name]
    path = fixtures_dir / f"{name}.safetensors"
    shown, fix = display_path(path), fix_command(name, fixtures_dir)
    if not path.exists():
        raise FixtureError(f"{shown} is missing: run {fix}")
    data = path.read_bytes()
    try:
        raw, metadata = read_safetensors(data)
    except CorruptFile as e:
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
        validate_config(config)
    except (ValueError, TypeError) as e:
        raise FixtureError(f"{shown}: its config no longer validates: {e}. Fix case {name!r} "
                           f"in harness/problems/cases.py if needed, then regenerate with {fix}") from None
    stored = {"config": config, "batch": metadata.get("batch"), "seq_len": metadata.get("seq_len"),
              "seed": metadata.get("seed")}
    wanted = {"config": case.config_dict(), "batch": str(case.batch),
              "seq_len": str(case.seq_len), "seed": str(case.seed)}
    for key in wanted:
        if stored[key] != wanted[key]:
            detail = _dict_diff(stored[key], wanted[key]) if key == "config" else \
                f"file {stored[key]!r}, catalogue {wanted[key]!r}"
            raise FixtureError(f"{shown} was written for another {key} than case {name!r} in "
                               f"harness/problems/cases.py ({detail}): regenerate it with {fix}")

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
        if tname == "attention_sink":  # -inf is a head without a sink
            bad = np.isnan(arr) | (arr == np.inf)
            if bad.any():
                fail(tname, arr, bad, "a sink logit is finite or -inf")
            continue
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
    mshown = display_path(fixtures_dir / MANIFEST_NAME)
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



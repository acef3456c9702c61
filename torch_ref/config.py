"""Configuration, dtype names and input checks of the torch reference.

The config rules and their messages are the contract of docs/plugins.md: the JAX
side raises the same text for the same mistake. This module knows nothing of
JAX; the math lives in `reference.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import torch

DTYPES = ("float32", "bfloat16", "float16", "float64")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(name: Any) -> tuple[torch.dtype, torch.dtype]:
    """Compute dtype name -> (torch compute dtype, torch wide dtype) (SPEC §2)."""
    if not isinstance(name, str) or name not in _TORCH_DTYPES:
        raise ValueError(f"dtype={name!r} is not supported (valid: {', '.join(DTYPES)})")
    dtype = _TORCH_DTYPES[name]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return dtype, wide


# --------------------------------------------------------------------------- config


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _chunk_message(name: str, value: Any, heads_name: str, heads: int) -> str:
    valid = ", ".join(str(c) for c in [0] + [d for d in range(1, heads + 1) if heads % d == 0])
    return f"{name}={value!r} must divide {heads_name}={heads} (valid: {valid})"


TEACHER_NORMALISERS = ("joint", "compressed")
# The JAX side's choice of scoring code: accepted (so one config dict serves both sides) and
# ignored here; validated with the same message.
SCORING_BACKENDS = ("xla", "pallas")
ROPE_SCALING_KEYS = ("type", "factor", "original_max_position", "beta_fast", "beta_slow")
INDEX_QUANT_KEYS = ("format", "block", "hadamard")
QUANT_FORMATS = ("e2m1", "e4m3")


def _is_finite_number(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v)


def _check_keys(field: str, v: Mapping, keys: tuple[str, ...]) -> None:
    """A dict-valued field holds exactly `keys`: an unknown key first, then a missing one."""
    for k in v:
        if k not in keys:
            raise ValueError(f"{field} has unknown key {k!r} (valid: {', '.join(keys)})")
    for k in keys:
        if k not in v:
            raise ValueError(f"{field} is missing key {k!r}")


def _check_rope_scaling(v: Any) -> None:
    """SPEC §1/§6: null or {"type": "yarn", factor, original_max_position, beta_fast, beta_slow}."""
    if not isinstance(v, Mapping):
        raise ValueError(f"rope_scaling={v!r} must be null or a dict with type 'yarn'")
    _check_keys("rope_scaling", v, ROPE_SCALING_KEYS)
    t, f, L0 = v["type"], v["factor"], v["original_max_position"]
    bf, bs = v["beta_fast"], v["beta_slow"]
    if not (isinstance(t, str) and t == "yarn"):
        raise ValueError(f"rope_scaling type={t!r} is not supported (valid: yarn)")
    if not (_is_finite_number(f) and f >= 1):
        raise ValueError(f"rope_scaling factor={f!r} must be a finite number >= 1")
    if not (_is_int(L0) and L0 >= 1):
        raise ValueError(f"rope_scaling original_max_position={L0!r} must be an int >= 1")
    if not (_is_finite_number(bf) and _is_finite_number(bs) and bf > bs > 0):
        raise ValueError(f"rope_scaling beta_fast={bf!r}, beta_slow={bs!r} "
                         "must satisfy beta_fast > beta_slow > 0")


def _check_index_quant(v: Any, head_dim: int) -> None:
    """SPEC §1/§7a: null or {"format": "e2m1" | "e4m3", "block": divides DI, "hadamard": bool},
    a rotation needing DI a power of two."""
    if not isinstance(v, Mapping):
        raise ValueError(f"index_quant={v!r} must be null or a dict with keys "
                         f"{', '.join(INDEX_QUANT_KEYS)}")
    _check_keys("index_quant", v, INDEX_QUANT_KEYS)
    fmt, block, rotate = v["format"], v["block"], v["hadamard"]
    if not (isinstance(fmt, str) and fmt in QUANT_FORMATS):
        raise ValueError(f"index_quant format={fmt!r} is not supported (valid: {', '.join(QUANT_FORMATS)})")
    if not (_is_int(block) and block >= 1 and head_dim % block == 0):
        valid = ", ".join(str(d) for d in range(1, head_dim + 1) if head_dim % d == 0)
        raise ValueError(f"index_quant block={block!r} must divide index_head_dim={head_dim} (valid: {valid})")
    if not isinstance(rotate, bool):
        raise ValueError(f"index_quant hadamard={rotate!r} must be a bool")
    if rotate and head_dim & (head_dim - 1):
        raise ValueError(f"index_quant hadamard=True needs index_head_dim={head_dim} to be a power of two "
                         "(the Sylvester Hadamard matrix has order 2**n)")


@dataclasses.dataclass(frozen=True)
class CSAConfig:
    """The CSA indexer configuration (SPEC §1), validated on construction."""

    emb_dim: int
    q_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    rope_head_dim: int
    compress_ratio: int
    index_topk: int
    num_query_heads: int
    head_dim: int
    rope_theta: float = 160000.0
    norm_eps: float = 1e-6
    indexer_head_chunk: int = 0
    loss_head_chunk: int = 0
    query_chunk: int = 0
    sparse_loss: bool = False
    loss_scale: float = 1.0
    sliding_window: int = 0
    teacher_normaliser: str = "joint"
    # A plain dict (or None). Left out of the hash (a dict has none); equality still compares it.
    rope_scaling: Any = dataclasses.field(default=None, hash=False)
    index_quant: Any = dataclasses.field(default=None, hash=False)
    scoring_backend: str = "xla"

    def __post_init__(self) -> None:
        # Checked in field order; the first violation raises.
        for f in dataclasses.fields(self):
            name, v = f.name, getattr(self, f.name)
            if name == "rope_head_dim":
                if not _is_int(v):
                    raise ValueError(f"rope_head_dim={v!r} must be an int")
                if v % 2 != 0:
                    raise ValueError(f"rope_head_dim={v!r} must be even")
                if not 0 <= v <= self.index_head_dim:
                    raise ValueError(
                        f"rope_head_dim={v!r} must satisfy 0 <= rope_head_dim <= "
                        f"index_head_dim={self.index_head_dim}"
                    )
            elif name in ("rope_theta", "norm_eps"):
                if not _is_number(v):
                    raise ValueError(f"{name}={v!r} must be a number")
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"{name}={v!r} must be finite and > 0")
            elif name == "indexer_head_chunk":
                if not (_is_int(v) and (v == 0 or (v > 0 and self.index_n_heads % v == 0))):
                    raise ValueError(
                        _chunk_message(name, v, "index_n_heads", self.index_n_heads)
                    )
            elif name == "loss_head_chunk":
                if not (_is_int(v) and (v == 0 or (v > 0 and self.num_query_heads % v == 0))):
                    raise ValueError(
                        _chunk_message(name, v, "num_query_heads", self.num_query_heads)
                    )
            elif name == "query_chunk":
                if not (_is_int(v) and v >= 0):
                    raise ValueError(f"query_chunk={v!r} must be an int >= 0 (0: all rows at once)")
            elif name == "sparse_loss":
                if not isinstance(v, bool):
                    raise ValueError(f"sparse_loss={v!r} must be a bool")
            elif name == "loss_scale":
                if not _is_number(v):
                    raise ValueError(f"loss_scale={v!r} must be a number")
                if not math.isfinite(v):
                    raise ValueError(f"loss_scale={v!r} must be finite")
            elif name == "sliding_window":
                if not (_is_int(v) and v >= 0):
                    raise ValueError(f"sliding_window={v!r} must be an int >= 0 (0: no window)")
            elif name == "teacher_normaliser":
                if not (isinstance(v, str) and v in TEACHER_NORMALISERS):
                    raise ValueError(f"teacher_normaliser={v!r} is not supported "
                                     f"(valid: {', '.join(TEACHER_NORMALISERS)})")
            elif name == "rope_scaling":
                if v is not None:
                    _check_rope_scaling(v)
                    object.__setattr__(self, "rope_scaling", dict(v))  # a plain copy
            elif name == "index_quant":
                if v is not None:
                    _check_index_quant(v, self.index_head_dim)
                    object.__setattr__(self, "index_quant", dict(v))  # a plain copy
            elif name == "scoring_backend":
                if not (isinstance(v, str) and v in SCORING_BACKENDS):
                    raise ValueError(f"scoring_backend={v!r} is not supported "
                                     f"(valid: {', '.join(SCORING_BACKENDS)})")
            else:  # the positive int fields
                if not _is_int(v):
                    raise ValueError(f"{name}={v!r} must be an int")
                if v < 1:
                    raise ValueError(f"{name}={v!r} must be >= 1")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CSAConfig":
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        for key in d:
            if key not in names:
                raise ValueError(f"unknown config field {key!r} (valid: {', '.join(names)})")
        for f in fields:
            no_default = f.default is dataclasses.MISSING
            if no_default and f.name not in d:
                raise ValueError(f"missing config field {f.name!r}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("rope_scaling", "index_quant"):
            if d[name] is not None:
                d[name] = dict(d[name])
        return d


# --------------------------------------------------------------------------- inputs

_FLOAT_INPUTS = ("hidden_states", "q_latent", "teacher_query", "teacher_kv",
                 "teacher_window_kv", "attention_sink")
_INT_INPUTS = ("position_ids", "segment_ids")
INPUT_NAMES = ("hidden_states", "q_latent", "position_ids", "segment_ids",
               "teacher_query", "teacher_kv", "teacher_window_kv", "attention_sink")
TEACHER_INPUTS = ("teacher_query", "teacher_kv", "teacher_window_kv", "attention_sink")
# The joint teacher's inputs (SPEC §4, §8): needed only when the config uses them.
JOINT_INPUTS = ("teacher_window_kv", "attention_sink")


def used_joint_inputs(cfg: "CSAConfig") -> tuple[str, ...]:
    """The joint teacher's inputs the loss of `cfg` reads: attention_sink under the joint
    normaliser, and teacher_window_kv too when it has a sliding window."""
    if cfg.teacher_normaliser != "joint":
        return ()
    if cfg.sliding_window > 0:
        return ("teacher_window_kv", "attention_sink")
    return ("attention_sink",)


PARAM_NAMES = ("indexer.wkv", "indexer.wgate", "indexer.ape", "indexer.kv_norm",
               "indexer.wq_b", "indexer.weights_proj")


def _as_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach()
    a = np.asarray(v)
    if a.dtype.name == "bfloat16":  # an ml_dtypes array: torch cannot read it directly
        a = a.astype(np.float32)
    if not a.flags.writeable:  # e.g. another run's outputs, held read-only: torch wants to own writable memory
        a = a.copy()
    return torch.as_tensor(a)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def _check_shape(label: str, t: torch.Tensor, symbols: list[str], values: list[int]) -> None:
    shape = tuple(int(s) for s in t.shape)
    if shape != tuple(values):
        raise ValueError(f"{label} has shape {shape}; expected [{', '.join(symbols)}] = "
                         f"[{', '.join(str(v) for v in values)}]")


def _check_float(label: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        raise ValueError(f"{label} has dtype {_dtype_name(t)}; expected a floating dtype")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(f"{label} contains NaN/Inf at index {_first_index(bad)}")


def _is_integer_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def validate_params(params: Mapping[str, Any], cfg: CSAConfig) -> None:
    """Each canonical parameter in turn: present, shaped per SPEC §3, floating, finite."""
    E, R, HI, DI, m = (cfg.emb_dim, cfg.q_lora_rank, cfg.index_n_heads,
                       cfg.index_head_dim, cfg.compress_ratio)
    expected = {
        "indexer.wkv": (["emb_dim", "2*index_head_dim"], [E, 2 * DI]),
        "indexer.wgate": (["emb_dim", "2*index_head_dim"], [E, 2 * DI]),
        "indexer.ape": (["compress_ratio", "2*index_head_dim"], [m, 2 * DI]),
        "indexer.kv_norm": (["index_head_dim"], [DI]),
        "indexer.wq_b": (["q_lora_rank", "index_n_heads*index_head_dim"], [R, HI * DI]),
        "indexer.weights_proj": (["emb_dim", "index_n_heads"], [E, HI]),
    }
    for name in PARAM_NAMES:
        if name not in params:
            raise ValueError(f"missing param {name!r}")
        t = _as_tensor(params[name])
        _check_shape(f"params[{name!r}]", t, *expected[name])
        _check_float(f"params[{name!r}]", t)


CODE_NAMES = ("query_codes", "query_scales", "key_codes", "key_scales")


def validate_codes(codes: Any, cfg: CSAConfig, B: int, S: int) -> dict[str, torch.Tensor]:
    """Imposed codes and scales (§7a): exactly the four names, uint8 codes and floating scales
    of the problem's shapes. Returns them as tensors."""
    if cfg.index_quant is None:
        raise ValueError("codes were given, but index_quant is null: only a quantizing indexer scores codes")
    if not isinstance(codes, Mapping):
        raise ValueError(f"codes must be a dict of {', '.join(CODE_NAMES)}, got {type(codes).__name__}")
    if set(codes) != set(CODE_NAMES):
        raise ValueError(f"codes has {', '.join(sorted(codes)) or 'nothing'}; expected exactly "
                         f"{', '.join(CODE_NAMES)}")
    HI, DI, W = cfg.index_n_heads, cfg.index_head_dim, S // cfg.compress_ratio
    nb = DI // cfg.index_quant["block"]
    shapes = {"query_codes": ((B, S, HI, DI), "[B, S, HI, DI]"), "query_scales": ((B, S, HI, nb), "[B, S, HI, DI / block]"),
              "key_codes": ((B, W, DI), "[B, W, DI]"), "key_scales": ((B, W, nb), "[B, W, DI / block]")}
    out = {}
    for name, (shape, dims) in shapes.items():
        t = _as_tensor(codes[name])
        ok = t.dtype == torch.uint8 if name.endswith("_codes") else t.is_floating_point()
        if tuple(t.shape) != shape or not ok:
            kind = "uint8" if name.endswith("_codes") else "floating"
            raise ValueError(f"codes[{name!r}] has shape {tuple(t.shape)} and dtype {_dtype_name(t)}; "
                             f"expected {kind} {dims} = {list(shape)}")
        out[name] = t
    return out


def validate_selection(selection: Any, B: int, S: int, k_eff: int, W: int) -> None:
    """A sparse-loss selection: integer [B, S, k_eff], values in [-1, W)."""
    t = _as_tensor(selection)
    shape = tuple(int(d) for d in t.shape)
    if shape != (B, S, k_eff) or not _is_integer_dtype(t):
        raise ValueError(f"selection has shape {shape} and dtype {_dtype_name(t)}; "
                         f"expected integer [B, S, k_eff] = [{B}, {S}, {k_eff}]")
    bad = (t < -1) | (t >= W)
    if bool(bad.any()):
        idx = _first_index(bad)
        raise ValueError(
            f"selection has value {int(t[idx])} at index {idx}; expected -1 <= value < W = {W}"
        )


def _check_sink(label: str, t: torch.Tensor) -> None:
    """attention_sink: floating; -inf (no sink for that head) allowed, NaN and +inf not."""
    if not t.dtype.is_floating_point:
        raise ValueError(f"{label} has dtype {_dtype_name(t)}; expected a floating dtype")
    bad = torch.isnan(t) | (t == float("inf"))
    if bool(bad.any()):
        raise ValueError(f"{label} contains NaN or +Inf at index {_first_index(bad)} "
                         "(-inf is allowed: no sink)")


def validate_inputs(inputs: Mapping[str, Any], cfg: CSAConfig, *,
                    require_teacher: bool = True) -> None:
    """Check the inputs of SPEC §4; the first problem raises ValueError.

    Phases, each over the inputs in a fixed order: presence (hidden_states,
    q_latent, teacher_query, teacher_kv, teacher_window_kv, attention_sink,
    position_ids, segment_ids); the rank of hidden_states, which gives B and S;
    shapes (SPEC §4 order); float inputs floating and finite (attention_sink
    may hold -inf: no sink); position/segment ids of an integer dtype;
    positions >= 0; positions never decreasing inside a document.

    teacher_query and teacher_kv are required only when `require_teacher` (the
    loss); when present they are always checked. teacher_window_kv and
    attention_sink are required, and checked, only for the loss and only when
    the config uses them (`used_joint_inputs`); otherwise they are ignored.
    """
    E, R, H, D, m = (cfg.emb_dim, cfg.q_lora_rank, cfg.num_query_heads,
                     cfg.head_dim, cfg.compress_ratio)
    used = used_joint_inputs(cfg) if require_teacher else ()
    skipped = tuple(name for name in JOINT_INPUTS if name not in used)
    for name in (*_FLOAT_INPUTS, *_INT_INPUTS):
        if name in skipped:
            continue
        if name not in inputs and (require_teacher or name not in TEACHER_INPUTS):
            raise ValueError(f"missing input {name!r}")
    t = {name: _as_tensor(inputs[name]) for name in INPUT_NAMES
         if name in inputs and name not in skipped}
    hs = t["hidden_states"]
    if hs.ndim != 3:
        raise ValueError(f"inputs['hidden_states'] has shape {tuple(int(d) for d in hs.shape)}; "
                         "expected [B, S, emb_dim] (rank 3)")
    B, S = int(hs.shape[0]), int(hs.shape[1])
    expected = {
        "hidden_states": (["B", "S", "emb_dim"], [B, S, E]),
        "q_latent": (["B", "S", "q_lora_rank"], [B, S, R]),
        "position_ids": (["B", "S"], [B, S]),
        "segment_ids": (["B", "S"], [B, S]),
        "teacher_query": (["B", "S", "num_query_heads", "head_dim"], [B, S, H, D]),
        "teacher_kv": (["B", "W", "head_dim"], [B, S // m, D]),
        "teacher_window_kv": (["B", "S", "head_dim"], [B, S, D]),
        "attention_sink": (["num_query_heads"], [H]),
    }
    for name in INPUT_NAMES:
        if name in t:
            _check_shape(f"inputs[{name!r}]", t[name], *expected[name])
    for name in _FLOAT_INPUTS:
        if name in t:
            check = _check_sink if name == "attention_sink" else _check_float
            check(f"inputs[{name!r}]", t[name])
    for name in _INT_INPUTS:
        if not _is_integer_dtype(t[name]):
            raise ValueError(f"inputs[{name!r}] has dtype {_dtype_name(t[name])}; "
                             "expected an integer dtype")
    pos = t["position_ids"].to(torch.int64)
    seg = t["segment_ids"].to(torch.int64)
    if bool((pos < 0).any()):
        where = _first_index(pos < 0)
        raise ValueError(f"inputs['position_ids'] has a negative position {int(pos[where])} "
                         f"at (b, s)={where}")
    drops = (pos[:, 1:] < pos[:, :-1]) & (seg[:, 1:] == seg[:, :-1])
    if bool(drops.any()):
        b, s = _first_index(drops)
        raise ValueError(
            "inputs['position_ids'] decreases inside a document at "
            f"(b, s)=({b}, {s + 1}): {int(pos[b, s])} -> {int(pos[b, s + 1])}"
        )

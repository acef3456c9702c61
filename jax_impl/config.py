"""Static configuration of the CSA indexer (SPEC section 1).

A frozen, hashable dataclass: it is passed to `jax.jit` as a static argument,
so every shape it implies is static. Every bad field is a `ValueError` naming
the field, the value, the rule and, where there is a finite set, the valid
choices. The torch reference validates on its own with the same messages
(docs/plugins.md); the two share no code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

DTYPES = ("float32", "bfloat16", "float16", "float64")
TEACHER_NORMALISERS = ("joint", "compressed")
# How the scores and the teacher's block probabilities are computed (jax_impl.scoring.raw_scores,
# jax_impl.loss.teacher_head_sum): XLA einsums, or the Pallas kernels of jax_impl.kernels (Mosaic
# on TPU, interpret mode elsewhere). Not part of the math.
SCORING_BACKENDS = ("xla", "pallas")
ROPE_SCALING_KEYS = ("type", "factor", "original_max_position", "beta_fast", "beta_slow")
# index_quant (SPEC section 7a): the keys of its dict and the formats of its codes.
INDEX_QUANT_KEYS = ("format", "block", "hadamard")
QUANT_FORMATS = ("e2m1", "e4m3")

_POSITIVE_INTS = (
    "emb_dim",
    "q_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "compress_ratio",
    "index_topk",
    "num_query_heads",
    "head_dim",
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class CSAConfig:
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
    rope_scaling: "YarnScaling | Mapping[str, Any] | None" = None
    index_quant: "IndexQuant | Mapping[str, Any] | None" = None
    scoring_backend: str = "xla"
    key_window: int = 512

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS[:4]:
            _check_positive_int(name, getattr(self, name))
        dr = self.rope_head_dim
        if not _is_int(dr):
            raise ValueError(f"rope_head_dim={dr!r} must be an int")
        if dr % 2:
            raise ValueError(f"rope_head_dim={dr!r} must be even")
        if not 0 <= dr <= self.index_head_dim:
            raise ValueError(
                f"rope_head_dim={dr!r} must satisfy 0 <= rope_head_dim <= "
                f"index_head_dim={self.index_head_dim}"
            )
        for name in _POSITIVE_INTS[4:]:
            _check_positive_int(name, getattr(self, name))
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if not _is_number(v):
                raise ValueError(f"{name}={v!r} must be a number")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be finite and > 0")
        _check_chunk("indexer_head_chunk", self.indexer_head_chunk, "index_n_heads", self.index_n_heads)
        _check_chunk("loss_head_chunk", self.loss_head_chunk, "num_query_heads", self.num_query_heads)
        if not (_is_int(self.query_chunk) and self.query_chunk >= 0):
            raise ValueError(f"query_chunk={self.query_chunk!r} must be an int >= 0 (0: all rows at once)")
        if not isinstance(self.sparse_loss, bool):
            raise ValueError(f"sparse_loss={self.sparse_loss!r} must be a bool")
        if not _is_number(self.loss_scale):
            raise ValueError(f"loss_scale={self.loss_scale!r} must be a number")
        if not math.isfinite(self.loss_scale):
            raise ValueError(f"loss_scale={self.loss_scale!r} must be finite")
        if not (_is_int(self.sliding_window) and self.sliding_window >= 0):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be an int >= 0 (0: no window)")
        if self.teacher_normaliser not in TEACHER_NORMALISERS:
            raise ValueError(f"teacher_normaliser={self.teacher_normaliser!r} is not supported "
                             f"(valid: {', '.join(TEACHER_NORMALISERS)})")
        # A frozen, hashable value (the config is a static argument of jax.jit).
        object.__setattr__(self, "rope_scaling", YarnScaling.of(self.rope_scaling))
        object.__setattr__(self, "index_quant", IndexQuant.of(self.index_quant, self.index_head_dim))
        if self.scoring_backend not in SCORING_BACKENDS:
            raise ValueError(f"scoring_backend={self.scoring_backend!r} is not supported "
                             f"(valid: {', '.join(SCORING_BACKENDS)})")
        if not (_is_int(self.key_window) and self.key_window >= 0):
            raise ValueError(f"key_window={self.key_window!r} must be an int >= 0 (0: every query block scores "
                             "every block)")

    # -- derived sizes -------------------------------------------------
    def num_blocks(self, seq_len: int) -> int:
        """W = S // m: whole compressed blocks in a sequence of `seq_len` tokens."""
        return seq_len // self.compress_ratio

    # -- serialisation -------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CSAConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise ValueError(f"unknown config field {key!r} (valid: {', '.join(names)})")
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.name not in d:
                raise ValueError(f"missing config field {f.name!r}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # rope_scaling comes back as a plain dict (or None)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """`rope_scaling` of type "yarn" (SPEC section 6), validated; `CSAConfig` holds one (or None)
    and takes it as a plain dict."""

    type: str
    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float

    @classmethod
    def of(cls, value: Any) -> "YarnScaling | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"rope_scaling={value!r} must be null or a dict with type 'yarn'")
        _check_keys("rope_scaling", value, ROPE_SCALING_KEYS)
        if value["type"] != "yarn":
            raise ValueError(f"rope_scaling type={value['type']!r} is not supported (valid: yarn)")
        f, length = value["factor"], value["original_max_position"]
        if not (_is_number(f) and math.isfinite(f) and f >= 1):
            raise ValueError(f"rope_scaling factor={f!r} must be a finite number >= 1")
        if not (_is_int(length) and length >= 1):
            raise ValueError(f"rope_scaling original_max_position={length!r} must be an int >= 1")
        fast, slow = value["beta_fast"], value["beta_slow"]
        if not (_is_number(fast) and _is_number(slow) and math.isfinite(fast) and math.isfinite(slow)
                and fast > slow > 0):
            raise ValueError(f"rope_scaling beta_fast={fast!r}, beta_slow={slow!r} must satisfy "
                             "beta_fast > beta_slow > 0")
        return cls(**{k: value[k] for k in ROPE_SCALING_KEYS})


@dataclasses.dataclass(frozen=True)
class IndexQuant:
    """`index_quant` (SPEC section 7a), validated; `CSAConfig` holds one (or None) and takes it
    as a plain dict."""

    format: str
    block: int
    hadamard: bool

    @classmethod
    def of(cls, value: Any, head_dim: int) -> "IndexQuant | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"index_quant={value!r} must be null or a dict with keys "
                             f"{', '.join(INDEX_QUANT_KEYS)}")
        _check_keys("index_quant", value, INDEX_QUANT_KEYS)
        fmt, block, rotate = value["format"], value["block"], value["hadamard"]
        if not (isinstance(fmt, str) and fmt in QUANT_FORMATS):
            raise ValueError(f"index_quant format={fmt!r} is not supported (valid: {', '.join(QUANT_FORMATS)})")
        if not (_is_int(block) and block >= 1 and head_dim % block == 0):
            valid = ", ".join(str(d) for d in _divisors(head_dim))
            raise ValueError(f"index_quant block={block!r} must divide index_head_dim={head_dim} (valid: {valid})")
        if not isinstance(rotate, bool):
            raise ValueError(f"index_quant hadamard={rotate!r} must be a bool")
        if rotate and head_dim & (head_dim - 1):
            raise ValueError(f"index_quant hadamard=True needs index_head_dim={head_dim} to be a power of two "
                             "(the Sylvester Hadamard matrix has order 2**n)")
        return cls(format=fmt, block=block, hadamard=rotate)


def _check_keys(field: str, value: Mapping, keys: tuple[str, ...]) -> None:
    """A dict-valued field holds exactly `keys`: an unknown key first, then a missing one."""
    for key in value:
        if key not in keys:
            raise ValueError(f"{field} has unknown key {key!r} (valid: {', '.join(keys)})")
    for key in keys:
        if key not in value:
            raise ValueError(f"{field} is missing key {key!r}")


def _check_positive_int(name: str, v: Any) -> None:
    if not _is_int(v):
        raise ValueError(f"{name}={v!r} must be an int")
    if v < 1:
        raise ValueError(f"{name}={v!r} must be >= 1")


def _check_chunk(name: str, v: Any, heads_name: str, heads: int) -> None:
    if not (_is_int(v) and (v == 0 or (v > 0 and heads % v == 0))):
        valid = ", ".join(str(c) for c in [0, *_divisors(heads)])
        raise ValueError(f"{name}={v!r} must divide {heads_name}={heads} (valid: {valid})")


def resolve_dtype(name: Any) -> tuple[jnp.dtype, jnp.dtype]:
    """Compute dtype and wide (accumulation) dtype for a dtype name (SPEC section 2)."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported (valid: {', '.join(DTYPES)})")
    if name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "dtype='float64' needs JAX 64-bit mode, which is off: set JAX_ENABLE_X64=1 or call "
            "jax.config.update('jax_enable_x64', True) before any computation"
        )
    dtype = jnp.dtype(name)
    wide = jnp.dtype("float64") if name == "float64" else jnp.dtype("float32")
    return dtype, wide

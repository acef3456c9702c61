"""Host-side checks of params and inputs before anything is traced.

Every failure is a ValueError that names the tensor, what it is, and the rule,
so a wrong shape never surfaces as a broadcasting error from inside XLA and a
NaN input never surfaces as a parity result.
"""

from __future__ import annotations

import numpy as np

PARAM_NAMES = (
    "indexer.wkv",
    "indexer.wgate",
    "indexer.ape",
    "indexer.kv_norm",
    "indexer.wq_b",
    "indexer.weights_proj",
)
FLOAT_INPUTS = ("hidden_states", "q_latent", "teacher_query", "teacher_kv")
INT_INPUTS = ("position_ids", "segment_ids")


def param_shapes(cfg) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical parameter shapes (SPEC section 3), with their symbolic form."""
    e, r, hi, di, m = cfg.emb_dim, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.compress_ratio
    return {
        "indexer.wkv": ("[emb_dim, 2*index_head_dim]", (e, 2 * di)),
        "indexer.wgate": ("[emb_dim, 2*index_head_dim]", (e, 2 * di)),
        "indexer.ape": ("[compress_ratio, 2*index_head_dim]", (m, 2 * di)),
        "indexer.kv_norm": ("[index_head_dim]", (di,)),
        "indexer.wq_b": ("[q_lora_rank, index_n_heads*index_head_dim]", (r, hi * di)),
        "indexer.weights_proj": ("[emb_dim, index_n_heads]", (e, hi)),
    }


def input_shapes(cfg, batch: int, seq: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Input shapes (SPEC section 4) for a batch of `batch` rows of `seq` tokens."""
    b, s, w = batch, seq, cfg.num_blocks(seq)
    return {
        "hidden_states": ("[B, S, emb_dim]", (b, s, cfg.emb_dim)),
        "q_latent": ("[B, S, q_lora_rank]", (b, s, cfg.q_lora_rank)),
        "position_ids": ("[B, S]", (b, s)),
        "segment_ids": ("[B, S]", (b, s)),
        "teacher_query": ("[B, S, num_query_heads, head_dim]", (b, s, cfg.num_query_heads, cfg.head_dim)),
        "teacher_kv": ("[B, W, head_dim]", (b, w, cfg.head_dim)),
    }


def _as_host(kind: str, name: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except Exception as exc:  # e.g. a torch tensor that needs grad, a ragged list
        raise ValueError(f"{kind}[{name!r}] cannot be read as an array: {exc}") from None


def _check_float(kind: str, name: str, arr: np.ndarray) -> None:
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
        raise ValueError(f"{kind}[{name!r}] has dtype {arr.dtype}; expected a floating dtype")
    finite = np.isfinite(arr.astype(np.float64))
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{kind}[{name!r}] contains NaN/Inf at index {where}")


def _check_shape(kind: str, name: str, arr: np.ndarray, symbolic: str, expected: tuple[int, ...]) -> None:
    if arr.shape != expected:
        raise ValueError(
            f"{kind}[{name!r}] has shape {tuple(arr.shape)}; expected {symbolic} = {list(expected)}"
        )


def validate_params(params, cfg) -> None:
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict keyed by canonical names, got {type(params).__name__}")
    for name, (symbolic, expected) in param_shapes(cfg).items():
        if name not in params:
            raise ValueError(f"missing param {name!r}")
        arr = _as_host("params", name, params[name])
        _check_shape("params", name, arr, symbolic, expected)
        _check_float("params", name, arr)


def validate_inputs(inputs, cfg) -> None:
    if not isinstance(inputs, dict):
        raise ValueError(f"inputs must be a dict keyed by SPEC names, got {type(inputs).__name__}")
    for name in (*FLOAT_INPUTS, *INT_INPUTS):
        if name not in inputs:
            raise ValueError(f"missing input {name!r}")
    hs = _as_host("inputs", "hidden_states", inputs["hidden_states"])
    if hs.ndim != 3:
        raise ValueError(f"inputs['hidden_states'] has shape {tuple(hs.shape)}; expected [B, S, emb_dim] (rank 3)")
    arrays = {name: _as_host("inputs", name, inputs[name]) for name in (*FLOAT_INPUTS, *INT_INPUTS)}
    for name, (symbolic, expected) in input_shapes(cfg, hs.shape[0], hs.shape[1]).items():
        _check_shape("inputs", name, arrays[name], symbolic, expected)
    for name in FLOAT_INPUTS:
        _check_float("inputs", name, arrays[name])
    for name in INT_INPUTS:
        if not np.issubdtype(arrays[name].dtype, np.integer):
            raise ValueError(f"inputs[{name!r}] has dtype {arrays[name].dtype}; expected an integer dtype")
    pos, seg = arrays["position_ids"].astype(np.int64), arrays["segment_ids"]
    if pos.size and pos.min() < 0:
        where = tuple(int(i) for i in np.argwhere(pos < 0)[0])
        raise ValueError(f"inputs['position_ids'] has a negative position {pos[where]} at (b, s)={where}")
    drops = (pos[:, 1:] < pos[:, :-1]) & (seg[:, 1:] == seg[:, :-1])
    if drops.any():
        b, s = (int(i) for i in np.argwhere(drops)[0])
        raise ValueError(
            f"inputs['position_ids'] decreases inside a document at (b, s)=({b}, {s + 1}): "
            f"{pos[b, s]} -> {pos[b, s + 1]}"
        )

"""Checks of params and inputs, in two kinds.

Structure (trace time): names, ranks, shapes and dtypes. They need no values, so they
run on numpy arrays, jax arrays, tracers (under `jax.jit`, `jax.grad`, `jax.vmap`,
`shard_map`) and `jax.ShapeDtypeStruct`s alike; every public entry point runs them
first, so a wrong shape is one clear line also when the call is traced, never a
broadcasting error from inside XLA. `check_params`, `check_inputs`, `check_selection`.

Values (host side only): NaN/Inf in a float tensor, negative or decreasing positions,
selection indices out of range. They need the numbers, which a tracer does not have, so
they live in `validate_inputs` (and `CSAIndexer.validate`), which a caller runs on
concrete arrays at its boundary: the harness before a matrix point, a user before a
training loop. The entry points never run them, whether or not their arguments are
concrete: a value check that silently ran on some calls and not on others would be
worse than one that is documented to run only when asked. Inside `jit` use
`jax.experimental.checkify` with `checkify_inputs` (the same rules, as checkify checks).

Every failure is a ValueError that names the tensor, what it is and the rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PARAM_NAMES = (
    "indexer.wkv",
    "indexer.wgate",
    "indexer.ape",
    "indexer.kv_norm",
    "indexer.wq_b",
    "indexer.weights_proj",
)
FLOAT_INPUTS = ("hidden_states", "q_latent", "teacher_query", "teacher_kv", "teacher_window_kv", "attention_sink")
INT_INPUTS = ("position_ids", "segment_ids")
INDEXER_INPUTS = ("hidden_states", "q_latent", "position_ids", "segment_ids")
TEACHER_INPUTS = ("teacher_query", "teacher_kv", "teacher_window_kv", "attention_sink")


def teacher_input_names(cfg) -> tuple[str, ...]:
    """The teacher inputs the loss reads under `cfg` (the only ones it requires): the sink for
    the joint teacher, and the window keys when it also has a window."""
    names = ("teacher_query", "teacher_kv")
    if cfg.teacher_normaliser == "joint":
        names += ("teacher_window_kv",) if cfg.sliding_window else ()
        names += ("attention_sink",)
    return names


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
        "teacher_window_kv": ("[B, S, head_dim]", (b, s, cfg.head_dim)),
        "attention_sink": ("[num_query_heads]", (cfg.num_query_heads,)),
    }


# --------------------------------------------------------------------------- structure (trace time)

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def as_array(kind: str, name: str, value):
    """`value` itself when it is already an array (numpy, jax, a tracer or a ShapeDtypeStruct:
    only its shape and dtype are read), else numpy's reading of it (a list, a CPU tensor)."""
    if isinstance(value, _ARRAY_TYPES):
        return value
    try:
        return np.asarray(value)
    except Exception as exc:  # e.g. a torch tensor that needs grad, a ragged list
        raise ValueError(f"{kind}[{name!r}] cannot be read as an array: {exc}") from None


def _check_float_dtype(kind: str, name: str, arr) -> None:
    if not jnp.issubdtype(arr.dtype, jnp.floating):
        raise ValueError(f"{kind}[{name!r}] has dtype {np.dtype(arr.dtype)}; expected a floating dtype")


def _check_int_dtype(kind: str, name: str, arr) -> None:
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{kind}[{name!r}] has dtype {np.dtype(arr.dtype)}; expected an integer dtype")


def _check_shape(kind: str, name: str, arr, symbolic: str, expected: tuple[int, ...]) -> None:
    if tuple(arr.shape) != expected:
        raise ValueError(
            f"{kind}[{name!r}] has shape {tuple(arr.shape)}; expected {symbolic} = {list(expected)}"
        )


def check_params(params, cfg) -> dict:
    """Names, shapes and float dtypes of the six parameters; returns them as arrays. Trace-safe."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict keyed by canonical names, got {type(params).__name__}")
    out = {}
    for name, (symbolic, expected) in param_shapes(cfg).items():
        if name not in params:
            raise ValueError(f"missing param {name!r}")
        arr = as_array("params", name, params[name])
        _check_shape("params", name, arr, symbolic, expected)
        _check_float_dtype("params", name, arr)
        out[name] = arr
    return out


def check_inputs(inputs, cfg, teacher: bool = True) -> dict:
    """Names, ranks, shapes and dtypes of the inputs (with `teacher`, also the teacher inputs
    the config's loss reads: `teacher_input_names`); returns them as arrays. Trace-safe."""
    if not isinstance(inputs, dict):
        raise ValueError(f"inputs must be a dict keyed by SPEC names, got {type(inputs).__name__}")
    names = (*INDEXER_INPUTS, *teacher_input_names(cfg)) if teacher else INDEXER_INPUTS
    for name in (*FLOAT_INPUTS, *INT_INPUTS):
        if name in names and name not in inputs:
            raise ValueError(f"missing input {name!r}")
    arrays = {name: as_array("inputs", name, inputs[name]) for name in names}
    hs = arrays["hidden_states"]
    if len(hs.shape) != 3:
        raise ValueError(f"inputs['hidden_states'] has shape {tuple(hs.shape)}; expected [B, S, emb_dim] (rank 3)")
    shapes = input_shapes(cfg, hs.shape[0], hs.shape[1])
    for name in names:
        _check_shape("inputs", name, arrays[name], *shapes[name])
    for name in names:
        if name in FLOAT_INPUTS:
            _check_float_dtype("inputs", name, arrays[name])
    for name in INT_INPUTS:
        _check_int_dtype("inputs", name, arrays[name])
    return arrays


def check_selection(selection, cfg, batch: int, seq: int):
    """Shape [B, S, k_eff] and integer dtype of an imposed top-k selection. Trace-safe."""
    expected = (batch, seq, min(cfg.index_topk, cfg.num_blocks(seq)))
    sel = as_array("selection", "selection", selection)
    if tuple(sel.shape) != expected or not jnp.issubdtype(sel.dtype, jnp.integer):
        raise ValueError(
            f"selection has shape {tuple(sel.shape)} and dtype {np.dtype(sel.dtype)}; "
            f"expected integer [B, S, k_eff] = {list(expected)}"
        )
    return sel


# The quantizer's outputs (SPEC section 7a) under their public names, as indexer_forward returns
# them and as the entry points take them back (`codes=`: score these instead of their own).
CODE_NAMES = ("query_codes", "query_scales", "key_codes", "key_scales")


def code_shapes(cfg, batch: int, seq: int) -> dict:
    """name -> (expected shape, dims in words) of the codes and scales of a problem."""
    hi, di, w = cfg.index_n_heads, cfg.index_head_dim, cfg.num_blocks(seq)
    nb = di // cfg.index_quant.block
    return {"query_codes": ((batch, seq, hi, di), "[B, S, HI, DI]"),
            "query_scales": ((batch, seq, hi, nb), "[B, S, HI, DI / block]"),
            "key_codes": ((batch, w, di), "[B, W, DI]"),
            "key_scales": ((batch, w, nb), "[B, W, DI / block]")}


def check_codes(codes, cfg, batch: int, seq: int) -> dict:
    """Names, shapes and dtypes of imposed codes and scales (uint8 codes, floating scales), as
    indexer_forward returns them. Trace-safe."""
    if cfg.index_quant is None:
        raise ValueError("codes were given, but index_quant is null: only a quantizing indexer scores codes")
    if not hasattr(codes, "keys"):
        raise ValueError(f"codes must be a dict of {', '.join(CODE_NAMES)}, got {type(codes).__name__}")
    names = set(codes)
    if names != set(CODE_NAMES):
        raise ValueError(f"codes has {', '.join(sorted(names)) or 'nothing'}; expected exactly "
                         f"{', '.join(CODE_NAMES)}")
    out = {}
    for name, (shape, dims) in code_shapes(cfg, batch, seq).items():
        arr = as_array("codes", name, codes[name])
        ok = jnp.dtype(arr.dtype) == jnp.uint8 if name.endswith("_codes") else jnp.issubdtype(arr.dtype, jnp.floating)
        if tuple(arr.shape) != shape or not ok:
            kind = "uint8" if name.endswith("_codes") else "floating"
            raise ValueError(f"codes[{name!r}] has shape {tuple(arr.shape)} and dtype {np.dtype(arr.dtype)}; "
                             f"expected {kind} {dims} = {list(shape)}")
        out[name] = arr
    return out


# --------------------------------------------------------------------------- values (host side)


def _host(label: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(
            f"{label} is a traced value: validate_inputs reads values and runs on the host, "
            "before jit/grad/vmap (inside jit use jax_impl.checkify_inputs under jax.experimental.checkify)"
        ) from None


# A sink of -inf is a head without a sink (SPEC section 8): the one float input that may hold it.
SINK_RULE = "(-inf is allowed: no sink)"


def _check_finite(kind: str, name: str, arr: np.ndarray) -> None:
    wide = arr.astype(np.float64)
    if name == "attention_sink":
        bad = np.isnan(wide) | (wide == np.inf)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{kind}[{name!r}] contains NaN or +Inf at index {where} {SINK_RULE}")
        return
    finite = np.isfinite(wide)
    if not finite.all():
        where = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"{kind}[{name!r}] contains NaN/Inf at index {where}")


def validate_params(params, cfg) -> None:
    """Structure and values (all finite) of the six parameters. Host side only."""
    for name, arr in check_params(params, cfg).items():
        _check_finite("params", name, _host(f"params[{name!r}]", arr))


def validate_inputs(params, inputs, cfg, selection=None, *, teacher: bool = True) -> None:
    """Every check of params, inputs (and an imposed `selection`), structure and values:
    finite floats, positions >= 0 and non-decreasing inside a document, selection indices in
    [-1, W). Host side only: call it on concrete arrays before jit / a training loop (the
    entry points check structure only). `params=None` checks the inputs alone; `teacher=False`
    leaves out the teacher's two inputs (forward only)."""
    if params is not None:
        validate_params(params, cfg)
    arrays = check_inputs(inputs, cfg, teacher)
    host = {name: _host(f"inputs[{name!r}]", arr) for name, arr in arrays.items()}
    for name in FLOAT_INPUTS:
        if name in host:
            _check_finite("inputs", name, host[name])
    pos, seg = host["position_ids"].astype(np.int64), host["segment_ids"]
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
    if selection is not None:
        b, s = pos.shape
        sel = _host("selection", check_selection(selection, cfg, b, s))
        w = cfg.num_blocks(s)
        out_of_range = (sel < -1) | (sel >= w)
        if out_of_range.any():
            idx = tuple(int(i) for i in np.argwhere(out_of_range)[0])
            raise ValueError(f"selection has value {int(sel[idx])} at index {idx}; expected -1 <= value < W = {w}")


# --------------------------------------------------------------------------- values, inside jit


def _first_index(bad):
    """The index of the first True of `bad` as a tuple of traced ints (all 0 when none)."""
    return jnp.unravel_index(jnp.argmax(bad.ravel()), bad.shape)


def _check_none(checkify, bad, message, args):
    """checkify.check that no element of `bad` is True (nothing to check when it is empty)."""
    if bad.size:
        checkify.check(~jnp.any(bad), message, *args(*_first_index(bad)))


def checkify_inputs(params, inputs, cfg, *, teacher: bool = True) -> None:
    """The value rules of `validate_inputs` (finite params and float inputs, positions >= 0 and
    non-decreasing inside a document) as `jax.experimental.checkify` checks: traceable, for use
    inside a function wrapped by `checkify.checkify(f, errors=checkify.user_checks)`; the error
    names the tensor and the first offending index like the host check does."""
    from jax.experimental import checkify

    floats = {f"params[{k!r}]": v for k, v in check_params(params, cfg).items()}
    arrays = check_inputs(inputs, cfg, teacher)
    floats.update({f"inputs[{k!r}]": v for k, v in arrays.items() if k in FLOAT_INPUTS})
    for label, arr in floats.items():
        where = ", ".join(["{}"] * len(arr.shape)) + ("," if len(arr.shape) == 1 else "")
        if label == "inputs['attention_sink']":
            _check_none(checkify, jnp.isnan(arr) | (arr == jnp.inf),
                        f"{label} contains NaN or +Inf at index ({where}) {SINK_RULE}", lambda *i: i)
            continue
        _check_none(checkify, ~jnp.isfinite(arr), f"{label} contains NaN/Inf at index ({where})", lambda *i: i)
    pos, seg = arrays["position_ids"], arrays["segment_ids"]
    _check_none(checkify, pos < 0, "inputs['position_ids'] has a negative position {} at (b, s)=({}, {})",
                lambda b, s: (pos[b, s], b, s))
    drops = (pos[:, 1:] < pos[:, :-1]) & (seg[:, 1:] == seg[:, :-1])
    _check_none(checkify, drops, "inputs['position_ids'] decreases inside a document at (b, s)=({}, {}): {} -> {}",
                lambda b, s: (b, s + 1, pos[b, s], pos[b, s + 1]))

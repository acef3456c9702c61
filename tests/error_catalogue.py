"""The catalogues of bad configs and bad inputs, with the small problems they mutate, shared
by tests/test_torch_ref.py and tests/test_torch_ref_teacher.py (the torch side) and
tests/test_bad_inputs.py (both sides; the jax side needs no torch). Messages are identical on both sides by docs/plugins.md. numpy only:
`cfg` is either side's CSAConfig."""

from __future__ import annotations

import math

import numpy as np

PARAMS = ("indexer.wkv", "indexer.wgate", "indexer.ape", "indexer.kv_norm",
          "indexer.wq_b", "indexer.weights_proj")

SMALL = dict(emb_dim=64, q_lora_rank=32, index_n_heads=8, index_head_dim=32, rope_head_dim=16,
             compress_ratio=4, index_topk=4, num_query_heads=8, head_dim=32)
TINY = dict(emb_dim=8, q_lora_rank=8, index_n_heads=2, index_head_dim=8, rope_head_dim=4,
            compress_ratio=4, index_topk=2, num_query_heads=2, head_dim=8)


def make_params(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    E, R, HI, DI, m = (cfg.emb_dim, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                       cfg.compress_ratio)

    def f(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "indexer.wkv": f(E, 2 * DI, scale=E ** -0.5),
        "indexer.wgate": f(E, 2 * DI, scale=E ** -0.5),
        "indexer.ape": f(m, 2 * DI, scale=0.5),
        "indexer.kv_norm": 1.0 + f(DI, scale=0.2),
        "indexer.wq_b": f(R, HI * DI, scale=R ** -0.5),
        "indexer.weights_proj": f(E, HI, scale=E ** -0.5),
    }


def make_inputs(cfg, B: int, S: int, seed: int = 1, docs=None) -> dict[str, np.ndarray]:
    """docs: list of document lengths for every row (packed), default one document."""
    rng = np.random.default_rng(seed)
    W = S // cfg.compress_ratio
    H, D = cfg.num_query_heads, cfg.head_dim
    docs = docs or [S]
    assert sum(docs) == S
    pos = np.concatenate([np.arange(n) for n in docs])
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(docs)])

    def f(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "hidden_states": f(B, S, cfg.emb_dim),
        "q_latent": f(B, S, cfg.q_lora_rank),
        "position_ids": np.tile(pos, (B, 1)).astype(np.int64),
        "segment_ids": np.tile(seg, (B, 1)).astype(np.int32),
        "teacher_query": f(B, S, H, D, scale=2.0 * D ** -0.5),
        "teacher_kv": f(B, W, D, scale=2.0),
        # The joint teacher's inputs (drawn last: the draws above do not move).
        "teacher_window_kv": f(B, S, D),
        "attention_sink": f(H),
    }


# --------------------------------------------------------------------------- config

# DeepSeek-V4's rope_scaling (SPEC section 1), the base of the rope_scaling entries.
V4_YARN = {"type": "yarn", "factor": 16, "original_max_position": 65536,
           "beta_fast": 32, "beta_slow": 1}


def _rs(**over):
    return {**V4_YARN, **over}


# DeepSeek-V4's index_quant (SPEC section 1), the base of the index_quant entries.
V4_QUANT = {"format": "e2m1", "block": 32, "hadamard": True}


def _iq(**over):
    return {**V4_QUANT, **over}


CONFIG_ERRORS = [
    (dict(emb_dim=2.0), "emb_dim=2.0 must be an int"),
    (dict(emb_dim=0), "emb_dim=0 must be >= 1"),
    (dict(emb_dim=0, q_lora_rank=2.0), "emb_dim=0 must be >= 1"),  # field order
    (dict(q_lora_rank=True), "q_lora_rank=True must be an int"),
    (dict(index_n_heads=-1), "index_n_heads=-1 must be >= 1"),
    (dict(index_head_dim="8"), "index_head_dim='8' must be an int"),
    (dict(compress_ratio=0), "compress_ratio=0 must be >= 1"),
    (dict(index_topk=0), "index_topk=0 must be >= 1"),
    (dict(num_query_heads=0), "num_query_heads=0 must be >= 1"),
    (dict(head_dim=1.5), "head_dim=1.5 must be an int"),
    (dict(rope_head_dim=2.0), "rope_head_dim=2.0 must be an int"),
    (dict(rope_head_dim=3), "rope_head_dim=3 must be even"),
    (dict(rope_head_dim=40),
     "rope_head_dim=40 must satisfy 0 <= rope_head_dim <= index_head_dim=32"),
    (dict(rope_head_dim=-2),
     "rope_head_dim=-2 must satisfy 0 <= rope_head_dim <= index_head_dim=32"),
    (dict(rope_theta="x"), "rope_theta='x' must be a number"),
    (dict(rope_theta=True), "rope_theta=True must be a number"),
    (dict(rope_theta=0.0), "rope_theta=0.0 must be finite and > 0"),
    (dict(rope_theta=math.inf), "rope_theta=inf must be finite and > 0"),
    (dict(norm_eps=-1e-6), "norm_eps=-1e-06 must be finite and > 0"),
    (dict(norm_eps=math.nan), "norm_eps=nan must be finite and > 0"),
    (dict(indexer_head_chunk=3),
     "indexer_head_chunk=3 must divide index_n_heads=8 (valid: 0, 1, 2, 4, 8)"),
    (dict(indexer_head_chunk=-2),
     "indexer_head_chunk=-2 must divide index_n_heads=8 (valid: 0, 1, 2, 4, 8)"),
    (dict(indexer_head_chunk=16),
     "indexer_head_chunk=16 must divide index_n_heads=8 (valid: 0, 1, 2, 4, 8)"),
    (dict(indexer_head_chunk=2.0),
     "indexer_head_chunk=2.0 must divide index_n_heads=8 (valid: 0, 1, 2, 4, 8)"),
    (dict(num_query_heads=6, loss_head_chunk=4),
     "loss_head_chunk=4 must divide num_query_heads=6 (valid: 0, 1, 2, 3, 6)"),
    (dict(loss_head_chunk=3),
     "loss_head_chunk=3 must divide num_query_heads=8 (valid: 0, 1, 2, 4, 8)"),
    (dict(sparse_loss=1), "sparse_loss=1 must be a bool"),
    (dict(loss_scale="x"), "loss_scale='x' must be a number"),
    (dict(loss_scale=math.inf), "loss_scale=inf must be finite"),
    (dict(loss_scale=math.nan), "loss_scale=nan must be finite"),
    # sliding_window, teacher_normaliser and rope_scaling (SPEC sections 1, 6 and 8)
    (dict(sliding_window=-1), "sliding_window=-1 must be an int >= 0 (0: no window)"),
    (dict(sliding_window=4.0), "sliding_window=4.0 must be an int >= 0 (0: no window)"),
    (dict(sliding_window=True), "sliding_window=True must be an int >= 0 (0: no window)"),
    (dict(sliding_window=None), "sliding_window=None must be an int >= 0 (0: no window)"),
    (dict(teacher_normaliser="softmax"),
     "teacher_normaliser='softmax' is not supported (valid: joint, compressed)"),
    (dict(teacher_normaliser=None),
     "teacher_normaliser=None is not supported (valid: joint, compressed)"),
    (dict(teacher_normaliser="Joint"),
     "teacher_normaliser='Joint' is not supported (valid: joint, compressed)"),
    (dict(rope_scaling="yarn"), "rope_scaling='yarn' must be null or a dict with type 'yarn'"),
    (dict(rope_scaling=[("type", "yarn")]),
     "rope_scaling=[('type', 'yarn')] must be null or a dict with type 'yarn'"),
    (dict(rope_scaling=16), "rope_scaling=16 must be null or a dict with type 'yarn'"),
    (dict(rope_scaling=_rs(scale=2, mscale=1)),
     "rope_scaling has unknown key 'scale' (valid: type, factor, original_max_position, "
     "beta_fast, beta_slow)"),
    (dict(rope_scaling={"type": "yarn", "mscale": 1}),  # unknown before missing
     "rope_scaling has unknown key 'mscale' (valid: type, factor, original_max_position, "
     "beta_fast, beta_slow)"),
    (dict(rope_scaling={}), "rope_scaling is missing key 'type'"),
    (dict(rope_scaling={"beta_slow": 1, "factor": 2}), "rope_scaling is missing key 'type'"),
    (dict(rope_scaling={"type": "yarn", "factor": 2, "beta_fast": 32}),
     "rope_scaling is missing key 'original_max_position'"),
    (dict(rope_scaling={k: v for k, v in V4_YARN.items() if k != "beta_slow"}),
     "rope_scaling is missing key 'beta_slow'"),
    (dict(rope_scaling=_rs(type="linear")), "rope_scaling type='linear' is not supported (valid: yarn)"),
    (dict(rope_scaling=_rs(type=None, factor=0)),  # type before factor
     "rope_scaling type=None is not supported (valid: yarn)"),
    (dict(rope_scaling=_rs(factor=0.5)), "rope_scaling factor=0.5 must be a finite number >= 1"),
    (dict(rope_scaling=_rs(factor=math.inf)), "rope_scaling factor=inf must be a finite number >= 1"),
    (dict(rope_scaling=_rs(factor=math.nan)), "rope_scaling factor=nan must be a finite number >= 1"),
    (dict(rope_scaling=_rs(factor=True)), "rope_scaling factor=True must be a finite number >= 1"),
    (dict(rope_scaling=_rs(factor="16")), "rope_scaling factor='16' must be a finite number >= 1"),
    (dict(rope_scaling=_rs(factor=0, original_max_position=0)),  # factor before L0
     "rope_scaling factor=0 must be a finite number >= 1"),
    (dict(rope_scaling=_rs(original_max_position=0)),
     "rope_scaling original_max_position=0 must be an int >= 1"),
    (dict(rope_scaling=_rs(original_max_position=65536.0)),
     "rope_scaling original_max_position=65536.0 must be an int >= 1"),
    (dict(rope_scaling=_rs(original_max_position=True)),
     "rope_scaling original_max_position=True must be an int >= 1"),
    (dict(rope_scaling=_rs(original_max_position=0, beta_fast=0)),  # L0 before the betas
     "rope_scaling original_max_position=0 must be an int >= 1"),
    (dict(rope_scaling=_rs(beta_fast=1, beta_slow=1)),
     "rope_scaling beta_fast=1, beta_slow=1 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_fast=1, beta_slow=32)),
     "rope_scaling beta_fast=1, beta_slow=32 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_slow=0)),
     "rope_scaling beta_fast=32, beta_slow=0 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_slow=-1.0)),
     "rope_scaling beta_fast=32, beta_slow=-1.0 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_fast=math.inf)),
     "rope_scaling beta_fast=inf, beta_slow=1 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_slow=math.nan)),
     "rope_scaling beta_fast=32, beta_slow=nan must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_fast="32")),
     "rope_scaling beta_fast='32', beta_slow=1 must satisfy beta_fast > beta_slow > 0"),
    (dict(rope_scaling=_rs(beta_slow=False)),
     "rope_scaling beta_fast=32, beta_slow=False must satisfy beta_fast > beta_slow > 0"),
    # field order: loss_scale, sliding_window, teacher_normaliser, rope_scaling
    (dict(loss_scale=math.inf, sliding_window=-1), "loss_scale=inf must be finite"),
    (dict(sliding_window=-1, teacher_normaliser="x"),
     "sliding_window=-1 must be an int >= 0 (0: no window)"),
    (dict(teacher_normaliser="x", rope_scaling="yarn"),
     "teacher_normaliser='x' is not supported (valid: joint, compressed)"),
    # scoring_backend: the JAX side's scoring code (torch accepts it and computes the same)
    (dict(scoring_backend="triton"), "scoring_backend='triton' is not supported (valid: xla, pallas)"),
    (dict(scoring_backend=None), "scoring_backend=None is not supported (valid: xla, pallas)"),
    (dict(scoring_backend="Pallas"), "scoring_backend='Pallas' is not supported (valid: xla, pallas)"),
    (dict(rope_scaling="yarn", scoring_backend="x"),
     "rope_scaling='yarn' must be null or a dict with type 'yarn'"),
    # index_quant (SPEC sections 1 and 7a): the format, a block dividing DI, the rotation's DI
    (dict(index_quant="e2m1"), "index_quant='e2m1' must be null or a dict with keys format, block, hadamard"),
    (dict(index_quant=_iq(scale="ue8m0")),
     "index_quant has unknown key 'scale' (valid: format, block, hadamard)"),
    (dict(index_quant={"format": "e2m1", "block": 32}), "index_quant is missing key 'hadamard'"),
    (dict(index_quant=_iq(format="e5m2")), "index_quant format='e5m2' is not supported (valid: e2m1, e4m3)"),
    (dict(index_quant=_iq(format="E2M1")), "index_quant format='E2M1' is not supported (valid: e2m1, e4m3)"),
    (dict(index_quant=_iq(format="mxfp4", block=3)),  # format before block
     "index_quant format='mxfp4' is not supported (valid: e2m1, e4m3)"),
    (dict(index_quant=_iq(block=3)), "index_quant block=3 must divide index_head_dim=32 (valid: 1, 2, 4, 8, 16, 32)"),
    (dict(index_quant=_iq(block=0)), "index_quant block=0 must divide index_head_dim=32 (valid: 1, 2, 4, 8, 16, 32)"),
    (dict(index_quant=_iq(block=64)),
     "index_quant block=64 must divide index_head_dim=32 (valid: 1, 2, 4, 8, 16, 32)"),
    (dict(index_quant=_iq(block=32.0)),
     "index_quant block=32.0 must divide index_head_dim=32 (valid: 1, 2, 4, 8, 16, 32)"),
    (dict(index_quant=_iq(block=True)),
     "index_quant block=True must divide index_head_dim=32 (valid: 1, 2, 4, 8, 16, 32)"),
    (dict(index_quant=_iq(hadamard=1)), "index_quant hadamard=1 must be a bool"),
    (dict(index_head_dim=24, index_quant=_iq(block=8)),
     "index_quant hadamard=True needs index_head_dim=24 to be a power of two (the Sylvester Hadamard "
     "matrix has order 2**n)"),
    (dict(rope_scaling="yarn", index_quant="x"),  # field order: rope_scaling, index_quant, scoring_backend
     "rope_scaling='yarn' must be null or a dict with type 'yarn'"),
    (dict(index_quant="x", scoring_backend="x"),
     "index_quant='x' must be null or a dict with keys format, block, hadamard"),
]

# --------------------------------------------------------------------------- input checks


def _set(name, value):
    def mutate(inputs, params):
        inputs[name] = value(inputs[name]) if callable(value) else value
    return mutate


def _del(*names):
    def mutate(inputs, params):
        for name in names:
            (params if name.startswith("indexer.") else inputs).pop(name)
    return mutate


def _both(*mutations):
    def mutate(inputs, params):
        for m in mutations:
            m(inputs, params)
    return mutate


def _at(name, index, value):
    def mutate(inputs, params):
        d = params if name.startswith("indexer.") else inputs
        d[name] = d[name].copy()
        d[name][index] = value
    return mutate


def _decrease(inputs, params):
    pos = inputs["position_ids"].copy()
    pos[0, 4], pos[0, 5] = 7, 3
    inputs["position_ids"] = pos


def _param(name, value):
    def mutate(inputs, params):
        params[name] = value(params[name])
    return mutate


INPUT_ERRORS = [
    (_del("q_latent"), "missing input 'q_latent'"),
    (_del("teacher_kv"), "missing input 'teacher_kv'"),
    (_set("hidden_states", lambda a: a[..., :32]),
     "inputs['hidden_states'] has shape (2, 64, 32); expected [B, S, emb_dim] = [2, 64, 64]"),
    (_set("hidden_states", lambda a: a[0, 0]),
     "inputs['hidden_states'] has shape (64,); expected [B, S, emb_dim] (rank 3)"),
    (_set("hidden_states", lambda a: a.astype(np.int32)),
     "inputs['hidden_states'] has dtype int32; expected a floating dtype"),
    (_set("q_latent", lambda a: a[:, :63]),
     "inputs['q_latent'] has shape (2, 63, 32); expected [B, S, q_lora_rank] = [2, 64, 32]"),
    (_at("q_latent", (0, 3, 1), np.nan), "inputs['q_latent'] contains NaN/Inf at index (0, 3, 1)"),
    (_at("hidden_states", (1, 0, 2), -np.inf),
     "inputs['hidden_states'] contains NaN/Inf at index (1, 0, 2)"),
    (_set("position_ids", lambda a: a.astype(np.float32)),
     "inputs['position_ids'] has dtype float32; expected an integer dtype"),
    (_set("segment_ids", lambda a: a > 0),
     "inputs['segment_ids'] has dtype bool; expected an integer dtype"),
    (_set("segment_ids", lambda a: a[:1]),
     "inputs['segment_ids'] has shape (1, 64); expected [B, S] = [2, 64]"),
    (_decrease, "inputs['position_ids'] decreases inside a document at (b, s)=(0, 5): 7 -> 3"),
    (_at("position_ids", (1, 0), -1),
     "inputs['position_ids'] has a negative position -1 at (b, s)=(1, 0)"),
    (_set("teacher_query", lambda a: a[:, :, :4]),
     "inputs['teacher_query'] has shape (2, 64, 4, 32); "
     "expected [B, S, num_query_heads, head_dim] = [2, 64, 8, 32]"),
    (_set("teacher_kv", lambda a: a[:, :15]),
     "inputs['teacher_kv'] has shape (2, 15, 32); expected [B, W, head_dim] = [2, 16, 32]"),
    (_at("teacher_kv", (1, 2, 3), np.inf),
     "inputs['teacher_kv'] contains NaN/Inf at index (1, 2, 3)"),
    (_del("indexer.wq_b"), "missing param 'indexer.wq_b'"),
    (_param("indexer.wkv", lambda a: a[:, :32]),
     "params['indexer.wkv'] has shape (64, 32); expected [emb_dim, 2*index_head_dim] = [64, 64]"),
    (_param("indexer.ape", lambda a: a.T),
     "params['indexer.ape'] has shape (64, 4); "
     "expected [compress_ratio, 2*index_head_dim] = [4, 64]"),
    (_param("indexer.kv_norm", lambda a: a[None]),
     "params['indexer.kv_norm'] has shape (1, 32); expected [index_head_dim] = [32]"),
    (_param("indexer.wq_b", lambda a: a[:, :-1]),
     "params['indexer.wq_b'] has shape (32, 255); "
     "expected [q_lora_rank, index_n_heads*index_head_dim] = [32, 256]"),
    (_param("indexer.weights_proj", lambda a: a.astype(np.int64)),
     "params['indexer.weights_proj'] has dtype int64; expected a floating dtype"),
    (_at("indexer.wgate", (5, 7), np.nan),
     "params['indexer.wgate'] contains NaN/Inf at index (5, 7)"),
]

# The joint teacher's inputs (SPEC sections 4 and 8), each under the config that reads them
# (SMALL with `over`: the sink under the joint teacher, teacher_window_kv only with a
# sliding window), on the same B=2, S=64 problem: (over, mutate, message).
TEACHER_INPUT_ERRORS = [
    (dict(), _del("attention_sink"), "missing input 'attention_sink'"),
    (dict(sliding_window=4), _del("teacher_window_kv"), "missing input 'teacher_window_kv'"),
    (dict(sliding_window=4), _del("attention_sink", "teacher_window_kv"),
     "missing input 'teacher_window_kv'"),
    (dict(sliding_window=4), _del("teacher_kv", "teacher_window_kv"),
     "missing input 'teacher_kv'"),
    (dict(sliding_window=4), _del("attention_sink", "segment_ids"),
     "missing input 'attention_sink'"),
    (dict(sliding_window=4), _set("teacher_window_kv", lambda a: a[:, :63]),
     "inputs['teacher_window_kv'] has shape (2, 63, 32); expected [B, S, head_dim] = [2, 64, 32]"),
    (dict(sliding_window=4), _set("teacher_window_kv", lambda a: a[..., None]),
     "inputs['teacher_window_kv'] has shape (2, 64, 32, 1); "
     "expected [B, S, head_dim] = [2, 64, 32]"),
    (dict(), _set("attention_sink", lambda a: a[:7]),
     "inputs['attention_sink'] has shape (7,); expected [num_query_heads] = [8]"),
    (dict(), _set("attention_sink", lambda a: np.float32(0.0)),
     "inputs['attention_sink'] has shape (); expected [num_query_heads] = [8]"),
    (dict(sliding_window=4), _set("attention_sink", lambda a: a.astype(np.int64)),
     "inputs['attention_sink'] has dtype int64; expected a floating dtype"),
    (dict(sliding_window=4), _set("teacher_window_kv", lambda a: a.astype(np.int32)),
     "inputs['teacher_window_kv'] has dtype int32; expected a floating dtype"),
    (dict(sliding_window=4), _at("teacher_window_kv", (1, 5, 3), np.nan),
     "inputs['teacher_window_kv'] contains NaN/Inf at index (1, 5, 3)"),
    (dict(sliding_window=4), _at("teacher_window_kv", (0, 0, 0), -np.inf),
     "inputs['teacher_window_kv'] contains NaN/Inf at index (0, 0, 0)"),
    (dict(), _at("attention_sink", 3, np.nan),
     "inputs['attention_sink'] contains NaN or +Inf at index (3,) (-inf is allowed: no sink)"),
    (dict(), _at("attention_sink", 3, np.inf),
     "inputs['attention_sink'] contains NaN or +Inf at index (3,) (-inf is allowed: no sink)"),
    # phases and order
    (dict(sliding_window=4),
     _both(_set("teacher_kv", lambda a: a[:, :3]), _at("teacher_window_kv", 0, np.nan)),
     "inputs['teacher_kv'] has shape (2, 3, 32); expected [B, W, head_dim] = [2, 16, 32]"),
    (dict(sliding_window=4),
     _both(_set("attention_sink", lambda a: a[:2]), _set("teacher_window_kv", lambda a: a[:1])),
     "inputs['teacher_window_kv'] has shape (1, 64, 32); expected [B, S, head_dim] = [2, 64, 32]"),
    (dict(sliding_window=4),
     _both(_set("attention_sink", lambda a: a[:2]), _at("teacher_window_kv", 0, np.nan)),
     "inputs['attention_sink'] has shape (2,); expected [num_query_heads] = [8]"),
    (dict(sliding_window=4),
     _both(_at("attention_sink", 0, np.nan), _at("teacher_window_kv", (0, 1, 2), np.nan)),
     "inputs['teacher_window_kv'] contains NaN/Inf at index (0, 1, 2)"),
    (dict(),
     _both(_at("attention_sink", 0, np.nan), _set("segment_ids", lambda a: a * 1.0)),
     "inputs['attention_sink'] contains NaN or +Inf at index (0,) (-inf is allowed: no sink)"),
    (dict(sliding_window=4), _at("teacher_window_kv", (1, 2, 3), np.inf),
     "inputs['teacher_window_kv'] contains NaN/Inf at index (1, 2, 3)"),
    (dict(sliding_window=4), _del("attention_sink"), "missing input 'attention_sink'"),
    # the compressed teacher reads neither: their absence is no error, the next fault is
    (dict(sliding_window=4, teacher_normaliser="compressed"),
     _both(_del("attention_sink", "teacher_window_kv"), _set("teacher_kv", lambda a: a[:, :3])),
     "inputs['teacher_kv'] has shape (2, 3, 32); expected [B, W, head_dim] = [2, 16, 32]"),
    # without a window teacher_window_kv is not read, so not checked: the sink's fault shows
    (dict(), _both(_set("teacher_window_kv", lambda a: a[:1]), _at("attention_sink", 2, np.inf)),
     "inputs['attention_sink'] contains NaN or +Inf at index (2,) (-inf is allowed: no sink)"),
]

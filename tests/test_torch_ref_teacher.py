"""Unit tests of the torch reference's joint teacher (SPEC §8), its two new inputs (SPEC §4),
YaRN RoPE (SPEC §6) and the three config fields they bring (SPEC §1). Torch and numpy only;
every numeric check runs in float64 on small shapes."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import numpy as np
import pytest

from needs import skip_module_without_torch

skip_module_without_torch()

import torch  # noqa: E402

from torch_ref import (  # noqa: E402
    CSAConfig,
    forward_stages,
    indexer_forward,
    indexer_loss,
    indexer_loss_and_grads,
    validate_inputs,
    yarn_bounds,
)
from torch_ref import reference  # noqa: E402

from error_catalogue import (  # noqa: E402
    SMALL,
    TEACHER_INPUT_ERRORS,
    TINY,
    V4_YARN,
    make_inputs,
    make_params,
)

EPS = 1e-8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cfg_of(base=TINY, **over) -> CSAConfig:
    return CSAConfig(**{**base, **over})


def joint_inputs(cfg, B, S, seed=1, docs=None, sink=None):
    """make_inputs plus the joint teacher's inputs: teacher_window_kv [B,S,D] and
    attention_sink [H] (random unless given)."""
    inputs = make_inputs(cfg, B, S, seed=seed, docs=docs)
    rng = np.random.default_rng(seed + 100)
    inputs["teacher_window_kv"] = (rng.standard_normal((B, S, cfg.head_dim)) * 2.0).astype(np.float32)
    inputs["attention_sink"] = (np.asarray(sink, np.float32) if sink is not None else
                                rng.standard_normal(cfg.num_query_heads).astype(np.float32))
    return inputs


def teacher_of(params, inputs, cfg, selection=None) -> torch.Tensor:
    return forward_stages(params, inputs, cfg, "float64", selection)["teacher"]


# --------------------------------------------------------------------------- brute force


def brute_force_teacher(inputs, cfg, selection=None) -> np.ndarray:
    """SPEC §8's teacher, one (b, s) row and one head at a time in float64 numpy: build the
    visible blocks C, the window set Win and the sink, take L = logsumexp over them, sum the
    heads' block probabilities, renormalise. Written from the SPEC text, not from
    torch_ref.reference."""
    pos = np.asarray(inputs["position_ids"])
    seg = np.asarray(inputs["segment_ids"])
    tq = np.asarray(inputs["teacher_query"], np.float64)
    tkv = np.asarray(inputs["teacher_kv"], np.float64)
    twkv = np.asarray(inputs.get("teacher_window_kv", np.zeros(0)), np.float64)
    sink = np.asarray(inputs.get("attention_sink", np.zeros(0)), np.float64)
    B, S, H, _ = tq.shape
    m, n_win = cfg.compress_ratio, cfg.sliding_window
    W = S // m
    joint = cfg.teacher_normaliser == "joint"
    T = np.zeros((B, S, W))
    for b in range(B):
        for s in range(S):
            C = [j for j in range(W)
                 if pos[b, j * m] + m <= pos[b, s] + 1
                 and all(seg[b, j * m + t] == seg[b, s] for t in range(m))]
            if cfg.sparse_loss:
                C = [j for j in C if j in set(int(i) for i in selection[b, s])]
            if not C:
                continue  # not a valid row: its teacher is 0
            Win = [r for r in range(S) if s - n_win < r <= s and seg[b, r] == seg[b, s]]
            row = np.zeros(W)
            for h in range(H):
                a = {j: float(tq[b, s, h] @ tkv[b, j]) for j in C}
                terms = list(a.values())
                if joint:
                    terms += [float(tq[b, s, h] @ twkv[b, r]) for r in Win]
                    terms.append(float(sink[h]))
                mx = max(terms)  # finite: C is not empty
                L = mx + math.log(sum(math.exp(t - mx) for t in terms))
                for j in C:
                    row[j] += math.exp(a[j] - L)
            T[b, s] = row / (row.sum() + EPS)
    return T


def loss_from_teacher(T: np.ndarray, scores: np.ndarray) -> float:
    """SPEC §8's KL with the student taken from the (already -inf masked) scores."""
    kls = []
    for b in range(T.shape[0]):
        for s in range(T.shape[1]):
            valid = np.isfinite(scores[b, s])
            if not valid.any():
                continue
            z = scores[b, s][valid]
            log_p = z - (z.max() + math.log(np.exp(z - z.max()).sum()))
            kls.append(sum(t * (math.log(t + EPS) - lp)
                           for t, lp in zip(T[b, s][valid], log_p) if t > 0))
    return sum(kls) / max(len(kls), 1)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("n_win", [0, 1, 3, 7, 40])
@pytest.mark.parametrize("normaliser", ["joint", "compressed"])
def test_teacher_matches_brute_force_loop(normaliser, n_win, sparse):
    cfg = cfg_of(num_query_heads=3, sliding_window=n_win, teacher_normaliser=normaliser,
                 sparse_loss=sparse, index_topk=2)
    params = make_params(cfg, 3)
    inputs = joint_inputs(cfg, 2, 18, seed=4, docs=[7, 11], sink=[0.3, -np.inf, 1.5])
    fwd = indexer_forward(params, inputs, cfg, "float64")
    selection = fwd["topk_indices"] if sparse else None
    T = teacher_of(params, inputs, cfg, selection)
    want = brute_force_teacher(inputs, cfg, None if selection is None else selection.numpy())
    assert T.dtype == torch.float64 and tuple(T.shape) == want.shape
    assert np.abs(want).sum(-1).max() > 0.5  # some rows carry a teacher
    torch.testing.assert_close(T, torch.from_numpy(want), rtol=1e-12, atol=1e-14)
    # The loss path (_loss -> kl_loss) reads the same teacher.
    if sparse:  # the student sees the selection only
        picked = (selection[..., None] == torch.arange(fwd["index_scores"].shape[-1])).any(-2)
        scores = torch.where(picked, fwd["index_scores"], -torch.inf).numpy()
    else:
        scores = fwd["index_scores"].numpy()
    want_loss = loss_from_teacher(want, scores)
    loss = float(indexer_loss(params, inputs, cfg, "float64", selection=selection))
    assert abs(loss - want_loss) <= 1e-12 * abs(want_loss), (loss, want_loss)


def test_joint_teacher_differs_from_compressed_and_by_head_mass():
    """The joint teacher is not the compressed one once a sink or a window takes mass."""
    cfg = cfg_of(num_query_heads=3, sliding_window=4)
    params, inputs = make_params(cfg), joint_inputs(cfg, 1, 16)
    joint = teacher_of(params, inputs, cfg)
    comp = teacher_of(params, inputs, dataclasses.replace(cfg, teacher_normaliser="compressed"))
    assert (joint - comp).abs().max() > 1e-3


# --------------------------------------------------------------------------- joint == compressed


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_no_window_and_no_sink_makes_joint_equal_compressed(sparse):
    cfg = cfg_of(SMALL, sliding_window=0, sparse_loss=sparse)
    params = make_params(cfg)
    inputs = joint_inputs(cfg, 2, 64, docs=[21, 43], sink=[-np.inf] * cfg.num_query_heads)
    comp_cfg = dataclasses.replace(cfg, teacher_normaliser="compressed")
    tj, tc = teacher_of(params, inputs, cfg), teacher_of(params, inputs, comp_cfg)
    assert tj.abs().sum() > 0
    assert (tj - tc).abs().max() <= 1e-15
    lj = float(indexer_loss(params, inputs, cfg, "float64"))
    lc = float(indexer_loss(params, inputs, comp_cfg, "float64"))
    assert abs(lj - lc) <= 1e-15 * max(abs(lc), 1.0), (lj, lc)
    # ... and a finite sink, or a window, breaks the equality.
    finite = dict(inputs, attention_sink=np.zeros(cfg.num_query_heads, np.float32))
    assert (teacher_of(params, finite, cfg) - tc).abs().max() > 1e-6
    windowed = dataclasses.replace(cfg, sliding_window=2)
    assert (teacher_of(params, inputs, windowed) - tc).abs().max() > 1e-6


# --------------------------------------------------------------------------- the window set


def _perturbed(inputs, tokens, b=None):
    out = dict(inputs)
    twkv = inputs["teacher_window_kv"].copy()
    rows = slice(None) if b is None else b
    twkv[rows, tokens] += 3.0
    out["teacher_window_kv"] = twkv
    return out


def test_window_never_crosses_a_document():
    cfg = cfg_of(num_query_heads=3, sliding_window=8)
    params = make_params(cfg)
    inputs = joint_inputs(cfg, 2, 18, docs=[7, 11])
    T = teacher_of(params, inputs, cfg)
    doc1, doc2 = slice(0, 7), slice(7, 18)
    assert T[:, 11:15].abs().sum() > 0  # doc 2 rows whose 8-token window would reach doc 1
    other = teacher_of(params, _perturbed(inputs, doc1), cfg)
    assert torch.equal(other[:, doc2], T[:, doc2])
    assert not torch.equal(other[:, doc1], T[:, doc1])  # the change itself is seen
    own = teacher_of(params, _perturbed(inputs, slice(7, 8)), cfg)  # doc 2's first token
    assert not torch.equal(own[:, 11:15], T[:, 11:15])


def test_window_is_causal_and_holds_exactly_n_win_tokens():
    n_win, S = 5, 24
    cfg = cfg_of(num_query_heads=3, sliding_window=n_win)
    params = make_params(cfg)
    inputs = joint_inputs(cfg, 1, S)
    T = teacher_of(params, inputs, cfg)[0]
    live = T.abs().sum(-1) > 0  # rows that see a compressed block
    assert live.sum() >= S - 4
    for r in range(S):
        Tr = teacher_of(params, _perturbed(inputs, [r]), cfg)[0]
        for s in range(S):
            if not live[s]:
                continue
            in_window = s - n_win < r <= s  # token r is query s's window: itself included
            changed = not torch.equal(Tr[s], T[s])
            assert changed == in_window, (r, s, in_window)
    # Explicitly: future tokens, token s - n_win, token s - n_win + 1.
    s = 17
    assert torch.equal(teacher_of(params, _perturbed(inputs, slice(s + 1, S)), cfg)[0, s], T[s])
    assert torch.equal(teacher_of(params, _perturbed(inputs, [s - n_win]), cfg)[0, s], T[s])
    assert not torch.equal(teacher_of(params, _perturbed(inputs, [s - n_win + 1]), cfg)[0, s], T[s])


@pytest.mark.parametrize("n_win", [18, 19, 1000])
def test_window_at_least_S_takes_the_whole_causal_document(n_win):
    cfg = cfg_of(num_query_heads=3, sliding_window=n_win)
    params = make_params(cfg)
    inputs = joint_inputs(cfg, 2, 18, docs=[7, 11])
    T = teacher_of(params, inputs, cfg)
    assert torch.isfinite(T).all()
    torch.testing.assert_close(T, torch.from_numpy(brute_force_teacher(inputs, cfg)),
                               rtol=1e-12, atol=1e-14)
    # n_win beyond S is clamped to S: the same computation as n_win = S.
    assert torch.equal(T, teacher_of(params, inputs, dataclasses.replace(cfg, sliding_window=18)))
    # 17 already spans every causal token of each document here (the longest has 11).
    ref = teacher_of(params, inputs, dataclasses.replace(cfg, sliding_window=17))
    torch.testing.assert_close(T, ref, rtol=0, atol=1e-15)
    assert torch.isfinite(indexer_loss(params, inputs, cfg, "float64"))


def test_window_logits_are_banded():
    """u is [B, H, S, n]: n keys per query, with MASK where s - t < 0."""
    tq = torch.randn(1, 6, 2, 4, dtype=torch.float64)
    twkv = torch.randn(1, 6, 4, dtype=torch.float64)
    seg = torch.ones(1, 6, dtype=torch.int64)
    u = reference.window_logits(tq, twkv, seg, 3)
    assert tuple(u.shape) == (1, 2, 6, 3)
    for s in range(6):
        for t in range(3):
            if s - t < 0:
                assert u[0, 0, s, t] < -1e37
            else:
                assert abs(float(u[0, 1, s, t] - tq[0, s, 1] @ twkv[0, s - t])) < 1e-14


def test_teacher_inputs_are_rounded_to_dtype_and_give_zero_grads():
    cfg = cfg_of(SMALL, sliding_window=6)
    params, inputs = make_params(cfg), joint_inputs(cfg, 2, 64, docs=[30, 34])
    inputs["attention_sink"][2] = -np.inf
    for dtype in ("float32", "bfloat16"):
        loss, pg, ig = indexer_loss_and_grads(params, inputs, cfg, dtype)
        assert torch.isfinite(loss)
        assert set(ig) == {"hidden_states", "q_latent", "teacher_query", "teacher_kv",
                           "teacher_window_kv", "attention_sink"}
        for name, g in ig.items():
            assert g.shape == tuple(inputs[name].shape)
            assert torch.count_nonzero(g) == 0, name
        for g in pg.values():
            assert torch.isfinite(g).all() and g.abs().max() > 0
    # bfloat16 rounds the sink and window keys first: feeding the rounded values changes nothing.
    rounded = dict(inputs)
    for name in ("teacher_window_kv", "attention_sink"):
        rounded[name] = torch.from_numpy(inputs[name]).to(torch.bfloat16).float().numpy()
    assert float(indexer_loss(params, rounded, cfg, "bfloat16")) == \
        float(indexer_loss(params, inputs, cfg, "bfloat16"))


# --------------------------------------------------------------------------- YaRN


def numpy_yarn_inv_freq(d, theta, f, L0, beta_fast, beta_slow):
    """SPEC §6 in numpy, written separately from the reference."""
    def corr(beta):
        return d * np.log(L0 / (2 * np.pi * beta)) / (2 * np.log(theta))
    low = max(np.floor(corr(beta_fast)), 0.0)
    high = min(np.ceil(corr(beta_slow)), d - 1.0)
    if low == high:
        high += 0.001
    out = np.empty(d // 2)
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        base = theta ** (-2.0 * i / d)
        out[i] = base * (1 - ramp) + base / f * ramp
    return out, (float(low), float(high))


def numpy_rope(x, pos, DI, DR, inv_freq):
    """Interleaved partial RoPE, one vector at a time: x [N, DI], pos [N]."""
    y = x.copy()
    for n in range(x.shape[0]):
        for i in range(DR // 2):
            ang = pos[n] * inv_freq[i]
            c0, c1 = DI - DR + 2 * i, DI - DR + 2 * i + 1
            x0, x1 = x[n, c0], x[n, c1]
            y[n, c0] = x0 * np.cos(ang) - x1 * np.sin(ang)
            y[n, c1] = x1 * np.cos(ang) + x0 * np.sin(ang)
    return y


def test_yarn_bounds_deepseek_v4():
    cfg = cfg_of(SMALL, index_head_dim=64, rope_head_dim=64, rope_scaling=V4_YARN)
    assert cfg.rope_theta == 160000.0
    assert yarn_bounds(cfg) == (15.0, 25.0)
    assert all(type(v) is float for v in yarn_bounds(cfg))


@pytest.mark.parametrize("d,theta,yarn,bounds", [
    (64, 160000.0, V4_YARN, (15.0, 25.0)),
    (16, 10000.0, dict(V4_YARN, factor=4.0, original_max_position=4096), (2.0, 6.0)),
    # low == high: both bounds clamp to 0, so high becomes 0.001
    (16, 10000.0, dict(V4_YARN, original_max_position=2, beta_fast=1, beta_slow=0.5), (0.0, 0.001)),
    # low == high at the top: both clamp to d - 1
    (16, 10000.0, dict(V4_YARN, original_max_position=2 ** 29, beta_fast=2, beta_slow=1),
     (15.0, 15.001)),
], ids=["v4", "mid", "low-eq-high-0", "low-eq-high-top"])
def test_yarn_inv_freq_matches_spec_in_numpy(d, theta, yarn, bounds):
    cfg = cfg_of(SMALL, index_head_dim=max(d, 32), rope_head_dim=d, rope_theta=theta,
                 rope_scaling=yarn)
    want, want_bounds = numpy_yarn_inv_freq(d, theta, yarn["factor"], yarn["original_max_position"],
                                            yarn["beta_fast"], yarn["beta_slow"])
    assert want_bounds == bounds
    assert yarn_bounds(cfg) == bounds
    got = reference.inv_freq(cfg, torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-15, atol=0)
    # The rotation uses them: RoPE of random vectors at large positions.
    rng = np.random.default_rng(0)
    DI = cfg.index_head_dim
    x = rng.standard_normal((12, DI))
    pos = rng.integers(0, 200000, 12)
    out = reference.rope(torch.from_numpy(x), torch.from_numpy(pos), cfg,
                         torch.float64, torch.float64)
    torch.testing.assert_close(out, torch.from_numpy(numpy_rope(x, pos, DI, d, want)),
                               rtol=1e-10, atol=1e-10)


def test_yarn_changes_only_the_slow_pairs_and_never_scales():
    cfg = cfg_of(SMALL, index_head_dim=64, rope_head_dim=64, rope_scaling=V4_YARN)
    plain = reference.inv_freq(dataclasses.replace(cfg, rope_scaling=None), torch.float64)
    yarn = reference.inv_freq(cfg, torch.float64)
    assert torch.equal(yarn[:16], plain[:16])  # i <= low = 15: ramp 0
    torch.testing.assert_close(yarn[25:], plain[25:] / 16, rtol=1e-15, atol=0)  # ramp 1
    assert (yarn[16:25] < plain[16:25]).all() and (yarn[16:25] > plain[16:25] / 16).all()
    # No mscale: a rotation keeps each pair's norm.
    x = torch.randn(5, 64, dtype=torch.float64)
    y = reference.rope(x, torch.arange(5) * 1000, cfg, torch.float64, torch.float64)
    torch.testing.assert_close(y.reshape(5, 32, 2).norm(dim=-1), x.reshape(5, 32, 2).norm(dim=-1),
                               rtol=1e-14, atol=0)
    # factor 1: the plain frequencies (to rounding), and the whole forward agrees.
    one = dataclasses.replace(cfg, rope_scaling=dict(V4_YARN, factor=1))
    torch.testing.assert_close(reference.inv_freq(one, torch.float64), plain, rtol=1e-15, atol=0)
    small = cfg_of(SMALL)
    params, inputs = make_params(small), make_inputs(small, 1, 32)
    a = indexer_forward(params, inputs, small, "float64")["index_scores"]
    b = indexer_forward(params, inputs, dataclasses.replace(small, rope_scaling=dict(V4_YARN, factor=1)),
                        "float64")["index_scores"]
    c = indexer_forward(params, inputs, dataclasses.replace(small, rope_scaling=V4_YARN),
                        "float64")["index_scores"]
    fin = torch.isfinite(a)
    torch.testing.assert_close(b[fin], a[fin], rtol=1e-12, atol=1e-12)
    assert (c[fin] - a[fin]).abs().max() > 1e-6


def _old_rope(x, pos, cfg, dtype, wide):
    """The reference's RoPE as it was before YaRN (the None path must stay this, bit for bit)."""
    DI, DR = cfg.index_head_dim, cfg.rope_head_dim
    xw = x.to(wide)
    x_pass, x_rot = xw[..., : DI - DR], xw[..., DI - DR:]
    i = torch.arange(DR // 2, dtype=wide)
    inv_freq = torch.pow(torch.tensor(cfg.rope_theta, dtype=wide), -(2.0 * i) / DR)
    angle = pos.to(wide)[..., None] * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    pairs = x_rot.reshape(*x_rot.shape[:-1], DR // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).reshape(x_rot.shape)
    return torch.cat([x_pass, rotated], dim=-1).to(dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_rope_scaling_none_is_plain_rope_bit_for_bit(dtype):
    cfg = cfg_of(SMALL)
    assert cfg.rope_scaling is None
    dt, wide = {"float64": (torch.float64, torch.float64), "float32": (torch.float32, torch.float32),
                "bfloat16": (torch.bfloat16, torch.float32)}[dtype]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 10, cfg.index_head_dim))
    pos = rng.integers(0, 5000, (3, 10))
    xt, pt = torch.from_numpy(x).to(dt), torch.from_numpy(pos)
    got = reference.rope(xt, pt, cfg, dt, wide)
    assert torch.equal(got, _old_rope(xt, pt, cfg, dt, wide))
    plain_freq = cfg.rope_theta ** (-2.0 * np.arange(cfg.rope_head_dim // 2) / cfg.rope_head_dim)
    assert np.array_equal(reference.inv_freq(cfg, torch.float64).numpy(), plain_freq)
    if dtype == "float64":  # a plain numpy RoPE: same frequencies bit for bit, same rotation
        want = numpy_rope(x.reshape(30, -1), pos.reshape(30), cfg.index_head_dim,
                          cfg.rope_head_dim, plain_freq).reshape(x.shape)
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-14, atol=1e-14)


# --------------------------------------------------------------------------- config


# Every rule of the three new fields and its exact message: error_catalogue.CONFIG_ERRORS,
# run on this side by tests/test_torch_ref.py and on the jax side by tests/test_bad_inputs.py.


def test_new_config_fields_defaults_order_and_round_trip():
    names = [f.name for f in dataclasses.fields(CSAConfig)]
    assert names[names.index("loss_scale") + 1:] == ["sliding_window", "teacher_normaliser",
                                                     "rope_scaling", "index_quant", "scoring_backend"]
    cfg = cfg_of(SMALL)
    assert (cfg.sliding_window, cfg.teacher_normaliser, cfg.rope_scaling) == (0, "joint", None)
    source = dict(V4_YARN, factor=16.0)
    cfg = cfg_of(SMALL, sliding_window=128, teacher_normaliser="compressed",
                 rope_scaling=types.MappingProxyType(source))
    assert type(cfg.rope_scaling) is dict and cfg.rope_scaling["factor"] == 16.0
    source["factor"] = 2.0  # a copy: the config does not follow its source
    assert cfg.rope_scaling["factor"] == 16.0
    d = cfg.to_dict()
    assert list(d) == names and type(d["rope_scaling"]) is dict
    assert d["rope_scaling"] == dict(V4_YARN, factor=16.0)
    d["rope_scaling"]["factor"] = 3.0  # to_dict hands out a copy too
    assert cfg.rope_scaling["factor"] == 16.0
    back = CSAConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)
    assert cfg_of(SMALL).to_dict()["rope_scaling"] is None
    assert cfg != dataclasses.replace(cfg, rope_scaling=dict(V4_YARN, factor=8))
    cfg_of(SMALL, rope_scaling=dict(V4_YARN, factor=1, beta_fast=1.5, beta_slow=1e-3))  # edges ok
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sliding_window = 3  # type: ignore[misc]
    # index_quant: a plain copy too, round-tripping through JSON, compared by value.
    quant = {"format": "e2m1", "block": 8, "hadamard": True}
    cfg = cfg_of(SMALL, index_quant=types.MappingProxyType(quant))
    assert type(cfg.index_quant) is dict and cfg.to_dict()["index_quant"] == quant
    assert CSAConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg != dataclasses.replace(cfg, index_quant=dict(quant, block=16))
    assert cfg_of(SMALL).to_dict()["index_quant"] is None


# --------------------------------------------------------------------------- input rules


def _joint(**over):
    return cfg_of(SMALL, **over)


def _run(inputs, cfg):
    params = make_params(cfg)
    return indexer_loss_and_grads(params, inputs, cfg, "float32")


# The rules of the two new inputs: error_catalogue.TEACHER_INPUT_ERRORS (the jax side runs them
# in tests/test_bad_inputs.py).


@pytest.mark.parametrize("over,mutate,message", TEACHER_INPUT_ERRORS,
                         ids=[m for _, _, m in TEACHER_INPUT_ERRORS])
def test_new_input_rule_is_rejected_with_exact_message(over, mutate, message):
    cfg = _joint(**over)
    inputs = joint_inputs(cfg, 2, 64)
    mutate(inputs, {})
    with pytest.raises(ValueError) as e:
        _run(inputs, cfg)
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        validate_inputs(inputs, cfg)
    assert str(e.value) == message


def test_joint_inputs_are_required_only_by_the_loss_and_only_when_used():
    cfg = _joint()  # joint, no window: the sink only
    inputs = joint_inputs(cfg, 2, 64)
    no_window = dict(inputs)
    del no_window["teacher_window_kv"]
    loss, _, ig = _run(no_window, cfg)
    assert torch.isfinite(loss) and "teacher_window_kv" not in ig
    # Present but unused: ignored, not checked (a NaN window under sliding_window = 0).
    unused = dict(inputs, teacher_window_kv=np.full((2, 64, 32), np.nan, np.float32))
    assert float(indexer_loss(make_params(cfg), unused, cfg, "float64")) == \
        float(indexer_loss(make_params(cfg), no_window, cfg, "float64"))
    # compressed: neither is required, and present ones are ignored.
    comp = _joint(sliding_window=4, teacher_normaliser="compressed")
    bare = {k: v for k, v in inputs.items() if k not in ("teacher_window_kv", "attention_sink")}
    ref = float(indexer_loss(make_params(comp), bare, comp, "float64"))
    junk = dict(bare, attention_sink=np.array([np.nan] * 3, np.float32),
                teacher_window_kv=np.full((2, 5, 32), np.inf, np.float32))
    assert float(indexer_loss(make_params(comp), junk, comp, "float64")) == ref
    # The forward pass needs neither (nor checks them), in any mode.
    windowed = _joint(sliding_window=4)
    for c in (cfg, windowed, comp):
        indexer_forward(make_params(c), bare, c, "float32")
        indexer_forward(make_params(c), junk, c, "float32")
    with pytest.raises(ValueError, match=r"^missing input 'teacher_window_kv'$"):
        indexer_loss(make_params(windowed), dict(bare, attention_sink=inputs["attention_sink"]),
                     windowed, "float32")


def test_sink_minus_inf_is_accepted_and_means_no_sink():
    cfg = _joint(sliding_window=3)
    params = make_params(cfg)
    inputs = joint_inputs(cfg, 2, 64)
    inputs["attention_sink"][[0, 5]] = -np.inf
    validate_inputs(inputs, cfg)
    loss, _, _ = _run(inputs, cfg)
    assert torch.isfinite(loss)
    everywhere = dict(inputs, attention_sink=np.full(8, -np.inf, np.float32))
    T = teacher_of(params, everywhere, cfg)
    assert torch.isfinite(T).all()
    # -inf means the head's sink takes no mass: a very negative finite sink is the same.
    far = dict(inputs, attention_sink=np.full(8, -1e4, np.float32))
    torch.testing.assert_close(T, teacher_of(params, far, cfg), rtol=0, atol=1e-15)

"""Unit tests of the torch reference (torch_ref): config rules, input checks, and
the math of SPEC §5-8 checked against finite differences, an independent loop
implementation, symmetries and edge cases. Torch and numpy only."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from needs import skip_module_without_torch

skip_module_without_torch()

import torch  # noqa: E402

from torch_ref import (  # noqa: E402
    DTYPES,
    CSAConfig,
    indexer_forward,
    indexer_loss,
    indexer_loss_and_grads,
    resolve_dtype,
    validate_inputs,
)

from error_catalogue import (  # noqa: E402
    CONFIG_ERRORS,
    INPUT_ERRORS,
    PARAMS,
    SMALL,
    TINY,
    make_inputs,
    make_params,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: intra-op threads only add contention (10x slower on a busy
    2-core machine). Restored afterwards so other test modules keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cfg_of(base=SMALL, **over) -> CSAConfig:
    return CSAConfig(**{**base, **over})


@pytest.mark.parametrize("over,message", CONFIG_ERRORS, ids=[m for _, m in CONFIG_ERRORS])
def test_config_rule_is_rejected_with_exact_message(over, message):
    with pytest.raises(ValueError) as e:
        cfg_of(**over)
    assert str(e.value) == message


def test_config_accepts_valid_chunks_and_round_trips():
    cfg = cfg_of(indexer_head_chunk=4, loss_head_chunk=8, sparse_loss=True, loss_scale=-2,
                 rope_head_dim=0, rope_theta=10000)
    d = cfg.to_dict()
    assert list(d) == [f.name for f in dataclasses.fields(CSAConfig)]
    assert CSAConfig.from_dict(d) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.emb_dim = 3  # type: ignore[misc]


def test_from_dict_unknown_and_missing_keys():
    valid = ", ".join(f.name for f in dataclasses.fields(CSAConfig))
    with pytest.raises(ValueError) as e:
        CSAConfig.from_dict({**SMALL, "foo": 1})
    assert str(e.value) == f"unknown config field 'foo' (valid: {valid})"
    d = dict(SMALL)
    del d["emb_dim"]
    with pytest.raises(ValueError) as e:
        CSAConfig.from_dict(d)
    assert str(e.value) == "missing config field 'emb_dim'"


def test_dtype_names():
    assert DTYPES == ("float32", "bfloat16", "float16", "float64")
    assert resolve_dtype("bfloat16") == (torch.bfloat16, torch.float32)
    assert resolve_dtype("float64") == (torch.float64, torch.float64)
    with pytest.raises(ValueError) as e:
        resolve_dtype("int8")
    assert str(e.value) == \
        "dtype='int8' is not supported (valid: float32, bfloat16, float16, float64)"
    cfg = cfg_of()
    with pytest.raises(ValueError, match=r"^dtype='float8' is not supported"):
        indexer_forward(make_params(cfg), make_inputs(cfg, 1, 8), cfg, "float8")


@pytest.mark.parametrize("mutate,message", INPUT_ERRORS, ids=[m for _, m in INPUT_ERRORS])
def test_bad_input_is_rejected_with_exact_message(mutate, message):
    cfg = cfg_of()
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    mutate(inputs, params)
    with pytest.raises(ValueError) as e:
        indexer_loss_and_grads(params, inputs, cfg, "float32")
    assert str(e.value) == message


def test_checks_run_dtype_then_params_then_inputs_in_phases():
    cfg = cfg_of()
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    params["indexer.ape"] = params["indexer.ape"][:1]
    inputs["q_latent"] = inputs["q_latent"][:1]
    del inputs["segment_ids"]
    with pytest.raises(ValueError, match="^dtype='fp8' is not supported"):
        indexer_forward(params, inputs, cfg, "fp8")
    with pytest.raises(ValueError, match=r"^params\['indexer.ape'\] has shape \(1, 64\)"):
        indexer_forward(params, inputs, cfg, "float32")
    with pytest.raises(ValueError, match="^missing input 'segment_ids'$"):
        validate_inputs(inputs, cfg)
    inputs["segment_ids"] = np.ones((2, 64), np.float32)  # a dtype fault after a shape fault
    with pytest.raises(ValueError, match=r"^inputs\['q_latent'\] has shape \(1, 64, 32\)"):
        validate_inputs(inputs, cfg)


def test_validation_accepts_packed_rows_and_forward_needs_no_teacher():
    cfg = cfg_of()
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64, docs=[20, 44])
    validate_inputs(inputs, cfg)  # positions restart at a new document: fine
    del inputs["teacher_query"], inputs["teacher_kv"]
    indexer_forward(params, inputs, cfg, "float32")
    with pytest.raises(ValueError, match="^missing input 'teacher_query'$"):
        indexer_loss(params, inputs, cfg, "float32")


def test_bad_selection_is_rejected_in_sparse_mode_only():
    cfg = cfg_of(sparse_loss=True)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    bad = np.zeros((2, 64, 3), np.int64)
    with pytest.raises(ValueError) as e:
        indexer_loss(params, inputs, cfg, "float32", selection=bad)
    assert str(e.value) == ("selection has shape (2, 64, 3) and dtype int64; "
                            "expected integer [B, S, k_eff] = [2, 64, 4]")
    with pytest.raises(ValueError) as e:
        indexer_loss(params, inputs, cfg, "float32", selection=bad[..., :1].repeat(4, -1) * 0.5)
    assert str(e.value) == ("selection has shape (2, 64, 4) and dtype float64; "
                            "expected integer [B, S, k_eff] = [2, 64, 4]")
    bad = np.zeros((2, 64, 4), np.int64)
    bad[1, 2, 3] = 16
    with pytest.raises(ValueError) as e:
        indexer_loss(params, inputs, cfg, "float32", selection=bad)
    assert str(e.value) == \
        "selection has value 16 at index (1, 2, 3); expected -1 <= value < W = 16"
    indexer_loss(params, inputs, dataclasses.replace(cfg, sparse_loss=False), "float32",
                 selection=bad)  # ignored in dense mode


# ---------------------------------------------------------------- independent loop oracle


def loop_reference(params, inputs, cfg: CSAConfig, b: int):
    """SPEC §5-8 in float64 numpy loops, one batch row, dense loss. Written separately from
    torch_ref.reference on purpose: a second reading of the same text. The teacher is the
    joint one (one softmax per head over the sink, the window tokens and the valid blocks) or,
    with teacher_normaliser "compressed", each head's softmax over the valid blocks alone;
    RoPE takes YaRN's frequencies when rope_scaling is set."""
    P = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(inputs["hidden_states"], np.float64)[b]
    ql = np.asarray(inputs["q_latent"], np.float64)[b]
    pos = np.asarray(inputs["position_ids"])[b]
    seg = np.asarray(inputs["segment_ids"])[b]
    tq = np.asarray(inputs["teacher_query"], np.float64)[b]
    tkv = np.asarray(inputs["teacher_kv"], np.float64)[b]
    twkv = np.asarray(inputs["teacher_window_kv"], np.float64)[b]
    sink = np.asarray(inputs["attention_sink"], np.float64)
    S = x.shape[0]
    m, DI, DR, HI = cfg.compress_ratio, cfg.index_head_dim, cfg.rope_head_dim, cfg.index_n_heads
    W = S // m

    def freq(i):
        base = cfg.rope_theta ** (-2.0 * i / DR)
        ys = cfg.rope_scaling
        if ys is None:
            return base

        def corr(beta):
            return DR * math.log(ys["original_max_position"] / (2 * math.pi * beta)) \
                / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(corr(ys["beta_fast"])), 0)
        high = min(math.ceil(corr(ys["beta_slow"])), DR - 1)
        if low == high:
            high += 0.001
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        return base * (1 - ramp) + base / ys["factor"] * ramp

    def rope_vec(v, p):
        v = v.copy()
        for i in range(DR // 2):
            ang = p * freq(i)
            c0, c1 = DI - DR + 2 * i, DI - DR + 2 * i + 1
            v0, v1 = v[c0], v[c1]
            cos, sin = math.cos(ang), math.sin(ang)
            v[c0], v[c1] = v0 * cos - v1 * sin, v1 * cos + v0 * sin
        return v

    kv, gate = x @ P["indexer.wkv"], x @ P["indexer.wgate"]
    K = np.zeros((W, DI))
    for w in range(W):
        pooled = np.zeros(DI)
        for c in range(DI):
            slots = []  # (kv, gate)
            if w > 0 and pos[w * m] == pos[(w - 1) * m] + m:
                for t in range(m):
                    tok = (w - 1) * m + t
                    slots.append((kv[tok, c], gate[tok, c] + P["indexer.ape"][t, c]))
            for t in range(m):
                tok = w * m + t
                slots.append((kv[tok, DI + c], gate[tok, DI + c] + P["indexer.ape"][t, DI + c]))
            g = np.array([s[1] for s in slots])
            e = np.exp(g - g.max())
            pooled[c] = sum(s[0] * wt for s, wt in zip(slots, e / e.sum()))
        normed = P["indexer.kv_norm"] * pooled / math.sqrt(np.mean(pooled ** 2) + cfg.norm_eps)
        K[w] = rope_vec(normed, pos[w * m])

    q = (ql @ P["indexer.wq_b"]).reshape(S, HI, DI)
    hw = (x @ P["indexer.weights_proj"]) * HI ** -0.5
    score = np.full((S, W), -np.inf)
    for s in range(S):
        for j in range(W):
            if pos[j * m] + m <= pos[s] + 1 and all(seg[j * m + t] == seg[s] for t in range(m)):
                score[s, j] = sum(hw[s, h] * max(rope_vec(q[s, h], pos[s]) @ K[j], 0.0)
                                  for h in range(HI)) * DI ** -0.5

    joint = cfg.teacher_normaliser == "joint"
    kls, count = [], 0
    for s in range(S):
        valid = np.isfinite(score[s])
        if not valid.any():
            continue
        count += 1
        window = [r for r in range(S) if s - cfg.sliding_window < r <= s and seg[r] == seg[s]]
        T = np.zeros(W)
        for h in range(cfg.num_query_heads):
            a = {j: tq[s, h] @ tkv[j] for j in range(W) if valid[j]}
            logits = list(a.values())
            if joint:
                logits += [tq[s, h] @ twkv[r] for r in window] + [sink[h]]
            top = max(logits)
            L = top + math.log(sum(math.exp(v - top) for v in logits))
            for j, v in a.items():
                T[j] += math.exp(v - L)
        T = T / (T.sum() + 1e-8)
        z = score[s][valid]
        log_p = z - (z.max() + math.log(np.exp(z - z.max()).sum()))
        Tv = T[valid]
        kls.append(sum(t * (math.log(t + 1e-8) - lp) for t, lp in zip(Tv, log_p) if t > 0))
    return K, score, sum(kls), count


# A YaRN whose ramp turns pair 1 of the 4 rotated channels at these short lengths:
# corr(2) = 0.10 -> low 0, corr(0.5) = 0.71 -> high 1 (theta 100, DR 4, L0 16).
SHORT_YARN = {"type": "yarn", "factor": 4.0, "original_max_position": 16,
              "beta_fast": 2.0, "beta_slow": 0.5}


@pytest.mark.parametrize("over", [
    dict(),  # the default: the joint teacher, no window (the sink alone joins the blocks)
    dict(sliding_window=3),  # a window that crosses the document boundary at 5
    dict(sliding_window=1),  # the query's own token only
    dict(sliding_window=40),  # wider than the sequence: every earlier token of the document
    dict(sliding_window=3, teacher_normaliser="compressed"),  # window and sink ignored
    dict(teacher_normaliser="compressed"),
    dict(sliding_window=3, rope_scaling=SHORT_YARN),
], ids=["joint-no-window", "joint-window-3", "joint-window-1", "joint-window-wide",
        "compressed-window-3", "compressed", "joint-window-3-yarn"])
@pytest.mark.parametrize("no_sink_head", [False, True], ids=["sinks", "head-1-no-sink"])
def test_matches_independent_loop_implementation_in_float64(over, no_sink_head):
    cfg = cfg_of(TINY, rope_theta=100.0, **over)
    params, inputs = make_params(cfg, 3), make_inputs(cfg, 2, 18, seed=4, docs=[5, 13])
    if no_sink_head:  # a sink of -inf: that head has no sink
        inputs["attention_sink"] = inputs["attention_sink"].copy()
        inputs["attention_sink"][1] = -np.inf
    out = indexer_forward(params, inputs, cfg, "float64")
    total, count = 0.0, 0
    for b in range(2):
        K, score, kl, n = loop_reference(params, inputs, cfg, b)
        torch.testing.assert_close(out["compressed_keys"][b], torch.from_numpy(K),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["index_scores"][b], torch.from_numpy(score),
                                   rtol=1e-12, atol=1e-12)
        total, count = total + kl, count + n
    loss = indexer_loss(params, inputs, cfg, "float64")
    assert loss.dtype == torch.float64
    assert abs(float(loss) - total / count) <= 1e-12 * abs(total / count)


def test_loop_teachers_differ_and_meet_without_window_and_sink():
    """The loop's two teachers are not the same function (the checks above would not tell
    them apart otherwise), and SPEC §8's identity holds: with no window and every sink -inf,
    the joint teacher is the compressed one."""
    cfg = cfg_of(TINY, rope_theta=100.0, sliding_window=3)
    params, inputs = make_params(cfg, 3), make_inputs(cfg, 2, 18, seed=4, docs=[5, 13])
    compressed = dataclasses.replace(cfg, teacher_normaliser="compressed")
    kl_joint = sum(loop_reference(params, inputs, cfg, b)[2] for b in range(2))
    kl_compressed = sum(loop_reference(params, inputs, compressed, b)[2] for b in range(2))
    assert abs(kl_joint - kl_compressed) > 1e-3 * abs(kl_compressed)
    bare = dataclasses.replace(cfg, sliding_window=0)
    no_sink = dict(inputs, attention_sink=np.full_like(inputs["attention_sink"], -np.inf))
    kl_bare = sum(loop_reference(params, no_sink, bare, b)[2] for b in range(2))
    assert abs(kl_bare - kl_compressed) <= 1e-12 * abs(kl_compressed)
    want = float(indexer_loss(params, inputs, compressed, "float64"))
    assert abs(float(indexer_loss(params, no_sink, bare, "float64")) - want) <= 1e-12 * abs(want)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_float64_param_grads_match_central_differences(sparse):
    cfg = cfg_of(TINY, sparse_loss=sparse)
    params = {k: torch.from_numpy(v).double() for k, v in make_params(cfg, 5).items()}
    inputs = make_inputs(cfg, 1, 16, seed=6)
    # Fix the selection so the discrete top-k cannot flip under the perturbation.
    selection = indexer_forward(params, inputs, cfg, "float64")["topk_indices"]
    loss, grads, _ = indexer_loss_and_grads(params, inputs, cfg, "float64", selection=selection)
    assert float(loss) > 1e-3
    h = 1e-5

    def central_difference(name, direction):
        vals = [float(indexer_loss({**params, name: params[name] + sign * h * direction},
                                   inputs, cfg, "float64", selection=selection))
                for sign in (1.0, -1.0)]
        return (vals[0] - vals[1]) / (2 * h)

    rng = torch.Generator().manual_seed(8)
    for name in PARAMS:
        g = grads[name]
        assert g.dtype == torch.float64 and g.abs().max() > 0
        # Directional derivatives along random unit directions: any wrong entry shows.
        for _ in range(3):
            v = torch.randn(g.shape, generator=rng, dtype=torch.float64)
            v /= v.norm()
            fd, an = central_difference(name, v), float((g * v).sum())
            assert abs(fd - an) <= 1e-9 + 1e-6 * abs(an), (name, fd, an)
    # Entry by entry for the small parameters, so a failure points at the element.
    for name in ("indexer.kv_norm", "indexer.weights_proj"):
        fd = torch.zeros_like(params[name])
        for i in range(fd.numel()):
            e = torch.zeros_like(fd)
            e.view(-1)[i] = 1.0
            fd.view(-1)[i] = central_difference(name, e)
        torch.testing.assert_close(grads[name], fd, rtol=1e-6, atol=1e-9,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("teacher", [dict(sliding_window=5), dict(), dict(teacher_normaliser="compressed")],
                         ids=["joint-window", "joint-sink-only", "compressed"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gradient_reaches_params_only(sparse, dtype, teacher):
    cfg = cfg_of(sparse_loss=sparse, **teacher)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64, docs=[30, 34])
    loss, pg, ig = indexer_loss_and_grads(params, inputs, cfg, dtype)
    assert set(pg) == set(PARAMS)
    # docs/plugins.md: a gradient, 0, for each float input the loss reads: all six under the joint
    # teacher with a window, the sink but not the window keys without one; the compressed
    # teacher reads neither joint input (given, ignored).
    reads = {"hidden_states", "q_latent", "teacher_query", "teacher_kv"}
    if cfg.teacher_normaliser == "joint":
        reads |= {"attention_sink"} | ({"teacher_window_kv"} if cfg.sliding_window else set())
    assert set(ig) == reads, sorted(ig)
    for name, g in ig.items():
        assert g.shape == tuple(inputs[name].shape)
        assert torch.count_nonzero(g) == 0, name
    for name, g in pg.items():
        assert g.shape == tuple(params[name].shape)
        assert torch.isfinite(g).all() and g.abs().max() > 0, name


# --------------------------------------------------------------------------- symmetries and edges


@pytest.mark.parametrize("window", [0, 5])
def test_head_permutation_invariance_float64(window):
    cfg = cfg_of(sliding_window=window)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    HI, DI, H = cfg.index_n_heads, cfg.index_head_dim, cfg.num_query_heads
    rng = np.random.default_rng(7)
    perm_i, perm_t = rng.permutation(HI), rng.permutation(H)
    pp = dict(params)
    pp["indexer.wq_b"] = params["indexer.wq_b"].reshape(-1, HI, DI)[:, perm_i].reshape(-1, HI * DI)
    pp["indexer.weights_proj"] = params["indexer.weights_proj"][:, perm_i]
    pi = dict(inputs)
    pi["teacher_query"] = inputs["teacher_query"][:, :, perm_t]
    pi["attention_sink"] = inputs["attention_sink"][perm_t]  # a head's sink moves with it
    a, b = indexer_forward(params, inputs, cfg, "float64"), indexer_forward(pp, pi, cfg, "float64")
    assert torch.equal(torch.isinf(a["index_scores"]), torch.isinf(b["index_scores"]))
    torch.testing.assert_close(a["index_scores"], b["index_scores"], rtol=1e-12, atol=1e-12)
    for sparse in (False, True):
        for teacher in ("joint", "compressed"):
            c = dataclasses.replace(cfg, sparse_loss=sparse, teacher_normaliser=teacher)
            la, lb = indexer_loss(params, inputs, c, "float64"), indexer_loss(pp, pi, c, "float64")
            assert abs(float(la) - float(lb)) <= 1e-12 * abs(float(la)), (sparse, teacher)
    # The sink is per head: left unpermuted, it pairs heads with other heads' sinks.
    stale = dict(pi, attention_sink=inputs["attention_sink"])
    la, lb = indexer_loss(params, inputs, cfg, "float64"), indexer_loss(pp, stale, cfg, "float64")
    assert abs(float(la) - float(lb)) > 1e-6 * abs(float(la))


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_compressed_blocks_when_S_below_ratio(dtype):
    cfg = cfg_of(TINY)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 3)
    assert inputs["teacher_kv"].shape == (2, 0, 8)
    out = indexer_forward(params, inputs, cfg, dtype)
    assert tuple(out["compressed_keys"].shape) == (2, 0, 8)
    assert tuple(out["index_scores"].shape) == (2, 3, 0)
    assert tuple(out["topk_indices"].shape) == (2, 3, 0)
    assert out["topk_indices"].dtype == torch.int64
    for sparse in (False, True):
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        loss, pg, ig = indexer_loss_and_grads(params, inputs, c, dtype)
        assert float(loss) == 0.0 and float(indexer_loss(params, inputs, c, dtype)) == 0.0
        for g in list(pg.values()) + list(ig.values()):
            assert torch.count_nonzero(g) == 0


def test_trailing_tokens_beyond_last_block_are_queries_not_keys():
    cfg = cfg_of(TINY)
    params, inputs = make_params(cfg), make_inputs(cfg, 1, 18)  # W = 4, U = 16
    out = indexer_forward(params, inputs, cfg, "float64")
    assert tuple(out["index_scores"].shape) == (1, 18, 4)
    assert torch.isfinite(out["index_scores"][0, 17]).all()  # the last query sees every block
    changed = dict(inputs)
    changed["hidden_states"] = inputs["hidden_states"].copy()
    changed["hidden_states"][:, 16:] += 1.0
    other = indexer_forward(params, changed, cfg, "float64")
    assert torch.equal(out["compressed_keys"], other["compressed_keys"])
    assert torch.equal(out["index_scores"][:, :16], other["index_scores"][:, :16])
    assert not torch.equal(out["index_scores"][:, 16:], other["index_scores"][:, 16:])


def test_topk_larger_than_block_count():
    cfg = cfg_of(TINY, index_topk=10)
    params, inputs = make_params(cfg), make_inputs(cfg, 1, 16)  # W = 4
    out = indexer_forward(params, inputs, cfg, "float64")
    topk = out["topk_indices"][0]
    assert tuple(topk.shape) == (16, 4)
    for s in range(16):
        n_valid = (s + 1) // 4  # blocks wholly in the past of position s
        assert sorted(topk[s].tolist()) == [-1] * (4 - n_valid) + list(range(n_valid))
    for sparse in (False, True):  # every valid block picked: sparse loss == dense loss
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        assert torch.isfinite(indexer_loss(params, inputs, c, "float64"))
    dense = indexer_loss(params, inputs, cfg, "float64")
    sparse = indexer_loss(params, inputs, dataclasses.replace(cfg, sparse_loss=True), "float64")
    assert abs(float(dense) - float(sparse)) <= 1e-14


def test_topk_picks_the_best_valid_blocks_and_sparse_selection_is_used():
    cfg = cfg_of(sparse_loss=True)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    out = indexer_forward(params, inputs, cfg, "float64")
    scores, topk = out["index_scores"], out["topk_indices"]
    kth = torch.where(topk >= 0, torch.gather(scores, -1, topk.clamp(min=0)),
                      torch.tensor(float("inf"), dtype=torch.float64)).amin(-1)
    n_valid = torch.isfinite(scores).sum(-1)
    assert torch.equal((topk >= 0).sum(-1), n_valid.clamp(max=4))
    picked = (topk[..., None] == torch.arange(16)).any(-2)  # -1 matches nothing
    unpicked = torch.where(picked | ~torch.isfinite(scores), -torch.inf, scores).amax(-1)
    assert (unpicked <= kth).all()
    own = indexer_loss(params, inputs, cfg, "float64")
    assert float(indexer_loss(params, inputs, cfg, "float64", selection=topk)) == float(own)
    shifted = torch.where(topk >= 0, (topk + 1) % 16, topk)
    assert float(indexer_loss(params, inputs, cfg, "float64", selection=shifted)) != float(own)


def test_packed_documents_never_see_each_other():
    cfg = cfg_of(TINY)
    params = make_params(cfg)
    packed = make_inputs(cfg, 1, 16, docs=[8, 8])
    out = indexer_forward(params, packed, cfg, "float64")
    scores = out["index_scores"][0]
    assert torch.isinf(scores[8:, :2]).all()  # doc 2's queries never see doc 1's blocks
    assert torch.isinf(scores[:8, 2:]).all()
    assert (out["topk_indices"][0, 8:] != 0).all() and (out["topk_indices"][0, 8:] != 1).all()
    for lo in (0, 8):  # each document alone gives the same keys and scores
        alone = {k: v[:, lo:lo + 8] for k, v in packed.items()
                 if k not in ("teacher_kv", "attention_sink")}
        alone["teacher_kv"] = packed["teacher_kv"][:, lo // 4:lo // 4 + 2]
        alone["attention_sink"] = packed["attention_sink"]  # [H]: per head, not per token
        ref = indexer_forward(params, alone, cfg, "float64")
        bl = slice(lo // 4, lo // 4 + 2)
        torch.testing.assert_close(out["compressed_keys"][:, bl], ref["compressed_keys"],
                                   rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(out["index_scores"][:, lo:lo + 8, bl], ref["index_scores"],
                                   rtol=1e-13, atol=1e-13)


def test_packed_documents_never_share_the_teacher_window():
    """A window wider than a document stops at its start: the packed loss is the mean of the
    two documents' losses alone (each has 5 valid rows: s = 3..7 of its own positions)."""
    cfg = cfg_of(TINY, sliding_window=6)
    params = make_params(cfg)
    packed = make_inputs(cfg, 1, 16, docs=[8, 8])
    alone_losses = []
    for lo in (0, 8):
        alone = {k: v[:, lo:lo + 8] for k, v in packed.items()
                 if k not in ("teacher_kv", "attention_sink")}
        alone["teacher_kv"] = packed["teacher_kv"][:, lo // 4:lo // 4 + 2]
        alone["attention_sink"] = packed["attention_sink"]
        alone_losses.append(float(indexer_loss(params, alone, cfg, "float64")))
    want = sum(alone_losses) / 2
    got = float(indexer_loss(params, packed, cfg, "float64"))
    assert abs(got - want) <= 1e-13 * abs(want)
    # Not vacuous: the window moves the loss, and so would doc 1's window keys seen by doc 2.
    no_window = float(indexer_loss(params, packed, dataclasses.replace(cfg, sliding_window=0),
                                   "float64"))
    assert abs(no_window - want) > 1e-6 * abs(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_runs_finite_and_close_to_float64(dtype):
    cfg = cfg_of()
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64, docs=[21, 43])
    torch_dtype, wide = resolve_dtype(dtype)
    out = indexer_forward(params, inputs, cfg, dtype)
    oracle = indexer_forward(params, inputs, cfg, "float64")
    assert out["compressed_keys"].dtype == torch_dtype
    assert out["index_scores"].dtype == wide
    assert torch.equal(torch.isinf(out["index_scores"]), torch.isinf(oracle["index_scores"]))
    assert not torch.isnan(out["index_scores"]).any()
    assert (out["index_scores"] != torch.inf).all()
    tol = {"float64": 1e-12, "float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2}[dtype]
    fin = torch.isfinite(oracle["index_scores"])
    err = (out["index_scores"][fin].double() - oracle["index_scores"][fin]).abs().max()
    assert err <= tol * oracle["index_scores"][fin].abs().max()
    for sparse in (False, True):
        c = dataclasses.replace(cfg, sparse_loss=sparse)
        loss, pg, _ = indexer_loss_and_grads(params, inputs, c, dtype)
        ref = indexer_loss(params, inputs, c, "float64")
        assert loss.dtype == wide and loss.ndim == 0
        assert abs(float(loss) - float(ref)) <= tol * 10 * abs(float(ref)), (sparse, loss, ref)
        for g in pg.values():
            assert g.dtype == wide and torch.isfinite(g).all()

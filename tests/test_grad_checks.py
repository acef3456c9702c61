"""The derivatives, checked on their own.

1. `jax.test_util.check_grads` (finite differences in float64, reverse mode, orders 1 and 2)
   on the custom VJP of the scoring (`scoring.head_contribution`) and on the dense loss with
   respect to the six parameters, native and chunked. Forward mode is not checked: a
   `jax.custom_vjp` function has no JVP (the library only ever runs reverse mode).
   Settings: eps = 1e-6 (central differences in float64: truncation O(eps^2) ~ 1e-12,
   round-off ~ 1e-16 / eps = 1e-10), atol = rtol = 1e-5 (check_grads' float64 default; the
   checks compare one random projection, so the finite-difference error above sits 1e5x
   below it). Away from ReLU kinks: every logit q . K that the ReLU sees is asserted to be
   at least MARGIN = 1e-3 from 0 (measured at the points below: 0.0165 for the VJP, 0.0151
   for the loss), while a finite-difference step moves a logit by at most
   eps * (|dq| |K| + |q| |dK|) ~ 1e-6 * 10: no step crosses a kink.
2. The custom VJP against plain JAX autodiff of the same forward (`raw_scores(...,
   vjp="autodiff")`), at every chunk size (0 and every divisor of the heads), float32 and
   float64: gradients of <ct, scores> with respect to wq_b, the head weights and the keys.
   The two backward passes add the same products in another order: float64 1e-12 relative
   to the largest gradient element (measured worst: see GRAD_RTOL), float32 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_impl
from jax_impl import scoring
from jax_impl.rope import apply_rope

EPS = 1e-6
TOL = 1e-5
MARGIN = 1e-3
# custom VJP vs autodiff, max |diff| / max |autodiff grad|. Measured worst over the chunk sizes
# and gradients below: float64 3.5e-16, float32 4.4e-7 (the float32 bound leaves 23x room for
# another CPU's blocking; float64 the 1e-12 of harness.judging.tolerance.EXACT64).
GRAD_RTOL = {"float64": 1e-12, "float32": 1e-5}

TINY = dict(emb_dim=16, q_lora_rank=8, index_n_heads=4, index_head_dim=8, rope_head_dim=4,
            compress_ratio=2, index_topk=2, num_query_heads=2, head_dim=8)


def _kink_margin(logits):
    return float(jnp.min(jnp.abs(logits)))


def test_check_grads_on_the_custom_vjp_of_the_scoring():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 5, 3, 8)))  # [B, S, c, DI] float64
    keys = jnp.asarray(rng.standard_normal((2, 4, 8)))
    hw = jnp.asarray(rng.standard_normal((2, 5, 3)))
    margin = _kink_margin(jnp.einsum("bshd,bwd->bshw", q, keys))
    assert margin >= MARGIN, f"a logit sits {margin:.2e} from the ReLU kink: pick another point"
    assert q.dtype == jnp.float64
    # jitted: check_grads evaluates it and its VJP at several points of one shape (trace once)
    check_grads(jax.jit(scoring.head_contribution), (q, keys, hw), order=2, modes=("rev",), atol=TOL, rtol=TOL,
                eps=EPS)
    # the check can fail: a wrong backward (dK dropped) is caught at order 1
    broken = jax.custom_vjp(scoring.head_contribution_autodiff)
    broken.defvjp(lambda q, k, h: (scoring.head_contribution_autodiff(q, k, h), (q, k, h)),
                  lambda res, g: (*jax.vjp(scoring.head_contribution_autodiff, *res)[1](g)[:1],
                                  jnp.zeros_like(res[1]), jax.vjp(scoring.head_contribution_autodiff, *res)[1](g)[2]))
    with pytest.raises(AssertionError):
        check_grads(broken, (q, keys, hw), order=1, modes=("rev",), atol=TOL, rtol=TOL, eps=EPS)


def _tiny_problem(seed):
    rng = np.random.default_rng(seed)
    c = TINY
    e, r, hi, di, m = c["emb_dim"], c["q_lora_rank"], c["index_n_heads"], c["index_head_dim"], c["compress_ratio"]
    b, s, h, d = 2, 8, c["num_query_heads"], c["head_dim"]
    params = {
        "indexer.wkv": rng.standard_normal((e, 2 * di)) * e**-0.5,
        "indexer.wgate": rng.standard_normal((e, 2 * di)) * e**-0.5,
        "indexer.ape": rng.standard_normal((m, 2 * di)) * 0.5,
        "indexer.kv_norm": 1.0 + 0.1 * rng.standard_normal(di),
        "indexer.wq_b": rng.standard_normal((r, hi * di)) * r**-0.5,
        "indexer.weights_proj": rng.standard_normal((e, hi)) * e**-0.5,
    }
    pos = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    inputs = {
        "hidden_states": rng.standard_normal((b, s, e)),
        "q_latent": rng.standard_normal((b, s, r)),
        "position_ids": pos,
        "segment_ids": np.ones_like(pos),
        "teacher_query": rng.standard_normal((b, s, h, d)) * d**-0.5 * 2,
        "teacher_kv": rng.standard_normal((b, s // m, d)),
    }
    # The joint teacher's inputs, drawn last (the draws above, and so the margins, do not move).
    inputs["teacher_window_kv"] = rng.standard_normal((b, s, d))
    inputs["attention_sink"] = rng.standard_normal(h)
    return {k: jnp.asarray(v) for k, v in params.items()}, inputs


def _loss_logit_margin(params, inputs, cfg):
    """min |q . K| over the (query, head, block) logits whose ReLU reaches the loss: valid blocks."""
    keys = jax_impl.indexer_forward(params, inputs, cfg, "float64")["compressed_keys"]
    b, s, _ = inputs["q_latent"].shape
    q = (inputs["q_latent"] @ params["indexer.wq_b"]).reshape(b, s, cfg.index_n_heads, cfg.index_head_dim)
    q = apply_rope(jnp.asarray(q), jnp.asarray(inputs["position_ids"])[:, :, None], cfg.rope_head_dim,
                   cfg.rope_theta, jnp.float64)
    logits = jnp.einsum("bshd,bwd->bswh", q, keys)
    valid = scoring.block_validity(jnp.asarray(inputs["position_ids"]), jnp.asarray(inputs["segment_ids"]), cfg, s)
    return float(jnp.min(jnp.where(valid[..., None], jnp.abs(logits), jnp.inf)))


@pytest.mark.parametrize("chunk,teacher", [(0, "joint"), (1, "joint"), (2, "joint"), (0, "compressed")])
def test_check_grads_on_the_loss_with_respect_to_the_six_parameters(chunk, teacher):
    """The joint teacher with a window of 3 tokens and a sink (the default teacher), and the
    compressed one; the teacher holds no parameter, but it weighs every term of the loss."""
    cfg = jax_impl.CSAConfig(**TINY, indexer_head_chunk=chunk, loss_head_chunk=min(chunk, 2),
                             sliding_window=3, teacher_normaliser=teacher)
    params, inputs = _tiny_problem(1)
    margin = _loss_logit_margin(params, inputs, cfg)
    assert margin >= MARGIN, f"a logit sits {margin:.2e} from the ReLU kink: pick another point"
    names = jax_impl.PARAM_NAMES

    @jax.jit  # check_grads evaluates the loss and its VJP at several points of one shape: trace once
    def loss(*ps):
        return jax_impl.indexer_loss(dict(zip(names, ps)), inputs, cfg, "float64")

    args = tuple(params[n] for n in names)
    assert float(loss(*args)) > 0
    check_grads(loss, args, order=2, modes=("rev",), atol=TOL, rtol=TOL, eps=EPS)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("chunk", [0, 1, 2, 4, 8])
def test_custom_vjp_equals_plain_autodiff_at_every_chunk_size(chunk, dtype):
    wide = jnp.dtype(dtype)
    cfg = jax_impl.CSAConfig(emb_dim=16, q_lora_rank=16, index_n_heads=8, index_head_dim=16, rope_head_dim=8,
                             compress_ratio=4, index_topk=4, num_query_heads=2, head_dim=8,
                             indexer_head_chunk=chunk)
    rng = np.random.default_rng(2)
    b, s, w = 2, 32, 8
    q_latent = jnp.asarray(rng.standard_normal((b, s, 16)), wide)
    pos = jnp.tile(jnp.arange(s, dtype=jnp.int32), (b, 1))
    wq_b = jnp.asarray(rng.standard_normal((16, 8 * 16)) * 0.25, wide)
    hw = jnp.asarray(rng.standard_normal((b, s, 8)), wide)
    keys = jnp.asarray(rng.standard_normal((b, w, 16)), wide)
    ct = jnp.asarray(rng.standard_normal((b, s, w)), wide)

    def grads(vjp):
        f = lambda wq, h, k: jnp.vdot(ct, scoring.raw_scores(q_latent, pos, wq, h, k, cfg, wide, vjp=vjp))  # noqa: E731
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(wq_b, hw, keys)

    custom, plain = grads("custom"), grads("autodiff")
    for name, c, p in zip(("wq_b", "head_weights", "keys"), custom, plain):
        assert c.dtype == wide
        err = float(jnp.max(jnp.abs(c - p)) / jnp.max(jnp.abs(p)))
        assert err <= GRAD_RTOL[dtype], f"{name} chunk={chunk} {dtype}: custom vs autodiff {err:.2e}"

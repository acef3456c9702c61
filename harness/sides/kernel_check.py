"""The `kernel` check: jax_impl's Pallas scoring kernels against the XLA path, on small problems
whose tiles do not divide them (interpret mode off TPU, where the rows and key blocks past the
end of a partial tile read NaN).

    kernel_check() -> [CheckResult]   # every comparison; the check passes when none failed

Four problems, in seven compiled programs (the XLA reference, the float64 kernels, the
float64 kernels with tile skipping, the bfloat16 forward kernel, and the teacher's kernels
beside their reference):
- float64, B=2, S=21, c=3, DI=8, W=10, tiles (8, 8): three row tiles (8, 8, 5) and two key
  tiles (8, 2), square so that a transposed tile has the right shape and must be caught by
  its numbers. The forward and the VJP (dq, dK, dw under a fixed random cotangent) against
  plain JAX autodiff of `jax_impl.scoring.head_contribution_autodiff`: EXACT64 (same math,
  summation order only).
- float64, the same shape and cotangent, tiles (4, 4) (square, as above), with a validity mask: causal (query s
  sees block j when 2j + 2 <= s + 1) and packed (two documents, rows 0..12 and 13..20; the block
  straddling the boundary is invalid). Of the 6 x 3 tiles, 8 hold no valid entry (past the
  diagonal, or the second document's rows against the first's blocks) and are skipped; the
  others are partly valid. The masked forward and its VJP (the cotangent masked
  too, as behind the -inf mask) against the same masks applied to the autodiff reference:
  EXACT64.
- bfloat16 q and K (w float32), the same shape, tiles (16, 8): the forward against the XLA
  contribution of the same values widened to float32, at KERNEL_BF16_FORWARD (below). A
  bfloat16 product is exact in float32, so only the summation order differs; an accumulator in
  bfloat16 is ~1e-2 off.
- The teacher's kernels, float64, the masked problem's shape, tiles and mask as the loss's keep
  (q as the teacher's queries, scaled by DI**-0.5, K as its blocks, a sink logit per head): each
  head's max over its kept blocks, the head sum of the compressed teacher's softmax (shift and
  sum by the kernels, `exp(logit - M) / sum`) and of the joint teacher's (the sink in the
  normaliser, `exp(logit - log-sum-exp)`), against the same softmaxes in plain JAX: EXACT64.

tests/test_pallas.py runs it on the committed code; the mutation self-test
(harness/selftest/mutations.py, `kernel=True` entries) on each mutated copy of jax_impl.
"""

from __future__ import annotations

import numpy as np

from ..judging.compare import CheckResult, compare_close
from ..judging.tolerance import EXACT64, KERNEL_BF16_FORWARD

SHAPE = {"B": 2, "S": 21, "c": 3, "DI": 8, "W": 10}
TILES64 = (8, 8)
TILES16 = (16, 8)
TILES_MASKED = (4, 4)
DOC_START = 13  # the second document's first row
CHECK = "kernel"


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    b, s, c, d, w = (SHAPE[k] for k in ("B", "S", "c", "DI", "W"))
    q = rng.standard_normal((b, s, c, d))
    keys = rng.standard_normal((b, w, d))
    hw = rng.standard_normal((b, s, c))
    ct = rng.standard_normal((b, s, w))
    return q, keys, hw, ct


def _validity():
    """[B, S, W] bool of the masked problem (module doc): causal with m = 2, two documents."""
    b, s, w = (SHAPE[k] for k in ("B", "S", "W"))
    pos = np.arange(s)
    seg = (pos >= DOC_START).astype(int)
    first = 2 * np.arange(w)
    block_seg = seg[np.minimum(first, s - 1)]
    uniform = block_seg == seg[np.minimum(first + 1, s - 1)]
    valid = (first[None, :] + 2 <= pos[:, None] + 1) & uniform & (block_seg[None, :] == seg[:, None])
    return np.broadcast_to(valid, (b, s, w))


def kernel_check(stop_on=()) -> list[CheckResult]:
    """Every comparison of the module doc, as CheckResults named `kernel` (needs 64-bit mode).
    `stop_on`: check names; when one of them has failed on the unmasked problem, the masked one
    (two more programs) is skipped (a mutation test's verdict is settled; harness.selftest.mutations)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels import Tiles, contribution
    from jax_impl.scoring import head_contribution_autodiff

    if not jax.config.jax_enable_x64:
        raise RuntimeError("kernel_check needs JAX 64-bit mode (JAX_ENABLE_X64=1)")
    t64, t16 = Tiles(*TILES64), Tiles(*TILES16)

    # Three programs, not one: a mutation of one kernel leaves the others' programs (and the
    # XLA reference's) unchanged, so a shared persistent compilation cache serves them.
    def vjp_at(fn, ct, *args):
        out, pull = jax.vjp(fn, *args)
        return (out, *pull(ct))

    def widened(q, keys, hw):
        return q.astype(jnp.bfloat16).astype(jnp.float32), keys.astype(jnp.bfloat16).astype(jnp.float32), \
            hw.astype(jnp.float32)

    reference = jax.jit(lambda q, keys, hw, ct: (vjp_at(head_contribution_autodiff, ct, q, keys, hw),
                                                 head_contribution_autodiff(*widened(q, keys, hw))))
    kernels64 = jax.jit(lambda q, keys, hw, ct: vjp_at(lambda *a: contribution(*a, t64), ct, q, keys, hw))
    kernels16 = jax.jit(lambda q, keys, hw: contribution(q.astype(jnp.bfloat16), keys.astype(jnp.bfloat16),
                                                         hw.astype(jnp.float32), t16))
    valid = jnp.asarray(_validity())
    tm = Tiles(*TILES_MASKED)

    def masked(fn):
        return lambda *a: jnp.where(valid, fn(*a), 0)

    masked_ref = jax.jit(lambda q, keys, hw, ct: vjp_at(masked(head_contribution_autodiff), jnp.where(valid, ct, 0),
                                                        q, keys, hw))
    masked_kernels = jax.jit(lambda q, keys, hw, ct: vjp_at(masked(lambda *a: contribution(*a, tm, valid)), ct,
                                                            q, keys, hw))
    q, keys, hw, ct = (jnp.asarray(a) for a in _problem())
    want, ref16 = reference(q, keys, hw, ct)
    got = kernels64(q, keys, hw, ct)
    out16 = kernels16(q, keys, hw)
    results = judge_kernel(dict(zip(NAMES64, got)), dict(zip(NAMES64, want)), out16, ref16)
    if any(r.failed and r.check in stop_on for r in results):
        return results
    got_m, want_m = masked_kernels(q, keys, hw, ct), masked_ref(q, keys, hw, ct)
    results += [compare_close(CHECK, f"float64 masked {n}", g, r, EXACT64) for n, g, r in zip(NAMES64, got_m, want_m)]
    return results + teacher_results(q * SHAPE["DI"]**-0.5, keys, valid, jnp.asarray(_problem(1)[2][0, 0]))


def teacher_results(tq, tkv, keep, sink) -> list[CheckResult]:
    """The teacher's kernels against plain JAX (module doc): `kernel` checks named teacher."""
    import jax
    import jax.numpy as jnp

    from jax_impl.kernels import Tiles, live_tiles, teacher_block_max, teacher_block_probs, teacher_block_sumexp

    live = live_tiles(keep, Tiles(*TILES_MASKED))

    @jax.jit
    def kernels(tq, tkv, sink):
        m = teacher_block_max(tq, tkv, keep, live)
        shift = jnp.where(jnp.isfinite(m), m, 0)
        compressed = teacher_block_probs(tq, tkv, keep, shift, 1 / teacher_block_sumexp(tq, tkv, keep, shift, live),
                                         live)
        top = jnp.maximum(m, sink)
        total = teacher_block_sumexp(tq, tkv, keep, top, live) + jnp.exp(sink - top)
        return m, compressed, teacher_block_probs(tq, tkv, keep, jnp.log(total) + top, live=live)

    @jax.jit
    def reference(tq, tkv, sink):
        a = jnp.where(keep[:, :, None, :], jnp.einsum("bshd,bwd->bshw", tq, tkv), -jnp.inf)
        kept = jnp.any(keep, axis=-1)[..., None, None]
        soft = jnp.where(kept, jax.nn.softmax(jnp.where(kept, a, 0), axis=-1), 0)
        lse = jax.nn.logsumexp(jnp.concatenate([jnp.broadcast_to(sink[..., None], (*a.shape[:3], 1)), a], -1), -1)
        return (jnp.max(a, axis=-1), jnp.sum(jnp.where(keep[:, :, None, :], soft, 0), axis=2),
                jnp.sum(jnp.exp(a - lse[..., None]), axis=2))

    sink = jnp.broadcast_to(sink, tq.shape[:3])
    got, want = kernels(tq, tkv, sink), reference(tq, tkv, sink)
    return [compare_close(CHECK, f"float64 teacher {n}", g, r, EXACT64)
            for n, g, r in zip(("max", "compressed head sum", "joint head sum"), got, want)]


NAMES64 = ("scores", "dq", "dkeys", "dhead_weights")


def judge_kernel(got64: dict, want64: dict, got16, want16) -> list[CheckResult]:
    """The verdicts of `kernel_check` on the arrays it computed: each float64 output of
    NAMES64 against the autodiff reference at EXACT64, the bfloat16 forward against the
    widened XLA contribution at KERNEL_BF16_FORWARD (normwise, `kernel` checks)."""
    results = [compare_close(CHECK, f"float64 {n}", got64[n], want64[n], EXACT64) for n in NAMES64]
    results.append(compare_close(CHECK, "bfloat16 scores", got16, want16, KERNEL_BF16_FORWARD))
    return results

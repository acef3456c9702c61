"""Other forms of the scores' forward kernel, timed beside the library's on one TPU chip: the
measurements behind docs/pallas.md's "where the forward's time goes".

    python -m benchmarks.forward_forms                                   # the forms measured, S=8192, 64 heads
    python -m benchmarks.forward_forms --seq 512 --heads 8 base:256x128u8 kst:256x128g4

Each form computes sum_h w[s, h] * relu(q[s, h] . K[j]) over the causal tiles of identity
positions (bfloat16 q and K, float32 w, tiles skipped as the library skips them) and is
checked against the first form named (normwise, over the valid entries), except `mxa` and
`mxb` below. Forms, as KIND:ROWSxKEYS followed by u (heads an iteration) or g (heads a
product) and a count:

- `base`: the library's kernels (`jax_impl.kernels.contribution`) at `Tiles(rows, keys, u)`;
- `grp`: the library's layout ([keys, rows] logits, K streamed through the MXU, each head's
  rows the stationary operand); the u heads of an iteration summed before one update of the
  accumulator;
- `kst` / `kss`: the [rows, keys] layout, K the stationary operand of every product and g
  heads' rows stacked into one product; the head weights lane-broadcast once per row tile
  into VMEM; `kss` sums the g heads before one update of the accumulator;
- `chkA` / `chkB` (with a trailing cN): the tile in chunks of N key rows (A, [keys, rows]
  layout) or N query rows (B, [rows, keys], K stationary), each chunk's sum over all heads
  carried in registers through the head loop and stored once;
- `mxa` / `mxb`: the products alone, no ReLU and no head weights: sum_h q[s, h] . K[j], in the
  library's layout (u heads an iteration, each head's [keys, rows] product added to the
  accumulator) or K stationary (g heads' rows stacked into one product). What the forward
  costs with its elementwise work taken out; checked against that sum (einsum at HIGHEST),
  not against the first form.

On a TPU the forms compile with Mosaic and each prints its median of --repeats. Elsewhere they
run in Pallas interpret mode, once, as a check of the forms (the times are not the chip's), and
only at a small shape (S x HI at most INTERPRET_LIMIT, e.g. --seq 512 --heads 8): at the
default shape it prints one line (no chip, nothing measured) and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_impl.kernels import Tiles, clamp_tile, contribution, live_tiles, tile_is_live

F32 = jnp.float32
MEASURED = ("base:256x256u8 grp:256x256u8 kst:256x256g1 kst:256x256g4 kss:256x256g4 kss:256x256g8 kst:512x256g4 "
            "kst:256x512g4 chkA:256x256u8c16 chkA:256x256u8c32 chkA:256x256u8c64 chkB:256x256u8c16 "
            "chkB:256x256u8c32 chkB:256x256u8c64 base:256x256u64 base:512x256u8 base:512x256u16 mxa:512x256u16 "
            "mxb:512x256g16").split()
# Off TPU, the largest S x HI interpreted (seconds per form on a CPU; S=8192 x 64 would take hours).
INTERPRET_LIMIT = 512 * 8
FORM = re.compile(r"^(base|grp|kst|kss|chkA|chkB|mxa|mxb):(\d+)x(\d+)[ug](\d+)(?:c(\d+))?$")
PRODUCTS = ("mxa", "mxb")  # the forms without ReLU and head weights


def parse(text: str):
    """'kst:256x256g4' -> ('kst', 256, 256, 4, None); a form it cannot read is refused naming the rule."""
    m = FORM.match(text)
    if not m or (m.group(1).startswith("chk")) != (m.group(5) is not None):
        raise ValueError(f"form {text!r}: expected KIND:ROWSxKEYS(u|g)N, KIND one of base, grp, kst, kss, mxa, "
                         "mxb (no chunk) or chkA, chkB (with a trailing cN chunk of rows)")
    kind, rows, keys, n, chunk = m.groups()
    return kind, int(rows), int(keys), int(n), int(chunk) if chunk else None


def _dot_nt(a, b, interpret):
    """a [M, K] . b [N, K]^T into float32, bfloat16 products at DEFAULT (exact)."""
    if interpret:
        a, b = a.astype(F32), b.astype(F32)
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=(jax.lax.Precision.DEFAULT,) * 2,
                               preferred_element_type=F32)


def _heads(heads, per, body, init):
    """fori_loop over heads // per groups of `per` heads, an int32 counter (Mosaic indexes in 32 bits)."""
    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(heads // per), body, init)


def _kernel(bits, rlo, rhi, klo, khi, q_ref, k_ref, w_ref, o_ref, acc_ref, *rest, kind, heads, per, chunk, nr,
            nwords, interpret):
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows_major = kind in ("kst", "kss", "chkB", "mxb")  # [rows, keys] tiles; else [keys, rows]
    live = tile_is_live(bits, b, i, j, nr, nwords)
    dot = functools.partial(_dot_nt, interpret=interpret)
    if rows_major and kind not in PRODUCTS:
        (wb_ref,) = rest
        ts, tw = acc_ref.shape

        @pl.when(j == 0)  # the head weights of the row tile as [rows, 128] lane broadcasts, once
        def _():
            for h in range(heads):
                wb_ref[h] = jnp.broadcast_to(w_ref[:, h:h + 1], (ts, 128))

        def weight(h, rows=slice(None)):
            wbh = wb_ref[h, rows]
            return jnp.concatenate([wbh] * (tw // 128), axis=1) if tw > 128 else wbh

    @pl.when(live)
    def _():
        k = k_ref[...]
        if kind == "grp":
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

            def step(g, carry):
                parts = [w_ref[g * per + u] * jnp.maximum(dot(k, q_ref[g * per + u]), 0) for u in range(per)]
                acc_ref[...] += functools.reduce(jnp.add, parts)
                return carry
            _heads(heads, per, step, jnp.int32(0))
        elif kind in PRODUCTS:
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

            def step(g, carry):
                if kind == "mxa":
                    for u in range(per):
                        acc_ref[...] += dot(k, q_ref[g * per + u])
                else:
                    ts = acc_ref.shape[0]
                    logits = dot(q_ref[pl.ds(g * per, per)].reshape(per * ts, q_ref.shape[-1]), k)
                    for u in range(per):
                        acc_ref[...] += logits[u * ts:(u + 1) * ts]
                return carry
            _heads(heads, per, step, jnp.int32(0))
        elif kind in ("kst", "kss"):
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

            def step(g, carry):
                h0 = g * per
                logits = dot(q_ref[pl.ds(h0, per)].reshape(per * ts, q_ref.shape[-1]), k)  # [per*ts, tw]
                parts = [weight(h0 + u) * jnp.maximum(logits[u * ts:(u + 1) * ts], 0) for u in range(per)]
                if kind == "kss":
                    acc_ref[...] += functools.reduce(jnp.add, parts)
                else:
                    for p in parts:
                        acc_ref[...] += p
                return carry
            _heads(heads, per, step, jnp.int32(0))
        else:  # chkA, chkB
            for r in range(acc_ref.shape[0] // chunk):
                sl = slice(r * chunk, (r + 1) * chunk)

                def step(g, acc, sl=sl):
                    for u in range(per):
                        h = g * per + u
                        if kind == "chkA":
                            acc = acc + w_ref[h] * jnp.maximum(dot(k_ref[sl], q_ref[h]), 0)
                        else:
                            acc = acc + weight(h, sl) * jnp.maximum(dot(q_ref[h, sl], k), 0)
                    return acc
                acc_ref[sl] = _heads(heads, per, step, jnp.zeros((chunk, acc_ref.shape[1]), F32))
        o_ref[...] = acc_ref[...] if rows_major else acc_ref[...].T

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def form_call(kind, ts, tw, per, chunk, table, q, keys, w, interpret):
    """The pallas_call of one non-library form: q [B,S,c,DI] bf16, keys [B,W,DI] bf16, w [B,S,c] f32."""
    b, s, c, di = q.shape
    nw = keys.shape[1]
    nr, nk = pl.cdiv(s, ts), pl.cdiv(nw, tw)
    i32 = jnp.int32

    def kj(b, i, j, bits, rlo, rhi, klo, khi):  # the key tile clamped into row tile i's live range
        return clamp_tile(j, rlo, rhi, b * nr + i)

    q_spec = pl.BlockSpec((None, c, ts, di), lambda b, i, j, *t: (b, i32(0), i, i32(0)))
    k_spec = pl.BlockSpec((None, tw, di), lambda b, i, j, *t: (b, kj(b, i, j, *t), i32(0)))
    o_spec = pl.BlockSpec((None, ts, tw), lambda b, i, j, *t: (b, i, j))
    if kind in ("grp", "chkA", "mxa"):
        args = (jnp.swapaxes(q, 1, 2), keys, jnp.swapaxes(w, 1, 2)[:, :, None, :])
        w_spec = pl.BlockSpec((None, c, 1, ts), lambda b, i, j, *t: (b, i32(0), i32(0), i))
        scratch = [pltpu.VMEM((tw, ts), F32)]
        inner = "parallel"
    else:
        args = (jnp.swapaxes(q, 1, 2), keys, w)
        w_spec = pl.BlockSpec((None, ts, c), lambda b, i, j, *t: (b, i, i32(0)))
        scratch = [pltpu.VMEM((ts, tw), F32)] + ([] if kind in PRODUCTS else [pltpu.VMEM((c, ts, 128), F32)])
        inner = "arbitrary"  # the weights' broadcast at j == 0 serves the row tile's later steps
    kernel = functools.partial(_kernel, kind=kind, heads=c, per=per, chunk=chunk, nr=nr,
                               nwords=pl.cdiv(nk, 32), interpret=interpret)
    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=5, grid=(b, nr, nk), in_specs=[q_spec, k_spec, w_spec],
                                        out_specs=o_spec, scratch_shapes=scratch)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((b, s, nw), F32), grid_spec=spec,
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", inner),
                                                               vmem_limit_bytes=96 * 2**20),
                          interpret=interpret)(*table, *args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("forms", nargs="*", default=MEASURED, help="forms to time, the first (not mxa, mxb) the yardstick "
                   "(default: the forms docs/pallas.md reports)")
    p.add_argument("--seq", type=int, default=8192, help="sequence length S (W = S/4 key blocks)")
    p.add_argument("--heads", type=int, default=64, help="indexer heads HI")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per form on a TPU")
    args = p.parse_args(argv)
    try:
        forms = [parse(f) for f in args.forms]
    except ValueError as e:
        p.error(str(e))
    on_tpu = jax.default_backend() == "tpu"
    if not on_tpu and args.seq * args.heads > INTERPRET_LIMIT:
        print(f"forward_forms: no TPU here (JAX default backend: {jax.default_backend()}); nothing measured "
              f"(off TPU the forms run in interpret mode at S x HI <= {INTERPRET_LIMIT}, e.g. --seq 512 --heads 8)")
        return 2
    s, c, w_ = args.seq, args.heads, args.seq // 4
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (1, s, c, 128), F32).astype(jnp.bfloat16)
    keys = jax.random.normal(kk, (1, w_, 128), F32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (1, s, c), F32) * c**-0.5
    rows = jnp.arange(s, dtype=jnp.int32)
    valid = jnp.arange(w_, dtype=jnp.int32)[None, None, :] * 4 + 4 <= rows[None, :, None] + 1
    print(f"device: {jax.devices()[0].device_kind}; S={s}, W={w_}, HI={c}, DI=128, bfloat16; "
          + ("median of %d" % args.repeats if on_tpu else "Pallas interpret mode, one run (not the chip's time)"))
    ref = ref_name = None
    products = None  # sum_h q.K, the yardstick of the product forms: computed once, if one is named
    if any(f[0] in PRODUCTS for f in forms):
        products = jnp.where(valid, jnp.einsum("bshd,bjd->bsj", q, keys, precision=jax.lax.Precision.HIGHEST,
                                               preferred_element_type=F32), 0)
    for text, (kind, ts, tw, per, chunk) in zip(args.forms, forms):
        live = live_tiles(valid, Tiles(ts, tw, per))
        if kind == "base":
            fn = jax.jit(lambda q, k, w, live=live: contribution(q, k, w, valid=live))
        else:
            fn = jax.jit(lambda q, k, w, a=(kind, ts, tw, per, chunk, live.table()):
                         form_call(*a, q, k, w, interpret=not on_tpu))
        try:
            out = jnp.where(valid, jax.block_until_ready(fn(q, keys, w)), 0)
            if kind in PRODUCTS:
                yardstick, err = "sum_h q.K", float(jnp.linalg.norm(out - products) / jnp.linalg.norm(products))
            else:
                ref, ref_name = (out, text) if ref is None else (ref, ref_name)
                yardstick, err = ref_name, float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            runs = []
            for _ in range(args.repeats if on_tpu else 1):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, keys, w))
                runs.append(1e3 * (time.perf_counter() - t0))
            print(f"{text:20s} {statistics.median(runs):8.3f} ms (min {min(runs):.3f})  "
                  f"normwise difference from {yardstick} {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a form that fails to compile is reported, the rest still run
            print(f"{text:20s} error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

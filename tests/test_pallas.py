"""The Pallas scoring kernels (jax_impl.kernels, `scoring_backend="pallas"`).

Off TPU every kernel here runs in Pallas interpret mode (and the report of a run says so);
TPU is reached by `jax.export(..., platforms=["tpu"])`, which lowers each kernel to its Mosaic
custom call on this CPU machine without running it.

1. The `kernel` check (harness.sides.kernel_check: partial square tiles in float64, bfloat16 inputs)
   passes on the committed code: the clean pass of the mutation catalogue's kernel entries.
2. `jax.test_util.check_grads` on the kernels' custom VJP, float64, partial tiles.
3. Gradients of the pallas backend's scores against plain JAX autodiff of the XLA path, float32.
4. TPU export of the loss's forward and backward with the pallas backend: at every matrix
   point's shapes and tiles (the sample of CSA_PARITY_SAMPLE, like tests/test_parity_matrix.py)
   and at production shapes (HI=64, DI=128, S=8192 and 32768, bfloat16 and float32): the
   Mosaic call is there, every tile is TPU-legal, and no per-head [.., rows, W] buffer exists
   (the XLA backend's export of the same loss has one: the assertion can fail).
5. The kernels as a stage plug-in (examples/pallas_scores.py) through the harness, and a
   planted kernel bug failing with the stage named.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads

import jax_impl
from harness.points import Entry, Point
from harness.problems.cases import CASES
from harness.problems.matrix import build_matrix
from harness.run.collect import evaluate
from harness.selftest.mutations import CATALOGUE, patch_copy
from harness.sides.kernel_check import kernel_check
from jax_impl import scoring
from jax_impl.kernels import (Tiles, contribution, default_tiles, live_tiles, teacher_block_max, teacher_block_probs,
                               teacher_block_sumexp)
from jax_impl.validate import input_shapes, param_shapes

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = os.environ.get("CSA_PARITY_SAMPLE", "default")
# check_grads settings and the kink margin: as tests/test_grad_checks.py (its docstring says why).
EPS, TOL, MARGIN = 1e-6, 1e-5, 1e-3
# Pallas vs XLA autodiff, float32, max |diff| / max |XLA grad|: measured 1.7e-7 (wq_b), 1.2e-7
# (keys), 0 (head weights) (float32 sums of up to W*c*DI products in another order); 1e-5 as
# tests/test_grad_checks.py's float32 custom-VJP bound.
GRAD_RTOL32 = 1e-5


def test_the_kernel_check_passes_on_the_committed_code():
    results = kernel_check()
    assert len(results) == 12  # 4 + 1 + 4 masked + 3 of the teacher (harness.sides.kernel_check)
    failed = [r.message for r in results if r.failed]
    assert not failed, "\n".join(failed)


def test_check_grads_on_the_kernels_custom_vjp_with_partial_tiles():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 11, 2, 8)))  # float64; rows 8 + 3, blocks 4 + 1
    keys = jnp.asarray(rng.standard_normal((1, 5, 8)))
    hw = jnp.asarray(rng.standard_normal((1, 11, 2)))
    margin = float(jnp.min(jnp.abs(jnp.einsum("bshd,bwd->bshw", q, keys))))
    assert margin >= MARGIN, f"a logit sits {margin:.2e} from the ReLU kink: pick another point"
    tiles = Tiles(8, 4)

    @jax.jit  # check_grads evaluates f and its VJP at several points of one shape: compile once
    def f(q, keys, hw):
        return contribution(q, keys, hw, tiles)

    check_grads(f, (q, keys, hw), order=1, modes=("rev",), atol=TOL, rtol=TOL, eps=EPS)
    # the check can fail: the same kernels with dK dropped are caught
    bad = jax.custom_vjp(f)

    def bad_bwd(res, g):
        dq, dk, dw = jax.vjp(f, *res)[1](g)
        return dq, jnp.zeros_like(dk), dw

    bad.defvjp(lambda *a: (f(*a), a), bad_bwd)
    with pytest.raises(AssertionError):
        check_grads(bad, (q, keys, hw), order=1, modes=("rev",), atol=TOL, rtol=TOL, eps=EPS)


def test_pallas_gradients_match_autodiff_of_the_xla_path_in_float32():
    """Head chunk 2 of 4: the kernels inside the checkpointed scan (the native path is
    tests/test_parity_matrix.py's pallas points)."""
    cfg = jax_impl.CSAConfig(emb_dim=16, q_lora_rank=8, index_n_heads=4, index_head_dim=8, rope_head_dim=4,
                             compress_ratio=2, index_topk=2, num_query_heads=2, head_dim=8,
                             indexer_head_chunk=2)
    rng = np.random.default_rng(2)
    b, s, w = 2, 13, 6
    q_latent = jnp.asarray(rng.standard_normal((b, s, 8)), jnp.float32)
    wq_b = jnp.asarray(rng.standard_normal((8, 32)) * 0.3, jnp.float32)
    hw = jnp.asarray(rng.standard_normal((b, s, 4)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, w, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    ct = jnp.asarray(rng.standard_normal((b, s, w)), jnp.float32)

    def grads(c, vjp):
        def f(wq_b, hw, keys):
            return jnp.sum(ct * scoring.raw_scores(q_latent, pos, wq_b, hw, keys, c, jnp.float32, vjp))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(wq_b, hw, keys)

    got = grads(dataclasses.replace(cfg, scoring_backend="pallas"), "custom")
    want = grads(cfg, "autodiff")
    for name, g, r in zip(("wq_b", "head_weights", "keys"), got, want):
        err = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
        assert err <= GRAD_RTOL32, f"{name}: {err:.3g} > {GRAD_RTOL32}"


# ----------------------------------------------------------------------------- teacher kernels

# The teacher kernels against the XLA teacher, max |diff| / max |XLA| of the head sum. The
# kernels give every exp the argument XLA's softmax gives it, so only the order of the sums
# differs: measured at most 1.7e-7 in float32 (the max at partial tiles; the head sums 9e-8, in
# bfloat16 too: float32 sums either way), 2.4e-16 in float64 (interpret mode, this CPU); bounds
# 6x above in float32, 40x in float64 (a few float64 roundings).
TEACHER_RTOL = {"float64": 1e-14, "float32": 1e-6, "bfloat16": 1e-6}


def _teacher_problem(b, r, h, d, w, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    tq = jnp.asarray(rng.standard_normal((b, r, h, d)) * d**-0.5, dtype)
    tkv = jnp.asarray(rng.standard_normal((b, w, d)), dtype)
    s, j = np.arange(r)[:, None], np.arange(w)[None]
    keep = (4 * j + 4 <= s + 1) & (rng.random((b, r, w)) < 0.7)
    keep[:, :3] = False  # rows that keep nothing
    return tq, tkv, jnp.asarray(keep)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_teacher_kernels_at_partial_tiles_match_a_plain_softmax(dtype):
    """Several row and key tiles, both partial (300 rows, 200 blocks, 128 x 128 tiles), a random
    keep with rows that keep nothing: the max is -inf there, the sum 0, the head sum 0 (no NaN)."""
    from jax_impl.kernels import Tiles, live_tiles

    tq, tkv, keep = _teacher_problem(2, 300, 3, 16, 200, dtype=jnp.dtype(dtype))
    live = live_tiles(keep, Tiles(128, 128, unroll=2))
    m = teacher_block_max(tq, tkv, keep, live)
    shift = jnp.where(jnp.isfinite(m), m, 0)
    total = teacher_block_sumexp(tq, tkv, keep, shift, live)
    got = teacher_block_probs(tq, tkv, keep, shift, 1 / total, live)

    a = jnp.where(keep[:, :, None, :], jnp.einsum("bshd,bwd->bshw", tq, tkv, precision="highest"), -jnp.inf)
    want_m = jnp.max(a, axis=-1)
    want = jnp.sum(jnp.where(keep[:, :, None, :], jax.nn.softmax(a, axis=-1), 0), axis=2)
    assert bool(jnp.all(jnp.isneginf(m[:, :3]))) and bool(jnp.all(total[:, :3] == 0))
    assert bool(jnp.all(jnp.isfinite(m) == jnp.isfinite(want_m)))
    fin = jnp.isfinite(want_m)
    m_err = float(jnp.max(jnp.abs(jnp.where(fin, m - want_m, 0))) / jnp.max(jnp.abs(jnp.where(fin, want_m, 0))))
    assert m_err <= TEACHER_RTOL[dtype], m_err
    assert not bool(jnp.any(jnp.isnan(got))) and bool(jnp.all(got[:, :3] == 0))
    err = float(jnp.max(jnp.abs(got - jnp.nan_to_num(want))) / jnp.max(want[:, 3:]))
    assert err <= TEACHER_RTOL[dtype], err


@pytest.mark.parametrize("extra", [dict(), dict(teacher_normaliser="compressed"), dict(sliding_window=3),
                                   dict(sliding_window=3, loss_head_chunk=2), dict(sparse_loss=True)],
                         ids=["joint", "compressed", "window", "window-chunk2", "sparse"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_the_teacher_by_the_kernels_matches_the_xla_teacher(extra, dtype):
    """`loss.teacher_head_sum` on both backends: packed documents, the joint teacher's sink and
    window, the compressed teacher, head chunks, a sparse keep."""
    from jax_impl import loss

    cfg = jax_impl.CSAConfig(emb_dim=16, q_lora_rank=8, index_n_heads=4, index_head_dim=8, rope_head_dim=4,
                             compress_ratio=2, index_topk=3, num_query_heads=4, head_dim=16, **extra)
    b, s, w = 2, 21, 10
    tq, tkv, keep = _teacher_problem(b, s, 4, 16, w, seed=3)
    rng = np.random.default_rng(4)
    seg = jnp.asarray(np.repeat(np.array([[1] * 12 + [2] * 9]), b, 0), jnp.int32)
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    narrow = {"bfloat16": jnp.bfloat16}.get(dtype, wide)
    exact = lambda x: jnp.asarray(x).astype(narrow).astype(wide)  # noqa: E731 - compute-dtype values, widened
    teacher = {"teacher_query": exact(tq), "teacher_kv": exact(tkv),
               "teacher_window_kv": exact(rng.standard_normal((b, s, 16))),
               "attention_sink": jnp.asarray(rng.standard_normal(4), wide)}
    rows = jnp.arange(s)

    def head_sum(backend):
        c = dataclasses.replace(cfg, scoring_backend=backend)
        return loss.teacher_head_sum(teacher, keep, c, rows, seg, dtype=dtype)

    got, want = head_sum("pallas"), jnp.where(keep, head_sum("xla"), 0)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(want))
    assert err <= TEACHER_RTOL[dtype], err


def test_the_backward_recomputes_only_the_teacher_head_sum():
    """The query-blocked loss saves the teacher kernels' normaliser per block: in the loss and
    its gradient the normaliser's kernels run once per block (the forward), the head sum twice
    (the forward, and the backward's recomputation of T). Each kernel counts twice in a jaxpr:
    its Mosaic call and its interpreted one."""
    import collections

    cfg = jax_impl.CSAConfig(emb_dim=16, q_lora_rank=8, index_n_heads=4, index_head_dim=8, rope_head_dim=4,
                             compress_ratio=2, index_topk=3, num_query_heads=4, head_dim=8, query_chunk=4,
                             scoring_backend="pallas")
    params = {k: jax.ShapeDtypeStruct(sh, jnp.float32) for k, (_, sh) in param_shapes(cfg).items()}
    inputs = {k: jax.ShapeDtypeStruct(sh, jnp.int32 if k in ("position_ids", "segment_ids") else jnp.float32)
              for k, (_, sh) in input_shapes(cfg, 1, 13).items()}
    jaxpr = jax.make_jaxpr(lambda p, x: jax_impl.indexer_loss_and_grads(p, x, cfg, "float32")[:2])(params, inputs)
    counts = collections.Counter(c.params["name"] for c in _pallas_calls(jaxpr.jaxpr))
    assert (counts["csa_teacher_max"], counts["csa_teacher_sum"], counts["csa_teacher_probs"]) == (2, 2, 4), counts


@pytest.mark.parametrize("module,argv", [("benchmarks.tpu_speed", ["--seqs", "8192"]), ("benchmarks.tpu_profile", [])])
def test_the_chip_benchmarks_refuse_off_tpu_in_one_line(module, argv, capsys, tmp_path):
    """Nothing is measured off a chip: one line, status 2, no results file written."""
    import importlib

    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU these benchmarks measure")
    out = tmp_path / "results.json"
    assert importlib.import_module(module).main(argv + (["--out", str(out)] if "tpu_speed" in module else [])) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "no TPU here" in lines[0] and "nothing measured" in lines[0], lines
    assert not out.exists()


def test_the_chip_benchmark_judges_only_the_programs_it_ran():
    """`--only stage` gives the stage's bounds and no step bound; a stage row missing from a run
    that measured the stage fails as missing (pure Python, no chip)."""
    from benchmarks.tpu_speed import STAGE_FWD_BWD_MS, STAGE_FWD_MS, evaluate_bounds

    def row(mode, ms):
        return {"program": "stage", "impl": "pallas", "mode": mode, "seq": 8192, "dtype": "bfloat16",
                "status": "ran", "median_ms": ms}

    bounds = evaluate_bounds([row("fwd", STAGE_FWD_MS / 2), row("fwd+bwd", STAGE_FWD_BWD_MS * 2)], [8192])
    assert [(b["name"], b["ok"]) for b in bounds] == [("stage fwd S=8192 pallas", True),
                                                       ("stage fwd+bwd S=8192 pallas", False)]
    (missing,) = [b for b in evaluate_bounds([row("fwd", 1.0)], [8192]) if "fwd+bwd" in b["name"]]
    assert not missing["ok"] and missing["detail"].startswith("missing")
    assert evaluate_bounds([], [8192]) == []


# ----------------------------------------------------------------------------- TPU export

# TPU has no float64 or float16 kernels: a matrix point is exported at its shapes and tiles in
# the TPU dtype of the same width class.
TPU_DTYPE = {"float64": "float32", "float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
TENSOR = re.compile(r"tensor<((?:\d+x)+)(?:f32|bf16|f16|f64)>")


def export_loss(cfg, batch: int, seq: int, dtype: str) -> str:
    """The StableHLO text of the loss's forward and backward (loss, parameter gradients),
    exported for TPU from abstract arguments (nothing runs, nothing is allocated)."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (_, s) in param_shapes(cfg).items()}
    inputs = {k: jax.ShapeDtypeStruct(s, jnp.int32 if k in ("position_ids", "segment_ids") else jnp.float32)
              for k, (_, s) in input_shapes(cfg, batch, seq).items()}

    def f(p, x):
        return jax_impl.indexer_loss_and_grads(p, x, cfg, dtype)[:2]

    return export.export(jax.jit(f), platforms=["tpu"])(params, inputs).mlir_module()


def per_head_buffers(text: str, rows: int, blocks: int, heads: int) -> list[str]:
    """Tensor types holding query rows, key blocks and the indexer's heads at once."""
    out = []
    for dims in {m.group(1) for m in TENSOR.finditer(text)}:
        shape = [int(d) for d in dims.rstrip("x").split("x")]
        if rows in shape and blocks in shape and heads in shape and len(shape) >= 3:
            out.append("x".join(map(str, shape)))
    return out


def kernel_rows(case, point) -> int:
    return min(point.qchunk, case.seq_len) if point.qchunk else case.seq_len


def _export_points(sample: str) -> list[Point]:
    """One pallas point per distinct (kernel shapes, tiles, TPU dtype) of the sample."""
    seen, out = set(), []
    for p in sorted({e.point for e in build_matrix(sample=sample, backends=["pallas"])}):
        case = CASES[p.case]
        heads = p.ichunk or case.config["index_n_heads"]
        key = (case.batch, kernel_rows(case, p), case.num_blocks, heads, case.config["index_head_dim"],
               TPU_DTYPE[p.dtype])
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


@pytest.mark.parametrize("point", _export_points(SAMPLE),
                         ids=lambda p: p.spec())
def test_the_loss_exports_for_tpu_at_a_matrix_points_tiles(point):
    case = CASES[point.case]
    dtype = TPU_DTYPE[point.dtype]
    cfg = jax_impl.CSAConfig(**{**case.config, "indexer_head_chunk": point.ichunk,
                                "loss_head_chunk": point.tchunk, "query_chunk": point.qchunk,
                                "scoring_backend": "pallas"})
    rows = kernel_rows(case, point)
    tiles = default_tiles(rows, case.num_blocks)
    text = export_loss(cfg, case.batch, case.seq_len, dtype)
    if case.num_blocks == 0:  # nothing to score: no kernel at all
        assert "tpu_custom_call" not in text
        return
    assert tiles.legal(rows, case.num_blocks, jnp.dtype(dtype).itemsize) is None
    assert text.count("tpu_custom_call") >= 3, "forward, dq/dw and dK kernels expected as Mosaic calls"


# Production shapes: DeepSeek-V4's indexer (HI=64, DI=128, m=4, YaRN), the loss walked in query
# blocks of 1024 rows (the kernels see [B, 1024, HI, DI] queries), the teacher 8 heads a step.
PRODUCTION = dict(emb_dim=4096, q_lora_rank=1024, index_n_heads=64, index_head_dim=128, rope_head_dim=64,
                  compress_ratio=4, index_topk=512, num_query_heads=64, head_dim=512, sliding_window=128,
                  loss_head_chunk=8, query_chunk=1024,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position": 65536,
                                "beta_fast": 32, "beta_slow": 1})


@pytest.mark.parametrize("seq,rows,dtype", [(8192, 1024, "bfloat16"), (8192, 1024, "float32"),
                                            (32768, 1024, "bfloat16"), (32768, 1024, "float32"),
                                            (8192, 1000, "bfloat16")])
def test_the_loss_exports_for_tpu_at_production_shape(seq, rows, dtype):
    """rows 1000: query blocks of 1000 rows, so the kernels' last row tile is partial
    (1000 = 512 + 488 in bfloat16, 3 x 256 + 232 in float32): masked in the kernels, not
    padded in HBM (bfloat16: the stricter (16, 128) rule). The tiles are the library's
    defaults for q's dtype: 512 rows in bfloat16, 256 otherwise."""
    cfg = jax_impl.CSAConfig(**{**PRODUCTION, "query_chunk": rows, "scoring_backend": "pallas"})
    w = seq // 4
    tiles = default_tiles(rows, w, dtype)
    assert (tiles.rows, tiles.keys) == (512 if dtype == "bfloat16" else 256, 256)
    assert tiles.legal(rows, w, jnp.dtype(dtype).itemsize) is None
    text = export_loss(cfg, 1, seq, dtype)
    assert text.count("tpu_custom_call") >= 3
    assert not per_head_buffers(text, rows, w, 64), per_head_buffers(text, rows, w, 64)


def test_the_xla_backend_at_production_shape_has_the_per_head_buffer():
    """The other side of the assertion above: the XLA path's logits [B, rows, HI, W] are there."""
    text = export_loss(jax_impl.CSAConfig(**PRODUCTION), 1, 8192, "bfloat16")
    assert "tpu_custom_call" not in text
    assert per_head_buffers(text, 1024, 2048, 64)


def test_illegal_tiles_are_refused_by_the_rule_and_by_the_tpu_lowering():
    assert Tiles(128, 100).legal(256, 640) == "key tile 100 is neither W=640 nor a multiple of 128"
    assert Tiles(16, 128).legal(256, 640) == "row tile 16 is neither S=256 nor a multiple of 128"
    assert Tiles(256, 128).legal(256, 640) is None
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 640, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((1, 256, 4), jnp.float32)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        export.export(jax.jit(lambda q, k, w: contribution(q, k, w, Tiles(128, 100))), platforms=["tpu"])(q, k, w)


# ----------------------------------------------------------------------------- stage plug-in

STAGE_QUANTITIES = ("stage.scores", "stage_grad.scores.q", "stage_grad.scores.keys",
                    "stage_grad.scores.head_weights")


@pytest.mark.torch
def test_the_kernels_as_a_stage_plugin_pass_and_a_planted_bug_names_the_stage(tmp_path, monkeypatch):
    for q in STAGE_QUANTITIES:
        (result,) = evaluate(Entry(Point("tiny", "float32"), "stage", q, "examples.pallas_scores"))
        assert result.status == "passed", result.message
    # The same plug-in over a copy of jax_impl whose dq kernel drops the head weight.
    mutant = next(m for m in CATALOGUE if m.name == "kernel_dq_missing_head_weight")
    patch_copy(mutant, tmp_path)
    shutil.move(tmp_path / "jax_impl", tmp_path / "csa_planted_kernel")
    (tmp_path / "planted_pallas_scores.py").write_text(
        (ROOT / "examples" / "pallas_scores.py").read_text().replace("from jax_impl.kernels", "from csa_planted_kernel.kernels"))
    monkeypatch.syspath_prepend(str(tmp_path))
    results = {q: evaluate(Entry(Point("tiny", "float32"), "stage", q, "planted_pallas_scores"))[0]
               for q in STAGE_QUANTITIES}
    assert results["stage.scores"].status == "passed"
    assert results["stage_grad.scores.q"].status == "failed"
    assert "stage_grad.scores.q (oracle): MISMATCH" in results["stage_grad.scores.q"].message


def test_a_report_says_the_kernels_ran_in_interpret_mode():
    from harness.judging.compare import status_result
    from harness.run.cli import platform_info
    from harness.run.report import markdown, record, summarise

    info = platform_info("highest", "goldens")
    assert jax.default_backend() != "tpu" and "Pallas interpret mode" in info["pallas"]
    entry = Entry(Point("tiny", "float64", backend="pallas"), "dense", "loss")
    rec = record(entry, status_result("exact64", "loss", "passed", ""))
    assert rec["backend"] == "pallas"
    text = markdown([rec], {"platform": info}, summarise([rec]))
    assert "Pallas kernels: Pallas interpret mode on cpu" in text.splitlines()[2]


def test_the_rerun_command_of_a_pallas_point_selects_exactly_that_point():
    import shlex

    from harness.run.cli import build_parser
    from harness.run.report import rerun_command

    point = Point("tiny", "float64", 2, 2, 5, backend="pallas")
    words = shlex.split(rerun_command(point, "dense"))
    assert "--backends" in words
    args = build_parser().parse_args(words[1:])
    entries = build_matrix(args.cases, args.dtypes, args.ichunks, args.tchunks, args.modes, args.impl, args.qchunks,
                           sample=args.sample, teachers=args.teachers, backends=args.backends)
    assert {e.point for e in entries} == {point}


# ----------------------------------------------------------------------------- off-chip pins

def _pallas_calls(jaxpr) -> list:
    """Every pallas_call equation in a jaxpr, through custom VJPs, conds and loops."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out.append(e)
            continue
        for p in e.params.values():
            for x in (p if isinstance(p, (tuple, list)) else (p,)):
                sub = getattr(x, "jaxpr", x)
                if hasattr(sub, "eqns"):
                    out += _pallas_calls(sub)
    return out


def _dots(jaxpr) -> list:
    """Every dot_general equation of a kernel body, through its loops and branches."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(e)
        for p in e.params.values():
            for x in (p if isinstance(p, (tuple, list)) else (p,)):
                sub = getattr(x, "jaxpr", x)
                if hasattr(sub, "eqns"):
                    out += _dots(sub)
    return out


def _traced_kernels(dtype, seq=512, heads=4, w=384, tiles=None, valid=False):
    q = jax.ShapeDtypeStruct((1, seq, heads, 128), dtype)
    k = jax.ShapeDtypeStruct((1, w, 128), dtype)
    hw = jax.ShapeDtypeStruct((1, seq, heads), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, seq, w), jnp.bool_)

    def f(q, k, hw, mask):
        out, pull = jax.vjp(lambda a, b, c: contribution(a, b, c, tiles, mask if valid else None), q, k, hw)
        # The teacher's kernels on the same operands (heads as teacher heads, keys as its blocks),
        # at the same tiles: the normaliser's max and sum, the head sum (log-sum-exp and scaled).
        live = live_tiles(mask, tiles or default_tiles(seq, w, dtype))
        m = teacher_block_max(q, k, mask, live)
        total = teacher_block_sumexp(q, k, mask, m, live)
        probs = (teacher_block_probs(q, k, mask, m, live=live), teacher_block_probs(q, k, mask, m, total, live))
        return out, *pull(out), *probs

    calls = _pallas_calls(jax.make_jaxpr(f)(q, k, hw, mask).jaxpr)
    # Each kernel twice: the Mosaic call (TPU) and the interpreted one (the default branch).
    assert sorted({c.params["name"] for c in calls}) == sorted(KERNELS)
    return calls


KERNELS = ("csa_index_scores", "csa_index_scores_dq", "csa_index_scores_dk", "csa_teacher_max", "csa_teacher_sum",
           "csa_teacher_probs")


# What each operand dtype is multiplied at: bfloat16 at DEFAULT (exact products, float32
# accumulation), float32 at HIGHEST (Mosaic's fp32 contract precision).
PRECISION_OF = {jnp.dtype(jnp.bfloat16): jax.lax.Precision.DEFAULT, jnp.dtype(jnp.float32): jax.lax.Precision.HIGHEST}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_kernel_dot_names_its_precision_and_float32_accumulation(dtype):
    """A dot without a named precision takes the global jax.default_matmul_precision; with
    HIGHEST on bfloat16 operands Mosaic refuses to compile ("Bad lhs type")."""
    calls = _traced_kernels(jnp.dtype(dtype))
    # The head sum twice (log-sum-exp and scaled forms).
    assert sum(not c.params["interpret"] for c in calls) == len(KERNELS) + 1, "each kernel's Mosaic call expected"
    for call in calls:
        dots = _dots(call.params["jaxpr"])
        assert dots, call.params["name"]
        for d in dots:
            a, b = (v.aval.dtype for v in d.invars)
            assert a == b, (call.params["name"], a, b)
            if not call.params["interpret"]:  # on the chip: the inputs' own dtype (interpret mode widens bfloat16)
                assert a == jnp.dtype(dtype), (call.params["name"], a)
            assert d.params["precision"] == (PRECISION_OF[a], PRECISION_OF[a]), (call.params["name"], d.params)
            assert d.params["preferred_element_type"] == jnp.float32, (call.params["name"], d.params)


def _block_bytes(call) -> tuple[int, int]:
    """(blocks double-buffered, scratch) bytes of a traced pallas_call, each buffer padded to
    the (sublane, 128) tile of its dtype."""
    from jax_impl.kernels.scores import padded_bytes

    gm = call.params["grid_mapping"]
    blocks = 0
    for bm in gm.block_mappings:
        shape = [d.block_size for d in bm.block_shape if hasattr(d, "block_size")]
        blocks += 2 * padded_bytes(shape, bm.array_aval.dtype)
    scratch_vars = call.params["jaxpr"].invars[len(call.params["jaxpr"].invars) - gm.num_scratch_operands:]
    scratch = sum(padded_bytes(v.aval.shape, v.aval.dtype) for v in scratch_vars)
    return blocks, scratch


@pytest.mark.parametrize("dtype,seq,heads,w,tiles", [
    ("bfloat16", 8192, 64, 2048, None), ("float32", 8192, 64, 2048, None),
    ("bfloat16", 1024, 64, 8192, None), ("float32", 1000, 8, 250, Tiles(256, 128))])
def test_no_kernel_holds_more_than_the_vmem_budget_it_declares(dtype, seq, heads, w, tiles):
    """Tracing only (make_jaxpr): the released shape at its default tiles (a whole sequence, and
    a query block of 1024 rows against 8192 key blocks) and a partial-tile shape. The
    declared budget is the Mosaic vmem_limit_bytes of each call, at most VMEM_CAP."""
    from jax_impl.kernels.scores import VMEM_CAP

    for call in _traced_kernels(jnp.dtype(dtype), seq, heads, w, tiles, valid=True):
        declared = call.params["compiler_params"].vmem_limit_bytes
        blocks, scratch = _block_bytes(call)
        assert declared <= VMEM_CAP, (call.params["name"], declared)
        assert blocks + scratch <= declared, (call.params["name"], blocks, scratch, declared)


def test_tiles_past_the_vmem_cap_are_refused():
    from jax_impl.kernels import vmem_budget

    with pytest.raises(ValueError, match="needs .* MiB of VMEM"):
        vmem_budget("dq", 64, 128, (jnp.float32,) * 4, Tiles(1024, 256))


def test_every_index_map_and_kernel_scalar_is_32_bit_under_x64():
    """Mosaic refuses 64-bit block indices ("failed to legalize operation 'func.func'"), and the
    tests run with jax_enable_x64: a literal 0 in an index map would be int64 there."""
    assert jax.config.jax_enable_x64
    for call in _traced_kernels(jnp.dtype(jnp.bfloat16), valid=True):
        for bm in call.params["grid_mapping"].block_mappings:
            outs = [v.aval.dtype for v in bm.index_map_jaxpr.jaxpr.outvars]
            assert all(d == jnp.int32 for d in outs), (call.params["name"], outs)
        body = call.params["jaxpr"]
        wide_ints = {str(v.aval.dtype) for e in _all_eqns(body) for v in e.outvars
                     if hasattr(v.aval, "dtype") and v.aval.dtype == jnp.int64}
        assert not wide_ints, call.params["name"]


def _all_eqns(jaxpr) -> list:
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for p in e.params.values():
            for x in (p if isinstance(p, (tuple, list)) else (p,)):
                sub = getattr(x, "jaxpr", x)
                if hasattr(sub, "eqns"):
                    out += _all_eqns(sub)
    return out


@pytest.mark.parametrize("s,w", [(3, 0), (0, 5)])
def test_a_mask_over_no_rows_or_no_blocks_builds_an_empty_table(s, w):
    """No key blocks (S < m) or no rows: the live table has no tiles on that axis, and the
    scores are the empty sum, as without a mask."""
    from jax_impl.kernels import live_tiles

    valid = jnp.ones((2, s, w), bool)
    table = live_tiles(valid, Tiles(4, 4)).table()
    assert all(bool(jnp.all(a == 0)) for a in table[1:])
    out = contribution(jnp.ones((2, s, 2, 8)), jnp.ones((2, w, 8)), jnp.ones((2, s, 2)), valid=valid)
    assert out.shape == (2, s, w)


def _forward_form(form, w, seed):
    """A causal problem (S=512, 4 heads, w key blocks, bfloat16) for one form of
    benchmarks.forward_forms, run in interpret mode: (q, keys, hw, valid, live, the form's
    output)."""
    from benchmarks.forward_forms import form_call, parse

    kind, ts, tw, per, chunk = parse(form)
    s, c = 512, 4
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (1, s, c, 128), jnp.float32).astype(jnp.bfloat16)
    keys = jax.random.normal(kk, (1, w, 128), jnp.float32).astype(jnp.bfloat16)
    hw = jax.random.normal(kw, (1, s, c), jnp.float32)
    valid = jnp.arange(w)[None, None, :] * 4 + 4 <= jnp.arange(s)[None, :, None] + 1
    live = live_tiles(valid, Tiles(ts, tw, per))
    return q, keys, hw, valid, live, form_call(kind, ts, tw, per, chunk, live.table(), q, keys, hw, interpret=True)


@pytest.mark.parametrize("form", ["grp:256x128u2", "kst:256x128g1", "kst:256x128g2", "kss:256x128g2",
                                  "chkA:256x128u2c64", "chkB:256x128u2c64"])
def test_every_form_the_forward_benchmark_times_computes_the_kernels_sum(form):
    """`python -m benchmarks.forward_forms` times these forms on a chip beside the kernels; a
    time means something only if the form computes the same causal sum (interpret mode here,
    two row tiles, the second partly past the diagonal). They differ from the kernels only in
    the order of the float32 head sum: measured at most 5e-8 normwise at this shape."""
    q, keys, hw, valid, live, got = _forward_form(form, w=128, seed=3)
    got = jnp.where(valid, got, 0)
    want = jnp.where(valid, contribution(q, keys, hw, valid=live), 0)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 1e-6


@pytest.mark.parametrize("form", ["mxa:256x128u2", "mxb:256x128g2"])
def test_the_forward_benchmarks_products_alone_are_the_head_summed_products_on_the_live_tiles(form):
    """The forward benchmark's `mxa` and `mxb` forms (the forward's products without ReLU and
    head weights, timed beside the kernels on a chip) compute sum_h q_h . K on the live tiles
    and 0 on the dead ones (interpret mode; row tile 1 of 2 has a dead key tile)."""
    q, keys, _, valid, live, got = _forward_form(form, w=256, seed=4)
    s, w, (ts, tw) = q.shape[1], keys.shape[1], (live.tiles.rows, live.tiles.keys)
    got = np.asarray(got)
    want = np.einsum("bshd,bjd->bsj", np.asarray(q, np.float64), np.asarray(keys, np.float64))
    tile_live = np.asarray(valid).reshape(1, s // ts, ts, w // tw, tw).any(axis=(2, 4))
    on = np.repeat(np.repeat(tile_live, ts, axis=1), tw, axis=2)
    assert 0 < on.mean() < 1, "the problem has live and dead tiles"
    np.testing.assert_allclose(got[on], want[on], rtol=1e-5, atol=1e-4)
    assert np.all(got[~on] == 0)

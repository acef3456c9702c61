"""Bad input catalogue: every bad input gets a clear error naming the field or
file, the value and the rule, on the library API of both sides and on the CLI (exit code 2,
exactly one line on stderr, no traceback); a legal input gets a correct result.

Already covered elsewhere, and not repeated here:
  - torch_ref: every config rule and its exact message (tests/test_torch_ref.py CONFIG_ERRORS),
    unknown / missing config keys, dtype names, every input check (INPUT_ERRORS: wrong shape
    and rank, float positions, NaN/Inf, decreasing and negative positions, missing tensors,
    parameter shapes and dtypes), packed rows accepted;
  - the fixture loader (library side): missing, truncated, corrupt header / not safetensors,
    old schema, missing or unexpected tensor, shape, dtype, sha mismatch, manifest missing
    (tests/test_fixtures.py test_error_*);
  - the CLI: unknown case, a non-divisor indexer chunk, a negative teacher chunk, an
    unsupported dtype, an implementation that cannot be imported or lacks its factory, an
    unwritable report directory (tests/test_cli.py test_user_errors_exit_2_with_one_line).
Here: the jax_impl side of those same catalogues (the messages are identical by
docs/plugins.md, so they are imported, not copied), the entries neither catalogue
holds, the value checks of a fixture (NaN / Inf / decreasing positions in a file whose
sha matches: a fixture error, never a parity pass or failure), and the CLI side of every
fixture error and of the remaining chunk errors.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

import importlib

import jax_impl
from harness.problems.fixtures import (FIXTURES_DIR, FixtureError, load_case, read_manifest, read_safetensors,
                                       sha256_of, write_manifest, write_safetensors)
from harness.run import cli
from error_catalogue import (
    CONFIG_ERRORS,
    INPUT_ERRORS,
    SMALL,
    TEACHER_INPUT_ERRORS,
    make_inputs,
    make_params,
)


class _TorchSide:
    """torch_ref, imported when a torch-side test first uses it (this module also runs
    without torch: the jax side of every catalogue needs none)."""

    def __getattr__(self, name):
        return getattr(importlib.import_module("torch_ref"), name)


SIDES = [pytest.param(jax_impl, id="jax"), pytest.param(_TorchSide(), id="torch", marks=pytest.mark.torch)]
CHUNK_VALID = "(valid: 0, 1, 2, 4, 8)"

# ----------------------------------------------------------------------------- config

# Bad configs that test_torch_ref's CONFIG_ERRORS lacks; run on both sides.
MORE_CONFIG_ERRORS = [
    (dict(loss_head_chunk=16), f"loss_head_chunk=16 must divide num_query_heads=8 {CHUNK_VALID}"),
    (dict(loss_head_chunk=-1), f"loss_head_chunk=-1 must divide num_query_heads=8 {CHUNK_VALID}"),
    (dict(indexer_head_chunk=-1), f"indexer_head_chunk=-1 must divide index_n_heads=8 {CHUNK_VALID}"),
    (dict(q_lora_rank=0), "q_lora_rank=0 must be >= 1"),
    (dict(index_head_dim=0), "index_head_dim=0 must be >= 1"),
    (dict(head_dim=-3), "head_dim=-3 must be >= 1"),
    (dict(index_topk=-4), "index_topk=-4 must be >= 1"),
    (dict(rope_head_dim=5), "rope_head_dim=5 must be even"),
    (dict(rope_head_dim=34), "rope_head_dim=34 must satisfy 0 <= rope_head_dim <= index_head_dim=32"),
]


@pytest.mark.parametrize("over,message", CONFIG_ERRORS, ids=[m for _, m in CONFIG_ERRORS])
def test_jax_config_rule_has_the_same_message(over, message):
    with pytest.raises(ValueError) as e:
        jax_impl.CSAConfig(**{**SMALL, **over})
    assert str(e.value) == message


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("over,message", MORE_CONFIG_ERRORS, ids=[m for _, m in MORE_CONFIG_ERRORS])
def test_config_rule(side, over, message):
    with pytest.raises(ValueError) as e:
        side.CSAConfig.from_dict({**SMALL, **over})
    assert str(e.value) == message


@pytest.mark.parametrize("side", SIDES)
def test_config_legal_edges_are_accepted(side):
    """The legal ends of each rule: chunk = 0 or the head count, DR = 0 or DI, k > W later."""
    for over in (dict(indexer_head_chunk=8, loss_head_chunk=8), dict(indexer_head_chunk=0, loss_head_chunk=1),
                 dict(rope_head_dim=0), dict(rope_head_dim=32), dict(compress_ratio=1, index_topk=1)):
        cfg = side.CSAConfig.from_dict({**SMALL, **over})
        assert side.CSAConfig.from_dict(cfg.to_dict()) == cfg


def test_jax_from_dict_unknown_and_missing_keys():
    valid = ", ".join(jax_impl.CSAConfig.__dataclass_fields__)
    with pytest.raises(ValueError) as e:
        jax_impl.CSAConfig.from_dict({**SMALL, "foo": 1})
    assert str(e.value) == f"unknown config field 'foo' (valid: {valid})"
    d = dict(SMALL)
    del d["emb_dim"]
    with pytest.raises(ValueError) as e:
        jax_impl.CSAConfig.from_dict(d)
    assert str(e.value) == "missing config field 'emb_dim'"


# ----------------------------------------------------------------------------- dtype names


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", ["int8", "bf16", "float", "float8_e4m3fn", None])
def test_unsupported_dtype_name(side, name):
    message = f"dtype={name!r} is not supported (valid: float32, bfloat16, float16, float64)"
    with pytest.raises(ValueError) as e:
        side.resolve_dtype(name)
    assert str(e.value) == message
    cfg = side.CSAConfig(**SMALL)
    with pytest.raises(ValueError) as e:  # through the entry point, before any computation
        side.indexer_loss_and_grads(make_params(cfg), make_inputs(cfg, 1, 8), cfg, name)
    assert str(e.value) == message


# ----------------------------------------------------------------------------- inputs


def _set(name, value):
    def mutate(inputs, params):
        inputs[name] = value(inputs[name])
    return mutate


def _at(name, index, value):
    def mutate(inputs, params):
        inputs[name] = inputs[name].copy()
        inputs[name][index] = value
    return mutate


# Bad inputs that test_torch_ref's INPUT_ERRORS lacks (same B=2, S=64 problem).
MORE_INPUT_ERRORS = [
    (_at("teacher_query", (1, 5, 2, 0), np.nan), "inputs['teacher_query'] contains NaN/Inf at index (1, 5, 2, 0)"),
    (_at("q_latent", (0, 0, 0), np.inf), "inputs['q_latent'] contains NaN/Inf at index (0, 0, 0)"),
    (_set("q_latent", lambda a: a[0]),
     "inputs['q_latent'] has shape (64, 32); expected [B, S, q_lora_rank] = [2, 64, 32]"),
    (_set("teacher_kv", lambda a: a[..., None]),
     "inputs['teacher_kv'] has shape (2, 16, 32, 1); expected [B, W, head_dim] = [2, 16, 32]"),
    (_set("position_ids", lambda a: a.astype(np.float64)),
     "inputs['position_ids'] has dtype float64; expected an integer dtype"),
    (_set("hidden_states", lambda a: a.astype(np.complex64)),
     "inputs['hidden_states'] has dtype complex64; expected a floating dtype"),
]


# The rules that need values (NaN/Inf, negative or decreasing positions): jax_impl checks them
# on the host in validate_inputs only; every other rule is structure (names, shapes, dtypes),
# checked by the traceable entry points too, concrete or traced.
VALUE_RULES = ("contains NaN/Inf", "contains NaN or +Inf", "negative position", "decreases inside a document")


def _is_value_rule(message):
    return any(rule in message for rule in VALUE_RULES)


@pytest.mark.parametrize("mutate,message", INPUT_ERRORS, ids=[m for _, m in INPUT_ERRORS])
def test_jax_input_check_has_the_same_message(mutate, message):
    """validate_inputs gives torch's message for every rule; a structure rule is also raised by
    the entry point itself, before anything runs (a value rule is host-side only: documented,
    and asserted here so that it cannot silently move)."""
    cfg = jax_impl.CSAConfig(**SMALL)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    mutate(inputs, params)
    with pytest.raises(ValueError) as e:
        jax_impl.validate_inputs(params, inputs, cfg)
    assert str(e.value) == message
    if not _is_value_rule(message):
        with pytest.raises(ValueError) as e:
            jax_impl.indexer_loss_and_grads(params, inputs, cfg, "float32")
        assert str(e.value) == message


# Where two faults of different kinds meet, each side names its first: torch checks float
# values before the integer dtypes, jax_impl every structure rule (its entry points run them,
# traced) before any value. One entry of TEACHER_INPUT_ERRORS has such a pair.
JAX_FIRST_FAULT = {
    "inputs['attention_sink'] contains NaN or +Inf at index (0,) (-inf is allowed: no sink)":
        "inputs['segment_ids'] has dtype float64; expected an integer dtype",
}


@pytest.mark.parametrize("over,mutate,message", TEACHER_INPUT_ERRORS,
                         ids=[m for _, _, m in TEACHER_INPUT_ERRORS])
def test_jax_teacher_input_check_has_the_same_message(over, mutate, message):
    """The joint teacher's inputs, under the config that reads them: torch's message from
    validate_inputs, and for a structure rule from the entry point too, eager and under jit
    (a missing input has no traced form: jit sees the dict without it, the same line)."""
    cfg = jax_impl.CSAConfig(**{**SMALL, **over})
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    mutate(inputs, params)
    message = JAX_FIRST_FAULT.get(message, message)
    with pytest.raises(ValueError) as e:
        jax_impl.validate_inputs(params, inputs, cfg)
    assert str(e.value) == message
    if not _is_value_rule(message):
        with pytest.raises(ValueError) as e:
            jax_impl.indexer_loss_and_grads(params, inputs, cfg, "float32")
        assert str(e.value) == message
        with pytest.raises(ValueError) as e:
            jax.jit(lambda p, x: jax_impl.indexer_loss(p, x, cfg, "float32"))(params, inputs)
        assert str(e.value) == message


@pytest.mark.parametrize("side", SIDES)
def test_sink_of_minus_inf_is_accepted(side):
    """-inf is a head without a sink (SPEC section 8), the one non-finite value an input may
    hold; every sink -inf with a window still gives a finite loss and gradients."""
    cfg = side.CSAConfig(**{**SMALL, "sliding_window": 4})
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    for sink in ([-np.inf] + [0.5] * 7, [-np.inf] * 8):
        x = dict(inputs, attention_sink=np.array(sink, np.float32))
        if side is jax_impl:
            jax_impl.validate_inputs(params, x, cfg)
        else:
            side.validate_inputs(x, cfg)
        loss, pg, _ = side.indexer_loss_and_grads(params, x, cfg, "float32")
        assert np.isfinite(float(loss))
        assert all(np.isfinite(np.asarray(g)).all() for g in pg.values())


@pytest.mark.parametrize("side", SIDES)
def test_teacher_inputs_are_required_only_when_the_config_reads_them(side):
    """The compressed teacher reads neither new input; the joint one without a window reads
    the sink alone; the forward pass reads neither. One not read is not checked either."""
    base = make_inputs(side.CSAConfig(**SMALL), 2, 64)
    bare = {k: v for k, v in base.items() if k not in ("teacher_window_kv", "attention_sink")}
    junk = dict(bare, attention_sink=np.full(3, np.nan, np.float32),
                teacher_window_kv=np.full((2, 5, 32), np.inf, np.float32))

    def loss(cfg, inputs):
        return float(side.indexer_loss_and_grads(make_params(cfg), inputs, cfg, "float32")[0])

    comp = side.CSAConfig(**{**SMALL, "sliding_window": 4, "teacher_normaliser": "compressed"})
    assert loss(comp, bare) == loss(comp, junk) and np.isfinite(loss(comp, bare))
    joint = side.CSAConfig(**SMALL)  # no window: the sink only
    sink_only = dict(bare, attention_sink=base["attention_sink"])
    assert np.isfinite(loss(joint, sink_only))
    assert loss(joint, sink_only) == loss(joint, dict(sink_only, teacher_window_kv=junk["teacher_window_kv"]))
    windowed = side.CSAConfig(**{**SMALL, "sliding_window": 4})
    for cfg in (comp, joint, windowed):
        side.indexer_forward(make_params(cfg), junk, cfg, "float32")
    with pytest.raises(ValueError) as e:
        side.indexer_loss_and_grads(make_params(windowed), sink_only, windowed, "float32")
    assert str(e.value) == "missing input 'teacher_window_kv'"


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mutate,message", MORE_INPUT_ERRORS, ids=[m for _, m in MORE_INPUT_ERRORS])
def test_input_check(side, mutate, message):
    cfg = side.CSAConfig(**SMALL)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    mutate(inputs, params)
    with pytest.raises(ValueError) as e:
        if side is jax_impl and _is_value_rule(message):
            jax_impl.validate_inputs(params, inputs, cfg)  # host-side only on the jax side
        else:
            side.indexer_loss_and_grads(params, inputs, cfg, "float32")
    assert str(e.value) == message


# Structure faults (shape, rank, dtype) under jax.jit and jax.vmap:
# the same one line, raised while tracing.
TRACED_ERRORS = [(mutate, message) for mutate, message in INPUT_ERRORS + MORE_INPUT_ERRORS
                 if not _is_value_rule(message) and "missing" not in message]


@pytest.mark.parametrize("mutate,message", TRACED_ERRORS, ids=[m for _, m in TRACED_ERRORS])
def test_jax_structure_error_is_the_same_line_when_traced(mutate, message):
    cfg = jax_impl.CSAConfig(**SMALL)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    mutate(inputs, params)
    # Under jit every leaf is a tracer; int64 positions are traced as int32 without x64.
    loss = jax.jit(lambda p, x: jax_impl.indexer_loss(p, x, cfg, "float32"))
    with pytest.raises(ValueError) as e:
        loss(params, inputs)
    assert str(e.value) == message
    stack = {k: np.stack([v, v]) for k, v in params.items()}, {k: np.stack([v, v]) for k, v in inputs.items()}
    with pytest.raises(ValueError) as e:  # vmap over two stacked problems: the rule is per problem
        jax.vmap(lambda p, x: jax_impl.indexer_loss(p, x, cfg, "float32"))(*stack)
    assert str(e.value) == message


def test_jax_wrong_shape_under_jit_and_vmap_names_the_argument():
    """A wrong shape inside jax.jit, and inside jax.vmap (where the rule
    applies to one problem of the stack), is one line naming the argument, shape and rule."""
    cfg = jax_impl.CSAConfig(**SMALL)
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 64)
    bad = dict(inputs, q_latent=inputs["q_latent"][:, :, :31])
    with pytest.raises(ValueError) as e:
        jax.jit(lambda p, x: jax_impl.indexer_forward(p, x, cfg, "float32"))(params, bad)
    assert str(e.value) == "inputs['q_latent'] has shape (2, 64, 31); expected [B, S, q_lora_rank] = [2, 64, 32]"
    stacked = {k: np.stack([v, v]) for k, v in bad.items()}
    with pytest.raises(ValueError) as e:
        jax.vmap(lambda x: jax_impl.indexer_loss(params, x, cfg, "float32"))(stacked)
    assert str(e.value) == "inputs['q_latent'] has shape (2, 64, 31); expected [B, S, q_lora_rank] = [2, 64, 32]"


def test_jax_value_checks_refuse_a_tracer_instead_of_skipping():
    """validate_inputs reads values; handed a tracer it says so, it never passes silently."""
    cfg = jax_impl.CSAConfig(**SMALL)
    params, inputs = make_params(cfg), make_inputs(cfg, 1, 16)
    with pytest.raises(ValueError) as e:
        jax.jit(lambda x: jax_impl.validate_inputs(params, x, cfg))(inputs)
    assert str(e.value).startswith("inputs['hidden_states'] is a traced value: validate_inputs reads values")


CHECKIFY_ERRORS = [
    (_at("q_latent", (0, 3, 1), np.nan), "inputs['q_latent'] contains NaN/Inf at index (0, 3, 1)"),
    (lambda inputs, params: params["indexer.wgate"].__setitem__((5, 7), np.inf),
     "params['indexer.wgate'] contains NaN/Inf at index (5, 7)"),
    (_at("position_ids", (1, 0), -1), "inputs['position_ids'] has a negative position -1 at (b, s)=(1, 0)"),
    (_at("position_ids", (0, 5), 3), "inputs['position_ids'] decreases inside a document at (b, s)=(0, 5): 4 -> 3"),
    (_at("attention_sink", 6, np.nan),
     "inputs['attention_sink'] contains NaN or +Inf at index (6,) (-inf is allowed: no sink)"),
    (_at("attention_sink", 1, np.inf),
     "inputs['attention_sink'] contains NaN or +Inf at index (1,) (-inf is allowed: no sink)"),
    (_at("teacher_window_kv", (1, 9, 4), -np.inf), "inputs['teacher_window_kv'] contains NaN/Inf at index (1, 9, 4)"),
]


CHECKIFY_CFG = {**SMALL, "sliding_window": 4}  # every input read, the window's too


@pytest.fixture(scope="module")
def checkified():
    """The checkified, jitted loss of one problem size, compiled once for every case below (the
    values differ, the program does not), and whether the clean problem passed through it."""
    from jax.experimental import checkify

    cfg = jax_impl.CSAConfig(**CHECKIFY_CFG)

    def checked(p, x):
        jax_impl.checkify_inputs(p, x, cfg)
        return jax_impl.indexer_loss(p, x, cfg, "float32")

    run = jax.jit(checkify.checkify(checked, errors=checkify.user_checks))
    return cfg, run


def _checkify_problem(cfg):
    params, inputs = make_params(cfg), make_inputs(cfg, 2, 16)
    inputs["attention_sink"][0] = -np.inf  # allowed: no sink for head 0
    return params, inputs


@pytest.mark.parametrize("mutate,message", CHECKIFY_ERRORS, ids=[m for _, m in CHECKIFY_ERRORS])
def test_jax_checkify_variant_reports_the_value_rule_inside_jit(checkified, mutate, message):
    cfg, run = checkified
    params, inputs = _checkify_problem(cfg)
    err, loss = run(params, inputs)
    assert err.get() is None and np.isfinite(loss)  # the clean problem passes
    mutate(inputs, params)
    err, _ = run(params, inputs)
    assert err.get() is not None and err.get().startswith(message), err.get()
    with pytest.raises(ValueError) as e:  # the host check says the same
        jax_impl.validate_inputs(params, inputs, cfg)
    assert str(e.value) == message


def test_jax_accepts_positions_that_restart_at_a_document():
    cfg = jax_impl.CSAConfig(**SMALL)
    inputs = make_inputs(cfg, 2, 64, docs=[20, 44])
    jax_impl.validate_inputs(None, inputs, cfg)  # legal: a new document restarts at 0


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def copy_dir(tmp_path):
    dst = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, dst)
    return dst


def _rewrite(path, replace, fix_manifest=True):
    """Replace tensors of a fixture file; by default keep MANIFEST.json consistent, so only
    the value check can object."""
    tensors, md = read_safetensors(path.read_bytes())
    tensors.update(replace)
    data = write_safetensors(tensors, md)
    path.write_bytes(data)
    if fix_manifest:
        manifest = read_manifest(path.parent)
        manifest["cases"][path.stem].update(sha256=sha256_of(data), bytes=len(data))
        write_manifest(path.parent, manifest["cases"])


def _array(path, name):
    return read_safetensors(path.read_bytes())[0][name].array()


def _nan_input(d):
    q = _array(d / "tiny.safetensors", "q_latent")
    q[0, 3, 1] = np.nan
    _rewrite(d / "tiny.safetensors", {"q_latent": q})


def _inf_teacher(d):
    kv = _array(d / "tiny.safetensors", "teacher_kv")
    kv[0, 2, 5] = -np.inf
    _rewrite(d / "tiny.safetensors", {"teacher_kv": kv})


def _sink_at(value):
    def damage(d):
        sink = _array(d / "tiny.safetensors", "attention_sink")
        sink[1] = value
        _rewrite(d / "tiny.safetensors", {"attention_sink": sink})
    damage.__name__ = f"_{value}_sink"
    return damage


def _inf_window(d):
    kv = _array(d / "tiny.safetensors", "teacher_window_kv")
    kv[0, 7, 3] = np.inf
    _rewrite(d / "tiny.safetensors", {"teacher_window_kv": kv})


def _nan_param(d):
    w = _array(d / "tiny.safetensors", "indexer.wq_b")
    w[1, 2] = np.nan
    _rewrite(d / "tiny.safetensors", {"indexer.wq_b": w})


def _decreasing_positions(d):
    pos = _array(d / "tiny.safetensors", "position_ids")
    pos[0, 6] = 2
    _rewrite(d / "tiny.safetensors", {"position_ids": pos})


def _nan_golden(d):
    g = _array(d / "tiny.safetensors", "golden.float32.loss.sparse")
    _rewrite(d / "tiny.safetensors", {"golden.float32.loss.sparse": np.full_like(g, np.nan)})


def _inf_golden(d):
    g = _array(d / "tiny.safetensors", "golden.float64.compressed_keys")
    g[0, 1, 2] = -np.inf  # -inf is legal in index_scores only
    _rewrite(d / "tiny.safetensors", {"golden.float64.compressed_keys": g})


def _pick_out_of_range(d):
    g = _array(d / "tiny.safetensors", "golden.float64.topk_indices")
    g[0, 15, 0] = 4  # W = 4
    _rewrite(d / "tiny.safetensors", {"golden.float64.topk_indices": g})


# A fixture whose sha matches MANIFEST.json but whose values no valid fixture holds:
# harness.problems.fixtures refuses it at load (the parity run must not judge NaN as pass or fail).
VALUE_ERRORS = [
    (_nan_input, "tensor 'q_latent' holds nan at index (0, 3, 1) (inputs and parameters must be finite)"),
    (_inf_teacher, "tensor 'teacher_kv' holds -inf at index (0, 2, 5) (inputs and parameters must be finite)"),
    (_nan_param, "tensor 'indexer.wq_b' holds nan at index (1, 2) (inputs and parameters must be finite)"),
    (_sink_at(np.nan), "tensor 'attention_sink' holds nan at index (1,) (a sink logit is finite or -inf)"),
    (_sink_at(np.inf), "tensor 'attention_sink' holds inf at index (1,) (a sink logit is finite or -inf)"),
    (_inf_window, "tensor 'teacher_window_kv' holds inf at index (0, 7, 3) (inputs and parameters must be finite)"),
    (_decreasing_positions,
     "tensor 'position_ids' holds 2 at index (0, 6) (positions must not decrease inside a document)"),
    (_nan_golden, "tensor 'golden.float32.loss.sparse' holds nan (goldens must be finite, but for -inf at "
                  "the invalid blocks of index_scores)"),
    (_inf_golden, "tensor 'golden.float64.compressed_keys' holds -inf at index (0, 1, 2) (goldens must be "
                  "finite, but for -inf at the invalid blocks of index_scores)"),
    (_pick_out_of_range,
     "tensor 'golden.float64.topk_indices' holds 4 at index (0, 15, 0) (picks must satisfy -1 <= pick < W = 4)"),
]


@pytest.mark.parametrize("damage,message", VALUE_ERRORS, ids=[d.__name__[1:] for d, _ in VALUE_ERRORS])
def test_fixture_value_error(copy_dir, damage, message):
    damage(copy_dir)
    with pytest.raises(FixtureError) as e:
        load_case("tiny", copy_dir)
    msg = str(e.value)
    assert msg.startswith(f"{copy_dir}/tiny.safetensors: {message}: restore it with `git checkout --"), msg
    assert "--case tiny" in msg


def test_fixture_sink_of_minus_inf_is_loaded(copy_dir):
    """-inf is a head without a sink: a fixture may hold it (window_only holds it for every head)."""
    _sink_at(-np.inf)(copy_dir)
    case = load_case("tiny", copy_dir)
    assert case.inputs["attention_sink"][1] == -np.inf
    assert (load_case("window_only").inputs["attention_sink"] == -np.inf).all()


# ----------------------------------------------------------------------------- CLI


def _cli(capfd, argv) -> tuple[int, list[str]]:
    """harness.run.cli.main in this process; (exit code, stderr lines). capfd also catches
    what a spawned worker writes to the inherited stderr."""
    code = cli.main(argv)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return code, err.strip().splitlines()


def _assert_user_error(code, lines, *needles):
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("csa-parity: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


CLI_CHUNK_ERRORS = [
    (["--ichunks", "-2"], f"case 'small': indexer_head_chunk=-2 must divide index_n_heads=8 {CHUNK_VALID}"),
    (["--ichunks", "16"], f"case 'small': indexer_head_chunk=16 must divide index_n_heads=8 {CHUNK_VALID}"),
    (["--tchunks", "3"], f"case 'small': loss_head_chunk=3 must divide num_query_heads=8 {CHUNK_VALID}"),
    (["--tchunks", "16"], f"case 'small': loss_head_chunk=16 must divide num_query_heads=8 {CHUNK_VALID}"),
    (["--qchunks", "-1"], "query_chunk=-1 must be an int >= 0 (0 = all rows)"),
]


@pytest.mark.parametrize("args,message", CLI_CHUNK_ERRORS, ids=["ichunk-negative", "ichunk-too-large",
                                                                "tchunk-not-divisor", "tchunk-too-large",
                                                                "qchunk-negative"])
def test_cli_chunk_error(capfd, tmp_path, args, message):
    code, lines = _cli(capfd, ["run", "--cases", "small", "--no-progress", "--out", str(tmp_path), *args])
    _assert_user_error(code, lines, message)


def test_cli_implementation_without_the_protocol(capfd, tmp_path):
    code, lines = _cli(capfd, ["run", "--impl", "json", "--no-progress", "--out", str(tmp_path)])
    _assert_user_error(code, lines, "implementation 'json' lacks CSAConfig, indexer_forward or "
                                    "indexer_loss_and_grads (the protocol of docs/plugins.md")


def _missing(d):
    (d / "tiny.safetensors").unlink()


def _truncated(d):
    p = d / "tiny.safetensors"
    p.write_bytes(p.read_bytes()[:1000])


def _not_safetensors(d):
    (d / "tiny.safetensors").write_text("this is not a safetensors file, just some text\n")


def _old_schema(d):
    p = d / "tiny.safetensors"
    tensors, md = read_safetensors(p.read_bytes())
    p.write_bytes(write_safetensors(tensors, {**md, "schema_version": "0"}))


def _missing_tensor(d):
    p = d / "tiny.safetensors"
    tensors, md = read_safetensors(p.read_bytes())
    del tensors["golden.float64.loss.dense"]
    p.write_bytes(write_safetensors(tensors, md))


def _wrong_shape(d):
    p = d / "tiny.safetensors"
    _rewrite(p, {"hidden_states": _array(p, "hidden_states")[:, :, :-1]}, fix_manifest=False)


def _sha_mismatch(d):
    p = d / "tiny.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor's data
    p.write_bytes(bytes(data))


def _manifest_missing(d):
    (d / "MANIFEST.json").unlink()


CLI_FIXTURE_ERRORS = [
    (_missing, ["tiny.safetensors is missing: run `csa-parity regenerate --case tiny"]),
    (_truncated, ["tiny.safetensors is truncated or corrupt (", "restore it with `git checkout --"]),
    (_not_safetensors, ["tiny.safetensors is truncated or corrupt (the header claims"]),
    (_old_schema, ["tiny.safetensors has schema version '0', this harness reads schema version 4"]),
    (_missing_tensor, ["tiny.safetensors has no tensor 'golden.float64.loss.dense'"]),
    (_wrong_shape, ["tensor 'hidden_states' is [1, 16, 15] float32, but case 'tiny'",
                    "implies [B, S, emb_dim] = [1, 16, 16] float32"]),
    (_sha_mismatch, ["tiny.safetensors does not match", "MANIFEST.json: expected sha256"]),
    (_manifest_missing, ["MANIFEST.json is missing"]),
    (_nan_input, ["tiny.safetensors: tensor 'q_latent' holds nan at index (0, 3, 1) "
                  "(inputs and parameters must be finite)"]),
    (_decreasing_positions, ["tensor 'position_ids' holds 2 at index (0, 6) "
                             "(positions must not decrease inside a document)"]),
]


@pytest.mark.parametrize("damage,needles", CLI_FIXTURE_ERRORS, ids=[d.__name__[1:] for d, _ in CLI_FIXTURE_ERRORS])
def test_cli_fixture_error(capfd, monkeypatch, copy_dir, tmp_path, damage, needles):
    """A damaged copy of the fixtures, pointed to by CSA_PARITY_FIXTURES: exit 2, one line
    naming the file, what is wrong and the fix (goldens reference: no torch needed)."""
    damage(copy_dir)
    monkeypatch.setenv("CSA_PARITY_FIXTURES", str(copy_dir))
    code, lines = _cli(capfd, ["run", "--cases", "tiny", "--dtypes", "float64", "--ichunks", "0",
                               "--tchunks", "0", "--modes", "forward", "--reference", "goldens",
                               "--no-progress", "--jobs", "1", "--out", str(tmp_path / "rep")])
    _assert_user_error(code, lines, str(copy_dir), *needles)
    assert not (tmp_path / "rep" / "parity.json").exists()  # no report of a run that did not happen


def test_cli_nan_fixture_is_an_input_error_whatever_the_implementation(capfd, monkeypatch, copy_dir, tmp_path):
    """A plug-in that validates nothing still never sees the NaN: the harness refuses the file."""
    _nan_input(copy_dir)
    monkeypatch.setenv("CSA_PARITY_FIXTURES", str(copy_dir))
    code, lines = _cli(capfd, ["run", "--cases", "tiny", "--dtypes", "float64", "--ichunks", "0", "--tchunks", "0",
                               "--modes", "dense", "--reference", "goldens", "--impl", "plugins.scaled_loss:make_impl",
                               "--no-progress", "--jobs", "1", "--out", str(tmp_path / "rep")])
    _assert_user_error(code, lines, "tensor 'q_latent' holds nan at index (0, 3, 1)")
    manifest = json.loads((copy_dir / "MANIFEST.json").read_text())
    assert manifest["cases"]["tiny"]["sha256"] == sha256_of((copy_dir / "tiny.safetensors").read_bytes())


def test_cli_fixture_error_is_one_line_with_the_progress_bar(capfd, monkeypatch, copy_dir, tmp_path):
    _missing(copy_dir)
    monkeypatch.setenv("CSA_PARITY_FIXTURES", str(copy_dir))
    code, lines = _cli(capfd, ["run", "--cases", "tiny", "--dtypes", "float64", "--ichunks", "0", "--tchunks", "0",
                               "--modes", "forward", "--reference", "goldens", "--jobs", "1",
                               "--out", str(tmp_path / "rep")])
    _assert_user_error(code, lines, "tiny.safetensors is missing")

"""Random whole problems, property-based: every config field, shape and layout the
fixed catalogue cannot reach, float64 JAX vs float64 torch at the exactness bound and chunked
vs native at the chunk bound, forward, loss and gradients (harness/problems/random_configs.py judges).

Profiles (HYPOTHESIS_PROFILE, default `ci`):
  ci       derandomised (the same examples on every run and machine), CI_EXAMPLES examples
           (half dense, half sparse), no shrinking (a failure prints its reproducer at once);
  nightly  NIGHTLY_EXAMPLES fresh random examples, shrinking on: for the nightly TPU job
           (HYPOTHESIS_PROFILE=nightly pytest tests/test_random_configs.py).

A failing example prints the problem as one line of JSON (config, sizes, documents, data seed,
low dtype) and two commands that rerun exactly it:
  python -m harness.problems.random_configs --repro '<json>'
  pytest tests/test_random_configs.py --repro '<json>'

Cost: every example compiles 2 programs per JAX configuration and dtype (forward, loss and
gradients), 2-8 in all: about 1 CPU-second each on this project's CPUs (a few ms of
arithmetic: the shapes are tiny). The pinned problems (harness.problems.random_configs.PINNED) run as
tests of their own, so xdist spreads them.
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a dev dependency: pip install -c constraints.txt -e '.[dev]'")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from harness.problems.cases import CONFIG_FIELDS  # noqa: E402
from harness.problems.matrix import divisors  # noqa: E402  (the harness's one divisor rule)
from harness.problems.random_configs import PINNED, Problem, check_problem  # noqa: E402

# 8 in CI (4 dense, 4 sparse): with the window, the sink and YaRN an example compiles larger
# programs (the dense test's 6 took 280 s of the side process, CI's critical path); the
# mutants that only a random problem reveals run on the PINNED problems, which always run, and
# the nightly profile explores 200 fresh ones.
CI_EXAMPLES = 8
NIGHTLY_EXAMPLES = 200

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=CI_EXAMPLES // 2, derandomize=True,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("nightly", max_examples=NIGHTLY_EXAMPLES // 2, derandomize=False, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


@st.composite
def documents(draw, batch: int, seq_len: int):
    """None (one document per row) or, per row, random positive lengths summing to seq_len."""
    if seq_len < 2 or not draw(st.booleans()):
        return None
    rows = []
    for _ in range(batch):
        cuts = draw(st.lists(st.integers(1, seq_len - 1), max_size=3, unique=True))
        edges = [0, *sorted(cuts), seq_len]
        rows.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return tuple(rows)


@st.composite
def problems(draw, sparse: bool | None = None) -> Problem:
    """A whole problem within the 2-core budget: every dimension <= 8 except S <= 14.
    `sparse` fixes sparse_loss (None: drawn)."""
    m = draw(st.sampled_from([1, 2, 3, 4]))
    seq_len = draw(st.integers(1, 14))  # S < m (W = 0), S % m != 0, W = 1 all reachable
    batch = draw(st.integers(1, 2))
    w = seq_len // m
    hi = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))  # 1, primes, composites
    h = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))
    di = draw(st.sampled_from([2, 4, 6, 8]))
    dr = draw(st.sampled_from(list(range(0, di + 1, 2))))  # 0 .. DI inclusive
    cfg = dict(
        emb_dim=draw(st.integers(1, 8)),
        q_lora_rank=draw(st.integers(1, 8)),
        index_n_heads=hi,
        index_head_dim=di,
        rope_head_dim=dr,
        compress_ratio=m,
        index_topk=draw(st.integers(1, max(w, 1) + 2)),  # 1 .. beyond W
        num_query_heads=h,
        head_dim=draw(st.integers(1, 8)),
        rope_theta=draw(st.sampled_from([160000.0, 10000.0]) | st.floats(2.0, 1e6)),
        norm_eps=draw(st.sampled_from([1e-6, 1e-3, 0.5])),
        indexer_head_chunk=draw(st.sampled_from([0, *divisors(hi)])),
        loss_head_chunk=draw(st.sampled_from([0, *divisors(h)])),
        sparse_loss=draw(st.booleans()) if sparse is None else sparse,
        loss_scale=draw(st.sampled_from([1.0, 0.5, -2.0, 3.25])),
        sliding_window=draw(st.integers(0, seq_len + 2)),  # 0, 1, between, >= S
        teacher_normaliser=draw(st.sampled_from(["joint", "compressed"])),
        # YaRN with a short original length, so that its ramp turns the frequencies at these
        # positions (0 .. 13); a negative corr (length below 2 pi beta) gives a degenerate but
        # well-defined ramp on both sides.
        rope_scaling=draw(st.none() | st.fixed_dictionaries(dict(
            type=st.just("yarn"), factor=st.sampled_from([1.0, 4.0, 16.0]),
            original_max_position=st.integers(1, 64), beta_fast=st.sampled_from([32.0, 8.0]),
            beta_slow=st.sampled_from([1.0, 0.5])))),
        # SPEC section 7a: either format, any block dividing DI, the rotation where DI is a
        # power of two (2, 4, 8; not 6).
        index_quant=draw(st.none() | st.fixed_dictionaries(dict(
            format=st.sampled_from(["e2m1", "e4m3"]), block=st.sampled_from(divisors(di)),
            hadamard=st.just(False) if di & (di - 1) else st.booleans()))),
    )
    assert set(cfg) == {n for n, _ in CONFIG_FIELDS}
    cfg["query_chunk"] = draw(st.integers(0, seq_len + 2))  # 0, dividing or not, >= S
    return Problem(cfg, batch, seq_len,
                   seed=draw(st.integers(0, 2**31 - 1)),
                   documents=draw(documents(batch, seq_len)),
                   dtype=draw(st.sampled_from(["float64", "float32", "bfloat16", "float16"])))


def _judge(problem: Problem, request=None) -> None:
    report = check_problem(problem)
    if request is not None:
        request.node.user_properties.append(("excused_ties", report.excused_ties))
    if hypothesis.currently_in_test_context():  # --hypothesis-show-statistics tallies them
        hypothesis.event(f"excused ties: {report.excused_ties}")
    assert report.passed, (
        f"{report.summary()}\n"
        f"also: pytest tests/test_random_configs.py --repro '{problem.to_json()}'")


# Two tests (dense and sparse loss), CI_EXAMPLES // 2 examples each in the ci profile, so that
# pytest-xdist can run them on both cores.
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@given(data=st.data())
def test_random_problem(sparse, data):
    _judge(data.draw(problems(sparse=sparse), label="problem"))


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_problem(name, request):
    """The pinned problems (harness.problems.random_configs.PINNED): value classes no committed case has,
    and the mutants of harness/selftest/mutations.py that need them."""
    _judge(PINNED[name], request)


def test_repro(request):
    """`pytest tests/test_random_configs.py --repro '<json>'` reruns one printed problem."""
    text = request.config.getoption("--repro")
    if not text:
        pytest.skip("no --repro '<problem json>' given")
    _judge(Problem.from_json(text), request)


def test_a_problem_round_trips_through_its_reproducer():
    p = PINNED["m3_prime_heads_packed"]
    again = Problem.from_json(p.to_json())
    assert again == p and again.to_json() == p.to_json()
    assert p.repro().startswith("python -m harness.problems.random_configs --repro '{")
    assert "\n" not in p.repro()
    with pytest.raises(ValueError, match=r"unknown problem key\(s\) \['bogus'\]"):
        Problem.from_json('{"bogus": 1}')


def test_the_reproducer_reports_a_failure(monkeypatch):
    """A failing problem's summary carries the reproducer (the judge is broken on purpose)."""
    import harness.problems.random_configs as rc

    real = rc.compare_close

    def broken(check, quantity, x, ref, bound, *a, **k):
        r = real(check, quantity, x, ref, bound, *a, **k)
        return r if quantity != "loss" else type(r)(r.check, r.quantity, "failed", 1.0, bound)

    monkeypatch.setattr(rc, "compare_close", broken)
    report = check_problem(PINNED["no_blocks"])
    assert not report.passed
    assert f"reproduce: {PINNED['no_blocks'].repro()}" in report.summary()


def test_a_problem_stops_at_the_first_stage_where_a_named_check_failed(monkeypatch):
    """check_problem(stop_on=...), what a mutation test runs: once a named check has failed, the
    later stages (float64 chunked, the low dtype) are skipped, and the report says so. The
    judge's float64 keys check is broken on purpose; one JAX run (float64 native) is all it costs."""
    import harness.problems.random_configs as rc

    real_compare, real_run, runs = rc.compare_close, rc._run, []

    def broken(check, quantity, x, ref, bound, *a, **k):
        r = real_compare(check, quantity, x, ref, bound, *a, **k)
        return r if quantity != "compressed_keys" else type(r)(r.check, r.quantity, "failed", 1.0, bound)

    def counted(side, *a, **k):
        runs.append((side.__name__, a[3]))
        return real_run(side, *a, **k)

    monkeypatch.setattr(rc, "compare_close", broken)
    monkeypatch.setattr(rc, "_run", counted)
    problem = PINNED["composite_chunks_w1"]
    assert problem.chunked and problem.dtype != "float64"  # three more stages would follow
    report = check_problem(problem, stop_on=("exact64",))
    assert runs == [("torch_ref", "float64"), ("jax_impl", "float64")]
    assert {r.check for r in report.failed} == {"exact64"}
    assert report.notes[-1] == "stopped after float64 native: exact64 failed (stop_on), later stages skipped"

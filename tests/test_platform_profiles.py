"""Platform tolerance profiles (harness/platforms.py, harness/profiles/*.json): loading, the numbers
pinned at their boundaries, and where the judge applies them.

Every factor of every stored profile is pinned here (PINS): a re-measured profile changes this
table too, in the same commit. For each factor the judge's oracle rule is probed with hand-made
outputs at 0.9x and 1.1x of factor * alpha * max(torch's error, floor) under a Policy carrying
the profile: the first passes, the second fails. The checks that compare a device with itself
(chunk, exact64) keep their bounds under any profile, and a CPU (no profile) keeps the CPU's.

Pure numpy and JSON: no JAX program, no torch (~1 s).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from harness import platforms
from harness.judging import tolerance
from harness.judging.judge import judge, score_tolerance
from harness.judging.tolerance import Policy, policy_factors
from harness.outputs import Outputs, References, output_name
from harness.points import Entry, Point

# Every stored factor: profile name -> matmul precision -> dtype -> kind -> factor. Measured by
# scripts/measure_platform_profile.py on the device (the file holds the measurement beside each).
PINS = {
    "tpu_v5_lite": {
        "highest": {"float32": {"forward": 24.0, "loss": 18.5, "grad": 31.0},
                    "bfloat16": {"forward": 3.75, "loss": 1.25, "grad": 1.0},
                    "float16": {"forward": 27.0, "loss": 29.25, "grad": 1.0}},
        "default": {"float32": {"forward": 974.0, "loss": 825.0, "grad": 108.25},
                    "bfloat16": {"forward": 3.75, "loss": 1.25, "grad": 1.75},
                    "float16": {"forward": 34.5, "loss": 114.5, "grad": 166.25}},
    },
}
STORED = sorted(f[:-5] for f in os.listdir(platforms.PROFILES_DIR) if f.endswith(".json"))
BELOW, ABOVE = 0.9, 1.1
QUANTITY = {"forward": ("compressed_keys", "forward"), "loss": ("loss", "dense"), "grad": ("grad.indexer.wq_b", "dense")}


def _stored(name: str) -> dict:
    with open(os.path.join(platforms.PROFILES_DIR, name + ".json")) as f:
        data = json.load(f)
    return platforms.load_profile(data["backend"], data["device_kind"])


def test_every_stored_profile_is_pinned_and_says_how_it_was_measured():
    assert STORED == sorted(PINS), "a profile file without a pin here (or a pin without its file)"
    for name in STORED:
        data = _stored(name)
        assert data["name"] == name and data["factors"] == PINS[name], f"{name}: factors differ from PINS"
        assert data["command"].startswith("python scripts/measure_platform_profile.py")
        assert data["jax_version"] and data["jaxlib_version"] and data["device_kind"]
        for precision, table in data["factors"].items():
            for dtype, row in table.items():
                for kind, factor in row.items():
                    measured = data["measured"][precision][dtype][kind]
                    # the factor follows from its measurement by the script's stated rule
                    want = math.ceil(max(1.0, measured["worst_ratio"] * data["margin"]) / data["grid"] - 1e-6) * data["grid"]
                    assert factor == pytest.approx(want, abs=data["grid"]), (name, precision, dtype, kind)
                    assert measured["at"], "each factor names the check it came from"


def _oracle_verdict(policy: Policy, dtype: str, kind: str, err: float):
    """The oracle check of one hand-made entry whose reference at the dtype is off by 1e-3
    (above every floor), the candidate off by `err` relative."""
    quantity, mode = QUANTITY[kind]
    oracle = np.linspace(1.0, 2.0, 12).reshape(3, 4) if kind != "loss" else np.array(1.5)
    t_err = 1e-3
    torch_t = oracle.copy()
    torch_t.flat[0] += t_err * np.max(np.abs(oracle))
    cand = oracle.copy()
    cand.flat[-1] += err * np.max(np.abs(oracle))
    name = quantity if mode == "forward" else output_name(quantity, mode)
    refs = References(Outputs("oracle", {name: oracle}), Outputs("ref@t", {name: torch_t}))
    [r] = [r for r in judge(Entry(Point("tiny", dtype), mode, quantity), Outputs("hand", {name: cand}), refs, policy)
           if r.check == "oracle"]
    return r, t_err


CASES = [(name, precision, dtype, kind) for name in sorted(PINS) for precision, table in PINS[name].items()
         for dtype, row in table.items() for kind in row]


@pytest.mark.parametrize("name,precision,dtype,kind", CASES, ids=[".".join(c) for c in CASES])
def test_each_factor_at_its_boundary(name, precision, dtype, kind):
    factor = PINS[name][precision][dtype][kind]
    stored = _stored(name)
    policy = Policy(precision, stored["backend"], policy_factors(platforms.oracle_factors(stored, precision)), name)
    cpu_bound = _oracle_verdict(Policy(precision, stored["backend"]), dtype, kind, 0.0)[0].bound
    bound = factor * cpu_bound
    below, _ = _oracle_verdict(policy, dtype, kind, BELOW * bound)
    above, _ = _oracle_verdict(policy, dtype, kind, ABOVE * bound)
    assert below.status == "passed", f"{name} {precision} {dtype} {kind}: {below.message}"
    assert above.status == "failed", f"{name} {precision} {dtype} {kind} went soft: {above.message}"
    assert above.bound == pytest.approx(bound, rel=1e-9)
    assert f"platform factor {factor:g} ({name})" in above.note


def test_a_cpu_policy_keeps_the_cpu_bounds():
    """No profile: factor 1 everywhere, and an error 1.1x the CPU bound fails as before."""
    policy = Policy("highest", "cpu")
    for kind in QUANTITY:
        for dtype in ("float32", "bfloat16", "float16"):
            assert policy.oracle_factor(dtype, QUANTITY[kind][0]) == 1.0
            cpu_bound = _oracle_verdict(policy, dtype, kind, 0.0)[0].bound
            assert cpu_bound == pytest.approx(tolerance.ALPHA[kind] * max(1e-3, tolerance.floor(dtype, QUANTITY[kind][0])))
            r, _ = _oracle_verdict(policy, dtype, kind, ABOVE * cpu_bound)
            assert r.status == "failed" and "platform factor" not in r.note


def test_chunk_checks_keep_their_bound_under_a_profile():
    """A chunked point against its native run: the CHUNK bound, whatever the profile says."""
    stored = _stored("tpu_v5_lite")
    policy = Policy("default", "tpu", policy_factors(platforms.oracle_factors(stored, "default")), "tpu_v5_lite")
    oracle = np.array(1.5)
    native = oracle + 1e-3
    bound = tolerance.chunk_bound("float32", "loss")
    for err, status in ((BELOW * bound, "passed"), (ABOVE * bound, "failed")):
        cand = Outputs("hand", {"loss.dense": np.array(native + err * native)})
        refs = References(Outputs("oracle", {"loss.dense": oracle}), Outputs("ref@t", {"loss.dense": oracle + 5e-4}),
                          native=Outputs("native", {"loss.dense": np.array(native)}))
        [r] = [r for r in judge(Entry(Point("tiny", "float32", ichunk=1), "dense", "loss"), cand, refs, policy)
               if r.check == "chunk"]
        assert r.status == status and r.bound == bound


def test_the_top_k_tie_window_widens_against_the_oracle_only():
    stored = _stored("tpu_v5_lite")
    factors = policy_factors(platforms.oracle_factors(stored, "highest"))
    policy = Policy("highest", "tpu", factors, "tpu_v5_lite")
    scores = np.linspace(1.0, 2.0, 8).reshape(1, 1, 8)
    at_dtype = scores + 1e-3
    plain = score_tolerance(scores, at_dtype, "float32", Policy("highest", "tpu"))
    widened = score_tolerance(scores, at_dtype, "float32", policy)
    own = score_tolerance(scores, at_dtype, "float32", policy, versus_oracle=False)
    assert np.allclose(widened, PINS["tpu_v5_lite"]["highest"]["float32"]["forward"] * plain)
    assert np.allclose(own, plain)


def test_a_profile_never_tightens_and_a_bad_file_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="must be >= 1"):
        Policy("highest", "tpu", (("float32", "loss", 0.5),), "x")
    monkeypatch.setattr(platforms, "PROFILES_DIR", str(tmp_path))
    platforms.read_profile_file.cache_clear()
    (tmp_path / "tpu_v9.json").write_text(json.dumps({"backend": "tpu", "device_kind": "TPU v9", "command": "c",
                                                      "factors": {"highest": {"float32": {"forward": 0.5}}}}))
    with pytest.raises(ValueError, match=r"tpu_v9.json: factors.highest.float32.forward=0.5 must be a number >= 1"):
        platforms.load_profile("tpu", "TPU v9")
    (tmp_path / "tpu_v8.json").write_text(json.dumps({"backend": "tpu", "device_kind": "TPU v8"}))
    with pytest.raises(ValueError, match="field 'command' is missing"):
        platforms.load_profile("tpu", "TPU v8")
    assert platforms.load_profile("tpu", "TPU v7") is None  # nobody measured it: the CPU's bounds
    platforms.read_profile_file.cache_clear()


def test_profile_names_and_lookup():
    assert platforms.profile_slug("tpu", "TPU v5 lite") == "tpu_v5_lite"
    assert platforms.profile_slug("gpu", "NVIDIA H100 80GB HBM3") == "gpu_nvidia_h100_80gb_hbm3"
    assert platforms.oracle_factors(None, "highest") == {}
    assert tolerance.oracle_factor(policy_factors({"float32": {"loss": 3.0}}), "float32", "loss") == 3.0
    assert tolerance.oracle_factor(policy_factors({"float32": {"loss": 3.0}}), "bfloat16", "loss") == 1.0

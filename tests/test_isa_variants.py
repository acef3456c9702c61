"""Which of the CPU kernels the fixtures' order errors are joined over (harness.ISA_VARIANTS) a CPU
runs, decided from its flags (harness.platforms.isa_variant_blockers)
(tests/test_judge_rules.py pins the join itself: harness.run.regenerate.join_order_errors keeps the
largest estimate over every variant, whether this CPU measured it or carried the committed one).

Pure Python on synthetic flags and estimates (no torch, no JAX; about a second). The AVX2-only CPU
is emulated by harness.platforms.CPU_FLAGS_ENV, the hook that replaces /proc/cpuinfo's flags.
tests/test_fixtures.py runs the regenerator itself under that emulation.
"""

from __future__ import annotations

import pytest

import harness
from harness import platforms
from harness.platforms import CPU_FLAGS_ENV, cpu_flags, isa_variant_blockers

# An x86-64 CPU with AVX2 and FMA and no AVX512 (AMD Zen 2 and 3, Intel client parts), as
# /proc/cpuinfo names its flags; and one with AVX512 (its core parts) and AVX512-BF16.
AVX2_ONLY = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2".split())
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
NEEDS_AVX512 = {"aten-avx512", "widest", "onednn-all", "mkl-auto"}


def test_an_avx2_only_cpu_runs_the_variants_it_can_and_names_why_not_the_others():
    blocked = isa_variant_blockers(AVX2_ONLY, "test")
    assert set(blocked) == NEEDS_AVX512, blocked
    for name in ("aten-avx512", "widest"):  # ATen believes its variable: SIGILL, so never started
        assert blocked[name].startswith("cannot run: CPU lacks avx512f, avx512bw, avx512vl, avx512dq ("), blocked[name]
        assert "SIGILL" in blocked[name]
    for name in ("onednn-all", "mkl-auto"):  # the libraries stay within the CPU: not their path
        assert blocked[name].startswith("cannot reach its kernels: CPU lacks avx512f"), blocked[name]
    assert isa_variant_blockers(AVX512, "test") == {}
    assert set(isa_variant_blockers(frozenset({"sse4_2"}), "test")) == set(harness.ISA_VARIANTS) - {"aten-default"}
    unknown = isa_variant_blockers(None, "no /proc/cpuinfo")
    assert set(unknown) == set(harness.ISA_VARIANTS) - {"aten-default"}
    assert all("unknown" in why and CPU_FLAGS_ENV in why for why in unknown.values())


def test_every_variant_states_what_it_needs():
    """A variant added to ISA_VARIANTS says what it needs of the CPU, and ATen's levels are those
    its own detection asks for."""
    assert set(harness.ISA_VARIANT_NEEDS) == set(harness.ISA_VARIANTS)
    assert set(harness.ATEN_NEEDS["avx512"]) == {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}
    assert set(harness.ATEN_NEEDS["avx2"]) == {"avx2", "fma"}


def test_the_flag_hook_emulates_another_cpu(monkeypatch):
    """CSA_PARITY_CPU_FLAGS replaces /proc/cpuinfo for every decision, and the cpu block of a report
    says it is emulated and which variants that CPU does not run, with the reason."""
    monkeypatch.setenv(CPU_FLAGS_ENV, " ".join(sorted(AVX2_ONLY)).replace(" avx2", ",avx2"))
    flags, source = cpu_flags()
    assert flags == AVX2_ONLY and CPU_FLAGS_ENV in source
    assert set(isa_variant_blockers()) == NEEDS_AVX512
    block = platforms.cpu_features()
    assert block["flags_from"] == source and "avx512f" not in block["isa"]
    assert {n for n, why in block["isa_variants"].items() if why != "runs"} == NEEDS_AVX512
    from harness.run.report import device_line

    line = device_line({"backend": "cpu", "cpu": block})
    assert f"emulated by {source}" in line
    assert "ISA variants this CPU does not run: aten-avx512 (cannot run: CPU lacks avx512f" in line


@pytest.mark.parametrize("flags,expected", [(AVX2_ONLY, NEEDS_AVX512), (AVX512, set())])
def test_a_variant_is_decided_by_flags_alone(flags, expected, monkeypatch):
    """No kernel is run to decide: the decision follows the flags given, whatever this CPU has."""
    monkeypatch.setattr(platforms, "cpu_flags", lambda: (_ for _ in ()).throw(AssertionError("read the CPU")))
    assert set(isa_variant_blockers(flags, "given")) == expected

"""csa-parity harness: fixtures, implementations, comparators, the parity matrix and its reports."""

import os

# torch's CPU kernels choose their instruction set once per process, at their first use, and a
# float32 or bfloat16 sum's order, so its rounding, follows that choice. Three libraries choose
# for themselves, each from its own variable, each by default from the CPU:
# - ATen's own kernels (ATEN_CPU_CAPABILITY: default, avx2, avx512): told avx512 here, 457 of
#   the fixtures' float64 goldens move in their last bits (at most 9.9e-16 normwise) and float32
#   ones by up to 0.46x FIXTURE_CHECK_RTOL (measured with scripts/measure_isa_variants.py);
# - oneDNN (ONEDNN_MAX_CPU_ISA), which computes the bfloat16 matmuls wherever the CPU has
#   AVX512-BF16 or AMX, whatever ATEN_CPU_CAPABILITY says: left to its widest, bfloat16 and
#   float16 goldens of 11 of the 21 cases move (up to 0.13x FIXTURE_CHECK_RTOL);
# - MKL, the BLAS of the float32 and float64 matmuls (MKL_CBWR, its Conditional Numerical
#   Reproducibility): left to itself (AUTO) it picks its code path per CPU model and vendor, and
#   its AVX512 and AVX2 paths give other bits in 20 of the 21 files (518 float64 goldens, at most
#   1.6e-15). MKL_CBWR=AVX2 is honoured on Intel CPUs only (MKL's documentation: on a non-Intel
#   CPU the AUTO branch runs instead); COMPATIBLE (SSE2 without the reciprocal approximations)
#   is MKL's branch for every x86 CPU. Measured here: under COMPATIBLE the 21 files come out
#   byte-identical whether MKL may use AVX512, AVX2 or SSE4.2 (MKL_ENABLE_INSTRUCTIONS), so the
#   vendor's path no longer shows. It costs matmul speed (single-threaded here: 4-8x slower on
#   256x256 to 1024x1024 matmuls), which the reference's small matmuls hardly feel: a whole
#   regeneration took 9.55 s of CPU against 9.22 s under AUTO.
# The committed fixtures are generated with ATen and oneDNN at AVX2 (which every x86-64 machine
# with AVX512 also has) and MKL at COMPATIBLE, so every process that imports the harness computes
# with them unless the user set a variable (`ATEN_CPU_CAPABILITY=avx512 scripts/regenerate_fixtures.py
# --check` shows what AVX512 changes); harness.run.regenerate notes a process that does not.
# The order-error estimates the bounds rest on do not trust any one of these choices: each is the
# max over the kernels a user may compute with (harness.run.regenerate.ISA_VARIANTS).
TORCH_CPU_CAPABILITY = "AVX2"
MKL_BRANCH = "COMPATIBLE"
CPU_PINS = {"ATEN_CPU_CAPABILITY": TORCH_CPU_CAPABILITY.lower(), "ONEDNN_MAX_CPU_ISA": TORCH_CPU_CAPABILITY,
            "MKL_CBWR": MKL_BRANCH}
# Every variable that selects torch's CPU kernels on x86 (DNNL_MAX_CPU_ISA is oneDNN's older name
# for ONEDNN_MAX_CPU_ISA; MKL_ENABLE_INSTRUCTIONS caps MKL's code path): a process that emulates
# another CPU (harness.run.regenerate.ISA_VARIANTS) starts from an environment without any of them.
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")
# An order error is a property of the CPU kernels that computed it as much as of the problem: torch
# picks its kernels per process from the CPU (harness.CPU_PINS says which and why), so the same
# reference run on another x86 CPU draws other roundings. The stored estimate is therefore the max
# over the kernels a user's CPU may select, each emulated on a CPU that has its path (an x86-64 CPU
# with AVX512 and AVX512-BF16 has every one) by capping it in a fresh process whose environment holds the variant's settings and no other ISA variable
# (ISA_VARIABLES; what a variant leaves unset, importing the harness pins). harness.run.regenerate
# joins them; a CPU runs only the variants whose ISA_VARIANT_NEEDS it has (below):
ISA_VARIANTS: dict[str, dict[str, str]] = {
    # every x86 CPU with AVX2 that imports the harness unchanged (harness.CPU_PINS), Intel or AMD:
    # the goldens' own kernels
    "pinned": {},
    # an x86-64 CPU without AVX2: ATen falls back to its baseline kernels (their float32 RoPE past
    # 65536 positions rounds otherwise: yarn_tail's float32 keys move by 6.3e-5, and its float16
    # loss error is 5.2e-5 where the vectorised kernels' is 7.3e-6)
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    # a user who asks for ATen's AVX512 kernels (Intel Xeon, AMD Zen 4 and later)
    "aten-avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    # oneDNN left to its widest: the bfloat16 matmuls on AVX512-BF16 (Intel, AMD Zen 4) or AMX
    "onednn-all": {"ONEDNN_MAX_CPU_ISA": "ALL"},
    # MKL left to pick its path per CPU model and vendor: AVX512 on this Intel (what the fixtures'
    # estimates were before MKL was pinned: with this variant every estimate is at least that)
    "mkl-auto": {"MKL_CBWR": "AUTO"},
    # MKL's own AVX2 path: an Intel without AVX512, and the nearest this machine comes to an AMD's
    # own path (MKL picks that per vendor, which no cap reproduces here)
    "mkl-auto-avx2": {"MKL_CBWR": "AUTO", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    # nothing pinned at all on an AVX512 / AMX Intel: every library at its widest
    "widest": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL", "MKL_CBWR": "AUTO"},
}

# What each variant needs of the CPU, by its /proc/cpuinfo flags (harness.platforms.cpu_flags), and
# what happens on a CPU without them (harness.platforms.isa_variant_blockers says it per variant):
# - ATen believes ATEN_CPU_CAPABILITY whatever the CPU has, so a variant whose ATen level (its own
#   setting, else the pin) needs flags the CPU lacks cannot run: its first vectorised kernel dies
#   of SIGILL. The flags are those ATen's own detection asks for: AVX2 with FMA; AVX512 with its
#   BW, VL and DQ parts and FMA.
# - oneDNN's and MKL's settings cap what they may use, and each library stays within what the
#   CPU has: without the flags of the path a variant stands for, it would compute with a narrower
#   one that another variant measures already, so the variant is not measured there (its
#   committed estimate stays, rather than being replaced by another path's).
ATEN_NEEDS = {"default": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")}
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # oneDNN's avx512_core; MKL's AVX512 path
# ISA_VARIANT_NEEDS: the flags of the oneDNN or MKL path a variant stands for (ATen's are ATEN_NEEDS
# of its level).
ISA_VARIANT_NEEDS: dict[str, tuple[str, ...]] = {
    "pinned": (),
    "aten-default": (),
    "aten-avx512": (),
    "onednn-all": AVX512_CORE,  # oneDNN's bfloat16 matmuls past AVX2 (avx512_core and up: AVX512-BF16, AMX)
    "mkl-auto": AVX512_CORE,  # the AVX512 path MKL picks on an Intel with it
    "mkl-auto-avx2": ("avx2", "fma"),
    "widest": AVX512_CORE,
}


def pin_cpu_kernels() -> tuple[str, ...]:
    """Set each variable of CPU_PINS the environment leaves unset; returns the names it set."""
    unset = tuple(name for name in CPU_PINS if name not in os.environ)
    for name in unset:
        os.environ[name] = CPU_PINS[name]
    return unset


# Pinned on import (the pytest plugin, harness.run.pytest_plugin, takes back what its own import set
# until a matrix is asked for).
PINNED_AT_IMPORT = pin_cpu_kernels()

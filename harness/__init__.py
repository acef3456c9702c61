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


def pin_cpu_kernels() -> tuple[str, ...]:
    """Set each variable of CPU_PINS the environment leaves unset; returns the names it set."""
    unset = tuple(name for name in CPU_PINS if name not in os.environ)
    for name in unset:
        os.environ[name] = CPU_PINS[name]
    return unset


# Pinned on import (the pytest plugin, harness.run.pytest_plugin, takes back what its own import set
# until a matrix is asked for).
PINNED_AT_IMPORT = pin_cpu_kernels()

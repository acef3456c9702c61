"""csa-parity harness: fixtures, implementations, comparators, the parity matrix and its reports."""

import os

# torch's CPU kernels choose their SIMD width once per process, at the first operation
# (ATEN_CPU_CAPABILITY, else the widest the CPU has), and a float32 reduction's order, so its
# rounding, follows that width: on one AVX512 machine the fixtures' float32 order-error goldens
# came out up to 4x off the committed ones (`ATEN_CPU_CAPABILITY=avx512
# scripts/regenerate_fixtures.py --check` lists them). The committed fixtures were generated with
# AVX2, which every x86-64 machine with AVX512 also has, so every process that imports the
# harness computes with it unless the user chose otherwise; harness.regenerate notes a process
# that does not.
TORCH_CPU_CAPABILITY = "AVX2"
os.environ.setdefault("ATEN_CPU_CAPABILITY", TORCH_CPU_CAPABILITY.lower())

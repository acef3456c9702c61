"""csa-parity harness: fixtures, implementations, comparators, the parity matrix and its reports."""

import os

# torch's CPU kernels choose their instruction set once per process, at their first use, and a
# float32 or bfloat16 sum's order, so its rounding, follows that choice. Two libraries choose
# for themselves, each from its own variable, each by default the widest the CPU has:
# - ATen's own kernels (ATEN_CPU_CAPABILITY): on one AVX512 machine the fixtures' float32
#   order-error goldens came out up to 4x off the committed ones;
# - oneDNN (ONEDNN_MAX_CPU_ISA), which computes the bfloat16 matmuls wherever the CPU has
#   AVX512-BF16 or AMX, whatever ATEN_CPU_CAPABILITY says: on such a CPU bfloat16 goldens moved
#   by up to 1.2e-2 relative (ties, topk_wide, flash_dims).
# The committed fixtures are generated with AVX2 in both, which every x86-64 machine with
# AVX512 also has, so every process that imports the harness computes with it unless the user
# set a variable (`ATEN_CPU_CAPABILITY=avx512 scripts/regenerate_fixtures.py --check` lists what
# AVX512 changes); harness.run.regenerate notes a process that does not.
# MKL, the BLAS of the float32 and float64 matmuls, is left to its default: it picks its code
# path per CPU model and vendor even when told AVX2 (files written on one machine regenerate with
# last-bit differences on another either way), and told AVX2 on an Intel AVX512 machine it draws
# a float32 order error of packed_edges' scores 0.7x the one its default kernels draw there
# (1.9e-6 against 2.7e-6): a bound that would rest on one lucky draw.
TORCH_CPU_CAPABILITY = "AVX2"
CPU_PINS = {"ATEN_CPU_CAPABILITY": TORCH_CPU_CAPABILITY.lower(), "ONEDNN_MAX_CPU_ISA": TORCH_CPU_CAPABILITY}
for _name, _value in CPU_PINS.items():
    os.environ.setdefault(_name, _value)

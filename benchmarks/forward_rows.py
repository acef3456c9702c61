"""The million sample's candidate walk: `jax_impl.api.indexer_forward_rows` on blocks of rows of
`million_documents` (S = 1048576, W = 262144, the long cases' width), at bfloat16.

    python -m benchmarks.forward_rows            # about 1 minute on 2 cores

What it times (the median of REPEATS calls after one that compiles), in seconds a call and in ns a
score entry of the whole width (rows x W):

* the chunked point (head chunks of 1) and the native point (no head chunks) on the last block of
  r rows, which sees every block: why the million sample runs the chunked point only;
* the chunked point on the first block, which `indexer_forward_rows` scores against the causal
  prefix of the blocks (rounded up to W / 16), beside the last: what the prefix saves.

Bounds, each printed with PASS or FAIL (exit 1 on a FAIL): the chunked point at most
CHUNKED_VS_NATIVE times the native point's time, and the first block at most PREFIX_VS_WHOLE times
the last one's. Nothing is written; docs/matrix.md quotes a run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

from harness.points import Point
from harness.problems.cases import MILLION_CASES, make_inputs
from harness.problems.matrix import MILLION_QUERY_BLOCKS
from harness.sides.long_sides import jax_config
from jax_impl import api

CASE, DTYPE, REPEATS = "million_documents", "bfloat16", 3
# Measured on the idle 2-core machine: the chunked point's last block takes 0.32 of the native
# point's, and the first block 0.27 of the last one's (the keys of its prefix and the [B, r, W]
# output it still writes cost what they cost): the bounds leave room for a loaded machine.
CHUNKED_VS_NATIVE, PREFIX_VS_WHOLE = 0.75, 0.6


def time_call(params, inputs, cfg, start: int, rows: int) -> float:
    """The median of REPEATS calls' seconds, after one call that compiles."""
    jax.block_until_ready(api.indexer_forward_rows(params, inputs, cfg, DTYPE, start, rows))
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(api.indexer_forward_rows(params, inputs, cfg, DTYPE, start, rows))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    case = MILLION_CASES[CASE]
    r = MILLION_QUERY_BLOCKS[CASE]
    inputs, params = make_inputs(case)
    problem = case.config_dict()
    S, W = case.seq_len, case.num_blocks
    last = (S - 1) // r * r - r  # the last whole block of r rows
    cfgs = {name: jax_config(problem, Point(CASE, DTYPE, c, c, r)) for name, c in (("chunked", 1), ("native", 0))}
    t = {"chunked last": time_call(params, inputs, cfgs["chunked"], last, r),
         "native last": time_call(params, inputs, cfgs["native"], last, r),
         "chunked first": time_call(params, inputs, cfgs["chunked"], 0, r)}
    prefix = {"chunked last": api.prefix_blocks(S, last + r, cfgs["chunked"]),
              "native last": api.prefix_blocks(S, last + r, cfgs["native"]),
              "chunked first": api.prefix_blocks(S, r, cfgs["chunked"])}
    print(f"{CASE}: S={S}, W={W}, {DTYPE}, blocks of r={r} rows, median of {REPEATS} calls")
    for name, s in t.items():
        print(f"  {name:14s} {s:7.3f} s a call, {s / (r * W) * 1e9:6.2f} ns a score entry of the whole width; "
              f"scored against {prefix[name]} blocks")
    ok = True
    for what, ratio, bound in (("chunked / native (last block)", t["chunked last"] / t["native last"], CHUNKED_VS_NATIVE),
                               ("first / last block (chunked)", t["chunked first"] / t["chunked last"], PREFIX_VS_WHOLE)):
        passed = ratio <= bound
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}: {what} = {ratio:.3f} (at most {bound})")
    return 0 if ok else 1


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())

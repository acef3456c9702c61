"""Where the device time of the training step goes, op by op, on one TPU chip.

    python -m benchmarks.tpu_profile                    # the Pallas step of benchmarks/tpu_speed.py, S = 8192
    python -m benchmarks.tpu_profile --impl xla         # the XLA step (head chunk 1, teacher chunk 1)

Runs the step of `benchmarks.tpu_speed` (`jax.value_and_grad(indexer_loss)` at memory_speed's
shapes, bfloat16) under `jax.profiler`, reads the trace back (`jax.profiler.ProfileData`) and
prints the device time of the whole program per run and of its ops, largest first, summed over
the runs and divided by them: each Pallas kernel by its name (`csa_index_scores`,
`csa_teacher_probs`, ...), each XLA fusion by its HLO name and shape. A loop (`while`) is listed
with everything inside it, so the rows overlap; the program's own time is the total. Off TPU it
prints one line (no chip, nothing measured) and exits with status 2.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax


def device_ops(trace_dir: str, runs: int):
    """({op name: (ms per run, calls per run)}, [program ms per run]) of the TPU:0 plane."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    data = ProfileData.from_file(path)
    ops = collections.defaultdict(lambda: [0.0, 0])
    modules = []
    for plane in data.planes:
        if "TPU:0" not in plane.name:
            continue
        for line in plane.lines:
            if line.name == "XLA Modules":
                modules += [e.duration_ns / 1e6 for e in line.events]
            elif line.name == "XLA Ops":
                for e in line.events:
                    ops[e.name][0] += e.duration_ns / 1e6 / runs
                    ops[e.name][1] += 1
    return {k: (ms, n // runs) for k, (ms, n) in ops.items()}, modules


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("pallas", "xla"), default="pallas")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--step-rows", type=int, default=1024, help="query block rows of the Pallas step")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=30, help="ops to print")
    args = p.parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu":
        print(f"tpu_profile: no TPU here (JAX default backend: {backend}); nothing measured")
        return 2
    from benchmarks.tpu_speed import step_args, step_configs, step_program

    impl, how, cfg = next(c for c in step_configs(args.seq, args.step_rows) if c[0] == args.impl)
    program, step = step_program(cfg, "bfloat16"), step_args(cfg, args.seq)
    jax.block_until_ready(program(*step))  # compile and warm up outside the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.runs):
            jax.block_until_ready(program(*step))
        jax.profiler.stop_trace()
        ops, modules = device_ops(trace_dir, args.runs)
    print(f"step {impl} S={args.seq} bfloat16 ({how}) on {jax.devices()[0].device_kind}: device time per run "
          + ", ".join(f"{ms:.2f}" for ms in modules) + " ms")
    print("| ms per run | calls per run | op |")
    print("|---|---|---|")
    for name, (ms, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {ms:.3f} | {n} | `{name.split(' = ')[0]}` {name.split(' = ')[1][:60] if ' = ' in name else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

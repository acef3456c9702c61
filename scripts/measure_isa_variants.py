#!/usr/bin/env python
"""How much the fixtures move between the CPU kernels torch may pick: regenerate every case once
per instruction-set variant (each in a fresh process whose environment caps the kernels), then
print, against the first variant, which files come out byte-identical, how far the goldens move
per dtype (in units of harness.judging.tolerance.FIXTURE_CHECK_RTOL) and, across all variants,
the spread (max / min) of every order-error estimate, with each variant's wall time.

    python scripts/measure_isa_variants.py                       # the variants of harness.run.regenerate.ISA_VARIANTS
    python scripts/measure_isa_variants.py --case tiny --case small
    python scripts/measure_isa_variants.py --variant avx2=ATEN_CPU_CAPABILITY=avx2 \\
        --variant cbwr=ATEN_CPU_CAPABILITY=avx2,MKL_CBWR=AVX2     # any variants, NAME=VAR=VALUE[,VAR=VALUE]

A variant's environment holds its own settings and none of the other instruction-set variables
(harness.ISA_VARIABLES), so what it does not set, importing the harness pins (harness.CPU_PINS).
A variant this CPU cannot run (harness.platforms.isa_variant_blockers, from the CPU's flags) is
named with the reason and left out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from harness.judging.tolerance import FIXTURE_CHECK_RTOL, ORDERR_CHECK_FACTOR, floor  # noqa: E402
from harness.problems.cases import CASES  # noqa: E402
from harness.problems.fixtures import read_safetensors  # noqa: E402
from harness.run.collect import dims  # noqa: E402
from harness.platforms import isa_variant_blockers  # noqa: E402
from harness.run.regenerate import ISA_VARIANTS, normwise, regenerate_in_subprocesses  # noqa: E402


def _parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition("=")
    env = dict(s.split("=", 1) for s in settings.split(",") if s)
    return name, env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", metavar="NAME", help="only this case (repeatable; default all)")
    parser.add_argument("--variant", action="append", metavar="NAME=VAR=VALUE[,VAR=VALUE]",
                        help="a variant (repeatable; default harness.run.regenerate.ISA_VARIANTS); the first is the "
                             "one the others are compared with")
    parser.add_argument("--jobs", type=int, default=2, help="variants regenerated at once (default 2)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="regenerate into DIR/<variant>/ and keep the files (default: a temporary folder)")
    args = parser.parse_args(argv)
    cases = args.case or list(CASES)
    variants = dict(_parse_variant(v) for v in args.variant) if args.variant else dict(ISA_VARIANTS)
    blocked = isa_variant_blockers(variants=variants)
    for name, why in blocked.items():
        print(f"  {name:<18} not measured on this CPU: {why}")
    variants = {n: v for n, v in variants.items() if n not in blocked}
    if len(variants) < 2:
        print(f"this CPU runs {len(variants)} of the variants: nothing to compare")
        return 0
    with tempfile.TemporaryDirectory(prefix="isa-variants-") as tmp:
        where = args.keep or Path(tmp)
        runs = regenerate_in_subprocesses(variants, cases, where, jobs=args.jobs)
        files = {name: {c: read_safetensors((where / name / f"{c}.safetensors").read_bytes())[0] for c in cases}
                 for name in variants}
    base = next(iter(variants))
    print(f"{len(cases)} case(s), {len(variants)} variant(s); compared with {base!r}")
    for name, run in runs.items():
        print(f"  {name:<18} {run.seconds:6.1f} s  torch CPU capability {run.capability:<8} "
              f"{' '.join(f'{k}={v}' for k, v in variants[name].items()) or '(nothing set)'}")
    print()
    print("variant           identical files  float64 goldens differing (max normwise)  "
          "low-dtype goldens: worst / FIXTURE_CHECK_RTOL per dtype")
    for name in variants:
        if name == base:
            continue
        same = sum(_bytes_equal(files[base][c], files[name][c]) for c in cases)
        f64, worst64 = 0, 0.0
        low = {dt: 0.0 for dt in ("float32", "bfloat16", "float16")}
        for c in cases:
            for t, a in files[base][c].items():
                b = files[name][c][t]
                if not t.startswith("golden.") or ".orderr." in t or t.endswith("topk_indices") or a.data == b.data:
                    continue
                dt = t.split(".")[1]
                err = normwise(a.array(), b.array())
                if dt == "float64":
                    f64 += 1
                    worst64 = max(worst64, err)
                else:
                    low[dt] = max(low[dt], err / FIXTURE_CHECK_RTOL[dt])
        print(f"  {name:<18} {same:>3} / {len(cases):<3}       {f64:>5} ({worst64:.2g})" + " " * 26
              + "  ".join(f"{dt} {v:.3g}" for dt, v in low.items()))
    print()
    print("order-error estimates across the variants: spread = max / min over the variants of each estimate, raw and")
    print("as the bound's baseline max(estimate, floor) (what --check compares, within ORDERR_CHECK_FACTOR[dtype])")
    spread: dict[tuple[str, str], tuple[float, str]] = {}
    top = {name: 0 for name in variants}
    for c in cases:
        for t in files[base][c]:
            if ".orderr." not in t:
                continue
            dt, quantity = t.split(".")[1], t.split("orderr.", 1)[1]
            fl = floor(dt, quantity, dims=dims(c))
            raw = {name: float(files[name][c][t].array()) for name in variants}
            for how, values in (("raw", raw), ("baseline", {n: max(v, fl) for n, v in raw.items()})):
                hi, lo = max(values.values()), min(values.values())
                s = hi / lo if lo > 0 else (1.0 if hi == 0 else np.inf)
                if s > spread.get((how, dt), (0.0, ""))[0]:
                    spread[(how, dt)] = (s, f"{c} {t}: " + ", ".join(f"{n} {v:.3g}" for n, v in values.items()))
            top.update({n: top[n] + 1 for n, v in raw.items() if v == max(raw.values()) > min(raw.values())})
    for (how, dt), (s, where) in sorted(spread.items()):
        print(f"  {how:<8} {dt:<9} {s:8.3g}x  {where}")
        if how == "baseline":
            print(f"  {'':<8} {'':<9} {'':>8}   ORDERR_CHECK_FACTOR[{dt}] = {ORDERR_CHECK_FACTOR[dt]:g}")
    print("  estimates where a variant draws the (strict) max: " + ", ".join(f"{n} {k}" for n, k in top.items()))
    return 0


def _bytes_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].data == b[k].data for k in a)


if __name__ == "__main__":
    sys.exit(main())

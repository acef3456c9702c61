"""What each JAX backend computes (harness.platforms) and the default matrix's points it cannot.

    python -m harness.run.platform_table [--backend tpu]   # the table and the not-applicable points
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from ..platforms import BACKENDS, PLATFORMS, current_backend, selection
from ..problems.matrix import build_matrix


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.run.platform_table", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=BACKENDS, help="default: the backend JAX runs on here")
    args = ap.parse_args(argv)
    backend = args.backend or current_backend()
    print("backend  float64  float16  matmul precision: float32 operand bits (meaning)")
    for b, p in PLATFORMS.items():
        mm = "; ".join(f"{k}: {bits} ({what})" for k, (bits, what) in p.matmul.items())
        print(f"{b:<8} {'IEEE' if p.float64 is None else 'no':<8} {'yes' if p.float16 is None else 'no':<8} {mm}")
    entries = build_matrix()
    chosen = selection(entries, backend)
    n = sum(len(v) for v in chosen.values())
    print(f"\n{backend}: {n} of {len(entries)} default matrix entries not applicable")
    for label, es in chosen.items():
        kinds = Counter(e.kind for e in es)
        print(f"  {len(es)} {label} ({', '.join(f'{k} {c}' for k, c in sorted(kinds.items()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

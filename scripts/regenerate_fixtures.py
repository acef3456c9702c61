#!/usr/bin/env python
"""Regenerate the committed fixtures (all, or --case NAME), or --check them.

The same as `csa-parity regenerate [--check] [--case NAME]`; the work is done by
`harness.run.regenerate.regenerate`. Inputs and weights come from a seeded numpy
generator and the goldens from torch_ref, single-threaded and deterministic, so
a rerun writes byte-identical files. `--check` regenerates in memory, compares
with the files under fixtures/, prints every difference and exits 1 if any.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from harness.run.regenerate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

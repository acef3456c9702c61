"""The parity matrix as data (like PyTorch's OpInfo): which checks exist.

A matrix entry is one (case, dtype, indexer chunk, teacher chunk, mode,
quantity). Tests and the CLI both read `build_matrix`; nothing else decides
what runs.

Sampling (the full cross product, ~1400 compiled programs, would take most of an
hour on 2 cores; `full=True` restores it for a long run):
- SWEEP_CASES (`small`, `flash_dims`: the head shapes that matter) sweep the
  indexer chunk over 0 and EVERY divisor of HI (teacher chunk 0) in float32,
  bfloat16 and float64, and over {0, 1, HI} in float16. This is the path with a
  checkpointed scan and the projection inside it, where chunking can go wrong.
- They sweep the teacher chunk over EVERY divisor of H (indexer chunk 0) in
  float32 and float64: chunking the teacher only reorders wide-dtype sums of an
  input-only softmax; the compute dtype only rounds the teacher inputs first,
  which the float32 run already covers.
- Every case (the layouts: packed, ragged, ties, ...) runs native and one
  combined point with chunk 2 on both knobs (the second-smallest divisor: more
  than one head per step and, beyond 2 heads, more than one step), in every
  dtype: the layout logic is shared by both paths; the combined point checks
  both scans against native on every layout.
- Forward quantities (keys, scores, top-k) do not depend on the teacher chunk
  or the loss mode: they are checked at teacher chunk 0 only, mode "forward".
"""

from __future__ import annotations

import dataclasses

from .cases import CASES
from .fixtures import PARAM_NAMES

DTYPES = ("float32", "bfloat16", "float16", "float64")
TEACHER_CHUNK_DTYPES = ("float32", "float64")
SWEEP_CASES = ("small", "flash_dims")
FORWARD_QUANTITIES = ("compressed_keys", "index_scores", "topk_indices")
LOSS_QUANTITIES = ("loss", *(f"grad.{p}" for p in PARAM_NAMES), "input_grads")
MODES = ("forward", "dense", "sparse")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    """One compiled configuration: everything but the quantity."""

    case: str
    dtype: str
    ichunk: int
    tchunk: int
    mode: str
    impl: str = "jax"

    @property
    def chunked(self) -> bool:
        return bool(self.ichunk or self.tchunk)

    @property
    def label(self) -> str:
        impl = "" if self.impl == "jax" else f" impl={self.impl}"
        return f"{self.case} {self.dtype} ichunk={self.ichunk} tchunk={self.tchunk} {self.mode}{impl}"

    @property
    def group(self) -> str:
        """Entries sharing compiled functions and torch results (one xdist worker each)."""
        return f"{self.impl}-{self.case}-{self.dtype}"


@dataclasses.dataclass(frozen=True, order=True)
class Entry:
    point: Point
    quantity: str

    @property
    def id(self) -> str:
        p = self.point
        impl = "" if p.impl == "jax" else f"{p.impl}-"
        return f"{impl}{p.case}-{p.dtype}-ichunk{p.ichunk}-tchunk{p.tchunk}-{p.mode}-{self.quantity}"

    @property
    def kind(self) -> str:
        q = self.quantity
        if q == "topk_indices":
            return "topk"
        if q == "input_grads":
            return "isolation"
        if q.startswith("grad"):
            return "grad"
        if q == "loss":
            return "loss"
        return "forward"


def chunk_pairs(case: str, dtype: str, full: bool = False) -> list[tuple[int, int]]:
    """The (indexer chunk, teacher chunk) pairs run for a case and dtype (see the module doc)."""
    cfg = CASES[case].config
    hi, h = cfg["index_n_heads"], cfg["num_query_heads"]
    if full:
        return [(i, t) for i in [0, *divisors(hi)] for t in [0, *divisors(h)]]
    smallest = (divisors(hi)[1] if hi > 1 else 1, divisors(h)[1] if h > 1 else 1)
    pairs = [(0, 0), smallest]
    if case in SWEEP_CASES:
        ichunks = divisors(hi) if dtype != "float16" else sorted({1, hi})
        pairs += [(c, 0) for c in ichunks]
        if dtype in TEACHER_CHUNK_DTYPES:
            pairs += [(0, t) for t in divisors(h)]
    return sorted(set(pairs))


def build_matrix(cases=None, dtypes=None, ichunks=None, tchunks=None, modes=None,
                 impl: str = "jax", full: bool = False) -> list[Entry]:
    """All entries. None = the sampling rule's choice; explicit `ichunks` / `tchunks`
    replace the sampled chunk pairs of every case by their cross product (a missing
    one counts as [0])."""
    entries = []
    for case in cases or CASES:
        for dtype in dtypes or DTYPES:
            if ichunks is None and tchunks is None:
                pairs = chunk_pairs(case, dtype, full)
            else:
                pairs = [(i, t) for i in (ichunks or [0]) for t in (tchunks or [0])]
            for ichunk, tchunk in pairs:
                for mode in modes or MODES:
                    if mode == "forward":
                        if tchunk:
                            continue
                        quantities = FORWARD_QUANTITIES
                    else:
                        quantities = LOSS_QUANTITIES
                    point = Point(case, dtype, ichunk, tchunk, mode, impl)
                    entries.extend(Entry(point, q) for q in quantities)
    return entries

"""Collect, then judge: the one path from a matrix entry to its results.

    outputs, references = collect(entry, reference)       # harness.implementations (cached)
    results = judge(entry, outputs, references, policy)   # harness.judge (pure)
    record(entry, result) for each result                 # harness.report

`evaluate` is the three steps in one call; tests/test_parity_matrix.py, the CLI workers
and the mutation worker all use it.

A point the backend cannot compute (harness.platforms, issue 14) is collected as
`Outputs(not_applicable=...)` without running anything: the judge reports it
`not_applicable`, counted and listed, never passed.
"""

from __future__ import annotations

from . import platforms
from .cases import CASES
from .compare import CheckResult
from .implementations import order_errors, outputs, reference_name
from .judge import judge
from .matrix import Entry, Point
from .outputs import Outputs, References
from .tolerance import Policy


def dims(case: str) -> dict[str, int]:
    """The problem sizes the reduction-length floors read (harness.tolerance.reduction_length)."""
    c = CASES[case]
    cfg = c.config
    return {"B": c.batch, "S": c.seq_len, "W": c.num_blocks, "HI": cfg["index_n_heads"],
            "DI": cfg["index_head_dim"], "R": cfg["q_lora_rank"], "E": cfg["emb_dim"],
            "m": cfg["compress_ratio"]}


def policy(profile: str = "highest") -> Policy:
    """The tolerance policy for a candidate that ran here at matmul precision `profile`."""
    return Policy(profile, platforms.current_backend())


def collect(entry: Entry, reference: str = "live") -> tuple[Outputs, References]:
    """The candidate's outputs at the entry's point, and what they are judged against: the
    reference (`live` torch_ref or the fixture `goldens`) in float64 and at the entry's
    dtype with its stored order errors, and the candidate's own run at `point.native`
    (chunked: unchunked; sharded: the same knobs on one device)."""
    p, ref = entry.point, reference_name(reference)
    backend = platforms.current_backend()
    reason = platforms.not_applicable(p.dtype, entry.kind, backend)
    if reason is not None:
        na = Outputs(entry.impl, not_applicable=platforms.not_applicable_label(backend, reason))
        return na, References(oracle=na, at_dtype=na)
    candidate = outputs(entry.impl, p.case, p)
    references = References(
        oracle=outputs(ref, p.case, Point(p.case, "float64")),
        at_dtype=outputs(ref, p.case, Point(p.case, p.dtype)),
        native=outputs(entry.impl, p.case, p.native) if p.native else None,
        order_errors=order_errors(p.case, p.dtype),
        dims=dims(p.case),
    )
    return candidate, references


def evaluate(entry: Entry, reference: str = "live", profile: str = "highest") -> list[CheckResult]:
    """Every check of one entry. `profile` picks the tolerance profile matching the matmul
    precision the candidate ran at (harness.tolerance.PROFILES)."""
    return judge(entry, *collect(entry, reference), policy(profile))

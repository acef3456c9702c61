"""The verdicts of the memory checks of head chunking, on numbers they are handed (bytes of a
compiled program, analytic floors): tests/test_memory.py, the mutation self-test's `memory`
check and benchmarks/memory_speed.py all judge with these. The numbers are
harness.judging.tolerance's MEMORY_FLOOR_FACTOR and MEMORY_GROWTH_SLACK, read when called."""

from __future__ import annotations

from . import tolerance


def within_floor_factor(held: float, floor: float) -> tuple[bool, float]:
    """(ok, ratio): a program holding `held` bytes against its analytic `floor` passes when
    held / floor <= MEMORY_FLOOR_FACTOR."""
    ratio = held / floor
    return bool(ratio <= tolerance.MEMORY_FLOOR_FACTOR), ratio


def grows_no_worse_than_linearly(points, slack: float | None = None):
    """No worse than linear: the memory each extra head adds (per-head slope between
    consecutive chunk sizes) never exceeds `slack` (default MEMORY_GROWTH_SLACK) times the
    larger of the floor's own per-head slope over the same step and every earlier measured
    slope. Linear growth has a constant slope; superlinear growth has a rising one.
    `points`: (chunk, bytes held, floor bytes) in increasing chunk order. Returns (ok, worst
    slope / allowed, per-step detail)."""
    slack = tolerance.MEMORY_GROWTH_SLACK if slack is None else slack
    worst, prev_max, detail = 0.0, 0.0, []
    for (c0, m0, f0), (c1, m1, f1) in zip(points, points[1:]):
        slope = (m1 - m0) / (c1 - c0)
        allowed = slack * max((f1 - f0) / (c1 - c0), prev_max)
        detail.append({"from": c0, "to": c1, "slope_bytes_per_head": slope, "allowed": allowed})
        if allowed > 0:
            worst = max(worst, slope / allowed)
        elif slope > 0:
            worst = float("inf")
        prev_max = max(prev_max, slope)
    return worst <= 1.0, worst, detail

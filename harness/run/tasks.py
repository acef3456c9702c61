"""What a worker of `csa-parity run` does with one point (harness.sides.worker runs the task
`TASK` names): collect and judge every entry of the point, as report records; and the records
of a point that could not be collected.
"""

from __future__ import annotations

import traceback

from ..judging.judge import judge
from ..outputs import Outputs
from ..sides.worker import first_line
from .collect import evaluate
from .report import record

TASK = f"{__name__}:evaluate_point"


def error_records(entries, line: str) -> list[dict]:
    """The records of `entries` when their point could not be collected: `error` with `line`."""
    return [record(e, r) for e in entries for r in judge(e, Outputs(e.impl, error=line), None)]


def evaluate_point(entries, reference: str, profile: str) -> list[dict]:
    try:
        return [record(e, r) for e in entries for r in evaluate(e, reference, profile)]
    except Exception as exc:  # the harness or a built-in side raised: the point's error, traceback on stderr
        traceback.print_exc()
        return error_records(entries, f"the harness raised at {entries[0].point.label}: {first_line(exc)} "
                                      "(traceback on stderr)")

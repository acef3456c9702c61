"""What each JAX backend computes, as data, and which matrix points it cannot.

One `Platform` row per backend (cpu, gpu, tpu): whether it has IEEE float64 and float16, and
what each matmul precision means for a float32 matmul there (the mantissa its operands keep).
Two things read it:

- `not_applicable(dtype, kind, backend)`: a pure function, None when the backend can
  compute the point, else the reason. Such a point is reported with the status "not
  applicable on <backend>: <reason>": counted and listed in every report, never dropped,
  never counted as passed (harness.run.collect / harness.judging.judge / harness.run.report; pytest skips it
  with the reason).
- `float32_operand_bits(backend, precision)`: the mantissa bits a float32 matmul operand
  keeps under a precision; harness.judging.tolerance turns it into the float32 floor of the
  `default` profile per backend (a TPU's one bfloat16 pass is not a GPU's TF32).

Sources: XLA:TPU has no native float64 (it emulates some 64-bit operations, not as IEEE
double, and rejects others), so the 1e-12 exactness checks cannot hold there; they come from
the CPU leg. XLA:TPU's DEFAULT precision rounds float32 matmul operands to bfloat16 (8-bit
significand, 7 bits stored) for one pass, HIGH takes three bfloat16 passes (~16 bits),
HIGHEST six (float32). XLA:GPU's DEFAULT on Ampere and later uses TF32 (10 stored mantissa
bits), HIGHEST true float32. XLA:CPU ignores the precision setting: every float32 matmul is
true float32. Nothing here has been measured on an accelerator yet; the first TPU/GPU run should
confirm it (docs/platforms.md says how).

The table and the matrix points a backend cannot compute: `python -m harness.run.platform_table`.
"""

from __future__ import annotations

import dataclasses

BACKENDS = ("cpu", "gpu", "tpu")
KINDS = ("forward", "topk", "loss", "grad", "isolation", "codes")  # harness.points.Entry.kind


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str
    float64: str | None  # None: IEEE double; else why float64 points are not applicable
    float16: str | None  # None: computes float16; else why not
    # matmul precision -> (stored mantissa bits a float32 operand keeps, what it means)
    matmul: dict[str, tuple[int, str]]


PLATFORMS: dict[str, Platform] = {
    "cpu": Platform(
        "cpu", None, None,
        {"highest": (23, "true float32 products"),
         "default": (23, "same as highest: XLA:CPU ignores the matmul precision")}),
    "gpu": Platform(
        "gpu", None, None,
        {"highest": (23, "true float32 products"),
         "default": (10, "TF32 on Ampere and later: operands rounded to a 10-bit mantissa, "
                         "float32 accumulation")}),
    "tpu": Platform(
        "tpu",
        "XLA:TPU has no IEEE float64 (some 64-bit operations are emulated, not as IEEE "
        "double, others rejected): the float64 oracle and exactness checks come from the CPU leg",
        None,
        {"highest": (23, "six bfloat16 passes: float32 products"),
         "default": (7, "one bfloat16 pass: operands rounded to bfloat16 (7 stored bits), "
                        "float32 accumulation")}),
}


def platform(backend: str) -> Platform:
    try:
        return PLATFORMS[backend]
    except KeyError:
        raise ValueError(f"backend={backend!r} is not known (valid: {', '.join(BACKENDS)})") from None


def current_backend() -> str:
    """The backend JAX runs on in this process (tests monkeypatch this to ask 'what if tpu')."""
    import jax

    return jax.default_backend()


def float32_operand_bits(backend: str, precision: str) -> int:
    """Stored mantissa bits of a float32 matmul operand under `precision` on `backend`."""
    table = platform(backend).matmul
    if precision not in table:
        raise ValueError(f"precision={precision!r} is not supported (valid: {', '.join(table)})")
    return table[precision][0]


def not_applicable(dtype: str, kind: str, backend: str) -> str | None:
    """None when `backend` can compute a matrix entry of `dtype` and kind `kind` (forward,
    topk, loss, grad, isolation, codes: harness.points.Entry.kind), else the reason. Today only the
    dtype decides (every kind of a float64 point needs float64 arithmetic); the kind is part
    of the question so a backend row can exclude one kind without changing any caller.
    Pure: the same answer for the same arguments, whatever runs this process."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not known (valid: {', '.join(KINDS)})")
    p = platform(backend)
    if dtype == "float64" and p.float64 is not None:
        return p.float64
    if dtype == "float16" and p.float16 is not None:
        return p.float16
    return None


def not_applicable_label(backend: str, reason: str) -> str:
    return f"not applicable on {backend}: {reason}"


def selection(entries, backend: str) -> dict[str, list]:
    """{reason label: [entries]} of the matrix entries `backend` cannot compute."""
    out: dict[str, list] = {}
    for e in entries:
        reason = not_applicable(e.point.dtype, e.kind, backend)
        if reason is not None:
            out.setdefault(not_applicable_label(backend, reason), []).append(e)
    return out

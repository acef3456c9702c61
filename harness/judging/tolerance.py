"""Every number that decides pass or fail, with the reason beside it.

Errors are normalised (harness.judging.compare): max |x - ref| / max |ref| per tensor,
per query row for scores, relative for scalars. "ulp(t)" below is the spacing
of dtype t at 1.0: float32 2^-23, bfloat16 2^-7, float16 2^-10.

Every figure quoted as "measured" below is re-measured by one command,

    python scripts/measure_tolerances.py          # [--quick]: fewer seeds and fixtures

which reruns each measurement (random problems for CHUNK, the committed fixtures
for the rest) and prints the worst value per entry next to its bound. A change
of a bound reruns it and updates the figures here.

Tables are keyed by the numeric kinds of harness.outputs.kind_of: forward
(compressed keys, scores), loss, grad. The top-k rule takes its score tolerance
from the forward row; isolation is exact (0). `Policy` is the judge's view of
all of it (harness.judging.judge).

`entries()` lists every number of this module; tests/test_tolerance_boundaries.py pins each
one (PINS) and judges hand-made errors at 0.9x and 1.1x of its bound, so a number changed
here is changed there too (and a new one gets a pin and a boundary case there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from ..outputs import kind_of


def numeric_kind(quantity: str) -> str:
    """forward | loss | grad: the row of the tables below that judges `quantity`."""
    kind = kind_of(quantity)
    if kind not in ("forward", "loss", "grad"):
        raise KeyError(f"{quantity!r} ({kind}) has no numeric tolerance")
    return kind


# --- SPEC section 10: JAX vs the float64 oracle, relative to torch at the same dtype
# err(jax@t) <= ALPHA[kind] * max(err(torch@t), FLOOR[t]).
# Alpha: FlashAttention's rule, 2 for forward values; gradients chain one more
# rounded product (the cotangent of each low-precision cast is rounded again),
# hence 3 (SPEC section 10).
ALPHA = {"forward": 2.0, "loss": 2.0, "grad": 3.0}

# Floors stop a lucky near-zero torch error from making the bound impossible
# (e.g. a loss whose inputs round identically on both sides).
# - forward and grad: one unit roundoff of the compute dtype, relative to the
#   tensor's largest value: an implementation cannot promise less than
#   rounding its own output once.
# - loss: a scalar reduced in the wide dtype (float32 for every dtype but
#   float64) over up to B*S*W = 2048 terms in the committed fixtures. Its error
#   is a single draw of a random walk of size ~sqrt(2048) * 2^-24 = 2.7e-6, so a
#   lucky torch draw can be several times below an equally good JAX one (measured:
#   torch 3.2e-8 vs JAX 1.2e-7 on `small` float32 sparse). Floor: 2^-18 = 3.8e-6,
#   the random-walk size with a 1.4x margin.
FLOOR = {
    "float32": {"forward": 2.0**-24, "loss": 2.0**-18, "grad": 2.0**-24},
    "bfloat16": {"forward": 2.0**-9, "loss": 2.0**-18, "grad": 2.0**-9},
    "float16": {"forward": 2.0**-12, "loss": 2.0**-18, "grad": 2.0**-12},
}


# --- Floors that scale with the reduction. A float32 result that is a sum of n
# rounded terms carries a random-walk error of about sqrt(n) unit roundoffs, whichever
# implementation sums it, so an equally good JAX error can sit sqrt(n) u above a lucky torch
# draw. The reductions are carried in float32 (the wide dtype) for every dtype but float64,
# so the unit roundoff is float32's, u = 2^-24, for float32, bfloat16 and float16 alike
# (for bfloat16/float16 the per-dtype floors above stay larger: 2^-9, 2^-12 > 100 u).
# Independent roundings of the sums on one result's path add in quadrature, so n counts the
# terms of every sum that reaches the result:
#   index_scores: n = HI * DI + R + E: the HI*DI products summed into one score (DI per
#     head, HI heads), each fed by a query projected over R = q_lora_rank terms and a key
#     projected over E = emb_dim terms: tiny 48 (floor 6.9 u = 4.1e-7), small 352 (18.8 u),
#     flash_dims 8272 (91 u = 5.4e-6).
#   compressed_keys: n = E + 2 * m + DI: the key projection (E terms), the softmax pool over
#     2 * compress_ratio slots and the RMS norm's mean over DI: tiny 32 (5.7 u), small and
#     all_invalid 104 (10.2 u).
#   grad.*: n = B * S * W, the (query, block) terms of the loss that every parameter
#     gradient sums (each reaches a parameter through its score), as for the loss floor:
#     tiny 64 (8 u = 4.8e-7), small/packed 2048 (45 u = 2.7e-6), flash_dims 1024 (32 u).
# At most sqrt(n) u: never more. The loss keeps its floor above (same random walk, n = 2048).
WIDE_U = 2.0**-24


def reduction_length(quantity: str, dims: dict) -> int | None:
    """n of the floor above for `quantity` of a problem with dims {B, S, W, HI, DI, R, E, m},
    or None when the quantity's floor does not scale."""
    if quantity == "index_scores":
        return dims["HI"] * dims["DI"] + dims["R"] + dims["E"]
    if quantity == "compressed_keys":
        return dims["E"] + 2 * dims["m"] + dims["DI"]
    if quantity.startswith("grad"):
        return dims["B"] * dims["S"] * dims["W"]
    return None


# --- A narrow dtype's loss is held no tighter than the wide dtype's reference.
# For bfloat16 and float16 both sides compute the loss's wide parts in float32 (the RoPE angles,
# every accumulation, the softmaxes, the KL sum) and round to the dtype only what they store
# (inputs, projections, keys, queries). So the loss's error at the dtype is e32 + e_t: the float32
# pipeline's own error e32, which every implementation of these formulas in float32 shares (it is
# the float32 reference's error, the same over evaluation orders and ISA variants), plus the
# dtype's roundings e_t. Where e_t happens to cancel e32, the reference at the dtype lands closer
# to the oracle than its float32 self; another implementation's roundings are another draw of
# e_t, and |e32 + e_t'| is then about |e32|. A bound below the float32 reference's error would
# rest on that accident, so the baseline of a bfloat16 or float16 loss is at least
# WIDE_REFERENCE_SHARE times the float32 reference's stored error of the same loss (the fixture's
# golden.float32.[teacher.]orderr.<loss>). Measured (yarn_tail, compressed teacher, dense loss,
# relative error; `python scripts/measure_isa_variants.py` for the torch figures): torch float32
# 4.76e-5 under every ISA variant, float16 7.3e-6 to 7.5e-6 under ATen's vectorised kernels but
# 5.2e-5 under its baseline ones, bfloat16 1.15e-3; jax_impl float32 4.78e-5, float16 5.39e-5.
# Past 65536 positions the float32 RoPE angles lose about 8e-4 of the scores on both sides, e32,
# and the vectorised float16 reference cancels most of it. Share 1: no narrow loss is held below
# the wide reference's own error; a smaller share would keep part of the accident. Forward values
# and gradients are not affected: their bfloat16 / float16 floors (2^-9, 2^-12 relative) are far
# above any float32 error of these problems (at most 4e-5), while the loss floor is float32's.
WIDE_REFERENCE_SHARE = {"loss": 1.0}
WIDE_DTYPE = "float32"
NARROW_DTYPES = ("bfloat16", "float16")


def wide_reference_floor(dtype: str, quantity: str, wide_error: float | None) -> float:
    """The floor the wide dtype's reference sets for `quantity` at `dtype`: WIDE_REFERENCE_SHARE
    times `wide_error` (the float32 reference's stored error of the same quantity) for a narrow
    dtype's loss, else 0."""
    share = WIDE_REFERENCE_SHARE.get(numeric_kind(quantity))
    if share is None or dtype not in NARROW_DTYPES or wide_error is None:
        return 0.0
    return share * float(wide_error)


# --- Precision profiles. Parity runs at `highest` matmul precision by default:
# float32 matmuls are then true float32 on every platform, and the table above applies
# unchanged. `default` is each backend's out-of-the-box float32 matmul: its operands keep
# fewer mantissa bits (harness.platforms: TPU one bfloat16 pass, 7 stored bits; GPU TF32,
# 10 bits; CPU ignores the setting, 23 bits). Under it a float32 run is as accurate as a
# run whose matmul operands are rounded to that mantissa, so the float32 forward/grad floors rise
# to half its unit roundoff, 2^-(bits + 2), the convention of the bfloat16 (2^-9, 7 bits)
# and float16 (2^-12, 10 bits) rows above; the torch reference (CPU) keeps true float32, so
# without the raised floor every float32 matmul result would fail. On CPU `default` equals
# `highest` (same numbers, same table). On a TPU the floor alone does not cover what its
# arithmetic costs: a measured platform profile multiplies the oracle bounds (below).
# The `highest` table is never loosened to absorb `default`.
PROFILES = ("highest", "default")


def floor(dtype: str, quantity: str, profile: str = "highest", backend: str = "cpu",
          dims: dict | None = None) -> float:
    """The floor of SPEC section 10 for `quantity` at `dtype`, under the matmul precision
    `profile` on `backend`, for a problem of `dims` (None: no reduction-length floor)."""
    from ..platforms import float32_operand_bits

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not supported (valid: {', '.join(PROFILES)})")
    kind = numeric_kind(quantity)
    value = FLOOR[dtype][kind]
    bits = float32_operand_bits(backend, profile)
    if dtype == "float32" and kind != "loss" and bits < 23:
        value = max(value, 2.0 ** -(bits + 2))
    n = reduction_length(quantity, dims) if dims is not None else None
    if n:
        value = max(value, n ** 0.5 * WIDE_U)
    return value


# --- float64 JAX vs float64 torch: two implementations of the same formulas in
# IEEE double differ only by rounding order. 1e-12 is ~1e4 unit roundoffs
# (2^-53 = 1.1e-16) for chains of O(100) operations, and ~1e9 below any formula error.
EXACT64 = 1e-12

# --- Chunked vs native JAX at the same dtype.
# The head-chunked path projects each chunk's queries inside the scan body
# (no all-heads q ever exists). XLA:CPU picks a different GEMM blocking for a
# 32-column slice than for the whole matrix, so q can differ by one ulp of the
# compute dtype (measured with each projection jitted alone: 25045 of 32768
# float32 entries at chunk 1, 0 in bfloat16, 28 in float16; 0 at chunk >= 2).
# Everything after the projection is wide-dtype and differs only by summation order. In the backward pass, cotangents cross the
# casts to the compute dtype, so one last-bit difference in an f32 cotangent can
# flip a bfloat16/float16 rounding: gradients of low-precision runs may move by
# an ulp of the compute dtype in a few elements.
# Measured worst on random small problems (3 seeds, every chunk size of both knobs, dense
# and sparse; after jax_impl/precision.round_to made every cast round exactly once):
#   float32:  forward 2.4e-6, loss 1.9e-7, grad 5.1e-7
#   bfloat16: forward 1.1e-6, loss 2.0e-7, grad 1.6e-3 (0.21 ulp(bf16))
#   float16:  forward 8.7e-5, loss 3.0e-7, grad 5.9e-4 (0.6 ulp(f16))
# Query chunks (same bound) r = 16 and 21 on S = 64, same problems:
#   float32:  forward 6.2e-7, loss 3.8e-7, grad 4.8e-7
#   bfloat16: forward 0,      loss 3.0e-7, grad 1.6e-3 (0.21 ulp(bf16))
#   float16:  forward 0,      loss 3.0e-7, grad 4.8e-4 (0.49 ulp(f16))
# Every parameter's gradient is summed over the query blocks in float32 and rounded to the
# compute dtype once, as the native contraction's is (jax_impl.precision.project with a wide
# weight, round_grad_to; tests/test_query_chunk.py): rounding each block's wq_b / weights_proj
# gradient at its own cast gave 4.4e-3 (bfloat16) and 6.4e-4 (float16) here, and 0.80 of the
# bound on the default sample's window_one bfloat16 i2/t2/q10 wq_b (0.003 once rounded once).
# (float16 forward stays above bfloat16's: a one-ulp f16 flip of q, from a different
# float32 FMA contraction of the RoPE products in the narrower program, moves a score by
# 2^-11 relative; bfloat16 flips are 8x rarer at the same f32 noise.)
# The scores are judged per query row, so a row whose head terms cancel carries its sum-order
# noise at the scale of its terms, not of its score. The matrix's worst such row: ragged's
# query 4, a single valid block whose 64 head terms sum to 1/393 of their magnitudes. Measured
# over the full sample's forward entries (`csa-parity run --sample full --dtypes
# float32,bfloat16,float16 --modes forward --reference goldens`, 741 points, 1812 chunk checks,
# CPU): float32 4.1e-5 there at indexer chunk 1 (q one ulp off, the GEMM blocking above),
# 1.6e-5 at chunks 2 and 4; every other row of the sample at most 3.3e-6 (ties, chunk 1).
# bfloat16 3.0e-6 and float16 2.8e-4 (small, chunk 1) in the same run.
# Each bound is a round number a few times above its measurement, and in float32 more than
# 10x below bfloat16's rounding of a score (2^-9), so a narrowed sum inside a chunk fails it.
CHUNK = {
    "float64": {"forward": EXACT64, "loss": EXACT64, "grad": EXACT64},
    "float32": {"forward": 1e-4, "loss": 2e-6, "grad": 4e-6},
    "bfloat16": {"forward": 2e-4, "loss": 5e-6, "grad": 2.0**-7},
    "float16": {"forward": 4e-4, "loss": 5e-6, "grad": 4.0 * 2.0**-10},
}


def chunk_bound(dtype: str, quantity: str) -> float:
    return CHUNK[dtype][numeric_kind(quantity)]


# --- The Pallas scoring backend vs the XLA path, same dtype and knobs (the `xla` check).
# Same math, other summation order: the kernels add the heads one by one into a float32
# (float64) tile and accumulate dq, dw and dK over tiles, where XLA contracts the [.., c, W]
# logits its own way. As with CHUNK, a last-bit difference of a float32 cotangent can flip the
# rounding of a low-precision parameter gradient at its cast.
# The scores are judged per query row (against the row's largest score), so a short row whose
# head sum cancels shows a float32 reordering at its largest: the kernels compute a head's
# logits as the [keys, rows] tile K . q_h^T, which XLA:CPU contracts in another order than
# XLA's [rows, keys] einsum.
# The teacher's kernels sum each head's exp(logit - normaliser) in the same arithmetic as XLA's
# softmax (jax_impl.loss), tile by tile: another summation order again.
# Measured worst over the default sample's 27 pallas points (612 entries; interpret mode, CPU;
# every case natively, the sweep cases in every dtype and at the combined chunk point), with
# the kernels in that [keys, rows] layout and the teacher's kernels (`csa-parity run --sample
# default --reference goldens --backends pallas`, the `xla` checks):
#   float64:  forward 1.8e-15, loss 3.4e-16, grad 1.5e-15
#   float32:  forward 1.4e-6 (flash_dims), loss 1.5e-7, grad 9.7e-7
#   bfloat16: forward 8.5e-6 (window_heavy, query 4), loss 3.5e-7, grad 3.5e-3 (0.44 ulp(bf16))
#   float16:  forward 1.2e-6 (flash_dims), loss 3.8e-7, grad 6.3e-4 (0.32 ulp(f16))
# (with the XLA teacher on both sides: loss 1.6e-7, 2.1e-7, 1.5e-7 and grad 6.2e-7, 3.0e-3,
# 4.4e-4 in float32, bfloat16, float16). The default sample runs ragged on pallas only in
# float64. Its query 4 (CHUNK above: one valid block, head terms cancelling 393-fold) gives, on
# the tpu sample's pallas points on a CPU (`csa-parity run --sample tpu --reference goldens
# --backends pallas`, 398 entries, 1068 checks), float32 forward 2.0e-5; and float16 2.7e-5
# natively, 2.9e-5 at indexer chunk 2 (`--cases ragged --dtypes float16 --backends pallas
# --ichunks 0,2 --tchunks 0 --qchunks 0 --modes forward`). Every other entry of those runs:
# float32 forward at most 1.4e-6, loss 4.5e-7, grad 6.1e-7; bfloat16 forward 8.5e-6, grad
# 3.5e-3; float16 forward 9.9e-7. Each bound is a round number 2.3-10x above its
# measurement, and at or below CHUNK's.
BACKEND = {
    "float64": {"forward": EXACT64, "loss": EXACT64, "grad": EXACT64},
    "float32": {"forward": 5e-5, "loss": 1e-6, "grad": 5e-6},
    "bfloat16": {"forward": 5e-5, "loss": 1e-6, "grad": 2.0**-7},
    "float16": {"forward": 1e-4, "loss": 1e-6, "grad": 2.0**-9},
}


# The `kernel` check (harness.sides.kernel_check): the kernels' forward fed bfloat16 q and K against
# the XLA contribution of the same values widened to float32. A bfloat16 product is exact in
# float32, so only the order of float32 sums differs: measured 6.5e-9 (normwise, 3 heads of 8
# channels); 1e-6 is ~16 float32 unit roundoffs. A bfloat16 accumulator is off by ~2^-9.
KERNEL_BF16_FORWARD = 1e-6


def backend_bound(dtype: str, quantity: str) -> float:
    return BACKEND[dtype][numeric_kind(quantity)]


# --- Top-k: a pick that differs from the reference's is excused only when it and the
# pick it replaced both score within the forward bound of the reference's k-th score
# (harness.judging.judge.score_tolerance; the rule itself is harness.judging.compare.topk_sets, the only
# one in the project). Isolation: d loss / d inputs must be exactly 0: the largest |input
# gradient| allowed (harness.judging.compare.exactly_zero) is 0.
ISOLATION = 0.0


# --- fixtures --check (harness.run.regenerate): how far a regenerated golden may move from
# the committed one. Inputs and parameters come from numpy's seeded PCG64 and must match
# bit for bit. Goldens come from torch kernels whose reduction order may differ between
# CPUs and library builds (not between runs: generation runs single-threaded with
# deterministic algorithms, and two runs on one machine are byte-identical, which
# tests/test_fixtures.py asserts). The bound is normwise: max |new - old| over the finite
# entries <= rtol * max |old|, with -inf / NaN patterns exact; top-k picks as sets per
# query, a swap excused only between scores tied within rtol * max |row| (the judge's
# tie rule, harness.judging.compare.topk_sets).
#   float64: 1e-12 (= EXACT64). A different summation order moves a float64 result by a
#     few ulp of its partial sums (about 1e-16 relative, times at most a few hundred
#     terms); a regeneration that moves further is a change of formula, not of order
#     (jax_impl, a whole other implementation, differs from the float64 goldens by at
#     most 3.8e-15 normwise).
#   float32 / bfloat16 / float16: 16 * eps(dtype) = 1.9e-6, 6.3e-2, 7.8e-3 (eps: 2^-23,
#     2^-8, 2^-11). Measured here (AMD EPYC, torch 2.13 CPU): run to run 0 (bit-identical);
#     1 vs 2 threads, deterministic algorithms on vs off: also 0 (at these sizes torch's
#     CPU kernels do not split reductions across threads). So the only thing another
#     build could do is reorder sums; the largest reordering at hand is a whole other
#     implementation, jax_impl on the same fixtures, and it differs from these goldens by
#     at most 3.1 eps(dtype) on keys and scores, 3.0 eps on losses, and 8.7 eps (float32),
#     1.0 eps (bfloat16), 1.3 eps (float16) on gradients (scripts/measure_tolerances.py,
#     FIXTURE_CHECK). 16 eps covers that with room and still flags a real change.
#     A pick that flips at a near-tie shows up in topk_indices and in the own-selection
#     sparse goldens, loudly, and is worth a look.
FIXTURE_CHECK_RTOL = {
    "float64": EXACT64,
    "float32": 16 * 2.0 ** -23,
    "bfloat16": 16 * 2.0 ** -8,
    "float16": 16 * 2.0 ** -11,
}
# A stored order error (golden.<dtype>.orderr.<name>) is an error estimate, not a value: the max,
# over K evaluation orders and over the CPU kernels a user's torch may pick
# (harness.run.regenerate.ISA_VARIANTS), of the reference's error at the dtype. --check
# regenerates it in one process, so under one variant's kernels, and compares it as the baseline
# of a bound, max(estimate, floor) (harness.run.regenerate.compare_order_error): regenerated and
# committed within this factor of each other. Measured: the largest spread (max / min over the 7
# variants) of that baseline over the 630 estimates of each dtype, `python
# scripts/measure_isa_variants.py` on an Intel Xeon with AVX512, AVX512-BF16 and AMX:
#   float32 25.2x (window_heavy's scores: MKL's AVX512 path draws 4.0e-5, its AVX2 path 1.6e-6,
#     COMPATIBLE 2.9e-5; the raw estimates, below their floors, spread up to 39x),
#   bfloat16 1.02x, float16 7.19x (yarn_tail's compressed-teacher dense loss: ATen's baseline
#     kernels 5.2e-5, the vectorised ones 7.3e-6).
# Each factor is a round number at or above its measurement; the committed estimate is the max,
# so any listed variant regenerates within it (tests/test_fixtures.py checks one case under two
# of them), and a factor beyond it is a change of the reference, not of the CPU.
ORDERR_CHECK_FACTOR = {"float32": 32.0, "bfloat16": 1.25, "float16": 8.0}


# --- Memory of head chunking (tests/test_memory.py, the mutation self-test's `memory`
# check and benchmarks/memory_speed.py, which read these: a test keeps them the same).
# Chunk 1 holds at most MEMORY_FLOOR_FACTOR x its analytic floor, the memory bound head
# chunking must meet (measured 1.83 x with jax.checkpoint around the scan body, 2.45 x
# without it: `python -m benchmarks.memory_speed`).
MEMORY_FLOOR_FACTOR = 2.0
# Per-head growth of temp memory with the chunk size: at most the floor's per-head cost
# (or the largest earlier one) times this slack: room for XLA's buffer packing, while the
# plain-autodiff backward (4A per head instead of 2A) fails.
MEMORY_GROWTH_SLACK = 1.15


@dataclasses.dataclass(frozen=True)
class Policy:
    """The tolerance policy the judge applies: the tables above under one matmul precision
    profile, on one backend (whose float32 matmul operands the `default` profile's floors
    read: harness.platforms). The judge hands `floor` the problem's dims for the floors that
    scale with the reduction (`reduction_length`)."""

    profile: str = "highest"
    backend: str = "cpu"
    # The platform profile of the device the candidate ran on (harness.platforms.load_profile,
    # at this matmul precision): ((dtype, kind, factor), ...) and its name; () on a CPU.
    platform_factors: tuple = ()
    platform_profile: str = ""

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile={self.profile!r} is not supported (valid: {', '.join(PROFILES)})")
        for dtype, kind, factor in self.platform_factors:
            if not factor >= 1:
                raise ValueError(f"platform factor {dtype}.{kind}={factor!r} must be >= 1: a profile never "
                                 "tightens the CPU's bounds")

    def oracle_factor(self, dtype: str, quantity: str) -> float:
        """The platform profile's factor on the oracle checks of `quantity` at `dtype` (1 without
        a profile, and for float64, whose exact64 check no profile touches)."""
        return oracle_factor(self.platform_factors, dtype, numeric_kind(quantity))

    def alpha(self, quantity: str) -> float:
        return ALPHA[numeric_kind(quantity)]

    def floor(self, dtype: str, quantity: str, dims: Mapping[str, int] | None = None,
              wide_error: float | None = None) -> float:
        """The floor of `quantity` at `dtype` (`floor`), at least `wide_reference_floor` for
        `wide_error`, the wide dtype's reference's stored error of the same quantity."""
        own = floor(dtype, quantity, self.profile, self.backend, dict(dims) if dims is not None else None)
        return max(own, wide_reference_floor(dtype, quantity, wide_error))

    def chunk(self, dtype: str, quantity: str) -> float:
        return chunk_bound(dtype, quantity)

    def backend_bound(self, dtype: str, quantity: str) -> float:
        return backend_bound(dtype, quantity)

    def backend_check_not_applicable(self, dtype: str, kind: str) -> str | None:
        """Why a scoring backend cannot be held to the XLA path for an entry of `kind` (forward,
        topk, loss, grad, isolation, codes: harness.points.Entry.kind) at `dtype` under
        this precision on this device (the `xla` checks), else None. The kernels name every dot's
        precision (jax_impl/kernels): float32 operands at HIGHEST, bfloat16 x bfloat16 at DEFAULT
        (exact), and in the backward the float32 cotangent against bfloat16 queries and keys as
        two bfloat16 terms (~16 bits). Where this precision rounds the XLA path's float32
        operands (a TPU at `default`: one bfloat16 pass), the two compute other products: every
        float32 quantity, and a bfloat16 point's gradients (measured on a v5e at `default`: up
        to 1.6 times the bfloat16 gradient bound, in one element of a tensor). The BACKEND bound,
        a summation-order bound, then does not apply; a bfloat16 point's forward and loss, whose
        products are exact on both, keep it. Compare the backends at `highest`."""
        from ..platforms import float32_operand_bits, not_applicable_label

        bits = float32_operand_bits(self.backend, self.profile)
        if bits >= 23 or not (dtype == "float32" or (dtype == "bfloat16" and kind == "grad")):
            return None
        operands = "float32 operands" if dtype == "float32" else "the float32 cotangent"
        kernels = "at HIGHEST" if dtype == "float32" else "as two bfloat16 terms"
        return not_applicable_label(self.backend, f"at matmul precision {self.profile!r} the XLA path multiplies "
                                    f"{operands} rounded to {bits} mantissa bits, the Pallas kernels {kernels}; "
                                    "compare the backends at --precision highest")

    @property
    def exact64(self) -> float:
        return EXACT64

    @property
    def isolation(self) -> float:
        return ISOLATION


def entries() -> list[tuple[str, tuple, float]]:
    """Every number of this module that decides a verdict, as (dotted name, keys, value):
    each upper-case module-level number (`EXACT64`: keys ("EXACT64",)) and each number of an
    upper-case table, nested dicts and tuples included (`CHUNK.float32.grad`: keys ("CHUNK",
    "float32", "grad")). Found by walking the module, so a number added here is listed
    without being registered anywhere: tests/test_tolerance_boundaries.py pins each one at
    its boundary (and fails, naming it, for one it has no boundary case for), and
    harness.selftest.judge_mutations loosens each one in turn."""
    out: list[tuple[str, tuple, float]] = []

    def walk(keys: tuple, value) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            out.append((".".join(str(k) for k in keys), keys, float(value)))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk((*keys, k), v)
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk((*keys, i), v)

    for name, value in list(globals().items()):
        if name.isupper() and not name.startswith("_"):
            walk((name,), value)
    return out


def loosened(value: float) -> float:
    """`value` made 10 times looser: every number here is a bound, a floor, a multiplier of
    one or a factor, so larger is looser; a bound of 0 becomes the smallest positive double."""
    return value * 10.0 if value > 0 else math.ulp(0.0)


# --- Platform profiles (harness/profiles/*.json, harness.platforms.load_profile): on a device
# whose arithmetic is not the CPU's, the oracle rule's bound is multiplied by the factor its
# profile measured for the run's matmul precision, dtype and kind. The numbers are data, each
# with its measurement beside it in the file, made by scripts/measure_platform_profile.py (its
# margin and grid are stated there and stored in the file); tests/test_platform_profiles.py pins
# each one at its boundary. The checks that compare a device with itself (chunk, xla, exact64)
# never read a factor.


def policy_factors(factors: Mapping[str, Mapping[str, float]]) -> tuple:
    """{dtype: {kind: factor}} as Policy.platform_factors."""
    return tuple((d, k, float(v)) for d, row in sorted(factors.items()) for k, v in sorted(row.items()))


def oracle_factor(platform_factors: tuple, dtype: str, kind: str) -> float:
    """The factor of (dtype, kind) among `platform_factors`; 1 where none is given."""
    for d, k, v in platform_factors:
        if d == dtype and k == kind:
            return v
    return 1.0

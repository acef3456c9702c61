"""Every number that decides pass or fail, with the reason beside it.

Errors are normalised (harness.compare): max |x - ref| / max |ref| per tensor,
per query row for scores, relative for scalars. "ulp(t)" below is the spacing
of dtype t at 1.0: float32 2^-23, bfloat16 2^-7, float16 2^-10.

The figures quoted as "measured" come from `python scripts/measure_tolerances.py`,
which reruns each measurement (random problems for CHUNK, the committed fixtures
for the rest) and prints the worst value per entry next to its bound.
"""

from __future__ import annotations

# Quantity kinds: how each compared quantity is grouped for the tables below.
def kind_of(quantity: str) -> str:
    if quantity in ("compressed_keys", "index_scores"):
        return "fwd"
    if quantity.startswith("loss"):
        return "loss"
    if quantity.startswith("grad"):
        return "grad"
    raise KeyError(quantity)


# --- SPEC section 10: JAX vs the float64 oracle, relative to torch at the same dtype
# err(jax@t) <= ALPHA[kind] * max(err(torch@t), FLOOR[t]).
# Alpha: FlashAttention's rule, 2 for forward values; gradients chain one more
# rounded product (the cotangent of each low-precision cast is rounded again),
# hence 3 (SPEC section 10).
ALPHA = {"fwd": 2.0, "loss": 2.0, "grad": 3.0}

# Floors stop a lucky near-zero torch error from making the bound impossible
# (e.g. a loss whose inputs round identically on both sides).
# - fwd and grad: one unit roundoff of the compute dtype, relative to the
#   tensor's largest value: an implementation cannot promise less than
#   rounding its own output once.
# - loss: a scalar reduced in the wide dtype (float32 for every dtype but
#   float64) over up to B*S*W = 2048 terms in the committed fixtures. Its error
#   is a single draw of a random walk of size ~sqrt(2048) * 2^-24 = 2.7e-6, so a
#   lucky torch draw can be several times below an equally good JAX one (measured:
#   torch 3.2e-8 vs JAX 1.2e-7 on `small` float32 sparse). Floor: 2^-18 = 3.8e-6,
#   the random-walk size with a 1.4x margin.
FLOOR = {
    "float32": {"fwd": 2.0**-24, "loss": 2.0**-18, "grad": 2.0**-24},
    "bfloat16": {"fwd": 2.0**-9, "loss": 2.0**-18, "grad": 2.0**-9},
    "float16": {"fwd": 2.0**-12, "loss": 2.0**-18, "grad": 2.0**-12},
}


# --- Floors that scale with the reduction (issue 14). A float32 result that is a sum of n
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


# --- Precision profiles (issues 7, 14). Parity runs at `highest` matmul precision by default:
# float32 matmuls are then true float32 on every platform, and the table above applies
# unchanged. `default` is each backend's out-of-the-box float32 matmul: its operands keep
# fewer mantissa bits (harness.platforms: TPU one bfloat16 pass, 7 stored bits; GPU TF32,
# 10 bits; CPU ignores the setting, 23 bits). Under it a float32 run is as accurate as a
# run whose matmul operands are rounded to that mantissa, so the float32 fwd/grad floors rise
# to half its unit roundoff, 2^-(bits + 2), the convention of the bfloat16 (2^-9, 7 bits)
# and float16 (2^-12, 10 bits) rows above; the torch reference (CPU) keeps true float32, so
# without the raised floor every float32 matmul result would fail. On CPU `default` equals
# `highest` (same numbers, same table). To be re-measured on the first TPU/GPU run.
# The `highest` table is never loosened to absorb `default`.
PROFILES = ("highest", "default")


def floor(dtype: str, quantity: str, profile: str = "highest", backend: str = "cpu",
          dims: dict | None = None) -> float:
    """The floor of SPEC section 10 for `quantity` at `dtype`, under the matmul precision
    `profile` on `backend`, for a problem of `dims` (None: no reduction-length floor)."""
    from .platforms import float32_operand_bits

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not supported (valid: {', '.join(PROFILES)})")
    kind = kind_of(quantity)
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
#   float32:  fwd 2.4e-6, loss 1.9e-7, grad 5.1e-7
#   bfloat16: fwd 1.1e-6, loss 1.8e-7, grad 3.1e-3 (0.4 ulp(bf16))
#   float16:  fwd 8.7e-5, loss 7.7e-7, grad 5.5e-4 (0.6 ulp(f16))
# Query chunks (issue #13, same bound) r = 16 and 21 on S = 64, same problems:
#   float32:  fwd 6.2e-7, loss 3.8e-7, grad 4.8e-7
#   bfloat16: fwd 0,      loss 4.4e-7, grad 4.4e-3 (0.57 ulp(bf16): each block's wq_b /
#             weights_proj gradient is rounded at its bfloat16 cast, tests/test_query_chunk.py)
#   float16:  fwd 0,      loss 3.8e-7, grad 6.4e-4 (0.65 ulp(f16))
# (float16 forward stays above bfloat16's: a one-ulp f16 flip of q, from a different
# float32 FMA contraction of the RoPE products in the narrower program, moves a score by
# 2^-11 relative; bfloat16 flips are 8x rarer at the same f32 noise.)
# Each bound is a round number a few times above its measurement and at least
# 30x below the same-dtype error against the oracle, so it stays tight.
CHUNK = {
    "float64": {"fwd": EXACT64, "loss": EXACT64, "grad": EXACT64},
    "float32": {"fwd": 1e-5, "loss": 2e-6, "grad": 4e-6},
    "bfloat16": {"fwd": 2e-4, "loss": 5e-6, "grad": 2.0**-7},
    "float16": {"fwd": 4e-4, "loss": 5e-6, "grad": 4.0 * 2.0**-10},
}


def chunk_bound(dtype: str, quantity: str) -> float:
    return CHUNK[dtype][kind_of(quantity)]

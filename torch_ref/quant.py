"""The quantization-aware indexer of the torch reference (SPEC §7a), the plain way.

torch's CPU casts have no e2m1, and its float8 e4m3 cast saturates where others give NaN, so no
cast is used at all: each format is a table of its non-negative values, built from the bit
layout (code -> value), and a value is rounded by looking at every entry of the table (the
nearest one; of two equally near, the even code). Nothing can saturate or turn into NaN: the
clip bounds every quotient by Qmax before the look-up, and the table holds finite values only.

1. rotation: x <- (x @ H) * DI**-0.5 in the wide dtype (H: Sylvester's Hadamard matrix), to dtype;
2. per block: amax = max(max |x|, tiny), a = amax * (1 / Qmax), s = the smallest power of two >= a;
3. c = the table value nearest to clip(x / s, -Qmax, Qmax), ties to the even code;
4. x_hat = c * s (wide), with the straight-through gradient (identity to the rotated x).
"""

from __future__ import annotations

import torch

# format -> (exponent bias, mantissa bits, number of finite non-negative codes, Qmax, amax floor)
FORMATS = {
    "e2m1": (1, 1, 8, 6.0, 6.0 * 2.0**-126),
    "e4m3": (7, 3, 127, 448.0, 1e-4),  # OCP e4m3fn: code 127 (0x7f) is NaN, so 0..126
}


def format_values(fmt: str, wide) -> torch.Tensor:
    """The non-negative values of the format, indexed by their code: [n] in the wide dtype."""
    bias, mbits, n, _, _ = FORMATS[fmt]
    values = []
    for code in range(n):
        field, mant = code >> mbits, code & ((1 << mbits) - 1)
        if field == 0:  # subnormal: mant * 2**(1 - bias - mbits)
            values.append(mant * 2.0 ** (1 - bias - mbits))
        else:
            values.append((1.0 + mant / 2.0**mbits) * 2.0 ** (field - bias))
    return torch.tensor(values, dtype=wide)


def hadamard(n: int, wide) -> torch.Tensor:
    """Sylvester's construction: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]."""
    h = torch.ones((1, 1), dtype=wide)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rotate(x: torch.Tensor, quant: dict, dtype, wide) -> torch.Tensor:
    """Step 1 (or x itself without `hadamard`): x [..., DI] in dtype -> rotated, in dtype."""
    if not quant["hadamard"]:
        return x
    di = x.shape[-1]
    return ((x.to(wide) @ hadamard(di, wide)) * di ** -0.5).to(dtype)


def power_of_two_at_least(a: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= a (a > 0): 2**ceil(log2 a), then corrected by one step
    either way where log2's rounding missed."""
    s = torch.pow(torch.tensor(2.0, dtype=a.dtype), torch.ceil(torch.log2(a)))
    s = torch.where(s < a, s * 2, s)
    return torch.where(s / 2 >= a, s / 2, s)


def quantize(rotated: torch.Tensor, quant: dict, wide):
    """Steps 2-4 from the rotated values [..., DI] -> (x_hat wide, code values wide [..., DI],
    codes int64 bit patterns [..., DI], scales wide [..., DI / block]). No gradient."""
    _, mbits, n, qmax, tiny = FORMATS[quant["format"]]
    block = quant["block"]
    x = rotated.detach().to(wide)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = torch.clamp(blocks.abs().amax(dim=-1), min=tiny)
    scales = power_of_two_at_least(amax * torch.tensor(1.0 / qmax, dtype=wide))
    v = torch.clamp(blocks / scales[..., None], -qmax, qmax)
    table = format_values(quant["format"], wide)
    dist = (v.abs()[..., None] - table).abs()  # [..., block, n]
    nearest = dist == dist.amin(dim=-1, keepdim=True)
    even = (torch.arange(n) % 2 == 0).to(torch.int64)
    code = torch.argmax(nearest.to(torch.int64) * (1 + even), dim=-1)  # of two ties, the even code
    mag = table[code]
    negative = (v < 0) & (mag > 0)  # zero is always the positive code
    values = torch.where(negative, -mag, mag)
    sign_bit = 1 << (mbits + (2 if quant["format"] == "e2m1" else 4))
    codes = torch.where(negative, code + sign_bit, code)
    x_hat = (values * scales[..., None]).reshape(x.shape)
    return x_hat, values.reshape(x.shape), codes.reshape(x.shape), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, quant: dict, wide) -> torch.Tensor:
    """Bit patterns [..., DI] and block scales [..., DI / block] -> code * scale, wide: the table
    entry of the code's magnitude bits, negated where its sign bit is set."""
    _, mbits, _, _, _ = FORMATS[quant["format"]]
    sign_bit = 1 << (mbits + (2 if quant["format"] == "e2m1" else 4))
    codes = torch.as_tensor(codes).to(torch.int64)
    mag = format_values(quant["format"], wide)[codes % sign_bit]
    values = torch.where(codes >= sign_bit, -mag, mag)
    return values * torch.repeat_interleave(torch.as_tensor(scales).to(wide), quant["block"], dim=-1)


def fake_quantize(x: torch.Tensor, quant: dict, dtype, wide, imposed=None) -> torch.Tensor:
    """x [..., DI] (dtype, after RoPE) -> x_hat (wide) with the straight-through gradient.
    `imposed` = (codes, scales) of x's shape: score those instead of x's own (another run's
    codes); the gradient still passes straight through x's own rotation."""
    rotated = rotate(x, quant, dtype, wide).to(wide)
    x_hat = quantize(rotated, quant, wide)[0] if imposed is None else dequantize(*imposed, quant, wide)
    return x_hat.detach() + (rotated - rotated.detach())

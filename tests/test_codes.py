"""harness.judging.codes: the formats' bit patterns, and the boundary-tie rule that judges quantized codes
and UE8M0 scales (SPEC sections 7a and 10). Pure numpy: a brute-force quantizer written here
(every format value tried, not harness.judging.codes' own rounding) builds the oracle's codes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harness.judging.codes import FORMATS, codes_check, decode, format_values, quantize_at, scales_check
from harness.outputs import EXCUSED, FAILED, PASSED

BOUND = 2e-3


def brute_quantize(x, fmt, block, scales=None):
    """SPEC section 7a steps 2-3 by exhaustion: (codes uint8 [..., DI], scales [..., DI/block])."""
    f = FORMATS[fmt]
    x = np.asarray(x, np.float64)
    if scales is None:
        amax = np.maximum(np.abs(x).reshape(*x.shape[:-1], -1, block).max(-1), f.tiny)
        a = amax * (1.0 / f.qmax)
        scales = 2.0 ** np.ceil(np.log2(a))
        scales = np.where(scales < a, scales * 2, scales)
        scales = np.where(scales / 2 >= a, scales / 2, scales)
    v = np.clip(x / np.repeat(scales, block, -1), -f.qmax, f.qmax)
    values = format_values(fmt)
    positive = np.arange(f.sign_bit)
    positive = positive[np.isfinite(values[positive])]
    dist = np.abs(np.abs(v)[..., None] - values[positive])
    best = dist.min(-1, keepdims=True)
    # of two equally near, the even code
    code = np.where((dist == best) & (positive % 2 == 0), positive, -1).max(-1)
    code = np.where(code < 0, np.where(dist == best, positive, -1).max(-1), code)
    code = np.where((v < 0) & (code > 0), code | f.sign_bit, code)
    return code.astype(np.uint8), scales.astype(np.float32)


def judge(fmt, block, x, at, cand_codes, cand_scales, bound=BOUND):
    o_codes, o_scales = brute_quantize(x, fmt, block)
    return (codes_check("oracle", "query_codes", cand_codes, cand_scales, o_codes, o_scales, x, at, fmt, block,
                        bound),
            scales_check("oracle", "query_scales", cand_scales, o_scales, x, at, fmt, block, bound))


def test_e2m1_decodes_every_pattern():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    values = format_values("e2m1")
    assert values.shape == (16,)
    np.testing.assert_array_equal(values[:8], expected)
    np.testing.assert_array_equal(values[8:], -np.array(expected))
    assert np.signbit(values[8])  # 0x8 is negative zero
    np.testing.assert_array_equal(decode(np.arange(16, dtype=np.uint8), "e2m1"), values)
    assert np.isnan(decode(np.array([16, -1]), "e2m1")).all()


def test_e4m3_decodes_the_known_patterns():
    values = format_values("e4m3")
    assert values.shape == (256,)
    known = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x38: 1.0, 0x3c: 1.5,
             0x7e: 448.0, 0x81: -(2.0**-9), 0xfe: -448.0}
    for code, value in known.items():
        assert decode(np.uint8(code), "e4m3") == value, hex(code)
    assert np.isnan(values[[0x7f, 0xff]]).all() and np.isfinite(np.delete(values, [0x7f, 0xff])).all()
    finite = values[:0x7f]
    assert np.all(np.diff(finite) > 0)  # monotone in the code: the layout, not a table


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_quantize_at_agrees_with_brute_force(fmt):
    rng = np.random.default_rng(0)
    f = FORMATS[fmt]
    s = np.float64(2.0**-3)
    grid = format_values(fmt)[: f.sign_bit]
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([rng.normal(size=4000) * f.qmax * s / 2, mids * s, -mids * s, grid * s, [0.0, 1e9, -1e9]])
    x = x[: len(x) // 32 * 32].reshape(-1, 32)
    want, _ = brute_quantize(x, fmt, 32, scales=np.full((x.shape[0], 1), s))
    np.testing.assert_array_equal(quantize_at(x, s, fmt), want)


def _row(fmt, block=32, seed=1):
    """One DI = 2 * block vector whose blocks' amax sit well inside their binades."""
    qmax = FORMATS[fmt].qmax
    x = np.random.default_rng(seed).uniform(-0.6, 0.6, size=(1, 2 * block)) * qmax
    x[0, :block] *= 2.0**-4
    x[0, block:] *= 2.0**-6
    x[0, 0], x[0, block] = 0.75 * qmax * 2.0**-4, -0.7 * qmax * 2.0**-6  # scales 2**-4 and 2**-6
    return x


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_identical_codes_pass(fmt):
    x = _row(fmt)
    at = x * (1 + 1e-7)  # not exact: rounded at the dtype
    codes, scales = brute_quantize(x, fmt, 32)
    c, s = judge(fmt, 32, x, at, codes, scales)
    assert (c.status, s.status) == (PASSED, PASSED), (c.message, s.message)
    assert c.total == x.size and s.total == 2 and c.mismatched == 0


def test_a_code_far_from_any_boundary_fails_with_its_index():
    x = _row("e2m1")
    codes, scales = brute_quantize(x, "e2m1", 32)
    j = 3
    bad = codes.copy()
    bad[0, j] ^= 0x8 if codes[0, j] else 0x2  # flip the sign (or 0 -> 1.0): no tie is that wide
    c, _ = judge("e2m1", 32, x, x * (1 + 1e-7), bad, scales)
    assert c.status == FAILED and c.where == (0, j) and c.mismatched == 1 and c.error == 1.0
    assert f"1 of {x.size} codes differ beyond a boundary tie" in c.message
    assert f"first at index (0, {j})" in c.message and "beyond the tolerance" in c.message


def _midpoint_row(rel):
    """A block of scale 1 (amax 6) whose element 5 sits at 0.25 * (1 + rel), the midpoint of 0 and 0.5."""
    x = np.zeros((1, 32))
    x[0, 0] = 6.0
    x[0, 1:] = np.linspace(-5, 5, 31) + 0.1
    x[0, 5] = 0.25 * (1 + rel)
    return x


def test_a_value_beside_a_midpoint_is_an_excused_tie():
    x = _midpoint_row(1e-9)  # rounds to 0.5 (code 1) in float64
    codes, scales = brute_quantize(x, "e2m1", 32)
    assert codes[0, 5] == 1 and scales[0, 0] == 1.0
    cand = codes.copy()
    cand[0, 5] = 0  # the other neighbour, as a low dtype may round
    c, _ = judge("e2m1", 32, x, x * (1 + 1e-6), cand, scales)
    assert c.status == EXCUSED and c.stats["excused"] == 1 and c.mismatched == 0 and c.passed
    assert "0 of 32 codes differ beyond a boundary tie, 1 boundary-tie differences excused" in c.message
    # the same swap 0.1 away from the midpoint is no tie
    x_far = _midpoint_row(0.4)
    codes_far, _ = brute_quantize(x_far, "e2m1", 32)
    cand = codes_far.copy()
    cand[0, 5] = 0
    c, _ = judge("e2m1", 32, x_far, x_far * (1 + 1e-6), cand, scales)
    assert c.status == FAILED and c.where == (0, 5)


def test_an_exact_planted_midpoint_must_round_to_even():
    x = _midpoint_row(0.0)
    x[0, 6] = 2.5  # midpoint of 2 (0x4) and 3 (0x5): even is 0x4
    codes, scales = brute_quantize(x, "e2m1", 32)
    assert codes[0, 5] == 0 and codes[0, 6] == 4
    c, _ = judge("e2m1", 32, x, x.copy(), codes, scales)
    assert c.status == PASSED
    half_away = codes.copy()
    half_away[0, 6] = 5
    c, _ = judge("e2m1", 32, x, x.copy(), half_away, scales)
    assert c.status == FAILED and c.where == (0, 6) and "exact at the dtype" in c.message
    assert "the tie rule gives 0x04" in c.message
    # the very same swap where the dtype rounded the value: a tie
    c, _ = judge("e2m1", 32, x, x * (1 + 1e-6), half_away, scales)
    assert c.status == EXCUSED and c.stats["excused"] == 1


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_a_scale_tie_one_step_down_is_excused_and_codes_follow_it(fmt):
    qmax = FORMATS[fmt].qmax
    x = _row(fmt)
    x[0, 0] = qmax * 2.0**-4 * (1 + 1e-9)  # a sits 1e-9 relative above 2**-4: the oracle's s is 2**-3
    at = x * (1 - 1e-6)
    codes, scales = brute_quantize(x, fmt, 32)
    assert scales[0, 0] == 2.0**-3
    cand_scales = scales.copy()
    cand_scales[0, 0] = 2.0**-4
    cand_codes, _ = brute_quantize(at, fmt, 32, scales=cand_scales.astype(np.float64))  # the candidate's own
    c, s = judge(fmt, 32, x, at, cand_codes, cand_scales)
    assert s.status == EXCUSED and s.stats["excused"] == 1 and s.mismatched == 0
    assert c.status == EXCUSED and c.mismatched == 0 and c.stats["excused"] >= 1, c.message
    assert "in blocks whose scale differs" in c.note
    # a code that fits neither scale fails although its scale is excused
    wrong = cand_codes.copy()
    wrong[0, 0] = codes[0, 0]  # the oracle's code (3.0 * 2**-3) read at the candidate's 2**-4
    c, _ = judge(fmt, 32, x, at, wrong, cand_scales)
    assert c.status == FAILED and c.where == (0, 0)
    # two steps down: a is a whole binade away
    two = scales.copy()
    two[0, 0] = 2.0**-5
    _, s = judge(fmt, 32, x, at, cand_codes, two)
    assert s.status == FAILED and s.where == (0, 0) and "beyond the tolerance" in s.message
    # codes follow their scale: at that wrong scale the clip sends the large values to +-Qmax,
    # which codes_check does not blame (the failure is the scale's, reported once)
    codes_two, _ = brute_quantize(at, fmt, 32, scales=two.astype(np.float64))
    assert np.sum(np.abs(format_values(fmt)[codes_two[0, :32]]) == qmax) > 1
    c, _ = judge(fmt, 32, x, at, codes_two, two)
    assert c.status == EXCUSED, c.message
    # the same one-step scale on an exact block: tolerance 0
    _, s = judge(fmt, 32, x, x.copy(), cand_codes, cand_scales)
    assert s.status == FAILED and "block exact at the dtype" in s.message
    # only the exact block fails: make the first block inexact, the second exact
    at_mixed = x.copy()
    at_mixed[0, 3] *= 1 + 1e-6
    _, s = judge(fmt, 32, x, at_mixed, cand_codes, cand_scales)
    assert s.status == EXCUSED


def test_an_exact_element_in_an_excused_scale_block_follows_the_tie_rule_at_that_scale():
    x = _row("e2m1")
    x[0, 0] = 6 * 2.0**-4 * (1 + 1e-9)
    x[0, 7] = 0.375 * 2.0**-4 * 4  # 1.5 at 2**-4: representable, so exact at the dtype
    at = x * (1 - 1e-6)
    at[0, 7] = x[0, 7]
    cand_scales = brute_quantize(x, "e2m1", 32)[1].copy()
    cand_scales[0, 0] = 2.0**-4
    cand_codes, _ = brute_quantize(at, "e2m1", 32, scales=cand_scales.astype(np.float64))
    c, _ = judge("e2m1", 32, x, at, cand_codes, cand_scales)
    assert c.status == EXCUSED, c.message
    cand_codes[0, 7] = 0x2  # 1.0 at 2**-4: within a loose tolerance, but the value is exact
    c, _ = judge("e2m1", 32, x, at, cand_codes, cand_scales, bound=0.1)
    assert c.status == FAILED and c.where == (0, 7) and "the tie rule gives 0x03" in c.message
    at[0, 7] *= 1 + 1e-6  # rounded at the dtype: the loose tolerance excuses it
    c, _ = judge("e2m1", 32, x, at, cand_codes, cand_scales, bound=0.1)
    assert c.status == EXCUSED


def test_invalid_scales_fail():
    x = _row("e2m1")
    codes, scales = brute_quantize(x, "e2m1", 32)
    for bad_value in (np.nan, 0.0, -scales[0, 0], 0.75 * scales[0, 0], np.inf):
        bad = scales.copy()
        bad[0, 0] = bad_value
        c, s = judge("e2m1", 32, x, x * (1 + 1e-6), codes, bad)
        assert s.status == FAILED and s.where == (0, 0), bad_value
        assert c.status == FAILED and c.mismatched == 32 and "not a positive power of two" in c.message


def test_an_underflowed_value_is_a_tie_only_where_the_row_tolerance_covers_it():
    tiny = 6 * 2.0**-126
    x = np.zeros((2, 64))
    x[:, 0] = tiny  # block 0: amax tiny, scale 2**-126, code 0x7 (6)
    x[0, 32] = 1.0  # row 0 has a large block: its tolerance dwarfs tiny
    at = x.copy()
    at[:, 0] = 0.0  # the dtype flushed it to zero
    codes, scales = brute_quantize(x, "e2m1", 32)
    assert scales[0, 0] == 2.0**-126 and codes[0, 0] == 0x7
    cand = codes.copy()
    cand[:, 0] = 0
    c, _ = judge("e2m1", 32, x, at, cand, scales)
    assert c.status == FAILED and c.mismatched == 1 and c.where == (1, 0) and c.stats["excused"] == 1


def test_invalid_code_patterns_fail():
    x = _row("e4m3")
    codes, scales = brute_quantize(x, "e4m3", 32)
    j = 0  # the block's largest value
    for pattern in (0x7f, 0xff):
        bad = codes.copy()
        bad[0, j] = pattern
        c, _ = judge("e4m3", 32, x, x * (1 + 1e-6), bad, scales)
        assert c.status == FAILED and c.where == (0, j) and "NaN or negative zero" in c.message
    zero = int(np.argmin(np.abs(x)))
    x[0, zero] = 1e-9  # rounds to code 0; negative zero is never a code
    codes, scales = brute_quantize(x, "e4m3", 32)
    bad = codes.copy()
    bad[0, zero] = 0x80
    c, _ = judge("e4m3", 32, x, x * (1 + 1e-6), bad, scales)
    assert c.status == FAILED and c.where == (0, zero)
    bad = bad.astype(np.int64)
    bad[0, zero] = 300  # no bit pattern of e4m3 at all
    c, _ = judge("e4m3", 32, x, x * (1 + 1e-6), bad, scales)
    assert c.status == FAILED and "no bit pattern" in c.message


def test_shapes_that_do_not_fit_are_a_pattern_failure():
    x = _row("e2m1")
    codes, scales = brute_quantize(x, "e2m1", 32)
    c = codes_check("oracle", "query_codes", codes[:, :32], scales, codes, scales, x, x, "e2m1", 32, BOUND)
    assert c.status == FAILED and c.template == "pattern" and "candidate codes [1, 32]" in c.message
    s = scales_check("oracle", "query_scales", scales[:, :1], scales, x, x, "e2m1", 32, BOUND)
    assert s.status == FAILED and "candidate scales [1, 1]" in s.message


def test_a_million_codes_judge_quickly():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 64, 8, 128))
    at = (x.astype(np.float32)).astype(np.float64)
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(x).max(-1, keepdims=True), 1e-4) / 448))
    o_codes, o_scales = quantize_at(x, s, "e4m3"), s.astype(np.float32)
    cand = quantize_at(at, s, "e4m3")
    start = time.perf_counter()
    c = codes_check("oracle", "query_codes", cand, o_scales, o_codes, o_scales, x, at, "e4m3", 128, 1e-6)
    elapsed = time.perf_counter() - start
    assert c.total == x.size and c.status in (PASSED, EXCUSED) and elapsed < 1.0, (elapsed, c.message)

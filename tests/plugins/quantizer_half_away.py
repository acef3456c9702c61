"""tests/plugins/quantizer_stage.py with a planted rounding bug: a value halfway between two
neighbouring codes goes to the larger magnitude (half away from zero) instead of the even code.
quant_planted puts queries on exactly those midpoints, so its codes differ in every dtype."""

from __future__ import annotations

from .quantizer_stage import quantize

STAGE = "quantizer"
ARRAYS = "numpy"


def quantizer(x, quant):
    return quantize(x, quant, half_away=True)

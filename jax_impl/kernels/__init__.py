"""Pallas kernels of the indexer (`scoring_backend="pallas"`): the head-summed ReLU scores
and their backward, and the teacher's block probabilities (its normaliser's max and sum, and
the head sum; jax_impl.kernels.scores). On a TPU they compile with Mosaic; on any other
platform they run in Pallas interpret mode (`interpret_mode`)."""

import jax

from .scores import (KEY_TILE, NARROW_ROW_TILE, ROW_TILE, LiveTiles, Plan, Tiles, clamp_tile, contribution,
                     default_tiles, live_tiles, live_tiles_by_rows, operand_dtype, teacher_block_max,
                     teacher_block_probs, teacher_block_sumexp, tile_is_live, vmem_budget)


def interpret_mode(platform: str | None = None) -> bool:
    """Whether the kernels run in Pallas interpret mode on `platform` (default: JAX's
    default backend): everywhere but TPU."""
    return (platform or jax.default_backend()) != "tpu"


__all__ = ["KEY_TILE", "NARROW_ROW_TILE", "ROW_TILE", "LiveTiles", "Plan", "Tiles", "clamp_tile", "contribution",
           "default_tiles", "interpret_mode", "live_tiles", "live_tiles_by_rows", "operand_dtype", "teacher_block_max",
           "teacher_block_probs", "teacher_block_sumexp", "tile_is_live", "vmem_budget"]

"""Both sides of a long point (SPEC section 11), a block of rows at a time: what harness.run.long
streams into the judge.

- the reference: `torch_ref.row_blocks` (the plain reference over blocks of JUDGE_ROWS rows) in
  float64 and at the point's dtype;
- the candidate: `jax_impl.api.indexer_forward_rows` (its own program on a block of query rows
  given every key: the point's query blocks counted from the block's first row, so the blocks
  it is asked for start at multiples of the point's r) and, whole, `indexer_loss_and_grads` on
  the query-blocked path (a scalar and parameter-shaped arrays: nothing of [B, S, W] leaves it).

Nothing here judges: it returns host numpy arrays under the canonical names of harness.outputs.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from ..outputs import FLOAT_INPUT_NAMES, PARAM_NAMES, Outputs
from ..points import Point
from .implementations import run_config

# The reference's rows per block: its float64 arrays of a block are [B, 512, visible blocks] (a few
# hundred MiB at W = 32768 with the autograd's saved tensors); a fixed count, unrelated to the
# candidate's query blocks.
JUDGE_ROWS = 512


def torch_config(problem: Mapping[str, Any], sparse: bool = False):
    import torch_ref

    return torch_ref.CSAConfig.from_dict({**problem, "sparse_loss": sparse})


def jax_config(problem: Mapping[str, Any], point: Point, sparse: bool = False):
    from jax_impl import api

    return api.CSAConfig.from_dict(run_config(problem, point, sparse))


def reference_forward(params, inputs, problem, dtype: str, rows) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """(rows, index_scores [B, r, W] float64, topk_indices [B, r, k_eff] int64) per slice of `rows`."""
    from torch_ref import row_blocks

    for r, scores, picks in row_blocks.forward_blocks(params, inputs, torch_config(problem), dtype, rows=rows):
        yield r, scores.numpy(), picks.numpy()


def reference_keys(params, inputs, problem, dtype: str) -> np.ndarray:
    from harness.judging.compare import to_numpy
    from torch_ref import row_blocks

    return to_numpy(row_blocks.keys(params, inputs, torch_config(problem), dtype))


def reference_losses(params, inputs, problem, dtype: str, selection: np.ndarray | None) -> dict[str, np.ndarray]:
    """The reference's loss and gradients: dense and sparse on its own top-k in float64 (the
    oracle: its own selection is the selection, so its sparse run is also `sparse_at_oracle`'s
    value), dense and sparse on `selection` (the oracle's picks) at a narrower dtype."""
    from torch_ref import row_blocks

    out = {}
    variants = (("dense", False, None),) + ((("sparse", True, None),) if dtype == "float64"
                                           else (("sparse_at_oracle", True, selection),))
    for variant, sparse, sel in variants:
        loss, grads = row_blocks.loss_and_grads(params, inputs, torch_config(problem, sparse), dtype, sel)
        out[f"loss.{variant}"] = loss.numpy()
        out.update({f"grad.{variant}.{n}": grads[n].numpy() for n in PARAM_NAMES})
    return out


def candidate_rows(params, inputs, problem, point: Point, start: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate's (index_scores [B, n, W], topk_indices [B, n, k_eff]) of rows start .. start+n-1."""
    from jax_impl import api

    scores, picks = api.indexer_forward_rows(params, inputs, jax_config(problem, point), point.dtype, start, rows)
    return np.asarray(scores, np.float32), np.asarray(picks)


def candidate_keys(params, inputs, problem, point: Point) -> np.ndarray:
    """The compressed keys [B, W, DI] (the key path alone: no [B, S, W] array)."""
    from jax_impl import api

    return np.asarray(api.indexer_keys(params, inputs, jax_config(problem, point), point.dtype), np.float32)


def candidate_losses(params, inputs, problem, point: Point, selection: np.ndarray) -> dict[str, np.ndarray]:
    """The candidate's loss, parameter and input gradients in dense, sparse (its own top-k) and
    sparse_at_oracle (the oracle's picks `selection`), on its query-blocked path."""
    from jax_impl import api

    out = {}
    for variant, sparse, sel in (("dense", False, None), ("sparse", True, None), ("sparse_at_oracle", True, selection)):
        loss, pg, ig = api.indexer_loss_and_grads(params, inputs, jax_config(problem, point, sparse), point.dtype,
                                                  selection=sel)
        out[f"loss.{variant}"] = np.asarray(loss, np.float64)
        out.update({f"grad.{variant}.{n}": np.asarray(pg[n], np.float64) for n in PARAM_NAMES})
        out.update({f"input_grad.{variant}.{n}": np.asarray(ig[n], np.float64) for n in FLOAT_INPUT_NAMES if n in ig})
    return out


def as_outputs(source: str, values: Mapping[str, np.ndarray]) -> Outputs:
    return Outputs(source, dict(values))

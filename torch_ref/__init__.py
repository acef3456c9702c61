"""PyTorch reference (the oracle) of the DeepSeek-V4 CSA lightning indexer and its KL loss.

See SPEC.md §5-8 for the math and docs/plugins.md for the protocol. Knows nothing of JAX.
"""

from .config import DTYPES, CSAConfig, resolve_dtype, validate_inputs, validate_params
from .reference import (forward_stages, indexer_forward, indexer_loss, indexer_loss_and_grads,
                        score_stage, yarn_bounds)

__all__ = [
    "CSAConfig",
    "DTYPES",
    "forward_stages",
    "indexer_forward",
    "indexer_loss",
    "indexer_loss_and_grads",
    "resolve_dtype",
    "score_stage",
    "validate_inputs",
    "validate_params",
    "yarn_bounds",
]

"""PyTorch reference (the oracle) of the DeepSeek-V4 CSA lightning indexer and its KL loss.

See SPEC.md §5-8 for the math and docs/API.md for the protocol. Knows nothing of JAX.
"""

from .config import DTYPES, CSAConfig, resolve_dtype, validate_inputs, validate_params
from .reference import indexer_forward, indexer_loss, indexer_loss_and_grads

__all__ = [
    "CSAConfig",
    "DTYPES",
    "indexer_forward",
    "indexer_loss",
    "indexer_loss_and_grads",
    "resolve_dtype",
    "validate_inputs",
    "validate_params",
]

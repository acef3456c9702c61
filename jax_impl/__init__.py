"""JAX (Flax NNX) implementation of the DeepSeek-V4 CSA lightning indexer and its KL loss.

Pure functions carry the math (pooling, rope, scoring, loss); `CSAIndexer` is a
thin nnx.Module holding the six parameters. The entry points are traceable (jit, grad,
vmap, shard_map; shapes and dtypes checked while tracing); values are checked on the host
by `validate_inputs` (or inside jit by `checkify_inputs`). No torch here.
"""

from .api import STAGES, forward_stages, indexer_forward, indexer_loss, indexer_loss_and_grads, indexer_parity_bundle, \
    parity_bundle_memory, score_stage
from .config import DTYPES, CSAConfig, resolve_dtype
from .validate import PARAM_NAMES, checkify_inputs, validate_inputs, validate_params



def __getattr__(name):
    # The NNX module loads Flax on first use only: the pure functions (the harness's workers and
    # subprocesses run nothing else) need none of it, and its import costs every process ~0.5 s.
    if name == "CSAIndexer":
        from .module import CSAIndexer

        return CSAIndexer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The teachers this implementation computes (the harness's plug-in protocol, docs/plugins.md):
# both, by cfg.teacher_normaliser.
TEACHERS = ("joint", "compressed")

__all__ = [
    "TEACHERS",
    "CSAConfig",
    "CSAIndexer",
    "DTYPES",
    "STAGES",
    "forward_stages",
    "PARAM_NAMES",
    "checkify_inputs",
    "indexer_forward",
    "indexer_loss",
    "indexer_loss_and_grads",
    "indexer_parity_bundle",
    "parity_bundle_memory",
    "resolve_dtype",
    "score_stage",
    "validate_inputs",
    "validate_params",
]

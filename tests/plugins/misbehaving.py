"""Scoring-kernel plug-ins (`STAGE = "scores"`) that misbehave the way kernels under development
do, on the `small` case only (q of shape [2, 64, 8, 32]); everywhere else they compute the
scores correctly, so the other points of a run pass. For tests/test_isolation.py."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import time
import types

import jax
import jax.numpy as jnp
import numpy as np


def _scores(q, keys, head_weights):
    logits = jnp.einsum("bshd,bwd->bshw", q, keys)
    return jnp.einsum("bsh,bshw->bsw", head_weights, jnp.maximum(logits, 0.0)) * q.shape[-1] ** -0.5


def _on_small(q) -> bool:
    return tuple(np.shape(q)[:2]) == (2, 64)


def _abort():
    os.abort()  # SIGABRT, as a failed check inside a runtime does


def _segfault():
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def _hard_exit():
    os._exit(3)  # a runtime that calls exit() itself


def _oom_kill():
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer sends


def _exceed_memory():
    # The worker's address space capped at what it uses plus 256 MiB, then a 16 GiB buffer:
    # the allocation fails (MemoryError) without touching the machine's memory.
    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + 2**28, resource.getrlimit(resource.RLIMIT_AS)[1]))
    np.ones(2**31)


def _grow():
    # Memory the worker really touches, 64 MiB at a time, until something ends it: the parent's
    # --max-memory limit (a kill), else a cap of 4 GiB more than it held (a MemoryError).
    held, start = [], time.monotonic()
    while len(held) < 64:
        held.append(np.ones(2**23))
        time.sleep(0.01)
    raise MemoryError(f"grew 4 GiB in {time.monotonic() - start:.1f} s and nothing stopped it")


def grow_task(entries, reference, profile):
    """A point task of harness.sides.worker.run_points: at a point whose entries are ["grow"] it
    grows (`_grow`), at any other it returns its entries as its records."""
    if entries == ["grow"]:
        _grow()
    return list(entries)


def grow_call():
    """A call for harness.sides.worker.call_in_worker: grows (`_grow`) until something ends it."""
    _grow()


def _hang():
    marker = os.environ.get("CSA_TEST_HANG_MARKER")
    if marker:  # tells the test that the run has reached this point
        open(marker, "w").close()
    time.sleep(3600)


def _misbehaving(action):
    def scores(q, keys, head_weights):
        if _on_small(q):
            action()
        return _scores(q, keys, head_weights)

    return lambda: types.SimpleNamespace(STAGE="scores", scores=scores)


abort = _misbehaving(_abort)
segfault = _misbehaving(_segfault)
hard_exit = _misbehaving(_hard_exit)
oom_kill = _misbehaving(_oom_kill)
exceed_memory = _misbehaving(_exceed_memory)
hang = _misbehaving(_hang)
grow = _misbehaving(_grow)


def _ragged_scores(q, keys, head_weights):
    if _on_small(q):
        return [[0.0, 1.0], [2.0]]  # a list of rows of different lengths, not [B, S, W]
    return _scores(q, keys, head_weights)


def ragged():
    return types.SimpleNamespace(STAGE="scores", scores=_ragged_scores)


@jax.custom_vjp
def _scores_backward_raises_in_float64(q, keys, head_weights):
    return _scores(q, keys, head_weights)


def _fwd(q, keys, head_weights):
    return _scores(q, keys, head_weights), (q, keys, head_weights)


def _bwd(res, ct):
    if res[0].dtype == jnp.float64:  # as a Pallas kernel without a float64 backward does
        raise NotImplementedError("no float64 backward in this kernel")
    return jax.vjp(_scores, *res)[1](ct)


_scores_backward_raises_in_float64.defvjp(_fwd, _bwd)


def backward_raises():
    """Correct scores everywhere; the backward raises at float64 (the MaxText-like kernel)."""
    return types.SimpleNamespace(STAGE="scores", scores=_scores_backward_raises_in_float64)

"""Adversarial top-k inputs for the tie-aware comparison, after vLLM's top-k tests:
fixed high bits, random low bits, so that a low-precision implementation and the float64
oracle may order a boundary group differently while both are right.

Two generators:

- `boundary_tie_scores`: score rows built on purpose, in float64, judged by
  `harness.judging.compare.topk_sets` at the tie tolerance the harness applies at a dtype
  (`score_tolerance`: alpha * floor(dtype) * the row's largest |score|, its smallest value:
  torch at the dtype can only raise it). Each row has clear winners, a boundary group whose
  scores agree to within half the tolerance (the same high bits at the dtype, different low
  bits), a "near miss" just beyond the tolerance, losers, blocks that are invalid (-inf), and
  some rows are ReLU-zero (every valid score exactly 0: the whole row is one tie). The
  candidate's picks are what an implementation at the dtype computes: the oracle scores
  rounded to the dtype after a perturbation within the dtype's error, top-k with a random
  tie-break. `plant_off_by_one` then moves one pick by one rank beside a tie (to the near
  miss, or a clear winner out for a tied block): that must fail.
- `near_tie_problem`: whole inputs for both implementations (twin blocks whose hidden
  states differ in the last bits of the input, ReLU-zero query rows, equal head weights).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from ..judging import tolerance
from .cases import ISOLATE_GATE, Case, full_config, make_inputs

_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def score_tolerance(dtype: str) -> float:
    """The smallest tie tolerance the harness applies at `dtype`, relative to the row's largest
    |score| (harness.judging.judge.score_tolerance with torch's own error below the floor)."""
    return tolerance.ALPHA["forward"] * tolerance.floor(dtype, "index_scores")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x).astype(_NP_DTYPES[dtype]).astype(np.float64)


def topk_picks(scores: np.ndarray, k: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """SPEC section 7's top-k on float64 scores [..., W]: k_eff = min(k, W) indices, -1 where the
    pick is -inf. Ties broken at random when `rng` is given (an implementation may break them
    any way), else by index."""
    w = scores.shape[-1]
    k_eff = min(k, w)
    if rng is None:
        order = np.argsort(-scores, axis=-1, kind="stable")
    else:
        order = np.lexsort((rng.random(scores.shape), -scores), axis=-1)
    idx = order[..., :k_eff]
    picked = np.take_along_axis(scores, idx, axis=-1)
    return np.where(np.isfinite(picked), idx, -1).astype(np.int64)


@dataclasses.dataclass
class NearTies:
    dtype: str
    k: int
    oracle_scores: np.ndarray  # [B, S, W] float64, -inf invalid
    oracle_picks: np.ndarray  # [B, S, k]
    candidate_picks: np.ndarray  # [B, S, k]
    tol: np.ndarray  # [B, S] absolute tie tolerance
    relu_zero_rows: int
    # per row: (the boundary group's block indices, the near miss, the clear winners)
    groups: dict


def boundary_tie_scores(dtype: str, seed: int, batch: int = 2, queries: int = 16, blocks: int = 12,
                        k: int = 4) -> NearTies:
    rng = np.random.default_rng(seed)
    rel = score_tolerance(dtype)
    scores = np.full((batch, queries, blocks), -np.inf)
    groups = {}
    relu_zero = 0
    for b in range(batch):
        for s in range(queries):
            n_valid = int(rng.integers(k, blocks + 1)) if s % 5 else int(rng.integers(1, k + 1))
            valid = np.sort(rng.choice(blocks, n_valid, replace=False))
            if s % 7 == 3:  # ReLU-zero row: every head's logit <= 0, every valid score exactly 0
                scores[b, s, valid] = 0.0
                relu_zero += 1
                continue
            order = rng.permutation(valid)
            top = float(rng.uniform(0.5, 4.0))  # the row's largest score: a clear winner
            tol = rel * top
            # At least one clear winner (it sets the row's tolerance), then a boundary group
            # across rank k, the near miss, the losers. The k-th score sits at 0.2-0.35 of the
            # top, so rounding it to the dtype moves it by at most 0.35 tolerances.
            n_win = max(0, min(int(rng.integers(1, k)), len(order) - 2))
            n_group = min(len(order) - n_win, int(rng.integers(2, 5)))
            kth = top * float(rng.uniform(0.2, 0.35))
            row = np.empty(len(order))
            row[:n_win] = top * np.sort(rng.uniform(0.7, 1.0, n_win))[::-1]
            if n_win:
                row[0] = top
            # The boundary group: the same value up to +-tol/4 (high bits equal at the dtype).
            row[n_win:n_win + n_group] = kth + rng.uniform(-0.25, 0.25, n_group) * tol
            rest = len(order) - n_win - n_group
            if rest:
                # the near miss: 1.6 tolerances below the group's centre, then the losers
                row[n_win + n_group] = kth - 1.6 * tol
                row[n_win + n_group + 1:] = kth * rng.uniform(0.0, 0.8, rest - 1)
            scores[b, s, order] = row
            groups[(b, s)] = (order[n_win:n_win + n_group].tolist(),
                              int(order[n_win + n_group]) if rest else None,
                              order[:n_win].tolist())
    finite = np.where(np.isfinite(scores), np.abs(scores), 0.0)
    tol = rel * finite.max(axis=-1)
    # The candidate: computed at the dtype (an error within a quarter of the tolerance, then
    # rounded to the dtype), top-k with an arbitrary tie-break.
    noise = rng.uniform(-0.25, 0.25, scores.shape) * tol[..., None]
    cand_scores = np.where(np.isfinite(scores), round_to(scores + noise, dtype), -np.inf)
    return NearTies(dtype, k, scores, topk_picks(scores, k), topk_picks(cand_scores, k, rng), tol,
                    relu_zero, groups)


def plant_off_by_one(nt: NearTies, kind: str) -> tuple[np.ndarray, tuple[int, int]]:
    """The candidate's picks with one pick moved by one rank beside a boundary tie, in the first
    row where that is possible. kind: `near_miss` (the last tied pick replaced by the block
    ranked just below the group, 1.6 tolerances away) or `winner_out` (a clear winner dropped
    for an unpicked tied block)."""
    picks = nt.candidate_picks.copy()
    for (b, s), (group, miss, winners) in nt.groups.items():
        row = list(picks[b, s])
        picked_group = [g for g in group if g in row]
        if kind == "near_miss" and miss is not None and picked_group and miss not in row:
            row[row.index(picked_group[-1])] = miss
        elif kind == "winner_out" and winners and any(g not in row for g in group):
            outsider = next(g for g in group if g not in row)
            row[row.index(winners[-1])] = outsider
        else:
            continue
        picks[b, s] = row
        return picks, (b, s)
    raise ValueError(f"no row admits a planted {kind!r} pick")


def true_ties_only(picks: np.ndarray, oracle_picks: np.ndarray, oracle_scores: np.ndarray,
                   tol: np.ndarray) -> bool:
    """Independent of topk_sets: every block by which `picks` and the oracle's sets differ lies
    within the tolerance of the oracle's k-th score (brute force, row by row)."""
    for idx in np.ndindex(picks.shape[:-1]):
        a = {int(i) for i in picks[idx] if i >= 0}
        o = {int(i) for i in oracle_picks[idx] if i >= 0}
        if a == o:
            continue
        if len(a) != len(o):
            return False
        kth = min(oracle_scores[idx][i] for i in o)
        if any(abs(oracle_scores[idx][i] - kth) > tol[idx] for i in a ^ o):
            return False
    return True


# ----------------------------------------------------------------------------- whole problems


NEAR_TIE_CONFIG = full_config(emb_dim=16, q_lora_rank=16, index_n_heads=4, index_head_dim=8, rope_head_dim=0,
                              compress_ratio=2, index_topk=3, num_query_heads=2, head_dim=8)


def near_tie_problem(seed: int, batch: int = 2, seq_len: int = 32, ulps: int = 2):
    """(params, inputs, config) with boundary ties for both implementations:

    - twin blocks: every odd block copies the hidden states of the block before it, then one
      token moves by `ulps` float32 ulps (the same high bits, different last bits); the a-slot
      gate is silenced (ISOLATE_GATE) and DR = 0, so a key depends only on its own tokens
      and twin keys, hence scores, agree to a few float32 roundings;
    - equal head weights: every column of weights_proj equals the first (every head weighs
      the same), so the per-head terms cannot break a tie;
    - ReLU-zero rows: every 5th query's latent is 0, so every head's logit is 0 and its whole
      row of scores is exactly 0 (every valid block tied).
    """
    case = Case("near_ties", NEAR_TIE_CONFIG, batch, seq_len, seed, "near ties")
    inputs, params = make_inputs(case)
    m = NEAR_TIE_CONFIG["compress_ratio"]
    rng = np.random.default_rng(seed + 1)
    hidden = inputs["hidden_states"]
    for b in range(batch):
        for w in range(1, seq_len // m, 2):
            hidden[b, w * m:(w + 1) * m] = hidden[b, (w - 1) * m:w * m]
            t, e = w * m + int(rng.integers(m)), int(rng.integers(hidden.shape[-1]))
            hidden[b, t, e] = np.nextafter(hidden[b, t, e], np.float32(np.inf) * rng.choice([-1, 1]))
            for _ in range(ulps - 1):
                hidden[b, t, e] = np.nextafter(hidden[b, t, e], np.float32(np.inf))
    params["indexer.ape"][:, :NEAR_TIE_CONFIG["index_head_dim"]] += np.float32(ISOLATE_GATE)
    params["indexer.weights_proj"][:] = params["indexer.weights_proj"][:, :1]
    inputs["q_latent"][:, ::5] = 0.0
    return params, inputs, dict(NEAR_TIE_CONFIG)


def plant_beside_tie(picks: np.ndarray, oracle_picks: np.ndarray, oracle_scores: np.ndarray,
                     tol: np.ndarray) -> tuple[np.ndarray, tuple]:
    """`picks` with one pick moved by one rank, beside a tie: in the first row where `picks`
    differs from the oracle's sets by a boundary tie, the lowest-scoring pick is replaced by
    the best unpicked valid block that is NOT tied with the oracle's k-th score (the next
    rank below the tie). Every other row is left as it is."""
    out = picks.copy()
    for idx in np.ndindex(picks.shape[:-1]):
        a = [int(i) for i in picks[idx] if i >= 0]
        o = {int(i) for i in oracle_picks[idx] if i >= 0}
        if set(a) == o or not o:
            continue
        row = oracle_scores[idx]
        kth = min(row[i] for i in o)
        below = [j for j in np.argsort(-row, kind="stable")
                 if np.isfinite(row[j]) and j not in a and kth - row[j] > tol[idx]]
        if not below:
            continue
        lowest = min(a, key=lambda i: row[i])
        new = list(picks[idx])
        new[new.index(lowest)] = int(below[0])
        out[idx] = new
        return out, idx
    raise ValueError("no row differs from the oracle by a tie with a non-tied block below it")

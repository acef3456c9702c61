"""What a row's picks must satisfy whatever their scores (SPEC section 11, sampled rows): checked
on every row of a long point, including the rows the oracle does not judge.

A row's `k_eff` picks (SPEC section 7) hold, besides `-1`, only blocks `j` in `[0, W)` that are
visible to the row: all of the block in the row's past (`position_ids[j*m] + m <= position_ids[s]
+ 1`) and all `m` of its tokens in the row's document. No block appears twice. The number of
picks other than `-1` is `min(k_eff, visible blocks of the row)`: a `-1` where a visible block was
left out, or a visible block short of `k_eff` picks, is a wrong selection no tie can excuse.

This reads the problem's position and segment ids only (the inputs both sides were given), never
either side's scores; `PicksStream` is a reduction over blocks of rows like the judge's other
streams (harness.judging.compare): two blocks' results merge by sum and first index.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..outputs import FAILED, PASSED
from .compare import CheckResult, to_numpy


@dataclasses.dataclass(frozen=True)
class BlockFacts:
    """What visibility needs of the W blocks of a [B, S] layout: each block's first position, whether
    its m tokens share one document, and that document ([B, W] each); and per row its count of
    visible blocks ([B, S])."""

    m: int
    first: np.ndarray
    uniform: np.ndarray
    doc: np.ndarray
    visible: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.first.shape[1]


def block_facts(position_ids, segment_ids, m: int) -> BlockFacts:
    """The facts of the layout (position_ids, segment_ids [B, S] int). The visible count of a row of
    document d is the number of blocks of d (all m tokens in d) whose first position is at most
    its position + 1 - m: a sorted search per document, O(S log W), never [S, W]."""
    pos, seg = to_numpy(position_ids).astype(np.int64), to_numpy(segment_ids).astype(np.int64)
    B, S = pos.shape
    W = S // m
    blocks_pos = pos[:, : W * m].reshape(B, W, m)
    blocks_seg = seg[:, : W * m].reshape(B, W, m)
    first, doc = blocks_pos[..., 0], blocks_seg[..., 0]
    uniform = np.all(blocks_seg == doc[..., None], axis=-1)
    visible = np.zeros((B, S), np.int64)
    for b in range(B):
        for d in np.unique(seg[b]):
            starts = np.sort(first[b][uniform[b] & (doc[b] == d)])
            rows = seg[b] == d
            visible[b, rows] = np.searchsorted(starts, pos[b, rows] + 1 - m, side="right")
    return BlockFacts(m, first, uniform, doc, visible)


class PicksStream:
    """The invariants of the picks of every row, block of rows by block of rows."""

    def __init__(self, facts: BlockFacts, k_eff: int):
        self.facts, self.k_eff = facts, k_eff
        self.rows = 0
        self.bad = 0
        self.first: tuple | None = None
        self.first_note = ""

    def add(self, picks, position_ids, segment_ids, offset: tuple = ()) -> "PicksStream":
        """The picks [B, n, k] of the rows whose position and segment ids are [B, n], the first of
        them at `offset` (b, s) of the whole [B, S]."""
        f = self.facts
        p = to_numpy(picks).astype(np.int64)
        pos, seg = to_numpy(position_ids).astype(np.int64), to_numpy(segment_ids).astype(np.int64)
        B, n = pos.shape
        b0, s0 = (tuple(offset) + (0, 0))[:2]
        self.rows += B * n
        if p.shape != (B, n, self.k_eff):
            self._fail((b0, s0), B * n, f"picks of shape {list(p.shape)}, not {[B, n, self.k_eff]}")
            return self
        W = f.num_blocks
        in_range = (p >= -1) & (p < W)
        live = p >= 0
        j = np.where(live & in_range, p, 0)
        bidx = np.arange(B)[:, None, None] + b0
        first, uniform, doc = f.first[bidx, j], f.uniform[bidx, j], f.doc[bidx, j]
        visible = (first + f.m <= pos[..., None] + 1) & uniform & (doc == seg[..., None])
        hidden = live & in_range & ~visible
        ordered = np.sort(np.where(live, p, -1), axis=-1)
        repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        count = live.sum(-1)
        want = np.minimum(self.k_eff, f.visible[b0:b0 + B, s0:s0 + n])
        bad = ~in_range.all(-1) | hidden.any(-1) | repeated.any(-1) | (count != want)
        nbad = int(bad.sum())
        if nbad:
            b, s = (int(i) for i in np.argwhere(bad)[0])
            row = p[b, s]
            if not in_range[b, s].all():
                note = f"pick {int(row[~in_range[b, s]][0])} is outside [-1, W={W})"
            elif hidden[b, s].any():
                jj = int(row[hidden[b, s]][0])
                note = (f"pick {jj} is not visible to the row (block {jj}: first position {int(f.first[b + b0, jj])}, "
                        f"document {int(f.doc[b + b0, jj])}, whole {bool(f.uniform[b + b0, jj])}; row: position "
                        f"{int(pos[b, s])}, document {int(seg[b, s])}; m = {f.m})")
            elif repeated[b, s].any():
                note = f"block {int(ordered[b, s][1:][repeated[b, s]][0])} is picked twice"
            else:
                note = (f"{int(count[b, s])} picks other than -1, where the row sees {int(f.visible[b + b0, s + s0])} "
                        f"blocks and k_eff = {self.k_eff} (want {int(want[b, s])})")
            self._fail((b + b0, s + s0), nbad, note)
        return self

    def _fail(self, where: tuple, count: int, note: str) -> None:
        self.bad += count
        if self.first is None or where < self.first:
            self.first, self.first_note = where, note

    def merge(self, other: "PicksStream") -> "PicksStream":
        self.rows += other.rows
        if other.bad:
            self._fail(other.first, other.bad, other.first_note)
        return self

    def result(self, quantity: str = "topk_indices", check: str = "invariants") -> CheckResult:
        if not self.bad:
            note = (f"all {self.rows} rows: picks in range, visible (causal, whole, in the row's document), "
                    f"distinct, and min(k_eff, visible blocks) of them")
            return CheckResult(check, quantity, PASSED, 0.0, 0.0, None, 0, self.rows, note, template="invariants")
        return CheckResult(check, quantity, FAILED, float(self.bad), 0.0, self.first, self.bad, self.rows,
                           self.first_note, template="invariants")

"""The case catalogue: one entry per fixture, as data (a new case is a new entry, not new code).

Each `Case` names what it exercises, holds the problem's config dict (every
`CSAConfig` field but the run-time knobs, defaults written out: the chunk sizes,
the query chunk and `sparse_loss` are set per matrix point, never stored with a
case or in its fixture, so a new knob rewrites no fixture), the batch and sequence
sizes, the seed, and the layout knobs `make_inputs` reads:

- `documents`: per row, the lengths of the packed documents (positions restart
  at 0 and the segment id changes at each start). `None`: one document per row.
- `tied_blocks`: per row, one label per compressed block; blocks that share a
  label get bit-identical hidden states and teacher keys, and the a-slot gate
  is pushed to -1e4 (its softmax weight is then exactly 0 in every dtype) so
  that each block's key depends on its own tokens only. With `rope_head_dim=0`
  the compressed keys of twin blocks are then bit-identical, their scores tie
  exactly, and the tie sits on the top-k boundary (see the `ties` entry).
- `planted_quant`: the queries are planted on the quantizer's decision boundaries (SPEC
  section 7a; `plant_quant_queries`): each token's query latent is one-hot, so its queries
  are one row of `wq_b`, exact in every dtype, and those rows hold exact rounding midpoints,
  block maxima at powers of two times Qmax, an all-zero block and a block at the amax floor.
  Needs an unrotated e2m1 config with `rope_head_dim=0` and blocks of 8.

`make_inputs(case)` is pure numpy, deterministic from
`np.random.default_rng(case.seed)`: the same case gives the same bytes on every
run and platform (numpy's PCG64 + standard_normal are platform-independent).
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..outputs import INPUT_NAMES, PARAM_NAMES  # noqa: F401  (re-exported: the catalogue's names)

# Every CSAConfig field in declaration order, with its default (REQUIRED: every case gives
# it), except the run-time knob `query_chunk`, which a plug-in that predates it need not
# know: the harness passes it per matrix point only when non-zero.
REQUIRED = object()
CONFIG_FIELDS: tuple[tuple[str, Any], ...] = (
    ("emb_dim", REQUIRED),
    ("q_lora_rank", REQUIRED),
    ("index_n_heads", REQUIRED),
    ("index_head_dim", REQUIRED),
    ("rope_head_dim", REQUIRED),
    ("compress_ratio", REQUIRED),
    ("index_topk", REQUIRED),
    ("num_query_heads", REQUIRED),
    ("head_dim", REQUIRED),
    ("rope_theta", 160000.0),
    ("norm_eps", 1e-6),
    ("indexer_head_chunk", 0),
    ("loss_head_chunk", 0),
    ("sparse_loss", False),
    ("loss_scale", 1.0),
    ("sliding_window", 0),
    ("teacher_normaliser", "joint"),
    ("rope_scaling", None),
    ("index_quant", None),
)

# Run-time knobs, with their defaults: set per matrix point (harness.sides.implementations.run_config),
# never part of a case or its fixture (they change how a result is computed, not what it is).
KNOB_DEFAULTS: dict[str, Any] = {"indexer_head_chunk": 0, "loss_head_chunk": 0, "query_chunk": 0,
                                 "sparse_loss": False, "teacher_normaliser": "joint"}
# The teachers a fixture can hold goldens for (SPEC section 8), each on every case
# (`Case.teachers`): `joint` (DeepSeek-V4's attention) and `compressed` (MaxText's).
TEACHERS = ("joint", "compressed")
# DeepSeek-V4's compressed layers (and so its indexer): YaRN from 65,536 positions, factor 16.
V4_YARN = {"type": "yarn", "factor": 16, "original_max_position": 65536, "beta_fast": 32, "beta_slow": 1}
KNOB_FIELDS = tuple(KNOB_DEFAULTS)
# The fields that define a problem: what a case and its fixture hold.
PROBLEM_FIELDS: tuple[tuple[str, Any], ...] = tuple((n, d) for n, d in CONFIG_FIELDS if n not in KNOB_DEFAULTS)

# DeepSeek-V4's indexer quantization (SPEC section 7a) and DeepSeek-V3.2's.
V4_QUANT = {"format": "e2m1", "block": 32, "hadamard": True}
V32_QUANT = {"format": "e4m3", "block": 128, "hadamard": True}
# `planted_quant`: blocks of 8 channels, four kinds (plant_quant_queries).
PLANT_BLOCK = 8

# The a-slot gate offset of `tied_blocks` cases: exp(-1e4 + O(10)) is exactly 0
# in float64 (underflow below about -745), so the a-slots carry weight 0.
ISOLATE_GATE = -1.0e4


def full_config(**fields: Any) -> dict[str, Any]:
    """A problem config dict: every field but the run-time knobs, in declaration order,
    defaults filled in. A knob at its default is dropped; any other value is refused."""
    unknown = set(fields) - {n for n, _ in CONFIG_FIELDS} - set(KNOB_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown config field(s) {sorted(unknown)}")
    for knob, default in KNOB_DEFAULTS.items():
        if knob in fields and fields[knob] != default:
            raise ValueError(f"{knob}={fields[knob]!r} is a run-time knob, set per matrix point "
                             "(harness.problems.matrix), not part of a case")
    out = {}
    for name, default in PROBLEM_FIELDS:
        if name in fields:
            out[name] = fields[name]
        elif default is REQUIRED:
            raise ValueError(f"missing config field {name!r}")
        else:
            out[name] = default
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: Mapping[str, Any]
    batch: int
    seq_len: int
    seed: int
    exercises: str
    documents: tuple[tuple[int, ...], ...] | None = None
    tied_blocks: tuple[tuple[str, ...], ...] | None = None
    # The joint teacher's inputs: the sink logits are normal(mean, std) per head, or -inf for
    # every head (None: no sink); the window keys are unit-normal times `window_scale`.
    sink: tuple[float, float] | None = (0.0, 1.0)
    window_scale: float = 1.0
    # Positions start here (in every document): a tail of a long document.
    position_offset: int = 0
    # The teachers whose goldens the fixture holds (TEACHERS; joint always): both on every case,
    # since each teacher applies to every problem; a teacher that did not would be left out here.
    teachers: tuple[str, ...] = TEACHERS
    planted_quant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(full_config(**dict(self.config))))
        m = self.config["compress_ratio"]
        if "joint" not in self.teachers or not set(self.teachers) <= set(TEACHERS):
            raise ValueError(f"case {self.name!r}: teachers={self.teachers!r} must hold 'joint' and only "
                             f"{', '.join(TEACHERS)}")
        if self.documents is not None:
            if len(self.documents) != self.batch or any(
                sum(row) != self.seq_len or min(row) < 1 for row in self.documents
            ):
                raise ValueError(f"case {self.name!r}: documents must give {self.batch} rows "
                                 f"of positive lengths summing to seq_len={self.seq_len}")
        if self.tied_blocks is not None:
            if len(self.tied_blocks) != self.batch or any(
                len(row) != self.num_blocks for row in self.tied_blocks
            ):
                raise ValueError(f"case {self.name!r}: tied_blocks must give {self.batch} rows "
                                 f"of W={self.num_blocks} labels")
            if self.config["rope_head_dim"] != 0 or self.seq_len % m:
                raise ValueError(f"case {self.name!r}: tied_blocks needs rope_head_dim=0 "
                                 f"and seq_len a multiple of compress_ratio")

        if self.planted_quant:
            q = self.config["index_quant"]
            if (q is None or q["format"] != "e2m1" or q["block"] != PLANT_BLOCK or q["hadamard"]
                    or self.config["rope_head_dim"] != 0 or self.config["index_head_dim"] % (4 * PLANT_BLOCK)):
                raise ValueError(f"case {self.name!r}: planted_quant needs index_quant e2m1 with block "
                                 f"{PLANT_BLOCK} and no rotation, rope_head_dim=0 and index_head_dim a "
                                 f"multiple of {4 * PLANT_BLOCK}")

    def __hash__(self) -> int:
        return hash((self.name, self.config_json()))

    def config_dict(self) -> dict[str, Any]:
        """A fresh plain dict (what `CSAConfig.from_dict` takes on either side)."""
        return dict(self.config)

    def config_json(self) -> str:
        """The config as JSON, fields in declaration order (the form stored in the fixture)."""
        return json.dumps(dict(self.config))

    @property
    def num_blocks(self) -> int:
        """W = S // m."""
        return self.seq_len // self.config["compress_ratio"]

    @property
    def k_eff(self) -> int:
        return min(self.config["index_topk"], self.num_blocks)

    def input_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, numpy dtype name) of every input (SPEC §4)."""
        c, B, S = self.config, self.batch, self.seq_len
        return {
            "hidden_states": ((B, S, c["emb_dim"]), "float32"),
            "q_latent": ((B, S, c["q_lora_rank"]), "float32"),
            "position_ids": ((B, S), "int32"),
            "segment_ids": ((B, S), "int32"),
            "teacher_query": ((B, S, c["num_query_heads"], c["head_dim"]), "float32"),
            "teacher_kv": ((B, self.num_blocks, c["head_dim"]), "float32"),
            "teacher_window_kv": ((B, S, c["head_dim"]), "float32"),
            "attention_sink": ((c["num_query_heads"],), "float32"),
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """canonical name -> shape of every parameter (SPEC §3; all float32, [in, out])."""
        c = self.config
        E, R, HI, DI, m = (c["emb_dim"], c["q_lora_rank"], c["index_n_heads"],
                           c["index_head_dim"], c["compress_ratio"])
        return {
            "indexer.wkv": (E, 2 * DI),
            "indexer.wgate": (E, 2 * DI),
            "indexer.ape": (m, 2 * DI),
            "indexer.kv_norm": (DI,),
            "indexer.wq_b": (R, HI * DI),
            "indexer.weights_proj": (E, HI),
        }


def _foundation(**over: Any) -> dict[str, Any]:
    """The foundation config, the first and smallest realistic shape (E=64, R=32, HI=8, DI=32, DR=16, m=4, k=4, H=8, D=32)."""
    base = dict(emb_dim=64, q_lora_rank=32, index_n_heads=8, index_head_dim=32, rope_head_dim=16,
                compress_ratio=4, index_topk=4, num_query_heads=8, head_dim=32)
    base.update(over)
    return full_config(**base)


def _teacher(**over: Any) -> dict[str, Any]:
    """The joint teacher's cases: tiny's indexer, 4 teacher heads of dim 16 (heads that
    differ in how much mass their window and sink take), k = 3 of W = 8 blocks."""
    base = dict(emb_dim=16, q_lora_rank=16, index_n_heads=2, index_head_dim=8, rope_head_dim=4,
                compress_ratio=4, index_topk=3, num_query_heads=4, head_dim=16)
    base.update(over)
    return full_config(**base)


_CATALOGUE = (
    Case("tiny", full_config(emb_dim=16, q_lora_rank=16, index_n_heads=2, index_head_dim=8,
                             rope_head_dim=4, compress_ratio=4, index_topk=2,
                             num_query_heads=2, head_dim=8, sliding_window=4),
         batch=1, seq_len=16, seed=1001,
         exercises="the smallest problem with blocks and a top-k boundary: W=4 blocks, k=2, "
                   "queries with 0..4 valid blocks; a window of 4 tokens and a sink"),
    Case("small", _foundation(sliding_window=8), batch=2, seq_len=64, seed=1002,
         exercises="the foundation config (B=2, S=64, E=64, R=32, HI=8, DI=32, DR=16, m=4, k=4, "
                   "H=8, D=32), unpacked, with a window of 8 tokens and a sink"),
    Case("packed", _foundation(sliding_window=16), batch=2, seq_len=64, seed=1003,
         documents=((21, 43), (32, 13, 19)),
         exercises="packed rows of 2 and 3 documents of unequal length: positions restart, "
                   "segment ids change mid-row, blocks 5 (row 0) and 11 (row 1) straddle a "
                   "boundary (never valid), row 1's document at token 32 starts on a block "
                   "edge (no a-slot carry-over from the previous document); the 16-token "
                   "window reaches back over every boundary and must stop at it"),
    Case("ragged", _foundation(sliding_window=8), batch=2, seq_len=30, seed=1004,
         exercises="S=30 not a multiple of m=4: W=7, the 2 trailing tokens belong to no block "
                   "but are queries (and window tokens)"),
    Case("no_blocks", _foundation(sliding_window=2), batch=2, seq_len=3, seed=1005,
         exercises="S=3 < m=4: W=0, every output empty, loss exactly 0, gradients exactly 0"),
    Case("all_invalid", _foundation(sliding_window=2), batch=1, seq_len=8, seed=1006,
         documents=((3, 3, 2),),
         exercises="W=2 blocks but every block straddles a document boundary: all scores -inf, "
                   "every pick -1, no token has a valid block, loss 0 without NaN (the window "
                   "and sink alone never make a row valid)"),
    Case("topk_wide", _foundation(index_topk=12, sliding_window=8), batch=2, seq_len=32, seed=1007,
         exercises="k=12 >= W=8: k_eff = W, every valid block is picked, sparse loss == dense "
                   "loss, -1 fills the picks beyond the valid blocks"),
    Case("ties", _foundation(rope_head_dim=0, index_topk=3, sliding_window=8), batch=2, seq_len=32, seed=1008,
         tied_blocks=(("a", "a", "b", "b", "c", "c", "d", "d"),
                      ("a", "b", "a", "b", "c", "d", "c", "d")),
         exercises="exact score ties on the top-k boundary: blocks come in twins with "
                   "bit-identical hidden states (and teacher keys), the a-slot gate is -1e4 and "
                   "DR=0, so twin keys and scores are bit-identical in every dtype; with k=3 and "
                   "an even number of valid blocks the 3rd and 4th scores are twins, so which "
                   "twin is picked is arbitrary (naive index comparison breaks, sets with "
                   "tie tolerance do not; twin teacher keys make the sparse loss tie-proof: "
                   "a query's window and sink do not depend on which twin is picked)"),
    Case("flash_dims", full_config(emb_dim=64, q_lora_rank=16, index_n_heads=64,
                                   index_head_dim=128, rope_head_dim=64, compress_ratio=4,
                                   index_topk=8, num_query_heads=8, head_dim=128,
                                   sliding_window=128, rope_scaling=V4_YARN),
         batch=1, seq_len=64, seed=1009,
         exercises="the DeepSeek-V4-Flash indexer head shapes (HI=64, DI=128, DR=64, m=4) with "
                   "E=64 and R=16 shrunk (real 4096 / 1024) to keep the fixture small, k=8 "
                   "(real 512) so W=16 still has a boundary, teacher H=8, D=128; the released "
                   "model's 128-token window (>= S: every earlier token) and YaRN"),
    Case("window_only", _teacher(sliding_window=6), batch=1, seq_len=32, seed=1010, sink=None,
         exercises="a window and NO sink (every sink -inf): an implementation that adds a sink "
                   "anyway, or takes exp(-inf - -inf), breaks"),
    Case("sink_only", _teacher(sliding_window=0), batch=1, seq_len=32, seed=1011,
         exercises="a sink and NO window (n_win = 0): an empty window must add nothing; a window "
                   "one token too long (the token itself) shows"),
    Case("window_one", _teacher(sliding_window=1), batch=1, seq_len=32, seed=1012,
         exercises="n_win = 1: the window is the query token alone (an off-by-one that drops "
                   "the token itself or adds its predecessor shows)"),
    Case("window_wide", _teacher(sliding_window=40), batch=2, seq_len=32, seed=1013,
         exercises="n_win = 40 >= S = 32: every earlier token of the row; a banded slice that "
                   "wraps around at negative indices, or a window cut at S, breaks"),
    Case("window_heavy", _teacher(sliding_window=8), batch=1, seq_len=32, seed=1014,
         sink=(2.0, 1.0), window_scale=4.0,
         exercises="window logits of spread 4 and a sink around 2 take most of every head's mass: "
                   "the compressed probabilities are small before the renormalisation (precision "
                   "of the joint normaliser in every dtype)"),
    Case("teacher_gap", _teacher(sliding_window=6), batch=2, seq_len=32, seed=1015,
         sink=(0.0, 4.0),
         exercises="sinks spread over heads (std 4): some heads spend almost nothing on the "
                   "blocks, others almost everything, so the joint and the compressed teacher "
                   "differ by a wide margin (the compressed teacher fails the joint loss checks here)"),
    Case("yarn_tail", _teacher(index_head_dim=64, rope_head_dim=64, sliding_window=8, rope_scaling=V4_YARN),
         batch=1, seq_len=32, seed=1016, position_offset=69968,
         exercises="YaRN with DeepSeek-V4's settings (DR=64: ramp from pair 15 to 25) at positions "
                   "69968..69999, past original_max_position = 65536: the interpolated slow "
                   "frequencies turn by radians, so a reversed ramp or an mscale shows in every "
                   "dtype"),
    Case("packed_edges", _teacher(sliding_window=6), batch=2, seq_len=32, seed=1017,
         documents=((16, 16), (14, 4, 14)),
         exercises="document boundaries at the device edges of a sequence split over seq=2 "
                   "(edge at token 16) or seq=4 (8, 16, 24): row 0's second document starts "
                   "exactly on the edge at 16 (the pooling halo from the previous device is "
                   "another document's block: no a-slot carry-over, and the window stops at "
                   "the edge); row 1's documents start at 14 and 18, inside blocks 3 and 4, the "
                   "two blocks beside that edge (both straddle a boundary, never valid; block "
                   "4's halo block 3 belongs to another document)"),
)

def _released(**over: Any) -> dict[str, Any]:
    """The released indexers' head dimension (DI=128, DR=64, m=4) with everything else shrunk to
    keep the fixtures small: E=16, R=8, HI=4, k=4 of W=8, a teacher of 2 heads of 16, a window of 8."""
    base = dict(emb_dim=16, q_lora_rank=8, index_n_heads=4, index_head_dim=128, rope_head_dim=64,
                compress_ratio=4, index_topk=4, num_query_heads=2, head_dim=16, sliding_window=8)
    base.update(over)
    return full_config(**base)


_QUANT = (
    Case("quant_v4", _released(rope_scaling=V4_YARN, index_quant=V4_QUANT),
         batch=1, seq_len=32, seed=1018,
         exercises="DeepSeek-V4's released indexer preset: DI=128 rotated by the Hadamard transform "
                   "and quantized to e2m1 in blocks of 32 with UE8M0 scales (4 blocks per head and "
                   "key), DR=64 with YaRN; an unrotated, unscaled or transposed Hadamard, a scale "
                   "rounded instead of raised to a power of two, or blocks taken across heads all "
                   "change the codes"),
    Case("quant_v32", _released(index_n_heads=2, index_quant=V32_QUANT),
         batch=1, seq_len=32, seed=1019,
         exercises="DeepSeek-V3.2's preset: e4m3 (OCP e4m3fn, max 448, subnormals) in one block of "
                   "128: a float8 cast that gives NaN past 448 or saturates, or a wrong subnormal "
                   "grid, shows in the codes"),
    Case("quant_planted", full_config(emb_dim=16, q_lora_rank=8, index_n_heads=2, index_head_dim=32,
                                      rope_head_dim=0, compress_ratio=4, index_topk=2, num_query_heads=2,
                                      head_dim=16, sliding_window=4,
                                      index_quant={"format": "e2m1", "block": PLANT_BLOCK, "hadamard": False}),
         batch=1, seq_len=16, seed=1020, planted_quant=True,
         exercises="unrotated e2m1, queries planted on the quantizer's decision boundaries, exact in "
                   "every dtype: values at the midpoints between neighbouring codes (a rounding "
                   "other than half to even flips them), block maxima at exactly Qmax times a "
                   "power of two (a scale taken as the next power up halves the codes), an "
                   "all-zero block and a block whose maximum is the amax floor 6 * 2**-126"),
    Case("quant_packed", full_config(emb_dim=32, q_lora_rank=16, index_n_heads=4, index_head_dim=32,
                                     rope_head_dim=16, compress_ratio=4, index_topk=3, num_query_heads=4,
                                     head_dim=16, sliding_window=8,
                                     index_quant={"format": "e2m1", "block": 8, "hadamard": True}),
         batch=2, seq_len=64, seed=1021, documents=((21, 43), (32, 13, 19)),
         exercises="blocks of 8 smaller than DI=32 (4 scales per query head and per key) on packed "
                   "rows of 2 and 3 documents; FP4 changes the top-k of 7 of the 107 queries with a "
                   "valid block against the same problem unquantized (tests/test_quant.py), so a "
                   "candidate that scores unquantized values picks other blocks"),
)

CASES: Mapping[str, Case] = MappingProxyType({c.name: c for c in _CATALOGUE + _QUANT})


def _long(**over: Any) -> dict[str, Any]:
    """The long cases' width (SPEC section 11): the cost of judging at length comes from S, W, k and
    the offsets, not the width, so the width is the smallest that still has something to chunk
    (HI=2 indexer heads of DI=16, H=2 teacher heads of D=8, E=R=8), with DeepSeek-V4's YaRN and
    its 128-token window."""
    base = dict(emb_dim=8, q_lora_rank=8, index_n_heads=2, index_head_dim=16, rope_head_dim=8,
                compress_ratio=4, index_topk=512, num_query_heads=2, head_dim=8, sliding_window=128,
                rope_scaling=V4_YARN)
    base.update(over)
    return full_config(**base)


# The long cases (SPEC section 11): judged by the `long` sample only (harness.problems.matrix.LONG_POINTS),
# never stored as fixtures: the inputs are drawn from the seed at run time (`make_inputs`, as for
# every case), so they hold no goldens. Each plants the hazards its description names.
LONG_S = 131072
# long_deep_documents' layout: 24 documents of 4096 tokens, one of 1699 (so the next starts deep, at
# 100003, inside block 25000), 7 of 4096, one of 825 and the last of 1572 from 129500, inside the
# last query block of 1900 rows (129200 .. 131071).
_DEEP = (4096,) * 24 + (1699,) + (4096,) * 7 + (825, 1572)
# long_ties_k2048's: 56 documents of 2048 tokens (512 blocks, fewer than k = 2048) and one of 16384
# (4096 blocks) at the end.
_TIED = (2048,) * 56 + (16384,)
_LONG = (
    Case("long_deep_documents", _long(), batch=1, seq_len=LONG_S, seed=2001, documents=(_DEEP,),
         position_offset=69968,
         exercises="B*S*W = 131072 * 32768 = 4.3e9 score entries (past 2^31: a row * W offset in int32 "
                   "overflows); a document starting deep, at token 100003 (inside block 25000, which "
                   "straddles it), and one at 129500, inside the last query block of 1900 rows (r does not "
                   "divide S: blocks start at multiples of 1900, the last one at 129200 is short); the last "
                   "two documents have 206 and 393 blocks, fewer than k = 512, so rows at the end of the "
                   "sequence keep -1 picks; every document's positions run from 69968 (past 2^16 and "
                   "YaRN's 65536) for up to 4096 tokens; 131072 valid rows and up to 1023 blocks a row "
                   "(counts past 2^8 and 2^11, bfloat16's and float16's exact integers); the joint "
                   "teacher's 128-token window and sink on every row"),
    Case("long_ties_k2048", _long(rope_head_dim=0, rope_scaling=None, index_topk=2048), batch=1,
         seq_len=LONG_S, seed=2002, documents=(_TIED,),
         tied_blocks=(tuple(f"t{w % 1000}" for w in range(LONG_S // 4)),),
         exercises="k = 2048 with exact ties at rank k among the 4096 blocks of the last document: block w "
                   "is a bit-identical twin of every block w + 1000j (DR = 0, the a-slot gate silenced, as "
                   "in `ties`: a block's key is its own tokens'), 4 or 5 copies inside that document, so "
                   "the k-th score of its late rows sits in a group of twins split by the boundary; the 56 "
                   "documents before it have 512 blocks, fewer than k (their rows keep 1536 or more -1 "
                   "picks); B*S*W = 4.3e9 (past 2^31); query blocks of 1024"),
)
LONG_CASES: Mapping[str, Case] = MappingProxyType({c.name: c for c in _LONG})

# The million-token case (SPEC section 11, sampled rows): judged by the `million` sample only.
MILLION_S = 2 ** 20
# Documents of 2^19 .. 2^12 tokens (the first one's rows see up to 131072 blocks), then one of 1699, one of
# 1997 from 1046179 (inside block 261544, which straddles it) and the last of 400 from 1048176, inside the
# last query block of 1000 rows (1048000 .. 1048575).
_MILLION = tuple(2 ** e for e in range(19, 11, -1)) + (1699, 1997, 400)
_MILLION_CASES = (
    Case("million_documents", _long(), batch=1, seq_len=MILLION_S, seed=2003, documents=(_MILLION,),
         exercises="S = 2^20, W = 2^18: B*S*W = 2.7e11 score entries (past 2^31 by 128x); k = 512 among up to "
                   "131072 visible blocks (the first document's 2^19 tokens, positions up to 524287, past YaRN's "
                   "65536); documents of 2^19 down to 2^12 tokens, one starting at 1046179 (inside block 261544, "
                   "which straddles it) and the last at 1048176, inside the last query block of 1000 rows (r does "
                   "not divide S); the last three documents have 424, 499 and 100 blocks, fewer than k, so their "
                   "rows keep -1 picks"),
)
MILLION_CASES: Mapping[str, Case] = MappingProxyType({c.name: c for c in _MILLION_CASES})


def get_case(name: str) -> Case:
    """A case of the catalogue, of the long cases or of the million-token cases."""
    try:
        return CASES[name] if name in CASES else LONG_CASES[name] if name in LONG_CASES else MILLION_CASES[name]
    except KeyError:
        raise ValueError(f"unknown case {name!r} (valid: {', '.join([*CASES, *LONG_CASES, *MILLION_CASES])})") from None


def layout(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids, segment_ids) as int32 [B, S]: positions restart at `position_offset` (0 unless
    the case says otherwise) per document, segment ids count documents from 1 within each row."""
    B, S = case.batch, case.seq_len
    docs = case.documents if case.documents is not None else ((S,),) * B
    pos = np.zeros((B, S), np.int32)
    seg = np.zeros((B, S), np.int32)
    for b, lengths in enumerate(docs):
        start = 0
        for i, n in enumerate(lengths):
            pos[b, start:start + n] = case.position_offset + np.arange(n, dtype=np.int32)
            seg[b, start:start + n] = i + 1
            start += n
    return pos, seg


def make_inputs(case: Case) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(inputs, params) for a case: float32 / int32 numpy, deterministic from the seed.

    Scales give the scores a spread of order 1: unit-normal hidden states, query
    latents and teacher keys; fan-in scaled normal weights; a random `ape`;
    `kv_norm` around 1; `teacher_query` unit-normal times `D**-0.5` (SPEC §4).
    The draw order is fixed (params first, then inputs) and every tensor is drawn
    whole, so adding a case never changes another case's bytes.
    """
    c = case.config
    E, R, HI, DI, m = (c["emb_dim"], c["q_lora_rank"], c["index_n_heads"],
                       c["index_head_dim"], c["compress_ratio"])
    H, D = c["num_query_heads"], c["head_dim"]
    B, S, W = case.batch, case.seq_len, case.num_blocks
    rng = np.random.default_rng(case.seed)

    def normal(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {
        "indexer.wkv": normal((E, 2 * DI), E ** -0.5),
        "indexer.wgate": normal((E, 2 * DI), E ** -0.5),
        "indexer.ape": normal((m, 2 * DI), 1.0),
        "indexer.kv_norm": (1.0 + normal((DI,), 0.1)).astype(np.float32),
        "indexer.wq_b": normal((R, HI * DI), R ** -0.5),
        "indexer.weights_proj": normal((E, HI), E ** -0.5),
    }
    hidden = normal((B, S, E))
    q_latent = normal((B, S, R))
    teacher_query = normal((B, S, H, D), D ** -0.5)
    teacher_kv = normal((B, W, D))
    # Drawn after every tensor above, so those keep their bytes.
    teacher_window_kv = normal((B, S, D), case.window_scale)
    if case.sink is None:
        attention_sink = np.full((H,), -np.inf, np.float32)
    else:
        attention_sink = normal((H,), case.sink[1]) + np.float32(case.sink[0])
    pos, seg = layout(case)

    if case.tied_blocks is not None:
        # Twin blocks: copy the first block of each label over the others (hidden
        # states and teacher keys), and silence the a-slots of the gate.
        for b, labels in enumerate(case.tied_blocks):
            first: dict[str, int] = {}
            for w, label in enumerate(labels):
                src = first.setdefault(label, w)
                if src != w:
                    hidden[b, w * m:(w + 1) * m] = hidden[b, src * m:(src + 1) * m]
                    teacher_kv[b, w] = teacher_kv[b, src]
        params["indexer.ape"][:, :DI] += np.float32(ISOLATE_GATE)

    if case.planted_quant:
        q_latent, params["indexer.wq_b"] = plant_quant_queries(B, S, R, HI, DI)

    inputs = {
        "hidden_states": hidden,
        "q_latent": q_latent,
        "position_ids": pos,
        "segment_ids": seg,
        "teacher_query": teacher_query,
        "teacher_kv": teacher_kv,
        "teacher_window_kv": teacher_window_kv,
        "attention_sink": attention_sink,
    }
    for name, (shape, dt) in case.input_shapes().items():
        assert inputs[name].shape == shape and inputs[name].dtype == dt, name
    for name, shape in case.param_shapes().items():
        assert params[name].shape == shape and params[name].dtype == np.float32, name
    return inputs, params


# Planted e2m1 blocks of 8 (`planted_quant`), as multiples of the block's scale 2**e. MIDPOINTS:
# Qmax (6: the block maximum, so amax / Qmax is exactly the power of two 2**e, on the scale's
# boundary) and the seven midpoints between neighbouring positive values, where half to even
# picks 4, 4, 2, 2, 1, 1, 0 (half away from zero: 6, 4, 3, 2, 1.5, 1, 0.5). FLOOR: a maximum
# of exactly the amax floor 6 * 2**-126 (scale 2**-126, codes 6 down to 1; every value a normal
# float32 and bfloat16, none in float16, where they flush to 0).
PLANT_MIDPOINTS = (6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25)
PLANT_FLOOR = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 1.0, 1.0)


def plant_quant_queries(batch: int, seq_len: int, rank: int, heads: int, head_dim: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(q_latent [B, S, R], wq_b [R, HI * DI]) with every query on the quantizer's boundaries.

    Token t's latent is the one-hot e_(t mod R), so its queries are row t mod R of wq_b, exact
    in every dtype (a sum of one product by 1 and zeros). Each head's DI channels are blocks of
    PLANT_BLOCK, in the pattern midpoints / zeros / floor / midpoints negated, shifted by the
    row and head; the midpoint blocks are scaled by 2**e, e cycling over -3..2 (exact in every
    dtype), their signs alternating. Deterministic without a seed."""
    q_latent = np.zeros((batch, seq_len, rank), np.float32)
    for b in range(batch):
        q_latent[b, np.arange(seq_len), (b * seq_len + np.arange(seq_len)) % rank] = 1.0
    signs = np.where(np.arange(PLANT_BLOCK) % 2 == 0, 1.0, -1.0)
    kinds = ("midpoints", "zeros", "floor", "negated")
    wq_b = np.zeros((rank, heads, head_dim), np.float64)
    for r in range(rank):
        for h in range(heads):
            for j in range(head_dim // PLANT_BLOCK):
                kind = kinds[(j + r + h) % len(kinds)]
                scale = 2.0 ** (((r * heads + h) * 7 + j) % 6 - 3)
                if kind == "midpoints":
                    block = np.asarray(PLANT_MIDPOINTS) * signs * scale
                elif kind == "negated":
                    block = -np.asarray(PLANT_MIDPOINTS)[::-1] * signs * scale
                elif kind == "floor":
                    block = np.asarray(PLANT_FLOOR) * signs * 2.0**-126
                else:
                    block = np.zeros(PLANT_BLOCK)
                wq_b[r, h, j * PLANT_BLOCK:(j + 1) * PLANT_BLOCK] = block
    return q_latent, wq_b.reshape(rank, heads * head_dim).astype(np.float32)

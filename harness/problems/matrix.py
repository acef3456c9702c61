"""The parity matrix as data (like PyTorch's OpInfo): which checks exist.

A matrix entry is one (case, dtype, indexer chunk, teacher chunk, query chunk, teacher,
mode, quantity): a `Point` (what an implementation runs) and what is judged at it. Tests and
the CLI both read `build_matrix`; nothing else decides what runs.

Four samples (`sample=`, `csa-parity run --sample`, CSA_PARITY_SAMPLE for pytest): `default`
(`csa-parity run`, `make parity`), `ci` (what `make test` runs: a subset of the default),
`full` (the whole chunk cross product) and `tpu` (what one TPU chip runs inside one 10-minute
command: every case, the three dtypes a TPU computes, every chunk axis, both teachers). Which points each holds and why is docs/matrix.md;
their sizes are `csa-parity run --list [--sample S]` and docs/FIGURES.md. The long cases
(`long`, S = 131072) and the million-token case (`million`, its rows sampled) are judged by
harness.run.long, a block of rows at a time, from their points here (`long_points`).
"""

from __future__ import annotations

import numpy as np

from ..outputs import LOSS_QUANTITIES, MODES, forward_quantities
from ..points import DTYPES, Entry, Point
from .cases import CASES, LONG_CASES, MILLION_CASES, TEACHERS, get_case

TEACHER_CHUNK_DTYPES = ("float32", "float64")
QUERY_CHUNK_DTYPES = ("float32", "bfloat16", "float64")
SWEEP_CASES = ("small", "flash_dims")
SAMPLES = ("ci", "default", "full", "tpu")
# The long sample (SPEC section 11; harness.run.long): every long case at these dtypes, each at one
# chunked point (head chunks of 1, query blocks of r) and its native point at length (no head
# chunks, the same query blocks: the unchunked program's [B, S, W] is what no process may hold).
# r per case: 1900 does not divide S = 131072 (its last block, 129200 .., holds a document start);
# 1024 does. A block's program holds a few [B, r, W] arrays, so r sets the loss stage's memory: at
# k = 2048 the loss's compiled temp is 1.75 GiB at r = 1024 against 6.81 GiB at r = 4096 (float32,
# native; XLA's memory analysis), and long_deep_documents' worker went past the sample's 8 GiB in
# its bfloat16 loss stage at r = 3000 (docs/matrix.md).
LONG_SAMPLE = "long"
LONG_DTYPES = ("float32", "bfloat16")
LONG_QUERY_BLOCKS = {"long_deep_documents": 1900, "long_ties_k2048": 1024}
assert set(LONG_QUERY_BLOCKS) == set(LONG_CASES)


# The million sample (SPEC section 11, sampled rows; harness.run.long): each million-token case at
# bfloat16, the dtype long-context training runs in, at its chunked point only (head chunks of 1,
# query blocks of r), the one a long-context user runs: its native point scores all heads of a row
# block at once, about three times the chunked point's time a block at S = 2^20
# (`python -m benchmarks.forward_rows`, docs/benchmarks.md).
# r = 1000 does not divide S. The oracle judges MILLION_RANDOM_ROWS seeded rows besides the first,
# the last and both sides of every document and query-block boundary (`sampled_rows`).
MILLION_SAMPLE = "million"
MILLION_DTYPES = ("bfloat16",)
MILLION_QUERY_BLOCKS = {"million_documents": 1000}
MILLION_RANDOM_ROWS = 1024
assert set(MILLION_QUERY_BLOCKS) == set(MILLION_CASES)


def long_points(case: str, dtype: str) -> tuple[Point, ...]:
    """The points of a long case at `dtype`: (the chunked point, its native point at length); of a
    million-token case, (the chunked point,)."""
    if case in MILLION_CASES:
        return (Point(case, dtype, 1, 1, MILLION_QUERY_BLOCKS[case]),)
    r = LONG_QUERY_BLOCKS[case]
    return Point(case, dtype, 1, 1, r), Point(case, dtype, 0, 0, r)


def sampled_rows(case, r: int, random_rows: int = MILLION_RANDOM_ROWS) -> np.ndarray:
    """The rows the oracle judges where it cannot afford every one (SPEC section 11): sorted indices
    along S, judged in every batch row. The first and the last, both sides of every document
    boundary (of any batch row) and of every query-block boundary (multiples of `r`), and
    `random_rows` rows drawn from the case's seed."""
    S = case.seq_len
    rows = {0, S - 1}
    for lengths in (case.documents or ((S,),) * case.batch):
        for edge in np.cumsum(lengths)[:-1]:
            rows |= {int(edge) - 1, int(edge)}
    for edge in range(r, S, r):
        rows |= {edge - 1, edge}
    rng = np.random.default_rng(case.seed)
    rows |= set(int(i) for i in rng.choice(S, size=min(random_rows, S), replace=False))
    return np.array(sorted(rows), np.int64)


def divisors(n: int) -> list[int]:
    """The positive divisors of n: the chunk sizes (besides 0, no chunking) a head count allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


def seq_split_reason(case: str, seq: int) -> str | None:
    """Why `case` cannot run with its sequence split over `seq` devices, or None: each device
    must hold a stretch of whole blocks (S/seq tokens, a multiple of m; jax_impl.sharded)."""
    if seq <= 1:
        return None
    c = CASES[case]
    m = c.config["compress_ratio"]
    if c.seq_len % seq == 0 and (c.seq_len // seq) % m == 0:
        return None
    valid = [p for p in divisors(c.seq_len) if p > 1 and (c.seq_len // p) % m == 0]
    sizes = (f"valid seq sizes: {', '.join(map(str, valid))}" if valid else
             "no seq size above 1 does" + (f": S={c.seq_len} is not a multiple of m" if c.seq_len % m else
                                          f": S holds {c.seq_len // m} block(s)"))
    return (f"not applicable: case {case} (S={c.seq_len}, m={m}) does not split into whole blocks over "
            f"seq={seq} devices (S/seq must be a multiple of m; {sizes})")


def combined_pair(case: str) -> tuple[int, int]:
    """The combined point's (indexer chunk, teacher chunk): the second-smallest divisor of each."""
    cfg = CASES[case].config
    hi, h = cfg["index_n_heads"], cfg["num_query_heads"]
    return (divisors(hi)[1] if hi > 1 else 1, divisors(h)[1] if h > 1 else 1)


def chunk_pairs(case: str, dtype: str, full: bool = False) -> list[tuple[int, int]]:
    """The (indexer chunk, teacher chunk) pairs of the default (or the full) sample for a
    case and dtype (docs/matrix.md)."""
    cfg = CASES[case].config
    hi, h = cfg["index_n_heads"], cfg["num_query_heads"]
    if full:
        return [(i, t) for i in [0, *divisors(hi)] for t in [0, *divisors(h)]]
    pairs = [(0, 0), combined_pair(case)]
    if case in SWEEP_CASES:
        ichunks = divisors(hi) if dtype != "float16" else sorted({1, hi})
        pairs += [(c, 0) for c in ichunks]
        if dtype in TEACHER_CHUNK_DTYPES:
            pairs += [(0, t) for t in divisors(h)]
    return sorted(set(pairs))


def query_chunk_sizes(seq_len: int) -> tuple[int, int]:
    """(dividing, non-dividing) query chunks of a sequence, each giving at least 2 blocks where
    S allows: the largest divisor of S up to S/4 (4 blocks when 4 divides S) and the largest
    non-divisor up to S/3 (at least 3 blocks, the last one short). 0 where none exists."""
    dividing = max([d for d in divisors(seq_len) if d <= seq_len // 4 and d < seq_len] or [0])
    non_dividing = max([r for r in range(1, seq_len // 3 + 1) if seq_len % r] or
                       [r for r in range(1, seq_len) if seq_len % r] or [0])
    return dividing, non_dividing


def chunk_points(case: str, dtype: str, sample: str = "default") -> list[tuple[int, int, int]]:
    """The (indexer chunk, teacher chunk, query chunk) triples run for a case and dtype in a
    sample (`ci`, `default`, `full`; docs/matrix.md). The default: chunk_pairs, the
    combined pair with the non-dividing query chunk folded in, and on the sweep cases query
    chunking alone."""
    if sample not in SAMPLES:
        raise ValueError(f"sample={sample!r} is not supported (valid: {', '.join(SAMPLES)})")
    if sample == "ci":
        return ci_points(case, dtype)
    if sample == "tpu":
        return tpu_points(case, dtype, "joint")
    full = sample == "full"
    pairs = chunk_pairs(case, dtype, full)
    dividing, non_dividing = query_chunk_sizes(CASES[case].seq_len)
    if full:
        return sorted({(i, t, q) for i, t in pairs for q in {0, dividing, non_dividing}})
    combined = combined_pair(case)
    points = [(i, t, non_dividing if (i, t) == combined else 0) for i, t in pairs]
    if case in SWEEP_CASES and dtype in QUERY_CHUNK_DTYPES:
        points += [(0, 0, q) for q in (dividing, non_dividing) if q]
    return sorted(set(points))


# The ci sample's dtypes (docs/matrix.md), per case: (the dtypes of its native point, the dtypes of
# its combined chunk point). A chunked point is judged against the native point of its own
# dtype, so the combined dtypes are a subset of the native ones. Chosen so that every dtype runs
# natively on 7 of the 14 cases beyond the sweep cases and holds the combined point of 2 of the
# 8 original ones (packed_edges, for the sequence-sharded slice, adds bfloat16 and float64), and
# so that the mutation self-test's points (tiny, packed, sink_only, yarn_tail and packed_edges
# in float64) are ci points whose programs the self-test loads from the run's compilation cache. A case missing here is an error (tests/test_matrix_samples.py).
CI_DTYPES = {
    "tiny": (("float16", "float64"), ("float16",)),
    "small": (DTYPES, ("float16", "float64")),
    "packed": (("bfloat16", "float64"), ("float64",)),
    "ragged": (("float16", "float32"), ("float32",)),
    "no_blocks": (("bfloat16", "float32"), ("bfloat16",)),
    "all_invalid": (("float16", "float32"), ("float16",)),
    "topk_wide": (("bfloat16", "float32"), ("float32",)),
    "ties": (("bfloat16", "float64"), ("bfloat16",)),
    "flash_dims": (DTYPES, ("bfloat16", "float32")),
    # The joint-teacher cases (TEACHER_CASES) share one small indexer and differ only in the
    # window and the sink, so each runs natively in one dtype: narrow on three, wide on three,
    # every dtype on at least one (teacher_gap's compressed points add float64). Every case above
    # has a window and a sink as well, in its own two dtypes or more.
    "window_only": (("float16",), ()),
    "sink_only": (("float64",), ()),
    "window_one": (("float32",), ()),
    "window_wide": (("bfloat16",), ()),
    "window_heavy": (("float32",), ()),
    "teacher_gap": (("bfloat16",), ()),
    "yarn_tail": (("float16", "float64"), ("float64",)),
    "packed_edges": (("bfloat16", "float64"), ("float64",)),
    # The quantized cases (docs/matrix.md): the released preset and the planted boundaries in
    # every dtype, V3.2's e4m3 and the packed blocks in two. One combined point among the four:
    # every path, chunked or not, scores the same x_hat (SPEC section 7a: the codes are made
    # once, before any head chunk or query block), so four combined points checked one thing
    # four times (~20 s of compile each). quant_planted's in float64, whose exact64 check sees
    # any row or head of the quantized path out of place; the pinned random problems
    # quant_e2m1_rotated and quant_e4m3_one_block add the quantizer under head and query chunks
    # in other formats. The default sample runs every case's.
    "quant_v4": (DTYPES, ()),
    "quant_v32": (("bfloat16", "float64"), ()),
    "quant_planted": (DTYPES, ("float64",)),
    "quant_packed": (("float16", "float32"), ()),
}
# On sweep case j, value class c runs in one of the dtypes the default sample sweeps that knob
# in, the (c + j)-th.
ICHUNK_DTYPES = ("float32", "bfloat16", "float64")
# The cases that exist for the joint teacher (they share one small indexer): the ci sample runs
# them natively only (every older case has a window and a sink too, so its combined point checks
# the window inside query blocks and head chunks; the default sample runs theirs).
TEACHER_CASES = ("window_only", "sink_only", "window_one", "window_wide", "window_heavy", "teacher_gap")


def ci_points(case: str, dtype: str) -> list[tuple[int, int, int]]:
    """The ci sample's chunk triples for a case and dtype: a subset of the default sample's."""
    if case not in CI_DTYPES:
        raise ValueError(f"case={case!r} has no entry in harness.problems.matrix.CI_DTYPES (the ci sample's dtypes "
                         "per case): add one")
    native, combined = CI_DTYPES[case]
    if dtype not in native:
        return []
    cfg = CASES[case].config
    hi, h = cfg["index_n_heads"], cfg["num_query_heads"]
    dividing, non_dividing = query_chunk_sizes(CASES[case].seq_len)
    points = [(0, 0, 0)]
    if dtype in combined:
        points.append((*combined_pair(case), non_dividing))
    if case in SWEEP_CASES:
        j = SWEEP_CASES.index(case)
        classes = [((1, 0, 0), ICHUNK_DTYPES), ((hi, 0, 0), ICHUNK_DTYPES),
                   ((0, 1, 0), TEACHER_CHUNK_DTYPES), ((0, h, 0), TEACHER_CHUNK_DTYPES),
                   ((0, 0, dividing), QUERY_CHUNK_DTYPES), ((0, 0, non_dividing), QUERY_CHUNK_DTYPES)]
        points += [p for c, (p, dtypes) in enumerate(classes) if dtypes[(c + j) % len(dtypes)] == dtype]
    return sorted(set(points))


# The tpu sample (`csa-parity run --sample tpu`): what one TPU chip runs start to finish inside one
# 10-minute command, the dtypes a TPU computes (float32, bfloat16, float16; float64 is not
# applicable there, harness.platforms). Every case natively with the joint teacher, in one dtype
# rotated over the catalogue (case i in TPU_DTYPES[i % 3]); every third case natively with the
# compressed teacher, in TPU_DTYPES[(i // 3) % 3], so each dtype meets both teachers; and every
# axis a TPU user chunks along, each against its native point: small in float32 at indexer head
# chunk 1, teacher head chunk 1, the dividing query chunk and the combined point (head chunks
# and the non-dividing query chunk at once); flash_dims (64 indexer heads) in bfloat16 and tiny
# in float16 at their combined points; tiny's compressed teacher at its combined point.
# Each point is one compiled program (two where the problem quantizes), the cost on a TPU.
TPU_DTYPES = ("float32", "bfloat16", "float16")
TPU_CHUNKED = {("small", "float32", "joint"): ("ichunk", "tchunk", "qchunk", "combined"),
               ("flash_dims", "bfloat16", "joint"): ("combined",),
               ("tiny", "float16", "joint"): ("combined",),
               ("tiny", "float32", "compressed"): ("combined",)}


def tpu_points(case: str, dtype: str, teacher: str) -> list[tuple[int, int, int]]:
    """The tpu sample's (indexer chunk, teacher chunk, query chunk) triples for a case, dtype
    and teacher (see TPU_DTYPES)."""
    if dtype not in TPU_DTYPES or teacher not in CASES[case].teachers:
        return []
    i = list(CASES).index(case)
    native = (TPU_DTYPES[i % 3] == dtype if teacher == "joint"
              else i % 3 == 0 and TPU_DTYPES[(i // 3) % 3] == dtype)
    axes = TPU_CHUNKED.get((case, dtype, teacher), ())
    points = [(0, 0, 0)] if native or axes else []
    dividing, non_dividing = query_chunk_sizes(CASES[case].seq_len)
    knob = {"ichunk": (1, 0, 0), "tchunk": (0, 1, 0), "qchunk": (0, 0, dividing),
            "combined": (*combined_pair(case), non_dividing)}
    points += [knob[a] for a in axes]
    return sorted(set(points))


# The compressed teacher's sample (docs/matrix.md): its points on every case (each holds its
# goldens, Case.teachers). default: the native point in every dtype, the combined point in
# float32, bfloat16 and float64. ci: the native point in one dtype per case (COMPRESSED_CI, the
# four dtypes spread over the catalogue: 3 to 5 cases each, float64 on the layouts whose semantics
# a shortcut gets wrong first: ragged rows, exact ties, packed document edges, YaRN past 65536),
# and the combined point on two cases, in their native dtype (its chunk checks compare with that
# point). A case missing from COMPRESSED_CI is an error (tests/test_matrix_samples.py).
#
# None: not in ci. The compressed teacher reads neither the window nor the sink (SPEC section 8:
# each head renormalised over the compressed blocks alone), and the joint-teacher cases share one
# small indexer and differ only in those two: on them its points would judge one computation
# again on other random numbers. ci keeps it on teacher_gap (where the two teachers differ
# most, natively and combined); the default sample runs it on every case.
COMPRESSED_CI = {
    "tiny": "float16", "small": "bfloat16", "packed": "float32", "ragged": "float64", "no_blocks": "float16",
    "all_invalid": "bfloat16", "topk_wide": "float32", "ties": "float64", "flash_dims": "bfloat16",
    "window_only": None, "sink_only": None, "window_one": None, "window_wide": None,
    "window_heavy": None, "teacher_gap": "float64", "yarn_tail": "float64", "packed_edges": "float64",
    "quant_v4": "bfloat16", "quant_v32": "float16", "quant_planted": "float32", "quant_packed": "float16",
}
COMPRESSED_COMBINED = {"ci": {"small": ("bfloat16",), "teacher_gap": ("float64",)},
                       "default": {case: ("float32", "bfloat16", "float64") for case in CASES}}


def compressed_points(case: str, dtype: str, sample: str = "default") -> list[tuple[int, int, int]]:
    """The (indexer chunk, teacher chunk, query chunk) triples run with the compressed teacher:
    none where the case holds no compressed goldens; the full sample runs the joint teacher's
    chunk points; the others the native point and the combined chunk point in their dtypes."""
    if "compressed" not in CASES[case].teachers:
        return []
    if sample == "full":
        return chunk_points(case, dtype, sample)
    if sample == "tpu":
        return tpu_points(case, dtype, "compressed")
    if sample == "ci" and case not in COMPRESSED_CI:
        raise ValueError(f"case={case!r} has no entry in harness.problems.matrix.COMPRESSED_CI (the ci sample's dtype of "
                         "the compressed teacher per case): add one")
    native = DTYPES if sample == "default" else (COMPRESSED_CI[case],) if COMPRESSED_CI[case] else ()
    points = [(0, 0, 0)] if dtype in native else []
    if dtype in COMPRESSED_COMBINED[sample].get(case, ()):
        points.append((*combined_pair(case), query_chunk_sizes(CASES[case].seq_len)[1]))
    return points


# The Pallas scoring backend's sample (config `scoring_backend`; Point.backend): the points it
# runs, each judged against the oracle like any point and against the XLA path at the same
# knobs (the `xla` check, harness.judging.tolerance.BACKEND). Interpret mode off TPU costs a compiled
# program of ~10 s per point on 2 cores, so the axis is sampled apart from the chunk knobs:
# default: every case natively in one dtype (DTYPES rotated over the catalogue), the sweep
#   cases natively in every dtype and at their combined chunk point in float32 and bfloat16,
#   and the ci sample's points;
# ci: tiny natively in float64, where `exact64` sees any formula error (~10 s). A chunked pallas
#   point costs ~40 s in interpret mode (each loss mode's scans hold their own kernels), so ci
#   leaves chunking to tests/test_pallas.py (the kernels inside the head-chunk scan, float32) and
#   the bfloat16 inputs to its `kernel` check.
# full: the joint teacher's chunk points of the default sample, on the pallas backend too.
BACKENDS = ("xla", "pallas")
PALLAS_CI = {("tiny", "float64"): "native"}


def pallas_points(case: str, dtype: str, sample: str = "default") -> list[tuple[int, int, int]]:
    """The (indexer chunk, teacher chunk, query chunk) triples run on the pallas backend (joint
    teacher) for a case and dtype in a sample (see BACKENDS)."""
    combined = (*combined_pair(case), query_chunk_sizes(CASES[case].seq_len)[1])
    if sample == "full":
        return chunk_points(case, dtype, "default")
    if sample == "tpu":
        return tpu_pallas_points(case, dtype)
    if sample == "ci":
        kind = PALLAS_CI.get((case, dtype))
        return [] if kind is None else [(0, 0, 0) if kind == "native" else combined]
    points = pallas_points(case, dtype, "ci")  # default holds ci
    if case in SWEEP_CASES or dtype == DTYPES[list(CASES).index(case) % len(DTYPES)]:
        points.append((0, 0, 0))
    if case in SWEEP_CASES and dtype in ("float32", "bfloat16"):
        points.append(combined)
    return sorted(set(points))


# The tpu sample's pallas points (`--sample tpu --backends xla,pallas`): the kernels compiled by
# Mosaic on the chip, at every joint-teacher point of the xla sample in float32 and bfloat16 (the
# dtypes the kernels take on a TPU, jax_impl/kernels), chunk axes included, each judged against
# the oracle and against the xla point at the same knobs.
TPU_PALLAS_DTYPES = ("float32", "bfloat16")


def tpu_pallas_points(case: str, dtype: str) -> list[tuple[int, int, int]]:
    return tpu_points(case, dtype, "joint") if dtype in TPU_PALLAS_DTYPES else []


def programs_at(point: Point) -> int:
    """The programs the built-in implementation compiles for a point: one (every mode and quantity
    in one parity bundle), two where the problem quantizes on one device (on the oracle's codes
    and on its own, harness.sides.implementations)."""
    return 2 if CASES[point.case].config.get("index_quant") is not None and point.mesh is None else 1


def entries_at(point: Point, modes=None, impl: str = "jax") -> list[Entry]:
    """Every entry of one point (forward quantities only at teacher chunk 0 and with the joint
    teacher: they do not depend on the teacher; where the problem quantizes, its codes and
    scales among them)."""
    out = []
    for mode in modes or MODES:
        if mode == "forward":
            if point.tchunk or point.teacher != "joint":
                continue
            quantities = forward_quantities(get_case(point.case).config)
        else:
            quantities = LOSS_QUANTITIES
        out.extend(Entry(point, mode, q, impl) for q in quantities)
    return out


def build_matrix(cases=None, dtypes=None, ichunks=None, tchunks=None, modes=None,
                 impl: str = "jax", qchunks=None, sample: str = "default", teachers=None,
                 backends=None) -> list[Entry]:
    """All entries. None = the sample's choice (`sample`: ci, default or full); explicit
    `ichunks` / `tchunks` / `qchunks` replace the sampled chunk points of every case by their
    cross product (a missing one counts as [0]). `teachers` (default: both) picks the teachers;
    each runs on the cases that hold its goldens (every case: Case.teachers). `backends` (default: xla)
    picks the scoring backends; pallas runs its own sample (`pallas_points`), or the explicit
    chunks. tests/test_parity_matrix.py asks for both; `csa-parity run --backends xla,pallas`."""
    for t in teachers or ():
        if t not in TEACHERS:
            raise ValueError(f"teacher={t!r} is not supported (valid: {', '.join(TEACHERS)})")
    for b in backends or ():
        if b not in BACKENDS:
            raise ValueError(f"backend={b!r} is not supported (valid: {', '.join(BACKENDS)})")
    backends = backends or ("xla",)
    entries = []
    if "xla" in backends:
        entries += _build(cases, dtypes, ichunks, tchunks, modes, impl, qchunks, sample, teachers, "xla")
    if "pallas" in backends and "joint" in (teachers or TEACHERS):
        entries += _build(cases, dtypes, ichunks, tchunks, modes, impl, qchunks, sample, ("joint",), "pallas")
    return entries


def _build(cases, dtypes, ichunks, tchunks, modes, impl, qchunks, sample, teachers, backend) -> list[Entry]:
    entries = []
    for case in cases or CASES:
        for dtype in dtypes or DTYPES:
            for teacher in teachers or TEACHERS:
                if teacher != "joint" and teacher not in CASES[case].teachers:
                    continue
                if ichunks is not None or tchunks is not None or qchunks is not None:
                    points = [(i, t, q) for i in (ichunks or [0]) for t in (tchunks or [0]) for q in (qchunks or [0])]
                elif backend == "pallas":
                    points = pallas_points(case, dtype, sample)
                elif teacher == "joint":
                    points = chunk_points(case, dtype, sample)
                else:
                    points = compressed_points(case, dtype, sample)
                for ichunk, tchunk, qchunk in points:
                    point = Point(case, dtype, ichunk, tchunk, qchunk, teacher=teacher, backend=backend)
                    entries.extend(entries_at(point, modes, impl))
    return entries

"""The collectives of a compiled XLA program, read from its optimized HLO text
(`compiled.as_text()`): what each moves per device, and whether it runs inside a loop.

Pure text, no JAX: `tests/test_context_parallel.py` checks it on HLO strings, the sharded slice
(`tests/sharded/test_collectives.py`) on a compiled program, and `benchmarks.context_parallel`
tabulates a program's communication with it.

Bytes per device, per execution of the op, with G the size of its replica group (the usual ring
costs; a group of 1 moves nothing):
  all-reduce          2 (G-1)/G x its result (a reduce-scatter then an all-gather)
  all-gather          (G-1)/G x its result (the gathered array)
  reduce-scatter      (G-1) x its result (a device's shard; the operand is G shards)
  all-to-all          (G-1)/G x its result
  collective-permute  its result, on a device that sends (the pairs name who does)
An op inside a `while` body (or in a computation that body calls, at any depth) runs once per
iteration: `per_step` multiplies by the loops' trip counts where XLA knows them
(`known_trip_count`), and `in_loop` marks it either way.

A combined op (XLA's all-reduce combiner merges several into one tuple-shaped op) lists each
operand's source in its `op_name` metadata, as prefix(part:part:...)suffix; `Collective.sources`
holds one op_name per tuple element when the counts agree, so each element can be attributed to
the `jax.named_scope` it came from.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str            # the instruction's name
    kind: str            # one of KINDS
    computation: str     # the computation that holds it
    result_bytes: int    # bytes of its result (summed over a tuple's elements)
    element_bytes: tuple  # bytes of each result element (one for an array result)
    group: int           # devices in its replica group (2 for a collective-permute)
    groups: tuple        # its replica groups (`replica_groups`); () for a collective-permute
    moved: int           # bytes a device moves per execution (see the module docstring)
    in_loop: bool        # inside a while loop's body or condition
    trips: int           # executions per run of the program (product of known trip counts)
    op_name: str         # the metadata's op_name
    sources: tuple       # one op_name per result element (a combined op), else (op_name,)

    @property
    def per_step(self) -> int:
        return self.moved * self.trips


def array_bytes(text: str) -> list[int]:
    """Bytes of each array type in `text`, in order ("f32[2,3]" -> 24; "(f32[], s32[4])" -> [4, 16])."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * DTYPE_BYTES[dtype])
    return out


def replica_groups(attrs: str) -> tuple:
    """The replica groups of an op's attributes, as sorted tuples of device ids: the listed form
    {{0,1},{2,3}} or the iota form [groups,size]<=[dims]T(perm) (the ids 0..n-1 laid out as
    dims, transposed by perm, read in rows of `size`). () when it has none."""
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        ids = np.arange(int(np.prod([int(d) for d in m.group(3).split(",")]))).reshape(
            [int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return tuple(tuple(sorted(int(x) for x in g)) for g in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        return tuple(tuple(sorted(int(x) for x in g.split(",") if x.strip()))
                     for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
    return ()


def _moved(kind: str, result: int, group: int, attrs: str) -> int:
    if kind == "collective-permute":
        return result if re.search(r"source_target_pairs=\{\{\d", attrs) else 0
    if group <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * (group - 1) * result // group
    if kind == "reduce-scatter":
        return (group - 1) * result
    return (group - 1) * result // group  # all-gather, all-to-all


def _split_sources(op_name: str, n: int) -> tuple:
    """prefix/(a:b:c)suffix -> (prefix/a suffix, ...) when it names n parts; else (op_name,)."""
    start = op_name.find("/(")
    if n <= 1 or start < 0:
        return (op_name,)
    depth, parts, cur = 0, [], ""
    for i in range(start + 2, len(op_name)):
        ch = op_name[i]
        if ch == ")" and depth == 0:  # the parenthesis that opened the list
            parts.append(cur)
            suffix = op_name[i + 1:]
            break
        if ch == ":" and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "(") - (ch == ")")
        cur += ch
    else:
        return (op_name,)
    if len(parts) != n:
        return (op_name,)
    return tuple(op_name[:start + 1] + p + suffix for p in parts)


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(1)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def collectives(hlo: str) -> list[Collective]:
    """Every collective of the optimized HLO text `hlo`, in the order they appear."""
    comps = _computations(hlo)
    # Who calls whom, and with what trip count: a while body or condition runs `trip` times per
    # execution of its caller (1 when XLA does not know it); any other called computation once.
    callers: dict[str, list[tuple[str, int, bool]]] = {}
    for comp, lines in comps.items():
        for line in lines:
            is_while = re.search(r"\swhile\(", line) is not None
            trip = int(_TRIP.search(line).group(1)) if is_while and _TRIP.search(line) else 1
            called = _CALLED.findall(line)
            for b in _BRANCHES.findall(line):
                called += [c.strip().lstrip("%") for c in b.split(",") if c.strip()]
            for callee in called:
                loop = is_while and re.search(rf"\b(?:body|condition)=%?{re.escape(callee)}\b", line) is not None
                callers.setdefault(callee, []).append((comp, trip if loop else 1, loop))

    memo: dict[str, tuple[int, bool]] = {}

    def context(comp: str, seen=()) -> tuple[int, bool]:
        """(executions per program run, inside a loop) of `comp` (the most over its callers)."""
        if comp in memo:
            return memo[comp]
        if comp in seen or comp not in callers:
            return 1, False
        trips, loop = 1, False
        for caller, trip, is_loop in callers[comp]:
            t, inside = context(caller, (*seen, comp))
            trips, loop = max(trips, t * trip), loop or inside or is_loop
        memo[comp] = (trips, loop)
        return memo[comp]

    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, rest = m.groups()
            op = re.search(r"\s(" + "|".join(KINDS) + r")(-start)?\(", " " + rest)
            if not op:
                continue
            result_type = rest[:op.start()]
            sizes = array_bytes(result_type)
            if op.group(2):  # async start: (operands..., results...) tuples; count the results' half
                sizes = sizes[len(sizes) // 2:] if len(sizes) > 1 else sizes
            kind = op.group(1)
            attrs = rest[op.end():]
            groups = () if kind == "collective-permute" else replica_groups(attrs)
            group = 2 if kind == "collective-permute" else max((len(g) for g in groups), default=1)
            result = sum(sizes)
            name_meta = re.search(r'op_name="([^"]*)"', attrs)
            op_name = name_meta.group(1) if name_meta else ""
            trips, loop = context(comp)
            found.append(Collective(name, kind, comp, result, tuple(sizes), group, groups,
                                    _moved(kind, result, group, attrs), loop, trips, op_name,
                                    _split_sources(op_name, len(sizes))))
    return found


def loop_all_reduces(hlo: str, allowed_groups=()) -> list[Collective]:
    """The all-reduces over more than one device that run inside a while loop, except those whose
    replica groups are exactly `allowed_groups` (e.g. a mesh axis whose psum belongs in the loop)."""
    allowed = set(map(tuple, map(sorted, allowed_groups)))
    return [c for c in collectives(hlo) if c.kind == "all-reduce" and c.in_loop and c.group > 1
            and not (allowed and set(c.groups) == allowed)]

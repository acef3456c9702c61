"""The matrix's vocabulary: a `Point` (what an implementation runs) and an `Entry` (what is
judged at it), and the dtypes they name. Every room reads them; which points a run holds is
harness.problems.matrix.
"""

from __future__ import annotations

import dataclasses

from .outputs import kind_of

DTYPES = ("float32", "bfloat16", "float16", "float64")


def mesh_text(mesh: tuple[int, int, int]) -> str:
    """A mesh (data, seq, model) as `DxSxM`, e.g. `2x2x2`."""
    return "x".join(map(str, mesh))


@dataclasses.dataclass(frozen=True, order=True)
class Point:
    """What an implementation runs: one problem at one dtype with its run-time knobs
    (indexer chunk, teacher chunk, query chunk (0 = all rows), and for sharded
    runs the mesh (data, seq, model): batch rows, token rows and heads split over that many
    devices each). One compiled program computes every mode and quantity of a point."""

    case: str
    dtype: str
    ichunk: int = 0
    tchunk: int = 0
    qchunk: int = 0
    mesh: tuple[int, int, int] | None = None
    # The teacher of the loss (SPEC section 8): "joint" (DeepSeek-V4's attention) or "compressed".
    teacher: str = "joint"
    # jax_impl's scoring code (config `scoring_backend`): "xla", or "pallas" (the Pallas kernels
    # for the scores and the teacher; interpret mode off TPU). Only the JAX implementation reads it
    # (BACKEND_SAMPLE).
    backend: str = "xla"

    @property
    def chunked(self) -> bool:
        return bool(self.ichunk or self.tchunk or self.qchunk)

    @property
    def native(self) -> "Point | None":
        """What this point's outputs must reproduce up to summation order (the `chunk`
        checks): a sharded point, the same knobs on one device; a chunked point, the same
        problem with no chunking at all; a native single-device point, nothing."""
        if self.mesh is not None:
            return dataclasses.replace(self, mesh=None)
        if self.backend != "xla":  # the kernel against the XLA path at the same knobs
            return dataclasses.replace(self, backend="xla")
        return dataclasses.replace(self, ichunk=0, tchunk=0, qchunk=0) if self.chunked else None

    @property
    def label(self) -> str:
        q = f" qchunk={self.qchunk}" if self.qchunk else ""
        mesh = f" mesh={mesh_text(self.mesh)}" if self.mesh else ""
        teacher = f" teacher={self.teacher}" if self.teacher != "joint" else ""
        backend = f" backend={self.backend}" if self.backend != "xla" else ""
        return f"{self.case} {self.dtype} ichunk={self.ichunk} tchunk={self.tchunk}{q}{mesh}{teacher}{backend}"

    def spec(self) -> str:
        """`case:dtype:ichunk:tchunk[:qchunk[:teacher[:backend[:DxSxM]]]]` (a command-line form;
        see `parse`)."""
        pallas, mesh = self.backend != "xla", self.mesh is not None
        tail = [str(self.qchunk)] if self.qchunk or self.teacher != "joint" or pallas or mesh else []
        tail += [self.teacher] if self.teacher != "joint" or pallas or mesh else []
        tail += [self.backend] if pallas or mesh else []
        tail += [mesh_text(self.mesh)] if mesh else []
        return ":".join([self.case, self.dtype, str(self.ichunk), str(self.tchunk), *tail])

    @classmethod
    def parse(cls, text: str) -> "Point":
        fields = text.split(":")
        form = "case:dtype:ichunk:tchunk[:qchunk[:teacher[:backend[:DxSxM]]]]"
        if len(fields) not in (4, 5, 6, 7, 8):
            raise ValueError(f"point {text!r} must be {form}")
        case, dtype, ichunk, tchunk, *rest = fields
        mesh = None
        if len(rest) > 3:
            sizes = rest[3].split("x")
            if len(sizes) != 3 or not all(x.isdigit() and int(x) >= 1 for x in sizes):
                raise ValueError(f"point {text!r}: mesh {rest[3]!r} must be DATAxSEQxMODEL, three sizes >= 1 ({form})")
            mesh = tuple(int(x) for x in sizes)
        return cls(case, dtype, int(ichunk), int(tchunk), int(rest[0]) if rest else 0, mesh=mesh,
                   teacher=rest[1] if len(rest) > 1 else "joint", backend=rest[2] if len(rest) > 2 else "xla")


@dataclasses.dataclass(frozen=True, order=True)
class Entry:
    """One matrix entry: an implementation's `quantity` at `point` in `mode`
    (forward | dense | sparse, harness.outputs.MODES)."""

    point: Point
    mode: str
    quantity: str
    impl: str = "jax"

    @property
    def id(self) -> str:
        p = self.point
        impl = "" if self.impl == "jax" else f"{self.impl}-"
        q = f"-qchunk{p.qchunk}" if p.qchunk else ""
        mesh = f"-mesh{mesh_text(p.mesh)}" if p.mesh else ""
        teacher = f"-{p.teacher}" if p.teacher != "joint" else ""
        backend = f"-{p.backend}" if p.backend != "xla" else ""
        return (f"{impl}{p.case}-{p.dtype}-ichunk{p.ichunk}-tchunk{p.tchunk}{q}{mesh}{teacher}{backend}-{self.mode}-"
                f"{self.quantity}")

    @property
    def kind(self) -> str:
        """forward | topk | loss | grad | isolation | codes (harness.outputs.kind_of)."""
        return kind_of(self.quantity)

    @property
    def label(self) -> str:
        impl = "" if self.impl == "jax" else f" impl={self.impl}"
        return f"{self.point.label} {self.mode}{impl}"

    @property
    def group(self) -> str:
        """Entries sharing compiled programs and torch results (one xdist worker each)."""
        return f"{self.impl}-{self.point.case}-{self.point.dtype}"

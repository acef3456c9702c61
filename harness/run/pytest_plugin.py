"""The parity matrix as pytest tests: the plugin an installed csa-parity registers (entry point
`pytest11`: `csa_parity`), and the machinery tests/test_parity_matrix.py runs the project's own
matrix with.

Off unless asked: a pytest run without `--csa-parity-impl` collects, configures and imports
nothing more than this module (no JAX, no torch), and leaves the environment as it found it.
Asked, in any repository:

    pytest --csa-parity-impl=mypkg.kernel [--csa-parity-cases=tiny,small] [--csa-parity-dtypes=...]
           [--csa-parity-sample=default|ci|full|tpu] [--csa-parity-reference=live|goldens]
           [--csa-parity-precision=highest|default] [--csa-parity-backends=xla,pallas]
           [--csa-parity-fixtures=DIR] [-n auto] [--junitxml=...]

it adds one test per matrix entry of that implementation, the entries `csa-parity run --impl`
judges (a stage plug-in's: its stage at the native points), beside the repository's own tests:
node ids `csa-parity::test_parity[<entry id>]`, the entry ids and marks of the project's matrix
(`matrix`, the entry's kind, `chunked`, and the `xdist_group` of its case and dtype, so that
`-n` runs each point's entries in one worker: `--dist loadgroup` is set when `-n` is given and
no other distribution is). A failed or errored entry fails with the judge's messages and the
`csa-parity run` command that reruns its point; an entry wholly not provided or not applicable
skips with its reason; passed and excused pass. `--impl` imports the module from the current
directory first, as the CLI does.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

import harness

# harness/__init__ pins torch's CPU kernels in the environment (harness.CPU_PINS). pytest loads
# plugins before any conftest or test module, so when this module is the first of the harness
# to be imported, the pins are its import's alone: they are taken back until a matrix is asked for
# (pytest_configure), so that a plugin left off changes nothing in the user's test processes.
if set(m for m in sys.modules if m.startswith("harness.")) <= {"harness.run", __name__}:
    for _name in harness.PINNED_AT_IMPORT:
        os.environ.pop(_name, None)


@dataclasses.dataclass(frozen=True)
class MatrixOptions:
    """What a matrix under pytest runs: the implementation, the slice of the matrix, and what
    it is judged against (the CLI's options of the same names)."""

    impl: str = "jax"
    sample: str = "default"
    cases: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    backends: tuple[str, ...] = ("xla",)
    reference: str = "live"
    precision: str = "highest"
    fixtures: str | None = None

    @classmethod
    def from_env(cls, **fixed) -> "MatrixOptions":
        """The project's own matrix (tests/test_parity_matrix.py): CSA_PARITY_REFERENCE,
        CSA_PARITY_PRECISION, CSA_PARITY_SAMPLE and CSA_PARITY_FIXTURES, then `fixed`."""
        env = os.environ.get
        return cls(**{"reference": env("CSA_PARITY_REFERENCE", "live"), "precision": env("CSA_PARITY_PRECISION", "highest"),
                      "sample": env("CSA_PARITY_SAMPLE", "default"), "fixtures": env("CSA_PARITY_FIXTURES") or None,
                      **fixed})

    def validate(self) -> None:
        """The options' own rules; ValueError naming the option, its value and the valid ones."""
        from ..problems.matrix import SAMPLES

        for name, value, valid in (("sample", self.sample, SAMPLES), ("reference", self.reference, ("live", "goldens")),
                                   ("precision", self.precision, ("highest", "default"))):
            if value not in valid:
                raise ValueError(f"{name}={value!r} is not supported (valid: {', '.join(valid)})")


def matrix_entries(options: MatrixOptions) -> list:
    """The entries `csa-parity run` would judge with these options (harness.problems.matrix;
    a stage plug-in's at the native points, as the CLI selects them)."""
    from ..problems.cases import get_case
    from ..problems.matrix import build_matrix
    from .cli import stage_entries

    options.validate()
    for name in options.cases or ():
        get_case(name)
    entries = build_matrix(options.cases, options.dtypes, impl=options.impl, sample=options.sample,
                           backends=options.backends)
    return stage_entries(entries, options.impl)


def entry_marks(entry) -> list:
    """An entry's marks: `matrix`, its kind (forward, topk, loss, grad, isolation, codes),
    `chunked` at a nonzero chunk, and the xdist group of its case and dtype."""
    marks = [pytest.mark.matrix, pytest.mark.xdist_group(entry.group), getattr(pytest.mark, entry.kind)]
    if entry.point.chunked:
        marks.append(pytest.mark.chunked)
    return marks


def matrix_params(options: MatrixOptions) -> list:
    """The entries as `pytest.param`s (id: the entry's id), for `@pytest.mark.parametrize("entry", ...)`."""
    return [pytest.param(e, id=e.id, marks=entry_marks(e)) for e in matrix_entries(options)]


def check_entry(entry, options: MatrixOptions) -> None:
    """One entry: collect the implementation's and the reference's outputs at its point, judge
    them; fail with the judge's messages and the rerun command, skip an entry wholly not
    provided or not applicable."""
    from ..judging.judge import judge
    from ..outputs import NOT_APPLICABLE, NOT_PROVIDED
    from .collect import collect, policy
    from .report import failure_text

    outputs, references = collect(entry, options.reference)
    results = judge(entry, outputs, references, policy(options.precision))
    if any(r.failed for r in results):
        pytest.fail(failure_text(entry, results, options.reference, options.precision, options.fixtures),
                    pytrace=False)
    unjudged = [r.message for r in results if r.status in (NOT_PROVIDED, NOT_APPLICABLE)]
    if unjudged and len(unjudged) == len(results):
        pytest.skip("; ".join(unjudged))


def prepare_jax(precision: str) -> None:
    """What a process that judges needs before JAX computes: 64-bit mode (the float64 oracle) and
    the matmul precision the tolerance profile assumes."""
    os.environ.setdefault("JAX_ENABLE_X64", "1")
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", precision)


# --------------------------------------------------------------------------- the plugin

MARKERS = {
    "matrix": "the parity matrix",
    "forward": "matrix entries of compressed keys and index scores",
    "topk": "matrix entries of top-k selections",
    "loss": "matrix entries of the loss",
    "grad": "matrix entries of the six parameter gradients",
    "isolation": "matrix entries asserting zero input gradients",
    "codes": "matrix entries of the quantizer's codes and scales",
    "chunked": "matrix entries at a nonzero indexer or teacher chunk",
}


def _csv(text: str | None) -> tuple[str, ...] | None:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else None


def pytest_addoption(parser):
    group = parser.getgroup("csa-parity", "the csa-parity matrix over an implementation (off unless --csa-parity-impl)")
    group.addoption("--csa-parity-impl", metavar="MODULE[:FACTORY]",
                    help="collect the parity matrix over this implementation: 'jax' or a plug-in module "
                         "(imported from the current directory first), as `csa-parity run --impl`")
    group.addoption("--csa-parity-cases", metavar="NAMES", help="comma-separated case names (default: all)")
    group.addoption("--csa-parity-dtypes", metavar="NAMES", help="float32,bfloat16,float16,float64 (default: all)")
    group.addoption("--csa-parity-sample", default="default", metavar="NAME",
                    help="which chunk points: default, ci, full or tpu (harness/problems/matrix.py)")
    group.addoption("--csa-parity-backends", default="xla", metavar="NAMES", help="xla,pallas (default: xla)")
    group.addoption("--csa-parity-reference", default="live", metavar="NAME",
                    help="live (torch_ref: the reference extra) or goldens (the fixtures' goldens, no torch)")
    group.addoption("--csa-parity-precision", default="highest", metavar="NAME",
                    help="JAX's matmul precision and the tolerance profile judged with: highest or default")
    group.addoption("--csa-parity-fixtures", metavar="DIR",
                    help="the fixture set (default: the installed package's own, or a clone's fixtures/)")


def _options(config) -> MatrixOptions | None:
    impl = config.getoption("csa_parity_impl", None)
    if not impl:
        return None
    fixtures = config.getoption("csa_parity_fixtures")
    return MatrixOptions(impl=impl, sample=config.getoption("csa_parity_sample"),
                         cases=_csv(config.getoption("csa_parity_cases")),
                         dtypes=_csv(config.getoption("csa_parity_dtypes")),
                         backends=_csv(config.getoption("csa_parity_backends")) or ("xla",),
                         reference=config.getoption("csa_parity_reference"),
                         precision=config.getoption("csa_parity_precision"),
                         fixtures=os.path.abspath(fixtures) if fixtures else None)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-n` with no distribution named: --dist loadgroup, so each point's entries share a worker."""
    if _options(config) is not None and getattr(config.option, "numprocesses", None) \
            and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"


def pytest_configure(config):
    options = _options(config)
    if options is None:
        return
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    try:
        options.validate()
    except ValueError as exc:
        raise pytest.UsageError(f"--csa-parity-{exc}") from None
    if options.fixtures is not None:
        from ..package_data import FIXTURES_ENV

        if not os.path.isdir(options.fixtures):
            raise pytest.UsageError(f"--csa-parity-fixtures={options.fixtures!r} is not a directory")
        os.environ[FIXTURES_ENV] = options.fixtures
    harness.pin_cpu_kernels()
    config.stash[_OPTIONS] = options


_OPTIONS = pytest.StashKey[MatrixOptions]()


class ParityMatrix(pytest.Collector):
    """The matrix of one implementation: the parent of its entries' items (node id `csa-parity`)."""

    def collect(self):
        return []  # its items are made by pytest_collection_modifyitems, which knows the options


class ParityEntry(pytest.Item):
    """One matrix entry (`csa-parity::test_parity[<entry id>]`)."""

    def __init__(self, *, entry, options: MatrixOptions, **kwargs):
        super().__init__(**kwargs)
        self.entry, self.options = entry, options
        for mark in entry_marks(entry):
            self.add_marker(mark)

    def setup(self) -> None:
        prepare_jax(self.options.precision)  # in the process that runs entries (not xdist's controller)

    def runtest(self) -> None:
        check_entry(self.entry, self.options)

    def reportinfo(self):
        return self.path, None, self.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """The matrix's entries join the collected tests before -k / -m select and xdist groups them."""
    options = config.stash.get(_OPTIONS, None)
    if options is None:
        return
    try:
        entries = matrix_entries(options)
    except ValueError as exc:  # an unknown case, a plug-in that cannot be imported, ...
        raise pytest.UsageError(f"csa-parity: {exc}") from None
    parent = ParityMatrix.from_parent(session, name="csa-parity", nodeid="csa-parity")
    added = [ParityEntry.from_parent(parent, name=f"test_parity[{e.id}]", entry=e, options=options) for e in entries]
    # reported as collected (the terminal's `collected N items` and its selected and deselected counts)
    session.ihook.pytest_collectreport(report=pytest.CollectReport(parent.nodeid, "passed", None, added))
    items.extend(added)

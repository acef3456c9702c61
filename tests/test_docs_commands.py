"""Every command that README.md and docs/ show, as a new user types it: from the repository
root, in a fresh process, with no PYTHONPATH and the venv's bin/ first on PATH (what `source
.venv/bin/activate` leaves).

A command is a line of a ```bash block, a `$ ` line of any block (the lines under it are its
output), or an inline code span that starts with `csa-parity`, `python`, `pytest` or `make` and
has an argument. Each one found is in HOW, which says how it runs here, cheaply enough for CI:

- `run`: exactly as written; the exit code is checked, and a `$ ` line's output is the
  output printed under it in the page;
- `list`: as written plus `--list`, the flag the docs give for sizing a run (it validates
  every option, imports the plug-in from the current directory, loads every selected fixture
  and builds the selection, and computes nothing);
- `help`: a command CI cannot afford or must not run (a benchmark, the mutation self-test, the
  suite itself, a rewrite of the committed fixtures, a TPU, a placeholder such as NAME): its
  program must start from the repository root and list in its --help every option the command
  shows (all such programs in one process, as `python -m` and `python script` would load them);
  a pytest selection's paths must exist and its markers be registered;
- `make`: `make -n TARGET` (the target exists; what its recipe runs is in the table too);
- `pip`: an install from the package registry: the constraints file and extras it names exist.

A command in the pages that HOW does not classify, or one HOW lists that no page shows any
more, fails the test: a new command is classified when it is written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.torch

RUN, LIST, HELP, MAKE, PIP = "run", "list", "help", "make", "pip"
HOW = {
    # csa-parity run: the kernel commands, the samples, the options of docs/running.md
    "csa-parity run": LIST,
    "csa-parity run --list": RUN,
    "csa-parity run --list --cases tiny --dtypes float32": RUN,
    "csa-parity run --list --full": RUN,
    "csa-parity run --cases small --dtypes bfloat16 --ichunks 0,2 --out reports/": LIST,
    "csa-parity run --cases small --dtypes float32,bfloat16": LIST,
    "csa-parity run --cases small,packed --dtypes bfloat16 --ichunks 0,1,2 --out reports/": LIST,
    "csa-parity run --impl examples.pallas_scores --cases tiny,small --dtypes float32,bfloat16": LIST,
    "csa-parity run --impl examples.scores_kernel --cases tiny": LIST,
    "csa-parity run --jobs 2 --timeout 120": LIST,
    "csa-parity run --max-memory 8GiB": LIST,
    "csa-parity run --precision default": LIST,
    "csa-parity run --reference goldens": LIST,
    "csa-parity run --sample ci": LIST,
    "csa-parity run --teachers compressed": LIST,
    "csa-parity --version": RUN,
    # an installed package's commands, in the user's own directory (tests/test_installed.py runs them there)
    "csa-parity run --impl mykernel --cases tiny": HELP,
    "csa-parity run --fixtures my_fixtures --cases tiny": HELP,
    "csa-parity regenerate --fixtures-dir my_fixtures --case tiny": HELP,
    "csa-parity regenerate --fixtures-dir DIR": HELP,
    "csa-parity regenerate --fixtures-dir DIR [--case NAME] [--check]": HELP,
    "csa-parity regenerate": HELP,
    "csa-parity fixtures": HELP,
    "csa-parity run --fixtures DIR": HELP,
    "csa-parity run --impl mykernel": HELP,
    "pytest --csa-parity-impl=mykernel --csa-parity-cases=tiny -n 2": HELP,
    "csa-parity run --cache-dir /tmp/c": LIST,
    "csa-parity run --profile": LIST,
    "csa-parity run --sample default --reference goldens --dtypes float32,bfloat16,float16 "
    "--cases quant_v4,quant_packed --jobs 1": LIST,
    "csa-parity run --sample tpu --jobs 1": LIST,
    "csa-parity run --sample tpu --reference goldens": LIST,
    "csa-parity run --sample tpu --reference goldens --precision default": LIST,
    "csa-parity run --sample tpu --reference goldens --backends xla,pallas": LIST,
    "csa-parity run --sample tpu --reference goldens --backends xla,pallas --precision default": LIST,
    "csa-parity run --sample tpu --backends xla,pallas": LIST,
    "csa-parity run --sample tpu --reference goldens --backends pallas --precision highest --jobs 1": LIST,
    "PYTHONPATH=tests csa-parity run --cases tiny --dtypes float32 --ichunks 0,2 --tchunks 0 --qchunks 0 "
    "--modes forward --impl plugins.wrong_at_one_point:make_impl": LIST,
    "PYTHONPATH=tests csa-parity run --impl plugins.quantizer_stage --cases quant_planted,quant_v4": LIST,
    # placeholders
    "csa-parity run --impl mypkg.kernels:make_impl": HELP,
    "csa-parity run --impl package.module[:factory] [--cases ...]": HELP,
    "csa-parity run --list [--sample ci|default|full]": HELP,
    "csa-parity run --sample ci|default|full|tpu": HELP,
    # cheap programs
    "python -m harness.run.platform_table": RUN,
    "python -m benchmarks.context_parallel --reprint": RUN,
    "python -c 'import harness.problems.cases as c; print(list(c.CASES))'": RUN,
    # benchmarks, self-tests, long runs, a TPU, the fixtures' rewrite, placeholders
    "python -c 'from harness.problems.matrix import build_matrix; ...'": HELP,
    "python -m harness.run.platform_table [--backend tpu]": HELP,
    "python -m benchmarks.context_parallel": HELP,
    "python -m benchmarks.context_parallel --quick": HELP,
    "python -m benchmarks.memory_speed": HELP,
    "python -m benchmarks.memory_speed --query-only": HELP,
    "python -m benchmarks.memory_speed --quick": HELP,
    "python -m benchmarks.memory_speed --s 8192 --no-time": HELP,
    "python -m benchmarks.memory_speed --window-only": HELP,
    "python -m benchmarks.teacher_gap": HELP,
    "python -m benchmarks.forward_forms": HELP,
    "python -m benchmarks.forward_forms base:512x256u16 mxa:512x256u16 mxb:512x256g16 mxa:512x256u64 "
    "base:512x256u64": HELP,
    "python -m benchmarks.tpu_speed": HELP,
    "python -m benchmarks.tpu_profile": HELP,
    "python -m benchmarks.tpu_speed --only stage --seqs 8192 --variants 256x256u16,256x256u64,512x256u8,512x256u16":
        HELP,
    "python -m benchmarks.tpu_speed --seqs 8192 --variants 256x256u8": HELP,
    "python -m benchmarks.quant_gap": HELP,
    "python -m benchmarks.quant_gap --memory-only": HELP,
    "python -m harness.selftest.judge_mutations": HELP,
    "python -m harness.selftest.judge_mutations --only NAME": HELP,
    "python -m harness.selftest.mutations": HELP,
    "python -m harness.selftest.mutations --only NAME": HELP,
    "python -m harness.selftest.mutations --dtype float32": HELP,
    "python -m harness.selftest.mutations --length": HELP,
    "csa-parity run --sample long": HELP,
    "csa-parity run --sample million": HELP,
    "python -m benchmarks.forward_rows": HELP,
    "python scripts/measure_platform_profile.py --write --no-cache": HELP,
    "python -m harness.run.multihost --judge /shared/mh": HELP,
    "python -m harness.run.multihost --judge /tmp/mh": HELP,
    "python -m harness.run.multihost --judge DIR": HELP,
    "python -m harness.run.multihost --local 2 --devices-per-process 4 --out /tmp/mh --point "
    "packed_edges:float64:0:0:0:joint:xla:1x8x1 --point packed_edges:float32:1:1:3:joint:xla:1x4x2": HELP,
    "python -m harness.run.multihost --out /shared/mh --point packed_edges:float32:0:0:0:joint:xla:1x16x1": HELP,
    "python -m harness.run.multihost --out DIR --point SPEC": HELP,
    "python -m harness.problems.random_configs --repro '<json>'": HELP,
    "python examples/train_indexer.py": HELP,
    "python scripts/figures.py": HELP,
    "python scripts/measure_isa_variants.py": HELP,
    "python scripts/measure_tolerances.py [--quick]": HELP,
    "python scripts/measure_tolerances.py": HELP,
    "python scripts/regenerate_fixtures.py": HELP,
    "python scripts/regenerate_fixtures.py --case NAME": HELP,
    "python scripts/regenerate_fixtures.py --check": HELP,
    "python scripts/regenerate_fixtures.py [--case NAME]": HELP,
    # selections of this suite
    "pytest -m \"grad and chunked\" -k small-bfloat16": HELP,
    "pytest tests/sharded -n 0 -m sharded": HELP,
    "pytest tests/test_judge_mutations.py": HELP,
    "pytest tests/test_judge_rules.py": HELP,
    "pytest tests/test_tolerance_boundaries.py": HELP,
    "HYPOTHESIS_PROFILE=nightly pytest tests/test_random_configs.py": HELP,
    "python -m pytest tests/multihost -n 0 -m multihost": HELP,
    # make targets
    "make bench": MAKE, "make bench-cp": MAKE, "make figures": MAKE, "make multihost": MAKE,
    "make parity": MAKE, "make test": MAKE, "make test312": MAKE, "make venv": MAKE, "make venv312": MAKE,
    # installs
    "pip install -c constraints.txt --extra-index-url https://download.pytorch.org/whl/cpu \"torch==2.13.0+cpu\"": PIP,
    "pip install -c constraints.txt -e '.[tpu]'": PIP,
    "pip wheel --no-deps -c constraints.txt -w dist .": PIP,
    "pip install -c constraints.txt \"dist/csa_parity-0.1.0-py3-none-any.whl[reference]\"": PIP,
}

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S+ )*(?:csa-parity|python|pytest|make) (?!-m$)\S")


def shown_commands() -> dict[str, list[str]]:
    """{command: the lines printed under it (a `$ ` line) or []}, from README.md and docs/."""
    found: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for m in FENCE.finditer(text):
            lang, lines = m.group(1), m.group(2).replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                if line.startswith("$ "):
                    found[line[2:].strip()] = lines[i + 1:]
                elif lang == "bash" and line.strip():
                    found.setdefault(" ".join(re.sub(r"\s+#\s.*$", "", line).split()), [])
        for m in re.finditer(r"`([^`]+)`", FENCE.sub("", text)):
            span = " ".join(m.group(1).split())
            if INLINE.match(span):
                found.setdefault(span, [])
    return found


SHOWN = shown_commands()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CSA_PARITY_FIXTURES")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env


def _bash(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)


def _options(command: str) -> list[str]:
    return [re.match(r"--[\w-]+", w).group() for w in shlex.split(command.replace("[", " ").replace("]", " "))
            if re.match(r"--\w", w)]


def test_every_command_shown_is_classified():
    assert SHOWN, "no command found in README.md and docs/"
    unknown, stale = sorted(set(SHOWN) - set(HOW)), sorted(set(HOW) - set(SHOWN))
    assert not unknown, f"commands the pages show that HOW does not say how to run: {unknown}"
    assert not stale, f"commands in HOW that no page shows any more: {stale}"


def test_the_commands_run_as_written():
    """`run` as written, `list` with --list appended: exit 0 from the repository root without
    PYTHONPATH; a `$ ` line prints what the page shows under it."""
    todo = [(c, c if how == RUN else f"{c} --list") for c, how in HOW.items() if how in (RUN, LIST)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda item: (item[0], item[1], _bash(item[1])), todo))
    failed = [f"{ran}\n  exit {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}"
              for _, ran, p in done if p.returncode != 0]
    assert not failed, "commands the docs show fail as typed:\n" + "\n".join(failed)
    for command, _, proc in done:
        if SHOWN.get(command):
            assert proc.stdout.splitlines() == SHOWN[command], (command, proc.stdout)


# One process loads each program as `python -m` / `python script.py` does and asks for its --help.
_HELP_PROBE = r"""
import contextlib, io, json, runpy, sys
out = {}
for kind, target in json.loads(sys.argv[1]):
    text = io.StringIO()
    sys.argv = [target, "--help"]
    path = list(sys.path)
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, __import__("os").path.dirname(target))
                runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    except Exception as exc:
        code, _ = 1, text.write(f"{type(exc).__name__}: {exc}")
    sys.path[:] = path
    out[target] = [code, text.getvalue()]
print(json.dumps(out))
"""


def _program(command: str) -> tuple[str, str] | None:
    """("module", name) of `python -m name ...`, ("script", path) of `python path ...`."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Z][A-Z0-9_]*=", words[0]):
        words = words[1:]
    if words[0] != "python" or words[1] == "-c":
        return None
    return ("module", words[2]) if words[1] == "-m" else ("script", words[1])


def test_the_commands_not_run_here_start_and_take_their_options():
    """Every `help` command's program loads from the repository root and its --help lists each
    option the command shows; a pytest selection's paths exist and its markers are registered."""
    helps = [c for c, how in HOW.items() if how == HELP]
    programs = sorted({p for c in helps if (p := _program(c)) and p[1] != "pytest"})
    probe = subprocess.run([sys.executable, "-c", _HELP_PROBE, json.dumps(programs)], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    texts = json.loads(probe.stdout.splitlines()[-1])
    cli, regen = _bash("csa-parity run --help"), _bash("csa-parity regenerate --help")
    assert cli.returncode == 0 and regen.returncode == 0, cli.stderr + regen.stderr
    assert "imported from the current directory first" in " ".join(cli.stdout.split()), cli.stdout
    markers = {m.split(":")[0] for m in
               tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    problems = []
    for command in helps:
        words = shlex.split(command.replace("[", " ").replace("]", " "))
        if "csa-parity" in words:
            text = regen.stdout if "regenerate" in words else cli.stdout
        elif "pytest" in words:
            paths = [w for w in words if w.startswith("tests")]
            problems += [f"{command}: {p} does not exist" for p in paths if not (ROOT / p).exists()]
            selection = words[words.index("pytest") + 1:]
            if "-m" in selection:
                used = set(re.findall(r"\w+", selection[selection.index("-m") + 1])) - {"and", "or", "not"}
                problems += [f"{command}: marker {m!r} is not registered" for m in used - markers]
            continue
        elif (program := _program(command)) is not None:
            code, text = texts[program[1]]
            if code != 0:
                problems.append(f"{command}: {program[1]} --help exited {code}: {text.strip()[-300:]}")
                continue
        else:  # python -c '...; ...': the names it imports
            module = re.search(r"from (\S+) import|import (\S+)", command)
            name = next(g for g in module.groups() if g)
            found = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, env=_env(),
                                   capture_output=True, text=True, timeout=120)
            if found.returncode:
                problems.append(f"{command}: {found.stderr.strip()[-300:]}")
            continue
        problems += [f"{command}: {o} is not an option ({text.splitlines()[0] if text else ''})"
                     for o in _options(command) if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]
    assert not problems, "\n".join(problems)


def test_the_make_targets_and_installs_exist():
    for command in [c for c, how in HOW.items() if how == MAKE]:
        proc = subprocess.run(["make", "-n", command.split()[1]], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, (command, proc.stderr)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for command in [c for c, how in HOW.items() if how == PIP]:
        words = shlex.split(command)
        assert (ROOT / words[words.index("-c") + 1]).exists(), command
        for spec in [w for w in words if w.startswith(".[")]:
            missing = set(spec[2:-1].split(",")) - set(extras)
            assert not missing, (command, missing)

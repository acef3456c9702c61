# One command each: `make parity` (the main job) and `make test` (the whole suite).
# Both create .venv from the pinned versions on first use and reuse it after.
# Two supported stacks, one constraints file each:
#   .venv    Python 3.11, constraints.txt: jax 0.10.2 + the torch reference (CPU build) -> everything
#   .venv312 Python 3.12, constraints-py312.txt: jax 0.12, NO torch -> JAX-only mode (goldens)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The 3.12 leg: the first Python 3.12 that runs, from PATH or pyenv's versions (a pyenv shim
# without a 3.12 selected does not count); override with PYTHON312=/path/to/python3.12.
PYTHON312 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$$p"; break; }; done)
VENV312 ?= .venv312
BIN312 := $(VENV312)/bin
STAMP312 := $(VENV312)/.installed

.PHONY: venv venv312 parity test test312 multihost check-fixtures regenerate-fixtures bench bench-cp clean

# pip byte-compiles what it installs (no --no-compile): with PYTHONDONTWRITEBYTECODE set, as in
# many containers, Python never writes a .pyc at import, so a venv without them compiles jax's and
# torch's sources again in every process (each worker, test subprocess, mutation worker).
# Measured on 2 shared cores (python -m benchmarks.startup, medians of 3): import jax 3.4 -> 1.2 s,
# import torch 3.7 -> 1.6 s, torch with deterministic algorithms 6.4 -> 2.9 s, a worker's start-up
# 4.6 -> 3.3 s; the .venv install took 23 -> 55 s wall, paid back by about ten processes.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,reference]'
	touch $(STAMP)

venv: $(STAMP)

$(STAMP312): pyproject.toml constraints-py312.txt
	@test -n "$(PYTHON312)" || { echo "make: no Python 3.12 found (PATH or pyenv): the jax 0.12 leg cannot run; install one or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	test -x $(BIN312)/python || $(PYTHON312) -m venv $(VENV312)
	$(BIN312)/python -m pip install -q --upgrade pip
	$(BIN312)/python -m pip install -q -c constraints-py312.txt -e '.[dev]'
	@! $(BIN312)/python -c "import torch" 2>/dev/null || { echo "make: torch is importable in $(VENV312), which must run without it" >&2; exit 1; }
	touch $(STAMP312)

venv312: $(STAMP312)

# The main job: the parity matrix on the committed fixtures; reports in reports/.
parity: $(STAMP)
	$(BIN)/csa-parity run

# The whole suite, in two processes side by side (each pytest one process). The main one: the
# tests on the ci sample of the matrix (SAMPLE=default or full for more; docs/matrix.md says
# what each holds), the matrix first. Beside it: crash isolation first (its ~40 s of waiting on
# timed-out workers fall while .ci/run's Python 3.12 leg shares that CPU), then
# the implementation's mutation self-test (its clean run, which executes matrix points the main
# process judges first, last in the side process: tests/conftest.py's LAST, so that it loads
# the programs that matrix compiled, sharing one compilation cache), the random configurations,
# the query-chunk tests (a process of their own: under xdist XLA:CPU's compiler segfaulted on
# query-blocked programs, once in each file; run alone, both pass), the fixtures' regeneration
# and --check, the installed wheel (tests/test_installed.py: a wheel built and installed into a
# venv outside the clone, run as a user runs it) and the training trajectories; then the sharded
# slice (8 simulated devices, set before JAX starts), all on the same sample as the main
# process; then the two-process slice (the sequence-sharded points across two processes of 4
# devices each, harness.run.multihost), which ends the side chain beside the main process's last
# tests. The quantizer's tests, the gradient checks and the caches run in the main process,
# which keeps the two about even with the 3.12 leg on the side CPU: in .ci/run on a 2-core AMD
# EPYC with its AVX512 flags hidden, the main process ended after 1460 s and the side chain
# (side process, sharded and two-process slices) after 1455 s, the 3.12 leg after 787 s.
# The side process's output is printed whole when both have ended; the target
# fails if either does. XDIST=0: on 2 cores two xdist workers were slower than one process
# (the ties/tiny/ragged slice: 172 s with -n 2, 134 s with -n 0), while two separate
# processes get through ~1.35x the work of one; XDIST=auto where there are more cores.
# --durations keeps where the time goes in the CI log.
SAMPLE ?= ci
XDIST ?= 0
# PIN (default: on where exactly 2 CPUs are allowed, taskset exists and XDIST=0; PIN=no turns it
# off): the main process runs on the first allowed CPU and the side process and the sharded slice
# on the second (taskset; every process a test starts inherits its CPU), the two-process slice
# unpinned (its processes keep deadlines). XLA sizes its compile and run threads by the CPUs a
# process may use: two processes that each spread over both CPUs beside a third (.ci/run's Python
# 3.12 leg) spend CPU time on threads that wait for one another. Measured on the 2-core machine,
# the ci sample alone (`csa-parity run --sample ci --reference goldens --jobs 1`): 436 s of CPU on
# one CPU, against 478 s spread over two beside a second such run. A process on one CPU
# multiplies matrices in one thread: 81 of the sample's 3151 checks (flash_dims, small and packed,
# float32 and float64) see other last bits than on two, all inside their bounds (as on any other
# count of cores).
ALLOWED_CPUS := $(shell python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)))' 2>/dev/null)
PIN ?= $(if $(and $(filter 2,$(words $(ALLOWED_CPUS))),$(filter 0,$(XDIST)),$(shell command -v taskset)),yes,no)
ON_MAIN_CPU := $(if $(filter yes,$(PIN)),taskset -c $(word 1,$(ALLOWED_CPUS)))
ON_SIDE_CPU := $(if $(filter yes,$(PIN)),taskset -c $(word 2,$(ALLOWED_CPUS)))
PIN_NOTE := $(if $(ON_MAIN_CPU),the main process on CPU $(word 1,$(ALLOWED_CPUS)) and the side process on CPU $(word 2,$(ALLOWED_CPUS)),every process on every allowed CPU)
SIDE_TESTS := tests/test_mutations.py tests/test_isolation.py tests/test_random_configs.py \
	tests/test_query_chunk.py tests/test_fixtures.py tests/test_installed.py tests/test_training.py
test: $(STAMP)
	@side=$$(mktemp); t0=$$(date +%s); cache=$$(mktemp -d); trap 'rm -rf "$$cache" "$$side"' EXIT; \
	export CSA_PARITY_CACHE_DIR=$$cache JAX_COMPILATION_CACHE_DIR=$$cache/xla JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 JAX_COMPILATION_CACHE_MAX_SIZE=4294967296; \
	{ CSA_PARITY_SAMPLE=$(SAMPLE) $(ON_SIDE_CPU) $(BIN)/python -m pytest $(SIDE_TESTS) -n 0 --durations=10 && \
	  CSA_PARITY_SAMPLE=$(SAMPLE) $(ON_SIDE_CPU) $(BIN)/python -m pytest tests/sharded -n 0 -m sharded --durations=5 && \
	  CSA_PARITY_SAMPLE=$(SAMPLE) $(BIN)/python -m pytest tests/multihost -n 0 -m multihost --durations=5; \
	  rc=$$?; echo "=== make test: the side process ended after $$(( $$(date +%s) - t0 )) s"; exit $$rc; } \
		>"$$side" 2>&1 & pid=$$!; \
	echo "=== make test: PIN=$(PIN): $(PIN_NOTE)"; \
	CSA_PARITY_SAMPLE=$(SAMPLE) $(ON_MAIN_CPU) $(BIN)/python -m pytest -n $(XDIST) --durations=25 \
		$(foreach f,$(SIDE_TESTS),--ignore=$(f)); main=$$?; \
	echo "=== make test: the main process ended after $$(( $$(date +%s) - t0 )) s"; \
	wait $$pid; rc=$$?; \
	echo "=== make test: crash isolation, mutation self-test, random configurations, query chunks, fixtures, the installed wheel, training, sharded and two-process slices (run beside the tests above)"; \
	cat "$$side"; rm -f "$$side"; \
	test $$main = 0 && test $$rc = 0

# The jax 0.12 leg (Python 3.12, no torch): the matrix's ci sample in float64 (the exact64
# checks, which any change of semantics in the newer XLA fails), 31 of its 105 programs, judged
# against the fixture goldens; then the tests whose subject is JAX's API: input validation and
# checkify, compiled memory, platforms, the layer under jit / grad / vmap /
# shard_map and NNX, the Pallas kernels, and the JAX-only CLI run. For .ci/run's 25 minutes the
# rest stays with `make test` (the pinned jax): the low-precision dtypes (bfloat16 here costs 21
# programs), the pure-Python tests (judge, comparisons, cases, the CLI's argument errors: one
# subprocess each; the layering, which reads our own imports), training and check_grads (whose
# float64 gradients the run above judges at 1e-12). `make test` runs the whole ci sample on the pinned jax; set
# SAMPLE312=default DTYPES312=float32,bfloat16,float16,float64 for the whole default matrix here.
# The quantized indexer (SPEC section 7a) runs in every dtype here as well: the planted
# boundaries (quant_planted, whose queries sit exactly on the quantizer's rounding midpoints and
# block maxima in every dtype), its ci points below float64 (QUANT312), since the codes are where
# a newer XLA's rounding would show first; the released preset (quant_v4) runs in the float64
# run above (its points below float64 here cost 8 programs, ~25 s of the leg).
# Tests that need torch skip (CSA_PARITY_NO_TORCH=1 says this leg has none on purpose; anywhere
# else a missing torch fails them).
SAMPLE312 ?= ci
DTYPES312 ?= float64
QUANT312 ?= quant_planted
TEST312_FILES := tests/test_bad_inputs.py tests/test_memory.py tests/test_platforms.py \
	tests/test_traceable.py tests/test_pallas.py tests/test_cli.py::test_jax_only_mode_needs_no_torch
# The Pallas kernels' per-dtype repeats (the teacher by the kernels and at partial tiles) run here in
# float32 only: float64 and bfloat16 cost ~55 s of this leg, and `make test` runs every dtype of them
# on the pinned jax. TEST312_SELECT= (empty) runs them all.
TEST312_SELECT ?= not ((teacher_by_the_kernels or partial_tiles) and (float64 or bfloat16))
# BESIDE=yes (.ci/run, which runs this leg beside `make test`): where PIN is on, the leg runs on
# the CPU `make test` gives its side process (its main process keeps the other to itself), as XLA
# sizes its threads by the CPUs a process may use.
BESIDE ?= no
ON_312_CPU := $(if $(filter yes,$(BESIDE)),$(ON_SIDE_CPU))
# One compilation cache for both steps: the CLI tests load the tiny programs the run compiled.
test312: $(STAMP312)
	@echo "=== make test312: $(if $(ON_312_CPU),on CPU $(word 2,$(ALLOWED_CPUS)) beside make test's side process,on every allowed CPU)"
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export CSA_PARITY_CACHE_DIR=$$cache JAX_COMPILATION_CACHE_DIR=$$cache/xla JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
		JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 JAX_COMPILATION_CACHE_MAX_SIZE=4294967296 && \
	$(ON_312_CPU) $(BIN312)/csa-parity run --reference goldens --sample $(SAMPLE312) --dtypes $(DTYPES312) --out reports-py312 \
		--no-progress && \
	$(ON_312_CPU) $(BIN312)/csa-parity run --reference goldens --sample $(SAMPLE312) --cases $(QUANT312) \
		--dtypes float32,bfloat16,float16 --out reports-py312-quant --no-progress && \
	CSA_PARITY_NO_TORCH=1 $(ON_312_CPU) $(BIN312)/python -m pytest -n $(XDIST) --durations=10 -k '$(TEST312_SELECT)' $(TEST312_FILES)

# The two-process slice alone (docs/multihost.md): two processes of 4 simulated CPU devices run
# the sequence-sharded points as one program, then the judge; about a minute on 2 cores.
multihost: $(STAMP)
	CSA_PARITY_SAMPLE=$(SAMPLE) $(BIN)/python -m pytest tests/multihost -n 0 -m multihost --durations=5

check-fixtures: $(STAMP)
	$(BIN)/python scripts/regenerate_fixtures.py --check

regenerate-fixtures: $(STAMP)
	$(BIN)/python scripts/regenerate_fixtures.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.memory_speed

# Context parallelism: per-device memory and communication of the sharded loss gradient at 128K
# and 1M tokens, compile-only on 64 simulated CPU devices (8 programs, a few minutes on 2 cores).
bench-cp: $(STAMP)
	$(BIN)/python -m benchmarks.context_parallel

# docs/FIGURES.md, the one page of figures that go stale (matrix sizes, line counts, benchmark
# results, the last parity report's headroom and times), and docs/judging.md's table of
# guarantees (every number of harness/judging/tolerance.py, its boundary test, its mutant), from cheap
# sources: a few seconds.
.PHONY: figures
figures: $(STAMP)
	$(BIN)/python scripts/figures.py

clean:
	rm -rf $(VENV) $(VENV312) reports reports-py312 reports-py312-quant .pytest_cache

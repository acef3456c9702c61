# One command each: `make parity` (the main job) and `make test` (the whole suite).
# Both create .venv from the pinned versions on first use and reuse it after.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv parity test check-fixtures regenerate-fixtures bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The main job: the parity matrix on the committed fixtures; reports in reports/.
parity: $(STAMP)
	$(BIN)/csa-parity run

# The whole suite: fixtures --check, the test matrix under xdist, then the sharded
# slice in its own process (it needs 8 simulated devices before JAX starts).
test: $(STAMP)
	$(BIN)/python scripts/regenerate_fixtures.py --check
	$(BIN)/python -m pytest -n auto
	$(BIN)/python -m pytest tests/sharded -n 0 -m sharded

check-fixtures: $(STAMP)
	$(BIN)/python scripts/regenerate_fixtures.py --check

regenerate-fixtures: $(STAMP)
	$(BIN)/python scripts/regenerate_fixtures.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.memory_speed

clean:
	rm -rf $(VENV) reports .pytest_cache

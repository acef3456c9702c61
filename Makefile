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
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(STAMP)

venv: $(STAMP)

parity: $(STAMP)
	$(BIN)/csa-parity run

test: $(STAMP)
	$(BIN)/python -m pytest -n auto

clean:
	rm -rf $(VENV) reports .pytest_cache

# `make demo`, `make test` and `make lint` each set up .venv on first use (CPU torch 2.13 unless torch is present).
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH ?= torch==2.13.0

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megadlms train

# two workers, one test file per worker at a time (a file's module fixtures are built once)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check megadlms tests benchmarks tools pretrain_difflm.py
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache

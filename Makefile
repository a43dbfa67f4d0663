# `make demo`, `make test` and `make lint` each set up .venv on first use (CPU torch 2.13 unless torch is present).
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH ?= torch==2.13.0

.PHONY: demo test lint clean

# the first run downloads torch and the dev tools (a few minutes): each step says what it does, pip shows its progress
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "make: creating the virtual environment $(VENV) (once)"; python3 -m venv $(VENV); }
	@$(PY) -c "import torch" 2>/dev/null || { echo "make: installing $(TORCH) into $(VENV) (once; a large download)"; \
		$(PY) -m pip install --progress-bar on "$(TORCH)"; }
	@echo "make: installing megadlms and its dev tools (pytest, ruff, mypy, transformers, triton) into $(VENV)"
	@$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)
	@echo "make: $(VENV) is ready"

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

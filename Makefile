# `make test` and `make serve` work on a fresh machine: they build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint serve clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the local CPU build: an unpinned `torch` pulls CUDA wheels.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check srt test bench
	$(PY) -m pytest -q test

lint: $(STAMP)
	$(PY) -m ruff check srt test bench

clean-venv:
	rm -rf $(VENV)

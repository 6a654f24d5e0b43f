# One command runs the main job (make demo), one runs the tests (make test). Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
# GPU users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" ...
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= runtime,pyinotify,metrics,dev
BIN := $(VENV)/bin
STAMP := $(VENV)/.ggufswap-installed

.PHONY: test demo bench fuzz soak lint typecheck clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/ggufswap
	ln -s $(CURDIR)/cli/* build/typecheck/ggufswap/
	for p in shards config ipc agent runtime; do ln -s $(CURDIR)/$$p build/typecheck/ggufswap/$$p; done
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/ggufswap demo

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

fuzz: $(STAMP)
	GGUFSWAP_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest -q -m "not slow" tests -k fuzz

# The 1,000-swap soak through real agent and runtime processes (make test runs 120 swaps).
soak: $(STAMP)
	GGUFSWAP_SOAK=1 $(BIN)/python -m pytest -q tests/test_soak.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

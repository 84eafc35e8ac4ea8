# Two commands from a fresh clone (Python >= 3.11 as python3):
#   make serve   - create and fill .venv if it is missing, then run the sidecar in
#                  front of the built-in simulator (Ctrl-C stops both)
#   make test    - the same set-up if missing, then `make lint`, then the whole suite
#                  (with the container tier's image build started first, beside them)
# Others:
#   make setup   - (re)install the project and its test extra into .venv; with a C
#                  compiler the core and the per-event shell are compiled (mypyc)
#   make lint    - ruff check + ruff format --check on the whole tree, mypy --strict
#                  on the product (tests/test_lint.py runs the same checks)
#   make pytest  - only the test suite
#   make test-loaded - the whole suite with every core kept busy beside it
#                  (scripts/cpu_hog.py): what a loaded CI machine does to timing
#   make native  - recompile after editing a compiled module (the import refuses a
#                  stale one); `make pure` removes them: the checkout runs as Python
#   make dev     - a pure-Python install for the edit-test loop (no rebuild after an
#                  edit); or keep the compiled one and run with OMNI_SIDECAR_PURE=1
# Arguments: `make serve ARGS="--max-sessions 8"`, `make pytest PYTEST_ARGS="-x tests/proxy"`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=
#: pytest-xdist workers for `make pytest`/`make test` (0: one process, no workers):
#: one more than the cores, at most 8. Tests spend about a third of their time
#: waiting on child processes, so a third worker fills it: on the 2-core CI machine
#: the suite took 356 s with two workers, 286 s with three, 288 s with four.
#: Work stealing: each worker starts on its slice of the suite and takes tests from
#: the longest queue when it runs out (xdist's default hands out whole chunks and once
#: left one worker idle for minutes while the other ran 400 integration tests).
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 1 < 8 ? n + 1 : 8 )))
PYTEST_DIST ?= worksteal
#: The suite starts hundreds of sidecar and simulator children, each importing the
#: checkout: with PYTHONDONTWRITEBYTECODE set (many container images set it) every
#: one compiled every module from source again, a third of a sidecar's start-up.
#: The test run writes its bytecode (__pycache__/ is ignored by git and the image build).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
#: Everything ruff checks and formats; keep in step with tests/test_lint.py.
LINT_PATHS := proxy engine_launcher metrics tests bench scripts
#: The product, type-checked with mypy --strict.
TYPED_PATHS := proxy engine_launcher metrics

.PHONY: help setup serve test test-steps test-loaded lint pytest bench native pure dev clean

help:
	@sed -n '1,/^PYTHON/p' Makefile | sed '$$d'

# The installed entry point marks a filled venv; it is built only when missing
# (run `make setup` to reinstall after changing dependencies).
$(BIN)/omni-sidecar:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test,stacks]'

setup:
	rm -f $(BIN)/omni-sidecar
	$(MAKE) $(BIN)/omni-sidecar

serve: $(BIN)/omni-sidecar
	$(BIN)/omni-sidecar serve $(ARGS)

# The whole suite (no PYTEST_ARGS) needs the container tier's image: its build starts
# first, beside the install, lint and suite (warm-during in
# tests/integration/container_image.py; a cold build is minutes of debootstrap and
# packages). Without podman, or with PYTEST_ARGS, the steps run alone.
test:
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PYTHON) -m tests.integration.container_image warm-during -- $(MAKE) test-steps
else
	$(MAKE) test-steps
endif

test-steps: $(BIN)/omni-sidecar
	$(MAKE) lint
	$(MAKE) pytest

lint: $(BIN)/omni-sidecar
	$(BIN)/python -m ruff check $(LINT_PATHS)
	$(BIN)/python -m ruff format --check $(LINT_PATHS)
	$(BIN)/python -m mypy --strict $(TYPED_PATHS)

pytest: $(BIN)/omni-sidecar
	$(PYTEST) -n $(PYTEST_WORKERS) --dist $(PYTEST_DIST) $(PYTEST_ARGS)

test-loaded: $(BIN)/omni-sidecar
	$(BIN)/python scripts/cpu_hog.py --seconds 3600 -- $(PYTEST) -n $(PYTEST_WORKERS) --dist $(PYTEST_DIST) $(PYTEST_ARGS)

bench: $(BIN)/omni-sidecar
	$(BIN)/python -m pip install -e '.[test,stacks,bench]'
	$(BIN)/python -m bench all

native: $(BIN)/omni-sidecar
	$(BIN)/python -m pip install --no-deps -e .

pure:
	find proxy \( -name '*.so' -o -name '*.pyd' \) -delete
	rm -f proxy/_native_sources.txt

# The development install: everything runs from its source, so an edit needs no
# rebuild. `make native` (or `make setup`) goes back to the compiled build.
dev:
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	OMNI_SIDECAR_PURE_BUILD=1 $(BIN)/python -m pip install -e '.[test,stacks]'
	$(MAKE) pure

# The heavier tier against the real vLLM-Omni serving layer (own venv per release, ~9 GB):
#   make test-real-engine [VLLM_OMNI=0.32.0rc1]
include mk/real-engine.mk

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info
	rm -rf build proxy/_native_sources.txt
	find proxy \( -name '*.so' -o -name '*.pyd' \) -delete

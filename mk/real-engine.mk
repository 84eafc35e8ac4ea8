# Optional heavy test tier: the real vLLM-Omni serving layer behind the sidecar.
#
#   make test-real-engine    build .venv-real once (vllm + vllm-omni + CUDA torch, ~7 GB),
#                            then run `pytest -m real_engine tests/real_engine`
#   make clean-real-engine   remove .venv-real
#
# Included from the top-level Makefile (`include mk/real-engine.mk`); it also
# runs on its own: `make -f mk/real-engine.mk test-real-engine`.
# The tests mount vLLM-Omni's own OmniDuplexSessionHandler (as its api_server
# does) over a stand-in engine, so no GPU and no model weights are needed; the
# CUDA builds of torch are what vllm 0.30.0 pins on PyPI.
PYTHON ?= python3
REAL_ENGINE_VENV ?= .venv-real
REAL_ENGINE_PIP_ARGS ?=
# `===` (exact string) rather than `==`: a local build such as torch 2.13.0+cpu in a
# find-links directory also satisfies `==2.13.0`, and pip prefers it, while
# torchvision 0.28.0 from PyPI is built against the CUDA torch (its ops fail to load).
REAL_ENGINE_PACKAGES ?= \
	vllm==0.30.0 \
	vllm-omni==0.30.0 \
	torch===2.13.0 \
	torchvision===0.28.0 \
	torchaudio===2.11.0

.PHONY: setup-real-engine test-real-engine clean-real-engine

# Wherever this file is included, it must not become the default goal.
_REAL_ENGINE_DEFAULT_GOAL := $(.DEFAULT_GOAL)

$(REAL_ENGINE_VENV)/.installed: pyproject.toml mk/real-engine.mk
	$(PYTHON) -m venv $(REAL_ENGINE_VENV)
	$(REAL_ENGINE_VENV)/bin/python -m pip install --upgrade pip
	$(REAL_ENGINE_VENV)/bin/python -m pip install $(REAL_ENGINE_PIP_ARGS) $(REAL_ENGINE_PACKAGES)
	$(REAL_ENGINE_VENV)/bin/python -m pip install $(REAL_ENGINE_PIP_ARGS) -e '.[test]'
	$(REAL_ENGINE_VENV)/bin/python -c "import vllm_omni.entrypoints.duplex.serving"
	touch $@

setup-real-engine: $(REAL_ENGINE_VENV)/.installed

test-real-engine: $(REAL_ENGINE_VENV)/.installed
	$(REAL_ENGINE_VENV)/bin/python -m pytest -m real_engine tests/real_engine

clean-real-engine:
	rm -rf $(REAL_ENGINE_VENV)

.DEFAULT_GOAL := $(_REAL_ENGINE_DEFAULT_GOAL)

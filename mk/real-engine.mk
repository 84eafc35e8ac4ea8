# Optional heavy test tier: the real vLLM-Omni serving layer behind the sidecar.
#
#   make test-real-engine                      vllm-omni 0.30.0 (the default)
#   make test-real-engine VLLM_OMNI=0.32.0rc1  the 0.32.0rc1 serving layer
#   make setup-real-engine [VLLM_OMNI=...]     only build the venv
#   make clean-real-engine [VLLM_OMNI=...]     remove that version's venv
#
# Each version gets its own venv, .venv-real-$(VLLM_OMNI) (vllm + vllm-omni +
# CUDA torch, ~9 GB each, built once; the project with its test and stacks extras:
# the voice stacks run against the real serving layer too), then runs
# `pytest -m real_engine tests/real_engine` in it. The tests read the installed
# vllm_omni.__version__ and assert what holds on that version.
#
# Included from the top-level Makefile (`include mk/real-engine.mk`); it also
# runs on its own: `make -f mk/real-engine.mk test-real-engine`.
# The tests mount vLLM-Omni's own OmniDuplexSessionHandler (as its api_server
# does) over a stand-in engine, so no GPU and no model weights are needed; the
# CUDA builds of torch are what vllm pins on PyPI.
PYTHON ?= python3
# Which vLLM-Omni release the tier runs against; a new one needs a
# REAL_ENGINE_PACKAGES_<version> line below.
VLLM_OMNI ?= 0.30.0
REAL_ENGINE_VENV ?= .venv-real-$(VLLM_OMNI)
REAL_ENGINE_PIP_ARGS ?=
# Per version: vllm-omni, the vllm release of the same major.minor (vllm-omni
# warns on a mismatch and patches vllm internals), and the torch builds that vllm
# pins (vllm 0.30.0 and 0.32.0 both pin torch 2.13.0 / torchvision 0.28.0 /
# torchaudio 2.11.0). vllm-omni 0.32.0rc1 is a pre-release: an exact `==` pin
# selects it without `--pre`, so its dependencies stay on final releases.
# `===` (exact string) rather than `==` for torch: a local build such as
# torch 2.13.0+cpu in a find-links directory also satisfies `==2.13.0`, and pip
# prefers it, while torchvision 0.28.0 from PyPI is built against the CUDA torch
# (its ops fail to load).
REAL_ENGINE_TORCH := torch===2.13.0 torchvision===0.28.0 torchaudio===2.11.0
REAL_ENGINE_PACKAGES_0.30.0 := vllm==0.30.0 vllm-omni==0.30.0 $(REAL_ENGINE_TORCH)
REAL_ENGINE_PACKAGES_0.32.0rc1 := vllm==0.32.0 vllm-omni==0.32.0rc1 $(REAL_ENGINE_TORCH)
REAL_ENGINE_PACKAGES ?= $(REAL_ENGINE_PACKAGES_$(VLLM_OMNI))

.PHONY: setup-real-engine test-real-engine clean-real-engine

# Wherever this file is included, it must not become the default goal.
_REAL_ENGINE_DEFAULT_GOAL := $(.DEFAULT_GOAL)

$(REAL_ENGINE_VENV)/.installed: pyproject.toml mk/real-engine.mk
	@test -n "$(REAL_ENGINE_PACKAGES)" || { echo "VLLM_OMNI=$(VLLM_OMNI): no REAL_ENGINE_PACKAGES_$(VLLM_OMNI) in mk/real-engine.mk (known: 0.30.0 0.32.0rc1)" >&2; exit 2; }
	$(PYTHON) -m venv $(REAL_ENGINE_VENV)
	$(REAL_ENGINE_VENV)/bin/python -m pip install --upgrade pip
	$(REAL_ENGINE_VENV)/bin/python -m pip install $(REAL_ENGINE_PIP_ARGS) $(REAL_ENGINE_PACKAGES)
	$(REAL_ENGINE_VENV)/bin/python -m pip install $(REAL_ENGINE_PIP_ARGS) -e '.[test,stacks]'
	$(REAL_ENGINE_VENV)/bin/python -c "import vllm_omni, vllm_omni.entrypoints.duplex.serving; assert vllm_omni.__version__ == '$(VLLM_OMNI)', vllm_omni.__version__"
	touch $@

setup-real-engine: $(REAL_ENGINE_VENV)/.installed

test-real-engine: $(REAL_ENGINE_VENV)/.installed
	$(REAL_ENGINE_VENV)/bin/python -m pytest -m real_engine tests/real_engine

clean-real-engine:
	rm -rf $(REAL_ENGINE_VENV)

.DEFAULT_GOAL := $(_REAL_ENGINE_DEFAULT_GOAL)

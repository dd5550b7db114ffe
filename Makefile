# Every target sets itself up on a fresh machine: a virtual environment in .venv, the CPU build of torch
# first (a bare range would pull a multi-GB CUDA build), then capserve with all its extras.
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU servers: make TORCH_SPEC=torch serve   (and install capserve[gpu] for onnxruntime-gpu)
TORCH_SPEC ?= torch==2.13.0
PORT ?= 3000

.PHONY: install test serve lint bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

serve: install
	cd $(CURDIR) && $(VENV)/bin/bentoml serve service:CapsuleService --host 0.0.0.0 --port $(PORT)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) benchmarks/bench_model.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Every target sets itself up on a fresh machine: a virtual environment in .venv, the CPU build of torch
# first, then capserve (editable) with its CPU extras.
# Afterwards `source .venv/bin/activate` puts `capserve` and `bentoml` on the PATH.
#
# torch comes from TORCH_INDEX, PyTorch's CPU index: from PyPI the same pin is a ~0.5 GB CUDA build that pulls
# CUDA toolkits and cuDNN. --index-url replaces PyPI for that one command only (the CPU index also serves torch's
# dependencies); wheels that pip's own configuration finds locally (find-links) still count. Overrides:
#   GPU training:         make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   your own mirror:      make install TORCH_INDEX=https://mirror.example/simple
#   offline / pip config: make install TORCH_INDEX=        (no index option: pip's configuration decides)
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INSTALL = "$(TORCH_SPEC)" $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX))
PORT ?= 3000

.PHONY: install install-gpu test serve lint bench bento bento-cpu clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INSTALL)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# NVIDIA GPU machines: capserve[gpu] alone (onnxruntime-gpu, CUDA 12 builds, instead of the CPU onnxruntime: the
# two must never be installed together), in its own environment .venv-gpu; `source .venv-gpu/bin/activate`.
install-gpu:
	python3 -m venv .venv-gpu
	.venv-gpu/bin/python -m pip install -q --upgrade pip
	.venv-gpu/bin/python -m pip install -q $(TORCH_INSTALL)
	.venv-gpu/bin/python -m pip install -q -e ".[gpu,train]" "pytest>=8" "httpx>=0.27"

test: install
	TORCH_INDEX="$(TORCH_INDEX)" $(PY) -m pytest -q

serve: install
	cd $(CURDIR) && $(VENV)/bin/capserve serve --host 0.0.0.0 --port $(PORT)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	$(PY) benchmarks/bench_model.py

# Bentos: the shipped models into BentoML's model store (a new version each time), then `bentoml build`
bento: install
	$(VENV)/bin/capserve export bentoml models/cifar10 --name capserve-cifar10
	$(VENV)/bin/capserve export bentoml models/multimnist --name capserve-multimnist
	$(VENV)/bin/bentoml build

bento-cpu: install
	$(VENV)/bin/capserve export bentoml models/cifar10 --name capserve-cifar10
	$(VENV)/bin/capserve export bentoml models/multimnist --name capserve-multimnist
	$(VENV)/bin/bentoml build -f bentofile-cpu.yaml

clean:
	rm -rf $(VENV) .venv-gpu build dist *.egg-info .pytest_cache .ruff_cache

# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv, install, train the tiny demo LoRA on CPU
#   make test   -- create .venv, install with test extras, run pytest
#
# TORCH_SPEC picks the torch build installed before everything else. The default
# is the CPU build that these CPU machines have locally; on a CUDA machine use
#   make demo TORCH_SPEC=torch   (or install your CUDA torch into .venv first).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m lowvram_lora demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) demo_output

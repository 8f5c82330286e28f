# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv, install, train the tiny demo LoRA on CPU
#   make test   -- create .venv, install with test extras, run pytest
#
# TORCH_SPEC picks the torch build installed before everything else (a torch already in
# .venv is kept). torch==2.13.0 resolves to the CPU wheel on these CPU machines (pip's
# find-links hold torch-2.13.0+cpu); from PyPI alone, Linux x86_64 gets a CUDA build.
# TORCH_PIP_ARGS passes extra pip arguments for that one install, e.g. PyTorch's CPU
# wheel index: make demo TORCH_SPEC=torch TORCH_PIP_ARGS="--index-url <PyTorch's CPU index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# PYTHONWARNINGS drops the notice setuptools prints on every editable install ("Editable installation.
# ... be careful with folders ... named like your package"); any other warning still shows.
$(VENV)/.installed: $(VENV)/bin/python pyproject.toml setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m lowvram_lora demo

test: $(VENV)/.installed
	$(PY) -m pytest -q  # testpaths: tests/ and each family folder's own tests

clean:
	rm -rf $(VENV) demo_output

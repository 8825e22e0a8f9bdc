# Quick start: `make parity` (the parity sweep on the default device) and `make test` (the tests).
# Both create the virtual environment in $(VENV) on first use.
PYTHON ?= python3
VENV ?= .venv
# The torch build to install first. torch 2.13.0 is the version CI tests with (a CPU wheel there);
# on a CUDA machine pass e.g. TORCH_SPEC=torch and JAX_EXTRA=cuda12.
TORCH_SPEC ?= torch==2.13.0
JAX_EXTRA ?=
EXTRAS = test$(if $(JAX_EXTRA),$(comma)$(JAX_EXTRA),)
comma := ,
BIN = $(VENV)/bin
STAMP = $(VENV)/.pallas-paged-installed

.PHONY: parity test bench clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

parity: $(STAMP)
	$(BIN)/python -m parity $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench $(ARGS)

clean-venv:
	rm -rf $(VENV)

# Quick start: `make parity` (the parity sweep on the default device) and `make test` (the tests).
# Both create the virtual environment in $(VENV) on first use.
#
# CI runs two lanes (see .ci/run), each in its own environment:
#   make test VENV=.venv-py311 PYTHON=python3.11 JAX_SPEC="jax==0.10.2 jaxlib==0.10.2"
#   make test VENV=.venv-py312 PYTHON=$(pyenv root)/versions/3.12.1/bin/python3 \
#             JAX_SPEC="jax==0.12.0.1 jaxlib==0.12.0.1"
PYTHON ?= python3
VENV ?= .venv
# The torch build to install first. torch 2.13.0 is the version CI tests with (a CPU wheel there);
# on a CUDA machine pass e.g. TORCH_SPEC=torch and JAX_EXTRA=cuda12.
TORCH_SPEC ?= torch==2.13.0
# Pins for jax/jaxlib (empty: the newest release pyproject.toml allows).
JAX_SPEC ?=
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
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" $(JAX_SPEC)
	touch $@

parity: $(STAMP)
	$(BIN)/python -m parity $(ARGS)

# The notebooks run as tests through nbmake; plain `python -m pytest` runs only tests/.
test: $(STAMP)
	$(BIN)/python -m pytest --nbmake $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench $(ARGS)

clean-venv:
	rm -rf $(VENV)

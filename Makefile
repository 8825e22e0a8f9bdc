# Quick start: `make parity` (the parity sweep on the default device) and `make test` (the tests).
# Each creates its virtual environment in $(VENV) on first use and installs what it needs:
#   make parity     the library alone (jax, torch, numpy, ml_dtypes)
#   make test       the quick suite, in parallel: every test not marked slow (a few minutes)
#   make test-all   every test, the slow interpret-mode grids and property runs included
#   make bench      the decode benchmark (python -m benchmarks.decode; GPU)
#
# CI (.ci/run) runs `make test` and `make test-all` in two lanes, each in its own environment:
#   make test VENV=.venv-py311 PYTHON=python3.11 JAX_SPEC="jax==0.10.2 jaxlib==0.10.2"
#   make test VENV=.venv-py312 PYTHON=$(pyenv root)/versions/3.12.1/bin/python3   (newest jax)
PYTHON ?= python3
VENV ?= .venv
# The torch build to install first. torch 2.13.0 is the version CI tests with (a CPU wheel there);
# on a CUDA machine pass e.g. TORCH_SPEC=torch and JAX_EXTRA=cuda12.
TORCH_SPEC ?= torch==2.13.0
# Pins for jax/jaxlib (empty: the newest release pyproject.toml allows).
JAX_SPEC ?=
JAX_EXTRA ?=
# pytest-xdist workers: one per CPU.
WORKERS ?= auto
# Seconds one test may run before pytest-timeout stops its worker and prints every thread's stack:
# a kernel that deadlocks in interpret mode fails its test instead of hanging the run.
TEST_TIMEOUT ?= 900
PYTEST = $(BIN)/python -m pytest -n $(WORKERS) --timeout=$(TEST_TIMEOUT) --timeout-method=thread
comma := ,
BIN = $(VENV)/bin
LIB_STAMP = $(VENV)/.pallas-paged-lib
TEST_STAMP = $(VENV)/.pallas-paged-test
# Installs survive a flaky network: a download cut off midway resumes (PIP_RESUME_RETRIES, which pip
# releases before 25.1 ignore), and an install that still fails is run again, three tries in all.
# (Where no local wheel exists, e.g. torch on Python 3.12, pip fetches GBs of CUDA wheels from PyPI.)
export PIP_RESUME_RETRIES ?= 20
PIP_INSTALL = $(BIN)/python -m pip install -q
retry = for try in 1 2 3; do $(1) && break; [ $$try -lt 3 ] || exit 1; \
	echo "install failed (try $$try of 3), retrying in 30 s: $(1)"; sleep 30; done

.PHONY: parity test test-all bench clean-venv

$(LIB_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call retry,$(PIP_INSTALL) --upgrade pip)
	$(call retry,$(PIP_INSTALL) "$(TORCH_SPEC)")
	$(call retry,$(PIP_INSTALL) -e ".$(if $(JAX_EXTRA),[$(JAX_EXTRA)],)" $(JAX_SPEC))
	touch $@

$(TEST_STAMP): $(LIB_STAMP)
	$(call retry,$(PIP_INSTALL) -e ".[test$(if $(JAX_EXTRA),$(comma)$(JAX_EXTRA),)]" $(JAX_SPEC))
	touch $@

parity: $(LIB_STAMP)
	$(BIN)/python -m parity $(ARGS)

test: $(TEST_STAMP)
	$(PYTEST) -m "not slow" $(ARGS)

# The notebooks run as tests through nbmake here; plain `python -m pytest` runs only tests/.
test-all: $(TEST_STAMP)
	$(PYTEST) --nbmake $(ARGS)

bench: $(TEST_STAMP)
	$(BIN)/python -m benchmarks.decode $(ARGS)

clean-venv:
	rm -rf $(VENV)

"""Shared test setup: GPU detection and per-test random generators.

The same test files run on CPU (Pallas in interpret mode) and on a GPU (the compiled kernel).
Tests marked ``gpu`` need a GPU visible to JAX and are skipped cleanly without one; tests marked
``slow`` (long interpret-mode grids, property runs) are left out by ``make test`` (``-m "not
slow"``) and run by ``make test-all``. Under pytest-xdist every worker is a fresh process that
imports this file before anything starts JAX, so each gets parity's JAX settings (``NPROC`` for
Mosaic GPU's interpret mode among them); no test depends on another's state or order, and none
writes outside its own ``tmp_path``.

Shared helpers live in one module, ``paged_inputs.py`` (test modules never import each other).
"""

from __future__ import annotations

import os
import sys
import zlib

# torch and JAX may share one GPU in a test process, and Mosaic GPU's interpret mode needs more
# XLA CPU threads than a small machine has CPUs: importing parity before JAX starts sets both
# (parity/__init__.py is the one place that says so).
import parity  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))  # the tests' helper module, paged_inputs

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh inputs per case, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    return ON_GPU

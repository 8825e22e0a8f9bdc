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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test from the I-th (0-based): N processes"
                          " with --shard 0/N ... N-1/N run the suite once between them")


def _shard(config, items):
    """Keep items ``i, i + n, ...`` of ``--shard i/n`` (after ``-m``/``-k`` deselection, so the
    selected tests are dealt evenly, a long parametrized test across every shard); the tests
    marked ``huge`` all in shard 0, in their order (they share caches of GBs on the device, and
    several processes building them at once run a GPU out of memory)."""
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N, got {spec!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--shard {spec!r}: I must be in [0, N)")
    huge = [item for item in items if item.get_closest_marker("huge")]
    rest = [item for item in items if not item.get_closest_marker("huge")]
    kept = [item for i, item in enumerate(rest) if i % count == index]
    if index == 0:
        kept = huge + kept
    kept_ids = {id(item) for item in kept}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    items[:] = kept


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _shard(config, items)
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

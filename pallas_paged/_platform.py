"""What the kernels need to know about where they run."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import jax
import numpy as np

# Streaming multiprocessors of an sm_90 GPU, used when the device does not report its count.
DEFAULT_SM_COUNT = 132


def has_gpu() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret=None`` means Pallas interpret mode exactly when there is no GPU backend."""
    return (not has_gpu()) if interpret is None else bool(interpret)


def device_kind() -> str:
    """The default device's kind as JAX reports it (e.g. ``"NVIDIA H200"``, ``"cpu"``): the key of
    the tuned config tables."""
    return str(jax.devices()[0].device_kind)


@functools.cache
def sm_count() -> int:
    """Multiprocessors of the default device (``DEFAULT_SM_COUNT`` when it does not say)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or DEFAULT_SM_COUNT)


def xla_cpu_threads() -> int:
    """Threads in each of the XLA CPU client's pools: ``NPROC`` where the environment sets it (XLA
    reads it when the client starts), else the CPUs this process may run on."""
    nproc = os.environ.get("NPROC", "")
    if nproc.isdigit() and int(nproc) > 0:
        return int(nproc)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def kernel_addresses_overflow(shape, dtype) -> bool:
    """True for arrays the Pallas Triton lowering cannot address: it switches to 64-bit offsets
    only above 2**32 bytes, so a 1-byte (fp8) array of 2**31 to 2**32 elements would index past
    2**31 with 32-bit offsets. Such caches go through the XLA paths instead."""
    elements = math.prod(shape)
    return np.dtype(dtype).itemsize == 1 and 2**31 <= elements <= 2**32


# Upstream's warning, emitted when a Pallas Triton kernel is lowered (jax >= 0.11).
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_triton_deprecation():
    """Silence upstream's Pallas Triton deprecation warning for the calls inside the block.

    Our public functions run their jitted programs inside it, so users who never called Pallas
    themselves do not see a warning about a backend they did not choose (README says what the
    deprecation means). It lowers when the program is first compiled: under a caller's own
    ``jax.jit``, that happens in the caller's call, outside this block.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def without_triton_deprecation(fn):
    """``fn`` run inside `quiet_triton_deprecation` (a decorator for the public functions)."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with quiet_triton_deprecation():
            return fn(*args, **kwargs)

    return quiet

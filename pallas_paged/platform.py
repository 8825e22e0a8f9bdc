"""What the kernels need to know about where they run."""

from __future__ import annotations

import functools

import jax

# Streaming multiprocessors of an H100 / H200, used when the device does not report its count.
DEFAULT_SM_COUNT = 132


def has_gpu() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret=None`` means Pallas interpret mode exactly when there is no GPU backend."""
    return (not has_gpu()) if interpret is None else bool(interpret)


@functools.cache
def sm_count() -> int:
    """Multiprocessors of the default device (``DEFAULT_SM_COUNT`` when it does not say)."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or DEFAULT_SM_COUNT)


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def kernel_addresses_overflow(shape, dtype) -> bool:
    """True for arrays the Pallas Triton lowering cannot address: it switches to 64-bit offsets
    only above 2**32 bytes, so a 1-byte (fp8) array of 2**31 to 2**32 elements would index past
    2**31 with 32-bit offsets. Such caches go through the XLA paths instead."""
    import math

    import numpy as np

    elements = math.prod(shape)
    return np.dtype(dtype).itemsize == 1 and 2**31 <= elements <= 2**32

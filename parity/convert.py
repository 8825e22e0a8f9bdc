"""numpy <-> torch and numpy <-> JAX, bit for bit: the one module that imports both frameworks.

Every array of a parity case starts as numpy (`parity.cases`) and reaches torch and JAX through
here, so both frameworks see the same bits: low-precision values are rounded once, by ml_dtypes
(round to nearest even), and then only reinterpreted. torch gets a bf16 / fp8 array as its raw
integer bits viewed back as the float type
(``torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)``), which never rounds and keeps NaN
payloads; JAX takes ml_dtypes arrays natively.

It also holds the few other places where the harness touches a framework directly: choosing the
devices, making torch's fp32 matmuls IEEE (no TF32) for the length of a block, and waiting for
asynchronous work before reading a clock.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np

import jax
import torch

__all__ = [
    "DEVICES",
    "bits",
    "default_device",
    "from_jax",
    "from_torch",
    "ieee_fp32_matmuls",
    "jax_device",
    "jax_sync",
    "to_jax",
    "to_torch",
    "torch_device",
    "torch_precision_flags",
    "torch_sync",
]

DEVICES = ("cpu", "cuda")

# numpy dtype -> (torch dtype, same-width integer numpy dtype used to carry the bits, if needed)
_TO_TORCH = {
    np.dtype(np.float32): (torch.float32, None),
    np.dtype(np.float16): (torch.float16, None),
    np.dtype(np.float64): (torch.float64, None),
    np.dtype(ml_dtypes.bfloat16): (torch.bfloat16, np.int16),
    np.dtype(ml_dtypes.float8_e4m3fn): (torch.float8_e4m3fn, np.uint8),
    np.dtype(np.int32): (torch.int32, None),
    np.dtype(np.int64): (torch.int64, None),
    np.dtype(np.uint8): (torch.uint8, None),
    np.dtype(np.bool_): (torch.bool, None),
}
# torch dtype -> (integer torch dtype carrying its bits, numpy dtype to view them as)
_FROM_TORCH = {
    torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
    torch.float8_e4m3fn: (torch.uint8, np.dtype(ml_dtypes.float8_e4m3fn)),
}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def gpu_visible() -> tuple[bool, bool]:
    """``(torch sees a CUDA GPU, JAX sees a GPU)``."""
    try:
        jax_gpu = bool(jax.devices("gpu"))
    except RuntimeError:
        jax_gpu = False
    return torch.cuda.is_available(), jax_gpu


def default_device() -> str:
    """``"cuda"`` when both torch and JAX see a GPU, else ``"cpu"``."""
    return "cuda" if all(gpu_visible()) else "cpu"


def check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is usable by both frameworks here."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {DEVICES}")
    if device == "cuda":
        torch_gpu, jax_gpu = gpu_visible()
        if not (torch_gpu and jax_gpu):
            raise ValueError(
                f"device='cuda' needs a GPU visible to torch and JAX; torch sees one: {torch_gpu},"
                f" JAX sees one: {jax_gpu}")


def torch_device(device: str) -> torch.device:
    return torch.device("cuda" if device == "cuda" else "cpu")


def jax_device(device: str):
    """The JAX device for ``"cpu"`` / ``"cuda"``: ``"cpu"`` is the host even on a GPU machine."""
    return jax.devices("gpu" if device == "cuda" else "cpu")[0]


def torch_precision_flags() -> dict:
    """torch's global fp32-matmul settings: the TF32 switches and the matmul precision."""
    return dict(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                float32_matmul_precision=torch.get_float32_matmul_precision())


def _set_torch_precision_flags(flags: dict) -> None:
    # The precision first: it sets cuda.matmul.allow_tf32 too, which the next line then restores.
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]


@contextlib.contextmanager
def ieee_fp32_matmuls():
    """Inside the block, torch's fp32 matmuls are IEEE fp32 on every backend (no TF32), as
    SPEC.md's precision rule says; on leaving it (exception or not), torch's flags are what they
    were before, so parity leaves no global state behind in the process that called it."""
    saved = torch_precision_flags()
    _set_torch_precision_flags(dict(matmul_allow_tf32=False, cudnn_allow_tf32=False,
                                    float32_matmul_precision="highest"))
    try:
        yield
    finally:
        _set_torch_precision_flags(saved)


def to_torch(arr: np.ndarray, device: str = "cpu") -> torch.Tensor:
    """A torch tensor with exactly ``arr``'s bits, on ``device`` (``"cpu"`` / ``"cuda"``)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in _TO_TORCH:
        raise ValueError(f"no torch dtype for numpy dtype {arr.dtype}")
    torch_dtype, carrier = _TO_TORCH[arr.dtype]
    if carrier is None:
        t = torch.from_numpy(arr.copy())
    else:
        t = torch.from_numpy(arr.view(carrier).copy()).view(torch_dtype)
    return t.to(torch_device(device))


def from_torch(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of ``t`` with exactly its bits (bf16 / fp8 as ml_dtypes arrays)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _FROM_TORCH:
        carrier, np_dtype = _FROM_TORCH[t.dtype]
        return t.view(carrier).numpy().copy().view(np_dtype)
    return t.numpy().copy()


def to_jax(arr: np.ndarray, device: str = "cpu") -> jax.Array:
    """A JAX array with exactly ``arr``'s bits, committed to ``device``'s JAX device.

    64-bit arrays are refused unless JAX runs with x64 enabled (JAX would silently narrow them).
    """
    arr = np.ascontiguousarray(arr)
    if arr.dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(f"a {arr.dtype} array would be narrowed by JAX (x64 is disabled)")
    return jax.device_put(arr, jax_device(device))


def from_jax(x: jax.Array) -> np.ndarray:
    """A numpy copy of ``x`` with exactly its bits."""
    return np.array(jax.device_get(x), copy=True)


def bits(arr: np.ndarray) -> np.ndarray:
    """``arr``'s raw bits as unsigned integers of the same width, so NaN == NaN and -0.0 != 0.0."""
    arr = np.ascontiguousarray(arr)
    return arr.view(_UNSIGNED[arr.dtype.itemsize])


def torch_sync(device: str) -> None:
    """Wait for queued torch work (a no-op on the CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def jax_sync(tree) -> None:
    """Wait until every array in ``tree`` is computed."""
    jax.block_until_ready(tree)

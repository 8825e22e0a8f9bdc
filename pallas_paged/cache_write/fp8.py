"""fp8 caches: per-tensor scales as fp32 operands, and the quantization bit-identical to
`torch_ref.write_kv` in XLA (``impl="xla"``; the Pallas kernel quantizes the rows it loads itself,
``pallas_triton.py``, with the same arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def scale_operand(scale):
    """A validated per-tensor scale (python float or float32 array of shape () / (1,)) as an
    ``f32[]`` operand, or None for None.

    A python float becomes a numpy fp32 scalar (rounded to nearest, as ``torch.tensor(scale,
    dtype=torch.float32)`` does), so that, like an array, it is an argument of the jitted program
    rather than a constant compiled into it: one program serves every scale.
    """
    if scale is None:
        return None
    if isinstance(scale, (int, float)):
        return np.float32(scale)
    return jnp.reshape(scale, ())


def quantize_fp8(x: jax.Array, scale) -> jax.Array:
    """``clamp(x / scale, -448, 448)`` in fp32, cast to float8_e4m3fn (round to nearest even).

    Args:
      x: any float array.
      scale: a python float or an ``f32[]`` / ``f32[1]`` array (traced or not).

    The division must be one IEEE fp32 division per element, as in torch, for the caches to be
    bit-identical. XLA rewrites ``x / broadcast(s)`` into ``x * broadcast(1 / s)``, which rounds
    differently, for a traced ``s`` as for a constant one; so the divisor is broadcast to ``x``'s
    shape behind an optimization barrier, which XLA cannot see through.
    """
    scale = jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
    scaled = x.astype(jnp.float32) / divisor
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)

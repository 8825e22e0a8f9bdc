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
    shape behind an optimization barrier, which XLA cannot see through. The quotient is then
    rounded onto the fp8 grid in fp32 (`round_to_fp8_grid`), so that the cast itself is exact
    whatever route a backend's conversion takes.
    """
    scale = jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scale, x.shape))
    scaled = x.astype(jnp.float32) / divisor
    scaled = jnp.where(scaled > FP8_MAX, FP8_MAX, jnp.where(scaled < -FP8_MAX, -FP8_MAX, scaled))
    return round_to_fp8_grid(scaled).astype(jnp.float8_e4m3fn)


def round_to_fp8_grid(x: jax.Array) -> jax.Array:
    """fp32 ``x`` (``|x| <= 448`` or NaN) rounded to the nearest float8_e4m3fn value, ties to
    even, computed in fp32 and integer arithmetic; NaN stays NaN.

    The result is exactly representable in fp8 (and in fp16), so the cast that follows cannot
    round again: XLA on a GPU converts fp32 to fp8 through fp16, and rounding twice moves values
    just off a tie onto the wrong side of it.

    - ``|x| >= 2**-6`` (fp8 normals): keep 3 of fp32's 23 mantissa bits, rounding the 20 dropped
      ones to nearest even on the bit pattern (a carry into the exponent is the right result).
    - ``|x| < 2**-6`` (fp8 subnormals, multiples of ``2**-9``): ``round_half_even(x * 2**9) /
      2**9``, exact since the scaling is by a power of two.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    odd = (bits >> 20) & 1
    kept = (bits + jnp.uint32(0x7FFFF) + odd) & jnp.uint32(0xFFF00000)
    normal = jax.lax.bitcast_convert_type(kept, jnp.float32)
    subnormal = jnp.round(x * 512.0) / 512.0
    rounded = jnp.where(jnp.abs(x) < 2.0**-6, subnormal, normal)
    return jnp.where(jnp.isnan(x), x, rounded)

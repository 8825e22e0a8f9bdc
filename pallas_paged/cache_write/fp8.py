"""Quantizing K/V rows for a float8_e4m3fn cache, bit-identical to `torch_ref.write_kv`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(x: jax.Array, scale: float) -> jax.Array:
    """``clamp(x / scale, -448, 448)`` in fp32, cast to float8_e4m3fn (round to nearest even).

    The division must be one IEEE fp32 division per element, as in torch, for the caches to be
    bit-identical. XLA rewrites ``x / broadcast(c)`` into ``x * (1 / c)``, which rounds
    differently, so the divisor is materialized behind an optimization barrier.
    """
    divisor = jax.lax.optimization_barrier(jnp.full(x.shape, scale, jnp.float32))
    scaled = x.astype(jnp.float32) / divisor
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)

"""The static facts of a decode call that its kernel and config depend on, and the key they are
looked up under in the tuned tables (`pallas_triton_config`, `mosaic_gpu_config`, the kernel
choice in `api`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_paged._platform import next_power_of_2


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The static facts a config depends on (all known at trace time)."""

    batch: int
    num_kv_heads: int
    group: int          # query heads per kv head
    head_dim: int
    block_size: int
    capacity: int       # max_blocks * block_size: the longest context the tables can hold
    cache_dtype: str    # e.g. "bfloat16"
    window: int | None = None  # the sliding window W; None: none

    @property
    def span(self) -> int:
        """The most cached tokens one query attends: the capacity, or a window within it."""
        return self.capacity if self.window is None else min(self.capacity, self.window)


def shape_class(shape: DecodeShape) -> tuple:
    """The key a shape is looked up under: ``(cache dtype, head_dim, group, block_size, batch,
    span)``, all but the dtype and block_size rounded up to powers of two, so that one measured
    entry covers its neighbours. The span (`DecodeShape.span`) is the tokens a query attends:
    a window of 1024 over caches of 32K tokens reads what a cache of 1024 does, and takes its
    config."""
    return (shape.cache_dtype, next_power_of_2(shape.head_dim), next_power_of_2(shape.group),
            shape.block_size, next_power_of_2(shape.batch), next_power_of_2(shape.span))


def decode_shape(q, k_cache, block_tables, sliding_window: int | None = None) -> DecodeShape:
    """The static facts of a call that its kernel and config depend on (reads ``.shape`` and
    ``.dtype`` only)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    return DecodeShape(batch=batch, num_kv_heads=kvh, group=num_heads // kvh, head_dim=head_dim,
                       block_size=block_size, capacity=block_tables.shape[1] * block_size,
                       cache_dtype=jnp.dtype(k_cache.dtype).name, window=sliding_window)

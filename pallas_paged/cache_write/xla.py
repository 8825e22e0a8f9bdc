"""The cache write as an XLA scatter: ``write_kv(..., impl="xla")``.

``cache.at[slots].set(rows, mode="drop")`` on the flat slot axis, every invalid slot mapped to its
own index past the end so that it is dropped (a raw ``-1`` would mean "the last slot" in JAX as in
torch).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


def write_xla(k_flat, v_flat, k_rows, v_rows, slots):
    """Scatter ``k_rows`` / ``v_rows`` ``[num_tokens, row]`` into the flat caches ``[num_slots, row]``."""
    num_slots = k_flat.shape[0]
    keep = (slots >= 0) & (slots < num_slots)
    # Each dropped token gets its own index past the end: dropped by mode="drop", and the indices
    # stay unique, so XLA may write rows without atomics.
    index = jnp.where(keep, slots, num_slots + jnp.arange(slots.shape[0], dtype=slots.dtype))
    scatter = functools.partial(_scatter_rows, index=index)
    return scatter(k_flat, k_rows), scatter(v_flat, v_rows)


def _scatter_rows(cache, rows, *, index):
    return cache.at[index].set(rows, mode="drop", unique_indices=True)

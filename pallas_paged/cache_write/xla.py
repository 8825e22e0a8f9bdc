"""The cache write as an XLA scatter: ``write_kv(..., impl="xla")``.

``cache.at[slots].set(rows, mode="drop")`` on the flat slot axis, every invalid slot mapped to its
own index past the end so that it is dropped (a raw ``-1`` would mean "the last slot" in JAX as in
torch).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp


def write_xla(flats, k_rows, v_rows, slots, *, head_dim: int):
    """Scatter ``k_rows`` / ``v_rows`` ``[num_tokens, num_kv_heads * head_dim]`` into the flat
    caches ``flats``: ``(k_flat, v_flat)``, each ``[num_slots, num_kv_heads * head_dim]``, or
    ``(kv_flat,)``, ``[num_slots, 2 * num_kv_heads * head_dim]`` (fused: the rows interleaved per
    kv head, K then V, as they lie in the cache). Returns the caches as given."""
    num_slots = flats[0].shape[0]
    keep = (slots >= 0) & (slots < num_slots)
    # Each dropped token gets its own index past the end: dropped by mode="drop", and the indices
    # stay unique, so XLA may write rows without atomics.
    index = jnp.where(keep, slots, num_slots + jnp.arange(slots.shape[0], dtype=slots.dtype))
    scatter = functools.partial(_scatter_rows, index=index)
    if len(flats) == 1:
        num_tokens = k_rows.shape[0]
        by_head = (num_tokens, -1, 1, head_dim)  # [T, KVH, 1, D]
        rows = jnp.concatenate([k_rows.reshape(by_head), v_rows.reshape(by_head)], axis=2)
        return (scatter(flats[0], rows.reshape(num_tokens, -1)),)
    return scatter(flats[0], k_rows), scatter(flats[1], v_rows)


def _scatter_rows(cache, rows, *, index):
    return cache.at[index].set(rows, mode="drop", unique_indices=True)

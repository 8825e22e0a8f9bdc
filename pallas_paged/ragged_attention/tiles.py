"""Which K/V tiles a query tile of ragged attention visits, and which of them need masks: the
plan both kernels (`pallas_triton.py`, `mosaic_gpu.py`) walk."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_paged._attention_common import split_share


def kv_tile_plan(first_pos, tile_queries, n, split, *, block_k: int, num_splits: int,
                 window: int | None):
    """The K/V tiles one program walks, and where they need masks.

    The tile's queries sit at positions ``first_pos .. first_pos + tile_queries - 1`` (of a
    sequence of ``n`` tokens). Some query sees the positions ``[key_lo, key_hi)``: from the window
    start of the first query (0 without a window) to the last query's position, inclusive. Every
    query sees ``[shared_lo, shared_hi)``: from the window start of the last query to the first
    query's position. Tiles of ``block_k`` positions wholly inside the shared range need no mask.
    The tiles ``key_lo // block_k .. ceil(key_hi / block_k) - 1`` are split into ``num_splits``
    balanced contiguous shares (`split_share`); this program (split ``split``) walks its share,
    in three ranges: masked tiles before the shared ones (a window's edge), unmasked shared
    tiles, masked tiles after them (the diagonal). Nothing past ``key_hi`` and no tile wholly
    before ``key_lo`` is visited. A program with no queries (``tile_queries == 0``) visits
    nothing.

    Returns:
      ``(key_lo, key_hi, shared_lo, shared_hi, loops)``: int32 scalars and three ``(lo, hi)``
      tile ranges with ``lo <= hi``.
    """
    last_pos = first_pos + tile_queries - 1
    key_lo = jnp.int32(0) if window is None else jnp.maximum(first_pos - window + 1, 0)
    key_hi = jnp.where(tile_queries > 0, jnp.clip(last_pos + 1, 0, n), 0)
    key_hi = jnp.maximum(key_hi, key_lo)
    shared_lo = jnp.int32(0) if window is None else jnp.maximum(last_pos - window + 1, 0)
    shared_hi = jnp.clip(first_pos + 1, 0, n)
    tile_lo = key_lo // block_k
    tile_hi = jnp.where(key_hi > key_lo, (key_hi + block_k - 1) // block_k, tile_lo)
    full_lo = jnp.clip((shared_lo + block_k - 1) // block_k, tile_lo, tile_hi)
    full_hi = jnp.clip(shared_hi // block_k, full_lo, tile_hi)
    lo, hi = tile_lo, tile_hi
    if num_splits > 1:
        lo, hi = split_share(tile_lo, tile_hi, split, num_splits)
    edge = (lo, jnp.maximum(jnp.minimum(hi, full_lo), lo))
    full_start = jnp.maximum(lo, full_lo)
    full = (full_start, jnp.maximum(jnp.minimum(hi, full_hi), full_start))
    diagonal_start = jnp.maximum(lo, full_hi)
    diagonal = (diagonal_start, jnp.maximum(hi, diagonal_start))
    return key_lo, key_hi, shared_lo, shared_hi, (edge, full, diagonal)

"""What every attention kernel and path shares, whatever its backend (plain jnp, traceable inside
Pallas Triton, Mosaic GPU and XLA programs alike): the tiles a program walks and the merge of
partial softmax results (flash-decoding's split-K, the persistent programs' cut sequences).
"""

from __future__ import annotations

import jax.numpy as jnp


def num_kv_heads(cache_shape, fused: bool) -> int:
    """The kv heads of a cache ``[num_blocks, block_size, heads, head_dim]``: ``heads``, or half of
    them for a fused cache (K of kv head ``h`` at combined head ``2h``, V at ``2h + 1``)."""
    return cache_shape[2] // 2 if fused else cache_shape[2]


def split_kv_cache(kv_cache):
    """A fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` as the pair of caches
    it is: ``(kv_cache[:, :, 0::2], kv_cache[:, :, 1::2])`` (K, V). For the XLA paths; the
    kernels read the fused rows in place (Triton: `_triton_common.kv_rows`, Mosaic GPU:
    `_mosaic_common.kv_head_rows`)."""
    return kv_cache[:, :, 0::2], kv_cache[:, :, 1::2]


def balanced_share(count, part, num_parts):
    """Part ``part``'s contiguous share ``[lo, hi)`` of ``count`` items dealt to ``num_parts``
    parts: the first ``count % num_parts`` shares one item longer than the others, so the
    lengths differ by at most one and the longest is ``ceil(count / num_parts)``. Computed
    without the product ``count * num_parts`` (no int32 overflow for any count).

    Args:
      count: int32 scalar >= 0; part: int32 scalar in ``[0, num_parts)``; num_parts: int >= 1.
    """
    base, extra = count // num_parts, count % num_parts
    lo = base * part + jnp.minimum(part, extra)
    longer = jnp.clip(extra - part, 0, 1)  # 1 for the first `extra` parts (no bool -> int)
    return lo, lo + base + longer


def share_owner(item, count, num_parts):
    """The part whose `balanced_share` of ``count`` items holds ``item`` (``0 <= item <
    count``), as an int32 scalar."""
    base, extra = count // num_parts, count % num_parts
    long_items = extra * (base + 1)  # the items of the longer shares, first
    return jnp.where(item < long_items, item // (base + 1),
                     extra + (item - long_items) // jnp.maximum(base, 1))


def split_share(tile_lo, tile_hi, split, num_splits: int):
    """Split ``split``'s contiguous share of the tiles ``[tile_lo, tile_hi)``, of ``num_splits``.

    Balanced (`balanced_share`): the shares' lengths differ by at most one tile, so a split
    count that does not divide the tiles leaves no split idle while others walk a full share
    (with ``ceil(count / num_splits)`` tiles per share, 512 tiles over 33 splits left the 33rd
    empty); the longest share is ``ceil(count / num_splits)`` tiles either way. Every share is
    empty when ``count`` is 0 and some are when ``count < num_splits``.

    Returns:
      ``(lo, hi)`` int32 scalars with ``tile_lo <= lo <= hi <= tile_hi``.
    """
    count = jnp.maximum(tile_hi - tile_lo, 0)
    lo, hi = balanced_share(count, split, num_splits)
    return tile_lo + lo, tile_lo + hi


def tile_range(n, split, *, block_k: int, num_splits: int, window: int | None):
    """The tiles one program walks: ``[tile_lo, tile_hi)`` of ``block_k`` tokens each.

    A sequence of ``n`` tokens has tiles ``first // block_k .. ceil(n / block_k) - 1``, where
    ``first = max(n - window, 0)`` is the oldest position inside the sliding window (0 without
    one): tiles wholly outside the window, and tiles past ``n``, are never visited, so their pages
    are never read. Split ``split`` of ``num_splits`` takes its balanced contiguous share
    (`split_share`); a share may be empty (``tile_lo >= tile_hi``).

    Returns:
      ``(first, tile_lo, tile_hi)`` as int32 scalars.
    """
    first = jnp.int32(0) if window is None else jnp.maximum(n - window, 0)
    tile_lo, tile_hi = first // block_k, (n + block_k - 1) // block_k
    if num_splits > 1:
        tile_lo, tile_hi = split_share(tile_lo, tile_hi, split, num_splits)
    return first, tile_lo, tile_hi


def divides(l):
    """Where a softmax's sum of exponentials ``l`` normalizes its row: everywhere but ``l == 0``
    (no key: the row is zeros); a NaN sum (a NaN query or key) divides, so that the NaN propagates
    as in torch_ref. Every kernel and merge decides with this."""
    return l != 0


def finite_total_max(m_max, sink):
    """The merged running max: ``m_max`` (the parts' max) with the sink's logit, 0 where neither
    saw a finite logit, so that the weights ``exp(m - m_total)`` stay finite."""
    m_total = m_max if sink is None else jnp.maximum(m_max, sink)
    return jnp.where(jnp.abs(m_total) < jnp.inf, m_total, 0.0)


def merged_max_and_sum(m, l, m_max, sink):
    """The running max and sum of exponentials of several splits together (the merge's first
    step, in every merge: `merge_splits`, the merge kernel, the in-kernel merge), over axis 0 of
    ``m`` and ``l``.

    Args:
      m, l: f32[splits, ...], each split's running max (-inf for an empty split) and sum.
      m_max: ``jnp.max(m, axis=0)``, which the caller has.
      sink: f32[...] (one more logit, with no value row) or None.

    Returns:
      ``(m_total, l_total, weight)``: ``m_total``, ``l_total`` f32[...]; ``weight = exp(m -
      m_total)`` f32[splits, ...], each split's factor (0 for empty splits). ``m_total`` is 0
      where no split and no sink saw a finite logit, so that the weights stay finite.
    """
    m_total = finite_total_max(m_max, sink)
    weight = jnp.exp(m - m_total)
    l_total = jnp.sum(weight * l, axis=0)
    if sink is not None:
        l_total = l_total + jnp.exp(sink - m_total)
    return m_total, l_total, weight


def merge_splits(o, m, l, n, sinks):
    """Combine per-split partial results (flash-decoding's final step), in fp32.

    Args:
      o: f32[batch, kvh, splits, group, head_dim], each split's unnormalized weighted sum.
      m, l: f32[batch, kvh, splits, group], each split's running max and sum of exponentials.
      n: i32[batch], the clamped lengths.
      sinks: f32[kvh, group] or None.

    Returns:
      ``(out f32[batch, kvh, group, head_dim], lse f32[batch, kvh, group])``.
    """
    m, l = jnp.moveaxis(m, 2, 0), jnp.moveaxis(l, 2, 0)  # f32[splits, batch, kvh, group]
    m_total, l_total, weight = merged_max_and_sum(m, l, m.max(axis=0),
                                                  None if sinks is None else sinks[None])
    o_total = jnp.sum(weight[..., None] * jnp.moveaxis(o, 2, 0), axis=0)
    has_rows = (n > 0)[:, None, None]
    has = has_rows & divides(l_total)
    out = jnp.where(has[..., None], o_total / jnp.where(has, l_total, 1.0)[..., None], 0.0)
    lse = jnp.where(has_rows, m_total + jnp.log(l_total), -jnp.inf)
    return out, lse

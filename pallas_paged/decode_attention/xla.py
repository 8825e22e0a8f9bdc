"""Paged decode attention in plain XLA (readable jnp, fp32 softmax): ``decode(..., impl="xla")``.

It gathers every table entry of every sequence (entries past ``ceil(n / block_size)`` are replaced
by block 0 first, so garbage ids are never used as addresses), masks positions outside
``[window start, n)`` in the scores *and* zeroes their K/V rows (``0 * NaN`` is NaN, so masking the
scores alone would let NaN from unused cache slots through), then does the softmax in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def sequence_positions(context_lens, capacity: int, sliding_window: int | None):
    """Per-sequence facts shared by both decode paths.

    Returns:
      ``(n, valid)``: ``n i32[batch]`` the lengths clamped to ``[0, capacity]`` (what jit does with
      out-of-range lengths), and ``valid bool[batch, capacity]``, the positions taking part.
    """
    n = jnp.clip(context_lens.astype(jnp.int32), 0, capacity)
    pos = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    valid = pos < n[:, None]
    if sliding_window is not None:
        valid &= pos >= (n - sliding_window)[:, None]
    return n, valid


def gather_sequences(cache, block_tables, context_lens):
    """Each sequence's cache rows in logical order: ``[batch, max_blocks * block_size, KVH, D]``.

    Only the first ``ceil(n / block_size)`` table entries are used as addresses (the rest read
    block 0); ids in the valid part are clamped into ``[0, num_blocks)``.
    """
    num_blocks, block_size, kvh, d = cache.shape
    batch, max_blocks = block_tables.shape
    n = jnp.clip(context_lens.astype(jnp.int32), 0, max_blocks * block_size)
    used = jnp.arange(max_blocks)[None, :] < ((n + block_size - 1) // block_size)[:, None]
    ids = jnp.where(used, jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1), 0)
    return cache[ids].reshape(batch, max_blocks * block_size, kvh, d)


def softmax_attention(s, v, visible, distance, *, logits_soft_cap=None, alibi_slopes=None,
                      sinks=None):
    """Scaled scores to attention outputs, in fp32: soft-cap -> ALiBi -> mask -> softmax (with
    sink) -> weighted sum, for rows of queries of either op.

    Args:
      s: ``f32[R, KVH, G, P]``, ``q . k * scale`` of each row's positions.
      v: ``f32[R, P, KVH, D]``, the value rows, zero where not visible (so no NaN enters).
      visible: ``bool[R, P]``, the positions each row takes part in.
      distance: ``i32[R, P]``, ``j - p`` for ALiBi.
      logits_soft_cap, alibi_slopes ``f32[KVH * G]``, sinks ``f32[KVH * G]``: as in SPEC.md.

    Returns:
      ``(out f32[R, KVH, G, D], lse f32[R, KVH, G])``; rows that see nothing give zeros and
      ``-inf``.
    """
    _, kvh, group, _ = s.shape
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if alibi_slopes is not None:
        s = s + (alibi_slopes.reshape(kvh, group)[None, :, :, None]
                 * distance.astype(jnp.float32)[:, None, None, :])
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = s.max(axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, sinks.reshape(kvh, group)[None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m[..., None])
    denom = e.sum(axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.reshape(kvh, group)[None] - m)
    o = jnp.einsum("rkgp,rpkd->rkgd", e, v, precision=HIGHEST)
    has_rows = visible.any(axis=1)[:, None, None]
    out = jnp.where(has_rows[..., None], o / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(has_rows, m + jnp.log(denom), -jnp.inf)
    return out, lse


def decode_xla(q, k_cache, v_cache, block_tables, context_lens, *, scale: float,
               logits_soft_cap=None, alibi_slopes=None, sliding_window=None, sinks=None,
               k_scale=None, v_scale=None):
    """Paged decode attention in plain jnp. Arguments as `pallas_paged.decode`.

    Returns:
      ``(out [batch, num_heads, head_dim] in q.dtype, lse f32[batch, num_heads])``.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    capacity = block_tables.shape[1] * block_size
    n, valid = sequence_positions(context_lens, capacity, sliding_window)
    rows = valid[:, :, None, None]
    k = gather_sequences(k_cache, block_tables, context_lens).astype(jnp.float32)
    v = gather_sequences(v_cache, block_tables, context_lens).astype(jnp.float32)
    if k_scale is not None:
        k, v = k * jnp.asarray(k_scale, jnp.float32), v * jnp.asarray(v_scale, jnp.float32)
    k = jnp.where(rows, k, 0.0)  # [B, P, KVH, D]
    v = jnp.where(rows, v, 0.0)  # [B, P, KVH, D]
    qg = q.astype(jnp.float32).reshape(batch, kvh, group, head_dim)  # head h -> kv head h // group
    s = jnp.einsum("bkgd,bpkd->bkgp", qg, k, precision=HIGHEST) * jnp.float32(scale)
    distance = jnp.arange(capacity)[None, :] - (n - 1)[:, None]  # [B, P]: p - (n - 1)
    out, lse = softmax_attention(s, v, valid, distance, logits_soft_cap=logits_soft_cap,
                                 alibi_slopes=alibi_slopes, sinks=sinks)
    return (out.reshape(batch, num_heads, head_dim).astype(q.dtype),
            lse.reshape(batch, num_heads))

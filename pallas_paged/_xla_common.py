"""What the plain-XLA attention paths (decode and ragged) share: the gather of each sequence's rows
in logical order and the fp32 softmax with the options."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


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

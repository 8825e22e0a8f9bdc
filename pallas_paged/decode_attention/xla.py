"""Paged decode attention in plain XLA (readable jnp, fp32 softmax): ``decode(..., impl="xla")``.

It gathers every table entry of every sequence (entries past ``ceil(n / block_size)`` are replaced
by block 0 first, so garbage ids are never used as addresses), masks positions outside
``[window start, n)`` in the scores *and* zeroes their K/V rows (``0 * NaN`` is NaN, so masking the
scores alone would let NaN from unused cache slots through), then does the softmax in fp32.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_paged._xla_common import HIGHEST, gather_sequences, softmax_attention


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

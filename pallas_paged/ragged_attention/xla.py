"""Ragged paged attention in plain XLA (readable jnp, fp32 softmax): ``paged_attention(...,
impl="xla")``.

Each token finds its sequence in ``query_start_loc`` and its position ``p``; each sequence's K/V
rows are gathered in logical order as in decode (`gather_sequences`), then every token takes its
own sequence's rows. A (token, position) pair takes part when ``j <= p``, ``j < n`` and, with a
window, ``j > p - W``. Pairs that do not take part are masked in the scores *and* their K/V rows
are zeroed for that token (``0 * NaN`` is NaN), so nothing a query does not see can reach it, not
even NaN at later positions of its own sequence.

Memory: the per-token rows are ``f32[tokens, max_blocks * block_size, num_kv_heads, head_dim]``
for K and for V; tokens go in chunks (`token_chunk`) that keep them under ``ROW_BUDGET_ELEMENTS``
each (one chunk for small problems), so a large call costs time, not gigabytes. This path is the
readable counterpart of the kernel, meant for checking it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_paged._xla_common import HIGHEST, gather_sequences, softmax_attention


def token_positions(query_start_loc, context_lens, num_tokens: int, capacity: int):
    """Where each query token sits.

    Token ``t`` belongs to the sequence ``b`` with ``query_start_loc[b] <= t <
    query_start_loc[b + 1]``; tokens at or past ``query_start_loc[batch]`` are padding. Entries of
    ``query_start_loc`` are clamped into ``[0, num_tokens]`` and lengths into ``[0, capacity]``
    (what jit does with values it cannot check).

    Returns:
      ``(seq, pos, n, real)``, each ``[num_tokens]``: ``seq i32`` the token's sequence (clamped
      into ``[0, batch)`` for padding tokens), ``pos i32`` its position ``n - q_len + i``, ``n
      i32`` its sequence's clamped length, ``real bool`` false for padding tokens.
    """
    batch = context_lens.shape[0]
    starts = jnp.clip(query_start_loc.astype(jnp.int32), 0, num_tokens)  # [B + 1]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(starts, t, side="right").astype(jnp.int32) - 1  # in [-1, batch]
    real = (seq >= 0) & (seq < batch)
    seq = jnp.clip(seq, 0, batch - 1)
    n = jnp.clip(context_lens.astype(jnp.int32), 0, capacity)[seq]
    q_len = starts[seq + 1] - starts[seq]
    pos = n - q_len + (t - starts[seq])
    return seq, pos, n, real


def paged_attention_xla(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                        scale: float, logits_soft_cap=None, alibi_slopes=None,
                        sliding_window=None, sinks=None, k_scale=None, v_scale=None):
    """Ragged paged attention in plain jnp. Arguments as `pallas_paged.paged_attention`.

    Tokens are taken ``token_chunk`` at a time (`token_chunk`), so the per-token rows stay under
    ``ROW_BUDGET_ELEMENTS``; each token's result does not depend on the others.

    Returns:
      ``(out [num_tokens, num_heads, head_dim] in q.dtype, lse f32[num_tokens, num_heads])``.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    group = num_heads // kvh
    capacity = block_tables.shape[1] * block_size
    seq, pos, n, real = token_positions(query_start_loc, context_lens, num_tokens, capacity)
    k_rows = gather_sequences(k_cache, block_tables, context_lens)  # [B, P, KVH, D]
    v_rows = gather_sequences(v_cache, block_tables, context_lens)  # [B, P, KVH, D]
    j = jnp.arange(capacity, dtype=jnp.int32)[None, :]

    def attend(q_c, seq_c, pos_c, n_c, real_c):  # the tokens of one chunk: [C, ...]
        visible = real_c[:, None] & (j <= pos_c[:, None]) & (j < n_c[:, None])  # [C, P]
        if sliding_window is not None:
            visible &= j > (pos_c - sliding_window)[:, None]
        rows = visible[:, :, None, None]
        k = k_rows[seq_c].astype(jnp.float32)
        v = v_rows[seq_c].astype(jnp.float32)
        if k_scale is not None:
            k, v = k * jnp.asarray(k_scale, jnp.float32), v * jnp.asarray(v_scale, jnp.float32)
        k = jnp.where(rows, k, 0.0)  # [C, P, KVH, D]
        v = jnp.where(rows, v, 0.0)  # [C, P, KVH, D]
        qg = q_c.astype(jnp.float32).reshape(-1, kvh, group, head_dim)  # h -> kv head h // group
        s = jnp.einsum("tkgd,tpkd->tkgp", qg, k, precision=HIGHEST) * jnp.float32(scale)
        return softmax_attention(s, v, visible, j - pos_c[:, None],
                                 logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                                 sinks=sinks)  # f32[C, KVH, G, D], f32[C, KVH, G]

    chunk = token_chunk(num_tokens, capacity * kvh * head_dim)
    per_token = (q, seq, pos, n, real)
    if chunk == num_tokens:
        out, lse = attend(*per_token)
    else:
        steps = -(-num_tokens // chunk)
        pad = steps * chunk - num_tokens  # padding tokens: real=False, so nothing is visible
        chunks = tuple(jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(
            steps, chunk, *x.shape[1:]) for x in per_token)
        out, lse = jax.lax.map(lambda c: attend(*c), chunks)
        out, lse = out.reshape(-1, *out.shape[2:])[:num_tokens], lse.reshape(
            -1, *lse.shape[2:])[:num_tokens]
    return (out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype),
            lse.reshape(num_tokens, num_heads))


ROW_BUDGET_ELEMENTS = 1 << 25  # f32 elements of the per-token K rows of one chunk (128 MiB)


def token_chunk(num_tokens: int, row_elements: int) -> int:
    """Tokens per step of `paged_attention_xla`: all of them when their K rows (``row_elements``
    each) fit in ``ROW_BUDGET_ELEMENTS``, else as many as fit (at least one)."""
    return max(1, min(num_tokens, ROW_BUDGET_ELEMENTS // max(row_elements, 1)))

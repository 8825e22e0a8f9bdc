"""Ragged paged attention: prefill chunks, speculative decoding and decode in one call.

Every sequence brings ``q_len_b >= 0`` new query tokens (packed in batch order in ``q``), already
written to the cache, so its ``n = context_lens[b]`` cached tokens include them. Query ``i`` of
sequence ``b`` sits at position ``p = n - q_len_b + i`` and attends causally to positions
``j <= p`` (and, with a sliding window, ``j > p - W``). Each query row is one call of
`torch_ref.attention.attend` over its visible positions, so the arithmetic (fp32 scores, scale,
soft-cap, ALiBi, softmax with sink, one cast at the end) is stated once for decode and ragged alike.
"""

from __future__ import annotations

import math

import torch

from torch_ref import _checks
from torch_ref.attention import _multiplier, _window_start, attend


def check_ragged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                        k_scale, v_scale, options: dict) -> None:
    """Every check of `paged_decode_attention`, then those of ``query_start_loc``.

    The decode checks are applied to the per-sequence arrays with a stand-in query of one row per
    sequence (same dtype, heads and head_dim as ``q``; ``q`` itself is checked first, so errors
    about ``q`` name its real shape).
    """
    _checks.check_caches(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _checks.check_query(q, head_dim, num_kv_heads, k_cache.dtype)
    _checks.check_tensor("block_tables", block_tables, 2)
    batch = block_tables.shape[0]
    per_sequence = q.new_empty((batch, q.shape[1], q.shape[2]))
    _checks.check_decode_inputs(per_sequence, k_cache, v_cache, block_tables, context_lens, scale,
                                k_scale, v_scale, options)
    _checks.check_tensor("query_start_loc", query_start_loc, 1)
    _checks.check_index_dtype("query_start_loc", query_start_loc)
    _checks.check_same_device(q=q, query_start_loc=query_start_loc)
    if tuple(query_start_loc.shape) != (batch + 1,):
        raise ValueError(
            f"query_start_loc.shape={tuple(query_start_loc.shape)} must be [batch + 1] ="
            f" ({batch + 1},) (block_tables.shape={tuple(block_tables.shape)})")
    starts = query_start_loc.to(torch.int64)
    if int(starts[0]) != 0:
        raise ValueError(f"query_start_loc[0]={int(starts[0])} must be 0")
    q_lens = starts[1:] - starts[:-1]
    decreasing = q_lens < 0
    if bool(decreasing.any()):
        b = _checks.first_index(decreasing)
        raise ValueError(
            f"query_start_loc must be non-decreasing, got query_start_loc[{b}]={int(starts[b])} >"
            f" query_start_loc[{b + 1}]={int(starts[b + 1])}")
    num_tokens = q.shape[0]
    if int(starts[batch]) > num_tokens:
        raise ValueError(
            f"query_start_loc[{batch}]={int(starts[batch])} exceeds num_tokens = q.shape[0] ="
            f" {num_tokens} (q.shape={tuple(q.shape)})")
    too_many = q_lens > context_lens.to(torch.int64)
    if bool(too_many.any()):
        b = _checks.first_index(too_many)
        raise ValueError(
            f"q_len of sequence {b} = query_start_loc[{b + 1}] - query_start_loc[{b}] ="
            f" {int(q_lens[b])} exceeds context_lens[{b}]={int(context_lens[b])}: the new tokens are"
            " part of the context (they are written before attention)")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Causal attention of each sequence's new tokens over its paged K/V (SPEC.md, "Ragged").

    Sequence ``b`` owns the query rows ``q[query_start_loc[b] : query_start_loc[b + 1]]``
    (``q_len_b`` of them, 0 allowed) and ``n = context_lens[b]`` cached tokens, its new ones
    included (they were written first), read through ``block_tables[b]`` exactly as in
    `paged_decode_attention`. Query ``i`` of the sequence sits at position ``p = n - q_len_b + i``
    and attends to the positions ``j <= p``, and with a sliding window ``W`` only to ``j > p - W``.
    ALiBi adds ``slope[h] * (j - p)``. Soft-cap, sinks, fp8 scales, GQA and fp32 accumulation are
    as in decode, per query row. Rows at or past ``query_start_loc[batch]`` are padding: zeros,
    with ``lse = -inf``. ``paged_decode_attention(q, ...)`` is the case
    ``query_start_loc = arange(batch + 1)`` (for sequences with ``n >= 1``).

    Cache contents at positions a query does not see (later positions of its own sequence, other
    sequences, unwritten slots) may hold anything, NaN included: they are never read for it.

    Written for clarity, not speed: Python loops over sequences and their query rows.

    Args:
      q: ``[num_tokens, num_heads, head_dim]``, fp32 / bf16 / fp16, the new tokens of every
        sequence packed in batch order, then any padding rows.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      block_tables: ``i32[batch, max_blocks]`` (int64 accepted).
      context_lens: ``i32[batch]`` (int64 accepted), each in ``[q_len_b, max_blocks * block_size]``.
      query_start_loc: ``i32[batch + 1]`` (int64 accepted), non-decreasing from 0, the last entry
        at most ``num_tokens``.
      scale, logits_soft_cap, alibi_slopes, sliding_window, sinks, k_scale, v_scale: as in
        `paged_decode_attention`.
      return_lse: also return the natural-log log-sum-exp of each row's final logits.

    Returns:
      ``out [num_tokens, num_heads, head_dim]`` in ``q.dtype``; with ``return_lse`` the pair
      ``(out, lse)``, ``lse`` fp32 ``[num_tokens, num_heads]``, ``-inf`` on padding rows.

    Raises:
      ValueError: everything `paged_decode_attention` refuses (with ``batch`` taken from
        ``block_tables``); ``query_start_loc`` of the wrong rank, dtype or length,
        ``query_start_loc[0] != 0``, a decreasing ``query_start_loc``,
        ``query_start_loc[batch] > num_tokens``, or ``q_len_b > context_lens[b]``.
    """
    options = dict(logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    check_ragged_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale,
                        k_scale, v_scale, options)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_mult, v_mult = _multiplier(k_scale), _multiplier(v_scale)
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(block_tables.shape[0]):
        n = int(context_lens[b])
        first, last = int(query_start_loc[b]), int(query_start_loc[b + 1])
        num_pages = -(-n // block_size)  # ceil(n / block_size)
        table = block_tables[b, :num_pages].to(torch.int64)  # never read past the used pages
        k = k_cache[table].reshape(num_pages * block_size, num_kv_heads, head_dim)[:n]
        v = v_cache[table].reshape(num_pages * block_size, num_kv_heads, head_dim)[:n]
        for i, row in enumerate(range(first, last)):
            p = n - (last - first) + i  # this query's position
            start = _window_start(p + 1, sliding_window)  # positions start..p take part
            out[row], lse[row] = attend(
                q[row], k[start:p + 1].float() * k_mult, v[start:p + 1].float() * v_mult, p + 1,
                start, scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                sinks=sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out

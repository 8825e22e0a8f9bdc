"""Decode attention: one new query token per sequence over its cached tokens.

Both public functions gather each sequence's K/V rows and hand them to `attend`, which states the
arithmetic once: scores in fp32, scale before the softmax, soft-cap, ALiBi, sliding window, softmax
with an optional sink, fp32 weighted sum, one cast to ``q.dtype`` at the end.
"""

from __future__ import annotations

import math

import torch

from torch_ref import _checks


def _window_start(n: int, sliding_window: int | None) -> int:
    """First position that takes part: the newest ``min(W, n)`` tokens, ``p > n - 1 - W``."""
    return 0 if sliding_window is None else max(0, n - sliding_window)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    n: int,
    start: int,
    scale: float,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence's query over its positions ``[start, n)``, all in fp32.

    Args:
      q: ``[num_heads, head_dim]``, any float dtype.
      k, v: ``[n - start, num_kv_heads, head_dim]`` float32, the rows of positions ``start..n-1``.
      n: the sequence's context length (positions are numbered ``0..n-1``).
      start: the first position present in ``k`` / ``v``.

    Returns:
      ``(out [num_heads, head_dim] fp32, lse [num_heads] fp32)``. With no rows the output is zeros
      and the lse ``-inf`` (a sink alone has no value row, so the output is still zeros).
    """
    num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] == 0:
        zeros = torch.zeros(num_heads, head_dim, dtype=torch.float32, device=q.device)
        return zeros, torch.full((num_heads,), -math.inf, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    # GQA: head h reads kv head h // group, so each kv head is repeated `group` times in a row.
    k = k.repeat_interleave(group, dim=1)  # [len, H, D]
    v = v.repeat_interleave(group, dim=1)  # [len, H, D]
    s = torch.einsum("hd,phd->hp", q.float(), k) * scale  # [H, len]
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if alibi_slopes is not None:
        positions = torch.arange(start, n, device=q.device, dtype=torch.float32)
        s = s + alibi_slopes[:, None] * (positions - (n - 1))[None, :]
    m = s.max(dim=-1).values  # [H]
    if sinks is not None:
        m = torch.maximum(m, sinks)
    e = torch.exp(s - m[:, None])  # [H, len]
    denom = e.sum(dim=-1)  # [H]
    if sinks is not None:
        denom = denom + torch.exp(sinks - m)
    out = torch.einsum("hp,phd->hd", e, v) / denom[:, None]
    return out, m + torch.log(denom)


def _multiplier(scale) -> float | torch.Tensor:
    """An fp8 scale as the multiplier of ``stored.float()``: 1 without one, a 0-d tensor for a
    tensor (the same fp32 product as a python float rounded to fp32)."""
    if scale is None:
        return 1.0
    return scale.reshape(()) if isinstance(scale, torch.Tensor) else scale


def _finish(outs: list, lses: list, q: torch.Tensor, return_lse: bool):
    """Stack the per-sequence results, cast the output once to ``q.dtype``."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        out = q.new_zeros(0, num_heads, head_dim)
        lse = q.new_zeros(0, num_heads, dtype=torch.float32)
    else:
        out, lse = torch.stack(outs).to(q.dtype), torch.stack(lses)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
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
    """Attention of each sequence's single query over its paged K/V.

    Sequence ``b`` has ``n = context_lens[b]`` cached tokens (its new token included; there is no
    causal mask). They live in the first ``nb = ceil(n / block_size)`` physical blocks listed in
    ``block_tables[b]``, in logical order; the last block is usually partial and its positions
    ``>= n`` do not exist. Entries ``block_tables[b, nb:]`` are never read, so they may hold
    anything. Query head ``h`` attends with kv head ``h // (num_heads // num_kv_heads)``
    (grouped-query attention: ``repeat_interleave``, not ``repeat``).

    Per sequence and head, in fp32: ``s_p = (q . k_p) * scale`` for ``p in [0, n)``, then
    ``s_p = cap * tanh(s_p / cap)`` (soft-cap), ``s_p += slope_h * (p - (n - 1))`` (ALiBi), only the
    newest ``min(W, n)`` positions kept (sliding window: blocks wholly outside it are not read),
    ``out = sum_p e^(s_p - m) v_p / (sum_p e^(s_p - m) + e^(sink_h - m))`` with
    ``m = max(max_p s_p, sink_h)`` (the sink term only when ``sinks`` is given), cast once to
    ``q.dtype``. A zero-length row (``n == 0``, a padded batch row) gives zeros, never NaN.

    Cache contents outside a sequence's valid tokens (other sequences, unwritten slots, the tail
    of its last block) may hold anything, NaN and Inf included: they are never read.

    Written for clarity, not speed: a Python loop over the batch.

    Args:
      q: ``[batch, num_heads, head_dim]``, fp32 / bf16 / fp16.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      block_tables: ``i32[batch, max_blocks]`` (int64 accepted).
      context_lens: ``i32[batch]`` (int64 accepted), each in ``[0, max_blocks * block_size]``.
      scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.
      logits_soft_cap: ``cap > 0`` or None.
      alibi_slopes: ``f32[num_heads]`` or None.
      sliding_window: ``W >= 1`` or None.
      sinks: ``f32[num_heads]`` or None, one extra logit per head with no value row.
      k_scale, v_scale: dequantization scales of an fp8 cache (``stored.float() * scale``): python
        floats or float32 tensors of shape () or (1,), finite and > 0.
      return_lse: also return the natural-log log-sum-exp of the final logits.

    Returns:
      ``out [batch, num_heads, head_dim]`` in ``q.dtype``; with ``return_lse`` the pair
      ``(out, lse)``, ``lse`` fp32 ``[batch, num_heads]``, ``-inf`` on zero-length rows.

    Raises:
      ValueError: wrong ranks, dtypes or devices; ``q.dtype`` other than the cache's (except over
        an fp8 cache); ``num_heads % num_kv_heads != 0``; a head_dim or
        batch mismatch; a negative length or one beyond the table's capacity; a block id outside
        ``[0, num_blocks)`` in the valid part of a table; bad extension options.
    """
    options = dict(logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _checks.check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale,
                                v_scale, options)
    batch, _, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_mult = _multiplier(k_scale)
    v_mult = _multiplier(v_scale)
    outs, lses = [], []
    for b in range(batch):
        n = int(context_lens[b])
        num_pages = -(-n // block_size)  # ceil(n / block_size)
        table = block_tables[b, :num_pages].to(torch.int64)  # never read past the used pages
        k = k_cache[table].reshape(num_pages * block_size, num_kv_heads, head_dim)[:n]
        v = v_cache[table].reshape(num_pages * block_size, num_kv_heads, head_dim)[:n]
        start = _window_start(n, sliding_window)
        out, lse = attend(q[b], k[start:].float() * k_mult, v[start:].float() * v_mult, n, start,
                          scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                          sinks=sinks)
        outs.append(out)
        lses.append(lse)
    return _finish(outs, lses, q, return_lse)


def dense_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """The same attention over contiguous K/V: sequence ``b`` uses ``k[b, :context_lens[b]]``.

    The self-check for paging (invariant I4): gathering a paged cache into this layout and calling
    this function must give exactly what `paged_decode_attention` gives.

    Args:
      q: ``[batch, num_heads, head_dim]``.
      k, v: ``[batch, max_len, num_kv_heads, head_dim]``, fp32 / bf16 / fp16.
      context_lens: ``i32[batch]`` (int64 accepted), each in ``[0, max_len]``.
      scale, logits_soft_cap, alibi_slopes, sliding_window, sinks, return_lse: as in
        `paged_decode_attention`.

    Returns:
      As `paged_decode_attention`.
    """
    options = dict(logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _checks.check_dense_inputs(q, k, v, context_lens, scale, options)
    batch, _, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    outs, lses = [], []
    for b in range(batch):
        n = int(context_lens[b])
        start = _window_start(n, sliding_window)
        out, lse = attend(q[b], k[b, start:n].float(), v[b, start:n].float(), n, start, scale,
                          logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sinks=sinks)
        outs.append(out)
        lses.append(lse)
    return _finish(outs, lses, q, return_lse)

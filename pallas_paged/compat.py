"""JAX's TPU ``ragged_paged_attention`` signature, on GPUs: what the JAX serving engines call.

``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (and the engines built on it) take
one fused cache ``kv_pages [total_pages, page_size, 2 * num_kv_heads, head_dim]``, K of kv head
``h`` at combined head ``2h`` and V at ``2h + 1``, with a dynamic sequence count. Moving such a
call to a GPU is one import::

    # from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    from pallas_paged.compat import ragged_paged_attention

    out = ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                 sm_scale=head_dim ** -0.5, sliding_window=None, soft_cap=None)

It runs `pallas_paged.paged_attention_fused` (the Pallas kernel on a GPU, interpret mode or the
XLA path on a CPU), reading the fused pages in place; `pallas_paged.write_kv_fused` writes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged.ragged_attention.api import paged_attention_fused

# The masking value of the TPU kernel's signature (a finite stand-in for -inf there).
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)


def ragged_paged_attention(
    queries: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """Ragged paged attention with the signature of JAX's TPU kernel, over the fused layout.

    Sequence ``b < num_seqs[0]`` owns ``queries[cu_q_lens[b] : cu_q_lens[b + 1]]`` and
    ``kv_lens[b]`` cached tokens (its new ones included: written before the call), in pages
    ``page_indices[b, : ceil(kv_lens[b] / page_size)]``. Query ``i`` of ``q_len`` sits at
    position ``p = kv_lens[b] - q_len + i`` and attends to the positions ``j <= p`` (and, with a
    window ``W``, ``j > p - W``); scores are ``q . k * sm_scale``, soft-capped with ``soft_cap``.
    Entries at or past ``num_seqs[0]`` are ignored, as are the rows at or past
    ``cu_q_lens[num_seqs[0]]`` (they come out zero here).

    What is computed, where it differs from TPU's reference (`ref_ragged_paged_attention`):
    scores, softmax and the weighted sum accumulate in fp32 and the output is rounded once to
    ``queries.dtype`` (the reference rounds the probabilities to the value dtype before the
    second product); masked positions are excluded exactly (``-inf``; ``mask_value`` is accepted
    and has no other effect: a query always sees at least its own position, so a finite mask
    changes nothing but rounding); fp8 pages (float8_e4m3fn) are dequantized to fp32 with
    ``k_scale`` / ``v_scale`` (the reference rounds them to the query dtype). The results are
    held to the float64 truth within FlashAttention's rule (docs/PARITY.md), as the reference's.

    Args:
      queries: ``[max_num_batched_tokens, num_q_heads, head_dim]``.
      kv_pages: ``[total_pages, page_size, 2 * num_kv_heads, head_dim]``, the queries' dtype, or
        float8_e4m3fn with ``k_scale`` and ``v_scale``.
      kv_lens: ``i32[max_num_seqs]``.
      page_indices: ``i32[max_num_seqs, pages_per_seq]``.
      cu_q_lens: ``i32[max_num_seqs + 1]``, non-decreasing from 0.
      num_seqs: ``i32[1]``, the sequences in use (may be traced).
      sm_scale, sliding_window, soft_cap: as in the TPU kernel (static python values;
        ``soft_cap`` 0 is refused there and here).
      k_scale, v_scale: the dequantization scales of float8_e4m3fn pages (python floats), which
        they require; refused for other pages (the TPU kernel would multiply any cache by them).
      mask_value: accepted for the signature; see above.
      num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes: the TPU kernel's tuning
        arguments, accepted and ignored (the GPU kernel picks its own tiles).
      impl, interpret: as `pallas_paged.paged_attention` (``"auto"``, ``"pallas"``, ``"mosaic"``
        or ``"xla"``).

    Returns:
      ``[max_num_batched_tokens, num_q_heads, head_dim]`` in ``queries.dtype``.

    Raises:
      ValueError: as `pallas_paged.paged_attention_fused` (shapes, dtypes, options; in an eager
        call the values too), and for ``num_seqs`` of a shape other than ``(1,)``.
    """
    del num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes  # TPU tiling only
    for name, x in (("num_seqs", num_seqs), ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
        _validation.check_index_array(name, x, 1)
    if tuple(num_seqs.shape) != (1,):
        raise ValueError(f"num_seqs.shape={tuple(num_seqs.shape)} must be (1,)")
    if mask_value is not None and (isinstance(mask_value, bool)
                                   or not isinstance(mask_value, (int, float))):
        raise ValueError(f"mask_value must be a python float or None, got {mask_value!r}")
    if soft_cap is not None and soft_cap == 0:
        raise ValueError(f"soft_cap={soft_cap} must not be 0")
    max_num_seqs = kv_lens.shape[0]
    count = jnp.clip(jnp.asarray(num_seqs).reshape(()).astype(jnp.int32), 0, max_num_seqs)
    in_use = jnp.arange(max_num_seqs) < count
    context_lens = jnp.where(in_use, kv_lens, 0).astype(kv_lens.dtype)
    # Sequences at or past num_seqs own no rows: their starts all become cu_q_lens[num_seqs].
    starts = jnp.asarray(cu_q_lens)
    query_start_loc = jnp.where(jnp.arange(max_num_seqs + 1) <= count, starts, starts[count])
    return paged_attention_fused(
        queries, kv_pages, page_indices, context_lens, query_start_loc.astype(starts.dtype),
        scale=sm_scale, logits_soft_cap=soft_cap, sliding_window=sliding_window,
        k_scale=k_scale, v_scale=v_scale, impl=impl, interpret=interpret)


def ragged_paged_attention_v3(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    *,
    use_causal_mask: bool = True,
    update_kv_cache: bool = True,
    skip_kv_mask: bool = False,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out_dtype=None,
    mask_value: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    chunk_prefill_size: int | None = None,
    d_block_sizes=None,
    p_block_sizes=None,
    m_block_sizes=None,
    vmem_limit_bytes: int | None = None,
    debug_mode: bool = False,
    disable_bounds_checks: bool = True,
    disable_semaphore_checks: bool = True,
    impl: str = "auto",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The new tokens' keys and values written into the cache, then ragged paged attention over
    it: the signature and semantics of tpu-inference's ``ragged_paged_attention`` (v3), which
    sglang-jax's shares, on GPUs. Moving a call is one import::

        from pallas_paged.compat import ragged_paged_attention_v3 as ragged_paged_attention

        out, kv_cache = ragged_paged_attention(queries, keys, values, kv_cache, kv_lens,
                                               page_indices, cu_q_lens, distribution,
                                               sm_scale=head_dim ** -0.5)

    The cache is TPU's packed fused layout ``[total_pages, page_size, 2 * num_kv_heads // P, P,
    head_dim_padded]`` (``P = 4 // itemsize`` combined heads per 32-bit word: 1 for float32, 2
    for 16-bit, 4 for fp8), which is, bit for bit, the fused layout ``[total_pages, page_size,
    2 * num_kv_heads, head_dim_padded]`` (K of kv head ``h`` at combined head ``2h``, V at
    ``2h + 1``) that `ragged_paged_attention` and `pallas_paged.paged_attention_fused` read in
    place; the reshape between them copies nothing. ``head_dim_padded`` may exceed the queries'
    ``head_dim`` (TPU pads it to a multiple of 128): the queries and new rows are padded with
    zeros to it, which changes no score, and the output is cut back.

    Sequence ``b < distribution[2]`` owns query rows ``cu_q_lens[b] : cu_q_lens[b + 1]``
    (``q_len`` of them) and ``kv_lens[b]`` tokens, the new ones included: with
    ``update_kv_cache`` its new row ``j`` of ``keys`` / ``values`` is stored at position
    ``p = kv_lens[b] - q_len + j``, page ``page_indices[b * pages_per_seq + p // page_size]``,
    row ``p % page_size``, as given (they have the cache's dtype, fp8 included: already
    quantized); then its queries attend as in `ragged_paged_attention` (position ``p`` sees
    ``j <= p``, and with a window ``W`` ``j > p - W``). Every new token is written, whatever the
    window. Nothing else in the cache changes; rows at or past ``cu_q_lens[distribution[2]]``
    are neither written nor attended (their output is zero).

    Where TPU's kernel differs: ``distribution``'s first two entries (its decode / chunked-prefill
    / mixed split, which picks one of three TPU kernels per range, and skips the middle range
    when ``chunk_prefill_size`` is None) do not change what is computed here: every sequence
    below ``distribution[2]`` is. ``q_scale`` (TPU rounds the query to the cache's dtype after
    dividing by it) is accepted, and the query keeps its dtype, the product it stands for being
    exact here. ``out_dtype`` (TPU's accumulator dtype) is accepted: accumulators are fp32 and
    the output has the queries' dtype. ``mask_value``, the scales and the precision are as in
    `ragged_paged_attention`.

    Args:
      queries: ``[T, num_q_heads, head_dim]``.
      keys, values: ``[T, num_kv_heads, head_dim]`` in the cache's dtype, the new tokens' rows,
        aligned with ``queries``.
      kv_cache: ``[total_pages, page_size, 2 * num_kv_heads // P, P, head_dim_padded]``, the
        queries' dtype (16-bit or float32), or float8_e4m3fn with ``k_scale`` and ``v_scale``.
      kv_lens: ``i32[max_num_seqs]``, each length with the new tokens.
      page_indices: ``i32[max_num_seqs * pages_per_seq]``, each sequence's pages in turn.
      cu_q_lens: ``i32[max_num_seqs + 1]``, non-decreasing from 0.
      distribution: ``i32[3]``; ``distribution[2]`` sequences are in use (may be traced).
      use_causal_mask: True (attention without the causal mask is refused).
      update_kv_cache: False: nothing is written and ``keys`` / ``values`` are not read.
      sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale: as in
        `ragged_paged_attention`.
      skip_kv_mask, chunk_prefill_size, d_block_sizes, p_block_sizes, m_block_sizes,
        vmem_limit_bytes, debug_mode, disable_bounds_checks, disable_semaphore_checks: TPU's
        tuning and debugging arguments, accepted and ignored.
      impl, interpret: as `pallas_paged.paged_attention`.

    Returns:
      ``(out [T, num_q_heads, head_dim] in queries.dtype, the updated kv_cache)``; under
      ``jax.jit`` with the cache donated, the update happens in place.

    Raises:
      ValueError: for a cache not in the packed fused layout of ``keys``' heads and dtype,
        ``use_causal_mask=False``, ``distribution`` not ``(3,)``, ``page_indices`` not a whole
        number of pages per sequence; else as `ragged_paged_attention`.
    """
    del (skip_kv_mask, out_dtype, q_scale, chunk_prefill_size, d_block_sizes, p_block_sizes,
         m_block_sizes, vmem_limit_bytes, debug_mode, disable_bounds_checks,
         disable_semaphore_checks)  # TPU's tuning, debugging and internal precision
    if use_causal_mask is not True:
        raise ValueError(f"use_causal_mask={use_causal_mask!r}: only causal attention is"
                         " supported (use_causal_mask=True)")
    if not isinstance(update_kv_cache, bool):
        raise ValueError(f"update_kv_cache must be a python bool, got {update_kv_cache!r}")
    for name, x in (("distribution", distribution), ("page_indices", page_indices),
                    ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
        _validation.check_index_array(name, x, 1)
    if tuple(distribution.shape) != (3,):
        raise ValueError(f"distribution.shape={tuple(distribution.shape)} must be (3,)")
    fused = _unpacked_cache(kv_cache, keys, values, queries)
    max_num_seqs = kv_lens.shape[0]
    if max_num_seqs == 0 or page_indices.shape[0] % max_num_seqs:
        raise ValueError(
            f"page_indices.shape={tuple(page_indices.shape)} must hold the same number of pages"
            f" for each of the {max_num_seqs} sequences of kv_lens.shape={tuple(kv_lens.shape)}")
    tables = jnp.reshape(page_indices, (max_num_seqs, -1))
    num_seqs = jnp.reshape(distribution[2], (1,))
    head_dim, padded_dim = queries.shape[2], fused.shape[3]
    if update_kv_cache:
        fused = _store_new_rows(fused, keys, values, kv_lens, tables, cu_q_lens, num_seqs,
                                padded_dim)
    out = ragged_paged_attention(
        _pad_head_dim(queries, padded_dim), fused, kv_lens, tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=mask_value, k_scale=k_scale, v_scale=v_scale, impl=impl, interpret=interpret)
    return out[..., :head_dim], jnp.reshape(fused, kv_cache.shape)


def _unpacked_cache(kv_cache, keys, values, queries):
    """``kv_cache`` in TPU's packed layout ``[pages, page_size, 2 * kvh // P, P, D_padded]`` as the
    fused layout ``[pages, page_size, 2 * kvh, D_padded]`` (a reshape: the same bits), after
    checking it against ``keys`` / ``values`` ``[T, kvh, D]`` and ``queries``."""
    if not hasattr(kv_cache, "shape") or len(kv_cache.shape) != 5:
        raise ValueError(
            f"kv_cache must be TPU's packed fused cache [total_pages, page_size, 2 * num_kv_heads"
            f" // P, P, head_dim], got shape {tuple(getattr(kv_cache, 'shape', ()))}")
    pages, page_size, words, packing, padded_dim = kv_cache.shape
    itemsize = jnp.dtype(kv_cache.dtype).itemsize
    for name, x in (("keys", keys), ("values", values)):
        if tuple(x.shape[:1]) != tuple(queries.shape[:1]) or len(x.shape) != 3:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, num_kv_heads, head_dim]"
                             f" with T = queries.shape[0] = {queries.shape[0]}")
        if jnp.dtype(x.dtype) != jnp.dtype(kv_cache.dtype):
            raise ValueError(f"{name}.dtype={jnp.dtype(x.dtype)} must be the cache's dtype"
                             f" kv_cache.dtype={jnp.dtype(kv_cache.dtype)}")
    if tuple(values.shape) != tuple(keys.shape) or keys.shape[2] != queries.shape[2]:
        raise ValueError(f"keys.shape={tuple(keys.shape)} and values.shape={tuple(values.shape)}"
                         f" must be equal, with queries' head_dim {queries.shape[2]}")
    kvh = keys.shape[1]
    if packing != max(4 // itemsize, 1) or words * packing != 2 * kvh:
        raise ValueError(
            f"kv_cache.shape={tuple(kv_cache.shape)} ({jnp.dtype(kv_cache.dtype)}) must pack the"
            f" {2 * kvh} combined heads of keys.shape={tuple(keys.shape)} as"
            f" [.., {2 * kvh * itemsize // 4 or 2 * kvh}, {max(4 // itemsize, 1)}, ..] (combined"
            " heads padded past 2 * num_kv_heads are not supported)")
    if padded_dim < queries.shape[2]:
        raise ValueError(f"kv_cache's head_dim {padded_dim} must be at least queries'"
                         f" {queries.shape[2]}")
    return jnp.reshape(kv_cache, (pages, page_size, words * packing, padded_dim))


def _pad_head_dim(x, padded_dim: int):
    """``x [..., D]`` with zero columns up to ``padded_dim``."""
    pad = padded_dim - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def _store_new_rows(fused, keys, values, kv_lens, tables, cu_q_lens, num_seqs, padded_dim):
    """``fused`` with row ``t`` of ``keys`` / ``values`` at its token's position (see
    `ragged_paged_attention_v3`), interleaved; rows of no sequence in use, or whose position
    falls outside the sequence's pages, are dropped."""
    pages, page_size, combined, _ = fused.shape
    max_num_seqs, pages_per_seq = tables.shape
    num_tokens = keys.shape[0]
    count = jnp.clip(num_seqs[0].astype(jnp.int32), 0, max_num_seqs)
    # the query start locations as the attention takes them (clamped, non-decreasing from 0)
    starts = jax.lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)).at[0].set(0)
    starts = jnp.where(jnp.arange(max_num_seqs + 1) <= count, starts, starts[count])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(starts, t, side="right") - 1, 0, max_num_seqs - 1)
    q_len = starts[b + 1] - starts[b]
    pos = kv_lens.astype(jnp.int32)[b] - q_len + (t - starts[b])
    page = pos // page_size
    block = tables[b, jnp.clip(page, 0, pages_per_seq - 1)].astype(jnp.int32)
    keep = (t < starts[count]) & (pos >= 0) & (page < pages_per_seq)
    keep &= (block >= 0) & (block < pages)
    row = jnp.where(keep, block * page_size + pos % page_size, pages * page_size)  # dropped
    new = jnp.stack([_pad_head_dim(keys, padded_dim), _pad_head_dim(values, padded_dim)],
                    axis=2).reshape(num_tokens, combined, padded_dim)
    flat = jnp.reshape(fused, (pages * page_size, combined, padded_dim))
    return jnp.reshape(flat.at[row].set(new, mode="drop"), fused.shape)

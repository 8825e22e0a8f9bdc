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

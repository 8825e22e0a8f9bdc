"""The fused KV layout: one cache holding K and V, as the JAX serving engines keep it (SPEC.md,
"Fused KV layout").

``kv_cache [num_blocks, block_size, 2 * num_kv_heads, head_dim]`` holds K of kv head ``h`` at
combined head ``2h`` and V at ``2h + 1``. It is the same cache as the pair `split_kv_cache`
returns, so every operation here is its separate-layout counterpart on those two views::

    kv_cache[blk, off] = [k_h0, v_h0, k_h1, v_h1, ...]     # each [head_dim]
    k_cache, v_cache = kv_cache[:, :, 0::2], kv_cache[:, :, 1::2]
"""

from __future__ import annotations

import torch

from torch_ref import _checks
from torch_ref.attention import paged_decode_attention
from torch_ref.cache import write_kv
from torch_ref.ragged import paged_attention


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_cache[:, :, 0::2], kv_cache[:, :, 1::2])``: the K and V caches a fused cache is, as
    views (writing through them writes ``kv_cache``).

    Raises:
      ValueError: ``kv_cache`` is not a rank-4 tensor with an even third dimension.
    """
    _checks.check_tensor("kv_cache", kv_cache, 4)
    if kv_cache.shape[2] % 2 or min(kv_cache.shape) < 1:
        raise ValueError(
            f"kv_cache.shape={tuple(kv_cache.shape)} must be [num_blocks, block_size,"
            " 2 * num_kv_heads, head_dim] with every dimension >= 1: K of kv head h at 2h,"
            " V at 2h + 1")
    return kv_cache[:, :, 0::2], kv_cache[:, :, 1::2]


def write_kv_fused(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None) -> None:
    """`write_kv` into a fused cache, in place: ``k[i, h]`` lands at ``kv_cache[s // bs, s % bs,
    2h]`` and ``v[i, h]`` at ``2h + 1``; everything else keeps its bits."""
    write_kv(*split_kv_cache(kv_cache), k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_decode_attention_fused(q: torch.Tensor, kv_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 scale: float | None = None, **options):
    """`paged_decode_attention` over a fused cache (the same result as over its two halves)."""
    return paged_decode_attention(q, *split_kv_cache(kv_cache), block_tables, context_lens, scale,
                                  **options)


def paged_attention_fused(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float | None = None, **options):
    """`paged_attention` (ragged) over a fused cache (the same result as over its two halves)."""
    return paged_attention(q, *split_kv_cache(kv_cache), block_tables, context_lens,
                           query_start_loc, scale, **options)

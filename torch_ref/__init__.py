"""torch_ref: the PyTorch reference that defines pallas-paged's semantics (see SPEC.md).

Clear before fast: every other implementation is judged against these functions.

- `write_kv`: store new tokens' K/V at their physical slots (slot -1 = padding, writes nothing).
- `paged_decode_attention`: one query per sequence over its paged K/V.
- `dense_decode_attention`: the same over contiguous K/V, the self-check for paging.
- `paged_attention`: ragged paged attention, causal over each sequence's new tokens (prefill
  chunks, speculative decoding and decode in one call).
- `write_kv_fused`, `paged_decode_attention_fused`, `paged_attention_fused`: the same over one
  fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` (K of kv head ``h`` at
  ``2h``, V at ``2h + 1``), the pair `split_kv_cache` returns.
"""

from torch_ref.attention import dense_decode_attention, paged_decode_attention
from torch_ref.cache import quantize_fp8, write_kv
from torch_ref.fused import (paged_attention_fused, paged_decode_attention_fused,
                             split_kv_cache, write_kv_fused)
from torch_ref.ragged import paged_attention

__all__ = ["write_kv", "paged_decode_attention", "dense_decode_attention", "quantize_fp8",
           "paged_attention", "split_kv_cache", "write_kv_fused", "paged_decode_attention_fused",
           "paged_attention_fused"]

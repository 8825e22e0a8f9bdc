"""pallas_paged: paged KV-cache write, paged decode attention and ragged paged attention in JAX,
with Pallas GPU kernels.

The semantics are those of `torch_ref` (SPEC.md). One folder per operation (``cache_write/``,
``decode_attention/``, ``ragged_attention/``), each split into ``api.py`` (validation, the choice
of kernel and config, the public function), one file per backend (``pallas_triton.py``,
``mosaic_gpu.py``, ``xla.py``), one config file per kernel with knobs (``pallas_triton_config.py``,
``mosaic_gpu_config.py``: the frozen config, its heuristic, the tuned table) and ``shape.py`` (the
static facts the configs are keyed by). What one backend's kernels share lives in
``_triton_common.py``, ``_mosaic_common.py`` and ``_xla_common.py``; what every attention
implementation shares in ``_attention_common.py``; fp8 scales and quantization in ``_fp8.py``.

- `write_kv`: masked scatter of new tokens' K/V into the paged cache (slot -1 writes nothing).
- `decode`: paged decode attention; ``impl="pallas"`` (the kernel, Triton-lowered on GPU,
  interpret mode elsewhere), ``impl="mosaic"`` (a Mosaic GPU kernel: jax >= 0.11.2, sm_90+) or
  ``impl="xla"`` (plain jnp).
- `paged_attention`: ragged paged attention (``ragged_attention/``), causal over each sequence's
  new tokens: prefill chunks, speculative decoding and decode in one call; same impls.
- `write_kv_fused`, `decode_fused`, `paged_attention_fused`: the same over one fused cache
  ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` (K of kv head ``h`` at ``2h``, V at
  ``2h + 1``), the JAX serving engines' layout; `pallas_paged.compat.ragged_paged_attention`
  takes JAX's TPU ``ragged_paged_attention`` signature.
- `validate_write_inputs`, `validate_decode_inputs`, `validate_attention_inputs`: eager value
  checks for untrusted inputs.
- `DecodeConfig`, `MosaicDecodeConfig`, `AttentionConfig`, `MosaicAttentionConfig`: the kernels'
  knobs.
- `shard_decode`, `shard_paged_attention`, `shard_write_kv`: the same under `jax.shard_map`, kv
  heads (tensor-parallel) and/or sequences (batch-parallel) across devices, with no communication.
"""

from pallas_paged._validation import (validate_attention_inputs, validate_decode_inputs,
                                      validate_write_inputs)
from pallas_paged.cache_write.api import write_kv, write_kv_fused
from pallas_paged._fp8 import quantize_fp8
from pallas_paged.decode_attention.api import decode, decode_fused
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
from pallas_paged.decode_attention.pallas_triton_config import DecodeConfig, get_heuristic_config
from pallas_paged.decode_attention.shape import DecodeShape
from pallas_paged.ragged_attention.api import paged_attention, paged_attention_fused
from pallas_paged.ragged_attention.mosaic_gpu_config import MosaicAttentionConfig
from pallas_paged.ragged_attention.pallas_triton_config import AttentionConfig
from pallas_paged.ragged_attention.shape import AttentionShape
from pallas_paged.sharding import (attention_shardings, decode_shardings, shard_decode,
                                   shard_paged_attention, shard_write_kv, write_shardings)

__all__ = [
    "write_kv",
    "decode",
    "paged_attention",
    "write_kv_fused",
    "decode_fused",
    "paged_attention_fused",
    "validate_write_inputs",
    "validate_decode_inputs",
    "validate_attention_inputs",
    "DecodeConfig",
    "MosaicDecodeConfig",
    "AttentionConfig",
    "MosaicAttentionConfig",
    "AttentionShape",
    "DecodeShape",
    "get_heuristic_config",
    "quantize_fp8",
    "shard_decode",
    "shard_paged_attention",
    "shard_write_kv",
    "decode_shardings",
    "attention_shardings",
    "write_shardings",
]

"""pallas_paged: paged KV-cache write and paged decode attention in JAX, with a Pallas GPU kernel.

The semantics are those of `torch_ref` (SPEC.md).

- `write_kv`: masked scatter of new tokens' K/V into the paged cache (slot -1 writes nothing).
- `decode`: paged decode attention; ``impl="pallas"`` (the kernel, Triton-lowered on GPU,
  interpret mode elsewhere) or ``impl="xla"`` (plain jnp).
- `validate_write_inputs`, `validate_decode_inputs`: eager value checks for untrusted inputs.
- `DecodeConfig`: the kernel's knobs.
- `shard_decode`, `shard_write_kv`: the same under `jax.shard_map`, kv heads (tensor-parallel) and/or
  sequences (batch-parallel) across devices, with no communication.
"""

from pallas_paged.config import DecodeConfig, DecodeShape, get_heuristic_config
from pallas_paged.decode import decode
from pallas_paged.sharding import decode_shardings, shard_decode, shard_write_kv, write_shardings
from pallas_paged.validate import validate_decode_inputs, validate_write_inputs
from pallas_paged.write import quantize_fp8, write_kv

__all__ = [
    "write_kv",
    "decode",
    "validate_write_inputs",
    "validate_decode_inputs",
    "DecodeConfig",
    "DecodeShape",
    "get_heuristic_config",
    "quantize_fp8",
    "shard_decode",
    "shard_write_kv",
    "decode_shardings",
    "write_shardings",
]

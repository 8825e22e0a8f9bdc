"""The static facts of a ragged-attention call that its kernel and config depend on, and the key
they are looked up under in the tuned tables."""

from __future__ import annotations

import dataclasses

from pallas_paged._platform import next_power_of_2


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The static facts a config depends on (all known at trace time)."""

    num_tokens: int
    batch: int
    num_kv_heads: int
    group: int          # query heads per kv head
    head_dim: int
    block_size: int
    capacity: int       # max_blocks * block_size
    cache_dtype: str    # e.g. "bfloat16"


def shape_class(shape: AttentionShape) -> tuple:
    """The key a shape is looked up under: ``(cache dtype, head_dim, group, block_size, batch,
    num_tokens, capacity)``, all but the dtype and block_size rounded up to powers of two."""
    return (shape.cache_dtype, next_power_of_2(shape.head_dim), next_power_of_2(shape.group),
            shape.block_size, next_power_of_2(shape.batch), next_power_of_2(shape.num_tokens),
            next_power_of_2(shape.capacity))

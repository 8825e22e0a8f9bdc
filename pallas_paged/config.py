"""Knobs of the Pallas decode kernel: a frozen, hashable config and the heuristic that picks one."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_paged.platform import next_power_of_2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static knobs of the paged-decode kernel (hashable, so it can be a static jit argument).

    Attributes:
      block_k: tokens per tile (a power of two >= 16). A tile gathers its tokens' rows through the
        block table one token at a time, so it may span several pages (``block_k / block_size``
        pages when ``block_size`` divides it) or part of one; any ``block_size`` works.
      num_splits: KV splits per (sequence, kv head) (flash-decoding). Each split walks an equal
        share of the sequence's tiles; 1 means no split and no merge step.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the tile loop.
    """

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_k", "num_splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeConfig.{name}={value!r} must be a positive int")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"DecodeConfig.block_k={self.block_k} must be a power of two >= 16")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"DecodeConfig.num_warps={self.num_warps} must be a power of two")


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The static facts a config depends on (all known at trace time)."""

    batch: int
    num_kv_heads: int
    group: int          # query heads per kv head
    head_dim: int
    block_size: int
    capacity: int       # max_blocks * block_size: the longest context the tables can hold
    cache_dtype: str    # e.g. "bfloat16"


def _num_splits(shape: DecodeShape, block_k: int, sm_count: int) -> int:
    """About four programs per multiprocessor, without splits shorter than 4 tiles.

    Measured on the H200 (132 SMs, bf16, D=128): the best split counts put 512-1024 programs on
    the device (B=32: 2 splits, B=4 at 128K tokens: 16, B=1 at 32K: 64, B=128: 1).
    """
    programs = max(shape.batch * shape.num_kv_heads, 1)
    wanted = (4 * sm_count) / programs
    splits = 1 << max(0, round(math.log2(wanted))) if wanted > 1 else 1
    max_useful = max(1, shape.capacity // (4 * block_k))
    return max(1, min(splits, max_useful, 256))


def get_heuristic_config(shape: DecodeShape, sm_count: int) -> DecodeConfig:
    """A reasonable config for any shape: the fallback of the tuned table."""
    itemsize = jnp.dtype(shape.cache_dtype).itemsize
    padded_dim = next_power_of_2(shape.head_dim)
    # Keep one K tile plus one V tile at about 32 KiB so several stages fit in shared memory.
    block_k = max(16, min(128, (16 * 1024) // (padded_dim * itemsize)))
    block_k = min(block_k, max(16, next_power_of_2(shape.capacity)))
    return DecodeConfig(
        block_k=block_k,
        num_splits=_num_splits(shape, block_k, sm_count),
        num_warps=4 if padded_dim <= 128 else 8,
        num_stages=2,
    )

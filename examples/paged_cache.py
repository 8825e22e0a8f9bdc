"""Per-layer paged KV caches and the block allocator that hands out their blocks.

The caches are ``num_layers`` pairs of ``[num_blocks, block_size, num_kv_heads, head_dim]``
arrays; all layers share one block numbering, so a sequence's block table is valid in every layer.
The allocator keeps a free list of physical block ids: a sequence takes blocks as its length crosses
block boundaries and gives all of them back when it finishes.

Token ``p`` of a sequence with table ``t`` lives at slot ``t[p // block_size] * block_size +
p % block_size``, the ``slot_mapping`` convention of `pallas_paged.write_kv`.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np


def make_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int, dtype) -> list[tuple]:
    """``[(k_cache, v_cache)] * num_layers`` of zeros, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list of physical block ids ``0 .. num_blocks - 1``.

    Blocks come out in first-freed, first-reused order, so a finished sequence's blocks are the
    next ones handed out once the never-used blocks are gone.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"{num_blocks=} must be >= 1")
        self.num_blocks = num_blocks
        self._free = collections.deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks.

        Raises:
          ValueError: fewer than ``count`` blocks are free.
        """
        if count > len(self._free):
            raise ValueError(f"{count=} blocks requested but only {len(self._free)} of"
                             f" {self.num_blocks} are free")
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return ``blocks`` to the free list.

        Raises:
          ValueError: a block is not currently allocated (a double free or a foreign id).
        """
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} is not allocated (double free or foreign id)")
            self._used.remove(block)
            self._free.append(block)


class BlockTable:
    """One sequence's physical blocks, grown on demand from a `BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []

    def ensure(self, num_tokens: int) -> None:
        """Hold enough blocks for positions ``0 .. num_tokens - 1``."""
        missing = blocks_for(num_tokens, self.block_size) - len(self.blocks)
        if missing > 0:
            self.blocks.extend(self.allocator.allocate(missing))

    def slots(self, start: int, stop: int) -> np.ndarray:
        """``i32[stop - start]``: the cache slots of positions ``start .. stop - 1`` (held)."""
        positions = np.arange(start, stop)
        table = np.asarray(self.blocks, np.int64)
        return (table[positions // self.block_size] * self.block_size
                + positions % self.block_size).astype(np.int32)

    def row(self, max_blocks: int) -> np.ndarray:
        """``i32[max_blocks]``: the block table row, padded with block 0 (never read)."""
        if len(self.blocks) > max_blocks:
            raise ValueError(f"{len(self.blocks)=} blocks exceed {max_blocks=}")
        row = np.zeros(max_blocks, np.int32)
        row[:len(self.blocks)] = self.blocks
        return row

    def release(self) -> None:
        """Give every block back to the allocator."""
        self.allocator.free(self.blocks)
        self.blocks = []

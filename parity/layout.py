"""The paged layout of a batch, as a block allocator leaves it: the one builder of block tables that
the parity cases, the tests and the benchmarks share.

Physical blocks are a random permutation (so table order is never memory order), each sequence
takes the next ``ceil(n / block_size)`` of them, ``spare_blocks`` more exist that no sequence
owns, and every table row's tail past its used entries holds ids that must never be read: garbage
that may fault (huge, negative) and stale ids of real blocks (someone else's data).

Example (``block_size = 4``, ``lens = [6, 0, 3]``: 2 + 0 + 1 pages, and 2 spare blocks)::

    physical = [2, 0, 4, 1, 3]         # rng.permutation(num_blocks), num_blocks = 3 + 2
    block_tables[0, :2] = [2, 0]       # sequence 0: positions 0-3 in block 2, 4-5 in block 0
    block_tables[2, :1] = [4]          # sequence 2: positions 0-2 in block 4
    slot of (sequence 0, position 5) = block_tables[0, 5 // 4] * 4 + 5 % 4 = 0 * 4 + 1 = 1
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Ids a table's unused tail may hold: past the cache, the int32 limits' neighbours, negative.
GARBAGE_BLOCK_IDS = (2**30, 2**31 - 1, 99999, -1, -7)


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Where every token of a batch lives.

    Attributes:
      num_blocks: physical blocks of the cache (the sequences' pages plus the spare ones).
      block_tables: ``i32[batch, table_width]``; row ``b``'s first ``ceil(lens[b] / block_size)``
        entries are its pages in logical order, the rest garbage.
      context_lens: ``i32[batch]``.
      slots: ``i64[sum(lens)]``, the flat cache slot of every valid position, in batch order, then
        position order (``seq`` and ``pos`` say whose and which).
      seq, pos: ``i64[sum(lens)]``, each slot's sequence and logical position.
    """

    num_blocks: int
    block_tables: np.ndarray
    context_lens: np.ndarray
    slots: np.ndarray
    seq: np.ndarray
    pos: np.ndarray

    def valid_slots(self, block_size: int) -> np.ndarray:
        """``bool[num_blocks * block_size]``: the slots that hold a valid token of the batch."""
        valid = np.zeros(self.num_blocks * block_size, bool)
        valid[self.slots] = True
        return valid


def paged_layout(rng: np.random.Generator, lens, *, block_size: int,
                 table_width: int | None = None, spare_blocks: int = 0,
                 tail=GARBAGE_BLOCK_IDS) -> PagedLayout:
    """The layout of a batch with context lengths ``lens`` (see the module docstring).

    Args:
      rng: draws the permutation, then (``tail="random"``) the tails.
      lens: the context lengths, ``>= 0``.
      block_size: tokens per block.
      table_width: entries per table row (default: the longest sequence's pages, at least 1).
      spare_blocks: blocks no sequence owns.
      tail: what fills each row past its used entries: a tuple of ids, cycled along the row, or
        ``"random"``: for each entry, with probability 1/2 a garbage id (`GARBAGE_BLOCK_IDS` or
        ``num_blocks``), else a real block id, both drawn from ``rng``.
    """
    lens = np.asarray(lens, np.int64).reshape(-1)
    pages = -(-lens // block_size)
    if table_width is None:
        table_width = max(1, int(pages.max(initial=0)))
    if (pages > table_width).any():
        raise ValueError(f"lens={lens.tolist()} need up to {int(pages.max())} pages, more than"
                         f" table_width={table_width}")
    num_blocks = max(int(pages.sum()) + spare_blocks, 1)
    physical = rng.permutation(num_blocks).astype(np.int32)
    batch = len(lens)
    tables = np.empty((batch, table_width), np.int32)
    garbage = np.asarray(GARBAGE_BLOCK_IDS + (num_blocks,), np.int64)
    start = 0
    for b in range(batch):
        used = int(pages[b])
        tables[b, :used] = physical[start:start + used]
        start += used
        width = table_width - used
        if isinstance(tail, str):
            if tail != "random":
                raise ValueError(f"tail={tail!r} must be a tuple of ids or 'random'")
            stale = rng.integers(0, num_blocks, size=width)
            tables[b, used:] = np.where(rng.random(width) < 0.5, rng.choice(garbage, size=width),
                                        stale)
        else:
            tables[b, used:] = [tail[i % len(tail)] for i in range(used, table_width)]
    seq = np.repeat(np.arange(batch), lens)
    pos = np.concatenate([np.arange(n) for n in lens]) if lens.sum() else np.zeros(0, np.int64)
    slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return PagedLayout(num_blocks=num_blocks, block_tables=tables,
                       context_lens=lens.astype(np.int32), slots=slots, seq=seq, pos=pos)

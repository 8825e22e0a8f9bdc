"""The Pallas Triton ragged-attention kernel's knobs: a frozen, hashable config, the heuristic that
picks one for any shape, and the table of configs tuned on real devices (`lookup`).

The per-sequence query lengths are values, unknown at trace time, so the heuristic reads the
average ``num_tokens / batch``. The evidence behind the rules is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_paged._platform import next_power_of_2
from pallas_paged._triton_common import K_TILE_BYTES, MIN_DOT_ROWS
from pallas_paged.ragged_attention.shape import AttentionShape, shape_class

MAX_DOT_ROWS = 64  # query tokens x GQA group per program at most (the heuristic's choice)
# Short tiles (`AttentionConfig.short_block_q`) where the average query length is below this: a
# batch with many sequences per token is a mixed one, while long prompts alone pay for the second
# tile space.
SHORT_TILES_BELOW_AVG_Q = 128


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static knobs of the ragged paged-attention kernel (hashable: a static jit argument).

    Attributes:
      block_q: query tokens per program (a power of two >= 1). With the GQA group they share the
        M dimension of the kernel's dots: ``M = max(16, next_power_of_2(block_q * group))`` rows.
      short_block_q: 0, or a power of two below ``block_q``: sequences with at most this many new
        tokens (decode steps, speculative steps) then take one tile of ``short_block_q`` tokens
        (``max(16, short_block_q * group)`` dot rows) from ``batch`` programs of their own, spread
        evenly among the ``block_q`` programs of the longer sequences. Their dots are not padded
        to a prefill tile's rows, and their memory-bound programs share the multiprocessors with
        the compute-bound prefill ones. 0: every sequence takes ``block_q`` tiles.
      block_k: K/V tokens per tile (a power of two >= 16), gathered token by token through the
        block table, so any ``block_size`` works.
      num_splits: KV splits per query tile (split-K, for few query tiles over long contexts);
        1 means no split and no merge step.
      num_warps: warps per program (a power of two).
      num_stages: software-pipelining depth of the tile loops.
      fp8_pairs: with an fp8 cache (and an even head_dim), K and V read as 16-bit words of two
        head columns, as `DecodeConfig.fp8_pairs` (every dot operand 16-bit; the dots split into
        the even and the odd columns). No effect on 16-bit caches.
    """

    block_q: int = 16
    short_block_q: int = 0
    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    fp8_pairs: bool = False

    def __post_init__(self):
        if not isinstance(self.fp8_pairs, bool):
            raise ValueError(f"AttentionConfig.fp8_pairs={self.fp8_pairs!r} must be a bool")
        for name in ("block_q", "block_k", "num_splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionConfig.{name}={value!r} must be a positive int")
        if self.block_q & (self.block_q - 1):
            raise ValueError(f"AttentionConfig.block_q={self.block_q} must be a power of two")
        short = self.short_block_q
        if (isinstance(short, bool) or not isinstance(short, int) or short < 0
                or (short and (short & (short - 1) or short >= self.block_q))):
            raise ValueError(f"AttentionConfig.short_block_q={short!r} must be 0 or a power of"
                             f" two below block_q={self.block_q}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"AttentionConfig.block_k={self.block_k} must be a power of two >= 16")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"AttentionConfig.num_warps={self.num_warps} must be a power of two")

    def dot_rows(self, group: int) -> int:
        """M of the dots of a ``block_q`` tile: ``block_q`` tokens x ``group`` heads, padded."""
        return tile_dot_rows(self.block_q, group)

    def long_query_tiles(self, num_tokens: int, batch: int) -> int:
        """An upper bound of the ``block_q`` tiles of any ``query_start_loc``.

        Sequence ``b`` (and the padding rows, as a sequence ``batch``) takes the programs from
        ``query_start_loc[b] // block_q + b`` on, ``ceil(q_len_b / block_q)`` of them; these
        ranges never overlap and all end below ``ceil(num_tokens / block_q) + batch``. With
        ``block_q == 1`` token ``t`` is program ``t``: ``num_tokens`` programs, none idle.
        """
        if self.block_q == 1:
            return max(num_tokens, 1)
        return -(-num_tokens // self.block_q) + batch

    def query_tiles(self, num_tokens: int, batch: int) -> int:
        """The static grid's query axis: the long tiles' bound, plus one short tile per
        sequence with ``short_block_q``."""
        short = batch if self.short_block_q else 0
        return self.long_query_tiles(num_tokens, batch) + short


def tile_dot_rows(tile_q: int, group: int) -> int:
    """M of the kernel's dots for a tile of ``tile_q`` tokens: ``tile_q * group`` rows, padded to
    a power of two of at least `MIN_DOT_ROWS`."""
    return max(MIN_DOT_ROWS, next_power_of_2(tile_q * group))


def heuristic_splits(shape: AttentionShape, block_q: int, block_k: int, sm_count: int) -> int:
    """KV splits for about four programs per multiprocessor, as decode's heuristic, without
    splits shorter than 4 tiles; the active query tiles are about ``ceil(num_tokens /
    block_q)``."""
    programs = max(-(-shape.num_tokens // block_q) * shape.num_kv_heads, 1)
    wanted = (4 * sm_count) / programs
    splits = 1 << max(0, round(math.log2(wanted))) if wanted > 1 else 1
    max_useful = max(1, shape.capacity // (4 * block_k))
    return max(1, min(splits, max_useful, 64))


def get_heuristic_config(shape: AttentionShape, sm_count: int) -> AttentionConfig:
    """A reasonable config for any shape: the fallback of the tuned table.

    ``block_q`` covers the average query length (1 for decode, 4 for 4-token speculation), up to
    `MAX_DOT_ROWS` dot rows for prefill and mixed batches, with 4 warps (8 past head_dim 128) and
    3 pipeline stages; K/V tiles of 64 tokens (32 past head_dim 128), or, when the dots have the
    minimum 16 rows (decode-like, memory-bound), tiles of `K_TILE_BYTES` of K at every width.
    Where ``block_q`` tiles have more than the minimum rows and the average query length is
    below `SHORT_TILES_BELOW_AVG_Q` (a mixed batch), sequences short enough to fill a minimum
    16-row tile take short tiles (``short_block_q``): a decode row then pads a 16-row dot, not a
    64-row one.
    """
    itemsize = jnp.dtype(shape.cache_dtype).itemsize
    padded_dim = next_power_of_2(shape.head_dim)
    avg_q = max(1, -(-shape.num_tokens // max(shape.batch, 1)))
    max_block_q = max(1, MAX_DOT_ROWS // next_power_of_2(shape.group))
    block_q = min(next_power_of_2(avg_q), max_block_q)
    rows = max(MIN_DOT_ROWS, next_power_of_2(block_q * shape.group))
    if rows <= MIN_DOT_ROWS:  # decode-like: memory-bound, decode's tile rule
        block_k = max(16, min(128, K_TILE_BYTES // (padded_dim * itemsize)))
    else:
        block_k = 64 if padded_dim <= 128 else 32
    block_k = min(block_k, max(16, next_power_of_2(shape.capacity)))
    short_block_q = max(1, MIN_DOT_ROWS // next_power_of_2(shape.group))
    return AttentionConfig(
        block_q=block_q,
        short_block_q=(short_block_q if short_block_q < block_q
                       and avg_q < SHORT_TILES_BELOW_AVG_Q else 0),
        block_k=block_k,
        num_splits=heuristic_splits(shape, block_q, block_k, sm_count),
        num_warps=8 if padded_dim > 128 else 4,
        num_stages=2 if rows <= MIN_DOT_ROWS else 3,
    )


# device kind -> shape class (`shape_class`: cache dtype, head_dim, group, block_size, batch,
# num_tokens, capacity, each but the dtype and block_size rounded up to a power of two) -> config;
# only classes where a measured config beat the heuristic (`python -m benchmarks.tune ragged`).
TUNED: dict[str, dict[tuple, AttentionConfig]] = {
    "NVIDIA H200": {
        ("bfloat16", 128, 4, 16, 32, 128, 4096): AttentionConfig(
            block_q=4, block_k=128, num_splits=1, num_warps=4, num_stages=2),
    },
}


def lookup(shape: AttentionShape, device_kind: str, sm_count: int) -> AttentionConfig:
    """The tuned config of ``shape``'s class on a device of kind ``device_kind``, else the
    heuristic one."""
    config = TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_heuristic_config(shape, sm_count)

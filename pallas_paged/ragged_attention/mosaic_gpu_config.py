"""The Mosaic GPU ragged-attention kernel's knobs: a frozen, hashable config, the heuristic that
picks one for any shape, and the table of configs tuned on real devices (`lookup_mosaic`). The
evidence behind the rules is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses

from pallas_paged._platform import next_power_of_2
from pallas_paged.ragged_attention.shape import AttentionShape, shape_class


MMA_ROWS = 64  # a consumer's query rows: wgmma's M
PACKS = (1, 2, 4, 8, 16, 32, 64)  # `MosaicAttentionConfig.pack_heads`: divisors of wgmma's M
PACK_BELOW = 16  # the heuristic packs heads where sequences average at most this many new tokens


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Static knobs of the Mosaic GPU ragged-attention kernel (hashable: a static jit argument).

    Attributes:
      block_kv: K/V tokens per tile, 64 or 128 (the N of the ``Q K^T`` wgmma, the K of ``P V``):
        ``block_kv / block_size`` whole pages, one TMA copy each, or one slice of a larger page.
      num_stages: shared-memory stages of the producer's TMA ring, >= 2.
      num_consumers: consumer warpgroups per CTA, 1 or 2, each on a query tile of 64 rows
        (``pack_heads`` query heads' ``64 / pack_heads`` tokens). With 2, the CTA's consumers
        take two packs of heads of one kv head (where the group holds an even number of packs)
        or else two consecutive token tiles of one pack; they share every K/V tile the producer
        brings in.
      ping_pong: with 2 consumers, a schedule barrier orders their wgmmas so that one's softmax
        runs while the other's products occupy the tensor cores (FlashAttention-3's
        inter-warpgroup overlap).
      decode_rows: sequences with one query token (decodes) go to the Mosaic decode kernel in
        the same call (its config looked up as `pallas_paged.decode` would for the batch),
        which puts the GQA group, not 64 tokens of one head, in the wgmmas; the ragged
        kernel's work list leaves them out.
      persistent: as many CTAs as stay resident on the device's multiprocessors, each walking
        several work items (the longest first, dealt in snake order), the next item's K/V
        tiles streaming in while the current one's output goes out; else one CTA per item.
      overlap_softmax: each consumer issues the next tile's ``Q K^T`` before this tile's
        softmax, so its softmax runs beside its own next product (FlashAttention-3's
        intra-warpgroup overlap, without keeping ``P V`` in flight). 16-bit caches, no
        ``ping_pong``.
      pack_heads: query heads of one kv head that share a consumer's 64 wgmma rows, each with
        ``64 / pack_heads`` consecutive tokens (1, 2, 4, 8, 16, 32 or 64, dividing the GQA
        group). 1: a consumer's rows are 64 tokens of one head. More: a sequence with few new
        tokens (speculative steps, decodes) fills the rows with the group's heads instead of
        padding, so each K/V tile's products serve the whole pack.
    """

    block_kv: int = 128
    num_stages: int = 2
    num_consumers: int = 2
    ping_pong: bool = True
    decode_rows: bool = False
    persistent: bool = False
    pack_heads: int = 1
    overlap_softmax: bool = False

    def __post_init__(self):
        for name in ("block_kv", "num_stages", "num_consumers", "pack_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MosaicAttentionConfig.{name}={value!r} must be a positive int")
        for name in ("ping_pong", "decode_rows", "persistent", "overlap_softmax"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"MosaicAttentionConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.block_kv not in (64, 128):
            raise ValueError(f"MosaicAttentionConfig.block_kv={self.block_kv} must be 64 or 128")
        if self.num_stages < 2:
            raise ValueError(f"MosaicAttentionConfig.num_stages={self.num_stages} must be >= 2")
        if self.num_consumers not in (1, 2):
            raise ValueError(
                f"MosaicAttentionConfig.num_consumers={self.num_consumers} must be 1 or 2")
        if self.overlap_softmax and self.ping_pong:
            raise ValueError(
                "MosaicAttentionConfig(overlap_softmax=True, ping_pong=True): the overlap"
                " orders a consumer's own products; ping_pong=False")
        if self.pack_heads not in PACKS:
            raise ValueError(f"MosaicAttentionConfig.pack_heads={self.pack_heads} must be one of"
                             f" {PACKS}")


def largest_pack(group: int, tokens: int) -> int:
    """The most query heads of a group of ``group`` (a power of two dividing it) whose
    ``tokens`` new tokens each fit a consumer's 64 rows."""
    fits = MMA_ROWS // next_power_of_2(tokens)
    return max(p for p in PACKS if group % p == 0 and p <= fits)


def packed_heads(shape: AttentionShape) -> int:
    """The query heads the heuristic packs into a consumer's rows: where the sequences bring at
    most `PACK_BELOW` new tokens on average (speculative steps, decodes), `largest_pack`; else
    1."""
    per_sequence = -(-shape.num_tokens // shape.batch)
    return 1 if per_sequence > PACK_BELOW else largest_pack(shape.group, per_sequence)


def get_mosaic_heuristic_config(shape: AttentionShape) -> MosaicAttentionConfig:
    """A reasonable config for any shape: the fallback of the tuned table.

    Two ping-ponging consumers on 128-token K/V tiles in two stages up to head_dim 128 (the
    structure of FlashAttention-3's forward kernel); past it, one consumer on 64-token tiles, so
    that the queries, the ring and the output's staging fit one CTA's shared memory. fp8 caches
    add a ring of the tiles converted to the query's dtype: 64-token tiles.

    Short sequences (`packed_heads`) pack the group's heads into each consumer's rows instead
    of padding 64-token tiles; where that leaves one pack per kv head, one consumer (a second
    would take an empty token tile) on 64-token tiles in three stages up to head_dim 128.
    """
    if shape.head_dim > 128:
        config = MosaicAttentionConfig(block_kv=64, num_stages=2, num_consumers=1,
                                       ping_pong=False)
    elif shape.cache_dtype == "float8_e4m3fn":
        config = MosaicAttentionConfig(block_kv=64)
    else:
        config = MosaicAttentionConfig()
    pack = packed_heads(shape)
    if pack == 1:
        return config
    if (shape.group // pack) % config.num_consumers == 0:  # a pack per consumer
        return dataclasses.replace(config, pack_heads=pack)
    if shape.head_dim > 128:
        return dataclasses.replace(config, pack_heads=pack)
    return MosaicAttentionConfig(block_kv=64, num_stages=3, num_consumers=1, ping_pong=False,
                                 pack_heads=pack)


# device kind -> shape class (`shape_class`) -> config; only classes where a measured config beat
# the heuristic.
MOSAIC_TUNED: dict[str, dict[tuple, MosaicAttentionConfig]] = {
    "NVIDIA H100 80GB HBM3": {
        ("bfloat16", 128, 4, 16, 4, 8192, 2048): MosaicAttentionConfig(
            block_kv=64, num_stages=2, num_consumers=2, ping_pong=False, persistent=True,
            pack_heads=1),
        ("bfloat16", 128, 4, 16, 64, 4096, 4096): MosaicAttentionConfig(
            block_kv=128, num_stages=2, num_consumers=2, decode_rows=True, pack_heads=1),
    },
}


def lookup_mosaic(shape: AttentionShape, device_kind: str) -> MosaicAttentionConfig:
    """The tuned config of ``shape``'s class on ``device_kind``, else the heuristic one."""
    config = MOSAIC_TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_mosaic_heuristic_config(shape)

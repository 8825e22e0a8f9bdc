"""The Mosaic GPU ragged-attention kernel's knobs: a frozen, hashable config, the heuristic that
picks one for any shape, and the table of configs tuned on real devices (`lookup_mosaic`). The
evidence behind the rules is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses

from pallas_paged.ragged_attention.shape import AttentionShape, shape_class


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
    """Static knobs of the Mosaic GPU ragged-attention kernel (hashable: a static jit argument).

    Attributes:
      block_kv: K/V tokens per tile, 64 or 128 (the N of the ``Q K^T`` wgmma, the K of ``P V``):
        ``block_kv / block_size`` whole pages, one TMA copy each, or one slice of a larger page.
      num_stages: shared-memory stages of the producer's TMA ring, >= 2.
      num_consumers: consumer warpgroups per CTA, 1 or 2, each on a query tile of 64 rows (one
        query head's 64 tokens). With 2, the CTA's consumers take two heads of one kv head
        (groups of even size) or, for odd groups, two consecutive 64-token tiles of one head;
        they share every K/V tile the producer brings in.
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
    """

    block_kv: int = 128
    num_stages: int = 2
    num_consumers: int = 2
    ping_pong: bool = True
    decode_rows: bool = False
    persistent: bool = False

    def __post_init__(self):
        for name in ("block_kv", "num_stages", "num_consumers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MosaicAttentionConfig.{name}={value!r} must be a positive int")
        for name in ("ping_pong", "decode_rows", "persistent"):
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


def get_mosaic_heuristic_config(shape: AttentionShape) -> MosaicAttentionConfig:
    """A reasonable config for any shape: the fallback of the tuned table.

    Two ping-ponging consumers on 128-token K/V tiles in two stages up to head_dim 128 (the
    structure of FlashAttention-3's forward kernel); past it, one consumer on 64-token tiles, so
    that the queries, the ring and the output's staging fit one CTA's shared memory. fp8 caches
    add a ring of the tiles converted to the query's dtype: 64-token tiles.
    """
    if shape.head_dim > 128:
        return MosaicAttentionConfig(block_kv=64, num_stages=2, num_consumers=1, ping_pong=False)
    if shape.cache_dtype == "float8_e4m3fn":
        return MosaicAttentionConfig(block_kv=64)
    return MosaicAttentionConfig()


# device kind -> shape class (`shape_class`) -> config; only classes where a measured config beat
# the heuristic.
MOSAIC_TUNED: dict[str, dict[tuple, MosaicAttentionConfig]] = {}


def lookup_mosaic(shape: AttentionShape, device_kind: str) -> MosaicAttentionConfig:
    """The tuned config of ``shape``'s class on ``device_kind``, else the heuristic one."""
    config = MOSAIC_TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_mosaic_heuristic_config(shape)

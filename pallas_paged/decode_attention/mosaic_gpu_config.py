"""The Mosaic GPU decode kernel's knobs: a frozen, hashable config, the heuristic that picks one
for any shape, and the table of configs tuned on real devices (`lookup_mosaic`). The evidence
behind the rules is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_paged.decode_attention.shape import DecodeShape, shape_class

MAX_MOSAIC_CONSUMERS = 4  # consumer warpgroups per CTA: with the producer, 640 threads


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Static knobs of the Mosaic GPU paged-decode kernel (hashable: a static jit argument).

    Attributes:
      block_k: tokens per tile, 64 or 128 (the N of the ``Q K^T`` wgmma, the K of ``P V``). A tile
        is ``block_k / block_size`` whole pages, one TMA copy each, or one slice of a page larger
        than the tile.
      num_splits: KV splits per (sequence, kv head) (flash-decoding); the splits are merged after
        the kernel.
      num_stages: shared-memory stages of the TMA ring (tiles in flight + the one computed), >= 2.
      num_consumers: consumer warpgroups per CTA, 1 to 4. With ``C`` of them, consumer ``c``
        takes the split's tiles ``c, c + C, ...`` (the ring's stages ``c, c + C, ...``, so
        ``num_stages`` must be a multiple of ``C``) with its own online softmax, so ``C`` tiles'
        dependent chains (wgmma, softmax, wgmma) run at once; each consumer's partial result is
        one more split for the merge. Several consumers share the CTA's registers by
        ``setmaxnreg`` (one CTA per multiprocessor).
      queries_in_n: the group's query heads in the wgmmas' N dimension, ``S^T = K Q^T`` and
        ``O^T = V^T P^T`` (N: the group padded to a multiple of 8; M: the tile's tokens, then the
        head dimension), instead of their M (the group padded to wgmma's minimum of 64 rows).
        For a group of 4 the softmax then works on 8 columns per token instead of 64 rows, the
        accumulator is 8 columns instead of 64 rows, and P is 8 rows instead of 64 in shared
        memory. The softmax's reductions over the tokens then cross the warps of a consumer,
        through shared memory that Mosaic GPU allocates: each consumer's lies apart
        (`mosaic_gpu.lower_apart`: in one, two consumers would race).
      fp8_k_in_registers: fp8 caches, with ``queries_in_n``: each K tile is loaded from its stage
        into registers, converted to fp16 there and given to the ``S^T = K Q^T`` wgmma as its A
        operand, instead of being written back to shared memory as an fp16 tile first (the same
        numbers: the conversion is exact). Compiled kernels only: interpret mode takes wgmma
        operands from shared memory, so there the tile takes the shared-memory path. No effect
        on 16-bit caches, whose stage is the operand as it is.
      persistent: as many CTAs as the GPU holds at once (`mosaic_gpu.persistent_programs`: the
        multiprocessors times the CTAs of this config's shared memory one holds, at most the
        work items), each walking several work items (sequence, kv head, split) instead of one
        CTA per item. The producer streams the next item's first tiles into the ring while the
        consumer finishes the item before (its normalization or partial result), and each CTA
        fills its ring once, not once per item. The items are dealt before the kernel runs:
        XLA sorts the sequences by length (one small sort per call), and the items, longest
        first, go to the CTAs in rounds of snake order (`mosaic_gpu.dealt_index`), so that
        sequences of different lengths still leave the CTAs about equal work. Needs one
        consumer and not ``fp8_v_in_producer``.
      fp8_v_in_producer: fp8 caches: the producer warpgroup, which otherwise only issues the
        copies, converts each V tile to fp16 (zeroing the rows outside the sequence on tiles
        that hold any) into a ring of two converted tiles that the consumer's ``P V`` wgmma
        reads (two tiles, or one per consumer for several), so the consumer's work per tile is
        the K conversion, the two wgmmas and the softmax. No effect on 16-bit caches.
    """

    block_k: int = 64
    num_splits: int = 1
    num_stages: int = 3
    num_consumers: int = 1
    queries_in_n: bool = False
    fp8_k_in_registers: bool = False
    fp8_v_in_producer: bool = False
    persistent: bool = False

    def __post_init__(self):
        for name in ("block_k", "num_splits", "num_stages", "num_consumers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MosaicDecodeConfig.{name}={value!r} must be a positive int")
        for name in ("queries_in_n", "fp8_k_in_registers", "fp8_v_in_producer", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"MosaicDecodeConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.fp8_k_in_registers and not self.queries_in_n:
            raise ValueError(
                "MosaicDecodeConfig(fp8_k_in_registers=True, queries_in_n=False): K is the A"
                " operand of a wgmma (the one operand registers can hold) only with the queries"
                " in N")
        if self.block_k not in (64, 128):
            raise ValueError(f"MosaicDecodeConfig.block_k={self.block_k} must be 64 or 128")
        if self.num_stages < 2:
            raise ValueError(f"MosaicDecodeConfig.num_stages={self.num_stages} must be >= 2")
        if self.num_consumers > MAX_MOSAIC_CONSUMERS:
            raise ValueError(f"MosaicDecodeConfig.num_consumers={self.num_consumers} must be 1 to"
                             f" {MAX_MOSAIC_CONSUMERS}")
        if self.persistent and (self.num_consumers > 1 or self.fp8_v_in_producer):
            raise ValueError(
                f"MosaicDecodeConfig(persistent=True, num_consumers={self.num_consumers},"
                f" fp8_v_in_producer={self.fp8_v_in_producer}): a persistent CTA walks its work"
                " items with one consumer and the producer only copying")
        if self.num_stages % self.num_consumers:
            raise ValueError(
                f"MosaicDecodeConfig.num_stages={self.num_stages} must be a multiple of"
                f" num_consumers={self.num_consumers} (each consumer owns every"
                f" {self.num_consumers}-th stage of the ring)")


def get_mosaic_heuristic_config(shape: DecodeShape, sm_count: int) -> MosaicDecodeConfig:
    """A reasonable Mosaic config for any shape: the fallback of the tuned table.

    - ``queries_in_n`` with one consumer warpgroup everywhere.
    - ``num_splits``, a power of two, without splits shorter than 4 tiles: about one CTA per
      multiprocessor for 16-bit caches (one wave of long CTAs), two for fp8 caches.
    - ``persistent`` for 16-bit caches past two waves of CTAs, with groups of 4 or 8 (which the
      kernel normalizes itself), 128-token tiles in 2 stages (one CTA per multiprocessor).
    - ``block_k``: for 16-bit caches 128-token tiles where the CTAs fit about two waves at one
      CTA per multiprocessor, or with ``persistent``; else 64 (two CTAs of ~100 KB share a
      multiprocessor, one's ring filling while the other computes). 64 for fp8 caches, whose
      tiles the consumer converts, and past head_dim 128 (the bytes of a 128-token tile at 128).
    - ``num_stages``: 2 for 128-token 16-bit tiles, fp8 and head_dim past 128; else 3.
    - fp8 caches: the K tile converted in registers (``fp8_k_in_registers``) and the V tile by
      the producer (``fp8_v_in_producer``).
    """
    itemsize = jnp.dtype(shape.cache_dtype).itemsize
    programs = max(shape.batch * shape.num_kv_heads, 1)
    fp8 = itemsize == 1
    wanted = (2 if fp8 else 1) * sm_count / programs
    splits = 1 << max(0, round(math.log2(wanted))) if wanted > 1 else 1
    few_ctas = programs * splits <= 2 * sm_count  # two waves or fewer at one CTA per SM
    # Past two waves, for 16-bit caches and groups the kernel normalizes itself (4 or 8 query
    # heads: 8 columns of the wgmmas), persistent CTAs of 128-token tiles.
    persistent = not fp8 and not few_ctas and shape.group in (4, 8)
    # Past head_dim 128 a 64-token tile holds the bytes of a 128-token one at head_dim 128 (two
    # stages of 128 tokens at head_dim 256 do not fit in shared memory): 64 tokens, 2 stages.
    wide = shape.head_dim > 128
    block_k = 128 if not fp8 and not wide and (few_ctas or persistent) else 64
    splits = max(1, min(splits, max(1, shape.span // (4 * block_k)), 256))
    num_stages = 2 if fp8 or wide or block_k == 128 else 3
    return MosaicDecodeConfig(block_k=block_k, num_splits=splits, num_stages=num_stages,
                              num_consumers=1, queries_in_n=True, fp8_k_in_registers=fp8,
                              fp8_v_in_producer=fp8, persistent=persistent)


# device kind -> shape class (`shape_class`) -> config; only classes where a measured config beat
# the heuristic (`python -m benchmarks.tune decode --impl mosaic`).
MOSAIC_TUNED: dict[str, dict[tuple, MosaicDecodeConfig]] = {
    "NVIDIA H100 80GB HBM3": {
        ("bfloat16", 128, 4, 16, 8, 1024): MosaicDecodeConfig(
            block_k=128, num_splits=1, num_stages=2, num_consumers=1, queries_in_n=True),
    },
}


def lookup_mosaic(shape: DecodeShape, device_kind: str, sm_count: int) -> MosaicDecodeConfig:
    """The tuned Mosaic config of ``shape``'s class on ``device_kind``, else the heuristic one."""
    config = MOSAIC_TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_mosaic_heuristic_config(shape, sm_count)

"""The Pallas Triton decode kernel's knobs: a frozen, hashable config, the heuristic that picks
one for any shape, and the table of configs tuned on real devices (`lookup` reads the table,
else the heuristic). The evidence behind the rules and entries is in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_paged._platform import next_power_of_2
from pallas_paged._triton_common import K_TILE_BYTES
from pallas_paged.decode_attention.shape import DecodeShape, shape_class


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static knobs of the paged-decode kernel (hashable, so it can be a static jit argument).

    Attributes:
      block_k: tokens per tile (a power of two >= 16). A tile gathers its tokens' rows through the
        block table one token at a time, so it may span several pages (``block_k / block_size``
        pages when ``block_size`` divides it) or part of one; any ``block_size`` works.
      num_splits: KV splits per (sequence, kv head) (flash-decoding). Each split walks a balanced
        share of the sequence's tiles (`split_share`); 1 means no split and no
        merge step.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the tile loop, as Triton takes it. The K/V loads
        depend on a table load, and Triton's pipeliner splits the stages between the two: 2, 3
        and 4 keep one K/V tile in flight per program, 5 and 6 two, 7 and 8 three
        (`kv_ring_depth`); each tile in flight holds its K and V rows in shared
        memory.
      merge_in_kernel: with several splits, the program that finishes a (sequence, kv head) last
        merges its splits' partial results (it learns it is last from an atomic count of
        arrivals), so decode is one kernel launch instead of two (the kernel, then the merge
        kernel). No effect with one split.
      fp8_v_at_load: with an fp8 cache, each V tile is converted to fp16 where it is loaded and
        reaches the ``p @ v`` dot through a transposed ``ldmatrix``; otherwise Triton converts it
        inside the dot operand's read from shared memory, one byte per instruction (8-bit
        elements have no transposed ``ldmatrix``). Fewer instructions and registers; it
        pays where the tiles are small. No effect on 16-bit caches.
      fp8_pairs: with an fp8 cache (and an even head_dim), the K and V rows are read as 16-bit
        words of two neighbouring head columns each and converted pairwise (PTX
        ``cvt.rn.f16x2.e4m3x2``) into an even-column and an odd-column fp16 tile; the query is
        split the same way, and each dot becomes two of half the head dimension. Every dot
        operand then comes from a 16-bit load, which Triton lays out two elements per register
        along K, as for bf16 caches; an fp8 load feeding a dot makes it take four, which costs
        register moves around every MMA, a query reread from shared memory per tile, and a V
        tile staged with bank conflicts. Replaces
        ``fp8_v_at_load``. No effect on 16-bit caches.
      persistent_programs: 0 (the default) for the grid of one program per (sequence, kv head,
        split); ``P >= 1`` for persistent programs, ``max(1, P // num_kv_heads)`` per kv head
        (``P`` in all where the kv heads divide it), that deal the tiles of the whole batch
        among them (`pallas_triton.persistent_decode_kernel`): the sequences' tiles end to end,
        each program a balanced contiguous share, so every program walks the same number of
        tiles (+-1) however the lengths differ, and a sequence cut by a share's boundary is
        merged by the last of its programs to finish (one launch). Needs ``num_splits == 1``.
        Ragged batches gain; uniform ones do not.
    """

    block_k: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    merge_in_kernel: bool = False
    fp8_v_at_load: bool = False
    fp8_pairs: bool = False
    persistent_programs: int = 0

    def __post_init__(self):
        for name in ("block_k", "num_splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeConfig.{name}={value!r} must be a positive int")
        programs = self.persistent_programs
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
            raise ValueError(f"DecodeConfig.persistent_programs={programs!r} must be an int >= 0")
        if programs and self.num_splits != 1:
            raise ValueError(f"DecodeConfig.persistent_programs={programs} deals whole sequences;"
                             f" it needs num_splits=1, not {self.num_splits}")
        for name in ("merge_in_kernel", "fp8_v_at_load", "fp8_pairs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecodeConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"DecodeConfig.block_k={self.block_k} must be a power of two >= 16")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"DecodeConfig.num_warps={self.num_warps} must be a power of two")


# Programs of the fp8 heuristic's config (128-token tiles at head_dim 128, 4 warps, rings two
# tiles deep) one multiprocessor holds at once (by registers), and of half its tile and warps (by
# shared memory).
FP8_PROGRAMS_PER_SM = 3
FP8_SMALL_PROGRAMS_PER_SM = 5
# The K tile's bytes of the heuristic's 16-bit configs at head_dim 129-256 (64 tokens of 256
# columns): 32-token tiles leave 8 warps too little work.
WIDE_ROW_TILE_BYTES = 32 * 1024
# Persistent programs per multiprocessor that the tuning sweep tries
# (`DecodeConfig.persistent_programs` = this x the SM count).
PERSISTENT_PROGRAMS_PER_SM = 2


def wave_fill(programs: int, slots: int) -> float:
    """How full the waves of ``programs`` equal programs are when ``slots`` run at once: 1.0 for
    one wave (a partial wave of several programs per multiprocessor still streams at the
    device's rate), else the mean fill of the waves, whose last one streams with too few
    programs."""
    waves = programs / slots
    return 1.0 if waves <= 1 else waves / math.ceil(waves)


def heuristic_splits(shape: DecodeShape, block_k: int, sm_count: int,
                     programs_per_sm: int) -> int:
    """KV splits that put about ``programs_per_sm`` programs on each multiprocessor (a power of
    two, at most 256), without splits shorter than 4 tiles."""
    programs = max(shape.batch * shape.num_kv_heads, 1)
    wanted = (programs_per_sm * sm_count) / programs
    splits = 1 << max(0, round(math.log2(wanted))) if wanted > 1 else 1
    max_useful = max(1, shape.span // (4 * block_k))
    return max(1, min(splits, max_useful, 256))


def get_heuristic_config(shape: DecodeShape, sm_count: int) -> DecodeConfig:
    """A reasonable config for any shape: the fallback of the tuned table.

    - 16-bit and fp32 caches: tiles of about `K_TILE_BYTES` of K (as many of V) in a ring one
      tile deep (``num_stages=2``), about four programs per multiprocessor; `WIDE_ROW_TILE_BYTES`
      and 8 warps for 16-bit rows of 129-256 columns.
    - fp8 caches: the same tile rule, rings two tiles deep (``num_stages=5``), about two programs
      per multiprocessor (as many tiles in flight, half the splits to merge), the rows read as
      column pairs (``fp8_pairs``). Where these programs (`FP8_PROGRAMS_PER_SM` to a
      multiprocessor) would fill their waves worse than programs of half the tile and two warps
      (`FP8_SMALL_PROGRAMS_PER_SM`, `wave_fill`), the smaller ones: a batch just past one wave
      would otherwise stream its last wave nearly alone.
    """
    itemsize = jnp.dtype(shape.cache_dtype).itemsize
    fp8 = itemsize == 1
    padded_dim = next_power_of_2(shape.head_dim)
    tile_bytes = WIDE_ROW_TILE_BYTES if (padded_dim > 128 and itemsize == 2) else K_TILE_BYTES
    block_k = max(16, min(128, tile_bytes // (padded_dim * itemsize)))
    block_k = min(block_k, max(16, next_power_of_2(shape.span)))
    num_warps = 4 if padded_dim <= 128 else 8
    splits = heuristic_splits(shape, block_k, sm_count, programs_per_sm=2 if fp8 else 4)
    programs = max(shape.batch * shape.num_kv_heads, 1) * splits
    if fp8 and num_warps == 4 and block_k >= 32 and (
            wave_fill(programs, FP8_PROGRAMS_PER_SM * sm_count)
            < wave_fill(programs, FP8_SMALL_PROGRAMS_PER_SM * sm_count)):
        block_k, num_warps = block_k // 2, 2
    return DecodeConfig(block_k=block_k, num_splits=splits, num_warps=num_warps,
                        num_stages=5 if fp8 else 2, fp8_pairs=fp8)


# device kind -> shape class (`shape_class`: cache dtype, head_dim, group, block_size, batch,
# span, each but the dtype and block_size rounded up to a power of two) -> config; only
# classes where a measured config beat the heuristic (`python -m benchmarks.tune decode`).
TUNED: dict[str, dict[tuple, DecodeConfig]] = {
    "NVIDIA H200": {
        ("float8_e4m3fn", 128, 4, 16, 8, 16384): DecodeConfig(
            block_k=64, num_splits=6, num_warps=4, num_stages=5, fp8_pairs=True),
        ("bfloat16", 128, 4, 16, 1, 32768): DecodeConfig(
            block_k=128, num_splits=16, num_warps=4, num_stages=5),
        ("bfloat16", 128, 4, 16, 32, 4096): DecodeConfig(
            block_k=64, num_splits=1, num_warps=8, num_stages=5),
        ("bfloat16", 256, 4, 16, 32, 4096): DecodeConfig(
            block_k=64, num_splits=1, num_warps=8, num_stages=2),
        ("bfloat16", 128, 4, 16, 64, 8192): DecodeConfig(
            block_k=64, num_warps=4, num_stages=5, persistent_programs=264),
        ("bfloat16", 128, 1, 16, 32, 4096): DecodeConfig(
            block_k=128, num_splits=1, num_warps=4, num_stages=3),
    },
    "NVIDIA H100 80GB HBM3": {
        ("bfloat16", 128, 4, 16, 64, 8192): DecodeConfig(
            block_k=64, num_warps=4, num_stages=5, persistent_programs=264),
    },
}


def lookup(shape: DecodeShape, device_kind: str, sm_count: int) -> DecodeConfig:
    """The tuned config of ``shape``'s class on ``device_kind``, else the heuristic one."""
    config = TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_heuristic_config(shape, sm_count)

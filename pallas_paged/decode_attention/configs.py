"""Knobs of the Pallas decode kernel: a frozen, hashable config, the heuristic that picks one, and
the table of configs tuned on real devices.

A shape class rounds the static facts of a call up to powers of two, so that one measured entry
covers its neighbours: ``(cache dtype, head_dim, group, block_size, batch, capacity)``. The table is
keyed by the device kind JAX reports (``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H200"``);
entries are measured with ``python -m benchmarks.bench --tune`` or ``python -m
benchmarks.decode_anatomy --config ...``. On any other device, or for a
shape class not in the table, `lookup` returns the heuristic config. The Mosaic GPU kernel has the
same three parts (`MosaicDecodeConfig`, `get_mosaic_heuristic_config`, `MOSAIC_TUNED` /
`lookup_mosaic`), and a last table, `IMPL_CHOICE`, records per device kind and shape class which
of the two kernels measured faster: `choose_impl` reads it for ``decode(..., impl="auto")``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_paged._platform import next_power_of_2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static knobs of the paged-decode kernel (hashable, so it can be a static jit argument).

    Attributes:
      block_k: tokens per tile (a power of two >= 16). A tile gathers its tokens' rows through the
        block table one token at a time, so it may span several pages (``block_k / block_size``
        pages when ``block_size`` divides it) or part of one; any ``block_size`` works.
      num_splits: KV splits per (sequence, kv head) (flash-decoding). Each split walks a balanced
        share of the sequence's tiles (`pallas_triton.split_share`); 1 means no split and no
        merge step.
      num_warps: warps per program.
      num_stages: software-pipelining depth of the tile loop, as Triton takes it. The K/V loads
        depend on a table load, and Triton's pipeliner splits the stages between the two: 2, 3
        and 4 keep one K/V tile in flight per program, 5 and 6 two, 7 and 8 three
        (`pallas_triton.kv_ring_depth`); each tile in flight holds its K and V rows in shared
        memory.
      merge_in_kernel: with several splits, the program that finishes a (sequence, kv head) last
        merges its splits' partial results (it learns it is last from an atomic count of
        arrivals), so decode is one kernel launch instead of two (the kernel, then the merge
        kernel). No effect with one split.
      fp8_v_at_load: with an fp8 cache, each V tile is converted to fp16 where it is loaded and
        reaches the ``p @ v`` dot through a transposed ``ldmatrix``; otherwise Triton converts it
        inside the dot operand's read from shared memory, one byte per instruction (8-bit
        elements have no transposed ``ldmatrix``). Fewer instructions and registers, but it
        pays where the tiles are small: on an H200, 32-token tiles with 2 warps ran 1.34x faster
        with it, 128-token tiles with 4 warps 0.97-1.00x (docs/BENCHMARKS.md). No effect on
        16-bit caches.
      fp8_pairs: with an fp8 cache (and an even head_dim), the K and V rows are read as 16-bit
        words of two neighbouring head columns each and converted pairwise (PTX
        ``cvt.rn.f16x2.e4m3x2``) into an even-column and an odd-column fp16 tile; the query is
        split the same way, and each dot becomes two of half the head dimension. Every dot
        operand then comes from a 16-bit load, which Triton lays out two elements per register
        along K, as for bf16 caches; an fp8 load feeding a dot makes it take four, which costs
        register moves around every MMA, a query reread from shared memory per tile, and a V
        tile staged with bank conflicts (Nsight Compute on an H200, docs/BENCHMARKS.md). Replaces
        ``fp8_v_at_load``. No effect on 16-bit caches.
      persistent_programs: 0 (the default) for the grid of one program per (sequence, kv head,
        split); ``P >= 1`` for persistent programs, ``max(1, P // num_kv_heads)`` per kv head
        (``P`` in all where the kv heads divide it), that deal the tiles of the whole batch
        among them (`pallas_triton._persistent_decode_kernel`): the sequences' tiles end to end,
        each program a balanced contiguous share, so every program walks the same number of
        tiles (+-1) however the lengths differ, and a sequence cut by a share's boundary is
        merged by the last of its programs to finish (one launch). Needs ``num_splits == 1``.
        A ragged batch gains (H100, 64 sequences of 1..8192 tokens: 1.12x the heuristic's
        config with ``P = 264``, two programs per multiprocessor); a uniform one does not.
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


# The programs of the fp8 heuristic's config (128-token tiles of D=128, 4 warps, rings two tiles
# deep) one multiprocessor holds at once: three, by registers; with 64-token tiles and 2 warps,
# five, by shared memory (`python -m benchmarks.triton_sass --shape fp8_b32_ctx4096 --config
# bk128/s1/w4/st5/pr1 --config bk64/s1/w2/st5/pr1`).
FP8_PROGRAMS_PER_SM = 3
FP8_SMALL_PROGRAMS_PER_SM = 5


# Persistent programs per multiprocessor that `benchmarks.bench --tune` tries
# (`DecodeConfig.persistent_programs` = this x the SM count): the ragged B=64 batch on an H100 ran
# as fast with two (389.4 us) as with three (389.7 us) per multiprocessor, and slower in two waves
# (419.6 us), 2026-12-05 (docs/BENCHMARKS.md).
PERSISTENT_PROGRAMS_PER_SM = 2


def _wave_fill(programs: int, slots: int) -> float:
    """How full the waves of ``programs`` equal programs are when ``slots`` run at once: 1.0 for
    one wave (whatever its size: a partial wave of several programs per multiprocessor still
    streams at the device's rate), else the mean fill of the waves, whose last one streams
    with too few programs (fp8 decode, 56 sequences: 0.63 of copy bandwidth in 1.13 waves of
    the larger programs, 0.88 in one of the smaller; docs/BENCHMARKS.md)."""
    waves = programs / slots
    return 1.0 if waves <= 1 else waves / math.ceil(waves)


def _num_splits(shape: DecodeShape, block_k: int, sm_count: int,
                programs_per_sm: int) -> int:
    """About ``programs_per_sm`` programs per multiprocessor, without splits shorter than 4 tiles.

    Measured on the H200 (132 SMs, bf16, D=128, rings one tile deep): the best split counts put
    512-1024 programs on the device (B=32: 2 splits, B=4 at 128K tokens: 16, B=1 at 32K: 64,
    B=128: 1).
    """
    programs = max(shape.batch * shape.num_kv_heads, 1)
    wanted = (programs_per_sm * sm_count) / programs
    splits = 1 << max(0, round(math.log2(wanted))) if wanted > 1 else 1
    max_useful = max(1, shape.capacity // (4 * block_k))
    return max(1, min(splits, max_useful, 256))


# The K tile's bytes (V's as many) of the heuristic's configs: K plus V about 32 KiB for each
# tile in flight (`pallas_triton.kv_ring_depth`), so that several programs share a
# multiprocessor. The ragged kernel's heuristic takes it for its decode-like rows.
K_TILE_BYTES = 16 * 1024

# The K tile's bytes (V's as many) of the heuristic's 16-bit configs at head_dim 129-256: 64
# tokens of 256 columns. With 32-token tiles (16 KiB, the rule of narrower rows) and 8 warps,
# decode at B=32, ctx=4096 took 1.2-1.5x as long: group 4 378.7 us against 271.3 (one split)
# on an H200 (2026-11-30, `benchmarks.bench --tune`), 428.1 against 348.6 us (two splits, this
# heuristic's config) on an H100; group 2 (16 kv heads) 715.0 against 500.4 us on an H200 and
# 855.5 against 680.5 us on an H100 (2026-12-06, docs/BENCHMARKS.md, "The heuristic at head_dim
# 256").
WIDE_ROW_TILE_BYTES = 32 * 1024


def get_heuristic_config(shape: DecodeShape, sm_count: int) -> DecodeConfig:
    """A reasonable config for any shape: the fallback of the tuned table.

    16-bit and fp32 caches: tiles of about 32 KiB of K plus V in a ring one tile deep
    (``num_stages=2``), about four programs per multiprocessor; 64 KiB and 8 warps for 16-bit
    rows of 129-256 columns (`WIDE_ROW_TILE_BYTES`). fp8 caches: the same tile
    length rule, rings two tiles deep (``num_stages=5``) and about two programs per
    multiprocessor (as many tiles in flight, half the splits to merge), the rows read as column
    pairs (``fp8_pairs``). On the H200 that layout was the fastest fp8 config at both measured
    shapes (B=32 ctx=4096: 74.0 us against 78.7 for the tuned entry of 64-token tiles and 2
    splits; B=8 ctx=16384: 76.6 against 77.4 us; 113-125 us for this heuristic's config before,
    with rings one tile deep and 8-bit dot operands; docs/BENCHMARKS.md). Those programs fit three
    to a multiprocessor (`FP8_PROGRAMS_PER_SM`); where their waves would be filled worse than
    those of programs of half the tile and two warps (five to a multiprocessor, `_wave_fill`),
    the heuristic takes the smaller ones: fp8 at ctx=4096, B=56 and B=64, 0.88 and 0.87 of copy
    against 0.63 and 0.69 (the larger programs' second wave streaming nearly alone); at B=96,
    128 and 256 (ctx=1024) the larger programs fill their waves better and stay (0.85, 0.85,
    0.80 against 0.65, 0.80, 0.77; checked at B=50, 72, 80 and 83, the range's edges, each
    faster picked; docs/BENCHMARKS.md, "A batch past a wave").
    """
    itemsize = jnp.dtype(shape.cache_dtype).itemsize
    fp8 = itemsize == 1
    padded_dim = next_power_of_2(shape.head_dim)
    # 64 KiB of K plus V for 16-bit rows of 256 columns, whose 32-token tiles leave the 8 warps
    # too little work (`WIDE_ROW_TILE_BYTES`); about 32 KiB otherwise (`K_TILE_BYTES`).
    tile_bytes = WIDE_ROW_TILE_BYTES if (padded_dim > 128 and itemsize == 2) else K_TILE_BYTES
    block_k = max(16, min(128, tile_bytes // (padded_dim * itemsize)))
    block_k = min(block_k, max(16, next_power_of_2(shape.capacity)))
    num_warps = 4 if padded_dim <= 128 else 8
    splits = _num_splits(shape, block_k, sm_count, programs_per_sm=2 if fp8 else 4)
    programs = max(shape.batch * shape.num_kv_heads, 1) * splits
    if fp8 and num_warps == 4 and block_k >= 32 and (
            _wave_fill(programs, FP8_PROGRAMS_PER_SM * sm_count)
            < _wave_fill(programs, FP8_SMALL_PROGRAMS_PER_SM * sm_count)):
        # The programs' last wave would run nearly empty (the batch just past what three per
        # multiprocessor hold): half the tile and half the warps, about five per multiprocessor,
        # whose waves the batch fills better (one split here).
        block_k, num_warps = block_k // 2, 2
    return DecodeConfig(
        block_k=block_k,
        num_splits=splits,
        num_warps=num_warps,
        num_stages=5 if fp8 else 2,
        fp8_pairs=fp8,
    )


# device kind -> shape class -> config. Measured with `python -m benchmarks.bench --tune` on an
# NVIDIA H200 (132 SMs), 2026-11-30, and later with `benchmarks.decode_anatomy`
# (docs/BENCHMARKS.md); only classes where the best candidate beat the heuristic are listed.
TUNED: dict[str, dict[tuple, DecodeConfig]] = {"NVIDIA H200": {
    # fp8 caches: at B=32 the heuristic's config (bk128 st5 fp8_pairs) is the fastest measured.
    # fp8_b8_ctx16384: 72.6 and 73.9 us vs 76.6 and 75.8 us heuristic (bk128 s4 w4 st5 pr1) in two
    # processes, 2026-12-05 (`python -m benchmarks.decode_anatomy`): 384 programs of 42-43 tiles
    # of 64 tokens (balanced split shares), s8 74.6-75.0 us
    ("float8_e4m3fn", 128, 4, 16, 8, 16384): DecodeConfig(block_k=64, num_splits=6, num_warps=4,
                                                           num_stages=5, fp8_pairs=True),
    # b1_ctx32768: 40.5 and 40.1 us vs 42.2 and 42.4 us heuristic (bk64 s64 w4 st2) in two runs,
    # 2026-12-02: 128 programs of 128-token tiles in a ring two tiles deep, one per multiprocessor
    ("bfloat16", 128, 4, 16, 1, 32768): DecodeConfig(block_k=128, num_splits=16, num_warps=4, num_stages=5),
    # b32_ctx4096: 130.6 us vs 137.7 us heuristic (bk64 s2 w4 st2, then the merge) in one run,
    # 2026-12-02, `python -m benchmarks.decode_anatomy`: no split and no merge, 256 programs of
    # 8 warps in one wave, each with a K/V ring two tiles deep (as many bytes in flight)
    ("bfloat16", 128, 4, 16, 32, 4096): DecodeConfig(block_k=64, num_splits=1, num_warps=8, num_stages=5),
    # d256_b32_ctx4096: 271.3 us vs 378.7 us heuristic (1.40x)
    ("bfloat16", 256, 4, 16, 32, 4096): DecodeConfig(block_k=64, num_splits=1, num_warps=8, num_stages=2),
    # ragged_b64_ctx8192 (lengths uniform in 1..8192): persistent programs (264, dealing the
    # batch's tiles) 264.1 us vs 286.0 us for bk128 s2 (1.08x; that entry took 298.5 us vs
    # 369.4 us heuristic); its uniform class-mate b64_ctx8192 486.9 us vs 495.7 us; 2026-12-05,
    # `python -m benchmarks.decode_anatomy` (269.6 us vs 301.0 us in an earlier run)
    ("bfloat16", 128, 4, 16, 64, 8192): DecodeConfig(block_k=64, num_warps=4, num_stages=5,
                                                      persistent_programs=264),
    # mha_b32_ctx4096: 518.2 us vs 534.9 us heuristic (1.03x); 3 stages 493.1 us vs 499.2 us
    # with 2 in one run, 2026-12-02 (`python -m benchmarks.decode_anatomy`)
    ("bfloat16", 128, 1, 16, 32, 4096): DecodeConfig(block_k=128, num_splits=1, num_warps=4, num_stages=3),
}, "NVIDIA H100 80GB HBM3": {
    # ragged_b64_ctx8192: persistent programs (264, dealing the batch's tiles), 389.4 us vs
    # 437.5 us heuristic (bk64 s1 w4 st2; 1.12x) and 407.5-410.1 us for the H200's entry (bk128
    # s2), within 1% of the Mosaic kernel's persistent CTAs (386.4-388.0 us); its uniform
    # class-mate b64_ctx8192 727.2-744.5 us vs 733.2-738.8 us; 2026-12-05, four runs of
    # `python -m benchmarks.decode_anatomy` / `benchmarks.bench` (docs/BENCHMARKS.md)
    ("bfloat16", 128, 4, 16, 64, 8192): DecodeConfig(block_k=64, num_warps=4, num_stages=5,
                                                      persistent_programs=264),
}}


def shape_class(shape: DecodeShape) -> tuple:
    """The key a shape is looked up under: its static facts rounded up to powers of two."""
    return (shape.cache_dtype, next_power_of_2(shape.head_dim), next_power_of_2(shape.group),
            shape.block_size, next_power_of_2(shape.batch), next_power_of_2(shape.capacity))


def lookup(shape: DecodeShape, device_kind: str, sm_count: int) -> DecodeConfig:
    """The tuned config of ``shape``'s class on a device of kind ``device_kind``, else the heuristic one."""
    config = TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_heuristic_config(shape, sm_count)


# --- the Mosaic GPU kernel (mosaic_gpu.py) ------------------------------------------------------

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
        (`mosaic_gpu.lower_apart`; in one, two consumers raced). On the H200: bf16 B=32 154.3
        -> 141.9 us, fp8 B=32 (4 stages) 208.2 -> 133.6 us (one consumer each).
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
    """A reasonable Mosaic config for any shape, from the H200 measurements of 2026-12-01/02
    (`python -m benchmarks.bench_mosaic --config ...`, docs/BENCHMARKS.md).

    - ``queries_in_n`` with one consumer warpgroup everywhere: the group's queries in the wgmmas'
      N against the queries in M of the configs before, the other fields alike: bf16 B=32 1.09x,
      B=128 1.18x, B=256 1.31x, MHA 1.10x; fp8 B=32 and B=8 1.56x and 1.50x (against two
      consumers of the queries in M, with 2 stages).
    - ``persistent`` for 16-bit caches past two waves of CTAs, with groups of 4 or 8 (the
      kernel normalizes their output itself), with 128-token tiles and 2 stages (one CTA per
      multiprocessor). On the H200 (2026-12-03, `bench_mosaic`, `mosaic_against`; runs spread
      by up to 10%): the ragged B=64/ctx 1..8192 batch 297.8-316.7 -> 268.1-273.8 us (0.86 ->
      0.94-0.97 of copy, 1.08-1.10x the Triton kernel), B=256/ctx 512 151.4-158.1 ->
      137.9-146.7 us, B=128/ctx 1024 144.1-151.4 -> 134.4-141.5 us, B=64/ctx 2048 138.1-143.6
      -> 136.2-138.0 us (64-token tiles with 2 or 3 stages: slower). Not for MHA (a group of
      1, merged by XLA: 504.3 -> 510.4-535.5 us).
    - ``block_k``: for 16-bit caches, 128-token tiles where the CTAs fit about two waves at one
      CTA per multiprocessor (B=32: 141.9 us; B=1 with 16 splits: 42.1 us against 43.8 with 64
      and 4 stages), else 64 (B=128 141.9 us against 152.0 with 128, B=256 153.3 against 161.5:
      a CTA of 64-token tiles takes ~100 KB of shared memory, so two share a multiprocessor and
      one's ring fills while the other computes). 64 for fp8 caches, whose tiles are converted by
      the consumer (128 measured 1.22x slower there, 1.23x with the K tile in registers).
    - ``num_stages``: 2 for 128-token 16-bit tiles (3 measured 2% slower at B=32), 3 for 64-token
      ones (2: 1% slower at B=256, 1% faster at B=128), 2 for fp8 (with the K tile in registers:
      B=32 123.3 us, 3 stages 122.5, 4 stages 123.1; B=8 123.6, 125.8, 126.6).
    - ``fp8_k_in_registers`` for fp8 caches: B=32 130.3 -> 123.1 us, B=8 134.2 -> 126.6 us (4
      stages each), the outputs bit for bit the same; ``fp8_v_in_producer`` with them: B=32
      112.8 -> 105.2 us, B=8 112.4 -> 103.4 us (2 stages; 3 within 2%), the outputs within one
      ulp (the programs round an fp32 sum apart: 7 of 16384 fp16 outputs in one GPU test).
    - head_dim 192 and 256: 64-token tiles in 2 stages, the tile's bytes of head_dim 128's
      128-token tiles; the rest as for head_dim 128 (H200, 2026-12-05, head_dim 256 B=32/ctx
      4096: 263.3 and 264.3 us, 0.965 and 0.951 of copy; head_dim 192 not timed).
    - ``num_splits``, rounded to a power of two, without splits shorter than 4 tiles: for 16-bit
      caches about one CTA per multiprocessor, one wave of long CTAs (B=1/ctx 32768 with 8 kv
      heads: 16 splits, 42.1 us against 48.8 with 32 and 53.5 with 64, timed in straight-line
      calls; B=32: 1 split); for fp8 caches about two (B=8/ctx 16384: 4 splits).
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
    splits = max(1, min(splits, max(1, shape.capacity // (4 * block_k)), 256))
    num_stages = 2 if fp8 or wide or block_k == 128 else 3
    return MosaicDecodeConfig(block_k=block_k, num_splits=splits, num_stages=num_stages,
                              num_consumers=1, queries_in_n=True, fp8_k_in_registers=fp8,
                              fp8_v_in_producer=fp8, persistent=persistent)


# device kind -> shape class -> Mosaic config, measured like TUNED: `python -m benchmarks.bench_mosaic
# --config ...` on an NVIDIA H200, 2026-12-01 (docs/BENCHMARKS.md, "the group's queries in the
# wgmma's N").
MOSAIC_TUNED: dict[str, dict[tuple, MosaicDecodeConfig]] = {"NVIDIA H200": {
    # Empty: the two entries measured before (bf16 and fp8, B=32, ctx 4096, the queries in N)
    # are the heuristic's configs since 2026-12-02.
}}


def lookup_mosaic(shape: DecodeShape, device_kind: str, sm_count: int) -> MosaicDecodeConfig:
    """The tuned Mosaic config of ``shape``'s class on ``device_kind``, else the heuristic one."""
    config = MOSAIC_TUNED.get(device_kind, {}).get(shape_class(shape))
    return config if config is not None else get_mosaic_heuristic_config(shape, sm_count)


# --- which kernel decode(impl="auto") runs ------------------------------------------------------

IMPL_CHOICES = ("mosaic", "pallas")

# device kind -> shape class -> the faster of the two kernels there ("mosaic" or "pallas").
# Measured with `python -m benchmarks.bench` (its mosaic and pallas rows of one run, each kernel
# with the config decode picks); the run prints these entries ("mosaic" where it was at least 2%
# faster on every shape of the class) beside its AUTO table of classes and speed ratios.
# On an NVIDIA H200, 2026-12-04, two runs (`--impls pallas,mosaic`, every shape; then the four
# shapes of the classes closest to the margin; docs/BENCHMARKS.md, "Both kernels side by side,
# IMPL_CHOICE"), the Triton kernel's time over the Mosaic kernel's:
# - head_dim 64, B=32/ctx 4096: 1.06x and 1.08x;
# - bf16 group 4, B=64, capacity 8192: the ragged batch (lengths 1..8192) 1.08x and 1.09x, the
#   uniform one (ctx 8192) 1.005x and 1.02x: level or faster in both runs, 2% faster in one;
# - not entered: block_size 64 (1.04x, then 1.01x); B=4/ctx 131072, B=8/ctx 16384, fp16 (1.01x);
#   every other class measured Mosaic level or slower (B=1 0.93x, fp8 0.56-0.78x).
# On 2026-12-05, two runs (docs/BENCHMARKS.md, "Mosaic at head_dim 256, ..."):
# - head_dim 256, B=32/ctx 4096: 1.027x and 1.034x.
# On 2026-12-05, night (docs/BENCHMARKS.md, "The timer's fixed cost per batch, ..."): the B=64 /
# capacity 8192 class left the table: with its persistent-programs `TUNED` entry the Triton
# kernel is level with Mosaic (ragged 0.99x, uniform 1.00x).
IMPL_CHOICE: dict[str, dict[tuple, str]] = {"NVIDIA H200": {
    ("bfloat16", 64, 4, 16, 32, 4096): "mosaic",
    ("bfloat16", 256, 4, 16, 32, 4096): "mosaic",
}}


def lookup_impl(shape: DecodeShape, device_kind: str) -> str | None:
    """The kernel measured faster for ``shape``'s class on ``device_kind`` (`IMPL_CHOICE`), or
    None where nothing was measured."""
    return IMPL_CHOICE.get(device_kind, {}).get(shape_class(shape))


def choose_impl(shape: DecodeShape, device_kind: str, can_run_mosaic: bool) -> str:
    """What ``decode(..., impl="auto")`` runs for ``shape`` when no config is given.

    ``"mosaic"`` where `IMPL_CHOICE` records it as the faster kernel for ``shape``'s class on
    ``device_kind`` and ``can_run_mosaic`` (the Mosaic kernel can run this call compiled: see
    `pallas_paged.decode_attention.api.auto_impl`); ``"pallas"`` everywhere else, unmeasured
    classes and devices included.
    """
    return "mosaic" if can_run_mosaic and lookup_impl(shape, device_kind) == "mosaic" else "pallas"

"""Paged decode attention, the Mosaic GPU kernel: ``decode(..., impl="mosaic")``.

Pallas Triton is deprecated from jax 0.11; this is the same operation written for Mosaic GPU
(``plgpu.kernel``, Hopper and later), where the TMA engine streams whole pages into shared memory.
Read top to bottom (the public function is `pallas_paged.decode_attention.api.decode`):

1. `_paged_decode_kernel` works on refs only. One CTA owns one (sequence, kv head, KV split) and
   has a producer warpgroup and ``num_consumers`` (1 to 4) consumer warpgroups. A tile is
   ``block_k`` consecutive tokens of the sequence: ``block_k / block_size`` whole pages (one TMA
   copy each, addressed by the block id read from the table in GMEM) or, for pages larger than a
   tile, one slice of one page.
   With ``MosaicDecodeConfig.persistent`` the grid is instead as many CTAs as stay resident,
   and each walks several such work items (`dealt_index`: the longest sequences first, from an
   XLA sort, in snake-order rounds), the ring's stages and two query slots carried from one item
   to the next, so the producer streams the next item's tiles while the consumer finishes one.
   - The producer warpgroup copies the queries, then walks the split's tiles, reads each tile's
     table entries, waits until its stage of the ring of ``num_stages`` shared-memory stages is
     free, and issues the TMA copies of K and V, which complete the stage's mbarriers. With
     ``MosaicDecodeConfig.fp8_v_in_producer`` (fp8 caches) it also converts each V tile to
     fp16 into a ring of two converted tiles for the consumer (which then frees its stage once
     it has read K), so the conversion runs beside the consumer's math instead of in it.
   - A consumer warpgroup computes the ``group`` query heads of the kv head together, as the
     rows of the wgmma (padded to its minimum M of 64 with zero queries: decode is bound by reading
     the cache, not by the tensor cores): ``S = Q K^T`` and ``P V`` on the tensor cores with fp32
     accumulators, the online softmax in fp32 registers (its sum of exponentials kept per score
     position and summed over the tokens once, after the last tile: the token axis of ``S^T``
     spans the four warps, and each reduction across them is a shared-memory round trip); then
     it frees the stage. With ``MosaicDecodeConfig.queries_in_n`` (the heuristic's choice) the
     group is the wgmmas' N instead (padded to a multiple of 8): ``S^T = K Q^T`` and ``O^T =
     V^T P^T``, the softmax over the tokens of ``S^T``'s columns, P stored transposed, ``O^T``
     written out whole.
     Consumer ``c`` of ``C`` takes the split's tiles ``c, c + C, ...``, which live in the ring's
     stages ``c, c + C, ...`` (``num_stages`` is a multiple of ``C``), so each stage's barriers
     have one waiter. Each consumer's code is lowered on its own (`lower_apart`): with the
     queries in N its reductions across warps then use their own shared-memory scratch.
   Only a split's first tile (before a window) and its last (past the sequence's end) can hold
   positions outside ``[first, n)``: each warpgroup walks its tiles in three loops, the masked
   tile body for those two and an unmasked one (no selects, no branch) for the rest.
   Each consumer writes its unnormalized ``(o, m, l)`` as one of the ``num_splits * C`` partial
   results. Where one part is left per (sequence, kv head) and its shared memory costs no wave
   (`finalizes`), the consumer normalizes instead and writes the output and lse (`write_final`,
   `write_normalized`): no merge.
2. `_merge_parts_kernel` merges the parts otherwise, one warpgroup per (sequence, kv head): the
   parts' max, their weighted sums (the parts' ``O^T`` read by TMA in chunks, one ahead), then
   the same `write_normalized` (`merges_in_mosaic`: with the queries in N and groups of 4 or
   more). For the queries in M and for groups of 1 or 2, `merge_splits` (XLA, shared with the
   Triton kernel) merges after `decode_mosaic` dequantizes the values.
3. `decode_kernel_call` checks what the kernel supports, builds the padded (and, for fp8 caches,
   range-shifted) query, calls the kernel over the grid ``(batch, num_kv_heads, num_splits)``
   and the Mosaic merge where it applies; `decode_mosaic` calls it, and XLA's merge otherwise.
4. `decode` (in ``api.py``) validates, resolves the scale and the config, and dispatches.

Safety, by construction (values cannot raise under jit):

- Only the tiles of the split's range are visited, and a tile reads the table only for pages
  ``first // block_size .. (n - 1) // block_size`` (``first`` the window start): a tile's page
  slots past the sequence or before the window re-read an in-range page of the same tile, so the
  table tail is never read, and pages wholly outside the window are not copied. Every block id is
  clamped into ``[0, num_blocks)`` before it becomes an address; lengths into
  ``[0, max_blocks * block_size]``.
- Scores of positions outside ``[first, n)`` are ``-inf`` (a select: NaN keys vanish too), and on
  tiles that hold such positions the V rows are replaced by zeros in shared memory before the
  ``P V`` product, so ``0 * NaN`` cannot reach the output.
- A row with no valid position gives zeros and ``lse = -inf`` (the merge's rule).

Supported (anything else is a ValueError naming the argument):

- bf16 / fp16 queries (fp32 would run the tensor cores in TF32, which SPEC forbids: use
  ``impl="pallas"`` or ``"xla"``);
- caches of the query's dtype, or float8_e4m3fn: tiles converted to fp16 (sm_90's one hardware
  conversion from e4m3; exact), V in shared memory, K in shared memory or, with
  ``MosaicDecodeConfig.fp8_k_in_registers`` (the heuristic's choice; compiled only), in registers
  as the ``S^T = K Q^T`` wgmma's A operand; a bf16 query divided by a power of two into fp16's
  range as in the Triton kernel, the scores multiplied back;
- ``head_dim`` 64, 128, 192 or 256: a multiple of 64, wgmma's M of ``O^T = V^T P^T`` with the
  queries in N (32: Mosaic's layout inference finds no layout for 64-byte rows); at 256, 128-token
  tiles, the group's queries in M (``queries_in_n=False``) and groups of more than 56 query
  heads need more shared memory than a CTA has (a ValueError says so);
- ``block_size`` a multiple of 8 that divides ``block_k`` or is a multiple of it;
- up to 64 query heads per kv head;
- jax >= 0.11.2 (``plgpu.kernel``'s API), GPUs of compute capability 9.0 or later, or Mosaic GPU's
  interpret mode (``plgpu.InterpretGPUParams``) on any machine.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_paged._attention_common import (divides, finite_total_max, merge_splits,
                                            num_kv_heads, tile_range)
from pallas_paged._fp8 import kernel_scale_operands
from pallas_paged._mosaic_common import (MAX_SMEM_BYTES, PRODUCER_REGISTERS, allocated,
                                         check_device, check_head_dim, check_jax,
                                         check_pages_fit_tiles, check_query_dtype,
                                         consumer_registers, copies_per_tile, copy_kv_tile,
                                         ctas_per_sm, dealt_index, dealt_items, import_plgpu,
                                         mma_smem, mma_swizzle, persistent_programs,
                                         tile_block_ids, with_optional_operands)
from pallas_paged._platform import sm_count
from pallas_paged._triton_common import FP16_SAFE_MAX, dot_dtype
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig

MMA_ROWS = 64  # wgmma's M: the query rows of a group, padded with zero queries
MMA_COLUMNS = 8  # the unit of wgmma's N: with queries_in_n, the group is padded to a multiple
TRANSPOSE_K = 16  # wgmma's K for 16-bit operands: the rows of O^T's transposing product
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
KERNEL_NAME = "pallas_paged_decode_mosaic"
MERGE_KERNEL_NAME = "pallas_paged_merge_mosaic"
PRODUCER = 0  # the producer warpgroup; consumers are warpgroups 1 .. num_consumers
# The shared memory Mosaic GPU places at the end of the scoped allocations for a reduction across
# the warps of a warpgroup (its CompilerParams.reduction_scratch_bytes, passed explicitly). Every
# warpgroup's reductions at one point of the program use the same bytes, so the consumers after
# the first lower theirs past pads of this size (`lower_apart`): concurrent reductions of two
# warpgroups in one scratch race.
REDUCTION_SCRATCH_BYTES = 2048
# Shared memory Mosaic GPU's kernel takes beyond the scratch below (a CTA of 230504 scratch bytes
# takes 232552 bytes, jax 0.11.2).
MOSAIC_OWN_SMEM_BYTES = 2048
# Mosaic GPU's compiler parameters for the kernel: exact math (exp, division), as the parity
# bounds were met with.
COMPILER_PARAMS = {"approx_math": False, "reduction_scratch_bytes": REDUCTION_SCRATCH_BYTES}


def v_converted_stages(num_consumers: int) -> int:
    """With ``MosaicDecodeConfig.fp8_v_in_producer``: the tiles of the ring of converted fp16 V
    tiles the producer fills and the consumers read. Two (one converted while the other is read)
    for one consumer; one per consumer for several, so that consumer ``c`` (the split's tiles
    ``c, c + C, ...``) alone waits on slot ``c``'s barriers."""
    return max(2, num_consumers)


def reduction_pads(num_consumers: int, queries_in_n: bool) -> int:
    """Scoped pads of `REDUCTION_SCRATCH_BYTES` that `lower_apart` places under the consumers after
    the first: only the queries in N reduce across warps (over the tokens of ``S^T``)."""
    return num_consumers - 1 if queries_in_n else 0


def lower_apart(plgpu, count: int, lower, apart: bool) -> None:
    """``lower(i)`` for ``i`` in ``0 .. count - 1`` (each guards itself with a ``pl.when`` on its
    warpgroup), with ``apart``: ``lower(i)`` inside ``i`` nested scoped pads of
    `REDUCTION_SCRATCH_BYTES`, so the scratch Mosaic GPU places at the end of the scoped
    allocations for each cross-warp reduction lies at its own offset for every ``i``.

    Each scope begins with a barrier of the whole CTA (and ends without one): every warpgroup must
    reach this call before it waits on another. The scopes are entered first, deepest last, and
    ``lower(i)`` runs on the way out, so no warpgroup's work sits before another's barrier.
    """
    if not apart:
        for i in range(count):
            lower(i)
        return

    def from_level(i):
        if i + 1 < count:
            pl.run_scoped(lambda _pad: from_level(i + 1),
                          plgpu.SMEM((REDUCTION_SCRATCH_BYTES // 4,), jnp.float32),
                          collective_axes="wg")
        lower(i)

    from_level(0)


def finalizes(config: MosaicDecodeConfig, *, batch: int, kvh: int, group: int, head_dim: int,
              cache_dtype, compute_dtype, sm_count: int) -> bool:
    """Whether the kernel writes the normalized output itself, so that no merge follows it (one
    XLA launch less). Where

    - each (sequence, kv head) has one part (one split, one consumer): nothing to merge;
    - its ``group`` lse values are a multiple of 16 bytes (TMA copies them; a group of 1 or 2,
      as MHA's, is merged after the kernel);
    - the output's shared memory (`final_smem_bytes`) costs no wave: the saved launch is
      worth less than halving the CTAs per multiprocessor. A persistent grid
      (`MosaicDecodeConfig.persistent`) has one wave by construction: its CTAs normalize
      wherever the staging fits, since the producer streams the next item's tiles meanwhile;
    - the cache is 16-bit: with an fp8 cache the normalizing kernel needs more registers than
      this shared-memory model sees (one CTA per multiprocessor instead of two), and XLA
      normalizing its single part is faster (docs/design/decode_mosaic.md).
    """
    if config.num_splits * config.num_consumers != 1 or (group * 4) % 16:
        return False
    if jnp.dtype(cache_dtype).itemsize == 1:
        return False
    sizes = [smem_bytes(head_dim, cache_dtype, compute_dtype, config, alibi=True, group=group,
                        finalize=finalize) for finalize in (False, True)]
    if sizes[1] > MAX_SMEM_BYTES:
        return False
    if config.persistent:
        return True
    waves = [-(-batch * kvh // (sm_count * ctas_per_sm(size))) for size in sizes]
    return waves[0] == waves[1]


def reads_rows_of_8(config: MosaicDecodeConfig, *, num_heads: int, group: int,
                    normalized_in_mosaic: bool, converts_query: bool) -> bool:
    """Whether the kernel reads the query as it is, ``[batch * num_heads, head_dim]``, in boxes of
    8 aligned rows (TMA copies of a tiled shared-memory ref start at a multiple of its 8-row
    tiles), instead of a copy padded to 8 rows per kv head, which XLA would build before the
    kernel (one more launch): a group of 4 (or 2, 1) lies inside one such box, at column 0 or 4
    of the scores. Where Mosaic code normalizes the output (the kernel itself, `finalizes`, or
    the merge kernel after it, `merges_in_mosaic`: both find each group's columns; XLA's merge
    would not), with the queries in N and 8 of them per kv head, a group below 8 that divides it,
    ``num_heads`` a multiple of 8 (no box past the end), and no conversion of the query: fp8
    caches read with a bf16 query divide it by a power of two in XLA first. (Divided per query
    column inside the kernel instead, the division costs every tile.)"""
    return (normalized_in_mosaic and config.queries_in_n and group < MMA_COLUMNS
            and MMA_COLUMNS % group == 0 and num_heads % MMA_COLUMNS == 0 and not converts_query)


class QueryBox(NamedTuple):
    """Where the group of kv head ``h`` of sequence ``b`` lies in what a CTA reads of the query
    (`reads_rows_of_8`): with ``rows_of_8`` the 8-aligned box of query rows ``row .. row + 7``
    of ``[batch * num_heads, head_dim]``, the group at its column ``column``, and the box of the
    per-head slopes and sinks from head ``head``; without, ``row`` and ``column`` are 0 (the
    query is padded per kv head) and the per-head operands are read at ``h``."""

    row: Any
    column: Any
    head: Any


def query_box(b, h, *, kvh: int, group: int, rows_of_8: bool) -> QueryBox:
    """`QueryBox` of kv head ``h`` of sequence ``b``; the other columns of a box are neighbouring
    heads' queries, computed and never written."""
    head_row = (b * kvh + h) * group if rows_of_8 else 0  # the group's first query row
    row = head_row // MMA_COLUMNS * MMA_COLUMNS
    return QueryBox(row=row, column=head_row - row,
                    head=(h * group) // MMA_COLUMNS * MMA_COLUMNS)


def per_query_source(ref, h, box: QueryBox, rows_of_8: bool):
    """The part of a per-query operand (slopes, sinks: f32[kvh, R], or with ``rows_of_8``
    f32[num_heads]) that kv head ``h``'s CTA copies: its row, or its box of 8 heads."""
    if rows_of_8:
        return ref.at[pl.ds(pl.multiple_of(box.head, MMA_COLUMNS), MMA_COLUMNS)]
    return ref.at[h]


MERGE_CHUNK_BYTES = 32 * 1024  # the parts' O^T one TMA of the merge kernel brings in


def merge_chunk(parts: int, head_dim: int, q_rows: int) -> int:
    """The parts per TMA copy of `merge_parts_mosaic` (a divisor of ``parts``): as many as fit in
    `MERGE_CHUNK_BYTES`, at least one."""
    fit = max(1, MERGE_CHUNK_BYTES // (head_dim * q_rows * 4))
    return max(d for d in range(1, min(parts, fit) + 1) if parts % d == 0)


def merge_smem_bytes(parts: int, head_dim: int, q_rows: int, out_dtype) -> int:
    """Shared memory of one CTA of `merge_parts_mosaic`, at most: with the sinks, and with
    `MOSAIC_OWN_SMEM_BYTES` (lowered for 16 and for 2 parts without sinks, jax 0.12.0.1, the
    kernel asked for 3,072 bytes less)."""
    chunk = merge_chunk(parts, head_dim, q_rows)
    total = allocated(2 * chunk * head_dim * q_rows * 4)      # two slots of the parts' O^T
    total += allocated(*[parts * q_rows * 4] * 2, *[q_rows * 4] * 2)  # m, l; the sinks, the lse
    total += final_smem_bytes(q_rows, head_dim, out_dtype, queries_in_n=True)
    return total + 8 * 3 + MOSAIC_OWN_SMEM_BYTES              # barriers


def merges_in_mosaic(config: MosaicDecodeConfig, *, group: int, head_dim: int, out_dtype,
                     finalize: bool) -> bool:
    """Whether the parts are merged by `merge_parts_mosaic` (one launch, and the kernel reads the
    query unpadded before it: `reads_rows_of_8`) instead of XLA's `merge_splits` (a transpose
    and reductions): where each (sequence, kv head) has several parts, with the queries in N
    (the parts are ``O^T``), and the group's lse values a multiple of 16 bytes (TMA copies them;
    MHA's group of 1 is merged by XLA). One part that the kernel does not normalize itself
    (`finalizes`) stays with XLA: a merge CTA per (sequence, kv head) that only turns one O^T
    into rows costs more than it saves."""
    parts = config.num_splits * config.num_consumers
    q_rows = query_rows(group, config)
    return (not finalize and parts > 1 and config.queries_in_n and (group * 4) % 16 == 0
            and merge_smem_bytes(parts, head_dim, q_rows, out_dtype) <= MAX_SMEM_BYTES)


def _merge_parts_kernel(
    lens_ref,     # i32[batch]                                          (GMEM)
    o_ref,        # f32[batch, kvh, P, head_dim, R]: each part's O^T, unnormalized
    m_ref,        # f32[batch, kvh, P, R]: each part's running max (-inf: it saw no key)
    l_ref,        # f32[batch, kvh, P, R]: each part's sum of exponentials
    sinks_ref,    # f32[kvh, R] or None (rows_of_8: f32[num_heads])
    v_scale_ref,  # f32[1] or None (fp8)
    out_ref,      # [batch, kvh, group, head_dim] in out_dtype
    lse_ref,      # f32[batch, kvh, group]
    o_smem,       # f32[2, chunk, head_dim, R]: two slots of `chunk` parts' O^T
    m_smem,       # f32[P, R]: every part's m (allocations of their own: a TMA copy into shared
    l_smem,       # f32[P, R]: every part's l   memory needs an address aligned to 128 bytes)
    sinks_smem,   # f32[R] or None
    lse_smem,     # f32[R]
    final_smem,   # `FinalSmem`
    ml_bar,       # m, l and the sinks copied
    o_bars,       # [2]: a slot's parts copied (one arrival per part)
    *,
    plgpu,
    group: int,
    capacity: int,
    rows_of_8: bool,
    out_dtype,
    launched_early: bool = False,
):
    """`merge_splits` for one (sequence, kv head) of the decode kernel's parts, in one
    warpgroup: the parts' max, then their weighted sums of ``l`` and ``O^T`` (read in chunks of
    parts, one TMA ahead), normalized and written as the kernel writes one part
    (`write_normalized`). With ``rows_of_8`` the parts' columns are the kernel's box of 8 query
    rows, the group at its column ``QueryBox.column``. ``launched_early``: a programmatic
    dependent launch, started while the decode kernel runs (its CTAs trigger it at their
    start): the CTA waits for the decode grid's end, and its writes, before it reads a part."""
    b = jax.lax.axis_index("batch")
    h = jax.lax.axis_index("kv_head")
    kvh, parts, head_dim, q_rows = o_ref.shape[1:]
    chunk = o_smem.shape[1]
    chunks = parts // chunk
    n = jnp.clip(lens_ref[b], 0, capacity)
    box = query_box(b, h, kvh=kvh, group=group, rows_of_8=rows_of_8)
    per_query_layout = plgpu.Layout.WGMMA.reduce(0)  # f32[R] beside O^T [head_dim, R]

    def fetch(c, slot):
        # One copy per part: a copy of several parts' tiled O^T needs more than TMA's five
        # strided dimensions wherever R spans more than one swizzle row (groups 24, 40-64).
        for j in range(chunk):
            plgpu.copy_gmem_to_smem(o_ref.at[b, h, c * chunk + j], o_smem.at[slot, j],
                                    o_bars.at[slot])

    if launched_early:
        plgpu.griddepcontrol_wait()
    fetch(0, 0)
    plgpu.copy_gmem_to_smem(m_ref.at[b, h], m_smem, ml_bar)
    plgpu.copy_gmem_to_smem(l_ref.at[b, h], l_smem, ml_bar)
    if sinks_ref is not None:
        plgpu.copy_gmem_to_smem(per_query_source(sinks_ref, h, box, rows_of_8), sinks_smem,
                                ml_bar)
    plgpu.barrier_wait(ml_bar)

    def row(ref):  # f32[R]
        return plgpu.load(ref, layout=per_query_layout)

    m_max = jax.lax.fori_loop(1, parts, lambda p, mx: jnp.maximum(mx, row(m_smem.at[p])),
                              row(m_smem.at[0]))
    sink = None if sinks_smem is None else row(sinks_smem)
    m_total = finite_total_max(m_max, sink)

    def add_chunk(c, carry):
        o, l_total = carry
        slot = jax.lax.rem(c, 2)

        @pl.when(c + 1 < chunks)
        def _fetch_next():
            plgpu.commit_smem()  # every thread is done reading the other slot (chunk c - 1)
            fetch(c + 1, 1 - slot)

        plgpu.barrier_wait(o_bars.at[slot])
        for j in range(chunk):
            p = c * chunk + j
            weight = jnp.exp(row(m_smem.at[p]) - m_total)  # 0 for a part with no key
            l_total = l_total + weight * row(l_smem.at[p])
            o_p = plgpu.load(o_smem.at[slot, j], layout=plgpu.Layout.WGMMA)
            if v_scale_ref is not None:  # P V is linear in V: dequantize each part's sum
                o_p = o_p * v_scale_ref[0]
            o = o + o_p * per_query_axis(weight, o_p.shape, 1)
        return o, l_total

    o, l_total = jax.lax.fori_loop(
        0, chunks, add_chunk,
        (plgpu.layout_cast(jnp.zeros((head_dim, q_rows), jnp.float32), plgpu.Layout.WGMMA),
         plgpu.layout_cast(jnp.zeros((q_rows,), jnp.float32), per_query_layout)))
    if sink is not None:
        l_total = l_total + jnp.exp(sink - m_total)
    write_normalized(plgpu, o, m_total, l_total, n=n, b=b, h=h, group=group,
                     group_column=box.column, queries_in_n=True, out_dtype=out_dtype,
                     final_smem=final_smem, lse_smem=lse_smem, out_ref=out_ref, lse_ref=lse_ref)


def launches_early(interpret: bool) -> bool:
    """Whether the Mosaic merge kernel is a programmatic dependent launch of the decode kernel
    before it (PTX ``griddepcontrol``, sm_90): its CTAs start while the decode kernel's last
    CTAs run and wait for that grid's end, so that its launch latency is off the call's path.
    Compiled only: interpret mode has no rule for ``griddepcontrol``."""
    return not interpret


def merge_parts_mosaic(o, m, l, lens, sinks, v_scale, *, group: int, capacity: int,
                       rows_of_8: bool, out_dtype, interpret: bool, launched_early: bool):
    """`merge_splits` of the decode kernel's parts as one Mosaic GPU kernel over the grid
    ``(batch, num_kv_heads)`` (`_merge_parts_kernel`), where `merges_in_mosaic`.

    Args:
      o: f32[batch, kvh, P, head_dim, R], each part's ``O^T`` as the kernel writes it (every
        column of its ``R`` query rows); m, l: f32[batch, kvh, P, R].
      lens: i32[batch], the sequence lengths (clamped to ``capacity`` here).
      sinks: f32[kvh, R] (zeros past the group) or None; with ``rows_of_8`` f32[num_heads].
      v_scale: f32[1] or None.
      rows_of_8: the kernel read the query in boxes of 8 rows (`reads_rows_of_8`).
      launched_early: the decode kernel before it triggers its launch (`launches_early`).

    Returns:
      ``(out [batch, kvh, group, head_dim] in out_dtype, lse f32[batch, kvh, group])``.
    """
    plgpu = import_plgpu()
    batch, kvh, parts, head_dim, q_rows = o.shape
    chunk = merge_chunk(parts, head_dim, q_rows)
    scratch = (
        plgpu.SMEM((2, chunk, head_dim, q_rows), jnp.float32),
        plgpu.SMEM((parts, q_rows), jnp.float32),
        plgpu.SMEM((parts, q_rows), jnp.float32),
        None if sinks is None else plgpu.SMEM((q_rows,), jnp.float32),
        plgpu.SMEM((q_rows,), jnp.float32),
        final_smem_scratch(plgpu, q_rows, head_dim, out_dtype, queries_in_n=True),
        plgpu.Barrier(num_arrivals=2 + (sinks is not None)),
        plgpu.Barrier(num_arrivals=chunk, num_barriers=2),
    )
    body = functools.partial(_merge_parts_kernel, plgpu=plgpu, group=group, capacity=capacity,
                             rows_of_8=rows_of_8, out_dtype=out_dtype,
                             launched_early=launched_early)
    kernel_body, optional = with_optional_operands(
        lambda *refs: pl.run_scoped(lambda *scratch_refs: body(*refs, *scratch_refs), *scratch),
        4, {"sinks": sinks, "v_scale": v_scale})
    return plgpu.kernel(
        kernel_body,
        out_type=(jax.ShapeDtypeStruct((batch, kvh, group, head_dim), out_dtype),
                  jax.ShapeDtypeStruct((batch, kvh, group), jnp.float32)),
        grid=(batch, kvh),
        grid_names=("batch", "kv_head"),
        kernel_name=f"{MERGE_KERNEL_NAME}_p{parts}_g{group}_d{head_dim}",
        compiler_params=plgpu.CompilerParams(**COMPILER_PARAMS),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(lens, o, m, l, *optional)


def query_rows(group: int, config: MosaicDecodeConfig) -> int:
    """The query rows the kernel computes per kv head, the group padded with zero queries: to
    wgmma's M of 64, or with ``config.queries_in_n`` to a multiple of its N unit of 8."""
    if config.queries_in_n:
        return -(-group // MMA_COLUMNS) * MMA_COLUMNS
    return MMA_ROWS


def smem_bytes(head_dim: int, cache_dtype, compute_dtype, config: MosaicDecodeConfig,
               alibi: bool = False, group: int = MMA_ROWS, finalize: bool = False) -> int:
    """Shared memory one CTA of the kernel takes for a group of ``group`` query heads: the
    scratch of `_paged_decode_kernel`, each allocation rounded up to Pallas' alignment
    (`allocated`), its barriers and `MOSAIC_OWN_SMEM_BYTES`; what the lowered kernel asks for,
    to the byte (`tests/test_decode_mosaic.py`). ``alibi``: with the slopes and, where the kernel
    normalizes, the sinks (the worst case of the optional operands); ``finalize``: with the
    normalized output's staging (`finalizes`), whose dtype has the compute dtype's size (both
    are 16-bit)."""
    cache, compute = jnp.dtype(cache_dtype).itemsize, jnp.dtype(compute_dtype).itemsize
    tile = config.block_k * head_dim
    consumers = config.num_consumers
    rows = query_rows(group, config)
    q_slots = query_slots(config.persistent)
    total = allocated(q_slots * rows * head_dim * compute)            # q
    total += allocated(*[config.num_stages * tile * cache] * 2)       # the K and V ring
    convert = jnp.dtype(cache_dtype) != jnp.dtype(compute_dtype)
    v_in_producer = convert and config.fp8_v_in_producer
    v_ring = v_converted_stages(consumers)
    if convert:                                              # converted V (and K) tiles
        v_tiles = v_ring if v_in_producer else consumers
        k_tiles = 0 if config.fp8_k_in_registers else consumers
        total += allocated(v_tiles * tile * compute, k_tiles * tile * compute)
    total += allocated(consumers * rows * config.block_k * compute)   # P
    total += allocated(consumers * rows * head_dim * 4, consumers * 2 * rows * 4)  # o; m, l
    if alibi:                             # the slopes, and where the kernel normalizes the sinks
        total += allocated(*[q_slots * per_query_slot(rows, q_slots) * 4] * (1 + finalize))
    if finalize:                                             # the normalized output
        total += final_smem_bytes(rows, head_dim, compute_dtype, config.queries_in_n)
    total += 8 * (q_slots * (1 + config.persistent) + 3 * config.num_stages)  # barriers
    total += 8 * 2 * v_ring * v_in_producer                  # the converted ring's barriers
    total += REDUCTION_SCRATCH_BYTES * reduction_pads(consumers, config.queries_in_n)  # pads
    return total + MOSAIC_OWN_SMEM_BYTES


# The config with the least shared memory: where it does not fit, none does.
SMALLEST_CONFIG = MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True)


def check_supported(q, k_cache, config: MosaicDecodeConfig) -> None:
    """ValueError naming the argument for every shape or dtype this kernel does not handle."""
    _, num_heads, head_dim = q.shape
    kvh = k_cache.shape[2]
    check_query_dtype(q)
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(q.dtype), FP8):
        raise ValueError(f"impl='mosaic' takes caches of q's dtype or float8_e4m3fn, got"
                         f" k_cache.dtype={jnp.dtype(k_cache.dtype)} with"
                         f" q.dtype={jnp.dtype(q.dtype)}")
    check_head_dim(q, SUPPORTED_HEAD_DIMS)
    check_pages_fit_tiles(k_cache, config.block_k, "block_k")
    group = max(num_heads // kvh, 1)
    need = smem_bytes(head_dim, k_cache.dtype, q.dtype, config, alibi=True, group=group)
    least = smem_bytes(head_dim, k_cache.dtype, q.dtype, SMALLEST_CONFIG, alibi=True, group=group)
    if least > MAX_SMEM_BYTES:
        raise ValueError(
            f"impl='mosaic' cannot hold a group of {group} query heads at head_dim={head_dim}"
            f" in one CTA's {MAX_SMEM_BYTES} bytes of shared memory ({least} with its smallest"
            f" config) for {q.shape=}, {k_cache.shape=}: use impl='pallas'")
    if need > MAX_SMEM_BYTES:
        raise ValueError(
            f"config={config} needs {need} bytes of shared memory for {k_cache.shape=}, more than"
            f" the {MAX_SMEM_BYTES} of one CTA: fewer num_stages, a smaller block_k or"
            " queries_in_n=True where the config has them, else impl='pallas'")
    if num_heads // kvh > MMA_ROWS:
        raise ValueError(f"impl='mosaic' supports up to {MMA_ROWS} query heads per kv head, got"
                         f" {q.shape=} with {k_cache.shape=}: use impl='pallas'")


def refusal(q, k_cache, config: MosaicDecodeConfig, interpret: bool) -> str | None:
    """Why this kernel cannot run the call (a ValueError's message), or None where it can.

    The jax version (`check_jax`), the shapes and dtypes for ``config`` (`check_supported`), then
    the device for ``interpret`` (`check_device`). Reads only ``.shape`` and ``.dtype`` of ``q``
    and ``k_cache`` (`jax.ShapeDtypeStruct` will do), so callers can ask before building any
    input; `pallas_paged.decode` asks once per call, before `decode_mosaic`.
    """
    try:
        check_jax()
        check_supported(q, k_cache, config)
        check_device(interpret)
    except ValueError as e:
        return str(e)
    return None


class WorkItem(NamedTuple):
    """One (sequence ``b``, kv head ``h``, split ``split``) of the decode kernel's work: the
    sequence's clamped length ``n``, the first position ``first`` its queries attend (the
    window's start, else 0), the split's tiles ``[tile_lo, tile_hi)`` (``num_tiles >= 0`` of
    them), the pages they may address ``[page_lo, page_hi]`` (the table is read only there), and
    where its group lies in what the CTA reads of the query (`QueryBox`)."""

    b: Any
    h: Any
    split: Any
    n: Any
    first: Any
    tile_lo: Any
    tile_hi: Any
    num_tiles: Any
    page_lo: Any
    page_hi: Any
    box: QueryBox


def sort_by_length(lens):
    """``(order, sorted_lens)``, i32[batch] each: the sequences by length, shortest first (ties
    in index order), and their lengths, from one XLA sort, for persistent CTAs to deal the
    longest first (`dealt_index`) with each item's sequence and length two independent loads."""
    sorted_lens, order = jax.lax.sort(
        (lens, jax.lax.broadcasted_iota(jnp.int32, lens.shape, 0)), num_keys=1)
    return order, sorted_lens


def query_slots(persistent: bool) -> int:
    """Shared-memory slots of the query (and its slopes and sinks): two for a persistent CTA,
    which copies the next work item's query while the consumer still reads this one's; one
    otherwise."""
    return 2 if persistent else 1


def per_query_slot(q_rows: int, q_slots: int) -> int:
    """The f32 values per slot of the per-query operands in shared memory (slopes, sinks): the
    query rows, and with several slots rounded up to 128 bytes (32 values), the alignment a TMA
    copy into shared memory needs."""
    return q_rows if q_slots == 1 else -(-q_rows // 32) * 32


def _paged_decode_kernel(
    lens_ref,     # i32[batch]                                          (GMEM)
    tables_ref,   # i32[batch, max_blocks]                              (GMEM)
    q_ref,        # [batch, num_kv_heads, R, head_dim], zero rows past the group (R: `query_rows`),
                  # or with rows_of_8: the query as it is, [batch * num_heads, head_dim]
    k_ref,        # [num_blocks, block_size, num_kv_heads, head_dim]    (the cache)
    v_ref,        # [num_blocks, block_size, num_kv_heads, head_dim]
    order_ref,    # i32[batch] or None (persistent): the sequences by length, shortest first
    sorted_lens_ref,  # i32[batch] or None (persistent): their lengths (`sort_by_length`)
    alibi_ref,    # f32[num_kv_heads, R] or None (rows_of_8: f32[num_heads])
    sinks_ref,    # f32[num_kv_heads, R] or None (finalize only; the merge adds them otherwise;
                  # rows_of_8: f32[num_heads])
    k_scale_ref,  # f32[1] or None (fp8)
    shift_ref,    # f32[batch, num_kv_heads] or None (fp8, bf16 query): the query's power of two
    v_scale_ref,  # f32[1] or None (fp8, finalize only; applied after the kernel otherwise)
    *out_refs,    # finalize (one part per (sequence, kv head)):
                  #   out [batch, num_kv_heads, group, head_dim] in out_dtype, normalized
                  #   lse f32[batch, num_kv_heads, group]
                  # else the partial results (C = num_consumers: part split * C + c is c's):
                  #   o f32[batch, num_kv_heads, num_splits * C, group, head_dim], unnormalized
                  #     (queries_in_n: its transpose with every row, [..., head_dim, R])
                  #   m f32[batch, num_kv_heads, num_splits * C, R], running max
                  #   l f32[batch, num_kv_heads, num_splits * C, R], sum of exponentials
    plgpu,
    scale: float,
    group: int,
    block_k: int,
    num_splits: int,
    num_stages: int,
    num_consumers: int,
    queries_in_n: bool,
    fp8_k_in_registers: bool,
    fp8_v_in_producer: bool,
    soft_cap: float | None,
    window: int | None,
    compute_dtype,
    finalize: bool,
    out_dtype,
    rows_of_8: bool = False,
    programs: int | None = None,
    launches_merge: bool = False,
    fused: bool = False,
):
    if launches_merge:  # the merge kernel's CTAs may start now and wait for this grid's end
        plgpu.griddepcontrol_launch_dependents()
    num_blocks, block_size, _, head_dim = k_ref.shape
    kvh = num_kv_heads(k_ref.shape, fused)
    batch, max_blocks = tables_ref.shape
    convert = jnp.dtype(k_ref.dtype) != jnp.dtype(compute_dtype)
    v_ring = v_converted_stages(num_consumers)  # with fp8_v_in_producer: converted V tiles
    q_rows = MMA_COLUMNS if rows_of_8 else q_ref.shape[2]
    q_slots = query_slots(programs is not None)
    # The scores' layout: [q_rows, Tk] (queries in wgmma's M), or [Tk, q_rows] (queries_in_n).
    query_axis = 1 if queries_in_n else 0
    token_axis = 1 - query_axis
    score_shape = (block_k, q_rows) if queries_in_n else (q_rows, block_k)
    acc_shape = (head_dim, q_rows) if queries_in_n else (q_rows, head_dim)  # O^T or O

    def work_item(b, h, split, length=None) -> WorkItem:
        """Item (``b``, ``h``, ``split``), with ``length`` the sequence's (else read from
        ``lens_ref``)."""
        n = jnp.clip(lens_ref[b] if length is None else length, 0, max_blocks * block_size)
        first, tile_lo, tile_hi = tile_range(n, split, block_k=block_k, num_splits=num_splits,
                                             window=window)
        # rows_of_8 (`reads_rows_of_8`): the CTA reads the 8 query rows (and slopes, sinks) of
        # the 8-aligned box that holds the group, which starts at column `box.column` of the
        # scores.
        return WorkItem(b=b, h=h, split=split, n=n, first=first, tile_lo=tile_lo,
                        tile_hi=tile_hi, num_tiles=jnp.maximum(tile_hi - tile_lo, 0),
                        page_lo=first // block_size, page_hi=jnp.maximum(n - 1, 0) // block_size,
                        box=query_box(b, h, kvh=kvh, group=group, rows_of_8=rows_of_8))

    if programs is None:  # the grid (batch, kv head, split): one work item per CTA
        def item_at(j):
            del j
            return work_item(jax.lax.axis_index("batch"), jax.lax.axis_index("kv_head"),
                             jax.lax.axis_index("split"))
    else:  # persistent: the items `dealt_index` gives this CTA
        program = jax.lax.axis_index("program")
        my_items = dealt_items(program, programs, batch * kvh * num_splits)

        def item_source(j):
            """``(b, h, split, length)`` of the CTA's ``j``-th item: the sequence and its length
            two loads side by side (`sort_by_length`; the longest first)."""
            rank, rest = jnp.divmod(dealt_index(program, j, programs), kvh * num_splits)
            sorted_at = batch - 1 - rank
            return (order_ref[sorted_at], rest // num_splits, rest % num_splits,
                    sorted_lens_ref[sorted_at])

    def for_each_item(item_body, carry):
        """``item_body(j, item, carry)`` over this CTA's items ``j`` (one, unlooped, without
        ``programs``). Persistent, each item's sequence and length are loaded while the item
        before is worked on (their latency off the path from one item to the next)."""
        if programs is None:
            return item_body(0, item_at(0), carry)

        def next_item(j, state):
            source, carry = state
            ahead = item_source(jnp.minimum(j + 1, my_items - 1))  # used by the next step
            return ahead, item_body(j, work_item(*source), carry)

        return jax.lax.fori_loop(0, my_items, next_item, (item_source(0), carry))[1]

    def masked_steps(it, first_owner, last_owner, count):
        """``(lo, hi)``: of the ``count`` tiles of item ``it`` a warpgroup walks (its steps
        ``0 .. count - 1``), those before ``lo`` and from ``hi`` on hold positions outside
        ``[first, n)`` and take the masked tile body; ``[lo, hi)`` are whole tiles of the
        sequence, which need no mask. Only the split's first tile (before the window) and its
        last one (past the end of the sequence) can be partial; ``first_owner`` /
        ``last_owner`` say whether this warpgroup walks them (as its first and its last step).
        Three loops over these ranges instead of a mask on every tile: the whole tiles carry no
        selects and no branch."""
        some = count > 0
        lo = (some & first_owner & (it.tile_lo * block_k < it.first)).astype(jnp.int32)
        hi = count - (some & last_owner & (it.tile_hi * block_k > it.n)).astype(jnp.int32)
        return lo, jnp.maximum(hi, lo)

    def walk(it, count, step_body, carry, first_owner=True, last_owner=True):
        """``step_body(i, carry, masked)`` for ``i`` in ``[0, count)``, masked on the partial
        tiles of item ``it`` (`masked_steps`)."""
        lo, hi = masked_steps(it, first_owner, last_owner, count)
        carry = jax.lax.fori_loop(0, lo, functools.partial(step_body, masked=True), carry)
        carry = jax.lax.fori_loop(lo, hi, functools.partial(step_body, masked=False), carry)
        return jax.lax.fori_loop(hi, count, functools.partial(step_body, masked=True), carry)

    def zero_invalid_rows(v, tile, it):
        """``v`` (a ``[block_k, D]`` V tile of ``tile``) with the rows of positions outside
        ``[first, n)`` of item ``it`` zeroed: their scores are -inf, but ``0 * NaN`` would still
        reach P V."""
        row = tile * block_k + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
        return jnp.where((row >= it.first) & (row < it.n), v, jnp.zeros_like(v))

    def per_query(vector, shape):
        """f32[q_rows] broadcast along the other axis of ``shape``."""
        return per_query_axis(vector, shape, query_axis)

    def body(q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem, alibi_smem, sinks_smem, o_smem,
             ml_smem, final_smem, q_bars, q_free_bars, k_bars, v_bars, free_bars, vconv_bars,
             vfree_bars):
        # q_smem [q_slots, R, D] (R = q_rows); k_smem, v_smem [stages, block_k, D] in the cache
        # dtype; per consumer (leading axis C): kc_smem, vc_smem [C, block_k, D] in
        # compute_dtype (fp8 caches only, else None; kc_smem None with fp8_k_in_registers too;
        # vc_smem the producer's ring [v_ring, block_k, D] with fp8_v_in_producer), p_smem [C,
        # R, block_k] in compute_dtype, o_smem f32[C, R, D] (queries_in_n: [C, D, R], O^T),
        # ml_smem f32[C, 2, R]; alibi_smem, sinks_smem f32[q_slots, `per_query_slot`] (the
        # first R of a slot used) or None; final_smem: with finalize, `FinalSmem` (the
        # normalized output on its way out).
        # Barriers: q_bars[q_slots] (a work item's queries and slopes copied); q_free_bars
        # [q_slots] (persistent: the consumer is done with a query slot, else None);
        # k_bars[stages], v_bars[stages] (TMA done); free_bars[stages] (a stage is done with:
        # its consumer, and with fp8_v_in_producer the producer too); with fp8_v_in_producer,
        # vconv_bars[v_ring] (a converted V tile is ready) and vfree_bars[v_ring] (the consumer
        # is done with it), else None.
        def block_ids(it, tile):
            return tile_block_ids(tables_ref, it.b, tile, block_size=block_size,
                                  block_kv=block_k, num_blocks=num_blocks, page_lo=it.page_lo,
                                  page_hi=it.page_hi)

        def issue(it, tile, slot, blocks):
            copy_kv_tile(plgpu, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, kv_tile=tile,
                         slot=slot, blocks=blocks, kv_head=it.h, fused=fused,
                         block_size=block_size, block_kv=block_k)

        def copy_query(it, qslot):
            """TMA item ``it``'s query rows (and slopes, sinks) into slot ``qslot``."""
            if rows_of_8:
                rows = pl.ds(pl.multiple_of(it.box.row, MMA_COLUMNS), MMA_COLUMNS)
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[qslot], q_bars.at[qslot])
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[it.b, it.h], q_smem.at[qslot], q_bars.at[qslot])
            for ref, smem_ref in ((alibi_ref, alibi_smem), (sinks_ref, sinks_smem)):
                if smem_ref is not None:
                    plgpu.copy_gmem_to_smem(per_query_source(ref, it.h, it.box, rows_of_8),
                                            smem_ref.at[qslot, pl.ds(0, q_rows)],
                                            q_bars.at[qslot])

        def produce_converting_v(it, vc_ring):
            """The producer with ``fp8_v_in_producer`` (one item per CTA): fills the ring, then
            per tile converts its V stage into the ``vc_ring`` slot the consumer reads (a ring of
            ``v_ring``), and refills the stage once the consumer has its K too."""
            tile_lo, num_tiles = it.tile_lo, it.num_tiles
            for j in range(num_stages):  # the first tiles: every stage of the ring

                @pl.when(j < num_tiles)
                def _fill():
                    issue(it, tile_lo + j, j, block_ids(it, tile_lo + j))

            def produce(step, carry, masked):
                slot = jax.lax.rem(step, num_stages)
                vslot = jax.lax.rem(step, v_ring)
                refill = step + num_stages < num_tiles
                # The refill's table entries, loaded first: their latency hides behind the
                # conversion (past the range the page index is clamped: an entry of this
                # sequence, unused).
                blocks = block_ids(it, tile_lo + step + num_stages)
                plgpu.barrier_wait(v_bars.at[slot])

                @pl.when(step >= v_ring)
                def _wait_converted_free():
                    plgpu.barrier_wait(vfree_bars.at[vslot])

                store_v(slot, vc_ring.at[vslot], tile_lo + step, masked, it)
                plgpu.barrier_arrive(vconv_bars.at[vslot])

                @pl.when(refill)
                def _refill():
                    plgpu.barrier_arrive(free_bars.at[slot])  # the producer is done with V
                    plgpu.barrier_wait(free_bars.at[slot])    # and the consumer with K
                    issue(it, tile_lo + step + num_stages, slot, blocks)
                return carry

            walk(it, num_tiles, produce, 0)

        def store_v(slot, vc_ref, tile, masked, it):
            """The fp8 V tile of stage ``slot``, converted into ``vc_ref`` (``masked``: rows
            outside ``[first, n)`` zeroed), ready for the wgmma."""
            v = _from_fp8(v_smem[slot], compute_dtype)
            vc_ref[...] = zero_invalid_rows(v, tile, it) if masked else v
            plgpu.commit_smem()

        wg = jax.lax.axis_index("wg")

        def lower_consumer(c):
            @pl.when(wg == PRODUCER + 1 + c)
            def _consumer():
                if num_consumers > 1:
                    plgpu.set_max_registers(consumer_registers(num_consumers),
                                            action="increase")
                consume(c, q_smem, k_smem, v_smem,
                        None if kc_smem is None else kc_smem.at[c],
                        vc_smem if fp8_v_in_producer or vc_smem is None else vc_smem.at[c],
                        p_smem.at[c], alibi_smem, o_smem.at[c], ml_smem.at[c], q_bars,
                        q_free_bars, k_bars, v_bars, free_bars, vconv_bars, vfree_bars, store_v,
                        sinks_smem=sinks_smem, final_smem=final_smem)

        # The consumers first: with the queries in N each consumer's reductions across its warps
        # get their own scratch, under scopes whose barriers every warpgroup passes at once.
        lower_apart(plgpu, num_consumers, lower_consumer,
                    apart=reduction_pads(num_consumers, queries_in_n) > 0)

        @pl.when(wg == PRODUCER)
        def _producer():
            if num_consumers > 1:
                plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            if fp8_v_in_producer:  # one item per CTA (the config refuses persistent with it)
                it = item_at(0)
                copy_query(it, 0)
                produce_converting_v(it, vc_smem)
                return

            def produce_item(j, it, base):
                """Item ``j``: its query into slot ``j % q_slots`` once the consumer is done
                with the item that had it, then its tiles, each in the ring's stage of its step
                ``base + step`` counted across the items (``base``: the tiles before it), at most
                ``num_stages`` ahead of the consumer. A tile's table entries are loaded before
                waiting for its stage to be free, so their latency hides behind the wait (only
                tiles of the range are visited: an empty range reads no entry)."""
                qslot = jax.lax.rem(j, q_slots)
                if q_free_bars is not None:

                    @pl.when(j >= q_slots)
                    def _wait_query_free():
                        plgpu.barrier_wait(q_free_bars.at[qslot])

                copy_query(it, qslot)

                @pl.loop(0, it.num_tiles)
                def _produce(step):
                    ring_step = base + step
                    slot = jax.lax.rem(ring_step, num_stages)
                    blocks = block_ids(it, it.tile_lo + step)

                    @pl.when(ring_step >= num_stages)
                    def _wait_free():
                        plgpu.barrier_wait(free_bars.at[slot])

                    issue(it, it.tile_lo + step, slot, blocks)

                return base + it.num_tiles

            ring_steps = for_each_item(produce_item, jnp.int32(0))

            # The consumer frees every stage it reads; the arrivals no refill waited for (the
            # last `num_stages` steps), waited for here, so no barrier phase is left unobserved.
            @pl.loop(jnp.maximum(ring_steps - num_stages, 0), ring_steps)
            def _drain(ring_step):
                plgpu.barrier_wait(free_bars.at[jax.lax.rem(ring_step, num_stages)])

    def consume(c, q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem, alibi_smem, o_smem, ml_smem,
                q_bars, q_free_bars, k_bars, v_bars, free_bars, vconv_bars, vfree_bars, store_v,
                *, sinks_smem, final_smem):
        """Consumer ``c``: per work item of the CTA, the online softmax over its tiles (``c, c +
        C, ...`` of the split), then its partial results, or with ``finalize`` the normalized
        output. The per-consumer refs come without their leading axis (``vc_smem``: the
        producer's whole ring with ``fp8_v_in_producer``)."""
        def consume_item(j, it, base):
            qslot = jax.lax.rem(j, q_slots)
            plgpu.barrier_wait(q_bars.at[qslot])
            attend(c, it, base, q_smem.at[qslot], k_smem, v_smem, kc_smem,
                   vc_smem, p_smem, None if alibi_smem is None else alibi_smem.at[qslot],
                   o_smem, ml_smem, k_bars, v_bars, free_bars, vconv_bars, vfree_bars,
                   store_v, sinks_smem=None if sinks_smem is None else sinks_smem.at[qslot],
                   final_smem=final_smem)
            if q_free_bars is not None:

                @pl.when(j + q_slots < my_items)
                def _free_query():
                    plgpu.barrier_arrive(q_free_bars.at[qslot])

            return base + it.num_tiles

        for_each_item(consume_item, jnp.int32(0))

    def attend(c, it, base, q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem,
               alibi_smem, o_smem, ml_smem, k_bars, v_bars, free_bars, vconv_bars, vfree_bars,
               store_v, *, sinks_smem, final_smem):
        """Consumer ``c`` on item ``it``, whose tiles are the ring's steps ``base ..`` (counted
        across the CTA's items); the query slot's refs come without their slot axis."""
        num_tiles = it.num_tiles
        if alibi_smem is not None:
            # f32[q_rows], one slope per query (the layout of the scores' token reductions).
            slopes = plgpu.load(alibi_smem.at[pl.ds(0, q_rows)],
                                layout=plgpu.Layout.WGMMA.reduce(token_axis))
        score_scale = scale
        if k_scale_ref is not None:  # fp8: scale * k_scale, times the query's power of two
            score_scale = scale * k_scale_ref[0]
            if shift_ref is not None:
                score_scale = shift_ref[it.b, it.h] * score_scale

        def tile_body(i, carry, masked):
            # f32[q_rows, D] (queries_in_n: [D, q_rows]), f32[q_rows], f32[score_shape] (the sum
            # of the exponentials per score position, summed over the tokens once, after the
            # last tile: no cross-warp reduction per tile for it); ``masked`` (static): the tile
            # holds positions outside [first, n) (`masked_steps`)
            acc, m_prev, l_parts = carry
            step = c + i * num_consumers  # the split's tile counted from tile_lo
            tile = it.tile_lo + step
            ring_step = base + step  # counted across the CTA's items
            slot = jax.lax.rem(ring_step, num_stages)
            if masked or alibi_smem is not None:  # the scores' positions
                pos = tile * block_k + jax.lax.broadcasted_iota(jnp.int32, score_shape,
                                                                token_axis)

            plgpu.barrier_wait(k_bars.at[slot])
            if fp8_k_in_registers:
                # fp8 K straight into registers in the layout that converts to wgmma's A operand
                # with one warp shuffle: no fp16 copy of the tile in shared memory.
                k_tile = fp8_tile_in_registers(plgpu, k_smem.at[slot], compute_dtype)
            elif convert:
                kc_smem[...] = _from_fp8(k_smem[slot], compute_dtype)
                plgpu.commit_smem()
                k_tile = kc_smem
            else:
                k_tile = k_smem.at[slot]

            def qk(acc_ref):
                if queries_in_n:  # S^T = K Q^T: M = the tile's tokens, N = the queries
                    plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
                else:
                    plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(score_shape, jnp.float32))  # f32[score_shape]
            if fp8_v_in_producer:
                # K is all this consumer reads of the stage (V comes converted): free its part of
                # the stage now, so the producer refills it while the softmax runs.
                @pl.when(step + num_stages < num_tiles)
                def _free_k():
                    plgpu.barrier_arrive(free_bars.at[slot])
            s = s * score_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            if alibi_smem is not None:
                rel = (pos - (it.n - 1)).astype(jnp.float32)
                s = s + per_query(slopes, s.shape) * rel
            if masked:
                s = jnp.where((pos >= it.first) & (pos < it.n), s, -jnp.inf)
            m_next = jnp.maximum(m_prev, s.max(axis=token_axis))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)  # f32[q_rows]
            p = jnp.exp(s - per_query(m_safe, s.shape))  # 0 where masked
            l_parts = l_parts * per_query(alpha, p.shape) + p

            if fp8_v_in_producer:  # converted (and masked) by the producer
                vslot = jax.lax.rem(step, v_ring)
                plgpu.barrier_wait(vconv_bars.at[vslot])
                v_tile = vc_smem.at[vslot]
            elif convert:
                plgpu.barrier_wait(v_bars.at[slot])
                store_v(slot, vc_smem, tile, masked, it)
                v_tile = vc_smem
            else:
                plgpu.barrier_wait(v_bars.at[slot])
                if masked:  # in place
                    v_smem[slot] = zero_invalid_rows(v_smem[slot], tile, it)
                    plgpu.commit_smem()
                v_tile = v_smem.at[slot]

            # P ([q_rows, Tk] in shared memory either way; S^T's P^T is stored transposed) goes
            # through shared memory: interpret mode takes wgmma operands from SMEM only.
            if queries_in_n:
                p_smem.transpose((1, 0))[...] = p.astype(compute_dtype)
            else:
                p_smem[...] = p.astype(compute_dtype)
            plgpu.commit_smem()

            def pv(acc_ref):
                if queries_in_n:  # O^T = V^T P^T: M = the head dimension, N = the queries
                    plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))
                else:
                    plgpu.wgmma(acc_ref, p_smem, v_tile)
                return acc_ref[...]

            # A fresh accumulator per tile (its own scope: interpret mode cannot mix ACC with
            # other memory spaces, nor seed it from registers), added to the rescaled sum.
            pv_tile = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            # Both wgmmas have read the stage (or its converted V): free it (with
            # fp8_v_in_producer, when the producer will refill it; else always, and the producer
            # waits for the arrivals it did not need at its end: every arrival is waited for, so
            # no barrier phase is left unobserved).
            if fp8_v_in_producer:
                @pl.when(step + v_ring < num_tiles)
                def _free_converted():
                    plgpu.barrier_arrive(vfree_bars.at[vslot])
            else:
                plgpu.barrier_arrive(free_bars.at[slot])

            acc = acc * per_query(alpha, acc.shape) + pv_tile
            return acc, m_next, l_parts

        carry = (jnp.zeros(acc_shape, jnp.float32),
                 jnp.full((q_rows,), -jnp.inf, jnp.float32),
                 jnp.zeros(score_shape, jnp.float32))
        my_tiles = (num_tiles - c + num_consumers - 1) // num_consumers  # >= 0
        # the split's first tile is this consumer's first step, its last one its last step
        acc, m, l_parts = walk(it, my_tiles, tile_body, carry, first_owner=c == 0,
                               last_owner=c == jax.lax.rem(jnp.maximum(num_tiles - 1, 0),
                                                           num_consumers))
        if finalize:
            write_final(it, acc, m, l_parts.sum(axis=token_axis), sinks_smem, ml_smem,
                        final_smem)
        else:
            write_partials(c, it, acc, m, l_parts.sum(axis=token_axis), o_smem, ml_smem)

    def write_final(it, acc, m, l, sinks_smem, ml_smem, final_smem):
        """The one part of item ``it``, normalized as `merge_splits` normalizes one split (the
        same operations in the same order: ``v_scale``, the sink, the division), written to
        ``out`` and ``lse`` (`write_normalized`): no merge after the kernel."""
        out_ref, lse_ref = out_refs
        o = acc if v_scale_ref is None else acc * v_scale_ref[0]
        sink = None
        if sinks_smem is not None:
            sink = plgpu.load(sinks_smem.at[pl.ds(0, q_rows)],
                              layout=plgpu.Layout.WGMMA.reduce(token_axis))
        m_total = finite_total_max(m, sink)
        weight = jnp.exp(m - m_total)  # f32[q_rows], 0 where this part saw no key
        l_total = weight * l
        if sink is not None:
            l_total = l_total + jnp.exp(sink - m_total)
        write_normalized(plgpu, o * per_query(weight, o.shape), m_total, l_total, n=it.n,
                         b=it.b, h=it.h, group=group, group_column=it.box.column,
                         queries_in_n=queries_in_n, out_dtype=out_dtype, final_smem=final_smem,
                         lse_smem=ml_smem.at[0], out_ref=out_ref, lse_ref=lse_ref)

    def write_partials(c, it, acc, m, l, o_smem, ml_smem):
        """Consumer ``c``'s unnormalized ``(o, m, l)`` of item ``it``, through shared memory to
        its part."""
        o_ref, m_ref, l_ref = out_refs
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        part = it.split * num_consumers + c
        # O^T whole (a transposed store of f32 registers finds no layout in compiled Mosaic
        # GPU); the caller transposes it and drops the padding columns.
        o_rows = o_smem if queries_in_n else o_smem.at[pl.ds(0, group)]
        plgpu.copy_smem_to_gmem(o_rows, o_ref.at[it.b, it.h, part])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[it.b, it.h, part])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[it.b, it.h, part])
        plgpu.wait_smem_to_gmem(0)

    def smem(shape, dtype, *, mma_operand):
        return mma_smem(plgpu, shape, dtype) if mma_operand else plgpu.SMEM(shape, dtype)

    cache_dtype = k_ref.dtype
    consumers = num_consumers
    per_query_shape = (q_slots, per_query_slot(q_rows, q_slots))
    scratch = (
        smem((q_slots, q_rows, head_dim), compute_dtype, mma_operand=True),
        smem((num_stages, block_k, head_dim), cache_dtype, mma_operand=True),
        smem((num_stages, block_k, head_dim), cache_dtype, mma_operand=True),
        (smem((consumers, block_k, head_dim), compute_dtype, mma_operand=True)
         if convert and not fp8_k_in_registers else None),
        (smem((v_ring if fp8_v_in_producer else consumers, block_k, head_dim),
              compute_dtype, mma_operand=True) if convert else None),
        smem((consumers, q_rows, block_k), compute_dtype, mma_operand=True),
        smem(per_query_shape, jnp.float32, mma_operand=False) if alibi_ref is not None else None,
        smem(per_query_shape, jnp.float32, mma_operand=False) if sinks_ref is not None else None,
        smem((consumers,) + acc_shape, jnp.float32, mma_operand=False),
        smem((consumers, 2, q_rows), jnp.float32, mma_operand=False),
        final_smem_scratch(plgpu, q_rows, head_dim, out_dtype, queries_in_n) if finalize else None,
        # q (and the slopes, the sinks) of a query slot copied
        plgpu.Barrier(num_arrivals=1 + (alibi_ref is not None) + (sinks_ref is not None),
                      num_barriers=q_slots),
        # persistent: the consumer is done with a query slot
        plgpu.Barrier(num_barriers=q_slots) if programs is not None else None,
        plgpu.Barrier(num_arrivals=copies_per_tile(block_size, block_k), num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies_per_tile(block_size, block_k), num_barriers=num_stages),
        # a stage's consumer, and with fp8_v_in_producer the producer too, are done with it
        plgpu.Barrier(num_arrivals=1 + fp8_v_in_producer, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=v_ring) if fp8_v_in_producer else None,
        plgpu.Barrier(num_barriers=v_ring) if fp8_v_in_producer else None,
    )
    pl.run_scoped(body, *scratch, collective_axes="wg")


def per_query_axis(vector, shape, query_axis: int):
    """f32[q_rows] broadcast along the other axis of ``shape`` (its queries on ``query_axis``)."""
    return jax.lax.broadcast_in_dim(vector, shape, [query_axis])


def write_normalized(plgpu, o, m_total, l_total, *, n, b, h, group: int, group_column,
                     queries_in_n: bool, out_dtype, final_smem, lse_smem, out_ref, lse_ref):
    """The end of a softmax over all parts of one (sequence, kv head), as `merge_splits` ends it:
    ``out = o / l_total`` where `divides` (else zeros; a row with ``n == 0`` gives zeros and ``lse
    = -inf``), ``lse = m_total + log(l_total)``, written to ``out_ref[b, h]`` ``[group, D]`` and
    ``lse_ref[b, h]`` ``[group]`` by TMA.

    ``o``: f32, the parts' weighted sum of values (``v_scale`` applied), ``[D, R]`` with the
    queries in N (``O^T``, turned into rows by `transpose_to_rows`) else ``[R, D]``; the group's
    queries are its columns (rows) ``group_column .. group_column + group - 1``. ``m_total``,
    ``l_total``: f32[R]. ``lse_smem``: f32[R] shared memory, ``final_smem``: `FinalSmem`.
    """
    query_axis = 1 if queries_in_n else 0
    present = jnp.zeros(m_total.shape, jnp.int32) + n > 0  # bool[R] (a select takes no scalar)
    has = divides(l_total) & present
    o = o / per_query_axis(jnp.where(has, l_total, 1.0), o.shape, query_axis)
    query = jax.lax.broadcasted_iota(jnp.int32, o.shape, query_axis)
    # zero rows past the group too: their values never reach the output, nor, through
    # E's zeros, an Inf or NaN of theirs the group's rows
    in_group = (query >= group_column) & (query < group_column + group)
    o = jnp.where(per_query_axis(has, o.shape, query_axis) & in_group, o, 0.0)
    lse_smem[...] = jnp.where(present, m_total + jnp.log(l_total), -jnp.inf)
    if queries_in_n:
        o = transpose_to_rows(plgpu, o, final_smem, group_column=group_column,
                              out_dtype=out_dtype)
    final_smem.out[...] = o.astype(out_dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(final_smem.out.at[pl.ds(0, group)], out_ref.at[b, h])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(group_column, group)], lse_ref.at[b, h])
    plgpu.wait_smem_to_gmem(0)


def transpose_to_rows(plgpu, o_t, final_smem, *, group_column, out_dtype):
    """``O^T`` (f32 ``[head_dim, q_rows]``, WGMMA layout) as ``O`` in out_dtype, padded to
    wgmma's 64 rows (WGMMA layout), row ``i`` being column ``i + group_column``: ``O^T``
    rounded to out_dtype into ``final_smem.o_t`` (``[K, head_dim]``, ``K`` the query rows
    padded to wgmma's K of 16 with zeros) by the transposed store P^T takes, then ``E [64, K]
    @ o_t`` with ``E`` the shifted identity (exact: each output is one product by 1.0), since a
    transposed store of f32 registers to memory that TMA can copy row by row has no layout in
    Mosaic GPU. A product by E's zeros would turn an Inf or NaN of one column into NaN in every
    row (``0 * Inf``), so the finite values go through it with the others zeroed, and a second
    product carries a code of the others (1 NaN, 2 +Inf, 3 -Inf), exact in any 16-bit float."""
    head_dim, q_rows = o_t.shape
    o_t_smem, eye_smem = final_smem.o_t, final_smem.eye
    k_rows = o_t_smem.shape[0]
    if k_rows > q_rows:
        zeros = plgpu.layout_cast(jnp.zeros((head_dim, k_rows - q_rows), out_dtype),
                                  plgpu.Layout.WGMMA)
        o_t_smem.at[pl.ds(q_rows, k_rows - q_rows)].transpose((1, 0))[...] = zeros
    eye_shape = eye_smem.shape
    # row i of the product is O^T's column i + group_column
    eye = (jax.lax.broadcasted_iota(jnp.int32, eye_shape, 0) + group_column
           == jax.lax.broadcasted_iota(jnp.int32, eye_shape, 1)).astype(out_dtype)
    eye_smem[...] = plgpu.layout_cast(eye, plgpu.Layout.WGMMA)

    def rows_of(columns):  # f32[head_dim, q_rows] -> f32[64, head_dim] through E
        o_t_smem.at[pl.ds(0, q_rows)].transpose((1, 0))[...] = columns.astype(out_dtype)
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, eye_smem, o_t_smem)
            return acc_ref[...]

        return pl.run_scoped(product, plgpu.ACC((MMA_ROWS, head_dim), jnp.float32))

    finite = jnp.abs(o_t) < jnp.inf
    values = rows_of(jnp.where(finite, o_t, 0.0))
    codes = rows_of(jnp.where(finite, 0.0, jnp.where(o_t != o_t, 1.0,
                                                      jnp.where(o_t > 0, 2.0, 3.0))))
    rows = jnp.where(codes == 1.0, jnp.nan, jnp.where(codes == 2.0, jnp.inf, jnp.where(
        codes == 3.0, -jnp.inf, values)))
    return rows.astype(out_dtype)


class FinalSmem(NamedTuple):
    """Shared memory of a kernel that writes the normalized output (``finalize``): ``out``
    ``[64, head_dim]`` (untiled, so that its first ``group`` rows copy out), and with the queries
    in N ``o_t`` ``[K, head_dim]`` and ``eye`` ``[64, K]`` (wgmma operands, ``K`` the query rows
    padded to a multiple of 16), all in the output dtype; else None."""

    o_t: Any
    eye: Any
    out: Any


def transposed_rows(q_rows: int) -> int:
    """The K of the wgmma that turns ``O^T`` into rows: the query rows padded to wgmma's 16."""
    return -(-q_rows // TRANSPOSE_K) * TRANSPOSE_K


def final_smem_scratch(plgpu, q_rows: int, head_dim: int, out_dtype, queries_in_n: bool):
    """`FinalSmem`'s allocations (see there)."""
    out = plgpu.SMEM((MMA_ROWS, head_dim), out_dtype)
    if not queries_in_n:
        return FinalSmem(None, None, out)
    k_rows = transposed_rows(q_rows)
    eye = mma_smem(plgpu, (MMA_ROWS, k_rows), out_dtype)
    # the two operands of one wgmma in one swizzle: E's, the narrower (its rows are K long)
    swizzle = mma_swizzle(k_rows * jnp.dtype(out_dtype).itemsize)
    return FinalSmem(mma_smem(plgpu, (k_rows, head_dim), out_dtype, swizzle=swizzle), eye, out)


def final_smem_bytes(q_rows: int, head_dim: int, out_dtype, queries_in_n: bool) -> int:
    """The shared memory of `final_smem_scratch`'s allocations (`allocated`)."""
    itemsize = jnp.dtype(out_dtype).itemsize
    k_rows = transposed_rows(q_rows)
    transposing = (k_rows * head_dim, MMA_ROWS * k_rows) if queries_in_n else ()
    return allocated(*(itemsize * n for n in (MMA_ROWS * head_dim, *transposing)))


def fp8_tile_in_registers(plgpu, ref, dtype):
    """The fp8 ``[rows, D]`` tile ``ref`` (shared memory) in registers, converted to ``dtype``
    (`_from_fp8`), in wgmma's register layout (its A operand): loaded in the layout whose upcast
    is one warp shuffle away from it."""
    x8 = plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_2X)
    return plgpu.layout_cast(_from_fp8(x8, dtype), plgpu.Layout.WGMMA)


def _from_fp8(x, dtype):
    """fp8 -> ``dtype`` (fp16, the one conversion from e4m3 that sm_90 has in hardware; exact)."""
    x = x.astype(jnp.float16)
    return x if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else x.astype(dtype)


def decode_kernel_call(q, k_cache, v_cache, block_tables, context_lens, *, scale,
                       config: MosaicDecodeConfig, interpret: bool, logits_soft_cap, alibi_slopes,
                       sliding_window, sinks, k_scale, v_scale, fused: bool):
    """The kernel over the grid ``(batch, num_kv_heads, num_splits)`` (persistent: over
    `persistent_programs` CTAs), with the XLA work that builds its operands (the query padded to
    the kernel's rows where it is not read in boxes of 8, for fp8 caches divided into fp16's
    range; the padded ALiBi slopes and sinks; the score multipliers; persistent, the sequences
    sorted by length), and the Mosaic merge after it where one applies (`merges_in_mosaic`).

    Arguments as `decode_mosaic`.

    Returns:
      where the kernel finalizes (`finalizes`: one part per (sequence, kv head)) or the Mosaic
      merge follows it, ``(out [batch, kvh, group, head_dim] in q.dtype, lse f32[batch, kvh,
      group])``; else the partial ``(o f32[batch, kvh, P, group, head_dim], m, l f32[batch, kvh,
      P, group])`` of the ``P = num_splits * num_consumers`` parts, unnormalized and without
      ``v_scale`` or the sinks, which `merge_splits` combines.
    """
    plgpu = import_plgpu()
    batch, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    group = num_heads // kvh
    splits = config.num_splits
    parts = splits * config.num_consumers  # partial results per (sequence, kv head)
    compute_dtype = dot_dtype(q.dtype, k_cache.dtype)  # fp16 for fp8 caches
    finalize = finalizes(
        config, batch=batch, kvh=kvh, group=group, head_dim=head_dim, cache_dtype=k_cache.dtype,
        compute_dtype=compute_dtype, sm_count=sm_count())
    lens = context_lens.astype(jnp.int32)
    tables = block_tables.astype(jnp.int32)
    q_grouped = q.reshape(batch, kvh, group, head_dim)
    rows = query_rows(group, config)
    # fp8 with a bf16 query, for the fp16 wgmmas: the query divided by the power of two that brings
    # each group's largest |q| under 2**15 (exact), the scores multiplied back in the kernel.
    converts_query = k_scale is not None and compute_dtype != q.dtype
    merge_in_mosaic = merges_in_mosaic(
        config, group=group, head_dim=head_dim, out_dtype=q.dtype, finalize=finalize)
    # one decision for both kernels: the decode kernel triggers what the merge kernel waits for
    merge_launched_early = merge_in_mosaic and launches_early(interpret)
    rows_of_8 = reads_rows_of_8(config, num_heads=num_heads, group=group,
                                normalized_in_mosaic=finalize or merge_in_mosaic,
                                converts_query=converts_query)
    shift = None
    if converts_query:
        q32 = q_grouped.astype(jnp.float32)
        q_max = jnp.max(jnp.abs(q32), axis=(2, 3))  # f32[batch, kvh]
        shift = jnp.exp2(jnp.maximum(jnp.ceil(jnp.log2(q_max / FP16_SAFE_MAX)), 0.0))
        q_grouped = q32 / shift[..., None, None]

    def per_query_operand(x):  # f32[num_heads] -> f32[kvh, rows], zeros past the group
        if x is None:
            return None
        x = x.astype(jnp.float32)
        if rows_of_8:
            return x
        x = x.reshape(kvh, group)
        return x if rows == group else jnp.pad(x, ((0, 0), (0, rows - group)))

    if rows_of_8:  # as it is
        q_padded = q.reshape(batch * num_heads, head_dim)
    else:
        q_padded = q_grouped.astype(compute_dtype)
        if rows > group:  # one more XLA op (a launch): groups of 8, 16, ... need none
            q_padded = jnp.pad(q_padded, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    # Interpret mode takes wgmma operands from shared memory only: the same numbers through the
    # converted tile in shared memory there.
    k_in_registers = config.fp8_k_in_registers and compute_dtype != k_cache.dtype and not interpret
    if config.persistent:  # as many CTAs as stay resident, each walking its work items
        smem = smem_bytes(head_dim, k_cache.dtype, compute_dtype, config, alibi=True,
                          group=group, finalize=finalize)
        programs = persistent_programs(batch * kvh * splits, smem, sm_count())
        grid, grid_names = (programs,), ("program",)
    else:
        programs, grid, grid_names = None, (batch, kvh, splits), ("batch", "kv_head", "split")
    body = functools.partial(
        _paged_decode_kernel, plgpu=plgpu, scale=scale, group=group, fused=fused,
        block_k=config.block_k, num_splits=splits, num_stages=config.num_stages,
        num_consumers=config.num_consumers, queries_in_n=config.queries_in_n,
        fp8_k_in_registers=k_in_registers,
        fp8_v_in_producer=config.fp8_v_in_producer and compute_dtype != k_cache.dtype,
        soft_cap=logits_soft_cap, window=sliding_window,
        compute_dtype=compute_dtype, finalize=finalize, out_dtype=q.dtype, rows_of_8=rows_of_8,
        programs=programs,
        launches_merge=merge_launched_early)
    # fp8: the scales (python floats or traced f32[]) operands, so one program serves every scale
    k_scale_operand, v_scale_operand = kernel_scale_operands(k_scale, v_scale)
    kernel_body, optional = with_optional_operands(body, 5, {  # in the kernel's order
        # persistent: the sequences by length, so that `dealt_index` balances the CTAs
        **dict(zip(("order", "sorted_lens"), sort_by_length(lens) if programs else (None,) * 2)),
        "alibi": per_query_operand(alibi_slopes),
        "sinks": per_query_operand(sinks) if finalize else None,
        "k_scale": k_scale_operand,
        "shift": shift,
        "v_scale": v_scale_operand if finalize else None,
    })
    operands = (lens, tables, q_padded, k_cache, v_cache, *optional)
    if finalize:
        out_type = (jax.ShapeDtypeStruct((batch, kvh, group, head_dim), q.dtype),
                    jax.ShapeDtypeStruct((batch, kvh, group), jnp.float32))
    else:
        o_shape = (head_dim, rows) if config.queries_in_n else (group, head_dim)
        out_type = (jax.ShapeDtypeStruct((batch, kvh, parts) + o_shape, jnp.float32),
                    jax.ShapeDtypeStruct((batch, kvh, parts, rows), jnp.float32),
                    jax.ShapeDtypeStruct((batch, kvh, parts, rows), jnp.float32))
    name = (f"{KERNEL_NAME}_bk{config.block_k}_s{splits}_st{config.num_stages}"
            f"_c{config.num_consumers}_g{group}_d{head_dim}_bs{k_cache.shape[1]}"
            + ("_qn" if config.queries_in_n else "")
            + ("_kreg" if k_in_registers else "")
            + ("_vprod" if config.fp8_v_in_producer and compute_dtype != k_cache.dtype else "")
            + ("_final" if finalize else "")
            + (f"_persistent{programs}" if programs else "") + ("_fused" if fused else ""))
    outs = plgpu.kernel(
        kernel_body,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=1 + config.num_consumers,
        thread_name="wg",
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(**COMPILER_PARAMS),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*operands)
    if finalize:
        return outs
    o, m, l = outs
    if merge_in_mosaic:
        return merge_parts_mosaic(
            o, m, l, lens, per_query_operand(sinks), v_scale_operand, group=group,
            capacity=tables.shape[1] * k_cache.shape[1], rows_of_8=rows_of_8, out_dtype=q.dtype,
            interpret=interpret, launched_early=merge_launched_early)
    if config.queries_in_n:
        o = jnp.swapaxes(o, -1, -2)[..., :group, :]
    return o, m[..., :group], l[..., :group]


def decode_mosaic(q, k_cache, v_cache, block_tables, context_lens, *, scale,
                  config: MosaicDecodeConfig, interpret: bool, logits_soft_cap, alibi_slopes,
                  sliding_window, sinks, k_scale, v_scale, fused: bool = False):
    """The Mosaic GPU kernel over the grid ``(batch, num_kv_heads, num_splits)`` and, where it
    leaves several parts per (sequence, kv head), the Mosaic merge (`decode_kernel_call`), or
    XLA's (`merge_splits`) where that one does not apply (`merges_in_mosaic`).

    Arguments as `pallas_paged.decode` (validated, ``scale`` resolved to a float); ``fused``:
    ``k_cache`` and ``v_cache`` are one fused cache ``[num_blocks, block_size, 2 * num_kv_heads,
    head_dim]``, whose K and V rows the TMA copies read in place. The caller has checked the call
    (`refusal`, on the K half's shape).

    Returns:
      ``(out [batch, num_heads, head_dim] in q.dtype, lse f32[batch, num_heads])``. ``k_scale`` /
      ``v_scale`` may be python floats or ``f32[]`` arrays: both enter the program as operands.
    """
    batch, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    outs = decode_kernel_call(
        q, k_cache, v_cache, block_tables, context_lens, scale=scale, config=config,
        interpret=interpret, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        fused=fused)
    if len(outs) == 2:  # the kernel finalized, or the Mosaic merge followed it
        out, lse = outs
    else:
        o, m, l = outs
        if v_scale is not None:  # P V is linear in V: dequantize the partial sums
            o = o * jnp.asarray(v_scale, jnp.float32).reshape(())
        n = jnp.clip(context_lens.astype(jnp.int32), 0,
                     block_tables.shape[1] * k_cache.shape[1])
        sinks_per_head = None if sinks is None else sinks.astype(jnp.float32).reshape(
            kvh, num_heads // kvh)
        out, lse = merge_splits(o, m, l, n, sinks_per_head)
    return (out.astype(q.dtype).reshape(batch, num_heads, head_dim),
            lse.reshape(batch, num_heads))

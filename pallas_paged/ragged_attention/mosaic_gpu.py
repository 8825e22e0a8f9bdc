"""Ragged paged attention, the Mosaic GPU kernel: ``paged_attention(..., impl="mosaic")``.

The structure of FlashAttention-3's forward kernel (warp-specialized producer, ping-ponging
consumers, wgmma with fp32 accumulators), adapted to pages and ragged batches, for Hopper and
later (``plgpu.kernel``). Read top to bottom (the public function is
`pallas_paged.ragged_attention.api.paged_attention`):

1. `work_list` (XLA, before the kernel) lists the query tiles: each sequence's new tokens in
   tiles of `tokens_per_cta` tokens, then the padding rows past ``query_start_loc[batch]`` as
   the tiles of a pseudo-sequence ``batch`` (no keys: its rows are written as zeros), sorted by
   the number of K/V positions they attend, longest first, so the GPU's block scheduler starts
   the long tiles first and a ragged batch leaves no long tail.
2. `_ragged_attention_kernel` works on refs only. A work item is one (query tile, kv head, head
   block); one CTA owns one item, or with ``MosaicAttentionConfig.persistent`` the CTAs that
   stay resident walk several each (dealt longest first in snake order, `dealt_index`; the
   ring, the query staging and the ping-pong turns carry on from one item to the next, so the
   next item's tiles stream in while the current one's output goes out). A CTA has
   ``num_consumers`` consumer warpgroups (1 or 2) and a producer warpgroup.
   - A consumer's 64 wgmma rows are 64 tokens of one query head, or with
     ``MosaicAttentionConfig.pack_heads`` the same ``64 / pack_heads`` tokens of that many heads
     of the kv head's group, one head after the other (so that a sequence with few new tokens
     does not leave most rows empty). With two consumers they take two packs of heads
     (`packs_per_cta`, where they divide the group's packs) over the same tokens, else two
     consecutive token tiles of one pack: either way they attend the same K/V tiles and share
     every stage of the ring.
   - The producer copies each consumer's query tile by TMA (a strided box ``q[t0:t0+64, head]``
     per head of the pack), then walks the CTA's K/V tiles: ``block_kv`` tokens, ``block_kv /
     block_size`` whole pages, one TMA copy each, the block ids read from the table in GMEM,
     into a ring of ``num_stages`` shared-memory stages; it refills a stage once every consumer
     has freed it.
   - fp8 caches: the first consumer converts each stage's K and V tiles to the query's dtype
     (exact) into a second ring, for both consumers; ``k_scale`` joins the scores' scale and
     ``v_scale`` the sum before its normalization.
   - A consumer computes ``S = Q K^T`` and ``O += P V`` with wgmma (P from registers, the
     accumulator seeded from registers), the online softmax in fp32 registers in base 2
     (``exp2``; the scale folds ``log2(e)`` in where no soft-cap or ALiBi comes between). The
     tiles are walked in three loops (`tiles.kv_tile_plan`): the window's edge and the causal
     diagonal, masked per (row, position), and between them the tiles every row sees whole,
     with no mask. Nothing past the tile's last query position is read, nor any tile wholly
     before the window of its first.
   - With ``ping_pong`` (two consumers), a schedule barrier orders the two consumers' wgmmas so
     that one's softmax runs while the other's products run on the tensor cores. With
     ``overlap_softmax``, each consumer issues the next tile's ``Q K^T`` before this tile's
     softmax, which then runs beside its own product (`walk_overlapped`).
   - Each consumer normalizes its rows (with the sink), writes them to shared memory and from
     there to the output by TMA in boxes of 64, 32, ..., 1 tokens (the binary digits of its row
     count, so no row of another sequence is touched), and its lse (64 values) to a per-CTA
     row that XLA gathers per token after the kernel (`gather_lse`).
3. `paged_attention_mosaic` builds the work list and operands, calls the kernel over
   ``work tiles x num_kv_heads x head blocks`` items (in that order of significance: a tile's
   items for every head run side by side), and gathers the lse.

Safety, by construction (values cannot raise under jit):

- ``query_start_loc`` and the lengths arrive clamped (the caller's `_paged_attention_jit`); a
  tile reads the table only for pages of its K/V range, and every block id is clamped into
  ``[0, num_blocks)`` before it becomes an address. A query tile near the end of ``q`` is read
  from ``num_tokens - 64`` (``q`` is padded to 64 rows when shorter), the consumer's rows
  shifted accordingly.
- Scores of positions a row does not see are ``-inf``; on the masked tiles the consumer (the
  first one, for both) replaces non-finite V entries at positions that not every row of the CTA
  sees by zeros in shared memory before ``P V``, so ``0 * NaN`` cannot reach a row that does not
  see them (invariant I8), as the Triton kernel does.
- Rows with no key (padding, a query at a position below 0) give zeros and ``lse = -inf``.

Supported (anything else is a ValueError naming the argument and the way out):

- bf16 / fp16 queries, caches of the query's dtype or float8_e4m3fn (head_dim 256 with fp8:
  ``impl="pallas"``: the converted ring does not fit);
- ``head_dim`` 64, 128, 192 or 256; ``block_size`` a multiple of 8 that divides ``block_kv`` or
  is a multiple of it; any GQA group;
- soft-cap, ALiBi, sliding window, sinks, ``return_lse``, the fused cache;
- jax >= 0.11.2 and compute capability 9.0 or later, or Mosaic GPU's interpret mode anywhere
  with jax >= 0.12 (`MIN_JAX_INTERPRET`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_paged._attention_common import divides, num_kv_heads
from pallas_paged._fp8 import kernel_scale_operands
from pallas_paged._platform import device_kind, sm_count
from pallas_paged.decode_attention import mosaic_gpu as decode_kernel
from pallas_paged.decode_attention import mosaic_gpu_config as decode_config
from pallas_paged.decode_attention.shape import decode_shape
from pallas_paged._mosaic_common import (MAX_SMEM_BYTES, PRODUCER_REGISTERS, allocated,
                                         check_device, check_head_dim, check_jax,
                                         check_pages_fit_tiles, check_query_dtype,
                                         consumer_registers, copies_per_tile, copy_kv_tile,
                                         dealt_index, dealt_items, import_plgpu, jax_version,
                                         mma_smem,
                                         persistent_programs, tile_block_ids,
                                         with_optional_operands)
from pallas_paged.ragged_attention.mosaic_gpu_config import MMA_ROWS, MosaicAttentionConfig
from pallas_paged.ragged_attention.tiles import kv_tile_plan

FP8 = jnp.dtype(jnp.float8_e4m3fn)
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256)
KERNEL_NAME = "pallas_paged_ragged_mosaic"
LOG2E = math.log2(math.e)
# Mosaic GPU's interpreter in jax 0.11 cannot seed a wgmma accumulator from registers
# (`plgpu.ACC.init`, the ``O += P V`` product); compiled, jax 0.11.2 runs the kernel.
MIN_JAX_INTERPRET = (0, 12, 0)
LN2 = math.log(2.0)
# Shared memory Mosaic GPU's kernel takes beyond the scratch (as for the decode kernel).
MOSAIC_OWN_SMEM_BYTES = 2048
V_FIX_ROWS = 64  # rows of a V tile the consumer checks for non-finite values at once
# Exact math (exp2, division), as the parity bounds were met with.
COMPILER_PARAMS = {"approx_math": False}


class _WorkItem(NamedTuple):
    """One work item of the kernel (`_ragged_attention_kernel`): a query tile for one kv head
    and head block, and the K/V tiles it walks (int32 scalars)."""
    w: Any           # the item's index (its lse rows)
    h: Any           # kv head
    hb: Any          # head block (`packs_per_cta` packs of the kv head's group)
    tile: Any        # the query tile within its sequence
    q_start: Any     # the sequence's first query row
    queries: Any     # the tile's query rows (0 .. `tokens_per_cta`)
    first_pos: Any   # the position of the tile's first query
    shared_lo: Any   # positions [shared_lo, shared_hi) every query of the tile sees
    shared_hi: Any
    loops: tuple     # the masked, unmasked and masked K/V tile ranges (`kv_tile_plan`)
    tile_lo: Any     # the first K/V tile
    steps: Any       # the K/V tiles walked
    page_lo: Any     # the pages the tiles may read: [page_lo, page_hi]
    page_hi: Any
    table_row: Any   # the sequence's row of the block table


def staging_columns(head_dim: int) -> int:
    """Columns of one part of the untiled query/output staging: 128 where they divide
    ``head_dim`` (Mosaic GPU's layout inference takes minutes over one untiled 256-column
    tile), else all of them."""
    return 128 if head_dim % 128 == 0 else head_dim


def packs_per_cta(group: int, num_consumers: int, pack: int) -> int:
    """Packs of ``pack`` query heads (`MosaicAttentionConfig.pack_heads`) one CTA computes: one
    per consumer where they divide the group's packs, else one."""
    packs = group // pack
    return num_consumers if packs % num_consumers == 0 else 1


def tokens_per_cta(group: int, num_consumers: int, pack: int) -> int:
    """Query tokens one CTA computes: ``64 / pack`` per consumer, over `packs_per_cta` packs."""
    return MMA_ROWS // pack * num_consumers // packs_per_cta(group, num_consumers, pack)


def num_work_tiles(num_tokens: int, batch: int, tokens: int) -> int:
    """A static bound on the query tiles of any ``query_start_loc``: ``ceil(q_len_b / tokens)``
    per sequence (padding rows included, as a last pseudo-sequence) sums to at most
    ``ceil(num_tokens / tokens) + batch`` and, each tile holding a token, to ``num_tokens``."""
    return max(1, min(-(-num_tokens // tokens) + batch, num_tokens))


def query_tiles(starts, *, num_tokens: int, tokens: int, skip=None):
    """``(q_len, tiles)``, i32[batch + 1] each: every sequence's query rows (the last entry: the
    padding rows ``[starts[batch], num_tokens)``) and its ``ceil(q_len / tokens)`` tiles, none
    where ``skip`` (bool[batch], or None) is set."""
    ends = jnp.concatenate([starts[1:], jnp.full((1,), num_tokens, jnp.int32)])
    q_len = ends - starts
    tiles = (q_len + tokens - 1) // tokens
    if skip is not None:
        tiles = jnp.where(jnp.concatenate([skip, jnp.zeros((1,), bool)]), 0, tiles)
    return q_len, tiles


def work_list(starts, lens, *, num_tokens: int, tokens: int, num_tiles: int, window: int | None,
              skip=None):
    """The query tiles, longest first: ``i32[2, num_tiles]`` (sequence, tile), in XLA.

    Sequence ``b`` (``b == batch``: the padding rows ``[starts[batch], num_tokens)``, with no
    keys) has ``ceil(q_len_b / tokens)`` tiles, none where ``skip[b]`` (`query_tiles`). They are
    ordered by the K/V positions their queries attend, most first (ties in order); entries past
    the last tile hold ``batch + 1`` (no work).

    Args:
      starts: i32[batch + 1], the clamped, non-decreasing query start locations.
      lens: i32[batch], the clamped lengths.
      skip: bool[batch] or None, sequences computed elsewhere (`MosaicAttentionConfig.decode_rows`).
    """
    batch = lens.shape[0]
    q_len, tiles = query_tiles(starts, num_tokens=num_tokens, tokens=tokens, skip=skip)
    n = jnp.concatenate([lens, jnp.zeros((1,), jnp.int32)])   # the pseudo-sequence has no keys
    tile_end = jnp.cumsum(tiles)
    index = jnp.arange(num_tiles, dtype=jnp.int32)
    b = jnp.searchsorted(tile_end, index, side="right").astype(jnp.int32)  # batch + 1: none
    b_safe = jnp.minimum(b, batch)
    tile = index - (tile_end - tiles)[b_safe]
    queries = jnp.clip(q_len[b_safe] - tile * tokens, 0, tokens)
    first_pos = n[b_safe] - q_len[b_safe] + tile * tokens
    key_lo = 0 if window is None else jnp.maximum(first_pos - window + 1, 0)
    work = jnp.where(b <= batch, jnp.clip(first_pos + queries, 0, None) - key_lo, -1)
    order = jnp.argsort(-work, stable=True)
    return jnp.stack([b[order], tile[order]])


def smem_bytes(head_dim: int, dtype, config: MosaicAttentionConfig, cache_dtype=None) -> int:
    """Shared memory one CTA takes: the consumers' query tiles, the K and V ring (in
    ``cache_dtype``, default ``dtype``; fp8: and the ring of their conversions to ``dtype``), the
    output's staging and the lse rows (each allocation rounded up: `allocated`), and the
    barriers."""
    itemsize = jnp.dtype(dtype).itemsize
    cache_itemsize = jnp.dtype(cache_dtype or dtype).itemsize
    consumers = config.num_consumers
    ring = config.num_stages * config.block_kv * head_dim
    total = allocated(consumers * MMA_ROWS * head_dim * itemsize)               # q
    total += allocated(*[ring * cache_itemsize] * 2)                            # K, V
    total += allocated(consumers * MMA_ROWS * head_dim * itemsize)              # the output
    total += allocated(consumers * MMA_ROWS * 4)                                # lse
    if cache_itemsize != itemsize:
        total += allocated(*[ring * itemsize] * 2)                  # K, V converted to dtype
    barriers = consumers + 3 * config.num_stages           # q; K, V, free
    barriers += config.num_stages * (consumers > 1)        # V checked
    barriers += config.ping_pong and consumers > 1         # the schedule
    return total + 8 * barriers + MOSAIC_OWN_SMEM_BYTES


def check_supported(q, k_cache, config: MosaicAttentionConfig) -> None:
    """ValueError naming the argument for every shape or dtype this kernel does not handle."""
    head_dim = q.shape[2]
    check_query_dtype(q)
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(q.dtype), FP8):
        raise ValueError(
            f"impl='mosaic' ragged attention takes caches of q's dtype or float8_e4m3fn, got"
            f" k_cache.dtype={jnp.dtype(k_cache.dtype)} with q.dtype={jnp.dtype(q.dtype)}")
    check_head_dim(q, SUPPORTED_HEAD_DIMS)
    check_pages_fit_tiles(k_cache, config.block_kv, "block_kv")
    group = q.shape[1] // k_cache.shape[2]
    if group % config.pack_heads:
        raise ValueError(
            f"config={config}: pack_heads={config.pack_heads} must divide the GQA group of"
            f" {group} query heads per kv head (num_heads={q.shape[1]},"
            f" num_kv_heads={k_cache.shape[2]}): a power of two dividing {group}")
    if config.overlap_softmax and jnp.dtype(k_cache.dtype) == FP8:
        raise ValueError(f"config={config}: overlap_softmax=True takes 16-bit caches, got"
                         f" k_cache.dtype={jnp.dtype(k_cache.dtype)}; overlap_softmax=False")
    if config.decode_rows:
        rows = jax.ShapeDtypeStruct((1, *q.shape[1:]), q.dtype)
        try:
            decode_kernel.check_supported(rows, k_cache, decode_kernel.SMALLEST_CONFIG)
        except ValueError as e:
            raise ValueError(f"config={config}: decode_rows=True needs the Mosaic decode kernel,"
                             f" which refuses the call ({e}); decode_rows=False") from None
    need = smem_bytes(head_dim, q.dtype, config, k_cache.dtype)
    if need > MAX_SMEM_BYTES:
        fp8 = " (fp8 caches: else impl='pallas')" if jnp.dtype(k_cache.dtype) == FP8 else ""
        raise ValueError(
            f"config={config} needs {need} bytes of shared memory at head_dim={head_dim} with"
            f" k_cache.dtype={jnp.dtype(k_cache.dtype)}, more than the {MAX_SMEM_BYTES} of one"
            f" CTA: fewer num_stages, block_kv=64 or num_consumers=1{fp8}")


def check_interpret_jax(interpret: bool) -> None:
    """ValueError where interpret mode is asked of a jax whose interpreter cannot run the
    kernel (`MIN_JAX_INTERPRET`)."""
    if interpret and jax_version() < MIN_JAX_INTERPRET:
        raise ValueError(
            f"impl='mosaic' with interpret=True needs jax >="
            f" {'.'.join(map(str, MIN_JAX_INTERPRET))} for the ragged kernel, found jax"
            f" {jax.__version__} (its Mosaic GPU interpreter cannot seed a wgmma accumulator from"
            f" registers): run it compiled on a Hopper GPU, or use impl='pallas' or impl='xla'")


def refusal(q, k_cache, config: MosaicAttentionConfig, interpret: bool) -> str | None:
    """Why this kernel cannot run the call (a ValueError's message), or None where it can: the
    jax version, the shapes and dtypes for ``config``, then the device. Reads only ``.shape``
    and ``.dtype``."""
    try:
        check_jax()
        check_supported(q, k_cache, config)
        check_device(interpret)
        check_interpret_jax(interpret)
    except ValueError as e:
        return str(e)
    return None


def _ragged_attention_kernel(
    work_ref,     # i32[2, W]: (sequence, tile) of each work tile, longest first (`work_list`)
    qsl_ref,      # i32[batch + 1], the query start locations (clamped, non-decreasing)
    lens_ref,     # i32[batch], the lengths (clamped)
    tables_ref,   # i32[batch, max_blocks]
    q_ref,        # [T, num_heads, head_dim], T = max(num_tokens, 64)
    k_ref,        # [num_blocks, block_size, num_kv_heads, head_dim]  (fused: the one cache,
    v_ref,        #  [..., 2 * num_kv_heads, head_dim], as both)
    alibi_ref,    # f32[num_heads] or None
    sinks_ref,    # f32[num_heads] or None
    k_scale_ref,  # f32[1] or None (fp8 caches)
    v_scale_ref,  # f32[1] or None (fp8 caches)
    out_ref,      # [num_tokens, num_heads, head_dim] in q.dtype
    lse_ref,      # f32[items, C, 64]: each work item's consumers' lse rows (`gather_lse`)
    *,
    plgpu,
    scale: float,
    group: int,
    num_tokens: int,
    block_kv: int,
    num_stages: int,
    num_consumers: int,
    ping_pong: bool,
    soft_cap: float | None,
    window: int | None,
    fused: bool,
    programs: int | None,
    pack: int,
    overlap: bool,
):
    num_blocks, block_size, _, head_dim = k_ref.shape
    kvh = num_kv_heads(k_ref.shape, fused)
    batch, max_blocks = tables_ref.shape
    padded_tokens = q_ref.shape[0]
    dtype = q_ref.dtype
    packs = packs_per_cta(group, num_consumers, pack)
    head_blocks = group // (packs * pack)
    tokens = tokens_per_cta(group, num_consumers, pack)
    # A consumer's 64 rows: heads head0 .. head0 + pack - 1 one after the other, each with the
    # same `head_tokens` consecutive tokens.
    head_tokens = MMA_ROWS // pack
    copies = copies_per_tile(block_size, block_kv)
    width = staging_columns(head_dim)
    converts = k_ref.dtype != dtype  # fp8 caches
    column_parts = [pl.ds(lo, width) for lo in range(0, head_dim, width)]

    # --- work items: item w is the work list's tile of rank w // (kvh * head_blocks) (sequence
    # b, tile), for kv head h and head block hb. Without `programs`, CTA w takes item w;
    # persistent, CTA p takes the items `dealt_index` deals it, longest first.
    items = lse_ref.shape[0]

    def item_at(w) -> _WorkItem:
        rank, rest = w // (kvh * head_blocks), w % (kvh * head_blocks)
        h, hb = rest // head_blocks, rest % head_blocks
        b, tile = work_ref[0, rank], work_ref[1, rank]
        real = b < batch  # b == batch: the padding rows; b > batch: no work
        q_start = jnp.where(b <= batch, qsl_ref[jnp.minimum(b, batch)], 0)
        q_end = jnp.where(real, qsl_ref[jnp.minimum(b + 1, batch)],
                          jnp.where(b == batch, num_tokens, q_start))
        n = jnp.where(real, lens_ref[jnp.minimum(b, batch - 1)], 0)
        q_len = q_end - q_start
        queries = jnp.clip(q_len - tile * tokens, 0, tokens)
        first_pos = n - q_len + tile * tokens  # the position of the item's first query
        key_lo, key_hi, shared_lo, shared_hi, loops = kv_tile_plan(
            first_pos, queries, n, 0, block_k=block_kv, num_splits=1, window=window)
        return _WorkItem(
            w=w, h=h, hb=hb, tile=tile, q_start=q_start, queries=queries, first_pos=first_pos,
            shared_lo=shared_lo, shared_hi=shared_hi, loops=loops, tile_lo=loops[0][0],
            steps=loops[2][1] - loops[0][0], page_lo=key_lo // block_size,
            page_hi=jnp.maximum(key_hi - 1, 0) // block_size, table_row=jnp.minimum(b, batch - 1))

    cta = jax.lax.axis_index("cta")
    if programs is None:
        my_items = 1
    else:
        my_items = dealt_items(cta, programs, items)

    def item_of_cta(j) -> _WorkItem:
        """The CTA's ``j``-th item (without ``programs``: its one item, ``j == 0``)."""
        return item_at(cta if programs is None else dealt_index(cta, j, programs))

    def for_each_item(item_body, carry):
        """``item_body(j, item, carry)`` over the CTA's items ``j`` (one, unlooped, without
        ``programs``)."""
        if programs is None:
            return item_body(0, item_of_cta(0), carry)
        return jax.lax.fori_loop(0, my_items, lambda j, c: item_body(j, item_of_cta(j), c), carry)

    def consumer_rows(it, c):
        """Consumer ``c``'s first query head ``head0`` in item ``it``, its first token ``t0``,
        valid tokens, the token its tile is read from (``t0_load``, at most ``T - head_tokens``)
        and the position of the tile's first token."""
        sub = c // packs
        head0 = it.h * group + (it.hb * packs + c % packs) * pack
        t0 = it.q_start + it.tile * tokens + sub * head_tokens
        queries = jnp.clip(it.queries - sub * head_tokens, 0, head_tokens)
        t0_load = jnp.clip(t0, 0, padded_tokens - head_tokens)
        row0_pos = it.first_pos + sub * head_tokens - (t0 - t0_load)
        return head0, t0, queries, t0_load, row0_pos

    def head_rows(k, start=0, size=head_tokens):
        """The rows of a consumer's tile that hold its ``k``-th head's tokens ``start ..``."""
        return pl.ds(k * head_tokens + start, size)

    def body(q_smem, k_smem, v_smem, o_smem, lse_smem, kc_smem, vc_smem, q_bars, k_bars, v_bars,
             free_bars, v_ready_bars, schedule_bar):
        # q_smem [C, 64, D]; k_smem, v_smem [stages, block_kv, D] in the cache's dtype (TMA
        # destinations; 16-bit: the wgmma operands); o_smem [C, D // W, 64, W] in q.dtype,
        # W = `staging_columns` (untiled: any row range copies out); lse_smem f32[C, 64];
        # kc_smem, vc_smem [stages, block_kv, D] in q.dtype, fp8 caches' tiles converted by the
        # first consumer (the wgmma operands), else None.
        # Barriers: q_bars[C] (a consumer's query tile copied); k_bars, v_bars[stages] (a stage's
        # copies done); free_bars[stages] (every consumer is done with a stage); v_ready_bars
        # [stages] (two consumers: the first has checked a stage's V, fp8: converted its K and
        # V, and the second may read them), else None; schedule_bar (ping_pong) the two
        # consumers' turns on the tensor cores.
        wg = jax.lax.axis_index("wg")
        row_layout = plgpu.Layout.WGMMA.reduce(1)  # f32[64]: one value per row of a tile

        def block_ids(it, kv_tile):
            return tile_block_ids(tables_ref, it.table_row, kv_tile, block_size=block_size,
                                  block_kv=block_kv, num_blocks=num_blocks, page_lo=it.page_lo,
                                  page_hi=it.page_hi)

        def issue(it, kv_tile, slot, blocks):
            copy_kv_tile(plgpu, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, kv_tile=kv_tile,
                         slot=slot, blocks=blocks, kv_head=it.h, fused=fused,
                         block_size=block_size, block_kv=block_kv)

        def copy_queries(it, c):
            """TMA consumer ``c``'s query tile of item ``it`` into its output staging (see
            `stage_queries`): the producer's for the CTA's first item, the consumer's own for
            the next ones (persistent), each once the staging is free."""
            head0, _, _, t0_load, _ = consumer_rows(it, c)
            for k in range(pack):
                for part, cols in enumerate(column_parts):
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t0_load, head_tokens), head0 + k, cols],
                                            o_smem.at[c, part, head_rows(k)], q_bars.at[c])

        @pl.when(wg == num_consumers)
        def _producer():
            if num_consumers > 1:
                plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            first = item_of_cta(0)
            for c in range(num_consumers):
                copy_queries(first, c)

            def produce(j, it, done):
                """Item ``it``'s K/V tiles into the ring (``done`` tiles went in before it)."""
                del j

                @pl.loop(0, it.steps)
                def _produce(step):
                    slot = jax.lax.rem(done + step, num_stages)
                    blocks = block_ids(it, it.tile_lo + step)  # loaded before the wait

                    @pl.when(done + step >= num_stages)
                    def _wait_free():
                        plgpu.barrier_wait(free_bars.at[slot])

                    issue(it, it.tile_lo + step, slot, blocks)

                return done + it.steps

            total = for_each_item(produce, jnp.int32(0))

            # every consumer frees every stage it reads: the frees no refill waited for (the
            # last `num_stages` tiles) are waited for here, so no barrier phase is unobserved
            @pl.loop(jnp.maximum(total - num_stages, 0), total)
            def _drain(step):
                plgpu.barrier_wait(free_bars.at[jax.lax.rem(step, num_stages)])

        def schedule_turn():
            plgpu.barrier_arrive(schedule_bar)
            plgpu.barrier_wait(schedule_bar)

        def fix_values(it, v_tile, kv_tile):
            """Non-finite entries of the V tile ``v_tile`` [block_kv, D] at positions not every
            row of the CTA sees, zeroed (a masked tile): a row whose weight for them is 0 would
            get ``0 * NaN``."""
            shape = (V_FIX_ROWS, head_dim)
            for r in range(0, block_kv, V_FIX_ROWS):
                rows = v_tile.at[pl.ds(r, V_FIX_ROWS)]
                v = plgpu.load(rows, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                pos = kv_tile * block_kv + r + plgpu.broadcasted_iota(
                    jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                keep = ((pos >= it.shared_lo) & (pos < it.shared_hi)) | (jnp.abs(v) < jnp.inf)
                rows[...] = jnp.where(keep, v, 0.0).astype(v_tile.dtype)
            plgpu.commit_smem()

        def convert_tiles(it, slot, kv_tile, masked):
            """fp8 caches: stage ``slot``'s K and V tiles in q.dtype (exact), V fixed where
            ``masked`` (`fix_values`)."""
            plgpu.barrier_wait(k_bars.at[slot])
            kc_smem[slot] = k_smem[slot].astype(jnp.float16).astype(dtype)
            plgpu.barrier_wait(v_bars.at[slot])
            vc_smem[slot] = v_smem[slot].astype(jnp.float16).astype(dtype)
            plgpu.commit_smem()
            if masked:
                fix_values(it, vc_smem.at[slot], kv_tile)

        def row_tokens(shape, layout):
            """i32 ``shape``: each row's token within the tile (rows hold ``pack`` heads'
            tokens one after the other)."""
            rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
            return rows if pack == 1 else jax.lax.rem(rows, head_tokens)

        def per_row(ref, head0):
            """``ref f32[num_heads]`` for each row's head: a scalar for one head, else
            f32[64] in the rows' layout."""
            if pack == 1:
                return ref[head0]
            k = jax.lax.div(plgpu.broadcasted_iota(jnp.int32, (MMA_ROWS,), 0,
                                                   layout=row_layout), head_tokens)
            value = plgpu.layout_cast(jnp.full((MMA_ROWS,), ref[head0], jnp.float32),
                                      row_layout)
            for i in range(1, pack):
                value = jnp.where(k == i, ref[head0 + i], value)
            return value

        def stage_queries(c):
            """Consumer ``c``'s query tile, once copied, from the output's untiled staging into
            the wgmma operand, through registers (a TMA copy into the tiled, swizzled operand
            needs a start row that is a multiple of 8; a sequence's first token can be any
            row)."""
            plgpu.barrier_wait(q_bars.at[c])
            for part, cols in enumerate(column_parts):
                q_smem[c, :, cols] = plgpu.load(o_smem.at[c, part], layout=plgpu.Layout.WGMMA)
            plgpu.commit_smem()

        def consumer(c):
            q_tile = q_smem.at[c]
            score_shape = (MMA_ROWS, block_kv)
            folds = soft_cap is None and alibi_ref is None  # log2(e) folded into the scale
            score_scale = scale if k_scale_ref is None else scale * k_scale_ref[0]

            def per_row_scores(x):
                """A scalar or per-row ``x`` (`per_row`) across the score tile's columns."""
                return x if pack == 1 else jax.lax.broadcast_in_dim(x, score_shape, [0])

            def initial_state():
                """The online softmax's start: ``O`` f32[64, D] zeros, the running max f32[64]
                (base 2) -inf and sum f32[64] zeros."""
                return (plgpu.layout_cast(jnp.zeros((MMA_ROWS, head_dim), jnp.float32),
                                          plgpu.Layout.WGMMA),
                        plgpu.layout_cast(jnp.full((MMA_ROWS,), -jnp.inf, jnp.float32),
                                          row_layout),
                        plgpu.layout_cast(jnp.zeros((MMA_ROWS,), jnp.float32), row_layout))

            def ring_slot(it, done, kv_tile):
                """The ring stage that holds item ``it``'s tile ``kv_tile`` (``done`` tiles went
                through the ring before the item)."""
                return jax.lax.rem(done + kv_tile - it.tile_lo, num_stages)

            def product_pv(acc, p16, v_tile, slot):
                """``O += P V`` for the tile in stage ``slot`` (waited for); the stage is then
                free for the producer."""
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(free_bars.at[slot])
                return acc

            def attend(j, it, done):
                """Item ``it`` (the CTA's ``j``-th; ``done`` ring tiles read before it): its
                query tile is in ``q_smem[c]``; its K/V tiles walked (`walk_tiles`, or
                `walk_overlapped` with ``overlap_softmax``); its output and lse go out;
                persistent, the next item's query tile moves in before the output is staged."""
                head0, t0, queries, _, row0_pos = consumer_rows(it, c)
                slope = None if alibi_ref is None else per_row_scores(per_row(alibi_ref, head0))
                walk = walk_overlapped if overlap else walk_tiles
                carry = walk(it, done, row0_pos=row0_pos, slope=slope)
                finish(j, it, c, head0, t0, queries, row0_pos, carry)
                return done + it.steps

            def walk_tiles(it, done, *, row0_pos, slope):
                """The online softmax over item ``it``'s K/V tiles, one `step_body` each:
                ``(O f32[64, D], m f32[64] (base 2), l f32[64])``."""
                walk = functools.partial(step_body, it=it, done=done, row0_pos=row0_pos,
                                         slope=slope)
                carry = initial_state()
                for (lo, hi), masked in zip(it.loops, (True, False, True)):
                    carry = jax.lax.fori_loop(lo, hi, functools.partial(walk, masked=masked),
                                              carry)
                return carry

            def softmax(s, kv_tile, m_prev, l_prev, *, masked: bool, row0_pos, slope):
                """Tile ``kv_tile``'s raw scores ``s`` f32[64, block_kv] -> ``(p, alpha, m_next,
                l_next)``: the weights (f32, unnormalized), the factor the accumulator takes,
                the running max (base 2) and sum; masked: the causal and window mask."""
                if folds:
                    s = s * (score_scale * LOG2E)
                else:
                    s = s * score_scale
                    if soft_cap is not None:
                        s = soft_cap * jnp.tanh(s / soft_cap)
                if alibi_ref is not None or masked:
                    pos = kv_tile * block_kv + plgpu.broadcasted_iota(
                        jnp.int32, score_shape, 1, layout=plgpu.Layout.WGMMA)
                    row_pos = row0_pos + row_tokens(score_shape, plgpu.Layout.WGMMA)
                if alibi_ref is not None:
                    s = s + slope * (pos - row_pos).astype(jnp.float32)
                if not folds:
                    s = s * LOG2E
                if masked:
                    sees = pos <= row_pos
                    if window is not None:
                        sees = sees & (pos > row_pos - window)
                    s = jnp.where(sees, s, -jnp.inf)
                m_next = jnp.maximum(m_prev, s.max(axis=1))
                m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # no key yet: exp2 finite
                alpha = jnp.exp2(m_prev - m_safe)
                p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_safe, score_shape, [0]))
                return p, alpha, m_next, l_prev * alpha + p.sum(axis=1)

            def values_ready(it, slot, kv_tile, masked: bool):
                """16-bit caches: stage ``slot``'s V tile copied and, on a masked tile, checked
                (`fix_values`, by the first consumer, which then signals the second)."""
                if c == 0:
                    plgpu.barrier_wait(v_bars.at[slot])
                    if masked:
                        fix_values(it, v_smem.at[slot], kv_tile)
                    if v_ready_bars is not None:
                        plgpu.barrier_arrive(v_ready_bars.at[slot])
                else:
                    plgpu.barrier_wait(v_ready_bars.at[slot])

            def walk_overlapped(it, done, *, row0_pos, slope):
                """`walk_tiles` with ``overlap_softmax``: tile ``t``'s softmax runs while tile
                ``t + 1``'s ``Q K^T`` is on the tensor cores. Each step issues the next tile's
                scores, turns this tile's into weights, runs this tile's ``P V`` (its stage is
                then free) and takes the next scores, done by then. The last tile takes the
                masked path (its mask is a no-op on a tile every row sees whole)."""
                first, last = it.tile_lo, it.tile_lo + it.steps

                def issue_scores(s_ref, kv_tile):
                    slot = ring_slot(it, done, kv_tile)
                    plgpu.barrier_wait(k_bars.at[slot])
                    plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))

                def first_scores(kv_tile, s):
                    del s

                    def scoped(s_ref):
                        issue_scores(s_ref, kv_tile)
                        return s_ref[...]

                    return pl.run_scoped(scoped, plgpu.ACC(score_shape, jnp.float32))

                def step(kv_tile, carry, *, masked: bool, last_tile: bool):
                    # this tile's scores f32[64, block_kv], f32[64, D], f32[64] (base 2), f32[64]
                    s, acc, m_prev, l_prev = carry
                    slot = ring_slot(it, done, kv_tile)

                    def scoped(s_ref):
                        if not last_tile:
                            issue_scores(s_ref, kv_tile + 1)
                        p, alpha, m_next, l_next = softmax(
                            s, kv_tile, m_prev, l_prev, masked=masked, row0_pos=row0_pos,
                            slope=slope)
                        rescaled = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
                        p16 = p.astype(dtype)
                        values_ready(it, slot, kv_tile, masked)
                        # waits for both products: this P V and the next scores
                        out = product_pv(rescaled, p16, v_smem.at[slot], slot)
                        return (s if last_tile else s_ref[...]), out, m_next, l_next

                    if last_tile:
                        return scoped(None)
                    return pl.run_scoped(scoped, plgpu.ACC(score_shape, jnp.float32))

                s = jax.lax.fori_loop(
                    first, jnp.minimum(first + 1, last), first_scores,
                    plgpu.layout_cast(jnp.zeros(score_shape, jnp.float32), plgpu.Layout.WGMMA))
                carry = (s, *initial_state())
                for (lo, hi), masked in zip(it.loops, (True, False, True)):
                    carry = jax.lax.fori_loop(
                        lo, jnp.minimum(hi, last - 1),
                        functools.partial(step, masked=masked, last_tile=False), carry)
                _, acc, m, l = jax.lax.fori_loop(
                    jnp.maximum(last - 1, first), last,
                    functools.partial(step, masked=True, last_tile=True), carry)
                return acc, m, l

            def step_body(kv_tile, carry, *, masked: bool, it, done, row0_pos, slope):
                acc, m_prev, l_prev = carry  # f32[64, D], f32[64] (base 2), f32[64]
                slot = ring_slot(it, done, kv_tile)
                if converts and c == 0:
                    convert_tiles(it, slot, kv_tile, masked)
                    if v_ready_bars is not None:
                        plgpu.barrier_arrive(v_ready_bars.at[slot])
                elif converts:
                    plgpu.barrier_wait(v_ready_bars.at[slot])
                else:
                    plgpu.barrier_wait(k_bars.at[slot])
                k_tile, v_tile = ((kc_smem.at[slot], vc_smem.at[slot]) if converts
                                  else (k_smem.at[slot], v_smem.at[slot]))

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
                    if ping_pong:
                        schedule_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC(score_shape, jnp.float32))  # f32[64, block_kv]
                p, alpha, m_next, l_next = softmax(s, kv_tile, m_prev, l_prev, masked=masked,
                                                   row0_pos=row0_pos, slope=slope)
                acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)

                if ping_pong:
                    plgpu.barrier_arrive(schedule_bar)  # done with the softmax
                if not converts:  # fp8: converted (and fixed) before the first product
                    values_ready(it, slot, kv_tile, masked)
                if ping_pong:
                    plgpu.barrier_wait(schedule_bar)  # the tensor cores are ours
                return product_pv(acc, p16, v_tile, slot), m_next, l_next

            stage_queries(c)
            if programs is not None:
                prefetch_queries(1, c)

            if ping_pong and c == 1:
                schedule_turn()  # the second consumer starts one turn behind the first
            for_each_item(attend, jnp.int32(0))
            if ping_pong and c == 0:
                schedule_turn()  # the second consumer's last turn

        def finish(j, it, c, head0, t0, queries, row0_pos, carry):
            """Consumer ``c``'s rows of item ``it`` (the CTA's ``j``-th) normalized (with the
            sink) and written, with their lse; persistent, the next item's query tile moved to
            the operand first, and the one after it copied into the staging once free."""
            acc, m, l = carry
            if v_scale_ref is not None:  # P V is linear in V: dequantize the sum
                acc = acc * v_scale_ref[0]
            if sinks_ref is not None:  # one more logit per row, with no value row
                sink = per_row(sinks_ref, head0) * LOG2E
                m_total = jnp.maximum(m, sink)
                correction = jnp.exp2(m - m_total)
                acc = acc * jax.lax.broadcast_in_dim(correction, acc.shape, [0])
                m, l = m_total, l * correction + jnp.exp2(sink - m_total)
            row_pos = row0_pos + row_tokens((MMA_ROWS,), row_layout)
            has_keys = row_pos >= 0  # a row at position p >= 0 sees at least p itself
            ok = has_keys & divides(l)
            l_safe = jnp.where(ok, l, 1.0)
            out = jnp.where(jax.lax.broadcast_in_dim(ok, acc.shape, [0]),
                            acc / jax.lax.broadcast_in_dim(l_safe, acc.shape, [0]), 0.0)
            if programs is not None:
                @pl.when(j + 1 < my_items)
                def _next_queries():
                    stage_queries(c)

            for part, cols in enumerate(column_parts):
                o_smem[c, part] = out[:, cols.start:cols.start + cols.size].astype(dtype)
            lse_smem[c] = jnp.where(has_keys, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)
            plgpu.commit_smem()
            write_rows(it, c, head0, t0, queries)
            plgpu.copy_smem_to_gmem(lse_smem.at[c], lse_ref.at[it.w, c])
            plgpu.wait_smem_to_gmem(0)
            if programs is not None:
                prefetch_queries(j + 2, c)

        def prefetch_queries(j, c):
            """Persistent: consumer ``c`` copies its query tile of the CTA's ``j``-th item, if
            any, into its free staging itself (the producer would wait on a consumer that the
            ping-pong turns can hold one item behind)."""
            @pl.when(j < my_items)
            def _copy():
                copy_queries(item_of_cta(j), c)

        def write_rows(it, c, head0, t0, queries):
            """Each head's tokens ``[delta, delta + queries)`` of consumer ``c``'s staged output
            to tokens ``t0 ..`` of heads ``head0 ..``, ``delta = t0 - t0_load``, in boxes of
            ``head_tokens``, ..., 2, 1 tokens."""
            _, _, _, t0_load, _ = consumer_rows(it, c)
            delta = t0 - t0_load
            done = jnp.int32(0)
            size = head_tokens
            while size >= 1:
                take = (queries & size) != 0

                @pl.when(take)
                def _store(size=size, done=done):
                    for k in range(pack):
                        for part, cols in enumerate(column_parts):
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[c, part, head_rows(k, delta + done, size)],
                                out_ref.at[pl.ds(t0 + done, size), head0 + k, cols])

                done = done + jnp.where(take, size, 0)
                size //= 2

        for c in range(num_consumers):

            @pl.when(wg == c)
            def _consumer(c=c):
                if num_consumers > 1:
                    plgpu.set_max_registers(consumer_registers(num_consumers), action="increase")
                consumer(c)

    c_count = num_consumers
    scratch = (
        mma_smem(plgpu, (c_count, MMA_ROWS, head_dim), dtype),
        mma_smem(plgpu, (num_stages, block_kv, head_dim), k_ref.dtype),
        mma_smem(plgpu, (num_stages, block_kv, head_dim), v_ref.dtype),
        plgpu.SMEM((c_count, head_dim // width, MMA_ROWS, width), dtype),
        plgpu.SMEM((c_count, MMA_ROWS), jnp.float32),
        *[mma_smem(plgpu, (num_stages, block_kv, head_dim), dtype) if converts else None] * 2,
        plgpu.Barrier(num_arrivals=head_dim // width * pack, num_barriers=c_count),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=c_count, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages) if c_count > 1 else None,
        plgpu.Barrier(num_arrivals=2) if ping_pong else None,
    )
    pl.run_scoped(body, *scratch, collective_axes="wg")


def gather_lse(lse_tiles, work, starts, *, num_tokens: int, num_heads: int, group: int,
               num_consumers: int, pack: int, padded_tokens: int, skip=None):
    """Each token's lse from the consumers' rows ``lse_tiles f32[CTAs, C, 64]`` (XLA, after the
    kernel): token ``t`` of sequence ``b`` lies in tile ``(t - starts[b]) // tokens``, whose rank
    in the work list gives its CTAs, and for the ``k``-th head of its consumer's pack in row
    ``k * 64 / pack + t - t0_load`` of the consumer's tile. Rows of sequences ``skip`` left out
    of the work list get meaningless values.

    Returns:
      ``f32[num_tokens, num_heads]``.
    """
    packs = packs_per_cta(group, num_consumers, pack)
    tokens = tokens_per_cta(group, num_consumers, pack)
    head_tokens = MMA_ROWS // pack
    head_blocks = group // (packs * pack)
    kvh = num_heads // group
    batch = starts.shape[0] - 1
    _, tiles = query_tiles(starts, num_tokens=num_tokens, tokens=tokens, skip=skip)
    tile_start = jnp.cumsum(tiles) - tiles                    # i32[batch + 1]
    num_tiles = work.shape[1]
    index = tile_start[jnp.minimum(work[0], batch)] + work[1]  # the tile of each rank
    rank_of = jnp.zeros((num_tiles,), jnp.int32).at[
        jnp.where(work[0] <= batch, index, num_tiles)].set(
            jnp.arange(num_tiles, dtype=jnp.int32), mode="drop")
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    b = (jnp.searchsorted(starts, t, side="right") - 1).astype(jnp.int32)
    b = jnp.clip(b, 0, batch)  # rows past starts[batch] belong to the padding pseudo-sequence
    offset = t - starts[b]
    tile = offset // tokens
    sub = (offset % tokens) // head_tokens
    rank = rank_of[tile_start[b] + tile]                      # i32[T]
    t0 = starts[b] + tile * tokens + sub * head_tokens
    token_row = t - jnp.clip(t0, 0, padded_tokens - head_tokens)
    head = jnp.arange(num_heads, dtype=jnp.int32)
    h, g = head // group, head % group
    pack_index, k = g // pack, g % pack                       # the head's pack, its place in it
    cta = (rank[:, None] * kvh + h[None, :]) * head_blocks + (pack_index // packs)[None, :]
    c = sub[:, None] * packs + (pack_index % packs)[None, :]
    row = k[None, :] * head_tokens + token_row[:, None]
    return lse_tiles[cta, c, row]


def paged_attention_mosaic(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           scale, config: MosaicAttentionConfig, interpret: bool,
                           logits_soft_cap, alibi_slopes, sliding_window, sinks,
                           k_scale=None, v_scale=None, fused: bool = False):
    """The kernel over ``work tiles x num_kv_heads x head blocks`` CTAs, with the XLA work around
    it: the work list before (`work_list`), the lse gathered per token after (`gather_lse`).

    Arguments as `pallas_paged.paged_attention` after validation (``scale`` a float; indices
    int32 and clamped, ``query_start_loc`` non-decreasing from 0; ``num_tokens >= 1``,
    ``batch >= 1``); the caller has checked the call (`refusal`). ``k_scale``, ``v_scale``
    (fp8 caches): python floats or ``f32[]`` arrays, kernel operands either way. ``fused``:
    ``k_cache`` and ``v_cache`` are one fused cache, read in place.

    Returns:
      ``(out [num_tokens, num_heads, head_dim] in q.dtype, lse f32[num_tokens, num_heads])``.
    """
    plgpu = import_plgpu()
    num_tokens, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    group = num_heads // kvh
    batch = block_tables.shape[0]
    consumers = config.num_consumers
    pack = config.pack_heads
    tokens = tokens_per_cta(group, consumers, pack)
    head_blocks = group // (packs_per_cta(group, consumers, pack) * pack)
    work_tiles = num_work_tiles(num_tokens, batch, tokens)
    starts = query_start_loc.astype(jnp.int32)
    lens = context_lens.astype(jnp.int32)
    options = dict(scale=scale, interpret=interpret, logits_soft_cap=logits_soft_cap,
                   alibi_slopes=alibi_slopes, sliding_window=sliding_window, sinks=sinks,
                   k_scale=k_scale, v_scale=v_scale, fused=fused)
    decodes = None
    if config.decode_rows:  # one-token sequences through the decode kernel
        decodes = (starts[1:] - starts[:-1]) == 1
        rows = jnp.clip(starts[:-1], 0, num_tokens - 1)
        out_rows, lse_rows = _decode_rows(q[rows], k_cache, v_cache, block_tables,
                                          jnp.where(decodes, lens, 0), **options)
    work = work_list(starts, lens, num_tokens=num_tokens, tokens=tokens, num_tiles=work_tiles,
                     window=sliding_window, skip=decodes)
    q_in = q if num_tokens >= MMA_ROWS else jnp.pad(
        q, ((0, MMA_ROWS - num_tokens), (0, 0), (0, 0)))
    items = work_tiles * kvh * head_blocks
    programs = None  # one CTA per work item
    if config.persistent:  # as many CTAs as stay resident, each walking its items
        smem = smem_bytes(head_dim, q.dtype, config, k_cache.dtype)
        programs = persistent_programs(items, smem, sm_count())
    ping_pong = config.ping_pong and consumers == 2
    body = functools.partial(
        _ragged_attention_kernel, plgpu=plgpu, scale=scale, group=group, num_tokens=num_tokens,
        block_kv=config.block_kv, num_stages=config.num_stages, num_consumers=consumers,
        ping_pong=ping_pong, soft_cap=logits_soft_cap, window=sliding_window, fused=fused,
        programs=programs, pack=pack, overlap=config.overlap_softmax)
    k_scale_operand, v_scale_operand = kernel_scale_operands(k_scale, v_scale)
    kernel_body, optional = with_optional_operands(body, 7, {
        "alibi": None if alibi_slopes is None else alibi_slopes.astype(jnp.float32),
        "sinks": None if sinks is None else sinks.astype(jnp.float32),
        "k_scale": k_scale_operand,
        "v_scale": v_scale_operand,
    })
    name = (f"{KERNEL_NAME}_bkv{config.block_kv}_st{config.num_stages}_c{consumers}"
            f"_g{group}_d{head_dim}_bs{k_cache.shape[1]}" + ("_pp" if ping_pong else "")
            + ("_fp8" if jnp.dtype(k_cache.dtype) == FP8 else "")
            + (f"_persistent{programs}" if programs else "") + ("_fused" if fused else "")
            + (f"_pack{pack}" if pack > 1 else "")
            + ("_overlap" if config.overlap_softmax else ""))
    out, lse_tiles = plgpu.kernel(
        kernel_body,
        out_type=(jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), q.dtype),
                  jax.ShapeDtypeStruct((items, consumers, MMA_ROWS), jnp.float32)),
        grid=(programs or items,),
        grid_names=("cta",),
        num_threads=consumers + 1,
        thread_name="wg",
        kernel_name=name,
        compiler_params=plgpu.CompilerParams(**COMPILER_PARAMS),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(work, starts, lens, block_tables.astype(jnp.int32), q_in, k_cache, v_cache, *optional)
    lse = gather_lse(lse_tiles, work, starts, num_tokens=num_tokens, num_heads=num_heads,
                     group=group, num_consumers=consumers, pack=pack,
                     padded_tokens=q_in.shape[0],
                     skip=decodes)
    if decodes is not None:  # the decode kernel's rows in place of rows no CTA wrote
        target = jnp.where(decodes, rows, num_tokens)
        out = out.at[target].set(out_rows, mode="drop")
        lse = lse.at[target].set(lse_rows, mode="drop")
    return out, lse


def _decode_rows(q_rows, k_cache, v_cache, block_tables, context_lens, *, fused: bool,
                 interpret: bool, **options):
    """`decode_mosaic` over ``q_rows [batch, num_heads, head_dim]`` (each sequence's first query
    row; lengths 0 where the sequence is not a decode, so its K/V is never read), with the
    config `pallas_paged.decode` would pick for the batch (else decode's smallest): ``(out,
    lse)`` per sequence."""
    k_half = jax.ShapeDtypeStruct(
        (*k_cache.shape[:2], num_kv_heads(k_cache.shape, fused), k_cache.shape[3]), k_cache.dtype)
    shape = decode_shape(q_rows, k_half, block_tables, options["sliding_window"])
    config = decode_config.lookup_mosaic(shape, device_kind(), sm_count())
    if decode_kernel.refusal(q_rows, k_half, config, interpret) is not None:
        config = decode_kernel.SMALLEST_CONFIG
    return decode_kernel.decode_mosaic(q_rows, k_cache, v_cache, block_tables, context_lens,
                                       config=config, interpret=interpret, fused=fused, **options)

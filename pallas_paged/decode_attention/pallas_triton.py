"""Paged decode attention, the Pallas Triton kernel: ``decode(..., impl="pallas")``.

Read top to bottom (the public function is `pallas_paged.decode_attention.api.decode`):

1. `_paged_decode_kernel` works on refs only. One program owns one (sequence, kv head, KV split):
   it computes all ``group = num_heads // num_kv_heads`` query heads of its kv head at once (the
   group padded to the dot's minimum of 16 rows), so every K/V row is read once per group. It walks
   the tiles of its split that lie below ``ceil(n / block_k)`` (and above the sliding-window
   start), gathering each token's row through the block table, with an online softmax in fp32.
   An fp8 cache's tiles are converted to fp16 for the dots, or with ``DecodeConfig.fp8_pairs``
   read as u16 words of two head columns (`fp8_pairs_to_f16`), each dot then split into the
   even and the odd columns.
2. `decode_kernel_call` builds the grid ``(batch, num_kv_heads, num_splits)`` and calls
   ``pallas_call``; `decode_pallas` then, when the KV axis is split (flash-decoding), merges the
   partial ``(o, m, l)`` results with a second, small kernel (`merge_splits_pallas`, the Pallas
   form of `merge_splits`, which the Mosaic GPU path keeps), or, with
   ``DecodeConfig.merge_in_kernel``, inside the kernel: each split counts its arrival with an
   atomic add, and the last to arrive merges (`merge_partials_in_program`): one launch. The
   tile loop (`attend_tiles`), the query load and the normalized store are shared with:
3. `_persistent_decode_kernel` (``DecodeConfig.persistent_programs``, `persistent_kernel_call`):
   a fixed number of programs per kv head deal the whole batch's tiles among them in balanced
   contiguous shares (`balanced_share`), walking one segment per sequence their share meets; a
   sequence cut by share boundaries is merged by the last of its programs to arrive
   (`share_owner` finds them). Every program walks as many tiles however ragged the lengths.
4. `decode` (in ``api.py``) validates, resolves the scale and the config, and dispatches to these
   kernels or to the plain-XLA path (``xla.py``).

Safety, by construction rather than by validation (values cannot raise under jit):

- Table entries are loaded only for positions ``< n``; every loaded block id is clamped into
  ``[0, num_blocks)`` before it becomes an address, so a garbage table cannot read outside the
  cache. Lengths are clamped into ``[0, max_blocks * block_size]`` so the table row is never
  overrun either.
- K and V rows of positions outside ``[window start, n)`` are not loaded (masked loads give 0), and
  their scores are ``-inf``: NaN/Inf in unused cache slots cannot reach the output.
- A row with no valid position (``n == 0``) gives zeros and ``lse = -inf``, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged._attention_common import (balanced_share, divides, merged_max_and_sum,
                                            num_kv_heads, share_owner, tile_range)
from pallas_paged._fp8 import kernel_scale_operands
from pallas_paged._platform import next_power_of_2
from pallas_paged._triton_common import (MIN_DOT_ROWS, column_parts, dot_dtype, dot_nn, dot_nt,
                                         kv_rows, load_kv_parts, merge_splits_pallas,
                                         query_for_dots, slot_major, softmax_exp, uses_fp8_pairs,
                                         with_sink)
from pallas_paged.decode_attention.pallas_triton_config import DecodeConfig


def value_tile_for_dot(v, compute_dtype, col_ok, *, at_load: bool):
    """A loaded ``[Tk, Dp]`` V tile in the ``p @ v`` dot's operand dtype.

    With ``at_load`` (`DecodeConfig.fp8_v_at_load`) an fp8 tile is also multiplied by
    ``col_ok`` (1 on the head's columns, 0 on the padding, which the masked load has already
    zeroed: the values do not change). A bare conversion lets Triton move it into the dot
    operand's read from shared memory, where an fp8 tile transposed for ``p @ v`` is read one
    byte per instruction and packed in pairs; the multiply by a tensor keeps the conversion where
    the tile is loaded, so the tile reaches the dot as fp16 through ``ldmatrix.trans``. Other
    dtypes, and fp8 without ``at_load``, convert directly.

    Args:
      v: ``[Tk, Dp]`` in the cache's dtype; col_ok: bool[Dp].
    """
    if not at_load or jnp.dtype(v.dtype).itemsize != 1:
        return v.astype(compute_dtype)
    return v.astype(compute_dtype) * col_ok.astype(compute_dtype)[None, :]


def tile_slots(tables_ref, b, tile, first, n, *, block_k: int, block_size: int, num_blocks: int):
    """Where tile ``tile`` of sequence ``b`` lives in the slot-major cache.

    Table entries are loaded only for positions in ``[first, n)``, and every block id is clamped
    into ``[0, num_blocks)`` before it becomes an address, so a garbage table cannot read outside
    the cache.

    Args:
      tables_ref: i32[batch, max_blocks]; b, tile, first, n: int32 scalars (`tile_range`'s).

    Returns:
      ``(pos, valid, slot)``, each i32/bool[Tk]: the tile's logical positions, which of them are
      in ``[first, n)``, and their cache slots (those of block 0 where not valid).
    """
    pos = tile * block_k + jnp.arange(block_k)  # i32[Tk]
    valid = (pos >= first) & (pos < n)
    page = jnp.where(valid, pos // block_size, 0)
    block = plgpu.load(tables_ref.at[b, page], mask=valid, other=0)  # i32[Tk]
    block = jnp.clip(block, 0, num_blocks - 1)  # a garbage id can never leave the cache
    return pos, valid, block * block_size + pos % block_size


def attend_tiles(tables_ref, k_ref, v_ref, qs, score_scale, slopes, *, b, h, n, first,
                 tile_lo, tile_hi, words, word_ok, block_k: int, block_size: int,
                 compute_dtype, soft_cap: float | None, fp8_v_at_load: bool, fp8_pairs: bool,
                 fused: bool, interpret: bool):
    """The online softmax of one kv head's query rows over tiles ``[tile_lo, tile_hi)`` of
    sequence ``b`` (the kernels' tile loop, which Triton pipelines).

    Args:
      tables_ref, k_ref, v_ref: as `_paged_decode_kernel`'s (the caches `slot_major`).
      qs: the query rows' `column_parts` tiles in ``compute_dtype`` (`query_for_dots`), each
        ``[Gp, Dq]``; score_scale: f32 scalar, the factor of every score.
      slopes: f32[Gp] ALiBi slopes, or None.
      b, h, n, first: int32 scalars: the sequence, the kv head, its clamped length and its first
        position inside the window (`tile_range`); tile_lo, tile_hi: int32 scalars.
      words, word_ok: `column_parts`' word indices and mask, i32[Dq] / bool[Dq].
      fused: ``k_ref`` and ``v_ref`` are one fused cache (`kv_rows`).

    Returns:
      ``(accs, m, l)``: per part the unnormalized weighted sum f32[Gp, Dq], the running max and
      the sum of exponentials f32[Gp] (``-inf`` and 0 where no tile was walked).
    """
    num_blocks = k_ref.shape[0] // block_size
    padded_group, part_dim = qs[0].shape
    load_tile = functools.partial(load_kv_parts, words=words, fp8_pairs=fp8_pairs,
                                  interpret=interpret)
    k_rows, v_rows = kv_rows(h, fused)

    def tile_body(tile, carry):
        accs, m_prev, l_prev = carry  # (f32[Gp, Dq],) * parts, f32[Gp], f32[Gp]
        pos, valid, slot = tile_slots(tables_ref, b, tile, first, n, block_k=block_k,
                                      block_size=block_size, num_blocks=num_blocks)
        kv_mask = valid[:, None] & word_ok[None, :]
        ks = load_tile(k_ref, slot, k_rows, mask=kv_mask)  # [Tk, Dq] each
        s = functools.reduce(jnp.add, [dot_nt(q, k.astype(compute_dtype))
                                       for q, k in zip(qs, ks)])  # f32[Gp, Tk]
        s = s * score_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        if slopes is not None:
            s = s + slopes[:, None] * (pos - (n - 1)).astype(jnp.float32)[None, :]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # all -inf so far: keep exp finite
        alpha = softmax_exp(m_prev - m_safe, interpret=interpret)  # f32[Gp]
        p = softmax_exp(s - m_safe[:, None], interpret=interpret)  # f32[Gp, Tk], 0 where masked
        vs = load_tile(v_ref, slot, v_rows, mask=kv_mask)  # [Tk, Dq] each
        if fp8_pairs:  # the pairs' fp16 tiles, in fp32 for an fp32 query
            vs = tuple(v.astype(compute_dtype) for v in vs)
        else:
            vs = (value_tile_for_dot(vs[0], compute_dtype, word_ok, at_load=fp8_v_at_load),)
        p_dot = p.astype(compute_dtype)
        accs = tuple(acc * alpha[:, None] + dot_nn(p_dot, v) for acc, v in zip(accs, vs))
        return accs, m_next, l_prev * alpha + p.sum(axis=1)

    carry = ((jnp.zeros((padded_group, part_dim), jnp.float32),) * len(qs),
             jnp.full((padded_group,), -jnp.inf, jnp.float32),
             jnp.zeros((padded_group,), jnp.float32))
    return jax.lax.fori_loop(tile_lo, tile_hi, tile_body, carry)


def load_queries(q_ref, b, h, rows, row_ok, word_ok, part_cols, score_scale, compute_dtype):
    """The query rows of (sequence ``b``, kv head ``h``) from ``q_ref`` [batch, kvh, group,
    head_dim] as `attend_tiles` takes them: `query_for_dots` of their `column_parts` tiles."""
    qs = tuple(plgpu.load(q_ref.at[b, h, rows[:, None], c[None, :]],
                          mask=row_ok[:, None] & word_ok[None, :], other=0)
               for c in part_cols)  # [Gp, Dq] each
    return query_for_dots(qs, score_scale, compute_dtype)


def store_normalized(out_ref, lse_ref, index, accs, m, l, sink, *, present, rows, row_ok,
                     word_ok, part_cols):
    """A finished online softmax's output and lse at ``out_ref.at[*index]`` / ``lse_ref.at[*index]``
    (``[..., group, head_dim]`` in the output dtype / f32[..., group]): the sink's logit added
    (``sink`` f32[Gp] or None), the sums divided out (rows with ``l == 0`` give zeros), ``lse =
    -inf`` where not ``present`` (no key)."""
    if sink is not None:
        accs, m, l = with_sink(accs, m, l, sink)
    ok = divides(l)
    for acc, c in zip(accs, part_cols):
        out = jnp.where(ok[:, None], acc / jnp.where(ok, l, 1.0)[:, None], 0.0)
        plgpu.store(out_ref.at[(*index, rows[:, None], c[None, :])], out.astype(out_ref.dtype),
                    mask=row_ok[:, None] & word_ok[None, :])
    lse = jnp.where(present, m + jnp.log(l), -jnp.inf)
    plgpu.store(lse_ref.at[(*index, rows)], lse, mask=row_ok)


def _paged_decode_kernel(
    lens_ref,    # i32[batch]
    tables_ref,  # i32[batch, max_blocks]
    q_ref,       # [batch, num_kv_heads, group, head_dim]
    k_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]  (the cache, slot-major;
                 #  fp8_pairs: u16[..., head_dim / 2], two columns per word; fused: the one
                 #  cache [num_blocks * block_size, num_kv_heads, 2, head_dim], `slot_major`)
    v_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]  (as k_ref; fused: k_ref)
    alibi_ref,   # f32[num_kv_heads, group] or None
    sinks_ref,   # f32[num_kv_heads, group] or None
    k_scale_ref,  # f32[1], the k_scale of an fp8 cache, or None
    v_scale_ref,  # f32[1], its v_scale, or None
    arrivals_in_ref,  # i32[batch, kvh] zeros (merge_in_kernel; the buffer of the last output), or None
    *out_refs,   # split:  o f32[batch, kvh, splits, group, head_dim], m, l f32[batch, kvh, splits, group]
                 #         (merge_in_kernel: then out, lse as single, then arrivals i32[batch, kvh])
                 # single: out [batch, kvh, group, head_dim] in q.dtype, then lse f32[batch, kvh, group]
    scale: float,
    block_size: int,
    block_k: int,
    num_splits: int,
    padded_group: int,
    padded_dim: int,
    compute_dtype,
    soft_cap: float | None,
    window: int | None,
    merge_in_kernel: bool,
    fp8_v_at_load: bool,
    fp8_pairs: bool,
    fused: bool,
    interpret: bool,
):
    del arrivals_in_ref  # aliased to the arrivals output, which the kernel updates
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, group, head_dim = q_ref.shape
    capacity = tables_ref.shape[1] * block_size

    n = jnp.clip(lens_ref[b], 0, capacity)
    first, tile_lo, tile_hi = tile_range(n, split, block_k=block_k, num_splits=num_splits,
                                         window=window)

    rows = jnp.arange(padded_group)  # [Gp]
    row_ok = rows < group
    # [Dq], [Dq], [Dq] per part: the head's columns in one part, or the even and the odd ones
    words, word_ok, part_cols = column_parts(padded_dim, head_dim, fp8_pairs=fp8_pairs)
    score_scale = scale if k_scale_ref is None else k_scale_ref[0] * scale
    qs, score_scale = load_queries(q_ref, b, h, rows, row_ok, word_ok, part_cols, score_scale,
                                   compute_dtype)
    slopes = None if alibi_ref is None else plgpu.load(alibi_ref.at[h, rows], mask=row_ok,
                                                       other=0)  # f32[Gp]
    accs, m, l = attend_tiles(
        tables_ref, k_ref, v_ref, qs, score_scale, slopes, b=b, h=h, n=n, first=first,
        tile_lo=tile_lo, tile_hi=tile_hi, words=words, word_ok=word_ok, block_k=block_k,
        block_size=block_size, compute_dtype=compute_dtype, soft_cap=soft_cap,
        fp8_v_at_load=fp8_v_at_load, fp8_pairs=fp8_pairs, fused=fused, interpret=interpret)
    if v_scale_ref is not None:
        accs = tuple(acc * v_scale_ref[0] for acc in accs)

    out_mask = row_ok[:, None] & word_ok[None, :]
    if num_splits > 1:
        o_ref, m_ref, l_ref = out_refs[:3]
        for acc, c in zip(accs, part_cols):
            plgpu.store(o_ref.at[b, h, split, rows[:, None], c[None, :]], acc, mask=out_mask)
        plgpu.store(m_ref.at[b, h, split, rows], m, mask=row_ok)
        plgpu.store(l_ref.at[b, h, split, rows], l, mask=row_ok)
        if not merge_in_kernel:
            return
        out_ref, lse_ref, arrivals_ref = out_refs[3:]
        if not interpret:  # every thread's stores above come before the arrival below
            plgpu.debug_barrier()
        # An acquire-release atomic at GPU scope: the split that arrives last sees every other
        # split's partial results.
        arrived = plgpu.atomic_add(arrivals_ref, (b, h), jnp.ones((), jnp.int32))

        @pl.when(arrived == num_splits - 1)
        def _merge():
            merge_partials_in_program(o_ref, m_ref, l_ref, sinks_ref, out_ref, lse_ref, b=b, h=h,
                                      present=n > 0, padded_dim=padded_dim,
                                      part_index=lambda j: (b, h, j), num_parts=num_splits,
                                      max_parts=num_splits)
        return

    sink = None if sinks_ref is None else plgpu.load(sinks_ref.at[h, rows], mask=row_ok,
                                                     other=0)  # f32[Gp]
    out_ref, lse_ref = out_refs
    store_normalized(out_ref, lse_ref, (b, h), accs, m, l, sink, present=n > 0, rows=rows,
                     row_ok=row_ok, word_ok=word_ok, part_cols=part_cols)


# Parts one step of a persistent program's merge loads: a sequence cut by share boundaries has
# two parts unless the shares are shorter than it; a chunk of more parts would hold their rows
# in registers the whole kernel pays for.
PERSISTENT_MERGE_PARTS_PER_STEP = 2


def _persistent_decode_kernel(
    lens_ref,    # i32[batch]
    tables_ref,  # i32[batch, max_blocks]
    q_ref,       # [batch, num_kv_heads, group, head_dim]
    k_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]  (as _paged_decode_kernel's)
    v_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]
    alibi_ref,   # f32[num_kv_heads, group] or None
    sinks_ref,   # f32[num_kv_heads, group] or None
    k_scale_ref,  # f32[1] or None
    v_scale_ref,  # f32[1] or None
    arrivals_in_ref,  # i32[batch, kvh] zeros (the buffer of the arrivals output)
    o_ref,       # f32[kvh, 2 * programs, group, head_dim]: each program's first and last
                 #   segments' partial weighted sums (part 2p and 2p + 1)
    m_ref,       # f32[kvh, 2 * programs, group]: their running maxima
    l_ref,       # f32[kvh, 2 * programs, group]: their sums of exponentials
    out_ref,     # [batch, kvh, group, head_dim] in q.dtype
    lse_ref,     # f32[batch, kvh, group]
    arrivals_ref,  # i32[batch, kvh]: programs done with each (sequence, kv head)
    *,
    scale: float,
    block_size: int,
    block_k: int,
    num_programs: int,
    padded_batch: int,
    padded_group: int,
    padded_dim: int,
    compute_dtype,
    soft_cap: float | None,
    window: int | None,
    fp8_v_at_load: bool,
    fp8_pairs: bool,
    fused: bool,
    interpret: bool,
):
    """`DecodeConfig.persistent_programs`: ``num_programs`` programs per kv head deal the tiles
    of every sequence of the batch among them.

    The sequences' tiles (`tile_range`'s, one split) are laid end to end, sequence 0 first, and
    program ``p`` walks its `balanced_share` of them: one segment per sequence its share meets,
    each segment the tile loop of `attend_tiles`. A segment that is a whole sequence is
    normalized and stored; the others (only a share's first and last can be cut) store partial
    results and count their arrival at the (sequence, kv head), and the last program to arrive
    merges its parts (`merge_partials_in_program`; `share_owner` says which programs hold them). Sequences
    without tiles (``n == 0``) get zeros and ``lse = -inf`` from program ``b % num_programs``.
    """
    del arrivals_in_ref  # aliased to the arrivals output, which the kernel updates
    h, p = pl.program_id(0), pl.program_id(1)
    batch = lens_ref.shape[0]
    _, _, group, head_dim = q_ref.shape
    capacity = tables_ref.shape[1] * block_size

    seqs = jnp.arange(padded_batch)  # [Bp]
    n_all = jnp.clip(plgpu.load(lens_ref.at[seqs], mask=seqs < batch, other=0), 0, capacity)
    _, lo_all, hi_all = tile_range(n_all, 0, block_k=block_k, num_splits=1, window=window)
    count_all = jnp.maximum(hi_all - lo_all, 0)  # i32[Bp], each sequence's tiles
    end_all = jnp.cumsum(count_all)  # i32[Bp], where each sequence's tiles end, end to end
    total = jnp.max(end_all)
    deal_lo, deal_hi = balanced_share(total, p, num_programs)
    # the sequences holding this program's first and last tile (empty ones end before them)
    b_first = jnp.sum(jnp.where(end_all <= deal_lo, 1, 0))
    b_last = jnp.sum(jnp.where(end_all < deal_hi, 1, 0))
    segments = jnp.where(deal_hi > deal_lo, b_last - b_first + 1, 0)

    rows = jnp.arange(padded_group)  # [Gp]
    row_ok = rows < group
    words, word_ok, part_cols = column_parts(padded_dim, head_dim, fp8_pairs=fp8_pairs)
    key_scale = scale if k_scale_ref is None else k_scale_ref[0] * scale
    slopes = None if alibi_ref is None else plgpu.load(alibi_ref.at[h, rows], mask=row_ok,
                                                       other=0)  # f32[Gp]
    sink = None if sinks_ref is None else plgpu.load(sinks_ref.at[h, rows], mask=row_ok,
                                                     other=0)  # f32[Gp]

    def of_sequence(values, b):  # element b of an i32[Bp]
        return jnp.sum(jnp.where(seqs == b, values, 0))

    def segment(b, *, may_be_cut: bool):
        """Sequence ``b``'s tiles in this program's share: attended, then stored normalized if
        they are the whole sequence; else (``may_be_cut``: the share's first or last segment)
        stored as a part, and merged by the last of the sequence's programs to arrive."""
        n = jnp.clip(lens_ref[b], 0, capacity)
        first, tile_first, tile_end = tile_range(n, 0, block_k=block_k, num_splits=1,
                                                 window=window)
        seq_end = of_sequence(end_all, b)
        seq_start = seq_end - (tile_end - tile_first)
        lo, hi = jnp.maximum(deal_lo, seq_start), jnp.minimum(deal_hi, seq_end)
        qs, score_scale = load_queries(q_ref, b, h, rows, row_ok, word_ok, part_cols, key_scale,
                                       compute_dtype)
        accs, m, l = attend_tiles(
            tables_ref, k_ref, v_ref, qs, score_scale, slopes, b=b, h=h, n=n, first=first,
            tile_lo=tile_first + lo - seq_start, tile_hi=tile_first + hi - seq_start,
            words=words, word_ok=word_ok, block_k=block_k, block_size=block_size,
            compute_dtype=compute_dtype, soft_cap=soft_cap, fp8_v_at_load=fp8_v_at_load,
            fp8_pairs=fp8_pairs, fused=fused, interpret=interpret)
        if v_scale_ref is not None:
            accs = tuple(acc * v_scale_ref[0] for acc in accs)
        walked = hi > lo  # (a sequence without tiles is left to the loop of empty ones below)
        whole = (lo == seq_start) & (hi == seq_end)

        @pl.when(walked & whole)
        def _store():
            store_normalized(out_ref, lse_ref, (b, h), accs, m, l, sink, present=n > 0,
                             rows=rows, row_ok=row_ok, word_ok=word_ok, part_cols=part_cols)

        if not may_be_cut:
            return

        @pl.when(walked & jnp.logical_not(whole))
        def _store_part():
            part = 2 * p + jnp.minimum(b - b_first, 1)  # 0: its first segment, 1: its last
            out_mask = row_ok[:, None] & word_ok[None, :]
            for acc, c in zip(accs, part_cols):
                plgpu.store(o_ref.at[h, part, rows[:, None], c[None, :]], acc, mask=out_mask)
            plgpu.store(m_ref.at[h, part, rows], m, mask=row_ok)
            plgpu.store(l_ref.at[h, part, rows], l, mask=row_ok)
            if not interpret:  # every thread's stores above come before the arrival below
                plgpu.debug_barrier()
            # acquire-release at GPU scope: the last to arrive sees every other part
            arrived = plgpu.atomic_add(arrivals_ref, (b, h), jnp.ones((), jnp.int32))
            owner_first = share_owner(seq_start, total, num_programs)
            parts = share_owner(seq_end - 1, total, num_programs) - owner_first + 1
            # 1 where the first owner's share starts before this sequence (this is its last
            # segment), else 0; the later owners' shares start in it (their first segment)
            first_owner_part = jnp.clip(
                seq_start - balanced_share(total, owner_first, num_programs)[0], 0, 1)

            def part_index(j):  # i32[C] -> (kv head, part) of the sequence's j-th program
                return h, 2 * (owner_first + j) + first_owner_part * jnp.clip(1 - j, 0, 1)

            @pl.when(arrived == parts - 1)
            def _merge():
                merge_partials_in_program(o_ref, m_ref, l_ref, sinks_ref, out_ref, lse_ref, b=b,
                                          h=h, present=n > 0, padded_dim=padded_dim,
                                          part_index=part_index, num_parts=parts,
                                          max_parts=num_programs,
                                          parts_per_step=PERSISTENT_MERGE_PARTS_PER_STEP)

    # Only a share's first and last segments can be cut by its boundaries: they are walked
    # apart, outside the loop of the whole sequences between them, which keeps the parts'
    # stores and the merge out of that loop (inside it they cost 70 registers per thread).
    @pl.when(segments >= 1)
    def _first_segment():
        segment(b_first, may_be_cut=True)

    def middle(b, carry):
        segment(b, may_be_cut=False)
        return carry

    jax.lax.fori_loop(b_first + 1, b_first + segments - 1, middle, jnp.int32(0))

    @pl.when(segments >= 2)
    def _last_segment():
        segment(b_first + segments - 1, may_be_cut=True)

    def empty(i, carry):  # sequences with no tiles: zeros, lse -inf
        b = p + i * num_programs

        @pl.when(of_sequence(count_all, b) == 0)
        def _zeros():
            accs = (jnp.zeros((padded_group, padded_dim // len(part_cols)), jnp.float32),) * len(
                part_cols)
            store_normalized(out_ref, lse_ref, (b, h), accs,
                             jnp.full((padded_group,), -jnp.inf, jnp.float32),
                             jnp.zeros((padded_group,), jnp.float32), None,
                             present=jnp.bool_(False), rows=rows, row_ok=row_ok,
                             word_ok=word_ok, part_cols=part_cols)
        return carry

    jax.lax.fori_loop(0, (batch - p + num_programs - 1) // num_programs, empty, jnp.int32(0))


MERGE_CHUNK_ELEMENTS = 8192  # partial-result elements one step of the in-kernel merge loads


def merge_partials_in_program(o_ref, m_ref, l_ref, sinks_ref, out_ref, lse_ref, *, b, h, present,
                              padded_dim: int, part_index, num_parts, max_parts: int,
                              parts_per_step: int | None = None):
    """`merge_splits` for one (sequence ``b``, kv head ``h``), inside the program that finishes
    it last, into ``out_ref.at[b, h]`` / ``lse_ref.at[b, h]`` (`_paged_decode_kernel`'s single
    outputs).

    The partial results ``(o f32[..., group, head_dim], m, l f32[..., group])`` of the row's
    parts ``j < num_parts`` (an int32 scalar, at most the static ``max_parts``) sit at
    ``o_ref.at[*part_index(j)]`` (and the same in ``m_ref``, ``l_ref``): ``part_index`` maps an
    i32[C] of part numbers to the refs' leading indices (scalars, or i32[C] arrays), e.g. ``(b,
    h, j)`` for the splits of `_paged_decode_kernel`. The maxima and sums of all parts are loaded
    at once; the weighted partial outputs in chunks of parts (``MERGE_CHUNK_ELEMENTS`` at a time,
    or ``parts_per_step`` parts where the row usually has few: the chunk's registers count
    toward the whole kernel's), independent loads that the loop can keep in flight. Partials
    are read with volatile loads (from L2, where other multiprocessors' stores are), never from
    a stale L1 line: the partials of small rows share cache lines with their neighbours', which
    an earlier merge on the same multiprocessor read.
    """
    group, head_dim = out_ref.shape[2], out_ref.shape[3]
    padded_parts = next_power_of_2(max_parts)
    rows_p = next_power_of_2(group)
    chunk = max(1, min(padded_parts, MERGE_CHUNK_ELEMENTS // (rows_p * padded_dim),
                       parts_per_step or padded_parts))
    rows = jnp.arange(rows_p)  # [Gm]
    cols = jnp.arange(padded_dim)  # [Dp]
    row_ok, col_ok = rows < group, cols < head_dim

    def at_parts(j, extra: int):  # part_index(j) shaped to broadcast against `extra` more axes
        return tuple(x if jnp.ndim(x) == 0 else x.reshape(x.shape + (1,) * extra)
                     for x in part_index(j))

    parts = jnp.arange(padded_parts)  # [Sp]
    ok = (parts < num_parts)[:, None] & row_ok[None, :]  # [Sp, Gm]
    at = at_parts(jnp.where(parts < num_parts, parts, 0), 1)
    m = plgpu.load(m_ref.at[(*at, rows[None, :])], mask=ok, other=-jnp.inf,
                   volatile=True)  # f32[Sp, Gm]
    l = plgpu.load(l_ref.at[(*at, rows[None, :])], mask=ok, other=0.0,
                   volatile=True)  # f32[Sp, Gm]
    sink = None if sinks_ref is None else plgpu.load(sinks_ref.at[h, rows], mask=row_ok,
                                                     other=0)  # f32[Gm]
    m_total, l_total, _ = merged_max_and_sum(m, l, jnp.max(m, axis=0), sink)  # f32[Gm] each

    def add_chunk(c, o_total):  # o_total: f32[Gm, Dp]
        j = c * chunk + jnp.arange(chunk)  # [C]
        j_ok = (j < num_parts)[:, None] & row_ok[None, :]  # [C, Gm]
        j_safe = jnp.where(j < num_parts, j, 0)
        m_c = plgpu.load(m_ref.at[(*at_parts(j_safe, 1), rows[None, :])], mask=j_ok,
                         other=-jnp.inf, volatile=True)  # f32[C, Gm]
        o_c = plgpu.load(o_ref.at[(*at_parts(j_safe, 2), rows[None, :, None], cols[None, None, :])],
                         mask=j_ok[:, :, None] & col_ok[None, None, :], other=0.0,
                         volatile=True)  # f32[C, Gm, Dp]
        weight = jnp.exp(m_c - m_total[None, :])  # f32[C, Gm], 0 for missing parts
        return o_total + jnp.sum(weight[:, :, None] * o_c, axis=0)

    o_total = jax.lax.fori_loop(0, (num_parts + chunk - 1) // chunk, add_chunk,
                                jnp.zeros((rows_p, padded_dim), jnp.float32))
    has = present & divides(l_total)  # [Gm]
    out = jnp.where(has[:, None], o_total / jnp.where(has, l_total, 1.0)[:, None], 0.0)
    plgpu.store(out_ref.at[b, h, rows[:, None], cols[None, :]], out.astype(out_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])
    lse = jnp.where(present, m_total + jnp.log(l_total), -jnp.inf)
    plgpu.store(lse_ref.at[b, h, rows], lse, mask=row_ok)


def kernel_statics(q, k_cache, config: DecodeConfig, fused: bool) -> dict:
    """The static arguments both Triton decode kernels take for one call (besides scale and the
    options): the block size, the tile, the padded group and head dims, the dots' dtype, the
    fp8 layout (``fp8_pairs`` where `uses_fp8_pairs`, else ``fp8_v_at_load`` for fp8 caches) and
    the cache layout (``fused``)."""
    _, num_heads, head_dim = q.shape
    block_size, kvh = k_cache.shape[1], num_kv_heads(k_cache.shape, fused)
    fp8_pairs = uses_fp8_pairs(config.fp8_pairs, k_cache.dtype, head_dim)
    return dict(block_size=block_size, block_k=config.block_k,
                padded_group=max(MIN_DOT_ROWS, next_power_of_2(num_heads // kvh)),
                padded_dim=max(16, next_power_of_2(head_dim)),
                compute_dtype=dot_dtype(q.dtype, k_cache.dtype),
                fp8_v_at_load=(config.fp8_v_at_load and jnp.dtype(k_cache.dtype).itemsize == 1
                               and not fp8_pairs),
                fp8_pairs=fp8_pairs, fused=fused)


def kernel_operands(q, k_cache, v_cache, block_tables, context_lens, alibi_slopes, sinks, k_scale,
                    v_scale, *, fp8_pairs: bool, fused: bool) -> tuple:
    """Both kernels' operands in their refs' order: lengths and tables as int32, the queries per
    kv head ``[batch, kvh, group, head_dim]``, the caches `slot_major`, ALiBi slopes and sinks per
    kv head ``[kvh, group]`` (or None), the fp8 scales (`kernel_scale_operands`). A fused cache
    is both cache operands."""
    batch, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    per_head = lambda x: None if x is None else x.reshape(kvh, num_heads // kvh)  # noqa: E731
    return (context_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
            q.reshape(batch, kvh, num_heads // kvh, head_dim),
            slot_major(k_cache, fp8_pairs=fp8_pairs, fused=fused),
            slot_major(v_cache, fp8_pairs=fp8_pairs, fused=fused),
            per_head(alibi_slopes), per_head(sinks), *kernel_scale_operands(k_scale, v_scale))


def kernel_name(grid: str, statics: dict, q, k_cache, *, merged: bool = False) -> str:
    """``pallas_paged_decode_bk64_<grid>_g4_d128_bs16[_merged][_vload][_pairs]``: a kernel's name
    in profiles, ``grid`` its grid's part (``s2`` splits, ``p33`` persistent programs per kv
    head)."""
    group, head_dim = q.shape[1] // num_kv_heads(k_cache.shape, statics["fused"]), q.shape[2]
    return (f"pallas_paged_decode_bk{statics['block_k']}_{grid}_g{group}_d{head_dim}"
            f"_bs{statics['block_size']}" + ("_merged" if merged else "")
            + ("_fused" if statics["fused"] else "")
            + ("_vload" if statics["fp8_v_at_load"] else "")
            + ("_pairs" if statics["fp8_pairs"] else ""))


def grid_kernel_out_shapes(q, kvh: int, splits: int, merge_in_kernel: bool) -> tuple:
    """`_paged_decode_kernel`'s outputs for ``q`` [batch, num_heads, head_dim] over ``kvh`` kv
    heads: with one split ``(out [batch, kvh, group, head_dim] in q.dtype, lse f32[batch, kvh,
    group])``; with several the partial ``(o f32[batch, kvh, splits, group, head_dim], m, l
    f32[batch, kvh, splits, group])``, then (``merge_in_kernel``) out, lse and the arrival counts
    i32[batch, kvh]."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // kvh
    finals = (jax.ShapeDtypeStruct((batch, kvh, group, head_dim), q.dtype),
              jax.ShapeDtypeStruct((batch, kvh, group), jnp.float32))
    if splits == 1:
        return finals
    partials = (jax.ShapeDtypeStruct((batch, kvh, splits, group, head_dim), jnp.float32),
                jax.ShapeDtypeStruct((batch, kvh, splits, group), jnp.float32),
                jax.ShapeDtypeStruct((batch, kvh, splits, group), jnp.float32))
    if not merge_in_kernel:
        return partials
    return partials + finals + (jax.ShapeDtypeStruct((batch, kvh), jnp.int32),)


def decode_kernel_call(q, k_cache, v_cache, block_tables, context_lens, *, scale,
                       config: DecodeConfig, interpret: bool, logits_soft_cap, alibi_slopes,
                       sliding_window, sinks, k_scale, v_scale, fused: bool):
    """The kernel alone, over the grid ``(batch, num_kv_heads, num_splits)``.

    Arguments as `decode_pallas`.

    Returns:
      with one split, or several and ``config.merge_in_kernel``, ``(out [batch, kvh, group,
      head_dim] in q.dtype, lse f32[batch, kvh, group])``; with several otherwise, the partial
      ``(o f32[batch, kvh, splits, group, head_dim], m, l f32[batch, kvh, splits, group])`` that
      `merge_splits` combines.
    """
    batch = q.shape[0]
    kvh = num_kv_heads(k_cache.shape, fused)
    splits = config.num_splits
    merge_in_kernel = config.merge_in_kernel and splits > 1
    statics = kernel_statics(q, k_cache, config, fused)
    kernel = functools.partial(
        _paged_decode_kernel, scale=scale, num_splits=splits, soft_cap=logits_soft_cap,
        window=sliding_window, merge_in_kernel=merge_in_kernel, interpret=interpret, **statics)
    out_shape = grid_kernel_out_shapes(q, kvh, splits, merge_in_kernel)
    operands = kernel_operands(q, k_cache, v_cache, block_tables, context_lens, alibi_slopes,
                               sinks, k_scale, v_scale, fp8_pairs=statics["fp8_pairs"],
                               fused=fused)
    # merge_in_kernel: the arrival counts start at zero and live in the last output's buffer.
    arrivals = jnp.zeros((batch, kvh), jnp.int32) if merge_in_kernel else None
    aliases = {len(jax.tree_util.tree_leaves(operands)): len(out_shape) - 1} if merge_in_kernel \
        else {}
    name = kernel_name(f"s{splits}", statics, q, k_cache, merged=merge_in_kernel)
    outs = pl.pallas_call(
        kernel,
        grid=(batch, kvh, splits),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*operands, arrivals)
    return outs[3:5] if merge_in_kernel else outs


def persistent_kernel_call(q, k_cache, v_cache, block_tables, context_lens, *, scale,
                           config: DecodeConfig, interpret: bool, logits_soft_cap, alibi_slopes,
                           sliding_window, sinks, k_scale, v_scale, fused: bool):
    """`_persistent_decode_kernel` over the grid ``(num_kv_heads, P)``: ``P = max(1,
    config.persistent_programs // num_kv_heads)`` programs per kv head.

    Arguments as `decode_pallas`.

    Returns:
      ``(out [batch, kvh, group, head_dim] in q.dtype, lse f32[batch, kvh, group])``.
    """
    batch, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    group = num_heads // kvh
    programs = max(1, config.persistent_programs // kvh)  # per kv head
    statics = kernel_statics(q, k_cache, config, fused)
    kernel = functools.partial(
        _persistent_decode_kernel, scale=scale, num_programs=programs,
        padded_batch=next_power_of_2(batch), soft_cap=logits_soft_cap, window=sliding_window,
        interpret=interpret, **statics)
    out_shape = (jax.ShapeDtypeStruct((kvh, 2 * programs, group, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((kvh, 2 * programs, group), jnp.float32),
                 jax.ShapeDtypeStruct((kvh, 2 * programs, group), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kvh, group, head_dim), q.dtype),
                 jax.ShapeDtypeStruct((batch, kvh, group), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kvh), jnp.int32))
    operands = kernel_operands(q, k_cache, v_cache, block_tables, context_lens, alibi_slopes,
                               sinks, k_scale, v_scale, fp8_pairs=statics["fp8_pairs"],
                               fused=fused)
    name = kernel_name(f"p{programs}", statics, q, k_cache)
    outs = pl.pallas_call(
        kernel,
        grid=(kvh, programs),
        out_shape=out_shape,
        # the arrival counts start at zero and live in the last output's buffer
        input_output_aliases={len(jax.tree_util.tree_leaves(operands)): len(out_shape) - 1},
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(*operands, jnp.zeros((batch, kvh), jnp.int32))
    return outs[3:5]


def decode_pallas(q, k_cache, v_cache, block_tables, context_lens, *, scale, config: DecodeConfig,
                  interpret: bool, logits_soft_cap, alibi_slopes, sliding_window, sinks, k_scale,
                  v_scale, fused: bool = False):
    """`decode_kernel_call`, then the split merge when the KV axis is split (flash-decoding).

    Arguments as `pallas_paged.decode` (validated, ``scale`` resolved to a float, lengths and
    table ids int32; ``k_scale`` / ``v_scale`` ``f32[]`` operands or None, passed to the kernel as
    two ``f32[1]`` operands (`kernel_scale_operands`) so that the compiled kernel serves every
    scale). ``fused``: ``k_cache`` and ``v_cache`` are one fused cache ``[num_blocks, block_size,
    2 * num_kv_heads, head_dim]``, read in place.

    Returns:
      ``(out [batch, num_heads, head_dim] in q.dtype, lse f32[batch, num_heads])``.
    """
    batch, num_heads, head_dim = q.shape
    kvh = num_kv_heads(k_cache.shape, fused)
    if config.persistent_programs:
        out, lse = persistent_kernel_call(
            q, k_cache, v_cache, block_tables, context_lens, scale=scale, config=config,
            interpret=interpret, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
            sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
            fused=fused)
        return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)
    outs = decode_kernel_call(
        q, k_cache, v_cache, block_tables, context_lens, scale=scale, config=config,
        interpret=interpret, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        fused=fused)
    if config.num_splits > 1 and not config.merge_in_kernel:
        per_head = None if sinks is None else sinks.reshape(kvh, num_heads // kvh)
        out, lse = merge_splits_pallas(*outs, context_lens.astype(jnp.int32), per_head,
                                       out_dtype=q.dtype,
                                       interpret=interpret)
    else:
        out, lse = outs
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)

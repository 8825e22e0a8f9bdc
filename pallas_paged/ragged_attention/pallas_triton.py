"""Ragged paged attention, the Pallas Triton kernel: ``paged_attention(..., impl="pallas")``.

Read top to bottom (the public function is `pallas_paged.ragged_attention.api.paged_attention`):

1. `find_query_tile` maps a program to its work. The grid is static, so its query axis covers an
   upper bound of the query tiles of any ``query_start_loc``: sequence ``b`` owns the programs
   ``query_start_loc[b] // block_q + b`` onwards, one per ``block_q`` of its new tokens, and the
   padding rows past ``query_start_loc[batch]`` form a last pseudo-sequence ``batch`` whose
   programs write zeros (with ``block_q == 1``, token ``t`` is simply program ``t``). A program finds its sequence by a binary search over the small
   ``query_start_loc``; programs in the gaps between sequences' ranges have no rows and return.
   With short tiles (``AttentionConfig.short_block_q``), ``batch`` more programs, spread evenly
   among those (`interleave_short_programs`), each take one sequence of at most
   ``short_block_q`` tokens (decode, speculative steps) with dots of fewer rows; the long tiles
   then skip those sequences.
2. `_ragged_attention_kernel` works on refs only. One program owns one (query tile, kv head, KV
   split): ``block_q`` query tokens x the ``group`` query heads of its kv head share the M
   dimension of both dots (padded to at least 16 rows), so every K/V row is read once per tile.
   It walks the K/V tiles of its split between the window start of its first query and its last
   query's position (causal and window skipping: nothing past the tile's last query position is
   read, nor any tile wholly outside the window), gathering each token's row through the block
   table, with an online softmax in fp32. Tiles that every query of the tile sees whole need no
   mask and take a cheaper loop; the others (the diagonal, the window's edge) are masked per
   (row, position).
3. `paged_attention_pallas` builds the grid ``(query tiles, num_kv_heads, num_splits)``, calls
   ``pallas_call`` and, when the KV axis is split, merges the partial ``(o, m, l)`` results with
   decode's `merge_splits_pallas`.

Safety, by construction rather than by validation (values cannot raise under jit):

- ``query_start_loc`` entries are clamped into ``[0, num_tokens]``, lengths into
  ``[0, max_blocks * block_size]``; table entries are loaded only for positions ``< n`` and every
  loaded block id is clamped into ``[0, num_blocks)`` before it becomes an address.
- K and V rows of positions outside a tile's visible range are not loaded (masked loads give 0)
  and their scores are ``-inf``. In masked tiles, a V row that only some of the tile's queries see
  has non-finite entries replaced by 0 before the ``p @ v`` dot: a query whose weight for it is 0
  would otherwise get ``0 * NaN``. So NaN at a position after a query's own (or outside its
  window) cannot reach that query's row (invariant I8).
- Padding rows and rows that see no position give zeros and ``lse = -inf``, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged._attention_common import divides, num_kv_heads
from pallas_paged._fp8 import kernel_scale_operands
from pallas_paged._platform import next_power_of_2
from pallas_paged._triton_common import (column_parts, dot_dtype, dot_nn, dot_nt, kv_rows,
                                         load_kv_parts, merge_splits_pallas, query_for_dots,
                                         slot_major, softmax_exp, uses_fp8_pairs, with_sink)
from pallas_paged.ragged_attention.pallas_triton_config import AttentionConfig, tile_dot_rows
from pallas_paged.ragged_attention.tiles import kv_tile_plan


def find_query_tile(program, qsl_ref, *, batch: int, num_tokens: int, block_q: int):
    """The query tile of grid program ``program`` (an int32 scalar).

    Sequence ``b`` (``b == batch``: the padding rows ``[query_start_loc[batch], num_tokens)``)
    owns the programs ``start(b) = query_start_loc[b] // block_q + b`` (``query_start_loc[b]``
    when ``block_q == 1``: one-token tiles never straddle two sequences, so each token is its
    own program, with no gap programs) to
    ``start(b) + ceil(q_len_b / block_q) - 1``. ``start`` is increasing, so the program's sequence
    is the number of ``b in [1, batch]`` with ``start(b) <= program`` (with ``block_q == 1``,
    empty sequences share their successor's start and the count lands on the owner): one vector
    load of the
    small ``query_start_loc`` and a sum (no chain of dependent scalar loads, as a binary search
    would take). Its tile is ``program - start(b)``, which may lie past the sequence's last tile
    (a gap program, with no rows).

    Args:
      qsl_ref: ``i32[batch + 1]``, the query start locations (any values: they are clamped into
        ``[0, num_tokens]``).

    Returns:
      ``(b, tile, first, end)`` as int32 scalars: the sequence, the tile index within it, and the
      sequence's rows ``[first, end)`` of ``q`` (``end = num_tokens`` for ``b == batch``).
    """
    index = jnp.arange(max(16, next_power_of_2(batch + 1)))  # i32[Bp]
    present = index <= batch
    starts = jnp.clip(plgpu.load(qsl_ref.at[index], mask=present, other=0), 0, num_tokens)
    gap = 0 if block_q == 1 else 1  # one-token tiles never straddle two sequences: no gaps
    before = present & (index >= 1) & (starts // block_q + gap * index <= program)
    b = jnp.sum(before.astype(jnp.int32))
    first = jnp.sum(jnp.where(index == b, starts, 0))
    end = jnp.where(b < batch, jnp.sum(jnp.where(index == b + 1, starts, 0)), num_tokens)
    return b, program - (first // block_q + gap * b), first, end


def interleave_short_programs(program, *, long_programs: int, batch: int):
    """Which tile space grid program ``program`` (an int32 scalar) belongs to, and its index there.

    With short tiles on, the query axis holds ``long_programs`` programs of ``block_q`` tiles and
    ``batch`` programs of one short tile each (program ``j`` of them: sequence ``j``). The short
    ones are spread evenly: every ``every = (long_programs + batch) // batch``-th program, the
    last of each run of ``every``, is short, so memory-bound short tiles (decode, speculative
    steps) run beside compute-bound long ones (prefill chunks) on the same multiprocessors,
    whatever the order of the sequences. Long program ``i`` is the ``i``-th program that is not
    short; the mapping is a bijection onto ``[0, long_programs) + [0, batch)``.

    Returns:
      ``(is_short, index)``: a bool scalar and the program's index in its tile space.
    """
    every = (long_programs + batch) // batch  # >= 1: long_programs >= batch + 1
    run = program // every
    is_short = (program % every == every - 1) & (run < batch)
    return is_short, jnp.where(is_short, run, program - jnp.minimum(run, batch))


def _ragged_attention_kernel(
    qsl_ref,     # i32[batch + 1]
    lens_ref,    # i32[batch]
    tables_ref,  # i32[batch, max_blocks]
    q_ref,       # [num_tokens * num_heads, head_dim]  (row t * num_heads + head)
    k_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]  (the cache, slot-major;
                 #  fp8_pairs: u16[..., head_dim / 2], two columns per word; fused: the one
                 #  cache [num_blocks * block_size, num_kv_heads, 2, head_dim], `slot_major`)
    v_ref,       # [num_blocks * block_size, num_kv_heads, head_dim]  (as k_ref; fused: k_ref)
    alibi_ref,   # f32[num_heads] or None
    sinks_ref,   # f32[num_heads] or None
    k_scale_ref,  # f32[1], the k_scale of an fp8 cache, or None
    v_scale_ref,  # f32[1], its v_scale, or None
    *out_refs,   # split:  o f32[num_tokens * kvh * splits * group, head_dim], m, l f32[same rows]
                 #         (row ((t * kvh + kv_head) * splits + split) * group + g)
                 # single: o [num_tokens * num_heads, head_dim] in q.dtype, lse f32[num_tokens * num_heads]
    scale: float,
    block_size: int,
    block_q: int,
    short_block_q: int,
    long_programs: int,
    block_k: int,
    num_splits: int,
    group: int,
    padded_dim: int,
    compute_dtype,
    soft_cap: float | None,
    window: int | None,
    fp8_pairs: bool,
    fused: bool,
    interpret: bool,
):
    program, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    batch = lens_ref.shape[0]
    head_dim = q_ref.shape[1]
    kv_heads = k_ref.shape[1]
    k_rows, v_rows = kv_rows(h, fused)
    num_heads = kv_heads * group
    num_tokens = q_ref.shape[0] // num_heads
    num_blocks = k_ref.shape[0] // block_size
    capacity = tables_ref.shape[1] * block_size

    def attend(b, tile, first_row, end_row, *, tile_q: int, owned):
        """Attention of query tile ``tile`` (of ``tile_q`` tokens) of sequence ``b`` (rows
        ``[first_row, end_row)`` of q), or nothing where ``owned`` is False."""
        dot_rows = tile_dot_rows(tile_q, group)
        # --- which rows: the tile's tokens and their positions --------------------------------
        table_row = jnp.minimum(b, batch - 1)
        n = jnp.where(b < batch, jnp.clip(lens_ref[table_row], 0, capacity), 0)
        q_len = end_row - first_row
        tile_queries = jnp.where(owned, jnp.clip(q_len - tile * tile_q, 0, tile_q), 0)
        first_pos = n - q_len + tile * tile_q  # position of the tile's first query

        rows = jnp.arange(dot_rows)  # [M]: query (rows // group) of the tile, head (rows % group)
        query, g = rows // group, rows % group
        row_real = (rows < tile_q * group) & (query < tile_queries)
        token = first_row + tile * tile_q + query  # i32[M]
        row_pos = first_pos + query  # i32[M], each row's position p
        head = h * group + g
        # [Dq], [Dq], [Dq] per part: the head's columns in one part, or the even and odd ones
        words, word_ok, part_cols = column_parts(padded_dim, head_dim, fp8_pairs=fp8_pairs)
        parts = len(part_cols)
        # Rows that are not real point one past the end: masked off, so never accessed
        # (interpret mode drops such out-of-range updates, where a duplicate real index would
        # race).
        q_row = jnp.where(row_real, token * num_heads + head, q_ref.shape[0])

        # --- which K/V tiles: causal and window skipping --------------------------------------
        plan = kv_tile_plan(first_pos, tile_queries, n, split, block_k=block_k,
                            num_splits=num_splits, window=window)
        key_lo, key_hi, shared_lo, shared_hi, loops = plan

        # --- the tile's queries ---------------------------------------------------------------
        qs = tuple(plgpu.load(q_ref.at[q_row[:, None], c[None, :]],
                              mask=row_real[:, None] & word_ok[None, :], other=0)
                   for c in part_cols)  # [M, Dq] each
        # The fp8 dequantization scales enter here (scores) and after the loops (values) only.
        score_scale = scale if k_scale_ref is None else k_scale_ref[0] * scale
        qs, score_scale = query_for_dots(qs, score_scale, compute_dtype)
        load_tile = functools.partial(load_kv_parts, words=words, fp8_pairs=fp8_pairs,
                                      interpret=interpret)
        if alibi_ref is not None:
            slopes = plgpu.load(alibi_ref.at[head], mask=row_real, other=0)  # f32[M]

        def tile_body(kv_tile, carry, *, masked: bool):
            accs, m_prev, l_prev = carry  # (f32[M, Dq],) * parts, f32[M], f32[M]
            pos = kv_tile * block_k + jnp.arange(block_k)  # i32[Tk], logical positions
            if masked:
                kv_ok = (pos >= key_lo) & (pos < key_hi)
                page = jnp.where(kv_ok, pos // block_size, 0)
                block = plgpu.load(tables_ref.at[table_row, page], mask=kv_ok, other=0)  # i32[Tk]
                kv_mask = kv_ok[:, None] & word_ok[None, :]
            else:  # every position of the tile is < n: its table entries are meaningful
                block = plgpu.load(tables_ref.at[table_row, pos // block_size])  # i32[Tk]
                kv_mask = None if padded_dim == head_dim else jnp.broadcast_to(
                    word_ok[None, :], (block_k, padded_dim // parts))
            block = jnp.clip(block, 0, num_blocks - 1)  # a garbage id can never leave the cache
            slot = block * block_size + pos % block_size  # i32[Tk]
            ks = load_tile(k_ref, slot, k_rows, mask=kv_mask)  # [Tk, Dq] each
            s = functools.reduce(jnp.add, [dot_nt(q, k.astype(compute_dtype))
                                           for q, k in zip(qs, ks)]) * score_scale  # f32[M, Tk]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            if alibi_ref is not None:
                s = s + slopes[:, None] * (pos[None, :] - row_pos[:, None]).astype(jnp.float32)
            if masked:
                sees = kv_ok[None, :] & (pos[None, :] <= row_pos[:, None])  # [M, Tk]
                if window is not None:
                    sees &= pos[None, :] > (row_pos - window)[:, None]
                s = jnp.where(sees, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, s.max(axis=1))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # all -inf so far: keep exp finite
            alpha = softmax_exp(m_prev - m_safe, interpret=interpret)  # f32[M]
            # f32[M, Tk], 0 where a row does not see a position
            p = softmax_exp(s - m_safe[:, None], interpret=interpret)
            vs = tuple(v.astype(compute_dtype)
                       for v in load_tile(v_ref, slot, v_rows, mask=kv_mask))  # [Tk, Dq] each
            if masked:  # a row with weight 0 for a NaN/Inf value row would still get 0 * NaN
                shared = (pos >= shared_lo) & (pos < shared_hi)
                # False for NaN and +-Inf
                vs = tuple(jnp.where(shared[:, None] | (jnp.abs(v.astype(jnp.float32)) < jnp.inf),
                                     v, jnp.zeros_like(v)) for v in vs)
            p_dot = p.astype(compute_dtype)
            accs = tuple(acc * alpha[:, None] + dot_nn(p_dot, v) for acc, v in zip(accs, vs))
            return accs, m_next, l_prev * alpha + p.sum(axis=1)

        carry = ((jnp.zeros((dot_rows, padded_dim // parts), jnp.float32),) * parts,
                 jnp.full((dot_rows,), -jnp.inf, jnp.float32),
                 jnp.zeros((dot_rows,), jnp.float32))
        masked_body = functools.partial(tile_body, masked=True)
        full_body = functools.partial(tile_body, masked=False)
        for (lo, hi), body in zip(loops, (masked_body, full_body, masked_body)):
            carry = jax.lax.fori_loop(lo, hi, body, carry)
        accs, m, l = carry
        if v_scale_ref is not None:
            accs = tuple(acc * v_scale_ref[0] for acc in accs)

        out_mask = row_real[:, None] & word_ok[None, :]
        if num_splits > 1:
            o_ref, m_ref, l_ref = out_refs
            split_row = ((token * kv_heads + h) * num_splits + split) * group + g
            split_row = jnp.where(row_real, split_row, m_ref.shape[0])
            for acc, c in zip(accs, part_cols):
                plgpu.store(o_ref.at[split_row[:, None], c[None, :]], acc, mask=out_mask)
            plgpu.store(m_ref.at[split_row], m, mask=row_real)
            plgpu.store(l_ref.at[split_row], l, mask=row_real)
            return

        has_keys = row_real & (row_pos >= 0)  # every real row with p >= 0 sees at least p itself
        if sinks_ref is not None:
            sink = plgpu.load(sinks_ref.at[head], mask=row_real, other=0)  # f32[M]
            accs, m, l = with_sink(accs, m, l, sink)
        o_ref, lse_ref = out_refs
        ok = has_keys & divides(l)
        for acc, c in zip(accs, part_cols):
            out = jnp.where(ok[:, None], acc / jnp.where(ok, l, 1.0)[:, None], 0.0)
            plgpu.store(o_ref.at[q_row[:, None], c[None, :]], out.astype(o_ref.dtype),
                        mask=out_mask)
        lse = jnp.where(has_keys, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
        plgpu.store(lse_ref.at[q_row], lse, mask=row_real)

    def attend_long(index):
        b, tile, first_row, end_row = find_query_tile(index, qsl_ref, batch=batch,
                                                      num_tokens=num_tokens, block_q=block_q)
        # sequences of at most short_block_q tokens belong to the short programs; the padding
        # pseudo-sequence (b == batch) always to the long ones
        owned = (b == batch) | (end_row - first_row > short_block_q)
        attend(b, tile, first_row, end_row, tile_q=block_q, owned=owned)

    if not short_block_q:
        attend_long(program)
        return
    is_short, index = interleave_short_programs(program, long_programs=long_programs,
                                                batch=batch)

    @pl.when(is_short)
    def _short():
        first_row = jnp.clip(qsl_ref[index], 0, num_tokens)
        end_row = jnp.clip(qsl_ref[index + 1], first_row, num_tokens)
        attend(index, 0, first_row, end_row, tile_q=short_block_q,
               owned=end_row - first_row <= short_block_q)

    @pl.when(jnp.logical_not(is_short))
    def _long():
        attend_long(index)


def paged_attention_pallas(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                           scale, config: AttentionConfig, interpret: bool, logits_soft_cap,
                           alibi_slopes, sliding_window, sinks, k_scale, v_scale,
                           fused: bool = False):
    """The kernel over the grid ``(query tiles, num_kv_heads, num_splits)``, then the split merge.

    Arguments as `pallas_paged.paged_attention` (validated, ``scale`` resolved to a float,
    indices int32, ``num_tokens >= 1``, ``batch >= 1``; ``k_scale`` / ``v_scale`` ``f32[]``
    operands or None, passed to the kernel as two ``f32[1]`` operands (`kernel_scale_operands`)
    so that the compiled kernel serves every scale). ``fused``: ``k_cache`` and ``v_cache`` are
    one fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]``, read in place.

    Returns:
      ``(out [num_tokens, num_heads, head_dim] in q.dtype, lse f32[num_tokens, num_heads])``.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kvh = k_cache.shape[1], num_kv_heads(k_cache.shape, fused)
    batch = block_tables.shape[0]
    group = num_heads // kvh
    splits = config.num_splits
    padded_dim = max(16, next_power_of_2(head_dim))
    fp8_pairs = uses_fp8_pairs(config.fp8_pairs, k_cache.dtype, head_dim)
    kernel = functools.partial(
        _ragged_attention_kernel, scale=scale, block_size=block_size, block_q=config.block_q,
        short_block_q=config.short_block_q,
        long_programs=config.long_query_tiles(num_tokens, batch), block_k=config.block_k,
        num_splits=splits, group=group, padded_dim=padded_dim,
        compute_dtype=dot_dtype(q.dtype, k_cache.dtype), soft_cap=logits_soft_cap,
        window=sliding_window, fp8_pairs=fp8_pairs, fused=fused, interpret=interpret)
    if splits > 1:
        rows = num_tokens * kvh * splits * group
        out_shape = (jax.ShapeDtypeStruct((rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.float32),
                     jax.ShapeDtypeStruct((rows,), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct((num_tokens * num_heads, head_dim), q.dtype),
                     jax.ShapeDtypeStruct((num_tokens * num_heads,), jnp.float32))
    name = (f"pallas_paged_ragged_bq{config.block_q}_sq{config.short_block_q}_bk{config.block_k}"
            f"_s{splits}_g{group}"
            f"_d{head_dim}_bs{block_size}" + ("_pairs" if fp8_pairs else "")
            + ("_fused" if fused else ""))
    outs = pl.pallas_call(
        kernel,
        grid=(config.query_tiles(num_tokens, batch), kvh, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name=name,
    )(query_start_loc.astype(jnp.int32), context_lens.astype(jnp.int32),
      block_tables.astype(jnp.int32), q.reshape(num_tokens * num_heads, head_dim),
      slot_major(k_cache, fp8_pairs=fp8_pairs, fused=fused),
      slot_major(v_cache, fp8_pairs=fp8_pairs, fused=fused),
      alibi_slopes, sinks, *kernel_scale_operands(k_scale, v_scale))
    if splits == 1:
        out, lse = outs
        return out.reshape(num_tokens, num_heads, head_dim), lse.reshape(num_tokens, num_heads)
    o, m, l = outs
    o = o.reshape(num_tokens, kvh, splits, group, head_dim)
    m = m.reshape(num_tokens, kvh, splits, group)
    l = l.reshape(num_tokens, kvh, splits, group)
    per_head = None if sinks is None else sinks.reshape(kvh, group)
    # a row that no split saw a key for (padding, or before the window) gives zeros, lse = -inf
    out, lse = merge_splits_pallas(o, m, l, None, per_head, out_dtype=q.dtype,
                                   interpret=interpret)
    return out.reshape(num_tokens, num_heads, head_dim), lse.reshape(num_tokens, num_heads)

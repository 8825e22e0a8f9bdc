"""What the Pallas Triton attention kernels (decode and ragged) share: the dots' operand dtype and
fp32 accumulation, the softmax's exp, the fp8 column-pair layout, K/V tile loads through the
slot-major cache, the sink, and the split-merge kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged._attention_common import divides, merged_max_and_sum
from pallas_paged._platform import next_power_of_2

MIN_DOT_ROWS = 16  # the smallest M of a Triton dot
FP16_SAFE_MAX = 2.0**15  # a bf16 query is scaled under this before its fp16 dot
HIGHEST = jax.lax.Precision.HIGHEST  # fp32 operands -> IEEE fp32 dot (Triton's default is TF32)


def dot_dtype(q_dtype, cache_dtype):
    """The operand dtype of the kernel's two dots (both accumulate in fp32).

    The query's dtype, except for fp8 caches with a bf16 query: fp8 -> fp16 is one packed
    conversion per two elements on sm_89+ where fp8 -> bf16 takes several, and fp16 holds every
    e4m3 value exactly, so the dots run in fp16. fp16 holds every bf16 value of magnitude
    2**-14 .. 2**15 exactly; the kernel divides the query by a power of two that brings it under
    2**15 (and multiplies the scores back), so only elements below 2**-14 of the largest lose
    bits, far under the rounding of the scores.
    """
    if jnp.dtype(cache_dtype) == jnp.dtype(jnp.float8_e4m3fn) and q_dtype != jnp.float32:
        return jnp.float16
    return jnp.dtype(q_dtype)


LOG2_E = 1.4426950408889634
# The heuristics' K tile (V's as many): about 16 KiB, so that K plus V of each tile in flight take
# about 32 KiB and several programs share a multiprocessor (docs/design/decode_triton.md).
K_TILE_BYTES = 16 * 1024


def softmax_exp(x, *, interpret: bool):
    """``e ** x`` (f32) for the kernels' online softmax.

    Compiled: ``2 ** (x * log2(e))`` with PTX's ``ex2.approx.ftz.f32``, one multiply and one
    hardware exp2 per element, where ``jnp.exp`` lowers to libdevice's ``expf`` (about 8
    instructions). Its relative error, a few units in
    fp32's last place (results under 2**-126 flush to 0), is of the order of the scores' own
    rounding. Interpret mode (no PTX): ``jnp.exp``.
    """
    if interpret:
        return jnp.exp(x)
    y = x * LOG2_E
    [out] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[y], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])
    return out


def fp8_pairs_to_f16(words, *, interpret: bool):
    """u16 words of two e4m3 values each (the even head column in the low byte, as a little-endian
    view of the fp8 cache's rows) -> ``(even, odd)`` columns, each f16 of the words' shape.

    Compiled: PTX ``cvt.rn.f16x2.e4m3x2``, one instruction per pair (exact: every e4m3 value,
    NaN included, is an fp16 value), two words per inline assembly: one byte permute brings the
    two words' low bytes together, and their high bytes, for the even and the odd output's
    conversions. The tiles reach the dots from 16-bit loads, so Triton lays the dots' operands
    out for 16-bit elements (two per register along K), where an fp8 load feeding a dot makes it
    take four. Interpret mode (no PTX): the bytes split with integer ops and converted by XLA.
    """
    if interpret:
        def convert(byte):
            return jax.lax.bitcast_convert_type(byte.astype(jnp.uint8),
                                                jnp.float8_e4m3fn).astype(jnp.float16)
        return convert(words & 0xFF), convert(words >> 8)
    # $1: words w0 (low half), w1; the permute 0x3120 orders the bytes w0.lo w1.lo w0.hi w1.hi
    asm = ("{ .reg .b32 lows_highs; .reg .b16 lows, highs; "
           "prmt.b32 lows_highs, $1, 0, 0x3120; mov.b32 {lows, highs}, lows_highs; "
           "cvt.rn.f16x2.e4m3x2 $0, %s; }")
    return tuple(
        plgpu.elementwise_inline_asm(
            asm % half, args=[words], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)])[0]
        for half in ("lows", "highs"))


def uses_fp8_pairs(fp8_pairs: bool, cache_dtype, head_dim: int) -> bool:
    """Whether a kernel reads its caches as column pairs: asked for, an fp8 cache, an even
    head_dim (elsewhere the option has no effect)."""
    return fp8_pairs and jnp.dtype(cache_dtype).itemsize == 1 and head_dim % 2 == 0


def slot_major(cache, *, fp8_pairs: bool, fused: bool = False):
    """A cache ``[num_blocks, block_size, heads, head_dim]`` as the kernels index it: ``[slots,
    kvh, head_dim]``, or for a fused cache ``[slots, kvh, 2, head_dim]`` (K of kv head ``h`` at
    ``[:, h, 0]``, V at ``[:, h, 1]``: `kv_rows`); with ``fp8_pairs`` u16 words of two
    neighbouring columns in the last axis, ``head_dim / 2`` of them (a bitcast: no copy).

    The fused cache keeps kv head ``h`` an index of its own rather than the combined heads
    ``2h`` and ``2h + 1``: the address then has the pair layout's form, which the Triton compiler
    turns into one wide multiply-add per row."""
    num_blocks, block_size, heads, head_dim = cache.shape
    rows = (num_blocks * block_size, *((heads // 2, 2) if fused else (heads,)))
    if not fp8_pairs:
        return cache.reshape(*rows, head_dim)
    pairs = cache.reshape(*rows, head_dim // 2, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint16)


def kv_rows(h, fused: bool):
    """The indices of kv head ``h``'s K rows and V rows after the slot in `slot_major`'s view:
    ``((h,), (h,))`` in separate caches, ``((h, 0), (h, 1))`` in a fused one."""
    return ((h, 0), (h, 1)) if fused else ((h,), (h,))


def column_parts(padded_dim: int, head_dim: int, *, fp8_pairs: bool):
    """The head's columns in the kernels' tiles: one part of all ``Dp = padded_dim`` columns, or
    with ``fp8_pairs`` two of ``Dq = Dp / 2``, the even and the odd columns.

    Returns:
      ``(words, word_ok, part_cols)``: ``words`` i32[Dq], the index of a tile's row in the
      `slot_major` cache (a column, or a word of two); ``word_ok`` bool[Dq], inside the head;
      ``part_cols``, per part the head columns i32[Dq] it holds (for q loads and output stores).
    """
    parts = 2 if fp8_pairs else 1
    words = jnp.arange(padded_dim // parts)
    return words, words < head_dim // parts, [parts * words + part for part in range(parts)]


def load_kv_parts(ref, slot, rows, words, mask, *, fp8_pairs: bool, interpret: bool):
    """A tile of K or V rows (slots ``slot`` i32[Tk] at ``rows``, `kv_rows`' indices of one kv
    head, in the `slot_major` cache ``ref``) as a tuple of its `column_parts` tiles [Tk, Dq]: with
    ``fp8_pairs`` the even and the odd columns in fp16, else the rows in the cache's dtype.
    ``mask`` bool[Tk, Dq] or None (masked elements are 0)."""
    other = None if mask is None else (0 if fp8_pairs else 0.0)  # u16 words, or floats
    tile = plgpu.load(ref.at[(slot[:, None], *rows, words[None, :])], mask=mask, other=other)
    return fp8_pairs_to_f16(tile, interpret=interpret) if fp8_pairs else (tile,)


def query_for_dots(qs, score_scale, compute_dtype):
    """Tiles of queries in the dots' operand dtype, and the factor their scores take.

    For fp16 dots over a bf16 (or fp32) query: bf16's range is wider than fp16's, so q is divided
    by a power of two that brings ``max |q|`` under 2**15 (exact), and the scores are multiplied
    back by it (see `dot_dtype`). ``qs`` may hold several tiles of one query (its even and odd
    head columns, `DecodeConfig.fp8_pairs`): they share the power of two.

    Returns:
      ``(tuple of the tiles in compute_dtype, score_scale)``.
    """
    if compute_dtype == jnp.float16 and qs[0].dtype != jnp.float16:
        qs = tuple(q.astype(jnp.float32) for q in qs)
        q_max = functools.reduce(jnp.maximum, [jnp.max(jnp.max(jnp.abs(q), axis=1), axis=0)
                                               for q in qs])
        q_shift = jnp.exp2(jnp.maximum(jnp.ceil(jnp.log2(q_max / FP16_SAFE_MAX)), 0.0))
        qs = tuple(q / q_shift for q in qs)
        score_scale = score_scale * q_shift
    return tuple(q.astype(compute_dtype) for q in qs), score_scale


def with_sink(accs, m, l, sink):
    """An online softmax's ``(accs, m, l)`` with one more logit ``sink`` per row and no value row.

    Args:
      accs: a tuple of ``f32[rows, D]`` accumulators of the rows (the head's columns, or parts of
        them); m, l, sink: ``f32[rows]``.
    """
    m_total = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_total)
    return (tuple(acc * correction[:, None] for acc in accs), m_total,
            l * correction + jnp.exp(sink - m_total))


def dot_nt(a, b):
    """``a @ b.T`` accumulated in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a @ b`` accumulated in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def kv_ring_depth(num_stages: int) -> int:
    """K (and V) tiles of one program in shared memory at once when Triton pipelines the tile
    loop with ``num_stages``: the loop's K/V loads are issued that many tiles ahead.

    Triton's pipeliner (its latency assignment, Triton 3.x) gives each load of a chain of
    dependent loads feeding a dot ``(num_stages - 1) // (loads in the chain)`` stages of lead;
    here the chain is two loads, a tile's block ids from the table, then the K/V rows they
    address. With ``num_stages = 2`` the table load is left out (no stage is left for it) and the
    K/V loads lead by one tile; from 3 the table load is pipelined too and the two share the
    stages, so 2, 3 and 4
    all keep **one** K/V tile in flight per program (issued after the tile before was consumed,
    so a program's copies do not overlap its own dots), 5 and 6 two, 7 and 8 three. 1: no
    pipelining (0). ``python -m benchmarks.profiling.triton_sass`` reads the depth of a compiled
    kernel from its Triton GPU IR, on the CPU.
    """
    if num_stages < 2:
        return 0
    return max(1, (num_stages - 1) // 2)


def _merge_splits_kernel(
    lens_ref,   # i32[batch] (decode's clamped lengths), or None: a row is present if any split saw a key
    o_ref,      # f32[batch, kvh, splits, group, head_dim], each split's unnormalized weighted sum
    m_ref,      # f32[batch, kvh, splits, group], each split's running max
    l_ref,      # f32[batch, kvh, splits, group], each split's sum of exponentials
    sinks_ref,  # f32[kvh, group] or None
    out_ref,    # [batch, kvh, group, head_dim] in the output dtype
    lse_ref,    # f32[batch, kvh, group]
    *,
    padded_splits: int,
    padded_dim: int,
):
    """`merge_splits` for one (row, kv head, query head of its group): its ``splits`` partial
    results, loaded at once, combined in fp32."""
    b, h, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_splits, head_dim = o_ref.shape[2], o_ref.shape[4]
    splits = jnp.arange(padded_splits)  # [Sp]
    split_ok = splits < num_splits
    cols = jnp.arange(padded_dim)  # [Dp]
    col_ok = cols < head_dim
    m = plgpu.load(m_ref.at[b, h, splits, g], mask=split_ok, other=-jnp.inf)  # f32[Sp]
    l = plgpu.load(l_ref.at[b, h, splits, g], mask=split_ok, other=0.0)  # f32[Sp]
    m_seen = jnp.max(m)
    m_total, l_total, weight = merged_max_and_sum(  # f32[], f32[], f32[Sp]
        m, l, m_seen, None if sinks_ref is None else sinks_ref[h, g])
    # ragged rows: present if a split saw a key, or a NaN (whose max the GPU's max may skip)
    present = ((lens_ref[b] > 0) if lens_ref is not None
               else (m_seen > -jnp.inf) | jnp.isnan(l_total))
    o = plgpu.load(o_ref.at[b, h, splits[:, None], g, cols[None, :]],
                   mask=split_ok[:, None] & col_ok[None, :], other=0.0)  # f32[Sp, Dp]
    o_total = jnp.sum(weight[:, None] * o, axis=0)  # f32[Dp]
    ok = present & divides(l_total)
    out = jnp.where(ok, o_total / jnp.where(ok, l_total, 1.0), 0.0)
    plgpu.store(out_ref.at[b, h, g, cols], out.astype(out_ref.dtype), mask=col_ok)
    lse_ref[b, h, g] = jnp.where(present, m_total + jnp.log(l_total), -jnp.inf)


def merge_splits_pallas(o, m, l, lens, sinks, *, out_dtype, interpret: bool):
    """`merge_splits` as one Pallas kernel (one launch, where XLA's reductions take several), one
    program per (row, kv head, query head).

    Args:
      o: f32[rows, kvh, splits, group, head_dim]; m, l: f32[rows, kvh, splits, group].
      lens: i32[rows], decode's clamped lengths (a row with ``n == 0`` gives zeros and ``lse =
        -inf``), or None (ragged rows: a row that no split saw a key for gives those).
      sinks: f32[kvh, group] or None.
      out_dtype: the dtype of ``out``.

    Returns:
      ``(out [rows, kvh, group, head_dim] in out_dtype, lse f32[rows, kvh, group])``.
    """
    rows, kvh, splits, group, head_dim = o.shape
    kernel = functools.partial(_merge_splits_kernel, padded_splits=max(16, next_power_of_2(splits)),
                               padded_dim=max(16, next_power_of_2(head_dim)))
    return pl.pallas_call(
        kernel,
        grid=(rows, kvh, group),
        out_shape=(jax.ShapeDtypeStruct((rows, kvh, group, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((rows, kvh, group), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"pallas_paged_merge_s{splits}_g{group}_d{head_dim}",
    )(lens, o, m, l, sinks)

"""The float64 numpy oracle of SPEC.md: the one truth that tests, parity and benchmarks compare with.

Written from SPEC.md alone and shares no code with any implementation under test (torch_ref, the
XLA path, the Pallas kernels): plain numpy in float64, reading the cache position by position
through the block table. Everything takes and returns numpy arrays (any float dtype numpy or
ml_dtypes knows, fp8 included).

- `oracle_ragged_attention`: ragged paged attention (causal over each sequence's new tokens) with
  every extension, in float64; `oracle_paged_attention` is its one-query-per-sequence case, decode.
- `oracle_write_kv`: the cache write as a loop over tokens; give it raw-bit views (e.g.
  ``t.view(torch.int16).numpy()``) and compare the result bit for bit.
- `oracle_quantize_fp8` / `fp8_e4m3fn_to_float`: the fp8 store (fp32 division, clamp to +-448,
  round to nearest even) and the decoding of float8_e4m3fn codes, from the bit layout alone.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "FP8_MAX",
    "fp8_e4m3fn_to_float",
    "oracle_paged_attention",
    "oracle_quantize_fp8",
    "oracle_ragged_attention",
    "oracle_write_kv",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn value: 0b0_1111_110 = 1.75 * 2**8


def _float64(x) -> np.ndarray:
    """``x`` as float64 (fp8 and bf16 through float32, which holds them exactly)."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":  # ml_dtypes (bfloat16, float8_*)
        x = x.astype(np.float32)
    return x.astype(np.float64)


QUERY_CHUNK = 256  # queries of one sequence the ragged oracle takes at once (bounds its memory)


def oracle_paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, *,
                           logits_soft_cap=None, alibi_slopes=None, sliding_window=None,
                           sinks=None, k_scale=None, v_scale=None):
    """Paged decode attention of SPEC.md in float64: `oracle_ragged_attention` with one query per
    sequence (``query_start_loc = arange(B + 1)``), SPEC's definition of decode.

    Args:
      q: ``[B, H, D]`` floats; the rest as `oracle_ragged_attention`.

    Returns:
      ``(out [B, H, D] float64, lse [B, H] float64)``; zero-length rows give zeros and ``-inf``.
    """
    batch = np.shape(q)[0]
    return oracle_ragged_attention(
        q, k_cache, v_cache, block_tables, context_lens, np.arange(batch + 1), scale,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale)


def oracle_ragged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale=None, *, logits_soft_cap=None, alibi_slopes=None,
                            sliding_window=None, sinks=None, k_scale=None, v_scale=None):
    """Ragged paged attention of SPEC.md in float64.

    Sequence ``b`` with ``n = context_lens[b]`` owns the rows ``query_start_loc[b] ..
    query_start_loc[b + 1] - 1`` of ``q``; its query ``i`` sits at position
    ``p = n - q_len_b + i`` and sees the positions ``j <= p`` (with a window, ``j > p - W``).
    Position ``j`` lives in physical block ``block_tables[b, j // block_size]`` at row
    ``j % block_size``; query head ``h`` uses kv head ``h // (H // KVH)``; ALiBi adds
    ``slope[h] * (j - p)``. Only positions that some query of the sequence sees are read, so
    nothing else of the cache or of the table is touched: unused slots may hold NaN and table tails
    garbage ids. One sequence at a time, its queries in chunks of `QUERY_CHUNK`, vectorized over
    queries, heads and positions (the products as float64 matrix products, each kv head's group of
    query heads in one); each row's softmax is taken against its maximum (the sink included).
    Rows past ``query_start_loc[B]`` stay zeros and ``-inf``.

    Args:
      q: ``[num_tokens, H, D]`` floats.
      k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` floats (fp8 codes as
        ``ml_dtypes.float8_e4m3fn`` or already decoded, e.g. ``cache.float().numpy()``): numpy,
        or any array that numpy integer arrays index, such as a JAX device array, of which only
        the rows read are fetched (a cache of many GB costs what its sequences read).
      block_tables: ``[B, max_blocks]`` ints. context_lens: ``[B]`` ints.
      query_start_loc: ``[B + 1]`` ints.
      scale: None means ``1 / sqrt(D)``.
      logits_soft_cap, alibi_slopes ``[H]``, sliding_window, sinks ``[H]``, k_scale, v_scale: as in
        SPEC.md's Extensions (the fp8 scales multiply the stored values).

    Returns:
      ``(out [num_tokens, H, D] float64, lse [num_tokens, H] float64)``.
    """
    q = _float64(q)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_mult = 1.0 if k_scale is None else float(k_scale)
    v_mult = 1.0 if v_scale is None else float(v_scale)
    slopes = None if alibi_slopes is None else _float64(alibi_slopes).reshape(num_heads)
    sink = None if sinks is None else _float64(sinks).reshape(num_heads)
    tables = np.asarray(block_tables).astype(np.int64)
    lens = np.asarray(context_lens).astype(np.int64)
    starts = np.asarray(query_start_loc).astype(np.int64)
    out = np.zeros((num_tokens, num_heads, head_dim), dtype=np.float64)
    lse = np.full((num_tokens, num_heads), -np.inf, dtype=np.float64)
    for b in range(len(lens)):
        n, lo, hi = int(lens[b]), int(starts[b]), int(starts[b + 1])
        if hi <= lo or n <= 0:
            continue
        query_pos = np.arange(n - (hi - lo), n, dtype=np.int64)        # [Q]
        first = 0 if sliding_window is None else max(0, int(query_pos[0]) - int(sliding_window) + 1)
        positions = np.arange(first, n, dtype=np.int64)                  # [P]
        seen = positions[None, :] <= query_pos[:, None]                  # [Q, P]
        if sliding_window is not None:
            seen &= positions[None, :] > (query_pos - int(sliding_window))[:, None]
        blocks, rows = tables[b, positions // block_size], positions % block_size
        keys = _float64(k_cache[blocks, rows]) * k_mult                  # [P, KVH, D]
        values = _float64(v_cache[blocks, rows]) * v_mult                # [P, KVH, D]
        values = np.where(seen.any(axis=0)[:, None, None], values, 0.0)  # unseen rows never enter
        keys_t = keys.transpose(1, 2, 0)                                 # [KVH, D, P]
        values_k = values.transpose(1, 0, 2)                             # [KVH, P, D]
        for c in range(0, hi - lo, QUERY_CHUNK):
            rows_c = slice(c, min(c + QUERY_CHUNK, hi - lo))             # C queries
            pos_c, seen_c = query_pos[rows_c], seen[rows_c]
            chunk = pos_c.shape[0]
            # Query head h = k * group + g uses kv head k: the group's heads share one product.
            q_c = q[lo:hi][rows_c].reshape(chunk, num_kv_heads, group, head_dim)
            q_k = q_c.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * chunk, head_dim)
            s = np.matmul(q_k, keys_t).reshape(num_heads, chunk, -1) * scale    # [H, C, P]
            if logits_soft_cap is not None:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            if slopes is not None:
                s = s + slopes[:, None, None] * (positions[None, :] - pos_c[:, None])[None]
            s = np.where(seen_c[None], s, -np.inf)
            m = s.max(axis=2)                                            # [H, C]
            if sink is not None:
                m = np.maximum(m, sink[:, None])
            weights = np.where(seen_c[None], np.exp(s - m[..., None]), 0.0)
            denom = weights.sum(axis=2)
            if sink is not None:
                denom = denom + np.exp(sink[:, None] - m)
            out_c = np.matmul(weights.reshape(num_kv_heads, group * chunk, -1), values_k)
            out_c = out_c.reshape(num_heads, chunk, head_dim) / denom[..., None]  # [H, C, D]
            out[lo + rows_c.start:lo + rows_c.stop] = out_c.transpose(1, 0, 2)
            lse[lo + rows_c.start:lo + rows_c.stop] = (m + np.log(denom)).T
    return out, lse


def oracle_write_kv(k_cache, v_cache, k, v, slot_mapping):
    """The cache write, one token at a time, on copies: ``(new_k_cache, new_v_cache)``.

    Works on any dtype, so raw-bit views give a bit-exact expectation. Slot ``-1`` writes nothing;
    any other slot outside ``[0, num_blocks * block_size)`` is an error here too.
    """
    k_cache, v_cache = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    num_blocks, block_size = k_cache.shape[:2]
    for i, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot == -1:
            continue
        if not 0 <= slot < num_blocks * block_size:
            raise ValueError(f"slot_mapping[{i}]={slot} is out of range")
        k_cache[slot // block_size, slot % block_size] = k[i]
        v_cache[slot // block_size, slot % block_size] = v[i]
    return k_cache, v_cache


def fp8_e4m3fn_to_float(codes):
    """Decode float8_e4m3fn bit patterns (``uint8``) to float64: 1 sign, 4 exponent (bias 7) and 3
    mantissa bits; exponent 0 is subnormal (``m/8 * 2**-6``); ``S.1111.111`` is NaN; no infinities.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    out = np.empty(codes.shape, dtype=np.float64)
    for idx, code in np.ndenumerate(codes):
        code = int(code)
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            out[idx] = math.nan
        elif exponent == 0:
            out[idx] = sign * mantissa / 8.0 * 2.0 ** -6
        else:
            out[idx] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return out


_FP8_POSITIVE = fp8_e4m3fn_to_float(np.arange(0x7F, dtype=np.uint8))  # codes 0..126, increasing


def oracle_quantize_fp8(x, scale):
    """The fp8 store of SPEC.md: ``clamp(x / scale, -448, 448)`` with the division in fp32, then
    rounded to the nearest float8_e4m3fn value, ties to the even code. Returns ``uint8`` codes.
    NaN inputs are not part of the contract and are refused here.
    """
    x = np.asarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError("oracle_quantize_fp8 takes no NaN")
    scaled = np.clip(x / np.float32(scale), -FP8_MAX, FP8_MAX).astype(np.float64)
    codes = np.empty(scaled.shape, dtype=np.uint8)
    for idx, value in np.ndenumerate(scaled):
        magnitude = abs(value)
        hi = int(np.searchsorted(_FP8_POSITIVE, magnitude))  # first grid value >= magnitude
        if hi < len(_FP8_POSITIVE) and _FP8_POSITIVE[hi] == magnitude:
            code = hi
        else:
            lo = hi - 1
            below, above = magnitude - _FP8_POSITIVE[lo], _FP8_POSITIVE[hi] - magnitude
            code = lo if below < above else hi if above < below else (lo if lo % 2 == 0 else hi)
        codes[idx] = code | (0x80 if math.copysign(1.0, value) < 0 else 0)
    return codes

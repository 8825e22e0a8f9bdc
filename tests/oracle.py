"""A float64 numpy oracle of SPEC.md, shared by the test files of every implementation.

Written from SPEC.md alone, as plain loops (one sequence, head and position at a time), so that it
shares no code, no vectorization and no precision shortcut with any implementation under test.
Everything takes and returns numpy arrays.

- `oracle_paged_attention`: decode attention with every extension, in float64.
- `oracle_ragged_attention`: ragged (causal, several new tokens per sequence) paged attention.
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


def oracle_paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, *,
                           logits_soft_cap=None, alibi_slopes=None, sliding_window=None,
                           sinks=None, k_scale=None, v_scale=None):
    """Paged decode attention of SPEC.md in float64, read literally.

    For sequence ``b`` with ``n = context_lens[b]``, position ``p`` lives in physical block
    ``block_tables[b, p // block_size]`` at row ``p % block_size``; query head ``h`` uses kv head
    ``h // (H // KVH)``. Only the positions that take part are ever read (the newest ``min(W, n)``
    with a sliding window), so nothing else of the cache or of the table is touched.

    Args:
      q: ``[B, H, D]`` floats.
      k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` floats (for an fp8 cache: the stored
        values decoded to float, e.g. ``cache.float().numpy()``).
      block_tables: ``[B, max_blocks]`` ints. context_lens: ``[B]`` ints.
      scale: None means ``1 / sqrt(D)``.
      logits_soft_cap, alibi_slopes ``[H]``, sliding_window, sinks ``[H]``, k_scale, v_scale: as in
        SPEC.md's Extensions.

    Returns:
      ``(out [B, H, D] float64, lse [B, H] float64)``; zero-length rows give zeros and ``-inf``.
    """
    q = np.asarray(q, dtype=np.float64)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_mult = 1.0 if k_scale is None else float(k_scale)
    v_mult = 1.0 if v_scale is None else float(v_scale)
    out = np.zeros((batch, num_heads, head_dim), dtype=np.float64)
    lse = np.full((batch, num_heads), -np.inf, dtype=np.float64)
    for b in range(batch):
        n = int(context_lens[b])
        positions = [p for p in range(n) if sliding_window is None or p > n - 1 - sliding_window]
        for h in range(num_heads):
            kv_head = h // group
            logits, values = [], []
            for p in positions:
                block = int(block_tables[b, p // block_size])
                row = p % block_size
                key = np.asarray(k_cache[block, row, kv_head], dtype=np.float64) * k_mult
                s = float(np.dot(q[b, h], key)) * scale
                if logits_soft_cap is not None:
                    s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                if alibi_slopes is not None:
                    s += float(alibi_slopes[h]) * (p - (n - 1))
                logits.append(s)
                values.append(np.asarray(v_cache[block, row, kv_head], dtype=np.float64) * v_mult)
            if not logits:
                continue  # n == 0: zeros and -inf, with or without a sink
            m = max(logits)
            if sinks is not None:
                m = max(m, float(sinks[h]))
            weights = [math.exp(s - m) for s in logits]
            denom = math.fsum(weights)
            if sinks is not None:
                denom += math.exp(float(sinks[h]) - m)
            acc = np.zeros(head_dim, dtype=np.float64)
            for w, value in zip(weights, values):
                acc += w * value
            out[b, h] = acc / denom
            lse[b, h] = m + math.log(denom)
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


def oracle_ragged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                            scale=None, *, logits_soft_cap=None, alibi_slopes=None,
                            sliding_window=None, sinks=None, k_scale=None, v_scale=None):
    """Ragged paged attention of SPEC.md in float64, read literally.

    Sequence ``b`` owns the rows ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of ``q``;
    its query ``i`` sits at position ``p = context_lens[b] - q_len_b + i`` and sees the positions
    ``j <= p`` (with a window, ``j > p - W``), read through the block table one at a time. ALiBi
    adds ``slope[h] * (j - p)``. Rows past ``query_start_loc[batch]`` stay zeros and ``-inf``.

    Args:
      q: ``[num_tokens, H, D]`` floats; query_start_loc: ``[B + 1]`` ints; the rest as
        `oracle_paged_attention`.

    Returns:
      ``(out [num_tokens, H, D] float64, lse [num_tokens, H] float64)``.
    """
    q = np.asarray(q, dtype=np.float64)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_mult = 1.0 if k_scale is None else float(k_scale)
    v_mult = 1.0 if v_scale is None else float(v_scale)
    out = np.zeros((num_tokens, num_heads, head_dim), dtype=np.float64)
    lse = np.full((num_tokens, num_heads), -np.inf, dtype=np.float64)
    for b in range(len(context_lens)):
        n = int(context_lens[b])
        first, last = int(query_start_loc[b]), int(query_start_loc[b + 1])
        for i, row in enumerate(range(first, last)):
            p = n - (last - first) + i
            seen = [j for j in range(p + 1) if sliding_window is None or j > p - sliding_window]
            for h in range(num_heads):
                kv_head = h // group
                logits, values = [], []
                for j in seen:
                    block, offset = int(block_tables[b, j // block_size]), j % block_size
                    key = np.asarray(k_cache[block, offset, kv_head], dtype=np.float64) * k_mult
                    s = float(np.dot(q[row, h], key)) * scale
                    if logits_soft_cap is not None:
                        s = logits_soft_cap * math.tanh(s / logits_soft_cap)
                    if alibi_slopes is not None:
                        s += float(alibi_slopes[h]) * (j - p)
                    logits.append(s)
                    values.append(np.asarray(v_cache[block, offset, kv_head], dtype=np.float64)
                                  * v_mult)
                if not logits:
                    continue
                m = max(logits)
                if sinks is not None:
                    m = max(m, float(sinks[h]))
                weights = [math.exp(s - m) for s in logits]
                denom = math.fsum(weights)
                if sinks is not None:
                    denom += math.exp(float(sinks[h]) - m)
                acc = np.zeros(head_dim, dtype=np.float64)
                for w, value in zip(weights, values):
                    acc += w * value
                out[row, h] = acc / denom
                lse[row, h] = m + math.log(denom)
    return out, lse

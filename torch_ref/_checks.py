"""Input validation shared by `torch_ref.write_kv` and the attention functions.

Every check raises `ValueError` naming the argument and showing the offending shapes, dtypes or
values. All checks run before anything is written, so a rejected call leaves the cache unchanged.
"""

from __future__ import annotations

import math

import torch

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPE = torch.float8_e4m3fn
FP32_MAX = torch.finfo(torch.float32).max


def _is_python_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_float(name: str, value) -> None:
    """A python float, finite, > 0 and representable in float32."""
    if not _is_python_number(value):
        raise ValueError(f"{name} must be a python float, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= FP32_MAX):
        raise ValueError(f"{name}={value} must be finite and > 0 (and at most float32's max)")


# fp8 scales: within [2**-60, 2**60] (SPEC.md). Inside this range every backend's write can give
# torch's bits (a correctly rounded fp32 division, whose quotients and divisor stay normal); outside
# it, XLA on a CPU, which flushes fp32 subnormals, could not. pallas_paged refuses the same range.
FP8_SCALE_RANGE = (2.0**-60, 2.0**60)


def check_fp8_scale_value(name: str, number: float) -> None:
    lo, hi = FP8_SCALE_RANGE
    if not (math.isfinite(number) and lo <= number <= hi):
        raise ValueError(f"{name}={number} must be finite and in [2**-60, 2**60]")


def check_fp8_scale(name: str, value) -> None:
    """A per-tensor fp8 scale: a python float or a float32 tensor of shape () or (1,), in
    `FP8_SCALE_RANGE`."""
    if _is_python_number(value):
        check_fp8_scale_value(name, value)
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a python float or a float32 scalar tensor, got"
                         f" {type(value).__name__}")
    if tuple(value.shape) not in ((), (1,)) or value.dtype != torch.float32:
        raise ValueError(f"{name} must be a python float or a float32 tensor of shape () or (1,),"
                         f" got {name}.shape={tuple(value.shape)}, {name}.dtype={value.dtype}")
    check_fp8_scale_value(name, float(value.reshape(())))


def check_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got {name}.shape={tuple(x.shape)}")


def check_index_dtype(name: str, x: torch.Tensor) -> None:
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {name}.dtype={x.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_caches(k_cache, v_cache) -> None:
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got k_cache.shape={tuple(k_cache.shape)}"
            f" and v_cache.shape={tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must have the same dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"k_cache.dtype={k_cache.dtype} is not one of {CACHE_DTYPES}")
    if min(k_cache.shape) < 1:
        raise ValueError(f"k_cache.shape={tuple(k_cache.shape)} must have every dimension >= 1")


def check_fp8_scales(cache_dtype: torch.dtype, k_scale, v_scale) -> None:
    """fp8 caches need both per-tensor scales; other caches take none."""
    if cache_dtype == FP8_DTYPE:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{name} is required for a float8_e4m3fn cache")
            check_fp8_scale(name, s)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale / v_scale apply to float8_e4m3fn caches only, got a {cache_dtype} cache with"
            f" k_scale={k_scale}, v_scale={v_scale}")


def first_index(mask: torch.Tensor) -> int:
    """Index of the first True entry of a 1-D bool tensor (which must have one)."""
    return int(torch.nonzero(mask)[0, 0])


def check_write_inputs(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale) -> None:
    check_caches(k_cache, v_cache)
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    check_tensor("slot_mapping", slot_mapping, 1)
    check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    num_blocks, block_size, kvh, d = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != (num_tokens, kvh, d):
            raise ValueError(
                f"{name}.shape={tuple(x.shape)} must be [num_tokens, num_kv_heads, head_dim] ="
                f" {(num_tokens, kvh, d)} (slot_mapping.shape={tuple(slot_mapping.shape)},"
                f" k_cache.shape={tuple(k_cache.shape)})")
    check_fp8_scales(k_cache.dtype, k_scale, v_scale)
    check_scale_device(k_scale, v_scale, k_cache.device)
    for name, x in (("k", k), ("v", v)):
        if k_cache.dtype == FP8_DTYPE:
            if x.dtype not in QUERY_DTYPES:
                raise ValueError(f"{name}.dtype={x.dtype} must be one of {QUERY_DTYPES} for an fp8 cache")
        elif x.dtype != k_cache.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} must equal k_cache.dtype={k_cache.dtype}")
    check_index_dtype("slot_mapping", slot_mapping)

    num_slots = num_blocks * block_size
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        i = first_index(bad)
        raise ValueError(
            f"slot_mapping[{i}]={int(slot_mapping[i])} is out of range: slots must be -1 (padding)"
            f" or in [0, num_blocks * block_size) = [0, {num_slots})")
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.numel() > 1:
        sorted_slots, order = torch.sort(slots, stable=True)
        repeated = sorted_slots[1:] == sorted_slots[:-1]
        if bool(repeated.any()):
            token_ids = torch.nonzero(valid)[:, 0]
            # The later of the two tokens sharing a slot, in token order.
            j = first_index(repeated)
            later = int(token_ids[torch.maximum(order[j], order[j + 1])])
            raise ValueError(
                f"slot_mapping[{later}]={int(slot_mapping[later])} is a duplicate: every slot may be"
                " written by one token only")


def check_attention_options(num_heads: int, logits_soft_cap, alibi_slopes, sliding_window,
                            sinks, device: torch.device) -> None:
    if logits_soft_cap is not None:
        check_positive_float("logits_soft_cap", logits_soft_cap)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise ValueError(f"sliding_window must be a python int, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != (num_heads,):
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [num_heads] = ({num_heads},)")
        if x.dtype != torch.float32:
            raise ValueError(f"{name}.dtype={x.dtype} must be float32")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, q is on {device}")


def check_scale(scale) -> None:
    if scale is None:
        return
    if not _is_python_number(scale):
        raise ValueError(f"scale must be a python float or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and abs(scale) <= FP32_MAX):
        raise ValueError(f"scale={scale} must be finite (in float32)")


def check_scale_device(k_scale, v_scale, device: torch.device) -> None:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, torch.Tensor) and s.device != device:
            raise ValueError(f"{name} is on {s.device}, the cache is on {device}")


def check_query(q, head_dim: int, num_kv_heads: int, kv_dtype: torch.dtype) -> None:
    """q's rank, dtype (that of the K/V, or any query dtype over an fp8 cache) and head counts."""
    check_tensor("q", q, 3)
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} must be one of {QUERY_DTYPES}")
    if kv_dtype != FP8_DTYPE and q.dtype != kv_dtype:
        raise ValueError(
            f"q.dtype={q.dtype} must equal k_cache.dtype={kv_dtype}: mixed query / cache float"
            " dtypes are refused (only a float8_e4m3fn cache takes a float32, bfloat16 or float16 q)")
    _, num_heads, d = q.shape
    if d != head_dim:
        raise ValueError(f"head_dim mismatch: q.shape={tuple(q.shape)} but the K/V head_dim is {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads: q.shape={tuple(q.shape)} has {num_heads}"
            f" heads, the K/V have {num_kv_heads}")


def check_lengths(context_lens, batch: int) -> None:
    check_tensor("context_lens", context_lens, 1)
    check_index_dtype("context_lens", context_lens)
    if context_lens.shape[0] != batch:
        raise ValueError(
            f"context_lens.shape={tuple(context_lens.shape)} must be [batch] = ({batch},)")
    negative = context_lens < 0
    if bool(negative.any()):
        b = first_index(negative)
        raise ValueError(f"context_lens[{b}]={int(context_lens[b])} must be >= 0")


def check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                        options: dict) -> None:
    check_caches(k_cache, v_cache)
    num_blocks, block_size, kvh, d = k_cache.shape
    check_query(q, d, kvh, k_cache.dtype)
    check_tensor("block_tables", block_tables, 2)
    check_index_dtype("block_tables", block_tables)
    check_tensor("context_lens", context_lens, 1)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      context_lens=context_lens)
    batch = q.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: q.shape={tuple(q.shape)} but block_tables.shape={tuple(block_tables.shape)}")
    check_lengths(context_lens, batch)
    check_scale(scale)
    check_fp8_scales(k_cache.dtype, k_scale, v_scale)
    check_scale_device(k_scale, v_scale, k_cache.device)
    check_attention_options(q.shape[1], device=q.device, **options)

    capacity = block_tables.shape[1] * block_size
    too_long = context_lens > capacity
    if bool(too_long.any()):
        b = first_index(too_long)
        raise ValueError(
            f"context_lens[{b}]={int(context_lens[b])} exceeds the table's capacity max_blocks *"
            f" block_size = {block_tables.shape[1]} * {block_size} = {capacity}")
    # Only the first ceil(n / block_size) entries of each row are meaningful.
    num_used = (context_lens.to(torch.int64) + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_used[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {i}]={int(block_tables[b, i])} is outside [0, num_blocks) ="
            f" [0, {num_blocks}) in the valid part of row {b} (context_lens[{b}]={int(context_lens[b])})")


def check_dense_inputs(q, k, v, context_lens, scale, options: dict) -> None:
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    if k.shape != v.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must match")
    if k.dtype != v.dtype or k.dtype not in QUERY_DTYPES:
        raise ValueError(f"k.dtype={k.dtype} and v.dtype={v.dtype} must be one of {QUERY_DTYPES} and equal")
    batch, max_len, kvh, d = k.shape
    check_query(q, d, kvh, k.dtype)
    check_tensor("context_lens", context_lens, 1)
    check_same_device(q=q, k=k, v=v, context_lens=context_lens)
    if q.shape[0] != batch:
        raise ValueError(f"batch mismatch: q.shape={tuple(q.shape)} but k.shape={tuple(k.shape)}")
    check_lengths(context_lens, batch)
    check_scale(scale)
    check_attention_options(q.shape[1], device=q.device, **options)
    too_long = context_lens > max_len
    if bool(too_long.any()):
        b = first_index(too_long)
        raise ValueError(f"context_lens[{b}]={int(context_lens[b])} exceeds k.shape[1]={max_len}")

"""Writing new tokens' K/V into the paged cache."""

from __future__ import annotations

import torch

from torch_ref import _checks

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """`clamp(x / scale, -448, 448)` in fp32, cast to float8_e4m3fn (round to nearest even).

    ``scale`` is a python float (rounded to fp32) or a float32 tensor of shape () or (1,). The
    division is one IEEE fp32 division per element, so every framework that divides in fp32 and
    rounds to nearest even stores the same bits. NaN stays NaN.
    """
    divisor = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
    scaled = x.to(torch.float32) / divisor
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Store each new token's K and V at its physical slot, in place.

    A slot is a flat position in the cache: ``slot = block * block_size + offset``, so token ``i``
    with ``s = slot_mapping[i] >= 0`` lands at ``k_cache[s // block_size, s % block_size]`` (and the
    same place of ``v_cache``). A slot of ``-1`` marks a padding token: it writes nothing, anywhere.
    Every other cache entry keeps its exact bits.

    Worked example, ``block_size = 16``::

        slot_mapping = [37, -1, 16]
        # token 0 -> block 37 // 16 = 2, offset 37 % 16 = 5: k_cache[2, 5] = k[0]
        # token 1 -> padding, nothing is written (a raw -1 index would hit k_cache[-1, -1])
        # token 2 -> block 1, offset 0:                       k_cache[1, 0] = k[2]

    The write is one vectorized masked scatter; no Python loop over tokens.

    fp8 caches (``float8_e4m3fn``) store ``clamp(k / k_scale, -448, 448)`` rounded to nearest even,
    the division done in fp32; ``k`` and ``v`` are then fp32 / bf16 / fp16.

    Args:
      k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32 / bf16 / fp16 / fp8.
      v_cache: same shape and dtype as ``k_cache``.
      k: ``[num_tokens, num_kv_heads, head_dim]``, the cache dtype (any float dtype for fp8 caches).
      v: same shape as ``k``.
      slot_mapping: ``i32[num_tokens]`` or ``i64[num_tokens]``, the slot of each token or ``-1``.
      k_scale, v_scale: per-tensor scales, python floats or float32 tensors of shape () or (1,)
        (finite, > 0), required for fp8 caches and refused otherwise.

    Raises:
      ValueError: wrong ranks, shapes, dtypes or devices; a slot ``< -1`` or
        ``>= num_blocks * block_size``; two tokens with the same slot; missing or unexpected fp8
        scales. The message names the argument and the first offending token index, and the cache
        is unchanged.
    """
    _checks.check_write_inputs(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    new_k, new_v = k[valid], v[valid]
    if k_cache.dtype == _checks.FP8_DTYPE:
        new_k, new_v = quantize_fp8(new_k, k_scale), quantize_fp8(new_v, v_scale)
    k_cache[blocks, offsets] = new_k
    v_cache[blocks, offsets] = new_v

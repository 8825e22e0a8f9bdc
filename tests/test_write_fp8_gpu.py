"""The fp8 cache write on a GPU, at a realistic size: bit for bit `torch_ref.write_kv` run by torch
on the same GPU.

16384 tokens (8 kv heads, head_dim 128) into float8_e4m3fn caches of 16384 blocks of 16 slots,
written by one jitted call of `WRITES` writes (the caches donated, each write to its own set of
random slots), from bf16 and from fp32 rows that mix N(0, 1) values with every fp8 rounding tie
of ``x / scale`` (the midpoints of neighbouring fp8 values, times the scale), NaN, +-inf and
values past +-448; ``impl="pallas"`` (quantizing in its kernel) and ``impl="xla"``. The whole
caches are compared, so a stray write anywhere shows too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from parity import convert

pytestmark = pytest.mark.gpu

TOKENS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 16384, 8, 128, 16, 16384
WRITES = 2
K_SCALE, V_SCALE = 0.03, 0.25  # 0.03: division and multiplication by the reciprocal differ


def rows_with_ties(rng, dtype, scale: float) -> np.ndarray:
    """``[TOKENS, KV_HEADS, HEAD_DIM]`` N(0, 1) rows, a quarter replaced by ``tie * scale`` for
    every rounding tie of float8_e4m3fn (both signs), NaN, +-inf and +-1e4."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.unique(codes[np.isfinite(codes)])
    ties = (finite[1:] + finite[:-1]) / 2 * np.float64(np.float32(scale))
    pool = np.concatenate([ties, [np.nan, np.inf, -np.inf, 1e4, -1e4]]).astype(np.float32)
    rows = rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float32)
    chosen = rng.random(rows.shape) < 0.25
    rows[chosen] = rng.choice(pool, int(chosen.sum()))
    return rows.astype(dtype)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("row_dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "fp32"])
def test_large_fp8_write_is_torchs_bit_for_bit(rng, row_dtype, impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU visible to torch")
    k = rows_with_ties(rng, row_dtype, K_SCALE)
    v = rows_with_ties(rng, row_dtype, V_SCALE)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:WRITES * TOKENS].reshape(WRITES, TOKENS)
    slots = slots.astype(np.int32)  # i32[WRITES, TOKENS], disjoint
    assert np.isnan(k.astype(np.float32)).any() and (np.abs(v.astype(np.float32)) > 448).any()
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    zeros = np.zeros(cache_shape, ml_dtypes.float8_e4m3fn)

    caches = [convert.to_torch(zeros, "cuda"), convert.to_torch(zeros, "cuda")]
    k_t, v_t = convert.to_torch(k, "cuda"), convert.to_torch(v, "cuda")
    for write in range(WRITES):
        torch_ref.write_kv(*caches, k_t, v_t, convert.to_torch(slots[write], "cuda"),
                           k_scale=K_SCALE, v_scale=V_SCALE)
    want = [convert.bits(convert.from_torch(c)) for c in caches]
    del caches, k_t, v_t
    torch.cuda.empty_cache()

    def writes(k_cache, v_cache, k, v, slots):  # straight-line writes on donated caches
        for write in range(WRITES):
            k_cache, v_cache = pp.write_kv(k_cache, v_cache, k, v, slots[write], impl=impl,
                                           k_scale=K_SCALE, v_scale=V_SCALE)
        return k_cache, v_cache

    donated = jax.jit(writes, donate_argnums=(0, 1))
    got = donated(jnp.zeros(cache_shape, jnp.float8_e4m3fn),
                  jnp.zeros(cache_shape, jnp.float8_e4m3fn), *map(jnp.asarray, (k, v, slots)))
    for name, g, w in zip(("k_cache", "v_cache"), got, want):
        differ = int((convert.bits(convert.from_jax(g)) != w).sum())
        assert differ == 0, f"{name}: {differ} of {w.size} bytes differ from torch_ref's"

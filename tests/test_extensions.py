"""The SPEC extensions in both JAX impls against `torch_ref`: soft-cap, ALiBi, sliding window,
sinks, fp8 KV cache, return_lse."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
from pallas_paged._attention_common import split_share, tile_range
from paged_inputs import make_paged
from test_decode import IMPLS, assert_matches_torch, run_jax

SPLITS = (pp.DecodeConfig(block_k=16, num_splits=1), pp.DecodeConfig(block_k=16, num_splits=3),
          pp.DecodeConfig(block_k=16, num_splits=3, merge_in_kernel=True),
          pp.DecodeConfig(block_k=16, persistent_programs=6))  # 3 per kv head


def options(rng, num_heads, which):
    every = dict(logits_soft_cap=3.0,
                 alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                 sliding_window=7,
                 sinks=rng.standard_normal(num_heads).astype(np.float32))
    return every if which == "all" else {which: every[which]}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["logits_soft_cap", "alibi_slopes", "sliding_window", "sinks", "all"])
@pytest.mark.parametrize("config", SPLITS, ids=["one_split", "three_splits", "merged_in_kernel",
                                                 "persistent"])
def test_option_matches_torch_ref(rng, impl, which, config):
    paged = make_paged(rng, lens=[29, 0, 1, 5, 16, 33], num_heads=6, num_kv_heads=2,
                       block_size=5, head_dim=32)
    assert_matches_torch(paged, impl, "float32", config=config if impl == "pallas" else None,
                         return_lse=True, **options(rng, 6, which))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 4, 5, 9, 1000])
def test_sliding_window_sizes(rng, impl, window):
    paged = make_paged(rng, lens=[1, 4, 5, 23, 40], block_size=4)
    assert_matches_torch(paged, impl, "float32", sliding_window=window)


@pytest.mark.parametrize("impl", IMPLS)
def test_sliding_window_ignores_poisoned_blocks_outside_it(rng, impl):
    """Whole blocks before the window may hold NaN: they are not read."""
    paged = make_paged(rng, lens=[40, 17], block_size=4, fill=0.0)
    k_cache, v_cache = paged.k_cache.copy(), paged.v_cache.copy()
    for b, n in enumerate(paged.context_lens):
        first = max(n - 6, 0)
        for page in range(first // 4):
            k_cache[paged.block_tables[b, page]] = np.nan
            v_cache[paged.block_tables[b, page]] = np.nan
    out = pp.decode(*paged.jax(k_cache=k_cache, v_cache=v_cache), impl=impl, sliding_window=6)
    np.testing.assert_array_equal(np.asarray(out), run_jax(paged, impl, sliding_window=6))


@pytest.mark.parametrize("block_k,num_splits,window", list(itertools.product(
    [16, 64], [1, 2, 3, 8], [None, 1, 16, 17, 100])))
def test_kernel_visits_only_tiles_inside_the_window(block_k, num_splits, window):
    """The kernel's loop bounds: every tile holding a token of ``[first, n)``, and no other."""
    for n in [0, 1, 15, 16, 17, 64, 65, 300]:
        first = 0 if window is None else max(n - window, 0)
        wanted = set(range(first // block_k, -(-n // block_k)))
        visited = []
        for split in range(num_splits):
            _, lo, hi = tile_range(jnp.int32(n), jnp.int32(split), block_k=block_k,
                                   num_splits=num_splits, window=window)
            visited += list(range(int(lo), int(hi)))
        assert sorted(visited) == sorted(wanted), (n, first)  # each wanted tile exactly once
        for tile in visited:  # no tile lies wholly outside [first, n)
            assert tile * block_k < n and (tile + 1) * block_k > first


@pytest.mark.parametrize("num_splits", [2, 3, 7, 16, 33])
def test_split_shares_are_balanced(num_splits):
    """`split_share`: contiguous shares covering each tile once, whose lengths differ by at most
    one tile, so no split is idle while another walks more than ``ceil(count / num_splits)``."""
    for tile_lo, count in [(0, 0), (5, 1), (0, 7), (3, 32), (0, 512), (11, 255)]:
        shares = [tuple(int(x) for x in split_share(jnp.int32(tile_lo), jnp.int32(tile_lo + count),
                                                    jnp.int32(split), num_splits))
                  for split in range(num_splits)]
        assert shares[0][0] == tile_lo and shares[-1][1] == tile_lo + count, shares
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:])), shares
        lengths = [hi - lo for lo, hi in shares]
        assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1, (count, lengths)
        assert max(lengths) == -(-count // num_splits), (count, lengths)


@pytest.mark.parametrize("impl", IMPLS)
def test_soft_cap_does_not_overflow(rng, impl):
    paged = make_paged(rng, lens=[12, 3], block_size=4)
    paged.q *= 1e4  # scores of order 1e4 / sqrt(32)
    out = assert_matches_torch(paged, impl, "float32", logits_soft_cap=5.0)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_with_zero_length_rows(rng, impl):
    paged = make_paged(rng, lens=[0, 6], block_size=4)
    sinks = np.array([5.0, -3.0, 0.0, 20.0], np.float32)
    out, lse = run_jax(paged, impl, sinks=sinks, return_lse=True)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()
    assert_matches_torch(paged, impl, "float32", sinks=sinks, return_lse=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16", "float32"])
def test_fp8_cache(rng, impl, q_dtype):
    paged = make_paged(rng, lens=[30, 0, 7, 16], num_heads=8, num_kv_heads=2, block_size=8,
                       dtype="float8_e4m3fn", q_dtype=q_dtype, head_dim=64)
    out = assert_matches_torch(paged, impl, "float8_e4m3fn", k_scale=0.5, v_scale=2.0,
                               return_lse=True)
    assert out.dtype == np.float32  # converted for comparison; the impl returns q.dtype
    got = pp.decode(*paged.jax(), impl=impl, k_scale=0.5, v_scale=2.0)
    assert got.dtype == jnp.dtype(q_dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_cache_with_every_option(rng, impl):
    paged = make_paged(rng, lens=[21, 3, 0], num_heads=4, num_kv_heads=2, block_size=4,
                       dtype="float8_e4m3fn")
    assert_matches_torch(paged, impl, "float8_e4m3fn", k_scale=0.25, v_scale=0.75,
                         return_lse=True, **options(rng, 4, "all"))


# The fp8 operand paths of the Triton kernel: V converted in the dot operand's read, V
# converted at load, K and V read as column pairs (`DecodeConfig.fp8_v_at_load`, `fp8_pairs`).
FP8_PATHS = {"v_in_operand_read": {}, "v_at_load": dict(fp8_v_at_load=True),
             "pairs": dict(fp8_pairs=True)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", FP8_PATHS)
@pytest.mark.parametrize("head_dim", [40, 33])
def test_fp8_cache_with_padded_head_dim(rng, impl, path, head_dim):
    """head_dim 40 and 33: the kernel's tiles pad them to 64 columns, which `value_tile_for_dot`
    multiplies by 0 with ``fp8_v_at_load`` (the masked load has zeroed them), and which
    ``fp8_pairs`` reads as 32 words, 20 of them the head's; an odd head_dim has no column pairs,
    and ``fp8_pairs`` has no effect there."""
    paged = make_paged(rng, lens=[19, 4], num_heads=4, num_kv_heads=2, block_size=4,
                       dtype="float8_e4m3fn", head_dim=head_dim)
    config = pp.DecodeConfig(block_k=16, num_splits=2, num_warps=2, **FP8_PATHS[path])
    assert_matches_torch(paged, impl, "float8_e4m3fn", k_scale=0.5, v_scale=1.5,
                         return_lse=True, config=config if impl == "pallas" else None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", ["v_at_load", "pairs"])
@pytest.mark.parametrize("merge", ["merge_kernel", "merged", "persistent"])
def test_fp8_paths_with_every_option(rng, impl, path, merge):
    paged = make_paged(rng, lens=[21, 3, 0], num_heads=4, num_kv_heads=2, block_size=4,
                       dtype="float8_e4m3fn")
    layout = (dict(persistent_programs=4) if merge == "persistent"
              else dict(num_splits=3, merge_in_kernel=merge == "merged"))
    config = pp.DecodeConfig(block_k=16, **layout, **FP8_PATHS[path])
    assert_matches_torch(paged, impl, "float8_e4m3fn", k_scale=0.25, v_scale=0.75,
                         return_lse=True, config=config if impl == "pallas" else None,
                         **options(rng, 4, "all"))


def every_fp8_pair():
    """u16[256, 256]: every pair of e4m3 bytes as a little-endian word (row: the odd column's
    byte, column: the even one's), and the two bytes' fp16 values."""
    even = np.broadcast_to(np.arange(256, dtype=np.uint16)[None, :], (256, 256))
    odd = np.broadcast_to(np.arange(256, dtype=np.uint16)[:, None], (256, 256))
    as_f16 = lambda byte: byte.astype(np.uint8).view(jnp.float8_e4m3fn).astype(np.float16)  # noqa: E731
    return (odd << 8) | even, as_f16(even), as_f16(odd)


def test_fp8_pairs_to_f16_keeps_every_pair_in_interpret_mode():
    from pallas_paged._triton_common import fp8_pairs_to_f16
    words, want_even, want_odd = every_fp8_pair()
    even, odd = fp8_pairs_to_f16(jnp.asarray(words), interpret=True)
    np.testing.assert_array_equal(np.asarray(even), want_even)  # NaN positions equal too
    np.testing.assert_array_equal(np.asarray(odd), want_odd)


@pytest.mark.gpu
def test_fp8_pairs_to_f16_keeps_every_pair_compiled():
    """The PTX conversion (``cvt.rn.f16x2.e4m3x2``) in a Pallas Triton kernel, bit for bit."""
    from jax.experimental import pallas as pl
    from pallas_paged._triton_common import fp8_pairs_to_f16
    words, want_even, want_odd = every_fp8_pair()

    def kernel(words_ref, even_ref, odd_ref):  # u16[16, 256] -> f16[16, 256] x 2, per program
        even_ref[...], odd_ref[...] = fp8_pairs_to_f16(words_ref[...], interpret=False)

    spec = pl.BlockSpec((16, 256), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct(words.shape, jnp.float16)
    even, odd = pl.pallas_call(kernel, grid=(16,), in_specs=[spec], out_specs=[spec, spec],
                               out_shape=[out, out])(jnp.asarray(words))
    for got, want in ((np.asarray(even), want_even), (np.asarray(odd), want_odd)):
        nan = np.isnan(want)  # a NaN's payload is the hardware's choice
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def test_value_tile_for_dot_keeps_every_fp8_value():
    """Every e4m3 value (NaN, the largest, the subnormals, both zeros) converts to the fp16
    that a bare ``astype`` gives on the head's columns, and the padding columns give 0; without
    ``at_load``, and for 16-bit tiles, it is a bare ``astype``."""
    from pallas_paged.decode_attention.pallas_triton import value_tile_for_dot
    every = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).reshape(16, 16)
    tile = jnp.asarray(np.concatenate([every, np.zeros((16, 16), every.dtype)], axis=1))
    col_ok = jnp.arange(32) < 16
    want = np.asarray(tile.astype(jnp.float16))
    got = np.asarray(value_tile_for_dot(tile, jnp.float16, col_ok, at_load=True))
    np.testing.assert_array_equal(got[:, :16], want[:, :16])  # NaN positions equal too
    assert (got[:, 16:] == 0).all()
    np.testing.assert_array_equal(
        np.asarray(value_tile_for_dot(tile, jnp.float16, col_ok, at_load=False)), want)
    bf16 = jnp.asarray(np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16), jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(value_tile_for_dot(bf16, jnp.float32, jnp.arange(16) < 8, at_load=True)),
        np.asarray(bf16.astype(jnp.float32)))


@pytest.mark.parametrize("impl", IMPLS)
def test_return_lse_shape_and_values(rng, impl):
    paged = make_paged(rng, lens=[9, 0, 4], num_heads=4, num_kv_heads=2, block_size=4)
    out, lse = pp.decode(*paged.jax(), impl=impl, return_lse=True)
    assert lse.shape == (3, 4) and lse.dtype == jnp.float32
    assert np.isneginf(np.asarray(lse)[1]).all()
    assert_matches_torch(paged, impl, "float32", return_lse=True)



@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    pp.DecodeConfig(block_k=16, num_splits=2, num_warps=1, fp8_pairs=True),
    pp.DecodeConfig(block_k=64, num_splits=2, num_warps=2, num_stages=5, fp8_pairs=True),
    pp.DecodeConfig(block_k=128, num_splits=1, num_warps=4, num_stages=5, fp8_pairs=True),
    pp.DecodeConfig(block_k=32, num_splits=3, num_warps=8, fp8_pairs=True, merge_in_kernel=True),
    pp.DecodeConfig(block_k=64, num_warps=4, num_stages=5, fp8_pairs=True, persistent_programs=6),
], ids=["bk16_w1", "bk64_w2_st5", "bk128_w4_st5", "bk32_w8_merged", "bk64_w4_st5_p3"])
@pytest.mark.parametrize("head_dim", [128, 40])
def test_fp8_pairs_every_byte_value_compiled(rng, config, head_dim):
    """The compiled decode kernel's fp8 column pairs (two words per conversion) with every fp8
    byte value in the caches (NaN aside: a NaN anywhere makes its rows NaN): torch_ref's output
    within tolerance."""
    paged = make_paged(rng, lens=[300, 7, 0, 129], num_heads=8, num_kv_heads=2, block_size=16,
                       dtype="float8_e4m3fn", head_dim=head_dim)
    every = np.arange(256, dtype=np.uint8)
    every = every[(every & 0x7F) != 0x7F].view(jnp.float8_e4m3fn)  # the two NaNs left out
    for cache in (paged.k_cache, paged.v_cache):
        flat = cache.reshape(-1)
        flat[:] = np.resize(every, flat.shape)
    assert_matches_torch(paged, "pallas", "float8_e4m3fn", k_scale=2.0 ** -8, v_scale=2.0 ** -8,
                         return_lse=True, config=config)

"""`pallas_paged.write_kv` (both impls): bit-exact against `torch_ref.write_kv`, I1, jit, donation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from paged_inputs import NP_DTYPES, bits, to_torch

IMPLS = ("xla", "pallas")
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def draw_write(rng, *, num_blocks=6, block_size=4, kvh=2, head_dim=32, num_tokens=9,
               num_padding=3, dtype="float32"):
    """A cache full of random values, and tokens for distinct random slots, some of them -1."""
    shape = (num_blocks, block_size, kvh, head_dim)
    cache_dtype = NP_DTYPES[dtype]
    # fp8 caches take bf16 tokens: few mantissa bits, so x / scale often lands exactly on a tie.
    new_dtype = NP_DTYPES["bfloat16"] if dtype == "float8_e4m3fn" else cache_dtype
    k_cache = rng.standard_normal(shape).astype(cache_dtype)
    v_cache = rng.standard_normal(shape).astype(cache_dtype)
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int32)
    slots[rng.choice(num_tokens, num_padding, replace=False)] = -1
    k = rng.standard_normal((num_tokens, kvh, head_dim)).astype(new_dtype)
    v = rng.standard_normal((num_tokens, kvh, head_dim)).astype(new_dtype)
    return k_cache, v_cache, k, v, slots


def fp8_scales(dtype):
    # With bf16 tokens, x / 0.03 lands on fp8 rounding ties often enough that x * (1 / 0.03), which
    # rounds differently, stores other bits in about 1% of the elements: only the division is right.
    return dict(k_scale=0.03, v_scale=0.3) if dtype == "float8_e4m3fn" else {}


def write_torch(k_cache, v_cache, k, v, slots, **scales):
    kc, vc = to_torch(k_cache.copy()), to_torch(v_cache.copy())
    torch_ref.write_kv(kc, vc, to_torch(k), to_torch(v), torch.from_numpy(slots), **scales)
    return kc, vc


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_exact_against_torch_ref(rng, impl, dtype):
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=16, num_tokens=60, num_padding=5,
                                               dtype=dtype)
    scales = fp8_scales(dtype)
    expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, **scales)
    got_k, got_v = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl,
                               **scales)
    np.testing.assert_array_equal(bits(got_k), bits(expected_k))
    np.testing.assert_array_equal(bits(got_v), bits(expected_v))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_saturates_and_keeps_nan(impl):
    cache = jnp.zeros((1, 4, 1, 16), jnp.float8_e4m3fn)
    k = jnp.array([1e6, -1e6, 448 * 0.5, np.nan] * 4, jnp.float32).reshape(1, 1, 16)
    got, _ = pp.write_kv(cache, cache, k, k, jnp.array([2], jnp.int32), k_scale=0.5, v_scale=0.5,
                         impl=impl)
    row = np.asarray(got[0, 2, 0, :4].astype(jnp.float32))
    assert row[0] == 448 and row[1] == -448 and row[2] == 448 and np.isnan(row[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_i1_padding_token_leaves_no_trace(rng, impl):
    """A -1 token with a sentinel value is written nowhere, least of all into the last slot."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=4, num_padding=0)
    slots[:] = [3, -1, 7, -1]
    k[[1, 3]] = 12345.0
    v[[1, 3]] = -12345.0
    got_k, got_v = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    got_k, got_v = np.asarray(got_k), np.asarray(got_v)
    assert not (got_k == 12345.0).any() and not (got_v == -12345.0).any()
    np.testing.assert_array_equal(got_k[-1, -1], k_cache[-1, -1])
    changed = (got_k != k_cache).any(axis=(2, 3)).reshape(-1)
    assert set(np.flatnonzero(changed)) <= {3, 7}


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_slots(rng, impl):
    """Real int64 slots (x64 on: with it off, JAX narrows the array before write_kv sees it), and a
    numpy int64 array with x64 off, write exactly what int32 slots write."""
    k_cache, v_cache, k, v, slots = draw_write(rng)
    a = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    with jax.enable_x64(True):
        slots64 = jnp.asarray(slots.astype(np.int64))
        assert slots64.dtype == jnp.int64
        b = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots64, impl=impl)
    c = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots.astype(np.int64), impl=impl)
    for got in (b, c):
        np.testing.assert_array_equal(bits(got[0]), bits(a[0]))
        np.testing.assert_array_equal(bits(got[1]), bits(a[1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_slots_outside_int32_never_wrap(rng, impl):
    """``2**32 + 5`` would wrap to slot 5 and ``2**32 - 1`` to -1 (the last slot): both are dropped,
    jitted with x64 on as eagerly with a numpy int64 array; eager validation rejects them."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=4, num_padding=0)
    slots64 = np.array([2**32 + 5, 2, 2**32 - 1, -(2**32) + 7], np.int64)
    expected_k, expected_v = write_torch(k_cache, v_cache, k, v, np.array([-1, 2, -1, -1], np.int32))
    with jax.enable_x64(True):
        args = [*map(jnp.asarray, (k_cache, v_cache, k, v, slots64))]
        assert args[4].dtype == jnp.int64
        jitted = jax.jit(functools.partial(pp.write_kv, impl=impl))(*args)
    eager = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots64, impl=impl)
    for got_k, got_v in (jitted, eager):
        np.testing.assert_array_equal(bits(got_k), bits(expected_k))
        np.testing.assert_array_equal(bits(got_v), bits(expected_v))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]=4294967301 is out of range"):
        pp.validate_write_inputs(k_cache, v_cache, k, v, slots64)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_slots_are_dropped_under_jit(rng, impl):
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=5, num_padding=0)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots[:] = [num_slots, -2, 5, num_slots + 100, -(2**31)]
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    expected = k_cache.copy()
    expected.reshape(num_slots, *k_cache.shape[2:])[5] = k[2]
    np.testing.assert_array_equal(np.asarray(got_k), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_row_width_not_a_power_of_two(rng, impl):
    k_cache, v_cache, k, v, slots = draw_write(rng, kvh=3, head_dim=80, dtype="bfloat16")
    expected_k, _ = write_torch(k_cache, v_cache, k, v, slots)
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    np.testing.assert_array_equal(bits(got_k), bits(expected_k))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(rng, impl):
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=0, num_padding=0)
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    np.testing.assert_array_equal(np.asarray(got_k), k_cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_donated_caches_are_updated_in_place(rng, impl):
    """With donation the output lives in the input's buffer: no cache-sized copy is made."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=256, block_size=16, kvh=2,
                                               head_dim=64)
    step = jax.jit(functools.partial(pp.write_kv, impl=impl), donate_argnums=(0, 1))
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    pointers = (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer())
    args = tuple(map(jnp.asarray, (k, v, slots)))
    compiled = step.lower(kc, vc, *args).compile()
    new_k, new_v = step(kc, vc, *args)
    assert kc.is_deleted() and vc.is_deleted()
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    memory = compiled.memory_analysis()
    if memory is not None:  # a copy of a cache would need a temporary at least its size
        assert memory.temp_size_in_bytes < k_cache.nbytes // 2
    expected_k, _ = write_torch(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(bits(new_k), bits(expected_k))


@pytest.mark.parametrize("impl", IMPLS)
def test_write_then_decode_sees_the_new_token(rng, impl):
    """The runner's step, jitted together with donated caches: decode reads what was just written."""
    num_blocks, block_size, kvh, d = 8, 4, 1, 16
    k_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kvh, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kvh, d)), jnp.float32)
    tables = jnp.array([[5, 2]], jnp.int32)
    lens = jnp.array([6], jnp.int32)  # the new token is position 5: block 2, offset 1 -> slot 9
    k_new = jnp.zeros((1, kvh, d), jnp.float32)
    v_new = jnp.full((1, kvh, d), 1000.0, jnp.float32)
    q = jnp.zeros((1, 1, d), jnp.float32)  # uniform weights over the 6 tokens

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_cache, v_cache):
        k_cache, v_cache = pp.write_kv(k_cache, v_cache, k_new, v_new, jnp.array([9], jnp.int32),
                                       impl=impl)
        return pp.decode(q, k_cache, v_cache, tables, lens, impl="pallas"), k_cache, v_cache

    out, _, v_after = step(k_cache, v_cache)
    assert float(v_after[2, 1, 0, 0]) == 1000.0
    assert float(out[0, 0, 0]) > 1000.0 / 6 - 10  # the written row carries a sixth of the weight


@pytest.mark.parametrize("impl", IMPLS)
def test_donation_recipe_takes_every_keyword(rng, impl):
    """README's form: ``jax.jit(write_kv, donate_argnums=(0, 1), static_argnames=("impl",
    "interpret"))`` with fp8 scales (python floats, traced by the caller's jit: one program for
    both) and ``impl=``, bit-identical to torch."""
    write = jax.jit(pp.write_kv, donate_argnums=(0, 1), static_argnames=("impl", "interpret"))
    k_cache, v_cache, k, v, slots = draw_write(rng, dtype="float8_e4m3fn")
    sizes = []
    for k_scale, v_scale in ((0.03, 0.3), (0.07, 0.11)):
        got_k, got_v = write(jnp.asarray(k_cache), jnp.asarray(v_cache), *map(jnp.asarray, (k, v, slots)),
                             k_scale=k_scale, v_scale=v_scale, impl=impl)
        expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, k_scale=k_scale,
                                             v_scale=v_scale)
        np.testing.assert_array_equal(bits(got_k), bits(expected_k))
        np.testing.assert_array_equal(bits(got_v), bits(expected_v))
        sizes.append(write._cache_size())  # jit objects of one function share their cache
    assert sizes[1] == sizes[0]

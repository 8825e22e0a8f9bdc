"""The fused KV layout (SPEC.md, "Fused KV layout") and the TPU signature (`pallas_paged.compat`).

A fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` is the pair
``(kv_cache[:, :, 0::2], kv_cache[:, :, 1::2])``: every op must give the same bits on either
layout, in every implementation, raise the same errors, and read the fused rows in place.
`compat.ragged_paged_attention` is judged against the float64 truth by FlashAttention's rule, and
against JAX's own pure-jnp `ref_ragged_paged_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch_ref

import pallas_paged as pp
from pallas_paged import _mosaic_common
from pallas_paged.compat import ragged_paged_attention, ragged_paged_attention_v3
from paged_inputs import (FP8, NP_DTYPES, assert_close, bits, draw_write, launched_ops,
                          lower_for_cuda, make_paged, make_ragged, reference, to_numpy, to_torch)

MOSAIC = _mosaic_common.jax_version() >= _mosaic_common.MIN_JAX
DECODE_IMPLS = ("xla", "pallas") + (("mosaic",) if MOSAIC else ())


def fuse(k_cache, v_cache) -> np.ndarray:
    """The fused cache whose halves are ``k_cache`` and ``v_cache`` (numpy)."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    nb, bs, kvh, d = k_cache.shape
    return np.stack([k_cache, v_cache], axis=3).reshape(nb, bs, 2 * kvh, d)


def scales_for(dtype: str) -> dict:
    return dict(k_scale=0.5, v_scale=0.25) if dtype == FP8 else {}


# --- the layout itself ---------------------------------------------------------------------------

def test_split_kv_cache_is_the_interleaving(rng):
    k_cache, v_cache = rng.standard_normal((2, 3, 4, 2, 8)).astype(np.float32)
    kv = to_torch(fuse(k_cache, v_cache))
    k_half, v_half = torch_ref.split_kv_cache(kv)
    np.testing.assert_array_equal(k_half.numpy(), k_cache)
    np.testing.assert_array_equal(v_half.numpy(), v_cache)
    assert k_half.data_ptr() == kv.data_ptr()  # views: writing them writes the fused cache


# --- write ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", FP8])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_write_kv_fused_gives_the_bits_of_the_separate_write(rng, impl, dtype):
    """Same bits as `write_kv` on the halves and as torch_ref's fused write; slot -1 writes
    nothing; every other element keeps its bits."""
    k_cache, v_cache, k, v, slots = draw_write(rng, dtype=dtype)
    scales = scales_for(dtype)
    kv = fuse(k_cache, v_cache)
    got = pp.write_kv_fused(jnp.asarray(kv), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots),
                            impl=impl, **scales)
    want_k, want_v = pp.write_kv(jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(k),
                                 jnp.asarray(v), jnp.asarray(slots), impl=impl, **scales)
    np.testing.assert_array_equal(bits(got), bits(fuse(want_k, want_v)))
    kv_torch = to_torch(np.array(kv, copy=True))
    torch_ref.write_kv_fused(kv_torch, to_torch(k), to_torch(v), torch.from_numpy(slots),
                             **scales)
    np.testing.assert_array_equal(bits(got), bits(kv_torch))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_write_kv_fused_under_jit_updates_the_donated_cache_in_place(rng, impl):
    k_cache, v_cache, k, v, slots = draw_write(rng, dtype="bfloat16")
    kv = jnp.asarray(fuse(k_cache, v_cache))
    write = jax.jit(functools.partial(pp.write_kv_fused, impl=impl), donate_argnums=(0,))
    text = write.lower(kv, k, v, slots).as_text()
    assert "tf.aliasing_output = 0" in text  # the donated cache is the output's buffer
    want = pp.write_kv_fused(kv, k, v, slots, impl=impl)
    np.testing.assert_array_equal(bits(write(kv, k, v, slots)), bits(want))


# --- decode and ragged attention -----------------------------------------------------------------

DECODE_CONFIGS = {
    "xla": [None],
    "pallas": [None, pp.DecodeConfig(block_k=16, num_splits=3),
               pp.DecodeConfig(block_k=16, num_splits=2, merge_in_kernel=True),
               pp.DecodeConfig(block_k=16, num_stages=5, persistent_programs=6)],
    "mosaic": [pp.MosaicDecodeConfig(block_k=64, num_splits=2, num_stages=2, queries_in_n=True)],
}


@pytest.mark.parametrize("impl,config", [
    pytest.param(impl, config, marks=[] if i == 0 else [pytest.mark.slow])  # slow: more configs
    for impl in DECODE_IMPLS for i, config in enumerate(DECODE_CONFIGS[impl])])
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param(FP8, marks=pytest.mark.slow)])
def test_decode_fused_gives_the_bits_of_decode(rng, impl, config, dtype):
    """Every kernel and config, every option: the fused call's bits are the separate call's, and
    both are within FlashAttention's bound of the truth."""
    mosaic = impl == "mosaic"
    paged = make_paged(rng, lens=[37, 0, 16, 5], num_heads=8, num_kv_heads=2,
                       head_dim=64 if mosaic else 32, block_size=16 if mosaic else 4,
                       dtype=dtype)
    q, k_cache, v_cache, tables, lens = paged.jax()
    options = dict(logits_soft_cap=20.0, sliding_window=24, return_lse=True,
                   alibi_slopes=jnp.linspace(-0.5, 0.5, 8, dtype=jnp.float32),
                   sinks=jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32), **scales_for(dtype))
    kv = jnp.asarray(fuse(paged.k_cache, paged.v_cache))
    out, lse = pp.decode_fused(q, kv, tables, lens, impl=impl, config=config, **options)
    want, want_lse = pp.decode(q, k_cache, v_cache, tables, lens, impl=impl, config=config,
                               **options)
    np.testing.assert_array_equal(bits(out), bits(want))
    np.testing.assert_array_equal(bits(lse), bits(want_lse))
    options.pop("return_lse")
    assert_close(reference(*paged.arrays(), **options), out, lse)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", FP8])
def test_paged_attention_fused_gives_the_bits_of_paged_attention(rng, impl, dtype):
    ragged = make_ragged(rng, [(5, 9), (0, 4), (1, 17), (3, 3)], pad=2, num_heads=4,
                         num_kv_heads=2, block_size=4, dtype=dtype)
    q, k_cache, v_cache, tables, lens, qsl = ragged.jax()
    options = dict(sliding_window=6, logits_soft_cap=10.0, return_lse=True, **scales_for(dtype))
    config = pp.AttentionConfig(block_q=2, block_k=16, num_splits=2) if impl == "pallas" else None
    kv = jnp.asarray(fuse(ragged.k_cache, ragged.v_cache))
    out, lse = pp.paged_attention_fused(q, kv, tables, lens, qsl, impl=impl, config=config,
                                        **options)
    want, want_lse = pp.paged_attention(q, k_cache, v_cache, tables, lens, qsl, impl=impl,
                                        config=config, **options)
    np.testing.assert_array_equal(bits(out), bits(want))
    np.testing.assert_array_equal(bits(lse), bits(want_lse))
    want_torch = torch_ref.paged_attention_fused(
        to_torch(ragged.q), to_torch(np.asarray(kv)), *(to_torch(x) for x in
                                                         (ragged.block_tables, ragged.context_lens,
                                                          ragged.query_start_loc)),
        sliding_window=6, logits_soft_cap=10.0, **scales_for(dtype))
    options.pop("return_lse")
    ref = reference(*ragged.arrays()[:5], query_start_loc=ragged.query_start_loc, **options)
    assert_close(ref, out, lse)
    assert_close(ref, want_torch, what="torch_ref fused")


@pytest.mark.parametrize("op", ["decode", "ragged"])
def test_the_kernels_read_the_fused_cache_in_place(op):
    """Lowered for CUDA, the fused call launches nothing the separate call does not: no slice,
    gather, transpose or copy of the cache before the kernel."""
    q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((64, 16, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((64, 16, 4, 128), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    if op == "decode":
        fused = lower_for_cuda(functools.partial(pp.decode_fused, impl="pallas"), q, kv, tables,
                               lens)
        separate = lower_for_cuda(functools.partial(pp.decode, impl="pallas"), q, cache, cache,
                                  tables, lens)
    else:
        qsl = jax.ShapeDtypeStruct((5,), jnp.int32)
        fused = lower_for_cuda(functools.partial(pp.paged_attention_fused, impl="pallas"), q, kv,
                               tables, lens, qsl)
        separate = lower_for_cuda(functools.partial(pp.paged_attention, impl="pallas"), q, cache,
                                  cache, tables, lens, qsl)
    assert launched_ops(fused) == launched_ops(separate)
    assert "_fused" in fused  # the kernel's name says which layout it reads


@pytest.mark.parametrize("bad,match", [
    ((6, 4, 3, 8), r"kv_cache.shape=\(6, 4, 3, 8\) must be \[num_blocks, block_size, 2 \*"),
    ((6, 4, 4), r"kv_cache must have rank 4"),
])
def test_a_cache_that_is_not_fused_is_refused_everywhere(rng, bad, match):
    kv = np.zeros(bad, np.float32)
    q = np.zeros((1, 4, 8), np.float32)
    tables, lens = np.zeros((1, 2), np.int32), np.ones((1,), np.int32)
    k = np.zeros((1, 2, 8), np.float32)
    slots = np.zeros((1,), np.int32)
    for call in (lambda: pp.decode_fused(q, kv, tables, lens),
                 lambda: pp.paged_attention_fused(q, kv, tables, lens, np.array([0, 1], np.int32)),
                 lambda: pp.write_kv_fused(kv, k, k, slots),
                 lambda: torch_ref.paged_decode_attention_fused(*map(to_torch, (q, kv, tables,
                                                                                lens))),
                 lambda: torch_ref.write_kv_fused(to_torch(kv), to_torch(k), to_torch(k),
                                                  to_torch(slots))):
        with pytest.raises(ValueError, match=match):
            call()


def test_bad_values_get_the_separate_layouts_errors(rng):
    paged = make_paged(rng, lens=[5, 3], block_size=4)
    q, _, _, tables, lens = paged.arrays()
    kv = fuse(paged.k_cache, paged.v_cache)
    too_long = np.array([5, 99], np.int32)
    for call in (lambda: pp.decode_fused(q, kv, tables, too_long),
                 lambda: torch_ref.paged_decode_attention_fused(
                     *map(to_torch, (q, kv, tables, too_long)))):
        with pytest.raises(ValueError, match=r"context_lens\[1\]=99 exceeds the table's capacity"):
            call()
    # check_values=False: jit's rule (the length clamped to the capacity), the same bits as on
    # the halves
    out = pp.decode_fused(q, kv, tables, too_long, check_values=False)
    want = pp.decode(q, paged.k_cache, paged.v_cache, tables, too_long, check_values=False)
    np.testing.assert_array_equal(bits(out), bits(want))


# --- JAX's TPU signature -------------------------------------------------------------------------

def tpu_batch(rng, *, dtype, num_seqs, max_seqs=5, page_size=8, kvh=2, num_heads=8, head_dim=64):
    """A random ragged batch in TPU's arguments: (q lengths, kv lengths) per sequence, sequences
    past ``num_seqs`` holding garbage lengths, padding rows past the last query."""
    kv_lens = rng.integers(1, 40, max_seqs).astype(np.int32)
    q_lens = np.minimum(rng.integers(0, 6, max_seqs), kv_lens).astype(np.int32)
    q_lens[num_seqs:] = 0
    kv_lens[num_seqs:] = rng.integers(0, 10**6, max_seqs - num_seqs)  # ignored
    pages_per_seq = 6
    total_pages = max_seqs * pages_per_seq + 3
    page_indices = rng.permutation(total_pages)[:max_seqs * pages_per_seq].reshape(
        max_seqs, pages_per_seq).astype(np.int32)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1]) + 3
    pages = rng.standard_normal((total_pages, page_size, 2 * kvh, head_dim)).astype(np.float32)
    q_dtype = "bfloat16" if dtype == FP8 else dtype
    with np.errstate(over="ignore"):
        pages = (pages * (2.0 if dtype == FP8 else 1.0)).astype(NP_DTYPES[dtype])
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(NP_DTYPES[q_dtype])
    return (q, pages, kv_lens, page_indices, cu_q_lens, np.array([num_seqs], np.int32))


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16",
                                   pytest.param(FP8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [
    pytest.param({}, marks=pytest.mark.slow),
    pytest.param(dict(sliding_window=5), marks=pytest.mark.slow),
    pytest.param(dict(soft_cap=8.0), marks=pytest.mark.slow),
    dict(sliding_window=9, soft_cap=30.0, mask_value=-1e30)],
    ids=["plain", "window", "soft_cap", "window_soft_cap"])  # the fast set: every option at once
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_compat_against_the_truth_and_jaxs_reference(rng, impl, options, dtype):
    """Every option of TPU's signature on a ragged batch with sequences past ``num_seqs``: within
    FlashAttention's bound of the float64 truth, and no farther from JAX's reference than the
    reference is from the truth plus that bound (each implementation rounds its own way)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu

    args = tpu_batch(rng, dtype=dtype, num_seqs=4)
    scales = dict(k_scale=0.5, v_scale=2.0) if dtype == FP8 else {}
    sm_scale = 64 ** -0.5
    out = ragged_paged_attention(*map(jnp.asarray, args), sm_scale=sm_scale, impl=impl,
                                 num_queries_per_block=8, **options, **scales)
    q, pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    used = int(cu_q_lens[num_seqs[0]])
    lens = np.where(np.arange(len(kv_lens)) < num_seqs[0], kv_lens, 0)
    qsl = np.where(np.arange(len(cu_q_lens)) <= num_seqs[0], cu_q_lens, used)
    k_half, v_half = pages[:, :, 0::2], pages[:, :, 1::2]
    ref = reference(q, k_half, v_half, page_indices, lens, sm_scale, query_start_loc=qsl,
                    sliding_window=options.get("sliding_window"),
                    logits_soft_cap=options.get("soft_cap"), **scales)
    assert_close(ref, out)
    assert (to_numpy(out)[used:].astype(np.float32) == 0).all()  # rows past the last sequence
    tpu_out = tpu.ref_ragged_paged_attention(*map(jnp.asarray, args), sm_scale=sm_scale,
                                             **options, **scales)
    tpu_err = np.abs(to_numpy(tpu_out).astype(np.float64) - ref.truth_out[:used]).max()
    ours_err = np.abs(to_numpy(out)[:used].astype(np.float64) - ref.truth_out[:used]).max()
    assert ours_err <= 2 * tpu_err + 1e-5 * np.abs(ref.truth_out).max(), (ours_err, tpu_err)


def test_compat_refuses_what_tpus_signature_refuses():
    q = jnp.zeros((4, 4, 16), jnp.float32)
    pages = jnp.zeros((6, 4, 4, 16), jnp.float32)
    lens, idx = jnp.ones((2,), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    cu, n = jnp.array([0, 1, 2], jnp.int32), jnp.array([2], jnp.int32)
    with pytest.raises(ValueError, match=r"num_seqs.shape=\(2,\) must be \(1,\)"):
        ragged_paged_attention(q, pages, lens, idx, cu, jnp.array([2, 2], jnp.int32))
    with pytest.raises(ValueError, match=r"soft_cap=0.0 must not be 0"):
        ragged_paged_attention(q, pages, lens, idx, cu, n, soft_cap=0.0)
    with pytest.raises(ValueError, match=r"k_scale / v_scale apply to float8_e4m3fn caches"):
        ragged_paged_attention(q, pages, lens, idx, cu, n, k_scale=0.5, v_scale=0.5)
    with pytest.raises(ValueError, match=r"q_len of sequence 0 = .* exceeds context_lens"):
        ragged_paged_attention(q, pages, lens, idx, jnp.array([0, 3, 4], jnp.int32), n)


def test_compat_under_jit_with_a_traced_num_seqs(rng):
    """One compiled program serves every ``num_seqs``, as in a serving loop."""
    args = tpu_batch(rng, dtype="bfloat16", num_seqs=5)
    run = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125))
    first = run(*map(jnp.asarray, args[:5]), jnp.array([5], jnp.int32))
    # (a first call in a fresh process can change the tracing context, e.g. a config set on
    # first use: count the programs from the second call on)
    fewer = run(*map(jnp.asarray, args[:5]), jnp.array([2], jnp.int32))
    programs = run._cache_size()
    run(*map(jnp.asarray, args[:5]), jnp.array([3], jnp.int32))
    assert run._cache_size() == programs
    cu = args[4]
    np.testing.assert_array_equal(bits(fewer)[:cu[2]], bits(first)[:cu[2]])
    assert (to_numpy(fewer)[cu[2]:].astype(np.float32) == 0).all()


# --- tpu-inference's v3 signature: the new tokens written, then attention -------------------------

def tpu_v3_batch(rng, *, dtype, num_seqs, head_dim=64, padded_dim=128, max_seqs=5, page_size=8,
                 kvh=2, num_heads=8):
    """A ragged batch in v3's arguments (the packed cache holding garbage, new keys/values in
    the cache's dtype), and the cache every new row written (numpy, the fused 4-D view)."""
    q, pages4, kv_lens, tables, cu_q_lens, num_seqs_arr = tpu_batch(
        rng, dtype=dtype, num_seqs=num_seqs, max_seqs=max_seqs, page_size=page_size, kvh=kvh,
        num_heads=num_heads, head_dim=head_dim)
    total_pages = pages4.shape[0]
    garbage = rng.standard_normal((total_pages, page_size, 2 * kvh, padded_dim))
    with np.errstate(over="ignore"):
        pages4 = garbage.astype(np.float32).astype(pages4.dtype)
    num_tokens = q.shape[0]
    keys, values = (rng.standard_normal((num_tokens, kvh, head_dim)).astype(np.float32)
                    .astype(pages4.dtype) for _ in range(2))
    written = pages4.copy()
    for b in range(num_seqs):
        q_len = cu_q_lens[b + 1] - cu_q_lens[b]
        for j in range(q_len):
            t, pos = cu_q_lens[b] + j, kv_lens[b] - q_len + j
            row = written[tables[b, pos // page_size], pos % page_size]
            row[0::2] = row[1::2] = 0
            row[0::2, :head_dim], row[1::2, :head_dim] = keys[t], values[t]
    packing = 4 // np.dtype(pages4.dtype).itemsize
    packed = pages4.reshape(total_pages, page_size, 2 * kvh // packing, packing, padded_dim)
    distribution = np.array([0, 0, num_seqs], np.int32)
    return (q, keys, values, packed, kv_lens, tables.reshape(-1), cu_q_lens, distribution), written


@pytest.mark.parametrize("dtype,head_dim,padded_dim", [
    ("bfloat16", 64, 128),                                       # two heads a word, D padded
    pytest.param(FP8, 64, 64, marks=pytest.mark.slow),           # four heads a word
    pytest.param("float32", 128, 128, marks=pytest.mark.slow)])  # one
@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_v3_writes_every_new_row_then_attends_as_the_truth(rng, impl, dtype, head_dim,
                                                           padded_dim):
    """The cache after the call is the given one with each sequence's new rows at their
    positions (bit for bit; the padded head columns zero), nothing else changed, sequences past
    ``distribution[2]`` untouched; the output is the float64 truth over that cache within
    FlashAttention's rule, zero past the last sequence's rows. A window of 5 drops none of the
    new rows (TPU's kernel skips some with a window)."""
    args, written = tpu_v3_batch(rng, dtype=dtype, num_seqs=4, head_dim=head_dim,
                                 padded_dim=padded_dim)
    q, _, _, packed, kv_lens, flat_tables, cu_q_lens, distribution = args
    scales = scales_for(dtype)
    sm_scale = head_dim ** -0.5
    out, cache = ragged_paged_attention_v3(
        *map(jnp.asarray, args), sm_scale=sm_scale, sliding_window=5, soft_cap=20.0,
        impl=impl, chunk_prefill_size=16, vmem_limit_bytes=1 << 20, **scales)
    assert cache.shape == packed.shape and cache.dtype == packed.dtype
    np.testing.assert_array_equal(bits(cache), bits(written.reshape(packed.shape)))
    used = int(cu_q_lens[4])
    lens = np.where(np.arange(len(kv_lens)) < 4, kv_lens, 0)
    qsl = np.where(np.arange(len(cu_q_lens)) <= 4, cu_q_lens, used)
    k_half, v_half = written[:, :, 0::2, :head_dim], written[:, :, 1::2, :head_dim]
    ref = reference(q, k_half, v_half, flat_tables.reshape(len(kv_lens), -1), lens, sm_scale,
                    query_start_loc=qsl, sliding_window=5, logits_soft_cap=20.0, **scales)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(ref, out)
    assert (to_numpy(out)[used:].astype(np.float32) == 0).all()


def test_v3_without_the_update_reads_the_cache_as_given(rng):
    """``update_kv_cache=False``: the cache comes back unchanged and the output is
    `ragged_paged_attention`'s over it (the same bits)."""
    args, _ = tpu_v3_batch(rng, dtype="bfloat16", num_seqs=3, head_dim=128, padded_dim=128)
    q, keys, values, packed, kv_lens, flat_tables, cu_q_lens, distribution = map(jnp.asarray,
                                                                                  args)
    out, cache = ragged_paged_attention_v3(
        q, keys * jnp.nan, values, packed, kv_lens, flat_tables, cu_q_lens, distribution,
        update_kv_cache=False, sm_scale=0.1)
    np.testing.assert_array_equal(bits(cache), bits(packed))
    fused = packed.reshape(*packed.shape[:2], -1, packed.shape[-1])
    want = ragged_paged_attention(q, fused, kv_lens, flat_tables.reshape(len(kv_lens), -1),
                                  cu_q_lens, distribution[2:], sm_scale=0.1)
    np.testing.assert_array_equal(bits(out), bits(want))


def test_v3_under_jit_donates_the_cache_and_serves_every_distribution(rng):
    """Jitted with the cache donated (as the engines call it): one program for every
    ``distribution``, the cache updated in place."""
    args, written = tpu_v3_batch(rng, dtype="bfloat16", num_seqs=4, head_dim=128, padded_dim=128)
    run = jax.jit(functools.partial(ragged_paged_attention_v3, sm_scale=0.1),
                  donate_argnums=(3,))
    args = list(map(jnp.asarray, args))
    out, cache = run(*args)
    np.testing.assert_array_equal(bits(cache), bits(written.reshape(cache.shape)))
    programs = run._cache_size()
    args[3], args[7] = cache, jnp.array([0, 0, 2], jnp.int32)
    run(*args)
    assert run._cache_size() == programs


@pytest.mark.parametrize("change,match", [
    (dict(use_causal_mask=False), r"use_causal_mask=False: only causal attention"),
    (dict(distribution=jnp.zeros((2,), jnp.int32)), r"distribution.shape=\(2,\) must be \(3,\)"),
    (dict(kv_cache=jnp.zeros((6, 8, 4, 128), jnp.bfloat16)), r"TPU's packed fused cache"),
    (dict(kv_cache=jnp.zeros((6, 8, 4, 1, 128), jnp.bfloat16)), r"must pack the 4 combined"),
    (dict(keys=jnp.zeros((7, 2, 64), jnp.float32)), r"keys.dtype=float32 must be the cache's"),
    (dict(page_indices=jnp.zeros((7,), jnp.int32)), r"page_indices.shape=\(7,\) must hold"),
])
def test_v3_refusals_name_the_argument(rng, change, match):
    args, _ = tpu_v3_batch(rng, dtype="bfloat16", num_seqs=2, head_dim=64, padded_dim=128)
    names = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens",
             "distribution")
    kwargs = dict(zip(names, map(jnp.asarray, args)))
    if "keys" in change:
        change = dict(keys=jnp.zeros((args[0].shape[0], 2, 64), jnp.float32))
    kwargs.update(change)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention_v3(*(kwargs[n] for n in names), **options)

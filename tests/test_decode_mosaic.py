"""`decode(..., impl="mosaic")`, the Mosaic GPU kernel, against the float64 oracle within the
tolerance rule: every option, fp8 caches, split-K, GQA, and the SPEC invariants I2-I7; the kernel's
refusals, ``impl="auto"``'s choice, its lowering for CUDA and its shared-memory model.

On a CPU the kernel runs in Mosaic GPU's interpret mode (``plgpu.InterpretGPUParams``: shared
memory, TMA, barriers and wgmma simulated, with race detection), so the shapes are small; on a GPU
the same tests run the compiled kernel, and the ``gpu`` tests add realistic shapes. jax < 0.11.2
has no ``plgpu.kernel`` of this API: the kernel's tests are skipped there (the ValueError it gives
is tested with a patched version number); the tests of ``impl="auto"``'s choice, marked
`on_every_jax`, run on every jax.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
import torch_ref
from paged_inputs import (NP_DTYPES, assert_close, bits, jax_options, launched_ops, make_paged,
                          reference, repeat_mapping_truth, to_numpy, used_entries)
from pallas_paged import _mosaic_common
from pallas_paged._platform import resolve_interpret, xla_cpu_threads
from pallas_paged.decode_attention import api, mosaic_gpu, mosaic_gpu_config
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
from pallas_paged.decode_attention.shape import shape_class
from parity.tolerance import ATOL

KERNEL_API = _mosaic_common.jax_version() >= _mosaic_common.MIN_JAX  # plgpu.kernel as the kernel uses it
# Interpret mode where there is no GPU, compiled where there is (as decode's interpret=None): the
# Mosaic GPU interpreter on a GPU machine is far too slow for a test.
NO_GPU = jax.devices()[0].platform != "gpu"


def on_every_jax(test):
    """Marks a test that holds on every jax (it runs no Mosaic kernel): `_needs_the_kernel_api`
    spares it."""
    test.on_every_jax = True
    return test


@pytest.fixture(autouse=True)
def _needs_the_kernel_api(request):
    """Skips every test not marked `on_every_jax` on a jax without the kernel's API."""
    if not KERNEL_API and not getattr(request.function, "on_every_jax", False):
        pytest.skip(f"impl='mosaic' needs jax >= 0.11.2 (plgpu.kernel); this is jax"
                    f" {jax.__version__}")

SLOW = pytest.mark.slow


def slow_but(values, *fast):
    """``values`` as params, those not in ``fast`` marked slow: in interpret mode each runs the
    kernel for seconds, so the fast set keeps one case of each behaviour."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=[] if v in fast else [SLOW])
            for v in values]

# The compiled kernel at realistic shapes is compared with impl="xla" (the oracle's float64 loops
# take minutes there, and the rule's naive baseline as long): within XLA_ROUNDINGS roundings of
# the output dtype (`parity.tolerance.ATOL`) at the output's scale, the output's and that of the
# softmax weights for the P V wgmma, with as much again of room.
XLA_ROUNDINGS = 4
ONE_SPLIT = MosaicDecodeConfig(block_k=64, num_splits=1, num_stages=2)
THREE_SPLITS = MosaicDecodeConfig(block_k=64, num_splits=3, num_stages=2)
# Two consumer warpgroups (tiles dealt alternately), with splits: 3 x 2 partial results.
TWO_CONSUMERS = MosaicDecodeConfig(block_k=64, num_splits=3, num_stages=2, num_consumers=2)


# The queries in N with more stages, with splits.
QN_FOUR_STAGES = MosaicDecodeConfig(block_k=64, num_splits=3, num_stages=4, queries_in_n=True)
# The queries in N with three consumers (their cross-warp reductions lowered apart), with splits.
QN_THREE_CONSUMERS = MosaicDecodeConfig(block_k=64, num_splits=2, num_stages=3, num_consumers=3,
                                        queries_in_n=True)


def in_n(config):
    """``config`` with the group's queries in the wgmmas' N (`MosaicDecodeConfig.queries_in_n`)."""
    return dataclasses.replace(config, queries_in_n=True)


def mosaic(paged, config=ONE_SPLIT, **kwargs):
    """``impl="mosaic"`` on ``paged`` -> numpy float32 (and lse with ``return_lse``)."""
    out = pp.decode(*paged.jax(), impl="mosaic", config=config, **jax_options(kwargs))
    if kwargs.get("return_lse"):
        return to_numpy(out[0]).astype(np.float32), to_numpy(out[1])
    return to_numpy(out).astype(np.float32)


def assert_matches_oracle(paged, dtype, config=ONE_SPLIT, **kwargs):
    """The kernel's output and lse against the float64 truth within the tolerance rule; the
    output as float32 numpy."""
    kwargs.pop("return_lse", None)
    out, lse = pp.decode(*paged.jax(), impl="mosaic", config=config, return_lse=True,
                         **jax_options(kwargs))
    assert np.dtype(out.dtype).name == dtype
    assert_close(reference(*paged.arrays(), **kwargs), out, lse, what=str(config))
    return to_numpy(out).astype(np.float32)


def assert_near_xla(got, want, dtype: str) -> None:
    """`XLA_ROUNDINGS` roundings of ``dtype`` at the output's scale (see there)."""
    got, want = (to_numpy(x).astype(np.float64) for x in (got, want))
    assert np.isfinite(got).all()
    bound = XLA_ROUNDINGS * ATOL[dtype] * max(1.0, np.abs(want).max())
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


def every_option(rng, num_heads):
    return dict(logits_soft_cap=3.0,
                alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                sliding_window=37,
                sinks=rng.standard_normal(num_heads).astype(np.float32))


# --- against the oracle and torch_ref ------------------------------------------------------------

@pytest.mark.parametrize("dtype,config", slow_but([
    ("bfloat16", THREE_SPLITS), ("float16", ONE_SPLIT), ("bfloat16", TWO_CONSUMERS),
    ("float16", MosaicDecodeConfig(block_k=64, num_splits=1, num_stages=4, num_consumers=2)),
    ("bfloat16", in_n(THREE_SPLITS)), ("float16", QN_FOUR_STAGES),
    ("bfloat16", in_n(TWO_CONSUMERS)), ("float16", QN_THREE_CONSUMERS)],
    ("bfloat16", in_n(THREE_SPLITS))))
def test_matches_the_truth(rng, dtype, config):
    """Lengths 0, 1, bs, bs + 1 and longer, GQA 4: one split, three (merged after the kernel),
    two consumers, the queries in N, more stages, three consumers."""
    paged = make_paged(rng, lens=[150, 0, 1, 16, 17, 64], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=dtype)
    assert_matches_oracle(paged, dtype, config)


@pytest.mark.parametrize("queries_in_n", slow_but([False, True], True))
@pytest.mark.parametrize("num_heads,num_kv_heads", slow_but([(4, 4), (4, 2), (8, 2), (8, 1),
                                                             (12, 1)], (12, 1)))
def test_gqa_groups(rng, num_heads, num_kv_heads, queries_in_n):
    """Groups of 1, 2, 4, 8 and 12 query heads per kv head, all in one wgmma (with
    ``queries_in_n``, N = 8 or 16)."""
    paged = make_paged(rng, lens=[70, 9], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=64, block_size=16, dtype="bfloat16")
    config = dataclasses.replace(ONE_SPLIT, queries_in_n=queries_in_n)
    assert_matches_oracle(paged, "bfloat16", config)


@pytest.mark.slow
def test_i5_gqa_is_repeat_interleave(rng):
    """Head h reads kv head h // (H / KVH): the truth, and clearly not what `repeat` gives."""
    paged = make_paged(rng, lens=[40, 14], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype="float16")
    out = assert_matches_oracle(paged, "float16")
    # `repeat` (h -> h % KVH) gives a clearly different answer on these inputs.
    assert np.abs(out - repeat_mapping_truth(*paged.arrays())).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("queries_in_n", [False, True])
@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_block_sizes(rng, block_size, queries_in_n):
    """Pages smaller than a tile (several TMA copies per tile) and larger (a slice per tile);
    lengths 1, bs - 1, bs, bs + 1, 2 bs + 3."""
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    # fp16: a bf16 group of 4 padded to 8 rows aborts interpret mode on some jaxlib / CPU pairs
    # (`test_interpret_mode_takes_bf16_groups_padded_in_n`)
    paged = make_paged(rng, lens=lens, num_heads=4, num_kv_heads=1, head_dim=64,
                       block_size=block_size, dtype="float16")
    assert_matches_oracle(paged, "float16", MosaicDecodeConfig(num_splits=2, num_stages=2,
                                                               queries_in_n=queries_in_n))


@pytest.mark.parametrize("which,config", slow_but([
    ("alibi_slopes", THREE_SPLITS), ("sinks", THREE_SPLITS), ("all", THREE_SPLITS),
    ("all", TWO_CONSUMERS), ("all", in_n(THREE_SPLITS)), ("all", QN_FOUR_STAGES)],
    ("all", in_n(THREE_SPLITS))))  # window, soft-cap: below
def test_options(rng, which, config):
    """ALiBi, sinks, and every option together with an explicit scale, through splits, two consumers
    and the queries in N."""
    paged = make_paged(rng, lens=[150, 0, 1, 40, 64], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16")
    every = every_option(rng, 8)
    options = every if which == "all" else {which: every[which]}
    assert_matches_oracle(paged, "bfloat16", config, scale=0.2, **options)


@pytest.mark.parametrize("window,config", slow_but([(1, THREE_SPLITS), (17, THREE_SPLITS),
                                                    (100, THREE_SPLITS), (17, in_n(THREE_SPLITS))],
                                                   (17, THREE_SPLITS)))
def test_sliding_window_skips_pages_before_it(rng, window, config):
    """Whole pages before the window hold NaN (they are not read); the window may start inside a
    page and inside a tile."""
    paged = make_paged(rng, lens=[200, 33, 5], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16", fill=np.nan)
    ref = reference(*paged.arrays(), sliding_window=window)
    for b, n in enumerate(paged.context_lens):
        for page in range(max(n - window, 0) // 16):
            paged.k_cache[paged.block_tables[b, page]] = np.nan
            paged.v_cache[paged.block_tables[b, page]] = np.nan
    out, lse = pp.decode(*paged.jax(), impl="mosaic", config=config, sliding_window=window,
                         return_lse=True)
    assert np.isfinite(np.asarray(out).astype(np.float32)).all()
    assert_close(ref, out, lse)


FP8_K_V = dataclasses.replace(QN_THREE_CONSUMERS, fp8_k_in_registers=True, fp8_v_in_producer=True)


@pytest.mark.parametrize("q_dtype,config", slow_but([
    ("bfloat16", THREE_SPLITS), ("float16", THREE_SPLITS), ("bfloat16", TWO_CONSUMERS),
    ("bfloat16", in_n(THREE_SPLITS)), ("float16", QN_FOUR_STAGES), ("bfloat16", FP8_K_V)],
    ("bfloat16", FP8_K_V)))
def test_fp8_cache(rng, q_dtype, config):
    """fp8 caches read with bf16 and fp16 queries, through every layout (and the fp8 conversions in
    registers and in the producer)."""
    paged = make_paged(rng, lens=[100, 0, 17], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="float8_e4m3fn", q_dtype=q_dtype)
    assert_matches_oracle(paged, q_dtype, config, k_scale=0.5, v_scale=2.0)


@pytest.mark.slow
def test_fp8_scales_may_be_traced_operands(rng):
    """The kernel takes ``k_scale`` / ``v_scale`` as f32[] operands (one program for every scale),
    with the same result as python floats."""
    paged = make_paged(rng, lens=[40, 3], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="float8_e4m3fn")
    options = dict(scale=0.125, config=ONE_SPLIT, interpret=NO_GPU, logits_soft_cap=None,
                   alibi_slopes=None, sliding_window=None, sinks=None)
    run = jax.jit(lambda k_scale, v_scale: mosaic_gpu.decode_mosaic(
        *paged.jax(), k_scale=k_scale, v_scale=v_scale, **options))
    traced = run(jnp.float32(0.5), jnp.float32(2.0))
    floats = mosaic_gpu.decode_mosaic(*paged.jax(), k_scale=0.5, v_scale=2.0, **options)
    for got, expected in zip(traced, floats):
        np.testing.assert_array_equal(to_numpy(got), to_numpy(expected))


def test_fp8_cache_bf16_query_beyond_fp16_range(rng):
    """The fp16 wgmmas of an fp8 cache take a bf16 query of magnitude 2**17 (past fp16's 65504):
    it is divided by a power of two and the scores multiplied back, so nothing overflows."""
    paged = make_paged(rng, lens=[70, 5], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="float8_e4m3fn")
    paged.q = (paged.q.astype(np.float32) * 2.0**17).astype(paged.q.dtype)
    assert_matches_oracle(paged, "bfloat16", scale=2.0**-17 / 8, k_scale=0.5, v_scale=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("config", [ONE_SPLIT, in_n(ONE_SPLIT)])
def test_fp8_cache_every_option_nan_poisoned(rng, config):
    """fp8 NaN codes in every unused slot (e4m3fn has no Inf) with every option."""
    paged = make_paged(rng, lens=[90, 1, 33], num_heads=4, num_kv_heads=1, head_dim=128,
                       block_size=16, dtype="float8_e4m3fn", fill=np.nan)
    assert_matches_oracle(paged, "bfloat16", config, k_scale=0.25, v_scale=0.75,
                          **every_option(rng, 4))


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_groups_read_in_boxes_of_8_rows(rng, cache):
    """Groups of 4 of 8 heads with one part each: the kernel reads the query (slopes, sinks) in
    boxes of 8 rows, its group at column 0 or 4 (`mosaic_gpu.reads_rows_of_8`). Every option
    against the oracle; then a changed query head (a neighbour in the other group's box)
    changes its own output and nothing else."""
    dtype = "float16" if cache == "float8_e4m3fn" else "bfloat16"  # a bf16 query is converted
    paged = make_paged(rng, lens=[90, 0, 33, 17, 64], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=cache)
    paged.q = paged.q.astype(NP_DTYPES[dtype])
    scales = dict(k_scale=0.25, v_scale=0.75) if cache == "float8_e4m3fn" else {}
    config = in_n(ONE_SPLIT)
    assert mosaic_gpu.reads_rows_of_8(config, num_heads=8, group=4, normalized_in_mosaic=True,
                                      converts_query=False)
    assert_matches_oracle(paged, dtype, config, **scales, **every_option(rng, 8))
    clean = mosaic(paged, config, **scales)
    # sequence 2, query head 5 (kv head 1): column 5 of its own box, and of kv head 0's, whose
    # group is its columns 0-3
    paged.q[2, 5] = (paged.q[2, 5].astype(np.float32) * 50).astype(paged.q.dtype)
    changed = mosaic(paged, config, **scales)
    assert not np.array_equal(changed[2, 5], clean[2, 5])
    others = np.ones(changed.shape[:2], bool)
    others[2, 5] = False
    np.testing.assert_array_equal(changed[others], clean[others])


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,cache,config", [
    # decode's own config: 64-token tiles in 2 stages past head_dim 128 (fp8: the producer
    # converts V; K takes the shared-memory path in interpret mode)
    (256, "bfloat16", None), (256, "float8_e4m3fn", None),
    # three parts, merged by the Mosaic merge kernel
    (256, "bfloat16", MosaicDecodeConfig(block_k=64, num_splits=3, num_stages=2,
                                         queries_in_n=True)),
    # 128-token tiles fit at 192; the group's queries in M
    (192, "float16", MosaicDecodeConfig(block_k=128, num_splits=2, num_stages=2,
                                        queries_in_n=True)),
    (192, "bfloat16", MosaicDecodeConfig(block_k=64, num_splits=2, num_stages=2)),
], ids=["d256", "d256_fp8", "d256_three_parts", "d192_bk128", "d192_queries_in_m"])
def test_head_dims_192_and_256(rng, head_dim, cache, config):
    """head_dim 192 and 256, the M of ``O^T = V^T P^T`` in three and four wgmma rows of 64, with
    every option, against the truth."""
    dtype = "float16" if cache != "bfloat16" else "bfloat16"
    paged = make_paged(rng, lens=[150, 0, 1, 17], num_heads=8, num_kv_heads=2,
                       head_dim=head_dim, block_size=16, dtype=cache, q_dtype=dtype)
    options = every_option(rng, 8)
    if cache == "float8_e4m3fn":
        options.update(k_scale=0.5, v_scale=0.25)
    assert_matches_oracle(paged, dtype, config, **options)


@pytest.mark.parametrize("config", slow_but([ONE_SPLIT, in_n(ONE_SPLIT), THREE_SPLITS,
                                              in_n(THREE_SPLITS)], ONE_SPLIT), ids=str)
def test_a_nan_query_propagates_as_in_torch_ref(rng, config):
    """A NaN query head gives a NaN output row and lse, as torch_ref's softmax does, and changes
    no other head: normalized in the kernel (its queries read in boxes of 8 rows with the queries
    in N) or merged after it."""
    paged = make_paged(rng, lens=[40, 9, 0, 70], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16")
    paged.q[0, 1] = np.nan
    out = assert_matches_oracle(paged, "bfloat16", config)
    expected = torch_ref.paged_decode_attention(*paged.torch())
    assert np.isnan(out[0, 1]).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(to_numpy(expected).astype(np.float32)))


@pytest.mark.parametrize("value", slow_but([np.inf, -np.inf, np.nan], np.inf))
def test_a_non_finite_value_row_reaches_only_its_own_outputs(rng, value):
    """An Inf or NaN in one valid V row of one dimension gives torch_ref's Inf or NaN in that
    dimension of the group's outputs and nothing else: through the identity wgmma that turns the
    normalized ``O^T`` into rows, where a product by its zeros would spread ``0 * Inf``."""
    paged = make_paged(rng, lens=[40, 9, 0, 70], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16")
    block = paged.block_tables[3, 1]  # sequence 3's second page: positions 16-31
    paged.v_cache[block, 5, 0, 7] = value  # position 21, kv head 0 (query heads 0-3), dim 7
    out = assert_matches_oracle(paged, "bfloat16", in_n(ONE_SPLIT))
    expected = to_numpy(torch_ref.paged_decode_attention(*paged.torch())).astype(np.float32)
    assert not np.isfinite(out[3, :4, 7]).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(expected))
    np.testing.assert_array_equal(np.sign(out[np.isinf(out)]), np.sign(expected[np.isinf(out)]))


# --- SPEC invariants -------------------------------------------------------------------------------

@pytest.mark.parametrize("config", slow_but([ONE_SPLIT, in_n(ONE_SPLIT)], ONE_SPLIT))
def test_i2_table_tail_is_never_read(rng, config):
    """Entries past ceil(n / bs) hold 2**30 or -2**31: the output keeps every bit."""
    paged = make_paged(rng, lens=[5, 0, 33, 16], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, max_blocks=9, dtype="bfloat16", tail=(0,))
    clean = mosaic(paged, config)
    tables = paged.block_tables.copy()
    used = np.arange(tables.shape[1])[None, :] < -(-paged.context_lens // 8)[:, None]
    for garbage in (2**30, -(2**31)):
        tables[~used] = garbage
        np.testing.assert_array_equal(mosaic(paged.replace(block_tables=tables), config), clean)


@pytest.mark.parametrize("config", slow_but([ONE_SPLIT, in_n(ONE_SPLIT)], in_n(ONE_SPLIT)))
def test_i3_exactly_n_rows_enter(rng, config):
    """Huge values right after the last valid token of a partial page would dominate. (fp16: see
    `test_interpret_mode_takes_bf16_groups_padded_in_n`.)"""
    paged = make_paged(rng, lens=[1, 3, 16, 17, 63], num_heads=4, num_kv_heads=1, head_dim=64,
                       block_size=16, dtype="float16", fill=1e4)
    assert_matches_oracle(paged, "float16", config)


@pytest.mark.slow
def test_i4_paged_equals_dense(rng):
    """Shuffled physical blocks give, bit for bit, what the same sequences in contiguous blocks
    in order give, and the truth."""
    paged = make_paged(rng, lens=[70, 16, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, spare_blocks=10, dtype="float16")
    out = assert_matches_oracle(paged, "float16")
    width = paged.block_tables.shape[1]
    dense_tables = np.arange(3 * width, dtype=np.int32).reshape(3, width)
    used = used_entries(paged.block_tables, paged.context_lens, 8)
    k_dense, v_dense = (np.zeros((3 * width,) + c.shape[1:], c.dtype)
                        for c in (paged.k_cache, paged.v_cache))
    k_dense[dense_tables[used]] = paged.k_cache[paged.block_tables[used]]
    v_dense[dense_tables[used]] = paged.v_cache[paged.block_tables[used]]
    dense = paged.replace(k_cache=k_dense, v_cache=v_dense, block_tables=dense_tables)
    np.testing.assert_array_equal(bits(mosaic(dense)), bits(out))


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("config", slow_but([THREE_SPLITS, in_n(THREE_SPLITS)],
                                            in_n(THREE_SPLITS)))
@pytest.mark.parametrize("fill", slow_but([np.nan, np.inf], np.nan))
def test_i6_poisoned_unused_slots_change_nothing(rng, fill, config):
    """NaN/Inf in every slot that is not a valid token, split tiles and partial pages included:
    bit-identical to a clean cache."""
    state = rng.bit_generator.state
    poisoned = make_paged(rng, lens=[70, 0, 12, 3], num_heads=4, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype="bfloat16", fill=fill)
    rng.bit_generator.state = state
    clean = make_paged(rng, lens=[70, 0, 12, 3], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16", fill=0.0)
    out = mosaic(poisoned, config)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, mosaic(clean, config))


@pytest.mark.slow
@pytest.mark.parametrize("config", [THREE_SPLITS, in_n(THREE_SPLITS)])
def test_i7_zero_length_rows(rng, config):
    """Zero-length rows give zeros and lse -inf with a sink; the others are the truth."""
    paged = make_paged(rng, lens=[0, 9, 0, 40], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype="bfloat16")
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = mosaic(paged, config, return_lse=True, sinks=sinks)
    assert (out[[0, 2]] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    assert_matches_oracle(paged, "bfloat16", config, sinks=sinks)


@pytest.mark.parametrize("config", slow_but([ONE_SPLIT, in_n(ONE_SPLIT)], in_n(ONE_SPLIT)))
def test_out_of_range_ids_and_lengths_are_clamped(rng, config):
    """Unchecked (``check_values=False``, as under jit) a bad id inside the valid part reads a
    clamped block, never outside the cache; lengths are clamped into [0, capacity]. Checked (an
    eager call's default), the same values are refused before the kernel runs."""
    paged = make_paged(rng, lens=[17, 24], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype="bfloat16", fill=0.0)
    num_blocks = paged.k_cache.shape[0]
    tables = paged.block_tables.copy()
    tables[0, 1], tables[1, 0], tables[1, 2] = 2**30, -5, num_blocks
    bad = paged.replace(block_tables=tables, context_lens=np.array([17, 1000], np.int32))
    fixed = paged.replace(block_tables=np.clip(tables, 0, num_blocks - 1),
                          context_lens=np.array([17, 24], np.int32))
    np.testing.assert_array_equal(mosaic(bad, config, check_values=False), mosaic(fixed, config))
    with pytest.raises(ValueError, match=r"context_lens\[1\]=1000 exceeds the table's capacity"):
        mosaic(bad, config)


@pytest.mark.slow
def test_usable_inside_user_jit(rng):
    """decode(impl="mosaic") traced inside a caller's jax.jit gives the eager result, bit for bit."""
    paged = make_paged(rng, lens=[6, 11], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype="bfloat16")

    @jax.jit
    def step(q, k_cache, v_cache, tables, lens):
        return pp.decode(q, k_cache, v_cache, tables, lens, impl="mosaic", config=ONE_SPLIT) * 2

    np.testing.assert_array_equal(to_numpy(step(*paged.jax())).astype(np.float32),
                                  2 * mosaic(paged))


BF16_PADDED_GROUP = """
import sys
sys.path.insert(0, "tests")
import parity
import numpy as np
import pallas_paged as pp
from paged_inputs import make_paged
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
p = make_paged(np.random.default_rng(0), lens=[17, 3], num_heads=4, num_kv_heads=1, head_dim=64,
               block_size=16, dtype="bfloat16", fill=0.0)
config = MosaicDecodeConfig(block_k=64, num_splits=1, num_stages=2, queries_in_n=True)
out = pp.decode(*p.jax(), impl="mosaic", config=config, interpret=True)
assert np.isfinite(np.asarray(out).astype(np.float32)).all()
"""


@pytest.mark.slow
@pytest.mark.skipif(not NO_GPU, reason="interpret mode on a CPU")
@pytest.mark.xfail(strict=False, reason="jaxlib 0.12.1's XLA:CPU aborts (LLVM 'Cannot select:"
                   " v8bf16 = X86ISD::VBROADCAST' in select_convert_fusion) on an AMD EPYC")
def test_interpret_mode_takes_bf16_groups_padded_in_n():
    """A bf16 query with a group of 4 padded to 8 rows, the queries in N (H=4, KVH=1), in
    interpret mode, in a process of its own: where XLA:CPU cannot compile the interpreter's
    program it aborts the process, which would take a test run with it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", BF16_PADDED_GROUP], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# --- what the kernel refuses, with a ValueError naming the argument ------------------------------

def warn_if_interpret_may_stall(interpret: bool, config: MosaicDecodeConfig) -> None:
    """`_mosaic_common.warn_if_interpret_may_stall` for the decode kernel's warpgroups."""
    _mosaic_common.warn_if_interpret_may_stall(interpret, 1 + config.num_consumers,
                                               fewer="num_consumers")


def auto_impl(q, k_cache, tables, *, interpret=None, config=None) -> str:
    """The kernel ``decode(..., impl="auto")`` runs for these arrays (`api.select_kernel`)."""
    return api.select_kernel(q, k_cache, tables, impl="auto", config=config,
                             interpret=resolve_interpret(interpret))[0]


def picked_mosaic_config(args) -> MosaicDecodeConfig:
    """The config ``decode(..., impl="mosaic")`` picks for these arrays."""
    return mosaic_gpu_config.lookup_mosaic(api.decode_shape(args[0], args[1], args[3]),
                                           api.device_kind(), api.sm_count())


def _abstract(batch=2, num_heads=8, kvh=2, head_dim=64, block_size=16, dtype=jnp.bfloat16,
              cache_dtype=None):
    q = jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((40, block_size, kvh, head_dim), cache_dtype or dtype)
    return (q, cache, cache, jax.ShapeDtypeStruct((batch, 8), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


def _kernel_finalizes(config, args) -> bool:
    """`mosaic_gpu.finalizes` for `_abstract`'s inputs ``args`` (q, caches, tables, lengths)."""
    q, cache = args[0], args[1]
    return mosaic_gpu.finalizes(config, batch=q.shape[0], kvh=cache.shape[2],
                                group=q.shape[1] // cache.shape[2], head_dim=q.shape[2],
                                cache_dtype=cache.dtype,
                                compute_dtype=mosaic_gpu.dot_dtype(q.dtype, cache.dtype),
                                sm_count=mosaic_gpu.sm_count())


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=jnp.float32), r"q.dtype=.*float32.*TF32"),
    (dict(head_dim=32), r"head_dim in \(64, 128, 192, 256\).*q.shape=\(2, 8, 32\)"),
    (dict(head_dim=96), r"head_dim in \(64, 128, 192, 256\).*head_dim=96"),
    (dict(head_dim=320), r"head_dim in \(64, 128, 192, 256\).*head_dim=320"),
    (dict(block_size=12), r"block_size a multiple of 8.*block_size=12"),
    (dict(block_size=48), r"block_size a multiple of 8.*block_size=48"),
    (dict(num_heads=128, kvh=1), r"up to 64 query heads per kv head"),
    # (the shared static validation may refuse the mix first, in its own words)
    (dict(cache_dtype=jnp.float16), r"caches of q's dtype or float8_e4m3fn|must equal k_cache"),
])
def test_unsupported_inputs_raise(kwargs, match):
    """Each shape or dtype the kernel does not take: a ValueError naming it, at trace time."""
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(pp.decode, impl="mosaic", interpret=True),
                       *_abstract(**kwargs))


def test_refusals_print_dtypes_as_bare_names():
    """The kernel's refusals name dtypes as the shared validation does (``q.dtype=float32``),
    never as their repr (``dtype('float32')``)."""
    with pytest.raises(ValueError) as info:
        jax.eval_shape(functools.partial(pp.decode, impl="mosaic", interpret=True),
                       *_abstract(dtype=jnp.float32))
    assert "q.dtype=float32" in str(info.value) and "dtype(" not in str(info.value)


@pytest.mark.parametrize("config", [
    MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True),
    MosaicDecodeConfig(block_k=64, num_stages=2)])  # the group's 64 query rows in M
def test_head_dim_256_configs_past_shared_memory_raise(config):
    """At head_dim 256 two stages of 128-token tiles (256 KiB of K and V), or the group's queries
    in M, need more shared memory than a CTA has: a ValueError with the bytes and the way out."""
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory for"
                                         r" k_cache.shape=\(40, 16, 2, 256\).*queries_in_n=True"):
        jax.eval_shape(functools.partial(pp.decode, impl="mosaic", interpret=True,
                                         config=config), *_abstract(head_dim=256))


@on_every_jax
def test_interpret_mode_warns_where_the_cpu_pools_cannot_hold_every_warpgroup(monkeypatch):
    """Interpret mode warns when NPROC gives the XLA CPU pools fewer threads than the config's
    warpgroups (it could stall), and only then."""
    four_warpgroups = MosaicDecodeConfig(block_k=64, num_splits=1, num_stages=3, num_consumers=3)
    monkeypatch.setattr(_mosaic_common, "has_gpu", lambda: False)  # the pools' warning alone
    monkeypatch.setenv("NPROC", "2")
    with pytest.warns(RuntimeWarning, match="4 warpgroups .* 2 threads .* NPROC=8"):
        warn_if_interpret_may_stall(True, four_warpgroups)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_interpret_may_stall(False, four_warpgroups)  # compiled: no host threads
        warn_if_interpret_may_stall(True, ONE_SPLIT)         # 2 warpgroups, 2 threads
        monkeypatch.setenv("NPROC", "8")
        warn_if_interpret_may_stall(True, four_warpgroups)


@on_every_jax
def test_interpret_mode_warns_where_a_gpu_is_the_default_backend(monkeypatch):
    """Interpret mode with the GPU as JAX's backend did not finish a two-sequence call in 100 s
    on an H200: the call warns and says where to run it instead."""
    monkeypatch.setenv("NPROC", "8")
    monkeypatch.setattr(_mosaic_common, "has_gpu", lambda: True)
    with pytest.warns(RuntimeWarning, match="GPU as JAX's default backend.*JAX_PLATFORMS=cpu"):
        warn_if_interpret_may_stall(True, ONE_SPLIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_interpret_may_stall(False, ONE_SPLIT)  # compiled on the GPU
        monkeypatch.setattr(_mosaic_common, "has_gpu", lambda: False)
        warn_if_interpret_may_stall(True, ONE_SPLIT)   # interpret mode on a CPU


@on_every_jax
@pytest.mark.skipif(not NO_GPU or not os.path.isdir("/proc/self/task"),
                    reason="counts the XLA CPU client's threads: Linux, JAX on the CPU")
def test_the_xla_cpu_pools_hold_every_warpgroup_of_the_interpreted_kernel():
    """conftest imports parity before JAX starts, and parity sets NPROC: the pools this process
    really got hold the five warpgroups of four consumers, so interpret mode cannot stall."""
    jnp.zeros(1).block_until_ready()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    most_warpgroups = 1 + mosaic_gpu_config.MAX_MOSAIC_CONSUMERS
    assert names.count("tf_XLAEigen") >= most_warpgroups, sorted(set(names))
    assert xla_cpu_threads() >= most_warpgroups


def test_config_type_and_fields_are_checked():
    """A config of the wrong type, and every bad MosaicDecodeConfig field, are refused with a message
    naming it."""
    args = _abstract()
    with pytest.raises(ValueError, match="config must be a MosaicDecodeConfig"):
        jax.eval_shape(functools.partial(pp.decode, impl="mosaic", config=pp.DecodeConfig()),
                       *args)
    with pytest.raises(ValueError, match="config must be a DecodeConfig"):
        jax.eval_shape(functools.partial(pp.decode, impl="pallas", config=ONE_SPLIT), *args)
    with pytest.raises(ValueError, match="block_k=32 must be 64 or 128"):
        MosaicDecodeConfig(block_k=32)
    with pytest.raises(ValueError, match="num_stages=1 must be >= 2"):
        MosaicDecodeConfig(num_stages=1)
    with pytest.raises(ValueError, match="num_consumers=5 must be 1 to 4"):
        MosaicDecodeConfig(num_consumers=5)
    with pytest.raises(ValueError, match="num_stages=3 must be a multiple of num_consumers=2"):
        MosaicDecodeConfig(num_stages=3, num_consumers=2)
    with pytest.raises(ValueError, match="num_consumers=True must be a positive int"):
        MosaicDecodeConfig(num_consumers=True)
    with pytest.raises(ValueError, match="queries_in_n=1 must be a bool"):
        MosaicDecodeConfig(queries_in_n=1)
    with pytest.raises(ValueError, match="fp8_k_in_registers=0 must be a bool"):
        MosaicDecodeConfig(queries_in_n=True, fp8_k_in_registers=0)
    with pytest.raises(ValueError, match=r"fp8_k_in_registers=True, queries_in_n=False.*A operand"):
        MosaicDecodeConfig(fp8_k_in_registers=True)
    with pytest.raises(ValueError, match="fp8_v_in_producer=1 must be a bool"):
        MosaicDecodeConfig(fp8_v_in_producer=1)
    with pytest.raises(ValueError, match="persistent=1 must be a bool"):
        MosaicDecodeConfig(persistent=1)
    with pytest.raises(ValueError, match=r"persistent=True, num_consumers=2.*one consumer"):
        MosaicDecodeConfig(persistent=True, num_consumers=2, num_stages=2)
    with pytest.raises(ValueError, match=r"persistent=True.*fp8_v_in_producer=True"):
        MosaicDecodeConfig(persistent=True, fp8_v_in_producer=True)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(functools.partial(
            pp.decode, impl="mosaic", interpret=True,
            config=MosaicDecodeConfig(block_k=128, num_stages=8)), *args)


@on_every_jax
def test_queries_in_n_pads_the_group_to_wgmma_n_and_needs_less_shared_memory():
    """With the queries in N the group is padded to a multiple of 8 rows, not 64, and q, P and
    the partial results shrink with it: 128-token bf16 tiles fit 3 stages instead of 2."""
    rows = mosaic_gpu.query_rows
    assert [rows(g, in_n(ONE_SPLIT)) for g in (1, 4, 8, 12, 64)] == [8, 8, 8, 16, 64]
    assert {rows(g, ONE_SPLIT) for g in (1, 4, 8, 12, 64)} == {64}
    three = MosaicDecodeConfig(block_k=128, num_stages=3)
    need = functools.partial(mosaic_gpu.smem_bytes, 128, "bfloat16", "bfloat16", alibi=True,
                             group=4)
    assert need(config=three) > mosaic_gpu.MAX_SMEM_BYTES >= need(config=in_n(three))
    assert need(config=in_n(three)) < need(config=three) - 50_000  # q, P and o of 8 rows


@on_every_jax
def test_old_jax_raises(monkeypatch):
    """On a jax before the kernel's API, impl="mosaic" says which jax it needs."""
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: (0, 10, 2))
    with pytest.raises(ValueError, match=r"impl='mosaic' needs jax >= 0.11.2"):
        jax.eval_shape(functools.partial(pp.decode, impl="mosaic", interpret=True), *_abstract())


def test_compiled_needs_an_sm90_gpu(on_gpu):
    """Compiled, the kernel needs an sm_90 GPU (a ValueError elsewhere); interpret mode runs
    anywhere."""
    if on_gpu:
        kind = jax.devices()[0].device_kind
        capability = float(getattr(jax.devices()[0], "compute_capability", "0"))
        if capability >= 9.0:
            mosaic_gpu.check_device(interpret=False)  # no error on Hopper and later
            return
        pytest.skip(f"{kind} is not sm_90+")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        mosaic_gpu.check_device(interpret=False)
    mosaic_gpu.check_device(interpret=True)


def test_heuristic_config_fits_and_splits_small_batches():
    """The heuristic's configs fit the shared memory for every head_dim, batch and group (or the
    shape is refused), and split small batches over the multiprocessors."""
    shape = pp.DecodeShape(batch=1, num_kv_heads=8, group=4, head_dim=128, block_size=16,
                           capacity=32768, cache_dtype="bfloat16")
    from pallas_paged.decode_attention.mosaic_gpu_config import get_mosaic_heuristic_config
    config = get_mosaic_heuristic_config(shape, sm_count=132)
    assert config.num_splits >= 16  # B=1: enough CTAs for 132 SMs
    for dtype in ("bfloat16", "float8_e4m3fn"):
        for head_dim in mosaic_gpu.SUPPORTED_HEAD_DIMS:
            for batch, group in ((1, 4), (32, 4), (256, 4), (32, 1), (4, 64)):
                c = get_mosaic_heuristic_config(
                    pp.DecodeShape(batch, 8, group, head_dim, 16, 4096, dtype), sm_count=132)
                need = mosaic_gpu.smem_bytes(head_dim, dtype, "bfloat16", c, alibi=True,
                                             group=group)
                if head_dim == 256 and group == 64:  # past what any config fits: refused
                    why = mosaic_gpu.refusal(*_abstract(num_heads=64, kvh=1, head_dim=256,
                                                        cache_dtype=dtype)[:2], c, True)
                    assert need > mosaic_gpu.MAX_SMEM_BYTES and "impl='pallas'" in why
                    continue
                assert need <= mosaic_gpu.MAX_SMEM_BYTES, (dtype, head_dim, batch, group, c)


@pytest.mark.parametrize("batch,context,dtype,expected", [
    (1, 32768, "bfloat16", MosaicDecodeConfig(block_k=128, num_splits=16, num_stages=2,
                                              queries_in_n=True)),
    (32, 4096, "bfloat16", MosaicDecodeConfig(block_k=128, num_splits=1, num_stages=2,
                                              queries_in_n=True)),
    (128, 1024, "bfloat16", MosaicDecodeConfig(block_k=128, num_splits=1, num_stages=2,
                                               queries_in_n=True, persistent=True)),
    (8, 16384, "float8_e4m3fn", MosaicDecodeConfig(block_k=64, num_splits=4, num_stages=2,
                                                   queries_in_n=True, fp8_k_in_registers=True,
                                                   fp8_v_in_producer=True)),
    (32, 4096, "float8_e4m3fn", MosaicDecodeConfig(block_k=64, num_splits=1, num_stages=2,
                                                   queries_in_n=True, fp8_k_in_registers=True,
                                                   fp8_v_in_producer=True)),
])
def test_heuristic_config_at_the_measured_shapes(batch, context, dtype, expected):
    """The configs measured fastest on the H200 (docs/design/decode_mosaic.md): the queries in N
    with one consumer; 128-token tiles for 16-bit caches where the CTAs make about one wave, and
    past two waves in persistent CTAs; 64 for fp8 caches."""
    from pallas_paged.decode_attention.mosaic_gpu_config import get_mosaic_heuristic_config
    shape = pp.DecodeShape(batch=batch, num_kv_heads=8, group=4, head_dim=128, block_size=16,
                           capacity=context, cache_dtype=dtype)
    assert get_mosaic_heuristic_config(shape, sm_count=132) == expected


# --- impl="auto": the measured table, gated on what the Mosaic kernel can run ---------------------

def _class_of(args) -> tuple:
    q, k_cache, _, tables, _ = args
    return shape_class(api.decode_shape(q, k_cache, tables))


@on_every_jax
def test_auto_reads_the_measured_table(monkeypatch, sm90):
    """"mosaic" only where the table says so for the call's class on this device kind and the
    kernel can run it compiled; neighbours in the class share the entry."""
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: _mosaic_common.MIN_JAX)
    b2 = _abstract(batch=2)
    neighbour = _abstract(batch=2, head_dim=64, kvh=2, num_heads=6)  # group 3 rounds up to 4
    b32 = _abstract(batch=32)
    unmeasured = _abstract(batch=8)
    monkeypatch.setattr(api, "device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(api, "IMPL_CHOICE", {"NVIDIA H200": {
        _class_of(b2): "mosaic", _class_of(b32): "pallas"}})
    assert _class_of(neighbour) == _class_of(b2)
    assert auto_impl(b2[0], b2[1], b2[3], interpret=False) == "mosaic"
    assert auto_impl(neighbour[0], neighbour[1], neighbour[3], interpret=False) == "mosaic"
    assert auto_impl(b2[0], b2[1], b2[3], interpret=True) == "pallas"
    assert auto_impl(b32[0], b32[1], b32[3], interpret=False) == "pallas"
    assert auto_impl(unmeasured[0], unmeasured[1], unmeasured[3], interpret=False) == "pallas"
    monkeypatch.setattr(api, "device_kind", lambda: "NVIDIA H100")
    assert auto_impl(b2[0], b2[1], b2[3], interpret=False) == "pallas"


@on_every_jax
def test_impl_choice_table_is_well_formed():
    """Every entry names one of the two kernels under a key of `shape_class`'s form."""
    for kind, table in api.IMPL_CHOICE.items():
        assert isinstance(kind, str) and kind
        for key, impl in table.items():
            assert impl in ("mosaic", "pallas"), (kind, key, impl)
            dtype, *sizes = key
            assert dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn"), key
            assert len(sizes) == 5 and sizes[3] >= 1, key
            for i in (0, 1, 2, 4):  # head_dim, group, batch, capacity: powers of two
                assert sizes[i] >= 1 and sizes[i] & (sizes[i] - 1) == 0, key


@pytest.fixture
def mosaic_measured_faster(monkeypatch):
    """A table that prefers Mosaic for the classes of `_abstract`'s shapes on this device kind."""
    shapes = [_abstract(), _abstract(head_dim=32), _abstract(dtype=jnp.float32)]
    monkeypatch.setattr(api, "IMPL_CHOICE",
                        {api.device_kind(): {_class_of(a): "mosaic" for a in shapes}})


@pytest.fixture
def sm90(monkeypatch):
    """`check_device` lifted, as on a GPU of compute capability 9.0."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)


@on_every_jax
def test_auto_picks_mosaic_only_where_it_can_run_compiled(mosaic_measured_faster, sm90,
                                                          monkeypatch):
    """impl="auto" runs the Mosaic kernel where the table says so, compiled, on a jax and a shape it
    takes; the Triton kernel everywhere else."""
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: _mosaic_common.MIN_JAX)
    q, k_cache, _, tables, _ = _abstract()
    assert auto_impl(q, k_cache, tables, interpret=False) == "mosaic"
    # Never in interpret mode (None: interpret mode exactly when there is no GPU backend).
    assert auto_impl(q, k_cache, tables, interpret=True) == "pallas"
    expected = "mosaic" if jax.default_backend() == "gpu" else "pallas"
    assert auto_impl(q, k_cache, tables) == expected
    # Shapes and dtypes the kernel refuses (head_dim 32, fp32), although the table says mosaic.
    for args in (_abstract(head_dim=32), _abstract(dtype=jnp.float32)):
        assert auto_impl(args[0], args[1], args[3], interpret=False) == "pallas"
    # jax before the kernel's API.
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: (0, 11, 1))
    assert auto_impl(q, k_cache, tables, interpret=False) == "pallas"
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: _mosaic_common.MIN_JAX)
    # A config (the one it would use) that does not fit the shared memory.
    monkeypatch.setattr(mosaic_gpu, "MAX_SMEM_BYTES", 1024)
    assert auto_impl(q, k_cache, tables, interpret=False) == "pallas"


@on_every_jax
def test_auto_compiled_needs_an_sm90_gpu(mosaic_measured_faster):
    """Without the lift: on a CPU (or a GPU before sm_90) compiled calls get the Triton kernel."""
    q, k_cache, _, tables, _ = _abstract()
    try:
        mosaic_gpu.check_device(interpret=False)
        expected = "mosaic"
    except ValueError:
        expected = "pallas"
    assert auto_impl(q, k_cache, tables, interpret=False) == expected
    if jax.default_backend() != "gpu":
        assert expected == "pallas"


@on_every_jax
def test_auto_follows_an_explicit_config():
    """Under impl="auto" a config's type names the kernel, with that kernel's refusals."""
    q, k_cache, _, tables, _ = _abstract()
    assert auto_impl(q, k_cache, tables, config=pp.DecodeConfig()) == "pallas"
    if KERNEL_API:
        assert auto_impl(q, k_cache, tables, config=ONE_SPLIT) == "mosaic"
    else:  # the choice is the Mosaic kernel's, and so is its refusal of this jax
        with pytest.raises(ValueError, match="needs jax >= 0.11.2"):
            auto_impl(q, k_cache, tables, config=ONE_SPLIT)
    with pytest.raises(ValueError, match="config must be a DecodeConfig, a MosaicDecodeConfig"):
        jax.eval_shape(functools.partial(pp.decode, config=("block_k", 64)), *_abstract())
    # A Mosaic config under "auto" is impl="mosaic", with its refusals.
    old_jax = "needs jax >= 0.11.2"
    refusal = r"head_dim in \(64, 128, 192, 256\)" if KERNEL_API else old_jax
    with pytest.raises(ValueError, match=refusal):
        jax.eval_shape(functools.partial(pp.decode, config=ONE_SPLIT, interpret=True),
                       *_abstract(head_dim=32))
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU" if KERNEL_API else old_jax):
            jax.eval_shape(functools.partial(pp.decode, config=ONE_SPLIT, interpret=False),
                           *_abstract())


@on_every_jax
def test_unknown_impl_lists_auto():
    """An unknown impl is refused with the list of impls, "auto" first."""
    with pytest.raises(ValueError, match=r"impl='triton' must be one of \('auto', 'pallas',"
                                         r" 'xla', 'mosaic'\)"):
        jax.eval_shape(functools.partial(pp.decode, impl="triton"), *_abstract())


@on_every_jax
def test_auto_in_interpret_mode_is_pallas_bit_for_bit(rng, monkeypatch):
    """With the table preferring Mosaic for this class on this device kind, interpret mode still
    runs the Triton kernel: the default ``impl`` equals ``impl="pallas"`` bit for bit."""
    paged = make_paged(rng, lens=[150, 0, 1, 17], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16", fill=np.nan)
    args = paged.jax()
    monkeypatch.setattr(api, "IMPL_CHOICE", {api.device_kind(): {_class_of(args): "mosaic"}})
    options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
               for k, v in every_option(rng, 8).items()}
    auto, auto_lse = pp.decode(*args, interpret=True, return_lse=True, **options)
    pallas, pallas_lse = pp.decode(*args, impl="pallas", interpret=True, return_lse=True, **options)
    np.testing.assert_array_equal(to_numpy(auto), to_numpy(pallas))
    np.testing.assert_array_equal(to_numpy(auto_lse), to_numpy(pallas_lse))


def test_auto_with_a_mosaic_config_runs_the_mosaic_kernel(rng):
    """impl="auto" with a MosaicDecodeConfig runs the Mosaic kernel, bit for bit impl="mosaic"."""
    paged = make_paged(rng, lens=[40, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=16, dtype="bfloat16")
    auto = pp.decode(*paged.jax(), config=ONE_SPLIT)
    np.testing.assert_array_equal(to_numpy(auto).astype(np.float32), mosaic(paged))


def test_auto_lowers_to_the_mosaic_kernel_where_the_table_picks_it(mosaic_measured_faster, sm90):
    """The whole path: with the table preferring Mosaic and an sm_90 GPU (check_device lifted),
    ``decode``'s default, compiled, lowers for CUDA to the Mosaic GPU kernel, without a config."""
    fn = functools.partial(pp.decode, interpret=False)
    text = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert mosaic_gpu.KERNEL_NAME in text and "xla.gpu.triton" not in text


# --- persistent CTAs: several work items each ------------------------------------------------------

PERSISTENT = MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True, persistent=True)


@pytest.mark.slow
@pytest.mark.parametrize("config,cache", [
    (PERSISTENT, "bfloat16"),                               # normalized in the kernel, rows of 8
    (dataclasses.replace(PERSISTENT, num_splits=3), "bfloat16"),         # the Mosaic merge
    (MosaicDecodeConfig(block_k=64, num_splits=2, num_stages=3, persistent=True),
     "float16"),                                            # the queries in M, XLA's merge
    (dataclasses.replace(PERSISTENT, num_stages=3, fp8_k_in_registers=True), "float8_e4m3fn"),
], ids=["one_part", "splits_mosaic_merge", "queries_in_m", "fp8"])
def test_persistent_ctas_walk_several_work_items(rng, config, cache, monkeypatch):
    """With `MosaicDecodeConfig.persistent` on one multiprocessor (patched), each CTA walks
    several work items (sequence, kv head, split) of different tile counts, empty ones
    included, with the ring's stages and the query slots carried from one to the next: every
    option against the oracle, and the output and lse of one CTA per item (bit for bit in
    interpret mode, within an ulp compiled). The sequences' lengths are in no order, so the
    CTAs take them as XLA sorted them, longest first."""
    monkeypatch.setattr(mosaic_gpu, "sm_count", lambda: 1)
    fp8 = cache == "float8_e4m3fn"
    dtype = "float16" if fp8 or cache == "float16" else "bfloat16"
    paged = make_paged(rng, lens=[150, 0, 1, 16, 17, 64, 130], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=cache, q_dtype=dtype)
    scales = dict(k_scale=0.25, v_scale=0.75) if fp8 else {}
    options = every_option(rng, 8)
    items = 7 * 2 * config.num_splits
    smem = mosaic_gpu.smem_bytes(64, paged.k_cache.dtype, NP_DTYPES[dtype], config, alibi=True,
                                 group=4, finalize=config.num_splits == 1)
    programs = _mosaic_common.persistent_programs(items, smem, sm_count=1)
    assert 1 <= programs < items / 2, (programs, items)  # several items per CTA
    out, lse = mosaic(paged, config, return_lse=True, **scales, **options)
    assert_matches_oracle(paged, dtype, config, **scales, **options)
    per_item = dataclasses.replace(config, persistent=False)
    out_per_item, lse_per_item = mosaic(paged, per_item, return_lse=True, **scales, **options)
    if NO_GPU:  # the same operations, simulated
        np.testing.assert_array_equal(out, out_per_item)
        np.testing.assert_array_equal(lse, lse_per_item)
    else:  # two programs compiled apart may round an fp32 value apart (an lse by one ulp, seen
        # compiled)
        eps = float(jnp.finfo(NP_DTYPES[dtype]).eps)
        np.testing.assert_allclose(out, out_per_item, rtol=eps, atol=eps)
        np.testing.assert_allclose(lse, lse_per_item, rtol=1e-6, atol=1e-6)


@on_every_jax
@pytest.mark.parametrize("programs,items", [(4, 16), (4, 15), (4, 13), (4, 10), (5, 5), (3, 2),
                                            (132, 1024), (132, 512)])
def test_persistent_ctas_are_dealt_every_item_once_in_snake_order(programs, items):
    """`dealt_items` / `dealt_index`: every item goes to exactly one CTA; round ``j`` gives
    items ``j * P ..`` in CTA order on even rounds and reversed on odd ones."""
    seen = []
    for p in range(programs):
        count = int(_mosaic_common.dealt_items(jnp.int32(p), programs, items))
        indices = [int(_mosaic_common.dealt_index(jnp.int32(p), j, programs))
                   for j in range(count)]
        for j, index in enumerate(indices):
            assert index // programs == j
            assert index % programs == (p if j % 2 == 0 else programs - 1 - p)
        seen += indices
    assert sorted(seen) == list(range(items))


@on_every_jax
def test_persistent_programs_fill_the_multiprocessors():
    """As many CTAs as the multiprocessors hold at once, never more than the work items."""
    assert _mosaic_common.persistent_programs(1024, 100_000, sm_count=132) == 264  # two per SM
    assert _mosaic_common.persistent_programs(1024, 140_000, sm_count=132) == 132
    assert _mosaic_common.persistent_programs(100, 60_000, sm_count=132) == 100
    assert _mosaic_common.persistent_programs(1, 230_000, sm_count=132) == 1


# --- lowered for CUDA (no GPU needed): Mosaic GPU's own lowering and layout inference run ---------

LOWERINGS = {
    "bf16_g4_d128": dict(),
    "fp16_d64_every_option_splits": dict(head_dim=64, dtype=jnp.float16, options=True,
                                         config=MosaicDecodeConfig(block_k=64, num_splits=4,
                                                                   num_stages=4)),
    "fp8_bf16_query": dict(cache_dtype=jnp.float8_e4m3fn, scales=True),
    "fp8_fp16_query_every_option": dict(dtype=jnp.float16, cache_dtype=jnp.float8_e4m3fn,
                                        scales=True, options=True),
    "bs8_mha": dict(block_size=8, num_heads=2, kvh=2),
    "bs128_subpage_tiles_g8": dict(block_size=128, num_heads=16, kvh=2,
                                   config=MosaicDecodeConfig(block_k=64, num_splits=2)),
    # the group in the wgmmas' N: S^T = K Q^T, O^T = V^T P^T
    "queries_in_n_bf16_bk128_st3": dict(config=MosaicDecodeConfig(block_k=128, num_stages=3,
                                                                  queries_in_n=True)),
    "queries_in_n_fp16_g16_every_option": dict(dtype=jnp.float16, options=True, num_heads=32,
                                               kvh=2, config=QN_FOUR_STAGES),
    "queries_in_n_fp8_every_option": dict(cache_dtype=jnp.float8_e4m3fn, scales=True,
                                          options=True, config=QN_FOUR_STAGES),
    # fp8 K tiles converted in registers, the S^T wgmma's A operand
    "fp8_k_in_registers_every_option": dict(
        cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=dataclasses.replace(QN_FOUR_STAGES, fp8_k_in_registers=True)),
    "fp8_k_in_registers_fp16_d64_bk128": dict(
        dtype=jnp.float16, cache_dtype=jnp.float8_e4m3fn, scales=True, head_dim=64,
        config=MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True,
                                  fp8_k_in_registers=True)),
    # fp8 V tiles converted by the producer warpgroup (and K in registers)
    "fp8_v_in_producer_k_in_registers_every_option": dict(
        cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=dataclasses.replace(QN_FOUR_STAGES, fp8_k_in_registers=True,
                                   fp8_v_in_producer=True)),
    "queries_in_m_fp8_v_in_producer_two_consumers": dict(
        dtype=jnp.float16, cache_dtype=jnp.float8_e4m3fn, scales=True,
        config=MosaicDecodeConfig(block_k=64, num_stages=2, num_consumers=2,
                                  fp8_v_in_producer=True)),
    # the queries in N with several consumers, their reductions lowered apart
    "queries_in_n_four_consumers_fp8_every_option": dict(
        cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=MosaicDecodeConfig(block_k=64, num_stages=8, num_consumers=4, queries_in_n=True,
                                  fp8_k_in_registers=True, fp8_v_in_producer=True)),
    "queries_in_n_two_consumers_bf16": dict(
        config=MosaicDecodeConfig(block_k=128, num_stages=2, num_consumers=2, queries_in_n=True)),
    # the group in the wgmmas' M (padded to 64 rows), two consumers
    "queries_in_m_fp8_two_consumers_every_option": dict(
        dtype=jnp.float16, cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=MosaicDecodeConfig(block_k=64, num_stages=2, num_consumers=2)),
    # persistent CTAs: normalized in the kernel; with splits and the Mosaic merge (fp8, K in
    # registers); the queries in M
    "persistent_every_option": dict(options=True, config=PERSISTENT),
    "persistent_fp8_splits_every_option": dict(
        cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=dataclasses.replace(PERSISTENT, num_splits=4, fp8_k_in_registers=True)),
    "persistent_queries_in_m_mha": dict(num_heads=2, kvh=2, config=MosaicDecodeConfig(
        block_k=64, num_stages=3, persistent=True)),
    # head_dim 256 and 192: decode's own config; fp8 with the Mosaic merge; persistent CTAs; the
    # queries in M
    "d256_bf16": dict(head_dim=256),
    "d256_fp8_every_option_splits": dict(
        head_dim=256, cache_dtype=jnp.float8_e4m3fn, scales=True, options=True,
        config=MosaicDecodeConfig(block_k=64, num_splits=4, num_stages=2, queries_in_n=True,
                                  fp8_k_in_registers=True, fp8_v_in_producer=True)),
    "d256_persistent_every_option": dict(head_dim=256, options=True, config=PERSISTENT),
    "d192_queries_in_m_fp16_every_option": dict(
        head_dim=192, dtype=jnp.float16, options=True,
        config=MosaicDecodeConfig(block_k=64, num_stages=2)),
}


@pytest.mark.parametrize("case", slow_but(list(LOWERINGS), "bf16_g4_d128",
                                          "fp8_v_in_producer_k_in_registers_every_option",
                                          "persistent_fp8_splits_every_option"), ids=str)
def test_lowers_to_the_mosaic_gpu_kernel(case, monkeypatch):
    """Lowered for CUDA on any machine, impl="mosaic" is one Mosaic GPU custom call carrying our
    kernel's name; this runs Mosaic's lowering (layout inference included), which is what rejects
    an unsupported layout before any GPU sees it. (`check_device` stops compiled runs without an
    sm_90 GPU; lowering needs none, so it is lifted here.)"""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    spec = dict(LOWERINGS[case])
    options, scales = spec.pop("options", False), spec.pop("scales", False)
    config = spec.pop("config", None)
    args = _abstract(head_dim=spec.pop("head_dim", 128), **spec)
    kwargs = dict(k_scale=0.5, v_scale=0.25) if scales else {}
    num_heads = args[0].shape[1]
    if options:
        kwargs.update(logits_soft_cap=5.0, sliding_window=100, return_lse=True)
        extra = (jax.ShapeDtypeStruct((num_heads,), jnp.float32),) * 2  # alibi slopes, sinks
        fn = lambda *a: pp.decode(*a[:5], impl="mosaic", interpret=False, config=config,  # noqa: E731
                                  alibi_slopes=a[5], sinks=a[6], **kwargs)
    else:
        extra = ()
        fn = functools.partial(pp.decode, impl="mosaic", interpret=False, config=config, **kwargs)
    text = jax.jit(fn).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
    ran = config or picked_mosaic_config(args)
    group = num_heads // args[1].shape[2]
    finalize = _kernel_finalizes(ran, args)
    merges = mosaic_gpu.merges_in_mosaic(ran, group=group, head_dim=args[0].shape[2],
                                         out_dtype=args[0].dtype, finalize=finalize)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 + merges
    assert (mosaic_gpu.MERGE_KERNEL_NAME in text) == merges
    # the merge kernel a programmatic dependent launch of the decode kernel (`launches_early`)
    assert text.count("griddepcontrol.launch_dependents") == merges
    assert text.count("griddepcontrol.wait") == merges
    assert mosaic_gpu.KERNEL_NAME in text and "xla.gpu.triton" not in text
    assert ("_qn" in text) == ran.queries_in_n
    assert ("_kreg" in text) == (ran.fp8_k_in_registers and args[1].dtype == jnp.float8_e4m3fn)
    assert ("_vprod" in text) == (ran.fp8_v_in_producer and args[1].dtype == jnp.float8_e4m3fn)
    assert ("_persistent" in text) == ran.persistent


SMEM_CASES = [
    (MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True), None, False, 128),
    (MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True), None, True, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=3, queries_in_n=True), None, False, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=3), None, True, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=4, num_consumers=2, queries_in_n=True), None, False,
     128),
    (MosaicDecodeConfig(block_k=128, num_splits=4, num_stages=2, queries_in_n=True), None, True,
     128),
    (dataclasses.replace(PERSISTENT, block_k=128), None, True, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True, fp8_k_in_registers=True,
                        fp8_v_in_producer=True), jnp.float8_e4m3fn, False, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=2, num_consumers=2), jnp.float8_e4m3fn, True, 128),
    (MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True), None, True, 256),
    (MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True, fp8_k_in_registers=True,
                        fp8_v_in_producer=True), jnp.float8_e4m3fn, True, 256),
    (MosaicDecodeConfig(block_k=64, num_stages=2), None, True, 192),
]


@pytest.mark.parametrize("config,cache,options,head_dim", slow_but(
    SMEM_CASES, SMEM_CASES[1], SMEM_CASES[7]),
    ids=["bk128", "bk128_options", "bk64_st3", "qm_options", "two_consumers", "splits_options",
         "persistent_options", "fp8_vp_kr", "fp8_qm_two_consumers", "d256_options",
         "d256_fp8_options", "d192_qm_options"])
def test_smem_bytes_is_the_shared_memory_the_kernel_asks_for(config, cache, options, head_dim,
                                                            monkeypatch):
    """`mosaic_gpu.smem_bytes`, which decides how many CTAs share a multiprocessor (the
    persistent grid, `finalizes`) and which configs fit, equals the dynamic shared memory the
    lowered kernel asks for, byte for byte: each scoped allocation rounded up to Pallas'
    alignment (`allocated`), the barriers and Mosaic's own scratch. (Summed unaligned, it was
    0.9-3 KiB short.)"""
    mgpu_core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(mgpu_core, "_smem_tree_size"):
        pytest.skip("this jax's Mosaic GPU does not size shared memory in _smem_tree_size")
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    asked = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: asked.append(size(tree))
                        or asked[-1])
    args = _abstract(batch=32, num_heads=32, kvh=8, head_dim=head_dim, cache_dtype=cache)
    scales = dict(k_scale=0.5, v_scale=0.25) if cache is not None else {}
    extra = (jax.ShapeDtypeStruct((32,), jnp.float32),) * 2 if options else ()
    fn = lambda *a: pp.decode(  # noqa: E731
        *a[:5], impl="mosaic", interpret=False, config=config, **scales,
        **(dict(alibi_slopes=a[5], sinks=a[6]) if options else {}))
    jax.jit(fn).trace(*args, *extra).lower(lowering_platforms=("cuda",))
    compute = mosaic_gpu.dot_dtype(args[0].dtype, args[1].dtype)
    assert asked[0] == mosaic_gpu.smem_bytes(head_dim, args[1].dtype, compute, config,
                                             alibi=options, group=4,
                                             finalize=_kernel_finalizes(config, args))


@pytest.mark.parametrize("batch,group,cache,config,expected", [
    # one CTA per multiprocessor either way (B=32, 128-token tiles): normalized in the kernel
    (32, 4, "bfloat16", MosaicDecodeConfig(block_k=128, num_stages=2, queries_in_n=True), True),
    # B=128 with 64-token tiles: two CTAs per multiprocessor, one with the output's staging
    (128, 4, "bfloat16", MosaicDecodeConfig(block_k=64, num_stages=3, queries_in_n=True), False),
    # MHA: one lse value per (sequence, kv head), 4 bytes, not a TMA row
    (32, 1, "bfloat16", MosaicDecodeConfig(block_k=64, num_stages=3, queries_in_n=True), False),
    # several parts: merged after the kernel
    (1, 4, "bfloat16", MosaicDecodeConfig(block_k=128, num_splits=16, queries_in_n=True), False),
    (32, 4, "bfloat16", MosaicDecodeConfig(block_k=64, num_stages=2, num_consumers=2,
                                           queries_in_n=True), False),
    # fp8 caches: XLA normalizes the one part (the kernel that normalizes measured slower)
    (32, 4, "float8_e4m3fn", MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True,
                                                fp8_k_in_registers=True,
                                                fp8_v_in_producer=True), False),
    # persistent CTAs normalize wherever the staging fits (one wave by construction)
    (128, 4, "bfloat16", dataclasses.replace(PERSISTENT, num_stages=3), True),
    (128, 1, "bfloat16", dataclasses.replace(PERSISTENT, num_stages=3), False),
])
def test_the_kernel_finalizes_where_it_costs_no_wave(batch, group, cache, config, expected):
    """`finalizes`: the kernel normalizes its one part where the staging costs no wave of CTAs."""
    compute = jnp.float16 if cache == "float8_e4m3fn" else jnp.bfloat16
    assert mosaic_gpu.finalizes(config, batch=batch, kvh=8, group=group, head_dim=128,
                                cache_dtype=jnp.dtype(cache), compute_dtype=compute,
                                sm_count=132) is expected


PADDED = {"pad", "convert"}  # jnp.pad: the pad, and its fill value's conversion


def _exp2_of_log2_ops() -> set[str]:
    """The ops this jax lowers ``exp2(ceil(log2(x)))`` to, beside the ceil (jax 0.12.1: exp2 and
    log2; before: exponential, log and multiplies)."""
    text = jax.jit(lambda x: jnp.exp2(jnp.ceil(jnp.log2(x)))).lower(
        jax.ShapeDtypeStruct((2,), jnp.float32)).as_text()
    return launched_ops(text) - {"ceil"}


# a bf16 query of an fp8 cache divided by its group's power of two, then padded
FP8_QUERY = PADDED | {"abs", "reduce", "divide", "ceil", "maximum",
                      "broadcast_in_dim"} | _exp2_of_log2_ops()


FP8_QN = MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True, fp8_k_in_registers=True,
                            fp8_v_in_producer=True)


@pytest.mark.parametrize("num_heads,kvh,config,cache,expected", [
    # one part per (sequence, kv head): the kernel normalizes; a group of 8 in the queries-in-N
    # kernel's 8 columns needs no padding, nor does a group of 4 read in boxes of 8 rows
    pytest.param(16, 2, MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True), None,
                 set(), marks=SLOW),
    (8, 2, MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True), None, set()),
    # 4 heads in all (a box of 8 would pass the end), and any group in the 64 rows of the
    # queries in M: the query padded
    pytest.param(4, 1, MosaicDecodeConfig(block_k=64, num_stages=2, queries_in_n=True), None,
                 PADDED, marks=SLOW),
    pytest.param(16, 2, MosaicDecodeConfig(block_k=64, num_stages=2), None, PADDED, marks=SLOW),
], ids=["g8_qn", "g4_qn_rows_of_8", "g4_qn_4_heads", "g8_qm"])
def test_one_part_launches_its_kernel_without_a_merge(num_heads, kvh, config, cache, expected,
                                                     monkeypatch):
    """Lowered for CUDA: with one part per (sequence, kv head) the kernel writes the normalized
    output and lse (sinks and v_scale included), so nothing follows it, and it reads the query
    unpadded where it can; every op XLA computes beside a kernel is one more launch per call (the
    merge, O^T's transpose and the query's pad were three)."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    args = _abstract(num_heads=num_heads, kvh=kvh, head_dim=128, cache_dtype=cache)
    sinks = jax.ShapeDtypeStruct((num_heads,), jnp.float32)
    scales = {} if cache is None else dict(k_scale=0.5, v_scale=0.25)
    fn = lambda *a: pp.decode(*a[:5], sinks=a[5], impl="mosaic", interpret=False,  # noqa: E731
                              config=config, return_lse=True, **scales)
    text = jax.jit(fn).trace(*args, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert "_final" in text
    assert launched_ops(text) == expected  # the sinks padded like the query, where it is
    plain = jax.jit(functools.partial(pp.decode, impl="mosaic", interpret=False, config=config,
                                      return_lse=True, **scales)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert launched_ops(plain) == expected


@pytest.mark.parametrize("num_heads,kvh", slow_but([(8, 2), (4, 1)], (8, 2)),
                         ids=["g4", "g4_4_heads"])
def test_fp8_cache_one_part_is_normalized_by_xla(num_heads, kvh, monkeypatch):
    """Lowered for CUDA: with an fp8 cache read by a bf16 query, the query is divided into fp16's
    range by XLA first (a reduction) and padded (the division measured slower inside the kernel),
    and XLA normalizes the kernel's one part after it (the kernel that normalizes measured 1.37x
    slower at fp8 B=32 on an H200: `mosaic_gpu.finalizes`)."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    args = _abstract(num_heads=num_heads, kvh=kvh, head_dim=128, cache_dtype=jnp.float8_e4m3fn)
    text = jax.jit(functools.partial(pp.decode, impl="mosaic", interpret=False, config=FP8_QN,
                                     return_lse=True, k_scale=0.5, v_scale=0.25)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_gpu.KERNEL_NAME in text and "_final" not in text
    assert mosaic_gpu.MERGE_KERNEL_NAME not in text
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    ops = launched_ops(text)
    assert FP8_QUERY <= ops and "transpose" in ops  # the query's division; O^T turned into rows


@pytest.mark.parametrize("num_heads,kvh,cache,expected_merges", [
    # B=1's 16 splits, a group of 4 read in boxes of 8 rows: the kernel, then the Mosaic merge
    (32, 8, None, 1),
    # the same for fp8 (v_scale and the sinks in the merge)
    pytest.param(32, 8, jnp.float8_e4m3fn, 1, marks=SLOW),
    pytest.param(64, 8, None, 1, marks=SLOW),   # a group of 8
    (32, 32, None, 0),                          # MHA: an lse row of 4 bytes, merged by XLA
], ids=["g4", "g4_fp8", "g8", "mha"])
def test_parts_are_merged_by_the_mosaic_merge_kernel(num_heads, kvh, cache, expected_merges,
                                                     monkeypatch):
    """Lowered for CUDA: where the heuristic splits (B=1, ctx 32768) and `merges_in_mosaic`, the
    decode kernel is followed by the Mosaic merge kernel and by nothing XLA computes (for a
    group of 4, not the query's pad either: the kernel reads it in boxes of 8 rows); else XLA
    merges as before (its transpose among its ops)."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    pages = 32768 // 16
    cache_shape = jax.ShapeDtypeStruct((pages + 1, 16, kvh, 128), cache or jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((1, num_heads, 128), jnp.bfloat16), cache_shape, cache_shape,
            jax.ShapeDtypeStruct((1, pages), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    config = picked_mosaic_config(args)
    assert config.num_splits > 1
    sinks = jax.ShapeDtypeStruct((num_heads,), jnp.float32)
    scales = {} if cache is None else dict(k_scale=0.5, v_scale=0.25)
    fn = lambda *a: pp.decode(*a[:5], sinks=a[5], impl="mosaic", interpret=False,  # noqa: E731
                              return_lse=True, **scales)
    text = jax.jit(fn).trace(*args, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 + expected_merges
    assert (mosaic_gpu.MERGE_KERNEL_NAME in text) == bool(expected_merges)
    # the merge kernel launched with programmatic stream serialization, waiting for the decode
    # grid (`launches_early`)
    assert text.count("mosaic_gpu.uses_pdl") == expected_merges
    assert text.count("griddepcontrol.wait") == expected_merges
    ops = launched_ops(text)
    if not expected_merges:
        assert "transpose" in ops
    elif cache is None:
        assert ops == set()
    else:  # the bf16 query divided into fp16's range first, and padded
        assert ops == FP8_QUERY


@pytest.mark.parametrize("config,group,expected", [
    (in_n(THREE_SPLITS), 4, True),
    (in_n(THREE_SPLITS), 8, True),
    (QN_THREE_CONSUMERS, 4, True),            # 2 splits x 3 consumers
    (in_n(ONE_SPLIT), 4, False),              # one part: XLA's merge measured faster
    (in_n(THREE_SPLITS), 2, False),           # lse rows of 8 bytes
    (THREE_SPLITS, 4, False),                 # the queries in M
])
def test_which_parts_the_mosaic_merge_takes(config, group, expected):
    """`merges_in_mosaic`: several parts with the queries in N and lse rows of 16 bytes."""
    assert mosaic_gpu.merges_in_mosaic(config, group=group, head_dim=128, out_dtype=jnp.bfloat16,
                                       finalize=False) is expected


def test_merge_chunks_divide_the_parts_and_fit():
    """`merge_chunk`: a divisor of the parts whose copy fits 32 KiB."""
    assert mosaic_gpu.merge_chunk(16, 128, 8) == 8      # 4 KiB per part, 32 KiB per copy
    assert mosaic_gpu.merge_chunk(12, 128, 8) == 6
    assert mosaic_gpu.merge_chunk(7, 128, 8) == 7
    assert mosaic_gpu.merge_chunk(11, 128, 8) == 1
    assert mosaic_gpu.merge_chunk(3, 128, 64) == 1      # 32 KiB per part
    assert mosaic_gpu.merge_chunk(1, 64, 8) == 1


@pytest.mark.slow
@pytest.mark.parametrize("num_heads,kvh", [(8, 2), (16, 2)], ids=["g4_rows_of_8", "g8"])
def test_the_merge_reads_its_parts_in_chunks(rng, num_heads, kvh, monkeypatch):
    """One part per TMA copy of the merge kernel (its chunk lowered to 4 KiB), so that three
    chunks pass through its two slots: every option, an empty row and a row shorter than a split,
    against the oracle; fp8 with its scales."""
    monkeypatch.setattr(mosaic_gpu, "MERGE_CHUNK_BYTES", 128 * 8 * 4)
    config = in_n(THREE_SPLITS)
    assert mosaic_gpu.merges_in_mosaic(config, group=num_heads // kvh, head_dim=128,
                                       out_dtype=jnp.bfloat16, finalize=False)
    assert mosaic_gpu.merge_chunk(3, 128, 8) == 1
    paged = make_paged(rng, lens=[150, 0, 20], num_heads=num_heads, num_kv_heads=kvh,
                       head_dim=128, block_size=16, dtype="bfloat16")
    assert_matches_oracle(paged, "bfloat16", config, **every_option(rng, num_heads))
    fp8 = make_paged(rng, lens=[150, 0, 20], num_heads=num_heads, num_kv_heads=kvh,
                     head_dim=128, block_size=16, dtype="float8_e4m3fn")
    fp8.q = fp8.q.astype(NP_DTYPES["float16"])
    assert_matches_oracle(fp8, "float16", config, k_scale=0.25, v_scale=0.75,
                          sinks=rng.standard_normal(num_heads).astype(np.float32))


# --- every group, head_dim, split count and query layout: refused up front or lowered -----------

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 56, 64)
GRID_SPLITS = (1, 2, 16)


def _grid(fast):
    """(group, head_dim, splits, queries_in_n) over the whole grid, those not in ``fast`` slow."""
    cases = [(g, d, s, qn) for g in GROUPS for d in (64, 128, 256) for s in GRID_SPLITS
             for qn in (False, True)]
    return slow_but(cases, *fast)


def _grid_config(splits, queries_in_n):
    return MosaicDecodeConfig(block_k=64, num_splits=splits, num_stages=2,
                              queries_in_n=queries_in_n)


def _grid_id(value):
    return str(value) if not isinstance(value, bool) else ("qn" if value else "qm")


# the Mosaic merge over a query box wider than one swizzle row, one and several parts a copy
GRID_FAST = ((64, 64, 2, True), (24, 128, 16, True), (40, 64, 16, True))


@pytest.mark.parametrize("group,head_dim,splits,queries_in_n", _grid(GRID_FAST), ids=_grid_id)
def test_every_accepted_grid_config_lowers(group, head_dim, splits, queries_in_n, monkeypatch):
    """Each call of the grid is refused by `check_supported` (the same ValueError from
    ``decode``) or lowers for CUDA through Mosaic's own lowering, which is where a layout the
    hardware cannot copy (TMA's five strided dimensions) or hold is rejected."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    config = _grid_config(splits, queries_in_n)
    args = _abstract(batch=2, num_heads=2 * group, kvh=2, head_dim=head_dim)
    fn = functools.partial(pp.decode, impl="mosaic", interpret=False, config=config)
    why = mosaic_gpu.refusal(args[0], args[1], config, interpret=False)
    if why is not None:
        with pytest.raises(ValueError, match=re.escape(why)):
            jax.jit(fn).trace(*args)
        return
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_gpu.KERNEL_NAME in text


@pytest.mark.parametrize("group,head_dim", slow_but(
    [(g, d) for g in GROUPS for d in (64, 128, 256)], (64, 64), (64, 256)), ids=str)
def test_the_default_config_lowers_for_every_group(group, head_dim, monkeypatch):
    """Without a config, B=1 at ctx 8192 (decode's splits, merged in Mosaic where
    `merges_in_mosaic`) lowers for CUDA for every group and head_dim that some config holds."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    q = jax.ShapeDtypeStruct((1, group, head_dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((520, 16, 1, head_dim), jnp.bfloat16)
    args = (q, cache, cache, jax.ShapeDtypeStruct((1, 512), jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32))
    fn = functools.partial(pp.decode, impl="mosaic", interpret=False)
    if mosaic_gpu.refusal(q, cache, mosaic_gpu.SMALLEST_CONFIG, interpret=False) is not None:
        # no config fits (a group of 64 at head_dim 256): refused as such, not for the config
        with pytest.raises(ValueError, match=r"cannot hold a group of 64 query heads at"
                                             r" head_dim=256 .*: use impl='pallas'"):
            jax.jit(fn).trace(*args)
        assert (group, head_dim) == (64, 256)
        return
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_gpu.KERNEL_NAME in text


@pytest.mark.parametrize("group,parts", slow_but([(24, 3), (64, 16)], (64, 16)), ids=str)
def test_the_mosaic_merge_takes_wide_query_boxes(rng, group, parts):
    """Groups whose box of query columns spans several swizzle rows, merged by the Mosaic merge
    kernel (with 16 parts, two to a slot), against the truth."""
    config = _grid_config(parts, True)
    paged = make_paged(rng, lens=[70, 1], num_heads=group, num_kv_heads=1, head_dim=64,
                       block_size=16, dtype="bfloat16")
    assert mosaic_gpu.merges_in_mosaic(config, group=group, head_dim=64, out_dtype=jnp.bfloat16,
                                       finalize=False)
    assert_matches_oracle(paged, "bfloat16", config, sinks=rng.standard_normal(group).astype(
        np.float32))


# --- the compiled kernel on a GPU ------------------------------------------------------------------

@pytest.mark.gpu
def test_compiled_program_contains_the_mosaic_kernel(rng):
    """On a GPU the compiled program calls the Mosaic kernel, not Triton."""
    paged = make_paged(rng, lens=[33, 7], num_heads=8, num_kv_heads=2, head_dim=128,
                       block_size=16, dtype="bfloat16")
    fn = jax.jit(functools.partial(pp.decode, impl="mosaic"))
    text = fn.lower(*paged.jax()).compile().as_text()
    assert "mosaic_gpu" in text and mosaic_gpu.KERNEL_NAME in text
    assert "xla.gpu.triton" not in text


def _realistic(rng, batch, context, dtype, num_kv_heads=8):
    """H=32, D=128, bs=16, shuffled blocks; every sequence at ``context`` but one shorter row
    and one empty one when the batch allows."""
    lens = [context] * batch
    if batch > 2:
        lens[1], lens[2] = context // 3 + 5, 0
    return make_paged(rng, lens=lens, num_heads=32, num_kv_heads=num_kv_heads, head_dim=128,
                      block_size=16, dtype=dtype, fill=np.nan)


@pytest.mark.gpu
@pytest.mark.parametrize("queries_in_n", [False, True])
@pytest.mark.parametrize("batch,context,dtype", [(1, 32768, "bfloat16"), (32, 4096, "bfloat16"),
                                                 (32, 4096, "float8_e4m3fn"),
                                                 (128, 1024, "bfloat16")])  # persistent
def test_compiled_kernel_at_realistic_shapes(rng, batch, context, dtype, queries_in_n):
    """Against impl="xla" (fp32 inside; the oracle's loops would take minutes at these sizes),
    with the config decode picks on an H200 and the queries in N or in M."""
    paged = _realistic(rng, batch, context, dtype)
    scales = dict(k_scale=0.5, v_scale=0.25) if dtype == "float8_e4m3fn" else {}
    q, k_cache, _, tables, _ = paged.jax()
    shape = api.decode_shape(q, k_cache, tables)
    picked = mosaic_gpu_config.lookup_mosaic(shape, "NVIDIA H200", 132)
    config = dataclasses.replace(picked, queries_in_n=queries_in_n,
                                 fp8_k_in_registers=picked.fp8_k_in_registers and queries_in_n)
    out, lse = pp.decode(*paged.jax(), impl="mosaic", config=config, return_lse=True, **scales)
    ref, ref_lse = pp.decode(*paged.jax(), impl="xla", return_lse=True, **scales)
    assert_near_xla(out, ref, "bfloat16")
    np.testing.assert_allclose(to_numpy(lse), to_numpy(ref_lse), atol=1e-3, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block_k,num_stages", [(64, 4), (128, 2)])
@pytest.mark.parametrize("conversion", [dict(fp8_k_in_registers=True),
                                        dict(fp8_v_in_producer=True),
                                        dict(fp8_k_in_registers=True, fp8_v_in_producer=True)],
                         ids=lambda d: "+".join(d))
def test_compiled_fp8_conversions_match_the_consumer_shared_memory_path(rng, q_dtype, block_k,
                                                                       num_stages, conversion):
    """The fp8 K tile converted in registers as the wgmma's A operand, and the V tile converted
    by the producer warpgroup, give the outputs of the consumer converting both through shared
    memory (the same exact conversion, the same products), with every option, splits and NaN in
    the unused slots: within one ulp of the output dtype, and the lse within 1e-6. Two programs
    compiled apart may round their fp32 running sums differently (on the H200, with fp16
    queries and 128-token tiles, the producer's V conversion moved 7 of 16384 outputs by one
    ulp, the same in every run of either program)."""
    paged = make_paged(rng, lens=[5000, 1700, 0, 333], num_heads=32, num_kv_heads=8,
                       head_dim=128, block_size=16, dtype="float8_e4m3fn", q_dtype=q_dtype,
                       fill=np.nan)
    options = every_option(rng, 32)
    options["sliding_window"] = 1500
    jax_options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    config = MosaicDecodeConfig(block_k=block_k, num_splits=4, num_stages=num_stages,
                                queries_in_n=True)
    outs = [pp.decode(*paged.jax(), impl="mosaic", return_lse=True, k_scale=0.5, v_scale=0.25,
                      config=dataclasses.replace(config, **fields), **jax_options)
            for fields in ({}, conversion)]
    ref = pp.decode(*paged.jax(), impl="xla", k_scale=0.5, v_scale=0.25, **jax_options)
    (smem_out, smem_lse), (out, lse) = outs
    out, smem_out = (to_numpy(x).astype(np.float32) for x in (out, smem_out))
    info = jnp.finfo(q_dtype)
    one_ulp = float(info.eps) * 2.0 ** np.floor(np.log2(np.maximum(
        np.maximum(np.abs(out), np.abs(smem_out)), float(info.tiny))))
    assert (np.abs(out - smem_out) <= one_ulp).all(), np.abs(out - smem_out).max()
    np.testing.assert_allclose(to_numpy(lse), to_numpy(smem_lse), rtol=1e-6, atol=0)
    assert_near_xla(out, ref, q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_consumers,num_stages,queries_in_n",
                         [(1, 4, False), (2, 2, False), (1, 2, True), (1, 4, True)])
def test_compiled_kernel_every_option_with_splits(rng, num_consumers, num_stages, queries_in_n):
    """(2 consumers with 4 stages exceed the shared memory with the queries in M; the queries in N
    take one consumer.)"""
    paged = _realistic(rng, 4, 5000, "bfloat16")
    options = every_option(rng, 32)
    options["sliding_window"] = 1500
    config = MosaicDecodeConfig(block_k=64, num_splits=8, num_stages=num_stages,
                                num_consumers=num_consumers, queries_in_n=queries_in_n)
    jax_options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    out = pp.decode(*paged.jax(), impl="mosaic", config=config, **jax_options)
    ref = pp.decode(*paged.jax(), impl="xla", **jax_options)
    assert_near_xla(out, ref, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("num_consumers", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_compiled_queries_in_n_with_several_consumers_do_not_race(rng, num_consumers, dtype):
    """Several consumers with the queries in N reduce ``S^T`` across their warps at once, each in
    its own scratch (`mosaic_gpu.lower_apart`): in one shared scratch two raced, a wrong lse in a
    few calls of many. Eight calls, each against impl="xla", every lse within 1e-4."""
    paged = _realistic(rng, 8, 3000, dtype)
    fp8 = dtype == "float8_e4m3fn"
    scales = dict(k_scale=0.5, v_scale=0.25) if fp8 else {}
    config = MosaicDecodeConfig(block_k=64, num_splits=2,  # a stage each for bf16 (smem)
                                num_stages=(2 if fp8 else 1) * num_consumers,
                                num_consumers=num_consumers, queries_in_n=True,
                                fp8_k_in_registers=fp8, fp8_v_in_producer=fp8)
    ref, ref_lse = pp.decode(*paged.jax(), impl="xla", return_lse=True, **scales)
    run = jax.jit(functools.partial(pp.decode, impl="mosaic", config=config, return_lse=True,
                                    **scales))
    for _ in range(8):
        out, lse = run(*paged.jax())
        assert_near_xla(out, ref, "bfloat16")
        np.testing.assert_allclose(to_numpy(lse), to_numpy(ref_lse), atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("group,head_dim,splits,queries_in_n", _grid(()), ids=_grid_id)
def test_compiled_grid_matches_the_oracle(rng, group, head_dim, splits, queries_in_n):
    """The whole grid compiled (each accepted call; each refused one raises `check_supported`'s
    ValueError before any compiler runs), against the float64 truth with sinks and soft-cap."""
    config = _grid_config(splits, queries_in_n)
    paged = make_paged(rng, lens=[70, 1, 0, 33], num_heads=2 * group, num_kv_heads=2,
                       head_dim=head_dim, block_size=16, dtype="bfloat16")
    q, k_cache = paged.jax()[:2]
    why = mosaic_gpu.refusal(q, k_cache, config, interpret=False)
    options = dict(logits_soft_cap=5.0, sinks=rng.standard_normal(2 * group).astype(np.float32))
    if why is not None:
        with pytest.raises(ValueError, match=re.escape(why)):
            mosaic(paged, config, **options)
        return
    assert_matches_oracle(paged, "bfloat16", config, **options)

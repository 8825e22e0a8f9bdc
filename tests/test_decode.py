"""`pallas_paged.decode` with ``impl="xla"`` and ``impl="pallas"`` (the Triton kernel): against
the float64 oracle within the tolerance rule, the SPEC invariants I2-I7, every extension option
(soft-cap, ALiBi, sliding window, sinks, fp8 caches, return_lse) with every split layout, the
kernel's tile plan, its heuristic configs, and proof that the kernel runs.

On a CPU the Pallas kernel runs in interpret mode; on a GPU the same tests run the compiled kernel.
The Mosaic GPU kernel (``impl="mosaic"``) has its own file, test_decode_mosaic.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
import torch_ref
from pallas_paged._attention_common import split_share, tile_range
from paged_inputs import (FP8, IMPLS, assert_close, bits, jax_options, launched_ops,
                          lower_for_cuda, make_paged, reference, repeat_mapping_truth, to_numpy,
                          used_entries)
from parity.oracle import oracle_paged_attention

C = pp.DecodeConfig
SLOW = pytest.mark.slow
SPLIT_CONFIGS = (
    C(block_k=16, num_splits=1),
    C(block_k=16, num_splits=3),
    C(block_k=32, num_splits=2),
    C(block_k=16, num_splits=7),
    C(block_k=16, num_splits=7, merge_in_kernel=True),  # some splits empty
    C(block_k=32, num_splits=2, merge_in_kernel=True),
    # persistent programs: the batch's tiles dealt to 1, 3 and 7 programs per kv head of 2
    # (shares that cut sequences, a share inside one sequence, shares of several sequences)
    C(block_k=16, persistent_programs=1),
    C(block_k=16, persistent_programs=6),
    C(block_k=32, persistent_programs=15),
)
FAST_SPLITS = (SPLIT_CONFIGS[1], SPLIT_CONFIGS[4], SPLIT_CONFIGS[7])  # splits, merged, persistent


def config_id(config) -> str:
    if config is None:
        return "default"
    parts = [f"bk{config.block_k}", f"s{config.num_splits}"]
    parts += ["merged"] * config.merge_in_kernel + ["pairs"] * config.fp8_pairs
    parts += ["v_at_load"] * config.fp8_v_at_load
    parts += [f"p{config.persistent_programs}"] * bool(config.persistent_programs)
    return "-".join(parts)


def run_id(run) -> str:
    impl, config = run
    return impl if impl == "xla" else f"{impl}-{config_id(config)}"


def runs(configs, fast=()):
    """``("xla", None)`` and ``("pallas", config)`` for every config; the pallas runs of configs
    outside ``fast`` are marked slow."""
    return [pytest.param(("xla", None), id="xla")] + [
        pytest.param(("pallas", c), id=run_id(("pallas", c)), marks=[] if c in fast else [SLOW])
        for c in configs]


def decode(paged, impl, config=None, **options):
    """``(out, lse)`` of `pp.decode` on ``paged``."""
    return pp.decode(*paged.jax(), impl=impl, config=config, return_lse=True,
                     **jax_options(options))


def check(paged, impl, config=None, **options):
    """`pp.decode` against the float64 truth within the tolerance rule: ``(out, lse)`` as numpy."""
    ref = reference(*paged.arrays(), **options)
    out, lse = decode(paged, impl, config, **options)
    assert_close(ref, out, lse, what=run_id((impl, config)))
    return np.asarray(out), np.asarray(lse)


def impls(*fast):
    """Both impls; the pallas one slow unless ``fast``."""
    return [pytest.param("xla"), pytest.param("pallas", marks=[] if fast else [SLOW])]


# --- against the float64 truth ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16",
                                   pytest.param("float16", marks=SLOW)])
def test_matches_the_truth(rng, impl, dtype):
    """Lengths 0, 1, bs - 1, bs, bs + 1, longer; GQA 4; every float dtype."""
    paged = make_paged(rng, lens=[37, 0, 1, 16, 17, 15, 64], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=dtype)
    check(paged, impl)


@pytest.mark.parametrize("config", [pytest.param(c, id=config_id(c),
                                                 marks=[] if c in FAST_SPLITS else [SLOW])
                                    for c in SPLIT_CONFIGS])
def test_split_configs(rng, config):
    """The split-K layouts: splits merged by the merge kernel or inside the kernel (some of them
    empty), persistent programs dealt whole sequences and shares of them."""
    paged = make_paged(rng, lens=[100, 0, 1, 33, 64, 7], num_heads=6, num_kv_heads=2,
                       head_dim=32, block_size=8, dtype="float32")
    check(paged, "pallas", config)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", [pytest.param(d, marks=[] if d == 80 else [SLOW])
                                      for d in (32, 64, 80, 96, 128, 256)])
def test_head_dims(rng, impl, head_dim):
    """Powers of two and not (80, 96: padded to the kernel's tile)."""
    paged = make_paged(rng, lens=[19, 5], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       block_size=8, dtype="bfloat16")
    check(paged, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [pytest.param(bs, marks=[] if bs == 5 else [SLOW])
                                        for bs in (1, 3, 5, 12, 16, 64)])
def test_block_sizes(rng, impl, block_size):
    """Lengths 1, bs - 1, bs, bs + 1, 2 bs + 3 around each block size (a power of two or not)."""
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    paged = make_paged(rng, lens=[max(n, 0) for n in lens], num_heads=4, num_kv_heads=1,
                       head_dim=32, block_size=block_size, dtype="float32")
    check(paged, impl, C(block_k=16, num_splits=2) if impl == "pallas" else None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [
    pytest.param(4, 4, marks=SLOW), pytest.param(4, 2, marks=SLOW), (6, 2),
    pytest.param(8, 1, marks=SLOW), pytest.param(16, 2, marks=SLOW)])
def test_gqa_ratios(rng, impl, num_heads, num_kv_heads):
    """Groups of 1, 2, 3 and 8 query heads per kv head (and MQA)."""
    paged = make_paged(rng, lens=[23, 9], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=32, block_size=4)
    check(paged, impl)


# --- SPEC invariants ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_i2_table_tail_is_never_read(rng, impl):
    """Entries past ceil(n / bs) may hold anything: 99999, -7, 2**30, -2**31 there change no bit."""
    paged = make_paged(rng, lens=[5, 0, 9, 12], block_size=4, max_blocks=6, tail=(0,))
    clean = decode(paged, impl)
    used = used_entries(paged.block_tables, paged.context_lens, 4)
    for garbage in (99999, -7, 2**30, -(2**31)):
        tables = np.where(used, paged.block_tables, garbage).astype(np.int32)
        got = decode(paged.replace(block_tables=tables), impl)
        for g, c in zip(got, clean):
            np.testing.assert_array_equal(bits(g), bits(c))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, pytest.param(3, marks=SLOW), pytest.param(4, marks=SLOW), 5,
                               pytest.param(8, marks=SLOW), pytest.param(13, marks=SLOW)])
def test_i3_exactly_n_rows_enter(rng, impl, n):
    """n not a multiple of bs, n = 1, n = bs: only the first n rows count (the slots after them
    hold 1e4, which would dominate the softmax)."""
    paged = make_paged(rng, lens=[n], block_size=4, fill=1e4)
    check(paged, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_i4_paged_equals_dense(rng, impl):
    """Shuffled physical blocks give, bit for bit, what the same sequences in contiguous blocks in
    order give, and the dense attention's truth."""
    paged = make_paged(rng, lens=[11, 16, 1, 30], block_size=4, spare_blocks=10)
    width = paged.block_tables.shape[1]
    dense_tables = np.arange(4 * width, dtype=np.int32).reshape(4, width)
    k_dense, v_dense = (np.zeros((4 * width,) + c.shape[1:], c.dtype)
                        for c in (paged.k_cache, paged.v_cache))
    used = used_entries(paged.block_tables, paged.context_lens, 4)
    k_dense[dense_tables[used]] = paged.k_cache[paged.block_tables[used]]
    v_dense[dense_tables[used]] = paged.v_cache[paged.block_tables[used]]
    dense = paged.replace(k_cache=k_dense, v_cache=v_dense, block_tables=dense_tables)
    out, lse = check(paged, impl)
    dense_out, dense_lse = decode(dense, impl)
    np.testing.assert_array_equal(bits(out), bits(dense_out))
    np.testing.assert_array_equal(bits(lse), bits(dense_lse))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_heads", [4, 8])
def test_i5_gqa_is_repeat_interleave(rng, impl, num_heads):
    """Head h reads kv head h // (H / KVH): the truth, and clearly not what ``repeat`` (h % KVH)
    gives on these inputs."""
    paged = make_paged(rng, lens=[9, 14], num_heads=num_heads, num_kv_heads=2)
    out, _ = check(paged, impl)
    assert np.abs(out - repeat_mapping_truth(*paged.arrays())).max() > 1e-2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fill", [np.nan, pytest.param(np.inf, marks=SLOW),
                                  pytest.param(-np.inf, marks=SLOW)])
def test_i6_poisoned_unused_slots_change_nothing(rng, impl, fill):
    """NaN / Inf in every slot that is not a valid token: bit-identical to a clean cache."""
    state = rng.bit_generator.state
    poisoned = make_paged(rng, lens=[7, 0, 12, 3], block_size=4, fill=fill)
    rng.bit_generator.state = state
    clean = make_paged(rng, lens=[7, 0, 12, 3], block_size=4, fill=0.0)
    out, lse = decode(poisoned, impl)
    assert np.isfinite(np.asarray(out)).all()
    for g, c in zip((out, lse), decode(clean, impl)):
        np.testing.assert_array_equal(bits(g), bits(c))


@pytest.mark.parametrize("run", runs((None,) + SPLIT_CONFIGS, fast=(SPLIT_CONFIGS[4],)))
@pytest.mark.parametrize("poisoned", ["query", "key"])
def test_a_nan_query_or_key_propagates_as_in_torch_ref(rng, run, poisoned):
    """A NaN query head (or a NaN in one valid K row) gives NaN output rows and lse where
    torch_ref's softmax does (not zero rows: only a sequence without keys is zeros), and changes
    nothing else; with every merge (one split, the merge kernel, the merge inside the kernel)."""
    impl, config = run
    paged = make_paged(rng, lens=[40, 9, 0, 70], num_heads=8, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype="float32")
    paged.q[2, 3] = np.nan  # a zero-length row stays zeros
    if poisoned == "query":
        paged.q[0, 1] = np.nan
    else:  # sequence 0, position 20, kv head 0: query heads 0-3
        paged.k_cache[paged.block_tables[0, 1], 4, 0, 3] = np.nan
    out, lse = (np.asarray(x) for x in check(paged, impl, config))
    expected, expected_lse = torch_ref.paged_decode_attention(*paged.torch(), return_lse=True)
    nan_heads = [1] if poisoned == "query" else [0, 1, 2, 3]
    assert np.isnan(out[0, nan_heads]).all() and np.isnan(lse[0, nan_heads]).all()
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(to_numpy(expected).astype(np.float32)))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(to_numpy(expected_lse)))


@pytest.mark.parametrize("impl", IMPLS)
def test_i7_zero_length_rows(rng, impl):
    """Zero-length rows give zeros and lse -inf; the other rows are as if alone."""
    paged = make_paged(rng, lens=[0, 9, 0, 4], block_size=4)
    out, lse = check(paged, impl)
    assert (out[[0, 2]] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    alone = paged.replace(q=paged.q[[1, 3]], block_tables=paged.block_tables[[1, 3]],
                          context_lens=paged.context_lens[[1, 3]])
    alone_out, _ = decode(alone, impl)
    np.testing.assert_allclose(out[[1, 3]], np.asarray(alone_out), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_rows_zero_length(rng, impl):
    """A batch whose every row is empty gives zeros and lse -inf."""
    paged = make_paged(rng, lens=[0, 0], block_size=4, max_blocks=2)
    out, lse = decode(paged, impl)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_ids_in_valid_part_are_clamped_unchecked(rng, impl):
    """Unchecked (``check_values=False``, as under jit) a bad id inside the valid part reads a
    clamped block: never outside the cache."""
    paged = make_paged(rng, lens=[9, 12], block_size=4, fill=0.0)
    num_blocks = paged.k_cache.shape[0]
    tables = paged.block_tables.copy()
    tables[0, 1], tables[1, 0], tables[1, 2] = 2**30, -5, num_blocks
    out = pp.decode(*paged.jax(block_tables=tables), impl=impl, check_values=False)
    clamped = pp.decode(*paged.jax(block_tables=np.clip(tables, 0, num_blocks - 1)), impl=impl)
    np.testing.assert_array_equal(bits(out), bits(clamped))


@pytest.mark.parametrize("impl", IMPLS)
def test_lengths_out_of_range_are_clamped_unchecked(rng, impl):
    """Unchecked, a length above the capacity counts as the capacity, a negative one as 0."""
    paged = make_paged(rng, lens=[8, 4], block_size=4, fill=0.0)
    lens = np.array([-3, 100], np.int32)  # capacity is 2 blocks * 4 = 8
    out = pp.decode(*paged.jax(context_lens=lens), impl=impl, check_values=False)
    expected = pp.decode(*paged.jax(context_lens=np.array([0, 8], np.int32)), impl=impl,
                         check_values=False)  # row 1's second entry is the tail's -7: clamped
    np.testing.assert_array_equal(bits(out), bits(expected))


# --- precision, scale, dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_is_fp32_accurate(rng, impl):
    """No silent TF32: against the float64 truth, fp32 inputs give ~1e-6 errors (TF32 ~1e-3).
    A bound tighter than the tolerance rule's ``1e-5 * max|truth|`` floor, kept to pin fp32."""
    paged = make_paged(rng, lens=[200, 77], num_heads=4, num_kv_heads=1, head_dim=64,
                       block_size=16, fill=0.0)
    paged.q *= 4  # sharper softmax: rounding of the scores shows
    expected, _ = oracle_paged_attention(paged.q, paged.k_cache, paged.v_cache,
                                         paged.block_tables, paged.context_lens)
    out, _ = check(paged, impl)
    assert np.abs(out - expected).max() < 5e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_scale(rng, impl):
    """An explicit scale (negative too) against the truth; None is 1 / sqrt(head_dim), bit for
    bit."""
    paged = make_paged(rng, lens=[10, 3], block_size=4)
    check(paged, impl, scale=0.37)
    check(paged, impl, scale=-0.2)
    default = decode(paged, impl)[0]
    np.testing.assert_array_equal(bits(default), bits(decode(paged, impl,
                                                              scale=1 / np.sqrt(32))[0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_tables_and_lengths(rng, impl):
    """Real int64 (x64 on: with it off, JAX narrows the arrays before decode sees them), and numpy
    int64 arrays with x64 off: the same output as int32."""
    paged = make_paged(rng, lens=[10, 3], block_size=4)
    tables, lens = paged.block_tables.astype(np.int64), paged.context_lens.astype(np.int64)
    expected = pp.decode(*paged.jax(), impl=impl)
    with jax.enable_x64(True):
        args = paged.jax(block_tables=tables, context_lens=lens)
        assert args[3].dtype == args[4].dtype == jnp.int64
        out = pp.decode(*args, impl=impl)
    np.testing.assert_array_equal(bits(out), bits(expected))
    args = paged.jax()[:3] + [tables, lens]
    np.testing.assert_array_equal(bits(pp.decode(*args, impl=impl)), bits(expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_output_dtype_follows_q(rng, impl):
    """The output has q's dtype and shape, for every float dtype."""
    for dtype in ("float32", "bfloat16", "float16"):
        paged = make_paged(rng, lens=[5], dtype=dtype)
        out = pp.decode(*paged.jax(), impl=impl)
        assert out.dtype == jnp.dtype(dtype) and out.shape == paged.q.shape


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl):
    """Batch 0: an empty output [0, H, D] and lse [0, H]."""
    q = jnp.zeros((0, 4, 32), jnp.float32)
    cache = jnp.zeros((3, 4, 2, 32), jnp.float32)
    out, lse = pp.decode(q, cache, cache, jnp.zeros((0, 2), jnp.int32),
                         jnp.zeros((0,), jnp.int32), impl=impl, return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)


# --- extension options -------------------------------------------------------------------------

def options(rng, num_heads, which):
    every = dict(logits_soft_cap=3.0,
                 alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                 sliding_window=7,
                 sinks=rng.standard_normal(num_heads).astype(np.float32))
    return every if which == "all" else {which: every[which]}


OPTION_SPLITS = (C(block_k=16, num_splits=1), C(block_k=16, num_splits=3),
                 C(block_k=16, num_splits=3, merge_in_kernel=True),
                 C(block_k=16, persistent_programs=6))  # 3 per kv head
OPTIONS = ("logits_soft_cap", "alibi_slopes", "sliding_window", "sinks", "all")


OPTION_RUNS = [pytest.param(("xla", None), which, id=f"xla-{which}") for which in OPTIONS] + [
    pytest.param(("pallas", config), which, id=f"{run_id(('pallas', config))}-{which}",
                 marks=[] if config == OPTION_SPLITS[1] and which == "all" else [SLOW])
    for config in OPTION_SPLITS for which in OPTIONS]


@pytest.mark.parametrize("run,which", OPTION_RUNS)
def test_option_matches_the_truth(rng, run, which):
    """Each option alone and all together, with the lse, through one split, the merge kernel,
    the merge in the kernel and persistent programs."""
    impl, config = run
    paged = make_paged(rng, lens=[29, 0, 1, 5, 16, 33], num_heads=6, num_kv_heads=2,
                       block_size=5, head_dim=32)
    check(paged, impl, config, **options(rng, 6, which))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [pytest.param(1, marks=SLOW), pytest.param(4, marks=SLOW), 5,
                                    pytest.param(9, marks=SLOW), 1000])
def test_sliding_window_sizes(rng, impl, window):
    """Windows of 1, bs, bs + 1, more, and beyond every length (no window)."""
    paged = make_paged(rng, lens=[1, 4, 5, 23, 40], block_size=4)
    check(paged, impl, sliding_window=window)


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
    out = decode(paged.replace(k_cache=k_cache, v_cache=v_cache), impl, sliding_window=6)
    for g, c in zip(out, decode(paged, impl, sliding_window=6)):
        np.testing.assert_array_equal(bits(g), bits(c))


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
def test_sinks_with_zero_length_rows(rng, impl):
    """With a sink a zero-length row is still zeros with lse -inf; the others are finite."""
    paged = make_paged(rng, lens=[0, 6], block_size=4)
    sinks = np.array([5.0, -3.0, 0.0, 20.0], np.float32)
    out, lse = check(paged, impl, sinks=sinks)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q_dtype", ["bfloat16", pytest.param("float16", marks=SLOW),
                                     pytest.param("float32", marks=SLOW)])
def test_fp8_cache(rng, impl, q_dtype):
    """An fp8 cache read with each query dtype: the output has q's dtype."""
    paged = make_paged(rng, lens=[30, 0, 7, 16], num_heads=8, num_kv_heads=2, block_size=8,
                       dtype=FP8, q_dtype=q_dtype, head_dim=64)
    out, _ = decode(paged, impl, k_scale=0.5, v_scale=2.0)
    assert out.dtype == jnp.dtype(q_dtype)
    check(paged, impl, k_scale=0.5, v_scale=2.0)


@pytest.mark.parametrize("impl", impls())
def test_fp8_cache_with_every_option(rng, impl):
    """An fp8 cache with soft-cap, ALiBi, window, sinks and the lse together: the truth."""
    paged = make_paged(rng, lens=[21, 3, 0], num_heads=4, num_kv_heads=2, block_size=4, dtype=FP8)
    check(paged, impl, k_scale=0.25, v_scale=0.75, **options(rng, 4, "all"))


# The fp8 operand paths of the Triton kernel: V converted in the dot operand's read, V
# converted at load, K and V read as column pairs (`DecodeConfig.fp8_v_at_load`, `fp8_pairs`).
FP8_PATHS = {"v_in_operand_read": {}, "v_at_load": dict(fp8_v_at_load=True),
             "pairs": dict(fp8_pairs=True)}


@pytest.mark.parametrize("run", runs(
    [C(block_k=16, num_splits=2, num_warps=2, **path) for path in FP8_PATHS.values()],
    fast=(C(block_k=16, num_splits=2, num_warps=2, fp8_pairs=True),)))
@pytest.mark.parametrize("head_dim", [40, pytest.param(33, marks=SLOW)])
def test_fp8_cache_with_padded_head_dim(rng, run, head_dim):
    """head_dim 40 and 33: the kernel's tiles pad them to 64 columns, which `value_tile_for_dot`
    multiplies by 0 with ``fp8_v_at_load`` (the masked load has zeroed them), and which
    ``fp8_pairs`` reads as 32 words, 20 of them the head's; an odd head_dim has no column pairs,
    and ``fp8_pairs`` has no effect there."""
    impl, config = run
    paged = make_paged(rng, lens=[19, 4], num_heads=4, num_kv_heads=2, block_size=4, dtype=FP8,
                       head_dim=head_dim)
    check(paged, impl, config, k_scale=0.5, v_scale=1.5)


@pytest.mark.parametrize("run", runs(
    [C(block_k=16, **layout, **FP8_PATHS[path]) for path in ("v_at_load", "pairs")
     for layout in (dict(num_splits=3), dict(num_splits=3, merge_in_kernel=True),
                    dict(persistent_programs=4))],
    fast=(C(block_k=16, num_splits=3, merge_in_kernel=True, fp8_v_at_load=True),)))
def test_fp8_paths_with_every_option(rng, run):
    """Each fp8 operand path through the merge kernel, the merge in the kernel and persistent
    programs, with every option."""
    impl, config = run
    paged = make_paged(rng, lens=[21, 3, 0], num_heads=4, num_kv_heads=2, block_size=4, dtype=FP8)
    check(paged, impl, config, k_scale=0.25, v_scale=0.75, **options(rng, 4, "all"))


def every_fp8_pair():
    """u16[256, 256]: every pair of e4m3 bytes as a little-endian word (row: the odd column's
    byte, column: the even one's), and the two bytes' fp16 values."""
    even = np.broadcast_to(np.arange(256, dtype=np.uint16)[None, :], (256, 256))
    odd = np.broadcast_to(np.arange(256, dtype=np.uint16)[:, None], (256, 256))
    as_f16 = lambda byte: byte.astype(np.uint8).view(jnp.float8_e4m3fn).astype(np.float16)  # noqa: E731
    return (odd << 8) | even, as_f16(even), as_f16(odd)


def test_fp8_pairs_to_f16_keeps_every_pair_in_interpret_mode():
    """`fp8_pairs_to_f16` (the column pairs' conversion) in interpret mode, bit for bit."""
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
    """``return_lse``: f32[batch, num_heads], -inf for empty rows; without it, the same output."""
    paged = make_paged(rng, lens=[9, 0, 4], num_heads=4, num_kv_heads=2, block_size=4)
    out, lse = check(paged, impl)
    assert lse.shape == (3, 4) and lse.dtype == np.float32
    assert np.isneginf(lse[1]).all()
    np.testing.assert_array_equal(bits(pp.decode(*paged.jax(), impl=impl)), bits(out))


# --- jit, interpret, and proof that the kernel runs ----------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_usable_inside_user_jit(rng, impl):
    """decode traced inside a caller's jax.jit gives the eager result."""
    paged = make_paged(rng, lens=[6, 11], block_size=4)

    @jax.jit
    def step(q, k_cache, v_cache, tables, lens):
        return pp.decode(q, k_cache, v_cache, tables, lens, impl=impl) * 2

    np.testing.assert_allclose(np.asarray(step(*paged.jax())),
                               2 * np.asarray(decode(paged, impl)[0]), atol=1e-6)


def _lowered_text(impl: str, q_dtype=jnp.bfloat16, cache_dtype=None, **options) -> str:
    q = jax.ShapeDtypeStruct((2, 8, 64), q_dtype)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), cache_dtype or q_dtype)
    tables = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(pp.decode, impl=impl, interpret=False, **options)
    return lower_for_cuda(fn, q, cache, cache, tables, lens)


def test_pallas_impl_lowers_to_the_triton_kernel():
    """Lowered for CUDA (works without a GPU), impl="pallas" is a Triton call of our kernel."""
    text = _lowered_text("pallas")
    assert "__gpu$xla.gpu.triton" in text
    assert "pallas_paged_decode" in text


@pytest.mark.parametrize("config", [None, C(block_k=32, num_splits=2),
                                    C(block_k=32, num_splits=2, merge_in_kernel=True),
                                    C(block_k=32, persistent_programs=4)], ids=config_id)
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_the_triton_decode_launches_its_kernels_alone(fp8_cache, config):
    """Lowered for CUDA, decode(impl="pallas") is its kernels (the decode kernel, and the merge
    kernel with splits) and views of its operands, nothing XLA computes itself: each such op is
    one more launch per call on a GPU (stacking the two fp8 scales into one operand was one).
    The one-launch layouts (the merge in the kernel, persistent programs) add the zeros their
    arrival counts start from, and nothing else."""
    options = dict(k_scale=0.5, v_scale=0.25, cache_dtype=jnp.float8_e4m3fn) if fp8_cache else {}
    text = _lowered_text("pallas", config=config, **options)
    one_launch = config is not None and (config.merge_in_kernel or config.persistent_programs)
    assert launched_ops(text) == ({"broadcast_in_dim"} if one_launch else set())
    assert text.count("stablehlo.custom_call") == (2 if config is not None and config.num_splits > 1
                                                   and not config.merge_in_kernel else 1)


TRITON_LOWERINGS = [
    (q_dtype, fp8_cache, name)
    for q_dtype in ("float32", "bfloat16", "float16") for fp8_cache in (False, True)
    for name in ("default", "plain", "fp8_pairs", "fp8_v_at_load", "persistent")
    if fp8_cache or name not in ("fp8_pairs", "fp8_v_at_load")]  # no effect on 16/32-bit caches
LOWERING_CONFIGS = {"default": None, "plain": C(block_k=32, num_splits=2),
                    "fp8_pairs": C(block_k=32, num_splits=2, fp8_pairs=True),
                    "fp8_v_at_load": C(block_k=16, fp8_v_at_load=True),
                    "persistent": C(block_k=32, persistent_programs=4)}


@pytest.mark.parametrize("q_dtype,fp8_cache,name", [
    pytest.param(*case, marks=[] if case[2] in ("default", "fp8_pairs") else [SLOW])
    for case in TRITON_LOWERINGS])
def test_triton_kernel_lowers_for_every_dtype(q_dtype, fp8_cache, name):
    """Lowered for CUDA, Triton's own lowering checks what interpret mode lets through (a dot of
    an fp32 and an fp16 operand, say): every query dtype, with its own cache dtype or an fp8
    cache, with the default config and each fp8 option."""
    scales = dict(k_scale=0.5, v_scale=0.25) if fp8_cache else {}
    text = _lowered_text("pallas", q_dtype=jnp.dtype(q_dtype),
                         cache_dtype=jnp.float8_e4m3fn if fp8_cache else None,
                         config=LOWERING_CONFIGS[name], **scales)
    assert "pallas_paged_decode" in text


def test_compiled_triton_kernels_take_the_hardware_exp2():
    """Compiled, the online softmax of both Triton kernels (decode and ragged attention) is PTX's
    ``ex2.approx.ftz.f32`` (`pallas_triton.softmax_exp`); in interpret mode it is ``jnp.exp``,
    with no PTX in the program."""
    asm = "ex2.approx.ftz.f32"
    assert asm in _lowered_text("pallas")
    q = jax.ShapeDtypeStruct((5, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    qsl = jax.ShapeDtypeStruct((3,), jnp.int32)
    compiled = lower_for_cuda(functools.partial(pp.paged_attention, impl="pallas",
                                                interpret=False), q, cache, cache, tables, lens,
                              qsl)
    assert asm in compiled and "pallas_paged_ragged" in compiled
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=gpu)):
        traced = jax.jit(functools.partial(pp.paged_attention, impl="pallas", interpret=True)
                         ).trace(q, cache, cache, tables, lens, qsl)
        interpreted = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert asm not in interpreted


def test_xla_impl_has_no_kernel():
    """Lowered for CUDA, impl="xla" calls no Triton kernel."""
    text = _lowered_text("xla")
    assert "xla.gpu.triton" not in text and "pallas_paged_decode" not in text


@pytest.mark.parametrize("backend,interpret", [("gpu", False), ("cpu", True), ("tpu", True)])
def test_interpret_default_follows_the_backend(monkeypatch, backend, interpret):
    """interpret=None is interpret mode exactly when JAX's default backend is not a GPU; an
    explicit value is kept whatever the backend."""
    from pallas_paged import _platform
    monkeypatch.setattr(_platform.jax, "default_backend", lambda: backend)
    assert _platform.resolve_interpret(None) is interpret
    assert _platform.resolve_interpret(True) is True
    assert _platform.resolve_interpret(False) is False
    assert _platform.resolve_interpret(1) is True  # a bool either way


@pytest.mark.gpu
def test_compiled_kernel_runs_on_gpu(rng):
    """On a GPU the default is the compiled Triton kernel, and its HLO says so."""
    paged = make_paged(rng, lens=[33, 7], block_size=16, dtype="bfloat16", num_heads=8)
    args = paged.jax()
    text = jax.jit(functools.partial(pp.decode, impl="pallas")).lower(*args).compile().as_text()
    assert "pallas_paged_decode" in text
    check(paged, "pallas")


# --- the heuristic's configs and the tuned table --------------------------------------------------

def _decode_shape(batch, capacity, cache_dtype, *, num_kv_heads=8, group=4, head_dim=128,
                  block_size=16):
    return pp.DecodeShape(batch=batch, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                          block_size=block_size, capacity=capacity, cache_dtype=cache_dtype)


def _fp8_config(block_k, num_splits=1, num_warps=4):
    """The fp8 heuristic's config shape: column pairs, rings two tiles deep."""
    return C(block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=5,
             fp8_pairs=True)


@pytest.mark.parametrize("batch,capacity,cache_dtype,expected", [
    # 16-bit caches: rings one tile deep, about four programs per multiprocessor
    (32, 4096, "bfloat16", C(block_k=64, num_splits=2, num_warps=4, num_stages=2)),
    (1, 32768, "bfloat16", C(block_k=64, num_splits=64, num_warps=4, num_stages=2)),
    (128, 1024, "float16", C(block_k=64, num_splits=1, num_warps=4, num_stages=2)),
    # fp8 caches: column pairs, rings two tiles deep, about two programs per multiprocessor
    (32, 4096, FP8, _fp8_config(128)),
    (8, 16384, FP8, _fp8_config(128, num_splits=4)),
    (48, 4096, FP8, _fp8_config(128)),
    # fp8 just past three programs per multiprocessor (396 on 132 SMs): half the tile, two warps
    (56, 4096, FP8, _fp8_config(64, num_warps=2)),
    (64, 4096, FP8, _fp8_config(64, num_warps=2)),
    # ... but not where the larger programs fill their waves better
    (96, 4096, FP8, _fp8_config(128)),
    (128, 4096, FP8, _fp8_config(128)),
    (256, 1024, FP8, _fp8_config(128)),
])
def test_heuristic_config_of_the_measured_shapes(batch, capacity, cache_dtype, expected):
    """The heuristic picks the configs measured fastest at these shapes."""
    assert pp.get_heuristic_config(_decode_shape(batch, capacity, cache_dtype), 132) == expected


@pytest.mark.parametrize("cache_dtype,head_dim,block_k", [
    ("bfloat16", 256, 64), ("float16", 192, 64),  # 16-bit rows past 128 columns: K + V 64 KiB
    ("bfloat16", 128, 64),  # 128 columns: the 32 KiB rule
    ("float32", 256, 16), (FP8, 256, 64),  # other widths keep the 32 KiB rule
])
def test_heuristic_tile_of_wide_rows(cache_dtype, head_dim, block_k):
    """16-bit rows of 129-256 columns get 64-token tiles (`pallas_triton_config.WIDE_ROW_TILE_BYTES`) and 8
    warps; 32-token tiles ran 1.2-1.5x slower at head_dim 256 (docs/design/decode_triton.md)."""
    config = pp.get_heuristic_config(_decode_shape(32, 4096, cache_dtype, head_dim=head_dim), 132)
    assert config.block_k == block_k
    assert config.num_warps == (8 if head_dim > 128 else 4)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", FP8])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("batch", [1, 3, 64, 1024])
@pytest.mark.parametrize("capacity", [16, 1000, 131072])
def test_heuristic_configs_are_valid_and_never_split_short(cache_dtype, head_dim, batch,
                                                           capacity):
    """Every heuristic config is valid: splits of at least four tiles, tiles within the capacity, K +
    V of a tile within 64 KiB, column pairs exactly for fp8."""
    from pallas_paged._platform import next_power_of_2
    config = pp.get_heuristic_config(
        _decode_shape(batch, capacity, cache_dtype, head_dim=head_dim), 132)
    assert 1 <= config.num_splits <= 256
    assert config.num_splits == 1 or capacity // config.num_splits >= 4 * config.block_k
    assert config.block_k <= max(16, next_power_of_2(capacity))
    tile_bytes = 2 * config.block_k * next_power_of_2(head_dim) * np.dtype(
        jnp.dtype(cache_dtype)).itemsize
    assert tile_bytes <= 64 * 1024  # K + V of one tile; rings hold one or two of them
    assert config.fp8_pairs == (cache_dtype == FP8)
    assert not config.fp8_v_at_load and not config.merge_in_kernel


def test_a_window_is_looked_up_and_split_by_its_span():
    """A sliding window's call is keyed and split by the tokens a query attends: a window of 1024
    over 32K-token tables shares the class and the configs of 1024-token tables; a window at
    least the capacity changes nothing."""
    from pallas_paged.decode_attention import api, mosaic_gpu_config
    from pallas_paged.decode_attention.shape import shape_class
    full = _decode_shape(8, 32768, "bfloat16")
    windowed = dataclasses.replace(full, window=1024)
    short = _decode_shape(8, 1024, "bfloat16")
    assert (full.span, windowed.span, short.span) == (32768, 1024, 1024)
    assert shape_class(windowed) == shape_class(short) != shape_class(full)
    assert dataclasses.replace(short, window=4096).span == 1024
    for heuristic in (pp.get_heuristic_config, mosaic_gpu_config.get_mosaic_heuristic_config):
        assert heuristic(windowed, 132) == heuristic(short, 132)
    q = jax.ShapeDtypeStruct((8, 32, 128), jnp.bfloat16)
    k_cache = jax.ShapeDtypeStruct((16384, 16, 8, 128), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((8, 2048), jnp.int32)
    assert api.decode_shape(q, k_cache, tables, 1024) == windowed
    picked = api.select_kernel(q, k_cache, tables, impl="pallas", config=None, interpret=True,
                               sliding_window=1024)
    assert picked == ("pallas", pp.get_heuristic_config(windowed, api.sm_count()))
    assert picked[1].num_splits * 4 * picked[1].block_k <= 1024  # no split without 4 tiles


def test_tuned_h200_fp8_entries_keep_the_pair_layout():
    """A tuned fp8 entry keeps the heuristic's fp8 layout (the pairs, measured fastest) and
    changes only the tiling; B=32/ctx 4096, where the heuristic's tiling measured fastest, has
    none, B=8/ctx 16384 has its own."""
    from pallas_paged.decode_attention.pallas_triton_config import TUNED, lookup
    from pallas_paged.decode_attention.shape import shape_class
    fp8_entries = {key: config for key, config in TUNED["NVIDIA H200"].items() if key[0] == FP8}
    assert fp8_entries
    for config in fp8_entries.values():
        assert config.fp8_pairs and not config.fp8_v_at_load
    b32 = _decode_shape(32, 4096, FP8)
    assert lookup(b32, "NVIDIA H200", 132) == pp.get_heuristic_config(b32, 132)
    b8 = _decode_shape(8, 16384, FP8)
    assert lookup(b8, "NVIDIA H200", 132) == fp8_entries[shape_class(b8)]
    assert lookup(b8, "NVIDIA H200", 132) != pp.get_heuristic_config(b8, 132)


def test_tuned_persistent_entries_put_one_wave_of_programs_on_the_device():
    """Every tuned entry with persistent programs has one split, and its programs fill the
    device's 132 multiprocessors in one wave of two programs each, the layout measured (the
    ragged B=64 class on both devices), whatever the number of kv heads."""
    from pallas_paged.decode_attention.pallas_triton_config import TUNED, lookup
    persistent = [(kind, key, config) for kind, table in TUNED.items()
                  for key, config in table.items() if config.persistent_programs]
    assert persistent
    for kind, key, config in persistent:
        assert config.num_splits == 1
        assert config.persistent_programs == 2 * 132, (kind, key)
    ragged = _decode_shape(64, 8192, "bfloat16")
    assert lookup(ragged, "NVIDIA H100 80GB HBM3", 132).persistent_programs == 264
    assert lookup(ragged, "NVIDIA H200", 132).persistent_programs == 264

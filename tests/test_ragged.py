"""Ragged paged attention: `pallas_paged.paged_attention` with ``impl="xla"`` and ``impl="pallas"``
against the float64 oracle within the tolerance rule, every option, the SPEC invariants I8-I10,
``decode`` as the one-token case, the kernel's plan and configs, and proof that the kernel runs.

On a CPU the Pallas kernel runs in interpret mode; on a GPU the same tests run the compiled kernel.
Every case draws fresh inputs; every cache slot that is not a valid token holds NaN. The errors
(the same ValueError as torch_ref) and the jit rules for malformed inputs are in
test_validation.py.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from paged_inputs import (FP8, IMPLS, assert_close, assert_within_ulps, bits, jax_options,
                          launched_ops, lower_for_cuda, make_paged, make_ragged, reference,
                          to_numpy, torch_options)
from pallas_paged.ragged_attention.pallas_triton import interleave_short_programs
from pallas_paged.ragged_attention.tiles import kv_tile_plan

A = pp.AttentionConfig
SLOW = pytest.mark.slow
CONFIGS = (  # query tiles of 1, 2, 8 tokens (and short tiles of 2); one and several KV splits
    A(block_q=2, block_k=16, num_splits=1),
    A(block_q=8, short_block_q=2, block_k=16, num_splits=3),
    A(block_q=1, block_k=32, num_splits=2),
)


def config_id(config) -> str:
    if config is None:
        return "default"
    short = f"-short{config.short_block_q}" if config.short_block_q else ""
    pairs = "-pairs" if config.fp8_pairs else ""
    return f"bq{config.block_q}{short}-bk{config.block_k}-s{config.num_splits}{pairs}"


def attend(problem, impl, config=None, **options):
    """``(out, lse)`` of `pp.paged_attention` on ``problem``."""
    return pp.paged_attention(*problem.jax(), impl=impl, config=config, return_lse=True,
                              **jax_options(options))


def check(problem, impl, config=None, **options):
    """`pp.paged_attention` against the float64 truth within the tolerance rule: ``(out, lse)``
    as numpy."""
    ref = reference(*problem.arrays()[:5], query_start_loc=problem.query_start_loc, **options)
    out, lse = attend(problem, impl, config, **options)
    assert_close(ref, out, lse, what=f"{impl} {config_id(config)}")
    return np.asarray(out), np.asarray(lse)


def options(rng, num_heads, which):
    every = dict(logits_soft_cap=3.0,
                 alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                 sliding_window=6,
                 sinks=rng.standard_normal(num_heads).astype(np.float32))
    return every if which == "all" else {which: every[which]}


# (q_len, context_len): decode, spec decode 2-8, primes, a whole prompt, chunks over longer
# cached contexts, an empty sequence.
MIX = [(1, 9), (0, 5), (4, 20), (7, 7), (13, 40), (2, 2), (8, 31), (33, 70), (3, 11)]


@pytest.mark.parametrize("impl,dtype", [("xla", "float32"), ("xla", "bfloat16"),
                                        pytest.param("pallas", "float32", marks=SLOW),
                                        ("pallas", "bfloat16")])
def test_mixed_batch_matches_the_truth(rng, impl, dtype):
    """Decodes, speculations, whole prompts and chunks in one batch, padding rows after them."""
    problem = make_ragged(rng, MIX, pad=3, num_heads=8, num_kv_heads=2, head_dim=32,
                          block_size=4, dtype=dtype)
    out, lse = check(problem, impl, CONFIGS[1] if impl == "pallas" else None)
    assert (out[-3:] == 0).all() and np.isneginf(lse[-3:]).all()


@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=config_id)  # CONFIGS[1]: above
def test_kernel_configs(rng, config):
    """Query tiles of 2 and 1 tokens, one and two KV splits, on the mixed batch: the truth."""
    problem = make_ragged(rng, MIX, pad=2, num_heads=6, num_kv_heads=2, head_dim=32,
                          block_size=5)
    check(problem, "pallas", config)


@pytest.mark.parametrize("impl,block_size,num_heads,num_kv_heads", [
    pytest.param(impl, *case, marks=[] if impl == "xla" else [SLOW])
    for impl in IMPLS for case in [(1, 4, 4), (3, 4, 2), (16, 8, 2)]])
def test_block_sizes_and_gqa(rng, impl, block_size, num_heads, num_kv_heads):
    """GQA ratios 1, 2, 4 (3: `test_kernel_configs`); block sizes 1, 3, 16; lengths around the
    block size."""
    seqs = [(1, 1), (min(2, block_size), block_size), (2, block_size + 1),
            (5, 2 * block_size + 3), (0, 3)]
    problem = make_ragged(rng, seqs, pad=1, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=32, block_size=block_size)
    check(problem, impl, A(block_q=2, block_k=16, num_splits=2) if impl == "pallas" else None)


@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
@pytest.mark.parametrize("head_dim", [80])
def test_head_dims(rng, impl, head_dim):
    """head_dim 80 (padded to the kernel's tile): the truth."""
    problem = make_ragged(rng, [(5, 19), (1, 7)], num_heads=4, num_kv_heads=2,
                          head_dim=head_dim, block_size=8, dtype="bfloat16")
    check(problem, impl)


OPTION_CASES = [pytest.param("xla", w) for w in ("logits_soft_cap", "alibi_slopes",
                                                  "sliding_window", "sinks", "all")] + [
    pytest.param("pallas", "sliding_window", marks=SLOW), pytest.param("pallas", "all")]


@pytest.mark.parametrize("impl,which", OPTION_CASES)
def test_options_match_the_truth(rng, impl, which):
    """Each option alone (XLA) and all together (both), with split KV tiles and short tiles."""
    problem = make_ragged(rng, [(9, 30), (0, 4), (1, 6), (4, 17), (12, 12)], pad=2,
                          num_heads=6, num_kv_heads=2, head_dim=32, block_size=5)
    config = A(block_q=4, short_block_q=1, block_k=16, num_splits=2)
    check(problem, impl, config if impl == "pallas" else None, **options(rng, 6, which))


def test_xla_path_in_token_chunks_matches_the_truth(rng, monkeypatch):
    """The XLA path takes tokens a chunk at a time when their rows would pass its memory budget:
    here chunks of 3 tokens (not dividing the 33 tokens plus padding), every option, padding rows
    and an empty sequence: the truth, and the one-chunk program's result."""
    from pallas_paged.ragged_attention import xla as ragged_xla

    problem = make_ragged(rng, [(9, 30), (0, 4), (1, 6), (4, 17), (12, 12), (7, 9)], pad=2,
                          num_heads=6, num_kv_heads=2, head_dim=32, block_size=5)
    kwargs = options(rng, 6, "all")
    whole = attend(problem, "xla", **kwargs)
    capacity = problem.block_tables.shape[1] * 5
    monkeypatch.setattr(ragged_xla, "ROW_BUDGET_ELEMENTS", 3 * capacity * 2 * 32)
    assert ragged_xla.token_chunk(len(problem.q), capacity * 2 * 32) == 3
    chunked = check(problem, "xla", **kwargs)
    for got, want in zip(chunked, whole):
        np.testing.assert_allclose(got, np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
def test_sliding_window_skips_poisoned_blocks_outside_it(rng, impl):
    """Whole blocks before every query's window may hold NaN: they are not read."""
    window = 5
    problem = make_ragged(rng, [(3, 40), (2, 23)], block_size=4)
    k_cache, v_cache = problem.k_cache.copy(), problem.v_cache.copy()
    for b, (n, q_len) in enumerate(zip(problem.context_lens, np.diff(problem.query_start_loc))):
        first_seen = max(n - q_len - window + 1, 0)
        for page in range(first_seen // 4):
            k_cache[problem.block_tables[b, page]] = np.nan
            v_cache[problem.block_tables[b, page]] = np.nan
    poisoned = problem.replace(k_cache=k_cache, v_cache=v_cache)
    out, _ = attend(poisoned, impl, sliding_window=window)
    np.testing.assert_array_equal(bits(out), bits(attend(problem, impl,
                                                         sliding_window=window)[0]))


@pytest.mark.parametrize("impl,q_dtype", [("xla", "float32"),
                                          pytest.param("pallas", "bfloat16", marks=SLOW)])
def test_fp8_cache_with_every_option(rng, impl, q_dtype):
    """An fp8 cache with every option: the truth; the output has q's dtype."""
    problem = make_ragged(rng, [(6, 21), (1, 3), (0, 2), (3, 9)], num_heads=4, num_kv_heads=2,
                          block_size=4, dtype=FP8, q_dtype=q_dtype)
    check(problem, impl, k_scale=0.25, v_scale=0.75, **options(rng, 4, "all"))
    out = pp.paged_attention(*problem.jax(), impl=impl, k_scale=0.25, v_scale=0.75)
    assert out.dtype == jnp.dtype(q_dtype)


@pytest.mark.parametrize("config,head_dim", [
    pytest.param(config, head_dim, id=f"{name}-{head_dim}",
                 marks=[] if (name, head_dim) == ("one_split", 40) else [SLOW])
    for name, config in (("split_short", A(block_q=4, short_block_q=1, block_k=16, num_splits=2,
                                           fp8_pairs=True)),
                         ("one_split", A(block_q=8, block_k=16, fp8_pairs=True)))
    for head_dim in (32, 40, 33)])
def test_fp8_column_pairs_with_every_option(rng, config, head_dim):
    """`AttentionConfig.fp8_pairs`: K and V read as u16 words of two head columns, the dots split
    into the even and the odd columns; head_dim 40 pads to 64 columns (32 words, 20 of the
    head's), and an odd head_dim has no pairs (no effect). Every slot that is not a valid token
    holds NaN (`make_paged`): none reaches the output, as without the pairs."""
    problem = make_ragged(rng, [(6, 21), (1, 3), (0, 2), (3, 9)], num_heads=4, num_kv_heads=2,
                          head_dim=head_dim, block_size=4, dtype=FP8, q_dtype="bfloat16")
    check(problem, "pallas", config, k_scale=0.25, v_scale=0.75, **options(rng, 4, "all"))


@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
def test_fp8_scales_as_arrays_one_program_for_every_scale(rng, impl):
    """Scalar f32 array scales equal the same python floats, in torch_ref and in JAX, and a jitted
    step compiles once for three different pairs of scales."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, num_heads=4, num_kv_heads=2,
                          block_size=4, dtype=FP8, q_dtype="bfloat16")
    arrays = problem.jax()
    traces = []

    @jax.jit
    def step(k_scale, v_scale, *arrays):
        traces.append(1)
        return pp.paged_attention(*arrays, impl=impl, k_scale=k_scale, v_scale=v_scale)

    for k_scale, v_scale in ((0.25, 0.75), (0.5, 2.0), (1.5, 0.125)):
        got = step(jnp.float32(k_scale), jnp.float32(v_scale), *arrays)
        want = pp.paged_attention(*arrays, impl=impl, k_scale=k_scale, v_scale=v_scale)
        np.testing.assert_array_equal(bits(got), bits(want))
        tensors = problem.torch()
        ref = torch_ref.paged_attention(*tensors, k_scale=torch.tensor(k_scale),
                                        v_scale=torch.tensor([v_scale]))
        np.testing.assert_array_equal(bits(ref), bits(torch_ref.paged_attention(
            *tensors, k_scale=k_scale, v_scale=v_scale)))
        truth = reference(*problem.arrays()[:5], query_start_loc=problem.query_start_loc,
                          k_scale=k_scale, v_scale=v_scale)
        assert_close(truth, got)
    assert len(traces) == 1


@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
def test_huge_windows_and_tables_of_width_zero(rng, impl):
    """A window of 2**31 or more is no window (as in torch_ref); a [B, 0] table gives zeros."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, block_size=4)
    plain, _ = check(problem, impl)
    for window in (2**31, 2**40):
        np.testing.assert_array_equal(bits(attend(problem, impl, sliding_window=window)[0]),
                                      bits(plain))
        expected = torch_ref.paged_attention(*problem.torch(), sliding_window=window)
        np.testing.assert_array_equal(bits(expected), bits(torch_ref.paged_attention(
            *problem.torch())))
    empty = problem.replace(block_tables=np.zeros((2, 0), np.int32),
                            context_lens=np.zeros(2, np.int32),
                            query_start_loc=np.zeros(3, np.int32))
    out, lse = check(empty, impl)
    expected, expected_lse = torch_ref.paged_attention(*empty.torch(), return_lse=True)
    assert not out.any() and not expected.any()
    assert np.isneginf(lse).all() and torch.isneginf(expected_lse).all()


# --- SPEC invariants I8-I10 --------------------------------------------------------------------

def _slots(problem, b, positions):
    block_size = problem.k_cache.shape[1]
    return [(problem.block_tables[b, j // block_size], j % block_size) for j in positions]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_options", [pytest.param(False, marks=SLOW), True])
def test_i8_later_positions_are_never_seen(rng, impl, with_options):
    """Poisoning every position from ``cut`` on (NaN) leaves the rows of queries before ``cut``
    bit for bit unchanged."""
    seqs = [(12, 30), (7, 7), (5, 22)]
    problem = make_ragged(rng, seqs, num_heads=4, num_kv_heads=2, block_size=4)
    extra = options(rng, 4, "all") if with_options else {}
    config = A(block_q=8, block_k=16, num_splits=2) if impl == "pallas" else None
    clean, _ = attend(problem, impl, config, **extra)
    k_cache, v_cache = problem.k_cache.copy(), problem.v_cache.copy()
    kept = []
    for b, (q_len, n) in enumerate(seqs):
        first = int(problem.query_start_loc[b])
        cut = n - q_len + q_len // 2  # queries at positions < cut keep their rows
        for block, offset in _slots(problem, b, range(cut, n)):
            k_cache[block, offset] = np.nan
            v_cache[block, offset] = np.nan
        kept += [first + i for i in range(q_len) if n - q_len + i < cut]
    poisoned = problem.replace(k_cache=k_cache, v_cache=v_cache)
    out, _ = attend(poisoned, impl, config, **extra)
    np.testing.assert_array_equal(bits(out)[kept], bits(clean)[kept])


@pytest.mark.parametrize("impl", IMPLS)
def test_i9_padding_rows_are_zeros_and_disturb_nothing(rng, impl):
    """Rows past ``query_start_loc[batch]`` are zeros (lse -inf) whatever they hold (NaN here),
    and change no other row."""
    problem = make_ragged(rng, [(5, 12), (1, 3), (3, 9)], pad=6, block_size=4)
    config = A(block_q=4, short_block_q=2, block_k=16) if impl == "pallas" else None
    out, lse = check(problem, impl, config)
    assert (out[-6:] == 0).all() and np.isneginf(lse[-6:]).all()
    problem.q[-6:] = np.nan  # padding rows may hold anything
    poisoned, poisoned_lse = attend(problem, impl, config)
    np.testing.assert_array_equal(bits(poisoned), bits(out))
    np.testing.assert_array_equal(bits(poisoned_lse), bits(lse))


@pytest.mark.parametrize("impl", IMPLS)
def test_i10_each_sequence_is_dense_causal_attention(rng, impl):
    """Each sequence's rows are the truth of dense causal attention over its gathered K/V, and
    the same sequence alone in the batch (the others with no new tokens) gives the same rows:
    the mix of q lengths changes nothing."""
    seqs = [(6, 6), (1, 13), (9, 25), (0, 4), (4, 10)]
    problem = make_ragged(rng, seqs, num_heads=4, num_kv_heads=2, block_size=4, spare_blocks=8)
    config = A(block_q=4, block_k=16, num_splits=2) if impl == "pallas" else None
    out, _ = check(problem, impl, config)
    block_size = problem.k_cache.shape[1]
    for b, (q_len, n) in enumerate(seqs):
        if q_len == 0:
            continue
        # Dense: the sequence's K/V gathered into contiguous blocks 0, 1, ... in order.
        pages = -(-n // block_size)
        dense_k, dense_v = (c[problem.block_tables[b, :pages]] for c in (problem.k_cache,
                                                                         problem.v_cache))
        first = problem.query_start_loc[b]
        dense = problem.replace(q=problem.q[first:first + q_len], k_cache=dense_k,
                                v_cache=dense_v,
                                block_tables=np.arange(pages, dtype=np.int32)[None],
                                context_lens=np.array([n], np.int32),
                                query_start_loc=np.array([0, q_len], np.int32))
        ref = reference(*dense.arrays()[:5], query_start_loc=dense.query_start_loc)
        assert_close(ref, out[first:first + q_len].astype(problem.q.dtype))
        # The same sequence alone (its rows first, the rest padding).
        q_lens = np.zeros(len(seqs), np.int32)
        q_lens[b] = q_len
        rows = np.r_[first:first + q_len, 0:first, first + q_len:len(problem.q)]
        alone = problem.replace(q=problem.q[rows],
                                query_start_loc=np.r_[0, np.cumsum(q_lens)].astype(np.int32))
        np.testing.assert_allclose(np.asarray(attend(alone, impl, config)[0])[:q_len],
                                   out[first:first + q_len], atol=1e-6, rtol=0)


# --- decode is the one-token case ----------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", [pytest.param("none", marks=SLOW), "every_option",
                                   pytest.param("fp8", marks=SLOW)])
def test_decode_equals_one_token_per_sequence(rng, impl, which):
    """``decode`` is ``paged_attention`` with ``query_start_loc = arange(B + 1)``: every option at
    once (soft-cap, ALiBi, window, sinks, lse), and with an fp8 cache; torch_ref's two functions
    agree bit for bit."""
    dtype = FP8 if which == "fp8" else "float32"
    paged = make_paged(rng, lens=[37, 1, 16, 17, 5], num_heads=8, num_kv_heads=2, block_size=4,
                       dtype=dtype)
    if which == "none":
        extra = {}
    else:
        extra = options(rng, 8, "all")
        if which == "fp8":
            extra.update(k_scale=0.5, v_scale=2.0)
    args = paged.jax()
    qsl = jnp.arange(len(paged.context_lens) + 1, dtype=jnp.int32)
    want, want_lse = pp.decode(*args, impl=impl, return_lse=True, **jax_options(extra))
    got, got_lse = pp.paged_attention(*args, qsl, impl=impl, return_lse=True, **jax_options(extra))
    # The two kernels differ in their tiles and reductions: fp32 sums within 1e-6; over an fp8
    # cache each rounds its softmax weights to fp16 per tile (tiles of its own config), so the
    # bf16 outputs agree within an ulp at the scale of the outputs (averages of the values),
    # not of each output (a row near 0 averages values far larger), lse within 1e-5.
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
    else:
        scale = float(np.abs(to_numpy(want).astype(np.float32)).max())
        assert_within_ulps(got, want, "bfloat16", ulps=1, magnitude=scale)
    np.testing.assert_allclose(to_numpy(got_lse), to_numpy(want_lse), atol=1e-5, rtol=1e-6)
    assert_close(reference(*paged.arrays(), **extra), got, got_lse)
    ref = torch_ref.paged_attention(*paged.torch(), torch.arange(len(paged.context_lens) + 1),
                                    **torch_options(extra))
    ref_decode = torch_ref.paged_decode_attention(*paged.torch(), **torch_options(extra))
    torch.testing.assert_close(ref, ref_decode, atol=0, rtol=0)


# --- the kernel's plan: causal and window skipping ---------------------------------------------

@pytest.mark.parametrize("block_k,num_splits,window", list(itertools.product(
    [16, 32], [1, 3], [None, 1, 16, 21])))
def test_kernel_visits_only_tiles_someone_sees(block_k, num_splits, window):
    """Each tile with a position some query of the tile sees is visited exactly once; no other
    tile is; tiles in the unmasked range are seen whole by every query."""
    for n, first_pos, tile_queries in [(1, 0, 1), (40, 39, 1), (40, 20, 8), (100, 37, 16),
                                       (100, 97, 3), (64, 0, 16), (30, 30, 0), (9, -3, 4)]:
        last = first_pos + tile_queries - 1
        seen = {j for p in range(max(first_pos, 0), last + 1) for j in range(p + 1)
                if window is None or j > p - window}
        wanted = {j // block_k for j in seen}
        visited = []
        for split in range(num_splits):
            _, _, shared_lo, shared_hi, loops = kv_tile_plan(
                jnp.int32(first_pos), jnp.int32(tile_queries), jnp.int32(n), jnp.int32(split),
                block_k=block_k, num_splits=num_splits, window=window)
            for index, (lo, hi) in enumerate(loops):
                tiles = list(range(int(lo), int(hi)))
                visited += tiles
                if index == 1:  # the unmasked range
                    for t in tiles:
                        assert int(shared_lo) <= t * block_k and (t + 1) * block_k <= int(shared_hi)
        assert sorted(visited) == sorted(wanted), (n, first_pos, tile_queries)


# --- edge cases --------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
def test_all_rows_padding_and_empty_inputs(rng, impl):
    """Sequences without new tokens: every row is padding (zeros, -inf); no rows, no sequences."""
    problem = make_ragged(rng, [(0, 3), (0, 0)], pad=4, block_size=4)
    out, lse = check(problem, impl)
    assert (out == 0).all() and np.isneginf(lse).all()
    out, lse = attend(problem.replace(q=problem.q[:0]), impl)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)
    no_batch = problem.replace(block_tables=problem.block_tables[:0],
                               context_lens=problem.context_lens[:0],
                               query_start_loc=np.zeros(1, np.int32))
    out, lse = attend(no_batch, impl)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("impl", [pytest.param("xla"), pytest.param("pallas", marks=SLOW)])
def test_int64_indices_and_user_jit(rng, impl):
    """int64 tables, lengths and query_start_loc give the int32 result, bit for bit; the call
    works inside a caller's jax.jit."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, block_size=4)
    wide = problem.replace(block_tables=problem.block_tables.astype(np.int64),
                           context_lens=problem.context_lens.astype(np.int64),
                           query_start_loc=problem.query_start_loc.astype(np.int64))
    expected, _ = check(problem, impl)
    got = pp.paged_attention(*wide.arrays(), impl=impl)
    np.testing.assert_array_equal(bits(got), bits(expected))

    @jax.jit
    def step(*arrays):
        return pp.paged_attention(*arrays, impl=impl) * 2

    out = step(*problem.jax())
    np.testing.assert_allclose(np.asarray(out), 2 * expected, atol=1e-6)


@pytest.mark.parametrize("impl,config", [pytest.param("xla", None, id="xla")] + [
    pytest.param("pallas", c, id=f"pallas-{config_id(c)}", marks=SLOW)
    for c in (None,) + CONFIGS])
def test_a_nan_query_propagates_as_in_torch_ref(rng, impl, config):
    """A NaN query token head gives a NaN output row and lse, as torch_ref's softmax does, and
    changes no other row (one split, and the merge of several)."""
    problem = make_ragged(rng, [(3, 40), (1, 9), (5, 70)], pad=1, num_heads=8, num_kv_heads=2,
                          head_dim=32, block_size=16, dtype="float32")
    problem.q[4, 2] = np.nan  # the second sequence's only query token, head 2
    out, lse = check(problem, impl, config)
    expected, expected_lse = torch_ref.paged_attention(*problem.torch(), return_lse=True)
    assert np.isnan(out[4, 2]).all() and np.isnan(lse[4, 2])
    np.testing.assert_array_equal(np.isnan(out), np.isnan(to_numpy(expected)))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(to_numpy(expected_lse)))


# --- the kernel runs; its configs -------------------------------------------------------------

def _jaxpr_text(impl):
    q = jax.ShapeDtypeStruct((40, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((3, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    qsl = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = functools.partial(pp.paged_attention, impl=impl, interpret=False)
    return str(jax.make_jaxpr(fn)(q, cache, cache, tables, lens, qsl))


def test_pallas_impl_is_the_named_kernel():
    """impl="pallas" is a pallas_call of the named kernel; impl="xla" has none."""
    assert "pallas_paged_ragged" in _jaxpr_text("pallas")
    assert "pallas_call" not in _jaxpr_text("xla")


def test_heuristic_configs():
    """The heuristic's query tiles, short tiles and splits for decode, speculation, prefill and a
    mix."""
    shape = lambda tokens, batch: pp.AttentionShape(  # noqa: E731
        num_tokens=tokens, batch=batch, num_kv_heads=8, group=4, head_dim=128, block_size=16,
        capacity=4096, cache_dtype="bfloat16")
    from pallas_paged.ragged_attention.pallas_triton_config import get_heuristic_config
    decode = get_heuristic_config(shape(32, 32), 132)
    assert decode.block_q == 1 and decode.dot_rows(4) == 16 and decode.num_splits >= 2
    spec = get_heuristic_config(shape(128, 32), 132)
    assert spec.block_q == 4 and spec.dot_rows(4) == 16
    prefill = get_heuristic_config(shape(8192, 4), 132)
    assert prefill.dot_rows(4) == 64 and prefill.num_splits == 1 and prefill.num_stages == 3
    assert prefill.long_query_tiles(8192, 4) == 8192 // prefill.block_q + 4
    assert decode.query_tiles(32, 32) == 32  # one program per token, none idle
    # decode rows of a prefill-sized config take 16-row short tiles, from programs of their own
    assert decode.short_block_q == 0 and spec.short_block_q == 0
    assert prefill.short_block_q == 0 and prefill.query_tiles(8192, 4) == 8192 // 16 + 4
    mixed = get_heuristic_config(shape(2108, 64), 132)  # 4 x 512 prefill tokens + 60 decodes
    assert mixed.block_q == 16 and mixed.short_block_q == 4
    assert mixed.query_tiles(2108, 64) == -(-2108 // 16) + 64 + 64


@pytest.mark.parametrize("long_programs,batch", [(2, 1), (5, 4), (9, 4), (196, 64), (7, 3)])
def test_short_programs_interleave_as_a_bijection(long_programs, batch):
    """Every long tile index and every sequence's short tile has exactly one program, and the
    short programs are spread over the whole query axis."""
    programs = jnp.arange(long_programs + batch)
    is_short, index = jax.vmap(functools.partial(
        interleave_short_programs, long_programs=long_programs, batch=batch))(programs)
    is_short, index = np.asarray(is_short), np.asarray(index)
    assert sorted(index[is_short]) == list(range(batch))
    assert sorted(index[~is_short]) == list(range(long_programs))
    gaps = np.diff(np.flatnonzero(is_short))
    assert (gaps == (long_programs + batch) // batch).all()


@pytest.mark.gpu
def test_compiled_kernel_runs_on_gpu(rng):
    """On a GPU the compiled program calls the ragged kernel, and every config gives the truth."""
    problem = make_ragged(rng, MIX, pad=3, num_heads=8, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype="bfloat16")
    text = jax.jit(functools.partial(pp.paged_attention, impl="pallas")).lower(
        *problem.jax()).compile()
    assert "pallas_paged_ragged" in text.as_text()
    for config in (None, *CONFIGS):
        check(problem, "pallas", config)


def test_the_fp8_scales_reach_the_kernel_as_operands():
    """Lowered for CUDA (no GPU needed), paged_attention(impl="pallas") with an fp8 cache adds no
    XLA op for its scales over the bf16 call (stacking the two into one operand was one, one more
    launch per call): the two programs launch the same XLA ops beside the kernel (those that
    sanitize ``query_start_loc``)."""
    def lowered(cache_dtype, **scales):
        q = jax.ShapeDtypeStruct((7, 8, 64), jnp.bfloat16)
        cache = jax.ShapeDtypeStruct((40, 16, 2, 64), cache_dtype)
        tables = jax.ShapeDtypeStruct((2, 8), jnp.int32)
        lens = jax.ShapeDtypeStruct((2,), jnp.int32)
        starts = jax.ShapeDtypeStruct((3,), jnp.int32)
        fn = functools.partial(pp.paged_attention, impl="pallas", interpret=False,
                               config=A(num_splits=1), **scales)
        return lower_for_cuda(fn, q, cache, cache, tables, lens, starts)

    fp8 = lowered(jnp.float8_e4m3fn, k_scale=0.5, v_scale=0.25)
    assert "pallas_paged_ragged" in fp8
    assert launched_ops(fp8) == launched_ops(lowered(jnp.bfloat16))

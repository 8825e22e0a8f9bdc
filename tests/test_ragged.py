"""Ragged paged attention: `pallas_paged.paged_attention` (both impls) against `torch_ref` and the
float64 oracle, every option, the SPEC invariants I8-I10, ``decode`` as the one-token case, the
errors, and proof that the kernel runs.

On CPU the Pallas kernel runs in interpret mode; on a GPU the same tests run the compiled kernel.
Every case draws fresh inputs; every cache slot that is not a valid token holds NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from oracle import oracle_ragged_attention
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from paged_inputs import assert_close_with_the_same_nans, launched_ops, make_paged, to_numpy, to_torch
from pallas_paged.ragged_attention.pallas_triton import interleave_short_programs, kv_tile_plan
from test_decode import ATOL, IMPLS

CONFIGS = (  # query tiles of 1, 2, 8 tokens (and short tiles of 2); one and several KV splits
    pp.AttentionConfig(block_q=2, block_k=16, num_splits=1),
    pp.AttentionConfig(block_q=8, short_block_q=2, block_k=16, num_splits=3),
    pp.AttentionConfig(block_q=1, block_k=32, num_splits=2),
)


@dataclasses.dataclass
class Ragged:
    """numpy arrays of one ragged problem: the cache and tables of `make_paged`, packed queries."""

    q: np.ndarray                # [num_tokens, H, D]
    k_cache: np.ndarray          # [num_blocks, bs, KVH, D]
    v_cache: np.ndarray
    block_tables: np.ndarray     # i32[B, max_blocks]
    context_lens: np.ndarray     # i32[B]
    query_start_loc: np.ndarray  # i32[B + 1]

    def arrays(self, **overrides):
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays.update(overrides)
        return [arrays[f.name] for f in dataclasses.fields(self)]


def make_ragged(rng, seqs, *, pad=0, **kwargs) -> Ragged:
    """``seqs`` = ``[(q_len, context_len), ...]``; ``pad`` padding rows after the last sequence."""
    q_lens = [q_len for q_len, _ in seqs]
    paged = make_paged(rng, lens=[n for _, n in seqs], **kwargs)
    _, num_heads, head_dim = paged.q.shape
    q = rng.standard_normal((sum(q_lens) + pad, num_heads, head_dim)).astype(paged.q.dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Ragged(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, qsl)


def _jax(kwargs):
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def _torch(kwargs):
    return {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def run_jax(problem, impl, config=None, **kwargs):
    """Output (and lse) as float32 numpy."""
    out = pp.paged_attention(*[jnp.asarray(a) for a in problem.arrays()], impl=impl,
                             config=config, return_lse=True, **_jax(kwargs))
    return to_numpy(out[0]).astype(np.float32), to_numpy(out[1])


def run_torch(problem, **kwargs):
    out, lse = torch_ref.paged_attention(*[to_torch(a) for a in problem.arrays()],
                                         return_lse=True, **_torch(kwargs))
    return to_numpy(out).astype(np.float32), to_numpy(lse)


def run_oracle(problem, **kwargs):
    k_cache, v_cache = (np.asarray(c).astype(np.float64)
                        for c in (problem.k_cache, problem.v_cache))
    return oracle_ragged_attention(np.asarray(problem.q).astype(np.float64), k_cache, v_cache,
                                   problem.block_tables, problem.context_lens,
                                   problem.query_start_loc, **kwargs)


def assert_matches(problem, impl, dtype, config=None, oracle=False, **kwargs):
    """Against torch_ref on the same inputs (and, with ``oracle``, the float64 oracle)."""
    got, got_lse = run_jax(problem, impl, config, **kwargs)
    expected, expected_lse = run_torch(problem, **kwargs)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    np.testing.assert_allclose(got, expected, atol=ATOL[dtype], rtol=0)
    np.testing.assert_allclose(got_lse, expected_lse, atol=1e-4, rtol=1e-5)
    if oracle:
        truth, truth_lse = run_oracle(problem, **kwargs)
        atol = 5e-6 if dtype == "float32" else ATOL[dtype]
        np.testing.assert_allclose(got, truth, atol=atol, rtol=0)
        np.testing.assert_allclose(expected, truth, atol=atol, rtol=0)
        np.testing.assert_allclose(got_lse, truth_lse, atol=1e-4, rtol=1e-5)
    return got, got_lse


# (q_len, context_len): decode, spec decode 2-8, primes, a whole prompt, chunks over longer
# cached contexts, an empty sequence.
MIX = [(1, 9), (0, 5), (4, 20), (7, 7), (13, 40), (2, 2), (8, 31), (33, 70), (3, 11)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_matches_torch_ref_and_oracle(rng, impl, dtype):
    problem = make_ragged(rng, MIX, pad=3, num_heads=8, num_kv_heads=2, head_dim=32,
                          block_size=4, dtype=dtype)
    out, lse = assert_matches(problem, impl, dtype, config=CONFIGS[1] if impl == "pallas" else None,
                              oracle=dtype == "float32")
    assert (out[-3:] == 0).all() and np.isneginf(lse[-3:]).all()


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=str)  # CONFIGS[1]: above
def test_kernel_configs(rng, config):
    problem = make_ragged(rng, MIX, pad=2, num_heads=6, num_kv_heads=2, head_dim=32,
                          block_size=5)
    assert_matches(problem, "pallas", "float32", config=config)


@pytest.mark.parametrize("impl,block_size,num_heads,num_kv_heads",
                         [(impl, *case) for impl in IMPLS for case in [(1, 4, 4), (3, 4, 2),
                                                                       (16, 8, 2)]])
def test_block_sizes_and_gqa(rng, impl, block_size, num_heads, num_kv_heads):
    """GQA ratios 1, 2, 4 (3: `test_kernel_configs`); block sizes 1, 3, 16; lengths around the
    block size."""
    seqs = [(1, 1), (min(2, block_size), block_size), (2, block_size + 1),
            (5, 2 * block_size + 3), (0, 3)]
    problem = make_ragged(rng, seqs, pad=1, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=32, block_size=block_size)
    assert_matches(problem, impl, "float32",
                   config=pp.AttentionConfig(block_q=2, block_k=16, num_splits=2)
                   if impl == "pallas" else None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", [80])
def test_head_dims(rng, impl, head_dim):
    problem = make_ragged(rng, [(5, 19), (1, 7)], num_heads=4, num_kv_heads=2,
                          head_dim=head_dim, block_size=8, dtype="bfloat16")
    assert_matches(problem, impl, "bfloat16")


def options(rng, num_heads, which):
    every = dict(logits_soft_cap=3.0,
                 alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                 sliding_window=6,
                 sinks=rng.standard_normal(num_heads).astype(np.float32))
    return every if which == "all" else {which: every[which]}


OPTION_CASES = [("xla", w) for w in ("logits_soft_cap", "alibi_slopes", "sliding_window", "sinks",
                                     "all")] + [("pallas", w) for w in ("sliding_window", "all")]


@pytest.mark.parametrize("impl,which", OPTION_CASES)
def test_options_match_torch_ref(rng, impl, which):
    problem = make_ragged(rng, [(9, 30), (0, 4), (1, 6), (4, 17), (12, 12)], pad=2,
                          num_heads=6, num_kv_heads=2, head_dim=32, block_size=5)
    config = pp.AttentionConfig(block_q=4, short_block_q=1, block_k=16, num_splits=2)
    assert_matches(problem, impl, "float32", config=config if impl == "pallas" else None,
                   oracle=which == "all", **options(rng, 6, which))


def test_xla_path_in_token_chunks_matches_torch_ref(rng, monkeypatch):
    """The XLA path takes tokens a chunk at a time when their rows would pass its memory budget:
    here chunks of 3 tokens (not dividing the 33 tokens plus padding), every option, padding rows
    and an empty sequence: the same results as torch_ref, and as the one-chunk program."""
    from pallas_paged.ragged_attention import xla as ragged_xla

    problem = make_ragged(rng, [(9, 30), (0, 4), (1, 6), (4, 17), (12, 12), (7, 9)], pad=2,
                          num_heads=6, num_kv_heads=2, head_dim=32, block_size=5)
    kwargs = options(rng, 6, "all")
    whole = run_jax(problem, "xla", **kwargs)
    capacity = problem.block_tables.shape[1] * 5
    monkeypatch.setattr(ragged_xla, "ROW_BUDGET_ELEMENTS", 3 * capacity * 2 * 32)
    assert ragged_xla.token_chunk(len(problem.q), capacity * 2 * 32) == 3
    chunked = assert_matches(problem, "xla", "float32", oracle=True, **kwargs)
    for got, want in zip(chunked, whole):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
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
    poisoned = dataclasses.replace(problem, k_cache=k_cache, v_cache=v_cache)
    out, _ = run_jax(poisoned, impl, sliding_window=window)
    np.testing.assert_array_equal(out, run_jax(problem, impl, sliding_window=window)[0])


@pytest.mark.parametrize("impl,q_dtype", [("xla", "float32"), ("pallas", "bfloat16")])
def test_fp8_cache_with_every_option(rng, impl, q_dtype):
    problem = make_ragged(rng, [(6, 21), (1, 3), (0, 2), (3, 9)], num_heads=4, num_kv_heads=2,
                          block_size=4, dtype="float8_e4m3fn", q_dtype=q_dtype)
    assert_matches(problem, impl, "float8_e4m3fn", k_scale=0.25, v_scale=0.75,
                   **options(rng, 4, "all"))
    out = pp.paged_attention(*[jnp.asarray(a) for a in problem.arrays()], impl=impl,
                             k_scale=0.25, v_scale=0.75)
    assert out.dtype == jnp.dtype(q_dtype)


@pytest.mark.parametrize("config", [
    pp.AttentionConfig(block_q=4, short_block_q=1, block_k=16, num_splits=2, fp8_pairs=True),
    pp.AttentionConfig(block_q=8, block_k=16, fp8_pairs=True)], ids=["split_short", "one_split"])
@pytest.mark.parametrize("head_dim", [32, 40, 33])
def test_fp8_column_pairs_with_every_option(rng, config, head_dim):
    """`AttentionConfig.fp8_pairs`: K and V read as u16 words of two head columns, the dots split
    into the even and the odd columns; head_dim 40 pads to 64 columns (32 words, 20 of the
    head's), and an odd head_dim has no pairs (no effect). Every slot that is not a valid token
    holds NaN (`make_paged`): none reaches the output, as without the pairs."""
    problem = make_ragged(rng, [(6, 21), (1, 3), (0, 2), (3, 9)], num_heads=4, num_kv_heads=2,
                          head_dim=head_dim, block_size=4, dtype="float8_e4m3fn",
                          q_dtype="bfloat16")
    assert_matches(problem, "pallas", "float8_e4m3fn", config=config, k_scale=0.25,
                   v_scale=0.75, **options(rng, 4, "all"))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_scales_as_arrays_one_program_for_every_scale(rng, impl):
    """Scalar f32 array scales equal the same python floats, in torch_ref and in JAX, and a jitted
    step compiles once for three different pairs of scales."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, num_heads=4, num_kv_heads=2,
                          block_size=4, dtype="float8_e4m3fn", q_dtype="bfloat16")
    arrays = [jnp.asarray(a) for a in problem.arrays()]
    traces = []

    @jax.jit
    def step(k_scale, v_scale, *arrays):
        traces.append(1)
        return pp.paged_attention(*arrays, impl=impl, k_scale=k_scale, v_scale=v_scale)

    for k_scale, v_scale in ((0.25, 0.75), (0.5, 2.0), (1.5, 0.125)):
        got = step(jnp.float32(k_scale), jnp.float32(v_scale), *arrays)
        want = pp.paged_attention(*arrays, impl=impl, k_scale=k_scale, v_scale=v_scale)
        np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
        tensors = [to_torch(a) for a in problem.arrays()]
        ref = torch_ref.paged_attention(*tensors, k_scale=torch.tensor(k_scale),
                                        v_scale=torch.tensor([v_scale]))
        np.testing.assert_array_equal(to_numpy(ref), to_numpy(torch_ref.paged_attention(
            *tensors, k_scale=k_scale, v_scale=v_scale)))
        np.testing.assert_allclose(to_numpy(got).astype(np.float32),
                                   to_numpy(ref).astype(np.float32), atol=ATOL["bfloat16"])
    assert len(traces) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_huge_windows_and_tables_of_width_zero(rng, impl):
    """A window of 2**31 or more is no window (as in torch_ref); a [B, 0] table gives zeros."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, block_size=4)
    plain, _ = run_jax(problem, impl)
    for window in (2**31, 2**40):
        np.testing.assert_array_equal(run_jax(problem, impl, sliding_window=window)[0], plain)
        expected, _ = run_torch(problem, sliding_window=window)
        np.testing.assert_allclose(plain, expected, atol=ATOL["float32"])
    empty = dataclasses.replace(problem, block_tables=np.zeros((2, 0), np.int32),
                                context_lens=np.zeros(2, np.int32),
                                query_start_loc=np.zeros(3, np.int32))
    out, lse = run_jax(empty, impl)
    expected, expected_lse = run_torch(empty)
    assert not out.any() and not expected.any()
    assert np.isneginf(lse).all() and np.isneginf(expected_lse).all()


# --- SPEC invariants I8-I10 --------------------------------------------------------------------

def _slots(problem, b, positions):
    block_size = problem.k_cache.shape[1]
    return [(problem.block_tables[b, j // block_size], j % block_size) for j in positions]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_options", [False, True])
def test_i8_later_positions_are_never_seen(rng, impl, with_options):
    """Poisoning every position from ``cut`` on (NaN) leaves the rows of queries before ``cut``
    bit for bit unchanged."""
    seqs = [(12, 30), (7, 7), (5, 22)]
    problem = make_ragged(rng, seqs, num_heads=4, num_kv_heads=2, block_size=4)
    extra = options(rng, 4, "all") if with_options else {}
    config = pp.AttentionConfig(block_q=8, block_k=16, num_splits=2) if impl == "pallas" else None
    clean, _ = run_jax(problem, impl, config, **extra)
    k_cache, v_cache = problem.k_cache.copy(), problem.v_cache.copy()
    kept = []
    for b, (q_len, n) in enumerate(seqs):
        first = int(problem.query_start_loc[b])
        cut = n - q_len + q_len // 2  # queries at positions < cut keep their rows
        for block, offset in _slots(problem, b, range(cut, n)):
            k_cache[block, offset] = np.nan
            v_cache[block, offset] = np.nan
        kept += [first + i for i in range(q_len) if n - q_len + i < cut]
    poisoned = dataclasses.replace(problem, k_cache=k_cache, v_cache=v_cache)
    out, _ = run_jax(poisoned, impl, config, **extra)
    np.testing.assert_array_equal(out[kept], clean[kept])


@pytest.mark.parametrize("impl", IMPLS)
def test_i9_padding_rows_are_zeros_and_disturb_nothing(rng, impl):
    problem = make_ragged(rng, [(5, 12), (1, 3), (3, 9)], pad=6, block_size=4)
    config = (pp.AttentionConfig(block_q=4, short_block_q=2, block_k=16) if impl == "pallas"
              else None)
    out, lse = assert_matches(problem, impl, "float32", config)
    assert (out[-6:] == 0).all() and np.isneginf(lse[-6:]).all()
    problem.q[-6:] = np.nan  # padding rows may hold anything
    poisoned, poisoned_lse = run_jax(problem, impl, config)
    np.testing.assert_array_equal(poisoned, out)
    np.testing.assert_array_equal(poisoned_lse, lse)


def dense_causal(q, k, v, scale):
    """float64 causal attention of one sequence over dense K/V: q ``[q_len, H, D]`` are the last
    ``q_len`` positions of k, v ``[n, KVH, D]``."""
    q_len, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    k = np.repeat(k, num_heads // num_kv_heads, axis=1)  # repeat_interleave
    v = np.repeat(v, num_heads // num_kv_heads, axis=1)
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    future = np.arange(n)[None, :] > (n - q_len + np.arange(q_len))[:, None]  # [q_len, n]
    s = np.where(future[None], -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hij,jhd->ihd", w / w.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("impl", IMPLS)
def test_i10_each_sequence_is_dense_causal_attention(rng, impl):
    seqs = [(6, 6), (1, 13), (9, 25), (0, 4), (4, 10)]
    problem = make_ragged(rng, seqs, num_heads=4, num_kv_heads=2, block_size=4, spare_blocks=8)
    config = pp.AttentionConfig(block_q=4, block_k=16, num_splits=2) if impl == "pallas" else None
    out, _ = run_jax(problem, impl, config)
    block_size = problem.k_cache.shape[1]
    for b, (q_len, n) in enumerate(seqs):
        if q_len == 0:
            continue
        rows = [problem.block_tables[b, j // block_size] * block_size + j % block_size
                for j in range(n)]
        flat = (c.reshape(-1, *c.shape[2:]) for c in (problem.k_cache, problem.v_cache))
        k, v = (c[rows].astype(np.float64) for c in flat)
        first = problem.query_start_loc[b]
        q = problem.q[first:first + q_len].astype(np.float64)
        np.testing.assert_allclose(out[first:first + q_len], dense_causal(q, k, v, 32 ** -0.5),
                                   atol=5e-6, rtol=0)
        # The same sequence alone (the others get no new tokens, its rows come first, the
        # rest is padding): the mix of q lengths changes nothing.
        q_lens = np.zeros(len(seqs), np.int32)
        q_lens[b] = q_len
        rows = np.r_[first:first + q_len, 0:first, first + q_len:len(problem.q)]
        alone = dataclasses.replace(problem, q=problem.q[rows],
                                    query_start_loc=np.r_[0, np.cumsum(q_lens)].astype(np.int32))
        np.testing.assert_allclose(run_jax(alone, impl, config)[0][:q_len],
                                   out[first:first + q_len], atol=1e-6, rtol=0)


# --- decode is the one-token case ----------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["none", "every_option", "fp8"])
def test_decode_equals_one_token_per_sequence(rng, impl, which):
    """Every option at once (soft-cap, ALiBi, window, sinks, lse), and with an fp8 cache."""
    dtype = "float8_e4m3fn" if which == "fp8" else "float32"
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
    want, want_lse = pp.decode(*args, impl=impl, return_lse=True, **_jax(extra))
    got, got_lse = pp.paged_attention(*args, qsl, impl=impl, return_lse=True, **_jax(extra))
    atol = 1e-6 if dtype == "float32" else ATOL["bfloat16"] / 4
    np.testing.assert_allclose(to_numpy(got).astype(np.float32),
                               to_numpy(want).astype(np.float32), atol=atol, rtol=0)
    np.testing.assert_allclose(to_numpy(got_lse), to_numpy(want_lse), atol=1e-5, rtol=1e-6)
    ref = torch_ref.paged_attention(*paged.torch(), torch.arange(len(paged.context_lens) + 1),
                                    **_torch(extra))
    ref_decode = torch_ref.paged_decode_attention(*paged.torch(), **_torch(extra))
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


# --- under jit, and edge cases --------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_more_queries_than_context_under_jit_see_nothing(rng, impl):
    """Unchecked under jit: queries at negative positions give zeros; the others are as if the
    sequence had only its last ``n`` queries."""
    problem = make_ragged(rng, [(3, 5), (2, 8)], block_size=4)
    lens = np.array([5, 1], np.int32)  # sequence 1: 2 new tokens but n = 1
    out, lse = run_jax(dataclasses.replace(problem, context_lens=lens), impl)
    assert (out[3] == 0).all() and np.isneginf(lse[3]).all()
    # Sequence 1 with only its last query (position 0): the same row.
    fixed = dataclasses.replace(problem, q=problem.q[[0, 1, 2, 4, 3]], context_lens=lens,
                                query_start_loc=np.array([0, 3, 4], np.int32))
    np.testing.assert_allclose(out[4], run_jax(fixed, impl)[0][3], atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_malformed_query_start_loc_under_jit_is_sanitized(rng, impl):
    """Unchecked under jit: query_start_loc is clamped into [0, num_tokens], made non-decreasing
    and starts at 0 (every row has one owner, none is left unwritten), as documented."""
    problem = make_ragged(rng, [(3, 9), (2, 8), (1, 4)], pad=2, block_size=4)
    bad = np.array([2, 5, 3, 99], np.int32)  # first entry 2, decreasing, past num_tokens (8)
    sane = np.array([0, 5, 5, 8], np.int32)  # what the jit rule makes of it
    out, lse = run_jax(dataclasses.replace(problem, query_start_loc=bad), impl)
    want, want_lse = run_jax(dataclasses.replace(problem, query_start_loc=sane), impl)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_all_rows_padding_and_empty_inputs(rng, impl):
    problem = make_ragged(rng, [(0, 3), (0, 0)], pad=4, block_size=4)
    out, lse = run_jax(problem, impl)
    assert (out == 0).all() and np.isneginf(lse).all()
    empty = dataclasses.replace(problem, q=problem.q[:0])
    out, lse = run_jax(empty, impl)
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)
    no_batch = Ragged(problem.q, problem.k_cache, problem.v_cache, problem.block_tables[:0],
                      problem.context_lens[:0], np.zeros(1, np.int32))
    out, lse = run_jax(no_batch, impl)
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_indices_and_user_jit(rng, impl):
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, block_size=4)
    wide = dataclasses.replace(problem, block_tables=problem.block_tables.astype(np.int64),
                               context_lens=problem.context_lens.astype(np.int64),
                               query_start_loc=problem.query_start_loc.astype(np.int64))
    expected, _ = run_jax(problem, impl)
    np.testing.assert_array_equal(run_jax(wide, impl)[0], expected)

    @jax.jit
    def step(*arrays):
        return pp.paged_attention(*arrays, impl=impl) * 2

    out = step(*[jnp.asarray(a) for a in problem.arrays()])
    np.testing.assert_allclose(to_numpy(out), 2 * expected, atol=1e-6)


# --- errors: the same ValueError in torch_ref and pallas_paged -----------------------------------

def _error_cases():
    """name -> (overrides of the valid problem of `_error_problem`, message pattern)."""
    def qsl(*values):
        return np.array(values, np.int32)

    def lens(*values):
        return np.array(values, np.int32)

    return {
        "qsl_first_not_zero": (dict(query_start_loc=qsl(1, 4, 5)),
                               r"query_start_loc\[0\]=1 must be 0"),
        "qsl_decreasing": (dict(query_start_loc=qsl(0, 4, 3)),
                           r"query_start_loc must be non-decreasing"),
        "qsl_past_num_tokens": (dict(query_start_loc=qsl(0, 4, 9)),
                                r"query_start_loc\[2\]=9 exceeds num_tokens"),
        "q_len_over_context": (dict(context_lens=lens(3, 4)),
                               r"q_len of sequence 0 .* exceeds context_lens\[0\]=3"),
        "qsl_wrong_length": (dict(query_start_loc=qsl(0, 4)),
                             r"query_start_loc.shape=\(2,\) must be \[batch \+ 1\]"),
        "qsl_float": (dict(query_start_loc=np.array([0.0, 4, 5], np.float32)),
                      r"query_start_loc must be int32"),
        "qsl_rank": (dict(query_start_loc=qsl(0, 4, 5)[None]),
                     r"query_start_loc must have rank 1"),
        "negative_length": (dict(context_lens=lens(-1, 4), query_start_loc=qsl(0, 0, 1)),
                            r"context_lens\[0\]=-1 must be >= 0"),
        "too_long": (dict(context_lens=lens(99, 4)),
                     r"context_lens\[0\]=99 exceeds the table's capacity"),
        "bad_block_id": (dict(block_tables=np.array([[0, 1, 2], [500, 4, 5]], np.int32)),
                         r"block_tables\[1, 0\]=500 is outside"),
        "head_dim": (dict(q=np.zeros((6, 4, 16), np.float32)), r"head_dim mismatch"),
        "gqa": (dict(q=np.zeros((6, 3, 32), np.float32)),
                r"num_heads must be a multiple of num_kv_heads"),
        "batch": (dict(context_lens=lens(8)), r"context_lens.shape=\(1,\) must be \[batch\]"),
    }


ERRORS = _error_cases()


def _error_problem(rng):
    """A valid problem: 2 sequences, (q_len, n) = (4, 8) and (1, 4), tables of 3 blocks of 4."""
    return make_ragged(rng, [(4, 8), (1, 4)], pad=1, block_size=4, max_blocks=3)


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_torch_ref_and_eager_validation(rng, case):
    overrides, pattern = ERRORS[case]
    arrays = _error_problem(rng).arrays(**overrides)
    with pytest.raises(ValueError, match=pattern):
        torch_ref.paged_attention(*[to_torch(a) for a in arrays])
    with pytest.raises(ValueError, match=pattern):
        pp.validate_attention_inputs(*[jnp.asarray(a) for a in arrays])


@pytest.mark.parametrize("case", ["qsl_wrong_length", "qsl_float", "qsl_rank", "head_dim", "gqa",
                                  "batch"])
def test_static_errors_at_trace_time(rng, case):
    overrides, pattern = ERRORS[case]
    arrays = _error_problem(rng).arrays(**overrides)
    for impl in IMPLS:
        with pytest.raises(ValueError, match=pattern):
            pp.paged_attention(*[jnp.asarray(a) for a in arrays], impl=impl)


def test_option_and_config_errors(rng):
    arrays = [jnp.asarray(a) for a in _error_problem(rng).arrays()]
    with pytest.raises(ValueError, match=r"sliding_window=0 must be >= 1"):
        pp.paged_attention(*arrays, sliding_window=0)
    with pytest.raises(ValueError, match=r"impl='cuda' must be one of"):
        pp.paged_attention(*arrays, impl="cuda")
    with pytest.raises(ValueError, match=r"config must be an AttentionConfig"):
        pp.paged_attention(*arrays, config=pp.DecodeConfig())
    with pytest.raises(ValueError, match=r"k_scale is required"):
        pp.paged_attention(arrays[0], arrays[1].astype(jnp.float8_e4m3fn),
                           arrays[2].astype(jnp.float8_e4m3fn), *arrays[3:])
    for bad in (dict(block_q=3), dict(block_k=8), dict(num_splits=0), dict(num_warps=3),
                dict(block_q=4, short_block_q=4), dict(block_q=8, short_block_q=3),
                dict(short_block_q=-1), dict(short_block_q=True), dict(fp8_pairs=1)):
        with pytest.raises(ValueError, match="AttentionConfig"):
            pp.AttentionConfig(**bad)
    with pytest.raises(ValueError, match=r"query_start_loc\[0\]=2 must be 0"):
        torch_ref.paged_attention(*[to_torch(np.asarray(a)) for a in arrays[:5]],
                                  torch.tensor([2, 4, 5]))


# --- the kernel runs --------------------------------------------------------------------------

def _jaxpr_text(impl):
    q = jax.ShapeDtypeStruct((40, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((3, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    qsl = jax.ShapeDtypeStruct((4,), jnp.int32)
    fn = functools.partial(pp.paged_attention, impl=impl, interpret=False)
    return str(jax.make_jaxpr(fn)(q, cache, cache, tables, lens, qsl))


def test_pallas_impl_is_the_named_kernel():
    assert "pallas_paged_ragged" in _jaxpr_text("pallas")
    assert "pallas_call" not in _jaxpr_text("xla")


def test_heuristic_configs():
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
    problem = make_ragged(rng, MIX, pad=3, num_heads=8, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype="bfloat16")
    args = [jnp.asarray(a) for a in problem.arrays()]
    text = jax.jit(functools.partial(pp.paged_attention, impl="pallas")).lower(*args).compile()
    assert "pallas_paged_ragged" in text.as_text()
    for config in (None, *CONFIGS):
        assert_matches(problem, "pallas", "bfloat16", config=config)


def test_benchmark_smoke_runs(capsys):
    """``python -m benchmarks.bench_ragged --smoke`` (its decode shape, in this process): the
    plumbing end to end, ceilings, checked and timed rows, the decode comparison, exit status 0."""
    from benchmarks import bench_ragged
    status = bench_ragged.main(["--smoke", "--shapes", "smoke_decode_b4_ctx40"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "| smoke_decode_b4_ctx40 | default:" in printed
    assert "paged_attention / decode time" in printed


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
                               config=pp.AttentionConfig(num_splits=1), **scales)
        gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=gpu)):
            return jax.jit(fn).trace(q, cache, cache, tables, lens, starts).lower(
                lowering_platforms=("cuda",)).as_text()

    fp8 = lowered(jnp.float8_e4m3fn, k_scale=0.5, v_scale=0.25)
    assert "pallas_paged_ragged" in fp8
    assert launched_ops(fp8) == launched_ops(lowered(jnp.bfloat16))


@pytest.mark.parametrize("config", (None,) + CONFIGS, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_a_nan_query_propagates_as_in_torch_ref(rng, impl, config):
    """A NaN query token head gives a NaN output row and lse, as torch_ref's softmax does, and
    changes no other row (one split, and the merge of several)."""
    if impl == "xla" and config is not None:
        pytest.skip("the XLA path has no config")
    problem = make_ragged(rng, [(3, 40), (1, 9), (5, 70)], pad=1, num_heads=8, num_kv_heads=2,
                          head_dim=32, block_size=16, dtype="float32")
    problem.q[4, 2] = np.nan  # the second sequence's only query token, head 2
    out, lse = run_jax(problem, impl, config)
    expected, expected_lse = run_torch(problem)
    assert np.isnan(out[4, 2]).all() and np.isnan(lse[4, 2])
    assert_close_with_the_same_nans(out, expected, ATOL["float32"])
    assert_close_with_the_same_nans(lse, expected_lse, 1e-5)

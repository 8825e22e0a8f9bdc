"""`paged_attention(..., impl="mosaic")`, the Mosaic GPU ragged kernel, against the float64 oracle
within the tolerance rule: mixed batches, every config shape (one or two consumers, ping-pong,
odd groups), every option, page sizes, head dims, the fused cache, the SPEC invariants I8-I9;
its work list and lse gather (plain XLA, every jax); its refusals; its lowering for CUDA with the
shared memory its model says; ``impl="auto"``'s choice.

On a CPU the kernel runs in Mosaic GPU's interpret mode, so the shapes are small; on a GPU the
same tests run the compiled kernel, and the ``gpu`` tests add realistic shapes. jax < 0.11.2 has
no ``plgpu.kernel`` of this API: the kernel's tests are skipped there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
from paged_inputs import assert_close, bits, jax_options, make_ragged, reference, to_numpy
from pallas_paged import _mosaic_common
from pallas_paged.ragged_attention import api, mosaic_gpu
from pallas_paged.ragged_attention.mosaic_gpu_config import MosaicAttentionConfig as M
from pallas_paged.ragged_attention.shape import shape_class
from parity.tolerance import ATOL

KERNEL_API = _mosaic_common.jax_version() >= _mosaic_common.MIN_JAX
needs_kernel_api = pytest.mark.skipif(
    not KERNEL_API, reason=f"impl='mosaic' needs jax >= 0.11.2 (plgpu.kernel); this is jax"
    f" {jax.__version__}")
# On a CPU the kernel runs in Mosaic GPU's interpreter, which needs jax >= 0.12 for this kernel.
RUNS_HERE = KERNEL_API and (jax.default_backend() == "gpu" or _mosaic_common.jax_version()
                            >= mosaic_gpu.MIN_JAX_INTERPRET)
needs_kernel = pytest.mark.skipif(
    not RUNS_HERE, reason=f"the ragged Mosaic kernel runs compiled (jax >= 0.11.2, a Hopper GPU)"
    f" or interpreted (jax >= 0.12); this is jax {jax.__version__} on {jax.default_backend()}")
SLOW = pytest.mark.slow
ONE_CONSUMER = M(block_kv=64, num_stages=3, num_consumers=1, ping_pong=False)
TWO_PLAIN = M(block_kv=64, num_stages=2, num_consumers=2, ping_pong=False)
PING_PONG = M(block_kv=128, num_stages=2, num_consumers=2, ping_pong=True)
# (q_len, context_len): a decode, an empty sequence, a 70-token chunk over longer context (two
# 64-token tiles), a whole prompt, a speculation, a chunk that ends a tile exactly.
MIX = [(1, 9), (0, 5), (70, 100), (13, 13), (3, 40), (64, 80)]


def attend(problem, config=None, **options):
    """``(out, lse)`` of the Mosaic kernel on ``problem``."""
    return pp.paged_attention(*problem.jax(), impl="mosaic", config=config, return_lse=True,
                              **jax_options(options))


def check(problem, config=None, **options):
    """The kernel against the float64 truth within the tolerance rule: ``(out, lse)`` numpy."""
    ref = reference(*problem.arrays()[:5], query_start_loc=problem.query_start_loc, **options)
    out, lse = attend(problem, config, **options)
    assert_close(ref, out, lse, what=f"mosaic {config}")
    return to_numpy(out), to_numpy(lse)


def every_option(rng, num_heads):
    return dict(logits_soft_cap=3.0,
                alibi_slopes=(2.0 ** -np.arange(1, num_heads + 1)).astype(np.float32),
                sliding_window=37, sinks=rng.standard_normal(num_heads).astype(np.float32))


# --- against the truth ---------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("dtype,config,heads", [
    ("bfloat16", None, (4, 2)),
    pytest.param("float16", PING_PONG, (8, 2), marks=SLOW),
    pytest.param("bfloat16", ONE_CONSUMER, (4, 2), marks=SLOW),
    pytest.param("bfloat16", TWO_PLAIN, (3, 1), marks=SLOW),   # group 3: two token halves
    pytest.param("bfloat16", PING_PONG, (2, 2), marks=SLOW),   # MHA: two token halves
    pytest.param("float16", TWO_PLAIN, (6, 2), marks=SLOW),
])
def test_mixed_batch_matches_the_truth(rng, dtype, config, heads):
    """Decodes, chunks, a prompt and padding rows in one batch, every config shape."""
    num_heads, kvh = heads
    problem = make_ragged(rng, MIX, pad=3, num_heads=num_heads, num_kv_heads=kvh, head_dim=64,
                          block_size=16, dtype=dtype)
    check(problem, config)


@needs_kernel
@pytest.mark.parametrize("which", [
    "all", pytest.param("logits_soft_cap", marks=SLOW), pytest.param("alibi_slopes", marks=SLOW),
    pytest.param("sliding_window", marks=SLOW), pytest.param("sinks", marks=SLOW)])
def test_options_match_the_truth(rng, which):
    every = every_option(rng, 4)
    options = every if which == "all" else {which: every[which]}
    problem = make_ragged(rng, [(40, 90), (2, 2), (0, 3), (9, 50)], pad=2, num_heads=4,
                          num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    check(problem, **options)


@needs_kernel
@pytest.mark.parametrize("config,heads,cache", [
    (M(block_kv=64, num_stages=2, pack_heads=2), (8, 2), "bfloat16"),  # a pack per consumer
    pytest.param(M(block_kv=64, num_stages=3, num_consumers=1, ping_pong=False, pack_heads=4),
                 (8, 2), "bfloat16", marks=SLOW),                      # the whole group
    pytest.param(M(block_kv=64, pack_heads=2), (4, 2), "bfloat16",
                 marks=SLOW),                                          # two token halves
    pytest.param(M(block_kv=64, pack_heads=8, persistent=True), (16, 1), "float8_e4m3fn",
                 marks=SLOW),
])
def test_packed_heads_match_the_truth_and_the_unpacked_bits(rng, config, heads, cache):
    """``pack_heads``: a consumer's rows hold several heads' tokens, each row still its own
    softmax: against the truth with every option, and ``pack_heads=1`` within a rounding (the
    same operations per row, but a sink or slope per row rather than per tile contracts into
    fused multiply-adds elsewhere: the last bit of an fp32 value may differ)."""
    num_heads, kvh = heads
    problem = make_ragged(rng, [(4, 40), (1, 9), (0, 5), (19, 70), (3, 3)], pad=2,
                          num_heads=num_heads, num_kv_heads=kvh, head_dim=64, block_size=16,
                          dtype=cache, q_dtype="bfloat16")
    scales = dict(k_scale=0.5, v_scale=2.0) if cache == "float8_e4m3fn" else {}
    every = every_option(rng, num_heads)
    out, lse = check(problem, config, **scales, **every)
    want, want_lse = attend(problem, dataclasses.replace(config, pack_heads=1), **scales,
                            **every)
    np.testing.assert_allclose(out.astype(np.float32), to_numpy(want).astype(np.float32),
                               rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(lse, to_numpy(want_lse), rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("config,heads", [
    (M(block_kv=64, num_stages=3, num_consumers=2, ping_pong=False, overlap_softmax=True),
     (4, 2)),
    pytest.param(M(block_kv=64, num_stages=3, num_consumers=1, ping_pong=False,
                   overlap_softmax=True, persistent=True), (4, 2), marks=SLOW),
    pytest.param(M(block_kv=64, num_stages=4, num_consumers=2, ping_pong=False,
                   overlap_softmax=True, persistent=True, pack_heads=2), (8, 2), marks=SLOW),
])
def test_overlapped_softmax_matches_the_truth_and_the_plain_bits(rng, config, heads):
    """``overlap_softmax`` reorders when each tile's products are issued and waited for, not
    what is computed: against the truth with every option, and the same config without it: the
    same bits, or with packed heads (a slope and sink per row, which a multiply-add may contract
    differently in other code) within a rounding."""
    num_heads, kvh = heads
    problem = make_ragged(rng, MIX, pad=3, num_heads=num_heads, num_kv_heads=kvh, head_dim=64,
                          block_size=16, dtype="bfloat16")
    every = every_option(rng, num_heads)
    out, lse = check(problem, config, **every)
    want, want_lse = attend(problem, dataclasses.replace(config, overlap_softmax=False),
                            **every)
    if config.pack_heads == 1:
        np.testing.assert_array_equal(out.view(np.uint16), to_numpy(want).view(np.uint16))
        np.testing.assert_array_equal(lse, to_numpy(want_lse))
    else:
        np.testing.assert_allclose(out.astype(np.float32), to_numpy(want).astype(np.float32),
                                   rtol=2 ** -7, atol=2 ** -7)
        np.testing.assert_allclose(lse, to_numpy(want_lse), rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("block_size,config", [
    pytest.param(16, ONE_CONSUMER, marks=SLOW),
    pytest.param(8, PING_PONG, marks=SLOW),
    pytest.param(32, TWO_PLAIN, marks=SLOW),
    pytest.param(128, TWO_PLAIN, marks=SLOW),  # a page larger than a tile: one slice of it
    pytest.param(256, PING_PONG, marks=SLOW),
])
def test_page_sizes(rng, block_size, config):
    problem = make_ragged(rng, [(20, 150), (5, 30)], pad=1, num_heads=4, num_kv_heads=2,
                          head_dim=64, block_size=block_size, dtype="bfloat16")
    check(problem, config)


@needs_kernel
@pytest.mark.parametrize("head_dim", [pytest.param(128, marks=SLOW), pytest.param(192, marks=SLOW),
                                      256])
def test_head_dims(rng, head_dim):
    """128 and 192 in one staging part of the query and output, 256 in two of 128 columns
    (`staging_columns`): against the truth."""
    problem = make_ragged(rng, [(9, 30), (1, 7)], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                          block_size=16, dtype="bfloat16")
    check(problem)


@needs_kernel
@SLOW
def test_fused_cache_gives_the_same_bits(rng):
    """`paged_attention_fused` reads the interleaved rows in place: the same bits as the pair."""
    problem = make_ragged(rng, [(20, 40), (1, 9)], pad=1, num_heads=4, num_kv_heads=2,
                          head_dim=64, block_size=16, dtype="bfloat16")
    q, k, v, tables, lens, qsl = problem.jax()
    kv = jnp.stack([k, v], axis=3).reshape(*k.shape[:2], -1, k.shape[3])
    out, lse = attend(problem)
    fused, fused_lse = pp.paged_attention_fused(q, kv, tables, lens, qsl, impl="mosaic",
                                                return_lse=True)
    np.testing.assert_array_equal(bits(fused), bits(out))
    np.testing.assert_array_equal(bits(fused_lse), bits(lse))


@needs_kernel
@pytest.mark.parametrize("with_options", [pytest.param(False, marks=SLOW), True])
def test_i8_later_positions_are_never_seen(rng, with_options):
    """Poisoning every position from ``cut`` on (NaN in K and V) leaves the rows of queries
    before ``cut`` bit for bit unchanged, masked tiles and the V fix included."""
    seqs = [(70, 90), (7, 7), (5, 22)]
    problem = make_ragged(rng, seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                          dtype="bfloat16")
    extra = every_option(rng, 4) if with_options else {}
    clean, _ = attend(problem, **extra)
    k_cache, v_cache = problem.k_cache.copy(), problem.v_cache.copy()
    kept = []
    for b, (q_len, n) in enumerate(seqs):
        first = int(problem.query_start_loc[b])
        cut = n - q_len + q_len // 2
        for j in range(cut, n):
            block = problem.block_tables[b, j // 16]
            k_cache[block, j % 16] = np.nan
            v_cache[block, j % 16] = np.nan
        kept += [first + i for i in range(q_len) if n - q_len + i < cut]
    out, _ = attend(problem.replace(k_cache=k_cache, v_cache=v_cache), **extra)
    np.testing.assert_array_equal(bits(out)[kept], bits(clean)[kept])


@needs_kernel
@SLOW
def test_i9_padding_rows_are_zeros_and_disturb_nothing(rng):
    problem = make_ragged(rng, [(5, 12), (1, 3), (3, 9)], pad=70, num_heads=4, num_kv_heads=2,
                          head_dim=64, block_size=16, dtype="bfloat16")
    out, lse = check(problem)
    assert (out[-70:] == 0).all() and np.isneginf(lse[-70:]).all()
    problem.q[-70:] = np.nan
    poisoned, poisoned_lse = attend(problem)
    np.testing.assert_array_equal(bits(poisoned), bits(out))
    np.testing.assert_array_equal(bits(poisoned_lse), bits(lse))


# --- the work list and the lse gather (plain XLA) ------------------------------------------------

@pytest.mark.parametrize("group,consumers,pack", [(4, 2, 1), (3, 2, 1), (4, 1, 1), (1, 2, 1),
                                                 (4, 2, 4), (8, 2, 2), (8, 1, 8), (2, 2, 2)])
def test_work_list_covers_every_row_once_longest_first(group, consumers, pack):
    """Every token (padding included) lies in exactly one listed tile; tiles are listed by the
    K/V positions they attend, most first; `gather_lse` finds each token's row (with
    ``pack`` heads per consumer tile, one after the other)."""
    q_lens = [1, 0, 70, 130, 13, 3]
    lens = [9, 5, 100, 400, 13, 40]
    num_tokens = sum(q_lens) + 5
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tokens = mosaic_gpu.tokens_per_cta(group, consumers, pack)
    programs = mosaic_gpu.num_work_tiles(num_tokens, len(q_lens), tokens)
    work = np.asarray(mosaic_gpu.work_list(starts, jnp.asarray(lens, jnp.int32),
                                           num_tokens=num_tokens, tokens=tokens,
                                           num_tiles=programs, window=None))
    ends = list(np.asarray(starts[1:])) + [num_tokens]
    covered = np.zeros(num_tokens, int)
    attended = []
    for b, tile in work.T:
        if b > len(q_lens):
            continue
        lo = int(starts[b]) + tile * tokens
        hi = min(lo + tokens, ends[b])
        assert lo < hi
        covered[lo:hi] += 1
        n = lens[b] if b < len(q_lens) else 0
        q_len = ends[b] - int(starts[b])
        attended.append(max(n - q_len + (hi - int(starts[b])), 0))
    assert (covered == 1).all()
    assert attended == sorted(attended, reverse=True)
    # each consumer's lse row holds its tokens: token t, head h -> t * 1000 + h
    packs = mosaic_gpu.packs_per_cta(group, consumers, pack)
    head_blocks = group // (packs * pack)
    head_tokens = 64 // pack
    kvh, num_heads = 2, 2 * group
    ctas = programs * kvh * head_blocks
    padded = max(num_tokens, 64)
    tiles = np.full((ctas, consumers, 64), np.nan, np.float32)
    for rank, (b, tile) in enumerate(work.T):
        if b > len(q_lens):
            continue
        for h in range(kvh):
            for hb in range(head_blocks):
                for c in range(consumers):
                    sub = c // packs
                    head0 = h * group + (hb * packs + c % packs) * pack
                    t0 = int(starts[b]) + tile * tokens + sub * head_tokens
                    t0_load = min(max(t0, 0), padded - head_tokens)
                    for row in range(64):
                        k, t = row // head_tokens, t0_load + row % head_tokens
                        if t0 <= t < min(t0 + head_tokens, ends[b]):
                            tiles[(rank * kvh + h) * head_blocks + hb, c, row] = (
                                t * 1000 + head0 + k)
    lse = mosaic_gpu.gather_lse(jnp.asarray(tiles), jnp.asarray(work), starts,
                                num_tokens=num_tokens, num_heads=num_heads, group=group,
                                num_consumers=consumers, pack=pack, padded_tokens=padded)
    want = np.arange(num_tokens)[:, None] * 1000 + np.arange(num_heads)[None, :]
    np.testing.assert_array_equal(np.asarray(lse), want)


@needs_kernel
@pytest.mark.parametrize("q_dtype,config,heads,head_dim", [
    ("bfloat16", PING_PONG, (4, 2), 64),       # the first consumer converts for both
    pytest.param("float16", ONE_CONSUMER, (4, 2), 64, marks=SLOW),
    pytest.param("bfloat16", TWO_PLAIN, (3, 1), 64, marks=SLOW),   # two token halves
    pytest.param("bfloat16", None, (4, 2), 192, marks=SLOW),
])
def test_fp8_cache_with_every_option(rng, q_dtype, config, heads, head_dim):
    """An fp8 cache: its tiles converted to the query's dtype in the kernel (exact), k_scale in
    the scores and v_scale in the sum, every option, NaN in every slot that holds no token:
    the truth; the output has q's dtype."""
    num_heads, kvh = heads
    problem = make_ragged(rng, MIX, pad=2, num_heads=num_heads, num_kv_heads=kvh,
                          head_dim=head_dim, block_size=16, dtype="float8_e4m3fn",
                          q_dtype=q_dtype)
    out, _ = check(problem, config, k_scale=0.25, v_scale=0.75, **every_option(rng, num_heads))
    assert out.dtype == jnp.dtype(q_dtype)


@needs_kernel
def test_fp8_scales_as_arrays_one_program_for_every_scale(rng):
    """Traced f32 scales equal the same python floats bit for bit, and a jitted step compiles
    once for two pairs of scales (they are kernel operands)."""
    problem = make_ragged(rng, [(3, 10), (1, 4)], pad=1, num_heads=4, num_kv_heads=2,
                          head_dim=64, block_size=16, dtype="float8_e4m3fn", q_dtype="bfloat16")
    arrays = problem.jax()
    traces = []

    @jax.jit
    def step(k_scale, v_scale, *arrays):
        traces.append(1)
        return pp.paged_attention(*arrays, impl="mosaic", k_scale=k_scale, v_scale=v_scale)

    for k_scale, v_scale in ((0.25, 0.75), (1.5, 0.125)):
        got = step(jnp.float32(k_scale), jnp.float32(v_scale), *arrays)
        want = pp.paged_attention(*arrays, impl="mosaic", k_scale=k_scale, v_scale=v_scale)
        np.testing.assert_array_equal(bits(got), bits(want))
    assert len(traces) == 1


DECODE_ROWS = M(block_kv=64, num_stages=2, num_consumers=2, ping_pong=True, decode_rows=True)


@needs_kernel
@pytest.mark.parametrize("cache,options", [
    ("bfloat16", "all"),
    pytest.param("float8_e4m3fn", "all", marks=SLOW),
    pytest.param("bfloat16", "fused", marks=SLOW),
])
def test_decode_rows_through_the_decode_kernel(rng, cache, options):
    """`MosaicAttentionConfig.decode_rows`: the one-token sequences of a mixed batch (MIX has
    two: a decode and, at the end, none) computed by the Mosaic decode kernel, the others by the
    ragged kernel, every row and lse against the truth with every option (and an fp8 cache, and
    the fused cache: the same bits as the pair)."""
    seqs = MIX + [(1, 50)]
    problem = make_ragged(rng, seqs, pad=2, num_heads=4, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype=cache, q_dtype="bfloat16")
    scales = dict(k_scale=0.25, v_scale=0.75) if cache == "float8_e4m3fn" else {}
    every = every_option(rng, 4)
    out, lse = check(problem, DECODE_ROWS, **scales, **every)
    if options == "fused":
        q, k_cache, v_cache, *rest = problem.jax()
        kv = jnp.stack([k_cache, v_cache], axis=3).reshape(*k_cache.shape[:2], -1,
                                                           k_cache.shape[3])
        fused, fused_lse = pp.paged_attention_fused(q, kv, *rest, impl="mosaic",
                                                    config=DECODE_ROWS, return_lse=True,
                                                    **jax_options(every))
        np.testing.assert_array_equal(bits(fused), bits(out))
        np.testing.assert_array_equal(bits(fused_lse), bits(lse))


@needs_kernel_api
def test_decode_rows_lower_for_cuda_to_both_kernels(monkeypatch):
    """Compiled, ``decode_rows`` is the decode kernel (and its merge where it splits) beside the
    ragged kernel in one program."""
    from pallas_paged.decode_attention import mosaic_gpu as decode_kernel

    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    monkeypatch.setattr(decode_kernel, "check_device", lambda interpret: None)
    fn = lambda *a: pp.paged_attention(*a, impl="mosaic", interpret=False,  # noqa: E731
                                       config=DECODE_ROWS, check_values=False)
    text = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_gpu.KERNEL_NAME in text and decode_kernel.KERNEL_NAME in text
    assert text.count("stablehlo.custom_call @mosaic_gpu") >= 2


@needs_kernel
def test_decode_rows_refused_where_the_decode_kernel_refuses(rng):
    """A group of 128 query heads: the ragged kernel takes it, the decode kernel (up to 64) does
    not, so decode_rows=True is a ValueError naming both ways out."""
    problem = make_ragged(rng, [(3, 12)], num_heads=128, num_kv_heads=1, head_dim=64,
                          block_size=16, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"decode_rows=True needs the Mosaic decode kernel.*up"
                                         r" to 64 query heads.*decode_rows=False"):
        pp.paged_attention(*problem.jax(), impl="mosaic", config=DECODE_ROWS)


# --- refusals ------------------------------------------------------------------------------------

@needs_kernel_api
@pytest.mark.parametrize("change,match", [
    (dict(dtype="float32"), "bf16 or fp16 queries"),
    (dict(dtype="float8_e4m3fn", head_dim=256), "bytes of shared memory.*fp8 caches"),
    (dict(head_dim=32), "head_dim in"),
    (dict(head_dim=320), "head_dim in"),
    (dict(block_size=12), "block_size a multiple of 8"),
])
def test_refusals_name_the_argument(rng, change, match):
    kwargs = dict(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    kwargs.update(change)
    problem = make_ragged(rng, [(3, 12)], **kwargs)
    scales = dict(k_scale=0.5, v_scale=2.0) if kwargs["dtype"] == "float8_e4m3fn" else {}
    with pytest.raises(ValueError, match=match):
        pp.paged_attention(*problem.jax(), impl="mosaic", interpret=True, **scales)


@needs_kernel_api
def test_refuses_configs_past_shared_memory_and_of_the_wrong_type(rng):
    problem = make_ragged(rng, [(3, 12)], num_heads=4, num_kv_heads=2, head_dim=192,
                          block_size=16, dtype="bfloat16")
    with pytest.raises(ValueError, match="bytes of shared memory"):
        pp.paged_attention(*problem.jax(), impl="mosaic", interpret=True,
                           config=M(block_kv=128, num_stages=2))
    with pytest.raises(ValueError, match="config"):
        pp.paged_attention(*problem.jax(), impl="mosaic", interpret=True,
                           config=pp.AttentionConfig())
    with pytest.raises(ValueError, match=r"pack_heads=4 must divide the GQA group of 2 query"
                                         r" heads per kv head \(num_heads=4, num_kv_heads=2\)"):
        pp.paged_attention(*problem.jax(), impl="mosaic", interpret=True,
                           config=M(block_kv=64, num_consumers=1, pack_heads=4))


@needs_kernel_api
def test_interpret_mode_refused_where_jax_cannot_interpret_the_kernel(rng, monkeypatch):
    """jax 0.11's Mosaic GPU interpreter cannot run the kernel: interpret=True is a ValueError
    that names both ways out (argument errors still come first)."""
    problem = make_ragged(rng, [(3, 12)], num_heads=4, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype="bfloat16")
    monkeypatch.setattr(mosaic_gpu, "jax_version", lambda: (0, 11, 2))
    with pytest.raises(ValueError, match=r"interpret=True needs jax >= 0\.12\.0 .* found jax"
                                         r".*run it compiled on a Hopper GPU, or use impl="):
        pp.paged_attention(*problem.jax(), impl="mosaic", interpret=True)
    with pytest.raises(ValueError, match="bf16 or fp16 queries"):
        pp.paged_attention(*make_ragged(rng, [(3, 12)], num_heads=4, num_kv_heads=2,
                                        head_dim=64, block_size=16, dtype="float32").jax(),
                           impl="mosaic", interpret=True)
    monkeypatch.setattr(mosaic_gpu, "jax_version", lambda: (0, 12, 0))
    assert mosaic_gpu.refusal(*problem.jax()[:2], M(), interpret=True) is None


@pytest.mark.parametrize("tokens,batch,group,head_dim,cache,want", [
    (8192, 4, 4, 128, "bfloat16", M()),                                  # prefill: no pack
    (2108, 64, 4, 128, "bfloat16", M()),                                 # a mix: 33 per sequence
    (128, 32, 4, 128, "bfloat16", M(block_kv=64, num_stages=3, num_consumers=1,
                                     ping_pong=False, pack_heads=4)),    # speculation: 4 tokens
    (32, 32, 8, 128, "bfloat16", M(block_kv=64, num_stages=3, num_consumers=1,
                                    ping_pong=False, pack_heads=8)),     # decodes
    (128, 32, 32, 128, "bfloat16", M(pack_heads=16)),                    # two packs of 16
    (32, 32, 6, 128, "float8_e4m3fn", M(block_kv=64, num_stages=3, num_consumers=1,
                                         ping_pong=False, pack_heads=2)),  # 6 = 2 x 3
    (32, 32, 8, 256, "bfloat16", M(block_kv=64, num_stages=2, num_consumers=1,
                                    ping_pong=False, pack_heads=8)),
    (32, 32, 1, 128, "bfloat16", M()),                                   # MHA: nothing to pack
])
def test_heuristic_packs_heads_for_short_sequences(tokens, batch, group, head_dim, cache, want):
    from pallas_paged.ragged_attention.mosaic_gpu_config import get_mosaic_heuristic_config
    shape = pp.AttentionShape(num_tokens=tokens, batch=batch, num_kv_heads=8, group=group,
                              head_dim=head_dim, block_size=16, capacity=4096,
                              cache_dtype=cache)
    config = get_mosaic_heuristic_config(shape)
    assert config == want
    S = jax.ShapeDtypeStruct
    mosaic_gpu.check_supported(S((tokens, 8 * group, head_dim), jnp.bfloat16),
                               S((100, 16, 8, head_dim), jnp.dtype(cache)), config)


@pytest.mark.parametrize("field,value", [("block_kv", 32), ("num_stages", 1),
                                         ("num_consumers", 3), ("ping_pong", 1),
                                         ("decode_rows", "yes"), ("persistent", 1),
                                         ("pack_heads", 3), ("pack_heads", True),
                                         ("overlap_softmax", 1)])
def test_config_refuses_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        M(**{field: value})


@needs_kernel_api
def test_overlapped_softmax_refused_with_ping_pong_and_fp8_caches():
    with pytest.raises(ValueError, match="overlap_softmax=True, ping_pong=True"):
        M(ping_pong=True, overlap_softmax=True)
    S = jax.ShapeDtypeStruct
    config = M(block_kv=64, ping_pong=False, overlap_softmax=True)
    mosaic_gpu.check_supported(S((8, 8, 128), jnp.bfloat16), S((10, 16, 2, 128), jnp.bfloat16),
                               config)
    with pytest.raises(ValueError, match="overlap_softmax=True takes 16-bit caches"):
        mosaic_gpu.check_supported(S((8, 8, 128), jnp.bfloat16),
                                   S((10, 16, 2, 128), jnp.float8_e4m3fn), config)


# --- compiled, realistic shapes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("seqs,cache,head_dim", [
    ([(2048, 2048)], "bfloat16", 128),                               # a whole prompt
    ([(512, 2560)] * 4 + [(1, 4096)] * 12, "bfloat16", 128),         # chunks and decodes
    ([(1000, 9000), (37, 37), (4, 700)], "bfloat16", 128),
    ([(1000, 9000), (37, 37), (4, 700)], "float8_e4m3fn", 128),
    ([(1000, 3000), (5, 700)], "bfloat16", 256),
    ([(1000, 3000), (5, 700)], "bfloat16", 64),
], ids=["prompt", "mixed", "ragged", "ragged_fp8", "d256", "d64"])
def test_compiled_against_the_triton_kernel(rng, seqs, cache, head_dim):
    """The compiled kernel at realistic shapes against impl="pallas" (the oracle's float64 loops
    would take minutes there), with its default config."""
    problem = make_ragged(rng, seqs, pad=7, num_heads=32, num_kv_heads=8, head_dim=head_dim,
                          block_size=16, dtype=cache, q_dtype="bfloat16")
    scales = dict(k_scale=0.5, v_scale=0.25) if cache == "float8_e4m3fn" else {}
    got = pp.paged_attention(*problem.jax(), impl="mosaic", **scales)
    want = pp.paged_attention(*problem.jax(), impl="pallas", **scales)
    got, want = (to_numpy(x).astype(np.float64) for x in (got, want))
    assert np.isfinite(got).all()
    bound = 4 * ATOL["bfloat16"] * max(1.0, np.abs(want).max())
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


PERSISTENT = M(block_kv=64, num_stages=2, num_consumers=2, ping_pong=True, persistent=True)


@needs_kernel
@pytest.mark.parametrize("config,cache,programs", [
    (PERSISTENT, "bfloat16", 1),
    pytest.param(PERSISTENT, "bfloat16", None, marks=SLOW),
    pytest.param(M(block_kv=64, num_stages=3, num_consumers=1, ping_pong=False,
                   persistent=True), "bfloat16", None, marks=SLOW),
    pytest.param(dataclasses.replace(PERSISTENT, decode_rows=True), "float8_e4m3fn", None,
                 marks=SLOW),
])
def test_persistent_ctas_walk_several_items(rng, monkeypatch, config, cache, programs):
    """`MosaicAttentionConfig.persistent`: a few CTAs (those a one-multiprocessor device holds,
    or one that walks every item, the trailing ones with no K/V tile among them) walk every work
    item, the ring, the query staging and the ping-pong turns carried from one item to the
    next; against the truth with every option, and the same bits as one CTA per item."""
    monkeypatch.setattr(mosaic_gpu, "sm_count", lambda: 1)
    if programs is not None:
        monkeypatch.setattr(mosaic_gpu, "persistent_programs", lambda items, smem, sms: programs)
    problem = make_ragged(rng, MIX, pad=3, num_heads=4, num_kv_heads=2, head_dim=64,
                          block_size=16, dtype=cache, q_dtype="bfloat16")
    scales = dict(k_scale=0.25, v_scale=0.75) if cache == "float8_e4m3fn" else {}
    every = every_option(rng, 4)
    smem = mosaic_gpu.smem_bytes(64, jnp.bfloat16, config, cache)
    tokens = mosaic_gpu.tokens_per_cta(2, config.num_consumers, config.pack_heads)
    items = (mosaic_gpu.num_work_tiles(problem.q.shape[0], len(MIX), tokens) * 2
             * 2 // (mosaic_gpu.packs_per_cta(2, config.num_consumers, config.pack_heads)
                     * config.pack_heads))
    assert _mosaic_common.persistent_programs(items, smem, sm_count=1) < items / 2
    out, lse = check(problem, config, **scales, **every)
    per_item = dataclasses.replace(config, persistent=False)
    want, want_lse = attend(problem, per_item, **scales, **every)
    if jax.default_backend() == "gpu":  # compiled apart, an fp32 value may round apart
        np.testing.assert_allclose(out.astype(np.float32), to_numpy(want).astype(np.float32),
                                   rtol=2 ** -7, atol=2 ** -7)
        np.testing.assert_allclose(lse, to_numpy(want_lse), rtol=1e-6, atol=1e-6)
    else:  # the same operations, simulated
        np.testing.assert_array_equal(bits(out), bits(want))
        np.testing.assert_array_equal(bits(lse), bits(want_lse))


# --- lowered for CUDA (no GPU needed) -------------------------------------------------------------

@needs_kernel_api
@pytest.mark.parametrize("head_dim,config,options", [
    (128, PING_PONG, True),
    pytest.param(128, M(block_kv=64, num_stages=3, num_consumers=2), False, marks=SLOW),
    pytest.param(64, TWO_PLAIN, False, marks=SLOW),
    (192, ONE_CONSUMER, True),
    (256, M(block_kv=64, num_stages=2, num_consumers=1, ping_pong=False), True),
    pytest.param(128, M(block_kv=128, num_stages=2, num_consumers=1, ping_pong=False), False,
                 marks=SLOW),
    (128, M(block_kv=64, num_stages=2, num_consumers=2, ping_pong=True), "fp8"),
    (128, M(persistent=True), True),
    (128, M(num_consumers=1, ping_pong=False, pack_heads=4), True),
    (128, M(block_kv=64, num_stages=2, ping_pong=False, persistent=True, overlap_softmax=True),
     True),
])
def test_lowers_for_cuda_with_the_shared_memory_its_model_says(monkeypatch, head_dim, config,
                                                               options):
    """The compiled kernel lowers for CUDA on any machine (Mosaic GPU's layout inference and
    shared-memory planning run there), and `mosaic_gpu.smem_bytes`, which decides which configs
    fit, equals the dynamic shared memory the lowered kernel asks for, byte for byte."""
    mgpu_core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(mgpu_core, "_smem_tree_size"):
        pytest.skip("this jax's Mosaic GPU does not size shared memory in _smem_tree_size")
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    asked = []
    size = mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: asked.append(size(tree))
                        or asked[-1])
    S = jax.ShapeDtypeStruct
    cache_dtype = jnp.float8_e4m3fn if options == "fp8" else jnp.bfloat16
    args = (S((300, 32, head_dim), jnp.bfloat16), *[S((500, 16, 8, head_dim), cache_dtype)] * 2,
            S((4, 64), jnp.int32), S((4,), jnp.int32), S((5,), jnp.int32))
    extra = (S((32,), jnp.float32),) * 2 + (S((), jnp.float32),) * 2 if options else ()

    def fn(*a):
        more = dict(alibi_slopes=a[6], sinks=a[7], logits_soft_cap=30.0,
                    sliding_window=100) if options else {}
        if options == "fp8":  # traced scales: kernel operands
            more.update(k_scale=a[8], v_scale=a[9])
        return pp.paged_attention(*a[:6], impl="mosaic", interpret=False, config=config,
                                  check_values=False, **more)

    text = jax.jit(fn).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert mosaic_gpu.KERNEL_NAME in text
    assert asked[0] == mosaic_gpu.smem_bytes(head_dim, jnp.bfloat16, config, cache_dtype)


# --- impl="auto" ---------------------------------------------------------------------------------

def _abstract(head_dim=128, dtype=jnp.bfloat16):
    S = jax.ShapeDtypeStruct
    return (S((300, 32, head_dim), dtype), *[S((500, 16, 8, head_dim), dtype)] * 2,
            S((4, 64), jnp.int32), S((4,), jnp.int32), S((5,), jnp.int32))


@pytest.fixture
def mosaic_measured_faster(monkeypatch):
    """A table that prefers Mosaic for the classes of `_abstract`'s shapes on this device kind."""
    classes = {shape_class(api.attention_shape(a[0], a[1], a[3])): "mosaic"
               for a in (_abstract(), _abstract(head_dim=32), _abstract(dtype=jnp.float32))}
    monkeypatch.setattr(api, "IMPL_CHOICE", {api.device_kind(): classes})


def test_auto_picks_mosaic_only_where_the_table_says_and_it_can_run_compiled(
        mosaic_measured_faster, monkeypatch):
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)  # as on sm_90
    monkeypatch.setattr(_mosaic_common, "jax_version", lambda: _mosaic_common.MIN_JAX)

    def picked(args, interpret=False, config=None):
        return api.select_kernel(args[0], args[1], args[3], impl="auto", config=config,
                                 interpret=interpret)[0]

    assert picked(_abstract()) == "mosaic"
    assert picked(_abstract(), interpret=True) == "pallas"        # never interpreted
    assert picked(_abstract(head_dim=32)) == "pallas"             # a shape it refuses
    assert picked(_abstract(dtype=jnp.float32)) == "pallas"
    assert picked(_abstract(head_dim=64)) == "pallas"             # a class not in the table
    assert picked(_abstract(), config=pp.AttentionConfig()) == "pallas"
    assert picked(_abstract(head_dim=64), config=M()) == "mosaic"  # a config names its kernel
    with pytest.raises(ValueError, match="config must be"):
        picked(_abstract(), config=object())


@needs_kernel_api
def test_auto_lowers_to_the_mosaic_kernel_where_the_table_picks_it(mosaic_measured_faster,
                                                                  monkeypatch):
    """The whole path, `paged_attention`'s default compiled for CUDA: one Mosaic GPU kernel."""
    monkeypatch.setattr(mosaic_gpu, "check_device", lambda interpret: None)
    fn = lambda *a: pp.paged_attention(*a, interpret=False, check_values=False)  # noqa: E731
    text = jax.jit(fn).trace(*_abstract()).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert mosaic_gpu.KERNEL_NAME in text and "xla.gpu.triton" not in text


def test_auto_is_the_triton_kernel_without_a_table_entry(rng):
    problem = make_ragged(rng, [(5, 12), (1, 3)], pad=1, num_heads=4, num_kv_heads=2,
                          head_dim=64, block_size=16, dtype="bfloat16")
    auto = pp.paged_attention(*problem.jax(), return_lse=True)
    pallas = pp.paged_attention(*problem.jax(), impl="pallas", return_lse=True)
    for a, b in zip(auto, pallas):
        np.testing.assert_array_equal(bits(a), bits(b))

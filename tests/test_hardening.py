"""Hardening: determinism, extreme values, the runner's donated write-then-decode step, bad tables /
lengths / slots unchecked (as under jit) with splits and every extension option; on a GPU the
compiled kernels with garbage inputs, caches past 2**31 elements, determinism at a serving-like
size, and the garbage cases under CUDA's memory checker.

The CPU tests run the Pallas kernels in interpret mode (on a GPU, compiled). To keep compilation
bounded, they share one static decode shape (`SHAPE`, `NUM_BLOCKS`) and one set of extension
options, so the jit caches are reused across tests. The eager value checks refuse the bad values
these tests feed on purpose; they pass ``check_values=False``, which runs what ``jax.jit`` runs
(test_validation.py checks the refusals and the jitted rules themselves).

Extreme values are judged against the float64 oracle, but not by the tolerance rule: on scores
of 1e4 the naive baseline in the test dtype is itself ruined (bf16 spaces 1e4 by 64; fp16
overflows), so its error bounds nothing. They keep a bound per sequence of `EXTREME_ROUNDINGS`
roundings of the output dtype (`parity.tolerance.ATOL`) at the row's scale, which a naive
softmax fails by orders of magnitude.

The GPU tests (marked ``gpu``, skipped without one)::

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -o addopts="" -m gpu \\
        tests/test_hardening.py

- garbage (``-k garbage``): table tails of +-2**31, out-of-range ids in the valid part of a table
  (clamped), ids wholly before a sliding window, lengths out of range (clamped), slots out of range
  (dropped) and bf16 NaN payloads outside the written slots, compared bit for bit with the clean
  / clamped / expected results, through the compiled kernels, with block_k 64 (20 tokens < one
  tile: masked pages).
- huge (``-k huge``): caches of 150,000 x 16 x 8 x 128 (> 2**31 elements) in bf16 and fp8 and of
  300,000 blocks in fp8 (> 2**32 elements). Tokens are written at the blocks on both sides of each
  boundary and near the end, with both write impls (donated) and the default, and the sequences
  living there are decoded with both impls and compared with the float64 oracle. Pallas' Triton
  lowering switches to 64-bit offsets only above 2**32 *bytes*, so the 150,000-block fp8 cache
  (2**31..2**32 one-byte elements) must be refused by our kernels (ValueError) and served by the
  XLA paths; the 300,000-block one runs the kernels past both boundaries.
- determinism (``-k determinism``): 20 calls per split configuration at B=8, 2048 tokens, bf16,
  H=32, KVH=8, D=128 (and XLA and one split config with every option), bit-identical, and
  within the tolerance rule of the float64 oracle; both writes, 20 calls each.
- memcheck: the garbage tests of the kernels' addressing (``MEMCHECK_SELECTION``) in a subprocess
  under ``compute-sanitizer --tool memcheck`` (with the platform allocator, so that every buffer is
  its own allocation and memcheck sees its bounds); skipped when compute-sanitizer is not on PATH.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from pallas_paged import _mosaic_common
from pallas_paged._platform import kernel_addresses_overflow
from pallas_paged.decode_attention import mosaic_gpu
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
from paged_inputs import (FP8, NP_DTYPES, assert_close, bits, make_paged, reference, to_numpy,
                          to_torch, used_entries)
from parity.layout import paged_layout
from parity.oracle import oracle_paged_attention, oracle_quantize_fp8
from parity import tolerance
from parity.tolerance import ATOL

C = pp.DecodeConfig
IMPLS = ("xla", "pallas")
SLOW = pytest.mark.slow
# Extreme values: per sequence, |out - truth| <= EXTREME_ROUNDINGS * ATOL[dtype] * max(1, max|row|):
# the output's rounding and the softmax weights' rounding to the dot's dtype (the kernels'
# P V product), each at most an ATOL relative. (Measured on the CPU: at most 1.15 ATOL.)
EXTREME_ROUNDINGS = 2

# One static decode shape for the whole file: GQA 4, head_dim 64, a block size that is not a power
# of two, capacity 12 * 5 = 60 tokens, 4 sequences, a fixed number of physical blocks.
SHAPE = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=5, max_blocks=12)
BATCH = 4
NUM_BLOCKS = BATCH * SHAPE["max_blocks"] + 5
CAPACITY = SHAPE["max_blocks"] * SHAPE["block_size"]

MERGED = dict(merge_in_kernel=True)
PERSISTENT = dict(persistent_programs=6)  # 3 per kv head
SPLIT_CONFIGS = tuple(C(block_k, splits) for splits in (1, 2, 3, 8) for block_k in (16, 32)) + (
    C(16, 3, **MERGED), C(32, 8, **MERGED), C(16, **PERSISTENT), C(32, persistent_programs=16))
GARBAGE_CONFIGS = (C(16, 1), C(16, 3), C(32, 8), C(32, 8, **MERGED),
                   C(16, **PERSISTENT))  # in SPLIT_CONFIGS
# 8 splits of 4 tiles: some empty; 8 persistent programs per kv head for the batch's 4 x 4 tiles
EXTREME_CONFIGS = (C(16, 1), C(16, 8), C(16, 8, **MERGED), C(16, persistent_programs=16))


def run_id(run):
    impl, config = run
    if config is None:
        return impl
    merged = "-merged" if config.merge_in_kernel else ""
    persistent = f"-p{config.persistent_programs}" if config.persistent_programs else ""
    return f"{impl}-bk{config.block_k}-s{config.num_splits}{merged}{persistent}"


def runs(configs, fast=()):
    """``("xla", None)`` and ``("pallas", config)`` for each config, the pallas runs outside
    ``fast`` marked slow."""
    return [pytest.param(("xla", None), id="xla")] + [
        pytest.param(("pallas", c), id=run_id(("pallas", c)), marks=[] if c in fast else [SLOW])
        for c in configs]


def grid(run_params, values, fast_values):
    """``(run, *value)`` for every run and value: slow where the run is, and for a pallas run
    with a value outside ``fast_values`` (the XLA path is cheap in every case)."""
    out = []
    for r in run_params:
        for v in values:
            vs = v if isinstance(v, tuple) else (v,)
            slow = bool(r.marks) or (r.values[0][0] != "xla" and v not in fast_values)
            out.append(pytest.param(r.values[0], *vs, id="-".join([r.id, *map(str, vs)]),
                                    marks=[SLOW] if slow else []))
    return out


DECODE_RUNS = runs(SPLIT_CONFIGS, fast=(C(16, 3, **MERGED),))
GARBAGE_RUNS = runs(GARBAGE_CONFIGS, fast=(C(16, 3),))
EXTREME_RUNS = runs(EXTREME_CONFIGS, fast=(C(16, 8, **MERGED),))


def paged(rng, lens, dtype="bfloat16", **kwargs):
    """`make_paged` with this file's static shape, whatever the lengths."""
    pages = sum(-(-n // SHAPE["block_size"]) for n in lens)
    return make_paged(rng, lens=lens, spare_blocks=NUM_BLOCKS - pages, dtype=dtype, **SHAPE,
                      **kwargs)


def every_option(rng):
    """Soft-cap, ALiBi, a window shorter than the capacity, sinks, lse: the static part is the
    same in every call, so one compilation per (impl, config) serves the file."""
    h = SHAPE["num_heads"]
    return dict(logits_soft_cap=20.0, sliding_window=23, return_lse=True,
                alibi_slopes=jnp.asarray(np.exp2(-np.arange(1, h + 1, dtype=np.float32))),
                sinks=jnp.asarray(rng.standard_normal(h).astype(np.float32)))


def decode_bits(p, impl, config, options, **overrides):
    """``(out, lse)`` raw bits of one call, the inputs uploaded afresh, values unchecked (the
    program ``jax.jit`` runs)."""
    out = pp.decode(*p.jax(**overrides), impl=impl, config=config, check_values=False, **options)
    out, lse = out if options.get("return_lse") else (out, jnp.zeros(()))
    return bits(out), bits(lse)


# --- determinism --------------------------------------------------------------------------------

@pytest.mark.parametrize("run", DECODE_RUNS)
def test_decode_is_bitwise_deterministic(rng, run):
    """The same inputs give the same bits on every call, for every split configuration."""
    impl, config = run
    p = paged(rng, lens=[CAPACITY, 0, 37, 6])
    options = every_option(rng)
    first = decode_bits(p, impl, config, options)
    for _ in range(4):
        again = decode_bits(p, impl, config, options)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_write_is_bitwise_deterministic(rng, impl):
    """Distinct slots: every call writes the same bits (there is no race to lose)."""
    shape = (NUM_BLOCKS, SHAPE["block_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
    k_cache, v_cache = (rng.standard_normal(shape).astype(NP_DTYPES["bfloat16"]) for _ in range(2))
    slots = rng.choice(NUM_BLOCKS * SHAPE["block_size"], 24, replace=False).astype(np.int32)
    slots[::5] = -1
    new = rng.standard_normal((2, 24, *shape[2:])).astype(NP_DTYPES["bfloat16"])
    outs = []
    for _ in range(5):
        got = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, new[0], new[1], slots)), impl=impl)
        outs.append([bits(x) for x in got])
    for k_bits, v_bits in outs[1:]:
        np.testing.assert_array_equal(k_bits, outs[0][0])
        np.testing.assert_array_equal(v_bits, outs[0][1])


# --- extreme values, against the float64 oracle ------------------------------------------------

def rewrite_valid(p, k_rows, v_rows):
    """Replace the K/V of every valid token (in slot order) by ``k_rows`` / ``v_rows`` (float)."""
    dtype = p.k_cache.dtype
    for cache, rows in ((p.k_cache, k_rows), (p.v_cache, v_rows)):
        flat = cache.reshape(-1, *cache.shape[2:])
        flat[p.valid_slots] = np.asarray(rows, np.float32).astype(dtype)


def check_against_oracle(p, run, dtype, options=None):
    """No NaN / Inf; per sequence within ``EXTREME_ROUNDINGS * ATOL[dtype] * max(1, max|row|)``
    of the float64 truth (the module docstring says why not the tolerance rule); the lse within
    the tolerance rule (its fp32 baseline is sound here); rows without keys exactly 0, -inf."""
    impl, config = run
    options = {k: v for k, v in (options or {}).items() if k != "return_lse"}
    ref = reference(*p.arrays(), **options)
    out, lse = pp.decode(*p.jax(), impl=impl, config=config, return_lse=True, **options)
    out, lse = to_numpy(out).astype(np.float64), to_numpy(lse)
    assert np.isfinite(out).all(), "NaN or Inf in the output"
    empty = p.context_lens == 0
    assert (out[empty] == 0).all() and np.isneginf(lse[empty]).all()
    assert np.isfinite(lse[~empty]).all()
    bound = EXTREME_ROUNDINGS * ATOL[dtype] * np.maximum(1.0, np.abs(ref.truth_out).max(axis=(1, 2)))
    err = np.abs(out - ref.truth_out).max(axis=(1, 2))
    assert (err <= bound).all(), f"errors {err} > bounds {bound}"
    lse_tol = tolerance.decode_tolerance("lse", "float32", ref.truth_lse, ref.baseline_lse)
    assert tolerance.max_abs_error(lse, ref.truth_lse) <= lse_tol.value
    return out


def exact_large_scores(rng, p, sign):
    """Scores ``sign * 1e4 + O(1)``, exactly representable (small integers; scale 1/8), so any
    error is the implementation's: ``q = [100, +-1, ...]``, ``k = [sign * 800, -2..2, ...]``."""
    num_valid = int(p.valid_slots.sum())
    kvh, d = SHAPE["num_kv_heads"], SHAPE["head_dim"]
    p.q[...] = rng.integers(-1, 2, p.q.shape).astype(p.q.dtype)
    p.q[..., 0] = 100
    k = rng.integers(-2, 3, (num_valid, kvh, d)).astype(np.float32)
    signs = np.asarray(sign(num_valid) if callable(sign) else np.full(num_valid, sign), np.float32)
    k[..., 0] = 800 * signs[:, None]
    rewrite_valid(p, k, rng.standard_normal((num_valid, kvh, d)))


@pytest.mark.parametrize("run,dtype,sign", grid(
    EXTREME_RUNS, [(d, s) for d in ("float32", "bfloat16", "float16")
                   for s in ("positive", "negative", "mixed")],
    fast_values=[("bfloat16", "mixed"), ("float16", "positive")]))
def test_scores_around_1e4(rng, run, dtype, sign):
    """Logits of +-1e4 with O(1) differences: the softmax must subtract its running max (e^1e4
    overflows, e^-1e4 underflows to 0/0), in every split of the merge."""
    p = paged(rng, lens=[CAPACITY, 1, 33, 16], dtype=dtype, fill=np.nan)
    choose = {"positive": 1.0, "negative": -1.0,
              "mixed": lambda n: rng.choice([-1.0, 1.0], n)}[sign]
    exact_large_scores(rng, p, choose)
    check_against_oracle(p, run, dtype)


@pytest.mark.parametrize("run,sign", grid(EXTREME_RUNS, ["positive", "mixed"], ["mixed"]))
def test_fp8_cache_scores_around_1e4(rng, run, sign):
    """fp8 cache, bf16 query: logits of +-9600 (q 100 x stored 384 x k_scale 2 / 8) with O(1)
    differences, exact in every dot dtype the kernel may pick."""
    p = paged(rng, lens=[CAPACITY, 1, 33, 16], dtype="float8_e4m3fn", fill=np.nan)
    num_valid = int(p.valid_slots.sum())
    kvh, d = SHAPE["num_kv_heads"], SHAPE["head_dim"]
    p.q[...] = rng.integers(-1, 2, p.q.shape).astype(p.q.dtype)
    p.q[..., 0] = 100
    k = rng.integers(-2, 3, (num_valid, kvh, d)).astype(np.float32)
    signs = rng.choice([-1.0, 1.0], num_valid) if sign == "mixed" else np.ones(num_valid)
    k[..., 0] = 384 * signs[:, None]
    rewrite_valid(p, k, rng.standard_normal((num_valid, kvh, d)) * 4)
    check_against_oracle(p, run, "bfloat16", dict(k_scale=2.0, v_scale=0.5))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_cache_bf16_query_beyond_fp16_range(impl):
    """SPEC.md computes scores from ``q.float()``; a bf16 query may exceed fp16's 65504 (the
    kernel's dots for fp8 caches run in fp16, on a query scaled by a power of two). Token 0
    scores 99840 * 2**-9 / 4 = 48.75 and wins over token 1 (160 / 4 = 40): the output is V_0."""
    q = np.zeros((1, 1, 16), np.float32)
    q[0, 0, :2] = [1e5, 1.0]
    k = np.zeros((1, 2, 1, 16), np.float32)
    k[0, 0, 0, 0], k[0, 1, 0, 1] = 2.0**-9, 160.0
    v = np.zeros((1, 2, 1, 16), np.float32)
    v[0, 0], v[0, 1] = 1.0, -1.0
    args = [q.astype(NP_DTYPES["bfloat16"]), k.astype(NP_DTYPES["float8_e4m3fn"]),
            v.astype(NP_DTYPES["float8_e4m3fn"]), np.zeros((1, 1), np.int32),
            np.array([2], np.int32)]
    out = pp.decode(*map(jnp.asarray, args), impl=impl, k_scale=1.0, v_scale=1.0)
    assert_close(reference(*args, k_scale=1.0, v_scale=1.0), out)
    assert float(to_numpy(out).astype(np.float32)[0, 0, 0]) > 0.99  # V_0's weight


@pytest.mark.parametrize("run", [("xla", None), ("pallas", C(16, 3))], ids=run_id)
def test_scores_far_below_the_sink(rng, run):
    """Every score near -1e4 and a sink of 0: the sink takes all the weight; out ~ 0, lse ~ 0."""
    p = paged(rng, lens=[CAPACITY, 0, 21, 5], dtype="float32")
    exact_large_scores(rng, p, -1.0)
    sinks = jnp.zeros(SHAPE["num_heads"], jnp.float32)
    out = check_against_oracle(p, run, "float32", dict(sinks=sinks))
    assert np.abs(out).max() < 1e-30


@pytest.mark.parametrize("run", EXTREME_RUNS)
def test_fp16_near_its_range_limit(rng, run):
    """fp16: V about +-6e4 (the max is 65504) and scores about 4e4 (q, k entries of 200): fine
    only if scores and the weighted sum accumulate in fp32."""
    p = paged(rng, lens=[CAPACITY, 1, 33, 16], dtype="float16")
    num_valid = int(p.valid_slots.sum())
    kvh, d = SHAPE["num_kv_heads"], SHAPE["head_dim"]
    p.q[...] = rng.integers(-1, 2, p.q.shape).astype(np.float16)
    p.q[..., :8] = 200
    k = rng.integers(-2, 3, (num_valid, kvh, d)).astype(np.float32)
    k[..., :8] = 200  # q.k / 8 = 4e4 + O(1), exact in fp32
    v = rng.choice([-1.0, 1.0], (num_valid, kvh, d)) * rng.uniform(5.5e4, 6.5e4,
                                                                  (num_valid, kvh, d))
    rewrite_valid(p, k, v)
    out = check_against_oracle(p, run, "float16")
    assert np.abs(out).max() > 3e4  # the test is about large outputs


@pytest.mark.parametrize("run", EXTREME_RUNS)
def test_fp16_uniform_weights_over_near_max_values(rng, run):
    """q = 0 and every V near +65504: an fp16 accumulator of the weighted sum would overflow
    (60 * 6e4); the output is their mean."""
    p = paged(rng, lens=[CAPACITY, 1, 33, 16], dtype="float16")
    p.q[...] = 0
    num_valid = int(p.valid_slots.sum())
    kvh, d = SHAPE["num_kv_heads"], SHAPE["head_dim"]
    rewrite_valid(p, rng.standard_normal((num_valid, kvh, d)),
                  rng.uniform(6.0e4, 65504, (num_valid, kvh, d)))
    out = check_against_oracle(p, run, "float16")
    assert out.min() > 5.9e4


@pytest.mark.parametrize("run,dtype", grid(EXTREME_RUNS, ["float32", "bfloat16", "float16"],
                                           ["float16"]))
def test_all_equal_scores(rng, run, dtype):
    """q = 0: every score is 0, the weights uniform, the output the mean of V, lse = log(n)."""
    p = paged(rng, lens=[CAPACITY, 1, 0, 27], dtype=dtype)
    p.q[...] = 0
    check_against_oracle(p, run, dtype)


@pytest.mark.parametrize("run,dtype", grid(EXTREME_RUNS, ["float32", "bfloat16"], ["bfloat16"]))
def test_single_huge_outlier_key(rng, run, dtype):
    """One key aligned with q, 40x longer than the others: it takes (nearly) all the weight,
    wherever it sits (first tile, last tile, a later split); a huge anti-aligned key takes none."""
    lens = [CAPACITY, 33, 1, 17]
    p = paged(rng, lens=lens, dtype=dtype)
    bs = SHAPE["block_size"]
    group = SHAPE["num_heads"] // SHAPE["num_kv_heads"]
    where = {0: (CAPACITY - 2, 40.0), 1: (20, -40.0), 2: (0, 40.0), 3: (0, 40.0)}
    for b, (pos, factor) in where.items():
        block = p.block_tables[b, pos // bs]
        for kv in range(SHAPE["num_kv_heads"]):
            direction = p.q[b, kv * group:(kv + 1) * group].astype(np.float32).mean(axis=0)
            p.k_cache[block, pos % bs, kv] = (factor * direction).astype(p.k_cache.dtype)
    out = check_against_oracle(p, run, dtype)
    # rows 0 and 3: the outlier's V row dominates
    for b in (0, 3):
        pos = where[b][0]
        v_row = p.v_cache[p.block_tables[b, pos // bs], pos % bs].astype(np.float64)  # [KVH, D]
        np.testing.assert_allclose(out[b], np.repeat(v_row, group, axis=0), atol=0.1)


# --- the runner's step: write, then decode, jitted together with donated caches ------------------

STEP_BS, STEP_WIDTH, STEP_BATCH = 4, 4, 3
STEP_BLOCKS = STEP_BATCH * STEP_WIDTH + 2
STEP_KVH, STEP_H, STEP_D = 2, 4, 32
STEP_OPTIONS = dict(sliding_window=6, return_lse=True)


@functools.cache
def donated_step(write_impl, decode_impl, dtype):
    scales = dict(k_scale=0.05, v_scale=0.1) if dtype == "float8_e4m3fn" else {}

    def step(k_cache, v_cache, k, v, slots, q, tables, lens):
        k_cache, v_cache = pp.write_kv(k_cache, v_cache, k, v, slots, impl=write_impl, **scales)
        out, lse = pp.decode(q, k_cache, v_cache, tables, lens, impl=decode_impl, **scales,
                             config=C(16, 2) if decode_impl == "pallas" else None, **STEP_OPTIONS)
        return out, lse, k_cache, v_cache

    return jax.jit(step, donate_argnums=(0, 1)), scales


@pytest.mark.parametrize("dtype,write_impl,decode_impl", [
    pytest.param("bfloat16", "xla", "xla", marks=SLOW),
    pytest.param("bfloat16", "xla", "pallas", marks=SLOW),
    pytest.param("bfloat16", "pallas", "xla", marks=SLOW), ("bfloat16", "pallas", "pallas"),
    pytest.param("float8_e4m3fn", "pallas", "pallas", marks=SLOW),
    ("float8_e4m3fn", "xla", "pallas")])
def test_runner_steps_read_the_token_just_written(rng, dtype, write_impl, decode_impl):
    """Six steps in a row, each writing one token per live sequence and decoding over it, the
    caches donated from step to step. The slot of each new token holds NaN until its write, so a
    decode that read the cache from before the write (stale aliasing) would return NaN; the
    outputs and the final caches must equal torch_ref doing the same steps."""
    step, scales = donated_step(write_impl, decode_impl, dtype)
    q_dtype = "bfloat16"
    shape = (STEP_BLOCKS, STEP_BS, STEP_KVH, STEP_D)
    tables = paged_layout(rng, [STEP_WIDTH * STEP_BS] * STEP_BATCH, block_size=STEP_BS,
                          spare_blocks=STEP_BLOCKS - STEP_BATCH * STEP_WIDTH).block_tables
    lens = np.array([3, 0, 9], np.int32)  # row 1 is a padded batch row: length 0, slot -1
    init = np.full((2, STEP_BLOCKS * STEP_BS, STEP_KVH, STEP_D), np.nan, np.float32)
    for b, n in enumerate(lens):
        pos = np.arange(n)
        slot = tables[b, pos // STEP_BS] * STEP_BS + pos % STEP_BS
        init[:, slot] = rng.standard_normal((2, n, STEP_KVH, STEP_D))
    with np.errstate(invalid="ignore"):
        caches = [x.reshape(shape).astype(NP_DTYPES[dtype]) for x in init]
    torch_k, torch_v = to_torch(caches[0].copy()), to_torch(caches[1].copy())
    k_cache, v_cache = jnp.asarray(caches[0]), jnp.asarray(caches[1])
    for _ in range(6):
        # the new token of a live row is position n (the length becomes n + 1); one extra padding
        # token carries a sentinel that must land nowhere
        slots = np.full(STEP_BATCH + 1, -1, np.int32)
        for b in (0, 2):
            n = lens[b]
            slots[b] = tables[b, n // STEP_BS] * STEP_BS + n % STEP_BS
            lens[b] += 1
        new = rng.standard_normal((2, STEP_BATCH + 1, STEP_KVH, STEP_D)).astype(NP_DTYPES[q_dtype])
        new[:, slots < 0] = 1000.0
        q = rng.standard_normal((STEP_BATCH, STEP_H, STEP_D)).astype(NP_DTYPES[q_dtype])

        torch_ref.write_kv(torch_k, torch_v, to_torch(new[0]), to_torch(new[1]),
                           torch.from_numpy(slots), **scales)
        ref = reference(q, torch_k, torch_v, tables, lens, **scales,
                        sliding_window=STEP_OPTIONS["sliding_window"])
        old = (k_cache, v_cache)
        out, lse, k_cache, v_cache = step(k_cache, v_cache, *map(jnp.asarray, (
            new[0], new[1], slots, q, tables, lens)))
        assert old[0].is_deleted() and old[1].is_deleted(), "the caches were not donated"
        assert np.isfinite(to_numpy(out).astype(np.float32)).all(), "a stale cache was read"
        assert_close(ref, out, lse)
    np.testing.assert_array_equal(bits(k_cache), bits(torch_k))
    np.testing.assert_array_equal(bits(v_cache), bits(torch_v))


# --- bad tables and lengths under jit, with splits and every option -----------------------------

@pytest.mark.parametrize("run", GARBAGE_RUNS)
def test_table_tail_garbage_with_splits_and_options(rng, run):
    """Entries past ceil(n / bs) are never read: huge, negative and out-of-range ids there leave
    out and lse bit for bit unchanged, through the split-K merge and with every option on."""
    impl, config = run
    p = paged(rng, lens=[23, 0, CAPACITY, 7], tail=(0,))
    options = every_option(rng)
    clean = decode_bits(p, impl, config, options)
    used = used_entries(p.block_tables, p.context_lens, SHAPE["block_size"])
    mixed = rng.choice(np.array([2**31 - 1, -2**31, NUM_BLOCKS, NUM_BLOCKS + 7, -1, 2**30]),
                       p.block_tables.shape)
    for garbage in (2**31 - 1, -2**31, NUM_BLOCKS, -1, mixed):
        tables = np.where(used, p.block_tables, garbage).astype(np.int32)
        got = decode_bits(p, impl, config, options, block_tables=tables)
        np.testing.assert_array_equal(got[0], clean[0])
        np.testing.assert_array_equal(got[1], clean[1])


@pytest.mark.parametrize("run", GARBAGE_RUNS)
def test_garbage_ids_before_the_window_change_nothing(rng, run):
    """With a sliding window, blocks wholly before it do not take part: out-of-range ids in their
    table entries (clamped under jit, or skipped by the kernel) change no output bit."""
    impl, config = run
    p = paged(rng, lens=[CAPACITY, 41, 0, 24])
    options = every_option(rng)  # window 23
    clean = decode_bits(p, impl, config, options)
    tables = p.block_tables.copy()
    bs = SHAPE["block_size"]
    for b, n in enumerate(p.context_lens):
        before = max(0, n - options["sliding_window"]) // bs  # blocks wholly before the window
        tables[b, :before] = rng.choice([2**31 - 1, -2**31, NUM_BLOCKS, -3], before)
    got = decode_bits(p, impl, config, options, block_tables=tables)
    np.testing.assert_array_equal(got[0], clean[0])
    np.testing.assert_array_equal(got[1], clean[1])


@pytest.mark.parametrize("run", GARBAGE_RUNS)
def test_out_of_range_ids_in_valid_part_are_clamped_with_splits(rng, run):
    """Unchecked (as under jit) an id outside [0, num_blocks) in the valid part reads the clamped
    block, never outside the cache: the result is that of the clipped table, bit for bit."""
    impl, config = run
    p = paged(rng, lens=[CAPACITY, 12, 33, 0], fill=0.0)
    options = every_option(rng)
    tables = p.block_tables.copy()
    tables[0, [0, 5, 11]] = [2**31 - 1, -2**31, NUM_BLOCKS]
    tables[1, 2] = -1
    tables[2, 6] = NUM_BLOCKS + 1000
    got = decode_bits(p, impl, config, options, block_tables=tables)
    clipped = decode_bits(p, impl, config, options,
                          block_tables=np.clip(tables, 0, NUM_BLOCKS - 1).astype(np.int32))
    np.testing.assert_array_equal(got[0], clipped[0])
    np.testing.assert_array_equal(got[1], clipped[1])
    assert np.isfinite(got[0].view(NP_DTYPES["bfloat16"]).astype(np.float32)).all()


@pytest.mark.parametrize("run", GARBAGE_RUNS)
def test_lengths_out_of_range_are_clamped_with_splits(rng, run):
    """Unchecked (as under jit) a length above the capacity counts as the capacity, a negative one
    as 0 (zeros and lse = -inf), bit for bit, with the merge and every option."""
    impl, config = run
    p = paged(rng, lens=[CAPACITY, 0, CAPACITY, 0], tail=(2**31 - 1,))
    options = every_option(rng)
    bad = np.array([CAPACITY + 1, -1, 2**31 - 1, -2**31], np.int32)
    got = decode_bits(p, impl, config, options, context_lens=bad)
    clamped = decode_bits(p, impl, config, options)
    np.testing.assert_array_equal(got[0], clamped[0])
    np.testing.assert_array_equal(got[1], clamped[1])
    lse = got[1].view(np.float32)
    assert np.isneginf(lse[[1, 3]]).all()


# --- writes under jit: duplicates, and bits that must survive -----------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_duplicate_slots_write_one_of_the_candidates(rng, impl):
    """Two or more tokens on one slot (an error that eager validation rejects): unchecked (as
    under jit) each element of that slot ends up holding the element of one of those tokens
    (which one is unspecified), and nothing else in the cache changes."""
    shape = (6, 4, 2, 16)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    slots = np.array([5, 9, 5, -1, 9, 5, 23, 30], np.int32)
    k, v = rng.standard_normal((2, len(slots), 2, 16)).astype(np.float32)
    got = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl,
                      check_values=False)
    for cache, new, out in ((k_cache, k, got[0]), (v_cache, v, got[1])):
        flat_in = cache.reshape(24, 2, 16)
        flat_out = np.asarray(out).reshape(24, 2, 16)
        for slot in range(24):
            writers = np.flatnonzero(slots == slot)
            if len(writers) == 0:
                np.testing.assert_array_equal(bits(flat_out[slot]), bits(flat_in[slot]))
            else:
                candidates = new[writers]  # [writers, 2, 16]
                assert (flat_out[slot][None] == candidates).any(axis=0).all(), f"slot {slot}"


NAN_PAYLOADS = {  # quiet and signalling NaNs with payloads, both signs
    "bfloat16": (np.uint16, [0x7FC1, 0x7F81, 0xFFA5, 0x7FFF]),
    "float16": (np.uint16, [0x7E01, 0x7C01, 0xFD55, 0x7FFF]),
    "float32": (np.uint32, [0x7FC00001, 0x7F800001, 0xFFB00000, 0x7FFFFFFF]),
}


@functools.cache
def scatter_keeps_bf16_nan_payloads() -> bool:
    """Whether a plain jitted ``x.at[i].set(...)`` on this backend leaves the bf16 NaN payloads of
    the elements it does not write as they were (XLA:CPU up to jaxlib 0.11 rewrites them to
    0x7FC0 / 0xFFC0; jaxlib 0.12 keeps them). Asked of XLA itself, not of pallas_paged."""
    raw = np.array([0x7FC1, 0xFFA5, 0, 0], np.uint16)
    scatter = jax.jit(lambda x, i: x.at[i].set(jnp.bfloat16(1.0)))
    got = np.asarray(scatter(jnp.asarray(raw.view(NP_DTYPES["bfloat16"])), jnp.asarray([2])))
    return bool((got.view(np.uint16)[:2] == raw[:2]).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(NAN_PAYLOADS))
def test_nan_payloads_outside_the_written_slots_survive(rng, request, impl, dtype):
    """"Nothing else in the cache changes, bit for bit": NaN payloads included. Where XLA's own
    scatter canonicalizes bfloat16 NaNs (XLA:CPU before jaxlib 0.12), bf16 is a known failure."""
    if dtype == "bfloat16" and not scatter_keeps_bf16_nan_payloads():
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="this XLA's scatter rewrites bfloat16 NaN payloads to"
                                " 0x7FC0/0xFFC0"))
    uint, patterns = NAN_PAYLOADS[dtype]
    shape = (4, 4, 1, 8)
    raw = rng.integers(0, 2**10, shape).astype(uint)
    raw.reshape(-1)[::3] = np.resize(np.asarray(patterns, uint), raw.size)[::3]
    k_cache = raw.view(NP_DTYPES[dtype])
    slots = np.array([1, 14, -1], np.int32)
    new = rng.standard_normal((3, 1, 8)).astype(NP_DTYPES[dtype])
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, k_cache, new, new, slots)), impl=impl)
    untouched = np.ones(16, bool)
    untouched[[1, 14]] = False
    np.testing.assert_array_equal(bits(got_k).reshape(16, -1)[untouched],
                                  bits(k_cache).reshape(16, -1)[untouched])


# --- on a GPU ------------------------------------------------------------------------------------

BF16, NP_FP8 = NP_DTYPES["bfloat16"], NP_DTYPES[FP8]
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
PAD_SENTINEL = 1000.0  # the rows of padding tokens: must never land in a cache
UNDER_SANITIZER = "PALLAS_PAGED_UNDER_SANITIZER"
MEMCHECK_SELECTION = "garbage and (table_tails or lengths) and not xla"


def gpu_run_id(run) -> str:
    impl, config = run
    if impl == "xla":
        return "xla"
    if config is None:
        return f"{impl}_default"
    merged = "_merged" if getattr(config, "merge_in_kernel", False) else ""
    pairs = "_pairs" if getattr(config, "fp8_pairs", False) else ""
    return f"{impl}_bk{config.block_k}_s{config.num_splits}{merged}{pairs}"


def gpu_decode_bits(run, args, **options):
    """Raw bits of ``(out, lse)`` of one decode call (NaN == NaN in comparisons)."""
    impl, config = run
    out, lse = pp.decode(*args, impl=impl, config=config, return_lse=True, check_values=False,
                         **options)
    return bits(out), bits(lse)


def same_bits(got, want) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(got, want))


def assert_same_bits(got, want, what: str):
    for x, y, part in ((got[0], want[0], "out"), (got[1], want[1], "lse")):
        differ = int((x != y).sum())
        assert differ == 0, f"{what}: {differ} {part} elements differ"


def assert_close_to_oracle(out, expected, lens, q_dtype: str) -> float:
    """Finite; zeros for empty rows; per row ``max|out - oracle| <= EXTREME_ROUNDINGS * ATOL *
    max(1, max|oracle row|)``: the caches of the huge tests are GBs on the device, and the
    tolerance rule's naive baseline would copy them whole to the host. Returns the largest
    error."""
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    empty = np.asarray(lens) <= 0
    assert (got[empty] == 0).all(), "a zero-length row is not zero"
    err = np.abs(got - expected).max(axis=(1, 2))
    bound = EXTREME_ROUNDINGS * ATOL[q_dtype] * np.maximum(1.0, np.abs(expected).max(axis=(1, 2)))
    assert (err <= bound).all(), f"max errors {err.tolist()} exceed {bound.tolist()}"
    return float(err.max())


# --- garbage -------------------------------------------------------------------------------------

def _mosaic_runs() -> list:
    """The Mosaic kernel's run where it can run compiled: this jax has its API and the GPU is
    sm_90 or later (`mosaic_gpu.check_device`); none elsewhere."""
    if _mosaic_common.jax_version() < _mosaic_common.MIN_JAX:
        return []
    try:
        mosaic_gpu.check_device(interpret=False)
    except ValueError:
        return []
    return [("mosaic", MosaicDecodeConfig(block_k=64, num_splits=3, num_stages=2))]


MOSAIC_RUNS = _mosaic_runs()
GPU_GARBAGE_RUNS = [("xla", None), ("pallas", C(64, 1)), ("pallas", C(16, 3)),
                ("pallas", C(16, 3, merge_in_kernel=True))] + MOSAIC_RUNS
GARBAGE_BATCH, GARBAGE_WIDTH, GARBAGE_BS = 4, 8, 16
GARBAGE_CAPACITY = GARBAGE_WIDTH * GARBAGE_BS
GARBAGE_LENS = (GARBAGE_CAPACITY, 17, 0, 20)  # 20 < one 64-token tile: masked pages
GARBAGE_OPTIONS = dict(logits_soft_cap=30.0, sliding_window=40)


@pytest.fixture(scope="module")
def garbage():
    """One bf16 problem (GQA 4, D=64) with every extension; spare blocks hold a finite fill, so
    that a clamped id landing in one still gives comparable numbers."""
    rng = np.random.default_rng(0)
    paged = make_paged(rng, lens=GARBAGE_LENS, num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=GARBAGE_BS, max_blocks=GARBAGE_WIDTH, spare_blocks=25,
                       dtype="bfloat16", fill=0.25)
    options = dict(GARBAGE_OPTIONS,
                   alibi_slopes=jnp.asarray(np.exp2(-np.arange(1, 9)).astype(np.float32)),
                   sinks=jnp.asarray(rng.standard_normal(8).astype(np.float32)))
    pages = -(-paged.context_lens // GARBAGE_BS)
    used = np.arange(GARBAGE_WIDTH)[None, :] < pages[:, None]
    return dict(paged=paged, options=options, used=used,
                num_blocks=paged.k_cache.shape[0])


def _garbage_args(g, tables=None, lens=None):
    p = g["paged"]
    tables = p.block_tables if tables is None else np.asarray(tables, np.int32)
    lens = p.context_lens if lens is None else np.asarray(lens, np.int32)
    return p.jax(block_tables=tables, context_lens=lens)


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_GARBAGE_RUNS)
def test_garbage_table_tails_are_never_read(garbage, run):
    """Compiled: table tails of +-2**31, num_blocks and -1 change no output bit."""
    g = garbage
    clean_tables = np.where(g["used"], g["paged"].block_tables, 0)
    clean = gpu_decode_bits(run, _garbage_args(g, clean_tables), **g["options"])
    for junk in (INT32_MAX, INT32_MIN, g["num_blocks"], g["num_blocks"] + 12345, -1):
        tables = np.where(g["used"], g["paged"].block_tables, junk)
        assert_same_bits(gpu_decode_bits(run, _garbage_args(g, tables), **g["options"]), clean,
                         f"tail {junk}")


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_GARBAGE_RUNS)
def test_garbage_ids_in_the_valid_part_are_clamped(garbage, run):
    """Compiled and unchecked: bad ids in the valid part read the clamped blocks, bit for bit."""
    g = garbage
    bad = g["paged"].block_tables.copy()
    bad[0, [0, 3, 7]] = [INT32_MAX, INT32_MIN, g["num_blocks"]]
    bad[1, 1] = -1
    bad[3, 0] = g["num_blocks"] + 999
    clamped = np.clip(bad, 0, g["num_blocks"] - 1)
    assert_same_bits(gpu_decode_bits(run, _garbage_args(g, bad), **g["options"]),
                     gpu_decode_bits(run, _garbage_args(g, clamped), **g["options"]), "clamped ids")


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_GARBAGE_RUNS)
def test_garbage_ids_before_the_window_are_never_read(garbage, run):
    """Compiled: ids of blocks wholly before the window (-2**31) change no output bit."""
    g = garbage
    bad = g["paged"].block_tables.copy()
    for row, n in enumerate(GARBAGE_LENS):
        bad[row, :max(0, n - GARBAGE_OPTIONS["sliding_window"]) // GARBAGE_BS] = INT32_MIN
    assert_same_bits(gpu_decode_bits(run, _garbage_args(g, bad), **g["options"]),
                     gpu_decode_bits(run, _garbage_args(g), **g["options"]), "ids before the window")


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_GARBAGE_RUNS)
def test_garbage_lengths_are_clamped(garbage, run):
    """Compiled and unchecked: lengths past the capacity or negative clamp, bit for bit."""
    g = garbage
    tables = np.clip(g["paged"].block_tables, 0, g["num_blocks"] - 1)  # read at full length
    full = [GARBAGE_CAPACITY, 0, GARBAGE_CAPACITY, 0]
    bad = [GARBAGE_CAPACITY + 1, -1, INT32_MAX, INT32_MIN]
    assert_same_bits(gpu_decode_bits(run, _garbage_args(g, tables, bad), **g["options"]),
                     gpu_decode_bits(run, _garbage_args(g, tables, full), **g["options"]),
                     "clamped lengths")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [C(32, 2), C(32, 2, fp8_v_at_load=True),
                                    C(64, 2, num_stages=5, fp8_pairs=True)],
                         ids=["v_in_operand_read", "v_at_load", "pairs"])
def test_garbage_fp8_table_tails_are_never_read(garbage, config):
    """Compiled, fp8 caches through each fp8 operand path: tails of 2**31 - 1 change no bit."""
    g = garbage
    rng = np.random.default_rng(1)
    k8 = rng.standard_normal(g["paged"].k_cache.shape).astype(NP_FP8)
    v8 = rng.standard_normal(g["paged"].k_cache.shape).astype(NP_FP8)
    run, scales = ("pallas", config), dict(k_scale=0.5, v_scale=0.25)
    clean_tables = np.where(g["used"], g["paged"].block_tables, 0)
    clean = gpu_decode_bits(run, g["paged"].jax(k_cache=k8, v_cache=v8, block_tables=clean_tables),
                        **scales)
    bad = np.where(g["used"], g["paged"].block_tables, INT32_MAX)
    assert_same_bits(gpu_decode_bits(run, g["paged"].jax(k_cache=k8, v_cache=v8, block_tables=bad),
                                 **scales), clean, "fp8 tails")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_garbage_slots_out_of_range_are_dropped_under_jit(garbage, impl):
    """Compiled under jit: slots out of range are dropped; the cache is the expected one bit for
    bit."""
    rng = np.random.default_rng(2)
    shape = garbage["paged"].k_cache.shape
    num_slots, kvh, d = shape[0] * shape[1], shape[2], shape[3]
    write = jax.jit(functools.partial(pp.write_kv, impl=impl), donate_argnums=(0, 1))
    k_cache, v_cache = (rng.standard_normal(shape).astype(BF16) for _ in range(2))
    slots = np.array([3, num_slots, -1, num_slots - 1, num_slots + 10**6, INT32_MAX, -2,
                      INT32_MIN, 17], np.int32)
    new = rng.standard_normal((2, len(slots), kvh, d)).astype(BF16)
    new[:, slots < 0] = PAD_SENTINEL
    got = write(jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(new[0]),
                jnp.asarray(new[1]), jnp.asarray(slots))
    keep = (slots >= 0) & (slots < num_slots)
    for cache, rows, out, name in ((k_cache, new[0], got[0], "k"), (v_cache, new[1], got[1], "v")):
        expected = cache.reshape(num_slots, kvh, d).copy()
        expected[slots[keep]] = rows[keep]
        differ = (bits(out).reshape(num_slots, -1) != bits(expected).reshape(num_slots, -1))
        assert not differ.any(), f"{name}_cache slots {np.flatnonzero(differ.any(1))[:8]} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_garbage_bf16_nan_payloads_outside_the_written_slots_survive(garbage, impl):
    """Compiled: bf16 NaN payloads outside the written slots keep their bits."""
    rng = np.random.default_rng(3)
    shape = garbage["paged"].k_cache.shape
    num_slots, kvh, d = shape[0] * shape[1], shape[2], shape[3]
    raw = rng.integers(0, 2**10, shape).astype(np.uint16)
    raw.reshape(-1)[::3] = np.resize(np.array([0x7FC1, 0x7F81, 0xFFA5, 0x7FFF], np.uint16),
                                     raw.size)[::3]
    cache = jnp.asarray(raw.view(BF16))
    slots = np.array([5, 70, -1], np.int32)
    new = jnp.asarray(rng.standard_normal((3, kvh, d)).astype(BF16))
    got, _ = pp.write_kv(cache, cache, new, new, jnp.asarray(slots), impl=impl)
    untouched = np.ones(num_slots, bool)
    untouched[[5, 70]] = False
    differ = bits(got).reshape(num_slots, -1) != raw.reshape(num_slots, -1)
    assert not differ[untouched].any(), f"{int(differ[untouched].sum())} NaN-payload bits changed"


# --- huge ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HugeShape:
    name: str
    dtype: object
    num_blocks: int
    boundaries: tuple[int, ...]  # first blocks wholly past 2**31 (and 2**32) elements
    scales: tuple = ()           # fp8: (("k_scale", 0.5), ("v_scale", 0.25))
    block_size: int = 16
    kvh: int = 8
    head_dim: int = 128
    num_heads: int = 32
    width: int = 80              # max_blocks of the tables

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.kvh, self.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


_ROW = 16 * 8 * 128  # elements per block
_AT_2_31, _AT_2_32 = -(-2**31 // _ROW), -(-2**32 // _ROW)  # blocks 131072 and 262144
_FP8_SCALES = (("k_scale", 0.5), ("v_scale", 0.25))
HUGE_SHAPES = (
    HugeShape("bf16", jnp.bfloat16, 150_000, (_AT_2_31,)),
    HugeShape("fp8", jnp.float8_e4m3fn, 150_000, (_AT_2_31,), _FP8_SCALES),  # 2**31..2**32 bytes
    HugeShape("fp8_past_2_32", jnp.float8_e4m3fn, 300_000, (_AT_2_31, _AT_2_32), _FP8_SCALES),
)
HUGE_WRITES = ("xla", "pallas", None)
# the last: fp8 caches past 2**32 bytes read as u16 column pairs (no effect on bf16)
HUGE_DECODES = (("xla", None), ("pallas", None), ("pallas", C(64, 4)),
                ("pallas", C(64, 4, num_stages=5, fp8_pairs=True)))


def huge_layout(s: HugeShape, rng):
    """Tables and lengths of 4 sequences: one past the last boundary, one straddling every
    boundary and ending on the second-to-last slot of the cache, one in the last blocks, one
    empty; table tails hold +-2**31, -1 and num_blocks."""
    bs, nb, w = s.block_size, s.num_blocks, s.width
    tables = rng.choice(np.array([INT32_MAX, -1, nb, INT32_MIN]), (4, w)).astype(np.int64)
    n0 = w * 4 // 5
    tables[0, :n0] = rng.choice(np.arange(s.boundaries[-1], nb), n0, replace=False)
    edges = [b for boundary in s.boundaries for b in (boundary - 1, boundary)] + [nb - 1]
    tables[1, :len(edges)] = edges
    tables[2, :] = np.arange(nb - w, nb)[::-1]
    lens = np.array([n0 * bs - 5, len(edges) * bs - 1, w * bs, 0], np.int32)
    return tables.astype(np.int32), lens


def huge_write_slots(s: HugeShape):
    """Slots around each boundary and near the end (the very last slot stays unwritten, so a -1
    wrapping onto it would show), then padding and out-of-range slots; and how many are real."""
    bs = s.block_size
    real = [slot for boundary in s.boundaries
            for slot in (boundary * bs - 1, boundary * bs, boundary * bs + 7)]
    real += [(s.num_blocks - 10) * bs + 3, (s.num_blocks - 1) * bs, s.num_slots - 2]
    return np.array(real + [-1, s.num_slots, INT32_MAX], np.int32), len(real)


@pytest.fixture(scope="module", params=HUGE_SHAPES, ids=lambda s: s.name)
def huge(request):
    """The caches of one huge shape, filled on the device, and the state the tests share in order
    (writes first, then decodes of what they wrote)."""
    s = request.param

    @functools.partial(jax.jit, static_argnums=(1,))
    def build(key, dtype):
        return jax.random.normal(key, s.shape, jnp.bfloat16).astype(dtype)

    key = jax.random.PRNGKey(7)
    state = dict(s=s, k=build(jax.random.fold_in(key, 0), s.dtype),
                 v=build(jax.random.fold_in(key, 1), s.dtype), rng=np.random.default_rng(1))
    jax.block_until_ready((state["k"], state["v"]))
    assert state["k"].size > 2**31
    state["refuses"] = kernel_addresses_overflow(s.shape, s.dtype)
    yield state
    state.clear()


def _expect_refusal(fn, *args):
    """The kernels refuse this cache (trace time: nothing runs, nothing is donated)."""
    with pytest.raises(ValueError, match="cannot address"):
        jax.eval_shape(fn, *args)


def _uint(dtype):
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


@pytest.mark.huge
@pytest.mark.gpu
@pytest.mark.parametrize("impl", HUGE_WRITES, ids=lambda i: i or "default")
def test_huge_write(huge, impl):
    """Writes around the 2**31 and 2**32 element boundaries land bit-exact, nowhere else; the kernel
    refuses the caches it cannot address."""
    s, rng, scales = huge["s"], huge["rng"], dict(huge["s"].scales)
    slots, num_real = huge_write_slots(s)
    write = jax.jit(functools.partial(pp.write_kv, impl=impl, **scales), donate_argnums=(0, 1))
    new = (rng.standard_normal((2, len(slots), s.kvh, s.head_dim)) * 0.3).astype(
        np.float32 if scales else BF16)
    new[:, slots < 0] = PAD_SENTINEL
    args = (jnp.asarray(new[0]), jnp.asarray(new[1]), jnp.asarray(slots))
    if impl == "pallas" and huge["refuses"]:
        _expect_refusal(write, huge["k"], huge["v"], *args)
        return

    @jax.jit
    def changed_slots(after, before):
        a = jax.lax.bitcast_convert_type(after, _uint(after.dtype))
        b = jax.lax.bitcast_convert_type(before, _uint(before.dtype))
        return jnp.any((a != b).reshape(s.num_slots, -1), axis=1)

    before = (jnp.copy(huge["k"]), jnp.copy(huge["v"]))
    huge["k"], huge["v"] = write(huge["k"], huge["v"], *args)
    real = slots[:num_real]
    for i, name in enumerate(("k", "v")):
        changed = np.flatnonzero(np.asarray(changed_slots(huge[name], before[i])))
        stray = sorted(set(changed.tolist()) - set(real.tolist()))
        assert not stray, f"{name}_cache: slots {stray[:8]} changed that no token targets"
        got = np.asarray(huge[name].reshape(s.num_slots, s.kvh, s.head_dim)[jnp.asarray(real)])
        rows = new[i, :num_real]
        scale = scales.get(f"{name}_scale")
        want = bits(rows) if scale is None else oracle_quantize_fp8(rows, scale)
        differ = (bits(got) != want).any(axis=(1, 2))
        assert not differ.any(), f"{name}_cache: wrong bits at slots {real[differ].tolist()}"


@pytest.mark.huge
@pytest.mark.gpu
@pytest.mark.parametrize("run", HUGE_DECODES, ids=gpu_run_id)
def test_huge_decode(huge, run):
    """Decode of sequences living around the boundaries matches the oracle; the kernel refuses the
    caches it cannot address."""
    s, scales = huge["s"], dict(huge["s"].scales)
    rng = np.random.default_rng(11)
    tables, lens = huge_layout(s, rng)
    q = rng.standard_normal((4, s.num_heads, s.head_dim)).astype(BF16)
    impl, config = run
    fn = functools.partial(pp.decode, impl=impl, config=config, return_lse=True, **scales)
    args = (jnp.asarray(q), huge["k"], huge["v"], jnp.asarray(tables), jnp.asarray(lens))
    if impl == "pallas" and huge["refuses"]:
        _expect_refusal(fn, *args)
        return
    # The oracle indexes the device caches with the positions it reads: only those rows move.
    expected, expected_lse = oracle_paged_attention(q, huge["k"], huge["v"], tables, lens,
                                                    **scales)
    out, lse = fn(*args)
    assert_close_to_oracle(out, expected, lens, "bfloat16")
    lse, live = np.asarray(lse), lens > 0
    assert np.abs(lse[live] - expected_lse[live]).max() < 1e-3
    assert np.isneginf(lse[~live]).all(), "lse of the empty row is not -inf"


# --- determinism ---------------------------------------------------------------------------------

DETERMINISM_CALLS = 20
DETERMINISM_RUNS = [("xla", None)] + [("pallas", c) for c in (
    None, C(64, 1), C(64, 2), C(64, 4), C(32, 8), C(16, 16), C(32, 16), C(32, 32))]


@pytest.fixture(scope="module")
def mid_size():
    """B=8, 2048 tokens, bf16, H=32, KVH=8, D=128; the first sequence full, the rest random."""
    rng = np.random.default_rng(3)
    ctx, bs = 2048, 16
    lens = rng.integers(1, ctx + 1, 8)
    lens[0] = ctx
    paged = make_paged(rng, lens=lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=bs,
                       max_blocks=ctx // bs, spare_blocks=13, dtype="bfloat16")
    options = dict(logits_soft_cap=30.0, sliding_window=ctx // 2,
                   alibi_slopes=np.exp2(-8.0 * np.arange(1, 33) / 32).astype(np.float32),
                   sinks=rng.standard_normal(32).astype(np.float32))
    return paged, options


def _deterministic_and_accurate(paged, run, options):
    args = paged.jax()
    jax_options = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
                   for k, v in options.items()}
    first = gpu_decode_bits(run, args, **jax_options)
    differing = sum(not same_bits(gpu_decode_bits(run, args, **jax_options), first)
                    for _ in range(DETERMINISM_CALLS - 1))
    assert differing == 0, f"{differing} of {DETERMINISM_CALLS - 1} repeated calls differ"
    out, lse = pp.decode(*args, impl=run[0], config=run[1], return_lse=True, **jax_options)
    assert_close(reference(*paged.arrays(), **options), out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("run", DETERMINISM_RUNS, ids=gpu_run_id)
def test_determinism_decode(mid_size, run):
    """20 compiled calls per split configuration give the same bits, within the tolerance rule of the
    truth."""
    _deterministic_and_accurate(mid_size[0], run, {})


@pytest.mark.gpu
@pytest.mark.parametrize("run", [("xla", None), ("pallas", C(64, 4))], ids=gpu_run_id)
def test_determinism_decode_with_every_option(mid_size, run):
    """The same with every extension option on."""
    paged, options = mid_size
    _deterministic_and_accurate(paged, run, options)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_determinism_write(mid_size, impl):
    """20 compiled writes give the same bits."""
    paged = mid_size[0]
    rng = np.random.default_rng(4)
    num_slots = paged.k_cache.shape[0] * paged.k_cache.shape[1]
    slots = rng.choice(num_slots, 11, replace=False).astype(np.int32)
    slots[-2:] = -1
    new = rng.standard_normal((2, 11, *paged.k_cache.shape[2:])).astype(BF16)
    write = jax.jit(functools.partial(pp.write_kv, impl=impl))
    inputs = (jnp.asarray(paged.k_cache), jnp.asarray(paged.v_cache), jnp.asarray(new[0]),
              jnp.asarray(new[1]), jnp.asarray(slots))
    first = [bits(x) for x in write(*inputs)]
    for _ in range(DETERMINISM_CALLS - 1):
        for again, want in zip(write(*inputs), first):
            np.testing.assert_array_equal(bits(again), want)


# --- the garbage cases under compute-sanitizer ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                    reason="compute-sanitizer is not on PATH")
@pytest.mark.skipif(os.environ.get(UNDER_SANITIZER) == "1", reason="already under the sanitizer")
def test_memcheck_reports_no_error():
    """The garbage tests that could make our kernels address memory out of bounds (table tails of
    +-2**31, lengths out of range), compiled, under compute-sanitizer memcheck (XLA's own kernels
    left out: memcheck makes every launch slow)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_PYTHON_CLIENT_ALLOCATOR="platform", PYTHONPATH=root,
               XLA_PYTHON_CLIENT_PREALLOCATE="false", **{UNDER_SANITIZER: "1"})
    cmd = ["compute-sanitizer", "--tool", "memcheck", "--target-processes", "all",
           sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-m", "gpu", "-k", MEMCHECK_SELECTION, os.path.abspath(__file__)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-4000:]
    assert " passed" in log and " failed" not in log, log[-4000:]


# --- from the extension options: values that overflow a careless kernel --------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_soft_cap_does_not_overflow(rng, impl):
    """Scores of order 1e4 / sqrt(32) under a soft-cap of 5: tanh written so that it cannot
    overflow (no ``exp(x) / exp(x)``), the truth within the tolerance rule."""
    p = make_paged(rng, lens=[12, 3], block_size=4)
    p.q *= 1e4
    out, lse = pp.decode(*p.jax(), impl=impl, logits_soft_cap=5.0, return_lse=True)
    assert np.isfinite(np.asarray(out)).all()
    assert_close(reference(*p.arrays(), logits_soft_cap=5.0), out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    C(block_k=16, num_splits=2, num_warps=1, fp8_pairs=True),
    C(block_k=64, num_splits=2, num_warps=2, num_stages=5, fp8_pairs=True),
    C(block_k=128, num_splits=1, num_warps=4, num_stages=5, fp8_pairs=True),
    C(block_k=32, num_splits=3, num_warps=8, fp8_pairs=True, merge_in_kernel=True),
    C(block_k=64, num_warps=4, num_stages=5, fp8_pairs=True, persistent_programs=6),
], ids=["bk16_w1", "bk64_w2_st5", "bk128_w4_st5", "bk32_w8_merged", "bk64_w4_st5_p3"])
@pytest.mark.parametrize("head_dim", [128, 40])
def test_fp8_pairs_every_byte_value_compiled(rng, config, head_dim):
    """The compiled decode kernel's fp8 column pairs (two words per conversion) with every fp8
    byte value in the caches (NaN aside: a NaN anywhere makes its rows NaN): the truth within
    the tolerance rule."""
    p = make_paged(rng, lens=[300, 7, 0, 129], num_heads=8, num_kv_heads=2, block_size=16,
                   dtype=FP8, head_dim=head_dim)
    every = np.arange(256, dtype=np.uint8)
    every = every[(every & 0x7F) != 0x7F].view(jnp.float8_e4m3fn)  # the two NaNs left out
    for cache in (p.k_cache, p.v_cache):
        flat = cache.reshape(-1)
        flat[:] = np.resize(every, flat.shape)
    scales = dict(k_scale=2.0 ** -8, v_scale=2.0 ** -8)
    out, lse = pp.decode(*p.jax(), impl="pallas", config=config, return_lse=True, **scales)
    assert_close(reference(*p.arrays(), **scales), out, lse)

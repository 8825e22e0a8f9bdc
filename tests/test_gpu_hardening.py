"""Hardening on a GPU, compiled kernels only: garbage inputs, caches past 2**31 elements,
determinism at a serving-like size, and the garbage cases again under CUDA's memory checker.

Every test here is marked ``gpu`` (skipped without one). On the GPU machine::

    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -o addopts="" -m gpu \\
        tests/test_gpu_hardening.py

- garbage (``-k garbage``): table tails of +-2**31, out-of-range ids in the valid part of a table
  (clamped), ids wholly before a sliding window, lengths out of range (clamped), slots out of range
  (dropped) and bf16 NaN payloads outside the written slots, compared bit for bit with the clean
  / clamped / expected results. test_hardening.py runs the same classes on CPU (interpret mode);
  here they run through the compiled kernels, with block_k 64 (20 tokens < one tile: masked pages).
- huge (``-k huge``): caches of 150,000 x 16 x 8 x 128 (> 2**31 elements) in bf16 and fp8 and of
  300,000 blocks in fp8 (> 2**32 elements). Tokens are written at the blocks on both sides of each
  boundary and near the end, with both write impls (donated) and the default, and the sequences
  living there are decoded with both impls and compared with the float64 oracle. Pallas' Triton
  lowering switches to 64-bit offsets only above 2**32 *bytes*, so the 150,000-block fp8 cache
  (2**31..2**32 one-byte elements) must be refused by our kernels (ValueError) and served by the
  XLA paths; the 300,000-block one runs the kernels past both boundaries.
- determinism (``-k determinism``): 20 calls per split configuration at B=8, 2048 tokens, bf16,
  H=32, KVH=8, D=128 (and XLA and one split config with every option), bit-identical, and
  within test_decode's tolerance of the float64 oracle; both writes, 20 calls each.
- memcheck: the garbage tests of the kernels' addressing (``MEMCHECK_SELECTION``) in a subprocess
  under ``compute-sanitizer --tool memcheck`` (with the platform allocator, so that every buffer is
  its own allocation and memcheck sees its bounds);
  skipped when compute-sanitizer is not on PATH.
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

import pallas_paged as pp
from pallas_paged._platform import kernel_addresses_overflow
from pallas_paged import _mosaic_common
from pallas_paged.decode_attention import mosaic_gpu
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
from oracle import oracle_paged_attention, oracle_quantize_fp8
from paged_inputs import NP_DTYPES, bits, make_paged
from test_decode import ATOL

pytestmark = pytest.mark.gpu

C = pp.DecodeConfig
BF16, FP8 = NP_DTYPES["bfloat16"], NP_DTYPES["float8_e4m3fn"]
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31
PAD_SENTINEL = 1000.0  # the rows of padding tokens: must never land in a cache
UNDER_SANITIZER = "PALLAS_PAGED_UNDER_SANITIZER"
MEMCHECK_SELECTION = "garbage and (table_tails or lengths) and not xla"


def run_id(run) -> str:
    impl, config = run
    if impl == "xla":
        return "xla"
    if config is None:
        return f"{impl}_default"
    merged = "_merged" if getattr(config, "merge_in_kernel", False) else ""
    pairs = "_pairs" if getattr(config, "fp8_pairs", False) else ""
    return f"{impl}_bk{config.block_k}_s{config.num_splits}{merged}{pairs}"


def decode_bits(run, args, **options):
    """Raw bits of ``(out, lse)`` of one decode call (NaN == NaN in comparisons)."""
    impl, config = run
    out, lse = pp.decode(*args, impl=impl, config=config, return_lse=True, **options)
    return bits(out), bits(lse)


def same_bits(got, want) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(got, want))


def assert_same_bits(got, want, what: str):
    for x, y, part in ((got[0], want[0], "out"), (got[1], want[1], "lse")):
        differ = int((x != y).sum())
        assert differ == 0, f"{what}: {differ} {part} elements differ"


def assert_close_to_oracle(out, expected, lens, q_dtype: str) -> float:
    """Finite; zeros for empty rows; per row ``max|out - oracle| <= ATOL * max(1, max|oracle row|)``.
    Returns the largest error."""
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    empty = np.asarray(lens) <= 0
    assert (got[empty] == 0).all(), "a zero-length row is not zero"
    err = np.abs(got - expected).max(axis=(1, 2))
    bound = ATOL[q_dtype] * np.maximum(1.0, np.abs(expected).max(axis=(1, 2)))
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
GARBAGE_RUNS = [("xla", None), ("pallas", C(64, 1)), ("pallas", C(16, 3)),
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


@pytest.mark.parametrize("run", GARBAGE_RUNS, ids=run_id)
def test_garbage_table_tails_are_never_read(garbage, run):
    g = garbage
    clean_tables = np.where(g["used"], g["paged"].block_tables, 0)
    clean = decode_bits(run, _garbage_args(g, clean_tables), **g["options"])
    for junk in (INT32_MAX, INT32_MIN, g["num_blocks"], g["num_blocks"] + 12345, -1):
        tables = np.where(g["used"], g["paged"].block_tables, junk)
        assert_same_bits(decode_bits(run, _garbage_args(g, tables), **g["options"]), clean,
                         f"tail {junk}")


@pytest.mark.parametrize("run", GARBAGE_RUNS, ids=run_id)
def test_garbage_ids_in_the_valid_part_are_clamped(garbage, run):
    g = garbage
    bad = g["paged"].block_tables.copy()
    bad[0, [0, 3, 7]] = [INT32_MAX, INT32_MIN, g["num_blocks"]]
    bad[1, 1] = -1
    bad[3, 0] = g["num_blocks"] + 999
    clamped = np.clip(bad, 0, g["num_blocks"] - 1)
    assert_same_bits(decode_bits(run, _garbage_args(g, bad), **g["options"]),
                     decode_bits(run, _garbage_args(g, clamped), **g["options"]), "clamped ids")


@pytest.mark.parametrize("run", GARBAGE_RUNS, ids=run_id)
def test_garbage_ids_before_the_window_are_never_read(garbage, run):
    g = garbage
    bad = g["paged"].block_tables.copy()
    for row, n in enumerate(GARBAGE_LENS):
        bad[row, :max(0, n - GARBAGE_OPTIONS["sliding_window"]) // GARBAGE_BS] = INT32_MIN
    assert_same_bits(decode_bits(run, _garbage_args(g, bad), **g["options"]),
                     decode_bits(run, _garbage_args(g), **g["options"]), "ids before the window")


@pytest.mark.parametrize("run", GARBAGE_RUNS, ids=run_id)
def test_garbage_lengths_are_clamped(garbage, run):
    g = garbage
    tables = np.clip(g["paged"].block_tables, 0, g["num_blocks"] - 1)  # read at full length
    full = [GARBAGE_CAPACITY, 0, GARBAGE_CAPACITY, 0]
    bad = [GARBAGE_CAPACITY + 1, -1, INT32_MAX, INT32_MIN]
    assert_same_bits(decode_bits(run, _garbage_args(g, tables, bad), **g["options"]),
                     decode_bits(run, _garbage_args(g, tables, full), **g["options"]),
                     "clamped lengths")


@pytest.mark.parametrize("config", [C(32, 2), C(32, 2, fp8_v_at_load=True),
                                    C(64, 2, num_stages=5, fp8_pairs=True)],
                         ids=["v_in_operand_read", "v_at_load", "pairs"])
def test_garbage_fp8_table_tails_are_never_read(garbage, config):
    g = garbage
    rng = np.random.default_rng(1)
    k8 = rng.standard_normal(g["paged"].k_cache.shape).astype(FP8)
    v8 = rng.standard_normal(g["paged"].k_cache.shape).astype(FP8)
    run, scales = ("pallas", config), dict(k_scale=0.5, v_scale=0.25)
    clean_tables = np.where(g["used"], g["paged"].block_tables, 0)
    clean = decode_bits(run, g["paged"].jax(k_cache=k8, v_cache=v8, block_tables=clean_tables),
                        **scales)
    bad = np.where(g["used"], g["paged"].block_tables, INT32_MAX)
    assert_same_bits(decode_bits(run, g["paged"].jax(k_cache=k8, v_cache=v8, block_tables=bad),
                                 **scales), clean, "fp8 tails")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_garbage_slots_out_of_range_are_dropped_under_jit(garbage, impl):
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


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_garbage_bf16_nan_payloads_outside_the_written_slots_survive(garbage, impl):
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


@pytest.mark.parametrize("impl", HUGE_WRITES, ids=lambda i: i or "default")
def test_huge_write(huge, impl):
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


@pytest.mark.parametrize("run", HUGE_DECODES, ids=run_id)
def test_huge_decode(huge, run):
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
    first = decode_bits(run, args, **jax_options)
    differing = sum(not same_bits(decode_bits(run, args, **jax_options), first)
                    for _ in range(DETERMINISM_CALLS - 1))
    assert differing == 0, f"{differing} of {DETERMINISM_CALLS - 1} repeated calls differ"
    expected, _ = oracle_paged_attention(paged.q, paged.k_cache, paged.v_cache,
                                         paged.block_tables, paged.context_lens, **options)
    out = pp.decode(*args, impl=run[0], config=run[1], **jax_options)
    assert_close_to_oracle(out, expected, paged.context_lens, "bfloat16")


@pytest.mark.parametrize("run", DETERMINISM_RUNS, ids=run_id)
def test_determinism_decode(mid_size, run):
    _deterministic_and_accurate(mid_size[0], run, {})


@pytest.mark.parametrize("run", [("xla", None), ("pallas", C(64, 4))], ids=run_id)
def test_determinism_decode_with_every_option(mid_size, run):
    paged, options = mid_size
    _deterministic_and_accurate(paged, run, options)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_determinism_write(mid_size, impl):
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

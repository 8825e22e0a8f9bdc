"""Property tests (hypothesis): on random inputs every implementation agrees with `torch_ref`.

What is random and what is not. Interpret-mode compilation costs seconds per static shape, so the
*static* part of an example (shapes, dtypes, block size, GQA ratio, the static options soft-cap,
sliding window, scale, fp8 scales and ``return_lse``, and the kernel configs) comes from a short
list of named buckets, one pytest case each; every example after a bucket's first reuses compiled
code. Everything else is drawn per example: the context lengths (0 to the table's capacity, edges
favoured), the block layout (a permutation with spare blocks, or physical blocks shared between
sequences and within one table), table-tail garbage (huge, negative, just past the end, stale
ids), the poison in unused slots (NaN, +-Inf, 1e4, 0) and, with a sliding window, in the valid
positions outside it, lengths beyond the capacity or negative (JAX only: jit clamps them; torch_ref
gets the clamped values), the magnitudes of q, V, the ALiBi slopes and the sinks, slot mappings
with padding and out-of-range slots, raw-bit cache contents, fp8 rounding ties and saturation, and
all the data (a numpy generator seeded by hypothesis).

Properties:

- decode: `pallas_paged.decode`, impl="xla" and impl="pallas" with each of the bucket's configs,
  matches the float64 truth within the tolerance rule (`paged_inputs.assert_close`: out and lse);
  outputs are finite; zero-length rows are exactly 0 (lse ``-inf``). Out-of-range lengths reach
  JAX unchecked (``check_values=False``, what ``jax.jit`` runs), the truth sees them clamped.
- write: `pallas_paged.write_kv` (both impls, unchecked) leaves the caches `torch_ref.write_kv`
  leaves, bit for bit (raw bits, so NaN == NaN), where out-of-range slots (dropped under jit) are
  passed to torch_ref as ``-1``.
- step: the runner's step, write then decode in one ``jax.jit`` with donated caches, equals
  torch_ref's write then decode (caches bit for bit, output within the tolerance rule).

Every test here is marked ``slow`` (``make test-all`` runs them; ``make test`` leaves them out).

Hypothesis profiles: a bounded CI run, a long soak. ``PALLAS_PAGED_HYPOTHESIS_PROFILE`` picks one
(default ``ci``):

- ``ci``: a few examples per static shape, derandomized (the same examples on every run, so CI
  is stable), about two minutes for the whole file on a 2-core CPU;
- ``long``: 10,000 examples in all, freshly random on every run (a soak; a failure prints the
  seed blob to reproduce it with ``@reproduce_failure``).

The profiles are registered, not loaded: the tests here take `PROFILE` as the parent of their own
``@settings``, so other test files keep hypothesis's defaults whichever profile is selected.
`EXAMPLES` gives each property test its example count *per static shape bucket*; the totals are
``EXAMPLES[kind] * len(buckets of that kind)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_paged as pp
import torch_ref
from paged_inputs import NP_DTYPES, assert_close, bits, reference, to_numpy, to_torch
from parity.cases import Case, make_inputs
from parity.layout import paged_layout

pytestmark = pytest.mark.slow
C = pp.DecodeConfig

# --- hypothesis profiles -----------------------------------------------------------------------

ENV_VAR = "PALLAS_PAGED_HYPOTHESIS_PROFILE"
_COMMON = dict(
    deadline=None,  # the first example of a bucket compiles (seconds); the rest take milliseconds
    database=None,  # no example database: a run depends on the profile alone
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("pallas-paged-ci", derandomize=True, **_COMMON)
settings.register_profile("pallas-paged-long", derandomize=False, **_COMMON)
# Examples per static bucket, by property. long: 600 * 10 decode buckets + 500 * 6 write buckets
# + 250 * 4 step buckets = 6,000 + 3,000 + 1,000 = 10,000 examples.
_EXAMPLES = {
    "ci": {"decode": 30, "write": 50, "step": 15},
    "long": {"decode": 600, "write": 500, "step": 250},
}
PROFILE_NAME = os.environ.get(ENV_VAR, "ci").strip() or "ci"
if PROFILE_NAME not in _EXAMPLES:
    raise ValueError(f"{ENV_VAR}={PROFILE_NAME!r} must be one of {sorted(_EXAMPLES)}")
PROFILE = settings.get_profile(f"pallas-paged-{PROFILE_NAME}")
EXAMPLES = _EXAMPLES[PROFILE_NAME]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch_ref's many tiny CPU ops are several times faster on one thread on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- checks shared by the properties ---------------------------------------------------------

def check_decode(label, got, ref, got_lse=None):
    """``got`` (any array) against the truth of `paged_inputs.reference`: finite, zero-length rows
    exactly 0 (lse -inf), the tolerance rule for out and lse."""
    got_np = to_numpy(got).astype(np.float32)
    finite = np.isfinite(got_np).all(axis=(1, 2))
    assert finite.all(), f"{label}: NaN or Inf in rows {np.flatnonzero(~finite)}"
    assert_close(ref, got, got_lse, what=label)


def _jnp_or_none(x):
    return None if x is None else jnp.asarray(x)


# --- decode -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static shape every example of a bucket shares (a new one would make jit compile)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    max_blocks: int
    batch: int
    dtype: str

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.block_size


@dataclasses.dataclass(frozen=True)
class DecodeBucket(Bucket):
    """The static part of a decode example: everything that would make jit compile again."""

    q_dtype: str | None = None  # None: the cache dtype (bf16 for an fp8 cache)
    spare_blocks: int = 3
    scale: float | None = None
    logits_soft_cap: float | None = None
    sliding_window: int | None = None
    alibi: bool = False
    sinks: bool = False
    k_scale: float | None = None
    v_scale: float | None = None
    return_lse: bool = False
    configs: tuple = (None,)  # the Pallas kernel runs once per config; None: the tuned default
    index_dtype: str = "int32"  # of block_tables and context_lens

    @property
    def num_blocks(self) -> int:
        return self.batch * self.max_blocks + self.spare_blocks

    @property
    def out_dtype(self) -> str:
        if self.q_dtype is not None:
            return self.q_dtype
        return "bfloat16" if self.dtype == "float8_e4m3fn" else self.dtype

    def static_options(self) -> dict:
        return dict(logits_soft_cap=self.logits_soft_cap, sliding_window=self.sliding_window,
                    k_scale=self.k_scale, v_scale=self.v_scale)


# GQA ratios 1, 2, 3, 4, 8 and MQA; block sizes 1, 2, 3, 5, 7, 12, 16; head_dim 32 / 64 / 80 / 128;
# fp32 / bf16 / fp16 caches and fp8 caches read with bf16, fp16 and fp32 queries; every option;
# splits 1, 2, 3, 8 with block_k 16 and 32, and the default config.
DECODE_BUCKETS = (
    DecodeBucket("mha_fp32_bs16", 4, 4, 32, 16, 4, 4, "float32", configs=(None, C(16, 3))),
    DecodeBucket("gqa2_bf16_bs1_lse", 4, 2, 64, 1, 24, 3, "bfloat16", return_lse=True,
                 configs=(C(16, 1), C(32, 2))),
    DecodeBucket("gqa3_fp16_d80_bs5_softcap_alibi", 6, 2, 80, 5, 8, 4, "float16",
                 logits_soft_cap=5.0, alibi=True, configs=(C(16, 8),)),
    DecodeBucket("gqa8_bf16_bs3_window_sinks_lse", 16, 2, 32, 3, 12, 3, "bfloat16",
                 sliding_window=7, sinks=True, return_lse=True, configs=(C(16, 2), C(32, 8))),
    DecodeBucket("mqa_fp32_bs12_all", 8, 1, 64, 12, 4, 5, "float32", scale=0.2,
                 logits_soft_cap=2.0, sliding_window=20, alibi=True, sinks=True, return_lse=True,
                 configs=(C(16, 1), C(16, 3))),
    DecodeBucket("mqa_fp16_bs7_int64", 4, 1, 32, 7, 6, 4, "float16", configs=(None, C(32, 2)),
                 index_dtype="int64"),
    DecodeBucket("gqa2_bf16_d128_bs16_softcap", 8, 4, 128, 16, 3, 2, "bfloat16", scale=1.0,
                 logits_soft_cap=30.0, configs=(C(16, 2),)),
    DecodeBucket("fp8_bf16q_gqa4_bs16_lse", 8, 2, 64, 16, 3, 4, "float8_e4m3fn", k_scale=0.5,
                 v_scale=2.0, return_lse=True, configs=(C(16, 1), C(16, 3))),
    DecodeBucket("fp8_fp16q_gqa3_bs5_all", 6, 2, 32, 5, 8, 3, "float8_e4m3fn", q_dtype="float16",
                 k_scale=0.25, v_scale=0.75, logits_soft_cap=3.0, sliding_window=9, alibi=True,
                 sinks=True, return_lse=True, configs=(C(16, 8),)),
    DecodeBucket("fp8_fp32q_mha_bs2_window", 4, 4, 32, 2, 10, 3, "float8_e4m3fn",
                 q_dtype="float32", k_scale=0.125, v_scale=1.5, sliding_window=3,
                 configs=(C(32, 1),)),
)

# Table-tail garbage, by kind; a row's tail mixes the kinds an example draws.
TAIL_KINDS = ("stale", "minus_one", "negative", "int32_min", "int32_max", "huge", "end", "past_end")
FILLS = (math.nan, math.inf, -math.inf, 1e4, 0.0)


def tail_ids(kind: str, rng: np.random.Generator, shape, num_blocks: int) -> np.ndarray:
    constant = {"minus_one": -1, "negative": -7, "int32_min": -2**31, "int32_max": 2**31 - 1,
                "huge": 2**30, "end": num_blocks}
    if kind == "stale":  # a real block of someone else: reading it would look plausible
        return rng.integers(0, num_blocks, shape)
    if kind == "past_end":
        return num_blocks + 1 + rng.integers(0, 1000, shape)
    return np.full(shape, constant[kind], np.int64)


@dataclasses.dataclass(frozen=True)
class DecodeDraw:
    """The random part of a decode example (compact, so a failing example prints readably)."""

    lens: tuple[int, ...]
    shared_blocks: bool
    tail_kinds: tuple[str, ...]
    fill: float
    q_mult: float
    v_mult: float
    slope_mult: float
    sink_mult: float
    poison_outside_window: bool
    lens_out_of_range: bool  # JAX sees full rows as longer than capacity and empty rows as < 0
    seed: int


def lengths(capacity: int, block_size: int, batch: int):
    edges = sorted({n for n in (0, 1, block_size - 1, block_size, block_size + 1, capacity - 1,
                                capacity) if 0 <= n <= capacity})
    length = st.one_of(st.sampled_from(edges), st.integers(0, capacity))
    return st.lists(length, min_size=batch, max_size=batch).map(tuple)


def decode_draws(bucket: DecodeBucket):
    return st.builds(
        DecodeDraw,
        lens=lengths(bucket.capacity, bucket.block_size, bucket.batch),
        shared_blocks=st.booleans(),
        tail_kinds=st.lists(st.sampled_from(TAIL_KINDS), min_size=1, max_size=4,
                            unique=True).map(tuple),
        fill=st.sampled_from(FILLS),
        q_mult=st.sampled_from((1.0, 0.0, 0.3, 4.0, 16.0)),
        v_mult=st.sampled_from((1.0, 0.01, 8.0)),
        slope_mult=st.sampled_from((1.0, 0.0, 0.25, 4.0)),
        sink_mult=st.sampled_from((1.0, 0.0, 10.0, 40.0)),
        poison_outside_window=st.booleans(),
        lens_out_of_range=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )


def sequence_slots(tables, lens, block_size, window=None):
    """Per sequence, the flat slots of the positions that take part (all of ``[0, n)``, or the
    newest ``min(W, n)`` with a window)."""
    out = []
    for row, n in zip(tables, lens):
        pos = np.arange(max(0, n - window) if window is not None else 0, n)
        out.append(row[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return out


def build_decode(bucket: DecodeBucket, draw: DecodeDraw) -> dict:
    """The numpy arrays of one decode example."""
    rng = np.random.default_rng(draw.seed)
    b, h, kvh, d = bucket.batch, bucket.num_heads, bucket.num_kv_heads, bucket.head_dim
    bs, width, num_blocks = bucket.block_size, bucket.max_blocks, bucket.num_blocks
    lens = np.asarray(draw.lens, np.int32)
    pages = -(-lens // bs)
    if draw.shared_blocks:  # prefix sharing, or worse: any block may appear in several rows
        tables = rng.integers(0, num_blocks, (b, width))
    else:  # each row owns its blocks; the spare ones lie among them
        tables = paged_layout(rng, lens, block_size=bs, table_width=width,
                              spare_blocks=num_blocks - int(pages.sum()), tail=(0,)).block_tables
    kind = rng.integers(0, len(draw.tail_kinds), (b, width))
    garbage = np.zeros((b, width), np.int64)
    for i, name in enumerate(draw.tail_kinds):
        garbage = np.where(kind == i, tail_ids(name, rng, (b, width), num_blocks), garbage)
    used = np.arange(width)[None, :] < pages[:, None]
    tables = np.where(used, tables, garbage).astype(np.int32)

    window = bucket.sliding_window if draw.poison_outside_window else None
    keep = np.zeros(num_blocks * bs, bool)  # slots whose value may reach the output
    for slots in sequence_slots(tables, lens, bs, window):
        keep[slots] = True
    kv = rng.standard_normal((2, num_blocks * bs, kvh, d), dtype=np.float32)
    kv[1] *= draw.v_mult
    kv[:, ~keep] = draw.fill  # unused slots, and valid slots outside the window
    shape = (num_blocks, bs, kvh, d)
    with np.errstate(invalid="ignore", over="ignore"):
        k_cache, v_cache = (x.reshape(shape).astype(NP_DTYPES[bucket.dtype]) for x in kv)
    q = (rng.standard_normal((b, h, d), dtype=np.float32) * draw.q_mult)
    alibi = sinks = None
    if bucket.alibi:
        alibi = (np.exp2(-8.0 * np.arange(1, h + 1) / h) * draw.slope_mult).astype(np.float32)
    if bucket.sinks:
        sinks = (rng.standard_normal(h) * draw.sink_mult).astype(np.float32)
    jax_lens = lens.astype(np.int64)
    if draw.lens_out_of_range:  # under jit lengths are clamped into [0, capacity]
        full, empty = lens == bucket.capacity, lens == 0
        jax_lens[full] += rng.integers(1, 2**30, int(full.sum()))
        jax_lens[empty] -= rng.integers(1, 2**31, int(empty.sum()))
    index = np.dtype(bucket.index_dtype)
    return dict(q=q.astype(NP_DTYPES[bucket.out_dtype]), k_cache=k_cache, v_cache=v_cache,
                tables=tables.astype(index), lens=lens.astype(index),
                jax_lens=jax_lens.astype(index), alibi_slopes=alibi, sinks=sinks)


@pytest.mark.parametrize("bucket", DECODE_BUCKETS, ids=lambda b: b.name)
@settings(PROFILE, max_examples=EXAMPLES["decode"])
@given(data=st.data())
def test_decode_matches_the_truth(bucket, data):
    """Every impl and config of the bucket on random layouts, lengths, poisons and magnitudes."""
    draw = data.draw(decode_draws(bucket), label="draw")
    x = build_decode(bucket, draw)
    options = bucket.static_options()
    ref = reference(x["q"], x["k_cache"], x["v_cache"], x["tables"], x["lens"], bucket.scale,
                    alibi_slopes=x["alibi_slopes"], sinks=x["sinks"], **options)
    args = [jnp.asarray(x[n]) for n in ("q", "k_cache", "v_cache", "tables", "jax_lens")]
    arrays = dict(alibi_slopes=_jnp_or_none(x["alibi_slopes"]), sinks=_jnp_or_none(x["sinks"]))
    runs = [("xla", None)] + [("pallas", config) for config in bucket.configs]
    for impl, config in runs:
        out = pp.decode(*args, bucket.scale, impl=impl, config=config, check_values=False,
                        return_lse=bucket.return_lse, **arrays, **options)
        out, lse = out if bucket.return_lse else (out, None)
        assert out.dtype == jnp.dtype(bucket.out_dtype)
        check_decode(f"{impl} {config}", out, ref, lse)


# --- write --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WriteBucket:
    name: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    dtype: str
    new_dtype: str | None = None  # the new tokens' dtype for an fp8 cache
    k_scale: float | None = None
    v_scale: float | None = None
    slot_dtype: str = "int32"

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def scales(self) -> dict:
        return {} if self.k_scale is None else dict(k_scale=self.k_scale, v_scale=self.v_scale)


WRITE_BUCKETS = (
    WriteBucket("fp32_bs16", 8, 16, 2, 32, 9, "float32"),
    WriteBucket("bf16_bs1_int64_slots", 40, 1, 1, 64, 7, "bfloat16", slot_dtype="int64"),
    WriteBucket("fp16_bs5_kvh3_d80", 9, 5, 3, 80, 12, "float16"),
    WriteBucket("fp8_from_fp32_bs16", 6, 16, 2, 32, 5, "float8_e4m3fn", "float32", 0.5, 0.25),
    WriteBucket("fp8_from_bf16_bs3", 10, 3, 4, 16, 16, "float8_e4m3fn", "bfloat16", 1 / 64, 0.02),
    WriteBucket("fp8_from_fp16_bs7_int64_slots", 5, 7, 1, 128, 3, "float8_e4m3fn", "float16", 2.0,
                0.3, slot_dtype="int64"),
)

# What a token that is not written carries as its slot: padding, or a value jit drops.
NOT_WRITTEN = ("pad", "end", "past_end", "minus_two", "int32_min", "int32_max")


@dataclasses.dataclass(frozen=True)
class WriteDraw:
    num_real: int
    not_written: tuple[str, ...]
    magnitude: float  # fp8: the new values' scale, as a multiple of the cache scale
    specials: bool  # fp8: sprinkle 0, -0, +-Inf, NaN, rounding ties and subnormals
    seed: int


def write_draws(bucket: WriteBucket):
    return st.builds(
        WriteDraw,
        num_real=st.integers(0, min(bucket.num_tokens, bucket.num_slots)),
        not_written=st.lists(st.sampled_from(NOT_WRITTEN), min_size=1, max_size=3,
                             unique=True).map(tuple),
        magnitude=st.sampled_from((1.0, 16.0, 448.0, 1e4)),
        specials=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_FP8_POSITIVE = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
FP8_TIES = (_FP8_POSITIVE[:-1] + _FP8_POSITIVE[1:]) / 2  # halfway between neighbours: ties to even


def random_bits(rng, shape, dtype: str) -> np.ndarray:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, subnormals, -0, Inf included).

    bf16 NaNs are canonicalized (sign kept): XLA's CPU scatter rewrites bf16 NaN payloads, which
    test_hardening.py covers separately.
    """
    np_dtype = np.dtype(NP_DTYPES[dtype])
    uint = _UINT[np_dtype.itemsize]
    raw = rng.integers(0, np.iinfo(uint).max, shape, dtype=uint, endpoint=True)
    if dtype == "bfloat16":
        nan = (raw & 0x7F80) == 0x7F80
        nan &= (raw & 0x7F) != 0
        raw = np.where(nan, (raw & 0x8000) | 0x7FC0, raw).astype(uint)
    return raw.view(np_dtype)


def fp8_inputs(rng, shape, dtype: str, scale: float, draw: WriteDraw) -> np.ndarray:
    """New tokens for an fp8 cache: ~N(0, magnitude * scale), saturating past 448 * scale."""
    x = rng.standard_normal(shape) * (draw.magnitude * scale)
    if draw.specials:
        pick = rng.random(shape)
        ties = rng.choice(FP8_TIES, shape) * scale * rng.choice([-1.0, 1.0], shape)
        x = np.where(pick < 0.2, ties, x)
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -449.0 * scale,
                             448.0 * scale])
        x = np.where(pick > 0.9, rng.choice(specials, shape), x)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(NP_DTYPES[dtype])


def build_write(bucket: WriteBucket, draw: WriteDraw) -> dict:
    rng = np.random.default_rng(draw.seed)
    n, num_slots = bucket.num_tokens, bucket.num_slots
    shape = (bucket.num_blocks, bucket.block_size, bucket.num_kv_heads, bucket.head_dim)
    others = {"pad": lambda: -1, "end": lambda: num_slots,
              "past_end": lambda: num_slots + 1 + int(rng.integers(0, 10**6)),
              "minus_two": lambda: -2, "int32_min": lambda: -2**31, "int32_max": lambda: 2**31 - 1}
    real = rng.choice(num_slots, draw.num_real, replace=False)
    fake = [others[draw.not_written[int(rng.integers(len(draw.not_written)))]]()
            for _ in range(n - draw.num_real)]
    slots = rng.permutation(np.concatenate([real, np.asarray(fake, np.int64)]))
    slots = slots.astype(bucket.slot_dtype)
    new_shape = (n, bucket.num_kv_heads, bucket.head_dim)
    if bucket.dtype == "float8_e4m3fn":
        k = fp8_inputs(rng, new_shape, bucket.new_dtype, bucket.k_scale, draw)
        v = fp8_inputs(rng, new_shape, bucket.new_dtype, bucket.v_scale, draw)
    else:
        k, v = (random_bits(rng, new_shape, bucket.dtype) for _ in range(2))
    return dict(k_cache=random_bits(rng, shape, bucket.dtype),
                v_cache=random_bits(rng, shape, bucket.dtype), k=k, v=v, slots=slots,
                # what jit does with an out-of-range slot (drop it) is torch_ref's -1
                torch_slots=np.where((slots >= 0) & (slots < num_slots), slots, -1))


def torch_write(x: dict, **scales):
    k_cache, v_cache = to_torch(x["k_cache"].copy()), to_torch(x["v_cache"].copy())
    torch_ref.write_kv(k_cache, v_cache, to_torch(x["k"]), to_torch(x["v"]),
                       torch.from_numpy(x["torch_slots"]), **scales)
    return bits(k_cache), bits(v_cache)


@pytest.mark.parametrize("bucket", WRITE_BUCKETS, ids=lambda b: b.name)
@settings(PROFILE, max_examples=EXAMPLES["write"])
@given(data=st.data())
def test_write_is_bit_exact(bucket, data):
    """Random slots (padding and out of range among them), raw-bit caches, fp8 ties and saturation:
    both impls leave torch_ref's caches, bit for bit."""
    draw = data.draw(write_draws(bucket), label="draw")
    x = build_write(bucket, draw)
    expected_k, expected_v = torch_write(x, **bucket.scales())
    args = [jnp.asarray(x[n]) for n in ("k_cache", "v_cache", "k", "v", "slots")]
    for impl in ("xla", "pallas"):
        got_k, got_v = pp.write_kv(*args, impl=impl, check_values=False, **bucket.scales())
        for name, got, expected in (("k_cache", got_k, expected_k), ("v_cache", got_v, expected_v)):
            diff = bits(got) != expected
            assert not diff.any(), (f"{impl}: {name} differs at {np.argwhere(diff)[:5].tolist()}"
                                    f" (slots {x['slots'].tolist()})")


# --- the runner's step: write, then decode, in one jit with donated caches -----------------------

@dataclasses.dataclass(frozen=True)
class StepBucket(Bucket):
    combos: tuple  # (write impl, decode impl) pairs
    padding_tokens: int = 2
    spare_blocks: int = 2
    k_scale: float | None = None
    v_scale: float | None = None
    logits_soft_cap: float | None = None
    sliding_window: int | None = None
    alibi: bool = False
    sinks: bool = False
    return_lse: bool = False
    config: pp.DecodeConfig | None = None

    def case(self, lens: tuple[int, ...], seed: int) -> Case:
        """A parity `Case` whose block count and token count do not depend on ``lens``."""
        bs = self.block_size
        pages = sum(-(-n // bs) for n in lens)
        num_real = sum(1 for n in lens if n > 0)
        return Case(
            name=self.name, batch=self.batch, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=bs,
            spare_blocks=self.batch * self.max_blocks + self.spare_blocks - pages,
            dtype=self.dtype, lengths=lens, max_blocks=self.max_blocks, seed=seed,
            logits_soft_cap=self.logits_soft_cap, alibi=self.alibi,
            sliding_window=self.sliding_window, sinks=self.sinks, k_scale=self.k_scale,
            v_scale=self.v_scale, return_lse=self.return_lse,
            padding_tokens=self.batch + self.padding_tokens - num_real)


STEP_BUCKETS = (
    StepBucket("bf16_gqa4_bs16", 8, 2, 64, 16, 3, 4, "bfloat16",
               combos=(("xla", "pallas"), ("pallas", "xla"))),
    StepBucket("fp16_gqa3_bs5_window_lse", 6, 2, 32, 5, 6, 3, "float16", sliding_window=9,
               return_lse=True, combos=(("pallas", "pallas"),), config=C(16, 3)),
    StepBucket("fp8_mqa_bs4", 4, 1, 32, 4, 5, 3, "float8_e4m3fn", k_scale=0.05, v_scale=0.1,
               combos=(("pallas", "pallas"), ("xla", "xla"))),
    StepBucket("fp32_mha_bs1_softcap_alibi_sinks", 4, 4, 32, 1, 12, 2, "float32",
               logits_soft_cap=4.0, alibi=True, sinks=True, config=C(16, 2),
               combos=(("xla", "xla"), ("pallas", "pallas"))),
)


@functools.cache
def runner_step(bucket: StepBucket, write_impl: str, decode_impl: str):
    """``jit(write_kv then decode)``, caches donated: the model runner's step."""
    scales = {} if bucket.k_scale is None else dict(k_scale=bucket.k_scale, v_scale=bucket.v_scale)

    def step(k_cache, v_cache, k, v, slots, q, tables, lens, alibi_slopes, sinks):
        k_cache, v_cache = pp.write_kv(k_cache, v_cache, k, v, slots, impl=write_impl, **scales)
        out = pp.decode(q, k_cache, v_cache, tables, lens, logits_soft_cap=bucket.logits_soft_cap,
                        alibi_slopes=alibi_slopes, sliding_window=bucket.sliding_window,
                        sinks=sinks, return_lse=bucket.return_lse, impl=decode_impl,
                        config=bucket.config if decode_impl == "pallas" else None, **scales)
        return out, k_cache, v_cache

    return jax.jit(step, donate_argnums=(0, 1))


@pytest.mark.parametrize("bucket", STEP_BUCKETS, ids=lambda b: b.name)
@settings(PROFILE, max_examples=EXAMPLES["step"])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_step_write_then_decode(bucket, data, seed):
    """The donated write-then-decode step on random lengths equals torch_ref's write (bit for bit)
    and the truth's decode."""
    lens = data.draw(lengths(bucket.capacity, bucket.block_size, bucket.batch), label="lens")
    case = bucket.case(lens, seed)
    x = make_inputs(case)
    scales = {} if bucket.k_scale is None else dict(k_scale=bucket.k_scale, v_scale=bucket.v_scale)
    k_cache, v_cache = to_torch(x["k_cache"].copy()), to_torch(x["v_cache"].copy())
    torch_ref.write_kv(k_cache, v_cache, to_torch(x["k"]), to_torch(x["v"]),
                       torch.from_numpy(x["slot_mapping"]), **scales)
    ref = reference(x["q"], k_cache, v_cache, x["block_tables"], x["context_lens"],
                    alibi_slopes=x.get("alibi_slopes"), sinks=x.get("sinks"),
                    logits_soft_cap=bucket.logits_soft_cap, sliding_window=bucket.sliding_window,
                    **scales)
    for write_impl, decode_impl in bucket.combos:
        step = runner_step(bucket, write_impl, decode_impl)
        out, got_k, got_v = step(
            *[jnp.asarray(x[n]) for n in ("k_cache", "v_cache", "k", "v", "slot_mapping", "q",
                                          "block_tables", "context_lens")],
            _jnp_or_none(x.get("alibi_slopes")), _jnp_or_none(x.get("sinks")))
        label = f"write {write_impl} + decode {decode_impl}"
        np.testing.assert_array_equal(bits(got_k), bits(k_cache), err_msg=label)
        np.testing.assert_array_equal(bits(got_v), bits(v_cache), err_msg=label)
        out, lse = out if bucket.return_lse else (out, None)
        check_decode(label, out, ref, lse)

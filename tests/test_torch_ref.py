"""torch_ref against SPEC.md: the invariants I1-I7, closeness to the float64 oracle (the tolerance
rule, and one rounding of the output dtype), the extensions, input validation, and one test per
classic paged-attention bug.

Every case builds fresh inputs from a seed derived from its own test id (`make_paged`, whose
tables come from `parity.layout.paged_layout`). Unused cache slots hold NaN (or Inf) unless a test
says otherwise, physical blocks are shuffled with spare blocks in between, and the tails of the
block tables hold garbage ids. Writes are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ref
from paged_inputs import (Reference, assert_close, assert_rounded_once, dtype_name, make_paged,
                          reference)
from paged_inputs import to_numpy as bit_numpy
from parity.oracle import (FP8_MAX, fp8_e4m3fn_to_float, oracle_paged_attention,
                           oracle_quantize_fp8, oracle_write_kv)

FP8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
# (num_heads, num_kv_heads): GQA ratios 1, 2, 3 and 8.
GQA = [(2, 2), (4, 2), (6, 2), (16, 2)]
HAS_CUDA = torch.cuda.is_available()


def dtype_id(value):
    """Readable test ids for dtype parameters: `float32`, `bfloat16`, ..."""
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of `t` as integers, so NaN == NaN and -0.0 != 0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected) -> None:
    expected = expected if isinstance(expected, np.ndarray) else bits(expected).numpy()
    np.testing.assert_array_equal(bits(actual).numpy(), expected)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact float64 values of a float tensor (any dtype, fp8 included)."""
    return t.to(torch.float64).numpy() if t.dtype != FP8 else t.float().numpy().astype(np.float64)


def assert_close_to_oracle(out: torch.Tensor, ref, lse: torch.Tensor | None = None) -> None:
    """torch_ref's output against the float64 truth: finite, within the tolerance rule
    (`paged_inputs.assert_close`, the lse too when given) and, stricter, within one rounding of
    the output dtype element by element (`assert_rounded_once`: SPEC.md's fp32 accumulation and
    single cast, which the reference is written to)."""
    assert torch.isfinite(out).all(), "output has NaN/Inf"
    assert_close(ref, bit_numpy(out), None if lse is None else bit_numpy(lse))
    assert_rounded_once(out.to(torch.float64).numpy(), ref.truth_out, dtype_name(out.dtype))


@dataclasses.dataclass
class Case:
    """One decode batch: torch inputs plus which cache slots hold valid tokens."""

    q: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # i32[B, max_blocks]
    context_lens: torch.Tensor  # i32[B]
    valid: np.ndarray  # bool[num_blocks, block_size]: slot holds a valid token of the batch

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens

    def run(self, scale=None, **kw):
        return torch_ref.paged_decode_attention(*self.args(), scale, **kw)

    def oracle(self, scale=None, **kw):
        """The float64 output and lse (`parity.oracle`)."""
        kw = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return oracle_paged_attention(to_numpy(self.q), to_numpy(self.k_cache), to_numpy(self.v_cache),
                                      self.block_tables.numpy(), self.context_lens.numpy(), scale, **kw)

    def truth(self, scale=None, **kw) -> Reference:
        """The truth and the naive baseline of the tolerance rule (`paged_inputs.reference`)."""
        kw = {k: (bit_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        return reference(*(bit_numpy(x) for x in self.args()), scale, **kw)

    def with_cache_fill(self, value: float) -> "Case":
        """The same batch with every slot that is not a valid token set to `value`."""
        invalid = torch.from_numpy(~self.valid)
        k, v = self.k_cache.clone(), self.v_cache.clone()
        k[invalid] = value
        v[invalid] = value
        return dataclasses.replace(self, k_cache=k, v_cache=v)


def make_case(rng, lens, *, block_size=4, num_heads=4, num_kv_heads=2, head_dim=8,
              dtype=torch.float32, q_dtype=None, max_blocks=None, tail=None, fill=math.nan,
              index_dtype=torch.int32, q_mult=1.0) -> Case:
    """A batch with sequences of lengths `lens` in shuffled physical blocks (`make_paged`: the
    tables from `parity.layout.paged_layout`), as many spare blocks as used ones, plus 3.

    Unused slots hold `fill`; table tails hold `tail` (default: random garbage ids, huge and
    negative included, and stale ids of real blocks); tables are `max_blocks` wide (default: two
    entries past the longest sequence's pages). The fp8 cache's query is fp32 by default.
    """
    pages = sum(-(-n // block_size) for n in lens)
    if max_blocks is None:
        max_blocks = max((-(-n // block_size) for n in lens), default=0) + 2
    wide_tail = tail is not None and not -2**31 <= tail < 2**31
    paged = make_paged(rng, lens=lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, spare_blocks=pages + 3,
                       max_blocks=max_blocks, dtype=dtype_name(dtype), fill=fill,
                       q_dtype=dtype_name(q_dtype or (dtype if dtype != FP8 else torch.float32)),
                       tail="random" if tail is None else (0 if wide_tail else tail,))
    q = rng.normal(size=paged.q.shape) * q_mult
    tables = torch.from_numpy(paged.block_tables.astype(np.int64))
    if wide_tail:
        used = torch.arange(max_blocks)[None, :] < torch.tensor(
            [-(-n // block_size) for n in lens], dtype=torch.int64).reshape(-1, 1)
        tables = torch.where(used, tables, torch.tensor(tail, dtype=torch.int64))
    return Case(
        q=torch.tensor(q, dtype=torch.float32).to(q_dtype or (dtype if dtype != FP8 else torch.float32)),
        k_cache=torch.from_numpy(paged.k_cache.astype(np.float32)).to(dtype),
        v_cache=torch.from_numpy(paged.v_cache.astype(np.float32)).to(dtype),
        block_tables=tables.to(index_dtype),
        context_lens=torch.tensor(lens, dtype=index_dtype),
        valid=paged.valid_slots.reshape(paged.k_cache.shape[:2]),
    )


def special_lens(block_size: int, max_blocks: int) -> list[int]:
    """0, 1, bs-1, bs, bs+1 and the table's capacity."""
    return [0, 1, block_size - 1, block_size, block_size + 1, max_blocks * block_size]


# --------------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------------


def make_write(rng, dtype, *, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, num_tokens=7,
               pad=(), index_dtype=torch.int64):
    """Caches full of random values and NaN, `num_tokens` new tokens at distinct random slots;
    the tokens at positions `pad` get slot -1."""
    cache_dtype = dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.tensor(rng.normal(size=shape), dtype=torch.float32)
    v_cache = torch.tensor(rng.normal(size=shape), dtype=torch.float32)
    k_cache[rng.random(shape) < 0.3] = math.nan
    v_cache[rng.random(shape) < 0.3] = math.nan
    k_dtype = torch.float32 if dtype == FP8 else dtype
    k = torch.tensor(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), dtype=k_dtype)
    v = torch.tensor(rng.normal(size=(num_tokens, num_kv_heads, head_dim)), dtype=k_dtype)
    slots = rng.choice(num_blocks * block_size, size=num_tokens, replace=False)
    slots[list(pad)] = -1
    return (k_cache.to(cache_dtype), v_cache.to(cache_dtype), k, v,
            torch.tensor(slots, dtype=index_dtype))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_write_kv_stores_each_token_at_its_slot_bit_exact(rng, dtype, index_dtype):
    """Each token lands at its slot, bit for bit the token loop of the oracle, in place (returns
    None), for int32 and int64 slots."""
    k_cache, v_cache, k, v, slots = make_write(rng, dtype, pad=(2,), index_dtype=index_dtype)
    expected_k, expected_v = oracle_write_kv(bits(k_cache).numpy(), bits(v_cache).numpy(),
                                             bits(k).numpy(), bits(v).numpy(), slots.numpy())
    assert torch_ref.write_kv(k_cache, v_cache, k, v, slots) is None
    assert_bits_equal(k_cache, expected_k)
    assert_bits_equal(v_cache, expected_v)


def test_write_kv_slot_arithmetic_matches_the_worked_example(rng):
    # block_size 16: slot 37 -> block 2, offset 5; slot 16 -> block 1, offset 0.
    """SPEC.md's worked example: slot 37 of blocks of 16 is block 2, offset 5."""
    k_cache = torch.zeros(4, 16, 1, 2)
    v_cache = torch.zeros(4, 16, 1, 2)
    k = torch.tensor([[[1.0, 2.0]], [[9.0, 9.0]], [[3.0, 4.0]]])
    torch_ref.write_kv(k_cache, v_cache, k, -k, torch.tensor([37, -1, 16]))
    expected_k, expected_v = torch.zeros(4, 16, 1, 2), torch.zeros(4, 16, 1, 2)
    expected_k[2, 5], expected_k[1, 0] = k[0], k[2]
    expected_v[2, 5], expected_v[1, 0] = -k[0], -k[2]
    assert_bits_equal(k_cache, expected_k)
    assert_bits_equal(v_cache, expected_v)


@pytest.mark.parametrize("pad", [(0,), (3,), (6,), (0, 2, 6), tuple(range(7))],
                         ids=["first", "middle", "last", "several", "all"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_I1_padding_token_leaves_no_trace(rng, dtype, pad):
    """I1: padding tokens (first, middle, last, several, all) carrying a sentinel leave no trace."""
    sentinel = 1234.5
    k_cache, v_cache, k, v, slots = make_write(rng, dtype, pad=pad)
    k[list(pad)] = sentinel
    v[list(pad)] = sentinel
    expected_k, expected_v = oracle_write_kv(bits(k_cache).numpy(), bits(v_cache).numpy(),
                                             bits(k).numpy(), bits(v).numpy(), slots.numpy())
    torch_ref.write_kv(k_cache, v_cache, k, v, slots)
    assert_bits_equal(k_cache, expected_k)
    assert_bits_equal(v_cache, expected_v)
    assert not (k_cache == sentinel).any() and not (v_cache == sentinel).any()


def test_write_kv_zero_tokens_changes_nothing(rng):
    """No tokens: the caches keep every bit."""
    k_cache, v_cache, k, v, slots = make_write(rng, torch.float32, num_tokens=0)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    torch_ref.write_kv(k_cache, v_cache, k, v, slots)
    assert_bits_equal(k_cache, before_k)
    assert_bits_equal(v_cache, before_v)


def test_write_kv_many_padding_tokens_are_not_duplicates(rng):
    """Several -1 slots are padding, not a duplicate slot."""
    k_cache, v_cache, k, v, slots = make_write(rng, torch.float32, pad=(1, 3, 4))
    torch_ref.write_kv(k_cache, v_cache, k, v, slots)  # three -1 slots: no error


def test_write_kv_int32_and_int64_slots_agree(rng):
    """int32 and int64 slot mappings write the same bits."""
    k_cache, v_cache, k, v, slots = make_write(rng, torch.bfloat16, pad=(1,))
    k32, v32 = k_cache.clone(), v_cache.clone()
    torch_ref.write_kv(k_cache, v_cache, k, v, slots.to(torch.int64))
    torch_ref.write_kv(k32, v32, k, v, slots.to(torch.int32))
    assert_bits_equal(k32, k_cache)
    assert_bits_equal(v32, v_cache)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(1, 6), block_size=st.integers(1, 5),
       num_tokens=st.integers(0, 12))
def test_write_kv_property_matches_token_loop(data, num_blocks, block_size, num_tokens):
    """Any distinct slots mixed with padding: the oracle's token loop, bit for bit."""
    num_slots = num_blocks * block_size
    distinct = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True,
                                  max_size=min(num_tokens, num_slots)))
    slots = distinct + [-1] * (num_tokens - len(distinct))
    slots = data.draw(st.permutations(slots)) if slots else slots
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    shape = (num_blocks, block_size, 2, 3)
    k_cache = torch.tensor(rng.normal(size=shape), dtype=torch.float16)
    v_cache = torch.full(shape, math.nan, dtype=torch.float16)
    k = torch.tensor(rng.normal(size=(num_tokens, 2, 3)), dtype=torch.float16)
    v = torch.tensor(rng.normal(size=(num_tokens, 2, 3)), dtype=torch.float16)
    slot_mapping = torch.tensor(slots, dtype=torch.int32).reshape(num_tokens)
    expected_k, expected_v = oracle_write_kv(bits(k_cache).numpy(), bits(v_cache).numpy(),
                                             bits(k).numpy(), bits(v).numpy(), slot_mapping.numpy())
    torch_ref.write_kv(k_cache, v_cache, k, v, slot_mapping)
    assert_bits_equal(k_cache, expected_k)
    assert_bits_equal(v_cache, expected_v)


# --------------------------------------------------------------------------------------------------
# fp8 cache
# --------------------------------------------------------------------------------------------------


def test_oracle_fp8_decoding_matches_torch():
    """The oracle decodes every float8_e4m3fn code as torch does."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    np.testing.assert_array_equal(fp8_e4m3fn_to_float(codes.numpy()),
                                  codes.view(FP8).float().numpy().astype(np.float64))


@pytest.mark.parametrize("scale", [1.0, 0.0123, 37.5])
@pytest.mark.parametrize("k_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_write_kv_fp8_stores_clamped_scaled_values_rounded_to_nearest_even(rng, k_dtype, scale):
    """fp8 stores clamp(x / scale) rounded to nearest even, bit for bit the oracle's, with saturation
    of large values and infinities."""
    num_tokens, shape = 6, (3, 4, 2, 8)
    magnitudes = np.exp(rng.uniform(np.log(1e-4), np.log(1e3), size=(num_tokens, 2, 8)))
    k = magnitudes * rng.choice([-1.0, 1.0], size=magnitudes.shape) * scale
    # Edge values: beyond 448 * scale saturates, infinities saturate, signed zeros keep their sign.
    k[0, 0, :6] = [500 * scale, -1000 * scale, math.inf, -math.inf, 0.0, -0.0]
    k_t = torch.tensor(k, dtype=torch.float32).to(k_dtype)
    v_t = torch.tensor(-k[::-1].copy(), dtype=torch.float32).to(k_dtype)
    slots = torch.tensor(rng.choice(12, size=num_tokens, replace=False))
    k_cache = torch.full(shape, math.nan).to(FP8)
    v_cache = torch.full(shape, math.nan).to(FP8)
    expected_k, expected_v = oracle_write_kv(
        bits(k_cache).numpy(), bits(v_cache).numpy(),
        oracle_quantize_fp8(k_t.float().numpy(), scale),
        oracle_quantize_fp8(v_t.float().numpy(), 2 * scale), slots.numpy())
    torch_ref.write_kv(k_cache, v_cache, k_t, v_t, slots, k_scale=scale, v_scale=2 * scale)
    assert_bits_equal(k_cache, expected_k)
    assert_bits_equal(v_cache, expected_v)
    written = k_cache[slots // 4, slots % 4].float()
    assert written.abs().max() <= FP8_MAX
    assert written[0, 0, 0] == FP8_MAX and written[0, 0, 1] == -FP8_MAX
    assert written[0, 0, 2] == FP8_MAX and written[0, 0, 3] == -FP8_MAX


@pytest.mark.parametrize("value, code", [
    (1.0625, 0x38),      # halfway 1.0 (even) / 1.125 -> 1.0
    (1.1875, 0x3A),      # halfway 1.125 / 1.25 (even) -> 1.25
    (2.0**-10, 0x00),    # halfway 0 (even) / smallest subnormal -> 0
    (3 * 2.0**-10, 0x02),  # halfway subnormals 1 and 2 (even) -> 2 * 2**-9
    (432.0, 0x7E),       # halfway 416 / 448 (even) -> 448
    (449.0, 0x7E),       # beyond the largest finite value: clamped to 448
    (1e30, 0x7E),
    (-1e30, 0xFE),
])
def test_write_kv_fp8_ties_and_saturation(value, code):
    """Rounding ties go to the even code; values past 448 saturate."""
    k_cache = torch.zeros(1, 1, 1, 1, dtype=FP8)
    v_cache = torch.zeros(1, 1, 1, 1, dtype=FP8)
    k = torch.full((1, 1, 1), value)
    assert oracle_quantize_fp8(k.numpy(), 1.0).item() == code
    torch_ref.write_kv(k_cache, v_cache, k, k, torch.tensor([0]), k_scale=1.0, v_scale=1.0)
    assert bits(k_cache).item() == code and bits(v_cache).item() == code


@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_fp8_decode_dequantizes_with_the_scales(rng, q_dtype, options):
    """fp8 decode multiplies the stored values by the scales, for every query dtype, with and without
    every option."""
    case = make_case(rng, [0, 1, 3, 4, 5, 12], dtype=FP8, q_dtype=q_dtype)
    kw = {} if options == "plain" else extension_options("all", rng, 4, 4)
    out = case.run(k_scale=0.5, v_scale=3.0, **kw)
    assert out.dtype == q_dtype
    ref = case.truth(k_scale=0.5, v_scale=3.0, **kw)
    assert_close_to_oracle(out, ref)
    expected = ref.truth_out
    unscaled, _ = case.oracle(k_scale=1.0, v_scale=1.0, **kw)
    assert np.abs(expected - unscaled).max() > 0.1  # the scales matter at this tolerance


@pytest.mark.parametrize("dtype", (*FLOAT_DTYPES, FP8), ids=dtype_id)
def test_write_then_decode_round_trip(rng, dtype):
    """Tokens written by write_kv at the slots their block tables name are what decode attends to."""
    scales = dict(k_scale=0.25, v_scale=4.0) if dtype == FP8 else {}
    layout = make_case(rng, [0, 5, 1, 8, 9], block_size=4, dtype=dtype)
    k_cache = torch.full_like(layout.k_cache, math.nan)
    v_cache = torch.full_like(layout.v_cache, math.nan)
    slots, ks, vs = [], [], []
    for b, n in enumerate(layout.context_lens.tolist()):
        for p in range(n):
            slots.append(int(layout.block_tables[b, p // 4]) * 4 + p % 4)
            ks.append(rng.normal(size=(2, 8)) * (2.0 if dtype == FP8 else 1.0))
            vs.append(rng.normal(size=(2, 8)))
    token_dtype = torch.bfloat16 if dtype == FP8 else dtype
    k = torch.tensor(np.array(ks), dtype=torch.float32).to(token_dtype)
    v = torch.tensor(np.array(vs), dtype=torch.float32).to(token_dtype)
    order = torch.from_numpy(rng.permutation(len(slots)))
    torch_ref.write_kv(k_cache, v_cache, k[order], v[order], torch.tensor(slots)[order], **scales)
    case = dataclasses.replace(layout, k_cache=k_cache, v_cache=v_cache)
    assert_close_to_oracle(case.run(**scales), case.truth(**scales))


# --------------------------------------------------------------------------------------------------
# paged_decode_attention: the invariants
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [99999, -7, 2**40], ids=["huge", "negative", "int64-huge"])
def test_I2_table_tail_is_never_read(rng, tail):
    """I2: tails of 99999, -7 or 2**40 give the output of a valid tail, bit for bit."""
    index_dtype = torch.int64 if tail > 2**31 else torch.int32
    case = make_case(rng, [1, 3, 4, 5, 9], block_size=4, max_blocks=6, tail=tail,
                     index_dtype=index_dtype)
    clean = dataclasses.replace(case, block_tables=case.block_tables.clone())
    for b, n in enumerate(case.context_lens.tolist()):
        clean.block_tables[b, -(-n // 4):] = 0  # a valid id, so a read of the tail would matter
        assert (case.block_tables[b, -(-n // 4):] == tail).all()
    out = case.run()
    assert_bits_equal(out, clean.run())
    assert_close_to_oracle(out, case.truth())


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_I3_exactly_n_rows_enter(rng, block_size):
    """I3: lengths 0, 1, bs - 1, bs, bs + 1 and the capacity, the rest NaN: the truth."""
    lens = special_lens(block_size, max_blocks=3)
    case = make_case(rng, lens, block_size=block_size, max_blocks=3)
    assert_close_to_oracle(case.run(), case.truth())


@pytest.mark.parametrize("heads", [pytest.param(h, id=f"H{h[0]}-KVH{h[1]}",
                                                marks=[] if h == (6, 2) else [pytest.mark.slow])
                                   for h in GQA])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_I4_paged_equals_dense_on_gathered_kv(rng, dtype, heads):
    """Paged attention equals the dense function on the gathered K/V, bit for bit, with every
    option and the lse too."""
    num_heads, num_kv_heads = heads
    case = make_case(rng, special_lens(4, 3), block_size=4, max_blocks=3, dtype=dtype,
                     num_heads=num_heads, num_kv_heads=num_kv_heads)
    batch, max_len = case.q.shape[0], 12
    k = torch.full((batch, max_len, num_kv_heads, 8), math.nan, dtype=dtype)
    v = torch.full_like(k, math.nan)
    for b, n in enumerate(case.context_lens.tolist()):
        for p in range(n):
            block = int(case.block_tables[b, p // 4])
            k[b, p], v[b, p] = case.k_cache[block, p % 4], case.v_cache[block, p % 4]
    assert_bits_equal(case.run(), torch_ref.dense_decode_attention(case.q, k, v, case.context_lens))
    options = dict(logits_soft_cap=3.0, sliding_window=5,
                   alibi_slopes=torch.tensor(rng.uniform(0, 1, num_heads), dtype=torch.float32),
                   sinks=torch.tensor(rng.normal(size=num_heads), dtype=torch.float32))
    out, lse = case.run(return_lse=True, **options)
    dense_out, dense_lse = torch_ref.dense_decode_attention(case.q, k, v, case.context_lens,
                                                            return_lse=True, **options)
    assert_bits_equal(out, dense_out)
    assert_bits_equal(lse, dense_lse)


def repeat_mapping_oracle(case: Case):
    """What head h would get from kv head h % KVH (`repeat` instead of `repeat_interleave`)."""
    num_heads, num_kv_heads = case.q.shape[1], case.k_cache.shape[2]
    heads = [h % num_kv_heads for h in range(num_heads)]
    k, v = to_numpy(case.k_cache)[:, :, heads], to_numpy(case.v_cache)[:, :, heads]
    return oracle_paged_attention(to_numpy(case.q), k, v, case.block_tables.numpy(),
                                  case.context_lens.numpy())[0]


@pytest.mark.parametrize("heads", [(4, 2), (8, 2)], ids=["H4-KVH2", "H8-KVH2"])
def test_I5_gqa_head_h_uses_kv_head_h_div_group(rng, heads):
    """I5: head h uses kv head h // group; `repeat`'s mapping gives a clearly other answer."""
    num_heads, num_kv_heads = heads
    case = make_case(rng, [1, 5, 8, 11], num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = case.run()
    ref = case.truth()
    assert_close_to_oracle(out, ref)
    expected = ref.truth_out
    # The check has teeth: the `repeat` mapping gives a clearly different answer on these inputs.
    assert np.abs(repeat_mapping_oracle(case) - expected).max() > 0.1
    assert np.abs(repeat_mapping_oracle(case) - out.numpy()).max() > 0.1


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_I6_nan_and_inf_outside_valid_tokens_change_nothing(rng, dtype):
    """I6: NaN, +-Inf or 1e4 in every slot that is not a valid token change no bit."""
    case = make_case(rng, special_lens(4, 3), block_size=4, max_blocks=3, dtype=dtype, fill=0.0)
    reference = case.run()
    assert torch.isfinite(reference).all()
    for fill in (math.nan, math.inf, -math.inf, 1e4):
        assert_bits_equal(case.with_cache_fill(fill).run(), reference)


@pytest.mark.parametrize("options", ["plain", "sinks"])
def test_I7_zero_length_rows_give_zeros_and_leave_the_batch_alone(rng, options):
    """I7: zero-length rows give zeros and lse -inf (with a sink too); other rows are bit for bit
    their own computed alone."""
    lens = [0, 5, 0, 13, 1, 0]
    case = make_case(rng, lens, block_size=4)
    kw = {} if options == "plain" else dict(sinks=torch.tensor(rng.normal(size=4) + 2.0, dtype=torch.float32))
    out, lse = case.run(return_lse=True, **kw)
    zero_rows = [b for b, n in enumerate(lens) if n == 0]
    assert_bits_equal(out[zero_rows], torch.zeros_like(out[zero_rows]))
    assert torch.isneginf(lse[zero_rows]).all()
    # Every non-empty row equals the same row computed alone.
    for b, n in enumerate(lens):
        if n:
            alone = dataclasses.replace(case, q=case.q[b:b + 1], block_tables=case.block_tables[b:b + 1],
                                        context_lens=case.context_lens[b:b + 1])
            assert_bits_equal(out[b:b + 1], alone.run(**kw))
    assert_close_to_oracle(out, case.truth(**kw))


def test_all_rows_empty_with_a_zero_width_table(rng):
    """A table of width 0: zeros and lse -inf."""
    case = make_case(rng, [0, 0], max_blocks=0)
    assert case.block_tables.shape == (2, 0)
    out, lse = case.run(return_lse=True, sinks=torch.ones(4))
    assert_bits_equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("return_lse", [False, True])
def test_batch_of_size_zero(rng, return_lse):
    """Batch 0: an empty output of q's dtype (and an empty fp32 lse)."""
    case = make_case(rng, [], block_size=4, dtype=torch.bfloat16)
    case = dataclasses.replace(case, k_cache=torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16),
                               v_cache=torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16))
    result = case.run(return_lse=return_lse)
    out = result[0] if return_lse else result
    assert out.shape == (0, 4, 8) and out.dtype == torch.bfloat16
    if return_lse:
        assert result[1].shape == (0, 4) and result[1].dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# paged_decode_attention: closeness to the float64 oracle
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("heads", [pytest.param(h, id=f"H{h[0]}-KVH{h[1]}",
                                                marks=[] if h[0] // h[1] in (3, 8)
                                                else [pytest.mark.slow]) for h in GQA])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_matches_float64_oracle(rng, dtype, heads, block_size):
    """Lengths 0, 1, bs - 1, bs, bs + 1, the capacity and one more; GQA 1, 2, 3, 8: the truth
    within the tolerance rule and one rounding of the output dtype."""
    num_heads, num_kv_heads = heads
    lens = special_lens(block_size, max_blocks=4) + [int(rng.integers(0, 4 * block_size + 1))]
    case = make_case(rng, lens, block_size=block_size, max_blocks=4, dtype=dtype,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, q_mult=2.0)
    out = case.run()
    assert out.dtype == dtype and out.shape == case.q.shape
    assert_close_to_oracle(out, case.truth())


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=dtype_id)
def test_int32_and_int64_tables_and_lengths_agree(rng, index_dtype):
    """int32 and int64 tables and lengths give the same bits."""
    case = make_case(rng, [0, 3, 9, 4], index_dtype=torch.int32, tail=7)
    expected = case.run()
    for tables in (case.block_tables, case.block_tables.to(index_dtype)):
        mixed = dataclasses.replace(case, block_tables=tables,
                                    context_lens=case.context_lens.to(index_dtype))
        assert_bits_equal(mixed.run(), expected)


def test_scale_none_means_inverse_sqrt_head_dim(rng):
    """scale=None is 1 / sqrt(head_dim), bit for bit."""
    case = make_case(rng, [3, 7, 12], head_dim=24)
    assert_bits_equal(case.run(), case.run(1.0 / math.sqrt(24)))


@pytest.mark.parametrize("scale", [0.37, 2.5])
def test_explicit_scale(rng, scale):
    """An explicit scale: the truth, and a different answer than the default."""
    case = make_case(rng, [1, 6, 11], head_dim=8)
    out = case.run(scale)
    assert_close_to_oracle(out, case.truth(scale))
    assert (out - case.run()).abs().max() > 1e-3


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), block_size=st.integers(1, 6), group=st.integers(1, 3),
       num_kv_heads=st.integers(1, 2), lens=st.lists(st.integers(0, 14), min_size=1, max_size=4))
def test_property_matches_float64_oracle(seed, block_size, group, num_kv_heads, lens):
    """Random lengths, block sizes and GQA ratios: the truth."""
    rng = np.random.default_rng(seed)
    case = make_case(rng, lens, block_size=block_size, num_heads=group * num_kv_heads,
                     num_kv_heads=num_kv_heads, head_dim=5)
    assert_close_to_oracle(case.run(), case.truth())


# --------------------------------------------------------------------------------------------------
# Extensions
# --------------------------------------------------------------------------------------------------


def extension_options(name: str, rng, num_heads: int, block_size: int) -> dict:
    slopes = torch.tensor(2.0 ** -rng.uniform(0, 4, num_heads), dtype=torch.float32)
    sinks = torch.tensor(rng.normal(size=num_heads) * 2.0, dtype=torch.float32)
    return {
        "soft_cap": dict(logits_soft_cap=2.0),
        "alibi": dict(alibi_slopes=slopes),
        "window_1": dict(sliding_window=1),
        "window_bs": dict(sliding_window=block_size),
        "window_bs_plus_1": dict(sliding_window=block_size + 1),
        "window_beyond_every_length": dict(sliding_window=1000),
        "sinks": dict(sinks=sinks),
        "all": dict(logits_soft_cap=2.0, alibi_slopes=slopes, sliding_window=block_size + 3,
                    sinks=sinks),
    }[name]


EXTENSIONS = ["soft_cap", "alibi", "window_1", "window_bs", "window_bs_plus_1",
              "window_beyond_every_length", "sinks", "all"]


@pytest.mark.parametrize("name,dtype", [
    pytest.param(name, dtype, id=f"{name}-{dtype_id(dtype)}",
                 marks=[] if dtype == torch.float32 or name == "all" else [pytest.mark.slow])
    for name in EXTENSIONS for dtype in FLOAT_DTYPES])
def test_extension_matches_float64_oracle(rng, name, dtype):
    """Each option (soft-cap, ALiBi, windows of 1, bs, bs + 1 and past every length, sinks) and
    all together: the truth, the lse too; each option changes the answer on these inputs."""
    block_size = 4
    case = make_case(rng, special_lens(block_size, 4) + [7], block_size=block_size, max_blocks=4,
                     dtype=dtype, num_heads=6, num_kv_heads=2, q_mult=3.0)
    options = extension_options(name, rng, 6, block_size)
    out, lse = case.run(return_lse=True, **options)
    ref = case.truth(**options)
    assert_close_to_oracle(out, ref, lse)
    expected = ref.truth_out
    plain, _ = case.oracle()
    if name == "window_beyond_every_length":
        np.testing.assert_array_equal(expected, plain)
    else:
        assert np.abs(expected - plain).max() > 1e-2  # the option changes the answer on these inputs


def test_soft_cap_with_huge_scores_stays_finite(rng):
    """Scores of order 1e4 under a soft-cap: finite, and the truth within the tolerance rule."""
    case = make_case(rng, [1, 5, 16], q_mult=1e4)
    out = case.run(logits_soft_cap=5.0)
    # Scores near 1e4 carry fp32 rounding of ~1e-3 before the cap flattens them: the tolerance
    # rule (its naive baseline errs as much), not one rounding of the output.
    assert_close(case.truth(logits_soft_cap=5.0), out)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 11])
def test_sliding_window_does_not_read_blocks_outside_the_window(rng, window):
    """Blocks wholly outside the window hold NaN: the output is the truth and unchanged."""
    block_size = 4
    case = make_case(rng, [0, 1, 4, 13, 16, 19], block_size=block_size, max_blocks=5)
    ref = case.truth(sliding_window=window)
    k, v = case.k_cache.clone(), case.v_cache.clone()
    poisoned = 0
    for b, n in enumerate(case.context_lens.tolist()):
        for i in range(-(-n // block_size)):
            if (i + 1) * block_size - 1 < n - window:  # every position of block i is out of window
                k[int(case.block_tables[b, i])] = math.nan
                v[int(case.block_tables[b, i])] = math.nan
                poisoned += 1
    assert poisoned > 0
    poisoned_case = dataclasses.replace(case, k_cache=k, v_cache=v)
    out = poisoned_case.run(sliding_window=window)
    assert_close_to_oracle(out, ref)
    assert_bits_equal(out, case.run(sliding_window=window))


def test_sinks_with_zero_length_rows_give_zeros_and_neg_inf_lse(rng):
    """With sinks, zero-length rows still give zeros and lse -inf; the rest is the truth."""
    case = make_case(rng, [0, 0, 2], num_heads=4, num_kv_heads=2)
    sinks = torch.tensor([5.0, -3.0, 0.0, 30.0])
    out, lse = case.run(return_lse=True, sinks=sinks)
    assert_bits_equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isneginf(lse[:2]).all()
    ref = case.truth(sinks=sinks)
    assert_close_to_oracle(out, ref, lse)
    np.testing.assert_allclose(lse[2].numpy(), ref.truth_lse[2], rtol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_return_lse(rng, dtype):
    """return_lse adds an fp32 [B, H] lse, -inf for empty rows, the truth's; the output is
    unchanged."""
    case = make_case(rng, [0, 1, 4, 9, 12], dtype=dtype, max_blocks=3)
    out_only = case.run()
    assert isinstance(out_only, torch.Tensor)
    out, lse = case.run(return_lse=True)
    assert_bits_equal(out, out_only)
    assert lse.dtype == torch.float32 and lse.shape == case.q.shape[:2]
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    assert_close_to_oracle(out, case.truth(), lse)


# --------------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------------

# write_kv base: caches [5, 4, 2, 8] fp32 (20 slots), 7 tokens, token 1 is padding.
WRITE_BAD = {
    "slot_below_minus_one": (lambda a: a["slot_mapping"].__setitem__(2, -2), r"slot_mapping\[2\]=-2 is out of range"),
    "slot_minus_100": (lambda a: a["slot_mapping"].__setitem__(5, -100), r"slot_mapping\[5\]=-100 is out of range"),
    "slot_at_capacity": (lambda a: a["slot_mapping"].__setitem__(3, 20), r"slot_mapping\[3\]=20 is out of range"),
    "slot_huge": (lambda a: a["slot_mapping"].__setitem__(0, 2**40), r"slot_mapping\[0\]=1099511627776 is out"),
    "duplicate_slot": (lambda a: a["slot_mapping"].__setitem__(4, int(a["slot_mapping"][0])),
                       r"slot_mapping\[4\]=\d+ is a duplicate"),
    "k_num_tokens": (lambda a: a.update(k=a["k"][:-1]), r"k\.shape=\(6, 2, 8\) must be"),
    "v_num_kv_heads": (lambda a: a.update(v=a["v"][:, :1]), r"v\.shape=\(7, 1, 8\) must be"),
    "k_head_dim": (lambda a: a.update(k=a["k"][..., :4]), r"k\.shape=\(7, 2, 4\) must be"),
    "k_rank": (lambda a: a.update(k=a["k"][0]), r"k must have rank 3, got k\.shape=\(2, 8\)"),
    "v_rank": (lambda a: a.update(v=a["v"][None]), r"v must have rank 3"),
    "slot_mapping_rank": (lambda a: a.update(slot_mapping=a["slot_mapping"][None]),
                          r"slot_mapping must have rank 1"),
    "k_cache_rank": (lambda a: a.update(k_cache=a["k_cache"][0]), r"k_cache must have rank 4"),
    "v_cache_shape": (lambda a: a.update(v_cache=a["v_cache"][:4]), r"k_cache and v_cache must have the same shape"),
    "v_cache_dtype": (lambda a: a.update(v_cache=a["v_cache"].half()), r"k_cache and v_cache must have the same dtype"),
    "cache_dtype_float64": (lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
                            r"k_cache\.dtype=torch\.float64"),
    "k_dtype": (lambda a: a.update(k=a["k"].half()), r"k\.dtype=torch\.float16 must equal k_cache\.dtype"),
    "v_dtype": (lambda a: a.update(v=a["v"].bfloat16()), r"v\.dtype=torch\.bfloat16 must equal"),
    "slot_mapping_float": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
                           r"slot_mapping must be int32 or int64"),
    "slot_mapping_int16": (lambda a: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)),
                           r"slot_mapping must be int32 or int64"),
    "slot_mapping_list": (lambda a: a.update(slot_mapping=a["slot_mapping"].tolist()),
                          r"slot_mapping must be a torch\.Tensor"),
    "fp8_without_scales": (lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8)),
                           r"k_scale is required"),
    "fp8_without_v_scale": (lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8),
                                               k_scale=1.0), r"v_scale is required"),
    "fp8_zero_scale": (lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8),
                                          k_scale=0.0, v_scale=1.0), r"k_scale=0\.0 must be finite and in \[2\*\*-60, 2\*\*60\]"),
    "fp8_nan_scale": (lambda a: a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8),
                                         k_scale=1.0, v_scale=math.nan), r"v_scale=nan must be finite"),
    "scales_on_fp32_cache": (lambda a: a.update(k_scale=1.0, v_scale=1.0),
                             r"k_scale / v_scale apply to float8_e4m3fn caches only"),
    "v_scale_on_fp32_cache": (lambda a: a.update(v_scale=2.0), r"k_scale / v_scale apply to float8_e4m3fn"),
}


WRITE_BAD_CASES = [pytest.param(name, index_dtype, id=f"{name}-{dtype_id(index_dtype)}")
                   for name in WRITE_BAD for index_dtype in INDEX_DTYPES
                   if not (name == "slot_huge" and index_dtype == torch.int32)]  # 2**40 needs int64


@pytest.mark.parametrize("name, index_dtype", WRITE_BAD_CASES)
def test_write_kv_rejects_bad_input_and_leaves_cache_unchanged(rng, name, index_dtype):
    """Each bad input of write_kv raises a ValueError naming it, and the caches keep every bit."""
    mutate, match = WRITE_BAD[name]
    k_cache, v_cache, k, v, slots = make_write(rng, torch.float32, pad=(1,), index_dtype=index_dtype)
    args = dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slots)
    mutate(args)
    before = {n: args[n].clone() for n in ("k_cache", "v_cache") if isinstance(args[n], torch.Tensor)}
    with pytest.raises(ValueError, match=match):
        torch_ref.write_kv(**args)
    for n, snapshot in before.items():
        assert_bits_equal(args[n], snapshot)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device for a second torch device")
def test_write_kv_rejects_mixed_devices(rng):
    """Tensors on two devices are refused; the cache is unchanged."""
    k_cache, v_cache, k, v, slots = make_write(rng, torch.float32)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"one device.*'k': device\(type='cuda'"):
        torch_ref.write_kv(k_cache, v_cache, k.cuda(), v, slots)
    assert_bits_equal(k_cache, before)


def decode_base(rng):
    """B=3, H=4, KVH=2, D=8, block_size 4, max_blocks 3 (capacity 12), lengths [5, 0, 9]."""
    case = make_case(rng, [5, 0, 9], block_size=4, max_blocks=3, tail=99999)
    assert case.k_cache.shape[0] == 2 * (2 + 0 + 3) + 3  # 13 blocks
    return dict(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=case.block_tables,
                context_lens=case.context_lens)


def _set(name, index, value):
    def mutate(a):
        a[name] = a[name].clone()
        a[name][index] = value
    return mutate


def _fp8(**scales):
    def mutate(a):
        a.update(k_cache=a["k_cache"].to(FP8), v_cache=a["v_cache"].to(FP8), **scales)
    return mutate


DECODE_BAD = {
    "q_rank": (lambda a: a.update(q=a["q"][0]), r"q must have rank 3, got q\.shape=\(4, 8\)"),
    "k_cache_rank": (lambda a: a.update(k_cache=a["k_cache"][0]), r"k_cache must have rank 4"),
    "block_tables_rank": (lambda a: a.update(block_tables=a["block_tables"][0]),
                          r"block_tables must have rank 2, got block_tables\.shape=\(3,\)"),
    "context_lens_rank": (lambda a: a.update(context_lens=a["context_lens"][None]),
                          r"context_lens must have rank 1, got context_lens\.shape=\(1, 3\)"),
    "heads_not_multiple_of_kv_heads": (lambda a: a.update(q=a["q"][:, :3]),
                                       r"num_heads must be a multiple of num_kv_heads: q\.shape=\(3, 3, 8\)"),
    "head_dim_mismatch": (lambda a: a.update(q=a["q"][..., :6]), r"head_dim mismatch: q\.shape=\(3, 4, 6\)"),
    "kv_cache_shapes": (lambda a: a.update(v_cache=a["v_cache"][:-1]), r"k_cache and v_cache must have the same shape"),
    "kv_cache_dtypes": (lambda a: a.update(v_cache=a["v_cache"].half()), r"k_cache and v_cache must have the same dtype"),
    "q_float64": (lambda a: a.update(q=a["q"].double()), r"q\.dtype=torch\.float64"),
    "q_int": (lambda a: a.update(q=a["q"].int()), r"q\.dtype=torch\.int32"),
    "cache_float64": (lambda a: a.update(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
                      r"k_cache\.dtype=torch\.float64"),
    "batch_q_vs_tables": (lambda a: a.update(block_tables=a["block_tables"][:2]),
                          r"batch mismatch: q\.shape=\(3, 4, 8\) but block_tables\.shape=\(2, 3\)"),
    "batch_q_vs_lengths": (lambda a: a.update(context_lens=a["context_lens"][:2]),
                           r"context_lens\.shape=\(2,\) must be \[batch\] = \(3,\)"),
    "tables_float": (lambda a: a.update(block_tables=a["block_tables"].float()),
                     r"block_tables must be int32 or int64, got block_tables\.dtype=torch\.float32"),
    "tables_int16": (lambda a: a.update(block_tables=a["block_tables"].to(torch.int16)),
                     r"block_tables must be int32 or int64"),
    "tables_list": (lambda a: a.update(block_tables=a["block_tables"].tolist()), r"block_tables must be a torch\.Tensor"),
    "lengths_float": (lambda a: a.update(context_lens=a["context_lens"].float()),
                      r"context_lens must be int32 or int64, got context_lens\.dtype=torch\.float32"),
    "lengths_uint8": (lambda a: a.update(context_lens=a["context_lens"].to(torch.uint8)),
                      r"context_lens must be int32 or int64"),
    "lengths_list": (lambda a: a.update(context_lens=a["context_lens"].tolist()), r"context_lens must be a torch\.Tensor"),
    "negative_length": (_set("context_lens", 1, -1), r"context_lens\[1\]=-1 must be >= 0"),
    "length_beyond_capacity": (_set("context_lens", 2, 13), r"context_lens\[2\]=13 exceeds .* = 12"),
    "block_id_at_num_blocks": (_set("block_tables", (2, 1), 13),
                               r"block_tables\[2, 1\]=13 is outside \[0, num_blocks\) = \[0, 13\)"),
    "block_id_huge_in_last_used_entry": (_set("block_tables", (2, 2), 99999), r"block_tables\[2, 2\]=99999 is outside"),
    "block_id_negative": (_set("block_tables", (0, 0), -7), r"block_tables\[0, 0\]=-7 is outside"),
    "block_id_minus_one": (_set("block_tables", (0, 1), -1), r"block_tables\[0, 1\]=-1 is outside"),
    "scale_nan": (lambda a: a.update(scale=math.nan), r"scale=nan must be finite"),
    "scale_string": (lambda a: a.update(scale="0.5"), r"scale must be a python float"),
    "soft_cap_zero": (lambda a: a.update(logits_soft_cap=0.0), r"logits_soft_cap=0\.0 must be finite and > 0"),
    "soft_cap_negative": (lambda a: a.update(logits_soft_cap=-1.0), r"logits_soft_cap=-1\.0 must be"),
    "soft_cap_inf": (lambda a: a.update(logits_soft_cap=math.inf), r"logits_soft_cap=inf must be"),
    "soft_cap_tensor": (lambda a: a.update(logits_soft_cap=torch.tensor(2.0)), r"logits_soft_cap must be a python float"),
    "window_zero": (lambda a: a.update(sliding_window=0), r"sliding_window=0 must be >= 1"),
    "window_negative": (lambda a: a.update(sliding_window=-3), r"sliding_window=-3 must be >= 1"),
    "window_float": (lambda a: a.update(sliding_window=2.0), r"sliding_window must be a python int"),
    "slopes_length": (lambda a: a.update(alibi_slopes=torch.ones(5)), r"alibi_slopes\.shape=\(5,\) must be \[num_heads\]"),
    "slopes_rank": (lambda a: a.update(alibi_slopes=torch.ones(1, 4)), r"alibi_slopes\.shape=\(1, 4\)"),
    "slopes_float64": (lambda a: a.update(alibi_slopes=torch.ones(4, dtype=torch.float64)),
                       r"alibi_slopes\.dtype=torch\.float64 must be float32"),
    "slopes_bf16": (lambda a: a.update(alibi_slopes=torch.ones(4, dtype=torch.bfloat16)), r"alibi_slopes\.dtype"),
    "slopes_list": (lambda a: a.update(alibi_slopes=[1.0] * 4), r"alibi_slopes must be a torch\.Tensor"),
    "sinks_length": (lambda a: a.update(sinks=torch.ones(8)), r"sinks\.shape=\(8,\) must be \[num_heads\]"),
    "sinks_scalar": (lambda a: a.update(sinks=torch.tensor(1.0)), r"sinks\.shape=\(\)"),
    "sinks_float16": (lambda a: a.update(sinks=torch.ones(4, dtype=torch.float16)), r"sinks\.dtype=torch\.float16"),
    "fp8_without_scales": (_fp8(), r"k_scale is required"),
    "fp8_without_v_scale": (_fp8(k_scale=1.0), r"v_scale is required"),
    "fp8_negative_scale": (_fp8(k_scale=-1.0, v_scale=1.0), r"k_scale=-1\.0 must be finite and in \[2\*\*-60, 2\*\*60\]"),
    "scales_on_fp32_cache": (lambda a: a.update(k_scale=1.0, v_scale=1.0),
                             r"k_scale / v_scale apply to float8_e4m3fn caches only"),
}


@pytest.mark.parametrize("name", list(DECODE_BAD))
def test_paged_decode_attention_rejects_bad_input(rng, name):
    """Each bad input of paged_decode_attention raises a ValueError naming it and its shape or
    value."""
    mutate, match = DECODE_BAD[name]
    args = decode_base(rng)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        torch_ref.paged_decode_attention(**args)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device for a second torch device")
def test_paged_decode_attention_rejects_mixed_devices(rng):
    """Tensors on two devices are refused."""
    args = decode_base(rng)
    args["q"] = args["q"].cuda()
    with pytest.raises(ValueError, match=r"one device"):
        torch_ref.paged_decode_attention(**args)


def test_dense_decode_attention_rejects_non_tensor_lengths(rng):
    """The dense function checks its lengths too."""
    q, k = torch.zeros(1, 2, 4), torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"context_lens must be a torch\.Tensor"):
        torch_ref.dense_decode_attention(q, k, k, [1])
    with pytest.raises(ValueError, match=r"context_lens\[0\]=4 exceeds k\.shape\[1\]=3"):
        torch_ref.dense_decode_attention(q, k, k, torch.tensor([4]))


def test_paged_decode_attention_accepts_garbage_in_table_tails(rng):
    """Garbage past the used entries is accepted."""
    args = decode_base(rng)
    tables = args["block_tables"]
    tables[0, 2] = -7  # n=5: entries 0 and 1 are used
    tables[1, :] = torch.tensor([99999, -1, -(2**31)])  # n=0: nothing is used
    out = torch_ref.paged_decode_attention(**args)
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------------
# Classic bugs: each check passes on torch_ref and fails when its bug is planted in it
# --------------------------------------------------------------------------------------------------
# `test_bug` runs every check twice from the same seed: on the real torch_ref (it must pass), then
# with a planted variant monkeypatched in (it must fail). A plant replaces the public function or
# the internal step the bug lives in (`attention.attend`, `attention._window_start`,
# `cache.quantize_fp8`), reusing the real code around it, so each variant differs from torch_ref
# by exactly its bug.


def check_negative_slot_wraps_to_last_slot(rng):
    """A raw -1 index means "the last element": padding must not overwrite the last slot."""
    for dtype in FLOAT_DTYPES:
        k_cache, v_cache, k, v, slots = make_write(rng, dtype, num_tokens=3, pad=(0, 2))
        slots[1] = 0  # the one real token goes to the first slot, far from the last
        k[:], v[:] = 7.0, 7.0
        last_k, last_v = k_cache[-1, -1].clone(), v_cache[-1, -1].clone()
        torch_ref.write_kv(k_cache, v_cache, k, v, slots)
        assert_bits_equal(k_cache[-1, -1], last_k)
        assert_bits_equal(v_cache[-1, -1], last_v)


def check_repeat_instead_of_repeat_interleave(rng):
    """With H=4, KVH=2, head 1 must read kv head 0 (h // 2), not kv head 1 (h % 2)."""
    case = make_case(rng, [3, 9], num_heads=4, num_kv_heads=2)
    out = case.run()
    assert_close_to_oracle(out, case.truth())
    single = make_case(rng, [6], num_heads=4, num_kv_heads=2)
    head1 = single.run()[0, 1]
    only_kv0 = dataclasses.replace(single, q=single.q[:, [1, 1]], k_cache=single.k_cache[:, :, :1],
                                   v_cache=single.v_cache[:, :, :1])
    assert_bits_equal(head1, only_kv0.run()[0, 0])


def check_floor_instead_of_ceil_page_count(rng):
    """n = bs + 1 spans 2 pages, n = bs - 1 spans 1: floor(n / bs) drops the partial page."""
    case = make_case(rng, [3, 5, 1, 6], block_size=4)
    assert_close_to_oracle(case.run(), case.truth())


def check_reading_whole_table_row(rng):
    """Gathering every table entry then cutting to n faults on garbage ids past ceil(n / bs)."""
    for tail in (99999, -7):
        case = make_case(rng, [1, 5, 2], block_size=4, max_blocks=6, tail=tail)
        assert_close_to_oracle(case.run(), case.truth())


def check_scale_after_softmax(rng):
    """The scale multiplies the scores, inside the exponent, not the probabilities or the output."""
    case = make_case(rng, [4, 9, 12], q_mult=2.0)
    for scale in (None, 0.1, 3.0):
        assert_close_to_oracle(case.run(scale), case.truth(scale))


def check_softmax_in_bf16(rng):
    """fp32 inputs keep the softmax in fp32: a bf16 one is ~2e-3 off here, 200x this tolerance."""
    case = make_case(rng, [7, 16, 33], block_size=8, max_blocks=5, head_dim=16, q_mult=2.0)
    assert_close_to_oracle(case.run(), case.truth())


def check_sorting_block_table(rng):
    """Table order is logical order; physical ids are shuffled and must not be sorted."""
    case = make_case(rng, [12, 15], block_size=3, max_blocks=5, num_heads=2, num_kv_heads=1,
                     head_dim=4, q_mult=2.0)
    alibi = dict(alibi_slopes=torch.tensor([0.5, 1.0]))  # position-dependent, so order matters
    assert_close_to_oracle(case.run(**alibi), case.truth(**alibi))
    assert_close_to_oracle(case.run(sliding_window=4), case.truth(sliding_window=4))


def check_keeping_rows_past_n_in_the_last_block(rng):
    """Positions >= n of the last block do not exist (here they hold NaN)."""
    case = make_case(rng, [1, 6, 7], block_size=4)
    assert_close_to_oracle(case.run(), case.truth())


def check_masking_scores_but_not_nan_value_rows(rng):
    """A -inf score gives weight 0, but 0 * NaN = NaN: masked rows must not enter the product."""
    case = make_case(rng, [2, 5], block_size=4, fill=math.nan)
    out = case.run()
    assert torch.isfinite(out).all()
    assert_close_to_oracle(out, case.truth())


def check_sliding_window_off_by_one(rng):
    """Exactly the newest min(W, n) tokens take part: p > n - 1 - W."""
    case = make_case(rng, [5, 9, 2], block_size=4, q_mult=2.0)
    for window in (1, 2, 4):
        out = case.run(sliding_window=window)
        assert_close_to_oracle(out, case.truth(sliding_window=window))
    # W = 1 keeps only the newest token: the output is its V row.
    newest = case.v_cache[int(case.block_tables[1, 2]), 0].repeat_interleave(2, dim=0)
    torch.testing.assert_close(case.run(sliding_window=1)[1], newest, atol=0, rtol=0)


def check_alibi_distance_measured_from_n_instead_of_the_newest_token(rng):
    """ALiBi adds slope * (p - (n - 1)); measured from n, it shifts every logit by -slope, which the
    softmax alone hides but a sink and the lse expose."""
    case = make_case(rng, [3, 8], block_size=4)
    slopes = torch.tensor([1.0, 0.5, 0.25, 2.0])
    sinks = torch.tensor([0.5, 0.0, -0.5, 1.0])
    out, lse = case.run(return_lse=True, alibi_slopes=slopes, sinks=sinks)
    assert_close_to_oracle(out, case.truth(alibi_slopes=slopes, sinks=sinks), lse)
    out_no_sink, lse_no_sink = case.run(return_lse=True, alibi_slopes=slopes)
    assert_close_to_oracle(out_no_sink, case.truth(alibi_slopes=slopes), lse_no_sink)


def check_fp8_scale_multiplied_instead_of_divided_on_write(rng):
    """The fp8 store divides by the scale (and decode multiplies): 3.0 with scale 0.5 stores 6.0."""
    k_cache = torch.zeros(1, 2, 1, 1, dtype=FP8)
    v_cache = torch.zeros(1, 2, 1, 1, dtype=FP8)
    k = torch.tensor([[[3.0]], [[-1.5]]])
    torch_ref.write_kv(k_cache, v_cache, k, k, torch.tensor([0, 1]), k_scale=0.5, v_scale=2.0)
    assert k_cache.float().flatten().tolist() == [6.0, -3.0]
    assert v_cache.float().flatten().tolist() == [1.5, -0.75]


# The planted variants. Each takes pytest's monkeypatch and plants one bug in torch_ref.

REAL_WRITE_KV = torch_ref.write_kv
REAL_DECODE = torch_ref.paged_decode_attention
REAL_ATTEND = torch_ref.attention.attend


def plant_negative_slot_wraps(m):
    def write_kv(k_cache, v_cache, k, v, slot_mapping, **scales):
        # No padding filter: slot -1 is block -1 // bs = -1, offset -1 % bs = bs - 1, the last slot.
        slots = slot_mapping.to(torch.int64)
        bs = k_cache.shape[1]
        k_cache[slots // bs, slots % bs] = k
        v_cache[slots // bs, slots % bs] = v
    m.setattr(torch_ref, "write_kv", write_kv)


def _plant_attend(m, attend):
    m.setattr(torch_ref.attention, "attend", attend)


def plant_repeat(m):
    def attend(q, k, v, *args, **kwargs):
        # Expanding the kv heads with `repeat` (tile): head h reads kv head h % KVH.
        group = q.shape[0] // k.shape[1]
        return REAL_ATTEND(q, k.repeat(1, group, 1), v.repeat(1, group, 1), *args, **kwargs)
    _plant_attend(m, attend)


def _plant_lengths(m, lengths):
    """paged_decode_attention reading ``lengths(context_lens, block_size)`` rows per sequence."""
    def decode(q, k_cache, v_cache, block_tables, context_lens, *args, **kwargs):
        return REAL_DECODE(q, k_cache, v_cache, block_tables,
                           lengths(context_lens, k_cache.shape[1]), *args, **kwargs)
    m.setattr(torch_ref, "paged_decode_attention", decode)


def plant_floor_page_count(m):
    _plant_lengths(m, lambda n, bs: n // bs * bs)  # floor(n / bs) pages: the partial one dropped


def plant_whole_table_row(m):
    def decode(q, k_cache, v_cache, block_tables, *args, **kwargs):
        k_cache[block_tables.to(torch.int64)]  # every entry gathered, garbage tail included
        return REAL_DECODE(q, k_cache, v_cache, block_tables, *args, **kwargs)
    m.setattr(torch_ref, "paged_decode_attention", decode)


def plant_scale_after_softmax(m):
    def attend(q, k, v, n, start, scale, **kwargs):
        # Softmax of the unscaled scores; scaling the probabilities afterwards cancels out in
        # the normalization.
        return REAL_ATTEND(q, k, v, n, start, 1.0, **kwargs)
    _plant_attend(m, attend)


class _TorchWith:
    """torch as torch_ref.attention sees it, with some functions replaced."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(torch, name)


def plant_softmax_in_bf16(m):
    exp = _TorchWith(exp=lambda x: torch.exp(x.to(torch.bfloat16)).to(x.dtype))  # the numerator
    m.setattr(torch_ref.attention, "torch", exp)


def plant_sorted_block_table(m):
    def decode(q, k_cache, v_cache, block_tables, context_lens, *args, **kwargs):
        tables = block_tables.clone()
        for b, n in enumerate(context_lens.tolist()):
            pages = -(-n // k_cache.shape[1])
            tables[b, :pages] = torch.sort(tables[b, :pages]).values
        return REAL_DECODE(q, k_cache, v_cache, tables, context_lens, *args, **kwargs)
    m.setattr(torch_ref, "paged_decode_attention", decode)


def plant_rows_past_n(m):
    _plant_lengths(m, lambda n, bs: -(-n // bs) * bs)  # the whole last block read


def plant_masked_scores_with_value_rows(m):
    true_lengths = []

    def attend(q, k, v, n, start, scale, **kwargs):
        # The rows past the true length get score -inf, so weight exactly 0, but still enter the
        # weighted sum: 0 * NaN = NaN.
        keep = true_lengths.pop(0) - start
        out, lse = REAL_ATTEND(q, k[:keep], v[:keep], start + keep, start, scale, **kwargs)
        group = q.shape[0] // v.shape[1]
        masked = v[keep:].repeat_interleave(group, dim=1)  # [rows, H, D]
        weights = torch.zeros(q.shape[0], masked.shape[0])
        return out + torch.einsum("hp,phd->hd", weights, masked), lse

    def decode(q, k_cache, v_cache, block_tables, context_lens, *args, **kwargs):
        true_lengths[:] = context_lens.tolist()
        bs = k_cache.shape[1]
        return REAL_DECODE(q, k_cache, v_cache, block_tables, -(-context_lens // bs) * bs, *args,
                           **kwargs)

    _plant_attend(m, attend)
    m.setattr(torch_ref, "paged_decode_attention", decode)


def plant_window_off_by_one(m):
    m.setattr(torch_ref.attention, "_window_start",
              lambda n, w: 0 if w is None else max(0, n - w - 1))  # W + 1 tokens


def plant_alibi_from_n(m):
    # attend's only arange numbers the positions for ALiBi: one lower, the distance is p - n.
    arange = _TorchWith(arange=lambda start, end, **kw: torch.arange(start - 1, end - 1, **kw))
    m.setattr(torch_ref.attention, "torch", arange)


def plant_fp8_scale_multiplied(m):
    def quantize_fp8(x, scale):
        return (x.to(torch.float32) * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    m.setattr(torch_ref.cache, "quantize_fp8", quantize_fp8)


# check -> (plant, what the check may fail with besides an assertion)
BUGS = {
    check_negative_slot_wraps_to_last_slot: (plant_negative_slot_wraps, ()),
    check_repeat_instead_of_repeat_interleave: (plant_repeat, ()),
    check_floor_instead_of_ceil_page_count: (plant_floor_page_count, ()),
    check_reading_whole_table_row: (plant_whole_table_row, (IndexError,)),  # faults on 99999
    check_scale_after_softmax: (plant_scale_after_softmax, ()),
    check_softmax_in_bf16: (plant_softmax_in_bf16, ()),
    check_sorting_block_table: (plant_sorted_block_table, ()),
    check_keeping_rows_past_n_in_the_last_block: (plant_rows_past_n, ()),
    check_masking_scores_but_not_nan_value_rows: (plant_masked_scores_with_value_rows, ()),
    check_sliding_window_off_by_one: (plant_window_off_by_one, ()),
    check_alibi_distance_measured_from_n_instead_of_the_newest_token: (plant_alibi_from_n, ()),
    check_fp8_scale_multiplied_instead_of_divided_on_write: (plant_fp8_scale_multiplied, ()),
}


@pytest.mark.parametrize("check", list(BUGS), ids=lambda f: f.__name__.removeprefix("check_"))
def test_bug(check, monkeypatch, request):
    """The check passes on torch_ref, fails on torch_ref with the bug planted, and passes again
    once the plant is gone, every time on the same inputs."""
    plant, also = BUGS[check]
    seed = zlib.crc32(request.node.nodeid.encode())
    check(np.random.default_rng(seed))
    with monkeypatch.context() as m:
        plant(m)
        with pytest.raises((AssertionError, *also)):
            check(np.random.default_rng(seed))
    check(np.random.default_rng(seed))


def test_every_check_has_its_bug():
    """Every bug check has a planted bug, and every plant a check."""
    checks = {name for name, f in globals().items() if name.startswith("check_") and callable(f)}
    assert checks == {f.__name__ for f in BUGS}

"""Bad input: a ValueError naming the argument, the same in torch_ref and pallas_paged; and what the
jitted functions do with values they cannot check (SPEC.md, "Input classes").

- Static checks (ranks, shapes, dtypes, options, configs): raised by every implementation, eagerly
  and at trace time.
- Eager value checks: `write_kv`, `decode` and `paged_attention` called eagerly (``check_values``
  on, the default) refuse a bad slot, length, block id, ``query_start_loc`` or fp8 scale with
  torch_ref's message, word for word, and a refused write leaves the cache as it was; under
  ``jax.jit`` the same values follow SPEC.md's rules (slots dropped, lengths and ids clamped,
  ``query_start_loc`` sanitized), and ``check_values=False`` skips the checks eagerly.
- Messages: a torch tensor given to pallas_paged says to convert it; a traced python-valued
  option says to mark it static and lists the static options; dtypes print as bare names.
- Input classes: every class of SPEC.md's table through torch_ref, the XLA path and the Pallas
  kernel: all agree (writes bit for bit, attention within the tolerance rule) or all raise the
  same ValueError. int64 classes run with numpy int64 (x64 off) and real JAX int64 (x64 on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_paged as pp
import torch_ref
from pallas_paged._validation import STATIC_OPTIONS
from pallas_paged.cache_write.api import _write_kv_jit
from pallas_paged.decode_attention.api import _decode_jit
from paged_inputs import (FP8, IMPLS, NP_DTYPES, assert_close, bits, make_paged,
                          make_ragged, reference, to_numpy, to_torch, write_torch)

DECODE_IMPLS = ("xla", "pallas", "mosaic", "auto")  # every value check runs before a kernel


def f32(x):
    return np.asarray(x, np.float32)


@pytest.fixture
def paged(rng):
    return make_paged(rng, lens=[5, 9], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                      fill=0.0)


# --- decode: static checks at trace time, shared by both impls ---------------------------------

STATIC_DECODE_CASES = {
    "q rank": (dict(q=np.zeros((2, 4), np.float32)), r"q must have rank 3"),
    "heads not divisible": (dict(q=np.zeros((2, 3, 32), np.float32)), r"multiple of num_kv_heads"),
    "head_dim mismatch": (dict(q=np.zeros((2, 4, 16), np.float32)), r"head_dim mismatch"),
    "cache rank": (dict(k_cache=np.zeros((8, 4, 64), np.float32)), r"k_cache must have rank 4"),
    "caches differ": (dict(v_cache=np.zeros((9, 4, 2, 32), np.float32)), r"same shape"),
    "cache dtype": (dict(k_cache=np.zeros((8, 4, 2, 32), np.int32),
                         v_cache=np.zeros((8, 4, 2, 32), np.int32)), r"k_cache.dtype"),
    "q dtype": (dict(q=np.zeros((2, 4, 32), np.int32)), r"q.dtype"),
    "tables batch": (dict(block_tables=np.zeros((3, 3), np.int32)), r"batch mismatch"),
    "tables rank": (dict(block_tables=np.zeros((2,), np.int32)), r"block_tables must have rank 2"),
    "tables float": (dict(block_tables=np.zeros((2, 3), np.float32)), r"block_tables must be int32"),
    "lens batch": (dict(context_lens=np.zeros((3,), np.int32)), r"context_lens.shape"),
    "lens float": (dict(context_lens=np.zeros((2,), np.float32)), r"context_lens must be int32"),
    "lens int16": (dict(context_lens=np.zeros((2,), np.int16)), r"context_lens must be int32 or int64"),
    "tables bool": (dict(block_tables=np.zeros((2, 3), np.bool_)), r"block_tables must be int32 or int64"),
    "mixed q / cache dtypes": (dict(q=np.zeros((2, 4, 32), np.float16)),
                               r"q.dtype=float16 must equal k_cache.dtype=float32"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(STATIC_DECODE_CASES))
def test_decode_static_errors(paged, impl, case):
    """Wrong ranks, shapes and dtypes: a ValueError naming the argument, from the call alone."""
    overrides, match = STATIC_DECODE_CASES[case]
    if "k_cache" in overrides and "v_cache" not in overrides:
        overrides = dict(overrides, v_cache=overrides["k_cache"])
    with pytest.raises(ValueError, match=match):
        pp.decode(*paged.jax(**overrides), impl=impl)


OPTION_CASES = {
    "soft cap zero": (dict(logits_soft_cap=0.0), r"logits_soft_cap"),
    "soft cap negative": (dict(logits_soft_cap=-1.0), r"logits_soft_cap"),
    "window zero": (dict(sliding_window=0), r"sliding_window"),
    "window float": (dict(sliding_window=2.5), r"sliding_window"),
    "slopes shape": (dict(alibi_slopes=jnp.zeros((3,), jnp.float32)), r"alibi_slopes.shape"),
    "slopes dtype": (dict(alibi_slopes=jnp.zeros((4,), jnp.bfloat16)), r"alibi_slopes.dtype"),
    "sinks shape": (dict(sinks=jnp.zeros((4, 1), jnp.float32)), r"sinks must have rank 1"),
    "scales on bf16": (dict(k_scale=1.0, v_scale=1.0), r"float8_e4m3fn caches only"),
    "scale nan": (dict(scale=float("nan")), r"scale"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_decode_option_errors(paged, impl, case):
    """Bad extension options: a ValueError naming the option."""
    options, match = OPTION_CASES[case]
    with pytest.raises(ValueError, match=match):
        pp.decode(*paged.jax(), impl=impl, **options)


def test_fp8_cache_needs_scales(rng):
    """An fp8 cache needs both scales, python floats or f32 arrays of shape () or (1,), in range."""
    paged = make_paged(rng, lens=[3], dtype=FP8, fill=0.0)
    with pytest.raises(ValueError, match="k_scale is required"):
        pp.decode(*paged.jax())
    with pytest.raises(ValueError, match="v_scale"):
        pp.decode(*paged.jax(), k_scale=1.0, v_scale=-1.0)
    with pytest.raises(ValueError, match=r"k_scale must be a python float or a float32 array"):
        pp.decode(*paged.jax(), k_scale=jnp.ones((2,), jnp.float32), v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale must be a python float or a float32 array"):
        pp.decode(*paged.jax(), k_scale=1.0, v_scale=jnp.ones((), jnp.bfloat16))
    pp.validate_decode_inputs(*paged.jax(), k_scale=jnp.float32(0.5), v_scale=jnp.ones((1,), jnp.float32))
    with pytest.raises(ValueError, match=r"k_scale=-0.5 must be finite and in \[2\*\*-60, 2\*\*60\]"):
        pp.validate_decode_inputs(*paged.jax(), k_scale=jnp.float32(-0.5), v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale=inf must be finite and in \[2\*\*-60, 2\*\*60\]"):
        pp.validate_decode_inputs(*paged.jax(), k_scale=0.5, v_scale=jnp.float32(np.inf))


def test_unknown_impl_and_bad_config(paged):
    """An unknown impl and a config that is no DecodeConfig are refused, named."""
    with pytest.raises(ValueError, match="impl='triton'"):
        pp.decode(*paged.jax(), impl="triton")
    with pytest.raises(ValueError, match="config must be a DecodeConfig"):
        pp.decode(*paged.jax(), config=("block_k", 16))


@pytest.mark.parametrize("field,value", [("block_k", 24), ("block_k", 8), ("num_splits", 0),
                                         ("num_warps", 3), ("num_stages", 0), ("block_k", True),
                                         ("merge_in_kernel", 1), ("merge_in_kernel", "yes"),
                                         ("fp8_v_at_load", 1), ("fp8_v_at_load", None),
                                         ("fp8_pairs", 1), ("fp8_pairs", "yes"),
                                         ("persistent_programs", -1),
                                         ("persistent_programs", True),
                                         ("persistent_programs", 2.0)])
def test_config_rejects_bad_knobs(field, value):
    """Every DecodeConfig field refuses values of the wrong type or range, naming the field."""
    with pytest.raises(ValueError, match=f"DecodeConfig.{field}"):
        pp.DecodeConfig(**{field: value})


def test_config_refuses_persistent_programs_with_splits():
    """Persistent programs deal whole sequences: a split count besides them is refused, naming
    both values."""
    with pytest.raises(ValueError, match=r"persistent_programs=8 .* num_splits=1, not 2"):
        pp.DecodeConfig(num_splits=2, persistent_programs=8)
    assert pp.DecodeConfig(persistent_programs=8).num_splits == 1


def test_config_is_hashable_and_frozen():
    """Configs are frozen and hash by value (they key jit caches)."""
    config = pp.DecodeConfig(block_k=32, num_splits=4)
    assert hash(config) == hash(pp.DecodeConfig(block_k=32, num_splits=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_k = 64


def test_validate_decode_accepts_good_inputs_and_garbage_tails(paged):
    """Garbage past a row's used entries passes validation."""
    tables = paged.block_tables.copy()
    tables[0, 2] = 99999  # past ceil(5 / 4) = 2 pages: garbage is fine
    pp.validate_decode_inputs(*paged.jax(block_tables=tables))


@pytest.mark.parametrize("lens,tables_patch,match", [
    ([-1, 9], None, r"context_lens\[0\]=-1 must be >= 0"),
    ([5, 13], None, r"context_lens\[1\]=13 exceeds the table's capacity"),
    ([5, 9], (1, 2, 99999), r"block_tables\[1, 2\]=99999 is outside \[0, num_blocks\)"),
    ([5, 9], (0, 0, -1), r"block_tables\[0, 0\]=-1 is outside"),
])
def test_validate_decode_rejects_bad_values(paged, lens, tables_patch, match):
    """Negative or too-long lengths and bad ids in the valid part: a ValueError naming the index."""
    tables = paged.block_tables.copy()
    if tables_patch:
        b, i, value = tables_patch
        tables[b, i] = value
    with pytest.raises(ValueError, match=match):
        pp.validate_decode_inputs(*paged.jax(block_tables=tables,
                                             context_lens=np.array(lens, np.int32)))


def test_validate_decode_runs_static_checks(paged):
    """validate_decode_inputs runs the static checks too."""
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        pp.validate_decode_inputs(*paged.jax(q=np.zeros((2, 3, 32), np.float32)))


# --- write: static checks ------------------------------------------------------------------------

def _write_args(num_tokens=3, **overrides):
    args = dict(k_cache=jnp.zeros((4, 4, 2, 8), jnp.float32),
                v_cache=jnp.zeros((4, 4, 2, 8), jnp.float32),
                k=jnp.ones((num_tokens, 2, 8), jnp.float32),
                v=jnp.ones((num_tokens, 2, 8), jnp.float32),
                slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32))
    args.update(overrides)
    return args


STATIC_WRITE_CASES = {
    "k shape": (dict(k=jnp.ones((3, 2, 4), jnp.float32)), r"k.shape=\(3, 2, 4\)"),
    "v tokens": (dict(v=jnp.ones((2, 2, 8), jnp.float32)), r"v.shape=\(2, 2, 8\)"),
    "k dtype": (dict(k=jnp.ones((3, 2, 8), jnp.bfloat16)), r"k.dtype=bfloat16 must equal"),
    "slots float": (dict(slot_mapping=jnp.zeros((3,), jnp.float32)), r"slot_mapping must be int32"),
    "slots rank": (dict(slot_mapping=jnp.zeros((3, 1), jnp.int32)), r"slot_mapping must have rank 1"),
    "cache rank": (dict(k_cache=jnp.zeros((16, 2, 8), jnp.float32)), r"k_cache must have rank 4"),
    "cache dtypes": (dict(v_cache=jnp.zeros((4, 4, 2, 8), jnp.bfloat16)), r"same dtype"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(STATIC_WRITE_CASES))
def test_write_static_errors(impl, case):
    """Wrong token shapes, dtypes, slot dtypes or ranks, cache ranks or dtypes: refused by the call,
    naming the argument."""
    overrides, match = STATIC_WRITE_CASES[case]
    with pytest.raises(ValueError, match=match):
        pp.write_kv(**_write_args(**overrides), impl=impl)


def test_write_fp8_scales():
    """An fp8 cache needs its scales, other caches refuse them; an unknown impl is refused."""
    fp8 = dict(k_cache=jnp.zeros((4, 4, 2, 8), jnp.float8_e4m3fn),
               v_cache=jnp.zeros((4, 4, 2, 8), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="k_scale is required"):
        pp.write_kv(**_write_args(**fp8))
    with pytest.raises(ValueError, match="float8_e4m3fn caches only"):
        pp.write_kv(**_write_args(), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="impl='scatter'"):
        pp.write_kv(**_write_args(), impl="scatter")


@pytest.mark.parametrize("slots,match", [
    ([0, -2, 1], r"slot_mapping\[1\]=-2 is out of range"),
    ([0, 1, 16], r"slot_mapping\[2\]=16 is out of range"),
    ([4, -1, 4], r"slot_mapping\[2\]=4 is a duplicate"),
])
def test_validate_write_rejects_bad_slots(slots, match):
    """Slots below -1, past the cache, or used twice: a ValueError naming the first bad token."""
    with pytest.raises(ValueError, match=match):
        pp.validate_write_inputs(**_write_args(slot_mapping=jnp.array(slots, jnp.int32)))


def test_validate_write_accepts_padding():
    """Several -1 slots are padding, not duplicates."""
    pp.validate_write_inputs(**_write_args(slot_mapping=jnp.array([-1, 15, -1], jnp.int32)))


def test_fp8_caches_the_kernel_cannot_address():
    """1-byte caches of 2**31..2**32 elements: the decode kernel refuses, the write falls back to
    XLA (checked on abstract shapes: nothing is allocated)."""
    cache = jax.ShapeDtypeStruct((150_000, 16, 8, 128), jnp.float8_e4m3fn)  # 2.46e9 elements
    q = jax.ShapeDtypeStruct((2, 32, 128), jnp.bfloat16)
    tables, lens = jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    scales = dict(k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="cannot address a float8_e4m3fn cache"):
        jax.eval_shape(lambda *a: pp.decode(*a, impl="pallas", **scales), q, cache, cache, tables, lens)
    jax.eval_shape(lambda *a: pp.decode(*a, impl="xla", **scales), q, cache, cache, tables, lens)
    rows = jax.ShapeDtypeStruct((3, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match="cannot address a float8_e4m3fn cache"):
        jax.eval_shape(lambda *a: pp.write_kv(*a, impl="pallas", **scales), cache, cache, rows, rows, slots)
    jax.eval_shape(lambda *a: pp.write_kv(*a, **scales), cache, cache, rows, rows, slots)


# --- ragged: the same errors in torch_ref and pallas_paged ---------------------------------------

def _ragged_error_cases():
    """name -> (overrides of the valid problem of `_ragged_problem`, message pattern)."""
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


RAGGED_ERRORS = _ragged_error_cases()
RAGGED_STATIC_ERRORS = ("qsl_wrong_length", "qsl_float", "qsl_rank", "head_dim", "gqa", "batch")


def _ragged_problem(rng):
    """A valid problem: 2 sequences, (q_len, n) = (4, 8) and (1, 4), tables of 3 blocks of 4."""
    return make_ragged(rng, [(4, 8), (1, 4)], pad=1, block_size=4, max_blocks=3)


@pytest.mark.parametrize("case", list(RAGGED_ERRORS))
def test_ragged_errors_torch_ref_and_pallas_paged(rng, case):
    """torch_ref, `validate_attention_inputs` and an eager `paged_attention` of each impl raise
    the same error."""
    overrides, pattern = RAGGED_ERRORS[case]
    arrays = _ragged_problem(rng).arrays(**overrides)
    with pytest.raises(ValueError, match=pattern):
        torch_ref.paged_attention(*[to_torch(a) for a in arrays])
    with pytest.raises(ValueError, match=pattern):
        pp.validate_attention_inputs(*[jnp.asarray(a) for a in arrays])
    for impl in IMPLS:
        with pytest.raises(ValueError, match=pattern):
            pp.paged_attention(*[jnp.asarray(a) for a in arrays], impl=impl)


@pytest.mark.parametrize("case", RAGGED_STATIC_ERRORS)
def test_ragged_static_errors_at_trace_time(rng, case):
    """Shape and dtype errors raise under jax.jit too, where no value is known."""
    overrides, pattern = RAGGED_ERRORS[case]
    arrays = [jnp.asarray(a) for a in _ragged_problem(rng).arrays(**overrides)]
    for impl in IMPLS:
        with pytest.raises(ValueError, match=pattern):
            jax.jit(functools.partial(pp.paged_attention, impl=impl))(*arrays)


def test_ragged_option_and_config_errors(rng):
    """Bad options, impls and configs of paged_attention, and torch_ref's check of
    query_start_loc."""
    arrays = [jnp.asarray(a) for a in _ragged_problem(rng).arrays()]
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


# --- eager value checks: torch_ref's message; jit: SPEC.md's rule --------------------------------

def torch_error(fn, *args, **kwargs) -> str:
    """The message of the ValueError torch_ref raises."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def assert_same_error(message: str, fn, *args, **kwargs) -> None:
    """``fn`` raises a ValueError with exactly ``message``."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert str(info.value) == message


# A write of 6 tokens into 32 blocks of 16 slots (512), one of them padding.
WRITE_SLOTS = (17, -1, 300, 511, 0, 42)
BAD_SLOTS = {
    "slot 519 of 512": (3, 519),
    "slot -5": (1, -5),
    "duplicate slot": (5, 300),
}


def bad_write(rng, name, dtype="float32"):
    token_dtype = "bfloat16" if dtype == FP8 else dtype
    k_cache, v_cache = rng.standard_normal((2, 32, 16, 2, 16)).astype(NP_DTYPES[dtype])
    k, v = rng.standard_normal((2, len(WRITE_SLOTS), 2, 16)).astype(NP_DTYPES[token_dtype])
    slots = np.array(WRITE_SLOTS, np.int32)
    if name is not None:
        index, value = BAD_SLOTS[name]
        slots[index] = value
    return k_cache, v_cache, k, v, slots


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(BAD_SLOTS))
def test_eager_write_refuses_bad_slots_as_torch_ref_does(rng, impl, name):
    """An eager write with a slot out of range or used twice raises torch_ref's ValueError, word
    for word (as does `validate_write_inputs`), and both caches keep every bit: torch_ref's
    (written in place) and the JAX arrays given (not donated, not deleted)."""
    k_cache, v_cache, k, v, slots = bad_write(rng, name)
    torch_k, torch_v = to_torch(k_cache), to_torch(v_cache)
    message = torch_error(torch_ref.write_kv, torch_k, torch_v, to_torch(k), to_torch(v),
                          torch.from_numpy(slots))
    np.testing.assert_array_equal(bits(torch_k), bits(k_cache))
    np.testing.assert_array_equal(bits(torch_v), bits(v_cache))
    args = [jnp.asarray(x) for x in (k_cache, v_cache, k, v, slots)]
    assert_same_error(message, pp.write_kv, *args, impl=impl)
    assert_same_error(message, pp.validate_write_inputs, *args)
    assert not args[0].is_deleted() and not args[1].is_deleted()
    np.testing.assert_array_equal(bits(args[0]), bits(k_cache))
    np.testing.assert_array_equal(bits(args[1]), bits(v_cache))


JIT_WRITE = {impl: jax.jit(functools.partial(pp.write_kv, impl=impl)) for impl in IMPLS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(BAD_SLOTS))
@pytest.mark.parametrize("how", ["jit", "check_values=False"])
def test_unchecked_write_follows_spec_rules(rng, impl, name, how):
    """Under jax.jit (and eagerly with ``check_values=False``) a slot out of range is dropped:
    the caches torch_ref leaves with that token's slot -1, bit for bit; of two tokens on one slot
    one wins, and nothing else changes."""
    k_cache, v_cache, k, v, slots = bad_write(rng, name)
    args = [jnp.asarray(x) for x in (k_cache, v_cache, k, v, slots)]
    if how == "jit":
        got = JIT_WRITE[impl](*args)
    else:
        got = pp.write_kv(*args, impl=impl, check_values=False)
    if name != "duplicate slot":
        kept = np.where((slots >= 0) & (slots < 512), slots, -1)
        expected = write_torch(k_cache, v_cache, k, v, kept)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(bits(g), bits(e))
        return
    for cache, new, out in ((k_cache, k, got[0]), (v_cache, v, got[1])):
        flat_in, flat_out = cache.reshape(512, -1), np.asarray(out).reshape(512, -1)
        for slot in range(512):
            writers = np.flatnonzero(slots == slot)
            if len(writers) == 0:
                np.testing.assert_array_equal(bits(flat_out[slot]), bits(flat_in[slot]))
            else:
                candidates = new[writers].reshape(len(writers), -1)
                assert (flat_out[slot][None] == candidates).any(axis=0).all(), f"slot {slot}"


BAD_SCALES = {"1e-40": 1e-40, "0": 0.0, "inf": float("inf"), "2**61": 2.0**61}


@pytest.mark.parametrize("form", ["python float", "f32[] array"])
@pytest.mark.parametrize("scale", list(BAD_SCALES))
def test_fp8_scales_outside_the_range_are_refused_as_torch_ref_does(rng, scale, form):
    """A k_scale of 1e-40, 0, inf or 2**61 (outside [2**-60, 2**60]) is refused by torch_ref,
    by an eager `write_kv` (both impls, the cache untouched), `decode` and `paged_attention`,
    with torch_ref's message; as a python float (static) also under jax.jit."""
    value = BAD_SCALES[scale]
    k_cache, v_cache, k, v, slots = bad_write(rng, None, dtype=FP8)
    if form == "python float":
        jax_scale, torch_scale = value, value
    else:
        jax_scale, torch_scale = jnp.float32(value), torch.tensor(np.float32(value))
    torch_k = to_torch(k_cache)
    message = torch_error(torch_ref.write_kv, torch_k, to_torch(v_cache), to_torch(k), to_torch(v),
                          torch.from_numpy(slots), k_scale=torch_scale, v_scale=0.5)
    np.testing.assert_array_equal(bits(torch_k), bits(k_cache))
    args = [jnp.asarray(x) for x in (k_cache, v_cache, k, v, slots)]
    for impl in IMPLS:
        assert_same_error(message, pp.write_kv, *args, k_scale=jax_scale, v_scale=0.5, impl=impl)
    np.testing.assert_array_equal(bits(args[0]), bits(k_cache))
    paged = make_paged(rng, lens=[5, 9], dtype=FP8, fill=0.0)
    decode_message = torch_error(torch_ref.paged_decode_attention, *paged.torch(),
                                 k_scale=torch_scale, v_scale=0.5)
    assert decode_message == message
    for impl in DECODE_IMPLS:
        assert_same_error(message, pp.decode, *paged.jax(), k_scale=jax_scale, v_scale=0.5,
                          impl=impl)
    qsl = jnp.arange(3, dtype=jnp.int32)
    for impl in IMPLS:
        assert_same_error(message, pp.paged_attention, *paged.jax(), qsl, k_scale=jax_scale,
                          v_scale=0.5, impl=impl)
    if form == "python float":
        with pytest.raises(ValueError, match=r"k_scale=.* must be finite and in"):
            jax.jit(functools.partial(pp.write_kv, k_scale=value, v_scale=0.5))(*args)


# A decode batch of 3 over tables of 4 blocks of 16 (capacity 64).
def bad_decode(rng, dtype="bfloat16"):
    return make_paged(rng, lens=[40, 64, 7], num_heads=8, num_kv_heads=2, head_dim=64,
                      block_size=16, max_blocks=4, dtype=dtype, fill=0.0)


def _with_length(value):
    def patch(p):
        lens = p.context_lens.copy()
        lens[1] = value
        return dict(context_lens=lens)
    return patch


def _with_block_id(value):
    def patch(p):
        tables = p.block_tables.copy()
        tables[0, 2] = value  # n = 40: entries 0-2 are the valid part
        return dict(block_tables=tables)
    return patch


BAD_DECODE_VALUES = {
    "length 74 over a capacity of 64": (_with_length(74), dict(context_lens=(1, 64))),
    "length -3": (_with_length(-3), dict(context_lens=(1, 0))),
    "block id 1000 in the valid part": (_with_block_id(1000), "clip"),
}


@pytest.mark.parametrize("name", list(BAD_DECODE_VALUES))
def test_eager_decode_refuses_bad_values_as_torch_ref_does(rng, name):
    """An eager `decode` of every impl (and `paged_attention` of each, and
    `validate_decode_inputs`) raises torch_ref's ValueError, word for word."""
    p = bad_decode(rng)
    patch, _ = BAD_DECODE_VALUES[name]
    bad = patch(p)
    message = torch_error(torch_ref.paged_decode_attention, *p.torch(**bad))
    for impl in DECODE_IMPLS:
        assert_same_error(message, pp.decode, *p.jax(**bad), impl=impl)
    assert_same_error(message, pp.validate_decode_inputs, *p.jax(**bad))
    qsl = np.arange(4, dtype=np.int32)
    ragged_message = torch_error(torch_ref.paged_attention, *p.torch(**bad), torch.from_numpy(qsl))
    assert ragged_message == message
    for impl in IMPLS:
        assert_same_error(message, pp.paged_attention, *p.jax(**bad), jnp.asarray(qsl), impl=impl)


JIT_DECODE = {impl: jax.jit(functools.partial(pp.decode, impl=impl, return_lse=True))
              for impl in IMPLS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(BAD_DECODE_VALUES))
def test_jitted_decode_clamps_bad_values(rng, impl, name):
    """Under jax.jit the same values follow SPEC.md's rule: a length clamps into [0, capacity],
    a block id of the valid part into [0, num_blocks); bit for bit the result of the clamped
    inputs, and eagerly with ``check_values=False`` too."""
    p = bad_decode(rng)
    patch, fixed = BAD_DECODE_VALUES[name]
    bad = patch(p)
    if fixed == "clip":
        fixed = dict(block_tables=np.clip(bad["block_tables"], 0, p.k_cache.shape[0] - 1))
    else:
        (key, (index, value)), = fixed.items()
        array = p.context_lens.copy()
        array[index] = value
        fixed = {key: array}
    got = JIT_DECODE[impl](*p.jax(**bad))
    want = JIT_DECODE[impl](*p.jax(**fixed))
    unchecked = pp.decode(*p.jax(**bad), impl=impl, return_lse=True, check_values=False)
    for g, u, w in zip(got, unchecked, want):
        np.testing.assert_array_equal(bits(g), bits(w))
        np.testing.assert_array_equal(bits(u), bits(w))
    if name == "length -3":
        assert not np.asarray(got[0])[1].any() and np.isneginf(np.asarray(got[1])[1]).all()


def _ragged(rng):
    """(q_len, n) = (4, 20), (2, 2), (3, 9): 9 query rows, 1 padding row; capacity 3 * 8."""
    return make_ragged(rng, [(4, 20), (2, 2), (3, 9)], pad=1, num_heads=4, num_kv_heads=2,
                       block_size=8, max_blocks=3, fill=0.0)


BAD_QUERY_START_LOC = {
    # name -> (bad query_start_loc, the jit rule's reading of it)
    "not starting at 0": ([2, 4, 6, 9], [0, 4, 6, 9]),
    "decreasing": ([0, 4, 3, 9], [0, 4, 4, 9]),
    "past num_tokens": ([0, 4, 6, 99], [0, 4, 6, 10]),
}


@pytest.mark.parametrize("name", list(BAD_QUERY_START_LOC) + ["q_len > context_len"])
def test_eager_paged_attention_refuses_bad_query_start_loc_as_torch_ref_does(rng, name):
    """query_start_loc not starting at 0, decreasing or past num_tokens, or q_len > context_len: an
    eager call of each impl and validate_attention_inputs raise torch_ref's ValueError, word
    for word."""
    r = _ragged(rng)
    if name == "q_len > context_len":
        bad = dict(context_lens=np.array([20, 1, 9], np.int32))
    else:
        bad = dict(query_start_loc=np.array(BAD_QUERY_START_LOC[name][0], np.int32))
    message = torch_error(torch_ref.paged_attention, *r.torch(**bad))
    for impl in IMPLS:
        assert_same_error(message, pp.paged_attention, *r.jax(**bad), impl=impl)
    assert_same_error(message, pp.validate_attention_inputs, *r.jax(**bad))


JIT_RAGGED = {impl: jax.jit(functools.partial(pp.paged_attention, impl=impl, return_lse=True))
              for impl in IMPLS}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(BAD_QUERY_START_LOC))
def test_jitted_paged_attention_sanitizes_query_start_loc(rng, impl, name):
    """Under jax.jit ``query_start_loc`` is clamped into [0, num_tokens], made non-decreasing and
    starts at 0: bit for bit the call with the sanitized array (eagerly with
    ``check_values=False`` too)."""
    r = _ragged(rng)
    bad, sane = (np.array(x, np.int32) for x in BAD_QUERY_START_LOC[name])
    got = JIT_RAGGED[impl](*r.jax(query_start_loc=bad))
    want = JIT_RAGGED[impl](*r.jax(query_start_loc=sane))
    unchecked = pp.paged_attention(*r.jax(query_start_loc=bad), impl=impl, return_lse=True,
                                   check_values=False)
    for g, u, w in zip(got, unchecked, want):
        np.testing.assert_array_equal(bits(g), bits(w))
        np.testing.assert_array_equal(bits(u), bits(w))


@pytest.mark.parametrize("impl", IMPLS)
def test_jitted_paged_attention_queries_before_position_0_see_nothing(rng, impl):
    """``q_len_b > context_lens[b]`` under jax.jit: the queries at negative positions give zeros
    (lse -inf); the others see what they would with only the last ``n`` queries."""
    r = _ragged(rng)
    lens = np.array([20, 1, 9], np.int32)  # sequence 1: 2 new tokens but n = 1
    out, lse = (np.asarray(x) for x in JIT_RAGGED[impl](*r.jax(context_lens=lens)))
    assert not out[4].any() and np.isneginf(lse[4]).all()
    rows = [0, 1, 2, 3, 5, 6, 7, 8, 9]  # row 5: sequence 1's last query, at position 0
    qsl = np.array([0, 4, 5, 8], np.int32)
    ref = reference(*r.arrays(q=r.q[rows], context_lens=lens)[:5], query_start_loc=qsl)
    assert_close(ref, out[rows], lse[rows])


# --- messages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argument", ["q", "k_cache", "block_tables", "context_lens",
                                      "alibi_slopes"])
def test_a_torch_tensor_is_refused_with_what_to_do(rng, argument):
    """A torch tensor given to `decode` (or `paged_attention`, `write_kv`) raises a ValueError
    naming the argument and saying to convert it, and how."""
    p = make_paged(rng, lens=[5, 9], fill=0.0)
    args = dict(zip(p.ARGS, p.jax()))
    options = {}
    if argument == "alibi_slopes":
        options["alibi_slopes"] = torch.zeros(4)
    else:
        args[argument] = to_torch(getattr(p, argument))
        if argument == "k_cache":
            args["v_cache"] = to_torch(p.v_cache)
    match = rf"{argument} is a torch\.Tensor .*convert it first.*parity\.convert\.from_torch"
    with pytest.raises(ValueError, match=match):
        pp.decode(**args, **options)
    with pytest.raises(ValueError, match=match):
        pp.paged_attention(**args, query_start_loc=jnp.arange(3, dtype=jnp.int32), **options)
    if argument == "k_cache":
        with pytest.raises(ValueError, match=match):
            pp.write_kv(args["k_cache"], args["v_cache"], jnp.zeros((1, 2, 32)),
                        jnp.zeros((1, 2, 32)), jnp.zeros(1, jnp.int32))


@pytest.mark.parametrize("option,value", [("sliding_window", 4), ("scale", 0.25),
                                          ("logits_soft_cap", 5.0)])
@pytest.mark.parametrize("op", ["decode", "paged_attention"])
def test_a_traced_static_option_says_to_mark_it_static(rng, option, value, op):
    """A python-valued option passed through jax.jit as an argument arrives traced: a ValueError
    that names it, says to mark it static and lists the static options."""
    p = make_paged(rng, lens=[5, 9], fill=0.0)
    qsl = jnp.arange(3, dtype=jnp.int32)
    fn = pp.decode if op == "decode" else functools.partial(pp.paged_attention,
                                                              query_start_loc=qsl)
    step = jax.jit(lambda *args, opt: fn(*args, impl="xla", **{option: opt}))
    listed = ", ".join(STATIC_OPTIONS)
    with pytest.raises(ValueError) as info:
        step(*p.jax(), opt=value)
    message = str(info.value)
    assert message.startswith(f"{option} is traced")
    assert "mark it static" in message and f"static_argnames=('{option}'" in message
    assert message.endswith(f"The static options are {listed}")
    assert {"scale", "sliding_window", "logits_soft_cap", "impl", "config"} <= set(STATIC_OPTIONS)
    static = jax.jit(lambda *args, opt: fn(*args, impl="xla", **{option: opt}),
                     static_argnames="opt")
    static(*p.jax(), opt=value)  # marked static, it runs


def _dtype_messages(rng):
    """Messages that name a dtype, from each kind of check."""
    p = make_paged(rng, lens=[5, 9], fill=0.0)
    fp8 = make_paged(rng, lens=[5, 9], dtype=FP8, fill=0.0)
    calls = {
        "mixed q / cache": lambda: pp.decode(*p.jax(q=p.q.astype(np.float16))),
        "cache dtype": lambda: pp.decode(*p.jax(k_cache=p.k_cache.astype(np.int32),
                                                v_cache=p.v_cache.astype(np.int32))),
        "caches differ": lambda: pp.decode(*p.jax(v_cache=p.v_cache.astype(np.float16))),
        "q float64": lambda: pp.decode(*p.arrays(q=p.q.astype(np.float64))),
        "tables float": lambda: pp.decode(*p.jax(block_tables=p.block_tables.astype(np.float32))),
        "slopes bf16": lambda: pp.decode(*p.jax(), alibi_slopes=jnp.zeros(4, jnp.bfloat16)),
        "scale array f64": lambda: pp.decode(*fp8.jax(), k_scale=np.asarray(0.5), v_scale=0.5),
        "fp8 scales on fp32": lambda: pp.decode(*p.jax(), k_scale=0.5, v_scale=0.5),
        "write k dtype": lambda: pp.write_kv(*p.jax()[1:3], jnp.zeros((1, 2, 32), jnp.bfloat16),
                                             jnp.zeros((1, 2, 32), jnp.bfloat16),
                                             jnp.zeros(1, jnp.int32)),
        "slots int16": lambda: pp.write_kv(*p.jax()[1:3], jnp.zeros((1, 2, 32)),
                                           jnp.zeros((1, 2, 32)), np.zeros(1, np.int16)),
    }
    messages = {}
    for name, call in calls.items():
        with pytest.raises(ValueError) as info:
            call()
        messages[name] = str(info.value)
    return messages


def test_dtypes_print_as_bare_names(rng):
    """Every message that names a dtype names it as numpy prints it (``float32``), never as its
    repr (``dtype('float32')``)."""
    for name, message in _dtype_messages(rng).items():
        assert "dtype(" not in message, (name, message)
        assert any(d in message for d in ("float32", "bfloat16", "float16", "float64", "int32",
                                          "int16", "float8_e4m3fn")), (name, message)


# --- input classes: torch_ref, the XLA path and the Pallas kernel agree, or all raise -----------

BIG = 2**32  # int64 values at or past it wrap to small ones when narrowed to int32
INDEX_NAMES = ("slot_mapping", "block_tables", "context_lens")


@dataclasses.dataclass(frozen=True)
class InputClass:
    """``build(rng) -> (arrays, options)``; ``raises``: a regex the ValueError of every
    implementation must match (it names the argument), or None when all must agree."""

    op: str  # "write" or "decode"
    build: Callable
    raises: str | None = None
    static: bool = False  # a shape / dtype / option check: raised under jit too
    int64: bool = False   # run with numpy int64 (x64 off) and with JAX int64 (x64 on)
    slow: bool = False    # an agreeing class whose behaviour another class of the fast set covers


def decode_arrays(rng, *, lens=(5, 9, 0, 1), dtype="bfloat16", q_dtype=None, max_blocks=None,
                  num_heads=4, num_kv_heads=2, head_dim=16, block_size=4):
    p = make_paged(rng, lens=lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=block_size, dtype=dtype, q_dtype=q_dtype,
                   max_blocks=max_blocks)
    return dict(q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, block_tables=p.block_tables,
                context_lens=p.context_lens)


def decoding(patch=None, options=None, **kw):
    """A decode class builder: `decode_arrays(**kw)`, then ``patch(arrays)`` edits them."""
    def build(rng):
        arrays = decode_arrays(rng, **kw)
        if patch is not None:
            patch(arrays)
        return arrays, dict(options or {})
    return build


def write_arrays(rng, *, dtype="float32", num_blocks=5, block_size=4, kvh=2, head_dim=8,
                 slots=(3, -1, 17, 0, 9)):
    shape = (num_blocks, block_size, kvh, head_dim)
    new_dtype = NP_DTYPES["bfloat16" if dtype == FP8 else dtype]
    caches = rng.standard_normal((2, *shape)).astype(NP_DTYPES[dtype])
    k, v = rng.standard_normal((2, len(slots), kvh, head_dim)).astype(new_dtype)
    return dict(k_cache=caches[0], v_cache=caches[1], k=k, v=v,
                slot_mapping=np.asarray(slots, np.int32))


def writing(patch=None, options=None, **kw):
    def build(rng):
        arrays = write_arrays(rng, **kw)
        if patch is not None:
            patch(arrays)
        return arrays, dict(options or {})
    return build


def recast(name, dtype):
    return lambda arrays: arrays.update({name: arrays[name].astype(dtype)})


def as_int64(*names, **entries):
    """A patch: ``names`` become int64; ``entries`` ``{name: [(index, value), ...]}`` set values
    that need int64."""
    def patch(arrays):
        for name in set(names) | set(entries):
            arrays[name] = arrays[name].astype(np.int64)
        for name, items in entries.items():
            for index, value in items:
                arrays[name][index] = value
    return patch


FP8_SCALES = dict(k_scale=0.05, v_scale=0.5)

DECODE_CLASSES = {
    # Dtypes: one per cache dtype; mixed float dtypes are refused, except over an fp8 cache.
    "fp32": InputClass("decode", decoding(dtype="float32")),
    "bf16": InputClass("decode", decoding(dtype="bfloat16"), slow=True),
    "fp16": InputClass("decode", decoding(dtype="float16"), slow=True),
    "fp16 q over a bf16 cache holding 1e5": InputClass(
        "decode", decoding(lambda a: a.update(k_cache=np.full_like(a["k_cache"], 1e5)),
                           dtype="bfloat16", q_dtype="float16"),
        raises=r"q\.dtype.*must equal k_cache\.dtype", static=True),
    "bf16 q over an fp32 cache": InputClass(
        "decode", decoding(dtype="float32", q_dtype="bfloat16"),
        raises=r"q\.dtype.*must equal k_cache\.dtype", static=True),
    "fp32 q over a bf16 cache": InputClass(
        "decode", decoding(dtype="bfloat16", q_dtype="float32"),
        raises=r"q\.dtype.*must equal k_cache\.dtype", static=True),
    "fp8 cache, bf16 q": InputClass("decode", decoding(dtype=FP8, q_dtype="bfloat16",
                                                       options=FP8_SCALES)),
    "fp8 cache, fp16 q": InputClass("decode", decoding(dtype=FP8, q_dtype="float16",
                                                       options=FP8_SCALES), slow=True),
    "fp8 cache, fp32 q": InputClass("decode", decoding(dtype=FP8, q_dtype="float32",
                                                       options=FP8_SCALES), slow=True),
    "fp8 scales as 0-d arrays": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32(0.05), v_scale=f32(0.5))),
        slow=True),
    "fp8 scales as (1,) arrays": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32([0.05]), v_scale=f32(0.5))),
        slow=True),
    "fp8 scale of shape (2,)": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32([0.05, 1.0]), v_scale=0.5)),
        raises=r"k_scale must be a python float or a float32", static=True),
    "fp8 scale array of float64": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=0.05, v_scale=np.asarray(0.5))),
        raises=r"v_scale must be a python float or a float32", static=True),
    "fp8 scale array <= 0": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32(-0.05), v_scale=0.5)),
        raises=r"k_scale=-0\.05\d* must be finite and in \[2\*\*-60, 2\*\*60\]"),
    "fp8 scale 0.0": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=0.0, v_scale=0.5)),
        raises=r"k_scale=0\.0 must be finite and in \[2\*\*-60, 2\*\*60\]", static=True),
    "fp8 scale beyond fp32": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=1e300, v_scale=0.5)),
        raises=r"k_scale=1e\+300 must be finite and in \[2\*\*-60, 2\*\*60\]", static=True),
    "fp8 cache without scales": InputClass(
        "decode", decoding(dtype=FP8), raises=r"k_scale is required", static=True),
    "scales on a bf16 cache": InputClass(
        "decode", decoding(options=FP8_SCALES), raises=r"k_scale / v_scale apply to float8_e4m3fn",
        static=True),
    "q float64": InputClass("decode", decoding(recast("q", np.float64), dtype="float32"),
                            raises=r"q\.dtype", static=True),
    "cache int32": InputClass(
        "decode", decoding(lambda a: a.update(k_cache=np.zeros(a["k_cache"].shape, np.int32),
                                              v_cache=np.zeros(a["v_cache"].shape, np.int32)),
                           dtype="float32"),
        raises=r"k_cache\.dtype", static=True),
    # Ranks and shapes.
    "q rank 2": InputClass("decode", decoding(lambda a: a.update(q=a["q"][:, 0])),
                           raises=r"q must have rank 3", static=True),
    "tables rank 1": InputClass("decode", decoding(lambda a: a.update(
        block_tables=a["block_tables"][:, 0])), raises=r"block_tables must have rank 2", static=True),
    "head_dim mismatch": InputClass("decode", decoding(lambda a: a.update(q=a["q"][..., :8])),
                                    raises=r"head_dim mismatch", static=True),
    "heads not a multiple of kv heads": InputClass(
        "decode", decoding(lambda a: a.update(q=a["q"][:, :3])), raises=r"num_heads must be a multiple",
        static=True),
    "batch mismatch": InputClass("decode", decoding(lambda a: a.update(
        block_tables=a["block_tables"][:3])), raises=r"batch mismatch", static=True),
    "lens batch mismatch": InputClass("decode", decoding(lambda a: a.update(
        context_lens=a["context_lens"][:3])), raises=r"context_lens\.shape", static=True),
    # Index dtypes.
    "tables bool": InputClass("decode", decoding(recast("block_tables", np.bool_)),
                              raises=r"block_tables must be int32 or int64", static=True),
    "tables float": InputClass("decode", decoding(recast("block_tables", np.float32)),
                               raises=r"block_tables must be int32 or int64", static=True),
    "tables int16": InputClass("decode", decoding(recast("block_tables", np.int16)),
                               raises=r"block_tables must be int32 or int64", static=True),
    "lens float": InputClass("decode", decoding(recast("context_lens", np.float32)),
                             raises=r"context_lens must be int32 or int64", static=True),
    # Index values, int32 and int64.
    "int64 indices": InputClass("decode", decoding(as_int64("block_tables", "context_lens")),
                                int64=True, slow=True),
    "int64 garbage beyond int32 in a table tail": InputClass(
        "decode", decoding(as_int64(block_tables=[((0, 2), BIG + 1), ((3, 1), -BIG)])), int64=True),
    "int64 length 2**32 + 1": InputClass(
        "decode", decoding(as_int64(context_lens=[(0, BIG + 1)])),
        raises=r"context_lens\[0\]=4294967297 exceeds the table's capacity", int64=True),
    "int64 length -2**32 + 5": InputClass(
        "decode", decoding(as_int64(context_lens=[(1, 5 - BIG)])),
        raises=r"context_lens\[1\]=-4294967291 must be >= 0", int64=True),
    "int64 block id 2**32 + 1 in the valid part": InputClass(
        "decode", decoding(as_int64(block_tables=[((1, 1), BIG + 1)])),
        raises=r"block_tables\[1, 1\]=4294967297 is outside \[0, num_blocks\)", int64=True),
    "negative length": InputClass("decode", decoding(lens=(5, 0), patch=lambda a: a[
        "context_lens"].__setitem__(1, -1)), raises=r"context_lens\[1\]=-1 must be >= 0"),
    "length beyond capacity": InputClass("decode", decoding(lens=(5, 8), patch=lambda a: a[
        "context_lens"].__setitem__(1, 9)), raises=r"context_lens\[1\]=9 exceeds the table's capacity"),
    "block id out of range": InputClass("decode", decoding(patch=lambda a: a[
        "block_tables"].__setitem__((0, 1), 99)), raises=r"block_tables\[0, 1\]=99 is outside"),
    # Widths and batch 0.
    "tables of width 0, all lengths 0": InputClass("decode", decoding(lens=(0, 0, 0), max_blocks=0)),
    "tables of width 0, a nonzero length": InputClass(
        "decode", decoding(lens=(0, 0), max_blocks=0, patch=lambda a: a["context_lens"].__setitem__(0, 3)),
        raises=r"context_lens\[0\]=3 exceeds the table's capacity"),
    "batch 0": InputClass("decode", decoding(lens=())),
    "all lengths 0": InputClass("decode", decoding(lens=(0, 0)), slow=True),
    # Options: huge, edge and bad values.
    "window 2**31": InputClass("decode", decoding(options=dict(sliding_window=2**31))),
    "window 2**40": InputClass("decode", decoding(options=dict(sliding_window=2**40)), slow=True),
    "window = capacity": InputClass("decode", decoding(lens=(5, 12, 0), options=dict(
        sliding_window=12)), slow=True),
    "window = capacity - 1": InputClass("decode", decoding(lens=(5, 12, 0), options=dict(
        sliding_window=11)), slow=True),
    "window 1": InputClass("decode", decoding(options=dict(sliding_window=1)), slow=True),
    "window 0": InputClass("decode", decoding(options=dict(sliding_window=0)),
                           raises=r"sliding_window=0 must be >= 1", static=True),
    "window float": InputClass("decode", decoding(options=dict(sliding_window=4.0)),
                               raises=r"sliding_window must be a python int", static=True),
    "scale nan": InputClass("decode", decoding(options=dict(scale=float("nan"))),
                            raises=r"scale", static=True),
    "scale beyond fp32": InputClass("decode", decoding(options=dict(scale=1e39)),
                                    raises=r"scale", static=True),
    "negative scale": InputClass("decode", decoding(options=dict(scale=-0.3)), slow=True),
    "soft cap 0": InputClass("decode", decoding(options=dict(logits_soft_cap=0.0)),
                             raises=r"logits_soft_cap=0\.0 must be finite and > 0", static=True),
    "soft cap 1e300": InputClass("decode", decoding(options=dict(logits_soft_cap=1e300)),
                                 raises=r"logits_soft_cap=1e\+300 must be finite", static=True),
    "sinks and slopes": InputClass("decode", decoding(options=dict(
        sinks=f32([0.5, -1.0, 2.0, 0.0]), alibi_slopes=f32([0.25, 0.5, 1.0, 2.0]))), slow=True),
    "sinks shape": InputClass("decode", decoding(options=dict(sinks=f32([0.5, 1.0]))),
                              raises=r"sinks\.shape", static=True),
    "slopes float64": InputClass("decode", decoding(options=dict(alibi_slopes=np.zeros(4))),
                                 raises=r"alibi_slopes\.dtype", static=True),
}

WRITE_CLASSES = {
    "fp32": InputClass("write", writing(dtype="float32")),
    "bf16": InputClass("write", writing(dtype="bfloat16"), slow=True),
    "fp16": InputClass("write", writing(dtype="float16"), slow=True),
    "fp8, float scales": InputClass("write", writing(dtype=FP8, options=FP8_SCALES)),
    "fp8, array scales": InputClass("write", writing(dtype=FP8, options=dict(
        k_scale=f32(0.05), v_scale=f32([0.5]))), slow=True),
    "fp8 scale array nan": InputClass("write", writing(dtype=FP8, options=dict(
        k_scale=f32(np.nan), v_scale=0.5)), raises=r"k_scale=nan must be finite and in \[2\*\*-60, 2\*\*60\]"),
    "fp8 scale of shape (1, 1)": InputClass("write", writing(dtype=FP8, options=dict(
        k_scale=f32([[0.5]]), v_scale=0.5)), raises=r"k_scale must be a python float or a float32",
        static=True),
    "fp8 scale as a string": InputClass("write", writing(dtype=FP8, options=dict(
        k_scale="0.5", v_scale=0.5)), raises=r"k_scale must be a python float", static=True),
    "bf16 k into an fp32 cache": InputClass("write", writing(recast("k", NP_DTYPES["bfloat16"])),
                                            raises=r"k\.dtype", static=True),
    "fp32 k into an fp16 cache": InputClass("write", writing(recast("v", np.float32), dtype="float16"),
                                            raises=r"v\.dtype", static=True),
    "k shape": InputClass("write", writing(lambda a: a.update(k=a["k"][:, :, :4])),
                          raises=r"k\.shape=\(5, 2, 4\)", static=True),
    "slots rank 2": InputClass("write", writing(lambda a: a.update(slot_mapping=a["slot_mapping"][:, None])),
                               raises=r"slot_mapping must have rank 1", static=True),
    "slots bool": InputClass("write", writing(recast("slot_mapping", np.bool_)),
                             raises=r"slot_mapping must be int32 or int64", static=True),
    "slots float": InputClass("write", writing(recast("slot_mapping", np.float32)),
                              raises=r"slot_mapping must be int32 or int64", static=True),
    "slots int16": InputClass("write", writing(recast("slot_mapping", np.int16)),
                              raises=r"slot_mapping must be int32 or int64", static=True),
    "no tokens": InputClass("write", writing(slots=())),
    "only padding": InputClass("write", writing(slots=(-1, -1))),
    "slot -2": InputClass("write", writing(slots=(3, -2)), raises=r"slot_mapping\[1\]=-2 is out of range"),
    "slot = num_slots": InputClass("write", writing(slots=(3, 20)),
                                   raises=r"slot_mapping\[1\]=20 is out of range"),
    "duplicate slot": InputClass("write", writing(slots=(3, -1, 3)),
                                 raises=r"slot_mapping\[2\]=3 is a duplicate"),
    "int64 slots": InputClass("write", writing(as_int64("slot_mapping")), int64=True),
    "int64 slot 2**32 + 5": InputClass(
        "write", writing(as_int64(slot_mapping=[(1, BIG + 5)])),
        raises=r"slot_mapping\[1\]=4294967301 is out of range", int64=True),
    "int64 slot -2**32 + 3": InputClass(
        "write", writing(as_int64(slot_mapping=[(2, 3 - BIG)])),
        raises=r"slot_mapping\[2\]=-4294967293 is out of range", int64=True),
    "int64 slot 2**32 - 1 (wraps to -1)": InputClass(
        "write", writing(as_int64(slot_mapping=[(0, BIG - 1)])),
        raises=r"slot_mapping\[0\]=4294967295 is out of range", int64=True),
}

CLASSES = {**{f"decode: {k}": c for k, c in DECODE_CLASSES.items()},
           **{f"write: {k}": c for k, c in WRITE_CLASSES.items()}}
PARAMS = [pytest.param(name, mode, id=f"{name} [{mode}]",
                       marks=[pytest.mark.slow] if c.slow or mode == "x64" and c.raises is None
                       else [])
          for name, c in CLASSES.items()
          for mode in (("numpy", "x64") if c.int64 else ("numpy",))]


def torch_value(x):
    if isinstance(x, np.ndarray) and x.dtype == np.int16:
        return torch.from_numpy(x.copy())
    return to_torch(x) if isinstance(x, np.ndarray) else x


def run_torch(op, arrays, options):
    t = {name: torch_value(x) for name, x in arrays.items()}
    opts = {name: torch_value(x) for name, x in options.items()}
    if op == "write":
        torch_ref.write_kv(**t, **opts)
        return to_numpy(t["k_cache"]), to_numpy(t["v_cache"])
    out, lse = torch_ref.paged_decode_attention(**t, **opts, return_lse=True)
    return to_numpy(out), to_numpy(lse)


def jax_context(mode):
    return jax.enable_x64(True) if mode == "x64" else contextlib.nullcontext()


def run_jax(op, impl, arrays, options, mode, *, validate=True):
    """``validate_*_inputs`` (unless told not to), then the eager call (which checks values
    itself), with numpy inputs (mode "numpy") or JAX arrays made with x64 on (mode "x64")."""
    with jax_context(mode):
        if mode == "x64":
            given = arrays
            arrays = {name: jnp.asarray(x) for name, x in arrays.items()}
            for name in INDEX_NAMES:
                if name in given and given[name].dtype == np.int64:
                    assert arrays[name].dtype == jnp.int64  # the code is shown real int64
        if op == "write":
            if validate:
                pp.validate_write_inputs(**arrays, **options)
            return tuple(map(np.asarray, pp.write_kv(**arrays, **options, impl=impl, interpret=True)))
        if validate:
            pp.validate_decode_inputs(**arrays, **options)
        out, lse = pp.decode(**arrays, **options, return_lse=True, impl=impl, interpret=True)
        return np.asarray(out), np.asarray(lse)


def jit_jax(op, impl, arrays, options):
    """The call under jax.jit (arrays traced, python options closed over): static classes raise
    at trace time."""
    fn = pp.write_kv if op == "write" else functools.partial(pp.decode, return_lse=True)
    # float64 arrays are closed over: traced with x64 off they would arrive as float32
    traced = {name: x for name, x in arrays.items() if np.asarray(x).dtype != np.float64}
    closed = {name: x for name, x in arrays.items() if name not in traced}
    return jax.jit(lambda a: fn(**a, **closed, **options, impl=impl, interpret=True))(traced)


@pytest.mark.parametrize("name,mode", PARAMS)
def test_input_class(rng, name, mode):
    """The class's rule: every implementation raises a ValueError matching it (eagerly with and
    without ``validate_*_inputs``; static ones under jax.jit too), or all agree with torch_ref
    (writes bit for bit, decode within the tolerance rule)."""
    c = CLASSES[name]
    arrays, options = c.build(rng)
    if c.raises is not None:
        with pytest.raises(ValueError, match=c.raises):
            run_torch(c.op, arrays, options)
        for impl in IMPLS:
            with pytest.raises(ValueError, match=c.raises):
                run_jax(c.op, impl, arrays, options, mode)
            with pytest.raises(ValueError, match=c.raises):
                run_jax(c.op, impl, arrays, options, mode, validate=False)
            if c.static and mode == "numpy":
                with pytest.raises(ValueError, match=c.raises):
                    jit_jax(c.op, impl, arrays, options)
        return
    expected = run_torch(c.op, arrays, options)
    if c.op == "decode":
        ref = reference(**{k: v for k, v in arrays.items()}, **options)
    for impl in IMPLS:
        got = run_jax(c.op, impl, arrays, options, mode)
        if c.op == "write":
            for e, g in zip(expected, got):
                np.testing.assert_array_equal(bits(g), bits(e))
        else:
            assert got[0].dtype == expected[0].dtype and got[0].shape == expected[0].shape
            assert_close(ref, *got, what=impl)


def test_every_class_is_decisive():
    """No class is left undecided, and both outcomes (agree, raise) and both modes are covered;
    every agreeing class of the slow set has a fast one of its kind."""
    assert {c.raises is None for c in CLASSES.values()} == {True, False}
    assert {p.values[1] for p in PARAMS} == {"numpy", "x64"}
    for name, c in CLASSES.items():
        assert c.op in ("write", "decode"), name
        assert not (c.static and c.raises is None), name
        assert not (c.slow and c.raises is not None), name  # raising classes run no kernel


# --- jit rules for int64 values, traced (x64 on) and numpy int64 unchecked (x64 off) ------------

@pytest.mark.parametrize("how", ["jit, x64", "numpy int64, x64 off, check_values=False"])
@pytest.mark.parametrize("impl", IMPLS)
def test_int64_slots_outside_int32_are_dropped_never_wrapped(rng, impl, how):
    """``2**32 + 5`` would wrap to slot 5 and ``2**32 - 1`` to -1 (the last slot): dropped, as
    torch_ref's -1."""
    arrays = write_arrays(rng, slots=(0, 3, 0, 7, 0))
    slots = np.array([BIG + 5, 3, 3 - BIG, 7, BIG - 1], np.int64)
    expected = run_torch("write", dict(arrays, slot_mapping=np.array([-1, 3, -1, 7, -1], np.int64)), {})
    if how == "jit, x64":
        with jax.enable_x64(True):
            x = {name: jnp.asarray(a) for name, a in dict(arrays, slot_mapping=slots).items()}
            assert x["slot_mapping"].dtype == jnp.int64
            got = jax.jit(functools.partial(pp.write_kv, impl=impl, interpret=True))(**x)
    else:
        got = pp.write_kv(**dict(arrays, slot_mapping=slots), impl=impl, interpret=True,
                          check_values=False)
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(bits(g), bits(e))  # slot 5 (and the last slot) untouched


@pytest.mark.parametrize("how", ["jit, x64", "numpy int64, x64 off, check_values=False"])
@pytest.mark.parametrize("impl", IMPLS)
def test_int64_lengths_and_ids_outside_int32_are_clamped_never_wrapped(rng, impl, how):
    """Lengths clamp into [0, capacity], block ids into [0, num_blocks): the result of the
    clamped inputs, bit for bit (a wrapped 2**32 + 1 would read as length 1, id 1)."""
    p = make_paged(rng, lens=(5, 9, 2), num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype="float32", fill=0.0)
    num_blocks, capacity = p.k_cache.shape[0], p.block_tables.shape[1] * 4
    lens = np.array([BIG + 1, 9, 2 - BIG], np.int64)
    tables = p.block_tables.astype(np.int64)
    tables[1, 0] = BIG + 1
    arrays = dict(q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, block_tables=tables,
                  context_lens=lens)
    clamped = dict(arrays, context_lens=np.clip(lens, 0, capacity).astype(np.int32),
                   block_tables=np.clip(tables, 0, num_blocks - 1).astype(np.int32))
    expected = pp.decode(**clamped, impl=impl, interpret=True, return_lse=True)
    if how == "jit, x64":
        with jax.enable_x64(True):
            x = {name: jnp.asarray(a) for name, a in arrays.items()}
            assert x["context_lens"].dtype == x["block_tables"].dtype == jnp.int64
            fn = jax.jit(functools.partial(pp.decode, impl=impl, interpret=True, return_lse=True))
            got = fn(**x)
    else:
        got = pp.decode(**arrays, impl=impl, interpret=True, return_lse=True, check_values=False)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(bits(g), bits(e))
    assert_close(reference(**clamped), *expected)


# --- fp8 scales: python floats and fp32 arrays alike, one program for every scale ----------------

def test_one_compiled_program_for_every_scale(rng):
    """A runner's jitted step (write then decode) with per-layer scales as traced arrays compiles
    once for three layers; the public functions compile once for three python-float scales too."""
    arrays = write_arrays(rng, dtype=FP8, num_blocks=6, block_size=4, kvh=2, head_dim=16,
                          slots=(1, 7, 12))
    q = rng.standard_normal((3, 4, 16)).astype(NP_DTYPES["bfloat16"])
    tables = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    lens = np.array([2, 8, 5], np.int32)
    traces = []

    @jax.jit
    def step(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale):
        traces.append(k_scale.shape)  # a python side effect: runs once per trace
        k_cache, v_cache = pp.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale,
                                       v_scale=v_scale, interpret=True)
        return pp.decode(q, k_cache, v_cache, tables, lens, k_scale=k_scale, v_scale=v_scale,
                         interpret=True), k_cache

    for k_scale, v_scale in ((0.05, 0.5), (0.1, 0.25), (0.02, 1.5)):
        out, k_cache = step(**arrays, k_scale=f32(k_scale), v_scale=f32(v_scale))
        expected_k, expected_v = run_torch("write", arrays, dict(k_scale=k_scale, v_scale=v_scale))
        np.testing.assert_array_equal(bits(k_cache), bits(expected_k))
        ref = reference(q, expected_k, expected_v, tables, lens, k_scale=k_scale, v_scale=v_scale)
        assert_close(ref, out)
    assert len(traces) == 1 and step._cache_size() == 1

    # The public functions, eagerly, with python floats: the scales are operands, not constants.
    shapes = dict(num_blocks=7, block_size=3, kvh=1, head_dim=24, slots=(4, 11))  # unused elsewhere
    fresh = write_arrays(rng, dtype=FP8, **shapes)
    q1 = rng.standard_normal((1, 2, 24)).astype(NP_DTYPES["bfloat16"])
    sizes = []
    for scale in (0.5, 0.25, 0.125):
        k_cache, v_cache = pp.write_kv(**fresh, k_scale=scale, v_scale=2 * scale, interpret=True)
        pp.decode(q1, k_cache, v_cache, np.array([[2, 3]], np.int32), np.array([5], np.int32),
                  k_scale=scale, v_scale=2 * scale, impl="xla")
        sizes.append((_write_kv_jit._cache_size(), _decode_jit._cache_size()))
    assert sizes[0] == sizes[1] == sizes[2]  # the first call compiled (or found) the one program

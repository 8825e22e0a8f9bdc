"""Bad input gets a ValueError naming the argument, in `pallas_paged` (static and eager checks)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_paged as pp
from paged_inputs import make_paged

IMPLS = ("xla", "pallas")


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
                               r"q.dtype=.*float16.* must equal k_cache.dtype=.*float32"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(STATIC_DECODE_CASES))
def test_decode_static_errors(paged, impl, case):
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
    options, match = OPTION_CASES[case]
    with pytest.raises(ValueError, match=match):
        pp.decode(*paged.jax(), impl=impl, **options)


def test_fp8_cache_needs_scales(rng):
    paged = make_paged(rng, lens=[3], dtype="float8_e4m3fn", fill=0.0)
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
    with pytest.raises(ValueError, match=f"DecodeConfig.{field}"):
        pp.DecodeConfig(**{field: value})


def test_config_refuses_persistent_programs_with_splits():
    """Persistent programs deal whole sequences: a split count besides them is refused, naming
    both values."""
    with pytest.raises(ValueError, match=r"persistent_programs=8 .* num_splits=1, not 2"):
        pp.DecodeConfig(num_splits=2, persistent_programs=8)
    assert pp.DecodeConfig(persistent_programs=8).num_splits == 1


def test_config_is_hashable_and_frozen():
    config = pp.DecodeConfig(block_k=32, num_splits=4)
    assert hash(config) == hash(pp.DecodeConfig(block_k=32, num_splits=4))
    with pytest.raises(Exception):
        config.block_k = 64


# --- decode: eager value checks ----------------------------------------------------------------

def test_validate_decode_accepts_good_inputs_and_garbage_tails(paged):
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
    tables = paged.block_tables.copy()
    if tables_patch:
        b, i, value = tables_patch
        tables[b, i] = value
    with pytest.raises(ValueError, match=match):
        pp.validate_decode_inputs(*paged.jax(block_tables=tables,
                                             context_lens=np.array(lens, np.int32)))


def test_validate_decode_runs_static_checks(paged):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        pp.validate_decode_inputs(*paged.jax(q=np.zeros((2, 3, 32), np.float32)))


# --- write ---------------------------------------------------------------------------------------

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
    overrides, match = STATIC_WRITE_CASES[case]
    with pytest.raises(ValueError, match=match):
        pp.write_kv(**_write_args(**overrides), impl=impl)


def test_write_fp8_scales():
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
    with pytest.raises(ValueError, match=match):
        pp.validate_write_inputs(**_write_args(slot_mapping=jnp.array(slots, jnp.int32)))


def test_validate_write_accepts_padding():
    pp.validate_write_inputs(**_write_args(slot_mapping=jnp.array([-1, 15, -1], jnp.int32)))


def test_fp8_caches_the_kernel_cannot_address():
    """1-byte caches of 2**31..2**32 elements: the decode kernel refuses, the write falls back to
    XLA (checked on abstract shapes: nothing is allocated)."""
    import jax

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

"""`pallas_paged.decode` (both impls) against `torch_ref`, and the SPEC invariants I2-I7.

On CPU the Pallas kernel runs in interpret mode; on a GPU the same tests run the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import pallas_paged as pp
import torch_ref
from oracle import oracle_paged_attention
from paged_inputs import assert_close_with_the_same_nans, launched_ops, make_paged, to_numpy, to_torch

IMPLS = ("xla", "pallas")
# Max abs error against torch_ref on the same inputs, outputs of order 1. bf16/fp16: one rounding
# of the output plus the softmax weights rounded to the input dtype for the tensor-core dot.
ATOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 3e-3, "float8_e4m3fn": 2e-2}
SPLIT_CONFIGS = (
    pp.DecodeConfig(block_k=16, num_splits=1),
    pp.DecodeConfig(block_k=16, num_splits=3),
    pp.DecodeConfig(block_k=32, num_splits=2),
    pp.DecodeConfig(block_k=16, num_splits=7),
    pp.DecodeConfig(block_k=16, num_splits=7, merge_in_kernel=True),  # some splits empty
    pp.DecodeConfig(block_k=32, num_splits=2, merge_in_kernel=True),
    # persistent programs: the batch's tiles dealt to 1, 3 and 7 programs per kv head of 2
    # (shares that cut sequences, a share inside one sequence, shares of several sequences)
    pp.DecodeConfig(block_k=16, persistent_programs=1),
    pp.DecodeConfig(block_k=16, persistent_programs=6),
    pp.DecodeConfig(block_k=32, persistent_programs=15),
)


def run_jax(paged, impl, config=None, **kwargs):
    out = pp.decode(*paged.jax(), impl=impl, config=config, **_jax_options(kwargs))
    if kwargs.get("return_lse"):
        return to_numpy(out[0]).astype(np.float32), to_numpy(out[1])
    return to_numpy(out).astype(np.float32)


def run_torch(paged, **kwargs):
    out = torch_ref.paged_decode_attention(*paged.torch(), **_torch_options(kwargs))
    if kwargs.get("return_lse"):
        return to_numpy(out[0]).astype(np.float32), to_numpy(out[1])
    return to_numpy(out).astype(np.float32)


def _jax_options(kwargs):
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def _torch_options(kwargs):
    return {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}


def assert_matches_torch(paged, impl, dtype, config=None, **kwargs):
    expected = run_torch(paged, **kwargs)
    got = run_jax(paged, impl, config, **kwargs)
    if kwargs.get("return_lse"):
        (got, got_lse), (expected, expected_lse) = got, expected
        np.testing.assert_allclose(got_lse, expected_lse, atol=1e-4, rtol=1e-5)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    np.testing.assert_allclose(got, expected, atol=ATOL[dtype], rtol=0)
    return got


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matches_torch_ref(rng, impl, dtype):
    paged = make_paged(rng, lens=[37, 0, 1, 16, 17, 15, 64], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=dtype)
    assert_matches_torch(paged, impl, dtype)


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=str)
def test_split_configs_match_torch_ref(rng, config):
    paged = make_paged(rng, lens=[100, 0, 1, 33, 64, 7], num_heads=6, num_kv_heads=2,
                       head_dim=32, block_size=8, dtype="float32")
    assert_matches_torch(paged, "pallas", "float32", config=config)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_head_dims(rng, impl, head_dim):
    paged = make_paged(rng, lens=[19, 5], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       block_size=8, dtype="bfloat16")
    assert_matches_torch(paged, impl, "bfloat16")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [1, 3, 5, 12, 16, 64])
def test_block_sizes(rng, impl, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    paged = make_paged(rng, lens=[max(n, 0) for n in lens], num_heads=4, num_kv_heads=1,
                       head_dim=32, block_size=block_size, dtype="float32")
    assert_matches_torch(paged, impl, "float32",
                         config=pp.DecodeConfig(block_k=16, num_splits=2) if impl == "pallas" else None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 1), (16, 2)])
def test_gqa_ratios(rng, impl, num_heads, num_kv_heads):
    paged = make_paged(rng, lens=[23, 9], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=32, block_size=4)
    assert_matches_torch(paged, impl, "float32")


# --- SPEC invariants ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_i2_table_tail_is_never_read(rng, impl):
    paged = make_paged(rng, lens=[5, 0, 9, 12], block_size=4, max_blocks=6, tail=(0,))
    clean = run_jax(paged, impl)
    for garbage in (99999, -7, 2**30, -(2**31)):
        tables = paged.block_tables.copy()
        used = np.arange(tables.shape[1])[None, :] < -(-paged.context_lens // 4)[:, None]
        tables[~used] = garbage
        out = pp.decode(*paged.jax(block_tables=tables), impl=impl)
        np.testing.assert_array_equal(to_numpy(out), clean)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13])
def test_i3_exactly_n_rows_enter(rng, impl, n):
    """n not a multiple of bs, n = 1, n = bs: only the first n rows count."""
    paged = make_paged(rng, lens=[n], block_size=4, fill=1e4)  # a huge value would dominate
    assert_matches_torch(paged, impl, "float32")


@pytest.mark.parametrize("impl", IMPLS)
def test_i4_paged_equals_dense(rng, impl):
    paged = make_paged(rng, lens=[11, 16, 1, 30], block_size=4, spare_blocks=10)
    out = run_jax(paged, impl)
    k, v = torch.zeros(4, 32, 2, 32), torch.zeros(4, 32, 2, 32)
    for b, n in enumerate(paged.context_lens):
        for pos in range(n):
            block = paged.block_tables[b, pos // 4]
            k[b, pos] = torch.from_numpy(paged.k_cache[block, pos % 4])
            v[b, pos] = torch.from_numpy(paged.v_cache[block, pos % 4])
    dense = torch_ref.dense_decode_attention(torch.from_numpy(paged.q), k, v,
                                             torch.from_numpy(paged.context_lens))
    np.testing.assert_allclose(out, dense.numpy(), atol=ATOL["float32"], rtol=0)


def numpy_attention(paged, kv_head_of):
    """float64 attention with an explicit head mapping ``kv_head_of(h)`` (the oracle has the
    right one built in; this shows what a wrong one would give)."""
    _, num_heads, head_dim = paged.q.shape
    block_size = paged.k_cache.shape[1]
    out = np.zeros(paged.q.shape)
    for b, n in enumerate(paged.context_lens):
        rows = [paged.block_tables[b, p // block_size] * block_size + p % block_size for p in range(n)]
        k = paged.k_cache.reshape(-1, *paged.k_cache.shape[2:])[rows].astype(np.float64)
        v = paged.v_cache.reshape(-1, *paged.v_cache.shape[2:])[rows].astype(np.float64)
        for h in range(num_heads):
            s = k[:, kv_head_of(h)] @ paged.q[b, h].astype(np.float64) / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            out[b, h] = w @ v[:, kv_head_of(h)] / w.sum()
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_heads", [4, 8])
def test_i5_gqa_is_repeat_interleave(rng, impl, num_heads):
    paged = make_paged(rng, lens=[9, 14], num_heads=num_heads, num_kv_heads=2)
    out = assert_matches_torch(paged, impl, "float32")
    expected, _ = oracle_paged_attention(paged.q, paged.k_cache, paged.v_cache,
                                         paged.block_tables, paged.context_lens)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    # `repeat` (h -> h % KVH) gives a clearly different answer on these inputs.
    assert np.abs(out - numpy_attention(paged, lambda h: h % 2)).max() > 1e-2


def make_paged_like(paged, **overrides):
    return dataclasses.replace(paged, **overrides)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_i6_poisoned_unused_slots_change_nothing(rng, impl, fill):
    state = rng.bit_generator.state
    poisoned = make_paged(rng, lens=[7, 0, 12, 3], block_size=4, fill=fill)
    rng.bit_generator.state = state
    clean = make_paged(rng, lens=[7, 0, 12, 3], block_size=4, fill=0.0)
    out = run_jax(poisoned, impl)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, run_jax(clean, impl))


@pytest.mark.parametrize("config", (None,) + SPLIT_CONFIGS, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("poisoned", ["query", "key"])
def test_a_nan_query_or_key_propagates_as_in_torch_ref(rng, impl, config, poisoned):
    """A NaN query head (or a NaN in one valid K row) gives NaN output rows and lse where
    torch_ref's softmax does (not zero rows: only a sequence without keys is zeros), and changes
    nothing else; with every merge (one split, the merge kernel, the merge inside the kernel)."""
    if impl == "xla" and config is not None:
        pytest.skip("the XLA path has no config")
    paged = make_paged(rng, lens=[40, 9, 0, 70], num_heads=8, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype="float32")
    paged.q[2, 3] = np.nan  # a zero-length row stays zeros
    if poisoned == "query":
        paged.q[0, 1] = np.nan
    else:  # sequence 0, position 20, kv head 0: query heads 0-3
        paged.k_cache[paged.block_tables[0, 1], 4, 0, 3] = np.nan
    out, lse = run_jax(paged, impl, config, return_lse=True)
    expected, expected_lse = run_torch(paged, return_lse=True)
    nan_heads = [1] if poisoned == "query" else [0, 1, 2, 3]
    assert np.isnan(out[0, nan_heads]).all() and np.isnan(lse[0, nan_heads]).all()
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()
    assert_close_with_the_same_nans(out, expected, ATOL["float32"])
    assert_close_with_the_same_nans(lse, expected_lse, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_i7_zero_length_rows(rng, impl):
    paged = make_paged(rng, lens=[0, 9, 0, 4], block_size=4)
    out, lse = run_jax(paged, impl, return_lse=True)
    assert (out[[0, 2]] == 0).all() and np.isneginf(lse[[0, 2]]).all()
    alone = make_paged_like(paged, q=paged.q[[1, 3]], block_tables=paged.block_tables[[1, 3]],
                            context_lens=paged.context_lens[[1, 3]])
    np.testing.assert_allclose(out[[1, 3]], run_jax(alone, impl), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_rows_zero_length(rng, impl):
    paged = make_paged(rng, lens=[0, 0], block_size=4, max_blocks=2)
    assert (run_jax(paged, impl) == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_ids_in_valid_part_are_clamped(rng, impl):
    """Under jit a bad id inside the valid part reads a clamped block: never outside the cache."""
    paged = make_paged(rng, lens=[9, 12], block_size=4, fill=0.0)
    num_blocks = paged.k_cache.shape[0]
    tables = paged.block_tables.copy()
    tables[0, 1], tables[1, 0], tables[1, 2] = 2**30, -5, num_blocks
    out = pp.decode(*paged.jax(block_tables=tables), impl=impl)
    clamped = pp.decode(*paged.jax(block_tables=np.clip(tables, 0, num_blocks - 1)), impl=impl)
    np.testing.assert_array_equal(to_numpy(out), to_numpy(clamped))


@pytest.mark.parametrize("impl", IMPLS)
def test_lengths_out_of_range_are_clamped_under_jit(rng, impl):
    paged = make_paged(rng, lens=[8, 4], block_size=4, fill=0.0)
    lens = np.array([-3, 100], np.int32)  # capacity is 2 blocks * 4 = 8
    out = to_numpy(pp.decode(*paged.jax(context_lens=lens), impl=impl))
    expected = to_numpy(pp.decode(*paged.jax(context_lens=np.array([0, 8], np.int32)), impl=impl))
    np.testing.assert_array_equal(out, expected)


# --- precision, scale, dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_is_fp32_accurate(rng, impl):
    """No silent TF32: against a float64 computation, fp32 inputs give ~1e-6 errors (TF32 ~1e-3)."""
    paged = make_paged(rng, lens=[200, 77], num_heads=4, num_kv_heads=1, head_dim=64,
                       block_size=16, fill=0.0)
    paged.q *= 4  # sharper softmax: rounding of the scores shows
    expected, _ = oracle_paged_attention(paged.q, paged.k_cache, paged.v_cache, paged.block_tables,
                                         paged.context_lens)
    out = run_jax(paged, impl)
    assert np.abs(out - expected).max() < 5e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_scale(rng, impl):
    paged = make_paged(rng, lens=[10, 3], block_size=4)
    assert_matches_torch(paged, impl, "float32", scale=0.37)
    default = run_jax(paged, impl)
    np.testing.assert_allclose(default, run_jax(paged, impl, scale=1 / np.sqrt(32)), atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_tables_and_lengths(rng, impl):
    """Real int64 (x64 on: with it off, JAX narrows the arrays before decode sees them), and numpy
    int64 arrays with x64 off: the same output as int32."""
    paged = make_paged(rng, lens=[10, 3], block_size=4)
    tables, lens = paged.block_tables.astype(np.int64), paged.context_lens.astype(np.int64)
    with jax.enable_x64(True):
        args = paged.jax(block_tables=tables, context_lens=lens)
        assert args[3].dtype == args[4].dtype == jnp.int64
        out = pp.decode(*args, impl=impl)
    np.testing.assert_array_equal(to_numpy(out), run_jax(paged, impl))
    args = paged.jax()[:3] + [tables, lens]
    np.testing.assert_array_equal(to_numpy(pp.decode(*args, impl=impl)), run_jax(paged, impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_output_dtype_follows_q(rng, impl):
    for dtype in ("float32", "bfloat16", "float16"):
        paged = make_paged(rng, lens=[5], dtype=dtype)
        out = pp.decode(*paged.jax(), impl=impl)
        assert out.dtype == jnp.dtype(dtype) and out.shape == paged.q.shape


def test_empty_batch():
    q = jnp.zeros((0, 4, 32), jnp.float32)
    cache = jnp.zeros((3, 4, 2, 32), jnp.float32)
    out = pp.decode(q, cache, cache, jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32))
    assert out.shape == (0, 4, 32)


# --- jit, interpret, and proof that the kernel runs ----------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_usable_inside_user_jit(rng, impl):
    paged = make_paged(rng, lens=[6, 11], block_size=4)

    @jax.jit
    def step(q, k_cache, v_cache, tables, lens):
        return pp.decode(q, k_cache, v_cache, tables, lens, impl=impl) * 2

    np.testing.assert_allclose(to_numpy(step(*paged.jax())), 2 * run_jax(paged, impl), atol=1e-6)


def _lowered_text(platform: str, impl: str, q_dtype=jnp.bfloat16, cache_dtype=None,
                  **options) -> str:
    q = jax.ShapeDtypeStruct((2, 8, 64), q_dtype)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), cache_dtype or q_dtype)
    tables = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = functools.partial(pp.decode, impl=impl, interpret=False, **options)
    # Without a GPU, jax >= 0.12's Triton lowering asks for an abstract GPU to lower for.
    gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=gpu)):
        traced = jax.jit(fn).trace(q, cache, cache, tables, lens)
        return traced.lower(lowering_platforms=(platform,)).as_text()


def test_pallas_impl_lowers_to_the_triton_kernel():
    """Lowered for CUDA (works without a GPU), impl="pallas" is a Triton call of our kernel."""
    text = _lowered_text("cuda", "pallas")
    assert "__gpu$xla.gpu.triton" in text
    assert "pallas_paged_decode" in text


@pytest.mark.parametrize("config", [None, pp.DecodeConfig(block_k=32, num_splits=2),
                                    pp.DecodeConfig(block_k=32, num_splits=2, merge_in_kernel=True),
                                    pp.DecodeConfig(block_k=32, persistent_programs=4)], ids=str)
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_the_triton_decode_launches_its_kernels_alone(fp8_cache, config):
    """Lowered for CUDA, decode(impl="pallas") is its kernels (the decode kernel, and the merge
    kernel with splits) and views of its operands, nothing XLA computes itself: each such op is
    one more launch per call on a GPU (stacking the two fp8 scales into one operand was one).
    The one-launch layouts (the merge in the kernel, persistent programs) add the zeros their
    arrival counts start from, and nothing else."""
    options = dict(k_scale=0.5, v_scale=0.25, cache_dtype=jnp.float8_e4m3fn) if fp8_cache else {}
    text = _lowered_text("cuda", "pallas", config=config, **options)
    one_launch = config is not None and (config.merge_in_kernel or config.persistent_programs)
    assert launched_ops(text) == ({"broadcast_in_dim"} if one_launch else set())
    assert text.count("stablehlo.custom_call") == (2 if config is not None and config.num_splits > 1
                                                   and not config.merge_in_kernel else 1)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("config", [None, pp.DecodeConfig(block_k=32, num_splits=2),
                                    pp.DecodeConfig(block_k=32, num_splits=2, fp8_pairs=True),
                                    pp.DecodeConfig(block_k=16, fp8_v_at_load=True),
                                    pp.DecodeConfig(block_k=32, persistent_programs=4)],
                         ids=["default", "plain", "fp8_pairs", "fp8_v_at_load", "persistent"])
def test_triton_kernel_lowers_for_every_dtype(q_dtype, fp8_cache, config):
    """Lowered for CUDA, Triton's own lowering checks what interpret mode lets through (a dot of
    an fp32 and an fp16 operand, say): every query dtype, with its own cache dtype or an fp8
    cache, with the default config and each fp8 option."""
    if config is not None and (config.fp8_pairs or config.fp8_v_at_load) and not fp8_cache:
        pytest.skip("the fp8 options change nothing for 16- and 32-bit caches")
    scales = dict(k_scale=0.5, v_scale=0.25) if fp8_cache else {}
    text = _lowered_text("cuda", "pallas", q_dtype=jnp.dtype(q_dtype),
                         cache_dtype=jnp.float8_e4m3fn if fp8_cache else None, config=config,
                         **scales)
    assert "pallas_paged_decode" in text


def test_compiled_triton_kernels_take_the_hardware_exp2():
    """Compiled, the online softmax of both Triton kernels (decode and ragged attention) is PTX's
    ``ex2.approx.ftz.f32`` (`pallas_triton.softmax_exp`); in interpret mode it is ``jnp.exp``,
    with no PTX in the program."""
    asm = "ex2.approx.ftz.f32"
    assert asm in _lowered_text("cuda", "pallas")
    q = jax.ShapeDtypeStruct((5, 8, 64), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((40, 16, 2, 64), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    qsl = jax.ShapeDtypeStruct((3,), jnp.int32)
    gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    for interpret, platform in ((False, "cuda"), (True, "cpu")):
        fn = functools.partial(pp.paged_attention, impl="pallas", interpret=interpret)
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=gpu)):
            traced = jax.jit(fn).trace(q, cache, cache, tables, lens, qsl)
            text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert (asm in text) == (not interpret), (interpret, platform)
        assert "pallas_paged_ragged" in text or interpret


def test_xla_impl_has_no_kernel():
    text = _lowered_text("cuda", "xla")
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
    assert_matches_torch(paged, "pallas", "bfloat16")


def _decode_shape(batch, capacity, cache_dtype, *, num_kv_heads=8, group=4, head_dim=128,
                  block_size=16):
    from pallas_paged.decode_attention.shape import DecodeShape
    return DecodeShape(batch=batch, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                       block_size=block_size, capacity=capacity, cache_dtype=cache_dtype)


def _fp8_config(block_k, num_splits=1, num_warps=4):
    """The fp8 heuristic's config shape: column pairs, rings two tiles deep."""
    return pp.DecodeConfig(block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                           num_stages=5, fp8_pairs=True)


@pytest.mark.parametrize("batch,capacity,cache_dtype,expected", [
    # 16-bit caches: rings one tile deep, about four programs per multiprocessor
    (32, 4096, "bfloat16", pp.DecodeConfig(block_k=64, num_splits=2, num_warps=4, num_stages=2)),
    (1, 32768, "bfloat16", pp.DecodeConfig(block_k=64, num_splits=64, num_warps=4, num_stages=2)),
    (128, 1024, "float16", pp.DecodeConfig(block_k=64, num_splits=1, num_warps=4, num_stages=2)),
    # fp8 caches: column pairs, rings two tiles deep, about two programs per multiprocessor
    (32, 4096, "float8_e4m3fn", _fp8_config(128)),
    (8, 16384, "float8_e4m3fn", _fp8_config(128, num_splits=4)),
    (48, 4096, "float8_e4m3fn", _fp8_config(128)),
    # fp8 just past three programs per multiprocessor (396 on 132 SMs): half the tile, two warps
    (56, 4096, "float8_e4m3fn", _fp8_config(64, num_warps=2)),
    (64, 4096, "float8_e4m3fn", _fp8_config(64, num_warps=2)),
    # ... but not where the larger programs fill their waves better
    (96, 4096, "float8_e4m3fn", _fp8_config(128)),
    (128, 4096, "float8_e4m3fn", _fp8_config(128)),
    (256, 1024, "float8_e4m3fn", _fp8_config(128)),
])
def test_heuristic_config_of_the_measured_shapes(batch, capacity, cache_dtype, expected):
    from pallas_paged.decode_attention.pallas_triton_config import get_heuristic_config
    assert get_heuristic_config(_decode_shape(batch, capacity, cache_dtype), 132) == expected


@pytest.mark.parametrize("cache_dtype,head_dim,block_k", [
    ("bfloat16", 256, 64), ("float16", 192, 64),  # 16-bit rows past 128 columns: K + V 64 KiB
    ("bfloat16", 128, 64),  # 128 columns: the 32 KiB rule
    ("float32", 256, 16), ("float8_e4m3fn", 256, 64),  # other widths keep the 32 KiB rule
])
def test_heuristic_tile_of_wide_rows(cache_dtype, head_dim, block_k):
    """16-bit rows of 129-256 columns get 64-token tiles (`pallas_triton_config.WIDE_ROW_TILE_BYTES`) and 8
    warps; 32-token tiles ran 1.2-1.5x slower at head_dim 256 (docs/BENCHMARKS.md)."""
    from pallas_paged.decode_attention.pallas_triton_config import get_heuristic_config
    config = get_heuristic_config(
        _decode_shape(32, 4096, cache_dtype, head_dim=head_dim), 132)
    assert config.block_k == block_k
    assert config.num_warps == (8 if head_dim > 128 else 4)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("batch", [1, 3, 64, 1024])
@pytest.mark.parametrize("capacity", [16, 1000, 131072])
def test_heuristic_configs_are_valid_and_never_split_short(cache_dtype, head_dim, batch,
                                                           capacity):
    from pallas_paged._platform import next_power_of_2
    from pallas_paged.decode_attention.pallas_triton_config import get_heuristic_config
    config = get_heuristic_config(
        _decode_shape(batch, capacity, cache_dtype, head_dim=head_dim), 132)
    assert 1 <= config.num_splits <= 256
    assert config.num_splits == 1 or capacity // config.num_splits >= 4 * config.block_k
    assert config.block_k <= max(16, next_power_of_2(capacity))
    tile_bytes = 2 * config.block_k * next_power_of_2(head_dim) * np.dtype(
        jnp.dtype(cache_dtype)).itemsize
    assert tile_bytes <= 64 * 1024  # K + V of one tile; rings hold one or two of them
    assert config.fp8_pairs == (cache_dtype == "float8_e4m3fn")
    assert not config.fp8_v_at_load and not config.merge_in_kernel


def test_tuned_h200_fp8_entries_keep_the_pair_layout():
    """A tuned fp8 entry keeps the heuristic's fp8 layout (the pairs, measured fastest) and
    changes only the tiling; B=32/ctx 4096, where the heuristic's tiling measured fastest, has
    none, B=8/ctx 16384 has its own."""
    from pallas_paged.decode_attention.pallas_triton_config import (TUNED, get_heuristic_config,
                                                                    lookup, shape_class)
    fp8_entries = {key: config for key, config in TUNED["NVIDIA H200"].items()
                   if key[0] == "float8_e4m3fn"}
    assert fp8_entries
    for config in fp8_entries.values():
        assert config.fp8_pairs and not config.fp8_v_at_load
    b32 = _decode_shape(32, 4096, "float8_e4m3fn")
    assert lookup(b32, "NVIDIA H200", 132) == get_heuristic_config(b32, 132)
    b8 = _decode_shape(8, 16384, "float8_e4m3fn")
    assert lookup(b8, "NVIDIA H200", 132) == fp8_entries[shape_class(b8)]
    assert lookup(b8, "NVIDIA H200", 132) != get_heuristic_config(b8, 132)


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

"""`pallas_paged.write_kv` with ``impl="xla"`` and ``impl="pallas"``: bit-exact against
`torch_ref.write_kv`, I1 (padding leaves no trace), int64 slots, out-of-range slots unchecked (as
under jit), jit and donation.

fp8 caches: every token dtype and scale form, rounding ties, NaN / inf / saturation, the
quantization inside the Pallas kernel (no token-sized XLA division, exact GPU arithmetic) and one
compiled program for every scale. The eager refusals of bad slots and scales, with torch_ref's
messages, are in test_validation.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import pallas_paged as pp
from pallas_paged._platform import quiet_triton_deprecation, resolve_interpret
from pallas_paged.cache_write.api import _write_kv_jit
from paged_inputs import IMPLS, NP_DTYPES, bits, draw_write, launched_ops, write_torch

SLOW = pytest.mark.slow
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
FP8_TOKEN_DTYPES = ("float32", "bfloat16", "float16")  # what an fp8 cache takes
# (cache dtype, token dtype): every dtype's own tokens, and every token dtype into an fp8 cache.
WRITE_DTYPES = [(d, d) for d in DTYPES[:3]] + [("float8_e4m3fn", t) for t in FP8_TOKEN_DTYPES]
SCALE_KINDS = ("python float", "f32[]", "f32[1]")


def fp8_scales(dtype):
    # With bf16 tokens, x / 0.03 lands on fp8 rounding ties often enough that x * (1 / 0.03), which
    # rounds differently, stores other bits in about 1% of the elements: only the division is right.
    return dict(k_scale=0.03, v_scale=0.3) if dtype == "float8_e4m3fn" else {}


def scale_args(value: float, kind: str):
    """One scale for `pp.write_kv` and the same for `torch_ref.write_kv`, as ``kind`` says."""
    if kind == "python float":
        return value, value
    shape = () if kind == "f32[]" else (1,)
    scale = np.full(shape, value, np.float32)
    return jnp.asarray(scale), torch.from_numpy(scale)


def fp8_edge_values(scale: float, dtype) -> np.ndarray:
    """Tokens of ``dtype`` whose fp32 quotient by ``scale`` probes every fp8 rounding decision.

    For every tie (the midpoint of two neighbouring finite float8_e4m3fn values, both signs, the
    subnormals' included) and for 448, 464 (midway to the missing next binade value) and 500:
    ``tie * scale`` rounded to ``dtype`` and its two neighbours in ``dtype``, so that ``x / scale``
    lands on, just below or just above the tie. Then NaN, +-inf, +-0 and +-1e4 (far past
    ``448 * scale``).
    """
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.unique(codes[np.isfinite(codes)])
    ties = (finite[1:] + finite[:-1]) / 2
    targets = np.concatenate([ties, [448.0, 464.0, 500.0, -464.0, -500.0]])
    near = (targets * np.float64(np.float32(scale))).astype(dtype)
    uint = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    raw = near.view(uint)
    near = np.concatenate([raw, raw + 1, raw - 1]).view(dtype)
    near = near[np.isfinite(near.astype(np.float32))]
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e4, -1e4], np.float32).astype(dtype)
    return np.concatenate([near, specials])


def grid(values, fast):
    """``(impl, *value)`` for both impls: the XLA path in every case, the kernel (interpret mode
    compiles slowly) in the fast set only for ``fast`` values."""
    out = []
    for impl in IMPLS:
        for v in values:
            vs = v if isinstance(v, tuple) else (v,)
            slow = impl == "pallas" and v not in fast
            out.append(pytest.param(impl, *vs, marks=[SLOW] if slow else []))
    return out


@pytest.mark.parametrize("impl,dtype,token_dtype", grid(
    WRITE_DTYPES, fast=[("float32", "float32"), ("float8_e4m3fn", "bfloat16")]))
def test_bit_exact_against_torch_ref(rng, impl, dtype, token_dtype):
    """Every cache dtype with its own tokens, and every token dtype into an fp8 cache: the bits
    torch_ref leaves, with padding tokens among the real ones."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=16, num_tokens=60, num_padding=5,
                                               dtype=dtype, token_dtype=token_dtype)
    scales = fp8_scales(dtype)
    expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, **scales)
    got_k, got_v = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl,
                               **scales)
    np.testing.assert_array_equal(bits(got_k), bits(expected_k))
    np.testing.assert_array_equal(bits(got_v), bits(expected_v))


@pytest.mark.parametrize("impl,token_dtype", grid(FP8_TOKEN_DTYPES, fast=["bfloat16"]))
def test_fp8_saturates_and_keeps_nan(impl, token_dtype):
    """Past +-448 and +-inf saturate to +-448 (the cast alone would make them NaN); NaN stays NaN
    (a max/min clamp that drops NaN, as Triton's maxnumf does, would make it -448 or 448)."""
    cache = jnp.zeros((1, 4, 1, 16), jnp.float8_e4m3fn)
    values = [1e4, -1e4, 448 * 0.5, np.nan, np.inf, -np.inf, 470 * 0.5, -0.0]
    k = jnp.array(values * 2, NP_DTYPES[token_dtype]).reshape(1, 1, 16)
    got, _ = pp.write_kv(cache, cache, k, k, jnp.array([2], jnp.int32), k_scale=0.5, v_scale=0.5,
                         impl=impl)
    row = np.asarray(got[0, 2, 0, :8].astype(jnp.float32))
    np.testing.assert_array_equal(row, [448, -448, 448, np.nan, 448, -448, 448, 0])
    assert np.signbit(row[7])


@pytest.mark.parametrize("impl,scale_kind,token_dtype", grid(
    [(kind, t) for kind in SCALE_KINDS for t in FP8_TOKEN_DTYPES],
    fast=[("python float", "bfloat16"), ("f32[1]", "bfloat16")]))
def test_fp8_rounding_ties_bit_exact(rng, impl, token_dtype, scale_kind):
    """Tokens on, just below and just above every fp8 rounding tie of ``x / scale`` (and NaN, inf,
    zeros, saturation) store torch's bits: x * (1 / scale) or a cast that does not round to
    nearest even would differ somewhere, and so would, on a GPU, a clamp that drops NaN."""
    dtype = NP_DTYPES[token_dtype]
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=16, num_tokens=24, num_padding=3,
                                               dtype="float8_e4m3fn", token_dtype=token_dtype)
    k_scale, v_scale = 0.03, 1.7
    k = np.resize(rng.permutation(fp8_edge_values(k_scale, dtype)), k.shape)
    v = np.resize(rng.permutation(fp8_edge_values(v_scale, dtype)), v.shape)
    (jax_k_scale, torch_k_scale), (jax_v_scale, torch_v_scale) = (
        scale_args(k_scale, scale_kind), scale_args(v_scale, scale_kind))
    expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, k_scale=torch_k_scale,
                                         v_scale=torch_v_scale)
    got_k, got_v = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)),
                               k_scale=jax_k_scale, v_scale=jax_v_scale, impl=impl)
    np.testing.assert_array_equal(bits(got_k), bits(expected_k))
    np.testing.assert_array_equal(bits(got_v), bits(expected_v))


def _equations(jaxpr, *, enter_kernels: bool):
    """The equations of ``jaxpr`` and of the jaxprs nested in it; a ``pallas_call``'s kernel is
    entered only with ``enter_kernels``."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call" and not enter_kernels:
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's own, or a jaxpr
                if hasattr(sub, "eqns"):
                    yield from _equations(sub, enter_kernels=enter_kernels)


def _primitives(jaxpr, *, enter_kernels: bool) -> set[str]:
    return {eqn.primitive.name for eqn in _equations(jaxpr, enter_kernels=enter_kernels)}


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_pallas_quantizes_inside_the_kernel(rng, impl):
    """Under jax.jit the pallas fp8 write divides only inside its kernel (tile-sized), never in
    XLA over the tokens: no ``div`` outside the ``pallas_call`` in the jaxpr, no ``divide`` of the
    tokens' shape in the HLO. ``impl="xla"`` quantizes in XLA and shows both, so the checks see
    what they look for."""
    num_tokens, kvh, d = 37, 2, 32
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=16, kvh=kvh, head_dim=d,
                                               num_tokens=num_tokens, dtype="float8_e4m3fn")
    args = tuple(map(jnp.asarray, (k_cache, v_cache, k, v, slots)))
    write = functools.partial(pp.write_kv, impl=impl)
    scales = dict(k_scale=0.03, v_scale=0.3)
    jaxpr = jax.make_jaxpr(write)(*args, **scales).jaxpr
    outside = _primitives(jaxpr, enter_kernels=False)
    hlo = jax.jit(write).lower(*args, **scales).as_text()
    token_divides = re.findall(
        rf"stablehlo\.divide[^\n]*tensor<{num_tokens}x({kvh}x{d}|{kvh * d})x", hlo)
    if impl == "xla":
        assert "div" in outside and token_divides
        return
    assert "div" not in outside and "optimization_barrier" not in outside, sorted(outside)
    assert not token_divides, token_divides
    # The kernel divides: with XLA's div in interpret mode, with PTX div.rn.f32 on a GPU.
    # (the inline-assembly primitive is named elementwise_inline_asm_p in some jax versions)
    division = "div" if resolve_interpret(None) else "elementwise_inline_asm"
    [kernel] = [eqn.params["jaxpr"] for eqn in _equations(jaxpr, enter_kernels=False)
                if eqn.primitive.name == "pallas_call"]
    assert division in {name.removesuffix("_p") for name in _primitives(kernel,
                                                                        enter_kernels=True)}


@pytest.mark.parametrize("token_dtype", FP8_TOKEN_DTYPES)
def test_fp8_pallas_lowers_to_exact_gpu_arithmetic(token_dtype):
    """Lowered for CUDA (works without a GPU): the fp8 kernel divides with PTX ``div.rn.f32``,
    never with Triton's ``/`` (``arith.divf``, approximate on the GPU); it clamps with selects,
    never with ``maxnumf`` / ``minnumf`` (which turn NaN into +-448); it casts with ``fp_to_fp``;
    and XLA divides nothing. The Triton module travels as MLIR bytecode, whose string table
    holds the op names and the inline assembly verbatim. A bf16 cache's kernel is a plain copy."""
    cache = jax.ShapeDtypeStruct((16, 4, 2, 32), jnp.float8_e4m3fn)
    tokens = jax.ShapeDtypeStruct((37, 2, 32), NP_DTYPES[token_dtype])
    slots = jax.ShapeDtypeStruct((37,), jnp.int32)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    fn = functools.partial(pp.write_kv, impl="pallas", interpret=False)
    # Without a GPU, jax >= 0.12's Triton lowering asks for an abstract GPU to lower for.
    gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    with quiet_triton_deprecation(), use_abstract_mesh(AbstractMesh((1,), ("x",),
                                                                     abstract_device=gpu)):
        text = jax.jit(fn).trace(cache, cache, tokens, tokens, slots, k_scale=scale,
                                 v_scale=scale).lower(lowering_platforms=("cuda",)).as_text()
        plain = jax.jit(fn).trace(*(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                                    for x in (cache, cache, tokens, tokens)),
                                  slots).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "pallas_paged_write_kv" in text
    assert "div.rn.f32" in text and "fp_to_fp" in text
    for banned in ("divf", "maxnumf", "minnumf", "stablehlo.divide"):
        assert banned not in text, banned
    assert "pallas_paged_write_kv" in plain
    assert "div.rn.f32" not in plain and "fp_to_fp" not in plain
    # the kernel alone, with the scales as operands: no XLA op of its own (one more launch)
    assert launched_ops(text) == set() and launched_ops(plain) == set()


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_one_program_for_every_scale(rng, impl):
    """The scales are operands: one compiled program (ahead of time, with f32[] scales) writes
    with two scale pairs, each bit-identical to torch; and eager calls with two python-float
    scale pairs compile `write_kv`'s program once."""
    k_cache, v_cache, k, v, slots = draw_write(rng, dtype="float8_e4m3fn")
    args = tuple(map(jnp.asarray, (k_cache, v_cache, k, v, slots)))
    pairs = ((0.03, 0.3), (0.07, 1.7))
    write = jax.jit(functools.partial(pp.write_kv, impl=impl))
    compiled = write.lower(*args, k_scale=jnp.float32(1), v_scale=jnp.float32(1)).compile()
    for k_scale, v_scale in pairs:
        got_k, got_v = compiled(*args, k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale))
        expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, k_scale=k_scale,
                                             v_scale=v_scale)
        np.testing.assert_array_equal(bits(got_k), bits(expected_k))
        np.testing.assert_array_equal(bits(got_v), bits(expected_v))
    sizes = []
    for k_scale, v_scale in pairs:
        pp.write_kv(*args, k_scale=k_scale, v_scale=v_scale, impl=impl)
        sizes.append(_write_kv_jit._cache_size())
    assert sizes[1] == sizes[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_i1_padding_token_leaves_no_trace(rng, impl):
    """A -1 token with a sentinel value is written nowhere, least of all into the last slot."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=4, num_padding=0)
    slots[:] = [3, -1, 7, -1]
    k[[1, 3]] = 12345.0
    v[[1, 3]] = -12345.0
    got_k, got_v = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    got_k, got_v = np.asarray(got_k), np.asarray(got_v)
    assert not (got_k == 12345.0).any() and not (got_v == -12345.0).any()
    np.testing.assert_array_equal(got_k[-1, -1], k_cache[-1, -1])
    changed = (got_k != k_cache).any(axis=(2, 3)).reshape(-1)
    assert set(np.flatnonzero(changed)) <= {3, 7}


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_slots(rng, impl):
    """Real int64 slots (x64 on: with it off, JAX narrows the array before write_kv sees it), and a
    numpy int64 array with x64 off, write exactly what int32 slots write."""
    k_cache, v_cache, k, v, slots = draw_write(rng)
    a = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    with jax.enable_x64(True):
        slots64 = jnp.asarray(slots.astype(np.int64))
        assert slots64.dtype == jnp.int64
        b = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots64, impl=impl)
    c = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots.astype(np.int64), impl=impl)
    for got in (b, c):
        np.testing.assert_array_equal(bits(got[0]), bits(a[0]))
        np.testing.assert_array_equal(bits(got[1]), bits(a[1]))


@pytest.mark.parametrize("impl", IMPLS)
def test_int64_slots_outside_int32_never_wrap(rng, impl):
    """``2**32 + 5`` would wrap to slot 5 and ``2**32 - 1`` to -1 (the last slot): both are dropped,
    jitted with x64 on as eagerly (unchecked) with a numpy int64 array; the eager call's checks
    and `validate_write_inputs` reject them."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=4, num_padding=0)
    slots64 = np.array([2**32 + 5, 2, 2**32 - 1, -(2**32) + 7], np.int64)
    expected_k, expected_v = write_torch(k_cache, v_cache, k, v, np.array([-1, 2, -1, -1], np.int32))
    with jax.enable_x64(True):
        args = [*map(jnp.asarray, (k_cache, v_cache, k, v, slots64))]
        assert args[4].dtype == jnp.int64
        jitted = jax.jit(functools.partial(pp.write_kv, impl=impl))(*args)
    eager = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots64, impl=impl,
                        check_values=False)
    for got_k, got_v in (jitted, eager):
        np.testing.assert_array_equal(bits(got_k), bits(expected_k))
        np.testing.assert_array_equal(bits(got_v), bits(expected_v))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]=4294967301 is out of range"):
        pp.validate_write_inputs(k_cache, v_cache, k, v, slots64)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]=4294967301 is out of range"):
        pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v)), slots64, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_slots_are_dropped_under_jit(rng, impl):
    """Under jax.jit (and eagerly with ``check_values=False``) slots past the cache or below -1,
    int32's minimum included, are dropped: only the one valid token is written."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=5, num_padding=0)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    slots[:] = [num_slots, -2, 5, num_slots + 100, -(2**31)]
    args = tuple(map(jnp.asarray, (k_cache, v_cache, k, v, slots)))
    expected = k_cache.copy()
    expected.reshape(num_slots, *k_cache.shape[2:])[5] = k[2]
    jitted, _ = jax.jit(functools.partial(pp.write_kv, impl=impl))(*args)
    unchecked, _ = pp.write_kv(*args, impl=impl, check_values=False)
    np.testing.assert_array_equal(bits(jitted), bits(expected))
    np.testing.assert_array_equal(bits(unchecked), bits(expected))


@pytest.mark.parametrize("impl", IMPLS)
def test_row_width_not_a_power_of_two(rng, impl):
    """Rows of 3 kv heads x 80 (not a power of two) are copied bit-exact."""
    k_cache, v_cache, k, v, slots = draw_write(rng, kvh=3, head_dim=80, dtype="bfloat16")
    expected_k, _ = write_torch(k_cache, v_cache, k, v, slots)
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    np.testing.assert_array_equal(bits(got_k), bits(expected_k))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(rng, impl):
    """No tokens: the cache is unchanged."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_tokens=0, num_padding=0)
    got_k, _ = pp.write_kv(*map(jnp.asarray, (k_cache, v_cache, k, v, slots)), impl=impl)
    np.testing.assert_array_equal(np.asarray(got_k), k_cache)


@pytest.mark.parametrize("impl", IMPLS)
def test_donated_caches_are_updated_in_place(rng, impl):
    """With donation the output lives in the input's buffer: no cache-sized copy is made."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=256, block_size=16, kvh=2,
                                               head_dim=64)
    step = jax.jit(functools.partial(pp.write_kv, impl=impl), donate_argnums=(0, 1))
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    pointers = (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer())
    args = tuple(map(jnp.asarray, (k, v, slots)))
    compiled = step.lower(kc, vc, *args).compile()
    new_k, new_v = step(kc, vc, *args)
    assert kc.is_deleted() and vc.is_deleted()
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == pointers
    memory = compiled.memory_analysis()
    if memory is not None:  # a copy of a cache would need a temporary at least its size
        assert memory.temp_size_in_bytes < k_cache.nbytes // 2
    expected_k, _ = write_torch(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(bits(new_k), bits(expected_k))


@pytest.mark.parametrize("impl", IMPLS)
def test_write_then_decode_sees_the_new_token(rng, impl):
    """The runner's step, jitted together with donated caches: decode reads what was just written."""
    num_blocks, block_size, kvh, d = 8, 4, 1, 16
    k_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kvh, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((num_blocks, block_size, kvh, d)), jnp.float32)
    tables = jnp.array([[5, 2]], jnp.int32)
    lens = jnp.array([6], jnp.int32)  # the new token is position 5: block 2, offset 1 -> slot 9
    k_new = jnp.zeros((1, kvh, d), jnp.float32)
    v_new = jnp.full((1, kvh, d), 1000.0, jnp.float32)
    q = jnp.zeros((1, 1, d), jnp.float32)  # uniform weights over the 6 tokens

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_cache, v_cache):
        k_cache, v_cache = pp.write_kv(k_cache, v_cache, k_new, v_new, jnp.array([9], jnp.int32),
                                       impl=impl)
        return pp.decode(q, k_cache, v_cache, tables, lens, impl="pallas"), k_cache, v_cache

    out, _, v_after = step(k_cache, v_cache)
    assert float(v_after[2, 1, 0, 0]) == 1000.0
    assert float(out[0, 0, 0]) > 1000.0 / 6 - 10  # the written row carries a sixth of the weight


@pytest.mark.parametrize("impl", IMPLS)
def test_donation_recipe_takes_every_keyword(rng, impl):
    """README's form: ``jax.jit(write_kv, donate_argnums=(0, 1), static_argnames=("impl",
    "interpret"))`` with fp8 scales (python floats, traced by the caller's jit: one program for
    both) and ``impl=``, bit-identical to torch."""
    write = jax.jit(pp.write_kv, donate_argnums=(0, 1), static_argnames=("impl", "interpret"))
    k_cache, v_cache, k, v, slots = draw_write(rng, dtype="float8_e4m3fn")
    sizes = []
    for k_scale, v_scale in ((0.03, 0.3), (0.07, 0.11)):
        got_k, got_v = write(jnp.asarray(k_cache), jnp.asarray(v_cache), *map(jnp.asarray, (k, v, slots)),
                             k_scale=k_scale, v_scale=v_scale, impl=impl)
        expected_k, expected_v = write_torch(k_cache, v_cache, k, v, slots, k_scale=k_scale,
                                             v_scale=v_scale)
        np.testing.assert_array_equal(bits(got_k), bits(expected_k))
        np.testing.assert_array_equal(bits(got_v), bits(expected_v))
        sizes.append(write._cache_size())  # jit objects of one function share their cache
    assert sizes[1] == sizes[0]


@pytest.mark.parametrize("scale", [0.03, 1.7, 0.25, 3.0, 417.3])
def test_fp8_quotient_correction_recovers_the_ieee_quotient(rng, scale):
    """`correct_quotient` turns any fp32 quotient within 2 ulps of x / scale (what XLA computes:
    x * (1 / s), or PTX's div.full.f32 on a GPU) into the correctly rounded one (numpy's)."""
    from pallas_paged._fp8 import correct_quotient, divide_rn

    n = 200_000
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    x[:4] = [0.0, -0.0, np.inf, np.nan]
    s = np.float32(scale)
    exact = x / s
    correct = jax.jit(correct_quotient)
    for ulps in (-2, -1, 0, 1, 2):
        approx = np.where(np.isfinite(exact) & (exact != 0),
                          (exact.view(np.int32) + ulps).view(np.float32), exact)
        got = np.asarray(correct(jnp.asarray(x), jnp.asarray(s), jnp.asarray(approx)))
        np.testing.assert_array_equal(got.view(np.int32), exact.view(np.int32))
    got = np.asarray(jax.jit(divide_rn)(jnp.asarray(x), jnp.asarray(s)))
    # NaN / s is NaN, but a GPU's division returns its canonical NaN, not numpy's payload
    np.testing.assert_array_equal(np.isnan(got), np.isnan(exact))
    number = ~np.isnan(exact)
    np.testing.assert_array_equal(got[number].view(np.int32), exact[number].view(np.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_forms_store_the_same_bits(rng, impl):
    """A python float, a 0-d and a (1,) fp32 array (torch: a float and a 0-d tensor) store the
    same fp8 bits, bit-identical to torch (0.03 makes x / s and x * (1 / s) differ)."""
    k_cache, v_cache, k, v, slots = draw_write(rng, num_blocks=16, num_tokens=32, num_padding=0,
                                               kvh=2, head_dim=8, dtype="float8_e4m3fn")
    expected = write_torch(k_cache, v_cache, k, v, slots, k_scale=0.03, v_scale=0.3)
    torch_forms = write_torch(k_cache, v_cache, k, v, slots,
                              k_scale=torch.tensor(np.float32(0.03)), v_scale=0.3)
    np.testing.assert_array_equal(bits(torch_forms[0]), bits(expected[0]))
    args = tuple(map(jnp.asarray, (k_cache, v_cache, k, v, slots)))
    for scales in (dict(k_scale=0.03, v_scale=0.3),
                   dict(k_scale=jnp.float32(0.03), v_scale=jnp.full((1,), 0.3, jnp.float32))):
        got = pp.write_kv(*args, impl=impl, **scales)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(bits(g), bits(e))


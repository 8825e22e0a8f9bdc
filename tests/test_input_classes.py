"""One rule per input class, the same in torch_ref, the XLA path and the Pallas kernel.

Every class of input SPEC.md names ("Input classes") runs through all three implementations
here: either they agree on the result (writes bit for bit, decode within the output dtype's
rounding) or all of them raise a ValueError whose message names the argument. The eager path is
the one SPEC gives for untrusted inputs: ``validate_*_inputs`` then the call; classes marked
``static`` must also raise from the call alone.

Classes with int64 indices run twice: as numpy int64 arrays with x64 off (JAX's conversion would
narrow them, so the public functions must handle them first) and as real JAX int64 arrays with
x64 on (the code is shown int64 and must clamp in int64 before narrowing). The jit rules for
values that cannot raise (dropped slots, clamped lengths and block ids) are checked at the end,
with traced int64 inputs, against torch_ref on the inputs those rules map them to.

Then the fp8 scales as arrays: a python float, a 0-d / (1,) fp32 array (torch: tensor) give the
same bits, and one compiled program serves every scale.
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
from pallas_paged.cache_write.api import _write_kv_jit
from pallas_paged.decode_attention.api import _decode_jit
from paged_inputs import NP_DTYPES, bits, make_paged, to_numpy, to_torch

JAX_IMPLS = ("xla", "pallas")
# Both sides compute in fp32 and round once to the output dtype: at most a unit or two of it.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
BIG = 2**32  # int64 values at or past it wrap to small ones when narrowed to int32
INDEX_NAMES = ("slot_mapping", "block_tables", "context_lens")


@dataclasses.dataclass(frozen=True)
class InputClass:
    """``build(rng) -> (arrays, options)``; ``raises``: a regex the ValueError of every
    implementation must match (it names the argument), or None when all must agree."""

    op: str  # "write" or "decode"
    build: Callable
    raises: str | None = None
    static: bool = False  # the call alone raises too (a shape / dtype / option check)
    int64: bool = False   # run with numpy int64 (x64 off) and with JAX int64 (x64 on)


# --- builders -------------------------------------------------------------------------------------

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
    new_dtype = NP_DTYPES["bfloat16" if dtype == "float8_e4m3fn" else dtype]
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


def setting(**values):
    """A patch that replaces (or adds) arrays."""
    return lambda arrays: arrays.update(values)


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


def f32(x):
    return np.asarray(x, np.float32)


FP8 = "float8_e4m3fn"
FP8_SCALES = dict(k_scale=0.05, v_scale=0.5)

DECODE_CLASSES = {
    # Dtypes: one per cache dtype; mixed float dtypes are refused, except over an fp8 cache.
    "fp32": InputClass("decode", decoding(dtype="float32")),
    "bf16": InputClass("decode", decoding(dtype="bfloat16")),
    "fp16": InputClass("decode", decoding(dtype="float16")),
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
                                                       options=FP8_SCALES)),
    "fp8 cache, fp32 q": InputClass("decode", decoding(dtype=FP8, q_dtype="float32",
                                                       options=FP8_SCALES)),
    "fp8 scales as 0-d arrays": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32(0.05), v_scale=f32(0.5)))),
    "fp8 scales as (1,) arrays": InputClass(
        "decode", decoding(dtype=FP8, options=dict(k_scale=f32([0.05]), v_scale=f32(0.5)))),
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
                                int64=True),
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
    "all lengths 0": InputClass("decode", decoding(lens=(0, 0))),
    # Options: huge, edge and bad values.
    "window 2**31": InputClass("decode", decoding(options=dict(sliding_window=2**31))),
    "window 2**40": InputClass("decode", decoding(options=dict(sliding_window=2**40))),
    "window = capacity": InputClass("decode", decoding(lens=(5, 12, 0), options=dict(
        sliding_window=12))),
    "window = capacity - 1": InputClass("decode", decoding(lens=(5, 12, 0), options=dict(
        sliding_window=11))),
    "window 1": InputClass("decode", decoding(options=dict(sliding_window=1))),
    "window 0": InputClass("decode", decoding(options=dict(sliding_window=0)),
                           raises=r"sliding_window=0 must be >= 1", static=True),
    "window float": InputClass("decode", decoding(options=dict(sliding_window=4.0)),
                               raises=r"sliding_window must be a python int", static=True),
    "scale nan": InputClass("decode", decoding(options=dict(scale=float("nan"))),
                            raises=r"scale", static=True),
    "scale beyond fp32": InputClass("decode", decoding(options=dict(scale=1e39)),
                                    raises=r"scale", static=True),
    "negative scale": InputClass("decode", decoding(options=dict(scale=-0.3))),
    "soft cap 0": InputClass("decode", decoding(options=dict(logits_soft_cap=0.0)),
                             raises=r"logits_soft_cap=0\.0 must be finite and > 0", static=True),
    "soft cap 1e300": InputClass("decode", decoding(options=dict(logits_soft_cap=1e300)),
                                 raises=r"logits_soft_cap=1e\+300 must be finite", static=True),
    "sinks and slopes": InputClass("decode", decoding(options=dict(
        sinks=f32([0.5, -1.0, 2.0, 0.0]), alibi_slopes=f32([0.25, 0.5, 1.0, 2.0])))),
    "sinks shape": InputClass("decode", decoding(options=dict(sinks=f32([0.5, 1.0]))),
                              raises=r"sinks\.shape", static=True),
    "slopes float64": InputClass("decode", decoding(options=dict(alibi_slopes=np.zeros(4))),
                                 raises=r"alibi_slopes\.dtype", static=True),
}

WRITE_CLASSES = {
    "fp32": InputClass("write", writing(dtype="float32")),
    "bf16": InputClass("write", writing(dtype="bfloat16")),
    "fp16": InputClass("write", writing(dtype="float16")),
    "fp8, float scales": InputClass("write", writing(dtype=FP8, options=FP8_SCALES)),
    "fp8, array scales": InputClass("write", writing(dtype=FP8, options=dict(
        k_scale=f32(0.05), v_scale=f32([0.5])))),
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
PARAMS = [(name, mode) for name, c in CLASSES.items()
          for mode in (("numpy", "x64") if c.int64 else ("numpy",))]


# --- runners ----------------------------------------------------------------------------------------

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
    """``validate_*_inputs`` (unless told not to), then the call, with numpy inputs (mode
    "numpy") or JAX arrays made with x64 on (mode "x64")."""
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


def assert_agree(op, expected, got, dtype_name):
    if op == "write":
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(bits(g), bits(e))
        return
    (out, lse), (expected_out, expected_lse) = got, expected
    assert out.dtype == expected_out.dtype and out.shape == expected_out.shape
    tol = TOLERANCE[dtype_name]
    np.testing.assert_allclose(out.astype(np.float32), expected_out.astype(np.float32), rtol=tol,
                               atol=tol)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,mode", PARAMS, ids=[f"{n} [{m}]" for n, m in PARAMS])
def test_input_class(rng, name, mode):
    c = CLASSES[name]
    arrays, options = c.build(rng)
    if c.raises is not None:
        with pytest.raises(ValueError, match=c.raises):
            run_torch(c.op, arrays, options)
        for impl in JAX_IMPLS:
            with pytest.raises(ValueError, match=c.raises):
                run_jax(c.op, impl, arrays, options, mode)
            if c.static:
                with pytest.raises(ValueError, match=c.raises):
                    run_jax(c.op, impl, arrays, options, mode, validate=False)
        return
    expected = run_torch(c.op, arrays, options)
    out_dtype = (arrays["q"] if c.op == "decode" else arrays["k_cache"]).dtype
    for impl in JAX_IMPLS:
        got = run_jax(c.op, impl, arrays, options, mode)
        assert_agree(c.op, expected, got, np.dtype(out_dtype).name)


def test_every_class_is_decisive():
    """No class is left undecided, and both outcomes (agree, raise) and both modes are covered."""
    assert {c.raises is None for c in CLASSES.values()} == {True, False}
    assert {m for _, m in PARAMS} == {"numpy", "x64"}
    for name, c in CLASSES.items():
        assert c.op in ("write", "decode"), name
        assert not (c.static and c.raises is None), name


# --- jit rules for values that cannot raise, with traced int64 (x64 on) -------------------------------

@pytest.mark.parametrize("how", ["jit, x64", "eager numpy int64, x64 off"])
@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_int64_slots_outside_int32_are_dropped_never_wrapped(rng, impl, how):
    arrays = write_arrays(rng, slots=(0, 3, 0, 7, 0))
    slots = np.array([BIG + 5, 3, 3 - BIG, 7, BIG - 1], np.int64)
    expected = run_torch("write", dict(arrays, slot_mapping=np.array([-1, 3, -1, 7, -1], np.int64)), {})
    if how == "jit, x64":
        with jax.enable_x64(True):
            x = {name: jnp.asarray(a) for name, a in dict(arrays, slot_mapping=slots).items()}
            assert x["slot_mapping"].dtype == jnp.int64
            got = jax.jit(functools.partial(pp.write_kv, impl=impl, interpret=True))(**x)
    else:
        got = pp.write_kv(**dict(arrays, slot_mapping=slots), impl=impl, interpret=True)
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(bits(g), bits(e))  # slot 5 (and the last slot) untouched


@pytest.mark.parametrize("how", ["jit, x64", "eager numpy int64, x64 off"])
@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_int64_lengths_and_ids_outside_int32_are_clamped_never_wrapped(rng, impl, how):
    """Lengths clamp into [0, capacity], block ids into [0, num_blocks): torch_ref on the clamped
    inputs is the expected result (a wrapped 2**32 + 1 would read as length 1, id 1)."""
    p = make_paged(rng, lens=(5, 9, 2), num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype="float32", fill=0.0)
    num_blocks, capacity = p.k_cache.shape[0], p.block_tables.shape[1] * 4
    lens = np.array([BIG + 1, 9, 2 - BIG], np.int64)
    tables = p.block_tables.astype(np.int64)
    tables[1, 0] = BIG + 1
    arrays = dict(q=p.q, k_cache=p.k_cache, v_cache=p.v_cache, block_tables=tables,
                  context_lens=lens)
    expected = run_torch("decode", dict(arrays, context_lens=np.clip(lens, 0, capacity),
                                        block_tables=np.clip(tables, 0, num_blocks - 1)), {})
    if how == "jit, x64":
        with jax.enable_x64(True):
            x = {name: jnp.asarray(a) for name, a in arrays.items()}
            assert x["context_lens"].dtype == x["block_tables"].dtype == jnp.int64
            fn = jax.jit(functools.partial(pp.decode, impl=impl, interpret=True, return_lse=True))
            got = tuple(map(np.asarray, fn(**x)))
    else:
        got = tuple(map(np.asarray, pp.decode(**arrays, impl=impl, interpret=True, return_lse=True)))
    assert_agree("decode", expected, got, "float32")


# --- fp8 scales: python floats and fp32 arrays alike, one program for every scale ----------------------

@pytest.mark.parametrize("impl", JAX_IMPLS)
def test_scale_forms_store_the_same_bits(rng, impl):
    """A python float, a 0-d and a (1,) fp32 array (torch: a float and a 0-d tensor) store the
    same fp8 bits, bit-identical to torch (0.03 makes x / s and x * (1 / s) differ)."""
    arrays = write_arrays(rng, dtype=FP8, num_blocks=16, slots=tuple(range(0, 64, 2)))
    forms = [dict(k_scale=0.03, v_scale=0.3), dict(k_scale=f32(0.03), v_scale=f32([0.3]))]
    expected = run_torch("write", arrays, forms[0])
    for form in forms:
        np.testing.assert_array_equal(bits(run_torch("write", arrays, form)[0]), bits(expected[0]))
        got = run_jax("write", impl, arrays, form, "numpy")
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(bits(g), bits(e))


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
        expected_k, _ = run_torch("write", arrays, dict(k_scale=k_scale, v_scale=v_scale))
        np.testing.assert_array_equal(bits(k_cache), bits(expected_k))
        written = dict(arrays, k_cache=expected_k, v_cache=run_torch(
            "write", arrays, dict(k_scale=k_scale, v_scale=v_scale))[1])
        expected_out, _ = run_torch("decode", dict(q=q, k_cache=written["k_cache"],
                                                   v_cache=written["v_cache"], block_tables=tables,
                                                   context_lens=lens),
                                    dict(k_scale=k_scale, v_scale=v_scale))
        np.testing.assert_allclose(np.asarray(out).astype(np.float32),
                                   expected_out.astype(np.float32), rtol=1.6e-2, atol=1.6e-2)
    assert len(traces) == 1 and step._cache_size() == 1

    # The public functions, eagerly, with python floats: the scales are operands, not constants.
    shapes = dict(num_blocks=7, block_size=3, kvh=1, head_dim=24, slots=(4, 11))  # unused elsewhere
    fresh = write_arrays(rng, dtype=FP8, **shapes)
    q1 = rng.standard_normal((1, 2, 24)).astype(NP_DTYPES["bfloat16"])
    writes, decodes = _write_kv_jit._cache_size(), _decode_jit._cache_size()
    for scale in (0.5, 0.25, 0.125):
        k_cache, v_cache = pp.write_kv(**fresh, k_scale=scale, v_scale=2 * scale, interpret=True)
        pp.decode(q1, k_cache, v_cache, np.array([[2, 3]], np.int32), np.array([5], np.int32),
                  k_scale=scale, v_scale=2 * scale, impl="xla")
    assert _write_kv_jit._cache_size() - writes == 1
    assert _decode_jit._cache_size() - decodes == 1


def test_parity_passes_both_scale_forms():
    """The default parity suite holds fp8 cases with float scales and with array scales, and the
    harness hands the latter to both frameworks as fp32 arrays."""
    from parity import cases, compare

    fp8 = [c for c in cases.DEFAULT_SUITE if c.dtype == FP8]
    assert {c.array_scales for c in fp8} == {False, True}
    case = next(c for c in fp8 if c.array_scales)
    scales = compare._scales(case, lambda s: np.asarray(s, np.float32))
    assert all(isinstance(s, np.ndarray) and s.dtype == np.float32 for s in scales.values())
    assert float(scales["k_scale"]) == np.float32(case.k_scale)
    plain = next(c for c in fp8 if not c.array_scales)
    assert compare._scales(plain, None) == dict(k_scale=plain.k_scale, v_scale=plain.v_scale)


def test_sharded_functions_take_scales_per_call(rng):
    """`shard_write_kv` / `shard_decode` take the fp8 scales per call (replicated operands): one
    compiled program for three layers' scales, the same bits as the single-device functions."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    write = pp.shard_write_kv(mesh, kv_axis="tp", impl="xla")
    decode = pp.shard_decode(mesh, kv_axis="tp", impl="xla")
    arrays = write_arrays(rng, dtype=FP8, num_blocks=6, block_size=4, kvh=2, head_dim=16,
                          slots=(1, 7, 12))
    q = jnp.asarray(rng.standard_normal((3, 4, 16)).astype(NP_DTYPES["bfloat16"]))
    tables = jnp.array([[0, 1], [2, 3], [4, 5]], jnp.int32)
    lens = jnp.array([2, 8, 5], jnp.int32)
    for k_scale, v_scale in ((0.05, 0.5), (0.1, f32(0.25)), (f32([0.02]), 1.5)):
        x = {name: jnp.asarray(a) for name, a in arrays.items()}
        expected_k, expected_v = pp.write_kv(**x, k_scale=k_scale, v_scale=v_scale, impl="xla")
        per_call = dict(k_scale=jnp.float32(np.reshape(k_scale, ())),  # one shape: one program
                        v_scale=jnp.float32(np.reshape(v_scale, ())))
        k_cache, v_cache = write(**{name: jnp.asarray(a) for name, a in arrays.items()}, **per_call)
        np.testing.assert_array_equal(bits(k_cache), bits(expected_k))
        np.testing.assert_array_equal(bits(v_cache), bits(expected_v))
        out = decode(q, k_cache, v_cache, tables, lens, **per_call)
        expected = pp.decode(q, expected_k, expected_v, tables, lens, k_scale=k_scale,
                             v_scale=v_scale, impl="xla")
        np.testing.assert_array_equal(bits(out), bits(expected))
    assert write._cache_size() == 1 and decode._cache_size() == 1

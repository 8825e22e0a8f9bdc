"""shard_decode / shard_paged_attention / shard_write_kv on 4 devices: bit-identical to one device, and no collectives.

The multi-device checks need 4 JAX devices. On CPU those are virtual devices that exist only when
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` is set before JAX creates its backends,
which a normal test run has done long before this file is imported. So:

- every multi-device test is skipped in a process with fewer than 4 devices, and
- `test_multi_device_checks_in_subprocess` runs this file again in a fresh CPU process with 4
  virtual devices and asserts that every one of those tests passed there (none skipped).

A process that already has 4 devices (``XLA_FLAGS`` set by hand, or a 4-GPU machine) runs them
in place and skips the subprocess.

Layouts: tensor parallel on a ``(4,)`` mesh ``"tp"``, batch parallel on a ``(4,)`` mesh ``"dp"``
(block ids and slots local to each device's cache shard), and both on a ``2 x 2`` mesh. The
single-device reference sees the same global arrays, with local ids translated to global ones
(``global block = shard * blocks_per_shard + local block``).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_paged
from paged_inputs import bits, draw_write
from pallas_paged import sharding
from parity import tolerance
from parity.layout import paged_layout

NUM_DEVICES = 4
CHILD_ENV = "PALLAS_PAGED_SHARDING_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
HAVE_DEVICES = len(jax.devices()) >= NUM_DEVICES
if IN_CHILD and not HAVE_DEVICES:  # the subprocess must run the checks, never skip them
    raise RuntimeError(f"{CHILD_ENV}=1 but JAX sees {len(jax.devices())} devices: {jax.devices()}")
needs_devices = pytest.mark.skipif(
    not HAVE_DEVICES, reason=f"needs {NUM_DEVICES} devices; run by test_multi_device_checks_in_subprocess")

# name -> (mesh shape, mesh axis names, kv_axis, batch_axis)
LAYOUTS = {
    "tp4": ((4,), ("tp",), "tp", None),
    "dp4": ((4,), ("dp",), None, "dp"),
    "dp2xtp2": ((2, 2), ("dp", "tp"), "tp", "dp"),
    # A machine with two GPUs (test_*_on_two_gpus).
    "tp2": ((2,), ("tp",), "tp", None),
    "dp2": ((2,), ("dp",), None, "dp"),
}
FOUR_DEVICE_LAYOUTS = ("tp4", "dp4", "dp2xtp2")
TWO_GPUS = sum(d.platform == "gpu" for d in jax.devices()) >= 2
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two GPUs")
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
             "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def slow_except(cases, fast):
    """``(case, layout)`` params, those outside ``fast`` marked slow (a Pallas kernel in interpret
    mode compiles slowly on the CPU, once per shard shape)."""
    return [pytest.param(*c, id="-".join(c), marks=[] if c in fast else [pytest.mark.slow])
            for c in cases]


def make_mesh(layout: str) -> Mesh:
    shape, names, _, _ = LAYOUTS[layout]
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def batch_shards(layout: str) -> int:
    shape, names, _, batch_axis = LAYOUTS[layout]
    return 1 if batch_axis is None else shape[names.index(batch_axis)]


def assert_within_rounding(actual, expected, what: str) -> None:
    """Two reductions of the same sums in another order: within `parity.tolerance.ULP_BOUND`
    ulps of the output's dtype (fp32 for the lse) at the array's largest magnitude."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (what, a.shape, a.dtype, e.shape, e.dtype)
    dtype = np.dtype(e.dtype).name
    finite = np.isfinite(e.astype(np.float64))
    magnitude = float(np.abs(e.astype(np.float64)[finite]).max(initial=0.0))
    ulps = tolerance.ulps_between(a, e, magnitude, dtype)
    bound = tolerance.ULP_BOUND["lse" if what == "lse" else dtype]
    assert ulps.max(initial=0.0) <= bound, f"{what}: {ulps.max():.1f} ulps of {dtype} apart"


def assert_bitwise_equal(actual, expected, what: str) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (what, a.shape, a.dtype, e.shape, e.dtype)
    mismatch = bits(a) != bits(e)
    assert not mismatch.any(), f"{what}: {mismatch.sum()} of {mismatch.size} elements differ"


def assert_no_collectives(compiled) -> None:
    found = sharding.collectives_in(compiled.as_text())
    assert not found, f"the compiled sharded program communicates: {found}"


def put(x, shardings, name):
    return jax.device_put(x, shardings[name])


def assert_sharded(x, expected: NamedSharding) -> None:
    assert x.sharding.is_equivalent_to(expected, x.ndim), (x.sharding, expected)


# ---------------------------------------------------------------------------------------- inputs
#
# One global problem per case serves every layout: the blocks (and slots) are drawn from 4 pools,
# one per contiguous quarter of the batch (of the tokens), and a layout with s batch shards joins
# 4 / s neighbouring pools into one shard. Its local ids are the global ids minus the shard's first
# block (slot). The single-device reference is computed once per case, on the global ids.

POOLS = 4


def to_local(ids: np.ndarray, used: np.ndarray, shards: int, per_shard_ids: int) -> np.ndarray:
    """Global block ids (rows of a table) or slots (tokens) -> ids local to each row's shard."""
    rows_per_shard = ids.shape[0] // shards
    offset = (np.arange(ids.shape[0]) // rows_per_shard) * per_shard_ids
    offset = offset.reshape((-1,) + (1,) * (ids.ndim - 1))
    return np.where(used, ids - offset, ids).astype(np.int32)


@functools.cache
def decode_problem(dtype: str, *, batch=8, num_heads=12, num_kv_heads=4, head_dim=16,
                   block_size=4, max_blocks=5, spare=2):
    """A decode problem whose sequences take their blocks from `POOLS` pools (see above).

    GQA group 3 (12 heads on 4 kv heads), so a wrong head -> kv head mapping on a shard shows.
    Lengths 0, 1, bs - 1, bs, bs + 1 and the capacity; shuffled blocks; garbage table tails; NaN
    in every cache slot that is not a valid token.
    """
    rng = np.random.default_rng(zlib.crc32(dtype.encode()))
    rows_per_pool = batch // POOLS
    blocks_per_pool = rows_per_pool * max_blocks + spare
    num_blocks = POOLS * blocks_per_pool
    capacity = max_blocks * block_size
    lens = rng.permutation([0, 1, block_size - 1, block_size, block_size + 1, capacity, 7, 13])
    lens = lens[:batch].astype(np.int32)
    tables, valid_slots = [], []
    for pool in range(POOLS):  # each pool's rows on its own blocks, its spare ones among them
        pool_lens = lens[pool * rows_per_pool:(pool + 1) * rows_per_pool]
        pages = int((-(-pool_lens // block_size)).sum())
        layout = paged_layout(rng, pool_lens, block_size=block_size, table_width=max_blocks,
                              spare_blocks=blocks_per_pool - pages, tail=(0,))
        assert layout.num_blocks == blocks_per_pool
        tables.append(layout.block_tables + pool * blocks_per_pool)
        valid_slots.append(layout.valid_slots(block_size))
    tables, valid_slots = np.concatenate(tables), np.concatenate(valid_slots)
    used = np.arange(max_blocks)[None, :] < -(-lens // block_size)[:, None]
    garbage = rng.choice(np.array([99999, -7, num_blocks], np.int32), size=tables.shape)
    tables = np.where(used, tables, garbage).astype(np.int32)

    def cache():
        c = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
        c.reshape(-1, num_kv_heads, head_dim)[~valid_slots] = np.nan  # never read
        return c.astype(NP_DTYPES[dtype])

    return dict(
        q=rng.standard_normal((batch, num_heads, head_dim)).astype(NP_DTYPES[dtype]),
        k_cache=cache(), v_cache=cache(), block_tables=tables, context_lens=lens, used=used,
        alibi_slopes=(2.0 ** -rng.uniform(0, 8, num_heads)).astype(np.float32),
        sinks=rng.standard_normal(num_heads).astype(np.float32))


def decode_inputs(dtype: str, layout: str) -> dict:
    """The case's arrays with the block tables made local to the layout's batch shards."""
    problem = dict(decode_problem(dtype))
    shards = batch_shards(layout)
    problem["block_tables"] = to_local(problem["block_tables"], problem.pop("used"), shards,
                                       problem["k_cache"].shape[0] // shards)
    return problem


@functools.cache
def write_problem(dtype: str, *, tokens=8, num_kv_heads=4, head_dim=16, block_size=4,
                  blocks_per_pool=6):
    """Caches and a chunk of tokens per pool; one padding token (slot -1) per pool."""
    rng = np.random.default_rng(zlib.crc32(dtype.encode()) + 1)
    per_pool = tokens // POOLS
    slots_per_pool = blocks_per_pool * block_size
    slots = np.concatenate([pool * slots_per_pool + rng.choice(slots_per_pool, per_pool, replace=False)
                            for pool in range(POOLS)])
    slots[::per_pool] = -1
    cache_shape = (POOLS * blocks_per_pool, block_size, num_kv_heads, head_dim)
    row_dtype = ml_dtypes.bfloat16 if dtype == "float8_e4m3fn" else NP_DTYPES[dtype]
    new = lambda shape, t: rng.standard_normal(shape).astype(t)  # noqa: E731
    return dict(k_cache=new(cache_shape, NP_DTYPES[dtype]), v_cache=new(cache_shape, NP_DTYPES[dtype]),
                k=new((tokens, num_kv_heads, head_dim), row_dtype),
                v=new((tokens, num_kv_heads, head_dim), row_dtype), slot_mapping=slots.astype(np.int32))


def write_inputs(dtype: str, layout: str) -> dict:
    """The case's arrays with the slots made local to the layout's batch shards."""
    problem = dict(write_problem(dtype))
    shards = batch_shards(layout)
    slots = problem["slot_mapping"]
    num_slots = problem["k_cache"].shape[0] * problem["k_cache"].shape[1]
    problem["slot_mapping"] = to_local(slots, slots >= 0, shards, num_slots // shards)
    return problem


# ---------------------------------------------------------------------------------------- decode

DECODE_CASES = {
    # name -> (impl, dtype, extensions on, DecodeConfig for the Pallas kernel)
    "xla-plain": ("xla", "float32", False, None),
    "xla-ext": ("xla", "bfloat16", True, None),
    "pallas-plain": ("pallas", "float32", False, pallas_paged.DecodeConfig(block_k=16)),
    "pallas-ext-split": ("pallas", "bfloat16", True,
                         pallas_paged.DecodeConfig(block_k=16, num_splits=2)),
}
# Every layout for the XLA path and the full-featured kernel case; the plain kernel once (Pallas
# interpret mode compiles slowly on CPU).
DECODE_GRID = slow_except([(case, layout) for case in ("xla-plain", "xla-ext", "pallas-ext-split")
                           for layout in FOUR_DEVICE_LAYOUTS] + [("pallas-plain", "tp4")],
                          fast=[("xla-ext", "dp2xtp2")])
DECODE_ARGS = ("q", "k_cache", "v_cache", "block_tables", "context_lens")
HEAD_ARRAYS = ("alibi_slopes", "sinks")


def decode_static(case: str) -> dict:
    impl, _, ext, config = DECODE_CASES[case]
    static = dict(impl=impl, config=config)
    if ext:
        static.update(return_lse=True, logits_soft_cap=5.0)
    return static


@functools.cache
def decode_reference(case: str):
    """`decode` on one device, global block ids: ``out`` or ``(out, lse)`` as numpy."""
    _, dtype, ext, _ = DECODE_CASES[case]
    problem = decode_problem(dtype)
    args = [problem[name] for name in DECODE_ARGS]
    extras = {name: jnp.asarray(problem[name]) for name in HEAD_ARRAYS} if ext else {}
    result = pallas_paged.decode(*args, **extras, **decode_static(case))
    return jax.tree.map(np.asarray, result)


@needs_devices
@pytest.mark.parametrize(("case", "layout"), DECODE_GRID)
def test_decode_matches_single_device(case, layout):
    """Bitwise equal to `decode` on one device, from one compiled program with no collectives.

    The ``-ext`` cases turn on return_lse, sinks, ALiBi and the soft cap (the head-indexed arrays
    must be split with the heads); ``-split`` runs the kernel's split-K merge on every shard.
    """
    check_decode(case, layout)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("case", ["pallas-plain", "pallas-ext-split", "xla-ext"])
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_decode_on_two_gpus(case, layout):
    """The same check with the compiled kernel on a machine with two GPUs."""
    check_decode(case, layout)


def check_decode(case: str, layout: str) -> None:
    _, dtype, ext, _ = DECODE_CASES[case]
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    inputs = decode_inputs(dtype, layout)
    shardings = sharding.decode_shardings(mesh, kv_axis=kv_axis, batch_axis=batch_axis)
    args = [put(inputs[name], shardings, name) for name in DECODE_ARGS]
    kwargs = {name: put(inputs[name], shardings, name) for name in HEAD_ARRAYS} if ext else {}
    fn = sharding.shard_decode(mesh, kv_axis=kv_axis, batch_axis=batch_axis, **decode_static(case))
    compiled = fn.lower(*args, **kwargs).compile()
    assert_no_collectives(compiled)
    result = compiled(*args, **kwargs)

    expected = decode_reference(case)
    # The Pallas kernel computes each (sequence, kv head) alone, so a shard's result is bitwise the
    # single-device one everywhere. XLA's GPU fusions may reduce in another order for the smaller
    # per-device shapes: there the XLA path is held to rounding instead.
    exact = DECODE_CASES[case][0] == "pallas" or jax.default_backend() == "cpu"
    same = assert_bitwise_equal if exact else assert_within_rounding
    if ext:
        (out, lse), (expected, expected_lse) = result, expected
        same(lse, expected_lse, "lse")
        assert_sharded(lse, shardings["lse"])
    else:
        out = result
    same(out, expected, "out")
    assert_sharded(out, shardings["out"])
    assert np.isfinite(np.asarray(out, np.float32)).all()


@needs_devices
def test_decode_head_arrays_given_at_construction():
    """sinks / alibi_slopes passed to shard_decode are defaults of the returned function."""
    inputs = decode_inputs("float32", "tp4")
    extras = {name: jnp.asarray(inputs[name]) for name in HEAD_ARRAYS}
    args = [inputs[name] for name in DECODE_ARGS]
    fn = sharding.shard_decode(make_mesh("tp4"), impl="xla", **extras)
    expected = pallas_paged.decode(*args, impl="xla", **extras)
    assert_bitwise_equal(fn(*args), expected, "out")


@needs_devices
def test_shards_are_independent():
    """A batch-parallel shard reads only its own pool, through ids local to it: shard 1 alone on its
    slice of the cache gives its rows of the output, and NaN over device 0's whole pool leaves the
    rows of devices 1-3 unchanged."""
    inputs = decode_inputs("float32", "dp4")
    q, kc, vc, tables, lens = (inputs[name] for name in DECODE_ARGS)
    expected = decode_reference("xla-plain")
    blocks_per_shard = kc.shape[0] // 4
    rows, blocks = slice(2, 4), slice(blocks_per_shard, 2 * blocks_per_shard)
    alone = pallas_paged.decode(q[rows], kc[blocks], vc[blocks], tables[rows], lens[rows], impl="xla")
    assert_bitwise_equal(alone, expected[rows], "shard 1 alone")
    mesh = make_mesh("dp4")
    kc_poisoned = kc.copy()
    kc_poisoned[:blocks_per_shard] = np.nan
    fn = sharding.shard_decode(mesh, kv_axis=None, batch_axis="dp", impl="xla")
    out = np.asarray(fn(q, kc_poisoned, vc, tables, lens))
    assert_bitwise_equal(out[2:], expected[2:], "rows of devices 1-3")


# ----------------------------------------------------------------------------------------- write

WRITE_CASES = {
    # name -> (impl, cache dtype, write_kv keywords)
    "xla-fp32": ("xla", "float32", {}),
    "xla-fp8": ("xla", "float8_e4m3fn", dict(k_scale=0.5, v_scale=0.25)),
    "pallas-bf16": ("pallas", "bfloat16", {}),
}
# Every layout for the plain XLA write; fp8 and the Pallas kernel on the 2-D mesh (both axes).
WRITE_GRID = slow_except([("xla-fp32", layout) for layout in FOUR_DEVICE_LAYOUTS]
                         + [("xla-fp8", "dp2xtp2"), ("pallas-bf16", "dp2xtp2")],
                         fast=[("xla-fp32", "dp4")])


@functools.cache
def write_reference(case: str):
    """`write_kv` on one device, global slots: ``(k_cache, v_cache)`` as numpy."""
    impl, dtype, extra = WRITE_CASES[case]
    p = write_problem(dtype)
    result = pallas_paged.write_kv(p["k_cache"], p["v_cache"], p["k"], p["v"], p["slot_mapping"],
                                   impl=impl, **extra)
    return jax.tree.map(np.asarray, result)


@needs_devices
@pytest.mark.parametrize(("case", "layout"), WRITE_GRID)
def test_write_kv_in_place_matches_single_device(case, layout):
    """Bitwise equal to `write_kv` on one device (writing the same tokens twice changes nothing
    more); the donated caches are consumed and every device's buffers reused; no collectives."""
    check_write(case, layout)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("case", ["pallas-bf16", "xla-fp8"])
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_write_kv_on_two_gpus(case, layout):
    """The sharded write on two GPUs, compiled."""
    check_write(case, layout)


def check_write(case: str, layout: str) -> None:
    impl, dtype, extra = WRITE_CASES[case]
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    inputs = write_inputs(dtype, layout)
    shardings = sharding.write_shardings(mesh, kv_axis=kv_axis, batch_axis=batch_axis)
    kc, vc, k, v, slots = (put(inputs[name], shardings, name)
                           for name in ("k_cache", "v_cache", "k", "v", "slot_mapping"))
    fn = sharding.shard_write_kv(mesh, kv_axis=kv_axis, batch_axis=batch_axis, impl=impl, **extra)
    compiled = fn.lower(kc, vc, k, v, slots).compile()
    assert_no_collectives(compiled)
    new_k, new_v = compiled(kc, vc, k, v, slots)
    assert kc.is_deleted() and vc.is_deleted()
    assert_sharded(new_k, shardings["k_cache"])
    # A second step (the same write again) on caches that XLA allocated: on CPU, device_put may
    # wrap numpy's memory, which a donation cannot reuse, so the buffer check starts here.
    pointers = [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in (new_k, new_v)]
    kc, vc = new_k, new_v
    new_k, new_v = compiled(kc, vc, k, v, slots)
    assert kc.is_deleted() and vc.is_deleted()
    assert [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards] for x in (new_k, new_v)] == pointers
    expected_k, expected_v = write_reference(case)
    assert_bitwise_equal(new_k, expected_k, "k_cache")
    assert_bitwise_equal(new_v, expected_v, "v_cache")


# -------------------------------------------------------------------------------------- failures

def decode_arrays(batch=8, num_heads=12, num_kv_heads=4, num_blocks=48, block_size=4):
    f = jnp.float32
    return (jnp.zeros((batch, num_heads, 16), f),
            jnp.zeros((num_blocks, block_size, num_kv_heads, 16), f),
            jnp.zeros((num_blocks, block_size, num_kv_heads, 16), f),
            jnp.zeros((batch, 5), jnp.int32), jnp.zeros((batch,), jnp.int32))


def write_arrays(tokens=8, num_kv_heads=4, num_blocks=24):
    cache = jnp.zeros((num_blocks, 4, num_kv_heads, 16), jnp.float32)
    rows = jnp.zeros((tokens, num_kv_heads, 16), jnp.float32)
    return cache, cache, rows, rows, jnp.full((tokens,), -1, jnp.int32)


@needs_devices
@pytest.mark.parametrize(("layout", "arrays", "match"), [
    ("tp4", dict(num_heads=6, num_kv_heads=6),
     r"num_kv_heads=6 must be divisible by the size of mesh axis 'tp' \(4\).*k_cache.shape=\(48, 4, 6, 16\)"),
    ("dp4", dict(batch=6), r"batch=6 must be divisible by the size of mesh axis 'dp' \(4\).*q.shape=\(6, 12, 16\)"),
    ("dp4", dict(num_blocks=50), r"num_blocks=50 must be divisible by .*'dp' \(4\)"),
    ("dp2xtp2", dict(num_heads=9, num_kv_heads=3), r"num_kv_heads=3 .* 'tp' \(2\).*'dp': 2, 'tp': 2"),
    ("tp4", dict(num_heads=10), r"num_heads must be a multiple of num_kv_heads"),
])
def test_decode_rejects_indivisible_shapes(layout, arrays, match):
    """Heads or batch not divisible by the mesh axis: a ValueError naming the shape."""
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    fn = sharding.shard_decode(mesh, kv_axis=kv_axis, batch_axis=batch_axis, impl="xla")
    with pytest.raises(ValueError, match=match):
        fn(*decode_arrays(**arrays))


@needs_devices
@pytest.mark.parametrize(("layout", "arrays", "match"), [
    ("tp4", dict(num_kv_heads=2), r"num_kv_heads=2 must be divisible by the size of mesh axis 'tp' \(4\)"),
    ("dp4", dict(tokens=6), r"num_tokens=6 must be divisible by .*'dp' \(4\).*slot_mapping.shape=\(6,\)"),
    ("dp4", dict(num_blocks=10), r"num_blocks=10 must be divisible by .*'dp' \(4\)"),
])
def test_write_rejects_indivisible_shapes(layout, arrays, match):
    """kv heads, tokens or blocks not divisible by the mesh axis: a ValueError naming them."""
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    fn = sharding.shard_write_kv(mesh, kv_axis=kv_axis, batch_axis=batch_axis, impl="xla")
    with pytest.raises(ValueError, match=match):
        fn(*write_arrays(**arrays))


@needs_devices
@pytest.mark.parametrize("make", [sharding.shard_decode, sharding.shard_paged_attention,
                                  sharding.shard_write_kv])
@pytest.mark.parametrize(("axes", "match"), [
    (dict(kv_axis="model"), r"kv_axis='model' is not an axis of the mesh: mesh axes \{'dp': 2, 'tp': 2\}"),
    (dict(kv_axis="tp", batch_axis="data"), r"batch_axis='data' is not an axis of the mesh"),
    (dict(kv_axis=None), r"kv_axis and batch_axis are both None"),
    (dict(kv_axis="tp", batch_axis="tp"), r"must be different mesh axes"),
    (dict(impl="xla", block_size=16), r"unknown .* keyword\(s\) \['block_size'\]"),
])
def test_bad_mesh_axes_and_keywords(make, axes, match):
    """Axes the mesh lacks, one axis named twice, or unknown keywords: a ValueError."""
    with pytest.raises(ValueError, match=match):
        make(make_mesh("dp2xtp2"), **axes)


@needs_devices
def test_collective_detector_sees_a_psum():
    """The HLO check is not vacuous: a program that does reduce across devices is caught."""
    mesh = make_mesh("tp4")
    fn = jax.jit(jax.shard_map(functools.partial(jax.lax.psum, axis_name="tp"), mesh=mesh, in_specs=P("tp"),
                               out_specs=P()))
    x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("tp")))
    assert "all-reduce" in sharding.collectives_in(fn.lower(x).compile().as_text())


# ------------------------------------------------------------------------------ ragged attention
#
# The decode problem's sequences, caches and tables, each sequence bringing 0..4 new tokens. A
# layout with s batch shards gives shard j the token rows [j * T/s, (j + 1) * T/s): its sequences'
# new tokens packed from the start of that chunk, padding after them, and a query_start_loc
# segment local to the chunk. The single-device reference runs `paged_attention` once per shard
# chunk on the global cache and global block ids (s = 1: once, on the whole batch).

RAGGED_TOKENS = 32
RAGGED_CASES = {
    # name -> (impl, dtype, extensions on, AttentionConfig for the Pallas kernel)
    "xla-ext": ("xla", "bfloat16", True, None),
    "pallas-ext-split": ("pallas", "bfloat16", True,
                         pallas_paged.AttentionConfig(block_q=2, block_k=16, num_splits=2)),
}
RAGGED_GRID = slow_except([("xla-ext", layout) for layout in FOUR_DEVICE_LAYOUTS]
                          + [("pallas-ext-split", "tp4"), ("pallas-ext-split", "dp2xtp2")],
                          fast=[("xla-ext", "dp2xtp2")])
RAGGED_ARGS = DECODE_ARGS + ("query_start_loc",)


@functools.cache
def ragged_new_tokens(dtype: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each sequence's number of new tokens (at most its length, at most 4) and their queries."""
    problem = decode_problem(dtype)
    rng = np.random.default_rng(zlib.crc32(dtype.encode()) + 2)
    lens = problem["context_lens"]
    q_lens = np.minimum(lens, rng.integers(1, 5, size=lens.shape)).astype(np.int32)
    heads, dim = problem["q"].shape[1:]
    queries = [rng.standard_normal((int(n), heads, dim)).astype(NP_DTYPES[dtype]) for n in q_lens]
    return q_lens, queries


def ragged_inputs(dtype: str, shards: int) -> dict:
    """The decode problem's arrays with ``q`` / ``query_start_loc`` laid out for ``shards`` batch
    shards (block ids still global)."""
    problem = dict(decode_problem(dtype))
    problem.pop("used")
    q_lens, queries = ragged_new_tokens(dtype)
    batch = len(q_lens)
    per_shard, rows = batch // shards, RAGGED_TOKENS // shards
    rng = np.random.default_rng(shards)
    q = rng.standard_normal((RAGGED_TOKENS,) + queries[0].shape[1:]).astype(NP_DTYPES[dtype])
    segments = []
    for j in range(shards):
        mine = range(j * per_shard, (j + 1) * per_shard)
        local = np.concatenate([[0], np.cumsum(q_lens[list(mine)])]).astype(np.int32)
        assert local[-1] <= rows, (local, rows)
        for b, start in zip(mine, local):
            q[j * rows + start: j * rows + start + q_lens[b]] = queries[b]
        segments.append(local)
    problem["q"] = q
    problem["query_start_loc"] = np.concatenate(segments) if shards > 1 else segments[0]
    return problem


@functools.cache
def ragged_reference(case: str, shards: int):
    """`paged_attention` on one device, once per shard chunk: ``(out, lse)`` as numpy."""
    impl, dtype, _, config = RAGGED_CASES[case]
    problem = ragged_inputs(dtype, shards)
    per_shard, rows = len(problem["context_lens"]) // shards, RAGGED_TOKENS // shards
    outs, lses = [], []
    for j in range(shards):
        seqs, toks = slice(j * per_shard, (j + 1) * per_shard), slice(j * rows, (j + 1) * rows)
        qsl = problem["query_start_loc"][j * (per_shard + 1):(j + 1) * (per_shard + 1)]
        out, lse = pallas_paged.paged_attention(
            problem["q"][toks], problem["k_cache"], problem["v_cache"],
            problem["block_tables"][seqs], problem["context_lens"][seqs], qsl,
            alibi_slopes=problem["alibi_slopes"], sinks=problem["sinks"], logits_soft_cap=5.0,
            return_lse=True, impl=impl, config=config)
        outs.append(np.asarray(out))
        lses.append(np.asarray(lse))
    return np.concatenate(outs), np.concatenate(lses)


@needs_devices
@pytest.mark.parametrize(("case", "layout"), RAGGED_GRID)
def test_paged_attention_matches_single_device(case, layout):
    """shard_paged_attention: bitwise the single-device result, one program, no collectives.

    Every option that a shard must split with the heads (ALiBi, sinks) is on, with lse; the
    ``-split`` case runs the kernel's split-K merge on every shard; padding rows stay zeros.
    """
    impl, dtype, _, config = RAGGED_CASES[case]
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    shards = batch_shards(layout)
    inputs = ragged_inputs(dtype, shards)
    used = decode_problem(dtype)["used"]
    inputs["block_tables"] = to_local(inputs["block_tables"], used, shards,
                                      inputs["k_cache"].shape[0] // shards)
    shardings = sharding.attention_shardings(mesh, kv_axis=kv_axis, batch_axis=batch_axis)
    args = [put(inputs[name], shardings, name) for name in RAGGED_ARGS]
    kwargs = {name: put(inputs[name], shardings, name) for name in HEAD_ARRAYS}
    fn = sharding.shard_paged_attention(mesh, kv_axis=kv_axis, batch_axis=batch_axis, impl=impl,
                                        config=config, return_lse=True, logits_soft_cap=5.0)
    compiled = fn.lower(*args, **kwargs).compile()
    assert_no_collectives(compiled)
    out, lse = compiled(*args, **kwargs)
    expected, expected_lse = ragged_reference(case, shards)
    # The kernel computes each (query tile, kv head) alone: bitwise the single-device result. The
    # XLA path's reductions may associate differently for the per-device shapes (seen on CPU: the
    # lse of a few rows, in its last bit): there it is held to rounding.
    same = assert_bitwise_equal if impl == "pallas" else assert_within_rounding
    same(out, expected, "out")
    same(lse, expected_lse, "lse")
    assert_sharded(out, shardings["out"])
    assert_sharded(lse, shardings["lse"])
    q_lens, _ = ragged_new_tokens(dtype)
    per_shard, rows = len(q_lens) // shards, RAGGED_TOKENS // shards
    for j in range(shards):  # the padding rows after each shard's tokens are zeros
        used_rows = int(q_lens[j * per_shard:(j + 1) * per_shard].sum())
        assert not np.asarray(out, np.float32)[j * rows + used_rows:(j + 1) * rows].any()


@needs_devices
@pytest.mark.parametrize(("layout", "arrays", "match"), [
    ("tp4", dict(num_heads=6, num_kv_heads=6),
     r"num_kv_heads=6 must be divisible by the size of mesh axis 'tp' \(4\)"),
    ("dp4", dict(tokens=30), r"num_tokens=30 must be divisible by .*'dp' \(4\)"),
    ("dp4", dict(qsl=9), r"query_start_loc.shape=\(9,\) must be \[batch \+ n\] = \(12,\)"),
    ("tp4", dict(qsl=12), r"query_start_loc.shape=\(12,\) must be \[batch \+ n\] = \(9,\)"),
])
def test_paged_attention_rejects_indivisible_shapes(layout, arrays, match):
    """kv heads, tokens or batch not divisible by the mesh axis: a ValueError naming them."""
    mesh = make_mesh(layout)
    _, _, kv_axis, batch_axis = LAYOUTS[layout]
    tokens, qsl = arrays.pop("tokens", 32), arrays.pop("qsl", 8 + batch_shards(layout))
    q, kc, vc, tables, lens = decode_arrays(**arrays)
    q = jnp.zeros((tokens,) + q.shape[1:], q.dtype)
    fn = sharding.shard_paged_attention(mesh, kv_axis=kv_axis, batch_axis=batch_axis, impl="xla")
    with pytest.raises(ValueError, match=match):
        fn(q, kc, vc, tables, lens, jnp.zeros((qsl,), jnp.int32))


# ------------------------------------------------------------------------------ 4-device process

def _is_slow(value) -> bool:
    return any(mark.name == "slow" for mark in getattr(value, "marks", ()))


def _count_multi_device_tests(slow: bool) -> int:
    """How many test cases carry `needs_devices` and are (``slow``) or are not marked slow, the
    parametrized ones counted per case."""
    marked = [obj for name, obj in globals().items()
              if name.startswith("test_") and needs_devices.mark in getattr(obj, "pytestmark", [])]
    total = 0
    for obj in marked:
        cases = [()]
        for mark in obj.pytestmark:
            if mark.name == "parametrize":
                cases = [c + (v,) for c in cases for v in mark.args[1]]
        total += sum(any(_is_slow(v) for v in c) == slow for c in cases)
    return total


SUBPROCESS_RUNS = {"fast": "not gpu and not slow", "slow": "not gpu and slow"}


@pytest.mark.skipif(IN_CHILD or HAVE_DEVICES,
                    reason="this process has the devices: the multi-device tests ran in place")
@pytest.mark.parametrize("selection", ["fast", pytest.param("slow", marks=pytest.mark.slow)])
def test_multi_device_checks_in_subprocess(selection):
    """Run this file's multi-device tests (the fast set, or the slow ones) in a fresh CPU
    process with 4 virtual devices; every one of them must pass there."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env[CHILD_ENV] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           os.path.abspath(__file__), "-k", "not test_multi_device_checks_in_subprocess and not"
           " test_sharded_functions_take_scales_per_call", "-m", SUBPROCESS_RUNS[selection]]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"the 4-device run failed:\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    expected = _count_multi_device_tests(slow=selection == "slow")
    assert passed and int(passed.group(1)) == expected, f"expected {expected} passed:\n{report}"
    assert "skipped" not in proc.stdout.splitlines()[-1], report


def test_sharded_functions_take_scales_per_call(rng):
    """`shard_write_kv` / `shard_decode` take the fp8 scales per call (replicated operands): one
    compiled program for three layers' scales, the same bits as the single-device functions."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    write = pallas_paged.shard_write_kv(mesh, kv_axis="tp", impl="xla")
    decode = pallas_paged.shard_decode(mesh, kv_axis="tp", impl="xla")
    k_cache, v_cache, k, v, _ = draw_write(rng, num_blocks=6, block_size=4, kvh=2, head_dim=16,
                                           num_tokens=3, num_padding=0, dtype="float8_e4m3fn")
    arrays = dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                  slot_mapping=np.array([1, 7, 12], np.int32))
    q = jnp.asarray(rng.standard_normal((3, 4, 16)).astype(ml_dtypes.bfloat16))
    tables = jnp.array([[0, 1], [2, 3], [4, 5]], jnp.int32)
    lens = jnp.array([2, 8, 5], jnp.int32)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    for k_scale, v_scale in ((0.05, 0.5), (0.1, f32(0.25)), (f32([0.02]), 1.5)):
        x = {name: jnp.asarray(a) for name, a in arrays.items()}
        expected_k, expected_v = pallas_paged.write_kv(**x, k_scale=k_scale, v_scale=v_scale,
                                                       impl="xla")
        per_call = dict(k_scale=jnp.float32(np.reshape(k_scale, ())),  # one shape: one program
                        v_scale=jnp.float32(np.reshape(v_scale, ())))
        k_new, v_new = write(**{name: jnp.asarray(a) for name, a in arrays.items()}, **per_call)
        assert_bitwise_equal(k_new, expected_k, "k_cache")
        assert_bitwise_equal(v_new, expected_v, "v_cache")
        out = decode(q, k_new, v_new, tables, lens, **per_call)
        expected = pallas_paged.decode(q, expected_k, expected_v, tables, lens, k_scale=k_scale,
                                       v_scale=v_scale, impl="xla")
        assert_bitwise_equal(out, expected, "out")
    assert write._cache_size() == 1 and decode._cache_size() == 1

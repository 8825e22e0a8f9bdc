"""The paged cache write, bf16 and fp8 caches, as fractions of the copy bandwidth measured in the
same run.

    python -m benchmarks.write [--json F] [--smoke]

`benchmarks.shapes.WRITE_SHAPE`: 16384 tokens (8 kv heads, head_dim 128) into caches of 16384
blocks of 16 slots, from bf16 rows into a bf16 cache, from bf16 and fp32 rows into float8_e4m3fn
caches, with ``write_kv(impl="pallas")`` and ``impl="xla"``. One timed call is 4 straight-line
writes (each to its own set of random slots, so that no write finds the one before in the L2)
jitted with the caches donated and fed back: updated in place.

Before it is timed, each variant's caches after one call are compared bit for bit with
`torch_ref.write_kv` run by torch on the same inputs (on the GPU where torch sees one, else the
CPU), from rows that mix N(0, 1) values with every fp8 rounding tie times the scale, NaN, +-inf
and +-1e4 (past fp8's 448): a cache that differs is WRONG, not timed, and makes the exit status
1. Figures: ``us``, the steady time of one write (`benchmarks.timing.measure`); ``TB/s``, the
bytes it moves (K and V rows and slots read, cache rows written) over that time; ``of copy``,
that rate over the copy bandwidth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

import torch_ref
from benchmarks import _cli
from benchmarks.shapes import FP8, WRITE_SHAPE, WRITE_SMOKE, write_rows, write_slots
from benchmarks.timing import describe_error, measure
from pallas_paged import write_kv
from parity import convert

# (rows' dtype, cache dtype): what a model writes into its cache
VARIANTS = (("bfloat16", "bfloat16"), ("bfloat16", FP8), ("float32", FP8))
IMPLS = ("pallas", "xla")
K_SCALE, V_SCALE = 0.03, 0.25  # 0.03: division and multiplication by the reciprocal differ
COLUMNS = [("us", "median_us", ".2f"), ("TB/s", "tbps", ".3f"), ("of copy", "of_copy", ".3f")]


def writes(impl: str, reps: int, scales: dict, interpret: bool):
    """A jitted ``f(k_cache, v_cache, k, v, slots)``: ``reps`` straight-line writes of the same
    rows at ``slots[i]`` (i32[reps, tokens]), the caches donated."""

    def run(k_cache, v_cache, k, v, slots):
        for i in range(reps):
            k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots[i], impl=impl,
                                        interpret=interpret if impl == "pallas" else None,
                                        **scales)
        return k_cache, v_cache

    return jax.jit(run, donate_argnums=(0, 1))


def torch_caches(shape, cache_dtype: str, k, v, slots, scales: dict, device: str):
    """The caches `torch_ref.write_kv` leaves after writing ``k``, ``v`` at each slot set, from
    zeros, as numpy (their bits)."""
    zeros = np.zeros(shape.cache_shape, jnp.dtype(cache_dtype))  # [blocks, bs, KVH, D]
    caches = [convert.to_torch(zeros, device), convert.to_torch(zeros, device)]
    k_t, v_t = convert.to_torch(k, device), convert.to_torch(v, device)
    for r in range(shape.reps):
        torch_ref.write_kv(*caches, k_t, v_t, convert.to_torch(slots[r], device), **scales)
    return tuple(convert.from_torch(c) for c in caches)


def bench_variant(shape, row_dtype: str, cache_dtype: str, impl: str, s, interpret: bool,
                  device: str, seed: int) -> dict:
    """One variant: written, compared with torch's caches, then timed."""
    rng = np.random.default_rng(seed)
    k = write_rows(rng, shape.row_shape, jnp.dtype(row_dtype), K_SCALE)  # [T, KVH, D]
    v = write_rows(rng, shape.row_shape, jnp.dtype(row_dtype), V_SCALE)  # [T, KVH, D]
    slots = write_slots(rng, shape)  # i32[reps, T]
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if cache_dtype == FP8 else {}
    cache_item = jnp.dtype(cache_dtype).itemsize
    moved = k.nbytes + v.nbytes + 4 * shape.tokens + 2 * k.size * cache_item
    row = {"shape": shape.name, "impl": impl, "config": f"{row_dtype} -> {cache_dtype}",
           "bytes": moved}
    try:
        want = torch_caches(shape, cache_dtype, k, v, slots, scales, device)
        fn = writes(impl, shape.reps, scales, interpret)
        args = tuple(jax.device_put(x) for x in (k, v, slots))
        state = {"caches": tuple(jnp.zeros(shape.cache_shape, cache_dtype)
                                 for _ in range(2))}
        compiled = fn.lower(*state["caches"], *args).compile()
        state["caches"] = compiled(*state["caches"], *args)
        differ = sum(int((convert.bits(convert.from_jax(g)) != convert.bits(w)).sum())
                     for g, w in zip(state["caches"], want))
        row.update(differing_elements=differ, correct=differ == 0)
        if differ:
            return dict(row, status="WRONG", reason=f"{differ} cache elements differ from torch's")
        del want

        def step():  # each call's caches are the next call's donated input
            state["caches"] = compiled(*state["caches"], *args)
            return state["caches"]

        t = measure(step, shape.reps, s)
        row.update(status="ok", median_us=t.median_us, min_us=t.min_us, max_us=t.max_us,
                   windows_us=t.windows_us, batch_median_us=t.batch_median_us,
                   ops_per_call=shape.reps)
    except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
        row.update(status="error", error=describe_error(e))
    return row


def main(argv=None) -> int:
    p = _cli.parser("benchmarks.write", __doc__, shapes=False)
    args = p.parse_args(argv)
    s, interpret = _cli.settings(args.smoke)
    shape = WRITE_SMOKE if args.smoke else WRITE_SHAPE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = _cli.run_record("benchmarks.write", argv, s, interpret)
    print(f"{doc['device']['kind']}, jax {jax.__version__}, torch {torch.__version__} on"
          f" {device}; {shape.tokens} tokens x {shape.num_kv_heads} kv heads x {shape.head_dim}"
          f" into {shape.num_blocks} blocks of {shape.block_size}, {shape.reps} writes per call",
          flush=True)
    doc["ceilings"] = _cli.ceilings(s, args.smoke)
    doc["rows"] = []
    for seed, (row_dtype, cache_dtype) in enumerate(VARIANTS):
        for impl in IMPLS:
            row = bench_variant(shape, row_dtype, cache_dtype, impl, s, interpret, device, seed)
            if _cli.timed(row):
                row["tbps"] = row["bytes"] / (row["median_us"] * 1e-6) / 1e12
                row["of_copy"] = row["tbps"] / doc["ceilings"]["tbps"]
            doc["rows"].append(row)
            print(_cli.table([row], COLUMNS).splitlines()[-1], flush=True)
            _cli.write_json(args.json, doc)
    print("\n" + _cli.table(doc["rows"], COLUMNS))
    return _cli.exit_status(doc["rows"])


if __name__ == "__main__":
    raise SystemExit(main())

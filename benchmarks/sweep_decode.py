"""A focused sweep of kernel knobs on a few shapes, against the device copy bandwidth.

    python -m benchmarks.sweep_decode [--quick] [--shapes NAMES] [--json PATH] [--no-write]
                                      [--write-only]

Prints one line per (shape, decode config) and per write-kernel variant: median time (the one
timer, `benchmarks.timing.measure`), the bandwidth achieved and its fraction of the copy bandwidth
measured at the start of the same run. Decode outputs are checked against the float64 oracle on
the first sequences (`benchmarks.bench.oracle_rows`); a WRONG config never counts as best, and any
WRONG line makes the exit status 1. The shapes are `benchmarks.shapes`' named shapes. For the full
benchmark with every baseline, and a bounded tuning search, see ``python -m benchmarks.bench
--tune``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged as pp
from benchmarks.bench import REF_ROWS, REL_TOL, compare, oracle_rows
from benchmarks.shapes import make_decode_inputs, shape_by_name
from benchmarks.timing import TimerSettings, jsonable, measure, measure_copy_bandwidth

SHAPES = ("b32_ctx4096", "b1_ctx32768", "b128_ctx1024", "b4_ctx131072", "fp8_b32_ctx4096")
TIMER = TimerSettings(windows=7, window_s=0.01, warmup_s=0.03, min_calls=3, max_calls=200)
WRITE_TOKENS, WRITE_BLOCKS = 16384, 16384


def configs_for(name: str, quick: bool):
    """The decode configs swept for shape ``name``."""
    if name.startswith("fp8"):
        for bk, s, w, st in itertools.product((128, 256), (1, 2), (4, 8), (2, 5)):
            yield pp.DecodeConfig(block_k=bk, num_splits=s, num_warps=w, num_stages=st)
        return
    if name in ("b1_ctx32768", "b4_ctx131072"):
        splits = (16, 32, 64) if name == "b1_ctx32768" else (4, 8, 16)
    else:
        splits = (1, 2, 4)
    block_ks = (32, 64) if quick else (32, 64, 128)
    warps = (4,) if quick else (4, 8)
    # K/V rings of one and two tiles (`pallas_triton.kv_ring_depth`), and 3 stages: one tile,
    # the table load pipelined as well.
    stages = (2, 5) if quick else (2, 3, 5)
    for bk, s, w, st in itertools.product(block_ks, splits, warps, stages):
        yield pp.DecodeConfig(block_k=bk, num_splits=s, num_warps=w, num_stages=st)


def sweep_write(copy_tbps: float, kv_heads=8, dim=128, block_size=16, dtype=jnp.bfloat16):
    """write_kv of 16384 tokens into a 0.5 GiB cache pair, donated: the XLA scatter and Pallas
    kernel variants (elements per program x warps), each checked bit for bit once."""
    from pallas_paged.cache_write.pallas_triton import write_pallas
    from pallas_paged.cache_write.xla import write_xla

    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.choice(WRITE_BLOCKS * block_size, WRITE_TOKENS, replace=False)
                        .astype(np.int32))
    shape = (WRITE_BLOCKS, block_size, kv_heads, dim)
    flat = (WRITE_BLOCKS * block_size, kv_heads * dim)
    new = jax.random.normal(jax.random.key(1), (WRITE_TOKENS, kv_heads, dim)).astype(dtype)
    rows = new.reshape(WRITE_TOKENS, kv_heads * dim)
    written = 2 * new.nbytes
    variants = {"xla": None}
    for elements, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8)):
        variants[f"pallas e{elements} w{warps}"] = dict(elements_per_program=elements,
                                                        num_warps=warps)
    out = []
    for label, knobs in variants.items():
        def step(kc, vc, knobs=knobs):
            kf, vf = kc.reshape(flat), vc.reshape(flat)
            if knobs is None:
                kf, vf = write_xla(kf, vf, rows, rows, slots)
            else:
                kf, vf = write_pallas(kf, vf, rows, rows, slots, interpret=False, **knobs)
            return kf.reshape(shape), vf.reshape(shape)

        row = dict(kind="write", label=label, tokens=WRITE_TOKENS)
        try:
            fn = jax.jit(step, donate_argnums=(0, 1))
            holder = {"caches": fn(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))}
            got = np.asarray(holder["caches"][0].reshape(flat)[slots])
            row["write_ok"] = got.tobytes() == np.asarray(rows).tobytes()

            def call():
                holder["caches"] = fn(*holder["caches"])
                return holder["caches"]

            t = measure(call, 1, TIMER)
            row.update(us=t.median_us, frac_written=written / (t.median_us * 1e-6) / 1e12 / copy_tbps)
            print(f"write_kv {label:20s} {WRITE_TOKENS} tokens: {t.median_us:8.1f} us,"
                  f" written/time {row['frac_written']:.3f} of copy bw, (read+written)/time"
                  f" {2 * row['frac_written']:.3f}{'' if row['write_ok'] else ' WRONG'}",
                  flush=True)
            del holder
        except Exception as exc:  # noqa: BLE001 - keep sweeping
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"write_kv {label} FAILED {row['error']}", flush=True)
        out.append(row)
    return out


def sweep_decode(name: str, quick: bool, copy_tbps: float) -> list[dict]:
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=0)
    args = inputs.args(0)
    kv_bytes = inputs.tokens_read() * shape.kv_bytes_per_token
    scales = dict(k_scale=inputs.k_scale, v_scale=inputs.v_scale)
    rows_checked = min(shape.batch, REF_ROWS)
    reference = oracle_rows(inputs, 0, rows_checked)
    out = []
    for config in [None, *configs_for(name, quick)]:
        row = dict(kind="decode", shape=name, config=None if config is None
                   else dataclasses.asdict(config))
        try:
            fn = jax.jit(lambda *a, c=config: pp.decode(*a, config=c, **scales))
            row.update(compare(fn(*args)[:rows_checked], reference))
            t = measure(lambda: fn(*args), 1, TIMER)
            row.update(us=t.median_us, frac=kv_bytes / (t.median_us * 1e-6) / 1e12 / copy_tbps)
            print(f"{name:16s} {str(config):80s} {t.median_us:9.1f} us  {row['frac']:5.3f}"
                  f"  rel {row['rel_err']:.1e}{'' if row['correct'] else ' WRONG'}", flush=True)
        except Exception as exc:  # noqa: BLE001 - keep sweeping
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"{name:16s} {config} FAILED {row['error']}", flush=True)
        out.append(row)
    for x in (inputs.q, inputs.k_cache, inputs.v_cache):
        x.delete()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_decode",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer decode configs")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma list of benchmarks.shapes names (default {','.join(SHAPES)})")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--no-write", action="store_true", help="skip the write-kernel variants")
    parser.add_argument("--write-only", action="store_true", help="only the write-kernel variants")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    try:
        for name in names:
            shape_by_name(name)
    except ValueError as e:
        parser.error(f"--shapes: {e}")
    copy = measure_copy_bandwidth(4 << 30, TIMER)
    copy_tbps = copy["tbps"]
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {copy_tbps:.3f} TB/s"
          f" ({copy['source']})", flush=True)
    rows = []
    if not args.no_write:
        rows += sweep_write(copy_tbps)
    if not args.write_only:
        for name in names:
            rows += sweep_decode(name, args.quick, copy_tbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jsonable(dict(copy_bandwidth=copy, rel_tol=REL_TOL, rows=rows)), f,
                      indent=1, allow_nan=False)
    best = {}
    for r in rows:
        if r["kind"] == "decode" and r.get("correct") and "frac" in r:
            if r["shape"] not in best or r["frac"] > best[r["shape"]]["frac"]:
                best[r["shape"]] = r
    for r in best.values():
        print(f"BEST {r['shape']:16s} {str(r['config']):80s} {r['us']:9.1f} us {r['frac']:.3f}")
    wrong = [r for r in rows if r.get("correct") is False or r.get("write_ok") is False]
    if wrong:
        print(f"WRONG: {len(wrong)} rows", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

"""A focused sweep of decode kernel configs on a few shapes, against the device copy bandwidth.

    PYTHONPATH=. python benchmarks/sweep_decode.py [--quick]

Prints one line per (shape, config): median time, achieved K/V bandwidth and its fraction of the
copy bandwidth measured at the start of the same run. For the full benchmark with every baseline
see `python -m benchmarks.bench`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_paged as pp


def time_fn(fn, *args, windows=7, calls=20):
    """Median seconds per call over several windows of back-to-back calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def copy_bandwidth(nbytes=4 << 30):
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)  # reads and writes every byte
    seconds = time_fn(copy, x, windows=5, calls=10)
    del x
    return 2 * nbytes / seconds


def decode_inputs(batch, ctx, heads=32, kv_heads=8, dim=128, block_size=16, dtype=jnp.bfloat16,
                  ragged=False, seed=0):
    rng = np.random.default_rng(seed)
    pages = -(-ctx // block_size)
    num_blocks = batch * pages + 8
    tables = rng.permutation(num_blocks)[: batch * pages].reshape(batch, pages).astype(np.int32)
    lens = (rng.integers(1, ctx + 1, batch) if ragged else np.full(batch, ctx)).astype(np.int32)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (num_blocks, block_size, kv_heads, dim)
    spread = 16.0 if dtype == jnp.float8_e4m3fn else 1.0  # fp8 caches hold x / scale, scale 1/16
    k_cache = (jax.random.normal(k1, shape, jnp.float32) * spread).astype(dtype)
    v_cache = (jax.random.normal(k2, shape, jnp.float32) * spread).astype(dtype)
    q = jax.random.normal(k3, (batch, heads, dim), jnp.float32).astype(
        jnp.bfloat16 if dtype == jnp.float8_e4m3fn else dtype)
    kv_bytes = int(lens.sum()) * kv_heads * dim * jnp.dtype(dtype).itemsize * 2
    return (q, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(lens)), kv_bytes


SHAPES = {
    "b32_ctx4096": dict(batch=32, ctx=4096),
    "b1_ctx32768": dict(batch=1, ctx=32768),
    "b128_ctx1024": dict(batch=128, ctx=1024),
    "b4_ctx131072": dict(batch=4, ctx=131072),
    "fp8_b32_ctx4096": dict(batch=32, ctx=4096, dtype=jnp.float8_e4m3fn),
}


def configs_for(name, quick):
    if name.startswith("fp8"):
        for bk, s, w, st in itertools.product((128, 256), (1, 2), (4, 8), (2, 3)):
            yield pp.DecodeConfig(block_k=bk, num_splits=s, num_warps=w, num_stages=st)
        return
    if name == "b1_ctx32768" or name == "b4_ctx131072":
        splits = (16, 32, 64) if name == "b1_ctx32768" else (4, 8, 16)
    else:
        splits = (1, 2, 4)
    block_ks = (32, 64) if quick else (32, 64, 128)
    warps = (4,) if quick else (4, 8)
    stages = (2, 3) if quick else (2, 3, 4)
    for bk, s, w, st in itertools.product(block_ks, splits, warps, stages):
        yield pp.DecodeConfig(block_k=bk, num_splits=s, num_warps=w, num_stages=st)


def sweep_write(bw, num_tokens=16384, kv_heads=8, dim=128, block_size=16, dtype=jnp.bfloat16):
    """write_kv of num_tokens tokens into a 0.5 GiB cache pair, donated: XLA and Pallas variants."""
    from pallas_paged.cache_write.pallas_triton import write_pallas

    num_blocks = 16384
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.choice(num_blocks * block_size, num_tokens, replace=False)
                        .astype(np.int32))
    shape = (num_blocks, block_size, kv_heads, dim)
    new = jax.random.normal(jax.random.key(1), (num_tokens, kv_heads, dim), jnp.float32).astype(dtype)
    rows = new.reshape(num_tokens, kv_heads * dim)
    written = 2 * new.nbytes
    variants = {"xla": None}
    for elements, warps in itertools.product((2048, 4096, 8192, 16384), (4, 8)):
        variants[f"pallas e{elements} w{warps}"] = dict(elements_per_program=elements, num_warps=warps)
    for label, knobs in variants.items():
        def step(kc, vc, knobs=knobs):
            flat = (num_blocks * block_size, kv_heads * dim)
            kf, vf = kc.reshape(flat), vc.reshape(flat)
            if knobs is None:
                kf, vf = write_module._write_xla(kf, vf, rows, rows, slots)
            else:
                kf, vf = write_pallas(kf, vf, rows, rows, slots, interpret=False,
                                                    **knobs)
            return kf.reshape(shape), vf.reshape(shape)
        try:
            fn = jax.jit(step, donate_argnums=(0, 1))
            caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(3):
                caches = fn(*caches)
            jax.block_until_ready(caches)
            samples = []
            for _ in range(7):
                start_t = time.perf_counter()
                for _ in range(20):
                    caches = fn(*caches)
                jax.block_until_ready(caches)
                samples.append((time.perf_counter() - start_t) / 20)
            seconds = statistics.median(samples)
            print(f"write_kv {label:20s} {num_tokens} tokens: {seconds * 1e6:8.1f} us, written/time"
                  f" {written / seconds / bw:.3f} of copy bw, (read+written)/time"
                  f" {2 * written / seconds / bw:.3f}", flush=True)
            del caches
        except Exception as exc:
            print(f"write_kv {label} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--write-only", action="store_true")
    args = parser.parse_args(argv)
    bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    if not args.no_write:
        sweep_write(bw)
    if args.write_only:
        return 0
    rows = []
    for name in args.shapes.split(","):
        inputs, kv_bytes = decode_inputs(**SHAPES[name])
        scales = dict(k_scale=1 / 16, v_scale=1 / 16) if name.startswith("fp8") else {}
        reference = np.asarray(pp.decode(*inputs, impl="xla", **scales).astype(jnp.float32)) \
            if kv_bytes < 8e9 else None
        candidates = [None, *configs_for(name, args.quick)]
        for config in candidates:
            try:
                scales = dict(k_scale=1 / 16, v_scale=1 / 16) if name.startswith("fp8") else {}
                fn = jax.jit(lambda *a, c=config, kw=scales: pp.decode(*a, config=c, **kw))
                out = np.asarray(fn(*inputs).astype(jnp.float32))
                err = float(np.abs(out - reference).max()) if reference is not None else float("nan")
                seconds = time_fn(fn, *inputs)
                frac = kv_bytes / seconds / bw
                rows.append(dict(shape=name, config=str(config), us=seconds * 1e6, frac=frac, err=err))
                print(f"{name:14s} {str(config):80s} {seconds * 1e6:9.1f} us  {frac:5.3f}  err {err:.2e}",
                      flush=True)
            except Exception as exc:  # keep sweeping
                print(f"{name:14s} {config} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del inputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_bandwidth=bw, rows=rows), f, indent=1)
    best = {}
    for r in rows:
        if r["shape"] not in best or r["frac"] > best[r["shape"]]["frac"]:
            best[r["shape"]] = r
    for r in best.values():
        print(f"BEST {r['shape']:14s} {r['config']:80s} {r['us']:9.1f} us {r['frac']:.3f}")


if __name__ == "__main__":
    sys.exit(main())

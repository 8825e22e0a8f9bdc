"""The fp8 cache write on a GPU: bit-exact against `torch_ref.write_kv`, and its speed.

Run ``python -m benchmarks.check_write_fp8_gpu [--smoke]``. It writes 16384 tokens (8 kv heads,
head_dim 128) into float8_e4m3fn caches of 16384 blocks of 16 slots, at a random permutation of the
slots, from bf16 and from fp32 rows, with ``impl="pallas"`` and ``impl="xla"``:

- correctness: after one call, the whole caches bit for bit against `torch_ref.write_kv` run by
  torch on the same device, from rows that mix N(0, 1) values with exact rounding ties of
  ``x / scale`` (the midpoints of neighbouring fp8 values, times the scale), NaN, +-inf and values
  past +-448;
- speed: `benchmarks.timing.measure` of one jitted call of ``REPS`` writes (straight-line, over
  ``REPS`` disjoint slot sets, so that no write finds the previous one's rows in L2), the caches
  donated and fed back as `benchmarks.bench` times writes; printed as the time of one write and as
  (bytes read + written) / time, a fraction of the copy bandwidth measured in the same run.

Exit status 1 when a cache differs from torch's or a variant fails, else 0. ``--smoke`` runs tiny
shapes (Pallas interpret mode and torch on the CPU when there is no GPU) with minimal timing: it
checks the plumbing, not the speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import parity  # noqa: F401  (before JAX starts: JAX and torch share the GPU)

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_ref  # noqa: E402
from benchmarks.timing import (TimerSettings, copy_summary, describe_error, measure,  # noqa: E402
                               measure_copy_bandwidth)
from pallas_paged import write_kv  # noqa: E402
from pallas_paged._platform import quiet_triton_deprecation  # noqa: E402
from parity import convert  # noqa: E402

REPS = 4                           # writes per timed call, each to its own slot set
K_SCALE, V_SCALE = 0.03, 0.25      # 0.03: division and reciprocal differ; 0.25: exact ties


@dataclasses.dataclass(frozen=True)
class Problem:
    tokens: int = 16384
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 16384
    copy_bytes: int = 4 * 2**30


SMOKE = Problem(tokens=64, num_kv_heads=2, head_dim=32, block_size=4, num_blocks=128,
                copy_bytes=16 * 2**20)
SMOKE_TIMER = TimerSettings(windows=2, window_s=0.0, warmup_s=0.0, min_calls=1, max_calls=1)


def make_rows(rng, shape, dtype, scale: float) -> np.ndarray:
    """N(0, 1) rows of ``dtype``, a quarter of them replaced by ``tie * scale`` for every rounding
    tie of float8_e4m3fn (both signs) and by NaN, +-inf and +-1e4."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.unique(codes[np.isfinite(codes)])
    ties = (finite[1:] + finite[:-1]) / 2 * np.float64(np.float32(scale))
    pool = np.concatenate([ties, [np.nan, np.inf, -np.inf, 1e4, -1e4]]).astype(np.float32)
    rows = rng.standard_normal(shape, dtype=np.float32)
    chosen = rng.random(shape) < 0.25
    rows[chosen] = rng.choice(pool, int(chosen.sum()))
    return rows.astype(dtype)


def write_fn(impl: str, interpret: bool | None):
    """``REPS`` writes of the same rows at ``slots[i]``, jitted with the caches donated."""

    def run(k_cache, v_cache, k, v, slots, scales):
        # straight-line writes: a fori_loop would add a host round trip per write
        for i in range(REPS):
            k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slots[i], k_scale=scales[0],
                                        v_scale=scales[1], impl=impl,
                                        interpret=interpret if impl == "pallas" else None)
        return k_cache, v_cache

    return jax.jit(run, donate_argnums=(0, 1))


def check_one(p: Problem, row_dtype, impl: str, device: str, timer, copy_tbps: float,
              interpret: bool | None, seed: int) -> bool:
    """Write, compare with torch bit for bit, time; print one line; True when bit-exact."""
    rng = np.random.default_rng(seed)
    cache_shape = (p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim)
    row_shape = (p.tokens, p.num_kv_heads, p.head_dim)
    k = make_rows(rng, row_shape, row_dtype, K_SCALE)
    v = make_rows(rng, row_shape, row_dtype, V_SCALE)
    num_slots = p.num_blocks * p.block_size
    slots = rng.permutation(num_slots)[:REPS * p.tokens].reshape(REPS, p.tokens).astype(np.int32)
    label = f"{np.dtype(row_dtype).name:>8} -> fp8  {impl:<6}"

    kc_t = torch.zeros(cache_shape, dtype=torch.float8_e4m3fn, device=device)
    vc_t = torch.zeros(cache_shape, dtype=torch.float8_e4m3fn, device=device)
    k_t, v_t = convert.to_torch(k, device), convert.to_torch(v, device)
    for r in range(REPS):
        torch_ref.write_kv(kc_t, vc_t, k_t, v_t, convert.to_torch(slots[r], device),
                           k_scale=K_SCALE, v_scale=V_SCALE)
    want = (convert.from_torch(kc_t), convert.from_torch(vc_t))
    del kc_t, vc_t, k_t, v_t

    try:
        args = tuple(convert.to_jax(x, device) for x in (k, v, slots))
        scales = convert.to_jax(np.array([K_SCALE, V_SCALE], np.float32), device)
        zeros = np.zeros(cache_shape, ml_dtypes.float8_e4m3fn)
        caches = (convert.to_jax(zeros, device), convert.to_jax(zeros, device))
        with quiet_triton_deprecation():
            compiled = write_fn(impl, interpret).lower(*caches, *args, scales).compile()
        holder = {"caches": compiled(*caches, *args, scales)}
        got = tuple(convert.from_jax(c) for c in holder["caches"])
        differ = sum(int((convert.bits(g) != convert.bits(w)).sum()) for g, w in zip(got, want))
        del got

        def step():
            holder["caches"] = compiled(*holder["caches"], *args, scales)
            return holder["caches"]

        t = measure(step, REPS, timer)
    except Exception as e:  # noqa: BLE001 - reported, the other variants still run
        print(f"{label}  ERROR {describe_error(e)}", flush=True)
        return False
    read = 2 * k.nbytes + 4 * p.tokens
    written = 2 * k.size  # one byte per fp8 element, k and v
    tbps = (read + written) / (t.median_us * 1e-6) / 1e12
    verdict = "bit-exact" if differ == 0 else f"WRONG ({differ} bytes differ)"
    print(f"{label}  {verdict:<24} {t.median_us:9.2f} us/write  {tbps:6.3f} TB/s"
          f" = {tbps / copy_tbps:5.3f} of copy bandwidth", flush=True)
    return differ == 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, minimal timing (interpret mode without a GPU)")
    args = parser.parse_args(argv)
    p, timer = (SMOKE, SMOKE_TIMER) if args.smoke else (Problem(), TimerSettings())
    device = convert.default_device()
    if device != "cuda" and not args.smoke:
        parser.error("needs a GPU visible to torch and JAX (or --smoke)")
    interpret = True if device == "cpu" else None
    copy = measure_copy_bandwidth(p.copy_bytes, timer)
    print(f"{jax.devices()[0].device_kind} (jax {jax.__version__}, torch {torch.__version__}):"
          f" copy bandwidth {copy_summary(copy)}; {p.tokens} tokens,"
          f" {p.num_kv_heads} kv heads x {p.head_dim}, {p.num_blocks} blocks of {p.block_size},"
          f" {REPS} writes per call", flush=True)
    ok = True
    for seed, row_dtype in enumerate((ml_dtypes.bfloat16, np.float32)):
        for impl in ("pallas", "xla"):
            ok &= check_one(p, row_dtype, impl, device, timer, copy["tbps"], interpret, seed)
    print("all bit-exact" if ok else "MISMATCH or error: see above", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

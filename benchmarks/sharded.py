"""Multi-GPU scaling of paged decode: `shard_decode` on 2 GPUs against `decode` on one.

    python -m benchmarks.sharded [--json PATH] [--impl pallas|xla] [--rounds N] [--smoke]

The problem (`benchmarks.shapes.SHARDED`): batch 64, context 4096, 32 query heads on 8 kv heads,
head_dim 128, bf16, block_size 16, every sequence at full length, blocks shuffled
(`parity.layout.paged_layout`). Variants:

- ``1gpu``: `decode` on one device, the baseline of every ratio below.
- strong scaling, the same global problem on 2 devices: ``tp2`` (kv heads split, 4 per device)
  and ``dp2`` (batch split, 32 sequences and their blocks per device, local block ids).
- weak scaling, the same per-device problem: ``dp2-weak`` (batch 128 over 2 devices) and
  ``tp2-weak`` (64 heads on 16 kv heads over 2 devices).

Reported per variant: the median step time (`benchmarks.timing.measure`: windows of back-to-back
calls after a warm-up, so the host's dispatch overlaps the device work as in a serving loop;
``--rounds``: the windows), the speedup over ``1gpu``
(strong: ``t1 / tn``; weak: ``n * t1 / tn``, the work done per unit time), the efficiency
(speedup / devices), the KV bandwidth achieved and its fraction of the devices' copy bandwidth
measured in the same run (`benchmarks.timing.measure_copy_bandwidth`: over 4 GiB on each device at
once; on one GPU also torch's device-to-device copy; the largest rate of the ways whose timed
windows agree counts), and the largest
difference from a single-device `decode` of the same global problem (a correctness check, outside
the timing). Each variant's failure is recorded and the others still run.

``--smoke`` runs tiny shapes on 2 virtual CPU devices (Pallas in interpret mode) to prove the
script works end to end; its times mean nothing.

NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are
set below before this module imports JAX (JAX reads the environment when it creates its backends,
at the first device query, and NCCL when it creates a communicator; ``_configure_platform``
checks that no backend exists yet). The sharded programs hold no collective, so NCCL has no work
here.
"""

from __future__ import annotations

import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.shapes import SHARDED, SHARDED_SMOKE, ShardedProblem  # noqa: E402
from benchmarks.timing import TimerSettings, jsonable, measure  # noqa: E402
from benchmarks.timing import measure_copy_bandwidth  # noqa: E402

DEVICES = 2


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    scaling: str                # "baseline", "strong" or "weak"
    devices: int
    problem: ShardedProblem     # the global problem
    kv_axis: str | None = None
    batch_axis: str | None = None


def variants(base: ShardedProblem) -> list[Variant]:
    n = DEVICES
    wider = dataclasses.replace(base, num_heads=n * base.num_heads,
                                num_kv_heads=n * base.num_kv_heads)
    return [
        Variant("1gpu", "baseline", 1, base),
        Variant("tp2", "strong", n, base, kv_axis="tp"),
        Variant("dp2", "strong", n, base, batch_axis="dp"),
        Variant("dp2-weak", "weak", n, dataclasses.replace(base, batch=n * base.batch),
                batch_axis="dp"),
        Variant("tp2-weak", "weak", n, wider, kv_axis="tp"),
    ]


# ------------------------------------------------------------------------------------------ setup

def _configure_platform(smoke: bool) -> None:
    """In smoke mode: the CPU backend with 2 virtual devices (before any backend exists)."""
    if not smoke:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("--smoke must configure the CPU devices before JAX creates its backends")
    jax.config.update("jax_platforms", "cpu")
    if hasattr(jax.config, "jax_num_cpu_devices"):
        jax.config.update("jax_num_cpu_devices", DEVICES)
    else:  # pragma: no cover - older JAX
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = \
            f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()


def _random(key, shape, dtype, sharding):
    """A normal array made directly in place on its devices (no host round trip)."""
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                   out_shardings=sharding)
    return make(key)


def build_inputs(v: Variant, devices, seed: int = 0):
    """Global arrays for variant ``v`` placed as `shard_decode` wants them.

    Each batch shard's sequences are laid out in a pool of their own blocks
    (`ShardedProblem.pool_tables`); tables hold ids local to the pool (with no ``batch_axis``
    there is one pool and local = global). Also returns the global tables for the
    single-device check.
    """
    from pallas_paged.sharding import decode_shardings

    p = v.problem
    dtype = jnp.dtype(p.dtype)
    if v.devices == 1:
        one = jax.sharding.NamedSharding(Mesh(np.array(devices[:1]), ("x",)),
                                         jax.sharding.PartitionSpec())
        shardings = dict.fromkeys(("q", "k_cache", "v_cache", "block_tables", "context_lens"), one)
        mesh = None
    else:
        axis = v.kv_axis or v.batch_axis
        mesh = Mesh(np.array(devices[:v.devices]), (axis,))
        shardings = decode_shardings(mesh, kv_axis=v.kv_axis, batch_axis=v.batch_axis)
    pools = v.devices if v.batch_axis else 1
    rows_per_pool = p.batch // pools
    blocks_per_pool = rows_per_pool * p.blocks_per_seq
    local = p.pool_tables(np.random.default_rng(seed), pools)  # i32[batch, blocks_per_seq]
    offsets = (np.arange(p.batch) // rows_per_pool * blocks_per_pool)[:, None]
    global_tables = (local + offsets).astype(np.int32)
    lens = np.full((p.batch,), p.context, np.int32)
    keys = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (pools * blocks_per_pool, p.block_size, p.num_kv_heads, p.head_dim)
    args = (
        _random(keys[0], (p.batch, p.num_heads, p.head_dim), dtype, shardings["q"]),
        _random(keys[1], cache_shape, dtype, shardings["k_cache"]),
        _random(keys[2], cache_shape, dtype, shardings["v_cache"]),
        jax.device_put(local, shardings["block_tables"]),
        jax.device_put(lens, shardings["context_lens"]),
    )
    return mesh, args, global_tables


def kernel_config(v: Variant, impl: str):
    """The config each device's kernel picks for its local shape (None for the XLA path)."""
    if impl != "pallas":
        return None
    from pallas_paged import DecodeShape
    from pallas_paged._platform import device_kind, sm_count
    from pallas_paged.decode_attention import pallas_triton_config

    p = v.problem
    local_batch = p.batch // (v.devices if v.batch_axis else 1)
    local_kvh = p.num_kv_heads // (v.devices if v.kv_axis else 1)
    shape = DecodeShape(batch=local_batch, num_kv_heads=local_kvh,
                        group=p.num_heads // p.num_kv_heads, head_dim=p.head_dim,
                        block_size=p.block_size, capacity=p.blocks_per_seq * p.block_size,
                        cache_dtype=p.dtype)
    return pallas_triton_config.lookup(shape, device_kind(), sm_count())


# ------------------------------------------------------------------------------------------- runs

def run_variant(v: Variant, impl: str, timing: TimerSettings, devices, copy_bw: dict,
                baseline: dict | None):
    import pallas_paged
    from pallas_paged.sharding import shard_decode

    row = dict(name=v.name, scaling=v.scaling, devices=v.devices, kv_axis=v.kv_axis,
               batch_axis=v.batch_axis, problem=dataclasses.asdict(v.problem), impl=impl)
    if len(devices) < v.devices:
        row["status"] = f"skipped: needs {v.devices} devices, have {len(devices)}"
        return row
    try:
        config = kernel_config(v, impl)
        row["config"] = None if config is None else dataclasses.asdict(config)
        mesh, args, global_tables = build_inputs(v, devices)
        if mesh is None:
            fn = jax.jit(lambda *a: pallas_paged.decode(*a, impl=impl))
        else:
            fn = shard_decode(mesh, kv_axis=v.kv_axis, batch_axis=v.batch_axis, impl=impl)
        jax.block_until_ready(fn(*args))  # compiled outside the clock
        t = measure(lambda: fn(*args), 1, timing)
        row.update(median_s=t.median_us * 1e-6, min_s=t.min_us * 1e-6, max_s=t.max_us * 1e-6)
        bandwidth = v.problem.kv_bytes / row["median_s"]
        row["kv_GBps"] = bandwidth / 1e9
        row["frac_of_copy_bw"] = bandwidth / copy_bw[v.devices]
        if v.scaling == "baseline":
            row["speedup"] = row["efficiency"] = 1.0
        elif baseline is not None and "median_s" in baseline:
            ratio = baseline["median_s"] / row["median_s"]
            row["speedup"] = ratio * (v.devices if v.scaling == "weak" else 1)
            row["efficiency"] = row["speedup"] / v.devices
        row["max_abs_diff_vs_1gpu"] = check(fn, args, global_tables, devices[0], impl)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one variant's failure must not stop the others
        row["status"] = f"failed: {type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    return row


def check(fn, args, global_tables, device, impl: str) -> float:
    """max |sharded - single-device decode| on the same global problem (global block ids)."""
    import pallas_paged

    out = np.asarray(fn(*args), np.float32)
    q, kc, vc, _, lens = (jax.device_put(a, device) for a in args)
    ref = pallas_paged.decode(q, kc, vc, jax.device_put(global_tables, device), lens, impl=impl)
    return float(np.max(np.abs(out - np.asarray(ref, np.float32))))


def _fmt(x, spec: str) -> str:
    """``format(x, spec)``, or a dash as wide as the spec's width when there is no value."""
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def print_table(report: dict) -> None:
    print(f"device: {report['device']}  x{report['num_devices']}   jax {report['jax']}"
          f"   impl={report['impl']}")
    bw = report["copy_GBps"]
    print("copy bandwidth (all devices at once): "
          + ", ".join(f"{k} dev {v:.0f} GB/s" for k, v in bw.items()))
    header = (f"{'variant':<10} {'scaling':<8} {'dev':>3} {'B':>4} {'H':>3} {'KVH':>3} {'ms':>8}"
              f" {'speedup':>7} {'eff':>5} {'KV GB/s':>8} {'%copy':>6} {'max|diff|':>9}  status")
    print(header)
    print("-" * len(header))
    for r in report["variants"]:
        p = r["problem"]
        ms = r.get("median_s")
        print(f"{r['name']:<10} {r['scaling']:<8} {r['devices']:>3} {p['batch']:>4}"
              f" {p['num_heads']:>3} {p['num_kv_heads']:>3} {_fmt(ms and ms * 1e3, '8.3f')}"
              f" {_fmt(r.get('speedup'), '7.2f')}"
              f" {_fmt(r.get('efficiency'), '5.2f')} {_fmt(r.get('kv_GBps'), '8.0f')}"
              f" {_fmt(r.get('frac_of_copy_bw') and 100 * r['frac_of_copy_bw'], '6.1f')}"
              f" {_fmt(r.get('max_abs_diff_vs_1gpu'), '9.2g')}  {r['status'][:60]}")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--impl", choices=("pallas", "xla"), default="pallas")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on 2 virtual CPU devices (interpret mode); times mean"
                             " nothing")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="timed windows per variant")
    args = parser.parse_args(argv)
    _configure_platform(args.smoke)

    if args.smoke:
        base = SHARDED_SMOKE
        timing = TimerSettings(windows=2, window_s=0.0, warmup_s=0.0, min_calls=2, max_calls=2)
        copy_bytes = 1 << 20
    else:
        base = SHARDED
        timing = TimerSettings(windows=20, window_s=0.0, warmup_s=0.02, min_calls=10, max_calls=10)
        copy_bytes = 4 << 30
    if args.rounds:
        timing = dataclasses.replace(timing, windows=args.rounds)
    devices = jax.devices()
    report = dict(device=devices[0].device_kind, num_devices=len(devices), jax=jax.__version__,
                  impl=args.impl, smoke=args.smoke, timing=dataclasses.asdict(timing),
                  env={k: os.environ.get(k)
                       for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
                  copy_GBps={}, variants=[])
    copy_bw = {}
    for n in sorted({1, min(DEVICES, len(devices))}):
        measured = measure_copy_bandwidth(copy_bytes, timing, devices[:n])
        report.setdefault("copy_bandwidth", {})[n] = measured
        copy_bw[n] = measured["tbps"] * 1e12
        report["copy_GBps"][n] = copy_bw[n] / 1e9
    baseline = None
    for v in variants(base):
        row = run_variant(v, args.impl, timing, devices, copy_bw, baseline)
        if v.scaling == "baseline":
            baseline = row
        report["variants"].append(row)
    print_table(report)
    for r in report["variants"]:
        if "traceback" in r:
            print(f"\n{r['name']}:\n{r['traceback']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jsonable(report), f, indent=2, allow_nan=False)
        print(f"wrote {args.json}")
    failed = [r["name"] for r in report["variants"] if r["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The Mosaic GPU decode kernel beside the Triton one, as fractions of the same run's copy bandwidth.

Run ``python -m benchmarks.bench_mosaic [--shapes a,b,...] [--configs] [--config LABEL ...]
[--json PATH] [--smoke]``.
For each shape (default: `SHAPES`; bf16 unless named fp8, H=32, KVH=8, D=128, bs=16, random block
permutations from `benchmarks.shapes`), in one process:

1. ``impl="xla"`` once, the reference; ``impl="mosaic"`` and ``impl="pallas"`` (each with the config
   ``decode`` picks itself) are checked against it first (`benchmarks.bench.compare`); a wrong or
   failing variant is reported as such and never timed.
2. Each correct variant is timed with `benchmarks.bench.measure` (median of windows of
   back-to-back calls). Problems that fit a few times in L2 rotate among copies of their inputs,
   in straight-line calls of one jitted program (`benchmarks.bench`'s loop mode: at B=1 one call
   per dispatch would time the host's dispatch, ~55 us, instead of the kernels).
3. The figure of merit is bytes that must be read (K/V rows + q + output) over the time, as a
   fraction of the device-to-device copy bandwidth measured at the start of the same run
   (`benchmarks.bench.measure_copy_bandwidth`).

``--configs`` also times a few `MosaicDecodeConfig` candidates per shape (the queries in N, splits
and stages around the heuristic), to fill `configs.MOSAIC_TUNED`; ``--config bk64/st4/c1/qn1``
(repeatable; any of block_k, splits, stages, consumers, queries_in_n, as the rows print them) also
times, on every shape, the heuristic's config with the named fields replaced. ``--probe-producer``
also times each Mosaic config's producer alone (`decode_mosaic`'s ``producer_only`` probe: not
attention, never compared); ``--compiler-param approx_math=1`` (repeatable) also times the
heuristic's config compiled with those Mosaic GPU compiler parameters in place of
`mosaic_gpu.COMPILER_PARAMS`. Every variant is isolated: an error is printed in its row and the run
goes on. ``--smoke`` runs tiny shapes with minimal repetitions (plumbing only): in interpret mode
without a GPU, compiled on one, as `benchmarks.bench --smoke` does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import sys

import jax
import numpy as np

from benchmarks.bench import (Settings, _error, compare, measure, measure_copy_bandwidth,
                              loop_args, loop_reps, parse_config_label, repeated,
                              smoke_settings)
from benchmarks.shapes import DecodeBenchShape, make_decode_inputs, rotation_copies, shape_by_name
from benchmarks.timing import kernel_variant
from pallas_paged._platform import has_gpu, sm_count
from pallas_paged.decode_attention import configs, mosaic_gpu
from pallas_paged.decode_attention.api import decode
from pallas_paged.decode_attention.configs import MosaicDecodeConfig
from pallas_paged.decode_attention.mosaic_gpu import MAX_SMEM_BYTES, decode_mosaic, smem_bytes

SHAPES = ("b1_ctx32768", "b32_ctx4096", "b128_ctx1024", "mha_b32_ctx4096", "fp8_b32_ctx4096")
# The smoke run's shapes: tiny, with a head_dim the Mosaic kernel takes (the shared SMALL_SHAPES
# have head_dim 32).
SMOKE_SHAPES = (DecodeBenchShape("smoke_d64_b2_ctx128", 2, 8, 2, 64, 16, 128),
                DecodeBenchShape("smoke_fp8_d64_b2_ctx128", 2, 8, 2, 64, 16, 128,
                                 dtype="float8_e4m3fn"))
L2_BYTES = 60e6
# The timing probe of `decode_mosaic(..., producer_only=True)`: the Mosaic kernel's producer
# streaming every tile, consumers that only wait and free (its output is not attention: timed,
# never compared).
PRODUCER_PROBE = "mosaic-producer-only"
# The heuristic's Mosaic config compiled with other Mosaic GPU compiler parameters
# (``--compiler-param``, `mosaic_gpu.COMPILER_PARAMS` replaced while it traces).
COMPILER_VARIANT = "mosaic-params"


def _call(impl, inputs, config, interpret):
    shape = inputs.shape
    if impl == PRODUCER_PROBE:
        return jax.jit(lambda q, k, v, t, n: decode_mosaic(
            q, k, v, t, n, scale=shape.head_dim ** -0.5, config=config,
            interpret=bool(interpret), logits_soft_cap=None, alibi_slopes=None,
            sliding_window=shape.sliding_window, sinks=None, k_scale=inputs.k_scale,
            v_scale=inputs.v_scale, producer_only=True)[0])
    impl = "mosaic" if impl == COMPILER_VARIANT else impl  # the params come from the module
    fn = jax.jit(lambda q, k, v, t, n: decode(
        q, k, v, t, n, impl=impl, config=config, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
        sliding_window=shape.sliding_window, interpret=interpret))
    return fn


def candidates(shape, heuristic: MosaicDecodeConfig) -> list[MosaicDecodeConfig]:
    """Configs around the heuristic that fit in shared memory, the most telling first (a run may
    stop early): the queries in wgmma's N (`MosaicDecodeConfig.queries_in_n`: its smaller q, P
    and partial results leave room for more stages), then in M; consumers 2, 1; splits x0.5, x1,
    x2; stages 2, 3, 4, 6; block_k 64, 128."""
    out = []
    for queries_in_n, consumers, factor, stages, block_k in itertools.product(
            (True, False), (2, 1), (0.5, 1, 2), (2, 3, 4, 6), (64, 128)):
        splits = max(1, int(heuristic.num_splits * factor))
        if stages % consumers or (queries_in_n and consumers > 1):  # refused by the config
            continue
        config = MosaicDecodeConfig(block_k=block_k, num_splits=splits, num_stages=stages,
                                    num_consumers=consumers, queries_in_n=queries_in_n)
        fits = smem_bytes(shape.head_dim, shape.dtype, shape.query_dtype, config,
                          group=shape.group) <= MAX_SMEM_BYTES
        if fits and config not in out and config != heuristic:
            out.append(config)
    return out


def parse_config(label: str) -> dict:
    """``"bk64/st4/c2"`` (parts of `benchmarks.bench.config_label`'s form, any subset; ``qn1``
    for `MosaicDecodeConfig.queries_in_n`, ``kr1`` for its ``fp8_k_in_registers``, ``vp1`` for its
    ``fp8_v_in_producer``, ``ps1`` for its ``persistent``) -> the `MosaicDecodeConfig` fields it
    names, ``{"block_k": 64, "num_stages": 4, ...}``."""
    return parse_config_label(label, {"bk": "block_k", "s": "num_splits", "st": "num_stages",
                                      "c": "num_consumers", "qn": "queries_in_n",
                                      "kr": "fp8_k_in_registers", "vp": "fp8_v_in_producer",
                                      "ps": "persistent"},
                              flags=("queries_in_n", "fp8_k_in_registers", "fp8_v_in_producer",
                                     "persistent"))


def parse_compiler_param(text: str) -> tuple[str, bool | int]:
    """``"approx_math=1"`` -> ``("approx_math", True)``; integers other than 0 / 1 stay ints."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value.lstrip("-").isdigit():
        raise ValueError(f"--compiler-param {text!r}: expected NAME=INT, e.g. approx_math=1")
    number = int(value)
    return name, bool(number) if number in (0, 1) else number


def bench_shape(shape: DecodeBenchShape, s: Settings, copy_tbps: float, tune: bool,
                overrides: tuple = (), probe: bool = False,
                compiler_params: tuple = ()) -> list[dict]:
    name = shape.name
    copies = 1 if s.interpret else rotation_copies(shape, min_bytes=4 * L2_BYTES, max_copies=4)
    inputs = make_decode_inputs(shape, s.seed, copies=copies)
    tokens = inputs.tokens_read()
    q_bytes = int(np.prod(inputs.q.shape[1:])) * inputs.q.dtype.itemsize
    nbytes = tokens * shape.kv_bytes_per_token + 2 * q_bytes  # K/V rows, q and the output
    interpret = True if s.interpret else None
    rows = []
    try:
        ref = _call("xla", inputs, None, interpret)(*inputs.args(0))
    except Exception as e:  # noqa: BLE001
        return [{"shape": name, "impl": "xla", "error": _error(e)}]
    variants = [("mosaic", configs.lookup_mosaic(pp_shape(shape), jax.devices()[0].device_kind,
                                                 sm_count())),
                ("pallas", None)]
    if tune:
        variants += [("mosaic", c) for c in candidates(shape, variants[0][1])]
    for fields in overrides:  # the heuristic's config with these fields replaced
        try:
            variant = dataclasses.replace(variants[0][1], **fields)
        except ValueError as e:  # e.g. an odd stage count for two consumers: a row, not a crash
            rows.append({"shape": name, "impl": "mosaic", "config": str(fields), "error": str(e)})
            print(_format_row(rows[-1]), flush=True)
            continue
        if variant not in (c for _, c in variants):
            variants.append(("mosaic", variant))
    if probe:  # every Mosaic config above, its producer alone
        variants += [(PRODUCER_PROBE, c) for impl, c in list(variants) if impl == "mosaic"]
    params = {**mosaic_gpu.COMPILER_PARAMS, **dict(compiler_params)}
    if compiler_params:  # the heuristic's config, compiled with these Mosaic GPU parameters
        variants.append((COMPILER_VARIANT, variants[0][1]))
    for impl, config in variants:
        row = {"shape": name, "impl": impl, "config": str(config) if config else "default",
               "class": configs.shape_class(pp_shape(shape))}
        if impl == COMPILER_VARIANT:
            row["compiler_params"] = params
        context = (kernel_variant({(mosaic_gpu, "COMPILER_PARAMS"): params})
                   if impl == COMPILER_VARIANT else contextlib.nullcontext())
        try:
            with context:
                row.update(_run(impl, inputs, config, interpret, ref, copies, nbytes, copy_tbps, s))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = _error(e)
        rows.append(row)
        print(_format_row(row), flush=True)
    return rows


def _run(impl, inputs, config, interpret, ref, copies, nbytes, copy_tbps, s) -> dict:
    """Check (except the producer probe) and time one variant: the row's measured fields.

    `benchmarks.bench`'s loop mode: ``reps`` straight-line calls over the copies (one or several)
    in one jitted program (`benchmarks.bench.repeated`), each call on its own query array."""
    fn = _call(impl, inputs, config, interpret)
    row = {"correct": None} if impl == PRODUCER_PROBE else compare(fn(*inputs.args(0)), ref)
    if row["correct"] is False:
        return row
    reps = loop_reps(copies, s.loop_ops)
    calls = repeated(fn, reps)
    args = loop_args(inputs, copies, reps)
    jax.block_until_ready(calls(*args))  # compiled outside the clock
    timing = measure(lambda: calls(*args), reps, s)
    row.update(mode="loop", reps_per_call=reps)
    row["us"] = timing.median_us
    row["tbps"] = nbytes / (timing.median_us * 1e-6) / 1e12
    row["of_copy"] = row["tbps"] / copy_tbps
    return row


def tuned_snippet(rows: list[dict]) -> str:
    """``shape class: config`` lines for `configs.MOSAIC_TUNED`, one per shape whose fastest
    correct Mosaic config is not the default one."""
    lines = []
    for name in dict.fromkeys(row["shape"] for row in rows):
        timed = [r for r in rows if r["shape"] == name and r["impl"] == "mosaic" and "us" in r]
        if not timed:
            continue
        default, best = timed[0], min(timed, key=lambda r: r["us"])
        if best is default:
            continue
        lines.append(f"    # {name}: {best['us']:.1f} us vs {default['us']:.1f} us heuristic\n"
                     f"    {best['class']!r}: {best['config']},")
    return "\n".join(lines) or "    (none)"


def pp_shape(shape) -> configs.DecodeShape:
    """The `DecodeShape` a benchmark shape's calls have (what the table is keyed by)."""
    return configs.DecodeShape(batch=shape.batch, num_kv_heads=shape.num_kv_heads,
                               group=shape.num_heads // shape.num_kv_heads,
                               head_dim=shape.head_dim, block_size=shape.block_size,
                               capacity=shape.capacity, cache_dtype=shape.dtype)


def _format_row(row: dict) -> str:
    if "error" in row:
        return f"{row['shape']:<18} {row['impl']:<7} {row.get('config', ''):<60} ERROR {row['error'][:300]}"
    if row.get("correct") is False:
        return f"{row['shape']:<18} {row['impl']:<7} {row['config']:<60} WRONG rel_err={row['rel_err']:.3g}"
    return (f"{row['shape']:<18} {row['impl']:<7} {row['config']:<60} {row['us']:9.1f} us"
            f" {row['tbps']:6.2f} TB/s {row['of_copy']:5.2f} of copy")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="comma-separated names (benchmarks.shapes)")
    parser.add_argument("--configs", action="store_true", help="also time Mosaic config candidates")
    parser.add_argument("--config", action="append", default=[], type=parse_config,
                        help="also time the heuristic's Mosaic config with these fields"
                        " replaced, e.g. bk64/st4/c2 (repeatable)")
    parser.add_argument("--probe-producer", action="store_true",
                        help="also time each Mosaic config's producer alone (consumers that"
                        " only wait and free; output not attention)")
    parser.add_argument("--compiler-param", action="append", default=[],
                        type=parse_compiler_param,
                        help="also time the heuristic's config compiled with this Mosaic GPU"
                        " compiler parameter, e.g. approx_math=1 (repeatable: all at once)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, minimal repetitions (interpret mode without a GPU)")
    args = parser.parse_args(argv)
    s = Settings(interpret=not has_gpu())
    if args.smoke:
        s = smoke_settings(s)
    if args.shapes:
        shapes = [shape_by_name(name) for name in args.shapes.split(",")]
    else:
        shapes = list(SMOKE_SHAPES) if args.smoke else [shape_by_name(name) for name in SHAPES]
    names = [shape.name for shape in shapes]
    copy = measure_copy_bandwidth(s.copy_bytes, s)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; copy bandwidth"
          f" {copy['tbps']:.2f} TB/s (read + written)", flush=True)
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, s, copy["tbps"], args.configs, tuple(args.config),
                            args.probe_producer, tuple(args.compiler_param))
    print("\nsummary (median time; fraction of copy bandwidth; mosaic speed-up over pallas)")
    for name in names:
        best = {}
        for row in rows:
            if row["shape"] == name and "us" in row:
                if row["impl"] not in best or row["us"] < best[row["impl"]]["us"]:
                    best[row["impl"]] = row
        cells = [f"{impl} {best[impl]['us']:.1f} us ({best[impl]['of_copy']:.2f})"
                 for impl in ("mosaic", "pallas") if impl in best]
        ratio = (f"  x{best['pallas']['us'] / best['mosaic']['us']:.2f}"
                 if {"mosaic", "pallas"} <= best.keys() else "")
        print(f"{name:<18} " + "   ".join(cells or ["no timing"]) + ratio)
    if args.configs:
        print("\nMOSAIC_TUNED entries (configs.py), where a candidate beat the heuristic:")
        print(tuned_snippet(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy": copy, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

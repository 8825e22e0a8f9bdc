"""What one decode call pays besides streaming its bytes: the same kernel and config timed at
several context lengths, and a straight line fitted through ``time = fixed + bytes / rate``.

Run ``python -m benchmarks.call_overhead [--shapes b32_ctx4096,mha_b32_ctx4096] [--contexts
1024,2048,4096,8192] [--config LABEL] [--json PATH] [--smoke]``. For each shape every context
length gets the config that ``decode`` picks for the named shape (or the shape's config with
``--config``'s fields, `benchmarks.bench.config_label`'s parts), so every point runs the same
kernel on the same grid and only the tiles each program walks change. Each point is checked
against ``impl="xla"`` first and timed as `benchmarks.decode_anatomy` times its rows (straight-line
calls in one jitted program, each call on its own query, inputs rotated among copies that fill L2
several times).

The fit says which part of a call's time the streaming rate explains: ``rate`` (the slope, as a
fraction of the run's copy bandwidth) is what the kernel streams once its programs run, and
``fixed`` (the intercept, µs per call) what a call costs at zero bytes, its programs' start and
its tail included. A kernel whose ``rate`` is at the bar but whose figure is not spends the
difference at the ends of the call, which no change to the tile loop can buy back.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np

import pallas_paged as pp
from benchmarks.bench import (ROTATE_BYTES, Settings, abstract_args, compare, config_label,
                              parse_decode_config, per_call, tool_parser, tool_setup,
                              tool_shape_names, write_tool_json)
from benchmarks.shapes import make_decode_inputs, rotation_copies, shape_by_name
from benchmarks.timing import describe_error, measure
from pallas_paged.decode_attention.api import picked_config

SHAPES = ("b32_ctx4096", "mha_b32_ctx4096")
CONTEXTS = (1024, 2048, 4096, 8192)
SMOKE_SHAPES = ("small_b2_ctx64",)
SMOKE_CONTEXTS = (32, 64)


def fit_line(nbytes, times_us) -> dict:
    """Least squares ``time_us = fixed_us + nbytes / (rate_tbps * 1e6)`` over the points.

    Returns:
      ``{"fixed_us", "rate_tbps", "max_residual_us"}``; NaNs for fewer than two distinct sizes.
    """
    x = np.asarray(nbytes, np.float64)
    y = np.asarray(times_us, np.float64)
    if len(set(x.tolist())) < 2:
        return {"fixed_us": float("nan"), "rate_tbps": float("nan"),
                "max_residual_us": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)  # us per byte, us
    residual = y - (intercept + slope * x)
    return {"fixed_us": float(intercept),
            "rate_tbps": float(1.0 / (slope * 1e6)) if slope > 0 else float("nan"),
            "max_residual_us": float(np.max(np.abs(residual)))}


def time_point(shape, config, s: Settings, interpret: bool) -> dict:
    """One context length: ``decode`` with ``config`` checked against ``impl="xla"``, then timed."""
    copies = s.copies or rotation_copies(shape, min_bytes=ROTATE_BYTES, max_copies=s.max_copies)
    inputs = make_decode_inputs(shape, seed=s.seed, copies=copies)
    scales = {} if inputs.k_scale is None else dict(k_scale=inputs.k_scale,
                                                   v_scale=inputs.v_scale)
    nbytes = (shape.tokens_read(inputs.context_lens_np) * shape.kv_bytes_per_token
              + 2 * shape.batch * shape.num_heads * shape.head_dim * 2)
    lens, kc, vc = inputs.context_lens, inputs.k_cache, inputs.v_cache
    row = {"context": shape.context, "bytes": nbytes, "copies": copies}

    def call(q, t, k, v):
        return pp.decode(q, k, v, t, lens, config=config, interpret=interpret, **scales)

    reference = pp.decode(inputs.q[0], kc, vc, inputs.block_tables[0], lens, impl="xla",
                          **scales)
    err = compare(jax.jit(call)(inputs.q[0], inputs.block_tables[0], kc, vc), reference)
    row["rel_err"] = err["rel_err"]
    if not err["correct"]:
        row["status"] = "WRONG"
        return row
    reps = copies * max(1, -(-s.loop_ops // copies))
    qs = per_call(inputs.q, copies, reps)
    tables = [inputs.block_tables[i % copies] for i in range(reps)]
    run = jax.jit(lambda qs, ts, k, v: tuple(call(qs[i], ts[i], k, v) for i in range(reps)))
    jax.block_until_ready(run(qs, tables, kc, vc))
    timing = measure(lambda: run(qs, tables, kc, vc), reps, s)
    row.update(status="ok", median_us=timing.median_us, min_us=timing.min_us,
               max_us=timing.max_us)
    return row


def run_shape(name: str, contexts, fields: dict, s: Settings, copy_tbps: float,
              interpret: bool) -> dict:
    """Every context length of one shape, and the line through them."""
    base = shape_by_name(name)
    config = dataclasses.replace(picked_config(*abstract_args(base)), **fields)
    print(f"[{name}] {base.describe()}, config {config_label(config)} at every length",
          flush=True)
    points = []
    for context in contexts:
        shape = dataclasses.replace(base, name=f"{name}@{context}", context=context)
        try:
            row = time_point(shape, config, s, interpret)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row = {"context": context, "status": "error", "error": describe_error(e)}
        points.append(row)
        if row["status"] == "ok":
            of_copy = row["bytes"] / (row["median_us"] * 1e-6) / 1e12 / copy_tbps
            row["of_copy"] = of_copy
            print(f"  ctx {context:6d}  {row['bytes'] / 1e6:9.1f} MB  {row['median_us']:9.2f} us"
                  f"  {of_copy:.3f} of copy", flush=True)
        else:
            print(f"  ctx {context:6d}  {row['status']}: {row.get('error', row.get('rel_err'))}",
                  flush=True)
    ok = [p for p in points if p["status"] == "ok"]
    line = fit_line([p["bytes"] for p in ok], [p["median_us"] for p in ok])
    line["rate_of_copy"] = line["rate_tbps"] / copy_tbps
    print(f"  fit: {line['fixed_us']:.2f} us per call + bytes at {line['rate_tbps']:.3f} TB/s"
          f" ({line['rate_of_copy']:.3f} of copy); largest residual"
          f" {line['max_residual_us']:.2f} us", flush=True)
    return {"shape": name, "config": dataclasses.asdict(config), "points": points, "fit": line}


def main(argv=None) -> int:
    parser = tool_parser(__doc__, "tiny shapes in interpret mode (the plumbing, not the speed)")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths")
    parser.add_argument("--config", default=None, type=parse_decode_config,
                        help="bk64/s1/w8/st5 (any subset): these fields over the picked config")
    args = parser.parse_args(argv)
    names = tool_shape_names(args, SHAPES, SMOKE_SHAPES)
    contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts
                else (SMOKE_CONTEXTS if args.smoke else CONTEXTS))
    s, interpret, copy = tool_setup(args.smoke)
    results = [run_shape(name, contexts, args.config or {}, s, copy["tbps"], interpret)
               for name in names]
    write_tool_json(args.json, copy, shapes=results)
    wrong = any(p["status"] == "WRONG" for r in results for p in r["points"])
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

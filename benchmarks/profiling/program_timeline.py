"""When each program of a one-launch decode call starts and ends, on the GPU's global timer: where
a call spends the time that streaming its bytes does not explain (the launch's ramp, the programs'
spread, the tail while the last programs finish, the gap before the next call).

Run ``python -m benchmarks.profiling.program_timeline [--shapes b32_ctx4096,mha_b32_ctx4096]
[--config LABEL] [--dispatch] [--json PATH] [--smoke]``. Each shape runs the Triton grid kernel
(`pallas_triton._paged_decode_kernel`, unchanged) inside a wrapper that also writes, per
program, the global timer (``%globaltimer_lo``, ns) when it starts and when its last store is
done, and the
multiprocessor it ran on (``%smid``). ``TimerSettings.loop_ops`` calls run back to back in one
jitted program, each on its own query, as `benchmarks.decode` times its rows; the first call's
output is checked against ``impl="xla"``. Per call (the medians over the calls are printed):

- ``span``: first start to last end; ``period``: first start to the next call's first start;
  ``gap``: last end to the next call's first start (launch and the loop between calls);
- ``ramp``: first start to the last program's start (the grid's programs placed);
- ``full``: first start to the first program's end (every program streaming); ``tail``: first
  end to last end (programs finishing; fewer streams in flight);
- program durations (min / median / max), the time the bytes take at the run's copy bandwidth,
  and `benchmarks.timing.measure`'s time per call of the same loop (its steady figure and its
  whole batches'): the host's timer against the device's.

``--dispatch``: the same calls also launched one per dispatch (each its own jitted program), its
timeline and host figure beside the loop's (JSON ``dispatch``): whether calls cost the same
inside one program and apart.

``--smoke``: a tiny shape in interpret mode (no timer there: the timestamps are zeros); it checks
the wrapper's output against ``impl="xla"``, not the timeline. ``--config`` takes
`benchmarks._cli.config_label`'s parts over the picked config; configs with splits must merge in
the kernel (``mk1``), and persistent programs are refused (their own kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_paged as pp
from benchmarks import _cli
from benchmarks._cli import compare, config_label
from benchmarks.shapes import (DECODE_SHAPES, DECODE_SMOKE, make_decode_inputs, rotation_copies,
                               shape_by_name)
from benchmarks.timing import loop_reps, measure, per_call
from pallas_paged.decode_attention import pallas_triton as decode_triton
from pallas_paged.decode_attention.api import select_kernel

SHAPES = ("b32_ctx4096", "mha_b32_ctx4096")
SMOKE_SHAPES = ("smoke_b2_ctx64",)
STAMPS = 4  # per program: start ns, end ns, SM id, unused
KERNEL_INPUTS = 10  # `_paged_decode_kernel`'s refs before its outputs (arrivals_in_ref included)


def special_register(name: str, like, *, interpret: bool):
    """PTX special register ``name`` (``globaltimer_lo``, ``smid``) read once per element of
    ``like`` (i32[N]); the read depends on ``like``, so it happens after ``like`` is computed.
    Interpret mode: zeros."""
    if interpret:
        return jnp.zeros_like(like)
    [value] = plgpu.elementwise_inline_asm(
        f"mov.u32 $0, %{name};", args=[like], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(like.shape, jnp.int32)])
    return value


def _timed_decode_kernel(*refs, interpret: bool, **kernel_args):
    """`_paged_decode_kernel` between two timer reads: ``refs`` are its refs, then
    ``timeline_ref`` i32[batch, kvh, splits, STAMPS]."""
    *kernel_refs, timeline_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lane = jnp.arange(STAMPS)  # i32[STAMPS]
    start = special_register("globaltimer_lo", lane + b, interpret=interpret)
    sm = special_register("smid", lane + h, interpret=interpret)
    plgpu.store(timeline_ref.at[b, h, split, lane], jnp.where(lane == 0, start, sm),
                mask=lane != 1)
    decode_triton._paged_decode_kernel(*kernel_refs, interpret=interpret, **kernel_args)
    # The end: after this program's stores (a barrier), read back through the lse output
    # [batch, kvh, group] (with splits, m [batch, kvh, splits, group]); the timer read depends
    # on the value read.
    scalars_ref = kernel_refs[KERNEL_INPUTS + 1]
    if not interpret:
        plgpu.debug_barrier()
    index = (b, h, lane * 0) if len(scalars_ref.shape) == 3 else (b, h, split, lane * 0)
    stored = plgpu.load(scalars_ref.at[index])  # f32[STAMPS]
    done = jnp.where(stored == stored, lane, lane + 1)  # i32[STAMPS], depends on the load
    end = special_register("globaltimer_lo", done, interpret=interpret)
    plgpu.store(timeline_ref.at[b, h, split, lane], end, mask=lane == 1)


def timed_decode(q, k_cache, v_cache, block_tables, context_lens, *, config: pp.DecodeConfig,
                 interpret: bool):
    """``decode(impl="pallas", config=config)`` without options, through `_timed_decode_kernel`.

    Returns:
      ``(out [batch, num_heads, head_dim] in q.dtype, timeline i32[batch, kvh, splits, STAMPS])``.
    """
    if config.persistent_programs:
        raise ValueError(f"config={config_label(config)}: persistent programs run their own "
                         "kernel, which this tool does not wrap")
    if config.num_splits > 1 and not config.merge_in_kernel:
        raise ValueError(f"config={config_label(config)}: splits merged by a second launch; "
                         "give mk1 (merged in the kernel) to time one launch")
    batch, num_heads, head_dim = q.shape
    kvh = k_cache.shape[2]
    splits = config.num_splits
    statics = decode_triton.kernel_statics(q, k_cache, config, fused=False)
    kernel = functools.partial(
        _timed_decode_kernel, scale=1.0 / float(np.sqrt(head_dim)), num_splits=splits,
        soft_cap=None, window=None, merge_in_kernel=splits > 1, interpret=interpret, **statics)
    out_shape = decode_triton.grid_kernel_out_shapes(q, kvh, splits, merge_in_kernel=splits > 1)
    out_shape += (jax.ShapeDtypeStruct((batch, kvh, splits, STAMPS), jnp.int32),)
    operands = decode_triton.kernel_operands(q, k_cache, v_cache, block_tables, context_lens,
                                             None, None, None, None, fp8_pairs=statics["fp8_pairs"],
                                             fused=False)
    arrivals = jnp.zeros((batch, kvh), jnp.int32) if splits > 1 else None
    aliases = ({len(jax.tree_util.tree_leaves(operands)): len(out_shape) - 2} if splits > 1
               else {})
    outs = pl.pallas_call(
        kernel, grid=(batch, kvh, splits), out_shape=out_shape, input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name="pallas_paged_decode_timeline",
    )(*operands, arrivals)
    out = outs[3] if splits > 1 else outs[0]
    return out.reshape(batch, num_heads, head_dim), outs[-1]


def call_phases(timeline: np.ndarray, next_first_start: float | None = None) -> dict:
    """The phases of one call from its programs' stamps (i32[..., STAMPS], ns of the global
    timer's low word; wrap-around handled relative to the earliest start).

    Returns:
      µs: ``span``, ``ramp``, ``full``, ``tail``, ``gap`` / ``period`` (None without
      ``next_first_start``, given relative to this call's first start in ns) and the programs'
      ``duration_min`` / ``_median`` / ``_max``; ``sms``: distinct multiprocessors used.
    """
    stamps = timeline.reshape(-1, STAMPS).astype(np.int64)
    origin = stamps[:, 0].min()
    start = (stamps[:, 0] - origin) % (1 << 32)
    end = (stamps[:, 1] - origin) % (1 << 32)
    duration = end - start
    us = lambda ns: float(ns) / 1e3  # noqa: E731
    phases = {"span": us(end.max()), "ramp": us(start.max()), "full": us(end.min()),
              "tail": us(end.max() - end.min()), "duration_min": us(duration.min()),
              "duration_median": us(np.median(duration)), "duration_max": us(duration.max()),
              "sms": int(len(np.unique(stamps[:, 2]))), "gap": None, "period": None}
    if next_first_start is not None:
        phases["gap"] = us(next_first_start - end.max())
        phases["period"] = us(next_first_start)
    return phases


def loop_phases(timelines: list) -> list:
    """`call_phases` of each call of a loop in the order the calls ran (XLA may launch a loop's
    independent calls in another order than written), each call's gap and period measured to
    the next call's first start."""
    firsts = np.array([int(t[..., 0].astype(np.int64).min()) for t in timelines])
    origin = firsts.min()
    starts = (firsts - origin) % (1 << 32)  # ns after the loop's first start
    ran = [timelines[i] for i in np.argsort(starts)]
    starts = np.sort(starts)
    return [call_phases(t, None if i + 1 == len(ran) else float(starts[i + 1] - starts[i]))
            for i, t in enumerate(ran)]


def median_phases(phases: list) -> dict:
    """The median of every field over the calls (fields that are None everywhere stay None)."""
    merged = {}
    for key in phases[0]:
        values = [p[key] for p in phases if p[key] is not None]
        merged[key] = float(np.median(values)) if values else None
    return merged


def run_shape(name: str, fields: dict, s, copy_tbps: float, interpret: bool,
              dispatch: bool = False) -> dict:
    """One shape's loop (and, with ``dispatch``, the same calls one per dispatch): checked
    against ``impl="xla"``, then timed on the device's and the host's timers."""
    shape = shape_by_name(name)
    if shape.scales:
        raise ValueError(f"shape={name}: fp8 caches are not wrapped by this tool")
    copies = rotation_copies(shape.expected_kv_bytes(), max_copies=1 if interpret else 8)
    inputs = make_decode_inputs(shape, seed=0, copies=copies)
    _, picked = select_kernel(*shape.abstract_args(), impl="pallas", config=None,
                              interpret=interpret)
    config = dataclasses.replace(picked, **fields)
    nbytes = (shape.tokens_read(inputs.context_lens_np) * shape.kv_bytes_per_token
              + 2 * shape.batch * shape.num_heads * shape.head_dim * 2)
    lens, kc, vc = inputs.context_lens, inputs.k_cache, inputs.v_cache
    call = functools.partial(timed_decode, config=config, interpret=interpret)
    print(f"[{name}] {shape.describe()}, config {config_label(config)}, "
          f"{nbytes / 1e6:.1f} MB per call", flush=True)
    reference = pp.decode(inputs.q[0], kc, vc, inputs.block_tables[0], lens, impl="xla")
    out, _ = jax.jit(call)(inputs.q[0], kc, vc, inputs.block_tables[0], lens)
    err = compare(out, reference)
    row = {"shape": name, "config": dataclasses.asdict(config), "bytes": nbytes,
           "rel_err": err["rel_err"]}
    if not err["correct"]:
        print(f"  WRONG rel_err={err['rel_err']:.2e}", flush=True)
        return {**row, "status": "WRONG"}
    reps = loop_reps(copies, s.loop_ops)
    qs = per_call(inputs.q, copies, reps)
    tables = [inputs.block_tables[i % copies] for i in range(reps)]
    stream_us = nbytes / (copy_tbps * 1e12) * 1e6
    loop = jax.jit(lambda qs, ts, k, v: tuple(call(qs[i], k, v, ts[i], lens)[1]
                                              for i in range(reps)))
    one = jax.jit(lambda q, t, k, v: call(q, k, v, t, lens)[1])
    # mode: (all its calls, what `measure` times, operations per timed step)
    modes = {"loop": (lambda: loop(qs, tables, kc, vc), lambda: loop(qs, tables, kc, vc), reps)}
    if dispatch:
        modes["dispatch"] = (lambda: [one(qs[i], tables[i], kc, vc) for i in range(reps)],
                             lambda: one(qs[0], tables[0], kc, vc), 1)
    result = {**row, "status": "ok"}
    for mode, (calls, step, per_step) in modes.items():
        for _ in range(3):  # warm: compiled, clocks up; the last run's timelines are kept
            timelines = [np.asarray(t) for t in jax.block_until_ready(calls())]
        host = measure(step, per_step, s)
        phases = loop_phases(timelines)
        typical = median_phases(phases)
        typical.update(at_copy_rate=stream_us, host_us=host.median_us,
                       host_batch_us=host.batch_median_us)
        what = (f"{reps} calls in one program" if mode == "loop"
                else f"{reps} calls, one per dispatch")
        print(f"  {what}, medians: period {typical['period'] or 0:.1f} us = span "
              f"{typical['span']:.1f} + gap {typical['gap'] or 0:.1f}; span = full "
              f"{typical['full']:.1f} + tail {typical['tail']:.1f}; ramp {typical['ramp']:.1f}; "
              f"programs {typical['duration_min']:.1f} / {typical['duration_median']:.1f} / "
              f"{typical['duration_max']:.1f} us (min / median / max) on {typical['sms']:.0f} "
              f"SMs; the bytes at copy rate {stream_us:.1f} us; the host timer: "
              f"{host.median_us:.1f} us per call ({host.batch_median_us:.1f} over whole batches)",
              flush=True)
        if mode == "loop":
            result.update(calls=phases, median=typical)
        else:
            result["dispatch"] = {"calls": phases, "median": typical}
    return result


def main(argv=None) -> int:
    parser = _cli.parser("benchmarks.profiling.program_timeline", __doc__, shapes=False)
    parser.add_argument("--shapes", default=None,
                        help=f"comma-separated decode shapes (default {','.join(SHAPES)})")
    parser.add_argument("--config", default=None,
                        type=lambda label: _cli.parse_config(label, pp.DecodeConfig),
                        help="bk64/s1/w8/st5 (any subset): these fields over the picked config")
    parser.add_argument("--dispatch", action="store_true",
                        help="also the same calls launched one per dispatch (each its own program)")
    args = parser.parse_args(argv)
    names = args.shapes or ",".join(SMOKE_SHAPES if args.smoke else SHAPES)
    shapes = _cli.pick_shapes(parser, names, DECODE_SHAPES + DECODE_SMOKE, (), False)
    s, interpret = _cli.settings(args.smoke)
    doc = _cli.run_record("benchmarks.profiling.program_timeline", argv, s, interpret)
    doc["ceilings"] = _cli.ceilings(s, args.smoke)
    doc["shapes"] = [run_shape(shape.name, args.config or {}, s, doc["ceilings"]["tbps"],
                               interpret, args.dispatch) for shape in shapes]
    _cli.write_json(args.json, doc)
    return 1 if any(r["status"] == "WRONG" for r in doc["shapes"]) else 0


if __name__ == "__main__":
    sys.exit(main())

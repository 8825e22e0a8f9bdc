r"""A few calls of one named shape's kernel, for a profiler to look at (Nsight Compute on a GPU).

    ncu --clock-control none --kernel-name regex:pallas_paged --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section SourceCounters \
        python -m benchmarks.profile_kernel --shape fp8_b32_ctx4096

``--shape`` names a decode shape of `benchmarks.shapes` (runs `pallas_paged.decode`) or a ragged
one of `benchmarks.bench_ragged.SHAPES` (runs `pallas_paged.paged_attention`), with the config
the call picks (for decode, ``--config bk64/pr1`` replaces those fields of it), or ``--impl``.
The script runs ``--calls`` calls and prints the names of the kernels in the program (the
profiler's ``--kernel-name`` filter). Nothing is timed here: read the
profiler's report.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax

import pallas_paged as pp
from benchmarks import bench_mosaic, bench_ragged
from benchmarks.bench import parse_decode_config
from benchmarks.shapes import make_decode_inputs, shape_by_name
from pallas_paged.decode_attention.api import picked_config


def decode_call(name: str, impl: str, fields: dict | None = None):
    """``(description, jitted fn, args)`` of one decode call on shape ``name``'s inputs; with
    ``fields`` (`benchmarks.bench.parse_decode_config`'s, or for ``impl="mosaic"``
    `benchmarks.bench_mosaic.parse_config`'s), the config ``decode`` picks with those fields
    replaced."""
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=0)
    scales = {} if inputs.k_scale is None else dict(k_scale=inputs.k_scale,
                                                   v_scale=inputs.v_scale)
    config = None
    if fields:
        config = dataclasses.replace(
            picked_config(inputs.q[0], inputs.k_cache, inputs.block_tables[0], impl=impl),
            **fields)
    # the caches are arguments: closed over, they would be captured as constants of the program
    fn = jax.jit(lambda q, k, v, t, n: pp.decode(q, k, v, t, n, impl=impl, config=config,
                                                 **scales))
    return shape.describe() + ("" if config is None else f", {config}"), fn, (
        inputs.q[0], inputs.k_cache, inputs.v_cache, inputs.block_tables[0], inputs.context_lens)


RAGGED_SHAPES = {shape.name: shape for shape in bench_ragged.SHAPES}


def ragged_call(name: str, impl: str):
    """``(description, jitted fn, args)`` of one ragged call on shape ``name``'s inputs."""
    shape = RAGGED_SHAPES[name]
    inputs = bench_ragged.make_inputs(shape, seed=0)
    fn = jax.jit(lambda *args: pp.paged_attention(*args, impl=impl))
    return shape.describe(), fn, inputs.args()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True,
                        help="a decode shape of benchmarks.shapes or a ragged one of"
                        " benchmarks.bench_ragged.SHAPES")
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--config", default=None,
                        help="decode shapes: bk64/pr1 (any subset; with --impl mosaic, e.g."
                        " st3/vp1) over the config decode picks")
    args = parser.parse_args(argv)
    if args.shape in RAGGED_SHAPES:
        if args.config:
            parser.error("--config applies to decode shapes")
        describe, fn, call_args = ragged_call(args.shape, args.impl)
    else:
        parse = bench_mosaic.parse_config if args.impl == "mosaic" else parse_decode_config
        try:
            fields = parse(args.config) if args.config else None
        except ValueError as e:
            parser.error(f"--config: {e}")
        describe, fn, call_args = decode_call(args.shape, args.impl, fields)
    print(f"{args.shape}: {describe}, impl={args.impl}")
    text = fn.lower(*call_args).as_text()
    print(text.count("pallas_paged"), "mention(s) of pallas_paged kernels in the program")
    for _ in range(args.calls):
        jax.block_until_ready(fn(*call_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

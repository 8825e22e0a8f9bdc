"""A few decode calls of one named shape, for a profiler to look at (Nsight Compute on a GPU).

    ncu --clock-control none --kernel-name regex:pallas_paged_decode --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy \
        python -m benchmarks.profile_decode --shape fp8_b32_ctx4096

Runs `pallas_paged.decode` (the config it picks, or ``--impl``) ``--calls`` times on the shape's
inputs from `benchmarks.shapes` and prints the kernel names it launched under (the profiler's
``--kernel-name`` filter). Nothing is timed here: read the profiler's report.
"""

from __future__ import annotations

import argparse
import sys

import jax

import pallas_paged as pp
from benchmarks.shapes import make_decode_inputs, shape_by_name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True, help="a name from benchmarks.shapes")
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)
    shape = shape_by_name(args.shape)
    inputs = make_decode_inputs(shape, seed=0)
    scales = {} if inputs.k_scale is None else dict(k_scale=inputs.k_scale,
                                                   v_scale=inputs.v_scale)
    q, tables = inputs.q[0], inputs.block_tables[0]
    fn = jax.jit(lambda q, t: pp.decode(q, inputs.k_cache, inputs.v_cache, t,
                                        inputs.context_lens, impl=args.impl, **scales))
    print(f"{shape.name}: {shape.describe()}, impl={args.impl}")
    print(fn.lower(q, tables).as_text().count("pallas_paged_decode"), "kernel call(s) named"
          " pallas_paged_decode* in the program")
    for _ in range(args.calls):
        jax.block_until_ready(fn(q, tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())

r"""A few calls of one named shape's kernel, for a profiler to look at (Nsight Compute on a GPU).

    ncu --clock-control none --kernel-name regex:pallas_paged --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section SourceCounters \
        python -m benchmarks.profiling.profile_kernel --shape fp8_b32_ctx4096

``--shape`` names a decode shape of `benchmarks.shapes` (runs `pallas_paged.decode`) or a ragged
one (runs `pallas_paged.paged_attention`), with the config the call picks for ``--impl``
(``--config bk64/pr1`` replaces those fields of it, `benchmarks._cli.config_label`'s parts).
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
from benchmarks._cli import parse_config
from benchmarks.shapes import (RaggedBenchShape, make_decode_inputs, make_ragged_inputs,
                               shape_by_name)
from pallas_paged._platform import resolve_interpret
from pallas_paged.decode_attention.api import select_kernel
from pallas_paged.ragged_attention.api import select_kernel as select_ragged


def picked_with(select, fields: dict | None):
    """The config a call picks (``select()``: its ``(impl, config)``) with ``fields``
    (`benchmarks._cli.parse_config`'s) replaced, or None (the call picks its own) without
    fields."""
    return dataclasses.replace(select()[1], **fields) if fields else None


def described(shape, config) -> str:
    """The shape's description, and the config where one was given."""
    return shape.describe() + ("" if config is None else f", {config}")


def decode_call(name: str, impl: str, fields: dict | None = None):
    """``(description, jitted fn, args)`` of one decode call on shape ``name``'s inputs; with
    ``fields``, the config ``decode`` picks with those fields replaced (`picked_with`)."""
    shape = shape_by_name(name)
    inputs = make_decode_inputs(shape, seed=0)
    config = picked_with(lambda: select_kernel(*shape.abstract_args(), impl=impl, config=None,
                                               interpret=resolve_interpret(None),
                                               sliding_window=shape.sliding_window), fields)
    # the caches are arguments: closed over, they would be captured as constants of the program
    fn = jax.jit(lambda q, k, v, t, n: pp.decode(q, k, v, t, n, impl=impl, config=config,
                                                 sliding_window=shape.sliding_window,
                                                 **shape.scales))
    return described(shape, config), fn, inputs.args(0)


def ragged_call(name: str, impl: str, fields: dict | None = None):
    """``(description, jitted fn, args)`` of one ragged call on shape ``name``'s inputs; with
    ``fields``, the config ``paged_attention`` picks with those fields replaced."""
    shape = shape_by_name(name)
    inputs = make_ragged_inputs(shape, seed=0)
    config = picked_with(lambda: select_ragged(*shape.abstract_args()[:3], impl=impl,
                                               config=None, interpret=resolve_interpret(None)),
                         fields)
    fn = jax.jit(lambda *args: pp.paged_attention(*args, impl=impl, config=config,
                                                  **shape.scales))
    return described(shape, config), fn, inputs.args(0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", required=True,
                        help="a decode or ragged shape of benchmarks.shapes")
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--config", default=None,
                        help="bk64/pr1 (any subset of the impl's config label; e.g. st3/vp1"
                        " for decode --impl mosaic, ps1/ov1 for a ragged shape's) over the"
                        " config the call picks")
    args = parser.parse_args(argv)
    try:
        ragged = isinstance(shape_by_name(args.shape), RaggedBenchShape)
    except ValueError as e:
        parser.error(str(e))
    mosaic = args.impl == "mosaic"
    if ragged:
        config_type = pp.MosaicAttentionConfig if mosaic else pp.AttentionConfig
    else:
        config_type = pp.MosaicDecodeConfig if mosaic else pp.DecodeConfig
    try:
        fields = parse_config(args.config, config_type) if args.config else None
    except ValueError as e:
        parser.error(f"--config: {e}")
    call = ragged_call if ragged else decode_call
    describe, fn, call_args = call(args.shape, args.impl, fields)
    print(f"{args.shape}: {describe}, impl={args.impl}")
    text = fn.lower(*call_args).as_text()
    print(text.count("pallas_paged"), "mention(s) of pallas_paged kernels in the program")
    for _ in range(args.calls):
        jax.block_until_ready(fn(*call_args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

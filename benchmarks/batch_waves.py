"""Decode at any batch size, with the config decode picks and with fields replaced over it.

The named shapes of `benchmarks.shapes` are powers of two; a serving batch is any number. Where a
batch's programs overflow a whole number of waves (``batch * kv_heads * splits`` past the
programs the device runs at once), the last programs stream alone after the others. This times
the Triton kernel (``impl="pallas"``) at the batches asked for, bf16 or fp8, H=32, KVH=8, D=128,
block_size=16, every sequence at the same context; each row is checked against ``impl="xla"``
first (`benchmarks.bench.compare`) and timed as `benchmarks.bench` times a
shape in dispatch mode (`benchmarks.timing.measure`), as a fraction of the same run's copy
bandwidth (K/V bytes read).

    python -m benchmarks.batch_waves fp8:34=s2,s4 bfloat16:33=bk64/s1/w8/st5 [--json F]

Each argument is ``DTYPE:BATCH[:CONTEXT]=LABEL,LABEL,...`` (DTYPE ``bfloat16``, ``float16`` or
``fp8``; CONTEXT 4096 by default; LABELs in `benchmarks.bench.config_label`'s form, replacing
fields of the picked config, none for the picked config alone). Exit status 1 when a row is
WRONG, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax

import pallas_paged as pp
from benchmarks.bench import Settings, compare, config_label, parse_decode_config, smoke_settings
from benchmarks.shapes import FP8, DecodeBenchShape, make_decode_inputs
from benchmarks.timing import copy_summary, jsonable, measure, measure_copy_bandwidth
from pallas_paged.decode_attention.api import picked_config


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    batch: int
    context: int
    overrides: tuple  # of dicts: DecodeConfig fields replaced over the picked config


def parse_case(text: str) -> Case:
    """``"fp8:34:8192=s2,bk64/s4"`` -> `Case`."""
    head, _, labels = text.partition("=")
    parts = head.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"{text!r}: expected DTYPE:BATCH[:CONTEXT]=LABEL,...")
    dtype = FP8 if parts[0] == "fp8" else parts[0]
    if dtype not in ("bfloat16", "float16", FP8):
        raise ValueError(f"{text!r}: dtype {parts[0]!r} is not bfloat16, float16 or fp8")
    overrides = tuple(parse_decode_config(label) for label in labels.split(",") if label)
    return Case(dtype, int(parts[1]), int(parts[2]) if len(parts) == 3 else 4096, overrides)


def case_shape(case: Case, smoke: bool) -> DecodeBenchShape:
    if smoke:  # tiny, for interpret mode on a CPU
        return DecodeBenchShape("smoke", case.batch, 8, 2, 32, 16, 64, dtype=case.dtype)
    return DecodeBenchShape(f"b{case.batch}_ctx{case.context}", case.batch, 32, 8, 128, 16,
                            case.context, dtype=case.dtype)


def run_case(case: Case, s: Settings, copy_tbps: float, smoke: bool) -> list[dict]:
    shape = case_shape(case, smoke)
    inputs = make_decode_inputs(shape, s.seed)
    args = inputs.args(0)
    k_scale, v_scale = shape.scales
    nbytes = inputs.tokens_read() * shape.kv_bytes_per_token
    picked = picked_config(args[0], args[1], args[3], impl="pallas")
    ref = pp.decode(*args, impl="xla", k_scale=k_scale, v_scale=v_scale)
    rows = []
    for fields in ({},) + case.overrides:
        config = dataclasses.replace(picked, **fields)
        fn = jax.jit(functools.partial(pp.decode, k_scale=k_scale, v_scale=v_scale, config=config,
                                       interpret=True if smoke else None))
        check = compare(jax.block_until_ready(fn(*args)), ref)
        rel_err = check["rel_err"]
        row = dict(dtype=case.dtype, batch=case.batch, context=shape.context,
                   config=config_label(config), picked=not fields,
                   programs=case.batch * shape.num_kv_heads * config.num_splits, rel_err=rel_err)
        if not check["correct"]:
            row["status"] = "WRONG"
        else:
            t = measure(lambda: fn(*args), 1, s)
            row.update(status="ok", median_us=t.median_us, windows_us=t.windows_us,
                       of_copy=nbytes / (t.median_us * 1e-6) / 1e12 / copy_tbps)
        rows.append(row)
        timing = (f"{row['median_us']:8.2f} us {row['of_copy']:.3f} of copy"
                  if row["status"] == "ok" else "WRONG")
        print(f"{case.dtype:14s} B={case.batch:4d} ctx={shape.context:6d} {row['config']:28s}"
              f"{' (picked)' if not fields else '         '} programs={row['programs']:6d} "
              f"{timing} rel_err {rel_err:.1e}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", help="DTYPE:BATCH[:CONTEXT]=LABEL,... (see above)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (the plumbing, not the speed)")
    args = parser.parse_args(argv)
    try:
        cases = [parse_case(text) for text in args.cases]
    except ValueError as e:
        parser.error(str(e))
    s = smoke_settings(Settings()) if args.smoke else Settings()
    copy = measure_copy_bandwidth(s.copy_bytes, s)
    print(f"copy bandwidth {copy_summary(copy)}", flush=True)
    rows = [row for case in cases for row in run_case(case, s, copy["tbps"], args.smoke)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jsonable({"copy": copy, "rows": rows}), f, indent=1)
    return 1 if any(r["status"] == "WRONG" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The device's ceilings alone, every way `benchmarks.timing` measures them, each with its windows'
spread: the copy bandwidth (the ceiling of memory-bound figures), the streaming read rate (how far
above the copy a kernel that only reads can go) and the bf16 matmul rate (the ceiling of
compute-bound figures).

    python -m benchmarks.ceilings [--gib 4] [--json F] [--smoke]

One process measures once; run it in several to see how the ways move between processes (the
spread that every fraction of a ceiling inherits). ``--smoke``: 1 MiB buffers and a 256^3
product with minimal timing (on a CPU the figures mean nothing).
"""

from __future__ import annotations

import jax

from benchmarks import _cli
from benchmarks.timing import (copy_summary, matmul_summary, measure_copy_bandwidth,
                               measure_matmul_peak, measure_read_bandwidth, read_summary)


def main(argv=None) -> int:
    p = _cli.parser("benchmarks.ceilings", __doc__, shapes=False)
    p.add_argument("--gib", type=float, default=4.0, help="the buffer copied and read, GiB")
    args = p.parse_args(argv)
    if not args.gib > 0:
        p.error(f"--gib must be positive, got {args.gib}")
    s, interpret = _cli.settings(args.smoke)
    nbytes = 1 << 20 if args.smoke else int(args.gib * 2**30)
    doc = _cli.run_record("benchmarks.ceilings", argv, s, interpret)
    print(f"{doc['device']['kind']}, jax {jax.__version__}; buffers of {nbytes / 2**30:.3f} GiB",
          flush=True)
    doc["copy"] = measure_copy_bandwidth(nbytes, s)
    print(f"copy bandwidth (read + written): {copy_summary(doc['copy'])}", flush=True)
    doc["read"] = measure_read_bandwidth(nbytes, s)
    print(f"read rate: {read_summary(doc['read'])}; {doc['read']['tbps'] / doc['copy']['tbps']:.3f}"
          " of the copy", flush=True)
    doc["matmul"] = measure_matmul_peak(s, **({"n": _cli.SMOKE_MATMUL_N} if args.smoke else {}))
    print(f"bf16 matmul {doc['matmul']['n']}^3: {matmul_summary(doc['matmul'])}", flush=True)
    _cli.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The device's copy bandwidth alone, every way `benchmarks.timing.measure_copy_bandwidth` measures
it: the ceiling every benchmark figure is a fraction of, and each way's rate and windows' spread.

    PYTHONPATH=. python3 -m benchmarks.copy_bandwidth [--gib 4] [--read] [--json FILE]
    for i in 1 2 3 4; do PYTHONPATH=. python3 -m benchmarks.copy_bandwidth --json c$i.json; done

One process measures once; run it in several processes to see how the ways move between them
(the ceiling's spread across processes is what the bars' verdicts inherit). ``--smoke``: a 1 MiB
copy with minimal timing (on a CPU its figures mean nothing). ``--read``: the streaming read
rate too (`timing.measure_read_bandwidth`, a sum of the same bytes), and its ratio to the copy:
how far above 1.0 of the copy a kernel that only reads can go on this device.
"""

from __future__ import annotations

import argparse

from benchmarks.bench import Settings, smoke_settings, write_tool_json
from benchmarks.timing import (copy_summary, measure_copy_bandwidth,
                               measure_read_bandwidth, read_summary)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="the buffer copied, GiB (default 4)")
    parser.add_argument("--json", help="write the measurement (every way's windows) here")
    parser.add_argument("--read", action="store_true",
                        help="the streaming read rate too, and its ratio to the copy")
    parser.add_argument("--smoke", action="store_true", help="1 MiB, minimal timing")
    args = parser.parse_args(argv)
    if args.gib <= 0:
        parser.error(f"--gib must be positive, got {args.gib}")
    s = smoke_settings(Settings()) if args.smoke else Settings()
    nbytes = 1 << 20 if args.smoke else int(args.gib * 2**30)
    copy = measure_copy_bandwidth(nbytes, s)
    print(f"copy bandwidth over {nbytes / 2**30:.3f} GiB: {copy_summary(copy)}", flush=True)
    fields = {}
    if args.read:
        read = measure_read_bandwidth(nbytes, s)
        print(f"read rate over {nbytes / 2**30:.3f} GiB: {read_summary(read)}; "
              f"{read['tbps'] / copy['tbps']:.3f} of the copy", flush=True)
        fields["read"] = read
    write_tool_json(args.json, copy, **fields)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

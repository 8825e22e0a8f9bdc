"""``python -m parity``: run the parity sweep and report; exit 1 on any mismatch, 2 on bad usage.

Examples::

    python -m parity                          # the default suite on the default device
    python -m parity --device cpu -k gqa4     # cases whose name contains "gqa4", on the CPU
    python -m parity --full --json report.json
    python -m parity --dtype bf16 --impl pallas --seed 7
    python -m parity --list                   # the case names, nothing run
    python -m parity --full --shard 0/4       # every 4th case from the first (4 processes
                                              # with 0/4 .. 3/4 cover the suite once)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

# `python -m parity` runs parity/__init__.py first, which keeps JAX from preallocating the GPU.

DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "f16": "float16", "half": "float16", "fp8": "float8_e4m3fn",
                 "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}
EXIT_MISMATCH = 1
EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m parity",
        description="Run write-then-decode parity cases through torch_ref and pallas_paged's"
                    " JAX implementations and judge every output (writes bit-exact; decode within"
                    " FlashAttention's tolerance rule against a float64 truth, finite, within k"
                    " ulps of torch_ref and without systematic bias).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where torch and JAX run (default: cuda when both torch and JAX see a"
                             " GPU, else cpu; on cpu the Pallas kernel runs in interpret mode)")
    parser.add_argument("--dtype", action="append", default=None, metavar="DTYPE",
                        help="only cases with this cache dtype (float32, bfloat16, float16,"
                             " float8_e4m3fn or fp32/bf16/fp16/fp8); repeatable")
    parser.add_argument("--impl", action="append", default=None, choices=("xla", "pallas", "mosaic"),
                        help="JAX implementation(s) to check (default: xla and pallas; mosaic runs the"
                             " decode cases its kernel takes, jax >= 0.11.2); torch_ref always"
                             " runs")
    parser.add_argument("--seed", type=int, default=None,
                        help="replace every case's seed with this one")
    parser.add_argument("--full", action="store_true",
                        help="the full suite (GPU-sized shapes; far too slow on a CPU)")
    parser.add_argument("-k", action="append", default=None, metavar="SUBSTRING", dest="keyword",
                        help="only cases whose name contains SUBSTRING; repeatable (any matches)")
    parser.add_argument("--shard", default=None, metavar="I/N", type=parse_shard,
                        help="only the selected cases i, i + N, i + 2N, ... (0 <= I < N): N"
                             " processes with I = 0 .. N-1 run the selection once, in parallel")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here")
    parser.add_argument("--interpret", action=argparse.BooleanOptionalAction, default=None,
                        help="force Pallas interpret mode on or off (default: on exactly for cpu)")
    parser.add_argument("--list", action="store_true",
                        help="print the selected case names and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; argparse reports anything else as a usage
    error."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r} must be I/N, e.g. 0/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text!r} needs 0 <= I < N")
    return index, count


def select_cases(cases, *, dtypes=None, keywords=None, seed=None):
    """The cases matching every filter, in suite order, with the seed replaced if given."""
    from parity.cases import DTYPES

    if dtypes:
        dtypes = [DTYPE_ALIASES.get(d.lower(), d.lower()) for d in dtypes]
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"unknown --dtype {unknown}: choose from {list(DTYPES)} or"
                             f" {sorted(DTYPE_ALIASES)}")
        cases = [c for c in cases if c.dtype in dtypes]
    if keywords:
        cases = [c for c in cases if any(k in c.name for k in keywords)]
    if seed is not None:
        cases = [dataclasses.replace(c, seed=seed) for c in cases]
    return list(cases)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)

    from parity import cases as cases_mod

    suite_name = "full" if args.full else "default"
    try:
        selected = select_cases(cases_mod.suite(suite_name), dtypes=args.dtype,
                                keywords=args.keyword, seed=args.seed)
    except ValueError as exc:
        print(f"python -m parity: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.shard is not None:
        index, count = args.shard
        selected = selected[index::count]
    if not selected:
        print(f"python -m parity: error: no {suite_name}-suite case matches the filters"
              f" (--dtype {args.dtype}, -k {args.keyword})", file=sys.stderr)
        return EXIT_USAGE
    if args.list:
        for case in selected:
            print(case.name)
        return 0

    from parity import convert, report
    from parity.compare import IMPLS, mosaic_refusal, run_suite

    device = args.device or convert.default_device()
    try:
        convert.check_device(device)
    except ValueError as exc:
        print(f"python -m parity: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    impls = tuple(dict.fromkeys(args.impl)) if args.impl else IMPLS
    interpret = (device == "cpu") if args.interpret is None else args.interpret
    case_impls = {c.name: impls for c in selected}
    if "mosaic" in impls:  # the Mosaic kernel runs the cases it takes; the others are named
        refused = {c.name: mosaic_refusal(c) for c in selected}
        for name, why in refused.items():
            if why is not None:
                print(f"parity: {name} left out for impl=mosaic: {why}", file=sys.stderr)
                case_impls[name] = tuple(i for i in impls if i != "mosaic")
        selected = [c for c in selected if case_impls[c.name]]  # the other impls keep every case
        if not selected:
            print("python -m parity: error: impl=mosaic takes none of the selected cases",
                  file=sys.stderr)
            return EXIT_USAGE

    print(f"parity: {len(selected)} {suite_name}-suite case(s) on {device}"
          f" (torch, {', '.join(impls)}; Pallas interpret mode {'on' if interpret else 'off'})",
          file=sys.stderr, flush=True)

    def progress(i, total, result, seconds):
        if not args.quiet:
            print(report.progress_line(i, total, result, seconds), file=sys.stderr, flush=True)

    suite = run_suite(selected, device=device, impls=impls, interpret=interpret, progress=progress,
                      impls_of=lambda case: case_impls[case.name])
    print(report.format_table(suite.results))
    failures = report.failure_lines(suite.results)
    if failures:
        print()
        print("\n".join(failures))
    print()
    print(report.summary_line(suite))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json(suite, suite_name=suite_name,
                                   argv=sys.argv[1:] if argv is None else list(argv)))
            f.write("\n")
        print(f"JSON report: {args.json}")
    return 0 if suite.passed else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())

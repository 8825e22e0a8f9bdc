"""``python -m parity``: run the parity sweep and report.

Exit status: 0 when every check passes, 1 on any mismatch, 2 on a usage error (a bad flag or
value, no matching case, a device, interpret mode or implementation this machine cannot run), and
141 (128 + SIGPIPE, what a shell reports for a tool a closed pipe stopped) when a write finds the
pipe closed by its reader (``python -m parity --full --list | head``): the run ends there, without
a traceback.

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
import os
import signal
import sys
from pathlib import Path

# `python -m parity` runs parity/__init__.py first, which keeps JAX from preallocating the GPU.

DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "f16": "float16", "half": "float16", "fp8": "float8_e4m3fn",
                 "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn"}
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE


class UsageError(ValueError):
    """A flag this machine or these cases cannot honour; the CLI exits with `EXIT_USAGE`."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m parity",
        description="Run write-then-decode parity cases through torch_ref and pallas_paged's"
                    " JAX implementations and judge every output (writes bit-exact; decode within"
                    " FlashAttention's tolerance rule against a float64 truth, finite, within k"
                    " ulps of torch_ref and without systematic bias).",
        epilog="Exit status: 0 all passed, 1 a mismatch, 2 a usage error, 141 a write found the"
               " pipe closed by its reader (e.g. | head).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where torch and JAX run (default: cuda when both torch and JAX see a"
                             " GPU, else cpu; on cpu the Pallas kernel runs in interpret mode)")
    parser.add_argument("--dtype", action="append", default=None, metavar="DTYPE",
                        help="only cases with this cache dtype (float32, bfloat16, float16,"
                             " float8_e4m3fn or fp32/bf16/fp16/fp8); repeatable")
    parser.add_argument("--impl", action="append", default=None,
                        choices=("xla", "pallas", "mosaic"),
                        help="JAX implementation(s) to check (default: xla and pallas; mosaic runs"
                             " the cases its kernels take, jax >= 0.11.2); torch_ref"
                             " always runs")
    parser.add_argument("--seed", type=parse_seed, default=None,
                        help="replace every case's seed with this one (an integer >= 0)")
    parser.add_argument("--full", action="store_true",
                        help="the full suite (GPU-sized shapes; far too slow on a CPU)")
    parser.add_argument("-k", action="append", default=None, metavar="SUBSTRING", dest="keyword",
                        help="only cases whose name contains SUBSTRING; repeatable (any matches)")
    parser.add_argument("--shard", default=None, metavar="I/N", type=parse_shard,
                        help="only the selected cases i, i + N, i + 2N, ... (0 <= I < N): N"
                             " processes with I = 0 .. N-1 run the selection once, in parallel")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the JSON report here")
    parser.add_argument("--interpret", action=argparse.BooleanOptionalAction, default=None,
                        help="force Pallas interpret mode on or off (default: on exactly for cpu;"
                             " --no-interpret needs a GPU)")
    parser.add_argument("--list", action="store_true",
                        help="print the selected case names and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def parse_seed(text: str) -> int:
    """``--seed``: an integer >= 0 (what ``np.random.default_rng`` takes)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"{seed} is negative: a seed is an integer >= 0")
    return seed


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; argparse reports anything else as a usage
    error."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N, e.g. 0/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"{text!r} needs 0 <= I < N")
    return index, count


def select_cases(cases, *, dtypes=None, keywords=None, seed=None):
    """The cases matching every filter, in suite order, with the seed replaced if given."""
    from parity.cases import DTYPES

    if dtypes:
        dtypes = [DTYPE_ALIASES.get(d.lower(), d.lower()) for d in dtypes]
        unknown = [d for d in dtypes if d not in DTYPES]
        if unknown:
            raise UsageError(f"unknown --dtype {unknown}: choose from {list(DTYPES)} or"
                             f" {sorted(DTYPE_ALIASES)}")
        cases = [c for c in cases if c.dtype in dtypes]
    if keywords:
        cases = [c for c in cases if any(k in c.name for k in keywords)]
    if seed is not None:
        cases = [dataclasses.replace(c, seed=seed) for c in cases]
    return list(cases)


def check_json_path(path: str) -> None:
    """UsageError unless the JSON report can be written to ``path``: checked before the sweep, so
    that a typo does not cost a whole run."""
    parent = Path(path).parent
    if Path(path).is_dir():
        raise UsageError(f"--json {path}: is a directory, not a file")
    if not parent.is_dir():
        raise UsageError(f"--json {path}: no directory {str(parent)!r} to write it in")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--json {path}: directory {str(parent)!r} is not writable")


def resolve_device(requested: str | None, interpret: bool | None) -> tuple[str, bool]:
    """``(device, interpret)`` from ``--device`` and ``--interpret/--no-interpret``.

    The device defaults to cuda when torch and JAX both see a GPU, else cpu; interpret mode to on
    exactly for cpu. A device this machine lacks, or ``--no-interpret`` (the compiled Pallas
    kernels) on the CPU, is a UsageError: on the CPU the kernels run only in interpret mode.
    """
    from parity import convert

    device = requested or convert.default_device()
    torch_gpu, jax_gpu = convert.gpu_visible()
    seen = f"torch sees one: {torch_gpu}, JAX sees one: {jax_gpu}"
    if device == "cuda" and not (torch_gpu and jax_gpu):
        raise UsageError(f"--device cuda needs a GPU visible to torch and JAX; {seen}")
    if interpret is False and device == "cpu":
        if requested == "cpu":
            raise UsageError("--no-interpret needs a GPU, and --device cpu runs the Pallas kernels"
                             " on the CPU, where they run in interpret mode only: drop"
                             " --no-interpret or pass --device cuda")
        raise UsageError("--no-interpret needs a GPU: the Pallas kernels compile only for one (on"
                         " the CPU they run in interpret mode), and torch and JAX do not both see"
                         f" one here ({seen})")
    return device, (device == "cpu") if interpret is None else interpret


def mosaic_unavailable(interpret: bool) -> str | None:
    """Why ``impl="mosaic"`` cannot run any case on this machine (a jax without the kernel's
    API; compiled, a device that is no Hopper GPU), or None."""
    from pallas_paged.decode_attention import mosaic_gpu

    try:
        mosaic_gpu.check_jax()
        mosaic_gpu.check_device(interpret)
    except ValueError as exc:
        return str(exc)
    return None


def impls_per_case(selected, impls: tuple[str, ...], interpret: bool) -> dict[str, tuple]:
    """The implementations each case runs: ``impls``, less ``mosaic`` where its kernel refuses
    the case (each named on stderr); a UsageError when mosaic is the only one and takes none."""
    from parity.compare import mosaic_refusal

    case_impls = {c.name: impls for c in selected}
    if "mosaic" not in impls:
        return case_impls
    anywhere = mosaic_unavailable(interpret)
    if anywhere is not None and impls == ("mosaic",):
        raise UsageError(f"--impl mosaic cannot run here, so impl=mosaic takes none of the"
                         f" selected cases: {anywhere}")
    for case in selected:
        why = anywhere or mosaic_refusal(case, interpret)
        if why is not None:
            print(f"parity: {case.name} left out for impl=mosaic: {why}", file=sys.stderr)
            case_impls[case.name] = tuple(i for i in impls if i != "mosaic")
    if not any(case_impls.values()):
        raise UsageError("impl=mosaic takes none of the selected cases")
    return case_impls


def main(argv: list[str] | None = None) -> int:
    """The CLI: the exit status of the run ``argv`` asks for (`run`), or `EXIT_USAGE` with the
    error on stderr."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return run(args, argv)
    except UsageError as exc:
        print(f"python -m parity: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The sweep the parsed flags ask for: the exit status, or a UsageError."""
    from parity import cases as cases_mod

    suite_name = "full" if args.full else "default"
    selected = select_cases(cases_mod.suite(suite_name), dtypes=args.dtype,
                            keywords=args.keyword, seed=args.seed)
    if args.shard is not None:
        index, count = args.shard
        selected = selected[index::count]
    if not selected:
        shard = "" if args.shard is None else f", --shard {'/'.join(map(str, args.shard))}"
        raise UsageError(f"no {suite_name}-suite case matches the filters (--dtype {args.dtype},"
                         f" -k {args.keyword}{shard})")
    if args.list:
        for case in selected:
            print(case.name)
        return 0

    from parity import report
    from parity.compare import IMPLS, run_suite

    if args.json:
        check_json_path(args.json)
    device, interpret = resolve_device(args.device, args.interpret)
    impls = tuple(dict.fromkeys(args.impl)) if args.impl else IMPLS
    case_impls = impls_per_case(selected, impls, interpret)
    selected = [c for c in selected if case_impls[c.name]]
    print(f"parity: {len(selected)} {suite_name}-suite case(s) on {device}"
          f" (torch, {', '.join(impls)}; Pallas interpret mode {'on' if interpret else 'off'})",
          file=sys.stderr, flush=True)

    def progress(i, total, result, _seconds):
        if not args.quiet:
            print(report.progress_line(i, total, result), file=sys.stderr, flush=True)

    suite = run_suite(selected, device=device, impls=impls, interpret=interpret, progress=progress,
                      impls_of=lambda case: case_impls[case.name])
    if args.json:  # first: the report survives a reader that closes the pipe on the table
        Path(args.json).write_text(report.to_json(
            suite, suite_name=suite_name, argv=sys.argv[1:] if argv is None else list(argv))
            + "\n")
    print(report.format_table(suite.results))
    failures = report.failure_lines(suite.results)
    if failures:
        print()
        print("\n".join(failures))
    print()
    print("\n".join(report.summary_lines(suite)))
    if args.json:
        print(f"JSON report: {args.json}")
    return 0 if suite.passed else EXIT_MISMATCH


def shell_main() -> int:
    """`main` for ``python -m parity``: when the output's reader goes away (``| head``), the run
    stops at that write and exits with `EXIT_CLOSED_PIPE`, without a traceback."""
    try:
        status = main()
        sys.stdout.flush()  # inside the try: a closed pipe found at exit is caught here too
        return status
    except BrokenPipeError:
        # Python flushes the standard streams again at exit: let those writes go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
        return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(shell_main())

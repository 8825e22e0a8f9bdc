"""The decode bars of issue "Decode at the limit", judged over several `benchmarks.bench` processes.

One run of ``bench`` meets or misses a bar that sits inside the spread of runs: the same config
on the same H200 measured 2-4% apart from one process to the next (docs/BENCHMARKS.md), while
the windows inside one process agree to about 1%. This script runs ``bench --impls pallas`` on
the bars' shapes in ``--runs`` separate processes (every other one in reverse shape order, so
that no shape always runs first or last), samples the GPU's clocks, power and temperatures
beside them (``nvidia-smi``, when present), and prints per shape every run's fraction of its
own run's copy bandwidth, their median and range, and the verdict: a bar is **met** when the
median of the runs meets it, **met in every run** when their minimum does. Beside the fractions
it gives each shape's median kernel time over the runs, and above them the GPU's identity
(``nvidia-smi``'s name, UUID, serial, PCI bus and driver): hosts of one device kind differ by
several percent on the same kernel, so a verdict names the card it was measured on. The bars
are fractions that peers reached on an NVIDIA H200 (`BARS_DEVICE`): on any other GPU (or where
the GPU is unknown) the table is printed under a line saying it is not a verdict, and
``--require-bars-device`` stops before running anything there (exit status 3), so a script
that may be handed another device kind spends no time on it.

    PYTHONPATH=. python3 -m benchmarks.bars --runs 3 --out DIR      # GPU: run, then judge
    python3 -m benchmarks.bars --from DIR                           # judge the JSONs of DIR again

``DIR`` gets ``bench_<i>.json`` / ``bench_<i>.txt`` per process, ``smi.csv``, ``gpu.txt``
(the identity) and ``bars.json`` (the summary). ``--bench-args`` passes extra arguments to every
``bench`` process (e.g. ``--smoke`` to check the plumbing on a CPU, whose shapes have no bar).
``bars.json`` also says whether the run's GPU is the bars' device (``on_bars_device``: true,
false, or null where no identity was recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys

from benchmarks.bench import float_at_least, int_at_least
from benchmarks.timing import COPY_WAYS

# shape name -> (the bar: the Triton kernel's decode bytes over the run's copy bandwidth, what
# it comes from). fp8 shapes count fp8 bytes (`benchmarks.bench`'s bytes are the cache dtype's).
BARS: dict[str, tuple[float, str]] = {
    "b1_ctx32768": (0.80, "above FlashInfer's 0.74"),
    "b32_ctx4096": (0.97, "FlashInfer"),
    "b128_ctx1024": (0.90, "FlashInfer"),
    "b256_ctx512": (0.88, "FlashInfer"),
    "mha_b32_ctx4096": (1.03, "FlashInfer"),
    "fp8_b32_ctx4096": (0.85, "fp8 bytes"),
    "fp8_b8_ctx16384": (0.85, "fp8 bytes"),
}

# The device of the peer table, where the bars were measured: nvidia-smi's name of the GPU.
BARS_DEVICE = "NVIDIA H200"
# `main`'s exit status when ``--require-bars-device`` finds another GPU and runs nothing.
EXIT_NOT_BARS_DEVICE = 3

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMI_FIELDS = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,temperature.memory,"
              "clocks_event_reasons.active")
GPU_IDENTITY_FIELDS = "name,uuid,serial,pci.bus_id,driver_version"


def run_order(shapes: list[str], run: int) -> list[str]:
    """Run ``run``'s shape order (0-based): the list, reversed in every odd run."""
    return list(reversed(shapes)) if run % 2 else list(shapes)


def bench_command(shapes: list[str], json_path: str, extra: list[str]) -> list[str]:
    """The ``bench`` process of one run."""
    return [sys.executable, "-m", "benchmarks.bench", "--impls", "pallas", "--shapes",
            ",".join(shapes), "--json", json_path, *extra]


def pallas_row(doc: dict, shape: str) -> dict | None:
    """The ``impl="pallas"`` row of ``shape`` in one ``bench`` JSON that has a fraction of copy
    bandwidth, or None where the shape is absent, errored, or its output was WRONG."""
    for record in doc.get("shapes", []):
        if record.get("name") != shape:
            continue
        for row in record.get("results", []):
            if (row.get("impl") == "pallas" and row.get("status") == "ok"
                    and row.get("correct", True) and "frac_copy_bw" in row):
                return row
    return None


def judge(docs: list[dict], shapes: list[str]) -> list[dict]:
    """Per shape: every run's fraction and kernel time (None where the run has none), the
    fractions' median, min and max over the runs that have one, the times' median, the bar and
    the verdicts."""
    rows = []
    for shape in shapes:
        found = [pallas_row(doc, shape) for doc in docs]
        runs = [None if r is None else float(r["frac_copy_bw"]) for r in found]
        times = [None if r is None or "median_us" not in r else float(r["median_us"])
                 for r in found]
        have = [f for f in runs if f is not None]
        have_us = [t for t in times if t is not None]
        bar, source = BARS.get(shape, (None, ""))
        row = {"shape": shape, "runs": runs, "us": times, "bar": bar, "bar_source": source,
               "median": statistics.median(have) if have else None,
               "min": min(have) if have else None, "max": max(have) if have else None,
               "median_us": statistics.median(have_us) if have_us else None}
        if bar is None or not have:
            row["verdict"] = "no bar" if bar is None else "not measured"
        elif row["min"] >= bar:
            row["verdict"] = "met in every run"
        elif row["median"] >= bar:
            row["verdict"] = "met (median)"
        else:
            row["verdict"] = "missed (median)"
        rows.append(row)
    return rows


def copy_rates(docs: list[dict]) -> list[float | None]:
    """Each run's copy bandwidth (TB/s), the ceiling of its fractions."""
    return [doc.get("copy_bandwidth", {}).get("tbps") for doc in docs]


def imprecise_runs(docs: list[dict]) -> list[bool]:
    """Per run, whether its ceiling came from no precise way (`benchmarks.timing.copy_ceiling`'s
    ``imprecise``): its fractions are then not to be judged by."""
    return [bool(doc.get("copy_bandwidth", {}).get("start", {}).get("imprecise")) for doc in docs]


def copy_ways(docs: list[dict]) -> dict[str, list[dict | None]]:
    """Each way's copy measurement per run at the run's start, ``{"tbps", "spread"}`` (the
    windows' ``(max - min) / median``; None where unknown), or None where the run has none; only
    the ways some run measured. The ceiling is the largest rate of the ways whose spread is
    within `benchmarks.timing.COPY_SPREAD_LIMIT`."""
    ways = {}
    for way in COPY_WAYS:
        measured = [doc.get("copy_bandwidth", {}).get("start", {}).get(way, {}) for doc in docs]
        cells = [{"tbps": m["tbps"], "spread": m.get("spread")} if "tbps" in m else None
                 for m in measured]
        if any(cells):
            ways[way] = cells
    return ways


def format_table(rows: list[dict], copies: list, ways: dict | None = None,
                 imprecise: list | None = None) -> str:
    """The verdicts as a Markdown table: the ceiling per run (marked where ``imprecise``; and,
    given ``ways``, each way's rate with its windows' spread), then every shape's runs, median,
    range, median kernel time, bar, verdict."""
    def f(x):
        return "-" if x is None else f"{x:.3f}"

    def ceiling_cell(i, c):
        return f(c) + (" (imprecise)" if imprecise and imprecise[i] else "")

    def way_cell(cell):
        if cell is None:
            return "-"
        spread = "" if cell["spread"] is None else f" ({100 * cell['spread']:.1f}%)"
        return f(cell["tbps"]) + spread
    n = max((len(r["runs"]) for r in rows), default=0)
    head = ("| shape | " + " | ".join(f"run {i + 1}" for i in range(n))
            + " | median | range | µs (median) | bar | verdict |")
    lines = [head, "|---|" + "---:|" * (n + 4) + "---|"]
    lines.append("| copy TB/s | " + " | ".join(ceiling_cell(i, c) for i, c in enumerate(copies))
                 + " | | | | | |")
    for way, cells in (ways or {}).items():
        lines.append(f"| copy TB/s, {way} (spread) | " + " | ".join(way_cell(c) for c in cells)
                     + " | | | | | |")
    for r in rows:
        spread = "-" if r["min"] is None else f"{r['min']:.3f}-{r['max']:.3f}"
        us = "-" if r.get("median_us") is None else f"{r['median_us']:.1f}"
        lines.append(f"| `{r['shape']}` | " + " | ".join(f(x) for x in r["runs"])
                     + f" | {f(r['median'])} | {spread} | {us} | {f(r['bar'])} | {r['verdict']} |")
    return "\n".join(lines)


def gpu_identity() -> str | None:
    """This machine's GPUs as ``nvidia-smi`` names them (name, UUID, serial, PCI bus, driver; one
    line per GPU), or None where there is no ``nvidia-smi`` or it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_IDENTITY_FIELDS}",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def read_gpu_identity(directory: str) -> str | None:
    """The identity a run of ``directory`` recorded in ``gpu.txt``, or None where it has none."""
    try:
        with open(os.path.join(directory, "gpu.txt")) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def gpu_names(identity: str | None) -> list[str]:
    """The GPU names of ``identity`` (`gpu_identity`'s lines, name first), one per GPU."""
    return [line.split(",")[0].strip() for line in (identity or "").splitlines() if line.strip()]


def on_bars_device(identity: str | None) -> bool | None:
    """Whether every GPU of ``identity`` is named exactly `BARS_DEVICE` (another model, e.g. an
    "NVIDIA H200 NVL", has its own clocks and no `TUNED` entry); None where there is no
    identity."""
    names = gpu_names(identity)
    return all(n == BARS_DEVICE for n in names) if names else None


def device_line(identity: str | None) -> str:
    """The line above the table: whether its met and missed are a verdict on the bars."""
    where = (gpu_names(identity) or ["unknown"])[0]
    if on_bars_device(identity):
        return f"Verdict: the bars were measured on an {BARS_DEVICE}, and so was this run."
    return (f"Not a verdict: the bars are fractions peers reached on an {BARS_DEVICE}; this "
            f"run's GPU is {where}.")


def load_runs(directory: str) -> list[dict]:
    """The ``bench_<i>.json`` documents of ``directory``, in run order (a run whose process
    wrote no JSON counts as an empty document)."""
    names = sorted((n for n in os.listdir(directory)
                    if n.startswith("bench_") and n.endswith(".json")),
                   key=lambda n: int(n[len("bench_"):-len(".json")]))
    docs = []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as fh:
                docs.append(json.load(fh))
        except (OSError, json.JSONDecodeError):
            docs.append({})
    return docs


def run(out: str, runs: int, shapes: list[str], extra: list[str], timeout_s: float,
        identity: str | None) -> None:
    """``runs`` ``bench`` processes one after another, ``nvidia-smi`` sampling beside them;
    ``identity`` (`gpu_identity`) is recorded in ``gpu.txt``."""
    os.makedirs(out, exist_ok=True)
    gpu_path = os.path.join(out, "gpu.txt")
    if identity is not None:
        with open(gpu_path, "w") as fh:
            fh.write(identity + "\n")
    elif os.path.exists(gpu_path):
        os.remove(gpu_path)
    smi = smi_log = None
    if shutil.which("nvidia-smi"):
        smi_log = open(os.path.join(out, "smi.csv"), "w")
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv",
                                "-lms", "250"], stdout=smi_log, stderr=subprocess.STDOUT)
    try:
        for i in range(runs):
            json_path = os.path.abspath(os.path.join(out, f"bench_{i + 1}.json"))
            if os.path.exists(json_path):
                os.remove(json_path)
            cmd = bench_command(run_order(shapes, i), json_path, extra)
            print(f"run {i + 1}/{runs}: {shlex.join(cmd[1:])}", flush=True)
            with open(os.path.join(out, f"bench_{i + 1}.txt"), "w") as log:
                try:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=timeout_s, cwd=REPO_ROOT).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"run {i + 1}/{runs}: exit {rc}", flush=True)
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait()
            smi_log.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int_at_least(1), default=3, help="bench processes (3)")
    p.add_argument("--out", default=None, help="directory of the runs' logs and JSONs")
    p.add_argument("--from", dest="from_dir", default=None,
                   help="judge the bench_<i>.json of this directory; run nothing")
    p.add_argument("--shapes", default=",".join(BARS), help="comma-separated (the bars' shapes)")
    p.add_argument("--bench-args", default="", help="extra arguments of every bench process")
    p.add_argument("--timeout", type=float_at_least(0.0, strict=True), default=300.0,
                   help="seconds per bench process")
    p.add_argument("--require-bars-device", action="store_true",
                   help=f"run only on an {BARS_DEVICE} (the bars' device); on any other GPU, or "
                        f"none, print why and exit {EXIT_NOT_BARS_DEVICE} having run nothing")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if args.from_dir is None and args.out is None:
        p.error("give --out DIR (run, then judge) or --from DIR (judge only)")
    if args.require_bars_device and args.from_dir is not None:
        p.error("--require-bars-device applies to a run (--out), not to --from")
    directory = args.from_dir or args.out
    if args.from_dir is None:
        identity = gpu_identity()
        if args.require_bars_device and not on_bars_device(identity):
            print(f"{device_line(identity)} Nothing was run (--require-bars-device).")
            return EXIT_NOT_BARS_DEVICE
        run(args.out, args.runs, shapes, shlex.split(args.bench_args), args.timeout, identity)
    docs = load_runs(directory)
    if not docs:
        print(f"no bench_<i>.json in {directory}", file=sys.stderr)
        return 1
    rows = judge(docs, shapes)
    table = format_table(rows, copy_rates(docs), copy_ways(docs), imprecise_runs(docs))
    gpu = read_gpu_identity(directory)
    print(f"GPU: {gpu or 'unknown (no nvidia-smi)'}")
    print(device_line(gpu))
    print(table)
    with open(os.path.join(directory, "bars.json"), "w") as fh:
        json.dump({"gpu": gpu, "bars_device": BARS_DEVICE, "on_bars_device": on_bars_device(gpu),
                   "rows": rows, "copy_tbps": copy_rates(docs),
                   "copy_ways": copy_ways(docs), "copy_imprecise": imprecise_runs(docs),
                   "table": table.splitlines()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

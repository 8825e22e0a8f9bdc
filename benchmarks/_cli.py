"""What the benchmark commands share: their command line, the run's record and ceilings, the check
of a row before it is timed, the printed table, the JSON file, the exit status, config labels.

A row is a dict: ``shape``, ``impl``, ``config`` (its label), ``status`` (``"ok"``; ``"WRONG"``:
checked and wrong, never timed; ``"error"``: it raised; ``"skipped"``: not run here, with a
``reason``), the check's ``rel_err`` / ``max_abs_err`` / ``nan`` / ``correct``, `measure`'s
``median_us`` (the steady time of one operation), ``min_us``, ``max_us``, ``windows_us``,
``batch_median_us``, ``ops_per_call``, and the command's own figures.
"""

from __future__ import annotations

import parity  # noqa: F401  (first: JAX must not take most of a GPU that torch shares)

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import (SMOKE_TIMER, TimerSettings, copy_summary, describe_error, jsonable,
                               matmul_summary, measure, measure_copy_bandwidth,
                               measure_matmul_peak)
from pallas_paged import AttentionConfig, DecodeConfig, MosaicDecodeConfig
from pallas_paged._platform import device_kind, has_gpu, sm_count
from pallas_paged.ragged_attention.mosaic_gpu_config import MosaicAttentionConfig

REL_TOL = 2e-2              # relative L2 error above which an output is WRONG (bf16: ~4e-3)
COPY_BYTES = 4 * 2**30      # the copy ceiling's buffer
SMOKE_COPY_BYTES = 16 * 2**20
SMOKE_MATMUL_N = 256


def parser(prog: str, doc: str, *, shapes: bool = True) -> argparse.ArgumentParser:
    """A command's parser: its docstring's first paragraph, ``--json`` and ``--smoke`` (and
    ``--shapes``)."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    if shapes:
        p.add_argument("--shapes", default="all",
                       help="comma-separated shape names, or 'all' (the smoke shapes with --smoke)")
    p.add_argument("--json", default=None, help="write the run's record and rows here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, minimal timing, interpret mode without a GPU: the plumbing"
                        " end to end (the numbers mean nothing)")
    return p


def pick_shapes(p: argparse.ArgumentParser, spec: str, shapes, smoke_shapes, smoke: bool) -> list:
    """The shapes ``--shapes`` names (``all``: ``shapes``, or ``smoke_shapes`` with ``--smoke``);
    an unknown name is a usage error (exit 2)."""
    if spec in (None, "", "all"):
        return list(smoke_shapes if smoke else shapes)
    known = {shape.name: shape for shape in tuple(shapes) + tuple(smoke_shapes)}
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        p.error(f"--shapes: unknown {unknown or spec!r}; known: {', '.join(known)}")
    return [known[name] for name in dict.fromkeys(names)]


def pick_impls(p: argparse.ArgumentParser, spec: str, impls: tuple) -> list:
    """The implementations ``--impls`` names, among ``impls``; else a usage error."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in impls]
    if unknown or not names:
        p.error(f"--impls {spec!r}: choose among {','.join(impls)}")
    return list(dict.fromkeys(names))


def settings(smoke: bool) -> tuple[TimerSettings, bool]:
    """``(timer settings, interpret)``: `SMOKE_TIMER` with ``--smoke``; Pallas interpret mode
    exactly where JAX has no GPU."""
    return (SMOKE_TIMER if smoke else TimerSettings()), not has_gpu()


def run_record(prog: str, argv, s: TimerSettings, interpret: bool) -> dict:
    """What a run's JSON starts with: the command, the date, the device, the versions."""
    device = jax.devices()[0]
    versions = {"python": sys.version.split()[0], "jax": jax.__version__}
    for dist in ("jaxlib", "triton", "torch", "numpy", "jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"command": prog, "argv": list(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": {"kind": device.device_kind, "platform": device.platform,
                       "count": jax.device_count(), "sm_count": sm_count()},
            "versions": versions, "timer": dataclasses.asdict(s), "interpret": interpret}


def ceilings(s: TimerSettings, smoke: bool, *, matmul: bool = False) -> dict:
    """The ceilings the run's figures divide by, measured now and printed: ``copy`` (its
    ``tbps``: `measure_copy_bandwidth` over 4 GiB) and, with ``matmul``, ``matmul`` (its
    ``tflops``: `measure_matmul_peak`, torch's cuBLAS rate where torch sees a GPU)."""
    copy = measure_copy_bandwidth(SMOKE_COPY_BYTES if smoke else COPY_BYTES, s)
    print(f"copy bandwidth (read + written): {copy_summary(copy)}", flush=True)
    out = {"copy": copy, "tbps": copy["tbps"]}
    if matmul:
        peak = measure_matmul_peak(s, **({"n": SMOKE_MATMUL_N} if smoke else {}))
        print(f"bf16 matmul {peak['n']}^3: {matmul_summary(peak)}", flush=True)
        out.update(matmul=peak, tflops=peak["tflops"])
    return out


def compare(out, ref) -> dict:
    """Max abs and relative L2 error of ``out`` against ``ref`` (float32 on the host); correct:
    no NaN and a relative error within `REL_TOL`."""
    o = np.asarray(out).astype(np.float32)
    r = np.asarray(ref).astype(np.float32)
    finite = bool(np.isfinite(o).all())
    diff = np.nan_to_num(np.abs(o - r), nan=np.inf)
    rel = float(np.linalg.norm(np.nan_to_num(o - r, nan=np.inf))) / max(
        float(np.linalg.norm(r)), 1e-30)
    return {"rel_err": rel, "max_abs_err": float(diff.max()) if diff.size else 0.0,
            "nan": not finite, "correct": finite and rel <= REL_TOL}


def checked_timing(fn, args: tuple, ops: int, s: TimerSettings, reference=None) -> dict:
    """One row's measured fields: ``fn`` (jitted) compiled for ``args`` outside the clock, run
    once and, given ``reference = (rows, values)``, its last output's ``rows`` compared with
    ``values`` (`compare`; ``fn`` returns one output or a tuple of them, as loop mode does);
    only a correct variant is then timed (`measure`, ``ops`` operations per call). Never
    raises: ``status`` says what happened."""
    row = {}
    try:
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 3)
        out = jax.block_until_ready(compiled(*args))
        if reference is not None:
            rows, values = reference
            last = out[-1] if isinstance(out, (tuple, list)) else out
            row.update(compare(last[jnp.asarray(rows)], values))
            if not row["correct"]:
                return dict(row, status="WRONG")
        del out
        t = measure(lambda: compiled(*args), ops, s)
        row.update(status="ok", median_us=t.median_us, min_us=t.min_us, max_us=t.max_us,
                   windows_us=t.windows_us, batch_median_us=t.batch_median_us, ops_per_call=ops)
    except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
        row.update(status="error", error=describe_error(e))
    return row


def timed(row: dict) -> bool:
    return row.get("status") == "ok" and "median_us" in row


def _cell(value, spec: str) -> str:
    missing = value is None or (isinstance(value, float) and not math.isfinite(value))
    return "-" if missing else format(value, spec)


def table(rows: list[dict], columns: list[tuple]) -> str:
    """``rows`` as a table: ``shape``, ``impl``, ``config``, then ``columns`` (``(header, key,
    format spec)``) for timed rows, the status and why for the others."""
    names = [("shape", "shape", "s"), ("impl", "impl", "s"), ("config", "config", "s")]
    widths = [max([len(h)] + [len(str(r.get(k, "-"))) for r in rows]) for h, k, _ in names]
    widths += [max(len(h), 8) for h, _, _ in columns]
    head = "  ".join(h.ljust(w) if i < 3 else h.rjust(w)
                     for i, ((h, _, _), w) in enumerate(zip(names + columns, widths)))
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [str(r.get(k, "-")).ljust(w) for (_, k, _), w in zip(names, widths)]
        if timed(r):
            cells += [_cell(r.get(k), spec).rjust(w)
                      for (_, k, spec), w in zip(columns, widths[3:])]
        else:
            why = " ".join(str(r.get("error") or r.get("reason") or
                               f"rel_err={_cell(r.get('rel_err'), '.1e')}").split())
            cells.append(f"{r.get('status', '?').upper()}: {why[:160]}")
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def source(value) -> str:
    """``value`` (a string, number or tuple of them) as the config modules write it, strings in
    double quotes: ``("bfloat16", 128, 4, 16, 32, 4096)``."""
    if isinstance(value, tuple):
        return "(" + ", ".join(source(x) for x in value) + ("," if len(value) == 1 else "") + ")"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def write_json(path: str | None, doc: dict) -> None:
    """``doc`` as strict JSON (`jsonable`) at ``path``, replaced whole (nothing when None)."""
    if not path:
        return
    with open(f"{path}.tmp", "w") as f:
        json.dump(jsonable(doc), f, indent=1, allow_nan=False)
    os.replace(f"{path}.tmp", path)


def exit_status(rows: list[dict]) -> int:
    """1 when a row is WRONG or failed (printed to stderr), else 0."""
    bad = [f"{r.get('shape')}/{r.get('impl')}/{r.get('config')}: {r['status']}" for r in rows
           if r.get("status") in ("WRONG", "error")]
    if bad:
        print(f"{len(bad)} rows WRONG or failed: {'; '.join(bad)}", file=sys.stderr, flush=True)
    return 1 if bad else 0


# ----------------------------------------------------------------------------------------------
# impl="auto": which kernel each shape class should run, from a run's rows

IMPL_MARGIN = 1.02  # an IMPL_CHOICE entry: Mosaic at least this much faster on every shape


def auto_choice(shapes, rows: list[dict], interpret: bool, *, select, key) -> tuple:
    """Per shape, the kernel ``impl="auto"`` picks now (``select(shape)``: ``(impl, config)``)
    and this run's Triton time over the Mosaic one; and the ``IMPL_CHOICE`` entries the run
    supports: ``"mosaic"`` for each shape class (``key(shape)``) where that ratio is at least
    `IMPL_MARGIN` on every shape of the class; none in interpret mode (its times say nothing).
    Returns ``(picks, choice)``."""
    picks, ratios = [], {}
    for shape in shapes:
        impl, config = select(shape)
        times = {r["impl"]: r["median_us"] for r in rows
                 if r["shape"] == shape.name and timed(r)}
        ratio = times["pallas"] / times["mosaic"] if {"pallas", "mosaic"} <= times.keys() else None
        picks.append({"shape": shape.name, "class": key(shape), "auto": impl,
                      "config": config_label(config), "pallas_over_mosaic": ratio})
        if ratio is not None:
            ratios.setdefault(key(shape), []).append(ratio)
    choice = {k: "mosaic" for k, found in ratios.items()
              if min(found) >= IMPL_MARGIN and not interpret}
    return picks, choice


def print_auto(picks: list[dict], choice: dict, interpret: bool, *, where: str,
               key_comment: str) -> None:
    """`auto_choice`'s picks, and (compiled runs) its entries in the bare form of the
    ``IMPL_CHOICE`` table in ``where``, under a comment naming the key."""
    print("\nimpl='auto' per shape (pallas/mosaic: the Triton time over the Mosaic time):")
    for pick in picks:
        ratio = pick["pallas_over_mosaic"]
        print(f"  {pick['shape']:<32} {pick['auto']:<7} {pick['config']:<36}"
              f" {'-' if ratio is None else f'{ratio:.3f}'}")
    if not interpret:
        print(f"\nIMPL_CHOICE entries this run supports ({where}):\n"
              + impl_choice_snippet(choice, key_comment))


def impl_choice_snippet(choice: dict, key_comment: str) -> str:
    """``choice`` in the bare form of an ``IMPL_CHOICE`` table, this device kind's entry."""
    lines = [f"    # {key_comment}: the kernel", f"    {source(device_kind())}: {{"]
    lines += [f"        {source(k)}: {source(impl)}," for k, impl in choice.items()]
    return "\n".join(lines + ["    },"])


# ----------------------------------------------------------------------------------------------
# Config labels: "bk64/s2/w4/st5/pr1", one part per field, a prefix and an integer (flags 0 or 1)


LABEL_PARTS = {
    DecodeConfig: {"bk": "block_k", "s": "num_splits", "w": "num_warps", "st": "num_stages",
                   "vl": "fp8_v_at_load", "mk": "merge_in_kernel", "pr": "fp8_pairs",
                   "p": "persistent_programs"},
    MosaicDecodeConfig: {"bk": "block_k", "s": "num_splits", "st": "num_stages",
                         "c": "num_consumers", "qn": "queries_in_n", "kr": "fp8_k_in_registers",
                         "vp": "fp8_v_in_producer", "ps": "persistent"},
    AttentionConfig: {"bq": "block_q", "sq": "short_block_q", "bk": "block_k", "s": "num_splits",
                      "w": "num_warps", "st": "num_stages", "pr": "fp8_pairs"},
    MosaicAttentionConfig: {"bkv": "block_kv", "st": "num_stages", "c": "num_consumers",
                            "pp": "ping_pong", "dr": "decode_rows", "ps": "persistent",
                            "ph": "pack_heads", "ov": "overlap_softmax"},
}


def config_label(config) -> str:
    """``config`` as its label: every integer field, those whose default is 0 only when set,
    and the flags that are on (``vl1``); ``-`` for None (the XLA path)."""
    if config is None:
        return "-"
    defaults = type(config)()
    parts = []
    for prefix, field in LABEL_PARTS[type(config)].items():
        value = getattr(config, field)
        if isinstance(value, bool) or getattr(defaults, field) == 0:
            if value:
                parts.append(f"{prefix}{int(value)}")
        else:
            parts.append(f"{prefix}{value}")
    return "/".join(parts)


def parse_config(label: str, config_type) -> dict:
    """``"bk32/w2/vl1"`` (any subset of `config_label`'s parts for ``config_type``) -> the fields
    it names, ``{"block_k": 32, "num_warps": 2, "fp8_v_at_load": True}``. ValueError for an
    unknown, repeated or empty part, or a flag other than 0 or 1."""
    fields = LABEL_PARTS[config_type]
    flags = {f.name for f in dataclasses.fields(config_type) if f.type in ("bool", bool)}
    values = {}
    for part in label.split("/"):
        key = part.rstrip("0123456789")
        if key not in fields or key == part or fields[key] in values:
            raise ValueError(f"config {label!r}: expected distinct parts among"
                             f" {', '.join(f'{k}<int>' for k in fields)}, got {part!r}")
        value = int(part[len(key):])
        if fields[key] in flags:
            if value not in (0, 1):
                raise ValueError(f"config {label!r}: {key} takes 0 or 1")
            value = bool(value)
        values[fields[key]] = value
    return values

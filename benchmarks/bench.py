"""Benchmark: paged decode and the cache write, as a fraction of the copy bandwidth of the same run.

Run ``python -m benchmarks.bench [--shapes NAMES|all] [--impls ...] [--tune] [--json PATH]
[--plot PATH] [--smoke]``. For each shape of `benchmarks.shapes` it measures, in one process:

- ``pallas``: ``decode(..., impl="pallas")`` with the config ``decode`` would pick itself (the tuned
  table's entry, else the heuristic); with ``--tune``, a bounded sweep of `DecodeConfig` candidates.
- ``mosaic``: ``decode(..., impl="mosaic")``, the Mosaic GPU kernel, with the config ``decode``
  would pick itself (`configs.lookup_mosaic`). Where the kernel cannot run the shape here (a CPU
  without interpret mode, jax < 0.11.2, a GPU before sm_90, head_dim 32, fp32, ...) its row says
  "not run" with the kernel's own reason (`mosaic_gpu.refusal`).
- ``xla``: ``decode(..., impl="xla")``; skipped when its gathered fp32 K/V would exceed ~30 GB.
- ``jax_paged_attention``: JAX's ``jax.experimental.pallas.ops.gpu.paged_attention``, its best over
  a few valid configs. Its layout (``[num_kv_heads, total_num_pages, page_size, head_dim]``), its
  pre-scaled queries (it applies no softmax scale) and, for fp8, its per-token scale arrays are
  built outside the timed region. It has no sliding window: skipped for windowed shapes.
- ``write``: ``write_kv`` of a decode step (``batch`` tokens) and of a prefill (16384 tokens), for
  ``impl="xla"`` and ``impl="pallas"``, jitted with the caches donated and fed back, so the
  buffers are updated in place. Measured once per distinct (dtype, kv heads, head_dim, block size
  [, batch]).

Method:

- Copy bandwidth (`benchmarks.timing.measure_copy_bandwidth`): over 4 GiB, torch's device-to-device
  copy (when torch sees the GPU) and a jitted JAX copy and bitwise-not (which XLA cannot elide)
  into donated buffers, bytes read + written over the median time, the largest of the ways whose
  windows agree within `benchmarks.timing.COPY_SPREAD_LIMIT`; measured at the start (the
  reference of every fraction) and again at the end (a drift check).
- Timing (`benchmarks.timing.measure`): compilation, a correctness call and ~0.2 s of warm-up
  calls outside the clock; then ``--repeats`` windows, each two batches of back-to-back calls from
  an idle device, ``N`` and ``2N`` (each followed by ``block_until_ready``; the longer one about
  ``--window-ms`` long); the median over windows of the batches' time difference / (``N`` *
  operations per call): the steady time of a call among back-to-back calls, without what a batch
  pays once (the first dispatch's enqueue, the final wait). ``batch_median_us`` in the JSON: the
  longer batches' own time per operation, that fixed cost included.
- Small problems (K/V read per call < 4x the 60 MB L2) rotate among several copies of their inputs
  (own queries, own physical blocks in one shared cache), so no call re-reads what the previous
  one left in L2. To keep host dispatch (~10 us) out of such short kernels, one jitted call then
  runs ``reps`` operations in straight-line code over the copies ("loop" mode: XLA launches them
  back to back; a ``fori_loop`` would add a host round trip per iteration); ``loop_overhead_us``
  reports the time per operation of a trivial body launched the same way. Problems large
  enough to need no rotation run in loop mode too, ``loop_ops`` calls on one copy (each call its
  own query array): launched one per dispatch, each call paid the gap between two of JAX's
  executables (4.7-4.8 us on an H100's timer, 3% of B=32/ctx 4096 on an H200), where calls
  inside one program, as in a model's jitted step, are under 1 us apart (docs/BENCHMARKS.md,
  "Both ways on the device's timer").
  Writes always run ``reps`` straight-line writes per call on the donated caches: a prefill
  write rotates among 4 disjoint sets of whole blocks; a decode-step write repeats its slots
  (slicing a rotation would launch a kernel as costly as the write itself).
- Bandwidth: decode bytes = the K/V rows that must be read (``sum_b min(n_b, W) * KVH * D *
  itemsize * 2``) + q + output; write bytes = bytes written (``tokens * KVH * D * itemsize * 2``)
  and, as a second figure, bytes read + written (k, v rows and slots read, cache rows written).
- ``impl="auto"``: each shape's record says which kernel ``decode``'s default picks there
  (``auto``: `api.auto_impl`, the `configs.IMPL_CHOICE` entry of its class, and why Mosaic could
  not run compiled, if it could not). The AUTO table prints it beside this run's pallas / mosaic
  time ratio, and the run ends with the ``IMPL_CHOICE`` entries those ratios call for (Mosaic at
  least `IMPL_MARGIN` faster), to paste into ``configs.py`` after a GPU run.
- Correctness: every decode variant's output (of the last copy; ``impl="xla"`` included) is
  compared on the first ``REF_ROWS`` sequences with the float64 oracle (`parity.oracle`, run on
  the host over just the blocks those sequences read); NaN or a relative L2 error above
  ``REL_TOL`` marks it WRONG and it can never be "best". Writes are checked bit for bit at the
  written slots. Any WRONG row makes the exit status 1.

Every variant is isolated: a compile or run error is recorded in the JSON and the table, and the
run goes on. The JSON is rewritten after every shape, so an interrupted run keeps what it measured
(``--resume`` then skips those shapes); an interrupted run exits 130, a usage error 2 (argparse).
``--smoke`` runs the tiny `SMALL_SHAPES` on any backend
(Pallas interpret mode on a CPU) with minimal repetitions: it checks the plumbing, not the speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform as host_platform
import signal
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_paged.decode_attention import configs, mosaic_gpu
from pallas_paged.decode_attention.configs import (DecodeConfig, MosaicDecodeConfig,
                                                   get_heuristic_config)
from pallas_paged.decode_attention.api import auto_impl, decode, decode_shape
from pallas_paged.decode_attention.pallas_triton import kv_ring_depth
from pallas_paged._platform import device_kind, has_gpu, next_power_of_2, sm_count
from benchmarks.shapes import (ALL_SHAPES, SHAPE_GROUPS, SMALL_SHAPES, DecodeBenchShape,
                                 make_decode_inputs, random_normal, rotation_copies,
                                 shape_by_name)
from pallas_paged import quantize_fp8, write_kv
from parity.oracle import oracle_paged_attention
from benchmarks.timing import (Timing, TimerSettings, copy_summary, jsonable, measure,
                               measure_copy_bandwidth)
from benchmarks.timing import describe_error as _error

IMPLS = ("pallas", "mosaic", "xla", "jax_paged_attention", "write")
# How every shape's calls are timed (the records' ``mode``): ``reps`` straight-line calls in one
# jitted program (`repeated`), never one call per dispatch (see Method above).
TIMING_MODE = "loop"
DECODE_IMPLS = ("pallas", "mosaic", "xla", "jax_paged_attention")
L2_BYTES = 60e6                 # H200 L2
ROTATE_BYTES = 4 * L2_BYTES     # below this much K/V per call, rotate among input copies
MAX_COPIES = 8
XLA_LIMIT_BYTES = 30e9          # skip impl="xla" when its gathered fp32 K/V would exceed this
PREFILL_TOKENS = 16384
COPY_BYTES = 4 * 2**30
REL_TOL = 2e-2                  # relative L2 error above which an output is WRONG (bf16: ~4e-3)
REF_ROWS = 8                    # batch rows compared with the float64 oracle
SMEM_BYTES = 220 * 1024         # prune tune candidates whose K/V tiles alone exceed this
# num_stages the tuner tries: no pipelining, then K/V rings of 1 (the table load not pipelined,
# then pipelined), 2 and 3 tiles (`pallas_triton.kv_ring_depth`).
TUNE_STAGES = (1, 2, 3, 5, 7)
JAX_PA_BLOCK_H = 16
IMPL_MARGIN = 1.02              # an IMPL_CHOICE entry needs Mosaic at least this much faster


# ----------------------------------------------------------------------------------------------
# Settings


@dataclasses.dataclass(frozen=True)
class Settings:
    windows: int = 7             # timed windows per variant (the median is reported)
    window_s: float = 0.010      # target duration of one window
    warmup_s: float = TimerSettings.warmup_s  # untimed calls before the windows
    min_calls: int = 3
    max_calls: int = 2000
    loop_ops: int = 16           # loop mode: at least this many operations per dispatch
    write_step_reps: int = 64    # writes per call, decode-step write (a few us each)
    write_prefill_reps: int = 4  # writes per call, prefill write
    prefill_tokens: int = PREFILL_TOKENS
    copy_bytes: int = COPY_BYTES
    jax_configs: int = 6         # JAX paged_attention configs per shape
    max_tune_configs: int = 40   # tune candidates per shape (besides the default config)
    compile_threads: int = 1     # >1: compile a shape's Pallas variants in threads
    copies: int = 0              # 0: automatic (rotation rule); else forced
    max_copies: int = MAX_COPIES
    interpret: bool = False      # Pallas interpret mode (no GPU)
    seed: int = 0


def smoke_settings(base: Settings) -> Settings:
    return dataclasses.replace(base, windows=2, window_s=0.0, warmup_s=0.0, min_calls=1,
                               max_calls=1, loop_ops=1, write_step_reps=2, write_prefill_reps=2,
                               prefill_tokens=64, copy_bytes=16 * 2**20, jax_configs=1,
                               max_tune_configs=3, max_copies=2)


def tool_setup(smoke: bool, copy_bytes: int = 1 << 30) -> tuple[Settings, bool, dict]:
    """A single-purpose timing tool's settings, interpret mode and copy bandwidth (measured over
    ``copy_bytes``, printed): default settings on the device, or (``smoke``) tiny settings in
    interpret mode over a 1 MiB copy."""
    s = smoke_settings(Settings()) if smoke else Settings()
    interpret = smoke or jax.devices()[0].platform != "gpu"
    copy = measure_copy_bandwidth(1 << 20 if smoke else copy_bytes, s)
    print(f"copy bandwidth {copy_summary(copy)}", flush=True)
    return s, interpret, copy


def tool_parser(doc: str, smoke_help: str) -> argparse.ArgumentParser:
    """A single-purpose timing tool's command line: its module docstring's first line, then
    ``--shapes`` (comma-separated names), ``--json`` (`write_tool_json`'s path) and ``--smoke``
    (``smoke_help``); the tool adds its own arguments."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated names")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    return parser


def tool_shape_names(args, shapes, smoke_shapes) -> list[str]:
    """The shapes a `tool_parser` tool runs: ``--shapes``, else ``smoke_shapes`` with
    ``--smoke``, else ``shapes``."""
    if args.shapes:
        return args.shapes.split(",")
    return list(smoke_shapes if args.smoke else shapes)


def write_tool_json(path: str | None, copy: dict, **fields) -> None:
    """A single-purpose timing tool's JSON at ``path`` (nothing when None): the device kind, the
    copy bandwidth (`tool_setup`'s), the jax version, then ``fields`` (its rows)."""
    if path is None:
        return
    with open(path, "w") as f:
        json.dump(jsonable({"device": jax.devices()[0].device_kind, "copy": copy,
                            "jax": jax.__version__, **fields}), f, indent=1)


# ----------------------------------------------------------------------------------------------
# Helpers (the timer and the copy bandwidth are `benchmarks.timing`'s)


def parse_config_label(label: str, fields: dict, flags: tuple = ()) -> dict:
    """``"bk64/st4"`` -> the config fields its parts name, ``{"block_k": 64, "num_stages": 4}``;
    ``fields`` maps each part's prefix (``"bk"``) to its field name; the fields named in
    ``flags`` are bools written 0 or 1 (``"vl1"`` -> True). ValueError for an unknown or repeated
    part, or a flag of another value (argparse's ``type=`` turns it into a usage error)."""
    values = {}
    for part in label.split("/"):
        key = part.rstrip("0123456789")
        if key not in fields or key == part or fields[key] in values:
            prefixes = ", ".join(f"{k}<int>" for k in fields)
            raise ValueError(f"config {label!r}: expected distinct parts among {prefixes},"
                             f" got {part!r}")
        value = int(part[len(key):])
        if fields[key] in flags:
            if value not in (0, 1):
                raise ValueError(f"config {label!r}: {key} takes 0 or 1")
            value = bool(value)
        values[fields[key]] = value
    return values


# `config_label`'s parts of a `DecodeConfig`: prefix -> field (the 0/1 flags in DECODE_CONFIG_FLAGS)
DECODE_CONFIG_PARTS = {"bk": "block_k", "s": "num_splits", "w": "num_warps", "st": "num_stages",
                       "vl": "fp8_v_at_load", "mk": "merge_in_kernel", "pr": "fp8_pairs",
                       "p": "persistent_programs"}
DECODE_CONFIG_FLAGS = ("fp8_v_at_load", "merge_in_kernel", "fp8_pairs")


def parse_decode_config(label: str) -> dict:
    """``"bk32/w2/vl1"`` (parts of `config_label`'s form for a `DecodeConfig`, any subset) ->
    ``{"block_k": 32, "num_warps": 2, "fp8_v_at_load": True}``."""
    return parse_config_label(label, DECODE_CONFIG_PARTS, flags=DECODE_CONFIG_FLAGS)


def _short(text: str, n: int = 60) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Variants: a jitted function, its arguments, and what one call does


@dataclasses.dataclass
class Variant:
    impl: str                      # pallas, pallas_tune, xla, jax_paged_attention, ref, probe,
                                   # write_xla, write_pallas
    label: str                     # config or size, for humans
    fn: object                     # the jitted function
    args: tuple
    ops_per_call: int = 1
    config: dict | None = None
    pooled: bool = True            # may compile in a thread (no XLA autotuning inside)
    compiled: object = None
    compile_s: float | None = None
    error: str | None = None


def compile_all(variants: list[Variant], threads: int) -> None:
    """AOT-compile every variant (``lower().compile()``), recording errors per variant.

    With ``threads > 1``, variants made of Pallas kernels, scatters and elementwise work compile
    in a thread pool; variants with dots (``impl="xla"``, references) always compile one at a
    time in this thread, first, since XLA autotunes their GEMMs on the device. The default is one
    thread: recent jaxlibs compile Pallas' Triton IR while lowering, under the GIL, so threads gain
    little there.
    """

    def work(v: Variant):
        t0 = time.perf_counter()
        try:
            v.compiled = v.fn.lower(*v.args).compile()
        except Exception as e:  # noqa: BLE001 - recorded per variant
            v.error = _error(e)
        v.compile_s = round(time.perf_counter() - t0, 3)

    todo = [v for v in variants if v.compiled is None and v.error is None]
    for v in [v for v in todo if not v.pooled]:
        work(v)
    todo = [v for v in todo if v.pooled]
    if threads <= 1 or len(todo) <= 1:
        for v in todo:
            work(v)
    else:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(todo))) as pool:
            list(pool.map(work, todo))


def repeated(call, reps: int):
    """A jitted ``f(qs, k, v, tables, lens, *extra)`` (``qs``, ``tables``: lists of ``reps``
    arrays, see `per_call`): ``reps`` calls of ``call`` in straight-line code, call ``i`` on
    ``qs[i]`` and ``tables[i]``, every output returned (so none is dropped). XLA launches them back
    to back with no host round trip between calls, where a ``fori_loop`` would copy its condition
    to the host every iteration (17.6 us per iteration on an H200 for a body of one small fusion,
    ``python -m benchmarks.decode_anatomy``)."""

    def run(qs, k, v, tables, lens, *extra):
        return tuple(call(qs[i], k, v, tables[i], lens, *extra) for i in range(reps))

    return jax.jit(run)


def per_call(stacked, copies: int, reps: int) -> list:
    """``reps`` arrays for `repeated`'s calls: call ``i`` gets its own device copy of
    ``stacked[i % copies]``. Calls on one copy's same arrays would be identical pure computations,
    which XLA merges into one (common-subexpression elimination), so each call has its own query
    array (the tables may be shared: one differing operand keeps calls apart)."""
    return [jnp.array(stacked[i % copies], copy=True) for i in range(reps)]


def loop_reps(copies: int, loop_ops: int) -> int:
    """Operations per call in loop mode: at least ``loop_ops``, a whole number of passes over the
    ``copies`` (one copy or several)."""
    return copies * max(1, math.ceil(loop_ops / copies))


def loop_args(inputs, copies: int, reps: int, q=None, tables=None) -> tuple:
    """`repeated`'s arguments over ``inputs`` (a `DecodeInputs`): every call's own query (`per_call`)
    and its copy's table, then the shared caches and lengths; ``q`` / ``tables`` (stacked per
    copy) replace the inputs' own."""
    q = inputs.q if q is None else q
    tables = inputs.block_tables if tables is None else tables
    shared_tables = [tables[i] for i in range(copies)]  # sliced once per copy
    return (per_call(q, copies, reps), inputs.k_cache, inputs.v_cache,
            [shared_tables[i % copies] for i in range(reps)], inputs.context_lens)


def loop_probe(reps: int):
    """`repeated`'s calls with a body that only reads its q and table into one small fusion: its
    time per call is what launching a call costs, included in every "loop" figure."""

    def run(qs, tables):
        return tuple(qs[i].astype(jnp.float32) + tables[i][:, :1, None] for i in range(reps))

    return jax.jit(run)


# ----------------------------------------------------------------------------------------------
# Correctness


def compare(out, ref) -> dict:
    """Max abs and relative L2 error of ``out`` against ``ref`` (float32 on the host)."""
    o = np.asarray(out).astype(np.float32)
    r = np.asarray(ref).astype(np.float32)
    finite = bool(np.isfinite(o).all())
    diff = np.abs(o - r)
    max_abs = float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else float("nan")
    denom = float(np.linalg.norm(r))
    rel = float(np.linalg.norm(np.nan_to_num(o - r, nan=np.inf))) / max(denom, 1e-30)
    ok = finite and bool(np.isfinite(rel)) and rel <= REL_TOL
    return {"max_abs_err": max_abs, "rel_err": rel, "nan": not finite, "correct": ok}


def oracle_rows(inputs, copy: int, rows: int) -> np.ndarray:
    """The float64 oracle's output for sequences ``0..rows-1`` of input copy ``copy`` (float32).

    The oracle indexes the device caches with the positions those sequences read, so only those
    rows leave the device.
    """
    out, _ = oracle_paged_attention(
        np.asarray(inputs.q[copy][:rows]), inputs.k_cache, inputs.v_cache,
        inputs.block_tables_np[copy][:rows], inputs.context_lens_np[:rows],
        k_scale=inputs.k_scale, v_scale=inputs.v_scale, sliding_window=inputs.shape.sliding_window)
    return out.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Decode variants


def _decode_fn(impl, *, config=None, k_scale=None, v_scale=None, window=None, interpret=None):
    return functools.partial(decode, impl=impl, config=config, k_scale=k_scale, v_scale=v_scale,
                             sliding_window=window, interpret=interpret)


def config_label(c: DecodeConfig | MosaicDecodeConfig) -> str:
    if isinstance(c, MosaicDecodeConfig):
        return (f"bk{c.block_k}/s{c.num_splits}/st{c.num_stages}/c{c.num_consumers}"
                + ("/qn1" if c.queries_in_n else "") + ("/kr1" if c.fp8_k_in_registers else "")
                + ("/vp1" if c.fp8_v_in_producer else "") + ("/ps1" if c.persistent else ""))
    return (f"bk{c.block_k}/s{c.num_splits}/w{c.num_warps}/st{c.num_stages}"
            + ("/vl1" if c.fp8_v_at_load else "") + ("/mk1" if c.merge_in_kernel else "")
            + ("/pr1" if c.fp8_pairs else "")
            + (f"/p{c.persistent_programs}" if c.persistent_programs else ""))


def abstract_args(shape: DecodeBenchShape) -> tuple:
    """``(q, k_cache, block_tables)`` of ``shape`` as `jax.ShapeDtypeStruct` s (one cache block):
    what `auto_impl`, `configs` and `mosaic_gpu.refusal` read, without building inputs."""
    q = jax.ShapeDtypeStruct((shape.batch, shape.num_heads, shape.head_dim), shape.query_dtype)
    cache = jax.ShapeDtypeStruct((1, shape.block_size, shape.num_kv_heads, shape.head_dim),
                                 shape.dtype)
    tables = jax.ShapeDtypeStruct((shape.batch, shape.max_blocks), jnp.int32)
    return q, cache, tables


def mosaic_plan(shape: DecodeBenchShape, interpret: bool, sms: int) -> tuple:
    """``(config, reason)``: the `MosaicDecodeConfig` ``decode`` would use for ``shape`` here, and
    why the Mosaic kernel cannot run it (None when it can)."""
    q, cache, tables = abstract_args(shape)
    config = configs.lookup_mosaic(decode_shape(q, cache, tables), device_kind(), sms)
    return config, mosaic_gpu.refusal(q, cache, config, interpret=interpret)


def auto_record(shape: DecodeBenchShape, interpret: bool, mosaic_refusal: str | None) -> dict:
    """What ``decode(..., impl="auto")`` does on ``shape`` here: ``impl`` (`auto_impl`), ``table``
    (the `configs.IMPL_CHOICE` entry of its class on this device kind, None when unmeasured) and
    ``mosaic_refusal`` (why ``"auto"`` cannot run the Mosaic kernel here: interpret mode, or the
    kernel's reason for refusing a compiled run, ``mosaic_plan``'s; None when it can)."""
    q, cache, tables = abstract_args(shape)
    return {"impl": auto_impl(q, cache, tables, interpret=interpret),
            "table": configs.lookup_impl(decode_shape(q, cache, tables), device_kind()),
            "mosaic_refusal": "interpret mode" if interpret else mosaic_refusal}


JAX_PA_DEFAULT = (16, 8, 8)  # paged_attention's defaults: k_splits, pages_per_compute_block, warps


def jax_pa_configs(shape: DecodeBenchShape, pages_per_seq: int, limit: int, sms: int) -> list:
    """Valid configs of JAX's paged_attention, most promising first, at most ``limit``.

    Valid: ``pages_per_seq % k_splits == 0``, the partition a multiple of the compute block, and
    the compute block a power of two. JAX's own default comes first when valid (the out-of-the-box
    baseline); the rest are ranked by a score (about two programs per SM or more, a K tile of about
    32 KiB, 4 warps for small tiles), with a penalty for repeating a k_splits or page count
    already chosen, so that a short sweep still spans both axes.
    """
    head_blocks = -(-shape.group // JAX_PA_BLOCK_H)
    itemsize = max(2, shape.cache_itemsize)
    scored = {}
    for k_splits in (1, 4, 8, 16):
        if pages_per_seq % k_splits:
            continue
        per_partition = pages_per_seq // k_splits
        for ppcb in (4, 8, 16):
            eff = min(per_partition, ppcb)
            if per_partition % eff or eff & (eff - 1):  # Triton tiles are powers of two
                continue
            programs = shape.batch * shape.num_kv_heads * head_blocks * k_splits
            tile = eff * shape.block_size * shape.head_dim * itemsize
            fill = math.log2(programs / (2 * sms))
            score = (-1.5 * fill if fill < 0 else 0.5 * fill) + abs(math.log2(tile / 32768))
            for warps in (4, 8):
                preferred = 4 if tile <= 32768 else 8
                key = (k_splits, eff, warps)
                total = score + (0 if warps == preferred else 0.5)
                scored[key] = min(total, scored.get(key, math.inf))
    ks, ppcb, warps = JAX_PA_DEFAULT
    default = (ks, min(ppcb, pages_per_seq // ks), warps)  # it clamps the block to the partition
    chosen = [default] if default in scored and limit > 0 else []
    while len(chosen) < min(limit, len(scored)):
        def penalized(key):
            same = [sum(key[i] == c[i] for c in chosen) for i in range(3)]
            return scored[key] + 0.6 * same[0] + 0.3 * same[1] + 0.2 * same[2]
        chosen.append(min((k for k in scored if k not in chosen), key=penalized))
    return [dict(block_h=JAX_PA_BLOCK_H, pages_per_compute_block=eff, k_splits=ks,
                 num_warps=w, num_stages=2) for ks, eff, w in chosen]


def _jax_pa_call(jax_pa, config: dict, interpret: bool):
    def call(q, k_pages, v_pages, tables, lens, *scales):
        return jax_pa.paged_attention(q, k_pages, v_pages, tables, lens, *scales,
                                      interpret=interpret, **config)

    return call


def _tile_bytes(block_k: int, shape: DecodeBenchShape, stages: int) -> int:
    """Shared memory of the K/V tiles in flight (`pallas_triton.kv_ring_depth`), counted at 16
    bits per element (an fp8 tile converted at load has an fp16 copy too)."""
    return 2 * block_k * next_power_of_2(shape.head_dim) * max(2, shape.cache_itemsize) * max(
        1, kv_ring_depth(stages))


def tune_stage1(shape: DecodeBenchShape, base: DecodeConfig, heuristic: DecodeConfig,
                persistent_programs: int = 0) -> list:
    """block_k x num_splits around the heuristic, the base config's warps, at K/V rings one and
    two tiles deep (2 and 5 stages, `pallas_triton.kv_ring_depth`): the split count and the ring
    depth win together (on the H200 at B=32, ctx=4096, bf16, the tune of 2026-11-30, rings one
    tile deep, kept 2 splits; 1 split with rings two deep then ran 1.04x faster, 1.05x with 8
    warps, docs/BENCHMARKS.md). With ``persistent_programs`` also that many persistent programs
    (`DecodeConfig.persistent_programs`) with 64- and 128-token tiles at rings two tiles deep (the
    ragged B=64 batch's best, 2026-12-05)."""
    eff_len = min(shape.capacity, shape.sliding_window or shape.capacity)
    stages = (base.num_stages, 5 if kv_ring_depth(base.num_stages) < 2 else 2)
    out = []
    for num_stages in stages:
        for block_k in (16, 32, 64, 128):
            if block_k > max(16, next_power_of_2(eff_len)):
                continue
            if _tile_bytes(block_k, shape, num_stages) > SMEM_BYTES:
                continue
            tiles = max(1, eff_len // block_k)
            h = heuristic.num_splits
            for splits in sorted({max(1, h // 2), h, min(64, 2 * h)}):
                if splits > tiles:
                    continue
                out.append(dataclasses.replace(base, block_k=block_k, num_splits=splits,
                                               num_stages=num_stages))
    if persistent_programs:
        out += [dataclasses.replace(base, block_k=block_k, num_splits=1, num_stages=5,
                                    merge_in_kernel=False, persistent_programs=persistent_programs)
                for block_k in (64, 128) if _tile_bytes(block_k, shape, 5) <= SMEM_BYTES]
    return list(dict.fromkeys(out))


# The fp8 operand paths stage 2 tries: the V tile converted in the dot operand's read, at load
# (`DecodeConfig.fp8_v_at_load`), K and V read as column pairs (`DecodeConfig.fp8_pairs`).
FP8_PATHS = (dict(fp8_v_at_load=False, fp8_pairs=False), dict(fp8_v_at_load=True, fp8_pairs=False),
             dict(fp8_v_at_load=False, fp8_pairs=True))


def tune_stage2(shape: DecodeBenchShape, best: DecodeConfig) -> list:
    """num_warps x num_stages at the best (block_k, num_splits): 4 and 8 warps, for fp8 caches
    2 and 4 (8 ran 1.3-1.9x slower there on the H200), each with every path of `FP8_PATHS`.
    Stages: one of each K/V ring depth (`pallas_triton.kv_ring_depth`: 4 compiles to the program
    of 3, 6 to that of 5), and 2, where the table load is not pipelined."""
    fp8 = shape.cache_itemsize == 1
    paths = FP8_PATHS if fp8 else (dict(fp8_v_at_load=best.fp8_v_at_load,
                                        fp8_pairs=best.fp8_pairs),)
    return [dataclasses.replace(best, num_warps=w, num_stages=st, **path)
            for w in ((2, 4) if fp8 else (4, 8)) for st in TUNE_STAGES for path in paths
            if _tile_bytes(best.block_k, shape, st) <= SMEM_BYTES]


def tune_stage3(ranked: list, best: DecodeConfig) -> list:
    """The runners-up (block_k, num_splits) of stage 1 with the best warps and stages."""
    out = []
    for c in ranked:
        if (c.block_k, c.num_splits) != (best.block_k, best.num_splits):
            out.append(dataclasses.replace(c, num_warps=best.num_warps,
                                           num_stages=best.num_stages))
        if len(out) == 3:
            break
    return out


# ----------------------------------------------------------------------------------------------
# One shape


class ShapeBench:
    """Everything measured on one shape; results are plain dicts (the JSON rows)."""

    def __init__(self, shape: DecodeBenchShape, impls, s: Settings, copy_tbps: float,
                 tune: bool, sms: int):
        self.shape, self.impls, self.s, self.copy_tbps, self.tune = shape, impls, s, copy_tbps, tune
        self.sms = sms
        self.rows: list[dict] = []
        self.record: dict = {"name": shape.name, "shape": dataclasses.asdict(shape),
                             "describe": shape.describe(), "status": "started",
                             "copy_tbps": copy_tbps}
        self.ref = None
        self.ref_kind = None
        self.ref_rows = None

    # -- bookkeeping ----------------------------------------------------------------------------

    def _row(self, v: Variant, **extra) -> dict:
        row = {"shape": self.shape.name, "impl": v.impl, "label": v.label, "config": v.config,
               "compile_s": v.compile_s, "status": "ok"}
        row.update(extra)
        if v.error is not None:
            row["status"], row["error"] = "error", v.error
        return row

    def _add_timing(self, row: dict, t: Timing, nbytes: float, rw_bytes: float | None = None):
        row.update(median_us=t.median_us, min_us=t.min_us, max_us=t.max_us,
                   windows_us=t.windows_us, calls_per_window=t.calls_per_window,
                   ops_per_call=t.ops_per_call, batch_median_us=t.batch_median_us, bytes=nbytes,
                   tbps=nbytes / (t.median_us * 1e-6) / 1e12)
        row["frac_copy_bw"] = row["tbps"] / self.copy_tbps
        if rw_bytes is not None:
            row["rw_bytes"] = rw_bytes
            row["rw_tbps"] = rw_bytes / (t.median_us * 1e-6) / 1e12
            row["rw_frac_copy_bw"] = row["rw_tbps"] / self.copy_tbps

    @staticmethod
    def _print(row: dict):
        if row.get("status") == "ok" and "median_us" in row:
            extra = ""
            if "rel_err" in row:
                extra = f" rel_err={row['rel_err']:.1e}" + ("" if row["correct"] else " WRONG")
            if "write_ok" in row:
                extra = f" written_ok={row['write_ok']} donated={row.get('donated')}"
            print(f"    {row['impl']:<22} {row['label']:<26} {row['median_us']:10.2f} us"
                  f" {row['tbps']:6.3f} TB/s ({row['frac_copy_bw']:.2f} of copy){extra}",
                  flush=True)
        else:
            print(f"    {row['impl']:<22} {row['label']:<26} {row['status'].upper()}:"
                  f" {_short(row.get('error') or row.get('reason', ''), 100)}", flush=True)

    # -- decode ---------------------------------------------------------------------------------

    def run(self, write_keys_done: set) -> tuple[dict, list]:
        shape, s = self.shape, self.s
        copies = s.copies or rotation_copies(shape, min_bytes=ROTATE_BYTES,
                                             max_copies=s.max_copies)
        reps = loop_reps(copies, s.loop_ops)
        self.copies, self.reps = copies, reps
        t0 = time.perf_counter()
        inputs = make_decode_inputs(shape, s.seed, copies=copies)
        jax.block_until_ready((inputs.q, inputs.k_cache, inputs.v_cache))
        tokens = inputs.tokens_read()
        q_bytes = shape.batch * shape.num_heads * shape.head_dim * jnp.dtype(
            shape.query_dtype).itemsize
        self.decode_bytes = tokens * shape.kv_bytes_per_token + 2 * q_bytes
        self.record.update(copies=copies, mode=TIMING_MODE, reps_per_call=reps, tokens_read=tokens,
                           decode_bytes=self.decode_bytes, num_blocks=inputs.num_blocks,
                           cache_bytes=2 * inputs.k_cache.size * shape.cache_itemsize,
                           inputs_s=round(time.perf_counter() - t0, 3))
        print(f"[{shape.name}] {shape.describe()}: {copies} cop{'y' if copies == 1 else 'ies'},"
              f" {TIMING_MODE} mode, {self.decode_bytes / 1e6:.1f} MB read per call", flush=True)
        try:
            if any(i in self.impls for i in DECODE_IMPLS):
                self._decode(inputs)
            if "write" in self.impls:
                self._writes(inputs, write_keys_done)
        finally:
            for x in (inputs.q, inputs.k_cache, inputs.v_cache):
                if not x.is_deleted():
                    x.delete()
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:  # of the process so far: jax cannot reset it
            self.record["peak_bytes_in_use_so_far"] = int(stats["peak_bytes_in_use"])
        self.record["status"] = "done"
        self.record["results"] = [r for r in self.rows if r.get("kind") != "write"]
        return self.record, [r for r in self.rows if r.get("kind") == "write"]

    def _decode_args(self, inputs, q=None, tables=None):
        """Arguments of a decode-like call in loop mode: lists of every call's q and its copy's
        table (`loop_args`)."""
        return loop_args(inputs, self.copies, self.reps, q=q, tables=tables)

    def _wrap(self, call):
        return repeated(call, self.reps)

    def _decode_variant(self, impl, label, call, args, config=None) -> Variant:
        fn = self._wrap(call)
        return Variant(impl=impl, label=label, fn=fn, args=args, ops_per_call=self.reps,
                       config=config)

    def _ours(self, inputs, config: DecodeConfig, impl="pallas") -> Variant:
        shape = self.shape
        call = _decode_fn("pallas", config=config, k_scale=inputs.k_scale, v_scale=inputs.v_scale,
                          window=shape.sliding_window, interpret=self.s.interpret or None)
        return self._decode_variant(impl, config_label(config), call, self._decode_args(inputs),
                                    dataclasses.asdict(config))

    def _mosaic(self, inputs, config: MosaicDecodeConfig) -> Variant:
        shape = self.shape
        call = _decode_fn("mosaic", config=config, k_scale=inputs.k_scale,
                          v_scale=inputs.v_scale, window=shape.sliding_window,
                          interpret=self.s.interpret or None)
        return self._decode_variant("mosaic", config_label(config), call,
                                    self._decode_args(inputs), dataclasses.asdict(config))

    def _decode(self, inputs):
        shape, s = self.shape, self.s
        last = self.copies - 1
        q0, k0, _, t0, _ = inputs.args(0)
        facts = decode_shape(q0, k0, t0)
        kind = device_kind()
        default_cfg = configs.lookup(facts, kind, self.sms)
        heuristic = get_heuristic_config(facts, self.sms)
        mosaic_cfg, mosaic_refusal = mosaic_plan(shape, s.interpret, self.sms)
        self.record.update(shape_class=list(configs.shape_class(facts)),
                           default_config=dataclasses.asdict(default_cfg),
                           heuristic_config=dataclasses.asdict(heuristic),
                           default_from_table=configs.shape_class(facts)
                           in configs.TUNED.get(kind, {}),
                           mosaic_config=dataclasses.asdict(mosaic_cfg),
                           auto=auto_record(shape, s.interpret, mosaic_refusal))
        variants: list[Variant] = []
        skipped: list[dict] = []
        if "pallas" in self.impls or self.tune:
            variants.append(self._ours(inputs, default_cfg))
        if "mosaic" in self.impls:
            if mosaic_refusal is not None:
                skipped.append({"impl": "mosaic", "label": config_label(mosaic_cfg),
                                "config": dataclasses.asdict(mosaic_cfg), "status": "not run",
                                "reason": mosaic_refusal})
            else:
                variants.append(self._mosaic(inputs, mosaic_cfg))
        xla_variant = None
        if "xla" in self.impls:
            need = 2 * shape.batch * shape.capacity * shape.num_kv_heads * shape.head_dim * 4
            if need > XLA_LIMIT_BYTES:
                skipped.append({"impl": "xla", "label": "-", "status": "skipped",
                                "reason": f"gathered fp32 K/V would be {need / 1e9:.0f} GB"})
            else:
                call = _decode_fn("xla", k_scale=inputs.k_scale, v_scale=inputs.v_scale,
                                  window=shape.sliding_window)
                xla_variant = self._decode_variant("xla", "-", call, self._decode_args(inputs))
                xla_variant.pooled = False
                variants.append(xla_variant)
        jax_layout = None
        if "jax_paged_attention" in self.impls:
            if shape.sliding_window is not None:
                skipped.append({"impl": "jax_paged_attention", "label": "-", "status": "skipped",
                                "reason": "JAX's paged_attention has no sliding window"})
            elif not jax_pa_configs(shape, shape.max_blocks, s.jax_configs, self.sms):
                skipped.append({"impl": "jax_paged_attention", "label": "-", "status": "skipped",
                                "reason": f"no valid config for {shape.max_blocks} pages per"
                                          " sequence"})
            else:
                try:
                    jax_layout = self._jax_layout(inputs)
                except Exception as e:  # noqa: BLE001
                    skipped.append({"impl": "jax_paged_attention", "label": "-",
                                    "status": "error", "error": _error(e)})
            if jax_layout is not None:
                try:
                    variants += self._jax_variants(inputs, jax_layout)
                except Exception as e:  # noqa: BLE001 - e.g. the module moved in this jax
                    skipped.append({"impl": "jax_paged_attention", "label": "-",
                                    "status": "error", "error": _error(e)})
        probe = None
        if variants:
            probe = Variant(impl="probe", label="loop overhead", fn=loop_probe(self.reps),
                            args=(per_call(inputs.q, self.copies, self.reps),
                                  per_call(inputs.block_tables, self.copies, self.reps)),
                            ops_per_call=self.reps, pooled=False)
            variants.append(probe)

        compile_all(variants, s.compile_threads)

        rows = min(shape.batch, REF_ROWS)
        try:
            self.ref = oracle_rows(inputs, last, rows)
            self.ref_kind, self.ref_rows = f"float64 oracle, rows 0..{rows - 1}", rows
        except Exception as e:  # noqa: BLE001
            self.record["reference_error"] = _error(e)
        for row in skipped:
            row.update(shape=shape.name, kind="decode")
            self.rows.append(row)
            self._print(row)
        for v in variants:
            if v.impl != "probe":
                self._run_decode(v)
        if probe is not None and probe.compiled is not None:
            try:
                t = measure(lambda: probe.compiled(*probe.args), probe.ops_per_call, s)
                self.record["loop_overhead_us"] = t.median_us
            except Exception as e:  # noqa: BLE001
                self.record["loop_overhead_error"] = _error(e)
        if jax_layout is not None:
            for x in jax_layout[:3]:
                x.delete()
            for x in jax_layout[3]:
                x.delete()
        if self.tune:
            self._tune(inputs, default_cfg, heuristic)

    def _jax_variants(self, inputs, jax_layout) -> list[Variant]:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

        q_scaled, k_pages, v_pages, scales = jax_layout
        out = []
        configs = jax_pa_configs(self.shape, self.shape.max_blocks, self.s.jax_configs, self.sms)
        for c in configs:
            call = _jax_pa_call(jax_pa, c, interpret=self.s.interpret)
            label = f"pp{c['pages_per_compute_block']}/ks{c['k_splits']}/w{c['num_warps']}"
            args = self._decode_args(inputs, q=q_scaled)
            args = (args[0], k_pages, v_pages, args[3], args[4], *scales)
            out.append(self._decode_variant("jax_paged_attention", label, call, args, c))
        return out

    def _jax_layout(self, inputs):
        """JAX paged_attention's inputs: pages ``[KVH, num_blocks, block_size, D]``, queries
        pre-multiplied by the softmax scale (it applies none), per-token fp8 scale arrays."""
        shape = self.shape
        scale = 1.0 / math.sqrt(shape.head_dim)
        to_pages = jax.jit(lambda c: jnp.transpose(c, (2, 0, 1, 3)))
        k_pages, v_pages = to_pages(inputs.k_cache), to_pages(inputs.v_cache)
        q_scaled = jax.jit(lambda q: (q.astype(jnp.float32) * scale).astype(q.dtype))(inputs.q)
        scales = ()
        if shape.is_fp8:
            pages_shape = (shape.num_kv_heads, inputs.num_blocks, shape.block_size)
            scales = (jnp.full(pages_shape, inputs.k_scale, jnp.float32),
                      jnp.full(pages_shape, inputs.v_scale, jnp.float32))
        jax.block_until_ready((k_pages, v_pages, q_scaled, scales))
        return q_scaled, k_pages, v_pages, scales

    def _run_decode(self, v: Variant) -> dict:
        row = self._row(v, kind="decode", mode=TIMING_MODE)
        if v.error is None:
            try:
                out = v.compiled(*v.args)
                jax.block_until_ready(out)
                if isinstance(out, tuple):  # loop mode: the last call's, on the last copy
                    out = out[-1]
                if self.ref is not None:
                    row.update(compare(out[: self.ref_rows], self.ref), reference=self.ref_kind)
                else:
                    row.update(correct=None, reference="none (reference failed)")
                del out
                t = measure(lambda: v.compiled(*v.args), v.ops_per_call, self.s)
                self._add_timing(row, t, self.decode_bytes)
            except Exception as e:  # noqa: BLE001
                row["status"], row["error"] = "error", _error(e)
        self.rows.append(row)
        self._print(row)
        return row

    # -- tuning ---------------------------------------------------------------------------------

    def _tune(self, inputs, default_cfg: DecodeConfig, heuristic: DecodeConfig):
        shape, s = self.shape, self.s
        budget = s.max_tune_configs
        tried: dict[DecodeConfig, dict] = {}
        default_row = next((r for r in self.rows if r["impl"] == "pallas"), None)
        if default_row is not None:
            tried[default_cfg] = default_row

        def run_stage(configs):
            nonlocal budget
            fresh = []
            for c in configs:
                if c not in tried and c not in fresh and budget > 0:
                    fresh.append(c)
                    budget -= 1
            variants = [self._ours(inputs, c, impl="pallas_tune") for c in fresh]
            compile_all(variants, s.compile_threads)
            for c, v in zip(fresh, variants):
                tried[c] = self._run_decode(v)

        def good(c):
            r = tried.get(c)
            return r is not None and r.get("status") == "ok" and r.get("correct") and \
                "median_us" in r

        def ranked():
            return sorted((c for c in tried if good(c)), key=lambda c: tried[c]["median_us"])

        print(f"  tuning {shape.name}: up to {budget} candidates", flush=True)
        run_stage(tune_stage1(shape, default_cfg, heuristic,
                              configs.PERSISTENT_PROGRAMS_PER_SM * self.sms))
        if ranked():
            run_stage(tune_stage2(shape, ranked()[0]))
        if ranked():
            run_stage(tune_stage3(ranked(), ranked()[0]))
        order = ranked()
        result = {"candidates": len(tried), "default": dataclasses.asdict(default_cfg),
                  "default_us": tried[default_cfg]["median_us"] if good(default_cfg) else None}
        if order:
            best = order[0]
            result.update(best=dataclasses.asdict(best), best_us=tried[best]["median_us"],
                          best_label=config_label(best))
            if best != default_cfg:
                best_row = dict(tried[best], impl="pallas_tuned")
                self.rows.append(best_row)
        self.record["tune"] = result

    # -- writes ---------------------------------------------------------------------------------

    def _writes(self, inputs, done: set):
        shape, s = self.shape, self.s
        base = (shape.dtype, shape.num_kv_heads, shape.head_dim, shape.block_size)
        num_slots = inputs.num_blocks * shape.block_size
        jobs = []
        step_key = base + ("step", shape.batch)
        if step_key not in done:
            jobs.append(("decode_step", step_key, min(shape.batch, num_slots), 1,
                         s.write_step_reps))
        prefill_key = base + ("prefill",)
        if prefill_key not in done:
            rot = max(1, min(4, s.write_prefill_reps))
            blocks = max(1, min(s.prefill_tokens // shape.block_size, inputs.num_blocks // rot))
            jobs.append(("prefill", prefill_key, blocks * shape.block_size, rot,
                         s.write_prefill_reps))
        if not jobs:
            self.record["writes"] = "measured with an earlier shape"
            return
        rng = np.random.default_rng([s.seed, zlib.crc32(shape.name.encode())])
        variants = []
        for kind, key, tokens, rot, reps in jobs:
            done.add(key)
            if kind == "decode_step":
                slots = rng.choice(num_slots, size=(rot, tokens), replace=False)
            else:
                per = tokens // shape.block_size
                blocks = rng.permutation(inputs.num_blocks)[: rot * per].reshape(rot, per)
                slots = (blocks[:, :, None] * shape.block_size
                         + np.arange(shape.block_size)).reshape(rot, tokens)
            slots = jnp.asarray(slots.astype(np.int32))
            for n, impl in enumerate(("xla", "pallas")):
                key_seed = int(rng.integers(0, 2**31 - 1))
                kkey, vkey = jax.random.split(jax.random.key(key_seed))
                row_shape = (tokens, shape.num_kv_heads, shape.head_dim)
                k_rows = random_normal(kkey, row_shape, shape.query_dtype)
                v_rows = random_normal(vkey, row_shape, shape.query_dtype)
                fn = self._write_fn(impl, reps, inputs.k_scale, inputs.v_scale)
                label = f"{kind}({tokens} tok)"
                v = Variant(impl=f"write_{impl}", label=label, fn=fn, ops_per_call=reps,
                            args=(inputs.k_cache, inputs.v_cache, k_rows, v_rows, slots),
                            config={"tokens": tokens, "rotations": rot, "reps": reps,
                                    "key": list(key)})
                variants.append(v)
        compile_all(variants, s.compile_threads)
        state = (inputs.k_cache, inputs.v_cache)
        for v in variants:
            state = self._run_write(v, state, inputs)
        # the caches now live in `state`; `inputs` still points at the donated originals.
        inputs.k_cache, inputs.v_cache = state

    def _write_fn(self, impl, reps, k_scale, v_scale):
        interpret = self.s.interpret or None

        def run(k_cache, v_cache, k, v, slots):
            # straight-line writes, as `repeated`'s decode calls: no host round trip between them
            rotations = [slots[j] for j in range(slots.shape[0])]
            for i in range(reps):
                k_cache, v_cache = write_kv(k_cache, v_cache, k, v, rotations[i % len(rotations)],
                                            k_scale=k_scale, v_scale=v_scale, impl=impl,
                                            interpret=interpret if impl == "pallas" else None)
            return k_cache, v_cache

        return jax.jit(run, donate_argnums=(0, 1))

    def _run_write(self, v: Variant, state, inputs):
        shape = self.shape
        tokens = v.config["tokens"]
        row = self._row(v, kind="write", key=v.config["key"])
        if v.error is not None:
            self.rows.append(row)
            self._print(row)
            return state
        k_rows, v_rows, slots = v.args[2:]
        holder = {"state": state}

        def step():
            holder["state"] = v.compiled(*holder["state"], k_rows, v_rows, slots)
            return holder["state"]

        try:
            old = holder["state"]
            jax.block_until_ready(step())
            row["donated"] = bool(old[0].is_deleted() and old[1].is_deleted())
            del old
            row["write_ok"] = self._check_write(holder["state"], k_rows, v_rows, slots,
                                                inputs.k_scale, inputs.v_scale)
            t = measure(step, v.ops_per_call, self.s)
            written = tokens * shape.kv_bytes_per_token
            read = 2 * tokens * shape.num_kv_heads * shape.head_dim * jnp.dtype(
                shape.query_dtype).itemsize + 4 * tokens
            self._add_timing(row, t, written, rw_bytes=written + read)
        except Exception as e:  # noqa: BLE001
            row["status"], row["error"] = "error", _error(e)
        self.rows.append(row)
        self._print(row)
        return holder["state"]

    def _check_write(self, state, k_rows, v_rows, slots, k_scale, v_scale) -> bool:
        """Bit-exact check of up to 256 written tokens of the first and last rotation."""
        shape = self.shape
        ok = True
        n = min(256, k_rows.shape[0])
        for r in sorted({0, slots.shape[0] - 1}):
            for cache, rows, scale in ((state[0], k_rows, k_scale), (state[1], v_rows, v_scale)):
                flat = cache.reshape(-1, shape.num_kv_heads, shape.head_dim)
                got = np.asarray(flat[slots[r, :n]])
                want = rows[:n] if scale is None else quantize_fp8(rows[:n], scale)
                want = np.asarray(want)
                ok &= got.tobytes() == want.astype(got.dtype).tobytes()
        return bool(ok)


# ----------------------------------------------------------------------------------------------
# Reporting


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "jax": jax.__version__}
    for dist in ("jaxlib", "triton", "numpy", "jax-cuda13-plugin", "jax-cuda12-plugin",
                 "jax-cuda13-pjrt", "jax-cuda12-pjrt", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict:
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": d.device_kind,
            "platform": d.platform, "sm_count": sm_count(),
            "core_count": getattr(d, "core_count", None), "num_devices": jax.device_count(),
            "host": host_platform.platform()}


def _timed_ok(r: dict) -> bool:
    return r.get("status") == "ok" and bool(r.get("correct")) and "median_us" in r


def _speedups(decode_rows: list[dict]) -> None:
    """``speedup_vs_jax`` = the best correct JAX paged_attention time / this row's time;
    ``speedup_vs_pallas`` (mosaic rows) = the Triton kernel's time with the config ``decode``
    picks (the ``pallas`` row) / this row's time, both correct."""
    by_shape: dict[str, list] = {}
    for r in decode_rows:
        by_shape.setdefault(r["shape"], []).append(r)
    for rows in by_shape.values():
        jax_rows = [r for r in rows if r["impl"] == "jax_paged_attention" and _timed_ok(r)]
        best = min((r["median_us"] for r in jax_rows), default=None)
        for r in rows:  # a wrong result never gets a speedup
            if best is not None and "median_us" in r and r.get("correct") is not False:
                r["speedup_vs_jax"] = best / r["median_us"]
        for r in jax_rows:
            r["best_of_impl"] = r["median_us"] == best
        pallas = next((r for r in rows if r["impl"] == "pallas" and _timed_ok(r)), None)
        for r in rows:
            if r["impl"] == "mosaic" and pallas is not None and _timed_ok(r):
                r["speedup_vs_pallas"] = pallas["median_us"] / r["median_us"]


def summary_rows(doc: dict) -> tuple[list, list]:
    """The rows of the two printed tables: decode (one per shape and impl) and writes."""
    decode_rows, write_rows = [], []
    for rec in doc["shapes"]:
        rows = rec.get("results", [])
        if rec.get("status") == "error":
            decode_rows.append({"shape": rec["name"], "impl": "-", "label": "-",
                                "status": "error", "error": rec.get("error", "")})
        for impl in ("pallas", "pallas_tuned", "mosaic", "xla", "jax_paged_attention"):
            cands = [r for r in rows if r["impl"] == impl]
            if not cands:
                continue
            if impl == "jax_paged_attention":
                ok = [r for r in cands if r.get("status") == "ok" and "median_us" in r]
                good = [r for r in ok if r.get("correct")]
                pick = min(good or ok, key=lambda r: r["median_us"]) if ok else cands[0]
                if ok:
                    pick = dict(pick, label=f"{pick['label']} (best of {len(cands)})")
            else:
                pick = cands[0]
            decode_rows.append(pick)
    write_rows = list(doc.get("writes", []))
    return decode_rows, write_rows


def _fmt(x, spec, missing="-"):
    return missing if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(
        x, spec)


def format_tables(doc: dict) -> str:
    decode_rows, write_rows = summary_rows(doc)
    bw = doc.get("copy_bandwidth", {}).get("tbps")
    lines = [f"device: {doc['meta']['device']['device_kind']}   copy bandwidth (same run, read +"
             f" written): {_fmt(bw, '.3f')} TB/s"]
    w = max([20] + [len(r["shape"]) for r in decode_rows])
    hdr = (f"{'shape':<{w}} {'impl':<19} {'config':<24} {'median_us':>10} {'TB/s':>6}"
           f" {'%copy':>6} {'vs_jax':>6}  check")
    lines += ["", "DECODE  (TB/s = K/V rows that must be read + q + out, per median time)", hdr,
              "-" * len(hdr)]
    for r in decode_rows:
        if r.get("status") != "ok" or "median_us" not in r:
            why = r.get("error") or r.get("reason") or ""
            lines.append(f"{r['shape']:<{w}} {r['impl']:<19} {_short(r.get('label', '-'), 24):<24}"
                         f" {r.get('status', '?').upper()}: {_short(why, 70)}")
            continue
        if r.get("nan"):
            check = "NaN!"
        elif r.get("correct") is False:
            check = f"WRONG rel={r.get('rel_err', float('nan')):.1e}"
        elif "rel_err" in r:
            check = f"ok rel={r['rel_err']:.0e} max={r['max_abs_err']:.0e}"
        else:
            check = "no reference"
        lines.append(f"{r['shape']:<{w}} {r['impl']:<19} {_short(r['label'], 24):<24}"
                     f" {r['median_us']:10.2f} {r['tbps']:6.3f} {100 * r['frac_copy_bw']:5.1f}%"
                     f" {_fmt(r.get('speedup_vs_jax'), '6.2f'):>6}  {check}")
    if write_rows:
        lines += ["", "WRITE_KV  (caches donated; %w = bytes written / time, %rw = (bytes read +"
                  " written) / time, both as % of copy bandwidth)"]
        hdr = (f"{'dtype kvh d bs':<22} {'kind':<7} {'tokens':>6} |"
               f" {'xla_us':>8} {'TB/s_w':>6} {'%w':>5} {'%rw':>5} |"
               f" {'pallas_us':>9} {'TB/s_w':>6} {'%w':>5} {'%rw':>5} | check")
        lines += [hdr, "-" * len(hdr)]
        groups: dict[tuple, dict] = {}
        for r in write_rows:
            groups.setdefault(tuple(r.get("key") or ["?"] * 5), {})[r["impl"]] = r
        for key, by_impl in groups.items():
            tokens = next(iter(by_impl.values())).get("config", {}).get("tokens", "-")
            cells, checks = [], []
            for impl, width in (("write_xla", 8), ("write_pallas", 9)):
                r = by_impl.get(impl)
                if r is None:
                    cells.append(f"{'-':>{width}} {'':>6} {'':>5} {'':>5}")
                elif r.get("status") != "ok" or "median_us" not in r:
                    cells.append(f"{'ERROR':>{width}} {'':>6} {'':>5} {'':>5}")
                    checks.append(f"{impl[6:]}: {_short(r.get('error', ''), 50)}")
                else:
                    cells.append(f"{r['median_us']:{width}.2f} {r['tbps']:6.3f}"
                                 f" {100 * r['frac_copy_bw']:5.1f}"
                                 f" {100 * r['rw_frac_copy_bw']:5.1f}")
                    if not r.get("write_ok"):
                        checks.append(f"{impl[6:]} WRONG")
                    if not r.get("donated"):
                        checks.append(f"{impl[6:]} not donated")
            name = " ".join(str(k) for k in key[:4])
            lines.append(f"{name:<22} {str(key[4]):<7} {tokens:>6} | {cells[0]} | {cells[1]} |"
                         f" {'; '.join(checks) or 'ok'}")
    lines += auto_table(doc)
    lines += ["", f"check: relative L2 / max abs error vs the float64 oracle (first {REF_ROWS}"
              f" sequences); WRONG above {REL_TOL:g}. vs_jax: best JAX paged_attention time / this"
              " time."]
    loop = [f"{r['name']} ({_fmt(r.get('loop_overhead_us'), '.2f')} us)" for r in doc["shapes"]
            if r.get("mode") == TIMING_MODE]
    if loop:
        lines.append("loop mode (times include slicing the copy's q and table per call, measured"
                     " alone in parentheses): " + ", ".join(loop))
    return "\n".join(lines)


def auto_table(doc: dict) -> list[str]:
    """The AUTO table's lines: per shape, its class, the `configs.IMPL_CHOICE` entry, the kernel
    ``impl="auto"`` picks, this run's mosaic speed-up over pallas, and why ``"auto"`` could not
    run Mosaic (if it could not). Empty when no record has the facts."""
    recs = [r for r in doc["shapes"] if "auto" in r]
    if not recs:
        return []
    w = max([20] + [len(r["name"]) for r in recs])
    hdr = (f"{'shape':<{w}} {'class':<38} {'table':<7} {'auto':<7} {'mosaic/pallas':>13}"
           f"  why auto cannot run mosaic")
    lines = ["", "AUTO  (impl='auto': the IMPL_CHOICE entry of the class on this device kind,"
             " where the Mosaic kernel can run compiled; else pallas)", hdr, "-" * len(hdr)]
    for rec in recs:
        auto = rec["auto"]
        mosaic = next((r for r in rec.get("results", []) if r["impl"] == "mosaic"), None)
        speedup = _fmt(mosaic.get("speedup_vs_pallas") if mosaic else None, ".2f")
        lines.append(f"{rec['name']:<{w}} {str(tuple(rec.get('shape_class', ()))):<38}"
                     f" {str(auto.get('table') or '-'):<7} {auto['impl']:<7} {speedup:>13}"
                     f"  {_short(auto.get('mosaic_refusal') or '-', 70)}")
    lines.append("mosaic/pallas: the pallas row's time / the mosaic row's (each with the config"
                 " decode picks); > 1: Mosaic faster.")
    return lines


def impl_choice_snippet(doc: dict) -> str:
    """``IMPL_CHOICE`` (paste into pallas_paged/decode_attention/configs.py) from this run.

    Every shape class in which both kernels ran correct and were timed gets an entry: ``"mosaic"``
    when Mosaic was at least `IMPL_MARGIN` times as fast as the ``pallas`` row (the Triton kernel
    with the config ``decode`` picks) on every shape of the class, else ``"pallas"``. Classes
    measured only on windowed shapes are comments (a class has no window, so it also covers full
    attention).
    """
    meta = doc["meta"]
    device = meta["device"]
    by_class: dict[tuple, list] = {}
    for rec in doc["shapes"]:
        rows = rec.get("results", [])
        pallas = next((r for r in rows if r["impl"] == "pallas" and _timed_ok(r)), None)
        mosaic = next((r for r in rows if r["impl"] == "mosaic" and _timed_ok(r)), None)
        if pallas is None or mosaic is None or "shape_class" not in rec:
            continue
        ratio = pallas["median_us"] / mosaic["median_us"]
        note = (f"{rec['name']}: {ratio:.2f}x ({mosaic['median_us']:.1f} us vs"
                f" {pallas['median_us']:.1f} us)")
        windowed = rec["shape"].get("sliding_window") is not None
        by_class.setdefault(tuple(rec["shape_class"]), []).append((ratio, note, windowed))
    lines = [f"# Measured with `python -m benchmarks.bench` on {device['device_kind']}"
             f" ({device['sm_count']} SMs), {meta['date'][:10]}: pallas time / mosaic time.",
             f"IMPL_CHOICE: dict[str, dict[tuple, str]] = {{{device['device_kind']!r}: {{"]
    for key, measured in by_class.items():
        full = [(ratio, note) for ratio, note, windowed in measured if not windowed]
        notes = "; ".join(note for _, note, _ in measured)
        if full:
            faster = "mosaic" if all(ratio >= IMPL_MARGIN for ratio, _ in full) else "pallas"
            lines.append(f"    {key!r}: {faster!r},  # {notes}")
        else:
            lines.append(f"    # (windowed shapes only) {key!r}  # {notes}")
    lines.append("}}")
    return "\n".join(lines)


def tuned_snippet(doc: dict) -> str:
    """``TUNED`` entries (paste into pallas_paged/decode_attention/configs.py) for shapes whose best config differs
    from the default; sliding-window shapes and key collisions are left as comments."""
    meta = doc["meta"]
    device = meta["device"]
    lines = [f"# Measured with `python -m benchmarks.bench --tune` on {device['device_kind']}"
             f" ({device['sm_count']} SMs), {meta['date'][:10]}.",
             "TUNED: dict[tuple, DecodeConfig] = {"]
    seen: dict[tuple, tuple] = {}
    for rec in doc["shapes"]:
        t = rec.get("tune")
        if not t or "best" not in t or "shape_class" not in rec:
            continue
        key = tuple(rec["shape_class"])
        best = DecodeConfig(**t["best"])
        gain = (t["default_us"] / t["best_us"]) if t.get("default_us") else float("nan")
        comment = (f"{rec['name']}: {t['best_us']:.1f} us vs {_fmt(t.get('default_us'), '.1f')} us"
                   f" default ({gain:.2f}x)")
        entry = (f"    {key!r}: DecodeConfig(block_k={best.block_k}, num_splits={best.num_splits},"
                 f" num_warps={best.num_warps}, num_stages={best.num_stages}"
                 + (", merge_in_kernel=True" if best.merge_in_kernel else "")
                 + (", fp8_v_at_load=True" if best.fp8_v_at_load else "")
                 + (", fp8_pairs=True" if best.fp8_pairs else "") + f"),  # {comment}")
        prefix = None
        if rec["shape"].get("sliding_window") is not None:
            prefix = "windowed shape: its class also covers full attention"
        elif t["best"] == t["default"]:
            prefix = "already the default"
        elif math.isfinite(gain) and gain < 1.02:
            prefix = "within 2%"
        elif key in seen:
            prefix = f"same class as {seen[key][0]}"
        if prefix is None:
            seen[key] = (rec["name"], gain)
            lines.append(entry)
        else:
            lines.append(f"    # ({prefix}) {entry.strip()}")
    lines.append("}")
    return "\n".join(lines)


def write_plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode_rows, write_rows = summary_rows(doc)
    impls = ["pallas", "pallas_tuned", "mosaic", "xla", "jax_paged_attention"]
    colors = {"pallas": "C0", "pallas_tuned": "C1", "mosaic": "C4", "xla": "C2",
              "jax_paged_attention": "C3"}
    shapes = list(dict.fromkeys(r["shape"] for r in decode_rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.8 * len(shapes) + 4), 10))
    ax = axes[0]
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = []
        for name in shapes:
            r = next((r for r in decode_rows if r["shape"] == name and r["impl"] == impl
                      and r.get("status") == "ok" and "frac_copy_bw" in r), None)
            vals.append(r["frac_copy_bw"] if r and r.get("correct") is not False else 0.0)
        if any(vals):
            ax.bar(np.arange(len(shapes)) + (i - len(impls) / 2 + 0.5) * width, vals, width,
                   color=colors[impl], label=impl)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="copy bandwidth (this run)")
    ax.set_xticks(np.arange(len(shapes)), shapes, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title(f"paged decode: K/V bytes read / time, {doc['meta']['device']['device_kind']}")
    ax.legend(fontsize=8)
    ax = axes[1]
    labels = list(dict.fromkeys(
        " ".join(str(k) for k in r.get("key", [])) for r in write_rows))
    for i, (impl, color) in enumerate((("write_xla", "C2"), ("write_pallas", "C0"))):
        w_vals, rw_vals = [], []
        for label in labels:
            r = next((r for r in write_rows if r["impl"] == impl and r.get("status") == "ok"
                      and " ".join(str(k) for k in r.get("key", [])) == label
                      and "frac_copy_bw" in r), None)
            w_vals.append(r["frac_copy_bw"] if r else 0.0)
            rw_vals.append(r["rw_frac_copy_bw"] if r else 0.0)
        x = np.arange(len(labels)) + (i - 0.5) * 0.4
        ax.bar(x, rw_vals, 0.4, color=color, alpha=0.35, hatch="//",
               label=f"{impl} (read+written)")
        ax.bar(x, w_vals, 0.4, color=color, label=f"{impl} (written)")
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(np.arange(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title("write_kv (donated caches)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _dump(doc: dict, path: str | None) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(doc), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Command line


def resolve_shapes(spec: str, smoke: bool) -> list[DecodeBenchShape]:
    if spec in (None, "", "all"):
        return list(SMALL_SHAPES if smoke else ALL_SHAPES)
    out = []
    for name in spec.split(","):
        name = name.strip()
        if not name:
            continue
        group = SHAPE_GROUPS.get(name)
        out.extend(group if group is not None else [shape_by_name(name)])
    return list(dict.fromkeys(out))


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def float_at_least(low: float, *, strict: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if strict else '>='} {low}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; a bad value exits 2 with argparse's message, as every option does.

    Also resolves ``--shapes`` into ``args.shape_list`` and ``--impls`` into ``args.impl_list``.
    """
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all",
                   help="comma list of shape names or groups (bench: the 13 benchmark shapes,"
                        " ext: fp8, sliding window, b64_ctx8192, all: both, small); default all"
                        " (small with --smoke); see --list")
    p.add_argument("--impls", default=None,
                   help=f"comma subset of {','.join(IMPLS)}; default all of them, or only"
                        " pallas with --tune")
    p.add_argument("--tune", action="store_true",
                   help="sweep DecodeConfig candidates per shape (bounded by --max-configs) and"
                        " print TUNED entries for pallas_paged/decode_attention/configs.py")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, minimal repetitions, interpret mode without a GPU: checks"
                        " that everything runs end to end (timings meaningless)")
    p.add_argument("--repeats", type=int_at_least(1), default=None,
                   help="timed windows per variant (7)")
    p.add_argument("--window-ms", type=float_at_least(0.0), default=None,
                   help="target window duration (10)")
    p.add_argument("--json", default=None, help="write all results here (rewritten per shape)")
    p.add_argument("--plot", default=None, help="bar chart (png) of fraction of copy bandwidth")
    p.add_argument("--jax-configs", type=int_at_least(1), default=None,
                   help="JAX paged_attention configs tried per shape (6; 24 = all valid)")
    p.add_argument("--max-configs", type=int_at_least(0), default=None,
                   help="tune candidates per shape besides the default (24)")
    p.add_argument("--compile-threads", type=int_at_least(1), default=None,
                   help="threads compiling one shape's Pallas variants (1: serial)")
    p.add_argument("--copies", type=int_at_least(0), default=0,
                   help="force this many input copies (0: automatic)")
    p.add_argument("--copy-gib", type=float_at_least(0.0, strict=True), default=None,
                   help="size of the copy-bandwidth buffer in GiB (4)")
    p.add_argument("--time-limit", type=float_at_least(0.0), default=0,
                   help="seconds: start no new shape after this (0: none); the table is still"
                        " printed. SIGTERM also stops the run and prints what was measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="keep the shapes already done in --json and skip them")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument("--plan", action="store_true",
                   help="print what a run with these flags would measure and compile, and exit")
    args = p.parse_args(argv)
    try:
        args.shape_list = resolve_shapes(args.shapes, args.smoke)
    except ValueError as e:
        p.error(f"--shapes: {e}")
    if not args.shape_list:
        p.error(f"--shapes {args.shapes!r} names no shape")
    spec = args.impls if args.impls is not None else ("pallas" if args.tune else ",".join(IMPLS))
    args.impl_list = tuple(dict.fromkeys(i.strip() for i in spec.split(",") if i.strip()))
    unknown = [i for i in args.impl_list if i not in IMPLS]
    if unknown or not args.impl_list:
        p.error(f"--impls {args.impls!r}: unknown {unknown}; choose from {','.join(IMPLS)}")
    return args


def build_settings(args) -> Settings:
    s = Settings(seed=args.seed, copies=args.copies, interpret=not has_gpu())
    if args.smoke:
        s = smoke_settings(s)
    overrides = {}
    if args.repeats is not None:
        overrides["windows"] = args.repeats
    if args.window_ms is not None:
        overrides["window_s"] = args.window_ms / 1e3
    if args.jax_configs is not None:
        overrides["jax_configs"] = args.jax_configs
    if args.max_configs is not None:
        overrides["max_tune_configs"] = args.max_configs
    if args.compile_threads is not None:
        overrides["compile_threads"] = args.compile_threads
    if args.copy_gib is not None:
        overrides["copy_bytes"] = int(args.copy_gib * 2**30)
    return dataclasses.replace(s, **overrides)


def plan(shapes, impls, s: Settings, tune: bool, sms: int) -> str:
    """What a run would do per shape (copies, mode, bytes, variants), without device work."""
    lines = [f"{'shape':<22} {'copies':>6} {'mode':<8} {'reps':>4} {'MB/call':>8} {'cache GB':>8}"
             f"  variants"]
    total, write_keys = 0, set()
    for shape in shapes:
        copies = s.copies or rotation_copies(shape, min_bytes=ROTATE_BYTES,
                                             max_copies=s.max_copies)
        reps = loop_reps(copies, s.loop_ops)
        touched = shape.expected_tokens_read() * shape.kv_bytes_per_token
        cache = copies * shape.batch * shape.capacity * shape.kv_bytes_per_token
        parts = []
        if "pallas" in impls or tune:
            parts.append("pallas 1" + (f" + tune <={s.max_tune_configs}" if tune else ""))
        mosaic_runs = "mosaic" in impls and mosaic_plan(shape, s.interpret, sms)[1] is None
        if "mosaic" in impls:
            parts.append("mosaic 1" if mosaic_runs else "mosaic not run")
        parts.append(f"auto={auto_impl(*abstract_args(shape), interpret=s.interpret)}")
        xla_bytes = 2 * shape.batch * shape.capacity * shape.num_kv_heads * shape.head_dim * 4
        if "xla" in impls:
            parts.append("xla 1" if xla_bytes <= XLA_LIMIT_BYTES else "xla skipped")
        n_jax = 0
        if "jax_paged_attention" in impls and shape.sliding_window is None:
            n_jax = len(jax_pa_configs(shape, shape.max_blocks, s.jax_configs, sms))
            parts.append(f"jax {n_jax}")
        n_write = 0
        if "write" in impls:
            base = (shape.dtype, shape.num_kv_heads, shape.head_dim, shape.block_size)
            for key in (base + ("step", shape.batch), base + ("prefill",)):
                if key not in write_keys:
                    write_keys.add(key)
                    n_write += 2
            parts.append(f"write {n_write}")
        count = (("pallas" in impls or tune) + mosaic_runs
                 + ("xla" in impls and xla_bytes <= XLA_LIMIT_BYTES)
                 + n_jax + n_write + (tune and s.max_tune_configs))
        total += count
        lines.append(f"{shape.name:<22} {copies:>6} {TIMING_MODE:<8} {reps:>4} {touched / 1e6:8.1f}"
                     f" {cache / 1e9:8.2f}  {', '.join(parts)}")
    lines.append(f"compiled variants (at most): {total}")
    return "\n".join(lines)


def _stop_on_sigterm():
    """SIGTERM (e.g. from ``timeout``) raises KeyboardInterrupt, so the table still gets printed."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.list:
        for group, members in SHAPE_GROUPS.items():
            if group == "all":
                continue
            for shape in members:
                print(f"{shape.name:<24} {group:<6} {shape.describe()}")
        return {}
    shapes, impls = args.shape_list, args.impl_list
    s = build_settings(args)
    if args.plan:
        print(plan(shapes, impls, s, args.tune, sm_count()))
        return {}
    if not has_gpu() and not args.smoke:
        print("warning: no GPU backend; Pallas runs in interpret mode and timings mean nothing"
              " (use --smoke for a quick end-to-end check)", flush=True)
    sms = sm_count()
    doc = {"meta": {"device": device_info(), "versions": _versions(),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "argv": [sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]),
                    "impls": list(impls), "tune": args.tune, "smoke": args.smoke,
                    "settings": dataclasses.asdict(s),
                    "constants": {"l2_bytes": L2_BYTES, "rotate_bytes": ROTATE_BYTES,
                                  "xla_limit_bytes": XLA_LIMIT_BYTES, "rel_tol": REL_TOL}},
           "shapes": [], "writes": []}
    done_names: set = set()
    write_keys_done: set = set()
    if args.resume and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            old = json.load(f)
        doc["shapes"] = [r for r in old.get("shapes", []) if r.get("status") == "done"]
        doc["writes"] = old.get("writes", [])
        done_names = {r["name"] for r in doc["shapes"]}
        write_keys_done = {tuple(w["key"]) for w in doc["writes"] if "key" in w}
        print(f"resuming: {len(done_names)} shapes already in {args.json}", flush=True)

    print(f"device: {doc['meta']['device']['device_kind']} ({sms} SMs), jax {jax.__version__};"
          f" {len(shapes)} shapes; impls {','.join(impls)}{'; tune' if args.tune else ''}",
          flush=True)
    t_start = time.perf_counter()
    interrupted = None
    previous_handler = _stop_on_sigterm()
    copy_start = measure_copy_bandwidth(s.copy_bytes, s)
    copy_tbps = copy_start["tbps"]
    doc["copy_bandwidth"] = {"start": copy_start, "tbps": copy_tbps}
    print(f"copy bandwidth (read + written, {s.copy_bytes / 2**30:.2f} GiB):"
          f" {copy_summary(copy_start)}", flush=True)
    if not math.isfinite(copy_tbps) or copy_tbps <= 0:
        copy_tbps = float("nan")

    try:
        for shape in shapes:
            if shape.name in done_names:
                continue
            if args.time_limit and time.perf_counter() - t_start > args.time_limit:
                interrupted = f"--time-limit {args.time_limit:g} s reached before {shape.name}"
                break
            t0 = time.perf_counter()
            bench = ShapeBench(shape, impls, s, copy_tbps, args.tune, sms)
            try:
                record, writes = bench.run(write_keys_done)
            except Exception as e:  # noqa: BLE001 - one shape must not end the run
                record = dict(bench.record, status="error", error=_error(e),
                              results=[r for r in bench.rows if r.get("kind") != "write"])
                writes = [r for r in bench.rows if r.get("kind") == "write"]
                print(f"  [{shape.name}] ERROR: {_short(_error(e), 200)}", flush=True)
            except KeyboardInterrupt:
                record = dict(bench.record, status="interrupted",
                              results=[r for r in bench.rows if r.get("kind") != "write"])
                writes = [r for r in bench.rows if r.get("kind") == "write"]
                interrupted = f"interrupted during {shape.name}"
            record["elapsed_s"] = round(time.perf_counter() - t0, 2)
            doc["shapes"].append(record)
            doc["writes"].extend(writes)
            _speedups([r for rec in doc["shapes"] for r in rec.get("results", [])])
            _dump(doc, args.json)
            print(f"  [{shape.name}] {record['elapsed_s']:.1f} s", flush=True)
            if interrupted:
                break
    except KeyboardInterrupt:
        interrupted = "interrupted between shapes"
    if interrupted:
        doc["interrupted"] = interrupted
        print(f"\nSTOPPED: {interrupted}; reporting what was measured", flush=True)
        copy_end = {"skipped": interrupted}
    else:
        try:
            copy_end = measure_copy_bandwidth(s.copy_bytes, s)
        except KeyboardInterrupt:
            copy_end = {"skipped": "interrupted"}
    if previous_handler is not None:
        try:
            signal.signal(signal.SIGTERM, previous_handler)
        except ValueError:
            pass
    doc["copy_bandwidth"]["end"] = copy_end
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 2)
    if args.tune:
        doc["tuned"] = {"snippet": tuned_snippet(doc),
                        "best": {r["name"]: r["tune"] for r in doc["shapes"] if r.get("tune")}}
    if {"pallas", "mosaic"} <= set(impls):
        doc["impl_choice"] = impl_choice_snippet(doc)
    tables = format_tables(doc)
    doc["table"] = tables.splitlines()
    _dump(doc, args.json)
    if args.plot:
        try:
            write_plot(doc, args.plot)
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {_error(e)}", flush=True)
    drift = copy_end.get("tbps", float("nan")) / copy_tbps if copy_tbps else float("nan")
    print(f"\ncopy bandwidth at the end: {_fmt(copy_end.get('tbps'), '.3f')} TB/s"
          f" ({_fmt(drift, '.3f')} of the start); total {doc['elapsed_s']:.0f} s", flush=True)
    if args.tune:
        print("\n" + doc["tuned"]["snippet"], flush=True)
    if "impl_choice" in doc and not s.interpret:  # interpret-mode times say nothing
        print("\n" + doc["impl_choice"], flush=True)
    print("\n" + tables, flush=True)
    return doc


def wrong_rows(doc: dict) -> list[str]:
    """``shape/impl/label`` of every row whose result was checked and found wrong: a decode output
    off the oracle (or NaN), or a write whose bits differ."""
    rows = [r for rec in doc.get("shapes", []) for r in rec.get("results", [])]
    rows += doc.get("writes", [])
    return [f"{r.get('shape')}/{r.get('impl')}/{r.get('label')}" for r in rows
            if r.get("correct") is False or r.get("write_ok") is False]


def exit_status(doc: dict) -> int:
    """0 when every checked row is right, 1 when any row is WRONG, 130 when interrupted."""
    if doc.get("interrupted"):
        return 130
    wrong = wrong_rows(doc)
    if wrong:
        print(f"\nWRONG results in {len(wrong)} rows: {', '.join(wrong)}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    result = main()
    status = exit_status(result)
    if status == 130:
        # Leave without interpreter teardown: an interrupted compile can crash it, and the
        # results are already printed and written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)

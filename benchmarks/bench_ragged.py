"""Benchmark: ragged paged attention (prefill, chunked prefill, mixed, spec decode, decode) against
the matmul peak and the copy bandwidth of the same run.

Run ``python -m benchmarks.bench_ragged [--shapes NAMES] [--sweep] [--json PATH] [--smoke]``.

Shapes (issue 13; bf16, H=32, KVH=8, D=128, block_size 16, physical blocks a random permutation):

| shape | sequences (q_len, context_len) |
|---|---|
| ``prefill_b4_q2048`` | 4 x (2048, 2048) |
| ``chunk_b1_q2048_ctx32768`` | 1 x (2048, 32768) |
| ``mixed_4x512c2560_60dec4096`` | 4 x (512, 2560) + 60 x (1, 4096) |
| ``spec_b32_q4_ctx4096`` | 32 x (4, 4096) |
| ``decode_b32_ctx4096`` | 32 x (1, 4096), through ``paged_attention`` and through ``decode`` |

Method:

- Ceilings, measured in this process before the shapes: the bf16 matmul peak (a jitted
  ``8192^3`` ``jnp.dot``, ``2 * N^3`` FLOP over its median time) and the copy bandwidth
  (`benchmarks.bench.measure_copy_bandwidth`: bytes read + written by a device copy).
- Timing: `benchmarks.bench.measure` (compilation and a correctness call outside the clock, warm-up
  calls, then the median of several windows of back-to-back calls). Every shape moves more K/V
  than the 60 MB L2 except ``prefill_b4_q2048`` (33 MB), which is compute-bound.
- FLOPs: causal, ``4 * D * H * attended pairs`` (a query at position ``p`` attends ``p + 1``
  positions). Bytes: every K/V row of every sequence read once (``sum_b n_b * KVH * D * 2 * 2``)
  plus q and the output. Roofline efficiency: ``max(flops / peak, bytes / copy_bw) / time``.
- Correctness, before any timing: the kernel's output has no NaN, its padding rows are zeros, and
  the rows of a sample of queries (the first, middle and last of some sequences) match
  ``decode(..., impl="xla")`` called with that query alone over its visible prefix
  (``context_len = p + 1``): a float32 computation on another code path. A relative L2 error above
  `benchmarks.bench.REL_TOL` marks the variant WRONG, and the run exits with status 1.
- ``--sweep`` also times a few alternative `AttentionConfig`s per shape (the best correct one is
  reported: candidates for the tuned table in ``pallas_paged/ragged_attention/configs.py``);
  ``--config bq16/sq4/w8`` (repeatable) also times the default config with the named fields
  replaced.
- ``--libdevice-exp`` also times the default config with the kernels' softmax exp as
  ``jnp.exp`` (libdevice's ``expf``) instead of `softmax_exp`'s hardware exp2, in the same run
  (`benchmarks.timing.kernel_variant`): an A/B of that one choice.

Every variant is isolated: a compile or run error is recorded and printed, and the run goes on
(exit status 2 if a default variant failed). ``--smoke`` runs tiny versions of the shapes on any
backend (Pallas interpret mode on a CPU): it checks the plumbing, not the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench import (Settings, _error, _short, _versions, compare, device_info,
                              measure, measure_copy_bandwidth, parse_config_label,
                              smoke_settings)
from benchmarks.shapes import (FP8, fp8_scales_for, query_dtype_for, random_normal,
                               store_scale_for)
from benchmarks.timing import kernel_variant, libdevice_exp_variant
from pallas_paged import AttentionConfig, decode, paged_attention
from pallas_paged._platform import device_kind, sm_count
from pallas_paged.ragged_attention import configs
from pallas_paged.ragged_attention.api import attention_shape

MATMUL_N = 8192
SMOKE_MATMUL_N = 256
REF_SEQUENCES = 4       # sequences sampled for the correctness check


@dataclasses.dataclass(frozen=True)
class RaggedBenchShape:
    """One ragged problem: ``seqs`` is a tuple of ``(count, q_len, context_len)`` groups."""

    name: str
    seqs: tuple
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"  # the caches'; q's too, except over fp8 caches (bf16 then)

    @property
    def query_dtype(self) -> str:
        return query_dtype_for(self.dtype)

    @property
    def scales(self) -> dict:
        """``k_scale`` / ``v_scale`` for an fp8 cache (`benchmarks.shapes.fp8_scales_for`), else
        none."""
        k_scale, v_scale = fp8_scales_for(self.dtype)
        return {} if k_scale is None else dict(k_scale=k_scale, v_scale=v_scale)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_lens i64[batch], context_lens i64[batch])`` in batch order."""
        q_lens = [q for count, q, _ in self.seqs for _ in range(count)]
        lens = [n for count, _, n in self.seqs for _ in range(count)]
        return np.array(q_lens, np.int64), np.array(lens, np.int64)

    @property
    def is_decode(self) -> bool:
        q_lens, _ = self.lengths()
        return bool((q_lens == 1).all())

    def describe(self) -> str:
        groups = " + ".join(f"{c} x ({q}, {n})" for c, q, n in self.seqs)
        return (f"{groups}; H={self.num_heads} KVH={self.num_kv_heads} D={self.head_dim}"
                f" bs={self.block_size} {self.dtype}")


def _shape(name, *seqs, **kwargs):
    return RaggedBenchShape(name, tuple(seqs), **kwargs)


SHAPES = (
    _shape("prefill_b4_q2048", (4, 2048, 2048)),
    _shape("chunk_b1_q2048_ctx32768", (1, 2048, 32768)),
    _shape("mixed_4x512c2560_60dec4096", (4, 512, 2560), (60, 1, 4096)),
    _shape("spec_b32_q4_ctx4096", (32, 4, 4096)),
    _shape("decode_b32_ctx4096", (32, 1, 4096)),
    _shape("fp8_mixed_4x512c2560_60dec4096", (4, 512, 2560), (60, 1, 4096), dtype=FP8),
    _shape("fp8_decode_b32_ctx4096", (32, 1, 4096), dtype=FP8),
    _shape("d256_decode_b32_ctx4096", (32, 1, 4096), head_dim=256),
)
_TINY = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
SMOKE_SHAPES = (
    _shape("smoke_prefill_b2_q24", (2, 24, 24), **_TINY),
    _shape("smoke_chunk_b1_q16_ctx80", (1, 16, 80), **_TINY),
    _shape("smoke_mixed_2x8c20_6dec30", (2, 8, 20), (6, 1, 30), **_TINY),
    _shape("smoke_spec_b4_q4_ctx40", (4, 4, 40), **_TINY),
    _shape("smoke_decode_b4_ctx40", (4, 1, 40), **_TINY),
    _shape("smoke_fp8_mixed_2x8c20_6dec30", (2, 8, 20), (6, 1, 30), dtype=FP8, **_TINY),
)


# ----------------------------------------------------------------------------------------------
# Inputs and work


@dataclasses.dataclass
class RaggedInputs:
    q: object               # [num_tokens, H, D]
    k_cache: object         # [num_blocks, bs, KVH, D]
    v_cache: object
    block_tables: object    # i32[batch, max_blocks]
    context_lens: object    # i32[batch]
    query_start_loc: object  # i32[batch + 1]
    tables_np: np.ndarray
    lens_np: np.ndarray
    qsl_np: np.ndarray
    scales: dict            # k_scale / v_scale of an fp8 cache, else empty

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc)


def make_inputs(shape: RaggedBenchShape, seed: int) -> RaggedInputs:
    """Random normal q and caches (drawn on the device), block tables from a permutation of all
    physical blocks (about 1% spare), table tails holding random valid ids."""
    rng = np.random.default_rng(seed)
    q_lens, lens = shape.lengths()
    pages = -(-lens // shape.block_size)
    max_blocks = int(pages.max())
    used = int(pages.sum())
    num_blocks = used + max(1, used // 100)
    physical = rng.permutation(num_blocks)[:used].astype(np.int32)
    tables = rng.integers(0, num_blocks, size=(len(lens), max_blocks), dtype=np.int32)
    tables[np.arange(max_blocks)[None, :] < pages[:, None]] = physical
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    keys = jax.random.split(jax.random.key(int(rng.integers(0, 2**31 - 1))), 3)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    q = random_normal(keys[0], (int(qsl[-1]), shape.num_heads, shape.head_dim),
                      shape.query_dtype)
    store_scale = store_scale_for(shape.dtype)
    k_cache = random_normal(keys[1], cache_shape, shape.dtype, scale=store_scale)
    v_cache = random_normal(keys[2], cache_shape, shape.dtype, scale=store_scale)
    return RaggedInputs(q, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(lens, jnp.int32),
                        jnp.asarray(qsl), tables, lens.astype(np.int32), qsl, shape.scales)


def work(shape: RaggedBenchShape) -> dict:
    """Causal FLOPs and the bytes that must move (K/V read once, q read, output written)."""
    q_lens, lens = shape.lengths()
    # query i of a sequence sits at p = n - q_len + i and attends p + 1 positions
    pairs = int(sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, lens)))
    kv = int(lens.sum()) * shape.num_kv_heads * shape.head_dim * jnp.dtype(shape.dtype).itemsize * 2
    q_out = (int(q_lens.sum()) * shape.num_heads * shape.head_dim
             * jnp.dtype(shape.query_dtype).itemsize * 2)
    return {"pairs": pairs, "flops": 4.0 * shape.head_dim * shape.num_heads * pairs,
            "bytes": float(kv + q_out)}


# ----------------------------------------------------------------------------------------------
# Ceilings


def measure_matmul_peak(n: int, s: Settings) -> dict:
    """bf16 ``[n, n] @ [n, n]`` (fp32 accumulation, bf16 out): ``2 n^3`` FLOP over the median
    time. Never raises: a failure is recorded and ``tflops`` is NaN."""
    try:
        ka, kb = jax.random.split(jax.random.key(1))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        compiled = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
                           .astype(jnp.bfloat16)).lower(a, b).compile()
        jax.block_until_ready(compiled(a, b))
        timing = measure(lambda: compiled(a, b), 1, s)
        return {"n": n, "median_us": timing.median_us, "windows_us": timing.windows_us,
                "tflops": 2.0 * n**3 / (timing.median_us * 1e-6) / 1e12}
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return {"n": n, "error": _error(e), "tflops": float("nan")}


# ----------------------------------------------------------------------------------------------
# Correctness


def sample_rows(inputs: RaggedInputs, count: int = REF_SEQUENCES):
    """``(rows, seq, pos)``: query rows to check: the first, middle and last query of up to
    ``count`` sequences spread over the batch (sequences with new tokens only)."""
    q_lens = np.diff(inputs.qsl_np)
    candidates = np.flatnonzero(q_lens > 0)
    chosen = candidates[np.linspace(0, len(candidates) - 1, min(count, len(candidates))).astype(int)]
    rows, seqs, positions = [], [], []
    for b in np.unique(chosen):
        q_len, n, first = int(q_lens[b]), int(inputs.lens_np[b]), int(inputs.qsl_np[b])
        for i in sorted({0, q_len // 2, q_len - 1}):
            rows.append(first + i)
            seqs.append(b)
            positions.append(n - q_len + i)
    return np.array(rows), np.array(seqs), np.array(positions)


def check(out, inputs: RaggedInputs, reference) -> dict:
    """Compare the sampled rows of ``out`` with ``reference`` (see the module doc)."""
    rows, _, _ = sample_rows(inputs)
    out_np = np.asarray(out[jnp.asarray(rows)]).astype(np.float32)
    result = compare(out_np, reference)
    result["nan_anywhere"] = bool(jnp.isnan(out).any())
    result["correct"] = result["correct"] and not result["nan_anywhere"]
    return result


def reference_rows(inputs: RaggedInputs, scale: float | None = None):
    """float32 ``decode(impl="xla")`` of each sampled query alone over positions ``0..p``."""
    rows, seqs, positions = sample_rows(inputs)
    q = inputs.q[jnp.asarray(rows)]
    tables = inputs.block_tables[jnp.asarray(seqs)]
    lens = jnp.asarray(positions + 1, jnp.int32)
    ref = decode(q, inputs.k_cache, inputs.v_cache, tables, lens, scale, impl="xla",
                 **inputs.scales)
    return np.asarray(ref).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Variants


def candidate_configs(shape: RaggedBenchShape, default: AttentionConfig) -> list:
    """A few alternatives around the default config (``--sweep``)."""
    out = []
    if shape.is_decode or default.block_q <= 4:
        for splits in sorted({1, 2, 4, max(1, default.num_splits * 2)}):
            for block_k in (64, 128):
                out.append(dataclasses.replace(default, num_splits=splits, block_k=block_k))
    else:
        short = max(1, 16 // (shape.num_heads // shape.num_kv_heads))  # a 16-row short tile
        for block_q, with_short, block_k, warps, stages in [
                (16, False, 64, 4, 3), (16, True, 64, 4, 3), (16, True, 64, 4, 2),
                (16, True, 128, 4, 3), (32, True, 64, 8, 3), (32, False, 64, 8, 2),
                (8, True, 64, 4, 3)]:
            use_short = with_short and short < block_q
            out.append(dataclasses.replace(
                default, block_q=block_q, short_block_q=short if use_short else 0,
                block_k=block_k, num_warps=warps, num_stages=stages))
    return [c for c in dict.fromkeys(out) if c != default]


def parse_config(label: str) -> dict:
    """``"bq16/sq4/w8"`` (parts of `config_label`'s form, without spaces, any subset) -> the
    `AttentionConfig` fields it names."""
    return parse_config_label(label, {"bq": "block_q", "sq": "short_block_q", "bk": "block_k",
                                      "s": "num_splits", "w": "num_warps", "st": "num_stages",
                                      "pr": "fp8_pairs"}, flags=("fp8_pairs",))


def config_label(c: AttentionConfig) -> str:
    return (f"bq{c.block_q} sq{c.short_block_q} bk{c.block_k} s{c.num_splits} w{c.num_warps}"
            f" st{c.num_stages}" + (" pr1" if c.fp8_pairs else ""))


def run_variant(name: str, fn, args, check_fn, w: dict, ceilings: dict, s: Settings) -> dict:
    """Compile, check, time one variant; every failure is recorded in the row."""
    row = {"variant": name, "status": "ok"}
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 3)
        out = jax.block_until_ready(compiled(*args))
        row.update(check_fn(out))
        if not row["correct"]:
            row["status"] = "WRONG"
            return row
        timing = measure(lambda: compiled(*args), 1, s)
        t = timing.median_us * 1e-6
        row.update(median_us=timing.median_us, windows_us=timing.windows_us,
                   tflops=w["flops"] / t / 1e12, tbps=w["bytes"] / t / 1e12)
        row["frac_peak"] = row["tflops"] / ceilings["tflops"]
        row["frac_copy"] = row["tbps"] / ceilings["tbps"]
        row["roofline"] = max(w["flops"] / (ceilings["tflops"] * 1e12),
                              w["bytes"] / (ceilings["tbps"] * 1e12)) / t
    except Exception as e:  # noqa: BLE001 - recorded per variant, the run goes on
        row.update(status="error", error=_error(e))
    return row


def bench_shape(shape: RaggedBenchShape, ceilings: dict, s: Settings, sweep: bool,
                overrides: tuple = (), libdevice_exp: bool = False) -> dict:
    record = {"name": shape.name, "describe": shape.describe(), **work(shape), "rows": []}
    print(f"[{shape.name}] {shape.describe()}: {record['flops'] / 1e9:.1f} GFLOP,"
          f" {record['bytes'] / 1e6:.1f} MB", flush=True)
    try:
        inputs = make_inputs(shape, s.seed)
        reference = reference_rows(inputs)
    except Exception as e:  # noqa: BLE001
        record.update(status="error", error=_error(e))
        print(f"    INPUTS ERROR: {_short(record['error'], 200)}", flush=True)
        return record
    num_tokens = int(inputs.q.shape[0])

    def check_ragged(out):
        result = check(out, inputs, reference)
        pad_ok = bool((out[int(inputs.qsl_np[-1]):] == 0).all()) if num_tokens else True
        result["correct"] = result["correct"] and pad_ok
        return result

    interpret = s.interpret or None
    default = configs.lookup(attention_shape(inputs.q, inputs.k_cache, inputs.block_tables),
                             device_kind(), sm_count())
    variants = [("pallas", default)]
    if sweep:
        variants += [("pallas_sweep", c) for c in candidate_configs(shape, default)]
    for fields in overrides:  # the default config with these fields replaced
        try:
            variants.append(("pallas_config", dataclasses.replace(default, **fields)))
        except ValueError as e:  # an invalid combination: a row, not a crash
            row = {"variant": "pallas_config", "status": "error", "error": str(e),
                   "label": str(fields), "default": False}
            record["rows"].append(row)
            _print_row(row)
    if libdevice_exp:  # the default config with the softmax's exp as libdevice's expf
        variants.append(("pallas_libdevice_exp", default))
    for kind, config in variants:
        fn = functools.partial(paged_attention, impl="pallas", config=config,
                               interpret=interpret, **inputs.scales)
        exp_ab = kind == "pallas_libdevice_exp"
        with kernel_variant(libdevice_exp_variant()) if exp_ab else contextlib.nullcontext():
            row = run_variant(kind, fn, inputs.args(), check_ragged, record, ceilings, s)
        row.update(label=config_label(config) + (", libdevice expf" if exp_ab else ""),
                   config=dataclasses.asdict(config), default=kind == "pallas")
        record["rows"].append(row)
        _print_row(row)
    if shape.is_decode:  # the same inputs through decode: q rows are the batch rows
        fn = functools.partial(decode, impl="pallas", interpret=interpret, **inputs.scales)
        args = inputs.args()[:5]
        row = run_variant("decode", fn, args, lambda out: check(out, inputs, reference), record,
                          ceilings, s)
        row.update(label="decode (its own config)", default=False)
        record["rows"].append(row)
        _print_row(row)
        ours = next((r for r in record["rows"] if r.get("default")), {})
        if "median_us" in row and "median_us" in ours:
            record["paged_attention_over_decode"] = ours["median_us"] / row["median_us"]
            print(f"    paged_attention / decode time: {record['paged_attention_over_decode']:.3f}",
                  flush=True)
    for x in (inputs.q, inputs.k_cache, inputs.v_cache):
        x.delete()
    record["status"] = "done"
    return record


def _print_row(row: dict) -> None:
    label = row.get("label", "")
    if "median_us" in row:
        print(f"    {row['variant']:<13} {label:<26} {row['median_us']:10.1f} us"
              f"  {row['frac_peak']:.3f} of peak  {row['frac_copy']:.3f} of copy"
              f"  roofline {row['roofline']:.3f}  rel_err={row['rel_err']:.1e}", flush=True)
    else:
        detail = row.get("error") or f"rel_err={row.get('rel_err', float('nan')):.1e}"
        print(f"    {row['variant']:<13} {label:<26} {row['status'].upper()}: {_short(detail, 120)}",
              flush=True)


# ----------------------------------------------------------------------------------------------
# Report


def format_table(doc: dict) -> str:
    c = doc["ceilings"]
    lines = [f"ceilings (same run): bf16 matmul {c['tflops']:.1f} TFLOP/s (n={c['matmul']['n']}),"
             f" copy {c['tbps']:.3f} TB/s",
             "| shape | config | time (us) | TFLOP/s | of peak | TB/s | of copy | roofline | vs decode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in doc["shapes"]:
        rows = [r for r in rec.get("rows", []) if r["variant"] != "decode"]
        # the best config: not a variant of the kernel's code (the libdevice-exp row)
        timed = [r for r in rows if "median_us" in r and r["variant"] != "pallas_libdevice_exp"]
        best = min(timed, key=lambda r: r["median_us"]) if timed else None
        default = next((r for r in rows if r.get("default")), None)
        for tag, r in (("default", default), ("best", best)):
            if r is None or (tag == "best" and r is default):
                continue
            if "median_us" not in r:
                lines.append(f"| {rec['name']} | {tag}: {r.get('label', '')} | {r['status']} |"
                             " - | - | - | - | - | - |")
                continue
            ratio = rec.get("paged_attention_over_decode") if tag == "default" else None
            lines.append(
                f"| {rec['name']} | {tag}: {r['label']} | {r['median_us']:.1f} |"
                f" {r['tflops']:.1f} | {r['frac_peak']:.3f} | {r['tbps']:.3f} |"
                f" {r['frac_copy']:.3f} | {r['roofline']:.3f} |"
                f" {'-' if ratio is None else f'{ratio:.3f}'} |")
        if rec.get("status") == "error":
            lines.append(f"| {rec['name']} | inputs | error | - | - | - | - | - | - |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="all", help="comma-separated shape names, or 'all'")
    p.add_argument("--sweep", action="store_true", help="also time alternative configs")
    p.add_argument("--config", action="append", default=[], type=parse_config,
                   help="also time the default config with these fields replaced, e.g."
                   " bq16/sq4/w8 (repeatable)")
    p.add_argument("--libdevice-exp", action="store_true",
                   help="also time the default config with jnp.exp (libdevice expf) for the"
                   " kernels' softmax instead of the hardware exp2 (softmax_exp)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, minimal repetitions")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    s = Settings(seed=args.seed, interpret=jax.default_backend() != "gpu")
    pool = SHAPES
    if args.smoke:
        s, pool = smoke_settings(s), SMOKE_SHAPES
    wanted = None if args.shapes == "all" else set(args.shapes.split(","))
    shapes = [sh for sh in pool if wanted is None or sh.name in wanted]
    if wanted is not None and len(shapes) != len(wanted):
        known = ", ".join(sh.name for sh in pool)
        print(f"unknown shapes in {args.shapes!r}; known: {known}", file=sys.stderr)
        return 2
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "argv": sys.argv,
           "device": device_info(), "versions": _versions(), "settings": dataclasses.asdict(s)}
    matmul = measure_matmul_peak(SMOKE_MATMUL_N if args.smoke else MATMUL_N, s)
    copy = measure_copy_bandwidth(s.copy_bytes, s)
    doc["ceilings"] = {"matmul": matmul, "copy": copy, "tflops": matmul["tflops"],
                       "tbps": copy["tbps"]}
    print(f"bf16 matmul peak {matmul['tflops']:.1f} TFLOP/s, copy bandwidth {copy['tbps']:.3f}"
          f" TB/s ({doc['device']['device_kind']})", flush=True)
    doc["shapes"] = []
    for shape in shapes:
        doc["shapes"].append(bench_shape(shape, doc["ceilings"], s, args.sweep,
                                         tuple(args.config), args.libdevice_exp))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1, default=str)
    print()
    print(format_table(doc))
    rows = [r for rec in doc["shapes"] for r in rec.get("rows", [])]
    if any(r["status"] == "WRONG" for r in rows):
        print("WRONG results: see the rows above", file=sys.stderr)
        return 1
    defaults_failed = [rec["name"] for rec in doc["shapes"] if rec.get("status") == "error"
                       or any(r.get("default") and r["status"] != "ok" for r in rec["rows"])]
    if defaults_failed:
        print(f"default variants failed on {defaults_failed}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

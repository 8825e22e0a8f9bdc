"""The bounded config sweeps that fill the tuned tables, and their entries for this device kind.

    python -m benchmarks.tune decode|ragged [--impl pallas|mosaic] [--shapes NAMES|all]
        [--json F] [--write] [--smoke]

- ``decode`` (``--impl pallas``, the default): `DecodeConfig` in three stages: tile size x splits
  around the heuristic's at K/V rings one and two tiles deep (and persistent programs); warps x
  stages x the fp8 operand paths at the best; the runners-up tiles with the best warps and
  stages. The table: ``TUNED`` of ``pallas_paged/decode_attention/pallas_triton_config.py``.
  Shapes: `benchmarks.shapes.DECODE_SHAPES` (a windowed one tunes the class of its span).
- ``decode --impl mosaic``: `MosaicDecodeConfig` around the heuristic's (queries in N or M,
  consumers, splits, stages, tile size) that the kernel takes; ``MOSAIC_TUNED`` of
  ``mosaic_gpu_config.py``.
- ``ragged``: `AttentionConfig` around the heuristic's (splits and tiles for decode-like shapes,
  query tiles, short tiles, warps and stages for the others); ``TUNED`` of
  ``pallas_paged/ragged_attention/pallas_triton_config.py``.
- ``ragged --impl mosaic``: `MosaicAttentionConfig` (tile size, stages, consumers, ping-pong)
  that the kernel takes; ``MOSAIC_TUNED`` of ``ragged_attention/mosaic_gpu_config.py``.

Each candidate is checked against the float64 oracle before it is timed, as `benchmarks.decode`
and `benchmarks.ragged` check and time their rows (loop mode); a WRONG candidate is never best
and makes the exit status 1. At most `MAX_CANDIDATES` per shape besides the heuristic's config
and the table's current entry. A shape class gets an entry where its best config ran at least
`TUNE_MARGIN` times as fast as the heuristic's on the first shape of the class in this run, and
loses its entry otherwise (the heuristic does as well). The entries print in the bare form of
the config modules; ``--write`` rewrites this device kind's entries in the module in place,
keeping the other device kinds' and the classes this run did not measure.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import sys
import textwrap

import jax.numpy as jnp

from benchmarks import _cli
from benchmarks.shapes import (DECODE_SHAPES, DECODE_SMOKE, RAGGED_SHAPES, RAGGED_SMOKE,
                               make_decode_inputs, make_ragged_inputs, rotation_copies)
from benchmarks.timing import loop_reps, per_call, straight_line
from pallas_paged import (AttentionConfig, DecodeConfig, MosaicDecodeConfig, decode,
                          paged_attention)
from pallas_paged._platform import device_kind, next_power_of_2, sm_count
from pallas_paged._triton_common import kv_ring_depth
from pallas_paged.decode_attention import mosaic_gpu, mosaic_gpu_config, pallas_triton_config
from pallas_paged.decode_attention.api import decode_shape
from pallas_paged.decode_attention.shape import shape_class as decode_class
from pallas_paged.ragged_attention import mosaic_gpu as ragged_mosaic
from pallas_paged.ragged_attention import mosaic_gpu_config as ragged_mosaic_config
from pallas_paged.ragged_attention import pallas_triton_config as ragged_config
from pallas_paged.ragged_attention.mosaic_gpu_config import MosaicAttentionConfig
from pallas_paged.ragged_attention.api import attention_shape
from pallas_paged.ragged_attention.shape import shape_class as ragged_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_CANDIDATES = 40     # per shape, besides the heuristic's config and the table's entry
SMOKE_CANDIDATES = 2
TUNE_MARGIN = 1.02      # an entry must beat the heuristic's config by this much
SMEM_BYTES = 220 * 1024  # decode candidates whose K/V tiles alone pass this are not tried
# (module, table, key fields): where each sweep's entries go
TABLES = {
    ("decode", "pallas"): ("pallas_paged/decode_attention/pallas_triton_config.py", "TUNED",
                           "cache dtype, head_dim, group, block_size, batch, span"),
    ("decode", "mosaic"): ("pallas_paged/decode_attention/mosaic_gpu_config.py", "MOSAIC_TUNED",
                           "cache dtype, head_dim, group, block_size, batch, span"),
    ("ragged", "pallas"): ("pallas_paged/ragged_attention/pallas_triton_config.py", "TUNED",
                           "cache dtype, head_dim, group, block_size, batch, num_tokens,"
                           " capacity"),
    ("ragged", "mosaic"): ("pallas_paged/ragged_attention/mosaic_gpu_config.py", "MOSAIC_TUNED",
                           "cache dtype, head_dim, group, block_size, batch, num_tokens,"
                           " capacity"),
}


# ----------------------------------------------------------------------------------------------
# Candidates: stage(shape, heuristic, ranked, sms) -> configs, ranked: the timed ones, fastest first


def _tile_bytes(shape, block_k: int, num_stages: int) -> int:
    """Shared memory of the K/V tiles in flight (`kv_ring_depth`), at 16 bits an element."""
    itemsize = max(2, jnp.dtype(shape.dtype).itemsize)
    return 2 * block_k * next_power_of_2(shape.head_dim) * itemsize * max(
        1, kv_ring_depth(num_stages))


def decode_tiles(shape, heuristic, ranked, sms) -> list:
    """Stage 1: block_k x num_splits (half, equal and twice the heuristic's) at rings one and two
    tiles deep (the split count and the ring depth win together); persistent programs with 64-
    and 128-token tiles at rings two deep."""
    capacity = shape.max_blocks * shape.block_size
    stages = (heuristic.num_stages, 5 if kv_ring_depth(heuristic.num_stages) < 2 else 2)
    h = heuristic.num_splits
    out = [dataclasses.replace(heuristic, block_k=block_k, num_splits=splits, num_stages=st)
           for st in stages for block_k in (16, 32, 64, 128)
           for splits in sorted({max(1, h // 2), h, min(64, 2 * h)})
           if block_k <= max(16, next_power_of_2(capacity)) and splits <= capacity // block_k
           and _tile_bytes(shape, block_k, st) <= SMEM_BYTES]
    programs = pallas_triton_config.PERSISTENT_PROGRAMS_PER_SM * sms
    return out + [dataclasses.replace(heuristic, block_k=block_k, num_splits=1, num_stages=5,
                                      persistent_programs=programs) for block_k in (64, 128)
                  if _tile_bytes(shape, block_k, 5) <= SMEM_BYTES]


def decode_warps(shape, heuristic, ranked, sms) -> list:
    """Stage 2, at the best tile and splits: 4 and 8 warps (fp8: 2 and 4), every distinct ring
    depth's stages, and for fp8 caches each operand path (converted in the dot's read, at load,
    as column pairs)."""
    if not ranked:
        return []
    best, fp8 = ranked[0], jnp.dtype(shape.dtype).itemsize == 1
    paths = ([dict(fp8_v_at_load=False, fp8_pairs=False), dict(fp8_v_at_load=True, fp8_pairs=False),
              dict(fp8_v_at_load=False, fp8_pairs=True)] if fp8 else [{}])
    return [dataclasses.replace(best, num_warps=w, num_stages=st, **path)
            for w in ((2, 4) if fp8 else (4, 8)) for st in (1, 2, 3, 5, 7) for path in paths
            if _tile_bytes(shape, best.block_k, st) <= SMEM_BYTES]


def decode_runners_up(shape, heuristic, ranked, sms) -> list:
    """Stage 3: the next three (block_k, num_splits) with the best warps and stages."""
    if not ranked:
        return []
    best = ranked[0]
    tiles = dict.fromkeys((c.block_k, c.num_splits, c.persistent_programs) for c in ranked[1:]
                          if (c.block_k, c.num_splits) != (best.block_k, best.num_splits))
    return [dataclasses.replace(best, block_k=bk, num_splits=s, persistent_programs=p)
            for bk, s, p in list(tiles)[:3]]


def mosaic_candidates(shape, heuristic, ranked, sms) -> list:
    """The queries in N, then in M; 2 and 1 consumers; splits x0.5, x1, x2; 2, 3, 4 and 6
    stages; 64- and 128-token tiles; the heuristic's fp8 paths and persistence where the
    combination allows them (invalid and refused configs are left out)."""
    out = []
    for in_n, consumers, factor, stages, block_k in itertools.product(
            (True, False), (2, 1), (0.5, 1, 2), (2, 3, 4, 6), (64, 128)):
        try:
            config = dataclasses.replace(
                heuristic, block_k=block_k, num_splits=max(1, int(heuristic.num_splits * factor)),
                num_stages=stages, num_consumers=consumers, queries_in_n=in_n,
                fp8_k_in_registers=heuristic.fp8_k_in_registers and in_n,
                persistent=heuristic.persistent and consumers == 1)
        except ValueError:
            continue
        try:
            mosaic_gpu.check_supported(*shape.abstract_args()[:2], config)
        except ValueError:  # e.g. more shared memory than a CTA has
            continue
        if config not in out:
            out.append(config)
    return out


def ragged_candidates(shape, heuristic, ranked, sms) -> list:
    """Decode-like shapes: 1, 2, 4 and twice the heuristic's splits with 64- and 128-token
    tiles. Others: query tiles of 8, 16 and 32 tokens with and without 16-row short tiles,
    tiles of 64 and 128 tokens, 4 and 8 warps, 2 and 3 stages (a fixed list)."""
    if shape.is_decode or heuristic.block_q <= 4:
        return [dataclasses.replace(heuristic, num_splits=s, block_k=bk)
                for s in sorted({1, 2, 4, 2 * heuristic.num_splits}) for bk in (64, 128)]
    short = max(1, 16 // (shape.num_heads // shape.num_kv_heads))  # a 16-row short tile
    return [dataclasses.replace(heuristic, block_q=bq, short_block_q=short if with_short
                                and short < bq else 0, block_k=bk, num_warps=w, num_stages=st)
            for bq, with_short, bk, w, st in ((16, False, 64, 4, 3), (16, True, 64, 4, 3),
                                              (16, True, 64, 4, 2), (16, True, 128, 4, 3),
                                              (32, True, 64, 8, 3), (32, False, 64, 8, 2),
                                              (8, True, 64, 4, 3))]


def ragged_mosaic_candidates(shape, heuristic, ranked, sms) -> list:
    """64- and 128-token tiles x 2, 3 and 4 stages x two consumers with and without ping-pong,
    and one: the configs the kernel takes for the shape (the rest are left out); the two-consumer
    ones again on persistent CTAs; where the shape has one-token sequences, the ping-pong ones
    again with ``decode_rows``; where it has sequences of at most 16 new tokens, the ping-pong
    and one-consumer ones again with the most heads of the group whose tokens fit 64 rows in a
    consumer's tile (``pack_heads``); last, the tiles and persistent ones without ping-pong
    again with ``overlap_softmax``."""
    configs = _ragged_mosaic_tiles(shape)
    ping_pong = [c for c in configs if c.ping_pong]
    one = [c for c in configs if c.num_consumers == 1]
    configs += [dataclasses.replace(c, persistent=True) for c in configs if c.num_consumers == 2]
    overlapped = [dataclasses.replace(c, overlap_softmax=True) for c in configs
                  if not c.ping_pong]
    if any(q_len == 1 for _, q_len, _ in shape.seqs):
        configs += [dataclasses.replace(c, decode_rows=True) for c in ping_pong]
    short = [q_len for _, q_len, _ in shape.seqs if 0 < q_len <= ragged_mosaic_config.PACK_BELOW]
    q, k_cache = shape.abstract_args()[:2]
    group = q.shape[1] // k_cache.shape[2]
    pack = ragged_mosaic_config.largest_pack(group, max(short)) if short else 1
    if pack > 1:
        configs += [dataclasses.replace(c, pack_heads=pack) for c in ping_pong + one]
    return [c for c in configs + overlapped if _takes(shape, c)]


def _takes(shape, config) -> bool:
    try:
        ragged_mosaic.check_supported(*shape.abstract_args()[:2], config)
    except ValueError:
        return False
    return True


def _ragged_mosaic_tiles(shape) -> list:
    out = []
    for block_kv, stages, (consumers, ping_pong) in itertools.product(
            (64, 128), (2, 3, 4), ((2, True), (2, False), (1, False))):
        config = MosaicAttentionConfig(block_kv=block_kv, num_stages=stages,
                                       num_consumers=consumers, ping_pong=ping_pong)
        if _takes(shape, config):  # else e.g. more shared memory than a CTA has
            out.append(config)
    return out


STAGES = {("decode", "pallas"): (decode_tiles, decode_warps, decode_runners_up),
          ("decode", "mosaic"): (mosaic_candidates,),
          ("ragged", "pallas"): (ragged_candidates,),
          ("ragged", "mosaic"): (ragged_mosaic_candidates,)}


# ----------------------------------------------------------------------------------------------
# The sweep


def facts(op: str, impl: str, shape) -> tuple:
    """``(shape class, heuristic's config, the table's config)`` of ``shape`` on this device."""
    kind, sms = device_kind(), sm_count()
    if op == "ragged":
        found = attention_shape(*shape.abstract_args()[:3])
        if impl == "mosaic":
            return (ragged_class(found), ragged_mosaic_config.get_mosaic_heuristic_config(found),
                    ragged_mosaic_config.lookup_mosaic(found, kind))
        return (ragged_class(found), ragged_config.get_heuristic_config(found, sms),
                ragged_config.lookup(found, kind, sms))
    found = decode_shape(*shape.abstract_args(), sliding_window=shape.sliding_window)
    if impl == "mosaic":
        return (decode_class(found), mosaic_gpu_config.get_mosaic_heuristic_config(found, sms),
                mosaic_gpu_config.lookup_mosaic(found, kind, sms))
    return (decode_class(found), pallas_triton_config.get_heuristic_config(found, sms),
            pallas_triton_config.lookup(found, kind, sms))


def tune_shape(op: str, impl: str, shape, s, interpret: bool, smoke: bool) -> dict:
    """Every candidate of ``shape``, checked then timed; the fastest correct one."""
    key, heuristic, tabled = facts(op, impl, shape)
    if op == "ragged":
        copies = rotation_copies(shape.work()["bytes"], max_copies=2 if smoke else 8)
        inputs = make_ragged_inputs(shape, seed=0, copies=copies)
    else:
        copies = rotation_copies(shape.expected_kv_bytes(), max_copies=2 if smoke else 8)
        inputs = make_decode_inputs(shape, seed=0, copies=copies)
    reps = loop_reps(copies, s.loop_ops)
    reference = inputs.reference()
    qs = per_call(inputs.q, copies, reps)  # every call its own query rows
    tables = [inputs.block_tables[i % copies] for i in range(reps)]  # i32[B, max_blocks] each
    shared = inputs.args()[1:3] + (inputs.context_lens,) + inputs.args()[5:]
    print(f"[{shape.name}] class {_cli.source(key)}, heuristic {_cli.config_label(heuristic)}",
          flush=True)
    results, budget = {}, SMOKE_CANDIDATES if smoke else MAX_CANDIDATES

    def run(configs, counted=True):
        nonlocal budget
        for config in configs:
            if config in results or (counted and budget <= 0):
                continue
            budget -= counted
            if op == "ragged":
                def call(q, t, k, v, n, qsl, config=config):
                    return paged_attention(q, k, v, t, n, qsl, impl=impl, config=config,
                                           interpret=interpret, **shape.scales)
            else:
                def call(q, t, k, v, n, config=config):
                    return decode(q, k, v, t, n, impl=impl, config=config, interpret=interpret,
                                  sliding_window=shape.sliding_window, **shape.scales)
            row = {"shape": shape.name, "impl": impl, "config": _cli.config_label(config)}
            row.update(_cli.checked_timing(straight_line(call, reps), (qs, tables, *shared),
                                           reps, s, reference))
            results[config] = row
            print(_cli.table([row], [("us", "median_us", ".2f")]).splitlines()[-1], flush=True)

    run([heuristic, tabled], counted=False)
    for stage in STAGES[(op, impl)]:
        ranked = sorted((c for c, r in results.items() if _cli.timed(r)),
                        key=lambda c: results[c]["median_us"])
        run(stage(shape, heuristic, ranked, sm_count()))
    for x in qs:
        x.delete()
    inputs.delete()
    timed = [c for c, r in results.items() if _cli.timed(r)]
    best = min(timed, key=lambda c: results[c]["median_us"]) if timed else None
    base_us = results[heuristic].get("median_us")
    gain = base_us / results[best]["median_us"] if best is not None and base_us else None
    return {"shape": shape.name, "class": key, "heuristic": heuristic, "best": best,
            "gain": gain, "rows": list(results.values())}


def entries(records: list[dict]) -> dict:
    """``{class: config or None}`` from the first record of each class where both the
    heuristic's config and a best one were timed: the best where it beat the heuristic's by
    `TUNE_MARGIN`, else None (no entry). Classes with no such record are left out (untouched)."""
    out = {}
    for r in records:
        if r["class"] not in out and r["gain"] is not None:
            wins = r["gain"] >= TUNE_MARGIN and r["best"] != r["heuristic"]
            out[r["class"]] = r["best"] if wins else None
    return out


# ----------------------------------------------------------------------------------------------
# The table's text


def config_source(config) -> str:
    """``DecodeConfig(block_k=64, ...)``: every integer field whose default is not 0, and the
    others where they differ from the default."""
    defaults = dataclasses.asdict(type(config)())
    fields = [f"{k}={v!r}" for k, v in dataclasses.asdict(config).items()
              if v != defaults[k] or not (isinstance(defaults[k], bool) or defaults[k] == 0)]
    body = textwrap.fill(", ".join(fields), width=99, initial_indent=" " * 12,
                         subsequent_indent=" " * 12, break_long_words=False)
    return f"{type(config).__name__}(\n{body})"


def kind_block(kind: str, table: dict) -> list[str]:
    """The lines of one device kind's dict in a tuned table: ``"KIND": {``, an entry per class
    (``(key): Config(...)``), ``},``."""
    lines = [f"    {_cli.source(kind)}: {{"]
    for key, config in table.items():
        lines += f"        {_cli.source(key)}: {config_source(config)},".split("\n")
    return lines + ["    },"]


def snippet(op: str, impl: str, kind: str, found: dict) -> str:
    """The entries of this run for ``kind``, under one comment naming the key's fields."""
    path, name, fields = TABLES[(op, impl)]
    table = {k: c for k, c in found.items() if c is not None}
    return "\n".join([f"    # {name} in {path}; key: ({fields})"] + kind_block(kind, table))


def load_table(path: str, name: str) -> dict:
    """The table ``name`` as the module at ``path`` defines it (the file executed afresh)."""
    spec = importlib.util.spec_from_file_location(f"_tuned_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    classes = {cls.__name__: cls for cls in (DecodeConfig, MosaicDecodeConfig, AttentionConfig,
                                             MosaicAttentionConfig)}
    return {kind: {key: classes[type(c).__name__](**dataclasses.asdict(c))  # the library's own
                   for key, c in entries.items()}
            for kind, entries in getattr(module, name).items()}


def rewrite_table(path: str, name: str, kind: str, found: dict) -> dict:
    """Rewrite ``kind``'s dict of table ``name`` in the file at ``path``: ``found``'s classes set
    (a config) or dropped (None), its other classes kept, other device kinds' lines untouched.
    Returns the table as the rewritten file defines it (checked against the intended one)."""
    table = load_table(path, name)
    merged = dict(table.get(kind, {}))
    for key, config in found.items():
        if config is None:
            merged.pop(key, None)
        else:
            merged[key] = config
    with open(path) as f:
        lines = f.read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
    head = lines[start].rstrip()  # "NAME: dict[...] = {" (or "= {}")
    if head.endswith("{}"):  # an empty table on one line
        head, body, end = head[:-1], [], start
    else:
        end = next(i for i in range(start + 1, len(lines)) if lines[i] == "}")
        body = lines[start + 1:end]
    own = f"    {_cli.source(kind)}: {{"
    new = kind_block(kind, merged) if merged else []
    if own in body:
        first = body.index(own)
        last = next(i for i in range(first, len(body)) if body[i] == "    },")
        body[first:last + 1] = new
    else:
        body += new
    lines[start:end + 1] = [head + "}"] if not body else [head] + body + ["}"]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    written = load_table(path, name)
    intended = {k: v for k, v in table.items() if k != kind} | ({kind: merged} if merged else {})
    if written != intended:
        raise RuntimeError(f"{path}: the rewritten {name} is {written}, not {intended}")
    return written


def main(argv=None) -> int:
    p = _cli.parser("benchmarks.tune", __doc__)
    p.add_argument("op", choices=("decode", "ragged"))
    p.add_argument("--impl", choices=("pallas", "mosaic"), default="pallas")
    p.add_argument("--write", action="store_true",
                   help="rewrite this device kind's entries in the config module in place")
    args = p.parse_args(argv)
    if (args.op, args.impl) not in TABLES:
        p.error(f"{args.op} has no --impl {args.impl}")
    pool, smoke_pool = ((RAGGED_SHAPES, RAGGED_SMOKE) if args.op == "ragged" else
                        (DECODE_SHAPES, DECODE_SMOKE))
    shapes = _cli.pick_shapes(p, args.shapes, pool, smoke_pool, args.smoke)
    s, interpret = _cli.settings(args.smoke)
    doc = _cli.run_record("benchmarks.tune", argv, s, interpret)
    kind = doc["device"]["kind"]
    records = [tune_shape(args.op, args.impl, shape, s, interpret, args.smoke) for shape in shapes]
    found = entries(records)
    print("\nper shape: the heuristic's config, the best, its speed over the heuristic's")
    for r in records:
        gain = "-" if r["gain"] is None else f"{r['gain']:.3f}x"
        print(f"  {r['shape']:<28} {_cli.config_label(r['heuristic']):<32}"
              f" {_cli.config_label(r['best']):<32} {gain}")
    text = snippet(args.op, args.impl, kind, found)
    print(f"\nentries for {kind} (class: none where the heuristic's config does as well):\n{text}")
    doc.update(snippet=text,
               entries={_cli.source(k): _cli.config_label(c) for k, c in found.items()},
               shapes=[dict(r, heuristic=_cli.config_label(r["heuristic"]),
                            best=_cli.config_label(r["best"]), **{"class": _cli.source(r["class"])})
                       for r in records])
    if args.write:
        path, name, _ = TABLES[(args.op, args.impl)]
        rewrite_table(os.path.join(ROOT, path), name, kind, found)
        print(f"wrote {kind}'s entries of {name} in {path}")
    _cli.write_json(args.json, doc)
    rows = [row for r in records for row in r["rows"]]
    wrong = [row for row in rows if row["status"] == "WRONG"]
    failed = [r["shape"] for r in records if not _cli.timed(r["rows"][0])]
    return _cli.exit_status(wrong + [{"shape": n, "status": "error", "impl": args.impl,
                                      "config": "heuristic"} for n in failed])


if __name__ == "__main__":
    raise SystemExit(main())

"""Paged decode: every implementation side by side per shape, as fractions of the copy bandwidth
measured in the same run.

    python -m benchmarks.decode [--shapes NAMES|all] [--impls pallas,mosaic,xla,jax] [--json F]
        [--smoke]
    python -m benchmarks.decode --impls pallas,pallas_fused,mosaic,mosaic_fused   # the layouts

Per shape (`benchmarks.shapes.DECODE_SHAPES`), each implementation with the config ``decode``
picks for it (`select_kernel`):

- ``pallas``: ``decode(impl="pallas")``, the Triton kernel;
- ``mosaic``: ``decode(impl="mosaic")``, the Mosaic GPU kernel; skipped, with the kernel's own
  reason, where it cannot run here (jax < 0.11.2, a GPU before sm_90, a shape it does not take);
- ``xla``: ``decode(impl="xla")``; skipped where its gathered fp32 K/V would pass 30 GB;
- ``pallas_fused``, ``mosaic_fused`` (not by default): ``decode_fused`` on the same K/V in one
  fused cache ``[blocks, block_size, 2 * KVH, D]`` (built outside the timed region), the kernel
  reading the interleaved rows in place: the fused layout's cost beside the separate one's;
- ``jax``: JAX's shipped ``jax.experimental.pallas.ops.gpu.paged_attention``, the fastest correct
  of up to four of its configs, on its own layout (pages ``[KVH, blocks, block_size, D]``,
  queries pre-scaled, per-token fp8 scales) built outside the timed region; skipped with the
  reason where it cannot run (no such module in this jax, a sliding window, no valid config).

Figures: ``us``, the steady time of one call (`benchmarks.timing.measure`) in loop mode (16 or
more straight-line calls per dispatch, rotating over input copies that together pass 4x the L2);
``TB/s``, the bytes a call must move (the K/V rows it must read, q and the output) over that time;
``of copy``, that rate over the run's copy bandwidth. Every row is first checked against the
float64 oracle on its first 8 sequences (`benchmarks._cli.REL_TOL`): a WRONG row is not timed and
makes the exit status 1. The run ends with the kernel ``impl="auto"`` picks per shape and the
``IMPL_CHOICE`` entries this run supports (``"mosaic"`` for a class where the Mosaic kernel was
at least 2% faster on every shape of it), to paste into ``pallas_paged/decode_attention/api.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks import _cli
from benchmarks.shapes import (DECODE_SHAPES, DECODE_SMOKE, fuse_caches, make_decode_inputs,
                               rotation_copies)
from benchmarks.timing import loop_reps, per_call, straight_line
from pallas_paged import decode, decode_fused
from pallas_paged.decode_attention.api import decode_shape, select_kernel
from pallas_paged.decode_attention.shape import shape_class

IMPLS = ("pallas", "mosaic", "xla", "jax", "pallas_fused", "mosaic_fused")
DEFAULT_IMPLS = ("pallas", "mosaic", "xla", "jax")
XLA_LIMIT_BYTES = 30e9   # skip impl="xla" where its gathered fp32 K/V would pass this
# JAX's paged_attention configs tried, (k_splits, pages_per_compute_block, num_warps): its
# defaults first; those valid for the shape, at most JAX_CONFIGS of them.
JAX_CANDIDATES = ((16, 8, 8), (8, 8, 4), (4, 16, 4), (1, 16, 4), (16, 4, 4), (2, 8, 4))
JAX_CONFIGS = 4
COLUMNS = [("us", "median_us", ".2f"), ("TB/s", "tbps", ".3f"), ("of copy", "of_copy", ".3f"),
           ("rel_err", "rel_err", ".1e")]


def ours(impl: str, config, shape, interpret: bool):
    """``decode`` as a loop-mode call ``f(q, table, k_cache, v_cache, lens)``; a ``*_fused`` impl
    as ``f(q, table, kv_cache, _, lens)``, `decode_fused` over the fused cache."""
    options = dict(config=config, sliding_window=shape.sliding_window, interpret=interpret,
                   **shape.scales)
    if impl.endswith("_fused"):
        kernel = impl.removesuffix("_fused")
        return lambda q, t, kv, _, n: decode_fused(q, kv, t, n, impl=kernel, **options)
    return lambda q, t, k, v, n: decode(q, k, v, t, n, impl=impl, **options)


def jax_configs(shape) -> list[dict]:
    """The valid `JAX_CANDIDATES`: the table's pages split evenly, each compute block a power of
    two dividing its split (JAX's kernel clamps the block to the split)."""
    out = []
    for k_splits, pages, warps in JAX_CANDIDATES:
        per_split = shape.max_blocks // k_splits
        block = min(pages, per_split)
        if shape.max_blocks % k_splits or not block or per_split % block or block & (block - 1):
            continue
        config = dict(block_h=16, pages_per_compute_block=block, k_splits=k_splits,
                      num_warps=warps, num_stages=2)
        if config not in out:
            out.append(config)
    return out[:JAX_CONFIGS]


def jax_row(shape, inputs, qs, tables, reps, s, reference, interpret) -> dict:
    """JAX's paged_attention: the fastest correct of `jax_configs` (the others under
    ``tried``), on its own layout."""
    if shape.sliding_window is not None:
        return {"status": "skipped", "reason": "JAX's paged_attention has no sliding window"}
    if not jax_configs(shape):
        return {"status": "skipped", "reason": f"no valid config for {shape.max_blocks} pages"}
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    except ImportError as e:
        return {"status": "skipped", "reason": f"not in jax {jax.__version__}: {e}"}
    to_pages = jax.jit(lambda c: jnp.transpose(c, (2, 0, 1, 3)))  # [KVH, blocks, bs, D]
    pages = (to_pages(inputs.k_cache), to_pages(inputs.v_cache))
    scale = shape.head_dim ** -0.5  # it applies no softmax scale: the queries carry it
    scaled = [(q.astype(jnp.float32) * scale).astype(q.dtype) for q in qs]
    per_token = ()
    if shape.scales:  # per-token fp8 scales [KVH, blocks, bs]
        per_token = tuple(jnp.full(pages[0].shape[:3], shape.scales[k], jnp.float32)
                          for k in ("k_scale", "v_scale"))
    tried = []
    for config in jax_configs(shape):
        call = functools.partial(jax_pa.paged_attention, interpret=interpret, **config)
        fn = straight_line(lambda q, t, k, v, n, *sc, call=call: call(q, k, v, t, n, *sc), reps)
        row = _cli.checked_timing(fn, (scaled, tables, *pages, inputs.context_lens, *per_token),
                                  reps, s, reference)
        tried.append(dict(row, config=f"pp{config['pages_per_compute_block']}"
                                      f"/ks{config['k_splits']}/w{config['num_warps']}"))
    for x in pages + per_token + tuple(scaled):
        x.delete()
    good = [r for r in tried if _cli.timed(r)]
    best = min(good, key=lambda r: r["median_us"]) if good else tried[0]
    if best["status"] == "error":  # a baseline that cannot run here is not our failure
        best = {"status": "skipped", "reason": f"JAX's paged_attention failed: {best['error']}"}
    return dict(best, tried=tried)


def bench_shape(shape, impls, s, interpret: bool, copy_tbps: float, smoke: bool) -> list[dict]:
    """Every implementation of ``impls`` on ``shape``: checked, then timed (module docstring)."""
    copies = rotation_copies(shape.expected_kv_bytes(), max_copies=2 if smoke else 8)
    reps = loop_reps(copies, s.loop_ops)
    inputs = make_decode_inputs(shape, seed=0, copies=copies)
    q_bytes = shape.batch * shape.num_heads * shape.head_dim * jnp.dtype(shape.query_dtype).itemsize
    nbytes = shape.tokens_read(inputs.context_lens_np) * shape.kv_bytes_per_token + 2 * q_bytes
    print(f"[{shape.name}] {shape.describe()}: {nbytes / 1e6:.1f} MB per call, {copies} input"
          f" cop{'y' if copies == 1 else 'ies'}, {reps} calls per dispatch", flush=True)
    reference = inputs.reference()
    qs = per_call(inputs.q, copies, reps)  # every call its own query [B, H, D]
    tables = [inputs.block_tables[i % copies] for i in range(reps)]  # i32[B, max_blocks] each
    shared = (inputs.k_cache, inputs.v_cache, inputs.context_lens)
    kv = fuse_caches(inputs.k_cache, inputs.v_cache) if any(i.endswith("_fused") for i in impls) else None
    rows = []
    for impl in impls:
        row = {"shape": shape.name, "impl": impl, "config": "-", "bytes": nbytes}
        if impl.removesuffix("_fused") in ("pallas", "mosaic"):
            try:
                _, config = select_kernel(*shape.abstract_args(), impl=impl.removesuffix("_fused"),
                                          config=None, interpret=interpret,
                                          sliding_window=shape.sliding_window)
            except ValueError as e:
                row.update(status="skipped", reason=str(e))
            else:
                fn = straight_line(ours(impl, config, shape, interpret), reps)
                caches = (kv, kv, inputs.context_lens) if impl.endswith("_fused") else shared
                row.update(_cli.checked_timing(fn, (qs, tables, *caches), reps, s, reference),
                           config=_cli.config_label(config))
        elif impl == "xla":
            gathered = 2 * shape.batch * shape.max_blocks * shape.block_size * (
                shape.num_kv_heads * shape.head_dim * 4)
            if gathered > XLA_LIMIT_BYTES:
                row.update(status="skipped", reason=f"its gathered K/V: {gathered / 1e9:.0f} GB")
            else:
                fn = straight_line(ours("xla", None, shape, interpret), reps)
                row.update(_cli.checked_timing(fn, (qs, tables, *shared), reps, s, reference))
        else:
            try:
                row.update(jax_row(shape, inputs, qs, tables, reps, s, reference, interpret))
            except Exception as e:  # noqa: BLE001 - e.g. no memory for its layout: a baseline
                row.update(status="skipped", reason=f"JAX's paged_attention: {e}")
        if _cli.timed(row):
            row["tbps"] = nbytes / (row["median_us"] * 1e-6) / 1e12
            row["of_copy"] = row["tbps"] / copy_tbps
        rows.append(row)
        print(_cli.table([row], COLUMNS).splitlines()[-1], flush=True)
    for x in qs + ([kv] if kv is not None else []):
        x.delete()
    inputs.delete()
    return rows


KEY_COMMENT = "(cache dtype, head_dim, group, block_size, batch, span)"


def auto_choice(shapes, rows: list[dict], interpret: bool) -> tuple:
    """`_cli.auto_choice` for decode shapes (a windowed shape's class is its span's)."""
    return _cli.auto_choice(
        shapes, rows, interpret,
        select=lambda shape: select_kernel(*shape.abstract_args(), impl="auto", config=None,
                                           interpret=interpret,
                                           sliding_window=shape.sliding_window),
        key=lambda shape: shape_class(decode_shape(*shape.abstract_args(),
                                                   sliding_window=shape.sliding_window)))


def main(argv=None) -> int:
    p = _cli.parser("benchmarks.decode", __doc__)
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma subset of {','.join(IMPLS)}")
    args = p.parse_args(argv)
    shapes = _cli.pick_shapes(p, args.shapes, DECODE_SHAPES, DECODE_SMOKE, args.smoke)
    impls = _cli.pick_impls(p, args.impls, IMPLS)
    s, interpret = _cli.settings(args.smoke)
    doc = _cli.run_record("benchmarks.decode", argv, s, interpret)
    print(f"{doc['device']['kind']}, jax {jax.__version__}; {len(shapes)} shapes;"
          f" {','.join(impls)}", flush=True)
    doc["ceilings"] = _cli.ceilings(s, args.smoke)
    doc["rows"] = []
    for shape in shapes:
        doc["rows"] += bench_shape(shape, impls, s, interpret, doc["ceilings"]["tbps"], args.smoke)
        _cli.write_json(args.json, doc)
    picks, choice = auto_choice(shapes, doc["rows"], interpret)
    doc.update(auto=picks, impl_choice={_cli.source(k): v for k, v in choice.items()})
    _cli.write_json(args.json, doc)
    print("\n" + _cli.table(doc["rows"], COLUMNS))
    _cli.print_auto(picks, choice, interpret, where="pallas_paged/decode_attention/api.py",
                    key_comment=KEY_COMMENT)
    return _cli.exit_status(doc["rows"])


if __name__ == "__main__":
    raise SystemExit(main())

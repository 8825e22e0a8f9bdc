"""Ragged paged attention (prefill, chunked prefill, mixed batches, speculative and plain decode)
against the bf16 matmul rate and the copy bandwidth measured in the same run.

    python -m benchmarks.ragged [--shapes NAMES|all] [--impls pallas,mosaic,xla] [--json F] [--smoke]

Per shape (`benchmarks.shapes.RAGGED_SHAPES`), each implementation with the config
``paged_attention`` picks (`select_kernel`): ``pallas`` (the Triton kernel), ``mosaic`` (the
Mosaic GPU kernel; skipped, with the kernel's own reason, where it cannot run the shape),
``xla``, and (not by default) ``pallas_fused`` / ``mosaic_fused``, `paged_attention_fused` on
the same K/V in one fused cache; a shape of one new token per sequence also runs through
``decode(impl="pallas")`` on the same inputs (row ``decode``).

Figures, from the steady time of one call (``us``, `benchmarks.timing.measure`, in loop mode as
`benchmarks.decode` times): ``TFLOP/s``, the shape's causal FLOPs (``4 * head_dim * num_heads``
per attended (query, key) pair) over the time, and ``of peak``, over the bf16 matmul rate
(torch's cuBLAS 8192^3 product where torch sees a GPU, else ``jnp.dot``'s); ``TB/s``, every K/V
row read once plus q and the output over the time, and ``of copy``, over the copy bandwidth;
``roofline``, ``max(flops / peak, bytes / copy) / time``: the share of the time the tighter
ceiling accounts for; ``vs decode``, this row's time over the ``decode`` row's. Every row is
first checked against the float64 oracle on the first, middle and last query of four
sequences (each as a decode of that query over its visible prefix): a WRONG row is not timed and
makes the exit status 1.
"""

from __future__ import annotations

import jax

from benchmarks import _cli
from benchmarks.shapes import (RAGGED_SHAPES, RAGGED_SMOKE, fuse_caches, make_ragged_inputs,
                               rotation_copies)
from benchmarks.timing import loop_reps, per_call, straight_line
from pallas_paged import decode, paged_attention, paged_attention_fused
from pallas_paged.ragged_attention.api import attention_shape, select_kernel
from pallas_paged.ragged_attention.shape import shape_class

IMPLS = ("pallas", "mosaic", "xla", "pallas_fused", "mosaic_fused")
DEFAULT_IMPLS = ("pallas", "mosaic", "xla")
COLUMNS = [("us", "median_us", ".1f"), ("TFLOP/s", "tflops", ".1f"), ("of peak", "of_peak", ".3f"),
           ("TB/s", "tbps", ".3f"), ("of copy", "of_copy", ".3f"), ("roofline", "roofline", ".3f"),
           ("vs decode", "vs_decode", ".3f")]


def call(impl: str, config, shape, interpret: bool):
    """A loop-mode call ``f(q, table, k_cache, v_cache, lens, query_start_loc)``: ragged paged
    attention, or (``impl="decode"``) `decode` on the same rows."""
    if impl == "decode":
        return lambda q, t, k, v, n, qsl: decode(q, k, v, t, n, impl="pallas",
                                                 interpret=interpret, **shape.scales)
    if impl.endswith("_fused"):  # k: the fused cache [blocks, bs, 2 * KVH, D]
        return lambda q, t, kv, _, n, qsl: paged_attention_fused(
            q, kv, t, n, qsl, impl=impl.removesuffix("_fused"), config=config,
            interpret=interpret, **shape.scales)
    return lambda q, t, k, v, n, qsl: paged_attention(q, k, v, t, n, qsl, impl=impl,
                                                      config=config, interpret=interpret,
                                                      **shape.scales)


def bench_shape(shape, impls, s, interpret: bool, ceilings: dict, smoke: bool) -> list[dict]:
    """Every implementation of ``impls`` (and ``decode``) on ``shape``: checked, then timed."""
    work = shape.work()
    copies = rotation_copies(work["bytes"], max_copies=2 if smoke else 8)
    reps = loop_reps(copies, s.loop_ops)
    print(f"[{shape.name}] {shape.describe()}: {work['flops'] / 1e9:.1f} GFLOP,"
          f" {work['bytes'] / 1e6:.1f} MB, {copies} input copies", flush=True)
    inputs = make_ragged_inputs(shape, seed=0, copies=copies)
    reference = inputs.reference()
    qs = per_call(inputs.q, copies, reps)  # every call its own query rows [T, H, D]
    tables = [inputs.block_tables[i % copies] for i in range(reps)]  # i32[B, max_blocks] each
    shared = (inputs.k_cache, inputs.v_cache, inputs.context_lens, inputs.query_start_loc)
    kv = (fuse_caches(inputs.k_cache, inputs.v_cache)
          if any(impl.endswith("_fused") for impl in impls) else None)
    rows = []
    for impl in list(impls) + (["decode"] if shape.is_decode else []):
        row = {"shape": shape.name, "impl": impl, **work}
        try:
            config = None if impl == "decode" else select_kernel(
                *shape.abstract_args()[:3], impl=impl.removesuffix("_fused"),
                config=None, interpret=interpret)[1]  # decode: its own pick
        except ValueError as e:  # the Mosaic kernel's refusal, in its own words
            rows.append({**row, "config": "-", "status": "skipped", "reason": str(e)})
            continue
        row["config"] = _cli.config_label(config)
        fn = straight_line(call(impl, config, shape, interpret), reps)
        caches = (kv, kv, *shared[2:]) if impl.endswith("_fused") else shared
        row.update(_cli.checked_timing(fn, (qs, tables, *caches), reps, s, reference))
        if _cli.timed(row):
            t = row["median_us"] * 1e-6
            row.update(tflops=work["flops"] / t / 1e12, tbps=work["bytes"] / t / 1e12)
            row.update(of_peak=row["tflops"] / ceilings["tflops"],
                       of_copy=row["tbps"] / ceilings["tbps"],
                       roofline=max(work["flops"] / (ceilings["tflops"] * 1e12),
                                    work["bytes"] / (ceilings["tbps"] * 1e12)) / t)
        rows.append(row)
    decode_row = next((r for r in rows if r["impl"] == "decode" and _cli.timed(r)), None)
    for row in rows:
        if decode_row is not None and _cli.timed(row):
            row["vs_decode"] = row["median_us"] / decode_row["median_us"]
        print(_cli.table([row], COLUMNS).splitlines()[-1], flush=True)
    for x in qs + ([kv] if kv is not None else []):
        x.delete()
    inputs.delete()
    return rows


def main(argv=None) -> int:
    p = _cli.parser("benchmarks.ragged", __doc__)
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma subset of {','.join(IMPLS)}")
    args = p.parse_args(argv)
    shapes = _cli.pick_shapes(p, args.shapes, RAGGED_SHAPES, RAGGED_SMOKE, args.smoke)
    impls = _cli.pick_impls(p, args.impls, IMPLS)
    s, interpret = _cli.settings(args.smoke)
    doc = _cli.run_record("benchmarks.ragged", argv, s, interpret)
    print(f"{doc['device']['kind']}, jax {jax.__version__}; {len(shapes)} shapes", flush=True)
    doc["ceilings"] = _cli.ceilings(s, args.smoke, matmul=True)
    doc["rows"] = []
    for shape in shapes:
        doc["rows"] += bench_shape(shape, impls, s, interpret, doc["ceilings"], args.smoke)
        _cli.write_json(args.json, doc)
    picks, choice = _cli.auto_choice(
        shapes, doc["rows"], interpret,
        select=lambda shape: select_kernel(*shape.abstract_args()[:3], impl="auto", config=None,
                                           interpret=interpret),
        key=lambda shape: shape_class(attention_shape(*shape.abstract_args()[:3])))
    doc.update(auto=picks, impl_choice={_cli.source(k): v for k, v in choice.items()})
    _cli.write_json(args.json, doc)
    print("\n" + _cli.table(doc["rows"], COLUMNS))
    _cli.print_auto(picks, choice, interpret, where="pallas_paged/ragged_attention/api.py",
                    key_comment="(cache dtype, head_dim, group, block_size, batch, num_tokens,"
                                " capacity)")
    return _cli.exit_status(doc["rows"])


if __name__ == "__main__":
    raise SystemExit(main())

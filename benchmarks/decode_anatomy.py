"""Where the time of one decode call goes: the Triton kernel's call timed in pieces and against
stripped-down kernels that read the same bytes, each as a fraction of the same run's copy bandwidth.

Run ``python -m benchmarks.decode_anatomy [--shapes a,b] [--configs a] [--only x,y] [--config
LABEL ...] [--json PATH] [--smoke]`` (``--configs``: only these shapes get the config variants;
``--only``: only the variants whose label contains one of these substrings, e.g. ``decode``, or
equals one written ``=label``, e.g. ``=decode``; ``--config bk64/s16/st9/mk1`` (repeatable,
`benchmarks.bench.config_label`'s parts, any subset): also time each shape's default config with
those fields, row ``decode LABEL``; default shapes:
``b1_ctx32768``, ``fp8_b32_ctx4096``, ``b32_ctx4096`` from `benchmarks.shapes`). For each shape:

- ``decode``: `pallas_paged.decode` with the config it picks (the reference time);
- ``decode, contiguous pages``: the same with the physical blocks of every sequence in order
  (the page-table gather then reads neighbouring rows): what the random layout costs;
- ``decode, libdevice expf``: the same kernel with ``jnp.exp`` for its softmax instead of
  `pallas_triton.softmax_exp` (the hardware exp2): what that buys;
- ``decode, fp8 V converted ...`` (fp8 caches not read as column pairs): the default config
  with ``DecodeConfig.fp8_v_at_load`` the other way: where the V tile's conversion belongs;
- ``decode, N words per fp8 pair conversion`` (fp8 caches read as column pairs): the default
  with `pallas_triton.PAIR_WORDS_PER_CONVERSION` the other way (1 or 2);
- ``decode, K/V loads evict_first``: the default with `pallas_triton.KV_EVICTION_POLICY`
  ``"evict_first"`` (each cached row is read once: whether marking its L2 lines first to go
  keeps the table and the partial results in L2);
- ``decode, merge in kernel``: ``DecodeConfig.merge_in_kernel`` (the last split of each row
  merges; one launch) at the default split count, half and twice it;
- ``kernel only`` / ``merge only``: the Pallas kernel without the split merge, and the merge
  alone on the kernel's partial results (the Pallas merge kernel `decode` runs, and XLA's
  reductions, `_merge_splits`): what the second launch costs; ``kernel + the XLA merge``: decode
  as it was with XLA's merge;
- ``loop overhead``: the calls of a trivial body (one small fusion) launched the same way;
- ``empty kernel``: a kernel on the same grid that only stores one value per program: launch and
  scheduling cost;
- ``read only``: a kernel on the same grid that gathers the same K/V tiles through the table and
  only adds them up as 32-bit words: what decode's access pattern can stream without its math
  (the default's config, and with the config variants a few more tiles and splits);
- config variants around the default (splits, tile, warps, stages).

Every decode variant is checked against ``impl="xla"`` before it is timed (`benchmarks.bench.compare`;
a WRONG row makes the exit status 1). Bytes are the K/V rows read plus q and the output, as in
`benchmarks.bench`. Inputs that fit a few times in L2 rotate among copies; every variant is timed
as ``Settings.loop_ops`` straight-line calls in one jitted program (no host round trip between
calls), as `benchmarks.bench` times its loop mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_paged as pp
from benchmarks.bench import (ROTATE_BYTES, Settings, compare, config_label, parse_decode_config,
                              per_call, tool_parser, tool_setup, tool_shape_names,
                              write_tool_json)
from benchmarks.timing import (describe_error, kernel_variant, libdevice_exp_variant,
                               measure)
from benchmarks.shapes import make_decode_inputs, rotation_copies, shape_by_name
from pallas_paged.decode_attention import pallas_triton as decode_triton
from pallas_paged.decode_attention.api import picked_config
from pallas_paged.decode_attention.pallas_triton import (_merge_splits, decode_kernel_call,
                                                         merge_splits_pallas, tile_range,
                                                         tile_slots)

SHAPES = ("b1_ctx32768", "fp8_b32_ctx4096", "b32_ctx4096")
SMOKE_SHAPES = ("small_b2_ctx64", "small_fp8_b2_ctx64")


def config_variants(default: pp.DecodeConfig, fp8: bool, pairs: int) -> list:
    """Configs around ``default`` for a shape of ``pairs`` (sequence, kv head) pairs, the most
    telling first (a run may stop early).

    For fp8 caches first the K and V tiles read as column pairs (`DecodeConfig.fp8_pairs`: every
    dot operand 16-bit) with K/V rings two and three tiles deep. Then K/V rings two tiles deep
    (``num_stages=5``): `pallas_triton.kv_ring_depth` says that
    stages 2 to 4 all keep one K/V tile in flight per program, issued only after the tile before was
    consumed (the stage sweeps of 2026-12-01 measured no difference between them), and ``python -m
    benchmarks.triton_sass`` counts the K/V bytes in flight per multiprocessor that each config can
    hold. For fp8 caches these are split counts for about four programs per multiprocessor (``512 /
    pairs``; twice that for 32-token tiles), 64- and 128-token tiles, the V tile converted at load;
    for 16-bit caches the default with 5 stages, with half its splits (as many tiles in flight from
    half the programs, and half the partial results to merge; also merged in the kernel), and with
    half its tile. Then, for fp8, the entry before the current one (128-token tiles, one split, 4
    warps), small tiles of 1-2 warps with ``fp8_v_at_load`` (the fastest kind on the H200,
    2026-12-01), then 64-, 128- and 32-token tiles of 4 or 8 warps with more splits; for 16-bit
    caches split counts and tiles around the default, 8 warps, 3 stages.
    """
    def splits(programs: int) -> int:  # a power of two near programs / pairs
        return 1 << max(0, round(math.log2(max(programs / max(pairs, 1), 1))))

    out = []
    if fp8:  # first the column pairs (`DecodeConfig.fp8_pairs`) with rings 2 and 3 deep
        out += [pp.DecodeConfig(block_k=block_k, num_splits=splits(programs), num_warps=warps,
                                num_stages=stages, fp8_pairs=True)
                for block_k, programs, warps, stages in ((64, 512, 2, 5), (64, 512, 4, 5),
                                                         (64, 512, 2, 7), (64, 512, 4, 7),
                                                         (128, 256, 4, 7), (32, 1024, 2, 5))]
        out += [pp.DecodeConfig(block_k=block_k, num_splits=splits(programs), num_warps=warps,
                                num_stages=5, fp8_v_at_load=True)
                for block_k, programs, warps in ((64, 512, 4), (64, 512, 2), (128, 256, 4),
                                                 (32, 1024, 2))]
        out += [pp.DecodeConfig(block_k=128, num_splits=splits(256))]
        out += [pp.DecodeConfig(block_k=block_k, num_splits=splits(programs), num_warps=warps,
                                num_stages=stages, fp8_v_at_load=True)
                for block_k, programs, warps, stages in ((64, 1024, 2, 2), (32, 1024, 2, 2),
                                                         (32, 2048, 1, 2), (64, 512, 2, 3))]
        out += [pp.DecodeConfig(block_k=64, num_splits=splits(programs), num_stages=stages)
                for programs in (512, 1024) for stages in (3, 2)]
        out += [pp.DecodeConfig(block_k=128, num_splits=splits(512), num_stages=stages)
                for stages in (2, 3)]
        out += [pp.DecodeConfig(block_k=128, num_splits=splits(256), num_warps=8),
                pp.DecodeConfig(block_k=128, num_splits=splits(256), num_stages=3),
                pp.DecodeConfig(block_k=64, num_splits=splits(512), num_warps=8, num_stages=3),
                pp.DecodeConfig(block_k=32, num_splits=splits(1024), num_stages=3),
                pp.DecodeConfig(block_k=32, num_splits=splits(2048), num_stages=3)]
    else:
        half = max(16, default.block_k // 2)
        fewer = max(1, default.num_splits // 2)
        out += [dataclasses.replace(default, num_stages=5),
                dataclasses.replace(default, num_splits=fewer, num_stages=5),
                dataclasses.replace(default, num_splits=fewer, num_stages=5,
                                    merge_in_kernel=fewer > 1),
                dataclasses.replace(default, block_k=half, num_stages=5),
                dataclasses.replace(default, block_k=half, num_warps=2, num_stages=5)]
        for n_splits in sorted({max(1, default.num_splits // 2), default.num_splits,
                                default.num_splits * 2}):
            for block_k in sorted({default.block_k, 2 * default.block_k}):
                out.append(dataclasses.replace(default, num_splits=n_splits, block_k=block_k))
        out += [dataclasses.replace(default, num_warps=8),
                dataclasses.replace(default, num_stages=3)]
    return [c for c in dict.fromkeys(out) if c != default]


def config_words(c: pp.DecodeConfig) -> str:
    """``"bk64 s2 w4 st2"``: a config's tile, splits, warps and stages, as the rows name them."""
    return f"bk{c.block_k} s{c.num_splits} w{c.num_warps} st{c.num_stages}"


def read_only_configs(default: pp.DecodeConfig, with_configs: bool) -> list:
    """The read-only probe's configs: the default's grid and tile, and with the config variants
    also 64-token tiles with 2 and 4 splits and 128-token tiles with 2."""
    out = [default]
    if with_configs:
        out += [pp.DecodeConfig(block_k=64, num_splits=2),
                pp.DecodeConfig(block_k=64, num_splits=4),
                pp.DecodeConfig(block_k=128, num_splits=2)]
    return list(dict.fromkeys(out))


def _empty_kernel(lens_ref,  # i32[batch]
                  q_ref,     # [batch, num_heads, head_dim], not read
                  out_ref,   # f32[batch, kvh, splits]
                  ):
    """One store per program: what launching decode's grid costs."""
    del q_ref  # an operand only, so that calls on different queries stay different calls
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    out_ref[b, h, split] = lens_ref[b].astype(jnp.float32)


def empty_call(q, k_cache, block_tables, context_lens, *, config: pp.DecodeConfig,
               interpret: bool):
    """`_empty_kernel` on decode's grid ``(batch, kvh, splits)`` for ``config``."""
    kvh = k_cache.shape[2]
    batch = block_tables.shape[0]
    return pl.pallas_call(
        _empty_kernel, grid=(batch, kvh, config.num_splits),
        out_shape=jax.ShapeDtypeStruct((batch, kvh, config.num_splits), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret, name="anatomy_empty",
    )(context_lens, q)


def _read_only_kernel(lens_ref,    # i32[batch]
                      tables_ref,  # i32[batch, max_blocks]
                      q_ref,       # [batch, num_heads, head_dim], not read
                      k_ref,       # u32[num_blocks * block_size, kvh, words]: rows as words
                      v_ref,       # u32[num_blocks * block_size, kvh, words]
                      out_ref,     # u32[batch, kvh, splits]
                      *, block_size: int, block_k: int, num_splits: int):
    """Decode's reads alone: the same tiles of each (sequence, kv head, split), gathered through
    the table with the same masks, summed as 32-bit words (one integer add per word, no
    conversion, no dot): what the kernel's access pattern can stream."""
    del q_ref  # an operand only, so that calls on different queries stay different calls
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    words = k_ref.shape[2]
    num_blocks = k_ref.shape[0] // block_size
    n = jnp.clip(lens_ref[b], 0, tables_ref.shape[1] * block_size)
    first, tile_lo, tile_hi = tile_range(n, split, block_k=block_k, num_splits=num_splits,
                                         window=None)
    cols = jnp.arange(words)  # [W]

    def tile_body(tile, acc):  # acc: u32[Tk, W]
        _, valid, slot = tile_slots(tables_ref, b, tile, first, n, block_k=block_k,
                                    block_size=block_size, num_blocks=num_blocks)  # [Tk] each
        k = plgpu.load(k_ref.at[slot[:, None], h, cols[None, :]], mask=valid[:, None],
                       other=0)  # u32[Tk, W]
        v = plgpu.load(v_ref.at[slot[:, None], h, cols[None, :]], mask=valid[:, None],
                       other=0)  # u32[Tk, W]
        return acc + k + v

    acc = jax.lax.fori_loop(tile_lo, tile_hi, tile_body,
                            jnp.zeros((block_k, words), jnp.uint32))
    out_ref[b, h, split] = jnp.sum(jnp.sum(acc, axis=1), axis=0)


def as_words(cache):
    """``[num_blocks, block_size, kvh, head_dim]`` -> ``u32[num_blocks * block_size, kvh,
    words]``: the same bytes, each row as 32-bit words."""
    num_blocks, block_size, kvh, head_dim = cache.shape
    per_word = 4 // cache.dtype.itemsize
    rows = cache.reshape(num_blocks * block_size, kvh, head_dim // per_word, per_word)
    return jax.lax.bitcast_convert_type(rows, jnp.uint32)


def read_only_call(q, k_words, v_words, block_tables, context_lens, *, block_size: int,
                   config: pp.DecodeConfig, interpret: bool):
    """`_read_only_kernel` on decode's grid ``(batch, kvh, splits)`` for ``config``, over the
    caches as `as_words` gives them."""
    kvh = k_words.shape[1]
    batch = block_tables.shape[0]
    kernel = functools.partial(_read_only_kernel, block_size=block_size, block_k=config.block_k,
                               num_splits=config.num_splits)
    return pl.pallas_call(
        kernel, grid=(batch, kvh, config.num_splits),
        out_shape=jax.ShapeDtypeStruct((batch, kvh, config.num_splits), jnp.uint32),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret, name="anatomy_read_only",
    )(context_lens, block_tables, q, k_words, v_words)


def contiguous_tables(tables: np.ndarray, block_size: int, lens: np.ndarray) -> np.ndarray:
    """Each copy's sequences remapped onto the blocks they own, in ascending order: the same set
    of physical blocks (so the same cache), laid out so that neighbouring pages are neighbours."""
    out = tables.copy()
    for c in range(tables.shape[0]):
        used = [(b, j) for b in range(tables.shape[1])
                for j in range(-(-int(lens[b]) // block_size))]
        owned = np.sort(np.array([tables[c, b, j] for b, j in used]))
        for (b, j), block in zip(used, owned):
            out[c, b, j] = block
    return out


def run_shape(name: str, s: Settings, copy_tbps: float, interpret: bool,
              with_configs: bool = True, only: tuple[str, ...] = (),
              named: tuple[dict, ...] = ()) -> list:
    """Every row of one shape; ``named``: `parse_decode_config` fields, each timed over the
    default config as ``decode LABEL`` (after the default, before the other variants)."""
    shape = shape_by_name(name)
    copies = s.copies or rotation_copies(shape, min_bytes=ROTATE_BYTES, max_copies=s.max_copies)
    inputs = make_decode_inputs(shape, seed=0, copies=copies)
    scales = {} if inputs.k_scale is None else dict(k_scale=inputs.k_scale,
                                                   v_scale=inputs.v_scale)
    tokens = shape.tokens_read(inputs.context_lens_np)
    nbytes = (tokens * shape.kv_bytes_per_token
              + 2 * shape.batch * shape.num_heads * shape.head_dim * 2)
    contiguous = jnp.asarray(contiguous_tables(inputs.block_tables_np, shape.block_size,
                                               inputs.context_lens_np))
    lens = inputs.context_lens
    kc, vc = inputs.k_cache, inputs.v_cache
    default = picked_config(inputs.q[0], kc, inputs.block_tables[0])
    references = {}  # id(tables) -> impl="xla" on copy 0

    def reference(tables):
        if id(tables) not in references:
            references[id(tables)] = jax.block_until_ready(
                pp.decode(inputs.q[0], kc, vc, tables[0], lens, impl="xla", **scales))
        return references[id(tables)]
    scale = 1.0 / float(np.sqrt(shape.head_dim))
    reps = copies * max(1, -(-s.loop_ops // copies))
    qs_all = per_call(inputs.q, copies, reps)  # each call its own q: no call merged with another
    tables_all = [inputs.block_tables[i % copies] for i in range(reps)]
    contiguous = [contiguous[i % copies] for i in range(reps)]
    rows = []

    def wanted(label):
        """``--only``: a part ``=LABEL`` is that label exactly, any other part a substring."""
        return not only or any(label == part[1:] if part.startswith("=") else part in label
                               for part in only)

    def timed(label, fn, firsts=qs_all, tables_of=tables_all, check=False, config=None,
              caches=(kc, vc)):
        """Time ``fn(firsts[i], tables_of[i], *caches)`` as `benchmarks.bench` does in loop mode:
        ``reps`` straight-line calls in one jitted program (``firsts[i]`` is call ``i``'s own
        array, so XLA cannot merge calls); the first call's output is checked against the
        reference when ``check``. The caches are arguments of the jitted program: closed over,
        they would be captured as constants of it (a copy of every cache byte in each compile)."""
        if not wanted(label):
            return
        row = {"shape": name, "variant": label, "config": None if config is None else
               dataclasses.asdict(config)}
        try:
            def run(qs, ts, cs):  # straight-line calls: no host round trip between them
                return tuple(fn(qs[i], ts[i], *cs) for i in range(reps))

            compiled = jax.jit(run)
            if check:
                err = compare(jax.jit(fn)(firsts[0], tables_of[0], *caches),
                              reference(tables_of))
                row["rel_err"] = err["rel_err"]
                if not err["correct"]:
                    row["status"] = "WRONG"
                    rows.append(row)
                    print(f"  {label:44s} WRONG rel_err={err['rel_err']:.2e}", flush=True)
                    return
            jax.block_until_ready(compiled(firsts, tables_of, caches))
            timing = measure(lambda: compiled(firsts, tables_of, caches), reps, s)
            row.update(status="ok", median_us=timing.median_us,
                       of_copy=nbytes / (timing.median_us * 1e-6) / 1e12 / copy_tbps)
            print(f"  {label:44s} {timing.median_us:9.1f} us  {row['of_copy']:.3f} of copy",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row.update(status="error", error=describe_error(e))
            print(f"  {label:44s} error: {row['error']}", flush=True)
        rows.append(row)

    def decode_fn(config):
        return lambda q, t, k, v: pp.decode(q, k, v, t, lens, config=config,
                                            interpret=interpret, **scales)

    kernel_kwargs = dict(scale=scale, interpret=interpret, logits_soft_cap=None,
                         alibi_slopes=None, sliding_window=None, sinks=None,
                         k_scale=None if not scales else jnp.float32(inputs.k_scale),
                         v_scale=None if not scales else jnp.float32(inputs.v_scale))
    print(f"[{name}] {shape.describe()}: {nbytes / 1e6:.1f} MB, {copies} copies,"
          f" default {default}", flush=True)
    timed("decode", decode_fn(default), check=True, config=default)
    for fields in named:
        config = dataclasses.replace(default, **fields)
        timed(f"decode {config_label(config)}", decode_fn(config), check=True, config=config)
    timed("decode, contiguous pages", decode_fn(default), tables_of=contiguous, check=True,
          config=default)
    with kernel_variant(libdevice_exp_variant()):  # the softmax's exp as before softmax_exp
        timed("decode, libdevice expf", decode_fn(default), check=True, config=default)
    pairs = decode_triton.uses_fp8_pairs(default.fp8_pairs, kc.dtype, shape.head_dim)
    if shape.is_fp8 and not pairs:  # (the column pairs replace fp8_v_at_load)
        flipped = dataclasses.replace(default, fp8_v_at_load=not default.fp8_v_at_load)
        timed("decode, fp8 V converted " + ("at load" if flipped.fp8_v_at_load
                                           else "in the operand read"),
              decode_fn(flipped), check=True, config=flipped)
    if pairs:
        other = 3 - decode_triton.PAIR_WORDS_PER_CONVERSION  # the column pairs' other conversion
        with kernel_variant({(decode_triton, "PAIR_WORDS_PER_CONVERSION"): other}):
            timed(f"decode, {other} words per fp8 pair conversion", decode_fn(default),
                  check=True, config=default)
    with kernel_variant({(decode_triton, "KV_EVICTION_POLICY"): "evict_first"}):
        timed("decode, K/V loads evict_first", decode_fn(default), check=True, config=default)
    timed("loop overhead (slices only)",
          lambda q, t: q.astype(jnp.float32) + t[:, :1, None].astype(jnp.float32), caches=())
    if default.num_splits > 1:
        kernel = functools.partial(decode_kernel_call, config=default, **kernel_kwargs)
        timed("kernel only (no merge)", lambda q, t, k, v: kernel(q, k, v, t, lens)[0],
              config=default)
        partials = jax.jit(lambda q, t, k, v: kernel(q, k, v, t, lens))(qs_all[0],
                                                                        tables_all[0], kc, vc)
        n = jnp.asarray(inputs.context_lens_np, jnp.int32)
        o, m, l = partials
        timed("kernel + the XLA merge",
              lambda q, t, k, v: _merge_splits(*kernel(q, k, v, t, lens), n, None)[0].astype(
                  q.dtype).reshape(q.shape), check=True, config=default)
        for splits in (default.num_splits // 2, default.num_splits, 2 * default.num_splits):
            if splits > 1:  # one launch instead of two
                merged = dataclasses.replace(default, num_splits=splits, merge_in_kernel=True)
                timed(f"decode, merge in kernel, {splits} splits", decode_fn(merged), check=True,
                      config=merged)
        timed("merge only (XLA)", lambda o, ml: _merge_splits(o, *ml, n, None)[0],
              firsts=per_call(o[None], 1, reps), tables_of=[(m, l)] * reps, caches=())
        timed("merge only (Pallas kernel)",
              lambda o, ml: merge_splits_pallas(o, *ml, n, None, out_dtype=inputs.q.dtype,
                                                interpret=interpret)[0],
              firsts=per_call(o[None], 1, reps), tables_of=[(m, l)] * reps, caches=())
    timed("empty kernel (launch only)",
          lambda q, t, k: empty_call(q, k, t, lens, config=default, interpret=interpret),
          caches=(kc,))
    read_only = [(f"read only {config_words(c)}", c)
                 for c in read_only_configs(default, with_configs)]
    if any(wanted(label) for label, _ in read_only):  # the word views only when timed
        k_words, v_words = jax.block_until_ready((as_words(kc), as_words(vc)))
        for label, config in read_only:
            timed(label, lambda q, t, kw, vw, c=config: read_only_call(
                q, kw, vw, t, lens, block_size=shape.block_size, config=c,
                interpret=interpret), caches=(k_words, v_words))
        del k_words, v_words
    pairs = shape.batch * shape.num_kv_heads
    for config in config_variants(default, shape.is_fp8, pairs) if with_configs else ():
        label = (f"decode {config_words(config)}" + (" merged" if config.merge_in_kernel else "")
                 + (" vl" if config.fp8_v_at_load else "") + (" pairs" if config.fp8_pairs else ""))
        timed(label, decode_fn(config), check=True, config=config)
    return rows


def main(argv=None) -> int:
    parser = tool_parser(__doc__, "tiny shapes in interpret mode (the plumbing, not the speed)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated shapes that also get config variants (default: all)")
    parser.add_argument("--only", default=None,
                        help="comma-separated substrings: only the variants whose label has one"
                             " (=LABEL: exactly that label)")
    parser.add_argument("--config", action="append", default=[], type=parse_decode_config,
                        help="bk64/s16/st9/mk1 (any subset): also time the default config with"
                             " these fields (repeatable)")
    args = parser.parse_args(argv)
    names = tool_shape_names(args, SHAPES, SMOKE_SHAPES)
    s, interpret, copy = tool_setup(args.smoke)
    rows = []
    for name in names:
        with_configs = args.configs is None or name in args.configs.split(",")
        rows += run_shape(name, s, copy["tbps"], interpret, with_configs,
                          tuple(args.only.split(",")) if args.only else (), tuple(args.config))
    write_tool_json(args.json, copy, rows=rows)
    return 1 if any(r.get("status") == "WRONG" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

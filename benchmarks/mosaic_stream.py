"""What Mosaic GPU's TMA can stream of decode's pages: one copy per (page, kv head), or per page.

Run ``python -m benchmarks.mosaic_stream [--shapes a,b] [--smoke] [--json PATH]`` (jax >= 0.11.2;
compiled on a GPU of compute capability 9.0 or later, in Mosaic GPU's interpret mode elsewhere).

The Mosaic decode kernel reads every sequence's K and V one TMA copy per (page, kv head): a
``[block_size, head_dim]`` box whose rows lie ``num_kv_heads * head_dim`` elements apart. On the
H200 it moved about the same number of such copies per microsecond and multiprocessor (7-8) at
every shape timed, bf16 or fp8, one CTA per multiprocessor or three, so fp8 caches (2 KiB a copy)
stayed at half the copy bandwidth while bf16 (4 KiB) neared it (docs/BENCHMARKS.md). A page of all
kv heads is one contiguous ``[block_size * num_kv_heads, head_dim]`` block: one copy of 8x the
bytes. This probe times both access patterns alone, with no attention math, in the same
producer / consumer structure as the kernel (a producer warpgroup issuing the copies into a ring
of ``stages`` shared-memory stages; a consumer warpgroup waiting for each stage and freeing it):

- ``head``: grid ``(batch, kv_heads, splits)``, a tile of ``tile_tokens`` tokens is
  ``tile_tokens / block_size`` copies of ``[block_size, head_dim]`` (one kv head of a page);
- ``page``: grid ``(batch, splits)``, a tile is one page of every kv head, one copy of
  ``[block_size * num_kv_heads, head_dim]`` (the cache seen as ``[num_blocks, rows, head_dim]``).

Each consumer counts the tiles it waited for; the counts are checked against the tiles a split
must walk (a probe that skipped tiles would time fewer bytes). Bytes are the K/V rows of every
sequence; the figure is their rate as a fraction of the same run's copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.bench import (ROTATE_BYTES, Settings, loop_reps, measure, per_call, repeated,
                              smoke_settings)
from benchmarks.shapes import make_decode_inputs, rotation_copies, shape_by_name
from benchmarks.timing import measure_copy_bandwidth
from pallas_paged.decode_attention import mosaic_gpu
from pallas_paged.decode_attention.pallas_triton import tile_range


@dataclasses.dataclass(frozen=True)
class Stream:
    """One streaming variant: ``layout`` (``head`` or ``page``), tokens per tile (``head``; a
    ``page`` tile is one page), ring stages, KV splits per sequence."""

    layout: str
    stages: int
    splits: int
    tile_tokens: int = 64

    def label(self) -> str:
        tile = f"bk{self.tile_tokens}/" if self.layout == "head" else ""
        return f"{self.layout} {tile}st{self.stages}/s{self.splits}"


# shape -> variants: the decode kernel's pattern at its heuristic's tiles and splits (about one
# CTA per multiprocessor), and whole pages with splits for about as many CTAs.
VARIANTS = {
    "b32_ctx4096": (Stream("head", 2, 1), Stream("head", 4, 1), Stream("head", 2, 4),
                    Stream("page", 2, 4),
                    Stream("page", 3, 4), Stream("page", 2, 8)),
    "fp8_b32_ctx4096": (Stream("head", 2, 1), Stream("head", 4, 1), Stream("head", 2, 4),
                        Stream("page", 4, 4),
                        Stream("page", 6, 4), Stream("page", 4, 8)),
    "b1_ctx32768": (Stream("head", 2, 16, 128), Stream("page", 2, 128), Stream("page", 3, 128),
                    Stream("page", 3, 64)),
    "fp8_b8_ctx16384": (Stream("head", 2, 4), Stream("page", 4, 16), Stream("page", 6, 16)),
}
SMOKE_VARIANTS = (Stream("head", 2, 2, 32), Stream("page", 2, 2), Stream("page", 3, 1))


def stream(k_cache, v_cache, tables, lens, variant: Stream, *, interpret: bool):
    """Streams every sequence's K/V tiles as ``variant`` says; returns the tiles each consumer
    waited for, i32[batch, kv_heads or 1, splits]."""
    plgpu = mosaic_gpu._plgpu()
    num_blocks, block_size, kvh, head_dim = k_cache.shape
    batch, max_blocks = tables.shape
    per_head = variant.layout == "head"
    if per_head:
        rows, copies, block_k = block_size, variant.tile_tokens // block_size, variant.tile_tokens
        k_src, v_src = k_cache, v_cache
        heads = kvh
    else:
        rows, copies, block_k = block_size * kvh, 1, block_size
        k_src = k_cache.reshape(num_blocks, rows, head_dim)  # a page of every kv head: one block
        v_src = v_cache.reshape(num_blocks, rows, head_dim)
        heads = 1
    stages, splits = variant.stages, variant.splits

    def kernel(lens_ref, tables_ref, k_ref, v_ref, count_ref):
        # lens_ref i32[batch], tables_ref i32[batch, max_blocks] (GMEM); k_ref, v_ref: the cache,
        # [num_blocks, block_size, kvh, D] (head) or [num_blocks, block_size * kvh, D] (page);
        # count_ref i32[batch, heads, splits, 128]: tiles waited for, in every lane.
        b = jax.lax.axis_index("batch")
        h = jax.lax.axis_index("kv_head") if per_head else 0
        split = jax.lax.axis_index("split")
        n = jnp.clip(lens_ref[b], 0, max_blocks * block_size)
        _, tile_lo, tile_hi = tile_range(n, split, block_k=block_k, num_splits=splits,
                                         window=None)
        num_tiles = jnp.maximum(tile_hi - tile_lo, 0)
        last_page = jnp.maximum(n - 1, 0) // block_size

        def scoped(k_smem, v_smem, count_smem, k_bars, v_bars, free_bars):
            # k_smem, v_smem [stages, copies * rows, D]; count_smem i32[128]; barriers per stage
            wg = jax.lax.axis_index("wg")

            @pl.when(wg == 0)
            def _producer():
                @pl.loop(0, num_tiles)
                def _produce(step):
                    slot = jax.lax.rem(step, stages)
                    tile = tile_lo + step
                    blocks = [jnp.clip(tables_ref[b, jnp.minimum(tile * copies + j, last_page)],
                                       0, num_blocks - 1) for j in range(copies)]

                    @pl.when(step >= stages)
                    def _wait_free():
                        plgpu.barrier_wait(free_bars.at[slot])

                    for j, block in enumerate(blocks):
                        dst = pl.ds(j * rows, rows)
                        src_k = k_ref.at[block, :, h] if per_head else k_ref.at[block]
                        src_v = v_ref.at[block, :, h] if per_head else v_ref.at[block]
                        plgpu.copy_gmem_to_smem(src_k, k_smem.at[slot, dst], k_bars.at[slot])
                        plgpu.copy_gmem_to_smem(src_v, v_smem.at[slot, dst], v_bars.at[slot])

            @pl.when(wg == 1)
            def _consumer():
                @pl.loop(0, num_tiles)
                def _consume(step):
                    slot = jax.lax.rem(step, stages)
                    plgpu.barrier_wait(k_bars.at[slot])
                    plgpu.barrier_wait(v_bars.at[slot])

                    @pl.when(step + stages < num_tiles)
                    def _free():
                        plgpu.barrier_arrive(free_bars.at[slot])

                count_smem[...] = jnp.full((128,), num_tiles, jnp.int32)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(count_smem, count_ref.at[b, h, split])
                plgpu.wait_smem_to_gmem(0)

        tile_rows = copies * rows
        pl.run_scoped(
            scoped,
            mosaic_gpu.mma_smem(plgpu, (stages, tile_rows, head_dim), k_cache.dtype),
            mosaic_gpu.mma_smem(plgpu, (stages, tile_rows, head_dim), k_cache.dtype),
            plgpu.SMEM((128,), jnp.int32),
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            collective_axes="wg")

    grid = (batch, heads, splits)
    counts = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, heads, splits, 128), jnp.int32),
        grid=grid, grid_names=("batch", "kv_head", "split"), num_threads=2, thread_name="wg",
        kernel_name=f"mosaic_stream_{variant.layout}_st{stages}_s{splits}",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(lens.astype(jnp.int32), tables.astype(jnp.int32), k_src, v_src)
    return counts[..., 0]


def expected_tiles(lens, variant: Stream, block_size: int, heads: int) -> np.ndarray:
    """The tiles each (sequence, head, split) must wait for: i32[batch, heads, splits]."""
    block_k = variant.tile_tokens if variant.layout == "head" else block_size
    tiles = -(-np.asarray(lens, np.int64) // block_k)
    per_split = -(-tiles // variant.splits)
    splits = np.arange(variant.splits)
    share = np.clip(tiles[:, None] - splits[None, :] * per_split[:, None], 0, per_split[:, None])
    return np.broadcast_to(share[:, None, :], (len(lens), heads, variant.splits))


def run_shape(name: str, variants, s: Settings, copy_tbps: float, interpret: bool) -> list:
    """Checks and times ``variants`` on shape ``name``. Problems that fit a few times in L2
    rotate among copies of their tables (own physical blocks each) in `benchmarks.bench`'s loop
    mode: straight-line calls of one jitted program, as the decode benchmarks time them."""
    shape = shape_by_name(name)
    copies = 1 if interpret else rotation_copies(shape, min_bytes=ROTATE_BYTES, max_copies=8)
    inputs = make_decode_inputs(shape, s.seed, copies=copies)
    _, k, v, tables, lens = inputs.args(0)
    nbytes = inputs.tokens_read() * shape.kv_bytes_per_token
    reps = loop_reps(copies, s.loop_ops)
    # Every call its own table array, so XLA cannot merge two calls of one copy into one.
    call_tables = per_call(inputs.block_tables, copies, reps)
    rows = []
    for variant in variants:
        row = {"shape": name, "variant": variant.label(), "copies": copies, "reps": reps}
        try:
            one = functools.partial(stream, variant=variant, interpret=interpret)
            counts = np.asarray(jax.jit(one)(k, v, tables, lens))
            heads = shape.num_kv_heads if variant.layout == "head" else 1
            want = expected_tiles(inputs.context_lens_np, variant, shape.block_size, heads)
            row["tiles_ok"] = bool(np.array_equal(counts, want))
            if row["tiles_ok"]:
                calls = repeated(lambda _, k, v, t, n: one(k, v, t, n), reps)
                args = (call_tables, k, v, call_tables, lens)
                jax.block_until_ready(calls(*args))  # compiled outside the clock
                timing = measure(lambda: calls(*args), reps, s)
                row["us"] = timing.median_us
                row["of_copy"] = nbytes / (timing.median_us * 1e-6) / 1e12 / copy_tbps
        except Exception as e:  # noqa: BLE001 - a row, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    head = f"{row['shape']:<18} {row['variant']:<22}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    if not row["tiles_ok"]:
        return f"{head} WRONG tile counts"
    return f"{head} {row['us']:9.1f} us {row['of_copy']:6.3f} of copy"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape in interpret mode")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    mosaic_gpu.check_jax()
    interpret = args.smoke or jax.devices()[0].platform != "gpu"
    s = Settings(interpret=interpret)
    if interpret:
        s = smoke_settings(s)
    if args.smoke:
        plan = {"small_b2_ctx64": SMOKE_VARIANTS}
    else:
        names = args.shapes.split(",") if args.shapes else list(VARIANTS)
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            parser.error(f"--shapes: unknown {unknown}; known: {list(VARIANTS)}")
        plan = {n: VARIANTS[n] for n in names}
    copy = measure_copy_bandwidth(s.copy_bytes, s)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; copy bandwidth"
          f" {copy['tbps']:.3f} TB/s", flush=True)
    rows = []
    for name, variants in plan.items():
        rows += run_shape(name, variants, s, copy["tbps"], interpret)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy": copy, "rows": rows}, f, indent=1, default=str)
    return 1 if any("error" in r or not r.get("tiles_ok", True) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

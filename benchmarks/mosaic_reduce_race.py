"""The smallest Mosaic GPU kernel of the two-consumer race: warpgroups reducing WGMMA-layout arrays.

Run ``python -m benchmarks.mosaic_reduce_race [--iters N]`` (jax >= 0.11.2; compiled on a GPU of
compute capability 9.0 or later, in Mosaic GPU's interpret mode elsewhere).

The Mosaic decode kernel with ``MosaicDecodeConfig.queries_in_n`` and two consumer warpgroups
gave a wrong, run-to-run different lse on the H200 (docs/BENCHMARKS.md, "Measured: the K/V ring
and the queries in N"); with one consumer, or the queries in M, it was exact. What differs: its
consumers reduce the scores ``S^T`` (tokens x queries, in the wgmma accumulator's layout) over
axis 0, whose rows lie in all four warps of a warpgroup, so the reduction crosses warps (through
shared memory that Mosaic GPU allocates for it), where a reduction over axis 1 stays inside each
warp. This kernel keeps only that: each of ``warpgroups`` warpgroups walks its own ``iters``
tiles of ``f32[64, 8]`` (copied by TMA into its own shared memory), loads each in the WGMMA
layout, reduces it over ``axis`` with ``max`` and ``sum``, and writes the two vectors out through
its own shared memory. Every variant is compared with numpy exactly (max and sum of 64 or 8
values in fp32 in any order are within a few ulp; the check allows 1e-5 relative): one warpgroup
and axis 1 are the controls.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.bench import int_at_least

ROWS, COLS = 64, 8  # a wgmma accumulator tile of S^T: 64 tokens x a group of 8 queries
RTOL = 1e-5


def reduce_tiles(x, *, axis: int, interpret: bool, apart: bool = False):
    """``x`` f32[warpgroups, iters, ROWS, COLS] -> ``(max, sum)`` over ``axis`` of every tile,
    each f32[warpgroups, iters, ROWS or COLS]; warpgroup ``w`` reduces the tiles ``x[w]``.
    ``apart``: each warpgroup's loop lowered on its own (`mosaic_gpu.lower_apart`), so each
    cross-warp reduction's scratch lies at its own offset, as the decode kernel's consumers do."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_paged.decode_attention.mosaic_gpu import COMPILER_PARAMS, lower_apart

    warpgroups, iters = x.shape[:2]
    width = COLS if axis == 0 else ROWS

    def kernel(x_ref, max_ref, sum_ref):
        # x_ref f32[W, iters, ROWS, COLS], max_ref / sum_ref f32[W, iters, width] in GMEM
        def scoped(x_smem, out_smem, bars):
            # x_smem f32[W, ROWS, COLS], out_smem f32[W, 2, width]: one slot per warpgroup;
            # bars[W]: the TMA of warpgroup w's tile
            def reduce_one(wg, i):
                plgpu.copy_gmem_to_smem(x_ref.at[wg, i], x_smem.at[wg], bars.at[wg])
                plgpu.barrier_wait(bars.at[wg])
                tile = plgpu.load(x_smem.at[wg], layout=plgpu.Layout.WGMMA)  # f32[ROWS, COLS]
                out_smem.at[wg, 0][...] = tile.max(axis=axis)
                out_smem.at[wg, 1][...] = tile.sum(axis=axis)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, 0], max_ref.at[wg, i])
                plgpu.copy_smem_to_gmem(out_smem.at[wg, 1], sum_ref.at[wg, i])
                plgpu.wait_smem_to_gmem(0)

            def walk(wg):
                @pl.loop(0, iters)
                def _tile(i):
                    reduce_one(wg, i)

            wg = jax.lax.axis_index("wg")
            if apart:
                lower_apart(plgpu, warpgroups, lambda w: pl.when(wg == w)(lambda: walk(w)),
                            apart=True)
            else:
                walk(wg)

        pl.run_scoped(scoped, plgpu.SMEM((warpgroups, ROWS, COLS), jnp.float32),
                      plgpu.SMEM((warpgroups, 2, width), jnp.float32),
                      plgpu.Barrier(num_barriers=warpgroups), collective_axes="wg")

    out = jax.ShapeDtypeStruct((warpgroups, iters, width), jnp.float32)
    return plgpu.kernel(kernel, out_type=(out, out), num_threads=warpgroups, thread_name="wg",
                        kernel_name=f"reduce_race_w{warpgroups}_axis{axis}"
                        + ("_apart" if apart else ""),
                        compiler_params=plgpu.CompilerParams(**COMPILER_PARAMS),
                        interpret=plgpu.InterpretGPUParams() if interpret else None)(x)


# (warpgroups, axis, apart): the controls, the race, and the race's fix (`reduce_tiles`'s apart)
VARIANTS = ((1, 1, False), (1, 0, False), (2, 1, False), (2, 0, False), (2, 0, True),
            (4, 0, True))


def check(warpgroups: int, axis: int, iters: int, *, interpret: bool, seed: int = 0,
          apart: bool = False) -> dict:
    """One variant against numpy: ``{"warpgroups", "axis", "apart", "tiles", "wrong_tiles",
    "max_rel_err"}`` (a tile is wrong when its max or its sum is)."""
    x = np.random.default_rng(seed).standard_normal(
        (warpgroups, iters, ROWS, COLS)).astype(np.float32)
    got_max, got_sum = jax.jit(functools.partial(reduce_tiles, axis=axis, interpret=interpret,
                                                 apart=apart))(x)
    want_max, want_sum = x.max(axis=axis + 2), x.sum(axis=axis + 2, dtype=np.float64)
    scale = np.abs(x).sum(axis=axis + 2)
    err_max = np.abs(np.asarray(got_max) - want_max) / np.maximum(np.abs(want_max), 1e-30)
    err_sum = np.abs(np.asarray(got_sum) - want_sum) / scale
    wrong = (err_max > RTOL).any(axis=-1) | (err_sum > RTOL).any(axis=-1)
    return dict(warpgroups=warpgroups, axis=axis, apart=apart, tiles=int(wrong.size),
                wrong_tiles=int(wrong.sum()), max_rel_err=float(max(err_max.max(),
                                                                      err_sum.max())))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int_at_least(1), default=None,
                        help="tiles per warpgroup (default 512 compiled, 4 in interpret mode)")
    args = parser.parse_args(argv)
    from pallas_paged.decode_attention import mosaic_gpu

    mosaic_gpu.check_jax()
    interpret = jax.devices()[0].platform != "gpu"
    iters = args.iters if args.iters is not None else (4 if interpret else 512)
    print(f"{'interpret mode' if interpret else jax.devices()[0].device_kind}, jax"
          f" {jax.__version__}, {iters} tiles per warpgroup")
    results = [check(w, axis, iters, interpret=interpret, apart=apart)
               for w, axis, apart in VARIANTS]
    for r in results:
        print(f"  {r['warpgroups']} warpgroup(s), axis {r['axis']}"
              f"{', scratch apart' if r['apart'] else ''}: {r['wrong_tiles']} of"
              f" {r['tiles']} tiles wrong, max rel err {r['max_rel_err']:.2e}")
    return 1 if any(r["wrong_tiles"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

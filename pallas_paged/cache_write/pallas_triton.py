"""The cache write as a Pallas Triton kernel: ``write_kv(..., impl="pallas")``.

Each program copies a few tokens' rows (a chunk of each) to their slots with masked stores, aliasing
the cache buffers (``input_output_aliases``) so the untouched part of the cache is never copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged._platform import next_power_of_2


def _write_rows_kernel(
    slots_ref,    # i32[num_tokens]
    k_ref,        # [num_tokens, row]          row = num_kv_heads * head_dim
    v_ref,        # [num_tokens, row]
    k_cache_in,   # [num_slots, row]           aliased to k_cache_ref
    v_cache_in,   # [num_slots, row]           aliased to v_cache_ref
    k_cache_ref,  # [num_slots, row]
    v_cache_ref,  # [num_slots, row]
    *,
    tokens_per_program: int,
    row_chunk: int,
):
    del k_cache_in, v_cache_in  # the same buffers as the outputs
    num_tokens, row = k_ref.shape
    num_slots = k_cache_ref.shape[0]
    tokens = pl.program_id(0) * tokens_per_program + jnp.arange(tokens_per_program)  # [Tw]
    in_batch = tokens < num_tokens
    slots = plgpu.load(slots_ref.at[tokens], mask=in_batch, other=-1)  # [Tw]
    keep = in_batch & (slots >= 0) & (slots < num_slots)
    # Masked lanes point past the end: the GPU never touches them, and interpret mode (which
    # writes masked lanes back with their old value) drops out-of-bounds scatter indices.
    safe_slots = jnp.where(keep, slots, num_slots)
    safe_tokens = jnp.where(in_batch, tokens, 0)
    cols = pl.program_id(1) * row_chunk + jnp.arange(row_chunk)  # [C]
    mask = keep[:, None] & (cols < row)[None, :]
    for src, dst in ((k_ref, k_cache_ref), (v_ref, v_cache_ref)):
        rows = plgpu.load(src.at[safe_tokens[:, None], cols[None, :]], mask=mask)  # [Tw, C]
        plgpu.store(dst.at[safe_slots[:, None], cols[None, :]], rows, mask=mask)


def write_pallas(k_flat, v_flat, k_rows, v_rows, slots, *, interpret: bool,
                  elements_per_program: int = 4096, num_warps: int = 8):
    """One program copies ``elements_per_program / row_chunk`` tokens' rows (a chunk of each).

    The defaults were the fastest of 8 variants for a 16K-token bf16 write on the H200
    (benchmarks/sweep_decode.py --write-only, docs/BENCHMARKS.md).
    """
    num_tokens, row = k_rows.shape
    row_chunk = min(next_power_of_2(row), 1024)
    tokens_per_program = max(1, min(64, elements_per_program // row_chunk))
    grid = (pl.cdiv(max(num_tokens, 1), tokens_per_program), pl.cdiv(row, row_chunk))
    kernel = functools.partial(_write_rows_kernel, tokens_per_program=tokens_per_program,
                               row_chunk=row_chunk)
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=(jax.ShapeDtypeStruct(k_flat.shape, k_flat.dtype),
                   jax.ShapeDtypeStruct(v_flat.shape, v_flat.dtype)),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="pallas_paged_write_kv",
    )(slots, k_rows, v_rows, k_flat, v_flat)

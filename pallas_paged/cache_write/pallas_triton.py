"""The cache write as a Pallas Triton kernel: ``write_kv(..., impl="pallas")``.

Each program copies a few tokens' rows (a chunk of each) to their slots with masked stores, aliasing
the cache buffers (``input_output_aliases``) so the untouched part of the cache is never copied.

For float8_e4m3fn caches the program quantizes the rows it has loaded before storing them:
``clamp(x / scale, -448, 448)`` rounded to nearest even, bit-identical to `torch_ref.write_kv`. The
scales are two ``f32[1]`` operands (one compiled program serves every scale) and nothing of the
tokens' or the cache's size is built outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged._platform import next_power_of_2
from pallas_paged._fp8 import clamp_to_fp8_range, divide_rn, kernel_scale_operands


def _divide_rn(x, scale, *, interpret: bool):
    """``x / scale``, one correctly rounded IEEE fp32 division per element (as torch divides).

    Args:
      x: ``f32[Tw, C]``, a tile of loaded rows.
      scale: ``f32[]``.
      interpret: whether the kernel runs in interpret mode (static).

    Triton lowers ``/`` to the approximate ``div.full.f32``, so the GPU divides with PTX
    ``div.rn.f32`` through inline assembly. Interpret mode cannot lower inline assembly: there the
    body runs as XLA, whose division is corrected as the XLA write path's is (`divide_rn`).
    """
    if interpret:
        return divide_rn(x, scale)
    divisor = jnp.full(x.shape, scale, jnp.float32)  # [Tw, C]
    [quotient] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, divisor],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return quotient


def _quantize_fp8(rows, scale, *, interpret: bool):
    """``clamp(rows / scale, -448, 448)`` in fp32, cast to float8_e4m3fn (round to nearest even).

    Args:
      rows: ``[Tw, C]``, float32 / bfloat16 / float16.
      scale: ``f32[]``.
      interpret: whether the kernel runs in interpret mode (static).

    NaN stays NaN and +-inf become +-448 (`clamp_to_fp8_range`). The cast rounds to nearest even
    (``cvt.rn.satfinite`` on the GPU).
    """
    scaled = _divide_rn(rows.astype(jnp.float32), scale, interpret=interpret)  # [Tw, C]
    return clamp_to_fp8_range(scaled).astype(jnp.float8_e4m3fn)


def _write_rows(slots_ref, k_scale_ref, v_scale_ref, k_ref, v_ref, cache_refs, *,
                tokens_per_program: int, row_chunk: int, fused_head_dim: int | None,
                interpret: bool):
    """The body of both kernels: load a ``[Tw, C]`` tile of each of k and v, quantize it with
    ``k_scale_ref`` / ``v_scale_ref`` when they are given, store it at the tokens' slots
    (masked). ``cache_refs``: the inputs aliased to the outputs, then the outputs: ``(k, v)``, or
    with ``fused_head_dim`` the one fused cache, where column ``c`` of a token's K row (kv head
    ``c // D``, ``D = fused_head_dim``) lies at ``(c // D) * 2D + c % D`` and of its V row ``D``
    further."""
    num_tokens, row = k_ref.shape
    outputs = cache_refs[len(cache_refs) // 2:]
    k_cache_ref, v_cache_ref = (outputs[0], outputs[0]) if fused_head_dim else outputs
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
    for half, (src, dst, scale_ref) in enumerate(((k_ref, k_cache_ref, k_scale_ref),
                                                  (v_ref, v_cache_ref, v_scale_ref))):
        rows = plgpu.load(src.at[safe_tokens[:, None], cols[None, :]], mask=mask)  # [Tw, C]
        if scale_ref is not None:
            rows = _quantize_fp8(rows, scale_ref[0], interpret=interpret)
        dst_cols = cols  # [C]
        if fused_head_dim:
            d = fused_head_dim
            dst_cols = (cols // d) * (2 * d) + half * d + cols % d
        plgpu.store(dst.at[safe_slots[:, None], dst_cols[None, :]], rows, mask=mask)


def _write_rows_kernel(
    slots_ref,    # i32[num_tokens]
    k_ref,        # [num_tokens, row]          row = num_kv_heads * head_dim, the cache dtype
    v_ref,        # [num_tokens, row]
    *cache_refs,  # k_cache_in, v_cache_in [num_slots, row] (aliased to the outputs), then the
                  # outputs k_cache, v_cache; fused: kv_cache_in, kv_cache [num_slots, 2 * row]
    tokens_per_program: int,
    row_chunk: int,
    fused_head_dim: int | None,
):
    """Caches of the tokens' dtype: the rows are stored as loaded."""
    _write_rows(slots_ref, None, None, k_ref, v_ref, cache_refs,
                tokens_per_program=tokens_per_program, row_chunk=row_chunk,
                fused_head_dim=fused_head_dim, interpret=False)


def _write_rows_fp8_kernel(
    slots_ref,    # i32[num_tokens]
    k_scale_ref,  # f32[1]                     k_scale
    v_scale_ref,  # f32[1]                     v_scale
    k_ref,        # [num_tokens, row]          row = num_kv_heads * head_dim; f32 / bf16 / f16
    v_ref,        # [num_tokens, row]          f32 / bf16 / f16
    *cache_refs,  # f8e4m3fn caches, as _write_rows_kernel's
    tokens_per_program: int,
    row_chunk: int,
    fused_head_dim: int | None,
    interpret: bool,
):
    """float8_e4m3fn caches: the rows are quantized with the scales between load and store."""
    _write_rows(slots_ref, k_scale_ref, v_scale_ref, k_ref, v_ref, cache_refs,
                tokens_per_program=tokens_per_program, row_chunk=row_chunk,
                fused_head_dim=fused_head_dim, interpret=interpret)


def write_pallas(flats, k_rows, v_rows, slots, *, head_dim: int, k_scale=None, v_scale=None,
                 interpret: bool, elements_per_program: int = 4096, num_warps: int = 8):
    """Write ``k_rows`` / ``v_rows`` ``[num_tokens, row]`` at ``slots`` of the flat caches
    ``flats``: ``(k_flat, v_flat)``, each ``[num_slots, row]``, or ``(kv_flat,)``, ``[num_slots,
    2 * row]`` (fused: each kv head's K columns, then its V columns); return the caches (the same
    buffers, aliased).

    One program copies ``elements_per_program / row_chunk`` tokens' rows (a chunk of each). With
    ``k_scale`` and ``v_scale`` (``f32[]`` each; required for, and only for, float8_e4m3fn
    caches; two ``f32[1]`` operands of the kernel, `kernel_scale_operands`) the rows, of any
    float dtype, are quantized inside the kernel; otherwise they are in the cache dtype and
    copied as they are. The defaults were the fastest measured (docs/design/write.md).
    """
    num_tokens, row = k_rows.shape
    row_chunk = min(next_power_of_2(row), 1024)
    tokens_per_program = max(1, min(64, elements_per_program // row_chunk))
    grid = (pl.cdiv(max(num_tokens, 1), tokens_per_program), pl.cdiv(row, row_chunk))
    tiling = dict(tokens_per_program=tokens_per_program, row_chunk=row_chunk,
                  fused_head_dim=head_dim if len(flats) == 1 else None)
    if k_scale is None:
        kernel = functools.partial(_write_rows_kernel, **tiling)
        operands = (slots, k_rows, v_rows, *flats)
    else:
        kernel = functools.partial(_write_rows_fp8_kernel, interpret=interpret, **tiling)
        operands = (slots, *kernel_scale_operands(k_scale, v_scale), k_rows, v_rows, *flats)
    first_cache = len(operands) - len(flats)
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=tuple(jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flats),
        input_output_aliases={first_cache + i: i for i in range(len(flats))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="pallas_paged_write_kv" + ("_fused" if len(flats) == 1 else ""),
    )(*operands)

"""Writing new tokens' K/V into the paged cache: a masked scatter.

Two implementations of one function, bit-identical to `torch_ref.write_kv`:

- ``impl="xla"``: ``cache.at[slots].set(rows, mode="drop")`` on the flat slot axis, every invalid
  slot mapped to its own index past the end so that it is dropped (a raw ``-1`` would mean "the
  last slot" in JAX as in torch).
- ``impl="pallas"``: a Pallas kernel that copies each token's row to its slot with masked stores,
  aliasing the cache buffers (``input_output_aliases``) so the untouched part is never copied.

Under ``jax.jit(write_kv, donate_argnums=(0, 1))`` both update the donated caches in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_paged import validate
from pallas_paged.platform import kernel_addresses_overflow, next_power_of_2, resolve_interpret

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
WRITE_IMPLS = ("xla", "pallas")


def quantize_fp8(x: jax.Array, scale: float) -> jax.Array:
    """``clamp(x / scale, -448, 448)`` in fp32, cast to float8_e4m3fn (round to nearest even).

    The division must be one IEEE fp32 division per element, as in torch, for the caches to be
    bit-identical. XLA rewrites ``x / broadcast(c)`` into ``x * (1 / c)``, which rounds
    differently, so the divisor is materialized behind an optimization barrier.
    """
    divisor = jax.lax.optimization_barrier(jnp.full(x.shape, scale, jnp.float32))
    scaled = x.astype(jnp.float32) / divisor
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


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


def _write_pallas(k_flat, v_flat, k_rows, v_rows, slots, *, interpret: bool,
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


def _write_xla(k_flat, v_flat, k_rows, v_rows, slots):
    num_slots = k_flat.shape[0]
    keep = (slots >= 0) & (slots < num_slots)
    # Each dropped token gets its own index past the end: dropped by mode="drop", and the indices
    # stay unique, so XLA may write rows without atomics.
    index = jnp.where(keep, slots, num_slots + jnp.arange(slots.shape[0], dtype=slots.dtype))
    scatter = functools.partial(_scatter_rows, index=index)
    return scatter(k_flat, k_rows), scatter(v_flat, v_rows)


def _scatter_rows(cache, rows, *, index):
    return cache.at[index].set(rows, mode="drop", unique_indices=True)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale", "impl", "interpret"))
def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Store each new token's K and V at its physical slot; return the updated caches.

    Token ``i`` with ``s = slot_mapping[i] >= 0`` lands at ``cache[s // block_size, s % block_size]``.
    A slot of ``-1`` marks padding and writes nothing, anywhere; every other entry keeps its exact
    bits. fp8 caches store ``clamp(x / scale, -448, 448)`` rounded to nearest even.

    Functional, as JAX is: the caches are returned. Under
    ``jax.jit(write_kv, donate_argnums=(0, 1))`` the donated buffers are updated in place.

    Args:
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      k, v: ``[num_tokens, num_kv_heads, head_dim]``, the cache dtype (any float dtype for fp8).
      slot_mapping: ``i32[num_tokens]`` (int64 accepted), the slot of each token or ``-1``.
      k_scale, v_scale: python floats, required for float8_e4m3fn caches and refused otherwise.
      impl: ``"xla"`` (a scatter) or ``"pallas"`` (a row-copy kernel); None picks ``"pallas"`` on a
        GPU and ``"xla"`` elsewhere (and for fp8 caches of 2**31 to 2**32 elements, which the
        kernel cannot address).
      interpret: run the Pallas kernel in interpret mode; None means exactly when JAX has no GPU.

    Returns:
      ``(k_cache, v_cache)`` with the new tokens written.

    Raises:
      ValueError: wrong ranks, shapes or dtypes, bad fp8 scales, or an unknown ``impl`` (trace time).
        Slot values are not checked here (they cannot raise under jit): out-of-range slots are
        dropped, and of two tokens sharing a slot one wins, unspecified which. Call
        `validate_write_inputs` first to reject them eagerly.
    """
    validate.static_validate_write(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    too_big = kernel_addresses_overflow(k_cache.shape, k_cache.dtype)
    if impl is None:
        impl = "xla" if resolve_interpret(None) or too_big else "pallas"
    if impl not in WRITE_IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {WRITE_IMPLS}")
    if impl == "pallas" and too_big:
        raise ValueError(
            f"impl='pallas' cannot address a {jnp.dtype(k_cache.dtype).name} cache of 2**31 to"
            f" 2**32 elements ({k_cache.shape=}): use impl='xla' (the default picks it)")
    num_blocks, block_size, kvh, d = k_cache.shape
    if k_cache.dtype == jnp.float8_e4m3fn:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    slots = slot_mapping.astype(jnp.int32)
    num_tokens = slots.shape[0]
    flat_shape = (num_blocks * block_size, kvh * d)
    k_flat, v_flat = k_cache.reshape(flat_shape), v_cache.reshape(flat_shape)
    k_rows, v_rows = k.reshape(num_tokens, kvh * d), v.reshape(num_tokens, kvh * d)
    if num_tokens == 0:
        return k_cache, v_cache
    if impl == "xla":
        k_flat, v_flat = _write_xla(k_flat, v_flat, k_rows, v_rows, slots)
    else:
        k_flat, v_flat = _write_pallas(k_flat, v_flat, k_rows, v_rows, slots,
                                       interpret=resolve_interpret(interpret))
    return k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)

"""Writing new tokens' K/V into the paged cache: a masked scatter, the public function.

Two implementations of one function, bit-identical to `torch_ref.write_kv`: ``impl="xla"``
(``xla.py``, a scatter) and ``impl="pallas"`` (``pallas_triton.py``, a row-copy kernel that also
quantizes for fp8 caches). `write_kv` is a plain function that
validates, then calls one jitted program (``_write_kv_jit``); under
``jax.jit(write_kv, donate_argnums=(0, 1), static_argnames=("impl", "interpret"))`` both impls
update the donated caches in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged._platform import (kernel_addresses_overflow, resolve_interpret,
                                    without_triton_deprecation)
from pallas_paged._fp8 import quantize_fp8, scale_operand
from pallas_paged.cache_write.pallas_triton import write_pallas
from pallas_paged.cache_write.xla import write_xla

WRITE_IMPLS = ("xla", "pallas")


@without_triton_deprecation
def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
    check_values: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Store each new token's K and V at its physical slot; return the updated caches.

    Token ``i`` with ``s = slot_mapping[i] >= 0`` lands at ``cache[s // block_size, s % block_size]``.
    A slot of ``-1`` marks padding and writes nothing, anywhere; every other entry keeps its exact
    bits. fp8 caches store ``clamp(x / scale, -448, 448)`` rounded to nearest even.

    Functional, as JAX is: the caches are returned. A plain function over one jitted program
    (keyed on the shapes, dtypes, ``impl`` and ``interpret``; the scales are operands of it), so
    ``jax.jit(write_kv, donate_argnums=(0, 1), static_argnames=("impl", "interpret"))`` works with
    every keyword and updates the donated buffers in place.

    Args:
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      k, v: ``[num_tokens, num_kv_heads, head_dim]``, the cache dtype (any float dtype for fp8).
      slot_mapping: ``i32[num_tokens]`` (int64 accepted, never wrapped), the slot of each token or
        ``-1``.
      k_scale, v_scale: python floats or ``f32[]`` arrays (shape ``(1,)`` accepted; traced under
        jit: one compiled program for every value), required for float8_e4m3fn caches and refused
        otherwise.
      impl: ``"xla"`` (a scatter) or ``"pallas"`` (a row-copy kernel, which also does the fp8
        quantization, so that no token-sized temporary is built); None picks ``"pallas"`` on a
        GPU and ``"xla"`` elsewhere (and for fp8 caches of 2**31 to 2**32 elements, which the
        kernel cannot address).
      interpret: run the Pallas kernel in interpret mode; None means exactly when JAX has no GPU.
      check_values: when ``slot_mapping`` (and array scales) are concrete (an eager call, not
        under ``jax.jit``), check their values as torch_ref does (`validate_write_inputs`: slots
        in ``[-1, num_blocks * block_size)``, no slot twice, fp8 scales in range), which fetches
        them to the host. False skips that for a hot eager loop; traced calls never check values.

    Returns:
      ``(k_cache, v_cache)`` with the new tokens written.

    Raises:
      ValueError: wrong ranks, shapes or dtypes, bad fp8 scales, or an unknown ``impl`` (before
        anything runs; under jit, at trace time); in an eager call with ``check_values``, a slot
        out of range or used twice (nothing is written then). Under jit, values cannot raise:
        out-of-range slots, int64 ones outside int32 included, are dropped, and of two tokens
        sharing a slot one wins, unspecified which (docs/RELIABILITY.md).
    """
    return _write_call((k_cache, v_cache), k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                       impl=impl, interpret=interpret, check_values=check_values)


@without_triton_deprecation
def write_kv_fused(
    kv_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    impl: str | None = None,
    interpret: bool | None = None,
    check_values: bool = True,
) -> jax.Array:
    """`write_kv` into a fused cache: the JAX serving engines' layout (SPEC.md, "Fused KV
    layout"); returns the updated ``kv_cache``.

    ``kv_cache [num_blocks, block_size, 2 * num_kv_heads, head_dim]`` holds K of kv head ``h`` at
    combined head ``2h`` and V at ``2h + 1``: token ``i``'s ``k[i, h]`` lands at ``kv_cache[s //
    block_size, s % block_size, 2h]`` and ``v[i, h]`` at ``2h + 1``, the same bits as `write_kv`
    into the pair ``(kv_cache[:, :, 0::2], kv_cache[:, :, 1::2])``. Every other argument, the
    donation rule (``donate_argnums=(0,)``) and the errors are `write_kv`'s.
    """
    return _write_call((kv_cache,), k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                       impl=impl, interpret=interpret, check_values=check_values)[0]


def _write_call(caches: tuple, k, v, slot_mapping, *, k_scale, v_scale, impl, interpret,
                check_values) -> tuple:
    """`write_kv` and `write_kv_fused` from their caches: ``(k_cache, v_cache)``, or
    ``(kv_cache,)`` (fused). Validates, picks the implementation, calls the jitted program;
    returns the caches as given."""
    if len(caches) == 1:  # fused: the checks every layout shares run on the halves' shape
        k_half = v_half = _validation.static_validate_fused_cache(caches[0])
    else:
        k_half, v_half = caches
    _validation.static_validate_write(k_half, v_half, k, v, slot_mapping, k_scale, v_scale)
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a python bool or None (static under jax.jit), got {interpret!r}")
    if not isinstance(check_values, bool):
        raise ValueError(f"check_values must be a python bool, got {check_values!r}")
    if check_values and _validation.is_concrete(slot_mapping, k_scale, v_scale):
        _validation.check_write_values(k_half, slot_mapping, k_scale, v_scale)
    cache = caches[0]
    too_big = kernel_addresses_overflow(cache.shape, cache.dtype)
    if impl is None:
        impl = "xla" if resolve_interpret(None) or too_big else "pallas"
    if not isinstance(impl, str) or impl not in WRITE_IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {WRITE_IMPLS} (static under jax.jit)")
    if impl == "pallas" and too_big:
        raise ValueError(
            f"impl='pallas' cannot address a {jnp.dtype(cache.dtype).name} cache of 2**31 to"
            f" 2**32 elements (shape {tuple(cache.shape)}): use impl='xla' (the default picks it)")
    num_slots = cache.shape[0] * cache.shape[1]
    slot_mapping = _validation.host_clamp_index(slot_mapping, -1, num_slots)
    return _write_kv_jit(caches, k, v, slot_mapping, scale_operand(k_scale),
                         scale_operand(v_scale), impl=impl,
                         interpret=resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("impl", "interpret"))
def _write_kv_jit(caches, k, v, slot_mapping, k_scale, v_scale, *, impl: str, interpret: bool):
    """`write_kv` after validation: ``caches`` ``(k_cache, v_cache)`` or ``(kv_cache,)``,
    ``k_scale`` / ``v_scale`` ``f32[]`` or None. Returns the caches as given.

    For fp8 caches ``impl="xla"`` quantizes the tokens (`quantize_fp8`) before its scatter, while
    ``impl="pallas"`` hands the kernel the scales as two ``f32[1]`` operands and the kernel
    quantizes the rows it loads: no token-sized temporary exists outside it.
    """
    num_blocks, block_size, _, d = caches[0].shape
    num_slots = num_blocks * block_size
    fp8 = caches[0].dtype == jnp.float8_e4m3fn
    slots = _validation.clamp_index(slot_mapping, -1, num_slots)
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return caches
    flats = tuple(c.reshape(num_slots, -1) for c in caches)
    k_rows, v_rows = k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)
    if impl == "xla":
        if fp8:
            k_rows, v_rows = quantize_fp8(k_rows, k_scale), quantize_fp8(v_rows, v_scale)
        flats = write_xla(flats, k_rows, v_rows, slots, head_dim=d)
    else:
        scales = dict(k_scale=k_scale, v_scale=v_scale) if fp8 else {}
        flats = write_pallas(flats, k_rows, v_rows, slots, head_dim=d, interpret=interpret,
                             **scales)
    return tuple(f.reshape(c.shape) for f, c in zip(flats, caches))

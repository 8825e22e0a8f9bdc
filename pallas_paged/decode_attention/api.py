"""Paged decode attention, the public function: validate, pick the kernel and config, call it.

Implementations: ``impl="pallas"`` (``pallas_triton.py``, a Pallas kernel lowered through Triton on
GPU, interpret mode elsewhere), ``impl="mosaic"`` (``mosaic_gpu.py``, a Mosaic GPU kernel for
Hopper and later) and ``impl="xla"`` (``xla.py``, plain jnp). ``impl="auto"``, the default, picks
one of the two kernels per shape class (`IMPL_CHOICE`). `select_kernel` makes every choice of a
call, once. `torch_ref` defines the semantics (SPEC.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged._attention_common import split_kv_cache
from pallas_paged._fp8 import scale_operand
from pallas_paged._mosaic_common import auto_kernel, warn_if_interpret_may_stall
from pallas_paged._platform import (device_kind, resolve_interpret, sm_count,
                                    without_triton_deprecation)
from pallas_paged.decode_attention import mosaic_gpu, mosaic_gpu_config, pallas_triton_config
from pallas_paged.decode_attention.mosaic_gpu import decode_mosaic
from pallas_paged.decode_attention.mosaic_gpu_config import MosaicDecodeConfig
from pallas_paged.decode_attention.pallas_triton import decode_pallas
from pallas_paged.decode_attention.pallas_triton_config import DecodeConfig
from pallas_paged.decode_attention.shape import decode_shape, shape_class
from pallas_paged.decode_attention.xla import decode_xla

DECODE_IMPLS = ("auto", "pallas", "xla", "mosaic")

# device kind -> shape class (`shape_class`) -> the kernel ``impl="auto"`` runs there: the one that
# measured faster (`python -m benchmarks.decode --impls pallas,mosaic`); "pallas" elsewhere.
IMPL_CHOICE: dict[str, dict[tuple, str]] = {
    "NVIDIA H100 80GB HBM3": {
        ("bfloat16", 64, 4, 16, 32, 4096): "mosaic",
        ("bfloat16", 128, 4, 16, 8, 1024): "mosaic",
        ("bfloat16", 128, 4, 16, 32, 4096): "mosaic",
        ("float16", 128, 4, 16, 32, 4096): "mosaic",
    },
    "NVIDIA H200": {
        ("bfloat16", 64, 4, 16, 32, 4096): "mosaic",
        ("bfloat16", 256, 4, 16, 32, 4096): "mosaic",
    },
}


def select_kernel(q, k_cache, block_tables, *, impl: str, config, interpret: bool,
                  sliding_window: int | None = None):
    """What a `decode` call runs: ``(impl, config)`` with ``impl`` one of ``"pallas"``,
    ``"mosaic"``, ``"xla"`` and ``config`` the kernel's config (None for ``"xla"``).

    - An explicit ``config`` is kept; with ``impl="auto"`` its type names the kernel
      (`DecodeConfig`: ``"pallas"``, `MosaicDecodeConfig`: ``"mosaic"``).
    - ``impl="auto"`` without one: ``"mosaic"`` where `IMPL_CHOICE` names it for the call's shape
      class on this device kind and the Mosaic kernel can run the call compiled (not in
      ``interpret`` mode, jax >= 0.11.2, sm_90+, a shape it takes: `mosaic_gpu.refusal`);
      ``"pallas"`` everywhere else, a CPU (interpret mode) included.
    - Without a config, the kernel's tuned entry for the shape class on this device kind, else its
      heuristic's (`pallas_triton_config.lookup`, `mosaic_gpu_config.lookup_mosaic`).

    Reads only ``.shape`` and ``.dtype`` of the arrays (it runs at trace time).

    Raises:
      ValueError: a ``config`` of the wrong type for ``impl``, or ``impl="mosaic"`` where the
        Mosaic kernel cannot run the call (the message says why and what to use instead).
    """
    if impl == "xla":
        return "xla", None
    shape = decode_shape(q, k_cache, block_tables, sliding_window)
    kind = device_kind()
    if impl == "auto":
        impl, config = auto_kernel(
            config, triton_type=DecodeConfig, mosaic_type=MosaicDecodeConfig,
            measured_faster=IMPL_CHOICE.get(kind, {}).get(shape_class(shape)) == "mosaic",
            interpret=interpret,
            mosaic_config=lambda: mosaic_gpu_config.lookup_mosaic(shape, kind, sm_count()),
            refusal=lambda c: mosaic_gpu.refusal(q, k_cache, c, interpret=False))
    config_type = MosaicDecodeConfig if impl == "mosaic" else DecodeConfig
    _validation.check_config_type(config, config_type, impl)
    if impl == "mosaic":
        config = config or mosaic_gpu_config.lookup_mosaic(shape, kind, sm_count())
        reason = mosaic_gpu.refusal(q, k_cache, config, interpret)
        if reason is not None:
            raise ValueError(reason)
        return "mosaic", config
    return "pallas", config or pallas_triton_config.lookup(shape, kind, sm_count())


@without_triton_deprecation
def decode(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    scale: float | None = None,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    interpret: bool | None = None,
    config: DecodeConfig | MosaicDecodeConfig | None = None,
    check_values: bool = True,
):
    """Paged decode attention: each sequence's single query over its cached K/V.

    The semantics are `torch_ref.paged_decode_attention`'s (SPEC.md): sequence ``b`` has
    ``n = context_lens[b]`` tokens in the first ``ceil(n / block_size)`` blocks of
    ``block_tables[b]`` (the rest of the row is never read); query head ``h`` uses kv head
    ``h // (num_heads // num_kv_heads)``; scores, softmax and the weighted sum are fp32 and the
    output is cast once to ``q.dtype``; ``n == 0`` gives zeros, while a NaN in a query or a
    valid K/V row gives NaN where torch_ref's softmax does (every kernel and path alike).
    Optional, in this order:
    ``s * scale`` -> soft-cap -> ALiBi -> sliding window -> softmax with sink.

    A plain function that validates, then calls one jitted program keyed on the shapes, dtypes
    and static options; ``k_scale`` / ``v_scale``, ``alibi_slopes`` and ``sinks`` are its operands.
    Under a caller's ``jax.jit``, list the python-valued options it passes in ``static_argnames``
    (``scale``, ``logits_soft_cap``, ``sliding_window``, ``return_lse``, ``impl``, ``interpret``,
    ``config``, ``check_values``); the fp8 scales may be traced.

    Example, two sequences over a cache of 4-token blocks::

        # sequence 0: 6 tokens in physical blocks 7, 2 (positions 0-3, 4-5)
        # sequence 1: 3 tokens in physical block 5; the rest of each row is never read
        block_tables = jnp.array([[7, 2, 0], [5, 99999, -7]], jnp.int32)
        context_lens = jnp.array([6, 3], jnp.int32)
        out = decode(q, k_cache, v_cache, block_tables, context_lens)   # [2, num_heads, head_dim]

    Args:
      q: ``[batch, num_heads, head_dim]``, the cache's dtype (fp32 / bf16 / fp16); any of the
        three for a float8_e4m3fn cache. Mixed float dtypes are refused.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32 / bf16 / fp16 /
        float8_e4m3fn (then with ``k_scale`` / ``v_scale``).
      block_tables: ``i32[batch, max_blocks]`` (int64 accepted, never wrapped); ``max_blocks``
        may be 0 (every length then counts as 0).
      context_lens: ``i32[batch]`` (int64 accepted, never wrapped).
      scale: softmax scale, static; None means ``1 / sqrt(head_dim)``.
      logits_soft_cap: static ``cap > 0``: ``s = cap * tanh(s / cap)``.
      alibi_slopes: ``f32[num_heads]``: ``s += slope[h] * (p - (n - 1))``.
      sliding_window: static ``W >= 1``: only the newest ``min(W, n)`` tokens; the kernels do not
        read blocks wholly outside the window. A window at least the table's capacity is no
        window.
      sinks: ``f32[num_heads]``, one extra logit per head in the softmax denominator.
      k_scale, v_scale: per-tensor dequantization scales of an fp8 cache: python floats or
        ``f32[]`` arrays (shape ``(1,)`` accepted), operands of the program (one compiled program
        for every value).
      return_lse: also return ``lse f32[batch, num_heads]`` (``-inf`` for ``n == 0``).
      impl: ``"auto"`` (the default: the kernel measured faster for this shape class on this
        device kind, see `select_kernel`), ``"pallas"`` (the Triton kernel), ``"mosaic"`` (the
        Mosaic GPU kernel: jax >= 0.11.2, sm_90+ or interpret mode, bf16/fp16 queries, head_dim
        64, 128, 192 or 256) or ``"xla"`` (plain jnp). docs/BACKENDS.md compares them.
      interpret: Pallas interpret mode; None means exactly when there is no GPU backend.
      config: kernel knobs (`DecodeConfig` for ``"pallas"``, `MosaicDecodeConfig` for
        ``"mosaic"``, either for ``"auto"``); None takes the tuned table's entry for this shape
        class, or the heuristic.
      check_values: when the arrays are concrete (an eager call, not under ``jax.jit``), check
        their values as torch_ref does (`validate_decode_inputs`: lengths within the table's
        capacity, block ids in range in the valid part of each table, fp8 scales finite and
        positive), which fetches them to the host. False skips that for a hot eager loop;
        traced calls never check values (see Raises).

    Returns:
      ``out [batch, num_heads, head_dim]`` in ``q.dtype``, or ``(out, lse)`` with ``return_lse``.

    Raises:
      ValueError: before anything runs (under jit: at trace time), for wrong ranks, shapes or
        dtypes, ``num_heads % num_kv_heads``, bad options, an unknown ``impl`` or a kernel that
        cannot run the call; in an eager call with ``check_values``, for bad values. Under jit,
        values cannot raise: lengths are clamped into ``[0, max_blocks * block_size]`` and block
        ids in the valid part of a table into ``[0, num_blocks)`` (docs/RELIABILITY.md).
    """
    return _decode_call(
        q, (k_cache, v_cache), block_tables, context_lens, scale, logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, return_lse=return_lse, impl=impl, interpret=interpret, config=config,
        check_values=check_values)


@without_triton_deprecation
def decode_fused(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    scale: float | None = None,
    *,
    logits_soft_cap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    interpret: bool | None = None,
    config: DecodeConfig | MosaicDecodeConfig | None = None,
    check_values: bool = True,
):
    """`decode` over a fused cache: the JAX serving engines' layout (SPEC.md, "Fused KV layout").

    ``kv_cache [num_blocks, block_size, 2 * num_kv_heads, head_dim]`` holds K of kv head ``h`` at
    combined head ``2h`` and V at ``2h + 1``: it is the pair ``(kv_cache[:, :, 0::2],
    kv_cache[:, :, 1::2])``, and the result is bit for bit ``decode(q, kv_cache[:, :, 0::2],
    kv_cache[:, :, 1::2], ...)``'s. The kernels read the interleaved rows in place (no copy, no
    transpose of the cache). Every other argument, the options and the errors are `decode`'s.
    """
    return _decode_call(
        q, (kv_cache,), block_tables, context_lens, scale, logits_soft_cap=logits_soft_cap,
        alibi_slopes=alibi_slopes, sliding_window=sliding_window, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, return_lse=return_lse, impl=impl, interpret=interpret, config=config,
        check_values=check_values)


def _decode_call(q, caches: tuple, block_tables, context_lens, scale, *, logits_soft_cap,
                 alibi_slopes, sliding_window, sinks, k_scale, v_scale, return_lse, impl,
                 interpret, config, check_values):
    """`decode` and `decode_fused` from their caches: ``(k_cache, v_cache)``, or ``(kv_cache,)``
    (fused). Validates, selects the kernel, calls the jitted program."""
    fused = len(caches) == 1
    if fused:  # the checks every layout shares run on the K and V halves' shape
        k_half = v_half = _validation.static_validate_fused_cache(caches[0])
    else:
        k_half, v_half = caches
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _validation.static_validate_decode(q, k_half, v_half, block_tables, context_lens,
                                       k_scale=k_scale, v_scale=v_scale, **options)
    _validation.static_validate_call(caches[0], impl=impl, impls=DECODE_IMPLS,
                                     return_lse=return_lse, interpret=interpret,
                                     check_values=check_values)
    if check_values and _validation.is_concrete(block_tables, context_lens, k_scale, v_scale):
        _validation.check_decode_values(k_half, block_tables, context_lens, k_scale, v_scale)
    interpret = resolve_interpret(interpret)
    impl, config = select_kernel(q, k_half, block_tables, impl=impl, config=config,
                                 interpret=interpret, sliding_window=sliding_window)
    if impl == "mosaic":
        warn_if_interpret_may_stall(interpret, 1 + config.num_consumers, fewer="num_consumers")
    num_blocks, block_size = k_half.shape[:2]
    capacity = block_tables.shape[1] * block_size
    if sliding_window is not None and sliding_window >= capacity:
        sliding_window = None  # every position p in [0, n) has p > n - 1 - W: no window
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    out, lse = _decode_jit(
        q, caches, _validation.host_clamp_index(block_tables, 0, num_blocks - 1),
        _validation.host_clamp_index(context_lens, 0, capacity), alibi_slopes, sinks,
        scale_operand(k_scale), scale_operand(v_scale), scale=scale,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, impl=impl,
        interpret=interpret, config=config)
    return (out, lse) if return_lse else out


@functools.partial(
    jax.jit, static_argnames=("scale", "logits_soft_cap", "sliding_window", "impl", "interpret",
                              "config"))
def _decode_jit(q, caches, block_tables, context_lens, alibi_slopes, sinks, k_scale, v_scale, *,
                scale: float, logits_soft_cap, sliding_window, impl: str, interpret: bool,
                config):
    """`decode` after validation and `select_kernel`: ``caches`` ``(k_cache, v_cache)`` or
    ``(kv_cache,)`` (fused), ``scale`` resolved, ``k_scale`` / ``v_scale`` ``f32[]`` or None.

    Returns ``(out, lse)``. int64 indices are clamped in int64 here, before they are narrowed.
    """
    fused = len(caches) == 1
    k_cache, v_cache = (caches[0], caches[0]) if fused else caches
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    tables = _validation.clamp_index(block_tables, 0, num_blocks - 1)
    lens = _validation.clamp_index(context_lens, 0, capacity)
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if batch == 0 or max_blocks == 0:  # no sequence, or none that can hold a token
        return (jnp.zeros(q.shape, q.dtype),
                jnp.full((batch, num_heads), -jnp.inf, jnp.float32))
    if impl == "xla":
        return decode_xla(q, *(split_kv_cache(k_cache) if fused else caches), tables, lens,
                          **options)
    if impl == "mosaic":
        return decode_mosaic(q, k_cache, v_cache, tables, lens, config=config,
                             interpret=interpret, fused=fused, **options)
    return decode_pallas(q, k_cache, v_cache, tables, lens, config=config, interpret=interpret,
                         fused=fused, **options)

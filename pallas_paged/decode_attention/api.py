"""Paged decode attention, the public function: validate, pick the implementation, call it.

Implementations: ``impl="pallas"`` (``pallas_triton.py``, a Pallas kernel lowered through Triton on
GPU, interpret mode elsewhere), ``impl="mosaic"`` (``mosaic_gpu.py``, a Mosaic GPU kernel for
Hopper and later) and ``impl="xla"`` (``xla.py``, plain jnp). ``impl="auto"``, the default, picks
one of the two kernels per call (`auto_impl`). `torch_ref` defines the semantics (SPEC.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged._platform import (device_kind, resolve_interpret, sm_count,
                                    without_triton_deprecation)
from pallas_paged.cache_write.fp8 import scale_operand
from pallas_paged.decode_attention import configs, mosaic_gpu
from pallas_paged.decode_attention.configs import DecodeConfig, DecodeShape, MosaicDecodeConfig
from pallas_paged.decode_attention.mosaic_gpu import decode_mosaic
from pallas_paged.decode_attention.pallas_triton import decode_pallas
from pallas_paged.decode_attention.xla import decode_xla

DECODE_IMPLS = ("auto", "pallas", "xla", "mosaic")


def decode_shape(q, k_cache, block_tables) -> DecodeShape:
    """The static facts of a call that its kernel config depends on."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    return DecodeShape(batch=batch, num_kv_heads=kvh, group=num_heads // kvh, head_dim=head_dim,
                       block_size=block_size, capacity=block_tables.shape[1] * block_size,
                       cache_dtype=jnp.dtype(k_cache.dtype).name)


def picked_config(q, k_cache, block_tables, *, impl: str = "pallas"):
    """The config ``decode(..., impl=impl)`` runs when given none: the tuned entry of the call's
    shape class on this device kind (`configs.lookup`, `configs.lookup_mosaic`), else the
    heuristic's. ``impl``: ``"pallas"`` (a `DecodeConfig`) or ``"mosaic"``."""
    lookup = configs.lookup_mosaic if impl == "mosaic" else configs.lookup
    return lookup(decode_shape(q, k_cache, block_tables), device_kind(), sm_count())


def auto_impl(q, k_cache, block_tables, *, interpret: bool | None = None, config=None) -> str:
    """The kernel ``decode(..., impl="auto")`` runs for this call: ``"mosaic"`` or ``"pallas"``.

    An explicit ``config`` decides by its type: a `DecodeConfig` means ``"pallas"``, a
    `MosaicDecodeConfig` ``"mosaic"`` (which then raises its usual ValueError if it cannot run the
    call). Without one, ``"mosaic"`` exactly when both hold:

    - the measured table says it is the faster kernel for this call's shape class on this device
      kind (`configs.choose_impl`, `configs.IMPL_CHOICE`);
    - the Mosaic kernel can run this call compiled: not in interpret mode (``interpret``, None
      meaning "when there is no GPU backend"), jax >= 0.11.2, a GPU of compute capability >= 9.0,
      and `mosaic_gpu.check_supported` passing for the config it would use (the tuned table's or
      the heuristic's). It takes every option `decode` has (soft-cap, ALiBi, window, sinks, fp8
      scales, ``return_lse``), so the options add no condition.

    Everywhere else ``"pallas"``, the Triton kernel (interpret mode on a CPU, as before ``"auto"``
    existed). Reads only ``.shape`` and ``.dtype`` of the arrays, so it runs at trace time.

    Raises:
      ValueError: for a ``config`` that is neither None nor one of the two config types.
    """
    if config is not None:
        if isinstance(config, MosaicDecodeConfig):
            return "mosaic"
        if isinstance(config, DecodeConfig):
            return "pallas"
        raise ValueError(f"config must be a DecodeConfig, a MosaicDecodeConfig or None for"
                         f" impl='auto', got {type(config).__name__}")
    shape = decode_shape(q, k_cache, block_tables)
    kind = device_kind()
    if configs.lookup_impl(shape, kind) != "mosaic" or resolve_interpret(interpret):
        return "pallas"  # the table does not name mosaic (every call, today), or interpret mode
    mosaic_config = configs.lookup_mosaic(shape, kind, sm_count())
    can_run_mosaic = mosaic_gpu.refusal(q, k_cache, mosaic_config, interpret=False) is None
    return configs.choose_impl(shape, kind, can_run_mosaic)


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
    ``config``); the scales may be traced.

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
      sliding_window: static ``W >= 1``: only the newest ``min(W, n)`` tokens; the kernel does not
        read blocks wholly outside the window. A window at least the table's capacity is no window.
      sinks: ``f32[num_heads]``, one extra logit per head in the softmax denominator.
      k_scale, v_scale: per-tensor dequantization scales of an fp8 cache: python floats or
        ``f32[]`` arrays (shape ``(1,)`` accepted), operands of the program (one compiled program
        for every value).
      return_lse: also return ``lse f32[batch, num_heads]`` (``-inf`` for ``n == 0``).
      impl: ``"auto"`` (the default: ``"mosaic"`` where it measured faster than ``"pallas"`` for
        this shape class on this device kind and can run the call compiled, else ``"pallas"``;
        an explicit ``config`` picks the kernel of its type; see `auto_impl`), ``"pallas"`` (the
        Triton kernel; it cannot address fp8 caches of 2**31 to 2**32 elements: ValueError),
        ``"xla"`` (plain jnp, the readable reference) or ``"mosaic"`` (the Mosaic GPU kernel,
        ``mosaic_gpu.py``: jax >= 0.11.2, sm_90+, bf16/fp16 queries, head_dim 64, 128, 192 or
        256).
      interpret: Pallas interpret mode; None means exactly when there is no GPU backend.
      config: kernel knobs (`DecodeConfig` for ``"pallas"``, `MosaicDecodeConfig` for
        ``"mosaic"``, either for ``"auto"``); None takes the tuned table's entry for this shape
        class, or the heuristic.

    Returns:
      ``out [batch, num_heads, head_dim]`` in ``q.dtype``, or ``(out, lse)`` with ``return_lse``.

    Raises:
      ValueError: before anything runs (under jit: at trace time), for wrong ranks, shapes or
        dtypes, ``num_heads % num_kv_heads``, bad options or an unknown ``impl``. Values are not
        checked (they cannot raise under jit): see `validate_decode_inputs` and the module
        docstring of `pallas_paged._validation`.
    """
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _validation.static_validate_decode(q, k_cache, v_cache, block_tables, context_lens,
                                       k_scale=k_scale, v_scale=v_scale, **options)
    if isinstance(impl, str) and impl == "auto":
        impl = auto_impl(q, k_cache, block_tables, interpret=interpret, config=config)
    _validation.static_validate_call(
        k_cache, impl=impl, impls=DECODE_IMPLS, return_lse=return_lse, interpret=interpret,
        config=config, config_type=MosaicDecodeConfig if impl == "mosaic" else DecodeConfig)
    num_blocks, block_size = k_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    if sliding_window is not None and sliding_window >= capacity:
        sliding_window = None  # every position p in [0, n) has p > n - 1 - W: no window
    if impl in ("pallas", "mosaic") and config is None and q.shape[0] > 0 and capacity > 0:
        config = picked_config(q, k_cache, block_tables, impl=impl)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    out, lse = _decode_jit(
        q, k_cache, v_cache, _validation.host_clamp_index(block_tables, 0, num_blocks - 1),
        _validation.host_clamp_index(context_lens, 0, capacity), alibi_slopes, sinks,
        scale_operand(k_scale), scale_operand(v_scale), scale=scale,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, impl=impl,
        interpret=resolve_interpret(interpret), config=config)
    return (out, lse) if return_lse else out


@functools.partial(
    jax.jit, static_argnames=("scale", "logits_soft_cap", "sliding_window", "impl", "interpret",
                              "config"))
def _decode_jit(q, k_cache, v_cache, block_tables, context_lens, alibi_slopes, sinks, k_scale,
                v_scale, *, scale: float, logits_soft_cap, sliding_window, impl: str,
                interpret: bool, config):
    """`decode` after validation: ``scale`` resolved, ``k_scale`` / ``v_scale`` ``f32[]`` or None.

    Returns ``(out, lse)``. int64 indices are clamped in int64 here, before they are narrowed.
    """
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
        return decode_xla(q, k_cache, v_cache, tables, lens, **options)
    if impl == "mosaic":
        return decode_mosaic(q, k_cache, v_cache, tables, lens, config=config,
                             interpret=interpret, **options)
    return decode_pallas(q, k_cache, v_cache, tables, lens, config=config, interpret=interpret,
                         **options)

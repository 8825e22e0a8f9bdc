"""Paged decode attention, the public function: validate, pick the implementation, call it.

Implementations: ``impl="pallas"`` (``pallas_triton.py``, a Pallas kernel lowered through Triton on
GPU, interpret mode elsewhere) and ``impl="xla"`` (``xla.py``, plain jnp). `torch_ref` defines the
semantics (SPEC.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged._platform import (device_kind, kernel_addresses_overflow, resolve_interpret,
                                    sm_count, without_triton_deprecation)
from pallas_paged.decode_attention import configs
from pallas_paged.decode_attention.configs import DecodeConfig, DecodeShape, MosaicDecodeConfig
from pallas_paged.decode_attention.mosaic_gpu import decode_mosaic
from pallas_paged.decode_attention.pallas_triton import decode_pallas
from pallas_paged.decode_attention.xla import decode_xla

DECODE_IMPLS = ("pallas", "xla", "mosaic")


def decode_shape(q, k_cache, block_tables) -> DecodeShape:
    """The static facts of a call that its kernel config depends on."""
    batch, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    return DecodeShape(batch=batch, num_kv_heads=kvh, group=num_heads // kvh, head_dim=head_dim,
                       block_size=block_size, capacity=block_tables.shape[1] * block_size,
                       cache_dtype=jnp.dtype(k_cache.dtype).name)


@without_triton_deprecation
@functools.partial(
    jax.jit,
    static_argnames=("scale", "logits_soft_cap", "sliding_window", "k_scale", "v_scale",
                     "return_lse", "impl", "interpret", "config"))
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
    k_scale: float | None = None,
    v_scale: float | None = None,
    return_lse: bool = False,
    impl: str = "pallas",
    interpret: bool | None = None,
    config: DecodeConfig | None = None,
):
    """Paged decode attention: each sequence's single query over its cached K/V.

    The semantics are `torch_ref.paged_decode_attention`'s (SPEC.md): sequence ``b`` has
    ``n = context_lens[b]`` tokens in the first ``ceil(n / block_size)`` blocks of
    ``block_tables[b]`` (the rest of the row is never read); query head ``h`` uses kv head
    ``h // (num_heads // num_kv_heads)``; scores, softmax and the weighted sum are fp32 and the
    output is cast once to ``q.dtype``; ``n == 0`` gives zeros. Optional, in this order:
    ``s * scale`` -> soft-cap -> ALiBi -> sliding window -> softmax with sink.

    Args:
      q: ``[batch, num_heads, head_dim]``, fp32 / bf16 / fp16.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32 / bf16 / fp16 /
        float8_e4m3fn (then with ``k_scale`` / ``v_scale``).
      block_tables: ``i32[batch, max_blocks]``.
      context_lens: ``i32[batch]``.
      scale: softmax scale, static; None means ``1 / sqrt(head_dim)``.
      logits_soft_cap: static ``cap > 0``: ``s = cap * tanh(s / cap)``.
      alibi_slopes: ``f32[num_heads]``: ``s += slope[h] * (p - (n - 1))``.
      sliding_window: static ``W >= 1``: only the newest ``min(W, n)`` tokens; the kernel does not
        read blocks wholly outside the window.
      sinks: ``f32[num_heads]``, one extra logit per head in the softmax denominator.
      k_scale, v_scale: static per-tensor dequantization scales of an fp8 cache.
      return_lse: also return ``lse f32[batch, num_heads]`` (``-inf`` for ``n == 0``).
      impl: ``"pallas"`` (the kernel) or ``"xla"`` (plain jnp, the readable reference). The kernel
        cannot address fp8 caches of 2**31 to 2**32 elements (ValueError). ``"mosaic"``: the
        Mosaic GPU kernel (``mosaic_gpu.py``: jax >= 0.11.2, sm_90+, bf16/fp16 queries).
      interpret: Pallas interpret mode; None means exactly when there is no GPU backend.
      config: kernel knobs (`DecodeConfig`; `MosaicDecodeConfig` for ``"mosaic"``); None takes the
        tuned table's entry for this shape class, or the heuristic.

    Returns:
      ``out [batch, num_heads, head_dim]`` in ``q.dtype``, or ``(out, lse)`` with ``return_lse``.

    Raises:
      ValueError: at trace time, for wrong ranks, shapes or dtypes, ``num_heads % num_kv_heads``,
        bad options or an unknown ``impl``. Values are not checked (they cannot raise under jit):
        see `validate_decode_inputs` and the module docstring of `pallas_paged._validation`.
    """
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _validation.static_validate_decode(q, k_cache, v_cache, block_tables, context_lens,
                                    k_scale=k_scale, v_scale=v_scale, **options)
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {DECODE_IMPLS}")
    if impl == "pallas" and kernel_addresses_overflow(k_cache.shape, k_cache.dtype):
        raise ValueError(
            f"impl='pallas' cannot address a {jnp.dtype(k_cache.dtype).name} cache of 2**31 to"
            f" 2**32 elements ({k_cache.shape=}; Triton offsets stay 32-bit below 2**32 bytes):"
            " use impl='xla', or a cache of fewer than 2**31 or more than 2**32 elements")
    config_type = MosaicDecodeConfig if impl == "mosaic" else DecodeConfig
    if config is not None and not isinstance(config, config_type):
        raise ValueError(f"config must be a {config_type.__name__} or None for impl={impl!r},"
                         f" got {type(config).__name__}")
    batch, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    options.update(scale=scale, k_scale=k_scale, v_scale=v_scale)
    if batch == 0:
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.zeros((0, num_heads), jnp.float32)
    elif impl == "xla":
        out, lse = decode_xla(q, k_cache, v_cache, block_tables, context_lens, **options)
    elif impl == "mosaic":
        if config is None:
            config = configs.lookup_mosaic(decode_shape(q, k_cache, block_tables), device_kind(),
                                           sm_count())
        out, lse = decode_mosaic(q, k_cache, v_cache, block_tables, context_lens, config=config,
                                 interpret=resolve_interpret(interpret), **options)
    else:
        if config is None:
            config = configs.lookup(decode_shape(q, k_cache, block_tables), device_kind(), sm_count())
        out, lse = decode_pallas(q, k_cache, v_cache, block_tables, context_lens, config=config,
                                  interpret=resolve_interpret(interpret), **options)
    return (out, lse) if return_lse else out

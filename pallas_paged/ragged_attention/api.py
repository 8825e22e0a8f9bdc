"""Ragged paged attention, the public function: validate, pick the kernel and config, call it.

Implementations: ``impl="pallas"`` (``pallas_triton.py``, a Pallas kernel lowered through Triton on
GPU, interpret mode elsewhere), ``impl="mosaic"`` (``mosaic_gpu.py``, a Mosaic GPU kernel for
Hopper and later) and ``impl="xla"`` (``xla.py``, plain jnp). ``impl="auto"``, the default, picks
one of the two kernels per shape class (`IMPL_CHOICE`). `select_kernel` makes every choice of a
call, once. `torch_ref` defines the semantics (SPEC.md, "Ragged paged
attention").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_paged import _validation
from pallas_paged._attention_common import split_kv_cache
from pallas_paged._platform import (device_kind, resolve_interpret, sm_count,
                                    without_triton_deprecation)
from pallas_paged._fp8 import scale_operand
from pallas_paged._mosaic_common import auto_kernel, warn_if_interpret_may_stall
from pallas_paged.ragged_attention import mosaic_gpu, mosaic_gpu_config, pallas_triton_config
from pallas_paged.ragged_attention.mosaic_gpu import paged_attention_mosaic
from pallas_paged.ragged_attention.mosaic_gpu_config import MosaicAttentionConfig
from pallas_paged.ragged_attention.pallas_triton import paged_attention_pallas
from pallas_paged.ragged_attention.pallas_triton_config import AttentionConfig
from pallas_paged.ragged_attention.shape import AttentionShape, shape_class
from pallas_paged.ragged_attention.xla import paged_attention_xla

ATTENTION_IMPLS = ("auto", "pallas", "xla", "mosaic")

# device kind -> shape class (`shape_class`) -> the kernel ``impl="auto"`` runs there: the one that
# measured faster (`python -m benchmarks.ragged --impls pallas,mosaic`); "pallas" elsewhere.
IMPL_CHOICE: dict[str, dict[tuple, str]] = {
    # (cache dtype, head_dim, group, block_size, batch, num_tokens, capacity): the kernel
    "NVIDIA H100 80GB HBM3": {
        ("bfloat16", 128, 4, 16, 4, 8192, 2048): "mosaic",     # prefill
        ("bfloat16", 128, 4, 16, 1, 2048, 32768): "mosaic",    # a chunk over a long cache
        ("bfloat16", 128, 4, 16, 32, 128, 4096): "mosaic",     # speculative steps
        ("bfloat16", 128, 4, 16, 32, 32, 4096): "mosaic",      # decodes
    },
}


def attention_shape(q, k_cache, block_tables) -> AttentionShape:
    """The static facts of a call that its kernel config depends on."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kvh, _ = k_cache.shape
    return AttentionShape(num_tokens=num_tokens, batch=block_tables.shape[0], num_kv_heads=kvh,
                          group=num_heads // kvh, head_dim=head_dim, block_size=block_size,
                          capacity=block_tables.shape[1] * block_size,
                          cache_dtype=jnp.dtype(k_cache.dtype).name)


def select_kernel(q, k_cache, block_tables, *, impl: str, config, interpret: bool):
    """What a `paged_attention` call runs: ``(impl, config)`` with ``impl`` one of ``"pallas"``,
    ``"mosaic"``, ``"xla"`` and ``config`` the kernel's (None for ``"xla"``).

    - An explicit ``config`` is kept; with ``impl="auto"`` its type names the kernel
      (`AttentionConfig`: ``"pallas"``, `MosaicAttentionConfig`: ``"mosaic"``).
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
    shape = attention_shape(q, k_cache, block_tables)
    kind = device_kind()
    if impl == "auto":
        impl, config = auto_kernel(
            config, triton_type=AttentionConfig, mosaic_type=MosaicAttentionConfig,
            measured_faster=IMPL_CHOICE.get(kind, {}).get(shape_class(shape)) == "mosaic",
            interpret=interpret,
            mosaic_config=lambda: mosaic_gpu_config.lookup_mosaic(shape, kind),
            refusal=lambda c: mosaic_gpu.refusal(q, k_cache, c, interpret=False))
    if impl == "mosaic":
        _validation.check_config_type(config, MosaicAttentionConfig, impl)
        config = config or mosaic_gpu_config.lookup_mosaic(shape, kind)
        reason = mosaic_gpu.refusal(q, k_cache, config, interpret)
        if reason is not None:
            raise ValueError(reason)
        return "mosaic", config
    _validation.check_config_type(config, AttentionConfig, impl)
    return "pallas", config or pallas_triton_config.lookup(shape, kind, sm_count())


@without_triton_deprecation
def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
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
    config: AttentionConfig | MosaicAttentionConfig | None = None,
    check_values: bool = True,
):
    """Ragged paged attention: each sequence's new tokens, causally, over its paged K/V.

    The semantics are `torch_ref.paged_attention`'s (SPEC.md): sequence ``b`` owns the query rows
    ``q[query_start_loc[b] : query_start_loc[b + 1]]`` (``q_len_b``, 0 allowed) and
    ``n = context_lens[b]`` cached tokens including them, in the first ``ceil(n / block_size)``
    blocks of ``block_tables[b]`` (the rest of the row is never read). Query ``i`` sits at
    position ``p = n - q_len_b + i`` and sees the positions ``j <= p`` (with a window ``W``, only
    ``j > p - W``); query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``; scores,
    softmax and the weighted sum are fp32, the output is cast once to ``q.dtype``. Optional, in
    this order: ``s * scale`` -> soft-cap -> ALiBi (``slope[h] * (j - p)``) -> sliding window ->
    softmax with sink. Rows at or past ``query_start_loc[batch]`` (padding) are zeros; a NaN in a
    query or a valid K/V row gives NaN where torch_ref's softmax does.
    ``decode(q, ...)`` equals ``paged_attention(q, ..., query_start_loc=arange(batch + 1))``.

    A plain function that validates, then calls one jitted program keyed on the shapes, dtypes
    and static options, as `pallas_paged.decode` does: under a caller's ``jax.jit``, list the
    python-valued options it passes in ``static_argnames``; the fp8 scales may be traced.

    Example, a prefill chunk, a 3-token speculation and a decode in one call::

        # sequence 0: 4 new tokens over 6 cached before them (n = 10), positions 6..9
        # sequence 1: 3 new tokens, n = 20, positions 17..19;  sequence 2: 1 new token, n = 7
        query_start_loc = jnp.array([0, 4, 7, 8], jnp.int32)   # q has >= 8 rows; rest padding
        context_lens = jnp.array([10, 20, 7], jnp.int32)
        out = paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc)

    Args:
      q: ``[num_tokens, num_heads, head_dim]``, fp32 / bf16 / fp16: the new tokens of every
        sequence packed in batch order, then any padding rows.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, fp32 / bf16 / fp16 /
        float8_e4m3fn (then with ``k_scale`` / ``v_scale``), already holding the new tokens.
      block_tables: ``i32[batch, max_blocks]``.
      context_lens: ``i32[batch]``, each in ``[q_len_b, max_blocks * block_size]``.
      query_start_loc: ``i32[batch + 1]``, non-decreasing from 0, the last entry ``<= num_tokens``.
      scale: softmax scale, static; None means ``1 / sqrt(head_dim)``.
      logits_soft_cap: static ``cap > 0``: ``s = cap * tanh(s / cap)``.
      alibi_slopes: ``f32[num_heads]``: ``s += slope[h] * (j - p)``.
      sliding_window: static ``W >= 1``; the kernel does not read tiles wholly outside the window.
      sinks: ``f32[num_heads]``, one extra logit per head in the softmax denominator.
      k_scale, v_scale: per-tensor dequantization scales of an fp8 cache: python floats or
        float32 arrays of shape ``()`` / ``(1,)`` (operands: one program serves every scale).
      return_lse: also return ``lse f32[num_tokens, num_heads]`` (``-inf`` for padding rows).
      impl: ``"auto"`` (the kernel `select_kernel` picks: the measured-faster one per shape
        class, `IMPL_CHOICE`), ``"pallas"`` (the Triton kernel), ``"mosaic"`` (the Mosaic GPU
        kernel: Hopper, jax >= 0.11.2, 16-bit caches; `mosaic_gpu.check_supported` says what
        else) or ``"xla"``
        (plain jnp, for small problems: it holds ``f32[num_tokens, max_blocks * block_size,
        num_kv_heads, head_dim]`` for K and for V).
      interpret: Pallas interpret mode; None means exactly when there is no GPU backend.
      config: kernel knobs (`AttentionConfig` for ``"pallas"``, `MosaicAttentionConfig` for
        ``"mosaic"``); None takes the tuned table's entry for this shape class, or the
        heuristic.
      check_values: when the arrays are concrete (an eager call, not under ``jax.jit``), check
        their values as torch_ref does (`validate_attention_inputs`), which fetches them to the
        host. False skips that for a hot eager loop; traced calls never check values.

    Returns:
      ``out [num_tokens, num_heads, head_dim]`` in ``q.dtype``, or ``(out, lse)`` with
      ``return_lse``.

    Raises:
      ValueError: before anything runs (under jit: at trace time), for wrong ranks, shapes or
        dtypes (``query_start_loc`` must be ``[batch + 1]``), ``num_heads % num_kv_heads``, bad
        options or an unknown ``impl``; in an eager call with ``check_values``, for bad values:
        everything `pallas_paged.decode` refuses, ``query_start_loc[0] != 0``, a decreasing
        ``query_start_loc``, ``query_start_loc[batch] > num_tokens``, ``q_len_b >
        context_lens[b]``. Under jit, values cannot raise: ``query_start_loc`` is clamped into
        ``[0, num_tokens]``, made non-decreasing (a running maximum) and its first entry taken as
        0, so every row has one owner; a query at a position below 0 (``q_len_b >
        context_lens[b]``) sees nothing and gives zeros (lse ``-inf``); lengths and block ids as
        in `pallas_paged.decode` (docs/RELIABILITY.md).
    """
    return _paged_attention_call(
        q, (k_cache, v_cache), block_tables, context_lens, query_start_loc, scale,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, impl=impl,
        interpret=interpret, config=config, check_values=check_values)


@without_triton_deprecation
def paged_attention_fused(
    q: jax.Array,
    kv_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
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
    config: AttentionConfig | MosaicAttentionConfig | None = None,
    check_values: bool = True,
):
    """`paged_attention` over a fused cache: the JAX serving engines' layout (SPEC.md, "Fused KV
    layout").

    ``kv_cache [num_blocks, block_size, 2 * num_kv_heads, head_dim]`` holds K of kv head ``h`` at
    combined head ``2h`` and V at ``2h + 1``: it is the pair ``(kv_cache[:, :, 0::2],
    kv_cache[:, :, 1::2])``, and the result is bit for bit ``paged_attention(q, kv_cache[:, :,
    0::2], kv_cache[:, :, 1::2], ...)``'s. The kernel reads the interleaved rows in place (no
    copy, no transpose of the cache). Every other argument, the options and the errors are
    `paged_attention`'s; `pallas_paged.compat.ragged_paged_attention` takes JAX's TPU signature.
    """
    return _paged_attention_call(
        q, (kv_cache,), block_tables, context_lens, query_start_loc, scale,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, impl=impl,
        interpret=interpret, config=config, check_values=check_values)


def _paged_attention_call(q, caches: tuple, block_tables, context_lens, query_start_loc, scale, *,
                          logits_soft_cap, alibi_slopes, sliding_window, sinks, k_scale, v_scale,
                          return_lse, impl, interpret, config, check_values):
    """`paged_attention` and `paged_attention_fused` from their caches: ``(k_cache, v_cache)``,
    or ``(kv_cache,)`` (fused). Validates, selects the kernel, calls the jitted program."""
    if len(caches) == 1:  # fused: the checks every layout shares run on the halves' shape
        k_half = v_half = _validation.static_validate_fused_cache(caches[0])
    else:
        k_half, v_half = caches
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks)
    _validation.static_validate_attention(q, k_half, v_half, block_tables, context_lens,
                                          query_start_loc, k_scale=k_scale, v_scale=v_scale,
                                          **options)
    _validation.static_validate_call(caches[0], impl=impl, impls=ATTENTION_IMPLS,
                                     return_lse=return_lse, interpret=interpret,
                                     check_values=check_values)
    if check_values and _validation.is_concrete(block_tables, context_lens, query_start_loc,
                                                k_scale, v_scale):
        _validation.check_attention_values(q, k_half, block_tables, context_lens,
                                           query_start_loc, k_scale, v_scale)
    interpret = resolve_interpret(interpret)
    impl, config = select_kernel(q, k_half, block_tables, impl=impl, config=config,
                                 interpret=interpret)
    if impl == "mosaic":
        warn_if_interpret_may_stall(interpret, config.num_consumers + 1, fewer="num_consumers")
    num_tokens = q.shape[0]
    num_blocks, block_size = k_half.shape[:2]
    capacity = block_tables.shape[1] * block_size
    if sliding_window is not None and sliding_window >= capacity:
        sliding_window = None  # every position j <= p < capacity has j > p - W: no window
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    out, lse = _paged_attention_jit(
        q, caches, _validation.host_clamp_index(block_tables, 0, num_blocks - 1),
        _validation.host_clamp_index(context_lens, 0, capacity),
        _validation.host_clamp_index(query_start_loc, 0, num_tokens), alibi_slopes, sinks,
        scale_operand(k_scale), scale_operand(v_scale), scale=scale,
        logits_soft_cap=logits_soft_cap, sliding_window=sliding_window, impl=impl,
        interpret=interpret, config=config)
    return (out, lse) if return_lse else out


@functools.partial(
    jax.jit, static_argnames=("scale", "logits_soft_cap", "sliding_window", "impl", "interpret",
                              "config"))
def _paged_attention_jit(q, caches, block_tables, context_lens, query_start_loc, alibi_slopes,
                         sinks, k_scale, v_scale, *, scale: float, logits_soft_cap,
                         sliding_window, impl: str, interpret: bool, config):
    """`paged_attention` after validation and `select_kernel`: ``caches`` ``(k_cache, v_cache)``
    or ``(kv_cache,)`` (fused), ``scale`` resolved, ``k_scale`` / ``v_scale`` ``f32[]`` or None.

    Returns ``(out, lse)``. int64 indices are clamped in int64 here, before they are narrowed.
    """
    fused = len(caches) == 1
    k_cache, v_cache = (caches[0], caches[0]) if fused else caches
    num_tokens, num_heads, _ = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    tables = _validation.clamp_index(block_tables, 0, num_blocks - 1)
    lens = _validation.clamp_index(context_lens, 0, capacity)
    # Under jit a malformed query_start_loc cannot raise: it is clamped into [0, num_tokens], made
    # non-decreasing (a running maximum) and starts at 0, so every row of q has one owner.
    starts = jnp.clip(_validation.clamp_index(query_start_loc, 0, num_tokens), 0, num_tokens)
    starts = jax.lax.cummax(starts).at[0].set(0)
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                   sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if num_tokens == 0 or block_tables.shape[0] == 0 or max_blocks == 0:
        # nothing to attend: every row is padding, or no sequence can hold a token
        return (jnp.zeros(q.shape, q.dtype),
                jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32))
    if impl == "xla":
        return paged_attention_xla(q, *(split_kv_cache(k_cache) if fused else caches), tables,
                                   lens, starts, **options)
    if impl == "mosaic":
        return paged_attention_mosaic(q, k_cache, v_cache, tables, lens, starts, config=config,
                                      interpret=interpret, fused=fused, **options)
    return paged_attention_pallas(q, k_cache, v_cache, tables, lens, starts, config=config,
                                  interpret=interpret, fused=fused, **options)

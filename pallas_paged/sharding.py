"""Multi-device paged attention and cache write: the single-device ops under ``shard_map``, no
collectives.

A serving step is embarrassingly parallel along two axes, and this module shards it along either
or both, running the single-device `pallas_paged.decode` / `pallas_paged.paged_attention` /
`pallas_paged.write_kv` on every shard:

- **Tensor parallel** (``kv_axis``): the kv heads. Device ``i`` of an ``n``-way axis holds kv heads
  ``[i * KVH/n, (i + 1) * KVH/n)`` of the caches and query heads ``[i * H/n, (i + 1) * H/n)`` of ``q``
  (and of ``alibi_slopes`` / ``sinks``). Block tables and lengths are replicated.
- **Batch parallel** (``batch_axis``): the sequences. Device ``i`` holds batch rows
  ``[i * B/n, (i + 1) * B/n)`` of ``q``, ``block_tables`` and ``context_lens``, and blocks
  ``[i * NB/n, (i + 1) * NB/n)`` of the caches: **each device's cache shard is a pool of its own,
  and the block ids in its rows of ``block_tables`` are local to that shard** (``0`` is the first
  block of the device's shard, not of the global array). The global block ``i * NB/n + j`` is local
  block ``j`` of device ``i``. Likewise for `shard_write_kv`: token rows are split over the devices
  and each device's ``slot_mapping`` entries are slots of its own shard (local slot ``s`` of device
  ``i`` is global slot ``i * (NB/n) * block_size + s``). An allocator that hands each device's
  sequences blocks from that device's pool produces exactly this.
  For `shard_paged_attention` (ragged query tokens) the tokens are split like the write's:
  device ``i`` holds token rows ``[i * T/n, (i + 1) * T/n)`` of ``q`` (its sequences' new tokens,
  packed from the start of its chunk, padding after them) and its own segment of
  ``query_start_loc``, **local to its token chunk**: the global ``query_start_loc`` is the devices'
  segments of ``B/n + 1`` entries one after another (``B + n`` entries), each starting at 0.
- Both at once on a 2-D mesh (e.g. ``("dp", "tp")``).

Why there is no communication. Attention of one sequence and one query head reads only that
sequence's blocks and that head's kv head; nothing is reduced across heads or across sequences. So
every device computes its own outputs from the data it holds, and the output is produced already
sharded like ``q``. The compiled program holds no all-gather, all-reduce, reduce-scatter,
all-to-all or collective-permute (the tests check the HLO), *provided the inputs arrive with the
shardings of* `decode_shardings` / `write_shardings` (`jax.device_put` them once; the caches stay
put across steps). An input with any other sharding is resharded by XLA at the start of the call.

Why GQA survives the split. Query head ``h`` uses kv head ``h // G`` with ``G = H / KVH``. Query
heads are split contiguously in chunks of ``H/n = G * KVH/n`` and kv heads in chunks of ``KVH/n``,
so device ``i``'s local query head ``j = h - i * G * KVH/n`` maps, by the same single-device rule,
to local kv head ``j // G = h // G - i * KVH/n``: exactly the local index of global kv head
``h // G``. A group of ``G`` query heads is never cut in two, because ``H/n`` is a multiple of ``G``.
This needs ``KVH % n == 0`` (then ``H % n == 0`` follows); splitting the query heads alone when
``KVH < n`` would need the kv heads replicated, which this module does not do.

Kernel configs. With ``config=None`` every shard picks the config of its own (smaller) shape, which
is what it should run for speed; a different ``num_splits`` may change the last bits of the output
compared with a single-device call on the global shape. Pass the same ``config`` to both to get
bit-identical results.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_paged import _validation
from pallas_paged.cache_write.api import write_kv
from pallas_paged._fp8 import scale_operand
from pallas_paged.decode_attention.api import decode
from pallas_paged.ragged_attention.api import paged_attention

__all__ = [
    "shard_decode",
    "shard_paged_attention",
    "shard_write_kv",
    "decode_shardings",
    "attention_shardings",
    "write_shardings",
    "collectives_in",
    "COLLECTIVE_OPS",
]

# HLO op names of cross-device traffic; none of them may appear in a compiled sharded step.
COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                  "collective-broadcast", "ragged-all-to-all")

# decode's keywords: the static ones (part of the compiled program) and the per-head arrays.
_DECODE_STATIC = ("scale", "logits_soft_cap", "sliding_window", "return_lse", "impl", "interpret",
                  "config", "check_values")
_DECODE_HEAD_ARRAYS = ("alibi_slopes", "sinks")
# fp8 scales: python floats or f32[] arrays, per call, replicated on every device.
_SCALES = ("k_scale", "v_scale")
_WRITE_STATIC = ("impl", "interpret")


def _shard_map(f: Callable, mesh, in_specs, out_specs) -> Callable:
    """``shard_map`` across JAX versions: ``jax.shard_map`` where it exists, else the experimental one.

    The replication check is off (``check_vma`` / ``check_rep``): the Pallas call has no rule for it,
    and every output here is fully described by its spec.
    """
    if hasattr(jax, "shard_map"):
        smap = jax.shard_map
    else:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map as smap
    try:
        params = inspect.signature(smap).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C-level callable
        params = {}
    check = {}
    if "check_vma" in params:
        check["check_vma"] = False
    elif "check_rep" in params:
        check["check_rep"] = False
    return smap(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)


def _axis_sizes(mesh) -> dict[str, int]:
    return {str(name): int(size) for name, size in dict(mesh.shape).items()}


def _check_axes(mesh, kv_axis, batch_axis) -> dict[str, int]:
    """The mesh's axis sizes, after checking that the named axes exist and differ."""
    sizes = _axis_sizes(mesh)
    if kv_axis is None and batch_axis is None:
        raise ValueError("kv_axis and batch_axis are both None: name at least one mesh axis to shard"
                         f" over (mesh axes {sizes})")
    for arg, axis in (("kv_axis", kv_axis), ("batch_axis", batch_axis)):
        if axis is None:
            continue
        if not isinstance(axis, str):
            raise ValueError(f"{arg}={axis!r} must be a mesh axis name (str) or None")
        if axis not in sizes:
            raise ValueError(f"{arg}={axis!r} is not an axis of the mesh: mesh axes {sizes}")
    if kv_axis is not None and kv_axis == batch_axis:
        raise ValueError(f"kv_axis and batch_axis must be different mesh axes, got {kv_axis!r} for"
                         f" both (mesh axes {sizes})")
    return sizes


def _check_divides(what: str, value: int, axis: str | None, sizes: Mapping[str, int],
                   context: str) -> None:
    if axis is None:
        return
    n = sizes[axis]
    if value % n:
        raise ValueError(f"{what}={value} must be divisible by the size of mesh axis {axis!r} ({n}):"
                         f" {context}; mesh axes {dict(sizes)}")


def _split_kwargs(kind: str, kwargs: dict, static_names, array_names=()) -> tuple[dict, dict]:
    unknown = sorted(set(kwargs) - set(static_names) - set(array_names))
    if unknown:
        raise ValueError(f"unknown {kind} keyword(s) {unknown}; expected some of"
                         f" {sorted(static_names) + sorted(array_names)}")
    static = {k: v for k, v in kwargs.items() if k in static_names}
    arrays = {k: v for k, v in kwargs.items() if k in array_names}
    return static, arrays


def _scale_operands(k_scale, v_scale) -> dict:
    """The given fp8 scales as ``f32[]`` operands of the sharded call (replicated), by name."""
    given = (("k_scale", k_scale), ("v_scale", v_scale))
    return {name: scale_operand(s) for name, s in given if s is not None}


def _decode_specs(kv_axis, batch_axis) -> dict[str, P]:
    return {
        "q": P(batch_axis, kv_axis, None),                 # [batch, num_heads, head_dim]
        "k_cache": P(batch_axis, None, kv_axis, None),     # [num_blocks, block_size, kvh, head_dim]
        "v_cache": P(batch_axis, None, kv_axis, None),
        "block_tables": P(batch_axis, None),               # i32[batch, max_blocks]
        "context_lens": P(batch_axis),                     # i32[batch]
        "alibi_slopes": P(kv_axis),                        # f32[num_heads]
        "sinks": P(kv_axis),                               # f32[num_heads]
        "out": P(batch_axis, kv_axis, None),               # [batch, num_heads, head_dim]
        "lse": P(batch_axis, kv_axis),                     # f32[batch, num_heads]
    }


def _attention_specs(kv_axis, batch_axis) -> dict[str, P]:
    return {
        "q": P(batch_axis, kv_axis, None),                 # [num_tokens, num_heads, head_dim]
        "k_cache": P(batch_axis, None, kv_axis, None),     # [num_blocks, block_size, kvh, head_dim]
        "v_cache": P(batch_axis, None, kv_axis, None),
        "block_tables": P(batch_axis, None),               # i32[batch, max_blocks]
        "context_lens": P(batch_axis),                     # i32[batch]
        "query_start_loc": P(batch_axis),                  # i32[batch + 1], or i32[batch + n] (local)
        "alibi_slopes": P(kv_axis),                        # f32[num_heads]
        "sinks": P(kv_axis),                               # f32[num_heads]
        "out": P(batch_axis, kv_axis, None),               # [num_tokens, num_heads, head_dim]
        "lse": P(batch_axis, kv_axis),                     # f32[num_tokens, num_heads]
    }


def _write_specs(kv_axis, batch_axis) -> dict[str, P]:
    return {
        "k_cache": P(batch_axis, None, kv_axis, None),     # [num_blocks, block_size, kvh, head_dim]
        "v_cache": P(batch_axis, None, kv_axis, None),
        "k": P(batch_axis, kv_axis, None),                 # [num_tokens, kvh, head_dim]
        "v": P(batch_axis, kv_axis, None),
        "slot_mapping": P(batch_axis),                     # i32[num_tokens]
    }


def decode_shardings(mesh, *, kv_axis: str | None = "tp",
                     batch_axis: str | None = None) -> dict[str, NamedSharding]:
    """Where `shard_decode`'s arrays live, by argument name (``"out"`` / ``"lse"`` for the results).

    ``jax.device_put(x, decode_shardings(mesh)["k_cache"])`` places an array so that the sharded
    call moves nothing between devices.
    """
    _check_axes(mesh, kv_axis, batch_axis)
    return {name: NamedSharding(mesh, spec) for name, spec in _decode_specs(kv_axis, batch_axis).items()}


def attention_shardings(mesh, *, kv_axis: str | None = "tp",
                        batch_axis: str | None = None) -> dict[str, NamedSharding]:
    """Where `shard_paged_attention`'s arrays live, by argument name (``"out"`` / ``"lse"`` for the
    results)."""
    _check_axes(mesh, kv_axis, batch_axis)
    return {name: NamedSharding(mesh, spec)
            for name, spec in _attention_specs(kv_axis, batch_axis).items()}


def write_shardings(mesh, *, kv_axis: str | None = "tp",
                    batch_axis: str | None = None) -> dict[str, NamedSharding]:
    """Where `shard_write_kv`'s arrays live, by argument name (the caches keep theirs)."""
    _check_axes(mesh, kv_axis, batch_axis)
    return {name: NamedSharding(mesh, spec) for name, spec in _write_specs(kv_axis, batch_axis).items()}


def shard_decode(mesh, *, kv_axis: str | None = "tp", batch_axis: str | None = None,
                 **decode_kwargs) -> Callable:
    """`pallas_paged.decode` over arrays sharded on a device mesh, one single-device call per shard.

    Tensor parallel over ``kv_axis`` (heads), batch parallel over ``batch_axis`` (sequences, with
    **block ids local to each device's cache shard**), or both; see the module docstring for the
    layout and why no device needs another's data. No collective is emitted.

    Args:
      mesh: a `jax.sharding.Mesh` holding the named axes (other axes replicate the work).
      kv_axis: mesh axis to split the kv heads (and their query heads) over, or None.
      batch_axis: mesh axis to split the batch and the cache blocks over, or None.
      **decode_kwargs: `decode`'s keywords: ``scale``, ``logits_soft_cap``, ``sliding_window``,
        ``return_lse``, ``impl``, ``interpret``, ``config`` (static), ``alibi_slopes`` / ``sinks``
        (``f32[num_heads]``, global, sharded with the heads) and the fp8 scales ``k_scale`` /
        ``v_scale`` (python floats or ``f32[]`` arrays, replicated): these four are better passed
        to the returned function per call (one compiled program serves every layer); given here
        they are its defaults.

    Returns:
      A jitted ``fn(q, k_cache, v_cache, block_tables, context_lens, *, alibi_slopes=None,
      sinks=None, k_scale=None, v_scale=None)`` on global arrays:

      - ``q [batch, num_heads, head_dim]``: sharded ``P(batch_axis, kv_axis, None)``;
      - ``k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]``:
        ``P(batch_axis, None, kv_axis, None)``;
      - ``block_tables i32[batch, max_blocks]``: ``P(batch_axis, None)`` (replicated without
        ``batch_axis``), ids local to the device's cache shard;
      - ``context_lens i32[batch]``: ``P(batch_axis)``;
      - ``alibi_slopes``, ``sinks`` ``f32[num_heads]``: ``P(kv_axis)``;
      - ``k_scale``, ``v_scale``: replicated (``P()``).

      It returns ``out [batch, num_heads, head_dim]`` sharded like ``q``, or ``(out, lse)`` with
      ``return_lse`` (``lse f32[batch, num_heads]``, ``P(batch_axis, kv_axis)``).

    Raises:
      ValueError: here, when the mesh lacks a named axis, both axes are None or equal, or a keyword
        is unknown; at trace time (the first call for a shape), everything `decode` checks (on the
        global shapes), and ``num_kv_heads`` not divisible by the ``kv_axis`` size, or ``batch`` /
        ``num_blocks`` not divisible by the ``batch_axis`` size, with the shapes and mesh axis sizes
        in the message.
    """
    return _shard_attention_op(mesh, kv_axis, batch_axis, "decode", decode_kwargs, ragged=False)


def shard_paged_attention(mesh, *, kv_axis: str | None = "tp", batch_axis: str | None = None,
                          **attention_kwargs) -> Callable:
    """`pallas_paged.paged_attention` (ragged) over arrays sharded on a device mesh, one
    single-device call per shard, no collectives.

    Tensor parallel over ``kv_axis`` (heads; the token rows, tables, lengths and
    ``query_start_loc`` replicated), batch parallel over ``batch_axis`` (sequences and their new
    tokens, with block ids local to each device's cache shard and ``query_start_loc`` segments
    local to each device's token chunk; see the module docstring), or both.

    Args:
      mesh, kv_axis, batch_axis: as `shard_decode`.
      **attention_kwargs: `paged_attention`'s keywords, as `shard_decode` takes `decode`'s.

    Returns:
      A jitted ``fn(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
      alibi_slopes=None, sinks=None, k_scale=None, v_scale=None)`` on global arrays:

      - ``q [num_tokens, num_heads, head_dim]``: sharded ``P(batch_axis, kv_axis, None)``;
      - caches, ``block_tables``, ``context_lens``, head arrays and scales as in `shard_decode`;
      - ``query_start_loc``: ``i32[batch + 1]`` replicated without ``batch_axis``; with it,
        ``i32[batch + n]`` sharded ``P(batch_axis)``, device ``i``'s ``B/n + 1`` entries indexing
        its own ``T/n`` token rows.

      It returns ``out [num_tokens, num_heads, head_dim]`` sharded like ``q``, or ``(out, lse)``
      with ``return_lse``.

    Raises:
      ValueError: as `shard_decode`; also ``num_tokens`` not divisible by the ``batch_axis`` size,
        and a ``query_start_loc`` whose length is not ``batch + n``; on every shard, everything
        `paged_attention` checks.
    """
    return _shard_attention_op(mesh, kv_axis, batch_axis, "paged_attention", attention_kwargs,
                               ragged=True)


def _shard_attention_op(mesh, kv_axis, batch_axis, kind: str, kwargs: dict, *, ragged: bool):
    """`shard_decode` (``ragged=False``) or `shard_paged_attention` (``ragged=True``)."""
    sizes = _check_axes(mesh, kv_axis, batch_axis)
    static, default_arrays = _split_kwargs(kind, kwargs, _DECODE_STATIC,
                                           _DECODE_HEAD_ARRAYS + _SCALES)
    specs = (_attention_specs if ragged else _decode_specs)(kv_axis, batch_axis)
    op = paged_attention if ragged else decode
    return_lse = bool(static.get("return_lse", False))
    out_specs = (specs["out"], specs["lse"]) if return_lse else specs["out"]
    shards = 1 if batch_axis is None else sizes[batch_axis]

    def sharded(q, k_cache, v_cache, block_tables, context_lens, *query_start_loc,
                alibi_slopes=default_arrays.get("alibi_slopes"),
                sinks=default_arrays.get("sinks"), k_scale=default_arrays.get("k_scale"),
                v_scale=default_arrays.get("v_scale")):
        options = {k: static[k] for k in ("scale", "logits_soft_cap", "sliding_window") if k in static}
        batch = block_tables.shape[0]
        shapes = f"{q.shape=}, {k_cache.shape=}, {block_tables.shape=}"
        if ragged:
            (qsl,) = query_start_loc
            shapes += f", {qsl.shape=}"
            if tuple(qsl.shape) != (batch + shards,):
                raise ValueError(
                    f"query_start_loc.shape={tuple(qsl.shape)} must be [batch + n] ="
                    f" ({batch + shards},): one segment of batch / n + 1 local offsets per"
                    f" batch shard (n = {shards}); {shapes}")
            # Checks on the global shapes with one shard's query_start_loc shape: the rest is
            # checked per shard by paged_attention itself.
            _validation.static_validate_attention(
                q, k_cache, v_cache, block_tables, context_lens,
                jax.ShapeDtypeStruct((batch + 1,), qsl.dtype), k_scale=k_scale, v_scale=v_scale,
                alibi_slopes=alibi_slopes, sinks=sinks, **options)
        else:
            _validation.static_validate_decode(
                q, k_cache, v_cache, block_tables, context_lens, k_scale=k_scale, v_scale=v_scale,
                alibi_slopes=alibi_slopes, sinks=sinks, **options)
        kvh = k_cache.shape[2]
        _check_divides("num_kv_heads", kvh, kv_axis, sizes, shapes)
        _check_divides("batch", batch, batch_axis, sizes, shapes)
        _check_divides("num_blocks", k_cache.shape[0], batch_axis, sizes, shapes)
        if ragged:
            _check_divides("num_tokens", q.shape[0], batch_axis, sizes, shapes)
        if kv_axis is not None:  # the GQA argument of the module docstring, as shapes
            heads_per_device = q.shape[1] // sizes[kv_axis]
            group = q.shape[1] // kvh
            assert heads_per_device % group == 0, (heads_per_device, group)

        head_arrays = {k: x for k, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
                       if x is not None}
        scales = _scale_operands(k_scale, v_scale)
        names = tuple(head_arrays) + tuple(scales)
        arrays = (q, k_cache, v_cache, block_tables, context_lens) + tuple(query_start_loc)
        num_arrays = len(arrays)

        def per_shard(*args):
            return op(*args[:num_arrays], **dict(zip(names, args[num_arrays:])), **static)

        in_specs = (tuple(specs[k] for k in ("q", "k_cache", "v_cache", "block_tables",
                                              "context_lens"))
                    + ((specs["query_start_loc"],) if ragged else ())
                    + tuple(specs[k] for k in head_arrays) + (P(),) * len(scales))
        fn = _shard_map(per_shard, mesh, in_specs, out_specs)
        return fn(*arrays, *head_arrays.values(), *scales.values())

    return jax.jit(sharded)


def shard_write_kv(mesh, *, kv_axis: str | None = "tp", batch_axis: str | None = None,
                   **write_kwargs) -> Callable:
    """`pallas_paged.write_kv` over sharded caches, in place on every device, no collectives.

    With ``kv_axis``, device ``i`` writes the rows of its kv heads of every token into its cache
    shard. With ``batch_axis``, the tokens are split into contiguous chunks, one per device, and the
    slots of device ``i``'s chunk are **local to its cache shard** (``-1`` still means padding);
    see the module docstring.

    Args:
      mesh: a `jax.sharding.Mesh` holding the named axes.
      kv_axis: mesh axis to split the kv heads over, or None.
      batch_axis: mesh axis to split the tokens and the cache blocks over, or None.
      **write_kwargs: `write_kv`'s static keywords ``impl``, ``interpret``, and the default fp8
        scales ``k_scale``, ``v_scale`` (better passed per call: one program for every layer).

    Returns:
      A jitted ``fn(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None) ->
      (k_cache, v_cache)`` (scales: python floats or ``f32[]`` arrays, replicated) that donates the
      caches (``donate_argnums=(0, 1)``): the input cache arrays are consumed and the results reuse
      their buffers on every device. Shardings: caches ``P(batch_axis, None, kv_axis, None)``,
      ``k, v [num_tokens, num_kv_heads, head_dim]`` ``P(batch_axis, kv_axis, None)``,
      ``slot_mapping i32[num_tokens]`` ``P(batch_axis)`` (replicated without ``batch_axis``).

    Raises:
      ValueError: here, when the mesh lacks a named axis, both axes are None or equal, or a keyword
        is unknown; at trace time, everything `write_kv` checks (on the global shapes), and
        ``num_kv_heads`` not divisible by the ``kv_axis`` size, or ``num_tokens`` / ``num_blocks``
        not divisible by the ``batch_axis`` size.
    """
    sizes = _check_axes(mesh, kv_axis, batch_axis)
    static, default_scales = _split_kwargs("write_kv", write_kwargs, _WRITE_STATIC, _SCALES)
    specs = _write_specs(kv_axis, batch_axis)
    cache_spec = specs["k_cache"]

    def sharded_write(k_cache, v_cache, k, v, slot_mapping, *,
                      k_scale=default_scales.get("k_scale"), v_scale=default_scales.get("v_scale")):
        _validation.static_validate_write(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        shapes = f"{k_cache.shape=}, {k.shape=}, {slot_mapping.shape=}"
        _check_divides("num_kv_heads", k_cache.shape[2], kv_axis, sizes, shapes)
        _check_divides("num_tokens", slot_mapping.shape[0], batch_axis, sizes, shapes)
        _check_divides("num_blocks", k_cache.shape[0], batch_axis, sizes, shapes)
        scales = _scale_operands(k_scale, v_scale)
        names = tuple(scales)

        def per_shard(k_cache, v_cache, k, v, slot_mapping, *extras):
            return write_kv(k_cache, v_cache, k, v, slot_mapping, **dict(zip(names, extras)),
                            **static)

        fn = _shard_map(per_shard, mesh,
                        (cache_spec, cache_spec, specs["k"], specs["v"], specs["slot_mapping"])
                        + (P(),) * len(scales),
                        (cache_spec, cache_spec))
        return fn(k_cache, v_cache, k, v, slot_mapping, *scales.values())

    return jax.jit(sharded_write, donate_argnums=(0, 1))


def collectives_in(hlo_text: str) -> list[str]:
    """The `COLLECTIVE_OPS` that occur in an HLO text (e.g. ``jitted.lower(...).compile().as_text()``)."""
    return [op for op in COLLECTIVE_OPS if op in hlo_text]

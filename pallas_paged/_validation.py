"""Input validation, split as in JAX's ragged paged attention.

- ``static_validate_*``: ranks, shapes, dtypes and option types. They read only ``.shape`` and
  ``.dtype``, so they run at trace time and every implementation (XLA path, Pallas kernel, write)
  calls them. Each raises ``ValueError`` with the shapes in the message.
- ``check_*_values``: the value checks (slots in range and unique, block ids in range for the
  valid part of each table, lengths non-negative and within capacity, a well-formed
  ``query_start_loc``, fp8 scales finite and positive). They fetch the values to the host, so the
  public functions run them in eager calls only (`is_concrete`; ``check_values=False`` skips
  them). ``validate_*_inputs`` are both, for callers who check untrusted inputs before a jitted
  step.

Under ``jax.jit`` values cannot raise. What happens instead, by construction of the kernels:

- ``write_kv``: a slot ``< 0`` or ``>= num_blocks * block_size`` is dropped (nothing is written for
  that token; ``-1`` is never wrapped to the last slot, and no slot is clipped onto another). When two
  tokens share a slot, one of them wins; which one is unspecified.
- ``decode``: a length below 0 counts as 0 and one above ``max_blocks * block_size`` as that
  capacity; a block id outside ``[0, num_blocks)`` in the valid part of a table is clamped into
  that range (the read stays inside the cache, the output for that sequence is meaningless).
  Table entries past ``ceil(n / block_size)`` are never read at all.
- ``paged_attention``: lengths and block ids as in ``decode``; ``query_start_loc`` is clamped into
  ``[0, num_tokens]``, made non-decreasing (a running maximum) and its first entry taken as 0, so
  every row of ``q`` belongs to one sequence or to the padding; a query whose position is below 0
  (``q_len_b > context_lens[b]``) sees no position and gives zeros, ``lse = -inf``.

int64 indices never wrap. The kernels work in int32; an int64 index array is clamped *in int64*
into the range its rule above maps it to (slots into ``[-1, num_blocks * block_size]``, lengths
into ``[0, capacity]``, block ids into ``[0, num_blocks)``) before it is narrowed, so a slot of
``2**32 + 5`` is dropped rather than written to slot 5. A numpy int64 array is clamped on the host
before JAX converts it (with x64 off that conversion would wrap it); a JAX int64 array (x64 on,
concrete or traced) is clamped on the device (`clamp_index`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_paged._fp8 import EXACT_RANGE
from pallas_paged._platform import kernel_addresses_overflow

CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn)
QUERY_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INDEX_DTYPES = (jnp.int32, jnp.int64)
FP8_DTYPE = jnp.float8_e4m3fn
FP32_MAX = float(np.finfo(np.float32).max)
# fp8 scales: within [2**-60, 2**60] (SPEC.md), the range where the write's correctly rounded
# division (`_fp8.divide_rn`) gives torch's bits on every backend; torch_ref refuses the same.
FP8_SCALE_RANGE = EXACT_RANGE


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _dtype(x):
    """``x``'s dtype as a numpy dtype, which prints as its bare name (``float32``)."""
    return jnp.dtype(x.dtype)


def _is_torch_tensor(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _check_array(name: str, x) -> None:
    """``x`` is a JAX or numpy array (a torch tensor gets a message that says how to convert)."""
    if _is_torch_tensor(x):
        raise ValueError(
            f"{name} is a torch.Tensor ({type(x).__name__} of shape {tuple(x.shape)}): pallas_paged"
            f" takes JAX or numpy arrays; convert it first, e.g. jnp.asarray({name}.numpy()), or"
            f" bit-exactly for any dtype with parity.convert.from_torch({name})")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def _check_rank(name: str, x, ndim: int) -> None:
    _check_array(name, x)
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got {name}.shape={_shape(x)}")


def _check_int(name: str, x) -> None:
    if _dtype(x) not in [jnp.dtype(d) for d in INDEX_DTYPES]:
        raise ValueError(f"{name} must be int32 or int64, got {name}.dtype={_dtype(x)}")


def check_index_array(name: str, x, ndim: int) -> None:
    """``x`` is an int32 or int64 array of rank ``ndim`` (a `ValueError` naming ``name``)."""
    _check_rank(name, x, ndim)
    _check_int(name, x)


def _is_python_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_concrete(*values) -> bool:
    """True when no value is traced (an eager call), so values can be fetched and checked."""
    return not any(isinstance(v, jax.core.Tracer) for v in values)


# The python-valued options of `decode` and `paged_attention`: static under a caller's jax.jit.
STATIC_OPTIONS = ("scale", "logits_soft_cap", "sliding_window", "return_lse", "impl",
                  "interpret", "config", "check_values")


def _check_not_traced(name: str, value) -> None:
    """A traced python-valued option gets a message that says to mark it static."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} is traced ({type(value).__name__}): it must be a python value, static under"
            f" jax.jit; mark it static, e.g. jax.jit(fn, static_argnames=({name!r}, ...)), or"
            f" close over it. The static options are {', '.join(STATIC_OPTIONS)}")


def _check_positive_float(name: str, value) -> None:
    _check_not_traced(name, value)
    if not _is_python_number(value):
        raise ValueError(f"{name} must be a python float, got {type(value).__name__}")
    if not (math.isfinite(value) and 0 < value <= FP32_MAX):
        raise ValueError(f"{name}={value} must be finite and > 0 (and at most float32's max)")


def check_fp8_scale_value(name: str, number: float) -> None:
    """An fp8 scale's value: finite and in `FP8_SCALE_RANGE` (the same message as torch_ref's)."""
    lo, hi = FP8_SCALE_RANGE
    if not (math.isfinite(number) and lo <= number <= hi):
        raise ValueError(f"{name}={number} must be finite and in [2**-60, 2**60]")


def check_fp8_scale(name: str, value) -> None:
    """A per-tensor fp8 scale: a python float in `FP8_SCALE_RANGE` or a float32 array of shape
    () or (1,).

    An array may be traced (under ``jax.jit`` one compiled program serves every value); its value
    is checked in eager calls (`check_write_values`, `check_decode_values`).
    """
    if _is_python_number(value):
        check_fp8_scale_value(name, value)
        return
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"{name} must be a python float or a float32 scalar array, got"
                         f" {type(value).__name__}")
    if _shape(value) not in ((), (1,)) or _dtype(value) != jnp.dtype(jnp.float32):
        raise ValueError(f"{name} must be a python float or a float32 array of shape () or (1,),"
                         f" got {name}.shape={_shape(value)}, {name}.dtype={_dtype(value)}")


def static_validate_caches(k_cache, v_cache) -> None:
    _check_rank("k_cache", k_cache, 4)
    _check_rank("v_cache", v_cache, 4)
    if _shape(k_cache) != _shape(v_cache):
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {k_cache.shape=} and {v_cache.shape=}")
    if _dtype(k_cache) != _dtype(v_cache):
        raise ValueError(f"k_cache and v_cache must have the same dtype, got k_cache.dtype={_dtype(k_cache)} and v_cache.dtype={_dtype(v_cache)}")
    if _dtype(k_cache) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
        raise ValueError(f"k_cache.dtype={_dtype(k_cache)} must be float32, bfloat16, float16 or float8_e4m3fn")
    if min(_shape(k_cache)) < 1:
        raise ValueError(f"{k_cache.shape=} must have every dimension >= 1")


def static_validate_fused_cache(kv_cache):
    """A fused cache ``[num_blocks, block_size, 2 * num_kv_heads, head_dim]`` (K of kv head ``h``
    at combined head ``2h``, V at ``2h + 1``): its rank, dtype and an even head axis. Returns
    the shape and dtype of its K half (and V half), ``[num_blocks, block_size, num_kv_heads,
    head_dim]``, for the checks every layout shares."""
    _check_rank("kv_cache", kv_cache, 4)
    if _dtype(kv_cache) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
        raise ValueError(f"kv_cache.dtype={_dtype(kv_cache)} must be float32, bfloat16, float16 or"
                         " float8_e4m3fn")
    num_blocks, block_size, heads, head_dim = _shape(kv_cache)
    if heads % 2 or min(_shape(kv_cache)) < 1:
        raise ValueError(
            f"kv_cache.shape={_shape(kv_cache)} must be [num_blocks, block_size, 2 * num_kv_heads,"
            " head_dim] with every dimension >= 1: K of kv head h at 2h, V at 2h + 1")
    return jax.ShapeDtypeStruct((num_blocks, block_size, heads // 2, head_dim), _dtype(kv_cache))


def static_validate_fp8_scales(cache_dtype, k_scale, v_scale) -> None:
    """fp8 caches need both per-tensor scales (`check_fp8_scale`); other caches take none."""
    if jnp.dtype(cache_dtype) == jnp.dtype(FP8_DTYPE):
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{name} is required for a float8_e4m3fn cache")
            check_fp8_scale(name, s)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale / v_scale apply to float8_e4m3fn caches only, got a {jnp.dtype(cache_dtype)}"
            f" cache with {k_scale=}, {v_scale=}")


def static_validate_write(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
    static_validate_caches(k_cache, v_cache)
    _check_rank("k", k, 3)
    _check_rank("v", v, 3)
    _check_rank("slot_mapping", slot_mapping, 1)
    _, _, kvh, d = _shape(k_cache)
    num_tokens = _shape(slot_mapping)[0]
    for name, x in (("k", k), ("v", v)):
        if _shape(x) != (num_tokens, kvh, d):
            raise ValueError(
                f"{name}.shape={_shape(x)} must be [num_tokens, num_kv_heads, head_dim] ="
                f" {(num_tokens, kvh, d)} ({slot_mapping.shape=}, {k_cache.shape=})")
    static_validate_fp8_scales(k_cache.dtype, k_scale, v_scale)
    for name, x in (("k", k), ("v", v)):
        if _dtype(k_cache) == jnp.dtype(FP8_DTYPE):
            if _dtype(x) not in [jnp.dtype(t) for t in QUERY_DTYPES]:
                raise ValueError(f"{name}.dtype={_dtype(x)} must be float32, bfloat16 or float16 for an fp8 cache")
        elif _dtype(x) != _dtype(k_cache):
            raise ValueError(f"{name}.dtype={_dtype(x)} must equal k_cache.dtype={_dtype(k_cache)}")
    _check_int("slot_mapping", slot_mapping)


def static_validate_options(num_heads: int, *, scale=None, logits_soft_cap=None, alibi_slopes=None,
                            sliding_window=None, sinks=None) -> None:
    if scale is not None:
        _check_not_traced("scale", scale)
        if not _is_python_number(scale) or not (math.isfinite(scale) and abs(scale) <= FP32_MAX):
            raise ValueError(f"scale must be a python float, finite in float32, or None, got {scale!r}")
    if logits_soft_cap is not None:
        _check_positive_float("logits_soft_cap", logits_soft_cap)
    if sliding_window is not None:
        _check_not_traced("sliding_window", sliding_window)
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
            raise ValueError(f"sliding_window must be a python int, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"{sliding_window=} must be >= 1")
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is None:
            continue
        _check_rank(name, x, 1)
        if _shape(x) != (num_heads,):
            raise ValueError(f"{name}.shape={_shape(x)} must be [num_heads] = ({num_heads},)")
        if _dtype(x) != jnp.dtype(jnp.float32):
            raise ValueError(f"{name}.dtype={_dtype(x)} must be float32")


def static_validate_query(q, k_cache) -> None:
    """q's dtype (the cache's, or any query dtype over an fp8 cache), head_dim and head counts."""
    if _dtype(q) not in [jnp.dtype(t) for t in QUERY_DTYPES]:
        raise ValueError(f"q.dtype={_dtype(q)} must be float32, bfloat16 or float16")
    if _dtype(k_cache) != jnp.dtype(FP8_DTYPE) and _dtype(q) != _dtype(k_cache):
        raise ValueError(
            f"q.dtype={_dtype(q)} must equal k_cache.dtype={_dtype(k_cache)}: mixed query / cache float dtypes are refused"
            " (only a float8_e4m3fn cache takes a float32, bfloat16 or float16 q)")
    _, num_heads, head_dim = _shape(q)
    _, _, kvh, d = _shape(k_cache)
    if head_dim != d:
        raise ValueError(f"head_dim mismatch: {q.shape=} but {k_cache.shape=}")
    if num_heads % kvh != 0:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads: {q.shape=} has {num_heads} heads,"
            f" {k_cache.shape=} has {kvh} kv heads")


def static_validate_decode(q, k_cache, v_cache, block_tables, context_lens, *, k_scale=None,
                           v_scale=None, **options) -> None:
    """Trace-time checks of `decode`'s arguments; ``options`` are its extension keywords + scale."""
    static_validate_caches(k_cache, v_cache)
    _check_rank("q", q, 3)
    _check_rank("block_tables", block_tables, 2)
    _check_rank("context_lens", context_lens, 1)
    static_validate_query(q, k_cache)
    batch, num_heads, _ = _shape(q)
    if _shape(block_tables)[0] != batch:
        raise ValueError(f"batch mismatch: {q.shape=} but {block_tables.shape=}")
    if _shape(context_lens) != (batch,):
        raise ValueError(f"{context_lens.shape=} must be [batch] = ({batch},) ({q.shape=})")
    _check_int("block_tables", block_tables)
    _check_int("context_lens", context_lens)
    static_validate_fp8_scales(k_cache.dtype, k_scale, v_scale)
    static_validate_options(num_heads, **options)


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def host_clamp_index(x, lo: int, hi: int):
    """A numpy int64 array clamped into ``[lo, hi]`` and narrowed to int32 on the host.

    JAX converts a numpy int64 array to int32 when x64 is off, wrapping values outside int32
    (``2**32 + 5`` becomes 5). The public functions call this first, with the range the jit rules
    map each index to, so that the narrowing changes no outcome. Anything else is returned as is.
    """
    if isinstance(x, np.ndarray) and x.dtype == np.int64:
        return np.clip(x, lo, hi).astype(np.int32)
    return x


def static_validate_call(k_cache, *, impl, impls, return_lse, interpret,
                         check_values=True) -> None:
    """The python-valued options of a public attention call (static under ``jax.jit``)."""
    for name, value in (("impl", impl), ("return_lse", return_lse), ("interpret", interpret),
                        ("check_values", check_values)):
        _check_not_traced(name, value)
    if not isinstance(impl, str) or impl not in impls:
        raise ValueError(f"impl={impl!r} must be one of {impls} (static under jax.jit)")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a python bool (static under jax.jit), got {return_lse!r}")
    if interpret is not None and not isinstance(interpret, bool):
        raise ValueError(
            f"interpret must be a python bool or None (static under jax.jit), got {interpret!r}")
    if not isinstance(check_values, bool):
        raise ValueError(f"check_values must be a python bool, got {check_values!r}")
    if impl in ("pallas", "auto") and kernel_addresses_overflow(k_cache.shape, k_cache.dtype):
        raise ValueError(
            f"impl={impl!r} cannot address a {_dtype(k_cache).name} cache of 2**31 to 2**32"
            f" elements (k_cache.shape={_shape(k_cache)}; Triton offsets stay 32-bit below 2**32"
            " bytes): use impl='xla', or a cache of fewer than 2**31 or more than 2**32 elements")


def check_config_type(config, config_type, impl: str) -> None:
    """``config`` is None or a ``config_type`` (the kernel ``impl`` takes)."""
    if config is not None and not isinstance(config, config_type):
        article = "an" if config_type.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"config must be {article} {config_type.__name__} or None for"
                         f" impl={impl!r}, got {type(config).__name__}")


def clamp_index(x, lo: int, hi: int):
    """Inside a traced program: an int64 index array clamped into ``[lo, hi]`` in int64, then
    narrowed to int32 (so it cannot wrap); an int32 one unchanged (the kernels bound it)."""
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.int64):
        return jnp.clip(x, lo, hi).astype(jnp.int32)
    return x.astype(jnp.int32)


def _check_scale_values(k_scale, v_scale) -> None:
    """The value of array scales (python floats were checked statically)."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or _is_python_number(s):
            continue
        check_fp8_scale_value(name, float(np.asarray(s, np.float32).reshape(())))


def validate_write_inputs(k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Eager checks of `write_kv`'s arguments: the static checks, then slot values.

    Pass the arrays as they will be passed to `write_kv` (numpy int64 slots are checked at their
    full width, before any narrowing).

    Raises:
      ValueError: a slot ``< -1`` or ``>= num_blocks * block_size``, or a slot used by two tokens,
        naming the first offending token index; an array scale that is not finite and > 0; or any
        static check.
    """
    static_validate_write(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    check_write_values(k_cache, slot_mapping, k_scale, v_scale)


def check_write_values(k_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """The value checks of `validate_write_inputs`, after its static checks."""
    _check_scale_values(k_scale, v_scale)
    num_blocks, block_size = _shape(k_cache)[:2]
    num_slots = num_blocks * block_size
    slots = np.asarray(slot_mapping).astype(np.int64)
    bad = (slots < -1) | (slots >= num_slots)
    if bad.any():
        (i,) = _first(bad)
        raise ValueError(
            f"slot_mapping[{i}]={slots[i]} is out of range: slots must be -1 (padding) or in"
            f" [0, num_blocks * block_size) = [0, {num_slots})")
    token_ids = np.flatnonzero(slots >= 0)
    _, first_use = np.unique(slots[token_ids], return_index=True)
    if len(first_use) < len(token_ids):
        repeated = np.ones(len(token_ids), bool)
        repeated[first_use] = False
        i = int(token_ids[np.argmax(repeated)])
        raise ValueError(f"slot_mapping[{i}]={slots[i]} is a duplicate: every slot may be written by one token only")


def validate_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, *, k_scale=None,
                           v_scale=None, **options) -> None:
    """Eager checks of `decode`'s arguments: the static checks, then lengths and block ids.

    Raises:
      ValueError: a negative length, a length beyond ``max_blocks * block_size`` (any nonzero
        length for a table of width 0), or a block id outside ``[0, num_blocks)`` among the first
        ``ceil(n / block_size)`` entries of a row (entries past those are garbage by contract and
        not checked); an array scale that is not finite and > 0; or any static check.
    """
    static_validate_decode(q, k_cache, v_cache, block_tables, context_lens, k_scale=k_scale,
                           v_scale=v_scale, **options)
    check_decode_values(k_cache, block_tables, context_lens, k_scale, v_scale)


def check_decode_values(k_cache, block_tables, context_lens, k_scale=None, v_scale=None) -> None:
    """The value checks of `validate_decode_inputs`, after its static checks."""
    _check_scale_values(k_scale, v_scale)
    num_blocks, block_size = _shape(k_cache)[:2]
    lens = np.asarray(context_lens).astype(np.int64)
    tables = np.asarray(block_tables).astype(np.int64)
    if (lens < 0).any():
        (b,) = _first(lens < 0)
        raise ValueError(f"context_lens[{b}]={lens[b]} must be >= 0")
    capacity = tables.shape[1] * block_size
    if (lens > capacity).any():
        (b,) = _first(lens > capacity)
        raise ValueError(
            f"context_lens[{b}]={lens[b]} exceeds the table's capacity max_blocks * block_size ="
            f" {tables.shape[1]} * {block_size} = {capacity}")
    used = np.arange(tables.shape[1])[None, :] < -(-lens // block_size)[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, i = _first(bad)
        raise ValueError(
            f"block_tables[{b}, {i}]={tables[b, i]} is outside [0, num_blocks) = [0, {num_blocks})"
            f" in the valid part of row {b} (context_lens[{b}]={lens[b]})")


# --- ragged paged attention (`paged_attention`) ---------------------------------------------------
# Under jit (values unchecked), by construction of both implementations: lengths are clamped as in
# decode; ``query_start_loc`` entries are clamped into ``[0, num_tokens]``; a query whose position
# ``n - q_len_b + i`` is negative (``q_len_b > context_lens[b]``) sees no position and gives zeros
# (lse -inf). A decreasing ``query_start_loc`` gives unspecified rows, every read and write still
# inside its array.


def _per_sequence_query(q, batch: int):
    """A stand-in for ``q`` with one row per sequence, for the decode checks (shape/dtype only)."""
    return jax.ShapeDtypeStruct((batch, *_shape(q)[1:]), _dtype(q))


def static_validate_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                              k_scale=None, v_scale=None, **options) -> None:
    """Trace-time checks of `paged_attention`'s arguments: every decode check (``batch`` taken from
    ``block_tables``), then ``query_start_loc``'s rank, length and dtype."""
    static_validate_caches(k_cache, v_cache)
    _check_rank("q", q, 3)
    _check_rank("block_tables", block_tables, 2)
    _check_rank("query_start_loc", query_start_loc, 1)
    static_validate_query(q, k_cache)  # first, so that errors about q name its real shape
    batch = _shape(block_tables)[0]
    static_validate_decode(_per_sequence_query(q, batch), k_cache, v_cache, block_tables,
                           context_lens, k_scale=k_scale, v_scale=v_scale, **options)
    if _shape(query_start_loc) != (batch + 1,):
        raise ValueError(
            f"{query_start_loc.shape=} must be [batch + 1] = ({batch + 1},) ({block_tables.shape=})")
    _check_int("query_start_loc", query_start_loc)


def validate_attention_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, *,
                              k_scale=None, v_scale=None, **options) -> None:
    """Eager checks of `paged_attention`'s arguments: the static checks, the decode value checks,
    then ``query_start_loc``'s values.

    Raises:
      ValueError: everything `validate_decode_inputs` refuses; ``query_start_loc[0] != 0``, a
        decreasing ``query_start_loc``, ``query_start_loc[batch] > num_tokens``, or a sequence with
        more new tokens than cached ones (``q_len_b > context_lens[b]``); or any static check.
    """
    static_validate_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                              k_scale=k_scale, v_scale=v_scale, **options)
    check_attention_values(q, k_cache, block_tables, context_lens, query_start_loc, k_scale,
                           v_scale)


def check_attention_values(q, k_cache, block_tables, context_lens, query_start_loc,
                           k_scale=None, v_scale=None) -> None:
    """The value checks of `validate_attention_inputs`, after its static checks."""
    check_decode_values(k_cache, block_tables, context_lens, k_scale, v_scale)
    batch = _shape(block_tables)[0]
    starts = np.asarray(query_start_loc).astype(np.int64)
    if starts[0] != 0:
        raise ValueError(f"query_start_loc[0]={starts[0]} must be 0")
    q_lens = np.diff(starts)
    if (q_lens < 0).any():
        (b,) = _first(q_lens < 0)
        raise ValueError(
            f"query_start_loc must be non-decreasing, got query_start_loc[{b}]={starts[b]} >"
            f" query_start_loc[{b + 1}]={starts[b + 1]}")
    num_tokens = _shape(q)[0]
    if starts[batch] > num_tokens:
        raise ValueError(
            f"query_start_loc[{batch}]={starts[batch]} exceeds num_tokens = q.shape[0] ="
            f" {num_tokens} ({q.shape=})")
    lens = np.asarray(context_lens).astype(np.int64)
    if (q_lens > lens).any():
        (b,) = _first(q_lens > lens)
        raise ValueError(
            f"q_len of sequence {b} = query_start_loc[{b + 1}] - query_start_loc[{b}] ="
            f" {q_lens[b]} exceeds context_lens[{b}]={lens[b]}: the new tokens are part of the"
            " context (they are written before attention)")

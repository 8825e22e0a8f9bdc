"""The named shapes of every benchmarked operation, and their inputs.

- Decode (`DecodeBenchShape`): `DECODE_SHAPES` (bf16, 32 query heads, 8 kv heads, head_dim 128,
  block size 16 unless the name says otherwise: docs/PERFORMANCE.md, "Shape names") and the tiny
  `DECODE_SMOKE` for CPU runs; `make_decode_inputs`.
- Ragged (`RaggedBenchShape`): `RAGGED_SHAPES`, `RAGGED_SMOKE`; `make_ragged_inputs`.
- Write (`WriteBenchShape`): `WRITE_SHAPE`, `WRITE_SMOKE`; `write_rows`, `write_slots`.
- Sharded (`ShardedProblem`): `SHARDED`, `SHARDED_SMOKE`.

Block tables come from `parity.layout.paged_layout` (a random permutation of physical blocks, about
1% spare); the queries and caches are random normal (never zeros: zeros time differently and hide
indexing bugs), drawn on the device with ``jax.random`` so that a multi-gigabyte cache never
crosses the host link. ``copies`` > 1 builds several problems in one cache, each with its own
queries and its own physical blocks, for timing that rotates among them (no call then reads what
the call before left in the L2).

Example (the index arithmetic of one copy)::

    inputs = make_decode_inputs(shape_by_name("b32_ctx4096"), seed=0)
    q, k_cache, v_cache, tables, lens = inputs.args(0)
    # sequence b, position p lives at k_cache[tables[b, p // block_size], p % block_size]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from parity.layout import paged_layout
from parity.oracle import oracle_paged_attention

FP8 = "float8_e4m3fn"
CACHE_DTYPES = ("float32", "bfloat16", "float16", FP8)
# fp8 caches store 16 * N(0, 1) (well inside +-448) and dequantize with k_scale = v_scale = 1/16,
# so the values attention sees are N(0, 1) like every other dtype's (1/16 is exact in fp32).
FP8_STORE_SCALE = 16.0
L2_BYTES = 60e6               # the L2 of an H200 (an H100's is 50 MB)
ROTATE_BYTES = 4 * L2_BYTES   # below this much touched per call, rotate among input copies
MAX_COPIES = 8
REF_ROWS = 8                  # decode: sequences compared with the float64 oracle
REF_SEQUENCES = 4             # ragged: sequences whose first, middle and last query are compared


def query_dtype_for(cache_dtype: str) -> str:
    """The queries' dtype over a cache of ``cache_dtype``: the same, bf16 over fp8."""
    return "bfloat16" if cache_dtype == FP8 else cache_dtype


def fp8_scales_for(cache_dtype: str) -> dict:
    """``{"k_scale", "v_scale"}`` for an fp8 cache (``1 / FP8_STORE_SCALE``), else ``{}``."""
    return dict(k_scale=1 / FP8_STORE_SCALE, v_scale=1 / FP8_STORE_SCALE) if cache_dtype == FP8 \
        else {}


def rotation_copies(touched_bytes: float, max_copies: int = MAX_COPIES) -> int:
    """Copies of the inputs so that one pass over them touches `ROTATE_BYTES`."""
    return int(max(1, min(max_copies, math.ceil(ROTATE_BYTES / max(touched_bytes, 1)))))


# ----------------------------------------------------------------------------------------------
# Decode


@dataclasses.dataclass(frozen=True)
class DecodeBenchShape:
    """One paged-decode problem.

    Attributes:
      name: unique, used on the command line and as the key in reports.
      batch, num_heads, num_kv_heads, head_dim, block_size: as in SPEC.md.
      context: every sequence's length; with ``ragged``, the longest.
      ragged: lengths drawn uniformly from ``1..context`` instead of all ``context``.
      dtype: the cache's dtype; the queries' too, except over fp8 caches (bf16 then).
      sliding_window: ``decode(..., sliding_window=W)``; None for full attention.
    """

    name: str
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context: int
    ragged: bool = False
    dtype: str = "bfloat16"
    sliding_window: int | None = None

    def __post_init__(self):
        for field in ("batch", "num_heads", "num_kv_heads", "head_dim", "block_size", "context"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {field}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads={self.num_heads} must be a multiple of"
                             f" num_kv_heads={self.num_kv_heads}")
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(f"{self.name}: dtype={self.dtype!r} must be one of {CACHE_DTYPES}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding_window={self.sliding_window} must be >= 1")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def query_dtype(self) -> str:
        return query_dtype_for(self.dtype)

    @property
    def scales(self) -> dict:
        return fp8_scales_for(self.dtype)

    @property
    def max_blocks(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V of one token (all kv heads)."""
        return 2 * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    def expected_kv_bytes(self) -> float:
        """K/V bytes one call reads, on average over the draws of the lengths."""
        mean = (self.context + 1) / 2 if self.ragged else self.context
        return self.batch * min(mean, self.sliding_window or mean) * self.kv_bytes_per_token

    def tokens_read(self, context_lens) -> int:
        """K/V rows decode must read: ``sum_b min(n_b, W)``."""
        lens = np.asarray(context_lens, np.int64)
        if self.sliding_window is not None:
            lens = np.minimum(lens, self.sliding_window)
        return int(lens.sum())

    def abstract_args(self) -> tuple:
        """``(q, k_cache, block_tables)`` as `jax.ShapeDtypeStruct` s (one cache block): what the
        kernel choice and the configs read, without building inputs."""
        return (jax.ShapeDtypeStruct((self.batch, self.num_heads, self.head_dim),
                                     self.query_dtype),
                jax.ShapeDtypeStruct((1, self.block_size, self.num_kv_heads, self.head_dim),
                                     self.dtype),
                jax.ShapeDtypeStruct((self.batch, self.max_blocks), jnp.int32))

    def describe(self) -> str:
        return (f"B={self.batch} H={self.num_heads} KVH={self.num_kv_heads} D={self.head_dim}"
                f" bs={self.block_size} ctx={'1..' if self.ragged else ''}{self.context}"
                f" {self.dtype}" + (f" window={self.sliding_window}" if self.sliding_window
                                    else ""))


def _decode(name, batch, context, *, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
            **kwargs) -> DecodeBenchShape:
    return DecodeBenchShape(name, batch, num_heads, num_kv_heads, head_dim, block_size, context,
                            **kwargs)


DECODE_SHAPES: tuple[DecodeBenchShape, ...] = (
    _decode("b32_ctx4096", 32, 4096),
    _decode("b64_ctx2048", 64, 2048),
    _decode("b8_ctx16384", 8, 16384),
    _decode("b128_ctx1024", 128, 1024),
    _decode("b1_ctx32768", 1, 32768),
    _decode("b256_ctx512", 256, 512),
    _decode("mha_b32_ctx4096", 32, 4096, num_kv_heads=32),
    _decode("bs64_b32_ctx4096", 32, 4096, block_size=64),
    _decode("b4_ctx131072", 4, 131072),
    _decode("ragged_b64_ctx8192", 64, 8192, ragged=True),
    _decode("fp16_b32_ctx4096", 32, 4096, dtype="float16"),
    _decode("d64_b32_ctx4096", 32, 4096, head_dim=64),
    _decode("d256_b32_ctx4096", 32, 4096, head_dim=256),
    _decode("fp8_b32_ctx4096", 32, 4096, dtype=FP8),
    _decode("fp8_b8_ctx16384", 8, 16384, dtype=FP8),
    # reads 1024 of 32768 tokens per sequence: about the cost of its baseline b8_ctx1024
    _decode("swa1024_b8_ctx32768", 8, 32768, sliding_window=1024),
    _decode("b8_ctx1024", 8, 1024),
    # the uniform batch of ragged_b64_ctx8192's shape class (one tuned entry serves both)
    _decode("b64_ctx8192", 64, 8192),
)

# Tiny versions for CPU runs (interpret mode): head_dim 64 and block size 16, which the Mosaic
# kernel takes too.
_SMOKE = dict(num_heads=8, num_kv_heads=2, head_dim=64)
DECODE_SMOKE: tuple[DecodeBenchShape, ...] = (
    _decode("smoke_b2_ctx64", 2, 64, **_SMOKE),
    _decode("smoke_fp8_b2_ctx64", 2, 64, dtype=FP8, **_SMOKE),
    _decode("smoke_ragged_b4_ctx96", 4, 96, ragged=True, **_SMOKE),
    _decode("smoke_mha_b2_ctx64", 2, 64, num_heads=4, num_kv_heads=4, head_dim=64),
    _decode("smoke_swa16_b2_ctx128", 2, 128, sliding_window=16, **_SMOKE),
)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key, *, shape, dtype, scale=1.0):
    """``scale * N(0, 1)`` of ``shape`` in ``dtype``, drawn on the device (fp8 through bf16)."""
    draw_dtype = jnp.bfloat16 if dtype == FP8 else jnp.dtype(dtype)
    x = jax.random.normal(key, shape, draw_dtype)
    return (x * jnp.asarray(scale, draw_dtype) if scale != 1.0 else x).astype(jnp.dtype(dtype))


# Largest single device-side draw, in elements: bigger arrays are drawn in chunks along their first
# axis (the generator's temporaries stay bounded) and concatenated.
DRAW_CHUNK_ELEMENTS = 2**28


def random_normal(key, shape: tuple, dtype: str, *, scale: float = 1.0):
    """``scale * N(0, 1)`` of ``shape`` in ``dtype``, drawn on the default device."""
    shape = tuple(int(d) for d in shape)
    rows_per_chunk = max(1, DRAW_CHUNK_ELEMENTS // max(math.prod(shape[1:]), 1))
    if not shape or shape[0] <= rows_per_chunk:
        return _normal(key, shape=shape, dtype=dtype, scale=float(scale))
    parts = [_normal(jax.random.fold_in(key, i), shape=(min(rows_per_chunk, shape[0] - start),)
                     + shape[1:], dtype=dtype, scale=float(scale))
             for i, start in enumerate(range(0, shape[0], rows_per_chunk))]
    out = jnp.concatenate(parts)
    for part in parts:
        part.delete()
    return out


def _tables_and_caches(rng, lens, copies: int, *, table_width, block_size, num_kv_heads,
                       head_dim, dtype, num_queries, num_heads):
    """The pieces every attention shape's inputs share: ``copies`` problems of lengths ``lens``
    laid out by `paged_layout` in one cache (each copy its own blocks; table tails hold block 0,
    a real one, since JAX's shipped paged_attention reads whole groups of table entries), queries
    ``[copies, num_queries, num_heads, head_dim]`` and the caches, drawn on the device."""
    lens = np.asarray(lens, np.int64)
    used = copies * int((-(-lens // block_size)).sum())
    layout = paged_layout(rng, np.tile(lens, copies), block_size=block_size,
                          table_width=table_width, spare_blocks=max(1, used // 100), tail=(0,))
    tables = layout.block_tables.reshape(copies, len(lens), table_width)  # i32[copies, B, width]
    keys = jax.random.split(jax.random.key(int(rng.integers(0, 2**31 - 1))), 3)
    cache_shape = (layout.num_blocks, block_size, num_kv_heads, head_dim)
    store_scale = FP8_STORE_SCALE if dtype == FP8 else 1.0
    q = random_normal(keys[0], (copies, num_queries, num_heads, head_dim), query_dtype_for(dtype))
    k_cache = random_normal(keys[1], cache_shape, dtype, scale=store_scale)
    v_cache = random_normal(keys[2], cache_shape, dtype, scale=store_scale)
    return q, k_cache, v_cache, tables


@dataclasses.dataclass
class AttentionInputs:
    """The inputs of one decode or ragged shape: ``copies`` problems sharing one physical cache,
    the same lengths in every copy (so every copy is the same work).

    Attributes:
      q: ``[copies, num_queries, num_heads, head_dim]`` (decode: ``num_queries = batch``).
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
      block_tables: ``i32[copies, batch, max_blocks]``; ``block_tables_np`` the same in numpy.
      context_lens: ``i32[batch]``; ``context_lens_np`` the same in numpy.
      query_start_loc: ragged only, ``i32[batch + 1]``; ``query_start_loc_np`` in numpy.
      scales: ``{"k_scale", "v_scale"}`` of an fp8 cache, else ``{}``.
    """

    shape: object
    copies: int
    q: object
    k_cache: object
    v_cache: object
    block_tables: object
    context_lens: object
    block_tables_np: np.ndarray
    context_lens_np: np.ndarray
    scales: dict
    query_start_loc: object = None
    query_start_loc_np: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.k_cache.shape[0])

    def args(self, copy: int = 0) -> tuple:
        """``(q, k_cache, v_cache, block_tables, context_lens[, query_start_loc])`` of one copy:
        `decode`'s (`paged_attention`'s) positional arguments."""
        ragged = () if self.query_start_loc is None else (self.query_start_loc,)
        return (self.q[copy], self.k_cache, self.v_cache, self.block_tables[copy],
                self.context_lens) + ragged

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, values)``: query rows of the last copy (the one a loop's last call reads) and
        the float64 oracle's output there (float32 ``[len(rows), num_heads, head_dim]``). Decode:
        the first `REF_ROWS` sequences. Ragged: the first, middle and last query of
        `REF_SEQUENCES` sequences spread over the batch, each as a decode of that query over its
        visible prefix (``context_len = p + 1``). The oracle fetches only the rows it reads."""
        copy = self.copies - 1
        window = getattr(self.shape, "sliding_window", None)
        if self.query_start_loc_np is None:
            rows = np.arange(min(REF_ROWS, len(self.context_lens_np)))
            seqs, lens = rows, self.context_lens_np[rows]
        else:
            rows, seqs, lens = [], [], []
            starts, q_lens = self.query_start_loc_np, np.diff(self.query_start_loc_np)
            candidates = np.flatnonzero(q_lens > 0)
            picked = candidates[np.linspace(0, len(candidates) - 1,
                                            min(REF_SEQUENCES, len(candidates))).astype(int)]
            for b in np.unique(picked):
                n, q_len = int(self.context_lens_np[b]), int(q_lens[b])
                for i in sorted({0, q_len // 2, q_len - 1}):
                    rows.append(starts[b] + i)
                    seqs.append(b)
                    lens.append(n - q_len + i + 1)
            rows, seqs, lens = np.array(rows), np.array(seqs), np.array(lens)
        out, _ = oracle_paged_attention(
            np.asarray(self.q[copy][jnp.asarray(rows)]), self.k_cache, self.v_cache,
            self.block_tables_np[copy][seqs], lens, sliding_window=window, **self.scales)
        return rows, out.astype(np.float32)

    def delete(self) -> None:
        for x in (self.q, self.k_cache, self.v_cache):
            if not x.is_deleted():
                x.delete()


def decode_lens(shape: DecodeBenchShape, rng: np.random.Generator) -> np.ndarray:
    """``i32[batch]``: ``context`` for every sequence, or uniform in ``1..context`` if ragged."""
    if shape.ragged:
        return rng.integers(1, shape.context + 1, size=shape.batch).astype(np.int32)
    return np.full(shape.batch, shape.context, np.int32)


def make_decode_inputs(shape: DecodeBenchShape, seed: int, copies: int = 1) -> AttentionInputs:
    """The inputs of ``shape`` (`AttentionInputs`), every draw from
    ``np.random.default_rng(seed)``: the lengths, the layout and the key of the device draws.
    fp8 caches hold ``16 * N(0, 1)`` with scales 1/16."""
    rng = np.random.default_rng(seed)
    lens = decode_lens(shape, rng)
    q, k_cache, v_cache, tables = _tables_and_caches(
        rng, lens, copies, table_width=shape.max_blocks, block_size=shape.block_size,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=shape.dtype,
        num_queries=shape.batch, num_heads=shape.num_heads)
    return AttentionInputs(shape, copies, q, k_cache, v_cache, jnp.asarray(tables),
                           jnp.asarray(lens), tables, lens, shape.scales)


# ----------------------------------------------------------------------------------------------
# Ragged


@dataclasses.dataclass(frozen=True)
class RaggedBenchShape:
    """One ragged problem: ``seqs`` is a tuple of ``(count, q_len, context_len)`` groups, in batch
    order; each sequence's ``q_len`` newest tokens are its queries."""

    name: str
    seqs: tuple
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def query_dtype(self) -> str:
        return query_dtype_for(self.dtype)

    @property
    def scales(self) -> dict:
        return fp8_scales_for(self.dtype)

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_lens i64[batch], context_lens i64[batch])``."""
        q_lens = [q for count, q, _ in self.seqs for _ in range(count)]
        lens = [n for count, _, n in self.seqs for _ in range(count)]
        return np.array(q_lens, np.int64), np.array(lens, np.int64)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence: `decode` takes the same inputs."""
        return bool((self.lengths()[0] == 1).all())

    def work(self) -> dict:
        """``pairs``: attended (query, key) pairs; ``flops``: causal, ``4 * D * H * pairs``;
        ``bytes``: every K/V row read once, q read and the output written."""
        q_lens, lens = self.lengths()
        # query i of a sequence sits at p = n - q_len + i and attends p + 1 positions
        pairs = int(sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(q_lens, lens)))
        kv = int(lens.sum()) * 2 * self.num_kv_heads * self.head_dim * jnp.dtype(
            self.dtype).itemsize
        q_out = int(q_lens.sum()) * self.num_heads * self.head_dim * 2 * jnp.dtype(
            self.query_dtype).itemsize
        return {"pairs": pairs, "flops": 4.0 * self.head_dim * self.num_heads * pairs,
                "bytes": float(kv + q_out)}

    def abstract_args(self) -> tuple:
        """``(q, k_cache, block_tables, context_lens, query_start_loc)`` as
        `jax.ShapeDtypeStruct` s, one cache block per page the sequences hold."""
        q_lens, lens = self.lengths()
        pages = -(-lens // self.block_size)
        i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731
        return (jax.ShapeDtypeStruct((int(q_lens.sum()), self.num_heads, self.head_dim),
                                     self.query_dtype),
                jax.ShapeDtypeStruct((int(pages.sum()), self.block_size, self.num_kv_heads,
                                      self.head_dim), self.dtype),
                i32(len(lens), int(pages.max())), i32(len(lens)), i32(len(lens) + 1))

    def describe(self) -> str:
        groups = " + ".join(f"{c} x ({q}, {n})" for c, q, n in self.seqs)
        return (f"{groups}; H={self.num_heads} KVH={self.num_kv_heads} D={self.head_dim}"
                f" bs={self.block_size} {self.dtype}")


def _ragged(name, *seqs, **kwargs) -> RaggedBenchShape:
    return RaggedBenchShape(name, tuple(seqs), **kwargs)


RAGGED_SHAPES: tuple[RaggedBenchShape, ...] = (
    _ragged("prefill_b4_q2048", (4, 2048, 2048)),
    _ragged("chunk_b1_q2048_ctx32768", (1, 2048, 32768)),
    _ragged("mixed_4x512c2560_60dec4096", (4, 512, 2560), (60, 1, 4096)),
    _ragged("spec_b32_q4_ctx4096", (32, 4, 4096)),
    _ragged("decode_b32_ctx4096", (32, 1, 4096)),
    _ragged("fp8_mixed_4x512c2560_60dec4096", (4, 512, 2560), (60, 1, 4096), dtype=FP8),
    _ragged("fp8_decode_b32_ctx4096", (32, 1, 4096), dtype=FP8),
    _ragged("d256_decode_b32_ctx4096", (32, 1, 4096), head_dim=256),
)
_TINY = dict(num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
RAGGED_SMOKE: tuple[RaggedBenchShape, ...] = (
    _ragged("smoke_prefill_b2_q24", (2, 24, 24), **_TINY),
    _ragged("smoke_chunk_b1_q16_ctx80", (1, 16, 80), **_TINY),
    _ragged("smoke_mixed_2x8c20_6dec30", (2, 8, 20), (6, 1, 30), **_TINY),
    _ragged("smoke_spec_b4_q4_ctx40", (4, 4, 40), **_TINY),
    _ragged("smoke_decode_b4_ctx40", (4, 1, 40), **_TINY),
    _ragged("smoke_fp8_mixed_2x8c20_6dec30", (2, 8, 20), (6, 1, 30), dtype=FP8, **_TINY),
)


def make_ragged_inputs(shape: RaggedBenchShape, seed: int, copies: int = 1) -> AttentionInputs:
    """The inputs of ``shape`` (`AttentionInputs` with ``query_start_loc``), as
    `make_decode_inputs` draws them."""
    rng = np.random.default_rng(seed)
    q_lens, lens = shape.lengths()
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)  # i32[batch + 1]
    q, k_cache, v_cache, tables = _tables_and_caches(
        rng, lens, copies, table_width=int((-(-lens // shape.block_size)).max()),
        block_size=shape.block_size, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        dtype=shape.dtype, num_queries=int(qsl[-1]), num_heads=shape.num_heads)
    lens = lens.astype(np.int32)
    return AttentionInputs(shape, copies, q, k_cache, v_cache, jnp.asarray(tables),
                           jnp.asarray(lens), tables, lens, shape.scales, jnp.asarray(qsl), qsl)


def shape_by_name(name: str):
    """The decode or ragged shape of that name (smoke shapes included)."""
    for shape in DECODE_SHAPES + DECODE_SMOKE + RAGGED_SHAPES + RAGGED_SMOKE:
        if shape.name == name:
            return shape
    raise ValueError(f"unknown shape {name!r}")


# ----------------------------------------------------------------------------------------------
# Write


@dataclasses.dataclass(frozen=True)
class WriteBenchShape:
    """One cache write: ``tokens`` rows into a cache of ``num_blocks`` blocks, at ``reps``
    disjoint sets of random slots (one per write of a timed call)."""

    name: str
    tokens: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    reps: int = 4

    @property
    def cache_shape(self) -> tuple:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def row_shape(self) -> tuple:
        return (self.tokens, self.num_kv_heads, self.head_dim)


WRITE_SHAPE = WriteBenchShape("write_t16384", tokens=16384, num_kv_heads=8, head_dim=128,
                              block_size=16, num_blocks=16384)
WRITE_SMOKE = WriteBenchShape("smoke_write_t64", tokens=64, num_kv_heads=2, head_dim=32,
                              block_size=4, num_blocks=128)


def write_rows(rng: np.random.Generator, shape: tuple, dtype, scale: float) -> np.ndarray:
    """N(0, 1) rows of ``dtype`` (numpy), a quarter of them replaced by ``tie * scale`` for every
    rounding tie of float8_e4m3fn (both signs: the midpoints of neighbouring fp8 values) and by
    NaN, +-inf and +-1e4 (past fp8's +-448)."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    finite = np.unique(codes[np.isfinite(codes)])
    ties = (finite[1:] + finite[:-1]) / 2 * np.float64(np.float32(scale))
    pool = np.concatenate([ties, [np.nan, np.inf, -np.inf, 1e4, -1e4]]).astype(np.float32)
    rows = rng.standard_normal(shape, dtype=np.float32)
    chosen = rng.random(shape) < 0.25
    rows[chosen] = rng.choice(pool, int(chosen.sum()))
    return rows.astype(dtype)


def write_slots(rng: np.random.Generator, shape: WriteBenchShape) -> np.ndarray:
    """``i32[reps, tokens]``: ``reps`` disjoint sets of slots from a random permutation of all."""
    slots = rng.permutation(shape.num_blocks * shape.block_size)[:shape.reps * shape.tokens]
    return slots.reshape(shape.reps, shape.tokens).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Sharded


@dataclasses.dataclass(frozen=True)
class ShardedProblem:
    """A decode problem for `shard_decode`: every sequence at full length."""

    batch: int = 64
    context: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one decode step reads."""
        return (2 * self.batch * self.context * self.num_kv_heads * self.head_dim
                * jnp.dtype(self.dtype).itemsize)

    def pool_tables(self, rng: np.random.Generator, pools: int) -> np.ndarray:
        """``i32[batch, blocks_per_seq]``: ``pools`` equal slices of the batch, each laid out
        (`paged_layout`) in a pool of its own blocks, with ids local to the pool."""
        rows = self.batch // pools
        return np.concatenate([
            paged_layout(rng, [self.context] * rows, block_size=self.block_size).block_tables
            for _ in range(pools)])


SHARDED = ShardedProblem()
SHARDED_SMOKE = ShardedProblem(batch=4, context=40, num_heads=4, num_kv_heads=2, head_dim=16)


@jax.jit
def fuse_caches(k_cache, v_cache):
    """``[blocks, bs, KVH, D]`` x 2 -> the fused cache ``[blocks, bs, 2 * KVH, D]`` (K of kv head
    h at 2h, V at 2h + 1)."""
    nb, bs, kvh, d = k_cache.shape
    return jnp.stack([k_cache, v_cache], axis=3).reshape(nb, bs, 2 * kvh, d)

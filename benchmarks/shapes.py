"""Named realistic decode shapes, shared by the tests and the benchmark, and their inputs.

- `DecodeBenchShape`: one decode problem, frozen and hashable (batch, heads, head_dim, block size,
  context, ragged or uniform lengths, cache dtype, optional sliding window).
- `BENCH_SHAPES`: the thirteen shapes the benchmark reports (bf16, D=128, H=32, KVH=8,
  block_size=16 unless the name says otherwise). `EXTENSION_SHAPES`: fp8 caches, a sliding
  window with its baseline, and the uniform batch of the ragged shape's class. `ALL_SHAPES` is
  both. `SMALL_SHAPES`: tiny versions of the features, for CPU smoke runs and tests.
- `make_decode_inputs`: the inputs of one shape (optionally several copies sharing one cache), from
  one ``np.random.default_rng(seed)``: block tables are a numpy permutation of physical blocks, q
  and the caches random normal (never zeros: zeros time differently and hide indexing bugs),
  drawn on the device with ``jax.random`` so that a multi-gigabyte cache never crosses the host
  link.

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
import numpy as np

__all__ = [
    "DecodeBenchShape",
    "DecodeInputs",
    "BENCH_SHAPES",
    "EXTENSION_SHAPES",
    "ALL_SHAPES",
    "SMALL_SHAPES",
    "FP8_STORE_SCALE",
    "query_dtype_for",
    "store_scale_for",
    "fp8_scales_for",
    "shape_by_name",
    "make_decode_inputs",
]

CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
FP8 = "float8_e4m3fn"
# fp8 caches store 16 * N(0, 1) (well inside +-448) and dequantize with k_scale = v_scale = 1/16,
# so the values attention sees are N(0, 1) like every other dtype's (1/16 is exact in fp32).
FP8_STORE_SCALE = 16.0


def query_dtype_for(cache_dtype: str) -> str:
    """The queries' dtype over a cache of ``cache_dtype``: the same, bf16 over fp8."""
    return "bfloat16" if cache_dtype == FP8 else cache_dtype


def store_scale_for(cache_dtype: str) -> float:
    """The factor the random cache values are drawn with: ``FP8_STORE_SCALE`` for fp8, else 1."""
    return FP8_STORE_SCALE if cache_dtype == FP8 else 1.0


def fp8_scales_for(cache_dtype: str) -> tuple[float | None, float | None]:
    """``(k_scale, v_scale)`` for `decode` / `write_kv`: ``1 / FP8_STORE_SCALE`` for fp8."""
    return (1.0 / FP8_STORE_SCALE,) * 2 if cache_dtype == FP8 else (None, None)


@dataclasses.dataclass(frozen=True)
class DecodeBenchShape:
    """One paged-decode problem.

    Attributes:
      name: unique, used on the command line and as the key in reports.
      batch, num_heads, num_kv_heads, head_dim, block_size: as in SPEC.md.
      context: the context length of every sequence; with ``ragged``, the maximum.
      ragged: lengths drawn uniformly from ``1..context`` instead of all equal to ``context``.
      dtype: the cache dtype name; q (and k/v rows for writes) use it too, except for fp8 caches,
        whose queries are bfloat16.
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
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def scales(self) -> tuple[float | None, float | None]:
        """``(k_scale, v_scale)`` for `decode` / `write_kv` (`fp8_scales_for`)."""
        return fp8_scales_for(self.dtype)

    @property
    def max_blocks(self) -> int:
        return -(-self.context // self.block_size)

    @property
    def capacity(self) -> int:
        """Tokens a table row can hold: ``max_blocks * block_size``."""
        return self.max_blocks * self.block_size

    @property
    def cache_itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V of one token (all kv heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.cache_itemsize

    def tokens_read(self, context_lens) -> int:
        """K/V rows decode must read: ``sum_b min(n_b, W)``."""
        lens = np.asarray(context_lens, np.int64)
        if self.sliding_window is not None:
            lens = np.minimum(lens, self.sliding_window)
        return int(lens.sum())

    def expected_tokens_read(self) -> float:
        mean = (self.context + 1) / 2 if self.ragged else self.context
        if self.sliding_window is not None:
            mean = min(mean, self.sliding_window)
        return self.batch * mean

    def describe(self) -> str:
        parts = [f"B={self.batch}", f"H={self.num_heads}", f"KVH={self.num_kv_heads}",
                 f"D={self.head_dim}", f"bs={self.block_size}",
                 f"ctx={'1..' if self.ragged else ''}{self.context}", self.dtype]
        if self.sliding_window is not None:
            parts.append(f"window={self.sliding_window}")
        return " ".join(parts)


def _shape(name, batch, context, *, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
           ragged=False, dtype="bfloat16", sliding_window=None) -> DecodeBenchShape:
    return DecodeBenchShape(name, batch, num_heads, num_kv_heads, head_dim, block_size, context,
                            ragged, dtype, sliding_window)


# bf16, D=128, H=32, KVH=8 (GQA group 4), block_size=16 unless the name says otherwise.
BENCH_SHAPES: tuple[DecodeBenchShape, ...] = (
    _shape("b32_ctx4096", 32, 4096),
    _shape("b64_ctx2048", 64, 2048),
    _shape("b8_ctx16384", 8, 16384),
    _shape("b128_ctx1024", 128, 1024),
    _shape("b1_ctx32768", 1, 32768),
    _shape("b256_ctx512", 256, 512),
    _shape("mha_b32_ctx4096", 32, 4096, num_kv_heads=32),
    _shape("bs64_b32_ctx4096", 32, 4096, block_size=64),
    _shape("b4_ctx131072", 4, 131072),
    _shape("ragged_b64_ctx8192", 64, 8192, ragged=True),
    _shape("fp16_b32_ctx4096", 32, 4096, dtype="float16"),
    _shape("d64_b32_ctx4096", 32, 4096, head_dim=64),
    _shape("d256_b32_ctx4096", 32, 4096, head_dim=256),
)

# For the fp8-cache and sliding-window work: the window shape reads 1024 of 32768 tokens per
# sequence, so it should cost about what its full-attention baseline b8_ctx1024 costs. b64_ctx8192
# is the uniform batch of ragged_b64_ctx8192's shape class (the same key in the tuned tables, which
# pick one config and one kernel per class): a class's entry needs both measured.
EXTENSION_SHAPES: tuple[DecodeBenchShape, ...] = (
    _shape("fp8_b32_ctx4096", 32, 4096, dtype=FP8),
    _shape("fp8_b8_ctx16384", 8, 16384, dtype=FP8),
    _shape("swa1024_b8_ctx32768", 8, 32768, sliding_window=1024),
    _shape("b8_ctx1024", 8, 1024),
    _shape("b64_ctx8192", 64, 8192),
)

ALL_SHAPES: tuple[DecodeBenchShape, ...] = BENCH_SHAPES + EXTENSION_SHAPES

# Tiny versions (interpret mode on a CPU runs them in seconds): the same features, small numbers.
SMALL_SHAPES: tuple[DecodeBenchShape, ...] = (
    _shape("small_b2_ctx64", 2, 64, num_heads=8, num_kv_heads=2, head_dim=32),
    _shape("small_ragged_b4_ctx96", 4, 96, num_heads=8, num_kv_heads=2, head_dim=32, ragged=True),
    _shape("small_mha_b2_ctx64", 2, 64, num_heads=4, num_kv_heads=4, head_dim=32),
    _shape("small_bs8_b2_ctx64", 2, 64, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8),
    _shape("small_fp16_b2_ctx64", 2, 64, num_heads=8, num_kv_heads=2, head_dim=32,
           dtype="float16"),
    _shape("small_fp8_b2_ctx64", 2, 64, num_heads=8, num_kv_heads=2, head_dim=32, dtype=FP8),
    _shape("small_swa16_b2_ctx128", 2, 128, num_heads=8, num_kv_heads=2, head_dim=32,
           sliding_window=16),
)

SHAPE_GROUPS = {"bench": BENCH_SHAPES, "ext": EXTENSION_SHAPES, "all": ALL_SHAPES,
                "small": SMALL_SHAPES}


def shape_by_name(name: str) -> DecodeBenchShape:
    for shape in ALL_SHAPES + SMALL_SHAPES:
        if shape.name == name:
            return shape
    known = ", ".join(s.name for s in ALL_SHAPES + SMALL_SHAPES)
    raise ValueError(f"unknown shape {name!r}; known: {known}")


@dataclasses.dataclass
class DecodeInputs:
    """The inputs of one shape: ``copies`` problems that share one physical cache.

    Every copy has its own queries and its own disjoint set of physical blocks (so a benchmark that
    rotates among copies never re-reads data that the previous call left in L2); the lengths are
    the same for every copy, so every copy is the same amount of work.

    Attributes:
      q: ``[copies, batch, num_heads, head_dim]`` in ``shape.query_dtype``.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``shape.dtype``.
      block_tables: ``i32[copies, batch, max_blocks]`` (tails past ``ceil(n / block_size)`` hold
        random valid block ids, so layouts that read whole page groups stay in bounds).
      context_lens: ``i32[batch]``.
      block_tables_np, context_lens_np: the same index arrays as numpy.
      k_scale, v_scale: the fp8 dequantization scales, else None.
    """

    shape: DecodeBenchShape
    copies: int
    q: object
    k_cache: object
    v_cache: object
    block_tables: object
    context_lens: object
    block_tables_np: np.ndarray
    context_lens_np: np.ndarray
    k_scale: float | None
    v_scale: float | None

    @property
    def num_blocks(self) -> int:
        return int(self.k_cache.shape[0])

    def args(self, copy: int = 0) -> tuple:
        """``(q, k_cache, v_cache, block_tables, context_lens)`` of one copy, `decode`'s order."""
        return (self.q[copy], self.k_cache, self.v_cache, self.block_tables[copy],
                self.context_lens)

    def tokens_read(self) -> int:
        return self.shape.tokens_read(self.context_lens_np)


def make_block_tables(shape: DecodeBenchShape, rng: np.random.Generator, copies: int = 1):
    """Lengths, block tables and the number of physical blocks, all numpy.

    Returns:
      ``(context_lens i32[batch], block_tables i32[copies, batch, max_blocks], num_blocks)``: each
      (copy, sequence) owns ``ceil(n / block_size)`` distinct physical blocks taken in random order
      from a permutation of all blocks; about 1% of the blocks (at least one) are spare.
    """
    if copies < 1:
        raise ValueError(f"copies={copies} must be >= 1")
    if shape.ragged:
        lens = rng.integers(1, shape.context + 1, size=shape.batch)
    else:
        lens = np.full(shape.batch, shape.context)
    lens = lens.astype(np.int32)
    blocks_per_seq = -(-lens.astype(np.int64) // shape.block_size)
    used_per_copy = int(blocks_per_seq.sum())
    needed = copies * used_per_copy
    num_blocks = needed + max(1, needed // 100)
    physical = rng.permutation(num_blocks)[:needed].astype(np.int32)
    tables = rng.integers(0, num_blocks, size=(copies, shape.batch, shape.max_blocks),
                          dtype=np.int32)
    used = np.arange(shape.max_blocks)[None, :] < blocks_per_seq[:, None]  # [batch, max_blocks]
    tables[:, used] = physical.reshape(copies, used_per_copy)
    return lens, tables, num_blocks


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _normal(key, *, shape, dtype, scale=1.0):
    """``scale * N(0, 1)`` of ``shape`` in ``dtype``, drawn on the device (fp8 through bf16)."""
    draw_dtype = jnp.bfloat16 if dtype == FP8 else jnp.dtype(dtype)
    x = jax.random.normal(key, shape, draw_dtype)
    if scale != 1.0:
        x = x * jnp.asarray(scale, draw_dtype)
    return x.astype(jnp.dtype(dtype))


# Largest single device-side draw, in elements: bigger arrays are drawn in chunks along their first
# axis (the generator's temporaries stay bounded) and concatenated.
DRAW_CHUNK_ELEMENTS = 2**28


def random_normal(key_or_rng, shape: tuple, dtype: str, *, scale: float = 1.0, backend="jax"):
    """``scale * N(0, 1)``: on the device (``backend="jax"``, a jax key) or numpy (a Generator)."""
    shape = tuple(int(d) for d in shape)
    if backend == "numpy":
        x = key_or_rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        return x.astype(jnp.dtype(dtype))
    per_row = math.prod(shape[1:])
    rows_per_chunk = max(1, DRAW_CHUNK_ELEMENTS // max(per_row, 1))
    if not shape or shape[0] <= rows_per_chunk:
        return _normal(key_or_rng, shape=shape, dtype=dtype, scale=float(scale))
    parts = []
    for i, start in enumerate(range(0, shape[0], rows_per_chunk)):
        rows = min(rows_per_chunk, shape[0] - start)
        parts.append(_normal(jax.random.fold_in(key_or_rng, i), shape=(rows,) + shape[1:],
                             dtype=dtype, scale=float(scale)))
    out = jnp.concatenate(parts)
    for part in parts:
        part.delete()
    return out


def make_decode_inputs(shape: DecodeBenchShape, seed: int, *, copies: int = 1,
                       backend: str = "jax") -> DecodeInputs:
    """Build the inputs of ``shape``: ``copies`` problems sharing one physical cache.

    Everything is drawn from ``np.random.default_rng(seed)``: the lengths, the block permutation and
    (``backend="jax"``) the key of the device-side draws of q and the caches.

    Args:
      shape: the problem.
      seed: the seed.
      copies: independent problems (own queries, own physical blocks) in one cache.
      backend: ``"jax"`` (device arrays; q and caches drawn with ``jax.random`` on the default
        device) or ``"numpy"`` (host arrays, for tests of small shapes).

    Returns:
      A `DecodeInputs`. For fp8 shapes the caches hold ``16 * N(0, 1)`` and the scales are 1/16.
    """
    if backend not in ("jax", "numpy"):
        raise ValueError(f"backend={backend!r} must be 'jax' or 'numpy'")
    rng = np.random.default_rng(seed)
    lens, tables, num_blocks = make_block_tables(shape, rng, copies)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    q_shape = (copies, shape.batch, shape.num_heads, shape.head_dim)
    store_scale = store_scale_for(shape.dtype)
    if backend == "numpy":
        sources = (rng, rng, rng)
    else:
        root = jax.random.key(int(rng.integers(0, 2**31 - 1)))
        sources = tuple(jax.random.split(root, 3))
    q = random_normal(sources[0], q_shape, shape.query_dtype, backend=backend)
    k_cache = random_normal(sources[1], cache_shape, shape.dtype, scale=store_scale,
                            backend=backend)
    v_cache = random_normal(sources[2], cache_shape, shape.dtype, scale=store_scale,
                            backend=backend)
    if backend == "jax":
        block_tables, context_lens = jnp.asarray(tables), jnp.asarray(lens)
    else:
        block_tables, context_lens = tables, lens
    k_scale, v_scale = shape.scales
    return DecodeInputs(shape=shape, copies=copies, q=q, k_cache=k_cache, v_cache=v_cache,
                        block_tables=block_tables, context_lens=context_lens,
                        block_tables_np=tables, context_lens_np=lens, k_scale=k_scale,
                        v_scale=v_scale)


def rotation_copies(shape: DecodeBenchShape, *, min_bytes: float, max_copies: int = 8) -> int:
    """Copies needed so that one pass over all copies touches ``min_bytes`` of K/V."""
    touched = shape.expected_tokens_read() * shape.kv_bytes_per_token
    return int(max(1, min(max_copies, math.ceil(min_bytes / max(touched, 1)))))

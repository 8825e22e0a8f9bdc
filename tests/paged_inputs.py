"""Small paged-cache inputs for the tests, drawn from one numpy generator.

Physical blocks are a random permutation with spare blocks; every cache slot that is not a valid
token of the batch holds ``fill`` (NaN by default); table tails hold garbage ids.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from parity import convert

NP_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}


@dataclasses.dataclass
class Paged:
    """numpy arrays of one decode problem (caches already hold every valid token)."""

    q: np.ndarray             # [B, H, D]
    k_cache: np.ndarray       # [num_blocks, bs, KVH, D]
    v_cache: np.ndarray       # [num_blocks, bs, KVH, D]
    block_tables: np.ndarray  # i32[B, max_blocks]
    context_lens: np.ndarray  # i32[B]
    valid_slots: np.ndarray   # bool[num_blocks * bs], the slots holding a valid token

    def jax(self, **overrides):
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays.update(overrides)
        return [jnp.asarray(arrays[n]) for n in
                ("q", "k_cache", "v_cache", "block_tables", "context_lens")]

    def torch(self, **overrides):
        arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        arrays.update(overrides)
        return [to_torch(arrays[n]) for n in
                ("q", "k_cache", "v_cache", "block_tables", "context_lens")]


def to_torch(x: np.ndarray) -> torch.Tensor:
    """Bit-exact numpy -> torch on the CPU (bf16 and fp8 through their raw bits)."""
    return convert.to_torch(np.asarray(x), "cpu")


def to_numpy(x) -> np.ndarray:
    """torch or jax array -> numpy, bit-exact."""
    return convert.from_torch(x) if isinstance(x, torch.Tensor) else np.asarray(x)


def bits(x) -> np.ndarray:
    """The raw bits of an array, so that NaN == NaN in comparisons."""
    return convert.bits(to_numpy(x))


def make_paged(rng: np.random.Generator, *, lens, num_heads=4, num_kv_heads=2, head_dim=32,
               block_size=4, spare_blocks=3, max_blocks=None, dtype="float32", q_dtype=None,
               fill=np.nan, tail=(99999, -7)) -> Paged:
    """A batch with context lengths ``lens`` over a shuffled paged cache.

    Every slot that is not a valid token holds ``fill``; each table row's unused tail alternates
    between the ids in ``tail``.
    """
    lens = np.asarray(lens, np.int32)
    pages = -(-lens // block_size)
    max_blocks = max(1, int(pages.max(initial=0))) if max_blocks is None else max_blocks
    num_blocks = int(pages.sum()) + spare_blocks
    physical = rng.permutation(num_blocks).astype(np.int32)
    tables = np.empty((len(lens), max_blocks), np.int32)
    for i in range(max_blocks):
        tables[:, i] = tail[i % len(tail)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    values = rng.standard_normal((2, *shape)).astype(np.float32)
    valid = np.zeros(num_blocks * block_size, bool)
    start = 0
    for b, (n, p) in enumerate(zip(lens, pages)):
        tables[b, :p] = physical[start:start + p]
        start += p
        for pos in range(n):
            valid[tables[b, pos // block_size] * block_size + pos % block_size] = True
    flat = values.reshape(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[:, ~valid] = fill
    cache_dtype = NP_DTYPES[dtype]
    q_dtype = NP_DTYPES[q_dtype or ("bfloat16" if dtype == "float8_e4m3fn" else dtype)]
    q = rng.standard_normal((len(lens), num_heads, head_dim)).astype(q_dtype)
    return Paged(q=q, k_cache=flat[0].reshape(shape).astype(cache_dtype),
                 v_cache=flat[1].reshape(shape).astype(cache_dtype), block_tables=tables,
                 context_lens=lens, valid_slots=valid)


# StableHLO ops that cost no launch of their own on a GPU: views of an operand, scalars, the kernels'
# custom calls themselves, the module's sharding mesh.
LAUNCH_FREE_OPS = frozenset({"reshape", "bitcast_convert", "constant", "custom_call", "mesh"})


def launched_ops(lowered_text: str) -> set[str]:
    """The StableHLO ops of a lowered program (``.lower(...).as_text()``) outside
    `LAUNCH_FREE_OPS`: XLA computations of the program's own, each one more launch beside its
    kernels on a GPU."""
    return set(re.findall(r"(?<!#)stablehlo\.(\w+)", lowered_text)) - LAUNCH_FREE_OPS


def assert_close_with_the_same_nans(got, expected, atol: float) -> None:
    """NaN exactly where ``expected`` has NaN (as torch_ref propagates them), ``atol``-close
    elsewhere."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(expected), atol=atol, rtol=0)

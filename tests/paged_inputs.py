"""The tests' one helper module: inputs, conversions, the tolerance rule, lowering for CUDA.

Inputs, drawn from one numpy generator (the ``rng`` fixture):

- `make_paged`: a decode batch over a shuffled paged cache, its tables built by
  `parity.layout.paged_layout` (the one builder of paged layouts); every cache slot that is not a
  valid token holds ``fill`` (NaN by default) and table tails hold garbage ids.
- `make_ragged`: the same cache and tables with packed queries (ragged paged attention).
- `draw_write`: caches full of values and tokens for distinct slots, some of them ``-1``;
  `write_torch`: torch_ref's write of them, the expectation of every write.
- `used_entries`: the table entries a row's length makes meaningful.

Conversions (bit-exact, through `parity.convert`): `to_torch`, `to_numpy`, `bits`, `jax_options`,
`torch_options`.

The tolerance rule: FlashAttention's, as `parity.tolerance` states it. `reference` computes the
truth (the float64 `parity.oracle`) and the naive baseline in the output dtype
(`parity.tolerance.naive_attention`); `assert_close` holds an output (and its lse) to
``max |out - truth| <= 2 * max |baseline - truth| + atol``, zero-length rows to exact zeros and
``-inf``, NaN exactly where the truth has NaN. Checks that must be exact or within ulps stay so:
`bits` (writes, determinism, invariants), `assert_within_ulps` (two implementations that round
the same fp32 result), `assert_rounded_once` (torch_ref: SPEC.md's one rounding).
`repeat_mapping_truth` is what a wrong GQA mapping would give, to show a test has teeth.

Lowering for CUDA on any machine: `lower_for_cuda`, `launched_ops`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
import torch_ref
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_paged._platform import quiet_triton_deprecation
from parity import convert, tolerance
from parity.cases import Case, decode_view
from parity.layout import paged_layout
from parity.oracle import oracle_paged_attention, oracle_ragged_attention

NP_DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
}
FP8 = "float8_e4m3fn"
IMPLS = ("xla", "pallas")  # the implementations every op has; decode also has "mosaic"


# --- conversions ---------------------------------------------------------------------------------

def to_torch(x) -> torch.Tensor:
    """Bit-exact numpy -> torch on the CPU (bf16 and fp8 through their raw bits)."""
    return convert.to_torch(np.asarray(x), "cpu")


def to_numpy(x) -> np.ndarray:
    """torch, JAX or numpy array -> numpy, bit-exact."""
    return convert.from_torch(x) if isinstance(x, torch.Tensor) else np.asarray(x)


def bits(x) -> np.ndarray:
    """The raw bits of an array, so that NaN == NaN and -0.0 != 0.0 in comparisons."""
    return convert.bits(to_numpy(x))


def jax_options(options: dict) -> dict:
    """Keyword arguments with numpy arrays made JAX arrays."""
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}


def torch_options(options: dict) -> dict:
    """Keyword arguments with numpy (or JAX) arrays made torch tensors."""
    return {k: to_torch(v) if isinstance(v, (np.ndarray, jax.Array)) else v
            for k, v in options.items()}


def dtype_name(dtype) -> str:
    """``float32``, ``bfloat16``, ... for a numpy, JAX or torch dtype."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


# --- inputs --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Paged:
    """numpy arrays of one decode problem (caches already hold every valid token)."""

    q: np.ndarray             # [B, H, D]
    k_cache: np.ndarray       # [num_blocks, bs, KVH, D]
    v_cache: np.ndarray       # [num_blocks, bs, KVH, D]
    block_tables: np.ndarray  # i32[B, max_blocks]
    context_lens: np.ndarray  # i32[B]
    valid_slots: np.ndarray   # bool[num_blocks * bs], the slots holding a valid token

    ARGS = ("q", "k_cache", "v_cache", "block_tables", "context_lens")

    def arrays(self, **overrides) -> list:
        values = {name: getattr(self, name) for name in self.ARGS}
        values.update(overrides)
        return [values[name] for name in self.ARGS]

    def jax(self, **overrides) -> list:
        return [jnp.asarray(x) for x in self.arrays(**overrides)]

    def torch(self, **overrides) -> list:
        return [to_torch(x) for x in self.arrays(**overrides)]

    def replace(self, **changes) -> "Paged":
        return dataclasses.replace(self, **changes)


def make_paged(rng: np.random.Generator, *, lens, num_heads=4, num_kv_heads=2, head_dim=32,
               block_size=4, spare_blocks=3, max_blocks=None, dtype="float32", q_dtype=None,
               fill=np.nan, tail=(99999, -7)) -> Paged:
    """A batch with context lengths ``lens`` over a shuffled paged cache.

    The tables come from `parity.layout.paged_layout` (physical blocks a permutation,
    ``spare_blocks`` owned by no sequence, each row's tail cycling through ``tail``, or
    ``"random"`` garbage); every slot that is not a valid token holds ``fill``. ``q`` is in
    ``q_dtype`` (default: the cache dtype, bf16 for an fp8 cache).
    """
    layout = paged_layout(rng, lens, block_size=block_size, table_width=max_blocks,
                          spare_blocks=spare_blocks, tail=tail)
    num_blocks = layout.num_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    values = rng.standard_normal((2, num_blocks * block_size, num_kv_heads, head_dim))
    values = values.astype(np.float32)
    valid = layout.valid_slots(block_size)
    values[:, ~valid] = fill
    q_dtype = q_dtype or ("bfloat16" if dtype == FP8 else dtype)
    q = rng.standard_normal((len(layout.context_lens), num_heads, head_dim)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        k_cache, v_cache = (x.reshape(shape).astype(NP_DTYPES[dtype]) for x in values)
    return Paged(q=q.astype(NP_DTYPES[q_dtype]), k_cache=k_cache, v_cache=v_cache,
                 block_tables=layout.block_tables, context_lens=layout.context_lens,
                 valid_slots=valid)


def used_entries(block_tables, context_lens, block_size: int) -> np.ndarray:
    """``bool[B, max_blocks]``: the table entries a row's length makes meaningful."""
    pages = -(-np.asarray(context_lens, np.int64) // block_size)
    return np.arange(np.shape(block_tables)[1])[None, :] < pages[:, None]


@dataclasses.dataclass
class Ragged:
    """numpy arrays of one ragged problem: the cache and tables of `make_paged`, packed queries."""

    q: np.ndarray                # [num_tokens, H, D]
    k_cache: np.ndarray          # [num_blocks, bs, KVH, D]
    v_cache: np.ndarray
    block_tables: np.ndarray     # i32[B, max_blocks]
    context_lens: np.ndarray     # i32[B]
    query_start_loc: np.ndarray  # i32[B + 1]

    def arrays(self, **overrides) -> list:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(overrides)
        return [values[f.name] for f in dataclasses.fields(self)]

    def jax(self, **overrides) -> list:
        return [jnp.asarray(x) for x in self.arrays(**overrides)]

    def torch(self, **overrides) -> list:
        return [to_torch(x) for x in self.arrays(**overrides)]

    def replace(self, **changes) -> "Ragged":
        return dataclasses.replace(self, **changes)


def make_ragged(rng: np.random.Generator, seqs, *, pad=0, **kwargs) -> Ragged:
    """``seqs`` = ``[(q_len, context_len), ...]``; ``pad`` padding rows after the last sequence;
    ``kwargs`` as `make_paged`."""
    q_lens = [q_len for q_len, _ in seqs]
    paged = make_paged(rng, lens=[n for _, n in seqs], **kwargs)
    _, num_heads, head_dim = paged.q.shape
    q = rng.standard_normal((sum(q_lens) + pad, num_heads, head_dim)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Ragged(q.astype(paged.q.dtype), paged.k_cache, paged.v_cache, paged.block_tables,
                  paged.context_lens, qsl)


def draw_write(rng: np.random.Generator, *, num_blocks=6, block_size=4, kvh=2, head_dim=32,
               num_tokens=9, num_padding=3, dtype="float32", token_dtype=None):
    """A cache full of random values, and tokens for distinct random slots, ``num_padding`` of
    them ``-1``: ``(k_cache, v_cache, k, v, slot_mapping)`` as numpy.

    The tokens are in ``token_dtype``, by default the cache dtype, and bf16 for fp8 caches: few
    mantissa bits, so x / scale often lands exactly on a tie.
    """
    shape = (num_blocks, block_size, kvh, head_dim)
    if token_dtype is None:
        token_dtype = "bfloat16" if dtype == FP8 else dtype
    k_cache, v_cache = rng.standard_normal((2, *shape)).astype(NP_DTYPES[dtype])
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int32)
    slots[rng.choice(num_tokens, num_padding, replace=False)] = -1
    k, v = rng.standard_normal((2, num_tokens, kvh, head_dim)).astype(NP_DTYPES[token_dtype])
    return k_cache, v_cache, k, v, slots


def write_torch(k_cache, v_cache, k, v, slots, **scales):
    """torch_ref's write on copies of the caches: ``(k_cache, v_cache)`` as torch tensors."""
    kc, vc = to_torch(np.array(k_cache, copy=True)), to_torch(np.array(v_cache, copy=True))
    torch_ref.write_kv(kc, vc, to_torch(k), to_torch(v), torch.from_numpy(np.asarray(slots)),
                       **torch_options(scales))
    return kc, vc


# --- the tolerance rule --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Reference:
    """What an attention output is judged against (see `reference`)."""

    out_dtype: str            # the output's dtype (q's)
    row_lens: np.ndarray      # i64[rows]: keys each output row sees (0: exact zeros, -inf)
    truth_out: np.ndarray     # f64[rows, H, D], `parity.oracle`
    truth_lse: np.ndarray     # f64[rows, H]
    baseline_out: np.ndarray  # f64, naive in out_dtype (`parity.tolerance.naive_attention`)
    baseline_lse: np.ndarray  # f64, naive in float32 (the lse is an fp32 output)


def _scalar(scale):
    return None if scale is None else float(np.asarray(to_numpy(scale), np.float64).reshape(()))


def reference(q, k_cache, v_cache, block_tables, context_lens, scale=None, *,
              query_start_loc=None, logits_soft_cap=None, alibi_slopes=None,
              sliding_window=None, sinks=None, k_scale=None, v_scale=None) -> Reference:
    """The float64 truth and the naive baseline of one decode (or, with ``query_start_loc``,
    ragged) attention call on valid inputs (numpy, JAX or torch arrays).

    The truth is `parity.oracle`'s; the baseline is SPEC.md's formula computed naively in the
    output dtype by `parity.tolerance.naive_attention` (in float32 for the lse), on the decode
    view of the call (one row per query, `parity.cases.decode_view`), as parity's judge does.
    """
    q, k_cache, v_cache = (to_numpy(x) for x in (q, k_cache, v_cache))
    tables = to_numpy(block_tables).astype(np.int64)
    lens = to_numpy(context_lens).astype(np.int64)
    slopes = None if alibi_slopes is None else to_numpy(alibi_slopes).astype(np.float32)
    sink = None if sinks is None else to_numpy(sinks).astype(np.float32)
    k_scale, v_scale = _scalar(k_scale), _scalar(v_scale)
    options = dict(logits_soft_cap=logits_soft_cap, alibi_slopes=slopes,
                   sliding_window=sliding_window, sinks=sink, k_scale=k_scale, v_scale=v_scale)
    if query_start_loc is None:
        truth_out, truth_lse = oracle_paged_attention(q, k_cache, v_cache, tables, lens, scale,
                                                      **options)
    else:
        starts = to_numpy(query_start_loc).astype(np.int64)
        truth_out, truth_lse = oracle_ragged_attention(q, k_cache, v_cache, tables, lens, starts,
                                                       scale, **options)
    out_dtype = dtype_name(q.dtype)
    batch = tables.shape[0]
    inputs = dict(q=q, block_tables=tables, context_lens=lens.astype(np.int32))
    if slopes is not None:
        inputs["alibi_slopes"] = slopes
    if sink is not None:
        inputs["sinks"] = sink
    if query_start_loc is not None:
        inputs["query_start_loc"] = starts.astype(np.int32)
    cache_dtype = dtype_name(k_cache.dtype)
    if batch == 0 or q.shape[0] == 0 or tables.shape[1] == 0 or not (lens > 0).any():
        empty_out, empty_lse = np.zeros(truth_out.shape), np.full(truth_lse.shape, -np.inf)
        return Reference(out_dtype, np.zeros(q.shape[0], np.int64), truth_out, truth_lse,
                         empty_out, empty_lse)
    q_lens = None if query_start_loc is None else tuple(int(n) for n in np.diff(starts))
    case = Case(name="test", batch=batch, num_heads=q.shape[1], num_kv_heads=k_cache.shape[2],
                head_dim=q.shape[2], block_size=k_cache.shape[1], dtype=cache_dtype,
                query_dtype=out_dtype if cache_dtype == FP8 else None, scale=scale,
                logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                alibi=slopes is not None, sinks=sink is not None, k_scale=k_scale,
                v_scale=v_scale, new_tokens=q_lens)
    view = decode_view(case, inputs)
    row_lens = view["context_lens"].astype(np.int64)
    base_out, _ = tolerance.naive_attention(case, view, k_cache, v_cache, out_dtype)
    _, base_lse = tolerance.naive_attention(case, view, k_cache, v_cache, "float32")
    return Reference(out_dtype, row_lens, truth_out, truth_lse, base_out, base_lse)


def _judge(name: str, got: np.ndarray, truth: np.ndarray, baseline: np.ndarray, dtype: str,
           output: str) -> None:
    """FlashAttention's rule on the elements where the truth is not NaN (those must be NaN)."""
    nan = np.isnan(truth)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{name}: NaN where the truth"
                                  " has none, or a number where it has NaN")
    got, truth, baseline = got[~nan], truth[~nan], baseline[~nan]
    tol = tolerance.decode_tolerance(output, dtype, truth, baseline)
    assert tol.finite, (f"{name}: the naive {dtype} baseline overflowed (error"
                        f" {tol.baseline_err}): the rule cannot judge this input")
    err = tolerance.max_abs_error(got, truth)
    assert err <= tol.value, (f"{name}: max|out - truth| = {err:.4g} > 2 * max|baseline - truth|"
                              f" + atol = 2 * {tol.baseline_err:.4g} + {tol.atol:.4g}")


def assert_close(ref: Reference, out, lse=None, *, what: str = "") -> None:
    """``out`` (and ``lse``) within FlashAttention's bound of ``ref``'s truth
    (`parity.tolerance`): ``max |out - truth| <= 2 * max |baseline - truth| + atol``, ``atol``
    from parity's table relative to ``max |truth|`` (``1e-5 * max(1, max |lse|)`` for the lse).
    Rows with no key are exactly 0 and ``-inf``; where the truth is NaN (a NaN query or key,
    SPEC.md's softmax) the output must be NaN, and nowhere else."""
    name = what or "out"
    got = to_numpy(out)
    assert got.shape == ref.truth_out.shape, (name, got.shape, ref.truth_out.shape)
    assert dtype_name(got.dtype) == ref.out_dtype, (name, got.dtype, ref.out_dtype)
    got = got.astype(np.float64)
    empty = ref.row_lens <= 0
    assert (got[empty] == 0).all(), f"{name}: rows {np.flatnonzero(empty)} without keys not zero"
    _judge(name, got, ref.truth_out, ref.baseline_out, ref.out_dtype, "out")
    if lse is not None:
        got_lse = to_numpy(lse)
        assert got_lse.dtype == np.float32 and got_lse.shape == ref.truth_lse.shape
        got_lse = got_lse.astype(np.float64)
        assert np.isneginf(got_lse[empty]).all(), f"{name}: lse of rows without keys not -inf"
        _judge(f"{name} lse", got_lse, ref.truth_lse, ref.baseline_lse, "float32", "lse")


def assert_rounded_once(out, truth, dtype: str) -> None:
    """SPEC.md's precision, element by element: fp32 accumulation then one rounding to ``dtype``,
    so within half an ulp of ``dtype`` (`parity.tolerance.ulp`) of the float64 truth, plus
    ``1e-5 * max(1, |truth|)`` for the fp32 sums. Stricter than `assert_close`; for torch_ref,
    which SPEC.md's formula is written in."""
    got = to_numpy(out).astype(np.float64)
    truth = np.asarray(truth, np.float64)
    assert np.isfinite(got).all(), "NaN or Inf in the output"
    bound = tolerance.ulp(truth, dtype) / 2 + 1e-5 * np.maximum(1.0, np.abs(truth))
    err = np.abs(got - truth)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), (f"|out - truth| = {err[worst]:.4g} > {bound[worst]:.4g} at"
                                  f" {tuple(int(i) for i in worst)} ({dtype})")


def assert_within_ulps(got, want, dtype: str, ulps: float = 1, magnitude: float = 0.0) -> None:
    """Two implementations agree within ``ulps`` units in the last place of ``dtype``
    (`parity.tolerance.ulp`) at the larger of the two values and ``magnitude`` (an fp32 sum of
    terms of that size errs at their scale, not at its result's)."""
    got, want = (to_numpy(x).astype(np.float64) for x in (got, want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    spacing = tolerance.ulp(np.maximum(np.maximum(np.abs(got[ok]), np.abs(want[ok])), magnitude),
                            dtype)
    err = np.abs(got[ok] - want[ok])
    assert (err <= ulps * spacing).all(), f"{(err / spacing).max():.2f} ulps of {dtype} apart"


def repeat_mapping_truth(q, k_cache, v_cache, block_tables, context_lens) -> np.ndarray:
    """The float64 output a wrong GQA mapping gives: query head ``h`` reading kv head
    ``h % KVH`` (``repeat``) instead of ``h // group`` (``repeat_interleave``)."""
    num_heads, num_kv_heads = np.shape(q)[1], np.shape(k_cache)[2]
    heads = [h % num_kv_heads for h in range(num_heads)]
    k, v = (np.asarray(to_numpy(c)).astype(np.float32)[:, :, heads] for c in (k_cache, v_cache))
    out, _ = oracle_paged_attention(to_numpy(q), k, v, to_numpy(block_tables),
                                    to_numpy(context_lens))
    return out


# --- lowering for CUDA without a GPU ---------------------------------------------------------------

# StableHLO ops that cost no launch of their own on a GPU: views of an operand, scalars, the kernels'
# custom calls themselves, the module's sharding mesh.
LAUNCH_FREE_OPS = frozenset({"reshape", "bitcast_convert", "constant", "custom_call", "mesh"})


def launched_ops(lowered_text: str) -> set[str]:
    """The StableHLO ops of a lowered program (``.lower(...).as_text()``) outside
    `LAUNCH_FREE_OPS`: XLA computations of the program's own, each one more launch beside its
    kernels on a GPU."""
    return set(re.findall(r"(?<!#)stablehlo\.(\w+)", lowered_text)) - LAUNCH_FREE_OPS


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """``jax.jit(fn)`` traced on ``args`` (arrays or ``jax.ShapeDtypeStruct``) and lowered for
    CUDA on any machine: the StableHLO text. Without a GPU, jax >= 0.12's Triton lowering asks
    for an abstract GPU to lower for."""
    gpu = AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    with quiet_triton_deprecation(), use_abstract_mesh(AbstractMesh((1,), ("x",),
                                                                     abstract_device=gpu)):
        traced = jax.jit(fn).trace(*args, **kwargs)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


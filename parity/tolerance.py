"""How close is close enough: FlashAttention's rule, with a per-dtype floor; writes are bit-exact.

The rule (FlashAttention's ``hopper/test_flash_attn.py``)
---------------------------------------------------------
For every decode output, compute the attention twice from the *same* inputs (q, and the caches as
they are after the write, already rounded to the test dtype):

- **truth**: in float64 (`parity.oracle.oracle_paged_attention`): the exact answer of
  SPEC.md's formula for these inputs, up to float64 rounding;
- **baseline**: naively in the test dtype (`naive_attention` with the test dtype): scores, scale,
  soft-cap, ALiBi, softmax and the weighted sum each rounded to that dtype by plain torch ops, the
  way a careless implementation would compute it.

An implementation passes when ::

    max |out - truth|  <=  2 * max |baseline - truth|  +  atol

The baseline error measures how hard this particular input is in this dtype (long contexts, peaked
softmaxes and large logits all make it larger), so the bound scales with the input instead of being
one guessed constant; an implementation that keeps SPEC.md's fp32 accumulation is far inside it,
and one that reads a wrong row, drops a mask or swaps K and V is far outside it. ``atol`` is a floor
for inputs where the baseline happens to be exact (a one-token context copies a V row), stated
relative to the output's scale ``max |truth|`` (1 where that is 0, which then demands exact zeros):

============  ==================  ========================================================
output dtype  atol / scale        why
============  ==================  ========================================================
float32       ``1e-5``            fp32-accurate: summation-order differences over thousands
                                  of terms stay near 1e-6; TF32 (10-bit mantissa, ~5e-4)
                                  does not fit
bfloat16      ``2**-8`` (3.9e-3)  one rounding of the output to bf16 (half an ulp is at
                                  most ``2**-8`` relative)
float16       ``2**-11`` (4.9e-4) one rounding of the output to fp16
============  ==================  ========================================================

fp8 caches are judged in their query dtype (bf16): the fp8 codes are the inputs, dequantized
exactly in the truth, so quantization itself is not an error here (the write check covers it).

The log-sum-exp is an fp32 output computed from fp32 scores in every dtype (SPEC.md: scores are
fp32), so its "test dtype" is fp32: its baseline is the naive computation in fp32 and its floor is
``1e-5 * max(1, max |lse|)``. Zero-length rows must give exactly 0 (out) and ``-inf`` (lse); NaN
anywhere is an infinite error.

Writes are compared bit for bit (`parity.convert.bits`), so NaN == NaN and a payload or sign-of-zero
change is a mismatch: there is no tolerance for a copy.

Beyond FlashAttention's rule
----------------------------
The rule above is one absolute bound per output, set by its largest elements: for bf16 about 1.6
ulps at ``max |truth|`` on the default suite, so 25 ulps for an element 16 times smaller, and a
bias of one ulp on every element hides inside it. Two more bounds close that room
(`parity.compare` applies them):

- **ulps against torch_ref** (JAX implementations, non-empty rows): ::

      |impl - torch_ref|  <=  k * ulp(max(|torch_ref|, magnitude))

  with `ulp` the output dtype's spacing and `magnitudes` the scale each element's fp32
  accumulation errs at (``sum_p w_p |v_p|`` for ``out``, the largest score plus ``log(terms)``
  for ``lse``); ``k = ULP_BOUND[dtype]``, derived and calibrated on the real implementations
  (docs/PARITY.md gives the numbers: at most 1 ulp for bf16 / fp16 and the lse, 24 for fp32, on
  the CPU).
- **no systematic bias** (every implementation, non-empty rows): ::

      |mean(out - truth)|  <=  BIAS_SIGMAS * sigma + BIAS_FLOOR_ULPS * mean(ulp_fp32(magnitude))

  with ``sigma`` the standard deviation that rounding each element once to its dtype gives the
  mean (`bias_statistics` derives it). A one-ulp bias of every bf16 output is 100 sigma and more.

A bound that is not finite (a baseline that overflowed) judges nothing: the check fails.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from parity import convert
from parity.cases import Case
from parity.oracle import oracle_paged_attention, oracle_ragged_attention

__all__ = [
    "ATOL",
    "BIAS_FLOOR_ULPS",
    "BIAS_SIGMAS",
    "LSE_ATOL",
    "ULP_BOUND",
    "Tolerance",
    "abs_errors",
    "bias_statistics",
    "decode_tolerance",
    "magnitudes",
    "max_abs_error",
    "naive_attention",
    "reference_outputs",
    "ulp",
    "ulps_between",
    "with_statistics",
]

# atol relative to the output's scale, per output dtype (see the module docstring).
ATOL = {"float32": 1e-5, "bfloat16": 2.0**-8, "float16": 2.0**-11}
LSE_ATOL = 1e-5
FACTOR = 2.0  # FlashAttention's factor on the baseline error

# Explicit mantissa bits and smallest normal exponent of each output dtype, for `ulp`.
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
MIN_NORMAL_EXPONENT = {"float32": -126, "bfloat16": -126, "float16": -14}
# |impl - torch_ref| <= ULP_BOUND[dtype] * ulp(magnitude) elementwise, for the JAX impls; "lse"
# is the (fp32) log-sum-exp. Calibrated on the default suite (docs/PARITY.md has the numbers).
ULP_BOUND = {"float32": 64.0, "bfloat16": 2.0, "float16": 2.0, "lse": 8.0}
# |mean(out - truth)| <= BIAS_SIGMAS * sigma + BIAS_FLOOR_ULPS * mean(ulp_fp32(magnitude)).
BIAS_SIGMAS = 6.0
BIAS_FLOOR_ULPS = 4.0

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64}
_CHUNK_ELEMENTS = 2**26  # gathered K elements per batch chunk, to bound memory on big cases


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The bound one decode output is held to: ``factor * baseline_err + atol``.

    Attributes:
      output: ``"out"`` or ``"lse"``.
      dtype: the dtype the baseline was computed in.
      baseline_err: ``max |baseline - truth|``.
      atol: the absolute floor (already multiplied by ``scale``).
      scale: the output's scale, ``max |truth|`` over finite entries (1 if that is 0 for lse).
      factor: the multiplier of ``baseline_err`` (2).
      ulp_bound: ``k`` of the elementwise bound against torch_ref,
        ``|impl - torch_ref| <= k * ulp(magnitude)`` (`ULP_BOUND`).
      bias_sigma: the standard deviation of ``mean(out - truth)`` that rounding every element
        to ``dtype`` gives (`bias_bound`).
      bias_floor: the allowance for fp32 accumulation error in that mean (`bias_bound`).
      bias_sigmas: how many ``bias_sigma`` the mean may drift (`BIAS_SIGMAS`).
    """

    output: str
    dtype: str
    baseline_err: float
    atol: float
    scale: float
    factor: float = FACTOR
    ulp_bound: float = 0.0
    bias_sigma: float = 0.0
    bias_floor: float = 0.0
    bias_sigmas: float = BIAS_SIGMAS

    @property
    def value(self) -> float:
        return self.factor * self.baseline_err + self.atol

    @property
    def finite(self) -> bool:
        """False when the baseline (or the truth) overflowed: such a bound judges nothing."""
        return math.isfinite(self.value) and math.isfinite(self.bias_bound)

    @property
    def bias_bound(self) -> float:
        """The bound on ``|mean(out - truth)|`` over the non-empty rows."""
        return self.bias_sigmas * self.bias_sigma + self.bias_floor

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), value=self.value, bias_bound=self.bias_bound)


def abs_errors(out: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Elementwise ``|out - truth|`` in float64, where equal infinities count as 0 and NaN or an
    infinity against anything else counts as ``inf``."""
    out = np.asarray(out, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(out - truth)
    same_inf = np.isinf(out) & np.isinf(truth) & (out == truth)
    err = np.where(same_inf, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


def max_abs_error(out: np.ndarray, truth: np.ndarray) -> float:
    err = abs_errors(out, truth)
    return float(err.max()) if err.size else 0.0


def output_scale(truth: np.ndarray) -> float:
    finite = np.abs(np.asarray(truth, dtype=np.float64)[np.isfinite(truth)])
    return float(finite.max()) if finite.size else 0.0


def decode_tolerance(output: str, out_dtype: str, truth: np.ndarray, baseline: np.ndarray,
                     baseline_dtype: str | None = None) -> Tolerance:
    """The `Tolerance` of one decode output from its truth and its naive baseline.

    Args:
      output: ``"out"`` or ``"lse"``.
      out_dtype: the dtype of the output under test (``q``'s dtype for ``out``).
      truth, baseline: float64 arrays of the same shape.
      baseline_dtype: what the baseline was computed in (for the record); default ``out_dtype``.
    """
    scale = output_scale(truth)
    if output == "lse":
        atol = LSE_ATOL * max(1.0, scale)
    else:
        atol = ATOL[out_dtype] * scale
    return Tolerance(output=output, dtype=baseline_dtype or out_dtype,
                     baseline_err=max_abs_error(baseline, truth), atol=atol, scale=scale)


def ulp(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype``'s numbers at ``|x|``: ``2**(e - mantissa_bits)`` for ``|x|`` in
    ``[2**e, 2**(e + 1))``, and that of the smallest normal below it (so 0 and subnormals get the
    smallest normal's spacing, never 0). float64 in and out; NaN and inf give NaN and inf."""
    mag = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    exponent = np.maximum(np.where(mag > 0, exponent, -np.inf), MIN_NORMAL_EXPONENT[dtype])
    spacing = np.exp2(exponent - MANTISSA_BITS[dtype])
    return np.where(np.isfinite(mag), spacing, mag)


def ulps_between(got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray,
                 dtype: str) -> np.ndarray:
    """``|got - ref|`` in units of ``ulp(max(|ref|, magnitude), dtype)``, elementwise (float64).

    NaN or an infinity on either side (other than equal infinities) is ``inf`` ulps.
    """
    ref64 = np.asarray(ref, dtype=np.float64)
    scale = np.maximum(np.abs(np.where(np.isfinite(ref64), ref64, 0.0)), magnitude)
    return abs_errors(got, ref) / ulp(scale, dtype)


def bias_statistics(truth: np.ndarray, magnitude: np.ndarray, dtype: str) -> tuple[float, float]:
    """``(sigma, floor)`` of the bias test: ``|mean(out - truth)| <= BIAS_SIGMAS * sigma + floor``.

    A correct output element is ``round(y)``, the fp32 result ``y = truth + a`` rounded once to
    ``dtype`` (SPEC.md). Round-to-nearest-even leaves an error ``r`` that is, element by element,
    close to uniform on ``[-ulp/2, ulp/2]``: mean 0, variance ``ulp**2 / 12``, independent between
    elements. The mean of ``N`` of them has ``sigma = sqrt(sum(ulp_i**2) / 12) / N`` (``ulp_i`` at
    ``|truth_i|``); by the central limit theorem it stays within `BIAS_SIGMAS` = 6 sigma but for
    odds of about 2e-9. The fp32 accumulation error ``a`` is no rounding to ``dtype`` and may be
    correlated (a denominator error scales a whole row), so its mean gets a floor instead:
    `BIAS_FLOOR_ULPS` fp32 ulps of the elements' magnitude (`magnitudes`), on average. Every bf16
    output one ulp high moves the mean by ``mean(ulp_i)``: up to ``sqrt(12 N)`` sigma, 190 sigma
    for N = 3072 (6 rows of 8 heads of 64).

    Args:
      truth: float64 values of the elements judged (zero-length rows left out).
      magnitude: float64, same shape: the scale of each element's fp32 accumulation.
      dtype: the output dtype.
    """
    truth = np.asarray(truth, dtype=np.float64).ravel()
    n = truth.size
    if n == 0:
        return 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        sigma = float(np.sqrt(np.sum(ulp(truth, dtype) ** 2) / 12.0) / n)
        floor = float(BIAS_FLOOR_ULPS * np.mean(ulp(np.asarray(magnitude).ravel(), "float32")))
    return sigma, floor


def with_statistics(tol: Tolerance, truth: np.ndarray, magnitude: np.ndarray,
                    rows: np.ndarray) -> Tolerance:
    """``tol`` with its ulp bound and bias bound filled in.

    Args:
      tol: from `decode_tolerance`.
      truth: the float64 truth of the output, ``[B, ...]``.
      magnitude: `magnitudes` of the output, same shape.
      rows: ``bool[B]``, the non-empty rows (zero-length rows are judged as exact zeros instead).
    """
    dtype = "float32" if tol.output == "lse" else tol.dtype
    sigma, floor = bias_statistics(truth[rows], magnitude[rows], dtype)
    key = "lse" if tol.output == "lse" else tol.dtype
    return dataclasses.replace(tol, ulp_bound=ULP_BOUND[key], bias_sigma=sigma, bias_floor=floor)


def magnitudes(case: Case, inputs: dict[str, np.ndarray], k_cache: np.ndarray,
               v_cache: np.ndarray, truth_lse: np.ndarray, device: str = "cpu") -> dict:
    """The magnitude each decode output element is computed at, float64: what its ulps count.

    - ``out``: ``sum_p w_p |v_p|`` with the float64 softmax weights ``w`` (`naive_attention` over
      ``|V|``). A weighted sum accumulated in fp32 errs by a few fp32 ulps of the sum of its
      terms' magnitudes, not of its result: an output near 0 made of terms near 1 is as accurate
      as one near 1, in absolute terms. Always ``>= |out|``.
    - ``lse``: ``max(|lse|, S) + log(terms)``, ``terms`` the positions that take part (plus the
      sink) and ``S`` the largest score magnitude among them, ``|scale| * sum_d |q_d k_pd| +
      |slope * (p - (n - 1))|`` (``|sink|`` too): each fp32 score is within a few ulps of ``S``,
      the running max ``m`` is one of them, and ``log(sum_p e^(s_p - m))`` lies in
      ``[0, log(terms)]``.

    Zero-length rows get 0 (they are judged as exact zeros / ``-inf``).
    """
    out_mag, _ = naive_attention(case, inputs, k_cache, np.abs(v_cache), "float64", device)
    slots, valid, distance = _positions(case, inputs)
    batch, num_heads, head_dim = inputs["q"].shape
    kvh, group = case.num_kv_heads, case.group
    scale = abs(case.scale if case.scale is not None else 1.0 / math.sqrt(head_dim))
    dev = convert.torch_device(device)
    k_rows = _cache_rows(convert.to_torch(k_cache, device), torch.float64, case.k_scale).abs()
    q_all = convert.to_torch(inputs["q"], device).to(torch.float64).abs()
    score = np.zeros((batch, num_heads))
    for b in range(batch):  # one row at a time: [P, KVH, D] float64 stays small
        ok = valid[b]
        if not ok.any():
            continue
        idx = torch.from_numpy(slots[b][ok]).to(dev)
        q = q_all[b].reshape(kvh, group, head_dim)
        dots = torch.einsum("kgd,pkd->kgp", q, k_rows[idx]) * scale  # [KVH, G, P]
        if "alibi_slopes" in inputs:
            slopes = np.abs(inputs["alibi_slopes"].astype(np.float64)).reshape(kvh, group)
            dots = dots + torch.from_numpy(slopes[:, :, None] * np.abs(distance[b][ok])).to(dev)
        score[b] = dots.amax(dim=-1).reshape(num_heads).cpu().numpy()
    if "sinks" in inputs:
        score = np.maximum(score, np.abs(inputs["sinks"].astype(np.float64))[None, :])
    terms = valid.sum(axis=1).astype(np.float64) + (1.0 if case.sinks else 0.0)  # [B]
    lse = np.asarray(truth_lse, dtype=np.float64)
    lse = np.abs(np.where(np.isfinite(lse), lse, 0.0))
    lse_mag = np.maximum(lse, score) + np.log(np.maximum(terms, 1.0))[:, None]
    lse_mag[inputs["context_lens"] == 0] = 0.0
    return {"out": out_mag, "lse": lse_mag}


def _positions(case: Case, inputs: dict[str, np.ndarray]):
    """Slots and masks of every sequence's positions, padded to the longest context.

    Returns:
      ``(slots i64[B, P], valid bool[B, P], distance f64[B, P])``: the flat cache slot of position
      ``p`` of sequence ``b`` (0 where it does not exist, so garbage table entries are never used),
      whether it takes part (``p < n`` and inside the sliding window), and ``p - (n - 1)``.
    """
    lens = inputs["context_lens"].astype(np.int64)
    tables = inputs["block_tables"].astype(np.int64)
    bs = case.block_size
    width = max(int(lens.max(initial=0)), 1)
    p = np.arange(width)[None, :]
    exists = p < lens[:, None]
    page = np.where(exists, p // bs, 0)
    block = np.where(exists, np.take_along_axis(tables, page, axis=1), 0)
    slots = np.where(exists, block * bs + p % bs, 0)
    valid = exists
    if case.sliding_window is not None:
        valid = valid & (p >= lens[:, None] - case.sliding_window)
    return slots, valid, (p - (lens[:, None] - 1)).astype(np.float64)


def _cache_rows(cache: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """The cache as ``[num_slots, KVH, D]`` in ``dtype``; fp8 dequantized as ``stored * scale``."""
    flat = cache.reshape(-1, cache.shape[2], cache.shape[3])
    if cache.dtype == torch.float8_e4m3fn:
        return (flat.to(torch.float32).to(torch.float64) * scale).to(dtype)
    return flat.to(dtype)


def naive_attention(case: Case, inputs: dict[str, np.ndarray], k_cache: np.ndarray,
                    v_cache: np.ndarray, dtype: str, device: str = "cpu"):
    """SPEC.md's decode attention computed entirely in ``dtype`` with plain torch ops.

    With ``dtype="float64"`` this is the truth; with the test dtype, the naive baseline. Vectorized
    over the batch (in chunks), written independently of `torch_ref`: positions are gathered by
    flat slot, masked rows are zeroed before they meet a weight (so NaN in unused slots cannot
    leak), and the sink is one more softmax column with no value row.

    Args:
      case: the case (scale and options).
      inputs: `make_inputs` output (q, tables, lengths, alibi slopes, sinks).
      k_cache, v_cache: the caches after the write (numpy, the case's dtype).
      dtype: ``"float64"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      device: ``"cpu"`` or ``"cuda"``.

    Returns:
      ``(out f64[B, H, D], lse f64[B, H])`` as numpy; zero-length rows give zeros and ``-inf``.
    """
    tdtype = _TORCH_DTYPES[dtype]
    dev = convert.torch_device(device)
    batch, num_heads, head_dim = inputs["q"].shape
    kvh, group = case.num_kv_heads, case.group
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(head_dim)
    slots, valid, distance = _positions(case, inputs)
    k_rows = _cache_rows(convert.to_torch(k_cache, device), tdtype, case.k_scale)
    v_rows = _cache_rows(convert.to_torch(v_cache, device), tdtype, case.v_scale)
    q_all = convert.to_torch(inputs["q"], device).to(tdtype)
    slopes = sinks = None
    if "alibi_slopes" in inputs:
        slopes = convert.to_torch(inputs["alibi_slopes"], device).to(tdtype).reshape(kvh, group)
    if "sinks" in inputs:
        sinks = convert.to_torch(inputs["sinks"], device).to(tdtype).reshape(kvh, group)
    lens = inputs["context_lens"]

    width = slots.shape[1]
    chunk = max(1, _CHUNK_ELEMENTS // max(1, width * kvh * head_dim))
    outs, lses = [], []
    for lo in range(0, batch, chunk):
        hi = min(batch, lo + chunk)
        idx = torch.from_numpy(slots[lo:hi]).to(dev)
        ok = torch.from_numpy(valid[lo:hi]).to(dev)  # [b, P]
        k = torch.where(ok[:, :, None, None], k_rows[idx], 0)  # [b, P, KVH, D]
        v = torch.where(ok[:, :, None, None], v_rows[idx], 0)  # [b, P, KVH, D]
        q = q_all[lo:hi].reshape(hi - lo, kvh, group, head_dim)  # head h -> kv head h // group
        s = torch.einsum("bkgd,bpkd->bkgp", q, k) * torch.tensor(scale, dtype=tdtype, device=dev)
        if case.logits_soft_cap is not None:
            cap = torch.tensor(case.logits_soft_cap, dtype=tdtype, device=dev)
            s = cap * torch.tanh(s / cap)
        if slopes is not None:
            dist = torch.from_numpy(distance[lo:hi]).to(dev).to(tdtype)  # [b, P]
            s = s + slopes[None, :, :, None] * dist[:, None, None, :]
        s = s.masked_fill(~ok[:, None, None, :], -math.inf)
        if sinks is not None:
            sink = sinks[None, :, :, None].expand(hi - lo, kvh, group, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s, dim=-1)
        lse = torch.logsumexp(s, dim=-1)  # [b, KVH, G]
        if sinks is not None:
            p = p[..., :-1]
        out = torch.einsum("bkgp,bpkd->bkgd", p, v)
        empty = torch.from_numpy(lens[lo:hi] == 0).to(dev)[:, None, None]
        out = torch.where(empty[..., None], 0, out)
        lse = torch.where(empty, -math.inf, lse)
        outs.append(out.reshape(hi - lo, num_heads, head_dim).to(torch.float64).cpu())
        lses.append(lse.reshape(hi - lo, num_heads).to(torch.float64).cpu())
    return torch.cat(outs).numpy(), torch.cat(lses).numpy()


def reference_outputs(case: Case, inputs: dict[str, np.ndarray], k_cache: np.ndarray,
                      v_cache: np.ndarray, device: str = "cpu",
                      ragged_inputs: dict[str, np.ndarray] | None = None):
    """Truth, baselines and tolerances of a case's decode outputs.

    Args:
      inputs: the decode view of the case (`parity.cases.decode_view`: one decode row per query).
      ragged_inputs: a ragged case's own inputs (`make_inputs`), or None. When given, the truth
        is `oracle_ragged_attention` over them, one sequence at a time, which SPEC.md makes equal
        to the decode view's rows (up to float64 rounding) at a fraction of the cost: a
        sequence's positions are gathered once, not once per query.

    Returns:
      ``(truth, baseline, tolerances)``: dicts keyed by ``"out"`` (and ``"lse"`` when the case
      returns it) of float64 arrays, float64 arrays and `Tolerance`.
    """
    out_dtype = case.q_dtype
    options = dict(logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.get("alibi_slopes"),
                   sliding_window=case.sliding_window, sinks=inputs.get("sinks"),
                   k_scale=case.k_scale, v_scale=case.v_scale)
    if ragged_inputs is not None:
        truth_out, truth_lse = oracle_ragged_attention(
            ragged_inputs["q"], k_cache, v_cache, ragged_inputs["block_tables"],
            ragged_inputs["context_lens"], ragged_inputs["query_start_loc"], case.scale,
            **options)
    else:
        truth_out, truth_lse = oracle_paged_attention(
            inputs["q"], k_cache, v_cache, inputs["block_tables"], inputs["context_lens"],
            case.scale, **options)
    base_out, base_lse = naive_attention(case, inputs, k_cache, v_cache, out_dtype, device)
    truth = {"out": truth_out}
    baseline = {"out": base_out}
    tolerances = {"out": decode_tolerance("out", out_dtype, truth_out, base_out)}
    if case.return_lse:
        if out_dtype != "float32":
            _, base_lse = naive_attention(case, inputs, k_cache, v_cache, "float32", device)
        truth["lse"], baseline["lse"] = truth_lse, base_lse
        tolerances["lse"] = decode_tolerance("lse", "float32", truth_lse, base_lse)
    return truth, baseline, tolerances

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
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from parity import convert
from parity.cases import Case
from parity.oracle import oracle_paged_attention

__all__ = [
    "ATOL",
    "LSE_ATOL",
    "Tolerance",
    "abs_errors",
    "decode_tolerance",
    "max_abs_error",
    "naive_attention",
    "reference_outputs",
]

# atol relative to the output's scale, per output dtype (see the module docstring).
ATOL = {"float32": 1e-5, "bfloat16": 2.0**-8, "float16": 2.0**-11}
LSE_ATOL = 1e-5
FACTOR = 2.0  # FlashAttention's factor on the baseline error

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
    """

    output: str
    dtype: str
    baseline_err: float
    atol: float
    scale: float
    factor: float = FACTOR

    @property
    def value(self) -> float:
        return self.factor * self.baseline_err + self.atol

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), value=self.value)


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
                      v_cache: np.ndarray, device: str = "cpu"):
    """Truth, baselines and tolerances of a case's decode outputs.

    Returns:
      ``(truth, baseline, tolerances)``: dicts keyed by ``"out"`` (and ``"lse"`` when the case
      returns it) of float64 arrays, float64 arrays and `Tolerance`.
    """
    out_dtype = case.q_dtype
    truth_out, truth_lse = oracle_paged_attention(
        inputs["q"], k_cache, v_cache, inputs["block_tables"], inputs["context_lens"], case.scale,
        logits_soft_cap=case.logits_soft_cap, alibi_slopes=inputs.get("alibi_slopes"),
        sliding_window=case.sliding_window, sinks=inputs.get("sinks"), k_scale=case.k_scale,
        v_scale=case.v_scale)
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

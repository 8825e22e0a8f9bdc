"""Run a case through torch_ref and every JAX impl, and judge each output.

One case is one model-runner step, done the same way by every implementation: write the new tokens
into the cache (`write_kv`), then decode attention over the cache *that implementation wrote*.
The judgements:

- ``k_cache`` / ``v_cache`` (the caches after the write): bit-exact against the numpy expectation
  (`parity.cases.apply_write`), torch_ref included, so "every row passes" means every
  implementation stores the same bits as the spec and as each other;
- ``out`` (and ``lse`` with ``return_lse``), each implementation torch_ref included, by four rules
  (`parity.tolerance` states and derives them):

  1. FlashAttention's: ``max |out - truth| <= 2 * max |baseline - truth| + atol`` against the
     float64 truth;
  2. finite: the tolerance is finite, every element of a non-empty row is finite, and zero-length
     rows are exactly 0 (``lse == -inf``, the only non-finite values SPEC.md defines);
  3. the JAX impls only, elementwise against torch_ref's own output:
     ``|impl - torch_ref| <= k * ulp(max(|torch_ref|, magnitude))`` in the output dtype;
  4. no systematic bias: ``|mean(out - truth)|`` over the non-empty rows within what rounding
     each element to the output dtype allows (``6 sigma`` plus an fp32 accumulation floor).

  Dtypes and shapes must be right.

An implementation that raises is a failed check carrying the exception, not a crashed sweep.

`case_outputs` returns the raw arrays (for plots); `judge` turns them into a `CaseResult`;
`run_case` is both; `run_suite` runs many with a progress callback.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

import pallas_paged
import torch_ref
from parity import convert, tolerance
from parity.cases import Case, apply_write, decode_view, make_inputs
from parity.tolerance import Tolerance

__all__ = [
    "IMPLS",
    "Check",
    "CaseResult",
    "SuiteResult",
    "case_outputs",
    "judge",
    "run_case",
    "run_suite",
]

IMPLS = ("xla", "pallas")  # the default sweep
ALL_IMPLS = IMPLS + ("mosaic",)  # mosaic: asked for by name, on the cases it takes
WRITE_OUTPUTS = ("k_cache", "v_cache")
_ARRAY_OPTIONS = ("alibi_slopes", "sinks")


@dataclasses.dataclass
class Check:
    """The verdict on one output of one implementation.

    Attributes:
      output: ``"k_cache"``, ``"v_cache"`` (the write), ``"out"`` or ``"lse"`` (the decode).
      impl: ``"torch"`` (torch_ref), ``"xla"`` or ``"pallas"``.
      passed: the verdict.
      max_abs_err: ``max |got - expected|`` (writes: over differing elements; NaN vs a number is
        ``inf``); decode outputs against the float64 truth.
      max_rel_err: ``max_abs_err`` over the output's scale (``max |truth|``; 0 when both are 0).
      tolerance: the bound on ``max_abs_err``; 0 for the bit-exact writes.
      mismatches: elements that differ in their bits (writes) or exceed the tolerance (decode).
      vs_torch: ``max |got - torch_ref|`` for decode outputs of the JAX impls, else None.
      ulps_vs_torch: the largest ``|got - torch_ref|`` in ulps of the output dtype at the
        element's magnitude (`parity.tolerance.ulps_between`), JAX decode outputs only.
      ulp_bound: the bound on ``ulps_vs_torch``.
      bias: ``mean(got - truth)`` over the non-empty rows (decode outputs).
      bias_bound: the bound on ``|bias|``.
      detail: what went wrong, in words (first differing element, exception, bad dtype...).
    """

    output: str
    impl: str
    passed: bool
    max_abs_err: float
    max_rel_err: float
    tolerance: float
    mismatches: int = 0
    vs_torch: float | None = None
    ulps_vs_torch: float | None = None
    ulp_bound: float | None = None
    bias: float | None = None
    bias_bound: float | None = None
    detail: str = ""

    @property
    def label(self) -> str:
        return f"{self.output}[{self.impl}]"

    @property
    def ratio(self) -> float:
        """``max_abs_err / tolerance`` (FlashAttention's rule): <= 1 passes; 0 / 0 is 0, x / 0 and
        anything over a non-finite tolerance are inf."""
        if not math.isfinite(self.tolerance):
            return math.inf
        if self.max_abs_err == 0:
            return 0.0 if self.passed else math.inf
        if self.tolerance == 0:
            return math.inf
        return self.max_abs_err / self.tolerance

    @property
    def ulp_ratio(self) -> float | None:
        """``ulps_vs_torch / ulp_bound``, None where there is no comparison with torch_ref."""
        if self.ulps_vs_torch is None or self.ulp_bound is None:
            return None
        return _quotient(self.ulps_vs_torch, self.ulp_bound)

    @property
    def bias_ratio(self) -> float | None:
        """``|bias| / bias_bound``, None for the writes."""
        if self.bias is None or self.bias_bound is None:
            return None
        return _quotient(abs(self.bias), self.bias_bound)

    @property
    def worst_ratio(self) -> float:
        """The largest of `ratio`, `ulp_ratio` and `bias_ratio`: every rule passes at <= 1."""
        return max(r for r in (self.ratio, self.ulp_ratio, self.bias_ratio) if r is not None)

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), label=self.label, ratio=self.ratio,
                    ulp_ratio=self.ulp_ratio, bias_ratio=self.bias_ratio)


def _quotient(x: float, bound: float) -> float:
    """``x / bound`` with 0 / 0 = 0 and NaN, x / 0 or anything over a non-finite bound = inf."""
    if math.isnan(x) or not math.isfinite(bound):
        return math.inf
    if x == 0:
        return 0.0
    return x / bound if bound > 0 else math.inf


@dataclasses.dataclass
class CaseResult:
    """Every check of one case, the tolerances used, timings (seconds) and exceptions."""

    case: Case
    device: str
    checks: list[Check]
    tolerances: dict[str, Tolerance]
    timings: dict[str, float]
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def check(self, output: str, impl: str) -> Check:
        for c in self.checks:
            if (c.output, c.impl) == (output, impl):
                return c
        raise KeyError(f"no check {output}[{impl}] in case {self.case.name!r}")

    def worst(self, output: str) -> Check | None:
        """The check of ``output`` with the largest error/tolerance ratio (failures first)."""
        checks = [c for c in self.checks if c.output == output]
        if not checks:
            return None
        return max(checks, key=lambda c: (not c.passed, c.ratio))

    def to_dict(self) -> dict:
        return dict(
            case=dataclasses.asdict(self.case),
            device=self.device,
            passed=self.passed,
            checks=[c.to_dict() for c in self.checks],
            tolerances={k: t.to_dict() for k, t in self.tolerances.items()},
            timings=self.timings,
            errors=self.errors,
        )


@dataclasses.dataclass
class SuiteResult:
    """The results of a sweep, in case order, and its wall time."""

    results: list[CaseResult]
    device: str
    impls: tuple[str, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]


# ------------------------------------------------------------------------------------------------
# Running the implementations.

def _timed(fn, sync):
    start = time.perf_counter()
    result = fn()
    sync(result)
    return result, time.perf_counter() - start


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _run_torch(case: Case, inputs: dict[str, np.ndarray], device: str, timings: dict,
               results: dict) -> None:
    """torch_ref's write (in place) then decode, on ``device``; numpy arrays into ``results``."""
    t = {name: convert.to_torch(x, device) for name, x in inputs.items()}
    sync = lambda _: convert.torch_sync(device)  # noqa: E731
    scales = _scales(case, lambda s: convert.to_torch(np.asarray(s, np.float32), device))
    _, timings["torch.write"] = _timed(
        lambda: torch_ref.write_kv(t["k_cache"], t["v_cache"], t["k"], t["v"], t["slot_mapping"],
                                   **scales), sync)
    results["k_cache"] = convert.from_torch(t["k_cache"])
    results["v_cache"] = convert.from_torch(t["v_cache"])
    attention = torch_ref.paged_attention if case.ragged else torch_ref.paged_decode_attention
    ragged = (t["query_start_loc"],) if case.ragged else ()
    decode = lambda: attention(  # noqa: E731
        t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["context_lens"], *ragged,
        case.scale, logits_soft_cap=case.logits_soft_cap, sliding_window=case.sliding_window,
        return_lse=case.return_lse, **scales, **{k: t[k] for k in _ARRAY_OPTIONS if k in t})
    res, timings["torch.decode"] = _timed(decode, sync)
    out, lse = res if case.return_lse else (res, None)
    results["out"] = convert.from_torch(out)
    if lse is not None:
        results["lse"] = convert.from_torch(lse)


def _scales(case: Case, to_array) -> dict:
    """The fp8 scales as the case passes them: python floats, or ``to_array(float)`` arrays."""
    if not case.array_scales or case.k_scale is None:
        return dict(k_scale=case.k_scale, v_scale=case.v_scale)
    return dict(k_scale=to_array(case.k_scale), v_scale=to_array(case.v_scale))


def _kernel_config(case: Case):
    """The case's `DecodeConfig` (ragged: `AttentionConfig`) for the Pallas kernel, or None."""
    if case.block_k is None and case.num_splits is None:
        return None
    fields = {}
    if case.block_k is not None:
        fields["block_k"] = case.block_k
    if case.num_splits is not None:
        fields["num_splits"] = case.num_splits
    config = pallas_paged.AttentionConfig if case.ragged else pallas_paged.DecodeConfig
    return config(**fields)


def _run_jax(case: Case, inputs: dict[str, np.ndarray], device: str, impl: str, interpret: bool,
             timings: dict, results: dict) -> None:
    """pallas_paged's write then decode with ``impl``, on ``device``; numpy arrays into ``results``.

    Each call runs twice: the first time (compile + run) and the second (run) are both recorded.
    """
    x = {name: convert.to_jax(a, device) for name, a in inputs.items()}
    scales = _scales(case, lambda s: convert.to_jax(np.asarray(s, np.float32), device))

    write_impl = None if impl == "mosaic" else impl  # no Mosaic write: write_kv's default

    def write():
        return pallas_paged.write_kv(x["k_cache"], x["v_cache"], x["k"], x["v"], x["slot_mapping"],
                                     **scales, impl=write_impl, interpret=interpret)

    _, timings[f"{impl}.write.first"] = _timed(write, convert.jax_sync)
    (k_cache, v_cache), timings[f"{impl}.write"] = _timed(write, convert.jax_sync)
    results["k_cache"] = convert.from_jax(k_cache)
    results["v_cache"] = convert.from_jax(v_cache)

    attention = pallas_paged.paged_attention if case.ragged else pallas_paged.decode
    ragged = (x["query_start_loc"],) if case.ragged else ()

    def decode():
        return attention(
            x["q"], k_cache, v_cache, x["block_tables"], x["context_lens"], *ragged,
            scale=case.scale, logits_soft_cap=case.logits_soft_cap,
            sliding_window=case.sliding_window, return_lse=case.return_lse, impl=impl,
            interpret=interpret, config=_kernel_config(case) if impl == "pallas" else None,
            **scales, **{k: x[k] for k in _ARRAY_OPTIONS if k in x})

    _, timings[f"{impl}.decode.first"] = _timed(decode, convert.jax_sync)
    res, timings[f"{impl}.decode"] = _timed(decode, convert.jax_sync)
    out, lse = res if case.return_lse else (res, None)
    results["out"] = convert.from_jax(out)
    if lse is not None:
        results["lse"] = convert.from_jax(lse)


def case_outputs(case: Case, device: str = "cpu", *, impls: Sequence[str] = IMPLS,
                 interpret: bool | None = None) -> dict:
    """Every raw array of one case: inputs, expectations, and each implementation's outputs.

    Args:
      case: the case.
      device: ``"cpu"`` or ``"cuda"``, for torch and JAX alike (``"cpu"`` puts the JAX arrays on
        the host even on a GPU machine).
      impls: the JAX implementations to run (``"xla"``, ``"pallas"``); torch_ref always runs.
      interpret: Pallas interpret mode; None means exactly when ``device == "cpu"``.

    Returns:
      A dict with ``"case"``, ``"device"``, ``"inputs"`` (`make_inputs`), ``"expected"`` (the
      written caches, `apply_write`), ``"truth"`` / ``"baseline"`` (float64 decode outputs, see
      `parity.tolerance`), ``"magnitudes"`` (float64, what each element's ulps are counted at,
      `parity.tolerance.magnitudes`), ``"tolerances"``, ``"timings"``, ``"errors"`` (impl ->
      exception text)
      and one dict per implementation (``"torch"``, ``"xla"``, ``"pallas"``) holding whichever of
      ``"k_cache"``, ``"v_cache"``, ``"out"``, ``"lse"`` it produced, as numpy arrays.
    """
    convert.check_device(device)
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        raise ValueError(f"unknown impls {unknown}: choose from {ALL_IMPLS}")
    interpret = (device == "cpu") if interpret is None else bool(interpret)
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}
    start = time.perf_counter()
    inputs = make_inputs(case)
    k_expected, v_expected = apply_write(case, inputs)
    timings["inputs"] = time.perf_counter() - start

    outputs: dict = dict(case=case, device=device, inputs=inputs,
                         expected={"k_cache": k_expected, "v_cache": v_expected})
    runners = {"torch": lambda results: _run_torch(case, inputs, device, timings, results)}
    for impl in impls:
        runners[impl] = lambda results, impl=impl: _run_jax(case, inputs, device, impl, interpret,
                                                            timings, results)
    with convert.ieee_fp32_matmuls():  # torch_ref and the references: no TF32, flags restored
        for name, runner in runners.items():
            outputs[name] = {}
            try:
                runner(outputs[name])
            except Exception as exc:  # an implementation that raises fails its checks
                errors[name] = _describe(exc)

        start = time.perf_counter()
        view = decode_view(case, inputs)  # ragged: one decode row per query
        truth, baseline, tolerances = tolerance.reference_outputs(
            case, view, k_expected, v_expected, device,
            ragged_inputs=inputs if case.ragged else None)
        lse = truth.get("lse")
        if lse is None:
            lse = np.zeros(inputs["q"].shape[:2])
        mags = tolerance.magnitudes(case, view, k_expected, v_expected, lse, device)
        timings["reference"] = time.perf_counter() - start
    rows = view["context_lens"] > 0
    tolerances = {name: tolerance.with_statistics(tol, truth[name], mags[name], rows)
                  for name, tol in tolerances.items()}
    outputs.update(view=view, truth=truth, baseline=baseline, tolerances=tolerances,
                   magnitudes={name: mags[name] for name in truth}, timings=timings,
                   errors=errors, impls=("torch", *impls))
    return outputs


# ------------------------------------------------------------------------------------------------
# Judging.

def mosaic_refusal(case: Case, interpret: bool) -> str | None:
    """Why ``impl="mosaic"`` cannot run ``case`` in the sweep's mode (its ValueError), or None
    when it can.

    The Mosaic GPU kernels take bf16/fp16 queries, head_dim 64, 128, 192 or 256 (the ragged one:
    fp8 caches up to 192) and block sizes that are multiples of 8; interpreted, the ragged one
    needs jax >= 0.12. A sweep with ``--impl mosaic`` runs the cases they take. Only the shapes
    and dtypes matter (the token count of a ragged case does not change the answer: one token
    stands for it). The device itself is checked once per sweep (`mosaic_unavailable`).
    """
    import jax
    from pallas_paged.decode_attention.api import select_kernel as select_decode
    from pallas_paged.ragged_attention.api import select_kernel as select_ragged

    rows = 1 if case.ragged else case.batch
    q = jax.ShapeDtypeStruct((rows, case.num_heads, case.head_dim), case.q_dtype)
    cache = jax.ShapeDtypeStruct((1, case.block_size, case.num_kv_heads, case.head_dim),
                                 case.dtype)
    tables = jax.ShapeDtypeStruct((case.batch, case.table_width), "int32")
    select = select_ragged if case.ragged else select_decode
    try:
        select(q, cache, tables, impl="mosaic", config=None, interpret=interpret)
    except ValueError as e:
        return str(e)
    return None


def _where(index: tuple[int, ...], block_size: int) -> str:
    block, offset, head, dim = index
    return (f"slot {block * block_size + offset} (block {block}, offset {offset}), kv head {head},"
            f" dim {dim}")


def _judge_write(name: str, impl: str, got, expected: np.ndarray, case: Case,
                 inputs: dict) -> Check:
    if got is None:
        return Check(name, impl, False, math.inf, math.inf, 0.0, expected.size,
                     detail="no output")
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return Check(name, impl, False, math.inf, math.inf, 0.0, expected.size,
                     detail=f"got {got.dtype}{list(got.shape)}, expected"
                            f" {expected.dtype}{list(expected.shape)}")
    differ = convert.bits(got) != convert.bits(expected)
    mismatches = int(differ.sum())
    if not mismatches:
        return Check(name, impl, True, 0.0, 0.0, 0.0)
    err = tolerance.abs_errors(got[differ], expected[differ])
    max_err = float(err.max()) if err.size else math.inf
    max_err = max_err if max_err > 0 else math.inf  # differing bits, equal values (e.g. -0.0)
    scale = tolerance.output_scale(expected)
    index = tuple(int(i) for i in np.argwhere(differ)[0])
    slot = index[0] * case.block_size + index[1]
    num_slots = expected.shape[0] * expected.shape[1]
    what = ("the last slot of the cache (where a raw -1 lands)" if slot == num_slots - 1
            else "a slot written this step" if slot in set(inputs["slot_mapping"].tolist())
            else "a slot not written this step")
    rows = np.unique(np.argwhere(differ)[:, :2], axis=0).shape[0]
    detail = (f"{mismatches} elements in {rows} slot(s) differ in their bits; first at"
              f" {_where(index, case.block_size)}, {what}: got"
              f" {float(got[index]):.6g}, expected {float(expected[index]):.6g}")
    return Check(name, impl, False, max_err, max_err / scale if scale else math.inf, 0.0,
                 mismatches, detail=detail)


def _at(index, view: dict) -> str:
    b = index[0]
    return f"{list(index)} (row {b}, attending {int(view['context_lens'][b])} positions)"


def _judge_decode(name: str, impl: str, got, truth: np.ndarray, tol: Tolerance,
                  magnitude: np.ndarray, case: Case, inputs: dict, torch_got) -> Check:
    expected_dtype = case.q_dtype if name == "out" else "float32"
    if got is None:
        return Check(name, impl, False, math.inf, math.inf, tol.value, truth.size,
                     detail="no output")
    if got.dtype.name != expected_dtype or got.shape != truth.shape:
        return Check(name, impl, False, math.inf, math.inf, tol.value, truth.size,
                     detail=f"got {got.dtype.name}{list(got.shape)}, expected"
                            f" {expected_dtype}{list(truth.shape)}")
    rows = inputs["context_lens"] > 0  # the others must be exact zeros / -inf (below)
    got64 = got.astype(np.float64)
    err = tolerance.abs_errors(got, truth)
    max_err = float(err.max()) if err.size else 0.0
    problems = []

    # 1. FlashAttention's rule; a bound that is not finite judges nothing and fails.
    if not tol.finite:
        problems.append(
            f"the tolerance is not finite (tolerance {tol.value:.3g}, bias bound"
            f" {tol.bias_bound:.3g}: the naive {tol.dtype} baseline or the truth overflowed,"
            f" max |baseline - truth| = {tol.baseline_err:.3g}), so it cannot judge this output")
    over = err > tol.value
    mismatches = int(over.sum())
    if mismatches:
        index = tuple(int(i) for i in np.argwhere(err == max_err)[0])
        problems.append(
            f"{mismatches} of {err.size} elements over the tolerance {tol.value:.3g}; worst at"
            f" {_at(index, inputs)}: got {float(got[index]):.6g}, truth {float(truth[index]):.6g}")

    # 2. Finite everywhere but where SPEC.md defines otherwise.
    bad = ~np.isfinite(got64) & rows.reshape(-1, *[1] * (got.ndim - 1))
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        problems.append(f"{int(bad.sum())} non-finite elements in non-empty rows; first at"
                        f" {_at(index, inputs)}: {float(got[index])}")
    if not np.isfinite(truth[rows]).all():
        problems.append("the float64 truth is not finite in a non-empty row")
    zero = 0.0 if name == "out" else -np.inf
    bad_rows = [b for b in np.flatnonzero(~rows).tolist() if not np.all(got64[b] == zero)]
    if bad_rows:
        problems.append(f"zero-length rows {bad_rows} are not exactly {zero}")

    # 3. Elementwise against torch_ref, in ulps of the output dtype at the element's magnitude.
    vs_torch = ulps = None
    if impl != "torch" and torch_got is not None and torch_got.shape == got.shape:
        vs_torch = tolerance.max_abs_error(got, torch_got)
        ulp_dtype = expected_dtype
        u = tolerance.ulps_between(got[rows], torch_got[rows], magnitude[rows], ulp_dtype)
        ulps = float(u.max()) if u.size else 0.0
        if not ulps <= tol.ulp_bound:
            worst = np.argwhere(u == ulps)[0]
            index = (int(np.flatnonzero(rows)[worst[0]]), *(int(i) for i in worst[1:]))
            problems.append(
                f"{int((u > tol.ulp_bound).sum())} elements more than {tol.ulp_bound:g} ulps"
                f" ({ulp_dtype}) from torch_ref; worst {ulps:.3g} ulps at {_at(index, inputs)}:"
                f" got {float(got[index]):.6g}, torch_ref {float(torch_got[index]):.6g},"
                f" magnitude {float(magnitude[index]):.3g}")

    # 4. No systematic bias against the truth.
    signed = got64[rows] - truth[rows]
    with np.errstate(invalid="ignore"):
        bias = float(signed.mean()) if signed.size else 0.0
    if not abs(bias) <= tol.bias_bound and not bad.any():  # NaN / inf: reported above
        problems.append(
            f"systematic bias: mean(out - truth) = {bias:.3g} over {signed.size} elements, beyond"
            f" {tol.bias_bound:.3g} = {tol.bias_sigmas:g} x sigma {tol.bias_sigma:.3g} (rounding to"
            f" {tol.dtype}) + floor {tol.bias_floor:.3g} (fp32 accumulation)")

    rel = max_err / tol.scale if tol.scale else (0.0 if max_err == 0 else math.inf)
    return Check(name, impl, not problems, max_err, rel, tol.value, mismatches, vs_torch,
                 ulps_vs_torch=ulps, ulp_bound=tol.ulp_bound if ulps is not None else None,
                 bias=bias, bias_bound=tol.bias_bound, detail="; ".join(problems))


def judge(outputs: dict) -> CaseResult:
    """The `CaseResult` of `case_outputs`' arrays."""
    case, inputs = outputs["case"], outputs["inputs"]
    checks = []
    for impl in outputs["impls"]:
        got = outputs[impl]
        error = outputs["errors"].get(impl)
        for name in WRITE_OUTPUTS:
            check = _judge_write(name, impl, got.get(name), outputs["expected"][name], case, inputs)
            checks.append(_with_error(check, error, name in got))
        for name, truth in outputs["truth"].items():
            check = _judge_decode(name, impl, got.get(name), truth, outputs["tolerances"][name],
                                  outputs["magnitudes"][name], case, outputs["view"],
                                  outputs["torch"].get(name))
            checks.append(_with_error(check, error, name in got))
    return CaseResult(case=case, device=outputs["device"], checks=checks,
                      tolerances=outputs["tolerances"], timings=outputs["timings"],
                      errors=outputs["errors"])


def _with_error(check: Check, error: str | None, produced: bool) -> Check:
    if error is None or produced:
        return check
    return dataclasses.replace(check, passed=False, detail=f"raised {error}")


def run_case(case: Case, *, device: str = "cpu", impls: Sequence[str] = IMPLS,
             interpret: bool | None = None) -> CaseResult:
    """Write then decode through torch_ref and every impl in ``impls``; judge every output."""
    return judge(case_outputs(case, device, impls=impls, interpret=interpret))


def run_suite(cases: Iterable[Case], *, device: str = "cpu", impls: Sequence[str] = IMPLS,
              interpret: bool | None = None,
              progress: Callable[[int, int, CaseResult, float], None] | None = None,
              impls_of: Callable[[Case], Sequence[str]] | None = None) -> SuiteResult:
    """`run_case` over ``cases`` in order; ``progress(i, total, result, seconds)`` after each.

    ``impls_of(case)``, when given, names the implementations of each case (a subset of
    ``impls``: e.g. without ``mosaic`` where its kernel refuses the case); else every case runs
    ``impls``.
    """
    cases = list(cases)
    start = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        case_start = time.perf_counter()
        result = run_case(case, device=device, impls=impls if impls_of is None else impls_of(case),
                          interpret=interpret)
        results.append(result)
        if progress is not None:
            progress(i, len(cases), result, time.perf_counter() - case_start)
    return SuiteResult(results=results, device=device, impls=tuple(impls),
                       seconds=time.perf_counter() - start)

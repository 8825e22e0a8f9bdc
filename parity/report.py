"""Human- and machine-readable reports of a parity sweep: the table, progress lines, JSON.

The table puts the implementations side by side. Each case opens with a line of its own: its
name, options, the verdict on the writes (``k_cache`` and ``v_cache``, bit for bit), its time and
its verdict (``ok``, or ``FAIL`` and the failed checks). Under it, one row per decode output
(``out``, and ``lse`` with ``return_lse``) gives the output's dtype, the bound of FlashAttention's
rule and the ulp bound ``k``, then, for every implementation side by side, its error against the
float64 truth (``err``), that error over the bound (``ratio``), its distance from torch_ref in
ulps (``ulps``, the JAX impls) and its mean error over the bias bound (``bias``). `LEGEND`,
printed under the table, says what the columns mean. A progress line is the case line's name,
time and verdict with the case's largest ``ratio``, ``ulps`` and ``bias`` cells, under the same
names, so the progress lines and the table agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from parity.cases import SHORT_DTYPES, Case
from parity.compare import CaseResult, Check, SuiteResult
from parity.tolerance import (ATOL, BIAS_FLOOR_ULPS, BIAS_SIGMAS, FACTOR, LSE_ATOL,
                              ULP_BOUND)

__all__ = ["LEGEND", "failure_lines", "fingerprint", "format_table", "progress_line",
           "summary_lines", "to_json"]

DECODE_OUTPUTS = ("out", "lse")
WRITE_OUTPUTS = ("k_cache", "v_cache")
CASE_LINE_HEADER = ("case  options  writes  time  verdict"
                    "    (under each case, a row per decode output)")
ROW_COLUMNS = ("output", "bound", "k")
# The columns of each implementation; torch_ref is the reference of `ulps`, so it has none.
REFERENCE_COLUMNS = ("err", "ratio", "bias")
IMPL_COLUMNS = ("err", "ratio", "ulps", "bias")
# Each rule's column and the `Check` property that holds its value over its bound.
RULE_RATIOS = {"ratio": "ratio", "ulps": "ulp_ratio", "bias": "bias_ratio"}
INDENT = "  "
GROUP_SEPARATOR = " | "


def _constant(x: float) -> str:
    """A rule's constant as the docs write it: ``2**-8``, ``1e-5``."""
    if math.log2(x).is_integer():
        return f"2**{math.log2(x):g}"
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


_BF16, _FP16, _FP32, _LSE = (_constant(x) for x in (ATOL["bfloat16"], ATOL["float16"],
                                                     ATOL["float32"], LSE_ATOL))
_K16 = f"{ULP_BOUND['bfloat16']:g}"
LEGEND = f"""\
err: max|out - truth| against the float64 truth.
ratio: err / bound, FlashAttention's rule (passes at <= 1): bound = {FACTOR:g} x the err of a naive
  baseline computed in the output dtype + atol, atol = {_BF16} x max|truth| for bf16 (one rounding
  of the output at its scale), {_FP16} x max|truth| for fp16, {_FP32} x max|truth| for fp32, and
  {_LSE} x max(1, max|truth|) for lse.
ulps: max|impl - torch_ref| in ulps of the output dtype at each element's magnitude (passes at
  <= k). 16-bit outputs often show 1 of k = {_K16}, an ulp ratio of 0.500: torch_ref and the JAX
  impl each round an fp32 result once, and where their fp32 results (summed in another order; the
  Pallas kernel's softmax weights rounded for the dot) lie on either side of a rounding boundary,
  the two outputs are one ulp apart.
bias: |mean(out - truth)| over the non-empty rows / its bound: {BIAS_SIGMAS:g} sigma of rounding
  every element to the output dtype + {BIAS_FLOOR_ULPS:g} fp32 ulps (passes at <= 1).
writes: k_cache and v_cache after the write, exact (bit for bit) against the expected caches.
-: not run, or not applicable (torch_ref is the reference of ulps)."""


def _scientific(x: float | None) -> str:
    """``1.4e-3``: two significant digits, a short exponent; ``0``, ``inf``, ``nan`` as such."""
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _ratio(r: float | None) -> str:
    """A value over its bound: three decimals below 10, three significant digits above."""
    if r is None:
        return "-"
    return f"{r:.3f}" if r < 10 else f"{r:.3g}"


def _ulps(u: float | None) -> str:
    """Ulps to three significant digits; below a hundredth, ``<0.01``."""
    if u is None:
        return "-"
    return "<0.01" if 0 < u < 0.01 else f"{u:.3g}"


def _cells(check: Check | None, columns: Iterable[str]) -> list[str]:
    """The table's cells of one check (``-`` for every column where there is no check)."""
    if check is None:
        return ["-" for _ in columns]
    cells = {"err": _scientific(check.max_abs_err), "ratio": _ratio(check.ratio),
             "ulps": _ulps(check.ulps_vs_torch), "bias": _ratio(check.bias_ratio)}
    return [cells[column] for column in columns]


def _case_seconds(result: CaseResult) -> float:
    """The time a case took: its inputs, every implementation's calls and the reference."""
    return sum(result.timings.values())


def _verdict(result: CaseResult) -> str:
    """``ok``, or ``FAIL`` and the failed checks' labels (``out[xla]``)."""
    return "ok" if result.passed else "FAIL " + " ".join(c.label for c in result.failures)


def _case_line(result: CaseResult) -> str:
    failed_writes = [c.impl for c in result.failures if c.output in WRITE_OUTPUTS]
    writes = "exact" if not failed_writes else "FAIL " + ",".join(dict.fromkeys(failed_writes))
    return "  ".join([result.case.name, ",".join(result.case.options) or "-", f"writes {writes}",
                      f"{_case_seconds(result):.1f}s", _verdict(result)])


def _output_row(result: CaseResult, output: str, impls: list[str]) -> list[list[str]]:
    """One decode output of a case as groups of cells: the output's own, then one group per
    implementation."""
    tol = result.tolerances[output]
    dtype = "fp32" if output == "lse" else SHORT_DTYPES[result.case.q_dtype]
    groups = [[f"{output} {dtype}", _scientific(tol.value), f"{tol.ulp_bound:g}"]]
    for impl in impls:
        check = next((c for c in result.checks if (c.output, c.impl) == (output, impl)), None)
        groups.append(_cells(check, REFERENCE_COLUMNS if impl == "torch" else IMPL_COLUMNS))
    return groups


def _span(widths: list[int]) -> int:
    """The width of a group of columns one space apart."""
    return sum(widths) + len(widths) - 1


def format_table(results: list[CaseResult]) -> str:
    """The implementations side by side: a two-line header, then a line per case with a row per
    decode output under it (the module docstring), then `LEGEND`."""
    impls = list(dict.fromkeys(c.impl for r in results for c in r.checks))  # torch first
    names = [list(ROW_COLUMNS)]
    names += [list(REFERENCE_COLUMNS if impl == "torch" else IMPL_COLUMNS) for impl in impls]
    blocks = [(_case_line(r), [_output_row(r, output, impls) for output in DECODE_OUTPUTS
                               if output in r.tolerances]) for r in results]
    rows = [names, *(groups for _, block in blocks for groups in block)]
    widths = [[max(len(row[g][i]) for row in rows) for i in range(len(group))]
              for g, group in enumerate(names)]
    titles = ["", *impls]
    for group_widths, title in zip(widths, titles):  # the implementation's name fits above
        group_widths[-1] += max(0, len(title) - _span(group_widths))

    def line(groups: list[list[str]]) -> str:
        cells = [" ".join(cell.ljust(w) for cell, w in zip(group, group_widths))
                 for group, group_widths in zip(groups, widths)]
        return (INDENT + GROUP_SEPARATOR.join(cells)).rstrip()

    titles_line = (INDENT + GROUP_SEPARATOR.join(
        title.ljust(_span(group_widths)) for title, group_widths in zip(titles, widths))).rstrip()
    names_line = line(names)
    rule = INDENT + "-" * (len(names_line) - len(INDENT))
    body = []
    for case_line, block in blocks:
        body.append(case_line)
        body.extend(line(groups) for groups in block)
    return "\n".join([CASE_LINE_HEADER, titles_line, names_line, rule, *body, rule, LEGEND])


def failure_lines(results: list[CaseResult]) -> list[str]:
    """One line per failed check: ``FAIL <case> <output>[<impl>]: errors and what went wrong``."""
    lines = []
    for r in results:
        for c in r.failures:
            err = f"max_abs_err={c.max_abs_err:.3g} tolerance={c.tolerance:.3g}"
            lines.append(f"FAIL {r.case.name} {c.label}: {err}; {c.detail}")
    return lines


def _rule_ratio(check: Check, rule: str) -> float | None:
    return getattr(check, RULE_RATIOS[rule])


def _largest(checks: Iterable[Check], rule: str) -> Check | None:
    """The decode check with the largest value of ``rule`` over its bound (`RULE_RATIOS`), or
    None where no check has one."""
    rated = [c for c in checks if c.output in DECODE_OUTPUTS and _rule_ratio(c, rule) is not None]
    return max(rated, key=lambda c: _rule_ratio(c, rule), default=None)


def _largest_text(check: Check | None, rule: str) -> str:
    """``ratio 0.182``, ``ulps 1 (k 2)``, ``bias 0.194``: a table cell under its column name."""
    if check is None:
        return f"{rule} -"
    if rule == "ulps":
        return f"ulps {_ulps(check.ulps_vs_torch)} (k {check.ulp_bound:g})"
    return f"{rule} {_cells(check, [rule])[0]}"


def progress_line(i: int, total: int, result: CaseResult) -> str:
    """``[i/N] <case>  <time>  ratio R  ulps U (k K)  bias B  <verdict>``: the case line's time and
    verdict, and the largest ``ratio``, ``ulps`` (by ulps / k) and ``bias`` cells of its rows."""
    largest = "  ".join(_largest_text(_largest(result.checks, rule), rule) for rule in RULE_RATIOS)
    return (f"[{i + 1:>{len(str(total))}}/{total}] {result.case.name}"
            f"  {_case_seconds(result):.1f}s  {largest}  {_verdict(result)}")


def summary_lines(suite: SuiteResult) -> list[str]:
    """``PASSED|FAILED: cases and checks passed``, then the largest cell of each rule over the
    sweep, with its case and check."""
    results = suite.results
    checks = [c for r in results for c in r.checks]
    failed = [c for c in checks if not c.passed]
    verdict = "PASSED" if suite.passed else "FAILED"
    lines = [f"{verdict}: {len(results) - len(suite.failed)}/{len(results)} cases passed,"
             f" {len(checks) - len(failed)}/{len(checks)} checks passed on {suite.device}"
             f" (impls: torch, {', '.join(suite.impls)}); {suite.seconds:.1f}s"]
    for rule in RULE_RATIOS:
        found = [(r, c) for r in results if (c := _largest(r.checks, rule)) is not None]
        if found:
            r, c = max(found, key=lambda pair: _rule_ratio(pair[1], rule))
            lines.append(f"largest {_largest_text(c, rule)}: {r.case.name} {c.label}")
    return lines


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else str(x)  # "inf", "-inf", "nan": JSON has no such numbers
    if isinstance(x, np.integer):
        return int(x)
    return x


def to_json(suite: SuiteResult, *, suite_name: str, argv: list[str] | None = None) -> str:
    """The whole sweep as JSON: environment, tolerance rule, every case's checks and timings.

    Non-finite floats are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``.
    """
    import jax
    import torch

    doc = dict(
        passed=suite.passed,
        summary="; ".join(summary_lines(suite)),
        suite=suite_name,
        argv=argv,
        device=suite.device,
        impls=["torch", *suite.impls],
        seconds=suite.seconds,
        environment=dict(python=sys.version.split()[0], platform=platform.platform(),
                         numpy=np.__version__, torch=torch.__version__, jax=jax.__version__,
                         jax_devices=[str(d) for d in jax.devices()],
                         torch_cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                         else None),
        tolerance_rule=dict(rule="max|out - truth| <= factor * max|baseline - truth| + atol",
                            factor=FACTOR, atol_relative_to_output_scale=ATOL, lse_atol=LSE_ATOL,
                            ulp_rule="|impl - torch_ref| <= ulp_bound * ulp(max(|torch_ref|,"
                                     " magnitude)), JAX impls, non-empty rows",
                            ulp_bound=ULP_BOUND,
                            bias_rule="|mean(out - truth)| <= bias_sigmas * sigma + bias_floor_ulps"
                                      " * mean(ulp_fp32(magnitude)), non-empty rows",
                            bias_sigmas=BIAS_SIGMAS, bias_floor_ulps=BIAS_FLOOR_ULPS),
        cases=[r.to_dict() for r in suite.results],
        failures=failure_lines(suite.results),
    )
    return json.dumps(_jsonable(doc), indent=1, allow_nan=False)


def fingerprint(cases: Iterable[Case]) -> str:
    """A short digest of what a report of ``cases`` shows apart from what it measures.

    It covers the cases' definitions (every field, so a case added, renamed or changed counts),
    the rules' constants and the source of this module (the table's format). A report stored with
    it, such as the outputs of ``notebooks/parity.ipynb``, is stale when the digest computed now
    differs: run it again.
    """
    parts = [repr(tuple(cases)),
             repr((FACTOR, ATOL, LSE_ATOL, ULP_BOUND, BIAS_SIGMAS, BIAS_FLOOR_ULPS)),
             Path(__file__).read_text()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

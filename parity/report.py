"""Human- and machine-readable reports of a parity sweep: progress lines, the table, JSON."""

from __future__ import annotations

import json
import math
import platform
import sys

import numpy as np

from parity.compare import CaseResult, Check, SuiteResult
from parity.tolerance import (ATOL, BIAS_FLOOR_ULPS, BIAS_SIGMAS, FACTOR, LSE_ATOL,
                              ULP_BOUND)

__all__ = ["failure_lines", "format_table", "progress_line", "summary_line", "to_json"]

OUTPUTS = ("k_cache", "v_cache", "out", "lse")
# Table columns beyond the outputs: the worst ratio of each statistic over the decode checks.
STATISTICS = {"ulp": "ulp_ratio", "bias": "bias_ratio"}


def _format_ratio(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:.3f}" if r < 10 else f"{r:.3g}"


def _ratio(check: Check) -> str:
    return _format_ratio(check.ratio)


def cell(result: CaseResult, output: str) -> str:
    """One table cell: the worst error/tolerance ratio of ``output`` over the impls.

    Writes read ``exact`` or ``FAIL <impls>``; decode outputs the ratio (``<= 1`` passes), with
    ``FAIL`` and the failing impls when any fails; ``-`` when the case has no such output.
    """
    checks = [c for c in result.checks if c.output == output]
    if not checks:
        return "-"
    failed = [c.impl for c in checks if not c.passed]
    if output in ("k_cache", "v_cache"):
        return "exact" if not failed else "FAIL " + ",".join(failed)
    worst = result.worst(output)
    if failed:
        return f"FAIL {_ratio(worst)} " + ",".join(failed)
    return _ratio(worst)


def statistic_cell(result: CaseResult, attribute: str) -> str:
    """The worst ``ulp_ratio`` / ``bias_ratio`` over the decode checks (``<= 1`` passes)."""
    values = [getattr(c, attribute) for c in result.checks if c.output in ("out", "lse")]
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    worst = max(values)
    return _format_ratio(worst) if worst <= 1 else f"FAIL {_format_ratio(worst)}"


def format_table(results: list[CaseResult]) -> str:
    """One row per case: name, cache dtype, options, the worst ratio per output (FlashAttention's
    rule), the worst ulp ratio against torch_ref and bias ratio, time, verdict."""
    header = ("case", "dtype", "options", *OUTPUTS, *STATISTICS, "time", "")
    rows = []
    for r in results:
        seconds = sum(v for k, v in r.timings.items())
        rows.append((r.case.name, r.case.dtype, ",".join(r.case.options) or "-",
                     *(cell(r, o) for o in OUTPUTS),
                     *(statistic_cell(r, a) for a in STATISTICS.values()), f"{seconds:.1f}s",
                     "ok" if r.passed else "FAIL"))
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(row):
        return "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def failure_lines(results: list[CaseResult]) -> list[str]:
    """One line per failed check: ``FAIL <case> <output>[<impl>]: errors and what went wrong``."""
    lines = []
    for r in results:
        for c in r.failures:
            err = f"max_abs_err={c.max_abs_err:.3g} tolerance={c.tolerance:.3g}"
            lines.append(f"FAIL {r.case.name} {c.label}: {err}; {c.detail}")
    return lines


def progress_line(i: int, total: int, result: CaseResult, seconds: float) -> str:
    width = len(str(total))
    ratio = max((c.worst_ratio for c in result.checks if c.output in ("out", "lse")),
                default=0.0)
    verdict = "ok" if result.passed else "FAIL " + " ".join(c.label for c in result.failures)
    return (f"[{i + 1:>{width}}/{total}] {result.case.name:<44} {verdict}"
            f"  (worst ratio {ratio:.3f}, {seconds:.1f}s)")


def summary_line(suite: SuiteResult) -> str:
    results = suite.results
    checks = [c for r in results for c in r.checks]
    failed = [c for c in checks if not c.passed]
    decode = [(r, c) for r in results for c in r.checks if c.output in ("out", "lse")]
    worst_text = ""
    for what, key in (("decode ratio", lambda c: c.ratio),
                      ("ulp ratio", lambda c: c.ulp_ratio),
                      ("bias ratio", lambda c: c.bias_ratio)):
        rated = [(key(c), r, c) for r, c in decode if key(c) is not None]
        if rated:
            value, r, c = max(rated, key=lambda x: x[0])
            worst_text += f"; worst {what} {_format_ratio(value)} ({r.case.name} {c.label})"
    verdict = "PASSED" if suite.passed else "FAILED"
    return (f"{verdict}: {len(results) - len(suite.failed)}/{len(results)} cases passed,"
            f" {len(checks) - len(failed)}/{len(checks)} checks passed on {suite.device}"
            f" (impls: torch, {', '.join(suite.impls)}){worst_text}; {suite.seconds:.1f}s")


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
        summary=summary_line(suite),
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

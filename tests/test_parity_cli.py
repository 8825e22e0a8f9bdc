"""``python -m parity`` as its users meet it: the table, the exit statuses, the docs, the notebook.

- The table puts every implementation side by side under named columns, fits 120 columns for the
  whole full suite with all four implementations, and agrees with the progress lines (made-up
  results, so no implementation runs; one real run of a small case checks the same end to end).
- Usage errors (a flag this machine cannot honour, a bad value) exit 2 with a message naming the
  flag, before any case runs; a reader that closes the pipe ends the run quietly with 141.
- docs/PARITY.md states the suites' real sizes.
- notebooks/parity.ipynb is committed with outputs that match the code: its last cell stamps the
  suite, the report's format and its own code cells, which the test recomputes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from parity import __main__ as cli
from parity import cases, report
from parity.cases import Case
from parity.compare import CaseResult, Check, SuiteResult
from parity.tolerance import ULP_BOUND, Tolerance

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "parity.ipynb"
SMALL_CASE = "mqa_h8_d64_bs3_fp16"  # one of the quickest default cases, 16-bit
RERUN_NOTEBOOK = "run `jupyter execute --inplace notebooks/parity.ipynb` and commit it"


def _environment() -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def _parity(*args: str, **popen) -> subprocess.Popen:
    """``python -m parity ARGS`` in a child process, from the repository root."""
    return subprocess.Popen([sys.executable, "-m", "parity", *args], cwd=ROOT, env=_environment(),
                            text=True, **popen)


# ------------------------------------------------------------------------------------------------
# The table, from made-up results.

def made_up_result(case: Case, impls=("xla", "pallas"), failing=()) -> CaseResult:
    """A `CaseResult` of ``case`` with typical numbers, distinct per implementation, and the
    checks named in ``failing`` (``(output, impl)`` pairs) failed; nothing runs."""
    outputs = ("out", "lse") if case.return_lse else ("out",)
    tolerances = {}
    for output in outputs:
        dtype = "float32" if output == "lse" else case.q_dtype
        tolerances[output] = Tolerance(
            output=output, dtype=dtype, baseline_err=1e-2, atol=3.9e-3, scale=1.0,
            ulp_bound=ULP_BOUND["lse" if output == "lse" else dtype], bias_sigma=1e-4,
            bias_floor=1e-6)
    checks = []
    for n, impl in enumerate(("torch", *impls)):
        for output in ("k_cache", "v_cache"):
            checks.append(Check(output, impl, (output, impl) not in failing, 0.0, 0.0, 0.0))
        for output in outputs:
            tol = tolerances[output]
            err = tol.value * (0.1 + 0.05 * n)
            ulps = None if impl == "torch" else float(n)
            checks.append(Check(
                output, impl, (output, impl) not in failing, err, err, tol.value,
                ulps_vs_torch=ulps, ulp_bound=None if ulps is None else tol.ulp_bound,
                bias=tol.bias_bound * (0.2 + 0.1 * n), bias_bound=tol.bias_bound))
    return CaseResult(case=case, device="cpu", checks=checks, tolerances=tolerances,
                      timings={"inputs": 0.1, "reference": 0.2})


def parse_table(text: str) -> tuple[list[str], list[list[str]], dict]:
    """``(titles, column names, cells)`` of `report.format_table`'s text: the implementations'
    titles, each group's column names, and ``{(case, output, impl): {column: cell}}`` (with the
    row's ``k``)."""
    lines = text.splitlines()
    titles = [title.strip() for title in lines[1].split(" | ")][1:]
    names = [group.split() for group in lines[2].split(" | ")]
    assert set(lines[3].strip()) == {"-"}, lines[3]
    cells, case = {}, None
    for line in lines[4:]:
        if set(line.strip()) == {"-"}:
            break
        if not line.startswith(" "):  # a case line
            case = line.split()[0]
            continue
        groups = [group.split() for group in line.split(" | ")]
        assert [len(g) for g in groups[1:]] == [len(n) for n in names[1:]], line  # all headed
        for impl, columns, group in zip(titles, names[1:], groups[1:]):
            cells[(case, groups[0][0], impl)] = dict(zip(columns, group), k=groups[0][-1])
    return titles, names, cells


def test_the_table_puts_the_implementations_side_by_side_under_named_columns():
    fp32_lse, bf16 = (next(c for c in cases.DEFAULT_SUITE if c.name == name)
                      for name in ("mha_h4_d64_bs5_fp32_lse", "gqa2_h4_d64_bs16_bf16"))
    results = [made_up_result(fp32_lse, impls=("xla", "pallas", "mosaic")),
               made_up_result(bf16, impls=("xla", "pallas"))]  # mosaic left out of this one
    text = report.format_table(results)
    titles, names, cells = parse_table(text)
    assert titles == ["torch", "xla", "pallas", "mosaic"]
    assert names == [["output", "bound", "k"], ["err", "ratio", "bias"],
                     *[["err", "ratio", "ulps", "bias"]] * 3]
    for r in results:
        for c in r.checks:
            if c.output not in ("out", "lse"):
                continue
            got = cells[(r.case.name, c.output, c.impl)]
            assert got["err"] == f"{c.max_abs_err:.1e}".replace("e-0", "e-")
            assert got["ratio"] == f"{c.ratio:.3f}" and got["bias"] == f"{c.bias_ratio:.3f}"
            if c.impl != "torch":
                assert got["ulps"] == f"{c.ulps_vs_torch:g}"
    left_out = cells[(bf16.name, "out", "mosaic")]
    assert {left_out[column] for column in names[-1]} == {"-"} and left_out["k"] == "2"
    assert (fp32_lse.name, "lse", "xla") in cells and (bf16.name, "lse", "xla") not in cells
    assert text.endswith(report.LEGEND)
    assert "an ulp ratio of 0.500" in report.LEGEND and "one ulp apart" in report.LEGEND


def test_the_whole_full_suite_with_four_implementations_fits_120_columns():
    results = [made_up_result(c, impls=("xla", "pallas", "mosaic")) for c in cases.FULL_SUITE]
    suite = SuiteResult(results, device="cuda", impls=("xla", "pallas", "mosaic"), seconds=1.0)
    lines = report.format_table(results).splitlines()
    lines += [report.progress_line(i, len(results), r) for i, r in enumerate(results)]
    lines += report.summary_lines(suite)
    too_wide = [line for line in lines if len(line) > 120]
    assert not too_wide, too_wide[:3]
    default = [made_up_result(c) for c in cases.DEFAULT_SUITE]
    assert max(map(len, report.format_table(default).splitlines())) <= 100


def _progress_numbers(line: str) -> dict[str, str]:
    found = re.search(r"ratio (\S+)  ulps (\S+) \(k (\S+)\)  bias (\S+)", line)
    return dict(zip(("ratio", "ulps", "k", "bias"), found.groups()))


def _largest_cells(cells: dict, case: str, column: str) -> str:
    """The largest cell of ``column`` in the case's rows; ulps by ulps / k, as the rule goes."""
    rows = [row for (name, _, _), row in cells.items()
            if name == case and row.get(column, "-") != "-"]
    by_ratio = {"ulps": lambda row: float(row["ulps"].lstrip("<")) / float(row["k"])}
    return max(rows, key=by_ratio.get(column, lambda row: float(row[column])))[column]


def test_progress_lines_show_the_tables_largest_cells():
    results = [made_up_result(c) for c in cases.DEFAULT_SUITE[:6]]
    _, _, cells = parse_table(report.format_table(results))
    for i, r in enumerate(results):
        line = report.progress_line(i, len(results), r)
        assert line.startswith(f"[{i + 1}/{len(results)}] {r.case.name}  ") and line.endswith(" ok")
        shown = _progress_numbers(line)
        for column in ("ratio", "ulps", "bias"):
            assert shown[column] == _largest_cells(cells, r.case.name, column), (line, column)


def test_a_failed_check_is_named_on_its_case_line_and_progress_line():
    case = next(c for c in cases.DEFAULT_SUITE if c.name == SMALL_CASE)
    r = made_up_result(case, failing={("out", "xla"), ("k_cache", "pallas")})
    case_line = next(line for line in report.format_table([r]).splitlines()
                     if line.startswith(case.name))
    assert "writes FAIL pallas" in case_line
    assert case_line.endswith("FAIL out[xla] k_cache[pallas]")
    assert report.progress_line(0, 1, r).endswith("FAIL out[xla] k_cache[pallas]")
    suite = SuiteResult([r], device="cpu", impls=("xla", "pallas"), seconds=1.0)
    assert report.summary_lines(suite)[0].startswith("FAILED: 0/1 cases passed")


def test_the_json_report_keeps_its_fields():
    case = next(c for c in cases.DEFAULT_SUITE if c.name == SMALL_CASE)
    suite = SuiteResult([made_up_result(case)], device="cpu", impls=("xla", "pallas"), seconds=1.0)
    doc = json.loads(report.to_json(suite, suite_name="default", argv=["-k", SMALL_CASE]))
    assert {"passed", "summary", "suite", "argv", "device", "impls", "seconds", "environment",
            "tolerance_rule", "cases", "failures"} <= doc.keys()
    assert isinstance(doc["summary"], str) and doc["summary"].startswith("PASSED: 1/1 cases")
    check = doc["cases"][0]["checks"][2]
    assert {"output", "impl", "passed", "max_abs_err", "max_rel_err", "tolerance", "mismatches",
            "vs_torch", "ulps_vs_torch", "ulp_bound", "bias", "bias_bound", "detail", "label",
            "ratio", "ulp_ratio", "bias_ratio"} <= check.keys()


def test_a_run_shows_the_same_numbers_in_progress_and_table(capsys):
    assert cli.main(["--device", "cpu", "-k", SMALL_CASE]) == 0
    captured = capsys.readouterr()
    progress = next(line for line in captured.err.splitlines() if line.startswith("[1/1] "))
    _, _, cells = parse_table(captured.out)
    assert {impl for _, _, impl in cells} == {"torch", "xla", "pallas"}
    shown = _progress_numbers(progress)
    for column in ("ratio", "ulps", "bias"):
        assert shown[column] == _largest_cells(cells, SMALL_CASE, column), (progress, column)
    assert "PASSED: 1/1 cases passed" in captured.out


def test_the_fingerprint_changes_with_the_cases():
    suite = cases.DEFAULT_SUITE
    reseeded = (dataclasses.replace(suite[0], seed=suite[0].seed + 1), *suite[1:])
    digests = {report.fingerprint(s) for s in (suite, suite[:-1], reseeded)}
    assert len(digests) == 3 and report.fingerprint(suite) == report.fingerprint(list(suite))


# ------------------------------------------------------------------------------------------------
# Exit statuses.

@pytest.mark.parametrize("argv, flag", [
    (["--seed", "-1"], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--json", "/no-such-directory/report.json", "-k", SMALL_CASE], "--json"),
    (["--json", "/", "-k", SMALL_CASE], "--json"),
    (["--device", "cpu", "--no-interpret", "-k", SMALL_CASE], "--no-interpret needs a GPU"),
])
def test_bad_flags_exit_2_naming_the_flag_before_any_case_runs(argv, flag, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert flag in err and "error" in err and "[1/1]" not in err


def test_no_interpret_without_a_gpu_is_a_usage_error():
    from parity import convert

    if convert.default_device() == "cuda":
        pytest.skip("a GPU is visible: --no-interpret runs the compiled kernels")
    proc = _parity("--no-interpret", "-k", SMALL_CASE, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == cli.EXIT_USAGE, out + err
    assert "python -m parity: error: --no-interpret needs a GPU" in err
    assert "Traceback" not in err and not out


def test_impl_mosaic_where_its_kernel_cannot_run_says_why(capsys):
    why = cli.mosaic_unavailable(interpret=True)
    if why is None:
        pytest.skip("the Mosaic kernel runs here (interpret mode)")
    assert cli.main(["--device", "cpu", "--impl", "mosaic", "-k", SMALL_CASE]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert ("--impl mosaic cannot run here, so impl=mosaic takes none of the selected cases:"
            f" {why}") in err


def test_a_closed_pipe_ends_the_run_quietly_with_141():
    proc = _parity("--full", "--list", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first name is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == cli.EXIT_CLOSED_PIPE == 141
    assert err == ""


def test_list_into_head_prints_its_lines_and_no_traceback():
    script = '"$0" -m parity --full --list | head -3; echo "status ${PIPESTATUS[0]}" >&2'
    proc = subprocess.run(["bash", "-c", script, sys.executable], cwd=ROOT, env=_environment(),
                          text=True, capture_output=True, timeout=60)
    assert proc.stdout.splitlines() == [c.name for c in cases.FULL_SUITE[:3]]
    assert re.fullmatch(r"status (0|141)\n", proc.stderr), proc.stderr  # 0: it wrote in time


# ------------------------------------------------------------------------------------------------
# docs/PARITY.md and the notebook.

def _listed(capsys, *argv: str) -> list[str]:
    assert cli.main(["--list", *argv]) == 0
    return capsys.readouterr().out.split()


def test_parity_md_states_the_suites_sizes(capsys):
    text = (ROOT / "docs" / "PARITY.md").read_text()
    for suite, argv in (("DEFAULT_SUITE", ()), ("FULL_SUITE", ("--full",))):
        stated = re.findall(rf"`{suite}` \((\d+) ", text)
        listed = len(_listed(capsys, *argv))
        assert stated and all(int(n) == listed for n in stated), (
            f"docs/PARITY.md says {suite} has {stated} cases; `python -m parity --list"
            f" {' '.join(argv)}` lists {listed}")


def _notebook_stamp(notebook: dict) -> dict:
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            found = re.search(r"freshness stamp: (\{.*\})", "".join(output.get("text", "")))
            if found:
                return json.loads(found.group(1))
    raise AssertionError(f"notebooks/parity.ipynb has no freshness stamp: {RERUN_NOTEBOOK}")


def test_the_notebook_is_committed_with_outputs_fresh_for_this_code():
    notebook = json.loads(NOTEBOOK.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1)), (
        f"the notebook's cells did not run once each, top to bottom: {RERUN_NOTEBOOK}")
    outputs = [output for cell in code for output in cell["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is not stored"
    assert NOTEBOOK.stat().st_size < 1_000_000
    sources = "\n".join("".join(cell["source"]).strip() for cell in code)
    expected = dict(default_suite_cases=len(cases.DEFAULT_SUITE),
                    fingerprint=report.fingerprint(cases.DEFAULT_SUITE),
                    code=hashlib.sha256(sources.encode()).hexdigest()[:16])
    assert _notebook_stamp(notebook) == expected, (
        f"the notebook's outputs were made from other cases, another report format or other"
        f" code cells: {RERUN_NOTEBOOK}")

r"""An Nsight Compute source page, summed by SASS opcode: where a kernel's instructions and its
warps' stall samples go.

    ncu ... --section SourceCounters --section WarpStateStats -o REPORT \
        python -m benchmarks.profiling.profile_kernel --shape S
    ncu -i REPORT --page source --csv --print-source sass > source.csv
    python -m benchmarks.profiling.ncu_opcodes source.csv [--top 20]

Every numeric column of the page (instructions executed, stall samples, ...) is summed over the
instructions of each opcode (the SASS mnemonic without its predicate, e.g. ``LDS.U8``); the table
lists the opcodes with the most instructions executed, each column also as a share of its total.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

INSTRUCTIONS = "Instructions Executed"
STALLS = "Warp Stall Sampling (All Samples)"
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def opcode(source: str) -> str:
    """The mnemonic of a SASS line (``@P0 LDS.U8 R1, [R2]`` -> ``LDS.U8``); '' for none."""
    text = _PREDICATE.sub("", source.strip())
    return text.split(" ", 1)[0].rstrip(";") if text else ""


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """``(per_opcode, totals)``: ``per_opcode[op][column]`` and ``totals[column]``, summed over
    the rows (instructions) of each opcode, for every column that holds numbers."""
    per_opcode: dict = defaultdict(lambda: defaultdict(float))
    totals: dict = defaultdict(float)
    for row in rows:
        op = opcode(row.get("Source", ""))
        if not op:
            continue
        for column, text in row.items():
            if column in ("Address", "Source") or text is None:
                continue
            value = _number(text)
            if value is not None:
                per_opcode[op][column] += value
                totals[column] += value
    return per_opcode, totals


def read_source_page(path: str) -> list[dict]:
    """The rows of ``ncu --page source --csv --print-source sass`` (lines before the header,
    e.g. ncu's own messages, are skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no ncu source page header (a line starting with \"Address\")")
    return list(csv.DictReader(lines[start:]))


def table(per_opcode: dict, totals: dict, top: int) -> str:
    columns = [c for c in (INSTRUCTIONS, STALLS) if totals.get(c)]
    head = "| opcode | " + " | ".join(columns) + " |"
    lines = [head, "|---|" + "---:|" * len(columns)]
    ranked = sorted(per_opcode, key=lambda op: -per_opcode[op].get(columns[0], 0.0)) if columns \
        else sorted(per_opcode)
    for op in ranked[:top]:
        cells = [f"{per_opcode[op].get(c, 0.0):,.0f} ({per_opcode[op].get(c, 0.0) / totals[c]:.1%})"
                 for c in columns]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"{totals[c]:,.0f}" for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    try:
        rows = read_source_page(args.csv)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_opcode, totals = summarize(rows)
    print(table(per_opcode, totals, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

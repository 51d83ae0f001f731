"""Plain-text report tables, cell formats and CSV files shared by the benchmarks (the table and the
CSV writer themselves are :mod:`tools.tables`'s, shared with the runtime model)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from tools.tables import print_table, write_csv

__all__ = ["cell", "check_choices", "csv_list", "fmt", "mib", "percentile", "print_table", "print_targets",
           "write_csv", "write_outputs"]


def fmt(x: Optional[float], spec: str, suffix: str = "") -> str:
    """``x`` formatted with ``spec`` (and ``suffix``); '-' when there is no value (a table cell)."""
    return "-" if x is None else format(x, spec) + suffix


def cell(x: Optional[float], spec: str) -> str:
    """``x`` formatted with ``spec``; empty when there is no value (a CSV field)."""
    return "" if x is None else format(x, spec)


def mib(nbytes: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{nbytes / 2**20:.2f}"


def percentile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation, as numpy's default); NaN when empty."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def csv_list(s: str) -> List[str]:
    """A comma-separated command-line value as its non-empty items."""
    return [x.strip() for x in s.split(",") if x.strip()]


def write_outputs(out_dir: Path, name: str, fields: Sequence[str], rows: Iterable[Dict[str, Any]],
                  plot: Optional[Callable[[Path], Optional[Path]]] = None) -> None:
    """A benchmark's files: ``<name>.csv`` in ``out_dir`` (:func:`write_csv`) and, where ``plot`` is
    given, ``<name>.png`` drawn by ``plot(path)`` (which returns None without matplotlib); each
    file written is printed."""
    csv_path = Path(out_dir) / f"{name}.csv"
    write_csv(csv_path, fields, rows)
    print(f"wrote {csv_path}")
    if plot is not None:
        png = plot(Path(out_dir) / f"{name}.png")
        if png is not None:
            print(f"wrote {png}")


def print_targets(targets: Sequence[Sequence[Any]]) -> None:
    """The benchmark's targets, one line each: ``(title, ok, detail)`` with ``ok`` True (met), False
    (not met) or None (not measured in this run)."""
    if not targets:
        return
    print("\ntargets:")
    for title, ok, detail in targets:
        tag = "not measured" if ok is None else ("met" if ok else "NOT MET")
        print(f"  [{tag}] {title}: {detail}")


def check_choices(values: Iterable[str], allowed: Sequence[str], what: str) -> None:
    """Exit with a message naming the first of ``values`` that is not in ``allowed``."""
    for v in values:
        if v not in allowed:
            raise SystemExit(f"unknown {what} {v!r}; choose from {', '.join(allowed)}")

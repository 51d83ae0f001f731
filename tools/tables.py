"""Plain-text tables and CSV files, for the benchmarks (``bench.common.tables`` builds on these) and
the runtime model's command line."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

__all__ = ["print_table", "write_csv"]


def print_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                group: Optional[Callable[[Sequence[str]], object]] = None) -> None:
    """Right-aligned columns; a blank line between rows whose ``group(row)`` differs."""
    table = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in table)) if table else len(h) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    last = None
    for i, r in enumerate(table):
        key = group(r) if group is not None else None
        if i > 0 and key != last:
            print()
        last = key
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def write_csv(path: Path, fields: Sequence[str], rows: Iterable[Dict[str, Any]]) -> None:
    """``rows`` (dicts keyed by ``fields``) as a CSV file with a header; the folder is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(fields))
        wr.writeheader()
        wr.writerows(rows)

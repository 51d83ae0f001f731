"""Running a benchmark script in its quick mode for a smoke test: one subprocess, its CSV read back.

Shared by the bench smoke tests (bench_train, bench_shard, bench_pipe): each asserts the run
succeeded, printed the words its output must contain, and wrote a CSV with the columns it needs.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: str, args: Sequence[str], out: Path, csv_name: str, columns: Iterable[str],
              words: Sequence[str], timeout: float) -> Tuple[str, List[Dict[str, str]]]:
    """Run ``bench/<script> args --out out`` as the module ``bench.<name>`` from the repository root
    (as ``make`` does; one torch thread per worker); its stdout and CSV rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", f"bench.{Path(script).stem}", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for word in words:
        assert word in proc.stdout, proc.stdout
    path = out / csv_name
    assert path.is_file(), proc.stdout
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or [])
        rows = list(reader)
    missing = set(columns) - cols
    assert not missing, f"missing columns {sorted(missing)} in {sorted(cols)}"
    return proc.stdout, rows

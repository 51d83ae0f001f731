"""The tests' helpers around worker processes: the spawn harness (:mod:`tools.spawn`, shared with
the benchmarks), a one-process group, torchrun, and an example's ``main`` inside a worker.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
from typing import Any, Dict, Iterator, Sequence

from tools.spawn import WorkerError, run_workers

__all__ = ["WorkerError", "run_workers", "single_process_group", "torchrun", "run_example_main"]


@contextlib.contextmanager
def single_process_group(backend: str) -> Iterator[None]:
    """A world of one process in this process (HashStore: no sockets); destroyed on exit. Skips the
    test when a default group already exists here."""
    import pytest
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrun(script: str, nproc: int, env: Dict[str, str], timeout: float,
             args: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` on this interpreter, one torch thread per worker."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **env)
    full.pop("LOCAL_WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
           *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout)


def run_example_main(filename: str, argv: Sequence[str]) -> Any:
    """Load ``examples/<filename>`` as a module and return ``main(argv)`` (inside a worker: the
    examples keep a process group that is already initialized)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", filename)
    spec = importlib.util.spec_from_file_location(os.path.splitext(filename)[0], path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look the module up by name
    spec.loader.exec_module(module)
    return module.main(list(argv))

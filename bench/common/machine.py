"""The machine a benchmark ran on: every benchmark prints it first, and its CSV rows carry the CPU,
core count and torch version, since the figures only compare within one run on one machine."""

from __future__ import annotations

import os
import platform
from typing import Dict

__all__ = ["report_machine"]


def _package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - any failure: not installed as far as this run is concerned
        return "not installed"


def report_machine(*references: str) -> Dict[str, str]:
    """Print the ``machine:`` line and return its fields: CPU, cores, torch, decentpy, the versions
    of the ``references`` (PyPI names of the frameworks compared, e.g. 'decent-dp', 'fairscale';
    key: the name with '_' for '-'), Python, the load average before the run and the platform."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import decentpy

        dp_version = decentpy.__version__
    except Exception:  # pragma: no cover
        dp_version = "?"
    try:
        load = "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "?"
    machine = dict(cpu=cpu, cores=str(os.cpu_count()), torch=torch.__version__, decentpy=dp_version,
                   **{name.replace("-", "_"): _package_version(name) for name in references},
                   python=platform.python_version(), load_before=load, platform=platform.platform())
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    return machine

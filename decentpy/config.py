"""Build and runtime configuration report (``decentpy.show_config()`` / ``python -m decentpy``)."""

from __future__ import annotations

import platform
import sys
from typing import Any, Dict, List, Optional, TextIO, Tuple

__all__ = ["show_config", "config_report"]


def _yes_no(flag: Any) -> str:
    return "yes" if flag else "no"


def _version() -> str:
    """The full build version (e.g. ``0.1.0+cu130.torch213.sm80.sm90``) when setup.py recorded it."""
    try:
        from . import _build_info  # written by setup.py at build time

        return f"{_build_info.version} (built against torch {_build_info.torch_version})"
    except ImportError:
        pass
    try:
        from .version import __version__

        return str(__version__)
    except Exception as exc:  # pragma: no cover - only when the package is broken
        return f"unknown ({type(exc).__name__}: {exc})"


def _build_info() -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Return ``(build_info, None)`` or ``(None, error message)`` if the extension is unusable."""
    try:
        from . import _C  # type: ignore[attr-defined]
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    try:
        info = dict(_C.build_info())
    except Exception as exc:
        return None, f"decentpy._C.build_info() failed: {type(exc).__name__}: {exc}"
    return info, None


def config_report() -> str:
    """Build the multi-line configuration report as a string (no printing)."""
    rows: List[Tuple[str, str]] = []
    rows.append(("decentpy", _version()))

    try:
        import torch

        torch_ver = str(torch.__version__)
        cuda_ver = getattr(torch.version, "cuda", None)
        torch_ver += f" (CUDA {cuda_ver})" if cuda_ver else " (CPU build)"
        rows.append(("torch", torch_ver))
    except Exception as exc:  # pragma: no cover - torch is a hard dependency
        torch = None  # type: ignore[assignment]
        rows.append(("torch", f"not importable ({type(exc).__name__}: {exc})"))

    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", f"{platform.platform()} {platform.machine()}"))

    info, err = _build_info()
    if info is None:
        rows.append(("extension", f"decentpy._C NOT available: {err}"))
    else:
        cpu = _yes_no(info.get("cpu_kernels"))
        width = info.get("vector_width_fp32")
        if info.get("cpu_kernels") and width:
            cpu += f" (fp32 vector width {width})"
        rows.append(("CPU kernels", cpu))
        cuda = _yes_no(info.get("cuda_kernels"))
        archs = str(info.get("cuda_archs") or "").strip()
        if info.get("cuda_kernels"):
            cuda += f" (archs: {archs or 'unknown'})"
        rows.append(("CUDA kernels", cuda))
        rows.append(("NCCL communicator", _yes_no(info.get("nccl"))))
        rows.append(("OpenMP", _yes_no(info.get("openmp"))))
        if info.get("compiler"):
            rows.append(("compiler", str(info.get("compiler"))))

    if torch is not None:
        rows.append(("intra-op threads", str(torch.get_num_threads())))
        try:
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
                rows.append(("CUDA device", f"yes: {n} visible ({names})"))
            else:
                rows.append(("CUDA device", "no"))
        except Exception as exc:
            rows.append(("CUDA device", f"no ({type(exc).__name__}: {exc})"))
        try:
            import torch.distributed as dist

            backends = [
                name
                for name, ok in (
                    ("gloo", dist.is_available() and dist.is_gloo_available()),
                    ("nccl", dist.is_available() and dist.is_nccl_available()),
                    ("mpi", dist.is_available() and dist.is_mpi_available()),
                )
                if ok
            ]
            rows.append(("torch.distributed", ", ".join(backends) if backends else "not available"))
        except Exception:
            pass

    width_col = max(len(k) for k, _ in rows)
    lines = ["decentpy configuration"]
    lines += [f"  {k + ':':<{width_col + 1}} {v}" for k, v in rows]
    return "\n".join(lines) + "\n"


def show_config(file: Optional[TextIO] = None) -> str:
    """Print the decentpy build/runtime configuration and return it as a string.

    Reports the decentpy, torch (and its CUDA) and Python versions, the platform, whether the
    compiled extension ``decentpy._C`` has CPU kernels (and their fp32 vector width), CUDA
    kernels (and for which architectures), the NCCL communicator and OpenMP, torch's intra-op
    thread count and whether a CUDA device is visible. If ``decentpy._C`` cannot be imported,
    the import error is reported instead of raised.

    Args:
        file: where to print; defaults to ``sys.stdout``.

    Returns:
        The report that was printed.
    """
    report = config_report()
    print(report, end="", file=file if file is not None else sys.stdout)
    return report

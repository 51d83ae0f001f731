"""Build and runtime configuration report (``decentpy.show_config()`` / ``python -m decentpy``)."""

from __future__ import annotations

import platform
import sys
from typing import Any, Dict, List, Optional, TextIO, Tuple

from .environment import (cpu_flags, load_extension, major_minor, missing_cpu_flags, recorded_build,
                          torch_mismatch)

__all__ = ["show_config", "config_report", "runtime_summary"]


def _yes_no(flag: Any) -> str:
    return "yes" if flag else "no"


def _version() -> str:
    """``decentpy.__version__`` (the build's full version, e.g. ``0.1.0+cu130.torch213.sm80.sm90``)."""
    try:
        from .version import __version__, base_version

        if __version__ != base_version:
            return f"{__version__} (release {base_version}; the local version names what was compiled)"
        return f"{__version__} (no build recorded: decentpy/_build_info.py is missing)"
    except Exception as exc:  # pragma: no cover - only when the package is broken
        return f"unknown ({type(exc).__name__}: {exc})"


def _arch_list(raw: str) -> List[str]:
    return [a.strip() for a in raw.split(",") if a.strip()]


def _cuda_status(info: Dict[str, Any], torch: Any, archs_shown: bool = True) -> str:
    """"compiled (...), usable here: ..." / "compiled (...), not usable here: <why>" / "not compiled"
    (``archs_shown=False``: "compiled, ..." without the archs, which the version names already)."""
    if not info.get("cuda_kernels"):
        return "not compiled (built without nvcc, or with DECENTPY_NO_CUDA=1): the CPU kernels run everything"
    archs = _arch_list(str(info.get("cuda_archs") or ""))
    sass = [a for a in archs if a.startswith("sm_")]
    ptx = [a for a in archs if a.startswith("compute_")]
    what = ", ".join(sass) + (f", PTX {', '.join(ptx)}" if ptx else "") if archs else "archs unknown"
    head = f"compiled ({what})" if archs_shown else "compiled"
    if torch is None:
        return f"{head}, not usable here: torch is not importable"
    if not getattr(torch.version, "cuda", None):
        return f"{head}, not usable here: torch {torch.__version__} is a CPU build"
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # pragma: no cover - a broken driver
        return f"{head}, not usable here: torch.cuda.is_available() failed ({type(exc).__name__}: {exc})"
    if not available:
        return f"{head}, not usable here: no CUDA device visible (torch.cuda.is_available() is False)"
    sm = [int(a[3:]) for a in sass if a[3:].isdigit()]
    ptx_sm = [int(a[8:]) for a in ptx if a[8:].isdigit()]
    usable, not_usable = [], []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        cc = 10 * major + minor
        # SASS runs on its own major with an equal or lower minor; PTX is JIT-compiled for newer GPUs.
        if any(s // 10 == major and s <= cc for s in sm) or any(p <= cc for p in ptx_sm):
            usable.append(f"cuda:{i} sm_{cc}")
        else:
            not_usable.append(f"cuda:{i} sm_{cc}")
    if not usable:
        return f"{head}, not usable here: no kernel for {', '.join(not_usable)}"
    tail = f" (not on {', '.join(not_usable)}: no kernel for it)" if not_usable else ""
    return f"{head}, usable here on {', '.join(usable)}{tail}"


def _nccl_status(info: Dict[str, Any]) -> str:
    if not info.get("nccl"):
        return "not compiled (needs nvcc and nccl.h at build time; torch.distributed's NCCL is used instead)"
    try:
        from .comm.nccl import nccl_unavailable_reason

        why = nccl_unavailable_reason()
    except Exception as exc:  # pragma: no cover
        why = f"{type(exc).__name__}: {exc}"
    return "compiled, usable here" if why is None else f"compiled, not usable here: {why}"


def _build_info() -> Tuple[Any, Optional[Dict[str, Any]], Optional[str]]:
    """``(decentpy._C, its build_info, None)``, or ``(None, None, why the extension is unusable
    here)``; the extension is loaded only when decentpy.environment finds nothing against it (a
    build that would die with SIGILL is not)."""
    try:
        C = load_extension()
    except ImportError as exc:
        return None, None, str(exc)
    try:
        return C, dict(C.build_info()), None
    except Exception as exc:
        return None, None, f"decentpy._C.build_info() failed: {type(exc).__name__}: {exc}"


def _cpu_arch_status(built: Any) -> str:
    """What the build's DECENTPY_CPU_ARCH asks of the CPU, and whether this one has it."""
    if not built.cpu_arch:
        return "portable (DECENTPY_CPU_ARCH unset: the CPU kernels pick AVX2 or AVX-512 at run time)"
    required = list(getattr(built, "cpu_arch_requires", None) or [])
    head = f"-march={built.cpu_arch} (DECENTPY_CPU_ARCH)"
    if not required:
        return f"{head}: what it needs of the CPU was not recorded (a build of an older decentpy)"
    flags = cpu_flags()
    if flags is None:
        return f"{head}, needs {', '.join(required)}: this CPU's flags are unknown (no /proc/cpuinfo)"
    missing = missing_cpu_flags(required, flags)
    if missing:
        return f"{head}: NOT usable on this CPU, which lacks {', '.join(missing)} (see the extension row)"
    return f"{head}: this CPU has the {len(required)} instruction-set flags it needs"


def _cuda_release(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _cuda_driver_status(C: Any) -> str:
    """The installed driver's CUDA against the runtime linked into the extension (CUDA builds)."""
    try:
        d = C.cuda_driver_info()
    except Exception as exc:
        return f"unknown: cudaDriverGetVersion failed ({type(exc).__name__}: {exc})"
    if d["problem"]:
        return f"NOT usable here: {d['problem']}"
    return (f"supports CUDA {_cuda_release(d['driver_version'])}; decentpy's CUDA runtime (linked in) is "
            f"{_cuda_release(d['runtime_version'])}")


def config_report() -> str:
    """Build the multi-line configuration report as a string (no printing)."""
    rows: List[Tuple[str, str]] = []
    rows.append(("decentpy", _version()))
    built = recorded_build()

    try:
        import torch

        torch_ver = str(torch.__version__)
        cuda_ver = getattr(torch.version, "cuda", None)
        torch_ver += f" (CUDA {cuda_ver})" if cuda_ver else " (CPU build)"
        rows.append(("torch", torch_ver))
    except Exception as exc:  # pragma: no cover - torch is a hard dependency
        torch = None  # type: ignore[assignment]
        rows.append(("torch", f"not importable ({type(exc).__name__}: {exc})"))
    if built is not None:
        against = f"torch {built.torch_version}"
        if torch is not None and torch_mismatch(str(built.torch_version), str(torch.__version__)):
            against += (f" -- MISMATCH: this is torch {torch.__version__}; decentpy._C needs torch "
                        f"{major_minor(str(built.torch_version))}.x (see the extension row)")
        rows.append(("compiled against", against))
        rows.append(("CPU arch", _cpu_arch_status(built)))

    rows.append(("python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", f"{platform.platform()} {platform.machine()}"))

    C, info, err = _build_info()
    if info is None:
        rows.append(("extension", f"decentpy._C NOT available: {err}"))
    else:
        if info.get("cpu_kernels"):
            cpu = "compiled, usable here"
            isa, width = info.get("cpu_kernel_isa"), info.get("vector_width_fp32")
            detail = ", ".join(x for x in (f"{isa} picked at run time" if isa else "",
                                           f"fp32 vector width {width}" if width else "") if x)
            cpu += f" ({detail})" if detail else ""
            if info.get("cpu_kernel_isa_note"):
                cpu += f"; {info['cpu_kernel_isa_note']}"
        else:
            cpu = "not compiled"
        rows.append(("CPU kernels", cpu))
        rows.append(("CUDA kernels", _cuda_status(info, torch)))
        if info.get("cuda_kernels"):
            rows.append(("CUDA driver", _cuda_driver_status(C)))
        rows.append(("NCCL communicator", _nccl_status(info)))
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
    for k, v in rows:  # a value of several lines (several problems) keeps its column
        lines.append(f"  {k + ':':<{width_col + 1}} " + v.replace("\n", "\n" + " " * (width_col + 4)))
    return "\n".join(lines) + "\n"


def runtime_summary() -> str:
    """One line for a script's banner: decentpy's version and which of its kernels run here.

    The version's local part (``0.1.0+cu130.torch213.sm80.sm90``) names what was *compiled*; beside
    a CPU torch it reads as if CUDA ran. This says what this process can use, as the report's rows
    do (``python -m decentpy`` has the details), e.g. ``decentpy 0.1.0+cu130.torch213.sm80.sm90
    (CPU kernels (avx2) usable here; CUDA kernels compiled, not usable here: torch 2.13.0+cpu is a
    CPU build)``."""
    from .version import __version__

    _, info, err = _build_info()
    if info is None:
        why = (err or "unknown").strip().splitlines()[0]
        return f"decentpy {__version__} (extension NOT usable here: {why}; python -m decentpy says what to do)"
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a hard dependency
        torch = None  # type: ignore[assignment]
    isa = f" ({info['cpu_kernel_isa']})" if info.get("cpu_kernel_isa") else ""
    cpu = f"CPU kernels{isa} usable here" if info.get("cpu_kernels") else "CPU kernels not compiled"
    cuda = ("no CUDA kernels compiled" if not info.get("cuda_kernels")
            else "CUDA kernels " + _cuda_status(info, torch, archs_shown=False))
    return f"decentpy {__version__} ({cpu}; {cuda})"


def show_config(file: Optional[TextIO] = None) -> str:
    """Print the decentpy build/runtime configuration and return it as a string.

    Reports ``decentpy.__version__`` (the build's full version, whose local part names what was
    compiled), the torch running and the torch decentpy was compiled against (a major.minor
    mismatch is flagged), Python and the platform, then for each compiled part of the extension
    ``decentpy._C`` what was compiled and whether it can run on this machine, and why not: the
    CPU kernels (and the vector ISA picked at run time), the CUDA kernels (their SASS/PTX archs,
    checked against torch's CUDA and the visible devices, e.g. "compiled (sm_80, sm_90, PTX
    compute_90), not usable here: torch 2.13.0+cpu is a CPU build"), the NVIDIA driver's CUDA
    against the CUDA runtime linked into the extension, decentpy's NCCL communicator; then OpenMP,
    torch's intra-op thread count, the CUDA devices and torch.distributed's backends. The build's
    DECENTPY_CPU_ARCH is checked against this CPU's flags, and the CPU kernels' row says when they
    do not run the instruction set torch chose (ATEN_CPU_CAPABILITY asking for one the CPU lacks).
    If ``decentpy._C`` cannot be used here (another torch, a CPU without its instructions, a failed
    load), why and what to do is reported instead of raised; it is then not loaded.

    Args:
        file: where to print; defaults to ``sys.stdout``.

    Returns:
        The report that was printed.
    """
    report = config_report()
    print(report, end="", file=file if file is not None else sys.stdout)
    return report

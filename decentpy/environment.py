"""Whether this decentpy installation can run here, decided before its extension is loaded.

A compiled extension loaded under another torch, or on a CPU without the instructions it was
compiled for, fails without a word on what to do: an ``undefined symbol`` from the dynamic loader,
or the process dies (SIGILL). ``import decentpy`` therefore compares what the build recorded
(``decentpy/_build_info.py``, written by setup.py) with what runs here before it loads
``decentpy._C``, and raises :class:`ExtensionImportError` naming both and what to do; a failure of
the load itself is worded the same way. ``python -m decentpy`` reports the same problems instead of
raising (decentpy/config.py). The table of these cases is in docs/howto/building.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any, FrozenSet, List, Optional, Sequence

import torch

__all__ = ["ExtensionImportError", "CPUINFO", "REBUILD", "recorded_build", "major_minor", "torch_mismatch",
           "cpu_flags", "missing_cpu_flags", "cpu_arch_problem", "environment_problems", "load_extension",
           "log_cpu_kernel_choice", "running_the_report"]

logger = logging.getLogger(__name__)

#: where Linux lists the CPU's instruction-set flags
CPUINFO = "/proc/cpuinfo"

#: how to build the extension against the torch of this environment
REBUILD = "`make build` in decentpy's source tree, or `pip install --no-build-isolation -e .` there"


class ExtensionImportError(ImportError):
    """decentpy's compiled extension cannot be used here; the message says why and what to do."""


def recorded_build() -> Optional[ModuleType]:
    """``decentpy._build_info`` (written by setup.py at build time), or None in a tree never built."""
    try:
        return importlib.import_module("decentpy._build_info")
    except ImportError:
        return None


def major_minor(version: str) -> str:
    """``"2.13"`` for ``"2.13.0+cpu"``: torch's binary interface changes between minor releases."""
    return ".".join(version.split("+")[0].split(".")[:2])


def torch_mismatch(built: str, running: str) -> Optional[str]:
    """Why an extension built against torch ``built`` cannot be loaded under torch ``running``, or
    None when both have the same major.minor."""
    b, r = major_minor(built), major_minor(running)
    if b == r:
        return None
    return (f"decentpy's extension decentpy._C was built against torch {built}, but this is torch {running}: a "
            f"compiled torch extension loads only under the torch major.minor it was built against ({b}); under "
            f"torch {r} it fails with an `undefined symbol` error, or crashes. Rebuild decentpy against this torch "
            f"({REBUILD}), or install the decentpy wheel built for torch {r} (the local part of its version names "
            f"it: torch{r.replace('.', '')}; docs/wheels.md), or install torch=={b}.*")


def cpu_flags() -> Optional[FrozenSet[str]]:
    """This CPU's instruction-set flags as Linux names them (``avx2``, ``avx512f``, ...), from
    /proc/cpuinfo; None where they cannot be read (not Linux, or not x86)."""
    try:
        with open(CPUINFO) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def missing_cpu_flags(required: Sequence[str], flags: Optional[FrozenSet[str]]) -> List[str]:
    """The ``required`` flags this CPU lacks; none where its flags are unknown (nothing to go on)."""
    if flags is None:
        return []
    return [f for f in required if f not in flags]


def cpu_arch_problem(cpu_arch: Optional[str], required: Sequence[str],
                     flags: Optional[FrozenSet[str]]) -> Optional[str]:
    """Why a build with ``DECENTPY_CPU_ARCH`` (``-march=cpu_arch``, needing the CPU flags
    ``required``) cannot run on a CPU with ``flags``, or None when it can."""
    missing = missing_cpu_flags(required, flags)
    if not cpu_arch or not missing:
        return None
    return (f"decentpy's extension decentpy._C was built with DECENTPY_CPU_ARCH (all its C++ compiled with "
            f"-march={cpu_arch}), which needs CPU instructions this CPU lacks: {', '.join(missing)} (not among "
            f"the flags of {CPUINFO}). Loading it would stop the process with SIGILL (illegal instruction). "
            f"Rebuild without DECENTPY_CPU_ARCH ({REBUILD}): the default build compiles its CPU kernels for "
            "AVX2 and AVX-512 and picks what the CPU has at run time; or install a decentpy wheel built without "
            "it (no 'march' in its version; docs/wheels.md)")


def environment_problems(build: Any = None) -> List[str]:
    """What makes the recorded ``build`` (default: this installation's) unusable here, found
    without loading it: another torch major.minor, CPU instructions this CPU lacks."""
    build = build if build is not None else recorded_build()
    if build is None:
        return []
    problems = []
    why = torch_mismatch(str(build.torch_version), str(torch.__version__))
    if why:
        problems.append(why)
    required = list(getattr(build, "cpu_arch_requires", None) or [])
    why = cpu_arch_problem(build.cpu_arch, required, cpu_flags() if required else None)
    if why:
        problems.append(why)
    return problems


def _load_failure(exc: ImportError) -> str:
    """The message for an ImportError of decentpy._C itself."""
    here = os.path.dirname(os.path.abspath(__file__))
    if isinstance(exc, ModuleNotFoundError) and exc.name == "decentpy._C":
        return (f"decentpy's compiled extension decentpy._C is not built in {here}: build it ({REBUILD}; "
                "docs/howto/building.md), or install a decentpy wheel (docs/wheels.md)")
    build = recorded_build()
    running = f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else "")
    if build is not None:
        cuda = f" (CUDA {build.torch_cuda_version})" if build.torch_cuda_version else ""
        built = f"torch {build.torch_version}{cuda}"
        against = f"It was built against {built}; this is {running}"
    else:
        against = f"No build is recorded (decentpy/_build_info.py is missing); this is {running}"
    return (f"decentpy cannot load its compiled extension decentpy._C: {exc}. {against}. An `undefined symbol` "
            "means the extension and this torch do not match (another torch, or a build that did not finish): "
            f"rebuild it ({REBUILD}), or install the decentpy wheel built for this torch (docs/wheels.md)")


def load_extension() -> ModuleType:
    """``decentpy._C``, after :func:`environment_problems` found nothing; otherwise, or when the
    load fails, :class:`ExtensionImportError` saying what is wrong and what to do (the load's own
    error chained)."""
    problems = environment_problems()
    if problems:
        raise ExtensionImportError("\n".join(problems), name="decentpy._C")
    try:
        return importlib.import_module("decentpy._C")
    except ImportError as exc:
        raise ExtensionImportError(_load_failure(exc), name="decentpy._C") from exc


def log_cpu_kernel_choice(extension: ModuleType) -> None:
    """One warning when the CPU kernels do not run the instruction set torch chose (e.g.
    ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512: they fall back to AVX2)."""
    note = extension.build_info().get("cpu_kernel_isa_note")
    if note:
        logger.warning("decentpy: %s", note)


def running_the_report(argv: Optional[Sequence[str]] = None) -> bool:
    """Whether this process is ``python -m decentpy``, which imports the package to report what is
    wrong with it, and so must not be refused. ``argv``: the interpreter's command line
    (``sys.orig_argv``, Python >= 3.10)."""
    if argv is None:
        argv = getattr(sys, "orig_argv", None)
        if argv is None:  # Python 3.9: runpy imports the package while sys.argv[0] is still "-m"
            return sys.argv[:1] == ["-m"]
    args = list(argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            return False  # a script, stdin, or the end of the interpreter's options
        for j, opt in enumerate(arg[1:], start=1):
            if opt == "m":
                module = arg[j + 1:] or (args[i + 1] if i + 1 < len(args) else "")
                return module == "decentpy"
            if opt == "c":
                return False
            if opt in "XW":  # their value follows, attached or as the next argument
                if j == len(arg) - 1:
                    i += 1
                break
        i += 1
    return False

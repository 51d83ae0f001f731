"""``python -m decentpy`` / ``decentpy.__version__``: what was compiled, and what can run here."""

from __future__ import annotations

import importlib.util
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import decentpy
import decentpy._C as C
from decentpy.config import config_report, runtime_summary

ROOT = Path(__file__).resolve().parents[1]


def _row(report: str, key: str) -> str:
    m = re.search(rf"^\s*{re.escape(key)}:\s+(.*)$", report, re.M)
    assert m, report
    return m.group(1)


def test_version_is_the_build_version() -> None:
    release = re.search(r'^__version__ = "([^"]+)"', (ROOT / "decentpy" / "version.py").read_text(), re.M).group(1)
    assert decentpy.version.base_version == release
    try:
        from decentpy import _build_info
    except ImportError:  # an unbuilt tree: the bare release
        assert decentpy.__version__ == release
    else:
        assert decentpy.__version__ == _build_info.version
        assert decentpy.__version__.startswith(release + "+")


def test_report_says_what_is_compiled_and_usable() -> None:
    info = C.build_info()
    report = config_report()
    assert _row(report, "decentpy").startswith(decentpy.__version__)
    assert _row(report, "CPU kernels").startswith("compiled, usable here")
    cuda = _row(report, "CUDA kernels")
    if not info["cuda_kernels"]:
        assert cuda.startswith("not compiled"), cuda
    else:
        archs = [a for a in info["cuda_archs"].split(",") if a.startswith("sm_")]
        assert cuda.startswith("compiled (" + ", ".join(archs)), cuda
        if torch.version.cuda is None:
            assert cuda.endswith(f"not usable here: torch {torch.__version__} is a CPU build"), cuda
        elif not torch.cuda.is_available():
            assert "not usable here: no CUDA device visible" in cuda, cuda
        else:
            assert "usable here on cuda:0" in cuda or "no kernel for" in cuda, cuda
    nccl = _row(report, "NCCL communicator")
    assert nccl.startswith("compiled" if info["nccl"] else "not compiled"), nccl
    if info["nccl"] and not torch.cuda.is_available():
        assert "not usable here" in nccl, nccl


def test_runtime_summary_says_what_runs_here() -> None:
    """The banner line of a training script: the version names what was compiled, the rest what this
    process can use (a CUDA build beside a CPU torch says so instead of looking like CUDA runs)."""
    info = C.build_info()
    line = runtime_summary()
    assert "\n" not in line and re.match(rf"decentpy {re.escape(decentpy.__version__)} \(CPU kernels( \(\w+\))? "
                                          r"usable here; ", line), line
    if not info["cuda_kernels"]:
        assert line.endswith("; no CUDA kernels compiled)"), line
    elif torch.version.cuda is None:
        assert line.endswith(f"; CUDA kernels compiled, not usable here: torch {torch.__version__} is a CPU build)"), line
    elif not torch.cuda.is_available():
        assert "; CUDA kernels compiled, not usable here: no CUDA device visible" in line, line
    else:
        assert "; CUDA kernels compiled, usable here on cuda:0" in line or "no kernel for" in line, line


def test_python_m_decentpy_prints_the_report(capsys) -> None:
    runpy.run_module("decentpy", run_name="__main__")  # what `python -m decentpy` runs
    out = capsys.readouterr().out
    assert out.startswith("decentpy configuration\n")
    assert re.search(r"^\s*CUDA kernels:\s+(compiled|not compiled)", out, re.M), out


def test_packaging_metadata() -> None:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    meta = project["project"]
    assert meta["license"] == "BSD-3-Clause" and meta["license-files"] == ["LICENSE"]
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    assert meta["authors"]
    assert "urls" not in meta  # no made-up address: added with the repository's public one
    assert "Typing :: Typed" in meta["classifiers"]
    assert (ROOT / "decentpy" / "py.typed").is_file()
    assert project["tool"]["setuptools"]["package-data"]["decentpy"] == ["py.typed"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {decentpy.version.base_version} - " in changelog


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_extension_uses_the_process_libstdcxx() -> None:
    """The extension defines none of the C++ runtimes' own functions (setup.py's list, which the
    build itself checks after the link): a statically linked copy beside the process's shared one
    crashed (SIGSEGV) at the first integer formatted into an error message."""
    spec = importlib.util.spec_from_file_location("decentpy_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)
    found = setup_py.runtime_copies(C.__file__)
    assert not found, f"{C.__file__} defines {found}: a C++ runtime was linked into the extension statically"


def test_an_error_message_with_integers_raises() -> None:
    """A refusal whose message formats integers (c10::str) raises a RuntimeError naming them, in a
    child process so that a crash fails this test instead of ending the session."""
    code = ("import torch, decentpy.optim.kernels as K\n"
            "p = torch.zeros(100)\n"
            "try:\n"
            "    K.fused_step(K.OptKind.ADAM, p, torch.zeros(100), [torch.zeros(99), torch.zeros(100)],\n"
            "                 K.segments_for_numel(100, p.device), [K.GroupHyper(lr=1e-3, weight_decay=0.0, bias_step=1)])\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"the child died (returncode {r.returncode}): {r.stderr[-2000:]}"
    assert "99" in r.stdout and "100" in r.stdout, r.stdout + r.stderr

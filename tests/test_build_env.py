"""A bad environment fails at import with one message that says what to do (issue 40), never an
``undefined symbol`` traceback or a dead process: another torch than the build's, an extension that
does not load, a DECENTPY_CPU_ARCH build on a CPU without its instructions, ATEN_CPU_CAPABILITY
asking for an instruction set the CPU lacks, an NVIDIA driver older than the linked CUDA runtime,
``comm="nccl"`` without a loadable libnccl; and ``python -m decentpy`` reports each.

Imports run in child processes (each with a timeout). A broken installation is a copy of the
decentpy package in a temporary directory, with its recorded build changed and, for decentpy._C,
a small shared object that behaves like the broken extension: an undefined symbol, or a SIGILL when
loaded. The CPU is faked where Linux describes it, /proc/cpuinfo (read through ``open``).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import decentpy
from decentpy import _C
from decentpy.comm import nccl as nccl_comm
from decentpy.comm import select as comm_select
from decentpy.config import config_report
from decentpy.environment import load_extension, log_cpu_kernel_choice, running_the_report

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180
C_COMPILER = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(C_COMPILER is None, reason="needs a C compiler for the stand-in extension")
X86 = platform.machine() in ("x86_64", "AMD64")

#: the flags of an Intel Haswell (AVX2, FMA, no AVX-512) as Linux lists them
HASWELL_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse "
    "sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon pebs bts rep_good nopl xtopology "
    "nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx est tm2 ssse3 sdbg fma cx16 xtpr pdcm "
    "pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm cpuid_fault "
    "epb invpcid_single pti ssbd ibrs ibpb stibp tpr_shadow vnmi flexpriority ept vpid ept_ad fsgsbase "
    "tsc_adjust bmi1 avx2 smep bmi2 erms invpcid xsaveopt dtherm ida arat pln pts md_clear flush_l1d")
AVX512 = ["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"]  # what -march=x86-64-v4 adds

UNDEFINED_SYMBOL_C = """
extern void _ZN3c1015SmallVectorBase8grow_podEPvmm_from_another_torch(void);
void* PyInit__C(void) { _ZN3c1015SmallVectorBase8grow_podEPvmm_from_another_torch(); return 0; }
"""
# Loading it executes an instruction the CPU refuses (ud2): what an AVX-512 build does on a CPU without it.
SIGILL_C = "void* PyInit__C(void) { __builtin_trap(); return 0; }\n"


def run_python(args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
                          env=full_env)


def package_copy(tmp_path: Path, build: Optional[Dict[str, object]] = None, extension_c: Optional[str] = None,
                 cpuinfo_flags: Optional[str] = None) -> Path:
    """A directory holding a copy of the decentpy package (its Python files and recorded build, no
    compiled extension): the recorded build updated with ``build``, ``extension_c`` compiled as its
    decentpy._C, and /proc/cpuinfo read as a CPU with ``cpuinfo_flags``. Its sitecustomize.py does
    both that and keeping the tree's editable install out, so `python -m decentpy` sees the same.
    Run Python in it with PYTHONPATH=it."""
    root = tmp_path / "site"
    shutil.copytree(ROOT / "decentpy", root / "decentpy",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.tmp"))
    if build:
        with open(root / "decentpy" / "_build_info.py", "a") as f:
            f.write("".join(f"{k} = {v!r}\n" for k, v in build.items()))
    if extension_c is not None:
        src = tmp_path / "ext.c"
        src.write_text(extension_c)
        out = root / "decentpy" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
        subprocess.run([C_COMPILER, "-shared", "-fPIC", str(src), "-o", str(out)], check=True, timeout=120)
    # The copy alone is decentpy: an editable install's finder would supply the tree's decentpy._C.
    site = textwrap.dedent("""\
        import sys
        sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
        """)
    if cpuinfo_flags is not None:
        fake = tmp_path / "cpuinfo"
        fake.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {cpuinfo_flags}\n\n")
        site += textwrap.dedent(f"""\
            import builtins
            _open = builtins.open
            def _fake_cpuinfo(file, *args, **kwargs):
                return _open({str(fake)!r} if file == "/proc/cpuinfo" else file, *args, **kwargs)
            builtins.open = _fake_cpuinfo
            """)
    (root / "sitecustomize.py").write_text(site)
    return root


def in_copy(root: Path, args: List[str]) -> subprocess.CompletedProcess:
    return run_python(args, cwd=root, env={"PYTHONPATH": str(root)})


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def another_minor(version: str) -> str:
    major, minor = version.split("+")[0].split(".")[:2]
    return f"{major}.{int(minor) - 1 if int(minor) > 0 else int(minor) + 1}.0"


def load_setup_module():
    spec = importlib.util.spec_from_file_location("decentpy_setup_for_tests", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as __main__
    return module


# ---- 1. another torch than the one the extension was built against ----------------------------

def test_import_refuses_another_torch_minor_release() -> None:
    """Before: the import went on and loaded the extension (under a real other torch, an
    `undefined symbol` or a crash). Now an ImportError names both versions and what to do, before
    decentpy._C is loaded."""
    built = decentpy._build_info.torch_version
    other = another_minor(built)
    code = (f"import sys, torch; torch.__version__ = {other!r}\n"
            "try:\n    import decentpy\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__, '|', 'decentpy._C' in sys.modules, '|', e)\n")
    r = run_python(["-c", code], cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    kind, loaded, message = r.stdout.split(" | ", 2)
    assert kind == "ExtensionImportError" and loaded == "False", r.stdout
    assert f"built against torch {built}" in message and f"this is torch {other}" in message, message
    assert "make build" in message and "pip install --no-build-isolation -e ." in message, message
    other_tag = "torch" + "".join(other.split(".")[:2])  # the local version of the wheel for that torch
    assert "docs/wheels.md" in message and other_tag in message, message


def test_another_patch_release_of_the_same_torch_imports() -> None:
    """Patch releases keep torch's binary interface: 2.13.0 -> 2.13.9 is not refused."""
    built = decentpy._build_info.torch_version
    same_minor = ".".join(built.split("+")[0].split(".")[:2]) + ".9"
    code = f"import torch; torch.__version__ = {same_minor!r}\nimport decentpy\nprint('ok', decentpy._C.__name__)"
    r = run_python(["-c", code], cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok decentpy._C", r.stderr[-3000:]


def test_report_flags_another_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    built = decentpy._build_info.torch_version
    other = another_minor(built)
    monkeypatch.setattr(torch, "__version__", other)
    report = config_report()
    assert re.search(rf"compiled against:\s+torch {re.escape(built)} -- MISMATCH: this is torch {other}", report), report
    assert re.search(r"extension:\s+decentpy\._C NOT available: decentpy's extension decentpy\._C was built against",
                     report), report


# ---- an extension that does not load, or is not there ------------------------------------------

@needs_cc
def test_an_extension_that_fails_to_load_is_explained(tmp_path: Path) -> None:
    """Before: `ImportError: .../_C...so: undefined symbol: ...` and nothing else, and `python -m
    decentpy` died with the same traceback. Now the message says which torch it was built for and
    what to do (the loader's error chained), and the report prints it, with exit status 1."""
    root = package_copy(tmp_path, extension_c=UNDEFINED_SYMBOL_C)
    r = in_copy(root, ["-c", "import decentpy"])
    assert r.returncode == 1, r.stderr
    err = r.stderr
    message = last_line(err)
    assert message.startswith("decentpy.environment.ExtensionImportError: decentpy cannot load its compiled "
                              "extension decentpy._C:"), err[-3000:]
    assert "undefined symbol: _ZN3c1015SmallVectorBase8grow_podEPvmm_from_another_torch" in message
    assert f"It was built against torch {decentpy._build_info.torch_version}" in message
    assert "make build" in message and "docs/wheels.md" in message
    assert "The above exception was the direct cause of the following exception" in err  # the loader's, chained

    r = in_copy(root, ["-m", "decentpy"])
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stdout.startswith("decentpy configuration\n"), r.stdout + r.stderr[-3000:]
    assert re.search(r"extension:\s+decentpy\._C NOT available: decentpy cannot load its compiled extension "
                     r"decentpy\._C: .*undefined symbol", r.stdout), r.stdout


def test_a_missing_extension_says_how_to_build_it(tmp_path: Path) -> None:
    """Before: `cannot import name '_C' from partially initialized module 'decentpy' (most likely
    due to a circular import)`."""
    root = package_copy(tmp_path)
    r = in_copy(root, ["-c", "import decentpy"])
    assert r.returncode == 1
    message = last_line(r.stderr)
    assert "decentpy's compiled extension decentpy._C is not built in" in message, r.stderr[-3000:]
    assert "make build" in message and "circular import" not in message


# ---- 4. a DECENTPY_CPU_ARCH build on a CPU without its instructions ---------------------------

@pytest.mark.skipif(not X86 or shutil.which("c++") is None, reason="x86-64 -march values, needs c++")
def test_the_build_records_what_its_march_needs() -> None:
    """setup.py asks the compiler what -march defines; the names are /proc/cpuinfo's: every flag
    that -march=native needs is one this CPU lists."""
    setup = load_setup_module()
    v4 = setup.march_cpu_flags("x86-64-v4", "c++")
    v3 = setup.march_cpu_flags("x86-64-v3", "c++")
    assert set(AVX512) <= set(v4) and {"avx2", "fma"} <= set(v3) and not set(AVX512) & set(v3), (v3, v4)
    assert setup.march_cpu_flags("", "c++") == []
    flags = set(Path("/proc/cpuinfo").read_text().split("\nflags")[1].split(":", 1)[1].split("\n")[0].split())
    native = setup.march_cpu_flags("native", "c++")
    assert native and set(native) <= flags, set(native) - flags
    with pytest.raises(SystemExit, match="rejects DECENTPY_CPU_ARCH='no-such-cpu'"):
        setup.march_cpu_flags("no-such-cpu", "c++")


@needs_cc
@pytest.mark.skipif(not X86 or shutil.which("c++") is None, reason="x86-64 -march values, needs c++")
def test_avx512_build_is_refused_on_a_cpu_without_avx512(tmp_path: Path) -> None:
    """Before: nothing checked the build's -march, and loading it on such a CPU is a SIGILL (here: a
    stand-in extension that executes an illegal instruction when loaded). Now `import decentpy`
    raises an ImportError before loading it, naming what the build needs and this CPU lacks, and
    `python -m decentpy` reports it."""
    requires = load_setup_module().march_cpu_flags("x86-64-v4", "c++")  # what an avx512 build records
    build = {"cpu_arch": "x86-64-v4", "cpu_arch_requires": requires}
    root = package_copy(tmp_path, build=build, extension_c=SIGILL_C, cpuinfo_flags=HASWELL_FLAGS)
    r = in_copy(root, ["-c", "import decentpy"])
    assert r.returncode == 1, f"returncode {r.returncode}: {r.stderr[-3000:]}"
    message = last_line(r.stderr)
    assert message.startswith("decentpy.environment.ExtensionImportError: decentpy's extension decentpy._C was "
                              "built with DECENTPY_CPU_ARCH (all its C++ compiled with -march=x86-64-v4)"), r.stderr
    missing = re.search(r"this CPU lacks: ([a-z0-9_, ]+) \(", message).group(1).split(", ")
    assert sorted(missing) == AVX512, message
    assert "SIGILL" in message and "Rebuild without DECENTPY_CPU_ARCH" in message and "make build" in message

    r = in_copy(root, ["-m", "decentpy"])
    assert r.returncode == 1, f"returncode {r.returncode}: {r.stderr[-3000:]}"
    assert re.search(r"CPU arch:\s+-march=x86-64-v4 \(DECENTPY_CPU_ARCH\): NOT usable on this CPU, which lacks "
                     r"avx512bw, avx512cd, avx512dq, avx512f, avx512vl", r.stdout), r.stdout
    assert re.search(r"extension:\s+decentpy\._C NOT available: .*-march=x86-64-v4", r.stdout), r.stdout

    # The same installation on a CPU that has the instructions passes the check and loads the
    # extension: the stand-in dies as the real one would where the check is missing.
    flags_with_avx512 = HASWELL_FLAGS + " " + " ".join(AVX512)
    root2 = package_copy(tmp_path / "v4", build=build, extension_c=SIGILL_C, cpuinfo_flags=flags_with_avx512)
    r = in_copy(root2, ["-c", "import decentpy"])
    assert r.returncode == -signal.SIGILL, f"returncode {r.returncode}: {r.stderr[-2000:]}"


# ---- 5. python -m decentpy: how it knows it is the report ------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["python", "-m", "decentpy"], True),
    (["python", "-mdecentpy"], True),
    (["python", "-Im", "decentpy"], True),
    (["python", "-X", "dev", "-W", "error", "-m", "decentpy"], True),
    (["python", "-m", "decentpy.config"], False),
    (["python", "-m", "pytest", "decentpy"], False),
    (["python", "-c", "import decentpy", "-m", "decentpy"], False),
    (["python", "train.py", "-m", "decentpy"], False),
])
def test_only_python_m_decentpy_is_the_report(argv: List[str], expected: bool) -> None:
    assert running_the_report(argv) is expected


def test_load_extension_returns_the_extension_here() -> None:
    assert load_extension() is _C


# ---- 4b. the default build's run-time pick never takes an ISA the CPU lacks --------------------

def test_cpu_kernels_never_pick_an_isa_the_cpu_lacks() -> None:
    """torch's capability (ATEN_CPU_CAPABILITY sets it without asking the CPU) fed with CPUs
    without AVX-512 / AVX2: the kernels fall back, and the note says why. Before: the same fall
    back, silently (nothing in build_info, the report or the log)."""
    if not X86:
        pytest.skip("no AVX2/AVX-512 kernels off x86-64")
    isa, note = _C.choose_cpu_isa("AVX512", cpu_avx2=True, cpu_avx512=False)
    assert isa == "avx2", (isa, note)
    assert "torch's CPU capability is AVX512, but this CPU lacks AVX-512" in note and "AVX2" in note, note
    assert "unset ATEN_CPU_CAPABILITY" in note
    isa, note = _C.choose_cpu_isa("AVX512", cpu_avx2=False, cpu_avx512=False)
    assert isa == "default" and "lacks AVX-512 and AVX2" in note, note
    isa, note = _C.choose_cpu_isa("AVX2", cpu_avx2=False, cpu_avx512=False)
    assert isa == "default" and "lacks AVX2" in note, note
    assert _C.choose_cpu_isa("AVX512", cpu_avx2=True, cpu_avx512=True) == ("avx512", "")
    assert _C.choose_cpu_isa("AVX2", cpu_avx2=True, cpu_avx512=True) == ("avx2", "")
    assert _C.choose_cpu_isa("DEFAULT", cpu_avx2=True, cpu_avx512=True) == ("default", "")


@pytest.mark.skipif(not X86, reason="x86-64 instruction sets")
@pytest.mark.parametrize("asked", ["default", "avx2", "avx512"])
def test_cpu_kernels_follow_aten_cpu_capability_within_what_the_cpu_has(asked: str) -> None:
    flags = decentpy.environment.cpu_flags() or frozenset()
    code = ("import decentpy, torch\n"
            "i = decentpy._C.build_info()\n"
            "print(torch.backends.cpu.get_cpu_capability(), i['cpu_kernel_isa'], i['vector_width_fp32'], "
            "repr(i['cpu_kernel_isa_note']))")
    r = run_python(["-c", code], cwd=ROOT, env={"ATEN_CPU_CAPABILITY": asked})
    assert r.returncode == 0, r.stderr[-3000:]
    capability, isa, width, note = r.stdout.split(" ", 3)
    has_avx2, has_avx512 = {"avx2", "fma"} <= flags, set(AVX512) - {"avx512cd"} <= flags
    expected = {"default": "default", "avx2": "avx2" if has_avx2 else "default",
                "avx512": "avx512" if has_avx512 else ("avx2" if has_avx2 else "default")}[asked]
    assert isa == expected and int(width) == (16 if isa == "avx512" else 8), r.stdout
    assert (note.strip() == "''") == (isa == asked), note  # a note exactly when it fell back


def test_report_and_log_say_when_the_cpu_kernels_fall_back(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    isa, note = _C.choose_cpu_isa("AVX512", cpu_avx2=True, cpu_avx512=False)  # a CPU without AVX-512
    info = dict(_C.build_info(), cpu_kernel_isa=isa, cpu_kernel_isa_note=note, vector_width_fp32=8)
    monkeypatch.setattr(_C, "build_info", lambda: info)
    row = re.search(r"CPU kernels:\s+(.*)", config_report()).group(1)
    assert row.startswith("compiled, usable here (avx2 picked at run time, fp32 vector width 8); torch's CPU "
                          "capability is AVX512, but this CPU lacks AVX-512"), row
    with caplog.at_level("WARNING", logger="decentpy.environment"):
        log_cpu_kernel_choice(_C)
    assert [r.getMessage() for r in caplog.records] == [f"decentpy: {note}"]


# ---- 2. an NVIDIA driver older than the CUDA runtime linked into the extension ----------------

def test_cuda_driver_older_than_the_runtime_is_explained() -> None:
    """The one wording of the driver check (C++, csrc/cuda/cuda_driver.cpp), fed (driver,
    runtime) pairs as cudaDriverGetVersion and CUDART_VERSION encode them. Before: the user got
    `decentpy CUDA error: cudaErrorInsufficientDriver (CUDA driver version is insufficient for CUDA
    runtime version) at ...` with no versions and nothing to do."""
    msg = _C.cuda_driver_problem(12080, 13000)
    assert "the NVIDIA driver supports CUDA 12.8" in msg and "built with CUDA 13.0" in msg, msg
    assert "update the NVIDIA driver to one that supports CUDA 13.0 or newer" in msg, msg
    assert "use a decentpy built for CUDA 12.8 or older" in msg, msg
    minor = _C.cuda_driver_problem(12020, 12080)
    assert "supports CUDA 12.2" in minor and "built with CUDA 12.8" in minor and "minor version" in minor, minor
    none = _C.cuda_driver_problem(0, 12080)
    assert "no NVIDIA driver was found" in none and "CUDA 12.8" in none, none
    assert _C.cuda_driver_problem(13000, 13000) == "" and _C.cuda_driver_problem(13020, 12080) == ""


@pytest.mark.skipif(not _C.build_info()["cuda_kernels"], reason="a build without CUDA links no CUDA runtime")
def test_the_first_cuda_call_and_the_report_check_the_driver() -> None:
    """The real path: this extension's own CUDA runtime against the installed driver. Without a
    driver (a CPU machine with nvcc) the first CUDA call raises the driver message; with one, it
    works when the driver is new enough."""
    d = _C.cuda_driver_info()
    report = config_report()
    row = re.search(r"CUDA driver:\s+(.*)", report).group(1)
    if d["problem"]:
        with pytest.raises(RuntimeError) as info:
            _C.cuda_device_count()
        assert str(info.value).startswith(d["problem"]), str(info.value)
        assert "cudaErrorInsufficientDriver" in str(info.value)  # the runtime's own error follows
        assert row == f"NOT usable here: {d['problem']}", row
    else:
        assert d["driver_version"] >= d["runtime_version"] > 0
        assert _C.cuda_device_count() >= 0
        assert row.startswith("supports CUDA "), row


# ---- 3. comm="nccl" without a loadable libnccl ------------------------------------------------

def _a_libnccl_is_loadable() -> bool:
    return bool(torch.version.cuda or ctypes.util.find_library("nccl") or nccl_comm.nccl_library_candidates())


@pytest.mark.skipif(_a_libnccl_is_loadable(), reason="a libnccl is installed here: it would load")
def test_nccl_library_that_cannot_be_loaded_is_explained() -> None:
    """DECENTPY_NCCL_LIBRARY names a file that is not there. Before: the path was dropped without a
    word (and without NCCL at build time the loader was not compiled: 'built without CUDA'). Now
    the loader's error names it, why dlopen refused it, every other place tried, and what to
    install or set."""
    code = ("from decentpy import _C\n"
            "from decentpy.comm.nccl import nccl_library_candidates\n"
            "try:\n    _C.nccl_load_library(nccl_library_candidates())\n"
            "except RuntimeError as e:\n    print(e)\n")
    r = run_python(["-c", code], cwd=ROOT, env={"DECENTPY_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert r.returncode == 0, r.stderr[-3000:]
    msg = r.stdout
    assert msg.startswith("decentpy: cannot load the NCCL library (libnccl.so.2, NCCL >= 2.14)"), msg
    assert "dlopen /nonexistent/libnccl.so.2: /nonexistent/libnccl.so.2: cannot open shared object file" in msg
    assert "dlopen libnccl.so.2: libnccl.so.2: cannot open shared object file" in msg  # the loader's path
    assert "nvidia-nccl-cu" in msg and "DECENTPY_NCCL_LIBRARY" in msg and "LD_LIBRARY_PATH" in msg, msg


@pytest.mark.skipif(_a_libnccl_is_loadable(), reason="a libnccl is installed here: it would load")
def test_comm_nccl_raises_the_loader_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """comm='nccl' where everything but libnccl is there (an NCCL build, a GPU: both faked here) is
    one RuntimeError carrying the loader's message; DecentralizedDataParallel checks it in its
    local set-up, which its first collective (the agreement) raises on every rank."""
    monkeypatch.setenv("DECENTPY_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    monkeypatch.setattr(nccl_comm, "nccl_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError) as info:
        comm_select.resolve_comm("nccl")
    msg = str(info.value)
    assert msg.startswith("comm='nccl': decentpy's NCCL communicator is not available: decentpy: cannot load the "
                          "NCCL library"), msg
    assert "/nonexistent/libnccl.so.2: cannot open shared object file" in msg, msg


def test_ddp_with_comm_nccl_fails_in_its_construction_agreement() -> None:
    """What comm='nccl' gives here (a build or a machine without NCCL): one RuntimeError from the
    wrapper's construction, raised by its agreement -- the first collective, which raises it on
    every rank -- instead of later, from the communicator's selection after the parameters'
    broadcast (before)."""
    from functools import partial

    from dist_harness import single_process_group

    from decentpy.optim import optim_fn_adamw

    with single_process_group("gloo"):
        with pytest.raises(RuntimeError, match="comm='nccl': decentpy's NCCL communicator is not available: ") as info:
            decentpy.DecentralizedDataParallel(torch.nn.Linear(4, 2), partial(optim_fn_adamw, lr=1e-3), comm="nccl")
    frames = [entry.name for entry in info.traceback]
    assert "agree_across_ranks" in frames and "select_communicator" not in frames, frames


def test_make_help_lists_the_targets_and_where_the_tools_are() -> None:
    """`make help` prints the Makefile's header: every entry point and the .venv's tools."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "-s", "help"], cwd=root, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for words in ("make train", "make test", "make docs", "make bench-lm", "make help", ".venv/bin/torchrun"):
        assert words in out.stdout, (words, out.stdout)
    assert not any(line.startswith("#") for line in out.stdout.splitlines())

"""Build of decentpy and its C++ extension decentpy._C.

Always built: the CPU kernels, bucket packing and bindings (a torch CppExtension, so a CPU-only
torch works). When nvcc is found and torch is a CUDA build (or DECENTPY_BUILD_CUDA=1 asks for it
against a CPU torch, as CI does to compile every source), every csrc/cuda/*.cu is compiled by nvcc into an object file
(no torch headers in .cu files), linked into the same extension together with the static CUDA
runtime, and DECENTPY_WITH_CUDA is defined for the .cpp files.

Environment:
  DECENTPY_NO_CUDA=1         never build the CUDA kernels
  DECENTPY_BUILD_CUDA=1      build them against a CPU torch too (by default a CPU torch gets none:
                             nothing could run them, and minutes of nvcc would be spent for nothing)
  CUDA_HOME / CUDA_PATH      CUDA toolkit to use (else /usr/local/cuda, else nvcc on PATH)
  DECENTPY_CUDA_ARCHS        semicolon/comma separated SM list, default "80;90" (+PTX of the highest)
  DECENTPY_CPU_ARCH          optional -march for all C++ files: avx2 (= x86-64-v3), avx512
                             (= x86-64-v4) or any -march value. Default none (portable): the
                             kernels are compiled for baseline, AVX2 and AVX512 and pick one at
                             run time (torch's own choice, ATEN_CPU_CAPABILITY overrides, within
                             what the CPU has). With it, the CPU flags that -march needs are
                             recorded, and `import decentpy` refuses on a CPU without one
  DECENTPY_DEBUG=1           -O0 -g
  MAX_JOBS                   parallel compile jobs (ninja)
  NCCL_HOME / NCCL_INCLUDE_DIR  NCCL headers for decentpy's NCCL communicator (else the
                             nvidia-nccl-cu13/-cu12 wheel's nvidia/nccl/include, else the CUDA
                             toolkit's or the system's nccl.h). Only nccl.h is needed: libnccl is
                             dlopen'ed at run time, never linked. Needs CUDA (nvcc).
  DECENTPY_NO_NCCL=1         never build the NCCL communicator
  DECENTPY_WHEEL=1           wheel build (set by `make wheel`; implied by bdist_wheel): the wheel
                             requires the torch major.minor it was compiled against
                             (torch==X.Y.*) instead of the editable install's torch>=2.3
  DECENTPY_LOCAL_VERSION     override the PEP 440 local version: a string such as "cu130" to use
                             instead of the computed one, or "none" for a plain version (PyPI
                             accepts no local versions)

Version: <version.py>+<local>, where local names what was built: "cpu" or "cu<M><m>" (the nvcc
release, e.g. cu130), "torch<M><m>" (the torch it was compiled against, e.g. torch213), then
"sm<arch>" for each CUDA arch, e.g. 0.1.0+cu130.torch213.sm80.sm90 or 0.1.0+cpu.torch213 (plus
"march<cpu arch>" with DECENTPY_CPU_ARCH and "debug" with DECENTPY_DEBUG). The same configuration
is written to decentpy/_build_info.py (generated, not in git), which goes into the wheel.

Install with: pip install --no-build-isolation -e .      Wheel: make wheel (dist/)
"""
import concurrent.futures
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import List, Optional, Sequence, Tuple

import torch
from setuptools import Distribution, find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

try:  # setuptools >= 70.1 ships bdist_wheel; older ones use the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
#: where the objects of every build go (and ninja finds them again): setuptools' default for plain
#: and wheel builds, which the editable install is given too (see DecentpyBuildExt)
BUILD_TEMP = os.path.join(ROOT, "build", f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")
# The one C++ standard of host and device code (nvcc gets the same -std; CMakeLists.txt reads this line).
CXX_STANDARD = 20


def read_version():
    with open(os.path.join(ROOT, "decentpy", "version.py")) as f:
        return re.search(r'__version__\s*=\s*"([^"]+)"', f.read()).group(1)


def env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def find_nvcc():
    """Path of nvcc and the CUDA root, or (None, None)."""
    if env_flag("DECENTPY_NO_CUDA"):
        return None, None
    import torch

    if torch.version.cuda is None and not env_flag("DECENTPY_BUILD_CUDA"):
        print("decentpy: a CPU build of torch: the CUDA kernels are not compiled (DECENTPY_BUILD_CUDA=1 compiles "
              "them anyway)", flush=True)
        return None, None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
            if os.path.exists(nvcc):
                return nvcc, home
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc", "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        nvcc = os.path.realpath(nvcc)
        return nvcc, os.path.dirname(os.path.dirname(nvcc))
    return None, None


def cuda_archs():
    raw = os.environ.get("DECENTPY_CUDA_ARCHS", "80;90")
    archs = sorted({a.strip().replace(".", "").replace("sm_", "") for a in re.split("[;, ]+", raw) if a.strip()},
                   key=lambda a: int(re.sub(r"\D", "", a) or 0))
    if not archs:
        raise SystemExit("DECENTPY_CUDA_ARCHS is empty")
    return archs


def cuda_lib_dir(home):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        d = os.path.join(home, sub)
        if os.path.exists(os.path.join(d, "libcudart_static.a")):
            return d
    raise SystemExit(f"nvcc found under {home} but no libcudart_static.a next to it; "
                     "set CUDA_HOME or DECENTPY_NO_CUDA=1")


def nvcc_version(nvcc):
    """(major, minor) of the CUDA release of nvcc, from `nvcc --version`."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"decentpy: cannot run {nvcc} --version: {exc}")
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise SystemExit(f"decentpy: cannot read the CUDA release from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def nccl_header_version(header):
    with open(header) as f:
        text = f.read()
    major = re.search(r"#define\s+NCCL_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+NCCL_MINOR\s+(\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else (0, 0)


def find_nccl_include(cuda_home):
    """Directory holding nccl.h (>= 2.14), or None. Explicit NCCL_HOME/NCCL_INCLUDE_DIR must have it."""
    if env_flag("DECENTPY_NO_NCCL"):
        return None
    explicit = []
    if os.environ.get("NCCL_INCLUDE_DIR"):
        explicit.append(os.environ["NCCL_INCLUDE_DIR"])
    for var in ("NCCL_HOME", "NCCL_ROOT"):
        if os.environ.get(var):
            explicit.append(os.path.join(os.environ[var], "include"))
    for d in explicit:
        if os.path.isfile(os.path.join(d, "nccl.h")):
            return d
    if explicit:
        raise SystemExit(f"decentpy: no nccl.h in {explicit} (NCCL_HOME / NCCL_INCLUDE_DIR); "
                         "fix the variable, unset it, or set DECENTPY_NO_NCCL=1")
    site_dirs = [os.path.dirname(os.path.dirname(torch.__file__))] + [p for p in sys.path if p]
    candidates = [os.path.join(p, "nvidia", "nccl", "include") for p in site_dirs]
    candidates += [os.path.join(cuda_home, "include"), "/usr/include", "/usr/local/include"]
    for d in candidates:
        header = os.path.join(d, "nccl.h")
        if os.path.isfile(header):
            if nccl_header_version(header) < (2, 14):
                print(f"decentpy: ignoring {header}: NCCL >= 2.14 needed", file=sys.stderr)
                continue
            return d
    return None



# ---- the C++ toolchain: one C++ runtime in the process ------------------------------------------
# torch and Python load the system's shared libstdc++ (and libgcc_s, libgomp). An extension linked
# with a C++ driver that has no shared libstdc++ (only libstdc++.a, e.g. a toolchain built for
# static binaries) carries a second copy of the runtime: its locale and stream objects are half
# initialised beside the process's, and the first integer formatted into an error message crashed
# the process (SIGSEGV, seen on a GPU image whose CXX was such a g++). The build therefore probes the
# driver before compiling and checks the extension after linking (docs/howto/building.md).

#: symbols that only the C++ runtimes themselves define; an extension that defines one carries its
#: own copy of that runtime. Name -> what it is.
RUNTIME_INTERNALS = {
    "_ZNSt6locale7classicEv": "libstdc++: std::locale::classic()",
    "_ZNSt8ios_base4InitC1Ev": "libstdc++: std::ios_base::Init::Init()",
    "_ZNSo9_M_insertIlEERSoT_": "libstdc++: std::ostream::_M_insert<long>(long)",
    "__cxa_throw": "libstdc++ (libsupc++): __cxa_throw",
    "_Unwind_RaiseException": "libgcc_s: _Unwind_RaiseException",
    "GOMP_parallel": "libgomp: GOMP_parallel",
}

#: what the probe links the way the extension is linked (-shared, -fopenmp): integer formatting
#: through a stream (libstdc++'s locale and num_put), an exception, an OpenMP region
_PROBE_SOURCE = """
#include <sstream>
#include <stdexcept>
#include <string>
std::string decentpy_probe(long n) {
  std::ostringstream s;
  s << n;
  long total = 0;
#pragma omp parallel for reduction(+ : total)
  for (long i = 0; i < n; ++i) total += i;
  if (total < 0) throw std::runtime_error(s.str());
  return s.str();
}
"""


def runtime_copies(shared_object: str) -> Optional[List[str]]:
    """The C++ runtime internals that ``shared_object`` defines itself (:data:`RUNTIME_INTERNALS`):
    empty for an extension that uses the process's shared runtimes; None when binutils' ``nm``
    is not installed (nothing can be checked)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    defined = set()
    for flag in ([], ["-D"]):  # the static symbol table, and the dynamic one (a stripped object has only that)
        r = subprocess.run([nm, "--defined-only", *flag, shared_object], capture_output=True, text=True)
        defined.update(line.split()[-1] for line in r.stdout.splitlines() if line.strip())
    return [what for sym, what in RUNTIME_INTERNALS.items() if sym in defined]


def _cxx_words(cxx: str) -> List[str]:
    return cxx.split()


#: probe results of earlier builds (a probe compiles and links: ~1-3 s), keyed by the driver's file
_PROBE_CACHE = os.path.join(ROOT, "build", "cxx_probe.json")


def cxx_runtime_problem(cxx: str, workdir: str) -> Optional[str]:
    """None when the C++ driver ``cxx`` links a shared object against the shared C++ runtimes;
    else what is wrong with it, in words. It links a small probe as the extension is linked; the
    answer is kept in build/cxx_probe.json for the same driver file (path, size, mtime)."""
    words = _cxx_words(cxx)
    path = shutil.which(words[0]) if words else None
    if path is None:
        return "not found"
    st = os.stat(os.path.realpath(path))
    key = f"{' '.join(words)}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|c++{CXX_STANDARD}"
    try:
        with open(_PROBE_CACHE) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key] or None
    problem = _probe_cxx(words, workdir)
    if problem is None or "cannot be run" not in problem:
        cache[key] = problem or ""
        try:
            os.makedirs(os.path.dirname(_PROBE_CACHE), exist_ok=True)
            with open(_PROBE_CACHE + ".tmp", "w") as f:
                json.dump(cache, f, indent=1)
            os.replace(_PROBE_CACHE + ".tmp", _PROBE_CACHE)
        except OSError:
            pass  # a read-only tree probes again next time
    return problem


def _probe_cxx(words: List[str], workdir: str) -> Optional[str]:
    try:
        lib = subprocess.run(words + ["-print-file-name=libstdc++.so"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot be run ({exc})"
    src = os.path.join(workdir, "decentpy_probe.cpp")
    out = os.path.join(workdir, "decentpy_probe.so")
    with open(src, "w") as f:
        f.write(_PROBE_SOURCE)
    cmd = words + [f"-std=c++{CXX_STANDARD}", "-fPIC", "-fopenmp", "-shared", src, "-o", out]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot be run ({exc})"
    if r.returncode != 0:
        return f"cannot build a C++{CXX_STANDARD} shared object with -fopenmp: {r.stderr.strip()[-300:]}"
    copies = runtime_copies(out)
    no_shared = f"it has no shared libstdc++ (-print-file-name=libstdc++.so answers {lib!r})"
    if copies is None:  # no nm: the driver's own answer is all there is to go by
        return None if os.path.isabs(lib) else no_shared
    if copies:
        why = no_shared if not os.path.isabs(lib) else "it links the C++ runtime statically"
        return f"{why}: a shared object it links defines {', '.join(copies)}"
    return None


def _python_cxx() -> str:
    """The C++ driver Python was configured with (setuptools' choice when $CXX is unset)."""
    return sysconfig.get_config_var("CXX") or "c++"


def _default_cxx() -> str:
    """The C++ driver setuptools would link with: $CXX, else Python's configured one."""
    return os.environ.get("CXX") or _python_cxx()


#: drivers tried, in this order, after Python's own, when the default one would link a second C++
#: runtime (Python's first: the same choice as a build without $CXX, whose objects it then reuses)
CXX_FALLBACKS = ("c++", "g++", "/usr/bin/c++", "/usr/bin/g++", "clang++")


def select_cxx(default: Optional[str] = None, fallbacks: Sequence[str] = CXX_FALLBACKS) -> Tuple[str, Optional[str]]:
    """(the C++ driver to compile and link with, a note saying why it is not ``default``, or None).

    ``default`` is :func:`_default_cxx`; it is kept when it links against the shared runtimes,
    else the first of ``fallbacks`` that does is used. Raises SystemExit, naming the driver and
    what to set, when none does."""
    import tempfile

    default = default or _default_cxx()
    tried: List[Tuple[str, str]] = []
    seen = set()
    candidates = [default, _python_cxx(), *fallbacks] if fallbacks else [default]
    with tempfile.TemporaryDirectory(prefix="decentpy-cxx-") as work:
        for cxx in candidates:
            words = _cxx_words(cxx)
            key = os.path.realpath(shutil.which(words[0]) or words[0]) if words else cxx
            if key in seen:
                continue
            seen.add(key)
            problem = cxx_runtime_problem(cxx, work)
            if problem is None:
                if cxx == default:
                    return cxx, None
                bad = "; ".join(f"{c}: {p}" for c, p in tried)
                return cxx, (f"C++ compiler {cxx} instead of {default} ({bad}; the extension would carry a "
                             "second C++ runtime beside torch's)")
            tried.append((cxx, problem))
    bad = "; ".join(f"{c}: {p}" for c, p in tried)
    raise SystemExit(
        f"decentpy: no C++ compiler here links the extension against the shared C++ runtime ({bad}). "
        f"CXX={os.environ.get('CXX', '(unset)')}. An extension with its own libstdc++ beside torch's crashes "
        "the process at its first formatted error message. Set CXX to a g++ or clang++ that has a shared "
        "libstdc++ (`$CXX -print-file-name=libstdc++.so` prints a full path), e.g. the system's /usr/bin/g++; "
        "docs/howto/building.md")



# ---- version, wheel requirements and decentpy/_build_info.py -------------------------------------
# Everything here depends only on the environment (never on the setup.py command), so every PEP 517
# hook (metadata, wheel, editable) computes the same version and writes the same _build_info.py.

def _local_segment(text):
    return re.sub(r"[^0-9a-z]", "", text.lower())


def local_version(cfg):
    override = os.environ.get("DECENTPY_LOCAL_VERSION", "").strip()
    if override:
        return "" if override.lower() == "none" else override
    parts = ["cu" + cfg.cuda_version.replace(".", "") if cfg.with_cuda else "cpu",
             "torch" + cfg.torch_major_minor.replace(".", "")]
    parts += ["sm" + _local_segment(a) for a in cfg.cuda_archs]
    if cfg.cpu_arch:
        parts.append("march" + _local_segment(cfg.cpu_arch))
    if cfg.debug:
        parts.append("debug")
    return ".".join(p for p in parts if p)


def full_version(cfg):
    base = read_version()
    local = local_version(cfg)
    version = f"{base}+{local}" if local else base
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover
        return version
    try:
        return str(Version(version))  # normalized, as it ends up in the metadata
    except InvalidVersion:
        raise SystemExit(f"decentpy: {version!r} is not a valid PEP 440 version "
                         "(check DECENTPY_LOCAL_VERSION / DECENTPY_CUDA_ARCHS)")


#: the x86 instruction-set macros a -march defines -> the CPU's flag for it in /proc/cpuinfo (where
#: Linux names it differently: SSE3 is "pni", BMI "bmi1", LZCNT "abm", SHA "sha_ni")
ISA_MACRO_FLAGS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__POPCNT__": "popcnt", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe", "__AES__": "aes",
    "__PCLMUL__": "pclmulqdq", "__SHA__": "sha_ni", "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq",
    "__GFNI__": "gfni", "__AVXVNNI__": "avx_vnni", "__AVX512F__": "avx512f", "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512IFMA__": "avx512ifma", "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8", "__AMX_BF16__": "amx_bf16",
}


def march_cpu_flags(cpu_arch: str, cxx: str) -> List[str]:
    """The CPU flags (as /proc/cpuinfo names them) that code compiled with ``-march=cpu_arch`` needs,
    from the instruction-set macros the C++ compiler ``cxx`` defines for it: ``import decentpy``
    refuses, instead of dying with SIGILL, on a CPU without one of them (decentpy/environment.py).
    Empty for the portable default build, and off x86 (no mapping there)."""
    if not cpu_arch:
        return []
    cmd = cxx.split() + [f"-march={cpu_arch}", "-dM", "-E", "-x", "c++", os.devnull]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"decentpy: cannot run `{' '.join(cmd)}` to see what DECENTPY_CPU_ARCH={cpu_arch!r} "
                         f"needs: {exc}")
    if r.returncode != 0:
        first = (r.stderr.strip().splitlines() or ["(no message)"])[0][:300]
        raise SystemExit(f"decentpy: {cxx} rejects DECENTPY_CPU_ARCH={cpu_arch!r} (-march={cpu_arch}): {first}; "
                         "use avx2, avx512, another -march value it accepts, or unset it (the default build "
                         "picks AVX2/AVX-512 at run time)")
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return sorted(flag for macro, flag in ISA_MACRO_FLAGS.items() if macro in defined)


def write_build_info(cfg):
    info = {
        "version": cfg.version,
        "base_version": read_version(),
        "local_version": cfg.version.partition("+")[2],
        "cuda_kernels": cfg.with_cuda,
        "cuda_version": cfg.cuda_version,
        "cuda_archs": cfg.cuda_archs,
        "ptx_arch": cfg.cuda_archs[-1] if cfg.cuda_archs else None,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "torch_requirement": cfg.torch_requirement,
        "cpu_arch": cfg.cpu_arch or None,
        "cxx": cfg.cxx,
        "debug": cfg.debug,
        # what a DECENTPY_CPU_ARCH build needs of the CPU it is imported on
        "cpu_arch_requires": march_cpu_flags(cfg.cpu_arch, cfg.cxx),
    }
    lines = ['"""Build configuration of this decentpy installation.',
             "",
             "Generated by setup.py at build time; do not edit (it is not in git).",
             '"""', ""]
    lines += [f"{k} = {v!r}" for k, v in info.items()]
    lines += ["", "BUILD_INFO = {", *[f"    {k!r}: {k}," for k in info], "}", ""]
    text = "\n".join(lines)
    path = os.path.join(ROOT, "decentpy", "_build_info.py")
    old = open(path).read() if os.path.exists(path) else None
    if old != text:  # unchanged content keeps its mtime (no needless rebuilds/copies)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)



class DecentpyDistribution(Distribution):
    """In a wheel build, pin torch to the major.minor the extension is compiled against.

    pyproject.toml lists the dependencies statically (torch>=2.3, right for an editable install);
    the pin replaces its torch entry once the configuration files are parsed.
    """

    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        if CONFIG.wheel_build:
            reqs = [r for r in (self.install_requires or [])
                    if re.split(r"[\s<>=!~;\[(]", r.strip(), 1)[0].lower() != "torch"]
            self.install_requires = [CONFIG.torch_requirement] + reqs
            self._finalize_requires()


class DecentpyBdistWheel(_bdist_wheel):
    """bdist_wheel from a clean build/lib.* (no stale modules or .so of earlier builds in the
    wheel); build/temp.* is kept, so ninja and the nvcc step only recompile what changed."""

    def run(self):
        build_lib = self.get_finalized_command("build").build_lib
        if os.path.isdir(build_lib):
            shutil.rmtree(build_lib)
        super().run()


class DecentpyBuildExt(BuildExtension):
    """torch's BuildExtension (ninja) plus nvcc-compiled objects for csrc/cuda/*.cu.

    An editable install (``make build``, ``pip install -e .``) compiles into the tree's
    build/temp.* (:data:`BUILD_TEMP`), where plain and wheel builds compile by default: setuptools
    gives it a temporary directory that pip deletes, so every rebuild recompiled all of csrc/
    (~2.5 min after a one-file change) and the wheel build after it (``make wheel``,
    tests/test_wheel.py) found nothing to reuse. Other builds keep their ``build_temp``."""

    def finalize_options(self):
        super().finalize_options()
        if getattr(self, "editable_mode", False):
            self.build_temp = BUILD_TEMP

    def build_extensions(self):
        if CONFIG.with_cuda:
            objects = self._compile_cuda()
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()
        for ext in self.extensions:
            self._check_runtime(self.get_ext_fullpath(ext.name))

    @staticmethod
    def _check_runtime(path: str) -> None:
        """Refuse (and delete) an extension that carries its own copy of a C++ runtime: it would
        crash the process rather than raise (see RUNTIME_INTERNALS)."""
        copies = runtime_copies(path)
        if copies is None:
            print(f"decentpy: WARNING: binutils' nm not found: {path} was not checked for a second C++ runtime",
                  file=sys.stderr)
        elif copies:
            os.remove(path)
            raise SystemExit(f"decentpy: the linked extension {path} defines {', '.join(copies)}: it carries its own "
                             f"copy of a C++ runtime beside the process's and would crash at its first formatted "
                             f"error message; it was deleted. The link used CXX={os.environ.get('CXX')}; set CXX to "
                             "a compiler with a shared libstdc++ (docs/howto/building.md)")

    def _compile_cuda(self):
        archs = cuda_archs()
        top = archs[-1]
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
        arch_list = ",".join([f"sm_{a}" for a in archs] + [f"compute_{top}"])
        out_dir = os.path.join(os.path.abspath(self.build_temp), "cuda")
        os.makedirs(out_dir, exist_ok=True)
        headers = [p for pat in ("cuda/*.h", "cuda/*.cuh", "kernels/*.h")
                   for p in glob.glob(os.path.join(CSRC, pat))]
        newest_header = max([os.path.getmtime(h) for h in headers] + [0])
        # -ccbin: the host compiler of the C++ files (its headers match the runtime the extension links)
        flags = ["-ccbin", CONFIG.cxx, "-O3" if not CONFIG.debug else "-O0", f"-std=c++{CXX_STANDARD}", "-Xcompiler", "-fPIC",
                 "-I" + CSRC, f'-DDECENTPY_CUDA_ARCHS="{arch_list}"'] + gencode
        if CONFIG.debug:
            flags += ["-g", "-lineinfo"]
        stamp = os.path.join(out_dir, "flags.txt")
        old_flags = open(stamp).read() if os.path.exists(stamp) else None
        objects, stale = [], []
        for src in CONFIG.cu_sources:
            obj = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
            objects.append(obj)
            if (os.path.exists(obj) and old_flags == " ".join(flags)
                    and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)):
                continue
            stale.append([CONFIG.nvcc] + flags + ["-c", src, "-o", obj])

        def compile_one(cmd):
            print("decentpy: " + " ".join(cmd), flush=True)
            subprocess.check_call(cmd)

        # the .cu files in parallel too (MAX_JOBS, as ninja's C++ jobs): nvcc is most of a cold build
        jobs = max(1, int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(min(jobs, max(1, len(stale)))) as pool:
            for future in [pool.submit(compile_one, cmd) for cmd in stale]:
                future.result()
        with open(stamp, "w") as f:
            f.write(" ".join(flags))
        return objects


@dataclasses.dataclass
class BuildConfig:
    """What this build compiles, from the environment only (never from the setup.py command line,
    except whether it builds a wheel), so every PEP 517 hook computes the same version."""

    nvcc: Optional[str]
    cuda_home: Optional[str]
    cu_sources: List[str]
    cpp_sources: List[str]
    debug: bool
    cpu_arch: str
    cxx_flags: List[str]
    define_macros: List[Tuple[str, str]]
    link_args: List[str]
    include_dirs: List[str]
    nccl_include: Optional[str]
    torch_major_minor: str
    cuda_version: Optional[str]
    cuda_archs: List[str]
    wheel_build: bool
    cxx: str = "c++"                 # the C++ driver of every compile and the link (select_cxx)
    cxx_note: Optional[str] = None   # why it is not the default one, if it is not
    version: str = ""

    @property
    def with_cuda(self) -> bool:
        return bool(self.nvcc) and bool(self.cu_sources)

    @property
    def with_nccl(self) -> bool:
        return self.nccl_include is not None

    @property
    def torch_requirement(self) -> str:
        # A wheel carries a compiled extension: it only works with the torch it was built against.
        return f"torch=={self.torch_major_minor}.*"


def configure() -> BuildConfig:
    nvcc, cuda_home = find_nvcc()
    cu_sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    with_cuda = bool(nvcc) and bool(cu_sources)
    cpp_sources = sorted(
        os.path.relpath(p, ROOT)
        for p in glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True)
        if os.sep + "tests" + os.sep not in os.path.relpath(p, CSRC) and
        not os.path.relpath(p, CSRC).startswith("tests" + os.sep)
    )
    debug = env_flag("DECENTPY_DEBUG")
    # -fvisibility=hidden: only PyInit__C is exported (pybind11's recommendation; its own types are
    # hidden, and bound types of default visibility would warn). -std given explicitly: the same
    # standard as nvcc's, whatever torch's default is.
    cxx_flags = ["-O0" if debug else "-O3", f"-std=c++{CXX_STANDARD}", "-fopenmp", "-Wno-psabi",
                 "-Wno-maybe-uninitialized", "-fvisibility=hidden"]
    # Python's CFLAGS carry -g: no debug info unless asked (smaller .so, faster builds).
    cxx_flags.append("-g" if debug else "-g0")
    cpu_arch = os.environ.get("DECENTPY_CPU_ARCH", "").strip()
    cpu_arch = {"avx2": "x86-64-v3", "avx512": "x86-64-v4", "default": ""}.get(cpu_arch.lower(), cpu_arch)
    if cpu_arch:
        cxx_flags.append(f"-march={cpu_arch}")
    define_macros = []
    link_args = ["-fopenmp"]
    if with_cuda:
        define_macros.append(("DECENTPY_WITH_CUDA", "1"))
        # The static runtime by its path, not -L<dir> -lcudart_static: a -L directory is searched first
        # for every library, the compiler's implicit -lstdc++ too, and a libstdc++.a there would be
        # linked into the extension beside the process's shared one. (An H200 build defined
        # libstdc++'s own integer formatting and crashed in it; this link path is the suspected
        # cause, not a confirmed one. tests/test_config_report.py guards the result.)
        link_args += [os.path.join(cuda_lib_dir(cuda_home), "libcudart_static.a"), "-ldl", "-lrt", "-lpthread"]
    include_dirs = [CSRC]
    nccl_include = find_nccl_include(cuda_home) if with_cuda else None
    if nccl_include is not None:
        define_macros.append(("DECENTPY_WITH_NCCL", "1"))
        # nccl.h includes cuda_runtime.h; system dirs stay implicit (-I/usr/include breaks libstdc++).
        for d in (nccl_include, os.path.join(cuda_home, "include")):
            if os.path.realpath(d) not in ("/usr/include", "/usr/local/include") and d not in include_dirs:
                include_dirs.append(d)
    torch_version = torch.__version__.split("+")[0]  # "2.13.0" (no local part)
    cfg = BuildConfig(
        nvcc=nvcc, cuda_home=cuda_home, cu_sources=cu_sources, cpp_sources=cpp_sources, debug=debug,
        cpu_arch=cpu_arch, cxx_flags=cxx_flags, define_macros=define_macros, link_args=link_args,
        include_dirs=include_dirs, nccl_include=nccl_include,
        torch_major_minor=".".join(torch_version.split(".")[:2]),
        cuda_version="%d.%d" % nvcc_version(nvcc) if with_cuda else None,
        cuda_archs=cuda_archs() if with_cuda else [],
        wheel_build=env_flag("DECENTPY_WHEEL") or "bdist_wheel" in sys.argv[1:])
    cfg.cxx, cfg.cxx_note = select_cxx()
    cfg.version = full_version(cfg)
    return cfg


CONFIG: BuildConfig  # set by main(): the build classes above read it when setuptools runs them


def main() -> None:
    global CONFIG
    CONFIG = cfg = configure()
    write_build_info(cfg)
    # torch's ninja compile and setuptools' link both take the C++ driver from $CXX: one compiler for both
    os.environ["CXX"] = cfg.cxx
    print(f"decentpy: {cfg.cxx_note or 'C++ compiler ' + cfg.cxx}", file=sys.stderr)
    print(f"decentpy: CUDA kernels {'ON (' + cfg.nvcc + ')' if cfg.with_cuda else 'OFF'}"
          f"{'' if cfg.with_cuda or not cfg.nvcc else ' (no csrc/cuda/*.cu)'}", file=sys.stderr)
    print(f"decentpy: NCCL communicator {'ON (' + cfg.nccl_include + ')' if cfg.with_nccl else 'OFF'}",
          file=sys.stderr)
    print(f"decentpy: version {cfg.version}"
          f"{' (wheel: requires ' + cfg.torch_requirement + ')' if cfg.wheel_build else ''}", file=sys.stderr)
    setup(
        name="decentpy",
        version=cfg.version,
        distclass=DecentpyDistribution,
        packages=find_packages(include=["decentpy", "decentpy.*"]),
        ext_modules=[
            CppExtension(
                name="decentpy._C",
                sources=cfg.cpp_sources,
                include_dirs=cfg.include_dirs,
                define_macros=cfg.define_macros,
                extra_compile_args={"cxx": cfg.cxx_flags},
                extra_link_args=cfg.link_args,
            )
        ],
        cmdclass={"build_ext": DecentpyBuildExt.with_options(use_ninja=True),
                  "bdist_wheel": DecentpyBdistWheel},
        zip_safe=False,
    )


if __name__ == "__main__":  # setuptools' PEP 517 backend runs this file as __main__; importing it does nothing
    main()

"""Build of decentpy and its C++ extension decentpy._C.

Always built: the CPU kernels, bucket packing and bindings (a torch CppExtension, so a CPU-only
torch works). When nvcc is found, every csrc/cuda/*.cu is compiled by nvcc into an object file
(no torch headers in .cu files), linked into the same extension together with the static CUDA
runtime, and DECENTPY_WITH_CUDA is defined for the .cpp files.

Environment:
  DECENTPY_NO_CUDA=1         never build the CUDA kernels
  CUDA_HOME / CUDA_PATH      CUDA toolkit to use (else /usr/local/cuda, else nvcc on PATH)
  DECENTPY_CUDA_ARCHS        semicolon/comma separated SM list, default "80;90" (+PTX of the highest)
  DECENTPY_CPU_ARCH          optional -march for all C++ files: avx2 (= x86-64-v3), avx512
                             (= x86-64-v4) or any -march value. Default none (portable): the
                             kernels are compiled for baseline, AVX2 and AVX512 and pick one at
                             run time (torch's own choice, ATEN_CPU_CAPABILITY overrides)
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
import glob
import os
import re
import shutil
import subprocess
import sys

import torch
from setuptools import Distribution, find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

try:  # setuptools >= 70.1 ships bdist_wheel; older ones use the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def read_version():
    with open(os.path.join(ROOT, "decentpy", "version.py")) as f:
        return re.search(r'__version__\s*=\s*"([^"]+)"', f.read()).group(1)


def env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def find_nvcc():
    """Path of nvcc and the CUDA root, or (None, None)."""
    if env_flag("DECENTPY_NO_CUDA"):
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


NVCC, CUDA_HOME = find_nvcc()
CU_SOURCES = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
WITH_CUDA = bool(NVCC) and bool(CU_SOURCES)

cpp_sources = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True)
    if os.sep + "tests" + os.sep not in os.path.relpath(p, CSRC) and
    not os.path.relpath(p, CSRC).startswith("tests" + os.sep)
)

debug = env_flag("DECENTPY_DEBUG")
# -fvisibility=hidden: only PyInit__C is exported (pybind11's recommendation; its own types are
# hidden, and bound types of default visibility would warn).
cxx_flags = ["-O0" if debug else "-O3", "-fopenmp", "-Wno-psabi", "-Wno-maybe-uninitialized", "-fvisibility=hidden"]
# Python's CFLAGS carry -g: no debug info unless asked (smaller .so, faster builds).
cxx_flags.append("-g" if debug else "-g0")
cpu_arch = os.environ.get("DECENTPY_CPU_ARCH", "").strip()
cpu_arch = {"avx2": "x86-64-v3", "avx512": "x86-64-v4", "default": ""}.get(cpu_arch.lower(), cpu_arch)
if cpu_arch:
    cxx_flags.append(f"-march={cpu_arch}")
define_macros = []
link_args = ["-fopenmp"]
if WITH_CUDA:
    define_macros.append(("DECENTPY_WITH_CUDA", "1"))
    link_args += [f"-L{cuda_lib_dir(CUDA_HOME)}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]


def nccl_header_version(header):
    with open(header) as f:
        text = f.read()
    major = re.search(r"#define\s+NCCL_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+NCCL_MINOR\s+(\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else (0, 0)


def find_nccl_include():
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
    candidates += [os.path.join(CUDA_HOME, "include"), "/usr/include", "/usr/local/include"]
    for d in candidates:
        header = os.path.join(d, "nccl.h")
        if os.path.isfile(header):
            if nccl_header_version(header) < (2, 14):
                print(f"decentpy: ignoring {header}: NCCL >= 2.14 needed", file=sys.stderr)
                continue
            return d
    return None


include_dirs = [CSRC]
NCCL_INCLUDE = find_nccl_include() if WITH_CUDA else None
WITH_NCCL = NCCL_INCLUDE is not None
if WITH_NCCL:
    define_macros.append(("DECENTPY_WITH_NCCL", "1"))
    # nccl.h includes cuda_runtime.h; system dirs stay implicit (-I/usr/include breaks libstdc++).
    for d in (NCCL_INCLUDE, os.path.join(CUDA_HOME, "include")):
        if os.path.realpath(d) not in ("/usr/include", "/usr/local/include") and d not in include_dirs:
            include_dirs.append(d)


# ---- version, wheel requirements and decentpy/_build_info.py -------------------------------------
# Everything here depends only on the environment (never on the setup.py command), so every PEP 517
# hook (metadata, wheel, editable) computes the same version and writes the same _build_info.py.

def _local_segment(text):
    return re.sub(r"[^0-9a-z]", "", text.lower())


TORCH_VERSION = torch.__version__.split("+")[0]          # "2.13.0" (no local part)
TORCH_MAJOR_MINOR = ".".join(TORCH_VERSION.split(".")[:2])  # "2.13"
CUDA_VERSION = "%d.%d" % nvcc_version(NVCC) if WITH_CUDA else None
CUDA_ARCHS = cuda_archs() if WITH_CUDA else []


def local_version():
    override = os.environ.get("DECENTPY_LOCAL_VERSION", "").strip()
    if override:
        return "" if override.lower() == "none" else override
    parts = ["cu" + CUDA_VERSION.replace(".", "") if WITH_CUDA else "cpu",
             "torch" + TORCH_MAJOR_MINOR.replace(".", "")]
    parts += ["sm" + _local_segment(a) for a in CUDA_ARCHS]
    if cpu_arch:
        parts.append("march" + _local_segment(cpu_arch))
    if debug:
        parts.append("debug")
    return ".".join(p for p in parts if p)


def full_version():
    base = read_version()
    local = local_version()
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


VERSION = full_version()
# A wheel carries a compiled extension: it only works with the torch it was built against.
WHEEL_BUILD = env_flag("DECENTPY_WHEEL") or "bdist_wheel" in sys.argv[1:]
TORCH_REQUIREMENT = f"torch=={TORCH_MAJOR_MINOR}.*"


def write_build_info():
    info = {
        "version": VERSION,
        "base_version": read_version(),
        "local_version": VERSION.partition("+")[2],
        "cuda_kernels": WITH_CUDA,
        "cuda_version": CUDA_VERSION,
        "cuda_archs": CUDA_ARCHS,
        "ptx_arch": CUDA_ARCHS[-1] if CUDA_ARCHS else None,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "torch_requirement": TORCH_REQUIREMENT,
        "cpu_arch": cpu_arch or None,
        "debug": debug,
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


write_build_info()


class DecentpyDistribution(Distribution):
    """In a wheel build, pin torch to the major.minor the extension is compiled against.

    pyproject.toml lists the dependencies statically (torch>=2.3, right for an editable install);
    the pin replaces its torch entry once the configuration files are parsed.
    """

    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        if WHEEL_BUILD:
            reqs = [r for r in (self.install_requires or [])
                    if re.split(r"[\s<>=!~;\[(]", r.strip(), 1)[0].lower() != "torch"]
            self.install_requires = [TORCH_REQUIREMENT] + reqs
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
    """torch's BuildExtension (ninja) plus nvcc-compiled objects for csrc/cuda/*.cu."""

    def build_extensions(self):
        if WITH_CUDA:
            objects = self._compile_cuda()
            for ext in self.extensions:
                ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extensions()

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
        flags = ["-O3" if not debug else "-O0", "-std=c++17", "-Xcompiler", "-fPIC",
                 "-I" + CSRC, f'-DDECENTPY_CUDA_ARCHS="{arch_list}"'] + gencode
        if debug:
            flags += ["-g", "-lineinfo"]
        stamp = os.path.join(out_dir, "flags.txt")
        old_flags = open(stamp).read() if os.path.exists(stamp) else None
        objects = []
        for src in CU_SOURCES:
            obj = os.path.join(out_dir, os.path.splitext(os.path.basename(src))[0] + ".o")
            objects.append(obj)
            if (os.path.exists(obj) and old_flags == " ".join(flags)
                    and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)):
                continue
            cmd = [NVCC] + flags + ["-c", src, "-o", obj]
            print("decentpy: " + " ".join(cmd), flush=True)
            subprocess.check_call(cmd)
        with open(stamp, "w") as f:
            f.write(" ".join(flags))
        return objects


print(f"decentpy: CUDA kernels {'ON (' + NVCC + ')' if WITH_CUDA else 'OFF'}"
      f"{'' if WITH_CUDA or not NVCC else ' (no csrc/cuda/*.cu)'}", file=sys.stderr)
print(f"decentpy: NCCL communicator {'ON (' + NCCL_INCLUDE + ')' if WITH_NCCL else 'OFF'}", file=sys.stderr)
print(f"decentpy: version {VERSION}"
      f"{' (wheel: requires ' + TORCH_REQUIREMENT + ')' if WHEEL_BUILD else ''}", file=sys.stderr)

setup(
    name="decentpy",
    version=VERSION,
    distclass=DecentpyDistribution,
    packages=find_packages(include=["decentpy", "decentpy.*"]),
    ext_modules=[
        CppExtension(
            name="decentpy._C",
            sources=cpp_sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": DecentpyBuildExt.with_options(use_ninja=True),
              "bdist_wheel": DecentpyBdistWheel},
    zip_safe=False,
)

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

Install with: pip install --no-build-isolation -e .
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

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
cxx_flags = ["-O0" if debug else "-O3", "-fopenmp", "-Wno-psabi", "-Wno-maybe-uninitialized"]
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

setup(
    name="decentpy",
    version=read_version(),
    packages=find_packages(include=["decentpy", "decentpy.*"]),
    ext_modules=[
        CppExtension(
            name="decentpy._C",
            sources=cpp_sources,
            include_dirs=[CSRC],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_args,
        )
    ],
    cmdclass={"build_ext": DecentpyBuildExt.with_options(use_ninja=True)},
    zip_safe=False,
)

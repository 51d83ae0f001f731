"""`make wheel` end to end: build the wheel, check its local version tag and metadata, install it
into a fresh venv (with the same torch) and run ``python -m decentpy`` there, outside the repo.

Slow (marked ``slow``): the wheel is built in-tree with the same command as ``make wheel``, so the
objects in build/temp.* from ``make build`` are reused (an unchanged tree only relinks, ~15 s);
creating the venv and installing torch into it takes ~30 s. Deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 1800  # a cold build compiles everything (~4 min on 2 idle cores); warm: seconds
INSTALL_TIMEOUT = 600


def _run(cmd, *, cwd, env=None, timeout):
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{exc.output or ''}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n{proc.stdout[-8000:]}")
    return proc.stdout


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _find_nvcc():
    """nvcc as setup.py finds it (DECENTPY_NO_CUDA; a CPU torch without DECENTPY_BUILD_CUDA; CUDA_HOME,
    CUDA_PATH, /usr/local/cuda, PATH)."""
    import torch

    if _env_flag("DECENTPY_NO_CUDA") or (torch.version.cuda is None and not _env_flag("DECENTPY_BUILD_CUDA")):
        return None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc")


def _expected_local_version():
    """The local version setup.py must give this build, derived independently of setup.py."""
    import torch

    override = os.environ.get("DECENTPY_LOCAL_VERSION", "").strip()
    if override:
        return None  # whatever was asked for; nothing to derive
    torch_tag = "torch" + "".join(torch.__version__.split("+")[0].split(".")[:2])
    nvcc = _find_nvcc()
    if nvcc is None or not list((ROOT / "csrc" / "cuda").glob("*.cu")):
        parts = ["cpu", torch_tag]
    else:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        major, minor = re.search(r"release (\d+)\.(\d+)", out).groups()
        raw = os.environ.get("DECENTPY_CUDA_ARCHS", "80;90")
        archs = sorted({a.strip().replace(".", "").replace("sm_", "")
                        for a in re.split("[;, ]+", raw) if a.strip()},
                       key=lambda a: int(re.sub(r"\D", "", a) or 0))
        parts = [f"cu{major}{minor}", torch_tag] + [f"sm{a.lower()}" for a in archs]
    cpu_arch = os.environ.get("DECENTPY_CPU_ARCH", "").strip()
    if cpu_arch and cpu_arch.lower() != "default":
        return None  # "march..." suffix: covered by the structural checks only
    if _env_flag("DECENTPY_DEBUG"):
        parts.append("debug")
    return ".".join(parts)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Build the wheel exactly as `make wheel` does (in-tree, reusing build/temp.*): (wheel, pip's
    verbose log)."""
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, DECENTPY_WHEEL="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                "-w", out, ROOT], cwd=ROOT, env=env, timeout=BUILD_TIMEOUT)
    wheels = sorted(out.glob("decentpy-*.whl"))
    assert len(wheels) == 1, (wheels, log[-4000:])
    return wheels[0], log


@pytest.fixture(scope="module")
def wheel(built):
    return built[0]


def test_wheel_reuses_the_objects_of_make_build(built):
    """After `make build` of this very tree the wheel only relinks: the editable install compiles
    into build/temp.* too (it used to compile in a temporary directory that pip deletes, and the
    wheel recompiled all of csrc/: 163 s of CI)."""
    stamp = Path(sys.prefix) / ".build-stamp"  # the Makefile's BUILD_STAMP, in the venv running the tests
    if not stamp.exists():
        pytest.skip(f"no {stamp}: the extension was not built by `make build` in this environment")
    inputs = [ROOT / "setup.py", ROOT / "pyproject.toml"] + [p for p in (ROOT / "csrc").rglob("*") if p.is_file()]
    changed = [p for p in inputs if p.stat().st_mtime > stamp.stat().st_mtime]
    if changed:
        pytest.skip(f"{changed[0].relative_to(ROOT)} changed after the last `make build`: the wheel had to "
                    "compile it")
    _, log = built
    compiled = [line.strip() for line in log.splitlines()
                if re.match(r"\s*\[\d+/\d+\] c\+\+ ", line) or re.match(r"\s*decentpy: \S*nvcc ", line)]
    assert not compiled, "the wheel build recompiled objects of an unchanged tree:\n" + "\n".join(
        c[:200] for c in compiled)
    assert "ninja: no work to do." in log, log[-4000:]


def _wheel_version(path):
    # decentpy-<version>-<python tag>-<abi tag>-<platform tag>.whl
    return path.name.split("-")[1]


def _read(zf, suffix):
    names = [n for n in zf.namelist() if n.endswith(suffix)]
    assert len(names) == 1, (suffix, zf.namelist())
    return zf.read(names[0]).decode()


def test_wheel_tag_and_metadata(wheel):
    import torch

    version = _wheel_version(wheel)
    base, _, local = version.partition("+")
    version_py = (ROOT / "decentpy" / "version.py").read_text()
    assert base == re.search(r'__version__\s*=\s*"([^"]+)"', version_py).group(1)
    expected = _expected_local_version()
    if expected is not None:
        assert local == expected, f"{wheel.name}: local version {local!r}, expected {expected!r}"
    # PEP 440 local segments: lowercase alphanumerics separated by dots
    assert re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", local), local

    with zipfile.ZipFile(wheel) as zf:
        sos = [n for n in zf.namelist() if re.fullmatch(r"decentpy/_C\..*\.so", n)]
        assert len(sos) == 1, zf.namelist()
        assert "decentpy/py.typed" in zf.namelist(), zf.namelist()  # PEP 561 marker ships
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist()), zf.namelist()
        metadata = _read(zf, ".dist-info/METADATA")
        info_src = _read(zf, "decentpy/_build_info.py")
    assert f"\nVersion: {version}\n" in metadata
    assert "\nLicense-Expression: BSD-3-Clause\n" in metadata, metadata[:2000]
    # compiled against this torch: the wheel must pin its major.minor
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    requires = re.findall(r"^Requires-Dist: (torch\b.*)$", metadata, re.M)
    assert requires == [f"torch=={major_minor}.*"], requires

    info = {}
    exec(compile(info_src, "_build_info.py", "exec"), info)
    assert info["version"] == version
    assert info["torch_version"] == torch.__version__
    assert bool(info["cuda_kernels"]) == local.startswith("cu")
    assert [f"sm{a}" for a in info["cuda_archs"]] == [p for p in local.split(".") if p.startswith("sm")]


def test_wheel_installs_and_runs_in_fresh_venv(wheel, tmp_path):
    import torch

    venv = tmp_path / "venv"
    work = tmp_path / "elsewhere"  # not the repo: must import the installed package
    work.mkdir()
    # The base interpreter, not this venv's (a venv of a venv would still be fresh, but be exact).
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    _run([base_python, "-m", "venv", venv], cwd=work, timeout=INSTALL_TIMEOUT)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", OMP_NUM_THREADS="1")
    torch_version = torch.__version__.split("+")[0]
    # torch first (the local CPU wheel: seconds), then the wheel with its other dependencies;
    # the wheel's torch==X.Y.* pin is then already satisfied and nothing else is pulled.
    _run([py, "-m", "pip", "install", "-q", f"torch=={torch_version}"], cwd=work, env=env,
         timeout=INSTALL_TIMEOUT)
    _run([py, "-m", "pip", "install", "-q", wheel], cwd=work, env=env, timeout=INSTALL_TIMEOUT)

    version = _wheel_version(wheel)
    listed = _run([py, "-m", "pip", "show", "decentpy"], cwd=work, env=env, timeout=120)
    assert f"Version: {version}" in listed, listed

    out = _run([py, "-m", "decentpy"], cwd=work, env=env, timeout=300)
    assert re.search(rf"^\s*decentpy:\s+{re.escape(version)}\b", out, re.M), out  # the full build version
    assert re.search(r"^\s*CPU kernels:\s+compiled, usable here", out, re.M), out
    assert "NOT available" not in out, out
    has_cuda = "+cu" in version
    assert re.search(rf"^\s*CUDA kernels:\s+{'compiled' if has_cuda else 'not compiled'}", out, re.M), out

    probe = _run([py, "-c",
                  "import json, decentpy, decentpy._build_info as b; "
                  "print(json.dumps([decentpy.__file__, b.version, decentpy.__version__, "
                  "decentpy._C.build_info()['cuda_archs']]))"],
                 cwd=work, env=env, timeout=300)
    where, built_version, package_version, archs = json.loads(probe.strip().splitlines()[-1])
    assert Path(where).resolve().is_relative_to(venv.resolve()), where  # not the source tree
    assert built_version == version
    assert package_version == version  # decentpy.__version__ is the wheel's version, local part included
    # the archs the tag names are the ones the binary carries
    tag_archs = [p[2:] for p in version.partition("+")[2].split(".") if p.startswith("sm")]
    assert sorted(a.strip() for a in archs.split(",") if a.strip().startswith("sm_")) == \
        sorted(f"sm_{a}" for a in tag_archs), (archs, version)

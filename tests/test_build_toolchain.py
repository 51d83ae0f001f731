"""The build never installs an extension that carries its own C++ runtime (issue 40).

A C++ driver without a shared libstdc++ (seen on a GPU image: ``CXX=/opt/gcc/bin/g++``, only
``libstdc++.a``) linked libstdc++ into ``decentpy._C`` beside the process's shared one, and the
first integer formatted into an error message crashed the process. Here a wrapper ``g++`` plays
that driver on any machine: it answers ``-print-file-name=libstdc++.so`` with the bare name, as
such a toolchain does, and adds ``-static-libstdc++`` to every ``-shared`` link. The checks run
against what the linker really produced (``nm``), not against setup.py's own answers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                                reason="needs g++ and binutils' nm")

WRAPPER = """#!/bin/sh
for a in "$@"; do [ "$a" = "-print-file-name=libstdc++.so" ] && { echo libstdc++.so; exit 0; }; done
case " $* " in *" -shared "*) exec REAL "$@" -static-libstdc++ ;; esac
exec REAL "$@"
"""

CHILD_REFUSAL = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("decentpy._C", sys.argv[1])
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
p = torch.zeros(100)
try:
    C.mix_and_step(kind=C.OptKind.ADAM, param=p, grad=torch.zeros(100), states=[torch.zeros(99), torch.zeros(100)],
                   segments=torch.tensor([[0, 100, 0]]), groups=[C.GroupHyper(lr=1e-3, weight_decay=0.0, bias_step=1)])
except RuntimeError as e:
    print("RuntimeError:", e)
"""


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    """setup.py as a module (its main() only runs as a script)."""
    spec = importlib.util.spec_from_file_location("decentpy_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def static_gxx(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A g++ that links libstdc++ statically into shared objects (a static-only toolchain)."""
    d = tmp_path_factory.mktemp("static-gxx")
    path = d / "g++"
    path.write_text(WRAPPER.replace("REAL", os.path.realpath(shutil.which("g++"))))
    path.chmod(0o755)
    return str(path)


def _nm_defined(path: str) -> set:
    out = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_the_wrapper_reproduces_the_bad_link(static_gxx: str, tmp_path: Path) -> None:
    """The premise: a shared object the wrapper links defines libstdc++'s integer formatting."""
    src = tmp_path / "x.cpp"
    src.write_text("#include <sstream>\nstd::string f(long n) { std::ostringstream s; s << n; return s.str(); }\n")
    subprocess.run([static_gxx, "-fPIC", "-shared", str(src), "-o", str(tmp_path / "x.so")], check=True)
    assert "_ZNSo9_M_insertIlEERSoT_" in _nm_defined(str(tmp_path / "x.so"))


def test_a_static_runtime_driver_is_replaced_and_said(setup_py: ModuleType, static_gxx: str) -> None:
    cxx, note = setup_py.select_cxx(static_gxx)
    assert cxx != static_gxx and setup_py.cxx_runtime_problem(cxx, str(ROOT / "build")) is None
    assert note is not None and static_gxx in note and "no shared libstdc++" in note, note
    assert "std::ostream::_M_insert<long>(long)" in note, note


def test_no_usable_driver_stops_the_build_with_what_to_set(setup_py: ModuleType, static_gxx: str) -> None:
    with pytest.raises(SystemExit) as exc:
        setup_py.select_cxx(static_gxx, fallbacks=[])
    msg = str(exc.value)
    assert static_gxx in msg and "no shared libstdc++" in msg and "Set CXX to" in msg, msg


def test_a_linked_extension_with_its_own_runtime_is_deleted(setup_py: ModuleType, static_gxx: str,
                                                            tmp_path: Path) -> None:
    """The post-link check of every build: an extension that defines libstdc++ internals is
    deleted and the build fails, so it can never be installed."""
    src = tmp_path / "ext.cpp"
    src.write_text(setup_py._PROBE_SOURCE)
    so = tmp_path / "_C.so"
    subprocess.run([static_gxx, "-std=c++20", "-fPIC", "-fopenmp", "-shared", str(src), "-o", str(so)], check=True)
    with pytest.raises(SystemExit, match=r"defines libstdc\+\+: std::locale::classic\(\)"):
        setup_py.DecentpyBuildExt._check_runtime(str(so))
    assert not so.exists()


@pytest.mark.slow
def test_a_build_with_the_static_driver_gives_an_extension_that_raises(static_gxx: str, tmp_path: Path) -> None:
    """``CXX`` set to the static-runtime driver, as the GPU image sets it: the build says which
    compiler it used instead and why, its extension defines no libstdc++ internals, and a refusal
    whose message formats integers raises a RuntimeError naming them (in a child: a crash would
    fail this test, not end the session). The objects of ``make build`` are reused (the same
    compiler is chosen), so this only relinks."""
    env = dict(os.environ, CXX=static_gxx)
    out = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("decentpy: C++ compiler")]
    assert line and f"instead of {static_gxx}" in line[0] and "no shared libstdc++" in line[0], proc.stderr[-3000:]
    built = list(out.glob("decentpy/_C*.so"))
    assert len(built) == 1, list(out.rglob("*"))
    defined = _nm_defined(str(built[0]))
    assert not {"_ZNSt6locale7classicEv", "_ZNSo9_M_insertIlEERSoT_", "__cxa_throw"} & defined
    child = subprocess.run([sys.executable, "-c", CHILD_REFUSAL, str(built[0])], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert child.returncode == 0, f"the child died (returncode {child.returncode}): {child.stderr[-2000:]}"
    assert "RuntimeError:" in child.stdout and "99" in child.stdout and "100" in child.stdout, child.stdout

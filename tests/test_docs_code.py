"""Every code block of the README and the documentation site that claims to run, run (CPU, gloo).

The rules the pages follow (docs/index.md says so to readers):
- a ``python`` block whose first line says ``run with: torchrun --standalone --nproc_per_node=N ...``
  or ``run with: python ...`` is a complete script: it is run here, as pasted (N = 2 workers);
- any other ``python`` block begins ``# not run:`` with the reason (a fragment of a larger script);
- a shell block (``bash``) either only runs ``make <target>`` (checked to be a Makefile target;
  CI's .ci/run runs ``make test`` and ``make docs``), or commands of the virtual environment
  ``make train`` makes (``.venv/bin/...``, run here as pasted from the clone's root), or begins
  ``# not run by the docs tests:`` with the reason (cluster launches, wheel builds);
- ``literalinclude`` of a script: the migration pairs and the quickstart, run here too.
The README's quickstart must be examples/quickstart.py verbatim (the docs include that file); every
script prints its result (each migration script one line on rank 0). Scripts run in a temporary
directory (their relative paths, e.g. checkpoints, land there).

All scripts run in one group of 2 spawned workers, one after the other, each with its own process
group on a fresh port; single-process blocks run on rank 0. The migration pairs are compared: the
decentpy script against the script it replaces.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import runpy
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from dist_harness import run_workers
from tools.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                      if "_build" not in p.parts and "_generated" not in p.parts)
FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1\s*$", re.S | re.M)
RUN_WITH = re.compile(r"run with: (?:torchrun --standalone --nproc_per_node=(\d+)|python) ")
CHECKPOINTS = " with a checkpoint directory"  # a migration script's second run, main(checkpoint_dir=...)
MIGRATION = ["torch_ddp_before", "torch_ddp_after", "decent_dp_before", "decent_dp_after",
             "fairscale_before", "fairscale_after", "torchft_diloco_before", "torchft_diloco_after"]
#: before-scripts that are shown but not run: torchft's needs its Lighthouse server and a replica group per
#: process (tests/test_local_sgd.py compares decentpy.DiLoCo with torchft's DiLoCo class instead)
NOT_RUN = {"torchft_diloco_before"}


def blocks(path: Path) -> List[Tuple[str, str, int]]:
    """(info string, code, line) of every fenced block in a Markdown page."""
    text = path.read_text()
    return [(m.group(2).strip(), m.group(3), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def runnable_blocks() -> List[Tuple[str, str, int]]:
    """(name, code, nproc) of every python block that claims to run."""
    out = []
    for page in PAGES:
        for info, code, line in blocks(page):
            if info == "python" and not code.startswith("# not run:"):
                m = RUN_WITH.search(code.splitlines()[0])
                out.append((f"{page.relative_to(ROOT)}:{line}", code, int(m.group(1) or 1) if m else 0))
    return out


def test_every_block_is_marked() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, re.M))
    problems = []
    for page in PAGES:
        for info, code, line in blocks(page):
            where = f"{page.relative_to(ROOT)}:{line}"
            first = code.splitlines()[0] if code.strip() else ""
            if info == "python":
                if first.startswith("# not run:"):
                    if len(first) < len("# not run: ") + 10:
                        problems.append(f"{where}: say why it is not run")
                elif not RUN_WITH.search(first):
                    problems.append(f"{where}: a python block must begin with 'run with: ...' or '# not run: <why>'")
            elif info in ("bash", "sh", "shell", "console"):
                if first.startswith("# not run by the docs tests:"):
                    continue
                for cmd in (l.split("#")[0].strip() for l in code.splitlines()):
                    if cmd.startswith(".venv/bin/"):  # run as pasted (test_commands_run_as_pasted)
                        continue
                    if cmd and not (cmd.startswith("make ") and cmd.split()[1] in targets):
                        problems.append(f"{where}: {cmd!r} is neither a Makefile target nor marked not run")
            elif info.startswith("{literalinclude}"):
                target = (page.parent / info.split(None, 1)[1]).resolve()
                rel = target.relative_to(ROOT).as_posix()
                if rel != "examples/quickstart.py" and Path(rel).stem not in MIGRATION:
                    problems.append(f"{where}: includes {rel}, which no test runs")
            elif info == "" :
                problems.append(f"{where}: give the block a language ('text' for output or diagrams)")
    assert not problems, "\n".join(problems)
    assert len(runnable_blocks()) >= 3


def test_readme_quickstart_is_the_example() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.splitlines()[0] == "# decentpy"
    first_blocks = [code for info, code, _ in blocks(ROOT / "README.md")][:2]
    assert first_blocks[0].strip() == "make train" and first_blocks[1].strip() == "make test", first_blocks
    quick = [code for info, code, _ in blocks(ROOT / "README.md") if info == "python"]
    assert quick and quick[0] == (ROOT / "examples" / "quickstart.py").read_text()
    assert len(readme.splitlines()) <= 210


def test_the_ddp_guide_lists_the_constructor_as_it_is() -> None:
    """docs/guide/ddp.md's signature line and argument table name every parameter of
    ``DecentralizedDataParallel.__init__``, in order, with its default (they drifted once: eight
    arguments were missing)."""
    import inspect

    import decentpy

    page = (ROOT / "docs" / "guide" / "ddp.md").read_text()
    sig = inspect.signature(decentpy.DecentralizedDataParallel.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    line = re.search(r"`DecentralizedDataParallel\((model, .*?)\)`\n", page, re.S)
    assert line, "docs/guide/ddp.md: no signature line"
    written = [a.strip() for a in re.split(r",(?![^(]*\))", line.group(1).replace("\n", " "))]
    names = [w.split("=")[0] for w in written]
    assert names == [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params], names
    for w, p in zip(written, params):
        if p.default is not inspect.Parameter.empty and p.name not in ("peer_liveness_timeout", "peer_check"):
            assert w.split("=", 1)[1] == (f'"{p.default}"' if isinstance(p.default, str) else repr(p.default)), (w, p)
    table = re.findall(r"^\| `(\*{0,2}\w+)` \|", page, re.M)
    assert table == [n for n in names if n != "model"], table


def test_topology_pictures_are_committed_and_current() -> None:
    """The pictures show where the Markdown is read (committed files, not the docs build's), one per
    case the drawing tool knows, each drawn from the schedule decentpy builds today."""
    from tools import docs_topologies as pictures

    page = ROOT / "docs" / "concepts" / "topologies.md"
    shown = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())
    expected = {pictures.file_name(*case) for case in pictures.CASES}
    assert {Path(s).name for s in shown} == expected, shown
    for src in shown:
        path = (page.parent / src).resolve()
        assert path.is_file() and Path(pictures.OUT_DIR) == path.parent, f"{src}: not a committed picture"
        name, n, local = next(c for c in pictures.CASES if pictures.file_name(*c) == path.name)
        assert pictures.stored_fingerprint(str(path)) == pictures.fingerprint(name, n, local), (
            f"{path.name} shows another schedule than decentpy builds: redraw with "
            "`python -m tools.docs_topologies` (or `make docs`) and commit it")


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_all(rank: int, world_size: int, jobs: List[Tuple[str, str, int, int]], tmp: str) -> Dict[str, Any]:
    import torch.distributed as dist

    dist.destroy_process_group()  # every script makes its own
    os.chdir(tmp)  # a script's relative paths (its checkpoints) land in the test's directory
    results: Dict[str, Any] = {}
    for index, (name, source, nproc, port) in enumerate(jobs):
        if nproc == 1 and rank != 0:
            continue
        os.environ["MASTER_PORT"] = str(port)
        out = io.StringIO()
        if source.endswith(".py") and "\n" not in source:  # a migration script: main(), as its __main__ runs it
            kwargs = {"checkpoint_dir": tmp} if name.endswith(CHECKPOINTS) else {}
            with contextlib.redirect_stdout(out):
                results[name] = _load(Path(source)).main(**kwargs)
            results[f"{name} printed"] = out.getvalue()
            continue
        path = Path(tmp) / f"rank{rank}_job{index}.py"  # the ranks share tmp; rank 1 skips the 1-process blocks
        path.write_text(source)
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
        results[name] = out.getvalue()
    return results


def test_run_blocks_and_migration_scripts(tmp_path) -> None:
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    have_decent_dp = importlib.util.find_spec("decent_dp") is not None
    jobs = []
    for stem in MIGRATION:
        if stem in NOT_RUN:
            continue
        if (stem.startswith("fairscale") and not have_fairscale) or (stem.startswith("decent_dp") and not have_decent_dp):
            if stem.endswith("_before"):
                continue
        jobs.append((stem, str(ROOT / "examples" / "migration" / f"{stem}.py"), 2, free_port()))
    jobs.append(("torch_ddp_after" + CHECKPOINTS, str(ROOT / "examples" / "migration" / "torch_ddp_after.py"), 2,
                 free_port()))
    for name, code, nproc in runnable_blocks():
        assert nproc in (1, 2), (name, nproc)
        jobs.append((name, code, nproc, free_port()))
    got = run_workers(_run_all, 2, jobs, str(tmp_path), timeout=240, local_ranks=True)
    r0, r1 = got

    # the README's quickstart: trained, averaged, printed on rank 0 only
    quick = r0["README.md:" + next(k.split(":")[1] for k in r0 if k.startswith("README.md:"))]
    m = re.search(r"consensus distance (\S+); test accuracy of the averaged model (\S+)", quick)
    assert m and float(m.group(2)) >= 0.85, quick
    assert not any(v for k, v in r1.items() if k.startswith("README.md:")), r1
    # the single-process blocks printed what they claim
    assert any("True" in v for k, v in r0.items() if "topologies" in k), r0

    # the checkpoint pattern: resumed = uninterrupted on every rank; the kept model loads into a plain one
    for r in (r0, r1):
        out = next(v for k, v in r.items() if k.startswith("docs/howto/checkpoints.md:"))
        m = re.search(r"identical to the uninterrupted run: (\w+); .* test accuracy (\S+)", out)
        assert m and m.group(1) == "True" and float(m.group(2)) >= 0.8, out
    # the metrics page: one NaN batch on rank 1 is one skipped step there, summed over the ranks
    out0, out1 = (next(v for k, v in r.items() if k.startswith("docs/howto/metrics.md:")) for r in (r0, r1))
    assert re.search(r"rank 0: .*'skipped_steps': 0", out0) and re.search(r"rank 1: .*'skipped_steps': 1", out1)
    assert re.search(r"all ranks: [1-9]\d* bytes sent, 1 skipped step", out0) and "all ranks" not in out1, out0
    # every migration script prints its result on rank 0, as run by its docstring's command
    for stem in (k for k in r0 if k in MIGRATION):
        m = re.fullmatch(r"epoch losses \[(.*)\], test accuracy (\S+)\n", r0[f"{stem} printed"])
        assert m, (stem, r0[f"{stem} printed"])
        assert float(m.group(2)) == pytest.approx(r0[stem]["accuracy"], abs=1e-3), (stem, m.group(0))
        assert [float(v) for v in m.group(1).split(", ")] == pytest.approx(r0[stem]["losses"], abs=1e-4)
        assert r1[f"{stem} printed"] == "", (stem, r1[f"{stem} printed"])
    # migration: the decentpy script trains as the one it replaces
    before, after = r0["torch_ddp_before"], r0["torch_ddp_after"]
    assert after["losses"][-1] < after["losses"][0] and after["accuracy"] >= 0.75, after  # chance: 0.25
    assert abs(after["accuracy"] - before["accuracy"]) <= 0.05, (before, after)
    assert (tmp_path / "rank0.pt").is_file() and (tmp_path / "rank1.pt").is_file() and (tmp_path / "model.pt").is_file()
    # OSS + ShardedDataParallel on 2 ranks computes what torch DDP computes: the same trajectory
    fs = r0["fairscale_after"]
    assert fs["losses"] == pytest.approx(before["losses"], rel=1e-4, abs=1e-5), (fs, before)
    assert fs["accuracy"] == pytest.approx(before["accuracy"], abs=1 / 128)
    if have_fairscale:
        assert fs["losses"] == pytest.approx(r0["fairscale_before"]["losses"], rel=1e-4, abs=1e-5)
    # decent-dp -> decentpy by the imports only: the same training (complete topology, no decay)
    dd = r0["decent_dp_after"]
    assert dd["losses"][-1] < dd["losses"][0] and dd["accuracy"] >= 0.65, dd
    if have_decent_dp:
        assert dd["losses"] == pytest.approx(r0["decent_dp_before"]["losses"], rel=1e-3, abs=1e-4)
        assert abs(dd["accuracy"] - r0["decent_dp_before"]["accuracy"]) <= 0.02
    # torchft's DiLoCo -> decentpy.DiLoCo by deleting the Manager: trains (chance 0.25), one model after the last
    # outer step on both replicas (4 epochs of 14 inner steps = 7 outer steps of 8)
    tf0, tf1 = r0["torchft_diloco_after"], r1["torchft_diloco_after"]
    assert tf0["losses"][-1] < tf0["losses"][0] and tf0["accuracy"] >= 0.8, tf0
    assert tf0["accuracy"] == tf1["accuracy"], (tf0, tf1)


def test_commands_run_as_pasted() -> None:
    """Every ``.venv/bin/...`` shell block of the pages, as pasted, from the clone's root (what a
    user types after ``make train``); each distinct block once."""
    import subprocess
    import sys

    venv_bin = Path(sys.executable).parent
    if not (ROOT / ".venv" / "bin").is_dir() or venv_bin.resolve() != (ROOT / ".venv" / "bin").resolve():
        pytest.skip("the tests do not run from the clone's own .venv (make test does)")
    seen = set()
    for page in PAGES:
        for info, code, line in blocks(page):
            if info not in ("bash", "sh", "shell") or code.startswith("# not run by the docs tests:"):
                continue
            if not any(l.strip().startswith(".venv/bin/") for l in code.splitlines()) or code in seen:
                continue
            seen.add(code)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("LOCAL_WORLD_SIZE", None)
            proc = subprocess.run(["bash", "-e", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, f"{page.relative_to(ROOT)}:{line}: {proc.stderr[-2000:]}"
    assert seen, "no .venv/bin command block found"

#!/usr/bin/env python
"""Run fairscale 0.4.13's own unit tests against fairscale and against decentpy, side by side.

Why: decentpy promises that ``from decentpy import OSS, ShardedDataParallel, ShardedGradScaler,
AsyncPipe`` replaces fairscale 0.4.13's classes. fairscale's unit tests are the most complete
statement of what those classes do, so this harness runs them twice -- once as fairscale wrote them
("fairscale" variant: the baseline on this machine) and once with only the import lines switched to
decentpy ("decentpy" variant) -- and reports every test that passes on fairscale but not on decentpy.

How: nothing of fairscale is vendored here. The test files are read at run time from a fairscale
git directory (``git --git-dir=DIR show TAG:path``), adapted by the explicit, commented list of
substitutions in ``RULES`` below (only what it takes to run them on CPU/gloo with this torch and
pytest, plus the decentpy imports), written to a work directory under /tmp, and run with pytest,
one process per (file, variant), each test under a pytest-timeout limit and each process under a
wall-clock limit, so a hang costs one test, never the run. Every rule states how many substitutions
it expects; a fairscale tree that does not match fails loudly instead of testing something else.
fairscale's test utilities (``fairscale.fair_dev.testing``: torch_spawn, dist_init, get_worker_map,
check_same_models_across_ranks, ...) are fairscale's in both variants, so fairscale 0.4.13 itself
must be importable: ``.venv/bin/pip install --no-deps fairscale==0.4.13`` (``--no-deps``: its
requirements would pull a CUDA torch); so must the pytest-timeout plugin
(``.venv/bin/pip install pytest-timeout``).

Two things keep one test's trouble from being charged to another, the same way in both variants:
a test that fails before its ``destroy_process_group()`` has its default process group destroyed
after it (else every later single-process test of the file fails in ``init_process_group``), and a
test whose worker process aborts at exit with torch 2.13's gloo teardown race (SIGABRT, "terminate
called without an active exception", after the test body passed; see ``EXIT_CRASH_NOTE``) is rerun
in a fresh pytest process, up to ``--crash-reruns`` times; every attempt is recorded.

Output (in the work directory, default /tmp/fairscale_compat, wiped at start): per variant the
adapted tree and ``ADAPTATIONS.diff`` (the exact changes against fairscale's files), ``logs/`` (one
pytest log per file and variant), ``results.json`` and ``results.csv`` (per-test outcome on both
variants) and ``summary.txt`` (the table and the lists printed at the end).

Usage:
    .venv/bin/python tools/fairscale_compat.py --fairscale-git /work/.mirror/facebookresearch+fairscale/repo \\
        [--files oss,sdp_features,...] [--variants fairscale,decentpy] [-k EXPR] [--timeout 120]
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import difflib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from decentpy.version import FAIRSCALE_VERSION  # the pinned release, one place

LOG = logging.getLogger("fairscale_compat")

DEFAULT_TAG = f"v{FAIRSCALE_VERSION}"
DEFAULT_WORKDIR = Path("/tmp/fairscale_compat")
WORKDIR_MARKER = ".fairscale_compat"
VARIANTS: Tuple[str, ...] = ("fairscale", "decentpy")
INSTALL_HINT = (f".venv/bin/pip install --no-deps fairscale=={FAIRSCALE_VERSION}  "
                "(never without --no-deps: it pulls a CUDA torch)")

# The test files, by the short key that --files takes (paths in the fairscale repository).
TEST_FILES: Dict[str, str] = {
    "oss": "tests/optim/test_oss.py",
    "sdp_features": "tests/nn/data_parallel/test_sharded_ddp_features.py",
    "sdp_parity": "tests/nn/data_parallel/test_sharded_ddp_pytorch_parity.py",
    "pipe": "tests/nn/pipe_process/test_pipe.py",
    "pipe_bugs": "tests/nn/pipe_process/test_bugs.py",
    "pipe_inplace": "tests/nn/pipe_process/test_inplace.py",
    "pipe_transparency": "tests/nn/pipe_process/test_transparency.py",
}

# ---------------------------------------------------------------------------------------------
# The adaptations.
#
# Policy ("adapted only to run on CPU/gloo"):
#  * Tests that fairscale gates on GPUs only because they pin "cuda"/"cuda:rank" devices, use NCCL
#    or size their world by torch.cuda.device_count() are un-gated and run on CPU with gloo (one
#    process per simulated GPU). Their bodies are unchanged apart from the device / backend /
#    world-size literals and the CUDA-only calls that have no CPU meaning (set_device, synchronize).
#  * Cases that need CUDA for what they test stay skipped (see KEPT_SKIPPED), either by fairscale's
#    own skipif or, inside a parametrization, by a `pytest.param(..., marks=skipif(no CUDA))` added
#    here -- so on a GPU machine they would run again.
#  * torch / pytest API changes are adapted only where a test cannot run otherwise (one: pytest 8
#    removed `pytest.warns(None)`).
#  * decentpy variant only: the import lines of the four classes (nothing else differs).
# Each rule: a regex (re.MULTILINE) applied to the whole file or to one top-level function/class
# ("scope", decorators included), the replacement, the exact number of substitutions expected
# (None: at least one) and why.
# ---------------------------------------------------------------------------------------------

SKIP_NO_CUDA = 'pytest.mark.skipif(not torch.cuda.is_available(), reason="fairscale-compat: CUDA-only case")'
NOOP_CUDA = "pass  # fairscale-compat: CUDA-only call, no CPU equivalent"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One substitution in one fairscale test file."""

    file: str  # key of TEST_FILES
    pattern: str  # regex, re.MULTILINE
    repl: str  # re.sub replacement
    why: str
    scope: Optional[str] = None  # top-level def/class name ("Class.method" for methods); None: whole file
    count: Optional[int] = 1  # exact number of substitutions expected; None: at least one
    variants: Tuple[str, ...] = VARIANTS


def _unskip(file: str, scope: str, decorators: Sequence[str], why: str) -> Rule:
    """Drop the given GPU-gating decorator lines (consecutive, in this order) from one test."""
    pattern = "".join(rf"^@{re.escape(d)}\n" for d in decorators)
    return Rule(file, pattern, "", f"un-gate: {why}", scope=scope)


def _cuda_noop(file: str, scope: str, call: str, count: int = 1) -> Rule:
    return Rule(file, rf"^([ \t]*){re.escape(call)}$", rf"\g<1>{NOOP_CUDA}",
                f"`{call}` raises on a CPU-only torch and has nothing to do on CPU", scope=scope, count=count)


RULES: List[Rule] = [
    # ---- tests/optim/test_oss.py --------------------------------------------------------------
    # (BACKEND / DEVICE at the top already fall back to gloo / cpu without CUDA.)
    _unskip("oss", "test_step", ["skip_if_single_gpu"], "only the device=rank pinning needs GPUs"),
    Rule("oss", r"\bdevice=rank\)", 'device="cpu")', "device=rank means cuda:rank; CPU here",
         scope="run_test_step", count=3),
    Rule("oss", r"^([ \t]*)m\.to\(rank\)$", r'\g<1>m.to("cpu")', "cuda:rank -> cpu", scope="run_test_step"),
    _unskip("oss", "test_step_with_closure", ["skip_if_no_cuda"], "only the device=rank pinning needs CUDA"),
    Rule("oss", r"world_size = min\(2, torch\.cuda\.device_count\(\)\)", "world_size = 2",
         "the world size was capped by the GPU count (0 here); 2 gloo processes instead",
         scope="test_step_with_closure"),
    Rule("oss", r"\bdevice=rank\)", 'device="cpu")', "device=rank means cuda:rank; CPU here",
         scope="run_test_step_with_closure", count=5),
    Rule("oss", r"^([ \t]*)m\.to\(rank\)$", r'\g<1>m.to("cpu")', "cuda:rank -> cpu",
         scope="run_test_step_with_closure"),
    _unskip("oss", "test_collect_shards", ["skip_if_single_gpu"], "device-agnostic once set_device is gone"),
    _cuda_noop("oss", "run_test_collect_shards", "torch.cuda.set_device(rank)"),
    _unskip("oss", "test_reproducibility", ["skip_if_single_gpu"], "device-agnostic once set_device is gone"),
    _cuda_noop("oss", "run_test_reproducibility", "torch.cuda.set_device(rank)"),
    Rule("oss", r"device_ids=\[device\]", "device_ids=None",
         "torch DDP refuses device_ids for a CPU module", scope="run_test_reproducibility"),
    _unskip("oss", "test_gradient_clipping", ["skip_if_no_cuda"], "only the cuda:rank device needs CUDA"),
    Rule("oss", r"^([ \t]*)device = torch\.device\(rank\)$", r'\g<1>device = torch.device("cpu")',
         "cuda:rank -> cpu", scope="run_gradient_clipping"),
    Rule("oss", r"device_ids=\[rank\]", "device_ids=None", "torch DDP refuses device_ids for a CPU module",
         scope="run_gradient_clipping", count=2),
    _unskip("oss", "test_state_dict_distributed", ["skip_if_single_gpu"], "only the cuda:rank device needs GPUs"),
    Rule("oss", r"^([ \t]*)device = torch\.device\(rank\)$", r'\g<1>device = torch.device("cpu")',
         "cuda:rank -> cpu", scope="run_state_dict_distributed"),
    Rule("oss", r"device_ids=\[rank\]", "device_ids=None", "torch DDP refuses device_ids for a CPU module",
         scope="run_state_dict_distributed", count=2),
    Rule("oss", r"^import fairscale\.optim as optim$",
         "import decentpy as optim  # fairscale-compat: decentpy variant (the file uses only optim.OSS)",
         "decentpy variant: `optim.OSS` -> decentpy.OSS", variants=("decentpy",)),
    # ---- tests/nn/data_parallel/test_sharded_ddp_features.py ----------------------------------
    _unskip("sdp_features", "test_step", ["skip_if_no_cuda", "skip_if_single_gpu"],
            "its [gloo, cpu] setup is a CPU case; the CUDA setups are skipped per case below"),
    Rule("sdp_features", r'\[dist\.Backend\.(NCCL|GLOO), torch\.device\("cuda"\)\]',
         rf'pytest.param([dist.Backend.\g<1>, torch.device("cuda")], marks={SKIP_NO_CUDA})',
         "the two setups on a cuda device are CUDA-only", scope="test_step", count=2),
    Rule("sdp_features", r"\[torch\.optim\.SGD, SGDWithPausingCompute\]",
         f"[torch.optim.SGD, pytest.param(SGDWithPausingCompute, marks={SKIP_NO_CUDA})]",
         "SGDWithPausingCompute sleeps on a CUDA stream: CUDA-only", scope="test_step"),
    _unskip("sdp_features", "test_inputs", ["skip_if_single_gpu"],
            "runs on available_devices (cpu here); the nccl+cpu case skips itself"),
    _unskip("sdp_features", "test_training_change", ["skip_if_no_cuda", "skip_if_single_gpu"],
            "the train/eval switch it checks is device-agnostic"),
    Rule("sdp_features", r'backend = "nccl"', 'backend = "gloo"', "nccl -> gloo", scope="test_training_change"),
    Rule("sdp_features", r'device = "cuda"', 'device = "cpu"', "cuda -> cpu", scope="test_training_change"),
    _cuda_noop("sdp_features", "run_test_training_change", "torch.cuda.set_device(rank)"),
    _unskip("sdp_features", "test_gpt2", ["skip_if_no_cuda", "skip_if_single_gpu"],
            "trainable unused parameters and .to(dtype) are device-agnostic (already gloo)"),
    Rule("sdp_features", r'device = "cuda"', 'device = "cpu"', "cuda -> cpu", scope="test_gpt2"),
    _cuda_noop("sdp_features", "run_test_gpt2", "torch.cuda.set_device(rank)"),
    _unskip("sdp_features", "test_multiple_groups", ["skip_if_less_than_four_gpu"],
            "4 gloo processes stand for the 4 GPUs; the nccl case is skipped below"),
    Rule("sdp_features", r'\["gloo", "nccl"\]', f'["gloo", pytest.param("nccl", marks={SKIP_NO_CUDA})]',
         "nccl is CUDA-only", scope="test_multiple_groups"),
    Rule("sdp_features", r'device = "cuda"', 'device = "cpu"', "cuda -> cpu", scope="run_test_multiple_groups"),
    _cuda_noop("sdp_features", "run_test_multiple_groups", "torch.cuda.set_device(rank)"),
    Rule("sdp_features", r"^from fairscale\.nn\.data_parallel import ShardedDataParallel$",
         "from decentpy import ShardedDataParallel  # fairscale-compat: decentpy variant",
         "decentpy variant", variants=("decentpy",)),
    Rule("sdp_features", r"^from fairscale\.optim import OSS$",
         "from decentpy import OSS  # fairscale-compat: decentpy variant", "decentpy variant", variants=("decentpy",)),
    # ---- tests/nn/data_parallel/test_sharded_ddp_pytorch_parity.py ----------------------------
    # amp=True cases run too: on CPU torch disables torch.cuda.amp.autocast and torch's GradScaler
    # (with a warning) and fairscale's ShardedGradScaler disables itself, so they check the
    # ShardedGradScaler code path against unscaled DDP.
    _unskip("sdp_parity", "test_ddp_parity", ["skip_if_no_cuda", "skip_if_single_gpu"],
            "the DDP parity it checks is device-agnostic"),
    Rule("sdp_parity", r"world_size = torch\.cuda\.device_count\(\)", "world_size = 2",
         "one process per GPU (0 here) -> 2 gloo processes", scope="test_ddp_parity"),
    Rule("sdp_parity", r"backend = dist\.Backend\.NCCL", "backend = dist.Backend.GLOO", "nccl -> gloo",
         scope="test_ddp_parity"),
    Rule("sdp_parity", r'device = torch\.device\("cuda"\)', 'device = torch.device("cpu")', "cuda -> cpu",
         scope="run_ddp_parity"),
    _cuda_noop("sdp_parity", "run_ddp_parity", "torch.cuda.set_device(rank)"),
    Rule("sdp_parity", r"device_ids=\[rank\]", "device_ids=None", "torch DDP refuses device_ids for a CPU module",
         scope="run_ddp_parity"),
    _unskip("sdp_parity", "test_ddp_parity_two_optim", ["skip_if_no_cuda", "skip_if_single_gpu"],
            "the DDP parity it checks is device-agnostic (already 2 processes)"),
    Rule("sdp_parity", r"backend = dist\.Backend\.NCCL", "backend = dist.Backend.GLOO", "nccl -> gloo",
         scope="test_ddp_parity_two_optim"),
    Rule("sdp_parity", r'device = torch\.device\("cuda"\)', 'device = torch.device("cpu")', "cuda -> cpu",
         scope="run_ddp_parity_two_optim"),
    _cuda_noop("sdp_parity", "run_ddp_parity_two_optim", "torch.cuda.set_device(rank)"),
    Rule("sdp_parity", r"device_ids=\[rank\]", "device_ids=None", "torch DDP refuses device_ids for a CPU module",
         scope="run_ddp_parity_two_optim"),
    _cuda_noop("sdp_parity", "run_ddp_parity_two_optim", "torch.cuda.synchronize(device)", count=2),
    Rule("sdp_parity", r"^from fairscale\.nn\.data_parallel import ShardedDataParallel$",
         "from decentpy import ShardedDataParallel  # fairscale-compat: decentpy variant",
         "decentpy variant", variants=("decentpy",)),
    Rule("sdp_parity", r"^from fairscale\.optim import OSS$",
         "from decentpy import OSS  # fairscale-compat: decentpy variant", "decentpy variant", variants=("decentpy",)),
    Rule("sdp_parity", r"^([ \t]+)from fairscale\.optim\.grad_scaler import ShardedGradScaler$",
         r"\g<1>from decentpy import ShardedGradScaler  # fairscale-compat: decentpy variant",
         "decentpy variant", variants=("decentpy",)),
    # ---- tests/nn/pipe_process/test_pipe.py ---------------------------------------------------
    Rule("pipe", r"^import os$", "import os\nimport warnings  # fairscale-compat: for pytest.warns(None) below",
         "needed by the pytest.warns(None) replacement"),
    Rule("pipe", r"^([ \t]*)with pytest\.warns\(None\) as record:$",
         r'\g<1>with warnings.catch_warnings(record=True) as record:  # fairscale-compat: pytest>=8 has no '
         r'pytest.warns(None)' '\n' r'\g<1>    warnings.simplefilter("always")',
         "pytest 8 removed pytest.warns(None) (TypeError); catch_warnings(record=True)+'always' is what it did",
         count=2),
    Rule("pipe", r"^from fairscale\.nn\.pipe import AsyncPipe$",
         "from decentpy import AsyncPipe  # fairscale-compat: decentpy variant", "decentpy variant",
         variants=("decentpy",)),
    # (LazyModule: switched to decentpy.pipeline.LazyModule only if that exists; see lazy_module_rule().)
    # ---- tests/nn/pipe_process/test_bugs.py ---------------------------------------------------
    Rule("pipe_bugs", r'^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\), reason="cuda required"\)\n', "",
         "un-gate: the pipe's only CUDA use is the .cuda() move, made .cpu() below",
         scope="python_autograd_function"),
    Rule("pipe_bugs", r"\.cuda\(\)$", ".cpu()", "cuda -> cpu", scope="python_autograd_function"),
    Rule("pipe_bugs", r'^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\), reason="cuda required"\)\n', "",
         "un-gate: the test uses no CUDA at all", scope="exception_no_hang"),
    Rule("pipe_bugs", r'^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\), reason="cuda required"\)\n', "",
         "un-gate: CUDA is used only for the devices, made cpu below", scope="parallel_randoms"),
    Rule("pipe_bugs", r"\.cuda\(\)", ".cpu()", "cuda -> cpu", scope="parallel_randoms", count=2),
    Rule("pipe_bugs", r"input_device=torch\.cuda\.current_device\(\)", 'input_device=torch.device("cpu")',
         "cuda -> cpu (torch.cuda.current_device() raises on a CPU-only torch)", scope="parallel_randoms"),
    Rule("pipe_bugs", r"^from fairscale\.nn\.pipe import AsyncPipe$",
         "from decentpy import AsyncPipe  # fairscale-compat: decentpy variant", "decentpy variant",
         variants=("decentpy",)),
    # ---- tests/nn/pipe_process/test_inplace.py ------------------------------------------------
    Rule("pipe_inplace", r'^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\), reason="cuda required"\)\n',
         "", "un-gate: the test uses no CUDA at all", scope="inplace_on_requires_grad"),
    Rule("pipe_inplace", r"^from fairscale\.nn\.pipe import AsyncPipe$",
         "from decentpy import AsyncPipe  # fairscale-compat: decentpy variant", "decentpy variant",
         variants=("decentpy",)),
    # ---- tests/nn/pipe_process/test_transparency.py -------------------------------------------
    Rule("pipe_transparency", r'^@pytest\.mark\.skipif\(not torch\.cuda\.is_available\(\), reason="cuda required"\)\n',
         "", "un-gate: the test uses no CUDA at all", scope="simple_linears"),
    Rule("pipe_transparency", r"^from fairscale\.nn\.pipe import AsyncPipe$",
         "from decentpy import AsyncPipe  # fairscale-compat: decentpy variant", "decentpy variant",
         variants=("decentpy",)),
]

# Documentation only: the cases that stay skipped on CPU and why (fairscale's own markers, or the
# pytest.param marks added above). Printed by --list-adaptations.
KEPT_SKIPPED: List[Tuple[str, str, str]] = [
    ("oss", "TestSingleRank.test_device_change", "moves the model to CUDA after OSS was built: CUDA-only"),
    ("oss", "test_empty_shard[nccl]", "nccl: CUDA-only (the test skips itself)"),
    ("oss", "test_ddp_parity[*] (8)", "fairscale: @pytest.mark.skip('broken at head')"),
    ("sdp_features", "test_step[*-setup0|setup2-*], test_step[*-optimizer_type1-*]",
     "cuda device setups; SGDWithPausingCompute sleeps on a CUDA stream"),
    ("sdp_features", "test_inputs[nccl-*]", "nccl: CUDA-only (the test skips itself)"),
    ("sdp_features", "test_device_change[*]", "checks that moving to CUDA is refused: CUDA-only"),
    ("sdp_features", "test_ddp_sync_batch_norm", "torch's SyncBatchNorm refuses CPU inputs"),
    ("sdp_features", "test_multiple_groups[nccl-*]", "nccl: CUDA-only"),
    ("sdp_parity", "test_ddp_parity[*-True-*-True-*] (manual_reduction and change_train_graph)",
     "fairscale skips that combination itself"),
    ("pipe", "test_infiniband, test_infiniband3", "CUDA tensors over the process group; no pipe involved"),
    ("pipe", "test_infiniband2, test_mpi", "MPI + CUDA"),
    ("pipe", "test_deny_moving", "moves the pipe to CUDA: CUDA-only"),
    ("pipe", "test_named_children, test_verify_module_duplicate_parameters_on_distinct_partitions",
     "fairscale: @pytest.mark.skip"),
    ("pipe_bugs", "test_tuple_wait", "needs torch.cuda._sleep on a CUDA stream and 2 GPUs"),
]


def lazy_module_rule(python: str) -> Tuple[Optional[Rule], str]:
    """The LazyModule import goes to decentpy.pipeline only if decentpy has one there."""
    probe = subprocess.run([python, "-c", "import decentpy.pipeline as p; print(hasattr(p, 'LazyModule'))"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip() == "True":
        return Rule("pipe", r"^from fairscale\.nn\.pipe\.types import LazyModule$",
                    "from decentpy.pipeline import LazyModule  # fairscale-compat: decentpy variant",
                    "decentpy variant", variants=("decentpy",)), "decentpy.pipeline.LazyModule"
    return None, ("decentpy.pipeline has no LazyModule: fairscale's (a callable that builds the layer) is kept "
                  "in both variants")


# ---------------------------------------------------------------------------------------------
# The pytest plugin written next to the adapted tests: per-test outcomes as JSON lines (so a
# process killed by the file timeout still leaves what it had finished), and after each test the
# removal of worker processes a timed-out test left behind.
# ---------------------------------------------------------------------------------------------

PLUGIN_SOURCE = r'''"""pytest plugin written by tools/fairscale_compat.py (harness code, not fairscale's)."""
import json
import os
import signal
import sys

import pytest

_OUT = os.environ["FAIRSCALE_COMPAT_RESULTS"]
_CONFIG = None


def _write(record):
    with open(_OUT, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config


def pytest_collection_finish(session):
    for item in session.items:
        _write({"event": "collected", "nodeid": item.nodeid})


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "collect_error", "nodeid": report.nodeid, "longrepr": str(report.longrepr)[-20000:]})


def pytest_runtest_logreport(report):
    category = _CONFIG.hook.pytest_report_teststatus(report=report, config=_CONFIG)[0]
    if not category:
        return
    message = ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        message = crash.message
    elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        message = str(report.longrepr[2])
    elif report.longrepr is not None:
        message = str(report.longrepr)[:2000]
    _write({
        "event": "report", "nodeid": report.nodeid, "when": report.when, "category": category,
        "duration": round(report.duration, 3), "message": message,
        "longrepr": report.longreprtext[-20000:] if report.failed else "",
        "stderr": report.capstderr[-20000:] if report.failed else "",
    })


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A test that failed before its destroy_process_group() leaves the default group initialized in
    this process, and every later single-process test would then fail in init_process_group
    ("trying to initialize the default process group twice"): destroy it, so each test is judged on
    its own. A no-op after a test that cleaned up."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # recorded, never a new failure
            _write({"event": "cleanup_failed", "nodeid": item.nodeid, "error": repr(e)})
        else:
            _write({"event": "cleaned_process_group", "nodeid": item.nodeid})


def _children():
    kids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def pytest_runtest_logfinish(nodeid, location):
    """Kill the multiprocessing workers this test left (only after a timeout are there any)."""
    kids, stack, strays = _children(), [os.getpid()], []
    while stack:
        for pid in kids.get(stack.pop(), []):
            stack.append(pid)
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                strays.append(pid)
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if strays:
        _write({"event": "killed_strays", "nodeid": nodeid, "pids": strays})
'''


class HarnessError(RuntimeError):
    """A problem with the set-up (fairscale tree, install, work dir, adaptation mismatch)."""


# ---------------------------------------------------------------------------------------------
# Reading and adapting fairscale's files.
# ---------------------------------------------------------------------------------------------


class FairscaleTree:
    """Read-only access to one tag of a fairscale git directory."""

    def __init__(self, git_dir: Path, tag: str) -> None:
        self.git_dir, self.tag = git_dir, tag
        if not git_dir.exists():
            raise HarnessError(f"--fairscale-git {git_dir}: no such directory")
        res = self._git("rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}", check=False)
        if res.returncode != 0:
            raise HarnessError(f"{git_dir}: no commit for tag {tag!r} (is it a fairscale git directory with tags?)")
        self.commit = res.stdout.strip()
        listing = self._git("ls-tree", "-r", "--name-only", tag).stdout.splitlines()
        self.paths = set(listing)

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(["git", f"--git-dir={self.git_dir}", *args], capture_output=True, text=True)
        if check and res.returncode != 0:
            raise HarnessError(f"git {' '.join(args)} failed in {self.git_dir}: {res.stderr.strip()}")
        return res

    def read(self, path: str) -> str:
        if path not in self.paths:
            raise HarnessError(f"{path} does not exist at {self.tag} in {self.git_dir}")
        return self._git("show", f"{self.tag}:{path}").stdout

    def support_files(self, test_path: str) -> List[str]:
        """The __init__.py and conftest.py files of the test's package and its parents."""
        out: List[str] = []
        parts = Path(test_path).parent.parts
        for i in range(1, len(parts) + 1):
            folder = "/".join(parts[:i])
            out += [f"{folder}/{name}" for name in ("__init__.py", "conftest.py") if f"{folder}/{name}" in self.paths]
        return out


def _scope_span(source: str, scope: str) -> Tuple[int, int]:
    """Character span of a top-level def/class (decorators included); "A.b" for a method."""
    body: List[ast.stmt] = ast.parse(source).body
    node: Optional[ast.AST] = None
    for part in scope.split("."):
        matches = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                   and n.name == part]
        if len(matches) != 1:
            raise HarnessError(f"scope {scope!r}: {len(matches)} definitions named {part!r}")
        node = matches[0]
        body = node.body  # type: ignore[attr-defined]
    assert node is not None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[attr-defined]
    lines = source.splitlines(keepends=True)
    return sum(map(len, lines[: start - 1])), sum(map(len, lines[: node.end_lineno]))  # type: ignore[attr-defined]


def adapt(source: str, rules: Iterable[Rule], where: str) -> Tuple[str, List[Dict[str, Any]]]:
    """Apply the rules in order; every rule must match its expected number of times."""
    applied = []
    for rule in rules:
        start, end = _scope_span(source, rule.scope) if rule.scope else (0, len(source))
        new, n = re.subn(rule.pattern, rule.repl, source[start:end], flags=re.MULTILINE)
        if (rule.count is not None and n != rule.count) or n == 0:
            raise HarnessError(f"{where}: rule {rule.pattern!r} (scope {rule.scope}) matched {n} times, expected "
                               f"{rule.count if rule.count is not None else '>= 1'} -- not the fairscale "
                               f"{FAIRSCALE_VERSION} file this harness was written for?")
        source = source[:start] + new + source[end:]
        applied.append({"pattern": rule.pattern, "replacement": rule.repl, "scope": rule.scope, "substitutions": n,
                        "why": rule.why})
    try:
        ast.parse(source)
    except SyntaxError as e:  # a rule bug, not a test failure
        raise HarnessError(f"{where}: the adapted file does not parse: {e}") from e
    return source, applied


def prepare_workdir(workdir: Path) -> None:
    """Wipe the work dir (only one this harness created, or an empty one) and mark it as ours."""
    if workdir.exists():
        if not (workdir / WORKDIR_MARKER).exists() and any(workdir.iterdir()):
            raise HarnessError(f"{workdir} exists and was not created by this harness (no {WORKDIR_MARKER}); "
                               "refusing to wipe it -- pass another --workdir")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / WORKDIR_MARKER).write_text("created by tools/fairscale_compat.py; wiped at each run\n")


def write_variant(tree: FairscaleTree, variant: str, keys: Sequence[str], rules: Sequence[Rule],
                  root: Path) -> List[Dict[str, Any]]:
    """Write one variant's adapted test tree, its pytest.ini, plugin and ADAPTATIONS.diff."""
    root.mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / "pytest.ini").write_text("[pytest]\n# written by tools/fairscale_compat.py: pins the rootdir here\n")
    (root / "_fairscale_compat_plugin.py").write_text(PLUGIN_SOURCE)
    diffs: List[str] = []
    report: List[Dict[str, Any]] = []
    support = sorted({p for k in keys for p in tree.support_files(TEST_FILES[k])})
    for path in support:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(tree.read(path))
    for key in keys:
        path = TEST_FILES[key]
        original = tree.read(path)
        mine = [r for r in rules if r.file == key and variant in r.variants]
        adapted, applied = adapt(original, mine, f"{variant}:{path}")
        header = (f"# fairscale-compat: ADAPTED COPY of fairscale {tree.tag}:{path} ({variant} variant), "
                  "written by tools/fairscale_compat.py; see ADAPTATIONS.diff\n")
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(header + adapted)
        diffs += difflib.unified_diff(original.splitlines(keepends=True), adapted.splitlines(keepends=True),
                                      f"a/{path}", f"b/{path}")
        report.append({"file": key, "path": path, "variant": variant, "rules": applied})
    (root / "ADAPTATIONS.diff").write_text("".join(diffs))
    return report


# ---------------------------------------------------------------------------------------------
# Running pytest and reading its results.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    file: str
    variant: str
    wall_s: float
    returncode: Optional[int]
    timed_out: bool
    tests: Dict[str, Dict[str, Any]]  # nodeid -> outcome record
    collect_errors: List[Dict[str, Any]]
    strays_killed: int
    log: str
    pg_cleanups: List[str] = dataclasses.field(default_factory=list)  # tests that left a default process group


_PRIORITY = ["failed", "error", "xpassed", "xfailed", "skipped", "passed"]


def _merge(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One outcome per test from its phase reports (the most severe phase wins)."""
    worst = min(records, key=lambda r: _PRIORITY.index(r["category"]) if r["category"] in _PRIORITY else 0)
    return {"outcome": worst["category"], "when": worst["when"],
            "duration": round(sum(r["duration"] for r in records), 3), "message": worst["message"],
            "longrepr": worst["longrepr"], "stderr": worst["stderr"]}


# torch 2.13 + gloo race at worker exit (not a test failure): a gloo worker thread still destroys a
# finished AsyncWork whose tensors have Python objects while the interpreter finalizes; the GIL
# acquire ends the thread inside a noexcept frame -> std::terminate -> SIGABRT, after the test body
# and destroy_process_group() returned (seen with gdb on a core of a fairscale-variant worker:
# ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> decref_pyobject -> take_gil -> pthread_exit).
# Upstream: pytorch/pytorch#157193, #179291 (atexit destroy_process_group). It hits both variants at
# random (~20-40% of the parity tests under load), so such failures are rerun (--crash-reruns).
EXIT_CRASH_NOTE = "terminate called without an active exception"


def is_exit_crash(rec: Dict[str, Any]) -> bool:
    return (rec["outcome"] in ("failed", "error") and "terminated with signal SIGABRT" in (rec.get("message") or "")
            and EXIT_CRASH_NOTE in (rec.get("stderr") or ""))


def _pytest_once(python: str, root: Path, key: str, variant: str, args: argparse.Namespace, log: Path,
                 results: Path, targets: Sequence[str], select: bool) -> Tuple[RunResult, List[str]]:
    """One pytest process over `targets`; returns its results and the node ids it collected."""
    cmd = [python, "-m", "pytest", *targets, "-p", "_fairscale_compat_plugin", "-p", "no:cacheprovider",
           "-rfEs", f"--timeout={args.timeout}", "--timeout-method=signal"]
    if select and args.k:
        cmd += ["-k", args.k]
    env = dict(os.environ)
    env.update({"FAIRSCALE_COMPAT_RESULTS": str(results), "TMPDIR": str(root / "tmp"), "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": str(root)})
    env.setdefault("OMP_NUM_THREADS", "1")  # several worker processes per test on a shared machine
    LOG.debug("[%s/%s] %s", key, variant, " ".join(cmd))
    t0 = time.monotonic()
    timed_out = False
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=args.file_timeout)
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
            LOG.error("[%s/%s] pytest ran past --file-timeout=%ss: killing it", key, variant, args.file_timeout)
        finally:
            _kill_session(proc)
    wall = time.monotonic() - t0
    collected: List[str] = []
    phases: Dict[str, List[Dict[str, Any]]] = {}
    collect_errors: List[Dict[str, Any]] = []
    strays = 0
    cleanups: List[str] = []
    if results.exists():
        for line in results.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "collected":
                collected.append(rec["nodeid"])
            elif rec["event"] == "report":
                phases.setdefault(rec["nodeid"], []).append(rec)
            elif rec["event"] == "collect_error":
                collect_errors.append(rec)
            elif rec["event"] == "killed_strays":
                strays += len(rec["pids"])
            elif rec["event"] == "cleaned_process_group":
                cleanups.append(rec["nodeid"])
    tests: Dict[str, Dict[str, Any]] = {}
    for nodeid in collected + [n for n in phases if n not in collected]:
        if nodeid in phases:
            tests[nodeid] = _merge(phases[nodeid])
        else:
            why = "pytest killed by --file-timeout before this test ended" if timed_out else "no result from pytest"
            tests[nodeid] = {"outcome": "error", "when": "", "duration": 0.0, "message": why, "longrepr": "",
                             "stderr": ""}
    for err in collect_errors:
        LOG.error("[%s/%s] collection error in %s (see %s)", key, variant, err["nodeid"], log)
    if rc not in (0, 1, 5) and not timed_out:  # 1: some tests failed; 5: none collected (-k)
        LOG.error("[%s/%s] pytest exited with %s (see %s)", key, variant, rc, log)
    return RunResult(key, variant, wall, rc, timed_out, tests, collect_errors, strays, str(log), cleanups), collected


def run_pytest(python: str, root: Path, key: str, variant: str, args: argparse.Namespace, logdir: Path) -> RunResult:
    """Run one file on one variant, then rerun (in fresh processes) the tests that hit the exit crash."""
    log = logdir / f"{key}.{variant}.log"
    run, _ = _pytest_once(python, root, key, variant, args, log, root / f"results.{key}.jsonl", [TEST_FILES[key]],
                          select=True)
    for rec in run.tests.values():
        rec["attempts"] = [rec["outcome"] + (" (exit crash)" if is_exit_crash(rec) else "")]
    for attempt in range(1, args.crash_reruns + 1):
        crashed = [n for n, r in run.tests.items() if is_exit_crash(r)]
        if not crashed:
            break
        LOG.info("[%s/%s] rerun %d: %d test(s) whose worker aborted at exit (torch/gloo teardown race)", key,
                 variant, attempt, len(crashed))
        again, _ = _pytest_once(python, root, key, variant, args, log, root / f"results.{key}.rerun{attempt}.jsonl",
                                crashed, select=False)
        run.wall_s += again.wall_s
        run.strays_killed += again.strays_killed
        run.pg_cleanups += again.pg_cleanups
        run.timed_out |= again.timed_out
        for nodeid in crashed:
            rec = again.tests.get(nodeid)
            if rec is None:
                continue
            rec["attempts"] = run.tests[nodeid]["attempts"] + [rec["outcome"] + (" (exit crash)" if is_exit_crash(rec)
                                                                                  else "")]
            run.tests[nodeid] = rec
    return run


def _kill_session(proc: subprocess.Popen) -> None:
    """End whatever is left of the pytest session started for this run (its own process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the leader exited; stragglers in its group get SIGKILL
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break


_ERROR_LINE = re.compile(
    r"^\s*(?:E\s+)?((?:[A-Za-z_][\w.]*\.)?(?:[A-Za-z_]\w*)?(?:Error|Exception|Exit|Failed|Timeout|Interrupt)\b:?.*)$")


_NATIVE_CRASH = re.compile(r"(terminate called.*|Fatal Python error.*|Segmentation fault.*|.*\bAborted\b.*)$")


def first_error_line(rec: Dict[str, Any]) -> str:
    """The line that says what went wrong; for mp.spawn failures the worker's exception, not spawn's."""
    msg = rec.get("message") or ""
    if rec["outcome"] == "skipped":
        return msg.splitlines()[0] if msg else ""
    candidates: List[str] = []
    worker = msg.split("terminated with the following error:", 1)
    if len(worker) == 2:
        lines = worker[1].splitlines()
        hits = [i for i, ln in enumerate(lines) if _ERROR_LINE.match(ln)]
        if hits:
            i = hits[-1]
            line = _ERROR_LINE.match(lines[i]).group(1)  # type: ignore[union-attr]
            if line.strip() == "AssertionError":  # a bare assert: show the statement that failed
                code = [ln.strip() for ln in lines[:i] if ln.strip() and not ln.strip().startswith(("File ", "^", "~"))]
                line += f" at `{code[-1]}`" if code else ""
            elif "Regex pattern did not match" in line:  # pytest.raises(match=...): show what was raised
                line += " " + " ".join(ln.strip() for ln in lines[i + 1:i + 3])
            candidates = [line]
    exited = re.search(r"process \d+ terminated with (exit code|signal) \w+", msg)
    if not candidates and exited:
        stderr = (rec.get("stderr") or "").splitlines()
        found = [m.group(1) for m in map(_ERROR_LINE.match, stderr) if m and "Warning" not in m.group(1)]
        found = found or [m.group(1) for m in map(_NATIVE_CRASH.search, stderr) if m]
        candidates = [f"{exited.group(0)}" + (f" ({found[-1].strip()})" if found else "")]
    if candidates:
        line = candidates[-1]
    else:
        line = next((ln for ln in msg.splitlines() if ln.strip()), "") or rec.get("outcome", "")
    line = re.sub(r"\s+", " ", line).strip()
    return line if len(line) <= 240 else line[:237] + "..."


# ---------------------------------------------------------------------------------------------
# Reporting.
# ---------------------------------------------------------------------------------------------

PASSING = {"passed", "xfailed", "xpassed"}


def counts(run: Optional[RunResult]) -> Dict[str, int]:
    c = {"total": 0, "passed": 0, "xfailed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if run is None:
        return c
    for t in run.tests.values():
        c["total"] += 1
        o = t["outcome"]
        if o in PASSING:
            c["passed"] += 1
            c["xfailed"] += o == "xfailed"
        elif o == "failed":
            c["failed"] += 1
        elif o == "skipped":
            c["skipped"] += 1
        else:
            c["errors"] += 1
    c["errors"] += len(run.collect_errors)
    return c


def _table(rows: List[List[str]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def render(runs: Dict[Tuple[str, str], RunResult], keys: Sequence[str], variants: Sequence[str]) -> str:
    """The per-file table: total / passed / failed / skipped / errors per variant, side by side, and wall time."""
    cols = ["total", "pass", "fail", "skip", "err"]
    rows = [["file"] + [f"{v[:2]}:{c}" for v in variants for c in cols] + [f"{v[:2]}:wall_s" for v in variants]]
    totals = {v: counts(None) for v in variants}
    walls = {v: 0.0 for v in variants}
    for key in keys:
        row = [key]
        for v in variants:
            c = counts(runs.get((key, v)))
            for k in c:
                totals[v][k] += c[k]
            row += [str(c[k]) for k in ("total", "passed", "failed", "skipped", "errors")]
        for v in variants:
            run = runs.get((key, v))
            walls[v] += run.wall_s if run else 0.0
            row.append("-" if run is None else f"{run.wall_s:.0f}" + (" TIMEOUT" if run.timed_out else ""))
        rows.append(row)
    rows.append(["TOTAL"] + [str(totals[v][k]) for v in variants for k in ("total", "passed", "failed", "skipped",
                                                                          "errors")]
                + [f"{walls[v]:.0f}" for v in variants])
    lines = _table(rows)
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    legend = ", ".join(f"{v[:2]} = {v}" for v in variants)
    notes = []
    for v in variants:
        recs = [r for key in keys if (key, v) in runs for r in runs[(key, v)].tests.values()]
        rerun = [r for r in recs if len(r.get("attempts", [])) > 1]
        still = [r for r in rerun if r["attempts"][-1].endswith("(exit crash)")]
        cleanups = sum(len(runs[(key, v)].pg_cleanups) for key in keys if (key, v) in runs)
        notes.append(f"{v}: {totals[v]['passed']} of {totals[v]['total'] - totals[v]['skipped']} runnable tests passed"
                     f" ({totals[v]['xfailed']} of them xfailed, as fairscale marks them); {len(rerun)} rerun after a"
                     f" worker abort at exit (torch/gloo teardown race), {len(still)} still aborting; default"
                     f" process group left by {cleanups} test(s), destroyed by the harness")
    return "\n".join([*lines, f"({legend}; pass includes xfailed; a strict XPASS counts as fail)", *notes])


def _line(key: str, nodeid: str, rec: Dict[str, Any]) -> str:
    name = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid
    tries = rec.get("attempts", [])
    tries_note = f" [attempts: {' -> '.join(tries)}]" if len(tries) > 1 else ""
    return f"  [{key}] {name}: {rec['outcome']}{tries_note} -- {first_error_line(rec)}"


def comparison(runs: Dict[Tuple[str, str], RunResult], keys: Sequence[str], variants: Sequence[str]) -> str:
    out: List[str] = []
    if "fairscale" in variants and "decentpy" in variants:
        regress: List[str] = []
        gains: List[str] = []
        for key in keys:
            fs, dp = runs.get((key, "fairscale")), runs.get((key, "decentpy"))
            if fs is None or dp is None:
                continue
            for nodeid, rec in fs.tests.items():
                other = dp.tests.get(nodeid)
                if rec["outcome"] in PASSING and (other is None or other["outcome"] not in PASSING):
                    regress.append(_line(key, nodeid, other) if other else f"  [{key}] {nodeid}: not collected")
                if other is not None and other["outcome"] in PASSING and rec["outcome"] not in PASSING:
                    gains.append(_line(key, nodeid, rec))
        out += [f"Pass on fairscale, not on decentpy ({len(regress)}):", *(regress or ["  (none)"]), "",
                f"Pass on decentpy, not on fairscale ({len(gains)}) -- fairscale's outcome:", *(gains or ["  (none)"]),
                ""]
    for v in variants:
        bad = [_line(key, n, r) for key in keys if (key, v) in runs for n, r in runs[(key, v)].tests.items()
               if r["outcome"] in ("failed", "error")]
        bad += [f"  [{key}] collection error {e['nodeid']}" for key in keys if (key, v) in runs
                for e in runs[(key, v)].collect_errors]
        out += [f"Failures and errors on {v} ({len(bad)}):", *(bad or ["  (none)"]), ""]
    return "\n".join(out)


def write_results(workdir: Path, runs: Dict[Tuple[str, str], RunResult], keys: Sequence[str],
                  variants: Sequence[str], meta: Dict[str, Any]) -> None:
    tests: List[Dict[str, Any]] = []
    for key in keys:
        nodeids: List[str] = []
        for v in variants:
            if (key, v) in runs:
                nodeids += [n for n in runs[(key, v)].tests if n not in nodeids]
        for nodeid in nodeids:
            entry: Dict[str, Any] = {"file": key, "nodeid": nodeid}
            for v in variants:
                rec = runs[(key, v)].tests.get(nodeid) if (key, v) in runs else None
                entry[v] = None if rec is None else {
                    **rec, "error": first_error_line(rec) if rec["outcome"] not in PASSING else ""}
            tests.append(entry)
    files = {key: {"path": TEST_FILES[key], "variants": {
        v: {"wall_s": round(runs[(key, v)].wall_s, 1), "returncode": runs[(key, v)].returncode,
            "timed_out": runs[(key, v)].timed_out, "counts": counts(runs[(key, v)]),
            "stray_workers_killed": runs[(key, v)].strays_killed, "log": runs[(key, v)].log,
            "process_group_cleanups": runs[(key, v)].pg_cleanups,
            "collect_errors": runs[(key, v)].collect_errors}
        for v in variants if (key, v) in runs}} for key in keys}
    (workdir / "results.json").write_text(json.dumps({"meta": meta, "files": files, "tests": tests}, indent=1))
    with open(workdir / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "nodeid"] + [f"{v}_{c}" for v in variants
                                          for c in ("outcome", "duration_s", "error", "attempts")])
        for t in tests:
            row = [t["file"], t["nodeid"]]
            for v in variants:
                r = t[v] or {"outcome": "", "duration": "", "error": ""}
                row += [r["outcome"], r["duration"], r["error"], " -> ".join(r.get("attempts", []))]
            w.writerow(row)


def load_results(workdir: Path) -> Tuple[Dict[Tuple[str, str], RunResult], List[str], List[str]]:
    """Rebuild the runs from a finished (or interrupted) run's results.json, for --report-only."""
    path = workdir / "results.json"
    if not path.exists():
        raise HarnessError(f"{path} does not exist: nothing to report (run without --report-only first)")
    data = json.loads(path.read_text())
    runs: Dict[Tuple[str, str], RunResult] = {}
    variants: List[str] = []
    for key, f in data["files"].items():
        for v, r in f["variants"].items():
            variants += [v] if v not in variants else []
            runs[(key, v)] = RunResult(key, v, r["wall_s"], r["returncode"], r["timed_out"], {}, r["collect_errors"],
                                       r["stray_workers_killed"], r["log"], r.get("process_group_cleanups", []))
    for t in data["tests"]:
        for v in variants:
            if t.get(v) is not None:
                runs[(t["file"], v)].tests[t["nodeid"]] = t[v]
    keys = [k for k in TEST_FILES if k in data["files"]]
    return runs, keys, [v for v in VARIANTS if v in variants]


def report(workdir: Path, runs: Dict[Tuple[str, str], RunResult], keys: Sequence[str],
           variants: Sequence[str]) -> str:
    text = "\n".join([render(runs, keys, variants), "", comparison(runs, keys, variants),
                      f"per-test outcomes: {workdir / 'results.json'} and results.csv; logs: {workdir / 'logs'}"])
    (workdir / "summary.txt").write_text(text + "\n")
    return text


# ---------------------------------------------------------------------------------------------
# Checks and main.
# ---------------------------------------------------------------------------------------------


def _probe(python: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], capture_output=True, text=True)


def check_environment(python: str, variants: Sequence[str]) -> Dict[str, str]:
    info: Dict[str, str] = {}
    res = _probe(python, "import fairscale, fairscale.fair_dev.testing; print(fairscale.__version__)")
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["?"])[-1]
        raise HarnessError(f"fairscale's test utilities are not importable with {python} ({tail}).\n"
                           f"Install fairscale {FAIRSCALE_VERSION} into that environment:\n    {INSTALL_HINT}")
    info["fairscale"] = res.stdout.strip()
    if info["fairscale"] != FAIRSCALE_VERSION:
        LOG.warning("fairscale %s is installed; this harness targets %s (%s)", info["fairscale"], FAIRSCALE_VERSION,
                    INSTALL_HINT)
    res = _probe(python, "import pytest_timeout, pytest; print(pytest.__version__)")
    if res.returncode != 0:
        raise HarnessError(f"pytest and the pytest-timeout plugin are needed with {python} (every test gets a time "
                           f"limit):\n    {python} -m pip install pytest pytest-timeout")
    info["pytest"] = res.stdout.strip()
    res = _probe(python, "import torch; print(torch.__version__, torch.cuda.is_available())")
    if res.returncode != 0:
        raise HarnessError(f"torch is not importable with {python}: {res.stderr.strip()[-500:]}")
    info["torch"], cuda = res.stdout.split()
    info["cuda_available"] = cuda
    if "decentpy" in variants:
        res = _probe(python, "import decentpy; print(decentpy.__version__)")
        if res.returncode != 0:
            raise HarnessError(f"decentpy is not importable with {python} (is `make build` still running?): "
                               f"{(res.stderr.strip().splitlines() or ['?'])[-1]}")
        info["decentpy"] = res.stdout.strip()
        info["decentpy_source"] = decentpy_source_state(python)
    return info


def decentpy_source_state(python: str) -> str:
    """HEAD and uncommitted files of the decentpy checkout under test (an editable install is a moving target)."""
    res = _probe(python, "import decentpy, os; print(os.path.dirname(os.path.dirname(decentpy.__file__)))")
    root = res.stdout.strip()
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if res.returncode != 0 or head.returncode != 0:
        return "not a git checkout"
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "decentpy"], capture_output=True,
                           text=True).stdout.split("\n")
    dirty = [ln[3:] for ln in dirty if ln.strip()]
    return f"{root} @ {head.stdout.strip()}" + (f" + uncommitted: {', '.join(dirty)}" if dirty else " (clean)")


def _csv_choice(value: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if items == ["all"]:
        return list(allowed)
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad or value!r}; choose from {', '.join(allowed)} or all")
    return [x for x in allowed if x in items]  # canonical order


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="files: " + ", ".join(f"{k} ({v})" for k, v in TEST_FILES.items()))
    p.add_argument("--fairscale-git", type=Path, help="a fairscale git directory (bare is fine)")
    p.add_argument("--tag", default=DEFAULT_TAG, help=f"fairscale tag to read the tests from (default {DEFAULT_TAG})")
    p.add_argument("--files", default="all", type=lambda s: _csv_choice(s, list(TEST_FILES), "file"),
                   help="comma-separated keys of the test files (default all)")
    p.add_argument("--variants", default="all", type=lambda s: _csv_choice(s, VARIANTS, "variant"),
                   help="fairscale,decentpy (default both)")
    p.add_argument("-k", default=None, help="pytest -k expression, passed through")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help=f"wiped at start (default {DEFAULT_WORKDIR})")
    p.add_argument("--python", default=sys.executable, help="interpreter with torch, pytest, fairscale, decentpy")
    p.add_argument("--timeout", type=int, default=120,
                   help="pytest-timeout limit per test, seconds (default 120; fairscale's slowest take ~20 s here)")
    p.add_argument("--file-timeout", type=int, default=5400,
                   help="wall-clock limit per pytest process (one file, one variant), seconds (default 5400)")
    p.add_argument("--crash-reruns", type=int, default=3,
                   help="times to rerun a test whose worker aborted at exit with the torch/gloo teardown race "
                        "(SIGABRT, 'terminate called without an active exception'); default 3, 0: never")
    p.add_argument("--report-only", action="store_true",
                   help="re-print the report of the run already in --workdir (from its results.json), run nothing")
    p.add_argument("--dry-run", action="store_true", help="write the adapted trees and diffs, run nothing")
    p.add_argument("--list-adaptations", action="store_true", help="print the rules and the kept skips, then exit")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.fairscale_git is None and not (args.report_only or args.list_adaptations):
        p.error("--fairscale-git is required (e.g. /work/.mirror/facebookresearch+fairscale/repo)")
    return args


def list_adaptations(rules: Sequence[Rule], lazy_note: str) -> None:
    for key, path in TEST_FILES.items():
        print(f"{key}: {path}")
        for r in (r for r in rules if r.file == key):
            tag = "" if r.variants == VARIANTS else f" [{'/'.join(r.variants)} only]"
            print(f"  - {r.scope or '<file>'}: {r.pattern!r} -> {r.repl!r}{tag}\n      why: {r.why}")
        for k, case, why in KEPT_SKIPPED:
            if k == key:
                print(f"  = kept skipped: {case}: {why}")
    print(f"LazyModule: {lazy_note}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.report_only:
        try:
            runs, keys, variants = load_results(args.workdir)
        except HarnessError as e:
            LOG.error("%s", e)
            return 2
        print(report(args.workdir, runs, keys, variants))
        return 0
    try:
        rules = list(RULES)
        lazy_rule, lazy_note = lazy_module_rule(args.python) if "decentpy" in args.variants else (None, "n/a")
        if lazy_rule is not None:
            rules.append(lazy_rule)
        if args.list_adaptations:
            list_adaptations(rules, lazy_note)
            return 0
        info = check_environment(args.python, args.variants)
        tree = FairscaleTree(args.fairscale_git, args.tag)
        prepare_workdir(args.workdir)
        logdir = args.workdir / "logs"
        logdir.mkdir()
        adaptations = []
        for v in args.variants:
            adaptations += write_variant(tree, v, args.files, rules, args.workdir / v)
        (args.workdir / "adaptations.json").write_text(json.dumps(adaptations, indent=1))
    except HarnessError as e:
        LOG.error("%s", e)
        return 2
    LOG.info("fairscale %s @ %s (%s); torch %s (CUDA %s); pytest %s; decentpy %s; LazyModule: %s", args.tag,
             tree.commit[:12], info["fairscale"], info["torch"], info["cuda_available"], info["pytest"],
             info.get("decentpy", "-"), lazy_note)
    if "decentpy_source" in info:
        LOG.info("decentpy under test: %s", info["decentpy_source"])
    LOG.info("adapted trees in %s (%s)", args.workdir, ", ".join(f"{v}/ADAPTATIONS.diff" for v in args.variants))
    if args.dry_run:
        return 0

    runs: Dict[Tuple[str, str], RunResult] = {}
    t_all = time.monotonic()
    try:
        for key in args.files:
            for v in args.variants:
                run = run_pytest(args.python, args.workdir / v, key, v, args, logdir)
                runs[(key, v)] = run
                c = counts(run)
                LOG.info("[%s/%s] %d tests: %d passed, %d failed, %d skipped, %d errors in %.0fs%s", key, v,
                         c["total"], c["passed"], c["failed"], c["skipped"], c["errors"], run.wall_s,
                         f" ({run.strays_killed} stray workers killed)" if run.strays_killed else "")
    except KeyboardInterrupt:
        LOG.error("interrupted: reporting what ran")
    keys = [k for k in args.files if any((k, v) in runs for v in args.variants)]
    meta = {"fairscale_git": str(args.fairscale_git), "tag": args.tag, "commit": tree.commit, **info,
            "python": args.python, "timeout_per_test_s": args.timeout, "file_timeout_s": args.file_timeout,
            "k": args.k, "lazy_module": lazy_note, "wall_s": round(time.monotonic() - t_all, 1)}
    write_results(args.workdir, runs, keys, args.variants, meta)
    print(report(args.workdir, runs, keys, args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A process whose heartbeat thread is inside a store call when Python finalizes must still exit 0.

Before decentpy/comm/exit.py, such a daemon thread was ended by CPython with ``pthread_exit``
when it came back for the GIL, the forced unwind hit ``std::terminate`` ("terminate called without
an active exception", SIGABRT) after the script had finished, and torchrun failed the run; seen
in CI in tests/test_dropin.py (1 run in several) and once in ``make train``. A heartbeat every
0.5 ms keeps the thread in the store almost all the time: 6 of 8 runs of this script aborted
before the fix, 0 of 8 after.
"""

from __future__ import annotations

import os
import re

import pytest

from dist_harness import torchrun

SCRIPT = '''
import time
import torch.distributed as dist
import decentpy.comm.failures as failures

failures.HEARTBEAT_INTERVAL_S = 0.0005
dist.init_process_group("gloo")
failures.peer_monitor()
time.sleep(0.3)
dist.destroy_process_group()
'''


@pytest.mark.timeout(240)
def test_exit_with_a_heartbeat_inside_a_store_call(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(str(tmp_path), "beat.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for run in range(4):
        proc = torchrun(path, 3, {"PYTHONPATH": root}, timeout=60)
        assert "terminate called" not in proc.stderr, f"run {run}: {proc.stderr[-2000:]}"
        assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{proc.stderr[-2000:]}"


WAIT_SCRIPT = '''
import datetime, time
import torch
import torch.distributed as dist
from decentpy.comm import PeerTimeoutError, PeerWatch, peer_monitor

dist.init_process_group("gloo")
rank = dist.get_rank()
watch = PeerWatch([0, 1], datetime.timedelta(seconds=60))
dist.barrier()
if rank == 0:
    peer_monitor().report("rank 0: a failure the peers must hear of")
    time.sleep(1.0)  # exits after rank 1 gave up its wait and began to exit: the connection closes then
else:
    t = torch.zeros(1)
    work = dist.irecv(t, src=0)  # never sent: the wait is given up on when rank 0's report arrives
    try:
        watch.wait(work, "the test's receive", [0])
    except PeerTimeoutError as exc:
        print("raised", type(exc).__name__, flush=True)
'''


@pytest.mark.timeout(240)
def test_exit_with_a_wait_given_up_on_still_inside_the_backend(tmp_path: "os.PathLike[str]") -> None:
    """A wait abandoned after a peer's error keeps the waiter thread inside gloo until the peer's
    connection closes; when that happens while Python finalizes, the thread used to end the process
    with SIGABRT ("terminate called without an active exception", exit -6 on a worker whose script
    had finished; found by the nonfinite='raise' test of tests/test_compression.py). The waiter is
    now stopped at exit like the heartbeat (decentpy/comm/exit.py)."""
    path = os.path.join(str(tmp_path), "wait.py")
    with open(path, "w") as f:
        f.write(WAIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for run in range(2):
        proc = torchrun(path, 2, {"PYTHONPATH": root}, timeout=90)
        assert "raised PeerReportedError" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr, f"run {run}: {proc.stderr[-2000:]}"
        assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{proc.stderr[-2000:]}"


# The peer closes its connection exactly while the other rank finalizes: the rank that gave up its
# wait writes a marker from its last atexit handler (registered first, so it runs last, right before
# the interpreter finalizes), and the peer, lingering after its own error, exits at once when it sees
# it. Before decentpy/comm/exit.py ended such a wait at exit, this was SIGABRT every time (3 of 3).
FINALIZING = '''
import atexit, os
MARK = os.path.join(os.environ["MARK_DIR"], "finalizing-" + os.environ["RANK"])


def _finalizing(_open=open):  # registered first: runs last, right before the interpreter finalizes
    _open(MARK, "w").close()


atexit.register(_finalizing)


def say(line):
    """One line in one write(2): the ranks share torchrun's stdout pipe, and print() may write the text
    and its newline apart (unbuffered stdout), letting another rank's line land between them."""
    os.write(1, (line + "\\n").encode())


def linger_until_finalizing(ranks, limit_s=60.0):
    """Stay alive (as a rank that handles its own error a while: a report, a checkpoint) until every
    rank of ``ranks`` is finalizing, then close every connection at once."""
    import time
    deadline = time.monotonic() + limit_s
    marks = [os.path.join(os.environ["MARK_DIR"], f"finalizing-{r}") for r in ranks]
    while not all(os.path.exists(m) for m in marks) and time.monotonic() < deadline:
        time.sleep(0.001)
    os._exit(0)
'''

CLOSE_WHILE_FINALIZING_SCRIPT = FINALIZING + '''
import datetime
import torch
import torch.distributed as dist
from decentpy.comm import PeerTimeoutError, PeerWatch, peer_monitor

dist.init_process_group("gloo")
rank = dist.get_rank()
watch = PeerWatch([0, 1], datetime.timedelta(seconds=60))
dist.barrier()
if rank == 0:
    peer_monitor().report("rank 0: a failure the peers must hear of")
    linger_until_finalizing([1])
work = dist.irecv(torch.zeros(1), src=0)  # never sent: given up on when rank 0's report arrives
try:
    watch.wait(work, "the test's receive", [0])
except PeerTimeoutError as exc:
    say("raised " + type(exc).__name__)
'''


def _torchrun_clean(tmp_path: "os.PathLike[str]", name: str, script: str, nproc: int, args: tuple = ()) -> str:
    """Run ``script`` under torchrun; assert no process died of a signal; its stdout."""
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        f.write(script)
    marks = os.path.join(str(tmp_path), name + ".marks")
    os.makedirs(marks, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = torchrun(path, nproc, {"PYTHONPATH": root + os.pathsep + os.path.join(root, "tests"), "MARK_DIR": marks},
                    timeout=120, args=args)
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "exitcode  : -" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(240)
def test_exit_when_the_peer_closes_while_this_rank_finalizes(tmp_path: "os.PathLike[str]") -> None:
    """The window of the SIGABRT made deterministic: the waiter blocked in a wait given up on is
    ended at exit (a 1 ms wait on the same work), not left for the peer's close to wake it while the
    interpreter finalizes."""
    out = _torchrun_clean(tmp_path, "close_while_finalizing.py", CLOSE_WHILE_FINALIZING_SCRIPT, 2)
    assert "raised PeerReportedError" in out, out


# Issue 52's scenario: 4 ranks, nonfinite='raise', rank 1's loss NaN at iteration 1; every rank
# catches the named error and exits -- the rank(s) that raised first linger until the others are
# finalizing (see FINALIZING), the moment that made the others abort (the probe on main: SIGABRT in
# 4 of 5 runs with intra_node='shard' + int8, 3 of 3 with ring + Adam).
NONFINITE_SCRIPT = FINALIZING + '''
import sys
import torch
import torch.distributed as dist
from reference import batch, decentpy_optim_fn, loss_fn, make_mlp
from decentpy import DecentralizedDataParallel, NonFiniteGradientError

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[1] == "shard":
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adamw"), topology="ring", intra_node="shard",
                                    local_world_size=2, compression="int8", nonfinite="raise")
else:
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology="ring", nonfinite="raise",
                                    bucket_size_in_mb=0.0002)
origin = False
try:
    for k in range(20):
        x, y = batch(rank, k)
        loss = loss_fn(ddp(x), y)
        (loss * float("nan") if (rank, k) == (1, 1) else loss).backward()
    say(f"rank {rank}: no error")
except NonFiniteGradientError as exc:
    origin = type(exc) is NonFiniteGradientError  # its own (or its node's) gradient, not a peer's report
    say(f"rank {rank}: raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
if origin:
    linger_until_finalizing([r for r in range(4) if r not in (rank, 0, 1)] if sys.argv[1] == "shard"
                            else [r for r in range(4) if r != rank])
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config", ["ring-adam", "shard-int8"])
def test_nonfinite_raise_ends_every_rank_with_the_named_error_and_exit_code_0(tmp_path: "os.PathLike[str]",
                                                                             config: str) -> None:
    out = _torchrun_clean(tmp_path, f"nonfinite_{config}.py", NONFINITE_SCRIPT, 4, (config.split("-")[0],))
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"rank (\d): raised (\w+): (.*)", out)}
    texts = {int(m.group(1)): m.group(3) for m in re.finditer(r"rank (\d): raised (\w+): (.*)", out)}
    assert sorted(lines) == [0, 1, 2, 3], out
    origin = {1} if config == "ring-adam" else {0, 1}  # with shards the node's reduction spreads the NaN
    for r, kind in lines.items():
        assert kind == ("NonFiniteGradientError" if r in origin else "PeerNonFiniteError"), (r, kind, out)
        assert "not finite" in texts[r] and re.search("rank 1" if config == "ring-adam" else "rank [01]", texts[r]), \
            (r, texts[r])

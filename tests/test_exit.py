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

"""decentpy's NCCL communicator (decentpy._C.NcclCommunicator, decentpy.nccl_comm).

Without a GPU only the build/selection logic runs (communicator choice, reasons, clear errors);
every test that needs NCCL is skipped with the reason. With one GPU: a world of size 1 -- exchange
with self, all-reduce, split, stream ordering against a preceding compute kernel, bounded
initialisation, abort, watchdog timeout -- and the wrapper end to end with ``comm='nccl'``.
Several processes cannot share one GPU under NCCL, so the multi-rank logic (which rank talks to
which, in which order) is the code path the gloo tests cover.
"""

from __future__ import annotations

import datetime
import inspect
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dist_harness import single_process_group

try:  # collect fine without a built extension
    from decentpy import _C
    from decentpy.comm import nccl as nccl_comm
    from decentpy.comm import select as comm_select
    from decentpy.comm import PeerTimeoutError, TorchCommunicator
    from decentpy.comm.plans import plan_exchange
    from decentpy.topology import Group, make_topology
except Exception as exc:  # pragma: no cover - depends on the install
    pytest.skip(f"decentpy is not importable: {exc}", allow_module_level=True)

NCCL_REASON = nccl_comm.nccl_unavailable_reason()
needs_nccl = pytest.mark.skipif(NCCL_REASON is not None, reason=f"needs a GPU and NCCL: {NCCL_REASON}")
TIMEOUT = datetime.timedelta(seconds=60)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_comm(nranks: int = 1, timeout_ms: int = 30000, **kw):
    return _C.NcclCommunicator(_C.nccl_get_unique_id(), 0, nranks, 0, timeout_ms, **kw)


# ---- everywhere (no GPU needed) ---------------------------------------------------------------

def test_build_reports_nccl_consistently():
    info = _C.nccl_info()
    assert info["compiled"] == _C.nccl_available() == bool(_C.build_info()["nccl"])
    assert nccl_comm.nccl_compiled() == info["compiled"]
    if not info["compiled"]:
        assert info["reason"] and ("NCCL" in info["reason"] or "CUDA" in info["reason"])
        with pytest.raises(RuntimeError, match="without"):
            _C.NcclCommunicator(b"\0" * 128, 0, 1, 0, 1000)
        with pytest.raises(RuntimeError, match="without"):
            _C.nccl_get_unique_id()
    else:
        assert info["header_version"] >= 21400
        assert issubclass(_C.NcclCommError, RuntimeError)


def test_unavailable_reason_is_explained():
    if NCCL_REASON is None:
        assert nccl_comm.nccl_available()
        assert "cpu" in nccl_comm.nccl_unavailable_reason("cpu")
    else:
        assert not nccl_comm.nccl_available()
        assert isinstance(NCCL_REASON, str) and len(NCCL_REASON) > 20


@pytest.mark.skipif(not nccl_comm.nccl_compiled() or torch.cuda.is_available(),
                    reason="needs an NCCL build on a machine without a usable GPU")
def test_constructor_without_gpu_fails_clearly():
    # The library may load (it needs no driver to load): the CUDA runtime check comes first.
    with pytest.raises(RuntimeError, match="CUDA|NCCL"):
        try:
            uid = _C.nccl_get_unique_id()
        except RuntimeError:
            uid = b"\0" * 128
        _C.NcclCommunicator(uid, 0, 1, 0, 1000)
    with pytest.raises(ValueError, match="128 bytes"):
        _C.NcclCommunicator(b"short", 0, 1, 0, 1000)


def test_resolve_comm_rejects_unknown_choice():
    with pytest.raises(ValueError, match="'auto', 'torch', 'nccl'"):
        comm_select.resolve_comm("mpi")


def test_selection_on_gloo():
    topo = make_topology("complete", 1, 1)
    with single_process_group("gloo"):
        kind, reason = comm_select.resolve_comm("auto")
        assert kind == "torch" and "gloo" in reason
        c = comm_select.select_communicator("auto", topo, TIMEOUT)
        assert isinstance(c, TorchCommunicator) and "gloo" in c.selection_reason
        c = comm_select.select_communicator("torch", topo, TIMEOUT)
        assert isinstance(c, TorchCommunicator)
        with pytest.raises(ValueError):
            comm_select.select_communicator("gloo", topo, TIMEOUT)
        if NCCL_REASON is not None:
            with pytest.raises(RuntimeError, match="comm='nccl'") as info:
                comm_select.select_communicator("nccl", topo, TIMEOUT)
            assert NCCL_REASON[:30] in str(info.value)
        else:  # explicit 'nccl' works with any backend (the store carries the unique id)
            c = comm_select.select_communicator("nccl", topo, TIMEOUT, device="cuda:0")
            assert isinstance(c, nccl_comm.NcclCommunicator)
            c.close()
            with pytest.raises(RuntimeError, match="cpu"):
                comm_select.select_communicator("nccl", topo, TIMEOUT, device="cpu")


# ---- one GPU: raw communicator ------------------------------------------------------------------

@needs_nccl
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exchange_with_self_is_stream_ordered(dtype):
    comm = new_comm()
    assert (comm.rank, comm.size, comm.device) == (0, 1, 0)
    n = 1 << 20
    ref = torch.arange(n, device="cuda").to(dtype)
    send = torch.zeros(n, device="cuda", dtype=dtype)
    recv = torch.full((n,), -1.0, device="cuda", dtype=dtype)
    torch.cuda._sleep(200_000_000)  # a long kernel before the write: the exchange must wait for it
    send.copy_(ref)
    work = comm.exchange(send, recv, 0, "bucket 3")
    assert work.label == "bucket 3" and work.peers == [0]
    work.wait(10_000)  # the current stream waits; no host synchronisation
    out = recv.clone()  # ordered after the exchange on the current stream
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert work.is_completed()
    comm.close()
    assert comm.closed


@needs_nccl
@pytest.mark.cuda
def test_all_reduce_and_synchronize():
    comm = new_comm()
    x = torch.empty(4097, device="cuda")
    torch.cuda._sleep(200_000_000)
    x.copy_(torch.linspace(-3, 3, 4097, device="cuda"))
    ref = torch.linspace(-3, 3, 4097, device="cuda")
    work = comm.all_reduce(x, "bucket 0")
    work.synchronize(10_000)  # host wait
    assert work.is_completed()
    torch.testing.assert_close(x, ref, rtol=0, atol=0)  # a sum over one rank is the identity
    # many in flight, then one stream-ordered wait each
    works = [comm.all_reduce(x, f"bucket {i}") for i in range(16)]
    for w in works:
        w.wait(10_000)
    torch.testing.assert_close(x, ref, rtol=0, atol=0)
    torch.cuda.synchronize()
    deadline = time.time() + 5
    while comm.outstanding and time.time() < deadline:  # the watchdog retires completed work
        time.sleep(0.05)
    assert comm.outstanding == 0
    comm.check()


@needs_nccl
@pytest.mark.cuda
def test_split():
    comm = new_comm()
    sub = comm.split(0, 0, "sub")
    assert sub is not None and (sub.rank, sub.size, sub.name) == (0, 1, "sub")
    sub.set_global_ranks([0])
    x = torch.ones(10, device="cuda")
    sub.all_reduce(x, "bucket 1").wait(10_000)
    torch.testing.assert_close(x, torch.ones(10, device="cuda"))
    assert comm.split(-1, 0, "none") is None  # NCCL_SPLIT_NOCOLOR
    sub.close()
    comm.close()


@needs_nccl
@pytest.mark.cuda
def test_invalid_arguments():
    comm = new_comm()
    a = torch.zeros(8, device="cuda")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        comm.exchange(torch.zeros(8), a, 0, "x")
    with pytest.raises(RuntimeError, match="dtype"):
        comm.exchange(a, torch.zeros(8, device="cuda", dtype=torch.float16), 0, "x")
    with pytest.raises(RuntimeError, match="elements"):
        comm.exchange(a, torch.zeros(9, device="cuda"), 0, "x")
    with pytest.raises(RuntimeError, match="share memory"):
        comm.exchange(a, a, 0, "x")
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.all_reduce(torch.zeros(8, 2, device="cuda").t(), "x")
    with pytest.raises(RuntimeError, match="dtype"):
        comm.all_reduce(torch.zeros(8, device="cuda", dtype=torch.bool), "x")
    with pytest.raises(ValueError, match="peer 1"):
        comm.exchange(a, torch.zeros(8, device="cuda"), 1, "x")
    with pytest.raises(ValueError, match="rank"):
        _C.NcclCommunicator(_C.nccl_get_unique_id(), 1, 1, 0, 1000)
    comm.check()  # argument errors do not break the communicator
    comm.close()


@needs_nccl
@pytest.mark.cuda
def test_abort_fails_every_later_call():
    comm = new_comm()
    x = torch.ones(16, device="cuda")
    work = comm.all_reduce(x, "bucket 2")
    torch.cuda.synchronize()
    comm.abort("test abort")
    assert comm.aborted and "test abort" in comm.error
    with pytest.raises(_C.NcclCommError, match="test abort"):
        work.wait(1000)
    with pytest.raises(_C.NcclCommError, match="test abort"):
        comm.all_reduce(x, "bucket 2")
    with pytest.raises(_C.NcclCommError, match="test abort"):
        comm.check()
    comm.close()  # after an abort: nothing left to destroy
    with pytest.raises(_C.NcclCommError):
        comm.exchange(x, torch.ones(16, device="cuda"), 0, "x")


_INIT_BOUNDED_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from decentpy import _C
    torch.cuda.set_device(0)
    start = time.monotonic()
    try:  # a 2-rank communicator whose second rank never comes
        _C.NcclCommunicator(_C.nccl_get_unique_id(), 0, 2, 0, 1500)
    except _C.NcclCommError as e:
        assert "did not complete within 1.5 s" in str(e), str(e)
        assert time.monotonic() - start < 60
        print("OK")
        sys.exit(0)
    sys.exit("no error raised")
""")


def _run_child_ok(script: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """A GPU scenario in its own process (if it hangs or aborts, the test session survives); it
    must exit 0 after printing OK."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=REPO)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    return r


@needs_nccl
@pytest.mark.cuda
def test_initialisation_is_bounded():
    _run_child_ok(_INIT_BOUNDED_SCRIPT)


_STREAM_OUTLIVES_SCRIPT = textwrap.dedent("""
    import gc, sys, torch
    from decentpy import _C
    torch.cuda.set_device(0)
    comm = _C.NcclCommunicator(_C.nccl_get_unique_id(), 0, 1, 0, 30000)
    side = torch.cuda.ExternalStream(comm.stream, device=0)
    block = torch.ones(1 << 20, device="cuda")     # a bucket block sent on the communicator's stream
    recv = torch.zeros(1 << 20, device="cuda")
    block.record_stream(side)
    recv.record_stream(side)
    comm.exchange(block, recv, 0, "bucket 0").wait(10000)
    torch.cuda.synchronize()
    comm.close()
    del comm, side
    gc.collect()
    del block, recv                                 # freed after the communicator: the allocator
    gc.collect()                                    # records events on its stream now
    torch.cuda.synchronize()
    x = torch.empty(1 << 20, device="cuda")         # the cached blocks are reusable
    x.fill_(1.0)
    torch.cuda.synchronize()
    print("OK")
""")


@needs_nccl
@pytest.mark.cuda
def test_buffers_recorded_on_the_stream_may_outlive_the_communicator():
    _run_child_ok(_STREAM_OUTLIVES_SCRIPT)


_WATCHDOG_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from decentpy import _C
    torch.cuda.set_device(0)
    comm = _C.NcclCommunicator(_C.nccl_get_unique_id(), 0, 1, 0, 60000)
    x = torch.ones(1024, device="cuda")
    torch.cuda._sleep(4_000_000_000)        # seconds of compute ahead of the operation
    work = comm.all_reduce(x, "bucket 5")
    work.wait(500)                          # deadline 0.5 s from now: the watchdog must fire
    t0 = time.monotonic()
    while not comm.aborted and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert comm.aborted, "watchdog did not abort"
    try:
        work.synchronize(1000)
    except _C.NcclCommError as e:
        msg = str(e)
        assert "bucket 5" in msg and "did not complete within 0.5 s" in msg and "rank 0" in msg, msg
        torch.cuda.synchronize()            # the streams are released
        print("OK")
        sys.exit(0)
    sys.exit("no error raised")
""")


@needs_nccl
@pytest.mark.cuda
def test_watchdog_aborts_past_the_deadline():
    # In a child process: an aborted communicator must not take the test session with it.
    r = _run_child_ok(_WATCHDOG_SCRIPT)
    assert "[decentpy NCCL watchdog]" in r.stderr and "bucket 5" in r.stderr


# ---- one GPU: the Python communicator and the wrapper -----------------------------------------

@needs_nccl
@pytest.mark.cuda
def test_python_communicator_world_of_one():
    topo = make_topology("complete", 1, 1)
    with single_process_group("nccl"):
        c = comm_select.select_communicator("auto", topo, TIMEOUT)
        assert isinstance(c, nccl_comm.NcclCommunicator), c.selection_reason
        assert plan_exchange(Group((0,), 1.0), 0).launch(c, 0, torch.ones(4, device="cuda"),
                                                         torch.ones(4, device="cuda")) is None
        send = torch.arange(100, dtype=torch.float32, device="cuda")
        recv = torch.zeros(100, device="cuda")
        ex = nccl_comm.NcclExchange(c.world.exchange(send, recv, 0, "bucket 9"), 9, (0,), 0, (send, recv), False)
        ex.wait(TIMEOUT)
        torch.testing.assert_close(recv, send)
        c.check()
        c.abort("bye")
        with pytest.raises(PeerTimeoutError, match="bye"):
            c.check()
        c.close()
        assert isinstance(comm_select.select_communicator("torch", topo, TIMEOUT), TorchCommunicator)


@needs_nccl
@pytest.mark.cuda
def test_wrapper_end_to_end_with_comm_nccl():
    from decentpy import DecentralizedDataParallel

    if "comm" not in inspect.signature(DecentralizedDataParallel.__init__).parameters:
        pytest.skip("DecentralizedDataParallel does not take comm= yet")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = [(torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")) for _ in range(5)]
    with single_process_group("nccl"):
        ddp = DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
                                        topology="complete", comm="nccl")
        comm = getattr(ddp, "_comm", None)
        if comm is not None:
            assert isinstance(comm, nccl_comm.NcclCommunicator)
        for x, y in data:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        torch.cuda.synchronize()
        for p, q in zip(model.parameters(), ref.parameters()):  # a world of one is plain SGD
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

"""Every rank agrees or fails clearly (issue 22): settings that differ between ranks, non-finite
gradients, dead and silent peers. Each probe asserts the error type and that the message names the
bad value or rank, on every rank, within a bound of seconds (not the process group's timeout)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict

import pytest
import torch

from dist_harness import run_workers
from reference import make_mlp

pytestmark = pytest.mark.timeout(120)


def _expect(fn: Any) -> Dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the error
        return {"type": type(exc).__name__, "types": [c.__name__ for c in type(exc).__mro__], "text": str(exc),
                "s": time.monotonic() - start}
    return {"type": None, "types": [], "text": "", "s": time.monotonic() - start}


def settings_worker(rank: int, world: int) -> Dict[str, Any]:
    """Constructor settings that differ on the last rank: one spawn, several probes (the group stays
    usable after each, since every rank raised before any other collective)."""
    from decentpy import DecentralizedDataParallel

    last = rank == world - 1

    def sgd(lr: float) -> Any:
        return lambda named: torch.optim.SGD([p for _, p in named], lr=lr)

    out = {
        "bucket_size_in_mb": _expect(lambda: DecentralizedDataParallel(
            make_mlp(0), sgd(0.1), topology="ring", bucket_size_in_mb=0.0002 if last else 0.0004)),
        "topology": _expect(lambda: DecentralizedDataParallel(
            make_mlp(0), sgd(0.1), topology="complete" if last else "ring")),
        "lr": _expect(lambda: DecentralizedDataParallel(make_mlp(0), sgd(0.5 if last else 0.1), topology="ring")),
    }
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # nobody is stuck in a half-started collective
    out["allreduce"] = t.item()
    out.update(nonfinite_probes(rank, world))
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def nonfinite_probes(rank: int, world: int) -> Dict[str, Any]:
    """A NaN loss on the last rank at step 2: with nonfinite='skip' no parameter anywhere becomes
    non-finite and every rank logs a warning naming rank, step and bucket; with 'raise' every rank
    raises. (Last in the spawn: after 'raise' the job's error board holds that rank's report.)"""
    import decentpy.comm.failures as failures
    from decentpy import DecentralizedDataParallel, NonFiniteGradientError
    from reference import batch, decentpy_optim_fn, loss_fn

    failures.NOTICE_INTERVAL_S = 0.0  # look for the peers' notices every iteration (default: every 5 s)
    records = _Records()
    logging.getLogger("decentpy").addHandler(records)
    logging.getLogger("decentpy").setLevel(logging.INFO)
    bad = world - 1
    out: Dict[str, Any] = {}
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology="ring", bucket_size_in_mb=0.0002)
    for k in range(6):
        x, y = batch(rank, k)
        loss = loss_fn(ddp(x), y)
        (loss * float("nan") if (rank == bad and k == 2) else loss).backward()
        time.sleep(0.05)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in ddp.parameters())
    out["consensus"] = ddp.consensus_distance()
    out["warnings"] = [m for m in records.lines if "not finite" in m]
    ddp.close()

    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology="ring", bucket_size_in_mb=0.0002,
                                    nonfinite="raise")
    start = time.monotonic()
    try:
        for k in range(20):
            x, y = batch(rank, k)
            loss = loss_fn(ddp(x), y)
            (loss * float("nan") if (rank == bad and k == 2) else loss).backward()
            if k == 2:
                start = time.monotonic()
        out["raise"] = {"type": None}
    except NonFiniteGradientError as exc:
        out["raise"] = {"type": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    return out


def test_settings_that_differ_and_nonfinite_gradients_raise_or_warn_on_every_rank() -> None:
    world = 3
    res = run_workers(settings_worker, world, timeout=90)
    names = {"bucket_size_in_mb": ("0.0004", "0.0002"), "topology": ("ring", "complete"), "lr": ("0.1", "0.5")}
    for rank, out in enumerate(res):
        assert out["allreduce"] == world
        for key, values in names.items():
            got = out[key]
            assert got["type"] == "SettingsMismatchError" and "ValueError" in got["types"], (rank, key, got)
            assert key in got["text"] and f"rank {world - 1}" in got["text"], (rank, key, got)
            assert all(v in got["text"] for v in values), (rank, key, got)
            assert got["s"] < 20, (rank, key, got)
        assert out["finite"] and out["consensus"] == out["consensus"], (rank, out)  # no NaN anywhere
        assert any(f"rank {world - 1}" in m and "step 2" in m and "bucket" in m for m in out["warnings"]), (rank, out)
        got = out["raise"]
        assert got["type"] in ("NonFiniteGradientError", "PeerNonFiniteError"), (rank, got)
        assert f"rank {world - 1}" in got["text"] and "not finite" in got["text"] and got["s"] < 15, (rank, got)


def killed_worker(rank: int, world: int, victim: int, sig: int) -> Dict[str, Any]:
    """Trains on a ring; ``victim`` gets ``sig`` (SIGKILL: dies without a goodbye; SIGSTOP: silent)
    at step 4. Every survivor must raise a PeerTimeoutError naming it."""
    import datetime
    import os
    import signal

    from decentpy import DecentralizedDataParallel, PeerTimeoutError
    from reference import batch, decentpy_optim_fn, loss_fn

    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology="ring",
                                    bucket_size_in_mb=0.0002, peer_liveness_timeout=datetime.timedelta(seconds=4))
    pids = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())  # a stopped victim is killed by rank 0 at the end
    start = None
    out: Dict[str, Any] = {"type": None}
    try:
        for k in range(200):
            if k == 4:
                if rank == victim:
                    os.kill(os.getpid(), sig)
                    time.sleep(60)  # stopped: never gets here before the others gave up
                start = time.monotonic()
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
        ddp.consensus_distance()
    except PeerTimeoutError as exc:
        out = {"type": type(exc).__name__, "text": str(exc), "ranks": exc.ranks,
               "elapsed": time.monotonic() - (start or time.monotonic())}
    except Exception as exc:  # noqa: BLE001 - a raw backend error: the test fails on it
        out = {"type": type(exc).__name__, "text": str(exc), "ranks": [], "elapsed": -1.0}
    if rank == 0 and sig == signal.SIGSTOP:
        os.kill(pids[victim], signal.SIGKILL)
    return out


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_dead_or_silent_peer_is_named_by_every_survivor(sig: str) -> None:
    import signal

    world, victim = 4, 2
    # pg_timeout_s: the process group's own timeout (gloo's waits) is far longer than what is allowed here
    res = run_workers(killed_worker, world, victim, int(getattr(signal, sig)), timeout=100, allow_failures=True,
                      pg_timeout_s=300)
    for r in range(world):
        if r == victim:
            continue
        o = res[r]
        assert isinstance(o, dict) and o["type"] is not None, f"rank {r}: {o}"
        assert o["type"] in ("PeerUnreachableError", "PeerReportedError"), f"rank {r}: {o}"
        assert victim in o["ranks"] and f"rank(s) [{victim}]" in o["text"], f"rank {r}: {o}"
        assert "bucket" in o["text"], f"rank {r}: {o}"
        assert 0 < o["elapsed"] < 20, f"rank {r}: {o}"


STEPS, EVERY, SIGNAL_AT = 12, 4, 5


def _train(rank: int, ddp: Any, start: int, ckpt: Any = None) -> int:
    """Steps ``start``..STEPS-1 (inputs with RNG noise, so the RNG state matters); with ``ckpt``,
    stops where it says so. Returns the number of iterations completed."""
    import os
    import signal

    from reference import batch, loss_fn

    for k in range(start, STEPS):
        if ckpt is not None and rank == 1 and k == SIGNAL_AT:
            os.kill(os.getpid(), signal.SIGTERM)  # preemption, noticed at the next boundary
        x, y = batch(rank, k)
        loss_fn(ddp(x + 0.1 * torch.randn_like(x)), y).backward()
        if ckpt is not None and ckpt.after_step(k + 1, {"next": k + 1}):
            return k + 1
    return STEPS


def preempted_worker(rank: int, world: int, directory: str, phase: str) -> Dict[str, Any]:
    from decentpy import DecentralizedDataParallel, PreemptionCheckpointer
    from reference import decentpy_optim_fn

    def make() -> Any:
        torch.manual_seed(100 + rank)
        return DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology="ring",
                                         bucket_size_in_mb=0.0002)

    out: Dict[str, Any] = {}
    if phase == "first":
        ddp = make()
        _train(rank, ddp, 0)
        out["reference"] = [p.detach().clone() for p in ddp.parameters()]
        ddp.close()
        ddp = make()
        out["stopped_at"] = _train(rank, ddp, 0, PreemptionCheckpointer(ddp, directory, every=EVERY))
        return out
    ddp = make()
    resumed = PreemptionCheckpointer(ddp, directory, every=EVERY).resume()
    assert resumed is not None
    out["resumed_at"] = resumed["step"]
    _train(rank, ddp, resumed["extra"]["next"])
    out["final"] = [p.detach().clone() for p in ddp.parameters()]
    return out


def test_sigterm_checkpoint_resumes_identically(tmp_path: Any) -> None:
    world = 3
    first = run_workers(preempted_worker, world, str(tmp_path), "first", timeout=90)
    assert [o["stopped_at"] for o in first] == [8] * world  # signalled at 5: every rank saved at 8 and stopped
    second = run_workers(preempted_worker, world, str(tmp_path), "second", timeout=90)
    for r in range(world):
        assert second[r]["resumed_at"] == 8
        for a, b in zip(first[r]["reference"], second[r]["final"]):
            assert torch.equal(a, b), f"rank {r}: the resumed run differs from the uninterrupted one"


# --- examples/train_digits.py: --checkpoint-dir / --resume --------------------------------------

def digits_worker(rank: int, world: int, mode: str, ckpt_dir: str, save_dir: str, stop_at: int) -> None:
    """``mode`` "full": an uninterrupted run; "stop": the preemption flag set at ``stop_at`` (what
    the SIGTERM handler sets; the real signal is test_sigterm_checkpoint_resumes_identically's);
    "resume": a new job with --resume."""
    import decentpy.preemption as pre
    from dist_harness import run_example_main

    argv = ["--topology", "ring", "--optimizer", "adamw", "--epochs", "2", "--compare", "none",
            "--local-world-size", "1", "--save", save_dir]
    ckpt = ["--checkpoint-dir", ckpt_dir, "--checkpoint-every", "10"]
    if mode == "stop":
        original = pre.PreemptionCheckpointer.after_step

        def after_step(self: Any, step: int, extra: Any = None) -> bool:
            if step == stop_at:
                self.signalled = True
            return original(self, step, extra)

        pre.PreemptionCheckpointer.after_step = after_step  # type: ignore[method-assign]
    run_example_main("train_digits.py", argv + {"full": [], "stop": ckpt, "resume": ckpt + ["--resume"]}[mode])


def _tensors(x: Any, prefix: str = "") -> Dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {prefix: x}
    out: Dict[str, torch.Tensor] = {}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else []
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out


def test_train_digits_resumes_identically(tmp_path: Any) -> None:
    """The example preempted at step 30 (checkpoints every 10) and resumed ends with the training
    state of the uninterrupted run, bit for bit, on every rank."""
    world = 2
    for mode, save in (("full", "a"), ("stop", "b"), ("resume", "b")):  # each a new job (new processes)
        run_workers(digits_worker, world, mode, str(tmp_path / "ckpt"), str(tmp_path / save), 30, timeout=120,
                    local_ranks=True)
    assert (tmp_path / "ckpt" / "ring" / "manifest.json").is_file()
    for r in range(world):
        a = _tensors(torch.load(tmp_path / "a" / "ring" / f"train_state_rank{r}.pt", weights_only=False))
        b = _tensors(torch.load(tmp_path / "b" / "ring" / f"train_state_rank{r}.pt", weights_only=False))
        assert a.keys() == b.keys() and a
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {r}: {k} differs after the resume"


# --- the other wrappers: a killed rank is named too ------------------------------------------------

def killed_other_worker(rank: int, world: int, kind: str, victim: int) -> Dict[str, Any]:
    """``kind`` "sharded": OSS + ShardedDataParallel on 3 ranks; "pipe": a 3-stage AsyncPipe. The
    victim SIGKILLs itself at step 3; the survivors must raise a PeerTimeoutError naming it."""
    import os
    import signal

    from torch import nn

    from decentpy import AsyncPipe, OSS, PeerTimeoutError, ShardedDataParallel

    torch.manual_seed(0)
    if kind == "sharded":
        model = make_mlp(0)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        net = ShardedDataParallel(model, opt)

        def step(k: int) -> None:
            x = torch.randn(8, 6)
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    else:
        layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        pipe = AsyncPipe(layers, [2, 2, 1], chunks=2)

        def step(k: int) -> None:
            out = pipe(torch.randn(8, 6))
            if rank == world - 1:
                out.sum().backward()
            else:
                pipe.back_helper(out)

    out: Dict[str, Any] = {"type": None}
    start = None
    try:
        for k in range(50):
            if k == 3:
                if rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL)
                start = time.monotonic()
            step(k)
    except PeerTimeoutError as exc:
        out = {"type": type(exc).__name__, "text": str(exc), "ranks": exc.ranks,
               "elapsed": time.monotonic() - (start or time.monotonic())}
    except Exception as exc:  # noqa: BLE001 - a raw backend error: the test fails on it
        out = {"type": type(exc).__name__, "text": str(exc), "ranks": [], "elapsed": -1.0}
    return out


@pytest.mark.parametrize("kind", ["sharded", "pipe"])
def test_killed_rank_is_named_by_the_sharding_and_pipeline_wrappers(kind: str) -> None:
    world, victim = 3, 1
    res = run_workers(killed_other_worker, world, kind, victim, timeout=90, allow_failures=True, pg_timeout_s=300)
    for r in range(world):
        if r == victim:
            continue
        o = res[r]
        assert isinstance(o, dict) and o["type"] in ("PeerUnreachableError", "PeerReportedError"), f"rank {r}: {o}"
        assert victim in o["ranks"] and f"[{victim}]" in o["text"], f"rank {r}: {o}"
        assert 0 < o["elapsed"] < 20, f"rank {r}: {o}"

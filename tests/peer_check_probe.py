"""Probes of a faulty peer (issue 52): one member of 4 gloo workers sends wrong values, the others
train a tiny MLP towards a fixed teacher and are measured on a held-out batch.

Faults are injected on the faulty rank at the wire, in what it sends, never in its own parameters:
its exchange's launch is wrapped so that a pair exchange sends a corrupted copy of the parameters
and a group exchange's send buffer is corrupted before the launch (so its fingerprint describes what
it sends: a member that computes garbage, named by the group check) -- or, with ``where='comm'``, in
the communicator's all-reduce after the fingerprint was taken (data that does not match its
fingerprint: detected as inconsistent, not named).

Used by tests/test_peer_check.py (one spawn per topology) and, run as a script, prints the table of
docs/failures.md ("A faulty peer"):

    PYTHONPATH=. python tests/peer_check_probe.py            # ring and alternating-exp-ring, every policy
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference import IN, make_mlp  # noqa: E402

FAULTY = 3                 # the faulty member (global rank) of the 4 workers
STEPS = 60                 # training iterations per run
BATCH = 16
LOCAL = {"ring": 1, "alternating-exp-ring": 2}   # local_world_size per topology (AER: 2 nodes x 2)
#: fault name -> (the step of the launch it corrupts, None: every step; the corruption of a buffer)
#: (alternating-exp-ring, 2 nodes: what is launched at an odd step is mixed in the group of 4, at an
#: even step by the node's pair)
FAULTS: Dict[str, Tuple[Optional[int], Callable[[torch.Tensor], None]]] = {
    "1e4 once (step 0)": (0, lambda t: t.mul_(1e4)),
    "1e4 once (step 19)": (19, lambda t: t.mul_(1e4)),
    "NaN once (step 9)": (9, lambda t: t.view(-1)[::3].fill_(float("nan"))),
    "sign flip every step": (None, lambda t: t.neg_()),
    "random every step": (None, lambda t: t.copy_(torch.randn_like(t) * t.std().clamp(min=1e-3))),
}


#: the faulty rank's own parameters become NaN (not a wire fault)
OWN_NAN = "own parameters NaN (step 10)"
#: no fault: every rank's learning rate x10 at step 30 (a change of scale every peer shows at once)
LR_JUMP = "learning rate x10 at step 30 (every rank)"


def teacher() -> torch.nn.Module:
    return make_mlp(1234)


def data(rank: int, step: int, net: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + 104729 * step + 11)
    x = torch.randn(BATCH, IN, generator=g)
    with torch.no_grad():
        return x, net(x)


def held_out(net: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(424242)
    x = torch.randn(256, IN, generator=g)
    with torch.no_grad():
        return x, net(x)


class Records(logging.Handler):
    """The warnings of the decentpy loggers (the peer check's: who named whom)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def inject(ddp: Any, fault: str, where: str = "exchange") -> None:
    """Corrupt what this rank sends (see the module): ``where='exchange'`` before the launch (the
    fingerprint describes it), ``'comm'`` in the communicator's group all-reduce (it does not)."""
    at, corrupt = FAULTS[fault]
    strategy = ddp._strategy
    keep: Dict[int, torch.Tensor] = {}  # a pair's corrupted copies, alive until their send completed
    comm = ddp.communicator

    def due() -> bool:
        return at is None or strategy.step == at

    ex = strategy.exchange
    launch = ex.launch
    send_recv = comm.send_recv

    def bad_send_recv(bucket: int, peer: int, send: torch.Tensor, recv: torch.Tensor) -> Any:
        bad = send.detach().clone()
        corrupt(bad)
        keep[bucket] = bad
        return send_recv(bucket, peer, bad, recv)

    def patched_launch(b: Any, nxt: Any) -> Any:
        if not due():
            return launch(b, nxt)
        if nxt.send_scale() is None:  # a pair: the parameter block itself is sent; send a corrupted copy
            comm.send_recv = bad_send_recv
            try:
                return launch(b, nxt)
            finally:
                comm.send_recv = send_recv
        if where == "exchange":
            corrupt(b.comm)  # the group's send buffer (scale * p), before its fingerprint is taken
        return launch(b, nxt)

    ex.launch = patched_launch
    if where == "comm":
        all_reduce = comm.all_reduce

        def bad_all_reduce(bucket: int, ranks: Tuple[int, ...], buffer: torch.Tensor) -> Any:
            if due():  # the body (the bucket's exchange buffer, the head of what is all-reduced), not the fingerprints
                corrupt(strategy.buckets[bucket].comm)
            return all_reduce(bucket, ranks, buffer)

        comm.all_reduce = bad_all_reduce


def train(rank: int, topology: str, peer_check: Any, fault: Optional[str], where: str = "exchange",
          steps: int = STEPS) -> Dict[str, Any]:
    """One run; this rank's held-out loss, parameters, stats and the warnings it logged. ``peer_check``
    None: the wrapper's default. ``fault`` :data:`OWN_NAN`: the faulty rank's own parameters become NaN
    before step 10's forward (the non-finite guard's case), instead of a fault on the wire. ``where``
    ``'lagged'``: a wire fault as ``'exchange'``, the verdicts read the GPU's way (a step late, the
    kernel reading the factor) on the CPU."""
    from decentpy import DecentralizedDataParallel
    from reference import decentpy_optim_fn

    records = Records()
    log = logging.getLogger("decentpy")
    log.addHandler(records)
    net = teacher()
    hx, hy = held_out(net)
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology=topology,
                                    local_world_size=LOCAL[topology], bucket_size_in_mb=0.0004,
                                    **({} if peer_check is None else {"peer_check": peer_check}))
    if where == "lagged":
        ddp._strategy.peer_check.lagged = True
    if fault is not None and rank == FAULTY and fault not in (OWN_NAN, LR_JUMP):
        inject(ddp, fault, "exchange" if where == "lagged" else where)
    start = time.monotonic()
    try:
        for k in range(steps):
            if fault == LR_JUMP and k == 30:
                for opt in ddp._optims:
                    for group in opt.param_groups:
                        group["lr"] *= 10
            if fault == OWN_NAN and rank == FAULTY and k == 10:
                ddp.wait()  # nothing in flight reads the parameters while they are written
                with torch.no_grad():
                    for p in ddp.module.parameters():
                        p.fill_(float("nan"))
            x, y = data(rank, k, net)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        ddp.wait()
        with torch.no_grad():
            loss = float(torch.nn.functional.mse_loss(ddp.module(hx), hy))
        params = [p.detach().clone() for p in ddp.module.parameters()]
        stats = ddp.stats()
        check = ddp._strategy.peer_check
        peaks = (getattr(check, "peak_ratio", 0.0), getattr(check, "peak_first_ratio", 0.0))
        ddp.close()
    finally:
        log.removeHandler(records)
    return {"loss": loss, "params": params, "stats": stats, "warnings": records.lines, "peaks": peaks,
            "s": time.monotonic() - start}


def train_until_error(rank: int, topology: str, fault: str, steps: int = 40) -> Dict[str, Any]:
    """``peer_check='raise'``: the error this rank raised, and how long after the fault."""
    from decentpy import DecentralizedDataParallel
    from reference import decentpy_optim_fn

    net = teacher()
    ddp = DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adam"), topology=topology,
                                    local_world_size=LOCAL[topology], bucket_size_in_mb=0.0004, peer_check="raise")
    if rank == FAULTY:
        inject(ddp, fault)
    at = FAULTS[fault][0] or 0
    start = time.monotonic()
    try:
        for k in range(steps):
            if k == at:
                start = time.monotonic()
            x, y = data(rank, k, net)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as exc:  # noqa: BLE001 - the probe reports it
        out = {"types": [c.__name__ for c in type(exc).__mro__], "text": str(exc), "s": time.monotonic() - start,
               "peer": getattr(exc, "peer", None)}
    else:
        out = {"types": [], "text": "", "s": time.monotonic() - start, "peer": None}
    # rank 0 holds the job's store, where the others read the report: every rank stays until all have theirs
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("peer_check_probe/raised", 1)
    deadline = time.monotonic() + 60
    while int(store.add("peer_check_probe/raised", 0)) < dist.get_world_size() and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


def probe_worker(rank: int, world: int, topology: str, runs: Sequence[Tuple[str, Any, Optional[str], str]],
                 raise_fault: Optional[str]) -> Dict[str, Any]:
    """Every run of ``runs`` (name, peer_check, fault, where) in this one spawn, then (last: it leaves
    the job's error board holding reports) ``peer_check='raise'`` under ``raise_fault``."""
    torch.manual_seed(0)
    out: Dict[str, Any] = {}
    for name, check, fault, where in runs:
        out[name] = train(rank, topology, check, fault, where)
    if raise_fault is not None:
        out["raise"] = train_until_error(rank, topology, raise_fault)
    return out


def label(check: Any) -> str:
    return check if isinstance(check, str) else f"{check.policy}(bound={check.bound:g})"


def table(topologies: Sequence[str] = ("ring", "alternating-exp-ring"),
          policies: Sequence[Any] = ("skip", "clip", "off")) -> None:
    """The probe table: the others' final held-out loss, clean and under each fault, per policy."""
    from dist_harness import run_workers

    for topo in topologies:
        runs = [(f"clean/{p}", p, None, "exchange") for p in policies]
        runs += [(f"{f}/{p}", p, f, "exchange") for f in FAULTS for p in policies]
        if topo != "ring":
            runs += [(f"sign flip, data != fingerprint/{p}", p, "sign flip every step", "comm") for p in policies]
        runs = [(f"{name.rpartition('/')[0]}/{label(p)}", p, f, w) for name, p, f, w in runs]
        t0 = time.monotonic()
        res = run_workers(probe_worker, 4, topo, runs, None, timeout=1800)
        print(f"\n{topo} (4 workers{', 2 nodes x 2' if topo != 'ring' else ''}), {STEPS} steps, faulty rank "
              f"{FAULTY}; the others' held-out MSE (max over ranks 0-2) and its ratio to the clean run of the "
              f"same policy, and the ranks whose logs name rank {FAULTY}; clean: [contributions flagged; the largest "
              f"accepted distance over the median of its history, and under the first bound over the norm] "
              f"({time.monotonic() - t0:.0f} s)")
        print(f"{'fault':<40}" + "".join(f"{label(p):>26}" for p in policies))
        for fault in ["clean"] + list(FAULTS) + (["sign flip, data != fingerprint"] if topo != "ring" else []):
            cells = []
            for p in policies:
                p = label(p)
                clean = [res[r][f"clean/{p}"]["loss"] for r in range(4) if r != FAULTY]
                got = [res[r][f"{fault}/{p}"]["loss"] for r in range(4) if r != FAULTY]
                ratio = max(g / c for g, c in zip(got, clean))
                run = [res[r][f"{fault}/{p}"] for r in range(4)]
                named = "".join(str(r) for r in range(4) if r != FAULTY and any(
                    f"faulty peer rank {FAULTY}" in m for m in run[r]["warnings"]))
                failed = sum(run[r]["stats"].get("peer_checks_failed", 0) for r in range(4) if r != FAULTY)
                peak = max(run[r]["peaks"][0] for r in range(4))
                first = max(run[r]["peaks"][1] for r in range(4))
                cell = f"{max(got):.3g}" + (f" [{failed}; {peak:.2g}, {first:.2g}]" if fault == "clean" else
                                            f" ({ratio:.3g}x{', by ' + named if named else ''})")
                cells.append(cell)
            print(f"{fault:<40}" + "".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    from decentpy import PeerCheck

    chosen = {"default": ("skip", "clip", "off"),
              "clip": (PeerCheck("clip", 2.0), PeerCheck("clip", 3.0), PeerCheck("skip", 3.0))}
    table(policies=chosen[sys.argv[1] if len(sys.argv) > 1 else "default"])

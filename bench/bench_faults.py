"""Training through faults: decentpy's elastic gossip under SIGKILLs, against the same run without faults
and against what a user would pick instead (torch DDP with ``torchrun`` restarts, torchft).

W CPU gloo workers (default 4) train the MLP of ``examples/train_elastic.py`` on scikit-learn's
digits to a fixed number of global steps (``--steps``; each step also sleeps ``--step-sleep`` s, a
stand-in for a real model's compute, so that the few cores of a CI machine are not the bottleneck).
Every framework uses the same model initialisation, batches (32 per worker, drawn from a function of
the worker's seed and the step), optimizer (decentpy's SGD, lr 0.05, momentum 0.9) and sleep. A
fault injector SIGKILLs one random worker process a random 0.2-1.0 x ``--kill-every`` s after every
worker is training, one fault at a time: after a kill it waits until every worker (the replacement,
or the whole restarted group) has trained a step again before it draws the next one. Every
framework runs twice with the same seeds: with faults and without (its floor).

``--frameworks`` (default: those available here):

- ``decentpy``: ``decentpy.elastic.ElasticGossip``, every topology of ``--topologies`` (AER with 2
  workers per node). The survivors go on; a replacement started ``--replace-after`` s after the kill
  joins the running job and receives its state from a neighbour.
- ``torch-ddp-restarts``: ``torchrun --standalone --nproc-per-node=W --max-restarts=100`` running a
  plain ``torch.nn.parallel.DistributedDataParallel`` worker (gloo). Every K steps
  (``--checkpoint-every``) rank 0 saves model, optimizer and step (the data position is the step;
  written to a temporary file, then renamed, so a kill during the save leaves the previous
  checkpoint). The injector kills one of the agent's worker children, found in /proc (not the
  agent); torchrun stops the others and restarts the whole group, which resumes from the last
  checkpoint. There is no replacement: the delay is what torchrun takes. torchrun's default of
  sharing its rendezvous store with the workers breaks gloo restarts here (the restarted group reads
  the old group's addresses and fails, several times per kill: pytorch#135712), so the job sets that
  issue's workaround, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
  **K** defaults to Young's optimal checkpoint interval sqrt(2 C MTBF), with C the cost of one save
  of this state (measured in the bench process before the runs, with the worker's save function)
  and MTBF = ``--kill-every``: the interval that minimises checkpoint time plus expected redone work,
  i.e. what a user who knows the failure rate would choose. (The "every 30-60 s" rule of thumb would
  mean no checkpoint at all in a run this short.) With this tiny model C is about 1 ms, so K is a few
  steps (5 at the defaults, 14 at ``--kill-every 60``) and the checkpoints cost 0.5-3 % of the run:
  the baseline gets its best case. With a real model, C is seconds and K and the redone steps grow
  accordingly.
- ``torchft``: torchft's ``Manager`` with its ``DistributedDataParallel`` and ``Optimizer`` wrappers
  (gloo, ``PGTransport``, as in its ``train_ddp.py``), one replica group (one process, with its own
  store) per worker, and a lighthouse process (``LighthouseServer``, min_replicas 1, default
  timeouts; the process group's is 5 s, as in ``train_ddp.py``). A replacement
  restarts the killed replica group under its replica id and heals from a live one. torchft 0.2.0's
  DDP comm hook crashes every surviving replica when a kill lands during an allreduce (an assertion
  on a future that the failed wait never set); the worker uses the same hook with that case handled
  (``_patched_torchft_ddp``; ``--torchft-as-shipped`` runs the original, and the run then fails
  with the reason). torchft is not a dependency: ``pip install --no-deps --target DIR torchft`` plus
  its opentelemetry packages (not torch), then ``--torchft-path DIR`` or ``BENCH_TORCHFT_PATH=DIR``.
  Without it, a skip line names the reason.

Columns of ``bench/out/bench_faults.csv`` (one row per framework x topology x faults):

- ``goodput_vs_no_faults``: useful steps per second over the whole run relative to the same
  framework's no-fault run, i.e. the no-fault wall time over this run's (both train ``--steps``
  global steps). The printout also gives every run against decentpy's no-fault runs;
- ``max_stall_steps``: the longest time any worker went without completing a step, in median step
  times (gossip: the detection of the dead peer, ~2.5 s plus one heartbeat; DDP: detection, stopping
  and restarting the group, re-initialisation and the checkpoint load; torchft: ~5 s when the kill
  fails an all-reduce, next to nothing when it falls between two);
- ``rejoin_s``: from the start of a replacement's process (DDP: a restarted worker's) to its first
  trained step (Python start, imports, admission or process-group set-up, state transfer or
  checkpoint load), mean;
- ``final_loss`` / ``final_accuracy``: test loss and accuracy (percent) of the final model (gossip:
  the members' average, ``global_avg``; DDP and torchft replicas are identical);
- ``lost_steps``: global steps trained again, i.e. step numbers that a worker completed a second
  time (DDP: the steps between the last checkpoint and the kill, summed over the restarts; torchft:
  a step whose commit failed and was retried; gossip: none, nothing restarts).

    python -m bench.bench_faults                          # ~4 minutes on 2 idle cores, torchft included
    python -m bench.bench_faults --steps 3000 --kill-every 60 --topologies alternating-exp-ring
    python -m bench.bench_faults --frameworks torch-ddp-restarts --checkpoint-every 1200
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "bench" / "out"
COLUMNS = ["framework", "topology", "workers", "kills", "goodput_vs_no_faults", "max_stall_steps", "rejoin_s",
           "final_loss", "final_accuracy", "lost_steps"]
FRAMEWORKS = ("decentpy", "torch-ddp-restarts", "torchft")
CSV_NAME = {"decentpy": "decentpy-elastic", "torch-ddp-restarts": "torch-ddp-restarts", "torchft": "torchft"}
LR, MOMENTUM, BATCH = 0.05, 0.9, 32
MAX_RESTARTS = 100  # torchrun's limit: never reached here (each kill is one restart)
CHECKPOINT = "checkpoint.pt"


# ----------------------------------------------------------------------------------------------
# Worker side: what every framework's worker shares.

def _process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc): a rejoin time then includes the
    interpreter's start and the imports, also for processes that torchrun starts."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


def _setup() -> Tuple["torch.nn.Module", Tuple["torch.Tensor", ...]]:
    """The model (same initialisation everywhere) and the digits split."""
    import torch
    from torch import nn

    from examples.train_elastic import digits

    torch.set_num_threads(1)
    data = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, data


def _make_optimizer(named: Sequence[Tuple[str, "torch.Tensor"]]) -> "torch.optim.Optimizer":
    import decentpy.optim as dopt

    return dopt.optim_fn_sgd(list(named), lr=LR, momentum=MOMENTUM)


def _batch(x: "torch.Tensor", y: "torch.Tensor", shard: "torch.Tensor", seed: int,
           step: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """A worker's batch for one step: a function of (seed, step) alone, so the data position is the step
    count (a DDP checkpoint needs nothing more, a redone step draws the same batch)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100_000 + step)
    idx = shard[torch.randint(len(shard), (BATCH,), generator=g)]
    return x[idx], y[idx]


def _checkpoint_state(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer", step: int) -> Dict[str, Any]:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def save_checkpoint(state: Dict[str, Any], path: Path) -> float:
    """Write to a temporary file, then rename: a kill during the save leaves the previous checkpoint.
    Returns the seconds it took."""
    import torch

    t = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return time.perf_counter() - t


def _bench_store(rendezvous: str) -> Any:
    """The bench's TCPStore (counters for the injector), for the baseline workers."""
    import torch.distributed as dist

    host, port = rendezvous.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))


class StepLog:
    """One worker's JSON lines (appended: a DDP rank keeps one file across restarts) and its marks in
    the bench's store: ``bench/trained/<key>`` after its first step (the injector kills only a
    worker set that has trained again since the last fault), ``bench/done`` at the end."""

    def __init__(self, path: Path, store: Any, key: str, replacement: bool) -> None:
        self._t_start = _process_start_time()
        self._file = open(path, "a", buffering=1)
        self._store = store
        self._key = key
        self._replacement = replacement
        self._first = True

    def event(self, **fields: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def step(self, step: int, loss: float, lost: bool = False) -> None:
        """A step completed (``lost``: trained but discarded, it is done again)."""
        extra: Dict[str, Any] = {"lost": True} if lost else {}
        if self._first and not lost:
            if self._replacement:
                extra["since_start"] = time.time() - self._t_start
            self._store.set(f"bench/trained/{self._key}", "1")
            self._first = False
        self.event(step=step, loss=loss, **extra)

    def late(self) -> bool:
        """A replacement that has not trained yet while the others have finished: it has no one left to
        join (torchft would let it train the whole run alone from step 0)."""
        return self._first and self._replacement and int(self._store.add("bench/done", 0)) > 0

    def final(self, model: "torch.nn.Module", x: "torch.Tensor", y: "torch.Tensor") -> None:
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            out = model(x)
            self.event(final=True, loss=F.cross_entropy(out, y).item(),
                       accuracy=(out.argmax(1) == y).float().mean().item() * 100)

    def finish(self, world_size: Callable[[], int]) -> None:
        """Count this worker done and wait (bounded) for the others, so none leaves a peer's
        collective hanging."""
        self._store.add("bench/done", 1)
        deadline = time.monotonic() + 30
        while int(self._store.add("bench/done", 0)) < world_size() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._file.close()


def gossip_worker(args: argparse.Namespace) -> None:
    """One elastic gossip worker: trains to --steps; its shard follows the membership."""
    import torch
    import torch.nn.functional as F

    from decentpy.elastic import ElasticGossip, connect

    host, port = args.rendezvous.rsplit(":", 1)
    store = connect(host, int(port))
    model, (xtr, ytr, xte, yte) = _setup()
    shard = [torch.arange(args.slot, len(ytr), args.workers)]
    log = StepLog(Path(args.log_dir) / f"{args.member}.jsonl", store, str(args.member),
                  replacement=args.member >= args.workers)

    def on_change(change: Any) -> None:
        shard[0] = torch.arange(change.rank, len(ytr), change.world_size)
        log.event(change=change.epoch, members=list(change.members), reform_s=change.reform_s,
                  detect_s=change.detect_s, left=list(change.left), joined=list(change.joined))

    eg = ElasticGossip(model, _make_optimizer, topology=args.topology,
                       store=store, member_id=str(args.member), initial_workers=args.workers,
                       timeout=datetime.timedelta(seconds=60), peer_liveness_timeout=datetime.timedelta(seconds=5),
                       reform_timeout=datetime.timedelta(seconds=30), on_membership_change=on_change,
                       local_world_size=2 if args.topology == "alternating-exp-ring" else 1)
    shard[0] = torch.arange(eg.rank, len(ytr), eg.world_size)
    while eg.step_count < args.steps:
        eg.update()
        x, y = _batch(xtr, ytr, shard[0], 1000 + args.member, eg.step_count)
        loss = F.cross_entropy(eg(x), y)
        loss.backward()
        time.sleep(args.step_sleep)
        log.step(eg.step_count, loss.item())
    eg.global_avg(will_revert=False)
    log.final(model, xte, yte)
    log.finish(lambda: eg.world_size)
    os._exit(0)  # the old epochs' gloo threads: no teardown (docs/elastic.md, limits)


def ddp_worker(args: argparse.Namespace) -> None:
    """One rank of plain torch DDP under torchrun: resumes from the last checkpoint if there is one,
    trains to --steps, rank 0 checkpoints every --checkpoint-every steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    store = _bench_store(args.rendezvous)
    model, (xtr, ytr, xte, yte) = _setup()
    ddp = DistributedDataParallel(model)
    optimizer = _make_optimizer(model.named_parameters())
    log = StepLog(Path(args.log_dir) / f"{rank}.jsonl", store, f"{attempt}-{rank}", replacement=attempt > 0)
    path = Path(args.log_dir) / CHECKPOINT
    step = 0
    if path.exists():
        state = torch.load(path, weights_only=True)  # this run's own file, read as data all the same
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step = int(state["step"])
        log.event(resume=step, attempt=attempt)
    shard = torch.arange(rank, len(ytr), world_size)
    while step < args.steps:
        x, y = _batch(xtr, ytr, shard, 1000 + rank, step)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        time.sleep(args.step_sleep)
        optimizer.step()
        step += 1
        log.step(step, loss.item())
        if step % args.checkpoint_every == 0 and step < args.steps and rank == 0:
            log.event(checkpoint=step, save_s=save_checkpoint(_checkpoint_state(model, optimizer, step), path))
    log.final(model, xte, yte)
    log.finish(lambda: world_size)
    dist.destroy_process_group()


def torchft_worker(args: argparse.Namespace) -> None:
    """One torchft replica group of one process: its own store, torchft's DDP and optimizer wrappers;
    a replacement heals from a live replica group at its first quorum."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    store = _bench_store(args.rendezvous)
    group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, (xtr, ytr, xte, yte) = _setup()
    optimizer = _make_optimizer(model.named_parameters())

    def load_state_dict(state: Dict[str, Any]) -> None:  # a healing replica's, from a live one
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=5))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      replica_id=f"bench_faults_{args.slot}", timeout=datetime.timedelta(seconds=30),
                      checkpoint_transport=PGTransport(pg, timeout=datetime.timedelta(seconds=10),
                                                       device=torch.device("cpu")),
                      store_addr="127.0.0.1", store_port=group_store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse)
    ddp = (DistributedDataParallel if args.torchft_as_shipped else _patched_torchft_ddp())(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    log = StepLog(Path(args.log_dir) / f"{args.member}.jsonl", store, str(args.member),
                  replacement=args.member >= args.workers)
    shard = torch.arange(args.slot, len(ytr), args.workers)
    while manager.current_step() < args.steps:
        x, y = _batch(xtr, ytr, shard, 1000 + args.member, manager.current_step())
        ft_optimizer.zero_grad()  # starts the quorum
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()  # waits for the quorum
        if log.late():
            break
        time.sleep(args.step_sleep)
        committed = manager.should_commit()  # torchft.Optimizer.step's body, keeping the decision
        if committed:
            optimizer.step()
        log.step(manager.current_step() + (0 if committed else 1), loss.item(), lost=not committed)
    if not log.late():
        log.final(model, xte, yte)
    log.finish(manager.num_participants)  # the last quorum's (a late replacement is not in it)
    manager.shutdown(wait=False)
    os._exit(0)


def _patched_torchft_ddp() -> type:
    """torchft's DistributedDataParallel with its comm hook's failure case handled.

    torchft 0.2.0's hook asserts on the wrapped future after ``work.wait()``; when the allreduce
    failed (a peer was killed during it), ``_ManagedWork.wait`` has reported the error to the
    manager and returned False without setting that future, so the assertion kills every surviving
    replica. Here the hook returns the bucket unreduced in that case: the manager has the error,
    ``should_commit`` says no, and the step is redone, which is what torchft intends. Otherwise
    the hook is torchft's. ``--torchft-as-shipped`` runs the original."""
    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel

    def comm_hook(manager: Any, bucket: Any) -> "torch.futures.Future[torch.Tensor]":
        work = manager.allreduce(bucket.buffer())
        ok = work.wait()
        inner = getattr(work.get_future(), "_fut", None)
        if ok is False or inner is None:  # failed (or skipped after a failure): the step will not commit
            fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        return inner

    # DDP checks the hook's annotations as objects (this module's are strings)
    comm_hook.__annotations__ = {"manager": Any, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
    return type("PatchedDistributedDataParallel", (DistributedDataParallel,), {"_comm_hook": staticmethod(comm_hook)})


WORKERS: Dict[str, Callable[[argparse.Namespace], None]] = {
    "decentpy": gossip_worker, "torch-ddp-restarts": ddp_worker, "torchft": torchft_worker}


# ----------------------------------------------------------------------------------------------
# Bench side: one job per framework and run, one fault injector for all of them.

class Job:
    """One framework's processes in one run, as the fault injector sees them."""

    def __init__(self, args: argparse.Namespace, framework: str, topology: str, log_dir: Path, store: Any) -> None:
        self.args, self.framework, self.topology, self.log_dir, self.store = args, framework, topology, log_dir, store
        self.env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), args.torchft_path) if p))

    def worker_args(self) -> List[str]:
        a = self.args
        return ["-m", "bench.bench_faults", "--worker", "--framework", self.framework, "--rendezvous",
                f"127.0.0.1:{self.store.port}", "--workers", str(a.workers), "--steps", str(a.steps),
                "--topology", self.topology, "--step-sleep", str(a.step_sleep), "--log-dir", str(self.log_dir),
                "--checkpoint-every", str(a.checkpoint_every)] + ["--torchft-as-shipped"] * a.torchft_as_shipped

    def trained(self, key: str) -> bool:
        return self.store.check([f"bench/trained/{key}"])

    def done(self) -> bool:
        return int(self.store.add("bench/done", 0)) > 0

    def start(self) -> None:
        raise NotImplementedError

    def victims(self) -> List[Tuple[str, int]]:
        """(name, pid) of the workers that may be killed now; none until every worker has trained
        since the last fault (one fault at a time)."""
        raise NotImplementedError

    def killed(self, name: str) -> None:
        """After a kill: start the replacement, if this framework has one."""

    def finished(self) -> bool:
        raise NotImplementedError

    def stop(self, force: bool) -> None:
        """Wait (bounded) for the processes to end; ``force``: the run failed, kill them now."""
        raise NotImplementedError


class ReplacingJob(Job):
    """Workers started one by one; a killed one is replaced ``--replace-after`` s later by a new
    process in the same slot (decentpy: a new member that joins; torchft: the same replica group)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.procs: Dict[int, subprocess.Popen] = {}
        self.slots: Dict[int, int] = {}
        self.live: List[int] = []
        self.extra: List[str] = []

    def spawn(self, member: int, slot: int) -> None:
        with open(self.log_dir / f"{member}.err", "w") as err:
            self.procs[member] = subprocess.Popen(
                [sys.executable, *self.worker_args(), "--member", str(member), "--slot", str(slot), *self.extra],
                env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        self.slots[member] = slot
        self.live.append(member)

    def start(self) -> None:
        for m in range(self.args.workers):
            self.spawn(m, m)

    def victims(self) -> List[Tuple[str, int]]:
        ready = [m for m in self.live if self.procs[m].poll() is None and self.trained(str(m))]
        return [(str(m), self.procs[m].pid) for m in ready] if len(ready) == self.args.workers else []

    def killed(self, name: str) -> None:
        member = int(name)
        self.live.remove(member)
        time.sleep(self.args.replace_after)
        if not self.done():
            self.spawn(max(self.procs) + 1, self.slots[member])

    def finished(self) -> bool:
        crashed = {m: self.procs[m].poll() for m in self.live if self.procs[m].poll() not in (None, 0)}
        if crashed:
            raise RuntimeError(f"worker(s) exited with {crashed} (not killed by the injector): see "
                               f"{self.log_dir}/<member>.err")
        return (int(self.store.add("bench/done", 0)) >= len(self.live)
                or not any(self.procs[m].poll() is None for m in self.live))

    def stop(self, force: bool) -> None:
        for p in self.procs.values():
            _wait_or_kill(p, 0 if force else 60)


class TorchftJob(ReplacingJob):
    """ReplacingJob plus torchft's lighthouse, a process of its own."""

    def start(self) -> None:
        code = ("import sys\nfrom torchft._torchft import LighthouseServer\n"
                "s = LighthouseServer(bind='[::]:0', min_replicas=1)\nprint(s.address(), flush=True)\n"
                "sys.stdin.read()\n")  # serves until the bench closes its stdin
        with open(self.log_dir / "lighthouse.err", "w") as err:
            self.lighthouse = subprocess.Popen([sys.executable, "-c", code], env=self.env, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.lighthouse.stdout is not None
        ready, _, _ = select.select([self.lighthouse.stdout], [], [], 60)
        address = self.lighthouse.stdout.readline().strip() if ready else ""
        if not address:
            _wait_or_kill(self.lighthouse, 0)
            raise RuntimeError(f"torchft's lighthouse did not start: see {self.log_dir / 'lighthouse.err'}")
        self.extra = ["--lighthouse", address]
        super().start()

    def stop(self, force: bool) -> None:
        super().stop(force)
        if self.lighthouse.stdin:
            self.lighthouse.stdin.close()
        _wait_or_kill(self.lighthouse, 0 if force else 10)


class TorchrunJob(Job):
    """``torchrun --max-restarts`` over W DDP workers: a kill restarts the whole group.

    With torchrun's default (the agent's rendezvous TCPStore shared with the workers), a restarted
    gloo group reads the previous group's addresses from that store and fails to connect, again and
    again until a restart happens to win the race (torch 2.13 here; pytorch#135712). The workaround
    from that issue, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0 hosts a fresh store each time), is
    what a user would set, so the baseline sets it."""

    def start(self) -> None:
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        with open(self.log_dir / "torchrun.log", "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.args.workers}",
                 f"--max-restarts={MAX_RESTARTS}", *self.worker_args()],
                env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def victims(self) -> List[Tuple[str, int]]:
        workers = _torchrun_workers(self.proc.pid)
        attempt = max((a for _, _, a in workers), default=-1)
        current = [(f"rank {rank}", pid) for pid, rank, a in workers if a == attempt]
        trained = all(self.trained(f"{attempt}-{r}") for r in range(self.args.workers))
        if len(current) < self.args.workers or not trained:
            return []
        return current

    def finished(self) -> bool:
        return self.proc.poll() is not None or int(self.store.add("bench/done", 0)) >= self.args.workers

    def stop(self, force: bool) -> None:
        if _wait_or_kill(self.proc, 0 if force else 60, group=True) != 0 and not force:
            raise RuntimeError(f"torchrun exited with {self.proc.returncode}: see {self.log_dir / 'torchrun.log'}")


def _torchrun_workers(agent: int) -> List[Tuple[int, int, int]]:
    """(pid, rank, restart attempt) of the torchrun agent's worker children (from /proc: the children
    whose environment has RANK and TORCHELASTIC_RESTART_COUNT)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue  # exited meanwhile
        if "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
            found.append((int(d.name), int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"])))
    return found


def _wait_or_kill(proc: subprocess.Popen, timeout: float, group: bool = False) -> Optional[int]:
    """Wait for a process (bounded), then SIGKILL it (and its session: torchrun's workers)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        return proc.wait(timeout=10)


JOBS = {"decentpy": ReplacingJob, "torch-ddp-restarts": TorchrunJob, "torchft": TorchftJob}


def run(args: argparse.Namespace, framework: str, topology: str, faults: bool, seed: int) -> Dict[str, Any]:
    """One run of one framework, with or without the fault injector; its logs summarised."""
    import torch.distributed as dist

    log_dir = args.out / "faults" / f"{framework}-{topology}-{'faults' if faults else 'none'}"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.iterdir():
        f.unlink()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = JOBS[framework](args, framework, topology, log_dir, store)
    job.start()
    failed = True
    try:
        deadline = time.monotonic() + 120
        while not job.victims():  # every worker has trained a step
            if time.monotonic() > deadline or job.finished():
                raise TimeoutError(f"{framework}: the workers did not start training: see {log_dir}")
            time.sleep(0.05)
        t0 = time.time()
        deadline = time.monotonic() + args.run_timeout
        rng = random.Random(seed)
        kills: List[Dict[str, Any]] = []
        next_kill: Optional[float] = time.monotonic() + rng.uniform(0.2, 1.0) * args.kill_every
        while not job.finished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{framework}: not finished after {args.run_timeout} s: see {log_dir}")
            time.sleep(0.05)
            if not faults or job.done() or len(kills) == args.max_kills:
                continue
            if next_kill is None:  # after a kill: the next one is drawn once every worker trains again
                if job.victims():
                    next_kill = time.monotonic() + rng.uniform(0.2, 1.0) * args.kill_every
                continue
            victims = job.victims() if time.monotonic() >= next_kill else []
            if victims:
                name, pid = rng.choice(victims)
                os.kill(pid, signal.SIGKILL)
                kills.append({"member": name, "t": time.time() - t0})
                job.killed(name)
                next_kill = None
        failed = False
    finally:
        job.stop(force=failed)
    return summarise(log_dir, t0, kills)


def summarise(log_dir: Path, t0: float, kills: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Wall time, stalls, rejoin times, redone steps, checkpoint costs and the final model's metrics
    from the workers' logs (one file per worker process or DDP rank)."""
    gaps: List[float] = []
    finals, rejoin, curve, saves = [], [], [], []
    redone = set()
    end = t0
    restarts = 0
    detects: List[float] = []
    for f in sorted(log_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        done = [r for r in rows if "step" in r and not r.get("lost")]
        gaps += [b["t"] - a["t"] for a, b in zip(done, done[1:])]
        end = max([end] + [r["t"] for r in done])
        counts: Dict[int, int] = collections.Counter()
        for r in rows:
            if "step" in r:
                counts[r["step"]] += 1
                if counts[r["step"]] > 1:
                    redone.add((r["step"], counts[r["step"]]))  # the same redo seen by several ranks counts once
        finals += [r for r in rows if r.get("final")]
        rejoin += [r["since_start"] for r in rows if "since_start" in r]
        saves += [r["save_s"] for r in rows if "save_s" in r]
        restarts = max([restarts] + [r["attempt"] for r in rows if "attempt" in r])
        detects += [r["detect_s"] for r in rows if r.get("left") and r.get("detect_s") is not None]
        curve += [(r["t"] - t0, r["loss"]) for r in done]
    median = statistics.median(gaps) if gaps else float("nan")
    return {"wall_s": end - t0, "max_stall_steps": max(gaps) / median if gaps else 0.0, "median_step_s": median,
            "max_stall_s": max(gaps, default=0.0), "detect_s": max(detects, default=None),
            "rejoin_s": statistics.mean(rejoin) if rejoin else None, "kills": kills, "lost_steps": len(redone),
            "final_loss": statistics.mean(r["loss"] for r in finals) if finals else None,
            "final_accuracy": statistics.mean(r["accuracy"] for r in finals) if finals else None,
            "checkpoints": len(saves), "restarts": restarts, "save_s": statistics.mean(saves) if saves else None,
            "curve": sorted(curve)}


def checkpoint_interval(args: argparse.Namespace) -> Tuple[int, float, float]:
    """Young's optimal checkpoint interval sqrt(2 C MTBF), in steps: C measured by saving the DDP
    worker's checkpoint (same state, same function) here, the step time estimated as the local
    step's compute plus --step-sleep. Returns (K, C, step time)."""
    import torch
    import torch.nn.functional as F

    model, (xtr, ytr, _, _) = _setup()
    optimizer = _make_optimizer(model.named_parameters())
    shard = torch.arange(len(ytr))
    times = []
    for step in range(20):
        t = time.perf_counter()
        x, y = _batch(xtr, ytr, shard, 1000, step)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - t)
    step_s = args.step_sleep + statistics.median(times)
    with tempfile.TemporaryDirectory() as d:
        state = _checkpoint_state(model, optimizer, 1)
        cost = statistics.median(save_checkpoint(state, Path(d) / CHECKPOINT) for _ in range(7))
    return max(1, round(math.sqrt(2 * cost * args.kill_every) / step_s)), cost, step_s


def torchft_unavailable(path: str) -> Optional[str]:
    """Why torchft cannot run here (None: it imports, with its lighthouse)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), path) if p))
    try:
        probe = subprocess.run([sys.executable, "-c", "import torchft\nfrom torchft._torchft import LighthouseServer"],
                               env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "importing torchft took over 120 s"
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return (lines[-1] if lines else f"exit status {probe.returncode}") + (
        "" if path else " (install it: pip install --no-deps --target DIR torchft + its opentelemetry "
                        "packages, then --torchft-path DIR)")


def plot(results: Dict[str, Dict[str, Any]], path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        window = 25
        smooth = [statistics.mean(ys[max(0, i - window):i + 1]) for i in range(len(ys))]
        line, = ax.plot(xs, smooth, label=name, lw=1, ls="-" if r["kills"] else "--")
        for k in r["kills"]:
            ax.axvline(k["t"], color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("wall time (s)")
    ax.set_yscale("log")  # the late differences (and a healing replica's first loss) are small against the start
    ax.set_ylabel("training loss (moving mean)")
    ax.set_title("training under SIGKILLs, each framework with and without faults (dotted: its kills)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _fmt(value: Optional[float], digits: int) -> Any:
    return round(value, digits) if value is not None else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--kill-every", type=float, default=8.0, help="one kill at a random time per period (s)")
    parser.add_argument("--replace-after", type=float, default=2.0)
    parser.add_argument("--max-kills", type=int, default=-1, help="stop injecting after this many (default: no limit)")
    parser.add_argument("--topologies", default="alternating-exp-ring,one-peer-exp", help="decentpy's")
    parser.add_argument("--frameworks", default="",
                        help=f"comma-separated, of {','.join(FRAMEWORKS)} (default: those available)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="DDP: steps between checkpoints (default: Young's interval for --kill-every)")
    parser.add_argument("--torchft-path", default=os.environ.get("BENCH_TORCHFT_PATH", ""),
                        help="a directory holding torchft and its dependencies, prepended to PYTHONPATH")
    parser.add_argument("--torchft-as-shipped", action="store_true",
                        help="torchft's DDP comm hook unpatched (its survivors crash when a kill hits an allreduce)")
    parser.add_argument("--run-timeout", type=float, default=600, help="one run's limit (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--framework", default="decentpy", help=argparse.SUPPRESS)
    parser.add_argument("--member", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--topology", default="ring", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        WORKERS[args.framework](args)
        return 0

    asked = [f for f in args.frameworks.split(",") if f] or list(FRAMEWORKS)
    unknown = sorted(set(asked) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown framework(s) {unknown}: choose from {','.join(FRAMEWORKS)}")
    if "torchft" in asked:
        reason = torchft_unavailable(args.torchft_path)
        if reason is not None:
            print(f"torchft: skipped: {reason}", flush=True)
            asked.remove("torchft")
    if "torch-ddp-restarts" in asked:
        if args.checkpoint_every <= 0:
            args.checkpoint_every, cost, step_s = checkpoint_interval(args)
            print(f"torch-ddp-restarts: checkpoint every {args.checkpoint_every} steps (Young's interval "
                  f"sqrt(2 C MTBF): one save C = {cost * 1e3:.1f} ms, MTBF = {args.kill_every:g} s, "
                  f"step ~{step_s * 1e3:.0f} ms)", flush=True)
        else:
            print(f"torch-ddp-restarts: checkpoint every {args.checkpoint_every} steps (--checkpoint-every)",
                  flush=True)

    rows: List[Dict[str, Any]] = []
    results: Dict[str, Dict[str, Any]] = {}
    walls: List[Tuple[str, int, float]] = []
    floors: Dict[str, float] = {}  # decentpy's no-fault wall time per topology
    for framework in (f for f in FRAMEWORKS if f in asked):
        for topo in args.topologies.split(",") if framework == "decentpy" else ["allreduce"]:
            try:
                base = run(args, framework, topo, False, args.seed)
                hit = run(args, framework, topo, True, args.seed)
            except (RuntimeError, TimeoutError) as e:
                print(f"{framework}: failed: {e}", flush=True)
                continue
            name = CSV_NAME[framework]
            results[f"{name} {topo}, no faults"] = base
            results[f"{name} {topo}, {len(hit['kills'])} kills"] = hit
            for r in (base, hit):
                rows.append({"framework": name, "topology": topo, "workers": args.workers,
                             "kills": len(r["kills"]), "goodput_vs_no_faults": round(base["wall_s"] / r["wall_s"], 3),
                             "max_stall_steps": round(r["max_stall_steps"], 1), "rejoin_s": _fmt(r["rejoin_s"], 2),
                             "final_loss": _fmt(r["final_loss"], 4), "final_accuracy": _fmt(r["final_accuracy"], 2),
                             "lost_steps": r["lost_steps"]})
                walls.append((f"{name} {topo}", len(r["kills"]), r["wall_s"]))
                print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
                if r["checkpoints"]:
                    print(f"  {r['checkpoints']} checkpoints of {r['save_s'] * 1e3:.1f} ms ("
                          f"~{r['checkpoints'] * r['save_s'] / r['wall_s'] * 100:.1f} % of the wall time), "
                          f"{r['restarts']} group restarts", flush=True)
                if r["detect_s"] is not None:
                    beyond = (r["max_stall_s"] - r["detect_s"]) / r["median_step_s"]
                    print(f"  longest stall {r['max_stall_s']:.2f} s; the longest failed wait before a peer was "
                          f"found dead {r['detect_s']:.2f} s: {beyond:.1f} steps beyond it", flush=True)
            if framework == "decentpy":
                floors[topo] = base["wall_s"]

    if floors:
        print("wall time against decentpy's no-fault runs (goodput = that run's wall time / this one's):")
        for label, kills, wall in walls:
            vs = ", ".join(f"{t} {floor / wall:.3f}" for t, floor in floors.items())
            print(f"  {label}, {kills} kills: {wall:.1f} s; vs decentpy {vs}")
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / "bench_faults.csv"
    with open(csv, "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for row in rows:
            f.write(",".join(str(row[c]) for c in COLUMNS) + "\n")
    print(f"wrote {csv}")
    png = plot(results, args.out / "bench_faults.png")
    if png is not None:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

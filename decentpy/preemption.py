"""Consistent checkpoints on preemption (SIGTERM) and at intervals, opt-in.

Every rank saves its own :meth:`~decentpy.DecentralizedDataParallel.training_state_dict` plus the
RNG states (CPU and every CUDA device) and whatever the loop adds (data order, epoch), at the same
iteration on every rank; group rank 0 writes a manifest *last*, after every rank's file is on disk,
naming the step and each rank's file. A resume reads the manifest only, so it never mixes steps:
a checkpoint cut short by the kill has no manifest and the previous one stands.

A signal cannot run a collective, so the handler only sets a flag; the ranks agree on it at the
next interval boundary (one one-element all-reduce every ``every`` iterations, nothing between)
and then all save and stop. Schedulers send SIGTERM some seconds to minutes before SIGKILL (30 s
by default on Kubernetes and Slurm's ``--signal``): choose ``every`` so that this many iterations
fit in that grace period.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["PreemptionCheckpointer"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class PreemptionCheckpointer:
    """Saves ``ddp`` into ``directory`` every ``every`` iterations and when a signal arrives.

    Call :meth:`after_step` after each iteration with the number of iterations completed; it
    returns True when a signal arrived (the checkpoint is written: stop training). :meth:`resume`
    loads the last complete checkpoint, if any.
    """

    def __init__(self, ddp: Any, directory: str, every: int = 100,
                 signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        if every <= 0:
            raise ValueError(f"every must be a positive number of iterations, got {every}")
        self.ddp = ddp
        self.directory = directory
        self.every = int(every)
        self.group = ddp.process_group
        self.rank = dist.get_rank(self.group)
        self.signalled = False
        os.makedirs(directory, exist_ok=True)
        for s in signals:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True  # acted on at the next boundary (a handler cannot join a collective)
        logger.warning("rank %d: got signal %d; a checkpoint is written at the next multiple of %d iterations",
                       self.rank, signum, self.every)

    def after_step(self, step: int, extra: Optional[Dict[str, Any]] = None) -> bool:
        """After iteration ``step`` (iterations completed). On multiples of ``every``: agree whether
        any rank was signalled, save; True: stop (every rank returns the same)."""
        if step % self.every:
            return False
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=self.ddp.join_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.save(step, extra)
        return bool(flag.item())

    def _file(self, step: int) -> str:
        return f"rank{self.rank}-step{step}.pt"

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None) -> None:
        """Every rank writes its state for ``step``; then group rank 0 writes the manifest (a
        collective: every rank calls it at the same step)."""
        state = self.ddp.training_state_dict()
        state["rng"] = {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        state["extra"] = extra
        _atomic_save(state, os.path.join(self.directory, self._file(step)))
        dist.barrier(group=self.group)  # every rank's file is on disk
        if self.rank == 0:
            world = dist.get_world_size(self.group)
            manifest = {"step": step, "world_size": world,
                        "files": {str(r): f"rank{r}-step{step}.pt" for r in range(world)}}
            tmp = os.path.join(self.directory, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, MANIFEST))
        dist.barrier(group=self.group)  # the manifest names this step: older files can go
        for name in os.listdir(self.directory):
            if name.startswith(f"rank{self.rank}-step") and name != self._file(step):
                os.remove(os.path.join(self.directory, name))
        logger.info("rank %d: checkpoint of step %d written to %s", self.rank, step, self.directory)

    def resume(self) -> Optional[Dict[str, Any]]:
        """Load the last complete checkpoint (the manifest's step) into the wrapper and the RNGs;
        returns ``{"step": ..., "extra": ...}``, or None when there is none. A collective."""
        path = os.path.join(self.directory, MANIFEST)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            manifest = json.load(f)
        world = dist.get_world_size(self.group)
        if manifest["world_size"] != world:
            raise ValueError(f"the checkpoint in {self.directory} was written by {manifest['world_size']} ranks, "
                             f"this job has {world}")
        state = torch.load(os.path.join(self.directory, manifest["files"][str(self.rank)]), weights_only=False)
        self.ddp.load_training_state_dict(state)
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return {"step": manifest["step"], "extra": state["extra"]}


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

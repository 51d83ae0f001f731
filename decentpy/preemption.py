"""Consistent checkpoints on preemption (SIGTERM) and at intervals, opt-in.

Every rank saves its own :meth:`~decentpy.DecentralizedDataParallel.training_state_dict` plus the
RNG states (CPU and every CUDA device) and whatever the loop adds (data order, epoch), at the same
iteration on every rank; group rank 0 writes a manifest *last*, after every rank's file is on disk,
naming the step, the world size, the topology and each rank's file with its size and SHA-256. A
resume reads the manifest only, so it never mixes steps: a checkpoint cut short by the kill has no
manifest and the previous one stands.

A signal cannot run a collective, so the handler only sets a flag; the ranks agree on it at the
next interval boundary (one one-element all-reduce every ``every`` iterations, nothing between)
and then all save and stop. Schedulers send SIGTERM some seconds to minutes before SIGKILL (30 s
by default on Kubernetes and Slurm's ``--signal``): choose ``every`` so that this many iterations
fit in that grace period.

A checkpoint file is input like any other (a shared file system, a copy from elsewhere): it is
read as data only (``torch.load(weights_only=True)``: tensors, numbers, strings and containers; no
code in it runs), its SHA-256 must be the manifest's, and the state in it must be this rank's (its
rank, world size and topology). Every rank checks its own file and the ranks agree on the outcome in
one collective before training goes on: a rank whose file is damaged raises :class:`CheckpointError`
naming the file, the others a RuntimeError naming that rank and its file. docs/howto/checkpoints.md
describes the format and these guarantees.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import signal
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .arguments import check_int
from .comm import raise_if_any_rank_failed
from .comm.wire import all_gather_json

__all__ = ["PreemptionCheckpointer", "CheckpointError", "MANIFEST", "FORMAT"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: the manifest's format: 2 adds the per-file SHA-256 and size, the topology and the format itself
FORMAT = 2
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint this rank cannot resume from: a file missing, damaged (its SHA-256 is not the
    manifest's: a flipped byte, a truncated copy), not a plain-data state (e.g. a serialised Python
    object, never run), or another rank's or job's state. ``path``: the file; ``rank``: this rank (in the
    wrapper's group)."""

    def __init__(self, message: str, path: str, rank: int) -> None:
        super().__init__(message)
        self.path, self.rank = path, rank


class PreemptionCheckpointer:
    """Saves ``ddp`` into ``directory`` every ``every`` iterations and when a signal arrives.

    Call :meth:`after_step` after each iteration with the number of iterations completed; it
    returns True when a signal arrived (the checkpoint is written: stop training). :meth:`resume`
    loads the last complete checkpoint, if any. What the loop adds (``extra``) must be plain data
    (tensors, numbers, strings, lists, tuples, dicts), as everything a resume reads.
    """

    def __init__(self, ddp: Any, directory: str, every: int = 100,
                 signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        check_int("every", every, 1)
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

    def _topology(self) -> Optional[str]:
        topology = getattr(self.ddp, "topology", None)
        return getattr(topology, "name", None)

    def save(self, step: int, extra: Optional[Dict[str, Any]] = None) -> None:
        """Every rank writes its state for ``step``; then group rank 0 writes the manifest with every
        file's SHA-256 (a collective: every rank calls it at the same step)."""
        _check_plain("extra", extra)  # a resume reads plain data only: refuse what it could not read, now
        state = self.ddp.training_state_dict()
        state["rng"] = {"cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        state["extra"] = extra
        name = self._file(step)
        path = os.path.join(self.directory, name)
        _atomic_save(state, path)
        digest, size = _sha256(path)
        # every rank's file is on disk once this returns (it replaces a barrier)
        files = all_gather_json({"file": name, "sha256": digest, "bytes": size}, self.group,
                                "PreemptionCheckpointer.save: the files written")
        if self.rank == 0:
            world = dist.get_world_size(self.group)
            manifest = {"format": FORMAT, "step": step, "world_size": world, "topology": self._topology(),
                        "files": {str(r): f["file"] for r, f in enumerate(files)},
                        "sha256": {str(r): f["sha256"] for r, f in enumerate(files)},
                        "bytes": {str(r): f["bytes"] for r, f in enumerate(files)}}
            tmp = os.path.join(self.directory, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, MANIFEST))
        dist.barrier(group=self.group)  # the manifest names this step: older files can go
        for old in os.listdir(self.directory):
            if old.startswith(f"rank{self.rank}-step") and old != name:
                os.remove(os.path.join(self.directory, old))
        logger.info("rank %d: checkpoint of step %d written to %s", self.rank, step, self.directory)

    def resume(self) -> Optional[Dict[str, Any]]:
        """Load the last complete checkpoint (the manifest's step) into the wrapper and the RNGs;
        returns ``{"step": ..., "extra": ...}``, or None when there is none. A collective: each rank
        checks its own file (the manifest's SHA-256, a plain-data state, this rank's rank, world size
        and topology), and the ranks agree on the outcome before anything goes on (see the module)."""
        path = os.path.join(self.directory, MANIFEST)
        if not os.path.exists(path):
            return None
        box: Dict[str, Any] = {}

        def read() -> Dict[str, Any]:
            manifest = _read_manifest(path, self.rank)
            box["manifest"] = manifest
            state = self._read_state(manifest)
            return state

        what = "PreemptionCheckpointer.resume"
        resume = getattr(self.ddp, "_resume", None)
        if resume is not None:  # one collective: the file's checks and the wrapper's, then the load
            _, state = resume(read, True, what)
        else:  # a wrapper without it (elastic): the files' agreement, then its own load
            failure: Optional[BaseException] = None
            state = {}
            try:
                state = read()
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
                failure = exc
            raise_if_any_rank_failed(failure, what, self.group)
            self.ddp.load_training_state_dict(state)
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return {"step": box["manifest"]["step"], "extra": state["extra"]}

    def _read_state(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's state, checked: its file's size and SHA-256 against the manifest, decoded as
        plain data, saved by this rank at this world size and topology."""
        me = str(self.rank)
        world = dist.get_world_size(self.group)
        if manifest["world_size"] != world:
            raise ValueError(f"the checkpoint in {self.directory} was written by {manifest['world_size']} ranks, "
                             f"this job has {world}")
        files = manifest["files"]
        if me not in files:
            raise CheckpointError(f"rank {me}: the manifest in {self.directory} names no file for this rank",
                                  self.directory, self.rank)
        path = os.path.join(self.directory, _plain_name(files[me], self.directory, self.rank))
        expected = manifest.get("sha256")
        if expected is None:
            logger.warning("rank %s: the manifest in %s has no checksums (format 1); %s is read unverified",
                           me, self.directory, path)
        else:
            digest, size = _sha256(path, self.rank)
            if digest != expected.get(me):
                other = next((r for r, d in expected.items() if d == digest and r != me), None)
                if other is not None:
                    raise CheckpointError(
                        f"rank {me}: checkpoint file {path} holds rank {other}'s checkpoint (its SHA-256 is the one "
                        f"the manifest gives for rank {other}'s file {files.get(other)!r}); this is rank {me}: the "
                        "files were swapped or renamed, and each rank resumes from its own", path, self.rank)
                want = manifest.get("bytes", {}).get(me)
                sizes = f"{size} bytes" + ("" if want is None else f", the manifest says {want}") + \
                    ("; truncated" if want is not None and size < want else "")
                raise CheckpointError(
                    f"rank {me}: checkpoint file {path} is damaged: its SHA-256 {digest[:16]}... is not the manifest's "
                    f"{str(expected.get(me))[:16]}... ({sizes})", path, self.rank)
        state = _load_plain(path, self.rank)
        saved_rank = state.get("rank")
        if saved_rank is not None and saved_rank != self.rank:
            raise CheckpointError(f"rank {me}: checkpoint file {path} holds the state of rank {saved_rank}; this is "
                                  f"rank {me}: the files were swapped or renamed, and each rank resumes from its own",
                                  path, self.rank)
        if state.get("world_size", world) != world:
            raise CheckpointError(f"rank {me}: checkpoint file {path} was saved at world size {state['world_size']}, "
                                  f"this job has {world}", path, self.rank)
        topology = manifest.get("topology")
        if topology is not None and state.get("topology", topology) != topology:
            raise CheckpointError(f"rank {me}: checkpoint file {path} was saved with topology {state['topology']!r}, "
                                  f"the manifest names {topology!r}", path, self.rank)
        _check_rng(state, path, self.rank)
        return state


def _read_manifest(path: str, rank: int) -> Dict[str, Any]:
    """The manifest, checked for shape (a damaged one is named, not a KeyError later)."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"rank {rank}: the checkpoint manifest {path} cannot be read: {exc}", path,
                              rank) from None
    ok = (isinstance(manifest, dict) and isinstance(manifest.get("step"), int)
          and isinstance(manifest.get("world_size"), int) and isinstance(manifest.get("files"), dict)
          and all(isinstance(v, str) for v in manifest["files"].values())
          and isinstance(manifest.get("sha256", {}), dict))
    if not ok:
        raise CheckpointError(f"rank {rank}: the checkpoint manifest {path} is not a decentpy manifest (needs step, "
                              "world_size and files)", path, rank)
    return manifest


def _plain_name(name: str, directory: str, rank: int) -> str:
    """A file name of the manifest: a name in the checkpoint directory, never a path elsewhere."""
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise CheckpointError(f"rank {rank}: the manifest in {directory} names {name!r}, not a file of its directory",
                              directory, rank)
    return name


def _sha256(path: str, rank: int = -1) -> Tuple[str, int]:
    """The file's SHA-256 (hex) and size, read in chunks."""
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                h.update(chunk)
                size += len(chunk)
    except OSError as exc:
        raise CheckpointError(f"rank {rank}: checkpoint file {path} cannot be read: {exc}", path, rank) from None
    return h.hexdigest(), size


def _load_plain(path: str, rank: int) -> Dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and containers only; no
    code in the file runs. Anything else is a :class:`CheckpointError` naming the file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for damaged or unsafe files
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()[0][:300] if str(exc) else ""
        raise CheckpointError(f"rank {rank}: checkpoint file {path} is not a plain-data training state "
                              f"({type(exc).__name__}: {first}); decentpy reads checkpoints with weights_only=True "
                              "and never runs code from them", path, rank) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"rank {rank}: checkpoint file {path} holds a {type(state).__name__}, not a training "
                              "state", path, rank)
    return state


def _check_rng(state: Dict[str, Any], path: str, rank: int) -> None:
    rng = state.get("rng")
    ok = (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor) and rng["cpu"].dtype == torch.uint8
          and isinstance(rng.get("cuda"), (list, tuple))
          and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng["cuda"]) and "extra" in state)
    if not ok:
        raise CheckpointError(f"rank {rank}: checkpoint file {path} has no RNG states (rng.cpu, rng.cuda: byte "
                              "tensors) or no extra: it was not written by PreemptionCheckpointer", path, rank)


def _check_plain(name: str, value: Any) -> None:
    """TypeError unless ``value`` reads back with ``weights_only=True`` (what a resume reads)."""
    if value is None:
        return
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the allow-list's refusal, named
        raise TypeError(f"{name} must be plain data (tensors, numbers, strings, lists, tuples, dicts), which a resume "
                        f"reads without running code; it holds something else: {str(exc).splitlines()[0][:200]}") \
            from None


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

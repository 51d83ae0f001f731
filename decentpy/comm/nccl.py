"""Exchanges over decentpy's own NCCL communicator (``decentpy._C.NcclCommunicator``).

The :class:`decentpy.comm.Communicator` primitives, as :class:`decentpy.comm.TorchCommunicator`
has them: ``send_recv`` is a grouped ``ncclSend``/``ncclRecv`` on one world communicator;
``all_reduce`` is in place on a sub-communicator made once, at construction, with ``ncclCommSplit``
(collective: every rank splits for every group, in the same order). Each returns an exchange
whose ``wait(timeout)`` must run before the buffers are read or written.

The world communicator comes from an ``ncclUniqueId`` that rank 0 puts in the default process
group's c10d store. Every operation runs on the communicator's own stream, after the work already
queued on torch's current stream; ``wait`` makes the current stream wait for it (an event: no host
synchronisation on the hot path). Waits are still bounded: a C++ watchdog aborts the communicator
(``ncclCommAbort``) when an operation outlives its deadline or NCCL reports an asynchronous error,
which releases the GPU streams, and every later ``wait``/``launch`` raises
:class:`~decentpy.comm.PeerTimeoutError` naming the peer(s) and the bucket. With
``DECENTPY_NCCL_BLOCKING_WAIT=1`` (or ``blocking_wait=True``) ``wait`` blocks the host instead,
raising as soon as the timeout passes.

:func:`decentpy.comm.select_communicator` implements ``comm='auto' | 'torch' | 'nccl'``.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)
from .plans import communication_needs
from ..topology import Topology
from .groups import CommGroup
from .waits import PeerTimeoutError

__all__ = ["NcclCommunicator", "NcclExchange", "nccl_compiled", "nccl_available", "nccl_unavailable_reason",
           "nccl_library_candidates", "DeviceLike"]

logger = logging.getLogger(__name__)

_UID_PREFIX = "decentpy/nccl_unique_id"
# Communicators built so far per group (global ranks): the members of a group build the same ones in the
# same order, so they agree on the store key without talking.
_uid_sequence: Dict[Tuple[int, ...], "itertools.count[int]"] = {}

DeviceLike = Union[None, int, str, torch.device]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def nccl_compiled() -> bool:
    """Whether this build of ``decentpy._C`` contains the NCCL communicator (build time)."""
    return bool(getattr(_C, "nccl_available", lambda: False)())


def nccl_library_candidates() -> List[str]:
    """Paths of libnccl.so.2 to try (after the copy torch already loaded, before the loader's
    search path): ``DECENTPY_NCCL_LIBRARY``, ``NCCL_HOME``/``NCCL_ROOT``, then the
    nvidia-nccl-cu13/-cu12 wheel next to torch or on ``sys.path``. The paths the environment names
    are kept even when no file is there, so that the loader's error names them and why; of the
    wheel's places only those that exist."""
    named: List[str] = []
    explicit = os.environ.get("DECENTPY_NCCL_LIBRARY", "").strip()
    if explicit:
        named.append(explicit)
    for var in ("NCCL_HOME", "NCCL_ROOT"):
        home = os.environ.get(var, "").strip()
        if home:
            paths = [os.path.join(home, sub, "libnccl.so.2") for sub in ("lib", "lib64")]
            named += [p for p in paths if os.path.isfile(p)] or paths[:1]
    bases = [os.path.dirname(os.path.dirname(torch.__file__))] + [p for p in sys.path if p]
    wheel = [os.path.join(b, "nvidia", "nccl", "lib", "libnccl.so.2") for b in bases]
    seen, result = set(), []
    for p in named + [w for w in wheel if os.path.isfile(w)]:
        if p not in seen:
            seen.add(p)
            result.append(p)
    return result


def _device_of(device: DeviceLike) -> Optional[torch.device]:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def nccl_unavailable_reason(device: DeviceLike = None) -> Optional[str]:
    """Why decentpy's NCCL communicator cannot be used here (``None`` when it can).

    Checks the build (CUDA + nccl.h), torch's CUDA, the device (when given) and that libnccl
    loads (``decentpy._C.nccl_load_library``)."""
    if not nccl_compiled():
        info = getattr(_C, "nccl_info", None)
        reason = info()["reason"] if info is not None else ""
        return reason or "decentpy._C was built without the NCCL communicator"
    if not torch.cuda.is_available():
        return ("torch.cuda.is_available() is False (a CPU build of torch, or no GPU/driver), so "
                "there is no GPU for NCCL")
    dev = _device_of(device)
    if dev is not None and dev.type != "cuda":
        return f"the tensors to exchange are on {dev}, not on a CUDA device"
    try:
        _C.nccl_load_library(nccl_library_candidates())
    except RuntimeError as exc:
        return str(exc)
    return None


def nccl_available(device: DeviceLike = None) -> bool:
    """Whether decentpy's NCCL communicator can be used (see :func:`nccl_unavailable_reason`)."""
    return nccl_unavailable_reason(device) is None


def _timeout_ms(timeout: Union[datetime.timedelta, float, int]) -> int:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0, got {timeout!r}")
    return max(1, int(round(seconds * 1000.0)))


def _share_unique_id(key: str, rank: int) -> bytes:
    """Group rank 0's ncclUniqueId through the default process group's c10d store."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, _C.nccl_get_unique_id())
    try:
        uid = store.get(key)
    except Exception as exc:  # the store raises on its own timeout (rank 0 died or never came)
        raise PeerTimeoutError(
            f"rank {rank}: no NCCL unique id from rank 0 under store key {key!r} ({exc}); "
            "rank 0 may have died or not created the communicator") from exc
    return bytes(uid)


class NcclExchange:
    """An in-flight NCCL exchange of one bucket: wait on it before reading or writing its buffers."""

    __slots__ = ("_work", "_tensors", "bucket", "ranks", "rank", "blocking")

    def __init__(self, work, bucket: int, ranks: Tuple[int, ...], rank: int, tensors: Tuple[Tensor, ...],
                 blocking: bool) -> None:
        self._work = work
        self._tensors = tensors  # kept until the wait (record_stream covers a dropped exchange)
        self.bucket = bucket
        self.ranks = ranks
        self.rank = rank
        self.blocking = blocking

    def wait(self, timeout: datetime.timedelta) -> None:
        """Order torch's current stream after the exchange (or, when blocking, wait on the host).

        The exchange's deadline becomes at most ``timeout`` from now; past it the watchdog aborts
        the communicator. Raises :class:`PeerTimeoutError` if the communicator failed."""
        if self._work is None:
            return
        ms = _timeout_ms(timeout)
        try:
            if self.blocking:
                self._work.synchronize(ms)
            else:
                self._work.wait(ms)
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc
        self._work = None
        self._tensors = ()

    def is_completed(self) -> bool:
        if self._work is None:
            return True
        try:
            return bool(self._work.is_completed())
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc


class NcclCommunicator:
    """Exchanges over decentpy's NCCL communicator (one GPU per rank)."""

    def __init__(self, topology: Topology, timeout: datetime.timedelta, device: DeviceLike = None,
                 blocking_wait: Optional[bool] = None, group: Optional[CommGroup] = None) -> None:
        dev = _device_of(device)
        why = nccl_unavailable_reason(dev)
        if why is not None:
            raise RuntimeError(f"decentpy's NCCL communicator is not available: {why}")
        if dev is None or dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.group = group if group is not None else CommGroup()
        self.rank = self.group.rank  # ranks here are the group's (the topology's numbering)
        self.world_size = self.group.size
        self.timeout = timeout
        self.timeout_ms = _timeout_ms(timeout)
        self.blocking_wait = _env_flag("DECENTPY_NCCL_BLOCKING_WAIT") if blocking_wait is None else bool(blocking_wait)
        blocking_comm = _env_flag("DECENTPY_NCCL_BLOCKING_COMM")  # unbounded init/connect: debugging only
        self.selection_reason = "constructed directly"

        members = self.group.global_ranks
        seq = next(_uid_sequence.setdefault(members, itertools.count()))
        key = f"{_UID_PREFIX}/{seq}/ranks{'-'.join(map(str, members))}"
        uid = _share_unique_id(key, self.rank)
        try:
            self._world = _C.NcclCommunicator(uid, self.rank, self.world_size, dev.index, self.timeout_ms,
                                              blocking=blocking_comm, name="decentpy world")
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc
        self._world.set_global_ranks(list(members))
        self._streams = {id(self._world): torch.cuda.ExternalStream(self._world.stream, device=dev)}

        # ncclCommSplit is collective over the world communicator: every rank, every group, same order.
        self._subcomms: Dict[Tuple[int, ...], object] = {}
        try:
            for ranks in communication_needs(topology)[1]:
                member = self.rank in ranks
                sub = self._world.split(0 if member else -1, self.rank,
                                        name=f"decentpy group {list(ranks)}")
                if member:
                    if sub is None:  # pragma: no cover - NCCL contract
                        raise RuntimeError(f"internal error: ncclCommSplit gave no communicator for group {ranks}")
                    sub.set_global_ranks(self.group.describe(ranks))
                    self._streams[id(sub)] = torch.cuda.ExternalStream(sub.stream, device=dev)
                    self._subcomms[ranks] = sub
                else:
                    self._subcomms[ranks] = None
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc
        logger.debug("rank %d: NCCL world communicator on %s, %d sub-communicators", self.rank, dev,
                     sum(1 for s in self._subcomms.values() if s is not None))

    # -- the Communicator primitives -----------------------------------------------------------
    def send_recv(self, bucket: int, peer: int, send: Tensor, recv: Tensor) -> NcclExchange:
        """``send`` goes to ``peer``; the peer's counterpart lands in ``recv``."""
        return self._start(bucket, tuple(sorted((self.rank, peer))), self._world,
                           lambda c, label: c.exchange(send, recv, peer, label), (send, recv))

    def all_reduce(self, bucket: int, ranks: Tuple[int, ...], buffer: Tensor) -> NcclExchange:
        """``buffer`` summed in place over ``ranks`` (on that group's split communicator)."""
        comm = self._subcomms.get(ranks)
        if comm is None:
            raise RuntimeError(
                f"rank {self.rank}: no NCCL sub-communicator for group {ranks} (bucket {bucket}); the "
                "topology must list every group at construction and contain this rank")
        return self._start(bucket, ranks, comm, lambda c, label: c.all_reduce(buffer, label), (buffer,))

    def _start(self, bucket: int, ranks: Tuple[int, ...], comm, op, tensors: Tuple[Tensor, ...]) -> NcclExchange:
        try:
            work = op(comm, f"bucket {bucket}")
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc
        # The caching allocator must not hand these blocks out again before the NCCL stream is done
        # with them, should the exchange be dropped without a wait.
        stream = self._streams[id(comm)]
        for t in tensors:
            t.record_stream(stream)
        return NcclExchange(work, bucket, ranks, self.rank, tensors, self.blocking_wait)

    # -- extras ----------------------------------------------------------------------------------
    @property
    def world(self):
        """The ``decentpy._C.NcclCommunicator`` over all ranks."""
        return self._world

    def subcommunicator(self, ranks: Sequence[int]):
        """The split communicator of a group of more than two ranks (None for a non-member)."""
        return self._subcomms.get(tuple(sorted(int(r) for r in ranks)))

    def check(self) -> None:
        """Raise :class:`PeerTimeoutError` if a communicator failed (timeout, asynchronous error)."""
        try:
            for sub in self._subcomms.values():
                if sub is not None:
                    sub.check()
            self._world.check()
        except _C.NcclCommError as exc:
            raise PeerTimeoutError(str(exc)) from exc

    def abort(self, reason: str = "aborted by the user") -> None:
        for sub in self._subcomms.values():
            if sub is not None:
                sub.abort(reason)
        self._world.abort(reason)

    def close(self) -> None:
        """Finalize and destroy the communicators (bounded by the timeout; abort otherwise)."""
        for sub in self._subcomms.values():
            if sub is not None:
                sub.close()
        self._world.close()

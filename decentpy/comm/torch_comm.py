"""The exchange primitives over ``torch.distributed`` (the :class:`~decentpy.comm.Communicator`
interface): a point-to-point exchange on one shared process group, and an in-place all-reduce on a
sub-group created once, collectively, at construction. Which exchange a step uses is decided by
:mod:`decentpy.comm.plans`. Every wait is bounded, and a timeout names the bucket and the peers.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)
from .plans import communication_needs
from ..topology import Topology
from .failures import DEFAULT_LIVENESS_TIMEOUT, PeerWatch
from .groups import CommGroup, SubGroup

__all__ = ["Exchange", "HostStaging", "TorchCommunicator"]

logger = logging.getLogger(__name__)


class Exchange:
    """An in-flight exchange of one bucket: wait on it before reading or writing its buffers."""

    def __init__(self, works: List[dist.Work], bucket: int, ranks: Tuple[int, ...], rank: int,
                 watch: PeerWatch, finish: Optional[Callable[[], None]] = None) -> None:
        self._works = works
        self.bucket = bucket
        self.ranks = ranks
        self.rank = rank
        self.watch = watch
        self._finish = finish  # runs once the works completed (a host-staged receive's copy to the GPU)
        self.step: Optional[int] = None  # the iteration that launched it (set by the strategy, for messages)

    def wait(self, timeout: datetime.timedelta) -> None:
        """Bounded by the communicator's timeout (``timeout`` is the same one); a dead peer ends it
        within the liveness timeout; any failure is a classified PeerTimeoutError."""
        peers = [r for r in self.ranks if r != self.rank]
        at = f" launched at step {self.step}" if self.step is not None else ""
        for work in self._works:
            self.watch.wait(work, f"rank {self.rank}: exchange of bucket {self.bucket}{at} with peer(s) {peers}",
                            peers, self.bucket, self.step)
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class HostStaging:
    """Pinned host copies of CUDA buffers for gloo's point-to-point messages.

    gloo's send and recv hand the tensor's data pointer to its TCP transport, which reads and
    writes it from a host thread: a CUDA tensor there is a device pointer (a crash, or garbage).
    Its collectives stage CUDA tensors themselves; send/recv do not. So a CUDA buffer travels
    through a pinned host copy: the send side copies device to host before the launch (a host
    synchronisation the transport needs: gloo reads the bytes as soon as the send is posted), the
    receive side copies host to device, ordered on the current stream, once the receive completed.
    NCCL never comes here. One pinned copy per device buffer, reused every step.
    """

    def __init__(self) -> None:
        self._host: Dict[Tuple[int, int, torch.dtype], Tensor] = {}
        self._pending: Dict[int, Any] = {}  # host buffer's data pointer -> event of its last copy to the GPU

    def host_of(self, t: Tensor) -> Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        host = self._host.get(key)
        if host is None:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host[key] = host
        ev = self._pending.pop(host.data_ptr(), None)
        if ev is not None:  # the previous step's copy out of this buffer must be done before it is refilled
            ev.synchronize()
        return host

    def to_host(self, t: Tensor) -> Tensor:
        host = self.host_of(t)
        host.copy_(t)  # synchronous: gloo reads the host bytes from its own thread as soon as the send is posted
        return host

    def to_device(self, host: Tensor, t: Tensor) -> None:
        t.copy_(host, non_blocking=True)  # ordered on the current stream, before the mix reads it
        ev = torch.cuda.Event()
        ev.record()
        self._pending[host.data_ptr()] = ev

    def clear(self) -> None:
        self._host.clear()
        self._pending.clear()


class TorchCommunicator:
    """Exchange primitives over ``torch.distributed`` (gloo on CPU, NCCL, MPI).

    Ranks given to :meth:`send_recv` and :meth:`all_reduce` are ranks of ``group`` (the world by
    default), as the topology numbers them.
    """

    def __init__(self, topology: Topology, timeout: datetime.timedelta, group: Optional[CommGroup] = None,
                 liveness: Optional[datetime.timedelta] = DEFAULT_LIVENESS_TIMEOUT,
                 needs: Optional[Tuple[bool, List[Tuple[int, ...]]]] = None) -> None:
        """``needs``: what to set up, ``(point to point, collective groups)``; default: what the
        topology's exchange plans use (:func:`decentpy.comm.plans.communication_needs`). A strategy
        that exchanges otherwise (compressed gossip: point to point within every group) says so."""
        self.group = group if group is not None else CommGroup()
        self.rank = self.group.rank
        self.world_size = self.group.size
        self.timeout = timeout
        self.watch = PeerWatch(self.group.global_ranks, timeout, liveness)
        self._subgroups: Dict[Tuple[int, ...], Optional[SubGroup]] = {}
        #: payload bytes this rank has sent (point to point) or contributed (all-reduce) so far
        self.bytes_sent = 0
        self._count_lock = threading.Lock()
        # Sub-group creation is collective over the group: every rank creates every group, in the
        # same (schedule) order. decentpy's traffic never uses the group itself, so it cannot
        # interleave with the user's collectives (torch DDP beside it, Join's all-reduces).
        p2p, collective = needs if needs is not None else communication_needs(topology)
        pg_timeout = max(timeout, datetime.timedelta(seconds=1))
        self._p2p_group: Optional[SubGroup] = None
        # gloo: a second group, so that the two directions of a pair exchange travel on two TCP
        # connections. On one connection gloo's send and receive of the same pair often run one
        # after the other (measured on a throttled link: half the link's duplex bandwidth, the
        # cross-node ring exchange 1.3 s instead of 0.7 s); on two they overlap.
        self._p2p_reverse: Optional[SubGroup] = None
        self._gloo = self.group.backend == dist.Backend.GLOO
        self._staging = HostStaging()  # gloo with CUDA buffers
        if p2p:
            self._p2p_group = self.group.new_subgroup(list(range(self.world_size)), pg_timeout)
            if self._gloo:
                self._p2p_reverse = self.group.new_subgroup(list(range(self.world_size)), pg_timeout)
        for ranks in collective:
            self._subgroups[ranks] = self.group.new_subgroup(ranks, pg_timeout)
        logger.debug("rank %d: %d sub-groups", self.rank, len(self._subgroups))

    def close(self) -> None:
        """Destroy the sub-groups this communicator created (the default group stays)."""
        groups = [g for g in self._subgroups.values() if g is not None]
        groups += [g for g in (self._p2p_group, self._p2p_reverse) if g is not None]
        self._subgroups, self._p2p_group, self._p2p_reverse = {}, None, None
        self._staging.clear()
        for g in groups:
            g.destroy()

    def send_recv(self, bucket: int, peer: int, send: Tensor, recv: Tensor) -> Exchange:
        """``send`` goes to ``peer``; the peer's counterpart lands in ``recv``. An empty ``send`` or
        ``recv`` is not sent / not awaited (the peer passes the matching empty tensor: a compressed
        group exchange's chunk may hold no element). Safe to call from a second thread (the
        compressed group exchange's helper)."""
        assert self._p2p_group is not None, "internal error: the topology has no pair exchange"
        to = self.group.to_global(peer)
        me = dist.get_rank()
        with self._count_lock:
            self.bytes_sent += send.numel() * send.element_size()
        finish: Optional[Callable[[], None]] = None
        if self._gloo and (send.is_cuda or recv.is_cuda):
            host_send = self._staging.to_host(send) if send.numel() else send.cpu()
            host_recv = self._staging.host_of(recv) if recv.numel() else recv.cpu()
            if recv.numel():
                finish = functools.partial(self._staging.to_device, host_recv, recv)
            send, recv = host_send, host_recv
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            works = self.watch.guard_launch(lambda: self._launch_pair(send, recv, me, to, bucket),
                                            f"rank {me}: starting the exchange of bucket {bucket} with peer {to}",
                                            [to], bucket)
        return Exchange(works, bucket, tuple(sorted((me, to))), me, self.watch, finish)

    def _launch_pair(self, send: Tensor, recv: Tensor, me: int, to: int, bucket: int) -> List[Any]:
        assert self._p2p_group is not None
        if self._p2p_reverse is None:
            if send.numel() and recv.numel():
                return self._p2p_group.send_recv(send, recv, to, bucket)
            out = back = self._p2p_group
        else:
            # the lower rank sends on the first group, the higher on the second: each direction has its own
            # connection (gloo serialises the two directions of one), so the exchange runs full duplex
            out, back = (self._p2p_group, self._p2p_reverse) if me < to else (self._p2p_reverse, self._p2p_group)
        return (([back.recv(recv, to, bucket)] if recv.numel() else []) +
                ([out.send(send, to, bucket)] if send.numel() else []))

    def all_reduce(self, bucket: int, ranks: Tuple[int, ...], buffer: Tensor) -> Exchange:
        """``buffer`` summed in place over ``ranks``."""
        sub = self._subgroups[ranks]
        self.bytes_sent += buffer.numel() * buffer.element_size()
        assert sub is not None, f"internal error: rank {self.rank} is not in group {ranks}"
        me = dist.get_rank()
        peers = [r for r in sub.global_ranks if r != me]
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            work = self.watch.guard_launch(lambda: sub.all_reduce(buffer),
                                           f"rank {me}: starting the all-reduce of bucket {bucket} with peer(s) {peers}",
                                           peers, bucket)
        return Exchange([work], bucket, tuple(sub.global_ranks), me, self.watch)


@contextlib.contextmanager
def _untraced_work(label: str) -> Iterator[None]:
    """Launch collectives whose ``Work`` carries no profiler RecordFunction.

    A c10d ``Work`` created while the torch profiler is active starts an asynchronous
    RecordFunction and ends it when the work finishes or is waited on. decentpy waits on an exchange
    one iteration later, possibly after the profiler stopped and freed its event storage; ending
    the RecordFunction then writes into freed memory (a crash at exit: ``free(): invalid next
    size`` or SIGSEGV). So the works are created with RecordFunction disabled on this thread
    (thread-local, restored at once), and the launch itself is recorded synchronously as
    ``label`` so profiles still show it.
    """
    traced = torch.autograd._profiler_enabled()
    with torch.autograd.profiler.record_function(label) if traced else contextlib.nullcontext():
        before = _C.record_function_enabled()
        _C.set_record_function_enabled(False)
        try:
            yield
        finally:
            _C.set_record_function_enabled(before)

"""The exchange primitives over ``torch.distributed`` (the :class:`decentpy.exchange.Communicator`
interface): a point-to-point exchange on one shared process group, and an in-place all-reduce on a
sub-group created once, collectively, at construction. Which exchange a step uses is decided by
:mod:`decentpy.exchange`. Every wait is bounded, and a timeout names the bucket and the peers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from .exchange import communication_needs
from .topology import Topology

logger = logging.getLogger(__name__)


class PeerTimeoutError(RuntimeError):
    """A peer did not complete an exchange within the timeout (it may have died)."""


class Exchange:
    """An in-flight exchange of one bucket: wait on it before reading or writing its buffers."""

    def __init__(self, works: List[dist.Work], bucket: int, ranks: Tuple[int, ...], rank: int) -> None:
        self._works = works
        self.bucket = bucket
        self.ranks = ranks
        self.rank = rank

    def wait(self, timeout: datetime.timedelta) -> None:
        peers = [r for r in self.ranks if r != self.rank]
        for work in self._works:
            wait_bounded(work, timeout, f"rank {self.rank}: exchange of bucket {self.bucket} with peer(s) {peers}")
        self._works = []


def wait_bounded(work: dist.Work, timeout: datetime.timedelta, what: str) -> None:
    """Wait for ``work`` at most ``timeout``; a :class:`PeerTimeoutError` that starts with ``what``
    otherwise (gloo raises on a timeout or a closed connection, other backends return False)."""
    try:
        ok = work.wait(timeout)
    except RuntimeError as exc:
        raise PeerTimeoutError(f"{what} failed or did not complete within {timeout.total_seconds():g} s ({exc}); "
                               "a peer may have died") from exc
    if ok is False:
        raise PeerTimeoutError(f"{what} did not complete within {timeout.total_seconds():g} s; a peer may have died")


class TorchCommunicator:
    """Exchange primitives over ``torch.distributed`` (gloo on CPU, NCCL, MPI)."""

    def __init__(self, topology: Topology, timeout: datetime.timedelta) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self._subgroups: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
        # new_group is collective over the default group: every rank creates every group, in the
        # same (schedule) order. decentpy's traffic never uses the default group itself, so it
        # cannot interleave with the user's collectives (torch DDP beside it, Join's all-reduces).
        p2p, collective = communication_needs(topology)
        self._p2p_group: Optional[dist.ProcessGroup] = None
        if p2p:
            self._p2p_group = dist.new_group(list(range(self.world_size)))
        for ranks in collective:
            self._subgroups[ranks] = dist.new_group(list(ranks))
        logger.debug("rank %d: %d sub-groups", self.rank, len(self._subgroups))

    def close(self) -> None:
        """Destroy the sub-groups this communicator created (the default group stays)."""
        groups = [g for g in self._subgroups.values() if g is not None]
        if self._p2p_group is not None:
            groups.append(self._p2p_group)
        self._subgroups, self._p2p_group = {}, None
        for g in groups:
            dist.destroy_process_group(g)

    def send_recv(self, bucket: int, peer: int, send: Tensor, recv: Tensor) -> Exchange:
        """``send`` goes to ``peer``; the peer's counterpart lands in ``recv``."""
        pg = self._p2p_group
        ops = [dist.P2POp(dist.isend, send, peer, group=pg, tag=bucket),
               dist.P2POp(dist.irecv, recv, peer, group=pg, tag=bucket)]
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            works = list(dist.batch_isend_irecv(ops))
        return Exchange(works, bucket, tuple(sorted((self.rank, peer))), self.rank)

    def all_reduce(self, bucket: int, ranks: Tuple[int, ...], buffer: Tensor) -> Exchange:
        """``buffer`` summed in place over ``ranks``."""
        with _untraced_work(f"decentpy.exchange[bucket {bucket}]"):
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._subgroups[ranks], async_op=True)
        return Exchange([work], bucket, ranks, self.rank)


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


def group_ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    """Global ranks of ``group`` (the world when None), in group-rank order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def first_difference_across_ranks(mine: Sequence[Any],
                                  group: Optional[dist.ProcessGroup] = None) -> Optional[Tuple[int, int, Any, Any]]:
    """Compare every rank's ``mine`` with the first rank's (a collective over ``group``, default:
    the world).

    Returns the first ``(rank in group, position, first rank's item, that rank's item)`` that
    differs (an item is ``None`` past the end of a shorter list), or ``None``; the same answer on
    every rank, so all of them can raise the same error.
    """
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(mine), group=group)
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other == ref:
            continue
        for k in range(max(len(ref), len(other))):
            a = ref[k] if k < len(ref) else None
            b = other[k] if k < len(other) else None
            if a != b:
                return r, k, a, b
    return None


def raise_if_any_rank_failed(failure: Optional[BaseException], what: str,
                             group: Optional[dist.ProcessGroup] = None) -> None:
    """A collective over ``group`` (default: the world): if ``failure`` is set on any rank, raise on
    every rank (the failing rank its own exception, the others a RuntimeError naming that rank (in
    the group) and its message), so that no rank goes on to a collective its peers never join."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    everyone: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if failure is not None:
        raise failure
    bad = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if bad:
        r, m = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {m}")


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (torch's default when it cannot be read)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == dist.Backend.NCCL else "cpu")
        t = pg._get_backend(device).options._timeout
        if isinstance(t, datetime.timedelta):
            return t
    except Exception:  # pragma: no cover - depends on torch internals
        logger.debug("could not read the process group timeout; using torch's default")
    return dist.default_pg_timeout

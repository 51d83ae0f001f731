"""The interface exchanges are built from: a :class:`Communicator` (torch.distributed or
decentpy's NCCL communicator) and the :class:`Work` its calls return."""

from __future__ import annotations

from typing import Any, Protocol, Tuple

from torch import Tensor

__all__ = ["Communicator", "Work"]


class Work(Protocol):
    """An exchange in flight: ``wait`` before the buffers are read or written again."""

    def wait(self, timeout: Any) -> None: ...


class Communicator(Protocol):
    """The primitives exchanges are built from (``decentpy.comm.TorchCommunicator``,
    ``decentpy.comm.NcclCommunicator``). Every rank calls them in the same order."""

    rank: int

    def send_recv(self, bucket: int, peer: int, send: Tensor, recv: Tensor) -> Work:
        """Send ``send`` to ``peer`` and receive its counterpart into ``recv``."""
        ...

    def all_reduce(self, bucket: int, ranks: Tuple[int, ...], buffer: Tensor) -> Work:
        """Sum ``buffer`` in place over ``ranks`` (a group listed by :func:`collective_groups`)."""
        ...

    def close(self) -> None: ...

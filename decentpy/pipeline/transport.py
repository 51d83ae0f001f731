"""Messages between neighbouring pipeline stages over plain ``torch.distributed`` point-to-point.

Every rank computes the same schedule, so each receive knows its source (the stage before or
after) and the order of its messages: no tags, no receive-from-any-source (which NCCL lacks).
A message is a header -- an int64 tensor: its kind, micro-batch, the step's micro-batch count,
and per tensor whether it is present, its dtype, whether it requires grad and its shape -- then
the tensors themselves, each sent as its raw bytes (any dtype, any shape; shapes may change from
batch to batch). Headers have a fixed size (:data:`HEADER_SLOTS`); a longer one (many tensors or
dimensions) continues in a second message. Sends are asynchronous (the buffers stay alive until
the step ends); every receive is bounded by the pipe's timeout.

Kinds: ``DATA`` (a micro-batch's activations, downstream), ``GRAD`` (the gradients of a stage's
inputs, upstream), ``NOGRAD`` (no gradient will come for that micro-batch: its backward did not
reach the stage's inputs) and ``ERROR`` (the sender failed; the payload is the message text, the
micro-batch field the failing stage): a rank that receives ``ERROR`` stops expecting messages.
After a failed step, each stage reads what its neighbours sent and it did not read
(:meth:`Link.drain`, from the counts the stages exchange), so the next step starts in step.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import wait_bounded

__all__ = ["Kind", "Message", "Link", "HEADER_SLOTS"]

HEADER_SLOTS = 32
_FIXED = 5  # kind, micro-batch, count, tensors, total header length

# dtype codes: positions in this tuple (the same on every rank: part of the wire format)
DTYPES: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODE = {d: i for i, d in enumerate(DTYPES)}


class Kind(enum.IntEnum):
    DATA = 1
    GRAD = 2
    NOGRAD = 3
    ERROR = 4


@dataclass
class Message:
    kind: Kind
    mb: int
    count: int
    tensors: List[Optional[Tensor]]
    requires_grad: List[bool]

    @property
    def text(self) -> str:
        """An ERROR message's text."""
        t = self.tensors[0] if self.tensors else None
        return "" if t is None else bytes(t.cpu().tolist()).decode("utf-8", errors="replace")


def encode(kind: Kind, mb: int, count: int, tensors: Sequence[Optional[Tensor]],
           requires_grad: Sequence[bool]) -> List[int]:
    body: List[int] = []
    for t, rg in zip(tensors, requires_grad):
        if t is None:
            body += [0]
            continue
        if t.dtype not in _CODE:
            raise TypeError(f"a tensor of dtype {t.dtype} cannot cross a pipeline stage boundary; supported: "
                            f"{', '.join(str(d) for d in DTYPES)}")
        body += [1, _CODE[t.dtype], int(rg), t.dim(), *t.shape]
    head = [int(kind), int(mb), int(count), len(tensors), _FIXED + len(body)]
    return head + body


def decode(values: List[int]) -> Tuple[Kind, int, int, List[Optional[Tuple[torch.dtype, bool, List[int]]]]]:
    kind, mb, count, n = Kind(values[0]), values[1], values[2], values[3]
    specs: List[Optional[Tuple[torch.dtype, bool, List[int]]]] = []
    i = _FIXED
    for _ in range(n):
        if values[i] == 0:
            specs.append(None)
            i += 1
            continue
        dtype, rg, ndim = DTYPES[values[i + 1]], bool(values[i + 2]), values[i + 3]
        specs.append((dtype, rg, values[i + 4:i + 4 + ndim]))
        i += 4 + ndim
    return kind, mb, count, specs


def _bytes(t: Tensor) -> Tensor:
    """``t``'s elements as a flat uint8 tensor (a view when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Link:
    """This stage's connection to one neighbour (``peer``: its global rank; ``peer_stage``: its
    stage), on ``group``. Tensors travel on ``device`` (the CPU for gloo, the current GPU for
    NCCL) and headers on ``meta_device`` (the same; NCCL's headers are read back to the host: their
    shapes size the receive buffers)."""

    peer: int
    peer_stage: int
    stage: int
    group: Any
    device: torch.device
    meta_device: torch.device
    timeout: datetime.timedelta
    _inflight: List[Tuple[Any, Tensor]] = field(default_factory=list)
    sent: int = 0      # messages sent to the peer this step (every kind)
    received: int = 0  # messages received from it this step

    # -- sending -----------------------------------------------------------------------------
    def _isend(self, t: Tensor) -> None:
        work = dist.isend(t, dst=self.peer, group=self.group)
        self._inflight.append((work, t))  # the buffer must outlive the send

    def send(self, kind: Kind, mb: int, count: int, tensors: Sequence[Optional[Tensor]],
             requires_grad: Optional[Sequence[bool]] = None) -> None:
        rg = list(requires_grad) if requires_grad is not None else [False] * len(tensors)
        values = encode(kind, mb, count, tensors, rg)
        head = values + [0] * max(0, HEADER_SLOTS - len(values))
        self._isend(torch.tensor(head[:HEADER_SLOTS], dtype=torch.int64, device=self.meta_device))
        if len(values) > HEADER_SLOTS:
            self._isend(torch.tensor(values[HEADER_SLOTS:], dtype=torch.int64, device=self.meta_device))
        for t in tensors:
            if t is not None and t.numel() > 0:
                self._isend(_bytes(t.to(self.device)))
        self.sent += 1

    def send_error(self, origin_stage: int, text: str) -> None:
        """Tell the neighbour this step failed (on ``origin_stage``); it stops waiting for us."""
        payload = torch.tensor(list(text.encode("utf-8")[:4000]), dtype=torch.uint8, device=self.device)
        self.send(Kind.ERROR, origin_stage, 0, [payload])

    # -- receiving ---------------------------------------------------------------------------
    def _recv_into(self, t: Tensor, what: str) -> None:
        work = dist.irecv(t, src=self.peer, group=self.group)
        wait_bounded(work, self.timeout, f"stage {self.stage}: receiving {what} from stage {self.peer_stage}")

    def recv(self, what: str) -> Message:
        """The next message from the neighbour (``what``: what it should be, for a timeout's
        message). Tensors arrive on this stage's device."""
        head = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.meta_device)
        self._recv_into(head, what)
        values = head.tolist()
        if values[4] > HEADER_SLOTS:
            rest = torch.empty(values[4] - HEADER_SLOTS, dtype=torch.int64, device=self.meta_device)
            self._recv_into(rest, what)
            values += rest.tolist()
        kind, mb, count, specs = decode(values)
        tensors: List[Optional[Tensor]] = []
        rgs: List[bool] = []
        for spec in specs:
            if spec is None:
                tensors.append(None)
                rgs.append(False)
                continue
            dtype, rg, shape = spec
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel() > 0:
                self._recv_into(_bytes_view(t), what)
            tensors.append(t)
            rgs.append(rg)
        self.received += 1
        return Message(kind, mb, count, tensors, rgs)

    # -- end of a step -------------------------------------------------------------------------
    def drain(self, peer_sent: int) -> int:
        """After a failed step: receive (and drop) what the peer sent that this stage did not read
        (``peer_sent``: the peer's count), so that the next step starts in step. Returns how many."""
        left = peer_sent - self.received
        for _ in range(left):
            self.recv("an unread message of the failed step")
        return max(left, 0)

    def finish(self) -> None:
        """The end of a step: every send has been (or, after :meth:`drain`, is being) received;
        wait for them and release their buffers."""
        for work, _ in self._inflight:
            wait_bounded(work, self.timeout, f"stage {self.stage}: a send to stage {self.peer_stage}")
        self._inflight = []
        self.sent = self.received = 0


def _bytes_view(t: Tensor) -> Tensor:
    """A fresh contiguous ``t`` as a writable flat uint8 view (the receive buffer)."""
    return t.reshape(-1).view(torch.uint8)

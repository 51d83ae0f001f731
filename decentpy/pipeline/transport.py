"""Messages between neighbouring pipeline stages over plain ``torch.distributed`` point-to-point.

Every rank computes the same schedule, so each receive knows its source (the stage before or
after) and the order of its messages: no receive-from-any-source (which NCCL lacks). A message is
a header -- int64 values: its kind, micro-batch, the step's micro-batch count, flags (whether the
tensors form a tuple), and per tensor whether it is present, its dtype, whether it requires grad
and its shape -- and the tensors' raw bytes (any dtype, any shape; shapes may change from batch to
batch). The format is the extension's (``csrc/pipeline/message.h``: encoding, decoding, packing
into one buffer and the views of a received one are one C++ call each -- in Python they cost tens
of microseconds per message on the pipeline's critical path). Sends are asynchronous (the buffers
stay alive until the step ends); every receive is bounded by the pipe's timeout. Two wire formats,
chosen by the backend:

* **one buffer** (gloo): header and tensors travel as one message, ``[header | tensor 0 | ...]``
  (each part 16-byte aligned; the received tensors are views of the buffer). Gloo accepts a
  message shorter than the receive buffer, so the receiver posts a buffer of the link's
  *capacity*: the largest message sent on it so far, which both sides know without talking. A
  message larger than that is announced by a header-only ``GROW`` message first. Since a receive
  needs no size, the pipe **posts it ahead** (:meth:`Link.prepost`) as soon as it knows that the
  message will come in this step, before computing the current micro-batch: gloo moves a message
  only once its receive is posted, and until then the receiving process's gloo thread spins on
  the waiting message (measured: about 1 ms of CPU per message left 5 ms without a receive, taken
  from the stages' compute when the processes outnumber the cores). So after a step's first
  message on a link, several receives may be posted at once (a GPipe stage posts every forward's
  at once); they all have the capacity that the first message settled, and a later message larger
  than that (a micro-batch whose output grew) travels ``SPLIT``: a header-only message with its
  size, then parts of at most the capacity, joined on arrival. Before the first message at most
  one receive is posted, so that ``GROW`` can enlarge it. Send buffers are pooled by size and
  reused from step to step.
* **header, then tensors** (NCCL, whose send and receive sizes must match): a fixed-size header
  (:data:`HEADER_SLOTS`, a continuation when longer), read back to the host to size the receive
  buffers, then one message per tensor. Nothing is posted ahead: NCCL runs a pair's sends and
  receives on one stream in order, so a receive posted early would hold back this stage's own
  sends to that neighbour (and the neighbour waits for them).

Kinds: ``DATA`` (a micro-batch's activations, downstream), ``GRAD`` (the gradients of a stage's
inputs, upstream), ``NOGRAD`` (no gradient will come for that micro-batch: its backward did not
reach the stage's inputs), ``ERROR`` (the sender failed; the payload is the message text, the
micro-batch field the failing stage): a rank that receives ``ERROR`` stops expecting messages;
``FILL`` (nothing: it completes a receive the peer posted ahead for a message that the failed
step never sent). After a failed step, each stage reads what its neighbours sent and it did not
read, and fills the receives they posted ahead (:meth:`Link.settle`, from the counts the stages
exchange), so the next step starts in step.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)
from ..comm import SubGroup, wait_bounded

__all__ = ["Kind", "Message", "Link", "HEADER_SLOTS", "PIPE_TAG"]

HEADER_SLOTS: int = _C.PIPE_HEADER_SLOTS  # the fixed header (NCCL wire: its first message)
PIPE_TAG = 0x5D1E  # the tag of every pipeline message (a user's own point-to-point traffic keeps tag 0)

#: the dtypes a message carries (a dtype's wire code is its position)
DTYPES: Tuple[torch.dtype, ...] = tuple(_C.pipe_dtypes())


class Kind(enum.IntEnum):
    DATA = 1
    GRAD = 2
    NOGRAD = 3
    ERROR = 4
    GROW = 5  # one-buffer wire only: the next message is larger than the link's capacity (mb field: its size)
    FILL = 6  # after a failed step: completes a receive the peer posted ahead
    SPLIT = 7  # one-buffer wire only: the next message (mb field: its size) comes in parts of the capacity


@dataclass
class Message:
    kind: Kind
    mb: int
    count: int
    tensors: List[Optional[Tensor]]
    requires_grad: List[bool]
    is_tuple: bool = False

    @property
    def text(self) -> str:
        """An ERROR message's text."""
        t = self.tensors[0] if self.tensors else None
        return "" if t is None else bytes(t.cpu().tolist()).decode("utf-8", errors="replace")


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # private torch API; without it nothing is reused


def _storage_users(t: Tensor) -> int:
    return int(_USE_COUNT(t.untyped_storage()._cdata)) if _USE_COUNT is not None else -1


#: the use count of a buffer that no other tensor views (the buffer itself plus the storage object
#: the count is read through), measured rather than assumed
_ALONE = _storage_users(torch.empty(1)) if _USE_COUNT is not None else -2


def _unviewed(buf: Tensor) -> bool:
    """Whether no tensor but ``buf`` itself uses ``buf``'s memory: a received message's tensors are
    views of its buffer, kept by autograd, a stage's outputs, or the user."""
    return _storage_users(buf) == _ALONE


def _bytes(t: Tensor) -> Tensor:
    """``t``'s elements as a flat uint8 tensor (a view when contiguous and not a lazy conjugate or
    negation, whose values are materialised first)."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Link:
    """This stage's connection to one neighbour (``peer``: its global rank; ``peer_stage``: its
    stage), on ``group``. Tensors travel on ``device`` (the CPU for gloo, the current GPU for
    NCCL); ``one_buffer`` picks the wire format (see the module's docstring).

    ``send_group`` / ``recv_group``: two-member groups over this stage and the peer that carry the
    messages of one direction each (None: ``group`` carries both). On gloo each direction then has
    its own TCP connection: gloo guards a connection with one lock, which its receiving thread
    holds while it reads a message, so a message arriving while this stage sends the other way on
    the same connection made the send wait for that thread (with more threads than cores, for a
    core); on two connections a receive can be posted ahead in every phase of a schedule."""

    peer: int
    peer_stage: int
    stage: int
    group: Any
    device: torch.device
    one_buffer: bool
    timeout: datetime.timedelta
    send_group: Optional[SubGroup] = None
    recv_group: Optional[SubGroup] = None
    _inflight: List[Tuple[Any, Tensor]] = field(default_factory=list)
    sent: int = 0      # messages sent to the peer this step (every kind but GROW)
    received: int = 0  # messages received from it this step (every kind but GROW)
    # one-buffer wire: the largest message each direction has carried (the same on both sides)
    send_capacity: int = 8 * HEADER_SLOTS
    recv_capacity: int = 8 * HEADER_SLOTS
    _posted: List[Tuple[Any, Tensor]] = field(default_factory=list)  # receives posted ahead, in order (one-buffer wire)
    _pool: Dict[int, List[Tensor]] = field(default_factory=dict)  # free send buffers by size
    _lent: List[Tensor] = field(default_factory=list)  # send buffers of this step (back to the pool at finish)
    _received: List[Tensor] = field(default_factory=list)  # receive buffers, reused once nothing views them
    #: called before every blocking wait on the peer (the pipe posts its end-of-step agreement there:
    #: work that can go while this stage would wait anyway, rather than before its first message)
    before_wait: Optional[Callable[[], None]] = None

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of the receive buffers this side holds (posted, viewed by received tensors, or free
        for the next messages): the link's memory beside the tensors it delivered."""
        return sum(b.numel() * b.element_size() for b in self._received)

    @property
    def consumed(self) -> int:
        """Messages this side's receives take this step: those received and those posted ahead."""
        return self.received + len(self._posted)

    # -- sending -----------------------------------------------------------------------------
    def _isend(self, t: Tensor) -> None:
        if self.send_group is not None:
            work = self.send_group.send(t, self.peer, PIPE_TAG)
        else:
            work = dist.isend(t, dst=self.peer, group=self.group, tag=PIPE_TAG)
        self._inflight.append((work, t))  # the buffer must outlive the send

    def _irecv(self, t: Tensor) -> Any:
        if self.recv_group is not None:
            return self.recv_group.recv(t, self.peer, PIPE_TAG)
        return dist.irecv(t, src=self.peer, group=self.group, tag=PIPE_TAG)

    @staticmethod
    def _control(kind: Kind, size: int) -> Tensor:
        """A header-only ``GROW``/``SPLIT`` message announcing a message of ``size`` bytes."""
        return _C.pipe_header(int(kind), size, 0, [], [], False).view(torch.uint8)

    def send(self, kind: Kind, mb: int, count: int, tensors: Sequence[Optional[Tensor]],
             requires_grad: Optional[Sequence[bool]] = None, is_tuple: bool = False) -> None:
        tensors = list(tensors)
        rg = list(requires_grad) if requires_grad is not None else [False] * len(tensors)
        if self.one_buffer:
            self._send_one_buffer(int(kind), mb, count, tensors, rg, is_tuple)
        else:
            head = _C.pipe_header(int(kind), mb, count, tensors, rg, is_tuple).to(self.device)
            self._isend(head[:HEADER_SLOTS])
            if head.numel() > HEADER_SLOTS:
                self._isend(head[HEADER_SLOTS:])
            for t in tensors:
                if t is not None and t.numel() > 0:
                    self._isend(_bytes(t.to(self.device)))
        self.sent += 1

    def _buffer(self, size: int) -> Tensor:
        """A send buffer of ``size`` bytes: a free one of that size from earlier steps, or a new one."""
        free = self._pool.get(size)
        buf = free.pop() if free else torch.empty(size, dtype=torch.uint8, device=self.device)
        self._lent.append(buf)
        return buf

    def _send_one_buffer(self, kind: int, mb: int, count: int, tensors: List[Optional[Tensor]], rg: List[bool],
                         is_tuple: bool) -> None:
        total = _C.pipe_message_bytes(tensors)  # refuses an unsupported dtype before anything is sent
        larger = total > self.send_capacity
        split = larger and self.sent > 0  # the peer's receives may be posted at the capacity: parts of it
        if larger and not split:  # the step's first message: one receive is posted, enlarge it
            self._isend(self._control(Kind.GROW, total))
            self.send_capacity = total
        buf = self._buffer(total)
        _C.pipe_pack(buf, kind, mb, count, tensors, rg, is_tuple)  # one copy, also of a non-contiguous tensor
        if not split:
            self._isend(buf)
            return
        self._isend(self._control(Kind.SPLIT, total))
        for start in range(0, total, self.send_capacity):
            self._isend(buf[start:start + self.send_capacity])

    def send_error(self, origin_stage: int, text: str) -> None:
        """Tell the neighbour this step failed (on ``origin_stage``); it stops waiting for us."""
        payload = torch.tensor(list(text.encode("utf-8")[:4000]), dtype=torch.uint8, device=self.device)
        self.send(Kind.ERROR, origin_stage, 0, [payload])

    # -- receiving ---------------------------------------------------------------------------
    def prepost(self, ahead: int = 1) -> None:
        """Have the receives of the next ``ahead`` messages posted now (one-buffer wire; a no-op on
        the NCCL wire). Only for messages that will come in this step (or, if the step fails, that
        :meth:`settle` fills). Before the step's first message only one (see the module's docstring)."""
        if not self.one_buffer:
            return
        if self.received == 0:
            ahead = min(ahead, 1)
        while len(self._posted) < ahead:
            self._post()

    def _post(self) -> None:
        buf = self._recv_buffer()
        self._posted.append((self._irecv(buf), buf))

    def _recv_buffer(self) -> Tensor:
        """A receive buffer of the link's capacity: one of earlier messages that no tensor views any
        more, or a new one. A fresh buffer of a few hundred KiB costs page faults on its first
        write that took longer than the copy itself (measured: 0.6 ms against 0.07 ms for 512 KiB),
        on every message of every step; torch's pre-shaped stages reuse their buffers the same way."""
        posted = {b.data_ptr() for _, b in self._posted}  # waiting for a message: not free, though unviewed
        for k, buf in enumerate(self._received):
            if buf.numel() == self.recv_capacity and buf.data_ptr() not in posted and _unviewed(buf):
                del self._received[k]
                break
        else:
            buf = torch.empty(self.recv_capacity, dtype=torch.uint8, device=self.device)
        self._received.append(buf)
        # the buffers of a smaller capacity never fit again; the rest stay for the next messages
        self._received = [b for b in self._received if b.numel() == self.recv_capacity]
        return buf

    def _recv_into(self, t: Tensor, what: str) -> None:
        self._wait(self._irecv(t), what)

    def _wait(self, work: Any, what: str) -> None:
        if self.before_wait is not None:
            self.before_wait()
        wait_bounded(work, self.timeout, f"stage {self.stage}: receiving {what} from stage {self.peer_stage}",
                     [self.peer])

    def recv(self, what: str) -> Message:
        """The next message from the neighbour (``what``: what it should be, for a timeout's
        message). Tensors arrive on this stage's device."""
        msg = self._recv_one_buffer(what) if self.one_buffer else self._recv_parts(what)
        self.received += 1
        return msg

    def _next_buffer(self, what: str) -> Tensor:
        """The next message's buffer, from the first receive posted (posting one if none is)."""
        if not self._posted:
            self._post()
        work, buf = self._posted.pop(0)
        self._wait(work, what)
        return buf

    def _join(self, total: int, what: str) -> Tensor:
        """A ``SPLIT`` message of ``total`` bytes: its parts (each of the capacity, the last one
        shorter) copied into one buffer."""
        whole = torch.empty(total, dtype=torch.uint8, device=self.device)
        for start in range(0, total, self.recv_capacity):
            n = min(self.recv_capacity, total - start)
            whole[start:start + n].copy_(self._next_buffer(what)[:n])
        return whole

    def _recv_one_buffer(self, what: str) -> Message:
        while True:
            buf = self._next_buffer(what)
            kind, mb, count, is_tuple, tensors, rg = _C.pipe_unpack(buf)
            if kind == Kind.SPLIT:
                kind, mb, count, is_tuple, tensors, rg = _C.pipe_unpack(self._join(mb, what))
            if kind != Kind.GROW:
                return Message(Kind(kind), mb, count, tensors, rg, is_tuple)
            self.recv_capacity = mb

    def _recv_parts(self, what: str) -> Message:
        head = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self._recv_into(head, what)
        values = head.tolist()  # a host read on NCCL: the shapes size the receive buffers
        length = _C.pipe_header_length(values)
        if length > HEADER_SLOTS:
            rest = torch.empty(length - HEADER_SLOTS, dtype=torch.int64, device=self.device)
            self._recv_into(rest, what)
            values += rest.tolist()
        kind, mb, count, is_tuple, specs = _C.pipe_decode(values)
        tensors: List[Optional[Tensor]] = []
        for spec in specs:
            if spec is None:
                tensors.append(None)
                continue
            t = torch.empty(spec[2], dtype=spec[0], device=self.device)
            if t.numel() > 0:
                self._recv_into(t.reshape(-1).view(torch.uint8), what)
            tensors.append(t)
        return Message(Kind(kind), mb, count, tensors, [s is not None and s[1] for s in specs], is_tuple)

    # -- end of a step -------------------------------------------------------------------------
    def fill(self, peer_consumed: int) -> int:
        """After a failed step, first half of :meth:`settle`: send a ``FILL`` for every receive the
        peer posted (``peer_consumed``: its count) that this side never sent a message for."""
        missing = max(peer_consumed - self.sent, 0)
        for _ in range(missing):
            self.send(Kind.FILL, 0, 0, [])
        return missing

    def settle(self, peer_sent: int) -> int:
        """After a failed step, second half: receive (and drop) what the peer sent (``peer_sent``:
        its count, fills included) that this side did not read, the receive posted ahead first, so
        that the next step starts in step. Returns how many."""
        left = max(peer_sent - self.received, len(self._posted))
        for _ in range(left):
            self.recv("an unread message of the failed step")
        return left

    def finish(self) -> None:
        """The end of a step: every send has been (or, after :meth:`settle`, is being) received;
        wait for them and give their buffers back to the pool."""
        if self._posted:
            raise RuntimeError(f"stage {self.stage}: a receive from stage {self.peer_stage} was posted ahead for a "
                               "message that never came (an AsyncPipe bug)")
        for work, _ in self._inflight:
            wait_bounded(work, self.timeout, f"stage {self.stage}: a send to stage {self.peer_stage}", [self.peer])
        self._inflight = []
        # the pool keeps this step's buffers only (shapes that stopped coming free their memory)
        self._pool = {}
        for buf in self._lent:
            self._pool.setdefault(buf.numel(), []).append(buf)
        self._lent = []
        self.sent = self.received = 0

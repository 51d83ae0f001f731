"""The end of every pipeline step: all ranks of the pipe's group agree whether (and where) a stage
failed, and learn every rank's message counts when one did (so the stages can read what the failed
step left unread).

Each rank contributes a row ``[code, counts...]`` (``code``: the failing stage, or a sentinel
when it did not fail); the agreement is the smallest code, and after a failure the table of all
rows. Two ways, by the wire:

* **gloo: a star through group rank 0, its receives posted early in the step**
  (:meth:`Agreement.arm`: before the rank's first blocking wait on a neighbour, where posting costs
  nothing on the pipeline's critical path -- posted at the start of the step, the first stage's
  receives delayed its first micro-batch by 0.25 ms per step at 4 stages; at the latest when its
  step ends). Every other rank sends its row to rank 0 when its step ends and waits for
  the table; rank 0, which in training finishes last (the backward ends on the first stage), finds
  the other rows already there and answers each rank with one message. So a step's end costs one
  message latency after the last stage finishes; an all-reduce of one integer costs several
  sequential hops (gloo's ring), each a scheduling delay when the processes outnumber the cores.
  Rows travel with their own tag, apart from the pipeline's messages.
* **NCCL: an all-reduce of the code** on the GPU and one host read of it (the agreement needs
  its value); the counts only after a failure (an all-gather). A point-to-point star on NCCL would
  open a communicator per pair of ranks.

Every wait is bounded by the pipe's timeout (a :class:`~decentpy.PeerTimeoutError` when a rank
died or never ended its step).
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import or_world, wait_bounded

__all__ = ["Agreement", "NO_FAILURE", "AGREE_TAG"]

NO_FAILURE = 2 ** 62
AGREE_TAG = 0x5D1F  # apart from the pipeline's messages (transport.PIPE_TAG)


class Agreement:
    """One pipe's end-of-step agreement over ``ranks`` (global ranks in group order; this rank is
    ``me`` in the group), rows of ``width`` int64 (the code first)."""

    def __init__(self, group: Any, ranks: Sequence[int], me: int, device: torch.device, star: bool, width: int,
                 timeout: datetime.timedelta) -> None:
        self.group, self.ranks, self.me, self.device = group, list(ranks), me, device
        self.star, self.width, self.timeout = star, width, timeout
        # the star's messages go straight to the process group (group ranks): ``dist.isend``'s
        # argument checks cost ~30 us a call, on the step's last hop
        self._pg = or_world(group)
        self._table = torch.empty(0)  # this step's table (rank 0: the rows arrive in it)
        self._armed = False
        self._recvs: List[Tuple[Any, Tensor]] = []      # posted receives (rank 0: rows; others: the table)
        self._sends: List[Tuple[Any, Tensor]] = []      # the last step's sends, waited at the next step

    def _what(self, peer: int) -> str:
        return f"AsyncPipe group rank {self.me}: the end-of-step agreement with group rank {peer}"

    def arm(self) -> None:
        """Post this rank's receives of the step's agreement (gloo star), once per step: before the
        rank's first blocking wait of the step, or when the step ends."""
        if not self.star or self._armed:
            return
        for work, _ in self._sends:  # received long ago: the last step's table or rows went through
            wait_bounded(work, self.timeout, self._what(0))
        self._sends = []
        self._table = torch.empty(len(self.ranks), self.width, dtype=torch.int64)
        if self.me == 0:  # each row straight into its place in the table
            for r in range(1, len(self.ranks)):
                self._recvs.append((self._pg.recv([self._table[r]], r, AGREE_TAG), self._table[r]))
        elif len(self.ranks) > 1:
            self._recvs.append((self._pg.recv([self._table], 0, AGREE_TAG), self._table))
        self._armed = True

    def agree(self, code: int, counts: Sequence[int]) -> Tuple[int, Optional[List[List[int]]]]:
        """The smallest code over the group, and (after a failure, or always on gloo) every rank's
        row ``[code, *counts]`` by group rank."""
        if not self.star:
            return self._all_reduce(code, counts)
        self.arm()  # a step that ended before it started (an error on entry)
        self._armed = False
        mine = torch.tensor([code, *counts], dtype=torch.int64)
        recvs, self._recvs = self._recvs, []
        table = self._table
        if len(self.ranks) == 1:
            table = mine.unsqueeze(0)
        elif self.me == 0:
            table[0] = mine
            for r, (work, _) in enumerate(recvs, start=1):
                wait_bounded(work, self.timeout, self._what(r))
            for r in range(1, len(self.ranks)):
                self._sends.append((self._pg.send([table], r, AGREE_TAG), table))
        else:
            send = self._pg.send([mine], 0, AGREE_TAG)
            work, _ = recvs[0]
            wait_bounded(work, self.timeout, self._what(0))
            wait_bounded(send, self.timeout, self._what(0))  # rank 0 answered: it has our row
        rows = table.tolist()
        return min(r[0] for r in rows), rows

    def _all_reduce(self, code: int, counts: Sequence[int]) -> Tuple[int, Optional[List[List[int]]]]:
        status = torch.tensor([code], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        wait_bounded(work, self.timeout, f"AsyncPipe group rank {self.me}: the end-of-step agreement")
        origin = int(status.item())  # a host read: the agreement needs its value
        if origin == NO_FAILURE:
            return origin, None
        mine = torch.tensor([code, *counts], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(rows, mine, group=self.group)
        return origin, [r.tolist() for r in rows]

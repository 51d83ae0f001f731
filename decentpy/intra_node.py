"""What happens inside a node with ``intra_node='shard'`` or ``'allreduce'``.

The world (or the wrapper's process group) is ``G`` nodes of ``L`` ranks (node ``g`` = group ranks
``g*L .. g*L + L - 1``). Links inside a node are fast, so the node averages its gradients exactly
and acts as one gossip worker; the topology runs over the ``G`` nodes
(:func:`decentpy.topology.node_topology`). Per bucket, inside backward:

* ``'shard'``: the bucket's gradients are reduce-scattered over the node (local rank ``l`` gets
  shard ``l`` of the node's mean gradient), rank ``l`` mixes shard ``l`` with the ranks holding
  shard ``l`` on the peer nodes (:func:`decentpy.topology.shard_topology`) and steps it with
  optimizer state for that shard only, then the node all-gathers the updated shards (waited for
  before the parameters are next used: the next forward). Optimizer state and inter-node bytes
  per rank are ``1/L`` of plain gossip's, and the ``L`` ranks of a node all use their links at once.
* ``'allreduce'``: the gradients are all-reduced over the node (its mean), every rank steps the
  whole bucket with replicated state and gossips it with the same local rank of the peer nodes.

This module owns that rule: the node group, the shard of a bucket, the gradient reduction, the
all-gather, and the count of a node's ranks that still have data (``Join``: the node's mean is
over those, and a node steps while any of its ranks does).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed
from torch import Tensor

from .comm import CommGroup, SubGroup, wait_bounded

logger = logging.getLogger(__name__)

INTRA_NODE_CHOICES = ("gossip", "shard", "allreduce")


def check_intra_node(mode: str) -> None:
    """ValueError naming ``mode`` and the valid choices, unless it is one of :data:`INTRA_NODE_CHOICES`."""
    if mode not in INTRA_NODE_CHOICES:
        raise ValueError(f"intra_node must be one of {', '.join(map(repr, INTRA_NODE_CHOICES))}, got {mode!r}")


class IntraNode:
    """The node of this rank for ``intra_node='shard' | 'allreduce'`` (``L`` ranks, ``L`` >= 1)."""

    def __init__(self, mode: str, rank: int, size: int, local: int, timeout: datetime.timedelta) -> None:
        """Local only; :meth:`connect` creates the node groups. ``rank``/``size``: in the wrapper's group."""
        check_intra_node(mode)
        assert mode != "gossip", "intra_node='gossip' needs no IntraNode"
        if local < 1 or size % local:
            raise ValueError(f"intra_node={mode!r} needs local_world_size to divide the number of ranks; got "
                             f"local_world_size={local} for {size} ranks (divisors: "
                             f"{', '.join(str(d) for d in range(1, size + 1) if size % d == 0)})")
        self.mode = mode
        self.local = int(local)
        self.nodes = size // self.local
        self.node = rank // self.local
        self.local_rank = rank % self.local
        self.timeout = timeout
        self.group: Optional[SubGroup] = None
        self._all: List[SubGroup] = []
        self._stream_ordered = False  # CUDA: waits order the current stream, the host never blocks
        self._count_work: Optional[Any] = None
        self._count: Optional[Tensor] = None

    def connect(self, group: CommGroup, device: torch.device) -> None:
        """Create the node groups: every rank creates every node's group, in node order (a collective
        over ``group``). ``device``: where the buckets live."""
        self._stream_ordered = device.type == "cuda"
        if self.local == 1:
            return
        for g in range(self.nodes):
            sub = group.new_subgroup(list(range(g * self.local, (g + 1) * self.local)), self.timeout)
            if sub is not None:
                self._all.append(sub)
            if g == self.node:
                self.group = sub

    def close(self) -> None:
        for sub in self._all:
            sub.destroy()
        self._all, self.group = [], None

    @property
    def shards(self) -> bool:
        return self.mode == "shard"

    @property
    def pad_multiple(self) -> int:
        """A bucket's element count is padded to a multiple of this (equal shards)."""
        return self.local if self.shards else 1

    def shard_range(self, numel: int) -> Tuple[int, int]:
        """This rank's ``[lo, hi)`` of a bucket of ``numel`` elements (padded by ``pad_multiple``)."""
        if not self.shards:
            return 0, numel
        size = numel // self.local
        return self.local_rank * size, (self.local_rank + 1) * size

    # -- per iteration ---------------------------------------------------------------------------
    def begin_count(self, active: bool, device: torch.device) -> None:
        """Start counting the node's ranks that have data this iteration (only inside ``Join``: outside
        it every rank has data, and the count would be ``L``)."""
        t = torch.tensor([1.0 if active else 0.0], device=device)
        self._count = t
        self._count_work = self.group.all_reduce(t) if self.group is not None else None

    def count(self) -> Optional[Tensor]:
        """The node's count of active ranks (a one-element tensor; None when not counting)."""
        if self._count_work is not None:
            self.wait(self._count_work, "the node's count of ranks with data")
            self._count_work = None
        return self._count

    def wait(self, work: Any, what: str) -> None:
        """Wait for a node collective. On the CPU (gloo) the wait is bounded by the timeout; on a GPU
        it only orders the current stream after it (torch's NCCL watchdog bounds it): a bounded
        wait there would block the host for every bucket."""
        if self._stream_ordered:
            work.wait()
        else:
            wait_bounded(work, self.timeout, f"rank {torch.distributed.get_rank()}: {what}")

    def end_iteration(self) -> None:
        self._count, self._count_work = None, None

    # -- per bucket ------------------------------------------------------------------------------
    def start_reduction(self, grad_block: Tensor, shard_grad: Tensor) -> Optional[Any]:
        """Start summing the node's gradients into ``shard_grad`` (this rank's shard, or ``grad_block``
        itself with 'allreduce'); :meth:`finish_reduction` makes it the mean."""
        if self.group is None:
            if shard_grad is not grad_block:
                shard_grad.copy_(grad_block)
            return None
        if self.shards:
            return self.group.reduce_scatter(shard_grad, grad_block)
        return self.group.all_reduce(grad_block)

    def finish_reduction(self, work: Optional[Any], grad_block: Tensor, shard_grad: Tensor) -> None:
        """Wait for :meth:`start_reduction` and divide by the node's ranks with data; with 'shard',
        ``grad_block`` is zeroed for the next iteration."""
        if work is not None:
            self.wait(work, "the node's gradient reduction")
        count = self.count()
        if count is not None:
            shard_grad.div_(count.clamp(min=1.0))
        elif self.local > 1:
            shard_grad.div_(self.local)
        if shard_grad is not grad_block:
            grad_block.zero_()

    def gather_params(self, param_block: Tensor, shard: Tensor) -> Optional[Any]:
        """Start the all-gather of the updated shards into ``param_block`` (None: nothing to gather)."""
        if not self.shards or self.group is None:
            return None
        return self.group.all_gather(param_block, shard)

    def squared_norm(self, shard_sq: Tensor) -> Tensor:
        """The node's sum of the shards' squared gradient norms (the whole bucket's), so that every
        rank of the node takes the same clip factor and found-inf decision."""
        if not self.shards or self.group is None:
            return shard_sq
        self.wait(self.group.all_reduce(shard_sq), "the node's gradient norm")
        return shard_sq



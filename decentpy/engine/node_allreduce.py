"""Node all-reduce then gossip (``intra_node='allreduce'``).

Per bucket, the node all-reduces its gradients (their mean over the ranks with data), and every
rank steps the whole bucket with replicated optimizer state and gossips it with the same local
rank of the peer nodes.
"""

from __future__ import annotations

from typing import Any, Optional

from .bucket import Bucket
from .node import NodeReduction

__all__ = ["NodeAllReduce"]


class NodeAllReduce(NodeReduction):
    """Gossip of node means: an in-place all-reduce of each bucket's gradient block over the node."""

    name = "allreduce"

    def start_reduction(self, b: Bucket) -> Optional[Any]:
        group = self.node.group
        return group.all_reduce(b.grad_block) if group is not None else None

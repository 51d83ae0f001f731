"""Node reduce-scatter, shard mix-and-step, all-gather (``intra_node='shard'``).

Per bucket, the gradients are reduce-scattered over the node, so local rank ``l`` holds shard
``l`` of the node's mean gradient; it mixes its shard of the parameters with the ranks holding
shard ``l`` on the peer nodes (:func:`decentpy.topology.shard_topology`), steps it with optimizer
state for that shard only, sends it, and the node then all-gathers the updated shards, waited for
before the parameters are next used (the next forward, ``wait()``, checkpoints, ``global_avg``).
Per rank: optimizer state and inter-node bytes ``1/L`` of plain gossip's, and the ``L`` ranks of a
node use their links at once. Buckets are padded to a multiple of ``L`` elements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from torch import Tensor, nn

from ..optim.grad_scaling import GradArgs
from .bucket import Bucket
from .node import NodeReduction

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["NodeShard"]


class NodeShard(NodeReduction):
    """Each rank of a node steps and gossips its ``1/L`` shard of every bucket."""

    name = "shard"

    def __init__(self, strategy: "GossipStrategy") -> None:
        super().__init__(strategy)
        self._gathers: Dict[int, Any] = {}  # the node's all-gathers in flight, by bucket

    @property
    def pad_multiple(self) -> int:
        return self.node.local

    def shard_of(self, numel: int) -> Optional[Tuple[int, int]]:
        size = numel // self.node.local
        return self.node.local_rank * size, (self.node.local_rank + 1) * size

    def check_resume(self, state: Dict[str, Any], local_world_size: int) -> None:
        super().check_resume(state, local_world_size)
        if "rank" in state:
            saved = int(state["rank"]) % self.node.local
            if saved != self.node.local_rank:
                raise ValueError(f"checkpoint was saved by rank {state['rank']}, which holds shard {saved} of every "
                                 f"bucket (intra_node='shard'); this is rank {self.strategy.rank}, which holds shard "
                                 f"{self.node.local_rank}: load each rank's checkpoint on a rank with the same local rank")

    def module_hooks(self, model: nn.Module) -> List[Any]:
        # The node's all-gather of the updated shards is in flight after a step: whoever reads the
        # parameters next (a forward of the model, with or without the wrapper; a state dict) waits.
        wait = self.strategy.policy.wait_params  # through the failure policy: a dead node peer ends it
        return [model.register_forward_pre_hook(lambda *_: wait()),
                model.register_state_dict_pre_hook(lambda *_: wait())]

    def start_reduction(self, b: Bucket) -> Optional[Any]:
        group = self.node.group
        if group is None:
            b.grad.copy_(b.grad_block)
            return None
        return group.reduce_scatter(b.grad, b.grad_block)

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        self.node.mean(reduction, b.grad)
        b.grad_block.zero_()  # the shard's gradient has a buffer of its own; the block starts the next iteration
        return self.strategy.grad_scaling.bucket_args(b.index, b.grad, self._node_squared_norm)

    def _node_squared_norm(self, shard_sq: Tensor) -> Tensor:
        """The node's sum of the shards' squared gradient norms (the whole bucket's), so that every
        rank of the node takes the same clip factor and found-inf decision."""
        group = self.node.group
        if group is not None:
            self.node.wait(group.all_reduce(shard_sq), "the node's gradient norm")
        return shard_sq

    def stepped(self, b: Bucket) -> None:
        group = self.node.group
        if group is not None:
            self._gathers[b.index] = group.all_gather(b.param_block, b.param)
        else:  # a node of one rank: its shard is the whole block
            b.scatter_params()  # param_as_bucket_view=False: the parameters follow the block

    def drop_work(self) -> None:
        """Forget the node's work in flight, the all-gathers of updated shards included (a worker of
        the node died: the node leaves the membership whole)."""
        super().drop_work()
        self._gathers = {}

    def part_changed(self, b: Bucket) -> None:
        """The shard's outer step (local steps): the node all-gathers the shards again, now."""
        group = self.node.group
        if group is not None:
            self.node.wait(group.all_gather(b.param_block, b.param),
                           f"the node's all-gather of bucket {b.index}'s shards after its outer step")
        b.scatter_params()

    def wait_params(self) -> None:
        for b in self.strategy.buckets:
            work = self._gathers.pop(b.index, None)
            if work is not None:
                self.node.wait(work, f"the node's all-gather of bucket {b.index}'s updated shards")
                b.scatter_params()  # param_as_bucket_view=False: the parameters follow the block

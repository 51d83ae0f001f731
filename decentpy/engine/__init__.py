"""The backward engine: one driver for every data-parallel wrapper, and the bucket strategies.

- :mod:`.driver`: :class:`BackwardDriver` -- the autograd hooks (the only ones on parameters),
  readiness, the end of backward, accumulation (``no_sync``), Join, bounded waits.
- :mod:`.strategy`: :class:`BucketStrategy`, the typed interface: what happens to a ready bucket.
- :mod:`.bucket` (one bucket type, one step path) and :mod:`.layout` (the gossip wrappers' buckets).
- One module per strategy: :mod:`.gossip` (mix-and-step), :mod:`.node_allreduce` and
  :mod:`.node_shard` (on what they share, :mod:`.node`), :mod:`.sharded_grads`
  (``ShardedDataParallel``'s reduce to the owners).
"""

from typing import Dict, Type

from .driver import BackwardDriver, BoundedWait, DriverJoinHook
from .gossip import GossipSetup, GossipStrategy
from .node_allreduce import NodeAllReduce
from .node_shard import NodeShard
from .strategy import BucketStrategy, Readiness

#: ``DecentralizedDataParallel(intra_node=...)`` name -> strategy. The registration: a new gossip
#: strategy is its own module plus its line here.
GOSSIP_STRATEGIES: Dict[str, Type[GossipStrategy]] = {cls.name: cls for cls in (GossipStrategy, NodeShard, NodeAllReduce)}



def check_intra_node(mode: str) -> None:
    """ValueError naming ``mode`` and the valid ``intra_node`` choices (the registered strategies)."""
    if mode not in GOSSIP_STRATEGIES:
        raise ValueError(f"intra_node must be one of {', '.join(map(repr, GOSSIP_STRATEGIES))}, got {mode!r}")


__all__ = ["check_intra_node", "BackwardDriver", "BoundedWait", "DriverJoinHook", "BucketStrategy", "Readiness", "GossipSetup",
           "GossipStrategy", "NodeAllReduce", "NodeShard", "GOSSIP_STRATEGIES"]

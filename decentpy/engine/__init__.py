"""The backward engine: one driver for every data-parallel wrapper, and the bucket strategies.

- :mod:`.driver`: :class:`BackwardDriver` -- the autograd hooks (the only ones on parameters),
  readiness, the end of backward, accumulation (``no_sync``), Join, bounded waits.
- :mod:`.strategy`: :class:`BucketStrategy`, the typed interface: what happens to a ready bucket.
- :mod:`.bucket` (one bucket type, one step path) and :mod:`.layout` (the gossip wrappers' buckets).
- :mod:`.gossip`: the gossip strategy, the per-bucket sequence once, composed of four parts with
  one registry each: the node mode (:mod:`.node`, :mod:`.node_allreduce`, :mod:`.node_shard`;
  :data:`NODE_MODES`), the exchange (:mod:`.exchanges`, :mod:`.choco`;
  :data:`EXCHANGES`), the failure policy (:mod:`.failure`; :data:`FAILURE_POLICIES`) and the peer
  check of what arrives (:mod:`.peer_check`; :data:`PEER_POLICIES`).

The strategies plug into the driver from where they belong: the gossip strategy and its parts
here; ``ShardedDataParallel``'s reduce to the owners in :mod:`decentpy.sharding.sharded_grads`.
"""

import functools
from typing import Callable, Dict, Optional, Type

from ..local_steps import LocalSteps
from ..optim.compression import Compression
from .choco import CompressedExchange
from .local_steps import LocalStepsExchange

from .driver import BackwardDriver, BoundedWait, DriverJoinHook
from .exchanges import Exchange
from .failure import FAILURE_POLICIES, ElasticPolicy, FailurePolicy
from .gossip import GossipStrategy
from .node import GossipSetup, NodeMode, NodeReduction
from .node_allreduce import NodeAllReduce
from .node_shard import NodeShard
from .peer_check import PEER_POLICIES, CheckedPeers, PeerCheck, PeerChecker, make_peer_check
from .strategy import BucketStrategy, Readiness

#: ``DecentralizedDataParallel(intra_node=...)`` name -> node mode (a strategy's ``node=``). The
#: registration: a new node mode is its own module plus its line here.
NODE_MODES: Dict[str, Type[NodeMode]] = {cls.name: cls for cls in (NodeMode, NodeShard, NodeAllReduce)}

#: exchange name -> class (a strategy's ``exchange=``): ``"plain"``, ``"compressed"`` (``compression=``)
EXCHANGES: Dict[str, Type[Exchange]] = {cls.name: cls for cls in (Exchange, CompressedExchange, LocalStepsExchange)}


def exchange_for(compression: Optional[Compression],
                 local_steps: Optional[LocalSteps] = None) -> Callable[[GossipStrategy], Exchange]:
    """The exchange a wrapper's ``compression=`` / ``local_steps=`` select (a factory taking the
    strategy); ``local_steps``: checked settings (:func:`decentpy.local_steps.resolve_local_steps`),
    None for every-step gossip."""
    if local_steps is not None:
        return functools.partial(EXCHANGES["local-steps"], options=local_steps, compression=compression)
    if compression is None:
        return EXCHANGES["plain"]
    return functools.partial(EXCHANGES["compressed"], compression=compression)


def check_intra_node(mode: str) -> None:
    """ValueError naming ``mode`` and the valid ``intra_node`` choices (the registered node modes)."""
    if mode not in NODE_MODES:
        raise ValueError(f"intra_node must be one of {', '.join(map(repr, NODE_MODES))}, got {mode!r}")


__all__ = ["check_intra_node", "BackwardDriver", "BoundedWait", "DriverJoinHook", "BucketStrategy", "Readiness", "GossipSetup",
           "GossipStrategy", "NodeMode", "NodeReduction", "NodeAllReduce", "NodeShard", "NODE_MODES", "Exchange",
           "CompressedExchange", "LocalStepsExchange",
           "EXCHANGES", "exchange_for", "FailurePolicy", "ElasticPolicy", "FAILURE_POLICIES", "PeerCheck", "PeerChecker",
           "CheckedPeers", "PEER_POLICIES", "make_peer_check"]

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
from typing import Any, Callable, Dict, Optional, Type

from ..optim.compression import Compression
from .choco import CompressedExchange
from .local_steps import LocalStepsExchange, OuterOptimFn, diloco_outer_optim

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


#: Streaming DiLoCo's arguments of local steps and their defaults (one fragment, no delay, no merge)
STREAMING_DEFAULTS: Dict[str, Any] = {"fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}


def exchange_for(compression: Optional[Compression], local_steps: int = 1,
                 outer_optim: Optional[OuterOptimFn] = None,
                 sync_every_s: Optional[float] = None, **streaming: Any) -> Callable[[GossipStrategy], Exchange]:
    """The exchange a wrapper's ``compression=`` / ``local_steps=`` / ``sync_every_s=`` arguments
    select (a factory taking the strategy); ``streaming``: ``fragments``, ``fragment_sync_delay``,
    ``fragment_update_alpha`` of local steps."""
    if outer_optim is not None or local_steps != 1 or sync_every_s is not None:
        return functools.partial(EXCHANGES["local-steps"], local_steps=local_steps, outer_optim=outer_optim,
                                 compression=compression, sync_every_s=sync_every_s, **streaming)
    if any(v != d for v, d in zip((streaming.get(k, d) for k, d in STREAMING_DEFAULTS.items()),
                                  STREAMING_DEFAULTS.values())):
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in streaming.items())} streams the outer steps of "
                         "local steps: give local_steps=H (> 1) as well")
    if compression is None:
        return EXCHANGES["plain"]
    return functools.partial(EXCHANGES["compressed"], compression=compression)


def check_intra_node(mode: str) -> None:
    """ValueError naming ``mode`` and the valid ``intra_node`` choices (the registered node modes)."""
    if mode not in NODE_MODES:
        raise ValueError(f"intra_node must be one of {', '.join(map(repr, NODE_MODES))}, got {mode!r}")


__all__ = ["check_intra_node", "BackwardDriver", "BoundedWait", "DriverJoinHook", "BucketStrategy", "Readiness", "GossipSetup",
           "GossipStrategy", "NodeMode", "NodeReduction", "NodeAllReduce", "NodeShard", "NODE_MODES", "Exchange",
           "CompressedExchange", "LocalStepsExchange", "OuterOptimFn", "diloco_outer_optim",
           "EXCHANGES", "exchange_for", "FailurePolicy", "ElasticPolicy", "FAILURE_POLICIES", "PeerCheck", "PeerChecker",
           "CheckedPeers", "PEER_POLICIES", "make_peer_check"]

"""Everything decentpy does to talk to other ranks, each once:

* :mod:`.protocol` -- the :class:`Communicator` interface exchanges are built from, and :class:`Work`;
* :mod:`.torch_comm` -- :class:`TorchCommunicator` over ``torch.distributed``;
* :mod:`.nccl` -- :class:`NcclCommunicator` over decentpy's own NCCL communicator, and whether it
  can run here;
* :mod:`.select` -- ``comm='auto' | 'torch' | 'nccl'``: :func:`select_communicator`, the one call
  that builds (or rebuilds, for a new set of members) a wrapper's communicator;
* :mod:`.groups` -- process-group defaults (:func:`or_world`), group ranks, :class:`CommGroup` and
  its private sub-groups;
* :mod:`.wire` -- what crosses a process boundary as data (JSON, plain-data states), never as Python objects;
* :mod:`.agreement` -- cross-rank agreement: every rank learns of a difference or a failure before
  a collective that would hang on it;
* :mod:`.failures` -- a peer's failure classified once (:class:`PeerTimeoutError` and its subclasses
  :class:`PeerUnreachableError`, :class:`PeerReportedError`), heartbeats, :class:`PeerWatch`;
* :mod:`.waits` -- bounded waits (:class:`PeerTimeoutError` is re-exported there);
* :mod:`.plans` -- exchange plans: what one bucket trades with its group at one step (pair, group
  all-reduce, none), the mix coefficients, and what a communicator must set up for a topology;
* :mod:`.group_exchange` -- the two-round exchange of compressed chunks within a group of more than
  two ranks (compressed gossip's group step).

Below the engine: nothing here imports a strategy, a bucket or a wrapper.
"""

from .agreement import (SettingsMismatchError, agree_across_ranks, check_on_every_rank, comparable, everyone,
                        first_difference_across_ranks, raise_if_any_rank_failed)
from .failures import (DEFAULT_LIVENESS_TIMEOUT, FaultyPeerError, NonFiniteGradientError, PeerFaultyError,
                       PeerReportedError, PeerUnreachableError, PeerWatch, peer_monitor)
from .groups import CommGroup, SubGroup, average_, group_ranks, or_world
from .nccl import (NcclCommunicator, NcclExchange, nccl_available, nccl_compiled, nccl_library_candidates,
                   nccl_unavailable_reason)
from .protocol import Communicator, Work
from .select import COMM_CHOICES, check_comm, resolve_comm, select_communicator
from .torch_comm import Exchange, TorchCommunicator
from .waits import PeerTimeoutError, default_timeout, wait_bounded
from .wire import MalformedMessageError

__all__ = ["Communicator", "Work", "TorchCommunicator", "Exchange", "NcclCommunicator", "NcclExchange",
           "nccl_available", "nccl_compiled", "nccl_library_candidates", "nccl_unavailable_reason", "COMM_CHOICES",
           "check_comm", "resolve_comm", "select_communicator", "CommGroup", "SubGroup", "average_", "group_ranks", "or_world",
           "check_on_every_rank", "everyone", "first_difference_across_ranks", "raise_if_any_rank_failed", "PeerTimeoutError",
           "default_timeout", "wait_bounded", "agree_across_ranks", "comparable", "SettingsMismatchError",
           "MalformedMessageError",
           "DEFAULT_LIVENESS_TIMEOUT", "NonFiniteGradientError", "FaultyPeerError", "PeerFaultyError", "PeerReportedError", "PeerUnreachableError", "PeerWatch",
           "peer_monitor"]

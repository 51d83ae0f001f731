"""Uneven inputs: torch's generic ``Join`` context, re-exported.

``DecentralizedDataParallel`` is a :class:`~torch.distributed.algorithms.join.Joinable`, so
torch's own context manager drives it, alone or together with torch's joinables (DDP,
``ZeroRedundancyOptimizer``) in one ``Join``. Nothing needs overriding: a joined rank's hook
shadows each iteration's bucket exchanges (see ``BackwardDriver.run_iteration`` in
:mod:`decentpy.engine.driver`).
"""

from torch.distributed.algorithms.join import Join, Joinable, JoinHook

__all__ = ["Join", "Joinable", "JoinHook"]

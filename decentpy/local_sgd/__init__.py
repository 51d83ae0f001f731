"""Local-steps training: H inner steps without communication, then an outer step over a topology.

- :mod:`.outer`: one fragment's outer step (pseudo-gradient against the global copy, its exchange
  over the topology's plan -- the exact mean on ``complete``, a gossip mix otherwise -- the outer
  optimizer, the reset and the Streaming DiLoCo merge).
- :mod:`.diloco`: :class:`DiLoCo` and :class:`LocalSGD`, torchft-shaped contexts for scripts that
  keep their own torch optimizer.
"""

from .diloco import DiLoCo, LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]

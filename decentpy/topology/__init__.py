"""Communication topologies: which ranks average together at each step.

- :mod:`.schedules`: the topology model (a periodic schedule of groups with self weights), the
  built-in schedules, validation, spectral gaps, the node and shard views of hybrid modes, and
  the one registry of names (:func:`register_topology`, :func:`make_topology`).
- :mod:`.edges`: decent-dp's edge view of the same registry (``Edge``, ``Topology`` classes that
  return edges, ``TopologyReg``), and the edges handed to ``pre_average_hook``.
- :mod:`.decent_dp`: decent-dp's module ``decent_dp.topo`` (what ``decentpy.topo`` is), names only.

Pure Python above torch: nothing here communicates or imports the rest of decentpy.
"""

from .schedules import *  # noqa: F401,F403  (the topology model: its __all__)
from .schedules import __all__ as _schedules_all
from .schedules import TopologyFactory  # noqa: F401  (the registry's value type, for annotations)
from .edges import Edge, EdgeTopology, TopologyReg, hook_edges  # noqa: F401

__all__ = list(_schedules_all) + ["TopologyFactory", "Edge", "EdgeTopology", "TopologyReg", "hook_edges"]

"""decent-dp's module path ``decent_dp.topo`` (importable as ``decentpy.topo``): its names, bound
to decentpy's topology core.

Nothing is defined here. ``Topology`` is :class:`decentpy.topology.edges.EdgeTopology` (subclass
it and return one list of :class:`Edge` per step from ``_get_topo_edges()``), ``TopologyReg`` and
``Edge`` come from the same module, and the built-in classes are what ``TopologyReg.registry``
lists for decentpy's built-in schedules (:mod:`decentpy.topology.schedules`). Inside decentpy,
import from those modules, never from this one.
"""

from .edges import Edge, EdgeTopology as Topology, TopologyReg

CompleteTopology = TopologyReg.registry["complete"]
RingTopology = TopologyReg.registry["ring"]
OnePeerExpTopology = TopologyReg.registry["one-peer-exp"]
AlternatingExpRingTopology = TopologyReg.registry["alternating-exp-ring"]

__all__ = ["Edge", "Topology", "TopologyReg", "CompleteTopology", "RingTopology", "OnePeerExpTopology",
           "AlternatingExpRingTopology"]

"""decent-dp's module path ``decent_dp.topo``: an alias of :mod:`decentpy.topology.decent_dp`
(``from decentpy.topo import Topology, TopologyReg, Edge`` as decent-dp scripts write it)."""

from .topology.decent_dp import *  # noqa: F401,F403
from .topology.decent_dp import __all__  # noqa: F401

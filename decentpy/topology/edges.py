"""decent-dp's edge view of topologies, on decentpy's one registry (:mod:`decentpy.topology.schedules`).

decent-dp describes a step as a list of :class:`Edge` (``ranks`` averaging together, ``weight``
the self weight ``w``: ``x_i <- w x_i + (1 - w) / (|R| - 1) sum_{j != i} x_j``, and ``group``, a
process group over exactly ``ranks``) and a topology as a class returning one such list per step
from ``_get_topo_edges()``, registered by name in ``TopologyReg.registry``. This module gives
decentpy that vocabulary without a second topology model:

- :class:`EdgeTopology` (decent-dp's ``Topology``): the edges become a validated
  :class:`~decentpy.topology.CustomTopology`; registering the class puts a factory for it in
  decentpy's registry, so the wrapper, :func:`~decentpy.topology.make_topology` and
  :func:`~decentpy.topology.available_topologies` all see it.
- :class:`TopologyReg`: ``registry`` is a mutable mapping *view* of decentpy's registry (name ->
  class, readable and iterable as decent-dp's dict); natively registered names (the built-ins
  among them) appear as generated :class:`EdgeTopology` classes whose edges come from decentpy's
  schedules, named as decent-dp names its classes (``ring`` -> ``RingTopology``).
- :class:`Edge` and :func:`hook_edges`: the edges the wrapper hands to ``pre_average_hook``.

Unlike decent-dp, constructing a topology creates no process groups (decentpy's communicator
builds its own); :meth:`EdgeTopology.create_process_groups` does it on request.
``decentpy.topo`` (:mod:`decentpy.topology.decent_dp`) re-exports these names under decent-dp's module
path.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .schedules import (
    CustomTopology,
    Group,
    Topology,
    TopologyError,
    TopologyFactory,
    available_topologies,
    make_topology,
    register_topology,
    topology_factories,
    unregister_topology,
)

__all__ = ["Edge", "EdgeTopology", "TopologyReg", "hook_edges"]

logger = logging.getLogger(__name__)


@dataclass
class Edge:
    """One group of one step: ``ranks`` average with self weight ``weight`` (decent-dp's ``Edge``).

    ``group`` is a process group over exactly ``ranks``; ``None`` until process groups are created
    (:meth:`EdgeTopology.create_process_groups`, or the wrapper for ``pre_average_hook``).
    """

    ranks: List[int]
    weight: float
    group: Optional[ProcessGroup] = None


def hook_edges(topology: Topology) -> Dict[Tuple[Tuple[int, ...], float], Edge]:
    """One :class:`Edge` per distinct (ranks, weight) of ``topology``, with a process group per
    distinct ranks (collective).

    For ``pre_average_hook``: created once, in schedule order on every rank (``new_group`` must be
    called identically everywhere), only when some optimizer defines the hook.
    """
    groups: Dict[Tuple[int, ...], ProcessGroup] = {}
    edges: Dict[Tuple[Tuple[int, ...], float], Edge] = {}
    for step in topology.schedule:
        for g in step:
            if g.ranks not in groups:
                groups[g.ranks] = dist.new_group(list(g.ranks))
            if (g.ranks, g.weight) not in edges:
                edges[(g.ranks, g.weight)] = Edge(list(g.ranks), g.weight, groups[g.ranks])
    return edges


# World size for topologies built by the registry (make_topology passes sizes, decent-dp's
# constructor takes only local_world_size, and user subclasses may override __init__ with it).
_BUILD_WORLD_SIZE: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("decentpy_topo_world_size",
                                                                                  default=None)


class EdgeTopology:
    """decent-dp's ``Topology`` base class: implement :meth:`_get_topo_edges`.

    ``_get_topo_edges()`` returns one list of :class:`Edge` per step; it may use ``self._world_size``,
    ``self._local_world_size``, ``self._n_nodes`` and ``self._rank``, as in decent-dp. The edges are
    validated by decentpy (:class:`decentpy.TopologyError`, a ``ValueError``, names the step and the
    rank at fault) and available as a decentpy topology through :attr:`topology`.

    Args:
        local_world_size: processes per node (must divide the world size).
        world_size: defaults to the initialized process group's size (decent-dp requires one).
    """

    name: str = "custom"

    def __init__(self, local_world_size: int, world_size: Optional[int] = None) -> None:
        if world_size is None:
            world_size = _BUILD_WORLD_SIZE.get()
        if world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"{type(self).__name__}(local_world_size={local_world_size}) needs the world size: call "
                    "torch.distributed.init_process_group(...) first, or pass world_size=")
            world_size = dist.get_world_size()
        self._world_size = int(world_size)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self._rank: int = rank if rank < self._world_size else 0  # built for another size (e.g. a test)
        self._local_world_size = int(local_world_size)
        if self._local_world_size < 1 or self._world_size % self._local_world_size != 0:
            raise TopologyError(
                f"topology {self.name!r}: local_world_size must be >= 1 and divide world_size, got "
                f"world_size={self._world_size}, local_world_size={self._local_world_size}")
        self._n_nodes = self._world_size // self._local_world_size
        self._registry: Dict[str, ProcessGroup] = {}
        self._all_edges: List[List[Edge]] = [list(step) for step in self._get_topo_edges()]
        schedule = [[self._group(k, e) for e in step] for k, step in enumerate(self._all_edges)]
        self._topology = CustomTopology(schedule, self._world_size, self._local_world_size, name=self.name)
        # This rank's edge at each step (decent-dp's get_edge).
        self._edges: List[Edge] = [next(e for e in step if self._rank in e.ranks) for step in self._all_edges]

    def _group(self, step: int, edge: Any) -> Group:
        """``edge`` as a decentpy :class:`Group` (its ranks sorted in place, as decent-dp does)."""
        if not isinstance(edge, Edge):
            raise TopologyError(
                f"topology {self.name!r}, step {step}: _get_topo_edges() must return lists of Edge, got "
                f"{type(edge).__name__} {edge!r}")
        edge.ranks = sorted(edge.ranks)
        try:
            return Group(tuple(edge.ranks), edge.weight)
        except TopologyError as exc:
            raise TopologyError(f"topology {self.name!r}, step {step}: {exc}") from None

    def _get_topo_edges(self) -> List[List[Edge]]:
        raise NotImplementedError(f"{type(self).__name__} must implement _get_topo_edges() -> List[List[Edge]]")

    # -- decent-dp's queries -------------------------------------------------------------------
    def get_edge(self, step: int) -> Edge:
        """This rank's edge at ``step`` (modulo the period)."""
        return self._edges[step % len(self._edges)]

    @property
    def topology(self) -> Topology:
        """The validated decentpy topology (schedule, mixing matrices, spectral gap)."""
        return self._topology

    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of the period-averaged mixing matrix (how fast consensus is reached)."""
        return self._topology.spectral_gap()

    def describe(self) -> str:
        return self._topology.describe()

    @property
    def edges(self) -> List[List[Edge]]:
        """Every step's edges (all ranks), as returned by ``_get_topo_edges()``."""
        return [list(step) for step in self._all_edges]

    def create_process_groups(self) -> None:
        """Give every edge a process group over its ranks (collective: call on every rank).

        decent-dp does this in its constructor; decentpy's wrapper does not need these groups, so
        here it happens only when asked.
        """
        for step in self._all_edges:
            for e in step:
                key = str(e.ranks)
                if key not in self._registry:
                    self._registry[key] = dist.new_group(list(e.ranks))
                e.group = self._registry[key]


class _ScheduleEdges(EdgeTopology):
    """Edges of a topology registered natively in decentpy (its schedule, as decent-dp edges)."""

    topology_name: str = ""

    def _get_topo_edges(self) -> List[List[Edge]]:
        topo = make_topology(self.topology_name, self._world_size, self._local_world_size)
        return [[Edge(list(g.ranks), g.weight) for g in step] for step in topo.schedule]


def _class_name(name: str) -> str:
    """decent-dp's class naming: ``alternating-exp-ring`` -> ``AlternatingExpRingTopology``."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^0-9A-Za-z]+", name)) + "Topology"


class _EdgeTopologyFactory:
    """decentpy registry entry for an :class:`EdgeTopology` class: ``(world_size, local_world_size) -> Topology``."""

    def __init__(self, name: str, cls: Type[EdgeTopology]) -> None:
        self.name = name
        self.edge_class = cls

    def __call__(self, world_size: int, local_world_size: int) -> Topology:
        with _building(world_size):
            inst = self.edge_class(local_world_size)
        if inst._world_size != world_size:
            raise TopologyError(
                f"topology {self.name!r} was built for world_size={inst._world_size}, expected {world_size}")
        topo = inst.topology
        topo.name = self.name
        return topo

    def __repr__(self) -> str:
        return f"<decent-dp-style topology {self.edge_class.__qualname__} registered as {self.name!r}>"


@contextlib.contextmanager
def _building(world_size: int) -> Iterator[None]:
    token = _BUILD_WORLD_SIZE.set(int(world_size))
    try:
        yield
    finally:
        _BUILD_WORLD_SIZE.reset(token)


def _check_class(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, EdgeTopology)):
        raise ValueError(f"Topology {name} must extend class decentpy.topo.Topology (decent-dp's "
                         f"decent_dp.topo.Topology), got {cls!r}")


class _RegistryView(MutableMapping):
    """``TopologyReg.registry``: name -> :class:`EdgeTopology` class, over decentpy's one registry.

    Reading and iterating work as on decent-dp's dict (names in sorted order). Assigning a class
    registers it (replacing an existing name, as assigning to decent-dp's dict does); ``del``
    unregisters. A natively registered name reads as a generated class whose edges come from its
    schedule, the same class for as long as the same factory stays registered.
    """

    def __init__(self) -> None:
        self._views: Dict[str, Tuple[TopologyFactory, Type[EdgeTopology]]] = {}

    def __getitem__(self, name: str) -> Type[EdgeTopology]:
        factory = topology_factories()[name]  # KeyError for unknown names, as a dict
        if isinstance(factory, _EdgeTopologyFactory):
            return factory.edge_class
        cached = self._views.get(name)
        if cached is None or cached[0] is not factory:
            doc = f"decentpy's {name!r} topology as decent-dp edges. {getattr(factory, '__doc__', '') or ''}"
            cls = type(_class_name(name), (_ScheduleEdges,), {"name": name, "topology_name": name,
                                                              "__doc__": doc.strip(), "__module__": __name__})
            cached = self._views[name] = (factory, cls)
        return cached[1]

    def __setitem__(self, name: str, cls: Type[EdgeTopology]) -> None:
        _check_class(name, cls)
        if issubclass(cls, _ScheduleEdges) and cls.topology_name == name:
            return  # the view of the native entry itself: nothing changes
        if "name" not in cls.__dict__:
            cls.name = name
        register_topology(name, _EdgeTopologyFactory(name, cls), overwrite=True)

    def __delitem__(self, name: str) -> None:
        unregister_topology(name)

    def __iter__(self) -> Iterator[str]:
        return iter(available_topologies())

    def __len__(self) -> int:
        return len(topology_factories())

    def __repr__(self) -> str:
        return f"TopologyReg.registry({', '.join(map(repr, self))})"


class TopologyReg:
    """decent-dp's topology registry: ``@TopologyReg.register("name")`` on a :class:`EdgeTopology` subclass."""

    registry: MutableMapping = _RegistryView()

    @classmethod
    def register(cls, name: str) -> Callable[[Type[EdgeTopology]], Type[EdgeTopology]]:
        """Decorator registering an :class:`EdgeTopology` subclass under ``name`` (a duplicate raises)."""
        def _register(topology: Type[EdgeTopology]) -> Type[EdgeTopology]:
            if name in topology_factories():
                raise ValueError(f"Topology {name} already registered (registered: "
                                 f"{', '.join(available_topologies())})")
            _check_class(name, topology)
            if "name" not in topology.__dict__:
                topology.name = name
            register_topology(name, _EdgeTopologyFactory(name, topology))
            return topology

        return _register

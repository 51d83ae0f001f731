"""decent-dp's topology interface (``decent_dp.topo``), mapped onto :mod:`decentpy.topology`.

decent-dp defines a topology by subclassing :class:`Topology` and returning, from
``_get_topo_edges()``, one list of :class:`Edge` per step of the period; ``@TopologyReg.register``
(or ``TopologyReg.registry[name] = cls``) makes it usable by name. Here such a class is turned into
a validated :class:`decentpy.topology.CustomTopology` (each rank in exactly one group per step,
weights in [0, 1], spectral gap available) and registered in decentpy's own registry, so the
wrapper, :func:`decentpy.make_topology` and :func:`decentpy.available_topologies` all see it.
There is one registry: ``TopologyReg.registry`` is a view of decentpy's, and the built-in names
appear in it as classes whose edges come from decentpy's own schedules.

An :class:`Edge` has decent-dp's meaning: ``ranks`` (sorted global ranks of the group), ``weight``
(the self weight ``w``: ``x_i <- w x_i + (1 - w) / (|R| - 1) sum_{j != i} x_j``) and ``group``, a
process group over exactly ``ranks``. Unlike decent-dp, constructing a topology creates no process
groups (decentpy's communicator builds its own); :meth:`Topology.create_process_groups` does it
on request, and the wrapper fills ``group`` for the edges it passes to ``pre_average_hook``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import topology as _native

__all__ = ["Edge", "Topology", "TopologyReg", "CompleteTopology", "RingTopology", "OnePeerExpTopology",
           "AlternatingExpRingTopology"]

logger = logging.getLogger(__name__)


@dataclass
class Edge:
    """One group of one step: ``ranks`` average with self weight ``weight`` (decent-dp's ``Edge``).

    ``group`` is a process group over exactly ``ranks``; ``None`` until process groups are created
    (:meth:`Topology.create_process_groups`, or the wrapper for ``pre_average_hook``).
    """

    ranks: List[int]
    weight: float
    group: Optional[ProcessGroup] = None


# World size for topologies built by the registry (make_topology passes sizes, decent-dp's
# constructor takes only local_world_size, and user subclasses may override __init__ with it).
_BUILD_WORLD_SIZE: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("decentpy_topo_world_size",
                                                                                  default=None)


class Topology:
    """Base class of decent-dp-style topologies: implement :meth:`_get_topo_edges`.

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
            raise _native.TopologyError(
                f"topology {self.name!r}: local_world_size must be >= 1 and divide world_size, got "
                f"world_size={self._world_size}, local_world_size={self._local_world_size}")
        self._n_nodes = self._world_size // self._local_world_size
        self._registry: Dict[str, ProcessGroup] = {}
        edges = self._get_topo_edges()
        self._all_edges: List[List[Edge]] = [[e for e in step] for step in edges]
        schedule = []
        for k, step in enumerate(self._all_edges):
            groups = []
            for e in step:
                if not isinstance(e, Edge):
                    raise _native.TopologyError(
                        f"topology {self.name!r}, step {k}: _get_topo_edges() must return lists of Edge, got "
                        f"{type(e).__name__} {e!r}")
                e.ranks = sorted(e.ranks)  # decent-dp sorts them too
                try:
                    groups.append(_native.Group(tuple(e.ranks), e.weight))
                except _native.TopologyError as exc:
                    raise _native.TopologyError(f"topology {self.name!r}, step {k}: {exc}") from None
            schedule.append(groups)
        self._topology = _native.CustomTopology(schedule, self._world_size, self._local_world_size, name=self.name)
        # This rank's edge at each step (decent-dp's get_edge).
        self._edges: List[Edge] = [next(e for e in step if self._rank in e.ranks) for step in self._all_edges]

    def _get_topo_edges(self) -> List[List[Edge]]:
        raise NotImplementedError(f"{type(self).__name__} must implement _get_topo_edges() -> List[List[Edge]]")

    # -- decent-dp's queries -------------------------------------------------------------------
    def get_edge(self, step: int) -> Edge:
        """This rank's edge at ``step`` (modulo the period)."""
        return self._edges[step % len(self._edges)]

    @property
    def topology(self) -> _native.Topology:
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


class _NativeTopology(Topology):
    """decent-dp-style view of a topology registered natively in decentpy (its edges, from its schedule)."""

    native_name: str = ""

    def _get_topo_edges(self) -> List[List[Edge]]:
        factory = _native._REGISTRY[self.native_name]
        topo = factory(self._world_size, self._local_world_size)
        return [[Edge(list(g.ranks), g.weight) for g in step] for step in topo.schedule]


class CompleteTopology(_NativeTopology):
    """All ranks average every step, weight 1/n (decentpy's ``complete``)."""

    name = native_name = "complete"


class RingTopology(_NativeTopology):
    """Alternating neighbour pairs, weight 1/2 (decentpy's ``ring``)."""

    name = native_name = "ring"


class OnePeerExpTopology(_NativeTopology):
    """Round t pairs rank j with j XOR 2^t (decentpy's ``one-peer-exp``)."""

    name = native_name = "one-peer-exp"


class AlternatingExpRingTopology(_NativeTopology):
    """Inter-node pairs and intra-node groups alternating (decentpy's ``alternating-exp-ring``)."""

    name = native_name = "alternating-exp-ring"


_BUILTIN_VIEWS: Dict[str, Type[Topology]] = {
    c.native_name: c for c in (CompleteTopology, RingTopology, OnePeerExpTopology, AlternatingExpRingTopology)
}


class _EdgeTopologyFactory:
    """decentpy registry entry for a decent-dp-style class: ``(world_size, local_world_size) -> Topology``."""

    def __init__(self, name: str, cls: Type[Topology]) -> None:
        self.name = name
        self.compat_class = cls

    def __call__(self, world_size: int, local_world_size: int) -> _native.Topology:
        with _building(world_size):
            inst = self.compat_class(local_world_size)
        if inst._world_size != world_size:
            raise _native.TopologyError(
                f"topology {self.name!r} was built for world_size={inst._world_size}, expected {world_size}")
        topo = inst.topology
        topo.name = self.name
        return topo

    def __repr__(self) -> str:
        return f"<decent-dp-style topology {self.compat_class.__qualname__} registered as {self.name!r}>"


@contextlib.contextmanager
def _building(world_size: int) -> Iterator[None]:
    token = _BUILD_WORLD_SIZE.set(int(world_size))
    try:
        yield
    finally:
        _BUILD_WORLD_SIZE.reset(token)


def _check_class(name: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Topology)):
        raise ValueError(f"Topology {name} must extend class decentpy.topo.Topology (decent-dp's "
                         f"decent_dp.topo.Topology), got {cls!r}")


class _RegistryView(MutableMapping):
    """``TopologyReg.registry``: name -> decent-dp-style class, backed by decentpy's registry.

    Assigning a :class:`Topology` subclass registers it (replacing an existing name, as assigning to
    decent-dp's dict does); names registered natively in decentpy appear as generated classes
    whose edges come from the native schedule.
    """

    def __init__(self) -> None:
        self._views: Dict[Tuple[str, int], Type[Topology]] = {}

    def __getitem__(self, name: str) -> Type[Topology]:
        factory = _native._REGISTRY[name]  # KeyError for unknown names, as a dict
        if isinstance(factory, _EdgeTopologyFactory):
            return factory.compat_class
        if name in _BUILTIN_VIEWS and factory is _BUILTIN_NATIVE.get(name):
            return _BUILTIN_VIEWS[name]
        key = (name, id(factory))
        if key not in self._views:
            self._views[key] = type(f"{name}Topology", (_NativeTopology,),
                                    {"name": name, "native_name": name, "__doc__": f"decentpy topology {name!r}."})
        return self._views[key]

    def __setitem__(self, name: str, cls: Type[Topology]) -> None:
        _check_class(name, cls)
        if issubclass(cls, _NativeTopology) and cls.native_name == name:
            return  # the view of the native entry itself: nothing changes
        if "name" not in cls.__dict__:
            cls.name = name
        _native.register_topology(name, _EdgeTopologyFactory(name, cls), overwrite=True)

    def __delitem__(self, name: str) -> None:
        del _native._REGISTRY[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_native.available_topologies())

    def __len__(self) -> int:
        return len(_native._REGISTRY)

    def __repr__(self) -> str:
        return f"TopologyReg.registry({', '.join(map(repr, self))})"


_BUILTIN_NATIVE: Dict[str, Callable[..., Any]] = {name: _native._REGISTRY[name] for name in _BUILTIN_VIEWS}


class TopologyReg:
    """decent-dp's topology registry: ``@TopologyReg.register("name")`` on a :class:`Topology` subclass."""

    registry: MutableMapping = _RegistryView()

    @classmethod
    def register(cls, name: str) -> Callable[[Type[Topology]], Type[Topology]]:
        """Decorator registering a :class:`Topology` subclass under ``name`` (a duplicate raises)."""
        def _register(topology: Type[Topology]) -> Type[Topology]:
            if name in _native._REGISTRY:
                raise ValueError(f"Topology {name} already registered (registered: "
                                 f"{', '.join(_native.available_topologies())})")
            _check_class(name, topology)
            if "name" not in topology.__dict__:
                topology.name = name
            _native.register_topology(name, _EdgeTopologyFactory(name, topology))
            return topology

        return _register


def hook_edges(topology: _native.Topology) -> Dict[Tuple[Tuple[int, ...], float], Edge]:
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

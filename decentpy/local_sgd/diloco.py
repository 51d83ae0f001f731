"""torchft-shaped local-steps training for scripts that keep their own torch optimizer:
:class:`DiLoCo` (and Streaming DiLoCo, with fragments) and :class:`LocalSGD`, without a Manager or
a Lighthouse, with the outer exchange over any decentpy topology.

Used as torchft's are: a context around a plain training loop that calls
``inner_optimizer.step()``; an optimizer post-step hook counts the inner steps and runs the outer
step of a fragment when it is due. torchft 0.2.0's keyword arguments keep their meaning
(``sync_every``, ``backup_device``, ``pin_memory``, ``fragment_sync_delay``,
``fragment_update_alpha``); ``topology=`` (default ``"complete"``: DiLoCo's exact mean) and
``group=`` are decentpy's. A torchft script ports by deleting its Manager and the manager
argument (docs/migration/torchft.md).
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..arguments import check_bool
from ..comm import CommGroup, agree_across_ranks, check_comm, default_timeout, or_world
from ..engine.step_checks import check_before_step
from ..optim.hyperparams import check_hyperparameters, hyperparameters_of
from ..optim.compression import Compression, resolve_compression
from ..local_steps import LocalSteps, SparseOuter, WindowClock
from ..optim.shards import local_shard, shard_layout
from ..topology import Topology, make_topology
from .outer import Fragment, TopologyMixer

__all__ = ["DiLoCo", "LocalSGD"]

logger = logging.getLogger(__name__)

TopologyLike = Union[str, Topology]


def _topology(topology: TopologyLike, world: int) -> Topology:
    if isinstance(topology, Topology):
        if topology.world_size != world:
            raise ValueError(f"topology {topology.name!r} is for {topology.world_size} ranks, the group has {world}")
        return topology
    if not isinstance(topology, str):
        raise TypeError(f"topology must be a registered name (e.g. 'complete', 'ring') or a decentpy Topology, got "
                        f"{type(topology).__name__}")
    return make_topology(topology, world, 1)


class _LocalSteps:
    """What DiLoCo and LocalSGD share: the group, the topology's mixer, the inner-optimizer hook,
    the context protocol and the initial broadcast."""

    def __init__(self, modules: Sequence[nn.Module], inner_optimizer: Optimizer, options: LocalSteps,
                 topology: TopologyLike, group: Optional[dist.ProcessGroup], comm: str,
                 broadcast_parameters: bool, check: Any, clock: Callable[[], float] = time.monotonic) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed: call "
                               "torch.distributed.init_process_group(...) first")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the world), got "
                            f"{type(group).__name__}")
        pg = or_world(group)
        self._group = CommGroup(pg)
        found: List[Topology] = []
        compression: List[Optional[Compression]] = []  # what ``check`` resolves (DiLoCo's compressed exchange)
        settings: Dict[str, Any] = {}

        def local_checks() -> None:
            if not isinstance(inner_optimizer, Optimizer):
                raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
            check_hyperparameters(inner_optimizer, f"the inner optimizer ({type(inner_optimizer).__name__})")
            options.check("sync_every")
            check_comm(comm if isinstance(comm, str) else repr(comm))
            check_bool("broadcast_parameters", broadcast_parameters)
            found.append(_topology(topology, self._group.size))
            comp, extra = check(found[0])
            options.check_exchange(comp, comm)
            compression.append(comp)
            settings.update({
                "model (parameter shapes and dtypes per module)": [
                    [(tuple(p.shape), str(p.dtype)) for p in m.parameters()] for m in modules],
                # FSDP2: each exchange pairs a shard with the same shard of the other replicas
                "shard of each DTensor parameter (placements, mesh coordinate, local shape; FSDP2: give "
                "group=mesh['replicate'].get_group(), the ranks that hold one shard index)": [
                    shard_layout(list(m.parameters())) for m in modules],
                **options.settings(), "topology": found[0].name, "comm": comm,
                "broadcast_parameters": broadcast_parameters, "compression": repr(comp),
                "inner_optimizer (class and hyper-parameters)": (type(inner_optimizer),
                                                                 hyperparameters_of(inner_optimizer)),
                **extra})

        # Bad input, and any setting that differs between ranks (sync_every 2 here, 3 there: their outer
        # steps would pair mismatched exchanges), raise on every rank before the first collective.
        failure: Optional[BaseException] = None
        try:
            local_checks()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            failure = exc
        agree_across_ranks(failure, settings if failure is None else {}, f"{type(self).__name__}(...)", pg)
        self.topology = found[0]
        self._inner = inner_optimizer
        self.options = options
        #: the window and fragment clock (ticked by the inner optimizer's post-step hook)
        self.clock = WindowClock(options, clock)
        self.clock.start()
        self._hooks: List[Any] = []
        self._closed = False
        if broadcast_parameters:
            with torch.no_grad():
                src = self._group.to_global(0)
                for m in modules:
                    for t in list(m.parameters()) + list(m.buffers()):
                        dist.broadcast(local_shard(t).data, src=src, group=pg)
        device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
        self._mixer = TopologyMixer(self.topology, self._group, default_timeout(), comm, device=device,
                                    compression=compression[0], replicas_equal=broadcast_parameters,
                                    sparse=options.sparse)

    def __enter__(self) -> "_LocalSteps":
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed (its context ended); build a new one")
        self._hooks.append(self._inner.register_step_pre_hook(self._step_pre_hook))
        self._hooks.append(self._inner.register_step_post_hook(self._step_post_hook))
        self.clock.start()  # a time budget counts from the start of training
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Remove the hook and release the communicator (the end of the context does this)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if not self._closed:
            self._closed = True
            self._mixer.close()

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank's outer exchanges put on the wire so far (DecentralizedDataParallel's
        counter: a point-to-point send or this rank's buffer of an all-reduce)."""
        return int(getattr(self._mixer.comm, "bytes_sent", 0))

    @property
    def local_step(self) -> int:
        """Inner steps since the last outer step."""
        return self.clock.inner_steps

    @property
    def outer_steps(self) -> int:
        """Outer steps completed (the index of the topology's schedule for the next one)."""
        return self.clock.outer_steps

    def _step_pre_hook(self, _optim: Optimizer, _args: Tuple[Any, ...], _kwargs: Dict[str, Any]) -> None:
        """Before each inner step: its hyper-parameters (a scheduler's NaN would turn the model NaN, and
        the next outer exchange every replica's); a bad one raises here, reported to the peers."""
        self._check_before_step([(self._inner, f"the inner optimizer ({type(self._inner).__name__})")])

    def _check_before_step(self, optimizers: List[Tuple[Optimizer, str]]) -> None:
        check_before_step(optimizers, self._group.to_global(self._group.rank), self.outer_steps)

    def _step_post_hook(self, _optim: Optimizer, _args: Tuple[Any, ...], _kwargs: Dict[str, Any]) -> None:
        self._after_inner_step(self.clock.tick())

    def _after_inner_step(self, launching: Optional[int]) -> None:
        """After an inner step: ``launching``, the fragment whose outer exchange starts now (None: none)."""
        raise NotImplementedError


class DiLoCo(_LocalSteps):
    """DiLoCo (and Streaming DiLoCo) over a decentpy topology; torchft 0.2.0's ``DiLoCo`` without
    the Manager.

    Args:
        model_fragments: the model (one fragment) or its fragments (modules whose parameters are
            disjoint; Streaming DiLoCo synchronises them at staggered steps).
        inner_optimizer: the script's own optimizer over the model (e.g. AdamW); the outer steps
            run from its post-step hook.
        outer_optimizer: over the fragments' parameters (one, or one per fragment); DiLoCo's is
            ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``.
        sync_every: inner steps between two outer steps of the same fragment (``H``); with ``F``
            fragments one fragment is synchronised every ``sync_every / F`` inner steps.
        backup_device: where the global copies live (default: the CPU, as in torchft).
        pin_memory: pin the CPU copies when CUDA is available.
        fragment_sync_delay: inner steps that run while a fragment's exchange is in flight (the
            exchange starts that many steps before the fragment's outer step; Streaming DiLoCo's
            ``tau``).
        fragment_update_alpha: after the outer step, the fragment's parameters move this fraction of
            the way back to the local parameters of those inner steps (0: the new global copy).
        topology: the outer exchange's topology: ``"complete"`` (default; the exact mean of the
            pseudo-gradients, DiLoCo), or any registered name or Topology (a gossip outer step: the
            global copies and pseudo-gradients mixed with a few peers, see
            :mod:`decentpy.local_sgd.outer`).
        group: the process group of the replicas (default: the world).
        comm: ``"torch"`` (default), ``"nccl"`` or ``"auto"``, as for DecentralizedDataParallel.
        broadcast_parameters: start every replica from the group's first rank's parameters (the
            global copies must agree; torchft's Manager heals a replica for the same reason).
        sync_every_s: a time budget instead of ``sync_every`` (pass ``sync_every=None``): each replica
            takes as many inner steps as fit in this many seconds, then the outer step, whose
            pseudo-gradients are weighted by the inner steps behind them (``sum s_j delta_j / sum
            s_j`` over the group), so replicas of different speeds need no per-replica tuning; a slow
            replica reaches the exchange at most one of its inner steps late. One fragment.
        clock: the time source of ``sync_every_s`` (seconds; ``time.monotonic``).
        outer_pull: NoLoCo's outer step (see :class:`decentpy.LocalSteps`): on a gossip topology each
            replica's outer optimizer steps its own global copy with the mixed pseudo-gradient plus
            ``outer_pull`` times (its copy - the group's mean copy). NoLoCo as its authors run it:
            ``topology="random-pairs"``, ``sync_every=50``, ``outer_pull=1.0`` and
            ``torch.optim.SGD(params, lr=0.7, momentum=0.5)``.
        sparse: SparseLoCo's outer exchange (:class:`decentpy.SparseOuter`): the error-fed chunk-wise
            top-k of the pseudo-gradient in 2 bits, averaged over ``topology="complete"``; give an
            outer ``torch.optim.SGD(params, lr=1.0)`` without momentum (the error buffer replaces it).

    ``use_bucketization`` and ``bucket_cap_mb`` are accepted for torchft scripts: each fragment
    already travels as one buffer per dtype. ``should_quantize=True`` is ``compression="int8"`` (on
    every device; torchft 0.2.0 quantises on CUDA with Triton only and otherwise sends full precision
    without saying so).

    ``compression`` (``"int8"``, ``"int4"``, ``"bf16"`` or a :class:`~decentpy.Compression`): on
    ``topology="complete"`` the pseudo-gradients travel compressed with error feedback (what one outer
    step's compression drops is sent at the next), averaged by compressed gossip's group exchange (each
    member re-quantises its chunk of the mean and feeds that rounding back too); on a gossip topology
    the global copy and the pseudo-gradient are mixed by compressed gossip against public copies
    (:mod:`decentpy.comm.compressed_mix`). ``comm="torch"``, ``sync_every`` only.
    """

    def __init__(self, model_fragments: Union[nn.Module, Sequence[nn.Module]], inner_optimizer: Optimizer,
                 outer_optimizer: Union[Optimizer, Sequence[Optimizer]], sync_every: Optional[int],
                 backup_device: Optional[torch.device] = None, pin_memory: bool = True,
                 use_bucketization: bool = False, bucket_cap_mb: Optional[int] = None, should_quantize: bool = False,
                 fragment_sync_delay: int = 0, fragment_update_alpha: float = 0.0, *,
                 topology: TopologyLike = "complete", group: Optional[dist.ProcessGroup] = None, comm: str = "torch",
                 broadcast_parameters: bool = True, sync_every_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic,
                 compression: Union[None, str, Compression] = None, outer_pull: Optional[float] = None,
                 sparse: Optional[SparseOuter] = None) -> None:
        fragments = [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        outers = list(outer_optimizer) if isinstance(outer_optimizer, (list, tuple)) else [outer_optimizer]

        def check(topo: Topology) -> Optional[Compression]:
            if not fragments or not all(isinstance(f, nn.Module) for f in fragments):
                raise TypeError("model_fragments must be an nn.Module or a non-empty list of them")
            if not all(isinstance(o, Optimizer) for o in outers):
                raise TypeError("outer_optimizer must be a torch.optim.Optimizer or a list of them (one per fragment)")
            if len(outers) not in (1, len(fragments)):
                raise ValueError(f"{len(outers)} outer optimizers for {len(fragments)} fragments: give one, or one "
                                 "per fragment")
            for i, o in enumerate(outers):
                check_hyperparameters(o, f"outer optimizer {i} ({type(o).__name__})")
            extra = {"should_quantize": should_quantize,
                     "outer_optimizer (class and hyper-parameters)": [(type(o), hyperparameters_of(o)) for o in outers]}
            comp = resolve_compression(compression)
            if should_quantize and comp is None:
                comp = resolve_compression("int8")  # torchft's low-bit outer exchange, on every device
            elif should_quantize and comp is not None and comp.kind != "int8":
                raise ValueError(f"should_quantize=True asks for int8, compression={comp.kind!r} for another "
                                 "compressor: give one of them")
            if comp is not None:
                if comm != "torch":
                    raise ValueError(f"compression={comp.kind!r} runs over comm='torch' (point to point), got "
                                     f"comm={comm!r}")
            seen: Dict[int, int] = {}
            for i, f in enumerate(fragments):
                for p in f.parameters():
                    if id(p) in seen:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in fragments {seen[id(p)]} and {i}: "
                                         "the fragments' parameters must be disjoint")
                    seen[id(p)] = i
            for i, o in enumerate(outers):
                mine = ({id(p) for p in fragments[i].parameters()} if len(outers) > 1 else set(seen))
                owned = {id(p) for g in o.param_groups for p in g["params"]}
                if not mine <= owned:
                    raise ValueError(f"outer optimizer {i} does not hold every parameter of "
                                     f"{'fragment ' + str(i) if len(outers) > 1 else 'the model'}: build it over "
                                     "those parameters (the outer step sets their .grad and steps them)")
            return comp, extra

        options = LocalSteps(sync_every=sync_every, sync_every_s=sync_every_s, fragments=len(fragments),
                             fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=fragment_update_alpha,
                             outer_pull=outer_pull, sparse=sparse)
        super().__init__(fragments, inner_optimizer, options, topology, group, comm, broadcast_parameters, check,
                         clock)
        self._send_globals = not self._mixer.exact
        self._fragments = [Fragment(i, [p for p in f.parameters() if p.requires_grad],
                                    outers[i] if len(outers) > 1 else outers[0], backup_device, pin_memory,
                                    fragment_update_alpha, self._mixer, weighted=self.clock.timed,
                                    pull=outer_pull)
                           for i, f in enumerate(fragments)]
        for f in self._fragments:
            f.save()
        logger.info("DiLoCo: %d fragment(s), one outer step every %s over %s (%s)", len(fragments),
                    f"{self.options.sync_every_s:g} s" if self.clock.timed else f"{self.clock.period} inner steps",
                    self.topology.name, "exact mean" if self._mixer.exact else "gossip")

    @property
    def fragments(self) -> int:
        return len(self._fragments)

    def _check_outer(self, f: Fragment) -> None:
        """The fragment's outer optimizer's hyper-parameters, before its exchange starts."""
        self._check_before_step([(f.outer, f"the outer optimizer of fragment {f.index} ({type(f.outer).__name__})")])

    def _current(self) -> Fragment:
        return self._fragments[self.outer_steps % len(self._fragments)]

    def _after_inner_step(self, launching: Optional[int]) -> None:
        # A time budget: as many inner steps as fit, then the outer step, the pseudo-gradients weighted
        # by the inner steps behind them; a slow replica reaches the exchange at most one of its inner
        # steps after the budget. A step count: a fragment's exchange starts fragment_sync_delay inner
        # steps before its outer step; the same fragment and tag on every rank, in the same order.
        if launching is not None:
            f = self._fragments[launching]
            self._check_outer(f)
            f.prepare(self.outer_steps, 16 * f.index, self._send_globals,
                      weight=float(self.clock.inner_steps) if self.clock.timed else None)
        if self.clock.apply_due and self._current().in_flight:
            self._current().perform()
            self.clock.applied()

    def sync(self) -> None:
        """Run the due fragment's outer step now (its exchange started if it was not yet)."""
        f = self._current()
        if not f.in_flight:
            self._check_outer(f)
            f.prepare(self.outer_steps, 16 * f.index, self._send_globals)
        f.perform()
        self.clock.applied()

    def state_dict(self) -> Dict[str, Any]:
        """The step counters, and per fragment its global copy, outer optimizer state and any
        exchange in flight: with the model's and the inner optimizer's state dicts, a resume
        continues bit for bit."""
        return {"local_step": self.clock.inner_steps, "outer_steps": self.clock.outer_steps,
                "sync_every": self.options.sync_every, "topology": self.topology.name, "fragments": [f.state_dict() for f in self._fragments]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state["fragments"]) != len(self._fragments) or state["sync_every"] != self.options.sync_every:
            raise ValueError(f"the checkpoint has {len(state['fragments'])} fragment(s) and sync_every="
                             f"{state['sync_every']}; this DiLoCo has {len(self._fragments)} and {self.options.sync_every}")
        for f, s in zip(self._fragments, state["fragments"]):
            f.load_state_dict(s)
        self.clock.load_state_dict({"outer_steps": state["outer_steps"], "inner_steps": state["local_step"]})


class LocalSGD(_LocalSteps):
    """Local SGD: every ``sync_every`` inner steps the parameters are mixed with the topology's
    group (``"complete"``: averaged over every replica, torchft's ``LocalSGD``); torchft 0.2.0's
    ``LocalSGD`` without the Manager."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, sync_every: int, *,
                 topology: TopologyLike = "complete", group: Optional[dist.ProcessGroup] = None, comm: str = "torch",
                 broadcast_parameters: bool = True) -> None:
        def check(_topo: Topology) -> Tuple[None, Dict[str, Any]]:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            return None, {}

        super().__init__([model], optimizer, LocalSteps(sync_every=sync_every), topology, group, comm,
                         broadcast_parameters, check)
        self._fragment = Fragment(0, [p for p in model.parameters() if p.requires_grad], None, None, False, 0.0)

    def _after_inner_step(self, launching: Optional[int]) -> None:
        if launching is not None:
            self.sync()

    def sync(self) -> None:
        """Mix the parameters now."""
        self._fragment.average_params(self._mixer, self.outer_steps, 0)
        self.clock.applied()

    def state_dict(self) -> Dict[str, Any]:
        return {"local_step": self.clock.inner_steps, "outer_steps": self.clock.outer_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.clock.load_state_dict({"outer_steps": state["outer_steps"], "inner_steps": state["local_step"]})


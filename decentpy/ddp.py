"""``DecentralizedDataParallel``: the user-facing wrapper.

Same constructor as the ``decent-dp`` package, so a script written for it runs by changing the
import. Construction validates everything that could differ between ranks *before* the first
collective, so bad input raises on every rank instead of leaving some rank hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim.lr_scheduler import LRScheduler

from .arguments import check_bool, check_int, check_real, check_timedelta
from .comm import CommGroup, agree_across_ranks, average_, default_timeout, raise_if_any_rank_failed
from .comm.arrival import Arrivals
from .comm import DEFAULT_LIVENESS_TIMEOUT, PeerWatch, check_comm, or_world, resolve_comm, select_communicator
from .engine import NODE_MODES, BackwardDriver, DriverJoinHook, GossipStrategy, check_intra_node, exchange_for, ownership
from .local_steps import LocalSteps, resolve_local_steps
from .optim.compression import Compression, resolve_compression
from .engine.bucket import Bucket
from .engine.layout import OptimFn, SchedulerFn
from .engine.peer_check import DEFAULT_PEER_CHECK, PeerCheck, resolve_peer_check
from .optim.grad_scaling import BucketGradScaling
from .optim.hyperparams import check_hyperparameters, hyperparameters_of
from .optim.shards import is_dtensor
from .topology import Topology
from .topology import hook_edges

logger = logging.getLogger(__name__)

OPTIM_FN_TYPE = OptimFn
LR_SCHEDULER_FN_TYPE = SchedulerFn



class DecentralizedDataParallel(nn.Module, Joinable):
    """Decentralized data parallelism: each worker mixes its parameters with a few peers.

    Args:
        model: the module to train; every rank must build the same architecture (the values are
            broadcast from rank 0 at construction).
        optim_fn: ``optim_fn(named_params) -> Optimizer``, called once per bucket with the
            bucket's ``(name, parameter)`` pairs. decentpy's fused optimizers (and torch's
            SGD/Adam/AdamW, converted to them) step in one kernel pass with the mixing; any other
            optimizer steps after a separate mix.
        lr_scheduler_fn: ``lr_scheduler_fn(optimizer) -> LRScheduler``, one per bucket, stepped
            once per iteration.
        topology: a registered topology name (``decentpy.available_topologies()``) or a
            :class:`~decentpy.Topology` instance.
        scaler: a ``torch.amp.GradScaler``; a bucket whose gradients are not finite skips its
            update (it still mixes and sends finite parameters) and the scale backs off.
        grad_clip_norm: clip each *bucket's* gradient to this norm (0 disables). Per bucket, so
            that clipping never delays the overlapped exchanges.
        param_as_bucket_view: parameters become views into the flat bucket blocks (no copies);
            ``False`` keeps their own storage at the cost of two copies per bucket and step.
        sync_buffer_in_global_avg: also average floating-point buffers (e.g. BatchNorm running
            statistics) in :meth:`global_avg`.
        bucket_size_in_mb: bucket capacity in MiB.
        local_world_size: workers per node (defaults to ``$LOCAL_WORLD_SIZE``, else 1); used by
            node-aware topologies. ``_local_world_size`` is accepted as in decent-dp.
        timeout: bound on every wait for a peer that is alive but slow (defaults to the process
            group's timeout).
        peer_liveness_timeout: a peer whose process stops beating its heartbeat (killed, stopped,
            its host gone) for this long ends every wait on it with a
            :class:`~decentpy.PeerUnreachableError` naming it (default 10 s; ``None`` disables the
            heartbeats, leaving only ``timeout``). See docs/failures.md.
        nonfinite: a bucket whose gradient is not finite (inf/NaN, e.g. a NaN loss) on a rank:
            ``'skip'`` (default) skips that bucket's update there (it still mixes, and sends its
            finite parameters: nothing non-finite reaches a peer) and logs a warning naming rank,
            step and bucket, on that rank at once and on the others within a few seconds;
            ``'raise'`` raises :class:`~decentpy.NonFiniteGradientError` there and on every other
            rank (a subclass of it, also a :class:`~decentpy.PeerTimeoutError`); ``'ignore'``
            checks nothing (no norm per bucket). Uses the bucket norm the GradScaler / clipping
            path takes anyway; with a GradScaler a skip is its normal back-off (logged at INFO).
        broadcast_parameters: ``True`` (the default): every rank starts from the group's first rank's
            parameters and buffers (one broadcast at construction). ``False``: each rank keeps its own
            values (:class:`decentpy.elastic.ElasticGossip` re-forming over the survivors of a failure,
            or every rank loading its own checkpoint right after).
        comm: ``'auto'`` (decentpy's NCCL communicator when the process group is NCCL and the
            extension has it, else torch.distributed), ``'torch'`` or ``'nccl'``.
        process_group: gossip among the ranks of this group only (default: the world). The
            topology is built over the group's ranks (numbered by group rank; ``local_world_size``
            defaults to the group's ranks per node), every exchange and every collective of the
            wrapper (construction checks, the initial broadcast from the group's first rank,
            :meth:`global_avg`, ``Join``) stays inside it, and wrappers on disjoint groups run side
            by side in one job (e.g. one per pipeline stage or per model replica set). Build it on
            the group's ranks only.
        intra_node: what the ``local_world_size`` ranks of a node do together. ``'gossip'`` (the
            default): every rank is a gossip worker. ``'shard'``: the node is one worker; per bucket its
            gradients are reduce-scattered over the node, each rank mixes and steps its ``1/L`` shard
            (optimizer state for that shard only) with the ranks holding that shard on the peer nodes,
            and the node all-gathers the updated shards before the next forward. ``'allreduce'``: the
            node averages its gradients and every rank steps the whole model (replicated state) and
            gossips it with its counterparts on the peer nodes. With either, ``topology`` runs over
            the nodes (names with ``n`` = number of nodes).
        local_steps: ``H`` (default 1: gossip every step), or a :class:`~decentpy.LocalSteps` with every
            local-steps setting (``LocalSteps(sync_every=H, outer_optim=..., sync_every_s=..., fragments=...,
            fragment_sync_delay=..., fragment_update_alpha=...)``, the fields documented there; the same
            names are accepted as keywords of this constructor, the earlier spelling). With ``H > 1``
            every rank takes ``H`` inner steps (the fused optimizer of ``optim_fn``, inside the backward)
            without exchanging, then an outer step: its pseudo-gradient (global copy minus parameters)
            is exchanged over ``topology`` -- ``'complete'`` averages it, DiLoCo; any other topology
            mixes the global copy and the pseudo-gradient with its group of that outer step, a gossip
            outer step -- while the backward finishes, and before the next forward the outer optimizer
            (default DiLoCo's ``SGD(lr=0.7, momentum=0.9, nesterov=True)`` over a bucket's float32 global
            copy) steps from the (mixed) global copy. With ``sync_every_s`` a window is a time budget,
            the pseudo-gradients weighted by the inner steps behind them; with ``fragments`` the
            buckets (bucket ``i`` in fragment ``i % fragments``) take their outer steps in turn
            (Streaming DiLoCo; fewer buckets than fragments leaves fragments empty, with a warning).
            With ``intra_node='allreduce'`` every node is a replica (its ranks all-reduce the gradients
            every inner step; the outer step runs between the nodes); with ``intra_node='shard'`` too,
            each rank then keeping the global copy and outer state of its ``1/L`` shard only and
            exchanging it with the same shard's ranks on the other nodes. With ``compression`` the outer
            exchange is compressed: on ``'complete'`` the pseudo-gradients with error feedback, on a
            gossip topology the global copy and pseudo-gradient by compressed gossip (CHOCO).
        peer_check: what arrives from a peer is checked before it is mixed: that it is finite, and
            that its distance from this replica is within ``bound`` times the median of the last
            ``window`` accepted distances (until a window is kept, within this replica's norm; a change
            of scale on every peer at once restarts the history). A policy name or a
            :class:`~decentpy.PeerCheck` (``policy``, ``bound``, ``window``; default
            ``PeerCheck('skip', bound=10, window=16)``). ``'skip'`` drops a contribution that fails (its
            weight goes to this replica) and logs a warning naming the peer's rank; ``'clip'`` scales
            the peer's difference down to the bound (ClippedGossip; a non-finite one is dropped);
            ``'raise'`` raises :class:`~decentpy.FaultyPeerError` naming the peer, the bucket, the step,
            the distance and the bound on the detecting rank, and an error naming the same peer on every
            other rank; ``'off'`` checks nothing. Groups of more than two ranks (``complete``, the
            cross-node groups of ``alternating-exp-ring``) carry a small fingerprint of each member's
            contribution with the sum; a member that fails makes every member keep its parameters for
            that step (or raise). An accepted contribution mixes with the coefficients it would without
            the check (bit for bit on pairs; a group's sum of the longer buffer may round otherwise);
            ``stats()`` counts the failures per peer. Compressed gossip and local steps get a non-finite
            check only. See docs/failures.md, "A faulty peer".
    """

    #: buffer dtypes that global_avg averages with sync_buffers (decent-dp's attribute; may be edited)
    FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    #: the strategy's failure policy (decentpy.engine.failure.FAILURE_POLICIES); an elastic epoch's: "elastic"
    _failure_policy = "raise"

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OptimFn,
        lr_scheduler_fn: Optional[SchedulerFn] = None,
        topology: Union[str, Topology] = "complete",
        scaler: Optional["torch.amp.GradScaler"] = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: float = 25,
        local_world_size: Optional[int] = None,
        _local_world_size: Optional[int] = None,
        timeout: Optional[datetime.timedelta] = None,
        comm: str = "auto",
        process_group: Optional[dist.ProcessGroup] = None,
        intra_node: str = "gossip",
        peer_liveness_timeout: Optional[datetime.timedelta] = DEFAULT_LIVENESS_TIMEOUT,
        nonfinite: str = "skip",
        compression: Union[None, str, Compression] = None,
        broadcast_parameters: bool = True,
        local_steps: Union[int, LocalSteps] = 1,
        peer_check: Union[str, PeerCheck] = DEFAULT_PEER_CHECK,
        **keywords: Any,
    ) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DecentralizedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group(...) before wrapping the model")
        if process_group is not None and process_group is not dist.GroupMember.NON_GROUP_MEMBER and \
                not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None (the world), got "
                            f"{type(process_group).__name__}")
        # The group first: the first collective below runs over it (a rank outside it raises here).
        self._group = CommGroup(process_group)
        self._process_group = self._group.process_group  # None: the world
        self._rank = self._group.rank
        self._world_size = self._group.size
        self._closed = False
        self._backups: List[Tensor] = []
        self._skip_mix_before_avg: List[bool] = []

        # Local work first (the arguments, then the buckets and the per-bucket optimizers); whether it
        # failed anywhere is the subject of the first collective, so a bad input on one rank raises on
        # every rank (a rank raising alone would leave the others in that collective) and none hangs.
        failure: Optional[BaseException] = None
        self._local_steps: Optional[LocalSteps] = None
        try:
            # LocalSteps' fields as keywords (the earlier spelling)
            self._local_steps = resolve_local_steps(local_steps, **keywords)
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
            _check_unwrapped(model)
            if not callable(optim_fn):
                raise TypeError(f"optim_fn must be callable (named params -> Optimizer), got {type(optim_fn).__name__}")
            if lr_scheduler_fn is not None and not callable(lr_scheduler_fn):
                raise TypeError(f"lr_scheduler_fn must be callable or None, got {type(lr_scheduler_fn).__name__}")
            if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
                raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
            check_real("grad_clip_norm", grad_clip_norm, 0.0, what="0 disables clipping")
            check_real("bucket_size_in_mb", bucket_size_in_mb, 0.0, strict=True, what="MiB per bucket")
            if int(bucket_size_in_mb * 1024 * 1024) < 1:
                raise ValueError(f"bucket_size_in_mb={bucket_size_in_mb!r} is less than one byte per bucket")
            for flag, value in (("param_as_bucket_view", param_as_bucket_view),
                                ("sync_buffer_in_global_avg", sync_buffer_in_global_avg),
                                ("broadcast_parameters", broadcast_parameters)):
                check_bool(flag, value)
            check_int("local_world_size", local_world_size, 1, allow_none=True)
            check_int("_local_world_size", _local_world_size, 1, allow_none=True)
            if local_world_size is not None and _local_world_size is not None and local_world_size != _local_world_size:
                raise ValueError(f"local_world_size={local_world_size} and _local_world_size={_local_world_size} "
                                 "differ; give one of them")
            check_timedelta("timeout", timeout, none_means="the process group's timeout")
            check_timedelta("peer_liveness_timeout", peer_liveness_timeout, none_means="no heartbeats: only timeout")
            check_comm(comm if isinstance(comm, str) else repr(comm))
            check_intra_node(intra_node if isinstance(intra_node, str) else repr(intra_node))
            self._compression = resolve_compression(compression)
            if self._compression is not None:
                if comm == "nccl":
                    raise ValueError("compression is not supported by the NCCL communicator yet (comm='nccl'); use "
                                     "comm='auto' or 'torch', which send the compressed bytes over torch.distributed")
                comm = "torch"
            lws = local_world_size if local_world_size is not None else _local_world_size
            self._node_processes: Optional[int] = None  # torchrun's LOCAL_WORLD_SIZE, where the nodes come from it
            if lws is None:
                lws = self._group.local_world_size(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                self._node_processes = int(lws)
                if self._world_size % lws:  # nodes of different sizes: named by the agreement below, not here
                    lws = 1
            self._local_world_size = int(lws)
            self._intra_node = intra_node
            node_mode = NODE_MODES[intra_node]
            self._timeout = timeout if timeout is not None else default_timeout()

            self._model = model
            self._scaler = scaler
            self._grad_clip_norm = float(grad_clip_norm)
            self._param_as_bucket_view = bool(param_as_bucket_view)
            self._sync_buffer_in_global_avg = bool(sync_buffer_in_global_avg)
            self._bucket_size = int(bucket_size_in_mb * 1024 * 1024)

            # Pure functions of the sizes and the topology argument; a rank given another topology
            # fails here alone, which the agreement below reports on every rank.
            setup = node_mode.configure(topology, self._rank, self._world_size, self._local_world_size,
                                       self._timeout)
            self._topology = setup.topology
            exchange_topology = setup.exchange_topology
            if self._local_steps is not None:  # (SparseLoCo's exchange: its own compression, over torch)
                self._local_steps.check_exchange(self._compression, comm if isinstance(comm, str) else repr(comm))
                if self._local_steps.sparse is not None:
                    comm = "torch"
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            if not named:
                raise ValueError("the model has no parameter that requires a gradient: nothing to train")
            self._param_names = [n for n, _ in named]
            self._params = [p for _, p in named]
            self._check_device()
            if comm == "nccl":  # libnccl and the GPU, checked here: the agreement below raises on every rank
                resolve_comm(comm, self._params[0].device, self._group)
            self._check_dense_gradients()
            exchange = exchange_for(self._compression, self._local_steps)
            self._grad_scaling = BucketGradScaling(scaler, self._grad_clip_norm, nonfinite)
            self._peer_check = resolve_peer_check(peer_check)
            self._strategy: GossipStrategy = GossipStrategy(
                self._params, self._param_names, optim_fn, lr_scheduler_fn, setup, self._grad_scaling,
                self._bucket_size, self._param_as_bucket_view, self._timeout, self._group,
                node=node_mode, exchange=exchange, failure=self._failure_policy, peer_check=self._peer_check)
            if self._compression is not None and self._local_steps is None:
                self._check_compressible()  # (local steps compress the outer exchange: any parameter dtype)
            for b in self._strategy.buckets:  # (fused optimizers checked theirs; torch's others accept NaN)
                check_hyperparameters(b.optimizer, f"the optimizer optim_fn returned for bucket {b.index} "
                                                   f"({type(b.optimizer).__name__})")
            if self._local_steps is not None and self._local_steps.outer_optim is not None:
                check_hyperparameters(self._local_steps.outer_optimizer([torch.zeros(1)]),
                                      "the optimizer outer_optim returned")
            self._driver = BackwardDriver()
            self._driver.attach(self._params, self._strategy)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank just below
            failure = exc
        settings: Dict[str, Any] = {} if failure is not None else {
            "topology": topology if isinstance(topology, str) else f"{type(topology).__name__} {topology.name!r}",
            **({} if self._node_processes is None else {
                "processes on this rank's node (torchrun's LOCAL_WORLD_SIZE)": self._node_processes}),
            "intra_node": intra_node, "local_world_size": self._local_world_size,
            "bucket_size_in_mb": bucket_size_in_mb, "comm": comm, "grad_clip_norm": self._grad_clip_norm,
            "scaler (GradScaler enabled)": scaler is not None and scaler.is_enabled(),
            "sync_buffer_in_global_avg": self._sync_buffer_in_global_avg, "nonfinite": nonfinite,
            "compression": repr(self._compression),
            **(self._local_steps.settings("local_steps") if self._local_steps is not None else {"local_steps": 1}),
            "peer_check": repr(getattr(self, "_peer_check", peer_check)),  # resolved: 'skip' == PeerCheck('skip')
        }
        wants_edges = False
        if failure is None:
            wants_edges = self._strategy.layout.has_pre_average_hook()
            settings = {"model": [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self._param_names, self._params)],
                        "optimizer defines pre_average_hook": wants_edges, **settings,
                        "optimizer (class and hyper-parameters per bucket)": [
                            (type(b.optimizer), hyperparameters_of(b.optimizer)) for b in self._strategy.buckets],
                        "lr_scheduler": [type(b.scheduler) for b in self._strategy.buckets]}
        # One collective, before any other: a failure anywhere, or any setting that differs, raises
        # on every rank (a rank with another bucket size or topology would abort or hang in gloo).
        agree_across_ranks(failure, settings, "DecentralizedDataParallel", group=self._process_group,
                           explain={"model": _model_differs, "optimizer defines pre_average_hook": _hook_differs})
        if self._node_processes is not None and self._world_size % self._node_processes:  # (every rank alike)
            raise ValueError(f"LOCAL_WORLD_SIZE={self._node_processes} processes per node does not divide the "
                             f"world of {self._world_size}: every node must run the same number of processes "
                             "(torchrun --nproc_per_node), or pass local_world_size=")
        if wants_edges and not self._strategy.exchanges_whole_model:  # the same verdict on every rank (checked above)
            raise ValueError(
                f"optimizers with decent-dp's pre_average_hook see each exchange of the whole model; with "
                f"intra_node={intra_node!r} the exchanges carry shards or node means: use intra_node='gossip' or an "
                "optimizer without pre_average_hook")
        if wants_edges and not self._group.is_world:
            raise ValueError(
                "optimizers with decent-dp's pre_average_hook get edges whose .group is a torch process group over "
                "the edge's ranks, which decentpy creates on the world only; with process_group= use an optimizer "
                "without pre_average_hook")
        if broadcast_parameters:
            self._broadcast_from_rank0()
            self._strategy.replicas_equal = True
        self._strategy.connect(self._params[0].device)
        comm_ = select_communicator(comm, exchange_topology, self._timeout, device=self._params[0].device,
                                    group=self._group, liveness=peer_liveness_timeout,
                                    needs=self._strategy.communication_needs())
        # Edges (with process groups) for optimizers that hook into the averaging; collective, so
        # only after the check above proved every rank wants them.
        self._strategy.attach(comm_, hook_edges(self._topology) if wants_edges else None)
        self._comm = comm_
        self._watch = PeerWatch(self._group.global_ranks, self._timeout, peer_liveness_timeout)
        # whole-model collectives of public calls announce themselves first (decentpy.comm.arrival)
        self._arrivals = Arrivals(self._group.global_ranks, self._rank, self._timeout)
        self._module_hooks: List[Any] = self._strategy.module_hooks(model)
        _WRAPPED[model] = weakref.ref(self)
        if self._rank == 0:
            logger.info("decentpy: %s, %s %d, local world size %d, bucket cap %.1f MiB",
                        self._topology.describe(),
                        "world size" if self._group.is_world else f"process group {list(self._group.global_ranks)}, size",
                        self._world_size, self._local_world_size, bucket_size_in_mb)

    # -- construction checks -----------------------------------------------------------------
    def _check_device(self) -> None:
        """With NCCL the parameters must be on this rank's GPU (moving them silently would leave the
        caller's references, e.g. an optimizer built on them, on the CPU)."""
        if dist.get_backend(self._process_group) != dist.Backend.NCCL:
            return
        bad = next(((n, p.device) for n, p in zip(self._param_names, self._params) if p.device.type != "cuda"), None)
        if bad is not None:
            raise ValueError(
                f"the process group's backend is nccl but parameter '{bad[0]}' is on {bad[1]}; move the model to "
                "this rank's GPU before wrapping it, e.g. model.to(torch.device('cuda', local_rank)) after "
                "torch.cuda.set_device(local_rank) (decentpy.utils.initialize_dist does the latter)")

    def _check_compressible(self) -> None:
        """Compressed gossip steps float32 parameters with decentpy's fused optimizers (one kernel pass)."""
        kind = self._compression.kind if self._compression is not None else None
        for n, p in zip(self._param_names, self._params):
            if p.dtype != torch.float32:
                raise ValueError(f"compression={kind!r}: parameter '{n}' is {p.dtype}; compressed gossip steps float32 "
                                 "parameters only for now (mixed precision with torch.autocast keeps float32 "
                                 "parameters and works)")
        for b in self._strategy.buckets:
            if not b.fused:
                raise ValueError(f"compression={kind!r}: bucket {b.index}'s optimizer {type(b.optimizer).__name__} is "
                                 "not one of decentpy's fused optimizers (SGD, Adam, AdamW, AccumAdam, AccumAdamW, or "
                                 "torch's SGD/Adam/AdamW, which decentpy fuses); the compressed exchange runs inside "
                                 "the fused kernel pass")
            if hasattr(b.optimizer, "pre_average_hook"):
                raise ValueError(f"compression={kind!r}: optimizers with pre_average_hook see the peers' parameters, "
                                 "which compressed gossip never sends")

    @property
    def compression(self) -> Optional[Compression]:
        """The compressed-gossip settings (None: uncompressed)."""
        return self._compression

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's exchanges have put on the wire so far (payload only)."""
        return int(getattr(self._comm, "bytes_sent", 0))

    @property
    def communicator(self) -> Any:
        """The communicator the exchanges go through (:class:`~decentpy.comm.TorchCommunicator` or
        :class:`~decentpy.comm.NcclCommunicator`); its ``selection_reason`` says why it was chosen."""
        return self._comm

    def _check_dense_gradients(self) -> None:
        for name, mod in self._model.named_modules():
            if getattr(mod, "sparse", False) is True and any(p.requires_grad for p in mod.parameters(False)):
                raise ValueError(
                    f"module '{name}' ({type(mod).__name__}) produces sparse gradients (sparse=True); "
                    "decentpy mixes dense buckets: construct it with sparse=False")

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        if self._world_size == 1:
            return
        src = self._group.to_global(0)
        for t in list(self._model.parameters()) + list(self._model.buffers()):
            dist.broadcast(t.data, src=src, group=self._process_group)

    # -- module interface ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (as ``torch.nn.parallel.DistributedDataParallel.module``)."""
        return self._model

    @property
    def topology(self) -> Topology:
        """The topology, over the ranks of :attr:`process_group` (numbered by group rank)."""
        return self._topology

    @property
    def intra_node(self) -> str:
        """``'gossip'``, ``'shard'`` or ``'allreduce'`` (see the constructor)."""
        return self._intra_node

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group this wrapper gossips in (``None``: the world)."""
        return self._process_group

    @property
    def group_rank(self) -> int:
        """This worker's rank in :attr:`process_group` (the topology's numbering)."""
        return self._rank

    @property
    def outer_steps(self) -> Optional[int]:
        """Outer steps completed with ``local_steps`` / ``sync_every_s`` (None: gossip every step). With
        a time budget, replicas of different speeds take different numbers of iterations per outer
        step: end the training loop on this count (the same on every rank), not on iterations."""
        return self._strategy.exchange.outer_steps

    @property
    def step_count(self) -> int:
        """Iterations completed (the schedule index of the next mix)."""
        return self._strategy.step

    @property
    def buckets(self) -> Tuple[Bucket, ...]:
        """The buckets, in exchange order (read-only view for inspection: each has its parameters,
        flat blocks, optimizer and scheduler; the layout is final after the first iteration)."""
        return tuple(self._settled_buckets())

    def _settled_buckets(self) -> List[Bucket]:
        """The buckets, with the last iteration's outcome applied to their optimizers and schedulers
        (the strategy defers it from the end of the backward; see GossipStrategy.settle)."""
        self._strategy.settle()
        return self._strategy.buckets

    def skip_next_mix(self) -> None:
        """Complete the exchanges in flight and do not average with them: the next iteration's mix
        is the identity. For after giving every worker the same parameters by hand (the values in
        flight would be stale); :meth:`global_avg` does this itself."""
        self._strategy.wait_all()
        self._strategy.mark_equal()

    @property
    def _optims(self) -> List[torch.optim.Optimizer]:
        """The per-bucket optimizers, in bucket order (decent-dp's attribute; supported).

        Each is a real ``torch.optim.Optimizer`` (decentpy's fused ones, or what ``optim_fn``
        returned): ``param_groups``, ``state_dict()`` and ``load_state_dict()`` work as usual. The
        list is final after the first training iteration (which may regroup the buckets; state
        loaded or edited before then is carried over).
        """
        return [b.optimizer for b in self._settled_buckets()]

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        """The per-bucket optimizers, in bucket order (:attr:`_optims`, decent-dp's name): change a
        hyper-parameter in their ``param_groups`` and the next step uses it."""
        return self._optims

    @property
    def state_optimizers(self) -> List[torch.optim.Optimizer]:
        """The optimizers that hold this rank's optimizer state, in bucket order: :attr:`_optims`, or
        with ``intra_node='shard'`` each bucket's shard optimizer (over 1-D pieces of the parameters;
        its hyper-parameters follow :attr:`_optims`, which holds no state then)."""
        return [b.state_optimizer for b in self._settled_buckets()]

    @property
    def _lr_schedulers(self) -> List[Optional[LRScheduler]]:
        """The per-bucket LR schedulers (``None`` entries without ``lr_scheduler_fn``), bucket order."""
        return [b.scheduler for b in self._settled_buckets()]

    def wait(self) -> None:
        """Finish every exchange in flight (e.g. before timing, or before reading the buffers)."""
        self._strategy.wait_all()

    def close(self) -> None:
        """Finish the exchanges in flight, remove the autograd hooks and release decentpy's process
        groups / communicators. The model keeps its (trained) parameters; the wrapper cannot train
        any more. Idempotent; also called by ``with DecentralizedDataParallel(...) as ddp:``."""
        if self._closed:
            return
        self._strategy.wait_all()
        self._driver.remove_hooks()
        groups = [e.group for e in (self._strategy.hook_edges or {}).values()]
        for g in dict.fromkeys(g for g in groups if g is not None):
            dist.destroy_process_group(g)
        self._strategy.hook_edges = None
        self._comm.close()
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self._strategy.close()
        self._closed = True
        if _WRAPPED.get(self.module) is not None and _WRAPPED[self.module]() is self:
            del _WRAPPED[self.module]

    def allow_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Let a torch optimizer of the user's step parameters that this wrapper also steps.

        The wrapper steps every parameter inside ``backward()`` (with the optimizer of its
        ``optim_fn``), so a torch optimizer's ``step()`` over them after the backward -- torch DDP's
        usual loop -- would apply its weight decay and moment updates a second time; it raises a
        RuntimeError naming the parameters instead. Call this for an optimizer that is meant to step
        some of them again (a second optimizer on purpose)."""
        ownership.allow(optimizer)

    def __enter__(self) -> "DecentralizedDataParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        """RuntimeError naming ``what`` after :meth:`close` (its communicator and groups are gone)."""
        if self._closed:
            raise RuntimeError(f"{what}: this DecentralizedDataParallel was closed; wrap the model again to keep "
                               "training (ddp.module still holds it)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("forward")
        # The wrapped model's mode decides (as in decent-dp), so `ddp.module.eval()` works too.
        if self._model.training and torch.is_grad_enabled():
            in_join = Join.notify_join_context(self) is not None  # tells joined ranks to shadow this iteration
            self._driver.arm(in_join=in_join)
        elif torch.is_grad_enabled():
            self._driver.leave_iteration()
        with torch.autograd.profiler.record_function("DecentralizedDataParallel.forward"):
            return self._model(*args, **kwargs)

    def set_accumulate_grad(self, enable: bool = True) -> None:
        """Accumulate gradients without stepping; the first backward after ``False`` steps."""
        self._driver.set_accumulate(enable)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate gradients."""
        with self._driver.accumulating():
            yield

    def set_adaptive_factor(self, factor: float) -> None:
        """Scale the mixing: ``p <- (1 - f) p + f * mix(p)`` (1.0, the default, is plain gossip)."""
        self._strategy.adaptive_factor = check_real("the adaptive factor", factor, 0.0, maximum=1.0)

    def get_lr(self) -> float:
        """Learning rate of the first bucket's first parameter group."""
        b = self._settled_buckets()[0]
        if b.scheduler is not None:
            return float(b.scheduler.get_last_lr()[0])
        return float(b.optimizer.param_groups[0]["lr"])

    # -- uneven inputs (Join) ------------------------------------------------------------------
    def join(self, enable: bool = True, throw_on_early_termination: bool = False,
             global_avg: bool = False) -> Join:
        """A :class:`torch.distributed.algorithms.join.Join` context for this model alone.

        Ranks that run out of data keep serving their neighbours' exchanges (mixing, no local
        step) until every rank has joined; ``global_avg=True`` averages all workers at the end.
        To combine with other joinables, use ``decentpy.Join([ddp, other, ...])``.
        """
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination,
                    global_avg=global_avg)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Hook shadowing one training iteration of the non-joined ranks per call: bucket by bucket,
        wait, mix what arrives and re-send, without a local step; at the end, the exchanges complete
        (and with ``global_avg`` every worker gets the average)."""
        global_avg = bool(kwargs.get("global_avg", False))

        def after() -> None:
            self._strategy.wait_all()
            if global_avg:
                self.global_avg(will_revert=False)

        return DriverJoinHook(self._driver, after=after)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> Any:
        return or_world(self._process_group)

    # -- averaging -----------------------------------------------------------------------------
    def _param_tensors(self) -> List[Tensor]:
        r = self._strategy
        if r.buckets and self._param_as_bucket_view:
            return [b.param_block for b in r.buckets]
        return [p.detach() for p in self._params]

    @torch.no_grad()
    def global_avg(self, will_revert: bool = True, return_d2c: bool = False,
                   sync_buffers: Optional[bool] = None) -> Optional[float]:
        """Give every worker the exact average of all workers' parameters.

        In-flight exchanges are completed first (none is left stale); afterwards the next mix is
        the identity, since all workers are equal. ``will_revert`` keeps a copy so that
        :meth:`revert_global_avg` can continue the decentralized trajectory (e.g. after
        evaluating the averaged model). ``return_d2c`` returns this worker's distance to the
        average. ``sync_buffers`` (default: ``sync_buffer_in_global_avg``) also averages float
        buffers. A collective: call it on every rank.
        """
        self._check_open("global_avg")
        sync = self._sync_buffer_in_global_avg if sync_buffers is None else check_bool("sync_buffers", sync_buffers)
        # (the buffers' all-reduce is part of the collective: a rank with another sync_buffers must not reach it)
        self._arrivals.arrive(f"global_avg(sync_buffers={sync})")
        with self._watch.guarding("global_avg"):
            return self._global_avg(will_revert, return_d2c, sync)

    def _global_avg(self, will_revert: bool, return_d2c: bool, sync_buffers: Optional[bool]) -> Optional[float]:
        r = self._strategy
        r.wait_all()
        tensors = self._param_tensors()
        if will_revert or return_d2c:
            if len(self._backups) != len(tensors):
                self._backups = [t.clone() for t in tensors]
            else:
                torch._foreach_copy_(self._backups, tensors)
            self._skip_mix_before_avg = [b.skip_mix for b in r.buckets]
        average_(tensors, self._world_size, self._process_group)
        if self._sync_buffer_in_global_avg if sync_buffers is None else sync_buffers:
            average_([b for b in self._model.buffers() if b.dtype in self.FLOAT_DTYPES], self._world_size,
                      self._process_group)
        r.mark_equal()
        if return_d2c:
            sq = sum(float(torch.sum((t.double() - b.double()) ** 2)) for t, b in zip(tensors, self._backups))
            return math.sqrt(sq)
        return None

    @torch.no_grad()
    def revert_global_avg(self) -> None:
        """Restore the parameters saved by ``global_avg(will_revert=True)``."""
        self._check_open("revert_global_avg")
        tensors = self._param_tensors()
        if len(self._backups) != len(tensors):
            raise RuntimeError("no backup to revert to: call global_avg(will_revert=True) first")
        torch._foreach_copy_(tensors, self._backups)
        for b, skip in zip(self._strategy.buckets, self._skip_mix_before_avg):
            b.skip_mix = skip

    @torch.no_grad()
    def consensus_distance(self) -> float:
        """Root-mean-square distance of the workers' parameters to their average.

        sqrt(1/n * sum_i ||x_i - mean||^2), the same value on every rank. A collective.
        """
        self._check_open("consensus_distance")
        self._arrivals.arrive("consensus_distance()")
        with self._watch.guarding("consensus_distance"):
            return self._consensus_distance()

    def _consensus_distance(self) -> float:
        self._strategy.wait_all()
        if self._world_size == 1:
            return 0.0
        total = torch.zeros((), dtype=torch.float64)
        for t in self._param_tensors():
            mean = t.to(torch.float64, copy=True)
            dist.all_reduce(mean, group=self._process_group)
            mean.div_(self._world_size)
            total += torch.sum((t.double() - mean) ** 2).cpu()
        total = total.to(self._params[0].device)
        dist.all_reduce(total, group=self._process_group)
        return math.sqrt(float(total) / self._world_size)

    def stats(self) -> Dict[str, float]:
        """This rank's counters, for logging: local, no communication (each rank has its own; average
        or sum them over ranks yourself, docs/howto/metrics.md).

        ``steps``: training iterations completed (:attr:`step_count`); ``bytes_sent``: payload this
        rank's exchanges put on the wire (:attr:`bytes_sent`); ``skipped_steps``: iterations in which
        at least one bucket skipped its update for a non-finite gradient (``nonfinite='skip'`` or a
        GradScaler backing off); ``skipped_bucket_updates``: the bucket updates skipped;
        ``peer_checks``: contributions of peers this rank checked (``peer_check``); ``peer_checks_failed``:
        those that failed, and per faulty peer ``peer_checks_failed_rank<r>`` (global rank ``r``;
        ``peer_checks_failed_unnamed``: a group's sum that did not match its members' fingerprints);
        ``peer_check_cpu_s``: host CPU seconds the check took (its passes and verdicts);
        ``nonfinite_param_checks`` / ``params_taken_from_peer`` when this rank's own parameters were found
        not finite. Reading it applies the last iteration's skip and peer-check verdicts (a device sync
        on a GPU, as :attr:`buckets`). Not here: :meth:`consensus_distance`, a collective every rank
        must call together.
        """
        self._strategy.settle()
        return {"steps": self.step_count, "bytes_sent": self.bytes_sent,
                "skipped_steps": self._strategy.skipped_steps,
                "skipped_bucket_updates": self._strategy.skipped_bucket_updates,
                **self._strategy.peer_check.counters()}

    @property
    def peer_check(self) -> PeerCheck:
        """The peer-check settings (``peer_check=``)."""
        return self._peer_check

    # -- checkpoints ---------------------------------------------------------------------------
    # state_dict() is nn.Module's: the model's keys prefixed "_model." (as decent-dp's), so that
    # evaluation code that strips the prefix loads it into a plain model.

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,  # type: ignore[override]
                        assign: bool = False) -> Any:
        """Load model weights: this wrapper's ``state_dict()`` (keys ``_model.*``), a plain model's,
        or torch DDP's (``module.*``). Values are copied into the bucket storage in place.

        A full training state from :meth:`training_state_dict` (or a checkpoint of decentpy <= 0.1,
        whose ``state_dict()`` returned it) is passed on to :meth:`load_training_state_dict`.
        """
        if _is_training_state(state_dict):
            logger.warning("load_state_dict() got a full decentpy training state; loading it with "
                           "load_training_state_dict() (call that directly to resume training)")
            return self.load_training_state_dict(state_dict, strict=strict)  # type: ignore[arg-type]
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the parameters that live in decentpy's "
                             "buckets; load with assign=False (the default), which copies the values in place")
        self._check_open("load_state_dict")
        prefixed = _with_model_prefix(state_dict, list(nn.Module.state_dict(self, keep_vars=True)))
        _check_model_state(self, prefixed, strict, "the state dict", "load_state_dict")  # all of it loads, or none
        r = self._strategy
        r.wait_all()  # a pair exchange may still be reading the parameter blocks
        with torch.no_grad():
            result = nn.Module.load_state_dict(self, prefixed, strict=strict)
            for b in r.buckets:
                b.gather_params()  # param_as_bucket_view=False: the blocks follow the parameters
        return result

    def training_state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume this worker's exact trajectory.

        Model, per-bucket optimizer and scheduler states, the scaler, the step, the bucket
        layout, and the bucket exchange that is in flight (completed first). Each rank saves
        its own; :meth:`load_training_state_dict` resumes bit for bit.
        """
        state = self._strategy.checkpoint_state()  # completes the exchanges in flight first
        state.update({
            "model": self._model.state_dict(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "topology": self._topology.name,
            "world_size": self._world_size,
            "rank": self._rank,
            "local_world_size": self._local_world_size,
        })
        return state

    @torch.no_grad()
    def load_training_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any:
        """Resume from :meth:`training_state_dict` (this rank's own checkpoint). A collective: every
        rank first checks its state (saved by this rank, at this world size and topology, with
        these settings; its bucket layout, per-bucket entries, model keys and shapes), and a state
        that any rank cannot take raises on every rank -- that rank its own error, the others a
        RuntimeError naming it -- before anything is loaded anywhere.

        A state with ``rebuild_exchange`` set (an elastic re-formation's: another membership, where
        the rank may differ and the world size is the new one) is loaded by this rank alone, without
        the rank and topology checks."""
        if isinstance(state_dict, Mapping) and state_dict.get("rebuild_exchange"):
            self._check_open("load_training_state_dict")
            self._strategy.settle()  # the outgoing trajectory's last iteration, before it is replaced
            self.check_training_state(state_dict, strict)
            return self._load_checked(state_dict, strict)
        return self._resume(lambda: state_dict, strict, "load_training_state_dict")[0]

    def _resume(self, read: Any, strict: bool, what: str) -> Tuple[Any, Dict[str, Any]]:
        """The one collective of a resume: ``read()`` (this rank's state, e.g. a checkpoint file's
        checks) and :meth:`check_training_state` locally, then one agreement carrying whether they
        failed, then the load. Returns the load's result and the state."""
        self._check_open(what)
        self._arrivals.arrive(what)  # a rank resuming alone gets a named error, not a hang
        failure: Optional[BaseException] = None
        state: Dict[str, Any] = {}
        try:
            state = read()
            self._strategy.settle()  # the outgoing trajectory's last iteration, before it is replaced
            self.check_training_state(state, strict)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            failure = exc
        raise_if_any_rank_failed(failure, what, self._process_group)
        return self._load_checked(state, strict), state

    def check_training_state(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Raise (ValueError / KeyError / TypeError naming the mismatch) if this wrapper cannot take
        ``state`` as this rank's training state; loads nothing and communicates nothing. The checks
        of :meth:`load_training_state_dict`, before it changes anything."""
        if not isinstance(state, Mapping):
            raise TypeError(f"a training state is a dict (from training_state_dict()), got {type(state).__name__}")
        if not _is_training_state(state):
            raise KeyError("not a decentpy training state (needs 'model', 'step' and 'buckets'; got keys "
                           f"{sorted(map(str, state))[:8]}); model weights alone load with load_state_dict()")
        if state.get("world_size", self._world_size) != self._world_size:
            raise ValueError(f"checkpoint was saved with world size {state['world_size']}, "
                             f"this run has {self._world_size}")
        r = self._strategy
        r.check_resume(dict(state), self._local_world_size)  # (the node mode's, which says more: a shard's rank)
        if not state.get("rebuild_exchange"):
            saved_rank = state.get("rank", self._rank)
            if saved_rank != self._rank:
                raise ValueError(f"this training state was saved by group rank {saved_rank}, this is group rank "
                                 f"{self._rank}: every rank resumes from its own state (the workers differ)")
            saved_topology = state.get("topology", self._topology.name)
            if saved_topology != self._topology.name:
                raise ValueError(f"this training state was saved with topology {saved_topology!r}, this run has "
                                 f"{self._topology.name!r}: resume with the same topology")
        if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 0:
            raise ValueError(f"the training state's step must be an int >= 0, got {state['step']!r}")
        self._check_bucket_entries(state)
        _check_model_state(self._model, state["model"], strict)
        if self._scaler is not None and state.get("scaler") is not None and not isinstance(state["scaler"], Mapping):
            raise TypeError(f"the training state's scaler entry must be a GradScaler state dict, got "
                            f"{type(state['scaler']).__name__}")

    def _check_bucket_entries(self, state: Mapping[str, Any]) -> None:
        """The saved layout and its per-bucket entries: one each per bucket, in the shapes the load
        takes (a state with ``optimizers=[]`` or a count that does not match would load nothing, or
        part of it, without a word)."""
        saved = state["buckets"]
        n_params = len(self._params)
        keys = ("optimizers", "schedulers", "exchange", "skip_mix")
        for k in keys:
            if not isinstance(state.get(k), (list, tuple)):
                raise ValueError(f"the training state's {k!r} must be a list (one entry per bucket), got "
                                 f"{type(state.get(k)).__name__}")
        if saved is None:  # saved before the first iteration: nothing has stepped, nothing per bucket
            extra = [k for k in keys if len(state[k])]
            if extra:
                raise ValueError(f"the training state has no bucket layout (saved before the first iteration) but "
                                 f"{', '.join(f'{len(state[k])} {k}' for k in extra)}; it is damaged or not decentpy's")
            return
        if not isinstance(saved, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in saved):
            raise ValueError(f"the training state's bucket layout must be a list of lists of parameter indices, got "
                             f"{type(saved).__name__}")
        flat = [i for b in saved for i in b]
        if sorted(flat) != list(range(n_params)) or any(isinstance(i, bool) or not isinstance(i, int) for i in flat):
            raise ValueError(f"the training state's bucket layout covers parameters {sorted(flat)[:12]}..., this model "
                             f"has {n_params} trainable parameters (each must be in one bucket): it is another model's")
        counts = {k: len(state[k]) for k in keys}
        bad = {k: c for k, c in counts.items() if c != len(saved)}
        if bad:
            raise ValueError(f"the training state has {len(saved)} buckets but "
                             f"{', '.join(f'{c} {k}' for k, c in bad.items())}: one entry per bucket is needed "
                             "(it is damaged, or was edited)")
        same_layout = self._strategy.layout.plan is not None and \
            [list(b) for b in self._strategy.layout.plan.buckets] == [list(b) for b in saved]
        whole = self._intra_node != "shard"
        for i, (indices, opt_sd) in enumerate(zip(saved, state["optimizers"])):
            groups = opt_sd.get("param_groups") if isinstance(opt_sd, Mapping) else None
            if not isinstance(groups, (list, tuple)) or not isinstance(opt_sd.get("state"), Mapping) or \
                    not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in groups):
                raise ValueError(f"the training state's optimizer entry for bucket {i} is not an optimizer state dict "
                                 "(needs 'state' and 'param_groups' with 'params')")
            sizes = [len(g["params"]) for g in groups]
            if same_layout:
                mine = [len(g["params"]) for g in self._strategy.buckets[i].state_optimizer.param_groups]
                if sizes != mine:
                    raise ValueError(f"the training state's optimizer for bucket {i} has parameter groups of sizes "
                                     f"{sizes}, this run's has {mine}: another optim_fn or model")
            elif whole and sum(sizes) != len(indices):
                raise ValueError(f"the training state's optimizer for bucket {i} holds {sum(sizes)} parameters, the "
                                 f"bucket has {len(indices)}")
        for i, sch in enumerate(state["schedulers"]):
            if sch is not None and not isinstance(sch, Mapping):
                raise ValueError(f"the training state's scheduler entry for bucket {i} must be a state dict or None, "
                                 f"got {type(sch).__name__}")
        for i, ex in enumerate(state["exchange"]):
            if ex is not None and not isinstance(ex, Tensor):
                raise ValueError(f"the training state's exchange entry for bucket {i} must be a tensor or None, got "
                                 f"{type(ex).__name__}")

    def _load_checked(self, state_dict: Mapping[str, Any], strict: bool) -> Any:
        """Load a state :meth:`check_training_state` accepted (no communication)."""
        r = self._strategy
        r.adopt_layout(state_dict)
        result = self._model.load_state_dict(state_dict["model"], strict=strict)
        r.load_checkpoint_state(state_dict)
        if self._scaler is not None and state_dict.get("scaler") is not None:
            self._scaler.load_state_dict(state_dict["scaler"])
        return result


#: the modules a live wrapper trains (one wrapper per model: a second would hook every parameter twice)
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _check_unwrapped(model: nn.Module) -> None:
    """Refuse, at construction, a model the wrapper cannot train as it is: already wrapped (by this
    wrapper, by torch's DDP, or trained by a live wrapper), or sharded by FSDP2 (DTensor parameters:
    FSDP owns its backward's communication)."""
    if isinstance(model, DecentralizedDataParallel):
        raise TypeError("model is already a DecentralizedDataParallel: wrap the plain module once (ddp.module is "
                        "the one it wraps)")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("model is wrapped by torch's DistributedDataParallel, which all-reduces the gradients "
                        "itself: pass the plain module (model.module) to DecentralizedDataParallel instead")
    live = _WRAPPED.get(model)
    other = live() if live is not None else None
    if other is not None and not other._closed:
        raise ValueError("this model is already trained by a DecentralizedDataParallel that is not closed (two "
                         "wrappers would step every parameter twice per backward): close() the first one, or "
                         "wrap each model once")
    if any(is_dtensor(p) for p in model.parameters()):
        raise TypeError("the model has DTensor parameters (FSDP2's fully_shard, or a DeviceMesh layout): "
                        "DecentralizedDataParallel steps whole parameters inside the backward, which FSDP owns; "
                        "for local steps across FSDP2 replicas use decentpy.DiLoCo(model, inner, outer, "
                        "group=mesh['replicate'].get_group()) (docs/guide/local_sgd.md)")


def _check_model_state(model: nn.Module, saved: Any, strict: bool, what: str = "the training state's model",
                       loader: str = "load_training_state_dict") -> None:
    """``saved`` (model weights) against ``model``: a dict of tensors with this model's keys (all of
    them when ``strict``) and shapes, checked before anything is copied (torch's load_state_dict
    copies the entries that fit before it reports those that do not). ``what`` names ``saved`` and
    ``loader`` the call, in the error."""
    if not isinstance(saved, Mapping):
        raise TypeError(f"{what} must be a state dict, got {type(saved).__name__}")
    mine = model.state_dict()
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    if strict and (missing or unexpected):
        raise KeyError(f"{what} does not match this model: missing keys {missing[:6]}, unexpected keys "
                       f"{unexpected[:6]} ({loader}(..., strict=False) skips them); nothing was loaded")
    for k, v in saved.items():
        if k in mine and isinstance(mine[k], Tensor):
            if not isinstance(v, Tensor):
                raise TypeError(f"{what}: entry {k!r} must be a tensor, got {type(v).__name__}; nothing was loaded")
            if v.shape != mine[k].shape:
                raise ValueError(f"{what}: entry {k!r} has shape {tuple(v.shape)}, this model's "
                                 f"{tuple(mine[k].shape)}: it is another model's; nothing was loaded")


def _model_differs(r: int, a: List[Any], b: List[Any]) -> str:
    k = next((i for i in range(max(len(a), len(b))) if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None)))
    show = lambda v, i: tuple(v[i]) if i < len(v) else None  # noqa: E731
    return (f"the model differs between rank 0 and rank {r}: parameter #{k} is {show(a, k)} on rank 0 but "
            f"{show(b, k)} on rank {r} (name, shape, dtype); every rank must build the same model")


def _hook_differs(r: int, a: bool, b: bool) -> str:
    return (f"optim_fn returns an optimizer {'with' if a else 'without'} pre_average_hook on rank 0 but "
            f"{'with' if b else 'without'} one on rank {r}; every rank must use the same optimizer")


_MODEL_PREFIX = "_model."
_TRAINING_STATE_KEYS = ("model", "step", "buckets")


def _is_training_state(state_dict: Mapping[str, Any]) -> bool:
    return all(k in state_dict for k in _TRAINING_STATE_KEYS)


def _with_model_prefix(state_dict: Mapping[str, Any], expected: List[str]) -> Dict[str, Any]:
    """The keys renamed to this wrapper's (``_model.*``) from any of the usual forms: the wrapper's
    own, a plain model's (no prefix) or torch DDP's (``module.*``) -- whichever matches ``expected``
    best (so a model that has a submodule called ``module`` is not mistaken for a DDP checkpoint)."""
    def renamed(old: str, new: str) -> Dict[str, Any]:
        return {new + k[len(old):] if k.startswith(old) else k: v for k, v in state_dict.items()}

    want = set(expected)
    candidates = [dict(state_dict), renamed("", _MODEL_PREFIX), renamed("module.", _MODEL_PREFIX)]
    return max(candidates, key=lambda c: len(want.intersection(c)))  # first wins a tie



"""``OSS``: optimizer state sharding (ZeRO stage 1), with fairscale's constructor and methods.

Every rank of ``group`` keeps the whole model, but the optimizer state of each parameter lives on
one rank only, its *owner*; large parameters are cut into pieces owned by different ranks
(:mod:`decentpy.sharding.partition`), so each rank holds about ``1/world`` of the state. A step
runs the wrapped optimizer on what this rank owns (whole parameters, and pieces as 1-D views of
the parameters' storage), then every owner broadcasts its update. The trainable parameters are
views of one flat block per dtype and device (packed by the extension, as decentpy's buckets),
in which each owner's elements are one contiguous run: one broadcast per owner, no packing.

Differences from fairscale 0.4.13 (fixes): ``clip_grad_norm`` reduces over ``group`` (fairscale
reduces over the world); ``broadcast_fp16`` halves the bytes while the owner keeps its fp32
values; freezing a parameter never moves optimizer state (the partition counts every parameter
by size); a rank that owns nothing works; state dicts load across world sizes and from/into a
plain torch optimizer; bad input raises on every rank before any collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ..comm import agree_across_ranks, default_timeout, group_ranks, or_world, raise_if_any_rank_failed
from ..comm.failures import start_heartbeat
from ..comm.wire import MalformedMessageError, all_gather_bytes, decode_state, encode_state, gather_bytes
from ..engine.bucket import flatten_params
from ..engine.driver import BoundedWait
from ..optim.kernels import flat_alias
from ..optim import fuse_torch_optimizer
from ..optim.hyperparams import check_hyperparameters
from .partition import MIN_SPLIT_NUMEL, Shard, owner_runs, partition_by_size

__all__ = ["OSS"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatLayout:
    """The trainable parameters of one dtype and device, in the OSS's parameter order, as views of
    one flat block; ``runs``: ``(owner, lo, hi)`` ranges of the block, in block order (one per
    owner, see :func:`~decentpy.sharding.partition.owner_runs`). The optimizer broadcasts each run
    from its owner after a step; :class:`ShardedDataParallel` reduces the gradients of a run to its
    owner from a gradient block of the same layout."""

    params: List[Tensor]
    offsets: List[int]
    shards: List[List[Shard]]
    runs: List[Tuple[int, int, int]]
    block: Tensor
    owned: List[Optional[Tuple[Shard, Tensor]]]  # per parameter: this rank's shard and the tensor it steps


def comm_device(group: Optional[dist.ProcessGroup], fallback: torch.device) -> torch.device:
    """Where small tensors for collectives on ``group`` live (NCCL needs the current GPU)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return fallback if fallback.type == "cpu" else torch.device("cpu")


class OSS(Optimizer, Joinable):
    """Shards the state of ``optim`` over the ranks of ``group`` (fairscale's ``OSS``).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        optim: the optimizer class run on each rank's shard (torch's SGD/Adam/AdamW are replaced by
            decentpy's fused equivalents when their options allow).
        group: the process group to shard over (default: the world).
        broadcast_buffer_size: accepted for compatibility; unused (as in fairscale).
        broadcast_fp16: send the updated parameters in fp16 (half the bytes); owners keep theirs.
        min_split_numel: parameters at least this large (and large next to a rank's share) are split
            into pieces over the ranks (decentpy's extension; see :mod:`decentpy.sharding.partition`).
        **defaults: the optimizer's hyper-parameters (``lr``, ...).

    The shard optimizer sees pieces of split parameters as 1-D tensors: element-wise optimizers
    (SGD, Adam, AdamW, RMSprop, ...) step them exactly as the whole tensor; optimizers that look at
    a whole tensor at once (LAMB/LARS trust ratios, Adafactor's factored moments) need
    ``min_split_numel`` larger than every parameter.
    """

    def __init__(self, params: Any, optim: Type[Optimizer] = torch.optim.SGD, group: Optional[Any] = None,
                 broadcast_buffer_size: int = -1, broadcast_fp16: bool = False,
                 min_split_numel: int = MIN_SPLIT_NUMEL, **defaults: Any) -> None:
        if not (isinstance(optim, type) and issubclass(optim, Optimizer)):
            raise TypeError(f"optim must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), got "
                            f"{optim!r} of type {type(optim).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("OSS needs torch.distributed: call torch.distributed.init_process_group(...) first")
        self._constructed = False
        Optimizer.__init__(self, params, defaults)  # validates: empty list, non-tensors, duplicates
        Joinable.__init__(self)
        self.group = or_world(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global_ranks = group_ranks(self.group)
        self._timeout = default_timeout()
        self.broadcast_fp16 = bool(broadcast_fp16)
        self._optim_class = optim
        self._optim_defaults = defaults
        self._all_states: Optional[Dict[Tuple[int, int], Dict[str, Any]]] = None
        self._min_split = int(min_split_numel)
        self._shards: Dict[int, List[Shard]] = {}   # id(param) -> its shards (one whole, or pieces)
        self._pieces: Dict[Tuple[int, int], Tensor] = {}  # (id(param), start) -> this rank's piece
        self._sliced: Set[Tuple[int, int]] = set()  # pieces whose gradient is a slice of the parameter's
        self._loads = [0] * self.world_size         # elements owned per rank
        self._devices = [p.device for p in self._params()]
        self._layouts: List[FlatLayout] = []        # the trainable parameters' flat blocks
        self._casts: List[Tuple[int, Tensor]] = []   # (owner, the run of a block it broadcasts)
        self._by_id: Dict[int, Tensor] = {}
        if broadcast_buffer_size != -1:
            logger.debug("OSS: broadcast_buffer_size is accepted for compatibility and unused")

        self._agree()
        self._assign_owners(self._params())
        self.optim = self._build_shard_optimizer()
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._constructed = True
        self.refresh_trainable()

    # -- construction -----------------------------------------------------------------------
    def _params(self) -> List[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _check_params_local(self) -> None:
        check_hyperparameters(self, f"OSS({self._optim_class.__name__})")
        for gi, g in enumerate(self.param_groups):
            for i, p in enumerate(g["params"]):
                if p.is_complex():
                    raise ValueError(f"OSS: parameter {i} of param group {gi} has dtype {p.dtype}; OSS optimizes "
                                     "real floating-point parameters (integer and bool ones, which have no "
                                     "gradient, are kept and skipped)")

    def _agree(self) -> None:
        """The construction's one collective: a local failure, or a setting or parameter list that
        differs from group rank 0's, raises on every rank."""
        failure: Optional[BaseException] = None
        try:
            self._check_params_local()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            failure = exc
        params = [(gi, i, tuple(p.shape), str(p.dtype))
                  for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
        settings = {"parameters": params, "optim": self._optim_class, "optimizer defaults": self._optim_defaults,
                    "min_split_numel": self._min_split, "broadcast_fp16": self.broadcast_fp16}
        start_heartbeat()  # so that a dead peer is named in any later failed wait
        agree_across_ranks(failure, settings, "OSS", group=self.group, explain={"parameters": _params_differ})

    def _assign_owners(self, params: Sequence[Tensor]) -> None:
        """Partition ``params`` on top of what the ranks own. Integer and bool parameters (a frozen
        ``LongTensor``, say) can have no gradient: as in a torch optimizer they are kept in the
        groups and never stepped; they get no shard, hence no owner, state or broadcast."""
        for p in params:
            if not p.is_floating_point():
                self._shards[id(p)] = []
        params = [p for p in params if p.is_floating_point()]
        shards = partition_by_size([p.numel() for p in params], self.world_size, self._loads, self._min_split)
        for p, sh in zip(params, shards):
            self._shards[id(p)] = sh
            for s in sh:
                if not s.whole and s.owner == self.rank:
                    self._pieces[(id(p), s.start)] = flat_alias(p.detach()).narrow(0, s.start, s.numel)

    def _owned(self, p: Tensor) -> List[Tensor]:
        """What this rank steps of ``p``: ``[p]`` when it owns it whole, its piece, or nothing."""
        out = []
        for s in self._shards[id(p)]:
            if s.owner == self.rank:
                out.append(p if s.whole else self._pieces[(id(p), s.start)])
        return out

    def _shard_groups(self, groups: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return [dict({k: v for k, v in g.items() if k != "params"},
                     params=[t for p in g["params"] for t in self._owned(p)]) for g in groups]

    def _build_shard_optimizer(self) -> Optimizer:
        failure: Optional[BaseException] = None
        opt: Optional[Optimizer] = None
        try:
            opt = fuse_torch_optimizer(self._optim_class(self._shard_groups(self.param_groups),
                                                         **self._optim_defaults))
        except Exception as exc:  # noqa: BLE001 - raised on every rank just below
            failure = exc
        raise_if_any_rank_failed(failure, f"building {self._optim_class.__name__} on this rank's shard",
                                 group=self.group)
        assert opt is not None
        return opt

    # -- ownership -----------------------------------------------------------------------------
    def shards_of(self, param: Tensor) -> List[Shard]:
        """The shards of ``param``: one whole shard, or one piece per rank."""
        try:
            return list(self._shards[id(param)])
        except KeyError:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not optimized by this OSS") from None

    def owner_of(self, param: Tensor) -> int:
        """The group rank that owns ``param`` (ValueError for a parameter split into pieces)."""
        sh = self.shards_of(param)
        if not sh:
            raise ValueError(f"the parameter of shape {tuple(param.shape)} has dtype {param.dtype}: it has no "
                             "gradient, so no rank owns it (OSS only steps floating-point parameters)")
        if not sh[0].whole:
            raise ValueError(f"the parameter of shape {tuple(param.shape)} is split over all ranks; see shards_of()")
        return sh[0].owner

    def local_tensor(self, param: Tensor, shard: Shard) -> Tensor:
        """The tensor this rank steps for one of its shards: the parameter, or its 1-D piece."""
        if shard.owner != self.rank:
            raise ValueError(f"shard {shard} belongs to group rank {shard.owner}, not {self.rank}")
        return param if shard.whole else self._pieces[(id(param), shard.start)]

    @property
    def local_params(self) -> List[Tensor]:
        """The tensors this rank updates: the parameters it owns whole and its pieces (1-D views) of
        the split ones."""
        return [t for p in self._params() for t in self._owned(p)]

    def partition_parameters(self) -> List[List[Dict[str, Any]]]:
        """Per group rank, its param groups (fairscale's view of the partition); a split parameter
        appears in every rank's groups as that rank's piece (this rank's pieces are the tensors
        it steps; other ranks' are fresh views)."""
        out = []
        for r in range(self.world_size):
            groups = []
            for g in self.param_groups:
                ts = []
                for p in g["params"]:
                    for s in self._shards[id(p)]:
                        if s.owner == r:
                            ts.append(p if s.whole else self._pieces.get((id(p), s.start),
                                                                      flat_alias(p.detach()).narrow(0, s.start, s.numel)))
                groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=ts))
            out.append(groups)
        return out

    # -- the step --------------------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:  # type: ignore[override]
        """Step this rank's shard, then broadcast every owner's updated parameters (a collective)."""
        Join.notify_join_context(self)
        self._check_devices()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._piece_grads_from_params()
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            # The closure may make the gradients (zero_grad, forward, backward): the pieces take
            # their slices after each call, before the shard optimizer reads them.
            def closure_then_pieces() -> Any:
                out = closure()
                self._piece_grads_from_params()
                return out

            loss = self.optim.step(closure=closure_then_pieces, **kwargs)
        self._broadcast_params()
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _piece_grads_from_params(self) -> None:
        """A split parameter with a whole gradient (OSS beside torch DDP, no ShardedDataParallel):
        this rank's piece takes its slice of it (a view). ShardedDataParallel sets the pieces'
        gradients itself and leaves the parameter's ``None``."""
        for key, piece in self._pieces.items():
            p = self._by_id[key[0]]
            if p.grad is not None:
                g = p.grad if p.grad.stride() == p.stride() else torch.empty_like(p).copy_(p.grad)  # p's memory order
                piece.grad = flat_alias(g).narrow(0, key[1], piece.numel())
                self._sliced.add(key)
            elif key in self._sliced:  # the whole gradient went (e.g. module.zero_grad()): so does the slice
                piece.grad = None
                self._sliced.discard(key)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter and of this rank's pieces."""
        super().zero_grad(set_to_none=set_to_none)
        for piece in self._pieces.values():
            if piece.grad is not None:
                if set_to_none:
                    piece.grad = None
                else:
                    piece.grad.zero_()

    def _check_devices(self) -> None:
        for i, (p, d) in enumerate(zip(self._params(), self._devices)):
            if p.device != d:
                raise RuntimeError(f"OSS: parameter {i} moved from {d} to {p.device} after the optimizer was built; "
                                   "move the model before building its optimizer")

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every owner's update to every rank (the same collectives, in the same order, everywhere):
        one broadcast per owner's run of each flat block, no packing."""
        if self.world_size == 1:
            return
        works = []
        staged: List[Tuple[Tensor, Tensor]] = []
        for owner, t in self._casts:
            payload = t
            if self.broadcast_fp16 and t.dtype != torch.float16:
                if owner == self.rank:
                    payload = t.to(torch.float16)
                else:
                    payload = torch.empty_like(t, dtype=torch.float16)
                    staged.append((t, payload))
            works.append((owner, dist.broadcast(payload, src=self._global_ranks[owner], group=self.group,
                                                async_op=True)))
        wait = BoundedWait(self._timeout, self._casts[0][1].device if self._casts else None)
        for owner, w in works:
            wait(w, f"the broadcast of group rank {owner}'s updated parameters")
        for t, payload in staged:
            t.copy_(payload)

    @staticmethod
    def _sync_param_groups(source: List[Dict[str, Any]], destination: List[Dict[str, Any]]) -> None:
        """Hyper-parameters (not params) from ``source`` to ``destination`` groups (LR schedulers
        edit the OSS's groups; the shard optimizer reads its own)."""
        for src, dst in zip(source, destination):
            for k, v in src.items():
                if k != "params":
                    dst[k] = v

    # -- groups and trainability -----------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group; its parameters are partitioned on top of the current ownership
        (nothing moves). A collective when called after construction: call it on every rank."""
        super().add_param_group(param_group)
        if not getattr(self, "_constructed", False):
            return  # Optimizer.__init__ is adding the initial groups
        new = self.param_groups[-1]
        self._devices += [p.device for p in new["params"]]
        self._assign_owners(new["params"])
        self.optim.add_param_group(self._shard_groups([new])[0])
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self.refresh_trainable()

    def refresh_trainable(self) -> None:
        """Rebuild the flat blocks after parameters were frozen or unfrozen (ownership and optimizer
        state stay where they are): the trainable parameters of each dtype and device become views
        of one block, in parameter order, so each owner's elements are one run of it."""
        with torch.no_grad():
            old = {layout.block.untyped_storage().data_ptr() for layout in self._layouts}
            by_key: Dict[Tuple[torch.dtype, torch.device], List[Tensor]] = {}
            for p in self._params():
                if p.requires_grad:
                    by_key.setdefault((p.dtype, p.device), []).append(p)
                elif p.untyped_storage().data_ptr() in old:
                    p.data = p.data.clone()  # frozen now: it must not stay in a block others overwrite
            self._layouts = []
            self._by_id = {id(p): p for p in self._params()}
            for params in by_key.values():
                flat = flatten_params(params, as_views=True)
                shards = [self._shards[id(p)] for p in params]
                owned = [next(((s, self.local_tensor(p, s)) for s in sh if s.owner == self.rank), None)
                         for p, sh in zip(params, shards)]
                self._layouts.append(FlatLayout(params, list(flat.offsets), shards, owner_runs(flat.offsets, shards),
                                                flat.block, owned))
            for (pid, start), piece in self._pieces.items():  # the shard optimizer's tensors follow
                piece.data = flat_alias(self._by_id[pid].detach()).narrow(0, start, piece.numel())
            self._casts = [(owner, layout.block.narrow(0, lo, hi - lo))
                           for layout in self._layouts for owner, lo, hi in layout.runs]

    def flat_layouts(self) -> List[FlatLayout]:
        """The flat blocks of the trainable parameters (rebuilt by :meth:`refresh_trainable`)."""
        return list(self._layouts)

    # -- gradient clipping ---------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       filter_params_fn: Optional[Callable[[Any], Any]] = None) -> Tensor:
        """Clip the whole model's gradient norm (as ``torch.nn.utils.clip_grad_norm_`` on the
        unsharded gradients): each owner contributes its parameters' gradients, the norm is reduced
        over ``group``. Returns the total norm. A collective: call it on every rank."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        self._piece_grads_from_params()
        params = [p for p in self.local_params if p.grad is not None]
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        device = comm_device(self.group, params[0].grad.device if params else torch.device("cpu"))
        if norm_type == float("inf"):
            local = max((g.grad.detach().abs().max().to(device, torch.float32) for g in params),
                        default=torch.zeros((), device=device))
            total = local.clone().reshape(1)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            local = sum((torch.linalg.vector_norm(p.grad.detach(), norm_type, dtype=torch.float32).to(device) ** norm_type
                         for p in params), torch.zeros((), device=device))
            total = local.reshape(1).clone()
            dist.all_reduce(total, group=self.group)
            total = total ** (1.0 / norm_type)
        total = total.reshape(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    # -- state dicts -------------------------------------------------------------------------------
    def _items(self) -> Dict[int, Tuple[int, int]]:
        """id(tensor this rank steps) -> (global parameter index, start of the piece)."""
        out = {}
        for i, p in enumerate(self._params()):
            for s in self._shards[id(p)]:
                if s.owner == self.rank:
                    out[id(p if s.whole else self._pieces[(id(p), s.start)])] = (i, s.start)
        return out

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather every shard's optimizer state on group rank ``recipient_rank`` (-1: on every rank),
        for :meth:`state_dict`. A collective: call it on every rank."""
        if not (recipient_rank == -1 or 0 <= recipient_rank < self.world_size):
            raise ValueError(f"recipient_rank must be -1 or a rank of the group (0..{self.world_size - 1}), "
                             f"got {recipient_rank}")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        items = self._items()
        mine = {items[id(t)]: _to_cpu(st) for t, st in self.optim.state.items() if id(t) in items}
        # plain data (tensors, numbers), decoded with weights_only=True: a peer's bytes never run here
        what = "OSS.consolidate_state_dict: the optimizer state"
        if recipient_rank == -1:
            payloads: Optional[List[bytes]] = all_gather_bytes(encode_state(mine), self.group, what)
        else:
            payloads = gather_bytes(encode_state(mine), recipient_rank, self.group, what)
        if payloads is None:
            self._all_states = None
            return
        merged: Dict[Tuple[int, int], Dict[str, Any]] = {}
        for r, data in enumerate(payloads):
            merged.update(_shard_states(decode_state(data, f"{what} from rank {r}", "cpu"), r, what))
        self._all_states = merged

    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:  # type: ignore[override]
        """The whole optimizer's state in torch's format (loadable by a torch optimizer over the same
        parameters; pieces of split parameters are joined), from the last
        :meth:`consolidate_state_dict` (``all_ranks=True``: consolidate on every rank now, a
        collective)."""
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._all_states is None:
            raise RuntimeError("OSS.state_dict(): the optimizer state is sharded and has not been consolidated on "
                               f"this rank (group rank {self.rank}); call consolidate_state_dict(recipient_rank=...) "
                               "on every rank first, then state_dict() on the recipient")
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        sd = Optimizer.state_dict(self)  # param_groups with global indices; the OSS itself holds no state
        state: Dict[int, Dict[str, Any]] = {}
        for i, p in enumerate(self._params()):
            parts = [(s, self._all_states[(i, s.start)]) for s in self._shards[id(p)] if (i, s.start) in self._all_states]
            if not parts:
                continue
            state[i] = parts[0][1] if parts[0][0].whole else _join_pieces(p, parts)
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Load a consolidated OSS state dict, or a torch optimizer's over the same parameters (saved
        at any world size): this rank keeps the state of what it owns (its slice of split ones)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or "state" not in state_dict:
            raise ValueError("OSS.load_state_dict: not an optimizer state dict (needs 'state' and 'param_groups')")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"OSS.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
                             f"{len(self.param_groups)}; it belongs to another model or optimizer")
        saved_ids: List[Any] = []
        for gi, (g, mine) in enumerate(zip(groups, self.param_groups)):
            if len(g["params"]) != len(mine["params"]):
                raise ValueError(f"OSS.load_state_dict: param group {gi} has {len(g['params'])} parameters in the state "
                                 f"dict but {len(mine['params'])} here; it belongs to another model")
            saved_ids += list(g["params"])
        by_saved = dict(zip(saved_ids, self._params()))
        for key, st in state_dict["state"].items():
            if key not in by_saved:
                raise ValueError(f"OSS.load_state_dict: state for unknown parameter index {key}")
            p = by_saved[key]
            for name, v in st.items():
                if isinstance(v, Tensor) and v.dim() > 0 and v.shape != p.shape:
                    raise ValueError(f"OSS.load_state_dict: state '{name}' of parameter {key} has shape "
                                     f"{tuple(v.shape)} but the parameter has {tuple(p.shape)}; the state dict "
                                     "belongs to another model")
        # This rank's shard, in the shard optimizer's own indexing (the order _shard_groups gives),
        # loaded by its own load_state_dict (which casts the values as that optimizer expects).
        shard_state: Dict[int, Dict[str, Any]] = {}
        shard_groups = []
        n = 0
        for g, mine in zip(groups, self.param_groups):
            idx = []
            for saved, p in zip(g["params"], mine["params"]):
                for s in self._shards[id(p)]:
                    if s.owner != self.rank:
                        continue
                    if saved in state_dict["state"]:
                        st = state_dict["state"][saved]
                        shard_state[n] = st if s.whole else _piece_of(st, p, s)
                    idx.append(n)
                    n += 1
            shard_groups.append(dict({k: v for k, v in g.items() if k != "params"}, params=idx))
        for g, mine in zip(groups, self.param_groups):
            mine.update({k: v for k, v in g.items() if k != "params"})
        self.optim.load_state_dict({"state": shard_state, "param_groups": shard_groups})
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._all_states = None

    # -- Join ----------------------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A joined rank keeps stepping its shard (with the gradients the others reduce to it) and
        broadcasting it, so the ranks still training get every owner's update."""
        return _OSSJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        params = self._params()
        return comm_device(self.group, params[0].device if params else torch.device("cpu"))

    @property
    def join_process_group(self) -> Any:
        return self.group


class _OSSJoinHook(JoinHook):
    def __init__(self, oss: OSS) -> None:
        self.oss = oss

    def main_hook(self) -> None:
        o = self.oss
        o._sync_param_groups(o.param_groups, o.optim.param_groups)
        o.optim.step()
        o._broadcast_params()


def _join_pieces(p: Tensor, parts: List[Tuple[Shard, Dict[str, Any]]]) -> Dict[str, Any]:
    """One parameter's state from its pieces' states: per-element tensors joined in memory order
    into the parameter's shape (and layout); anything else (the step count) from the first piece."""
    out: Dict[str, Any] = {}
    for name, v in parts[0][1].items():
        if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == parts[0][0].numel:
            full = torch.empty_like(p, dtype=v.dtype, device="cpu")
            flat = flat_alias(full)
            for s, st in parts:
                flat.narrow(0, s.start, s.numel).copy_(st[name])
            out[name] = full
        else:
            out[name] = v
    return out


def _piece_of(st: Dict[str, Any], p: Tensor, s: Shard) -> Dict[str, Any]:
    """The state of one piece from a whole parameter's state (per-element tensors sliced in memory
    order; scalars such as the step count kept)."""
    out: Dict[str, Any] = {}
    for name, v in st.items():
        if isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape:
            laid_out = torch.empty_like(p, dtype=v.dtype, device=v.device).copy_(v)  # p's memory order
            out[name] = flat_alias(laid_out).narrow(0, s.start, s.numel).clone()
        else:
            out[name] = v
    return out


def _shard_states(shard: Any, rank: int, what: str) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """One rank's consolidated states as sent, checked for shape: ``{(parameter index, start): state
    dict}`` (a malformed one is named with its sender, never merged)."""
    ok = isinstance(shard, dict) and all(
        isinstance(k, tuple) and len(k) == 2 and all(isinstance(x, int) for x in k) and isinstance(v, dict)
        for k, v in shard.items())
    if not ok:
        raise MalformedMessageError(f"{what} from rank {rank}: not a map of (parameter index, start) to a state "
                                    f"dict ({type(shard).__name__})")
    return shard


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _params_differ(r: int, a: List[Any], b: List[Any]) -> str:
    k = next(i for i in range(max(len(a), len(b))) if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None))
    show = lambda v: (v[k][0], v[k][1], tuple(v[k][2]), v[k][3]) if k < len(v) else None  # noqa: E731
    return (f"OSS: the parameters differ between group rank 0 and group rank {r}: item #{k} is {show(a)} on rank 0 "
            f"but {show(b)} on rank {r} (param group, index, shape, dtype); every rank must optimize the same "
            "parameters")

"""FSDP2's sharded parameters (DTensors) seen by local steps: each rank works on its local shard.

A replica whose model is sharded with ``torch.distributed.fsdp.fully_shard`` holds every parameter
as a DTensor whose local tensor is this rank's shard. :class:`decentpy.DiLoCo` runs its outer step on
those local shards against the same shard of the other replicas (its ``group`` holds the ranks of one
shard index: ``mesh["replicate"]``), so nothing is all-gathered: the local tensor is the storage the
inner optimizer steps, and the outer step writes it in place. What crosses a torch API that wants the
DTensor (the outer optimizer's ``.grad``, its state in a checkpoint) is wrapped or unwrapped here.
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["is_dtensor", "local_shard", "like_param", "shard_layout", "local_state", "restore_state", "RankState"]

try:  # (torch.distributed may be absent from a build)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_shard(t: Tensor) -> Tensor:
    """This rank's storage of ``t``: a DTensor's local tensor (the same memory, no copy), else ``t``."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def like_param(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (this rank's shard of a tensor shaped as ``param``) as ``param`` is laid out: a
    DTensor on its mesh and placements when ``param`` is one, else ``local`` itself."""
    if not is_dtensor(param):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def shard_layout(params: Sequence[Tensor]) -> List[Optional[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]]:
    """Per parameter, which shard this rank holds (None: a plain tensor): the placements, the rank's
    coordinate on the parameter's mesh and the local shape. The replicas of a local-steps group must
    hold the same shards (each exchange pairs a shard with itself)."""
    out: List[Optional[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]] = []
    for p in params:
        if not is_dtensor(p):
            out.append(None)
            continue
        coordinate = p.device_mesh.get_coordinate()
        out.append((str(tuple(p.placements)), tuple(coordinate or ()), tuple(local_shard(p).shape)))
    return out


def local_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer's ``state_dict()`` with its DTensor states as their local shards (a per-rank
    checkpoint; :func:`restore_state` undoes it)."""
    return {**state, "state": {k: {n: local_shard(v) for n, v in s.items()} for k, s in state["state"].items()}}


def restore_state(state: Dict[str, Any], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """:func:`local_state`'s dict with each local state laid out again as its parameter (a DTensor
    where the parameter is one), for ``optimizer.load_state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out: Dict[Any, Dict[str, Any]] = {}
    for k, s in state["state"].items():
        p = params[int(k)] if int(k) < len(params) else None
        out[k] = {n: (like_param(v, p) if p is not None and isinstance(v, Tensor) and v.dim() > 0 else v)
                  for n, v in s.items()}
    return {**state, "state": out}


class _HasState(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


class RankState:
    """A ``torch.distributed.checkpoint`` item (it is ``Stateful``) holding one object's state per
    rank: what differs between ranks and has no global layout -- this rank's shard of the global
    copies, the flat buffers of its exchanges, its replica's error feedback -- under a key named by
    the global rank, as one serialized blob (DCP saves a plain tensor found under one key on many
    ranks once, and loads only the tensors its template already holds). A resume needs the same
    world and mesh. Loading reads tensors and plain containers only (``weights_only``).

    Example: ``dcp.save({"model": ..., "optim": ..., "diloco": RankState(diloco)}, ...)`` and the same
    dict for ``dcp.load``."""

    def __init__(self, obj: _HasState, rank: Optional[int] = None) -> None:
        import torch.distributed as dist

        self.obj = obj
        self.key = f"rank{dist.get_rank() if rank is None else rank}"

    def state_dict(self) -> Dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.obj.state_dict(), buf)
        return {self.key: buf.getvalue()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        blob = state.get(self.key)
        if not isinstance(blob, (bytes, bytearray)) or not blob:
            raise ValueError(f"the checkpoint holds no state for {self.key} (saved by a world of other ranks?); "
                             f"it has {sorted(state)}")
        self.obj.load_state_dict(torch.load(io.BytesIO(bytes(blob)), weights_only=True))

"""Which communicator a wrapper uses: ``comm='auto' | 'torch' | 'nccl'``, decided the same on
every rank. :func:`select_communicator` is also the one call that (re)builds the communicators for
a set of members: a topology over the group's ranks, a group, a timeout."""

from __future__ import annotations

import datetime
import logging
from typing import List, Optional, Tuple

import torch.distributed as dist

from ..topology import Topology
from .agreement import everyone
from .failures import DEFAULT_LIVENESS_TIMEOUT
from .groups import CommGroup
from .nccl import DeviceLike, NcclCommunicator, nccl_unavailable_reason
from .torch_comm import TorchCommunicator

__all__ = ["COMM_CHOICES", "check_comm", "resolve_comm", "select_communicator"]

logger = logging.getLogger(__name__)

COMM_CHOICES = ("auto", "torch", "nccl")


def check_comm(comm: str) -> None:
    """ValueError naming ``comm`` and the valid choices, unless it is one of :data:`COMM_CHOICES`."""
    if comm not in COMM_CHOICES:
        raise ValueError(f"comm must be one of {', '.join(repr(c) for c in COMM_CHOICES)}, got {comm!r}")


def resolve_comm(comm: str, device: DeviceLike = None, group: Optional[CommGroup] = None) -> Tuple[str, str]:
    """This rank's choice for ``comm`` ('auto' | 'torch' | 'nccl'): ``(kind, reason)`` with kind
    'nccl' or 'torch'. Raises ``ValueError`` for another value and ``RuntimeError`` (with the
    reason) when 'nccl' is asked for but unavailable. Local: see :func:`select_communicator` for
    the decision every rank agrees on."""
    check_comm(comm)
    if comm == "torch":
        return "torch", "comm='torch' (torch.distributed)"
    why = nccl_unavailable_reason(device)
    if comm == "nccl":
        if why is not None:
            raise RuntimeError(f"comm='nccl': decentpy's NCCL communicator is not available: {why}")
        return "nccl", "comm='nccl'"
    pg = group.process_group if group is not None else None
    backend = dist.get_backend(pg) if dist.is_initialized() else None
    if backend != dist.Backend.NCCL:
        return "torch", (f"comm='auto': the process group's backend is {backend!r}, not 'nccl'")
    if why is not None:
        return "torch", f"comm='auto': decentpy's NCCL communicator is not available: {why}"
    return "nccl", "comm='auto': the process group's backend is 'nccl' and decentpy has NCCL support"


def select_communicator(comm: str, topology: Topology, timeout: datetime.timedelta,
                        device: DeviceLike = None, group: Optional[CommGroup] = None,
                        liveness: Optional[datetime.timedelta] = DEFAULT_LIVENESS_TIMEOUT,
                        needs: Optional[Tuple[bool, List[Tuple[int, ...]]]] = None):
    """The communicator for ``comm='auto' | 'torch' | 'nccl'`` (collective over ``group``, default:
    the world; the topology numbers the ranks of that group).

    * 'torch': :class:`~decentpy.comm.TorchCommunicator` (any backend).
    * 'nccl': :class:`NcclCommunicator`; ``RuntimeError`` naming the reason (and the rank) when it
      is unavailable on any rank.
    * 'auto': NCCL when the default group's backend is NCCL, the extension has NCCL support, torch
      has CUDA and ``device`` (the tensors' device, when given) is a CUDA device -- on every rank;
      otherwise torch.distributed.

    ``liveness``: a peer without a heartbeat this long is unreachable (torch.distributed exchanges;
    None disables the heartbeats; see :mod:`decentpy.comm.failures`).

    ``needs``: what the strategy exchanges, ``(point to point, collective groups)``, when it is
    not what the topology's plans use (the torch communicator only; NCCL refuses it).

    The returned communicator's ``selection_reason`` says why it was chosen.
    """
    check_comm(comm)
    if needs is not None and comm != "torch":
        raise ValueError(f"custom communication needs work with comm='torch' only, got comm={comm!r}")
    if comm == "torch":
        chosen = TorchCommunicator(topology, timeout, group=group, liveness=liveness, needs=needs)
        chosen.selection_reason = "comm='torch' (torch.distributed)"  # type: ignore[attr-defined]
        return chosen
    group = group if group is not None else CommGroup()
    try:
        kind, reason = resolve_comm(comm, device, group)
    except RuntimeError as exc:
        kind, reason = "error", str(exc)
    if comm == "nccl" or dist.get_backend(group.process_group) == dist.Backend.NCCL:
        # Same choice on every rank (a build or library difference must not split the job).
        answers = everyone((kind == "nccl", reason), group.process_group)
        bad = [(r, why) for r, (ok, why) in enumerate(answers) if not ok]
        if bad and kind == "nccl":
            r, why = bad[0]
            if comm == "nccl":
                raise RuntimeError(f"comm='nccl': decentpy's NCCL communicator is not available on rank {r}: {why}")
            kind, reason = "torch", f"comm='auto': NCCL is not available on rank {r}: {why}"
        elif bad and comm == "nccl":
            raise RuntimeError(reason)
    if kind == "nccl":
        chosen = NcclCommunicator(topology, timeout, device=device, group=group)
    else:
        chosen = TorchCommunicator(topology, timeout, group=group, liveness=liveness)
    chosen.selection_reason = reason  # type: ignore[attr-defined]
    logger.debug("rank %d: decentpy exchanges over %s (%s)", dist.get_rank(),
                "decentpy's NCCL communicator" if kind == "nccl" else "torch.distributed", reason)
    return chosen

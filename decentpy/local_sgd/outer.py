"""DiLoCo's face of the outer step: a fragment's parameters over the shared outer exchange.

A fragment is a set of the model's parameters with a *global copy* ``theta`` (the parameters as of
the last outer step, kept on ``backup_device``) and an outer optimizer. Its parameters travel as one
flat buffer per dtype and device, each a :class:`decentpy.local_steps.exchange.OuterBuffer` -- the
outer exchange both faces of local steps share (the pseudo-gradient ``delta = theta - x``, DiLoCo's
sign; the exact mean on ``complete``, a gossip mix of ``[theta; delta]`` elsewhere; compressed with
error feedback or by compressed gossip; weighted under a time budget) -- and the outer step, the
outer optimizer over the model's own parameters stepping from the (mixed) global copy, then the
reset of the parameters to the new global copy or Streaming DiLoCo's merge.

:class:`TopologyMixer` is this face's :class:`~decentpy.local_steps.exchange.OuterLink`: its own
communicator over the group (the engine's face uses its strategy's).
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm import CommGroup, select_communicator
from ..comm.group_exchange import GroupExchanger
from ..comm.plans import BufferMix, ExchangeSchedule
from ..local_steps.exchange import OuterBuffer, OuterLink, outer_needs, split
from ..local_steps.sparse import SparseOuter
from ..optim.compression import Compression
from ..optim.shards import local_shard, local_state, restore_state
from ..topology import Topology

__all__ = ["TopologyMixer", "Fragment"]


class TopologyMixer(OuterLink):
    """The outer exchanges' link of :class:`decentpy.DiLoCo` and :class:`decentpy.LocalSGD`: the
    topology's schedule over ``group`` and a communicator of its own (a collective set-up over
    ``group`` at construction: the communicator's sub-groups)."""

    def __init__(self, topology: Topology, group: CommGroup, timeout: datetime.timedelta, comm: str = "torch",
                 device: Optional[torch.device] = None, compression: Optional[Compression] = None,
                 replicas_equal: bool = True, sparse: Optional[SparseOuter] = None) -> None:
        communicator = select_communicator(comm, topology, timeout, device=device, group=group,
                                           needs=outer_needs(topology, compression, sparse))
        super().__init__(ExchangeSchedule(topology, group.rank), communicator, GroupExchanger(), topology,
                         group.rank, timeout, compression, replicas_equal, sparse)

    def launch(self, step: int, tag: int, buf: Tensor) -> BufferMix:
        """Start mixing ``buf`` with this rank's group at outer step ``step`` (LocalSGD's average of
        the parameters themselves)."""
        return BufferMix(self.plan(step), self.comm, tag, buf, self.timeout)

    def close(self) -> None:
        self.exchanger.close()
        self.comm.close()


class Fragment:
    """One fragment's outer state and step (see the module): its parameters, grouped by dtype and
    device (one exchange buffer each), the global copy and the outer optimizer."""

    def __init__(self, index: int, params: Sequence[Tensor], outer_optimizer: Optional[Optimizer],
                 backup_device: Optional[torch.device], pin_memory: bool, alpha: float,
                 link: Optional[OuterLink] = None, weighted: bool = False, pull: Optional[float] = None) -> None:
        self.index = index
        #: NoLoCo's pull towards the group's global copies (None: start from the mixed copy)
        self.pull = pull
        #: the parameters the optimizers hold (FSDP2: DTensors) and this rank's storage of each (their
        #: local shards: what is packed, exchanged and reset; no all-gather)
        self.stepped = list(params)
        self.params = [local_shard(p) for p in self.stepped]
        self.outer = outer_optimizer
        self.alpha = float(alpha)
        groups: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i, p in enumerate(self.params):
            groups.setdefault((p.dtype, p.device), []).append(i)
        #: parameter indices per exchange buffer (one dtype and device each)
        self.groups: List[List[int]] = list(groups.values())
        pin = pin_memory and torch.cuda.is_available()
        self.backup: List[Tensor] = []
        for p in self.params:
            dev = backup_device if backup_device is not None else torch.device("cpu")
            t = torch.empty(p.shape, dtype=p.dtype, device=dev)
            self.backup.append(t.pin_memory() if pin and t.device.type == "cpu" else t)
        self._link = link
        #: the outer exchange of each buffer (the shared one: decentpy.local_steps.exchange)
        self.buffers: List[OuterBuffer] = [] if link is None else [
            OuterBuffer(link, sum(self.params[i].numel() for i in idx), self.params[idx[0]].device, weighted)
            for idx in self.groups]

    @torch.no_grad()
    def save(self) -> None:
        """The parameters become the global copy."""
        for b, p in zip(self.backup, self.params):
            b.copy_(p.detach())

    @property
    def in_flight(self) -> bool:
        return any(b.pending is not None for b in self.buffers)

    def _working(self, idx: List[int]) -> torch.dtype:
        """The dtype a buffer's exchange runs in: float32, or float64 for float64 parameters."""
        return torch.float64 if self.params[idx[0]].dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def prepare(self, step: int, tag: int, send_globals: bool, weight: Optional[float] = None) -> None:
        """The pseudo-gradient of the inner steps so far, and its exchange (started, not awaited).
        ``weight``: this replica's inner steps behind it (a time budget: the group's pseudo-gradients
        are averaged weighted by them)."""
        if self.in_flight:
            raise RuntimeError(f"internal error: fragment {self.index} prepared twice")
        link = self._link
        assert link is not None, "internal error: LocalSGD's fragment has no outer exchange"
        weight_mix = None
        if weight is not None and link.compression is not None:  # the weights mixed apart, uncompressed
            weight_mix = link.weight_mix(step, weight, self.params[0].device)
        for k, idx in enumerate(self.groups):
            dev = self.params[idx[0]].device
            x = torch.cat([self.params[i].detach().reshape(-1) for i in idx])
            theta = torch.cat([self.backup[i].to(device=dev, dtype=self._working(idx)).reshape(-1) for i in idx])
            self.buffers[k].launch(x, theta, step, tag + k, send_globals=send_globals, weight=weight,
                                   weight_mix=weight_mix, step=step)

    @torch.no_grad()
    def perform(self) -> None:
        """The outer step with the mixed buffers (waits for them): the optimizer steps the (mixed)
        global copy with the mixed pseudo-gradient, which becomes the global copy, and the parameters
        restart from it or merge with it (:func:`decentpy.optim.outer.outer_step`, the one outer step)."""
        assert self.outer is not None
        for idx, buf in zip(self.groups, self.buffers):
            buf.apply(self.outer, [self.params[i] for i in idx], [self.backup[i] for i in idx], alpha=self.alpha,
                      pull=self.pull, stepped=[self.stepped[i] for i in idx])

    @torch.no_grad()
    def average_params(self, mixer: TopologyMixer, step: int, tag: int) -> None:
        """LocalSGD's outer step: the parameters themselves mixed with the group (no global copy)."""
        works = [(idx, mixer.launch(step, tag + k, torch.cat([self.params[i].detach().reshape(-1) for i in idx])))
                 for k, idx in enumerate(self.groups)]
        for idx, m in works:
            for i, t in zip(idx, split(m.wait(), [self.params[i] for i in idx])):
                self.params[i].copy_(t)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """The global copy, the outer optimizer's state and an exchange in flight (its result: waited
        for, so that a resume applies the same outer step at the same inner step)."""
        states = [b.state_dict(settled=True) for b in self.buffers]
        return {"backup": [b.clone() for b in self.backup],
                "outer_optimizer": local_state(self.outer.state_dict()) if self.outer is not None else None,
                "in_flight": [st["in_flight"] for st in states] if self.in_flight else None,
                "excess": [st["excess"] for st in states], "copies": [st["copies"] for st in states],
                **({"error": [st["error"] for st in states]} if any("error" in st for st in states) else {})}

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, object]) -> None:
        backup = state["backup"]
        assert isinstance(backup, list)
        if len(backup) != len(self.backup) or any(a.shape != b.shape for a, b in zip(backup, self.backup)):
            raise ValueError(f"fragment {self.index}: the checkpoint's global copy has shapes "
                             f"{[tuple(b.shape) for b in backup]}, this fragment's parameters "
                             f"{[tuple(b.shape) for b in self.backup]}")
        for b, s in zip(self.backup, backup):
            b.copy_(s)
        if self.outer is not None and state.get("outer_optimizer") is not None:
            self.outer.load_state_dict(restore_state(state["outer_optimizer"], self.outer))  # type: ignore[arg-type]
        flights = state.get("in_flight") or [None] * len(self.buffers)
        excess = state.get("excess") or [None] * len(self.buffers)
        copies = state.get("copies") or [None] * len(self.buffers)
        errors = state.get("error") or [None] * len(self.buffers)
        for k, buf in enumerate(self.buffers):
            saved = {"excess": excess[k], "in_flight": flights[k], "copies": copies[k],  # type: ignore[index]
                     "error": errors[k]}  # type: ignore[index]
            if saved["excess"] is None and buf.excess is not None:
                saved["excess"] = torch.zeros_like(buf.excess)  # (saved before its first compressed exchange)
            # (copies never saved: the checkpoint precedes the first compressed gossip exchange; they
            # start afresh from the global copy at the next one)
            buf.load_state_dict(saved, copies=saved["copies"] is not None, what=f"fragment {self.index}: ")

"""The outer step of local-steps training (DiLoCo, LocalSGD), one fragment at a time.

A fragment is a set of the model's parameters with a *global copy* ``theta`` (the parameters as of
the last outer step, kept on ``backup_device``) and an outer optimizer. After ``H`` inner steps the
replica's pseudo-gradient is ``delta = theta - x`` (DiLoCo's sign: the outer optimizer *descends*
it). The outer exchange mixes it with the group that the topology names for this outer step,
through the same exchange plans as every-step gossip (:mod:`decentpy.comm.plans`):

- ``complete`` (one group of every rank, weight ``1/n``): ``delta`` is averaged, ``theta`` is the
  same on every rank (broadcast at the start, and every rank applies the same update) and is not
  sent -- DiLoCo exactly, one buffer of the fragment's size per outer step;
- any other topology (gossip outer step): ``[theta; delta]`` is mixed as one buffer, so each replica
  steps from the mixed global copy with the mixed pseudo-gradient. The mixing matrices are doubly
  stochastic, so the replicas' mean global copy follows DiLoCo's update with the mean
  pseudo-gradient (for momentum optimizers too: the outer update is linear in its gradient).

Then the outer step: the parameters are set to the (mixed) global copy, their ``.grad`` to the
(mixed) pseudo-gradient, the outer optimizer steps (any torch optimizer; Nesterov SGD in DiLoCo),
the result becomes the new global copy, and with ``fragment_update_alpha`` the local parameters
of the inner steps that ran during the exchange are merged back (Streaming DiLoCo).
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm import CommGroup, select_communicator
from ..comm.plans import BufferMix, ExchangeSchedule
from ..topology import Topology

__all__ = ["TopologyMixer", "Fragment"]


class TopologyMixer:
    """Mixes flat buffers with the topology's group of an outer step (a collective set-up over
    ``group`` at construction: the communicator's sub-groups)."""

    def __init__(self, topology: Topology, group: CommGroup, timeout: datetime.timedelta, comm: str = "torch",
                 device: Optional[torch.device] = None) -> None:
        self.topology = topology
        self.rank = group.rank
        self.timeout = timeout
        self.schedule = ExchangeSchedule(topology, group.rank)
        self.comm = select_communicator(comm, topology, timeout, device=device, group=group)
        self.complete = topology.is_exact_average()

    def launch(self, step: int, tag: int, buf: Tensor) -> BufferMix:
        """Start mixing ``buf`` with this rank's group at outer step ``step`` (``tag``: one per buffer
        in flight at once)."""
        return BufferMix(self.schedule.at(step), self.comm, tag, buf, self.timeout)

    def close(self) -> None:
        self.comm.close()


def _split(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out


class Fragment:
    """One fragment's outer state and step (see the module): its parameters, grouped by dtype and
    device (one exchange buffer each), the global copy and the outer optimizer."""

    def __init__(self, index: int, params: Sequence[Tensor], outer_optimizer: Optional[Optimizer],
                 backup_device: Optional[torch.device], pin_memory: bool, alpha: float) -> None:
        self.index = index
        self.params = list(params)
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
        self._pending: List[BufferMix] = []
        self._weighted = False  # the exchange in flight carries weighted pseudo-gradients
        self._mixed: Optional[List[Tensor]] = None  # results read back by state_dict (an exchange in flight)

    @torch.no_grad()
    def save(self) -> None:
        """The parameters become the global copy."""
        for b, p in zip(self.backup, self.params):
            b.copy_(p.detach())

    @property
    def in_flight(self) -> bool:
        return bool(self._pending) or self._mixed is not None

    @torch.no_grad()
    def prepare(self, mixer: TopologyMixer, step: int, tag: int, send_globals: bool,
                weight: Optional[float] = None) -> None:
        """The pseudo-gradient of the inner steps so far, and its exchange (started, not awaited).
        ``weight``: the pseudo-gradient is mixed as ``sum w_j delta_j / sum w_j`` over the group (the
        weights travel as one more element of the buffer)."""
        if self.in_flight:
            raise RuntimeError(f"internal error: fragment {self.index} prepared twice")
        self._weighted = weight is not None
        for k, idx in enumerate(self.groups):
            parts = []
            if send_globals:
                parts += [self.backup[i].to(self.params[i].device).reshape(-1) for i in idx]
            deltas = [(self.backup[i].to(self.params[i].device) - self.params[i].detach()).reshape(-1) for i in idx]
            if weight is not None:
                deltas = [d * weight for d in deltas]
                deltas.append(torch.full((1,), weight, dtype=deltas[0].dtype, device=deltas[0].device))
            parts += deltas
            self._pending.append(mixer.launch(step, tag + k, torch.cat(parts)))

    def wait(self) -> List[Tensor]:
        """The mixed buffers of :meth:`prepare` (waits for the exchange)."""
        if self._mixed is None:
            self._mixed = [m.wait() for m in self._pending]
            self._pending = []
        return self._mixed

    @torch.no_grad()
    def perform(self, send_globals: bool) -> None:
        """The outer step with the mixed buffers (waits for them): restore, step, save, merge."""
        mixed = self.wait()
        self._mixed = None
        local = [p.detach().clone() for p in self.params] if self.alpha > 0.0 else None
        grads: List[Optional[Tensor]] = [None] * len(self.params)
        for idx, flat in zip(self.groups, mixed):
            sub = [self.params[i] for i in idx]
            n = sum(p.numel() for p in sub)
            if self._weighted:  # sum w_j delta_j / sum w_j (no inner step anywhere in the group: no move)
                total = flat[-1]
                flat = flat[:-1]
                body = flat[n:] if send_globals else flat
                body.div_(total.clamp(min=torch.finfo(body.dtype).tiny))  # (no host sync; all weights 0: all deltas 0)
            if send_globals:
                theta, delta = _split(flat[:n], sub), _split(flat[n:], sub)
            else:
                theta, delta = [self.backup[i].to(self.params[i].device) for i in idx], _split(flat, sub)
            for i, t, d in zip(idx, theta, delta):
                self.params[i].copy_(t)
                grads[i] = d
        self._outer_step(grads)
        self.save()
        if local is not None:
            for p, x in zip(self.params, local):
                p.lerp_(x, self.alpha)

    def _outer_step(self, grads: List[Optional[Tensor]]) -> None:
        """``outer.step()`` with the fragment's parameters' ``.grad`` set to ``grads``; the optimizer's
        other parameters (another fragment's, a shared outer optimizer) see no gradient, so it leaves
        them as they are, and get theirs back."""
        assert self.outer is not None
        mine = {id(p) for p in self.params}
        stash = []
        for group in self.outer.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    stash.append((p, p.grad))
                    p.grad = None
        try:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.outer.step()
        finally:
            for p in self.params:
                p.grad = None
            for p, g in stash:
                p.grad = g

    @torch.no_grad()
    def average_params(self, mixer: TopologyMixer, step: int, tag: int) -> None:
        """LocalSGD's outer step: the parameters themselves mixed with the group (no global copy)."""
        works = [(idx, mixer.launch(step, tag + k, torch.cat([self.params[i].detach().reshape(-1) for i in idx])))
                 for k, idx in enumerate(self.groups)]
        for idx, m in works:
            for i, t in zip(idx, _split(m.wait(), [self.params[i] for i in idx])):
                self.params[i].copy_(t)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """The global copy, the outer optimizer's state and an exchange in flight (its result: waited
        for, so that a resume applies the same mix at the same step)."""
        mixed = [m.clone() for m in self.wait()] if self.in_flight else None
        return {"backup": [b.clone() for b in self.backup],
                "outer_optimizer": self.outer.state_dict() if self.outer is not None else None,
                "in_flight": mixed}

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
            self.outer.load_state_dict(state["outer_optimizer"])  # type: ignore[arg-type]
        mixed = state.get("in_flight")
        self._pending = []
        self._mixed = [m.clone() for m in mixed] if mixed is not None else None  # type: ignore[union-attr]

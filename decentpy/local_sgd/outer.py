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

With ``compression``: on ``complete`` the error-fed pseudo-gradient's compressed mean
(:class:`CompressedMean`); on another topology the buffer ``[theta; delta]`` mixed by compressed
gossip against public copies (:class:`decentpy.comm.compressed_mix.CompressedMix`), which keeps the
replicas' mean as the uncompressed mix does.

Then the outer step, :func:`decentpy.optim.outer.outer_step` (the engine's ``local_steps=`` runs the
same function): the outer optimizer steps the (mixed) global copy with the (mixed) pseudo-gradient
(any torch optimizer; Nesterov SGD in DiLoCo; torch's SGD / Adam / AdamW over float32 parameters
whose global copy sits on their device run as one fused kernel pass), the result becomes the new
global copy, and with ``fragment_update_alpha`` the local parameters of the inner steps that ran
during the exchange are merged back (Streaming DiLoCo).
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..comm import CommGroup, select_communicator
from ..comm.compressed_mix import CompressedMix, GossipCopies
from ..comm.group_exchange import GroupExchange, GroupExchanger, compressed_needs, start_compressed_mean
from ..comm.plans import BufferMix, ExchangeSchedule, communication_needs, unweigh, weigh, weight_mix
from ..optim import kernels
from ..optim.compression import Compression
from ..optim.outer import outer_step, pseudo_gradient
from ..topology import Topology

__all__ = ["TopologyMixer", "CompressedMean", "Fragment"]


class TopologyMixer:
    """Mixes flat buffers with the topology's group of an outer step (a collective set-up over
    ``group`` at construction: the communicator's sub-groups)."""

    def __init__(self, topology: Topology, group: CommGroup, timeout: datetime.timedelta, comm: str = "torch",
                 device: Optional[torch.device] = None, compression: Optional[Compression] = None,
                 replicas_equal: bool = True) -> None:
        self.topology = topology
        #: every replica started from the same parameters (compressed gossip's public copies start from them)
        self.replicas_equal = replicas_equal
        self.rank = group.rank
        self.timeout = timeout
        self.schedule = ExchangeSchedule(topology, group.rank)
        self.compression = compression
        # a compressed exchange runs point to point (the two rounds of the group exchange); a time
        # budget's weights mix through the plans (pairs, all-reduces)
        needs = None if compression is None else (compressed_needs(topology)[0], communication_needs(topology)[1])
        self.comm = select_communicator(comm, topology, timeout, device=device, group=group, needs=needs)
        self.complete = topology.is_exact_average()
        self._exchanger = GroupExchanger()

    def launch(self, step: int, tag: int, buf: Tensor, adaptive_factor: float = 1.0) -> BufferMix:
        """Start mixing ``buf`` with this rank's group at outer step ``step`` (``tag``: one per buffer
        in flight at once; ``adaptive_factor``: see :class:`~decentpy.comm.plans.BufferMix`)."""
        return BufferMix(self.schedule.at(step), self.comm, tag, buf, self.timeout, adaptive_factor)

    def launch_weight(self, step: int, weight: float, device: torch.device) -> BufferMix:
        """A time budget with compression: start mixing this rank's inner-step weight (one element,
        uncompressed) with the coefficients of the compressed exchange beside it."""
        assert self.compression is not None
        return weight_mix(self.schedule.at(step), self.comm, weight, device, self.timeout, self.complete,
                          float(self.compression.gamma))  # type: ignore[arg-type]

    def launch_compressed(self, step: int, tag: int, numel: int, wires: Sequence[Tensor], excess: Tensor,
                          dtype: torch.dtype) -> "CompressedMean":
        """Start the compressed mean of this rank's wire ``wires[0]`` (the error-fed pseudo-gradient of
        ``numel`` elements) over its group at outer step ``step``: the group exchange of compressed
        gossip, whose owners' re-quantisation is fed back into ``excess`` (an exact-average topology)."""
        assert self.compression is not None
        work, mean = start_compressed_mean(self.comm, self._exchanger, tag, self.schedule.at(step), self.rank,
                                           self.compression, numel, wires, excess, self.timeout, step)
        return CompressedMean(self.compression, work, mean, numel, dtype, self.timeout)

    def launch_compressed_mix(self, step: int, tag: int, buf: Tensor, copies: GossipCopies) -> CompressedMix:
        """Start mixing the float32 ``buf`` with this rank's group at outer step ``step`` by compressed
        gossip against ``copies`` (a gossip outer step with ``compression``)."""
        return CompressedMix(self.schedule.at(step), self.comm, self._exchanger, tag, buf, copies, self.timeout, step)

    def new_copies(self, numel: int, start: Tensor) -> GossipCopies:
        """Public copies for :meth:`launch_compressed_mix` of a buffer of ``numel`` elements: from
        ``start`` where every replica holds it alike, else from zero."""
        assert self.compression is not None
        return GossipCopies(self.topology, self.rank, numel, self.compression, start.device,
                            start if self.replicas_equal else None)

    def close(self) -> None:
        self._exchanger.close()
        self.comm.close()


class CompressedMean:
    """A compressed mean in flight: :meth:`wait` returns its values (decoded, float32 converted to
    the parameters' dtype), as :class:`~decentpy.comm.plans.BufferMix` returns its mixed buffer."""

    def __init__(self, compression: Compression, work: Optional[GroupExchange], wire: Tensor, numel: int,
                 dtype: torch.dtype, timeout: datetime.timedelta) -> None:
        self.compression, self.work, self.wire, self.numel, self.dtype, self.timeout = \
            compression, work, wire, numel, dtype, timeout

    def wait(self) -> Tensor:
        if self.work is not None:
            work, self.work = self.work, None
            work.wait(self.timeout)
        out = torch.empty(self.numel, dtype=torch.float32, device=self.wire.device)
        kernels.outer_decode(self.compression.compressor, self.wire, out)
        return out  # (float32: the outer step converts to the parameters' dtype)


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
        self._pending: List[Union[BufferMix, CompressedMean, CompressedMix]] = []
        #: a compressed gossip outer step's public copies, per exchange buffer (made at its first use;
        #: a checkpoint's wait in ``_copies_saved`` until then)
        self.copies: List[Optional[GossipCopies]] = [None] * len(self.groups)
        self._copies_saved: List[Optional[Dict[str, object]]] = [None] * len(self.groups)
        #: a compressed exchange's error feedback and wire buffers, per exchange buffer (made at its first use)
        self.excess: List[Optional[Tensor]] = [None] * len(self.groups)
        self._wires: List[List[Tensor]] = [[] for _ in self.groups]
        self._weighted = False  # the exchange in flight carries weighted pseudo-gradients and their weight
        self._weight_mix: Optional[BufferMix] = None  # a time budget with compression: the weights' own mix
        self._mixed: Optional[List[Tensor]] = None  # results read back by state_dict (an exchange in flight)

    @torch.no_grad()
    def save(self) -> None:
        """The parameters become the global copy."""
        for b, p in zip(self.backup, self.params):
            b.copy_(p.detach())

    @property
    def in_flight(self) -> bool:
        return bool(self._pending) or self._mixed is not None or self._weight_mix is not None

    @torch.no_grad()
    def prepare(self, mixer: TopologyMixer, step: int, tag: int, send_globals: bool,
                weight: Optional[float] = None) -> None:
        """The pseudo-gradient of the inner steps so far, and its exchange (started, not awaited).
        ``weight``: the pseudo-gradient is mixed as ``sum w_j delta_j / sum w_j`` over the group (the
        weights travel as one more element of the buffer)."""
        if self.in_flight:
            raise RuntimeError(f"internal error: fragment {self.index} prepared twice")
        # the weight travels as one more element, or with compression in its own mix (uncompressed)
        self._weighted = weight is not None and mixer.compression is None
        if weight is not None and mixer.compression is not None:
            self._weight_mix = mixer.launch_weight(step, weight, self.params[0].device)
        if mixer.compression is not None and not send_globals:
            self._prepare_compressed(mixer, step, tag, weight)
            return
        for k, idx in enumerate(self.groups):
            parts = []
            if send_globals:
                parts += [self.backup[i].to(self.params[i].device).reshape(-1) for i in idx]
            deltas = [(self.backup[i].to(self.params[i].device) - self.params[i].detach()).reshape(-1) for i in idx]
            parts += deltas
            if self._weighted:  # one more element for the weight
                parts.append(deltas[0].new_empty(1))
            buf = torch.cat(parts)
            n = sum(d.numel() for d in deltas)
            if self._weighted:
                weigh(buf[-1 - n:-1], buf[-1:], weight)  # type: ignore[arg-type]
            elif weight is not None:
                buf[-n:].mul_(weight)
            if mixer.compression is not None:  # a compressed gossip outer step: [theta; delta] by CHOCO
                self._pending.append(mixer.launch_compressed_mix(step, tag + k, buf.float(), self._copies(mixer, k,
                                                                                                          buf)))
            else:
                self._pending.append(mixer.launch(step, tag + k, buf))

    def _copies(self, mixer: TopologyMixer, k: int, buf: Tensor) -> GossipCopies:
        """Buffer ``k``'s public copies (``[theta; 0]`` at the start, or a checkpoint's)."""
        c = self.copies[k]
        if c is None:
            n = buf.numel() // 2
            start = buf.to(torch.float32, copy=True)
            start[n:].zero_()
            c = self.copies[k] = mixer.new_copies(buf.numel(), start)
            saved, self._copies_saved[k] = self._copies_saved[k], None
            if saved is not None:
                c.load_state_dict(saved)
        return c

    def _prepare_compressed(self, mixer: TopologyMixer, step: int, tag: int, weight: Optional[float]) -> None:
        """Each buffer's pseudo-gradient, compressed with error feedback (the fused pack), and its
        compressed mean over the group (an exact-average topology: the global copies stay home)."""
        comp = mixer.compression
        assert comp is not None
        for k, idx in enumerate(self.groups):
            sub = [self.params[i] for i in idx]
            dev = sub[0].device
            x = torch.cat([p.detach().reshape(-1) for p in sub])
            theta = torch.cat([self.backup[i].to(dev).reshape(-1).float() for i in idx])
            n = x.numel()
            if self.excess[k] is None:
                self.excess[k] = torch.zeros(n, dtype=torch.float32, device=dev)
            if not self._wires[k]:
                size = kernels.compressed_bytes(comp.compressor, n)
                self._wires[k] = [torch.empty(size, dtype=torch.uint8, device=dev)
                                  for _ in range(1 + max(1, mixer.topology.world_size))]
            excess = self.excess[k]
            assert excess is not None
            if weight is None:
                pseudo_gradient(x, theta, self._wires[k][0], comp.compressor, excess)
            else:  # Q(w d - e): the weighted pseudo-gradient against zero
                wd = torch.empty_like(theta)
                pseudo_gradient(x, theta, wd)
                pseudo_gradient(torch.zeros_like(wd), wd.mul_(weight), self._wires[k][0], comp.compressor, excess)
            self._pending.append(mixer.launch_compressed(step, tag + k, n, self._wires[k], excess, sub[0].dtype))

    def wait(self) -> List[Tensor]:
        """The mixed buffers of :meth:`prepare` (waits for the exchange)."""
        if self._mixed is None:
            self._mixed = [m.wait() for m in self._pending]
            self._pending = []
            if self._weight_mix is not None:  # sum w d / sum w: the mixed body over the mixed weight
                total = self._weight_mix.wait().clamp(min=torch.finfo(torch.float32).tiny)
                self._weight_mix = None
                for idx, flat in zip(self.groups, self._mixed):
                    n = sum(self.params[i].numel() for i in idx)
                    flat[-n:].div_(total.to(flat.dtype))
        return self._mixed

    @torch.no_grad()
    def perform(self, send_globals: bool) -> None:
        """The outer step with the mixed buffers (waits for them): the optimizer steps the (mixed)
        global copy with the mixed pseudo-gradient, which becomes the global copy, and the parameters
        restart from it or merge with it (:func:`decentpy.optim.outer.outer_step`, the one outer step)."""
        assert self.outer is not None
        mixed = self.wait()
        self._mixed = None
        params: List[Tensor] = []
        thetas: List[Tensor] = []
        deltas: List[Tensor] = []
        mixes: List[Tensor] = []
        for idx, flat in zip(self.groups, mixed):
            sub = [self.params[i] for i in idx]
            n = sum(p.numel() for p in sub)
            flat = flat.to(sub[0].dtype)  # (a compressed gossip mix is float32)
            if self._weighted:  # sum w_j delta_j / sum w_j (no inner step anywhere in the group: no move)
                flat = unweigh(flat, n)
            if send_globals:
                mixes += _split(flat[:n], sub)
                deltas += _split(flat[n:], sub)
            else:
                deltas += _split(flat, sub)
            params += sub
            thetas += [self.backup[i] for i in idx]
        outer_step(self.outer, params, thetas, deltas, theta_mix=mixes if send_globals else None, alpha=self.alpha)

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
                "in_flight": mixed, "excess": [None if e is None else e.clone() for e in self.excess],
                "copies": [c.state_dict() if c is not None else saved for c, saved in zip(self.copies,
                                                                                        self._copies_saved)]}

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
        for k, e in enumerate(state.get("excess") or []):  # type: ignore[arg-type]
            if e is not None:
                self.excess[k] = e.clone()  # (the wires are made at the next exchange: sizes follow)
        for k, c in enumerate(state.get("copies") or []):  # type: ignore[arg-type]
            if c is None:
                continue
            if self.copies[k] is not None:
                self.copies[k].load_state_dict(c)  # type: ignore[union-attr]
            else:
                self._copies_saved[k] = c  # (made at the next exchange)
        mixed = state.get("in_flight")
        self._pending = []
        self._mixed = [m.clone() for m in mixed] if mixed is not None else None  # type: ignore[union-attr]

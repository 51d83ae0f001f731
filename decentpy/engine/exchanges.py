"""Exchanges: what a gossip strategy sends and mixes (one part of the strategy, beside its node mode
and its failure policy).

The strategy holds the per-bucket sequence once (wait for the bucket's exchange, plan, one kernel
pass, launch the next exchange; :meth:`~decentpy.engine.gossip.GossipStrategy.mix_and_step`). The
exchange decides the two steps in it that depend on what travels: the arguments the kernel pass
takes from it (:meth:`Exchange.mixing`) and the launch of the next exchange
(:meth:`Exchange.launch`). It also owns what it keeps beyond the buckets, in checkpoints too. What
arrives passes the strategy's peer check (:mod:`~decentpy.engine.peer_check`) in ``mixing``, after
the wait and before the kernel pass.

- :class:`Exchange` (``"plain"``): the whole bucket (or shard) as the exchange plans of
  :mod:`decentpy.comm.plans` move it; the kernel mixes the received buffer in.
- :class:`~decentpy.engine.choco.CompressedExchange` (``"compressed"``): compressed differences
  against tracked public copies (``compression=``).
- :class:`~decentpy.engine.local_steps.LocalStepsExchange` (``"local-steps"``): ``H`` inner steps
  without exchange, then an outer step over the topology (``local_steps=``, DiLoCo).

Adding an exchange: subclass :class:`Exchange`, override :meth:`~Exchange.mixing` and
:meth:`~Exchange.launch` (and the state methods if it keeps any), register it in
:data:`decentpy.engine.EXCHANGES`. An exchange is handed the strategy it serves; this module imports
:class:`~decentpy.engine.gossip.GossipStrategy` for type checking only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..comm.plans import ExchangePlan
from .bucket import Bucket

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["Exchange"]


class Exchange:
    """The plain exchange: the bucket's values, mixed by the kernel with the plans' coefficients."""

    name = "plain"
    #: a backward may step before the host has read the last iteration's skip verdicts
    defers_verdicts = True

    def __init__(self, strategy: "GossipStrategy") -> None:
        self.strategy = strategy

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """What the communicator must set up, when it differs from what the exchange plans use
        (None: the plans' needs, see :func:`decentpy.comm.plans.communication_needs`)."""
        return None

    def mixing(self, b: Bucket, received: ExchangePlan, nxt: ExchangePlan) -> Dict[str, Any]:
        """The arguments of the bucket's kernel pass (:meth:`Bucket.step`) that come from the
        exchange: what was received at this step and is mixed in, and where the next send goes."""
        s = self.strategy
        recv = None
        a, c = 1.0, 0.0
        if received.mixes and not b.skip_mix:
            if not b.comm_valid:
                raise RuntimeError(f"internal error: bucket {b.index} has no exchange to mix at step {s.step}")
            s.pre_average_hook(b, received.group)
            recv = b.comm
            a, c = received.mix_coefficients(s.adaptive_factor)
        mixing = {"recv": recv, "mix_a": a, "mix_b": c, "send_scale": nxt.send_scale(),
                  "prev_skip": s.deferred_skip_flag(b)}
        return s.peer_check.admit(b, received, mixing)  # what arrived is checked before it is mixed

    def launch(self, b: Bucket, nxt: ExchangePlan) -> Optional[Any]:
        """Start the bucket's exchange of the next step (its work, or None: nothing to exchange), with
        the peer check's fingerprint of what is sent, where it has one (groups: their own all-reduce,
        launched and waited with the body's)."""
        s = self.strategy
        assert s.comm is not None, "internal error: the strategy has no communicator (attach() first)"
        s.peer_check.stepped(b)  # what the kernel pass's element guard kept
        carried = s.peer_check.fingerprint(b, nxt)  # a buffer to carry instead of b.comm (None: b.comm)
        work = nxt.launch(s.comm, b.index, b.param, carried if carried is not None else b.comm)
        return s.peer_check.launched(b, nxt, work)

    def memory_bytes(self) -> int:
        """Bytes the exchange keeps beyond the buckets' own buffers."""
        return 0

    @property
    def outer_steps(self) -> Optional[int]:
        """Outer steps completed (local steps); None for an exchange at every step."""
        return None

    def wait_params(self) -> None:
        """Complete whatever of the exchange still writes the parameters (local steps: the outer step),
        before they are read again: the next forward, a checkpoint, a layout rebuild."""

    def abandon(self) -> None:
        """Forget what of the exchange is still in flight outside the buckets' own works (a peer
        failed, or the group is being replaced: nobody will complete it)."""

    def close(self) -> None:
        """Release what the exchange holds (threads, buffers)."""

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """What the exchange keeps beyond the buckets, for a checkpoint; None: nothing."""
        return None

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (after the bucket layout was restored)."""
        if state is not None:
            raise ValueError(f"the checkpoint was saved with the {state['kind']!r} exchange (compression= or "
                             "local_steps=); this run has neither (pass the same arguments to resume)")

    def load_after_reform(self, state: Optional[Dict[str, Any]]) -> None:
        """An elastic re-formation's state (new peers, a new group): the default starts the exchange's
        own state afresh on every member alike (per-edge state, compressed gossip's public copies,
        means nothing with other peers)."""

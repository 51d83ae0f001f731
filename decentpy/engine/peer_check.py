"""The peer check: what arrives from a peer is checked before it is mixed (one part of the gossip
strategy, beside its node mode, exchange and failure policy; chosen by ``peer_check=``).

Peers are untrusted input: a peer whose parameters went wrong once (a NaN, a scaled copy) or go wrong
every step (a flipped sign, random values) would otherwise be averaged into every replica within a
few steps. The check sits in the exchange's :meth:`~decentpy.engine.exchanges.Exchange.mixing`, after
the wait for the bucket's exchange and before the kernel pass, and decides what the pass mixes:

* **pairs** (:class:`~decentpy.comm.plans.PairExchange`): one pass over the received buffer ``c``
  and this replica ``p`` (:func:`decentpy.optim.kernels.peer_stats`, csrc/kernels/peer_check.h) gives
  ``d = ||c - p||``, ``||p||`` and whether ``c`` and ``p`` are finite;
* **groups of more than two ranks** (:class:`~decentpy.comm.plans.GroupAllReduce`) deliver only the
  sum, so each member also contributes a fingerprint of what it sends -- a finite flag, its sum of
  squares and a linear sketch of ``SKETCH_SLOTS`` float64 values (:func:`decentpy.optim.kernels.peer_sketch`) -- in
  its own row of a tail the body's all-reduce carries (float32 buckets: each float64 value as a float32
  pair ``hi + lo``, exact after the sum since every other member adds zeros there; other dtypes: a
  small float64 all-reduce launched and waited with the body's). Every member then
  sees every member's sketch ``S y_j`` and the sum's own sketch: ``||S y_j - center||`` (the center the
  coordinate-wise median of the members' sketches) estimates each member's distance, and ``S(sum)``
  against ``sum_j S y_j`` reveals a member whose data does not match its fingerprint. The verdict is a
  function of what every member received alike, so every member reaches the same one.

The bound, per bucket (pairs) or per bucket and group (groups): ``bound`` times the median of the last
``window`` accepted distances (zeros are not kept: equal replicas say nothing of the scale), from
steps at least :data:`HISTORY_LAG` before the current one (the device reports its verdicts that late
on a GPU; the same lag on the CPU keeps both alike, and every member of a group alike). Until a full
window of such distances is kept -- the first steps after construction or an elastic re-formation,
when distances grow fast -- the bound is relative to this replica's own norm: ``FIRST_BOUND x ||p||``
when the replicas started equal (the broadcast at construction: honest replicas are then a few steps
apart, far below ``||p||``, while a scaled, flipped or random copy is at least ``||p||`` away),
``bound x ||p||`` when they did not. A change of scale every peer shows at once (a learning-rate
restart) restarts the history (:data:`RESET_STREAK`); a faulty peer is one peer.

What a contribution that fails does is the policy (:data:`PEER_POLICIES`):

* ``"skip"`` (the default): dropped this step -- its weight goes to this replica, the row of the mix
  stays valid (a pair keeps ``p``; a group's members all keep their own parameters: the sum cannot be
  cleaned);
* ``"clip"``: ClippedGossip (He, Karimireddy, Jaggi 2022): ``p + w CLIP(c - p, tau)`` with ``tau`` the
  bound, i.e. the factor ``f = min(1, tau / d)`` on the peer's difference; a non-finite contribution
  is dropped; a group's mix is not applied (its members' differences cannot be separated);
* ``"raise"``: :class:`~decentpy.FaultyPeerError` naming the peer, the bucket, the step, the distance
  and the bound (or "not finite"), on the detecting rank, reported through the peer monitor so that
  every other rank raises a :class:`~decentpy.comm.PeerFaultyError` naming the same peer;
* ``"off"``: no check (the code path of decentpy before the check).

An accepted contribution mixes with exactly the coefficients it would without the check (the kernel
gets the same ``a`` and ``b``): a run in which nothing fails is bit for bit the run without it on
pairs. A group's body travels with the fingerprints' tail, a longer buffer that the backend splits
otherwise for its sum (gloo's ring): the same mean, its float additions in another order (within the
rounding of an m-term sum of the unchecked run's).
On the CPU the verdict is read at once (no device to wait for). On a GPU the kernel reads it from
device memory (``mix_factor``: csrc/kernels/mix_and_step.h) and the host learns it through a pinned
copy and an event, read when the strategy settles an iteration (or :data:`HISTORY_LAG` steps later),
for its history, its logs, its counters and ``'raise'`` -- so ``'raise'`` raises a step late there,
and nothing flagged is mixed meanwhile.

This rank's own parameters: the same pass says whether ``p`` is finite; when it is not, the rank logs
it (naming "parameters", never claiming that nothing non-finite was sent) and, for a pair whose
contribution is finite, takes the peer's values in place of its own (the CPU at once, a GPU when the
host learns it). Compressed gossip and local steps receive other things than parameters: a non-finite
check only (see :meth:`PeerChecker.admit_wire` and :meth:`PeerChecker.admit_outer`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor

from ..optim import kernels
from ..optim.host_copy import HostCopy
from ..comm import FaultyPeerError, peer_monitor
from ..comm.failures import FAULTY_PEER_TOKEN
from ..comm.plans import ExchangePlan
from .bucket import Bucket

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["PeerCheck", "PeerChecker", "CheckedPeers", "PeerPolicy", "SkipPolicy", "ClipPolicy", "RaisePolicy",
           "PEER_POLICIES", "PEER_CHECK_CHOICES", "DEFAULT_PEER_CHECK", "resolve_peer_check", "make_peer_check",
           "pair_verdict", "group_verdict", "history_bound", "FIRST_BOUND", "HISTORY_LAG", "RESET_STREAK", "SKETCH_SLOTS",
           "SUMMARY_EVERY"]

logger = logging.getLogger(__name__)

#: the bound relative to this replica's norm before any accepted distance (replicas that started equal)
FIRST_BOUND = 1.0
#: the history a step's bound reads ends this many steps before it
HISTORY_LAG = 2
#: consecutive checks of a bucket (pairs: from at least two peers, or from its only one) that failed the
#: bound of the history restart that history: a change of scale that every peer shows at once (a
#: learning-rate restart) is not a faulty peer, which is one peer; the first bound decides until the
#: history is full again, and still drops what is farther than this replica's norm
RESET_STREAK = 4
#: float64 values of a group member's sketch
SKETCH_SLOTS = 32
#: a flagged peer's later failures are summed up in one warning per this many steps
SUMMARY_EVERY = 100
#: the seed of the group sketches (the members must share it)
SKETCH_SEED = 0x5EED_DEC0
#: the passes over a bucket read about this many of its elements: one unit of kernels.SAMPLE_UNIT in
#: every ``numel // SAMPLE_TARGET`` (buckets below twice this are read whole). What costs is the memory
#: traffic of cold buffers (a pass over the whole of a 12 MiB bucket, in a training step, cost ~1.5 ms of
#: CPU, the step ~30 ms); a sample of 64 Ki elements estimates a distance within ~1%.
SAMPLE_TARGET = 1 << 16
#: (the smallest bucket that is sampled)
SAMPLE_MIN = 2 * SAMPLE_TARGET
#: the element guard of a group's mix, in units of its bound (a member within the bound of the center
#: moves this replica by at most about twice the bound; the sketched distances are estimates)
GROUP_GUARD = 4.0
#: the element guard while only the device knows the bound (a GPU before any accepted distance): it
#: keeps what is not finite
GUARD_FINITE = float(torch.finfo(torch.float32).max)


def sample_for(numel: int) -> int:
    """The sampling of the peer check's passes over a buffer of ``numel`` elements (1: every element)."""
    return max(1, numel // SAMPLE_TARGET)


def expansion(numel: int, sample: int) -> float:
    """What a sum over the sampled elements is multiplied by to estimate the sum over all of them."""
    got = kernels.peer_sampled_count(numel, sample)
    return numel / got if got else 1.0


def _unit_roundoff(dtype: torch.dtype) -> float:
    """Of the values the passes read (a float64 bucket is read as float32: kernels.peer_read_dtype)."""
    return float(torch.finfo(kernels.peer_read_dtype(dtype)).eps) / 2.0


# -- the argument ------------------------------------------------------------------------------


class PeerPolicy:
    """What a contribution that failed the check does (one per policy name in :data:`PEER_POLICIES`)."""

    name = ""
    #: a failure raises FaultyPeerError on every rank
    raises = False
    #: a pair's contribution beyond the bound is scaled to it (ClippedGossip) rather than dropped
    clips = False


class SkipPolicy(PeerPolicy):
    """``"skip"``: drop the contribution (its weight goes to this replica)."""

    name = "skip"


class ClipPolicy(PeerPolicy):
    """``"clip"``: ClippedGossip, the peer's difference scaled to length ``tau`` (``f = min(1, tau / d)``)."""

    name = "clip"
    clips = True


class RaisePolicy(PeerPolicy):
    """``"raise"``: a named error on every rank (nothing flagged is mixed meanwhile)."""

    name = "raise"
    raises = True


#: policy name -> what a failed contribution does (``"off"``: no check at all)
PEER_POLICIES: Dict[str, Type[PeerPolicy]] = {cls.name: cls for cls in (SkipPolicy, ClipPolicy, RaisePolicy)}
PEER_CHECK_CHOICES = tuple(PEER_POLICIES) + ("off",)


@dataclasses.dataclass(frozen=True)
class PeerCheck:
    """``DecentralizedDataParallel(peer_check=...)``: what arrives from a peer is checked before it is
    mixed. ``policy``: ``'skip'`` (default), ``'clip'``, ``'raise'`` or ``'off'``; ``bound``: a
    contribution farther than ``bound`` times the median of the last ``window`` accepted distances
    fails. See docs/failures.md, "A faulty peer", for the rule, the measured faults and the cost."""

    policy: str = "skip"
    bound: float = 10.0
    window: int = 16

    def __post_init__(self) -> None:
        if self.policy not in PEER_CHECK_CHOICES:
            raise ValueError(f"peer_check policy must be one of {', '.join(map(repr, PEER_CHECK_CHOICES))}, got "
                             f"{self.policy!r}")
        if isinstance(self.bound, bool) or not isinstance(self.bound, (int, float)) or not (
                math.isfinite(self.bound) and self.bound > 1.0):
            raise ValueError(f"peer_check bound must be a finite number > 1 (a multiple of the median recent distance),"
                             f" got {self.bound!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"peer_check window must be an int >= 1 (accepted distances whose median scales the bound),"
                             f" got {self.window!r}")


#: the wrapper's default
DEFAULT_PEER_CHECK = PeerCheck()


def resolve_peer_check(value: Union[None, str, PeerCheck]) -> PeerCheck:
    """``peer_check=`` as a :class:`PeerCheck`: a policy name takes the default bound and window; None
    is ``'off'``. A ValueError names a bad value and the valid ones."""
    if value is None:
        return PeerCheck("off")
    if isinstance(value, PeerCheck):
        return value
    if isinstance(value, str):
        return dataclasses.replace(DEFAULT_PEER_CHECK, policy=value)
    raise TypeError(f"peer_check must be a policy name ({', '.join(map(repr, PEER_CHECK_CHOICES))}) or a "
                    f"decentpy.PeerCheck, got {type(value).__name__}")


# -- the rules (the verdicts are csrc/kernels/peer_check.h's: the same on the CPU and a GPU) ---------


def history_bound(history: Sequence[Tuple[int, float]], step: int, bound: float, window: int) -> Optional[float]:
    """The bound at ``step`` from the accepted distances ``(step, d)`` kept so far (in step order):
    ``bound x`` the median of the last ``window`` of those from steps ``<= step - HISTORY_LAG``; None
    until there are ``window`` of them (the first bound applies: in the first steps the distances grow
    fast -- momentum builds up, a learning-rate warm-up starts from zero, replicas that started equal
    drift apart -- and a median of a few early ones would be no scale for the next)."""
    ds = [d for s, d in history if s <= step - HISTORY_LAG][-window:]
    return bound * statistics.median(ds) if len(ds) >= window else None


def pair_verdict(stats: Tensor, tau: Optional[float], first: float, policy: PeerPolicy,
                 expand: float = 1.0) -> Tensor:
    """A pair's verdict (csrc/kernels/peer_check.h ``pair_verdict``, on the stats' device) from the
    stats pass's result (float64 ``[sum (c-p)^2, sum p^2, c's and p's non-finite indicators]``, over the
    sampled elements: ``expand`` scales its sums to the whole buffer): ``[f, d, tau, c_ok, p_ok]``.
    ``tau``: the bound from the history (None: ``first x ||p||``). ``f`` the kernel's mix factor: 1
    within the bound, else 0 (``'clip'``: ``tau / d``); 0 for a non-finite contribution or replica."""
    return kernels.peer_pair_verdict(stats, expand, tau, first, policy.clips)


def group_verdict(fingerprints: Tensor, recv_sketch: Tensor, scale: float, unit_roundoff: float,
                  tau: Optional[float], first: float, expand: float = 1.0) -> Tensor:
    """A group's verdict (csrc/kernels/peer_check.h ``group_verdict``), the same on every member (its
    inputs are): ``fingerprints`` the all-reduced ``[m, k + 2]`` rows (member j's: its non-finite flag,
    its sum of squares, its sketch of ``y_j = scale x_j``); ``recv_sketch`` the all-reduced sum's own
    sketch (``k`` values, its sum of squares, its non-finite indicator). Returns ``[f, consistent, tau,
    ||center||, d_0 .. d_{m-1}, bad_0 .. bad_{m-1}]`` (float64): ``d_j = ||S x_j - center||`` with the
    center the coordinate-wise median; member j is bad when its flag or sketch is not finite or ``d_j >
    tau``; the group is consistent when ``|S(sum) - sum_j S y_j| <= 16 (m - 1) u sqrt(m sum_j
    ||y_j||^2)`` in every slot (the rounding of a float sum of m terms, ``u`` the unit roundoff of the
    buffer's dtype, is at most ``(m - 1) u sum_j |y_ij|`` per element; the sketch's random signs make a
    slot's error a Rademacher sum of those); ``f`` is 1 when no member is bad and the group is
    consistent, else 0. With sampled sketches, ``expand`` scales the distances and the norm to the whole
    buffer."""
    return kernels.peer_group_verdict(fingerprints, recv_sketch, scale, unit_roundoff, tau, first, expand)


# -- the part -------------------------------------------------------------------------------------


def _timed(method: Any) -> Any:
    """Count the host CPU time of a check's entry point into ``self.cpu_s`` (what ``stats()`` reports as
    ``peer_check_cpu_s``: the check's own cost, the kernel's element guard aside)."""
    @functools.wraps(method)
    def run(self: "CheckedPeers", *args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.cpu_s += time.thread_time() - t0
    return run


class PeerChecker:
    """``peer_check='off'``: nothing is checked; the base of the checking part (every method is the
    unchecked behaviour)."""

    name = "off"

    def __init__(self, strategy: "GossipStrategy", config: PeerCheck = PeerCheck("off")) -> None:
        self.strategy = strategy
        self.config = config

    def admit(self, b: Bucket, received: ExchangePlan, mixing: Dict[str, Any]) -> Dict[str, Any]:
        """The kernel pass's mixing arguments after the check of what arrived for ``b`` (the exchange's
        :meth:`~decentpy.engine.exchanges.Exchange.mixing`, after the wait)."""
        return mixing

    def stepped(self, b: Bucket) -> None:
        """After ``b``'s kernel pass: what its element guard kept (read at once on the CPU)."""

    def fingerprint(self, b: Bucket, nxt: ExchangePlan) -> Optional[Tensor]:
        """Before the launch of ``b``'s next exchange (its send buffer written): the buffer the exchange
        carries instead of ``b.comm``, or None (``b.comm``)."""
        return None

    def launched(self, b: Bucket, nxt: ExchangePlan, work: Optional[Any]) -> Optional[Any]:
        """After the launch: the exchange's work (a group's, with its fingerprints' all-reduce)."""
        return work

    def admit_wire(self, b: Bucket, wire: Tensor, compressor: Any, numel: int, peers: Sequence[int]) -> bool:
        """Compressed gossip: whether the received compressed bytes may be applied."""
        return True

    def admit_outer(self, b: Bucket, result: Tensor, compressor: Any, numel: int, peers: Sequence[int]) -> bool:
        """Local steps: whether the outer exchange's result may be applied."""
        return True

    def settle(self, force: bool = False) -> None:
        """Read what the device decided and the host has not seen yet (``force``: wait for it)."""

    def params_finite(self, b: Bucket) -> Optional[bool]:
        """Whether this rank's own parameters of ``b`` were finite at the last check (None: not known)."""
        return None

    def reset(self) -> None:
        """The buckets were rebuilt or restored (a checkpoint, a new layout): forget what was kept per
        bucket (histories, fingerprints in flight); the next checks start afresh."""

    def counters(self) -> Dict[str, float]:
        """The part's counters for ``stats()``."""
        return {"peer_checks": 0, "peer_checks_failed": 0}


class _Joined:
    """A group exchange's work and its fingerprints' all-reduce, waited together."""

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    @property
    def step(self) -> Optional[int]:
        return getattr(self.works[0], "step", None)

    @step.setter
    def step(self, value: Optional[int]) -> None:
        for w in self.works:
            if hasattr(w, "step"):
                w.step = value

    def wait(self, timeout: Any) -> None:
        for w in self.works:
            w.wait(timeout)


class _Pending:
    """One check's verdict on the device, until the host reads it."""

    def __init__(self, kind: str, step: int, bucket: int, key: Tuple[Any, ...], peers: Tuple[int, ...],
                 result: Tensor, first: bool = False) -> None:
        self.kind, self.step, self.bucket, self.key, self.peers = kind, step, bucket, key, peers
        self.result = result
        self.first = first  # the bound was the first one (relative to the norm: no accepted distance yet)
        self.guard = 0.0    # (kind 'guard': the element guard, and the kind of check it followed)
        self.check_kind = kind
        self._copy = HostCopy(result)

    def ready(self) -> bool:
        return self._copy.ready()

    def values(self) -> List[float]:
        return self._copy.values()


class CheckedPeers(PeerChecker):
    """The check, under a policy of :data:`PEER_POLICIES` (see the module)."""

    name = "checked"

    def __init__(self, strategy: "GossipStrategy", config: PeerCheck) -> None:
        super().__init__(strategy, config)
        self.policy: PeerPolicy = PEER_POLICIES[config.policy]()
        self.name = config.policy
        #: the verdict is read by the host at once (CPU buffers) or later (a GPU's; see the module)
        self.lagged: Optional[bool] = None
        #: accepted distances (step, d) per pair bucket / group bucket and group, in step order
        self._history: Dict[Tuple[Any, ...], Deque[Tuple[int, float]]] = {}
        self._pending: Deque[_Pending] = deque()
        self._outs: Dict[Tuple[int, int], Tensor] = {}     # (bucket, width) -> the passes' output rows
        #: bucket -> the fingerprints in flight: float64 rows of their own all-reduce, or the float32 buffer
        #: whose tail carries them (``carried``); the group; the send scale; carried
        self._fingerprints: Dict[int, Tuple[Tensor, Tuple[int, ...], float, bool]] = {}
        #: bucket -> the float32 buffer its group exchanges carry: ``b.comm`` is its head (see _carrier)
        self._carriers: Dict[int, Tensor] = {}
        self._max_group: Optional[int] = None
        self._own_finite: Dict[int, bool] = {}
        self._guards: Dict[int, Tuple[Tensor, float, _Pending]] = {}  # bucket -> (count, guard, its check) this step
        self._counters: Dict[int, Tensor] = {}             # bucket -> the guard's int64 counter
        self._adopt: set = set()                           # buckets whose parameters take a peer's at the next mix
        self._streak: Dict[Tuple[Any, ...], Tuple[int, set]] = {}  # key -> (failed checks in a row, their peers)
        self._pair_peers: Optional[set] = None             # this rank's pair partners over the topology's period
        self.checks = 0
        self.cpu_s = 0.0                                   # host CPU time in the check (see _timed)
        self.failed: Dict[int, int] = {}                   # peer (global rank; -1 unnamed) -> failures
        self._seen: set = set()                            # (peer, bucket) already warned about
        self._since: Dict[int, Tuple[int, int, str]] = {}  # peer -> (failures since its last warning, first step, last)
        self._warned_at: Dict[int, int] = {}
        self.own_nonfinite = 0
        self.adopted = 0
        self._own_warned: set = set()
        #: the largest accepted distance over the median of the history it was checked against (how
        #: close honest training came to ``bound``), and over the norm under the first bound
        self.peak_ratio = 0.0
        self.peak_first_ratio = 0.0

    # -- what the strategy sees ------------------------------------------------------------------
    def counters(self) -> Dict[str, float]:
        self.settle(force=True)
        out: Dict[str, float] = {"peer_checks": self.checks, "peer_checks_failed": sum(self.failed.values()),
                                 "peer_check_cpu_s": self.cpu_s}
        for peer, n in sorted(self.failed.items()):
            out[f"peer_checks_failed_rank{peer}" if peer >= 0 else "peer_checks_failed_unnamed"] = n
        if self.own_nonfinite:
            out["nonfinite_param_checks"] = self.own_nonfinite
            out["params_taken_from_peer"] = self.adopted
        return out

    def params_finite(self, b: Bucket) -> Optional[bool]:
        return self._own_finite.get(b.index)

    def reset(self) -> None:
        self.settle(force=True)
        self._guards.clear()
        self._counters.clear()
        self._history.clear()
        self._streak.clear()
        self._fingerprints.clear()
        self._carriers.clear()
        self._outs.clear()
        self._own_finite.clear()
        self._adopt.clear()

    @_timed
    def settle(self, force: bool = False) -> None:
        while self._pending and (force or self._pending[0].ready()):
            self._record(self._pending.popleft())

    # -- helpers -----------------------------------------------------------------------------------
    def _out(self, b: Bucket, width: int, device: torch.device) -> Tensor:
        key = (b.index, width)
        out = self._outs.get(key)
        if out is None or out.device != device:
            out = self._outs[key] = kernels.peer_rows(width, device)
        return out

    def _is_lagged(self, device: torch.device) -> bool:
        if self.lagged is None:
            self.lagged = device.type != "cpu"
        return self.lagged

    def _bound(self, key: Tuple[Any, ...]) -> Optional[float]:
        """``bound x`` the median of the last ``window`` accepted distances of ``key`` from steps at least
        HISTORY_LAG before this one; None before any (the first bound)."""
        step = self.strategy.step
        # the device's verdicts of those steps have landed long ago (a whole iteration since): no wait
        while self._pending and self._pending[0].step <= step - HISTORY_LAG:
            self._record(self._pending.popleft())
        return history_bound(self._history.get(key, ()), step, self.config.bound, self.config.window)

    def _first(self) -> float:
        return FIRST_BOUND if self.strategy.replicas_equal else self.config.bound

    def _me(self) -> int:
        s = self.strategy
        return s.group.to_global(s.rank)

    # -- pairs -------------------------------------------------------------------------------------
    @_timed
    def admit(self, b: Bucket, received: ExchangePlan, mixing: Dict[str, Any]) -> Dict[str, Any]:
        fp = self._fingerprints.pop(b.index, None)
        recv = mixing.get("recv")
        if recv is None:  # nothing is mixed (equal replicas, no exchange): nothing to check
            return mixing
        if received.collective_ranks is not None:
            return self._admit_group(b, received, mixing, fp)
        peer = next(r for r in received.group.ranks if r != self.strategy.rank)
        return self._admit_pair(b, peer, mixing)

    def _admit_pair(self, b: Bucket, peer: int, mixing: Dict[str, Any]) -> Dict[str, Any]:
        s = self.strategy
        p, c = b.param, mixing["recv"]
        lagged = self._is_lagged(p.device)
        if b.index in self._adopt:  # this replica's own values were found not finite (a GPU: a step ago)
            self._adopt.discard(b.index)
            self._take_peer_values(b, c)
        sample = sample_for(p.numel())
        stats = kernels.peer_stats(p, c, self._out(b, kernels.PEER_STATS, p.device), sample)
        key = ("pair", b.index)
        tau = self._bound(key)
        verdict = pair_verdict(stats, tau, self._first(), self.policy, expansion(p.numel(), sample))
        self.checks += 1
        pending = _Pending("pair", s.step, b.index, key, (s.group.to_global(peer),), verdict, tau is None)
        if lagged:
            self._pending.append(pending)
            mixing["mix_factor"] = verdict[0:1].float()
            return self._guard(b, mixing, pending, mixing["mix_b"] * tau if tau is not None else GUARD_FINITE)
        f, _, t, c_ok, p_ok = verdict.tolist()
        if not p_ok and c_ok:
            self._take_peer_values(b, c)
            self.adopted += 1
        self._record(pending)  # (raises under 'raise')
        if f <= 0.0:
            mixing["recv"] = None
            return mixing
        if f < 1.0:  # (f = 1: the same coefficients as without the check, bit for bit)
            mixing["mix_factor"] = torch.tensor([f], dtype=torch.float32)
        return self._guard(b, mixing, pending, mixing["mix_b"] * t)

    def _guard(self, b: Bucket, mixing: Dict[str, Any], check: _Pending, guard: float) -> Dict[str, Any]:
        """The kernel's element guard on what the check measured on a sample: an element whose change
        exceeds ``guard`` (for a pair ``b x`` the bound: no element of an accepted difference is longer
        than the difference) or is not finite keeps its value; counted, read after the pass."""
        if not (guard > 0 and math.isfinite(guard)) and guard != GUARD_FINITE:
            guard = GUARD_FINITE
        count = self._counters.get(b.index)
        if count is None or count.device != b.param.device:
            count = self._counters[b.index] = torch.zeros(1, dtype=torch.int64, device=b.param.device)
        else:
            count.zero_()
        mixing["mix_guard"] = float(min(guard, GUARD_FINITE))
        mixing["mix_guarded"] = count
        self._guards[b.index] = (count, mixing["mix_guard"], check)
        return mixing

    @_timed
    def stepped(self, b: Bucket) -> None:
        entry = self._guards.pop(b.index, None)
        if entry is None:
            return
        count, guard, check = entry
        kept = _Pending("guard", check.step, b.index, check.key, check.peers, count, check.first)
        kept.guard = guard
        kept.check_kind = check.kind
        if kept.result.is_cuda:
            self._pending.append(kept)
        elif int(count.item()) != 0:  # the CPU: at once (nothing to wait for)
            self._record(kept)

    def _take_peer_values(self, b: Bucket, c: Tensor) -> None:
        """This replica's own parameters are not finite: it takes the peer's (where those are)."""
        with torch.no_grad():
            if c.is_cuda:
                torch.where(torch.isfinite(c).all(), c, b.param, out=b.param)
            else:
                b.param.copy_(c)
            if not b.params_are_views:
                b.scatter_params()

    # -- groups ------------------------------------------------------------------------------------
    @_timed
    def fingerprint(self, b: Bucket, nxt: ExchangePlan) -> Optional[Tensor]:
        """A group member's fingerprint of what it sends: its row (the non-finite flag, the sum of squares,
        the sketch) of m float64 rows, zeros elsewhere, summed over the group with the body. For a float32
        bucket the rows ride in a tail of the buffer the body's all-reduce carries (:meth:`_carrier`):
        ``hi = float32(row)``, ``lo = float32(row - hi)``, exact after the sum (the other members add
        zeros), so no second collective (on 4 CPU workers of ``complete`` one cost ~5% of a step). Other
        dtypes cannot carry a float64 value exactly: their rows go in their own float64 all-reduce,
        launched with the body's (:meth:`launched`)."""
        ranks = nxt.collective_ranks
        if ranks is None or nxt.send_scale() is None:
            return None
        send = b.comm  # written by the kernel pass: scale * p
        sk = kernels.peer_sketch(send, SKETCH_SEED, SKETCH_SLOTS, self._out(b, SKETCH_SLOTS + 2, send.device),
                                 sample_for(send.numel()))
        rows = torch.zeros(len(ranks), SKETCH_SLOTS + 2, dtype=torch.float64, device=send.device)
        me = ranks.index(self.strategy.rank)
        rows[me, 0] = (sk[-1] != 0).to(torch.float64)  # the non-finite indicator: 0, or NaN
        rows[me, 1] = sk[SKETCH_SLOTS]
        rows[me, 2:] = sk[:SKETCH_SLOTS]
        scale = float(nxt.send_scale())  # type: ignore[arg-type]
        if send.dtype != torch.float32:
            self._fingerprints[b.index] = (rows, tuple(ranks), scale, False)
            return None
        n = send.numel()
        carrier = self._carrier(b, 2 * rows.numel())
        tail = carrier[n:n + 2 * rows.numel()].view(2, *rows.shape)
        tail[0].copy_(rows)  # rounded to float32: hi
        tail[1].copy_(rows - tail[0].to(torch.float64))  # what the rounding dropped: lo
        self._fingerprints[b.index] = (carrier, tuple(ranks), scale, True)
        return carrier[:n + 2 * rows.numel()]

    def _carrier(self, b: Bucket, extra: int) -> Tensor:
        """The float32 buffer ``[body | tail]`` whose head is ``b.comm`` (the kernel pass writes the body
        there, the group's all-reduce sums the whole prefix it needs in place): made once per bucket
        with room for the topology's largest group, ``b.comm`` then a view of it (its values copied)."""
        n = b.comm.numel()
        if self._max_group is None:
            self._max_group = max(len(g.ranks) for g in self.strategy.topology.unique_groups())
        room = max(extra, 2 * self._max_group * (SKETCH_SLOTS + 2))
        carrier = self._carriers.get(b.index)
        if (carrier is None or carrier.numel() < n + extra or carrier.device != b.comm.device
                or carrier.data_ptr() != b.comm.data_ptr()):
            carrier = torch.empty(n + room, dtype=b.comm.dtype, device=b.comm.device)
            carrier[:n].copy_(b.comm)
            b.comm = carrier[:n]
            self._carriers[b.index] = carrier
        return carrier

    @_timed
    def launched(self, b: Bucket, nxt: ExchangePlan, work: Optional[Any]) -> Optional[Any]:
        fp = self._fingerprints.get(b.index)
        if fp is None or work is None or fp[3]:  # (carried in the body's tail: nothing more to launch)
            return work
        comm = self.strategy.comm
        assert comm is not None and nxt.collective_ranks is not None
        # launched right after the body on the same group, waited with it: its latency hides behind the body's
        return _Joined([work, comm.all_reduce(b.index, nxt.collective_ranks, fp[0])])

    def _admit_group(self, b: Bucket, received: ExchangePlan, mixing: Dict[str, Any],
                     fp: Optional[Tuple[Tensor, Tuple[int, ...], float, bool]]) -> Dict[str, Any]:
        s = self.strategy
        ranks = tuple(received.collective_ranks or ())
        if fp is None or fp[1] != ranks:
            # no fingerprint travelled with this exchange (a resumed checkpoint's buffer): mixed unchecked
            logger.debug("rank %d: bucket %d at step %d: no fingerprints for group %s; mixed unchecked", self._me(),
                         b.index, s.step, list(ranks))
            return mixing
        rows, _, scale, carried = fp
        recv = mixing["recv"]
        if carried:  # the summed tail after the body: hi + lo of every member's row
            tail = rows[recv.numel():recv.numel() + 2 * len(ranks) * (SKETCH_SLOTS + 2)].view(2, len(ranks), -1)
            rows = tail[0].to(torch.float64) + tail[1].to(torch.float64)
        lagged = self._is_lagged(recv.device)
        sample = sample_for(recv.numel())
        sk = kernels.peer_sketch(recv, SKETCH_SEED, SKETCH_SLOTS, self._out(b, SKETCH_SLOTS + 2, recv.device), sample)
        key = ("group", b.index, ranks)
        tau = self._bound(key)
        verdict = group_verdict(rows, sk, scale, _unit_roundoff(recv.dtype), tau, self._first(),
                                expansion(recv.numel(), sample))
        self.checks += len(ranks) - 1
        pending = _Pending("group", s.step, b.index, key, tuple(s.group.describe(ranks)), verdict, tau is None)
        if lagged:
            self._pending.append(pending)
            mixing["mix_factor"] = verdict[0:1].float()
            return self._guard(b, mixing, pending, GROUP_GUARD * tau if tau is not None else GUARD_FINITE)
        f, _, t = verdict[:3].tolist()
        self._record(pending)
        if f < 1.0:
            mixing["recv"] = None  # every member keeps its own parameters (the sum cannot be cleaned)
            return mixing
        return self._guard(b, mixing, pending, GROUP_GUARD * t)

    # -- what the host learns ----------------------------------------------------------------------
    def _record(self, p: _Pending) -> None:
        """History, counters, logs, and 'raise', from one verdict."""
        v = p.values()
        if p.kind == "pair":
            self._record_pair(p, v)
        elif p.kind == "group":
            self._record_group(p, v)
        elif v[0] != 0:
            self._record_guard(p, int(v[0]))

    def _accept(self, p: _Pending, tau: float, ds: Sequence[float]) -> None:
        scale = tau / (self._first() if p.first else self.config.bound)  # the norm, or the median
        if scale > 0:
            top = max(ds) / scale
            if p.first:
                self.peak_first_ratio = max(self.peak_first_ratio, top)
            else:
                self.peak_ratio = max(self.peak_ratio, top)
        key, step = p.key, p.step
        hist = self._history.get(key)
        if hist is None:
            hist = self._history[key] = deque(maxlen=4 * self.config.window + 64)
        for d in ds:
            if d > 0 and math.isfinite(d):
                hist.append((step, d))

    def _record_pair(self, p: _Pending, v: List[float]) -> None:
        f, d, tau, c_ok, p_ok = v
        peer = p.peers[0]
        self._own_finite[p.bucket] = bool(p_ok)
        if not p_ok:
            self._own_params(p, peer, bool(c_ok))
            return
        if not c_ok:
            self._streak_of(p, [peer])
            return self._failed(p, peer, "sent values that are not finite (inf or NaN)", None, None)
        if d <= tau:
            self._streak.pop(p.key, None)
            self._accept(p, tau, [d])
            return
        self._streak_of(p, [peer])
        self._failed(p, peer, f"sent values at distance {d:.4g} from this replica, beyond the bound {tau:.4g} "
                     f"({self._bound_text(p)})", d, tau)

    def _streak_of(self, p: _Pending, peers: Sequence[int]) -> None:
        """A check of ``p.key`` failed the bound of its history (``peers``: whom it judged): after
        RESET_STREAK in a row from two peers or more (or from this rank's only pair partner), the history
        restarts (see RESET_STREAK)."""
        if p.first:
            return
        n, seen = self._streak.get(p.key, (0, set()))
        n, seen = n + 1, seen | set(peers)
        if n < RESET_STREAK or (len(seen) < 2 and p.kind == "pair" and len(self._partners()) > 1):
            self._streak[p.key] = (n, seen)
            return
        self._streak.pop(p.key, None)
        self._history.pop(p.key, None)
        logger.warning("rank %d: bucket %d: %d checks in a row from peer(s) %s failed the bound of its history (%s): "
                       "a change of scale, not one faulty peer; its history restarts (the first bound decides until "
                       "%d distances are kept again)", self._me(), p.bucket, n, sorted(seen), self._bound_text(p),
                       self.config.window)

    def _partners(self) -> set:
        """This rank's pair partners over one period of the topology (global ranks)."""
        if self._pair_peers is None:
            s = self.strategy
            plans = [s.plans.at(k) for k in range(s.topology.period)]
            self._pair_peers = {s.group.to_global(r) for plan in plans if plan.point_to_point
                                for r in plan.group.ranks if r != s.rank}
        return self._pair_peers

    def _record_group(self, p: _Pending, v: List[float]) -> None:
        m = len(p.peers)
        f, consistent, tau, _ = v[:4]
        ds, bad = v[4:4 + m], v[4 + m:4 + 2 * m]
        me = self._me()
        self._own_finite[p.bucket] = not (bad[p.peers.index(me)] and not math.isfinite(ds[p.peers.index(me)]))
        if f >= 1.0:
            self._streak.pop(p.key, None)
            self._accept(p, tau, ds)
            return
        named = [(r, d) for r, d, x in zip(p.peers, ds, bad) if x]
        if consistent and len(named) >= 2 and all(math.isfinite(d) for _, d in named):
            # several members beyond the bound at once (against the median of all), all finite: a change of
            # scale (a learning-rate change), not one faulty member -- nobody is named; the mix waits, and the
            # history restarts soon
            n, _ = self._streak.get(p.key, (0, set()))
            if n == 0 and not p.first:
                logger.warning("rank %d: bucket %d, step %d: %d of the %d members of group %s are beyond the bound "
                               "%.4g (%s) together: a change of scale rather than a faulty peer; the group's mix waits "
                               "and its history restarts after %d such checks", self._me(), p.bucket, p.step,
                               len(named), m, list(p.peers), tau, self._bound_text(p), RESET_STREAK)
            self._streak_of(p, [r for r, _ in named])
            return
        self._streak.pop(p.key, None)
        where = f"of group {list(p.peers)}"
        for r, d in named:
            if r == me and not math.isfinite(d):
                self._own_params(p, -1, False)
                continue
            what = ("sent values that are not finite (inf or NaN)" if not math.isfinite(d) else
                    f"sent values at distance {d:.4g} from the group's median (sketched), beyond the bound {tau:.4g} "
                    f"({self._bound_text(p)})")
            self._failed(p, r, f"{what} as a member {where}", d if math.isfinite(d) else None,
                         tau if math.isfinite(d) else None)
        if not consistent and not named:
            self._failed(p, -1, f"(a member {where}, not named): the group's sum does not match its members' "
                         "fingerprints (a member sent data other than it declared, or the data was corrupted on the "
                         "way)", None, None)

    def _record_guard(self, p: _Pending, kept: int) -> None:
        """The kernel's element guard kept ``kept`` elements of a contribution the sampled check accepted:
        values there not finite or beyond the guard (a fault in a part of the buffer the sample did not read)."""
        what = (f"sent {kept} value(s) that are not finite or farther than the element guard {p.guard:.4g} "
                "(in elements the sampled check did not read); those elements were not mixed")
        if getattr(p, "check_kind", "pair") == "pair":
            self._failed(p, p.peers[0], what, None, None)
        else:
            self._failed(p, -1, f"(a member of group {list(p.peers)}, not named) {what}", None, None)

    def _bound_text(self, p: _Pending) -> str:
        if not p.first:
            return f"{self.config.bound:g} x the median of the last {self.config.window} accepted distances"
        norm = "this replica" if p.kind == "pair" else "the group's median (sketched)"
        return f"{self._first():g} x the norm of {norm}, before any accepted distance"

    def _failed(self, p: _Pending, peer: int, what: str, d: Optional[float], tau: Optional[float]) -> None:
        me = self._me()
        self.failed[peer] = self.failed.get(peer, 0) + 1
        named = f"{FAULTY_PEER_TOKEN} {peer}" + (" (this rank, as its group sees it)" if peer == me else "")
        text = f"rank {me}: {named} {what}, at bucket {p.bucket}, step {p.step}"
        if self.policy.raises:
            err = FaultyPeerError(f"{FaultyPeerError.__name__}: {text}; peer_check policy 'raise'", peer, p.bucket,
                                  p.step, d, tau, p.peers)
            monitor = peer_monitor()
            if monitor is not None:
                monitor.report(str(err))
            raise err
        action = ("the rest of the mix was applied" if p.kind == "guard" else
                  "the group's mix was not applied on any member (each keeps its parameters this step)"
                  if p.kind == "group" else
                  "its contribution was dropped" if self.policy.name == "skip" or d is None else
                  f"its difference was clipped to {tau:.4g} (ClippedGossip)")
        if (peer, p.bucket) not in self._seen:
            self._seen.add((peer, p.bucket))
            self._warned_at.setdefault(peer, p.step)
            logger.warning("%s; %s (peer_check policy %r; later failures of this peer are summed up every %d steps)",
                           text, action, self.policy.name, SUMMARY_EVERY)
            return
        n, first, _ = self._since.get(peer, (0, p.step, ""))
        self._since[peer] = (n + 1, first, text)
        if p.step - self._warned_at.get(peer, p.step) >= SUMMARY_EVERY:
            n, first, last = self._since.pop(peer)
            self._warned_at[peer] = p.step
            logger.warning("rank %d: %s failed the peer check %d more time(s) in steps %d..%d (policy %r); the last: %s",
                           me, f"{FAULTY_PEER_TOKEN} {peer}", n, first, p.step, self.policy.name, last)

    def _own_params(self, p: _Pending, peer: int, peer_ok: bool) -> None:
        """This rank's own parameters of the bucket are not finite (after its step, or a fault)."""
        self.own_nonfinite += 1
        if p.kind == "pair" and peer_ok and self.lagged:
            self._adopt.add(p.bucket)  # a GPU: at the next mix with a peer (the CPU took them already)
        if p.bucket in self._own_warned:
            return
        self._own_warned.add(p.bucket)
        if p.kind == "pair" and peer_ok:
            then = "it takes peer rank %d's finite values in their place%s" % (
                peer, " at its next mix" if self.lagged else "")
        elif p.kind == "pair":
            then = f"peer rank {peer}'s values are not finite either: nothing is mixed"
        else:
            then = "its group's members drop the group's mix (its contribution makes the sum non-finite)"
        logger.warning("rank %d: the parameters of bucket %d are not finite at step %d (on this rank, after its step "
                       "or a fault; they were sent to its peers as they are, who drop them); %s", self._me(), p.bucket,
                       p.step, then)

    # -- compressed gossip and local steps: a non-finite check ------------------------------------
    def _finite(self, t: Tensor) -> bool:
        return bool(kernels.peer_stats(t, None)[3].item() == 0)  # this rank's indicator: 0, or NaN

    def _wire_values(self, wire: Tensor, compressor: Any, numel: int) -> Tensor:
        """The floating-point part of a compressed wire: bf16 values, or the int8 / int4 block scales (the
        codes are integers)."""
        if compressor == kernels.Compressor.BF16:
            return wire.view(torch.bfloat16)
        blocks = -(-numel // kernels.INT8_BLOCK)
        return wire[:4 * blocks].view(torch.float32)

    def admit_wire(self, b: Bucket, wire: Tensor, compressor: Any, numel: int, peers: Sequence[int]) -> bool:
        if wire.is_cuda:  # a host read per step would synchronise the GPU: not checked there (docs/failures.md)
            return True
        self.checks += 1
        if self._finite(self._wire_values(wire, compressor, numel)):
            return True
        s = self.strategy
        ranks = list(s.group.describe(peers))
        p = _Pending("pair", s.step, b.index, ("wire", b.index), tuple(ranks), torch.zeros(1))
        self._failed(p, ranks[0] if len(ranks) == 1 else -1,
                     f"sent a compressed difference that is not finite{'' if len(ranks) == 1 else f' (group {ranks})'};"
                     " the pair's tracked copies no longer agree (that difference is missing here)", None, None)
        return False

    def admit_outer(self, b: Bucket, result: Tensor, compressor: Any, numel: int, peers: Sequence[int]) -> bool:
        self.checks += 1
        values = result if compressor is None else self._wire_values(result, compressor, numel)
        if values.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            values = values.float()
        if self._finite(values.reshape(-1)):
            return True
        s = self.strategy
        ranks = list(s.group.describe(peers))
        p = _Pending("pair", s.step, b.index, ("outer", b.index), tuple(ranks), torch.zeros(1))
        self._failed(p, -1, f"(the outer exchange of group {ranks}, not named): its result is not finite; this outer "
                     "step was dropped (the global copy and the parameters stay)", None, None)
        return False


def make_peer_check(value: Union[None, str, PeerCheck], strategy: "GossipStrategy") -> PeerChecker:
    """The strategy's peer-check part for ``peer_check=value``."""
    config = resolve_peer_check(value)
    if config.policy == "off":
        return PeerChecker(strategy, config)
    return CheckedPeers(strategy, config)

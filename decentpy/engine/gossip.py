"""The gossip strategy: bucket-by-bucket mix-and-step inside the backward, composed of parts.

When a bucket's gradients are ready: wait (bounded) for the bucket's exchange launched last
iteration, ask the exchange plans of this step and the next (:mod:`decentpy.comm.plans`) and the
exchange part what the kernel pass mixes and sends, run one kernel pass over the bucket (mix,
unscale/clip, the optimizer update, zero the gradient, write the next send buffer), and launch the
next exchange -- while autograd keeps computing the earlier layers. The sequence is written once,
here (:meth:`GossipStrategy.mix_and_step`); what varies is one of three parts, each with one
registry: the node mode (:mod:`~decentpy.engine.node`: every rank a worker, or the node reduces
first), the exchange (:mod:`~decentpy.engine.exchanges`: plain or compressed) and the failure
policy (:mod:`~decentpy.engine.failure`: raise, or elastic); a fourth, the peer check
(:mod:`~decentpy.engine.peer_check`), checks what arrives from a peer before the exchange lets the
kernel pass mix it.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from ..optim import kernels
from ..comm import CommGroup, Communicator, NonFiniteGradientError, peer_monitor
from ..comm.plans import ExchangeSchedule
from ..optim.grad_scaling import UNSCALED, BucketGradScaling, GradArgs, SkipVerdict
from ..topology import Group
from .bucket import Bucket, BucketPlan
from .exchanges import Exchange
from .failure import FailurePolicy, make_failure_policy
from .step_checks import check_step_hyperparameters
from .peer_check import PeerCheck, PeerChecker, make_peer_check
from .node import GossipSetup, NodeMode
from .layout import BucketLayout, OptimFn, SchedulerFn
from .strategy import BucketStrategy, Readiness

if TYPE_CHECKING:
    from ..topology import Edge

__all__ = ["GossipStrategy"]

logger = logging.getLogger(__name__)


class GossipStrategy(BucketStrategy):
    """Bucket-by-bucket mix-and-step inside backward, with exchanges overlapping compute."""

    #: a backward may step before the host has read the last iteration's skip verdicts (see
    #: :meth:`begin_backward`); compressed gossip and the elastic failure policy always read them first
    defers_verdicts = True

    def __init__(self, params: List[Tensor], names: List[str], optim_fn: OptimFn, scheduler_fn: Optional[SchedulerFn],
                 setup: GossipSetup, grad_scaling: BucketGradScaling, bucket_cap_bytes: int,
                 param_as_bucket_view: bool, timeout: datetime.timedelta, group: CommGroup,
                 node: Callable[["GossipStrategy"], NodeMode] = NodeMode,
                 exchange: Callable[["GossipStrategy"], Exchange] = Exchange, failure: str = "raise",
                 peer_check: Union[None, str, PeerCheck] = "off") -> None:
        """Local only (no collective): builds the buckets and their optimizers; :meth:`attach` then
        gives the strategy its communicator. Its parts: ``node`` makes the node mode
        (:data:`~decentpy.engine.NODE_MODES`; its ``configure`` made ``setup``); ``exchange`` makes the exchange
        (:data:`~decentpy.engine.EXCHANGES`; the plain one by default); ``failure`` names the failure
        policy (:data:`~decentpy.engine.failure.FAILURE_POLICIES`); ``peer_check`` what arrives from a
        peer goes through before it is mixed (:mod:`~decentpy.engine.peer_check`; 'off': nothing)."""
        self.setup = setup
        self.topology = setup.exchange_topology
        self.grad_scaling = grad_scaling
        self.timeout = timeout
        self.group = group
        self.rank = group.rank
        self.plans = ExchangeSchedule(self.topology, self.rank)
        self.comm: Optional[Communicator] = None
        self.hook_edges: Optional[Dict[Tuple[Tuple[int, ...], float], "Edge"]] = None  # for pre_average_hook
        self.step = 0                       # iterations completed (schedule index of the next mix)
        # the last iteration's skip verdict, the buckets' step flags and its step, until settle()
        self._unsettled: Optional[Tuple[Optional[SkipVerdict], List[Tuple[Bucket, Optional[bool]]], int]] = None
        # the part of it whose outcome this iteration's steps read on the device (begin_backward)
        self._deferred: Optional[Tuple[SkipVerdict, List[Tuple[Bucket, Optional[bool]]], int]] = None
        self._prev_skip: Dict[int, Tensor] = {}  # bucket index -> its deferred skip flag (device)
        self._warned_no_grad: Set[str] = set()  # parameter names already reported without a gradient
        self.adaptive_factor = 1.0          # p <- (1-f) p + f mix(p)
        #: every rank holds the same parameters (broadcast at construction): an exchange's state may
        #: start from them (compressed gossip's public copies); False: it starts from zero
        self.replicas_equal = False
        #: what travels between the ranks, and what the kernel pass takes from it
        self.exchange: Exchange = exchange(self)
        #: what a failed peer does to this strategy (every operation that can meet one runs through it)
        self.policy: FailurePolicy = make_failure_policy(failure, self)
        #: what arrives from a peer is checked before it is mixed (the exchange asks it)
        self.peer_check: PeerChecker = make_peer_check(peer_check, self)
        #: what the ranks of a node do together (before the layout: it pads and shards the buckets)
        self.node_mode: NodeMode = node(self)
        self.layout = BucketLayout(params, names, optim_fn, scheduler_fn, bucket_cap_bytes, param_as_bucket_view,
                                   group, self.node_mode.pad_multiple, self.node_mode.shard_of)

    @property
    def name(self) -> str:
        """The ``intra_node`` name (the node mode's)."""
        return self.node_mode.name

    @property
    def local_gradients(self) -> bool:
        """The step's gradient is this rank's own (see :attr:`NodeMode.local_gradients`)."""
        return self.node_mode.local_gradients

    @property
    def exchanges_whole_model(self) -> bool:
        """Each exchange carries this rank's whole model (see :attr:`NodeMode.exchanges_whole_model`)."""
        return self.node_mode.exchanges_whole_model

    @property
    def buckets(self) -> List[Bucket]:
        return self.layout.buckets

    def attach(self, comm: Communicator,
               hook_edges: Optional[Dict[Tuple[Tuple[int, ...], float], "Edge"]] = None) -> None:
        """The communicator (and, for optimizers with ``pre_average_hook``, the edges) to exchange with."""
        self.comm = comm
        self.hook_edges = hook_edges
        self.layout.pre_average_hook = hook_edges is not None
        self.policy.attach(comm)

    def node_reduction(self) -> Optional[Any]:
        """The node's own collectives (:class:`~decentpy.engine.node.IntraNode`); None: every rank is a
        gossip worker."""
        return self.node_mode.node_reduction()

    def communication_needs(self) -> Optional[Tuple[bool, List[Tuple[int, ...]]]]:
        """What the communicator must set up when it differs from what the topology's exchange
        plans use (None: the plans' needs, see :func:`decentpy.comm.plans.communication_needs`)."""
        return self.exchange.communication_needs()

    def memory_bytes(self) -> int:
        """Bytes the exchange keeps beyond the buckets (compressed gossip: its copies and buffers)."""
        return self.exchange.memory_bytes()

    def connect(self, device: torch.device) -> None:
        """Collective set-up of the strategy's own groups, if any (every rank, at construction)."""
        self.node_mode.connect(device)

    def close(self) -> None:
        """Release what :meth:`connect` created, and the claim on the parameters (a torch optimizer
        may step them again)."""
        self.node_mode.close()
        self.exchange.close()
        self.layout.release()

    def module_hooks(self, model: nn.Module) -> List[Any]:
        """Hooks the strategy needs on the wrapped model (handles, removed by the wrapper's close)."""
        return self.node_mode.module_hooks(model)

    # -- the driver's interface ----------------------------------------------------------------
    def readiness(self) -> Optional[Readiness]:
        return self.layout.readiness()

    def settle_layout(self, order: Sequence[int]) -> None:
        self.settle()  # nothing pending may point at buckets a rebuild replaces
        self.exchange.wait_params()
        self.layout.settle(order)
        check_step_hyperparameters(self)  # the rebuilt buckets' optimizers, before any of them steps
        self.peer_check.reset()

    def begin_iteration(self, in_join: bool, active: bool) -> None:
        if not active and not self.layout.final:
            raise RuntimeError(
                f"rank {self.rank} joined before its first training iteration; every rank needs at least one "
                "iteration (which fixes the bucket layout) before it runs out of data")
        self.policy.wait_params()
        self.layout.moved_check()
        track = (self.local_gradients and self.grad_scaling.active and self.layout.final
                 and Bucket.norm_while_copying)
        for b in self.buckets:
            b.reset_iteration()
            if track and b.whole and b.grad.dtype in kernels.KERNEL_DTYPES:
                b.track_grad_norms()
        self.node_mode.begin_iteration(in_join, active)

    def stray_grad(self, index: int) -> None:
        raise RuntimeError(self._twice_message(index))

    def grad_ready(self, index: int, first: bool, sent: bool) -> bool:
        layout = self.layout
        # A separately allocated gradient is copied in and freed at once.
        layout.buckets[layout.bucket_of[index]].adopt_grad(layout.slot_of[index], strict=layout.final)
        if not first:
            raise RuntimeError(self._twice_message(index))
        return True

    def begin_backward(self) -> None:
        self._settle_or_defer()  # the last iteration's verdicts, before this one steps anything
        check_step_hyperparameters(self)  # what the kernel passes read (a scheduler's NaN): before any steps
        self.grad_scaling.begin_iteration()

    def _settle_or_defer(self) -> None:
        """Apply the last iteration's outcome before this backward steps. On a GPU, when its skip
        verdicts have not reached the host yet, waiting here would idle the GPU while the host
        launches the backward; instead the buckets whose outcome only the device knows step with
        their flag (the kernel takes the bias corrections of one step fewer if that update was
        skipped) and are settled at the end of this backward, when the GPU has the whole backward
        queued. Only where nothing else needs the outcome first: no LR scheduler on those buckets
        (it moves only after an update), a fused optimizer whose flags agree for both outcomes
        (:meth:`FusedOptimizer.defers_verdict`), and not under ``nonfinite='raise'``."""
        u = self._unsettled
        if u is None or self._deferred is not None:
            return self.settle()
        verdict, stepped, step = u
        defers = self.defers_verdicts and self.exchange.defers_verdicts and self.policy.defers_verdicts
        if not defers or verdict is None or verdict.ready():
            return self.settle()
        # a fused step's outcome is the kernel's (stepped False: not known on the host); a torch
        # optimizer's step was decided on the host (its flag is the outcome)
        uncertain = [(b, st) for b, st in stepped if b.fused and st is False and verdict.flag(b.index) is not None]
        if not uncertain or any(b.scheduler is not None or not b.state_optimizer.defers_verdict()  # type: ignore[attr-defined]
                                for b, _ in uncertain):
            return self.settle()
        self._unsettled = None
        for b, st in stepped:  # what the host knows already
            if not any(b is c for c, _ in uncertain):
                b.finish_iteration(st, None)
        self._deferred = (verdict, uncertain, step)
        self._prev_skip = {b.index: verdict.flag(b.index) for b, _ in uncertain}  # type: ignore[misc]

    def bucket_ready(self, bucket: int, joined: bool) -> None:
        self.node_mode.bucket_ready(self.layout.buckets[bucket], joined)

    def end_backward(self, joined: bool) -> None:
        try:
            self.node_mode.end_backward(joined)  # what the node mode still holds (the last reduction)
            self.settle()
            verdict = self.grad_scaling.end_iteration()  # copied to the host without waiting
            self._unsettled = (verdict, [(b, b.take_stepped()) for b in self.buckets], self.step)
            self.step += 1
            if self.grad_scaling.nonfinite == "raise" and self.grad_scaling.scaler is None:
                self.settle()  # raise in this iteration, on every rank (waits for the verdict)
        finally:
            self.node_mode.end_iteration()

    def settle(self) -> None:
        """Apply the last iteration's outcome: each bucket's step counter and LR scheduler move if
        its update happened (the device's verdict, read now), and a skipped bucket is reported.
        Deferred from the end of the backward so that the host does not wait for the GPU there;
        run before anything steps again or reads the optimizers (the wrapper's accessors)."""
        if self._deferred is not None:
            deferred, self._deferred, self._prev_skip = self._deferred, None, {}
            self._apply(*deferred)
        self.peer_check.settle()  # what the device decided of the peers' contributions (a GPU: lagged)
        if self._unsettled is None:
            return
        unsettled, self._unsettled = self._unsettled, None
        self._apply(*unsettled)

    #: this rank's iterations in which a bucket skipped its update (non-finite gradient), and the
    #: bucket updates skipped; counted here, where each verdict is applied (the wrapper's stats())
    skipped_steps = 0
    skipped_bucket_updates = 0

    def _apply(self, verdict: Optional[SkipVerdict], stepped: List[Tuple[Bucket, Optional[bool]]], step: int) -> None:
        skipped = verdict.result() if verdict is not None else {}
        bad = sum(1 for s in skipped.values() if s)
        self.skipped_bucket_updates += bad
        self.skipped_steps += int(bad > 0)
        for b, st in stepped:
            b.finish_iteration(st, skipped.get(b.index))
        if self.grad_scaling.check_finite and self.group.size > 1:
            self._nonfinite(sorted(i for i, s in skipped.items() if s), step)

    #: iterations with a non-finite gradient whose warning was logged in full; after these, one summary
    #: every NONFINITE_SUMMARY_EVERY steps (a rank whose parameters stay non-finite would warn every step)
    NONFINITE_WARNINGS = 3
    NONFINITE_SUMMARY_EVERY = 100
    _nonfinite_events = 0
    _nonfinite_quiet: Tuple[int, int] = (0, -1)  # (events not logged since the last line, step of that line)

    def _params_not_finite(self, bad: List[int]) -> Tuple[List[int], List[int]]:
        """Of the buckets in ``bad`` (their gradient was not finite), those whose parameters were not
        finite at this step's peer check (the parameters the gradient was taken at) and those whose
        parameters are not finite now (what this step sends). A host read, on this error path only."""
        by_index = {b.index: b for b in self.buckets}
        were, now = [], []
        for i in bad:
            b = by_index.get(i)
            if b is None:
                continue
            if self.peer_check.params_finite(b) is False:
                were.append(i)
            if not bool(torch.isfinite(b.param).all()):
                now.append(i)
        return were, now

    def _nonfinite(self, bad: List[int], step: int) -> None:
        """Tell every rank about this rank's skipped buckets (a warning here, a notice for the
        others, who log it at their next look), or raise on every rank (``nonfinite='raise'``). The
        message says whether this rank's parameters are not finite too (then they were sent to the
        peers as they are) or only its gradient (then nothing non-finite was sent)."""
        monitor = peer_monitor()
        me = self.group.to_global(self.rank)
        if bad:
            scaler = self.grad_scaling.scaler is not None
            were, now = ([], []) if scaler else self._params_not_finite(bad)
            params = sorted(set(were) | set(now))
            grads = [i for i in bad if i not in params]
            what = "their update was skipped" if self.grad_scaling.nonfinite == "skip" or scaler else "raising"
            parts = []
            if grads:
                parts.append(f"the gradient of bucket(s) {grads} at step {step} is not finite (inf or NaN)")
            if params:
                parts.append(f"the parameters of bucket(s) {params} are not finite at step {step} (on this rank, after "
                             "its step or a fault; the gradient taken at them is not finite either)")
            taken = [i for i in were if i not in now]
            if taken:
                parts.append(f"bucket(s) {taken} took a peer's finite values in their place before this step's send")
            sent = ("nothing non-finite was sent to the peers" if not params else
                    "non-finite parameters go to the peers as they are" + (
                        " (their peer check drops them)" if self.peer_check.name != "off" else
                        " (peer_check='off': the peers mix them)") if now else
                    "if they were non-finite at its last send too, its peers' check dropped them")
            text = (f"rank {me}: {'; '.join(parts)}; {what}{' (the GradScaler backs off)' if scaler else ''}; {sent}")
            if self.grad_scaling.nonfinite == "raise" and not scaler:
                err = NonFiniteGradientError(f"{NonFiniteGradientError.__name__}: {text}", me, step, bad)
                if monitor is not None:
                    monitor.report(str(err))
                raise err
            self._nonfinite_events += 1
            quiet, last = self._nonfinite_quiet
            if self._nonfinite_events <= self.NONFINITE_WARNINGS or scaler:
                logger.log(logging.INFO if scaler else logging.WARNING, "%s", text)
                if monitor is not None and not scaler:
                    monitor.notify(text)
                self._nonfinite_quiet = (0, step)
            elif step - last >= self.NONFINITE_SUMMARY_EVERY:
                summary = (f"{text} ({quiet + 1} iteration(s) with a non-finite gradient on this rank since step "
                           f"{last}; one line every {self.NONFINITE_SUMMARY_EVERY} steps after the first "
                           f"{self.NONFINITE_WARNINGS})")
                logger.warning("%s", summary)
                if monitor is not None:
                    monitor.notify(summary)
                self._nonfinite_quiet = (0, step)
            else:
                self._nonfinite_quiet = (quiet + 1, last)
        if monitor is not None:
            for r, text in monitor.notices(self.group.global_ranks):
                logger.warning("peer notice from rank %d: %s", r, text)

    def _twice_message(self, index: int) -> str:
        return (f"parameter '{self.layout.names[index]}' received a gradient twice in one training iteration (two "
                "backward passes over one forward, reentrant checkpointing, or a backward without a "
                "training-mode forward of the wrapper); decentpy steps each parameter once per iteration. "
                "Run forward and backward once per iteration, use non-reentrant checkpointing, or wrap "
                "extra backward passes in ddp.no_sync()")

    # -- the per-bucket work -------------------------------------------------------------------
    def mix_and_step(self, b: Bucket, local_step: bool, reduction: Optional[Any] = None) -> None:
        """Wait, plan, step (unless ``local_step`` is False: a joined worker), launch the next exchange.
        ``reduction``: the bucket's gradient reduction in flight (see :meth:`grad_args`). Run through
        the failure policy (:meth:`FailurePolicy.bucket`), as are the operations it calls that can
        meet a failed peer."""
        self.wait_exchange(b)
        received, nxt = self.plans.at(self.step), self.plans.at(self.step + 1)
        mixing = self.exchange.mixing(b, received, nxt)
        grads = self.policy.grad_args(b, reduction) if local_step else UNSCALED
        b.step(grads=grads, local_step=local_step, no_update=self.without_gradient(b, local_step), **mixing)
        b.comm_valid = False
        b.skip_mix = False
        b.work = self.exchange.launch(b, nxt)
        if b.work is not None and hasattr(b.work, "step"):
            b.work.step = self.step  # for a failure's message
        self.policy.stepped(b)

    def deferred_skip_flag(self, b: Bucket) -> Optional[Tensor]:
        """The device flag of the bucket's last update when its outcome is deferred (see
        :meth:`_settle_or_defer`), for the kernel pass; None: the host knows it."""
        return self._prev_skip.get(b.index)

    def without_gradient(self, b: Bucket, local_step: bool) -> int:
        """The parameters of ``b`` that got no gradient this iteration (a bit mask): they are mixed and
        sent but not updated -- no weight decay, optimizer state untouched -- as torch's optimizers
        skip a parameter whose ``.grad`` is None. Said once per parameter, at WARNING. Only where
        the step's gradient is this rank's own (a node strategy steps the node's reduction)."""
        mask = b.no_grad_slots if self.local_gradients and local_step else 0
        if mask:
            new = [n for i, n in enumerate(b.names) if mask >> i & 1 and n not in self._warned_no_grad]
            if new:
                self._warned_no_grad.update(new)
                logger.warning("rank %d: parameter(s) %s got no gradient at step %d: not updated (no weight decay, "
                               "optimizer state untouched) while they get none, as torch's optimizers skip a "
                               "parameter whose .grad is None; the gossip mix still averages them with the peers",
                               self.group.to_global(self.rank), ", ".join(repr(n) for n in new), self.step)
        return mask

    def grad_args(self, b: Bucket, reduction: Optional[Any]) -> GradArgs:
        """How the kernel scales the bucket's gradient (the node mode's: after the node's reduction)."""
        return self.node_mode.grad_args(b, reduction)

    def stepped(self, b: Bucket) -> None:
        """After the bucket's step and the launch of its exchange (the node mode's)."""
        self.node_mode.stepped(b)

    def wait_exchange(self, b: Bucket) -> None:
        if b.work is not None:
            work, b.work = b.work, None
            work.wait(self.timeout)  # type: ignore[attr-defined]
            b.comm_valid = True

    def wait_params(self) -> None:
        """Wait for whatever still writes the parameters after a step (before they are used again)."""
        self.wait_node_params()
        self.exchange.wait_params()

    def wait_node_params(self) -> None:
        """The node's part of :meth:`wait_params` (a sharded node's all-gather of updated shards)."""
        self.node_mode.wait_params()

    def drop_node_work(self) -> None:
        """Forget the node's own collectives in flight without waiting (after one of them failed: the
        rest will never complete)."""
        self.node_mode.drop_work()

    def wait_all(self) -> None:
        self.settle()  # first: it needs no exchange, and a failed wait below must not lose it
        for b in self.buckets:
            self.wait_exchange(b)
        self.policy.wait_params()

    def pre_average_hook(self, b: Bucket, group: Group) -> None:
        """decent-dp's extension point: ``optimizer.pre_average_hook(edge, weight)`` right before the
        bucket mixes with ``group`` (after its exchange completed, before the optimizer step)."""
        hook = getattr(b.optimizer, "pre_average_hook", None)
        if hook is None:
            return
        assert self.hook_edges is not None  # BucketLayout.build refuses such optimizers otherwise
        edge = self.hook_edges[(group.ranks, group.weight)]
        hook(edge, edge.weight)

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_state(self) -> Dict[str, Any]:
        """The strategy's part of a training checkpoint: the step, the bucket layout, each bucket's
        optimizer and scheduler state, the exchange in flight (completed first), the node mode and
        the exchange's own state (:meth:`Exchange.state_dict`). Before the first iteration nothing has
        stepped and the layout is provisional: no layout or optimizer state is saved, and loading
        such a checkpoint leaves the layout to the trace."""
        self.wait_all()
        final = self.layout.final
        plan = self.layout.plan if final else None
        buckets = self.buckets if final else []
        return {
            "step": self.step,
            "buckets": plan.buckets if plan is not None else None,
            "optimizers": [b.state_optimizer.state_dict() for b in buckets],
            "schedulers": [b.scheduler.state_dict() if b.scheduler is not None else None for b in buckets],
            "exchange": [b.comm.clone() if b.comm_valid else None for b in buckets],
            "skip_mix": [b.skip_mix for b in buckets],
            "intra_node": self.name,
            "compression": self.exchange.state_dict(),
        }

    def check_resume(self, state: Dict[str, Any], local_world_size: int) -> None:
        """Refuse a checkpoint whose per-rank state this strategy cannot take (the node mode, and for
        node reductions the node size and the shard: each rank's optimizer state is its part)."""
        self.node_mode.check_resume(state, local_world_size)

    @torch.no_grad()
    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`checkpoint_state` (after :meth:`check_resume`; the model's values are loaded
        by the wrapper after the layout, which this adopts first: see :meth:`adopt_layout`)."""
        self.peer_check.reset()  # the buffers in flight and the histories were another run's
        if not state.get("rebuild_exchange", False):
            self.exchange.load_state_dict(state.get("compression"))
        else:  # an elastic epoch: new peers; the exchange decides what of its state carries over
            self.exchange.load_after_reform(state.get("compression"))
        for b, opt_sd, sch_sd, ex, skip in zip(self.buckets, state["optimizers"], state["schedulers"],
                                               state["exchange"], state["skip_mix"]):
            b.state_optimizer.load_state_dict(opt_sd)
            if b.scheduler is not None and sch_sd is not None:
                b.scheduler.load_state_dict(sch_sd)
            if ex is not None:
                b.comm.copy_(ex)
            b.comm_valid = ex is not None
            b.skip_mix = bool(skip)
            b.gather_params()
        self.step = int(state["step"])

    def adopt_layout(self, state: Dict[str, Any]) -> None:
        """The saved bucket layout, before the model's values are loaded into the buckets."""
        self.wait_all()
        saved = state["buckets"]
        if saved is not None:
            self.layout.adopt(BucketPlan([list(b) for b in saved]))

    # -- whole-model operations ----------------------------------------------------------------
    def mark_equal(self) -> None:
        """All workers hold the same parameters: the next mix is the identity."""
        self.replicas_equal = True
        for b in self.buckets:
            b.skip_mix = True

"""``AsyncPipe``: a model's layers in stages, one per process, with micro-batches flowing through.

fairscale's constructor and way of driving it, on plain ``torch.distributed`` point-to-point
messages (:mod:`.transport`; gloo on CPU, NCCL on GPU) instead of torch RPC:

* every rank calls ``out = pipe(x)`` (only the first stage needs real data; later stages learn
  the shapes and the micro-batch count from the messages). The final stage gets the gathered
  output and calls ``loss.backward()``. A non-final stage serves the backward of its micro-batches
  **inside** ``forward``: in training with autograd on, its ``forward`` returns once every
  micro-batch's gradient has passed through it (so a script that calls ``pipe.back_helper(out)``
  afterwards, as fairscale's do, works unchanged: it has nothing left to do). Meanwhile the final
  stage must not wait for the other stages (no collective between its forward and its backward);
* ``pipe.train_step(x, target, loss_fn)`` runs a whole GPipe or 1F1B schedule (:mod:`.schedule`)
  and returns the loss on the final stage.

Every step ends with an agreement over the pipe's group (idle ranks included) that tells every
rank whether a stage failed (:mod:`.agreement`: on gloo a star through the first stage, whose
receives are posted when the step starts; on NCCL an all-reduce of one int64 and one host read:
the agreement needs its value).
A failure anywhere (forward, backward, loss) sends ``ERROR`` to the neighbours that may be
waiting for a message, so no rank hangs; the stages then read what the failed step left unread
(the pipe stays usable: the next step starts in step), and every rank raises -- the failing one
its own exception, the others a :class:`PipelineError` naming the stage. Every wait is bounded by
the pipe's timeout; a timeout (a stage died or never called the pipe) leaves the pipe unusable.

A stage's partition can run through a data-parallel wrapper (:meth:`AsyncPipe.wrap_partition`,
e.g. a ``DecentralizedDataParallel`` over the stage's replicas: :mod:`decentpy.hybrid`). Such a
wrapper steps inside the backward and expects one forward and one backward per iteration, while a
stage runs ``m`` of each per mini-batch. So the pipe calls the wrapper for the mini-batch's first
micro-batch only (one iteration per mini-batch: its ``prepare()``, ``Join``'s count) and the bare
partition for the others and for recomputations, and runs every micro-batch's backward but the
last one executed under the wrapper's ``no_sync()``: gradients accumulate, and the last backward
mixes and steps once, bucket by bucket, its exchanges running in the background while the earlier
stages finish their backward (autograd accumulates a parameter's gradient before it passes the
input's gradient on, so the bucket holding the stage's first layers steps just before that last
gradient goes upstream).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

from ..comm import CommGroup, PeerTimeoutError, SubGroup, agree_across_ranks, default_timeout, group_ranks, or_world
from ..comm.failures import start_heartbeat
from ..comm.wire import MalformedMessageError, broadcast_json
from .agreement import NO_FAILURE, Agreement
from .batchnorm import DeferredBatchNorm
from .checkpoint import checkpointing, recomputing
from .layers import build_stage, check_balance, check_no_shared_layers, layer_list
from .microbatch import TensorOrTensors, as_tuple, batch_size, check, gather, scatter
from .schedule import SCHEDULES, Action, max_alive, one_f_one_b
from .transport import Kind, Link

__all__ = ["AsyncPipe", "PipelineError", "CHECKPOINT_MODES"]

logger = logging.getLogger(__name__)

CHECKPOINT_MODES = ("always", "except_last", "never")
_COUNTS = 4  # per rank after its code: sent to prev, sent to next, consumed from prev, consumed from next


class PipelineError(RuntimeError):
    """A pipeline stage failed (``stage``); raised on the ranks other than the failing one."""

    def __init__(self, message: str, stage: int) -> None:
        super().__init__(message)
        self.stage = stage


class _PeerFailed(Exception):
    """A neighbour sent ERROR: stage ``origin`` failed with ``text``."""

    def __init__(self, origin: int, text: str, via: Link) -> None:
        super().__init__(text)
        self.origin, self.text, self.via = origin, text, via


class _GradTap(torch.autograd.Function):
    """Identity whose backward hands the gradients to ``hook`` instead of passing them on: the
    final stage's gathered output, whose hook runs each micro-batch's backward itself (so that a
    failure there reaches the other stages). The outputs are the user's to keep: tensors of their
    own to autograd (``detach()``: the same memory, no copy), which may be modified in place like
    any model output (``y.add_(1)``, a collective writing into ``y``)."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[Tuple[Optional[Tensor], ...]], None], *xs: Tensor) -> Tuple[Tensor, ...]:
        ctx.hook = hook
        return tuple(x.detach() for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[None, ...]:
        ctx.hook(grads)
        return (None,) * (len(grads) + 1)


class _Step:
    """One mini-batch on one stage: its micro-batches' inputs and outputs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.outputs: Dict[int, TensorOrTensors] = {}
        self.input_rg: Dict[int, bool] = {}      # micro-batch -> its inputs need gradients (upstream waits)
        self.answered: Dict[int, bool] = {}      # micro-batch -> GRAD/NOGRAD sent upstream
        self.losses: Dict[int, Tensor] = {}
        self.forwards = 0
        self.backwards = 0                       # micro-batch backwards run (or skipped) on this stage
        # micro-batch -> (inputs, positions that require grad, those received leaves): their .grad
        # after the micro-batch's backward is what goes upstream
        self.inputs: Dict[int, Tuple[int, List[int], List[Tensor]]] = {}


class AsyncPipe(nn.Module):
    """A sequential model split over the ranks of ``group``, one stage per rank (fairscale's
    ``AsyncPipe``).

    Args:
        module: an ``nn.Sequential``, or a list of layers (modules, or callables building them
            such as :class:`~decentpy.pipeline.LazyModule`: only the owning stage builds its layers).
        balance: layers per stage; stage ``i`` runs on group rank ``i``; ranks beyond the stages
            hold nothing (their ``forward`` returns its input). An empty module with an empty
            balance is an empty pipe: every rank returns its input (as fairscale's).
        group: the process group of the pipe (default: the world). Give each pipeline its own group
            (e.g. several pipelines side by side, their stages' replicas in data-parallel groups).
        worker_map: accepted for compatibility; not needed (no RPC).
        input_device: where the first stage puts its input (default: its layers' device).
        chunks: micro-batches per mini-batch (a batch smaller than that gives one per sample).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: micro-batches before the stop
            keep only their inputs (and RNG state) and are recomputed just before their backward;
            never in eval mode or without autograd.
        deferred_batch_norm: BatchNorm running statistics updated once per mini-batch
            (:class:`~decentpy.pipeline.DeferredBatchNorm`), as plain BatchNorm on the whole batch.
        schedule: the default of :meth:`train_step`: ``"gpipe"`` or ``"1f1b"``.
        timeout: the most any wait on another stage may take (default: the process group's).
    """

    def __init__(self, module: Union[nn.Sequential, List[Any]], balance: Sequence[int], *, group: Any = None,
                 worker_map: Optional[Dict[int, str]] = None, input_device: Any = None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False, schedule: str = "gpipe",
                 timeout: Union[None, float, datetime.timedelta] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("AsyncPipe needs torch.distributed: call torch.distributed.init_process_group(...) first")
        layers = layer_list(module)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
            raise ValueError(f"chunks must be a positive int (micro-batches per mini-batch), got {chunks!r}")
        if checkpoint not in CHECKPOINT_MODES:  # fairscale's text (its tests match it)
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {checkpoint!r})")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(repr(s) for s in SCHEDULES)}, got {schedule!r}")
        self.group = or_world(group)
        self._ranks = group_ranks(self.group)
        self.balance = check_balance(len(layers), balance, len(self._ranks))
        check_no_shared_layers(layers, self.balance)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self.worker_map = worker_map
        self.input_device = input_device
        self.timeout = (timeout if isinstance(timeout, datetime.timedelta) else
                        datetime.timedelta(seconds=float(timeout)) if timeout is not None else default_timeout())
        # The construction's one agreement (before any other collective): these shape every message.
        settings = {"balance": self.balance, "chunks": chunks, "checkpoint": checkpoint, "layers": len(layers),
                    "schedule": schedule, "deferred_batch_norm": bool(deferred_batch_norm)}
        start_heartbeat()  # so that a dead peer is named in any later failed wait
        agree_across_ranks(None, settings, "AsyncPipe's arguments", group=self.group)

        rank = dist.get_rank(self.group)
        self.num_stages = len(self.balance)
        self.stage: Optional[int] = rank if rank < self.num_stages else None
        self.final_stage = self.stage is not None and self.stage == self.num_stages - 1
        self.partition: Optional[nn.Sequential] = None
        if self.stage is not None:
            part = build_stage(layers, self.balance, self.stage)
            if deferred_batch_norm:
                part = DeferredBatchNorm.convert_deferred_batch_norm(part, chunks)
            self.partition = part
        elif self.num_stages:
            logger.warning("AsyncPipe: group rank %d holds no stage (%d stages on %d ranks)", rank, self.num_stages,
                           len(self._ranks))
        else:
            logger.debug("AsyncPipe: an empty pipe (no layers): every rank's forward returns its input")
        del module, layers

        nccl = dist.get_backend(self.group) == dist.Backend.NCCL
        self._wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._prev: Optional[Link] = None
        self._next: Optional[Link] = None
        down, up = self._direction_groups(nccl)
        self._own_groups: List[SubGroup] = [*down.values(), *up.values()]  # released by close()
        self._closed = False
        if self.stage is not None and self.stage > 0:
            s = self.stage - 1
            self._prev = Link(self._ranks[s], s, self.stage, self.group, self._wire, not nccl, self.timeout,
                              send_group=up.get(s), recv_group=down.get(s))
        if self.stage is not None and not self.final_stage:
            s = self.stage
            self._next = Link(self._ranks[s + 1], s + 1, self.stage, self.group, self._wire, not nccl, self.timeout,
                              send_group=down.get(s), recv_group=up.get(s))
        self._agreement = Agreement(self.group, self._ranks, rank, self._wire, not nccl, 1 + _COUNTS, self.timeout)
        self._stepping = False  # between _start and _finish_step: the agreement may be armed
        for link in self._links():
            link.before_wait = self._arm_agreement
        self._broken: Optional[str] = None
        self._here = self._wire  # this stage's device during a step (set by _start)
        self._pending: Optional[_Step] = None   # the final stage's step waiting for its user-driven backward
        # wrap_partition's wrapper, held in a tuple so that it is not a registered submodule: the
        # partition's parameters and state_dict keys stay where they are (the wrapper reads the
        # partition's train/eval mode, which pipe.train()/eval() set)
        self._wrapper: Tuple[nn.Module, ...] = ()

    def _direction_groups(self, nccl: bool) -> Tuple[Dict[int, SubGroup], Dict[int, SubGroup]]:
        """On gloo, per pair of neighbouring stages (s, s + 1) two groups of those two ranks: one for
        the downstream messages (activations), one for the upstream ones (gradients), so that each
        direction has its own connection (see :class:`~decentpy.pipeline.transport.Link`). Keyed by
        ``s``; this rank's entries only. Every rank of the group creates them, in the same order
        (collective on the world). NCCL: none (its links post nothing ahead)."""
        down: Dict[int, SubGroup] = {}
        up: Dict[int, SubGroup] = {}
        if nccl or self.num_stages < 2:
            return down, up
        groups = CommGroup(None if self.group is dist.group.WORLD else self.group)
        pg_timeout = max(self.timeout, datetime.timedelta(seconds=1))
        for s in range(self.num_stages - 1):
            for table in (down, up):
                sub = groups.new_subgroup([s, s + 1], pg_timeout)
                if sub is not None:
                    table[s] = sub
        return down, up

    # -- fairscale's container API ----------------------------------------------------------------
    @property
    def pipeline(self) -> Optional["AsyncPipe"]:
        """What runs this rank's stage: None on a rank without one (fairscale's test of an idle
        rank reads ``pipe.pipeline is None``); the pipe itself otherwise (fairscale's
        ``AsyncPipeline`` internals are not reproduced)."""
        return self if self.stage is not None else None

    @property
    def partitions(self) -> List[nn.Sequential]:
        """This rank's partitions (one, or none on an idle rank)."""
        return [self.partition] if self.partition is not None else []

    def __len__(self) -> int:
        """The number of layers this rank holds."""
        return len(self.partition) if self.partition is not None else 0

    def __getitem__(self, index: int) -> nn.Module:
        """A layer this rank holds (negative indices count from its last)."""
        if self.partition is None:
            raise IndexError("this rank holds no stage")
        layers = list(self.partition)
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer index {index} out of range: this rank holds {len(layers)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers this rank holds, in order."""
        return iter(list(self.partition) if self.partition is not None else [])

    # -- a data-parallel wrapper around this rank's partition ------------------------------------------
    def wrap_partition(self, wrap: Callable[[nn.Sequential], nn.Module]) -> Optional[nn.Module]:
        """Run this rank's partition through ``wrap(partition)`` (e.g. a ``DecentralizedDataParallel``
        over the stage's replicas) and return the wrapper; None on a rank without a stage (``wrap``
        is not called there). Call it on every stage rank before training (the wrapper's own
        construction may be a collective over its group).

        The wrapper must hold the partition itself (not a copy) and behave as decentpy's does: one
        training iteration per ``forward`` call, and a ``no_sync()`` context read at backward time.
        Per mini-batch the pipe calls it on the first micro-batch's forward only, and runs every
        micro-batch's backward but the last under ``no_sync()``, so the wrapper steps once per
        mini-batch, from the whole mini-batch's gradient (see the module's docstring)."""
        if self._wrapper:
            raise RuntimeError("wrap_partition was already called on this AsyncPipe; wrap the partition once")
        if self.partition is None:
            return None
        wrapper = wrap(self.partition)
        if not isinstance(wrapper, nn.Module):
            raise TypeError(f"wrap_partition: wrap(partition) must return a torch.nn.Module, got "
                            f"{type(wrapper).__name__}")
        held = {id(p) for p in wrapper.parameters()}
        missing = [n for n, p in self.partition.named_parameters() if id(p) not in held]
        if missing:
            raise ValueError(f"wrap_partition: the wrapper does not hold the partition's parameter '{missing[0]}'; "
                             "wrap the partition passed to wrap (not a copy of it)")
        self._wrapper = (wrapper,)
        return wrapper

    @property
    def partition_wrapper(self) -> Optional[nn.Module]:
        """The wrapper set by :meth:`wrap_partition` (None without one)."""
        return self._wrapper[0] if self._wrapper else None

    def _backward_scope(self, step: _Step) -> ContextManager[Any]:
        """Counts a micro-batch's backward: every one but the mini-batch's last runs under the
        wrapper's ``no_sync()`` (accumulate only); the last one lets it mix and step."""
        step.backwards += 1
        no_sync = getattr(self._wrapper[0], "no_sync", None) if self._wrapper else None
        if no_sync is None or step.backwards >= step.count:
            return contextlib.nullcontext()
        return no_sync()

    @property
    def devices(self) -> List[torch.device]:
        return [self._device()]

    def _device(self) -> torch.device:
        """Where this stage computes: its layers' device (the wire's when it has no tensors)."""
        if self.partition is not None:
            t = next(itertools.chain(self.partition.parameters(), self.partition.buffers()), None)
            if t is not None:
                return t.device
        return self._wire

    # -- driving it as fairscale does ---------------------------------------------------------------
    def forward(self, input: Any = None, *, event: Any = None) -> Any:  # type: ignore[override]
        """Run the mini-batch through the pipeline (every rank calls it; only the first stage's
        ``input`` is used). Returns the gathered output on the final stage (with autograd, as the
        unpipelined model's: a tensor, or a tuple as long as the last layer's, a tensor of the
        caller's to modify in place if it likes), this stage's micro-batch outputs (detached)
        elsewhere, ``input`` on an idle rank or an empty pipe. In training with autograd on, a
        non-final stage returns after its part of the backward (driven by the final stage's
        ``loss.backward()``)."""
        if self.num_stages == 0:  # an empty pipe: the identity, as fairscale's (no stage, no messages)
            check(input)
            return input
        self._start()
        grad = self.training and torch.is_grad_enabled()
        result: Any = input
        finish = True
        try:
            with torch.set_grad_enabled(grad):
                if self.stage is not None:
                    self._refuse_grads_of_grads(grad)
                    step = self._forward_all(input, grad)
                    if self.final_stage:
                        result, finish = self._final_output(step, grad)
                    else:
                        result = [_detached(step.outputs[j]) for j in range(step.count)]
                        if grad:
                            self._serve_backward(step)
                        self._answer_all(step)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it before raising
            self._fail(exc)
        if finish:
            self._finish_step(None)
        return result

    def back_helper(self, output: Any) -> None:
        """fairscale's backward service for non-final stages. decentpy's ``forward`` already served
        it, so this only checks the call (kept so that fairscale scripts run unchanged)."""
        if self.final_stage:
            raise ValueError("back_helper should only be called on non-final stages (the final stage calls "
                             "loss.backward())")

    # -- a whole schedule ----------------------------------------------------------------------------
    def train_step(self, x: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], *,
                   schedule: Optional[str] = None) -> Optional[Tensor]:
        """Forward and backward of one mini-batch with the GPipe or 1F1B schedule (every rank calls
        it; ``x`` matters on the first stage, ``target`` on the final one). ``loss_fn(output,
        target)`` is applied per micro-batch and weighted by the micro-batch's share of the batch,
        so a mean-reduced loss gives the gradients of the whole batch's loss. Returns that loss
        (detached) on the final stage, None elsewhere; parameter gradients accumulate in
        ``.grad`` as after ``loss.backward()``. In eval mode or under ``torch.no_grad()`` it only
        runs the forward (the loss is still returned). An empty pipe returns None (no stage holds
        a loss)."""
        name = schedule if schedule is not None else self.schedule
        if name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(repr(s) for s in SCHEDULES)}, got {name!r}")
        if self.num_stages == 0:
            return None
        self._start()
        grad = self.training and torch.is_grad_enabled()
        loss: Optional[Tensor] = None
        try:
            with torch.set_grad_enabled(grad):
                if self.stage is not None:
                    self._refuse_grads_of_grads(grad)
                    loss = self._run_schedule(x, target, loss_fn, name, grad)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        self._finish_step(None)
        return loss

    # -- one step, step by step --------------------------------------------------------------------
    def _arm_agreement(self) -> None:
        """Before a blocking wait inside a step: post the step's agreement now, where this stage
        waits anyway (see :meth:`Agreement.arm`). Not while a step ends (reading what a failed step
        left): receives armed then would outlive the step, and a later pipe on the same group could
        have its agreement's messages taken by them."""
        if self._stepping:
            self._agreement.arm()

    def close(self) -> None:
        """Release the process groups the pipe made for itself (on gloo, two per pair of neighbouring
        stages). The stage keeps its layers and their trained parameters; the pipe cannot run
        another step. Idempotent; local (no collective); also called by ``with AsyncPipe(...) as
        pipe:``. Call it on every rank, after the last step, before destroying the process group
        the pipe was built on."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        for sub in self._own_groups:
            sub.destroy()
        self._own_groups = []

    def __enter__(self) -> "AsyncPipe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("AsyncPipe: this pipe was closed (close()); build a new AsyncPipe to train again")
        if self._broken is not None:
            raise RuntimeError(f"AsyncPipe: {self._broken}; build a new AsyncPipe (its message streams are out of "
                               "step)")
        if self._pending is not None:
            # the other stages still wait for that step's gradients: end it, as a failure, everywhere
            self._pending = None
            self._fail(RuntimeError(
                "AsyncPipe: the final stage ran forward again before the backward of the previous training "
                "output (in training with autograd on, call backward on a loss of the output, or run the "
                "forward under torch.no_grad() / in eval mode)"))
        self._stepping = True
        self._here = self._device()  # once per step, not per message (the layers do not move mid-step)

    def _refuse_grads_of_grads(self, grad: bool) -> None:
        """Gradients of gradients cannot cross stages (the gradients travel as plain tensors), so a
        training forward is refused when a parameter's gradient requires grad -- what a backward
        with ``create_graph=True`` leaves -- before this stage computes or sends anything (as
        fairscale refuses it at forward). The backward itself refuses it too, where it can see it
        (the final stage's output)."""
        if not grad or self.partition is None:
            return
        for name, p in self.partition.named_parameters():
            if p.grad is not None and p.grad.requires_grad:
                raise RuntimeError(f"AsyncPipe stage {self.stage}: parameter '{name}' has a gradient that requires "
                                   "grad (left by a backward with create_graph=True); gradients of gradients cannot "
                                   "cross pipeline stages. Set the parameters' .grad to None before the next step")

    def _checkpointed(self, mb: int, count: int, grad: bool) -> bool:
        if not grad:
            return False
        stop = {"always": count, "except_last": count - 1, "never": 0}[self.checkpoint]
        return mb < stop

    def _first_inputs(self, input: Any) -> List[TensorOrTensors]:
        check(input)
        batch_size(input)
        if self.input_device is not None:
            input = tuple(t.to(self.input_device) for t in input) if isinstance(input, tuple) else \
                input.to(self.input_device)
        return scatter(input, self.chunks)

    def _receive_input(self, mb: int, step_count: Optional[int]) -> Tuple[TensorOrTensors, int, bool]:
        """Micro-batch ``mb``'s inputs from the previous stage: (inputs -- a tuple when the
        previous stage's output was one --, the step's count, whether the previous stage waits for
        their gradients)."""
        assert self._prev is not None
        msg = self._prev.recv(f"the activations of micro-batch {mb}")
        if msg.kind == Kind.ERROR:
            raise _PeerFailed(msg.mb, msg.text, self._prev)
        if msg.kind != Kind.DATA or msg.mb != mb or (step_count is not None and msg.count != step_count):
            raise RuntimeError(f"stage {self.stage}: expected the activations of micro-batch {mb}, got {msg.kind.name} "
                               f"for micro-batch {msg.mb} (count {msg.count}): the stages disagree on the schedule")
        device = self._here
        grad = torch.is_grad_enabled()
        xs = []
        for t, rg in zip(msg.tensors, msg.requires_grad):
            assert t is not None
            t = t.to(device)
            if grad and rg and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            xs.append(t)
        return (tuple(xs) if msg.is_tuple else xs[0]), msg.count, any(msg.requires_grad)

    def _run_partition(self, mb: int, step: _Step, inputs: TensorOrTensors, checkpointed: bool) -> TensorOrTensors:
        """The stage's layers on one micro-batch, checkpointed when asked. The received inputs that
        require grad are autograd leaves: their ``.grad`` after the micro-batch's backward goes
        upstream (as torch's pipelining does; an autograd Function around them cost 15-45 us a
        micro-batch, on the critical path), and a layer cannot modify them in place (which would
        corrupt them for a checkpointed micro-batch's recomputation)."""
        assert self.partition is not None
        xs = list(as_tuple(inputs))
        single = not isinstance(inputs, tuple)
        diff = [i for i, t in enumerate(xs) if t.requires_grad] if self.stage != 0 else []
        if diff:
            leaves = [xs[i] for i in diff]
            step.inputs[mb] = (len(xs), diff, leaves)
            if self._wrapper:  # sent from inside the backward (see _send_input_grads)
                torch.autograd.graph.register_multi_grad_hook(
                    leaves, _step_hook(step, lambda s, grads: self._send_input_grads(s, mb, grads)), mode="all")
        part = self.partition
        # a wrapper counts iterations by its forward calls: it sees the mini-batch's first micro-batch
        first = self._wrapper[0] if self._wrapper and step.forwards == 0 and torch.is_grad_enabled() else part
        try:
            out = self._call_partition(part, xs, single, checkpointed, first)
        except RuntimeError as exc:
            if diff and "leaf Variable that requires grad is being used in an in-place operation" in str(exc):
                raise RuntimeError(f"stage {self.stage}: a layer modified in place a tensor that requires grad and "
                                   "has no history -- most likely the activations it received from the previous "
                                   "stage; use an out-of-place operation (or clone the input first). "
                                   f"torch: {exc}") from exc
            raise
        check(out, f"the output of stage {self.stage}")
        return out

    @staticmethod
    def _call_partition(part: nn.Module, xs: List[Tensor], single: bool, checkpointed: bool,
                        first: Optional[nn.Module] = None) -> TensorOrTensors:
        """``first`` (default: ``part``) runs the forward, ``part`` any recomputation."""
        first = part if first is None else first
        if not checkpointed:
            out = first(xs[0] if single else tuple(xs))
        else:
            calls = [0]

            def run(*args: Tensor) -> TensorOrTensors:
                calls[0] += 1
                arg = args[0] if single else tuple(args)
                if calls[0] == 1:
                    with checkpointing():
                        return first(arg)
                with recomputing():  # DeferredBatchNorm counts the first run only
                    return part(arg)

            out = torch.utils.checkpoint.checkpoint(run, *xs, use_reentrant=False, preserve_rng_state=True)
        return out

    def _send_input_grads(self, step: _Step, mb: int, grads: Sequence[Optional[Tensor]]) -> None:
        """Micro-batch ``mb``'s input gradients upstream (``grads``: one per received leaf, None
        where the backward did not reach it): GRAD, or NOGRAD when it reached none. With a
        data-parallel wrapper on the stage they are sent from inside the backward, as soon as
        autograd has them (the upstream stage's backward then overlaps the wrapper's hooks);
        without one, once the backward returns (:meth:`_release_upstream`): sending from inside
        the autograd backward cost measurably more CPU time than after it (1F1B, 2 stages on 2
        cores: +10-30% CPU per step), for no earlier start upstream: what remains of the backward
        after the first layer's input gradient is the accumulation of its parameters' gradients."""
        width, diff, _ = step.inputs.pop(mb)
        full: List[Optional[Tensor]] = [None] * width
        for i, g in zip(diff, grads):
            full[i] = g
        assert self._prev is not None
        if all(g is None for g in full):
            self._prev.send(Kind.NOGRAD, mb, step.count, [])
        else:
            self._prev.send(Kind.GRAD, mb, step.count, full)
        step.answered[mb] = True

    def _answer_upstream(self, step: _Step, mb: int) -> None:
        """NOGRAD upstream for a micro-batch whose backward did not reach this stage's inputs."""
        if self._prev is not None and step.input_rg.get(mb) and not step.answered.get(mb):
            self._prev.send(Kind.NOGRAD, mb, step.count, [])
            step.answered[mb] = True

    def _answer_all(self, step: _Step) -> None:
        """The end of a step on a stage: the previous stage waits for an answer to every
        micro-batch it sent with gradients on (NOGRAD where no backward ran here: eval mode or
        no_grad on this rank only)."""
        for j in range(step.count):
            self._answer_upstream(step, j)

    def _forward_one(self, step: _Step, mb: int, inputs: TensorOrTensors, grad: bool,
                     upstream_waits: bool = False) -> TensorOrTensors:
        """``upstream_waits``: the previous stage waits for this micro-batch's input gradients."""
        step.input_rg[mb] = upstream_waits
        out = self._run_partition(mb, step, inputs, self._checkpointed(mb, step.count, grad))
        step.outputs[mb] = out
        step.forwards += 1
        if self._next is not None:
            ys = as_tuple(out)
            self._next.send(Kind.DATA, mb, step.count, [y.detach() for y in ys], [y.requires_grad for y in ys],
                            isinstance(out, tuple))
        if step.forwards == step.count:
            self._commit_batch_norm()
        return out

    def _commit_batch_norm(self) -> None:
        if self.partition is not None and self.training:
            for m in self.partition.modules():
                if isinstance(m, DeferredBatchNorm):
                    m.commit()

    def _forward_all(self, input: Any, grad: bool) -> _Step:
        """GPipe's forward phase: every micro-batch through this stage, in order."""
        if self.stage == 0:
            mbs = self._first_inputs(input)
            step = _Step(len(mbs))
            for j, x in enumerate(mbs):
                self._forward_one(step, j, x, grad)
            return step
        x, count, waits = self._receive_input(0, None)
        step = _Step(count)
        # receives posted at once: training keeps every micro-batch alive here (GPipe), and the
        # buffers become those activations; a forward-only pass keeps none
        depth = count if grad else self._forward_only_depth(count)
        for j in range(count):
            if j > 0:
                x, _, waits = self._receive_input(j, count)
            if j + 1 < count:  # the later micro-batches' receives, before this one's compute
                self._prev.prepost(min(count - 1 - j, depth))
            self._forward_one(step, j, x, grad, waits)
        return step

    def _backward_one(self, step: _Step, mb: int, grads: Optional[Sequence[Optional[Tensor]]]) -> None:
        """Micro-batch ``mb``'s backward through this stage, from its outputs' gradients (None:
        none came); its inputs' gradients go upstream."""
        out = step.outputs.pop(mb)
        with self._backward_scope(step):
            if grads is not None:
                pairs = [(y, g) for y, g in zip(as_tuple(out), grads) if g is not None and y.requires_grad]
                if pairs:
                    torch.autograd.backward([y for y, _ in pairs], [g.to(y.device) for y, g in pairs])
        del out
        self._release_upstream(step, mb)

    def _release_upstream(self, step: _Step, mb: int) -> None:
        """Micro-batch ``mb``'s answer to the previous stage: its input gradients (the received
        leaves' ``.grad``), or NOGRAD where the backward reached none of them."""
        entry = step.inputs.get(mb)
        if entry is not None:  # not yet sent from inside the backward
            self._send_input_grads(step, mb, [x.grad for x in entry[2]])
        self._answer_upstream(step, mb)

    def _forward_only_depth(self, count: int) -> int:
        """How many forwards' receives a forward-only pass posts at once (it keeps no activations,
        so no more receive buffers than 1F1B keeps micro-batches alive on this stage)."""
        return max_alive(one_f_one_b(count, self.num_stages, self.stage))

    def _expects_grad(self, step: _Step, mb: int) -> bool:
        return any(y.requires_grad for y in as_tuple(step.outputs[mb]))

    def _receive_grad(self, step: _Step, mb: Optional[int]) -> Tuple[int, Optional[List[Optional[Tensor]]]]:
        assert self._next is not None
        msg = self._next.recv("gradients" if mb is None else f"the gradients of micro-batch {mb}")
        if msg.kind == Kind.ERROR:
            raise _PeerFailed(msg.mb, msg.text, self._next)
        if msg.kind not in (Kind.GRAD, Kind.NOGRAD) or (mb is not None and msg.mb != mb) or msg.mb not in step.outputs:
            raise RuntimeError(f"stage {self.stage}: expected gradients{'' if mb is None else f' of micro-batch {mb}'}, "
                               f"got {msg.kind.name} for micro-batch {msg.mb}: the stages disagree on the schedule")
        return msg.mb, (msg.tensors if msg.kind == Kind.GRAD else None)

    def _serve_backward(self, step: _Step) -> None:
        """A non-final stage's backward, driven by the gradients arriving from the next stage (in
        the order the final stage's backward produces them)."""
        waiting = {j for j in step.outputs if self._expects_grad(step, j)}
        for j in [j for j in step.outputs if j not in waiting]:
            self._backward_one(step, j, None)
        while waiting:
            j, grads = self._receive_grad(step, None)
            waiting.discard(j)
            if waiting:
                self._next.prepost()  # the next gradient's receive, before this one's backward
            self._backward_one(step, j, grads)

    def _final_output(self, step: _Step, grad: bool) -> Tuple[TensorOrTensors, bool]:
        """The gathered output of the final stage, and whether the step ends now. With autograd it
        comes out of a :class:`_GradTap`, whose backward runs the micro-batches' backward and ends the
        step then."""
        outs = [step.outputs[j] for j in range(step.count)]
        joined = list(as_tuple(gather([_detached(o) for o in outs])))
        structured = tuple if isinstance(outs[0], tuple) else (lambda ts: ts[0])  # as the last layer returned
        diff = [i for i in range(len(joined)) if any(as_tuple(o)[i].requires_grad for o in outs)]
        if not grad or not diff:  # no backward will come: the step ends here
            self._answer_all(step)
            step.outputs.clear()
            return structured(joined), True
        sizes = [as_tuple(o)[0].shape[0] for o in outs]
        leaves = [joined[i].requires_grad_(True) for i in diff]
        width = len(joined)
        owned = _GradTap.apply(_step_hook(step, lambda s, grads: self._final_backward(s, sizes, width, diff, grads)),
                               *leaves)
        for i, v in zip(diff, owned):
            joined[i] = v
        self._pending = step
        return structured(joined), False

    def _final_backward(self, step: _Step, sizes: List[int], width: int, diff: List[int],
                        grads: Sequence[Optional[Tensor]]) -> None:
        """Inside the user's ``loss.backward()``: each micro-batch's backward (the last first, as
        GPipe), then the end of the step; a failure reaches every stage."""
        if self._pending is not step:
            raise RuntimeError("AsyncPipe: backward of an output whose step already ended (a later forward "
                               "ran, or this backward already ran once)")
        self._pending = None
        try:
            if torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
                raise RuntimeError("AsyncPipe: backward with create_graph=True (gradients of gradients) is not "
                                   "supported: the gradients cross the pipeline stages as plain tensors")
            per_mb: List[List[Optional[Tensor]]] = [[None] * width for _ in sizes]
            for i, g in zip(diff, grads):
                if g is None:
                    continue
                for j, part in enumerate(torch.split(g, sizes)):
                    per_mb[j][i] = part
            for j in reversed(range(step.count)):
                self._backward_one(step, j, per_mb[j])
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        self._finish_step(None)

    def _run_schedule(self, x: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor], name: str,
                      grad: bool) -> Optional[Tensor]:
        """One mini-batch with the ``name`` schedule.

        Receives posted ahead: right after an action's receive, before its compute, the receives of
        the next messages on that link are posted (the later forwards' activations, as many as the
        schedule keeps alive; the next backward's gradients, once that micro-batch's forward has
        run here), so they move while this action computes, and gloo's receiving thread does not
        spin on a message that arrived before its receive (see :mod:`~decentpy.pipeline.transport`).
        With one connection per link, posting ahead while the two directions alternate (1F1B's
        steady state) cost more than it gained: gloo guards each connection with one lock, which
        its receiving thread holds while it reads a message, and a message arriving while this
        stage sent the other way on that connection made the send wait for that thread (with more
        threads than cores, for a core: single sends of several milliseconds, 1F1B 20-30% slower).
        On gloo each direction now has its own connection (:meth:`_direction_groups`), so every
        phase posts ahead; on NCCL nothing is posted ahead (see :mod:`~decentpy.pipeline.transport`)."""
        first: Optional[Tuple[TensorOrTensors, bool]] = None
        if self.stage == 0:
            mbs: Optional[List[TensorOrTensors]] = self._first_inputs(x)
            count = len(mbs)
        else:
            mbs = None
            x0, count, waits0 = self._receive_input(0, None)
            first = (x0, waits0)
        step = _Step(count)
        targets: Optional[List[Any]] = None
        weights: List[float] = []
        actions: List[Action] = SCHEDULES[name](count, self.num_stages, self.stage)
        # receives of later forwards posted at once: as many micro-batches as the schedule keeps
        # alive here in training (the buffers become those activations: every one in GPipe)
        depth = max_alive(actions) if grad else self._forward_only_depth(count)
        # per action: the forwards that come later, and the micro-batch of the next backward
        later_forwards = [0] * len(actions)
        next_backward: List[Optional[int]] = [None] * len(actions)
        for i in range(len(actions) - 2, -1, -1):
            nb = actions[i + 1]
            later_forwards[i] = later_forwards[i + 1] + int(nb.forward)
            next_backward[i] = nb.mb if not nb.forward else next_backward[i + 1]
        for i, a in enumerate(actions):
            if a.forward:
                waits = False
                if mbs is not None:
                    inp = mbs[a.mb]
                elif a.mb == 0 and first is not None:
                    inp, waits = first
                else:
                    inp, _, waits = self._receive_input(a.mb, count)
                if self._prev is not None and later_forwards[i]:
                    self._prev.prepost(min(later_forwards[i], depth))  # see the docstring
                out = self._forward_one(step, a.mb, inp, grad, waits)
                if grad and self._grad_will_come(step, next_backward[i]):
                    self._next.prepost()  # the gradients of the next backward, while this stage moves on
                if self.final_stage:
                    if targets is None:
                        targets, weights = self._split_target(target, step, out)
                    loss = loss_fn(out, targets[a.mb])
                    if not isinstance(loss, Tensor) or loss.numel() != 1:
                        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                        + (f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""))
                    step.losses[a.mb] = loss.reshape(()) * weights[a.mb]
            elif not grad:
                # no backward here; where the previous stage trains and waits, NOGRAD in the
                # schedule's order (the order in which it waits for gradients)
                step.outputs.pop(a.mb)
                self._answer_upstream(step, a.mb)
            elif self.final_stage:
                step.outputs.pop(a.mb)
                loss = step.losses[a.mb]
                with self._backward_scope(step):
                    if loss.requires_grad:
                        loss.backward()
                self._release_upstream(step, a.mb)
            else:
                if self._expects_grad(step, a.mb):
                    _, grads = self._receive_grad(step, a.mb)
                else:
                    grads = None
                if self._grad_will_come(step, next_backward[i]):
                    self._next.prepost()  # see the docstring
                self._backward_one(step, a.mb, grads)
        self._answer_all(step)
        if self.final_stage:
            return torch.stack([step.losses[j].detach() for j in range(count)]).sum()
        return None

    def _grad_will_come(self, step: _Step, mb: Optional[int]) -> bool:
        """Whether the next stage will send gradients for micro-batch ``mb`` (the next backward's)
        in this step: its forward ran here and an output requires grad."""
        return self._next is not None and mb is not None and mb in step.outputs and self._expects_grad(step, mb)

    def _split_target(self, target: Any, step: _Step, first_out: TensorOrTensors) -> Tuple[List[Any], List[float]]:
        """The target cut as the batch was (sizes from the micro-batches), and each one's weight."""
        check(target, "train_step's target (on the final stage)")
        n = batch_size(target, "train_step's target")
        parts = scatter(target, step.count)
        sizes = [batch_size(p, "train_step's target") for p in parts]
        if sizes[0] != as_tuple(first_out)[0].shape[0]:
            raise ValueError(f"train_step's target has {n} rows, which do not split as the input's micro-batches "
                             f"(first micro-batch {as_tuple(first_out)[0].shape[0]} rows, target's {sizes[0]})")
        return parts, [s / n for s in sizes]

    # -- ending a step ---------------------------------------------------------------------------------
    def _links(self) -> List[Link]:
        return [link for link in (self._prev, self._next) if link is not None]

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes of the message buffers this stage holds for its neighbours' messages (gloo; they
        are reused from step to step): a training GPipe step holds one per micro-batch (they become
        the activations its backward keeps), a forward-only pass or 1F1B only as many as it keeps
        in flight."""
        return sum(link.receive_buffer_bytes for link in self._links())

    def _fail(self, exc: BaseException) -> None:
        """This step failed here (or a neighbour said so): tell the neighbours that may wait for a
        message, agree with every rank, raise."""
        if isinstance(exc, _PeerFailed):
            origin, text, skip = exc.origin, exc.text, exc.via
        else:
            origin, text, skip = (self.stage if self.stage is not None else -1), f"{type(exc).__name__}: {exc}", None
        if isinstance(exc, PeerTimeoutError):  # a stage may be gone: no agreement is possible
            self._broken = f"a wait timed out ({exc})"
            raise exc
        for link in self._links():
            if link is not skip:
                try:
                    link.send_error(origin, text)
                except Exception:  # noqa: BLE001 - the neighbour may be gone; the timeout bounds the rest
                    logger.debug("could not tell stage %d about the failure", link.peer_stage, exc_info=True)
        self._pending = None
        self._finish_step((origin, text, exc if not isinstance(exc, _PeerFailed) else None))

    def _counts(self) -> List[int]:
        """This rank's row of the agreement after its code: messages sent to and consumed from
        (received, or a receive posted ahead) each neighbour."""
        prev, nxt = self._prev, self._next
        return [prev.sent if prev else 0, nxt.sent if nxt else 0, prev.consumed if prev else 0,
                nxt.consumed if nxt else 0]

    def _finish_step(self, failure: Optional[Tuple[int, str, Optional[BaseException]]]) -> None:
        """The end of every step on every rank of the group: the agreement says whether (and where)
        a stage failed. After a failure the stages settle their links from every rank's counts
        (read what is left unread, fill the receives posted ahead; so the next step starts in
        step), then every rank raises."""
        code = NO_FAILURE if failure is None else failure[0]
        self._stepping = False
        try:
            origin, table = self._agreement.agree(code, self._counts())
            if origin != NO_FAILURE:
                assert table is not None
                self._settle(table)
            for link in self._links():
                link.finish()
        except Exception as exc:
            self._broken = f"a stage did not finish the step ({exc})"
            raise
        if origin == NO_FAILURE:
            return
        mine = failure[1] if failure is not None and failure[0] == origin and failure[2] is not None else None
        src = self._ranks[origin] if origin >= 0 else None
        text: Any = None
        if src is not None:  # the failing stage's message, as JSON text (nothing of it runs here)
            try:
                text = broadcast_json(mine, origin, self.group, f"AsyncPipe stage {origin}'s error message")
            except MalformedMessageError as exc:
                text = f"(its error message could not be read: {exc})"
            if text is not None and not isinstance(text, str):
                text = f"(its error message was not a text: {type(text).__name__})"
        own = failure[2] if failure is not None and failure[0] == origin else None
        if own is not None and self.stage == origin:
            if hasattr(own, "add_note"):
                own.add_note(f"(raised on AsyncPipe stage {origin}; every stage of the pipe raised)")
            raise own
        raise PipelineError(f"AsyncPipe stage {origin} (rank {src}) failed: {text}", origin)

    def _settle(self, table: List[List[int]]) -> None:
        """After a failed step (the failure path only): fill what each neighbour posted ahead
        and this stage never sent, then read what it sent and this stage did not read. The fills
        go first: they never wait (the neighbour's receives are posted), the reads may."""
        # a neighbour's row: [code, sent to its prev, sent to its next, consumed from prev, from next];
        # the previous stage's link to this one is its "next", the next stage's is its "prev"
        if self._prev is not None:
            self._prev.fill(table[self._prev.peer_stage][4])
        if self._next is not None:
            self._next.fill(table[self._next.peer_stage][3])
        if self._prev is not None:
            self._prev.settle(table[self._prev.peer_stage][2])
        if self._next is not None:
            self._next.settle(table[self._next.peer_stage][1])


def _step_hook(step: _Step, fn: Callable[[_Step, Tuple[Optional[Tensor], ...]], None]
               ) -> Callable[[Tuple[Optional[Tensor], ...]], None]:
    """A :class:`_GradTap` (or multi-grad) hook that runs ``fn(step, grads)``, holding ``step``
    weakly. The hook lives in the step's autograd graph, which the step reaches (its outputs, the
    final stage's losses): a strong reference back from it would make a cycle through C++ autograd
    nodes that Python's garbage collector cannot see through, and every step's received
    activations would stay alive for good (found as a leak of every receive buffer of the final
    stage)."""
    ref = weakref.ref(step)

    def hook(grads: Tuple[Optional[Tensor], ...]) -> None:
        alive = ref()
        if alive is None:
            raise RuntimeError("AsyncPipe: backward of an output whose step already ended (a later forward ran)")
        fn(alive, grads)

    return hook


def _detached(value: TensorOrTensors) -> TensorOrTensors:
    return tuple(t.detach() for t in value) if isinstance(value, tuple) else value.detach()

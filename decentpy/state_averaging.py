"""Averaging an adaptive optimizer's state across the workers: a remedy for the per-worker Adam gap.

Each worker of a decentralized job steps its own AdamW on its share of the global batch (a quarter of
it on 4 workers). Averaging the parameters does not average what Adam divides by: a worker's second
moment ``exp_avg_sq`` is estimated from its own, noisier gradients, and its first moment follows its
own batch only. :class:`OptimizerStateAveraging` all-reduces the chosen state tensors over the
wrapper's group every ``every`` steps, so every worker's Adam moves with the group's statistics
(docs/guide/ddp.md, "Adam on a share of the batch", gives what it costs and what it measured).

It is a separate part, called by the training loop after ``backward()``: the wrapper, its buckets,
kernels and communicators are unchanged, and the exchange in flight is not waited for (optimizer
state is not what the exchange carries).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .comm.agreement import agree_across_ranks

__all__ = ["OptimizerStateAveraging", "ADAM_STATES"]

#: the state tensors of decentpy's and torch's Adam family
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _state_tensors(opt: torch.optim.Optimizer, name: str) -> List[Tensor]:
    """``name``'s tensors of ``opt``: its flat block when decentpy's fused optimizer keeps one (no
    copy), else the per-parameter tensors in parameter order (torch's optimizers)."""
    block = getattr(opt, "state_block", None)
    if callable(block):
        flat = block(name)
        if flat is not None:
            return [flat]
    return [opt.state[p][name] for g in opt.param_groups for p in g["params"]
            if isinstance(opt.state.get(p, {}).get(name), Tensor)]


class OptimizerStateAveraging:
    """Every ``every`` calls to :meth:`step`, replace the named optimizer-state tensors of every
    rank of ``ddp``'s group by their mean over the group.

    Args:
        ddp: a :class:`decentpy.DecentralizedDataParallel` (anything with ``state_optimizers``,
            ``process_group`` and ``intra_node``).
        every: average once per this many steps (1: every step; the cost is one all-reduce of the
            states' size, i.e. the model's size per state, on each averaging step).
        states: the optimizer-state names, default Adam's second moment ``("exp_avg_sq",)``;
            ``ADAM_STATES`` averages both moments.

    Call :meth:`step` on every rank after each ``backward()`` (where the wrapper has stepped). The
    settings are checked equal on every rank at construction, and the states' sizes at the first
    averaging, before the all-reduce, so a mismatch raises on every rank instead of hanging. A
    non-finite mean (a faulty peer's state) leaves that element of this rank's own state as it was.
    """

    def __init__(self, ddp: Any, every: int = 1, states: Sequence[str] = ("exp_avg_sq",)) -> None:
        group = getattr(ddp, "process_group", None)
        failure: Optional[BaseException] = None
        try:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"OptimizerStateAveraging: every must be an int >= 1 (1: every step), got {every!r}")
            if isinstance(states, str) or not states or not all(isinstance(s, str) and s for s in states):
                raise ValueError("OptimizerStateAveraging: states must be a non-empty sequence of optimizer-state "
                                 f"names such as ('exp_avg_sq',) or decentpy.state_averaging.ADAM_STATES, got "
                                 f"{states!r}")
            if len(set(states)) != len(states):
                raise ValueError(f"OptimizerStateAveraging: states names a state twice: {tuple(states)!r}")
            if not hasattr(ddp, "state_optimizers"):
                raise TypeError("OptimizerStateAveraging takes a decentpy.DecentralizedDataParallel, got "
                                f"{type(ddp).__name__}")
            if getattr(ddp, "intra_node", "gossip") == "shard":
                raise ValueError("OptimizerStateAveraging: with intra_node='shard' each rank's optimizer holds a "
                                 "different piece of the state, which cannot be averaged rank with rank; use "
                                 "intra_node='gossip' or 'allreduce'")
        except (ValueError, TypeError) as exc:
            failure = exc
        agree_across_ranks(failure, {"every": every, "states": tuple(states) if failure is None else ()},
                           "OptimizerStateAveraging", group)
        self._ddp = ddp
        self._group = group
        self.every = every
        self.states: Tuple[str, ...] = tuple(states)
        self._calls = 0
        self._checked = False
        self.averaged = 0  #: averagings done so far

    def _tensors(self) -> Dict[str, List[Tensor]]:
        return {name: [t for opt in self._ddp.state_optimizers for t in _state_tensors(opt, name)]
                for name in self.states}

    @torch.no_grad()
    def step(self) -> bool:
        """Count one training step; on every ``every``-th, average the states. True when it averaged."""
        self._calls += 1
        if self._calls % self.every:
            return False
        found = self._tensors()
        if not self._checked:  # once: the same states of the same sizes everywhere, before the all-reduce
            failure: Optional[BaseException] = None
            missing = [n for n, ts in found.items() if not ts]
            if missing:
                failure = ValueError(f"OptimizerStateAveraging: the optimizers hold no state {missing!r} (states "
                                     "appear after the first step; Adam's are 'exp_avg' and 'exp_avg_sq')")
            sizes = {n: [int(t.numel()) for t in ts] for n, ts in found.items()}
            agree_across_ranks(failure, {"state sizes": sizes}, "OptimizerStateAveraging", self._group)
            self._checked = True
        world = dist.get_world_size(self._group)
        for tensors in found.values():
            flat = tensors[0] if len(tensors) == 1 and tensors[0].is_contiguous() else torch.cat(
                [t.reshape(-1) for t in tensors])
            mean = flat.clone()
            dist.all_reduce(mean, group=self._group)
            mean.div_(world)
            # a faulty peer's non-finite state does not replace this rank's (elementwise, no host sync)
            flat.copy_(torch.where(torch.isfinite(mean), mean, flat))
            if flat is not tensors[0]:
                offset = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n
        self.averaged += 1
        return True

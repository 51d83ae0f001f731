"""Which parameters decentpy steps inside the backward, and a guard against stepping them twice.

A torch DDP habit survives the move to decentpy: ``opt = torch.optim.AdamW(model.parameters())``
and ``opt.step(); opt.zero_grad()`` after each backward. The wrapper has already stepped those
parameters inside the backward (with the optimizer of its ``optim_fn``), so the second optimizer
applies its weight decay and moment updates again, silently: a different training. torch's global
optimizer step pre-hook sees every ``step()`` of every torch optimizer in the process; it refuses
one that would step a parameter a layout has claimed, before anything is modified, unless the
optimizer is decentpy's own (a bucket's) or the user allowed it (:func:`allow`: a second optimizer
on some parameters on purpose).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Dict, List, Sequence, Tuple

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["claim", "release", "own", "allow"]

_tokens = itertools.count(1)
#: id(parameter) -> (weak reference to it, its name, the claims that hold it)
_claimed: Dict[int, Tuple["weakref.ref[Tensor]", str, set]] = {}
_owned: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_allowed: "weakref.WeakSet[Optimizer]" = weakref.WeakSet()
_hook: List[Any] = []


def claim(params: Sequence[Tensor], names: Sequence[str]) -> int:
    """Record that decentpy steps ``params`` inside the backward; returns the claim's token for
    :func:`release`. Installs the step guard the first time."""
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_before_step))
    token = next(_tokens)
    for p, name in zip(params, names):
        entry = _claimed.get(id(p))
        if entry is None or entry[0]() is not p:
            entry = (weakref.ref(p), name, set())
            _claimed[id(p)] = entry
        entry[2].add(token)
    return token


def release(token: int) -> None:
    """Forget a claim (the wrapper was closed: a torch optimizer may step those parameters again)."""
    for key in [k for k, (_, _, tokens) in _claimed.items() if token in tokens]:
        tokens = _claimed[key][2]
        tokens.discard(token)
        if not tokens:
            del _claimed[key]


def own(optimizer: Optimizer) -> None:
    """``optimizer`` is decentpy's (a bucket's): its steps are the in-backward steps themselves."""
    _owned.add(optimizer)


def allow(optimizer: Optimizer) -> None:
    """Let ``optimizer`` step parameters that decentpy also steps: a deliberate second optimizer."""
    _allowed.add(optimizer)


def _before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if not _claimed or optimizer in _owned or optimizer in _allowed:
        return
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _claimed.get(id(p))
            if entry is not None and entry[0]() is p:
                names.append(entry[1])
    if names:
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() would step parameter(s) {shown}, which "
            "decentpy.DecentralizedDataParallel already stepped inside backward() with the optimizer of its "
            "optim_fn: a second step applies the weight decay and moment updates again. Remove this "
            "optimizer's step() and zero_grad() from the training loop (decentpy steps and zeroes the gradients "
            "itself; set the optimizer and learning rate through optim_fn / lr_scheduler_fn), or, to step some "
            "parameters with a second optimizer on purpose, call ddp.allow_optimizer(optimizer) first")

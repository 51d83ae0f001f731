"""The one check of an optimizer's hyper-parameters, for every face that steps one.

A learning rate of NaN (a typo, a scheduler dividing by zero, a config file) does not fail anywhere
by itself: the update multiplies by it and the parameters turn NaN -- in gossip training on every
rank it mixes with. So every face checks the same rules, once: the fused optimizers at
construction, :class:`~decentpy.DecentralizedDataParallel` over the optimizers ``optim_fn`` returns
(and, before each kernel pass, the host floats the pass reads, which a scheduler or an edit of
``param_groups`` may have changed), :class:`~decentpy.DiLoCo` / :class:`~decentpy.LocalSGD` over the
inner and outer optimizers. The rules:

* every number in a parameter group (``lr``, ``weight_decay``, ``momentum``, ``betas``, ``eps``, a
  scheduler's ``initial_lr`` ...) is finite;
* ``lr``, ``weight_decay``, ``momentum``, ``dampening`` are ``>= 0``; ``eps`` is ``> 0``; each of
  ``betas`` is in ``[0, 1)``; ``accum_iter`` is an integer ``>= 1``.

Checking costs a few host comparisons per parameter group (a CUDA tensor ``lr`` is left to the
optimizer: reading it would wait for the GPU).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from torch.optim import Optimizer

__all__ = ["HyperparameterError", "check_param_group", "check_hyperparameters", "hyperparameters_of"]


class HyperparameterError(ValueError):
    """An optimizer hyper-parameter that would corrupt the parameters (non-finite, or out of its
    range). ``where`` names the optimizer, ``group`` the parameter group's index, ``name`` and
    ``value`` the hyper-parameter."""

    def __init__(self, message: str, where: str, group: int, name: str, value: Any) -> None:
        super().__init__(message)
        self.where, self.group, self.name, self.value = where, group, name, value


#: name -> (rule, what is valid): the ranges beyond finiteness
_RANGES: Dict[str, Tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v >= 0.0, "a finite number >= 0"),
    "weight_decay": (lambda v: v >= 0.0, "a finite number >= 0"),
    "momentum": (lambda v: v >= 0.0, "a finite number >= 0"),
    "dampening": (lambda v: v >= 0.0, "a finite number >= 0"),
    "eps": (lambda v: v > 0.0, "a finite number > 0"),
}


def _number(value: Any) -> Any:
    """``value`` as a Python number if it is one (a real number, a one-element CPU tensor); None for
    anything else (flags, strings, None, a tensor on a device: not read here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1 \
            and (value.is_floating_point() or not value.dtype.is_complex):
        return float(value.item())
    return None


#: what a hyper-parameter is, in the error message
_MEANING = {"lr": "the learning rate", "betas": "the moments' decay rates", "eps": "the denominator's guard",
            "weight_decay": "the weight decay", "accum_iter": "steps per moment update"}


def _fail(where: str, group: int, name: str, value: Any, valid: str) -> HyperparameterError:
    meaning = f" ({_MEANING[name]})" if name in _MEANING else ""
    return HyperparameterError(f"{where}, param group {group}: {name}={value!r} is not valid; {name}{meaning} must be "
                               f"{valid}", where, group, name, value)


def check_param_group(group: Mapping[str, Any], where: str, index: int = 0) -> None:
    """Raise :class:`HyperparameterError` (a ValueError) naming ``where``, the group's ``index``, the
    hyper-parameter and its value, for the first one that breaks the rules (see the module)."""
    for name, value in group.items():
        if name == "params":
            continue
        if name == "betas":
            betas = value.tolist() if isinstance(value, torch.Tensor) else value
            nums = [_number(b) for b in betas] if isinstance(betas, (tuple, list)) else []
            if len(nums) != 2 or any(b is None or not (0.0 <= b < 1.0) for b in nums):
                raise _fail(where, index, name, value, "two finite numbers in [0, 1)")
            continue
        if name == "accum_iter":
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise _fail(where, index, name, value, "an integer >= 1")
            continue
        if isinstance(value, (tuple, list)):
            items = [_number(v) for v in value]
            if any(v is not None and not math.isfinite(v) for v in items):
                raise _fail(where, index, name, value, "finite")
            continue
        v = _number(value)
        if v is None:
            continue
        rule = _RANGES.get(name)
        if not math.isfinite(v):
            raise _fail(where, index, name, value, rule[1] if rule is not None else "finite")
        if rule is not None and not rule[0](v):
            raise _fail(where, index, name, value, rule[1])


def check_hyperparameters(optimizer: Optimizer, where: str = "") -> None:
    """:func:`check_param_group` over every parameter group of ``optimizer``; ``where`` (default: the
    optimizer's class) names it in the error."""
    where = where or f"{type(optimizer).__name__}"
    groups: Sequence[Mapping[str, Any]] = optimizer.param_groups
    for i, group in enumerate(groups):
        check_param_group(group, where, i)


def hyperparameters_of(optimizer: Optimizer) -> List[Dict[str, Any]]:
    """Each parameter group's hyper-parameters (everything but ``params``): what the faces agree on
    across ranks, since a rank stepping with another learning rate trains another model."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

"""Which layers a pipeline stage holds: the balance, its checks, and building the stage's layers.

The module is an ``nn.Sequential`` or a list of layers (modules, or callables that build one:
only the stage that owns a layer calls it, so a layer too big for one worker is never built
elsewhere; :class:`LazyModule` is fairscale's name for such a callable). ``balance[i]``
consecutive layers form stage ``i``. The same module object may appear twice within one stage (it
runs twice, its parameters are shared), not in two stages, and neither may a parameter (it would
live in two processes, trained apart). An empty module with an empty balance is an empty pipe
(fairscale accepts it: every rank returns its input).

Error texts start with fairscale's where fairscale's tests match them (``pytest.raises(...,
match=...)``), so code written against fairscale keeps catching them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Sequence, Tuple

from torch import nn

__all__ = ["LazyModule", "TooFewRanksError", "layer_list", "check_balance", "stage_bounds", "check_no_shared_layers",
           "build_stage"]


class LazyModule:
    """A layer built only on the rank that owns it: ``LazyModule(lambda: nn.Linear(4096, 4096))``
    (fairscale's ``fairscale.nn.pipe.types.LazyModule``; any callable returning an ``nn.Module``
    is accepted in the pipe's list the same way). A layer too big for one worker is then never
    built elsewhere."""

    def __init__(self, function: Callable[[], nn.Module]) -> None:
        if not callable(function):
            raise TypeError(f"LazyModule needs a callable that builds an nn.Module, got {type(function).__name__}")
        self.function = function

    def __call__(self) -> nn.Module:
        return self.function()

    def __repr__(self) -> str:
        return f"LazyModule({getattr(self.function, '__qualname__', self.function)!r})"


class TooFewRanksError(ValueError, IndexError):
    """More partitions than ranks in the pipe's group. fairscale raises IndexError here (and its
    tests catch that type); a ValueError is what a bad argument raises elsewhere: this is both."""


def layer_list(module: Any) -> List[Tuple[str, Any]]:
    """``(name, layer)`` in order: an ``nn.Sequential``'s children (a repeated one at each place),
    or a list's items (modules or callables)."""
    if isinstance(module, nn.Sequential):
        return list(module._modules.items())  # named_children() would drop repeats
    if isinstance(module, list):
        for i, layer in enumerate(module):
            if not (isinstance(layer, nn.Module) or callable(layer)):
                raise TypeError(f"layer {i} of the pipe's list is a {type(layer).__name__}; each must be an "
                                "nn.Module or a callable that builds one")
        return [(str(i), layer) for i, layer in enumerate(module)]
    raise TypeError(f"module must be nn.Sequential to be partitioned, or a list of layers (modules, or callables "
                    f"building them such as LazyModule), got {type(module).__name__}")


def check_balance(num_layers: int, balance: Sequence[Any], group_size: int) -> List[int]:
    """``balance`` as a list of positive ints summing to ``num_layers``, at most ``group_size``
    partitions (empty for an empty module); ValueError (naming the bad value) otherwise, and
    :class:`TooFewRanksError` for more partitions than ranks."""
    try:
        out = [int(b) for b in balance]
    except (TypeError, ValueError):
        raise TypeError(f"balance must be a sequence of ints (layers per stage), got {balance!r}") from None
    if any(b != float(x) for b, x in zip(out, balance)):
        raise TypeError(f"balance must hold ints, got {list(balance)!r}")
    if not out and num_layers:
        raise ValueError(f"balance is empty but the module has {num_layers} layers: give the number of layers of each "
                         "stage, e.g. [2, 2] (an empty balance goes with an empty module only)")
    bad = [b for b in out if b <= 0]
    if bad:
        raise ValueError(f"all balance numbers must be positive integer (balance: {out}): {bad[0]} is not; every "
                         "stage needs at least one layer")
    if sum(out) != num_layers:
        raise ValueError(f"module and sum of balance have different length (module: {num_layers}, sum of balance: "
                         f"{sum(out)}): balance {out} sums to {sum(out)} layers but the module has {num_layers}")
    if len(out) > group_size:
        raise TooFewRanksError(f"too few ranks to hold given partitions (ranks: {group_size}, partitions: {len(out)}): "
                               f"balance {out} has {len(out)} partitions but the pipe's group has only {group_size} "
                               "ranks (one stage per rank)")
    return out


def stage_bounds(balance: Sequence[int], stage: int) -> Tuple[int, int]:
    """Layers ``[start, stop)`` of ``stage``."""
    start = sum(balance[:stage])
    return start, start + balance[stage]


def check_no_shared_layers(layers: Sequence[Tuple[str, Any]], balance: Sequence[int]) -> None:
    """ValueError when one module object, or one parameter, belongs to layers of two different
    stages (each stage's copy would be trained apart: tied weights would silently untie). Layers
    given as callables are built later, on their own rank only, and cannot be checked."""
    first: Dict[int, Tuple[int, int]] = {}
    first_param: Dict[int, Tuple[int, int, str]] = {}
    for stage in range(len(balance)):
        start, stop = stage_bounds(balance, stage)
        for i in range(start, stop):
            layer = layers[i][1]
            if not isinstance(layer, nn.Module):
                continue  # a callable builds a new layer each time
            seen = first.setdefault(id(layer), (stage, i))
            if seen[0] != stage:
                raise ValueError(f"module with duplicate children is not supported across stages: layer {i} "
                                 f"('{layers[i][0]}') is the same module as layer {seen[1]} ('{layers[seen[1]][0]}'), "
                                 f"which is in stage {seen[0]}, not {stage}; a module can appear twice only within "
                                 "one stage (its parameters live in one process)")
            for name, p in layer.named_parameters():
                where = first_param.setdefault(id(p), (stage, i, name))
                if where[0] != stage:
                    raise ValueError(f"module with duplicate parameters on distinct devices is not supported: "
                                     f"parameter '{name}' of layer {i} ('{layers[i][0]}', stage {stage}) is parameter "
                                     f"'{where[2]}' of layer {where[1]} ('{layers[where[1]][0]}', stage {where[0]}); "
                                     "put the layers that share it in one stage")


def build_stage(layers: Sequence[Tuple[str, Any]], balance: Sequence[int], stage: int) -> nn.Sequential:
    """The stage's layers as an ``nn.Sequential`` (callables are called now, here only)."""
    start, stop = stage_bounds(balance, stage)
    built: "OrderedDict[str, nn.Module]" = OrderedDict()
    for name, layer in layers[start:stop]:
        if not isinstance(layer, nn.Module):
            layer = layer()
            if not isinstance(layer, nn.Module):
                raise TypeError(f"the callable for layer '{name}' returned a {type(layer).__name__}, not an nn.Module")
        built[name] = layer
    return nn.Sequential(built)

"""Which layers a pipeline stage holds: the balance, its checks, and building the stage's layers.

The module is an ``nn.Sequential`` or a list of layers (modules, or callables that build one:
only the stage that owns a layer calls it, so a layer too big for one worker is never built
elsewhere). ``balance[i]`` consecutive layers form stage ``i``. The same module object may appear
twice within one stage (it runs twice, its parameters are shared), not in two stages (its
parameters would live in two processes).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, List, Sequence, Tuple

from torch import nn

__all__ = ["layer_list", "check_balance", "stage_bounds", "check_no_shared_layers", "build_stage"]


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
    raise TypeError(f"the pipe's module must be an nn.Sequential or a list of layers (modules or callables "
                    f"building them), got {type(module).__name__}")


def check_balance(num_layers: int, balance: Sequence[Any], group_size: int) -> List[int]:
    """``balance`` as a list of positive ints summing to ``num_layers``, at most ``group_size``
    partitions; ValueError (naming the bad value) otherwise."""
    try:
        out = [int(b) for b in balance]
    except (TypeError, ValueError):
        raise TypeError(f"balance must be a sequence of ints (layers per stage), got {balance!r}") from None
    if any(b != float(x) for b, x in zip(out, balance)):
        raise TypeError(f"balance must hold ints, got {list(balance)!r}")
    if not out:
        raise ValueError("balance is empty: give the number of layers of each stage, e.g. [2, 2]")
    bad = [b for b in out if b <= 0]
    if bad:
        raise ValueError(f"balance {out} has a non-positive entry ({bad[0]}); every stage needs at least one layer")
    if sum(out) != num_layers:
        raise ValueError(f"balance {out} sums to {sum(out)} layers but the module has {num_layers}")
    if len(out) > group_size:
        raise ValueError(f"balance {out} has {len(out)} partitions but the pipe's group has only {group_size} "
                         "ranks (one stage per rank)")
    return out


def stage_bounds(balance: Sequence[int], stage: int) -> Tuple[int, int]:
    """Layers ``[start, stop)`` of ``stage``."""
    start = sum(balance[:stage])
    return start, start + balance[stage]


def check_no_shared_layers(layers: Sequence[Tuple[str, Any]], balance: Sequence[int]) -> None:
    """ValueError when one module object is a layer of two different stages."""
    first: dict = {}
    for stage in range(len(balance)):
        start, stop = stage_bounds(balance, stage)
        for i in range(start, stop):
            layer = layers[i][1]
            if not isinstance(layer, nn.Module):
                continue  # a callable builds a new layer each time
            seen = first.setdefault(id(layer), (stage, i))
            if seen[0] != stage:
                raise ValueError(f"layer {i} ('{layers[i][0]}') is the same module as layer {seen[1]} "
                                 f"('{layers[seen[1]][0]}'), which is in stage {seen[0]}, not {stage}: a module "
                                 "can appear twice only within one stage (its parameters live in one process)")


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

"""Pipeline schedules: the order in which a stage runs its micro-batches' forward and backward.

Every rank computes its own list from ``(micro-batches, stages, stage)`` alone, so neighbours
agree on the order of every message between them without telling each other.

* GPipe: all forwards (micro-batch 0 first), then all backwards (the last micro-batch first).
  Every micro-batch's activations are alive at once.
* 1F1B: stage ``s`` runs ``min(S - 1 - s, m)`` forwards to fill the pipe, then alternates one
  forward and one backward, then drains the backwards (micro-batch 0 first). At most ``S - s``
  micro-batches' activations are alive on stage ``s`` (never more than ``S``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "max_alive"]


@dataclass(frozen=True)
class Action:
    """``forward`` or backward of micro-batch ``mb``."""

    forward: bool
    mb: int

    def __repr__(self) -> str:
        return f"{'F' if self.forward else 'B'}{self.mb}"


def gpipe(micro_batches: int, stages: int, stage: int) -> List[Action]:
    return ([Action(True, j) for j in range(micro_batches)] +
            [Action(False, j) for j in reversed(range(micro_batches))])


def one_f_one_b(micro_batches: int, stages: int, stage: int) -> List[Action]:
    warmup = min(stages - 1 - stage, micro_batches)
    out = [Action(True, j) for j in range(warmup)]
    f, b = warmup, 0
    while f < micro_batches:
        out += [Action(True, f), Action(False, b)]
        f, b = f + 1, b + 1
    out += [Action(False, j) for j in range(b, micro_batches)]
    return out


SCHEDULES: Dict[str, Callable[[int, int, int], List[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def max_alive(actions: List[Action]) -> int:
    """The most micro-batches whose activations are alive at once (forward done, backward not)."""
    alive = peak = 0
    for a in actions:
        alive += 1 if a.forward else -1
        peak = max(peak, alive)
    return peak

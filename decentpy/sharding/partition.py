"""Which rank of a group owns (keeps the optimizer state of, and updates) which elements.

The rule, identical on every rank, greedy in parameter order: the parameters, in order (the
parameter groups in order, each in its own order), are laid end to end, and that run of elements
is cut into one contiguous share per rank, rank 0 first: rank ``r``'s share ends at ``E_r``, the
sizes of the first ``r + 1`` shares, each ``total // world`` elements (one more for the lowest
``total % world`` ranks). Parameters added later (``add_param_group``) are cut the same way on
top of what each rank owns already: the shares then fill the ranks up to one common level,
least loaded first. Then:

* a *small* parameter -- fewer than ``min_split_numel`` elements (default 2**16), or at most
  ``tolerance`` (default 5%) of one share -- is never cut: it goes whole to the first rank whose
  share ends at or after its midpoint (the cut moves to its nearer end);
* a *large* parameter is cut at every ``E_r`` inside it, into contiguous pieces (memory order)
  owned by consecutive ranks.

Every rank thus holds its share to within half a small parameter at each end, which whole
parameters alone cannot give (three equal matrices on two ranks would leave one rank 2/3 of the
state, as fairscale's greedy-by-size rule does), and a rank may own nothing (a small model on
many ranks). fairscale's own balance case, sizes [9, 7, 5, 3] repeated per rank, gives equal
shares.

Why contiguous: each rank's elements are one range of a flat block in parameter order, so a
rank's update travels in one broadcast and its gradients reach it in one
reduction, straight from the gradient block (no packing).

Parameters are counted by size whether they are trainable or not, so freezing or unfreezing a
parameter never moves optimizer state between ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

MIN_SPLIT_NUMEL = 2 ** 16
BALANCE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Shard:
    """Elements ``[start, end)`` (memory order) of parameter ``index``, owned by group rank
    ``owner``; ``whole`` when it is the entire parameter."""

    index: int
    start: int
    end: int
    owner: int
    whole: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


def _fills(loads: List[int], amount: int) -> List[int]:
    """How many elements each rank takes of ``amount`` so that ``loads + fills`` is as level as
    possible (integers summing to ``amount``; the lowest ranks get the remainder)."""
    w = len(loads)
    order = sorted(range(w), key=lambda r: (loads[r], r))
    below = 0
    k, level = w, 0.0
    for k in range(1, w + 1):  # the k least loaded ranks share the amount
        below += loads[order[k - 1]]
        level = (amount + below) / k
        if k == w or level <= loads[order[k]]:
            break
    fills = [max(0, int(level - loads[r])) if r in order[:k] else 0 for r in range(w)]
    rest = amount - sum(fills)
    for r in sorted(order[:k]):  # rounding: one more element to the lowest ranks of the level
        if rest <= 0:
            break
        fills[r] += 1
        rest -= 1
    return fills


def partition_by_size(numels: Sequence[int], world_size: int, loads: Optional[List[int]] = None,
                      min_split_numel: int = MIN_SPLIT_NUMEL, tolerance: float = BALANCE_TOLERANCE) -> List[List[Shard]]:
    """The shards of each of ``numels`` (one whole shard, or pieces on consecutive ranks), by the
    rule above. ``loads``: elements each rank owns already (updated in place), for parameters
    added later (``add_param_group``) without moving the earlier ones."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if loads is None:
        loads = [0] * world_size
    if len(loads) != world_size:
        raise ValueError(f"loads has {len(loads)} entries for world_size {world_size}")
    sizes = [int(n) for n in numels]
    share = (sum(loads) + sum(sizes)) / world_size
    fills = _fills(loads, sum(sizes))
    ends = []  # cumulative cut positions: rank r's range ends at ends[r]
    acc = 0
    for f in fills:
        acc += f
        ends.append(acc)
    out: List[List[Shard]] = []
    pos, rank = 0, 0
    for i, n in enumerate(sizes):
        large = world_size > 1 and n >= min_split_numel and n > tolerance * share
        shards: List[Shard] = []
        if not large:
            while rank < world_size - 1 and pos + n / 2 > ends[rank]:  # the nearer side of the cut
                rank += 1
            shards.append(Shard(i, 0, n, rank, True))
        else:
            start = 0
            while start < n:
                while rank < world_size - 1 and ends[rank] <= pos + start:
                    rank += 1
                stop = n if rank == world_size - 1 else min(n, ends[rank] - pos)
                shards.append(Shard(i, start, stop, rank, stop - start == n))
                start = stop
        for s in shards:
            loads[s.owner] += s.numel
        out.append(shards)
        pos += n
    return out


def owner_runs(offsets: Sequence[int], shards: Sequence[Sequence[Shard]]) -> List[Tuple[int, int, int]]:
    """``(owner, lo, hi)`` runs of a flat block, in block order, given each parameter's offset in
    the block (parameters in partition order): consecutive shards of one owner merge into one run
    (the alignment padding between them included), so each owner has one run per block unless
    parameters were added later (``add_param_group``)."""
    runs: List[Tuple[int, int, int]] = []
    for off, sh in zip(offsets, shards):
        for s in sh:
            if s.numel == 0:
                continue
            lo, hi = off + s.start, off + s.end
            if runs and runs[-1][0] == s.owner:
                runs[-1] = (s.owner, runs[-1][1], hi)
            else:
                runs.append((s.owner, lo, hi))
    return runs

"""Communication topologies for decentralized training.

A topology is a periodic schedule. At every step the ranks are partitioned into groups; inside a
group ``R`` each member keeps ``w`` of its own parameters and takes ``(1 - w) / (|R| - 1)`` from
every other member. The mixing matrix of a step is therefore symmetric and doubly stochastic by
construction, so mixing never changes the global mean.

This module is pure Python (torch is used only to build matrices). It creates no process groups:
the communication layer builds one sub-group per entry of :meth:`Topology.unique_groups`, in that
order, on every rank. Schedules are pure functions of ``(world_size, local_world_size)`` so all
ranks compute identical ones without talking to each other.

The built-ins take any world size where a generalisation exists (odd rings, exponential graphs
and AER node counts that are not powers of two), since membership may change between runs; the
rest fail with :class:`TopologyError` naming the sizes that work. This module owns the one
registry of names (:func:`register_topology`, :func:`make_topology`, :func:`topology_factories`);
decent-dp's edge view of it is :mod:`decentpy.topology.edges`.
"""

from __future__ import annotations

import difflib
import logging
import math
import operator
import random
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "TopologyError",
    "Group",
    "Topology",
    "validate_schedule",
    "CompleteTopology",
    "RingTopology",
    "OnePeerExpTopology",
    "AlternatingExpRingTopology",
    "RandomPairsTopology",
    "CustomTopology",
    "register_topology",
    "available_topologies",
    "make_topology",
    "topology_factories",
    "unregister_topology",
    "spectral_gap",
    "node_topology",
    "shard_topology",
]

logger = logging.getLogger(__name__)

# Tolerance used when checking user supplied mixing matrices.
_MATRIX_ATOL = 1e-9
# Tolerance used when a weight that must be 1.0 (size-1 group) arrives with rounding noise.
_WEIGHT_ATOL = 1e-12


class TopologyError(ValueError):
    """A topology does not fit the world size, or a schedule/matrix breaks a rule.

    Messages name the rule, the sizes that were given, and sizes that would work.
    """


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _as_int(value: Any, what: str) -> int:
    """Accept ints (and numpy/torch integer scalars), refuse bools, floats and strings."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _exp_rounds(n: int) -> int:
    """``ceil(log2 n)``: the rounds of distances ``1, 2, 4, ... < n`` (0 for n = 1)."""
    return (n - 1).bit_length()


def _distance_matching(n: int, distance: int) -> List[Tuple[int, int]]:
    """A largest set of disjoint pairs ``{j, (j + distance) mod n}``, sorted by their lower member.

    The pairs at one distance form ``gcd(n, distance)`` cycles ``c, c + d, c + 2d, ...`` of
    ``n / gcd`` members each; consecutive members pair up along a cycle, and the last member of an
    odd cycle sits the round out. For ``n = 2^r`` and ``d = 2^t`` the cycles are even and this is
    the hypercube pairing ``j <-> j XOR 2^t``.
    """
    cycles = math.gcd(n, distance)
    length = n // cycles
    pairs = []
    for c in range(cycles):
        members = [(c + i * distance) % n for i in range(length)]
        pairs += [tuple(sorted(members[i:i + 2])) for i in range(0, length - 1, 2)]
    return sorted(pairs)  # type: ignore[arg-type]


def _exp_matchings(n: int) -> List[List[Tuple[int, int]]]:
    """Round ``t`` of ``ceil(log2 n)``: the pairs at distance ``2^t`` (see _distance_matching).

    The union of the rounds is connected, so mixing along them reaches consensus (checked for
    every n <= 300 and a few larger ones in tests/test_topology.py).
    """
    return [_distance_matching(n, 1 << t) for t in range(_exp_rounds(n))]


def _singletons(n: int, pairs: Sequence[Tuple[int, ...]]) -> List[Group]:
    """1-rank groups for the members of ``range(n)`` that no pair of the step covers."""
    covered = {r for p in pairs for r in p}
    return [Group((r,), 1.0) for r in range(n) if r not in covered]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


def _fmt_list(values: Sequence[Any]) -> str:
    return ", ".join(str(v) for v in values)


# --------------------------------------------------------------------------------------------
# Group
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One averaging group of a step.

    ``ranks`` are sorted unique global ranks; ``weight`` is the self weight ``w``. Every other
    member gets ``(1 - w) / (len(ranks) - 1)``, so one (w, ranks) pair fully describes a
    symmetric, row-stochastic block; a 1-rank group must have ``w == 1`` (it keeps itself).
    Ranks are normalised to a sorted tuple of ints so equal groups compare and hash equal.
    """

    ranks: Tuple[int, ...]
    weight: float

    def __post_init__(self) -> None:
        try:
            raw = list(self.ranks)
        except TypeError:
            raise TypeError(f"Group ranks must be a sequence of ints, got {self.ranks!r}") from None
        ranks = sorted(_as_int(r, "group rank") for r in raw)
        if not ranks:
            raise TopologyError("a group needs at least one rank, got an empty group")
        if ranks[0] < 0:
            raise TopologyError(f"group ranks must be >= 0, got {tuple(ranks)}")
        dupes = sorted({r for r in ranks if ranks.count(r) > 1})
        if dupes:
            raise TopologyError(
                f"group ranks must be unique, rank(s) {_fmt_list(dupes)} repeated in {tuple(raw)}"
            )
        try:
            weight = float(self.weight)
        except (TypeError, ValueError):
            raise TypeError(f"Group weight must be a float, got {self.weight!r}") from None
        if not math.isfinite(weight) or weight < 0.0 or weight > 1.0:
            raise TopologyError(
                f"group {tuple(ranks)}: self weight must be a finite number in [0, 1], got {weight!r}"
            )
        if len(ranks) == 1:
            if abs(weight - 1.0) > _WEIGHT_ATOL:
                raise TopologyError(
                    f"group {tuple(ranks)} has one rank, so its self weight must be 1.0 "
                    f"(it has nobody to average with), got {weight!r}"
                )
            weight = 1.0
        object.__setattr__(self, "ranks", tuple(ranks))
        object.__setattr__(self, "weight", weight)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def neighbour_weight(self) -> float:
        """Weight given to each other member: ``(1 - w) / (|R| - 1)``; 0.0 for a 1-rank group."""
        if len(self.ranks) <= 1:
            return 0.0
        return (1.0 - self.weight) / (len(self.ranks) - 1)


# --------------------------------------------------------------------------------------------
# schedule validation
# --------------------------------------------------------------------------------------------


def validate_schedule(schedule: List[List[Group]], world_size: int, name: str) -> None:
    """Check that ``schedule`` is a valid periodic partition schedule of ``world_size`` ranks.

    Every step must put each rank in ``[0, world_size)`` in exactly one group, weights must be
    finite and in [0, 1], and 1-rank groups must keep weight 1. Symmetry and row-stochasticity
    then hold by construction of :class:`Group`. Raises :class:`TopologyError` naming the step
    and the offending rank.
    """
    n = _as_int(world_size, "world_size")
    if n < 1:
        raise TopologyError(f"topology {name!r}: world_size must be >= 1, got {n}")
    if schedule is None or len(schedule) < 1:
        raise TopologyError(
            f"topology {name!r}: the schedule is empty; a topology needs a period >= 1 "
            f"(at least one step of groups)"
        )
    for step, groups in enumerate(schedule):
        if isinstance(groups, Group):
            raise TopologyError(
                f"topology {name!r}, step {step}: expected a list of Group, got a single Group"
            )
        owner: Dict[int, Tuple[int, ...]] = {}
        for group in groups:
            if not isinstance(group, Group):
                raise TopologyError(
                    f"topology {name!r}, step {step}: expected Group objects, "
                    f"got {type(group).__name__} {group!r}"
                )
            w = group.weight
            if not math.isfinite(w) or w < 0.0 or w > 1.0:
                raise TopologyError(
                    f"topology {name!r}, step {step}: group {group.ranks} has self weight {w!r}; "
                    f"weights must be finite and in [0, 1]"
                )
            if len(group.ranks) == 1 and w != 1.0:
                raise TopologyError(
                    f"topology {name!r}, step {step}: 1-rank group {group.ranks} must have "
                    f"weight 1.0, got {w!r}"
                )
            if not math.isfinite(group.neighbour_weight()):
                raise TopologyError(
                    f"topology {name!r}, step {step}: group {group.ranks} has a non-finite "
                    f"neighbour weight"
                )
            for r in group.ranks:
                if r < 0 or r >= n:
                    raise TopologyError(
                        f"topology {name!r}, step {step}: rank {r} in group {group.ranks} is out "
                        f"of range for world_size={n} (valid ranks: 0..{n - 1})"
                    )
                if r in owner:
                    raise TopologyError(
                        f"topology {name!r}, step {step}: rank {r} is in more than one group "
                        f"({owner[r]} and {group.ranks}); each rank must be in exactly one "
                        f"group per step"
                    )
                owner[r] = group.ranks
        if len(owner) != n:
            missing = [r for r in range(n) if r not in owner]
            shown = _fmt_list(missing[:16]) + (", ..." if len(missing) > 16 else "")
            raise TopologyError(
                f"topology {name!r}, step {step}: rank(s) {shown} are in no group; each of the "
                f"{n} ranks must be in exactly one group per step (use a 1-rank group with "
                f"weight 1.0 for a rank that does not communicate)"
            )


# --------------------------------------------------------------------------------------------
# Topology base
# --------------------------------------------------------------------------------------------


class Topology:
    """Base: a periodic schedule of partitions of the ranks into groups.

    Subclasses implement :meth:`_build`, a pure function of ``world_size`` and
    ``local_world_size`` returning one list of groups per step of the period.
    """

    name: str = "topology"

    def __init__(self, world_size: int, local_world_size: int = 1) -> None:
        n = _as_int(world_size, "world_size")
        local = _as_int(local_world_size, "local_world_size")
        if n < 1:
            raise TopologyError(
                f"topology {self.name!r}: world_size must be >= 1, got world_size={n}"
            )
        if local < 1:
            raise TopologyError(
                f"topology {self.name!r}: local_world_size must be >= 1, got "
                f"local_world_size={local} (world_size={n}); divisors of {n} that would work: "
                f"{_fmt_list(_divisors(n))}"
            )
        # local need not divide n: the last node then holds the n mod L remaining workers (what a
        # job of full nodes becomes when a worker dies or leaves); strategies that need equal
        # nodes (intra_node all-reduce / shard) check that themselves.
        self._world_size = n
        self._local_world_size = local
        schedule = [list(step) for step in self._build()]
        validate_schedule(schedule, n, self.name)
        self._schedule: List[List[Group]] = schedule
        # rank -> group, per step, for O(1) group_of
        self._owner: List[List[Group]] = []
        for groups in schedule:
            owner: List[Optional[Group]] = [None] * n
            for g in groups:
                for r in g.ranks:
                    owner[r] = g
            self._owner.append(owner)  # type: ignore[arg-type]
        self._matrices: Dict[int, torch.Tensor] = {}
        self._gap: Optional[float] = None
        self._period_gap: Optional[float] = None
        if logger.isEnabledFor(logging.DEBUG):  # describe() computes an eigendecomposition
            logger.debug("built topology %s", self.describe())

    # -- to implement ----------------------------------------------------------------------

    def _build(self) -> List[List[Group]]:
        raise NotImplementedError(f"{type(self).__name__} must implement _build()")

    # -- sizes ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    @property
    def num_nodes(self) -> int:
        """``ceil(world_size / local_world_size)``: the last node may hold fewer workers."""
        return -(-self._world_size // self._local_world_size)

    def node_ranks(self, node: int) -> Tuple[int, ...]:
        """The global ranks of ``node`` (``node = rank // local_world_size``; the last node holds the
        ``world_size mod local_world_size`` remaining ranks when the division is uneven)."""
        node = _as_int(node, "node")
        if not 0 <= node < self.num_nodes:
            raise TopologyError(f"topology {self.name!r}: node must be in [0, {self.num_nodes}), got {node}")
        local = self._local_world_size
        return tuple(range(node * local, min((node + 1) * local, self._world_size)))

    @property
    def period(self) -> int:
        return len(self._schedule)

    @property
    def schedule(self) -> List[List[Group]]:
        """A copy of the whole schedule (one list of groups per step of the period)."""
        return [list(groups) for groups in self._schedule]

    # -- queries ----------------------------------------------------------------------------

    def _index(self, step: int) -> int:
        step = _as_int(step, "step")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step % len(self._schedule)

    def groups(self, step: int) -> List[Group]:
        """The partition used at ``step`` (taken modulo the period)."""
        return list(self._schedule[self._index(step)])

    def group_of(self, rank: int, step: int) -> Group:
        """The group that ``rank`` belongs to at ``step``."""
        rank = _as_int(rank, "rank")
        if rank < 0 or rank >= self._world_size:
            raise ValueError(
                f"rank {rank} is out of range for world_size={self._world_size} "
                f"(valid ranks: 0..{self._world_size - 1})"
            )
        return self._owner[self._index(step)][rank]

    def unique_groups(self) -> List[Group]:
        """Every distinct ranks-tuple of size >= 2 used in any step, in order of first appearance.

        The communication layer creates one sub-group per entry, collectively and in this order
        on every rank (process-group creation must be called identically everywhere).
        """
        seen: Dict[Tuple[int, ...], Group] = {}
        for groups in self._schedule:
            for g in groups:
                if len(g.ranks) >= 2 and g.ranks not in seen:
                    seen[g.ranks] = g
        return list(seen.values())

    def is_exact_average(self) -> bool:
        """Every step is one group of every rank with weight ``1/n``: each mix is the exact mean
        (``complete``, and any schedule that equals it)."""
        n = self.world_size
        return all(len(g.ranks) == n and abs(g.weight - 1.0 / n) <= _WEIGHT_ATOL
                   for step in range(self.period) for g in self.groups(step))

    def mixing_matrix(self, step: int) -> torch.Tensor:
        """The float64 ``[n, n]`` mixing matrix ``W`` of ``step``: row i mixes worker i."""
        idx = self._index(step)
        if idx not in self._matrices:
            n = self._world_size
            w_mat = torch.zeros((n, n), dtype=torch.float64)
            for g in self._schedule[idx]:
                idx_t = torch.tensor(g.ranks, dtype=torch.long)
                w_mat[idx_t.unsqueeze(1), idx_t.unsqueeze(0)] = g.neighbour_weight()
                w_mat[idx_t, idx_t] = g.weight
            self._matrices[idx] = w_mat
        return self._matrices[idx].clone()

    def average_mixing_matrix(self) -> torch.Tensor:
        """``mean_t W(t)`` over one period (float64 ``[n, n]``)."""
        acc = torch.zeros((self._world_size, self._world_size), dtype=torch.float64)
        for t in range(self.period):
            acc += self.mixing_matrix(t)
        return acc / self.period

    def period_mixing_matrix(self) -> torch.Tensor:
        """``W(period-1) @ ... @ W(0)``: what one whole period does to the workers (float64)."""
        acc = torch.eye(self._world_size, dtype=torch.float64)
        for t in range(self.period):
            acc = self.mixing_matrix(t) @ acc
        return acc

    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of the period-averaged mixing matrix; 1.0 when ``n == 1``.

        Computed as ``1 - max |eig(W_avg - 11^T / n)|`` (W_avg is symmetric and doubly
        stochastic, so removing the consensus direction leaves the other eigenvalues).
        Larger means faster consensus; 0 means the averaged graph is disconnected.
        """
        if self._gap is None:
            w_avg = self.average_mixing_matrix()
            self._gap = _gap_of(0.5 * (w_avg + w_avg.T), symmetric=True)
        return self._gap

    def period_spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of :meth:`period_mixing_matrix`; 1.0 when ``n == 1``.

        Asymptotically, the disagreement ``x - mean(x)`` shrinks by ``1 - gap`` per period of
        the actual (deterministic) schedule; 1.0 when one period gives the exact average
        (``complete``, ``one-peer-exp`` at n = 2^r). The product of symmetric matrices is not
        symmetric, so its eigenvalues may be complex; their moduli are used.
        """
        if self._period_gap is None:
            self._period_gap = _gap_of(self.period_mixing_matrix(), symmetric=False)
        return self._period_gap

    def describe(self) -> str:
        """One line: name, n, L, nodes, period and the two spectral gaps."""
        return (
            f"{self.name}: n={self._world_size} L={self._local_world_size} "
            f"nodes={self.num_nodes} period={self.period} "
            f"spectral_gap={self.spectral_gap():.4f} period_gap={self.period_spectral_gap():.4f}"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, world_size={self._world_size}, "
            f"local_world_size={self._local_world_size}, period={self.period})"
        )

    # -- helpers for subclasses -------------------------------------------------------------

    def _single_rank_schedule(self) -> List[List[Group]]:
        """World size 1: one step, rank 0 keeps itself (no communication)."""
        return [[Group((0,), 1.0)]]


def _gap_of(w_mat: torch.Tensor, symmetric: bool) -> float:
    """``1 - max |eig(W - 11^T / n)|`` of a doubly stochastic ``W``, clamped to [0, 1].

    ``W`` maps the consensus direction to itself and its complement to itself, so removing
    ``11^T / n`` leaves exactly the eigenvalues other than the consensus one.
    """
    n = w_mat.shape[0]
    if n == 1:
        return 1.0
    centred = w_mat - 1.0 / n
    eig = torch.linalg.eigvalsh(centred) if symmetric else torch.linalg.eigvals(centred)
    return min(1.0, max(0.0, 1.0 - float(eig.abs().max())))


def _sorted_groups(groups: List[Group]) -> List[Group]:
    """Deterministic order inside a step: by lowest rank."""
    return sorted(groups, key=lambda g: g.ranks)


# --------------------------------------------------------------------------------------------
# built-in topologies
# --------------------------------------------------------------------------------------------


class CompleteTopology(Topology):
    """One group of all ``n`` ranks with ``w = 1/n`` (exact average every step)."""

    name = "complete"

    def _build(self) -> List[List[Group]]:
        n = self.world_size
        return [[Group(tuple(range(n)), 1.0 / n)]]


class RingTopology(Topology):
    """Pairs of ring neighbours, ``w = 1/2``: every ring edge is averaged once per period.

    Even n (period 2): ``{2k, 2k+1}``, then ``{2k+1, (2k+2) mod n}``. An odd ring has no perfect
    matching (its edges need three colours), so odd n >= 3 has period 3: step ``s`` pairs
    ``{s+2k, s+2k+1} mod n`` for ``k < (n-1)/2`` and rank ``s-1 mod n`` keeps itself; steps 0 and 1
    are the even rule's, step 2 adds the edge ``{n-1, 0}``.
    """

    name = "ring"

    def _build(self) -> List[List[Group]]:
        n = self.world_size
        if n == 1:
            return self._single_rank_schedule()
        schedule: List[List[Group]] = []
        for s in range(2 if n % 2 == 0 else 3):
            pairs = [((s + 2 * k) % n, (s + 2 * k + 1) % n) for k in range(n // 2)]
            groups = [Group(p, 0.5) for p in pairs] + _singletons(n, pairs)
            schedule.append(_sorted_groups(groups))
        return schedule


class OnePeerExpTopology(Topology):
    """One peer per step at distance ``2^t``, ``w = 1/2``; period ``ceil(log2 n)``.

    Round t pairs ``j`` with ``j + 2^t mod n`` (largest set of such disjoint pairs; a rank left
    without a partner keeps itself). For ``n = 2^r`` this is the hypercube ``j <-> j XOR 2^t``
    and one period multiplies to the exact average; for other n the rounds still connect every
    rank, so the gossip reaches consensus (at the rate :meth:`Topology.spectral_gap` reports).
    """

    name = "one-peer-exp"

    def _build(self) -> List[List[Group]]:
        n = self.world_size
        if n == 1:
            return self._single_rank_schedule()
        return [_sorted_groups([Group(p, 0.5) for p in pairs] + _singletons(n, pairs))
                for pairs in _exp_matchings(n)]


class RandomPairsTopology(Topology):
    """A random perfect matching at every step, ``w = 1/2``; period ``RANDOM_PAIRS_PERIOD``.

    Step ``s`` pairs consecutive ranks of a permutation drawn by Python's ``random.Random`` seeded
    with ``RANDOM_PAIRS_SEED + n`` (``shuffle`` of ``range(n)``, one per step in order): a pure
    function of ``n``, the same on every rank and every run. For odd ``n`` the permutation's last rank
    keeps itself at that step. Random pairings spread information like an expander (NoLoCo's and
    gossip-DiLoCo's outer steps pair replicas at random). Every step is a set of pairs, so a pair's
    exchange is point to point; compressed gossip keeps a pair of public copies per distinct partner,
    which here is most of the ranks: prefer it with local steps (no copies) or a fixed schedule.
    """

    name = "random-pairs"

    def _build(self) -> List[List[Group]]:
        n = self.world_size
        if n == 1:
            return self._single_rank_schedule()
        rng = random.Random(RANDOM_PAIRS_SEED + n)
        steps = []
        for _ in range(RANDOM_PAIRS_PERIOD):
            perm = list(range(n))
            rng.shuffle(perm)
            pairs = [tuple(sorted(perm[i:i + 2])) for i in range(0, n - 1, 2)]
            steps.append(_sorted_groups([Group(p, 0.5) for p in pairs] + _singletons(n, pairs)))
        return steps


#: steps of the random-pairs schedule before it repeats, and the seed its pairings are drawn from
RANDOM_PAIRS_PERIOD = 64
RANDOM_PAIRS_SEED = 0x5EED


def _aer_size_message(n: int, local: int, nodes: int) -> str:
    """Why AER refuses ``(n, local)`` and the ``local_world_size`` values that would work, worded the
    same for both rules: on one machine a smaller ``local_world_size`` simulates several nodes, and
    at ``n = 2`` no value works, so none is suggested."""
    rule = ("at least 2 workers per node (local_world_size >= 2)" if local < 2 else
            "at least 2 nodes N = ceil(world_size / local_world_size)")
    got = f"got world_size={n}, local_world_size={local}" + ("" if local < 2 else f" (N={nodes})")
    if n < 3:
        return (f"topology 'alternating-exp-ring' needs {rule}, {got}; no local_world_size works for "
                f"world_size={n} (AER needs >= 2 nodes with >= 2 workers on the first: world_size >= 3); "
                f"use 'complete' (at 2 workers 'ring' and 'one-peer-exp' average the same pair)")
    half = -(-n // 2)
    fits = (f"for world_size={n}, local_world_size from 2 to {n - 1} works (the last node may hold fewer "
            f"workers): pass it as DecentralizedDataParallel(..., local_world_size=L) (default "
            f"$LOCAL_WORLD_SIZE, which torchrun sets to --nproc_per_node); on one machine it simulates "
            f"nodes, e.g. local_world_size={half} makes 2 nodes")
    if local < 2:
        return (f"topology 'alternating-exp-ring' needs {rule}, {got}; {fits}; with one worker per node "
                f"use 'one-peer-exp' or 'ring'")
    return (f"topology 'alternating-exp-ring' needs {rule}, {got}; {fits}; on a single node 'complete' "
            f"averages exactly; across real nodes of {local} workers the world sizes that work are "
            f"any n > {local}, e.g. {_fmt_list([local * k for k in range(2, 5)])} (full nodes) or "
            f"{local + 1} (a last node of one worker)")


class AlternatingExpRingTopology(Topology):
    """Alternating exponential ring (AER) for ``N >= 2`` nodes of ``L >= 2`` workers.

    Period ``2 ceil(log2 N)``. Round t pairs nodes ``(j, j + 2^t mod N)`` as one-peer-exp pairs
    ranks. Each round has two steps: in the first, the node pairs with an even running pair
    counter average across the pair (one group of the ``2L`` ranks, ``w = 1/(2L)``) while the
    others average inside their node (``w = 1/L``); in the second step the halves swap. Every
    paired node thus talks across nodes once in every round (every other step on average) and
    inside its node otherwise, keeping the slow inter-node link busy only half the time per node.
    When N is not a power of two a node left without a partner in a round averages inside its
    node for both of the round's steps. When L does not divide n the last node holds the
    remaining ``n mod L`` workers (N = ceil(n / L)); every group averages uniformly over its
    members (``w = 1 / |group|``), so each step stays doubly stochastic.
    """

    name = "alternating-exp-ring"

    def _build(self) -> List[List[Group]]:
        n = self.world_size
        local = self.local_world_size
        if n == 1:
            return self._single_rank_schedule()
        nodes = self.num_nodes
        if local < 2 or nodes < 2:
            raise TopologyError(_aer_size_message(n, local, nodes))

        def node(j: int) -> Group:
            ranks = self.node_ranks(j)
            return Group(ranks, 1.0 / len(ranks))

        def across(a: int, b: int) -> Group:
            ranks = self.node_ranks(a) + self.node_ranks(b)
            return Group(ranks, 1.0 / len(ranks))

        schedule: List[List[Group]] = []
        counter = 0  # running pair counter over the whole schedule
        for pairs in _exp_matchings(nodes):
            paired = {j for pair in pairs for j in pair}
            alone = [node(j) for j in range(nodes) if j not in paired]
            for phase in (0, 1):
                step: List[Group] = list(alone)
                for c, (a, b) in enumerate(pairs, start=counter):
                    if c % 2 == phase:
                        step.append(across(a, b))
                    else:
                        step += [node(a), node(b)]
                schedule.append(_sorted_groups(step))
            counter += len(pairs)
        return schedule


# --------------------------------------------------------------------------------------------
# custom topologies
# --------------------------------------------------------------------------------------------


GroupSpec = Union[Group, Tuple[Sequence[int], float]]


class CustomTopology(Topology):
    """A user-given schedule (from group lists or per-step mixing matrices), validated."""

    name = "custom"

    def __init__(
        self,
        schedule: Sequence[Sequence[Group]],
        world_size: int,
        local_world_size: int = 1,
        name: str = "custom",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"topology name must be a non-empty str, got {name!r}")
        self.name = name
        self._given_schedule = [list(step) for step in schedule]
        super().__init__(world_size, local_world_size)

    def _build(self) -> List[List[Group]]:
        return self._given_schedule

    @classmethod
    def from_groups(
        cls,
        fn: Callable[[int], Sequence[GroupSpec]],
        period: int,
        world_size: int,
        local_world_size: int = 1,
        name: str = "custom",
    ) -> "CustomTopology":
        """Build from ``fn(step) -> [(ranks, self_weight), ...]`` for ``step in range(period)``.

        ``fn`` may also return :class:`Group` objects.
        """
        period = _as_int(period, "period")
        if period < 1:
            raise TopologyError(
                f"topology {name!r}: period must be >= 1 (at least one step), got period={period}"
            )
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(step) -> groups, got {fn!r}")
        schedule: List[List[Group]] = []
        for step in range(period):
            specs = fn(step)
            if specs is None:
                raise TopologyError(
                    f"topology {name!r}: fn({step}) returned None; it must return the groups "
                    f"of the step as [(ranks, self_weight), ...]"
                )
            groups: List[Group] = []
            for spec in specs:
                if isinstance(spec, Group):
                    groups.append(spec)
                    continue
                try:
                    ranks, weight = spec
                except (TypeError, ValueError):
                    raise TopologyError(
                        f"topology {name!r}, step {step}: each group must be (ranks, "
                        f"self_weight) or a Group, got {spec!r}"
                    ) from None
                try:
                    groups.append(Group(tuple(ranks), weight))
                except TopologyError as exc:
                    raise TopologyError(f"topology {name!r}, step {step}: {exc}") from None
            schedule.append(groups)
        return cls(schedule, world_size, local_world_size, name=name)

    @classmethod
    def from_matrices(
        cls,
        matrices: Sequence[Any],
        world_size: int,
        local_world_size: int = 1,
        name: str = "custom",
    ) -> "CustomTopology":
        """Build from one mixing matrix per step (torch tensors, numpy arrays or nested lists).

        Each matrix must be symmetric, non-negative, with rows summing to 1, and must be a
        block of group averages: decentpy realises a step as group averages, so the connected
        components of the matrix's support must be cliques with one self weight ``w`` on the
        diagonal and ``(1 - w) / (|R| - 1)`` everywhere else inside the component.
        """
        n = _as_int(world_size, "world_size")
        if getattr(matrices, "ndim", None) == 2:  # one torch tensor / numpy array: period 1
            matrices = [matrices]
        mats = list(matrices)
        if not mats:
            raise TopologyError(
                f"topology {name!r}: no mixing matrices given; a topology needs a period >= 1"
            )
        schedule = [_groups_from_matrix(m, n, name, step) for step, m in enumerate(mats)]
        return cls(schedule, n, local_world_size, name=name)


def _groups_from_matrix(matrix: Any, n: int, name: str, step: int) -> List[Group]:
    """Decompose one mixing matrix into groups, or explain why it cannot be."""
    where = f"topology {name!r}, step {step}"
    try:
        w_mat = torch.as_tensor(matrix, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TopologyError(f"{where}: cannot read the mixing matrix as numbers: {exc}") from None
    if w_mat.dim() != 2 or tuple(w_mat.shape) != (n, n):
        raise TopologyError(
            f"{where}: the mixing matrix must have shape [{n}, {n}] for world_size={n}, "
            f"got {list(w_mat.shape)}"
        )
    if not bool(torch.isfinite(w_mat).all()):
        raise TopologyError(f"{where}: the mixing matrix has non-finite entries")
    atol = _MATRIX_ATOL
    neg = (w_mat < -atol).nonzero()
    if len(neg):
        i, j = (int(v) for v in neg[0])
        raise TopologyError(
            f"{where}: mixing weights must be >= 0, got W[{i},{j}] = {float(w_mat[i, j])!r}"
        )
    asym = ((w_mat - w_mat.T).abs() > atol).nonzero()
    if len(asym):
        i, j = (int(v) for v in asym[0])
        raise TopologyError(
            f"{where}: the mixing matrix must be symmetric (atol {atol:g}), got "
            f"W[{i},{j}] = {float(w_mat[i, j])!r} but W[{j},{i}] = {float(w_mat[j, i])!r}"
        )
    sums = w_mat.sum(dim=1)
    bad_rows = ((sums - 1.0).abs() > atol).nonzero()
    if len(bad_rows):
        i = int(bad_rows[0])
        raise TopologyError(
            f"{where}: every row of the mixing matrix must sum to 1 (atol {atol:g}), "
            f"row {i} sums to {float(sums[i])!r}"
        )

    # connected components of the support (entries above atol)
    support = w_mat.abs() > atol
    comp = [-1] * n
    components: List[List[int]] = []
    for start in range(n):
        if comp[start] != -1:
            continue
        cid = len(components)
        members = [start]
        comp[start] = cid
        frontier = [start]
        while frontier:
            i = frontier.pop()
            for j in support[i].nonzero().flatten().tolist():
                if comp[j] == -1:
                    comp[j] = cid
                    members.append(j)
                    frontier.append(j)
        components.append(sorted(members))

    explain = (
        "decentpy realises each step as group averages: the ranks connected by non-zero "
        "weights must form a group R where every member keeps the same self weight w and "
        "gives (1 - w) / (|R| - 1) to each other member"
    )
    for i in range(n):
        members = components[comp[i]]
        first = members[0]
        w = float(w_mat[first, first])
        if abs(float(w_mat[i, i]) - w) > atol:
            raise TopologyError(
                f"{where}: row {i} cannot be realised: its self weight W[{i},{i}] = "
                f"{float(w_mat[i, i])!r} differs from W[{first},{first}] = {w!r} of the same "
                f"group {tuple(members)}; {explain}"
            )
        if len(members) > 1:
            other = (1.0 - w) / (len(members) - 1)
            for j in members:
                if j != i and abs(float(w_mat[i, j]) - other) > atol:
                    raise TopologyError(
                        f"{where}: row {i} cannot be realised: W[{i},{j}] = "
                        f"{float(w_mat[i, j])!r} but the group {tuple(members)} with self "
                        f"weight {w!r} needs {other!r} for every other member; {explain}"
                    )
    groups: List[Group] = []
    for members in components:
        if len(members) == 1:
            groups.append(Group((members[0],), 1.0))
        else:
            w = sum(float(w_mat[r, r]) for r in members) / len(members)
            groups.append(Group(tuple(members), min(1.0, max(0.0, w))))
    return groups


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

TopologyFactory = Callable[[int, int], Topology]

_REGISTRY: Dict[str, TopologyFactory] = {}
# What topology_factories() hands out: a live view nobody can write through (one owner).
_REGISTRY_VIEW: Mapping[str, TopologyFactory] = types.MappingProxyType(_REGISTRY)


def register_topology(
    name: str,
    factory: Optional[TopologyFactory] = None,
    *,
    overwrite: bool = False,
) -> Any:
    """Register ``factory(world_size, local_world_size) -> Topology`` under ``name``.

    With ``factory`` omitted, returns a decorator (``@register_topology("star")`` on a
    :class:`Topology` subclass or a factory function). A decorated Topology subclass that does
    not set its own ``name`` gets the registered one. Duplicate names need ``overwrite=True``.
    """
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"topology name must be a non-empty str, got {name!r}")

    def _register(obj: Any) -> Any:
        if not callable(obj):
            raise TypeError(
                f"topology factory for {name!r} must be callable as "
                f"factory(world_size, local_world_size), got {obj!r}"
            )
        if name in _REGISTRY and not overwrite:
            raise ValueError(
                f"a topology named {name!r} is already registered; pass overwrite=True to "
                f"replace it (registered: {_fmt_list(available_topologies())})"
            )
        if isinstance(obj, type) and issubclass(obj, Topology) and "name" not in obj.__dict__:
            obj.name = name
        _REGISTRY[name] = obj
        logger.debug("registered topology %r", name)
        return obj

    if factory is None:
        return _register
    _register(factory)
    return factory


def unregister_topology(name: str) -> TopologyFactory:
    """Remove ``name`` from the registry and return its factory (KeyError naming the registered)."""
    try:
        factory = _REGISTRY.pop(name)
    except KeyError:
        raise KeyError(
            f"no topology named {name!r} is registered (registered: "
            f"{_fmt_list(available_topologies())})"
        ) from None
    logger.debug("unregistered topology %r", name)
    return factory


def available_topologies() -> List[str]:
    """Registered topology names, sorted."""
    return sorted(_REGISTRY)


def topology_factories() -> Mapping[str, TopologyFactory]:
    """The registry itself, read-only and live: name -> ``factory(world_size, local_world_size)``.

    For code that needs more than the names (decent-dp's ``TopologyReg.registry`` is built on
    it); changes go through :func:`register_topology` and :func:`unregister_topology`.
    """
    return _REGISTRY_VIEW


def make_topology(
    topology: Union[str, Topology], world_size: int, local_world_size: int
) -> Topology:
    """Resolve a name (through the registry) or check a ready instance against the sizes."""
    n = _as_int(world_size, "world_size")
    local = _as_int(local_world_size, "local_world_size")
    if isinstance(topology, Topology):
        if topology.world_size != n or topology.local_world_size != local:
            raise TopologyError(
                f"topology {topology.name!r} was built for world_size={topology.world_size}, "
                f"local_world_size={topology.local_world_size} but the job runs with "
                f"world_size={n}, local_world_size={local}; build it with those sizes or pass "
                f"its name instead"
            )
        return topology
    if not isinstance(topology, str):
        raise TypeError(
            f"topology must be a registered name (str) or a Topology instance, got "
            f"{type(topology).__name__} {topology!r}"
        )
    factory = _REGISTRY.get(topology)
    if factory is None:
        close = difflib.get_close_matches(topology, list(_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TopologyError(
            f"unknown topology {topology!r}{hint}; valid names: "
            f"{_fmt_list(available_topologies())}"
        )
    result = factory(n, local)
    if not isinstance(result, Topology):
        raise TypeError(
            f"the factory registered as {topology!r} returned {type(result).__name__}, "
            f"expected a Topology"
        )
    if result.world_size != n or result.local_world_size != local:
        raise TopologyError(
            f"the factory registered as {topology!r} returned a topology for "
            f"world_size={result.world_size}, local_world_size={result.local_world_size}; "
            f"expected world_size={n}, local_world_size={local}"
        )
    return result


_GAP_KINDS = ("average", "period")


def spectral_gap(
    topology: Union[str, Topology],
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    kind: str = "average",
) -> float:
    """``1 - |lambda_2|`` of a topology's mixing: how fast its gossip reaches consensus.

    ``topology`` is a registered name (then ``world_size`` is required; ``local_world_size``
    defaults to 1) or an instance (sizes optional, checked when given).

    ``kind='average'`` (the default, the figures of the docs) uses the period-averaged matrix
    ``mean_t W(t)``: it is symmetric, so the gap is real and well defined, it is a per-step rate
    that compares topologies of different periods, and it is what custom topologies have always
    reported. ``kind='period'`` uses the product of one period, ``W(p-1) ... W(0)``: asymptotically
    the factor ``1 - gap`` by which the actual schedule shrinks the disagreement per period (1.0
    when a period is an exact average). With self weights in (0, 1) (every built-in: ``w = 1/|R|``)
    both are > 0 exactly when the union of a period's groups connects every rank.
    """
    if kind not in _GAP_KINDS:
        raise ValueError(f"kind must be one of {_fmt_list(_GAP_KINDS)}, got {kind!r}")
    if isinstance(topology, Topology):
        topo = make_topology(topology, topology.world_size if world_size is None else world_size,
                             topology.local_world_size if local_world_size is None else local_world_size)
    elif world_size is None:
        raise TypeError(
            f"spectral_gap({topology!r}) needs world_size= to build the topology "
            f"(a name is a schedule for any world size)"
        )
    else:
        topo = make_topology(topology, world_size, 1 if local_world_size is None else local_world_size)
    return topo.spectral_gap() if kind == "average" else topo.period_spectral_gap()


def node_topology(topology: Union[str, Topology], nodes: int) -> Topology:
    """The topology over ``nodes`` nodes for ``intra_node='shard'`` / ``'allreduce'``, where each node
    acts as one worker: a registered name built with ``n = nodes`` (``alternating-exp-ring``: its
    node pairing, since inside a node the gradients are averaged exactly anyway: a cross-node group
    of 2L ranks becomes the two nodes with self weight 1/2, a group inside a node becomes the node
    alone), or an instance built for ``world_size=nodes, local_world_size=1``."""
    nodes = _as_int(nodes, "nodes")
    if isinstance(topology, str) and topology == AlternatingExpRingTopology.name:
        if nodes < 2:
            raise TopologyError(
                f"topology 'alternating-exp-ring' over nodes needs at least 2 nodes, got {nodes} node(s); "
                f"valid: 2, 3, 4, ... nodes (on a single node use 'complete')")
        full = AlternatingExpRingTopology(2 * nodes, 2)

        def node_groups(step: int) -> List[Tuple[Tuple[int, ...], float]]:
            seen: Dict[Tuple[int, ...], float] = {}
            for g in full.groups(step):
                members = tuple(sorted({r // 2 for r in g.ranks}))
                seen.setdefault(members, 1.0 / len(members))
            return list(seen.items())

        return CustomTopology.from_groups(node_groups, full.period, nodes, 1, name=AlternatingExpRingTopology.name)
    return make_topology(topology, nodes, 1)


def shard_topology(nodes: Topology, local: int) -> Topology:
    """``nodes`` lifted to ``nodes.world_size * local`` ranks (node ``g`` = ranks ``g*local ..
    g*local + local - 1``): whenever nodes ``g`` and ``h`` mix, ranks ``g*local + l`` and ``h*local + l``
    mix with the same weights, for every ``l`` -- the exchange of shard ``l`` of every node."""
    local = _as_int(local, "local")
    if local == 1:
        return nodes

    def groups(step: int) -> List[Tuple[List[int], float]]:
        return [([g * local + lr for g in grp.ranks], grp.weight) for grp in nodes.groups(step) for lr in range(local)]

    return CustomTopology.from_groups(groups, nodes.period, nodes.world_size * local, local,
                                      name=f"{nodes.name} over nodes, {local} shards")


register_topology("complete", CompleteTopology)
register_topology("ring", RingTopology)
register_topology("one-peer-exp", OnePeerExpTopology)
register_topology("alternating-exp-ring", AlternatingExpRingTopology)
register_topology("random-pairs", RandomPairsTopology)

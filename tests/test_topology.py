"""Tests for decentpy.topology: pure, no processes.

Expected schedules are re-derived here from the topology definitions of docs/concepts/topologies.md independently of
the implementation, then compared with what the module builds.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import re
import sys
from typing import Dict, List, Set, Tuple

import numpy as np
import pytest
import torch

try:  # normal import; fall back to loading the file if the package __init__ is broken
    from decentpy import topology as topo
except Exception:  # pragma: no cover - only when decentpy/__init__.py cannot be imported
    _path = pathlib.Path(__file__).resolve().parents[1] / "decentpy" / "topology.py"
    _spec = importlib.util.spec_from_file_location("decentpy_topology_standalone", _path)
    topo = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = topo
    _spec.loader.exec_module(topo)

TopologyError = topo.TopologyError
Group = topo.Group

BUILTINS = ["complete", "ring", "one-peer-exp", "alternating-exp-ring"]
SIZES = [1, 2, 4, 8, 16]
LOCALS = [1, 2, 4]


# ------------------------------------------------------------------------------------------
# independent re-derivation (from the definitions in docs/concepts/topologies.md, not from the module)
# ------------------------------------------------------------------------------------------

GroupSet = Set[Tuple[Tuple[int, ...], float]]


def valid_for(name: str, n: int, L: int) -> bool:
    if n % L:
        return False
    if n == 1:
        return True
    if name == "complete":
        return True
    if name == "ring":
        return n % 2 == 0
    if name == "one-peer-exp":
        return n & (n - 1) == 0
    if name == "alternating-exp-ring":
        N = n // L
        return L >= 2 and N >= 2 and N & (N - 1) == 0
    raise AssertionError(name)


def expected_schedule(name: str, n: int, L: int) -> List[GroupSet]:
    if n == 1:
        return [{((0,), 1.0)}]
    if name == "complete":
        return [{(tuple(range(n)), 1.0 / n)}]
    if name == "ring":
        s0 = {(tuple(sorted((2 * k, 2 * k + 1))), 0.5) for k in range(n // 2)}
        s1 = {(tuple(sorted((2 * k + 1, (2 * k + 2) % n))), 0.5) for k in range(n // 2)}
        return [s0, s1]
    if name == "one-peer-exp":
        r = int(round(math.log2(n)))
        return [
            {(tuple(sorted((j, j ^ (1 << t)))), 0.5) for j in range(n)} for t in range(r)
        ]
    if name == "alternating-exp-ring":
        N = n // L
        r = int(round(math.log2(N)))
        node = lambda j: tuple(range(j * L, j * L + L))  # noqa: E731
        steps: List[GroupSet] = []
        for t in range(r):
            pairs = []
            used = set()
            for j in range(N):
                if j in used:
                    continue
                k = (j + 2**t) % N
                used |= {j, k}
                pairs.append((j, k))
            for phase in (0, 1):
                s: GroupSet = set()
                for idx, (a, b) in enumerate(pairs):
                    if idx % 2 == phase:
                        s.add((tuple(sorted(node(a) + node(b))), 1.0 / (2 * L)))
                    else:
                        s.add((node(a), 1.0 / L))
                        s.add((node(b), 1.0 / L))
                steps.append(s)
        return steps
    raise AssertionError(name)


def matrix_from_groups(groups: GroupSet, n: int) -> np.ndarray:
    W = np.zeros((n, n))
    for ranks, w in groups:
        for i in ranks:
            for j in ranks:
                W[i, j] = w if i == j else (1 - w) / (len(ranks) - 1)
    return W


def as_set(groups) -> GroupSet:
    return {(g.ranks, g.weight) for g in groups}


def approx_set(a: GroupSet, b: GroupSet) -> bool:
    da = {r: w for r, w in a}
    db = {r: w for r, w in b}
    return da.keys() == db.keys() and all(math.isclose(da[k], db[k], abs_tol=1e-15) for k in da)


CASES = [
    (name, n, L)
    for name in BUILTINS
    for n in SIZES
    for L in LOCALS
    if valid_for(name, n, L)
]


# ------------------------------------------------------------------------------------------
# built-ins
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,n,L", CASES)
def test_builtin_schedule_matches_design(name, n, L):
    t = topo.make_topology(name, n, L)
    exp = expected_schedule(name, n, L)
    assert t.name == name
    assert (t.world_size, t.local_world_size, t.num_nodes) == (n, L, n // L)
    assert t.period == len(exp)
    for step in range(2 * t.period):
        groups = t.groups(step)
        # a partition of the ranks
        seen = sorted(r for g in groups for r in g.ranks)
        assert seen == list(range(n))
        for g in groups:
            assert list(g.ranks) == sorted(set(g.ranks))
            assert math.isclose(g.weight, 1.0 / len(g.ranks))  # built-ins: exact group average
            for r in g.ranks:
                assert t.group_of(r, step) == g
        assert approx_set(as_set(groups), exp[step % t.period]), (step, groups)


@pytest.mark.parametrize("name,n,L", CASES)
def test_builtin_mixing_matrices(name, n, L):
    t = topo.make_topology(name, n, L)
    exp = expected_schedule(name, n, L)
    rng = np.random.default_rng(n * 10 + L)
    x = rng.standard_normal((n, 5))
    for step in range(t.period):
        W = t.mixing_matrix(step)
        assert W.dtype == torch.float64 and tuple(W.shape) == (n, n)
        Wn = W.numpy()
        np.testing.assert_allclose(Wn, Wn.T, atol=0)
        np.testing.assert_allclose(Wn.sum(axis=1), np.ones(n), atol=1e-12)
        np.testing.assert_allclose(Wn.sum(axis=0), np.ones(n), atol=1e-12)
        assert (Wn >= 0).all()
        np.testing.assert_allclose(Wn, matrix_from_groups(exp[step], n), atol=1e-15)
        # mixing never changes the global mean
        np.testing.assert_allclose((Wn @ x).mean(axis=0), x.mean(axis=0), atol=1e-12)
    # returned matrices are copies
    W0 = t.mixing_matrix(0)
    W0.fill_(7.0)
    assert float(t.mixing_matrix(0)[0, 0]) != 7.0


@pytest.mark.parametrize("name,n,L", CASES)
def test_spectral_gap_in_range_and_matches_numpy(name, n, L):
    t = topo.make_topology(name, n, L)
    gap = t.spectral_gap()
    assert 0.0 < gap <= 1.0
    if n == 1:
        assert gap == 1.0
        return
    exp = expected_schedule(name, n, L)
    Wavg = sum(matrix_from_groups(s, n) for s in exp) / len(exp)
    ev = np.sort(np.abs(np.linalg.eigvals(Wavg).real))[::-1]
    assert math.isclose(gap, 1.0 - ev[1], abs_tol=1e-10)
    d = t.describe()
    assert "\n" not in d and name in d and f"n={n}" in d and f"L={L}" in d
    assert f"period={t.period}" in d and "spectral" in d


def test_known_spectral_gaps():
    assert topo.make_topology("complete", 8, 1).spectral_gap() == pytest.approx(1.0)
    # ring n=4: averaged W is circulant [1/2, 1/4, 0, 1/4] -> eigenvalues 1, 1/2, 0, 1/2
    W = np.array(
        [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
    )
    ev = np.sort(np.abs(np.linalg.eigvalsh(W)))[::-1]
    assert ev[0] == pytest.approx(1.0)
    assert topo.make_topology("ring", 4, 1).spectral_gap() == pytest.approx(1 - ev[1])
    assert topo.make_topology("ring", 4, 1).spectral_gap() == pytest.approx(0.5)
    # ring n=8: circulant [1/2, 1/4, 0, ..., 0, 1/4] -> 1 - (1/2 + 1/2 cos(2 pi / 8))
    assert topo.make_topology("ring", 8, 1).spectral_gap() == pytest.approx(
        0.5 - 0.5 * math.cos(2 * math.pi / 8)
    )
    # one-peer-exp n = 2^r: average of r commuting projections -> gap 1/r
    for r in (1, 2, 3, 4):
        assert topo.make_topology("one-peer-exp", 2**r, 1).spectral_gap() == pytest.approx(1 / r)


@pytest.mark.parametrize("name,n", [("complete", n) for n in SIZES] + [("one-peer-exp", n) for n in SIZES])
def test_one_period_gives_exact_average(name, n):
    t = topo.make_topology(name, n, 1)
    P = torch.eye(n, dtype=torch.float64)
    for step in range(t.period):
        P = t.mixing_matrix(step) @ P
    torch.testing.assert_close(P, torch.full((n, n), 1.0 / n, dtype=torch.float64))


def test_ring_n8_pairs():
    t = topo.RingTopology(8)
    assert [g.ranks for g in t.groups(0)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {g.ranks for g in t.groups(1)} == {(1, 2), (3, 4), (5, 6), (0, 7)}
    assert t.groups(2) == t.groups(0) and t.groups(3) == t.groups(1)
    assert all(g.weight == 0.5 for s in range(2) for g in t.groups(s))
    assert t.group_of(7, 1).ranks == (0, 7)


def test_ring_n2_same_pair_both_steps():
    t = topo.RingTopology(2)
    assert t.period == 2
    assert [g.ranks for g in t.groups(0)] == [(0, 1)] == [g.ranks for g in t.groups(1)]
    assert [g.ranks for g in t.unique_groups()] == [(0, 1)]


def test_one_peer_exp_pairs_xor():
    t = topo.OnePeerExpTopology(16)
    assert t.period == 4
    for step in range(4):
        for j in range(16):
            assert t.group_of(j, step).ranks == tuple(sorted((j, j ^ (1 << step))))


def test_aer_n8_l2_groups_by_step():
    t = topo.AlternatingExpRingTopology(8, 2)
    assert (t.num_nodes, t.period) == (4, 4)
    q, h = 0.25, 0.5
    expected = [
        {((0, 1, 2, 3), q), ((4, 5), h), ((6, 7), h)},  # round 0 (nodes 0-1, 2-3): pair 0 across
        {((0, 1), h), ((2, 3), h), ((4, 5, 6, 7), q)},  # swap: pair 1 across
        {((0, 1, 4, 5), q), ((2, 3), h), ((6, 7), h)},  # round 1 (nodes 0-2, 1-3): pair 0 across
        {((0, 1), h), ((4, 5), h), ((2, 3, 6, 7), q)},  # swap
    ]
    for step, exp in enumerate(expected):
        assert as_set(t.groups(step)) == exp, step
    # every node talks across exactly once per round (every other step on average),
    # and at every step half the nodes are across
    node_of = lambda r: r // 2  # noqa: E731
    for rnd in range(2):
        across_count: Dict[int, int] = {j: 0 for j in range(4)}
        for step in (2 * rnd, 2 * rnd + 1):
            across_nodes = {node_of(r) for g in t.groups(step) if len(g.ranks) == 4 for r in g.ranks}
            assert len(across_nodes) == 2
            for j in across_nodes:
                across_count[j] += 1
        assert all(c == 1 for c in across_count.values()), across_count
    # intra-node groups never mix nodes
    for step in range(4):
        for g in t.groups(step):
            if len(g.ranks) == 2:
                assert node_of(g.ranks[0]) == node_of(g.ranks[1])


def test_aer_two_nodes_across_then_inside():
    t = topo.AlternatingExpRingTopology(4, 2)
    assert t.period == 2
    assert as_set(t.groups(0)) == {((0, 1, 2, 3), 0.25)}
    assert as_set(t.groups(1)) == {((0, 1), 0.5), ((2, 3), 0.5)}


def test_world_size_one_works_everywhere():
    for name in BUILTINS:
        t = topo.make_topology(name, 1, 1)
        assert t.period == 1
        assert t.groups(0) == [Group((0,), 1.0)]
        assert t.unique_groups() == []
        assert t.spectral_gap() == 1.0
        torch.testing.assert_close(t.mixing_matrix(5), torch.ones(1, 1, dtype=torch.float64))


def test_unique_groups_contents_and_order():
    t = topo.RingTopology(4)
    assert [g.ranks for g in t.unique_groups()] == [(0, 1), (2, 3), (0, 3), (1, 2)]
    t = topo.AlternatingExpRingTopology(8, 2)
    assert [g.ranks for g in t.unique_groups()] == [
        (0, 1, 2, 3), (4, 5), (6, 7), (0, 1), (2, 3), (4, 5, 6, 7), (0, 1, 4, 5), (2, 3, 6, 7)
    ]
    assert [g.ranks for g in topo.CompleteTopology(4).unique_groups()] == [(0, 1, 2, 3)]
    t = topo.OnePeerExpTopology(8)
    u = t.unique_groups()
    assert len(u) == 12 and len({g.ranks for g in u}) == 12
    # deterministic: two independent builds agree exactly
    assert u == topo.OnePeerExpTopology(8).unique_groups()


def test_group_basics():
    g = Group((3, 1, 2), 0.5)
    assert g.ranks == (1, 2, 3) and g.weight == 0.5
    assert g.neighbour_weight() == pytest.approx(0.25)
    assert Group((4,), 1.0).neighbour_weight() == 0.0
    assert Group([0, 1], 0.5) == Group((1, 0), 0.5)
    with pytest.raises(TopologyError, match="weight must be 1.0"):
        Group((0,), 0.5)
    with pytest.raises(TopologyError, match="unique"):
        Group((1, 1), 0.5)
    with pytest.raises(TopologyError, match=r"\[0, 1\]"):
        Group((0, 1), 1.5)
    with pytest.raises(TopologyError):
        Group((), 1.0)
    with pytest.raises(TopologyError):
        Group((0, 1), float("nan"))


def test_group_of_and_steps():
    t = topo.RingTopology(4)
    assert t.group_of(1, 0).ranks == (0, 1)
    assert t.group_of(1, 1).ranks == (1, 2)
    assert t.group_of(1, 1001).ranks == (1, 2)
    with pytest.raises(ValueError, match="out of range"):
        t.group_of(4, 0)
    with pytest.raises(ValueError):
        t.groups(-1)


# ------------------------------------------------------------------------------------------
# any number of workers
# ------------------------------------------------------------------------------------------


def _consensus_periods(t, periods: int = 400) -> float:
    """Mix random vectors for ``periods`` periods; return the remaining disagreement (relative)."""
    n = t.world_size
    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    mean = x.mean(dim=0)
    start = float((x - mean).norm())
    for _ in range(periods):
        for step in range(t.period):
            x = t.mixing_matrix(step) @ x
    torch.testing.assert_close(x.mean(dim=0), mean, rtol=0, atol=1e-12)  # the mean never moves
    return float((x - mean).norm()) / max(start, 1e-300)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("n", range(1, 10))
def test_every_builtin_any_world_size_reaches_consensus_or_names_valid_sizes(name, n):
    for L in (1, 2, 3):
        if n % L:
            continue
        try:
            t = topo.make_topology(name, n, L)
        except TopologyError as e:
            msg = str(e)
            assert name == "alternating-exp-ring", (name, n, L, msg)  # the others take any n
            assert "valid" in msg or "work" in msg, msg
            assert f"world_size={n}" in msg and f"local_world_size={L}" in msg, msg
            continue
        topo.validate_schedule(t.schedule, n, name)
        for step in range(t.period):
            W = t.mixing_matrix(step)
            torch.testing.assert_close(W, W.T, rtol=0, atol=0)
            ones = torch.ones(n, dtype=torch.float64)
            torch.testing.assert_close(W.sum(dim=0), ones, rtol=0, atol=1e-12)
            torch.testing.assert_close(W.sum(dim=1), ones, rtol=0, atol=1e-12)
            assert bool((W >= 0).all())
        assert t.spectral_gap() > 0.0 and t.period_spectral_gap() > 0.0, t.describe()
        assert _consensus_periods(t) < 1e-9, t.describe()


@pytest.mark.parametrize("n", list(range(2, 301)) + [1000, 1023, 1025])
def test_one_peer_exp_rounds_connect_every_rank(n):
    """The union of one period's pairs is connected for every n (so the gap is > 0)."""
    t = topo.make_topology("one-peer-exp", n, 1)
    assert t.period == math.ceil(math.log2(n))
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for step in range(t.period):
        for g in t.groups(step):
            assert len(g.ranks) <= 2 and (len(g.ranks) == 1 or 2**step % n in {(g.ranks[1] - g.ranks[0]) % n,
                                                                               (g.ranks[0] - g.ranks[1]) % n})
            for r in g.ranks:
                parent[find(r)] = find(g.ranks[0])
    assert len({find(r) for r in range(n)}) == 1


@pytest.mark.parametrize("nodes", range(2, 18))
def test_aer_any_node_count_keeps_its_shape(nodes):
    """Cross-node groups are two whole nodes (w = 1/2L), the rest whole nodes (w = 1/L); each node
    is across at most once per round, and a node pair is across in exactly one step of its round."""
    L = 2
    t = topo.make_topology("alternating-exp-ring", nodes * L, L)
    assert t.period == 2 * math.ceil(math.log2(nodes))
    for rnd in range(t.period // 2):
        across: Dict[Tuple[int, ...], int] = {}
        for step in (2 * rnd, 2 * rnd + 1):
            for g in t.groups(step):
                node_set = tuple(sorted({r // L for r in g.ranks}))
                assert g.ranks == tuple(r for j in node_set for r in range(j * L, j * L + L))
                assert len(node_set) in (1, 2) and g.weight == 1.0 / len(g.ranks)
                if len(node_set) == 2:
                    assert (node_set[1] - node_set[0]) % nodes in {2**rnd % nodes, -(2**rnd) % nodes}
                    across[node_set] = across.get(node_set, 0) + 1
        assert all(c == 1 for c in across.values())
        assert len({j for pair in across for j in pair}) == 2 * len(across)  # each node in <= 1 pair
    assert t.spectral_gap() > 0.0


def test_spectral_gap_function_average_and_period():
    assert topo.spectral_gap("ring", 8) == topo.make_topology("ring", 8, 1).spectral_gap()
    assert topo.spectral_gap("one-peer-exp", 8, kind="period") == pytest.approx(1.0)  # one period: exact average
    assert topo.spectral_gap("one-peer-exp", 8) == pytest.approx(1 / 3)
    t = topo.make_topology("alternating-exp-ring", 6, 2)
    assert topo.spectral_gap(t) == t.spectral_gap()
    assert topo.spectral_gap(t, kind="period") == t.period_spectral_gap()
    # the period gap is that of the product of the period's matrices, in order
    P = t.mixing_matrix(3) @ t.mixing_matrix(2) @ t.mixing_matrix(1) @ t.mixing_matrix(0)
    torch.testing.assert_close(t.period_mixing_matrix(), P)
    ev = np.abs(np.linalg.eigvals(P.numpy() - 1 / 6))
    assert t.period_spectral_gap() == pytest.approx(1 - ev.max(), abs=1e-12)
    assert topo.spectral_gap("complete", 1, kind="period") == 1.0
    with pytest.raises(ValueError, match="kind must be one of average, period, got 'mean'"):
        topo.spectral_gap("ring", 4, kind="mean")
    with pytest.raises(TypeError, match="world_size"):
        topo.spectral_gap("ring")
    with pytest.raises(TopologyError, match="world_size=8"):
        topo.spectral_gap(t, 8, 2)
    assert "period_gap=" in t.describe()


# ------------------------------------------------------------------------------------------
# bad sizes
# ------------------------------------------------------------------------------------------


def test_odd_ring_has_period_three():
    # was test_odd_ring_error: an odd ring is now built (its edges need three matchings)
    t = topo.make_topology("ring", 7, 1)
    assert t.period == 3
    assert as_set(t.groups(0)) == {((0, 1), 0.5), ((2, 3), 0.5), ((4, 5), 0.5), ((6,), 1.0)}
    assert as_set(t.groups(1)) == {((0,), 1.0), ((1, 2), 0.5), ((3, 4), 0.5), ((5, 6), 0.5)}
    assert as_set(t.groups(2)) == {((0, 6), 0.5), ((1,), 1.0), ((2, 3), 0.5), ((4, 5), 0.5)}
    ring_edges = {tuple(sorted((j, (j + 1) % 7))) for j in range(7)}
    assert {g.ranks for g in t.unique_groups()} == ring_edges
    assert 0.0 < t.spectral_gap() < 1.0


def test_one_peer_exp_any_world_size():
    # was test_one_peer_exp_non_power_of_two_error: peers at distance 2^t mod n, period ceil(log2 n)
    t = topo.make_topology("one-peer-exp", 6, 1)
    assert t.period == 3
    assert as_set(t.groups(0)) == {((0, 1), 0.5), ((2, 3), 0.5), ((4, 5), 0.5)}
    assert as_set(t.groups(1)) == {((0, 2), 0.5), ((1, 3), 0.5), ((4,), 1.0), ((5,), 1.0)}
    assert as_set(t.groups(2)) == {((0, 4), 0.5), ((1, 5), 0.5), ((2,), 1.0), ((3,), 1.0)}
    t = topo.make_topology("one-peer-exp", 12, 1)
    assert t.period == 4
    for step in range(4):
        for g in t.groups(step):
            assert len(g.ranks) == 1 or (g.ranks[1] - g.ranks[0]) % 12 in (2**step, 12 - 2**step)
    assert 0.0 < t.spectral_gap() < 1.0 and 0.0 < t.period_spectral_gap() < 1.0


def test_aer_local_one_error():
    with pytest.raises(TopologyError) as e:
        topo.make_topology("alternating-exp-ring", 8, 1)
    msg = str(e.value)
    assert "local_world_size" in msg and "one-peer-exp" in msg and "ring" in msg
    assert "LOCAL_WORLD_SIZE" in msg


@pytest.mark.parametrize("n,local", [(4, 4), (8, 8), (5, 1), (8, 1), (3, 3)])
def test_aer_size_errors_name_local_world_size_and_values_that_build(n, local):
    """Both AER refusals (one worker per node; a single node, what torchrun --standalone reports)
    name the argument, say that on one machine it simulates nodes, and every value they offer builds
    (the topology itself is the reference), as does the example given; the values outside the
    range offered do not."""
    with pytest.raises(TopologyError) as e:
        topo.make_topology("alternating-exp-ring", n, local)
    msg = str(e.value)
    assert f"world_size={n}, local_world_size={local}" in msg and "simulates" in msg, msg
    assert "DecentralizedDataParallel(..., local_world_size=L)" in msg and "LOCAL_WORLD_SIZE" in msg, msg
    lo, hi = map(int, re.search(r"local_world_size from (\d+) to (\d+) works", msg).groups())
    for L in range(1, n + 2):
        builds = True
        try:
            topo.make_topology("alternating-exp-ring", n, L)
        except TopologyError:
            builds = False
        assert builds == (lo <= L <= hi), (n, L, msg)
    example = int(re.search(r"e\.g\. local_world_size=(\d+) makes 2 nodes", msg).group(1))
    assert topo.make_topology("alternating-exp-ring", n, example).num_nodes == 2


@pytest.mark.parametrize("local", [1, 2])
def test_aer_two_workers_suggests_no_local_world_size(local):
    """At 2 workers no local world size works: the error says so and offers none (it used to say
    "no local world size works" and then "set LOCAL_WORLD_SIZE")."""
    with pytest.raises(TopologyError) as e:
        topo.make_topology("alternating-exp-ring", 2, local)
    msg = str(e.value)
    assert "no local_world_size works for world_size=2" in msg and "'complete'" in msg, msg
    assert "LOCAL_WORLD_SIZE" not in msg and "local_world_size=L" not in msg and "simulates" not in msg, msg
    for L in range(1, 4):
        with pytest.raises(TopologyError):
            topo.make_topology("alternating-exp-ring", 2, L)


def test_aer_any_node_count_and_single_node_error():
    # was test_aer_non_power_of_two_nodes_error: N = 3 nodes is now built (round t pairs nodes at
    # distance 2^t mod N; a node without a partner averages inside itself for the round)
    t = topo.make_topology("alternating-exp-ring", 6, 2)
    assert (t.num_nodes, t.period) == (3, 4)
    q, h = 0.25, 0.5
    expected = [
        {((0, 1, 2, 3), q), ((4, 5), h)},  # round 0: nodes 0-1 (pair 0) across, node 2 alone
        {((0, 1), h), ((2, 3), h), ((4, 5), h)},
        {((0, 1), h), ((2, 3), h), ((4, 5), h)},  # round 1: nodes 0-2 (pair 1) across next
        {((0, 1, 4, 5), q), ((2, 3), h)},
    ]
    for step, exp in enumerate(expected):
        assert as_set(t.groups(step)) == exp, step
    with pytest.raises(TopologyError) as e:  # single node: still refused
        topo.AlternatingExpRingTopology(4, 4)
    msg = str(e.value)
    assert "complete" in msg and "N=1" in msg and "8, 12, 16" in msg


@pytest.mark.parametrize("name", BUILTINS)
def test_local_not_dividing_builds_with_a_partial_last_node(name):
    # was test_local_not_dividing_error: a local world size that does not divide the world size is
    # now accepted (what a job of full nodes becomes after a worker dies); the last node holds the
    # remaining workers, and every step stays symmetric and doubly stochastic.
    t = topo.make_topology(name, 8, 3)
    assert (t.num_nodes, t.node_ranks(0), t.node_ranks(2)) == (3, (0, 1, 2), (6, 7))
    for step in range(t.period):
        w = t.mixing_matrix(step).double()
        assert torch.allclose(w, w.T) and torch.allclose(w.sum(0), torch.ones(8, dtype=torch.float64))
        assert bool((w >= 0).all())
    assert 0.0 < t.period_spectral_gap() <= 1.0


def test_aer_partial_last_node_groups():
    # 7 workers, L = 2: nodes (0,1) (2,3) (4,5) (6); round t pairs nodes at distance 2^t mod 4
    t = topo.make_topology("alternating-exp-ring", 7, 2)
    assert (t.num_nodes, t.period) == (4, 4)
    for step in range(t.period):
        for g in t.groups(step):
            assert g.weight == pytest.approx(1.0 / g.size)  # uniform average in every group
        nodes = {tuple(sorted({r // 2 for r in g.ranks})) for g in t.groups(step)}
        assert all(len(ns) in (1, 2) for ns in nodes)
    across = [g.ranks for s in range(t.period) for g in t.groups(s) if len({r // 2 for r in g.ranks}) == 2]
    assert (4, 5, 6) in across or (0, 1, 6) in across or (2, 3, 6) in across  # the partial node talks across
    with pytest.raises(TopologyError, match="world_size >= 3"):
        topo.make_topology("alternating-exp-ring", 2, 1)
    with pytest.raises(TopologyError, match="2 to 6"):
        topo.make_topology("alternating-exp-ring", 7, 1)


def test_bad_sizes_never_crash_with_other_errors():
    for name in BUILTINS:
        for n in range(0, 20):
            for L in range(0, 6):
                try:
                    topo.make_topology(name, n, L)
                except TopologyError:
                    pass
    with pytest.raises(TopologyError, match="world_size must be >= 1"):
        topo.CompleteTopology(0)
    with pytest.raises(TypeError):
        topo.CompleteTopology(2.0)


def test_unknown_name_lists_valid_names():
    with pytest.raises(TopologyError) as e:
        topo.make_topology("rnig", 4, 1)
    msg = str(e.value)
    assert "rnig" in msg
    for name in BUILTINS:
        assert name in msg


def test_make_topology_instance_checks_sizes():
    t = topo.RingTopology(4, 2)
    assert topo.make_topology(t, 4, 2) is t
    with pytest.raises(TopologyError, match="world_size=4"):
        topo.make_topology(t, 8, 2)
    with pytest.raises(TopologyError, match="local_world_size=2"):
        topo.make_topology(t, 4, 1)
    with pytest.raises(TypeError):
        topo.make_topology(42, 4, 1)


def test_available_topologies_sorted_and_has_builtins():
    names = topo.available_topologies()
    assert names == sorted(names)
    assert set(BUILTINS) <= set(names)


# ------------------------------------------------------------------------------------------
# custom topologies
# ------------------------------------------------------------------------------------------


def test_custom_from_groups_valid():
    def fn(step):
        if step == 0:
            return [((0, 1, 2), 0.5), ((3,), 1.0)]
        return [([1, 3], 0.5), (Group((0, 2), 0.25).ranks, 0.25)]

    t = topo.CustomTopology.from_groups(fn, period=2, world_size=4, name="tri")
    assert t.name == "tri" and t.period == 2
    W0 = t.mixing_matrix(0).numpy()
    assert W0[0, 0] == 0.5 and W0[0, 1] == 0.25 and W0[3, 3] == 1.0 and W0[0, 3] == 0.0
    W1 = t.mixing_matrix(1).numpy()
    assert W1[0, 0] == 0.25 and W1[0, 2] == 0.75
    assert [g.ranks for g in t.unique_groups()] == [(0, 1, 2), (1, 3), (0, 2)]
    assert 0 < t.spectral_gap() <= 1
    assert "tri" in t.describe()


def test_custom_from_groups_rank_in_two_groups():
    with pytest.raises(TopologyError) as e:
        topo.CustomTopology.from_groups(lambda s: [((0, 1), 0.5), ((1, 2), 0.5), ((3,), 1.0)], 1, 4)
    msg = str(e.value)
    assert "step 0" in msg and "rank 1" in msg and "more than one group" in msg


def test_custom_from_groups_missing_rank():
    def fn(step):
        return [((0, 1), 0.5), ((2, 3), 0.5)] if step == 0 else [((0, 1), 0.5), ((2,), 1.0)]

    with pytest.raises(TopologyError) as e:
        topo.CustomTopology.from_groups(fn, 2, 4)
    msg = str(e.value)
    assert "step 1" in msg and "3" in msg and "no group" in msg


def test_custom_from_groups_other_errors():
    with pytest.raises(TopologyError, match="out of range"):
        topo.CustomTopology.from_groups(lambda s: [((0, 4), 0.5), ((1,), 1), ((2,), 1), ((3,), 1)], 1, 4)
    with pytest.raises(TopologyError, match="step 0"):
        topo.CustomTopology.from_groups(lambda s: [((0,), 0.5), ((1,), 1.0)], 1, 2)
    with pytest.raises(TopologyError, match="period"):
        topo.CustomTopology.from_groups(lambda s: [((0,), 1.0)], 0, 1)
    # was: refused because local_world_size=2 does not divide 3; now a partial last node
    t = topo.CustomTopology.from_groups(lambda s: [((0, 1, 2), 1 / 3)], 1, 3, 2)
    assert (t.num_nodes, t.node_ranks(1)) == (2, (2,))


def test_custom_from_matrices_valid_roundtrip():
    ring = topo.RingTopology(8)
    mats = [ring.mixing_matrix(0), ring.mixing_matrix(1).numpy(), ring.mixing_matrix(0).tolist()]
    t = topo.CustomTopology.from_matrices(mats, 8)
    assert t.period == 3
    for step in range(3):
        torch.testing.assert_close(t.mixing_matrix(step), ring.mixing_matrix(step % 2))
    # non-uniform self weight, lazy pair, isolated rank
    W = np.array([[0.7, 0.3, 0, 0], [0.3, 0.7, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    t = topo.CustomTopology.from_matrices([W], 4)
    assert as_set(t.groups(0)) == {((0, 1), 0.7), ((2,), 1.0), ((3,), 1.0)}
    assert [g.ranks for g in t.unique_groups()] == [(0, 1)]
    # averaged graph disconnected -> gap 0, but still a valid topology
    assert t.spectral_gap() == pytest.approx(0.0, abs=1e-12)


def test_custom_from_matrices_asymmetric():
    W = np.array([[0.5, 0.5, 0], [0.25, 0.5, 0.25], [0.25, 0, 0.75]])
    with pytest.raises(TopologyError, match="symmetric"):
        topo.CustomTopology.from_matrices([W], 3)


def test_custom_from_matrices_row_sum():
    W = np.array([[0.5, 0.4], [0.4, 0.5]])
    with pytest.raises(TopologyError) as e:
        topo.CustomTopology.from_matrices([W], 2)
    assert "sum to 1" in str(e.value) and "row 0" in str(e.value)


def test_custom_from_matrices_negative_and_shape():
    W = np.array([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(TopologyError, match=">= 0"):
        topo.CustomTopology.from_matrices([W], 2)
    with pytest.raises(TopologyError, match="shape"):
        topo.CustomTopology.from_matrices([np.eye(3)], 2)
    with pytest.raises(TopologyError, match="period"):
        topo.CustomTopology.from_matrices([], 2)


def test_custom_from_matrices_not_decomposable():
    # a path 0-1-2: symmetric and doubly stochastic, but not a set of group averages
    W = np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]])
    with pytest.raises(TopologyError) as e:
        topo.CustomTopology.from_matrices([W], 3)
    msg = str(e.value)
    assert "group averages" in msg and "row 0" in msg
    # ring averaged matrix (circulant) is a valid mixing matrix but not one step of groups
    Wc = np.array(
        [[0.5, 0.25, 0, 0.25], [0.25, 0.5, 0.25, 0], [0, 0.25, 0.5, 0.25], [0.25, 0, 0.25, 0.5]]
    )
    with pytest.raises(TopologyError, match="group averages"):
        topo.CustomTopology.from_matrices([Wc], 4)
    # clique with unequal diagonal
    Wd = np.array([[0.6, 0.2, 0.2], [0.2, 0.4, 0.4], [0.2, 0.4, 0.4]])
    with pytest.raises(TopologyError, match="row 1"):
        topo.CustomTopology.from_matrices([Wd], 3)


def test_validate_schedule_direct():
    topo.validate_schedule([[Group((0, 1), 0.5)]], 2, "x")
    with pytest.raises(TopologyError, match="period"):
        topo.validate_schedule([], 2, "x")
    with pytest.raises(TopologyError, match="no group"):
        topo.validate_schedule([[Group((0, 1), 0.5)]], 3, "x")
    with pytest.raises(TopologyError, match="Group"):
        topo.validate_schedule([[((0, 1), 0.5)]], 2, "x")


# ------------------------------------------------------------------------------------------
# registry
# ------------------------------------------------------------------------------------------


def test_register_topology_function_and_duplicate():
    name = "test-star-pairs"
    try:
        def factory(n, L):
            def fn(s):  # rank 0 averages with rank s + 1; everybody else keeps itself
                return [((0, s + 1), 0.5)] + [((k,), 1.0) for k in range(1, n) if k != s + 1]

            return topo.CustomTopology.from_groups(fn, n - 1, n, L, name=name)

        topo.register_topology(name, factory)
        assert name in topo.available_topologies()
        t = topo.make_topology(name, 4, 1)
        assert t.period == 3 and t.name == name
        assert [g.ranks for g in t.unique_groups()] == [(0, 1), (0, 2), (0, 3)]
        with pytest.raises(ValueError, match=name):
            topo.register_topology(name, factory)
        topo.register_topology(name, factory, overwrite=True)
    finally:
        if name in topo.topology_factories():
            topo.unregister_topology(name)


def test_register_topology_decorator_on_class():
    name = "test-pairs-decorated"
    try:

        @topo.register_topology(name)
        class Pairs(topo.Topology):
            def _build(self):
                n = self.world_size
                return [[Group((2 * k, 2 * k + 1), 0.5) for k in range(n // 2)]]

        assert isinstance(Pairs, type) and issubclass(Pairs, topo.Topology)
        t = topo.make_topology(name, 4, 2)
        assert isinstance(t, Pairs) and t.name == name
        assert [g.ranks for g in t.groups(0)] == [(0, 1), (2, 3)]
        with pytest.raises(ValueError, match="already registered"):
            topo.register_topology(name)(Pairs)
        # a factory that breaks the partition rule is caught at construction
        with pytest.raises(TopologyError, match="no group"):
            topo.make_topology(name, 5, 1)
    finally:
        if name in topo.topology_factories():
            topo.unregister_topology(name)


def test_register_topology_bad_factory_result():
    name = "test-bad-factory"
    try:
        topo.register_topology(name, lambda n, L: "not a topology")
        with pytest.raises(TypeError, match="Topology"):
            topo.make_topology(name, 2, 1)
        topo.register_topology(name, lambda n, L: topo.CompleteTopology(2 * n, L), overwrite=True)
        with pytest.raises(TopologyError, match="expected world_size=2"):
            topo.make_topology(name, 2, 1)
    finally:
        if name in topo.topology_factories():
            topo.unregister_topology(name)


def test_registry_is_one_read_only_mapping():
    factories = topo.topology_factories()
    assert sorted(factories) == topo.available_topologies()
    assert factories["ring"] is topo.RingTopology
    with pytest.raises(TypeError):
        factories["x"] = topo.RingTopology  # type: ignore[index]
    name = "test-unregister"
    topo.register_topology(name, topo.CompleteTopology)
    assert name in factories  # a live view
    assert topo.unregister_topology(name) is topo.CompleteTopology
    assert name not in factories
    with pytest.raises(KeyError, match="test-unregister.*registered: .*ring"):
        topo.unregister_topology(name)


def test_topology_has_one_owner():
    """Inside the package nothing imports decentpy.topo (decent-dp's module path) but __init__,
    and no private name of the topology package's modules is imported from outside it."""
    import ast

    pkg = pathlib.Path(topo.__file__).resolve().parents[1]  # decentpy/ (topology/ is a package in it)
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = node.module or ""
            names = [a.name for a in node.names]
            if rel != "__init__.py":
                assert mod not in ("topo", "decentpy.topo") and not (mod in ("", "decentpy") and "topo" in names), (
                    f"{rel} imports decentpy.topo")
            if not rel.startswith("topology/") and mod.split(".")[-1] in ("topology", "schedules", "edges", "decent_dp"):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                assert not private, f"{rel} imports private names from {mod}: {private}"


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_random_pairs_is_the_documented_draw_and_reaches_consensus(n):
    """Step s pairs consecutive ranks of the s-th shuffle of range(n) by random.Random(0x5EED + n)
    (docs/concepts/topologies.md), a rank left over keeps itself; the same schedule on every call; the
    mean never moves and one period mixes far towards consensus."""
    import random

    t = topo.make_topology("random-pairs", n, 1)
    again = topo.make_topology("random-pairs", n, 1)
    rng = random.Random(0x5EED + n)
    assert t.period == 64
    for s in range(t.period):
        perm = list(range(n))
        rng.shuffle(perm)
        want = {(tuple(sorted(perm[i:i + 2])), 0.5) for i in range(0, n - 1, 2)}
        want |= {((r,), 1.0) for r in range(n) if n % 2 and r == perm[-1]}
        assert as_set(t.groups(s)) == want, (n, s)
        assert as_set(again.groups(s)) == want
    assert _consensus_periods(t, periods=1) < 1e-3

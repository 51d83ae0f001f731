"""A plain-PyTorch float64 re-computation of compressed gossip (CHOCO with per-edge public copies),
written from docs/compression.md without decentpy's kernels or wrapper.

All workers live in one process. Per iteration k, on every worker i, with j = partner(k, i):
gradient at x_i; (k >= 1) xhat_{j|i} += D(q_j) for the q_j that j sent at the end of step k-1, then
x_i += gamma * w * (xhat_{j|i} - xhat_{i|j}); the optimizer step; then for j' = partner(k + 1, i):
q_i = Q(x_i - xhat_{i|j'}), xhat_{i|j'} += D(q_i). The quantisers act on each worker's flat bucket
(the parameters in reverse registration order, each at a 128-byte aligned offset), int8 in blocks
of 256 elements with scale max|d| / 127 and round-half-to-even codes in [-127, 127], int4 the same
with max|d| / 7 and codes in [-7, 7], bf16 by round-to-nearest-even.
A group G of m > 2 workers shares one public mean: worker i keeps xhat_i^G and M^G (both from x_i at
the start). At the end of step k-1, for the group G of step k: q_i = Q(x_i - xhat_i^G),
xhat_i^G += D(q_i); the bucket's ceil(n/256) scale blocks are split into m chunks (member at position
p of the sorted group owns blocks [p B // m, (p + 1) B // m)); for each chunk, mu = the mean of the
members' D(q) there, r = Q(mu) (quantised from the chunk's start), the owner's xhat += m (D(r) - mu).
At step k: M^G += D(r), x_i += gamma * w * m * (M^G - xhat_i^G).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

INT8_BLOCK = 256
CODE_MAX = {"int8": 127.0, "int4": 7.0}  # the largest code of the block-scaled kinds
ALIGN_ELEMS = 32  # 128 bytes of fp32


def ring_partner(n: int) -> Callable[[int, int], int]:
    """ring: period 2, matchings {2m, 2m+1} then {2m+1, 2m+2 mod n}."""
    def partner(k: int, i: int) -> int:
        if k % 2 == 0:
            return i ^ 1
        return (i + 1) % n if i % 2 == 1 else (i - 1) % n
    return partner


def one_peer_exp_partner(n: int) -> Callable[[int, int], int]:
    r = n.bit_length() - 1
    return lambda k, i: i ^ (1 << (k % r))


def flat_layout(shapes: Sequence[torch.Size]) -> Tuple[List[int], int]:
    """Offsets of the parameters (in bucket order) at 128-byte (32 fp32) aligned positions, and the end."""
    offsets, pos = [], 0
    for s in shapes:
        offsets.append(pos)
        n = 1
        for d in s:
            n *= int(d)
        pos = -(-(pos + n) // ALIGN_ELEMS) * ALIGN_ELEMS
    return offsets, pos


def quantize64(kind: str, d: Tensor, stats: Dict[str, float]) -> Tensor:
    """D(Q(d)) in float64 for a flat float64 ``d``. ``stats['unit']`` keeps the largest rounding
    unit seen (int8 / int4: the block scale; bf16: 2^-8 of |d|)."""
    if kind == "bf16":
        out = d.to(torch.bfloat16).double()
        stats["unit"] = max(stats.get("unit", 0.0), float(d.abs().max()) * 2.0 ** -8)
        return out
    n = d.numel()
    pad = -(-n // INT8_BLOCK) * INT8_BLOCK - n
    blocks = torch.cat([d, d.new_zeros(pad)]).view(-1, INT8_BLOCK)
    cmax = CODE_MAX[kind]
    s = blocks.abs().amax(dim=1, keepdim=True) / cmax
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round(blocks / safe).clamp(-cmax, cmax), torch.zeros_like(blocks))
    stats["unit"] = max(stats.get("unit", 0.0), float(s.max()))
    return (codes * s).reshape(-1)[:n]


class FlatModels:
    """Each worker's parameters viewed as one flat float64 bucket (reverse registration order)."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.models = list(models)
        self.params = [list(reversed(list(m.parameters()))) for m in self.models]
        self.offsets, self.total = flat_layout([p.shape for p in self.params[0]])

    def get(self, i: int) -> Tensor:
        flat = torch.zeros(self.total, dtype=torch.float64)
        for p, o in zip(self.params[i], self.offsets):
            flat[o:o + p.numel()] = p.detach().reshape(-1)
        return flat

    def set(self, i: int, flat: Tensor) -> None:
        with torch.no_grad():
            for p, o in zip(self.params[i], self.offsets):
                p.copy_(flat[o:o + p.numel()].view_as(p))


def group_schedule(topology: str, n: int, local_world_size: int = 1) -> Callable[[int, int], Tuple[List[int], float]]:
    """``(peers, neighbour weight)`` of worker i at step k for the built-in uniform-group topologies
    used by the tests: complete (one group of n) and alternating-exp-ring with 2 workers per node at
    n = 4 (even steps: the group of all 4; odd steps: the node pairs {0, 1}, {2, 3})."""
    if topology == "complete":
        return lambda k, i: ([j for j in range(n) if j != i], 1.0 / n)
    if topology == "alternating-exp-ring" and n == 4 and local_world_size == 2:
        return lambda k, i: (([j for j in range(4) if j != i], 0.25) if k % 2 == 0 else ([i ^ 1], 0.5))
    raise ValueError(f"no reference schedule for {topology!r} at n={n}, L={local_world_size}")


def pair_schedule(partner: Callable[[int, int], int], weight: float = 0.5) -> Callable[[int, int], Tuple[List[int], float]]:
    return lambda k, i: ([partner(k, i)], weight)


def simulate_choco(models: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
                   grads: Callable[[int, int, nn.Module], None],
                   schedule: Callable[[int, int], Tuple[List[int], float]], kind: str,
                   gamma: float, steps: int, shards: int = 1) -> Tuple[List[Tensor], Dict[str, float]]:
    """Run ``steps`` iterations; ``grads(i, k, model)`` fills the gradients of worker i at step k;
    ``schedule(k, i)`` is worker i's peers at step k and their (uniform) weight. A pair has its own
    copies per edge, a larger group one public mean (see the module doc). ``shards``: the flat
    bucket is quantised in that many equal shards, each from its own start (``intra_node='shard'``:
    each rank of a node compresses its shard). Returns every worker's final flat parameters and the
    rounding statistics."""
    n = len(models)
    flat = FlatModels(models)
    x0 = [flat.get(i) for i in range(n)]
    self_copy: List[Dict[int, Tensor]] = [dict() for _ in range(n)]
    peer_copy: List[Dict[int, Tensor]] = [dict() for _ in range(n)]
    group_self: List[Dict[Tuple[int, ...], Tensor]] = [dict() for _ in range(n)]
    group_mean: List[Dict[Tuple[int, ...], Tensor]] = [dict() for _ in range(n)]
    stats: Dict[str, float] = {}
    sent: List[Dict[int, Tensor]] = [dict() for _ in range(n)]  # sent[i][j]: D(q) that i sent to j last step
    reduced: Dict[Tuple[int, ...], Tensor] = {}  # D(r) of each group's last exchange
    for k in range(steps):
        for i, m in enumerate(models):
            for p in m.parameters():
                p.grad = None
            grads(i, k, m)
        if k >= 1:
            xs = [flat.get(i) for i in range(n)]
            for i in range(n):
                peers, w = schedule(k, i)
                if len(peers) > 1:
                    g = tuple(sorted(peers + [i]))
                    gm = group_mean[i].setdefault(g, x0[i].clone())
                    gm += reduced[g]
                    xs[i] = xs[i] + gamma * w * len(g) * (gm - group_self[i].setdefault(g, x0[i].clone()))
                    continue
                for j in peers:
                    pc = peer_copy[i].setdefault(j, x0[j].clone())
                    pc += sent[j][i]
                    sc = self_copy[i].setdefault(j, x0[i].clone())
                    xs[i] = xs[i] + gamma * w * (pc - sc)
            for i in range(n):
                flat.set(i, xs[i])
        for o in opts:
            o.step()
        group_q: Dict[Tuple[int, ...], Dict[int, Tensor]] = {}
        for i in range(n):
            x = flat.get(i)
            sent[i] = {}
            peers = schedule(k + 1, i)[0]
            if len(peers) > 1:
                assert shards == 1, "the reference has no sharded groups"
                g = tuple(sorted(peers + [i]))
                sc = group_self[i].setdefault(g, x0[i].clone())
                dq = quantize64(kind, x - sc, stats)
                sc += dq
                group_q.setdefault(g, {})[i] = dq
                continue
            for j in peers:
                sc = self_copy[i].setdefault(j, x0[i].clone())
                d = x - sc
                size = d.numel() // shards
                dq = torch.cat([quantize64(kind, d[r * size:(r + 1) * size], stats) for r in range(shards)])
                sc += dq
                sent[i][j] = dq
        for g, qs in group_q.items():
            m = len(g)
            total = flat.total
            blocks = -(-total // INT8_BLOCK)
            r = torch.zeros(total, dtype=torch.float64)
            for pos, owner in enumerate(g):
                lo = min(pos * blocks // m * INT8_BLOCK, total)
                hi = min((pos + 1) * blocks // m * INT8_BLOCK, total)
                if lo == hi:
                    continue
                mu = sum(qs[j][lo:hi] for j in g) / m
                dr = quantize64(kind, mu, stats)
                r[lo:hi] = dr
                group_self[owner][g][lo:hi] += m * (dr - mu)
            reduced[g] = r
    return [flat.get(i) for i in range(n)], stats

"""decentpy.DiLoCo / decentpy.LocalSGD (torchft-shaped local steps, issue 44) on 4 gloo workers, one
spawn for every scenario, each against a reference that does not use decentpy:

- complete topology: a plain-torch DiLoCo in the same worker (all-reduce mean of the
  pseudo-gradients, torch's SGD with Nesterov on the restored global copy) -- equal to float32
  rounding; and torchft 0.2.0's own ``DiLoCo`` (with a stand-in Manager) where torchft is importable
  (``DECENTPY_TORCHFT_PATH``/``BENCH_TORCHFT_PATH``: see docs/elastic.md for its install);
- streaming (2 fragments, a delayed exchange, a merge): the same plain re-computation of torchft's
  schedule, and torchft where importable; the engine's streaming fragments (``fragments=2``) against
  the same re-computation, with a resume while a fragment's exchange is in flight;
- gossip outer steps (ring): a float64 single-process re-computation of the four replicas; the
  replicas' mean global copy follows DiLoCo's update with the mean pseudo-gradient;
- LocalSGD: a plain all-reduce average every H steps;
- a checkpoint with an exchange in flight resumes bit for bit; bad input raises on every rank.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch import nn

from decentpy.local_steps.sparse import SparseOuter
from dist_harness import run_workers
from examples.lm.loop import TorchftStandInManager
from reference import REF_OPTIMIZERS, batch, decentpy_optim_fn, loss_fn, make_mlp

N = 4
H = 4            # inner steps per outer step (per fragment: H / fragments)
OUTER = 3        # outer steps per scenario
LR_IN = 1e-2


def _torchft_path() -> Optional[str]:
    return os.environ.get("DECENTPY_TORCHFT_PATH") or os.environ.get("BENCH_TORCHFT_PATH")


def _inner(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=LR_IN, weight_decay=0.01)


def _outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _train(model: nn.Module, inner: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for k in steps:
        x, y = batch(rank, k)
        inner.zero_grad()
        loss_fn(model(x), y).backward()
        inner.step()


def _flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _plain_diloco(rank: int, world: int, fragments: List[List[nn.Parameter]], inner: torch.optim.Optimizer,
                  outers: List[torch.optim.Optimizer], model: nn.Module, steps: int, delay: int, alpha: float) -> None:
    """torchft's Streaming DiLoCo schedule written out with torch.distributed and torch's optimizers:
    fragment f = (outer step) % F; pseudo-gradient at step period - delay, all-reduce mean; at
    step period: restore the global copy, .grad = the mean, outer step, new global copy, lerp back
    to the local parameters by alpha."""
    import torch.distributed as dist

    period = H // len(fragments)
    backup = [[p.detach().clone() for p in f] for f in fragments]
    local, outer_steps, pending = 0, 0, None
    for k in range(steps):
        x, y = batch(rank, k)
        inner.zero_grad()
        loss_fn(model(x), y).backward()
        inner.step()
        local += 1
        f = outer_steps % len(fragments)
        with torch.no_grad():
            if local == period - delay:
                pending = [b - p for b, p in zip(backup[f], fragments[f])]
                for d in pending:
                    dist.all_reduce(d)
                    d.div_(world)
            if local == period:
                saved = [p.detach().clone() for p in fragments[f]]
                for p, b, d in zip(fragments[f], backup[f], pending):
                    p.copy_(b)
                    p.grad = d
                outers[f].step()
                outers[f].zero_grad()
                backup[f] = [p.detach().clone() for p in fragments[f]]
                for p, s in zip(fragments[f], saved):
                    p.lerp_(s, alpha)
                outer_steps += 1
                local = 0


def _weighted_diloco(rank: int, windows: List[int], make_inner: Any) -> torch.Tensor:
    """Weighted DiLoCo written out with torch.distributed: this rank's windows of inner steps (torch's
    optimizer from ``make_inner``), each ending in the outer step with ``sum w_j delta_j / sum w_j``
    over the ranks (``w`` the window's inner steps) and torch's Nesterov SGD."""
    import torch.distributed as dist

    ref = make_mlp(0)
    ref_inner = make_inner(ref)
    ref_outer = _outer(ref.parameters())
    backup = [p.detach().clone() for p in ref.parameters()]
    k = 0
    for w in windows:
        _train(ref, ref_inner, rank, range(k, k + w))
        k += w
        with torch.no_grad():
            total = torch.tensor([float(w)])
            dist.all_reduce(total)
            for p, b in zip(ref.parameters(), backup):
                g = (b - p) * w
                dist.all_reduce(g)
                p.copy_(b)
                p.grad = g / total
        ref_outer.step()
        ref_outer.zero_grad()
        backup = [p.detach().clone() for p in ref.parameters()]
    return _flat(ref)


def _int8_diloco_reference(rank: int, world: int, steps: int, face: bool = False,
                           windows: Optional[List[int]] = None) -> torch.Tensor:
    """DiLoCo with int8 pseudo-gradients, written from csrc/kernels/outer_step.h and docs/compression.md
    in float64 with torch's AdamW inside: each rank sends ``D(Q(d))`` of ``d = theta - x - e`` and keeps
    ``e = D(Q(d)) - d`` (error feedback); the group's mean ``mu`` is re-quantised, ``r = D(Q(mu))``, and
    the owner of each chunk of scale blocks (position p of 4 owns blocks [p B // 4, (p + 1) B // 4))
    adds ``4 (r - mu)`` to its ``e`` there; the outer Nesterov SGD steps ``theta`` with ``r``. The flat
    buffer is the engine's bucket (reverse registration order, 128-byte aligned), or with ``face`` the
    DiLoCo face's (the parameters in order, back to back) and its inner AdamW. With ``windows`` (a time
    budget: this rank's inner steps per outer step) the compressed value is ``w (theta - x)`` and the
    outer step takes ``r`` over the ranks' mean weight."""
    import torch.distributed as dist
    from compression_reference import INT8_BLOCK, FlatModels, quantize64

    ref = make_mlp(0)
    inner = _inner(ref) if face else REF_OPTIMIZERS["adamw"](ref)
    flat = FlatModels([ref])
    if face:
        flat.params = [list(ref.parameters())]
        flat.offsets, flat.total = [0], 0
        for q in flat.params[0]:
            flat.offsets.append(flat.offsets[-1] + q.numel())
        flat.total = flat.offsets.pop()
    theta = flat.get(0)
    excess = torch.zeros_like(theta)
    mom: Optional[torch.Tensor] = None
    n = theta.numel()
    blocks = -(-n // INT8_BLOCK)
    lo = min(n, rank * blocks // world * INT8_BLOCK)
    hi = min(n, (rank + 1) * blocks // world * INT8_BLOCK)
    k = 0
    for w in (windows if windows is not None else [H] * (steps // H)):
        _train(ref, inner, rank, range(k, k + w))
        k += w
        u = (theta - flat.get(0)) * (w if windows is not None else 1)
        d = u - excess
        v = quantize64("int8", d, {})
        excess = v - d
        every = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(every, v)
        mu = sum(every[1:], every[0]) / world
        r = quantize64("int8", mu, {})
        excess[lo:hi] += world * (r[lo:hi] - mu[lo:hi])
        if windows is not None:
            total = torch.tensor([float(w)], dtype=torch.float64)
            dist.all_reduce(total)
            r = r / (total / world)
        mom = r.clone() if mom is None else 0.9 * mom + r
        theta = theta - 0.7 * (r + 0.9 * mom)
        flat.set(0, theta.float())
    return _flat(ref)


def _gossip_int8_reference(rank: int, world: int, steps: int, topology: str, face: bool = False,
                           windows: Optional[List[int]] = None) -> torch.Tensor:
    """A compressed gossip outer step (int8), written from decentpy/comm/compressed_mix.py's docstring
    in float64 with torch's AdamW inside: the buffer ``z = [theta; theta - x]`` (the engine's flat
    bucket twice), CHOCO against public copies that start from ``[theta_0; 0]``: a pair sends
    ``v = D(Q(z - zhat_{i|j}))``, both ends add it to their copy, ``z += (1 - w) (zhat_{j|i} - zhat_{i|j})``;
    a group of m: ``v`` likewise against ``zhat_i``, the owners' re-quantised mean ``r`` of the members'
    ``v`` (owner's copy += m (r - mu) on its chunk), ``M += r``, ``z += s m (M - zhat_i)``; then torch's
    outer Nesterov SGD (lr 0.7, momentum 0.9) from the mixed ``theta`` with the mixed ``delta``. With
    ``face`` the DiLoCo face's buffer (the parameters in order, back to back) and its inner AdamW. With
    ``windows`` (a time budget) the buffer is ``[theta; w (theta - x)]`` and the mixed pseudo-gradient is
    divided by the weights' own uncompressed mix with the same coefficients."""
    import torch.distributed as dist
    from compression_reference import INT8_BLOCK, FlatModels, group_schedule, one_peer_exp_partner, pair_schedule, \
        quantize64

    schedule = (pair_schedule(one_peer_exp_partner(world)) if topology == "one-peer-exp" else
                group_schedule(topology, world, 2))
    ref = make_mlp(0)
    inner = _inner(ref) if face else REF_OPTIMIZERS["adamw"](ref)
    flat = FlatModels([ref])
    if face:
        flat.params = [list(ref.parameters())]
        flat.offsets = [0]
        for q in flat.params[0]:
            flat.offsets.append(flat.offsets[-1] + q.numel())
        flat.total = flat.offsets.pop()
    theta = flat.get(0)
    n = theta.numel()
    z0 = torch.cat([theta, torch.zeros_like(theta)])
    copies: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
    mom: Optional[torch.Tensor] = None
    wins = windows if windows is not None else [H] * (steps // H)
    for o, w in enumerate(wins):
        _train(ref, inner, rank, range(sum(wins[:o]), sum(wins[:o + 1])))
        peers, nw = schedule(o, rank)
        g = tuple(sorted(peers + [rank]))
        own, public = copies.setdefault(g, [z0.clone(), z0.clone()])
        z = torch.cat([theta, (theta - flat.get(0)) * (w if windows is not None else 1)])
        if windows is not None:
            ws = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(ws, torch.tensor([float(w)], dtype=torch.float64))
            total = (1 - nw * len(peers)) * float(w) + nw * sum(float(ws[j]) for j in peers)
        v = quantize64("int8", z - own, {})
        own += v
        every = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(every, v)
        if len(peers) == 1:
            public += every[peers[0]]
            z += nw * (public - own)
        else:
            m = len(g)
            mu = sum(every[j] for j in g) / m
            r = quantize64("int8", mu, {})  # chunks are whole scale blocks: quantised alike from the start
            blocks = -(-2 * n // INT8_BLOCK)
            p = g.index(rank)
            lo, hi = min(2 * n, p * blocks // m * INT8_BLOCK), min(2 * n, (p + 1) * blocks // m * INT8_BLOCK)
            own[lo:hi] += m * (r[lo:hi] - mu[lo:hi])
            public += r
            z += nw * m * (public - own)
        d = z[n:] / (total if windows is not None else 1)
        mom = d.clone() if mom is None else 0.9 * mom + d
        theta = z[:n] - 0.7 * (d + 0.9 * mom)
        flat.set(0, theta.float())
    return _flat(ref)


def _torchft_run(rank: int, fragmented: bool, steps: int) -> Optional[torch.Tensor]:
    path = _torchft_path()
    if not path:
        return None
    sys.path.insert(0, path)
    try:
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    except Exception:  # noqa: BLE001 - reported by the test as the reason it skips
        return None
    model = make_mlp(0)
    inner = _inner(model)
    frags = [model[0:2], model[2:]] if fragmented else [model]
    outers = [_outer(f.parameters()) for f in frags]
    with TorchftDiLoCo(TorchftStandInManager(), frags, inner, outers, sync_every=H,
                       fragment_sync_delay=1 if fragmented else 0, fragment_update_alpha=0.5 if fragmented else 0.0):
        _train(model, inner, rank, range(steps))
    return _flat(model)


def _worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    import decentpy

    torch.set_num_threads(1)
    out: Dict[str, Any] = {}
    steps = H * OUTER

    # -- complete: decentpy against the plain-torch DiLoCo ------------------------------------------
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H) as d:
        _train(model, inner, rank, range(steps))
    out["complete_outer_steps"] = d.outer_steps
    out["complete"] = _flat(model)
    ref = make_mlp(0)
    ref_inner = _inner(ref)
    _plain_diloco(rank, world, [list(ref.parameters())], ref_inner, [_outer(ref.parameters())], ref, steps, 0, 0.0)
    out["complete_ref"] = _flat(ref)
    out["no_sync"] = _flat(make_mlp(0))  # (the start: the runs above must have moved)

    # -- streaming: 2 fragments, the exchange one step early, merge alpha 0.5 ----------------------
    model = make_mlp(0)
    inner = _inner(model)
    frags = [model[0:2], model[2:]]
    with decentpy.DiLoCo(frags, inner, [_outer(f.parameters()) for f in frags], sync_every=H,
                         fragment_sync_delay=1, fragment_update_alpha=0.5):
        _train(model, inner, rank, range(steps))
    out["streaming"] = _flat(model)
    ref = make_mlp(0)
    ref_inner = _inner(ref)
    rfr = [list(ref[0:2].parameters()), list(ref[2:].parameters())]
    _plain_diloco(rank, world, rfr, ref_inner, [_outer(f) for f in rfr], ref, steps, 1, 0.5)
    out["streaming_ref"] = _flat(ref)
    # one outer optimizer shared by the fragments (torchft 0.2.0 accepts it too, but steps the other
    # fragment's parameters with their inner gradients at each fragment's outer step)
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo([model[0:2], model[2:]], inner, _outer(model.parameters()), sync_every=H,
                         fragment_sync_delay=1, fragment_update_alpha=0.5):
        _train(model, inner, rank, range(steps))
    out["streaming_shared"] = _flat(model)

    # -- torchft 0.2.0 itself, where importable ------------------------------------------------------
    out["torchft_complete"] = _torchft_run(rank, False, steps)
    out["torchft_streaming"] = _torchft_run(rank, True, steps)

    # -- gossip outer steps on a ring: global copies and the inner parameters at each outer step ---
    model = make_mlp(0)
    inner = _inner(model)
    seen: List[Tuple[torch.Tensor, torch.Tensor]] = []
    d = decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, topology="ring")

    def capture(*_: Any) -> None:  # registered first: runs before DiLoCo's hook, at every inner step
        if (d.local_step + 1) % H == 0:  # this inner step is followed by an outer step
            seen.append((torch.cat([b.reshape(-1) for b in d.state_dict()["fragments"][0]["backup"]]), _flat(model)))

    handle = inner.register_step_post_hook(capture)
    with d:
        _train(model, inner, rank, range(steps))
    handle.remove()
    globals_after = torch.cat([b.reshape(-1) for b in d.state_dict()["fragments"][0]["backup"]])
    out["ring"] = _flat(model)
    out["ring_globals"] = [s[0] for s in seen] + [globals_after]
    out["ring_locals"] = [s[1] for s in seen]

    # -- LocalSGD: the average every H steps ----------------------------------------------------------
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.LocalSGD(model, inner, sync_every=H):
        _train(model, inner, rank, range(steps))
    out["localsgd"] = _flat(model)
    ref = make_mlp(0)
    ref_inner = _inner(ref)
    for k in range(steps):
        _train(ref, ref_inner, rank, range(k, k + 1))
        if (k + 1) % H == 0:
            with torch.no_grad():
                for p in ref.parameters():
                    dist.all_reduce(p)
                    p.div_(world)
    out["localsgd_ref"] = _flat(ref)

    # -- checkpoint with an exchange in flight, resumed -------------------------------------------
    def build() -> Tuple[nn.Module, torch.optim.Optimizer, Any]:
        m = make_mlp(0)
        opt = _inner(m)
        fr = [m[0:2], m[2:]]
        return m, opt, decentpy.DiLoCo(fr, opt, [_outer(f.parameters()) for f in fr], sync_every=H,
                                       fragment_sync_delay=1, topology="ring")

    model, inner, d = build()
    with d:
        _train(model, inner, rank, range(5))  # step 5: fragment 0 of outer step 2 is in flight
        state = copy.deepcopy({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": d.state_dict()})
        _train(model, inner, rank, range(5, 11))
    straight = _flat(model)
    model, inner, d = build()
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])
    d.load_state_dict(state["diloco"])
    with d:
        _train(model, inner, rank, range(5, 11))
    out["resume_equal"] = torch.equal(straight, _flat(model))

    # -- bad input: every rank raises, before any collective ---------------------------------------
    errors = {}
    m = make_mlp(0)
    cases = {
        "fragments": lambda: decentpy.DiLoCo([m[0:2], m[2:]], _inner(m), _outer(m.parameters()), sync_every=3),
        "delay": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m.parameters()), sync_every=4, fragment_sync_delay=4),
        "alpha": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m.parameters()), 4, fragment_update_alpha=1.5),
        "quantize": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m.parameters()), 4, should_quantize=True,
                                            comm="nccl"),
        "quantize_kind": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m.parameters()), 4, should_quantize=True,
                                                 compression="int4"),
        "outer": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m[0].parameters()), 4),
        "topology": lambda: decentpy.DiLoCo(m, _inner(m), _outer(m.parameters()), 4, topology="rnig"),
        "one_rank": lambda: decentpy.LocalSGD(m, _inner(m), sync_every=0 if rank == 1 else 4),
    }
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is the result
            errors[name] = f"{type(exc).__name__}: {exc}"
    out["errors"] = errors

    # -- a time budget: odd ranks twice as slow, the pseudo-gradients weighted by their inner steps --
    speed = 1.0 + rank % 2          # seconds per inner step on this rank's (fake) clock
    now = [0.0]
    model = make_mlp(0)
    inner = _inner(model)
    d = decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=None, sync_every_s=4.0,
                        clock=lambda: now[0])
    fast_steps = 3 * 4                # 3 windows of 4 s: 4 inner steps a window, or 2 when slow
    n_steps = fast_steps // int(speed)
    with d:
        for k in range(n_steps):
            x, y = batch(rank, k)
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            now[0] += speed
            inner.step()
    out["timed_outer_steps"] = d.outer_steps
    out["timed"] = _flat(model)
    per = 4 // int(speed)
    out["timed_ref"] = _weighted_diloco(rank, [per] * (n_steps // per), _inner)

    # -- the engine: DecentralizedDataParallel(local_steps=H), the fused AdamW inside the backward ---
    def engine(topology: str, upto: int, state: Optional[Dict[str, Any]] = None, start: int = 0,
               buckets: Optional[List[List[int]]] = None, **kw: Any) -> Tuple[torch.Tensor, Any]:
        m = make_mlp(0)
        ddp = decentpy.DecentralizedDataParallel(m, decentpy_optim_fn("adamw"), topology=topology, local_steps=H,
                                                 **kw)
        if state is not None:
            ddp.load_training_state_dict(state)
        saved = None
        for k in range(start, upto):
            if k == 5 and state is None:
                saved = copy.deepcopy(ddp.training_state_dict())
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
        ddp.wait()
        got = _flat(m)
        if buckets is not None:  # the layout: each bucket's parameters, as indices into m.parameters()
            index = {id(p): i for i, p in enumerate(m.parameters())}
            buckets += [[index[id(p)] for p in b.params] for b in ddp.buckets]
        ddp.close()
        return got, saved

    out["engine_complete"], _ = engine("complete", steps)
    ref = make_mlp(0)
    ref_inner = REF_OPTIMIZERS["adamw"](ref)
    _plain_diloco(rank, world, [list(ref.parameters())], ref_inner, [_outer(ref.parameters())], ref, steps, 0, 0.0)
    out["engine_complete_ref"] = _flat(ref)
    # every node a replica: the node all-reduces the gradients each inner step, DiLoCo across the 2 nodes
    out["engine_nodes"], _ = engine("complete", steps, intra_node="allreduce", local_world_size=2)
    ref = make_mlp(0)
    ref_inner = REF_OPTIMIZERS["adamw"](ref)
    ref_outer = _outer(ref.parameters())
    node = [2 * (rank // 2), 2 * (rank // 2) + 1]
    backup = [p.detach().clone() for p in ref.parameters()]
    for k in range(steps):
        ref_inner.zero_grad()
        for r in node:  # the node's mean gradient
            x, y = batch(r, k)
            (loss_fn(ref(x), y) / len(node)).backward()
        ref_inner.step()
        if (k + 1) % H == 0:
            with torch.no_grad():
                for p, b in zip(ref.parameters(), backup):
                    g = b - p
                    dist.all_reduce(g)  # every rank of a node holds the same: the mean over ranks is over nodes
                    p.copy_(b)
                    p.grad = g / world
            ref_outer.step()
            ref_outer.zero_grad()
            backup = [p.detach().clone() for p in ref.parameters()]
    out["engine_nodes_ref"] = _flat(ref)
    # the same with intra_node='shard': each rank steps, keeps and exchanges its half of every bucket
    out["engine_shard"], saved = engine("complete", steps, intra_node="shard", local_world_size=2)
    out["engine_shard_resumed"], _ = engine("complete", steps, state=saved, start=5, intra_node="shard",
                                            local_world_size=2)
    # a time budget in the engine: odd ranks twice as slow on their (fake) clocks; windows of 5 and 3
    # inner steps (the window ends at the first iteration whose backward starts 4 s after it began)
    import decentpy.engine.local_steps as local_steps_module
    now = [0.0]
    speed = 1 + rank % 2
    local_steps_module.CLOCK = lambda: now[0]
    windows = [5, 5, 5] if speed == 1 else [3, 3, 3]

    def timed_engine(**kw: Any) -> Tuple[torch.Tensor, Optional[int]]:
        now[0] = 0.0
        m = make_mlp(0)
        ddp = decentpy.DecentralizedDataParallel(m, decentpy_optim_fn("adamw"), topology="complete",
                                                 sync_every_s=4.0, **kw)
        for k in range(sum(windows)):
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
            now[0] += speed
        ddp.wait()
        got, outer_steps = _flat(m), ddp.outer_steps
        ddp.close()
        return got, outer_steps

    out["engine_timed"], out["engine_timed_outer_steps"] = timed_engine()
    # the same with the int8 outer exchange (the weights mixed apart, uncompressed)
    out["engine_timed_int8"], _ = timed_engine(compression="int8")
    out["engine_timed_int8_ref"] = _int8_diloco_reference(rank, world, 0, windows=windows)
    # and the DiLoCo face's compressed gossip outer step (one-peer-exp) with a time budget
    now = [0.0]
    model = make_mlp(0)
    inner = _inner(model)
    per = 4 // speed
    d = decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=None, sync_every_s=4.0,
                        clock=lambda: now[0], topology="one-peer-exp", compression="int8")
    with d:
        for k in range(3 * per):
            x, y = batch(rank, k)
            inner.zero_grad()
            loss_fn(model(x), y).backward()
            now[0] += speed
            inner.step()
    out["face_timed_gossip_int8"] = _flat(model)
    out["face_timed_gossip_int8_ref"] = _gossip_int8_reference(rank, world, 0, "one-peer-exp", face=True,
                                                               windows=[per] * 3)
    out["engine_timed_ref"] = _weighted_diloco(rank, windows, REF_OPTIMIZERS["adamw"])

    # compressed outer exchange: int8 pseudo-gradients with error feedback, a resume from iteration 5
    out["engine_int8"], saved = engine("complete", steps, compression="int8")
    out["engine_int8_resumed"], _ = engine("complete", steps, state=saved, start=5, compression="int8")
    out["engine_int8_ref"] = _int8_diloco_reference(rank, world, steps)
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, should_quantize=True) as d:
        _train(model, inner, rank, range(5))
        saved_face = copy.deepcopy((d.state_dict(), model.state_dict(), inner.state_dict()))
        _train(model, inner, rank, range(5, steps))
    out["face_int8"] = _flat(model)
    # a compressed gossip outer step (int8, CHOCO on [theta; delta]): pairs (one-peer-exp, a resume
    # from iteration 5 with the public copies) and a group of 4 then pairs (alternating-exp-ring)
    out["engine_gossip_int8"], saved = engine("one-peer-exp", steps, compression="int8")
    out["engine_gossip_int8_resumed"], _ = engine("one-peer-exp", steps, state=saved, start=5, compression="int8")
    out["engine_gossip_int8_ref"] = _gossip_int8_reference(rank, world, steps, "one-peer-exp")
    out["engine_aer_int8"], _ = engine("alternating-exp-ring", steps, compression="int8", local_world_size=2)
    out["engine_aer_int8_ref"] = _gossip_int8_reference(rank, world, steps, "alternating-exp-ring")
    out["engine_aer"], _ = engine("alternating-exp-ring", steps, local_world_size=2)
    # the same on the DiLoCo face (should_quantize on one-peer-exp), with a resume from step 5
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, should_quantize=True,
                         topology="one-peer-exp") as d:
        _train(model, inner, rank, range(5))
        saved_gossip = copy.deepcopy((d.state_dict(), model.state_dict(), inner.state_dict()))
        _train(model, inner, rank, range(5, steps))
    out["face_gossip_int8"] = _flat(model)
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, compression="int8",
                         topology="one-peer-exp") as d:
        d.load_state_dict(saved_gossip[0])
        model.load_state_dict(saved_gossip[1])
        inner.load_state_dict(saved_gossip[2])
        _train(model, inner, rank, range(5, steps))
    out["face_gossip_int8_resumed"] = _flat(model)
    out["face_gossip_int8_ref"] = _gossip_int8_reference(rank, world, steps, "one-peer-exp", face=True)
    # Streaming DiLoCo in the engine: bucket i in fragment i % 2, each exchange in flight over one
    # inner step, merged with alpha 0.5; a checkpoint at iteration 5 (fragment 0's exchange in flight)
    stream = dict(fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5, bucket_size_in_mb=5e-4)
    layout: List[List[int]] = []
    out["engine_streaming"], saved = engine("complete", steps, buckets=layout, **stream)
    out["engine_streaming_resumed"], _ = engine("complete", steps, state=saved, start=5, **stream)
    ref = make_mlp(0)
    ref_params = list(ref.parameters())
    rfr = [[ref_params[i] for b in layout[f::2] for i in b] for f in range(2)]
    out["engine_streaming_buckets"] = len(layout)
    _plain_diloco(rank, world, rfr, REF_OPTIMIZERS["adamw"](ref), [_outer(f) for f in rfr], ref, steps, 1, 0.5)
    out["engine_streaming_ref"] = _flat(ref)
    out["face_int8_ref"] = _int8_diloco_reference(rank, world, steps, face=True)
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _outer(model.parameters()), sync_every=H, compression="int8") as d:
        d.load_state_dict(saved_face[0])
        model.load_state_dict(saved_face[1])
        inner.load_state_dict(saved_face[2])
        _train(model, inner, rank, range(5, steps))
    out["face_int8_resumed"] = _flat(model)
    out["engine_ring"], saved = engine("ring", steps, param_as_bucket_view=False)
    out["engine_ring_resumed"], _ = engine("ring", steps, state=saved, start=5, param_as_bucket_view=False)
    # -- NoLoCo's outer step on random pairs: both faces, the engine's resumed mid-exchange ------------
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, _noloco_outer(model.parameters()), sync_every=H, topology="random-pairs",
                         outer_pull=NOLOCO_PULL):
        _train(model, inner, rank, range(steps))
    out["noloco_face"] = _flat(model)

    def steps_engine(topology: str, options: Any, state: Optional[Dict[str, Any]] = None,
                     start: int = 0) -> Tuple[torch.Tensor, Any]:
        m = make_mlp(0)
        ddp = decentpy.DecentralizedDataParallel(m, decentpy_optim_fn("adamw"), topology=topology, local_steps=options)
        if state is not None:
            ddp.load_training_state_dict(state)
        saved = None
        for k in range(start, steps):
            if k == H and state is None:  # the first outer exchange is in flight (applied at this forward)
                saved = copy.deepcopy(ddp.training_state_dict())
            x, y = batch(rank, k)
            loss_fn(ddp(x), y).backward()
        ddp.wait()
        got = _flat(m)
        ddp.close()
        return got, saved

    noloco = decentpy.LocalSteps(sync_every=H, outer_optim=_noloco_outer, outer_pull=NOLOCO_PULL)
    out["noloco_engine"], saved = steps_engine("random-pairs", noloco)
    out["noloco_engine_resumed"], _ = steps_engine("random-pairs", noloco, saved, H)

    # -- SparseLoCo's exchange: the DiLoCo face against the rule re-computed, the engine resumed --------
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=SPARSE_LR), sync_every=H,
                         sparse=SPARSE) as d:
        _train(model, inner, rank, range(steps))
        out["sparse_face_state"] = {k: v for k, v in d.state_dict()["fragments"][0].items() if k == "error"}
    out["sparse_face"] = _flat(model)
    sparse = decentpy.LocalSteps(sync_every=H, sparse=SPARSE,
                                 outer_optim=lambda p: torch.optim.SGD(p, lr=SPARSE_LR))
    out["sparse_engine"], saved = steps_engine("complete", sparse)
    out["sparse_engine_resumed"], _ = steps_engine("complete", sparse, saved, H)
    out["sparse_engine_bytes"] = saved is not None and "error" in saved["compression"]["buckets"][0]
    # -- the sparse gossip outer step (one-peer-exp): the face against the rule, both resumed ----------
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=SPARSE_LR), sync_every=H,
                         sparse=SPARSE_GOSSIP, topology="one-peer-exp") as d:
        _train(model, inner, rank, range(H + 1))
        saved_face = copy.deepcopy((d.state_dict(), model.state_dict(), inner.state_dict()))
        _train(model, inner, rank, range(H + 1, steps))
    out["sparse_gossip_face"] = _flat(model)
    model = make_mlp(0)
    inner = _inner(model)
    with decentpy.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=SPARSE_LR), sync_every=H,
                         sparse=SPARSE_GOSSIP, topology="one-peer-exp") as d:
        d.load_state_dict(saved_face[0])
        model.load_state_dict(saved_face[1])
        inner.load_state_dict(saved_face[2])
        _train(model, inner, rank, range(H + 1, steps))
    out["sparse_gossip_face_resumed"] = _flat(model)
    out["sparse_gossip_ref"] = _sparse_gossip_reference(rank, world, steps)
    gossip = decentpy.LocalSteps(sync_every=H, sparse=SPARSE_GOSSIP,
                                 outer_optim=lambda p: torch.optim.SGD(p, lr=SPARSE_LR))
    out["sparse_gossip_engine"], saved = steps_engine("one-peer-exp", gossip)
    out["sparse_gossip_engine_resumed"], _ = steps_engine("one-peer-exp", gossip, saved, H)

    errors = {}
    for name, kw in {"zero": dict(local_steps=0),
                     "fragments": dict(local_steps=4, fragments=3),
                     "delay": dict(local_steps=4, fragments=2, fragment_sync_delay=2),
                     "alpha": dict(local_steps=4, fragment_update_alpha=-0.1),
                     "streaming_without_local_steps": dict(fragments=2),
                     "streaming_with_budget": dict(sync_every_s=2.0, fragments=2),
                     "sparse_compressed": dict(local_steps=decentpy.LocalSteps(sync_every=4, sparse=SPARSE),
                                               compression="int8")}.items():
        try:
            decentpy.DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("adamw"), **kw)
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the message is the result
            errors[name] = f"{type(exc).__name__}: {exc}"
    out["engine_errors"] = errors
    return out


@pytest.fixture(scope="module")
def results() -> List[Dict[str, Any]]:
    env = {}
    if _torchft_path():
        env["DECENTPY_TORCHFT_PATH"] = _torchft_path()  # type: ignore[assignment]
    return run_workers(_worker, N, timeout=240, env=env)


def test_complete_is_diloco(results: List[Dict[str, Any]]) -> None:
    """The complete topology is DiLoCo: the plain-torch re-computation to float32 rounding."""
    for rank, r in enumerate(results):
        assert r["complete_outer_steps"] == OUTER
        assert not torch.allclose(r["complete"], r["no_sync"]), "nothing trained"
        torch.testing.assert_close(r["complete"], r["complete_ref"], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["complete"], results[0]["complete"], rtol=0, atol=0)  # one model everywhere


def test_streaming_fragments_match_torchfts_schedule(results: List[Dict[str, Any]]) -> None:
    """Per-fragment outer optimizers, and one shared by both fragments (a fragment's outer step
    leaves the other fragment's parameters alone): the plain re-computation of torchft's schedule."""
    for rank, r in enumerate(results):
        for kind in ("streaming", "streaming_shared"):
            torch.testing.assert_close(r[kind], r["streaming_ref"], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {kind}: {m}")


@pytest.mark.parametrize("kind", ["complete", "streaming"])
def test_equals_torchft_diloco(results: List[Dict[str, Any]], kind: str) -> None:
    """torchft 0.2.0's DiLoCo on the same seeds (a stand-in Manager on the default group)."""
    if results[0][f"torchft_{kind}"] is None:
        pytest.skip("torchft 0.2.0 is not importable here (set DECENTPY_TORCHFT_PATH to a --target install: "
                    "docs/elastic.md)")
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[kind], r[f"torchft_{kind}"], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {m}")


def _float64_window(models: List[nn.Module], inners: List[torch.optim.Optimizer], o: int) -> None:
    """Window ``o``'s H inner steps of each float64 replica on its own batches."""
    for i, m in enumerate(models):
        for k in range(o * H, (o + 1) * H):
            x, y = batch(i, k)
            inners[i].zero_grad()
            loss_fn(m(x.double()), y.double()).backward()
            inners[i].step()


def _float64_ring(inner: Any = None) -> Tuple[List[torch.Tensor], List[List[torch.Tensor]]]:
    """The four replicas in one process, float64: torch's AdamW inner steps, at each outer step the
    ring's mixing matrix W(k) applied to the global copies and to the pseudo-gradients, torch's
    Nesterov SGD from the mixed global copy."""
    from decentpy.topology import make_topology

    topo = make_topology("ring", N, 1)
    models = [make_mlp(0).double() for _ in range(N)]
    inners = [(inner or _inner)(m) for m in models]
    outers = [_outer(m.parameters()) for m in models]
    globals_ = [[p.detach().clone() for p in m.parameters()] for m in models]
    history = [[torch.cat([g.reshape(-1) for g in gl]) for gl in globals_]]
    for o in range(OUTER):
        _float64_window(models, inners, o)
        w = topo.mixing_matrix(o).double()
        deltas = [[g - p.detach() for g, p in zip(globals_[i], models[i].parameters())] for i in range(N)]
        new = []
        for i, m in enumerate(models):
            with torch.no_grad():
                for j, p in enumerate(m.parameters()):
                    p.copy_(sum(w[i, q] * globals_[q][j] for q in range(N)))
                    p.grad = sum(w[i, q] * deltas[q][j] for q in range(N))
            outers[i].step()
            outers[i].zero_grad()
            new.append([p.detach().clone() for p in m.parameters()])
        globals_ = new
        history.append([torch.cat([g.reshape(-1) for g in gl]) for gl in globals_])
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models], history


NOLOCO_PULL = 0.5  # gamma = 0.35 with the outer lr 0.7: the pull's weight apart from the lr's
SPARSE = SparseOuter(k=8, chunk=64, decay=0.5)  # 5 chunks of the MLP's 275 (the last of 19)
SPARSE_LR = 1.0  # SparseLoCo's theta <- theta - alpha mean; (decay 0.5 and lr 1: exact in float32)


def _sparse_reference() -> List[torch.Tensor]:
    """SparseLoCo on the four replicas in one process, float32, the rule written out
    (tests/sparse_reference.py: e <- beta e + delta, the chunk-wise top-k of e in 2 bits, e minus what
    was sent; the members' mean; theta <- theta - alpha mean; the parameters restart from theta),
    torch's AdamW inner steps as the DiLoCo face's."""
    import sparse_reference as R

    models = [make_mlp(0) for _ in range(N)]
    inners = [_inner(m) for m in models]
    theta = [_flat(m) for m in models]
    errors = [torch.zeros_like(theta[0]) for _ in range(N)]
    for o in range(OUTER):
        for i, m in enumerate(models):
            _train(m, inners[i], i, range(o * H, (o + 1) * H))
        wires = []
        for i, m in enumerate(models):
            w, errors[i] = R.pack(_flat(m), theta[i], errors[i], SPARSE.chunk, SPARSE.k, SPARSE.decay)
            wires.append(w)
        mean = R.mean(wires, theta[0].numel(), SPARSE.chunk, SPARSE.k)
        for i, m in enumerate(models):
            theta[i] = theta[i] - SPARSE_LR * mean
            with torch.no_grad():
                at = 0
                for p in m.parameters():
                    p.copy_(theta[i][at:at + p.numel()].view_as(p))
                    at += p.numel()
    return [_flat(m) for m in models]


SPARSE_GOSSIP = SparseOuter(k=8, chunk=64, gamma=0.5)  # [theta; delta]: 550 elements, 9 chunks


def _sparse_gossip_reference(rank: int, world: int, steps: int) -> torch.Tensor:
    """The sparse gossip outer step on one-peer-exp, float32, written from
    decentpy/local_steps/sparse.py's docstring: ``z = [theta; theta - x]`` (the DiLoCo face's buffer:
    the parameters in order), per pair copies ``(zhat_i, M)`` from ``[theta_0; 0]``; ``q = S(z - zhat_i)``
    (tests/sparse_reference.py's top-k and 2-bit codes of the difference), ``zhat_i += D(q)``,
    ``M += mean(D(q_i), D(q_j))``, ``z += gamma s m (M - zhat_i)``; then ``theta = z_theta - lr z_delta``
    (SGD, no momentum); torch's AdamW inside."""
    import torch.distributed as dist
    import sparse_reference as R
    from compression_reference import one_peer_exp_partner, pair_schedule

    schedule = pair_schedule(one_peer_exp_partner(world))
    s = SPARSE_GOSSIP
    ref = make_mlp(0)
    inner = _inner(ref)
    theta = _flat(ref)
    n = theta.numel()
    z0 = torch.cat([theta, torch.zeros_like(theta)])
    copies: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
    for o in range(steps // H):
        _train(ref, inner, rank, range(o * H, (o + 1) * H))
        peers, nw = schedule(o, rank)
        g = tuple(sorted(peers + [rank]))
        own, mean = copies.setdefault(g, [z0.clone(), z0.clone()])
        z = torch.cat([theta, theta - _flat(ref)])
        wire, _ = R.pack(own, z, torch.zeros(2 * n), s.chunk, s.k, 0.0)
        own += R.mean([wire], 2 * n, s.chunk, s.k)
        mine = torch.tensor(list(wire), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        mean += R.mean([bytes(every[j].tolist()) for j in g], 2 * n, s.chunk, s.k)
        z += s.consensus * nw * len(g) * (mean - own)
        theta = z[:n] - SPARSE_LR * z[n:]
        with torch.no_grad():
            at = 0
            for p in ref.parameters():
                p.copy_(theta[at:at + p.numel()].view_as(p))
                at += p.numel()
    return _flat(ref)


def test_sparse_gossip_outer_step_matches_the_rule_and_resumes(results: List[Dict[str, Any]]) -> None:
    """The sparse gossip outer step (SparseLoCo's messages as the compressor of a CHOCO mix on
    one-peer-exp): the DiLoCo face equals the rule re-computed in float32 to float32 rounding; both
    faces resume bit for bit (the face from a checkpoint one step into a window, the engine's with its
    first exchange in flight); the replicas differ (a gossip step, not an average), and the exchange
    moved them (the result is not what no exchange at all gives: each replica's own inner steps)."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["sparse_gossip_face"], r["sparse_gossip_ref"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["sparse_gossip_face"], r["sparse_gossip_face_resumed"]), f"rank {rank}: face resume"
        assert torch.equal(r["sparse_gossip_engine"], r["sparse_gossip_engine_resumed"]), f"rank {rank}: resume"
        assert torch.isfinite(r["sparse_gossip_engine"]).all()
    assert not torch.equal(results[0]["sparse_gossip_face"], results[1]["sparse_gossip_face"])
    assert not torch.equal(results[0]["sparse_gossip_engine"], results[1]["sparse_gossip_engine"])


def test_sparseloco_matches_the_rule_and_resumes(results: List[Dict[str, Any]]) -> None:
    """SparseLoCo's exchange on the complete topology: the DiLoCo face equals the rule re-computed in
    float32 element by element (its top-k, 2-bit codes and error feedback: tests/sparse_reference.py)
    to float32 rounding; the engine's face, resumed from a checkpoint taken while its first exchange
    was in flight (the error buffers in it), is bit-equal to its uninterrupted run; every replica
    ends on the same model (the mean is exact)."""
    want = _sparse_reference()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["sparse_face"], want[rank], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["sparse_face"], results[0]["sparse_face"])
        assert torch.equal(r["sparse_engine"], results[0]["sparse_engine"])
        assert torch.equal(r["sparse_engine"], r["sparse_engine_resumed"]), f"rank {rank}: the resumed run differs"
        assert r["sparse_engine_bytes"] and r["sparse_face_state"]["error"][0].abs().sum() > 0


def _noloco_outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.5)


def _float64_noloco(inner: Any = None, gamma: float = 0.7 * NOLOCO_PULL) -> List[torch.Tensor]:
    """NoLoCo's rule as its authors' code writes it (jkolehm/noloco, src/noloco/sparse_optimizer_c.py),
    float64, the four replicas in one process: after H inner steps each replica ``i`` averages with
    its group ``G`` of this outer step (random-pairs' mixing matrix), ``m_i <- beta m_i + lr
    mean_G(x - phi) + gamma (mean_G(phi) - phi_i)``, ``phi_i <- phi_i + m_i``, ``x_i <- phi_i``."""
    from decentpy.topology import make_topology

    topo = make_topology("random-pairs", N, 1)
    lr, beta = 0.7, 0.5
    models = [make_mlp(0).double() for _ in range(N)]
    inners = [(inner or _inner)(m) for m in models]
    phi = [[p.detach().clone() for p in m.parameters()] for m in models]
    mom = [[torch.zeros_like(p) for p in m.parameters()] for m in models]
    for o in range(OUTER):
        _float64_window(models, inners, o)
        w = topo.mixing_matrix(o).double()
        xs = [[p.detach().clone() for p in m.parameters()] for m in models]
        assert all(int((w[i] > 0).sum()) == 2 for i in range(N)), "random-pairs: one peer per outer step"
        new = []
        for i in range(N):
            row = []
            for j in range(len(phi[i])):
                mean_x = sum(w[i, q] * xs[q][j] for q in range(N))
                mean_phi = sum(w[i, q] * phi[q][j] for q in range(N))
                mom[i][j] = beta * mom[i][j] + lr * (mean_x - mean_phi) + gamma * (mean_phi - phi[i][j])
                row.append(phi[i][j] + mom[i][j])
            new.append(row)
        phi = new
        with torch.no_grad():
            for m, ph in zip(models, phi):
                for p, t in zip(m.parameters(), ph):
                    p.copy_(t)
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]


@pytest.mark.parametrize("face", ["noloco_face", "noloco_engine"])
def test_noloco_matches_its_authors_rule_in_float64(results: List[Dict[str, Any]], face: str) -> None:
    """NoLoCo's outer step (``outer_pull``, heavy-ball SGD, random pairs) through both faces against
    the float64 re-computation of the authors' rule; the engine's run resumed from a checkpoint taken
    while its first outer exchange was in flight is bit-equal to the uninterrupted one."""
    final = _float64_noloco(REF_OPTIMIZERS["adamw"] if face == "noloco_engine" else None)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[face].double(), final[rank], rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
    if face == "noloco_engine":
        for rank, r in enumerate(results):
            assert torch.equal(r["noloco_engine"], r["noloco_engine_resumed"]), f"rank {rank}: the resumed run differs"
    # the pull is what the comparison resolves: the same rule without it lands measurably elsewhere
    unpulled = _float64_noloco(REF_OPTIMIZERS["adamw"] if face == "noloco_engine" else None, gamma=0.0)
    assert float((results[0][face].double() - unpulled[0]).abs().max()) > 1e-3
    assert not torch.allclose(results[0][face], results[1][face]), "gossip replicas should differ"


def test_gossip_outer_steps_match_float64_reference(results: List[Dict[str, Any]]) -> None:
    final, _ = _float64_ring()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["ring"].double(), final[rank], rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
    assert not torch.allclose(results[0]["ring"], results[1]["ring"]), "gossip replicas should differ"


def test_gossip_mean_global_copy_follows_diloco(results: List[Dict[str, Any]]) -> None:
    """Mean preservation: the replicas' mean global copy after outer step k is the mean before it
    stepped by torch's Nesterov SGD with the mean pseudo-gradient (its momentum the running one)."""
    mean_model = nn.Parameter(torch.stack([r["ring_globals"][0] for r in results]).double().mean(0))
    opt = _outer([mean_model])
    for k in range(OUTER):
        mean_delta = torch.stack([r["ring_globals"][k].double() - r["ring_locals"][k].double()
                                  for r in results]).mean(0)
        mean_model.grad = mean_delta
        opt.step()
        got = torch.stack([r["ring_globals"][k + 1].double() for r in results]).mean(0)
        torch.testing.assert_close(got, mean_model.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"outer step {k}: {m}")


def test_time_budget_weights_the_pseudo_gradients_by_inner_steps(results: List[Dict[str, Any]]) -> None:
    """sync_every_s: in each 4 s window the fast ranks take 4 inner steps, the slow ones (half the
    speed) 2; three outer steps on every rank, each the mean of the pseudo-gradients weighted by the
    steps behind them -- a plain re-computation of that weighted DiLoCo, to float32 rounding."""
    for rank, r in enumerate(results):
        assert r["timed_outer_steps"] == 3, (rank, r["timed_outer_steps"])
        torch.testing.assert_close(r["timed"], r["timed_ref"], rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["timed"], results[0]["timed"], rtol=0, atol=0)


def test_local_sgd_averages_every_h_steps(results: List[Dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["localsgd"], r["localsgd_ref"], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {m}")


def test_checkpoint_with_an_exchange_in_flight_resumes_bit_for_bit(results: List[Dict[str, Any]]) -> None:
    assert [r["resume_equal"] for r in results] == [True] * N


def test_bad_input_raises_on_every_rank(results: List[Dict[str, Any]]) -> None:
    want = {"fragments": "multiple of the number of fragments", "delay": "fragment_sync_delay must be",
            "alpha": "fragment_update_alpha must be in", "quantize": "runs over comm='torch'",
            "quantize_kind": "should_quantize=True asks for int8",
            "outer": "does not hold every parameter", "topology": "rnig"}
    for rank, r in enumerate(results):
        for name, text in want.items():
            assert r["errors"][name] is not None and text in r["errors"][name], (rank, name, r["errors"][name])
        msg = r["errors"]["one_rank"]
        assert msg is not None, rank
        assert ("sync_every must be an int >= 1" in msg) if rank == 1 else ("rank 1" in msg), (rank, msg)


def test_engine_local_steps_complete_is_diloco(results: List[Dict[str, Any]]) -> None:
    """DecentralizedDataParallel(local_steps=H) on the complete topology: the fused AdamW inside the
    backward for H iterations, then DiLoCo's outer step -- the plain-torch DiLoCo with torch's AdamW
    to float32 rounding (the fused kernel and torch's AdamW differ in the last bits)."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["engine_complete"], r["engine_complete_ref"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["engine_complete"], results[0]["engine_complete"], rtol=0, atol=0)


def test_engine_local_steps_ring_matches_float64_reference_and_resumes(results: List[Dict[str, Any]]) -> None:
    """A gossip outer step on the ring (separate parameters, param_as_bucket_view=False): the float64
    four-replica re-computation with torch's AdamW; a checkpoint at iteration 5 resumes bit for bit."""
    final, _ = _float64_ring(REF_OPTIMIZERS["adamw"])
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["engine_ring"].double(), final[rank], rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["engine_ring"], r["engine_ring_resumed"]), f"rank {rank}: the resumed run differs"


def test_engine_local_steps_with_node_allreduce_is_node_level_diloco(results: List[Dict[str, Any]]) -> None:
    """intra_node='allreduce' + local_steps: each node (2 ranks) a replica whose inner steps use the
    node's mean gradient, DiLoCo's outer step across the nodes -- the plain-torch re-computation."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["engine_nodes"], r["engine_nodes_ref"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["engine_nodes"], results[0]["engine_nodes"], rtol=0, atol=0)


def test_engine_local_steps_with_node_shard_is_node_level_diloco(results: List[Dict[str, Any]]) -> None:
    """intra_node='shard' + local_steps: the node reduce-scatters the gradients, each rank steps its half
    of every bucket and keeps that half's global copy and outer momentum, DiLoCo across the nodes
    between the ranks holding the same half -- the same plain-torch node-level DiLoCo as
    intra_node='allreduce'; a checkpoint at iteration 5 resumes bit for bit."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["engine_shard"], r["engine_nodes_ref"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(r["engine_shard"], results[0]["engine_shard"], rtol=0, atol=0)
        assert torch.equal(r["engine_shard"], r["engine_shard_resumed"]), f"rank {rank}: the resume differs"


@pytest.mark.parametrize("kind", ["gossip_int8", "aer_int8"])
def test_engine_compressed_gossip_outer_step_matches_float64_reference(results: List[Dict[str, Any]],
                                                                      kind: str) -> None:
    """local_steps + compression='int8' on a gossip topology: CHOCO on [theta; delta] with public copies
    per pair partner (one-peer-exp) and a group's public mean (alternating-exp-ring's group of 4), the
    float64 re-computation from the docs; the pairs' run resumes bit for bit from iteration 5, and so
    does the DiLoCo face's (should_quantize=True on one-peer-exp, against the same re-computation);
    the compression is real (the result differs from the float32 gossip outer step)."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[f"engine_{kind}"].double(), r[f"engine_{kind}_ref"].double(), rtol=1e-4,
                                   atol=2e-5, msg=lambda m: f"rank {rank}: {m}")
    if kind == "gossip_int8":
        for rank, r in enumerate(results):
            assert torch.equal(r["engine_gossip_int8"], r["engine_gossip_int8_resumed"]), f"rank {rank}: resume differs"
            torch.testing.assert_close(r["face_gossip_int8"].double(), r["face_gossip_int8_ref"].double(), rtol=1e-4,
                                       atol=2e-5, msg=lambda m: f"rank {rank}, DiLoCo face: {m}")
            assert torch.equal(r["face_gossip_int8"], r["face_gossip_int8_resumed"]), f"rank {rank}: face resume"
    else:
        gap = (results[0]["engine_aer_int8"] - results[0]["engine_aer"]).abs().max().item()
        err = (results[0]["engine_aer_int8"].double() - results[0]["engine_aer_int8_ref"].double()).abs().max().item()
        assert gap > 10 * err, (gap, err)


def test_engine_streaming_fragments_match_torchfts_schedule_and_resume(results: List[Dict[str, Any]]) -> None:
    """DecentralizedDataParallel(local_steps=4, fragments=2, fragment_sync_delay=1,
    fragment_update_alpha=0.5): the buckets in turn, one fragment's exchange in flight over one inner
    step, merged back by alpha -- the plain-torch re-computation of torchft's Streaming DiLoCo schedule
    (fragment f = the buckets i with i % 2 == f) with torch's AdamW; a checkpoint taken while a
    fragment's exchange is in flight resumes bit for bit."""
    for rank, r in enumerate(results):
        assert r["engine_streaming_buckets"] >= 2, r["engine_streaming_buckets"]
        torch.testing.assert_close(r["engine_streaming"], r["engine_streaming_ref"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["engine_streaming"], r["engine_streaming_resumed"]), f"rank {rank}: the resume differs"
    # the merge and the delay matter: the result is not the plain DiLoCo's
    assert not torch.allclose(results[0]["engine_streaming"], results[0]["engine_complete"], rtol=1e-3, atol=1e-4)


def test_engine_local_steps_int8_outer_exchange_matches_reference_and_resumes(results: List[Dict[str, Any]]) -> None:
    """local_steps + compression='int8' on the complete topology: the float64 re-computation of DiLoCo
    with error-fed int8 pseudo-gradients and the owners' re-quantised mean; every rank holds the same
    parameters; a checkpoint at iteration 5 (the error feedback in it) resumes bit for bit; and the
    compression shows: the int8 run is not the full-precision one."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["engine_int8"].double(), r["engine_int8_ref"].double(), rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["engine_int8"], results[0]["engine_int8"]), f"rank {rank}: the replicas differ"
        assert torch.equal(r["engine_int8"], r["engine_int8_resumed"]), f"rank {rank}: the resumed run differs"
    gap = (results[0]["engine_int8"] - results[0]["engine_complete"]).abs().max().item()
    err = (results[0]["engine_int8"].double() - results[0]["engine_int8_ref"].double()).abs().max().item()
    assert gap > 10 * err, (gap, err)


def test_engine_time_budget_weights_the_pseudo_gradients_by_inner_steps(results: List[Dict[str, Any]]) -> None:
    """DecentralizedDataParallel(sync_every_s=4) with odd ranks twice as slow: 3 outer steps on every
    rank after 5 and 3 inner steps a window, equal to the weighted DiLoCo written out (torch's AdamW
    inside, sum s_j delta_j / sum s_j) to float32 rounding; every rank ends on the same global copy."""
    for rank, r in enumerate(results):
        assert r["engine_timed_outer_steps"] == 3, (rank, r["engine_timed_outer_steps"])
        torch.testing.assert_close(r["engine_timed"], r["engine_timed_ref"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["engine_timed"], results[0]["engine_timed"]), f"rank {rank}: not the same global copy"


@pytest.mark.parametrize("kind", ["engine_timed_int8", "face_timed_gossip_int8"])
def test_time_budget_with_a_compressed_outer_exchange(results: List[Dict[str, Any]], kind: str) -> None:
    """sync_every_s with compression='int8' (odd ranks twice as slow): the engine on the complete
    topology (the weighted pseudo-gradient error-fed, the weights' mean apart) and the DiLoCo face's
    compressed gossip outer step on one-peer-exp -- each against its float64 re-computation."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[kind].double(), r[f"{kind}_ref"].double(), rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")


def test_diloco_face_should_quantize_is_the_int8_outer_exchange(results: List[Dict[str, Any]]) -> None:
    """decentpy.DiLoCo(should_quantize=True): the same error-fed int8 outer exchange as the engine's,
    against the float64 re-computation over the face's flat buffer; every rank equal; a checkpoint
    at step 5 (the error feedback in it) resumed with compression='int8' bit for bit."""
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["face_int8"].double(), r["face_int8_ref"].double(), rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"rank {rank}: {m}")
        assert torch.equal(r["face_int8"], results[0]["face_int8"]), f"rank {rank}: the replicas differ"
        assert torch.equal(r["face_int8"], r["face_int8_resumed"]), f"rank {rank}: the resumed run differs"
    gap = (results[0]["face_int8"] - results[0]["complete"]).abs().max().item()
    err = (results[0]["face_int8"].double() - results[0]["face_int8_ref"].double()).abs().max().item()
    assert gap > 10 * err, (gap, err)


def test_engine_local_steps_bad_input(results: List[Dict[str, Any]]) -> None:
    want = {"zero": "local_steps must be an int >= 1",
            "fragments": "local_steps=4 must be a multiple of the number of fragments (3)",
            "delay": "fragment_sync_delay must be an int in [0, 2)",
            "alpha": "fragment_update_alpha must be in [0, 1], got -0.1",
            "streaming_without_local_steps": "give local_steps=H (> 1) as well",
            "streaming_with_budget": "sync_every_s (a time budget) runs one fragment",
            "sparse_compressed": "give sparse= or compression='int8', not both"}
    for rank, r in enumerate(results):
        for name, text in want.items():
            msg = r["engine_errors"][name]
            assert msg is not None and text in msg, (rank, name, msg)

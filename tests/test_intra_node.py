"""``intra_node='shard' | 'allreduce'``: nodes of L ranks average gradients exactly, gossip across nodes.

Every scenario is checked against an independent re-computation: the float64 plain-PyTorch
simulation of node-level decentralized training (``reference.simulate`` with one worker per node
whose gradient is the mean over the node's ranks' batches, the topology run over the nodes),
torch's own DDP + AdamW for a single node, or plain gossip (L = 1). One spawn per world size runs
every scenario; each is then its own test case.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from dist_harness import run_workers, single_process_group
from reference import assert_close_params, batch, decentpy_optim_fn, grad_factor64, loss_fn, make_mlp, simulate

STEPS = 5
CLIP = 0.05
JOIN_STOP = 3  # in the Join scenario rank 1 runs out of data after this many iterations

# name -> (intra_node, local_world_size, topology, optimizer, bucket MiB)
SCENARIOS_4: Dict[str, tuple] = {
    "shard-complete-adam": ("shard", 2, "complete", "adam", 0.0002),
    "shard-ring-sgd": ("shard", 2, "ring", "sgd", 25),
    "allreduce-ope-adam": ("allreduce", 2, "one-peer-exp", "adam", 0.0002),
    "shard-L1-ring-accum": ("shard", 1, "ring", "accum_adam", 0.0002),
    "gossip-L1-ring-accum": ("gossip", 1, "ring", "accum_adam", 0.0002),
    "shard-G1-adamw": ("shard", 4, "complete", "torch_adamw", 25),
    "shard-nosync-sgd": ("shard", 2, "complete", "sgd", 25),
    "shard-join-adam": ("shard", 2, "complete", "adam", 0.0002),
    "shard-scaler-clip-sgd": ("shard", 2, "complete", "sgd", 25),
    "shard-noview-adam": ("shard", 2, "ring", "adam", 0.0002),
    "shard-rmsprop": ("shard", 2, "complete", "rmsprop", 0.0002),
    "shard-scaler-inf-sgd": ("shard", 2, "complete", "sgd", 0.0002),
    "allreduce-join-scaler-sgd": ("allreduce", 2, "ring", "sgd", 0.0002),
}
INF_RANK, INF_STEP = 1, 2  # in 'shard-scaler-inf-sgd' this rank's loss is inf at this iteration
# Join x resume, each in one run: rank 1 runs out of data after JOIN_STOP iterations, every rank takes a
# checkpoint before iteration RESUME_AT (all still have data) and a fresh wrapper resumes from it under
# Join; name -> (intra_node, local_world_size, topology, optimizer, bucket MiB) as above
RESUME_SCENARIOS: Dict[str, tuple] = {
    "allreduce-ignore-join-resume-adam": ("allreduce", 2, "ring", "adam", 0.0002),  # nonfinite='ignore'
    "shard-scaler-inf-join-resume-adam": ("shard", 2, "complete", "adam", 0.0002),  # + a GradScaler, an inf
}
RESUME_AT = 2
SCALER_INF = (3, 3)  # (rank, iteration): an inf loss after the checkpoint, while rank 1 has joined
SCENARIOS_8: Dict[str, tuple] = {
    "shard-complete-sgd": ("shard", 2, "complete", "sgd", 0.0002),
    "shard-ring-adam": ("shard", 2, "ring", "adam", 25),
    "shard-ope-adamw": ("shard", 2, "one-peer-exp", "adamw", 0.0002),
    "shard-aer-accum": ("shard", 2, "alternating-exp-ring", "accum_adam", 25),
}


def _params(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def _train(rank: int, name: str, spec: tuple) -> Dict[str, Any]:
    from decentpy import DecentralizedDataParallel

    intra, local, topo, opt, cap = spec
    model = make_mlp(seed=0 if rank == 0 else 100 + rank)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if "scaler" in name else None
    ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology=topo, local_world_size=local,
                                    intra_node=intra, bucket_size_in_mb=cap, scaler=scaler,
                                    grad_clip_norm=CLIP if "clip" in name else 0.0,
                                    param_as_bucket_view="noview" not in name)
    out: Dict[str, Any] = {}
    steps = JOIN_STOP if ("join" in name and rank == 1) else STEPS
    with ddp.join() if "join" in name else contextlib.nullcontext():
        for k in range(steps):
            if "nosync" in name:
                with ddp.no_sync():
                    x, y = batch(rank, 2 * k)
                    loss_fn(ddp(x), y).backward()
                x, y = batch(rank, 2 * k + 1)
            else:
                x, y = batch(rank, k)
            loss = loss_fn(ddp(x), y)
            if "inf" in name and (rank, k) == (INF_RANK, INF_STEP):
                loss = loss * float("inf")  # the node's mean gradient is not finite: its whole model skips
            (scaler.scale(loss) if scaler is not None else loss).backward()
    # read straight after the last backward (the shards' all-gather may be in flight: the state dict waits)
    out["state_dict"] = {k: v.double().clone() for k, v in model.state_dict().items()}
    ddp.wait()
    out["params"] = _params(model)
    if intra == "shard" and local > 1:
        out["state_elems"] = sum(t.numel() for o in ddp.state_optimizers
                                 for st in o.state.values() for t in st.values()
                                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    if name == "shard-complete-adam":
        ddp.global_avg(will_revert=False)
        out["avg"] = _params(model)
    ddp.close()
    return out


def _checkpoint(rank: int) -> Dict[str, Any]:
    """3 iterations, a checkpoint, 2 more; a fresh wrapper resumes from the checkpoint: same result."""
    from decentpy import DecentralizedDataParallel

    def wrap(model: torch.nn.Module) -> Any:
        return DecentralizedDataParallel(model, decentpy_optim_fn("adam"), topology="ring", local_world_size=2,
                                         intra_node="shard", bucket_size_in_mb=0.0002)

    model = make_mlp(seed=0)
    ddp = wrap(model)
    for k in range(STEPS):
        if k == 3:
            saved = copy.deepcopy(ddp.training_state_dict())  # (state dicts share the live tensors)
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
    ddp.wait()
    straight = _params(model)
    ddp.close()
    model2 = make_mlp(seed=7)
    ddp2 = wrap(model2)
    try:  # another local rank's checkpoint holds the other shard's optimizer state: refused
        ddp2.load_training_state_dict(dict(saved, rank=saved["rank"] ^ 1))
        wrong_shard = None
    except ValueError as exc:
        wrong_shard = str(exc)
    ddp2.load_training_state_dict(saved)
    for k in range(3, STEPS):
        x, y = batch(rank, k)
        loss_fn(ddp2(x), y).backward()
    ddp2.wait()
    resumed = _params(model2)
    ddp2.close()
    return {"straight": straight, "resumed": resumed, "wrong_shard": wrong_shard}


def _join_resume(rank: int, name: str, spec: tuple) -> Dict[str, Any]:
    """Uneven inputs under Join with a checkpoint before iteration RESUME_AT, and a fresh wrapper (other
    initial parameters, a GradScaler with another initial scale) resuming from it under Join: the
    uninterrupted run's parameters and scaler, and the resumed run's. 'ignore': nonfinite='ignore'.
    'scaler': a GradScaler (growth every 2 clean iterations) and an inf loss at SCALER_INF, after the
    checkpoint: that rank's node skips its update and its scalers back off."""
    from decentpy import DecentralizedDataParallel

    intra, local, topo, opt, cap = spec
    scaled = "scaler" in name

    def wrap(seed: int, init_scale: float) -> tuple:
        model = make_mlp(seed=seed)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2) if scaled else None
        ddp = DecentralizedDataParallel(model, decentpy_optim_fn(opt), topology=topo, local_world_size=local,
                                        intra_node=intra, bucket_size_in_mb=cap, scaler=scaler,
                                        nonfinite="ignore" if "ignore" in name else "skip")
        return model, ddp, scaler

    def run(ddp: Any, scaler: Any, start: int, saved: Optional[List[Any]] = None) -> List[float]:
        scales = []
        with ddp.join():
            for k in range(start, JOIN_STOP if rank == 1 else STEPS):
                if saved is not None and k == RESUME_AT:
                    saved.append(copy.deepcopy(ddp.training_state_dict()))
                x, y = batch(rank, k)
                loss = loss_fn(ddp(x), y)
                if scaled and (rank, k) == SCALER_INF:
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if scaler is not None:
                    scales.append(scaler.get_scale())
        ddp.wait()
        return scales

    model, ddp, scaler = wrap(0 if rank == 0 else 100 + rank, 2.0 ** 10)
    saved: List[Any] = []
    out: Dict[str, Any] = {"scales": run(ddp, scaler, 0, saved)}
    out["params"] = _params(model)
    out["scaler"] = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    out["skipped"] = ddp.stats()["skipped_steps"]
    ddp.close()
    model2, ddp2, scaler2 = wrap(7, 2.0)
    out["fresh_scale"] = scaler2.get_scale() if scaler2 is not None else None
    ddp2.load_training_state_dict(saved[0])
    run(ddp2, scaler2, RESUME_AT)
    out["resumed"] = _params(model2)
    out["scaler_resumed"] = copy.deepcopy(scaler2.state_dict()) if scaler2 is not None else None
    ddp2.close()
    return out


def _torch_ddp(rank: int) -> Dict[str, torch.Tensor]:
    """One node of 4 = torch DDP with torch AdamW (decentpy's 'torch_adamw' groups)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from decentpy.optim import split_decay_groups

    model = make_mlp(seed=0)
    ddp = DDP(model, process_group=dist.new_group(list(range(4))))
    opt = torch.optim.AdamW(split_decay_groups(list(model.named_parameters()), 0.1), lr=0.01)
    for k in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, k)
        loss_fn(ddp(x), y).backward()
        opt.step()
    return _params(model)


def run_all(rank: int, world: int, scenarios: Dict[str, tuple]) -> Dict[str, Any]:
    out = {name: _train(rank, name, spec) for name, spec in scenarios.items()}
    if world == 4:
        out.update({name: _join_resume(rank, name, spec) for name, spec in RESUME_SCENARIOS.items()})
        out["checkpoint"] = _checkpoint(rank)
        out["torch_ddp"] = _torch_ddp(rank)
    return out


@pytest.fixture(scope="module")
def results_4() -> List[Dict[str, Any]]:
    return run_workers(run_all, 4, SCENARIOS_4, timeout=400)


@pytest.fixture(scope="module")
def results_8() -> List[Dict[str, Any]]:
    return run_workers(run_all, 8, SCENARIOS_8, timeout=500)


def _node_reference(world: int, spec: tuple, data: Optional[List[Any]] = None,
                    grad_hook: Optional[Callable] = None, micro_batches: int = 1,
                    skip: Optional[Callable[[int, int], bool]] = None) -> List[Dict[str, torch.Tensor]]:
    """Node-level decentralized training: one worker per node, gradient = mean over its ranks
    (``skip(node, k)``: that node only mixes at iteration k)."""
    from decentpy.topology import node_topology

    _, local, topo, opt, _ = spec
    nodes = world // local
    t = node_topology(topo, nodes)
    data = data if data is not None else [list(range(g * local, (g + 1) * local)) for g in range(nodes)]
    per_node = simulate(nodes, t.mixing_matrix, opt, STEPS, data_ranks=data, grad_hook=grad_hook,
                        micro_batches=micro_batches, skip=skip)
    return [per_node[r // local] for r in range(world)]


def _check_node_scenario(results: List[Dict[str, Any]], name: str, spec: tuple, **kw: Any) -> None:
    world, local = len(results), spec[1]
    got = [r[name]["params"] for r in results]
    assert_close_params(got, _node_reference(world, spec, **kw), rtol=2e-5, atol=2e-5, what=name)
    for r in range(world):  # every rank of a node holds the node's parameters, bit for bit
        first = got[(r // local) * local]
        assert all(torch.equal(got[r][k], first[k]) for k in first), f"{name}: rank {r} differs from its node"
        sd = results[r][name]["state_dict"]
        assert all(torch.equal(sd[k], got[r][k]) for k in first), f"{name}: rank {r}: state_dict() read stale values"


@pytest.mark.parametrize("name", ["shard-complete-adam", "shard-ring-sgd", "allreduce-ope-adam"])
def test_matches_node_level_reference_g2(results_4, name: str) -> None:
    _check_node_scenario(results_4, name, SCENARIOS_4[name])


@pytest.mark.parametrize("name", list(SCENARIOS_8))
def test_matches_node_level_reference_g4(results_8, name: str) -> None:
    _check_node_scenario(results_8, name, SCENARIOS_8[name])


def test_one_rank_per_node_is_plain_gossip(results_4) -> None:
    """L = 1: exactly today's trajectory (bit for bit)."""
    for r, res in enumerate(results_4):
        a, b = res["shard-L1-ring-accum"]["params"], res["gossip-L1-ring-accum"]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {r}"


def test_one_node_is_torch_ddp(results_4) -> None:
    """G = 1: equals torch DDP with torch's AdamW (same groups)."""
    got = [r["shard-G1-adamw"]["params"] for r in results_4]
    want = [r["torch_ddp"] for r in results_4]
    assert_close_params(got, want, rtol=1e-5, atol=1e-6, what="G=1 vs torch DDP")


def test_optimizer_state_is_sharded(results_4) -> None:
    """Each rank of a 2-rank node keeps about half the Adam state (2 moments per element)."""
    numel = sum(p.numel() for p in make_mlp(0).parameters())
    for res in results_4:
        elems = res["shard-complete-adam"]["state_elems"]
        assert elems <= 2 * numel * (0.5 + 0.05) + 2 * 64, (elems, numel)  # + alignment padding of a bucket


def test_global_avg(results_4) -> None:
    ref = _node_reference(4, SCENARIOS_4["shard-complete-adam"])
    mean = {k: (ref[0][k] + ref[2][k]) / 2 for k in ref[0]}
    assert_close_params([r["shard-complete-adam"]["avg"] for r in results_4], [mean] * 4, rtol=2e-5, atol=2e-5,
                        what="global_avg")


def test_no_sync_accumulation(results_4) -> None:
    _check_node_scenario(results_4, "shard-nosync-sgd", SCENARIOS_4["shard-nosync-sgd"], micro_batches=2)


def test_join_uneven_inputs(results_4) -> None:
    """Rank 1 runs out after 3 iterations: node 0's gradient is then rank 0's alone."""
    data = [lambda k: [0, 1] if k < JOIN_STOP else [0], [2, 3]]
    _check_node_scenario(results_4, "shard-join-adam", SCENARIOS_4["shard-join-adam"], data=data)


def test_join_with_a_grad_scaler_on_node_allreduce(results_4) -> None:
    """Pairs the other scenarios leave out (issue 43): Join x GradScaler, and intra_node='allreduce'
    with each. Rank 1 runs out after 3 iterations (node 0's gradient is then rank 0's alone) while a
    GradScaler scales every loss: the node-level float64 reference of the unscaled run."""
    data = [lambda k: [0, 1] if k < JOIN_STOP else [0], [2, 3]]
    _check_node_scenario(results_4, "allreduce-join-scaler-sgd", SCENARIOS_4["allreduce-join-scaler-sgd"],
                         data=data)


def _check_resumed_bit_for_bit(results: List[Dict[str, Any]], name: str) -> None:
    for r, res in enumerate(results):
        a, b = res[name]["params"], res[name]["resumed"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
            f"{name}: rank {r}: the resumed run differs"


def test_join_and_resume_with_nonfinite_ignore_on_node_allreduce(results_4) -> None:
    """Pairs the other scenarios leave out: nonfinite='ignore' x intra_node='allreduce', nonfinite x
    Join, Join x resume. No gradient norm is taken; rank 1 runs out after 3 iterations (node 0's
    gradient is then rank 0's alone): the node-level float64 reference; a checkpoint taken before
    iteration 2 resumes under Join to the same bits."""
    name = "allreduce-ignore-join-resume-adam"
    data = [lambda k: [0, 1] if k < JOIN_STOP else [0], [2, 3]]
    got = [r[name]["params"] for r in results_4]
    assert_close_params(got, _node_reference(4, RESUME_SCENARIOS[name], data=data), rtol=2e-5, atol=2e-5,
                        what=name)
    _check_resumed_bit_for_bit(results_4, name)


def test_grad_scaler_resume_with_join_and_a_skipped_node_on_shards(results_4) -> None:
    """Pairs the other scenarios leave out: GradScaler x resume, Join x resume (and nonfinite='skip'
    x Join). A GradScaler on every rank, rank 1 out of data after 3 iterations, rank 3's loss inf at
    iteration 3 (after the checkpoint, in the Join): node 1 skips that update and both its scalers
    back off; the node-level float64 reference of the unscaled run with that skip. The resumed run
    (a fresh GradScaler with another initial scale) equals the uninterrupted one bit for bit,
    parameters and scaler state."""
    name = "shard-scaler-inf-join-resume-adam"
    inf_rank, inf_step = SCALER_INF
    node = inf_rank // 2
    data = [lambda k: [0, 1] if k < JOIN_STOP else [0], [2, 3]]
    want = _node_reference(4, RESUME_SCENARIOS[name], data=data, skip=lambda i, k: (i, k) == (node, inf_step))
    got = [r[name]["params"] for r in results_4]
    assert_close_params(got, want, rtol=2e-5, atol=2e-5, what=name)
    _check_resumed_bit_for_bit(results_4, name)
    for r, res in enumerate(results_4):
        run = res[name]
        assert run["skipped"] == (1 if r // 2 == node else 0), (r, run["skipped"])
        # torch's GradScaler rule: x2 after every 2 clean iterations, x0.5 at an overflow (then the count restarts)
        want_scales, scale, clean = [], 2.0 ** 10, 0
        for k in range(JOIN_STOP if r == 1 else STEPS):
            if r // 2 == node and k == inf_step:
                scale, clean = scale / 2, 0
            else:
                clean += 1
                if clean == 2:
                    scale, clean = scale * 2, 0
            want_scales.append(scale)
        assert run["scales"] == want_scales, (r, run["scales"], want_scales)
        assert run["fresh_scale"] != run["scaler"]["scale"], "the resumed scaler would equal it without loading"
        assert run["scaler_resumed"] == run["scaler"], (r, run["scaler_resumed"], run["scaler"])


def test_grad_scaler_and_clipping(results_4) -> None:
    """A GradScaler and clipping of the node's mean gradient (one bucket: the whole model's norm)."""
    def clip(_: int, __: int, grads: List[torch.Tensor]) -> None:
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        factor, skip = grad_factor64(norm, 1.0, CLIP)
        assert not skip
        for g in grads:
            g.mul_(factor)

    _check_node_scenario(results_4, "shard-scaler-clip-sgd", SCENARIOS_4["shard-scaler-clip-sgd"], grad_hook=clip)


@pytest.mark.parametrize("name", ["shard-noview-adam", "shard-rmsprop"])
def test_parameters_outside_the_blocks_and_torch_optimizers(results_4, name: str) -> None:
    """param_as_bucket_view=False, and an optimizer the kernel does not fuse (torch's RMSprop on the
    shard's pieces)."""
    _check_node_scenario(results_4, name, SCENARIOS_4[name])


def test_a_non_finite_gradient_skips_the_whole_node(results_4) -> None:
    """One rank's inf reaches its node's mean gradient: every shard of that node skips the update
    (and only mixes), the other node steps; the node stays identical."""
    spec = SCENARIOS_4["shard-scaler-inf-sgd"]
    node = INF_RANK // spec[1]
    from decentpy.topology import node_topology

    t = node_topology(spec[2], 2)
    per_node = simulate(2, t.mixing_matrix, spec[3], STEPS, data_ranks=[[0, 1], [2, 3]],
                        skip=lambda i, k: (i, k) == (node, INF_STEP))
    want = [per_node[r // 2] for r in range(4)]
    got = [r["shard-scaler-inf-sgd"]["params"] for r in results_4]
    assert_close_params(got, want, rtol=2e-5, atol=2e-5, what="inf in one rank's gradient")
    for r in range(4):
        assert all(torch.equal(got[r][k], got[(r // 2) * 2][k]) for k in got[r])


def test_checkpoint_resume(results_4) -> None:
    for r, res in enumerate(results_4):
        a, b = res["checkpoint"]["straight"], res["checkpoint"]["resumed"]
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {r}: resumed run differs"
        assert res["checkpoint"]["wrong_shard"] is not None and "holds shard" in res["checkpoint"]["wrong_shard"], \
            f"rank {r}: a checkpoint of the other local rank was loaded"


def test_bad_arguments_are_refused_before_any_collective() -> None:
    from decentpy import DecentralizedDataParallel
    from decentpy.topology import TopologyError, node_topology

    with single_process_group("gloo"):
        with pytest.raises(ValueError, match="intra_node must be one of 'gossip', 'shard', 'allreduce'"):
            DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), intra_node="zero")
        with pytest.raises(ValueError, match="local_world_size to divide"):
            DecentralizedDataParallel(make_mlp(0), decentpy_optim_fn("sgd"), intra_node="shard", local_world_size=2)
    # any number of nodes >= 2 is accepted now (3 nodes used to be refused); one node is not
    assert node_topology("alternating-exp-ring", 3).world_size == 3
    with pytest.raises(TopologyError, match="at least 2 nodes, got 1 node"):
        node_topology("alternating-exp-ring", 1)


def test_one_rank_per_node_without_bucket_views_steps_the_parameters() -> None:
    """With L = 1 a rank's shard is its whole bucket and no all-gather follows the step: with
    param_as_bucket_view=False the parameters must still take the stepped block (as with gossip)."""
    from decentpy import DecentralizedDataParallel

    got = {}
    with single_process_group("gloo"):
        for intra in ("gossip", "shard", "allreduce"):
            model = make_mlp(0)
            ddp = DecentralizedDataParallel(model, decentpy_optim_fn("adam"), intra_node=intra, local_world_size=1,
                                            param_as_bucket_view=False)
            for k in range(3):
                x, y = batch(0, k)
                loss_fn(ddp(x), y).backward()
            ddp.wait()
            got[intra] = _params(model)
            ddp.close()
    assert got["shard"].keys() == got["gossip"].keys()
    for intra in ("shard", "allreduce"):
        assert all(torch.equal(got[intra][k], got["gossip"][k]) for k in got["gossip"]), intra


@pytest.mark.parametrize("name,nodes,local", [("ring", 4, 2), ("one-peer-exp", 4, 3), ("alternating-exp-ring", 4, 2),
                                              ("complete", 2, 4)])
def test_shard_exchange_is_the_node_mixing_per_shard(name: str, nodes: int, local: int) -> None:
    """The exchange schedule over all ranks mixes shard l of node g with shard l of node h exactly as
    the node topology mixes g and h: W_ranks = kron(W_nodes, I_L), at every step."""
    from decentpy.topology import node_topology, shard_topology

    nt = node_topology(name, nodes)
    st = shard_topology(nt, local)
    assert st.world_size == nodes * local and st.period == nt.period
    for k in range(nt.period):
        want = torch.kron(nt.mixing_matrix(k), torch.eye(local, dtype=torch.float64))
        assert torch.allclose(st.mixing_matrix(k), want, atol=1e-12), (name, k)
    if name == "alternating-exp-ring":  # node pairs average half-half; the other nodes keep themselves
        w = nt.mixing_matrix(0)
        assert sorted(set(w.flatten().tolist())) == [0.0, 0.5, 1.0]

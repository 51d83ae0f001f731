"""Fast unit tests of the analytic runtime model: tools/runtime_model/model.py (the model),
fit.py (calibration) and cli.py (the command line)."""

import math
from dataclasses import replace

import numpy as np
import pytest

import decentpy.topology as topology
from tools.runtime_model import cli, fit
from tools.runtime_model import model as rm

GB = 1e9
INF_HW = rm.Hardware(intra_bw=math.inf, inter_bw=math.inf, intra_lat=0.0, inter_lat=0.0,
                     mem_bw=900e9)
HW = rm.Hardware()  # 100 Gb/s intra per worker, 25 Gb/s per node, 10 us
WL = rm.Workload(model_bytes=100e6, compute_s=0.2)


def _valid(n, local):
    return [t for t in rm.TOPOLOGIES if rm.topology_valid(t, n, local)]


# ---------------------------------------------------------------------------------------------
# limiting cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,local", [(8, 8), (16, 8), (64, 4), (256, 8), (32, 1)])
def test_infinite_bandwidth_gives_compute_plus_kernel(n, local):
    k_dec = WL.kernel_traffic_dec * WL.model_bytes / INF_HW.mem_bw
    k_ddp = WL.kernel_traffic_ddp * WL.model_bytes / INF_HW.mem_bw
    for name in _valid(n, local):
        t, comm = rm.decentralized_iteration_time(name, n, local, WL, INF_HW)
        assert comm == 0.0
        assert t == pytest.approx(WL.compute_s + k_dec, rel=1e-12)
    t, comm = rm.ddp_iteration_time(n, local, WL, INF_HW)
    assert comm == 0.0
    assert t == pytest.approx(WL.compute_s + k_ddp, rel=1e-12)


def test_single_worker_has_no_communication():
    for name in ("complete", "ring", "one-peer-exp", "alternating-exp-ring"):
        assert rm.decentralized_iteration_time(name, 1, 1, WL, HW)[1] == 0.0
    assert rm.ddp_iteration_time(1, 1, WL, HW)[1] == 0.0


@pytest.mark.parametrize("n", [256, 1024, 4096])
def test_zero_compute_comm_bound_ordering(n):
    wl = replace(WL, compute_s=0.0)
    # L = 8: the one-link-per-node topologies beat all-reduce; one-peer-exp puts all 8 workers'
    # full models on the NIC at once in its cross-node rounds, so it is the slowest.
    t = rm.iteration_times(n, 8, wl, HW)
    assert t["alternating-exp-ring"] < t["allreduce"]
    assert t["ring"] < t["allreduce"]
    assert t["alternating-exp-ring"] < t["one-peer-exp"]
    assert t["allreduce"] < t["one-peer-exp"]
    # complete = an all-reduce of the parameters, without the exposed bucket tail and forward
    # (up to the kernels: the fused mix+step moves one more buffer than DDP's optimizer step)
    k_dec = wl.kernel_traffic_dec * wl.model_bytes / HW.mem_bw
    k_ddp = wl.kernel_traffic_ddp * wl.model_bytes / HW.mem_bw
    assert t["complete"] - k_dec <= t["allreduce"] - k_ddp
    # one worker per node: a one-peer exchange (M over the link) beats all-reduce (2M + latency)
    t1 = rm.iteration_times(n, 1, wl, HW)
    assert t1["one-peer-exp"] < t1["allreduce"]
    assert t1["ring"] < t1["allreduce"]


def test_hand_computed_costs():
    m, n, local = 100e6, 64, 8
    nodes = n // local
    hw = HW
    # hierarchical all-reduce
    expected = (2 * (local - 1) * hw.intra_lat + 2 * (local - 1) / local * m / hw.intra_bw
                + 2 * (nodes - 1) * hw.inter_lat + 2 * (nodes - 1) / nodes * m / hw.inter_bw)
    assert rm.allreduce_time(m, n, local, hw) == pytest.approx(expected)
    # flat ring
    flat = 2 * (n - 1) * max(hw.intra_lat, hw.inter_lat) + 2 * (n - 1) / n * m / min(
        hw.intra_bw, hw.inter_bw)
    assert rm.allreduce_time(m, n, local, hw, "flat") == pytest.approx(flat)
    # ring, L even: step 0 all pairs inside nodes; step 1 one pair per node boundary, so every
    # node's NIC carries two full models (to the node before and the node after it)
    ring = rm.step_comm_times("ring", n, local, m, hw)
    assert ring == pytest.approx(
        [hw.intra_lat + m / hw.intra_bw, hw.inter_lat + 2 * m / hw.inter_bw])
    # one worker per node: every pair crosses, one flow per NIC
    ring1 = rm.step_comm_times("ring", 16, 1, m, hw)
    assert ring1 == pytest.approx([hw.inter_lat + m / hw.inter_bw] * 2)
    # one-peer-exp: log2(L) intra rounds, then all L workers of a node cross the NIC together
    ope = rm.step_comm_times("one-peer-exp", n, local, m, hw)
    assert ope[:3] == pytest.approx([hw.intra_lat + m / hw.intra_bw] * 3)
    assert ope[3:] == pytest.approx([hw.inter_lat + local * m / hw.inter_bw] * 3)
    # AER: every step has a cross-node group of 2L (hierarchical over 2 nodes)
    aer = rm.step_comm_times("alternating-exp-ring", n, local, m, hw)
    cross = (2 * (local - 1) * hw.intra_lat + 2 * (local - 1) / local * m / hw.intra_bw
             + 2 * hw.inter_lat + m / hw.inter_bw)
    assert len(aer) == 2 * int(math.log2(nodes))
    assert aer == pytest.approx([cross] * len(aer))


def test_ddp_overlaps_only_backward_and_decentralized_overlaps_all():
    # all-reduce as long as the backward: DDP is forward + max(backward + tail, AR) + kernel
    wl = rm.Workload(model_bytes=50e6, compute_s=0.3)
    n, local = 64, 8
    t, ar = rm.ddp_iteration_time(n, local, wl, HW)
    tail = rm.allreduce_time(wl.bucket_bytes, n, local, HW)
    kernel = wl.kernel_traffic_ddp * wl.model_bytes / HW.mem_bw
    fwd, bwd = wl.compute_s / 3, 2 * wl.compute_s / 3
    assert t == pytest.approx(fwd + max(bwd + tail, ar) + kernel)
    # no overlap at all: comm adds up fully
    hw0 = replace(HW, overlap=0.0)
    t0, _ = rm.ddp_iteration_time(n, local, wl, hw0)
    assert t0 == pytest.approx(wl.compute_s + ar + kernel)
    td0, comm = rm.decentralized_iteration_time("ring", n, local, wl, hw0)
    k_dec = wl.kernel_traffic_dec * wl.model_bytes / HW.mem_bw
    assert td0 == pytest.approx(wl.compute_s + comm + k_dec)


@pytest.mark.parametrize("n,local", [(16, 8), (128, 8), (64, 4), (64, 1)])
def test_monotone_in_bandwidth_and_latency(n, local):
    prev = None
    for gbps in (1, 5, 25, 100, 400, 1600):
        hw = replace(HW, inter_bw=gbps * rm.GBIT, intra_bw=4 * gbps * rm.GBIT)
        cur = rm.iteration_times(n, local, WL, hw)
        if prev is not None:
            for k, v in cur.items():
                if v is not None:
                    assert v <= prev[k] + 1e-15, (k, gbps)
        prev = cur
    prev = None
    for lat in (0.0, 1e-6, 1e-5, 1e-4, 1e-3):
        cur = rm.iteration_times(n, local, replace(WL, compute_s=0.0),
                                 replace(HW, intra_lat=lat, inter_lat=lat))
        if prev is not None:
            for k, v in cur.items():
                if v is not None:
                    assert v >= prev[k] - 1e-15, (k, lat)
        prev = cur


# ---------------------------------------------------------------------------------------------
# consensus
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,n,local",
    [("complete", n, 1) for n in (2, 5, 16)]
    + [("ring", n, 1) for n in (2, 4, 6, 8, 10, 16, 32, 64)]
    + [("ring", 16, 8)]
    + [("one-peer-exp", n, 1) for n in (2, 4, 8, 16, 32, 64)]
    + [("one-peer-exp", 64, 8)]
    + [("alternating-exp-ring", n * local, local) for local in (2, 4, 8) for n in (2, 4, 8, 16)],
)
def test_closed_form_gap_matches_topology_module(name, n, local):
    exact = topology.make_topology(name, n, local).spectral_gap()
    assert rm.closed_form_gap(name, n, local) == pytest.approx(exact, abs=1e-9)
    assert rm.spectral_gap(name, n, local) == pytest.approx(exact, abs=1e-9)


def test_gap_beyond_exact_range_uses_closed_form():
    assert rm.spectral_gap("one-peer-exp", 4096, 8) == pytest.approx(1 / 12)
    assert rm.spectral_gap("alternating-exp-ring", 4096, 8) == pytest.approx(1 / 18)
    assert rm.spectral_gap("ring", 1024, 8) == pytest.approx((1 - math.cos(2 * math.pi / 1024)) / 2)


def test_gap_without_closed_form_is_computed():
    # odd rings and non-powers of two are valid topologies now; no closed form, the module's value
    for name, n, local in (("ring", 7, 1), ("one-peer-exp", 6, 1), ("alternating-exp-ring", 6, 2)):
        exact = topology.make_topology(name, n, local).spectral_gap()
        assert rm.spectral_gap(name, n, local) == pytest.approx(exact, abs=1e-12)
        with pytest.raises(ValueError, match="no closed form"):
            rm.closed_form_gap(name, n, local)


def test_iterations_to_10x():
    assert rm.iterations_to_10x(1.0) == 1.0
    assert rm.iterations_to_10x(0.0) == math.inf
    for gap in (1e-3, 1e-2):
        assert rm.iterations_to_10x(gap) == pytest.approx(math.log(10) / gap, rel=0.01)
    # (1 - gap)^k == 0.1 exactly
    gap = 0.25
    assert (1 - gap) ** rm.iterations_to_10x(gap) == pytest.approx(0.1)


def test_topology_validity_agrees_with_module():
    for name in rm.TOPOLOGIES:
        for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            for local in (1, 2, 3, 4, 8):
                if n % local:
                    continue
                try:
                    topology.make_topology(name, n, local)
                    ok = True
                except topology.TopologyError:
                    ok = False
                assert rm.topology_valid(name, n, local) == ok, (name, n, local)


# ---------------------------------------------------------------------------------------------
# published comparison
# ---------------------------------------------------------------------------------------------


def test_published_scenarios_are_sane():
    rows = rm.published_table()
    assert len(rows) == 24
    for r in rows:
        # AER never loses to all-reduce, and never wins by more than the ~4x the volumes allow
        # (all-reduce moves 2M per node per step, AER M every other step).
        assert 0.98 <= r["ratio"] <= 4.0, r
    inside = [r for r in rows if r["in_range"]]
    assert len(inside) >= len(rows) // 3
    # slower network or more GPUs (smaller local batch) -> larger advantage
    by = {(r["model"], r["gpus"], r["local"], r["inter_gbps"]): r["ratio"] for r in rows}
    for (model, gpus, local, inter), ratio in by.items():
        if inter == 100.0:
            assert by[(model, gpus, local, 25.0)] >= ratio - 1e-9
        if gpus == 64:
            assert ratio >= by[(model, 16, local, inter)] - 1e-9


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------


def _synthetic(truth, noise, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for workers in (2, 4, 8):
        methods = [("torch-ddp", "allreduce", workers), ("decentpy", "complete", workers),
                   ("decentpy", "ring", workers), ("decentpy", "one-peer-exp", workers)]
        if workers >= 4:
            methods.append(("decentpy", "alternating-exp-ring", 2))
        for fw, topo, local in methods:
            for model, nbytes in (("tiny", 4e4), ("small", 2e6), ("big", 2e7)):
                for compute in (0.003, 0.03):
                    m = fit.Measurement(fw, topo, workers, model, 1.0, nbytes, compute, local)
                    t = fit.predict(m, truth) * float(np.exp(rng.normal(0.0, noise)))
                    out.append(replace(m, step_time_s=t))
    return out


def test_calibration_recovers_known_parameters():
    truth = rm.Hardware(intra_bw=1.5 * GB, inter_bw=1.5 * GB, intra_lat=150e-6,
                        inter_lat=150e-6, mem_bw=4 * GB, overlap=0.6)
    ms = _synthetic(truth, noise=0.02)
    res = fit.calibrate(ms, restarts=2)
    h = res.hardware
    assert h.intra_bw == pytest.approx(truth.intra_bw, rel=0.15)
    assert h.intra_lat == pytest.approx(truth.intra_lat, rel=0.3)
    assert h.mem_bw == pytest.approx(truth.mem_bw, rel=0.2)
    assert h.overlap == pytest.approx(truth.overlap, abs=0.1)
    assert res.median_abs_error < 0.03
    assert len(res.rel_errors) == len(ms)


def test_calibration_exact_without_noise():
    truth = rm.Hardware(intra_bw=0.8 * GB, inter_bw=0.8 * GB, intra_lat=60e-6, inter_lat=60e-6,
                        mem_bw=8 * GB, overlap=0.9)
    res = fit.calibrate(_synthetic(truth, noise=0.0), restarts=2)
    assert res.median_abs_error < 1e-3
    assert res.hardware.intra_bw == pytest.approx(truth.intra_bw, rel=0.02)


def test_load_measurements_and_cli(tmp_path, capsys):
    truth = rm.Hardware(intra_bw=1 * GB, inter_bw=1 * GB, intra_lat=100e-6, inter_lat=100e-6,
                        mem_bw=5 * GB, overlap=0.7)
    ms = _synthetic(truth, noise=0.01)
    path = tmp_path / "bench_train.csv"
    with open(path, "w") as fh:
        fh.write("framework,topology,workers,model,step_time_s,bytes_per_step,compute_time_s\n")
        for m in ms:
            if m.topology == "alternating-exp-ring":
                continue  # needs local_world_size; the loader defaults L = 2 for it
            fh.write(f"{m.framework},{m.topology if m.topology != 'allreduce' else ''},"
                     f"{m.workers},{m.model},{m.step_time_s},{m.model_bytes},"
                     f"{m.compute_time_s}\n")
        fh.write("decentpy,not-a-topology,4,x,0.1,1000,0.01\n")  # skipped
        fh.write("decentpy,ring,4,x,,1000,0.01\n")  # skipped
    loaded = fit.load_measurements(path)
    assert len(loaded) == sum(m.topology != "alternating-exp-ring" for m in ms)
    assert {m.topology for m in loaded} == {"allreduce", "complete", "ring", "one-peer-exp"}
    assert all(m.local == m.workers for m in loaded)

    out = tmp_path / "out"
    assert cli.main(["--max-n", "64", "--calibrate", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "median |relative error|" in text
    assert "Published comparison" in text
    assert (out / "runtime_model.csv").is_file()
    assert (out / "runtime_model_published.csv").is_file()
    assert (out / "runtime_model.png").is_file() or (out / "runtime_model.svg").is_file()

    assert cli.main(["--max-n", "32", "--calibrate", str(tmp_path / "missing.csv"),
                    "--out", str(out)]) == 0
    assert "calibration skipped" in capsys.readouterr().out


def test_load_measurements_rejects_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("framework,workers\nddp,4\n")
    with pytest.raises(ValueError, match="missing column"):
        fit.load_measurements(path)


def test_vectorised_predictor_matches_predict():
    hw = rm.Hardware(intra_bw=2 * GB, inter_bw=2 * GB, intra_lat=80e-6, inter_lat=80e-6,
                     mem_bw=6 * GB, overlap=0.5)
    ms = _synthetic(hw, noise=0.0)
    ms.append(fit.Measurement("decentpy", "ring", 1, "solo", 1.0, 1e6, 0.01, 1))
    ms.append(fit.Measurement("torch-ddp", "allreduce", 1, "solo", 1.0, 1e6, 0.01, 1))
    fast = fit._TiedPredictor(ms, rm.Workload(0.0, 0.0))(hw)
    slow = np.array([fit.predict(m, hw) for m in ms])
    np.testing.assert_allclose(fast, slow, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# hybrid modes: HSDP and sharded gossip
# ---------------------------------------------------------------------------------------------


def _rs(nbytes, local, hw=HW):
    """Ring reduce-scatter (= all-gather) over one node's ranks, by hand."""
    return (local - 1) * hw.intra_lat + (local - 1) / local * nbytes / hw.intra_bw


@pytest.mark.parametrize("name", ["complete", "ring", "one-peer-exp"])
@pytest.mark.parametrize("nodes", [2, 4, 16, 64])
@pytest.mark.parametrize("overlap", [1.0, 0.4])
def test_sharded_gossip_with_one_rank_per_node_is_plain_gossip(name, nodes, overlap):
    hw = replace(HW, overlap=overlap)
    for wl in (WL, replace(WL, compute_s=1e-3)):
        assert rm.sharded_gossip_iteration_time(name, nodes, 1, wl, hw) == pytest.approx(
            rm.decentralized_iteration_time(name, nodes, 1, wl, hw), rel=1e-12)


@pytest.mark.parametrize("compute", [0.2, 1e-3])
def test_hsdp_on_one_node_is_intra_sharding(compute):
    local, m, b = 8, WL.model_bytes, WL.bucket_bytes
    wl = replace(WL, compute_s=compute)
    fwd, bwd = compute / 3, 2 * compute / 3
    ag, agb = _rs(m, local), _rs(b, local)
    # forward: gather prefetched but the first unit; backward: re-gather + reduce-scatter, last
    # unit's reduce-scatter exposed; step on 1/L of the model
    expected = (agb + max(fwd, ag - agb) + max(bwd, 2 * ag - agb) + agb
                + wl.kernel_traffic_ddp * m / local / HW.mem_bw)
    t, comm = rm.hsdp_iteration_time(local, local, wl, HW)
    assert t == pytest.approx(expected, rel=1e-12)
    assert comm == pytest.approx(3 * ag, rel=1e-12)
    # no inter-node term at all: a NIC of 1 byte/s changes nothing
    assert rm.hsdp_iteration_time(local, local, wl, replace(HW, inter_bw=1.0)) == (t, comm)


def test_hsdp_hand_computed_across_nodes():
    n, local, m, b = 16, 4, 200e6, 25e6
    nodes = n // local
    wl = rm.Workload(model_bytes=m, compute_s=0.05)
    fwd, bwd = wl.compute_s / 3, 2 * wl.compute_s / 3
    ag, agb = _rs(m, local), _rs(b, local)
    # the L shard all-reduces of a node share its NIC: 2 (N-1)/N * M through it
    x = 2 * (nodes - 1) * HW.inter_lat + 2 * (nodes - 1) / nodes * m / HW.inter_bw
    xb = 2 * (nodes - 1) * HW.inter_lat + 2 * (nodes - 1) / nodes * b / HW.inter_bw
    expected = (agb + max(fwd, ag - agb) + max(bwd, 2 * ag + x - (agb + xb)) + agb + xb
                + wl.kernel_traffic_ddp * m / local / HW.mem_bw)
    t, comm = rm.hsdp_iteration_time(n, local, wl, HW)
    assert t == pytest.approx(expected, rel=1e-12)
    assert comm == pytest.approx(3 * ag + x, rel=1e-12)
    # per link, the backward moves what DDP's hierarchical all-reduce moves
    assert comm - ag == pytest.approx(rm.allreduce_time(m, n, local, HW), rel=1e-12)
    # no overlap: every communication adds up
    hw0 = replace(HW, overlap=0.0)
    assert rm.hsdp_iteration_time(n, local, wl, hw0)[0] == pytest.approx(
        wl.compute_s + 3 * ag + x + wl.kernel_traffic_ddp * m / local / HW.mem_bw, rel=1e-12)


@pytest.mark.parametrize("nodes,cross", [(4, [1, 1, 1, 1]), (2, [1, 0])])
def test_sharded_aer_hand_computed(nodes, cross):
    local, m, b = 4, 100e6, 25e6
    n = nodes * local
    wl = rm.Workload(model_bytes=m, compute_s=0.03)
    fwd, bwd = wl.compute_s / 3, 2 * wl.compute_s / 3
    ag, agb = _rs(m, local), _rs(b, local)
    # AER over the nodes: one pair exchange of M / L per rank, L flows per NIC = M per NIC; with
    # N = 2 the second step of the period averages inside the nodes: nothing to send
    steps = [c * (HW.inter_lat + m / HW.inter_bw) for c in cross]
    window = (agb + max(fwd, ag - agb)) + (max(bwd, ag - agb) + agb)
    k = wl.kernel_traffic_dec * m / local / HW.mem_bw
    t, comm = rm.sharded_gossip_iteration_time("alternating-exp-ring", n, local, wl, HW)
    assert comm == pytest.approx(np.mean(steps), rel=1e-12)
    assert t == pytest.approx(np.mean([max(window, c) + k for c in steps]), rel=1e-12)


def test_sharded_gossip_nic_bytes_are_one_model_per_exchange():
    # bytes only: no latency, free intra-node link
    hw = replace(HW, intra_bw=math.inf, intra_lat=0.0, inter_lat=0.0)
    m, local, nodes = 100e6, 8, 16
    n = nodes * local
    shard = rm._step_times(rm.node_topology_rows("one-peer-exp", nodes), m, hw)
    plain = rm.step_comm_times("one-peer-exp", n, local, m, hw)[3:]  # the cross-node rounds
    assert shard == pytest.approx([m / hw.inter_bw] * 4)
    assert plain == pytest.approx(local * shard)  # every worker sends its full model
    # plain AER already sends one model per node pair (hierarchical all-reduce over 2 nodes)
    shard = rm._step_times(rm.node_topology_rows("alternating-exp-ring", nodes), m, hw)
    plain = rm.step_comm_times("alternating-exp-ring", n, local, m, hw)
    assert shard == pytest.approx(plain)
    assert shard == pytest.approx([m / hw.inter_bw] * 8)


def test_hybrid_modes_with_infinite_bandwidth_are_compute_plus_sharded_step():
    for n, local in ((8, 8), (64, 8), (64, 4)):
        t, comm = rm.hsdp_iteration_time(n, local, WL, INF_HW)
        assert comm == 0.0
        assert t == pytest.approx(WL.compute_s + WL.kernel_traffic_ddp * WL.model_bytes / local
                                  / INF_HW.mem_bw, rel=1e-12)
        t, comm = rm.sharded_gossip_iteration_time("complete", n, local, WL, INF_HW)
        assert comm == 0.0
        assert t == pytest.approx(WL.compute_s + WL.kernel_traffic_dec * WL.model_bytes / local
                                  / INF_HW.mem_bw, rel=1e-12)


def test_sharded_topology_validity():
    # the topology runs over the nodes: AER needs >= 2 nodes, whatever L; any node count otherwise
    # (6 nodes of AER, 3 of one-peer-exp or ring used to be refused: the topologies take any n now)
    assert rm.sharded_topology_valid("alternating-exp-ring", 2)
    assert rm.sharded_topology_valid("alternating-exp-ring", 512)
    assert not rm.sharded_topology_valid("alternating-exp-ring", 1)
    assert rm.sharded_topology_valid("alternating-exp-ring", 6)
    assert rm.sharded_topology_valid("one-peer-exp", 3)
    assert rm.sharded_topology_valid("ring", 3)
    assert rm.sharded_topology_valid("complete", 3)
    t, comm = rm.sharded_gossip_iteration_time("ring", 24, 8, WL, HW)  # 3 nodes
    assert t > comm > 0.0
    with pytest.raises(ValueError):
        rm.sharded_gossip_iteration_time("alternating-exp-ring", 8, 8, WL, HW)  # one node
    with pytest.raises(ValueError):
        rm.hsdp_iteration_time(12, 8, WL, HW)


def test_hybrid_table():
    rows = rm.hybrid_table()
    assert len(rows) == 2 * 2 * 10
    for r in rows:
        aer, shard = r["alternating-exp-ring_s"], r["shard-alternating-exp-ring_s"]
        if r["nodes"] == 1:
            assert aer is None and shard is None
            continue
        # in these scenarios: sharding the node's model saves the intra-node part of the AER
        # exchange and 7/8 of the step; AER beats DDP (not always HSDP: on 2 nodes at 100 Gb/s
        # HSDP's 1/8 step wins), sharded AER beats both
        assert shard <= aer < r["allreduce_s"]
        assert shard < r["hsdp_s"]
    slow = {(r["model"], r["gpus"]): r for r in rows if r["inter_gbps"] == 25.0}
    fast = {(r["model"], r["gpus"]): r for r in rows if r["inter_gbps"] == 100.0}
    for key, r in slow.items():
        for mode in rm.HYBRID_MODES:
            if r[f"{mode}_s"] is not None:
                assert r[f"{mode}_s"] >= fast[key][f"{mode}_s"]


def test_load_and_predict_sharded_rows(tmp_path):
    path = tmp_path / "bench_hybrid.csv"
    path.write_text(
        "framework,topology,workers,model,step_time_s,bytes_per_step,compute_time_s,model_bytes,"
        "local_world_size\n"
        "decentpy-shard,alternating-exp-ring,4,mlp,0.05,6000000,0.02,12000000,2\n"
        "decentpy-shard,one-peer-exp,4,mlp,0.05,6000000,0.02,12000000,\n"  # default L = 2
        "decentpy,alternating-exp-ring,4,mlp,0.05,12000000,0.02,12000000,2\n"
        "ddp,,4,mlp,0.05,12000000,0.02,12000000,2\n"
        "ddp-zero,,4,mlp,0.05,12000000,0.02,12000000,2\n"  # not modelled: skipped
        "hsdp,,4,mlp,0.05,12000000,0.02,12000000,2\n"
        "decentpy-shard,ring,6,mlp,0.05,6000000,0.02,12000000,2\n"  # ring over 3 nodes (refused before)
        "decentpy-shard,alternating-exp-ring,2,mlp,0.05,6000000,0.02,12000000,2\n"  # AER over 1 node: skipped
    )
    ms = fit.load_measurements(path)
    assert [(m.framework, m.kind, m.topology, m.local) for m in ms] == [
        ("decentpy-shard", "shard", "alternating-exp-ring", 2),
        ("decentpy-shard", "shard", "one-peer-exp", 2),
        ("decentpy", "gossip", "alternating-exp-ring", 2),
        ("ddp", "allreduce", "allreduce", 2),
        ("hsdp", "hsdp", "hsdp", 2),
        ("decentpy-shard", "shard", "ring", 2),
    ]
    assert all(m.model_bytes == 12e6 for m in ms)  # the full model, not the shard
    hw = rm.Hardware(intra_bw=2 * GB, inter_bw=2 * GB, intra_lat=80e-6, inter_lat=80e-6,
                     mem_bw=6 * GB, overlap=0.5)
    wl = rm.Workload(model_bytes=12e6, compute_s=0.02)
    # G = 2 nodes x L = 2 on one machine: the shard exchange is one pair of M / 2 per rank
    # over the tied link, two flows on the "NIC": lat + M / bw per step
    fwd, bwd = 0.02 / 3, 2 * 0.02 / 3
    rs = 80e-6 + 6e6 / hw.intra_bw  # M = bucket: all of it is exposed
    window = rs + max(fwd, 0.0) + max(bwd, 0.0) + rs
    pair = 80e-6 + 12e6 / hw.inter_bw
    k = wl.kernel_traffic_dec * 12e6 / 2 / hw.mem_bw
    hand = np.mean([max(window, pair) + 0.5 * min(window, pair) + k,
                    max(window, 0.0) + k])  # N = 2: the second AER step stays inside the nodes
    assert fit.predict(ms[0], hw) == pytest.approx(hand, rel=1e-12)
    assert fit.predict(ms[2], hw) == rm.decentralized_iteration_time(
        "alternating-exp-ring", 4, 2, wl, hw)[0]
    assert fit.predict(ms[3], hw) == rm.ddp_iteration_time(4, 2, wl, hw)[0]
    assert fit.predict(ms[4], hw) == rm.hsdp_iteration_time(4, 2, wl, hw)[0]
    # the vectorised predictor of the calibration sends these rows through predict()
    fast = fit._TiedPredictor(ms, rm.Workload(0.0, 0.0))(hw)
    np.testing.assert_allclose(fast, [fit.predict(m, hw) for m in ms], rtol=1e-12)


def test_cli_hybrid_only(tmp_path, capsys):
    png = tmp_path / "docs" / "runtime_hybrid.png"
    assert cli.main(["--hybrid-only", "--out", str(tmp_path), "--hybrid-plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Hybrid modes at scale" in text and "shard-AER" in text and "HSDP" in text
    assert (tmp_path / "runtime_hybrid.csv").is_file()
    assert png.is_file() or png.with_suffix(".svg").is_file()


# ---------------------------------------------------------------------------------------------
# compressed gossip
# ---------------------------------------------------------------------------------------------


def _int8_wire(model_bytes):
    """int8 wire bytes of an fp32 model, by hand: one fp32 scale per 256 elements, a byte each."""
    n = round(model_bytes / 4)
    return 4 * math.ceil(n / 256) + n


BYTES_ONLY = replace(HW, intra_lat=0.0, inter_lat=0.0)  # finite links, no latency


def test_exchange_bytes_by_hand():
    for m in (100e6, 1024.0, 1028.0, 102.4e6):
        assert rm.exchange_bytes(None, m) == m
        assert rm.exchange_bytes("bf16", m) == m / 2
        assert rm.exchange_bytes("int8", m) == _int8_wire(m)
    assert rm.exchange_bytes("int8", 100e6) / 100e6 == pytest.approx(0.2539, abs=1e-4)
    with pytest.raises(ValueError, match="compression kind"):
        rm.exchange_bytes("fp8", 100e6)


def test_compressed_pairs_send_one_wire_size():
    m, n, local, hw = 100e6, 64, 8, HW
    w = _int8_wire(m)
    # one-peer-exp: 3 intra rounds of one pair exchange, then 3 rounds in which the node's 8
    # workers each send one compressed model through the NIC
    ope = rm.step_comm_times("one-peer-exp", n, local, m, hw, "int8")
    assert ope == pytest.approx([hw.intra_lat + w / hw.intra_bw] * 3
                                + [hw.inter_lat + local * w / hw.inter_bw] * 3)
    # ring: intra pairs, then two cross-node pairs per NIC (as uncompressed, W for M)
    ring = rm.step_comm_times("ring", n, local, m, hw, "bf16")
    assert ring == pytest.approx([hw.intra_lat + m / 2 / hw.intra_bw,
                                  hw.inter_lat + 2 * (m / 2) / hw.inter_bw])


# a model of 4_096_000 fp32 elements = 16_000 int8 blocks: equal chunks of whole blocks for groups
# of 4, 8, 16 and 32 (each chunk's int8 wire then exactly W / m)
M_EVEN = 16_384_000.0
W_EVEN = 4 * 16_000 + 4_096_000  # int8: the block scales, then a byte per element


def test_compressed_groups_reduce_scatter_and_all_gather_chunks():
    m, hw, w = M_EVEN, HW, W_EVEN
    assert _int8_wire(m) == w
    # complete over one node of 4: two rounds of 3 messages of W/4 over the intra link, 1.5 W in
    # all, against the ring all-reduce's 2 (m-1)/m = 1.5 models: 0.254x the bytes
    c4 = rm.step_comm_times("complete", 4, 4, m, hw, "int8")
    assert c4 == pytest.approx([6 * hw.intra_lat + 6 * (w / 4) / hw.intra_bw], rel=1e-12)
    assert (6 * w / 4) / (2 * 3 / 4 * m) == pytest.approx(0.254, abs=1e-3)
    # complete over 2 nodes of 8: per round 7 intra and 8 remote messages of W/16 per rank, the
    # NIC carrying 8 x 8 of them; intra and inter in flight together (max); two rounds
    c16 = rm.step_comm_times("complete", 16, 8, m, hw, "int8")
    one_round = max(7 * hw.intra_lat + 7 * (w / 16) / hw.intra_bw,
                    8 * hw.inter_lat + 64 * (w / 16) / hw.inter_bw)
    assert c16 == pytest.approx([2 * one_round], rel=1e-12)
    # AER over 8 nodes of 4: every step has a node pair (a group of 8 ranks; per round 3 intra
    # and 4 remote messages of W/8 per rank, 16 through each NIC)
    aer = rm.step_comm_times("alternating-exp-ring", 32, 4, m, hw, "int8")
    cross = 2 * max(3 * hw.intra_lat + 3 * (w / 8) / hw.intra_bw,
                    4 * hw.inter_lat + 16 * (w / 8) / hw.inter_bw)
    assert aer == pytest.approx([cross] * 6, rel=1e-12)


def test_compressed_group_bytes_with_uneven_chunks_by_hand():
    # 2660 elements = 11 int8 blocks (the last one of 100) over 4 members: chunk p starts at block
    # 11 p // 4, so the chunks are 2, 3, 3, 3 blocks: 512, 768, 768, 612 elements, int8 wires
    # 520, 780, 780, 624 bytes. The busiest member owns a 780-byte chunk: round 1 sends the others'
    # chunks (520 + 780 + 624), round 2 its own to the 3 others (3 x 780): 4264 bytes
    numel, busiest = 2660, 3 * 780 + (520 + 780 + 624)
    assert [4 * b + e for b, e in ((2, 512), (3, 768), (3, 768), (3, 612))] == [520, 780, 780, 624]
    assert rm.compressed_send_bytes("int8", numel, 4) == busiest
    assert rm.largest_chunk(numel, 4) == (1, 768)
    # one node: 6 messages over the intra link, 4264 bytes in all
    hw = replace(HW, intra_lat=1e-6)
    assert rm.step_comm_times("complete", 4, 4, 4.0 * numel, hw, "int8") == pytest.approx(
        [6 * 1e-6 + busiest / hw.intra_bw], rel=1e-12)
    # pairs: one wire of the whole bucket (11 scales + 2660 codes)
    assert rm.compressed_send_bytes("int8", numel, 2) == 4 * 11 + 2660
    assert rm.compressed_send_bytes("int8", numel, 1) == 0


def test_int8_pairs_never_slower_than_fp32_when_link_bound():
    wl = replace(WL, compute_s=0.0)
    hw_free_kernels = replace(HW, mem_bw=math.inf)
    for name in ("ring", "one-peer-exp"):
        for n, local in ((16, 8), (64, 8), (256, 8), (32, 1), (64, 4)):
            for gbps in (1, 25, 100, 400):
                hw = replace(hw_free_kernels, inter_bw=gbps * rm.GBIT)
                t32, c32 = rm.decentralized_iteration_time(name, n, local, wl, hw)
                t16, c16 = rm.decentralized_iteration_time(name, n, local, wl, hw, "bf16")
                t8, c8 = rm.decentralized_iteration_time(name, n, local, wl, hw, "int8")
                assert t8 <= t16 <= t32 and c8 <= c16 <= c32, (name, n, local, gbps)


@pytest.mark.parametrize("local", [2, 4, 8])
def test_int8_aer_never_slower_than_fp32_when_the_gpu_link_is_the_bottleneck(local):
    # per-GPU link the bottleneck (NIC free): a group of 2L sends 2 (L-1) chunks of W / 2L over the
    # GPU link, against the hierarchical all-reduce's intra part 2 (L-1)/L M
    hw = replace(HW, inter_bw=math.inf, inter_lat=0.0, mem_bw=math.inf)
    wl = replace(WL, model_bytes=M_EVEN, compute_s=0.0)
    w = W_EVEN
    for nodes in (2, 4, 16):
        n = nodes * local
        t32 = rm.decentralized_iteration_time("alternating-exp-ring", n, local, wl, hw)[0]
        t8 = rm.decentralized_iteration_time("alternating-exp-ring", n, local, wl, hw, "int8")[0]
        assert t8 <= t32
    # 2 nodes by hand: the node pair (two rounds of L-1 messages of W / 2L over the GPU link),
    # then each node alone (a pair for L = 2: one message of W; else two rounds of L-1 of W / L)
    cross = 2 * (local - 1) * (hw.intra_lat + w / (2 * local) / hw.intra_bw)
    inside = (hw.intra_lat + w / hw.intra_bw if local == 2
              else 2 * (local - 1) * (hw.intra_lat + w / local / hw.intra_bw))
    assert rm.step_comm_times("alternating-exp-ring", 2 * local, local, M_EVEN, hw, "int8") \
        == pytest.approx([cross, inside], rel=1e-12)


@pytest.mark.parametrize("local", [2, 4, 8])
def test_int8_aer_moves_l_wire_sizes_through_the_nic(local):
    # NIC the bottleneck (GPU link free): fp32 AER's node pair all-reduces M through each NIC;
    # int8 AER's group of 2L sends, per round, L x L chunks of W / 2L out of each node: L W in the
    # two rounds, more than M for L >= 4 (L * 0.254 > 1), less for L = 2
    nodes, m, w = 4, M_EVEN, W_EVEN
    n = nodes * local
    hw = replace(BYTES_ONLY, intra_bw=math.inf)
    fp32 = rm.step_comm_times("alternating-exp-ring", n, local, m, hw)
    int8 = rm.step_comm_times("alternating-exp-ring", n, local, m, hw, "int8")
    assert fp32 == pytest.approx([m / hw.inter_bw] * 4)
    assert int8 == pytest.approx([2 * local * local * (w / (2 * local)) / hw.inter_bw] * 4,
                                 rel=1e-12)
    assert (local * w > m) == (local >= 4)


def test_choco_kernel_passes_by_hand():
    wl, hw = replace(WL, model_bytes=M_EVEN), HW
    m, w = M_EVEN, W_EVEN
    # pair: the fused compressing pass (p, g, m, v and three copies: 12 fp32 streams) + q in/out
    pair = (12 * m + 2 * w) / hw.mem_bw
    assert rm.choco_kernel_time(2, "int8", wl, hw) == pytest.approx(pair)
    assert pair / (wl.kernel_traffic_dec * m / hw.mem_bw) == pytest.approx(1.563, abs=1e-3)
    # a group of k: the same fused pass + the owner's reduction of its chunk (k chunk wires read,
    # one written, its fp32 copy's chunk read and written): (k+1) W/k + 2 M/k
    for k in (4, 8, 16, 32):
        assert rm.choco_kernel_time(k, "int8", wl, hw) == pytest.approx(
            pair + ((k + 1) * w / k + 2 * m / k) / hw.mem_bw, rel=1e-12)
    # 3 members: 16_000 blocks split 5333, 5333, 5334; the largest chunk 5334 x 256 elements
    c = 5334 * 256
    assert rm.choco_kernel_time(3, "int8", wl, hw) == pytest.approx(
        pair + (4 * (4 * 5334 + c) + 8 * c) / hw.mem_bw, rel=1e-12)
    # no extra passes any more: a group costs a pair's pass plus less than one wire and one model
    times = [rm.choco_kernel_time(k, "bf16", wl, hw) for k in range(3, 18)]
    bf16_pair = (12 * m + m) / hw.mem_bw
    assert all(bf16_pair < t < bf16_pair + (m / 2 + m) / hw.mem_bw for t in times)
    # free links: the iteration is compute + the largest group's passes (AER over 4 nodes of 8:
    # a node pair of 16 in every step; complete over one node of 4)
    assert rm.decentralized_iteration_time("alternating-exp-ring", 32, 8, wl, INF_HW, "int8")[0] \
        == pytest.approx(wl.compute_s + (12 * m + 2 * w + 17 * w / 16 + 2 * m / 16) / INF_HW.mem_bw)
    assert rm.decentralized_iteration_time("complete", 4, 4, wl, INF_HW, "bf16")[0] \
        == pytest.approx(wl.compute_s + (12 * m + m + 5 * (m / 8) + 2 * m / 4) / INF_HW.mem_bw)
    # AER over 2 nodes: the node pair, then both nodes inside (groups of 16, then of 8)
    assert rm.step_group_sizes("alternating-exp-ring", 16, 8) == (16, 8)


def test_compressed_copies_by_hand():
    # pairs: two copies per distinct partner
    assert rm.compressed_copies("ring", 64, 8) == 4
    assert rm.compressed_copies("one-peer-exp", 64, 8) == 2 * 6
    # groups of more than two: two copies per distinct group (own public copy, group mean)
    assert rm.compressed_copies("complete", 16, 8) == 2
    assert rm.compressed_copies("complete", 2, 2) == 2  # a pair
    # AER over 8 nodes of 8: its node and the 3 node pairs
    assert rm.compressed_copies("alternating-exp-ring", 64, 8) == 2 * (1 + 3)
    # AER over 4 nodes of 2: the node is a pair (1 partner), then 2 node pairs of 4 ranks
    assert rm.compressed_copies("alternating-exp-ring", 8, 2) == 2 * (1 + 2)


def test_compression_kinds_checked_by_decentpy_and_none_is_uncompressed():
    # sharded gossip takes compression now (decentpy's CompressedNodeShard), with decentpy's kinds
    t, comm = rm.sharded_gossip_iteration_time("alternating-exp-ring", 64, 8, WL, HW, "int8")
    assert t > comm > 0.0
    for call in (rm.decentralized_iteration_time, rm.sharded_gossip_iteration_time):
        with pytest.raises(ValueError, match="compression kind must be one of"):
            call("ring", 64, 8, WL, HW, "fp8")
        # uncompressed is unchanged by the parameter
        assert call("complete", 64, 8, WL, HW, None) == call("complete", 64, 8, WL, HW)


# sharded compressed gossip (intra_node="shard" + compression): each rank's 1/L shard exchanged
# compressed with the same shard of the peer nodes


def _shard_wire(kind, model_bytes, local):
    """Wire bytes of one rank's compressed shard (model_bytes / L of fp32), by hand."""
    shard = model_bytes / local
    return _int8_wire(shard) if kind == "int8" else shard / 2  # bf16: 2 bytes per element


def _window(wl, local, hw=HW):
    """What sharded gossip's exchange overlaps (all-gather in the forward, reduce-scatter in the
    backward, one bucket of each exposed), full overlap, by hand."""
    m, b = wl.model_bytes, min(wl.bucket_bytes, wl.model_bytes)
    ag, agb = _rs(m, local, hw), _rs(b, local, hw)
    fwd, bwd = wl.compute_s / 3, 2 * wl.compute_s / 3
    return (agb + max(fwd, ag - agb)) + (max(bwd, ag - agb) + agb)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("local", [2, 4, 8])
def test_sharded_compressed_aer_on_two_nodes_by_hand(kind, local):
    # 2 nodes of L: AER over the nodes pairs them, then (second step of the period) each node alone
    m, n = 100e6, 2 * local
    wl = rm.Workload(model_bytes=m, compute_s=0.03)
    ws = _shard_wire(kind, m, local)
    # NIC bytes each way in the pair step: the L ranks each send one compressed shard
    hw = replace(BYTES_ONLY, intra_bw=math.inf)
    comm = rm.sharded_gossip_iteration_time("alternating-exp-ring", n, local, wl, hw, kind)[1]
    assert comm == pytest.approx(local * ws / hw.inter_bw / 2, rel=1e-12)  # (pair + nothing) / 2
    assert local * ws < m  # less than uncompressed sharded gossip's one model per NIC
    # the iteration, latency and intra-node link included: one message latency, the compressing
    # pass on the shard in the pair step, the plain fused step on the shard in the other
    steps = [HW.inter_lat + local * ws / HW.inter_bw, 0.0]
    s = m / local
    kernels = [(12 * s + 2 * ws) / HW.mem_bw, 8 * s / HW.mem_bw]
    win = _window(wl, local)
    t, comm = rm.sharded_gossip_iteration_time("alternating-exp-ring", n, local, wl, HW, kind)
    assert comm == pytest.approx(np.mean(steps), rel=1e-12)
    assert t == pytest.approx(np.mean([max(win, c) + k for c, k in zip(steps, kernels)]), rel=1e-12)


def test_sharded_compressed_groups_of_nodes_by_hand():
    # complete over 3 nodes of 4: each rank's group is the same shard on the 3 nodes. A shard of
    # 768_000 elements = 3000 int8 blocks, so 3 chunks of 1000 blocks, 260_000 bytes each (W_s /
    # 3). Two rounds of 2 messages per rank (4 latencies), 4 chunks per rank through the NIC, 4
    # ranks per node; kernels: the fused pass + the reduction of a chunk (4 chunk wires, its fp32
    # copy's chunk read and written), on the shard
    local, m = 4, 4 * 4 * 768_000.0
    s, ws, chunk_wire = m / local, _int8_wire(m / local), 4 * 1000 + 256_000
    assert ws == 3 * chunk_wire
    wl = rm.Workload(model_bytes=m, compute_s=0.0)  # communication-bound: the exchange shows
    c = 4 * HW.inter_lat + local * 4 * chunk_wire / HW.inter_bw
    k = (12 * s + 2 * ws + 4 * chunk_wire + 8 * 256_000) / HW.mem_bw
    t, comm = rm.sharded_gossip_iteration_time("complete", 3 * local, local, wl, HW, "int8")
    assert comm == pytest.approx(c, rel=1e-12)
    assert t == pytest.approx(max(_window(wl, local), c) + k, rel=1e-12)
    # AER over 4 nodes: a node pair at every step
    m = 100e6
    wl = rm.Workload(model_bytes=m, compute_s=0.0)
    t, comm = rm.sharded_gossip_iteration_time("alternating-exp-ring", 4 * local, local, wl, HW,
                                               "bf16")
    assert comm == pytest.approx(HW.inter_lat + local * (m / local / 2) / HW.inter_bw, rel=1e-12)


@pytest.mark.parametrize("name", ["ring", "one-peer-exp", "complete"])
@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_sharded_compressed_with_one_rank_per_node_is_plain_compressed_gossip(name, kind):
    for nodes in (2, 4, 8):
        assert rm.sharded_gossip_iteration_time(name, nodes, 1, WL, HW, kind) == pytest.approx(
            rm.decentralized_iteration_time(name, nodes, 1, WL, HW, kind), rel=1e-12)


def test_sharded_compressed_never_slower_than_sharded_when_the_nic_is_the_bottleneck():
    # topologies of node pairs: one compressed shard per rank per peer node, L W_s <= M per NIC
    wl = replace(WL, compute_s=0.0)
    free_kernels = replace(HW, mem_bw=math.inf)
    for name in ("alternating-exp-ring", "ring", "one-peer-exp"):
        for local in (2, 4, 8):
            for nodes in (2, 4, 16):
                for gbps in (1, 25, 100):
                    hw = replace(free_kernels, inter_bw=gbps * rm.GBIT)
                    n = nodes * local
                    t32, c32 = rm.sharded_gossip_iteration_time(name, n, local, wl, hw)
                    t16, c16 = rm.sharded_gossip_iteration_time(name, n, local, wl, hw, "bf16")
                    t8, c8 = rm.sharded_gossip_iteration_time(name, n, local, wl, hw, "int8")
                    assert t8 <= t16 <= t32 and c8 <= c16 <= c32, (name, local, nodes, gbps)
    # a slow NIC: int8 wins with the real kernels and compute too (the exchange is not hidden)
    hw = replace(HW, inter_bw=1 * rm.GBIT)
    assert rm.sharded_gossip_iteration_time("alternating-exp-ring", 64, 8, WL, hw, "int8")[0] \
        < rm.sharded_gossip_iteration_time("alternating-exp-ring", 64, 8, WL, hw)[0]


def test_sharded_compressed_copies_by_hand_and_as_decentpy_counts_them():
    # 2 copies of the shard per distinct partner node (2 per distinct group of > 2 nodes): AER
    # over N = 2^r nodes has r partner nodes
    assert rm.sharded_compressed_copies("alternating-exp-ring", 2) == 2
    assert rm.sharded_compressed_copies("alternating-exp-ring", 8) == 2 * 3
    assert rm.sharded_compressed_copies("alternating-exp-ring", 512) == 2 * 9
    assert rm.sharded_compressed_copies("ring", 8) == 4
    assert rm.sharded_compressed_copies("one-peer-exp", 8) == 2 * 3
    assert rm.sharded_compressed_copies("complete", 2) == 2  # a pair of nodes
    assert rm.sharded_compressed_copies("complete", 3) == 2  # one group of 3 nodes
    # decentpy's own lifting to ranks: rank 0's distinct peers are rank 0 of those nodes
    for nodes, local in ((8, 8), (4, 2)):
        ranks = topology.shard_topology(topology.node_topology("alternating-exp-ring", nodes), local)
        peers = {r for t in range(ranks.period) for r in ranks.group_of(0, t).ranks} - {0}
        assert peers == {g * local for g in range(1, nodes) if g & (g - 1) == 0}
        assert rm.sharded_compressed_copies("alternating-exp-ring", nodes) == 2 * len(peers)


def test_compression_table():
    rows = rm.compression_table()
    assert len(rows) == 2 * 2 * 10
    for r in rows:
        if r["nodes"] == 1:
            assert r["alternating-exp-ring_s"] is None and r["alternating-exp-ring+int8_s"] is None
            continue
        # the model's findings: compression helps one-peer-exp (pairs, every GPU's model through
        # the NIC) and still hurts AER on 8-GPU nodes (its node pair's chunks put 8 int8 models,
        # 2.03 M, through each NIC against the all-reduce's M: at most that ratio slower); int8
        # is never slower than bf16
        assert r["one-peer-exp+int8_s"] < r["one-peer-exp_s"]
        assert r["alternating-exp-ring_s"] < r["alternating-exp-ring+int8_s"] \
            < 8 * 0.254 * r["alternating-exp-ring_s"]
        for topo in ("alternating-exp-ring", "one-peer-exp"):
            assert r[f"{topo}+int8_s"] <= r[f"{topo}+bf16_s"]
        # two copies for its node's group and two per node pair (log2 N partner nodes)
        assert r["alternating-exp-ring_copies"] == 2 * (1 + int(math.log2(r["nodes"])))
        # sharded AER: one compressed model through each NIC per node pair (8 shards of 1/8),
        # never slower than plain compressed AER, faster than sharded fp32 where the NIC is slow
        assert r["shard-alternating-exp-ring+int8_s"] < r["alternating-exp-ring+int8_s"]
        assert r["shard-alternating-exp-ring+int8_s"] <= r["shard-alternating-exp-ring+bf16_s"]
        if r["inter_gbps"] == 25:
            assert r["shard-alternating-exp-ring+int8_s"] < r["shard-alternating-exp-ring_s"]
        assert r["shard-alternating-exp-ring_copies"] == 2 * int(math.log2(r["nodes"]))
    one_node = [r for r in rows if r["nodes"] == 1]
    assert one_node and all(r["shard-alternating-exp-ring+int8_s"] is None
                            and r["shard-alternating-exp-ring_copies"] is None for r in one_node)


def test_cli_compression_only(tmp_path, capsys):
    table = tmp_path / "docs" / "data" / "runtime_compression.csv"
    png = tmp_path / "docs" / "runtime_compression.png"
    assert cli.main(["--compression-only", "--out", str(tmp_path), "--compression-gpus", "8",
                     "64", "--compression-csv", str(table), "--compression-plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Compressed gossip at scale" in text and "AER+int8" in text and "1peer-exp+bf16" in text
    assert "shard-AER 18 shard copies" not in text and "shard-AER 6 shard copies" in text  # 64 GPUs
    assert "AER 8 copies" in text  # its node and 3 node pairs, 2 each
    lines = table.read_text().splitlines()
    assert lines[0].startswith("model,NIC Gb/s per node,GPUs (nodes),DDP-AR,AER,AER+int8")
    assert lines[0].endswith(",shard-AER,shard-AER+int8,shard-AER+bf16")
    assert len(lines) == 1 + 2 * 2 * 2  # 2 workloads x 2 NIC speeds x 2 GPU counts
    assert (tmp_path / "runtime_compression.csv").is_file()
    assert png.is_file() or png.with_suffix(".svg").is_file()
    with pytest.raises(SystemExit):
        cli.main(["--compression-only", "--out", str(tmp_path), "--compression-gpus", "12"])


# ---------------------------------------------------------------------------------------------
# local steps: DiLoCo and gossip DiLoCo
# ---------------------------------------------------------------------------------------------

NO_KERNELS = replace(HW, mem_bw=math.inf)  # kernel passes cost nothing


def _kernels(wl, hw):
    """(inner Adam step, DiLoCo outer step) seconds, by hand."""
    return 7.0 * wl.model_bytes / hw.mem_bw, 11.0 * wl.model_bytes / hw.mem_bw


@pytest.mark.parametrize("n,local", [(64, 8), (16, 1), (8, 8)])
def test_diloco_h1_without_overlap_is_one_allreduce_per_iteration(n, local):
    hw = replace(HW, overlap=0.0)
    allreduce = rm.allreduce_time(WL.model_bytes, n, local, hw)
    t, exposed = rm.diloco_iteration_time(n, local, WL, replace(hw, mem_bw=math.inf), 1)
    assert t == pytest.approx(WL.compute_s + allreduce, rel=1e-12)
    assert exposed == pytest.approx(allreduce, rel=1e-12)
    k_in, k_out = _kernels(WL, hw)
    t = rm.diloco_iteration_time(n, local, WL, hw, 1)[0]
    assert t == pytest.approx(WL.compute_s + allreduce + k_in + k_out, rel=1e-12)


def test_local_steps_hand_computed_with_overlap():
    n, local, h = 64, 8, 4
    fwd, bwd = WL.compute_s / 3, 2 * WL.compute_s / 3
    k_in, k_out = _kernels(WL, HW)
    a = rm.allreduce_time(WL.model_bytes, n, local, HW)
    e = rm.allreduce_time(WL.bucket_bytes, n, local, HW)  # the last bucket: exposed
    outer = fwd + e + max(bwd, a - e) + k_in + k_out
    t, exposed = rm.diloco_iteration_time(n, local, WL, HW, h)
    assert t == pytest.approx(((h - 1) * (WL.compute_s + k_in) + outer) / h, rel=1e-12)
    assert exposed == pytest.approx((e + max(bwd, a - e) - bwd) / h, rel=1e-12)
    # a gossip outer step on AER: its step's 2M buffer, the mix's 6 M bytes more kernel traffic
    steps = rm.step_comm_times("alternating-exp-ring", n, local, 2 * WL.model_bytes, HW)
    tails = rm.step_comm_times("alternating-exp-ring", n, local, 2 * WL.bucket_bytes, HW)
    outer = np.mean([fwd + e + max(bwd, a - e) for a, e in zip(steps, tails)]) + k_in + k_out \
        + 6.0 * WL.model_bytes / HW.mem_bw
    t = rm.gossip_diloco_iteration_time("alternating-exp-ring", n, local, WL, HW, h)[0]
    assert t == pytest.approx(((h - 1) * (WL.compute_s + k_in) + outer) / h, rel=1e-12)


def test_utilisation_tends_to_one_as_local_steps_grow():
    wl, n, local = rm.local_steps_workload(), 512, 8
    hw = rm.gpu_hardware(25.0)
    solo = rm.solo_iteration_time(wl, hw)
    assert solo == pytest.approx(wl.compute_s + 7.0 * wl.model_bytes / hw.mem_bw, rel=1e-12)
    for name in ("complete", "alternating-exp-ring"):
        for kind in (None, "int8"):
            ts = {h: rm.local_steps_iteration_time(name, n, local, wl, hw, h, kind)[0]
                  for h in (1, 16, 256, 10 ** 6)}
            us = [rm.compute_utilisation(ts[h], wl, hw) for h in sorted(ts)]
            assert all(a < b for a, b in zip(us, us[1:])) and us[-1] == pytest.approx(1, abs=1e-5)
            # T = T_solo + (outer step's extra) / H: the extra does not depend on H
            assert (ts[16] - solo) * 16 == pytest.approx((ts[256] - solo) * 256, rel=1e-9)


def test_gossip_diloco_sends_twice_diloco_bytes_per_outer_step_for_pairs():
    m = WL.model_bytes
    # two workers, one per node: DiLoCo's all-reduce moves M through each NIC, a gossip outer
    # step's pair 2M (global copy and pseudo-gradient), each one way at a time (full duplex)
    for name in ("one-peer-exp", "ring"):
        pair = rm.outer_exchange_times(name, 2, 1, m, BYTES_ONLY)  # every step of the period
        assert pair.tolist() == pytest.approx([2 * m / HW.inter_bw] * len(pair))
    diloco = rm.outer_exchange_times("complete", 2, 1, m, BYTES_ONLY)
    assert diloco.tolist() == pytest.approx([m / HW.inter_bw])
    # int8: one wire of the 2M buffer against one of the M pseudo-gradient (plus a block scale)
    pair = rm.outer_exchange_times("one-peer-exp", 2, 1, m, BYTES_ONLY, "int8")[0]
    assert pair == pytest.approx(_int8_wire(2 * m) / HW.inter_bw, rel=1e-12)
    diloco = rm.outer_exchange_times("complete", 2, 1, m, BYTES_ONLY, "int8")[0]
    assert diloco == pytest.approx(_int8_wire(m) / HW.inter_bw, rel=1e-12)
    assert pair == pytest.approx(2 * diloco, rel=1e-6)
    # one-peer-exp on 16 single-GPU nodes: every outer step a pair, 2M each way
    steps = rm.outer_exchange_times("one-peer-exp", 16, 1, m, HW)
    assert steps.tolist() == pytest.approx([HW.inter_lat + 2 * m / HW.inter_bw] * len(steps))


def test_int8_outer_exchange_by_hand():
    m, local = WL.model_bytes, 8
    intra = rm.allreduce_time(m, local, local, HW)  # fp32 reduce-scatter + all-gather in a node
    # DiLoCo on 2 nodes: each GPU's 1/8 shard, int8, to the same GPU of the other node
    got = rm.outer_exchange_times("complete", 16, local, m, HW, "int8")
    assert got.tolist() == pytest.approx(
        [intra + HW.inter_lat + local * _int8_wire(m / local) / HW.inter_bw], rel=1e-12)
    # AER on 2 nodes: the node-pair step as above for the 2M buffer, the intra-node step fp32
    got = rm.outer_exchange_times("alternating-exp-ring", 16, local, m, HW, "int8")
    intra2 = rm.allreduce_time(2 * m, local, local, HW)
    assert sorted(got.tolist()) == pytest.approx(
        [intra2, intra2 + HW.inter_lat + local * _int8_wire(2 * m / local) / HW.inter_bw],
        rel=1e-12)
    # one node: nothing crosses a NIC, nothing is compressed
    assert rm.outer_exchange_times("complete", 8, 8, m, HW, "int8").tolist() == [intra]
    assert rm.outer_kernel_time("complete", 8, 8, WL, HW, "int8") == \
        rm.outer_kernel_time("complete", 8, 8, WL, HW)
    # kernels: error feedback, quantise and dequantise of the GPU's shard
    extra = (4 * m / local + 2 * _int8_wire(m / local)) / HW.mem_bw
    assert rm.outer_kernel_time("complete", 16, local, WL, HW, "int8") == pytest.approx(
        11 * m / HW.mem_bw + extra, rel=1e-12)


def test_bandwidth_for_utilisation_reaches_the_target():
    wl = rm.local_steps_workload()
    for mode in (rm.LocalStepsMode("ddp"), rm.LocalStepsMode("gossip", "alternating-exp-ring"),
                 rm.LocalStepsMode("local-steps", "complete", 32, "int8"),
                 rm.LocalStepsMode("local-steps", "alternating-exp-ring", 128)):
        for target in (0.90, 0.95):
            g = rm.bandwidth_for_utilisation(mode, 64, target)
            assert rm.utilisation_at(mode, 64, g) >= target
            assert rm.utilisation_at(mode, 64, g * (1 - 2e-4)) < target  # the least, to 1e-4
            assert rm.utilisation_at(mode, 64, g) == pytest.approx(target, abs=1e-3)
    # DiLoCo, by hand (full overlap, the all-reduce longer than the backward): T = T_solo + (A - B
    # + K_out) / H, so A = B - K_out + H T_solo (1 / u - 1) solved for the NIC bandwidth
    h, n, local, u = 32, 512, 8, 0.9
    hw0 = rm.gpu_hardware(1.0)
    solo, k_out = rm.solo_iteration_time(wl, hw0), 11 * wl.model_bytes / hw0.mem_bw
    a = 2 * wl.compute_s / 3 - k_out + h * solo * (1 / u - 1)
    nodes = n // local
    rest = a - rm.allreduce_time(wl.model_bytes, n, local, replace(hw0, inter_bw=math.inf))
    gbps = 2 * (nodes - 1) / nodes * wl.model_bytes / rest / rm.GBIT
    mode = rm.LocalStepsMode("local-steps", "complete", h)
    assert rm.bandwidth_for_utilisation(mode, n, u) == pytest.approx(gbps, rel=2e-4)
    # out of reach: the kernel passes alone cap AER every step below 99.5%
    assert rm.bandwidth_for_utilisation(rm.LocalStepsMode("gossip", "alternating-exp-ring"),
                                        64, 0.995) is None
    with pytest.raises(ValueError, match="target"):
        rm.bandwidth_for_utilisation(mode, n, 1.0)


def test_int8_lowers_the_needed_bandwidth_of_the_outer_exchange():
    for topo in ("complete", "alternating-exp-ring"):
        for h in (32, 128):
            for n in (64, 512):
                fp32 = rm.bandwidth_for_utilisation(rm.LocalStepsMode("local-steps", topo, h), n,
                                                    0.9)
                int8 = rm.bandwidth_for_utilisation(
                    rm.LocalStepsMode("local-steps", topo, h, "int8"), n, 0.9)
                assert int8 < 0.3 * fp32  # 0.254x the NIC bytes, fp32 inside the node


def test_local_steps_modes_and_checks():
    names = [m.name for m in rm.LOCAL_STEPS_MODES]
    assert names[:3] == ["allreduce", "alternating-exp-ring", "alternating-exp-ring+int8"]
    assert "diloco-H32+int8" in names and "diloco-alternating-exp-ring-H128" in names
    assert len(set(names)) == len(names) == 11
    assert cli.label("diloco-H32+int8") == "DiLoCo H=32+int8"
    assert cli.label("diloco-alternating-exp-ring-H128") == "AER-DiLoCo H=128"
    with pytest.raises(ValueError, match="local_steps"):
        rm.LocalStepsMode("gossip", "ring", 4)
    with pytest.raises(ValueError, match="compression"):
        rm.LocalStepsMode("ddp", compression="int8")
    with pytest.raises(ValueError, match="compression kind"):
        rm.LocalStepsMode("local-steps", "complete", 8, "fp8")
    with pytest.raises(ValueError, match="positive integer"):
        rm.diloco_iteration_time(64, 8, WL, HW, 0)
    with pytest.raises(ValueError, match="DiLoCo"):
        rm.gossip_diloco_iteration_time("complete", 64, 8, WL, HW, 8)
    assert not rm.LocalStepsMode("local-steps", "alternating-exp-ring", 8).valid(8, 8)


def test_local_steps_table():
    rows = rm.local_steps_table((64, 4096))
    assert len(rows) == 11 * 2
    by = {(r["mode"], r["gpus"]): r for r in rows}
    for n in (64, 4096):
        need = {m: by[(m, n)]["gbps_for_90pct"] for m, _ in by if _ == n}
        # the model's findings: local steps need a fraction of every-step AER's bandwidth, less
        # with larger H and with int8; int8 hurts AER every step on 8-GPU nodes (compressed
        # chunks of its 16-GPU node-pair group); AER-DiLoCo the same at every scale
        assert need["diloco-H128"] < need["diloco-H32"] < need["alternating-exp-ring"] \
            < need["alternating-exp-ring+int8"]
        assert need["diloco-H32+int8"] < need["diloco-H32"]
        for r in (by[(m, n)] for m in need):
            assert r["gbps_for_90pct"] is None or r["gbps_for_95pct"] is None \
                or r["gbps_for_90pct"] < r["gbps_for_95pct"]
    # DDP's ring all-reduce: 2 (N - 1) latencies in its exposed last bucket cap it at 512 nodes
    assert by[("allreduce", 4096)]["gbps_for_90pct"] is None
    assert by[("allreduce", 4096)]["util_at_400gbps"] < 0.9
    assert by[("diloco-alternating-exp-ring-H32", 64)]["gbps_for_90pct"] == pytest.approx(
        by[("diloco-alternating-exp-ring-H32", 4096)]["gbps_for_90pct"], rel=1e-3)


def test_cli_local_steps_only(tmp_path, capsys):
    table = tmp_path / "docs" / "data" / "runtime_local_steps.csv"
    png = tmp_path / "docs" / "runtime_local_steps.png"
    assert cli.main(["--local-steps-only", "--out", str(tmp_path), "--local-steps-gpus", "64",
                     "512", "--local-steps-n", "64", "--local-steps-csv", str(table),
                     "--local-steps-plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Local steps at scale" in text and "AER-DiLoCo H=128+int8" in text
    lines = table.read_text().splitlines()
    assert lines[0] == ("mode,GPUs (nodes),Gb/s for 90%,Gb/s for 95%,util. at 25 Gb/s,"
                        "util. at 100 Gb/s,util. at 400 Gb/s")
    assert len(lines) == 1 + 11 * 2
    assert lines[1].startswith("DDP-AR,64 (8),")
    assert (tmp_path / "runtime_local_steps.csv").is_file()
    assert png.is_file() or png.with_suffix(".svg").is_file()
    with pytest.raises(SystemExit):
        cli.main(["--local-steps-only", "--out", str(tmp_path), "--local-steps-gpus", "12"])


# ---------------------------------------------------------------------------------------------
# local steps measured: the replicas' int8 path, windows, bench-lm runs, the link calibration
# ---------------------------------------------------------------------------------------------


def test_replicas_int8_outer_exchange_is_compressed_gossip_of_the_buffer():
    m = WL.model_bytes
    for name, buffers in (("complete", 1), ("alternating-exp-ring", 2), ("ring", 2)):
        got = rm.outer_exchange_times(name, 16, 8, m, HW, "int8", node_level=False)
        want = rm.step_comm_times(name, 16, 8, buffers * m, HW, "int8")
        np.testing.assert_allclose(got, want, rtol=1e-12)
        # kernels: error feedback, quantise, dequantise of the whole buffer, not a 1/L shard
        y = buffers * m
        mix = 0.0 if name == "complete" else 6.0 * m
        assert rm.outer_kernel_time(name, 16, 8, WL, HW, "int8", node_level=False) == \
            pytest.approx((11.0 * m + mix + 4 * y + 2 * _int8_wire(y)) / HW.mem_bw, rel=1e-12)
    # off the node-level topologies the two paths are one
    np.testing.assert_array_equal(rm.outer_exchange_times("ring", 16, 8, m, HW, "int8"),
                                  rm.outer_exchange_times("ring", 16, 8, m, HW, "int8", False))
    # bench-lm's 2 nodes of 2: the group of 4 puts 2 wires through each NIC, the node-level path 1
    nic_only = replace(BYTES_ONLY, intra_bw=math.inf)
    replicas = rm.outer_exchange_times("complete", 4, 2, m, nic_only, "int8", node_level=False)
    fp32 = rm.outer_exchange_times("complete", 4, 2, m, nic_only)
    assert replicas[0] / fp32[0] == pytest.approx(2 * _int8_wire(m) / m, rel=1e-3)
    assert rm.local_steps_iteration_time("complete", 4, 2, WL, HW, 8, "int8")[0] < \
        rm.local_steps_iteration_time("complete", 4, 2, WL, HW, 8, "int8", node_level=False)[0]


@pytest.mark.parametrize("name,kind", [("complete", None), ("alternating-exp-ring", "int8"),
                                       ("one-peer-exp", None)])
def test_local_steps_window_by_hand(name, kind):
    n, local, h = 16, 8, 4
    inner, outer = rm.local_steps_step_times(name, n, local, WL, HW, kind)
    period = len(outer)
    # whole periods of the schedule: the steady-state mean
    assert rm.local_steps_window_time(name, n, local, WL, HW, h, 1, h * period, kind) == \
        pytest.approx(rm.local_steps_iteration_time(name, n, local, WL, HW, h, kind)[0], rel=1e-12)
    # iterations 3..13 at H = 4: outer steps at 4, 8, 12 (topology steps 0, 1, 2 mod period)
    want = (8 * inner + sum(outer[k % period] for k in range(3))) / 11
    assert rm.local_steps_window_time(name, n, local, WL, HW, h, 3, 13, kind) == \
        pytest.approx(want, rel=1e-12)
    # no outer step inside: inner iterations only
    assert rm.local_steps_window_time(name, n, local, WL, HW, h, 5, 7, kind) == \
        pytest.approx(inner, rel=1e-12)
    with pytest.raises(ValueError, match="first=5"):
        rm.local_steps_window_time(name, n, local, WL, HW, h, 5, 4, kind)


def test_predict_local_steps_is_the_model_function():
    hw = replace(HW, overlap=0.7)
    wl = replace(WL, compute_s=0.05)
    for topo, kind in (("complete", None), ("complete", "int8"), ("alternating-exp-ring", "int8")):
        m = fit.Measurement("decentpy", topo, 16, "x", 1.0, wl.model_bytes, wl.compute_s, 8,
                            local_steps=32, compression=kind, link_mbit=100.0)
        assert m.kind == "local-steps"
        assert fit.predict(m, hw) == rm.local_steps_iteration_time(
            topo, 16, 8, wl, hw, 32, kind, node_level=False)[0]
        w = replace(m, window=(31, 244))
        assert fit.predict(w, hw) == rm.local_steps_window_time(
            topo, 16, 8, wl, hw, 32, 31, 244, kind, node_level=False)
    every = fit.Measurement("decentpy", "alternating-exp-ring", 16, "x", 1.0, wl.model_bytes,
                            wl.compute_s, 8, compression="int8")
    assert fit.predict(every, hw) == rm.decentralized_iteration_time(
        "alternating-exp-ring", 16, 8, wl, hw, "int8")[0]
    with pytest.raises(ValueError, match="shard"):
        fit.predict(replace(m, sharded=True), hw)


_LM_HEADER = ("framework,mode,topology,compression,intra_node,local_steps,fragments,link_mbit,"
              "workers,preset,seed,step,tokens,wall_s,bytes_sent_per_worker,params,device")


def _lm_run(arm, link, seed, points, params=1000):
    """bench-lm rows of one run: arm = (framework, mode, topology, compression, intra_node, H, F)."""
    fw, mode, topo, comp, intra, h, frag = arm
    return [f"{fw},{mode},{topo},{comp},{intra},{h},{frag},{link},4,small,{seed},{s},{s * 64},{w},"
            f"0.0,{params},cpu" for s, w in points]


_DILOCO8 = ("decentpy", "decentpy", "complete", "none", "gossip", 8, 1)
_AER32_INT8 = ("decentpy", "decentpy", "alternating-exp-ring", "int8", "gossip", 32, 1)
_RANDOM32 = ("decentpy", "decentpy", "random-pairs", "none", "gossip", 32, 1)
_DDP = ("torch", "ddp", "allreduce", "none", "", "", "")


def _write_lm_csv(path, throttled=True):
    rows = []
    # loopback: start-up in the first interval (step 0 -> 10), then 0.1 / 0.12 / 0.2 s per step
    rows += _lm_run(_DILOCO8, "", 0, [(0, 0.0), (10, 5.0), (20, 6.0), (40, 8.0)])
    rows += _lm_run(_AER32_INT8, "", 0, [(0, 0.0), (10, 3.0), (40, 6.6)])
    rows += _lm_run(_RANDOM32, "", 0, [(0, 0.0), (10, 2.0), (40, 8.0)])
    rows += _lm_run(_DDP, "", 0, [(0, 0.0), (10, 1.0), (40, 4.0)])
    rows += _lm_run(_DDP, "", 1, [(0, 0.0), (10, 1.0), (40, 7.0)])
    if throttled:
        rows += _lm_run(_DILOCO8, "100.0", 0, [(40, 6.0), (10, 1.5), (0, 0.0), (20, 3.0)])
        rows += _lm_run(_AER32_INT8, "100.0", 0, [(0, 0.0), (40, 9.0)])  # two points: from 0
        rows += _lm_run(_RANDOM32, "100.0", 0, [(0, 0.0), (10, 2.0), (40, 9.0)])
        rows += _lm_run(_DDP, "100.0", 0, [(0, 0.0), (10, 4.0), (40, 16.0)])
        rows += _lm_run(("torch", "ddp-powersgd", "allreduce", "powersgd-rank4", "", "", ""),
                        "100.0", 0, [(0, 0.0), (40, 9.0)])
        rows += _lm_run(("decentpy", "decentpy", "ring", "none", "gossip", "", ""), "100.0", 0,
                        [(0, 0.0), (40, 9.0)])  # no loopback run of its arm
        rows += _lm_run(("decentpy", "decentpy", "complete", "none", "gossip", 32, 4), "100.0", 0,
                        [(0, 0.0), (40, 9.0)])
        rows += _lm_run(_DILOCO8, "1000.0", 0, [(40, 5.0)])  # one point: no time
    path.write_text(_LM_HEADER + "\n" + "\n".join(rows) + "\n")


def test_bench_lm_loader(tmp_path):
    path = tmp_path / "bench_lm.csv"
    _write_lm_csv(path)
    assert fit.is_bench_lm(path)
    runs = fit.load_bench_lm(path)
    assert runs.loopback_runs == 5
    by = {(m.topology, m.local_steps): m for m in runs.measurements}
    assert set(by) == {("complete", 8), ("alternating-exp-ring", 32), ("allreduce", 1)}
    pooled = 0.12  # median of the local-steps loopback runs: 0.1, 0.12, 0.2 (random-pairs too)
    d = by[("complete", 8)]
    assert (d.framework, d.workers, d.local, d.model, d.link_mbit) == ("decentpy", 4, 2, "lm-small", 100.0)
    assert d.model_bytes == 4000.0 and d.compression is None and not d.sharded
    assert d.window == (11, 40) and d.step_time_s == pytest.approx((6.0 - 1.5) / 30)
    assert d.compute_time_s == pytest.approx(pooled)
    a = by[("alternating-exp-ring", 32)]
    assert a.compression == "int8" and a.window == (1, 40) and a.step_time_s == pytest.approx(9.0 / 40)
    assert a.compute_time_s == pytest.approx(pooled)
    ddp = by[("allreduce", 1)]
    assert ddp.kind == "allreduce" and ddp.step_time_s == pytest.approx(0.4)
    assert ddp.compute_time_s == pytest.approx(0.15)  # the median of its two seeds: 0.1, 0.2
    reasons = {s.run.split(" @ ")[0] + " @ " + s.run.split(" @ ")[1].split(",")[0]: s.reason
               for s in runs.skipped}
    assert "random-pairs" in reasons["decentpy random-pairs H=32 @ 100 Mbit/s"]
    assert "PowerSGD" in reasons["ddp-powersgd allreduce powersgd-rank4 @ 100 Mbit/s"]
    assert "no loopback run" in reasons["decentpy ring @ 100 Mbit/s"]
    assert "fragments" in reasons["decentpy complete H=32 F=4 @ 100 Mbit/s"]
    assert "fewer than two" in reasons["decentpy complete H=8 @ 1000 Mbit/s"]
    assert len(runs.skipped) == 5
    assert fit.load_measurements(path) == runs.measurements
    # compute='arm': the same arm and seed's loopback run
    arm = {(m.topology, m.local_steps): m for m in fit.load_bench_lm(path, "arm").measurements}
    assert arm[("complete", 8)].compute_time_s == pytest.approx(0.1)
    assert arm[("alternating-exp-ring", 32)].compute_time_s == pytest.approx(0.12)
    assert arm[("allreduce", 1)].compute_time_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="'median'"):
        fit.load_bench_lm(path, "median")


def _link_synthetic(eff, lat, ov, m_bytes=4.3e6):
    """Throttled measurements like bench-lm's, step times from the model with a known link."""
    out = []
    for mbit in (100.0, 1000.0):
        for topo, kind, h in (("allreduce", None, 1), ("complete", None, 1), ("ring", None, 1),
                              ("one-peer-exp", None, 1), ("alternating-exp-ring", None, 1),
                              ("alternating-exp-ring", "int8", 1), ("complete", None, 8),
                              ("complete", "int8", 32), ("alternating-exp-ring", None, 32)):
            m = fit.Measurement("decentpy", topo, 4, "lm", 1.0, m_bytes, 0.25, 2, local_steps=h,
                                compression=kind, link_mbit=mbit, window=(31, 244))
            t = fit.predict(m, fit.link_hardware(mbit, eff, lat, ov))
            out.append(replace(m, step_time_s=t))
    return out


def test_link_calibration_recovers_a_known_link():
    ms = _link_synthetic(0.8, 5e-3, 0.5)
    res = fit.calibrate_links(ms, restarts=1)
    assert res.fitted == [m.local_steps == 1 for m in ms]
    assert res.efficiency == pytest.approx(0.8, rel=0.02)
    assert res.latency_s == pytest.approx(5e-3, rel=0.1)
    assert res.overlap == pytest.approx(0.5, abs=0.05)
    assert res.median_abs_error(True) < 1e-3 and res.median_abs_error(False) < 1e-3
    hw = res.hardware(100.0)
    assert hw.inter_bw == pytest.approx(res.efficiency * 12.5e6) and hw.overlap == res.overlap
    with pytest.raises(ValueError, match="calibrate_links"):
        fit.calibrate(ms)
    with pytest.raises(ValueError, match="link_mbit"):
        fit.calibrate_links([replace(ms[0], link_mbit=None)])
    with pytest.raises(ValueError, match="fit set"):
        fit.calibrate_links(ms, fit_on=lambda m: False)


def test_cli_calibrates_bench_lm(tmp_path, capsys):
    path = tmp_path / "bench_lm.csv"
    _write_lm_csv(path)
    table = tmp_path / "docs" / "runtime_model_calibration_lm.csv"
    out = tmp_path / "out"
    assert cli.main(["--calibration-only", "--calibrate", str(path), "--out", str(out),
                     "--lm-calibration-csv", str(table), "--local-steps-n", "64"]) == 0
    text = capsys.readouterr().out
    assert "bench-lm calibration on the 3 throttled-link runs" in text
    assert "random-pairs" in text and "NIC Gb/s per node" in text
    lines = table.read_text().splitlines()
    assert lines[0].startswith("run,set,link Mbit/s,H,compute ms,measured ms,model ms,rel err")
    assert len(lines) == 1 + 3
    assert (out / "runtime_model_calibration_lm.csv").is_file()
    assert (out / "runtime_model_calibration_lm_params.csv").read_text().startswith("param,value")
    loopback = tmp_path / "loopback.csv"
    _write_lm_csv(loopback, throttled=False)
    assert cli.main(["--calibration-only", "--calibrate", str(loopback), "--out", str(out)]) == 0
    assert "no throttled-link run" in capsys.readouterr().out

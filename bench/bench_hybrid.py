"""Hybrid (2 nodes x 2 local ranks) benchmark on CPU: decentpy vs torch DDP / ZeRO, and pipelines x gossip.

One run of 4 gloo worker processes on 127.0.0.1 (one torch thread each), with the ranks laid out as
G = 2 nodes x L = 2 local ranks (node = rank // 2; simulated: ``local_world_size=2``, all on one
machine), trains an MLP (``--model mlp``: 4 x Linear(1024, 1024) with ReLU between, batch 64 per
rank (per pipeline replica for the pipelines), cross-entropy over 1024 classes, own synthetic data
per rank / replica, fixed seed; ``--quick``: the same with width 256) with AdamW (lr 1e-4) in these
set-ups, side by side:

* ``decentpy``       ``DecentralizedDataParallel(model, optim_fn, topology=T, local_world_size=2)``
                     for T = ``alternating-exp-ring`` (the baseline "plain decentpy") and
                     ``one-peer-exp``;
* ``decentpy-shard`` the same with ``intra_node="shard"`` (sharded gossip), only when
                     ``DecentralizedDataParallel.__init__`` has an ``intra_node`` parameter; else a
                     line says it is not available in this build (no row, no numbers);
* ``decentpy-int8``, ``decentpy-shard-int8``: the two above with ``compression="int8"`` (compressed
                     gossip; with ``intra_node="shard"`` the node reduces exactly and each rank's
                     shard is compressed for the same shard on the other node), first topology only;
* ``ddp``            ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``;
* ``ddp-zero``       ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(optimizer_class=AdamW)``;
* ``pipe-gossip``    2 stages x 2 replicas (``decentpy.hybrid.pipeline_groups(stages=2,
                     replicas=2)``: replica r = ranks 2r, 2r+1, i.e. a pipeline inside a node, the
                     replicas of a stage across the nodes), ``decentpy.AsyncPipe(..., chunks=4,
                     schedule="1f1b", checkpoint="never")`` with ``pipe.wrap_partition(lambda part:
                     DecentralizedDataParallel(part, optim_fn, topology="complete",
                     process_group=groups.replicas))``, stepped by ``pipe.train_step(x, y, loss)``;
* ``pipe-ddp``       the same AsyncPipe without ``wrap_partition``: after ``train_step`` each stage's
                     gradients (one flat buffer) are all-reduced (averaged) over ``groups.replicas``,
                     then a torch AdamW step.

Measured per set-up (step time and memory machinery shared with bench/bench_train.py and
bench/bench_shard.py: bench/common/measure.py):

* step time: wall time of one training step (forward + backward + optimizer step where the set-up
  has one), every rank; per step the max over ranks; the median over the timed steps plus the
  25th/75th percentiles. All set-ups live in the same processes and are timed in interleaved rounds;
* optimizer state per rank: bytes of the tensors in the rank's optimizer state(s), each storage
  counted once (decentpy: all of ``ddp.state_optimizers``; ZeRO: its local shard's optimizer; DDP: the AdamW;
  pipelines: the stage's), max over ranks (and every rank's in the CSV);
* peak memory per worker: bench_train's peak RSS (baseline RSS + the RSS high-water mark of the
  set-up built and warmed up alone), max over ranks;
* bytes sent per rank per step, inside the node and across nodes (see ``BYTES``).

Writes ``bench/out/bench_hybrid.csv`` (columns ``tools/runtime_model/fit.py``'s loader reads, plus more).

    python -m bench.bench_hybrid            # the full run (~2-3 minutes on 2 cores)
    python -m bench.bench_hybrid --quick    # smoke test: width 256, a few steps
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import threading
import time
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import add_link_args, add_run_args, bench_parser, open_network, quick_timing, spawn_workers
from bench.common.machine import report_machine
from bench.common.measure import (Config, Runner, gather_results, measure_and_time, prime, rss_bytes, state_bytes,
                                  timing_row)
from bench.common.models import LR, adamw_fn
from bench.common.tables import cell, check_choices, csv_list, fmt, mib, print_targets
from bench.common.tables import print_table as print_table_rows
from bench.common.tables import write_csv as write_rows_csv


WORLD = 4          # G x L
LOCAL = 2          # ranks per (simulated) node
STAGES, REPLICAS = 2, 2
CHUNKS = 4         # micro-batches per pipeline mini-batch
BATCH = 64
BASE_TOPO = "alternating-exp-ring"
FRAMEWORKS = ("decentpy", "decentpy-shard", "decentpy-int8", "decentpy-shard-int8", "ddp", "ddp-zero", "pipe-gossip",
              "pipe-ddp")
GOSSIP = ("decentpy", "decentpy-shard", "decentpy-int8", "decentpy-shard-int8")
PIPES = ("pipe-gossip", "pipe-ddp")
TOPO_OF = {"ddp": "allreduce", "ddp-zero": "allreduce", "pipe-gossip": "pipeline+complete",
           "pipe-ddp": "pipeline+allreduce"}
SETUP = {"decentpy": "DecentralizedDataParallel", "decentpy-shard": "DecentralizedDataParallel(intra_node=shard)",
         "decentpy-int8": "DecentralizedDataParallel(compression=int8)",
         "decentpy-shard-int8": "DecentralizedDataParallel(intra_node=shard, compression=int8)",
         "ddp": "DDP+AdamW", "ddp-zero": "DDP+ZeRO(AdamW)", "pipe-gossip": "AsyncPipe 2x2 + gossip",
         "pipe-ddp": "AsyncPipe 2x2 + all-reduce"}
WIDTH = {"mlp": 1024, "mlp-small": 256}
TOLERANCE = 0.05   # targets: <= 1/L + 5% of plain decentpy's

BYTES = """\
bytes sent per rank per step, split by the peer's node (node = rank // 2): every tensor handed to a
torch.distributed call inside a timed step is counted on the sending rank, once:
  point to point (dist.isend / send, decentpy's pair exchanges, the pipeline's activations and
             gradients): the tensor's bytes, to that peer (exact);
  all-reduce of B bytes over m ranks (dist.all_reduce, decentpy's group all-reduces, torch DDP's
             gradient buckets): ring algorithm, each rank sends 2(m-1)/m * B to its successor in
             the group's rank order (analytic: the split between nodes follows from the ring);
  broadcast of B bytes (ZeRO's parameter sync): binomial tree from the root, B per edge;
  torch DDP's reducer runs its all-reduces in C++ (no Python call to see): counted as one ring
             all-reduce of all gradient bytes per step.
Intra / inter = the max over ranks of that rank's average per step after the warm-up (timed and
untimed steps of the timing pass; per-rank values and the mean over ranks in the CSV)."""


# ----------------------------------------------------------------------------------------------
# byte counting (worker side)
# ----------------------------------------------------------------------------------------------


def _node(rank: int) -> int:
    return rank // LOCAL


class Traffic:
    """Bytes this rank sends, to its own node and to other nodes (cumulative)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.intra = 0.0
        self.inter = 0.0
        self._tls = threading.local()

    # -- attribution
    def send(self, peer: int, nbytes: float) -> None:
        if peer == self.rank or nbytes <= 0:
            return
        if _node(peer) == _node(self.rank):
            self.intra += nbytes
        else:
            self.inter += nbytes

    def ring_allreduce(self, ranks: Sequence[int], nbytes: float, phases: int = 2) -> None:
        """Ring all-reduce (``phases=2``: reduce-scatter then all-gather) of ``nbytes``; ``phases=1``:
        a reduce-scatter of ``nbytes`` of input or an all-gather of ``nbytes`` of output alone."""
        m = len(ranks)
        if m < 2 or self.rank not in ranks:
            return
        i = list(ranks).index(self.rank)
        self.send(ranks[(i + 1) % m], phases * (m - 1) / m * nbytes)

    def tree_broadcast(self, ranks: Sequence[int], root: int, nbytes: float) -> None:
        m = len(ranks)
        if m < 2 or self.rank not in ranks:
            return
        ranks = list(ranks)
        rel = (ranks.index(self.rank) - ranks.index(root)) % m
        mask = 1
        while mask < m:  # round k: relative ranks < mask send to rel + mask
            if rel < mask and rel + mask < m:
                self.send(ranks[(ranks.index(root) + rel + mask) % m], nbytes)
            mask <<= 1

    # -- nesting: decentpy's own wrappers count, the dist calls inside them do not
    @property
    def inside(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def enter(self) -> None:
        self._tls.depth = getattr(self._tls, "depth", 0) + 1

    def leave(self) -> None:
        self._tls.depth -= 1


TRAFFIC: Optional[Traffic] = None


def _group_ranks(group: Any) -> List[int]:
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def install_counters(rank: int) -> Traffic:
    """Wrap the torch.distributed calls (and decentpy's sub-group exchanges, which on private
    groups bypass them) so that every tensor sent is counted in the returned :class:`Traffic`."""
    global TRAFFIC
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import decentpy.comm as dcomm

    tr = TRAFFIC = Traffic(rank)

    def wrap_dist(name: str, count: Callable[[inspect.BoundArguments], None]) -> None:
        orig = getattr(c10d, name)
        sig = inspect.signature(orig)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not tr.inside:
                ba = sig.bind(*args, **kwargs)
                ba.apply_defaults()
                count(ba)
            tr.enter()
            try:
                return orig(*args, **kwargs)
            finally:
                tr.leave()

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)

    def p2p(ba: inspect.BoundArguments) -> None:
        a = ba.arguments
        dst = a.get("dst")
        if dst is None and a.get("group_dst") is not None:
            dst = _group_ranks(a.get("group"))[a["group_dst"]]
        if dst is not None:
            tr.send(int(dst), _nbytes(a["tensor"]))

    def allreduce(ba: inspect.BoundArguments) -> None:
        tr.ring_allreduce(_group_ranks(ba.arguments.get("group")), _nbytes(ba.arguments["tensor"]))

    def broadcast(ba: inspect.BoundArguments) -> None:
        a = ba.arguments
        ranks = _group_ranks(a.get("group"))
        src = a.get("src")
        if src is None and a.get("group_src") is not None:
            src = ranks[a["group_src"]]
        if src is not None:  # the root and the relays count their own sends
            tr.tree_broadcast(ranks, int(src), _nbytes(a["tensor"]))

    wrap_dist("isend", p2p)
    wrap_dist("send", p2p)
    wrap_dist("all_reduce", allreduce)
    wrap_dist("broadcast", broadcast)

    def wrap_subgroup(name: str, count: Callable[..., None]) -> None:
        """decentpy's own sub-groups (private gloo groups bypass torch.distributed's functions)."""
        orig = getattr(dcomm.SubGroup, name)

        def wrapper(self: Any, *args: Any) -> Any:
            if not tr.inside:
                count(self, *args)
            tr.enter()
            try:
                return orig(self, *args)
            finally:
                tr.leave()

        setattr(dcomm.SubGroup, name, wrapper)

    wrap_subgroup("send_recv", lambda g, send, recv, peer, tag: tr.send(int(peer), _nbytes(send)))
    # gloo pair exchanges send and receive on two groups (full duplex): SubGroup.send / recv
    wrap_subgroup("send", lambda g, send, peer, tag: tr.send(int(peer), _nbytes(send)))
    wrap_subgroup("all_reduce", lambda g, buffer: tr.ring_allreduce(list(g.global_ranks), _nbytes(buffer)))
    # intra_node='shard': the gradients' reduce-scatter and the updated shards' all-gather in a node
    wrap_subgroup("reduce_scatter",
                  lambda g, out, inp: tr.ring_allreduce(list(g.global_ranks), _nbytes(inp), phases=1))
    wrap_subgroup("all_gather",
                  lambda g, out, inp: tr.ring_allreduce(list(g.global_ranks), _nbytes(out), phases=1))
    return tr


# ----------------------------------------------------------------------------------------------
# model, data, set-ups (worker side)
# ----------------------------------------------------------------------------------------------


def make_layers(width: int, seed: int, keep: Optional[range] = None) -> List[Any]:
    """4 x Linear(width, width) with ReLU between (7 layers); layer i from seed ``seed + i`` (the
    same on every rank); layers outside ``keep`` are ``nn.Identity`` (another stage's)."""
    import torch
    from torch import nn

    out: List[Any] = []
    for i in range(7):
        if keep is not None and i not in keep:
            out.append(nn.Identity())
        elif i % 2 == 0:
            torch.manual_seed(seed * 100 + i)
            out.append(nn.Linear(width, width))
        else:
            out.append(nn.ReLU())
    return out


BALANCE = [4, 3]  # stage 0: Linear ReLU Linear ReLU; stage 1: Linear ReLU Linear


def model_desc(model: str) -> str:
    w = WIDTH[model]
    return (f"MLP 4 x Linear({w},{w}) with ReLU between, batch {BATCH} per rank (per replica for the pipelines, "
            f"{CHUNKS} micro-batches, 1F1B, balance {BALANCE}), cross-entropy over {w} classes")


def xent(out: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out, y)


def has_intra_node() -> bool:
    import decentpy

    return "intra_node" in inspect.signature(decentpy.DecentralizedDataParallel.__init__).parameters


class HybridRunner(Runner):
    """The benchmarks' Runner (memory bookkeeping, timing loop) with this bench's set-ups, model, data
    and per-step byte counting."""

    def __init__(self, cfg: Config, rank: int, seed: int) -> None:
        self.ddp: Any = None
        self.pipe: Any = None
        self.warmup = 10**9  # set by the worker: steps after which bytes are counted
        self.counted_steps = 0
        self.intra = 0.0
        self.inter = 0.0
        super().__init__(cfg, rank, seed)

    def load_batches(self, seed: int) -> List[Tuple[Any, Any]]:
        """Every stage of a pipeline replica gets the replica's batches; a data-parallel rank its own."""
        import torch

        width = WIDTH[self.cfg.model]
        data_id = self.rank // STAGES if self.cfg.framework in PIPES else self.rank
        g = torch.Generator().manual_seed(seed * 1000 + data_id)
        return [(torch.randn(BATCH, width, generator=g), torch.randint(0, width, (BATCH,), generator=g))
                for _ in range(4)]

    def new_model(self, seed: int) -> Any:
        """The whole MLP, or this rank's stage of it (the other stages' layers: nn.Identity)."""
        from torch import nn

        width = WIDTH[self.cfg.model]
        if self.cfg.framework in PIPES:
            stage = self.rank % STAGES
            start = sum(BALANCE[:stage])
            return nn.Sequential(*make_layers(width, seed, range(start, start + BALANCE[stage])))
        return nn.Sequential(*make_layers(width, seed))

    def build(self, model: Any) -> None:
        import torch

        fw = self.cfg.framework
        if fw in GOSSIP:
            from decentpy import DecentralizedDataParallel

            extra: Dict[str, Any] = {"intra_node": "shard"} if "shard" in fw else {}
            if fw.endswith("-int8"):
                extra["compression"] = "int8"
            self.net = self.ddp = DecentralizedDataParallel(model, adamw_fn, topology=self.cfg.topology,
                                                            local_world_size=LOCAL, **extra)
        elif fw in ("ddp", "ddp-zero"):
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(model)
            if fw == "ddp":
                self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.opt = ZeroRedundancyOptimizer(self.net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
            self.grad_bytes = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
        elif fw in PIPES:
            from decentpy import AsyncPipe, DecentralizedDataParallel
            from decentpy.hybrid import pipeline_groups

            # new groups per pipe (a collective, same order on every rank): two pipes alive side by
            # side never share a group
            self.groups = groups = pipeline_groups(stages=STAGES, replicas=REPLICAS)
            self.net = self.pipe = AsyncPipe(model, balance=BALANCE, group=groups.pipeline, chunks=CHUNKS,
                                             checkpoint="never", schedule="1f1b")
            if fw == "pipe-gossip":
                self.ddp = self.pipe.wrap_partition(lambda part: DecentralizedDataParallel(
                    part, adamw_fn, topology="complete", process_group=groups.replicas))
            else:
                self.params = [p for p in self.pipe.partition.parameters()]
                self.opt = torch.optim.AdamW(self.params, lr=LR)
        else:
            raise ValueError(f"unknown framework {fw!r}")

    def _pipe_ddp_sync(self) -> None:
        """The baseline's DDP-style step: average the stage's gradients over its replicas, AdamW."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.groups.replicas)
        flat /= REPLICAS
        for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(v)
        self.opt.step()
        self.opt.zero_grad()

    def step(self) -> Tuple[float, float]:
        tr = TRAFFIC
        assert tr is not None
        intra0, inter0 = tr.intra, tr.inter
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = time.perf_counter()
        if self.pipe is not None:
            first, last = self.groups.stage == 0, self.groups.final_stage
            self.pipe.train_step(x if first else None, y if last else None, xent)
            t1 = time.perf_counter()
            if self.cfg.framework == "pipe-ddp":
                self._pipe_ddp_sync()
        else:
            loss = xent(self.net(x), y)
            loss.backward()  # decentpy mixes, steps and launches its exchanges in here
            t1 = time.perf_counter()
            if self.opt is not None:
                self.opt.step()
                self.opt.zero_grad()
        t2 = time.perf_counter()
        if self.cfg.framework in ("ddp", "ddp-zero"):  # the C++ reducer's all-reduce (see BYTES)
            tr.ring_allreduce(list(range(WORLD)), self.grad_bytes)
        if self.i > self.warmup:
            self.counted_steps += 1
            self.intra += tr.intra - intra0
            self.inter += tr.inter - inter0
        return t2 - t0, t1 - t0

    def finish(self) -> None:
        if self.ddp is not None:
            self.ddp.wait()

    def state_bytes(self) -> int:
        if self.ddp is not None:  # every bucket's optimizer, one storage counted once across them
            merged: Dict[Any, Any] = {}
            for k, opt in enumerate(self.ddp.state_optimizers):
                for i, st in enumerate(opt.state.values()):
                    merged[(k, i)] = st
            return state_bytes(types.SimpleNamespace(state=merged))
        return state_bytes(self.opt)

    def bytes_per_step(self) -> Tuple[float, float]:
        n = max(1, self.counted_steps)
        return self.intra / n, self.inter / n


def _worker_body(rank: int, n: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    import decentpy  # noqa: F401  (imported before the baseline RSS is taken)
    import decentpy.hybrid  # noqa: F401

    install_counters(rank)
    cfgs = [Config(**c) for c in plan["configs"]]
    dist.barrier()

    class _Counted(HybridRunner):  # bytes counted after the warm-up of the timing pass
        def __init__(self, cfg: Config, rank: int, seed: int) -> None:
            super().__init__(cfg, rank, seed)
            self.warmup = plan["warmup"]

    prime(cfgs, rank, plan, _Counted)
    base_rss = rss_bytes()
    runners, mems = measure_and_time(cfgs, rank, plan, _Counted)
    results = gather_results(runners, mems, base_rss, rank, n)
    mine = [[r.state_bytes(), *r.bytes_per_step(), r.param_bytes] for r in runners]
    every: List[Any] = [None] * n
    dist.all_gather_object(every, mine)
    for i, res in enumerate(results):  # rank 0 only
        res["state_ranks"] = [every[k][i][0] for k in range(n)]
        res["intra_ranks"] = [every[k][i][1] for k in range(n)]
        res["inter_ranks"] = [every[k][i][2] for k in range(n)]
        res["param_ranks"] = [every[k][i][3] for k in range(n)]
    for r in runners:
        r.finish()
    del runners
    return dict(results=results)


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def _label(c: Config) -> str:
    return f"{c.framework}/{c.topology}"


def summarize(raw: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    rows = []
    for res in raw:
        r = timing_row(res)
        r.update(state_ranks=res["state_ranks"], state=max(res["state_ranks"]), intra_ranks=res["intra_ranks"],
                 inter_ranks=res["inter_ranks"], intra=max(res["intra_ranks"]), inter=max(res["inter_ranks"]),
                 model_bytes=sum(res["param_ranks"]) // (WORLD if res["cfg"]["framework"] not in PIPES else REPLICAS))
        rows.append(r)
    by = {(r["cfg"].framework, r["cfg"].topology): r for r in rows}
    base = by.get(("decentpy", BASE_TOPO))
    ddp = by.get(("ddp", "allreduce"))
    pipe_ddp = by.get(("pipe-ddp", TOPO_OF["pipe-ddp"]))
    for r in rows:
        fw = r["cfg"].framework
        ref = pipe_ddp if fw == "pipe-gossip" else (ddp if fw not in PIPES and fw != "ddp" else None)
        r["ref"] = ref["cfg"].framework if ref else ""
        r["speedup"] = ref["step"] / r["step"] if ref else None  # > 1: this one is faster
        r["state_vs_dp"] = r["state"] / base["state"] if base and base["state"] else None
        r["inter_vs_dp"] = r["inter"] / base["inter"] if base and base["inter"] else None
        r["intra_vs_dp"] = r["intra"] / base["intra"] if base and base["intra"] else None
        r["rss_vs_dp"] = r["peak_rss"] - base["peak_rss"] if base else None
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    rows.sort(key=lambda r: (order[r["cfg"].framework], r["cfg"].topology != BASE_TOPO))
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    hdr = ["framework", "topology", "median ms", "p25-p75 ms", "steps", "ref", "ref/this", "opt state MiB",
           "vs decentpy", "peak RSS MiB", "intra MB/step", "inter MB/step", "inter vs decentpy"]
    table = []
    for r in rows:
        c = r["cfg"]
        table.append([c.framework, c.topology, f"{r['step'] * 1e3:.2f}", f"{r['p25'] * 1e3:.1f}-{r['p75'] * 1e3:.1f}",
                      str(r["steps"]), r["ref"] or "-", fmt(r["speedup"], ".2f", "x"), mib(r["state"]),
                      fmt(r["state_vs_dp"], ".3f"), f"{r['peak_rss'] / 2**20:.0f}", f"{r['intra'] / 1e6:.2f}",
                      f"{r['inter'] / 1e6:.2f}", fmt(r["inter_vs_dp"], ".3f")])
    print_table_rows(hdr, table, group=lambda t: t[0] in PIPES)
    print(f"median ms = one training step, per step the max over the {WORLD} ranks, median over the timed steps; "
          "ref/this = the reference's median over this one's (>1: this one is faster; reference: ddp for the data-"
          "parallel rows, pipe-ddp for pipe-gossip);\nopt state = optimizer-state bytes on the rank holding the most; "
          f"vs decentpy = over plain decentpy's ({BASE_TOPO}); peak RSS as bench_train measures it, max over ranks;\n"
          "intra / inter MB/step = bytes sent per step to ranks of the same node / of the other node "
          "(node = rank // 2), "
          "max over ranks (see below)")


def check_targets(rows: List[Dict[str, Any]]) -> List[Tuple[str, bool, str]]:
    shard = next((r for r in rows if r["cfg"].framework == "decentpy-shard"), None)
    if shard is None:
        return []
    bound = 1.0 / LOCAL + TOLERANCE
    out = []
    for key, what in (("state_vs_dp", "optimizer state per rank"), ("inter_vs_dp", "inter-node bytes per rank")):
        v = shard[key]
        title = f"decentpy-shard {what} <= (1/L + 5%) = {bound:.3f} of plain decentpy's"
        out.append((title, v is not None and v <= bound, "not measured" if v is None else f"{v:.3f}"))
    return out


CSV_FIELDS = ["framework", "topology", "setup", "workers", "local_world_size", "nodes", "model", "intra_node",
              "step_time_s", "step_time_p25_s", "step_time_p75_s", "compute_time_s", "timed_steps",
              "bytes_per_step", "model_bytes", "optim_state_bytes_per_rank", "optim_state_bytes_ranks",
              "state_ratio_vs_decentpy", "peak_rss_mib", "peak_rss_vs_decentpy_mib", "intra_bytes_per_step",
              "inter_bytes_per_step", "intra_bytes_mean", "inter_bytes_mean", "intra_bytes_ranks",
              "inter_bytes_ranks", "inter_ratio_vs_decentpy",
              "reference", "speedup_vs_reference", "cpu", "cores", "torch"]


def write_csv(path: Path, rows: List[Dict[str, Any]], machine: Dict[str, str]) -> None:
    def row(r: Dict[str, Any]) -> Dict[str, Any]:
        c = r["cfg"]
        pipe = c.framework in PIPES

        def f6(v: Optional[float]) -> str:
            return cell(v, ".6g")

        return dict(
            framework=c.framework, topology=c.topology, setup=SETUP[c.framework], workers=c.workers,
            local_world_size=LOCAL, nodes=WORLD // LOCAL, model=c.model,
            intra_node="shard" if "shard" in c.framework else "",
            step_time_s=f6(r["step"]), step_time_p25_s=f6(r["p25"]), step_time_p75_s=f6(r["p75"]),
            # empty for the pipelines: tools/runtime_model/fit.py then skips them (it models data parallelism only)
            compute_time_s="" if pipe else f6(r["compute"]), timed_steps=r["steps"],
            bytes_per_step=f"{max(a + b for a, b in zip(r['intra_ranks'], r['inter_ranks'])):.0f}",
            model_bytes=r["model_bytes"], optim_state_bytes_per_rank=r["state"],
            optim_state_bytes_ranks=";".join(map(str, r["state_ranks"])),
            state_ratio_vs_decentpy=f6(r["state_vs_dp"]), peak_rss_mib=f"{r['peak_rss'] / 2**20:.1f}",
            peak_rss_vs_decentpy_mib="" if r["rss_vs_dp"] is None else f"{r['rss_vs_dp'] / 2**20:.2f}",
            intra_bytes_per_step=f"{r['intra']:.0f}", inter_bytes_per_step=f"{r['inter']:.0f}",
            intra_bytes_mean=f"{sum(r['intra_ranks']) / len(r['intra_ranks']):.0f}",
            inter_bytes_mean=f"{sum(r['inter_ranks']) / len(r['inter_ranks']):.0f}",
            intra_bytes_ranks=";".join(f"{b:.0f}" for b in r["intra_ranks"]),
            inter_bytes_ranks=";".join(f"{b:.0f}" for b in r["inter_ranks"]),
            inter_ratio_vs_decentpy=f6(r["inter_vs_dp"]), reference=r["ref"], speedup_vs_reference=f6(r["speedup"]),
            cpu=machine["cpu"], cores=machine["cores"], torch=machine["torch"])

    write_rows_csv(path, CSV_FIELDS, (row(r) for r in rows))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--model", default="mlp", choices=sorted(WIDTH), help="mlp: width 1024; mlp-small: 256")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {','.join(FRAMEWORKS)}")
    p.add_argument("--topologies", default=f"{BASE_TOPO},one-peer-exp", help="decentpy topologies (first: baseline)")
    add_run_args(p, rounds=6, chunk=4)
    add_link_args(p)
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: mlp-small, 2 warm-up steps, 1 round of 3 timed steps, no primer set-ups")
    args = p.parse_args(argv)
    if args.quick:
        args.model = "mlp-small"
        quick_timing(args, warmup=2)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    requested = csv_list(args.frameworks)
    check_choices(requested, FRAMEWORKS, "framework")
    machine = report_machine()
    t_start = time.perf_counter()
    topologies = csv_list(args.topologies)
    if "decentpy-shard" in requested and not has_intra_node():
        print("decentpy-shard: not available in this build (DecentralizedDataParallel.__init__ has no intra_node "
              "parameter): no sharded-gossip row, its targets are not checked")
        requested = [f for f in requested if f != "decentpy-shard"]
    cfgs: List[Config] = []
    for fw in requested:
        if fw == "decentpy":
            cfgs += [Config(fw, t, WORLD, args.model) for t in topologies]
        elif fw in GOSSIP:
            cfgs.append(Config(fw, topologies[0], WORLD, args.model))
        else:
            cfgs.append(Config(fw, TOPO_OF[fw], WORLD, args.model))
    print(f"layout: {WORLD} gloo workers on 127.0.0.1 (1 torch thread each) as G = {WORLD // LOCAL} nodes x "
          f"L = {LOCAL} local ranks (node = rank // {LOCAL}, simulated with local_world_size={LOCAL}); pipelines: "
          f"{STAGES} stages x {REPLICAS} replicas, replica r = ranks {STAGES}r..{STAGES}r+{STAGES - 1} (a pipeline "
          "inside a node, a stage's replicas across the nodes)")
    print(f"optimizer: AdamW(lr={LR}) everywhere (decentpy fuses it into its mix-and-step kernel)")
    print(f"model {args.model}: {model_desc(args.model)}")
    print(f"timing: {args.warmup} warm-up steps per set-up, then {args.rounds} interleaved rounds x ({args.rewarm} "
          f"untimed + {args.chunk} timed) steps = {args.rounds * args.chunk} timed steps; per step the max over ranks; "
          "median")
    plan = dict(configs=[asdict(c) for c in cfgs], warmup=args.warmup, rounds=args.rounds, chunk=args.chunk,
                rewarm=args.rewarm, seed=args.seed, primer=not args.quick)
    print(f"[{WORLD} workers] {len(cfgs)} set-ups ({', '.join(_label(c) for c in cfgs)}) ...", flush=True)
    t0 = time.perf_counter()
    net = open_network(args, WORLD)  # None: loopback; else the --link-mbit namespaces
    try:
        if net is not None:
            print(f"network: {net.describe()}", flush=True)
        raw = spawn_workers(_worker_body, WORLD, plan, args.timeout, pg_timeout_s=300.0, net=net)["results"]
    finally:
        if net is not None:
            net.close()
    print(f"[{WORLD} workers] done in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = summarize(raw)
    print()
    print_table(rows)
    print("\n" + BYTES)
    print_targets(check_targets(rows))
    csv_path = Path(args.out) / ("bench_hybrid.csv" if args.link_mbit is None
                                  else f"bench_hybrid_link{args.link_mbit:g}_{args.link_layout}.csv")
    write_csv(csv_path, rows, machine)
    print(f"\nwrote {csv_path} (total {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

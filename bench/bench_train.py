"""End-to-end training-step benchmark on CPU: decentpy vs decent-dp vs torch DDP vs no communication.

For 2, 4 and 8 gloo worker processes on 127.0.0.1 (one torch thread each) and every topology that
is valid at that size, it trains the same model on the same synthetic data (fixed seed, own data
per rank) with the same optimizer (torch.optim.AdamW, lr 1e-4, passed through ``optim_fn``; decentpy
fuses it into its mix-and-step kernel, decent-dp steps it as it is), and measures:

* the step time: wall time of forward + backward (+ ``optimizer.step()`` where the framework does
  not step inside backward), measured on every rank; per step the max over ranks; the median
  over >= 20 timed steps (plus the 25th/75th percentiles);
* memory per worker: the RSS high-water mark of the configuration and its extra memory over the
  no-communication floor (see ``MEMORY`` below);
* bytes sent per worker per step, from the topology (see ``BYTES`` below).

Frameworks: ``decentpy`` (this project), ``decent-dp`` (the reference package from PyPI, skipped
with a message when not installed), ``torch-ddp`` (``DistributedDataParallel``, topology column
``allreduce``), ``local`` (the floor: every worker trains alone with the same model and
optimizer, no collective; topology column ``none``) and ``local-fused`` (the same floor stepped by
decentpy's fused AdamW kernel, standalone; topology column ``none-fused``): decentpy runs that
kernel instead of torch's AdamW, so this is the floor its own overhead is measured against).

All configurations of one (workers, model) live in the same worker processes and are timed in
interleaved rounds (a few steps of each configuration in turn, order rotated each round), so a
slow phase of the shared machine hits every configuration alike.

Throttled links (``--link-mbit B [--link-layout per-worker|two-nodes]``, root only): the workers
run inside network namespaces (:mod:`bench.common.netlink`), every worker behind its own B Mbit/s
full-duplex NIC (``per-worker``) or two simulated nodes of n/2 workers joined by one B Mbit/s link
(``two-nodes``); the default frameworks then add torch DDP with its compression comm hooks
(``torch-ddp-fp16``, ``torch-ddp-bf16``: ``fp16_compress_hook`` / ``bf16_compress_hook``;
``torch-ddp-powersgd``: PowerSGD rank POWERSGD_RANK with error feedback), and the table reports each
configuration's compute-to-communication ratio (compute = the no-communication floor's step,
communication = step - compute).

Writes ``bench/out/bench_train.csv`` (throttled: ``bench_train_link<B>_<layout>.csv`` / ``.png``) (the columns ``python -m tools.runtime_model --calibrate`` reads,
plus more) and ``bench/out/bench_train.png``.

    python -m bench.bench_train                      # everything (~10 minutes on 2 cores)
    python -m bench.bench_train --quick --workers 2 --models mlp --frameworks decentpy,local
    python -m bench.bench_train --workers 4 --models mlp --frameworks decentpy --peer-check   # the check's cost
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import add_link_args, add_run_args, bench_parser, open_network, quick_timing, spawn_workers
from bench.common.machine import report_machine
from bench.common.measure import (AER_LOCAL, Config, Runner, gather_results, measure_and_time, prime, rss_bytes,
                                  timing_row, trim)
from bench.common.models import LR, MODEL_DESC, MODELS, adamw_fn
from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import cell, check_choices, csv_list, fmt, print_targets
from bench.common.tables import print_table as print_table_rows
from bench.common.tables import write_csv as write_rows_csv


FRAMEWORKS = ("decentpy", "decentpy-nocheck", "decentpy-int8", "decentpy-int4", "decentpy-bf16", "decent-dp", "torch-ddp", "torch-ddp-fp16",
              "torch-ddp-bf16", "torch-ddp-powersgd", "local", "local-fused")
COMPRESSED = {"decentpy-int8": "int8", "decentpy-int4": "int4", "decentpy-bf16": "bf16"}  # decentpy with compressed gossip
DECENTPY = ("decentpy", "decentpy-nocheck") + tuple(COMPRESSED)
NOCHECK = "decentpy-nocheck"  # decentpy with peer_check='off' (--peer-check: paired with decentpy's default)
LINK_FRAMEWORKS = tuple(f for f in FRAMEWORKS if f not in ("decentpy-bf16", "decentpy-int4"))  # the default on a throttled link
DEFAULT_FRAMEWORKS = ("decentpy", "decent-dp", "torch-ddp", "local", "local-fused")  # on loopback
DDP_HOOKS = ("torch-ddp-fp16", "torch-ddp-bf16", "torch-ddp-powersgd")  # DDP + a compression comm hook
DDPS = ("torch-ddp",) + DDP_HOOKS
POWERSGD_RANK = 4  # matrix_approximation_rank of PowerSGD (error feedback on, 2 warm-up steps of plain all-reduce)
FLOORS = ("local", "local-fused")
TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring")
SHORT_TOPO = {"complete": "complete", "ring": "ring", "one-peer-exp": "1-peer-exp",
              "alternating-exp-ring": "AER", "allreduce": "allreduce", "none": "none",
              "none-fused": "none(fused)"}


def short_topo(c: Config) -> str:
    """The table's topology label; alternating-exp-ring with its node size (``AER(L=4)``)."""
    label = SHORT_TOPO.get(c.topology, c.topology)
    return f"{label}(L={c.local_world_size})" if c.topology == "alternating-exp-ring" else label

BYTES = """\
bytes/step = bytes SENT per worker per step, averaged over one period of the schedule, max over
ranks (P = parameter bytes, m = size of the worker's group at that step):
  decentpy   m == 1: 0;  m == 2: P (peer exchange: send own bucket, receive the peer's);
             m > 2: 2(m-1)/m * P (in-place all-reduce of the group, ring algorithm)
  decentpy-int8 / -int4 / -bf16   m == 2: C, the compressed difference, C = P/4 + 4 ceil(P/1024)
             bytes (int8: a code per element and an fp32 scale per 256), P/8 + 4 ceil(P/1024)
             (int4: two codes per byte) or P/2 (bf16); m > 2: ~2(m-1)/m * C (a reduce-scatter and an
             all-gather of compressed chunks of whole scale blocks: decentpy.optim.compression.group_wire_bytes)
  decent-dp  m == 1: 0;  m >= 2: 2(m-1)/m * P (all-reduce on a per-edge group, pairs too: 1.0 P)
  torch-ddp  2(n-1)/n * P (ring all-reduce of the gradients); fp16/bf16 hooks: half of it;
             powersgd: 2(n-1)/n * (sum over matrices (rows + cols) * rank * 4 + vector bytes)
  local, local-fused   0"""

MEMORY = """\
memory per worker (max over ranks): before each configuration is built the process is trimmed
(gc, malloc_trim) and its RSS high-water mark reset (/proc/self/clear_refs = 5);
  peak RSS   = worker baseline RSS (torch + gloo initialised, before any configuration)
               + (VmHWM after setup and warm-up steps - RSS before the model was built);
               i.e. the peak a process running only this configuration would reach
  extra      = peak RSS of the configuration minus that of the local floor (which holds the
               model, its gradients, the AdamW state and the activations): the framework's own
               memory (buffers, process groups), to compare with one copy of the parameters P;
               the CSV also has extra_steady_rss_mib (live RSS after warm-up and malloc_trim
               instead of the peak; the floors free their gradients between steps, decentpy
               keeps them in its gradient block, so its steady target credits one P back).
               A throw-away configuration of each framework is built and stepped first, so
               one-time process costs are in the baseline, not in the first configuration."""


# ----------------------------------------------------------------------------------------------
# configurations
# ----------------------------------------------------------------------------------------------


def _decent_dp_accepts(topo: str, n: int, local: int) -> bool:
    """decent-dp 0.2.3's rules: even rings, powers of two (of nodes for alternating-exp-ring)."""
    if topo == "ring":
        return n % 2 == 0
    size = n // local if topo == "alternating-exp-ring" else n
    return topo == "complete" or size & (size - 1) == 0


def topology_valid(topo: str, n: int, framework: str = "decentpy", node_size: Optional[int] = None) -> bool:
    """Whether ``framework`` runs ``topo`` on n workers: decentpy takes any n its topology module
    accepts, decent-dp fewer (_decent_dp_accepts)."""
    from decentpy import make_topology

    local = (node_size or AER_LOCAL) if topo == "alternating-exp-ring" else n
    if framework == "decent-dp" and n > 1 and not _decent_dp_accepts(topo, n, local):
        return False
    try:
        make_topology(topo, n, local)
        return True
    except ValueError:
        return False


def build_configs(workers: Sequence[int], models: Sequence[str], frameworks: Sequence[str],
                  topologies: Sequence[str], two_nodes: bool = False) -> List[Config]:
    """Every configuration; ``two_nodes``: alternating-exp-ring's nodes are the two simulated
    nodes of n/2 workers (the two-nodes link layout)."""
    out = []
    for n in workers:
        for model in models:
            for fw in frameworks:
                if fw in DECENTPY or fw == "decent-dp":
                    out += [Config(fw, t, n, model, n // 2 if two_nodes and t == "alternating-exp-ring" else 0)
                            for t in topologies if topology_valid(t, n, fw, n // 2 if two_nodes else None)]
                elif fw in DDPS:
                    out.append(Config(fw, "allreduce", n, model))
                elif fw == "local":
                    out.append(Config(fw, "none", n, model))
                elif fw == "local-fused":
                    out.append(Config(fw, "none-fused", n, model))
                else:
                    raise ValueError(f"unknown framework {fw!r} (choose from {', '.join(FRAMEWORKS)})")
    return out


def powersgd_bytes(model: str, rank: int = POWERSGD_RANK) -> float:
    """Bytes PowerSGD all-reduces per step for ``model``: its low-rank factors P (rows x rank) and Q
    (cols x rank) of each matrix-shaped gradient, the vectors (biases, norms) uncompressed."""
    from bench.common.models import make_model

    tot = 0.0
    for p in make_model(model, 0).parameters():
        if p.dim() <= 1:
            tot += p.numel() * 4
        else:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            r = min(rank, rows, cols)
            tot += (rows + cols) * r * 4
    return tot


def bytes_per_step(cfg: Config, param_bytes: int) -> float:
    """Bytes sent per worker per step (see BYTES)."""
    n, p = cfg.workers, float(param_bytes)
    if cfg.framework in FLOORS or n == 1:
        return 0.0
    if cfg.framework == "torch-ddp":
        return 2.0 * (n - 1) / n * p
    if cfg.framework in ("torch-ddp-fp16", "torch-ddp-bf16"):
        return (n - 1) / n * p
    if cfg.framework == "torch-ddp-powersgd":
        return 2.0 * (n - 1) / n * powersgd_bytes(cfg.model)
    from decentpy import make_topology
    from decentpy.optim.compression import group_wire_bytes, wire_bytes

    topo = make_topology(cfg.topology, n, cfg.local_world_size)
    kind = COMPRESSED.get(cfg.framework)
    wire = float(wire_bytes(kind, int(p) // 4)) if kind else 0.0
    worst = 0.0
    for r in range(n):
        tot = 0.0
        for k in range(topo.period):
            m = len(topo.group_of(r, k).ranks)
            if m == 1:
                continue
            if kind:
                g = topo.group_of(r, k).ranks
                tot += wire if m == 2 else group_wire_bytes(kind, int(p) // 4, m, list(g).index(r))
            elif m == 2 and cfg.framework in ("decentpy", NOCHECK):
                tot += p
            else:
                tot += 2.0 * (m - 1) / m * p
        worst = max(worst, tot / topo.period)
    return worst


# ----------------------------------------------------------------------------------------------
# worker side
# ----------------------------------------------------------------------------------------------


class TrainRunner(Runner):
    """A configuration of this benchmark: decentpy, decent-dp, torch DDP or a floor."""

    def build(self, model: Any) -> None:
        """Wrap ``model`` for ``self.cfg.framework``: set ``self.net`` and ``self.opt`` (None when the
        wrapper steps inside backward)."""
        import torch

        cfg = self.cfg
        if cfg.framework in DECENTPY:
            from decentpy import DecentralizedDataParallel

            self.net = DecentralizedDataParallel(model, optim_fn=adamw_fn, topology=cfg.topology,
                                                 local_world_size=cfg.local_world_size,
                                                 compression=COMPRESSED.get(cfg.framework),
                                                 **({"peer_check": "off"} if cfg.framework == NOCHECK else {}))
        elif cfg.framework == "decent-dp":
            from decent_dp.ddp import DecentralizedDataParallel as RefDDP

            self.net = RefDDP(model, optim_fn=adamw_fn, topology=cfg.topology,
                              _local_world_size=cfg.local_world_size)
        elif cfg.framework in DDPS:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
            from torch.nn.parallel import DistributedDataParallel

            # PowerSGD's hook chains all-reduces in future callbacks; with several buckets on gloo their
            # order differs between ranks (seen here: "Received data size doesn't match expected size",
            # a crash; pytorch/pytorch#58467): one bucket keeps its collectives in one order.
            one_bucket = {"bucket_cap_mb": 1024} if cfg.framework == "torch-ddp-powersgd" else {}
            self.net = DistributedDataParallel(model, **one_bucket)
            if cfg.framework == "torch-ddp-fp16":
                self.net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif cfg.framework == "torch-ddp-bf16":
                self.net.register_comm_hook(None, default_hooks.bf16_compress_hook)
            elif cfg.framework == "torch-ddp-powersgd":
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                    start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
                self.net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR)
        elif cfg.framework == "local-fused":
            import decentpy.optim

            self.net = model
            self.opt = decentpy.optim.AdamW(model.parameters(), lr=LR)
        else:
            self.net = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)


    def extra_figures(self) -> Dict[str, float]:
        """decentpy's peer check: its host CPU time per step over this configuration's steps (timed and
        untimed alike), in ms."""
        if self.cfg.framework != "decentpy":
            return {}
        stats = self.net.stats()
        return {"peer_check_ms": 1e3 * stats.get("peer_check_cpu_s", 0.0) / max(1, stats["steps"]),
                "peer_checks_failed": float(stats.get("peer_checks_failed", 0))}


def _worker_body(rank: int, n: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    try:
        from loguru import logger as _loguru  # decent-dp logs every step at INFO

        _loguru.remove()
        _loguru.add(sys.stderr, level="WARNING")
    except ImportError:
        pass
    import decentpy  # noqa: F401  (imported before the baseline is taken)

    if any(c["framework"] == "decent-dp" for c in plan["configs"]):
        import decent_dp.ddp  # noqa: F401
    dist.barrier()
    base_rss: Optional[int] = None
    results = []
    for model in plan["models"]:
        cfgs = [Config(**c) for c in plan["configs"] if c["model"] == model]
        if not cfgs:
            continue
        prime(cfgs, rank, plan, TrainRunner)
        if model == plan["models"][0] or base_rss is None:
            base_rss = rss_bytes()
        runners, mems = measure_and_time(cfgs, rank, plan, TrainRunner)
        results += gather_results(runners, mems, base_rss, rank, n)
        for r in runners:
            r.finish()
        del runners
        trim()
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    allru: List[Any] = [None] * n
    dist.all_gather_object(allru, ru)
    return dict(results=results, ru_maxrss=max(allru))


def run_group(n: int, plan: Dict[str, Any], timeout_s: float, net: Any = None) -> Dict[str, Any]:
    """Spawn ``n`` workers running ``plan`` (inside ``net``'s namespaces, if given); rank 0's results,
    or raise with every traceback."""
    return spawn_workers(_worker_body, n, plan, timeout_s, pg_timeout_s=plan["pg_timeout_s"], net=net)


# ----------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------


def period_of(cfg: Config) -> int:
    """Steps after which ``cfg``'s exchange pattern repeats (1 for all-reduce and the floors)."""
    if (cfg.framework not in DECENTPY and cfg.framework != "decent-dp") or cfg.workers == 1:
        return 1
    from decentpy import make_topology

    return make_topology(cfg.topology, cfg.workers, cfg.local_world_size).period


def per_period(res: Dict[str, Any], chunk: int) -> Dict[str, Any]:
    """``res`` with each timed chunk's steps replaced by the means of its whole periods: on a slow
    link a ring alternates fast (inside a node) and slow (across) steps, whose median would be
    either kind; the median of period means is the typical step. Unchanged when the chunk is not
    a multiple of the period."""
    p = period_of(Config(**res["cfg"]))
    if p == 1 or chunk % p:
        return res
    out = dict(res)
    for key in ("step_max", "compute_max", "cpu_sum"):
        xs = res[key]
        out[key] = [sum(xs[i:i + p]) / p for i in range(0, len(xs) - p + 1, p)]
    return out


def summarize(raw: List[Dict[str, Any]], chunk: int = 0) -> List[Dict[str, Any]]:
    """Report rows; ``chunk`` (throttled links): steps averaged over each period first (per_period)."""
    rows = []
    for res in raw:
        row = timing_row(per_period(res, chunk) if chunk else res)
        rows.append(dict(row, steady_delta=res["steady_delta"], peak_delta=res["peak_delta"],
                         wrap_delta=res["wrap_delta"], bytes=bytes_per_step(row["cfg"], res["param_bytes"]),
                         figures=res.get("extra", {})))
    by = {(r["cfg"].model, r["cfg"].workers, r["cfg"].framework, r["cfg"].topology): r for r in rows}
    for r in rows:
        c = r["cfg"]
        floor = by.get((c.model, c.workers, "local", "none"))
        ffloor = by.get((c.model, c.workers, "local-fused", "none-fused"))
        ddp = by.get((c.model, c.workers, "torch-ddp", "allreduce"))
        psgd = by.get((c.model, c.workers, "torch-ddp-powersgd", "allreduce"))
        ref = by.get((c.model, c.workers, "decent-dp", c.topology))
        r["floor_compute"] = floor["compute"] if floor else (ffloor["compute"] if ffloor else None)
        r["vs_floor"] = r["step"] / floor["step"] if floor else None
        r["vs_ffloor"] = r["step"] / ffloor["step"] if ffloor else None
        r["vs_ddp"] = ddp["step"] / r["step"] if ddp else None  # > 1: faster than DDP
        r["vs_powersgd"] = psgd["step"] / r["step"] if psgd else None  # > 1: faster than DDP + PowerSGD
        r["vs_ref"] = ref["step"] / r["step"] if ref else None  # > 1: faster than decent-dp
        r["cpu_vs_ref"] = ref["cpu"] / r["cpu"] if ref else None  # > 1: less CPU per step than decent-dp
        r["cpu_vs_floor"] = r["cpu"] / floor["cpu"] if floor else None
        mfloor = floor or ffloor
        r["extra"] = r["peak_delta"] - mfloor["peak_delta"] if mfloor else None
        r["extra_steady"] = r["steady_delta"] - mfloor["steady_delta"] if mfloor else None
        # compute-to-communication: compute = the floor's step (no communication), communication =
        # what the configuration adds to it
        r["comm"] = max(0.0, r["step"] - floor["step"]) if floor else None
        r["comp_comm"] = floor["step"] / r["comm"] if floor and r["comm"] else None
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    torder = {t: i for i, t in enumerate(TOPOLOGIES + ("allreduce", "none", "none-fused"))}
    rows.sort(key=lambda r: (MODELS.index(r["cfg"].model), r["cfg"].workers, order[r["cfg"].framework],
                             torder[r["cfg"].topology]))
    return rows


def print_table(rows: List[Dict[str, Any]], link: bool = False) -> None:
    hdr = ["model", "n", "framework", "topology", "median ms", "p25-p75 ms", "steps",
           "dp-ref/this", "DDP/this", "this/floor", "this/ffloor", "CPU ms", "CPU dp-ref/this", "peak RSS MiB",
           "extra MiB", "P MiB", "MB/step"]
    if link:
        hdr += ["comm ms", "compute/comm"]
    table = []
    for r in rows:
        c = r["cfg"]
        extra = [fmt(None if r["comm"] is None else r["comm"] * 1e3, ".0f"), fmt(r["comp_comm"], ".2f")] if link else []
        table.append([c.model, str(c.workers), c.framework, short_topo(c),
                      f"{r['step'] * 1e3:.2f}", f"{r['p25'] * 1e3:.1f}-{r['p75'] * 1e3:.1f}",
                      str(r["steps"]),
                      fmt(r["vs_ref"], ".2f", "x") if c.framework in DECENTPY else "",
                      fmt(r["vs_ddp"], ".2f", "x") if c.framework != "torch-ddp" else "",
                      fmt(r["vs_floor"], ".2f", "x"), fmt(r["vs_ffloor"], ".2f", "x"),
                      f"{r['cpu'] * 1e3:.1f}", fmt(r["cpu_vs_ref"], ".2f", "x") if c.framework in DECENTPY else "",
                      f"{r['peak_rss'] / 2**20:.0f}", fmt(None if r["extra"] is None else r["extra"] / 2**20,
                                                          "+.1f"),
                      f"{r['param_bytes'] / 2**20:.2f}", f"{r['bytes'] / 1e6:.2f}"] + extra)
    print_table_rows(hdr, table, group=lambda t: (t[0], t[1]))
    print("dp-ref/this = decent-dp step time / this (>1: faster than decent-dp, same topology); "
          "DDP/this = torch DDP / this (>1: faster than DDP);\nthis/floor = this / no-communication "
          "floor with torch AdamW (1.00 = no overhead); this/ffloor = this / no-communication floor "
          "with decentpy's fused AdamW\n(decentpy.optim.AdamW, standalone step: the same kernel decentpy "
          "runs, without the mixing); extra = peak RSS minus the torch-AdamW floor's;\nCPU ms = CPU time of one "
          "step summed over the workers (all threads; median over steps): the cost to the machine, robust to other "
          "load, where wall times on an oversubscribed machine are not; CPU dp-ref/this = decent-dp's / this")
    if link:
        print("comm ms = step - the no-communication floor's step (same n): the time communication adds; "
              "compute/comm = floor step / comm ms (the compute-to-communication ratio; < 1: communication-bound)")


def _target(title: str, rows: List[Dict[str, Any]], met: Any, score: Any, fmt: Any,
            higher_is_better: bool) -> Tuple[str, bool, str]:
    """One target line: how many configurations meet it, the worst one, and every miss."""
    bad = [r for r in rows if not met(r)]
    worst = (min if higher_is_better else max)(rows, key=score)
    detail = (f"{len(rows) - len(bad)}/{len(rows)} met; worst {fmt(worst)} "
              f"({worst['cfg'].model}, n={worst['cfg'].workers}, {worst['cfg'].topology})")
    if bad:
        detail += "; missed: " + ", ".join(
            f"{r['cfg'].model}/n={r['cfg'].workers}/{short_topo(r['cfg'])} {fmt(r)}" for r in bad)
    return title, not bad, detail


def compression_targets(rows: List[Dict[str, Any]], link: Optional[str]) -> List[Tuple[str, bool, str]]:
    """Issue 24's compressed-gossip targets: bytes per step against uncompressed gossip on the same
    topology (int8 <= 0.27x, bf16 <= 0.5x); on a link, alternating-exp-ring >= 1.5x faster than DDP
    uncompressed, and with int8 >= 2.5x faster than DDP and >= 1.3x faster than DDP + PowerSGD."""
    out = []
    by = {(r["cfg"].model, r["cfg"].workers, r["cfg"].framework, r["cfg"].topology): r for r in rows}
    for fw, limit in (("decentpy-int8", 0.27), ("decentpy-int4", 0.14), ("decentpy-bf16", 0.5)):
        pairs = [(r, by.get((r["cfg"].model, r["cfg"].workers, "decentpy", r["cfg"].topology)))
                 for r in rows if r["cfg"].framework == fw]
        pairs = [(r, u) for r, u in pairs if u is not None and u["bytes"] > 0]
        for r, u in pairs:
            r["bytes_vs_fp32"] = r["bytes"] / u["bytes"]
        if pairs:
            out.append(_target(f"{fw} moves <= {limit}x the bytes per step of uncompressed gossip (same topology)",
                               [r for r, _ in pairs], lambda r, lim=limit: r["bytes_vs_fp32"] <= lim + 1e-9,
                               lambda r: r["bytes_vs_fp32"], lambda r: f"{r['bytes_vs_fp32']:.3f}x",
                               higher_is_better=False))
    if link is None:
        return out
    aer = [r for r in rows if r["cfg"].topology == "alternating-exp-ring" and r["vs_ddp"] is not None]
    for fw, want in (("decentpy", 1.5), ("decentpy-int8", 2.5)):
        t = [r for r in aer if r["cfg"].framework == fw]
        if t:
            out.append(_target(f"{link}: {fw} alternating-exp-ring >= {want}x faster per step than torch DDP", t,
                               lambda r, w=want: r["vs_ddp"] >= w, lambda r: r["vs_ddp"],
                               lambda r: f"DDP/this {r['vs_ddp']:.2f}x", higher_is_better=True))
    t = [r for r in aer if r["cfg"].framework == "decentpy-int8" and r["vs_powersgd"] is not None]
    if t:
        out.append(_target(f"{link}: decentpy-int8 alternating-exp-ring >= 1.3x faster per step than DDP + PowerSGD",
                           t, lambda r: r["vs_powersgd"] >= 1.3, lambda r: r["vs_powersgd"],
                           lambda r: f"PowerSGD/this {r['vs_powersgd']:.2f}x", higher_is_better=True))
    return out


#: the peer check may cost at most this fraction of a step (issue 52)
PEER_CHECK_BUDGET = 0.03


def peer_check_cost(rows: List[Dict[str, Any]]) -> List[Tuple[str, bool, str]]:
    """``--peer-check``: decentpy's default (the peer check on) against ``peer_check='off'`` in the same
    workers, interleaved: per topology the two median steps, their ratio and the CPU time per step;
    the target line: the check within PEER_CHECK_BUDGET of a step everywhere."""
    by = {(r["cfg"].model, r["cfg"].workers, r["cfg"].framework, r["cfg"].topology): r for r in rows}
    pairs = []
    for r in rows:
        c = r["cfg"]
        off = by.get((c.model, c.workers, NOCHECK, c.topology))
        if c.framework == "decentpy" and off is not None:
            r["check_cost"] = r["step"] / off["step"] - 1.0
            r["check_cpu_cost"] = r["cpu"] / off["cpu"] - 1.0
            pairs.append((r, off))
    if not pairs:
        return []
    print("\npeer check (decentpy default: PeerCheck('skip', bound=10, window=16)) against peer_check='off', "
          "interleaved in the same workers:")
    hdr = ["model", "n", "topology", "check ms", "off ms", "step ratio", "check CPU ms", "off CPU ms", "CPU ratio",
           "check's own ms", "of a worker's CPU", "flagged"]
    table = []
    for r, off in pairs:
        own = r["figures"].get("peer_check_ms")
        per_worker = r["cpu"] / r["cfg"].workers
        r["check_share"] = own / (per_worker * 1e3) if own is not None else None
        table.append([r["cfg"].model, str(r["cfg"].workers), short_topo(r["cfg"]), f"{r['step'] * 1e3:.2f}",
                      f"{off['step'] * 1e3:.2f}", f"{r['step'] / off['step']:.4f}", f"{r['cpu'] * 1e3:.1f}",
                      f"{off['cpu'] * 1e3:.1f}", f"{r['cpu'] / off['cpu']:.4f}", fmt(own, ".3f"),
                      fmt(r["check_share"], ".2%"), fmt(r["figures"].get("peer_checks_failed"), ".0f")])
    print_table_rows(hdr, table, group=lambda t: (t[0], t[1]))
    print("step / CPU ratio: decentpy's median step (wall; CPU summed over the workers) over peer_check='off''s; "
          "check's own ms: the host CPU the check took per step on a worker (its passes and verdicts, max over the "
          "workers: stats()['peer_check_cpu_s']), and its share of a worker's CPU per step (the ratio of two noisy "
          "medians cannot resolve a few percent on a loaded machine; this share can); flagged: contributions the "
          "check failed (max over the workers; honest training: 0)")
    out = [_target(f"the peer check costs <= {PEER_CHECK_BUDGET:.0%} of a step (median step, check / off - 1)",
                   [r for r, _ in pairs], lambda r: r["check_cost"] <= PEER_CHECK_BUDGET, lambda r: r["check_cost"],
                   lambda r: f"{r['check_cost']:+.2%} (CPU {r['check_cpu_cost']:+.2%})", higher_is_better=False)]
    shares = [r for r, _ in pairs if r.get("check_share") is not None]
    if shares:
        out.append(_target(f"the peer check's own CPU <= {PEER_CHECK_BUDGET:.0%} of a worker's CPU per step", shares,
                           lambda r: r["check_share"] <= PEER_CHECK_BUDGET, lambda r: r["check_share"],
                           lambda r: f"{r['check_share']:.2%}", higher_is_better=False))
    return out


def check_targets(rows: List[Dict[str, Any]], link: Optional[str] = None) -> List[Tuple[str, bool, str]]:
    out = []
    dp = [r for r in rows if r["cfg"].framework == "decentpy"]
    if link is not None:  # the throttled-link targets (issue 24) replace the loopback ones
        t1 = [r for r in dp if r["vs_ref"] is not None]
        if t1:
            out.append(_target(f"{link}: decentpy >= 1.2x faster per step than decent-dp on every topology", t1,
                               lambda r: r["vs_ref"] >= 1.2, lambda r: r["vs_ref"],
                               lambda r: f"{r['vs_ref']:.2f}x", higher_is_better=True))
        t2 = [r for r in dp if r["vs_ddp"] is not None]
        if t2:
            out.append(_target(f"{link}: decentpy >= 1.2x faster per step than torch DDP on every topology", t2,
                               lambda r: r["vs_ddp"] >= 1.2, lambda r: r["vs_ddp"],
                               lambda r: f"DDP/decentpy {r['vs_ddp']:.2f}x", higher_is_better=True))
        out += compression_targets(rows, link)
        return out
    out += compression_targets(rows, None)
    t1 = [r for r in dp if r["cfg"].workers in (4, 8) and r["vs_ref"] is not None]
    if t1:
        out.append(_target("decentpy >= 1.3x faster per step than decent-dp on every topology at 4 and 8 workers",
                           t1, lambda r: r["vs_ref"] >= 1.3, lambda r: r["vs_ref"],
                           lambda r: f"{r['vs_ref']:.2f}x", higher_is_better=True))
    t2 = [r for r in dp if r["vs_ddp"] is not None]
    if t2:
        out.append(_target("decentpy faster than torch DDP (every topology and size)",
                           t2, lambda r: r["vs_ddp"] > 1.0, lambda r: r["vs_ddp"],
                           lambda r: f"DDP/decentpy {r['vs_ddp']:.2f}x", higher_is_better=True))
    for key, label in (("vs_floor", "the torch-AdamW floor: same model, data, batch and optimizer, no communication"),
                       ("vs_ffloor", "the stricter fused-AdamW floor: decentpy's own kernel, no communication")):
        t3 = [r for r in dp if r[key] is not None]
        if t3:
            out.append(_target(f"decentpy within 1.15x of {label}", t3,
                               lambda r, k=key: r[k] <= 1.15, lambda r, k=key: r[k],
                               lambda r, k=key: f"{r[k]:.2f}x", higher_is_better=False))

    def mib(extra_key: str) -> Any:
        return lambda r: f"extra {r[extra_key] / 2**20:+.1f} MiB vs P = {r['param_bytes'] / 2**20:.2f} MiB"

    t5 = [r for r in dp if r["extra_steady"] is not None]
    if t5:
        # The floor's optimizer.zero_grad() frees its gradients (set_to_none) between steps, so its
        # live memory lacks one P that decentpy keeps in the gradient block: credit it back.
        for r in t5:
            r["extra_steady_vs_grads"] = r["extra_steady"] - r["param_bytes"]
        out.append(_target("decentpy extra steady (live, after warm-up) memory per worker <= one copy of the "
                           "parameters, against the floor with its gradients (+1 MiB tolerance)", t5,
                           lambda r: r["extra_steady_vs_grads"] <= r["param_bytes"] + 2**20,
                           lambda r: r["extra_steady_vs_grads"] - r["param_bytes"],
                           mib("extra_steady_vs_grads"), higher_is_better=False))
    t4 = [r for r in dp if r["extra"] is not None]
    if t4:
        # tolerance: 1 MiB of RSS noise (page granularity, allocator, gloo threads)
        out.append(_target("decentpy extra peak memory per worker <= one copy of the parameters (beyond model, "
                           "grads and optimizer state, i.e. the local floor; +1 MiB tolerance)", t4,
                           lambda r: r["extra"] <= r["param_bytes"] + 2**20,
                           lambda r: r["extra"] - r["param_bytes"], mib("extra"), higher_is_better=False))
    return out


CSV_FIELDS = ["framework", "topology", "workers", "model", "step_time_s", "bytes_per_step", "compute_time_s",
              "model_bytes", "local_world_size", "step_time_p25_s", "step_time_p75_s", "timed_steps",
              "own_compute_time_s", "peak_rss_mib", "extra_rss_mib", "extra_steady_rss_mib", "wrap_rss_mib",
              "speedup_vs_decent_dp", "speedup_vs_ddp", "ratio_vs_floor", "ratio_vs_fused_floor", "cpu_time_s",
              "cpu_speedup_vs_decent_dp", "cpu_ratio_vs_floor", "comm_time_s", "compute_to_comm", "link_mbit",
              "link_layout", "cpu", "cores", "torch"]


def write_csv(path: Path, rows: List[Dict[str, Any]], machine: Dict[str, str], link_mbit: Optional[float] = None,
              link_layout: str = "") -> None:
    def row(r: Dict[str, Any]) -> Dict[str, Any]:
        c = r["cfg"]
        return dict(
            framework=c.framework, topology=c.topology, workers=c.workers, model=c.model,
            step_time_s=f"{r['step']:.6g}", bytes_per_step=f"{r['bytes']:.0f}",
            # forward+backward of the local floor (same n): the compute of one iteration
            compute_time_s=f"{(r['floor_compute'] if r['floor_compute'] is not None else r['compute']):.6g}",
            model_bytes=r["param_bytes"], local_world_size=c.local_world_size,
            step_time_p25_s=f"{r['p25']:.6g}", step_time_p75_s=f"{r['p75']:.6g}", timed_steps=r["steps"],
            own_compute_time_s=f"{r['compute']:.6g}", peak_rss_mib=f"{r['peak_rss'] / 2**20:.1f}",
            extra_rss_mib="" if r["extra"] is None else f"{r['extra'] / 2**20:.2f}",
            extra_steady_rss_mib="" if r["extra_steady"] is None else f"{r['extra_steady'] / 2**20:.2f}",
            wrap_rss_mib=f"{r['wrap_delta'] / 2**20:.2f}",
            speedup_vs_decent_dp=cell(r["vs_ref"], ".4f"), speedup_vs_ddp=cell(r["vs_ddp"], ".4f"),
            ratio_vs_floor=cell(r["vs_floor"], ".4f"), ratio_vs_fused_floor=cell(r["vs_ffloor"], ".4f"),
            cpu_time_s=f"{r['cpu']:.6g}", cpu_speedup_vs_decent_dp=cell(r["cpu_vs_ref"], ".4f"),
            cpu_ratio_vs_floor=cell(r["cpu_vs_floor"], ".4f"), comm_time_s=cell(r["comm"], ".6g"),
            compute_to_comm=cell(r["comp_comm"], ".4f"), link_mbit=cell(link_mbit, "g"),
            link_layout=link_layout if link_mbit is not None else "", cpu=machine["cpu"], cores=machine["cores"], torch=machine["torch"])

    write_rows_csv(path, CSV_FIELDS, (row(r) for r in rows))


def plot(path: Path, rows: List[Dict[str, Any]], machine: Dict[str, str], link: str = "") -> Optional[Path]:
    """Step time per configuration: a panel per model, bars per framework (whiskers p25-p75)."""
    plt = pyplot()
    if plt is None:
        return None
    models = [m for m in MODELS if any(r["cfg"].model == m for r in rows)]
    colors = {"decentpy": "#1f77b4", NOCHECK: "#9ecae1", "decentpy-int8": "#aec7e8", "decentpy-int4": "#c6dbef", "decentpy-bf16": "#6baed6", "decent-dp": "#ff7f0e", "torch-ddp": "#2ca02c", "torch-ddp-fp16": "#98df8a",
              "torch-ddp-bf16": "#17becf", "torch-ddp-powersgd": "#9467bd", "local": "#7f7f7f",
              "local-fused": "#bcbd22"}
    fig, axes = plt.subplots(len(models), 1, figsize=(13, 4.2 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mrows = [r for r in rows if r["cfg"].model == model]
        groups: List[Tuple[int, str]] = []
        for r in mrows:
            key = (r["cfg"].workers, r["cfg"].topology)
            if key not in groups:
                groups.append(key)
        fws = [f for f in FRAMEWORKS if any(r["cfg"].framework == f for r in mrows)]
        width = 0.8 / max(1, len(fws))
        for j, fw in enumerate(fws):
            xs, ys, lo, hi = [], [], [], []
            for gi, (n, topo) in enumerate(groups):
                for r in mrows:
                    c = r["cfg"]
                    if c.framework == fw and c.workers == n and c.topology == topo:
                        xs.append(gi + (j - (len(fws) - 1) / 2) * width)
                        ys.append(r["step"] * 1e3)
                        lo.append((r["step"] - r["p25"]) * 1e3)
                        hi.append((r["p75"] - r["step"]) * 1e3)
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[fw], label=fw)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"n={n}\n{SHORT_TOPO.get(t, t)}" for n, t in groups], fontsize=7)
        finish_axes(ax, "median step time (ms)", f"{model}: {MODEL_DESC[model]}", grid_axis="y")
    return finish_figure(fig, f"step time per configuration (bars: median, whiskers: p25-p75){link}, {machine['cpu']}, "
                         f"{machine['cores']} cores, torch {machine['torch']}", path, fontsize=9)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--workers", default="2,4,8", help="comma-separated worker counts")
    p.add_argument("--models", default="mlp,cnn", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--frameworks", default=None,
                   help=f"comma-separated, from {','.join(FRAMEWORKS)} (decent-dp is skipped when not installed); "
                   f"default: {','.join(DEFAULT_FRAMEWORKS)}; with --link-mbit: {','.join(LINK_FRAMEWORKS)}")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES), help="comma-separated")
    p.add_argument("--peer-check", action="store_true",
                   help=f"also run decentpy with peer_check='off' ({NOCHECK}) in the same workers, interleaved with "
                   "decentpy's default check, and report the check's cost: the ratio of their median steps")
    add_run_args(p, rounds=4, chunk=8, plot=True)
    add_link_args(p)
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: 2 warm-up steps, 1 round of 3 timed steps, no primer "
                   "configurations (memory numbers less exact)")
    args = p.parse_args(argv)
    if args.quick:
        quick_timing(args, warmup=2)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workers = [int(w) for w in csv_list(args.workers)]
    models = csv_list(args.models)
    link = args.link_mbit is not None
    frameworks = csv_list(args.frameworks or ",".join(LINK_FRAMEWORKS if link else DEFAULT_FRAMEWORKS))
    check_choices(models, MODELS, "model")
    check_choices(frameworks, FRAMEWORKS, "framework")
    if args.peer_check and "decentpy" in frameworks and NOCHECK not in frameworks:
        frameworks.insert(frameworks.index("decentpy") + 1, NOCHECK)
    if "torch-ddp-bf16" in frameworks:  # torch refuses it on CPU: "requires CUDA 11+ and NCCL 2.10+"
        print("torch-ddp-bf16 skipped: torch's bf16_compress_hook needs NCCL (CUDA) or XCCL; these workers run gloo "
              "on CPU")
        frameworks = [f for f in frameworks if f != "torch-ddp-bf16"]
    if "decent-dp" in frameworks:
        try:
            import decent_dp.ddp  # noqa: F401
        except ImportError as exc:
            print(f"decent-dp skipped: `import decent_dp.ddp` failed ({exc}); "
                  "install it with `pip install --no-deps decent-dp==0.2.3 loguru` (or run `make deps`)")
            frameworks = [f for f in frameworks if f != "decent-dp"]
    machine = report_machine("decent-dp")
    where = "127.0.0.1"
    if link:
        where = (f"throttled links of {args.link_mbit:g} Mbit/s ({args.link_layout}: " +
                 ("one namespace and NIC per worker" if args.link_layout == "per-worker" else
                  "2 nodes of n/2 workers, fast inside a node") + ")")
    print(f"optimizer: torch.optim.AdamW(lr={LR}) everywhere (decentpy fuses it; decent-dp, DDP and the "
          f"floor run torch's default CPU implementation); gloo on {where}, 1 torch thread per worker")
    for m in models:
        print(f"model {m}: {MODEL_DESC[m]}")
    print(f"timing: {args.warmup} warm-up steps per configuration, then {args.rounds} interleaved rounds x "
          f"({args.rewarm} untimed + {args.chunk} timed) steps = {args.rounds * args.chunk} timed steps; per "
          "step the max over ranks; median" + (" of the means over each period of the topology's schedule"
                                               if link else ""))
    configs = build_configs(workers, models, frameworks, csv_list(args.topologies),
                            two_nodes=link and args.link_layout == "two-nodes")
    raw: List[Dict[str, Any]] = []
    ru_max = 0.0
    t_start = time.perf_counter()
    for n in workers:
        cfgs = [c for c in configs if c.workers == n]
        if not cfgs:
            continue
        t0 = time.perf_counter()
        print(f"[{n} workers] {len(cfgs)} configurations ...", flush=True)
        plan = dict(configs=[asdict(c) for c in cfgs], models=models, warmup=args.warmup, rounds=args.rounds,
                    chunk=args.chunk, rewarm=args.rewarm, seed=args.seed, pg_timeout_s=300,
                    primer=not args.quick)
        net = open_network(args, n)
        try:
            if net is not None:
                print(f"[{n} workers] network: {net.describe()}", flush=True)
            payload = run_group(n, plan, args.timeout, net)
        finally:
            if net is not None:
                net.close()
        raw += payload["results"]
        ru_max = max(ru_max, payload["ru_maxrss"])
        print(f"[{n} workers] done in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = summarize(raw, args.chunk if link else 0)
    print()
    print_table(rows, link)
    print()
    print(BYTES)
    print(MEMORY)
    print(f"process-wide ru_maxrss (max over all workers, all configurations of a worker alive together): "
          f"{ru_max / 2**20:.0f} MiB")
    link_label = f"{args.link_mbit:g} Mbit/s {args.link_layout} link" if link else None
    targets = check_targets(rows, link_label)
    if args.peer_check:
        targets += peer_check_cost(rows)
    print_targets(targets)
    out = Path(args.out)
    stem = f"bench_train_link{args.link_mbit:g}_{args.link_layout}" if link else "bench_train"  # not the calibration CSV
    csv_path = out / f"{stem}.csv"
    write_csv(csv_path, rows, machine, args.link_mbit, args.link_layout)
    png = None if args.no_plot else plot(out / f"{stem}.png", rows, machine,
                                         f", {link_label}" if link_label else "")
    print(f"\nwrote {csv_path}" + (f", {png}" if png else "") +
          f" (total {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibration of the runtime model's free parameters against measured step times.

Reads the CSVs of the end-to-end benchmarks (``bench/bench_train.py``, and the sharded-gossip
and HSDP rows of ``bench/bench_hybrid.py`` when it writes them) into :class:`Measurement` rows
and fits, on one machine (so the intra- and inter-node links are tied to one effective link),
the effective bandwidth, latency, kernel memory bandwidth and compute/communication overlap of
:class:`tools.runtime_model.model.Hardware` to them. The model itself lives in ``model.py``.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Sequence

import numpy as np
from scipy.optimize import OptimizeResult, minimize
from scipy.special import expit

from .model import (
    TOPOLOGIES,
    Hardware,
    Workload,
    ddp_iteration_time,
    decentralized_iteration_time,
    hsdp_iteration_time,
    sharded_gossip_iteration_time,
    sharded_topology_valid,
    topology_rows,
    topology_valid,
)

__all__ = [
    "Measurement",
    "load_measurements",
    "predict",
    "calibrate",
    "CalibrationResult",
]


@dataclass(frozen=True)
class Measurement:
    """One measured configuration of the end-to-end benchmark (one CSV row)."""

    framework: str  # 'ddp' (all-reduce), 'decentpy', 'decentpy-shard', 'hsdp', ...
    topology: str  # one of TOPOLOGIES, or 'allreduce' for DDP, 'hsdp' for HSDP
    workers: int
    model: str
    step_time_s: float
    model_bytes: float  # the full model's bytes, also for the sharded modes
    compute_time_s: float
    local: int
    sharded: bool = False  # sharded gossip (decentpy intra_node="shard") on ``topology``

    @property
    def kind(self) -> str:
        """Which model predicts it: 'allreduce', 'hsdp', 'shard' (sharded gossip), 'gossip'."""
        if self.topology in ("allreduce", "hsdp"):
            return self.topology
        return "shard" if self.sharded else "gossip"


def _is_allreduce(framework: str, topology: str) -> bool:
    """Whether a CSV row is an all-reduce (DDP) run; the benchmark names those several ways."""
    f, t = framework.strip().lower(), topology.strip().lower()
    if t in ("allreduce", "all-reduce", "ddp"):
        return True
    return ("ddp" in f or "allreduce" in f or "all-reduce" in f) and "decent" not in f


#: frameworks whose bytes are compressed (bench-train's decentpy-int8/-bf16, torch DDP's comm hooks):
#: not the fp32 buffers the model's communication terms are fitted on, so they are skipped
COMPRESSED_SUFFIXES = ("-int8", "-int4", "-bf16", "-fp16", "-powersgd")


def _row_kind(framework: str, topology: str, row: Dict[str, str]) -> str:
    """'allreduce', 'hsdp', 'shard', 'gossip', 'zero' (DDP + ZeroRedundancyOptimizer: not
    modelled, and not DDP: its step and parameter broadcast differ) or 'compressed' (compressed
    exchanges: skipped) for one CSV row."""
    f, t = framework.strip().lower(), topology.strip().lower()
    mode = ((row.get("intra_node") or "") + (row.get("mode") or "")).strip().lower()
    if "zero" in f:
        return "zero"
    if any(f.endswith(k) for k in COMPRESSED_SUFFIXES):
        return "compressed"
    if any(k in f or k in t for k in ("hsdp", "hybrid_shard", "hybrid-shard")):
        return "hsdp"
    if mode == "shard" or ("decent" in f and "shard" in f):
        return "shard"
    return "allreduce" if _is_allreduce(framework, topology) else "gossip"


def load_measurements(path: os.PathLike) -> List[Measurement]:
    """Read the end-to-end benchmark CSV.

    Columns: framework, topology, workers, model, step_time_s, bytes_per_step, compute_time_s;
    optional: local_world_size (default: all workers on one node, except alternating-exp-ring
    and the sharded modes, which need >= 2 nodes: L = 2 from 4 workers), model_bytes (overrides
    bytes_per_step), intra_node / mode ('shard': sharded gossip). ``bytes_per_step`` is read as
    the size of the buffer each worker exchanges / all-reduces per step (the model's parameter
    or gradient bytes); sharded rows should carry the full model in model_bytes. Framework
    names: DDP ('ddp', 'torch-ddp', or topology 'allreduce'), HSDP ('hsdp', 'fsdp-hybrid_shard',
    or topology 'hsdp'), sharded gossip ('decentpy-shard' on one of TOPOLOGIES over the nodes),
    plain gossip (anything else on one of TOPOLOGIES). Rows with missing or non-positive
    numbers, ZeRO rows ('ddp-zero', 'torch-zero': not modelled), compressed rows (COMPRESSED_SUFFIXES)
    and topologies that do not fit are skipped.
    """
    out: List[Measurement] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"framework", "topology", "workers", "model", "step_time_s", "bytes_per_step",
                "compute_time_s"}
        missing = need - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for row in reader:
            try:
                workers = int(float(row["workers"]))
                step = float(row["step_time_s"])
                nbytes = float(row.get("model_bytes") or row["bytes_per_step"])
                compute = float(row["compute_time_s"])
            except (TypeError, ValueError):
                continue
            if workers < 1 or step <= 0 or nbytes < 0 or compute < 0:
                continue
            framework = (row["framework"] or "").strip()
            topology = (row["topology"] or "").strip()
            kind = _row_kind(framework, topology, row)
            if kind in ("zero", "compressed"):
                continue
            if kind in ("allreduce", "hsdp"):
                topology = kind
            elif topology not in TOPOLOGIES:
                continue
            local_s = (row.get("local_world_size") or "").strip()
            if local_s:
                local = int(float(local_s))
            elif ((topology == "alternating-exp-ring" or kind in ("shard", "hsdp"))
                  and workers >= 4 and workers % 2 == 0):
                local = 2
            else:
                local = workers
            if local < 1 or workers % local:
                continue
            if kind == "gossip" and not topology_valid(topology, workers, local):
                continue
            if kind == "shard" and not sharded_topology_valid(topology, workers // local):
                continue
            out.append(Measurement(framework, topology, workers, row["model"], step, nbytes,
                                   compute, local, sharded=kind == "shard"))
    return out


def _hw_from_theta(theta: np.ndarray) -> Hardware:
    """Hardware from the fit's unconstrained coordinates (log bandwidth, log latency, log kernel
    bandwidth, logit overlap); one machine, so the "inter-node" link is the intra one (tied)."""
    bw, lat, mem = (float(np.exp(x)) for x in theta[:3])
    overlap = float(expit(theta[3]))  # logistic without exp overflow at large logits
    return Hardware(intra_bw=bw, inter_bw=bw, intra_lat=lat, inter_lat=lat, mem_bw=mem,
                    overlap=overlap)


def predict(m: Measurement, hw: Hardware, base: Workload = Workload(0.0, 0.0)) -> float:
    """The model's step time for ``m`` (``base`` gives the knobs a measurement does not carry)."""
    wl = replace(base, model_bytes=m.model_bytes, compute_s=m.compute_time_s)
    kind = m.kind
    if kind == "allreduce":
        return ddp_iteration_time(m.workers, m.local, wl, hw)[0]
    if kind == "hsdp":
        return hsdp_iteration_time(m.workers, m.local, wl, hw)[0]
    if kind == "shard":
        return sharded_gossip_iteration_time(m.topology, m.workers, m.local, wl, hw)[0]
    return decentralized_iteration_time(m.topology, m.workers, m.local, wl, hw)[0]


# Starting points (bandwidth B/s, latency s, kernel bandwidth B/s, overlap) spread over the
# plausible range of a shared-core CPU machine.
_STARTS = (
    (1e9, 50e-6, 10e9, 0.5),
    (1e8, 500e-6, 1e9, 0.9),
    (1e10, 5e-6, 100e9, 0.2),
    (3e8, 100e-6, 3e9, 0.7),
)
# Logit of the overlap when it is not fitted: expit(50) == 1.0 in float64 (full overlap).
_NO_OVERLAP_FIT = 50.0


class _TiedPredictor:
    """Vectorised ``predict`` over many measurements for hardware with inter == intra link.

    The calibration fits one machine, so both link kinds share bandwidth and latency and every
    cost row collapses to ``a * lat + b / bw``; one loss evaluation is then a few numpy ops.
    The few HSDP and sharded-gossip rows go through :func:`predict` one by one.
    """

    def __init__(self, ms: Sequence[Measurement], base: Workload) -> None:
        row_a, row_b, row_step, step_meas, step_tc, step_k = [], [], [], [], [], []
        ddp_idx, ddp = [], []  # (index, a_full, b_full, a_tail, b_tail, compute, kernel bytes)
        self.others = [(i, m) for i, m in enumerate(ms) if m.kind in ("hsdp", "shard")]
        self.base = base
        n_steps = 0
        for i, m in enumerate(ms):
            if m.kind in ("hsdp", "shard"):
                continue
            if m.topology == "allreduce":
                if m.workers <= 1:
                    full = tail = np.zeros(4)
                else:
                    full = tail = topology_rows("complete", m.workers, m.local)[0][0]
                tail_bytes = min(base.bucket_bytes, m.model_bytes)
                ddp_idx.append(i)
                ddp.append((full[0] + full[2], (full[1] + full[3]) * m.model_bytes,
                            tail[0] + tail[2], (tail[1] + tail[3]) * tail_bytes,
                            m.compute_time_s, base.kernel_traffic_ddp * m.model_bytes))
                continue
            for rows in topology_rows(m.topology, m.workers, m.local):
                for r in rows:
                    row_a.append(r[0] + r[2])
                    row_b.append((r[1] + r[3]) * m.model_bytes)
                    row_step.append(n_steps)
                step_meas.append(i)
                step_tc.append(m.compute_time_s)
                step_k.append(base.kernel_traffic_dec * m.model_bytes)
                n_steps += 1
        self.n = len(ms)
        self.row_a, self.row_b = np.array(row_a), np.array(row_b)
        row_step_arr = np.array(row_step, dtype=np.int64)
        self.starts = np.flatnonzero(np.r_[True, np.diff(row_step_arr) != 0]) if row_step else None
        self.step_meas = np.array(step_meas, dtype=np.int64)
        self.step_tc, self.step_k = np.array(step_tc), np.array(step_k)
        self.step_count = np.bincount(self.step_meas, minlength=self.n) if step_meas else None
        self.ddp_idx = np.array(ddp_idx, dtype=np.int64)
        self.ddp = np.array(ddp).reshape(-1, 6)
        self.bwd = base.backward_fraction

    def __call__(self, hw: Hardware) -> np.ndarray:
        out = np.zeros(self.n)
        ov = hw.overlap
        if self.starts is not None:
            cost = self.row_a * hw.intra_lat + self.row_b / hw.intra_bw
            comm = np.maximum.reduceat(cost, self.starts)
            tc = self.step_tc
            t = np.maximum(tc, comm) + (1 - ov) * np.minimum(tc, comm) + self.step_k / hw.mem_bw
            out += np.bincount(self.step_meas, weights=t, minlength=self.n) / np.maximum(
                self.step_count, 1)
        if len(self.ddp_idx):
            a_f, b_f, a_t, b_t, tc, kb = self.ddp.T
            full = a_f * hw.intra_lat + b_f / hw.intra_bw
            tail = a_t * hw.intra_lat + b_t / hw.intra_bw
            hidden = np.maximum(full - tail, 0.0)
            bwd = self.bwd * tc
            t = ((1 - self.bwd) * tc + np.maximum(bwd, hidden) + (1 - ov) * np.minimum(bwd, hidden)
                 + tail + kb / hw.mem_bw)
            out[self.ddp_idx] = t
        for i, m in self.others:
            out[i] = predict(m, hw, self.base)
        return out


@dataclass
class CalibrationResult:
    """The fitted hardware and how well it reproduces each measurement."""

    hardware: Hardware
    rel_errors: List[float]  # (predicted - measured) / measured, per measurement
    measurements: List[Measurement] = field(repr=False, default_factory=list)
    predictions: List[float] = field(repr=False, default_factory=list)

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(e) for e in self.rel_errors) if self.rel_errors else math.nan


def _nelder_mead(loss: Callable[[np.ndarray], float], x0: np.ndarray, edge: float
                 ) -> OptimizeResult:
    """SciPy's Nelder-Mead from a simplex of the given edge (in the fit's log / logit
    coordinates) around ``x0``; the explicit simplex keeps the first moves large."""
    simplex = np.vstack([x0, x0 + edge * np.eye(len(x0))])
    return minimize(loss, x0, method="Nelder-Mead",
                    options=dict(initial_simplex=simplex, xatol=1e-8, fatol=1e-12, maxiter=600))


def calibrate(
    measurements: Sequence[Measurement],
    workload: Workload = Workload(0.0, 0.0),
    fit_overlap: bool = True,
    restarts: int = 4,
) -> CalibrationResult:
    """Fit effective bandwidth, latency, kernel bandwidth and overlap to measured step times.

    Minimises the sum of squared log(predicted / measured) (relative errors: step times span
    orders of magnitude) with Nelder-Mead in log / logit space from up to ``restarts`` starting
    points, each run twice (the second from a smaller simplex, to escape a collapsed one).
    Not least squares, though the loss is one: the model's max() kinks stall gradient steps,
    which then end in worse local minima on noisy measurements. ``workload`` gives the fixed knobs (backward fraction, bucket size, kernel traffic); each
    measurement brings its own model bytes and compute time.
    """
    ms = list(measurements)
    if not ms:
        raise ValueError("calibrate() needs at least one measurement")
    log_measured = np.log([m.step_time_s for m in ms])
    fast = _TiedPredictor(ms, workload)

    def full_theta(theta: np.ndarray) -> np.ndarray:
        return theta if fit_overlap else np.append(theta[:3], _NO_OVERLAP_FIT)

    def loss(theta: np.ndarray) -> float:
        pred = fast(_hw_from_theta(full_theta(theta)))
        return float(np.sum((np.log(pred) - log_measured) ** 2))

    dim = 4 if fit_overlap else 3
    best_x, best_f = None, math.inf
    for bw, lat, mem, ov in _STARTS[: max(1, restarts)]:
        x0 = np.array([math.log(bw), math.log(lat), math.log(mem), math.log(ov / (1 - ov))])[:dim]
        coarse = _nelder_mead(loss, x0, 1.0)
        fine = _nelder_mead(loss, coarse.x, 0.2)
        if fine.fun < best_f:
            best_x, best_f = fine.x, fine.fun
    hw = _hw_from_theta(full_theta(best_x))
    pred = [predict(m, hw, workload) for m in ms]
    errs = [(p - m.step_time_s) / m.step_time_s for p, m in zip(pred, ms)]
    return CalibrationResult(hw, errs, ms, pred)

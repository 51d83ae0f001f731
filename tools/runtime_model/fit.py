"""Calibration of the runtime model's free parameters against measured step times.

Reads the CSVs of the end-to-end benchmarks (``bench/bench_train.py``, and the sharded-gossip
and HSDP rows of ``bench/bench_hybrid.py`` when it writes them) into :class:`Measurement` rows
and fits, on one machine (so the intra- and inter-node links are tied to one effective link),
the effective bandwidth, latency, kernel memory bandwidth and compute/communication overlap of
:class:`tools.runtime_model.model.Hardware` to them (:func:`calibrate`).

The LM benchmark's CSV (``bench/bench_lm.py``, one row per evaluation of each run; recognised by its
columns, :func:`is_bench_lm`) gives one measurement per run behind a throttled link
(:func:`load_bench_lm`: its step time, and the compute time from the loopback runs), every step and
local steps (DiLoCo); :func:`calibrate_links` fits the link (efficiency of the tc rate, latency,
overlap) on a part of them and predicts the rest. The model itself lives in ``model.py``.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
    local_steps_iteration_time,
    local_steps_window_time,
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
    "BENCH_LM_COLUMNS",
    "is_bench_lm",
    "SkippedRun",
    "BenchLmRuns",
    "load_bench_lm",
    "link_hardware",
    "every_step",
    "LinkCalibration",
    "calibrate_links",
]


@dataclass(frozen=True)
class Measurement:
    """One measured configuration: a row of the end-to-end benchmark, or one bench-lm run."""

    framework: str  # 'ddp' (all-reduce), 'decentpy', 'decentpy-shard', 'hsdp', ...
    topology: str  # one of TOPOLOGIES, or 'allreduce' for DDP, 'hsdp' for HSDP
    workers: int
    model: str
    step_time_s: float
    model_bytes: float  # the full model's bytes, also for the sharded modes
    compute_time_s: float
    local: int
    sharded: bool = False  # sharded gossip (decentpy intra_node="shard") on ``topology``
    local_steps: int = 1  # H > 1: local steps (DiLoCo on 'complete', a gossip outer step elsewhere)
    compression: Optional[str] = None  # decentpy's kind ('int8') of the exchange (the outer one if H > 1)
    link_mbit: Optional[float] = None  # the tc-throttled link per node (bench-lm); None: one machine
    window: Optional[Tuple[int, int]] = None  # (first, last) iteration timed, 1-based; None: the mean
    run: str = ""  # which run it is, for the tables (bench-lm: arm and seed)

    @property
    def kind(self) -> str:
        """Which model predicts it: 'allreduce', 'hsdp', 'local-steps', 'shard' (sharded gossip),
        'gossip'."""
        if self.topology in ("allreduce", "hsdp"):
            return self.topology
        if self.local_steps > 1:
            return "local-steps"
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
    """Read the end-to-end benchmark CSV (a bench-lm CSV, :func:`is_bench_lm`: the measurements of
    :func:`load_bench_lm`, its throttled-link runs).

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
    if is_bench_lm(path):
        return load_bench_lm(path).measurements
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
    """The model's step time for ``m`` (``base`` gives the knobs a measurement does not carry).

    Local steps are decentpy's with every rank a replica (``intra_node="gossip"``), so a compressed
    outer exchange takes the replicas' path (``node_level=False``); with a ``window`` the mean of
    those iterations (:func:`local_steps_window_time`), else the steady-state mean."""
    wl = replace(base, model_bytes=m.model_bytes, compute_s=m.compute_time_s)
    kind = m.kind
    if kind == "allreduce":
        return ddp_iteration_time(m.workers, m.local, wl, hw)[0]
    if kind == "hsdp":
        return hsdp_iteration_time(m.workers, m.local, wl, hw)[0]
    if kind == "local-steps":
        if m.sharded:
            raise ValueError(f"{m.run or m.topology}: local steps with intra_node='shard' are not "
                             "predicted (the model's node-level int8 path is the nearest)")
        if m.window is None:
            return local_steps_iteration_time(m.topology, m.workers, m.local, wl, hw, m.local_steps,
                                              m.compression, node_level=False)[0]
        return local_steps_window_time(m.topology, m.workers, m.local, wl, hw, m.local_steps,
                                       m.window[0], m.window[1], m.compression, node_level=False)
    if kind == "shard":
        return sharded_gossip_iteration_time(m.topology, m.workers, m.local, wl, hw,
                                             m.compression)[0]
    return decentralized_iteration_time(m.topology, m.workers, m.local, wl, hw, m.compression)[0]


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
    The few HSDP, sharded-gossip, local-steps and compressed rows go through :func:`predict` one by
    one.
    """

    @staticmethod
    def one_by_one(m: Measurement) -> bool:
        """Whether ``m`` has no vectorised cost rows here (plain DDP and uncompressed gossip have)."""
        return m.kind in ("hsdp", "shard", "local-steps") or m.compression is not None

    def __init__(self, ms: Sequence[Measurement], base: Workload) -> None:
        row_a, row_b, row_step, step_meas, step_tc, step_k = [], [], [], [], [], []
        ddp_idx, ddp = [], []  # (index, a_full, b_full, a_tail, b_tail, compute, kernel bytes)
        self.others = [(i, m) for i, m in enumerate(ms) if self.one_by_one(m)]
        self.base = base
        n_steps = 0
        for i, m in enumerate(ms):
            if self.one_by_one(m):
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
    which then end in worse local minima on noisy measurements. ``workload`` gives the fixed
    knobs (backward fraction, bucket size, kernel traffic); each measurement brings its own model
    bytes and compute time. Throttled-link measurements (bench-lm) are :func:`calibrate_links`'.
    """
    ms = list(measurements)
    if not ms:
        raise ValueError("calibrate() needs at least one measurement")
    linked = [m.run or m.framework for m in ms if m.link_mbit is not None]
    if linked:
        raise ValueError(f"calibrate() ties the links of one machine; {', '.join(linked[:3])} ran "
                         "behind a throttled link: calibrate_links()")
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


# ----------------------------------------------------------------------------------------------
# bench-lm: one measurement per throttled-link run, the link fitted on a part of them
# ----------------------------------------------------------------------------------------------

#: the columns that mark a bench-lm CSV (examples/lm/loop.py's COLUMNS, which bench/bench_lm.py writes)
BENCH_LM_COLUMNS = frozenset(("mode", "topology", "compression", "intra_node", "local_steps",
                              "fragments", "link_mbit", "workers", "preset", "seed", "step",
                              "wall_s", "params"))
#: the columns that name a run (with ``seed``: one run; its rows are the evaluation points)
_RUN_COLUMNS = ("framework", "mode", "topology", "compression", "intra_node", "local_steps",
                "fragments", "link_mbit", "workers", "preset")
#: how a throttled run's compute time is taken from the loopback runs (:func:`load_bench_lm`)
COMPUTE_RULES = ("pooled", "arm")
#: bytes per parameter: the LM trains in float32 (examples/lm)
_PARAM_BYTES = 4.0


def is_bench_lm(path: os.PathLike) -> bool:
    """Whether ``path`` is a bench-lm CSV (its header has :data:`BENCH_LM_COLUMNS`)."""
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    return BENCH_LM_COLUMNS <= set(header)


@dataclass(frozen=True)
class SkippedRun:
    """A bench-lm run that gives no measurement, and why."""

    run: str
    reason: str


@dataclass
class BenchLmRuns:
    """What :func:`load_bench_lm` made of a bench-lm CSV."""

    measurements: List[Measurement]  # the throttled-link runs the model predicts
    skipped: List[SkippedRun]  # throttled runs it does not (the loopback runs are no measurements)
    compute_s: Dict[str, float]  # the compute references of the measurements: label -> seconds
    loopback_runs: int  # runs on loopback: the compute references, never measurements


def _none(text: Optional[str]) -> Optional[str]:
    """A CSV cell, None when empty ('' / 'None' / 'none')."""
    text = (text or "").strip()
    return None if text in ("", "None", "none") else text


def _int_cell(text: Optional[str], default: int) -> int:
    cell = _none(text)
    return default if cell is None else int(float(cell))


def _arm_label(key: Dict[str, Optional[str]]) -> str:
    """A run's arm, short: 'DDP', 'decentpy complete H=32 int8', 'decent-dp ring', ..."""
    mode = key["mode"] or "?"
    if mode == "ddp":
        return "DDP"
    parts = [mode if mode != "decentpy" else "decentpy", key["topology"] or "?"]
    h = _int_cell(key["local_steps"], 1)
    if h > 1:
        parts.append(f"H={h}")
    if _int_cell(key["fragments"], 1) > 1:
        parts.append(f"F={_int_cell(key['fragments'], 1)}")
    if key["compression"] is not None:
        parts.append(key["compression"])
    if mode == "decentpy" and key["intra_node"] not in (None, "gossip"):
        parts.append(str(key["intra_node"]))
    return " ".join(parts)


def _link_label(mbit: Optional[float]) -> str:
    return "loopback" if mbit is None else f"{mbit:g} Mbit/s"


def _step_window(points: Sequence[Tuple[int, float]]) -> Optional[Tuple[int, int, float]]:
    """(first, last iteration (1-based), mean seconds per iteration) of a run from its evaluation
    points (step, cumulative training seconds): the slope of the training time from the first
    evaluation after step 0 to the last -- the interval from step 0 carries the start-up (the
    bucket layout rebuilt after the first backward, first allocations, connections warming up) --
    or from step 0 where a run has only two points. None: fewer than two points, or no time."""
    pts = sorted(dict(points).items())
    if len(pts) < 2:
        return None
    i0 = 1 if len(pts) >= 3 and pts[0][0] == 0 else 0
    (s0, w0), (s1, w1) = pts[i0], pts[-1]
    if s1 <= s0 or w1 <= w0:
        return None
    return s0 + 1, s1, (w1 - w0) / (s1 - s0)


def load_bench_lm(path: os.PathLike, compute: str = "pooled") -> BenchLmRuns:
    """One :class:`Measurement` per throttled-link run of a bench-lm CSV (``bench/bench_lm.py``).

    A run is one arm, link and seed; its rows are evaluation points (``step``, cumulative
    ``wall_s``). ``wall_s`` is training time only, the largest over the ranks (examples/lm/loop.py:
    evaluations are not counted; exchanges in flight at an evaluation are finished inside it), so the
    step time is its slope over the steps, from the first evaluation after step 0 to the last
    (:func:`_step_window`); that window goes with the measurement, since local steps' outer steps
    fall in it at the multiples of H, not at 1 / H of its iterations. Model bytes: ``params`` in
    float32. Workers: 4 processes; decentpy's nodes are ``local_world_size`` (examples/lm: 2, so two
    nodes of 2), which must be the throttled layout's two nodes of ``workers / 2`` (tc tbf on each
    node's one veth pair, ``link_mbit`` each way; inside a node the namespace's loopback,
    bench.common.netlink).

    Compute time: every part of an iteration that does not cross the throttled link is taken from
    the loopback runs, measured, not modelled (:func:`link_hardware` then makes those parts free):
    ``compute='pooled'`` (default) -- a local-steps run takes the median step time of all loopback
    runs of decentpy's local steps (the same inner iteration in all: forward, backward, the fused
    AdamW step; any H, topology and compression, outer steps over loopback included), an every-step
    run the median of its own arm's loopback runs over the seeds (its loopback exchange and mixing
    are part of it); ``compute='arm'`` -- the loopback run of the same arm and seed.

    Loopback runs are the references, not measurements. Skipped (:attr:`BenchLmRuns.skipped`, with
    the reason): arms the model does not predict (PowerSGD, decent-dp, torchft's DiLoCo, Streaming
    DiLoCo's fragments, topologies outside TOPOLOGIES such as random-pairs, ``intra_node`` other
    than 'gossip' -- and 'shard' every step --, local steps with 'shard'), runs without a loopback
    reference, with fewer than two evaluation points, or whose nodes are not the link's.
    """
    if compute not in COMPUTE_RULES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_RULES)}, got {compute!r}")
    runs: Dict[Tuple[Optional[str], ...], List[Tuple[int, float]]] = {}
    info: Dict[Tuple[Optional[str], ...], Dict[str, Optional[str]]] = {}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = BENCH_LM_COLUMNS - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: not a bench-lm CSV, missing column(s) "
                             f"{', '.join(sorted(missing))}")
        for row in reader:
            cells = {c: _none(row.get(c)) for c in (*_RUN_COLUMNS, "seed", "params",
                                                    "local_world_size")}
            key = tuple(cells[c] for c in (*_RUN_COLUMNS, "seed"))
            try:
                point = (int(float(row["step"])), float(row["wall_s"]))
            except (TypeError, ValueError):
                continue  # a row without a time: not an evaluation point
            runs.setdefault(key, []).append(point)
            info.setdefault(key, cells)

    # every run's window and step time first: the loopback ones are the compute references
    timed: Dict[Tuple[Optional[str], ...], Tuple[int, int, float]] = {}
    skipped: List[SkippedRun] = []
    names: Dict[Tuple[Optional[str], ...], str] = {}
    short: Dict[Tuple[Optional[str], ...], str] = {}
    for key, points in runs.items():
        cells = info[key]
        mbit = None if cells["link_mbit"] is None else float(cells["link_mbit"])
        names[key] = f"{_arm_label(cells)} @ {_link_label(mbit)}, seed {cells['seed']}"
        short[key] = f"{_arm_label(cells)}, seed {cells['seed']}"  # (the link is its own field)
        got = _step_window(points)
        if got is None:
            if mbit is not None:
                skipped.append(SkippedRun(names[key], "fewer than two timed evaluation points"))
            continue
        timed[key] = got

    def arm_of(key: Tuple[Optional[str], ...]) -> Tuple[Optional[str], ...]:
        return tuple(v for c, v in zip((*_RUN_COLUMNS, "seed"), key) if c != "link_mbit")

    def pooled_local_steps(cells: Dict[str, Optional[str]]) -> bool:
        return (cells["mode"] == "decentpy" and _int_cell(cells["local_steps"], 1) > 1
                and _int_cell(cells["fragments"], 1) == 1 and cells["intra_node"] in (None, "gossip"))

    def ref_key(key: Tuple[Optional[str], ...]) -> Tuple[Tuple[Optional[str], ...], str]:
        """Which loopback runs give ``key``'s compute time, and a label for them."""
        cells = info[key]
        arm = arm_of(key)
        if compute == "arm":
            return ("arm",) + arm, f"{_arm_label(cells)}, seed {cells['seed']} (loopback)"
        if pooled_local_steps(cells):
            return (("local-steps", cells["preset"], cells["workers"]),
                    f"decentpy local steps, {cells['preset']}, {cells['workers']} workers "
                    "(loopback, median)")
        return ("every-step",) + arm[:-1], f"{_arm_label(cells)} (loopback, median over seeds)"

    pools: Dict[Tuple[Optional[str], ...], List[float]] = {}
    labels: Dict[Tuple[Optional[str], ...], str] = {}
    loopback = 0
    for key, (_, _, step) in timed.items():
        if info[key]["link_mbit"] is None:
            loopback += 1
            rk, label = ref_key(key)
            pools.setdefault(rk, []).append(step)
            labels[rk] = label
    medians = {labels[rk]: statistics.median(v) for rk, v in pools.items()}
    compute_s: Dict[str, float] = {}

    out: List[Measurement] = []
    for key, (first, last, step) in timed.items():
        cells = info[key]
        if cells["link_mbit"] is None:
            continue
        mbit = float(cells["link_mbit"])  # type: ignore[arg-type]
        why, m = _bench_lm_measurement(cells, mbit, step, (first, last), short[key])
        if m is not None:
            rk, label = ref_key(key)
            if rk not in pools:
                why = f"no loopback run to take the compute time from ({label})"
            else:
                compute_s[label] = medians[label]
                out.append(replace(m, compute_time_s=medians[label]))
                continue
        skipped.append(SkippedRun(names[key], why))
    return BenchLmRuns(out, skipped, compute_s, loopback)


def _bench_lm_measurement(cells: Dict[str, Optional[str]], mbit: float, step: float,
                          window: Tuple[int, int], run: str
                          ) -> Tuple[str, Optional[Measurement]]:
    """A throttled bench-lm run as a measurement (compute time still 0), or why the model does not
    predict it."""
    mode, topology = cells["mode"], cells["topology"] or ""
    h = _int_cell(cells["local_steps"], 1)
    intra = cells["intra_node"] or "gossip"
    compression = cells["compression"]
    try:
        workers = int(float(cells["workers"] or ""))
        params = float(cells["params"] or "")
    except ValueError:
        return "no workers or params", None
    if mode == "ddp-powersgd" or (compression or "").startswith("powersgd"):
        return "PowerSGD's compressed all-reduce is not modelled", None
    if mode == "decent-dp":
        return ("decent-dp's exchange (all-reduces of every parameter in its Python hooks) is not "
                "decentpy's, which the model costs"), None
    if mode == "torchft-diloco":
        return "torchft's DiLoCo is not decentpy's local steps (the model costs decentpy's)", None
    if mode not in ("ddp", "decentpy"):
        return f"mode {mode!r} is not modelled", None
    if _int_cell(cells["fragments"], 1) > 1:
        return "Streaming DiLoCo's fragments are not modelled", None
    if mode == "decentpy" and topology not in TOPOLOGIES:
        what = ("its pairs (and so how many cross the link) are drawn at random per outer step"
                if topology == "random-pairs" else "no cost rows")
        return f"topology {topology!r} is not one of the model's ({what})", None
    if mode == "decentpy" and intra not in ("gossip", "shard"):
        return f"intra_node={intra!r} is not modelled", None
    if h > 1 and intra != "gossip":
        return (f"local steps with intra_node={intra!r} (the model's node-level int8 path is the "
                "nearest, not it)"), None
    local = _int_cell(cells.get("local_world_size"), min(2, workers))  # examples/lm's default
    if workers % 2 or local != workers // 2:
        return (f"decentpy's nodes of {local} are not the throttled layout's two nodes of "
                f"{workers // 2}"), None
    sharded = mode == "decentpy" and intra == "shard"
    if mode == "ddp":
        topology = "allreduce"
    elif sharded and not sharded_topology_valid(topology, workers // local):
        return f"{topology!r} does not run over {workers // local} nodes", None
    elif not sharded and not topology_valid(topology, workers, local):
        return f"{topology!r} does not run on n={workers}, L={local}", None
    return "", Measurement(mode or "", topology, workers, f"lm-{cells['preset']}", step,
                           params * _PARAM_BYTES, 0.0, local, sharded=sharded, local_steps=h,
                           compression=compression, link_mbit=mbit, window=window, run=run)


#: bandwidth (B/s) that costs nothing at these sizes: the loopback parts of a throttled run
_FREE_BW = 1e30


def link_hardware(link_mbit: float, efficiency: float = 1.0, latency_s: float = 0.0,
                  overlap: float = 1.0) -> Hardware:
    """A throttled bench-lm run's hardware: each node's tc link, full duplex, delivering
    ``efficiency`` of its ``link_mbit`` with ``latency_s`` per message; what stays on the machine
    (the intra-node exchanges over the namespace's loopback, the kernel passes) is in the run's
    compute time, taken from the loopback runs (:func:`load_bench_lm`), so free here."""
    if link_mbit <= 0 or efficiency <= 0:
        raise ValueError(f"link_mbit and efficiency must be positive, got {link_mbit!r}, "
                         f"{efficiency!r}")
    return Hardware(intra_bw=_FREE_BW, inter_bw=efficiency * link_mbit * 1e6 / 8, intra_lat=0.0,
                    inter_lat=latency_s, mem_bw=_FREE_BW, overlap=overlap)


def every_step(m: Measurement) -> bool:
    """The default fit set of :func:`calibrate_links`: runs that exchange every step."""
    return m.local_steps == 1


@dataclass
class LinkCalibration:
    """The throttled link fitted on a part of the measurements, and every measurement's prediction."""

    efficiency: float  # the fraction of the tc rate the exchanges achieve
    latency_s: float  # per message over the link
    overlap: float  # fraction of min(compute, comm) hidden
    measurements: List[Measurement] = field(repr=False, default_factory=list)
    predictions: List[float] = field(repr=False, default_factory=list)
    fitted: List[bool] = field(repr=False, default_factory=list)  # in the fit, or a validation

    def hardware(self, link_mbit: float) -> Hardware:
        """The fitted hardware of a run behind ``link_mbit``."""
        return link_hardware(link_mbit, self.efficiency, self.latency_s, self.overlap)

    @property
    def rel_errors(self) -> List[float]:
        """(predicted - measured) / measured, per measurement."""
        return [(p - m.step_time_s) / m.step_time_s
                for p, m in zip(self.predictions, self.measurements)]

    def median_abs_error(self, fitted: Optional[bool] = None) -> float:
        """Median |relative error| over the fitted (True), the validation (False) or all (None)."""
        errs = [abs(e) for e, f in zip(self.rel_errors, self.fitted) if fitted is None or f == fitted]
        return statistics.median(errs) if errs else math.nan


# Starting points (efficiency, latency s, overlap) of the link fit.
_LINK_STARTS = ((1.0, 1e-3, 0.5), (0.5, 1e-4, 0.9), (0.8, 1e-2, 0.1))


def calibrate_links(measurements: Sequence[Measurement], workload: Workload = Workload(0.0, 0.0),
                    fit_on: Callable[[Measurement], bool] = every_step,
                    restarts: int = 3) -> LinkCalibration:
    """Fit the throttled link's efficiency, latency and the overlap to the measurements that
    ``fit_on`` selects (default: those that exchange every step), and predict all of them.

    The same loss and search as :func:`calibrate` (sum of squared log(predicted / measured),
    Nelder-Mead in log / logit space from up to ``restarts`` starting points, twice each). The
    measurements left out of the fit are predictions with the fitted link: a validation, not tuned.
    Each measurement brings its compute time and its link (:func:`link_hardware`)."""
    ms = list(measurements)
    bad = [m.run or m.framework for m in ms if m.link_mbit is None]
    if bad:
        raise ValueError(f"calibrate_links() needs throttled-link measurements; {', '.join(bad[:3])} "
                         "have no link_mbit: calibrate()")
    fit_set = [m for m in ms if fit_on(m)]
    if not fit_set:
        raise ValueError(f"calibrate_links(): none of the {len(ms)} measurements is in the fit set")
    log_measured = np.log([m.step_time_s for m in fit_set])

    def link(theta: np.ndarray) -> Tuple[float, float, float]:
        return float(np.exp(theta[0])), float(np.exp(theta[1])), float(expit(theta[2]))

    def predict_all(sel: Sequence[Measurement], eff: float, lat: float, ov: float) -> List[float]:
        return [predict(m, link_hardware(m.link_mbit, eff, lat, ov), workload)  # type: ignore[arg-type]
                for m in sel]

    def loss(theta: np.ndarray) -> float:
        pred = np.array(predict_all(fit_set, *link(theta)))
        return float(np.sum((np.log(pred) - log_measured) ** 2))

    best_x, best_f = None, math.inf
    for eff, lat, ov in _LINK_STARTS[: max(1, restarts)]:
        x0 = np.array([math.log(eff), math.log(lat), math.log(ov / (1 - ov))])
        coarse = _nelder_mead(loss, x0, 1.0)
        fine = _nelder_mead(loss, coarse.x, 0.2)
        if fine.fun < best_f:
            best_x, best_f = fine.x, fine.fun
    eff, lat, ov = link(best_x)
    return LinkCalibration(eff, lat, ov, ms, predict_all(ms, eff, lat, ov),
                           [fit_on(m) for m in ms])

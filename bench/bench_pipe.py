"""Pipeline-parallel benchmark on CPU: decentpy AsyncPipe vs torch.distributed.pipelining vs one process.

A stack of ``--blocks`` x (Linear(width, width) + ReLU) (default 8 x 512 wide, batch 256, MSE loss
against a fixed random target, same seed everywhere) is split into 2 and 4 equal stages, one per
gloo worker process on 127.0.0.1 (one torch thread each), and trained (forward + backward,
gradients only, no optimizer step) for every chunk count (micro-batches per batch: 1, 2, 4, 8, 16)
and schedule, side by side in one run:

* ``decentpy``  ``decentpy.AsyncPipe(model, balance, chunks=m, checkpoint="never")``, stepped by
                ``pipe.train_step(x, target, mse_loss, schedule="gpipe" | "1f1b")``;
* ``torch``     ``torch.distributed.pipelining``: ``PipelineStage`` over the rank's slice of the same
                ``nn.Sequential``, ``ScheduleGPipe`` / ``Schedule1F1B(n_microbatches=m,
                loss_fn=mse_loss)``, ``schedule.step(x)`` on stage 0, ``step(target=..., losses=...,
                return_outputs=False)`` on the last one, ``step()`` in between;
* ``single``    the whole model on rank 0 alone (the others wait in a barrier), timed in the same
                rounds: forward + backward of the whole batch (``m = 1``: the reference of the bubble,
                the loss and the gradients), and of the same ``m`` micro-batches one after the other
                (gradients accumulated): the compute a pipeline of ``m`` micro-batches cannot avoid
                (small micro-batches use the cores less well than one big batch).

Settings a framework refuses or fails at (torch's 1F1B wants ``m >= stages``; anything that raises
or hangs in a short probe run) are reported as ``n/a`` with the reason, never dropped.

Per configuration:

* step time: wall time of one training step, every rank starting it after a barrier; per step the
  max over ranks; the median over the timed steps (plus the 25th/75th percentiles). All
  configurations of one stage count live in the same processes and are timed in interleaved rounds
  (a few steps of each in turn, order rotated each round), as bench/bench_shard.py does;
* bubble: measured ``1 - T_single / (S * T_step)`` -- the share of the S workers' time not spent on
  the model's own compute: it assumes balanced stages and counts communication (and any framework
  overhead) as bubble -- beside the theory of an ideal pipeline, ``(S - 1) / (m + S - 1)``; and the
  same with ``T_single`` of the m micro-batches (``bubble (m mb)``), which does not count the cost of
  cutting the batch as bubble;
* start-up cost: construction of the configuration (the pipe, or torch's stage and schedule) plus
  its first step (torch infers the stages' shapes there), each after a barrier, per rank; the max
  over ranks;
* correctness: the first step's loss and the gradients of every stage, against the single-process
  model's (same batch, same initial weights);
* activation memory per stage (``decentpy.pipeline.ActivationMeter`` around one step, a separate
  untimed pass, both frameworks): the peak bytes autograd holds for backward (each saved tensor by
  its own bytes: a micro-batch's slice of the batch or target counts as that slice), compared with
  one micro-batch's worth, measured the same way on a decentpy pipe with ``chunks=1`` fed one
  micro-batch. Target: with 1F1B at most ``S`` micro-batches' worth on every stage (stage ``s``
  keeps ``min(S - s, m)`` micro-batches alive).

Writes ``bench/out/bench_pipe.csv`` and ``bench/out/bench_pipe.png`` (step time vs chunks, one panel
per stage count; needs matplotlib, skipped with a message otherwise).

    python -m bench.bench_pipe                               # 2 and 4 stages, chunks 1..16 (~3 minutes on 2 cores)
    python -m bench.bench_pipe --quick                       # smoke test: 2 stages, chunks 1,2, small model
    python -m bench.bench_pipe --stages 2 --chunks 4,8 --frameworks decentpy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import add_run_args, bench_parser, quick_timing, spawn_workers
from bench.common.machine import report_machine
from bench.common.plots import finish_axes, finish_figure, pyplot
from bench.common.tables import cell, check_choices, csv_list, fmt, percentile, print_targets
from bench.common.tables import print_table as print_table_rows
from bench.common.tables import write_csv as write_rows_csv


FRAMEWORKS = ("decentpy", "torch")
SCHEDULES = ("gpipe", "1f1b")
SINGLE = "single"
TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
SPEED_TOLERANCE = 0.05   # "within noise": decentpy's median at most 5% above torch's
MEMORY_SLACK = 0.01      # bytes of scalars (the weighted loss) on top of whole micro-batches


@dataclass(frozen=True)
class PipeConfig:
    """One measured setting: ``framework`` with ``schedule`` on ``stages`` stages, ``chunks`` micro-batches."""

    framework: str
    schedule: str
    stages: int
    chunks: int

    @property
    def key(self) -> str:
        return f"{self.framework}/{self.schedule}/S{self.stages}/m{self.chunks}"


# ----------------------------------------------------------------------------------------------
# model, data, stages (the same on every rank and in every framework)
# ----------------------------------------------------------------------------------------------


def make_layers(width: int, blocks: int, seed: int) -> List[Any]:
    """``blocks`` x (Linear + ReLU) as a flat layer list, initialised from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: List[Any] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return layers


def balance(blocks: int, stages: int) -> List[int]:
    """Layers per stage: whole Linear+ReLU blocks, as even as possible (the first stages one more)."""
    per, extra = divmod(blocks, stages)
    return [2 * (per + (1 if s < extra else 0)) for s in range(stages)]


def stage_slice(blocks: int, stages: int, stage: int) -> Tuple[int, int]:
    """Layers ``[start, stop)`` of ``stage`` in :func:`make_layers`' list."""
    bal = balance(blocks, stages)
    start = sum(bal[:stage])
    return start, start + bal[stage]


def make_batch(plan: Dict[str, Any]) -> Tuple[Any, Any]:
    """The fixed input batch and regression target (from the seed, independent of the model's)."""
    import torch

    g = torch.Generator().manual_seed(plan["seed"] + 1)
    x = torch.randn(plan["batch"], plan["width"], generator=g)
    y = torch.randn(plan["batch"], plan["width"], generator=g)
    return x, y


def mse_loss(out: Any, target: Any) -> Any:
    """The loss of every framework (module level: picklable, one object for all)."""
    import torch.nn.functional as F

    return F.mse_loss(out, target)


# ----------------------------------------------------------------------------------------------
# worker side: one runner per configuration
# ----------------------------------------------------------------------------------------------


class _Runner:
    """One configuration inside one worker: its stage (or whole model), its step, its step times."""

    cfg: PipeConfig
    params: List[Any]

    def __init__(self) -> None:
        self.times: List[float] = []
        self.build_s = 0.0     # construction, this rank (timed after a barrier when asked)
        self.startup_s = 0.0   # construction + first step, this rank
        self.first_loss: Optional[float] = None
        self.grad_err: Optional[float] = None
        self.act: Dict[str, int] = {}

    def run(self, x: Any, y: Any) -> Optional[float]:
        """Forward + backward of the batch; the batch loss where this rank knows it."""
        raise NotImplementedError

    def step(self, x: Any, y: Any) -> Tuple[float, Optional[float]]:
        """One timed step (gradients dropped first, outside the timing): (seconds, loss or None)."""
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        loss = self.run(x, y)
        return time.perf_counter() - t0, loss


class DecentpyRunner(_Runner):
    def __init__(self, cfg: PipeConfig, rank: int, plan: Dict[str, Any]) -> None:
        import decentpy
        from torch import nn

        super().__init__()
        self.cfg = cfg
        model = nn.Sequential(*make_layers(plan["width"], plan["blocks"], plan["seed"]))
        self.pipe = decentpy.AsyncPipe(model, balance=balance(plan["blocks"], cfg.stages), chunks=cfg.chunks,
                                       checkpoint="never", schedule=cfg.schedule, timeout=plan["pipe_timeout_s"])
        del model  # the pipe keeps this rank's layers only
        assert self.pipe.partition is not None
        self.params = list(self.pipe.partition.parameters())
        self.first = self.pipe.stage == 0
        self.last = bool(self.pipe.final_stage)

    def run(self, x: Any, y: Any) -> Optional[float]:
        loss = self.pipe.train_step(x if self.first else None, y if self.last else None, mse_loss,
                                    schedule=self.cfg.schedule)
        return float(loss) if loss is not None else None


class TorchRunner(_Runner):
    def __init__(self, cfg: PipeConfig, rank: int, plan: Dict[str, Any]) -> None:
        import torch
        from torch import nn
        from torch.distributed import pipelining

        super().__init__()
        self.cfg = cfg
        start, stop = stage_slice(plan["blocks"], cfg.stages, rank)
        self.part = nn.Sequential(*make_layers(plan["width"], plan["blocks"], plan["seed"])[start:stop])
        self.params = list(self.part.parameters())
        stage = pipelining.PipelineStage(self.part, rank, cfg.stages, torch.device("cpu"))
        cls = getattr(pipelining, TORCH_CLASS[cfg.schedule])
        # scale_grads (default True) divides the gradients by m: with a mean loss per micro-batch
        # they are the whole batch's, as decentpy's share-weighted loss gives
        self.schedule = cls(stage, n_microbatches=cfg.chunks, loss_fn=mse_loss)
        self.first = rank == 0
        self.last = rank == cfg.stages - 1

    def run(self, x: Any, y: Any) -> Optional[float]:
        if self.first:
            self.schedule.step(x)
            return None
        if self.last:
            losses: List[Any] = []
            # return_outputs=False: decentpy's train_step returns the loss only, not the output
            self.schedule.step(target=y, losses=losses, return_outputs=False)
            return float(sum(float(v.detach()) for v in losses) / len(losses))  # equal micro-batches
        self.schedule.step()
        return None


class SingleRunner(_Runner):
    """The unpipelined model on rank 0; every other rank only takes part in the barriers."""

    def __init__(self, cfg: PipeConfig, rank: int, plan: Dict[str, Any]) -> None:
        from torch import nn

        super().__init__()
        self.cfg = cfg
        self.active = rank == 0
        self.net = nn.Sequential(*make_layers(plan["width"], plan["blocks"], plan["seed"])) if self.active else None
        self.params = list(self.net.parameters()) if self.net is not None else []

    def run(self, x: Any, y: Any) -> Optional[float]:
        import torch

        if self.net is None:
            return None
        m = self.cfg.chunks
        if m == 1:
            loss = mse_loss(self.net(x), y)
            loss.backward()
            return float(loss.detach())
        total = 0.0
        for xs, ys in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            loss = mse_loss(self.net(xs), ys) / m  # equal micro-batches: the batch's mean loss
            loss.backward()
            total += float(loss.detach())
        return total

    def step(self, x: Any, y: Any) -> Tuple[float, Optional[float]]:
        if not self.active:
            return 0.0, None  # the max over ranks is rank 0's time
        return super().step(x, y)


RUNNERS = {"decentpy": DecentpyRunner, "torch": TorchRunner, SINGLE: SingleRunner}


def reference(plan: Dict[str, Any], rank: int, stages: int, x: Any, y: Any) -> Tuple[float, List[Any]]:
    """The single-process loss and the gradients of this rank's stage (same batch, same weights)."""
    from torch import nn

    layers = make_layers(plan["width"], plan["blocks"], plan["seed"])
    loss = mse_loss(nn.Sequential(*layers)(x), y)
    loss.backward()
    start, stop = stage_slice(plan["blocks"], stages, rank)
    grads = [p.grad.detach().clone() for layer in layers[start:stop] for p in layer.parameters()]
    return float(loss.detach()), grads


def reference_grads_all(plan: Dict[str, Any], x: Any, y: Any) -> List[Any]:
    """The single-process gradients of every layer (the check of the micro-batched single runs)."""
    from torch import nn

    layers = make_layers(plan["width"], plan["blocks"], plan["seed"])
    mse_loss(nn.Sequential(*layers)(x), y).backward()
    return [p.grad.detach().clone() for layer in layers for p in layer.parameters()]


def grad_error(params: Sequence[Any], ref: Sequence[Any]) -> float:
    """max |g - g_ref| / max |g_ref| over the stage's parameters (inf when a gradient is missing)."""
    if len(params) != len(ref) or any(p.grad is None for p in params):
        return float("inf")
    num = max(float((p.grad - r).abs().max()) for p, r in zip(params, ref))
    den = max(float(r.abs().max()) for r in ref)
    return num / den if den > 0 else num


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:limit]


def _build(cfgs: Sequence[PipeConfig], rank: int, plan: Dict[str, Any],
           timed: bool = False) -> Tuple[List[_Runner], Dict[str, str]]:
    """Build every configuration; those that fail to build on any rank are dropped everywhere with
    the first error (no messages move while a stage or schedule is built, so this is safe).
    ``timed``: each construction starts after a barrier and its time is kept (``build_s``)."""
    import torch.distributed as dist

    built: List[Optional[_Runner]] = []
    errs: List[Optional[str]] = []
    for cfg in cfgs:
        try:
            if timed:
                dist.barrier()
            t0 = time.perf_counter()
            runner = RUNNERS[cfg.framework](cfg, rank, plan)
            runner.build_s = time.perf_counter() - t0
            built.append(runner)
            errs.append(None)
        except Exception as exc:  # noqa: BLE001  (reported as n/a)
            built.append(None)
            errs.append(_first_line(exc))
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, errs)
    failed: Dict[str, str] = {}
    runners: List[_Runner] = []
    for i, (cfg, r) in enumerate(zip(cfgs, built)):
        err = next((e[i] for e in every if e[i]), None)
        if err:
            failed[cfg.key] = f"fails to build: {err}"
        else:
            assert r is not None
            runners.append(r)
    return runners, failed


def _probe_body(rank: int, stages: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    """Build each configuration and run two steps: {key: None (works) or the first error}. After a
    failure inside a step the message streams may be out of step: the rest stay ``unresolved``."""
    import torch.distributed as dist

    x, y = make_batch(plan)
    out: Dict[str, Optional[str]] = {}
    unresolved: List[str] = []
    for c in plan["configs"]:
        cfg = PipeConfig(**c)
        if unresolved:
            unresolved.append(cfg.key)
            continue
        runners, failed = _build([cfg], rank, plan)
        if failed:
            out[cfg.key] = failed[cfg.key]
            continue
        err: Optional[str] = None
        try:
            for _ in range(2):
                dist.barrier()
                runners[0].step(x, y)
        except Exception as exc:  # noqa: BLE001
            err = f"fails at run time: {_first_line(exc)}"
        errs: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        out[cfg.key] = next((e for e in errs if e), None)
        if out[cfg.key]:
            unresolved.append("")  # marker: stop here
        del runners
    return dict(results=out, unresolved=[k for k in unresolved if k])


def _measure_act(r: _Runner, x: Any, y: Any) -> int:
    """Peak bytes saved for backward on this rank during one step of ``r`` on ``(x, y)``."""
    from decentpy.pipeline import ActivationMeter

    for p in r.params:
        p.grad = None
    with ActivationMeter() as meter:
        r.run(x, y)
    return int(meter.peak_bytes)


def _worker_body(rank: int, stages: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    import decentpy  # noqa: F401  (import cost before any timing)

    try:  # the same for torch's pipelining: its first import is not the first configuration's start-up
        import torch.distributed.pipelining  # noqa: F401
    except Exception:  # noqa: BLE001  (the configurations report it as n/a)
        pass
    x, y = make_batch(plan)
    ref_loss, ref_grads = reference(plan, rank, stages, x, y)
    cfgs = [PipeConfig(**c) for c in plan["configs"]]
    singles = [PipeConfig(SINGLE, "none", stages, m) for m in sorted({1} | {c.chunks for c in cfgs})]
    runners, failed = _build(singles + cfgs, rank, plan, timed=True)
    # warm-up: the first step's loss and gradients are the correctness check; with the
    # construction, the start-up cost
    for r in runners:
        dist.barrier()
        t_first, r.first_loss = r.step(x, y)
        r.startup_s = r.build_s + t_first
        if r.cfg.framework != SINGLE:
            r.grad_err = grad_error(r.params, ref_grads)
        elif rank == 0:
            r.grad_err = grad_error(r.params, reference_grads_all(plan, x, y))
        for _ in range(plan["warmup"] - 1):
            dist.barrier()
            r.step(x, y)
    # timing: interleaved rounds, order rotated each round
    for rnd in range(plan["rounds"]):
        k = rnd % len(runners)
        for r in runners[k:] + runners[:k]:
            for i in range(plan["rewarm"] + plan["chunk"]):
                dist.barrier()
                t, _ = r.step(x, y)
                if i >= plan["rewarm"]:
                    r.times.append(t)
    dist.barrier()
    # activation memory (untimed: the meter's hooks cost a Python call per saved tensor)
    pipes = [r for r in runners if r.cfg.framework != SINGLE]
    mb_ref: Dict[int, int] = {}
    if pipes and plan["memory"]:
        one = DecentpyRunner(PipeConfig("decentpy", "gpipe", stages, 1), rank, plan)
        for m in sorted({r.cfg.chunks for r in pipes}):
            n = plan["batch"] // m
            mb_ref[m] = _measure_act(one, x[:n].clone(), y[:n].clone())
        del one
        for r in pipes:
            r.act["peak"] = _measure_act(r, x, y)
    mine = [dict(key=r.cfg.key, times=r.times, loss=r.first_loss, grad_err=r.grad_err, act=r.act.get("peak"),
                 startup=r.startup_s) for r in runners]
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(runners=mine, mb_ref=mb_ref))
    if rank != 0:
        return {}
    results = []
    for i, r in enumerate(runners):
        per_rank = [e["runners"][i] for e in every]
        steps = list(zip(*[p["times"] for p in per_rank]))
        results.append(dict(
            cfg=asdict(r.cfg), step_max=[max(s) for s in steps], startup=max(p["startup"] for p in per_rank),
            loss=next((p["loss"] for p in per_rank if p["loss"] is not None), None),
            grad_err=max((p["grad_err"] for p in per_rank if p["grad_err"] is not None), default=None),
            act=None if r.cfg.framework == SINGLE or not plan["memory"] else [p["act"] for p in per_rank],
            mb_ref=None if r.cfg.framework == SINGLE or not plan["memory"] else
            [e["mb_ref"][r.cfg.chunks] for e in every]))
    return dict(results=results, failed=failed, ref_loss=ref_loss)


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------


def probe(stages: int, cfgs: Sequence[PipeConfig], plan: Dict[str, Any], timeout_s: float) -> Dict[str, str]:
    """Run-time check of ``cfgs`` on ``stages`` workers (two steps each): {key: why it is n/a}.

    All in one spawn; what that spawn leaves unresolved (a step failed, so later configurations
    could see stale messages; or the spawn died or hung) is probed again one configuration per
    spawn, each bounded by a timeout, so a hanging setting is named rather than waited for.
    """
    if not cfgs:
        return {}
    base = dict(plan, pipe_timeout_s=min(plan["pipe_timeout_s"], 20.0))
    why: Dict[str, str] = {}
    try:
        out = spawn_workers(_probe_body, stages, dict(base, configs=[asdict(c) for c in cfgs]), timeout_s,
                            pg_timeout_s=20.0)
        why.update({k: v for k, v in out["results"].items() if v})
        again = [c for c in cfgs if c.key in set(out["unresolved"])]
    except (RuntimeError, TimeoutError) as exc:
        print(f"  probe of all {len(cfgs)} configurations failed ({_first_line(exc, 120)}): probing each alone")
        again = list(cfgs)
    for c in again:
        try:
            out = spawn_workers(_probe_body, stages, dict(base, configs=[asdict(c)]), 60.0, pg_timeout_s=20.0)
            if out["results"].get(c.key):
                why[c.key] = out["results"][c.key]
        except TimeoutError:
            why[c.key] = "hangs: two steps did not finish within 60 s (probe)"
        except RuntimeError as exc:
            lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith((" ", "---", "Trace"))]
            last = lines[-1][:300] if lines else "a worker died"
            if "timeout" in last.lower() or "timed out" in last.lower():
                why[c.key] = f"hangs on some rank: another one timed out waiting for it (probe): {last}"
            else:
                why[c.key] = f"fails at run time (probe): {last}"
    return why


def build_configs(stages: Sequence[int], chunks: Sequence[int], frameworks: Sequence[str],
                  schedules: Sequence[str]) -> Dict[int, List[PipeConfig]]:
    return {s: [PipeConfig(fw, sch, s, m) for m in chunks for sch in schedules for fw in frameworks] for s in stages}


def summarize(raw: Dict[int, Dict[str, Any]], cfgs: Dict[int, List[PipeConfig]], na: Dict[str, str],
              plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Report rows: one per configuration (measured or n/a) and one single-process row per stage count."""
    rows: List[Dict[str, Any]] = []
    for s, group in cfgs.items():
        res = raw.get(s)
        by = {PipeConfig(**r["cfg"]).key: r for r in res["results"]} if res else {}
        t_single: Dict[int, float] = {}
        for key, r in by.items():
            c = PipeConfig(**r["cfg"])
            if c.framework == SINGLE:
                t_single[c.chunks] = statistics.median(r["step_max"])
        ref_loss = res["ref_loss"] if res else None
        for m in sorted({1} | {c.chunks for c in group}):
            single = by.get(PipeConfig(SINGLE, "none", s, m).key)
            if single:
                rows.append(_row(PipeConfig(SINGLE, "none", s, m), single, t_single, ref_loss, plan))
            for c in group:
                if c.chunks != m:
                    continue
                r = by.get(c.key)
                rows.append(_row(c, r, t_single, ref_loss, plan) if r else
                            dict(cfg=c, status="n/a", reason=na.get(c.key, "no result"), loss_single=ref_loss))
    by_key = {r["cfg"].key: r for r in rows}
    for r in rows:
        c = r["cfg"]
        if c.framework == "decentpy" and r["status"] == "ok":
            t = by_key.get(PipeConfig("torch", c.schedule, c.stages, c.chunks).key)
            r["vs_torch"] = t["step"] / r["step"] if t and t["status"] == "ok" else None
            r["startup_torch"] = t["startup"] if t and t["status"] == "ok" else None
    return rows


def _row(c: PipeConfig, res: Dict[str, Any], t_single: Dict[int, float], ref_loss: Optional[float],
         plan: Dict[str, Any]) -> Dict[str, Any]:
    st = res["step_max"]
    step = statistics.median(st)
    row: Dict[str, Any] = dict(cfg=c, status="ok", reason="", step=step, p25=percentile(st, 0.25),
                               p75=percentile(st, 0.75), steps=len(st), loss=res["loss"], loss_single=ref_loss, grad_err=res["grad_err"],
                               vs_torch=None, t_single=t_single.get(1), t_single_m=t_single.get(c.chunks),
                               startup=res.get("startup"))
    row["loss_err"] = (abs(res["loss"] - ref_loss) / abs(ref_loss)
                       if res["loss"] is not None and ref_loss else None)
    if c.framework == SINGLE:
        row.update(bubble=None, bubble_m=None, bubble_theory=None, act=None, mb_ref=None, act_ratio=None,
                   act_bound=None)
        return row
    s, m = c.stages, c.chunks
    row["bubble"] = 1.0 - row["t_single"] / (s * step) if row["t_single"] else None
    row["bubble_m"] = 1.0 - row["t_single_m"] / (s * step) if row["t_single_m"] else None
    row["bubble_theory"] = (s - 1) / (m + s - 1)
    row["act"], row["mb_ref"] = res["act"], res["mb_ref"]
    if res["act"] is not None:
        row["act_ratio"] = [a / b if b else None for a, b in zip(res["act"], res["mb_ref"])]
        # micro-batches alive at once on stage k: GPipe all m; 1F1B min(S - k, m)
        row["act_bound"] = [m if c.schedule == "gpipe" else min(s - k, m) for k in range(s)]
    else:
        row["act_ratio"] = row["act_bound"] = None
    return row


def _short(reason: str) -> str:
    """A table-sized reason (the full text is printed under the table and written to the CSV)."""
    if "must be greater than or equal to the number of stages" in reason:
        return "torch's Schedule1F1B refuses m < S"
    return reason if len(reason) <= 60 else reason[:57] + "..."


def _ms(x: Optional[float]) -> str:
    return fmt(None if x is None else x * 1e3, ".2f")


def _mibs(xs: Optional[Sequence[int]]) -> str:
    return "-" if xs is None else "/".join(f"{b / 2**20:.2f}" for b in xs)


def print_table(rows: List[Dict[str, Any]]) -> None:
    hdr = ["S", "m", "framework", "schedule", "median ms", "p25-p75 ms", "torch/this", "start-up ms", "bubble",
           "bubble (m mb)", "theory",
           "act MiB/stage", "act/1 mb", "1F1B bound", "loss rel err", "grad rel err", "note"]
    table = []
    for r in rows:
        c = r["cfg"]
        m = str(c.chunks)
        sch = "-" if c.framework == SINGLE else c.schedule
        if r["status"] != "ok":
            table.append([str(c.stages), m, c.framework, sch, "n/a", "-", "-", "-", "-", "-",
                          fmt((c.stages - 1) / (c.chunks + c.stages - 1), ".3f"), "-", "-", "-", "-", "-",
                          f"n/a ({_short(r['reason'])})"])
            continue
        ratio = "-" if not r.get("act_ratio") else "/".join(fmt(v, ".2f") for v in r["act_ratio"])
        bound = "-" if not r.get("act_bound") else "/".join(map(str, r["act_bound"]))
        table.append([str(c.stages), m, c.framework if c.framework != SINGLE else "single (1 process)", sch,
                      _ms(r["step"]), f"{r['p25'] * 1e3:.1f}-{r['p75'] * 1e3:.1f}", fmt(r.get("vs_torch"), ".2f", "x"),
                      _ms(r.get("startup")), fmt(r["bubble"], ".3f"), fmt(r["bubble_m"], ".3f"), fmt(r["bubble_theory"], ".3f"),
                      _mibs(r["act"]), ratio,
                      bound if c.schedule == "1f1b" else "-", fmt(r["loss_err"], ".1e"), fmt(r["grad_err"], ".1e"),
                      ""])
    print_table_rows(hdr, table, group=lambda t: (t[0], t[1]))
    print("median ms = one training step (forward+backward of the batch, every rank starting after a barrier), per "
          "step the max over ranks, median over the timed steps;\ntorch/this = torch's median / decentpy's at the "
          "same S, m, schedule (>1: decentpy is faster); start-up ms = construction + first step (each after a "
          "barrier; max over ranks);\nbubble = 1 - T_single / (S * T_step) (T_single: the single "
          "row of the same S, m=1);\nbubble (m mb) = the same with the single process running the m micro-batches one "
          "after the other (the pipeline's unavoidable compute); theory = (S-1)/(m+S-1); act MiB/stage = peak bytes saved for backward per stage "
          "(stage 0/1/...); act/1 mb = that over one micro-batch's worth (a decentpy chunks=1 pipe on one "
          "micro-batch);\n"
          "1F1B bound = micro-batches 1F1B keeps alive per stage, min(S-s, m); loss/grad rel err = first step vs the "
          "single-process model")


def print_startup(rows: List[Dict[str, Any]]) -> None:
    """Start-up cost (construction + first step) of decentpy beside torch's, per stage count and
    schedule: the range over the chunk counts."""
    lines = []
    for s in sorted({r["cfg"].stages for r in rows}):
        for sch in SCHEDULES:
            per = {fw: [r["startup"] for r in rows if r["cfg"].stages == s and r["cfg"].schedule == sch
                        and r["cfg"].framework == fw and r["status"] == "ok" and r.get("startup") is not None]
                   for fw in FRAMEWORKS}
            if not any(per.values()):
                continue
            text = ", ".join(f"{fw} {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} ms" if v else f"{fw} n/a"
                             for fw, v in per.items())
            lines.append(f"  S={s} {sch}: {text}")
    if lines:
        print("\nstart-up (construction + first step, max over ranks; range over the chunk counts):")
        print("\n".join(lines))


def check_targets(rows: List[Dict[str, Any]]) -> List[Tuple[str, Optional[bool], str]]:
    """(title, met (None: not measured), detail) for each target."""
    out: List[Tuple[str, Optional[bool], str]] = []
    dp = [r for r in rows if r["cfg"].framework == "decentpy" and r["status"] == "ok"]
    pairs = [r for r in dp if r.get("vs_torch") is not None]
    title = "decentpy no slower than torch.distributed.pipelining at equal settings (median step time)"
    if not pairs:
        out.append((title, None, "not measured: no setting where both ran"))
    else:
        ok = [r for r in pairs if r["vs_torch"] >= 1.0]
        close = [r for r in pairs if r["vs_torch"] >= 1.0 / (1.0 + SPEED_TOLERANCE)]
        slow = [f"S={r['cfg'].stages} m={r['cfg'].chunks} {r['cfg'].schedule} ({r['vs_torch']:.2f}x)"
                for r in pairs if r["vs_torch"] < 1.0]
        nocmp = [f"S={r['cfg'].stages} m={r['cfg'].chunks} {r['cfg'].schedule}" for r in dp if r.get("vs_torch") is None]
        detail = (f"{len(ok)} of {len(pairs)} settings (decentpy median <= torch median); {len(close)} of "
                  f"{len(pairs)} within {SPEED_TOLERANCE:.0%}" + (f"; slower: {', '.join(slow)}" if slow else "")
                  + (f"; no torch result to compare: {', '.join(nocmp)}" if nocmp else ""))
        out.append((title, len(ok) == len(pairs), detail))
    for s in sorted({r["cfg"].stages for r in rows}):
        title = f"decentpy 1F1B peak activation memory per stage <= {s} micro-batches' worth (S={s})"
        one = [r for r in dp if r["cfg"].stages == s and r["cfg"].schedule == "1f1b" and r.get("act_ratio")]
        if not one:
            out.append((title, None, "not measured (no decentpy 1F1B run, or --no-memory)"))
            continue
        worst = max(one, key=lambda r: max(v or 0.0 for v in r["act_ratio"]))
        wv = max(v or 0.0 for v in worst["act_ratio"])
        ok_total = all(max(v or 0.0 for v in r["act_ratio"]) <= s + MEMORY_SLACK for r in one)
        ok_stage = all((v or 0.0) <= b + MEMORY_SLACK for r in one for v, b in zip(r["act_ratio"], r["act_bound"]))
        out.append((title, ok_total, f"max over stages and m: {wv:.2f} micro-batches (m={worst['cfg'].chunks}); "
                                     f"per stage within min(S-s, m): {'yes' if ok_stage else 'NO'}"))
    return out


CSV_FIELDS = ["framework", "schedule", "stages", "chunks", "micro_batch", "batch", "width", "blocks", "status",
              "reason", "step_time_s", "step_time_p25_s", "step_time_p75_s", "timed_steps", "startup_s",
              "startup_torch_s", "single_step_time_s",
              "single_m_step_time_s", "bubble_measured", "bubble_measured_m", "bubble_theory", "speedup_vs_torch", "loss_first_step", "loss_single",
              "loss_rel_err", "grad_rel_err", "act_peak_bytes_stages", "act_one_mb_bytes_stages", "act_ratio_stages",
              "act_ratio_max", "act_bound_1f1b_stages", "cpu", "cores", "torch"]


def write_csv(path: Path, rows: List[Dict[str, Any]], plan: Dict[str, Any], machine: Dict[str, str]) -> None:
    def g(x: Optional[float], spec: str = ".6g") -> str:
        return cell(x, spec)

    def row(r: Dict[str, Any]) -> Dict[str, Any]:
        c = r["cfg"]
        ok = r["status"] == "ok"
        ratios = r.get("act_ratio") or []
        return dict(
            framework=c.framework, schedule=c.schedule, stages=c.stages, chunks=c.chunks,
            micro_batch=plan["batch"] // c.chunks, batch=plan["batch"], width=plan["width"], blocks=plan["blocks"],
            status=r["status"], reason=r.get("reason", ""),
            step_time_s=g(r.get("step")), step_time_p25_s=g(r.get("p25")), step_time_p75_s=g(r.get("p75")),
            timed_steps=r.get("steps", ""), startup_s=g(r.get("startup")), startup_torch_s=g(r.get("startup_torch")),
            single_step_time_s=g(r.get("t_single")) if ok else "",
            single_m_step_time_s=g(r.get("t_single_m")) if ok else "",
            bubble_measured=g(r.get("bubble")), bubble_measured_m=g(r.get("bubble_m")),
            bubble_theory=g(r.get("bubble_theory")),
            speedup_vs_torch=g(r.get("vs_torch"), ".4f"), loss_first_step=g(r.get("loss"), ".9g"),
            loss_single=g(r.get("loss_single"), ".9g"), loss_rel_err=g(r.get("loss_err"), ".3e"),
            grad_rel_err=g(r.get("grad_err"), ".3e"),
            act_peak_bytes_stages=";".join(map(str, r.get("act") or [])),
            act_one_mb_bytes_stages=";".join(map(str, r.get("mb_ref") or [])),
            act_ratio_stages=";".join(format(v, ".4f") for v in ratios if v is not None),
            act_ratio_max=g(max((v for v in ratios if v is not None), default=None), ".4f"),
            act_bound_1f1b_stages=";".join(map(str, r.get("act_bound") or [])) if c.schedule == "1f1b" else "",
            cpu=machine["cpu"], cores=machine["cores"], torch=machine["torch"])

    write_rows_csv(path, CSV_FIELDS, (row(r) for r in rows))


def plot(path: Path, rows: List[Dict[str, Any]], machine: Dict[str, str], plan: Dict[str, Any]) -> Optional[Path]:
    """Step time vs chunks, one line per framework x schedule, one panel per stage count."""
    plt = pyplot("`make bench-pipe` installs it")
    if plt is None:
        return None
    stages = sorted({r["cfg"].stages for r in rows})
    style = {("decentpy", "gpipe"): ("#1f77b4", "-", "o"), ("decentpy", "1f1b"): ("#1f77b4", "--", "s"),
             ("torch", "gpipe"): ("#d62728", "-", "o"), ("torch", "1f1b"): ("#d62728", "--", "s")}
    fig, axes = plt.subplots(1, len(stages), figsize=(6.2 * len(stages), 4.4), squeeze=False)
    for ax, s in zip(axes[0], stages):
        srows = [r for r in rows if r["cfg"].stages == s and r["status"] == "ok"]
        for (fw, sch), (color, ls, mk) in style.items():
            pts = sorted((r["cfg"].chunks, r) for r in srows if r["cfg"].framework == fw and r["cfg"].schedule == sch)
            if not pts:
                continue
            xs = [m for m, _ in pts]
            ys = [r["step"] * 1e3 for _, r in pts]
            err = [[(r["step"] - r["p25"]) * 1e3 for _, r in pts], [(r["p75"] - r["step"]) * 1e3 for _, r in pts]]
            ax.errorbar(xs, ys, yerr=err, color=color, ls=ls, marker=mk, capsize=2, label=f"{fw} {sch}")
        singles = {r["cfg"].chunks: r["step"] * 1e3 for r in srows if r["cfg"].framework == SINGLE}
        chunks = sorted({r["cfg"].chunks for r in rows if r["cfg"].stages == s and r["cfg"].framework != SINGLE})
        if 1 in singles:
            ax.axhline(singles[1], color="#7f7f7f", lw=1, label="single process, whole batch")
        ms = [m for m in chunks if m in singles]
        if ms:
            ax.plot(ms, [singles[m] for m in ms], color="#7f7f7f", ls="--", marker=".",
                    label="single process, m micro-batches in turn")
            ax.plot(ms, [singles[m] / s * (m + s - 1) / m for m in ms], color="#7f7f7f", ls=":",
                    label="ideal pipeline: that / S x (m+S-1)/m")
        ax.set_xscale("log", base=2)
        ax.set_xticks(chunks)
        ax.set_xticklabels([str(m) for m in chunks])
        ax.set_xlabel("chunks m (micro-batches per batch)")
        note = f" ({s} processes on {machine['cores']} cores)" if s > int(machine["cores"]) else ""
        finish_axes(ax, "median step time (ms)", f"S={s} stages{note}", legend_size=7)
    return finish_figure(fig, f"{plan['blocks']} x (Linear({plan['width']}) + ReLU), batch {plan['batch']}, gloo on "
                         f"CPU; lines: median, whiskers: p25-p75; {machine['cpu']}, torch {machine['torch']}", path)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--stages", default="2,4", help="comma-separated stage counts (one worker process per stage)")
    p.add_argument("--chunks", default="1,2,4,8,16", help="comma-separated micro-batch counts (each must divide "
                   "the batch)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {','.join(FRAMEWORKS)} "
                   "(the single-process baseline always runs)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, from {','.join(SCHEDULES)}")
    p.add_argument("--width", type=int, default=512, help="Linear width D")
    p.add_argument("--blocks", type=int, default=8, help="Linear+ReLU blocks")
    p.add_argument("--batch", type=int, default=256, help="rows per batch")
    add_run_args(p, rounds=8, chunk=5, plot=True)
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 stages, chunks 1,2, an 8 x 128 model on a "
                   "batch of 16, 1 warm-up step, 1 round of 3 timed steps")
    p.add_argument("--no-probe", action="store_true", help="skip the run-time probe (a setting that fails at run time "
                   "then aborts its stage count's run instead of showing as n/a)")
    p.add_argument("--no-memory", action="store_true", help="skip the activation-memory pass")
    args = p.parse_args(argv)
    if args.quick:
        quick_timing(args, warmup=1)
        for name, val in (("stages", "2"), ("chunks", "1,2"), ("width", 128), ("batch", 16)):
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, val)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stages = [int(s) for s in csv_list(args.stages)]
    chunks = [int(m) for m in csv_list(args.chunks)]
    frameworks = csv_list(args.frameworks)
    schedules = csv_list(args.schedules)
    check_choices(frameworks, FRAMEWORKS, "framework")
    check_choices(schedules, SCHEDULES, "schedule")
    for s in stages:
        if not 2 <= s <= args.blocks:
            raise SystemExit(f"--stages {s}: need 2 <= stages <= blocks ({args.blocks})")
    for m in chunks:
        if m <= 0 or args.batch % m:
            raise SystemExit(f"--chunks {m}: must divide the batch ({args.batch}) so that every framework cuts the "
                             "same equal micro-batches")
    machine = report_machine()
    t_start = time.perf_counter()
    plan: Dict[str, Any] = dict(width=args.width, blocks=args.blocks, batch=args.batch, seed=args.seed,
                                warmup=max(1, args.warmup), rounds=args.rounds, chunk=args.chunk, rewarm=args.rewarm,
                                memory=not args.no_memory, pipe_timeout_s=min(300.0, args.timeout))
    print(f"model: {args.blocks} x (Linear({args.width}, {args.width}) + ReLU), batch {args.batch} (float32), MSE "
          "against a fixed random target, gradients only (no optimizer step); same seed everywhere; balance "
          f"{', '.join(f'S={s}: {balance(args.blocks, s)}' for s in stages)} layers")
    print("decentpy: AsyncPipe(checkpoint='never') + train_step; torch: torch.distributed.pipelining PipelineStage + "
          "ScheduleGPipe / Schedule1F1B (return_outputs=False); gloo on 127.0.0.1, 1 torch thread per process")
    print(f"timing: {plan['warmup']} warm-up steps per configuration, then {args.rounds} interleaved rounds x "
          f"({args.rewarm} untimed + {args.chunk} timed) steps = {args.rounds * args.chunk} timed steps; a barrier "
          "before every step; per step the max over ranks; median")
    cores = os.cpu_count() or 1
    for s in stages:
        if s > cores:
            print(f"caveat: {s} stage processes share {cores} cores: the S={s} numbers are oversubscribed (the stages "
                  f"cannot all compute at once, so step times and the measured bubble include waiting for a core; "
                  f"at best {cores}/{s} of the pipeline runs at a time)")
    all_cfgs = build_configs(stages, chunks, frameworks, schedules)
    na: Dict[str, str] = {}
    if "torch" in frameworks:
        try:
            import torch.distributed.pipelining  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            for group in all_cfgs.values():
                for c in group:
                    if c.framework == "torch":
                        na[c.key] = f"torch.distributed.pipelining does not import: {_first_line(exc)}"
    raw: Dict[int, Dict[str, Any]] = {}
    failed_groups = 0
    for s in stages:
        cfgs = [c for c in all_cfgs[s] if c.key not in na]
        if not args.no_probe:
            t0 = time.perf_counter()
            na.update(probe(s, cfgs, plan, timeout_s=min(args.timeout, 180.0)))
            print(f"[S={s}] run-time probe of {len(cfgs)} configurations: {time.perf_counter() - t0:.0f} s, "
                  f"{sum(1 for c in cfgs if c.key in na)} n/a", flush=True)
        cfgs = [c for c in cfgs if c.key not in na]
        t0 = time.perf_counter()
        print(f"[S={s}] {len(cfgs)} configurations + the single-process model ({len(set(chunks) | {1})} "
              "micro-batch counts) ...", flush=True)
        try:
            raw[s] = spawn_workers(_worker_body, s, dict(plan, configs=[asdict(c) for c in cfgs]), args.timeout,
                                   pg_timeout_s=300.0)
            na.update(raw[s]["failed"])
            print(f"[S={s}] done in {time.perf_counter() - t0:.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as exc:
            failed_groups += 1
            print(f"[S={s}] FAILED after {time.perf_counter() - t0:.0f} s:\n{exc}", flush=True)
            for c in cfgs:
                na[c.key] = f"the S={s} measurement run failed: {_first_line(exc, 120)}"
    rows = summarize(raw, all_cfgs, na, plan)
    print()
    print_table(rows)
    print_startup(rows)
    print("bubble caveat: the measured bubble assumes balanced stages (equal blocks per stage here) and counts "
          "communication and framework overhead as bubble" + ("; with more stage processes than cores it also counts "
                                                               "waiting for a core" if max(stages) > cores else ""))
    if na:
        print("\nn/a settings:")
        for k, why in na.items():
            print(f"  {k}: {why}")
    print_targets(check_targets(rows))
    out = Path(args.out)
    csv_path = out / "bench_pipe.csv"
    write_csv(csv_path, rows, plan, machine)
    print(f"\nwrote {csv_path}")
    if not args.no_plot:
        png = plot(out / "bench_pipe.png", rows, machine, plan)
        if png is not None:
            print(f"wrote {png}")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 1 if failed_groups else 0


if __name__ == "__main__":
    sys.exit(main())

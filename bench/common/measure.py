"""Step-time and memory measurement inside the worker processes, shared by bench_train, bench_shard
and bench_hybrid, so that their figures are taken the same way.

A benchmark subclasses :class:`Runner` (``build`` wraps the model for each of its frameworks) and
runs, per worker: :func:`prime` (one-time costs into the baseline), :func:`measure_and_time` (each
configuration's memory alone, then all of them timed in interleaved rounds) and
:func:`gather_results` (per step the max over ranks, memory figures); the driver turns each result
into a report row with :func:`timing_row`.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from bench.common.models import make_batches, make_model
from bench.common.tables import percentile

__all__ = ["AER_LOCAL", "Config", "Runner", "gather_results", "measure_and_time", "prime", "rss_bytes",
           "state_bytes", "timing_row", "trim"]

AER_LOCAL = 2  # alternating-exp-ring needs >= 2 ranks per node: the benchmarks simulate nodes of 2


@dataclass(frozen=True)
class Config:
    """One measured configuration (plain fields: it travels to the workers as a dict)."""

    framework: str
    topology: str  # a topology name, "allreduce" (torch-ddp) or "none" (local), or a set-up label
    workers: int
    model: str
    node_size: int = 0  # ranks per node of alternating-exp-ring; 0: AER_LOCAL (the simulated nodes)

    @property
    def local_world_size(self) -> int:
        return (self.node_size or AER_LOCAL) if self.topology == "alternating-exp-ring" else self.workers

    @property
    def key(self) -> str:
        return f"{self.model}/{self.workers}/{self.framework}/{self.topology}"


# ----------------------------------------------------------------------------------------------
# process memory
# ----------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def trim() -> None:
    """Free dead objects and return free heap pages to the OS, so RSS counts live memory only."""
    from decentpy.host_memory import release_free_host_memory

    gc.collect()
    release_free_host_memory()


# ----------------------------------------------------------------------------------------------
# one configuration in one worker
# ----------------------------------------------------------------------------------------------


class Runner:
    """One configuration inside one worker: model, wrapper, optimizer, data, step times.

    The memory bookkeeping brackets the model and its wrapper: RSS before the model, after it,
    and the high-water mark from there on. Subclasses implement :meth:`build`; they may replace
    the data (:meth:`load_batches`), the model (:meth:`new_model`) and the step."""

    def __init__(self, cfg: Config, rank: int, seed: int) -> None:
        import torch.nn.functional as F

        self.cfg = cfg
        self.rank = rank
        self.F = F
        self.i = 0
        self.times: List[float] = []
        self.compute: List[float] = []
        self.cpu: List[float] = []  # CPU seconds of this process (all its threads) per timed step
        self.opt: Any = None
        self.zero_grad_kwargs: Dict[str, Any] = {}  # build() may ask for another zero_grad mode
        self.batches = self.load_batches(seed)
        trim()
        self.hwm_ok = _reset_hwm()
        self.rss0 = rss_bytes()
        model = self.new_model(seed)
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # this rank's
        self.rss_model = rss_bytes()
        self.build(model)
        self.net.train()

    def load_batches(self, seed: int) -> List[Tuple[Any, Any]]:
        """This rank's batches (the steps cycle through them)."""
        return make_batches(self.cfg.model, seed, self.rank)

    def new_model(self, seed: int) -> Any:
        """The model to wrap, the same on every rank."""
        return make_model(self.cfg.model, seed)

    def build(self, model: Any) -> None:
        """Wrap ``model`` for ``self.cfg.framework``: set ``self.net`` and ``self.opt`` (None when the
        wrapper steps inside backward)."""
        raise NotImplementedError

    def step(self) -> Tuple[float, float]:
        """One training step: its wall time and that of its forward + backward, seconds."""
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = time.perf_counter()
        loss = self.F.cross_entropy(self.net(x), y)
        loss.backward()  # decentralized wrappers mix, step and launch the exchange in here
        t1 = time.perf_counter()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(**self.zero_grad_kwargs)
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0

    def extra_figures(self) -> Dict[str, float]:
        """Figures of this configuration beyond the timings (a framework's own counters), reported as
        the max over ranks (``extra`` in the gathered results)."""
        return {}

    def finish(self) -> None:
        """Complete in-flight exchanges before the configuration is dropped."""
        from decentpy import DecentralizedDataParallel

        if isinstance(self.net, DecentralizedDataParallel):  # decent-dp's wrapper has no wait()
            self.net.wait()

    def after_warmup(self) -> None:
        hwm = _hwm_bytes() if self.hwm_ok else None
        trim()  # steady: live memory only (freed pages returned to the OS first)
        self.rss1 = rss_bytes()
        self.hwm = hwm if hwm is not None else self.rss1


def state_bytes(opt: Any) -> int:
    """Bytes of the tensors held in ``opt``'s state on this rank, each storage counted once.

    For the sharded optimizers (decentpy / fairscale OSS, torch ZeRO) the local shard's optimizer
    (``opt.optim``) holds the state; for a plain optimizer, ``opt`` itself.
    """
    import torch

    inner = getattr(opt, "optim", None)
    inner = inner if isinstance(inner, torch.optim.Optimizer) else opt
    seen: Dict[Tuple[str, int], int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            key = (str(x.device), st.data_ptr())
            if st.data_ptr() == 0:  # empty storage: count the tensor's own bytes (0)
                key = (str(x.device), id(x))
            seen[key] = max(seen.get(key, 0), st.nbytes())
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for per_param in inner.state.values():
        visit(per_param)
    return int(sum(seen.values()))


# ----------------------------------------------------------------------------------------------
# a worker's configurations
# ----------------------------------------------------------------------------------------------

RunnerClass = Type[Runner]


def _warm_runner(cfg: Config, rank: int, plan: Dict[str, Any], steps: int, runner_cls: RunnerClass) -> Runner:
    """Build ``cfg`` on every rank (after a barrier) and run ``steps`` untimed steps."""
    import torch.distributed as dist

    dist.barrier()
    r = runner_cls(cfg, rank, plan["seed"])
    for _ in range(steps):
        r.step()
    return r


def _measure_memory(cfg: Config, rank: int, plan: Dict[str, Any], runner_cls: RunnerClass) -> List[float]:
    """Build ``cfg`` alone, warm it up, free it: its memory figures (bytes) without the others alive."""
    r = _warm_runner(cfg, rank, plan, plan["warmup"], runner_cls)
    r.after_warmup()
    mem = [r.rss0, r.rss_model, r.rss1, r.hwm]
    r.finish()
    del r
    trim()
    return mem


def prime(cfgs: Sequence[Config], rank: int, plan: Dict[str, Any], runner_cls: RunnerClass) -> None:
    """One throw-away configuration per framework (when ``plan["primer"]``): one-time costs (lazy
    thread pools, kernel dispatch tables, gloo transport) land in the baseline, not in the first
    configuration measured. Ends trimmed, after a barrier."""
    import torch.distributed as dist

    seen = set() if plan["primer"] else {c.framework for c in cfgs}
    for cfg in cfgs:
        if cfg.framework in seen:
            continue
        seen.add(cfg.framework)
        primer = _warm_runner(cfg, rank, plan, max(2, plan["warmup"]), runner_cls)
        primer.finish()
        del primer
        trim()
    dist.barrier()
    trim()


def measure_and_time(cfgs: Sequence[Config], rank: int, plan: Dict[str, Any],
                     runner_cls: RunnerClass) -> Tuple[List[Runner], List[List[float]]]:
    """Memory pass, then timing pass; the live runners (with their step times) and memory figures."""
    import torch.distributed as dist

    # Memory pass: each configuration alone (built, warmed up, freed), so that one
    # configuration's heap does not shape the next one's peak.
    mems = [_measure_memory(cfg, rank, plan, runner_cls) for cfg in cfgs]
    # Timing pass: all configurations alive, timed in interleaved rounds.
    runners: List[Runner] = [_warm_runner(cfg, rank, plan, plan["warmup"], runner_cls) for cfg in cfgs]
    for rnd in range(plan["rounds"]):
        order = runners[rnd % len(runners):] + runners[:rnd % len(runners)]
        for r in order:
            dist.barrier()
            for _ in range(plan["rewarm"]):
                r.step()
            for _ in range(plan["chunk"]):
                c0 = time.process_time()
                t, c = r.step()
                r.cpu.append(time.process_time() - c0)
                r.times.append(t)
                r.compute.append(c)
    dist.barrier()
    return runners, mems


def gather_results(runners: Sequence[Runner], mems: Sequence[List[float]], base_rss: float, rank: int,
                   n: int) -> List[Dict[str, Any]]:
    """Per configuration, the step times (max over ranks per step) and memory figures (max over
    ranks); collective, the list is filled on rank 0 only."""
    import torch
    import torch.distributed as dist

    results = []
    for r, m in zip(runners, mems):
        t = torch.tensor([r.times, r.compute, r.cpu], dtype=torch.float64)
        allt = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(allt, t)
        mem = torch.tensor(list(m) + [base_rss], dtype=torch.float64)
        allm = [torch.empty_like(mem) for _ in range(n)]
        dist.all_gather(allm, mem)
        extra = r.extra_figures()
        allx: List[Any] = [None] * n
        dist.all_gather_object(allx, extra)
        if rank == 0:
            st = torch.stack(allt)  # [n, 3, steps]
            step_max = st[:, 0].max(0).values.tolist()
            comp_max = st[:, 1].max(0).values.tolist()
            # CPU of one step of the whole job: what the step costs the machine, independent of
            # how other load shares the cores (wall times on an oversubscribed machine are not)
            cpu_sum = st[:, 2].sum(0).tolist()
            mm = torch.stack(allm)  # [n, 5]: rss0, rss_model, rss1, hwm, base
            results.append(dict(
                cfg=asdict(r.cfg), step_max=step_max, compute_max=comp_max, cpu_sum=cpu_sum,
                param_bytes=r.param_bytes,
                base_rss=float(mm[:, 4].max()),
                peak_delta=float((mm[:, 3] - mm[:, 0]).max()),
                steady_delta=float((mm[:, 2] - mm[:, 0]).max()),
                wrap_delta=float((mm[:, 2] - mm[:, 1]).max()),
                hwm_reset=r.hwm_ok, extra={k: max(x[k] for x in allx) for k in extra}))
    return results


# ----------------------------------------------------------------------------------------------
# driver side
# ----------------------------------------------------------------------------------------------


def timing_row(res: Dict[str, Any]) -> Dict[str, Any]:
    """One configuration's gathered results as a report row: its Config, median / quartile step
    times (the max over ranks per step), compute time, CPU seconds per step summed over the
    workers, parameter bytes and peak RSS."""
    return dict(cfg=Config(**res["cfg"]), step=statistics.median(res["step_max"]),
                cpu=statistics.median(res["cpu_sum"]),
                p25=percentile(res["step_max"], 0.25), p75=percentile(res["step_max"], 0.75),
                steps=len(res["step_max"]), compute=statistics.median(res["compute_max"]),
                param_bytes=res["param_bytes"], peak_rss=res["base_rss"] + res["peak_delta"])

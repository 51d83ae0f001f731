"""The training loop of the byte-level LM: one arm (framework + mode) for one seed, one row per
evaluation. ``examples/train_lm.py`` and the ``bench-lm`` benchmark both call :func:`run_arm`.

Every arm trains the same model from the same initial values on the same batches (a pure function
of seed, rank, world size and step: :func:`examples.lm.corpus.train_batch`; by default each step's
global batch is drawn from the whole training text and split over the ranks, as torch's
``DistributedSampler`` does, ``data_split="shard"`` gives each rank its own contiguous shard
instead) with the same optimizer and schedule: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices
only, as ``decentpy.optim.split_decay_groups`` splits them), a linear warm-up from 1% of the peak
rate over ``warmup_steps`` steps (default: 5% of the steps), then a cosine decay to 10% of it
(``decentpy.optim.lr_scheduler_fn_cosine_with_warmup`` builds it for every framework), gradients
clipped to the norm ``grad_clip`` (default 1.0; torch DDP and torchft clip over the model, decentpy
per bucket -- one bucket for the presets' models unless fragments split them -- and decent-dp per
bucket through its own ``grad_clip_norm``, since it steps inside the backward). The global batch is fixed per
preset and split over the workers, so every arm sees the same tokens per step. Local-steps arms
take DiLoCo's outer Nesterov SGD (lr 0.7, momentum 0.9) unless ``outer_lr`` / ``outer_momentum``
say otherwise (momentum 0: plain SGD; lr 1, momentum 0: plain averaging of the replicas).

Modes:

- ``ddp``: torch ``DistributedDataParallel``, gradients all-reduced every step.
- ``ddp-powersgd``: the same with torch's PowerSGD comm hook (rank 4, error feedback, warm start,
  2 steps of plain all-reduce first; one bucket, see :func:`_build_ddp`).
- ``decentpy``: :class:`decentpy.DecentralizedDataParallel` with ``topology``, ``compression``
  (None or ``"int8"``) and ``intra_node`` (``"gossip"``, ``"shard"``, ``"allreduce"``).
- ``decent-dp``: the pure-Python decent-dp 0.2.3 package with ``topology``.

At each evaluation (step 0 and ``evals`` evenly spaced steps up to the last) every rank joins:
the consensus distance of the workers' parameters, each worker's own model's held-out loss (their
mean is ``val_bits_per_byte_workers_mean``), then the averaged model's loss
(``val_bits_per_byte``: decentpy and decent-dp ``global_avg(will_revert=True)``, evaluate,
``revert_global_avg()``; torch DDP's replicas are the average already). ``wall_s`` is training
time only, the largest over the ranks: evaluations are not counted, but the exchanges still in
flight when one begins are finished inside the training time (``ddp.wait()``), so an arm that
overlaps its communication is not credited with the last one.

Bytes sent per worker (the mean over the ranks), one definition for every arm, decentpy's own
(``DecentralizedDataParallel.bytes_sent``): the payload a worker sends to a peer, and for an
all-reduce the buffer it contributes. On the wire an all-reduce over m workers moves about
2 (m - 1) / m times its contribution per worker (a ring: 1.5x at m = 4; 1x for a pair), so torch
DDP's wire bytes at n workers are 2 (n - 1) / n times its column, as are those of decentpy's and
decent-dp's groups of more than two; the throttled-link wall times show what that costs. By
``bytes_source``:

- ``decentpy.stats``: ``ddp.stats()["bytes_sent"]`` (``ddp.bytes_sent`` where the wrapper has no
  ``stats()``). It counts the gossip exchanges; with ``intra_node="shard"`` or ``"allreduce"`` the
  reduce-scatter / all-gather / all-reduce inside a node are not in it (they run on the node's
  process group, not through the communicator that counts).
- ``allreduce(gradients)``: torch DDP, computed: every step all-reduces every fp32 gradient.
- ``allreduce(powersgd)``: counted in PowerSGD's hook: the whole bucket in its plain steps, then
  the P and Q factors and the tensors it leaves uncompressed
  (``PowerSGDState.total_numel_after_compression``).
- ``allreduce(decent-dp)``: decent-dp all-reduces every parameter within each step's group (when
  the group has another worker), as its hooks launch them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .corpus import Corpus, train_batch, val_windows
from .model import ByteTransformer, ModelConfig, count_parameters, preset

__all__ = ["MODES", "COLUMNS", "RunSpec", "Schedule", "schedule", "run_arm", "bits_per_byte", "TorchftStandInManager",
           "DILOCO_OUTER", "NOLOCO_OUTER", "SPARSELOCO_OUTER", "OUTER_RULES", "outer_settings", "measure_throughput", "tokens_for_budget"]

MODES = ("ddp", "ddp-powersgd", "decentpy", "decent-dp", "torchft-diloco")
FRAMEWORK = {"ddp": "torch", "ddp-powersgd": "torch", "decentpy": "decentpy", "decent-dp": "decent-dp",
             "torchft-diloco": "torchft"}
COMPRESSIONS = (None, "int8")
INTRA_NODE = ("gossip", "shard", "allreduce")
POWERSGD_RANK = 4
BETAS = (0.9, 0.95)
EPS = 1e-8

#: what ``state_avg`` may name: Adam's second moment, or both moments
STATE_AVG = ("exp_avg_sq", "exp_avg,exp_avg_sq")
#: the outer step of local steps: DiLoCo's (from the mixed global copy), NoLoCo's (decentpy.LocalSteps.noloco)
#: or SparseLoCo's (decentpy.LocalSteps.sparseloco: the error-fed sparse exchange, an outer SGD without momentum)
OUTER_RULES = ("diloco", "noloco", "sparseloco")

#: the columns of a row, in order (the benchmark's CSV writes them so)
COLUMNS = ("framework", "mode", "topology", "compression", "intra_node", "local_steps", "fragments", "link_mbit",
           "workers", "preset", "seed", "data_split", "peak_lr", "grad_clip", "warmup_steps", "outer_rule",
           "outer_lr", "outer_momentum", "state_averaging", "budget_s",
           "step", "tokens", "wall_s", "bytes_sent_per_worker", "val_bits_per_byte",
           "val_bits_per_byte_workers_mean", "consensus_distance", "skipped_steps", "train_bits_per_byte",
           "tokens_per_s", "lr", "params", "bytes_source", "corpus", "corpus_bytes", "corpus_hash", "device")


@dataclass
class RunSpec:
    """One arm for one seed. None fields take the preset's value (``lr``, ``global_batch``,
    ``context``) or, for ``local_world_size``, 2 (two simulated nodes at 4 workers)."""

    mode: str = "decentpy"
    topology: str = "ring"  # decentpy and decent-dp only
    compression: Optional[str] = None  # decentpy only
    intra_node: str = "gossip"  # decentpy only
    local_steps: int = 1  # decentpy only: H inner steps between outer steps (DiLoCo; 1: gossip every step)
    fragments: int = 1  # decentpy local steps only: Streaming DiLoCo's fragments (groups of buckets)
    fragment_sync_delay: int = 0  # inner steps a fragment's exchange stays in flight
    fragment_update_alpha: float = 0.0  # the merge of those steps after the fragment's outer step
    preset: str = "small"
    tokens: int = 1_000_000  # the budget: steps = tokens // (global_batch * context)
    seed: int = 0
    evals: int = 8
    val_windows: int = 64
    lr: Optional[float] = None
    global_batch: Optional[int] = None
    context: Optional[int] = None
    local_world_size: Optional[int] = None
    warmup_frac: float = 0.05
    warmup_steps: Optional[int] = None  # the warm-up in steps (None: warmup_frac of the steps)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # the gradient norm every arm clips to (0: none)
    data_split: str = "shuffle"  # examples.lm.corpus.SPLITS: the whole text shuffled, or a shard per rank
    outer_lr: Optional[float] = None  # local steps: the outer SGD's lr (None: DiLoCo's 0.7)
    outer_momentum: Optional[float] = None  # local steps: its Nesterov momentum (None: DiLoCo's 0.9; 0: plain)
    outer_rule: str = "diloco"  # local steps: OUTER_RULES ('noloco': heavy-ball, pulled to the peers' copies)
    state_avg_every: int = 0  # decentpy only: average the AdamW states over the workers every this many steps (0: never)
    state_avg: str = "exp_avg_sq"  # which: 'exp_avg_sq' or 'exp_avg,exp_avg_sq' (decentpy.OptimizerStateAveraging)
    link_mbit: Optional[float] = None  # recorded in the rows only (the benchmark throttles the link)
    budget_s: Optional[float] = None  # recorded in the rows only: the wall-clock budget this token count fills
    log_every: int = 0  # on_log every this many steps (0: never)

    def check(self, world_size: int) -> None:
        """Raise ValueError naming the bad value and what is valid, the same on every rank."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: choose from {', '.join(MODES)}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be None or 'int8', got {self.compression!r}")
        if self.intra_node not in INTRA_NODE:
            raise ValueError(f"intra_node must be one of {', '.join(INTRA_NODE)}, got {self.intra_node!r}")
        if self.mode != "decentpy" and (self.compression is not None or self.intra_node != "gossip"):
            raise ValueError(f"compression={self.compression!r} / intra_node={self.intra_node!r} are decentpy's "
                             f"options; mode {self.mode!r} takes neither (use mode 'decentpy')")
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ValueError(f"local_steps must be an int >= 1, got {self.local_steps!r}")
        if self.mode == "torchft-diloco" and self.local_steps < 2:
            raise ValueError(f"mode 'torchft-diloco' is torchft 0.2.0's DiLoCo: give local_steps >= 2 (its "
                             f"sync_every), got {self.local_steps}")
        if self.local_steps > 1 and self.mode not in ("decentpy", "torchft-diloco"):
            raise ValueError(f"local_steps={self.local_steps} is decentpy's (or mode 'torchft-diloco'), got mode "
                             f"{self.mode!r}")
        if (self.fragments != 1 or self.fragment_sync_delay or self.fragment_update_alpha) and (
                self.mode != "decentpy" or self.local_steps < 2):
            raise ValueError(f"fragments={self.fragments} / fragment_sync_delay={self.fragment_sync_delay} / "
                             f"fragment_update_alpha={self.fragment_update_alpha} stream decentpy's local steps: "
                             f"give mode 'decentpy' and local_steps >= 2 (got mode {self.mode!r}, local_steps="
                             f"{self.local_steps})")
        if self.tokens < 1 or self.evals < 1 or self.val_windows < 1:
            raise ValueError(f"tokens, evals and val_windows must be >= 1, got {self.tokens}, {self.evals}, "
                             f"{self.val_windows}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                                              or self.warmup_steps < 0):
            raise ValueError(f"warmup_steps must be an int >= 0 or None, got {self.warmup_steps!r}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ValueError(f"grad_clip must be a finite number >= 0 (0: no clipping), got {self.grad_clip}")
        from .corpus import SPLITS
        if self.data_split not in SPLITS:
            raise ValueError(f"data_split must be one of {', '.join(map(repr, SPLITS))}, got {self.data_split!r}")
        if (self.outer_lr is not None or self.outer_momentum is not None) and self.local_steps < 2:
            raise ValueError(f"outer_lr / outer_momentum are the outer step's, with local_steps >= 2 (got local_steps="
                             f"{self.local_steps})")
        if self.outer_rule not in OUTER_RULES:
            raise ValueError(f"outer_rule must be one of {', '.join(map(repr, OUTER_RULES))}, got {self.outer_rule!r}")
        if self.outer_rule != "diloco" and (self.mode != "decentpy" or self.local_steps < 2):
            raise ValueError(f"outer_rule={self.outer_rule!r} is decentpy's local steps: give mode 'decentpy' and "
                             f"local_steps >= 2 (got mode {self.mode!r}, local_steps={self.local_steps})")
        if self.outer_lr is not None and not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ValueError(f"outer_lr must be a finite number > 0, got {self.outer_lr}")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if isinstance(self.state_avg_every, bool) or not isinstance(self.state_avg_every, int) or \
                self.state_avg_every < 0:
            raise ValueError(f"state_avg_every must be an int >= 0 (0: never), got {self.state_avg_every!r}")
        if self.state_avg_every and self.mode != "decentpy":
            raise ValueError(f"state_avg_every is decentpy's OptimizerStateAveraging: give mode 'decentpy' (got mode "
                             f"{self.mode!r})")
        if self.state_avg not in STATE_AVG:
            raise ValueError(f"state_avg must be one of {', '.join(map(repr, STATE_AVG))}, got {self.state_avg!r}")
        cfg = self.model_config()
        if cfg.global_batch % world_size:
            raise ValueError(f"the global batch ({cfg.global_batch} sequences) must be a multiple of the number of "
                             f"workers ({world_size}): pass a global_batch that is")

    def model_config(self) -> ModelConfig:
        """The preset with this spec's overrides."""
        return preset(self.preset, lr=self.lr, global_batch=self.global_batch, context=self.context)


@dataclass(frozen=True)
class Schedule:
    """Steps of a run: how many, the warm-up, and where it evaluates."""

    steps: int
    warmup: int
    tokens_per_step: int
    eval_steps: Tuple[int, ...]


def schedule(spec: RunSpec) -> Schedule:
    """Steps from the token budget (at least 1), warm-up, evaluation steps (0 and ``evals`` evenly
    spaced up to the last step)."""
    cfg = spec.model_config()
    per_step = cfg.global_batch * cfg.context
    steps = max(1, spec.tokens // per_step)
    if spec.warmup_steps is not None:
        warmup = min(steps - 1, spec.warmup_steps)
    else:
        warmup = min(steps - 1, max(1, round(spec.warmup_frac * steps))) if spec.warmup_frac > 0 else 0
    evals = sorted({0} | {round(k * steps / spec.evals) for k in range(1, spec.evals + 1)})
    return Schedule(steps, warmup, per_step, tuple(evals))


def bits_per_byte(nats: float) -> float:
    """Cross-entropy in nats per byte -> bits per byte."""
    return nats / math.log(2.0)


def _scheduler_fn(lr: float, sched: Schedule) -> Callable[[torch.optim.Optimizer], Any]:
    from decentpy.optim import lr_scheduler_fn_cosine_with_warmup

    return functools.partial(lr_scheduler_fn_cosine_with_warmup, t_max=max(1, sched.steps - sched.warmup),
                             t_warmup=sched.warmup, cosine_eta_min=0.1 * lr)


def _adamw_groups(named: Sequence[Tuple[str, Tensor]], weight_decay: float) -> List[Dict[str, Any]]:
    from decentpy.optim import split_decay_groups

    return split_decay_groups(list(named), weight_decay)


@torch.no_grad()
def _generic_consensus(params: Sequence[Tensor], world: int) -> float:
    """sqrt(1/n * sum_i ||x_i - mean||^2) over the ranks (decentpy's definition), for frameworks
    that have no such method. A collective."""
    total = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        mean = p.detach().to(torch.float64, copy=True)
        dist.all_reduce(mean)
        mean.div_(world)
        total += torch.sum((p.detach().double() - mean) ** 2)
    dist.all_reduce(total)
    return math.sqrt(float(total) / world)


class _Arm:
    """A wrapped model: step, evaluate its own and the averaged model, count bytes."""

    bytes_source = ""
    replicas_equal = False  # torch DDP: every worker holds the average already

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # the plain module (parameters shared with the wrapper)

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def bytes_sent(self) -> float:
        raise NotImplementedError

    def consensus(self) -> float:
        return _generic_consensus([p for p in self.model.parameters()], dist.get_world_size())

    def skipped_steps(self) -> Optional[int]:
        return None  # torch DDP and decent-dp never skip an update

    def settle(self) -> None:
        """Finish the exchanges in flight, so that the training time counts them (DDP has none)."""

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        yield

    def lr(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class _DDPArm(_Arm):
    def __init__(self, model: nn.Module, spec: RunSpec, cfg: ModelConfig, sched: Schedule,
                 device: torch.device) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(model)
        kw: Dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
        self.elems = 0.0  # elements all-reduced so far (PowerSGD: counted in the hook)
        self.param_elems = sum(p.numel() for p in model.parameters())
        if spec.mode == "ddp-powersgd":
            # PowerSGD's hook chains all-reduces in future callbacks; with several buckets on gloo their
            # order differs between ranks (pytorch/pytorch#58467): one bucket keeps them in one order.
            kw["bucket_cap_mb"] = 1024
        self.net = DistributedDataParallel(model, **kw)
        if spec.mode == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)

            # no annotations: DDP compares them with dist.GradBucket, and this module's are strings
            def counted(st, bucket):  # type: ignore[no-untyped-def]
                plain = st.iter < st.start_powerSGD_iter
                before = st.total_numel_after_compression
                fut = powerSGD_hook.powerSGD_hook(st, bucket)
                self.elems += bucket.buffer().numel() if plain else st.total_numel_after_compression - before
                return fut

            self.net.register_comm_hook(state, counted)
            self.bytes_source = "allreduce(powersgd)"
        else:
            self.bytes_source = "allreduce(gradients)"
        self.powersgd = spec.mode == "ddp-powersgd"
        self.clip = spec.grad_clip
        self.steps = 0
        self.opt = torch.optim.AdamW(_adamw_groups(list(model.named_parameters()), spec.weight_decay), lr=cfg.lr,
                                     betas=BETAS, eps=EPS)
        self.sched = _scheduler_fn(cfg.lr, sched)(self.opt)
        self.replicas_equal = True

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = _loss(self.net(x), y)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.steps += 1
        return loss.detach()

    def bytes_sent(self) -> float:
        elems = self.elems if self.powersgd else self.param_elems * self.steps
        return elems * 4.0  # fp32 gradients

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])


def _bucket_mb(model: nn.Module, fragments: int) -> float:
    """The wrapper's default bucket size, or with fragments a size that gives every fragment about
    two buckets (a fragment is a set of buckets)."""
    if fragments == 1:
        return 25.0
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return min(25.0, nbytes / (2 * fragments) / 2**20)


#: DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD, lr 0.7, momentum 0.9
DILOCO_OUTER = (0.7, 0.9)
#: NoLoCo's (Kolehmainen et al. 2025, its authors' code): heavy-ball SGD, lr 0.7, momentum 0.5
NOLOCO_OUTER = (0.7, 0.5)
#: SparseLoCo's (Sarfi et al. 2025): theta <- theta - alpha mean, alpha 1, no momentum (the error buffer's)
SPARSELOCO_OUTER = (1.0, 0.0)


def outer_settings(spec: RunSpec) -> Tuple[float, float]:
    """The outer SGD's (lr, momentum) of a local-steps arm: the spec's, else its rule's (DiLoCo's or
    NoLoCo's)."""
    lr0, m0 = {"noloco": NOLOCO_OUTER, "sparseloco": SPARSELOCO_OUTER}.get(spec.outer_rule, DILOCO_OUTER)
    lr = spec.outer_lr if spec.outer_lr is not None else lr0
    momentum = spec.outer_momentum if spec.outer_momentum is not None else m0
    return lr, momentum


def _outer_sgd(lr: float, momentum: float, params: Any, nesterov: bool = True) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


def _local_steps(spec: RunSpec) -> Any:
    """The wrapper's ``local_steps=``: 1, or the spec's settings as one decentpy.LocalSteps (NoLoCo:
    heavy-ball momentum and the pull of weight lr, as its authors' code; SparseLoCo: the sparse
    exchange at its defaults, 64 of every 4096 entries in 2 bits, the error buffer's decay 0.95)."""
    from decentpy import LocalSteps, SparseOuter

    if spec.local_steps < 2:
        return 1
    noloco = spec.outer_rule == "noloco"
    return LocalSteps(sync_every=spec.local_steps, fragments=spec.fragments,
                      fragment_sync_delay=spec.fragment_sync_delay, fragment_update_alpha=spec.fragment_update_alpha,
                      outer_optim=functools.partial(_outer_sgd, *outer_settings(spec), nesterov=not noloco),
                      outer_pull=1.0 if noloco else None,
                      sparse=SparseOuter() if spec.outer_rule == "sparseloco" else None)


class _DecentpyArm(_Arm):
    bytes_source = "decentpy.stats"

    def __init__(self, model: nn.Module, spec: RunSpec, cfg: ModelConfig, sched: Schedule, lws: int) -> None:
        from decentpy import DecentralizedDataParallel
        from decentpy.optim import optim_fn_adamw

        super().__init__(model)
        optim_fn = functools.partial(optim_fn_adamw, lr=cfg.lr, beta1=BETAS[0], beta2=BETAS[1],
                                     weight_decay=spec.weight_decay, eps=EPS)
        self.ddp = DecentralizedDataParallel(model, optim_fn, _scheduler_fn(cfg.lr, sched), topology=spec.topology,
                                             local_world_size=lws, intra_node=spec.intra_node,
                                             compression=spec.compression, local_steps=_local_steps(spec),
                                             bucket_size_in_mb=_bucket_mb(model, spec.fragments),
                                             grad_clip_norm=spec.grad_clip)
        self.state_avg = None
        if spec.state_avg_every:
            from decentpy import OptimizerStateAveraging
            self.state_avg = OptimizerStateAveraging(self.ddp, every=spec.state_avg_every,
                                                     states=tuple(spec.state_avg.split(",")))

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        loss = _loss(self.ddp(x), y)
        loss.backward()  # the wrapper steps and launches the exchanges inside backward
        if self.state_avg is not None:
            self.state_avg.step()
        return loss.detach()

    def _stats(self) -> Dict[str, Any]:
        stats = getattr(self.ddp, "stats", None)  # public counters where the wrapper has them
        return dict(stats()) if callable(stats) else {"bytes_sent": self.ddp.bytes_sent}

    def bytes_sent(self) -> float:
        return float(self._stats()["bytes_sent"])

    def skipped_steps(self) -> Optional[int]:
        s = self._stats().get("skipped_steps")
        return None if s is None else int(s)

    def consensus(self) -> float:
        return self.ddp.consensus_distance()

    def settle(self) -> None:
        self.ddp.wait()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        self.ddp.global_avg(will_revert=True)
        try:
            yield
        finally:
            self.ddp.revert_global_avg()  # back to each worker's own trajectory

    def lr(self) -> float:
        return float(self.ddp.get_lr())

    def close(self) -> None:
        self.ddp.close()


class _DecentDPArm(_Arm):
    bytes_source = "allreduce(decent-dp)"

    def __init__(self, model: nn.Module, spec: RunSpec, cfg: ModelConfig, sched: Schedule, lws: int) -> None:
        try:
            from loguru import logger as _loguru  # decent-dp logs every step at INFO

            _loguru.remove()
            _loguru.add(sys.stderr, level="WARNING")
        except ImportError:
            pass
        from decent_dp.ddp import DecentralizedDataParallel as RefDDP

        super().__init__(model)

        def optim_fn(named: List[Tuple[str, Tensor]]) -> torch.optim.Optimizer:
            # torch's AdamW with decentpy's decay groups: the optimizer of every other arm
            return torch.optim.AdamW(_adamw_groups(named, spec.weight_decay), lr=cfg.lr, betas=BETAS, eps=EPS)

        # decent-dp steps inside backward from its second iteration on (its first is lazy): its own
        # per-bucket clip (grad_clip_norm, as decentpy's) is the only one that reaches its optimizer
        self.ddp = RefDDP(model, optim_fn=optim_fn, lr_scheduler_fn=_scheduler_fn(cfg.lr, sched),
                          topology=spec.topology, _local_world_size=lws, grad_clip_norm=spec.grad_clip)
        self.param_bytes = 4.0 * sum(p.numel() for p in model.parameters())
        self.rank = dist.get_rank()
        self.steps = 0
        self.sent = 0.0

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        loss = _loss(self.ddp(x), y)
        loss.backward()
        # decent-dp's all-reduces of every parameter over a step's group, as its forward and backward
        # hooks launch them: none in iteration 1, edges 1 (second forward) and 3 in iteration 2, then i + 1
        self.steps += 1
        i = self.steps
        for k in ((1, 3) if i == 2 else () if i == 1 else (i + 1,)):
            self.sent += self.param_bytes if len(self.ddp._topo.get_edge(k).ranks) > 1 else 0.0
        return loss.detach()

    def bytes_sent(self) -> float:
        return self.sent

    def settle(self) -> None:
        for op in self.ddp._comm_ops:
            if op is not None:
                op.wait()

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        if not self.ddp._initialized:  # decent-dp builds its buckets at the second forward; no step before
            yield
            return
        self.ddp.global_avg(will_revert=True)
        try:
            yield
        finally:
            self.ddp.revert_global_avg()

    def lr(self) -> float:
        return float(self.ddp.get_lr())


class TorchftStandInManager:
    """What torchft 0.2.0's ``DiLoCo`` asks of its ``Manager``, on the default process group: an
    averaging all-reduce (counted), a step counter that moves at each commit, no-ops for the rest.
    No Lighthouse, no quorum: the anchor measures torchft's DiLoCo itself, not its coordination."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self._step = 0
        self.sent = 0.0

    def allreduce(self, tensor: Tensor, should_quantize: bool = False, **_: Any) -> Any:
        self.sent += tensor.numel() * tensor.element_size()
        work = dist.all_reduce(tensor, async_op=True)
        world = dist.get_world_size()

        class _Work:
            def wait(self) -> bool:
                work.wait()
                tensor.div_(world)
                return True

        return _Work()

    def current_step(self) -> int:
        return self._step

    def should_commit(self) -> bool:
        self._step += 1
        return True

    def start_quorum(self, *_: Any, **__: Any) -> None: ...
    def register_state_dict_fn(self, *_: Any) -> None: ...
    def disallow_state_dict_read(self) -> None: ...
    def allow_state_dict_read(self) -> None: ...


class _TorchftDiLoCoArm(_Arm):
    """torchft 0.2.0's ``DiLoCo`` (``sync_every=local_steps``; torch's AdamW inside, its outer Nesterov
    SGD) on a stand-in Manager over the default process group. torchft is not a dependency:
    ``pip install --no-deps --target DIR torchft==0.2.0`` plus its opentelemetry packages, then
    ``DECENTPY_TORCHFT_PATH=DIR`` (or ``BENCH_TORCHFT_PATH``)."""

    bytes_source = "allreduce(torchft pseudo-gradients)"

    def __init__(self, model: nn.Module, spec: RunSpec, cfg: ModelConfig, sched: Schedule) -> None:
        import os

        path = os.environ.get("DECENTPY_TORCHFT_PATH") or os.environ.get("BENCH_TORCHFT_PATH")
        if path and path not in sys.path:
            sys.path.insert(0, path)
        try:
            from torchft.local_sgd import DiLoCo
        except Exception as exc:  # noqa: BLE001 - said in full: what to install
            raise RuntimeError(f"mode 'torchft-diloco' needs torchft 0.2.0 importable ({exc}); install it with "
                               "pip install --no-deps --target DIR and set DECENTPY_TORCHFT_PATH=DIR") from exc
        super().__init__(model)
        self.opt = torch.optim.AdamW(_adamw_groups(list(model.named_parameters()), spec.weight_decay), lr=cfg.lr,
                                     betas=BETAS, eps=EPS)
        self.sched = _scheduler_fn(cfg.lr, sched)(self.opt)
        self.outer = _outer_sgd(*outer_settings(spec), model.parameters())
        self.clip = spec.grad_clip
        self.manager = TorchftStandInManager()
        with torch.no_grad():  # one initial model (run_arm seeds every rank alike; torchft's Manager heals)
            for t in model.parameters():
                dist.broadcast(t, 0)
        self.diloco = DiLoCo(self.manager, [model], self.opt, self.outer, sync_every=spec.local_steps)
        self.diloco.__enter__()

    def train_step(self, x: Tensor, y: Tensor) -> Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = _loss(self.model(x), y)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()  # every sync_every-th: torchft's outer step (its post-step hook)
        self.sched.step()
        return loss.detach()

    def bytes_sent(self) -> float:
        return self.manager.sent

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        saved = [p.detach().clone() for p in self.model.parameters()]
        with torch.no_grad():
            for p in self.model.parameters():
                dist.all_reduce(p)
                p.div_(dist.get_world_size())
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.model.parameters(), saved):
                    p.copy_(s)

    def lr(self) -> float:
        return float(self.opt.param_groups[0]["lr"])

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)


def _build_arm(model: nn.Module, spec: RunSpec, cfg: ModelConfig, sched: Schedule, device: torch.device,
               lws: int) -> _Arm:
    if spec.mode in ("ddp", "ddp-powersgd"):
        return _DDPArm(model, spec, cfg, sched, device)
    if spec.mode == "decentpy":
        return _DecentpyArm(model, spec, cfg, sched, lws)
    if spec.mode == "torchft-diloco":
        return _TorchftDiLoCoArm(model, spec, cfg, sched)
    return _DecentDPArm(model, spec, cfg, sched, lws)


@torch.no_grad()
def _nll_sum(model: nn.Module, windows: Tensor, device: torch.device, batch: int = 16) -> float:
    """Summed next-byte cross-entropy (nats) of ``model`` over ``windows`` (rows of context + 1)."""
    was = model.training
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        logits = model(w[:, :-1])
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                       reduction="sum"))
    model.train(was)
    return total


def _evaluate(arm: _Arm, windows: Tensor, device: torch.device) -> Tuple[float, float, float]:
    """(averaged model's bits/byte, mean of the workers' own models' bits/byte, consensus distance).
    A collective: every rank calls it at the same step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    count = windows.shape[0] * (windows.shape[1] - 1)
    cons = arm.consensus()
    mine = windows[rank::n]  # the averaged model is the same everywhere: each rank takes a share
    if arm.replicas_equal:
        own = None
    else:
        t = torch.tensor([_nll_sum(arm.model, windows, device)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        own = float(t) / n / count
    with arm.averaged():
        t = torch.tensor([_nll_sum(arm.model, mine, device) if mine.shape[0] else 0.0], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t)
    avg = float(t) / count
    return bits_per_byte(avg), bits_per_byte(avg if own is None else own), cons


def _eval_row(arm: _Arm, windows: Tensor, device: torch.device, row: Dict[str, Any], train_s: float,
              loss_sum: Tensor, loss_steps: int, last_tokens: int, last_train_s: float) -> Dict[str, Any]:
    """Evaluate and reduce this interval's numbers over the ranks into one row (a collective)."""
    n = dist.get_world_size()
    avg, own, cons = _evaluate(arm, windows, device)
    skipped = arm.skipped_steps()
    sums = torch.tensor([float(loss_sum), loss_steps, arm.bytes_sent(), float(skipped or 0)], dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums)
    wall_t = torch.tensor([train_s], dtype=torch.float64, device=device)
    dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
    wall, dt = float(wall_t), float(wall_t) - last_train_s
    row.update(wall_s=wall, bytes_sent_per_worker=float(sums[2]) / n, val_bits_per_byte=avg,
               val_bits_per_byte_workers_mean=own, consensus_distance=cons,
               skipped_steps=None if skipped is None else int(sums[3]),
               train_bits_per_byte=bits_per_byte(float(sums[0]) / float(sums[1])) if sums[1] > 0 else None,
               tokens_per_s=(row["tokens"] - last_tokens) / dt if row["tokens"] > last_tokens and dt > 0 else None,
               lr=arm.lr())
    return {c: row.get(c) for c in COLUMNS}


def _local_world(spec: RunSpec, n: int) -> int:
    """Workers per simulated node: the spec's, else 2 (two nodes at 4 workers), at most ``n``."""
    return min(spec.local_world_size or 2, n)


def measure_throughput(spec: RunSpec, corpus: Corpus, device: Optional[torch.device] = None,
                       steps: Optional[int] = None, skip: int = 4) -> Dict[str, float]:
    """The arm's training throughput on this process group (a collective, every rank alike): ``steps``
    timed steps after ``skip`` untimed ones (the layout trace, the first exchanges), the exchanges in
    flight finished inside the time, the slowest rank's. Default ``steps``: at least 16 and two
    windows of local steps (a multiple of ``local_steps``, so the outer steps' share is the run's).
    Returns ``{"tokens_per_s", "s_per_step", "steps"}``: what a time-matched run sizes its token
    budget from (``bench-lm --race``)."""
    if not dist.is_initialized():
        raise RuntimeError("measure_throughput needs torch.distributed: call init_process_group first")
    device = device or torch.device("cpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    spec.check(n)
    h = max(1, spec.local_steps)
    if steps is None:
        steps = max(16, 2 * h)
        steps = -(-steps // h) * h
    cfg = spec.model_config()
    sched = schedule(spec)
    torch.manual_seed(spec.seed)
    model = ByteTransformer(cfg).to(device)
    arm = _build_arm(model, spec, cfg, sched, device, _local_world(spec, n))
    per_rank = cfg.global_batch // n
    try:
        t0 = time.perf_counter()
        for step in range(skip + steps):
            if step == skip:
                arm.settle()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            x, y = train_batch(corpus.train, spec.seed, rank, n, step, per_rank, cfg.context, spec.data_split)
            arm.train_step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        arm.settle()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
    finally:
        arm.close()
    s_per_step = float(took) / steps
    return {"tokens_per_s": cfg.global_batch * cfg.context / s_per_step, "s_per_step": s_per_step,
            "steps": float(steps)}


def tokens_for_budget(budget_s: float, tokens_per_s: float, tokens_per_step: int) -> int:
    """The token budget an arm of ``tokens_per_s`` trains in ``budget_s`` (the race's rule): whole
    steps, at least 8."""
    if not (budget_s > 0 and math.isfinite(budget_s)) or not (tokens_per_s > 0 and math.isfinite(tokens_per_s)):
        raise ValueError(f"a time budget needs budget_s > 0 and a measured throughput > 0, got budget_s={budget_s!r}, "
                         f"tokens_per_s={tokens_per_s!r}")
    return max(8, int(budget_s * tokens_per_s // tokens_per_step)) * tokens_per_step


def run_arm(spec: RunSpec, corpus: Corpus, device: Optional[torch.device] = None,
            on_eval: Optional[Callable[[Dict[str, Any]], None]] = None,
            on_log: Optional[Callable[[Dict[str, Any]], None]] = None,
            on_step: Optional[Callable[[int], None]] = None) -> List[Dict[str, Any]]:
    """Train one arm for one seed in the initialized default process group; return its rows (one per
    evaluation, :data:`COLUMNS`), the same on every rank. ``on_eval(row)`` is called on every rank
    after each evaluation; ``on_log({"step", "tokens", "train_bits_per_byte", "lr"})`` every
    ``spec.log_every`` steps with this rank's own training loss (no collective); ``on_step(steps
    done)`` after every step (a progress bar; no synchronisation)."""
    if not dist.is_initialized():
        raise RuntimeError("run_arm needs torch.distributed: call init_process_group first")
    device = device or torch.device("cpu")
    rank, n = dist.get_rank(), dist.get_world_size()
    spec.check(n)
    cfg = spec.model_config()
    sched = schedule(spec)
    lws = _local_world(spec, n)
    per_rank = cfg.global_batch // n
    windows = val_windows(corpus.val, cfg.context, spec.val_windows)

    torch.manual_seed(spec.seed)  # the same initial model on every rank and in every arm
    model = ByteTransformer(cfg).to(device)
    arm = _build_arm(model, spec, cfg, sched, device, lws)
    base: Dict[str, Any] = dict(
        framework=FRAMEWORK[spec.mode], mode=spec.mode,
        topology=spec.topology if spec.mode in ("decentpy", "decent-dp") else
        ("complete" if spec.mode == "torchft-diloco" else "allreduce"),
        compression=(spec.compression or "none") if spec.mode == "decentpy" else
        (f"powersgd-rank{POWERSGD_RANK}" if spec.mode == "ddp-powersgd" else "none"),
        intra_node=spec.intra_node if spec.mode == "decentpy" else None,
        local_steps=spec.local_steps if spec.mode in ("decentpy", "torchft-diloco") else 1, fragments=spec.fragments,
        link_mbit=spec.link_mbit, data_split=spec.data_split, peak_lr=cfg.lr, grad_clip=spec.grad_clip,
        warmup_steps=sched.warmup, budget_s=spec.budget_s,
        state_averaging=f"{spec.state_avg}/{spec.state_avg_every}" if spec.state_avg_every else None,
        **(dict(outer_rule=spec.outer_rule, **dict(zip(("outer_lr", "outer_momentum"), outer_settings(spec))))
           if spec.local_steps > 1 else {}),
        workers=n,
        preset=spec.preset, seed=spec.seed, params=count_parameters(model), bytes_source=arm.bytes_source,
        corpus=corpus.name, corpus_bytes=corpus.n_bytes, corpus_hash=corpus.list_hash, device=str(device))

    rows: List[Dict[str, Any]] = []
    train_s = 0.0  # this rank's training time: the intervals between evaluations
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    loss_steps = 0
    last_tokens, last_train_s = 0, 0.0
    t0 = time.perf_counter()
    try:
        for step in range(sched.steps + 1):
            if step in sched.eval_steps:
                arm.settle()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                train_s += time.perf_counter() - t0
                rows.append(_eval_row(arm, windows, device, dict(base, step=step, tokens=step * sched.tokens_per_step),
                                      train_s, loss_sum, loss_steps, last_tokens, last_train_s))
                last_tokens, last_train_s = rows[-1]["tokens"], rows[-1]["wall_s"]
                loss_sum.zero_()
                loss_steps = 0
                if on_eval is not None:
                    on_eval(rows[-1])
                t0 = time.perf_counter()
            if step == sched.steps:
                break
            x, y = train_batch(corpus.train, spec.seed, rank, n, step, per_rank, cfg.context, spec.data_split)
            loss = arm.train_step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            loss_sum += loss
            loss_steps += 1
            if on_step is not None:
                on_step(step + 1)
            if on_log is not None and spec.log_every > 0 and (step + 1) % spec.log_every == 0:
                on_log({"step": step + 1, "tokens": (step + 1) * sched.tokens_per_step,
                        "train_bits_per_byte": bits_per_byte(float(loss)), "lr": arm.lr()})
    finally:
        arm.close()
    return rows

"""Does a fairscale script give the same results with decentpy? fairscale's own OSS benchmark, on CPU.

decentpy promises that ``from decentpy import OSS, ShardedDataParallel, ShardedGradScaler`` can
replace fairscale 0.4.13's ``fairscale.optim.OSS``, ``fairscale.nn.data_parallel.ShardedDataParallel``
and ``fairscale.optim.grad_scaler.ShardedGradScaler`` with the same results. This benchmark checks
that promise on the workload fairscale checks itself with, ``benchmarks/oss.py`` (a torchvision
ResNet on MNIST, 2 workers, seed 0, ``RMSprop(lr=1e-4, momentum=0.9)``), rebuilt for a CPU-only
machine (torchvision does not work with decentpy's torch, so the model and data are local):

* model: a torchvision-architecture ResNet-18 written out below (BasicBlock [2, 2, 2, 2], 7x7 stem,
  max-pool, 1000 classes and torchvision's initialisation, as ``resnet18(pretrained=False)``), 3-channel
  input;
* data: scikit-learn's ``load_digits`` (1797 8x8 greyscale digits, scaled to [0, 1] like
  ``ToTensor``, upscaled x4 (nearest) to 32x32, the grey channel repeated to 3 in the collate
  function as oss.py does with MNIST); ``DistributedSampler`` (shuffled, seed 0, never
  ``set_epoch``: every epoch sees the same order, as in oss.py) + ``BatchSampler(drop_last=True)``;
* 2 gloo workers on 127.0.0.1, one torch thread each, fresh processes for every run (as oss.py's
  ``mp.spawn`` per mode; ``--quick``: one spawn for all); ``torch.manual_seed(seed)`` and
  ``np.random.seed(seed)`` before the model is built, the same seed for every framework;
* the step exactly as oss.py: ``optimizer.step(closure)`` with closure = ``model.zero_grad()``,
  forward, ``CrossEntropyLoss``, backward, return the loss; in the ``+amp`` modes the closure runs the
  forward (and the scaled backward) under autocast and outside the scaler, then
  ``scaler.step(optimizer)``, ``scaler.update()``; after each epoch the OSS modes call
  ``consolidate_state_dict()`` and rank 0 ``state_dict()``, as oss.py does.

Modes (oss.py's ``--optim_type``), each without and with AMP:

* ``pytorch``          torch DDP + ``torch.optim.RMSprop`` (+ ``torch.amp.GradScaler("cpu")``):
                       the reference, framework ``torch``;
* ``oss_ddp``          torch DDP + ``OSS(optim=RMSprop)``: the gradients are made inside
                       ``optimizer.step(closure)`` (the path of decentpy's bug fixed in e3a37e5);
* ``oss_sharded_ddp``  ``OSS`` + ``ShardedDataParallel(reduce_buffer_size=0)`` (+ ``ShardedGradScaler``).

Frameworks for the OSS modes: ``fairscale`` (0.4.13; skipped with a message when it does not
import), ``decentpy`` (the same script with decentpy's classes), and ``decentpy-split``: decentpy's
OSS splits a parameter of at least ``min_split_numel`` (2**16) elements only where it straddles a
cut between two ranks' shares, so at 2 workers one parameter of ResNet-18 is split, whatever
``min_split_numel`` (``layer4.0.conv2.weight``, 2.36M elements, cut at 1881300; the report says
which); ``decentpy-split`` builds the OSS over the first parameter and adds the others one by one
(``add_param_group``, which cuts each added large parameter to level the ranks), so that 13 of
the 14 parameters of at least 2**16 elements are split (``layer4.0.downsample.0.weight`` stays
whole: under 5% of a rank's share) -- the same optimisation maths, split-heavy.

AMP on CPU: ``torch.autocast("cpu", dtype=torch.bfloat16)`` by default (``--amp-dtype float16``
works too, about 50x slower on CPUs without fp16 kernels). torch's and decentpy's scalers scale
the loss by 2**16; fairscale's ``ShardedGradScaler`` disables itself when CUDA is not available
(``amp_definitely_not_available()``, a warning), so fairscale's AMP run trains autocast without
loss scaling (forced on, it could not run here: its ``unscale_`` moves the CPU found-inf flag with
``v.cuda()`` before the all-reduce). Under bfloat16 that is the same arithmetic: multiplying by a
power of two commutes with floating-point rounding, so a scaled backward and unscale give the same
bits as an unscaled backward unless a value overflows or becomes subnormal (the report counts the
skipped steps).

Printed per mode: the loss per epoch (rank 0's loss on the epoch's last batch, as oss.py logs it),
the final and minimum loss, for torch, fairscale, decentpy (and decentpy-split), to 6 decimals;
whether decentpy matches fairscale and torch to 4 decimals: ``|a - b| < 5e-5`` on the unrounded
losses of every epoch (not ``round(a, 4) == round(b, 4)``, which a 1e-9 difference across a
rounding boundary fails); the largest difference over every step's loss; the largest absolute
difference between the final parameters of each pair; and, as a side note, the median step time
(optimizer.step with its closure; per step the max over ranks).

Writes ``bench/out/bench_fairscale_parity.csv`` (one row per mode, framework and epoch) and
``bench/out/bench_fairscale_parity.png`` (loss curves per mode; needs matplotlib, skipped with a
message otherwise).

    make bench-fairscale-parity                                   # installs fairscale --no-deps first
    python -m bench.bench_fairscale_parity                        # everything: 14 runs of 30-60 s on 2 cores
    python -m bench.bench_fairscale_parity --modes oss_ddp --frameworks torch,fairscale,decentpy
    python -m bench.bench_fairscale_parity --quick --frameworks torch,decentpy    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.common.launch import OUT_DIR, bench_parser, spawn_workers
from bench.common.machine import report_machine
from bench.common.plots import pyplot, save_figure
from bench.common.references import fairscale_missing
from bench.common.tables import check_choices, csv_list, print_table, print_targets
from bench.common.tables import write_outputs

log = logging.getLogger("bench_fairscale_parity")

FRAMEWORKS = ("torch", "fairscale", "decentpy", "decentpy-split")
MODES = ("oss_ddp", "oss_sharded_ddp", "oss_ddp+amp", "oss_sharded_ddp+amp")
SETUP = {"pytorch": "DDP + RMSprop", "oss_ddp": "DDP + OSS(RMSprop), step(closure)",
         "oss_sharded_ddp": "OSS(RMSprop) + ShardedDataParallel(reduce_buffer_size=0), step(closure)"}
LR, MOMENTUM = 1e-4, 0.9  # oss.py: OPTIM(..., lr=1e-4, momentum=0.9)
MATCH_TOL = 5e-5          # "equal to 4 decimals": |a - b| < 5e-5 on the unrounded values
WORKERS = 2


# ----------------------------------------------------------------------------------------------
# model and data
# ----------------------------------------------------------------------------------------------


def resnet18(width: int = 64, num_classes: int = 1000):  # -> nn.Module
    """torchvision's ``resnet18(pretrained=False)``: same modules, names, order and initialisation
    (so the same seed draws the same weights); ``width`` scales the channels (64: the real one)."""
    from torch import nn

    def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
        return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
            super().__init__()
            self.conv1 = conv3x3(cin, cout, stride)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = conv3x3(cout, cout)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = downsample

        def forward(self, x: Any) -> Any:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inplanes = width
            self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
            self.layer1 = self._make_layer(width, 1)
            self.layer2 = self._make_layer(2 * width, 2)
            self.layer3 = self._make_layer(4 * width, 2)
            self.layer4 = self._make_layer(8 * width, 2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(8 * width, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)

        def _make_layer(self, planes: int, stride: int) -> nn.Sequential:
            downsample = None
            if stride != 1 or self.inplanes != planes:
                downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                           nn.BatchNorm2d(planes))
            blocks = [BasicBlock(self.inplanes, planes, stride, downsample), BasicBlock(planes, planes)]
            self.inplanes = planes
            return nn.Sequential(*blocks)

        def forward(self, x: Any) -> Any:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(self.avgpool(x).flatten(1))

    return ResNet()


def load_digits_images(image_size: int) -> Tuple[Any, List[int]]:
    """scikit-learn's digits as an N x 1 x S x S float32 array in [0, 1] (like torchvision's MNIST
    with ``ToTensor()``: 8x8 values 0..16 divided by 16, upscaled by repeating pixels) and labels.
    Loaded once by the main process and handed to the workers (which then need no sklearn)."""
    import numpy as np
    from sklearn.datasets import load_digits

    if image_size % 8:
        raise ValueError(f"--image-size must be a multiple of 8, got {image_size}")
    d = load_digits()
    k = image_size // 8
    x = (d.images.astype(np.float32) / np.float32(16.0))[:, None]  # N x 1 x 8 x 8
    x = np.ascontiguousarray(x.repeat(k, axis=2).repeat(k, axis=3))
    return x, [int(v) for v in d.target]


class DigitsDataset:
    """(1 x S x S image, label) pairs, as torchvision's MNIST gives them to oss.py."""

    def __init__(self, images: Any, labels: List[int]) -> None:
        import torch

        self.images = torch.from_numpy(images)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Tuple[Any, int]:
        return self.images[i], self.labels[i]


def _collate(items: List[Tuple[Any, int]]) -> Dict[str, Any]:
    """oss.py's collate: stack, grey channel repeated to 3 (pseudo colour)."""
    import torch

    return {"inputs": torch.stack([i[0] for i in items]).repeat(1, 3, 1, 1),
            "label": torch.tensor([i[1] for i in items])}


def make_loader(rank: int, world: int, batch_size: int, digits: Tuple[Any, List[int]]):  # -> DataLoader
    from torch.utils.data import BatchSampler, DataLoader
    from torch.utils.data.distributed import DistributedSampler

    dataset = DigitsDataset(*digits)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank)  # type: ignore[arg-type]
    batch_sampler = BatchSampler(sampler, batch_size, drop_last=True)
    return DataLoader(dataset=dataset, batch_sampler=batch_sampler, collate_fn=_collate)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# one training run (worker side)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One training run: ``framework`` in FRAMEWORKS, ``mode`` one of oss.py's optim types
    (``pytorch`` for torch), ``amp`` on or off."""

    framework: str
    mode: str
    amp: bool

    @property
    def key(self) -> str:
        return f"{self.framework}:{self.mode}{'+amp' if self.amp else ''}"


def _classes(framework: str) -> Tuple[Any, Any, Any]:
    """(OSS, ShardedDataParallel, ShardedGradScaler) of ``framework``."""
    if framework == "fairscale":
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS
        from fairscale.optim.grad_scaler import ShardedGradScaler

        return OSS, ShardedDataParallel, ShardedGradScaler
    import decentpy

    return decentpy.OSS, decentpy.ShardedDataParallel, decentpy.ShardedGradScaler


def _build(run: Run, model: Any) -> Tuple[Any, Any, Any, List[str]]:
    """oss.py's set-up of ``run``: (model to call, optimizer, scaler or None, notes)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    notes: List[str] = []
    optim_cls = torch.optim.RMSprop
    if run.framework == "torch":
        model = DDP(model, device_ids=None, find_unused_parameters=False)
        optimizer = optim_cls(model.parameters(), lr=LR, momentum=MOMENTUM)
        scaler = torch.amp.GradScaler("cpu") if run.amp else None
        return model, optimizer, scaler, notes
    OSS, SDP, ShardedGradScaler = _classes(run.framework)

    def make_oss(params: List[Any]) -> Any:
        if run.framework != "decentpy-split":
            return OSS(params=params, optim=optim_cls, lr=LR, momentum=MOMENTUM)
        # split-heavy: each large parameter added alone is cut in two to level the ranks' loads
        opt = OSS(params=params[:1], optim=optim_cls, lr=LR, momentum=MOMENTUM)
        for p in params[1:]:
            opt.add_param_group({"params": [p]})
        return opt

    if run.mode == "oss_sharded_ddp":
        optimizer = make_oss(list(model.parameters()))
        model = SDP(model, optimizer, reduce_buffer_size=0)  # oss.py: single node, no reduce buckets
    elif run.mode == "oss_ddp":
        model = DDP(model, device_ids=None, find_unused_parameters=False)
        optimizer = make_oss(list(model.parameters()))
    else:
        raise ValueError(f"unknown mode {run.mode!r} for {run.framework}")
    scaler = None
    if run.amp:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = ShardedGradScaler()
        notes += sorted({str(w.message) for w in caught if "deprecated" not in str(w.message)})
    return model, optimizer, scaler, notes


def _split_params(optimizer: Any, module: Any) -> List[Dict[str, Any]]:
    """decentpy: the parameters cut into pieces, with each piece's (start, end, owner)."""
    if not hasattr(optimizer, "shards_of"):
        return []
    out = []
    for name, p in module.named_parameters():
        shards = optimizer.shards_of(p)
        if len(shards) > 1:
            out.append(dict(name=name, numel=p.numel(), pieces=[(s.start, s.end, s.owner) for s in shards]))
    return out


def train_run(rank: int, world: int, run: Run, plan: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Train ``run`` as oss.py does; rank 0 returns the losses, timings and checks (others None)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(plan["seed"])  # oss.py: torch.manual_seed(0); np.random.seed(0)
    np.random.seed(plan["seed"])
    model = resnet18(plan["width"], plan["num_classes"])
    module = model
    dataloader = make_loader(rank, world, plan["batch_size"], plan["digits"])
    loss_fn = nn.CrossEntropyLoss()
    model, optimizer, scaler, notes = _build(run, model)
    amp_dtype = getattr(torch, plan["amp_dtype"])
    model.train()

    def closure(data: Dict[str, Any], grad_scaler: Any = None) -> Any:
        model.zero_grad()
        if grad_scaler is not None:
            with torch.autocast("cpu", dtype=amp_dtype):
                outputs = model(data["inputs"])
                loss = loss_fn(outputs, data["label"])
                grad_scaler.scale(loss).backward()
        else:
            outputs = model(data["inputs"])
            loss = loss_fn(outputs, data["label"])
            loss.backward()
        return loss

    losses: List[float] = []        # rank 0's loss, every step
    epoch_ends: List[int] = []      # len(losses) after each epoch
    times: List[float] = []
    skipped = 0
    for _epoch in range(plan["epochs"]):
        for i, batch in enumerate(dataloader):
            if plan["max_steps"] and i >= plan["max_steps"]:
                break
            t0 = time.perf_counter()
            if scaler is not None:
                before = scaler.get_scale()
                loss = closure(batch, grad_scaler=scaler)  # AMP scaler.step does not support closures
                scaler.step(optimizer)
                scaler.update()
                skipped += int(scaler.get_scale() < before)
            else:
                loss = optimizer.step(lambda b=batch: closure(b))
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.item()))
        epoch_ends.append(len(losses))
        if run.mode != "pytorch":  # oss.py checks the OSS checkpointing after every epoch
            optimizer.consolidate_state_dict()
            if dist.get_rank() == 0:
                _ = optimizer.state_dict()

    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    other = flat.clone()
    dist.broadcast(other, src=0)  # the ranks must hold the same model
    rank_diff = torch.tensor([float((flat - other).abs().max())])
    dist.all_reduce(rank_diff, op=dist.ReduceOp.MAX)
    every: List[Any] = [None] * world
    dist.all_gather_object(every, times)
    if rank != 0:
        return None
    path = Path(plan["param_dir"]) / f"{run.key.replace(':', '_').replace('+', '_')}.pt"
    torch.save(flat, path)
    per_step = [max(ts[k] for ts in every) for k in range(len(times))]
    scaler_info = None
    if scaler is not None:
        scaler_info = dict(enabled=bool(scaler.is_enabled()), final_scale=float(scaler.get_scale()),
                           skipped=skipped)
    return dict(run=asdict(run), losses=losses, epoch_ends=epoch_ends, step_times=per_step,
                rank_param_diff=float(rank_diff.item()), params_file=str(path), notes=notes,
                split=_split_params(optimizer, module), scaler=scaler_info,
                param_names=[(n, p.numel()) for n, p in module.named_parameters()])


def _worker_body(rank: int, world: int, plan: Dict[str, Any]) -> Dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.cuda.amp deprecations in fairscale
    logging.basicConfig(level=logging.WARNING)
    results = [train_run(rank, world, Run(**r), plan) for r in plan["runs"]]
    return dict(results=results)


# ----------------------------------------------------------------------------------------------
# comparison and report
# ----------------------------------------------------------------------------------------------


def epoch_losses(res: Dict[str, Any]) -> List[float]:
    """oss.py's per-epoch loss: rank 0's loss on the epoch's last batch."""
    return [res["losses"][e - 1] for e in res["epoch_ends"]]


@dataclass
class Match:
    epoch_diff: float       # max |a - b| over the epochs' losses (and so final and min)
    step_diff: float        # max |a - b| over every step's loss
    identical_steps: int    # steps whose losses are bit-identical
    steps: int
    param_diff: float       # max |a - b| over the final parameters
    param_where: str        # the parameter where that is

    @property
    def ok4(self) -> bool:
        return self.epoch_diff < MATCH_TOL


def _load(res: Dict[str, Any], cache: Dict[str, Any]) -> Any:
    import torch

    f = res["params_file"]
    if f not in cache:
        cache[f] = torch.load(f)
    return cache[f]


def compare(a: Dict[str, Any], b: Dict[str, Any], cache: Dict[str, Any]) -> Tuple[Match, bool]:
    """(the differences between runs a and b, whether their epoch losses also agree after rounding
    to 4 decimals)."""
    ea, eb = epoch_losses(a), epoch_losses(b)
    n = min(len(a["losses"]), len(b["losses"]))
    diffs = [abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n])]
    pa, pb = _load(a, cache), _load(b, cache)
    d = (pa - pb).abs()
    where = "-"
    dmax = float(d.max()) if d.numel() else 0.0
    if dmax > 0:
        idx, off = int(d.argmax()), 0
        for name, numel in a["param_names"]:
            if idx < off + numel:
                where = name
                break
            off += numel
    pairs = list(zip(ea + [min(ea)], eb + [min(eb)]))  # every epoch (the last is the final loss) and the min
    rounded = all(round(x, 4) == round(y, 4) for x, y in pairs)
    m = Match(epoch_diff=max(abs(x - y) for x, y in pairs),
              step_diff=max(diffs or [0.0]), identical_steps=sum(x == y for x, y in zip(a["losses"], b["losses"])),
              steps=n, param_diff=dmax, param_where=where)
    return m, rounded


def _verdict(m: Match, rounded: bool) -> str:
    if m.identical_steps == m.steps and m.param_diff == 0.0:
        return "MATCH (bit-identical losses and parameters)"
    tag = "MATCH" if m.ok4 else "NO MATCH"
    extra = "" if rounded == m.ok4 else f"; round(x, 4) equality says {'yes' if rounded else 'no'}"
    return f"{tag} to 4 decimals (max |diff| of the epoch losses {m.epoch_diff:.2e}{extra})"


def run_label(fw: str) -> str:
    return "torch (pytorch)" if fw == "torch" else fw


def report(runs: Dict[str, Dict[str, Any]], failed: Dict[str, str], modes: Sequence[str],
           frameworks: Sequence[str], skipped: Dict[str, str]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Print the per-mode tables and verdicts; (CSV rows, verdict rows)."""
    cache: Dict[str, Any] = {}
    csv_rows: List[Dict[str, Any]] = []
    verdicts: List[Dict[str, Any]] = []
    for mode in modes:
        base, amp = mode.split("+")[0], mode.endswith("+amp")
        keys = {fw: Run("torch", "pytorch", amp).key if fw == "torch" else Run(fw, base, amp).key for fw in frameworks}
        present = {fw: runs[k] for fw, k in keys.items() if k in runs}
        print(f"\n=== {mode}: {SETUP[base]}{' + autocast + ShardedGradScaler' if amp else ''}; reference torch "
              f"{SETUP['pytorch']}{' + GradScaler' if amp else ''} ===")
        for fw in frameworks:
            if fw not in present:
                why = failed.get(keys[fw]) or skipped.get(fw) or "not run"
                print(f"  {run_label(fw)}: no result ({why})")
        if not present:
            continue
        fws = [fw for fw in frameworks if fw in present]
        n_ep = max(len(r["epoch_ends"]) for r in present.values())
        table = []
        for e in range(n_ep):
            table.append([str(e)] + [f"{epoch_losses(present[fw])[e]:.6f}" if e < len(present[fw]["epoch_ends"])
                                     else "-" for fw in fws])
        table.append(["final"] + [f"{epoch_losses(present[fw])[-1]:.6f}" for fw in fws])
        table.append(["min"] + [f"{min(epoch_losses(present[fw])):.6f}" for fw in fws])
        table.append(["step ms"] + [f"{statistics.median(present[fw]['step_times']) * 1e3:.0f}" for fw in fws])
        print_table(["epoch"] + [run_label(fw) for fw in fws], table)
        pairs = [(x, y) for x, y in (("decentpy", "fairscale"), ("decentpy", "torch"), ("fairscale", "torch"),
                                     ("decentpy-split", "fairscale"), ("decentpy-split", "torch"),
                                     ("decentpy-split", "decentpy")) if x in present and y in present]
        matches: Dict[Tuple[str, str], Match] = {}
        for x, y in pairs:
            m, rounded = compare(present[x], present[y], cache)
            matches[(x, y)] = m
            print(f"  {x} vs {run_label(y)}: {_verdict(m, rounded)}; every step: max |diff| {m.step_diff:.2e}, "
                  f"{m.identical_steps}/{m.steps} bit-identical; final parameters: max |diff| {m.param_diff:.2e}"
                  + (f" ({m.param_where})" if m.param_diff > 0 else ""))
            verdicts.append(dict(mode=mode, a=x, b=y, epoch_diff=m.epoch_diff, step_diff=m.step_diff,
                                 identical=f"{m.identical_steps}/{m.steps}", ok4=m.ok4, rounded4=rounded,
                                 param_diff=m.param_diff, param_where=m.param_where))
        for fw in fws:
            r = present[fw]
            if r["rank_param_diff"] != 0.0:
                print(f"  WARNING {fw}: the ranks' final parameters differ by up to {r['rank_param_diff']:.2e}")
            if r.get("scaler"):
                sc = r["scaler"]
                state = (f"scale {sc['final_scale']:g}, {sc['skipped']} skipped steps" if sc["enabled"]
                         else "DISABLED (no loss scaling)")
                print(f"  {fw} scaler: {state}" + "".join(f"; warning: {w}" for w in r["notes"]))
            if r["split"] and fw in ("decentpy", "decentpy-split"):
                split = r["split"]
                show = ", ".join(f"{d['name']} ({d['numel']}: "
                                 + "/".join(f"[{a}:{b})->r{o}" for a, b, o in d["pieces"]) + ")" for d in split[:3])
                print(f"  {fw}: {len(split)} parameters split over the ranks: {show}"
                      f"{', ...' if len(split) > 3 else ''}")
            elif fw in ("decentpy", "decentpy-split"):
                print(f"  {fw}: no parameter split (min_split_numel {2 ** 16} and the cut between the shares)")
        for fw in fws:
            r = present[fw]
            ep = epoch_losses(r)
            mt = matches.get((fw, "torch"))
            mf = matches.get((fw, "fairscale"))
            for e, loss in enumerate(ep):
                lo, hi = (r["epoch_ends"][e - 1] if e else 0), r["epoch_ends"][e]
                csv_rows.append(dict(
                    mode=mode, base_mode=base if fw != "torch" else "pytorch", amp=int(amp), framework=fw,
                    setup=SETUP[base if fw != "torch" else "pytorch"], epoch=e, steps=hi - lo,
                    loss_last=f"{loss:.9g}", loss_epoch_mean=f"{statistics.fmean(r['losses'][lo:hi]):.9g}",
                    min_loss_so_far=f"{min(ep[:e + 1]):.9g}", final_loss=f"{ep[-1]:.9g}", min_loss=f"{min(ep):.9g}",
                    step_losses=";".join(f"{v:.9g}" for v in r["losses"][lo:hi]),
                    loss_diff_vs_torch="" if mt is None else f"{abs(loss - epoch_losses(present['torch'])[e]):.3g}",
                    loss_diff_vs_fairscale="" if mf is None else
                    f"{abs(loss - epoch_losses(present['fairscale'])[e]):.3g}",
                    match4_vs_torch="" if mt is None else int(mt.ok4),
                    match4_vs_fairscale="" if mf is None else int(mf.ok4),
                    param_maxdiff_vs_torch="" if mt is None else f"{mt.param_diff:.3g}",
                    param_maxdiff_vs_fairscale="" if mf is None else f"{mf.param_diff:.3g}",
                    rank_param_diff=f"{r['rank_param_diff']:.3g}", n_split_params=len(r["split"]),
                    scaler="" if not r.get("scaler") else ("on" if r["scaler"]["enabled"] else "disabled"),
                    skipped_steps="" if not r.get("scaler") else r["scaler"]["skipped"],
                    step_time_median_s=f"{statistics.median(r['step_times']):.6g}"))
    return csv_rows, verdicts


CSV_FIELDS = ["mode", "base_mode", "amp", "framework", "setup", "epoch", "steps", "loss_last", "loss_epoch_mean",
              "min_loss_so_far", "final_loss", "min_loss", "step_losses", "loss_diff_vs_torch",
              "loss_diff_vs_fairscale", "match4_vs_torch", "match4_vs_fairscale", "param_maxdiff_vs_torch",
              "param_maxdiff_vs_fairscale", "rank_param_diff", "n_split_params", "scaler", "skipped_steps",
              "step_time_median_s", "amp_dtype", "width", "num_classes", "batch_size", "image_size", "workers",
              "seed", "cpu", "cores", "torch", "fairscale"]


def targets(verdicts: List[Dict[str, Any]], modes: Sequence[str], failed: Dict[str, str],
            skipped: Dict[str, str], requested: Sequence[str]) -> List[Tuple[str, Optional[bool], str]]:
    """(title, met (None: not measured), detail): decentpy's losses equal fairscale's and torch's to 4
    decimals in every mode."""
    out: List[Tuple[str, Optional[bool], str]] = []
    by = {(v["mode"], v["a"], v["b"]): v for v in verdicts}
    for mode in modes:
        base, amp = mode.split("+")[0], mode.endswith("+amp")
        for other in ("fairscale", "torch"):
            title = f"{mode}: decentpy's loss curve equals {run_label(other)}'s to 4 decimals"
            v = by.get((mode, "decentpy", other))
            if v is None:
                missing = [fw for fw in ("decentpy", other) if fw not in requested]
                if missing:
                    why = f"{missing[0]} not requested (--frameworks)"
                else:
                    fw = other if other in skipped else "decentpy"
                    key = Run("torch", "pytorch", amp).key if fw == "torch" else Run(fw, base, amp).key
                    why = f"{fw} {skipped.get(fw) or failed.get(key) or 'gave no result'}"
                out.append((title, None, f"not measured: {why}"))
                continue
            out.append((title, bool(v["ok4"]), f"max |diff| {v['epoch_diff']:.2e} over the epochs, "
                                                f"{v['step_diff']:.2e} over every step ({v['identical']} steps "
                                                "bit-identical), final "
                                                f"parameters {v['param_diff']:.2e}"))
    return out


def print_summary(verdicts: List[Dict[str, Any]]) -> None:
    if not verdicts:
        return
    print("\nsummary (4 decimals: |a-b| < 5e-5 on the unrounded epoch losses, final and min included):")
    rows = [[v["mode"], f"{v['a']} vs {v['b']}", "yes" if v["ok4"] else "NO", f"{v['epoch_diff']:.2e}",
             f"{v['step_diff']:.2e}", v["identical"], f"{v['param_diff']:.2e}", v["param_where"]] for v in verdicts]
    print_table(["mode", "pair", "4 dec.", "max|d| epoch", "max|d| step", "identical steps", "max|d| params",
                 "where"], rows, group=lambda r: r[0])


def plot(path: Path, runs: Dict[str, Dict[str, Any]], modes: Sequence[str], frameworks: Sequence[str],
         machine: Dict[str, str], plan: Dict[str, Any]) -> Optional[Path]:
    """Per mode: every step's loss (rank 0) per framework, and its distance to torch's (log scale)."""
    plt = pyplot("`make bench-fairscale-parity` installs it")
    if plt is None:
        return None
    style = {"torch": ("#2ca02c", "-", 3.0), "fairscale": ("#ff7f0e", "--", 2.0), "decentpy": ("#1f77b4", ":", 1.6),
             "decentpy-split": ("#9467bd", "-.", 1.2)}
    fig, axes = plt.subplots(2, len(modes), figsize=(4.6 * len(modes), 7.2), squeeze=False, sharex="col")
    for j, mode in enumerate(modes):
        base, amp = mode.split("+")[0], mode.endswith("+amp")
        ax, dax = axes[0][j], axes[1][j]
        ref = runs.get(Run("torch", "pytorch", amp).key)
        for fw in frameworks:
            r = runs.get(Run("torch", "pytorch", amp).key if fw == "torch" else Run(fw, base, amp).key)
            if r is None:
                continue
            color, ls, lw = style[fw]
            xs = list(range(1, len(r["losses"]) + 1))
            ax.plot(xs, r["losses"], color=color, ls=ls, lw=lw, label=run_label(fw))
            if ref is not None and fw != "torch":
                d = [max(abs(a - b), 1e-9) for a, b in zip(r["losses"], ref["losses"])]
                dax.plot(xs[:len(d)], d, color=color, ls=ls, lw=lw, label=f"|{fw} - torch|")
        if ref is not None:
            for e in ref["epoch_ends"][:-1]:
                ax.axvline(e + 0.5, color="#cccccc", lw=0.8)
        ax.set_title(mode, fontsize=10)
        ax.set_yscale("log")
        ax.set_ylabel("loss (rank 0, every step)")
        ax.legend(fontsize=7)
        dax.set_yscale("log")
        dax.axhline(MATCH_TOL, color="#d62728", lw=0.8, ls="--", label="5e-5 (4 decimals)")
        dax.set_xlabel("step")
        dax.set_ylabel("|loss - torch's| (1e-9: equal)")
        dax.legend(fontsize=7)
    fig.suptitle(f"fairscale oss.py parity on CPU: ResNet-18 (width {plan['width']}) on digits {plan['image_size']}px, "
                 f"2 gloo workers, batch {plan['batch_size']}/rank, RMSprop(lr=1e-4, momentum=0.9), AMP "
                 f"{plan['amp_dtype']}\n{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
                 f"fairscale {machine.get('fairscale')}", fontsize=9)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {','.join(FRAMEWORKS)}")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64, help="per rank (oss.py: 256 on MNIST's 60000 images)")
    p.add_argument("--max-steps", type=int, default=0, help="steps per epoch at most (0: the whole epoch)")
    p.add_argument("--width", type=int, default=64, help="ResNet-18 base width (64: the real ResNet-18)")
    p.add_argument("--num-classes", type=int, default=1000,
                   help="classifier outputs (torchvision's default, as oss.py)")
    p.add_argument("--image-size", type=int, default=32, help="digits upscaled from 8x8 to this (a multiple of 8)")
    p.add_argument("--amp-dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="torch.autocast('cpu') dtype of the +amp modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per worker group, seconds")
    p.add_argument("--out", default=str(OUT_DIR))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: width 16, batch 16, 2 epochs of 3 steps, every run in one spawn")
    args = p.parse_args(argv)
    args.one_spawn = False
    if args.quick:
        args.width, args.batch_size, args.epochs, args.max_steps, args.one_spawn = 16, 16, 2, 3, True
    return args


def available(frameworks: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """The frameworks that import; why each other one is skipped."""
    skipped: Dict[str, str] = {}
    if "fairscale" in frameworks:
        why = fairscale_missing("bench-fairscale-parity")
        if why is not None:
            skipped["fairscale"] = why
    for fw, why in skipped.items():
        print(f"{fw} skipped: {why}")
    return [f for f in frameworks if f not in skipped], skipped


def plan_runs(modes: Sequence[str], frameworks: Sequence[str]) -> List[Run]:
    runs: List[Run] = []
    for mode in modes:
        base, amp = mode.split("+")[0], mode.endswith("+amp")
        for fw in frameworks:
            r = Run("torch", "pytorch", amp) if fw == "torch" else Run(fw, base, amp)
            if r not in runs:
                runs.append(r)
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    return sorted(runs, key=lambda r: (order[r.framework], r.amp, r.mode))


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    modes = csv_list(args.modes)
    check_choices(modes, MODES, "mode")
    requested = csv_list(args.frameworks)
    check_choices(requested, FRAMEWORKS, "framework")
    machine = report_machine("fairscale")
    frameworks, skipped = available(requested)
    n_params = sum(p.numel() for p in resnet18(args.width, args.num_classes).parameters())
    print(f"model: torchvision-architecture ResNet-18, width {args.width}, {args.num_classes} classes, "
          f"{n_params / 1e6:.2f}M parameters; data: sklearn digits 8x8 -> {args.image_size}x{args.image_size}, grey "
          f"repeated to 3 channels; {WORKERS} gloo workers, batch {args.batch_size} per rank, DistributedSampler + "
          f"BatchSampler(drop_last=True), {args.epochs} epochs"
          + (f" of at most {args.max_steps} steps" if args.max_steps else "")
          + f"; RMSprop(lr={LR}, momentum={MOMENTUM}), CrossEntropyLoss, seed {args.seed}; AMP: "
          f"torch.autocast('cpu', dtype=torch.{args.amp_dtype})")
    runs = plan_runs(modes, frameworks)
    digits = load_digits_images(args.image_size)
    plan_base = dict(seed=args.seed, width=args.width, num_classes=args.num_classes, batch_size=args.batch_size,
                     image_size=args.image_size, epochs=args.epochs, max_steps=args.max_steps,
                     amp_dtype=args.amp_dtype)
    results: Dict[str, Dict[str, Any]] = {}
    failed: Dict[str, str] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_fairscale_parity_") as tmp:
        groups = [runs] if args.one_spawn else [[r] for r in runs]
        for group in groups:
            if not group:
                continue
            names = ", ".join(r.key for r in group)
            t0 = time.perf_counter()
            log.info("running %s ...", names)
            plan = dict(plan_base, runs=[asdict(r) for r in group], param_dir=tmp, digits=digits)
            try:
                out = spawn_workers(_worker_body, WORKERS, plan, args.timeout * len(group), pg_timeout_s=300.0)
            except (RuntimeError, TimeoutError) as exc:
                lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
                why = (lines[-1] if lines else type(exc).__name__)[:400]
                log.error("%s failed: %s", names, str(exc)[-3000:])
                for r in group:
                    if r.framework == "torch":
                        raise SystemExit(f"the torch reference failed: {why}") from exc
                    failed[r.key] = f"failed: {why}"
                continue
            for res in out["results"]:
                results[Run(**res["run"]).key] = res
            log.info("  done in %.0f s", time.perf_counter() - t0)
        csv_rows, verdicts = report(results, failed, modes, requested, skipped)
        print_summary(verdicts)
        print_targets(targets(verdicts, modes, failed, skipped, requested))
    extra = dict(amp_dtype=args.amp_dtype, width=args.width, num_classes=args.num_classes, batch_size=args.batch_size,
                 image_size=args.image_size, workers=WORKERS, seed=args.seed, cpu=machine["cpu"],
                 cores=machine["cores"], torch=machine["torch"], fairscale=machine["fairscale"])
    print("\nloss = rank 0's loss on the epoch's last batch (what oss.py logs); step ms = median wall time of "
          "optimizer.step(closure) (AMP: closure + scaler.step + update), per step the max over ranks (side note: "
          "a shared 2-core machine)")
    print()
    write_outputs(Path(args.out), "bench_fairscale_parity", CSV_FIELDS, (dict(r, **extra) for r in csv_rows),
                  None if args.no_plot else (lambda png: plot(png, results, modes, requested, machine, plan_base)))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

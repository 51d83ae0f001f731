"""decentpy.AsyncPipe on gloo workers, checked against the unpipelined model in one process.

The reference is always plain PyTorch: the same ``nn.Sequential`` (same seed) run in each worker
on the whole batch, with ``loss.backward()`` and ``torch.optim.SGD``; ``nn.BatchNorm1d`` on the
whole batch for DeferredBatchNorm; ``checkpoint="never"`` for the dropout masks of a recomputed
forward (whose draws must equal the first forward's).

One spawn per world size (2, 3, 4) runs every scenario and returns all results (a scenario that
raises records its traceback instead of stopping the others); the tests only assert on the
cached results, so a failure names its scenario and configuration.
"""

from __future__ import annotations

import datetime
import gc
import time
import traceback
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dist_harness import run_example_main, run_workers, single_process_group

CHUNKS = (1, 2, 4, 7)
CHECKPOINTS = ("never", "except_last", "always")
DRIVERS = ("forward", "gpipe", "1f1b")  # forward: fairscale's `out = pipe(x)` + loss.backward()
BALANCES = {2: [3, 2], 3: [2, 2, 1], 4: [1, 1, 2, 1]}
BATCH = 10  # chunks 4 and 7 do not divide it; with 4 stages, chunks 1 and 2 give fewer micro-batches
TOL = {torch.float64: 1e-10, torch.float32: 2e-6}  # max abs error vs the reference (values ~1)
TIMEOUT_S = 15.0  # the pipe's own wait bound in these tests


# --- models ---------------------------------------------------------------------------------------


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    """Five layers (Linear, Tanh, Linear, ReLU, Linear): 6 -> 3."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


def data(n: int = BATCH, dtype: torch.dtype = torch.float64, seed: int = 1) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def mse(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


class Counter(nn.Module):
    """Identity that counts its calls (forwards and recomputations)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        return x


class SplitSign(nn.Module):
    """Tensor -> (tensor, int64 count of positives per row, bool mask): non-float tensors and a
    tuple cross the next boundary."""

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return x, (x > 0).sum(1), x > 0.5


class Join(nn.Module):
    """(h, counts, mask) -> h * (1 + counts) + mask: uses every element of the tuple."""

    def forward(self, xs: Tuple[Tensor, Tensor, Tensor]) -> Tensor:
        h, counts, mask = xs
        return h * (1 + counts.unsqueeze(1).to(h.dtype)) + mask.to(h.dtype)


class Boom(nn.Module):
    """Raises in forward (``when="forward"``) or in backward (``"backward"``) while ``armed``
    (in forward after letting ``skip`` calls through: a later micro-batch fails)."""

    def __init__(self, when: str, skip: int = 0) -> None:
        super().__init__()
        self.when, self.armed, self.skip = when, False, skip

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and self.when == "forward":
            if self.skip > 0:
                self.skip -= 1
                return x
            raise ValueError("boom in forward")
        return _RaiseInBackward.apply(x) if self.armed else x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise ValueError("boom in backward")


class InPlace(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.add_(1.0)


class ToTuple(nn.Module):
    """Tensor -> a 1-tuple of it."""

    def forward(self, x: Tensor) -> Tuple[Tensor]:
        return (x,)


class TupleLinear(nn.Module):
    """A Linear from a 1-tuple to a 1-tuple; a bare tensor is refused (not unpacked row-wise)."""

    def __init__(self, a: int, b: int, act: bool = False) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(a, b), act

    def forward(self, xs: Tuple[Tensor]) -> Tuple[Tensor]:
        if not (isinstance(xs, tuple) and len(xs) == 1):
            raise TypeError(f"TupleLinear expects a 1-tuple, got {type(xs).__name__}")
        y = self.fc(xs[0])
        return (torch.tanh(y) if self.act else y,)


def tuple_mse(out: Any, target: Tensor) -> Tensor:
    if not (isinstance(out, tuple) and len(out) == 1):
        raise TypeError(f"the loss expects the model's 1-tuple, got {type(out).__name__}")
    return mse(out[0], target)


# --- helpers run in the workers -----------------------------------------------------------------------


def make_pipe(module: Any, balance: Sequence[int], **kw: Any) -> Any:
    from decentpy import AsyncPipe

    kw.setdefault("timeout", TIMEOUT_S)
    return AsyncPipe(module, list(balance), **kw)


def drive(pipe: Any, x: Tensor, y: Tensor, driver: str) -> Optional[Tensor]:
    """One training step's forward and backward; the output (final stage) or None."""
    if driver == "forward":
        out = pipe(x if pipe.stage == 0 else None)
        if pipe.final_stage:
            if out.requires_grad:  # not in eval mode / under no_grad
                mse(out, y).backward()
            return out.detach()
        pipe.back_helper(out)
        return None
    loss = pipe.train_step(x, y, mse, schedule=driver)
    return loss


def stage_params(pipe: Any, ref: nn.Sequential) -> List[Tuple[str, Tensor, Tensor]]:
    """(name, the pipe's parameter, the reference's) for this rank's layers (names as in the model)."""
    refp = dict(ref.named_parameters())
    return [(n, p, refp[n]) for n, p in pipe.partition.named_parameters()] if pipe.partition is not None else []


def max_err(pairs: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]]) -> float:
    err = 0.0
    for a, b in pairs:
        if a is None or b is None:
            return float("inf") if (a is None) != (b is None) else err
        err = max(err, (a.double() - b.double()).abs().max().item())
    return err


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """A scenario's result, or its traceback (the other scenarios go on)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}


def expect_failure(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``fn`` (every rank), which should raise; what was raised and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        from decentpy import PipelineError

        return {"raised": type(exc).__name__, "text": str(exc), "pipeline_error": isinstance(exc, PipelineError),
                "stage": getattr(exc, "stage", None), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


# --- scenarios ---------------------------------------------------------------------------------------


def sc_matrix(rank: int, world: int) -> Dict[str, float]:
    """Every chunks x checkpoint x driver x dtype: max error of this stage's gradients and of the
    output / loss vs the reference."""
    out: Dict[str, float] = {}
    balance = BALANCES[world]
    for dtype in (torch.float64, torch.float32):
        x, y = data(dtype=dtype)
        ref = mlp(dtype)
        ref_out = ref(x)
        ref_loss = mse(ref_out, y)
        ref_loss.backward()
        for driver in DRIVERS:
            for chunks in CHUNKS:
                for ckpt in CHECKPOINTS:
                    pipe = make_pipe(mlp(dtype), balance, chunks=chunks, checkpoint=ckpt)
                    result = drive(pipe, x, y, driver)
                    pairs = [(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)]
                    if pipe.final_stage:
                        pairs.append((result, ref_out.detach() if driver == "forward" else ref_loss.detach()))
                    out[f"{driver}/{chunks}/{ckpt}/{str(dtype)[6:]}"] = max_err(pairs)
    return out


def sc_training(rank: int, world: int) -> Dict[str, float]:
    """Four SGD (momentum) steps per stage, batches of changing size, vs single-process training."""
    out: Dict[str, float] = {}
    for driver in DRIVERS:
        ref = mlp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        pipe = make_pipe(mlp(), BALANCES[world], chunks=3, checkpoint="except_last", schedule="1f1b")
        params = list(pipe.parameters())  # a stage may have none (Tanh alone)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
        for k, n in enumerate((10, 6, 13, 2)):
            x, y = data(n, seed=10 + k)
            ref_opt.zero_grad()
            mse(ref(x), y).backward()
            ref_opt.step()
            if opt is not None:
                opt.zero_grad()
            drive(pipe, x, y, driver)
            if opt is not None:
                opt.step()
        out[driver] = max_err([(p, r) for _, p, r in stage_params(pipe, ref)])
    return out


def sc_tuples(rank: int, world: int) -> Dict[str, float]:
    """A tuple with int64 and bool tensors crosses a boundary; batch size changes between steps."""
    def model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 5), SplitSign(), Join(), nn.Linear(5, 3)).double()

    balance = {2: [2, 2], 3: [2, 1, 1], 4: [1, 1, 1, 1]}[world]
    out: Dict[str, float] = {}
    for driver in DRIVERS:
        for n in (10, 5):
            x, y = data(n, seed=n)
            ref = model()
            ref_out = ref(x)
            mse(ref_out, y).backward()
            pipe = make_pipe(model(), balance, chunks=3)
            result = drive(pipe, x, y, driver)
            pairs = [(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)]
            if pipe.final_stage:
                pairs.append((result, ref_out.detach() if driver == "forward" else mse(ref_out, y).detach()))
            out[f"{driver}/batch{n}"] = max_err(pairs)
    return out


def sc_dropout(rank: int, world: int) -> Dict[str, float]:
    """Dropout in every stage: checkpointed runs (recomputed before backward) vs checkpoint="never"
    with the same seeds: the same masks, so the same output and gradients."""
    def model() -> nn.Sequential:
        torch.manual_seed(5)
        layers: List[nn.Module] = []
        for _ in range(world):
            layers += [nn.Linear(6, 6), nn.Dropout(0.5)]
        return nn.Sequential(*layers).double()

    x = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    y = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    out: Dict[str, float] = {}
    for driver in DRIVERS:
        runs = {}
        for ckpt in CHECKPOINTS:
            pipe = make_pipe(model(), [2] * world, chunks=4, checkpoint=ckpt)
            torch.manual_seed(100 + rank)
            result = drive(pipe, x, y, driver)
            runs[ckpt] = ([p.grad for p in pipe.parameters()], result)
        base_grads, base_out = runs["never"]
        for ckpt in ("except_last", "always"):
            grads, result = runs[ckpt]
            pairs = list(zip(grads, base_grads)) + ([(result, base_out)] if result is not None else [])
            out[f"{driver}/{ckpt}"] = max_err(pairs)
        # the masks are random (a zero-dropout run would differ): guards against a vacuous check
        pipe = make_pipe(model(), [2] * world, chunks=4, checkpoint="never")
        torch.manual_seed(200 + rank)
        drive(pipe, x, y, driver)
        out[f"{driver}/other_seed_differs"] = max_err(list(zip([p.grad for p in pipe.parameters()], base_grads)))
    return out


def sc_calls(rank: int, world: int) -> Dict[str, Any]:
    """How often each stage's layers run: m per mini-batch, plus one recomputation per
    checkpointed micro-batch in training; none in eval or under no_grad, where no graph is built."""
    m = 4
    out: Dict[str, Any] = {}
    for ckpt in CHECKPOINTS:
        for mode in ("train", "eval", "no_grad"):
            for driver in DRIVERS:
                layers: List[nn.Module] = []
                for _ in range(world):
                    layers += [Counter(), nn.Linear(6, 6)]
                torch.manual_seed(0)
                pipe = make_pipe(nn.Sequential(*layers).double(), [2] * world, chunks=m, checkpoint=ckpt)
                x, _ = data(8)
                y = torch.zeros(8, 6, dtype=torch.float64)
                if mode == "eval":
                    pipe.eval()
                ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
                with ctx:
                    if driver == "forward":
                        res = pipe(x if pipe.stage == 0 else None)
                        graph = any(t.requires_grad or t.grad_fn is not None
                                    for t in (res if isinstance(res, list) else [res]))
                        if pipe.final_stage and mode == "train":
                            mse(res, y).backward()
                        elif mode == "train":
                            pipe.back_helper(res)
                    else:
                        res = pipe.train_step(x, y, mse, schedule=driver)
                        graph = res is not None and (res.requires_grad or res.grad_fn is not None)
                out[f"{ckpt}/{mode}/{driver}"] = (pipe[0].calls, graph)
    return out


def sc_batchnorm(rank: int, world: int) -> Dict[str, float]:
    """deferred_batch_norm=True: after two mini-batches (chunks 4, not dividing the batch; every
    micro-batch recomputed for its backward) each stage's running statistics equal those of an
    nn.BatchNorm1d fed the whole mini-batch that reached the layer (its micro-batches joined)."""
    def model() -> nn.Sequential:
        torch.manual_seed(9)
        layers: List[nn.Module] = []
        for _ in range(world):
            layers += [nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=0.3)]
        return nn.Sequential(*layers)

    pipe = make_pipe(model(), [2] * world, chunks=4, deferred_batch_norm=True, checkpoint="always")
    bn = pipe[1]
    ref = nn.BatchNorm1d(6, momentum=0.3)
    seen: List[Tensor] = []
    bn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    for k in range(2):
        x = torch.randn(10, 6, generator=torch.Generator().manual_seed(20 + k)) * 3 + 1
        y = torch.randn(10, 6, generator=torch.Generator().manual_seed(30 + k))
        seen.clear()
        drive(pipe, x, y, "gpipe")
        assert len(seen) == 8, len(seen)  # 4 forwards + 4 recomputations
        ref(torch.cat(seen[:4]))  # the micro-batches' first forwards make up the mini-batch
    return {"stats": max_err([(bn.running_mean, ref.running_mean), (bn.running_var, ref.running_var)]),
            "tracked": float(int(bn.num_batches_tracked) != int(ref.num_batches_tracked)),
            "deferred": float(type(bn).__name__ != "DeferredBatchNorm"),
            "moved": max_err([(bn.running_mean, torch.zeros(6))])}


def sc_failures(rank: int, world: int) -> Dict[str, Any]:
    """An exception in a stage reaches every rank as an exception naming the stage, in time."""
    out: Dict[str, Any] = {}
    last = world - 1
    cases = [("last_forward_eval", last, "forward", "eval", 0), ("last_forward_train", last, "forward", "train", 0),
             ("first_forward_train", 0, "forward", "train", 0), ("last_backward_train", last, "backward", "train", 0),
             ("first_backward_train", 0, "backward", "train", 0),
             # the second micro-batch fails after the first went through: several receives are
             # posted ahead on both sides of the stage, and the neighbours fill them
             ("second_microbatch_forward", 1, "forward", "train", 1)]
    if world > 2:
        cases.append(("middle_backward_train", 1, "backward", "train", 0))
    for name, where, when, mode, skip in cases:
        for driver in DRIVERS:
            layers: List[nn.Module] = []
            for s in range(world):
                layers += [nn.Linear(6, 6), Boom(when, skip)]
            torch.manual_seed(0)
            pipe = make_pipe(nn.Sequential(*layers).double(), [2] * world, chunks=3)
            if pipe.stage == where:
                pipe[1].armed = True
            if mode == "eval":
                pipe.eval()
            x, _ = data(6)
            y = torch.zeros(6, 6, dtype=torch.float64)
            res = expect_failure(lambda: drive(pipe, x, y, driver))
            # the stages read what the failed step left unread: the pipe goes on, in step
            res["next_step"] = expect_failure(lambda: drive(pipe, x, y, driver))["raised"]
            pipe[1].armed = False
            res["recovered"] = expect_failure(lambda: drive(pipe, x, y, driver))["raised"]
            out[f"{name}/{driver}"] = res
    return out


def sc_container(rank: int, world: int) -> Dict[str, Any]:
    """len, indexing (negative too), iteration over this rank's layers; lazily built layers (a list
    of callables is called only on the owning rank)."""
    built: List[int] = []

    def lazy(i: int) -> Callable[[], nn.Module]:
        from decentpy.pipeline import LazyModule

        def make() -> nn.Module:
            built.append(i)
            return nn.Linear(6, 6)
        return LazyModule(make) if i % 2 else make  # fairscale's LazyModule, or any callable

    n = 2 * world
    pipe = make_pipe([lazy(i) for i in range(n)], [2] * world)
    mine = list(pipe)
    res = {"len": len(pipe), "built": built, "iter_is_layers": [type(m).__name__ for m in mine],
           "neg_index_is_last": pipe[-1] is mine[-1], "index0_is_first": pipe[0] is mine[0]}
    try:
        pipe[len(mine)]
        res["out_of_range"] = None
    except IndexError as exc:
        res["out_of_range"] = str(exc)
    return res


def sc_idle_rank(rank: int, world: int) -> Dict[str, float]:
    """Fewer stages than ranks: the last rank holds nothing, its forward returns its input, and it
    takes part in every step's end."""
    if world < 3:
        return {}
    balance = [3, 2] if world == 3 else [2, 2, 1]
    x, y = data()
    ref = mlp()
    ref_out = ref(x)
    mse(ref_out, y).backward()
    out = {}
    for driver in DRIVERS:
        pipe = make_pipe(mlp(), balance, chunks=2)
        result = drive(pipe, x, y, driver)
        if pipe.stage is None:  # fairscale's tests read pipe.pipeline (None on an idle rank)
            out[driver] = float(len(pipe) != 0 or pipe.partition is not None or pipe.pipeline is not None)
        else:
            pairs = [(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)]
            if pipe.final_stage:
                pairs.append((result, ref_out.detach() if driver == "forward" else mse(ref_out, y).detach()))
            out[driver] = max_err(pairs)
    return out


def sc_hybrid(rank: int, world: int) -> Dict[str, float]:
    """Two 2-stage pipelines side by side ({0, 1} and {2, 3}), each stage's two replicas averaging
    gradients in their own group ({0, 2} and {1, 3}): equal to one model on both halves' batch."""
    if world != 4:
        return {}
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, stage = rank // 2, rank % 2
    x, y = data(12)
    ref = mlp()
    mse(ref(x), y).backward()
    out = {}
    for driver in DRIVERS:
        pipe = make_pipe(mlp(), [3, 2], group=pipes[replica], chunks=3)
        assert pipe.stage == stage
        half = slice(6 * replica, 6 * replica + 6)
        drive(pipe, x[half], y[half], driver)
        for p in pipe.parameters():
            dist.all_reduce(p.grad, group=dps[stage])
            p.grad /= 2
        out[driver] = max_err([(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)])
    return out


def sc_bad_input(rank: int, world: int) -> Dict[str, Any]:
    """Bad input that only some ranks see, or that needs the group: a clear error on every rank."""
    out: Dict[str, Any] = {}
    # arguments that differ between ranks
    out["chunks_differ"] = expect_failure(lambda: make_pipe(mlp(), BALANCES[world], chunks=2 + (rank == 1)))
    # not a tensor on the first stage: every rank raises (ERROR notices only, the pipe stays usable)
    pipe = make_pipe(mlp(), BALANCES[world], chunks=2)
    x, y = data()
    for name, bad in (("list_input", [x]), ("str_input", "x"), ("scalar_input", torch.tensor(1.0)),
                      ("ragged_tuple", (x, x[:3]))):
        for driver in ("forward", "gpipe"):
            res = expect_failure(lambda: drive(pipe, bad if pipe.stage == 0 else None, y, driver))  # noqa: B023
            out[f"{name}/{driver}"] = res
    loss = drive(pipe, x, y, "gpipe")
    out["usable_after"] = max_err([(loss, mse(mlp()(x), y))]) if pipe.final_stage else 0.0
    # in-place on an input that requires grad (the second stage's received activations)
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(6, 6)] + [InPlace() if s == 1 else nn.Linear(6, 6) for s in range(1, world)]
    pipe = make_pipe(nn.Sequential(*layers).double(), [1] * world, chunks=2)
    out["inplace"] = expect_failure(lambda: drive(pipe, x, torch.zeros(10, 6, dtype=torch.float64), "gpipe"))
    # a loss that is not a scalar
    pipe = make_pipe(mlp(), BALANCES[world], chunks=2)
    out["loss_not_scalar"] = expect_failure(lambda: pipe.train_step(x, y, lambda o, t: (o - t) ** 2))
    # the final stage runs forward twice without a backward in between
    pipe = make_pipe(mlp(), BALANCES[world], chunks=2)

    def twice() -> None:
        for _ in range(2):
            out_ = pipe(x if pipe.stage == 0 else None)
            if not pipe.final_stage:
                pipe.back_helper(out_)

    out["forward_twice"] = expect_failure(twice)
    out["forward_twice_then"] = expect_failure(lambda: drive(pipe, x, y, "forward"))["raised"]
    return out


def sc_memory(rank: int, world: int) -> Dict[str, Any]:
    """Activation memory per stage (bytes autograd holds for backward, ActivationMeter): GPipe
    keeps all m micro-batches alive, 1F1B at most S - s on stage s."""
    from decentpy.pipeline import ActivationMeter

    m, width = 8, 32
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(world):
        layers += [nn.Linear(width, width), nn.ReLU()]
    x = torch.randn(4 * m, width)
    y = torch.zeros(4 * m, width)
    out: Dict[str, Any] = {}
    for name in ("gpipe", "1f1b"):
        pipe = make_pipe(nn.Sequential(*layers), [2] * world, chunks=m, checkpoint="never")
        with ActivationMeter() as meter:
            pipe.train_step(x, y, mse, schedule=name)
        out[name] = (meter.peak_bytes, meter.live_bytes)
    # one micro-batch's worth: the same stage on a single micro-batch
    pipe = make_pipe(nn.Sequential(*layers), [2] * world, chunks=1, checkpoint="never")
    with ActivationMeter() as meter:
        pipe.train_step(x[:4], y[:4], mse)
    out["one"] = meter.peak_bytes
    return out


def sc_transport(rank: int, world: int) -> Dict[str, Any]:
    """Both wire formats (one buffer: gloo's; header then tensors: NCCL's, run here over gloo) carry
    every dtype, empty and absent tensors, a header longer than HEADER_SLOTS, growing and
    shrinking messages, lazily conjugated and non-contiguous tensors, in order."""
    if world != 2:
        return {}
    from decentpy.pipeline.transport import DTYPES, HEADER_SLOTS, Kind, Link

    g = torch.Generator().manual_seed(4)

    def tensor(dtype: torch.dtype, shape: Tuple[int, ...]) -> Tensor:
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 50
        if dtype.is_complex:
            return torch.complex(t, -t).to(dtype)
        return t.to(dtype) if dtype != torch.bool else t > 0

    messages: List[Tuple[Kind, List[Optional[Tensor]]]] = [
        (Kind.DATA, [tensor(d, (3, 2 + i % 3)) for i, d in enumerate(DTYPES)]),   # every dtype, in one message
        (Kind.DATA, [tensor(torch.float32, (1, 2))]),                            # shrinks
        (Kind.GRAD, [None, tensor(torch.float64, (500, 7)), torch.empty(0, 5)]),  # grows; absent and empty
        (Kind.DATA, [tensor(torch.int64, (2,) * 7) for _ in range(6)]),           # header > HEADER_SLOTS
        (Kind.NOGRAD, []),
        # a lazily conjugated complex tensor and a transposed one travel as their values
        (Kind.DATA, [tensor(torch.complex64, (3, 4)).conj(), tensor(torch.float32, (4, 3)).t()]),
    ]
    out: Dict[str, Any] = {}
    from decentpy.comm import CommGroup

    groups = CommGroup()
    down, up = groups.new_subgroup([0, 1], datetime.timedelta(seconds=TIMEOUT_S)), \
        groups.new_subgroup([0, 1], datetime.timedelta(seconds=TIMEOUT_S))
    for variant in ("one_buffer", "parts", "directional"):
        one_buffer = variant != "parts"
        # directional: one group per direction, as AsyncPipe builds them on gloo (rank 0 sends downstream)
        via = {"send_group": down if rank == 0 else up, "recv_group": up if rank == 0 else down} \
            if variant == "directional" else {}
        link = Link(1 - rank, 1 - rank, rank, dist.group.WORLD, torch.device("cpu"), one_buffer,
                    datetime.timedelta(seconds=TIMEOUT_S), **via)
        ok = []
        for j, (kind, tensors) in enumerate(messages):
            if rank == 0:
                link.send(kind, j, len(messages), tensors, [t is not None and t.is_floating_point() for t in tensors])
                continue
            msg = link.recv(f"message {j}")
            same = msg.kind == kind and msg.mb == j and msg.count == len(messages) and len(msg.tensors) == len(tensors)
            for a, b in zip(msg.tensors, tensors):
                same = same and ((a is None and b is None) or
                                 (a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b)))
            ok.append(same)
        link.finish()
        dist.barrier()
        out[variant] = ok
    out["long_header"] = 5 + sum(4 + 7 for _ in range(6)) > HEADER_SLOTS
    # receive buffers: reused once no tensor views them, never while one does
    link = Link(1 - rank, 1 - rank, rank, dist.group.WORLD, torch.device("cpu"), True,
                datetime.timedelta(seconds=TIMEOUT_S))
    if rank == 0:
        for j in range(3):
            link.send(Kind.DATA, j, 3, [torch.full((64, 64), float(j))], [False])
    else:
        first = link.recv("message 0").tensors[0]
        at = first.data_ptr()
        del first
        second = link.recv("message 1").tensors[0]
        third = link.recv("message 2").tensors[0]
        out["reuse"] = (second.data_ptr() == at, third.data_ptr() != second.data_ptr(),
                        bool((second == 1.0).all()), bool((third == 2.0).all()))
    link.finish()
    dist.barrier()
    # receives posted ahead: after a step's first message, several at once at its capacity; a later
    # message larger than that comes SPLIT into them, a step's first message larger than it GROWs
    # the one receive posted before it; each step ends with nothing posted
    steps = [[(64, 64), (64, 64), (130, 64), (3, 5), (64, 64)], [(200, 64), (10, 10), (300, 64)]]
    link = Link(1 - rank, 1 - rank, rank, dist.group.WORLD, torch.device("cpu"), True,
                datetime.timedelta(seconds=TIMEOUT_S))
    got: List[bool] = []
    for k, shapes in enumerate(steps):
        sent = [tensor(torch.float32, shape) for shape in shapes]
        if rank == 0:
            for j, t in enumerate(sent):
                link.send(Kind.DATA, j, len(sent), [t], [False])
        else:
            link.prepost(len(sent))  # before the step's first message: only one is posted
            got.append(link.consumed == 1)
            for j, t in enumerate(sent):
                msg = link.recv(f"message {j} of step {k}")
                got.append(msg.mb == j and torch.equal(msg.tensors[0], t))
                link.prepost(len(sent) - 1 - j)  # every later message's receive, posted now
                got.append(link.consumed == len(sent))
        link.finish()
        dist.barrier()
    out["posted_ahead"] = got
    return out


class Widen(nn.Module):
    """Repeats its input's columns more the fewer rows it has: a later (smaller) micro-batch sends
    a larger message than the first one (with receives posted ahead at the first one's size)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.repeat(1, max(1, 18 // x.shape[0] ** 2))


class RowMean(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1, keepdim=True)


def sc_growing_messages(rank: int, world: int) -> Dict[str, Any]:
    """GPipe whose later micro-batches' activations outgrow the first one's (rows 3, 3, 2, 2 widened
    2, 2, 4, 4 times): the loss and every stage's gradients equal the unpipelined model's."""
    if world != 2:
        return {}

    def model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 4), Widen(), RowMean(), nn.Linear(1, 3)).double()

    x, y = data()
    ref = model()
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pipe = make_pipe(model(), [2, 2], chunks=4, checkpoint="never")
    errors = []
    for _ in range(2):  # the second step starts at the grown capacity
        for p in pipe.partition.parameters():
            p.grad = None
        loss = pipe.train_step(x if pipe.stage == 0 else None, y if pipe.final_stage else None, mse)
        if loss is not None:
            errors.append(abs(float(loss) - float(ref_loss)))
        want = list((ref[:2] if pipe.stage == 0 else ref[2:]).parameters())
        for p, w in zip(pipe.partition.parameters(), want, strict=True):
            errors.append(float((p.grad - w.grad).abs().max()))
    return {"errors": errors}


def sc_receive_buffers(rank: int, world: int) -> Dict[str, Any]:
    """The receive buffers a stage holds: one per micro-batch when training with GPipe (the
    activations its backward keeps), at most as many as it keeps in flight for a forward-only pass."""
    if world != 2:
        return {}
    torch.manual_seed(0)
    pipe = make_pipe(nn.Sequential(nn.Linear(6, 32), nn.Linear(32, 3)).double(), [1, 1], chunks=8)
    x, y = torch.randn(64, 6, dtype=torch.float64), torch.randn(64, 3, dtype=torch.float64)
    held: Dict[str, int] = {}
    for mode in ("eval", "train"):
        pipe.train(mode == "train")
        for _ in range(3):
            with torch.set_grad_enabled(mode == "train"):
                drive(pipe, x, y, "forward" if mode == "eval" else "gpipe")
        held[mode] = pipe.receive_buffer_bytes
    return held


def sc_structure(rank: int, world: int) -> Dict[str, Any]:
    """1-tuples across stage boundaries and as the model's output: every stage gets what the layer
    before it returned (a tuple stays a tuple), the final stage's output and loss_fn see the
    unpipelined model's structure, in training and in eval; gradients equal the reference."""
    def model() -> nn.Sequential:
        torch.manual_seed(11)
        return nn.Sequential(nn.Linear(6, 6), ToTuple(), TupleLinear(6, 6, act=True), TupleLinear(6, 6),
                             TupleLinear(6, 3)).double()

    balance = {2: [2, 3], 3: [2, 2, 1], 4: [1, 1, 2, 1]}[world]
    x, y = data()
    ref = model()
    ref_out = ref(x)
    tuple_mse(ref_out, y).backward()
    out: Dict[str, Any] = {}
    for driver in DRIVERS:
        for chunks in (1, 3):
            pipe = make_pipe(model(), balance, chunks=chunks)
            if driver == "forward":
                res = pipe(x if pipe.stage == 0 else None)
                if pipe.final_stage:
                    out[f"{driver}/{chunks}/type"] = (type(res).__name__, len(res))
                    tuple_mse(res, y).backward()
                    got: Any = res[0].detach()
                    want = ref_out[0].detach()
                else:
                    pipe.back_helper(res)
            else:
                got = pipe.train_step(x, y, tuple_mse, schedule=driver)
                want = tuple_mse(ref_out, y).detach()
            pairs = [(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)]
            if pipe.final_stage:
                pairs.append((got, want))
            out[f"{driver}/{chunks}"] = max_err(pairs)
    pipe = make_pipe(model(), balance, chunks=3)
    pipe.eval()
    res = pipe(x if pipe.stage == 0 else None)
    if pipe.final_stage:
        out["eval/type"] = (type(res).__name__, len(res))
        out["eval"] = max_err([(res[0], ref_out[0])])
    return out


def sc_inplace_output(rank: int, world: int) -> Dict[str, Any]:
    """The final stage's output is a tensor the caller owns: modified in place before the loss
    (gradients equal the reference doing the same), written into by a collective after the
    backward (fairscale's tests all_gather into it), without a copy of the activation (one
    micro-batch: the output is the last layer's own memory)."""
    last = dist.new_group([world - 1])  # a collective writing into the output, on the final rank alone
    x, y = data()
    ref = mlp()
    ref_out = ref(x)
    ref_out.mul_(2.0).add_(1.0)
    mse(ref_out, y).backward()
    out: Dict[str, Any] = {}
    for chunks in (1, 3):
        for ckpt in ("never", "except_last"):
            pipe = make_pipe(mlp(), BALANCES[world], chunks=chunks, checkpoint=ckpt)
            produced: List[Tensor] = []
            if pipe.final_stage:
                pipe[-1].register_forward_hook(lambda _m, _a, o: produced.append(o))
            res = pipe(x if pipe.stage == 0 else None)
            key = f"{chunks}/{ckpt}"
            if pipe.final_stage:
                res.mul_(2.0).add_(1.0)
                mse(res, y).backward()
                out[f"{key}/shares_memory"] = res.data_ptr() == produced[0].data_ptr()
                pairs: List[Tuple[Optional[Tensor], Optional[Tensor]]] = [(res.detach().clone(), ref_out.detach())]
                dist.all_gather([res], torch.full_like(res, 7.0), group=last)
                out[f"{key}/gathered"] = bool((res == 7.0).all())
            else:
                pipe.back_helper(res)
                pairs = []
            pairs += [(p.grad, r.grad) for _, p, r in stage_params(pipe, ref)]
            out[key] = max_err(pairs)
    return out


def sc_reused_buffers(rank: int, world: int) -> Dict[str, Any]:
    """Receive buffers are reused from message to message, but never while a tensor views them:
    with identities after the first stage, the final output is a view of the last receive buffer;
    outputs kept from earlier steps keep their values while later steps run (eval and training)."""
    def model() -> nn.Sequential:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(6, 3), *[nn.Identity() for _ in range(world - 1)]).double()

    ref = model()
    pipe = make_pipe(model(), [1] * world, chunks=1)
    kept: List[Tuple[Tensor, Tensor]] = []
    for k in range(4):
        x, y = data(seed=10 + k)
        pipe.train(k % 2 == 1)
        with torch.set_grad_enabled(k % 2 == 1):
            res = pipe(x if pipe.stage == 0 else None)
            if pipe.final_stage:
                kept.append((res, ref(x).detach()))
                if res.requires_grad:
                    mse(res, y).backward()
            elif res is not None and pipe.training:
                pipe.back_helper(res)
    if not pipe.final_stage:
        return {}
    return {"errors": [float((got.detach() - want).abs().max()) for got, want in kept]}


class Recorder(nn.Module):
    """Identity that keeps a weak reference to every tensor it is given and to what they view."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[Any] = []

    def forward(self, x: Tensor) -> Tensor:
        t: Optional[Tensor] = x
        while t is not None:
            self.seen.append(weakref.ref(t))
            t = t._base
        return x


def sc_step_memory_freed(rank: int, world: int) -> Dict[str, Any]:
    """Nothing of a step stays alive once it ended: the activations every stage received (and the
    buffers they view) are freed, with both schedules, checkpointing, and fairscale's way of
    driving the pipe -- as with the unpipelined model, whose step keeps nothing either."""
    layers: List[nn.Module] = []
    for s in range(world):
        layers += [Recorder(), nn.Linear(6, 6 if s + 1 < world else 3)]
    torch.manual_seed(0)
    out: Dict[str, Any] = {}
    for checkpoint in ("never", "except_last"):
        pipe = make_pipe(nn.Sequential(*layers).double(), [2] * world, chunks=4, checkpoint=checkpoint)
        recorder = pipe[0]
        x, y = data(seed=3)
        for schedule in ("gpipe", "1f1b", "gpipe"):
            pipe.train_step(x, y, mse, schedule=schedule)
        res = pipe(x if pipe.stage == 0 else None)
        if pipe.final_stage:
            mse(res, y).backward()
        else:
            pipe.back_helper(res)
        del res, x, y
        gc.collect()
        out[checkpoint] = (len(recorder.seen), sum(r() is not None for r in recorder.seen))
    return out


def sc_closed(rank: int, world: int) -> Dict[str, Any]:
    """close() releases the pipe's own groups: a step after it is refused clearly on every rank, a
    second close() does nothing, the layers keep their trained values, the process group the pipe
    was built on stays usable."""
    torch.manual_seed(0)
    with make_pipe(nn.Sequential(*[nn.Linear(6, 6) for _ in range(world)]).double(), [1] * world, chunks=2) as pipe:
        x, _ = data(seed=4)
        pipe.train_step(x, torch.zeros(BATCH, 6, dtype=torch.float64), mse)
        trained = [p.grad.clone() for p in pipe.parameters()]
    pipe.close()
    try:
        pipe.train_step(x, x, mse)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    ok = torch.ones(1)
    dist.all_reduce(ok)
    return {"refused": refused, "grads_kept": all(torch.equal(p.grad, g) for p, g in zip(pipe.parameters(), trained)),
            "group_usable": float(ok) == world}


def sc_grad_of_grad(rank: int, world: int) -> Dict[str, Any]:
    """Gradients of gradients cannot cross stages: a backward with create_graph=True fails on every
    rank (the final stage's own RuntimeError, a PipelineError elsewhere), and a training forward is
    refused while a parameter's gradient requires grad -- before that stage runs a layer (as
    fairscale refuses it at forward); the pipe goes on after each."""
    out: Dict[str, Any] = {}
    layers: List[nn.Module] = []
    for _ in range(world):
        layers += [Counter(), nn.Linear(6, 6)]
    torch.manual_seed(0)
    pipe = make_pipe(nn.Sequential(*layers).double(), [2] * world, chunks=2)
    x, _ = data(6)
    y = torch.zeros(6, 6, dtype=torch.float64)

    def create_graph() -> None:
        res = pipe(x if pipe.stage == 0 else None)
        if pipe.final_stage:
            mse(res, y).backward(create_graph=True)
        else:
            pipe.back_helper(res)

    out["backward"] = expect_failure(create_graph)
    for p in pipe.parameters():
        p.grad = None
    out["backward_then"] = expect_failure(lambda: drive(pipe, x, y, "gpipe"))["raised"]
    where = world - 1
    for driver in DRIVERS:
        for p in pipe.parameters():
            p.grad = None
        if pipe.stage == where:
            pipe[1].weight.grad = torch.zeros_like(pipe[1].weight).requires_grad_(True)
        before = pipe[0].calls
        res = expect_failure(lambda: drive(pipe, x, y, driver))  # noqa: B023
        res["layer_calls"] = pipe[0].calls - before
        for p in pipe.parameters():
            p.grad = None
        res["then"] = expect_failure(lambda: drive(pipe, x, y, driver))["raised"]  # noqa: B023
        out[f"forward/{driver}"] = res
    return out


def sc_mixed_modes(rank: int, world: int) -> Dict[str, Any]:
    """Stage 0 trains while the other stages run in eval mode: they answer stage 0's gradient
    waits with NOGRAD, so nobody waits for a timeout; the next step (all training) is in step."""
    x, y = data()
    out: Dict[str, Any] = {}
    for driver in DRIVERS:
        pipe = make_pipe(mlp(), BALANCES[world], chunks=3)
        if pipe.stage != 0:
            pipe.eval()
        res = expect_failure(lambda: drive(pipe, x, y, driver))  # noqa: B023
        res["grads"] = [p.grad is not None for p in pipe.parameters()]
        pipe.train()
        res["then"] = expect_failure(lambda: drive(pipe, x, y, driver))["raised"]  # noqa: B023
        out[driver] = res
    return out


SCENARIOS: Dict[str, Callable[[int, int], Any]] = {
    "transport": sc_transport, "step_memory_freed": sc_step_memory_freed,
    "closed": sc_closed,
    "memory": sc_memory,
    "matrix": sc_matrix, "training": sc_training, "tuples": sc_tuples, "dropout": sc_dropout,
    "calls": sc_calls, "batchnorm": sc_batchnorm, "failures": sc_failures, "container": sc_container,
    "idle_rank": sc_idle_rank, "hybrid": sc_hybrid, "bad_input": sc_bad_input,
    "structure": sc_structure, "inplace_output": sc_inplace_output, "grad_of_grad": sc_grad_of_grad,
    "mixed_modes": sc_mixed_modes, "reused_buffers": sc_reused_buffers, "growing_messages": sc_growing_messages,
    "receive_buffers": sc_receive_buffers,
}


def pipeline_worker(rank: int, world: int) -> Dict[str, Any]:
    return {name: guarded(fn, rank, world) for name, fn in SCENARIOS.items()}


_CACHE: Dict[int, List[Dict[str, Any]]] = {}


def results(world: int) -> List[Dict[str, Any]]:
    if world not in _CACHE:
        _CACHE[world] = run_workers(pipeline_worker, world, timeout=420, pg_timeout_s=60)
    return _CACHE[world]


def scenario(world: int, name: str) -> List[Any]:
    res = [r[name] for r in results(world)]
    errors = [f"rank {r}:\n{v['error']}" for r, v in enumerate(res) if isinstance(v, dict) and "error" in v]
    assert not errors, f"scenario {name} raised:\n" + "\n".join(errors)
    return res


WORLDS = (2, 3, 4)


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gradients_and_output_equal_unpipelined(world: int, dtype: str) -> None:
    tol = TOL[getattr(torch, dtype)]
    bad = {}
    for rank, res in enumerate(scenario(world, "matrix")):
        for key, err in res.items():
            if key.endswith(dtype) and not err <= tol:
                bad[f"rank {rank} {key}"] = err
    checked = sum(key.endswith(dtype) for key in results(world)[0]["matrix"])
    assert checked == len(DRIVERS) * len(CHUNKS) * len(CHECKPOINTS), checked
    assert not bad, f"max abs error above {tol}: {bad}"


@pytest.mark.parametrize("world", WORLDS)
def test_training_matches_single_process(world: int) -> None:
    for rank, res in enumerate(scenario(world, "training")):
        assert set(res) == set(DRIVERS)
        for driver, err in res.items():
            assert err <= 1e-10, (rank, driver, err)


@pytest.mark.parametrize("world", WORLDS)
def test_tuples_and_integer_tensors_cross_boundaries(world: int) -> None:
    for rank, res in enumerate(scenario(world, "tuples")):
        assert len(res) == 2 * len(DRIVERS)
        for key, err in res.items():
            assert err <= 1e-10, (rank, key, err)


@pytest.mark.parametrize("world", (2, 4))
def test_dropout_recomputed_with_the_same_mask(world: int) -> None:
    for rank, res in enumerate(scenario(world, "dropout")):
        for key, err in res.items():
            if key.endswith("other_seed_differs"):
                assert err > 1e-3, (rank, key, err)  # the masks really are random
            else:
                assert err <= 1e-12, (rank, key, err)


@pytest.mark.parametrize("world", (2, 3))
def test_recomputation_only_when_training(world: int) -> None:
    m = 4
    expected = {"never": m, "except_last": 2 * m - 1, "always": 2 * m}
    for rank, res in enumerate(scenario(world, "calls")):
        for key, (calls, graph) in res.items():
            ckpt, mode, driver = key.split("/")
            want = expected[ckpt] if mode == "train" else m
            assert calls == want, (rank, key, calls, want)
            if mode != "train":
                assert not graph, (rank, key, "a graph was built")


@pytest.mark.parametrize("world", (2, 3))
def test_deferred_batch_norm_equals_full_batch(world: int) -> None:
    for rank, res in enumerate(scenario(world, "batchnorm")):
        assert res["deferred"] == 0.0 and res["tracked"] == 0.0, res
        assert res["stats"] <= 1e-4, (rank, res)
        assert res["moved"] > 1e-2, (rank, res)  # the statistics did move (a non-vacuous comparison)


@pytest.mark.parametrize("world", WORLDS)
def test_failures_reach_every_rank(world: int) -> None:
    res = scenario(world, "failures")
    for key in res[0]:
        where = int(next(r[key]["stage"] for r in res if r[key]["pipeline_error"]))
        for rank, per in enumerate(res):
            got = per[key]
            assert got["raised"] is not None, (key, rank, "did not raise")
            assert got["seconds"] < TIMEOUT_S, (key, rank, got)  # no rank waited for a timeout
            if rank == where:
                assert got["raised"] == "ValueError" and "boom" in got["text"], (key, rank, got)
            else:
                assert got["pipeline_error"] and got["stage"] == where, (key, rank, got)
                assert "boom" in got["text"] and f"stage {where}" in got["text"], (key, rank, got)
        # the pipe goes on: the next step fails in the same way (still armed), then one succeeds
        assert {r[key]["next_step"] for r in res} == {"ValueError", "PipelineError"}, key
        assert {r[key]["recovered"] for r in res} == {None}, key


@pytest.mark.parametrize("world", WORLDS)
def test_outputs_kept_across_steps_keep_their_values(world: int) -> None:
    final = scenario(world, "reused_buffers")[-1]
    assert len(final["errors"]) == 4 and max(final["errors"]) < 1e-12, final


def test_transport_wire_formats() -> None:
    res = scenario(2, "transport")[1]  # the receiving rank
    assert res["long_header"], res
    assert res["one_buffer"] == [True] * 6 and res["parts"] == [True] * 6, res
    assert res["directional"] == [True] * 6, res
    assert res["reuse"] == (True, True, True, True), res
    assert res["posted_ahead"] == [True] * (1 + 2 * 5 + 1 + 2 * 3), res


def test_receive_buffers_held_per_schedule() -> None:
    res = scenario(2, "receive_buffers")[1]  # the stage that receives activations
    # 8 micro-batches of 8 x 32 doubles (2 KiB each, plus a header): training holds all 8 buffers,
    # a forward-only pass at most the 1 it keeps in flight and the one being read
    assert res["train"] >= 8 * 8 * 32 * 8 and res["eval"] <= res["train"] / 3, res


def test_messages_larger_than_the_first_of_a_step() -> None:
    for stage, res in enumerate(scenario(2, "growing_messages")):
        assert len(res["errors"]) >= 4 and max(res["errors"]) < TOL[torch.float64], (stage, res)


def test_close_releases_the_pipe() -> None:
    for res in scenario(3, "closed"):
        assert res["refused"] is not None and "closed" in res["refused"], res
        assert res["grads_kept"] and res["group_usable"], res


@pytest.mark.parametrize("world", WORLDS)
def test_nothing_of_a_step_stays_alive(world: int) -> None:
    for stage, res in enumerate(scenario(world, "step_memory_freed")):
        for checkpoint, (seen, alive) in res.items():
            assert seen >= 16 and alive == 0, (stage, checkpoint, seen, alive)


@pytest.mark.parametrize("world", (3, 4))
def test_activation_memory_gpipe_vs_1f1b(world: int) -> None:
    for stage, res in enumerate(scenario(world, "memory")):
        one, m = res["one"], 8
        assert one > 0, res
        assert res["gpipe"][1] == 0 and res["1f1b"][1] == 0, res  # nothing left after the step
        assert res["gpipe"][0] >= m * one * 0.95, (stage, res)
        assert res["1f1b"][0] <= (world - stage) * one * 1.05, (stage, res)


@pytest.mark.parametrize("world", (2, 4))
def test_container_api_and_lazy_layers(world: int) -> None:
    for rank, res in enumerate(scenario(world, "container")):
        assert res["len"] == 2 and res["built"] == [2 * rank, 2 * rank + 1], res
        assert res["iter_is_layers"] == ["Linear", "Linear"] and res["neg_index_is_last"] and res["index0_is_first"]
        assert res["out_of_range"] and "2 layers" in res["out_of_range"], res


@pytest.mark.parametrize("world", (3, 4))
def test_idle_rank(world: int) -> None:
    for rank, res in enumerate(scenario(world, "idle_rank")):
        assert set(res) == set(DRIVERS)
        for driver, err in res.items():
            assert err <= 1e-10, (rank, driver, err)


def test_pipelines_side_by_side_with_data_parallel_groups() -> None:
    for rank, res in enumerate(scenario(4, "hybrid")):
        assert set(res) == set(DRIVERS)
        for driver, err in res.items():
            assert err <= 1e-10, (rank, driver, err)


@pytest.mark.parametrize("world", (2, 3))
def test_bad_input_raises_on_every_rank(world: int) -> None:
    res = scenario(world, "bad_input")
    for rank, per in enumerate(res):
        got = per["chunks_differ"]
        # (SettingsMismatchError: the ValueError of decentpy.comm.agreement for a setting that differs)
        assert got["raised"] == "SettingsMismatchError" and "chunks" in got["text"], (rank, got)
        for key, got in per.items():
            if "/" not in key:
                continue
            if rank == 0:
                assert got["raised"] in ("TypeError", "ValueError") and "input" in got["text"], (rank, key, got)
            else:
                assert got["pipeline_error"] and got["stage"] == 0, (rank, key, got)
        assert per["usable_after"] <= 1e-12, per["usable_after"]
        got = per["inplace"]
        if rank == 1:
            assert got["raised"] == "RuntimeError" and "in place" in got["text"], got
        else:
            assert got["pipeline_error"] and got["stage"] == 1, (rank, got)
        got = per["loss_not_scalar"]
        if rank == world - 1:
            assert got["raised"] == "TypeError" and "scalar" in got["text"], got
        else:
            assert got["pipeline_error"], (rank, got)
        got = per["forward_twice"]
        assert got["raised"] is not None and got["seconds"] < TIMEOUT_S, (rank, got)
        assert "backward" in got["text"], got
        assert per["forward_twice_then"] is None, per  # the pipe goes on with the next step


@pytest.mark.parametrize("world", WORLDS)
def test_tuple_outputs_keep_their_structure(world: int) -> None:
    for rank, res in enumerate(scenario(world, "structure")):
        errs = {k: v for k, v in res.items() if not k.endswith("type")}
        assert len(errs) == 2 * len(DRIVERS) + (rank == world - 1), (rank, res)
        for key, err in errs.items():
            assert err <= 1e-10, (rank, key, err)
        if rank == world - 1:
            for key in ("forward/1/type", "forward/3/type", "eval/type"):
                assert res[key] == ("tuple", 1), (key, res[key])


@pytest.mark.parametrize("world", (2, 3))
def test_output_modified_in_place(world: int) -> None:
    for rank, res in enumerate(scenario(world, "inplace_output")):
        for chunks in (1, 3):
            for ckpt in ("never", "except_last"):
                key = f"{chunks}/{ckpt}"
                assert res[key] <= 1e-10, (rank, key, res[key])
                if rank == world - 1:
                    assert res[f"{key}/gathered"], (key, res)
                    # one micro-batch: the output is the last layer's own memory (no copy); several: their join
                    assert res[f"{key}/shares_memory"] == (chunks == 1), (key, res)


@pytest.mark.parametrize("world", (2, 3))
def test_gradients_of_gradients_refused(world: int) -> None:
    res = scenario(world, "grad_of_grad")
    last = world - 1
    for rank, per in enumerate(res):
        got = per["backward"]
        assert got["raised"] is not None and got["seconds"] < TIMEOUT_S, (rank, got)
        if rank == last:
            assert got["raised"] == "RuntimeError" and "create_graph=True" in got["text"], got
        else:
            assert got["pipeline_error"] and got["stage"] == last and "create_graph" in got["text"], (rank, got)
        assert per["backward_then"] is None, (rank, per)
        for driver in DRIVERS:
            got = per[f"forward/{driver}"]
            assert got["seconds"] < TIMEOUT_S and got["then"] is None, (rank, driver, got)
            if rank == last:
                assert got["raised"] == "RuntimeError" and "create_graph=True" in got["text"], got
                assert got["layer_calls"] == 0, got  # refused before this stage ran anything
            else:
                assert got["pipeline_error"] and got["stage"] == last, (rank, driver, got)


@pytest.mark.parametrize("world", (2, 3))
def test_stages_in_different_modes_do_not_wait(world: int) -> None:
    for rank, res in enumerate(scenario(world, "mixed_modes")):
        for driver, got in res.items():
            assert got["raised"] is None and got["then"] is None, (rank, driver, got)
            assert got["seconds"] < TIMEOUT_S, (rank, driver, got)
            if rank == 0:  # trained, but no gradient came back from the stages in eval mode
                assert got["grads"] and not any(got["grads"]), (driver, got)


# --- bad construction: local checks, no group needed beyond this process -------------------------------


@pytest.fixture(scope="module")
def one_rank() -> Any:
    with single_process_group("gloo"):
        yield


# the texts fairscale's tests match (pytest.raises(..., match=...)) come first in decentpy's messages
@pytest.mark.parametrize("module, balance, kw, error, words", [
    (nn.Linear(2, 2), [1], {}, TypeError, "module must be nn.Sequential to be partitioned"),
    ([nn.Linear(2, 2), 3], [2], {}, TypeError, "layer 1"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1], {}, ValueError,
     "module and sum of balance have different length (module: 2, sum of balance: 1)"),
    (nn.Sequential(), [1], {}, ValueError, "module and sum of balance have different length (module: 0, sum of balance: 1)"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [2, 0], {}, ValueError, "all balance numbers must be positive integer"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1, 1], {}, ValueError,
     "too few ranks to hold given partitions (ranks: 1, partitions: 2)"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [], {}, ValueError, "empty"),
    (nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1.5, 0.5], {}, TypeError, "ints"),
    (nn.Sequential(nn.Linear(2, 2)), [1], {"chunks": 0}, ValueError, "chunks must be a positive int"),
    (nn.Sequential(nn.Linear(2, 2)), [1], {"chunks": 2.0}, ValueError, "chunks must be a positive int"),
    (nn.Sequential(nn.Linear(2, 2)), [1], {"checkpoint": "sometimes"}, ValueError,
     "checkpoint is not one of 'always', 'except_last', or 'never'"),
    (nn.Sequential(nn.Linear(2, 2)), [1], {"schedule": "zigzag"}, ValueError, "'gpipe', '1f1b'"),
])
def test_bad_construction(one_rank: Any, module: Any, balance: list, kw: dict, error: type, words: str) -> None:
    from decentpy import AsyncPipe

    with pytest.raises(error, match=None) as info:
        AsyncPipe(module, balance, **kw)
    assert words in str(info.value), str(info.value)


def test_same_layer_in_two_stages_refused() -> None:
    from decentpy.pipeline.layers import check_no_shared_layers, layer_list

    shared = nn.Linear(2, 2)
    layers = layer_list(nn.Sequential(shared, nn.ReLU(), shared))
    with pytest.raises(ValueError, match="module with duplicate children is not supported") as info:
        check_no_shared_layers(layers, [2, 1])
    assert "same module as layer 0" in str(info.value)
    check_no_shared_layers(layers, [3])  # within one stage it is fine (shared parameters, one process)


class Surrogate(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_same_parameter_in_two_stages_refused() -> None:
    """Two modules holding one parameter (tied weights) in two stages would be trained apart."""
    from decentpy.pipeline.layers import check_no_shared_layers, layer_list

    conv = nn.Conv2d(3, 3, 1)
    layers = layer_list(nn.Sequential(Surrogate(conv), Surrogate(conv)))
    with pytest.raises(ValueError, match="module with duplicate parameters on distinct devices is not supported") as info:
        check_no_shared_layers(layers, [1, 1])
    assert "'module.weight' of layer 1" in str(info.value), str(info.value)
    check_no_shared_layers(layers, [2])


def test_message_format_in_one_buffer() -> None:
    """The wire format of csrc/pipeline/message.h, re-computed here from its description: int64
    header slots, the tensors after the header (padded to HEADER_SLOTS slots), each 16-byte
    aligned; received tensors are views of the buffer. An unsupported dtype is a TypeError, and a
    malformed buffer an exception -- never a crash or a view past the buffer's end."""
    from decentpy import _C
    from decentpy.pipeline.transport import DTYPES, HEADER_SLOTS, Kind

    tensors: List[Optional[Tensor]] = [torch.arange(6.0).reshape(2, 3), None, torch.ones(0, 4, dtype=torch.int32),
                                       torch.tensor([True, False, True])]
    rg = [True, False, False, False]
    f32, i32, b8 = DTYPES.index(torch.float32), DTYPES.index(torch.int32), DTYPES.index(torch.bool)
    header = [int(Kind.GRAD), 5, 9, 4, 24, 1,  # kind, micro-batch, count, tensors, header length, tuple
              1, f32, 1, 2, 2, 3,  0,  1, i32, 0, 2, 0, 4,  1, b8, 0, 1, 3]
    start = 8 * HEADER_SLOTS
    total = start + 32 + 0 + 16  # 24 bytes of floats padded to 32, the empty tensor, 3 bools padded to 16
    assert _C.pipe_message_bytes(tensors) == total
    buf = torch.full((total,), 0xAB, dtype=torch.uint8)
    _C.pipe_pack(buf, int(Kind.GRAD), 5, 9, tensors, rg, True)
    assert buf[:8 * len(header)].view(torch.int64).tolist() == header
    assert torch.equal(buf[start:start + 24].view(torch.float32), torch.arange(6.0))
    assert buf[start + 32:start + 35].tolist() == [1, 0, 1]
    kind, mb, count, is_tuple, out, out_rg = _C.pipe_unpack(buf)
    assert (kind, mb, count, is_tuple, out_rg) == (int(Kind.GRAD), 5, 9, True, rg)
    assert out[0] is not None and torch.equal(out[0], tensors[0]) and out[0].data_ptr() == buf.data_ptr() + start
    assert out[1] is None and out[2] is not None and out[2].shape == (0, 4) and out[2].dtype == torch.int32
    assert out[3] is not None and torch.equal(out[3], tensors[3])
    # the header alone (the NCCL wire's first message), and its decoding
    head = _C.pipe_header(int(Kind.GRAD), 5, 9, tensors, rg, True)
    assert head.dtype == torch.int64 and head.numel() == HEADER_SLOTS and head.tolist()[:24] == header
    assert _C.pipe_decode(header) == (int(Kind.GRAD), 5, 9, True, [(torch.float32, True, [2, 3]), None,
                                                                  (torch.int32, False, [0, 4]), (torch.bool, False, [3])])
    # refusals
    with pytest.raises(TypeError, match="torch.uint16 cannot cross a pipeline stage boundary; supported: torch.float32"):
        _C.pipe_message_bytes([torch.zeros(2, dtype=torch.uint16)])
    small = torch.zeros(total - 1, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="does not fit"):
        _C.pipe_pack(small, int(Kind.GRAD), 5, 9, tensors, rg, True)
    assert not small.any()  # nothing written
    for slot, value in [(4, 10 ** 6),      # a header longer than the buffer
                        (3, -1),           # a negative tensor count
                        (7, len(DTYPES)),  # an unknown dtype code
                        (10, 10 ** 9),     # a tensor past the buffer's end
                        (11, -3),          # a negative size
                        (10, 2 ** 62)]:    # a size whose bytes overflow int64
        bad = buf.clone()
        bad[:8 * len(header)].view(torch.int64)[slot] = value
        with pytest.raises(RuntimeError, match="malformed pipeline message"):
            _C.pipe_unpack(bad)


def test_schedules_order_and_memory() -> None:
    """The schedules every rank computes: each micro-batch's forward before its backward, every
    micro-batch once; 1F1B keeps at most S - s micro-batches alive on stage s, GPipe all."""
    from decentpy.pipeline.schedule import SCHEDULES, max_alive

    for stages in (1, 2, 3, 4):
        for m in (1, 2, 3, 7, 16):
            for stage in range(stages):
                for name, fn in SCHEDULES.items():
                    acts = fn(m, stages, stage)
                    fwd = [a.mb for a in acts if a.forward]
                    bwd = [a.mb for a in acts if not a.forward]
                    assert fwd == list(range(m)) and sorted(bwd) == list(range(m)), (name, acts)
                    assert all(acts.index(next(a for a in acts if a.forward and a.mb == j)) <
                               acts.index(next(a for a in acts if not a.forward and a.mb == j)) for j in range(m))
                    want = m if name == "gpipe" else min(m, stages - stage)
                    assert max_alive(acts) == want, (name, stages, m, stage, acts)


def test_microbatch_split_and_join() -> None:
    from decentpy.pipeline.microbatch import gather, scatter

    x = torch.arange(20.0).reshape(10, 2)
    idx = torch.arange(10)
    for chunks in (1, 3, 4, 10, 16):
        parts = scatter((x, idx), chunks)
        assert len(parts) == min(chunks, 10)
        sizes = [p[0].shape[0] for p in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        joined = gather(parts)
        assert torch.equal(joined[0], x) and torch.equal(joined[1], idx)


def example_worker(rank: int, world: int) -> Dict[str, Any]:
    return run_example_main("pipeline_digits.py", ["--epochs", "3"])


def test_example_trains() -> None:
    """examples/pipeline_digits.py's main() on 2 stages (2 spawned gloo workers, the example's
    own process group kept): the loss falls and the pipelined model classifies the held-out
    digits."""
    first, last = run_workers(example_worker, 2, timeout=240)
    assert first == {}, first  # stage 0 reports nothing
    losses, acc = last["losses"], last["accuracy"]
    assert len(losses) == 3 and losses[-1] < losses[0] * 0.5, losses
    assert acc > 0.8, acc

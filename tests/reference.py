"""A plain-PyTorch, float64, single-process re-computation of decentralized training.

All workers live in one process. Iteration k on worker i: gradient at the un-mixed parameters,
mix ``z_i = sum_j W(k)_ij x_j``, then the worker's own optimizer steps from z_i (docs/concepts/buckets.md, How a step runs).
Optimizers are torch's own (SGD/Adam/AdamW/RMSprop) or, for AccumAdam, a direct transcription
of the equations in docs/concepts/algorithm.md (Optimizers). Nothing here uses decentpy's kernels or wrapper.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn

IN, HIDDEN, OUT = 6, 16, 3
BATCH = 8


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 8), nn.Tanh(), nn.Linear(8, OUT))


def make_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 2 * 2, OUT))


def batch(rank: int, step: int, kind: str = "mlp") -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10007 * rank + 31 * step + 5)
    x = torch.randn(BATCH, IN, generator=g) if kind == "mlp" else torch.randn(BATCH, 2, 6, 6, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x, y


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(out, y)


def decay_groups(model: nn.Module, wd: float) -> List[dict]:
    """Weight decay on weights (dim > 1) only, as decentpy's optim_fn helpers do."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


class RefAccumAdam:
    """AccumAdam(W) transcribed from the equations of docs/concepts/algorithm.md, float64."""

    def __init__(self, groups: List[dict], lr: float, betas: Tuple[float, float], eps: float, accum_iter: int,
                 decoupled: bool) -> None:
        self.groups = groups
        self.lr, (self.b1, self.b2), self.eps, self.A, self.decoupled = lr, betas, eps, accum_iter, decoupled
        self.state: Dict[int, dict] = {}
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        t, A, b1, b2 = self.t, self.A, self.b1, self.b2
        k = math.ceil(t / A)
        for group in self.groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                st = self.state.setdefault(id(p), {"M": torch.zeros_like(p), "V": torch.zeros_like(p),
                                                   "acc": torch.zeros_like(p)})
                g = p.grad.clone()
                if self.decoupled:
                    p.mul_(1 - self.lr * wd)
                else:
                    g = g + wd * p
                st["acc"] += g / A
                mt = b1 * st["M"] + (1 - b1) * g
                vt = b2 * st["V"] + (1 - b2) * g * g
                p -= self.lr / (1 - b1 ** k) * mt / (vt.sqrt() / math.sqrt(1 - b2 ** k) + self.eps)
                if t % A == 0:
                    st["M"] = b1 * st["M"] + (1 - b1) * st["acc"]
                    st["V"] = b2 * st["V"] + (1 - b2) * st["acc"] ** 2
                    st["acc"].zero_()

    def zero_grad(self) -> None:
        for group in self.groups:
            for p in group["params"]:
                p.grad = None


# name -> (decentpy optim_fn factory(named_params), reference factory(model))
def _ref_factories() -> Dict[str, Callable[[nn.Module], object]]:
    return {
        "sgd": lambda m: torch.optim.SGD(decay_groups(m, 0.01), lr=0.05, momentum=0.9, nesterov=True),
        "adam": lambda m: torch.optim.Adam(decay_groups(m, 0.01), lr=0.01),
        "adamw": lambda m: torch.optim.AdamW(decay_groups(m, 0.1), lr=0.01),
        "accum_adam": lambda m: RefAccumAdam(decay_groups(m, 0.01), 0.01, (0.9, 0.999), 1e-8, 3, False),
        "accum_adamw": lambda m: RefAccumAdam(decay_groups(m, 0.1), 0.01, (0.9, 0.999), 1e-8, 3, True),
        "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
        "sgd_plain": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    }


REF_OPTIMIZERS = _ref_factories()


def decentpy_optim_fn(name: str) -> Callable:
    """The same optimizers through decentpy's optim_fn helpers (or torch, for the generic path)."""
    from decentpy import optim as O

    return {
        "sgd": lambda named: O.optim_fn_sgd(named, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
        "adam": lambda named: O.optim_fn_adam(named, lr=0.01, weight_decay=0.01),
        "adamw": lambda named: O.optim_fn_adamw(named, lr=0.01, weight_decay=0.1),
        "accum_adam": lambda named: O.optim_fn_accum_adam(named, lr=0.01, weight_decay=0.01, accum_iter=3),
        "accum_adamw": lambda named: O.optim_fn_accum_adamw(named, lr=0.01, weight_decay=0.1, accum_iter=3),
        "rmsprop": lambda named: torch.optim.RMSprop([p for _, p in named], lr=0.01),
        "sgd_plain": lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
        # torch's AdamW with the same groups as "adamw": fused for fp32, torch's own step for fp64
        "torch_adamw": lambda named: torch.optim.AdamW(O.split_decay_groups(named, 0.1), lr=0.01),
    }[name]


def simulate(n: int, mixing: Callable[[int], Tensor], opt_name: str, steps: int, kind: str = "mlp",
             grad_hook: Callable[[int, int, List[Tensor]], None] | None = None,
             micro_batches: int = 1,
             skip: Callable[[int, int], bool] | None = None,
             data_ranks: Sequence[Any] | None = None,
             after_step: Callable[[int, List[Any]], None] | None = None) -> List[Dict[str, Tensor]]:
    """Final float64 parameters of every worker after ``steps`` iterations.

    ``mixing(k)`` is W(k); ``micro_batches`` > 1 sums the gradients of that many batches per
    iteration (gradient accumulation); ``grad_hook(rank, k, grads)`` may edit gradients;
    ``skip(rank, k)`` true means that worker only mixes at step k (no optimizer step);
    ``data_ranks[i]`` is the rank whose batches worker i trains on (default: i), or the ranks (a
    list, or ``fn(k) -> list`` for iteration k) whose mean gradient it takes: a node of ranks that
    averages its gradients exactly (intra_node). ``after_step(k, opts)`` runs once every worker has
    stepped in iteration k (e.g. to edit the optimizers' states).
    """
    data_ranks = list(range(n)) if data_ranks is None else list(data_ranks)
    make = make_mlp if kind == "mlp" else make_cnn
    models = [make(0).double() for _ in range(n)]
    opts = [REF_OPTIMIZERS[opt_name](m) for m in models]
    for k in range(steps):
        for i, m in enumerate(models):
            for p in m.parameters():
                p.grad = None
            for mb in range(micro_batches):
                src = data_ranks[i](k) if callable(data_ranks[i]) else data_ranks[i]
                ranks = list(src) if isinstance(src, (list, tuple)) else [src]
                for r in ranks:
                    x, y = batch(r, k * micro_batches + mb, kind)
                    (loss_fn(m(x.double()), y.double()) / len(ranks)).backward()
            if grad_hook is not None:
                grad_hook(i, k, [p.grad for p in m.parameters()])
        W = mixing(k).double()
        with torch.no_grad():
            per_param = list(zip(*[list(m.parameters()) for m in models]))
            for tensors in per_param:
                stacked = torch.stack([t.detach().clone() for t in tensors])
                mixed = torch.einsum("ij,j...->i...", W, stacked)
                for t, z in zip(tensors, mixed):
                    t.copy_(z)
        for i, o in enumerate(opts):
            if skip is None or not skip(i, k):
                o.step()
        if after_step is not None:
            after_step(k, opts)
    return [{name: p.detach().clone() for name, p in m.named_parameters()} for m in models]


def assert_close_params(got: Sequence[Dict[str, Tensor]], want: Sequence[Dict[str, Tensor]], rtol: float,
                        atol: float, what: str) -> None:
    for r, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}: parameter names differ on rank {r}"
        for name in w:
            a, b = g[name].double(), w[name].double()
            if not torch.allclose(a, b, rtol=rtol, atol=atol):
                err = (a - b).abs().max().item()
                raise AssertionError(f"{what}: rank {r} parameter '{name}' differs from the reference by {err:.3g} "
                                     f"(rtol={rtol}, atol={atol})")


# --- the gradient factor of the fused kernels (csrc/kernels/update.h grad_factor), in float64 ---

F32_MAX = torch.finfo(torch.float32).max


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def grad_factor64(norm: float, scale: float, clip: float) -> Tuple[float, bool]:
    """(factor, skip) of the gradient-norm rule in float64: n = norm / scale; skip when n is not
    finite in float32 (the kernel's precision); factor = (1 / scale) * (clip / (n + 1e-6) if
    clip > 0 and n > clip else 1)."""
    norm, scale, clip = _f32(norm), _f32(scale), _f32(clip)
    n = norm / scale
    if not math.isfinite(n) or abs(n) > F32_MAX:
        return 0.0, True
    factor = 1.0 / scale
    if clip > 0 and n > clip:
        factor *= clip / (n + 1e-6)
    return factor, False


# name -> (grad_norm, scaler_scale or None, clip_norm): the update happens.
GRAD_NORM_CASES = {
    "unscale": (3000.0, 1024.0, 0.0),
    "unscale_clip": (3000.0, 1024.0, 0.5),            # n = 2.93 > clip: clipped
    "unscale_clip_inactive": (3000.0, 1024.0, 10.0),  # n < clip: unscaled only
    "odd_scale_clip": (123.456, 3.0, 1.0),
    "clip_no_scaler": (7.5, None, 2.0),
    "norm_only": (7.5, None, 0.0),                    # factor 1
}
# The unscaled norm is not finite: the update is skipped (mix, send and zero_grad still happen).
SKIP_NORM_CASES = {
    "inf_norm": (math.inf, 1024.0, 0.0),
    "nan_norm": (math.nan, 1024.0, 1.0),
    "inf_norm_no_scaler": (math.inf, None, 0.5),
    "overflow": (1e10, 1e-30, 0.0),                   # 1e10 / 1e-30 overflows float32
}

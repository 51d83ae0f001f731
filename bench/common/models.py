"""The models, data and optimizer that bench_train, bench_shard and bench_hybrid train: one
definition, so that their step times and memory compare across the benchmarks."""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

__all__ = ["LR", "MODELS", "MODEL_DESC", "adamw_fn", "make_batches", "make_model"]

MODELS = ("mlp", "cnn")
LR = 1e-4

MODEL_DESC = {
    "mlp": "MLP 3 x Linear(1024,1024)+ReLU, batch 64, input 1024, cross-entropy over 1024 classes",
    "cnn": "CNN conv3x3 3-32 (s1), 32-64 (s2), 64-64 (s2), each BN+ReLU, avgpool, Linear(64,10); "
           "channels_last, batch 32, input 3x32x32",
}


def make_model(name: str, seed: int) -> Any:  # -> nn.Module (torch is imported in the workers only)
    """The model ``name`` (one of MODELS), initialised from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024))
    if name == "cnn":
        m = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        return m.to(memory_format=torch.channels_last)
    raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")


def make_batches(name: str, seed: int, rank: int, count: int = 4) -> List[Tuple[Any, Any]]:
    """``count`` synthetic (input, label) batches for model ``name``: the rank's own data, fixed by
    ``seed``; the steps cycle through them."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(count):
        if name == "mlp":
            x = torch.randn(64, 1024, generator=g)
            y = torch.randint(0, 1024, (64,), generator=g)
        else:
            x = torch.randn(32, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (32,), generator=g)
        out.append((x, y))
    return out


def adamw_fn(named_params: Iterable[Tuple[str, Any]]) -> Any:
    """optim_fn of the decentralized wrappers: torch AdamW(lr=LR) (module level: picklable)."""
    import torch

    return torch.optim.AdamW([p for _, p in named_params], lr=LR)

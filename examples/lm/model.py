"""A decoder-only byte-level transformer written with ``torch.nn`` only.

GPT-2's layout: learned token and position embeddings, pre-norm blocks (LayerNorm, causal
self-attention through ``F.scaled_dot_product_attention(is_causal=True)``, LayerNorm, a GELU MLP
of 4x width), a final LayerNorm and an *untied* output head (its own 256 x d matrix: with 256
bytes of vocabulary tying would save little, and a parameter shared by two modules is one more
thing every data-parallel wrapper of the comparison would have to handle alike). No dropout: the
runs are far shorter than one pass over the corpus.

Presets (parameter counts in :data:`PRESETS`' docs; ``count_parameters`` prints them):

- ``small``: d_model 128, 5 layers, 4 heads, context 128, about 1.07M parameters: a step's
  compute outweighs its exchange even on a slow link.
- ``wide``: d_model 384, 5 layers, 6 heads, context 64, about 9.1M parameters: 36 MB of fp32
  parameters per exchange, so a throttled link dominates; the shorter context keeps a step
  affordable on 4 CPU workers sharing 2 cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["VOCAB", "ModelConfig", "PRESETS", "preset", "ByteTransformer", "count_parameters"]

VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of :class:`ByteTransformer` plus the batch its preset trains with."""

    d_model: int
    n_layers: int
    n_heads: int
    context: int
    global_batch: int  # sequences per step over all workers (the same for every arm)
    lr: float  # AdamW's peak learning rate
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "context", "global_batch", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


#: ``small``: 1,073,536 parameters; ``wide``: 9,094,272 parameters
PRESETS: Dict[str, ModelConfig] = {
    "small": ModelConfig(d_model=128, n_layers=5, n_heads=4, context=128, global_batch=32, lr=2e-3),
    "wide": ModelConfig(d_model=384, n_layers=5, n_heads=6, context=64, global_batch=16, lr=1e-3),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """The named preset, with fields replaced by ``overrides`` that are not None."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only (the mask is ``is_causal=True``)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(nn.Module):
    """Next-byte logits ``(batch, time, 256)`` for int64 bytes ``(batch, time)``, time <= context."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, the residual projections scaled by
        1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith("proj.weight") else 0.02
                p.normal_(0.0, std)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.cfg.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (distinct) parameters' elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def build(name: str, seed: Optional[int] = None, **overrides: object) -> ByteTransformer:
    """The preset's model; with ``seed``, initialized from ``torch.manual_seed(seed)``."""
    cfg = preset(name, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    return ByteTransformer(cfg)

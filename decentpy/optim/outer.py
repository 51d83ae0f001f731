"""The outer step of local-steps training (DiLoCo), one implementation for every face of it.

Both the engine's ``local_steps=`` exchange (:mod:`decentpy.engine.local_steps`, one flat bucket at a
time) and the torchft-shaped :class:`decentpy.DiLoCo` (:mod:`decentpy.local_sgd`, a fragment's
parameters) end a window of inner steps the same way: with the mixed pseudo-gradient ``delta`` and
the global copy ``theta`` (or the mixed one, for a gossip outer step), the outer optimizer steps the
global copy, which becomes the new ``theta``, and the local parameters restart from it (or merge
with it, Streaming DiLoCo's ``alpha``). :func:`outer_step` does that.

It runs the fused kernel pass (csrc/kernels/outer_step.h: the update, the new global copy and the
reset of the parameters in one pass over the bucket) when the outer optimizer is a torch ``SGD``,
``Adam`` or ``AdamW`` the kernel computes exactly (:func:`fused_outer_reason` says why not
otherwise), reading and writing the optimizer's own state, so ``state_dict`` / ``load_state_dict``
and a later generic step see what torch would have. Otherwise the optimizer's own ``step()`` runs
over ``.grad`` set to the pseudo-gradients, its other parameters' gradients stashed (torchft 0.2.0
steps a shared outer optimizer's other fragments with their inner gradients: 0.875 max abs
difference on its own test model, docs/migration/torchft.md). FSDP2's DTensor parameters take that
path too: the tensors here are this rank's local shards, the optimizer's ``.grad`` the shard laid out
as its DTensor (:mod:`decentpy.optim.shards`).

:func:`pseudo_gradient` is the pass before the exchange: ``theta - x``, or its compressed form with
error feedback (int8 / int4 / bf16: the wire formats of compressed gossip).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import kernels
from .fused import mark_stepped
from .kernels import KERNEL_DTYPES, OptKind, flat_alias
from .shards import is_dtensor, like_param, local_shard

__all__ = ["fused_outer_reason", "fusable_here", "outer_step", "pseudo_gradient"]

logger = logging.getLogger(__name__)

_FUSABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused_outer_reason(optimizer: Optimizer) -> Optional[str]:
    """Why ``optimizer``'s outer step cannot run as the fused kernel pass (None: it can, for float32
    global copies). Only exact equivalents run fused: torch's SGD / Adam / AdamW (the exact types)
    without the options the kernel does not implement."""
    if type(optimizer) not in _FUSABLE:
        return f"{type(optimizer).__name__} is not torch's SGD, Adam or AdamW"
    for g in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(key):
                return f"{type(optimizer).__name__}({key}=True)"
        if type(optimizer) is torch.optim.Adam and g.get("decoupled_weight_decay"):
            return "Adam(decoupled_weight_decay=True)"
        if isinstance(g.get("lr"), Tensor):
            return "a tensor learning rate"
    return None


def pseudo_gradient(param: Tensor, theta: Tensor, out: Tensor, compressor: Optional["kernels.Compressor"] = None,
                    excess: Optional[Tensor] = None) -> None:
    """``out = theta - param`` (flat buffers; ``theta`` float32), or with ``compressor`` its wire
    bytes ``Q(theta - param - excess)`` with ``excess`` (float32, the error feedback) updated to what
    the wire sends beyond the true value (csrc/kernels/outer_step.h). Without compression a float64
    ``out`` (float64 parameters: their precision kept) is computed with torch's ops."""
    if compressor is None and (out.dtype != torch.float32 or param.dtype not in KERNEL_DTYPES):
        torch.sub(theta.to(out.dtype), param.to(out.dtype), out=out)
        return
    kernels.outer_pack(param, theta, out, compressor, excess)


def _group_of(optimizer: Optimizer, t: Tensor) -> Optional[dict]:
    for g in optimizer.param_groups:
        if any(p is t for p in g["params"]):
            return g
    return None


def fusable_here(optimizer: Optimizer, stepped: Sequence[Tensor], params: Sequence[Tensor],
                  thetas: Sequence[Tensor], deltas: Sequence[Tensor]) -> Optional[str]:
    """Why these tensors cannot take the fused pass (None: they can)."""
    why = fused_outer_reason(optimizer)
    if why is not None:
        return why
    for s, p, th, d in zip(stepped, params, thetas, deltas):
        if is_dtensor(s):
            return "a DTensor parameter (FSDP2) steps through the optimizer's own step"
        if _group_of(optimizer, s) is None:
            return "a stepped tensor is not among the outer optimizer's parameters"
        if th.dtype != torch.float32 or not th.is_contiguous() or th.device != p.device or th.numel() != p.numel():
            return "the global copy is not a contiguous float32 tensor beside its parameter"
        if p.dtype not in KERNEL_DTYPES or not p.is_contiguous() or p.device.type not in ("cpu", "cuda"):
            return f"a parameter is {p.dtype} (or not contiguous)"
        if d.device != p.device or not d.is_contiguous():
            return "the pseudo-gradient is not a contiguous tensor beside its parameter"
        for key, st in optimizer.state.get(s, {}).items():
            if isinstance(st, Tensor) and key != "step" and (st.dtype != torch.float32 or not st.is_contiguous()):
                return f"its state {key!r} is {st.dtype}"
            if key == "step" and isinstance(st, Tensor) and st.device.type != "cpu":
                return "its step count lives on the device"
    return None


def _fused(optimizer: Optimizer, stepped: Sequence[Tensor], params: Sequence[Tensor], thetas: Sequence[Tensor],
           deltas: Sequence[Tensor], theta_mix: Optional[Sequence[Tensor]], compressor: Optional["kernels.Compressor"],
           alpha: float) -> None:
    adam = type(optimizer) is not torch.optim.SGD
    for i, (s, p, th, d) in enumerate(zip(stepped, params, thetas, deltas)):
        g = _group_of(optimizer, s)
        assert g is not None
        st = optimizer.state[s]
        if adam:
            b1, b2 = g["betas"]
            step = st.get("step")
            k = (int(step.item()) if isinstance(step, Tensor) else int(step or 0)) + 1  # a CPU scalar: no device sync
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in st:
                    st[key] = torch.zeros(s.shape, dtype=torch.float32, device=s.device)
            hyper = kernels.GroupHyper(lr=float(g["lr"]), weight_decay=float(g["weight_decay"]), beta1=float(b1),
                                       beta2=float(b2), eps=float(g["eps"]), bias_step=k)
            states = [flat_alias(st["exp_avg"]), flat_alias(st["exp_avg_sq"])]
            kind, decoupled, init = OptKind.ADAM, type(optimizer) is torch.optim.AdamW, False
        else:
            momentum = float(g["momentum"])
            init = False
            states = []
            if momentum != 0.0:
                buf = st.get("momentum_buffer")
                if buf is None:
                    buf = torch.empty(s.shape, dtype=torch.float32, device=s.device)
                    init = True  # torch's first step: the buffer is the gradient
                st["momentum_buffer"] = buf
                states = [flat_alias(buf)]
            hyper = kernels.GroupHyper(lr=float(g["lr"]), weight_decay=float(g["weight_decay"]), momentum=momentum,
                                       dampening=float(g["dampening"]), nesterov=int(bool(g["nesterov"])))
            kind, decoupled = OptKind.SGD, False
        kernels.outer_apply(flat_alias(p), flat_alias(th), d.reshape(-1), kind, hyper, states,
                            theta_mix=None if theta_mix is None else flat_alias(theta_mix[i]), compressor=compressor,
                            decoupled_weight_decay=decoupled, momentum_init=init, alpha=alpha)
        if adam:
            st["step"] = torch.tensor(float(k), dtype=torch.float32)
        if s is not p and s is not th:
            s.copy_(th.view_as(s))
    mark_stepped(optimizer)


def _generic(optimizer: Optimizer, stepped: Sequence[Tensor], params: Sequence[Tensor], thetas: Sequence[Tensor],
             deltas: Sequence[Tensor], theta_mix: Optional[Sequence[Tensor]], alpha: float) -> None:
    mine = {id(s) for s in stepped}
    stash: List[Tuple[Tensor, Optional[Tensor]]] = []
    for group in optimizer.param_groups:
        for q in group["params"]:
            if id(q) not in mine:
                stash.append((q, q.grad))
                q.grad = None
    # (the parameters before the step, for the merge: a stepped tensor, or a DTensor's local shard, is overwritten)
    sharded = any(map(is_dtensor, stepped))
    local = [p.detach().clone() if alpha > 0.0 and (sharded or any(p is s for s in stepped)) else None for p in params]
    try:
        for i, (s, th, d) in enumerate(zip(stepped, thetas, deltas)):
            start = theta_mix[i] if theta_mix is not None else th
            own = local_shard(s)  # (a DTensor's shard: the tensors here are this rank's shards)
            if start is not s:
                own.copy_(start.view_as(own))
            s.grad = like_param(d.view_as(own).to(s.dtype), s)
        optimizer.step()
    finally:
        for s in stepped:
            s.grad = None
        for q, gq in stash:
            q.grad = gq
    for s, p, th, x in zip(stepped, params, thetas, local):
        if s is not th:
            th.copy_(local_shard(s).view_as(th))
        if alpha == 0.0:
            if p is not s:
                p.copy_(th.view_as(p))
        else:
            base = x if x is not None else p.detach().clone()
            p.copy_(th.view_as(p))
            p.lerp_(base.to(p.dtype), alpha)


@torch.no_grad()
def outer_step(optimizer: Optimizer, params: Sequence[Tensor], thetas: Sequence[Tensor], deltas: Sequence[Tensor], *,
               stepped: Optional[Sequence[Tensor]] = None, theta_mix: Optional[Sequence[Tensor]] = None,
               compressor: Optional["kernels.Compressor"] = None, alpha: float = 0.0) -> bool:
    """The outer step of each tensor ``i`` (see the module): the outer optimizer steps
    ``theta_mix[i]`` (or ``thetas[i]``) with the pseudo-gradient ``deltas[i]``, ``thetas[i]`` takes the
    result and ``params[i]`` becomes ``theta + alpha (params[i] - theta)``.

    ``stepped[i]`` is the tensor the optimizer holds for ``i`` (default: ``params[i]``, as torchft's
    outer optimizer over the model's parameters; the engine's is over ``thetas``). ``deltas[i]`` is
    float32, or with ``compressor`` the wire bytes of the mixed pseudo-gradient (fused pass only).
    Returns whether the fused pass ran."""
    stepped = list(params) if stepped is None else list(stepped)
    if not (len(stepped) == len(params) == len(thetas) == len(deltas)) or (
            theta_mix is not None and len(theta_mix) != len(params)):
        raise ValueError(f"outer_step: {len(params)} parameters, {len(thetas)} global copies, {len(deltas)} "
                         f"pseudo-gradients, {len(stepped)} stepped tensors: one of each per parameter")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"outer_step: alpha must be in [0, 1], got {alpha!r}")
    why = fusable_here(optimizer, stepped, params, thetas, deltas)
    if why is None:
        _fused(optimizer, stepped, params, thetas, deltas, theta_mix, compressor, alpha)
        return True
    if compressor is not None:
        raise ValueError(f"a compressed outer exchange needs the fused outer step, and {why}; use torch's SGD, Adam "
                         "or AdamW as the outer optimizer with float32 global copies beside the parameters")
    logger.debug("outer step through %s.step(): %s", type(optimizer).__name__, why)
    _generic(optimizer, stepped, params, thetas, deltas, theta_mix, alpha)
    return False

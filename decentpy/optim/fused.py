"""Fused optimizers and the ``optim_fn`` helpers.

The optimizers are ordinary :class:`torch.optim.Optimizer` subclasses (so LR schedulers,
``state_dict`` and ``param_groups`` behave as users expect), whose update is one pass of the
compiled ``mix_and_step`` kernel. Used standalone, :meth:`step` updates each parameter in place.
Inside :class:`~decentpy.DecentralizedDataParallel` the wrapper calls :meth:`bucket_step`, which
mixes the bucket with the received parameters, steps, and writes the next send buffer in the
same pass over the bucket's flat buffers.

Optimizer state is kept in float32 whatever the parameter dtype (bf16/fp16 parameters get fp32
moments), and for a bucket it lives in one flat block per state name with per-parameter views,
so ``state_dict()`` still has the usual per-parameter entries.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from . import kernels
from .grad_scaling import GradArgs
from .hyperparams import check_hyperparameters
from .kernels import KERNEL_DTYPES, OptKind, flat_alias

logger = logging.getLogger(__name__)

__all__ = [
    "OptKind",
    "FusedOptimizer",
    "SGD",
    "Adam",
    "AdamW",
    "AccumAdam",
    "AccumAdamW",
    "fuse_torch_optimizer",
    "split_decay_groups",
    "optim_fn_sgd",
    "optim_fn_adam",
    "optim_fn_adamw",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "lr_scheduler_fn_cosine_with_warmup",
    "accum_adam_foreach",
    "accum_adamw_foreach",
]


#: parameter groups one bucket's kernel pass can mix: the kernel's limit, less the group of the
#: parameters without a gradient (see FusedOptimizer.bucket_step)
MAX_GROUPS_PER_BUCKET = kernels.MAX_GROUPS - 1


def _step_one_tensor(kind: OptKind, p: Tensor, grad: Tensor, states: Sequence[Tensor], hyper: "kernels.GroupHyper",
                     decoupled_weight_decay: bool, momentum_init: bool, accum_boundary: bool) -> None:
    """One kernel pass over one parameter (no mixing): the standalone form of the fused update."""
    if grad.is_sparse:
        raise RuntimeError(f"fused optimizers do not support sparse gradients (parameter of shape {tuple(p.shape)})")
    for st in states:
        if st.dtype != torch.float32 or st.shape != p.shape:
            raise ValueError(f"optimizer state must be float32 with the parameter's shape {tuple(p.shape)}; got "
                             f"{st.dtype} {tuple(st.shape)}")
    if grad.stride() != p.stride():
        grad = torch.empty_like(p).copy_(grad)  # same memory order as p
    kernels.fused_step(kind, flat_alias(p), flat_alias(grad), [flat_alias(st) for st in states],
                       kernels.segments_for_numel(p.numel(), p.device), [hyper],
                       decoupled_weight_decay=decoupled_weight_decay, momentum_init=momentum_init,
                       accum_boundary=accum_boundary)


def _adam_group(lr: float, weight_decay: float, betas: Tuple[float, float], eps: float, bias_step: int,
                accum_iter: int = 1) -> "kernels.GroupHyper":
    """The kernel's hyper-parameters of an Adam/AdamW/AccumAdam(W) group at bias-correction step
    ``bias_step`` (the kernel derives the bias corrections from it)."""
    b1, b2 = betas
    return kernels.GroupHyper(lr=float(lr), weight_decay=float(weight_decay), beta1=float(b1), beta2=float(b2),
                              eps=float(eps), bias_step=int(bias_step), accum_iter=int(accum_iter))


def mark_stepped(optimizer: Optimizer) -> None:
    """Tell LR schedulers that ``optimizer`` has stepped: torch's ``LRScheduler`` sets this flag from
    its wrapper of ``optimizer.step()`` and warns at its first step when the flag is missing. Bucket
    steps bypass ``step()`` (the fused pass, or a shard's own optimizer), so they set it here."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


class CompressedPass(NamedTuple):
    """The compressed-gossip buffers of one bucket pass: fields of :data:`decentpy.optim.kernels.StepArgs` of
    the same names (see :func:`decentpy.optim.kernels.compressed_step`)."""

    compressor: Any
    q_recv: Optional[Tensor]
    peer_copy: Optional[Tensor]
    self_copy_mix: Optional[Tensor]
    choco_mix: float
    q_send: Optional[Tensor]
    self_copy_next: Optional[Tensor]


class FusedOptimizer(Optimizer):
    """Base class of the fused optimizers: one kernel pass per bucket (or per tensor standalone)."""

    kind: OptKind = OptKind.NONE
    decoupled_weight_decay: bool = False
    state_names: Tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: Dict[str, Any]) -> None:
        super().__init__(params, defaults)
        # every group's values (a group may override the defaults: fuse_torch_optimizer passes groups)
        check_hyperparameters(self, type(self).__name__)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dtype not in KERNEL_DTYPES:
                    raise ValueError(
                        f"{type(self).__name__} steps float32, bfloat16 and float16 parameters (fp32 math); got a "
                        f"{p.dtype} parameter of shape {tuple(p.shape)}. For {p.dtype}, use the torch optimizer "
                        "(e.g. torch.optim.AdamW), which decentpy steps after a separate mix")
        # Flat per-bucket state: name -> fp32 block, set up lazily by bucket_step.
        self._flat_state: Dict[str, Tensor] = {}
        self._flat_layout_key: Optional[Tuple[int, int]] = None
        self._shared_step: Optional[Tensor] = None

    # -- what subclasses provide -----------------------------------------------------------
    def _hyper(self, group: Dict[str, Any], step: int) -> "kernels.GroupHyper":
        raise NotImplementedError

    def _uses_state(self) -> Tuple[str, ...]:
        """State buffers the kernel needs now (SGD without momentum needs none)."""
        return self.state_names

    def _flags(self, step: int) -> Tuple[bool, bool]:
        """(momentum_init, accum_boundary) for the 1-based ``step``."""
        return False, False

    # -- shared machinery ------------------------------------------------------------------
    def _check_lr(self, group: Dict[str, Any]) -> float:
        lr = group["lr"]
        return float(lr.item() if isinstance(lr, Tensor) else lr)

    def _state_tensor(self, p: Tensor, name: str) -> Tensor:
        st = self.state[p]
        if name not in st:
            st[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return st[name]

    def _step_tensor(self, p: Tensor) -> Tensor:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.tensor(self._loaded_step(st), dtype=torch.float32)
        return st["step"]

    def _loaded_step(self, st: Dict[str, Any]) -> float:
        """Steps already taken by a parameter whose state has no step count: state buffers loaded
        from a torch optimizer (torch's SGD keeps only ``momentum_buffer``) mean at least one, so
        they are continued rather than re-initialised."""
        return 1.0 if any(isinstance(st.get(n), Tensor) for n in self.state_names) else 0.0

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Standalone update: one kernel call per parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                step_t = self._step_tensor(p)
                step_t += 1
                step = int(step_t.item())
                states = [self._state_tensor(p, n) for n in self._uses_state_for(group)]
                momentum_init, accum_boundary = self._flags(step)
                _step_one_tensor(self.kind, p, p.grad, states, self._hyper(group, step),
                                 self.decoupled_weight_decay, momentum_init, accum_boundary)
        mark_stepped(self)
        return loss

    def _uses_state_for(self, group: Dict[str, Any]) -> Tuple[str, ...]:
        return self._uses_state()

    # -- bucket path (used by DecentralizedDataParallel) -----------------------------------
    def _ensure_flat_state(self, params: Sequence[Tensor], offsets: Sequence[int], total: int,
                           device: torch.device) -> List[Tensor]:
        """Flat fp32 state blocks for a bucket, with per-parameter views put in ``self.state``.

        Existing per-parameter values (e.g. from ``load_state_dict``) are copied in, so a
        checkpoint restores the exact state.
        """
        names = self._uses_state()
        key = (id(params[0]), total)
        if self._flat_layout_key == key and all(n in self._flat_state for n in names):
            return [self._flat_state[n] for n in names]
        steps = [self.state[p]["step"] for p in params if "step" in self.state.get(p, {})]
        start = float(steps[0].item()) if steps else max(
            (self._loaded_step(self.state[p]) for p in params if p in self.state), default=0.0)
        self._shared_step = torch.tensor(start, dtype=torch.float32)
        for name in names:
            block = torch.zeros(total, dtype=torch.float32, device=device)
            for p, off in zip(params, offsets):
                view = block.as_strided(p.size(), p.stride(), off)
                old = self.state[p].get(name)
                if old is not None:
                    view.copy_(old)
                self.state[p][name] = view
            self._flat_state[name] = block
        for p in params:
            self.state[p]["step"] = self._shared_step
        self._flat_layout_key = key
        return [self._flat_state[n] for n in names]

    def state_block(self, name: str) -> Optional[Tensor]:
        """The flat fp32 block that holds state ``name`` of every parameter of the bucket (the
        per-parameter entries of ``self.state`` are views into it), or ``None`` before the bucket
        path set it up. Lets a caller communicate a state in one piece (OptimizerStateAveraging)."""
        return self._flat_state.get(name) if self._flat_layout_key is not None else None

    def prepare_bucket_state(self, params: Sequence[Tensor], offsets: Sequence[int], total: int,
                             device: torch.device) -> None:
        """Allocate the bucket's flat state blocks ahead of the first step (zeros, step 0)."""
        self._ensure_flat_state(params, offsets, total, device)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The kernels keep fp32 state whatever the parameter dtype (torch casts loaded state to it).
        for st in self.state.values():
            for k, v in list(st.items()):
                if k != "step" and isinstance(v, Tensor) and v.is_floating_point() and v.dtype != torch.float32:
                    st[k] = v.float()
        self._flat_layout_key = None  # re-link the loaded values into flat blocks on next use

    def group_hypers(self, step: int) -> List["kernels.GroupHyper"]:
        if len(self.param_groups) > MAX_GROUPS_PER_BUCKET:
            raise ValueError(
                f"a bucket may mix at most {MAX_GROUPS_PER_BUCKET} parameter groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        return [self._hyper(g, step) for g in self.param_groups]

    @torch.no_grad()
    def bucket_step(
        self,
        params: Sequence[Tensor],
        offsets: Sequence[int],
        param_block: Tensor,
        grad_block: Tensor,
        segments: Tensor,
        comm: Optional[Tensor],
        send: Optional[Tensor],
        mix_a: float,
        mix_b: float,
        send_scale: float,
        grads: "GradArgs",
        skip_update: bool,
        zero_grad: bool = False,
        compressed: Optional["CompressedPass"] = None,
        prev_skip: Optional[Tensor] = None,
        no_update_group: bool = False,
        mix_factor: Optional[Tensor] = None,
        mix_guard: float = 0.0,
        mix_guarded: Optional[Tensor] = None,
    ) -> None:
        """Mix, step and fill the send buffer for one bucket in one kernel pass.

        ``grads`` says how the kernel scales the gradients (a factor, or a gradient norm and the
        GradScaler's scale on the device, from which the kernel derives the factor and whether to
        skip). The step counter moves in :meth:`finish_bucket_step`, once the caller knows whether
        the update happened (on a GPU that is known only at the end of the iteration). With
        ``zero_grad`` the kernel also zeroes ``grad_block`` in the same pass, right after reading each
        gradient (and also when the update is skipped: the skipped gradients are discarded).
        ``prev_skip``: the previous update's outcome is still on the device (a one-element bool
        tensor there, true when it was skipped; see :meth:`defers_verdict`): this step counts it as
        taken, and the kernel takes the bias corrections of one step fewer when it was not.
        ``no_update_group``: ``segments`` names one group more than the optimizer has, whose
        elements (parameters without a gradient) are not updated. ``mix_factor``: the peer check's
        verdict on ``comm`` (a one-element float32 tensor the kernel reads: csrc/kernels/mix_and_step.h);
        ``mix_guard`` / ``mix_guarded``: its element guard (0: none) and the count of elements it kept.
        """
        states = self._ensure_flat_state(params, offsets, param_block.numel(), param_block.device)
        assert self._shared_step is not None
        step = int(self._shared_step.item()) + (0 if skip_update else 1)
        alt_bias: List[int] = []
        if prev_skip is not None and not skip_update:
            step += 1
            alt_bias = [int(h.bias_step) for h in self.group_hypers(step - 1)]
            if no_update_group:
                alt_bias.append(alt_bias[0])
        else:
            prev_skip = None
        momentum_init, accum_boundary = self._flags(step)
        hypers = self.group_hypers(max(step, 1))
        if no_update_group:
            frozen = self._hyper(self.param_groups[0], max(step, 1))
            frozen.no_update = True
            hypers.append(frozen)
        if compressed is not None:  # compressed gossip: comm / send are the compressed pass's own buffers
            assert prev_skip is None, "internal error: compressed gossip does not defer the skip verdict"
            exchange: Dict[str, Any] = compressed._asdict()  # its fields are StepArgs' of the same names
        else:
            exchange = dict(comm=comm, send=send, mix_a=mix_a, mix_b=mix_b, send_scale=send_scale)
            if mix_factor is not None:
                exchange["mix_factor"] = mix_factor
            if mix_guard > 0:
                exchange.update(mix_guard=float(mix_guard), mix_guarded=mix_guarded)
        kernels.step(kernels.StepArgs(
            kind=self.kind, param=param_block, grad=grad_block, states=states, segments=segments, groups=hypers,
            grad_scale=grads.factor, grad_norm=grads.norm, scaler_scale=grads.scale, clip_norm=grads.clip,
            decoupled_weight_decay=self.decoupled_weight_decay, momentum_init=momentum_init,
            accum_boundary=accum_boundary, skip_update=skip_update, zero_grad=zero_grad, prev_skip=prev_skip,
            alt_bias_steps=alt_bias, **exchange))

    def defers_verdict(self) -> bool:
        """Whether the next :meth:`bucket_step` can run before the host knows if the last one's
        update happened: both outcomes give the same flags (SGD's first step, an AccumAdam
        boundary) and differ at most in the bias corrections, which the kernel picks itself."""
        if self._shared_step is None:
            return False
        s = int(self._shared_step.item())  # a CPU tensor: no synchronisation
        return self._flags(s + 1) == self._flags(s + 2)

    def finish_bucket_step(self, updated: bool) -> None:
        """Count the step of the last :meth:`bucket_step` if its update happened."""
        if updated:
            assert self._shared_step is not None
            self._shared_step += 1
        mark_stepped(self)


class SGD(FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay (torch.optim.SGD semantics)."""

    kind = OptKind.SGD
    state_names = ("momentum_buffer",)

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))
        for i, g in enumerate(self.param_groups):  # (after the rules every group passed in __init__)
            if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
                raise ValueError(f"SGD, param group {i}: Nesterov momentum requires a momentum > 0 and zero "
                                 f"dampening, got momentum={g['momentum']!r}, dampening={g['dampening']!r}")

    def _uses_state(self) -> Tuple[str, ...]:
        return self.state_names if any(g["momentum"] != 0 for g in self.param_groups) else ()

    def _uses_state_for(self, group: Dict[str, Any]) -> Tuple[str, ...]:
        return self.state_names if group["momentum"] != 0 else ()

    def _flags(self, step: int) -> Tuple[bool, bool]:
        return step == 1, False

    def _hyper(self, group: Dict[str, Any], step: int) -> "kernels.GroupHyper":
        return kernels.GroupHyper(lr=self._check_lr(group), weight_decay=float(group["weight_decay"]),
                                  momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                                  nesterov=bool(group["nesterov"]))


class Adam(FusedOptimizer):
    """Adam (torch.optim.Adam semantics; coupled L2 weight decay)."""

    kind = OptKind.ADAM
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=_pair(betas), eps=eps, weight_decay=weight_decay))

    def _bias_step(self, group: Dict[str, Any], step: int) -> int:
        return step

    def _hyper(self, group: Dict[str, Any], step: int) -> "kernels.GroupHyper":
        return _adam_group(self._check_lr(group), group["weight_decay"], group["betas"], group["eps"],
                           self._bias_step(group, step), group.get("accum_iter", 1))


class AdamW(Adam):
    """AdamW (torch.optim.AdamW semantics; decoupled weight decay, default 1e-2)."""

    decoupled_weight_decay = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class AccumAdam(Adam):
    """Adam whose moments move once per ``accum_iter`` steps, from the averaged gradient.

    Tames the variance of small local batches in decentralized training (README, Optimizers). Step t
    uses bias corrections of block k = ceil(t / accum_iter).
    """

    kind = OptKind.ACCUM_ADAM
    state_names = ("exp_avg", "exp_avg_sq", "accum_grad")

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, accum_iter: int = 4) -> None:
        FusedOptimizer.__init__(self, params, dict(lr=lr, betas=_pair(betas), eps=eps,
                                                   weight_decay=weight_decay,
                                                   accum_iter=int(accum_iter) if isinstance(accum_iter, float)
                                                   and accum_iter.is_integer() else accum_iter))
        if len({int(g["accum_iter"]) for g in self.param_groups}) != 1:
            raise ValueError("all parameter groups of one AccumAdam must share accum_iter")

    def _accum_iter(self) -> int:
        return int(self.param_groups[0]["accum_iter"])

    def _bias_step(self, group: Dict[str, Any], step: int) -> int:
        return -(-step // int(group["accum_iter"]))

    def _flags(self, step: int) -> Tuple[bool, bool]:
        return False, step % self._accum_iter() == 0


class AccumAdamW(AccumAdam):
    """AccumAdam with decoupled weight decay.

    ``weight_decay`` defaults to 0, as decent-dp's ``AccumAdamW`` (not torch AdamW's 1e-2), so a
    script relying on the default trains the same.
    """

    decoupled_weight_decay = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, accum_iter: int = 4) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, accum_iter=accum_iter)


def _pair(betas: Any) -> Any:
    """``betas`` as a tuple when it is a sequence (the hyper-parameter check names anything else)."""
    return tuple(betas) if isinstance(betas, (tuple, list)) else betas


# -- converting torch's own optimizers ---------------------------------------------------------

_GROUP_KEYS = {
    torch.optim.SGD: (SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov")),
    torch.optim.Adam: (Adam, ("lr", "betas", "eps", "weight_decay")),
    torch.optim.AdamW: (AdamW, ("lr", "betas", "eps", "weight_decay")),
}


def fuse_torch_optimizer(opt: Optimizer) -> Optimizer:
    """Return a fused equivalent of a fresh torch SGD/Adam/AdamW, or ``opt`` itself.

    Only exact equivalents are converted: options the kernel does not implement (amsgrad,
    maximize, capturable, differentiable, an optimizer that already has state, Adam with
    ``decoupled_weight_decay``, an instance given a ``pre_average_hook``) keep the optimizer as it
    is, stepped by the generic path.
    """
    entry = _GROUP_KEYS.get(type(opt))  # exact type: subclasses may change the maths
    if entry is None or len(opt.state) > 0 or hasattr(opt, "pre_average_hook"):
        return opt
    if any(p.dtype not in KERNEL_DTYPES for g in opt.param_groups for p in g["params"]):
        return opt  # e.g. float64: torch's own step keeps full precision
    cls, keys = entry
    for g in opt.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("capturable") or g.get("differentiable"):
            return opt
        if type(opt) is torch.optim.Adam and g.get("decoupled_weight_decay"):
            return opt
        if isinstance(g.get("lr"), Tensor):
            return opt
    groups = [dict({k: g[k] for k in keys}, params=list(g["params"])) for g in opt.param_groups]
    fused = cls(groups)  # type: ignore[arg-type]
    logger.debug("using fused %s for %s", cls.__name__, type(opt).__name__)
    return fused


# -- optim_fn helpers ---------------------------------------------------------------------------

def split_decay_groups(named_params: Sequence[Tuple[str, Tensor]], weight_decay: float) -> List[Dict[str, Any]]:
    """Weight decay on weights (matrices, conv kernels) only; none on biases and norm parameters.

    A parameter with one dimension (bias, norm scale/shift) gets no decay; so does any whose name
    says it is a bias or belongs to a norm layer. (The reference helpers invert this.)
    """
    decay, no_decay = [], []
    for name, p in named_params:
        parts = name.lower().split(".")
        owner = parts[-2] if len(parts) > 1 else ""
        if p.dim() <= 1 or parts[-1] == "bias" or any(h in owner for h in ("bn", "norm", "ln")):
            no_decay.append(p)
        else:
            decay.append(p)
    groups: List[Dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optim_fn_sgd(params: List[Tuple[str, Tensor]], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 1e-4, nesterov: bool = False, dampening: float = 0.0) -> Optimizer:
    """Fused SGD with weight decay on weights only."""
    return SGD(split_decay_groups(params, weight_decay), lr=lr, momentum=momentum, dampening=dampening,
               nesterov=nesterov)


def optim_fn_adam(params: List[Tuple[str, Tensor]], lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                  weight_decay: float = 1.0 / 32768, eps: float = 1e-8) -> Optimizer:
    """Fused Adam with weight decay on weights only (same signature as decent-dp's helper)."""
    return Adam(split_decay_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_adamw(params: List[Tuple[str, Tensor]], lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                   weight_decay: float = 0.1, eps: float = 1e-8) -> Optimizer:
    """Fused AdamW with weight decay on weights only."""
    return AdamW(split_decay_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_accum_adam(params: List[Tuple[str, Tensor]], lr: float = 1e-3, beta1: float = 0.9,
                        beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1.0 / 32768,
                        accum_iter: int = 4) -> Optimizer:
    """Fused AccumAdam with weight decay on weights only."""
    return AccumAdam(split_decay_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps,
                     accum_iter=accum_iter)


def optim_fn_accum_adamw(params: List[Tuple[str, Tensor]], lr: float = 1e-3, beta1: float = 0.9,
                         beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.1,
                         accum_iter: int = 4) -> Optimizer:
    """Fused AccumAdamW with weight decay on weights only."""
    return AccumAdamW(split_decay_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps,
                      accum_iter=accum_iter)


def lr_scheduler_fn_cosine_with_warmup(optimizer: Optimizer, t_max: int, t_warmup: int,
                                       cosine_eta_min: float = 1e-6, warmup_decay: float = 0.01) -> LRScheduler:
    """Linear warm-up for ``t_warmup`` steps, then cosine annealing over the next ``t_max`` steps (the
    minimum is reached at step ``t_warmup + t_max``: for a run of ``n`` steps give ``t_max = n - t_warmup``)."""
    main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max, eta_min=cosine_eta_min)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_decay, total_iters=t_warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warm, main], milestones=[t_warmup])


# -- decent-dp's functional forms ----------------------------------------------------------------

def _accum_adam_foreach(decoupled: bool, params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                        exp_avg_sqs: List[Tensor], accum_grads: List[Tensor], state_steps: List[Tensor],
                        beta1: float, beta2: float, lr: float | Tensor, weight_decay: float, eps: float,
                        accum_iter: int) -> None:
    if not params:
        return
    lengths = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs), len(accum_grads), len(state_steps)}
    if len(lengths) != 1:
        raise ValueError(f"params, grads and the state lists must have the same length, got lengths {sorted(lengths)}")
    torch._foreach_add_(state_steps, 1)
    step = int(state_steps[0].item())  # the reference reads the shared step once, too
    lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
    row = _adam_group(lr, weight_decay, (beta1, beta2), eps, -(-step // int(accum_iter)), int(accum_iter))
    for p, g, m, v, acc in zip(params, grads, exp_avgs, exp_avg_sqs, accum_grads):
        _step_one_tensor(OptKind.ACCUM_ADAM, p, g, [m, v, acc], row, decoupled, False, step % int(accum_iter) == 0)


@torch.no_grad()
def accum_adam_foreach(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                       exp_avg_sqs: List[Tensor], accum_grads: List[Tensor], state_steps: List[Tensor],
                       beta1: float, beta2: float, lr: float | Tensor, weight_decay: float, eps: float,
                       accum_iter: int) -> None:
    """decent-dp's functional AccumAdam step (same arguments), one fused kernel pass per tensor.

    ``state_steps`` are incremented; states must be float32 (the kernel's state dtype).
    """
    _accum_adam_foreach(False, params, grads, exp_avgs, exp_avg_sqs, accum_grads, state_steps, beta1, beta2,
                        lr, weight_decay, eps, accum_iter)


@torch.no_grad()
def accum_adamw_foreach(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                        exp_avg_sqs: List[Tensor], accum_grads: List[Tensor], state_steps: List[Tensor],
                        beta1: float, beta2: float, lr: float | Tensor, weight_decay: float, eps: float,
                        accum_iter: int) -> None:
    """decent-dp's functional AccumAdamW step (decoupled weight decay), as :func:`accum_adam_foreach`."""
    _accum_adam_foreach(True, params, grads, exp_avgs, exp_avg_sqs, accum_grads, state_steps, beta1, beta2,
                        lr, weight_decay, eps, accum_iter)

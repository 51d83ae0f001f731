"""PyTorch Lightning strategies: swap ``Trainer(strategy="ddp")`` for decentpy.

- :class:`DecentralizedStrategy`: gossip (or the wrapper's local steps) through
  :class:`decentpy.DecentralizedDataParallel`. The wrapper steps the optimizer inside the backward,
  bucket by bucket, so Lightning's optimizer step runs only its closure (the training step and the
  backward); the per-bucket optimizers are built from ``configure_optimizers``' optimizer (its class
  and parameter groups), and each step takes that optimizer's learning rate and weight decay, so
  Lightning's LR schedulers drive them.
- :class:`DiLoCoStrategy`: local steps with :class:`decentpy.DiLoCo` around Lightning's own optimizer
  (the inner one; it steps as usual), the outer optimizer from ``outer_optimizer``.

Checkpoints go through Lightning's hooks: the checkpoint file holds the replicas' *average* model (what
``validate`` / ``test`` / inference after loading it should see; every rank takes part in computing
it), and each rank writes its own training state beside it (``<file>.decentpy-rank<r>``: its model,
optimizer state and decentpy's exchange state); ``fit(ckpt_path=...)`` on the same world resumes every
rank from its own.

Launch as any Lightning multi-process job (its own launcher, or ``torchrun``).
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from ..comm import average_
from ..ddp import DecentralizedDataParallel
from ..local_sgd import DiLoCo

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl  # type: ignore[import-not-found]
    from lightning.pytorch.strategies import DDPStrategy  # type: ignore[import-not-found]
    from lightning.pytorch.trainer.states import TrainerFn  # type: ignore[import-not-found]
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.strategies import DDPStrategy  # type: ignore[no-redef]
        from pytorch_lightning.trainer.states import TrainerFn  # type: ignore[no-redef]
    except ImportError as exc:  # pragma: no cover - the optional dependency is missing
        raise ImportError("decentpy.integrations.lightning needs PyTorch Lightning: pip install pytorch-lightning "
                          "(or lightning); decentpy itself does not depend on it") from exc

__all__ = ["DecentralizedStrategy", "DiLoCoStrategy", "rank_state_path"]

#: the per-rank training state beside a checkpoint file
RANK_SUFFIX = ".decentpy-rank{rank}"

#: the hyper-parameters a step takes from configure_optimizers' optimizer (what LR schedulers change)
_FOLLOWED = ("lr", "weight_decay")


def rank_state_path(filepath: Any, rank: int) -> str:
    """Where rank ``rank`` keeps its training state beside the checkpoint ``filepath``."""
    return os.fspath(filepath) + RANK_SUFFIX.format(rank=rank)


class _BucketOptimizers:
    """``optim_fn`` for the wrapper built from a torch optimizer over the module: per bucket an
    optimizer of the same class with the same parameter groups (restricted to the bucket's
    parameters, matched by name), and the origin of each bucket group to follow its hyper-parameters."""

    def __init__(self, optimizer: Optimizer, module: nn.Module) -> None:
        self.optimizer = optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.origin_by_name = {n: group_of[id(p)] for n, p in module.named_parameters() if id(p) in group_of}
        missing = [n for n, p in module.named_parameters() if p.requires_grad and n not in self.origin_by_name]
        if missing:
            raise ValueError(f"configure_optimizers' {type(optimizer).__name__} does not hold the parameters "
                             f"{missing[:5]}: the wrapper steps every trainable parameter, give them all to it")
        self.origin_by_param: Dict[int, int] = {}

    def __call__(self, named: List[Tuple[str, Tensor]]) -> Optimizer:
        groups: Dict[int, List[Tensor]] = {}
        for name, p in named:
            groups.setdefault(self.origin_by_name[name], []).append(p)
            self.origin_by_param[id(p)] = self.origin_by_name[name]
        src = self.optimizer.param_groups
        built = [dict({k: v for k, v in src[i].items() if k != "params"}, params=ps) for i, ps in groups.items()]
        cls = type(self.optimizer)
        # (the groups carry every hyper-parameter; the constructor gets those of its defaults it names)
        accepted = inspect.signature(cls.__init__).parameters
        return cls(built, **{k: v for k, v in self.optimizer.defaults.items() if k in accepted})

    def follow(self, optimizers: Sequence[Optimizer]) -> None:
        """Each bucket group takes its origin group's current lr and weight decay (a scheduler's)."""
        src = self.optimizer.param_groups
        for opt in optimizers:
            for g in opt.param_groups:
                origin = self.origin_by_param.get(id(g["params"][0])) if g["params"] else None
                if origin is None:
                    continue
                for key in _FOLLOWED:
                    if key in g and key in src[origin]:
                        g[key] = src[origin][key]


def _averaged_state_dict(module: nn.Module) -> Dict[str, Any]:
    """The module's state dict averaged over the world (floating tensors; the rest as this rank's).
    A collective: every rank calls it (Lightning dumps a checkpoint on every rank)."""
    state = module.state_dict()
    floats = {k: v.detach().clone() for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()}
    average_(list(floats.values()), dist.get_world_size() if dist.is_initialized() else 1)
    return {**state, **floats}


class _RankCheckpoints:
    """What both strategies add to Lightning's checkpoints (see the module)."""

    _rank_state: Optional[Dict[str, Any]] = None

    def _own_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        module = self.lightning_module  # type: ignore[attr-defined]
        assert module is not None
        return _averaged_state_dict(module)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]  (rank 0: the file)
        io = self.checkpoint_io  # type: ignore[attr-defined]  (Lightning's: it makes the directory)
        io.save_checkpoint(self._own_state(), rank_state_path(filepath, dist.get_rank()))

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        self.checkpoint_io.remove_checkpoint(rank_state_path(filepath, dist.get_rank()))  # type: ignore[attr-defined]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        try:  # (tensors and plain containers only: what _own_state writes)
            self._rank_state = self.checkpoint_io.load_checkpoint(  # type: ignore[attr-defined]
                rank_state_path(checkpoint_path, dist.get_rank()), weights_only=True)
        except FileNotFoundError:
            self._rank_state = None
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        assert module is not None
        # this rank's own parameters when it saved them (a resume), else the average (the file's)
        state = self._rank_state["model"] if self._rank_state is not None else checkpoint["state_dict"]
        module.load_state_dict(state, strict=strict)


class DecentralizedStrategy(_RankCheckpoints, DDPStrategy):
    """Gossip through :class:`decentpy.DecentralizedDataParallel` (see the module).

    ``wrapper_kwargs`` go to the wrapper (``topology``, ``local_steps``, ``compression``,
    ``grad_clip_norm``, ``bucket_size_in_mb``, ...); the other keyword arguments to Lightning's
    ``DDPStrategy`` (``process_group_backend``, ``timeout``, ``start_method``, ...).
    Not supported: ``accumulate_grad_batches`` > 1 and ``Trainer(gradient_clip_val=)`` (give
    ``grad_clip_norm=``), more than one optimizer, manual optimization."""

    def __init__(self, topology: str = "ring", *, wrapper_kwargs: Optional[Dict[str, Any]] = None,
                 **ddp_kwargs: Any) -> None:
        wrapper = dict(wrapper_kwargs or {})
        clip = ddp_kwargs.pop("grad_clip_norm", None)
        if clip is not None:
            wrapper["grad_clip_norm"] = clip
        super().__init__(**ddp_kwargs)
        self.topology = topology
        self.wrapper_kwargs = wrapper
        self._builder: Optional[_BucketOptimizers] = None
        self.wrapper: Optional[DecentralizedDataParallel] = None

    def setup(self, trainer: "pl.Trainer") -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)  # (no wrapper outside fit: nothing steps)
            return
        assert self.accelerator is not None and self.model is not None
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"DecentralizedStrategy steps inside every backward: accumulate_grad_batches="
                             f"{trainer.accumulate_grad_batches} is not supported (use a larger batch)")
        if trainer.gradient_clip_val:
            raise ValueError(f"DecentralizedStrategy steps inside the backward, before Lightning would clip: give "
                             f"DecentralizedStrategy(grad_clip_norm={trainer.gradient_clip_val}) instead of "
                             "Trainer(gradient_clip_val=...)")
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)  # configure_optimizers, over the plain module
        if len(self.optimizers) != 1:
            raise ValueError(f"DecentralizedStrategy steps one optimizer inside the backward; configure_optimizers "
                             f"returned {len(self.optimizers)}")
        if not self.lightning_module.automatic_optimization:
            raise ValueError("DecentralizedStrategy steps the optimizer inside the backward: manual optimization "
                             "(automatic_optimization = False) is not supported")
        self._builder = _BucketOptimizers(self.optimizers[0], self.model)
        self.wrapper = DecentralizedDataParallel(self.model, self._builder, topology=self.topology,
                                                 **self.wrapper_kwargs)
        self.model = self.wrapper
        self.setup_precision_plugin()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[nn.Module] = None, **kwargs: Any) -> Any:
        """The closure only (the training step and its backward, inside which the wrapper steps),
        with the current lr and weight decay of ``configure_optimizers``' optimizer."""
        assert self.wrapper is not None and self._builder is not None
        self._builder.follow(self.wrapper.optimizers)
        return closure()

    def _own_state(self) -> Dict[str, Any]:
        if self.wrapper is None:
            return {"model": self.lightning_module.state_dict()}
        return {"model": self.lightning_module.state_dict(), "wrapper": self.wrapper.training_state_dict()}

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.wrapper is not None:
            if self._rank_state is None or "wrapper" not in self._rank_state:
                raise FileNotFoundError(f"rank {dist.get_rank()}: no training state of its own beside the checkpoint "
                                        f"({RANK_SUFFIX.format(rank=dist.get_rank())}); a gossip run resumes each "
                                        "rank from its own (saved by DecentralizedStrategy on the same world)")
            self.wrapper.load_training_state_dict(self._rank_state["wrapper"])

    def teardown(self) -> None:
        if self.wrapper is not None:
            self.wrapper.close()
            self.model = self.lightning_module
            self.wrapper = None
        super().teardown()


class DiLoCoStrategy(_RankCheckpoints, DDPStrategy):
    """Local steps with :class:`decentpy.DiLoCo` around Lightning's own optimizer (see the module).

    ``outer_optimizer``: builds the outer optimizer over the module's parameters (default DiLoCo's
    ``SGD(lr=0.7, momentum=0.9, nesterov=True)``); ``diloco_kwargs`` go to ``DiLoCo`` (``topology``,
    ``compression``, ``fragment_sync_delay``, ...); the other keyword arguments to ``DDPStrategy``.
    The module is not wrapped: each replica trains alone between outer steps."""

    def __init__(self, sync_every: int = 32, *,
                 outer_optimizer: Optional[Callable[[Any], Optimizer]] = None,
                 diloco_kwargs: Optional[Dict[str, Any]] = None, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self.sync_every = sync_every
        self.outer_factory = outer_optimizer or functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9,
                                                                  nesterov=True)
        self.diloco_kwargs = dict(diloco_kwargs or {})
        self.diloco: Optional[DiLoCo] = None

    def setup(self, trainer: "pl.Trainer") -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"DiLoCoStrategy wraps one inner optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")
        module = self.lightning_module
        self.diloco = DiLoCo(module, self.optimizers[0], self.outer_factory(module.parameters()),
                             sync_every=self.sync_every, **self.diloco_kwargs)
        self.diloco.__enter__()
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:  # (not wrapped: the replicas train alone between outer steps)
        return

    def _own_state(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model": self.lightning_module.state_dict()}
        if self.diloco is not None:
            out.update(inner=self.optimizers[0].state_dict(), diloco=self.diloco.state_dict())
        return out

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.diloco is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        if self._rank_state is None or "diloco" not in self._rank_state:
            raise FileNotFoundError(f"rank {dist.get_rank()}: no training state of its own beside the checkpoint "
                                    f"({RANK_SUFFIX.format(rank=dist.get_rank())}); DiLoCo resumes each rank "
                                    "from its own (saved by DiLoCoStrategy on the same world)")
        # (DiLoCo's construction broadcast the first replica's parameters: this rank's own come back)
        self.lightning_module.load_state_dict(self._rank_state["model"])
        self.optimizers[0].load_state_dict(self._rank_state["inner"])
        self.diloco.load_state_dict(self._rank_state["diloco"])

    def teardown(self) -> None:
        if self.diloco is not None:
            self.diloco.close()
            self.diloco = None
        super().teardown()

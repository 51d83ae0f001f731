"""Pipeline parallelism across processes: :class:`AsyncPipe` (fairscale's API) on plain
``torch.distributed`` point-to-point messages, GPipe and 1F1B schedules, checkpointing,
:class:`DeferredBatchNorm`, and :class:`ActivationMeter` (a stage's activation memory).
fairscale's :class:`LazyModule`, ``is_checkpointing()`` and ``is_recomputing()`` have their
equivalents here."""

from .async_pipe import CHECKPOINT_MODES, AsyncPipe, PipelineError
from .batchnorm import DeferredBatchNorm
from .checkpoint import is_checkpointing, is_recomputing
from .layers import LazyModule, TooFewRanksError
from .meter import ActivationMeter
from .schedule import SCHEDULES

__all__ = ["AsyncPipe", "PipelineError", "TooFewRanksError", "LazyModule", "DeferredBatchNorm", "ActivationMeter",
           "is_checkpointing", "is_recomputing", "CHECKPOINT_MODES", "SCHEDULES"]

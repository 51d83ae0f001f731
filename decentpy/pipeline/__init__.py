"""Pipeline parallelism across processes: :class:`AsyncPipe` (fairscale's API) on plain
``torch.distributed`` point-to-point messages, GPipe and 1F1B schedules, checkpointing,
:class:`DeferredBatchNorm`, and :class:`ActivationMeter` (a stage's activation memory)."""

from .async_pipe import CHECKPOINT_MODES, AsyncPipe, PipelineError
from .batchnorm import DeferredBatchNorm
from .meter import ActivationMeter
from .schedule import SCHEDULES

__all__ = ["AsyncPipe", "PipelineError", "DeferredBatchNorm", "ActivationMeter", "CHECKPOINT_MODES", "SCHEDULES"]

"""The optimizer and kernel layer: everything that touches a bucket's bytes in one pass.

- :mod:`decentpy.optim.kernels` -- the Python face of the compiled kernels (``StepArgs``, the
  fused mix-and-step pass, packing, the compressed exchange's group reduction);
- :mod:`decentpy.optim.fused` -- the fused optimizers (:class:`AdamW`, ...) and decent-dp's
  ``optim_fn_*`` helpers, re-exported here, so ``decentpy.optim`` is decent-dp's module path
  (``from decentpy.optim import optim_fn_adamw``) as well as this layer's package;
- :mod:`decentpy.optim.grad_scaling` -- the per-bucket gradient factor, GradScaler's unscale and
  the non-finite verdicts that the kernel pass reads;
- :mod:`decentpy.optim.compression` -- the compressors of compressed gossip and their wire sizes;
- :mod:`decentpy.optim.hyperparams` -- the one check of an optimizer's hyper-parameters
  (:class:`HyperparameterError`), for every face that steps one.

The layer sits below the engine and the communication patterns: it imports the extension and
torch only, never :mod:`decentpy.engine` or :mod:`decentpy.comm` (the rooms check in
``tests/test_engine_structure.py`` keeps it so).
"""

from .fused import *  # noqa: F401,F403
from .fused import __all__ as _fused_all
from .hyperparams import HyperparameterError, check_hyperparameters, check_param_group, hyperparameters_of  # noqa: F401

__all__ = list(_fused_all) + ["HyperparameterError", "check_hyperparameters", "check_param_group", "hyperparameters_of"]

"""Local-steps training's one home: what both of its faces use.

The wrapper's ``DecentralizedDataParallel(local_steps=...)`` (an exchange part of the engine,
:mod:`decentpy.engine.local_steps`) and the torchft-shaped :class:`decentpy.DiLoCo`
(:mod:`decentpy.local_sgd`) are adapters over this package; it never imports either of them.

- :mod:`.options`: :class:`LocalSteps`, the settings and every rule between them.
- :mod:`.clock`: :class:`WindowClock`, when each fragment's outer exchange starts and applies.
- :mod:`.exchange`: one outer exchange of a flat buffer (:class:`~.exchange.OuterBuffer`).
- :mod:`.sparse`: SparseLoCo's exchange (:class:`SparseOuter`).
"""

from .clock import WindowClock
from .options import KEYWORDS, LocalSteps, OuterOptimFn, diloco_outer_optim, resolve_local_steps
from .sparse import SparseOuter

__all__ = ["LocalSteps", "SparseOuter", "WindowClock", "OuterOptimFn", "diloco_outer_optim", "resolve_local_steps", "KEYWORDS"]

"""The settings of local-steps training and every rule between them, for both faces.

:class:`LocalSteps` is what ``DecentralizedDataParallel(local_steps=...)`` takes (an int ``H`` is
the short form) and what :class:`decentpy.DiLoCo` builds from torchft's keywords: the window (``H``
inner steps, or a time budget in seconds), the outer optimizer, and Streaming DiLoCo's fragments.
Its :meth:`LocalSteps.check` is the one place the rules live (the window is an int >= 1 *or* a
time budget; fragments divide the window; the delay is shorter than a fragment's period; the merge
weight is in [0, 1]; a time budget runs one fragment), so the two faces cannot disagree on them.
It checks lazily (on the consumer's call, inside its cross-rank agreement), so that a bad value
raises on every rank before any collective, not on the one rank that built it.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..arguments import is_int
from .sparse import SparseOuter

__all__ = ["LocalSteps", "OuterOptimFn", "diloco_outer_optim", "resolve_local_steps", "KEYWORDS"]

#: a bucket's flat float32 global copy (a one-tensor list) -> its outer optimizer
OuterOptimFn = Callable[[List[Tensor]], Optimizer]


def diloco_outer_optim(params: List[Tensor]) -> Optimizer:
    """DiLoCo's outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _heavy_ball(params: List[Tensor], lr: float, momentum: float) -> Optimizer:
    """NoLoCo's outer optimizer: SGD with heavy-ball momentum (its authors' ``m = beta m - lr g;
    phi += m``)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


@dataclass(frozen=True)
class LocalSteps:
    """Local-steps training: ``sync_every`` inner steps (or ``sync_every_s`` seconds) without
    communication, then an outer step over the topology.

    Args:
        sync_every: ``H``, inner steps per outer step of each fragment (an int >= 1).
        sync_every_s: a time budget instead of ``sync_every``: as many inner steps as fit, the
            pseudo-gradients weighted by the inner steps behind them (one fragment).
        outer_optim: a bucket's float32 global copy (a one-tensor list) -> its outer optimizer
            (default :func:`diloco_outer_optim`: Nesterov SGD, lr 0.7, momentum 0.9). The wrapper's
            face only: :class:`decentpy.DiLoCo` takes the optimizer instances themselves.
        fragments: Streaming DiLoCo: the model in this many fragments synchronised in turn, one every
            ``sync_every / fragments`` inner steps.
        fragment_sync_delay: inner steps that run while a fragment's exchange is in flight
            (``< sync_every / fragments``).
        fragment_update_alpha: after the outer step, the fragment's parameters move this fraction of
            the way back to the local ones of the delayed steps (in [0, 1]).
        outer_pull: NoLoCo's outer step (Kolehmainen et al. 2025) on a gossip topology: each replica
            steps its *own* global copy (not the group's mixed one) with the mixed pseudo-gradient
            plus ``outer_pull`` times (its global copy - the group's mean global copy), so the outer
            optimizer's momentum, not an average, pulls the replicas together. ``outer_pull = gamma /
            lr`` for the paper's ``gamma`` and the outer optimizer's ``lr``: 1.0 is the authors' code
            (:meth:`noloco`). None: the gossip outer step starts from the mixed copy. Exact-average
            topologies (every global copy equal) are unaffected.
        sparse: SparseLoCo's outer exchange (:class:`~decentpy.local_steps.sparse.SparseOuter`): the
            error-fed chunk-wise top-k of the pseudo-gradient in 2 bits, averaged over an
            exact-average topology (an all-gather of the messages); use an outer SGD without momentum
            (:meth:`sparseloco`). Not with ``compression``, a time budget or ``outer_pull``.
    """

    sync_every: Optional[int] = None
    sync_every_s: Optional[float] = None
    outer_optim: Optional[OuterOptimFn] = None
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    outer_pull: Optional[float] = None
    sparse: Optional[SparseOuter] = None

    @classmethod
    def noloco(cls, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.5,
               pull: float = 1.0) -> "LocalSteps":
        """NoLoCo's outer step as its authors run it (arXiv 2506.10911, code jkolehm/noloco: H = 50,
        heavy-ball momentum 0.5, lr 0.7, the pull's weight equal to the lr): use it with
        ``topology="random-pairs"`` (each replica averages with one random peer per outer step)."""
        return cls(sync_every=sync_every, outer_pull=pull,
                   outer_optim=functools.partial(_heavy_ball, lr=outer_lr, momentum=outer_momentum))

    @classmethod
    def sparseloco(cls, sync_every: int = 30, k: int = 64, chunk: int = 4096, decay: float = 0.95,
                   outer_lr: float = 1.0) -> "LocalSteps":
        """SparseLoCo (arXiv 2508.15706): the error-fed sparse exchange (:class:`SparseOuter`) and its
        outer step ``theta <- theta - outer_lr * mean``, an SGD without momentum (the error buffer
        replaces the outer momentum); on ``topology="complete"``."""
        return cls(sync_every=sync_every, sparse=SparseOuter(k=k, chunk=chunk, decay=decay),
                   outer_optim=functools.partial(_heavy_ball, lr=outer_lr, momentum=0.0))

    def check(self, steps_name: str = "sync_every") -> int:
        """Raise ``ValueError`` / ``TypeError`` naming the bad value (``steps_name``: what the caller
        calls ``H``, e.g. the wrapper's ``local_steps``); return a fragment's period in inner steps,
        ``sync_every // fragments`` (0 with a time budget)."""
        h, s = self.sync_every, self.sync_every_s
        if s is not None:
            if h is not None:
                raise ValueError(f"give {steps_name} (inner steps) or sync_every_s (seconds), not both: got "
                                 f"{steps_name}={h!r}, sync_every_s={s!r}")
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
                raise ValueError(f"sync_every_s must be a number of seconds > 0, got {s!r}")
        elif not is_int(h) or h < 1:  # type: ignore[operator]
            raise ValueError(f"{steps_name} must be an int >= 1 (inner steps per outer step), got {h!r}"
                             + (" (or give sync_every_s, a time budget in seconds)" if h is None else ""))
        if self.outer_optim is not None and not callable(self.outer_optim):
            raise TypeError(f"outer_optim must be callable ([a bucket's float32 global copy] -> Optimizer), got "
                            f"{type(self.outer_optim).__name__}")
        f, delay, alpha = self.fragments, self.fragment_sync_delay, self.fragment_update_alpha
        if not is_int(f) or f < 1:
            raise ValueError(f"fragments must be an int >= 1, got {f!r}")
        if s is not None:
            if f > 1 or delay:
                raise ValueError(f"sync_every_s (a time budget) runs one fragment without fragment_sync_delay; "
                                 f"streaming fragments take {steps_name} (inner steps)")
            period = 0
        else:
            assert h is not None
            if h < f or h % f:
                raise ValueError(f"{steps_name}={h} must be a multiple of the number of fragments "
                                 f"({f}): one fragment is synchronised every {steps_name} / fragments steps")
            period = h // f
            if not is_int(delay) or not 0 <= delay < period:
                raise ValueError(f"fragment_sync_delay must be an int in [0, {period}) ({steps_name} / fragments = "
                                 f"{period}: a fragment's exchange must complete before its next one), got {delay!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"fragment_update_alpha must be in [0, 1], got {alpha!r}")
        pull = self.outer_pull
        if pull is not None and (isinstance(pull, bool) or not isinstance(pull, (int, float))
                                 or not (math.isfinite(pull) and pull >= 0)):
            raise ValueError(f"outer_pull must be a number >= 0 (NoLoCo's gamma / the outer lr; 1.0 in its "
                             f"authors' code) or None, got {pull!r}")
        if self.sparse is not None:
            if not isinstance(self.sparse, SparseOuter):
                raise TypeError(f"sparse must be a decentpy.SparseOuter or None, got {type(self.sparse).__name__}")
            self.sparse.check()
            if s is not None or pull is not None:
                raise ValueError("sparse (SparseLoCo's outer exchange) takes neither sync_every_s (a time budget) nor "
                                 f"outer_pull; got sync_every_s={s!r}, outer_pull={pull!r}")
        return period

    def check_exchange(self, compression: Any, comm: str = "torch") -> None:
        """The rules between these settings and the outer exchange's compression and communicator
        (raise ``ValueError``): SparseLoCo's exchange is its own compression and runs point to point
        over torch.distributed (``comm`` 'torch' or 'auto'); it averages over an exact-average topology
        and is a sparse gossip outer step over any other."""
        if self.sparse is None:
            return
        if comm not in ("torch", "auto"):
            raise ValueError(f"sparse (SparseLoCo's outer exchange) sends its messages over torch.distributed: use "
                             f"comm='torch' or 'auto', got comm={comm!r}")
        if compression is not None:
            raise ValueError(f"sparse (SparseLoCo's outer exchange) is its own compression: give sparse= or "
                             f"compression={getattr(compression, 'kind', compression)!r}, not both")

    @property
    def period(self) -> int:
        """A fragment's period in inner steps (0 with a time budget); the settings must be valid."""
        return 0 if self.sync_every_s is not None else int(self.sync_every or 0) // self.fragments

    def outer_optimizer(self, params: List[Tensor]) -> Optimizer:
        """The outer optimizer over ``params`` (``outer_optim``'s, or DiLoCo's)."""
        return (self.outer_optim or diloco_outer_optim)(params)

    def checkpoint_fields(self) -> Dict[str, Any]:
        """What a checkpoint of the wrapper's local steps records of these settings (``local_steps``:
        ``H``, 1 under a time budget; the layout checkpoints have always had)."""
        return {"local_steps": self.sync_every if self.sync_every is not None else 1,
                "sync_every_s": None if self.sync_every_s is None else float(self.sync_every_s),
                "fragments": self.fragments, "fragment_sync_delay": self.fragment_sync_delay,
                "fragment_update_alpha": float(self.fragment_update_alpha),
                "outer_pull": None if self.outer_pull is None else float(self.outer_pull),
                "sparse": None if self.sparse is None else [self.sparse.k, self.sparse.chunk, float(self.sparse.decay)]}

    def check_checkpoint(self, state: Dict[str, Any]) -> None:
        """Raise ``ValueError`` naming both sides when ``state`` (a checkpoint's) was saved with other
        settings."""
        mine = self.checkpoint_fields()
        theirs = {k: state.get(k, d) for k, d in (("local_steps", None), ("sync_every_s", None), ("fragments", 1),
                                                  ("fragment_sync_delay", 0), ("fragment_update_alpha", 0.0),
                                                  ("outer_pull", None), ("sparse", None))}
        if theirs != mine:
            raise ValueError("the checkpoint was saved with " + ", ".join(f"{k}={v}" for k, v in theirs.items())
                             + "; this run has " + ", ".join(f"{k}={v}" for k, v in mine.items()))

    def settings(self, steps_name: str = "sync_every") -> Dict[str, Any]:
        """The fields by name (``sync_every`` as ``steps_name``): what every rank must agree on."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out[steps_name] = out.pop("sync_every")
        return out


#: the wrapper's keywords that are fields of :class:`LocalSteps` (its ``local_steps`` is ``sync_every``)
KEYWORDS: Tuple[str, ...] = ("outer_optim", "sync_every_s", "fragments", "fragment_sync_delay",
                             "fragment_update_alpha")  # (outer_pull, newer: in LocalSteps only)


def resolve_local_steps(local_steps: Union[int, LocalSteps], **keywords: Any) -> Optional[LocalSteps]:
    """The wrapper's ``local_steps=`` (an int ``H`` or a :class:`LocalSteps`) and its separate
    keywords (``outer_optim=``, ``sync_every_s=``, ``fragments=``, ...: the earlier spelling, still
    accepted) as one :class:`LocalSteps`, checked; None: gossip every step. An int 1 without any
    keyword is every-step gossip; ``outer_optim`` or ``sync_every_s`` alone turn local steps on."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        hints = [m for u in unknown for m in difflib.get_close_matches(u, KEYWORDS + ("local_steps",), 1)]
        raise TypeError(f"DecentralizedDataParallel() got an unexpected keyword argument "
                        f"{', '.join(map(repr, unknown))}" + (f" (did you mean {', '.join(map(repr, hints))}?)"
                                                               if hints else ""))
    defaults = {f.name: f.default for f in fields(LocalSteps)}
    # (True == 1: a bool is never taken for a default int, so fragments=True is named, not ignored)
    given = {k: v for k, v in keywords.items()
             if isinstance(v, bool) != isinstance(defaults[k], bool) or v != defaults[k]}
    if isinstance(local_steps, LocalSteps):
        if given:
            raise ValueError(f"local_steps={local_steps!r} and {', '.join(f'{k}={v!r}' for k, v in given.items())}: "
                             "give the local-steps settings in LocalSteps(...) or as keywords, not both")
        local_steps.check("local_steps")
        return local_steps
    if not is_int(local_steps):
        raise TypeError(f"local_steps must be an int >= 1 (inner steps per outer step) or a decentpy.LocalSteps, "
                        f"got {local_steps!r} ({type(local_steps).__name__})")
    if local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1 (inner steps per outer step) or a decentpy.LocalSteps, "
                         f"got {local_steps!r}")
    if local_steps == 1 and given.get("outer_optim") is None and given.get("sync_every_s") is None:
        if given:
            raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} streams the outer steps of "
                             "local steps: give local_steps=H (> 1) as well")
        return None
    opts = LocalSteps(sync_every=None if given.get("sync_every_s") is not None and local_steps == 1 else local_steps,
                      **given)
    opts.check("local_steps")
    return opts

"""Checks of what a training iteration's kernel passes read, before the first of them runs.

The hyper-parameters of the buckets' optimizers are host floats a scheduler or an edit of
``param_groups`` can change between iterations; one that is NaN or out of range would turn the
bucket's parameters NaN here and, through the next exchanges, on every peer. So before any bucket
steps, each is checked (:func:`decentpy.optim.hyperparams.check_hyperparameters`, a few comparisons per
parameter group); a bad one raises :class:`~decentpy.optim.HyperparameterError` on this rank, its
parameters untouched, and is posted on the job's error board (the peer monitor), so that the other
ranks, waiting for this rank's next exchange, raise a :class:`~decentpy.PeerReportedError` naming it
within a heartbeat instead of waiting for their timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Tuple

from torch.optim import Optimizer

from ..comm.failures import report_to_peers
from ..optim.hyperparams import HyperparameterError, check_hyperparameters

if TYPE_CHECKING:
    from .gossip import GossipStrategy

__all__ = ["check_step_hyperparameters", "check_before_step"]


def check_before_step(optimizers: Iterable[Tuple[Optimizer, str]], rank: int, step: int) -> None:
    """Each ``(optimizer, what it is)``'s hyper-parameters before a step; a bad one raises
    :class:`HyperparameterError` naming global ``rank``, ``step``, the optimizer, the group and the
    value, reported to the peers first."""
    try:
        for opt, where in optimizers:
            check_hyperparameters(opt, where)
    except HyperparameterError as exc:
        err = HyperparameterError(f"rank {rank}, step {step}: {exc}; nothing was stepped or sent with it",
                                  exc.where, exc.group, exc.name, exc.value)
        report_to_peers(err)
        raise err from None


def check_step_hyperparameters(strategy: "GossipStrategy") -> None:
    """Every bucket optimizer's hyper-parameters (see the module), before the iteration's first step."""
    check_before_step(((b.optimizer, f"bucket {b.index}'s optimizer ({type(b.optimizer).__name__})")
                       for b in strategy.buckets), strategy.group.to_global(strategy.rank), strategy.step)

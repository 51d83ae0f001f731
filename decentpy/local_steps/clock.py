"""The window and fragment clock of local steps: when an outer exchange starts and when it applies.

One owner for both faces (the engine's exchange part ticks it once per iteration, at its first
bucket's launch; :class:`decentpy.DiLoCo` once per inner optimizer step):

- a step count: a fragment's window is ``period = H / fragments`` inner steps; its exchange starts
  after inner step ``period - fragment_sync_delay`` of the window and applies after inner step
  ``period`` (before the next forward), the fragments in turn (outer step ``k`` is fragment
  ``k % fragments``). An exchange dropped without its outer step (an elastic re-formation) leaves
  the count running: the next one starts a period later, its pseudo-gradient carrying both windows.
- a time budget (``sync_every_s``): the exchange starts, and applies, after the first inner step
  that ends ``sync_every_s`` seconds or more after the window began (the start of training: DiLoCo's
  context, the engine's first forward; then each outer step); :attr:`WindowClock.inner_steps` (the
  steps behind it) weighs the pseudo-gradient.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from .options import LocalSteps

__all__ = ["WindowClock"]


class WindowClock:
    """Counts the inner steps of the current window and the outer steps completed (see the module)."""

    def __init__(self, options: LocalSteps, clock: Callable[[], float] = time.monotonic) -> None:
        self.period = options.period
        self.delay = options.fragment_sync_delay
        self.fragments = options.fragments
        self.budget_s = None if options.sync_every_s is None else float(options.sync_every_s)
        self._clock = clock
        #: inner steps since the last outer step was applied (this one's included once ticked)
        self.inner_steps = 0
        #: outer steps completed (the index of the topology's schedule for the next one)
        self.outer_steps = 0
        self._t0: Optional[float] = None

    @property
    def timed(self) -> bool:
        """A time budget (the pseudo-gradients weighted by :attr:`inner_steps`)."""
        return self.budget_s is not None

    def start(self, once: bool = False) -> None:
        """The time budget's window starts now (default: at the first :meth:`tick`); ``once``: unless
        it has started already (the engine calls this before every forward)."""
        if not (once and self._t0 is not None):
            self._t0 = self._clock()

    def tick(self) -> Optional[int]:
        """One inner step done: the fragment whose outer exchange starts now, or None."""
        self.inner_steps += 1
        if self.budget_s is not None:
            now = self._clock()
            if self._t0 is None:
                self._t0 = now
            return 0 if now - self._t0 >= self.budget_s else None
        if (self.inner_steps + self.delay) % self.period == 0:
            return self.outer_steps % self.fragments
        return None

    @property
    def apply_due(self) -> bool:
        """Whether the exchange started in this window applies after the current inner step (a step
        count: at the window's end; a time budget: at once)."""
        return self.budget_s is not None or self.inner_steps % self.period == 0

    @property
    def fragment(self) -> int:
        """The fragment of the next outer step."""
        return self.outer_steps % self.fragments

    def applied(self) -> None:
        """An outer step completed (or was dropped by the peer check: it counts as taken)."""
        self.outer_steps += 1
        self.inner_steps = 0
        self._t0 = self._clock() if self.budget_s is not None else None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, int]:
        return {"outer_steps": self.outer_steps, "inner_steps": self.inner_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The counts of a checkpoint (a time budget restarts its window with the resumed run)."""
        self.outer_steps = int(state["outer_steps"])
        self.inner_steps = int(state.get("inner_steps", 0))
        self._t0 = None

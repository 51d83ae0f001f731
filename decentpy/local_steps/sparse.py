"""SparseLoCo's outer exchange (Sarfi et al. 2025, arXiv 2508.15706): the settings, and the
all-gather of the members' sparse messages.

Each replica adds its pseudo-gradient to an error-feedback buffer decayed by ``decay`` (the buffer
replaces the outer momentum), sends the ``k`` largest entries of every chunk of ``chunk`` elements
in 2 bits, and keeps the rest for later outer steps; the group's mean of the decoded messages is the
outer step's pseudo-gradient (an outer SGD without momentum, lr ``alpha``: SparseLoCo's
``theta <- theta - alpha mean``). The arithmetic lives in csrc/kernels/sparse.h (CPU and CUDA);
what travels is an all-gather of equal-sized messages (no reduction of compressed values: the mean
is exact for what was sent).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from torch import Tensor

from ..arguments import is_int
from ..optim import kernels

__all__ = ["SparseOuter", "SparseGather"]

@dataclass(frozen=True)
class SparseOuter:
    """SparseLoCo's outer exchange for ``LocalSteps(sparse=...)`` / ``DiLoCo(sparse=...)``.

    Args:
        k: entries sent per chunk (a multiple of 4); ``k / chunk`` is the density (default 64 / 4096,
            1.56%: inside the paper's 1-3%).
        chunk: elements per chunk of the flat buffer (a power of two up to 4096; the paper's
            64 x 64 blocks hold 4096).
        decay: the error-feedback buffer's decay ``beta`` in ``e <- beta e + delta`` (default 0.95).

    Bytes per message of ``n`` elements: ``8 ceil(n / chunk)`` (two fp32 scales per chunk) + 1.75
    per sent element (a 12-bit offset in its chunk and a 2-bit code): 0.73% of the fp32 bytes at the
    default density.
    """

    k: int = 64
    chunk: int = 4096
    decay: float = 0.95

    def check(self) -> None:
        """Raise ``ValueError`` naming the bad value."""
        c, k, d = self.chunk, self.k, self.decay
        if not is_int(c) or not 4 <= c <= kernels.SPARSE_MAX_CHUNK or c & (c - 1):
            raise ValueError(f"SparseOuter: chunk must be a power of two in [4, {kernels.SPARSE_MAX_CHUNK}], got {c!r}")
        if not is_int(k) or not 4 <= k <= c or k % 4:
            raise ValueError(f"SparseOuter: k must be a multiple of 4 in [4, chunk={c}] (entries sent per chunk), "
                             f"got {k!r}")
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (math.isfinite(d) and 0.0 <= d <= 1.0):
            raise ValueError(f"SparseOuter: decay must be in [0, 1] (the error buffer's beta), got {d!r}")

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def wire_bytes(self, numel: int) -> int:
        """Bytes of one message of ``numel`` elements."""
        return kernels.sparse_wire_bytes(numel, self.chunk, self.k)


class SparseGather:
    """One outer exchange in flight: this rank's message to every other member of the group and
    theirs into one slot each (the communicator's ``send_recv``, the buffer's tag); :meth:`wait`
    then writes the members' mean (rank order, this rank's own at its place) into ``out``, the
    exchange's result (as a compressed group exchange's :meth:`wait` completes into its result bytes)."""

    def __init__(self, comm: Any, tag: int, ranks: Sequence[int], rank: int, settings: SparseOuter,
                 mine: Tensor, slots: Sequence[Tensor], out: Tensor, step: Optional[int]) -> None:
        self.settings, self.out = settings, out
        others = [r for r in ranks if r != rank]
        self.inputs: List[Tensor] = list(slots[:len(others)])
        self.inputs.insert(list(ranks).index(rank), mine)
        self.works: List[Any] = []
        for peer, slot in zip(others, slots):
            w = comm.send_recv(tag, peer, mine, slot)
            if hasattr(w, "step"):
                w.step = step
            self.works.append(w)

    def wait(self, timeout: datetime.timedelta) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait(timeout)
        kernels.sparse_mean(self.inputs, self.out, self.settings.chunk, self.settings.k)


"""How many bytes the autograd graph holds for backward: the activation memory of a stage.

CPU tensors have no allocator statistics, and RSS mixes activations with everything else; the
tensors autograd saves for backward are what a pipeline schedule decides to keep alive. Inside an
:class:`ActivationMeter`, every saved tensor is counted (once, by its own bytes) from the moment it is
saved until the graph that holds it is freed (after its backward, or when dropped), and the peak
is kept. Meant for benchmarks and tests: the hooks cost a Python call per saved tensor.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor

__all__ = ["ActivationMeter"]


class _Held:
    """One saved tensor as the graph holds it; releases its bytes from the meter when freed."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: Tensor, meter: "ActivationMeter", key: Any) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Context manager: ``live_bytes`` and ``peak_bytes`` of the tensors saved for backward by the
    autograd operations run inside it (each tensor's own bytes -- a micro-batch that is a slice of
    a batch counts its slice --, counted once however many ops save it, while any graph holds it).
    Parameters (and views of them) are not activations and are not counted."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: Dict[Any, list] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, t: Tensor) -> Any:
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter):  # a parameter (or a view of one), not an activation
            return t
        nbytes = t.numel() * t.element_size()
        key = (t.data_ptr(), nbytes, t.device)
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        # detached: holding ``t`` itself would tie it to its own grad_fn (a cycle through C++
        # that the garbage collector cannot see), and the graph would never be freed
        return _Held(t.detach(), self, key)

    @staticmethod
    def _unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: Any) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live_bytes -= entry[1]

    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

"""The argument rules the public faces share (the wrapper, DiLoCo / LocalSGD, the checkpointer),
each written once: a wrong type or value raises naming the argument, the value and what is valid,
instead of failing later (``int(inf)``, a comparison with a string) or running with a value that
silently means something else (``"False"`` is true).

The faces call these inside the local part of their construction, whose failure their first
collective reports on every rank (:func:`decentpy.comm.agree_across_ranks`).
"""

from __future__ import annotations

import datetime
import math
import numbers
from typing import Any, Optional

__all__ = ["is_int", "check_bool", "check_int", "check_real", "check_timedelta"]


def is_int(value: Any) -> bool:
    """An int, not a bool (``True == 1`` would pass for a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; TypeError naming ``name`` otherwise (a string like ``"False"``
    would be true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> Optional[int]:
    """``value`` as an int ``>= minimum`` (an integral number, not a bool); TypeError / ValueError
    naming ``name``, the value and the valid range otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}{' or None' if allow_none else ''}, got {value!r} "
                        f"({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_real(name: str, value: Any, minimum: float = -math.inf, strict: bool = False,
               maximum: float = math.inf, what: str = "") -> float:
    """``value`` as a finite float in ``[minimum, maximum]`` (``strict``: ``> minimum``); TypeError /
    ValueError naming ``name``, the value and the valid range (``what`` adds the meaning, e.g.
    ``"0 disables clipping"``)."""
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    valid = "a finite number" + ("" if minimum == -math.inf else f" {bound}") + \
        ("" if maximum == math.inf else f" and <= {maximum:g}") + (f" ({what})" if what else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {valid}, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < minimum or (strict and v == minimum) or v > maximum:
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    return v


def check_timedelta(name: str, value: Any, allow_none: bool = True,
                    none_means: str = "") -> Optional[datetime.timedelta]:
    """``value`` if it is a ``datetime.timedelta`` longer than zero (or None, when allowed);
    TypeError / ValueError naming ``name``, the value and what is valid otherwise (a zero or negative
    timeout would end every wait at once)."""
    valid = "a datetime.timedelta > 0" + (f" or None ({none_means})" if allow_none and none_means else
                                           " or None" if allow_none else "")
    if value is None and allow_none:
        return None
    if not isinstance(value, datetime.timedelta):
        raise TypeError(f"{name} must be {valid}, got {value!r} ({type(value).__name__})")
    if value <= datetime.timedelta(0):
        raise ValueError(f"{name} must be {valid}, got {value!r} ({value.total_seconds():g} s)")
    return value

"""Cross-rank agreement: every rank learns of a difference or a failure before any collective
that would hang on it (each helper is one collective over the group, the same answer everywhere).

What the ranks say to each other here is plain data (JSON, :mod:`.wire`), never serialised Python
objects: a message from a faulty or foreign process can only raise a named error."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .wire import all_gather_json

__all__ = ["first_difference_across_ranks", "raise_if_any_rank_failed", "check_on_every_rank", "everyone",
           "agree_across_ranks", "comparable", "SettingsMismatchError"]

#: ``explain(rank, mine_on_rank0, theirs)`` -> the error message for one setting (the default names
#: the setting and both values)
Explain = Callable[[int, Any, Any], str]


class SettingsMismatchError(ValueError):
    """A setting that must be the same on every rank differs (raised on every rank alike).

    ``rank``: the first group rank whose ``setting`` differs from the reference rank's
    (``reference_rank``, group rank 0 unless the caller chose another); ``differing``: every group
    rank with a differing setting, so that a caller (an elastic membership admitting joiners) can
    leave them out instead of failing."""

    def __init__(self, message: str, rank: int, setting: str, reference_rank: int = 0,
                 differing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.setting = setting
        self.reference_rank = reference_rank
        self.differing = tuple(differing) or (rank,)


def everyone(mine: Any, group: Optional[dist.ProcessGroup] = None, what: str = "an agreement") -> List[Any]:
    """Every rank's ``mine`` (plain data: numbers, strings, lists, dicts, None; tuples arrive as
    lists), by rank in ``group`` (a collective). Sent as JSON, never as Python objects."""
    return all_gather_json(mine, group, what)


def first_difference_across_ranks(mine: Sequence[Any],
                                  group: Optional[dist.ProcessGroup] = None) -> Optional[Tuple[int, int, Any, Any]]:
    """Compare every rank's ``mine`` with the first rank's (a collective over ``group``, default:
    the world).

    Returns the first ``(rank in group, position, first rank's item, that rank's item)`` that
    differs (an item is ``None`` past the end of a shorter list), or ``None``; the same answer on
    every rank, so all of them can raise the same error.
    """
    answers = everyone(list(mine), group)
    ref = answers[0]
    for r, other in enumerate(answers):
        if other == ref:
            continue
        for k in range(max(len(ref), len(other))):
            a = ref[k] if k < len(ref) else None
            b = other[k] if k < len(other) else None
            if a != b:
                return r, k, a, b
    return None


def comparable(value: Any) -> Any:
    """``value`` in a form that compares by value across ranks (tensors as lists, classes and
    callables by qualified name, NaN equal to itself), for :func:`agree_across_ranks`."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().tolist())
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, Mapping):
        return {str(k): comparable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, functools.partial):  # (its arguments are settings too: lr=0.7 here, 0.5 there)
        return ["partial", comparable(value.func), comparable(list(value.args)), comparable(value.keywords)]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


def agree_across_ranks(failure: Optional[BaseException], settings: Mapping[str, Any], what: str,
                       group: Optional[dist.ProcessGroup] = None,
                       explain: Optional[Mapping[str, Explain]] = None, reference: int = 0) -> None:
    """The one construction-time agreement of a wrapper: ONE collective over ``group`` (default:
    the world) that carries whether this rank's local set-up failed and every setting that must be
    the same on every rank (passed through :func:`comparable`).

    A failure anywhere raises on every rank first (the failing rank its own exception, the others a
    RuntimeError naming that rank and its message); then the first setting (in ``settings`` order)
    that differs from the ``reference`` group rank's (default 0) raises :class:`SettingsMismatchError`
    (a ValueError) on every rank, naming the setting, both values and the rank (``explain[name]``
    words it for settings that need more, such as the model's structure). Run before any other collective, so a rank with another setting
    never reaches an exchange its peers shape differently (gloo aborts, or everyone hangs).
    """
    mine_failure = None if failure is None else f"{type(failure).__name__}: {failure}"
    mine_settings = [[k, comparable(v)] for k, v in settings.items()] if failure is None else None
    answers = everyone([mine_failure, mine_settings], group, f"{what} (settings agreement)")
    if failure is not None:
        raise failure
    answers = [_well_formed(a, r, what) for r, a in enumerate(answers)]
    bad = [(r, m) for r, (m, _) in enumerate(answers) if m is not None]
    if bad:
        r, m = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {m}")
    if not 0 <= reference < len(answers):
        raise ValueError(f"{what}: reference rank {reference} is not in a group of {len(answers)}")
    ref = answers[reference][1] or []
    first: Optional[Tuple[int, str, str]] = None  # (rank, setting, message)
    differing: List[int] = []
    for r, (_, theirs) in enumerate(answers):
        theirs = theirs or []
        found = _first_mismatch(ref, theirs, r, what, reference, explain)
        if found is not None:
            differing.append(r)
            if first is None:
                first = (r, found[0], found[1])
    if first is not None:
        r, key, message = first
        raise SettingsMismatchError(message, r, key, reference, differing)


def _well_formed(answer: Any, rank: int, what: str) -> Tuple[Optional[str], Optional[List[Tuple[str, Any]]]]:
    """One rank's ``[failure, settings]`` as sent, checked for shape (a malformed one is named)."""
    from .wire import MalformedMessageError
    ok = (isinstance(answer, list) and len(answer) == 2 and (answer[0] is None or isinstance(answer[0], str))
          and (answer[1] is None or (isinstance(answer[1], list)
                                     and all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str)
                                             for kv in answer[1]))))
    if not ok:
        raise MalformedMessageError(f"{what}: rank {rank} sent a malformed settings message ({str(answer)[:120]!r})")
    return answer[0], [(k, v) for k, v in answer[1]] if answer[1] is not None else None


def _first_mismatch(ref: List[Tuple[str, Any]], theirs: List[Tuple[str, Any]], r: int, what: str, reference: int,
                    explain: Optional[Mapping[str, Explain]]) -> Optional[Tuple[str, str]]:
    """``(setting, message)`` of the first setting of rank ``r`` that differs from the reference's."""
    for (key, a), (key_b, b) in zip(ref, theirs):
        if key != key_b:  # another version of decentpy on that rank
            return key, (f"{what}: rank {reference} and rank {r} check different settings ({key!r} vs {key_b!r}); "
                         "run the same decentpy version on every rank")
        if a != b:
            if explain is not None and key in explain:
                return key, explain[key](r, a, b)
            return key, (f"{what}: {key} differs across ranks: {a!r} on rank {reference} but {b!r} on rank {r}; "
                         f"every rank must pass the same {key}")
    if len(ref) != len(theirs):
        return "settings", (f"{what}: rank {reference} checks {len(ref)} settings, rank {r} {len(theirs)}; run the "
                            "same decentpy version on every rank")
    return None


def raise_if_any_rank_failed(failure: Optional[BaseException], what: str,
                             group: Optional[dist.ProcessGroup] = None) -> None:
    """A collective over ``group`` (default: the world): if ``failure`` is set on any rank, raise on
    every rank (the failing rank its own exception, the others a RuntimeError naming that rank (in
    the group) and its message), so that no rank goes on to a collective its peers never join."""
    agree_across_ranks(failure, {}, what, group)


def check_on_every_rank(check: Callable[[], None], what: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Run the local ``check`` (raising on bad input), then :func:`raise_if_any_rank_failed`: a bad
    input on one rank raises on every rank, before any collective that would hang on it."""
    failure: Optional[BaseException] = None
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
        failure = exc
    raise_if_any_rank_failed(failure, what, group)

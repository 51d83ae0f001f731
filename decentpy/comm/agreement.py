"""Cross-rank agreement: every rank learns of a difference or a failure before any collective
that would hang on it (each helper is one collective over the group, the same answer everywhere)."""

from __future__ import annotations

import math
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["first_difference_across_ranks", "raise_if_any_rank_failed", "check_on_every_rank", "everyone",
           "agree_across_ranks", "comparable"]

#: ``explain(rank, mine_on_rank0, theirs)`` -> the error message for one setting (the default names
#: the setting and both values)
Explain = Callable[[int, Any, Any], str]


def everyone(mine: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's ``mine`` (any picklable value), by rank in ``group`` (a collective)."""
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out


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
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


def agree_across_ranks(failure: Optional[BaseException], settings: Mapping[str, Any], what: str,
                       group: Optional[dist.ProcessGroup] = None,
                       explain: Optional[Mapping[str, Explain]] = None) -> None:
    """The one construction-time agreement of a wrapper: ONE collective over ``group`` (default:
    the world) that carries whether this rank's local set-up failed and every setting that must be
    the same on every rank (passed through :func:`comparable`).

    A failure anywhere raises on every rank first (the failing rank its own exception, the others a
    RuntimeError naming that rank and its message); then the first setting (in ``settings`` order)
    that differs from group rank 0's raises ValueError on every rank, naming the
    setting, both values and the rank (``explain[name]`` words it for settings that need more, such
    as the model's structure). Run before any other collective, so a rank with another setting
    never reaches an exchange its peers shape differently (gloo aborts, or everyone hangs).
    """
    mine_failure = None if failure is None else f"{type(failure).__name__}: {failure}"
    mine_settings = [(k, comparable(v)) for k, v in settings.items()] if failure is None else None
    answers = everyone((mine_failure, mine_settings), group)
    if failure is not None:
        raise failure
    bad = [(r, m) for r, (m, _) in enumerate(answers) if m is not None]
    if bad:
        r, m = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {m}")
    ref = answers[0][1] or []
    for r, (_, theirs) in enumerate(answers):
        theirs = theirs or []
        for (key, a), (key_b, b) in zip(ref, theirs):
            if key != key_b:  # another version of decentpy on that rank
                raise ValueError(f"{what}: rank 0 and rank {r} check different settings ({key!r} vs "
                                            f"{key_b!r}); run the same decentpy version on every rank")
            if a != b:
                if explain is not None and key in explain:
                    raise ValueError(explain[key](r, a, b))
                raise ValueError(
                    f"{what}: {key} differs across ranks: {a!r} on rank 0 but {b!r} on rank {r}; every rank must "
                    f"pass the same {key}")
        if len(ref) != len(theirs):
            raise ValueError(f"{what}: rank 0 checks {len(ref)} settings, rank {r} {len(theirs)}; run "
                                        "the same decentpy version on every rank")


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

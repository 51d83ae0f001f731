"""Cross-rank agreement: every rank learns of a difference or a failure before any collective
that would hang on it (each helper is one collective over the group, the same answer everywhere)."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

__all__ = ["first_difference_across_ranks", "raise_if_any_rank_failed", "check_on_every_rank", "everyone"]


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


def raise_if_any_rank_failed(failure: Optional[BaseException], what: str,
                             group: Optional[dist.ProcessGroup] = None) -> None:
    """A collective over ``group`` (default: the world): if ``failure`` is set on any rank, raise on
    every rank (the failing rank its own exception, the others a RuntimeError naming that rank (in
    the group) and its message), so that no rank goes on to a collective its peers never join."""
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    answers = everyone(mine, group)
    if failure is not None:
        raise failure
    bad = [(r, m) for r, m in enumerate(answers) if m is not None]
    if bad:
        r, m = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {m}")


def check_on_every_rank(check: Callable[[], None], what: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Run the local ``check`` (raising on bad input), then :func:`raise_if_any_rank_failed`: a bad
    input on one rank raises on every rank, before any collective that would hang on it."""
    failure: Optional[BaseException] = None
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
        failure = exc
    raise_if_any_rank_failed(failure, what, group)

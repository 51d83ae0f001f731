"""Bucketed reduce-scatter: many small reduce-scatters become one collective.

Sharded optimizers and FSDP-style gradient reduction issue one reduce-scatter per tensor. For
small tensors the fixed cost of a collective (launch, latency, synchronisation) dominates, so
:class:`ReduceScatterBucketer` packs the small ones into a per-(dtype, device, group) bucket of
shape ``[world, shard_cap]`` (row ``r`` holds what is sent to rank ``r``) and reduce-scatters the
whole bucket at once; each caller's callback then receives its slice of the reduced shard. Inputs
too big for a bucket are reduced at once, without an extra concatenated copy where the backend
allows it. The packing itself runs in C++ (``decentpy._C.pack_into_bucket``).

Backends differ in what they implement: NCCL has every reduce-scatter form; ProcessGroupGloo
lacked reduce-scatter entirely in older torch releases (and may lack it for some devices); MPI
has none. Where a form is missing, the bucketer falls back to an all-reduce of the packed
``[world, shard]`` block (or of the stacked inputs) and keeps row ``rank``: exactly the same sum
of the same values. The choice is made once per (backend, device type, form), at first use, and
cached for the life of the process.

Like fairscale's ``ReduceScatterBucketer`` (whose API this follows), collectives run synchronously
with respect to the host on gloo (stream-ordered on NCCL) when a bucket is flushed; "async" means
that the callback of a bucketed input fires later, at a flush, not when the input is submitted.
Every rank must make the same sequence of calls with the same shapes and dtypes (as for any
collective); shapes across ranks cannot be checked without communicating, so they are not.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)
from .comm import or_world

logger = logging.getLogger(__name__)

__all__ = ["ReduceScatterBucketer"]

_MIB = 1024 * 1024

# The one-tensor reduce-scatter: ``reduce_scatter_single`` in recent torch, which deprecates
# ``reduce_scatter_tensor`` (itself the successor of ``_reduce_scatter_base``).
_reduce_scatter_flat: Callable[..., Any] = (getattr(dist, "reduce_scatter_single", None)
                                            or getattr(dist, "reduce_scatter_tensor", None)
                                            or getattr(dist, "_reduce_scatter_base"))

# Reduce-scatter forms used here: "flat" (one [world * n] input, one [n] output) for full buckets,
# "list" (one input tensor per rank) for partly filled buckets and for inputs too big for a bucket.
_FORMS = ("flat", "list")
_NATIVE = "native"
_ALL_REDUCE = "all_reduce"

# (backend name, device type, form) -> _NATIVE or _ALL_REDUCE. Decided once per process: the
# first call of a form tries the native collective; a backend that does not implement it raises
# on every rank alike before communicating, and that combination then uses the all-reduce.
_MODE_CACHE: Dict[Tuple[str, str, str], str] = {}

_CAPABILITY_MESSAGES = ("does not support", "not supported", "unsupported", "not implemented",
                        "no support", "not yet supported")


def _is_capability_error(exc: BaseException) -> bool:
    """True when ``exc`` says the backend lacks the operation (not a failure of communication)."""
    if isinstance(exc, NotImplementedError):
        return True
    if not isinstance(exc, (RuntimeError, ValueError)):
        return False
    text = str(exc).lower()
    return any(m in text for m in _CAPABILITY_MESSAGES)


def _backend_name(group: ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:  # custom process groups may not report a backend name
        return type(group).__name__


def _set_mode(backend: str, device_type: str, form: str, mode: str) -> None:
    """Force the collective used for one (backend, device type, form); for tests and experiments.

    ``mode`` is ``"native"`` (the backend's reduce-scatter) or ``"all_reduce"`` (the fallback).
    Every rank must set the same mode, or the ranks issue different collectives and hang.
    """
    if form not in _FORMS:
        raise ValueError(f"form must be one of {_FORMS}, got {form!r}")
    if mode not in (_NATIVE, _ALL_REDUCE):
        raise ValueError(f"mode must be {_NATIVE!r} or {_ALL_REDUCE!r}, got {mode!r}")
    _MODE_CACHE[(backend, device_type, form)] = mode


def _reduce_scatter(output: Tensor, rows: Sequence[Tensor], flat: Optional[Tensor], group: ProcessGroup,
                    rank: int, scratch_ok: bool) -> Tensor:
    """Sum over ranks of every rank's ``rows[rank]``, written into (or returned instead of) ``output``.

    ``rows`` are the per-rank inputs (contiguous, same numel as ``output``). ``flat``, when given,
    is a contiguous [world * n] tensor whose row-major split equals ``rows`` (a full bucket), which
    allows the one-tensor form. ``scratch_ok`` says the caller's storage behind ``rows``/``flat``
    may be overwritten (a bucket) so the all-reduce fallback can run in place. Returns the tensor
    holding the result (``output`` on the native path).
    """
    form = "flat" if flat is not None else "list"
    key = (_backend_name(group), output.device.type, form)
    mode = _MODE_CACHE.get(key)
    if mode != _ALL_REDUCE:
        try:
            if flat is not None:
                _reduce_scatter_flat(output.view(-1), flat, group=group)
            else:
                dist.reduce_scatter(output, list(rows), group=group)
        except Exception as exc:
            if mode is not None or not _is_capability_error(exc):
                raise
            logger.debug("backend %s on %s has no %s reduce-scatter (%s); using all-reduce + row select "
                        "from now on", key[0], key[1], form, str(exc).splitlines()[0] if str(exc) else exc)
            _MODE_CACHE[key] = _ALL_REDUCE
        else:
            if mode is None:
                logger.debug("backend %s on %s: native %s reduce-scatter works", key[0], key[1], form)
                _MODE_CACHE[key] = _NATIVE
            return output
    # Fallback: all-reduce the whole [world, n] block, then keep this rank's row (same sum).
    if flat is not None and scratch_ok:
        block = flat.view(len(rows), -1)
    else:
        block = torch.stack([r.reshape(-1) for r in rows])
    dist.all_reduce(block, group=group)
    output.view(-1).copy_(block[rank])
    return output


class _Bucket:
    """One [world, shard_cap] packing buffer plus the callbacks of the inputs packed into it."""

    def __init__(self, data: Tensor, group: ProcessGroup, rank: int) -> None:
        self.data = data  # [world, shard_cap]
        self.group = group
        self.rank = rank
        self.offset = 0
        # (offset, shape, callback) of each packed input, in packing order.
        self.pending: List[Tuple[int, torch.Size, Optional[Callable[[Tensor], Any]]]] = []

    @property
    def shard_cap(self) -> int:
        return self.data.size(1)

    def fits(self, numel: int) -> bool:
        return self.offset + numel <= self.shard_cap

    def append(self, inputs: Sequence[Tensor], callback_fn: Optional[Callable[[Tensor], Any]]) -> None:
        numel = inputs[0].numel()
        _C.pack_into_bucket(self.data, self.offset, list(inputs))
        self.pending.append((self.offset, inputs[0].shape, callback_fn))
        self.offset += numel

    def flush(self) -> None:
        """Reduce-scatter the filled part of the bucket, then fire the callbacks in packing order."""
        if not self.pending:
            return
        used, pending = self.offset, self.pending
        # Reset first: whatever happens below, no callback can fire twice and the bucket stays usable.
        self.offset, self.pending = 0, []
        # A fresh output per flush: callbacks get views into it and may keep them.
        output = self.data.new_empty(used)
        full = used == self.shard_cap
        rows = [row.narrow(0, 0, used) for row in self.data.unbind(0)]
        logger.debug("flushing bucket %s/%s: %d inputs, %d of %d elements per rank", self.data.dtype,
                     self.data.device, len(pending), used, self.shard_cap)
        try:
            _reduce_scatter(output, rows, self.data.view(-1) if full else None, self.group, self.rank,
                            scratch_ok=True)
        except Exception:
            logger.error("reduce-scatter of a bucket of %d inputs (%s, %s) failed; their callbacks will not "
                         "fire", len(pending), self.data.dtype, self.data.device)
            raise
        _fire([(cb, output.narrow(0, off, _numel(shape)).view(shape)) for off, shape, cb in pending])

    def free(self) -> None:
        """Release the packing buffer's memory now (not when the last reference happens to die)."""
        self.data.untyped_storage().resize_(0)


def _numel(shape: torch.Size) -> int:
    return math.prod(shape)


def _fire(calls: Sequence[Tuple[Optional[Callable[[Tensor], Any]], Tensor]]) -> None:
    """Call every callback once, even if one raises; then re-raise the first error."""
    first: Optional[BaseException] = None
    for callback_fn, result in calls:
        if callback_fn is None:
            continue
        try:
            callback_fn(result)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others ran
            if first is None:
                first = exc
            else:
                logger.error("reduce-scatter callback %r also raised: %r", callback_fn, exc)
    if first is not None:
        raise first


class ReduceScatterBucketer:
    """Buffers small reduce-scatters into per-(dtype, device, group) buckets.

    Args:
        bucket_cap_mb: size of each bucket in MiB (all ranks' rows together). An input whose
            ``shard numel * world * element_size`` exceeds it (its shard does not fit in the
            per-rank row of ``bucket_cap_mb / world``) is reduced at once. ``0`` disables bucketing.

    Example::

        bucketer = ReduceScatterBucketer()
        for param in params:
            chunks = list(param.grad.flatten().chunk(world))  # one equal chunk per rank
            bucketer.reduce_scatter_async(chunks, group, callback_fn=lambda shard, p=param: ...)
        bucketer.flush()  # every callback has fired after this

    Not thread-safe; use one bucketer per thread that issues collectives.
    """

    def __init__(self, bucket_cap_mb: float = 25) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {type(bucket_cap_mb).__name__}")
        if not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be finite and >= 0 (0 disables bucketing), got {bucket_cap_mb}")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self._buckets: Dict[Tuple[torch.dtype, torch.device, ProcessGroup], _Bucket] = {}

    @torch.no_grad()
    def reduce_scatter_async(self, input_list: List[Tensor], group: Optional[ProcessGroup],
                             callback_fn: Optional[Callable[[Tensor], Any]] = None) -> None:
        """Reduce-scatter ``input_list`` over ``group``; pass this rank's reduced shard to ``callback_fn``.

        ``input_list`` holds one tensor per rank of ``group`` (same shape, dtype and device);
        ``input_list[r]`` is this rank's contribution to rank ``r``'s shard. The result, the sum
        over ranks of their ``input_list[my_rank]``, has the shape of ``input_list[0]`` and is
        passed to ``callback_fn`` exactly once: at once for an input too big for a bucket (or
        with bucketing disabled), else when its bucket is flushed (when a later input does not
        fit, or at :meth:`flush`). The inputs are copied (packed) or consumed before this returns,
        so the caller may reuse them. ``group=None`` means the default group.

        Raises TypeError/ValueError, before any collective, for a wrong number of inputs or
        inputs that differ in shape, dtype or device.
        """
        group = or_world(group)
        if callback_fn is not None and not callable(callback_fn):
            raise TypeError(f"callback_fn must be callable or None, got {type(callback_fn).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ReduceScatterBucketer needs an initialised torch.distributed process group "
                               "(call torch.distributed.init_process_group first)")
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        inputs = _check_inputs(input_list, world)
        first = inputs[0]

        if first.numel() == 0:  # nothing to reduce; same on every rank since shapes match
            _fire([(callback_fn, first.new_empty(first.shape))])
            return

        shard_cap = self._shard_cap(first.element_size(), world)
        if first.numel() > shard_cap:
            self._reduce_now(inputs, group, rank, callback_fn)
            return

        key = (first.dtype, first.device, group)
        bucket = self._buckets.get(key)
        if bucket is None:
            data = torch.empty((world, shard_cap), dtype=first.dtype, device=first.device)
            bucket = self._buckets[key] = _Bucket(data, group, rank)
            logger.debug("new reduce-scatter bucket %s/%s: [%d, %d]", first.dtype, first.device, world, shard_cap)
        if not bucket.fits(first.numel()):
            bucket.flush()
        bucket.append(inputs, callback_fn)

    def flush(self) -> None:
        """Reduce every pending bucket and fire its callbacks (all ranks must call it together)."""
        for bucket in list(self._buckets.values()):
            bucket.flush()

    def free(self) -> None:
        """Flush, then release the buckets' memory; the bucketer stays usable (buckets are re-made)."""
        self.flush()
        for bucket in self._buckets.values():
            bucket.free()
        self._buckets.clear()

    def _shard_cap(self, element_size: int, world: int) -> int:
        """Elements per rank row of a bucket: bucket_cap_mb / world, in elements of this size."""
        return int(self.bucket_cap_mb * _MIB) // (element_size * world)

    @staticmethod
    def _reduce_now(inputs: List[Tensor], group: ProcessGroup, rank: int,
                    callback_fn: Optional[Callable[[Tensor], Any]]) -> None:
        """One collective for one input, straight from the caller's tensors (no concatenated copy)."""
        first = inputs[0]
        output = torch.empty(first.shape, dtype=first.dtype, device=first.device)
        rows = [t if t.is_contiguous() else t.contiguous() for t in inputs]
        _reduce_scatter(output, rows, None, group, rank, scratch_ok=False)
        _fire([(callback_fn, output)])

    def __repr__(self) -> str:
        return f"ReduceScatterBucketer(bucket_cap_mb={self.bucket_cap_mb:g}, buckets={len(self._buckets)})"


def _check_inputs(input_list: Any, world: int) -> List[Tensor]:
    """Validate one call's inputs (before any collective, so a bad call raises on every rank alike)."""
    if isinstance(input_list, Tensor) or not isinstance(input_list, (list, tuple)):
        raise TypeError(f"input_list must be a list of tensors (one per rank of the group), got "
                        f"{type(input_list).__name__}")
    if len(input_list) != world:
        raise ValueError(f"input_list has {len(input_list)} tensors but the group has {world} ranks; "
                         f"expected exactly {world} (one per rank of the group)")
    for i, t in enumerate(input_list):
        if not isinstance(t, Tensor):
            raise TypeError(f"input_list[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"input_list[{i}] has layout {t.layout}; only dense (strided) tensors are supported")
    first = input_list[0]
    for i, t in enumerate(input_list[1:], start=1):
        if t.dtype != first.dtype:
            raise TypeError(f"input_list[{i}] has dtype {t.dtype} but input_list[0] has dtype {first.dtype}; "
                            "all inputs must have the same dtype")
        if t.shape != first.shape:
            raise ValueError(f"input_list[{i}] has shape {tuple(t.shape)} but input_list[0] has shape "
                             f"{tuple(first.shape)}; all inputs must have the same shape")
        if t.device != first.device:
            raise ValueError(f"input_list[{i}] is on {t.device} but input_list[0] is on {first.device}; "
                             "all inputs must be on the same device")
    return list(input_list)

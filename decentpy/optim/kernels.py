"""The one Python module that calls decentpy's compiled kernels.

The fused optimizers (:mod:`decentpy.optim`), the generic mix of a bucket step, the send-buffer
copy and the bucket packing (assignment, aligned offsets, flat blocks) all go through here. The kernel contract's types come from the extension itself
(``_C.OptKind``, ``_C.GroupHyper``, ``_C.MAX_GROUPS``), so Python never copies an enum value or a
limit, and every argument is passed by keyword: a mismatch between the two sides fails at the
call with pybind's message instead of silently reading the wrong slot.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import decentpy._C as _C  # the compiled extension (a module of the package, not its __init__)

__all__ = ["OptKind", "GroupHyper", "MAX_GROUPS", "KERNEL_DTYPES", "StepArgs", "step", "fused_step", "compressed_step", "Compressor", "INT8_BLOCK", "compressed_bytes",
           "group_reduce", "wire_regions", "mix", "peer_mix", "peer_stats", "peer_sketch", "peer_rows", "peer_sampled_count", "SAMPLE_UNIT", "peer_pair_verdict", "peer_group_verdict", "PEER_PARTS", "PEER_STATS",
           "scale_copy", "NORM_SLOTS", "sparse_pack", "sparse_mean", "sparse_wire_bytes", "SPARSE_MAX_CHUNK",
           "peer_read_dtype", "segments_for_numel", "check_segments", "flat_alias", "assign_buckets", "aligned_offsets",
           "make_flat_block", "build_info"]

OptKind = _C.OptKind
GroupHyper = _C.GroupHyper
Compressor = _C.Compressor
#: elements per int8 / int4 scale block of the compressed exchange (one fp32 scale each)
INT8_BLOCK: int = int(_C.INT8_BLOCK)
MAX_GROUPS: int = int(_C.MAX_GROUPS)
#: most elements of one SparseLoCo chunk (csrc/kernels/sparse.h: uint16 offsets, the CUDA pack's shared keys)
SPARSE_MAX_CHUNK: int = int(_C.SPARSE_MAX_CHUNK)
# Parameter dtypes the kernels step (fp32 math, fp32 state); others take torch's path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def build_info() -> Dict[str, Any]:
    """What the extension was compiled with (CPU ISA and vector width, CUDA kernels and archs,
    NCCL, OpenMP, compiler): what benchmarks and ``python -m decentpy`` report."""
    return dict(_C.build_info())


#: the arguments of one fused pass, set by name (csrc/ops/mix_and_step_op.h ``StepCall``: the one list
#: of them; a name that is not a field raises TypeError)
StepArgs = _C.StepArgs


def step(args: "_C.StepArgs") -> None:
    """One fused pass over a flat buffer (csrc/kernels/mix_and_step.h): the mix with ``comm``, the
    optimizer update, the send-buffer write; with ``compressor``, the compressed-gossip pass."""
    _C.mix_and_step(args)


def fused_step(kind: "_C.OptKind", param: Tensor, grad: Optional[Tensor], states: Sequence[Tensor],
               segments: Optional[Tensor], groups: Sequence["_C.GroupHyper"], **fields: Any) -> None:
    """:func:`step` with the common fields positional and any other field of :data:`StepArgs` by
    name: ``comm``, ``send``, ``mix_a``, ``mix_b``, ``send_scale``, ``grad_scale``, ``grad_norm`` /
    ``scaler_scale`` (one-element tensors on the buffer's device from which the kernel derives the
    gradient factor and the found-inf skip), ``clip_norm``, the flags, ``prev_skip`` /
    ``alt_bias_steps`` (a deferred skip verdict)."""
    _C.mix_and_step(kind=kind, param=param, grad=grad, states=list(states), segments=segments, groups=list(groups),
                    **fields)


def compressed_step(kind: "_C.OptKind", compressor: "_C.Compressor", param: Tensor, grad: Optional[Tensor],
                    states: Sequence[Tensor], segments: Optional[Tensor], groups: Sequence["_C.GroupHyper"],
                    **fields: Any) -> None:
    """One compressed-gossip pass over a flat fp32 buffer (csrc/kernels/mix_and_step.h): the received
    ``q_recv`` into ``peer_copy`` and ``param += choco_mix * (peer_copy - self_copy_mix)``, the
    optimizer update, then ``q_send = Q(param - self_copy_next)`` and ``self_copy_next += D(q_send)``;
    other fields of :data:`StepArgs` by name, as :func:`fused_step`."""
    _C.mix_and_step(kind=kind, compressor=compressor, param=param, grad=grad, states=list(states),
                    segments=segments, groups=list(groups), **fields)


def compressed_bytes(compressor: "_C.Compressor", numel: int) -> int:
    """Bytes on the wire of ``numel`` fp32 elements compressed with ``compressor`` (NONE: 4 per element)."""
    return int(_C.compressed_bytes(compressor, int(numel)))


def group_reduce(compressor: "_C.Compressor", inputs: Sequence[Tensor], out: Tensor, self_copy: Tensor, lo: int,
                 hi: int) -> None:
    """The owner's step of a compressed group exchange over elements ``[lo, hi)`` (csrc/kernels/mix_and_step.h,
    GroupReduceArgs): ``mu`` = the mean of the members' ``D(q)`` (``inputs``, wire bytes of the whole
    bucket), ``r = Q(mu)`` into ``out`` and ``self_copy += m (D(r) - mu)``."""
    _C.compressed_group_reduce(compressor=compressor, inputs=list(inputs), out=out, self_copy=self_copy, lo=int(lo),
                               hi=int(hi))


def wire_regions(compressor: "_C.Compressor", numel: int, lo: int, hi: int) -> List[Tuple[int, int]]:
    """The byte ranges ``[start, stop)`` that hold elements ``[lo, hi)`` (``lo`` a multiple of
    :data:`INT8_BLOCK`) in the wire bytes of ``numel`` elements: the block scales, then the codes."""
    return [(int(a), int(b)) for a, b in _C.compressed_wire_regions(compressor=compressor, numel=int(numel),
                                                                   lo=int(lo), hi=int(hi))]


def outer_pack(param: Tensor, theta: Tensor, out: Tensor, compressor: Optional["_C.Compressor"] = None,
               excess: Optional[Tensor] = None) -> None:
    """The outer step's first pass (csrc/kernels/outer_step.h): the pseudo-gradient ``theta - param``
    into ``out`` (fp32), or with a ``compressor`` ``q = Q(theta - param - excess)`` into ``out`` (wire
    bytes) and ``excess = D(q) - (theta - param - excess)`` (error feedback)."""
    _C.outer_pack(param=param, theta=theta, compressor=compressor if compressor is not None else Compressor.NONE,
                  excess=excess, out=out)


def outer_apply(param: Tensor, theta: Tensor, delta: Tensor, kind: "_C.OptKind", hyper: "_C.GroupHyper",
                states: Sequence[Tensor], *, theta_mix: Optional[Tensor] = None,
                compressor: Optional["_C.Compressor"] = None, decoupled_weight_decay: bool = False,
                momentum_init: bool = False, alpha: float = 0.0) -> None:
    """The outer step's second pass (csrc/kernels/outer_step.h): the outer optimizer (``kind`` SGD or
    Adam, ``states`` as :func:`fused_step`'s) steps ``theta_mix`` (or ``theta``) with the pseudo-gradient
    ``delta`` (fp32, or wire bytes of ``compressor``); ``theta`` takes the result and ``param`` becomes
    ``theta + alpha (param - theta)``."""
    _C.outer_apply(param=param, theta=theta, theta_mix=theta_mix,
                   compressor=compressor if compressor is not None else Compressor.NONE, delta=delta, kind=kind,
                   hyper=hyper, states=list(states), decoupled_weight_decay=decoupled_weight_decay,
                   momentum_init=momentum_init, alpha=float(alpha))


def outer_decode(compressor: "_C.Compressor", wire: Tensor, out: Tensor) -> None:
    """``out = D(wire)``: the float32 values of a compressed pseudo-gradient of ``out.numel()``
    elements, exactly as :func:`outer_apply` reads them."""
    _C.outer_decode(compressor=compressor, wire=wire, out=out)


def sparse_wire_bytes(numel: int, chunk: int, k: int) -> int:
    """Bytes of one SparseLoCo message of ``numel`` elements (csrc/kernels/sparse.h's layout: two fp32
    scales per chunk, a uint16 offset and a 2-bit code per sent element)."""
    return int(_C.sparse_wire_bytes(numel=numel, chunk=chunk, k=k))


def sparse_pack(param: Tensor, theta: Tensor, error: Tensor, wire: Tensor, chunk: int, k: int, decay: float) -> None:
    """SparseLoCo's pack (csrc/kernels/sparse.h): ``error = decay error + (theta - param)``, the ``k``
    largest ``|error|`` of each chunk of ``chunk`` elements in 2 bits into ``wire``, what the wire
    sends taken out of ``error``. Flat contiguous float32 tensors on one device."""
    _C.sparse_pack(param=param, theta=theta, error=error, wire=wire, chunk=chunk, k=k, decay=float(decay))


def sparse_mean(inputs: Sequence[Tensor], out: Tensor, chunk: int, k: int) -> None:
    """``out`` = the mean of the members' SparseLoCo messages (their order: the rounding order)."""
    _C.sparse_mean(inputs=list(inputs), out=out, chunk=chunk, k=k)


def mix(param: Tensor, comm: Optional[Tensor], mix_a: float, mix_b: float, *, grad: Optional[Tensor] = None,
        send: Optional[Tensor] = None, send_scale: float = 1.0, zero_grad: bool = False,
        mix_factor: Optional[Tensor] = None, mix_guard: float = 0.0, mix_guarded: Optional[Tensor] = None) -> None:
    """``param = mix_a * param + mix_b * comm`` (no update); optionally ``send = send_scale * param``
    and ``grad`` zeroed, in the same pass. ``mix_factor``: the peer check's factor on the mix (a
    one-element float32 tensor on param's device, read by the kernel; see :func:`peer_mix`);
    ``mix_guard`` / ``mix_guarded``: its element guard (an element whose change is not within the guard
    keeps its value, counted into the one-element int64 ``mix_guarded``)."""
    _C.mix_and_step(kind=OptKind.NONE, param=param, grad=grad, comm=comm, send=send, mix_a=mix_a, mix_b=mix_b,
                    send_scale=send_scale, zero_grad=zero_grad, mix_factor=mix_factor, mix_guard=float(mix_guard),
                    mix_guarded=mix_guarded)


def peer_mix(mix_a: float, mix_b: float, factor: float) -> Tuple[float, float, bool]:
    """``(a, b, reads_comm)``: the mix coefficients the kernels use under the peer check's factor
    (csrc/kernels/update.h ``peer_mix``): as given for ``factor >= 1``; ``(a + b (1 - f), b f)``
    between; ``comm`` not read (``p`` kept) for ``factor <= 0`` or NaN."""
    a, b, reads = _C.peer_mix(float(mix_a), float(mix_b), float(factor))
    return float(a), float(b), bool(reads)


#: float64 rows of the peer check's passes (fixed parts, then the result; csrc/kernels/peer_check.h)
PEER_PARTS: int = int(_C.PEER_PARTS)
#: the stats pass's values: sum (c - p)^2, sum p^2, c's and p's non-finite indicators
PEER_STATS: int = int(_C.PEER_STATS)


def peer_rows(width: int, device: torch.device) -> Tensor:
    """A work buffer of a peer-check pass of ``width`` values (its parts' rows, then the result)."""
    return torch.empty((PEER_PARTS + 1) * width, dtype=torch.float64, device=device)


def peer_stats(param: Tensor, comm: Optional[Tensor], out: Optional[Tensor] = None, sample: int = 1) -> Tensor:
    """The peer check's one pass (csrc/kernels/peer_check.h): float64 ``[sum (c - p)^2, sum p^2, c's
    non-finite indicator, p's]`` (an indicator is 0, or NaN) over the sampled elements (``sample``:
    one unit of SAMPLE_UNIT elements in every ``sample``; 1: all), on param's device; a view of ``out``
    (:func:`peer_rows` of PEER_STATS, reused across calls) when given."""
    if out is None:
        out = peer_rows(PEER_STATS, param.device)
    param, comm = _peer_readable(param), (None if comm is None else _peer_readable(comm))
    _C.peer_stats(param, comm, int(sample), out)
    return out[-PEER_STATS:]


def peer_read_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the peer check's passes read a buffer of ``dtype`` in: its own for the kernels'
    dtypes, float32 for others (float64 buckets, which take torch's path: read as a float32 copy --
    a heuristic's precision; its rounding is what the group verdict's tolerance must allow)."""
    return dtype if dtype in KERNEL_DTYPES else torch.float32


def _peer_readable(t: Tensor) -> Tensor:
    return t if t.dtype in KERNEL_DTYPES else t.to(torch.float32)


def peer_sketch(src: Tensor, seed: int, slots: int, out: Optional[Tensor] = None, sample: int = 1) -> Tensor:
    """The peer check's linear sketch of ``src`` (csrc/kernels/peer_check.h), of its sampled elements:
    float64 ``[slots values, their sum of squares, the non-finite indicator]``, on src's device (a view
    of ``out``, :func:`peer_rows` of ``slots + 2``, when given)."""
    if out is None:
        out = peer_rows(slots + 2, src.device)
    src = _peer_readable(src)
    _C.peer_sketch(src, int(seed), int(slots), int(sample), out)
    return out[-(slots + 2):]


def peer_pair_verdict(stats: Tensor, expand: float, tau: Optional[float], first: float, clip: bool,
                      out: Optional[Tensor] = None) -> Tensor:
    """A pair's verdict (csrc/kernels/peer_check.h ``pair_verdict``): float64 ``[f, d, tau, c_ok, p_ok]``
    on the stats' device, computed there (a GPU: a one-thread kernel, nothing read back). ``tau`` None:
    the first bound, ``first x ||p||``."""
    if out is None:
        out = torch.empty(5, dtype=torch.float64, device=stats.device)
    _C.peer_pair_verdict(stats, float(expand), float("nan") if tau is None else float(tau), float(first), bool(clip),
                         out)
    return out


def peer_group_verdict(fingerprints: Tensor, recv: Tensor, scale: float, unit_roundoff: float, tau: Optional[float],
                       first: float, expand: float = 1.0, out: Optional[Tensor] = None) -> Tensor:
    """A group's verdict (csrc/kernels/peer_check.h ``group_verdict``): float64 ``[f, consistent, tau,
    ||center||, d_0 .. d_{m-1}, bad_0 .. bad_{m-1}]`` on the fingerprints' device."""
    m = fingerprints.shape[0]
    if out is None:
        out = torch.empty(4 + 2 * m, dtype=torch.float64, device=fingerprints.device)
    _C.peer_group_verdict(fingerprints, recv, float(scale), float(unit_roundoff),
                          float("nan") if tau is None else float(tau), float(first), float(expand), out)
    return out


#: elements of a unit of the peer check's sampling (csrc/kernels/mix_and_step.h kSampleUnit)
SAMPLE_UNIT: int = int(_C.SAMPLE_UNIT)


def peer_sampled_count(numel: int, sample: int) -> int:
    """Elements of ``numel`` the peer check's passes read with ``sample``."""
    return int(_C.peer_sampled_count(int(numel), int(sample)))


#: slots of the partial sums of squares :func:`scale_copy` writes (``sumsq``)
NORM_SLOTS: int = int(_C.NORM_SLOTS)


def scale_copy(dst: Tensor, src: Tensor, alpha: float, sumsq: Optional[Tensor] = None) -> None:
    """``dst = alpha * src`` (``dst`` may be ``src``). With ``sumsq`` (float32, :data:`NORM_SLOTS`
    elements, on the same device) the same pass writes partial sums of the squares of ``src``:
    ``sumsq.sum()`` is its squared norm, the same bits in every run."""
    _C.scale_copy_(dst, src, float(alpha), sumsq)


def segments_for_numel(numel: int, device: torch.device) -> Tensor:
    """The segment table of a buffer with one parameter group."""
    return torch.tensor([[0, int(numel), 0]], dtype=torch.int64, device=device)


def check_segments(segments: Tensor, numel: int, num_groups: int) -> None:
    """Validate a CPU segment table (sorted, disjoint, covering ``[0, numel)``, groups below
    ``num_groups``) before it goes to the device: the GPU kernel trusts it."""
    _C.check_segments(segments, numel, num_groups)


def assign_buckets(size_bytes: Sequence[int], keys: Sequence[int], cap_bytes: int) -> List[List[int]]:
    """Greedy bucket assignment in gradient-ready order, one open bucket per key (dtype, device);
    lists of tensor indices, in closing order."""
    return _C.assign_buckets(list(size_bytes), list(keys), int(cap_bytes))


def aligned_offsets(numels: Sequence[int], element_size: int, align_bytes: int) -> Tuple[List[int], int]:
    """Element offsets aligned to ``align_bytes``, and the (aligned) total number of elements."""
    return _C.aligned_offsets(list(numels), element_size, align_bytes)


def make_flat_block(tensors: Sequence[Tensor], offsets: Sequence[int], total: int,
                    copy_values: bool) -> Tuple[Tensor, List[Tensor]]:
    """A zero-filled flat block of ``total`` elements and one view per tensor at its offset
    (strides kept when dense), with the tensors' values copied in when ``copy_values``."""
    return _C.make_flat_block(list(tensors), list(offsets), total, copy_values)


def flat_alias(t: Tensor) -> Tensor:
    """A 1-D alias of a dense tensor in memory order (channels_last included): what the kernels and
    the sharded optimizer's pieces address."""
    if t.is_contiguous():
        return t.view(-1)
    if not torch._prims_common.is_non_overlapping_and_dense_or_false(t):
        raise ValueError(f"expected a dense tensor; got sizes {tuple(t.shape)} strides {t.stride()}")
    return t.as_strided((t.numel(),), (1,))

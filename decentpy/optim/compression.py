"""Compressed gossip: the settings (:class:`Compression`) and the wire sizes.

CHOCO-style (Koloskova et al., 2019): instead of its parameters, a worker sends a compressed
difference ``q = Q(x_i - xhat_{i|j})`` between its parameters and a *public copy* ``xhat_{i|j}``
that the peer ``j`` tracks as well; both ends add the same dequantised ``D(q)`` to their copy of
``xhat_{i|j}``, so the copies stay bit-identical and what compression drops is sent again later
(error feedback). The mix moves the parameters towards the peer's public copy:
``x_i += gamma * w_ij * (xhat_{j|i} - xhat_{i|j})``; the pair's sum is unchanged, so the global mean
of the workers is preserved exactly as in uncompressed gossip.

Time-varying topologies (ring, one-peer-exp change partners every step) are handled with one pair
of copies **per edge**: for every distinct peer ``j`` of the topology's period a rank keeps
``xhat_{i|j}`` and ``xhat_{j|i}`` for each bucket, i.e. ``2 x (distinct peers) x bucket size`` fp32
values of memory beside the model (ring: 2 peers, 4 extra fp32 copies of the model; one-peer-exp
over n = 2^r workers: r peers, 2r copies).

A group of ``m > 2`` ranks (complete, alternating-exp-ring's groups) shares one public mean instead:
each member keeps ``xhat_i`` (its own public copy in that group) and ``M`` (the group's mean of the
members' copies, identical on every member). A member sends ``q_i = Q(x_i - xhat_i)`` in ``m``
chunks of whole scale blocks, chunk ``c`` to the member ``c`` that owns it; the owner averages the
``m`` chunks it holds, re-quantises the mean once, ``r = Q(mean)``, keeps what that rounding dropped
in its own ``xhat`` (so that the copies keep summing to ``m M``), and sends ``r`` to every member;
all add ``D(r)`` to ``M`` and mix ``x_i += gamma w m (M - xhat_i)``. Bytes per rank and step:
``2 (m - 1) / m`` wire sizes (a reduce-scatter and an all-gather of compressed chunks) instead of
``m - 1`` with one copy per edge; memory: two fp32 copies per distinct group.

The quantise / dequantise, the public-copy updates and the mix run inside the fused mix-and-step
kernel pass (csrc/kernels/compress.h), on CPU and CUDA; the owner's reduction is one more kernel of
the same header. See docs/compression.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from . import kernels

__all__ = ["Compression", "resolve_compression", "wire_bytes", "chunk_bounds", "group_wire_bytes", "INT8_BLOCK",
           "DEFAULT_GAMMA"]

#: elements per int8 / int4 scale block (one fp32 scale each)
INT8_BLOCK: int = kernels.INT8_BLOCK

#: the consensus step size used when ``gamma`` is not given (see docs/compression.md for the
#: digits runs behind these values)
DEFAULT_GAMMA = {"bf16": 1.0, "int8": 1.0, "int4": 1.0}

_KINDS = {"bf16": kernels.Compressor.BF16, "int8": kernels.Compressor.INT8, "int4": kernels.Compressor.INT4}


def _kind_names() -> str:
    """The valid kinds for error messages: 'bf16', 'int8' or 'int4'."""
    names = [repr(k) for k in _KINDS]
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclass(frozen=True)
class Compression:
    """Compressed gossip settings for ``DecentralizedDataParallel(compression=...)``.

    ``kind``: ``"bf16"`` (0.5x the fp32 bytes), ``"int8"`` (per block of 256 elements one fp32
    scale ``max|d| / 127`` and round-to-nearest int8 codes: ``1 + 4/256`` bytes per element, 0.254x)
    or ``"int4"`` (the same blocks with scale ``max|d| / 7`` and 4-bit codes in [-7, 7], two per
    byte: ``1/2 + 4/256`` bytes per element, 0.129x; coarser, so it may want a smaller ``gamma``).
    ``gamma``: the consensus step size in ``x_i += gamma * w_ij * (xhat_j - xhat_i)``, in ``(0, 1]``;
    ``None`` takes :data:`DEFAULT_GAMMA` of the kind. ``gamma = 1`` with an exact compressor is plain
    gossip; smaller values damp the compression noise at the price of slower consensus.
    """

    kind: str
    gamma: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"compression kind must be one of {_kind_names()}, got {self.kind!r}")
        if self.gamma is not None:
            g = float(self.gamma)
            if not (math.isfinite(g) and 0.0 < g <= 1.0):
                raise ValueError(f"compression gamma (the consensus step size) must be in (0, 1], got {self.gamma}")
            object.__setattr__(self, "gamma", g)
        else:
            object.__setattr__(self, "gamma", DEFAULT_GAMMA[self.kind])

    @property
    def compressor(self) -> "kernels.Compressor":
        """The kernel's enum value."""
        return _KINDS[self.kind]

    def wire_bytes(self, numel: int) -> int:
        """Bytes one exchange of ``numel`` elements puts on the wire."""
        return wire_bytes(self.kind, numel)


def wire_bytes(kind: Optional[str], numel: int) -> int:
    """Bytes on the wire for ``numel`` fp32 elements: ``None`` 4n, bf16 2n, int8 ``4 ceil(n/256) + n``,
    int4 ``4 ceil(n/256) + ceil(n/2)`` (the fp32 block scales first, then the codes)."""
    if kind is not None and kind not in _KINDS:
        raise ValueError(f"compression kind must be None or one of {_kind_names()}, got {kind!r}")
    return kernels.compressed_bytes(_KINDS[kind] if kind is not None else kernels.Compressor.NONE, numel)


def chunk_bounds(numel: int, members: int, position: int) -> Tuple[int, int]:
    """The elements ``[lo, hi)`` of a bucket of ``numel`` that the member at ``position`` (its index in
    the group's rank order) reduces in a compressed group exchange: the ``ceil(numel / 256)`` scale
    blocks split as evenly as whole blocks allow, ``position * blocks // members`` on (a member may own
    none when the bucket has fewer blocks than the group has members)."""
    if not 0 <= position < members:
        raise ValueError(f"position must be in [0, {members}), got {position}")
    blocks = -(-numel // INT8_BLOCK)
    lo = position * blocks // members * INT8_BLOCK
    hi = (position + 1) * blocks // members * INT8_BLOCK
    return min(lo, numel), min(hi, numel)


def group_wire_bytes(kind: str, numel: int, members: int, position: int) -> int:
    """Bytes the member at ``position`` sends in one compressed group exchange of a bucket of
    ``numel``: every other member's chunk of its ``q``, then its reduced chunk to each other member
    (``2 (m - 1) / m`` wire sizes when the chunks are equal)."""
    own = chunk_bounds(numel, members, position)
    out = (members - 1) * wire_bytes(kind, own[1] - own[0])
    for p in range(members):
        if p != position:
            lo, hi = chunk_bounds(numel, members, p)
            out += wire_bytes(kind, hi - lo)
    return out


def resolve_compression(arg: Union[None, str, Compression]) -> Optional[Compression]:
    """``None`` / ``"none"``: no compression; a kind name; or a :class:`Compression`."""
    if arg is None:
        return None
    if isinstance(arg, Compression):
        return arg
    if isinstance(arg, str):
        if arg.lower() == "none":
            return None
        return Compression(arg.lower())
    raise TypeError(f"compression must be None, {_kind_names()} or a decentpy.Compression, got {type(arg).__name__}")

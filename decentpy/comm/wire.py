"""What crosses a process boundary, as data and never as code.

Everything decentpy exchanges between ranks outside the tensors of an exchange -- settings agreed at
construction, verdicts, a training state handed to a joiner, a consolidated optimizer state -- is
input from another process, which may be faulty or not ours: it is encoded here as plain data and
decoded with bounds checks, so that a crafted message can at worst raise a named error. Never
Python's object serialisation (torch.distributed's object collectives and a ``torch.load`` that
is not ``weights_only`` run code chosen by the sender).

* :func:`all_gather_json` -- every rank's JSON value (numbers, strings, lists, dicts, None), one
  length round and one payload round over the group; :func:`broadcast_json` -- one rank's;
* :func:`all_gather_bytes` / :func:`gather_bytes` -- every rank's byte message, on every rank or on one;
* :func:`encode_state` / :func:`decode_state` -- a state made of tensors and plain containers
  (``torch.save`` bytes, loaded with ``weights_only=True``: tensors, numbers, strings, lists, tuples,
  dicts, no other class);
* :func:`send_bytes` / :func:`recv_bytes` -- one length-prefixed byte message between two ranks.
"""

from __future__ import annotations

import ctypes
import io
import json
from typing import Any, List, Optional

import torch
import torch.distributed as dist

__all__ = ["MalformedMessageError", "MAX_JSON_BYTES", "MAX_STATE_BYTES", "to_json_bytes", "from_json_bytes",
           "all_gather_json", "broadcast_json", "all_gather_bytes", "gather_bytes", "encode_state", "decode_state",
           "send_bytes", "recv_bytes", "send_state",
           "recv_state", "wire_device"]

#: largest JSON message one rank may send (settings of a model with many parameters fit easily)
MAX_JSON_BYTES = 64 << 20
#: largest training state a rank may send to another (a joiner's whole model and optimizer state)
MAX_STATE_BYTES = 1 << 40


class MalformedMessageError(RuntimeError):
    """A message from another rank (or a file) that is not what the protocol allows: too large, not
    valid JSON, not a plain-data state. Named with its sender; nothing of it was run."""


def wire_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for NCCL, else the
    CPU."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_json_bytes(value: Any) -> bytes:
    """``value`` (plain data) as UTF-8 JSON; TypeError naming the first value that is not plain
    data."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"only plain data (numbers, strings, lists, dicts, None) crosses ranks as JSON: {exc}") from exc


def from_json_bytes(data: bytes, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Decode :func:`to_json_bytes`; :class:`MalformedMessageError` naming ``what`` for anything
    else."""
    if len(data) > max_bytes:
        raise MalformedMessageError(f"{what}: {len(data)} bytes, more than the {max_bytes} allowed")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedMessageError(f"{what}: not a valid JSON message ({type(exc).__name__}: "
                                    f"{str(exc)[:120]})") from None


def all_gather_json(value: Any, group: Optional[dist.ProcessGroup] = None, what: str = "a message",
                    max_bytes: int = MAX_JSON_BYTES) -> List[Any]:
    """Every rank's ``value`` (plain data), by rank in ``group`` (two collectives: the lengths, then
    the payloads padded to the longest). A message that is too large or not JSON raises
    :class:`MalformedMessageError` naming the sender, on every rank (all of them received it)."""
    payloads = all_gather_bytes(to_json_bytes(value), group, what, max_bytes)
    return [from_json_bytes(data, f"{what} from rank {r}", max_bytes) for r, data in enumerate(payloads)]


def broadcast_json(value: Any, src: int, group: Optional[dist.ProcessGroup] = None, what: str = "a message",
                   max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Group rank ``src``'s ``value`` (plain data) on every rank of ``group`` (the others pass
    anything: it is not sent). Two collectives: the length, then the payload; a message that is too
    large or not JSON raises :class:`MalformedMessageError` naming ``src`` on every receiver."""
    device = wire_device(group)
    payload = to_json_bytes(value) if dist.get_rank(group) == src else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=_global(src, group), group=group)
    n = int(length.item())
    if not 0 <= n <= max_bytes:
        raise MalformedMessageError(f"{what} from rank {src}: announced {n} bytes (at most {max_bytes} allowed)")
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    if payload:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if n:
        dist.broadcast(buf, src=_global(src, group), group=group)
    return from_json_bytes(_bytes_of(buf), f"{what} from rank {src}", max_bytes)


def _lengths(data: bytes, group: Optional[dist.ProcessGroup], what: str, max_bytes: int,
             device: torch.device) -> List[int]:
    """Every rank's message length (an all-gather), each checked against ``max_bytes`` before
    anything is allocated for it."""
    n = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(t.item()) for t in lengths]
    bad = next((r for r, s in enumerate(sizes) if not 0 <= s <= max_bytes), None)
    if bad is not None:
        raise MalformedMessageError(f"{what}: rank {bad} announced {sizes[bad]} bytes (at most {max_bytes} allowed)")
    return sizes


def _padded(data: bytes, longest: int, device: torch.device) -> torch.Tensor:
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    return mine


def all_gather_bytes(data: bytes, group: Optional[dist.ProcessGroup] = None, what: str = "a message",
                     max_bytes: int = MAX_STATE_BYTES) -> List[bytes]:
    """Every rank's byte message, by rank in ``group``, on every rank (the lengths, then the
    payloads padded to the longest; a length above ``max_bytes`` is refused on every rank, naming
    its sender, before anything that long is allocated)."""
    device = wire_device(group)
    sizes = _lengths(data, group, what, max_bytes, device)
    longest = max(sizes)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(out, _padded(data, longest, device), group=group)
    return [_bytes_of(t[:s]) for t, s in zip(out, sizes)]


def gather_bytes(data: bytes, dst: int, group: Optional[dist.ProcessGroup] = None, what: str = "a message",
                 max_bytes: int = MAX_STATE_BYTES) -> Optional[List[bytes]]:
    """Every rank's byte message on group rank ``dst`` (by rank; None elsewhere). The lengths travel
    to every rank (an all-gather), so all of them pad alike and refuse an oversized one alike."""
    device = wire_device(group)
    sizes = _lengths(data, group, what, max_bytes, device)
    longest = max(sizes)
    mine = _padded(data, longest, device)
    if dist.get_rank(group) != dst:
        dist.gather(mine, None, dst=_global(dst, group), group=group)
        return None
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.gather(mine, out, dst=_global(dst, group), group=group)
    return [_bytes_of(t[:s]) for t, s in zip(out, sizes)]


def encode_state(state: Any) -> bytes:
    """A state of tensors and plain containers as bytes (``torch.save``'s format)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def decode_state(data: bytes, what: str, map_location: Any = None) -> Any:
    """Load :func:`encode_state` with ``weights_only=True`` (no code of the sender runs);
    :class:`MalformedMessageError` naming ``what`` if the bytes are not such a state."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several types for bad or unsafe payloads
        raise MalformedMessageError(f"{what}: not a plain-data state ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); decentpy loads states "
                                    "with weights_only=True and never runs code from another process") from None


def send_bytes(data: bytes, dst: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Send one message to rank ``dst`` (of ``group``): its length, then its bytes."""
    device = wire_device(group)
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=device), dst=_global(dst, group), group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst=_global(dst, group),
                  group=group)


def recv_bytes(src: int, group: Optional[dist.ProcessGroup] = None, what: str = "a message",
               max_bytes: int = MAX_STATE_BYTES) -> bytes:
    """Receive one :func:`send_bytes` message from rank ``src`` (of ``group``), refusing one longer
    than ``max_bytes`` before allocating it."""
    device = wire_device(group)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=_global(src, group), group=group)
    n = int(length.item())
    if not 0 <= n <= max_bytes:
        raise MalformedMessageError(f"{what} from rank {src}: announced {n} bytes (at most {max_bytes} allowed)")
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    dist.recv(buf, src=_global(src, group), group=group)
    return _bytes_of(buf)


def send_state(state: Any, dst: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Send a plain-data state (tensors and containers) to rank ``dst``: :func:`recv_state` loads it
    without running code."""
    send_bytes(encode_state(state), dst, group)


def recv_state(src: int, group: Optional[dist.ProcessGroup] = None, what: str = "a training state",
               map_location: Any = None) -> Any:
    """The state :func:`send_state` sent from rank ``src``, loaded with ``weights_only=True``."""
    return decode_state(recv_bytes(src, group, what), f"{what} from rank {src}", map_location)


def _bytes_of(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor (copied to the host; no numpy needed)."""
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def _global(rank: int, group: Optional[dist.ProcessGroup]) -> int:
    """``dist.send`` / ``recv`` take global ranks even with a group."""
    return rank if group is None else dist.get_global_rank(group, rank)

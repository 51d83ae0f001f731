"""Admission by a job secret: the one place that signs and checks what elastic members rely on.

Without it, anyone who can reach the rendezvous store can register as a member, receive a
neighbour's model and optimizer state and send its own parameters into the mix, or write a record
that evicts a member. With a secret (``ElasticGossip(secret=...)`` or ``DECENTPY_JOB_SECRET``) the
members admit only processes that hold it. Standard library only: :mod:`hmac` (SHA-256),
:mod:`secrets`, :func:`hmac.compare_digest`; nothing home-made.

**The job key.** ``K = HMAC-SHA256(secret, "decentpy/elastic job key v1" | job)``: one key per job
name, so a record of one job is not valid in another job sharing the secret. Every MAC below is
``HMAC-SHA256(K, part | part | ...)`` over length-prefixed parts (no two sequences of parts encode
alike).

**The job's namespace.** Every membership key lives under ``decentpy/elastic/<job>/k-<N>/`` with
``N = HMAC(K, "namespace")`` (128 bits, hex): a process without the secret cannot name any of them,
so it can neither overwrite a member's record (which could evict it), squat a key whose first
writer wins (``compare_set`` of an epoch's member list), bump a private counter, nor find the
process groups' rendezvous keys (under it too, see :meth:`JobKey.group_suffix`).

**Records.** Every value the members rely on is signed: ``hmac-sha256:<64 hex>:<payload>`` whose
tag is ``HMAC(K, "record", store key, context, payload)``. The store key is the full key (job
prefix included), so a record cannot be moved to another key or job; ``context`` is the job
*instance*'s nonce for records that must be fresh (below). A record that is not signed, or is
signed with another key, is ignored (:meth:`JobKey.verify` returns None).

**Freshness.** The first epoch's decider draws a random nonce (:func:`secrets.token_hex`) and
writes it, signed, as the job instance's ``instance`` record before the first member list. A
joiner's request ``join/<slot>`` is signed with that nonce as context (and its slot in the key),
as are member lists, announcements, leave, admitted and refused records: a request sniffed in an
earlier instance of the job (same secret, same job name) is not valid in this one, and within one
instance a slot is written once (a replay of it is the record already there).

**Each process group is authenticated.** After every epoch's ``init_process_group``,
:func:`handshake` runs a challenge-response over the new group: every rank contributes a fresh
32-byte nonce (all-gathered), then sends ``HMAC(K, "handshake", epoch, its rank, its member id,
instance nonce, all nonces)``; every rank checks every other's with :func:`hmac.compare_digest`.
A rank whose tag is wrong is named and left out: the others re-form without it.

**Outsiders.** A process without the secret (or with another one) posts its request where the
old, unauthenticated protocol did (``decentpy/elastic/<job>/join/<slot>``, the *public* area);
the members read those requests only to name them once in their logs at WARNING and to answer
with a signed ``refused/<id>`` record, from which that process raises
:class:`~decentpy.elastic.AdmissionError`. Public values are read without blocking and parsed as
untrusted text; a public counter is never ``add``-ed to by a member (a value that is not a number
makes the store drop that client's connection).

What this does not protect (docs/security.md): the traffic itself (neither encrypted nor
integrity-protected per message; an on-path attacker sees the namespace and can alter tensors),
a member holding the secret (it is inside), and the store's availability (an outsider can fill or
delete public keys, bump public counters: a bounded delay, never a change of membership).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["SECRET_ENV", "JobKey", "resolve_secret", "handshake", "new_instance_nonce", "describe_untrusted",
           "NONCE_BYTES"]

#: the environment variable a job secret may come from (``ElasticGossip(secret=)`` wins)
SECRET_ENV = "DECENTPY_JOB_SECRET"
#: bytes of each rank's handshake nonce
NONCE_BYTES = 32
_RECORD = "hmac-sha256"
_TAG_HEX = 64


def resolve_secret(secret: Union[None, bytes, str]) -> Optional[bytes]:
    """The job secret as bytes: ``secret`` if given, else :data:`SECRET_ENV` from the environment,
    else None (an unauthenticated job). A str is taken as UTF-8."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes or str (e.g. secrets.token_hex(32)), got {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty; use e.g. secrets.token_hex(32), the same on every worker "
                         f"(or leave it unset, and {SECRET_ENV} unset, for a job without admission)")
    return bytes(secret)


def _encode(parts: Sequence[bytes]) -> bytes:
    """Length-prefixed parts: no two different sequences encode alike."""
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def new_instance_nonce() -> str:
    """A job instance's nonce (128 random bits, hex)."""
    return secrets.token_hex(16)


class JobKey:
    """The job's key, derived from the secret and the job name; signs and checks records and runs
    the handshake's MACs. Holds no secret in its repr."""

    def __init__(self, secret: bytes, job: str) -> None:
        self._key = hmac.new(bytes(secret), _encode([b"decentpy/elastic job key v1", job.encode("utf-8")]),
                             hashlib.sha256).digest()
        self.namespace = "k-" + self.mac(b"namespace").hex()[:32]

    def __repr__(self) -> str:
        return "JobKey(<hidden>)"

    def mac(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, _encode(parts), hashlib.sha256).digest()

    def sign(self, store_key: str, payload: str, context: bytes = b"") -> str:
        """The signed value of ``payload`` stored at ``store_key`` (the full key)."""
        tag = self.mac(b"record", store_key.encode("utf-8"), context, payload.encode("utf-8"))
        return f"{_RECORD}:{tag.hex()}:{payload}"

    def verify(self, store_key: str, value: bytes, context: bytes = b"") -> Optional[str]:
        """The payload of a value signed by :meth:`sign` for ``store_key`` (and ``context``), or
        None if it is not signed, signed for another key or context, or signed with another key."""
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
        kind, _, rest = text.partition(":")
        tag_hex, sep, payload = rest.partition(":")
        if kind != _RECORD or not sep or len(tag_hex) != _TAG_HEX:
            return None
        try:
            tag = bytes.fromhex(tag_hex)
        except ValueError:
            return None
        want = self.mac(b"record", store_key.encode("utf-8"), context, payload.encode("utf-8"))
        return payload if hmac.compare_digest(tag, want) else None

    def group_suffix(self, epoch: int, context: bytes) -> str:
        """The secret-derived name of epoch ``epoch``'s process-group keys in the store."""
        return self.mac(b"process group", str(epoch).encode(), context).hex()[:32]

    def handshake_tag(self, epoch: int, rank: int, member_id: str, context: bytes, nonces: bytes) -> bytes:
        return self.mac(b"handshake", str(epoch).encode(), str(rank).encode(), member_id.encode("utf-8"), context,
                        nonces)


def describe_untrusted(value: bytes, limit: int = 80) -> str:
    """A value from an untrusted record as printable text for a log line: a signature prefix
    dropped, control characters replaced, at most ``limit`` characters."""
    text = value.decode("utf-8", errors="replace")
    kind, _, rest = text.partition(":")
    if kind == _RECORD and rest[_TAG_HEX:_TAG_HEX + 1] == ":":
        text = rest[_TAG_HEX + 1:]
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _gather_bytes(data: bytes, group: Optional[dist.ProcessGroup]) -> list:
    """Every rank's ``data`` (all of length ``len(data)``), by rank: one all-gather of uint8 tensors."""
    n = dist.get_world_size(group)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(len(data), dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.tolist()) for t in out]


def handshake(key: JobKey, epoch: int, members: Sequence[str], rank: int, context: bytes,
              group: Optional[dist.ProcessGroup] = None) -> list:
    """The challenge-response of a new process group (see the module): two all-gathers over
    ``group`` (gloo, CPU tensors). Returns the ranks whose answer is wrong (the same on every honest
    rank: each checks the same gathered bytes); empty when every rank holds the job key."""
    n = dist.get_world_size(group)
    if n != len(members):
        raise ValueError(f"handshake: a group of {n} ranks for {len(members)} members {list(members)}")
    nonce = secrets.token_bytes(NONCE_BYTES)
    nonces = _gather_bytes(nonce, group)
    bad = []
    joined = b"".join(nonces)
    tags = _gather_bytes(key.handshake_tag(epoch, rank, members[rank], context, joined), group)
    for r in range(n):
        if r != rank and not hmac.compare_digest(tags[r], key.handshake_tag(epoch, r, members[r], context, joined)):
            bad.append(r)
    return bad

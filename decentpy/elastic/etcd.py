"""The rendezvous in an etcd cluster, for jobs where no single host may be trusted to stay up.

torch ships a c10d Store over etcd (``torch.distributed.elastic.rendezvous.etcd_store.EtcdStore``,
the one torchelastic's etcd rendezvous uses, on the etcd v2 API through the ``python-etcd``
client). Its Store API lacks the two operations decentpy's membership needs besides ``set``,
``get``, ``add`` and ``check``: ``compare_set`` (the first proposal of an epoch's member list wins)
and ``delete_key`` (a replacement reusing an id clears the old one's marks). :class:`EtcdRendezvousStore`
adds them on etcd's own atomic operations (create-if-absent and compare-and-swap), nothing else.

The etcd server must serve the v2 API: ``etcd --enable-v2`` (etcd 3.4; Debian's ``etcd-server``).
Over a network you do not trust, serve it with TLS and authentication and pass them here:
``connect_etcd(..., protocol="https", ca_cert=..., cert=(cert, key), username=..., password=...)``
(python-etcd's own options, passed through; docs/security.md).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Optional, Tuple, Union

from .etcd_v3 import tls_options
from .membership import RendezvousError

__all__ = ["EtcdRendezvousStore", "connect_etcd"]

logger = logging.getLogger(__name__)

try:  # torch's store and the client it is written for; both optional until an etcd store is asked for
    import etcd as _etcd  # type: ignore[import-not-found]
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as _EtcdStore
except ImportError:  # pragma: no cover - depends on the environment
    _etcd = None
    _EtcdStore = object


def _missing_client() -> RendezvousError:
    return RendezvousError("an etcd rendezvous needs the python-etcd client (pip install python-etcd), which torch's "
                           "EtcdStore is written for")


class EtcdRendezvousStore(_EtcdStore):  # type: ignore[misc,valid-type]
    """torch's ``EtcdStore`` plus ``compare_set`` and ``delete_key`` (see the module)."""

    def compare_set(self, key: str, expected_value: Union[str, bytes], desired_value: Union[str, bytes]) -> bytes:
        """c10d's semantics: store ``desired_value`` if the key holds ``expected_value`` (or is absent
        and ``expected_value`` is empty); return the value the key holds afterwards (``expected_value``
        when it is absent and was not created)."""
        path = self.prefix + self._encode(key)
        desired = self._encode(desired_value)
        expected = self._encode(expected_value)
        try:
            if expected == "":
                node = self.client.write(key=path, value=desired, prevExist=False)
            else:
                node = self.client.test_and_set(key=path, value=desired, prev_value=expected)
            return self._decode(node.value)
        except (_etcd.EtcdAlreadyExist, _etcd.EtcdCompareFailed):
            return self._decode(self.client.get(key=path).value)
        except _etcd.EtcdKeyNotFound:
            return self._decode(expected)

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        try:
            self.client.delete(key=self.prefix + self._encode(key))
            return True
        except _etcd.EtcdKeyNotFound:
            return False


def connect_etcd(endpoint: str = "127.0.0.1:2379", prefix: str = "/decentpy",
                 timeout: datetime.timedelta = datetime.timedelta(seconds=30), protocol: str = "http",
                 ca_cert: Optional[str] = None, cert: Union[None, str, Tuple[str, str]] = None,
                 username: Optional[str] = None, password: Optional[str] = None) -> Any:
    """A store on the etcd cluster at ``endpoint`` (``host:port``), under the key ``prefix``; pass it as
    ``ElasticGossip(store=...)``. :class:`RendezvousError` if etcd cannot be reached (or does not
    serve the v2 API) within ``timeout``; every later store wait is bounded by it too.

    TLS and authentication (python-etcd's ``Client`` options, passed through): ``protocol='https'``;
    ``ca_cert``: the CA file that signed the server's certificate (verified when given);
    ``cert``: this client's certificate, a PEM file holding certificate and key or a pair
    ``(certificate file, key file)``; ``username`` and ``password``: etcd's authentication (both)."""
    options = tls_options(protocol, ca_cert, cert, username, password)
    if _etcd is None:
        raise _missing_client()
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"endpoint must be 'host:port', got {endpoint!r}")
    client = _etcd.Client(host=host, port=int(port), read_timeout=max(1, int(timeout.total_seconds())), **options)
    try:
        client.read("/")
    except Exception as exc:  # noqa: BLE001 - refused, timed out, no v2 API, or TLS / authentication refused
        raise RendezvousError(f"cannot reach etcd at {protocol}://{endpoint} through its v2 API "
                              f"({str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); start etcd "
                              "with --enable-v2 (etcd 3.4), and check the TLS and authentication options") from exc
    return EtcdRendezvousStore(client, prefix, timeout)

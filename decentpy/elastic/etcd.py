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
import os
from typing import Any, Optional, Tuple, Union

from .membership import RendezvousError

__all__ = ["EtcdRendezvousStore", "connect_etcd", "tls_options"]

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


def tls_options(protocol: str, ca_cert: Optional[str], cert: Union[None, str, Tuple[str, str]],
                 username: Optional[str], password: Optional[str]) -> dict:
    """python-etcd's ``Client`` keywords for TLS and authentication, checked: ValueError naming
    what is wrong and what would be valid."""
    if protocol not in ("http", "https"):
        raise ValueError(f"protocol must be 'http' or 'https', got {protocol!r}")
    if protocol == "http" and (ca_cert is not None or cert is not None):
        raise ValueError("ca_cert= and cert= need protocol='https' (TLS); with protocol='http' etcd's traffic is "
                         "plain text and no certificate is used")
    if isinstance(cert, (tuple, list)):
        if len(cert) != 2 or not all(isinstance(c, str) and c for c in cert):
            raise ValueError(f"cert must be a file name (certificate and key in one PEM file) or a pair (certificate "
                             f"file, key file), got {cert!r}")
        cert = (cert[0], cert[1])
    elif cert is not None and not (isinstance(cert, str) and cert):
        raise ValueError(f"cert must be a file name or a pair (certificate file, key file), got {cert!r}")
    files = [("ca_cert", ca_cert)] + ([("cert", c) for c in cert] if isinstance(cert, tuple) else [("cert", cert)])
    for what, path in files:
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{what}: no such file {path!r}")
    if (username is None) != (password is None):
        raise ValueError("etcd authentication needs both username= and password= (python-etcd ignores one alone), "
                         f"got {'username' if username is not None else 'password'} only")
    if username is not None and protocol == "http":
        logger.warning("decentpy.elastic: the etcd password travels in plain text over http; use https "
                       "with ca_cert=")
    if protocol == "https" and ca_cert is None:
        logger.warning("decentpy.elastic: etcd over https without ca_cert=: the server's certificate is checked "
                       "against the system's CAs only (python-etcd does not verify it at all); pass the CA that "
                       "signed it")
    options: dict = {"protocol": protocol}
    if ca_cert is not None:
        options["ca_cert"] = ca_cert
    if cert is not None:
        options["cert"] = cert
    if username is not None:
        options.update(username=username, password=password)
    return options


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

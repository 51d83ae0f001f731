"""The rendezvous in an etcd cluster over etcd's v3 API, through its HTTP/JSON gateway: no client
library.

etcd 3.6 removes the v2 API that torch's ``EtcdStore`` (and :mod:`.etcd`) speak; the v3 API is
served by every etcd 3.4+ as JSON over HTTP (``POST /v3/kv/range``, ``/v3/kv/put``,
``/v3/kv/txn``, ``/v3/kv/deleterange``; keys and values in base64), and the Python etcd3 clients are
unmaintained. :class:`EtcdV3Store` is a c10d ``Store`` on it: ``set``, ``get`` and ``wait`` (blocking
up to the store's timeout), ``add`` and ``compare_set`` (one transaction each: compare the key's
revision or value, then put), ``check``, ``delete_key`` and ``num_keys`` -- what decentpy's elastic
membership and the per-epoch gloo rendezvous use.

TLS: ``https://`` with ``ca_cert`` (the CA that signed the server's certificate; verified) and
``cert`` (a client certificate); etcd's authentication: ``username`` and ``password`` (a token
from ``/v3/auth/authenticate``, renewed when etcd says it expired).
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from .membership import RendezvousError

__all__ = ["EtcdV3Store", "connect_etcd_v3", "tls_options"]

logger = logging.getLogger(__name__)

_POLL_S = (0.005, 0.1)  # a wait's first and longest sleep between two reads


def _b64(data: Union[str, bytes]) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range that holds every key starting with ``prefix`` (etcd's prefix rule)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[:i + 1])
    return b"\0"


class EtcdV3Store(dist.Store):
    """A c10d Store in etcd through the v3 HTTP/JSON gateway (see the module). Build it with
    :func:`connect_etcd_v3`."""

    def __init__(self, url: str, prefix: str, timeout: datetime.timedelta, context: Optional[ssl.SSLContext] = None,
                 credentials: Optional[Tuple[str, str]] = None) -> None:
        super().__init__()  # (the pybind trampoline)
        self.url = url.rstrip("/")
        self.prefix = prefix.encode() if prefix.endswith("/") else (prefix + "/").encode()
        self._context = context
        self._credentials = credentials
        self._token: Optional[str] = None
        self.set_timeout(timeout)
        if credentials is not None:
            self._authenticate()

    # -- the gateway ---------------------------------------------------------------------------
    def _post(self, path: str, body: Dict[str, Any], retry_auth: bool = True) -> Dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": self._token} if self._token else {})})
        try:
            with urllib.request.urlopen(req, timeout=max(1.0, self.timeout.total_seconds()),
                                        context=self._context) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            if retry_auth and self._credentials is not None and "token" in detail.lower():
                self._authenticate()  # (an expired token: one retry with a fresh one)
                return self._post(path, body, retry_auth=False)
            raise RendezvousError(f"etcd at {self.url} refused {path}: HTTP {exc.code} {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise RendezvousError(f"cannot reach etcd at {self.url} ({exc})") from exc

    def _authenticate(self) -> None:
        assert self._credentials is not None
        name, password = self._credentials
        self._token = None
        reply = self._post("/v3/auth/authenticate", {"name": name, "password": password}, retry_auth=False)
        token = reply.get("token")
        if not token:
            raise RendezvousError(f"etcd at {self.url} gave no token for user {name!r}: {reply}")
        self._token = token

    def _key(self, key: Union[str, bytes]) -> bytes:
        return self.prefix + (key.encode() if isinstance(key, str) else bytes(key))

    def _range(self, key: bytes) -> Optional[Dict[str, Any]]:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        return kvs[0] if kvs else None

    def _txn(self, compare: Dict[str, Any], put: Dict[str, Any], key: bytes) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """``if compare then put``; (whether it succeeded, the key's entry afterwards)."""
        reply = self._post("/v3/kv/txn", {
            "compare": [compare], "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": _b64(key)}}]})
        ok = bool(reply.get("succeeded"))
        if ok:
            return True, None
        kvs = (((reply.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or [])
        return False, kvs[0] if kvs else None

    # -- the c10d Store --------------------------------------------------------------------------
    def set(self, key: Union[str, bytes], value: Union[str, bytes]) -> None:
        self._post("/v3/kv/put", {"key": _b64(self._key(key)), "value": _b64(value)})

    def get(self, key: Union[str, bytes]) -> bytes:
        """The value, waiting up to the store's timeout for the key to appear (``LookupError`` then,
        as torch's stores)."""
        self.wait([key])
        kv = self._range(self._key(key))
        if kv is None:
            raise LookupError(f"key {key!r} was deleted while it was read from etcd")
        return _unb64(kv.get("value", ""))

    def add(self, key: Union[str, bytes], num: int) -> int:
        """Atomically add ``num`` to the decimal integer at ``key`` (0 when absent); the new value."""
        k = self._key(key)
        b64 = _b64(k)
        while True:
            kv = self._range(k)
            if kv is None:
                new = int(num)
                compare = {"key": b64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            else:
                new = int(_unb64(kv.get("value", "")) or b"0") + int(num)
                compare = {"key": b64, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
            ok, _ = self._txn(compare, {"key": b64, "value": _b64(str(new))}, k)
            if ok:
                return new
            time.sleep(0.001)  # (another writer came between: read again)

    def compare_set(self, key: Union[str, bytes], expected_value: Union[str, bytes],
                    desired_value: Union[str, bytes]) -> bytes:
        """c10d's semantics: store ``desired_value`` if the key holds ``expected_value`` (or is absent
        and ``expected_value`` is empty); the value the key holds afterwards (``expected_value`` when
        it is absent and was not created)."""
        k = self._key(key)
        b64 = _b64(k)
        expected = expected_value.encode() if isinstance(expected_value, str) else bytes(expected_value)
        desired = desired_value.encode() if isinstance(desired_value, str) else bytes(desired_value)
        if not expected:
            compare = {"key": b64, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            compare = {"key": b64, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        ok, kv = self._txn(compare, {"key": b64, "value": _b64(desired)}, k)
        if ok:
            return desired
        return _unb64(kv.get("value", "")) if kv is not None else expected

    def check(self, keys: Sequence[Union[str, bytes]]) -> bool:
        return all(self._range(self._key(k)) is not None for k in keys)

    def wait(self, keys: Sequence[Union[str, bytes]],
             override_timeout: Optional[datetime.timedelta] = None) -> None:
        """Until every key is there, or the timeout (``LookupError``, as torch's stores)."""
        limit = (override_timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = _POLL_S[0]
        missing: List[Union[str, bytes]] = list(keys)
        while True:
            missing = [k for k in missing if self._range(self._key(k)) is None]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise LookupError(f"timed out after {limit:g} s waiting for the keys {missing[:3]} in etcd at "
                                  f"{self.url}")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])

    def delete_key(self, key: Union[str, bytes]) -> bool:
        reply = self._post("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        reply = self._post("/v3/kv/range", {"key": _b64(self.prefix), "range_end": _b64(_range_end(self.prefix)),
                                            "count_only": True})
        return int(reply.get("count", 0))


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


def connect_etcd_v3(endpoint: str = "http://127.0.0.1:2379", prefix: str = "/decentpy",
                    timeout: datetime.timedelta = datetime.timedelta(seconds=30), ca_cert: Optional[str] = None,
                    cert: Union[None, str, Tuple[str, str]] = None, username: Optional[str] = None,
                    password: Optional[str] = None) -> EtcdV3Store:
    """A store on the etcd cluster at ``endpoint`` (``http[s]://host:port``, or ``host:port`` for
    http) through its v3 API, under the key ``prefix``; pass it as ``ElasticGossip(store=...)``.
    :class:`RendezvousError` if etcd cannot be reached within ``timeout``; every later wait is bounded
    by it too. No client library: etcd 3.4+ serves the v3 API as JSON over HTTP."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rstrip("/").rpartition(":")
    if scheme not in ("http", "https") or not host or not port.isdigit():
        raise ValueError(f"endpoint must be 'host:port' or 'http[s]://host:port', got {endpoint!r}")
    options = tls_options(scheme, ca_cert, cert, username, password)
    context = None
    if scheme == "https":
        context = ssl.create_default_context(cafile=options.get("ca_cert"))
        pair = options.get("cert")
        if isinstance(pair, tuple):
            context.load_cert_chain(pair[0], pair[1])
        elif pair is not None:
            context.load_cert_chain(pair)
    store = EtcdV3Store(url, prefix, timeout, context, (username, password) if username is not None else None)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            store.num_keys()  # (a read through the gateway: reachable, v3 served, authorised)
            return store
        except RendezvousError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"cannot reach etcd's v3 API at {url} within {timeout.total_seconds():g} s "
                                      f"({exc})") from exc
            time.sleep(0.2)


def create_rdzv_handler(params: Any) -> Any:
    """torchrun's dynamic rendezvous (the ``c10d`` backend's state machine) on an etcd cluster through
    its v3 API: ``torchrun --rdzv-backend=decentpy-etcd-v3 --rdzv-endpoint=HOST:PORT`` (or
    ``https://HOST:PORT``; ``--rdzv-conf`` may name ``ca_cert``, ``cert``, ``key``, ``username``,
    ``password``, ``read_timeout``). Registered for torchrun through the ``torchrun.handlers`` entry point."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    if not params.endpoint:
        raise ValueError("--rdzv-backend=decentpy-etcd-v3 needs --rdzv-endpoint=HOST:PORT (an etcd client URL)")
    cert: Union[None, str, Tuple[str, str]] = params.get("cert")
    if cert is not None and params.get("key"):
        cert = (cert, params.get("key"))
    store = connect_etcd_v3(params.endpoint, prefix=f"/torchrun/{params.run_id}",
                            timeout=datetime.timedelta(seconds=params.get_as_int("read_timeout", 60)),
                            ca_cert=params.get("ca_cert"), cert=cert, username=params.get("username"),
                            password=params.get("password"))
    class EtcdV3Backend(C10dRendezvousBackend):
        """c10d's rendezvous state on the etcd store, under this backend's name (torch checks it)."""

        @property
        def name(self) -> str:
            return "decentpy-etcd-v3"

    return create_handler(store, EtcdV3Backend(store, params.run_id), params)


def torchrun_handler() -> Any:
    """The ``torchrun.handlers`` entry point: the creator torch registers under ``decentpy-etcd-v3``."""
    return create_rdzv_handler

"""Admission by a job secret (decentpy.elastic.auth, docs/security.md): nobody uninvited joins an
elastic job, no peer runs code on another, a joiner that disagrees is refused and the job goes on.

The multi-process scenario is one spawn (three members, an outsider, two joiners), checked against
the float64 re-computation of plain gossip (tests/test_elastic.py's), so that "the outsider changed
nothing" means "the members' parameters are those of a run without it".
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import logging
import os
import pickle
import threading
import time
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_workers
from reference import batch, loss_fn, make_mlp
from test_elastic import LR, _gossip_reference, _params64, _wait_all_done, run_members

SECRET = "a job secret for the tests: 5b1e0c"
PUBLIC = "decentpy/elastic/default/"
OUTSIDER, REFUSED, JOINER = 10, 3, 4
HOLD_OUTSIDER, HOLD_REFUSED, HOLD_JOIN, END = 4, 6, 10, 13


class _Logs(logging.Handler):
    """Every WARNING (and above) of decentpy's loggers in this process, as text."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: List[str] = []
        logging.getLogger("decentpy").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _sgd(lr: float) -> Any:
    return lambda named: torch.optim.SGD([p for _, p in named], lr=lr)


def _elastic(model: Any, store: Any, member: str, lr: float = LR, **kwargs: Any) -> Any:
    from decentpy.elastic import ElasticGossip

    options = dict(topology="ring", store=store, member_id=member, initial_workers=3,
                   timeout=datetime.timedelta(seconds=30), peer_liveness_timeout=datetime.timedelta(seconds=4),
                   reform_timeout=datetime.timedelta(seconds=10), bucket_size_in_mb=0.0002)
    options.update(kwargs)
    return ElasticGossip(model, _sgd(lr), **options)


def _await_count(store: Any, key: str, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(store.add(key, 0)) < n:
        assert time.monotonic() < deadline, f"{key} never reached {n}"
        time.sleep(0.05)


def member_worker(member: int, port: int) -> Dict[str, Any]:
    """Members 0-2 (with the secret) train; they stand still at HOLD_OUTSIDER until the outsider is
    done, at HOLD_REFUSED until the joiner with another lr was refused, at HOLD_JOIN until the
    joiner with the right settings is in (applying changes meanwhile, as a training loop's
    update() does). They record their parameters at each hold and at every membership change."""
    from decentpy.elastic import connect

    logs = _Logs()
    store = connect("127.0.0.1", port, timeout=datetime.timedelta(seconds=20))
    model = make_mlp(0)
    changes: Dict[int, Any] = {}

    def on_change(c: Any) -> None:
        changes[c.epoch] = {"members": c.members, "step": c.step, "joined": c.joined, "left": c.left,
                            "params": _params64(model)}

    eg = _elastic(model, store, str(member), secret=SECRET, on_membership_change=on_change)
    store.add("test/training", 1)
    held: Dict[int, Any] = {}
    longest = 0.0  # the longest single update() + step of this member (holds excluded)
    while eg.step_count < END:
        t0 = time.monotonic()
        eg.update()
        k = eg.step_count
        waiting = ((k == HOLD_OUTSIDER and not store.check(["test/outsider_done"]))
                   or (k == HOLD_REFUSED and not store.check(["test/refused_done"]))
                   or (k == HOLD_JOIN and str(JOINER) not in eg.members))
        if k in (HOLD_OUTSIDER, HOLD_REFUSED, HOLD_JOIN) and k not in held:  # (the joiners start once all are here)
            held[k] = {"params": _params64(model), "epoch": eg.epoch, "members": eg.members}
            store.add(f"test/hold{k}", 1)
        if waiting:
            longest = max(longest, time.monotonic() - t0)
            time.sleep(0.02)
            continue
        x, y = batch(member, k)
        loss_fn(eg(x), y).backward()
        longest = max(longest, time.monotonic() - t0)
    eg.ddp.wait()
    _wait_all_done(store, "test/done", 4)
    return {"held": held, "changes": changes, "final": _params64(model), "members": eg.members,
            "logs": logs.lines, "longest_s": longest, "epochs": [c.epoch for c in eg.history]}


def outsider_worker(member: int, port: int) -> Dict[str, Any]:
    """Knows the store's host:port and the job's name, not its secret: forges the records of the
    unauthenticated layout (leave, member list, current epoch, a ghost join with heartbeats),
    then asks to join as an ElasticGossip without a secret and with a wrong one, then breaks the
    public counter; last, a job of its own without a secret (one warning per process)."""
    from decentpy.elastic import AdmissionError, connect

    logs = _Logs()
    store = connect("127.0.0.1", port, timeout=datetime.timedelta(seconds=20))
    while int(store.add("test/training", 0)) < 3:
        time.sleep(0.05)
    for m in ("0", "1", "2"):
        store.set(PUBLIC + f"leave/{m}", "1")
    store.set(PUBLIC + "epoch2/members", "0|0,1,ghost")
    store.set(PUBLIC + "current", "2")
    store.add(PUBLIC + "epoch2/announced", 1)
    store.set(PUBLIC + "node/ghost", "ghost")
    slot = int(store.add(PUBLIC + "joins", 1))
    store.set(PUBLIC + f"join/{slot}", "ghost")
    store.add(PUBLIC + "changes", 1)
    errors: Dict[str, Any] = {}
    stop = threading.Event()

    def ghost_beats() -> None:
        while not stop.wait(0.5):
            store.add(PUBLIC + "beat/ghost", 1)

    beating = threading.Thread(target=ghost_beats, daemon=True)
    beating.start()
    for name, secret in (("intruder", None), ("impostor", "not the job's secret")):
        t0 = time.monotonic()
        try:
            _elastic(make_mlp(0), store, name, secret=secret, timeout=datetime.timedelta(seconds=20))
            errors[name] = None
        except AdmissionError as exc:
            errors[name] = (type(exc).__name__, str(exc), time.monotonic() - t0)
    store.set(PUBLIC + "joins", "not a number")  # a counter every client adds to: members must not
    time.sleep(1.5)
    stop.set()
    beating.join()
    solo = _elastic(make_mlp(0), store, "solo", job="solo", initial_workers=1)
    x, y = batch(0, 0)
    loss_fn(solo(x), y).backward()
    solo.close()
    store.set("test/outsider_done", "1")
    return {"errors": errors, "logs": logs.lines}


def joiner_worker(member: int, port: int) -> Dict[str, Any]:
    """Member 3: the secret, but lr 0.2 (refused); member 4: the secret and the members' settings
    (admitted, receives its neighbour's state, trains on)."""
    from decentpy.elastic import JoinRefusedError, connect

    logs = _Logs()
    store = connect("127.0.0.1", port, timeout=datetime.timedelta(seconds=20))
    if member == REFUSED:
        _await_count(store, f"test/hold{HOLD_REFUSED}", 3)
        try:
            _elastic(make_mlp(member), store, str(member), lr=0.2, secret=SECRET)
            return {"error": None}
        except JoinRefusedError as exc:
            store.set("test/refused_done", "1")
            return {"error": (type(exc).__name__, str(exc), exc.setting), "logs": logs.lines}
    _await_count(store, f"test/hold{HOLD_JOIN}", 3)
    model = make_mlp(member)  # its own initial values must not matter
    at: Dict[str, Any] = {}

    def on_change(c: Any) -> None:
        at.update(epoch=c.epoch, step=c.step, members=c.members, params=_params64(model))

    eg = _elastic(model, store, str(member), secret=SECRET, on_membership_change=on_change)
    while eg.step_count < END:
        eg.update()
        x, y = batch(member, eg.step_count)
        loss_fn(eg(x), y).backward()
    eg.ddp.wait()
    _wait_all_done(store, "test/done", 4)
    return {"at": at, "final": _params64(model), "members": eg.members, "step": eg.step_count,
            "logs": logs.lines}


def _scenario(member: int, port: int) -> Dict[str, Any]:
    if member == OUTSIDER:
        return outsider_worker(member, port)
    if member in (REFUSED, JOINER):
        return joiner_worker(member, port)
    return member_worker(member, port)


def _close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    for name, w in want.items():
        assert torch.allclose(got[name], w, rtol=0, atol=1e-6), \
            f"{what}: {name} off by {(got[name] - w).abs().max():.3g}"


def test_outsiders_are_refused_and_a_joiner_that_disagrees_too() -> None:
    from decentpy.topology import make_topology

    t0 = time.monotonic()
    res = run_members(_scenario, [0, 1, 2, OUTSIDER, REFUSED, JOINER], (), timeout=240)
    elapsed = time.monotonic() - t0
    members = [0, 1, 2]
    ring3 = make_topology("ring", 3, 1)
    initial = {str(m): _params64(make_mlp(0)) for m in members}

    # 1. the outsider: refused with a clear error, named by every member, and it changed nothing
    out = res[OUTSIDER]
    for name in ("intruder", "impostor"):
        assert out["errors"][name] is not None, f"{name} was admitted"
        kind, text, took = out["errors"][name]
        assert kind == "AdmissionError" and "not admitted" in text and "job secret" in text, text
        assert took < 20, (name, took)
    assert "none" in out["errors"]["intruder"][1] and "is not the job's" in out["errors"]["impostor"][1]
    assert sum("runs without a job secret" in line for line in out["logs"]) == 1, out["logs"]
    want4 = _gossip_reference(ring3, [[str(m)] for m in members], initial, 0, HOLD_OUTSIDER)
    for m in members:
        r = res[m]
        assert r["held"][HOLD_OUTSIDER]["epoch"] == 1 and r["held"][HOLD_OUTSIDER]["members"] == ("0", "1", "2")
        _close(r["held"][HOLD_OUTSIDER]["params"], want4[m], f"member {m} after the outsider")
        for who in ("intruder", "impostor", "ghost"):
            assert any(f"'{who}' asked to join without the job secret" in line for line in r["logs"]), (who, r["logs"])
        assert not any("runs without a job secret" in line for line in r["logs"])
        assert r["longest_s"] < 15, f"member {m} stalled {r['longest_s']:.1f} s"

    # 2. the joiner with another lr: refused, named with the setting and both values, the members go on
    kind, text, setting = res[REFUSED]["error"]
    assert kind == "JoinRefusedError" and "optimizer" in setting, text
    assert "'lr': 0.1" in text and "'lr': 0.2" in text, text
    for m in members:
        refusal = [line for line in res[m]["logs"] if "refused joiner(s) ['3']" in line]
        assert refusal and "'lr': 0.1" in refusal[0] and "'lr': 0.2" in refusal[0], res[m]["logs"]
    epochs = sorted(res[0]["changes"])
    assert len(epochs) == 2, res[0]["changes"].keys()  # the re-formation without the refused joiner, the admission
    after_refusal, admission = (res[0]["changes"][e] for e in epochs)
    assert after_refusal["members"] == ("0", "1", "2") and after_refusal["step"] == HOLD_REFUSED
    want6 = _gossip_reference(ring3, [[str(m)] for m in members], initial, 0, HOLD_REFUSED)
    start10 = {str(m): res[m]["changes"][epochs[0]]["params"] for m in members}
    want10 = _gossip_reference(ring3, [[str(m)] for m in members], start10, HOLD_REFUSED, HOLD_JOIN)
    for i, m in enumerate(members):
        _close(res[m]["changes"][epochs[0]]["params"], want6[i], f"member {m} at the refusal")
        _close(res[m]["changes"][epochs[1]]["params"], want10[i], f"member {m} at the admission")

    # 3. the joiner with the secret and the members' settings: admitted, its neighbour's state bit for bit
    j = res[JOINER]
    assert admission["members"] == ("0", "1", "2", "4") and admission["joined"] == ("4",), admission
    assert j["at"]["members"] == ("0", "1", "2", "4") and j["step"] == END and j["members"] == admission["members"]
    for name, v in res[2]["changes"][epochs[1]]["params"].items():
        assert torch.equal(j["at"]["params"][name], v), f"{name}: the joiner's state differs from its donor's"
    order = ["0", "1", "2", "4"]
    start = {str(m): res[m]["changes"][epochs[1]]["params"] for m in members}
    start["4"] = j["at"]["params"]
    want = _gossip_reference(make_topology("ring", 4, 1), [[m] for m in order], start, admission["step"], END)
    for i, m in enumerate(order):
        _close((res[int(m)]["final"]), want[i], f"member {m} at the end")
    print(f"\nadmission scenario: {elapsed:.1f} s; outsider refused after "
          f"{', '.join(f'{n} {e[2]:.1f} s' for n, e in out['errors'].items())}")


def test_survivors_go_on_after_a_sigkill_with_a_secret(monkeypatch: Any) -> None:
    """tests/test_elastic.py's SIGKILL scenario (ring, member 2 killed at step 5) with every worker
    holding the secret (from DECENTPY_JOB_SECRET): signed announcements and decisions, a handshake
    per epoch; the survivors end where the float64 re-computation over them does."""
    import test_elastic
    from decentpy.elastic.auth import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, SECRET)
    test_elastic.test_survivors_go_on_after_sigkill("ring", {2: 5})


class _RunsCode:
    """A pickle payload that would create a file if it were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def gloo_worker(rank: int, world_size: int, marker: str) -> Dict[str, Any]:
    """Rank 2 holds another secret: the handshake names it on ranks 0 and 1 (and they it, on
    rank 2); with one key everywhere nobody is named. Then rank 0 sends pickles where rank 1
    expects a joiner's training state."""
    from decentpy.comm import MalformedMessageError
    from decentpy.comm.wire import send_bytes
    from decentpy.elastic.auth import JobKey, handshake
    from decentpy.elastic.membership import Formation
    from decentpy.elastic.wrapper import ElasticGossip

    members = ["a", "b", "c"]
    good = JobKey(SECRET.encode(), "default")
    out: Dict[str, Any] = {"same": handshake(good, 2, members, rank, b"nonce")}
    key = good if rank < 2 else JobKey(b"another secret", "default")
    out["one_other"] = handshake(key, 3, members, rank, b"nonce")
    errors = []
    for payload in (pickle.dumps({"model": _RunsCode(marker)}), _torch_save_with_code(marker)):
        if rank == 0:
            send_bytes(payload, dst=1)
        elif rank == 1:
            try:
                ElasticGossip._receive_state(None, Formation(4, members, 0), None, 0)  # type: ignore[arg-type]
                errors.append(None)
            except MalformedMessageError as exc:
                errors.append(str(exc))
    out["errors"] = errors
    dist.barrier()
    return out


def _torch_save_with_code(marker: str) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": _RunsCode(marker), "step": 3}, buf)
    return buf.getvalue()


def test_handshake_names_a_rank_without_the_key_and_no_pickle_runs(tmp_path: Any) -> None:
    marker = str(tmp_path / "ran")
    out = run_workers(gloo_worker, 3, marker, timeout=120, pg_timeout_s=60)
    assert [o["same"] for o in out] == [[], [], []]
    assert out[0]["one_other"] == [2] and out[1]["one_other"] == [2] and out[2]["one_other"] == [0, 1]
    assert len(out[1]["errors"]) == 2
    for text in out[1]["errors"]:
        assert text is not None and "member 'a'" in text and "from rank 0" in text and "weights_only" in text, text
    assert not os.path.exists(marker), "a payload from another process ran code"


def test_records_are_bound_to_key_context_and_secret() -> None:
    """The record format of docs/security.md, checked against hmac computed here."""
    from decentpy.elastic.auth import JobKey, describe_untrusted

    def parts(*ps: bytes) -> bytes:
        return b"".join(len(p).to_bytes(8, "big") + p for p in ps)

    key = JobKey(b"s3cret", "job")
    job_key = hmac.new(b"s3cret", parts(b"decentpy/elastic job key v1", b"job"), hashlib.sha256).digest()
    tag = hmac.new(job_key, parts(b"record", b"p/leave/0", b"ctx", b"1"), hashlib.sha256).hexdigest()
    value = key.sign("p/leave/0", "1", b"ctx")
    assert value == f"hmac-sha256:{tag}:1"
    assert key.verify("p/leave/0", value.encode(), b"ctx") == "1"
    assert key.verify("p/leave/1", value.encode(), b"ctx") is None          # moved to another key
    assert key.verify("p/leave/0", value.encode(), b"other") is None        # another job instance
    assert JobKey(b"other", "job").verify("p/leave/0", value.encode(), b"ctx") is None
    assert JobKey(b"s3cret", "job2").verify("p/leave/0", value.encode(), b"ctx") is None
    assert key.verify("p/leave/0", b"1", b"ctx") is None                     # unsigned
    assert key.verify("p/leave/0", value.replace(":1", ":2").encode(), b"ctx") is None
    assert key.verify("p/leave/0", b"\xff\xfe", b"ctx") is None
    assert key.namespace == "k-" + hmac.new(job_key, parts(b"namespace"), hashlib.sha256).hexdigest()[:32]
    assert key.namespace != JobKey(b"other", "job").namespace
    assert describe_untrusted(value.encode()) == "1" and describe_untrusted(b"a\x00b") == "a?b"
    assert "s3cret" not in repr(key)


def test_secret_from_argument_or_environment(monkeypatch: Any) -> None:
    from decentpy.elastic.auth import SECRET_ENV, resolve_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret(None) is None
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert resolve_secret(None) == b"from-env" and resolve_secret(b"arg") == b"arg"
    assert resolve_secret("é") == "é".encode()
    with pytest.raises(ValueError, match="must not be empty"):
        resolve_secret("")
    with pytest.raises(TypeError, match="bytes or str"):
        resolve_secret(123)  # type: ignore[arg-type]


def test_rendezvous_listens_on_loopback_by_default(monkeypatch: Any, capsys: Any) -> None:
    import inspect

    from decentpy.elastic import rendezvous

    assert inspect.signature(rendezvous.serve).parameters["host"].default == "127.0.0.1"
    seen: Dict[str, Any] = {}
    monkeypatch.setattr(rendezvous, "serve", lambda port, host, stop=None: seen.update(port=port, host=host))
    assert rendezvous.main(["--port", "29411"]) == 0 and seen == {"port": 29411, "host": "127.0.0.1"}
    assert rendezvous.main(["--port", "29411", "--host", "0.0.0.0"]) == 0 and seen["host"] == "0.0.0.0"
    monkeypatch.undo()

    stop, ready = threading.Event(), threading.Event()
    server = threading.Thread(target=rendezvous.serve, args=(0,), kwargs=dict(ready=ready, stop=stop), daemon=True)
    server.start()
    assert ready.wait(30)
    printed = capsys.readouterr().out
    port = int(printed.split("listening on 127.0.0.1:")[1].split()[0])
    assert "--host 0.0.0.0" in printed
    try:
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                    listening.append(fields[1].rsplit(":", 1)[0])
        assert listening == ["0100007F"], listening  # 127.0.0.1 only, not 0.0.0.0 or ::
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
        assert client.add("n", 2) == 2
    finally:
        stop.set()
        server.join(timeout=10)


def test_connect_etcd_passes_tls_and_auth_through(monkeypatch: Any, tmp_path: Any) -> None:
    """python-etcd 0.4.5's Client(host, port, ..., protocol, cert, ca_cert, username, password)
    gets the options as given (a fake client here: python-etcd may not be installed)."""
    from decentpy.elastic import RendezvousError, etcd

    calls: List[Dict[str, Any]] = []

    class Refused(Exception):
        pass

    class FakeClient:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(kwargs)

        def read(self, key: str) -> None:
            raise Refused("certificate verify failed")

    class FakeEtcd:
        Client = FakeClient

    monkeypatch.setattr(etcd, "_etcd", FakeEtcd)
    ca, crt, pem = (tmp_path / n for n in ("ca.pem", "client.crt", "client.key"))
    for f in (ca, crt, pem):
        f.write_text("x")
    with pytest.raises(RendezvousError, match="https://etcd:2379.*certificate verify failed"):
        etcd.connect_etcd("etcd:2379", protocol="https", ca_cert=str(ca), cert=(str(crt), str(pem)),
                          username="job", password="pw", timeout=datetime.timedelta(seconds=5))
    assert calls[-1] == dict(host="etcd", port=2379, read_timeout=5, protocol="https", ca_cert=str(ca),
                             cert=(str(crt), str(pem)), username="job", password="pw")
    with pytest.raises(RendezvousError):
        etcd.connect_etcd("etcd:2379")
    assert calls[-1] == dict(host="etcd", port=2379, read_timeout=30, protocol="http")
    for kwargs, words in [
        (dict(protocol="https", ca_cert=str(tmp_path / "missing.pem")), "no such file"),
        (dict(ca_cert=str(ca)), "need protocol='https'"),
        (dict(protocol="https", cert=(str(crt),)), "a pair"),
        (dict(protocol="https", username="job"), "both username= and password="),
        (dict(protocol="ftp"), "'http' or 'https'"),
    ]:
        with pytest.raises(ValueError, match=words):
            etcd.connect_etcd("etcd:2379", **kwargs)


def test_training_states_round_trip_as_plain_data() -> None:
    """What a joiner receives (encode_state / decode_state: weights_only=True) for the states of
    fused optimizers, LR schedulers, compression, local steps and a GradScaler: loaded, equal."""
    import decentpy.optim as dopt
    from decentpy import DecentralizedDataParallel
    from decentpy.comm.wire import decode_state, encode_state
    from dist_harness import single_process_group

    sgd = _sgd(0.1)
    cases = {
        "fused AdamW, cosine schedule": dict(optim_fn=lambda n: dopt.optim_fn_adamw(n, lr=0.01, weight_decay=0.1),
                                             lr_scheduler_fn=lambda o: dopt.lr_scheduler_fn_cosine_with_warmup(
                                                 o, t_max=20, t_warmup=3)),
        "OneCycleLR": dict(optim_fn=sgd, lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.1, total_steps=50)),
        "int8 compression": dict(optim_fn=sgd, compression="int8"),
        "local steps, int8": dict(optim_fn=sgd, local_steps=2, compression="int8"),
        "GradScaler": dict(optim_fn=sgd, scaler=torch.amp.GradScaler("cpu")),
    }

    def equal(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b or (a != a and b != b)

    with single_process_group("gloo"):
        for name, kwargs in cases.items():
            model = make_mlp(0)
            scaler = kwargs.get("scaler")
            ddp = DecentralizedDataParallel(model, kwargs.pop("optim_fn"), topology="ring", bucket_size_in_mb=0.0002,
                                            **kwargs)
            for k in range(4):
                x, y = batch(0, k)
                loss = loss_fn(ddp(x), y)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            state = ddp.training_state_dict()
            back = decode_state(encode_state(state), name)
            assert equal(state, back), name
            ddp.load_training_state_dict(back)


def test_malformed_peer_reports_are_ignored_not_fatal() -> None:
    """PeerMonitor reads what peers posted in the store as untrusted text."""
    from decentpy.comm.failures import PeerMonitor

    store = dist.HashStore()
    monitor = PeerMonitor(store, 0)
    try:
        store.set("decentpy/peers/error/1", "1,x,\x00|PeerUnreachableError: gone")
        store.set("decentpy/peers/error/2", "3|a message")
        store.add("decentpy/peers/errors", 2)
        assert monitor.reports([0, 1, 2]) == {1: ([], "PeerUnreachableError: gone"), 2: ([3], "a message")}
        store.add("decentpy/peers/notice/1/n", 2)  # counted twice, written once: never waited for
        store.set("decentpy/peers/notice/1/1", "skipped \x07 bucket")
        store.add("decentpy/peers/notices", 1)
        assert monitor.notices([0, 1], force=True) == [(1, "skipped ? bucket")]
        store.set("decentpy/peers/notice/1/2", "second")
        store.add("decentpy/peers/notices", 1)
        assert monitor.notices([0, 1], force=True) == [(1, "second")]
    finally:
        monitor.stop()

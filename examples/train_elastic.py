"""Elastic gossip training on scikit-learn's digits: a worker is killed, the others go on, a
replacement joins. CPU, gloo; nothing is downloaded.

One command runs the whole scenario on this machine::

    python examples/train_elastic.py                          # 4 workers, kill one, replace it
    python examples/train_elastic.py --workers 4 --steps 400 --kill-after 5 --replace-after 3 \
        --topology one-peer-exp

It starts the rendezvous (the TCPStore the membership lives in, listening on 127.0.0.1 only; in
production ``python -m decentpy.rendezvous --port P --host <private address>`` on a host of its
own) and draws the job's secret, then one process per worker (in production one launch per failure
domain, e.g. per node, pointed at the rendezvous, each with the secret in ``DECENTPY_JOB_SECRET``:
only workers holding it are admitted, docs/security.md), SIGKILLs one
worker ``--kill-after`` seconds in, and starts a replacement ``--replace-after`` seconds later.
Each worker trains a small MLP on its shard of the training set, re-sharded at every membership
change; at the end the members average their models (``global_avg``) and report the test
accuracy.

A worker alone (the job's secret in the environment)::

    DECENTPY_JOB_SECRET=... python examples/train_elastic.py --member 7 --rendezvous HOST:PORT --initial-workers 4
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger("train_elastic")


def digits() -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def worker(args: argparse.Namespace) -> None:
    import decentpy.optim as dopt
    from decentpy.elastic import ElasticGossip, connect

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[member {args.member}] %(message)s")
    host, port = args.rendezvous.rsplit(":", 1)
    store = connect(host, int(port))
    xtr, ytr, xte, yte = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    shard: List[Tensor] = []

    def reshard(rank: int, world_size: int) -> None:
        shard[:] = [torch.arange(rank, len(ytr), world_size)]

    def on_change(change) -> None:  # type: ignore[no-untyped-def]
        reshard(change.rank, change.world_size)
        print(f"[member {args.member}] epoch {change.epoch}: members {list(change.members)}, now rank "
              f"{change.rank}/{change.world_size} from step {change.step} (left {list(change.left)}, joined "
              f"{list(change.joined)}; re-formed in {change.reform_s:.2f} s)", flush=True)

    # the job's secret comes from DECENTPY_JOB_SECRET (ElasticGossip's default; secret= would override it)
    eg = ElasticGossip(model, lambda named: dopt.optim_fn_sgd(named, lr=0.1, momentum=0.9), topology=args.topology,
                       store=store, member_id=str(args.member), initial_workers=args.initial_workers,
                       timeout=datetime.timedelta(seconds=60), peer_liveness_timeout=datetime.timedelta(seconds=5),
                       reform_timeout=datetime.timedelta(seconds=20), on_membership_change=on_change)
    reshard(eg.rank, eg.world_size)
    store.add("example/training", 1)
    g = torch.Generator().manual_seed(args.member)
    loss = torch.tensor(0.0)
    while eg.step_count < args.steps:
        eg.update()
        idx = shard[0][torch.randint(len(shard[0]), (32,), generator=g)]
        loss = F.cross_entropy(eg(xtr[idx]), ytr[idx])
        loss.backward()
        time.sleep(args.step_sleep)  # a stand-in for a real step's compute
    eg.global_avg(will_revert=False)
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    print(f"[member {args.member}] done: step {eg.step_count}, members {list(eg.members)}, last loss {loss.item():.3f}, "
          f"test accuracy of the average {acc:.1f}%", flush=True)
    # a bounded barrier, so that nobody exits while a peer still exchanges with it
    store.add("example/done", 1)
    deadline = time.monotonic() + 30
    while int(store.add("example/done", 0)) < eg.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    eg.close()


def launcher(args: argparse.Namespace) -> int:
    from decentpy.elastic.auth import SECRET_ENV
    from decentpy.elastic.rendezvous import host_store

    store = host_store("127.0.0.1", 0)  # this host only (a plain TCPStore would listen on every interface)
    rdzv = f"127.0.0.1:{store.port}"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env.setdefault(SECRET_ENV, secrets.token_hex(32))  # the job's secret: every worker of the job gets it

    def start(member: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--member", str(member), "--rendezvous", rdzv,
                                 "--initial-workers", str(args.workers), "--steps", str(args.steps),
                                 "--topology", args.topology, "--step-sleep", str(args.step_sleep)], env=env)

    procs = {m: start(m) for m in range(args.workers)}
    while int(store.add("example/training", 0)) < args.workers:  # every worker built its wrapper
        time.sleep(0.1)
    time.sleep(args.kill_after)
    victim = args.workers // 2
    print(f"[launcher] SIGKILL member {victim}", flush=True)
    procs[victim].send_signal(signal.SIGKILL)
    if args.replace_after >= 0:
        time.sleep(args.replace_after)
        print(f"[launcher] starting member {args.workers} as a replacement", flush=True)
        procs[args.workers] = start(args.workers)
    rc = 0
    for m, p in procs.items():
        code = p.wait(timeout=600)
        if m != victim and code not in (0, -signal.SIGABRT):  # SIGABRT: gloo threads at exit (docs/elastic.md)
            rc = 1
    return rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--kill-after", type=float, default=3.0, help="seconds after the start")
    parser.add_argument("--replace-after", type=float, default=2.0, help="seconds after the kill (-1: none)")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--member", type=int, default=None, help="run one worker (with --rendezvous)")
    parser.add_argument("--rendezvous", default=None, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--initial-workers", type=int, default=None)
    args = parser.parse_args()
    if args.member is not None:
        args.initial_workers = args.initial_workers or args.workers
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())

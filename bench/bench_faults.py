"""Training through faults: decentpy's elastic gossip under SIGKILLs, against the same run without faults.

W CPU gloo workers (default 4) train the MLP of ``examples/train_elastic.py`` on scikit-learn's
digits to a fixed number of steps (``--steps``; each step also sleeps ``--step-sleep`` s, a stand-in
for a real model's compute, so that the few cores of a CI machine are not the bottleneck). A fault
injector SIGKILLs a random worker at a random time in every period of ``--kill-every`` s and
starts a replacement ``--replace-after`` s later (the replacement joins the running job and
receives its state from a neighbour). Every topology in ``--topologies`` (AER with 2 workers per node) runs twice with the same
seeds: with faults and without (the floor).

Columns of ``bench/out/bench_faults.csv`` (one row per framework x topology x faults):

- ``goodput_vs_no_faults``: useful steps per second over the whole run relative to the no-fault
  run, i.e. the no-fault wall time over this run's (both train ``--steps`` global steps; a killed
  worker's steps are not redone by anyone, so they are not counted as lost);
- ``max_stall_steps``: the longest time any survivor went without completing a step, in median
  step times (it includes the detection of the dead peer: ~2.5 s plus one heartbeat);
- ``rejoin_s``: from the start of a replacement's process to its first trained step (its import
  of torch and decentpy, the admission at the members' next iteration, the state transfer), mean;
- ``final_loss`` / ``final_accuracy``: test loss and accuracy (percent) of the members' average
  (``global_avg``) at the end;
- ``lost_steps``: global steps trained again (0 for gossip: nothing restarts).

Not yet in it (issue 23 asks for them): torch DDP under the same kills with ``torchrun
--max-restarts`` and checkpoints, and torchft.

    python -m bench.bench_faults                          # ~1-2 minutes on 2 cores
    python -m bench.bench_faults --steps 1500 --kill-every 20 --topologies ring
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "bench" / "out"
COLUMNS = ["framework", "topology", "workers", "kills", "goodput_vs_no_faults", "max_stall_steps", "rejoin_s",
           "final_loss", "final_accuracy", "lost_steps"]


def worker(args: argparse.Namespace) -> None:
    """One elastic worker: trains to --steps, logs (wall time, step, loss) per step as JSON lines."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import decentpy.optim as dopt
    from decentpy.elastic import ElasticGossip, connect
    from examples.train_elastic import digits

    t_start = float(os.environ.get("BENCH_FAULTS_T0", time.time()))
    torch.set_num_threads(1)
    host, port = args.rendezvous.rsplit(":", 1)
    store = connect(host, int(port))
    xtr, ytr, xte, yte = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    shard: List[Any] = [torch.arange(0, len(ytr))]
    log = open(Path(args.log_dir) / f"{args.member}.jsonl", "w", buffering=1)

    def on_change(change: Any) -> None:
        shard[0] = torch.arange(change.rank, len(ytr), change.world_size)
        log.write(json.dumps({"change": change.epoch, "t": time.time(), "members": list(change.members),
                              "reform_s": change.reform_s, "left": list(change.left), "joined": list(change.joined)})
                  + "\n")

    eg = ElasticGossip(model, lambda named: dopt.optim_fn_sgd(named, lr=0.05, momentum=0.9), topology=args.topology,
                       store=store, member_id=str(args.member), initial_workers=args.workers,
                       timeout=datetime.timedelta(seconds=60), peer_liveness_timeout=datetime.timedelta(seconds=5),
                       reform_timeout=datetime.timedelta(seconds=30), on_membership_change=on_change,
                       local_world_size=2 if args.topology == "alternating-exp-ring" else 1)
    shard[0] = torch.arange(eg.rank, len(ytr), eg.world_size)
    store.add("bench/training", 1)
    g = torch.Generator().manual_seed(1000 + args.member)
    first = True
    while eg.step_count < args.steps:
        eg.update()
        idx = shard[0][torch.randint(len(shard[0]), (32,), generator=g)]
        loss = F.cross_entropy(eg(xtr[idx]), ytr[idx])
        loss.backward()
        time.sleep(args.step_sleep)
        log.write(json.dumps({"t": time.time(), "step": eg.step_count, "loss": loss.item(),
                              **({"since_start": time.time() - t_start} if first else {})}) + "\n")
        first = False
    eg.global_avg(will_revert=False)
    with torch.no_grad():
        out = model(xte)
        log.write(json.dumps({"final": True, "t": time.time(), "loss": F.cross_entropy(out, yte).item(),
                              "accuracy": (out.argmax(1) == yte).float().mean().item() * 100}) + "\n")
    store.add("bench/done", 1)
    deadline = time.monotonic() + 30
    while int(store.add("bench/done", 0)) < eg.world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    log.close()
    os._exit(0)  # the old epochs' gloo threads: no teardown (docs/elastic.md, limits)


def run(args: argparse.Namespace, topology: str, faults: bool, seed: int) -> Dict[str, Any]:
    """One run; its per-worker logs and the kills, summarised."""
    import torch.distributed as dist

    log_dir = OUT_DIR / "faults" / f"{topology}-{'faults' if faults else 'none'}"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.glob("*.jsonl"):
        f.unlink()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

    def start(member: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "bench.bench_faults", "--worker", "--member", str(member),
                                 "--rendezvous", f"127.0.0.1:{store.port}", "--workers", str(args.workers),
                                 "--steps", str(args.steps), "--topology", topology, "--step-sleep",
                                 str(args.step_sleep), "--log-dir", str(log_dir)],
                                env=dict(env, BENCH_FAULTS_T0=str(time.time())), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    procs = {m: start(m) for m in range(args.workers)}
    deadline = time.monotonic() + 120
    while int(store.add("bench/training", 0)) < args.workers:
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not start")
        time.sleep(0.05)
    t0 = time.time()
    rng = random.Random(seed)
    kills: List[Dict[str, Any]] = []
    next_member = args.workers
    live = list(procs)
    while any(procs[m].poll() is None for m in live) and int(store.add("bench/done", 0)) < len(live):
        if faults:
            wait = rng.uniform(0.2, 1.0) * args.kill_every
            end = time.monotonic() + wait
            while time.monotonic() < end and any(procs[m].poll() is None for m in live):
                time.sleep(0.05)
            epoch = int(store.get("decentpy/elastic/default/current"))
            members = store.get(f"decentpy/elastic/default/epoch{epoch}/members").decode().partition("|")[2]
            running = [m for m in live if procs[m].poll() is None and str(m) in members.split(",")]
            if len(running) < args.workers:  # a replacement still joining: one fault at a time
                continue
            if int(store.add("bench/done", 0)) > 0:
                continue
            victim = rng.choice(running)
            procs[victim].send_signal(signal.SIGKILL)
            kills.append({"member": victim, "t": time.time() - t0})
            live.remove(victim)
            time.sleep(args.replace_after)
            if int(store.add("bench/done", 0)) == 0:
                procs[next_member] = start(next_member)
                live.append(next_member)
                next_member += 1
        else:
            time.sleep(0.1)
    for m, p in procs.items():
        if p.poll() is None and m not in live:
            p.kill()
    for p in procs.values():
        if p.poll() is None:
            p.wait(timeout=60)
    return summarise(log_dir, t0, kills, args)


def summarise(log_dir: Path, t0: float, kills: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    steps: Dict[str, List[Dict[str, Any]]] = {}
    finals, rejoin, curve = [], [], []
    for f in sorted(log_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        steps[f.stem] = [r for r in rows if "step" in r]
        finals += [r for r in rows if r.get("final")]
        if int(f.stem) >= args.workers:
            rejoin += [r["since_start"] for r in rows if "since_start" in r]
        curve += [(r["t"] - t0, r["loss"]) for r in rows if "step" in r]
    end = max(r["t"] for rows in steps.values() for r in rows)
    gaps = [b["t"] - a["t"] for rows in steps.values() for a, b in zip(rows, rows[1:])]
    median = statistics.median(gaps) if gaps else float("nan")
    return {"wall_s": end - t0, "max_stall_steps": max(gaps) / median if gaps else 0.0, "median_step_s": median,
            "rejoin_s": statistics.mean(rejoin) if rejoin else None, "kills": kills,
            "final_loss": statistics.mean(r["loss"] for r in finals) if finals else None,
            "final_accuracy": statistics.mean(r["accuracy"] for r in finals) if finals else None,
            "curve": sorted(curve)}


def plot(results: Dict[str, Dict[str, Any]], path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        window = 25
        smooth = [statistics.mean(ys[max(0, i - window):i + 1]) for i in range(len(ys))]
        line, = ax.plot(xs, smooth, label=name, lw=1)
        for k in r["kills"]:
            ax.axvline(k["t"], color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss (moving mean)")
    ax.set_title("decentpy elastic gossip under SIGKILLs (dotted: kills)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--kill-every", type=float, default=8.0, help="one kill at a random time per period (s)")
    parser.add_argument("--replace-after", type=float, default=2.0)
    parser.add_argument("--topologies", default="alternating-exp-ring,one-peer-exp,ring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--member", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default="", help=argparse.SUPPRESS)
    parser.add_argument("--topology", default="ring", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    rows, results = [], {}
    for topo in args.topologies.split(","):
        base = run(args, topo, False, args.seed)
        hit = run(args, topo, True, args.seed)
        results[f"{topo}, no faults"] = base
        results[f"{topo}, {len(hit['kills'])} kills"] = hit
        for r, faults in ((base, False), (hit, True)):
            rows.append({"framework": "decentpy-elastic", "topology": topo, "workers": args.workers,
                         "kills": len(r["kills"]), "goodput_vs_no_faults": round(base["wall_s"] / r["wall_s"], 3),
                         "max_stall_steps": round(r["max_stall_steps"], 1),
                         "rejoin_s": round(r["rejoin_s"], 2) if r["rejoin_s"] is not None else "",
                         "final_loss": round(r["final_loss"], 4) if r["final_loss"] is not None else "",
                         "final_accuracy": round(r["final_accuracy"], 2) if r["final_accuracy"] is not None else "",
                         "lost_steps": 0})
            print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    csv = OUT_DIR / "bench_faults.csv"
    with open(csv, "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for row in rows:
            f.write(",".join(str(row[c]) for c in COLUMNS) + "\n")
    print(f"wrote {csv}")
    png = plot(results, OUT_DIR / "bench_faults.png")
    if png is not None:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

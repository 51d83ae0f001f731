"""Train a byte-level transformer language model on real text, data-parallel, in any mode.

Launch (CPU workers over gloo, or one GPU per worker over NCCL when GPUs are visible)::

    torchrun --standalone --nproc_per_node=4 examples/train_lm.py                     # decentpy, ring
    torchrun --standalone --nproc_per_node=4 examples/train_lm.py --mode ddp          # torch DDP
    torchrun --standalone --nproc_per_node=4 examples/train_lm.py --mode ddp-powersgd
    torchrun --standalone --nproc_per_node=4 examples/train_lm.py --topology alternating-exp-ring \\
        --compression int8 --intra-node shard --local-world-size 2
    torchrun --standalone --nproc_per_node=4 examples/train_lm.py --mode decent-dp --topology ring
    torchrun --standalone --nproc_per_node=4 examples/train_lm.py --topology complete --local-steps 32  # DiLoCo
    torchrun --standalone --nproc_per_node=2 examples/train_lm.py --preset wide --tokens 500000 \\
        --tensorboard runs/lm                     # then: tensorboard --logdir runs/lm

The corpus is the Python standard library's own ``*.py`` files (this interpreter's; its byte count
and file-list hash are printed first, so runs on another Python are told apart), or ``--corpus``.
Every mode trains the same model on the same batches with the same AdamW schedule and global batch
(see ``examples/lm/loop.py``), so their validation losses compare. Each evaluation prints one line:
tokens/s, the training loss, the held-out bits per byte of the averaged model (and of the workers'
own models), bytes sent per worker, the consensus distance; the last line is the summary.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):  # run as a script (torchrun examples/train_lm.py): import examples.lm
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

import decentpy
from decentpy.utils import initialize_dist
from examples.lm import corpus as lm_corpus
from examples.lm import loop, model
from examples.train_digits import choose_device


def _count(text: str) -> int:
    """An integer, also written 2e6, 2_000_000, 500k or 2M."""
    t = text.strip().lower().replace("_", "")
    mult = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 2000000, 2e6, 2M, 500k)") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(value)


#: the launch lines of the module's docstring, for --help
_LAUNCH = "\n".join(l.replace("    torchrun ", "  .venv/bin/torchrun ") for l in __doc__.split("\n\n")[2].splitlines())


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults appended once: not where the help text already says its default (or has none)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False):
            return text
        return super()._get_help_string(action)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help,
                                epilog="launch (after make train, from the clone's root):\n" + _LAUNCH)
    p.add_argument("--mode", default="decentpy", choices=loop.MODES,
                   help="torch DDP, DDP with PowerSGD, decentpy, the decent-dp package, or torchft 0.2.0's own "
                        "DiLoCo (torchft-diloco: give --local-steps H >= 2; torchft importable, see docs/elastic.md)")
    p.add_argument("--topology", default=None, help="gossip topology (decentpy, decent-dp; default ring): e.g. "
                   "complete, ring, one-peer-exp, alternating-exp-ring (decentpy.available_topologies())")
    p.add_argument("--compression", default="none", choices=["none", "int8"], help="compressed gossip (decentpy)")
    p.add_argument("--intra-node", default="gossip", choices=list(loop.INTRA_NODE),
                   help="what the workers of a node do together (decentpy)")
    p.add_argument("--local-world-size", type=int, default=2,
                   help="workers per (simulated) node for node-aware topologies and --intra-node "
                        "(clamped to the number of workers)")
    p.add_argument("--local-steps", type=int, default=1, metavar="H",
                   help="decentpy: H inner steps between outer steps (DiLoCo's outer Nesterov step over the topology; "
                        "'complete' = DiLoCo); 1: gossip every step")
    p.add_argument("--fragments", type=int, default=1,
                   help="decentpy local steps: Streaming DiLoCo's fragments (groups of buckets synchronised in turn)")
    p.add_argument("--fragment-sync-delay", type=int, default=0, metavar="TAU",
                   help="inner steps a fragment's outer exchange stays in flight")
    p.add_argument("--fragment-update-alpha", type=float, default=0.0, metavar="A",
                   help="the share of those inner steps kept after the fragment's outer step")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="decentpy local steps: the outer SGD's lr (default DiLoCo's 0.7; 1.0 with --outer-momentum 0: "
                        "plain averaging)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="decentpy local steps: the outer SGD's Nesterov momentum (default DiLoCo's 0.9; 0: plain SGD)")
    p.add_argument("--outer-rule", choices=loop.OUTER_RULES, default="diloco",
                   help="decentpy local steps: DiLoCo's outer step, NoLoCo's (with --topology random-pairs: "
                        "heavy-ball momentum pulling each replica towards its peer; outer lr 0.7, momentum 0.5 "
                        "unless given) or SparseLoCo's (with --topology complete: 64 of every 4096 entries of the "
                        "error-fed pseudo-gradient in 2 bits; outer lr 1, no momentum)")
    p.add_argument("--state-avg-every", type=int, default=0, metavar="K",
                   help="decentpy: average the AdamW states over the workers every K steps "
                        "(decentpy.OptimizerStateAveraging; 0: never)")
    p.add_argument("--state-avg", default="exp_avg_sq", choices=list(loop.STATE_AVG), metavar="STATES",
                   help="with --state-avg-every: exp_avg_sq (Adam's second moment) or exp_avg,exp_avg_sq (both)")
    p.add_argument("--data-split", default="shuffle", choices=list(lm_corpus.SPLITS),
                   help="shuffle: each step's global batch drawn from the whole text, split over the workers (as "
                        "DistributedSampler); shard: each worker its own contiguous part (heterogeneous data)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm every mode clips to (0: none)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="learning-rate warm-up in steps (default: 5%% of the steps)")
    p.add_argument("--preset", default="small", choices=sorted(model.PRESETS), help="model size")
    p.add_argument("--tokens", type=_count, default=1_000_000,
                   help="token budget over all workers (steps = tokens / (global batch x context))")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="a wall-clock budget instead of --tokens: a short probe of this mode on this launch "
                        "measures its throughput, and the run trains the tokens that fill S seconds, its "
                        "schedule sized to them (bench-lm's race)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--evals", type=int, default=8, help="evaluations after step 0, evenly spaced")
    g.add_argument("--eval-every", type=int, default=None, metavar="STEPS", help="evaluate every STEPS steps instead")
    p.add_argument("--val-windows", type=int, default=64, help="windows of context+1 held-out bytes per evaluation")
    p.add_argument("--log-every", type=int, default=0, metavar="STEPS",
                   help="also print rank 0's own training loss every STEPS steps (0: only at evaluations)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step over all workers "
                   "(default: the preset's; a multiple of the number of workers)")
    p.add_argument("--context", type=int, default=None, help="bytes per sequence (default: the preset's)")
    p.add_argument("--corpus", default=None, metavar="PATH",
                   help="a text file or a directory of text files (default: the Python standard library's *.py)")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars into DIR (rank 0)")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the evaluation rows to FILE (rank 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda:LOCAL_RANK when GPUs are visible")
    p.add_argument("--backend", default=None, help="process-group backend (default: nccl with a GPU per worker, "
                   "else gloo)")
    args = p.parse_args(argv)
    for name in ("evals", "eval_every", "val_windows", "global_batch", "context", "local_world_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.log_every < 0:
        p.error(f"--log-every must be >= 0, got {args.log_every}")
    if args.budget_s is not None and not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        p.error(f"--budget-s must be a finite number of seconds > 0, got {args.budget_s}")
    if args.mode.startswith("ddp") and args.topology is not None:
        p.error(f"--topology {args.topology}: torch DDP all-reduces; --topology is for --mode decentpy or decent-dp")
    if args.mode != "decentpy" and (args.compression != "none" or args.intra_node != "gossip"):
        p.error(f"--compression {args.compression} / --intra-node {args.intra_node} are decentpy's options; "
                f"--mode {args.mode} takes neither (use --mode decentpy)")
    args.topology = args.topology or "ring"
    return args


def make_spec(args: argparse.Namespace) -> loop.RunSpec:
    """The arm the options describe; --eval-every becomes a number of evaluations."""
    spec = loop.RunSpec(mode=args.mode, topology=args.topology,
                        compression=None if args.compression == "none" else args.compression,
                        intra_node=args.intra_node, local_steps=args.local_steps, fragments=args.fragments,
                        fragment_sync_delay=args.fragment_sync_delay,
                        fragment_update_alpha=args.fragment_update_alpha, preset=args.preset, tokens=args.tokens,
                        seed=args.seed,
                        evals=args.evals, val_windows=args.val_windows, lr=args.lr, global_batch=args.global_batch,
                        context=args.context, local_world_size=args.local_world_size, log_every=args.log_every,
                        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, outer_rule=args.outer_rule,
                        data_split=args.data_split,
                        grad_clip=args.grad_clip, warmup_steps=args.warmup_steps,
                        state_avg_every=args.state_avg_every, state_avg=args.state_avg)
    _evals_from(spec, args)
    return spec


def _evals_from(spec: loop.RunSpec, args: argparse.Namespace) -> None:
    """``--eval-every`` as a number of evaluations of the spec's schedule (redone when the tokens change)."""
    if args.eval_every is not None:
        spec.evals = max(1, loop.schedule(spec).steps // args.eval_every)


def _tensorboard_writer(path: Optional[str], rank: int) -> Any:
    """A SummaryWriter on rank 0 (None elsewhere); stops every rank alike when tensorboard is missing."""
    if path is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if rank != 0:  # (rank 0 says why, once)
            raise SystemExit(2) from None
        raise SystemExit(f"--tensorboard {path}: torch.utils.tensorboard needs the tensorboard package ({e}); "
                         "`make train` installs it into .venv (or: .venv/bin/pip install tensorboard), or leave out "
                         "--tensorboard") from None
    return SummaryWriter(log_dir=path) if rank == 0 else None


def _local_steps_text(spec: Any) -> str:
    """The header's words for local steps (nothing when every step communicates)."""
    if spec.local_steps < 2:
        return ""
    text = f" local steps H={spec.local_steps} outer rule {spec.outer_rule}"
    if spec.fragments > 1:
        text += (f" fragments {spec.fragments} (sync delay {spec.fragment_sync_delay}, "
                 f"alpha {spec.fragment_update_alpha:g})")
    return text


def _progress_bar(steps: int, rank: int) -> Any:
    """A tqdm bar on rank 0 when its stderr is a terminal (None otherwise, or without tqdm)."""
    if rank != 0 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, unit="step", dynamic_ncols=True, leave=False)


def _mb(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 1e6:,.2f} MB"


def _f(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Parse options, set up the process group, train one arm, print and return its rows."""
    args = parse_args(argv)
    args.device_, backend = choose_device(args)
    created = not dist.is_initialized()  # a caller's process group is kept (tests run main in workers)
    rank, world = initialize_dist(backend=backend)  # torchrun's environment
    out = print if rank == 0 else (lambda *a, **k: None)
    try:
        writer = _tensorboard_writer(args.tensorboard, rank)
        spec = make_spec(args)
        spec.check(world)
        corpus = lm_corpus.load_corpus(args.corpus)
        if args.budget_s is not None:  # the race: the tokens this mode trains in the budget here
            probe = loop.measure_throughput(spec, corpus, args.device_)
            spec.tokens = loop.tokens_for_budget(args.budget_s, probe["tokens_per_s"],
                                                 loop.schedule(spec).tokens_per_step)
            spec.budget_s = args.budget_s
            _evals_from(spec, args)
            out(f"time budget {args.budget_s:g} s: this mode trains {probe['tokens_per_s']:,.0f} tokens/s here "
                f"(a {probe['steps']:.0f}-step probe), so {spec.tokens:,} tokens", flush=True)
        cfg, sched = spec.model_config(), loop.schedule(spec)
        out(f"decentpy {decentpy.__version__}, torch {torch.__version__}, {world} workers, backend "
            f"{dist.get_backend()}, device {args.device_}", flush=True)
        out(corpus.describe(), flush=True)
        params = model.count_parameters(model.ByteTransformer(cfg))
        out(f"model {spec.preset}: {params:,} parameters (d_model {cfg.d_model}, {cfg.n_layers} layers, "
            f"{cfg.n_heads} heads, context {cfg.context}); global batch {cfg.global_batch} sequences "
            f"({cfg.global_batch // world}/worker), {sched.steps} steps of {sched.tokens_per_step:,} tokens, "
            f"AdamW lr {cfg.lr:g} (warm-up {sched.warmup} steps, cosine to {0.1 * cfg.lr:g}), gradients clipped to "
            f"{spec.grad_clip:g}, data split {spec.data_split}", flush=True)
        arm = (f"{spec.mode}" + (f" topology {spec.topology}" if spec.mode in ("decentpy", "decent-dp") else "")
               + (f" compression {args.compression} intra-node {spec.intra_node}" if spec.mode == "decentpy" else "")
               + _local_steps_text(spec))
        out(f"mode {arm}; {len(sched.eval_steps)} evaluations on {spec.val_windows} held-out windows", flush=True)

        bar = _progress_bar(sched.steps, rank)
        if bar is not None:  # (the lines go above the bar)
            out = lambda *a, **k: bar.write(" ".join(map(str, a)))  # noqa: E731

        def on_eval(row: Dict[str, Any]) -> None:
            out(f"step {row['step']:>6}/{sched.steps}  tokens {row['tokens']:>11,}  "
                f"{_f(row['tokens_per_s'], ',.0f'):>8} tok/s  train (ranks' mean) "
                f"{_f(row['train_bits_per_byte'], '.4f')} b/B  "
                f"val {row['val_bits_per_byte']:.4f} b/B (workers {row['val_bits_per_byte_workers_mean']:.4f})  "
                f"sent {_mb(row['bytes_sent_per_worker'])}/worker  consensus {row['consensus_distance']:.3e}  "
                f"skipped {_f(row['skipped_steps'], 'd')}  wall {row['wall_s']:.1f}s", flush=True)
            if writer is not None:
                x = row["tokens"]  # TensorBoard's step axis is tokens, as the benchmark's plots
                for tag, key in (("loss/val_bits_per_byte", "val_bits_per_byte"),
                                 ("loss/val_bits_per_byte_workers_mean", "val_bits_per_byte_workers_mean"),
                                 ("loss/train_bits_per_byte", "train_bits_per_byte"),
                                 ("throughput/tokens_per_s", "tokens_per_s"),
                                 ("comm/bytes_sent_per_worker", "bytes_sent_per_worker"),
                                 ("comm/consensus_distance", "consensus_distance"),
                                 ("steps/skipped_steps", "skipped_steps"), ("steps/lr", "lr"),
                                 ("time/wall_s", "wall_s")):
                    if row[key] is not None:
                        writer.add_scalar(tag, row[key], x)
                writer.flush()

        def on_log(info: Dict[str, Any]) -> None:
            out(f"step {info['step']:>6}/{sched.steps}  tokens {info['tokens']:>11,}  rank 0 train "
                f"{info['train_bits_per_byte']:.4f} b/B  lr {info['lr']:.3g}", flush=True)
            if writer is not None:
                writer.add_scalar("loss/train_bits_per_byte_rank0", info["train_bits_per_byte"], info["tokens"])

        rows = loop.run_arm(spec, corpus, args.device_, on_eval=on_eval, on_log=on_log,
                            on_step=None if bar is None else (lambda done: bar.update(done - bar.n)))
        if bar is not None:
            bar.close()
            out = print
        if writer is not None:
            writer.close()
        if rank == 0 and args.csv:
            os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=loop.COLUMNS)
                w.writeheader()
                w.writerows(rows)
        last = rows[-1]
        out(f"final val_bits_per_byte={last['val_bits_per_byte']:.4f} "
            f"workers_mean={last['val_bits_per_byte_workers_mean']:.4f} "
            f"initial={rows[0]['val_bits_per_byte']:.4f} tokens={last['tokens']} wall_s={last['wall_s']:.1f} "
            f"bytes_sent_per_worker={last['bytes_sent_per_worker']:.0f} mode={spec.mode} "
            f"topology={last['topology']} compression={last['compression']} intra_node={last['intra_node']} "
            f"local_steps={last['local_steps']} fragments={last['fragments']} "
            f"{('outer_rule=' + str(last.get('outer_rule')) + ' ') if spec.local_steps > 1 else ''}"
            f"workers={world} preset={spec.preset} seed={spec.seed} corpus_bytes={corpus.n_bytes} "
            f"corpus_hash={corpus.list_hash}", flush=True)
        return rows
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

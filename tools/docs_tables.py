"""The documentation's benchmark tables, generated from CSV files (never typed into a page).

``python -m tools.docs_tables [OUT_DIR]`` (default docs/_generated), and docs/conf.py at every
docs build, writes one Markdown table per entry of ``TABLES`` (``OUT_DIR/<name>.md``, included by
docs/benchmarks.md and the other pages) from ``docs/data/<name>.csv``: the measured results the
pages discuss, committed with the machine and command that produced them (the ``source`` below).
It also writes ``OUT_DIR/local_runs.md`` with every CSV a local benchmark run left in ``bench/out/``
(``make bench-train`` and the others write there), column for column, or a note that there is
none; those are never committed, so a fresh clone's site shows the committed results only.

To publish a new measurement, run the benchmark, copy the figures into the CSV of the same name
under docs/data/ (the columns the pages use) and update ``source`` here.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
LOCAL = ROOT / "bench" / "out"

# name -> what it measured, how, on what machine (shown under the table)
TABLES: Dict[str, str] = {
    "bench_kernels": "`make bench` (bench/bench_kernels.py): one 25 MiB fp32 bucket, median of 9 interleaved runs, "
                     "AVX-512 picked at run time. Intel Xeon, 2 cores, torch 2.13.0+cpu.",
    "bench_outer_step": "`make bench-outer` (bench/bench_outer_step.py --docs --device cpu --repeats 9): the outer step of "
                        "one 25 MiB fp32 bucket, the pseudo-gradient pass (fp32, or int8 with error feedback) and "
                        "DiLoCo's Nesterov apply pass with the reset of the parameters; `sparse`: SparseLoCo's pack (64 of "
                        "every 4096 entries, 2 bits, error-fed), the mean of four members' messages and the outer step "
                        "(SGD lr 1); each against torch's sequence of the same operations and a same-run copy of the "
                        "same bytes ('pack pass % of copy': the sparse pack alone against a copy of its 16 bytes per "
                        "element); medians of 9 interleaved runs. AMD EPYC, 2 cores, torch 2.13.0+cpu, AVX-512 "
                        "kernels, 2026-11-29.",
    "bench_lm_wide_summary": "`python -m bench.bench_lm --preset wide --arms ddp,aer-int8,diloco-32,"
                             "diloco-32-streaming-4 --links loopback --settings none` (then `--from-csv ... --docs "
                             "--docs-name bench_lm_wide`): the `wide` preset (9,094,272 parameters, context 64, global "
                             "batch 16: 976 steps for 999,424 tokens), seed 0, 4 workers, the shuffled split, gradients "
                             "clipped to 1.0, warm-up 5% of the steps, every arm at the preset's settings (lr 1e-3; "
                             "DiLoCo's outer Nesterov SGD 0.7 / 0.9). AMD EPYC, 2 cores, torch 2.13.0+cpu, 2026-11-29.",
    "bench_lm_sweep_summary": "`python -m bench.bench_lm --sweep --docs` (bench/bench_lm.py): each arm of the race "
                              "at 500k tokens on loopback, seed 0, the `small` preset, 4 workers, the shuffled split, "
                              "gradients clipped to 1.0, warm-up 5% of the steps: the inner peak lr x 0.5 / 1 / 2 of "
                              "the preset's 2e-3, and for local steps the outer (lr, momentum) among DiLoCo's (0.7, "
                              "0.9), plain averaging (1, 0) and (0.85, 0.5); 'best': the setting every other mode of "
                              "bench-lm takes (`--settings`). Training is deterministic per seed: the machine sets only "
                              "the time. AMD EPYC, 2 cores, torch 2.13.0+cpu, 2026-11-29.",
    "bench_straggler_summary": "`make bench-straggler` (bench/bench_straggler.py --docs): 4 workers, the byte-level "
                               "LM's small preset, DiLoCo on the complete topology, 12 outer steps per run, medians of "
                               "2 interleaved runs per arm (every evaluation: docs/data/bench_straggler.csv; "
                               "evaluations taken out of the wall time). AMD EPYC, 2 cores shared by the 4 workers, "
                               "torch 2.13.0+cpu.",
    "bench_kernels_cuda": "`python -m bench.bench_kernels_cuda --runs 20` (tools/gpu_session.sh): the fused mix + step + "
                          "send pass, median of 20 runs (CUDA events) after 5, GB/s = bytes read + written / time, "
                          "'% of copy' against dst.copy_(src) of the same bytes in the same run; 'vs torch': torch's "
                          "mix (mul_/add_) + torch.optim fused or foreach step + send (mul) on the same flat bucket. "
                          "scale_copy+norm: the copy of a gradient with its squared norm, against torch's copy_ then vector_norm; "
                          "group_reduce: the int8 group reduction of compressed gossip (4 members; no torch counterpart). "
                          "NVIDIA H200 (132 SMs), torch 2.11.0+cu130, decentpy built for sm_90, 2026-11-27.",
    "bench_overhead_cuda": "`python -m bench.bench_overhead_cuda` (bench/bench_overhead_cuda.py, in "
                           "tools/gpu_session.sh) and, for the A/B rows, the same model and timing with one part of "
                           "the path switched off at a time (now `--ablations`): 6 x Linear(4096, 4096) = 100.7M "
                           "parameters, batch 64, MSE, AdamW, world size 1 (6 buckets), CUDA events, median of 50 "
                           "(A/B: 30) iterations; 'torch iteration' keeps its gradients (autograd adds into them), "
                           "'with zero_grad()' is the usual loop. Two NVIDIA H200 machines, torch 2.11.0+cu130, "
                           "2026-11-27: bench 1 and 2 on the first, A/B on the second.",
    "bench_lm_summary": "`python -m bench.bench_lm --arms ddp,complete,complete-avg-v-16,complete-avg-mv-1,complete-2x2,"
                        "aer,aer-int8,diloco-32,diloco-32-streaming-4 --links loopback --seeds 0,1,2`, `--arms "
                        "complete-avg-v-1,complete-avg-mv-16 --seeds 0` and `--arms complete-avg-v-1 --seeds 1,2` "
                        "(merged with `--from-csv ... --docs`): equal tokens "
                        "(999,424), each arm at its best settings in the sweep, the `small` preset, 1,073,536 "
                        "parameters, 4 workers, the shuffled split, gradients clipped to 1.0, 8 evaluations; corpus: "
                        "CPython 3.11.7's standard library, 31,512,085 bytes, file-list hash 0d7e6025254fea8e. AMD "
                        "EPYC, 2 cores shared by the 4 workers, torch 2.13.0+cpu, decent-dp 0.2.3, 2026-11-29. "
                        "Times interpolated between evaluations; 'loss every arm reached': the worst mean final "
                        "loss of the every-step arms.",
    "bench_lm_race_summary": "`python -m bench.bench_lm --race --arms ddp,aer,aer-int8,diloco-32-streaming-4,"
                             "decent-dp-aer --links 100 --seeds 0,1,2` and `--links loopback,1000 --seeds 0` (merged "
                             "with `--from-csv ... --docs --docs-name bench_lm_race`): per link T = DDP's time for "
                             "1M tokens from its probe on that link; each arm's tokens from its own probe there, its "
                             "schedule sized to them; 4 workers as two simulated nodes of 2 (network namespaces, tbf "
                             "on each node's link), each arm at its best settings in the sweep, the `small` preset, "
                             "the shuffled split, clip 1.0; 'train wall': the arm's training time (evaluations "
                             "excluded). AMD EPYC, 2 cores shared by the 4 workers, torch 2.13.0+cpu, decent-dp "
                             "0.2.3, 2026-11-29.",
    "bench_lm_wide_race_summary": "`python -m bench.bench_lm --race --preset wide --budget-s 600 --links 100 --seeds 0 "
                                  "--arms ddp,aer,aer-int8,diloco-32-streaming-4,decent-dp-aer --settings none` (then "
                                  "`--from-csv ... --docs --docs-name bench_lm_wide_race`): T = 600 s behind 100 Mbit/s "
                                  "per node, each arm's tokens from its own probe on the link; the `wide` preset "
                                  "(9,094,272 parameters), every arm at the preset's settings (lr 1e-3; Streaming "
                                  "DiLoCo's outer Nesterov SGD 0.7 / 0.9: the sweep ran on the small preset only), the "
                                  "shuffled split, clip 1.0, seed 0, 4 workers as two simulated nodes of 2. AMD EPYC, 2 "
                                  "cores shared by the 4 workers, torch 2.13.0+cpu, decent-dp 0.2.3, 2026-11-29.",
    "bench_lm_outer_summary": "`python -m bench.bench_lm --preset small --arms ddp,diloco-32,diloco-32-int8,"
                              "diloco-32-random-pairs,noloco-32,sparseloco-32,sparseloco-32-random-pairs --links loopback --seeds 0,1,2` (then "
                              "`--from-csv ... --docs --docs-name bench_lm_outer`): 1M tokens, the `small` preset, 4 "
                              "workers, the shuffled split, clip 1.0; DDP and DiLoCo at the sweep's best settings, the "
                              "other arms at their defaults (see the text); means of 3 seeds. AMD EPYC, 2 cores, torch "
                              "2.13.0+cpu, 2026-11-29 (the sparse gossip arm run apart the same day, same code "
                              "otherwise).",
    "bench_lm_outer_race_summary": "`python -m bench.bench_lm --race --preset small --links 100 --seeds 0 --arms ddp,"
                                   "diloco-32-int8,diloco-32-streaming-4,noloco-32,sparseloco-32,torchft-diloco-32` and "
                                   "`sparseloco-32-random-pairs` (run apart with `--budget-s 175.75`) "
                                   "(then `--from-csv ... --docs --docs-name bench_lm_outer_race`; torchft 0.2.0 from "
                                   "BENCH_TORCHFT_PATH): T = DDP's time for 1M tokens from its probe behind 100 Mbit/s "
                                   "per node, each arm's tokens from its own probe there; 4 workers as two simulated "
                                   "nodes of 2, the `small` preset, seed 0, settings as in the equal-token table. AMD "
                                   "EPYC, 2 cores shared by the 4 workers, torch 2.13.0+cpu, 2026-11-29.",
    "bench_train": "`make bench-train` (bench/bench_train.py): AdamW, gloo, 1 torch thread per worker, median step "
                   "time over 32 steps (CNN rows: 48), max over ranks; decent-dp 0.2.3 and torch DDP in the same "
                   "run. Intel Xeon, 2 cores shared by the 4 or 8 workers, torch 2.13.0+cpu.",
    "bench_train_link": "`make bench-train BENCH_ARGS=\"--link-mbit 400 --link-layout two-nodes\"` (bench/bench_train.py "
                        "in network namespaces, bench/common/netlink.py): 4 workers as 2 nodes of 2 joined by one "
                        "400 Mbit/s link (tbf on both ends), MLP 3 x Linear(1024,1024), AdamW; median over 12 timed "
                        "steps of the means over each period of the schedule, max over ranks per step; one run. AMD "
                        "EPYC, 2 cores shared with other load, torch 2.13.0+cpu, decent-dp 0.2.3.",
    "bench_train_link_8workers": "`make bench-train BENCH_ARGS=\"--workers 8 --models mlp --frameworks decentpy,"
                                 "decentpy-int8,decent-dp,torch-ddp,torch-ddp-fp16,torch-ddp-powersgd,local --topologies "
                                 "ring,one-peer-exp,alternating-exp-ring --rounds 3 --link-mbit 400 --link-layout "
                                 "two-nodes\"`: 8 workers as 2 nodes of 4 joined by one 400 Mbit/s link, MLP 3 x "
                                 "Linear(1024,1024), AdamW; median over 12 period means (DDP and one-peer-exp: 24 "
                                 "steps), max over ranks per step; one run. Intel Xeon, 2 cores shared by the 8 workers "
                                 "(load 0.7 before the run, after other runs), torch 2.13.0+cpu, decent-dp 0.2.3, "
                                 "2026-11-26.",
    "bench_train_link_compressed": "`make bench-train BENCH_ARGS=\"--workers 4 --models mlp --frameworks decentpy,"
                                   "decentpy-int8,torch-ddp,torch-ddp-powersgd,local --topologies ring,"
                                   "alternating-exp-ring --link-mbit B --link-layout L\"` with B, L = 1000, per-worker "
                                   "and 2000, two-nodes: MLP 3 x Linear(1024,1024), AdamW, 4 workers; median over 16 "
                                   "period means (DDP: 32 steps), max over ranks per step; DDP + PowerSGD in one "
                                   "bucket (see the text). Intel Xeon, 2 cores (load 6-10 before the runs), torch 2.13.0+cpu, "
                                   "2026-11-26.",
    "bench_convergence": "`make bench-convergence` (bench/bench_convergence.py): digits, 4 workers, 10 epochs, seed 0, "
                         "test accuracy of the averaged model (360 test samples: one sample is 0.28 points). "
                         "Intel Xeon, 2 cores, torch 2.13.0+cpu.",
    "bench_hybrid": "`make bench-hybrid` (bench/bench_hybrid.py): 4 gloo workers as 2 nodes x 2 ranks, "
                    "4 x Linear(1024) + ReLU, batch 64 per rank, AdamW, 1 thread per worker, 24 timed steps per "
                    "configuration, medians with p25-p75. AMD EPYC, 2 cores shared by the 4 workers.",
    "runtime_hybrid": "`python -m tools.runtime_model --hybrid-only` (tools/runtime_model): predicted ms per "
                      "iteration on an assumed GPU cluster (8 GPUs per node; assumptions below), speedup vs DDP in "
                      "parentheses. A model, not a measurement.",
    "runtime_compression": "`python -m tools.runtime_model --compression-only --compression-gpus 8 64 512 4096 "
                           "--compression-csv docs/data/runtime_compression.csv --compression-plot "
                           "docs/runtime_compression.png` (tools/runtime_model): predicted ms per iteration on the "
                           "hybrid table's assumed GPU cluster (8 GPUs per node, NIC speed per node), speedup vs DDP in "
                           "parentheses. A model, not a measurement: no compressed run on GPUs has been timed.",
    "bench_shard": "`make bench-shard` (bench/bench_shard.py): the bench-train MLP, 3 x Linear(1024, 1024), batch 64 "
                   "per rank, AdamW, gloo, 1 thread per worker, medians of 64 steps timed in interleaved rounds, the "
                   "four set-ups in the same processes. AMD EPYC, 2 cores.",
    "bench_pipe": "`make bench-pipe` (bench/bench_pipe.py): 8 x (Linear(512) + ReLU), batch 256, MSE, gradients "
                  "only, one gloo worker per stage (1 thread each), medians of 160 steps in interleaved rounds "
                  "(`--rounds 32`), each step after a barrier; every row's first step checked against one process "
                  "(rel. error <= 2e-7). Intel Xeon, 2 cores, 2026-11-27 (messages packed in C++, received inputs "
                  "as autograd leaves).",
    "bench_fairscale_parity": "`make bench-fairscale-parity` (bench/bench_fairscale_parity.py): fairscale's "
                              "benchmarks/oss.py on CPU, ResNet-18 on digits upscaled to 32x32, 2 gloo workers, "
                              "batch 64 per rank, RMSprop(lr=1e-4, momentum=0.9), 4 epochs of 14 steps; rank 0's "
                              "last-batch loss per epoch. The same cells for torch DDP, fairscale 0.4.13 and decentpy.",
    "fairscale_compat": "`python tools/fairscale_compat.py --fairscale-git <dir>`: fairscale 0.4.13's own unit tests "
                        "for these classes, adapted to CPU/gloo, run against fairscale and decentpy side by side.",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: List[List[str]]) -> str:
    if not rows:
        return "*(no rows)*\n"
    header, body = rows[0], rows[1:]
    out = ["| " + " | ".join(_cell(c) for c in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in body]
    return "\n".join(out) + "\n"


def read_csv(path: Path) -> List[List[str]]:
    with open(path, newline="") as fh:
        return [row for row in csv.reader(fh)]


def generate(out_dir: str) -> List[str]:
    """Write every table of TABLES and local_runs.md into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, source in TABLES.items():
        path = DATA / f"{name}.csv"
        text = markdown_table(read_csv(path))
        text += f"\n*Source: `docs/data/{name}.csv`, measured by {source}*\n"
        (out / f"{name}.md").write_text(text)
        written.append(str(out / f"{name}.md"))
    local = sorted(LOCAL.glob("*.csv")) if LOCAL.is_dir() else []
    parts = ["The CSV files a local benchmark run left in `bench/out/` (not committed; rebuilt with the "
             "site):\n"]
    if not local:
        parts.append("\n*None in this checkout: run a `make bench-*` target, then `make docs`.*\n")
    for path in local:
        parts.append(f"\n**`bench/out/{path.name}`**\n\n{markdown_table(read_csv(path))}")
    (out / "local_runs.md").write_text("".join(parts))
    written.append(str(out / "local_runs.md"))
    return written


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        sys.exit("usage: python tools/docs_tables.py [OUTPUT_DIR]  (default docs/_generated; the docs build runs it)")
    for p in generate(sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "_generated")):
        print(p)

"""Command line of the runtime model: prediction tables, consensus, published comparison, the
hybrid modes, compressed gossip and local steps (DiLoCo) at scale, calibration on measured step times, CSVs and plots.

Run ``python -m tools.runtime_model --help`` (``__main__.py`` runs :func:`main`). Apart from the
model so that importing the model loads no command line, plotting or SciPy: the model is
``model.py``, the calibration ``fit.py``, the plots ``plots.py``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tools.tables import print_table, write_csv

from . import model as runtime_model
from .fit import (
    COMPUTE_RULES,
    BenchLmRuns,
    LinkCalibration,
    Measurement,
    calibrate,
    calibrate_links,
    is_bench_lm,
    link_hardware,
    load_bench_lm,
    load_measurements,
    predict,
)
from .model import (
    COMPRESSION_MODES,
    EXACT_GAP_MAX_N,
    GBIT,
    GPU_INTER_LAT,
    GPU_INTRA_BW,
    GPU_INTRA_LAT,
    GPU_MEM_BW,
    HYBRID_GPUS,
    HYBRID_INTER_GBPS,
    HYBRID_LOCAL,
    HYBRID_MODES,
    LOCAL_STEPS_GBPS,
    LOCAL_STEPS_GPUS,
    LOCAL_STEPS_MODES,
    LOCAL_STEPS_TARGETS,
    PUBLISHED_RANGE,
    SHARD_PREFIX,
    TOPOLOGIES,
    Hardware,
    Workload,
    bandwidth_for_utilisation,
    compression_table,
    decentralized_iteration_time,
    ddp_iteration_time,
    hybrid_table,
    iteration_times,
    iterations_to_10x,
    local_steps_table,
    local_steps_workload,
    mode_name,
    gpu_hardware,
    published_table,
    spectral_gap,
    topology_valid,
    utilisation_at,
)
from .plots import SHORT, label, plot_hybrid, plot_iteration_times, plot_local_steps

__all__ = ["main"]


def _fmt_ms(t: Optional[float]) -> str:
    """Seconds as milliseconds for the tables; n/a where the topology does not fit."""
    return "n/a" if t is None else f"{t * 1e3:.1f}"


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.runtime_model",
                                description=runtime_model.__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-mb", type=float, default=100.0, help="parameter bytes, in MB (1e6)")
    p.add_argument("--compute-ms", type=float, default=200.0, help="forward+backward per iteration")
    p.add_argument("--backward-fraction", type=float, default=2.0 / 3.0)
    p.add_argument("--intra-gbps", type=float, default=100.0, help="per-worker intra-node Gb/s")
    p.add_argument("--inter-gbps", type=float, default=25.0, help="per-node inter-node Gb/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="inter-node latency per message "
                   "(and intra-node unless --intra-latency-us)")
    p.add_argument("--intra-latency-us", type=float, default=None)
    p.add_argument("--mem-gbs", type=float, default=900.0, help="kernel memory bandwidth, GB/s")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--overlap", type=float, default=1.0, help="fraction of min(compute, comm) hidden")
    p.add_argument("--local", type=int, default=8, help="workers per node L")
    p.add_argument("--allreduce", choices=("hierarchical", "flat"), default="hierarchical",
                   help="DDP all-reduce algorithm")
    p.add_argument("--max-n", type=int, default=4096)
    p.add_argument("--calibrate", nargs="*",
                   default=["bench/out/bench_train.csv", "bench/out/bench_hybrid.csv"],
                   help="CSVs of measured CPU step times, fitted together (missing files are "
                   "skipped with a message; no file: no calibration); a bench-lm CSV (docs/data/"
                   "bench_lm.csv, recognised by its columns) gives its throttled-link runs, whose "
                   "link is fitted on the every-step runs and validated on the local-steps runs")
    p.add_argument("--calibration-only", action="store_true",
                   help="only the calibration on the --calibrate CSVs (no tables at scale)")
    p.add_argument("--lm-compute", choices=COMPUTE_RULES, default="pooled",
                   help="bench-lm CSVs: a throttled run's compute time from the loopback runs -- "
                   "'pooled': local-steps runs the median of all of decentpy's local-steps loopback "
                   "runs, every-step runs their arm's over the seeds; 'arm': the same arm and seed")
    p.add_argument("--lm-calibration-csv", default=None,
                   help="also write the printed bench-lm calibration table, cell for cell, to this "
                   "CSV (the docs' table is docs/data/runtime_model_calibration_lm.csv)")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--hybrid-plot", default=None,
                   help="plot of the hybrid modes at scale (default: OUT/runtime_hybrid.png; the "
                   "the README's and the docs' figure is docs/runtime_hybrid.png)")
    p.add_argument("--hybrid-only", action="store_true",
                   help="only the hybrid modes at scale (DDP, HSDP, AER, sharded AER on the GPU "
                   "cluster of the published comparison): table, CSV and plot")
    p.add_argument("--compression-only", action="store_true",
                   help="only compressed gossip at scale (DDP; AER, one-peer-exp and sharded AER "
                   "uncompressed, int8 and bf16 on the hybrid table's GPU cluster): table, OUT/"
                   "runtime_compression.csv (every GPU count) and plot")
    p.add_argument("--compression-gpus", type=int, nargs="+", default=list(HYBRID_GPUS),
                   help="GPU counts (multiples of 8) of the printed compressed-gossip table and of "
                   "--compression-csv")
    p.add_argument("--compression-csv", default=None,
                   help="also write the printed compressed-gossip table, cell for cell, to this CSV "
                   "(the docs' table is docs/data/runtime_compression.csv)")
    p.add_argument("--compression-plot", default=None,
                   help="plot of compressed gossip at scale (default: OUT/runtime_compression.png; "
                   "the docs' figure is docs/runtime_compression.png)")
    p.add_argument("--local-steps-only", action="store_true",
                   help="only local steps at scale (DDP; AER every step, fp32 and int8; DiLoCo and "
                   "AER-DiLoCo, H=32 and 128, fp32 and int8 outer exchange, on the hybrid table's "
                   "GPU cluster with its transformer): the NIC Gb/s per node each needs for 90%% "
                   "and 95%% compute utilisation, table, OUT/runtime_local_steps.csv and plot")
    p.add_argument("--local-steps-gpus", type=int, nargs="+", default=list(LOCAL_STEPS_GPUS),
                   help="GPU counts (multiples of 8) of the local-steps table, its CSVs and plot")
    p.add_argument("--local-steps-n", type=int, default=512,
                   help="GPU count of the plot's utilisation-against-bandwidth panel")
    p.add_argument("--local-steps-csv", default=None,
                   help="also write the printed local-steps table, cell for cell, to this CSV "
                   "(the docs' table is docs/data/runtime_local_steps.csv)")
    p.add_argument("--local-steps-plot", default=None,
                   help="plot of local steps at scale (default: OUT/runtime_local_steps.png; the "
                   "docs' figure is docs/runtime_local_steps.png)")
    args = p.parse_args(argv)
    for flag, counts in (("--compression-gpus", args.compression_gpus),
                         ("--local-steps-gpus", args.local_steps_gpus + [args.local_steps_n])):
        bad = [g for g in counts if g < 1 or g % HYBRID_LOCAL]
        if bad:
            p.error(f"{flag}: {bad} are not positive multiples of {HYBRID_LOCAL} (GPUs per node)")
    return args


def _speedup_cells(row: Dict[str, object], keys: Sequence[str]) -> List[str]:
    """The row's ms per key, with the speedup vs DDP (its first key, 'allreduce') in parentheses."""
    ddp = row["allreduce_s"]
    cells = []
    for k in keys:
        t = row[f"{k}_s"]
        cells.append(_fmt_ms(t) if k == "allreduce" or t is None
                     else f"{_fmt_ms(t)} ({ddp / t:.2f}x)")
    return cells


def _plot_panels(rows: List[Dict[str, object]], keys: Sequence[str]
                 ) -> Dict[str, Dict[str, List[Optional[float]]]]:
    """One plot panel per (workload, NIC speed) of the rows (in GPU order), a series per key."""
    panels: Dict[str, Dict[str, List[Optional[float]]]] = {}
    for r in rows:
        series = panels.setdefault(f"{r['model']} ({r['model_mb']:.0f} MB, "
                                   f"{r['compute_ms']:.1f} ms compute), {r['inter_gbps']:g} Gb/s",
                                   {k: [] for k in keys})
        for k in keys:
            series[k].append(r[f"{k}_s"])
    return panels


def _cluster_line(gpus: Sequence[int] = HYBRID_GPUS,
                  nic: str = "/".join(f"{g:g}" for g in HYBRID_INTER_GBPS) + " Gb/s") -> str:
    """The assumed GPU cluster of the tables at scale, for their headings."""
    return (f"{min(gpus)}-{max(gpus)} GPUs, {HYBRID_LOCAL} per node, NVLink "
            f"{GPU_INTRA_BW / 1e9:g} GB/s/GPU, NIC {nic} "
            f"per node (shared by its {HYBRID_LOCAL} GPUs), latency intra "
            f"{GPU_INTRA_LAT * 1e6:g} us inter {GPU_INTER_LAT * 1e6:g} us, kernels "
            f"{GPU_MEM_BW / 1e9:g} GB/s, full overlap; weak scaling (32 images / 4096 tokens per "
            "GPU)")


def _hybrid_report(out_dir: Path, plot_path: Optional[str]) -> List[Path]:
    """Print the hybrid-modes table, write its CSV and plot; returns the paths written."""
    rows = hybrid_table()
    print(f"Hybrid modes at scale: {_cluster_line()}; DDP hierarchical all-reduce, HSDP = FSDP "
          "HYBRID_SHARD (shard in a node, all-reduce across), AER = decentpy alternating-exp-ring, "
          "shard-AER = sharded gossip (AER over the nodes); 25 MB buckets / FSDP units")
    print("iteration time ms (speedup vs DDP = DDP ms / mode ms); n/a: AER needs >= 2 nodes")
    table = [[r["model"], f"{r['inter_gbps']:g}", r["gpus"], r["nodes"],
              *_speedup_cells(r, HYBRID_MODES)] for r in rows]
    print_table(["model", "Gb/s", "GPUs", "N", *[SHORT[k] for k in HYBRID_MODES]], table,
                group=lambda row: (row[0], row[1]))
    csv_path = out_dir / "runtime_hybrid.csv"
    write_csv(csv_path, list(rows[0]), rows)
    png = Path(plot_path) if plot_path else out_dir / "runtime_hybrid.png"
    png.parent.mkdir(parents=True, exist_ok=True)  # (the SVG fallback without matplotlib writes there too)
    written = plot_hybrid(png, list(HYBRID_GPUS), _plot_panels(rows, HYBRID_MODES),
                          f"Predicted iteration time, {HYBRID_LOCAL} GPUs per node, NVLink "
                          "intra-node (analytic model, tools/runtime_model)")
    return [csv_path, written]


def _compression_report(out_dir: Path, gpus: Sequence[int], table_csv: Optional[str],
                        plot_path: Optional[str]) -> List[Path]:
    """Print the compressed-gossip table at ``gpus``, write its CSVs (OUT: every row, the hybrid
    table's GPU counts and ``gpus``; ``table_csv``: the printed cells) and the plot; returns the
    paths written."""
    keys = [mode_name(t, c) for t, c in COMPRESSION_MODES]
    rows = compression_table(sorted(set(HYBRID_GPUS) | set(gpus)))
    print(f"Compressed gossip at scale: {_cluster_line()}; DDP hierarchical all-reduce (fp32), AER "
          "= alternating-exp-ring, 1peer-exp = one-peer-exp, +int8 / +bf16 = compression=; a "
          "compressed group exchange of m GPUs is two point-to-point rounds of chunks of 1/m (a "
          "reduce-scatter and an all-gather of compressed chunks), so AER's node-pair group of "
          f"{2 * HYBRID_LOCAL} GPUs puts {HYBRID_LOCAL} compressed models through each NIC where "
          "fp32's hierarchical all-reduce puts one; shard-AER = sharded gossip over AER "
          "(intra_node=\"shard\": exact "
          f"reduce-scatter / all-gather in the node, each GPU exchanging its 1/{HYBRID_LOCAL} shard, "
          f"compressed, with the same shard of the peer node: {HYBRID_LOCAL} compressed shards, one "
          "compressed model, through each NIC)")
    print("iteration time ms (speedup vs DDP = DDP ms / mode ms); n/a: AER needs >= 2 nodes")
    header = ["model", "NIC Gb/s per node", "GPUs (nodes)", *[label(k) for k in keys]]
    table = [[r["model"], f"{r['inter_gbps']:g}", f"{r['gpus']} ({r['nodes']})",
              *_speedup_cells(r, keys)] for r in rows if r["gpus"] in gpus]
    print_table(header, table, group=lambda row: (row[0], row[1]))
    big = max(gpus)  # the memory the copies take, at the largest printed count
    at_big = {r["model"]: r for r in rows if r["gpus"] == big}
    parts = []
    for t in sorted({t for t, c in COMPRESSION_MODES if c is not None}):
        copies = next(iter(at_big.values()))[f"{t}_copies"]
        # sharded gossip keeps copies of its 1/L shard, plain gossip of the whole model
        what, per = (("shard copies", HYBRID_LOCAL) if t.startswith(SHARD_PREFIX)
                     else ("copies", 1))
        parts.append(f"{label(t)} n/a" if copies is None else f"{label(t)} {copies} {what} ("
                     + ", ".join(f"{m} {r['model_mb'] * copies / per / 1e3:.1f} GB"
                                 for m, r in at_big.items()) + ")")
    print(f"memory per GPU at {big} GPUs (2 fp32 copies of the model, or of the GPU's "
          f"1/{HYBRID_LOCAL} shard with shard-, per distinct pair partner and per distinct group "
          "of more than two): " + "; ".join(parts))
    written = _write_tables(out_dir / "runtime_compression.csv", rows, header, table, table_csv)
    png = Path(plot_path) if plot_path else out_dir / "runtime_compression.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_rows = [r for r in rows if r["gpus"] in HYBRID_GPUS]
    written.append(plot_hybrid(png, list(HYBRID_GPUS), _plot_panels(plot_rows, keys),
                               f"Predicted iteration time with compressed gossip, {HYBRID_LOCAL} "
                               "GPUs per node (analytic model, tools/runtime_model)", logy=True))
    return written


def _write_tables(csv_path: Path, rows: Sequence[Dict[str, object]], header: Sequence[str],
                  table: Sequence[Sequence[object]], table_csv: Optional[str]) -> List[Path]:
    """A report's files: every row as numbers at ``csv_path``, and with ``table_csv`` the printed
    cells (the docs' table); the paths written."""
    write_csv(csv_path, list(rows[0]), rows)
    written = [csv_path]
    if table_csv:
        path = Path(table_csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as fh:
            wr = csv.writer(fh)
            wr.writerow(header)
            wr.writerows(table)
        written.append(path)
    return written


def _gbps_cell(g: Optional[float]) -> str:
    """A needed bandwidth for the tables: 3 significant digits, 'out of reach' for None."""
    return "out of reach" if g is None else f"{g:.3g}"


def _local_steps_report(out_dir: Path, gpus: Sequence[int], n_plot: int,
                        table_csv: Optional[str], plot_path: Optional[str]) -> List[Path]:
    """Print the local-steps table at ``gpus``, write its CSVs (OUT: every row, numbers;
    ``table_csv``: the printed cells) and the plot (utilisation against bandwidth at ``n_plot``
    GPUs, bandwidth for 90% against the GPU count); returns the paths written."""
    wl = local_steps_workload()
    counts = sorted(set(gpus))
    rows = local_steps_table(counts)
    targets = [round(t * 100) for t in LOCAL_STEPS_TARGETS]
    print(f"Local steps at scale: {_cluster_line(counts, 'X Gb/s (varied)')}; Transformer-110M "
          f"({wl.model_bytes / 1e6:.0f} MB fp32, {wl.compute_s * 1e3:.1f} ms "
          "forward+backward per GPU). DDP = hierarchical all-reduce every step; AER = gossip every "
          "step on alternating-exp-ring (+int8: decentpy's compressed gossip); DiLoCo H=h = "
          "local_steps=h on complete (one all-reduce of the pseudo-gradient per h steps); "
          "AER-DiLoCo = a gossip outer step on AER (global copy and pseudo-gradient, 2 models); the "
          "outer exchange overlaps the rest of the h-th backward only; +int8 outer exchange "
          "(node level, as decentpy's intra_node=\"shard\" runs it): exact fp32 inside the node, "
          f"each GPU's 1/{HYBRID_LOCAL} shard int8 across nodes")
    print("compute utilisation = (forward + backward + Adam step of one GPU alone) / iteration "
          "time; NIC Gb/s per node needed to reach it (bisection; out of reach: latencies and "
          "kernel passes cap it below the target)")
    gb = list(LOCAL_STEPS_GBPS)
    header = ["mode", "GPUs (nodes)", *[f"Gb/s for {t}%" for t in targets],
              *[f"util. at {g:g} Gb/s" for g in gb]]
    table = [[label(r["mode"]), f"{r['gpus']} ({r['nodes']})",
              *[_gbps_cell(r[f"gbps_for_{t}pct"]) for t in targets],
              *["n/a" if r[f"util_at_{g:g}gbps"] is None else f"{100 * r[f'util_at_{g:g}gbps']:.1f}%"
                for g in gb]] for r in rows]
    print_table(header, table, group=lambda row: row[0])
    written = _write_tables(out_dir / "runtime_local_steps.csv", rows, header, table, table_csv)
    grid = [10 ** (k / 20) for k in range(0, 61)]  # 1 .. 1000 Gb/s
    utilisation = {m.name: [utilisation_at(m, n_plot, g, HYBRID_LOCAL, wl) if m.valid(
        n_plot, HYBRID_LOCAL) else None for g in grid] for m in LOCAL_STEPS_MODES}
    first = targets[0]
    needed = {m.name: [r[f"gbps_for_{first}pct"] for r in rows if r["mode"] == m.name]
              for m in LOCAL_STEPS_MODES}
    png = Path(plot_path) if plot_path else out_dir / "runtime_local_steps.png"
    written.append(plot_local_steps(
        png, n_plot, grid, utilisation, counts, needed, first / 100,
        f"Local steps (DiLoCo) against an exchange every step: Transformer-110M "
        f"({wl.model_bytes / 1e6:.0f} MB, {wl.compute_s * 1e3:.1f} ms forward+backward per GPU), "
        f"{HYBRID_LOCAL} GPUs per node, NVLink intra-node\nanalytic model "
        "(tools/runtime_model), not a measurement; int8: the node-level outer exchange (exact in "
        "the node, each GPU's shard int8 across)"))
    return written


def _tied_report(ms: List[Measurement], sources: str, wl: Workload, out_dir: Path) -> List[Path]:
    """The one-machine calibration (bench-train, bench-hybrid rows): fit, table, parameter CSV."""
    res = calibrate(ms, replace(wl, model_bytes=0.0, compute_s=0.0))
    h = res.hardware
    print(f"calibration on {len(ms)} measurements from {sources}: effective bandwidth "
          f"{h.intra_bw / 1e9:.3g} GB/s, latency {h.intra_lat * 1e6:.3g} us, kernel "
          f"bandwidth {h.mem_bw / 1e9:.3g} GB/s, overlap {h.overlap:.2f}")
    print_table(
        ["framework", "mode", "topology", "n", "L", "model", "measured ms", "model ms",
         "rel err"],
        [[m.framework, m.kind, m.topology, m.workers, m.local, m.model,
          f"{m.step_time_s * 1e3:.2f}", f"{p * 1e3:.2f}", f"{e:+.1%}"]
         for m, p, e in zip(res.measurements, res.predictions, res.rel_errors)])
    by_kind: Dict[str, List[float]] = {}
    for m, e in zip(res.measurements, res.rel_errors):
        by_kind.setdefault(m.kind, []).append(abs(e))
    print(f"median |relative error|: {res.median_abs_error:.1%} ("
          + ", ".join(f"{k} {statistics.median(v):.1%} over {len(v)}"
                      for k, v in sorted(by_kind.items())) + ")")
    path = out_dir / "runtime_model_calibration.csv"
    with open(path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["param", "value"])
        for k, v in asdict(h).items():
            wr.writerow([k, v])
        wr.writerow(["median_abs_rel_error", res.median_abs_error])
    return [path]


def _link_report(runs: BenchLmRuns, sources: str, wl: Workload, out_dir: Path, compute: str,
                 table_csv: Optional[str], n_gpus: int) -> List[Path]:
    """The bench-lm calibration: the throttled link fitted on the every-step runs, predicted for
    the local-steps runs (a validation); table, CSVs, and what the fitted overlap would change in
    the local-steps table at scale."""
    base = replace(wl, model_bytes=0.0, compute_s=0.0)
    res: LinkCalibration = calibrate_links(runs.measurements, base)
    ms = res.measurements
    nominal = [_nominal(m, base) for m in ms]
    links = sorted({m.link_mbit for m in ms})  # type: ignore[type-var]
    print(f"bench-lm calibration on the {len(ms)} throttled-link runs of {sources}: "
          f"{ms[0].workers} CPU workers as 2 nodes of {ms[0].local} (decentpy's local_world_size), "
          "each node's link limited by tc tbf to " + " / ".join(f"{g:g}" for g in links)
          + " Mbit/s each way, loopback inside a node")
    rule = ("the median of decentpy's local-steps loopback runs for local steps, of the arm's "
            "loopback runs over the seeds every step" if compute == "pooled"
            else "the same arm and seed's loopback run")
    print("step time: slope of the training wall time (evaluations excluded) from the first "
          "evaluation after step 0 to the last; local steps: the outer steps at the multiples of H "
          f"in that window; compute time: {rule} (what stays on the machine, measured); the model "
          "adds what crosses the link")
    for ref, t in runs.compute_s.items():
        print(f"  compute {t * 1e3:.1f} ms: {ref}")
    n_fit = sum(res.fitted)
    print(f"link fitted on the {n_fit} every-step runs: efficiency {res.efficiency:.3g} of the tc "
          f"rate, latency {res.latency_s * 1e3:.3g} ms per message, overlap {res.overlap:.2f}; "
          f"median |relative error| {res.median_abs_error(True):.1%} fitted, "
          f"{res.median_abs_error(False):.1%} on the {len(ms) - n_fit} local-steps runs "
          "(predicted, not fitted)")
    if res.efficiency > 1:
        print("  (an efficiency above 1 is not physical: the fit trades the model's mismatches of "
              "the every-step modes against each other, see the errors below)")
    header = ["run", "set", "link Mbit/s", "H", "compute ms", "measured ms", "model ms", "rel err",
              "measured - compute ms", "model - compute ms", "nominal link ms"]
    order = sorted(range(len(ms)), key=lambda i: (not res.fitted[i], ms[i].link_mbit,
                                                  ms[i].local_steps, ms[i].run))
    table = []
    for i in order:
        m, p, e = ms[i], res.predictions[i], res.rel_errors[i]
        table.append([m.run, "fit" if res.fitted[i] else "validation", f"{m.link_mbit:g}",
                      str(m.local_steps),
                      f"{m.compute_time_s * 1e3:.1f}", f"{m.step_time_s * 1e3:.1f}",
                      f"{p * 1e3:.1f}", f"{e:+.1%}",
                      f"{(m.step_time_s - m.compute_time_s) * 1e3:+.1f}",
                      f"{(p - m.compute_time_s) * 1e3:+.1f}", f"{nominal[i] * 1e3:.1f}"])
    print("per run (nominal link: the tc rate, no latency, full overlap):")
    print_table(header, table, group=lambda row: row[1])
    if runs.skipped:
        print(f"not predicted ({len(runs.skipped)} throttled runs):")
        for sk in runs.skipped:
            print(f"  {sk.run}: {sk.reason}")
    rows = [dict(run=m.run, framework=m.framework, topology=m.topology,
                 compression=m.compression or "", sharded=m.sharded, local_steps=m.local_steps,
                 link_mbit=m.link_mbit, workers=m.workers, local=m.local, model=m.model,
                 model_bytes=m.model_bytes, window_first=m.window[0] if m.window else None,
                 window_last=m.window[1] if m.window else None, fitted=f,
                 compute_s=m.compute_time_s, measured_s=m.step_time_s, predicted_s=p,
                 rel_error=e, nominal_link_s=q)
            for m, p, e, f, q in zip(ms, res.predictions, res.rel_errors, res.fitted, nominal)]
    written = _write_tables(out_dir / "runtime_model_calibration_lm.csv", rows, header, table,
                            table_csv)
    params = out_dir / "runtime_model_calibration_lm_params.csv"
    with open(params, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["param", "value"])
        wr.writerows([["link_efficiency", res.efficiency], ["link_latency_s", res.latency_s],
                      ["overlap", res.overlap], ["compute_rule", compute],
                      ["median_abs_rel_error_fit", res.median_abs_error(True)],
                      ["median_abs_rel_error_local_steps", res.median_abs_error(False)]])
    written.append(params)
    _overlap_sensitivity(res.overlap, n_gpus)
    return written


def _nominal(m: Measurement, base: Workload) -> float:
    """``m`` predicted on its nominal link (the tc rate, no latency, full overlap)."""
    return predict(m, link_hardware(m.link_mbit), base)  # type: ignore[arg-type]


def _overlap_sensitivity(overlap: float, n: int) -> None:
    """The local-steps table's NIC bandwidth for 90% / 95% at ``n`` GPUs, with full overlap (the
    table) and with the CPU fit's ``overlap``: the only fitted parameter with a meaning on a GPU
    cluster (the link efficiency and latency are tc's and TCP's on one machine, and they absorb the
    model's mismatches)."""
    def hardware(gbps: float) -> Hardware:
        return replace(gpu_hardware(gbps), overlap=overlap)

    targets = list(LOCAL_STEPS_TARGETS)
    table = []
    for mode in LOCAL_STEPS_MODES:
        if not mode.valid(n, HYBRID_LOCAL):
            continue
        full = [bandwidth_for_utilisation(mode, n, t) for t in targets]
        cpu = [bandwidth_for_utilisation(mode, n, t, hardware=hardware) for t in targets]
        table.append([label(mode.name), *(f"{_gbps_cell(a)} / {_gbps_cell(b)}"
                                          for a, b in zip(full, cpu))])
    print(f"local steps at scale ({n} GPUs, the table's cluster): NIC Gb/s per node for "
          + " and ".join(f"{round(t * 100)}%" for t in targets)
          + f" utilisation, full overlap / the CPU fit's overlap {overlap:.2f} (a sensitivity, "
          "not a calibration of the GPU cluster)")
    print_table(["mode", *[f"Gb/s for {round(t * 100)}%" for t in targets]], table)


def _calibration_report(args: argparse.Namespace, wl: Workload, out_dir: Path) -> List[Path]:
    """Read the --calibrate CSVs and run the one-machine calibration on the bench-train /
    bench-hybrid rows and the link calibration on the bench-lm runs; the paths written."""
    ms: List[Measurement] = []
    used: List[str] = []
    lm_runs: List[BenchLmRuns] = []
    lm_used: List[str] = []
    for cal in args.calibrate or []:
        cal_path = Path(cal)
        if not cal_path.is_file():
            print(f"calibration skipped for {cal_path}: it does not exist (bench_train.py / "
                  "bench_hybrid.py write it: columns framework, topology, workers, model, "
                  "step_time_s, bytes_per_step, compute_time_s; or bench_lm.py's CSV)")
            continue
        if is_bench_lm(cal_path):
            runs = load_bench_lm(cal_path, args.lm_compute)
            if not runs.measurements:
                print(f"calibration skipped for {cal_path}: no throttled-link run the model "
                      f"predicts ({runs.loopback_runs} loopback runs, {len(runs.skipped)} "
                      "throttled runs skipped)")
                continue
            lm_runs.append(runs)
            lm_used.append(str(cal_path))
            continue
        found = load_measurements(cal_path)
        if not found:
            print(f"calibration skipped for {cal_path}: no usable rows")
            continue
        ms += found
        used.append(str(cal_path))
    written: List[Path] = []
    if ms:
        written += _tied_report(ms, ", ".join(used), wl, out_dir)
    if lm_runs:
        if ms:
            print()
        merged = BenchLmRuns([m for r in lm_runs for m in r.measurements],
                             [s for r in lm_runs for s in r.skipped],
                             {k: v for r in lm_runs for k, v in r.compute_s.items()},
                             sum(r.loopback_runs for r in lm_runs))
        written += _link_report(merged, ", ".join(lm_used), wl, out_dir, args.lm_compute,
                                args.lm_calibration_csv, args.local_steps_n)
    if not ms and not lm_runs:
        print("calibration skipped: no measurements")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the tables, calibrate when the measured CSV exists, write the CSVs and the plot."""
    args = _parse(argv)
    local = args.local
    hw = Hardware(intra_bw=args.intra_gbps * GBIT, inter_bw=args.inter_gbps * GBIT,
                  intra_lat=(args.intra_latency_us if args.intra_latency_us is not None
                             else args.latency_us) * 1e-6,
                  inter_lat=args.latency_us * 1e-6, mem_bw=args.mem_gbs * 1e9,
                  overlap=args.overlap)
    wl = Workload(model_bytes=args.model_mb * 1e6, compute_s=args.compute_ms * 1e-3,
                  backward_fraction=args.backward_fraction, bucket_bytes=args.bucket_mb * 1e6)
    ns = [n for n in (2 ** k for k in range(3, 13)) if n <= args.max_n and n % local == 0]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.calibration_only:
        written = _calibration_report(args, wl, out_dir)
        if written:
            print(f"\nwrote {', '.join(map(str, written))}")
        return 0
    if args.hybrid_only or args.compression_only or args.local_steps_only:
        paths = []
        if args.hybrid_only:
            paths += _hybrid_report(out_dir, args.hybrid_plot)
        if args.compression_only:
            if paths:
                print()
            paths += _compression_report(out_dir, args.compression_gpus, args.compression_csv,
                                         args.compression_plot)
        if args.local_steps_only:
            if paths:
                print()
            paths += _local_steps_report(out_dir, args.local_steps_gpus, args.local_steps_n,
                                         args.local_steps_csv, args.local_steps_plot)
        print(f"\nwrote {', '.join(map(str, paths))}")
        return 0

    print(f"runtime model: M={args.model_mb:g} MB, compute={args.compute_ms:g} ms "
          f"(backward {args.backward_fraction:.2f}), intra {args.intra_gbps:g} Gb/s/worker, "
          f"inter {args.inter_gbps:g} Gb/s/node, latency inter {hw.inter_lat * 1e6:g} us "
          f"intra {hw.intra_lat * 1e6:g} us, L={local}, kernel {args.mem_gbs:g} GB/s, "
          f"DDP all-reduce {args.allreduce}, bucket {args.bucket_mb:g} MB, overlap {args.overlap:g}")
    print("DDP: all-reduce overlaps the backward only (last bucket exposed); decentralized: the "
          "exchange of step k overlaps all of step k+1's forward+backward.\n")

    names = ["allreduce", *TOPOLOGIES]
    series: Dict[str, List[Optional[float]]] = {k: [] for k in names}
    csv_rows = []
    table = []
    for n in ns:
        times = iteration_times(n, local, wl, hw, args.allreduce)
        row = [n, n // local]
        for k in names:
            t = times[k]
            series[k].append(t)
            row.append(_fmt_ms(t))
            if k == "allreduce":
                comm = ddp_iteration_time(n, local, wl, hw, args.allreduce)[1]
                gap = iters = None  # all-reduce keeps the replicas identical
            elif t is None:
                continue
            else:
                comm = decentralized_iteration_time(k, n, local, wl, hw)[1]
                gap = spectral_gap(k, n, local)
                iters = iterations_to_10x(gap)
            csv_rows.append(dict(n=n, nodes=n // local, local=local, method=k, iter_time_s=t,
                                 comm_time_s=comm, spectral_gap=gap, iters_10x=iters,
                                 time_10x_s=None if iters is None else iters * t))
        best = min((times[k], k) for k in TOPOLOGIES if times[k] is not None)
        row.append(f"{times['allreduce'] / best[0]:.2f}x ({SHORT[best[1]]})")
        table.append(row)
    print("Predicted iteration time (ms); n/a = topology not valid for n, L")
    print_table(["n", "N", *[SHORT[k] for k in names], "AR/best-decent"], table)

    print("\nConsensus: spectral gap of the period-averaged W (exact for n <= "
          f"{EXACT_GAP_MAX_N}, closed form beyond); iterations and time to cut the consensus "
          "distance 10x")
    ctab = []
    for n in ns:
        row: List[object] = [n]
        for k in TOPOLOGIES:
            if not topology_valid(k, n, local):
                row += ["n/a", "n/a"]
                continue
            gap = spectral_gap(k, n, local)
            t = decentralized_iteration_time(k, n, local, wl, hw)[0]
            it = iterations_to_10x(gap)
            row += [f"{gap:.3g}", f"{it:.3g} it / {it * t:.3g} s"]
        ctab.append(row)
    hdr = ["n"]
    for k in TOPOLOGIES:
        hdr += [f"gap {SHORT[k]}", f"10x {SHORT[k]}"]
    print_table(hdr, ctab)

    print("\nPublished comparison: AER vs all-reduce iteration time (papers: AER 1.2x-2.8x "
          "shorter on 16-64 GPUs, 25-100 Gb/s, NVLink intra-node)")
    print(f"assumptions: V100-class GPUs, NVLink {GPU_INTRA_BW / 1e9:g} GB/s/GPU, "
          f"intra latency {GPU_INTRA_LAT * 1e6:g} us, inter latency {GPU_INTER_LAT * 1e6:g} us, "
          f"NIC bandwidth per node, HBM kernels {GPU_MEM_BW / 1e9:g} GB/s, fixed global batch "
          "(ResNet-50: 1024 images, ~1200 img/s/GPU AMP + 5 ms; Transformer-110M fp32: 262k "
          "tokens, 6*P*tokens FLOPs at 40 TFLOP/s + 10 ms), DDP hierarchical ring, 25 MB buckets")
    ptab = published_table(args.allreduce)
    print_table(
        ["model", "GPUs", "L", "inter Gb/s", "MB", "compute ms", "AR ms", "AER ms", "AR/AER",
         "published", "in range"],
        [[r["model"], r["gpus"], r["local"], f"{r['inter_gbps']:g}", f"{r['model_mb']:.0f}",
          f"{r['compute_ms']:.1f}", f"{r['allreduce_ms']:.1f}", f"{r['aer_ms']:.1f}",
          f"{r['ratio']:.2f}x", "1.2x-2.8x", "yes" if r["in_range"] else "no"] for r in ptab])
    ratios = [r["ratio"] for r in ptab]
    inside = sum(r["in_range"] for r in ptab)
    below = sum(r < PUBLISHED_RANGE[0] for r in ratios)
    above = sum(r > PUBLISHED_RANGE[1] for r in ratios)
    print(f"model ratios span {min(ratios):.2f}x-{max(ratios):.2f}x: {inside}/{len(ptab)} "
          f"scenarios inside the published 1.2x-2.8x, {below} below (compute-bound: the "
          f"all-reduce hides behind the backward), {above} above")

    print()
    hybrid_paths = _hybrid_report(out_dir, args.hybrid_plot)
    print()
    hybrid_paths += _compression_report(out_dir, args.compression_gpus, args.compression_csv,
                                        args.compression_plot)
    print()
    hybrid_paths += _local_steps_report(out_dir, args.local_steps_gpus, args.local_steps_n,
                                        args.local_steps_csv, args.local_steps_plot)

    print()
    hybrid_paths += _calibration_report(args, wl, out_dir)

    csv_path = out_dir / "runtime_model.csv"
    write_csv(csv_path, list(csv_rows[0]) if csv_rows else ["n"], csv_rows)
    pub_path = out_dir / "runtime_model_published.csv"
    write_csv(pub_path, list(ptab[0]), ptab)
    title = (f"M={args.model_mb:g} MB, compute {args.compute_ms:g} ms, intra {args.intra_gbps:g} "
             f"Gb/s, inter {args.inter_gbps:g} Gb/s/node, L={local}")
    plot_path = plot_iteration_times(out_dir / "runtime_model.png", ns, series, title)
    print(f"\nwrote {csv_path}, {pub_path}, {plot_path}, {', '.join(map(str, hybrid_paths))}")
    return 0


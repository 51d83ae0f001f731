"""Plots of the runtime model's predictions (matplotlib when installed, else a plain SVG).

The model is ``model.py``; this module only draws what it predicts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["SHORT", "label", "plot_iteration_times", "plot_hybrid", "plot_local_steps"]

# Short labels of the methods, for plot legends and table headers.
SHORT: Dict[str, str] = {
    "allreduce": "DDP-AR",
    "complete": "complete",
    "ring": "ring",
    "one-peer-exp": "1peer-exp",
    "alternating-exp-ring": "AER",
    "hsdp": "HSDP",
}
SHORT.update({f"shard-{k}": f"shard-{v}" for k, v in list(SHORT.items())
              if k not in ("allreduce", "hsdp")})  # sharded gossip on each topology
_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "v"), ("-", "D"), ("--", "x"), (":", "P")]


def label(name: str) -> str:
    """Short label of a method: SHORT's, with a compression suffix kept ('AER+int8'); local steps
    (model.LocalStepsMode.name) as 'DiLoCo H=32' (complete) or 'AER-DiLoCo H=32' (a gossip outer
    step on AER)."""
    topology, plus, kind = name.partition("+")
    if topology.startswith("diloco-"):
        topo, _, h = topology[len("diloco-"):].rpartition("H")
        topo = topo.rstrip("-")
        return (f"{SHORT.get(topo, topo)}-" if topo else "") + f"DiLoCo H={h}" + plus + kind
    return SHORT.get(topology, topology) + plus + kind


def _draw(ax, ns: List[int], series: Dict[str, List[Optional[float]]]) -> None:
    """One panel: a line per method, ms against n on a log2 axis (points where valid)."""
    for i, (name, ys) in enumerate(series.items()):
        pts = [(n, y * 1e3) for n, y in zip(ns, ys) if y is not None]
        if pts:
            ls, mk = _STYLES[i % len(_STYLES)]
            ax.plot(*zip(*pts), linestyle=ls, marker=mk, ms=4, lw=1.5, alpha=0.85,
                    label=label(name))
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    many = len(series) > len(_STYLES)  # two narrower legend columns: less of the panel hidden
    ax.legend(fontsize=7 if many else 8, ncol=2 if many else 1)


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_iteration_times(path_png: Path, ns: List[int], series: Dict[str, List[Optional[float]]],
                         title: str) -> Path:
    """Predicted iteration time against n per method; a PNG with matplotlib, else an SVG (the
    model needs no plotting library). Returns the path written."""
    plt = _pyplot()
    if plt is None:
        return _plot_svg(path_png.with_suffix(".svg"), ns, series, title)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    _draw(ax, ns, series)
    ax.set_xlabel("workers n")
    ax.set_ylabel("predicted iteration time (ms)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return path_png


def plot_hybrid(path_png: Path, ns: List[int],
                panels: Dict[str, Dict[str, List[Optional[float]]]], title: str,
                logy: bool = False) -> Path:
    """One panel per (workload, NIC speed) key of ``panels``, each with a line per mode, in a
    grid of two columns; a PNG with matplotlib, else one SVG with the panel named in every
    legend entry. ``logy``: a log time axis (the PNG), for modes an order of magnitude apart.
    Returns the path written."""
    plt = _pyplot()
    if plt is None:
        merged = {f"{panel}: {label(k)}": ys for panel, series in panels.items()
                  for k, ys in series.items()}
        return _plot_svg(path_png.with_suffix(".svg"), ns, merged, title)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.6 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        _draw(ax, ns, series)
        if logy:
            ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("GPUs n")
        ax.set_ylabel("predicted iteration time (ms)")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png


def _local_steps_style(name: str) -> Dict[str, object]:
    """Line style of a local-steps comparison mode: a colour per family (DDP, AER every step,
    DiLoCo, AER-DiLoCo; darker for H=128), dashed with int8, a marker per H."""
    base, _, kind = name.partition("+")
    h128 = base.endswith("-H128")
    if base == "allreduce":
        color, marker = "black", "D"
    elif base.startswith("diloco-H"):
        color, marker = ("tab:red" if h128 else "tab:orange"), ("s" if h128 else "o")
    elif base.startswith("diloco-"):
        color, marker = ("darkgreen" if h128 else "tab:green"), ("s" if h128 else "o")
    else:
        color, marker = "tab:blue", "^"
    return dict(color=color, marker=marker, linestyle="--" if kind else "-")


def plot_local_steps(path_png: Path, n: int, gbps: List[float],
                     utilisation: Dict[str, List[Optional[float]]], gpus: List[int],
                     needed: Dict[str, List[Optional[float]]], target: float, title: str) -> Path:
    """Two panels: each mode's compute utilisation against the NIC bandwidth per node at ``n``
    GPUs (``utilisation[mode]`` at ``gbps``), and the bandwidth each mode needs for ``target``
    utilisation against the GPU count (``needed[mode]`` at ``gpus``, None: out of reach, no
    point); a PNG with matplotlib, else an SVG of the second panel. Returns the path written."""
    plt = _pyplot()
    if plt is None:
        return _plot_svg(path_png.with_suffix(".svg"), gpus, needed, title, scale=1.0,
                         unit="Gb/s")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    for name, ys in utilisation.items():
        pts = [(g, 100.0 * u) for g, u in zip(gbps, ys) if u is not None]
        if pts:
            style = _local_steps_style(name)
            left.plot(*zip(*pts), lw=1.5, alpha=0.85, label=label(name), color=style["color"],
                      linestyle=style["linestyle"])
    for pct in (90, 95):
        left.axhline(pct, color="grey", lw=0.8, linestyle=":")
    left.set_xscale("log")
    left.set_ylim(50, 100.5)
    left.set_xlabel("NIC bandwidth per node (Gb/s)")
    left.set_ylabel("predicted compute utilisation (%)")
    left.set_title(f"compute utilisation at {n} GPUs", fontsize=9)
    left.grid(True, which="both", alpha=0.3)
    for name, ys in needed.items():
        pts = [(g, y) for g, y in zip(gpus, ys) if y is not None]
        if pts:
            style = _local_steps_style(name)
            right.plot(*zip(*pts), ms=4, lw=1.5, alpha=0.85, label=label(name), **style)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("GPUs n (8 per node)")
    right.set_ylabel(f"NIC Gb/s per node for {100 * target:.0f}% utilisation")
    right.set_title(f"bandwidth needed for {100 * target:.0f}% (no point: out of reach)",
                    fontsize=9)
    right.grid(True, which="both", alpha=0.3)
    handles, labels = right.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return path_png


def _plot_svg(path: Path, ns: List[int], series: Dict[str, List[Optional[float]]], title: str,
              scale: float = 1e3, unit: str = "ms") -> Path:
    """The same plot as plain SVG, so a machine without matplotlib still gets a picture (values
    times ``scale``, in ``unit``: seconds as ms by default)."""
    w, h, pad = 720, 420, 60
    xs = [math.log2(n) for n in ns]
    ys = [y * scale for v in series.values() for y in v if y is not None]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = 0.0, max(ys) * 1.05 if ys else 1.0
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: E731
    sy = lambda y: h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)  # noqa: E731
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="12">{title}</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>']
    for n, x in zip(ns, xs):
        parts.append(f'<text x="{sx(x)}" y="{h - pad + 15}" font-size="10" '
                     f'text-anchor="middle">{n}</text>')
    parts.append(f'<text x="10" y="{pad - 8}" font-size="10">{y1:.0f} {unit}</text>')
    for i, (name, vals) in enumerate(series.items()):
        pts = " ".join(f"{sx(x):.1f},{sy(y * scale):.1f}" for x, y in zip(xs, vals)
                       if y is not None)
        c = colors[i % len(colors)]
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{w - pad + 5}" y="{pad + 14 * i}" font-size="10" fill="{c}">'
                     f'{label(name)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))
    return path

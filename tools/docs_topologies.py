"""Pictures of the built-in topologies' communication graphs, drawn from decentpy's own schedules.

``python -m tools.docs_topologies [OUT_DIR]`` (default docs/_generated/topologies), and docs/conf.py
at every docs build. For each case (topology, n workers, L per node) one PNG: a panel per step of
the period, the workers on a circle (nodes as coloured pairs/quads), an edge between every two
workers that average together at that step (from ``Topology.groups(step)``: what the wrapper
runs), solid inside a node and dashed across nodes; the title gives both spectral gaps.
"""

from __future__ import annotations

import math
import os
import sys
from typing import List, Sequence, Tuple

# (name, n, L): the built-ins at the docs' reference size, plus sizes that are not powers of two
CASES: Sequence[Tuple[str, int, int]] = (
    ("complete", 8, 2),
    ("ring", 8, 2),
    ("one-peer-exp", 8, 2),
    ("alternating-exp-ring", 8, 2),
    ("ring", 7, 1),
    ("one-peer-exp", 6, 2),
    ("alternating-exp-ring", 6, 2),
)


def file_name(name: str, n: int, local: int) -> str:
    return f"{name}-n{n}-L{local}.png"


def _edges(groups) -> List[Tuple[int, int]]:
    out = []
    for g in groups:
        r = list(g.ranks)
        out += [(r[i], r[j]) for i in range(len(r)) for j in range(i + 1, len(r))]
    return out


def draw(name: str, n: int, local: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import decentpy

    topo = decentpy.make_topology(name, n, local)
    period = topo.period
    cols = min(period, 4)
    rows = math.ceil(period / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.8 * rows + 0.4), squeeze=False)
    pos = [(math.cos(math.pi / 2 - 2 * math.pi * i / n), math.sin(math.pi / 2 - 2 * math.pi * i / n))
           for i in range(n)]
    colours = plt.get_cmap("tab10")
    for step in range(rows * cols):
        ax = axes[step // cols][step % cols]
        ax.set_axis_off()
        ax.set_aspect("equal")
        if step >= period:
            continue
        groups = topo.groups(step)
        for a, b in _edges(groups):
            same_node = a // local == b // local
            ax.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], color="0.25" if same_node else "tab:red",
                    linestyle="-" if same_node else "--", linewidth=1.4, zorder=1)
        for i, (x, y) in enumerate(pos):
            ax.scatter([x], [y], s=260, color=colours((i // local) % 10), edgecolor="black", zorder=2)
            ax.text(x, y, str(i), ha="center", va="center", fontsize=8, zorder=3)
        ax.set_title(f"step {step} mod {period}", fontsize=9)
        ax.set_xlim(-1.3, 1.3)
        ax.set_ylim(-1.3, 1.3)
    fig.suptitle(f"{name}, n={n}, L={local}: spectral gap {topo.spectral_gap():.3f} (average), "
                 f"{topo.period_spectral_gap():.3f} (period)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def generate(out_dir: str) -> List[str]:
    """Draw every case into ``out_dir``; returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, n, local in CASES:
        path = os.path.join(out_dir, file_name(name, n, local))
        draw(name, n, local, path)
        written.append(path)
    return written


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join("docs", "_generated", "topologies")
    for p in generate(target):
        print(p)

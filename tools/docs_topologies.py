"""Pictures of the built-in topologies' communication graphs, drawn from decentpy's own schedules.

``python -m tools.docs_topologies [OUT_DIR]`` (default docs/images/topologies, committed so that
the pictures show where the Markdown is read, e.g. on the repository's web page), and docs/conf.py
at every docs build, which redraws only the pictures whose schedule changed. For each case
(topology, n workers, L per node) one PNG: a panel per step of the period, the workers on a circle
(nodes as coloured pairs/quads), an edge between every two workers that average together at that
step (from ``Topology.groups(step)``: what the wrapper runs), solid inside a node and dashed across
nodes; the title gives both spectral gaps. Each PNG carries the fingerprint of what it shows
(a ``decentpy-schedule`` text chunk), so a stale picture is found without drawing it again.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
from typing import List, Optional, Sequence, Tuple

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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "docs", "images", "topologies")
# bump when draw() changes what a picture looks like: every picture is then redrawn
DRAWING_VERSION = 1
KEY = "decentpy-schedule"


def file_name(name: str, n: int, local: int) -> str:
    return f"{name}-n{n}-L{local}.png"


def fingerprint(name: str, n: int, local: int) -> str:
    """What a picture shows: the groups and weights of every step of the period and the spectral
    gaps of its title, hashed (with :data:`DRAWING_VERSION`)."""
    import decentpy

    topo = decentpy.make_topology(name, n, local)
    steps = [sorted((tuple(g.ranks), round(g.weight, 12)) for g in topo.groups(s)) for s in range(topo.period)]
    text = repr((DRAWING_VERSION, name, n, local, steps, f"{topo.spectral_gap():.3f}",
                 f"{topo.period_spectral_gap():.3f}"))
    return hashlib.sha256(text.encode()).hexdigest()


def stored_fingerprint(path: str) -> Optional[str]:
    """The fingerprint a PNG was drawn with (its ``decentpy-schedule`` tEXt chunk), None if it has
    none or is not there. Reads the chunks directly: no matplotlib needed."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    pos = 8  # after the PNG signature
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"tEXt":
            key, _, value = data[pos + 8:pos + 8 + length].partition(b"\0")
            if key.decode("latin-1") == KEY:
                return value.decode("latin-1")
        pos += 12 + length
    return None


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
    fig.savefig(path, dpi=90, metadata={KEY: fingerprint(name, n, local)})
    plt.close(fig)


def generate(out_dir: str = OUT_DIR, force: bool = False) -> List[str]:
    """Draw every case whose picture in ``out_dir`` is missing or shows another schedule (every case
    with ``force``); returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, n, local in CASES:
        path = os.path.join(out_dir, file_name(name, n, local))
        if force or stored_fingerprint(path) != fingerprint(name, n, local):
            draw(name, n, local, path)
            written.append(path)
    return written


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else OUT_DIR
    for p in generate(target, force=True):
        print(p)

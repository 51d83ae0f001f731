"""matplotlib for the benchmarks' figures: optional (a missing matplotlib skips the plot, with a
line saying so), drawn off-screen, saved the same way by every benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure", "finish_axes", "finish_figure"]


def pyplot(hint: str = "") -> Any:
    """matplotlib's pyplot on the Agg backend; None, after printing why there is no plot (and
    ``hint``, e.g. the make target that installs it), when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot" + (f" ({hint})" if hint else ""))
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (the folder is created) and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_axes(ax: Any, ylabel: str, title: str, *, grid_axis: str = "both", legend_size: int = 8) -> None:
    """The common dressing of one panel: y label, small title, light grid, legend."""
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.grid(True, axis=grid_axis, alpha=0.3)
    ax.legend(fontsize=legend_size)


def finish_figure(fig: Any, suptitle: str, path: Path, fontsize: int = 8) -> Path:
    """Title the whole figure (what was measured, on which machine) and save it (see save_figure)."""
    fig.suptitle(suptitle, fontsize=fontsize)
    return save_figure(fig, path)

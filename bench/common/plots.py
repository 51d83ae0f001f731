"""matplotlib for the benchmarks' figures: optional (a missing matplotlib skips the plot, with a
line saying so), drawn off-screen, saved the same way by every benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure"]


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

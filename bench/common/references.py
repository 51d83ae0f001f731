"""The reference frameworks the benchmarks compare decentpy with, when they are installed.

fairscale is installed by the bench targets that need it (``--no-deps``: it depends on an
unpinned torch, which would replace the venv's CPU torch with CUDA wheels), not by ``make
build``; each bench skips it with the same message when it does not import.
"""

from __future__ import annotations

from typing import Optional

from decentpy.version import FAIRSCALE_VERSION

__all__ = ["FAIRSCALE_VERSION", "fairscale_missing"]


def fairscale_missing(make_target: str) -> Optional[str]:
    """Why fairscale cannot be the reference here (None: it imports); ``make_target`` installs it.
    Prints a note when another version than the pinned one is installed."""
    try:
        import fairscale
        import fairscale.nn.data_parallel  # noqa: F401
        import fairscale.optim  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip, and say why
        return (f"`import fairscale` failed ({type(exc).__name__}: {exc}); install it with "
                f"`pip install --no-deps fairscale=={FAIRSCALE_VERSION}` (or run `make {make_target}`)")
    if fairscale.__version__ != FAIRSCALE_VERSION:
        print(f"note: fairscale {fairscale.__version__} installed, the benchmark is meant for {FAIRSCALE_VERSION}")
    return None

"""``python -m decentpy``: print the build and runtime configuration. Exit status 1 when the
extension cannot be used here (the report's extension row says why and what to do)."""

import sys

from .config import show_config
from .environment import load_extension

if __name__ == "__main__":
    show_config()
    try:
        load_extension()
    except ImportError:
        sys.exit(1)

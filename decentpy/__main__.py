"""``python -m decentpy``: print the build and runtime configuration."""

from .config import show_config

if __name__ == "__main__":
    show_config()

"""``python -m tools.runtime_model [--help]``: the runtime model's command line (``make runtime-model``)."""

import sys

from .cli import main

sys.exit(main())

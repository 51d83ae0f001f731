"""decentpy's version.

``__version__`` is the version of the installed build, the one ``pip show decentpy`` and the wheel's
file name carry: the release below plus the PEP 440 local version naming what was compiled, e.g.
``0.1.0+cu130.torch213.sm80.sm90`` (CUDA 13.0 kernels for sm_80 and sm_90, compiled against torch
2.13) or ``0.1.0+cpu.torch213``. setup.py writes it to ``decentpy/_build_info.py`` at build time.
In a source tree that was never built, ``__version__`` is the bare release. ``base_version`` is
always the release, for comparisons (``packaging.version.Version(decentpy.__version__).public``
gives the same).
"""

# The release. setup.py reads this line (and appends the local version); keep it a plain literal.
__version__ = "0.1.0"
base_version = __version__

try:  # the build's full version, when setup.py recorded it
    from ._build_info import version as __version__  # noqa: F811
except ImportError:  # a source tree without a build
    pass

# The fairscale release whose OSS / ShardedDataParallel / AsyncPipe API and results decentpy
# follows (its benchmarks and the fairscale test harness in tools/ compare against this one).
FAIRSCALE_VERSION = "0.4.13"

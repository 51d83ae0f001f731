"""The benchmarks. Run them from the repository root as modules (``python -m bench.bench_train
--quick``; the ``make bench-*`` targets do), so that they import :mod:`bench.common` and
:mod:`tools` by their package names."""

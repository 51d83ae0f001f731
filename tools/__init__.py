"""Developer tools beside the library (not shipped in the wheel): the spawn harness the tests and
benchmarks share (:mod:`tools.spawn`), the analytic runtime model (:mod:`tools.runtime_model`) and
the fairscale compatibility runner (``tools/fairscale_compat.py``).

Import them with the repository root on ``sys.path``: pytest adds it (``pythonpath`` in
pyproject.toml), ``python -m tools.runtime_model`` and ``python -m bench.<name>`` from the root do.
"""

"""Analytic per-iteration runtime model of all-reduce DDP, decentralized gossip and the hybrid
modes: ``model`` (the model; imports nothing else of the package), ``fit`` (calibration on the
benchmarks' CSVs, SciPy), ``plots`` and ``cli`` (``python -m tools.runtime_model``)."""

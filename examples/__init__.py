"""The examples are scripts (``torchrun examples/train_digits.py``); a package as well, so that
``bench/bench_convergence.py`` imports train_digits' data, model and helpers instead of copying them."""

"""A byte-level transformer language model on real text (issue 42): the corpus, the model and the
training loop that both ``examples/train_lm.py`` and the ``bench-lm`` benchmark run, so that the
example a user launches and the benchmark's figures come from one implementation.

- :mod:`examples.lm.corpus`: the Python standard library's own ``*.py`` files (or ``--corpus``), as
  bytes, with a fixed held-out split by file and deterministic per-rank batches.
- :mod:`examples.lm.model`: a decoder-only transformer in ``torch.nn`` (presets ``small``, ``wide``).
- :mod:`examples.lm.loop`: one arm (torch DDP, DDP + PowerSGD, decentpy, decent-dp) for one seed,
  returning one row per evaluation.
"""

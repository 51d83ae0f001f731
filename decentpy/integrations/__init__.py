"""decentpy inside training frameworks: :mod:`.lightning` (PyTorch Lightning strategies; needs
``pytorch_lightning`` or ``lightning``, an optional dependency)."""

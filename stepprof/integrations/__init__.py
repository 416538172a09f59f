"""stepprof inside the training loops that frameworks own.

- :mod:`stepprof.integrations.lightning`: ``StepprofCallback`` for Lightning's
  ``Trainer``, and ``sweep`` (a knee-aware batch-size finder for a LightningModule).
- :mod:`stepprof.integrations.transformers`: ``StepprofCallback`` for Hugging Face's
  ``Trainer``, and ``sweep`` for it.

Each is imported on its own; ``import stepprof`` never imports a framework.
"""

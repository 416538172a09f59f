"""The batch-size sweep behind :func:`stepprof.sweep`.

- ``search``: ``sweep()`` and the search that grows, refines the memory boundary
  and backfills.
- ``trial``: one trial at one batch size (steps, timing, out-of-memory detection
  and clean-up, the peak read).
- ``rules``: pure decisions over the points (knee, thrash zone, memory fit, the
  next probe, recommendation and its reason); ``verdict`` builds the result from them.
- ``output``: the sweep's log records and progress lines.
- ``restore``: saving and restoring the user's state; the muted profiler.
- ``result`` and ``plot``: the records and their PNG.

This file imports nothing, so that the records (``result``) load without torch.
"""

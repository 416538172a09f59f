"""Everything stepprof asks of the GPU, behind one boundary.

- :mod:`.backend`: the :class:`~.backend.Backend` contract and its capabilities, the
  host backends (no CUDA).
- :mod:`.cuda`: the CUDA backends (the Python boundary).
- :mod:`.compiled`: the compiled boundary (``stepprof build``) and its backend.
- :mod:`.select`: the choice of a backend (``select_backend``, ``select_sweep_backend``,
  ``memory_backend``, ``upgrade_from_host``).
- :mod:`.sync_routes`: the "warn" and "trace" routes that bring torch's host-device
  waits to :mod:`stepprof._syncs`.
- :mod:`.exchange`: the NCCL exchange's buffers (:mod:`stepprof._dist`).
- :mod:`.calibrate`: ``stepprof calibrate``, this GPU's achieved rates.
- :mod:`.facts`: device and allocator facts for ``stepprof env`` and the records.
- :mod:`.nvml`: the only module that imports ``pynvml``.

Process-wide state, one object per module, each with a ``reset()``:
``sync_routes.ROUTES``, ``exchange.SIDE_STREAMS``, ``nvml.NVML``.
"""

"""stepprof: honest numbers about a PyTorch training step.

Wrap a step with :func:`profile_step` (or decorate it with :func:`measure`)
inside a :class:`Profiler`; each step's GPU time (CUDA events, read back
lazily, no added synchronisation), wall time and peak memory go to a
JSON-lines log that :func:`read` streams back.  :func:`memory_report` reconciles
PyTorch's memory figures with nvidia-smi's and explains the difference.
:func:`sweep` measures samples/s and peak memory over batch sizes and
recommends one.
"""

from ._api import configure, measure, memory_report, profile_step
from ._errors import ConfigError, StepprofError, SyncBudgetExceeded, UsageError
from ._log import SCHEMA_VERSION, read
from ._memory import MemoryReport
from ._profiler import Profiler
from ._records import Percentiles, Summary, SweepPoint, SweepResult
from ._sweep import sweep

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "MemoryReport",
    "Percentiles",
    "Profiler",
    "SCHEMA_VERSION",
    "StepprofError",
    "Summary",
    "SweepPoint",
    "SweepResult",
    "SyncBudgetExceeded",
    "UsageError",
    "configure",
    "measure",
    "memory_report",
    "profile_step",
    "read",
    "sweep",
]

"""stepprof: honest numbers about a PyTorch training step.

Wrap a step with :func:`profile_step` (or decorate it with :func:`measure`)
inside a :class:`Profiler`; each step's GPU time (CUDA events, read back
lazily, no added synchronisation), wall time and peak memory go to a
JSON-lines log that :func:`read` streams back.  :func:`memory_report` reconciles
PyTorch's memory figures with nvidia-smi's and explains the difference.
:func:`sweep` measures samples/s and peak memory over batch sizes and
recommends one.
"""

import typing

from ._errors import (
    BuildError, ConfigError, MissingExtraError, StepprofError, StepprofWarning, SyncBudgetExceeded, UsageError,
)
from ._frame import frame
from ._log import read
from ._records import Percentiles, PhaseFigures, Summary
from ._schema import SCHEMA_VERSION
from ._sweep.result import SweepPoint, SweepResult

if typing.TYPE_CHECKING:
    from ._api import configure, explain_peak, iterate, measure, memory_report, profile_step
    from ._memory import MemoryReport
    from ._peak import PeakExplanation
    from ._recorder.profiler import Profiler
    from ._sweep.search import sweep

del typing

#: The one source of the version: pyproject.toml reads it, ``stepprof --version`` prints it.
__version__ = "0.2.0.dev0"

__all__ = [
    "BuildError",
    "ConfigError",
    "MemoryReport",
    "MissingExtraError",
    "PeakExplanation",
    "Percentiles",
    "PhaseFigures",
    "Profiler",
    "SCHEMA_VERSION",
    "StepprofError",
    "StepprofWarning",
    "Summary",
    "SweepPoint",
    "SweepResult",
    "SyncBudgetExceeded",
    "UsageError",
    "configure",
    "explain_peak",
    "frame",
    "iterate",
    "measure",
    "memory_report",
    "profile_step",
    "read",
    "sweep",
]


def __getattr__(name: str) -> object:
    # These names need torch, which takes seconds to import: they are loaded at first
    # use, so that `stepprof report` and `stepprof.read` start without it.
    module = {
        "MemoryReport": "_memory",
        "Profiler": "_recorder.profiler",
        "PeakExplanation": "_peak",
        "configure": "_api",
        "explain_peak": "_api",
        "iterate": "_api",
        "measure": "_api",
        "memory_report": "_api",
        "profile_step": "_api",
        "sweep": "_sweep.search",
    }.get(name)
    if module is None:
        raise AttributeError(f"module 'stepprof' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public names only: not the private modules that importing them adds as attributes.
    return sorted([*__all__, "__version__"])

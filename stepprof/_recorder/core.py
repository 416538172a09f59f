"""The step core: a profiler's boundaries on the training thread in one C call each.

``stepprof/_core.c`` (in stepprof's C module, :mod:`stepprof._native`) does what
:class:`~.boundaries.Boundaries` does at the common boundaries: a step's entry and exit, a
phase's entry and exit, on the same objects.  It leaves every other boundary to
``Boundaries`` before changing anything, and hands an exception inside one to
``Boundaries.entry_failed``/``exit_failed``, so the two paths leave the same state
(``tests/test_core.py``).  Without the C module (no C compiler), or with
``boundary="python"``, the profiler's scopes call ``Boundaries`` directly.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import _native, _syncs
from .._batch import NO_BATCH
from .._device.backend import MARK, POP, PUSH, READ, RESET
from .._syncs import SyncTracker
from .backend_slot import BackendSlot
from .boundaries import LIGHT_PHASE
from .hooks import ActiveHooks
from .measure import error_message
from .step import OpenPhase, PhaseTotals, Step
from .threads import Threads, ThreadSteps

__all__ = ["make_core", "reason"]


class _State:
    """The C module whose step core is configured (None: none), and why not."""

    module: ModuleType | None = None
    reason: str | None = None


_STATE = _State()


def _configure() -> None:
    """Configure the loaded C module's step core (called again whenever the module changes)."""
    mod = _native.module()
    if mod is None:
        _STATE.module, _STATE.reason = None, _native.reason()
        return
    if not hasattr(mod, "Core"):
        _STATE.module, _STATE.reason = None, "the C module has no step core: rebuild it (`stepprof build`)"
        return
    try:
        mod.configure_core(
            Step, Step(0, "", False, None), OpenPhase, OpenPhase(""), PhaseTotals, PhaseTotals(0),
            ThreadSteps, Threads, ActiveHooks, BackendSlot, NO_BATCH, LIGHT_PHASE, error_message,
            (MARK, READ, RESET, PUSH, POP), SyncTracker, _syncs._trackers,
        )
    except (TypeError, ValueError) as e:  # a class changed shape: the Python boundaries go on
        _STATE.module, _STATE.reason = None, f"the step core could not be configured ({e}): rebuild it (`stepprof build`)"
        return
    _STATE.module, _STATE.reason = mod, None


def make_core(boundaries: Any, boundary: str) -> Any | None:
    """The step core for ``boundaries`` (``.enter``, ``.exit``), or None: the profiler's
    scopes then call ``boundaries`` themselves."""
    mod = _STATE.module
    if mod is None or boundary == "python":
        return None
    return mod.Core(boundaries)


def reason(boundary: str) -> str | None:
    """Why a profiler's boundaries run in Python (None: in the step core)."""
    if boundary == "python":
        return "boundary='python' was asked for"
    return _STATE.reason


_native.use(_configure)

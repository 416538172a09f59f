"""The routes that bring torch's host-device waits to :mod:`stepprof._syncs`.

"warn": torch's sync-debug mode "warn" makes every stream-level wait (``.item()``,
copies to the host, ``nonzero``, ``Stream.synchronize``...) issue a UserWarning on
the calling thread, which ``_syncs.WarningTap`` counts; it costs nothing until a
sync happens.  It misses device and event waits, so ``torch.cuda.synchronize``,
``torch.accelerator.synchronize`` and ``torch.cuda.Event.synchronize`` are wrapped.
``torch.Event`` is an immutable C type and cannot be wrapped.

"trace": torch's private GPU-trace callbacks see every wait, but torch calls into
Python on every allocation and free once they are active (for good: activation
cannot be undone), which costs a few percent on an allocation-heavy step.

Each route is a :class:`stepprof._syncs.Route`: installed when the first profiler
session that uses it opens, uninstalled when the last one closes.  Their
process-wide state is one object, :data:`ROUTES`.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from .. import _syncs
from .._errors import SyncBudgetExceeded, raised_by_user
from .._registry import register_state

__all__ = [
    "ROUTES",
    "TraceRoute",
    "WarnRoute",
    "enable_gpu_trace",
    "on_device_sync",
    "on_event_sync",
    "on_stream_sync",
    "register_repeat_interleave_probe",
    "repeat_interleave_waits",
    "set_sync_debug_mode",
    "trace_route",
    "waiter",
    "warn_route",
]

_UTILS_FILE = os.path.join(os.path.dirname(torch.__file__), "_utils.py")
#: Frames in stepprof's device package (this route's callbacks, a backend's own waits)
#: are skipped on the way to the frame that made a traced wait, as are torch's
#: callback-firing helpers in ``torch/_utils.py``.
_DEVICE_DIR = os.path.dirname(__file__) + os.sep

#: torch's sync-debug modes, by number (``torch.cuda.set_sync_debug_mode``).
MODE_NAMES = {0: "default", 1: "warn", 2: "error"}


class _RouteState:
    """The sync routes' process-wide state.  :meth:`reset` forgets what can be forgotten."""

    __slots__ = ("warn_route", "trace_route", "trace_registered", "trace_on", "trace_probe",
                 "prototype_quiet")

    def __init__(self) -> None:
        #: The "warn" route, built at its first use.
        self.warn_route: WarnRoute | None = None
        #: The "trace" route (its on-flag is :attr:`trace_on`).
        self.trace_route = TraceRoute()
        #: torch's GPU-trace callbacks are registered (for good: they cannot be removed).
        self.trace_registered = False
        #: A session holds the "trace" route: the callbacks count (else they return).
        self.trace_on = False
        #: Set while :func:`enable_gpu_trace` checks that the callbacks fire: they list here.
        self.trace_probe: list[str | None] | None = None
        #: torch's warning that the sync-debug mode is a prototype has been silenced.
        self.prototype_quiet = False

    def reset(self) -> None:
        """Forget the warn route and turn the trace callbacks off.

        The callbacks' registration stays (torch cannot unregister them), and so
        does the silenced prototype warning (torch issues it once per process).
        Call it after :func:`stepprof._syncs.close_all` (the registry's reset does).
        """
        self.warn_route = None
        self.trace_on = False
        self.trace_probe = None


# Set on a thread while one of the wrappers below runs its original: a wrapper reached
# from inside another one (a user's replacement, made during a session, that calls the
# wrapper it replaced, and is wrapped in turn) is the same wait.
# Per thread and restored on every exit, so it is not part of ROUTES.
_waiting = threading.local()


# -- "warn" ------------------------------------------------------------------------


def waiter(original: Callable[..., Any], hint: str, route: Any) -> Callable[..., Any]:
    """``original`` wrapped to report each call as a wait of kind ``hint`` while ``route``
    is installed (a wrapper kept by someone after that passes straight through)."""

    @functools.wraps(original)
    def wait(*args: Any, **kwargs: Any) -> Any:
        if route.installed and not getattr(_waiting, "on", False):
            _syncs.dispatch(hint, sys._getframe(1))
            _waiting.on = True
            try:
                return original(*args, **kwargs)
            finally:
                _waiting.on = False
        return original(*args, **kwargs)

    return wait


def set_sync_debug_mode(mode: int) -> None:
    """torch's sync-debug mode, set without torch's once-per-process prototype warning."""
    if not ROUTES.prototype_quiet:
        ROUTES.prototype_quiet = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._C._cuda_set_sync_debug_mode(mode)
        return
    torch._C._cuda_set_sync_debug_mode(mode)


def _mode_name(mode: int) -> str:
    return repr(MODE_NAMES.get(mode, mode))


class WarnRoute:
    """The "warn" mechanism: the sync-debug mode, the warnings tap, three wrappers.

    Installed once per session (:meth:`install`), checked at each watched step
    (:meth:`ensure`: identity checks, nothing allocated while nothing moved), restored at
    the session's close (:meth:`uninstall`) to what the user had when it started, except
    what the user changed since, which is left as they set it.
    """

    traced = False

    def __init__(self) -> None:
        targets = [(torch.cuda, "synchronize", "device_synchronize"),
                   (torch.cuda.Event, "synchronize", "event_synchronize")]
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None and hasattr(accelerator, "synchronize"):
            targets.append((accelerator, "synchronize", "device_synchronize"))
        self.installed = False
        # [obj, name, hint, wrapper, the original it wraps]
        self.patches = [
            [obj, name, hint, waiter(getattr(obj, name), hint, self), getattr(obj, name)]
            for obj, name, hint in targets
        ]
        self.mode_was = 0
        self.tap: _syncs.WarningTap | None = None
        self._get_mode: Callable[[], int] = lambda: 0

    def install(self) -> None:
        self._get_mode = get = torch._C._cuda_get_sync_debug_mode
        mode = self.mode_was = get()
        if mode == 0:
            set_sync_debug_mode(1)
        try:
            # The user had "warn" on: count, and pass their warnings on as before.
            self.tap = _syncs.tap(forward=mode == 1)
            self.tap.install()
            self._wrap()
        except BaseException:
            self.uninstall()
            raise
        self.installed = True

    def _wrap(self) -> None:
        for p in self.patches:
            current = getattr(p[0], p[1])
            if current is not p[3]:
                if current is not p[4]:  # replaced (by the user): wrap theirs
                    p[3], p[4] = waiter(current, p[2], self), current
                setattr(p[0], p[1], p[3])

    def ensure(self) -> str | None:
        mode = self._get_mode()
        if mode != 1:
            if mode == 2:
                return ("torch's sync-debug mode is 'error' (set outside stepprof), so a sync "
                        "raises instead of being counted")
            return (f"torch's sync-debug mode was set to {_mode_name(mode)}"
                    f"{' (off)' if mode == 0 else ''} outside stepprof during the run; "
                    f"stepprof gives way while it stays so")
        tap = self.tap
        if tap is not None:
            tap.ensure()
        for p in self.patches:
            if getattr(p[0], p[1]) is not p[3]:
                with _syncs.LOCK:
                    self._wrap()
                break
        return None

    def checks(self) -> tuple[_syncs.Check, ...] | None:
        """:meth:`ensure`'s checks as data (tests/test_sync_routes.py holds the two to agree)."""
        tap = self.tap
        if not self.installed or tap is None:
            return None
        return ((self._get_mode, None, None, 1), *tap.checks(),
                *((p[0], p[1], None, p[3]) for p in self.patches))

    def uninstall(self) -> None:
        self.installed = False
        try:
            for obj, name, _, wrapper, original in self.patches:
                if getattr(obj, name) is wrapper:  # else the user patched it since: leave theirs
                    setattr(obj, name, original)
            if self.tap is not None:
                self.tap.uninstall()
                self.tap = None
        finally:
            # Still ours ("warn")?  Else the user set a mode of their own meanwhile: leave it.
            if self.mode_was == 0 and torch._C._cuda_get_sync_debug_mode() == 1:
                torch._C._cuda_set_sync_debug_mode(0)


def warn_route() -> WarnRoute:
    """The process's "warn" route (made at its first use)."""
    if ROUTES.warn_route is None:
        ROUTES.warn_route = WarnRoute()
    return ROUTES.warn_route


# -- "trace" -----------------------------------------------------------------------


def _trace_fire(hint: str | None) -> None:
    probe = ROUTES.trace_probe
    if probe is not None:
        probe.append(hint)
        return
    if not ROUTES.trace_on:
        return  # callbacks cannot be unregistered: this flag gates them
    origin: FrameType | None = sys._getframe(1)
    while origin is not None and (
        origin.f_code.co_filename.startswith(_DEVICE_DIR) or origin.f_code.co_filename == _UTILS_FILE
    ):
        origin = origin.f_back
    if origin is not None:
        try:
            _syncs.dispatch(hint, origin, traced=True)
        except SyncBudgetExceeded as e:  # torch would log it and go on: the step raises it
            _syncs.defer(e)
    else:  # a thread of torch's own (C++ autograd's): no Python caller, so no step open on it
        _syncs.count_elsewhere(traced=True)


def on_device_sync(*_: Any) -> None:
    """torch's GPU-trace callback for a device synchronisation."""
    _trace_fire("device_synchronize")


def on_stream_sync(*_: Any) -> None:
    """torch's GPU-trace callback for a stream synchronisation."""
    _trace_fire(None)


def on_event_sync(*_: Any) -> None:
    """torch's GPU-trace callback for an event synchronisation."""
    _trace_fire("event_synchronize")


def enable_gpu_trace(index: int) -> str | None:
    """Register the GPU-trace callbacks (once) and check that one fires; None if it does.

    The check waits on an event recorded on a fresh, idle side stream, so it does not
    wait for any of the user's work.
    """
    try:
        import torch.cuda._gpu_trace as gt  # private: imported only when "trace" is asked for

        activate = torch._C._activate_gpu_trace
        if not ROUTES.trace_registered:
            gt.register_callback_for_device_synchronization(on_device_sync)
            gt.register_callback_for_stream_synchronization(on_stream_sync)
            gt.register_callback_for_event_synchronization(on_event_sync)
            activate()
            ROUTES.trace_registered = True
        probe: list[str | None] = []
        ROUTES.trace_probe = probe
        try:
            side = torch.cuda.Stream(index)
            ev = torch.cuda.Event()
            ev.record(side)
            ev.synchronize()
        finally:
            ROUTES.trace_probe = None
    except Exception as e:  # noqa: BLE001 - a private API: any failure means "not available"
        if raised_by_user(e):
            raise
        return f"torch's GPU-trace callbacks are unavailable ({type(e).__name__}: {e})"
    if "event_synchronize" not in probe:
        return "torch's GPU-trace callbacks did not fire in the start-up self-test"
    return None


class TraceRoute:
    """The "trace" mechanism: the (registered) callbacks count while a session holds it."""

    traced = True

    def install(self) -> None:
        ROUTES.trace_on = True

    def uninstall(self) -> None:
        ROUTES.trace_on = False

    def ensure(self) -> None:
        return None

    def checks(self) -> tuple[_syncs.Check, ...]:
        return ()


def trace_route() -> TraceRoute:
    """The process's "trace" route."""
    return ROUTES.trace_route


ROUTES = register_state(_RouteState())


# -- measuring a multi-wait op -----------------------------------------------------


def repeat_interleave_waits(index: int) -> int:
    """How many waits one call of ``repeat_interleave`` without ``output_size`` makes.

    Registered as the ``repeat_interleave`` probe of :mod:`stepprof._syncs`, which runs
    it once per process, at the first wait it sees of that kind: from inside the
    user's own call, so its kernels are loaded already.  It runs on a fresh, idle side
    stream, so its waits drain nothing of the user's, and its waits are counted, through
    the mechanism in use, by a :class:`stepprof._syncs.WaitCounter` pushed on this
    thread.  torch 2.4-2.13 read two figures back (the output size, and a check that
    no repeat is negative): 2.  That is torch's implementation, so it is measured.
    """
    counter = _syncs.WaitCounter()
    _syncs.attach(counter)
    try:
        side = torch.cuda.Stream(index)
        with torch.cuda.stream(side):
            torch.repeat_interleave(torch.ones(2, dtype=torch.long, device=torch.device("cuda", index)))
    finally:
        _syncs.detach(counter)
    return counter.waits


def register_repeat_interleave_probe(index: int) -> None:
    """Register :func:`repeat_interleave_waits` on device ``index`` in ``_syncs.PROBES``,
    unless a probe for that kind is registered already."""
    _syncs.PROBES.setdefault("repeat_interleave", functools.partial(repeat_interleave_waits, index))

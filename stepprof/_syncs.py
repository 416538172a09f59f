"""Sync points: which of the user's lines made the host wait for the GPU, and how often.

This module is pure Python.  A *mechanism* (in :mod:`stepprof._device.sync_routes`) notices
each host-device synchronisation and calls :func:`dispatch` with a kind hint and
the Python frame that made the call.  The :class:`SyncTracker` of the step open
on that thread then

* walks out of torch's and stepprof's own frames to the first other frame: the
  user's line (``where``);
* names the kind from the bytecode instruction that frame is executing and the
  source text of its expression (``loss.item()`` is ``item``, ``if t > 0:`` is
  ``bool``, ``x[mask]`` is ``mask_index``...), cached per code object and offset;
* folds the waits made inside torch's Python code on behalf of one call into
  one count: ``print(t)`` waits about a dozen times inside torch's formatting
  code, but it is one sync point of the user's.  ``waits`` keeps the raw number.
  A C++ op that waits several times in one call (``repeat_interleave``
  without ``output_size`` waits twice) looks, from Python, exactly like that many
  calls in a loop: same frame, same instruction.  Its waits per call are
  measured once per process, at the first wait of that kind (:data:`PROBES`,
  :data:`WAITS_PER_CALL`), and each group of that many waits at one site counts
  as one call;
* applies the step's sync budget (``max_syncs``, ``on_sync``).

The warning route's plumbing is here too (:class:`WarningTap`): torch's
sync-debug mode "warn" turns each sync into a ``UserWarning``; a front filter
("always", for that message only) and a hook in place of
``warnings._showwarnmsg`` turn it into a count, and every other warning goes on
to the original, and so to ``showwarning``, unchanged.

The hub holds the routes per *session* (a profiler, from its first watched step to
its close): a route is installed when its first session opens and restored when
its last one closes, at fork (in the child) and at interpreter exit.  Per step, only
the thread's tracker is pushed and popped, after a check that the route is still in
place (:meth:`Route.ensure`).  A wait on a thread with no open step counts in every
open session's ``outside`` (``syncs_outside_steps``) and in other threads' open
steps' ``other_threads``.
"""

from __future__ import annotations

import ast
import atexit
import dis
import linecache
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from ._errors import StepprofWarning, SyncBudgetExceeded, raised_by_user
from ._registry import register_state

__all__ = [
    "OWN_WAITS",
    "SYNC_MESSAGE",
    "Route",
    "SyncSession",
    "SyncTracker",
    "Sessions",
    "WarningTap",
    "attach",
    "classify",
    "close_all",
    "close_session",
    "count_elsewhere",
    "defer",
    "detach",
    "dispatch",
    "open_session",
]

#: The text of torch's sync-debug warning (c10/cuda/CUDAFunctions.cpp).
SYNC_MESSAGE = "called a synchronizing CUDA operation"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STEPPROF_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Frames under these paths are torch's or stepprof's own: the walk to the user's line
#: skips them (one ``str.startswith`` per frame).
_INTERNAL_PREFIXES: tuple[str, ...] = (_TORCH_DIR, _STEPPROF_DIR)

# The last name of the callee -> kind.  "to" and "copy_" are decided by their arguments.
_CALLEE_KIND = {
    "item": "item",
    "tolist": "tolist",
    "cpu": "to_host",
    "numpy": "to_host",
    "cuda": "to_device",
    "tensor": "to_device",
    "as_tensor": "to_device",
    "bool": "bool",
    "__bool__": "bool",
    "float": "scalar",
    "int": "scalar",
    "complex": "scalar",
    "__float__": "scalar",
    "__int__": "scalar",
    "__index__": "scalar",
    "nonzero": "nonzero",
    "argwhere": "nonzero",
    "where": "nonzero",
    "masked_select": "masked_select",
    "unique": "unique",
    "unique_consecutive": "unique",
    "repeat_interleave": "repeat_interleave",
    "print": "print",
    "str": "print",
    "repr": "print",
    "format": "print",
    "__str__": "print",
    "__repr__": "print",
    "__format__": "print",
    "synchronize": "stream_synchronize",
    "backward": "backward",
}
_CALL_OPS = frozenset(
    {"CALL", "CALL_KW", "CALL_FUNCTION_EX", "PRECALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD"}
)
_SUBSCRIPT_OPS = frozenset({"BINARY_SUBSCR"})
_BOOL_OPS = frozenset(
    {
        "POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE",
        "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE",
        "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP", "TO_BOOL", "UNARY_NOT",
    }
)
_FORMAT_OPS = frozenset({"FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC"})

_Site = tuple[str, str, str]  # (where, kind, code)


# -- naming a sync point -------------------------------------------------------

_where_cache: dict[str, str] = {}


def _display_path(filename: str) -> str:
    shown = _where_cache.get(filename)
    if shown is None:
        shown = filename
        try:
            rel = os.path.relpath(filename)
            if not rel.startswith(os.pardir):
                shown = rel
        except ValueError:  # another drive (Windows)
            pass
        _where_cache[filename] = shown
    return shown


def _segment(filename: str, positions: Any) -> str | None:
    if positions is None or positions.lineno is None or positions.col_offset is None:
        return None
    lines = [
        linecache.getline(filename, n) for n in range(positions.lineno, positions.end_lineno + 1)
    ]
    if not lines or not lines[0]:
        return None
    if len(lines) == 1:
        return lines[0][positions.col_offset : positions.end_col_offset]
    lines[0] = lines[0][positions.col_offset :]
    lines[-1] = lines[-1][: positions.end_col_offset]
    return " ".join(s.strip() for s in lines)


def _callee(text: str) -> tuple[str | None, str]:
    """(last name of the called function, its arguments' source) of a call expression."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None, ""
    if not isinstance(node, ast.Call):
        return None, ""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    args = " ".join(ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)])
    return name, args


def _kind_of_call(text: str) -> str | None:
    name, args = _callee(text)
    if name == "to" or name == "copy_":
        if "cpu" in args:
            return "to_host"
        if "cuda" in args:
            return "to_device"
        return "copy"
    return _CALLEE_KIND.get(name) if name else None


def classify(frame: Any) -> tuple[str | None, str]:
    """(kind or None, source text) of what ``frame`` is executing now.

    Reads the instruction at ``frame.f_lasti`` and its source positions
    (Python 3.11+); on older versions, the whole line.  The tracker caches the
    result per code object and offset (``_sites_by_code``), so a sync point costs
    a dictionary lookup after its first time.
    """
    code = frame.f_code
    kind: str | None = None
    text: str | None = None
    ins = None
    for i in dis.get_instructions(code):  # the instruction that owns f_lasti (or its caches)
        if i.offset > frame.f_lasti:
            break
        ins = i
    positions = getattr(ins, "positions", None)  # (Python 3.11+)
    if ins is not None and positions is not None:
        text = _segment(code.co_filename, positions)
        op = ins.opname
        if op in _CALL_OPS and text:
            kind = _kind_of_call(text)
        elif op in _SUBSCRIPT_OPS or (op == "BINARY_OP" and "[" in (text or "")):
            kind = "mask_index"
        elif op in _BOOL_OPS:
            kind = "bool"
        elif op in _FORMAT_OPS:
            kind = "print"
    if text is None:  # no positions: fall back on the line
        text = linecache.getline(code.co_filename, frame.f_lineno).strip()
        for m in re.finditer(r"(\w+)\s*\(", text):
            kind = _CALLEE_KIND.get(m.group(1))
            if kind:
                break
    return kind, " ".join(text.split())[:200]


# (id(code), f_lasti, hint) -> (code, site).  Keyed by id: hashing a code object hashes
# its bytecode and constants, which cost ~6 µs a sync on a long function.  The value
# holds the code object, so the id cannot be reused while the entry exists.
_sites_by_code: dict[tuple[int, int, str | None], tuple[Any, _Site]] = {}

#: Kind -> how many waits one call makes, for the C++ ops that wait more than once per
#: call.  Filled by measurement (:data:`PROBES`), never assumed: an unmeasured kind
#: counts every wait.
WAITS_PER_CALL: dict[str, int] = {}
#: Kind -> a function that measures one call's waits (registered by the CUDA backend).
#: Each runs once per process, at the first wait of its kind, from inside that wait.
PROBES: dict[str, Callable[[], int]] = {}


class WaitCounter:
    """A tracker that only counts waits (for measuring an op, outside any step)."""

    mechanism = None  # takes the waits of any route
    deferred = None

    def __init__(self) -> None:
        self.waits = 0
        self.other_threads = 0

    def record(self, hint: str | None, origin: Any) -> None:
        self.waits += 1


def _name_site(user: Any, origin: Any, hint: str | None) -> _Site:
    """(where, kind, code) of a wait that ``user`` made (through ``origin``, torch's frame)."""
    kind, text = classify(user)
    if kind is None and origin is not user:
        kind = classify(origin)[0]  # what torch's own code was doing (`.item()` in a helper)
    if hint is not None:
        kind = hint  # the mechanism knows device and event waits exactly
    return f"{_display_path(user.f_code.co_filename)}:{user.f_lineno}", kind or "other", text


# -- the tracker -------------------------------------------------------------


class SyncTracker:
    """Counts one thread's sync points per step, by site, and enforces the budget.

    The C step core does :meth:`begin`, and :meth:`end` for a sync-free step, through these
    slots (``_core.c``'s ``begin_tracker`` and ``end_tracker``)."""

    __slots__ = ("mechanism", "_sites", "_by_key", "_open", "count", "other_threads", "max_syncs", "on_sync",
                 "budget_armed", "_warned", "_last_user", "_last_lasti", "_last_child", "_last_counts", "_mute",
                 "deferred", "attached")

    def __init__(self, mechanism: str) -> None:
        self.mechanism = mechanism
        self._sites: dict[_Site, list[int]] = {}
        self._by_key: dict[tuple[int, int, str | None], tuple[Any, _Site, list[int], int]] = {}
        self._open: Sequence[Any] = ()  # the open phases, each with a ``syncs`` count
        self.count = 0
        self.other_threads = 0
        self.max_syncs: int | None = None
        self.on_sync = "count"
        self.budget_armed = False
        self._warned: set[_Site] = set()
        self._last_user: Any = None
        self._last_lasti = -1
        self._last_child: Any = None
        self._last_counts: list[int] = [0, 0]
        self._mute = 0
        #: A SyncBudgetExceeded that could not be raised at its line (see :func:`defer`).
        self.deferred: SyncBudgetExceeded | None = None
        #: Routed to by :func:`attach`, until :func:`detach`.
        self.attached = False

    def begin(self, phases: list[Any], max_syncs: int | None, on_sync: str, armed: bool) -> None:
        if self._sites:  # (a sync-free step's are still empty: kept)
            self._sites = {}
        if self._by_key:
            self._by_key = {}
        self._open = phases
        self._last_user = self._last_child = None  # a step that failed may not have ended
        self.count = self.other_threads = 0
        self.deferred = None
        self.max_syncs = max_syncs
        self.on_sync = on_sync
        self.budget_armed = armed and max_syncs is not None

    def end(self) -> dict[str, Any]:
        """The step's ``syncs`` field; forgets the frames it held."""
        self._last_user = self._last_child = None
        self._open = ()
        sites: list[dict[str, Any]] = []
        waits = 0
        if self._sites:  # else the common case, a sync-free step: nothing to sort or sum
            self._by_key = {}
            sites = [
                {"where": w, "kind": k, "code": c, "count": n, "waits": nw}
                for (w, k, c), (n, nw) in sorted(self._sites.items(), key=lambda kv: -kv[1][0])
            ]
            waits = sum(s["waits"] for s in sites)
        return {
            "count": self.count,
            "waits": waits,
            "sites": sites,
            "other_threads": self.other_threads,
            "mechanism": self.mechanism,
        }

    def record(self, hint: str | None, origin: Any) -> None:
        """A host-device wait, made by the code running in frame ``origin``.

        This runs at every sync, so it is kept lean: one prefix test per frame on
        the way out, one cached lookup for the site.
        """
        if self._mute:
            return
        user = origin
        child = None
        while user.f_code.co_filename.startswith(_INTERNAL_PREFIXES):
            child = user
            user = user.f_back
            if user is None:  # torch's own code with no caller outside it
                user, child = origin, None
                break
        lasti = user.f_lasti
        if child is not None and child is self._last_child and user is self._last_user and (
            lasti == self._last_lasti
        ):
            # Another wait inside the same call of torch's Python code (print(t)'s formatting):
            # the frame it runs in is the same object, held since the last wait.
            self._last_counts[1] += 1
            return
        code = user.f_code
        entry = self._by_key.get((id(code), lasti, hint))  # this step's counts of this location
        if entry is None or entry[0] is not code:
            entry = self._new_location(code, lasti, hint, user, origin)
        counts = entry[2]
        counts[1] += 1
        if entry[3] > 1 and (counts[1] - 1) % entry[3]:
            return  # a later wait of the same call of a multi-wait op (WAITS_PER_CALL)
        counts[0] += 1
        self.count += 1
        if self._open:
            for ph in self._open:
                ph.syncs += 1
        if child is not None:  # only a call through torch's Python code can wait again
            self._last_user, self._last_lasti, self._last_child, self._last_counts = (
                user, lasti, child, counts
            )
        if self.budget_armed and self.count > self.max_syncs:  # type: ignore[operator]
            self._over_budget(entry[1], counts[0], user)

    def _new_location(self, code: Any, lasti: int, hint: str | None, user: Any, origin: Any) -> Any:
        """This step's first wait at a code location: name its site (cached across steps)."""
        key = (id(code), lasti, hint)
        hit = _sites_by_code.get(key)
        if hit is None or hit[0] is not code:
            if len(_sites_by_code) > 50_000:
                _sites_by_code.clear()
            hit = _sites_by_code[key] = (code, _name_site(user, origin, hint))
        kind = hit[1][1]
        probe = PROBES.pop(kind, None) if kind not in WAITS_PER_CALL else None
        if probe is not None:  # a multi-wait op's first wait: measure it (once: popped)
            self._mute += 1  # (a WaitCounter gets the probe's own waits; this is a guard)
            try:
                n = probe()
            except Exception as e:  # noqa: BLE001 - unmeasured: each wait counts
                if raised_by_user(e):
                    raise
                n = 0
            finally:
                self._mute -= 1
            if n > 1:
                WAITS_PER_CALL[kind] = n
        counts = self._sites.get(hit[1])  # two locations can make one site
        if counts is None:
            counts = self._sites[hit[1]] = [0, 0]
        entry = self._by_key[key] = (code, hit[1], counts, WAITS_PER_CALL.get(hit[1][1], 1))
        return entry

    def _over_budget(self, site: _Site, site_count: int, frame: Any) -> None:
        where, kind, text = site
        msg = (
            f"step made {self.count} sync(s), over max_syncs={self.max_syncs}: "
            f"{kind} at {where} ({text}) has synced {site_count} time(s) this step"
        )
        if self.on_sync == "raise":
            raise SyncBudgetExceeded(msg, where=where, kind=kind, count=site_count)
        if self.on_sync == "warn" and site not in self._warned:
            self._warned.add(site)
            self._mute += 1
            try:
                warnings.warn_explicit(
                    f"stepprof: {msg}", StepprofWarning, frame.f_code.co_filename, frame.f_lineno,
                    module=frame.f_globals.get("__name__"),
                    registry=frame.f_globals.setdefault("__warningregistry__", {}),
                )
            finally:
                self._mute -= 1


# -- the hub: routes held by sessions, trackers per thread ------------------------


class Route(Protocol):
    """A mechanism's process-wide installation (:mod:`stepprof._device.sync_routes`).

    Installed when the first session that uses it opens, uninstalled when the last one
    closes.  ``traced``: its waits come from torch's GPU-trace callbacks.  A tracker takes
    only the waits of its own mechanism's route (see :func:`dispatch`), so two routes
    installed at once never count one wait twice.
    """

    traced: bool

    def install(self) -> None: ...

    def uninstall(self) -> None: ...

    def ensure(self) -> str | None:
        """At each watched step: put back what the user moved (identity checks when nothing
        moved); or why the route gives way this step (the user's sync-debug mode)."""
        ...

    def checks(self) -> tuple[Check, ...] | None:
        """What :meth:`ensure` checks, as data: while every check holds (the step core's
        ``checks_pass``) it would return None having changed nothing.  None: the route cannot say."""
        ...


#: (obj, attr, index, expected): ``getattr(obj, attr)`` (``obj()`` where attr is None), then
#: ``[index]`` unless it is None, is ``expected`` (equal, where expected is an int).  A missing
#: attribute or item fails the check (an empty filter list: :meth:`Route.ensure` puts it back);
#: any other error is the step entry's, as it would be in ``ensure``.
Check = tuple[Any, "str | None", "int | None", Any]


class SyncSession:
    """One profiler's hold on a route, from its first watched step to its close."""

    __slots__ = ("route", "outside", "lost", "open")

    def __init__(self, route: Route) -> None:
        self.route = route
        #: Waits on threads with no open step while the session was open.
        self.outside = 0
        #: Why ``outside`` is incomplete (the route gave way at some step), or None.
        self.lost: str | None = None
        self.open = True


#: Guards opening and closing sessions and a route's repairs; never taken per step or per
#: sync.  Held across ``os.fork()`` (see :func:`_before_fork`).
LOCK = threading.RLock()
# Thread id -> the trackers of the steps open on it, innermost last (two profilers can each
# have a step open on one thread: the inner step gets the waits).  A thread changes only its
# own entry, one dict or list operation at a time (atomic under the GIL): no lock per step.
_trackers: dict[int, list[Any]] = {}
# The open sessions: a tuple, replaced under LOCK, read without it.
_sessions: tuple[SyncSession, ...] = ()


def open_session(route: Route) -> SyncSession:
    """Hold ``route`` for a new session; the first session of a route installs it."""
    global _sessions
    with LOCK:
        if not any(s.route is route for s in _sessions):
            route.install()
        session = SyncSession(route)
        _sessions = (*_sessions, session)
    return session


def close_session(session: SyncSession) -> None:
    """End ``session`` (idempotent); the last session of its route uninstalls it."""
    global _sessions
    with LOCK:
        if not session.open:
            return
        session.open = False
        _sessions = tuple(s for s in _sessions if s is not session)
        if not any(s.route is session.route for s in _sessions):
            session.route.uninstall()


def close_all(forget_trackers: bool = True) -> None:
    """End every open session, uninstalling their routes (at exit, in a forked child, at
    reset); with ``forget_trackers``, forget every thread's trackers too.  Restores all it
    can, then raises the first failure."""
    global _sessions
    errors: list[Exception] = []
    with LOCK:
        sessions, _sessions = _sessions, ()
        if forget_trackers:
            _trackers.clear()
        routes: list[Route] = []
        for s in sessions:
            s.open = False
            if not any(r is s.route for r in routes):
                routes.append(s.route)
        for route in reversed(routes):
            try:
                route.uninstall()
            except Exception as e:  # noqa: BLE001 - restore the rest before reporting
                if raised_by_user(e):
                    raise
                errors.append(e)
    if errors:
        raise errors[0]


def give_way(route: Route, why: str) -> None:
    """``route`` does not count this step (``why``): every session holding it is incomplete."""
    for s in _sessions:
        if s.route is route and s.lost is None:
            s.lost = why


class Sessions:
    """A backend's sync session: opened at its first watched step, closed by :meth:`end`.

    Per step, :meth:`watch` checks the route (:meth:`Route.ensure`) and pushes the
    thread's tracker; :meth:`unwatch` pops it.  The route stays installed in between.
    """

    __slots__ = ("session", "final", "ended")

    def __init__(self, final: bool = False) -> None:
        self.session: SyncSession | None = None
        #: :meth:`end` is for good (a backend of one profiler): no session opens after it.
        self.final = final
        self.ended = False

    def watch(self, tracker: Any, route: Callable[[], Route]) -> str | None:
        """Route this thread's waits to ``tracker``; or why they are not counted this step.

        ``route`` gives the route to hold when no session is open (the first step).
        """
        s = self.session
        if s is None or not s.open:
            with LOCK:  # two threads' first steps open one session
                s = self.session
                if s is None or not s.open:
                    if self.ended and self.final:
                        return CLOSED
                    s = self.session = open_session(route())
        why = s.route.ensure()
        if why is not None:
            give_way(s.route, why)
            return why
        attach(tracker)
        return None

    def unwatch(self, tracker: Any) -> None:
        detach(tracker)

    def plan(self, mechanism: str | None) -> tuple[str | None, tuple[Check, ...]] | None:
        """For the C step core's watch: (the trackers' mechanism, checks) such that, while
        every check passes, :meth:`watch` would only :func:`attach` (and
        :meth:`unwatch` only :func:`detach`); None while no session is open or its route
        cannot say (:meth:`Route.checks`)."""
        s = self.session
        checks = s.route.checks() if s is not None and s.open else None
        if s is None or checks is None:
            return None
        return mechanism, ((self, "session", None, s), (s, "open", None, True), *checks)

    def end(self) -> None:
        """Close the session (idempotent); the figures stay readable."""
        with LOCK:
            self.ended = True
            if self.session is not None:
                close_session(self.session)

    def outside(self, reason: str | None) -> tuple[int | None, str | None]:
        """(``syncs_outside_steps``, None), or (None, why): ``reason`` when syncs are not
        counted at all, else why the session's count is incomplete or missing."""
        if reason is not None:
            return None, reason
        s = self.session
        if s is None:
            return None, NOT_WATCHED
        if s.lost is not None:
            return None, s.lost
        return s.outside, None


#: Why ``syncs_outside_steps`` is null when no step watched syncs.
NOT_WATCHED = "no step watched syncs: they are counted from the first step to close"
#: Why a step that began while its profiler closed has no syncs.
CLOSED = "the profiler was closing: its sync session had ended"


def attach(tracker: Any) -> None:
    """Route this thread's waits to ``tracker`` (innermost) until :func:`detach`."""
    tracker.attached = True  # first: an interrupt between the two still gets it detached
    tid = threading.get_ident()
    stack = _trackers.get(tid)
    if stack is None:
        _trackers[tid] = [tracker]
    else:
        stack.append(tracker)


def detach(tracker: Any = None) -> None:
    """Stop routing this thread's waits to ``tracker`` (default: its innermost one).
    Detaching a tracker that is not attached does nothing."""
    tid = threading.get_ident()
    stack = _trackers.get(tid)
    if stack:
        if tracker is None:
            tracker = stack.pop()
        elif stack[-1] is tracker:
            stack.pop()
        elif any(t is tracker for t in stack):
            stack[:] = [t for t in stack if t is not tracker]
        if not stack:
            _trackers.pop(tid, None)
    if tracker is not None:
        tracker.attached = False


def dispatch(hint: str | None, origin: Any, traced: bool = False) -> None:
    """Called by a route for every host-device wait it sees, on the waiting thread.

    ``traced``: the wait came through torch's GPU-trace callbacks.  A step's tracker takes
    the waits of its own mechanism's route; a wait on a thread with no open step is counted
    elsewhere (:func:`count_elsewhere`).
    """
    open_here = _trackers.get(threading.get_ident())
    if open_here:
        t = open_here[-1]
        m = t.mechanism
        if m is None or (m == "trace") is traced:
            t.record(hint, origin)
        return
    count_elsewhere(traced)


def defer(exc: SyncBudgetExceeded) -> None:
    """A budget error raised where it cannot propagate: in a callback that torch calls from
    C++ (the "trace" route), which logs whatever it raises.  The thread's step raises the
    first one when it exits."""
    open_here = _trackers.get(threading.get_ident())
    if open_here and open_here[-1].deferred is None:
        open_here[-1].deferred = exc


def count_elsewhere(traced: bool = False) -> None:
    """A wait on a thread with no open step: every open session of that route counts it in
    ``outside``, and every open step of that mechanism in ``other_threads``."""
    for s in _sessions:
        if s.route.traced is traced:
            s.outside += 1
    for stack in list(_trackers.values()):
        for t in stack:
            if (t.mechanism == "trace") is traced:
                t.other_threads += 1


def installed() -> bool:
    """Whether any session holds a route."""
    return bool(_sessions)


class _OwnWaits:
    """On a thread's stack while stepprof itself waits on the device (at close, in the
    sweep): those waits are neither a step's nor outside the steps."""

    mechanism = None
    deferred = None
    attached = False
    other_threads = 0

    def record(self, hint: str | None, origin: Any) -> None:
        pass

    def __enter__(self) -> None:
        attach(self)

    def __exit__(self, *exc: Any) -> None:
        detach(self)


#: ``with OWN_WAITS:`` around stepprof's own waits.
OWN_WAITS = _OwnWaits()


def _before_fork() -> None:
    LOCK.acquire()


def _after_fork_in_parent() -> None:
    LOCK.release()


def _after_fork_in_child() -> None:
    # The forking thread holds LOCK (_before_fork): the registry's handler, which runs first,
    # closes the inherited profilers' sessions through it.  Then what is left is restored:
    # the child gets the sync-debug mode, the filters, the hook and the functions back.
    global LOCK
    try:
        close_all()
    except Exception as e:  # noqa: BLE001, S110 - a forked child must start whatever happened here
        if raised_by_user(e):
            raise
    LOCK = threading.RLock()


def _close_all_at_exit() -> None:
    try:
        close_all(forget_trackers=False)
    except Exception as e:  # noqa: BLE001, S110 - at interpreter exit, nothing may raise
        if raised_by_user(e):
            raise


class _HubState:
    """The hub's sessions and trackers, for :func:`stepprof._registry.reset`."""

    def reset(self) -> None:
        close_all()


register_state(_HubState())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )
# Registered after stepprof._registry's (imported first): runs before it at exit, so the
# process state is back whatever the profilers' closing does.
atexit.register(_close_all_at_exit)


# -- the warning route's plumbing (pure Python) --------------------------------


_TAPS: dict[bool, WarningTap] = {}


def tap(forward: bool) -> WarningTap:
    """The shared :class:`WarningTap` (one per ``forward``), made once."""
    t = _TAPS.get(forward)
    if t is None:
        t = _TAPS[forward] = WarningTap(forward)
    return t


def _remove(filters: list[Any], item: Any) -> None:
    """Remove ``item`` from ``filters`` by identity (an equal filter of the user's stays)."""
    for i in range(len(filters) - 1, -1, -1):
        if filters[i] is item:
            del filters[i]


class WarningTap:
    """Turns torch's sync-debug warnings into counts.

    Installs a front "always" filter for :data:`SYNC_MESSAGE` only (the default
    filter would show each location once, and a user's "error" filter would raise)
    and replaces ``warnings._showwarnmsg``, which Python's C warning code calls with
    each warning it shows: the sync message is counted, and every other warning goes
    to the original, which calls ``showwarning`` (yours, or pytest's) as before.
    Hooking there rather than ``showwarning`` saves a Python frame per sync, and the
    frame that issued the warning is the hook's caller.  With ``forward=True`` (the
    user had turned sync-debug warnings on themselves) the sync warnings are passed
    on too, after counting.

    Installed once per session; :meth:`ensure` puts the filter back in front and the
    hook back in place at each step if the user moved them.
    """

    def __init__(self, forward: bool = False) -> None:
        self.forward = forward
        self._filter = ("always", re.compile(re.escape(SYNC_MESSAGE)), UserWarning, None, 0)
        self._cleared = False
        self._current: _Hook | None = None
        self._hook: Any = None  # the installed bound method, so that ensure and uninstall recognise it
        self._filters: list[Any] | None = None  # the filter list it was installed into

    def install(self) -> None:
        # warnings.filters is a list (typeshed's Sequence: not meant to be changed by hand).
        self._filters = cast("list[Any]", warnings.filters)
        self._filters.insert(0, self._filter)
        if self.forward or not self._cleared:
            # A location's registry of "already shown" warnings is checked before any
            # filter, so a sync warning once shown there (under the user's own "warn"
            # mode) would be hidden from us.  Bumping the filters' version clears every
            # registry -- and so shows each of the user's once-per-location warnings once
            # more.  That is done at the first install of the process, and at each one
            # while the user has "warn" on (sync warnings were shown, so registered,
            # before the session).  Otherwise sync warnings only happen under our "always"
            # filter, which registers nothing, and the user's warnings stay shown once.
            _filters_mutated()
            self._cleared = True
        self._chain()

    def _chain(self) -> None:
        # A new hook each time: one that a user's own ``_showwarnmsg`` chained to stays in
        # their chain, and must pass through, not loop back to theirs (which would call it
        # again) or count a second time.
        old = self._current
        if old is not None:
            old.active = False
        hook = self._current = _Hook(warnings._showwarnmsg, self.forward)  # type: ignore[attr-defined]
        self._hook = hook.show
        warnings._showwarnmsg = self._hook  # type: ignore[attr-defined]

    def checks(self) -> tuple[Check, Check]:
        """:meth:`ensure`'s two identity checks, as data (see :meth:`Route.checks`)."""
        return (warnings, "filters", 0, self._filter), (warnings, "_showwarnmsg", None, self._hook)

    def ensure(self) -> None:
        """Our filter first and our hook in place (two identity checks); else put them back."""
        f = warnings.filters
        if f and f[0] is self._filter and warnings._showwarnmsg is self._hook:  # type: ignore[attr-defined]
            return
        with LOCK:
            f = cast("list[Any]", warnings.filters)
            if not f or f[0] is not self._filter:
                # A filter of the user's is in front (``catch_warnings()`` and
                # ``simplefilter``, say): ours goes back in front.  The version bump clears
                # the registries, where a sync warning shown under theirs meanwhile would
                # hide the next one at that line.
                _remove(f, self._filter)
                f.insert(0, self._filter)
                _filters_mutated()
            if warnings._showwarnmsg is not self._hook:  # type: ignore[attr-defined]
                self._chain()  # the user's replacement: ours in front of theirs

    def uninstall(self) -> None:
        # From the list it went into and from the current one (a ``catch_warnings()``
        # copy still in force); no _filters_mutated(): an "always" filter marks nothing.
        for f in (self._filters, cast("list[Any]", warnings.filters)):
            if f is not None:
                _remove(f, self._filter)
        self._filters = None
        hook = self._current
        if hook is None:
            return
        hook.active = False  # from now on it passes everything through
        if warnings._showwarnmsg is self._hook:  # type: ignore[attr-defined]
            warnings._showwarnmsg = hook.previous  # type: ignore[attr-defined]
        # Else someone replaced it after us: leave theirs; ours passes all through now.
        self._current = self._hook = None


class _Hook:
    """One installation of a :class:`WarningTap` in place of ``warnings._showwarnmsg``."""

    __slots__ = ("previous", "forward", "active")

    def __init__(self, previous: Any, forward: bool) -> None:
        self.previous = previous
        self.forward = forward
        self.active = True

    def show(self, msg: Any) -> None:
        if self.active and msg.category is UserWarning and str(msg.message).startswith(SYNC_MESSAGE):
            open_here = _trackers.get(threading.get_ident())
            if open_here:  # sys._getframe(1): called from C, the frame that issued the warning
                t = open_here[-1]
                if t.mechanism != "trace":
                    t.record(None, sys._getframe(1))
            else:
                count_elsewhere()
            if not self.forward:
                return
        self.previous(msg)


def _filters_mutated() -> None:
    f = getattr(warnings, "_filters_mutated", None) or getattr(
        warnings, "_filters_mutated_lock_held", None
    )
    if f is not None:
        f()

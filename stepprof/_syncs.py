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
to the original, and so to ``showwarning``, unchanged.  Everything is installed
when the first step opens and restored when the last one closes, on every exit
path.
"""

from __future__ import annotations

import ast
import dis
import linecache
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._errors import SyncBudgetExceeded, raised_by_user

__all__ = [
    "SYNC_MESSAGE",
    "SyncTracker",
    "WarningTap",
    "classify",
    "count_elsewhere",
    "defer",
    "dispatch",
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
    if ins is not None and getattr(ins, "positions", None) is not None:
        text = _segment(code.co_filename, ins.positions)
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
    """Counts one thread's sync points per step, by site, and enforces the budget."""

    def __init__(self, mechanism: str) -> None:
        self.mechanism = mechanism
        self._sites: dict[_Site, list[int]] = {}
        self._by_key: dict[tuple[int, int, str | None], tuple[Any, _Site, list[int], int]] = {}
        self._open: list[Any] = []  # the open phases, each with a ``syncs`` count
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
        self._sites = {}
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
        self._open = []
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
                    f"stepprof: {msg}", RuntimeWarning, frame.f_code.co_filename, frame.f_lineno,
                    module=frame.f_globals.get("__name__"),
                    registry=frame.f_globals.setdefault("__warningregistry__", {}),
                )
            finally:
                self._mute -= 1


# -- the hub: one process-wide installation, per-thread trackers ----------------

_lock = threading.Lock()
# Thread id -> the trackers of the steps open on it, innermost last (two profilers can
# each have a step open on one thread: the inner step gets the waits).
_trackers: dict[int, list[SyncTracker]] = {}
_uninstall: list[Callable[[], None]] = []


def dispatch(hint: str | None, origin: Any) -> None:
    """Called by a mechanism for every host-device wait it sees, on the waiting thread."""
    open_here = _trackers.get(threading.get_ident())
    if open_here:
        open_here[-1].record(hint, origin)
        return
    count_elsewhere()


def defer(exc: SyncBudgetExceeded) -> None:
    """A budget error raised where it cannot propagate: in a callback that torch calls from
    C++ (the "trace" route), which logs whatever it raises.  The thread's step raises the
    first one when it exits."""
    open_here = _trackers.get(threading.get_ident())
    if open_here and open_here[-1].deferred is None:
        open_here[-1].deferred = exc


def count_elsewhere() -> None:
    """A wait on a thread with no open step: every open step counts it in ``other_threads``."""
    for stack in list(_trackers.values()):
        for t in stack:
            t.other_threads += 1


def attach(tracker: SyncTracker, install: Callable[[], list[Callable[[], None]]]) -> None:
    """Route this thread's waits to ``tracker``; the first attach runs ``install``.

    ``install`` returns the undo callables; the last :func:`detach` runs them.
    """
    with _lock:
        if not _trackers:
            _uninstall[:] = install()
        tracker.attached = True  # first: an interrupt between the two still gets it detached
        _trackers.setdefault(threading.get_ident(), []).append(tracker)


def detach(tracker: SyncTracker | None = None) -> None:
    """Stop routing this thread's waits to ``tracker`` (default: its innermost one); the last
    detach uninstalls.  Detaching a tracker that is not attached does nothing."""
    with _lock:
        tid = threading.get_ident()
        stack = _trackers.get(tid)
        if stack:
            if tracker is None:
                stack.pop().attached = False
            elif tracker in stack:
                stack.remove(tracker)
                tracker.attached = False
        if not stack:
            _trackers.pop(tid, None)
        if not _trackers and _uninstall:
            undo, _uninstall[:] = list(_uninstall), []
            errors = []
            for u in reversed(undo):
                try:
                    u()
                except Exception as e:  # noqa: BLE001 - restore the rest before reporting
                    errors.append(e)
            if errors:
                raise errors[0]


def installed() -> bool:
    return bool(_trackers)


# -- the warning route's plumbing (pure Python) --------------------------------


_TAPS: dict[bool, WarningTap] = {}


def tap(forward: bool) -> WarningTap:
    """The shared :class:`WarningTap` (one per ``forward``), made once."""
    t = _TAPS.get(forward)
    if t is None:
        t = _TAPS[forward] = WarningTap(forward)
    return t


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
    """

    def __init__(self, forward: bool = False) -> None:
        self.forward = forward
        self._filter = ("always", re.compile(re.escape(SYNC_MESSAGE)), UserWarning, None, 0)
        self._cleared = False
        self._current: _Hook | None = None
        self._hook: Any = None  # the installed bound method, so that uninstall can recognise it

    def install(self) -> Callable[[], None]:
        # A new hook per installation: one that a user's own ``_showwarnmsg`` chained to
        # during an earlier step stays in their chain, and must pass through, not loop
        # back to theirs (which would call it again) or count a second time.
        hook = self._current = _Hook(warnings._showwarnmsg, self.forward)  # type: ignore[attr-defined]
        self._hook = hook.show
        warnings.filters.insert(0, self._filter)
        if self.forward or not self._cleared:
            # A location's registry of "already shown" warnings is checked before any
            # filter, so a sync warning once shown there (under the user's own "warn"
            # mode) would be hidden from us.  Bumping the filters' version clears every
            # registry -- and so shows each of the user's once-per-location warnings once
            # more.  That is done at the first install of the process, and at each one
            # while the user has "warn" on (sync warnings are shown, so registered, between
            # steps).  Otherwise sync warnings only happen under our "always" filter, which
            # registers nothing, and the user's warnings stay shown once, as before.
            _filters_mutated()
            self._cleared = True
        warnings._showwarnmsg = self._hook  # type: ignore[attr-defined]
        return self.uninstall

    def uninstall(self) -> None:
        try:
            warnings.filters.remove(self._filter)
        except ValueError:
            pass  # the user reset the filters meanwhile
        # No _filters_mutated(): an "always" filter never marks a location as shown.
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
        if (
            self.active
            and _trackers
            and msg.category is UserWarning
            and str(msg.message).startswith(SYNC_MESSAGE)
        ):
            open_here = _trackers.get(threading.get_ident())
            if open_here:  # sys._getframe(1): called from C, the frame that issued the warning
                open_here[-1].record(None, sys._getframe(1))
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

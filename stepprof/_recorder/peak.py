"""``Profiler(explain_peak=...)``: where one step's peak memory comes from (``kind: "peak"``).

For the explained step only, :class:`Explaining` turns the allocator's history on (through
the backend) and notes, in the trace's clock:

- the storages of the model's parameters, their gradients and the optimizer's state, at
  the step's entry and exit, and each gradient as it is accumulated
  (``register_post_accumulate_grad_hook``);
- the storage of every tensor autograd saves for backward (a ``saved_tensors_hooks`` pack
  hook that returns the tensor unchanged);
- each module's forward (forward pre- and post-hooks) and backward (a hook on the
  gradient of its output; the end of the backward pass from a callback queued on the
  autograd engine);
- the step's phases (:meth:`Boundaries.watch_phases`).

Where torch records ``record_function`` ranges into the history
(:attr:`HistoryStart.annotations`), the module and phase hooks also emit markers, ranges named
``stepprof:...`` (:data:`stepprof._peak.MARKER`), which torch timestamps in the history's own
clock: the replay then needs no clock alignment.  The host times stay, for torch without it.

At the step's exit the history stops, every hook is removed and the hook retires from the
step boundaries, so other steps pay nothing.  The collector replays the history
(:func:`stepprof._peak.explain`) and writes the record right after the step's.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .. import _peak
from .._device.backend import Backend, HistoryStart
from .._errors import raised_by_user
from .._paths import whole_file
from .._peak import MARKER, Event, Observation, PeakExplanation
from .hooks import Closing, Hook
from .sinks import Write
from .step import Step

#: The bound of the allocator's history (entries).  A step with more allocations and
#: frees than this gets null figures with the reason: its start would have been dropped.
MAX_ENTRIES = 500_000

ROOT = "(root)"


def _now_us() -> float:
    return time.time_ns() / 1000


def _enter(name: str) -> Any:
    """Open a ``record_function`` range (a RecordFunction of ``USER_SCOPE``): its handle."""
    return torch.ops.profiler._record_function_enter_new(name)


def _exit(handle: Any) -> None:
    """Close a range from :func:`_enter` (torch's ``record_function.__exit__`` minus its checks;
    without ``DisableTorchFunctionSubclass`` the call costs several times more)."""
    with torch._C.DisableTorchFunctionSubclass():
        torch.ops.profiler._record_function_exit._RecordFunction(handle)


def _storage(t: Any, index: int) -> tuple[int, int] | None:
    """(data_ptr, nbytes) of a CUDA tensor's storage on device ``index``, else None."""
    try:
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.device.index != index:
            return None
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except Exception as e:  # noqa: BLE001 - a subclass or fake tensor without a storage
        if raised_by_user(e):
            raise
        return None


def _first_grad_tensor(out: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad and out.grad_fn is not None else None
    if depth < 2:
        items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
        for item in items:
            t = _first_grad_tensor(item, depth + 1)
            if t is not None:
                return t
    return None


class Explaining:
    """The notes taken during the explained step, and the hooks that take them.

    Args:
        index: the CUDA device index.
        model, optimizer: where parameters, gradients and optimizer state come from (either
            may be None: without the model no module is named; parameters then come from
            the optimizer's ``param_groups``).
    """

    def __init__(self, index: int, model: Any, optimizer: Any) -> None:
        self.index = index
        self.model = model
        self.optimizer = optimizer
        self.observations: list[tuple[str, int, int, str | float]] = []  # host µs for times
        self.module_events: list[tuple[float, str, str]] | None = [] if model is not None else None
        self.phase_events: list[tuple[float, str, str]] = []
        self.notes: list[str] = []
        self.activations_from: str | None = "saved_tensors_hooks"
        #: Emit markers (set once the history records annotations).
        self.in_clock = False
        #: Host time spent in the hooks (ns).
        self.hook_ns = 0
        self._live = True
        self._handles: list[Any] = []
        self._saved: Any = None
        self._saved_thread: int | None = None  # saved-tensor hooks are per thread: the one that pushed
        self._backward_open = False
        self._open: dict[str, list[Any]] = {}  # open marker ranges, by module or phase

    # -- what is a parameter, a gradient, optimizer state ------------------------------

    def _params(self) -> list[torch.Tensor]:
        if self.model is not None:
            return list(self.model.parameters())
        if self.optimizer is not None:
            return [p for g in self.optimizer.param_groups for p in g["params"]]
        return []

    def observe(self, when: str) -> None:
        """Note the parameters, gradients and optimizer state now (``"start"`` or ``"end"``)."""
        add = self.observations.append
        for p in self._params():
            for cat, t in (("parameters", p), ("gradients", p.grad)):
                s = _storage(t, self.index)
                if s is not None:
                    add((cat, s[0], s[1], when))
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for t in state.values() if isinstance(state, dict) else ():
                    s = _storage(t, self.index)
                    if s is not None:
                        add(("optimizer_state", s[0], s[1], when))

    # -- the hooks -------------------------------------------------------------------------

    def install(self) -> None:
        """The hooks of the explained step (removed by :meth:`remove`)."""
        self._install_saved()
        hook = getattr(torch.Tensor, "register_post_accumulate_grad_hook", None)
        if hook is not None:
            for p in self._params():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        else:
            self.notes.append("this torch has no register_post_accumulate_grad_hook: gradients are "
                              "seen only at the step's entry and exit")
        if self.model is not None:
            for name, module in self.model.named_modules():
                name = name or ROOT
                self._handles.append(module.register_forward_pre_hook(self._pre(name)))
                self._handles.append(module.register_forward_hook(self._post(name)))

    def _install_saved(self) -> None:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        try:
            existing = top(False) if top is not None else None
        except TypeError:
            existing = top()  # type: ignore[misc]
        if existing is not None:
            self.activations_from = "stacks"
            self.notes.append("saved_tensors_hooks of your own were active, so stepprof did not add its "
                              "own: activations are told from temporaries by their stacks (made under a "
                              "forward)")
            return
        index, add = self.index, self.observations.append

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not self._live:  # left pushed on the step's thread by a remove() from another thread
                return t
            t0 = time.perf_counter_ns()
            s = _storage(t, index)
            if s is not None:
                add(("activations", s[0], s[1], _now_us()))
            self.hook_ns += time.perf_counter_ns() - t0
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        ctx.__enter__()
        self._saved = ctx
        self._saved_thread = threading.get_ident()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._live:
            return
        t0 = time.perf_counter_ns()
        s = _storage(p.grad, self.index)
        if s is not None:
            self.observations.append(("gradients", s[0], s[1], _now_us()))
        self.hook_ns += time.perf_counter_ns() - t0

    # -- markers: ranges whose START and END torch records in the history's clock ----

    def _open_range(self, key: str, name: str) -> None:
        self._open.setdefault(key, []).append(_enter(name))

    def _close_range(self, key: str) -> None:
        handles = self._open.get(key)
        if handles:
            _exit(handles.pop())

    def _instant(self, name: str) -> None:
        _exit(_enter(name))

    # -- modules and phases -------------------------------------------------------------

    def _pre(self, name: str) -> Callable[..., None]:
        events = self.module_events
        assert events is not None
        marker = f"{MARKER}fwd:{name}"

        def pre(module: Any, args: Any) -> None:
            if not self._live:
                return
            t0 = time.perf_counter_ns()
            events.append((_now_us(), "enter", name))
            if self.in_clock:
                self._open_range(marker, marker)
            self.hook_ns += time.perf_counter_ns() - t0

        return pre

    def _post(self, name: str) -> Callable[..., None]:
        events = self.module_events
        assert events is not None
        marker = f"{MARKER}fwd:{name}"

        def post(module: Any, args: Any, out: Any) -> None:
            if not self._live:
                return
            t0 = time.perf_counter_ns()
            if self.in_clock:
                self._close_range(marker)
            events.append((_now_us(), "exit", name))
            t = _first_grad_tensor(out)
            if t is not None:
                try:
                    t.register_hook(lambda grad: self._on_backward(name))
                except RuntimeError:
                    pass
            self.hook_ns += time.perf_counter_ns() - t0

        return post

    def _on_backward(self, name: str) -> None:
        if not self._live:  # a graph kept (retain_graph) past the explained step
            return
        t0 = time.perf_counter_ns()
        assert self.module_events is not None
        if self.in_clock:
            self._instant(f"{MARKER}bwd:{name}")
        self.module_events.append((_now_us(), "backward", name))
        if not self._backward_open:
            self._backward_open = True
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            except Exception as e:  # noqa: BLE001, S110 - then backward allocations stay with the last module
                if raised_by_user(e):
                    raise
        self.hook_ns += time.perf_counter_ns() - t0

    def _on_backward_end(self) -> None:
        if not self._live:
            return
        t0 = time.perf_counter_ns()
        assert self.module_events is not None
        if self.in_clock:
            self._instant(f"{MARKER}bwd_end")
        self.module_events.append((_now_us(), "backward_end", ""))
        self._backward_open = False
        self.hook_ns += time.perf_counter_ns() - t0

    def on_phase(self, action: str, key: str) -> None:
        t0 = time.perf_counter_ns()
        if self.in_clock:
            marker = f"{MARKER}phase:{key}"
            if action == "enter":
                self._open_range(marker, marker)
            else:
                self._close_range(marker)
        self.phase_events.append((_now_us(), action, key))
        self.hook_ns += time.perf_counter_ns() - t0

    def remove(self) -> None:
        """Every hook off (idempotent).  Marker ranges a raising forward left open stay open
        (their handles are dropped with this object, once recording has stopped).  Called
        from another thread than the step's, the saved-tensor hook (that thread's) stays
        pushed there, inert."""
        self._live = False
        handles, self._handles = self._handles, []
        ctx = self._saved
        if ctx is not None and self._saved_thread == threading.get_ident():
            self._saved = None
        else:
            ctx = None
        try:
            for h in handles:
                h.remove()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class PeakHook(Hook):
    """Explains the peak of step ``target`` and writes its ``kind: "peak"`` record.

    Args:
        target: the explained step's index.
        model, optimizer: see :class:`Explaining`.
        ensure_backend: the profiler's backend, chosen now if it is not yet (the hook runs
            before the step's entry boundary, which would choose it).
        watch_phases: ``watch_phases(fn)`` routes the phase boundaries to ``fn(action,
            key)``; ``watch_phases(None)`` stops.
        retire: takes the hook off the step boundaries.
        max_entries: the bound of the allocator's history.
    """

    states_its_cost = True  # the replay is the peak record's cost_ms, no step's overhead_us

    def __init__(self, target: int, *, model: Any, optimizer: Any, ensure_backend: Callable[[], Backend],
                 watch_phases: Callable[[Any], None], retire: Callable[[Hook], None],
                 max_entries: int = MAX_ENTRIES) -> None:
        self.target = target
        self.explanation: PeakExplanation | None = None
        self._model = model
        self._optimizer = optimizer
        self._ensure_backend = ensure_backend
        self._watch_phases = watch_phases
        self._retire = retire
        self._max_entries = max_entries
        self._explaining: Explaining | None = None
        self._start: HistoryStart | None = None
        self._backend: Backend | None = None
        self._cost_ns = 0
        self._pending: dict[str, Any] | None = None  # what the collector replays
        self._reason: str | None = None
        self._pid = os.getpid()  # a forked child leaves the parent's allocator alone
        self._ran = False  # the target step ran under the history and the hooks
        #: Where to write the explained step's allocator snapshot (explain_peak(snapshot=)), or None.
        self.snapshot_path: str | None = None

    # -- training thread --------------------------------------------------------------

    def on_step_begin(self, index: int) -> None:
        if index != self.target:
            return
        t0 = time.perf_counter_ns()
        try:
            self._begin()
        except Exception as e:  # noqa: BLE001 - a null record, never a broken step
            if raised_by_user(e):
                raise
            self._abandon(f"{type(e).__name__}: {e}")
        self._cost_ns += time.perf_counter_ns() - t0
        if self._explaining is None:
            self._retire(self)

    def _begin(self) -> None:
        b = self._ensure_backend()
        self._backend = b
        if not b.has_device_memory or b.index is None:
            self._reason = f"no CUDA allocator to explain: {b.memory_reason or b.gpu_reason}"
            return
        ex = Explaining(b.index, self._model, self._optimizer)
        try:
            ex.install()
            ex.observe("start")
            started = b.begin_history(self._max_entries)
        except BaseException:
            ex.remove()
            raise
        if isinstance(started, str):
            ex.remove()
            self._reason = started
            return
        self._start = started
        self._pid = os.getpid()
        ex.in_clock = started.annotations
        self._explaining = ex
        self._watch_phases(ex.on_phase)

    def on_step_end(self, step: Step, exc: BaseException | None) -> None:
        ex = self._explaining
        if ex is None or step.index != self.target:
            return
        t0 = time.perf_counter_ns()
        self._explaining = None
        self._ran = True
        try:
            end, end_before = self._stop(ex, step.backend, observe=True)
        except Exception as e:  # noqa: BLE001 - a null record, never a broken step
            if raised_by_user(e):
                raise
            self._abandon(f"{type(e).__name__}: {e}")
            end = None
        finally:
            self._retire(self)
        if end is not None:
            if exc is not None:
                ex.notes.append(f"the step raised {type(exc).__name__}: its peak is up to the exception")
            self._pending = {"end": end, "explaining": ex, "peak": step.peak if step.peak >= 0 else None,
                             "end_before": end_before, "light": step.sampled == 0}
        self._cost_ns += time.perf_counter_ns() - t0

    def _stop(self, ex: Explaining, backend: Backend | None, *, observe: bool) -> tuple[Any, float]:
        """Phases unwatched, hooks off, the end observed, and recording off, even when one of
        the first raises: (the end snapshot, the host time just before it).  In a forked
        child (a close at its exit) the allocator is the parent's: it is not touched."""
        try:
            self._watch_phases(None)
            ex.remove()
            if observe:
                ex.observe("end")
        finally:
            end_before = _now_us()
            end = backend.end_history() if backend is not None and os.getpid() == self._pid else None
        return end, end_before

    def on_fail(self, step_open: bool, why: str) -> None:
        ex, self._explaining = self._explaining, None
        if ex is not None:
            try:
                self._stop(ex, self._backend, observe=False)
            except Exception as e:  # noqa: BLE001, S110 - recording already failed; the reason says so
                if raised_by_user(e):
                    raise
            self._abandon(f"recording stopped during the explained step: {why}")

    def _abandon(self, why: str) -> None:
        self._reason = f"explaining the peak failed: {why}"
        self._explaining = None

    # -- collector --------------------------------------------------------------------

    def on_record(self, step: Step, record: dict[str, Any]) -> None:
        """Flag the explained step: its times include the history's and the hooks' cost, so the
        run's figures leave it out (like the step whose FLOPs were counted)."""
        if self._ran and step.index == self.target:
            record["explained"] = True

    def after_record(self, step: Step, write: Write) -> None:
        """The peak record, right after the explained step's record."""
        if step.index != self.target or self.explanation is not None:
            return
        end = self._pending["end"] if self._pending is not None else None
        self.explanation = self._with_snapshot(self._explain(step), end)
        write(self.explanation.to_record())

    def _with_snapshot(self, exp: PeakExplanation, end: dict[str, Any] | None) -> PeakExplanation:
        """``exp`` with the snapshot asked for written (``snapshot_path``), or the reason it is not."""
        path = self.snapshot_path
        if path is None:
            return exp
        why = (_write_snapshot(path, end) if end is not None else
               exp.unavailable.get("bytes_by_category") or "the step's allocator history was not recorded")
        if why is None:
            return attrs.evolve(exp, snapshot_path=path)
        return attrs.evolve(exp, unavailable={**exp.unavailable, "snapshot_path": why})

    def _explain(self, step: Step) -> PeakExplanation:
        device = step.backend.device if step.backend is not None else "cpu"
        cost = self._cost_ns / 1e6
        pending, self._pending = self._pending, None
        if pending is None:
            return _peak.unavailable_explanation(
                self._reason or "the explained step was not recorded", step=step.index, device=device,
                peak_allocated_bytes=step.peak if step.peak >= 0 and step.backend.has_device_memory else None,
                cost_ms=cost)
        t0 = time.perf_counter_ns()
        start = self._start
        assert start is not None
        ex: Explaining = pending["explaining"]
        try:
            end = pending["end"]
            offset = _offset_us(start, end, ex.index, pending["end_before"])
            if offset is None:
                offset = 0.0
                ex.notes.append("the history has no marker of its start, so host times are taken as the "
                                "trace's clock")
            t = _to_trace(offset)
            mods, phases, annotations, in_clock = _in_clock(start, end, ex, self._max_entries)
            if not in_clock:
                mods = None if ex.module_events is None else [Event(t(u), a, n) for u, a, n in ex.module_events]
                phases = [Event(t(u), a, n) for u, a, n in ex.phase_events]
            obs = [Observation(c, p, n, w if isinstance(w, str) else t(w)) for c, p, n, w in ex.observations]
            blind = ex.model is None and ex.optimizer is None  # (no parameter known)
            result = _peak.explain(
                start.snapshot, end, device=ex.index, step=step.index, observations=obs,
                module_events=mods, phase_events=phases, annotations=annotations, in_clock=in_clock,
                peak_allocated_bytes=pending["peak"], max_entries=self._max_entries,
                activations_from=ex.activations_from, notes=[*ex.notes, NO_MODEL_NOTE] if blind else ex.notes,
                unavailable={**(_NO_MODEL if blind else {}), **(_LIGHT if pending["light"] else {})},
            )
        except Exception as e:  # noqa: BLE001 - a null record, never a stopped collector
            if raised_by_user(e):
                raise
            return _peak.unavailable_explanation(
                f"replaying the allocator's history failed: {type(e).__name__}: {e}", step=step.index,
                device=device, peak_allocated_bytes=pending["peak"], cost_ms=cost)
        cost += (time.perf_counter_ns() - t0 + ex.hook_ns) / 1e6
        return _with_cost(result, cost)

    def on_close(self, closing: Closing) -> None:
        """A peak record saying why, when the explained step's record was never written (the
        run ended first, recording stopped, another thread's step had the index); recording
        off if the step is still open on another thread."""
        ex, self._explaining = self._explaining, None
        if ex is not None:
            try:
                self._stop(ex, self._backend, observe=False)
            except Exception as e:  # noqa: BLE001, S110 - the reason below says it was not explained
                if raised_by_user(e):
                    raise
            self._retire(self)
            self._reason = (f"the profiler was closed while the explained step was open on another "
                            f"thread than the one closing it; step {self.target} is not explained")
        if self.explanation is not None:
            return
        device = closing.backend.device if closing.backend is not None else "none"
        if closing.last_step is None or closing.last_step < self.target:
            ran = "no step ran" if closing.last_step is None else f"the last step was {closing.last_step}"
            why = f"the run ended before step {self.target}, the one to explain ({ran})"
        else:
            why = self._reason or f"step {self.target} was not recorded (recording stopped)"
        self.explanation = self._with_snapshot(_peak.unavailable_explanation(why, step=self.target, device=device),
                                               None)
        closing.write(self.explanation.to_record())


_LIGHT = dict.fromkeys(
    ("peak_allocated_bytes", "phase"),
    "the explained step was not sampled (overhead_budget: a light step), so the allocator's counter "
    "was not read and its phases were not watched; explain a sampled step (explain_peak=N)")

_NO_MODEL = {
    "bytes_by_category.parameters": "no model or optimizer was given (pass model= and optimizer=): "
    "parameters, gradients and optimizer state count as activations where autograd saved them for "
    "backward (a layer's weight), else as other or temporaries",
}
#: The note of a record explained without a model or an optimizer.
NO_MODEL_NOTE = ("activations include the weights autograd saved for backward: without model= or optimizer= "
                 "they cannot be told from activations")


def _in_clock(start: HistoryStart, end: dict[str, Any], ex: Explaining, max_entries: int) -> tuple[
        list[Event] | None, list[Event], list[dict[str, Any]] | None, bool]:
    """(module events, phase events, annotations, True) from stepprof's markers in the
    history; (None, [], annotations or None, False) where they cannot serve, with a note."""
    annotations = end.get("external_annotations")
    if not start.annotations or annotations is None:
        ex.notes.append(
            f"module and phase attribution is approximate: this torch ({torch.__version__}) does not "
            f"record ranges into the allocator's history (no global_record_annotations, torch < 2.8), "
            f"so host times were aligned to the history's clock, to a few µs")
        return None, [], annotations, False
    if len(annotations) >= max_entries:
        ex.notes.append(
            f"the history's annotations overflowed their bound of {max_entries} (the oldest were "
            f"dropped): module and phase attribution is approximate, by host times aligned to the "
            f"history's clock")
        return None, [], annotations, False
    mods, phases = _peak.marker_events(annotations, ex.index)
    if not mods and not phases and (ex.phase_events or ex.module_events):
        ex.notes.append(
            "stepprof's markers are missing from the allocator's history (ranges recorded on another "
            "device, or not recorded by this torch): module and phase attribution is approximate, by "
            "host times aligned to the history's clock")
        return None, [], annotations, False
    return (mods if ex.module_events is not None else None), phases, annotations, True


def _offset_us(start: HistoryStart, end: dict[str, Any], index: int, end_before_us: float) -> float | None:
    """Trace clock minus host clock, from the snapshots' markers in the history.

    torch records a snapshot's marker as its ``_snapshot()`` begins (before it builds the
    Python dicts and symbolises stacks, the slow part), so each marker is compared with the
    host's clock just before its call.  A delay between the two (the thread descheduled)
    only adds to the difference, so the smaller of the two estimates is taken.
    """
    traces = end.get("device_traces") or []
    trace = traces[index] if index < len(traces) else []
    markers = [e for e in trace if e.get("action") == "snapshot" and "time_us" in e]
    if not markers:
        return None
    first: float = markers[0]["time_us"] - start.host_before_us
    return first if len(markers) < 2 else min(first, markers[-1]["time_us"] - end_before_us)


def _to_trace(offset: float) -> Callable[[float], float]:
    return lambda host_us: host_us + offset


def _with_cost(result: PeakExplanation, cost_ms: float) -> PeakExplanation:
    return attrs.evolve(result, cost_ms=round(cost_ms, 3))


def _write_snapshot(path: str, snapshot: dict[str, Any]) -> str | None:
    """Pickle ``snapshot`` (``torch.cuda.memory._snapshot()``'s dict, which pytorch.org/memory_viz
    opens) to ``path``, whole or not at all; returns why it could not, or None."""
    try:
        with whole_file(path) as f:
            pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a reason in the record, never a stopped collector
        if raised_by_user(e):
            raise
        return f"writing the snapshot to {path!r} failed: {type(e).__name__}: {e}"
    return None

"""Where one step's peak memory comes from: the pure logic of ``explain_peak``.

The CUDA backend (:mod:`stepprof._device.cuda`) records the allocator's history for one
step and hands over two snapshots in torch's format (``torch.cuda.memory._snapshot()``:
``segments`` with their ``blocks``, ``device_traces`` with ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``, ... entries).  The peak hook
(:mod:`stepprof._recorder.peak`) notes, during that step, which storages are parameters,
gradients, optimizer state and tensors saved for backward (:class:`Observation`), when
each module's forward and backward ran and when each phase did (:class:`Event`).  This
module replays the trace and answers, at the instant of the high-water mark of
allocated bytes: which blocks were live, in which category, made by which module, in
which phase and at which op.  It needs no torch, so it is tested on the CPU with
synthetic snapshots.  The record it fills, :class:`PeakExplanation`, and its one line of
text are in :mod:`stepprof._peak_record` (re-exported here).

Sizes: torch's trace entries carry the *requested* size; the allocator's
``allocated_bytes`` counts *block* sizes.  A block alive at either snapshot has its exact
size there; any other is the request rounded up to the allocator's 512-byte granule
(a block the allocator did not split keeps a remainder of up to 1 MiB that this misses).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from ._peak_record import CATEGORIES, TOP_MODULES, ModuleBytes, PeakExplanation, unavailable_explanation

__all__ = [
    "CATEGORIES",
    "Event",
    "ModuleBytes",
    "Observation",
    "PeakExplanation",
    "TOP_MODULES",
    "MARKER",
    "explain",
    "marker_events",
    "round_block",
    "unavailable_explanation",
]

#: The categories a hook can claim, in priority order (see :data:`CATEGORIES`).
_CLAIMED = CATEGORIES[:4]

#: The allocator's granule: every block is a multiple of it (``kMinBlockSize``).
BLOCK_BYTES = 512

#: How far (µs) an observation's time may fall outside the lifetime of the block it
#: names: host times are aligned to the trace's clock to a few µs.
TOLERANCE_US = 100.0

#: Timeline points kept in the record (the bucket maxima, so the peak stays visible).
TIMELINE_POINTS = 200

#: The prefix of stepprof's markers among the history's ``external_annotations``:
#: ``stepprof:fwd:NAME`` (a module's forward, START and END), ``stepprof:bwd:NAME`` (the
#: gradient of its output arrived: its backward starts), ``stepprof:bwd_end`` (the backward
#: pass finished), ``stepprof:phase:KEY`` (a phase, START and END).
MARKER = "stepprof:"

#: Module names for live bytes that no module made.
BEFORE_STEP = "(before the step)"
OUTSIDE_MODULES = "(outside modules)"


def round_block(requested: int) -> int:
    """The block the allocator gives for ``requested`` bytes (the 512-byte granule)."""
    if requested <= BLOCK_BYTES:
        return BLOCK_BYTES
    return BLOCK_BYTES * ((requested + BLOCK_BYTES - 1) // BLOCK_BYTES)


@attrs.frozen
class Observation:
    """A storage that the hook saw: ``category`` is one of the four claimed ones.

    ``when``: ``"start"`` (seen at the step's entry: a block alive then), ``"end"`` (at
    its exit: a block alive then), or a time in the trace's clock (µs) at which it was alive.
    """

    category: str
    ptr: int
    nbytes: int
    when: str | float


@attrs.frozen
class Event:
    """A module or phase boundary, at ``t_us`` in the trace's clock.

    ``action``: ``"enter"``/``"exit"`` (a module's forward, or a phase), ``"backward"``
    (the gradient of a module's output is ready: its backward starts), ``"backward_end"``
    (the backward pass finished).
    """

    t_us: float
    action: str
    name: str


# -- the replay ----------------------------------------------------------------------


class _Block:
    """One allocation's life: alive from ``t_alloc`` (None: before the step) to ``t_free``."""

    __slots__ = ("addr", "size", "t_alloc", "t_free", "frames", "index", "freed_at", "ranges")

    def __init__(self, addr: int, size: int, t_alloc: float | None, frames: Sequence[Any], index: int) -> None:
        self.addr = addr
        self.size = size
        self.t_alloc = t_alloc
        self.t_free: float | None = None
        self.frames = frames
        self.index = index  # the trace entry that allocated it (-1: before the step)
        self.freed_at: int | None = None  # the trace entry that freed it
        self.ranges: dict[str, list[tuple[int, int]]] = {}


def _device_trace(snapshot: Mapping[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return list(traces[device]) if device < len(traces) else []


def _segments(snapshot: Mapping[str, Any], device: int) -> list[dict[str, Any]]:
    return [s for s in snapshot.get("segments") or [] if s.get("device", device) == device]


def _live_blocks(snapshot: Mapping[str, Any], device: int) -> dict[int, int]:
    """Address to size of the blocks a snapshot shows allocated."""
    return {b["address"]: b["size"] for s in _segments(snapshot, device) for b in s.get("blocks", ())
            if b.get("state") == "active_allocated"}


def _step_entries(trace: list[dict[str, Any]], start_index: int | None) -> list[dict[str, Any]]:
    """The entries after the start snapshot's marker (all of them without one)."""
    return trace if start_index is None else trace[start_index + 1:]


def _frame_text(frame: Mapping[str, Any]) -> str:
    filename = str(frame.get("filename", "?"))
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{frame.get('line', '?')}"


def _in_torch(frame: Mapping[str, Any]) -> bool:
    filename = str(frame.get("filename", "")).replace("\\", "/")
    return ("/torch/" in filename or filename.startswith("torch/") or "/stepprof/" in filename
            or filename.startswith("<"))


def _op_of(frames: Sequence[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """(the innermost frame as ``name (file:line)``, the innermost frame outside torch)."""
    if not frames:
        return None, None
    first = frames[0]
    op = f"{first.get('name', '?')} ({_frame_text(first)})"
    user = next((_frame_text(f) for f in frames if not _in_torch(f)), None)
    return op, user


def _subtract(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``intervals``, merged and sorted."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _measure(union: list[tuple[int, int]], taken: list[tuple[int, int]]) -> int:
    """Bytes of ``union`` not in ``taken`` (both merged and sorted)."""
    total = 0
    j = 0
    for lo, hi in union:
        n = hi - lo
        while j < len(taken) and taken[j][1] <= lo:
            j += 1
        k = j
        while k < len(taken) and taken[k][0] < hi:
            n -= min(hi, taken[k][1]) - max(lo, taken[k][0])
            k += 1
        total += n
    return total


def _split_block(block: _Block, fallback: str) -> dict[str, int]:
    """A live block's bytes by category: claimed ranges in priority order; the rest (the
    allocator's rounding included) goes to the largest claim, else to ``fallback``."""
    out: dict[str, int] = {}
    taken: list[tuple[int, int]] = []
    for category in _CLAIMED:
        ranges = block.ranges.get(category)
        if not ranges:
            continue
        union = _subtract(ranges)
        n = _measure(union, taken)
        if n > 0:
            out[category] = n
        taken = _subtract(taken + union)
    rest = block.size - sum(out.values())
    if rest > 0:
        target = max(out, key=lambda c: out[c]) if out else fallback
        out[target] = out.get(target, 0) + rest
    return out


#: Actions that close an interval: at the same µs as an allocation they count after it.
_CLOSING = frozenset({"exit"})


def _before(times: list[float], closing: list[bool], t_us: float) -> int:
    """The index of the last event before an allocation at ``t_us`` (-1: none).  The trace's
    µs are truncated, so an event in the same µs counts before the allocation, unless it
    closes an interval (the allocation was then made inside it)."""
    i = bisect.bisect_right(times, t_us) - 1
    while i >= 0 and times[i] == t_us and closing[i]:
        i -= 1
    return i


class _Timeline:
    """The innermost module at any instant, from the module events (in time order; events
    in the same µs keep their order)."""

    def __init__(self, events: Iterable[Event]) -> None:
        stack: list[str] = []
        backward: str | None = None
        self.times: list[float] = []
        self.closing: list[bool] = []
        self.names: list[str | None] = []
        self.in_forward: list[bool] = []
        for ev in sorted(events, key=lambda e: e.t_us):
            if ev.action == "enter":
                stack.append(ev.name)
            elif ev.action == "exit":
                if ev.name in stack:  # a forward that raised left its inner modules open
                    del stack[len(stack) - 1 - stack[::-1].index(ev.name):]
            elif ev.action == "backward":
                backward = ev.name
            elif ev.action == "backward_end":
                backward = None
            self.times.append(ev.t_us)
            self.closing.append(ev.action in _CLOSING)
            self.names.append(stack[-1] if stack else backward)
            self.in_forward.append(bool(stack))

    def at(self, t_us: float) -> str | None:
        i = _before(self.times, self.closing, t_us)
        return self.names[i] if i >= 0 else None


def _phase_at(events: Sequence[Event], t_us: float) -> str | None:
    stack: list[str] = []
    ordered = sorted(events, key=lambda e: e.t_us)
    last = _before([e.t_us for e in ordered], [e.action in _CLOSING for e in ordered], t_us)
    for ev in ordered[:last + 1]:
        if ev.action == "enter":
            stack.append(ev.name)
        elif ev.action == "exit" and ev.name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(ev.name):]
    return stack[-1] if stack else None



# -- the markers: module and phase boundaries in the trace's own clock ----------------


def _on_device(annotations: Iterable[Mapping[str, Any]], device: int) -> list[Mapping[str, Any]]:
    return [a for a in annotations if a.get("device", device) == device and a.get("time_us") is not None]


def marker_events(annotations: Iterable[Mapping[str, Any]], device: int) -> tuple[list[Event], list[Event]]:
    """stepprof's markers among a snapshot's ``external_annotations`` on ``device``, as
    (module events, phase events) in the trace's clock (µs); the list's order is kept."""
    modules: list[Event] = []
    phases: list[Event] = []
    for a in _on_device(annotations, device):
        name = str(a.get("name", ""))
        if not name.startswith(MARKER):
            continue
        kind, _, rest = name[len(MARKER):].partition(":")
        start = a.get("stage") == "START"
        t = float(a["time_us"])
        if kind == "fwd":
            modules.append(Event(t, "enter" if start else "exit", rest))
        elif kind == "bwd" and start:
            modules.append(Event(t, "backward", rest))
        elif kind == "bwd_end" and start:
            modules.append(Event(t, "backward_end", ""))
        elif kind == "phase":
            phases.append(Event(t, "enter" if start else "exit", rest))
    return modules, phases


def _spans(annotations: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, str, int]]:
    """Other annotations (aten ops where torch records them, your ``record_function`` ranges)
    as (start, end, name, order); each END closes the latest open START of its name, so
    ranges of other threads interleave without breaking the pairs.  Never closed: end inf."""
    open_: dict[str, list[tuple[float, int]]] = {}
    out: list[tuple[float, float, str, int]] = []
    for i, a in enumerate(annotations):
        name = str(a.get("name", ""))
        if name.startswith(MARKER):
            continue
        if a.get("stage") == "START":
            open_.setdefault(name, []).append((float(a["time_us"]), i))
        elif a.get("stage") == "END" and open_.get(name):
            t0, j = open_[name].pop()
            out.append((t0, float(a["time_us"]), name, j))
    out.extend((t0, math.inf, name, j) for name, ts in open_.items() for t0, j in ts)
    return out


def _contexts(module_events: Sequence[Event], phase_events: Sequence[Event]) -> list[tuple[float, float]]:
    """The intervals the markers open: forwards, phases and each module's stretch of backward
    (to the next module's, or the end of the pass)."""
    out: list[tuple[float, float]] = []
    for events in (module_events, phase_events):
        opened: dict[str, list[float]] = {}
        ordered = sorted(events, key=lambda e: e.t_us)
        for k, ev in enumerate(ordered):
            if ev.action == "enter":
                opened.setdefault(ev.name, []).append(ev.t_us)
            elif ev.action == "exit" and opened.get(ev.name):
                out.append((opened[ev.name].pop(), ev.t_us))
            elif ev.action == "backward":
                nxt = next((e.t_us for e in ordered[k + 1:] if e.action in ("backward", "backward_end")), math.inf)
                out.append((ev.t_us, nxt))
    return out


def _op_at(spans: list[tuple[float, float, str, int]], contexts: list[tuple[float, float]],
           t_us: float) -> str | None:
    """The innermost annotation open at an allocation at ``t_us`` that nests inside the
    innermost marker interval holding it.

    Annotations carry a device but no thread.  A range of another thread is told by its
    not nesting with the markers of the allocating thread: one that opens before the
    interval and closes inside it (or the reverse) is not the allocation's.  A range that
    encloses the interval (your step-wide ``record_function``) is context, not the op."""
    holding = [(s, e) for s, e in contexts if s <= t_us <= e]
    lo, hi = max(holding, key=lambda c: (c[0], -c[1])) if holding else (-math.inf, math.inf)
    best: tuple[float, int, str] | None = None
    for s, e, name, j in spans:
        if s <= t_us <= e and s >= lo and e <= hi and (best is None or (s, j) > best[:2]):
            best = (s, j, name)
    return best[2] if best is not None else None


def _timeline(points: list[tuple[float, int]], t0: float) -> tuple[list[float], list[int]]:
    """At most :data:`TIMELINE_POINTS` (ms since ``t0``, live bytes): each bucket's maximum."""
    if len(points) <= TIMELINE_POINTS:
        return [round((t - t0) / 1000, 4) for t, _ in points], [n for _, n in points]
    per = math.ceil(len(points) / TIMELINE_POINTS)
    ms, values = [], []
    for i in range(0, len(points), per):
        chunk = points[i:i + per]
        t, n = max(chunk, key=lambda p: p[1])
        ms.append(round((t - t0) / 1000, 4))
        values.append(n)
    return ms, values


def _free_ranges(segments: dict[int, int], occupied: list[tuple[int, int]]) -> int:
    """The largest gap between occupied ranges inside the segments (address: size)."""
    occupied = sorted(occupied)
    starts = [lo for lo, _ in occupied]
    largest = 0
    for addr, size in segments.items():
        end = addr + size
        cursor = addr
        i = bisect.bisect_left(starts, addr)
        while i < len(occupied) and occupied[i][0] < end:
            lo, hi = occupied[i]
            largest = max(largest, lo - cursor)
            cursor = max(cursor, hi)
            i += 1
        largest = max(largest, end - cursor)
    return largest


def explain(
    start: Mapping[str, Any] | None,
    end: Mapping[str, Any],
    *,
    device: int,
    step: int | None = None,
    t0_us: float | None = None,
    observations: Iterable[Observation] = (),
    module_events: Sequence[Event] | None = None,
    phase_events: Sequence[Event] | None = None,
    annotations: Sequence[Mapping[str, Any]] | None = None,
    in_clock: bool = False,
    peak_allocated_bytes: int | None = None,
    max_entries: int | None = None,
    activations_from: str | None = "saved_tensors_hooks",
    cost_ms: float | None = None,
    notes: Sequence[str] = (),
    unavailable: Mapping[str, str] | None = None,
) -> PeakExplanation:
    """Replay one step's allocator history and break its peak down.

    Args:
        start: the snapshot taken at the step's entry, right after recording began (its
            ``snapshot`` entry marks where the step's history starts); None when it could
            not be taken: blocks alive before the step then come from the end snapshot
            and the frees, and the reserved figures are None.
        end: the snapshot taken at the step's exit, with the history.
        device: the CUDA device index.
        step: the step's index.
        t0_us: the step's entry in the trace's clock (default: the first entry).
        observations: the storages seen as parameters, gradients, optimizer state, saved.
        module_events: modules' forward/backward boundaries (None: no module breakdown).
        phase_events: the step's phase boundaries (None: no phase).
        annotations: the snapshot's ``external_annotations`` (None: none recorded): the op
            at the peak is the innermost one open at its allocation (see :func:`_op_at`).
        in_clock: the events' times are the trace's own (stepprof's markers), not host
            times aligned to it.
        peak_allocated_bytes: the allocator's counter for the step, to compare with.
        max_entries: the history's bound: a trace that long may have lost its start.
        activations_from: ``"saved_tensors_hooks"`` (saved storages are observations),
            ``"stacks"`` (a block made under a function named ``forward`` is an
            activation), or None (activations unknown: they count as temporaries).
        cost_ms: the explaining's cost so far (the replay's own time is the caller's).
        notes, unavailable: carried into the result.
    """
    dev = f"cuda:{device}"
    notes = list(notes)
    missing = dict(unavailable or {})
    entries, t0_us, refused = _step_history(start, end, device, max_entries, t0_us)
    if refused is not None:
        return unavailable_explanation(refused, step=step, device=dev,
                                       peak_allocated_bytes=peak_allocated_bytes, cost_ms=cost_ms)
    end_live = _live_blocks(end, device)
    run = _replay(entries, _alive_at_start(start, device, entries, end_live, notes),
                  _exact_at_end(entries, end_live), t0_us, notes)
    at_peak = _claimed_at_peak(run.blocks, run.peak_index, observations)
    shift = 0.0 if in_clock else 0.5  # host times aligned to the trace: the middle of its truncated µs
    timeline = _Timeline(module_events) if module_events is not None else None
    categories, per_module, outside = _categorise(at_peak, activations_from, timeline, shift, missing)
    live_bytes = sum(categories.values())
    modules = _ranked_modules(per_module, timeline is not None, missing)
    phase = _phase_of_peak(phase_events, run.peak_t + shift, missing)
    op, user = _op_of_peak(entries, run, device, annotations, module_events, phase_events, timeline, shift,
                           missing)
    reserved, fragmentation, largest_free = _segments_at_peak(
        start, device, entries, run, at_peak, live_bytes, notes, missing)
    _check_counter(live_bytes, peak_allocated_bytes, notes, missing)
    ms, values = _timeline(run.points, t0_us)
    return PeakExplanation(
        step=step, device=dev, peak_allocated_bytes=peak_allocated_bytes, live_bytes=live_bytes,
        peak_at_ms=round((run.peak_t - t0_us) / 1000, 4), phase=phase, op=op, user_frame=user,
        bytes_by_category=categories, modules=modules,
        outside_modules_bytes=outside if timeline is not None else None,
        reserved_bytes=reserved, fragmentation_bytes=fragmentation,
        largest_free_block_bytes=largest_free, live_blocks=len(at_peak), trace_entries=len(entries),
        cost_ms=cost_ms, timeline_ms=ms, timeline_bytes=values, activations_from=activations_from,
        notes=notes, unavailable=missing,
    )


# -- the steps of explain: each fills in its figures, and adds its notes and the reasons
# of the figures it could not give to ``notes`` and ``missing`` ---------------------------


def _step_history(start: Mapping[str, Any] | None, end: Mapping[str, Any], device: int,
                  max_entries: int | None, t0_us: float | None) -> tuple[list[dict[str, Any]], float, str | None]:
    """(the step's trace entries, its entry in the trace's clock, why it cannot be replayed or None)."""
    trace = _device_trace(end, device)
    start_index = next((i for i, e in enumerate(trace) if e.get("action") == "snapshot"), None)
    if max_entries is not None and len(trace) >= max_entries:
        return [], 0.0, (f"the allocator's history overflowed its bound of {max_entries} entries during the "
                         f"step (the oldest were dropped), so the step cannot be replayed; explain a smaller step")
    if start is not None and start_index is None:
        return [], 0.0, ("the allocator's history lacks the marker of the step's start (this torch records no "
                         "'snapshot' entries), so the step's entries cannot be told from earlier ones")
    entries = _step_entries(trace, start_index)
    if t0_us is None:
        t0_us = trace[start_index]["time_us"] if start_index is not None else (
            entries[0].get("time_us", 0) if entries else 0)
    return entries, t0_us, None


def _exact_at_end(entries: list[dict[str, Any]], end_live: dict[int, int]) -> dict[int, int]:
    """Entry index to exact size of the allocations still alive at the end snapshot."""
    last_alloc: dict[int, int] = {}
    freed_after: set[int] = set()
    for i, e in enumerate(entries):
        a = e.get("action")
        if a == "alloc":
            last_alloc[e["addr"]] = i
            freed_after.discard(e["addr"])
        elif a == "free_requested":
            freed_after.add(e["addr"])
    return {i: end_live[addr] for addr, i in last_alloc.items()
            if addr not in freed_after and addr in end_live}


def _alive_at_start(start: Mapping[str, Any] | None, device: int, entries: list[dict[str, Any]],
                    end_live: dict[int, int], notes: list[str]) -> dict[int, _Block]:
    """The blocks alive at the step's start: the start snapshot's, else those freed or alive at
    the end without being allocated in the step."""
    live: dict[int, _Block] = {}
    addr: Any  # an int, or whatever a trace entry holds
    if start is not None:
        for addr, size in _live_blocks(start, device).items():
            live[addr] = _Block(addr, size, None, (), -1)
        return live
    seen: set[int] = set()
    for e in entries:
        a, addr = e.get("action"), e.get("addr")
        if a == "alloc":
            seen.add(addr)
        elif a == "free_requested" and addr not in seen and addr not in live:
            live[addr] = _Block(addr, round_block(e.get("size", 0)), None, (), -1)
    for addr, size in end_live.items():
        if addr not in seen and addr not in live:
            live[addr] = _Block(addr, size, None, (), -1)
    notes.append("no snapshot at the step's start: blocks alive before it are sized from their "
                 "frees (rounded to 512 B), and reserved memory is unknown")
    return live


class _Replay(NamedTuple):
    """The step's history replayed: every block, live bytes over time, and the high-water mark
    (``peak_index``: the entry that set it, -1 for the step's start; ``peak_t``: its time)."""

    blocks: list[_Block]
    points: list[tuple[float, int]]
    peak_index: int
    peak_t: float


def _replay(entries: list[dict[str, Any]], live: dict[int, _Block], exact_at_end: dict[int, int],
            t0_us: float, notes: list[str]) -> _Replay:
    """Replay the allocations and frees from the blocks ``live`` at the start (which it updates)."""
    blocks: list[_Block] = list(live.values())
    current = sum(b.size for b in live.values())
    peak, peak_index, peak_t = current, -1, t0_us
    points: list[tuple[float, int]] = [(t0_us, current)]
    unmatched_frees = 0
    b: _Block | None
    for i, e in enumerate(entries):
        a = e.get("action")
        if a == "alloc":
            t = e.get("time_us", t0_us)
            b = _Block(e["addr"], exact_at_end.get(i) or round_block(e.get("size", 0)), t, e.get("frames") or (), i)
            live[b.addr] = b
            blocks.append(b)
            current += b.size
        elif a == "free_requested":
            b = live.pop(e["addr"], None)
            if b is None:
                unmatched_frees += 1
                continue
            b.t_free = e.get("time_us", t0_us)
            b.freed_at = i
            current -= b.size
        else:
            continue
        points.append((e.get("time_us", t0_us), current))
        if current > peak:
            peak, peak_index, peak_t = current, i, e.get("time_us", t0_us)
    if unmatched_frees:
        notes.append(f"{unmatched_frees} frees of blocks the replay did not know were skipped")
    return _Replay(blocks, points, peak_index, peak_t)


def _claimed_at_peak(blocks: list[_Block], peak_index: int, observations: Iterable[Observation]) -> list[_Block]:
    """The live set at the peak (allocated by then, not freed by then), each block with the
    ranges the observations claim of it."""
    at_peak = [b for b in blocks if b.index <= peak_index and
               (b.freed_at is None or b.freed_at > peak_index)]
    by_addr = sorted(at_peak, key=lambda b: b.addr)
    addrs = [b.addr for b in by_addr]
    for ob in observations:
        i = bisect.bisect_right(addrs, ob.ptr) - 1
        if i < 0:
            continue
        b = by_addr[i]
        if ob.ptr >= b.addr + b.size or not _alive_when(b, ob.when):
            continue
        lo, hi = max(ob.ptr, b.addr), min(ob.ptr + max(ob.nbytes, 1), b.addr + b.size)
        b.ranges.setdefault(ob.category, []).append((lo, hi))
    return at_peak


def _categorise(at_peak: list[_Block], activations_from: str | None, timeline: _Timeline | None,
                shift: float, missing: dict[str, str]) -> tuple[dict[str, int], dict[str, dict[str, int]], int]:
    """(live bytes by category, by module and category, bytes made outside every module)."""
    categories = dict.fromkeys(CATEGORIES, 0)
    per_module: dict[str, dict[str, int]] = {}
    outside = 0
    for b in at_peak:
        if b.t_alloc is None:
            fallback = "other"
        elif activations_from == "stacks" and any(f.get("name") == "forward" for f in b.frames):
            fallback = "activations"
        else:
            fallback = "temporaries"
        split = _split_block(b, fallback)
        for c, n in split.items():
            categories[c] += n
        if timeline is not None and b.t_alloc is not None:
            name = timeline.at(b.t_alloc + shift)
            if name is None:
                outside += b.size
            else:
                m = per_module.setdefault(name, {})
                for c, n in split.items():
                    m[c] = m.get(c, 0) + n
    if activations_from is None:
        missing["bytes_by_category.activations"] = (
            "saved tensors could not be told from temporaries in this step; they count as temporaries")
    return categories, per_module, outside


def _ranked_modules(per_module: dict[str, dict[str, int]], watched: bool,
                    missing: dict[str, str]) -> tuple[ModuleBytes, ...] | None:
    """The :data:`TOP_MODULES` largest modules; None when no module was ``watched``."""
    if not watched:
        missing.setdefault("modules", "no model was given (pass model=), so no module hooks ran")
        missing.setdefault("outside_modules_bytes", missing["modules"])
        return None
    ranked = sorted(per_module.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    return tuple(ModuleBytes(name, sum(c.values()), {k: c[k] for k in CATEGORIES if k in c})
                 for name, c in ranked[:TOP_MODULES])


def _phase_of_peak(phase_events: Sequence[Event] | None, t_us: float, missing: dict[str, str]) -> str | None:
    """The innermost phase open at the peak (at ``t_us``)."""
    if "phase" in missing:
        return None  # the caller's reason (a step whose phases were not watched)
    if phase_events is None or not phase_events:
        missing["phase"] = "the step has no phases (stepprof.measure inside the step)"
        return None
    phase = _phase_at(phase_events, t_us)
    if phase is None:
        missing["phase"] = "the peak fell outside every phase of the step"
    return phase


def _op_of_peak(entries: list[dict[str, Any]], run: _Replay, device: int,
                annotations: Sequence[Mapping[str, Any]] | None, module_events: Sequence[Event] | None,
                phase_events: Sequence[Event] | None, timeline: _Timeline | None, shift: float,
                missing: dict[str, str]) -> tuple[str | None, str | None]:
    """(the op at the allocation that set the peak, its innermost frame outside torch)."""
    if run.peak_index < 0:
        missing["op"] = missing["user_frame"] = (
            "nothing allocated during the step rose above what was alive at its start")
        return None, None
    frames = entries[run.peak_index].get("frames") or ()
    op, user = _op_of(frames)
    if annotations:
        on_device = _on_device(annotations, device)
        op = _op_at(_spans(on_device), _contexts(module_events or (), phase_events or ()), run.peak_t) or op
    no_frames = ("the allocation that set the peak has no Python frames (made on the autograd "
                 "engine's thread, in backward, or in C++)")
    if op is None:
        where = timeline.at(run.peak_t + shift) if timeline is not None else None
        missing["op"] = no_frames + (f" and no annotation was open at it; it was made in {where!r}"
                                     if where else "")
    if user is None:
        missing["user_frame"] = ("every frame of the allocation that set the peak is in torch"
                                 if frames else no_frames)
    return op, user


def _segments_at_peak(start: Mapping[str, Any] | None, device: int, entries: list[dict[str, Any]],
                      run: _Replay, at_peak: list[_Block], live_bytes: int, notes: list[str],
                      missing: dict[str, str]) -> tuple[int | None, int | None, int | None]:
    """(reserved, fragmentation, largest free block) at the peak, replayed from the start's segments."""
    if start is None:
        for name in ("reserved_bytes", "fragmentation_bytes", "largest_free_block_bytes"):
            missing[name] = "no snapshot was taken at the step's start, so the segments then are unknown"
        return None, None, None
    segs = {s["address"]: s["total_size"] for s in _segments(start, device)}
    pending: dict[int, int] = {}
    at_peak_addrs = {b.addr for b in at_peak}
    sizes = {b.addr: b.size for b in run.blocks}
    for i, e in enumerate(entries):
        if i > run.peak_index:
            break
        a = e.get("action")
        if a in ("segment_alloc", "segment_map"):
            segs[e["addr"]] = segs.get(e["addr"], 0) + e.get("size", 0)
        elif a in ("segment_free", "segment_unmap"):
            left = segs.get(e["addr"], 0) - e.get("size", 0)
            if left > 0:
                segs[e["addr"]] = left
            else:
                segs.pop(e["addr"], None)
        elif a == "free_requested" and e["addr"] not in at_peak_addrs:
            pending[e["addr"]] = sizes.get(e["addr"], round_block(e.get("size", 0)))
        elif a == "free_completed":
            pending.pop(e["addr"], None)
    if any(s.get("is_expandable") for s in _segments(start, device)) or any(
            e.get("action") == "segment_map" for e in entries):
        notes.append("expandable segments: reserved memory at the peak is replayed from the "
                     "mapped ranges")
    reserved = sum(segs.values())
    occupied = [(b.addr, b.addr + b.size) for b in at_peak] + [(a, a + n) for a, n in pending.items()]
    return reserved, reserved - live_bytes, _free_ranges(segs, occupied)


def _check_counter(live_bytes: int, peak_allocated_bytes: int | None, notes: list[str],
                   missing: dict[str, str]) -> None:
    """A note where the replayed peak and the allocator's counter disagree by over 1%."""
    if peak_allocated_bytes is not None and peak_allocated_bytes > 0:
        gap = abs(live_bytes - peak_allocated_bytes) / peak_allocated_bytes
        if gap > 0.01:
            notes.append(
                f"the replayed peak ({live_bytes} B) differs from the allocator's counter "
                f"({peak_allocated_bytes} B) by {gap:.1%}: blocks the allocator did not split, or "
                f"allocations on other threads or devices")
    if peak_allocated_bytes is None:
        missing.setdefault("peak_allocated_bytes", "the allocator's counter was not read for this step")


def _alive_when(b: _Block, when: str | float) -> bool:
    """Whether the observation at ``when`` can be of block ``b`` (not of an earlier or later
    block at the same address)."""
    if when == "start":
        return b.t_alloc is None
    if when == "end":
        return b.t_free is None
    t = float(when)
    if b.t_alloc is not None and t < b.t_alloc - TOLERANCE_US:
        return False
    return b.t_free is None or t <= b.t_free + TOLERANCE_US

"""``stepprof export``: the steps of one or more logs as a Chrome/Perfetto trace or as TensorBoard scalars.

docs/howto/export.md describes both outputs.  Each log is read twice, streaming: the first pass
finds its runs (grouped as ``stepprof report`` groups them, :class:`~stepprof._report.read.RunGrouper`),
their ranks and the earliest step; the second writes.  So a long log never sits in memory,
and the trace's time origin and the TensorBoard directory layout are known before the first
event is written.  torch is imported only for ``--tensorboard``.
"""

from __future__ import annotations

import glob
import heapq
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import orjson

from ._errors import ConfigError, MissingExtraError
from ._log import ScanStats, scan
from ._paths import component, components, inside
from ._units import printable
from ._report.read import RunGrouper
from ._rules import RUN_KINDS as _RUN_KINDS

__all__ = ["Exported", "export_chrome", "export_tensorboard"]


#: The step figures written as TensorBoard scalars, under ``stepprof/<figure>``.
TB_FIGURES = (
    "gpu_ms", "wall_ms", "gpu_busy", "peak_allocated_bytes", "reserved_bytes", "host_rss_bytes",
    "samples_per_s", "tokens_per_s", "data_wait_ms", "overhead_us", "energy_j", "tflops_per_s", "mfu",
    "mfu_datasheet",
)
#: Each phase's figures, under ``stepprof/phases/<name>/<figure>``.
TB_PHASE_FIGURES = ("gpu_ms", "wall_ms")
#: Runs ``--tensorboard`` writes, one directory each: the last ones, in the order they begin
#: in the logs (the report, too, keeps a log's last runs).  The rest are counted.
TB_RUNS_KEPT = 100

# Short notes in the events' args; the trace's otherData and docs/howto/export.md explain them.
_GPU_ALIGNED = "starts at the host start (aligned); length exact"
_GPU_TILED = "tiles the step's GPU span from its start (offset exact); the step's start is aligned"
_SUMMED = "{n} runs: starts at the first, lasts their summed wall time"
_APPROXIMATE = "approximate: the log has no start_ms (older stepprof); laid out back to back"


@attrs.frozen
class Exported:
    """What an export wrote: where, how many steps, of how many ranks and runs."""

    path: str
    steps: int
    ranks: int  # distinct ranks among the runs (0: no run carries one)
    runs: int
    skipped: int  # step records without a usable index, start time or wall time
    runs_left_out: int = 0  # runs with steps that were not written (--tensorboard keeps the last TB_RUNS_KEPT)


# -- reading --------------------------------------------------------------------------


def _ns(ms: float) -> int:
    """Milliseconds (as the log writes them, from integer nanoseconds) back to nanoseconds."""
    return round(ms * 1e6)


class _Run:
    """One run of one log: a profiler's steps (one rank's, in a distributed run)."""

    __slots__ = ("log", "run_id", "rank", "world_size", "device", "steps", "first_s", "label", "pid", "subdir",
                 "written")

    def __init__(self, log: str, run_id: str | None) -> None:
        self.log = log
        self.run_id = run_id
        self.rank: int | None = None
        self.world_size: int | None = None
        self.device: str | None = None
        self.steps = 0  # usable step records
        self.first_s = math.inf  # the earliest start_unix_s
        self.label = ""
        self.pid = 0
        self.subdir = ""
        self.written = 0


def _usable(r: dict[str, Any]) -> bool:
    """Whether a step record can be placed: a start time and a wall time (its index is an int:
    the records come through ``scan``, where a value of the wrong type or out of range is null)."""
    return r.get("start_unix_s") is not None and r.get("wall_ms") is not None


def _walk(
    path: str, new_run: Callable[[str | None], _Run], stats: ScanStats | None = None
) -> Iterator[tuple[_Run, dict[str, Any]]]:
    """The step records of ``path`` with their runs (every run record goes through the grouper)."""
    run_of = RunGrouper(new_run).run_of
    for r in scan(path, stats if stats is not None else ScanStats()):
        kind = r.get("kind")
        if kind in _RUN_KINDS:
            run = run_of(kind, r)
            if kind == "step":
                yield run, r


def _check_logs(paths: Sequence[str]) -> list[str]:
    if not paths:
        raise ConfigError("'LOG' is missing: pass the path of at least one stepprof JSON-lines log")
    out = []
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            raise ConfigError(f"'LOG' {p!r} does not exist; pass the path of a stepprof JSON-lines log")
        if not os.path.isfile(p):
            raise ConfigError(f"'LOG' {p!r} is not a file; pass the path of a stepprof JSON-lines log")
        out.append(p)
    return out


def _survey(paths: Sequence[str]) -> tuple[list[list[_Run]], int]:
    """First pass: each log's runs, in order of their first record, and the unusable steps."""
    per_log: list[list[_Run]] = []
    skipped = 0
    for path in paths:
        runs: list[_Run] = []

        def new_run(run_id: str | None, runs: list[_Run] = runs, path: str = path) -> _Run:
            runs.append(_Run(path, run_id))
            return runs[-1]

        seen = 0
        stats = ScanStats()
        for run, r in _walk(path, new_run, stats):
            seen += 1
            if not _usable(r):
                skipped += 1
                continue
            run.steps += 1
            start = float(r["start_unix_s"])
            if start < run.first_s:
                run.first_s = start
            rank = r.get("rank")
            if run.rank is None and type(rank) is int:
                run.rank, world = rank, r.get("world_size")
                run.world_size = world if type(world) is int else None
            device = r.get("device")
            if type(device) is str and (run.device is None or (
                    device.startswith("cuda") and not run.device.startswith("cuda"))):
                run.device = device  # the first, or the first CUDA device after the host
        if not any(run.steps for run in runs):
            foreign = stats.foreign()
            why = f" ({seen:,} without a usable index, start_unix_s or wall_ms)" if seen else ""
            what = f"is {foreign}" if foreign is not None else f"has no step records to export{why}"
            raise ConfigError(f"'LOG' {path!r} {what}; pass a log that stepprof.Profiler wrote steps to")
        per_log.append(runs)
    return per_log, skipped


def _label_runs(per_log: list[list[_Run]]) -> list[_Run]:
    """Give each run with steps its process label, pid and TensorBoard subdirectory.

    A subdirectory is made of :func:`~stepprof._paths.component`\\ s only (a run's ``run_id``
    comes from the log, which may hold anything), unique among the runs.
    """
    runs = [run for runs in per_log for run in runs if run.steps]
    multi_rank = len({run.rank for run in runs if run.rank is not None}) > 1

    def grouped(key: Callable[[_Run], str]) -> dict[str, list[_Run]]:
        groups: dict[str, list[_Run]] = {}
        for run in runs:
            groups.setdefault(key(run), []).append(run)
        return groups

    def names(members: list[_Run]) -> list[str]:
        return components(run.run_id if run.run_id is not None else f"run{k}" for k, run in enumerate(members, 1))

    for base, members in grouped(lambda r: f"rank {r.rank}" if r.rank is not None
                                 else os.path.basename(r.log)).items():
        for run, name in zip(members, names(members), strict=True):
            run.label = base if len(members) == 1 else f"{base} · run {name}"
    for part, members in grouped(lambda r: component(f"rank{r.rank}" if r.rank is not None else
                                                     os.path.splitext(os.path.basename(r.log))[0])
                                 if multi_rank else "").items():
        for run, name in zip(members, names(members), strict=True):
            parts = [part] + ([name] if len(members) > 1 else [])
            run.subdir = os.path.join(*[x for x in parts if x]) if any(parts) else ""
    order = sorted(runs, key=lambda r: (r.rank if r.rank is not None else math.inf, r.first_s))
    for pid, run in enumerate(order, 1):
        run.pid = pid
    return runs


def _read(paths: Sequence[str]) -> tuple[list[str], list[list[_Run]], list[_Run], int]:
    paths = _check_logs(paths)
    per_log, skipped = _survey(paths)
    return paths, per_log, _label_runs(per_log), skipped


def _steps(paths: Sequence[str], per_log: list[list[_Run]]) -> Iterator[tuple[_Run, dict[str, Any]]]:
    """Second pass: the usable step records with their runs.  The grouping is deterministic,
    so the runs come in the first pass's order; steps appended to a log since (a run still
    writing) are left out, so the export is the first pass's snapshot."""
    for path, runs in zip(paths, per_log, strict=True):
        made = iter(runs)

        def new_run(run_id: str | None, made: Iterator[_Run] = made, path: str = path) -> _Run:
            return next(made, None) or _Run(path, run_id)  # a run begun since: not exported

        for run, r in _walk(path, new_run):
            if run.written < run.steps and _usable(r):
                run.written += 1
                yield run, r


def _summary(runs: list[_Run], skipped: int, out: str, left_out: int = 0) -> Exported:
    ranks = {run.rank for run in runs if run.rank is not None}
    return Exported(path=out, steps=sum(run.steps for run in runs), ranks=len(ranks), runs=len(runs),
                    skipped=skipped, runs_left_out=left_out)


# -- Chrome trace ----------------------------------------------------------------------


#: Lanes of a track searched in order for one where a slice nests; past them, lanes are reused
#: only once they are free (a heap of the times they are free from), so that placing a slice
#: costs O(log lanes) however many slices overlap it (steps that never nest, out of order).
LANES_SEARCHED = 4


class _Lanes:
    """The lanes of one drawn track.  A slice goes on the first lane where it nests properly
    (inside the open slice, after the closed ones): trace viewers require it on one thread,
    and a GPU span that outlasts the next step's start, or a repeated phase's summed slice,
    would break it.  The lane of the latest slice is tried first, for a slice that nests in it
    (a phase in the step just drawn).  Past :data:`LANES_SEARCHED` lanes, a slice takes a lane
    whose slices all ended by its start, else a new one."""

    __slots__ = ("lanes", "free", "last")

    def __init__(self) -> None:
        self.lanes: list[tuple[list[tuple[int, int]], list[int]]] = []  # (open slices, [closed until])
        self.free: list[tuple[int, int]] = []  # (free from, lane) of the lanes past LANES_SEARCHED
        self.last = -1

    def place(self, s: int, e: int) -> int:
        lanes = self.lanes
        if self.last >= 0:  # nested in the latest slice's lane: its free time (in the heap) holds
            stack, closed = lanes[self.last]
            while stack and stack[-1][1] <= s:
                closed[0] = max(closed[0], stack.pop()[1])
            if stack and s >= closed[0] and stack[-1][0] <= s and e <= stack[-1][1]:
                stack.append((s, e))
                return self.last
        for i in range(min(len(lanes), LANES_SEARCHED)):
            stack, closed = lanes[i]
            while stack and stack[-1][1] <= s:
                closed[0] = max(closed[0], stack.pop()[1])
            if s >= closed[0] and (not stack or (stack[-1][0] <= s and e <= stack[-1][1])):
                stack.append((s, e))
                self.last = i
                return i
        free = self.free
        if len(lanes) >= LANES_SEARCHED and free and free[0][0] <= s:  # all its slices ended by s
            lane = free[0][1]
            heapq.heapreplace(free, (e, lane))
            lanes[lane] = ([(s, e)], [-(2**62)])
        else:
            lane = len(lanes)
            lanes.append(([(s, e)], [-(2**62)]))
            if lane >= LANES_SEARCHED:
                heapq.heappush(free, (e, lane))
        self.last = lane
        return lane


class _Trace:
    """The trace-event stream: events buffered and written in batches, thread ids per lane."""

    def __init__(self, f: Any, t0_s: float) -> None:
        self._f = f
        self._events: list[dict[str, Any]] = []
        self._first = True
        self.t0_s = t0_s
        # (pid, thread, track) -> its lanes, and the tid of each lane
        self._tracks: dict[tuple[int, str | None, str], tuple[_Lanes, list[int]]] = {}
        self._threads: dict[tuple[int, str | None], int] = {}  # (pid, thread) -> its order in the process
        self._next_tid: dict[int, int] = {}
        self._thread_count: dict[int, int] = {}  # pid -> threads seen in it

    def emit(self, event: dict[str, Any]) -> None:
        self._events.append(event)
        if len(self._events) >= 4096:
            self.flush()

    def flush(self) -> None:
        """Write the events buffered: one ``orjson.dumps`` of the list, without its brackets."""
        if self._events:
            text = orjson.dumps(self._events)  # every key is a str (the records are sanitised)
            self._f.write((b"" if self._first else b",\n") + text[1:-1])
            self._first = False
            self._events = []

    def _new_tid(self, pid: int, thread: str | None, track: str, lane: int, name: str) -> int:
        tid = self._next_tid.get(pid, 0) + 1
        self._next_tid[pid] = tid
        order = self._threads.get((pid, thread))
        if order is None:
            order = self._threads[(pid, thread)] = self._thread_count.get(pid, 0)
            self._thread_count[pid] = order + 1
        label = name if lane == 0 else f"{name} (lane {lane + 1})"
        self.emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        # A thread's host lanes, then its repeated phases' host tracks, its GPU lanes, and
        # their GPU tracks; each group in order of appearance.
        kind, _, repeated = track.partition(":")
        sort = order * 40_000 + (2 if kind == "gpu" else 0) * 10_000 + (10_000 if repeated else 0) + tid
        self.emit({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": sort}})
        return tid

    def slice(self, pid: int, thread: str | None, track: str, name: str, track_name: str,
              s: int, e: int, cat: str, args: dict[str, Any]) -> int:
        """Draw [s, e) ns on a lane of ``track`` of the thread; return its tid."""
        found = self._tracks.get((pid, thread, track))
        if found is None:
            found = self._tracks[(pid, thread, track)] = (_Lanes(), [])
        lane = found[0].place(s, e)
        tids = found[1]
        if lane < len(tids):
            tid = tids[lane]
        else:  # lanes are made one at a time: this is the next
            tid = self._new_tid(pid, thread, track, lane, track_name)
            tids.append(tid)
        self.emit({"name": name, "cat": cat, "ph": "X", "ts": s / 1e3, "dur": (e - s) / 1e3,
                   "pid": pid, "tid": tid, "args": args})
        return tid


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _phase_layout(phases: Any) -> list[tuple[str, dict[str, Any], int, int, bool]]:
    """The phases as (key, figures, host start ns from the step's start, wall ns, approximate),
    ordered by start (longest first at one start)."""
    if not phases:
        return []
    valid = [(k, f) for k, f in phases.items() if f is not None and f.get("wall_ms") is not None]
    out: list[tuple[str, dict[str, Any], int, int, bool]] = []
    if all(f.get("start_ms") is not None for _, f in valid):
        out = [(k, f, _ns(f["start_ms"]), _ns(f["wall_ms"]), False) for k, f in valid]
    else:  # an older log: back to back from the start of the step or the enclosing phase
        starts: dict[str, int] = {"": 0}
        cursor: dict[str, int] = {}
        for k, f in sorted(valid, key=lambda kf: kf[0].count("/")):
            parent = k.rpartition("/")[0]
            start = cursor.get(parent, starts.get(parent, 0))
            wall = _ns(f["wall_ms"])
            starts[k] = start
            cursor[parent] = start + wall
            out.append((k, f, start, wall, True))
    out.sort(key=lambda p: (p[2], -p[3]))
    return out


#: The step record's fields shown in its slice's args (those that are not null).
_STEP_ARGS = ("batch_size", "wall_ms", "gpu_ms", "gpu_busy", "samples_per_s", "tokens", "tokens_per_s", "data_wait_ms",
              "overhead_us", "sampled", "compiled", "run_id")
#: A phase's, likewise.
_PHASE_ARGS = ("wall_ms", "gpu_ms", "peak_allocated_bytes", "count", "syncs", "start_ms")


def _step_events(tr: _Trace, run: _Run, r: dict[str, Any]) -> None:
    pid = run.pid
    get = r.get
    draw = tr.slice
    thread = get("thread")
    host_name = "host" if thread is None else f"host: {thread}"
    s = round((r["start_unix_s"] - tr.t0_s) * 1e9)
    e = s + _ns(r["wall_ms"])
    index = r["step"]
    warmup = get("warmup") is True
    error = get("error")
    cat = "step" + (",warmup" if warmup else "") + (",error" if error else "")
    name = get("name")
    if name is None:
        name = "step"
    args: dict[str, Any] = {"step": index, "name": name, "warmup": warmup}
    if error is not None:
        args["error"] = error
    for k in _STEP_ARGS:
        v = get(k)
        if v is not None:
            args[k] = v
    # On the host track a step is named as torch.profiler names its steps, which HTA and the
    # TensorBoard plugin look for (its own name in args); on the GPU track, by its name.
    host_tid = draw(pid, thread, "host", f"ProfilerStep#{index}", host_name, s, e, cat, args)
    device = get("device") or run.device
    gpu_name = f"GPU {device or ''}".rstrip() + ("" if thread is None else f": {thread}")
    gpu_ms = get("gpu_ms")
    if gpu_ms is not None:
        draw(pid, thread, "gpu", name, gpu_name, s, s + _ns(gpu_ms), cat,
             {"step": index, "gpu_ms": gpu_ms, "placement": _GPU_ALIGNED})
    phases = _phase_layout(get("phases"))
    tiled: dict[str, tuple[int, int]] = {}
    if gpu_ms is not None and phases:
        top = [p for p in phases if "/" not in p[0]]
        if top and all(p[1].get("count") == 1 and p[1].get("gpu_ms") is not None for p in top):
            cum = 0.0
            gpu_end = s + _ns(gpu_ms)
            for key, fig, *_ in top:
                a = s + _ns(cum)
                cum += fig["gpu_ms"]
                # The last top-level end event precedes the step's: an excess is the events' rounding.
                tiled[key] = (a, min(s + _ns(cum), gpu_end))
    pcat = "phase,warmup" if warmup else "phase"
    for key, fig, start, wall, approx in phases:
        count = fig.get("count")
        repeated = type(count) is int and count > 1
        label = f"{key} ×{count}" if repeated else key
        pargs: dict[str, Any] = {"step": index}
        for k in _PHASE_ARGS:
            v = fig.get(k)
            if v is not None:
                pargs[k] = v
        if repeated:
            pargs["summed"] = _SUMMED.format(n=count)
        if approx:
            pargs["start"] = _APPROXIMATE
        # A phase that ran several times is drawn on a track of its own: its summed slice would
        # seem to contain, or to be contained in, the phases its runs alternated with.
        track = f":{key}" if repeated else ""
        own = f" · {key} (repeated)" if repeated else ""
        draw(pid, thread, "host" + track, label, host_name + own, s + start, s + start + wall, pcat, pargs)
        pg = fig.get("gpu_ms")
        if pg is None:
            continue
        if key in tiled:
            a, b = tiled[key]
            placement = _GPU_TILED
        else:
            a, b = s + start, s + start + _ns(pg)
            placement = _GPU_ALIGNED
        gargs = {"step": index, "gpu_ms": pg, "count": count, "placement": placement}
        if count is None:
            del gargs["count"]
        draw(pid, thread, "gpu" + track, label, gpu_name + own, a, b, pcat, gargs)
    _sync_events(tr, pid, host_tid, s, index, get("syncs"), phases)
    _memory_event(tr, pid, s, r)


def _sync_events(tr: _Trace, pid: int, tid: int, s: int, index: int, syncs: Any,
                 phases: list[tuple[str, dict[str, Any], int, int, bool]]) -> None:
    """One instant per sync site: at the start of the phase that holds all of the step's syncs
    (the deepest that ran once and counted them all), else at the step's start."""
    if not syncs or not syncs.get("sites"):
        return
    total = syncs.get("count")
    at, where = s, "at the step's start (sync sites carry no time)"
    holders = [p for p in phases if type(total) is int and total > 0 and p[1].get("syncs") == total
               and p[1].get("count") == 1]
    if holders:
        key, _, start, _, _ = max(holders, key=lambda p: p[0].count("/"))
        at = s + start
        where = f"at the start of phase {key!r}, which holds all of the step's syncs (sites carry no time)"
    for site in syncs["sites"]:
        if site is None:
            continue
        kind = site.get("kind") or "sync"
        tr.emit({"name": f"sync: {kind}", "cat": "sync", "ph": "i", "s": "t", "ts": at / 1e3,
                 "pid": pid, "tid": tid,
                 "args": _clean({"step": index, "where": site.get("where"), "code": site.get("code"),
                                 "count": site.get("count"), "waits": site.get("waits"), "placed": where})})


def _memory_event(tr: _Trace, pid: int, s: int, r: dict[str, Any]) -> None:
    args = {k: r[k] for k in ("peak_allocated_bytes", "reserved_bytes", "host_rss_bytes") if r.get(k) is not None}
    if args:
        tr.emit({"name": "memory", "ph": "C", "ts": s / 1e3, "pid": pid, "tid": 0, "args": args})


def _distributed_info(runs: Sequence[_Run]) -> bytes:
    """``"distributedInfo"``, the rank HTA reads from a trace, when the runs are one rank's
    (HTA takes a trace per rank: export each rank's log to a file of its own); else nothing."""
    ranks = {(run.rank, run.world_size) for run in runs if run.rank is not None}
    if len(ranks) != 1 or len({run.rank for run in runs}) != 1:
        return b""
    ((rank, world),) = ranks
    info = {"rank": rank} if world is None else {"rank": rank, "world_size": world}
    return b', "distributedInfo": ' + orjson.dumps(info)


def export_chrome(paths: Sequence[str], out: str) -> Exported:
    """Write the steps of the logs at ``paths`` to a Chrome trace-event file at ``out``.

    Raises:
        ConfigError: a log is missing or has no step records.
        OSError: ``out`` cannot be written.
    """
    from . import __version__

    out = os.fspath(out)
    for p in _check_logs(paths):
        if os.path.exists(out) and os.path.samefile(out, p):
            raise ConfigError(f"'--chrome' {out!r} is one of the logs to export, which the trace would "
                              f"replace; pass another path, such as {os.path.splitext(out)[0] + '.trace.json'!r}")
    paths, per_log, runs, skipped = _read(paths)
    t0 = min(run.first_s for run in runs)
    other = {
        "generator": f"stepprof {__version__} export",
        "logs": paths,
        "time_origin_unix_s": t0,
        "ts": "µs since the earliest step's start (time_origin_unix_s), from each step's start_unix_s",
        "host": "steps and phases at their host times (time.perf_counter_ns); a phase that ran k times "
                "is one slice 'name ×k' from its first start, of the summed length",
        "gpu": "GPU slices have the exact CUDA-event lengths; a step's GPU slice starts at its host start "
               "(CUDA events give spans, not clock times); top-level phases that each ran once tile it",
        "syncs": "instants at the start of the step (or of the one phase that holds them): sites carry no time",
        "memory": "counters set at each step's start to that step's figures",
    }
    directory = os.path.dirname(os.path.abspath(out))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".stepprof-export-", suffix=".json", dir=directory)
    except OSError as e:  # its temp file's name would mean nothing to the user: theirs instead
        raise OSError(e.errno, e.strerror, out) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b'{"displayTimeUnit": "ms", "otherData": ' + orjson.dumps(other) + _distributed_info(runs)
                    + b', "traceEvents": [\n')
            tr = _Trace(f, t0)
            for run in sorted(runs, key=lambda r: r.pid):
                tr.emit({"name": "process_name", "ph": "M", "pid": run.pid, "tid": 0, "args": {"name": run.label}})
                tr.emit({"name": "process_sort_index", "ph": "M", "pid": run.pid, "tid": 0,
                         "args": {"sort_index": run.pid}})
                tr.emit({"name": "process_labels", "ph": "M", "pid": run.pid, "tid": 0, "args": {"labels": ", ".join(
                    x for x in (f"run_id {run.run_id}" if run.run_id else None, os.path.basename(run.log)) if x)}})
            for run, r in _steps(paths, per_log):
                _step_events(tr, run, r)
            tr.flush()
            f.write(b"\n]}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is not None:  # the temp file's: name the user's path
            raise OSError(e.errno, e.strerror, out) from e
        raise
    return _summary(runs, skipped, out)


# -- TensorBoard -----------------------------------------------------------------------


def _tensorboard() -> tuple[Any, Any]:
    """torch's event-file writer and TensorBoard's Summary proto (what ``SummaryWriter.add_scalar`` uses)."""
    try:
        from torch.utils.tensorboard.writer import FileWriter
        from tensorboard.compat.proto.summary_pb2 import Summary
    except ImportError as e:
        raise MissingExtraError(
            "stepprof export --tensorboard needs tensorboard, which is not installed. "
            "Install it with: pip install 'stepprof[tensorboard]'"
        ) from e
    return FileWriter, Summary


def export_tensorboard(paths: Sequence[str], out_dir: str) -> Exported:
    """Write the steps of the logs at ``paths`` as TensorBoard scalars under ``out_dir``.

    Each step is one event holding all its scalars (what ``SummaryWriter.add_scalar`` writes,
    one value per call), at the framework's ``global_step`` when the record has one (a callback's
    run), else its step index, at the step's ``start_unix_s``.  Each run (of the last
    :data:`TB_RUNS_KEPT`) has a directory of its own when there are several, named from its rank
    or log and its ``run_id``, made safe as path components; every path is checked to lie
    inside ``out_dir`` before anything is written there.

    Raises:
        ConfigError: a log is missing or has no step records, ``out_dir`` already holds
            event files, or a run's directory would resolve outside it (a symbolic link).
        MissingExtraError: tensorboard is not installed.
    """
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"'--tensorboard' {out_dir!r} is a file; pass a directory (new or empty)")
    if glob.glob(os.path.join(glob.escape(out_dir), "**", "*tfevents*"), recursive=True):
        raise ConfigError(
            f"'--tensorboard' {out_dir!r} already holds TensorBoard event files, which would show "
            f"every curve twice; pass a new directory or remove them"
        )
    FileWriter, Summary = _tensorboard()
    paths, per_log, runs, skipped = _read(paths)
    kept = {id(run) for run in runs[-TB_RUNS_KEPT:]}
    writers: dict[int, Any] = {}
    try:
        for run, r in _steps(paths, per_log):
            if id(run) not in kept:
                continue
            w = writers.get(id(run))
            if w is None:
                where = inside(out_dir, os.path.join(out_dir, run.subdir), "--tensorboard")
                # A deep queue: with the default (10), each write waits on the writer's thread.
                w = writers[id(run)] = FileWriter(where, max_queue=8192, flush_secs=30)
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in _scalars(r)]
            if values:
                at = r.get("global_step")  # the framework's step: its own curves are drawn at it
                w.add_summary(Summary(value=values), global_step=at if type(at) is int else r["step"],
                              walltime=float(r["start_unix_s"]))
            if run.written == run.steps:
                writers.pop(id(run)).close()
    finally:
        for w in writers.values():
            w.close()
    written = [run for run in runs if id(run) in kept]
    return _summary(written, skipped, out_dir, len(runs) - len(written))


def _scalars(r: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """A step record's scalars: (tag, value), nulls left out."""
    for name in TB_FIGURES:
        v = r.get(name)
        if v is not None:
            yield f"stepprof/{name}", float(v)
    syncs = r.get("syncs")
    if syncs and syncs.get("count") is not None:
        yield "stepprof/syncs", float(syncs["count"])
    for key, fig in (r.get("phases") or {}).items():
        if fig is None:
            continue
        for name in TB_PHASE_FIGURES:
            v = fig.get(name)
            if v is not None:
                yield f"stepprof/phases/{printable(key)}/{name}", float(v)

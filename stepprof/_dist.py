"""Distributed runs: rank identity, per-rank log names, the cross-rank exchange and
the straggler rule.

Every ``ranks_every`` step exits, each rank puts a small vector of its figures
over the steps finalised since the last exchange (its *window*) into one
``all_gather``, enqueued with ``async_op=True`` and never waited on by the
training thread.  The collector thread polls the collective; once it has
completed, group rank 0 turns the gathered figures into a ``kind: "ranks"``
record (:func:`ranks_record`), and :func:`find_straggler` names the slow rank.

Why the rule looks at segments, not only at step times: under DDP or FSDP each
step holds collectives, so every rank leaves the step together and the step
times come out equal.  A straggler's extra time shows in its own time *before*
the first collective it delays, and as waiting in the other ranks' time at that
collective, later in the step.  So the earliest segment of the step (the gap
before it, then each top-level phase in order) where some rank exceeds the
median names the cause.  docs/distributed.md explains it.

This module imports nothing from torch at import time (``stepprof report`` uses
the pure functions); the CUDA buffers live in :mod:`stepprof._device.exchange`.
"""

from __future__ import annotations

import math
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

from ._stats import median
from ._errors import ConfigError, raised_by_user, warn
from ._validate import check_count

__all__ = [
    "CLOSE_WAIT_S",
    "MAX_PHASES",
    "RANKS_EVERY",
    "STRAGGLER_RATIO",
    "Exchange",
    "Identity",
    "Window",
    "find_straggler",
    "identify",
    "rank_log_path",
    "ranks_record",
]

#: A rank is a straggler when its step time exceeds the median rank's by this factor,
#: or (lockstep) when, in the earliest segment where any rank does, its excess over
#: the segment's median exceeds ``STRAGGLER_RATIO - 1`` times the median step time.
STRAGGLER_RATIO = 1.10
#: Top-level phases exchanged per rank (in order of first appearance); more are ignored.
MAX_PHASES = 8
#: Default of ``Profiler(ranks_every=...)`` in a distributed run.
RANKS_EVERY = 100
#: At close, how long stepprof waits for exchanges that other ranks have not joined.
CLOSE_WAIT_S = 5.0
#: ``Profiler(log_ranks=...)``: every rank writes its own log, or only rank 0 does.
LOG_RANKS = ("all", "zero")

# The exchanged vector, float64 (exact for byte counts below 2**53 and for a CRC32):
# _INTERVAL: the interval between full steps this rank would choose under overhead_budget.
_EXCHANGE, _STEPS, _GPU, _WALL, _PEAK, _SYNCS, _GAP, _CRC, _GPU_BASIS, _NPH, _INTERVAL = range(11)
_PH0 = 11
WIDTH = _PH0 + MAX_PHASES
_NAN = float("nan")


class Identity(NamedTuple):
    """Where this process sits in a distributed run."""

    rank: int
    local_rank: int
    world_size: int

    def fields(self) -> dict[str, int]:
        return {"rank": self.rank, "local_rank": self.local_rank, "world_size": self.world_size}


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def identify() -> Identity | None:
    """This process's rank, local rank and world size, or None outside a distributed run.

    From ``torch.distributed`` when its default process group is initialised, else from
    the ``RANK`` and ``WORLD_SIZE`` variables that torchrun sets; ``LOCAL_RANK`` gives
    the local rank (default: the rank).  A world of one is not distributed.
    """
    rank = world = None
    dist = _torch_dist()
    if dist is not None and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None or world <= 1:
        return None
    local = _env_int("LOCAL_RANK")
    return Identity(rank, rank if local is None else local, world)


def _torch_dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - every torch build has the module
        return None
    return dist if dist.is_available() else None


def rank_log_path(path: str, rank: int) -> str:
    """``run.jsonl`` -> ``run.rank3.jsonl``: each rank's log, next to the given path."""
    head, tail = os.path.split(path)
    stem, suffix = os.path.splitext(tail)
    if not stem:  # ".jsonl": a bare suffix is the stem
        stem, suffix = suffix, ""
    return os.path.join(head, f"{stem}.rank{rank}{suffix}")


# -- the window: this rank's figures since the last exchange ------------------------


class Window:
    """The figures of this rank's measured steps since the last exchange.

    The collector thread adds a step as it finalises it; the training thread takes
    the window at an exchange.  A lock keeps the two apart (uncontended: ~0.1 µs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: list[tuple[Any, ...]] = []

    def add(self, gpu_ms: float | None, wall_ms: float, peak: int | None, syncs: int | None,
            gap_ms: float | None, phases: dict[str, float | None]) -> None:
        with self._lock:
            self._steps.append((gpu_ms, wall_ms, peak, syncs, gap_ms, phases))

    def take(self, exchange: int) -> tuple[list[float], list[str]]:
        """The vector to exchange (medians over the window) and the phase names in it."""
        with self._lock:
            steps, self._steps = self._steps, []
        return summarise_window(steps, exchange)


def _median(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return median(vals) if vals else _NAN


def summarise_window(steps: list[tuple[Any, ...]], exchange: int) -> tuple[list[float], list[str]]:
    vec = [_NAN] * WIDTH
    vec[_EXCHANGE] = float(exchange)
    vec[_STEPS] = float(len(steps))
    names: list[str] = []
    for s in steps:
        for name in s[5]:
            if name not in names:
                names.append(name)
    vec[_CRC] = float(zlib.crc32("\0".join(names).encode()))
    vec[_NPH] = float(len(names))
    if not steps:
        return vec, names
    gpu_basis = all(s[0] is not None for s in steps)
    vec[_GPU] = _median([s[0] for s in steps])
    vec[_WALL] = _median([s[1] for s in steps])
    peaks = [s[2] for s in steps if s[2] is not None]
    vec[_PEAK] = float(max(peaks)) if peaks else _NAN
    vec[_SYNCS] = _median([s[3] for s in steps])
    vec[_GAP] = _median([s[4] for s in steps])
    vec[_GPU_BASIS] = 1.0 if gpu_basis else 0.0
    for i, name in enumerate(names[:MAX_PHASES]):
        vec[_PH0 + i] = _median([s[5].get(name) for s in steps])
    return vec, names


# -- the straggler rule (pure) ---------------------------------------------------------


class Straggler(NamedTuple):
    rank: int | None
    basis: str | None
    excess_ms: float | None
    ratio: float | None
    reason: str | None


def _finite(xs: Sequence[float]) -> bool:
    return all(math.isfinite(x) for x in xs)


def find_straggler(
    step_ms: Sequence[float],
    segments: Sequence[tuple[str, Sequence[float]]],
    threshold: float = STRAGGLER_RATIO,
    ranks: Sequence[int] | None = None,
) -> Straggler:
    """Name the straggler from per-rank figures (index = rank; NaN = unavailable).

    (a) The step: if max/median of ``step_ms`` exceeds ``threshold``, the slowest rank.
    (b) Lockstep (step times equal because collectives align the ranks): the earliest
    of ``segments`` (the gap before the step, then the phases in order) where some
    rank's time exceeds the segment's median by more than ``(threshold - 1) x`` the
    median step time, *and* its time from the step's start through that segment
    exceeds the median by as much.  The second test rejects waiting: a rank that
    reached a collective early waits longest in it, but it was faster before.

    ``ranks``: the rank of each position (a subgroup's global ranks); default the position.
    """
    if ranks is not None:
        found = find_straggler(step_ms, segments, threshold)
        if found.rank is not None:
            found = found._replace(rank=ranks[found.rank])
        missing = [ranks[r] for r, x in enumerate(step_ms) if not math.isfinite(x)]
        if missing:
            found = found._replace(reason=f"rank(s) {_ranks(missing)} had no measured step in this window")
        return found
    missing = [r for r, x in enumerate(step_ms) if not math.isfinite(x)]
    if missing:
        return Straggler(None, None, None, None,
                         f"rank(s) {_ranks(missing)} had no measured step in this window")
    med = median(step_ms)
    if med <= 0:
        return Straggler(None, None, None, None, "the median step took no measurable time")
    top = max(range(len(step_ms)), key=lambda r: step_ms[r])
    ratio = step_ms[top] / med
    if ratio > threshold:
        return Straggler(top, "step", step_ms[top] - med, ratio, None)
    bar = (threshold - 1) * med
    skipped = []
    cum = [0.0] * len(step_ms)
    for name, vals in segments:
        if len(vals) != len(step_ms) or not _finite(vals):
            skipped.append(name)
            continue
        cum = [c + v for c, v in zip(cum, vals)]
        m, mc = median(vals), median(cum)
        hits = [r for r in range(len(vals)) if vals[r] - m > bar and cum[r] - mc > bar]
        if hits:
            r = max(hits, key=lambda i: vals[i])
            return Straggler(r, name, vals[r] - m, ratio, None)
    why = (
        f"no rank's step time exceeded the median by more than {threshold - 1:.0%} "
        f"(max/median {ratio:.3f}), nor its time in a segment (and up to it) by more than "
        f"{threshold - 1:.0%} of the median step ({bar:.3f} ms)"
    )
    if skipped:
        why += f"; not compared (unavailable on some rank): {', '.join(skipped)}"
    return Straggler(None, None, None, ratio, why)


def _ranks(rs: Sequence[int]) -> str:
    s = ", ".join(map(str, rs[:8]))
    return s + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")


def _stats(vals: Sequence[float], ranks: Sequence[int] | None = None) -> dict[str, Any] | None:
    ok = [(x, r if ranks is None else ranks[r]) for r, x in enumerate(vals) if math.isfinite(x)]
    if not ok:
        return None
    xs = [x for x, _ in ok]
    return {"min": min(xs), "median": median(xs), "max": max(xs),
            "slowest_rank": max(ok, key=lambda p: p[0])[1]}


def _json(x: float) -> float | None:
    return x if math.isfinite(x) else None


_FIGURES = (("gpu_ms", _GPU), ("wall_ms", _WALL), ("peak_allocated_bytes", _PEAK),
            ("syncs_per_step", _SYNCS), ("gap_ms", _GAP))


def ranks_record(rows: Sequence[Sequence[float]], names: list[str], step: int | None,
                 threshold: float = STRAGGLER_RATIO, ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """The ``kind: "ranks"`` record from the gathered vectors (row = rank) and rank 0's phase names.

    ``ranks``: with a subgroup, the global rank of each row; the record names ranks by them
    (``straggler_rank``, ``slowest_rank``) and lists them as ``group_ranks``.
    """
    unavailable: dict[str, str] = {}
    world = len(rows)

    def col(i: int) -> list[float]:
        return [float(r[i]) for r in rows]
    per_rank: dict[str, list[Any]] = {"steps": [int(x) if math.isfinite(x) else 0 for x in col(_STEPS)]}
    figures: dict[str, Any] = {}
    for key, i in _FIGURES:
        vals = col(i)
        per_rank[key] = [_json(x) for x in vals]
        figures[key] = _stats(vals, ranks)
        if key == "peak_allocated_bytes":
            per_rank[key] = [None if v is None else int(v) for v in per_rank[key]]
            if figures[key] is not None:
                figures[key] = {k: int(v) for k, v in figures[key].items()}
        if figures[key] is None:
            unavailable[key] = "no rank measured it in this window"
    exchanges = col(_EXCHANGE)
    if len(set(exchanges)) > 1:
        unavailable["straggler_rank"] = (
            "the ranks' exchange counts differ: every rank must call profile_step the same number "
            "of times (pass ranks_every=0 where they do not)"
        )
    gpu_basis = all(x == 1.0 for x in col(_GPU_BASIS))
    step_key = "gpu_ms" if gpu_basis and _finite(col(_GPU)) else "wall_ms"
    segments: list[tuple[str, list[float]]] = [("gap", col(_GAP))]
    phases: dict[str, Any] = {}
    # Only ranks with a measured step in the window say anything about phase names and basis.
    measured = [r for r in rows if math.isfinite(float(r[_STEPS])) and float(r[_STEPS]) > 0]
    crcs = {float(r[_CRC]) for r in measured}
    if len(crcs) <= 1 and len({float(r[_GPU_BASIS]) for r in measured}) <= 1:
        for k, name in enumerate(names[:MAX_PHASES]):
            vals = col(_PH0 + k)
            segments.append((name, vals))
            phases[name] = _stats(vals, ranks)
        if len(names) > MAX_PHASES:
            unavailable["phases"] = f"only the first {MAX_PHASES} top-level phases are exchanged"
        elif not names and any(float(r[_NPH]) > 0 for r in measured):
            unavailable["phases"] = ("the recording rank had no measured step in this window, so "
                                     "the phase names are unknown and phases are not compared")
    elif len(crcs) > 1:
        unavailable["phases"] = "the ranks' top-level phase names differ, so phases are not compared"
    else:
        unavailable["phases"] = "some ranks timed on the GPU and others on the host"
    found = find_straggler(col(_GPU) if step_key == "gpu_ms" else col(_WALL), segments, threshold, ranks)
    if "straggler_rank" in unavailable:
        found = Straggler(None, None, None, found.ratio, unavailable["straggler_rank"])
    elif found.reason is not None:
        unavailable["straggler_rank"] = found.reason
    record: dict[str, Any] = {
        "kind": "ranks",
        "step": step,
        "world_size": world,
        "window_steps": _stats(col(_STEPS), ranks),
        "step_basis": step_key,
        "figures": figures,
        "phases": phases,
        "per_rank": per_rank,
        "straggler_rank": found.rank,
        "straggler_basis": found.basis,
        "straggler_excess_ms": found.excess_ms,
        "step_ratio": found.ratio,
        "threshold": threshold,
        "unavailable": unavailable,
    }
    if ranks is not None:
        record["group_ranks"] = list(ranks)
    return record


def unjoined_record(step: int | None, world: int, why: str) -> dict[str, Any]:
    """A ``ranks`` record for an exchange that did not complete."""
    return {
        "kind": "ranks", "step": step, "world_size": world, "window_steps": None, "step_basis": None,
        "figures": {}, "phases": {}, "per_rank": {}, "straggler_rank": None, "straggler_basis": None,
        "straggler_excess_ms": None, "step_ratio": None, "threshold": STRAGGLER_RATIO,
        "unavailable": {"straggler_rank": why},
    }


# -- the exchange -----------------------------------------------------------------------

#: ``gather(vector) -> pending``; ``pending()`` returns the rows (one per rank) once the
#: collective has completed, else None, and raises if the collective failed.
Gather = Callable[[list[float]], Callable[[], list[list[float]] | None]]


class Exchange:
    """Every ``every`` step exits, gather each rank's window; rank 0 records the result.

    ``step_exit`` runs on the training thread and only enqueues; ``poll`` runs on the
    collector thread and writes the records of completed exchanges, in order.
    """

    def __init__(self, every: int, ident: Identity, *, group: Any = None,
                 gather: Gather | None = None, close_wait_s: float = CLOSE_WAIT_S,
                 budget: Any = None) -> None:
        self.every = every
        #: Under ``overhead_budget``: the ranks agree on the interval between full steps
        #: through the exchange (see :class:`stepprof._recorder.budget.Budget`).
        self.budget = budget
        self.ident = ident
        self.window = Window()
        self._group = group
        self._gather = gather  # None: built at the first exchange, when the device is known
        self._close_wait_s = close_wait_s
        self.exits = 0
        self._outstanding: list[tuple[int | None, list[str], Callable[[], Any]]] = []
        self._lock = threading.Lock()
        self.failed: str | None = None
        self._is_zero = ident.rank == 0 if group is None else None
        self._members: list[int] | None = None  # a subgroup's global ranks (set with _is_zero)

    # training thread
    def due(self) -> bool:
        """Whether the next step exit enqueues an exchange."""
        return (self.exits + 1) % self.every == 0 and self.failed is None

    def step_exit(self, step: int | None, device_index: int | None) -> None:
        """Count a step exit; at every ``every``-th, enqueue the exchange (never waits)."""
        self.exits += 1
        if self.exits % self.every or self.failed is not None:
            return
        vec, names = self.window.take(self.exits)
        budget = self.budget
        if budget is not None:
            vec[_INTERVAL] = float(budget.desired)
            if step is not None:
                budget.awaiting(step + self.every)  # the ranks' answer applies from there
        try:
            if self._gather is None:
                self._gather = _real_gather(self._group, device_index)
            pending = self._gather(vec)
        except _NotJoined as e:
            pending = _failed(str(e))
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
            self.failed = f"the cross-rank exchange failed: {type(e).__name__}: {e}"
            warn(f"stepprof: {self.failed}; exchanges stopped on this rank "
                          f"(other ranks' exchanges will not complete)", stacklevel=4)
            return
        with self._lock:
            self._outstanding.append((step, names, pending))

    # collector thread
    def poll(self, write: Callable[[dict[str, Any]], None], *, deadline: float | None = None) -> None:
        """Write the records of completed exchanges, oldest first.

        With ``deadline`` (``time.monotonic()``), wait for the rest until then, and write a
        record saying so for each exchange still incomplete after it.
        """
        while True:
            with self._lock:
                head = self._outstanding[0] if self._outstanding else None
            if head is None:
                return
            step, names, pending = head
            try:
                rows = pending()
                record = None if rows is None else self._record(rows, names, step)
            except Exception as e:  # noqa: BLE001 - a failed collective: say so, carry on
                if raised_by_user(e):
                    raise
                rows, record = [], unjoined_record(
                    step, self._world(),
                    f"the exchange failed: {type(e).__name__}: {str(e)[:500]}")
            if rows is None:
                if deadline is None:
                    return
                if time.monotonic() < deadline:
                    time.sleep(0.005)
                    continue
                with self._lock:
                    left, self._outstanding = self._outstanding, []
                if self._zero():
                    for step, _, _ in left:
                        write(unjoined_record(
                            step, self._world(),
                            f"rank(s) did not join the exchange within {self._close_wait_s:g} s of "
                            f"close (a rank that stopped calling profile_step, raised or died)"))
                return
            with self._lock:
                self._outstanding.pop(0)
            if self.budget is not None and step is not None:
                # Every rank gets the same rows: each adopts the longest interval any asked for
                # (a failed exchange: every step in full), from the same step on.
                asked = [r[_INTERVAL] for r in rows if math.isfinite(r[_INTERVAL])]
                self.budget.agreed(step + self.every, int(max(asked)) if asked else 1)
            if record is not None and self._zero():
                write(record)

    def close(self, write: Callable[[dict[str, Any]], None]) -> None:
        """Finish the exchanges already enqueued (waiting at most ``close_wait_s``); start none."""
        self.poll(write, deadline=time.monotonic() + self._close_wait_s)

    def _zero(self) -> bool:
        if self._is_zero is None:
            dist = _torch_dist()
            self._is_zero = dist.get_rank(self._group) == 0
            members = list(dist.get_process_group_ranks(self._group))
            if members != list(range(self.ident.world_size)):
                self._members = members  # a subgroup: its records name global ranks
        return self._is_zero

    def _world(self) -> int:
        self._zero()
        return self.ident.world_size if self._members is None else len(self._members)

    def _record(self, rows: list[list[float]], names: list[str], step: int | None) -> dict[str, Any] | None:
        if not self._zero():
            return None
        return ranks_record(rows, names, step, ranks=self._members)


class _NotJoined(Exception):
    pass


def _failed(why: str) -> Callable[[], Any]:
    def pending() -> Any:
        raise RuntimeError(why)

    return pending


def _real_gather(group: Any, device_index: int | None) -> Gather:
    """The all_gather for this process group: on the GPU for NCCL, else on the host."""
    dist = _torch_dist()
    if dist is None or not dist.is_initialized():
        raise _NotJoined("torch.distributed's process group was not initialised at the exchange")
    import torch

    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    gather_into: Any = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
    if backend == "nccl":
        from ._device.exchange import ExchangeSlots

        index = device_index if device_index is not None else torch.cuda.current_device()
        slots = ExchangeSlots(index, WIDTH, world)

        def gather_gpu(vec: list[float]) -> Callable[[], Any]:
            slot = slots.stage(vec)  # pinned host -> device, non_blocking, on the current stream
            if slot is None:
                raise _NotJoined("the stream was capturing a CUDA graph at the exchange")
            work = gather_into(slot.dev_out, slot.dev_in, group=group, async_op=True)

            def pending() -> list[list[float]] | None:
                if not work.is_completed():
                    return None
                out = slot.fetch()  # device -> pinned host on a side stream, then an event
                if out is None:
                    return None
                slots.free(slot)
                return [out[r * WIDTH:(r + 1) * WIDTH] for r in range(world)]

            return pending

        return gather_gpu

    def gather_host(vec: list[float]) -> Callable[[], Any]:
        inp = torch.tensor(vec, dtype=torch.float64)
        out = torch.empty(world * WIDTH, dtype=torch.float64)
        if gather_into is not None:
            work = gather_into(out, inp, group=group, async_op=True)
        else:  # pragma: no cover - old torch
            parts = list(out.view(world, WIDTH).unbind(0))
            work = dist.all_gather(parts, inp, group=group, async_op=True)

        def pending() -> list[list[float]] | None:
            if not work.is_completed():
                return None
            work.wait()  # completed: returns at once, or raises the collective's error
            return out.view(world, WIDTH).tolist()

        return pending

    return gather_host


# -- the settings' checks (Profiler(ranks_every=, log_ranks=, group=)) ----------------------


def check_ranks_every(ranks_every: Any) -> int:
    return check_count(
        ranks_every, "ranks_every",
        f"pass e.g. ranks_every={RANKS_EVERY}, or 0 to turn the cross-rank exchange off",
    )


def check_log_ranks(log_ranks: Any) -> str:
    if log_ranks not in LOG_RANKS:
        raise ConfigError(
            f"'log_ranks' must be 'all' (each rank writes <stem>.rank<R><suffix>) or 'zero' "
            f"(only rank 0 writes a log) (got {log_ranks!r})"
        )
    return cast(str, log_ranks)


def check_group(group: Any, ident: Identity | None, ranks_every: int) -> Any:
    """``group`` if it is None or a process group this rank belongs to, else a ConfigError."""
    if group is None:
        return None
    import torch.distributed  # slow to import; see the module docstring

    dist = torch.distributed if torch.distributed.is_available() else None
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if isinstance(group, int) and not isinstance(group, bool) and group == non_member:
        if ident is None or not ranks_every:
            return group  # no exchange: the group is not used
        raise ConfigError(
            f"this rank ({ident.rank}) is not a member of 'group' (got {group!r}: what "
            f"torch.distributed.new_group returns to the ranks outside the group); on those ranks "
            f"pass ranks_every=0 (or group=None to exchange on the default group)"
        )
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise ConfigError(
            f"'group' must be a torch.distributed process group (got {group!r}); pass the group "
            f"that torch.distributed.new_group(...) returns, or None for the default group"
        )
    return group

"""``stepprof report``: stream one or more logs into figures and diagnoses.

One pass over each log, in bounded memory: each figure goes into a :class:`~stepprof._stats.QuantileSketch`
(exact quantiles up to its ``EXACT`` values, then a compacting sketch whose
rank error stays below 0.1%), sync sites, phases and batch sizes into capped
tables, and the slowest steps into a small heap.  The report is a plain,
JSON-able dict (``--json`` prints it as is); :func:`render` turns it into text.

A log may hold several runs (one ``Profiler`` after another on the same path:
each ends with a summary, and step indices restart) and sweeps; each is
reported on its own.  Several logs are reported one after the other; the layout
(``{"logs": [{"path", "runs", "sweeps"}]}``) leaves room for a cross-log view
(per-rank logs) later.
"""

from __future__ import annotations

import heapq
import math
import os
from typing import Any

import attrs

from ._log import SCHEMA_VERSION, ScanStats, scan
from ._records import SweepPoint, SweepResult
from ._stats import QuantileSketch
from ._units import format_bytes
from ._roofline import load_calibration, roofline

__all__ = ["REPORT_VERSION", "build_report", "render"]

#: Version of the ``--json`` layout.
REPORT_VERSION = 1

_NUM = (int, float)
_CAP = 256  # sync sites, phase names and batch sizes kept per run
_SPIKES_KEPT = 32  # slowest steps kept per run
#: A step is a spike when its time is at least this many times the median.
SPIKE_FACTOR = 3.0
#: gpu_busy below this: the GPU finished the step's work well before the host.
HOST_BOUND_BUSY = 0.9
_GIB = 2**30


def _num(x: Any) -> float | None:
    """A finite number, else None (logs are read as found: a field may hold anything)."""
    if type(x) is float:
        return x if math.isfinite(x) else None
    if type(x) is int:
        return float(x)
    return None


class _Phase:
    __slots__ = ("wall", "gpu", "peak", "syncs", "count", "steps")

    def __init__(self) -> None:
        self.wall, self.gpu = QuantileSketch(), QuantileSketch()
        self.peak: float | None = None
        self.syncs = 0
        self.count = 0
        self.steps = 0

    def merge(self, other: _Phase) -> None:
        self.wall.merge(other.wall)
        self.gpu.merge(other.gpu)
        self.peak = _max(self.peak, other.peak)
        self.syncs += other.syncs
        self.count += other.count
        self.steps += other.steps

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.wall, self.gpu, self.peak, self.syncs, self.count, self.steps)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.wall, self.gpu, self.peak, self.syncs, self.count, self.steps = state


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _add_counts(into: dict[Any, int], other: dict[Any, int]) -> None:
    for k, n in other.items():
        if k in into:
            into[k] += n
        elif len(into) < _CAP:
            into[k] = n


class _Run:
    """One profiling run's aggregates."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.steps = self.warmup = self.errors = self.measured = 0
        self.devices: dict[str, int] = {}
        self.names: dict[str, int] = {}
        self.batch_sizes: dict[int, int] = {}
        self.first_step: int | None = None
        self.last_step = -1
        self.first_measured: int | None = None
        self.wall, self.gpu, self.span, self.busy = QuantileSketch(), QuantileSketch(), QuantileSketch(), QuantileSketch()
        self.sps, self.syncs, self.tflops, self.mfu, self.overhead = QuantileSketch(), QuantileSketch(), QuantileSketch(), QuantileSketch(), QuantileSketch()
        self.dists = [
            self.wall,
            self.gpu,
            self.span,
            self.busy,
            self.sps,
            self.syncs,
            self.tflops,
            self.mfu,
            self.overhead,
        ]
        self.peak: float | None = None
        self.reserved: float | None = None
        self.reserved_last: float | None = None
        self.rss: float | None = None
        self.alloc = {
            "num_alloc_retries": 0,
            "num_sync_all_streams": 0,
            "num_device_alloc": 0,
            "num_device_free": 0,
        }
        self.alloc_steps = 0
        self.steps_with_device_alloc = 0
        self.sites: dict[tuple[str, str], list[Any]] = {}
        self.sites_dropped = 0
        self.sync_steps = 0
        self.sync_mechanism: str | None = None
        self.other_threads = 0
        self.phases: dict[str, _Phase] = {}
        self.spikes: list[tuple[float, int, int, int]] = []  # (span, step, device allocs, retries)
        self.memory_first: dict[str, Any] | None = None
        self.memory_last: dict[str, Any] | None = None
        self.memory_records = 0
        self.flops: dict[str, Any] | None = None
        self.flops_counted_step: int | None = None
        self.summary: dict[str, Any] | None = None
        self.unavailable: dict[str, str] = {}
        self.malformed = 0
        self.since_settle = 0
        # Distributed runs: this log's rank, and (rank 0's log) the ranks records.
        self.identity: dict[str, Any] | None = None
        self.ranks_records = 0
        self.ranks_named: dict[int, int] = {}
        self.ranks_last: dict[str, Any] | None = None
        self.ranks_last_named: dict[str, Any] | None = None

    def merge(self, b: _Run) -> None:
        """Fold in ``b``: the same run, continued in a later stretch of the log."""
        for f in ("steps", "warmup", "errors", "measured", "alloc_steps", "steps_with_device_alloc",
                  "sync_steps", "other_threads", "memory_records", "malformed", "sites_dropped"):
            setattr(self, f, getattr(self, f) + getattr(b, f))
        _add_counts(self.devices, b.devices)
        _add_counts(self.names, b.names)
        _add_counts(self.batch_sizes, b.batch_sizes)
        if b.steps:
            if self.first_step is None:
                self.first_step = b.first_step
            self.last_step = b.last_step
        if self.first_measured is None:
            self.first_measured = b.first_measured
        for mine, theirs in zip(self.dists, b.dists):
            mine.merge(theirs)
        self.peak = _max(self.peak, b.peak)
        self.reserved = _max(self.reserved, b.reserved)
        if b.reserved_last is not None:
            self.reserved_last = b.reserved_last
        if b.rss is not None:
            self.rss = b.rss
        for k, v in b.alloc.items():
            self.alloc[k] += v
        for key, (n, code, steps) in b.sites.items():
            entry = self.sites.get(key)
            if entry is None:
                if len(self.sites) >= _CAP:
                    self.sites_dropped += n
                    continue
                entry = self.sites[key] = [0, code, 0]
            entry[0] += n
            entry[2] += steps
            if entry[1] is None:
                entry[1] = code
        if b.sync_mechanism is not None:
            self.sync_mechanism = b.sync_mechanism
        for name, ph in b.phases.items():
            mine = self.phases.get(name)
            if mine is None:
                if len(self.phases) < _CAP:
                    self.phases[name] = ph
                continue
            mine.merge(ph)
        self.spikes = heapq.nlargest(_SPIKES_KEPT, self.spikes + b.spikes)
        heapq.heapify(self.spikes)
        if self.memory_first is None:
            self.memory_first = b.memory_first
        if b.memory_last is not None:
            self.memory_last = b.memory_last
        if b.flops is not None:
            self.flops = b.flops
        if b.flops_counted_step is not None:
            self.flops_counted_step = b.flops_counted_step
        if b.summary is not None:
            self.summary = b.summary
        if self.identity is None:
            self.identity = b.identity
        self.ranks_records += b.ranks_records
        _add_counts(self.ranks_named, b.ranks_named)
        self.ranks_last = b.ranks_last or self.ranks_last
        self.ranks_last_named = b.ranks_last_named or self.ranks_last_named
        for k, v in b.unavailable.items():
            if k not in self.unavailable and len(self.unavailable) < _CAP:
                self.unavailable[k] = v

    # -- the per-record work: kept lean, it runs a million times --------------------

    def add_step(self, r: dict[str, Any]) -> None:
        # Numbers are taken as orjson gives them: int or float (JSON has no NaN or
        # infinity); anything else (a str, a bool, null) is treated as missing.
        get = r.get
        self.steps += 1
        idx = get("step")
        if type(idx) is int:
            if self.first_step is None:
                self.first_step = idx
            self.last_step = idx
        else:
            idx = -1
        if self.identity is None:
            self.take_identity(r)
        dev = get("device")
        devices = self.devices
        if type(dev) is not str:
            pass
        elif dev in devices:
            devices[dev] += 1
        elif len(devices) < _CAP:
            devices[dev] = 1
        name = get("name")
        names = self.names
        if type(name) is not str:
            pass
        elif name in names:
            names[name] += 1
        elif len(names) < _CAP:
            names[name] = 1
        if get("warmup") is True:
            self.warmup += 1
            return
        if get("error") is not None:
            self.errors += 1
            return
        wall = get("wall_ms")
        t = type(wall)
        if t is not float and t is not int:
            self.malformed += 1
            return
        self.measured += 1
        if self.first_measured is None and idx >= 0:
            self.first_measured = idx
        if get("flops_counted") is True:
            self.flops_counted_step = idx if idx >= 0 else None
            return  # its times include FlopCounterMode's cost
        self.wall.buf.append(wall)
        gpu = get("gpu_ms")
        t = type(gpu)
        span = wall
        if t is float or t is int:
            self.gpu.buf.append(gpu)
            if gpu > wall:
                span = gpu
        self.span.buf.append(span)
        x = get("gpu_busy")
        t = type(x)
        if t is float or t is int:
            self.busy.buf.append(x)
        bs = get("batch_size")
        if type(bs) is int:
            sizes = self.batch_sizes
            if bs in sizes:
                sizes[bs] += 1
            elif len(sizes) < _CAP:
                sizes[bs] = 1
            x = get("samples_per_s")
            t = type(x)
            if t is float or t is int:
                self.sps.buf.append(x)
        x = get("peak_allocated_bytes")
        t = type(x)
        if (t is int or t is float) and (self.peak is None or x > self.peak):
            self.peak = x
        x = get("reserved_bytes")
        t = type(x)
        if t is int or t is float:
            self.reserved_last = x
            if self.reserved is None or x > self.reserved:
                self.reserved = x
        x = get("overhead_us")
        t = type(x)
        if t is float or t is int:
            self.overhead.buf.append(x)
        x = get("host_rss_bytes")
        if type(x) is int:
            self.rss = x
        allocs = retries = 0
        alloc = get("allocator")
        if type(alloc) is dict:
            self.alloc_steps += 1
            totals = self.alloc
            for k, v in alloc.items():
                if type(v) is int and k in totals:
                    totals[k] += v
            allocs = alloc.get("num_device_alloc")
            retries = alloc.get("num_alloc_retries")
            if type(allocs) is not int:
                allocs = 0
            elif allocs > 0:
                self.steps_with_device_alloc += 1
            if type(retries) is not int:
                retries = 0
        syncs = get("syncs")
        if type(syncs) is dict:
            self._add_syncs(syncs)
        phases = get("phases")
        if phases and type(phases) is dict:
            self._add_phases(phases)
        if "tflops_per_s" in r:
            x = get("tflops_per_s")
            t = type(x)
            if t is float or t is int:
                self.tflops.buf.append(x)
            x = get("mfu")
            t = type(x)
            if t is float or t is int:
                self.mfu.buf.append(x)
        spikes = self.spikes
        if len(spikes) < _SPIKES_KEPT:
            heapq.heappush(spikes, (span, idx, allocs, retries))
        elif span > spikes[0][0]:
            heapq.heapreplace(spikes, (span, idx, allocs, retries))
        unavailable = get("unavailable")
        if unavailable and type(unavailable) is dict and len(self.unavailable) < _CAP:
            for k, v in unavailable.items():
                if k not in self.unavailable and type(v) is str:
                    self.unavailable[k] = v
        self.since_settle += 1
        if self.since_settle >= 4096:
            self.since_settle = 0
            for d in self.dists:
                d.settle()
            for ph in self.phases.values():
                ph.wall.settle()
                ph.gpu.settle()

    def take_identity(self, r: dict[str, Any]) -> None:
        rank = r.get("rank")
        if type(rank) is int:
            self.identity = {
                k: r.get(k) if type(r.get(k)) is int else None for k in ("rank", "local_rank", "world_size")
            }

    def add_ranks(self, r: dict[str, Any]) -> None:
        """A ``kind: "ranks"`` record (rank 0's log): count who was named, keep the latest."""
        self.ranks_records += 1
        who = r.get("straggler_rank")
        if type(who) is int:
            self.ranks_named[who] = self.ranks_named.get(who, 0) + 1
            self.ranks_last_named = r
        self.ranks_last = r

    def _add_syncs(self, syncs: dict[str, Any]) -> None:
        count = syncs.get("count")
        if type(count) is not int:
            return
        self.sync_steps += 1
        self.syncs.buf.append(count)
        mech = syncs.get("mechanism")
        if mech is not None and type(mech) is str:
            self.sync_mechanism = mech
        other = syncs.get("other_threads")
        if other and type(other) is int:
            self.other_threads += other
        sites = syncs.get("sites")
        if not sites or type(sites) is not list:
            return
        table = self.sites
        for site in sites:
            if type(site) is not dict:
                continue
            n = site.get("count")
            if type(n) is not int:
                continue
            key = (site.get("where"), site.get("kind"))
            entry = table.get(key) if type(key[0]) is str and type(key[1]) is str else None
            if entry is None:
                key = (str(key[0]), str(key[1]))
                entry = table.get(key)
            if entry is None:
                if len(table) >= _CAP:
                    self.sites_dropped += n
                    continue
                code = site.get("code")
                entry = table[key] = [0, code if type(code) is str else None, 0]
            entry[0] += n
            entry[2] += 1

    def _add_phases(self, phases: dict[str, Any]) -> None:
        table = self.phases
        for name, ph in phases.items():
            agg = table.get(name)
            if agg is None:
                if len(table) >= _CAP:
                    continue
                agg = table[name] = _Phase()
            if type(ph) is not dict:
                continue
            agg.steps += 1
            get = ph.get
            x = get("wall_ms")
            t = type(x)
            if t is float or t is int:
                agg.wall.buf.append(x)
            x = get("gpu_ms")
            t = type(x)
            if t is float or t is int:
                agg.gpu.buf.append(x)
            x = get("peak_allocated_bytes")
            t = type(x)
            if (t is int or t is float) and (agg.peak is None or x > agg.peak):
                agg.peak = x
            x = get("syncs")
            if x and type(x) is int:
                agg.syncs += x
            x = get("count")
            agg.count += x if type(x) is int else 1

    def add_memory(self, r: dict[str, Any]) -> None:
        self.memory_records += 1
        if self.memory_first is None and r.get("trigger") in ("after_warmup", "periodic"):
            self.memory_first = r
        self.memory_last = r

    # -- the report --------------------------------------------------------------

    def result(self, sweeps: list[dict[str, Any]]) -> dict[str, Any]:
        for d in self.dists:
            d.settle()
        approximate = not all(d.exact for d in self.dists)
        batch = max(self.batch_sizes, key=lambda k: self.batch_sizes[k]) if self.batch_sizes else None
        figures = {
            "wall_ms": self.wall.percentiles(),
            "gpu_ms": self.gpu.percentiles(),
            "step_ms": self.span.percentiles(),
            "samples_per_s": self.sps.percentiles(),
            "gpu_busy_median": self.busy.quantile(0.5),
            "syncs_per_step": self.syncs.percentiles(),
            "overhead_us_median": self.overhead.quantile(0.5),
            "tflops_per_s_median": self.tflops.quantile(0.5),
            "mfu_median": self.mfu.quantile(0.5),
        }
        unavailable = self._figure_reasons(figures)
        memory = self._memory()
        out: dict[str, Any] = {
            "run": self.index,
            "device": max(self.devices, key=lambda k: self.devices[k]) if self.devices else None,
            "names": sorted(self.names),
            "steps": self.steps,
            "warmup_steps": self.warmup,
            "error_steps": self.errors,
            "measured_steps": self.measured,
            "malformed_steps": self.malformed,
            "first_step": self.first_step,
            "last_step": self.last_step if self.first_step is not None else None,
            "batch_size": batch,
            "batch_sizes": len(self.batch_sizes),
            "figures": figures,
            "approximate_quantiles": approximate,
            "memory": memory,
            "allocator": dict(
                self.alloc, steps=self.alloc_steps, steps_with_device_alloc=self.steps_with_device_alloc
            )
            if self.alloc_steps
            else None,
            "syncs": self._sync_table(),
            "phases": self._phase_table(),
            "flops": self.flops,
            "flops_counted_step": self.flops_counted_step,
            "roofline": None,
            "spikes": self._spikes(figures),
            "summary_found": self.summary is not None,
            "unavailable": unavailable,
        }
        if self.identity is not None:
            out.update(self.identity)
        if self.ranks_records:
            out["ranks"] = {
                "exchanges": self.ranks_records,
                "straggler_counts": {str(k): v for k, v in sorted(self.ranks_named.items())},
                "latest": self.ranks_last,
                "latest_named": self.ranks_last_named,
            }
        out["roofline"], roofline_reason = self._roofline(figures)
        out["diagnoses"], out["not_diagnosed"] = _diagnose(out, sweeps, roofline_reason)
        return out

    def _figure_reasons(self, figures: dict[str, Any]) -> dict[str, str]:
        why: dict[str, str] = {}
        if self.measured == 0:
            msg = "no measured steps (all were warm-up, failed, or none ran)"
            why = {k: msg for k, v in figures.items() if v is None}
            if self.peak is None:
                why["peak_allocated_bytes"] = msg
            return why
        step_reason = {
            "gpu_ms": "gpu_ms",
            "samples_per_s": "samples_per_s",
            "gpu_busy_median": "gpu_busy",
            "syncs_per_step": "syncs",
            "tflops_per_s_median": "tflops_per_s",
            "mfu_median": "mfu",
        }
        for fig, field in step_reason.items():
            if figures[fig] is None:
                why[fig] = self.unavailable.get(field) or (
                    "FLOPs were not requested (Profiler(flops='auto') or flops_per_step=N)"
                    if field in ("tflops_per_s", "mfu")
                    else "not in this log (written by an older stepprof)"
                    if field == "syncs"
                    else "not recorded"
                )
        if self.peak is None:
            why["peak_allocated_bytes"] = self.unavailable.get("peak_allocated_bytes", "not recorded")
        return why

    def _memory(self) -> dict[str, Any]:
        last = self.memory_last or {}
        first = self.memory_first or {}
        out = {
            "peak_allocated_bytes_max": self.peak,
            "reserved_bytes_max": self.reserved,
            "reserved_bytes_last": self.reserved_last,
            "host_rss_bytes_last": self.rss,
            "memory_records": self.memory_records,
            "nvml_process_bytes": _num(last.get("nvml_process_bytes")),
            "residual_bytes": _num(last.get("residual_bytes")),
            "residual_bytes_first": _num(first.get("residual_bytes")),
            "allocated_bytes": _num(last.get("allocated_bytes")),
            "total_bytes": _num(last.get("total_bytes")),
            "device_used_bytes": _num(last.get("mem_get_info_used_bytes")),
            "inactive_split_bytes": _num(last.get("inactive_split_bytes")),
            "num_alloc_retries": _num(last.get("num_alloc_retries")),
            "num_ooms": _num(last.get("num_ooms")),
            "basis": last.get("basis") if type(last.get("basis")) is str else None,
            "explanation": last.get("explanation") if type(last.get("explanation")) is str else None,
            "notes": [n for n in last.get("notes") or [] if type(n) is str]
            if type(last.get("notes")) is list
            else [],
        }
        return out

    def _sync_table(self) -> dict[str, Any] | None:
        if not self.sync_steps:
            return None
        sites = sorted(self.sites.items(), key=lambda kv: -kv[1][0])[:10]
        return {
            "steps_counted": self.sync_steps,
            "mechanism": self.sync_mechanism,
            "other_threads": self.other_threads,
            "total": int(sum(v[0] for v in self.sites.values()) + self.sites_dropped),
            "sites": [
                {
                    "where": w,
                    "kind": k,
                    "code": v[1],
                    "count": v[0],
                    "per_step": v[0] / self.sync_steps,
                    "steps_with_it": v[2],
                }
                for (w, k), v in sites
            ],
        }

    def _phase_table(self) -> list[dict[str, Any]]:
        rows = []
        for name, ph in self.phases.items():
            ph.wall.settle()
            ph.gpu.settle()
            rows.append(
                {
                    "name": name,
                    "wall_ms_median": ph.wall.quantile(0.5),
                    "gpu_ms_median": ph.gpu.quantile(0.5),
                    "peak_allocated_bytes_max": ph.peak,
                    "syncs_per_step": ph.syncs / ph.steps if ph.steps else None,
                    "runs_per_step": ph.count / ph.steps if ph.steps else None,
                }
            )
        return rows

    def _spikes(self, figures: dict[str, Any]) -> dict[str, Any] | None:
        step = figures["step_ms"]
        if step is None:
            return None
        median = step["median"]
        threshold = SPIKE_FACTOR * median
        top = sorted((s for s in self.spikes if s[0] >= threshold), key=lambda s: s[1])
        n = self.span.count_above(threshold) if top else 0
        early_until = (self.first_measured or 0) + max(10, self.measured // 20)
        early = [s for s in top if 0 <= s[1] < early_until]
        late = [s for s in top if s not in early]
        period = _period([s[1] for s in late])
        return {
            "threshold_ms": threshold,
            "median_ms": median,
            "count": n,
            "early": [{"step": s[1], "ms": s[0]} for s in early],
            "late": [{"step": s[1], "ms": s[0], "device_allocs": s[2], "alloc_retries": s[3]} for s in late],
            "period_steps": period,
            "max_ms": self.span.max(),
        }

    def _roofline(self, figures: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        f = self.flops
        if f is None:
            return None, (
                "FLOPs are not in this log: run with Profiler(flops='auto') (or flops_per_step=N) "
                "and `stepprof calibrate` once"
            )
        step = figures["step_ms"]
        by_dtype = f.get("flops_by_dtype")
        if step is None:
            return None, "no measured step to compare the FLOPs with"
        if type(by_dtype) is not dict:
            return None, (
                "the FLOPs' dtypes are unknown (flops_per_step was given): run with "
                "Profiler(flops='auto') for the roofline"
            )
        calibration = f.get("calibration")
        source = "log"
        if type(calibration) is not dict:
            name = f.get("device_name")
            calibration, why = load_calibration(name) if type(name) is str else (None, None)
            if calibration is None:
                return None, (
                    why or "the log has no calibration and names no GPU model"
                ) + " (MFU and the class use only measured peaks)"
            source = "this machine's cache"
        try:
            r = roofline(
                step_ms=step["median"],
                flops_by_dtype=by_dtype,
                op_bytes=_num(f.get("op_bytes")),
                ops=f.get("ops") if type(f.get("ops")) is int else None,
                calibration=calibration,
            )
        except (TypeError, ValueError, ZeroDivisionError) as e:
            return None, f"the log's flops record is malformed ({e})"
        r["calibration_source"] = source
        r["mfu"] = (
            r["compute_ms"] / step["median"] if r["compute_ms"] is not None and step["median"] > 0 else None
        )
        r["calibration"] = {
            k: calibration.get(k) for k in ("device_name", "matmul_tflops", "copy_gbps", "launch_us")
        }
        return r, r.get("reason") or ""


def _period(steps: list[int]) -> int | None:
    """The spacing of at least three spike steps, if they are evenly spaced."""
    if len(steps) < 3:
        return None
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    g = gaps[0]
    for x in gaps[1:]:
        g = math.gcd(g, x)
    return g if g > 1 and max(gaps) <= 3 * min(gaps) and all(x % g == 0 for x in gaps) else None


# -- diagnoses ---------------------------------------------------------------------

_SYNC_REMEDY = {
    "item": "keep the value on the GPU and read it every N steps (e.g. accumulate the loss in a tensor)",
    "tolist": "read the list every N steps, or keep it on the GPU",
    "to_host": "copy with .to('cpu', non_blocking=True) into pinned memory and read it a step later",
    "to_device": "copy from pinned memory with non_blocking=True",
    "bool": "avoid Python control flow on GPU values: use torch.where, or check every N steps",
    "scalar": "avoid float()/int() of GPU values in the step: keep them as tensors",
    "nonzero": "use torch.nonzero_static(size=...) or masks that keep the shape",
    "mask_index": "use torch.where(mask, x, 0) or masked_fill instead of x[mask]",
    "masked_select": "use torch.where / masked_fill, which keep the shape",
    "unique": "use a fixed-size alternative or move it out of the step",
    "repeat_interleave": "pass output_size= to repeat_interleave",
    "print": "log tensors every N steps, not every step",
    "device_synchronize": "remove torch.cuda.synchronize() from the step (stepprof times the GPU without it)",
    "stream_synchronize": "wait on an event for the work you need, not the whole stream",
    "event_synchronize": "poll event.query() or move the wait out of the step",
    "backward": (
        "a sync inside autograd: check custom autograd functions and clip_grad_norm_(error_if_nonfinite=True)"
    ),
}


def _diagnose(
    run: dict[str, Any], sweeps: list[dict[str, Any]], roofline_reason: str
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    found: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    figs = run["figures"]
    if run["measured_steps"] == 0:
        why = "no measured steps"
        return [], {
            k: why
            for k in ("host-bound", "sync-heavy", "memory-headroom", "fragmentation", "spikes", "roofline")
        }
    roof = run["roofline"]
    busy = figs["gpu_busy_median"]
    syncs = figs["syncs_per_step"]
    sync_median = syncs["median"] if syncs else None
    # host-bound
    host_evidence = []
    if busy is not None and busy < HOST_BOUND_BUSY:
        host_evidence.append(
            f"median gpu_busy {busy:.2f}: the GPU reached the end of the step's work {1 - busy:.0%} "
            f"of the step before the host did, so it idles at least that share of each step"
        )
    if roof is not None and roof["class"] == "host-bound":
        host_evidence.append(
            f"roofline: {roof['host_ms']:.2f} ms of per-operation host cost (operations x "
            f"{roof['calibration']['launch_us']:.1f} µs) exceeds the compute ({_ms(roof['compute_ms'])}) "
            f"and memory ({_ms(roof['memory_ms'])}) bounds of a {roof['step_ms']:.2f} ms step"
        )
    rec = _sweep_for(sweeps)
    bs = run["batch_size"]
    if rec is not None and bs is not None and type(rec.get("knee")) is int and bs < rec["knee"]:
        host_evidence.append(
            f"the sweep in this log found the knee at batch {rec['knee']:,}; at batch {bs:,} the "
            f"GPU is not saturated"
        )
    if host_evidence:
        found.append(
            {
                "kind": "host-bound",
                "title": "Host-bound: the GPU waits for Python to launch work",
                "evidence": host_evidence,
                "remedy": [
                    "a larger batch (more work per launch)",
                    "torch.compile(model, mode='reduce-overhead'), which replays CUDA graphs",
                    "CUDA graphs (torch.cuda.graphs) for a static step",
                    "fuse small ops (torch.compile, fused optimizers: AdamW(fused=True))",
                ],
            }
        )
    elif busy is None:
        missing["host-bound"] = run["unavailable"].get("gpu_busy_median", "gpu_busy not recorded")
    elif busy > 1.1:
        found.append(
            {
                "kind": "gpu-bound",
                "title": "GPU-bound: the GPU is the bottleneck",
                "evidence": [
                    f"median gpu_busy {busy:.2f}: the host left the step before the GPU finished it"
                ],
                "remedy": ["see the roofline class below for what limits the GPU"],
            }
        )
    elif (
        roof is not None
        and roof["class"] in ("compute-bound", "memory-bound")
        and (roof["explained"] or 0) >= 0.5
    ):
        missing["host-bound"] = (
            f"ruled out: the roofline's {roof['class'].split('-')[0]} bound explains "
            f"{roof['explained']:.0%} of the step"
        )
    else:
        missing["host-bound"] = (
            f"median gpu_busy {busy:.2f} is close to 1, which fits both a host-bound loop and a "
            f"GPU-bound one that syncs each step; the roofline (flops='auto' and `stepprof calibrate`) "
            f"or Nsight Systems tells them apart"
        )
    # sync-heavy
    table = run["syncs"]
    if table is None:
        missing["sync-heavy"] = run["unavailable"].get("syncs_per_step", "syncs not recorded")
    elif sync_median is not None and sync_median >= 1:
        ev = [f"median {sync_median:g} sync(s) per step over {table['steps_counted']:,} steps"]
        remedies = []
        for site in table["sites"][:5]:
            ev.append(
                f"{site['where']}: {site['kind']} `{site['code'] or '?'}`, {site['per_step']:.2f} per step"
            )
            tip = _SYNC_REMEDY.get(site["kind"])
            if tip and tip not in remedies:
                remedies.append(f"{site['kind']} at {site['where']}: {tip}")
        remedies.append("profile_step(max_syncs=0, on_sync='raise') stops at the line that syncs")
        found.append(
            {
                "kind": "sync-heavy",
                "title": "Sync-heavy: the host waits for the GPU inside the step",
                "evidence": ev,
                "remedy": remedies,
            }
        )
    # memory headroom and fragmentation
    _memory_diagnoses(run, rec, found, missing)
    # spikes
    sp = run["spikes"]
    if sp is not None and sp["count"]:
        ev = [
            f"{sp['count']:,} step(s) took more than {SPIKE_FACTOR:g}x the median "
            f"{sp['median_ms']:.2f} ms (slowest {sp['max_ms']:.2f} ms)"
        ]
        remedy = []
        if sp["early"]:
            ev.append(
                "right after warm-up: steps "
                + ", ".join(f"{s['step']} ({s['ms']:.1f} ms)" for s in sp["early"][:6])
            )
            remedy.append(
                f"raise Profiler(warmup=...) past step {sp['early'][-1]['step']}, so that "
                f"compilation and autotuning stay out of the figures"
            )
        if sp["late"]:
            ev.append("later: steps " + ", ".join(f"{s['step']} ({s['ms']:.1f} ms)" for s in sp["late"][:6]))
            if sp["period_steps"]:
                ev.append(
                    f"they recur every {sp['period_steps']} steps: periodic work inside the step "
                    f"(evaluation, checkpointing, logging)"
                )
                remedy.append("move periodic work out of profile_step, or measure it as its own step name")
            if any(s["device_allocs"] or s["alloc_retries"] for s in sp["late"]):
                remedy.append(
                    "some spikes called cudaMalloc or retried an allocation: the allocator grew there; "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and steady shapes avoid it"
                )
            remedy.append(
                "recompiles: run with TORCH_LOGS=recompiles; mark varying dims with "
                "torch._dynamo.mark_dynamic or pad shapes to a few sizes"
            )
        found.append(
            {
                "kind": "spikes",
                "title": "Spikes: steps far above the median",
                "evidence": ev,
                "remedy": remedy,
            }
        )
    # roofline
    if roof is None or roof["class"] is None:
        missing["roofline"] = roofline_reason
    else:
        cls = roof["class"]
        ev = [
            f"{_ms(roof['compute_ms'])} compute bound (FLOPs at the calibrated matmul rates), "
            f"{_ms(roof['memory_ms'])} memory bound (operation bytes at "
            f"{roof['calibration']['copy_gbps']:,.0f} GB/s), "
            f"{_ms(roof['host_ms'])} host bound, against a {roof['step_ms']:.2f} ms step"
        ]
        if roof["mfu"] is not None:
            ev.append(f"MFU {roof['mfu']:.1%} of this GPU's calibrated (measured, not datasheet) peak")
        if roof["arithmetic_intensity"] is not None and roof["ridge"] is not None:
            ev.append(
                f"arithmetic intensity {roof['arithmetic_intensity']:.0f} FLOP/byte against a ridge of "
                f"{roof['ridge']:.0f} (operation bytes count each op's inputs and outputs: an upper "
                f"bound for fused kernels)"
            )
        if roof["explained"] is not None and roof["explained"] < 0.5:
            ev.append(
                f"the largest bound explains only {roof['explained']:.0%} of the step: the rest is "
                f"idle time (syncs, data waits, small kernels below their bound)"
            )
        remedy = {
            "compute-bound": [
                "the matmuls dominate: bf16 (or fp8) if not used yet, fewer recomputed "
                "FLOPs (activation checkpointing costs a forward)"
            ],
            "memory-bound": [
                "fuse elementwise ops (torch.compile)",
                "keep activations in bf16",
                "larger matmuls (bigger hidden sizes or batches) raise the intensity",
            ],
            "host-bound": [
                "a larger batch",
                "torch.compile(mode='reduce-overhead') / CUDA graphs",
                "fuse small ops",
            ],
        }.get(cls or "", [])
        found.append(
            {
                "kind": "roofline",
                "title": f"Roofline: {cls}" if cls else "Roofline",
                "evidence": ev,
                "remedy": remedy,
            }
        )
    return found, missing


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"


def _sweep_for(sweeps: list[dict[str, Any]]) -> dict[str, Any] | None:
    for s in reversed(sweeps):
        if s.get("result") is not None:
            return s["result"]
    return None


def _memory_diagnoses(
    run: dict[str, Any], sweep: dict[str, Any] | None, found: list[dict[str, Any]], missing: dict[str, str]
) -> None:
    mem = run["memory"]
    peak = mem["peak_allocated_bytes_max"]
    total = mem["total_bytes"]
    bs = run["batch_size"]
    if peak is None:
        missing["memory-headroom"] = run["unavailable"].get(
            "peak_allocated_bytes", "no peak memory in the log"
        )
        missing["fragmentation"] = missing["memory-headroom"]
        return
    ev: list[str] = []
    remedy: list[str] = []
    if total is not None:
        # Unknown is not 0; a negative residual (MPS, MIG, a driver change) is about 0 (memory.md).
        residual = None if mem["residual_bytes"] is None else max(0.0, mem["residual_bytes"])
        others = 0.0
        if mem["device_used_bytes"] is not None and mem["nvml_process_bytes"] is not None:
            others = max(0.0, mem["device_used_bytes"] - mem["nvml_process_bytes"])
        usable = total - (residual or 0.0) - others
        headroom = usable - peak
        context = (
            "CUDA context and other unknown: the last memory record has no residual"
            if residual is None
            else f"{format_bytes(int(residual))} CUDA context and other"
        )
        ev.append(
            f"peak {format_bytes(int(peak))} of {'at most ' if residual is None else ''}"
            f"{format_bytes(int(usable))} usable by the allocator ({format_bytes(int(total))} total, {context}"
            + (f", {format_bytes(int(others))} other processes" if others else "")
            + ")"
        )
        base = mem["allocated_bytes"]
        if bs and base is not None and residual is not None and peak > base:
            per_sample = (peak - base) / bs
            fits = int(bs + headroom / per_sample) if headroom > 0 else bs
            ev.append(
                f"at batch {bs:,} the step adds {format_bytes(int(peak - base))} over the "
                f"{format_bytes(int(base))} held between steps ({format_bytes(int(per_sample))} per sample): "
                f"about batch {fits:,} fits ({fits / bs:.1f}x), if that grows linearly with the batch"
            )
        if sweep is None:
            remedy.append(
                "confirm with stepprof.sweep(), which finds the largest batch that fits and the knee"
            )
    if sweep is not None:
        ev.append(
            f"the sweep in this log: max_fit {_int(sweep.get('max_fit'))}, knee {_int(sweep.get('knee'))}, "
            f"recommended {_int(sweep.get('recommended'))}"
        )
        if bs is not None and type(sweep.get("recommended")) is int and sweep["recommended"] > 0:
            remedy.append(f"use batch {sweep['recommended']:,} (the sweep's recommendation; now {bs:,})")
    if ev:
        found.append(
            {"kind": "memory-headroom", "title": "Memory headroom", "evidence": ev, "remedy": remedy}
        )
    else:
        missing["memory-headroom"] = "no memory record in the log (CUDA runs write one after warm-up)"
    # fragmentation: the allocator holds much more than the step ever needed
    reserved = run["memory"]["reserved_bytes_max"]
    alloc = run["allocator"] or {}
    retries = alloc.get("num_alloc_retries", 0)
    frag_ev = []
    if reserved is not None and reserved > peak:
        extra = reserved - peak
        if extra > 0.25 * reserved and extra > 512 * 2**20:
            frag_ev.append(
                f"reserved {format_bytes(int(reserved))} against a peak of {format_bytes(int(peak))}: "
                f"{format_bytes(int(extra))} cached that no step needed at once"
            )
    split = mem["inactive_split_bytes"]
    if split is not None and split > 256 * 2**20:
        frag_ev.append(
            f"{format_bytes(int(split))} in inactive split blocks (pieces of segments that cannot be freed)"
        )
    if retries:
        frag_ev.append(
            f"{retries:,} allocation retries in measured steps: cudaMalloc failed and the "
            f"allocator freed its cache and synchronised"
        )
    if alloc.get("steps_with_device_alloc", 0) > 0.02 * max(1, run["measured_steps"]):
        frag_ev.append(
            f"{alloc['steps_with_device_alloc']:,} measured steps called cudaMalloc "
            f"(a steady loop calls none)"
        )
    frag_ev += [f"memory record: {n}" for n in mem["notes"]]
    if frag_ev and (len(frag_ev) > len(mem["notes"]) or any("fragment" in n for n in mem["notes"])):
        found.append(
            {
                "kind": "fragmentation",
                "title": "Fragmentation and allocator churn",
                "evidence": frag_ev,
                "remedy": [
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow in place)",
                    "keep tensor shapes steady across steps (pad variable lengths to a few sizes)",
                    "a slightly smaller batch if allocations retry",
                ],
            }
        )
    elif reserved is None:
        missing["fragmentation"] = run["unavailable"].get("reserved_bytes", "reserved memory not recorded")


def _int(x: Any) -> str:
    return f"{x:,}" if type(x) is int else "n/a"


# -- sweeps ------------------------------------------------------------------------


def _sweep(points: list[dict[str, Any]], result: dict[str, Any] | None) -> dict[str, Any]:
    names = {a.name for a in attrs.fields(SweepPoint)}
    built: list[SweepPoint] = []
    for p in points:
        kw = {k: p.get(k) for k in names}
        kw["unavailable"] = p.get("unavailable") if type(p.get("unavailable")) is dict else {}
        if (
            type(kw["batch_size"]) is not int
            or type(kw["oom"]) is not bool
            or not all(
                v is None or type(v) in (int, float)
                for k, v in kw.items()
                if k not in ("phase", "error", "unavailable", "oom")
            )
            or not all(v is None or type(v) is str for v in (kw["phase"], kw["error"]))
        ):
            continue  # a point this version cannot read
        built.append(SweepPoint(**kw))
    built.sort(key=lambda p: p.batch_size if type(p.batch_size) is int else 0)
    out: dict[str, Any] = {"points": [attrs.asdict(p) for p in built], "result": None, "table": None}
    if result is not None:
        rnames = {a.name for a in attrs.fields(SweepResult)} - {"points"}
        kw = {k: result.get(k) for k in rnames}
        zone = result.get("thrash_zone")
        kw["thrash_zone"] = (
            range(zone[0], zone[1] + 1)
            if type(zone) is list and len(zone) == 2 and all(type(z) is int for z in zone)
            else None
        )
        notes = result.get("notes")
        kw["notes"] = tuple(n for n in notes if type(n) is str) if type(notes) is list else ()
        kw["unavailable"] = result.get("unavailable") if type(result.get("unavailable")) is dict else {}
        kw.setdefault("knee_within", 0.1)
        if kw.get("knee_within") is None:
            kw["knee_within"] = 0.1
        clean = {k: v for k, v in result.items() if k not in ("schema_version",)}
        out["result"] = clean
        try:
            obj = SweepResult(points=tuple(built), **kw)
            out["table"] = str(obj)
            out["_object"] = obj
        except Exception:  # noqa: BLE001 - a result this version cannot read: the points still print
            out["table"] = None
    if out["table"] is None and built:
        out["table"] = "\n".join(str(p) for p in built)
    return out


# -- the pass over the logs --------------------------------------------------------


class _Segment:
    """The aggregates of one stretch of a log: its runs, in order, and what else it held.

    A whole log is one segment.  A large log is read as several byte ranges in
    parallel, one segment each, and the segments are stitched in file order
    (:meth:`stitch`): a run that the previous range left open continues into the
    next one, as it would have in one pass.
    """

    def __init__(self) -> None:
        self.stats = ScanStats()
        self.runs: list[_Run] = []
        self.sweep_records: list[dict[str, Any]] = []  # sweep_point/sweep_result, in order
        self.versions: dict[Any, int] = {}
        self.kinds: dict[str, int] = {}
        # The first run was opened only because the range began (not by a summary or an
        # index restart), so it may continue the previous range's last run.
        self.first_continues = False

    def read(self, path: str, start: int = 0, end: int | None = None) -> _Segment:
        versions, kinds, sweep_records = self.versions, self.kinds, self.sweep_records
        run: _Run | None = None
        closed = False
        for r in scan(path, self.stats, start, end):
            kind = r.get("kind")
            v = r.get("schema_version")
            if type(v) is not int:  # a foreign line's may be anything, unhashable too
                v = None if v is None else str(v)[:40]
            if v not in versions and len(versions) < 16:
                versions[v] = 0
            if v in versions:
                versions[v] += 1
            if kind == "step":
                idx = r.get("step")
                if run is None or closed or (type(idx) is int and idx <= run.last_step and run.steps):
                    run = self._new_run(run)
                    closed = False
                run.add_step(r)
            elif kind == "memory":
                if run is None or closed:
                    run = self._new_run(run)
                    closed = False
                run.add_memory(r)
            elif kind == "summary":
                if run is None:
                    run = self._new_run(run)
                run.summary = r
                if run.identity is None:
                    run.take_identity(r)
                closed = True
            elif kind == "ranks":
                if run is None or closed:
                    run = self._new_run(run)
                    closed = False
                run.add_ranks(r)
            elif kind == "flops":
                if run is None or closed:
                    run = self._new_run(run)
                    closed = False
                run.flops = r
            elif kind == "sweep_point" or kind == "sweep_result":
                if len(sweep_records) < 200_000:
                    sweep_records.append(r)
            else:
                key = str(kind)[:40]
                if key in kinds or len(kinds) < 32:
                    kinds[key] = kinds.get(key, 0) + 1
        return self

    def _new_run(self, previous: _Run | None) -> _Run:
        if previous is None and not self.runs:
            self.first_continues = True
        run = _Run(len(self.runs))
        self.runs.append(run)
        return run

    def stitch(self, later: _Segment) -> None:
        """Append the segment that follows this one in the file."""
        self.stats.lines += later.stats.lines
        self.stats.skipped += later.stats.skipped
        for v, n in later.versions.items():
            if v in self.versions or len(self.versions) < 16:
                self.versions[v] = self.versions.get(v, 0) + n
        for k, n in later.kinds.items():
            if k in self.kinds or len(self.kinds) < 32:
                self.kinds[k] = self.kinds.get(k, 0) + n
        self.sweep_records.extend(later.sweep_records[: max(0, 200_000 - len(self.sweep_records))])
        runs = later.runs
        if runs and self.runs and later.first_continues:
            last, first = self.runs[-1], runs[0]
            restarted = (
                first.first_step is not None and last.steps and first.first_step <= last.last_step
            )
            if last.summary is None and not restarted:
                last.merge(first)
                runs = runs[1:]
        for run in runs:
            run.index = len(self.runs)
            self.runs.append(run)
        if not self.runs:
            self.first_continues = later.first_continues


def _read_range(args: tuple[str, int, int]) -> _Segment:
    path, start, end = args
    return _Segment().read(path, start, end)


#: Logs larger than this are read as several byte ranges in parallel (Linux, fork).
PARALLEL_BYTES = 64 * 2**20


def _read_log(path: str, workers: int | None = None) -> _Segment:
    size = os.path.getsize(path)
    if workers is None:
        workers = min(16, os.cpu_count() or 1) if size >= PARALLEL_BYTES else 1
    if workers <= 1 or size == 0:
        return _Segment().read(path)
    import multiprocessing

    try:
        ctx = multiprocessing.get_context("fork")  # workers inherit the imports: no start-up
    except ValueError:
        return _Segment().read(path)
    cuts = [size * k // workers for k in range(workers + 1)]
    with ctx.Pool(workers) as pool:
        parts = pool.map(_read_range, [(path, a, b) for a, b in zip(cuts, cuts[1:])])
    whole = parts[0]
    for part in parts[1:]:
        whole.stitch(part)
    return whole


def report_log(path: str, workers: int | None = None) -> dict[str, Any]:
    """Stream one log into its report section.

    Args:
        path: the log.
        workers: processes to read it with; None reads a log of at least
            :data:`PARALLEL_BYTES` with one process per core (up to 16), else in this one.
    """
    seg = _read_log(path, workers)
    sweeps: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for r in seg.sweep_records:
        if r.get("kind") == "sweep_point":
            if len(points) < 10_000:
                points.append(r)
        else:
            sweeps.append(_sweep(points, r))
            points = []
    if points:
        sweeps.append(_sweep(points, None))
    objects = [s.pop("_object", None) for s in sweeps]
    versions = seg.versions
    newer = sorted(v for v in versions if type(v) is int and v > SCHEMA_VERSION)
    return {
        "path": os.fspath(path),
        "lines": seg.stats.lines,
        "skipped_lines": seg.stats.skipped,
        "schema_versions": sorted((v for v in versions if type(v) is int)),
        "newer_schema": newer[-1] if newer else None,
        "other_kinds": seg.kinds,
        "runs": [r.result(sweeps) for r in seg.runs if r.steps or r.memory_records or r.flops
                 or r.ranks_records],
        "sweeps": sweeps,
        "_sweep_objects": objects,
    }


def build_report(paths: list[str]) -> dict[str, Any]:
    """The report of ``paths`` as a JSON-able dict (what ``stepprof report --json`` prints)."""
    logs = []
    for p in paths:
        section = report_log(p)
        section.pop("_sweep_objects", None)
        logs.append(section)
    report: dict[str, Any] = {"stepprof_report": REPORT_VERSION, "logs": logs}
    ranks = _cross_rank(logs)
    if ranks is not None:
        report["distributed"] = ranks
    return report


def _cross_rank(logs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-rank logs together: a row per rank (each log's last run) and the straggler view."""
    from ._dist import find_straggler

    last: dict[int, tuple[str, dict[str, Any]]] = {}
    for log in logs:
        for run in log["runs"]:
            if type(run.get("rank")) is int:
                last[run["rank"]] = (log["path"], run)
    if not last:
        return None
    rows = []
    for rank in sorted(last):
        path, run = last[rank]
        f = run["figures"]
        rows.append({
            "rank": rank, "local_rank": run.get("local_rank"), "world_size": run.get("world_size"),
            "log": path, "steps": run["steps"], "measured_steps": run["measured_steps"],
            "wall_ms_median": (f["wall_ms"] or {}).get("median"),
            "gpu_ms_median": (f["gpu_ms"] or {}).get("median"),
            "peak_allocated_bytes_max": run["memory"]["peak_allocated_bytes_max"],
            "syncs_per_step_median": (f["syncs_per_step"] or {}).get("median"),
            "phases": {ph["name"]: ph["gpu_ms_median"] if ph["gpu_ms_median"] is not None else ph["wall_ms_median"]
                       for ph in run["phases"] if "/" not in ph["name"]},
        })
    worlds = {r["world_size"] for r in rows}
    notes = []
    world = max((w for w in worlds if type(w) is int), default=None)
    if world is not None and len(rows) < world:
        have = {r["rank"] for r in rows}
        notes.append(f"logs of rank(s) {', '.join(str(r) for r in range(world) if r not in have)} "
                     f"were not given")
    # The report's own check, on the per-rank medians over the whole run (rows in rank order;
    # the rule's index is the position, mapped back to the rank).
    gpu = all(r["gpu_ms_median"] is not None for r in rows)
    step = [float("nan") if x is None else x for x in
            (r["gpu_ms_median"] if gpu else r["wall_ms_median"] for r in rows)]
    names = list(rows[0]["phases"])
    same = all(list(r["phases"]) == names for r in rows)
    segments = [(n, [float("nan") if r["phases"][n] is None else r["phases"][n] for r in rows])
                for n in names] if same else []
    if not same:
        notes.append("the ranks' phase names differ, so phases are not compared")
    found = find_straggler(step, segments)
    check = {
        "straggler_rank": rows[found.rank]["rank"] if found.rank is not None else None,
        "basis": found.basis, "excess_ms": found.excess_ms, "step_ratio": found.ratio,
        "step_figure": "gpu_ms" if gpu else "wall_ms", "reason": found.reason,
    }
    exchanges = None
    for _, run in last.values():
        if run.get("ranks"):
            exchanges = run["ranks"]
    return {"ranks": rows, "from_medians": check, "exchanges": exchanges, "notes": notes}


# -- text --------------------------------------------------------------------------


def _p(d: dict[str, float] | None, fmt: str = "{:.2f}", unit: str = "") -> str:
    if d is None:
        return "n/a"
    return f"{fmt.format(d['median'])}{unit} (p10 {fmt.format(d['p10'])}, p90 {fmt.format(d['p90'])})"


def _b(x: float | None) -> str:
    return "n/a" if x is None else format_bytes(int(x))


def render(report: dict[str, Any]) -> str:
    """The report as plain text: figures, then diagnoses with evidence and remedies."""
    out: list[str] = []
    for log in report["logs"]:
        out.append(f"== {log['path']}: {log['lines']:,} lines")
        if log["skipped_lines"]:
            out.append(
                f"   skipped {log['skipped_lines']:,} line(s) that are not JSON objects (torn or corrupt)"
            )
        if log["newer_schema"]:
            out.append(
                f"   written by a newer stepprof (schema {log['newer_schema']}): fields this version "
                f"does not know are ignored"
            )
        if not log["runs"] and not log["sweeps"]:
            out.append("   no step, memory or sweep records")
        for run in log["runs"]:
            _render_run(run, out, len(log["runs"]) > 1)
        for i, sw in enumerate(log["sweeps"]):
            out.append("")
            out.append(f"-- sweep {i + 1}" if len(log["sweeps"]) > 1 else "-- sweep")
            out.append(sw["table"] or "(no points)")
            if sw["result"] is None:
                out.append("the sweep has no result record (it stopped before the end)")
        out.append("")
    if "distributed" in report:
        _render_ranks(report["distributed"], out)
    return "\n".join(out).rstrip() + "\n"


def _render_ranks(d: dict[str, Any], out: list[str]) -> None:
    rows = d["ranks"]
    out.append(f"== ranks: {len(rows)} log(s) of world size {rows[0]['world_size']}")
    out.append(f"   {'rank':>4} {'steps':>7} {'wall ms':>9} {'GPU ms':>9} {'peak':>11} {'syncs/step':>10}  log")
    for r in rows:
        syncs = r["syncs_per_step_median"]
        out.append(
            f"   {r['rank']:>4} {r['measured_steps']:>7,} {_f(r['wall_ms_median']):>9} {_f(r['gpu_ms_median']):>9} "
            f"{_b(r['peak_allocated_bytes_max']):>11} {'n/a' if syncs is None else format(syncs, 'g'):>10}  {r['log']}"
        )
    for n in d["notes"]:
        out.append(f"   note: {n}")
    ex = d["exchanges"]
    if ex is None:
        out.append("   stepprof's exchanges: no ranks records (rank 0's log not given, or ranks_every=0)")
    else:
        counts = ex["straggler_counts"]
        named = ", ".join(f"rank {k} in {v:,}" for k, v in counts.items()) or "no rank"
        out.append(f"   stepprof's exchanges: {ex['exchanges']:,}; straggler named: {named}")
        rec = ex["latest_named"]
        if rec is not None:
            out.append(
                f"   latest named (step {rec.get('step')}): rank {rec.get('straggler_rank')}, "
                f"basis {rec.get('straggler_basis')}, {_f(rec.get('straggler_excess_ms'))} ms over the median"
            )
        last = ex["latest"]
        if last is not None and last.get("straggler_rank") is None:
            why = (last.get("unavailable") or {}).get("straggler_rank")
            out.append(f"   latest exchange (step {last.get('step')}): no straggler" + (f" ({why})" if why else ""))
    c = d["from_medians"]
    if c["straggler_rank"] is not None:
        out.append(
            f"   from the per-rank medians: rank {c['straggler_rank']} (basis {c['basis']}, "
            f"{c['excess_ms']:.2f} ms over the median; {c['step_figure']})"
        )
    else:
        out.append(f"   from the per-rank medians: no straggler ({c['reason']})")


def _render_run(run: dict[str, Any], out: list[str], several: bool) -> None:
    f = run["figures"]
    head = f"-- run {run['run'] + 1}" if several else "--"
    names = ", ".join(run["names"][:5]) or "none"
    out.append("")
    out.append(
        f"{head} {run['device'] or 'no device'}: {run['steps']:,} steps ({run['warmup_steps']:,} warm-up, "
        f"{run['error_steps']:,} failed, {run['measured_steps']:,} measured); names: {names}"
        + (f"; batch {run['batch_size']:,}" if run["batch_size"] else "")
    )
    if not run["summary_found"] and run["steps"]:
        out.append("   no summary record: the run did not close (crash or still running)")
    if run["approximate_quantiles"]:
        out.append("   quantiles are approximate (over 32,768 steps: rank error < 0.1%)")
    if run["malformed_steps"]:
        out.append(f"   {run['malformed_steps']:,} step record(s) without a usable wall_ms were left out")
    rows = [
        ("wall ms", _p(f["wall_ms"])),
        ("GPU ms", _p(f["gpu_ms"])),
        ("samples/s", _p(f["samples_per_s"], "{:,.0f}")),
        ("GPU busy (median)", "n/a" if f["gpu_busy_median"] is None else f"{f['gpu_busy_median']:.2f}"),
        ("syncs/step", _p(f["syncs_per_step"], "{:g}")),
        (
            "TFLOP/s (median)",
            "n/a" if f["tflops_per_s_median"] is None else f"{f['tflops_per_s_median']:.4g}",
        ),
        ("MFU (median)", "n/a" if f["mfu_median"] is None else f"{f['mfu_median']:.1%}"),
        ("stepprof µs/step", "n/a" if f["overhead_us_median"] is None else f"{f['overhead_us_median']:.0f}"),
    ]
    m = run["memory"]
    rows += [
        ("peak allocated", _b(m["peak_allocated_bytes_max"])),
        ("reserved (max)", _b(m["reserved_bytes_max"])),
        ("nvidia-smi (NVML)", _b(m["nvml_process_bytes"])),
        ("residual (context+other)", _b(m["residual_bytes"])),
    ]
    if m["host_rss_bytes_last"] is not None:
        rows.append(("host RSS (last)", _b(m["host_rss_bytes_last"])))
    a = run["allocator"]
    if a is not None:
        rows.append(
            (
                "allocator retries",
                f"{a['num_alloc_retries']:,} (cudaMalloc in {a['steps_with_device_alloc']:,} steps)",
            )
        )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        reason = ""
        key = {
            "wall ms": "wall_ms",
            "GPU ms": "gpu_ms",
            "samples/s": "samples_per_s",
            "GPU busy (median)": "gpu_busy_median",
            "syncs/step": "syncs_per_step",
            "TFLOP/s (median)": "tflops_per_s_median",
            "MFU (median)": "mfu_median",
            "stepprof µs/step": "overhead_us_median",
            "peak allocated": "peak_allocated_bytes",
        }.get(k)
        if v == "n/a" and key in run["unavailable"]:
            reason = f"  ({run['unavailable'][key]})"
        out.append(f"   {k:<{width}}  {v}{reason}")
    if run["syncs"] and run["syncs"]["sites"]:
        out.append("   top sync sites:")
        for s in run["syncs"]["sites"][:5]:
            out.append(f"     {s['per_step']:>6.2f}/step  {s['where']}  {s['kind']}  {s['code'] or ''}")
    if run["phases"]:
        out.append(f"   {'phase':<24} {'wall ms':>9} {'GPU ms':>9} {'peak':>11} {'syncs/step':>10}")
        for ph in run["phases"]:
            out.append(
                f"   {ph['name'][:24]:<24} {_f(ph['wall_ms_median']):>9} {_f(ph['gpu_ms_median']):>9} "
                f"{_b(ph['peak_allocated_bytes_max']):>11} "
                f"{'n/a' if ph['syncs_per_step'] is None else format(ph['syncs_per_step'], '.2f'):>10}"
            )
    if run["flops"] is not None and type(run["flops"].get("flops_per_step")) in (int, float):
        fl = run["flops"]
        out.append(
            f"   FLOPs/step {fl['flops_per_step']:.4g} ({fl.get('source')}"
            + (f", counted in step {fl['step']}" if type(fl.get("step")) is int else "")
            + ")"
        )
    out.append("")
    if run["diagnoses"]:
        out.append("   Diagnoses")
        for d in run["diagnoses"]:
            out.append(f"   * {d['title']}")
            for e in d["evidence"]:
                out.append(f"       evidence: {e}")
            for r in d["remedy"]:
                out.append(f"       remedy:   {r}")
    else:
        out.append("   Diagnoses: nothing stands out")
    if run["not_diagnosed"]:
        out.append("   Not diagnosed")
        for k, v in run["not_diagnosed"].items():
            out.append(f"   - {k}: {v}")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"

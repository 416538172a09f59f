"""``stepprof plot``: a step log's times and memory over steps, or a sweep log's curve.

matplotlib is imported here only, through the object API (no pyplot): no global
figure state, no GUI backend.
"""

from __future__ import annotations

import os
from array import array
from typing import Any, NamedTuple

from ._errors import ConfigError, MissingExtraError
from ._log import ScanStats, scan
from ._report.read import SWEEP_RECORDS_KEPT, RunGrouper
from ._report.sweeps import logged_sweeps
from ._rules import RUN_KINDS, SPIKE_FACTOR, is_spike, left_out, span_ms
from ._stats import QuantileSketch
from ._sweep.plot import legend_above, plot_sweep
from ._units import printable

__all__ = ["default_png", "plot_log"]

_GIB = 2**30
_MAX_POINTS = 4000  # beyond this many steps, each plotted point is a bin: median line, min-max band


def _matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise MissingExtraError(
            "stepprof plot needs matplotlib, which is not installed. "
            "Install it with: pip install 'stepprof[plot]'"
        ) from e
    return Figure, FigureCanvasAgg, FuncFormatter


class _Series:
    def __init__(self) -> None:
        self.step = array("d")
        self.wall = array("d")
        self.gpu = array("d")
        self.peak = array("d")
        self.reserved = array("d")
        self.rss = array("d")
        self.timed: list[bool] = []  # each step: a timed step (stepprof._rules.left_out), as the summary's
        self.warm_until: float | None = None
        self.device: str | None = None
        self.memory: list[tuple[float, float, float]] = []  # (step, nvml, total); NaN: missing
        self.flops_step: float | None = None
        self.last = -1  # the latest step index (where a memory record without one goes)


def _as_float(x: Any) -> float:
    """A number as a float; anything else (null, a str) as NaN, which matplotlib leaves out."""
    return float(x) if type(x) in (int, float) else float("nan")


def _read(path: str) -> tuple[list[_Series], list[dict[str, Any]], ScanStats]:
    """The log's runs (grouped as ``stepprof report`` groups them) and its sweep records."""
    stats = ScanStats()
    runs: list[_Series] = []
    sweep_records: list[dict[str, Any]] = []

    def new_run(run_id: str | None) -> _Series:
        runs.append(_Series())
        return runs[-1]

    run_of = RunGrouper(new_run).run_of
    for r in scan(path, stats):
        kind = r.get("kind")
        if kind in ("sweep_point", "sweep_result"):
            if len(sweep_records) < SWEEP_RECORDS_KEPT:
                sweep_records.append(r)
            continue
        if kind not in RUN_KINDS:
            continue
        cur = run_of(kind, r)
        if kind == "step":
            idx = r.get("step")
            if type(idx) is not int:
                continue
            cur.last = idx
            cur.step.append(idx)
            cur.wall.append(_as_float(r.get("wall_ms")))
            cur.gpu.append(_as_float(r.get("gpu_ms")))
            cur.peak.append(_as_float(r.get("peak_allocated_bytes")))
            cur.reserved.append(_as_float(r.get("reserved_bytes")))
            cur.rss.append(_as_float(r.get("host_rss_bytes")))
            cur.timed.append(left_out(r) is None)
            if r.get("warmup") is True:
                cur.warm_until = idx
            if type(r.get("device")) is str:
                cur.device = r["device"]
            if r.get("flops_counted") is True:
                cur.flops_step = idx
        elif kind == "memory":
            step = r.get("step")
            cur.memory.append(
                (
                    float(step) if type(step) is int else float(cur.last),
                    _as_float(r.get("nvml_process_bytes")),
                    _as_float(r.get("total_bytes")),
                )
            )
    return [run for run in runs if len(run.step)], sweep_records, stats


def _binned(xs: array[float], ys: array[float]) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, median, min, max) per bin; one bin per step below _MAX_POINTS steps."""
    n = len(xs)
    if n <= _MAX_POINTS:
        ys_l = list(ys)
        return list(xs), ys_l, ys_l, ys_l
    size = -(-n // _MAX_POINTS)
    bx, med, lo, hi = [], [], [], []
    for i in range(0, n, size):
        chunk = sorted(y for y in ys[i : i + size] if y == y)
        if not chunk:
            continue
        bx.append(xs[i + (min(size, n - i) - 1) // 2])
        med.append(chunk[len(chunk) // 2])
        lo.append(chunk[0])
        hi.append(chunk[-1])
    return bx, med, lo, hi


def default_png(log: str, suffix: str = ".png") -> str:
    """Where ``stepprof plot LOG`` writes without ``-o``: beside the log, ``.jsonl`` replaced by
    ``suffix`` (``.png``; ``.peak.png`` for ``--peak``)."""
    root, ext = os.path.splitext(log)
    return (root if ext.lower() in (".jsonl", ".json", ".ndjson") else log) + suffix


def plot_log(path: str, out: str, *, run: int = -1, sweep: bool = False) -> str:
    """Draw the log at ``path`` to a PNG at ``out``; return ``out``.

    A log with steps draws its run ``run`` (default the last); ``sweep=True``, or a
    log with only sweep records, draws the last sweep's curve.
    """
    _, Canvas, _ = _matplotlib()
    ext = os.path.splitext(os.fspath(out))[1].lstrip(".").lower()
    if ext and ext not in Canvas.get_supported_filetypes():
        raise ConfigError(
            f"'-o' {out!r}: matplotlib cannot write .{ext} files; name a .png file "
            f"(or one of .{', .'.join(sorted(Canvas.get_supported_filetypes()))})"
        )
    runs, sweep_records, stats = _read(path)
    if sweep or not runs:
        if not sweep_records:
            skipped = f" ({stats.skipped} unreadable lines)" if stats.skipped else ""
            if runs:  # --sweep asked for, but the log holds only steps
                raise ConfigError(
                    f"{path!r} has no sweep records{skipped}, only steps; run the same command "
                    f"without --sweep to plot its steps"
                )
            foreign = stats.foreign()
            if foreign is not None:
                raise ConfigError(f"{path!r} is {foreign}; pass a log that stepprof wrote")
            raise ConfigError(f"{path!r} has no step or sweep records to plot{skipped}")
        return _plot_sweep(path, sweep_records, out)
    if not -len(runs) <= run < len(runs):
        raise ConfigError(f"'--run' must be between 1 and {len(runs)} for {path!r} (got {run + 1})")
    fig = steps_figure(path, runs[run], run, len(runs))
    # Without an extension matplotlib would add ".png" to the name: write the path as given.
    fig.savefig(out, format=None if ext else "png")
    return out


class RunFigures(NamedTuple):
    """What the steps plot states: the median wall time, its 99th percentile, and the spikes
    (step, span), over the timed steps, by the rules and the sketch the summary and the report use."""

    median_wall_ms: float | None
    p99_wall_ms: float | None
    spikes: list[tuple[float, float]]


def run_figures(s: _Series) -> RunFigures:
    """The plotted figures of one run's steps (see :class:`RunFigures`)."""
    walls, spans = QuantileSketch(), QuantileSketch()
    timed_spans: list[tuple[float, float]] = []  # (step, span)
    for i, w, g, timed in zip(s.step, s.wall, s.gpu, s.timed, strict=True):
        if timed:
            span = span_ms(w, g if g == g else None)
            walls.add(w)
            spans.add(span)
            timed_spans.append((i, span))
    median_span = spans.quantile(0.5)
    return RunFigures(walls.quantile(0.5), walls.quantile(0.99),
                      [(i, span) for i, span in timed_spans if is_spike(span, median_span)])


def steps_figure(path: str, s: _Series, run: int, n_runs: int) -> Any:
    """The figure of one run's steps: times on top, memory (or the host's RSS) below."""
    Figure, Canvas, Fmt = _matplotlib()
    from matplotlib.ticker import MaxNLocator  # there, as _matplotlib() found

    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    Canvas(fig)
    ax, mem = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    title = printable(f"stepprof: {os.path.basename(path)}, {len(s.step):,} steps on {s.device or 'unknown device'}")
    if n_runs > 1:
        title += f" (run {run % n_runs + 1} of {n_runs})"
    fig.suptitle(title, fontsize=13)
    binned = len(s.step) > _MAX_POINTS
    _plot_times(ax, s, binned)
    _mark_figures(ax, s)
    for a in (ax, mem):
        _mark_steps(a, s, legend=a is ax)
    ax.set_ylabel("ms per step")
    if any(p == p for p in s.peak):
        _plot_allocator(mem, s, binned)
    elif any(r == r for r in s.rss):
        _plot_rss(mem, s)
    else:
        mem.text(0.5, 0.5, "no memory figures in this log", transform=mem.transAxes, ha="center", va="center")
        mem.set_yticks([])
    for a in (ax, mem):
        legend_above(a)  # where it covers no step
    mem.set_xlabel("step")
    # Steps are whole: a tick between two steps would be labelled with one of them. The axes
    # share the locator (matplotlib's default one's spacing, whole steps only); min_n_ticks=1
    # keeps to whole steps in a run of one step.
    mem.xaxis.set_major_locator(MaxNLocator("auto", steps=[1, 2, 5, 10], integer=True, min_n_ticks=1))
    mem.xaxis.set_major_formatter(Fmt(lambda v, _: f"{v:,.0f}"))
    return fig


def _plot_times(ax: Any, s: _Series, binned: bool) -> None:
    """The wall and GPU times per step (a bin's median, with its min-max band, when ``binned``)."""
    has_gpu = any(g == g for g in s.gpu)
    for series, color, label in (
        (s.wall, "tab:blue", "wall ms (host)"),
        (s.gpu, "tab:orange", "GPU ms (CUDA events)"),
    ):
        if series is s.gpu and not has_gpu:
            continue
        x, med, lo, hi = _binned(s.step, series)
        ax.plot(x, med, "-", color=color, lw=1.2, label=label + (" (bin median)" if binned else ""))
        if binned:
            ax.fill_between(
                x, lo, hi, color=color, alpha=0.2, lw=0, label=f"{label.split(' (')[0]}: min-max per bin"
            )


def _mark_figures(ax: Any, s: _Series) -> None:
    """The median wall time and the spikes (see :func:`run_figures`); the y axis, clipped above
    when a few huge steps would flatten the rest."""
    m, top, spikes = run_figures(s)
    if m is None:
        return
    assert top is not None
    ax.axhline(
        m, color="tab:blue", ls="--", lw=0.8, alpha=0.7, label=f"median wall {m:.2f} ms (after warm-up)"
    )
    peak_all = max((w for w in s.wall if w == w), default=m)
    ceiling = None
    if peak_all > 4 * top:  # a few huge steps would flatten the rest: clip, and say so
        ceiling = top * 1.6
        ax.set_ylim(0, ceiling)
        ax.text(
            0.01,
            0.90,
            f"y axis clipped at {ceiling:,.1f} ms: the slowest step took {peak_all:,.1f} ms",
            transform=ax.transAxes,
            ha="left",
            va="top",
            fontsize=9,
            color="tab:red",
        )
    else:
        ax.set_ylim(bottom=0)
    if spikes:  # drawn one by one: a bin's median hides them, the clip would cut them
        ys = [min(w, ceiling * 0.97) if ceiling else w for _, w in spikes]
        ax.plot(
            [i for i, _ in spikes],
            ys,
            "v",
            color="tab:red",
            ms=7,
            ls="none",
            clip_on=False,
            label=f"spikes after warm-up: {len(spikes):,} step(s) ≥ {SPIKE_FACTOR:g}x the median step",
        )


def _mark_steps(a: Any, s: _Series, *, legend: bool) -> None:
    """The warm-up span, the step whose FLOPs were counted, and the grid (labelled if ``legend``)."""
    if s.warm_until is not None:
        a.axvspan(
            s.step[0] - 0.5,
            s.warm_until + 0.5,
            color="gray",
            alpha=0.2,
            label="warm-up (left out of the figures)" if legend else None,
        )
    if s.flops_step is not None:
        a.axvline(
            s.flops_step,
            color="tab:green",
            ls=":",
            lw=1,
            label="FLOPs counted (slower step)" if legend else None,
        )
    a.grid(True, alpha=0.3)


def _plot_allocator(mem: Any, s: _Series, binned: bool) -> None:
    """Peak allocated and reserved per step (a bin's maximum when ``binned``), nvidia-smi's figure
    from the memory records, and the GPU's total."""
    for series, color, label in (
        (s.peak, "tab:purple", "peak allocated"),
        (s.reserved, "tab:gray", "reserved"),
    ):
        x, med, _, hi = _binned(s.step, series)
        mem.plot(
            x,
            [v / _GIB for v in (hi if binned else med)],
            "-",
            color=color,
            lw=1.4,
            label=f"{label} (GiB)",
        )
    nv = [(st, n) for st, n, _ in s.memory if n == n]
    if nv:
        mem.plot(
            [p[0] for p in nv],
            [p[1] / _GIB for p in nv],
            "D",
            color="tab:red",
            ms=5,
            label="nvidia-smi for this process (memory records)",
        )
    totals = [t for _, _, t in s.memory if t == t]
    if totals:
        mem.text(
            0.01, 0.04, f"GPU total {totals[-1] / _GIB:.0f} GiB", transform=mem.transAxes, fontsize=9
        )
    mem.set_ylabel("GiB")
    highest = max(
        [v / _GIB for v in list(s.peak) + list(s.reserved) if v == v] + [p[1] / _GIB for p in nv]
    )
    mem.set_ylim(0, highest * 1.15)


def _plot_rss(mem: Any, s: _Series) -> None:
    """The host's RSS per step (a bin's median), where the log has no GPU memory figures."""
    x, med, _, _ = _binned(s.step, s.rss)
    mem.plot(
        x, [v / _GIB for v in med], "-", color="tab:brown", lw=1.4, label="host RSS (GiB, whole process)"
    )
    mem.set_ylabel("GiB")
    # Room above the highest point: a flat line at the data maximum would sit on the frame.
    mem.set_ylim(0, max(v for v in s.rss if v == v) / _GIB * 1.15)


def _plot_sweep(path: str, records: list[dict[str, Any]], out: str) -> str:
    sweeps = logged_sweeps(records)
    obj = sweeps[-1].result if sweeps else None
    if obj is None:
        raise ConfigError(f"the last sweep in {path!r} has no readable sweep_result record to plot")
    return plot_sweep(obj, out)

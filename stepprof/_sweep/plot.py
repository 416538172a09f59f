"""``SweepResult.plot``: samples/s and peak memory against batch size, in one PNG.

matplotlib is imported here only, through the object API (no pyplot, so no global
figure state and no GUI backend is touched).  It is imported inside
:func:`plot_sweep` because it is an optional dependency (``stepprof[plot]``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._errors import MissingExtraError
from .._units import GiB, MiB, printable

if TYPE_CHECKING:  # pragma: no cover - for the annotation only; result.py imports this module
    from .result import SweepPoint, SweepResult

__all__ = ["plot_sweep"]


def plot_sweep(result: SweepResult, path: str | os.PathLike[str]) -> str:
    """Draw ``result`` to a PNG at ``path`` and return the path."""
    fig = sweep_figure(result)
    out = os.fspath(path)
    # Without an extension matplotlib would add ".png" to the name: write the path as given.
    fig.savefig(out, format=None if os.path.splitext(out)[1].strip(".") else "png")
    return out


def sweep_figure(result: SweepResult) -> Any:
    """The figure of ``result`` (see :func:`plot_sweep`), not yet saved."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise MissingExtraError(
            "SweepResult.plot() needs matplotlib, which is not installed. "
            "Install it with: pip install 'stepprof[plot]'  (or: pip install matplotlib)"
        ) from e

    ran = [p for p in result.points if not p.oom and p.samples_per_s is not None]
    ooms = [p for p in result.points if p.oom]
    has_memory = any(p.peak_allocated_bytes is not None for p in result.points)
    fig = Figure(figsize=(10, 7.5 if has_memory else 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    if has_memory:
        ax, mem = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    else:
        ax, mem = fig.subplots(1, 1), None
    title = printable(f"stepprof.sweep on {result.device}")  # read back from a log, it may hold anything
    if result.recommended is not None:
        title += f": recommended batch {result.recommended:,}"
    fig.suptitle(title, fontsize=13)

    sizes = [p.batch_size for p in result.points if p.batch_size > 0]  # a log axis has no 0 (a log may say 0)
    lo, hi = (min(sizes), max(sizes)) if sizes else (1, 2)
    _draw_bounds(ax, mem, result, lo, hi)
    _draw_rates(ax, result, ran, ooms)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    legend_above(ax)
    if mem is not None:
        _draw_memory(mem, ax, result, ran, ooms, lo, hi)
        legend_above(mem)
    bottom = mem if mem is not None else ax
    bottom.set_xlabel("batch size (log scale)")
    bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    return fig


def _draw_bounds(ax: Any, mem: Any, result: SweepResult, lo: int, hi: int) -> None:
    """On both axes: the log-2 batch axis, the thrash zone, ``max_fit`` and ``first_oom``
    (labelled on the rate axis ``ax`` only)."""
    zone = result.thrash_zone
    zone_name = "slower (CPU: the cores' limit)" if result.on_host else "thrash zone"
    bracketed = result.stopped == "boundary" or result.first_oom is not None
    fit_name = "max_fit" if bracketed else "largest ran"
    axes = [a for a in (ax, mem) if a is not None]
    for a in axes:
        a.set_xscale("log", base=2)
        a.grid(True, which="major", alpha=0.3)
        if zone is not None:
            a.axvspan(zone.start / 1.08, zone[-1] * 1.08, color="tab:orange", alpha=0.25,
                      label=f"{zone_name} {zone.start:,}-{zone[-1]:,}" if a is ax else None)
        if result.max_fit is not None:
            a.axvline(result.max_fit, color="tab:gray", ls="--", lw=1.2,
                      label=f"{fit_name} {result.max_fit:,}" if a is ax else None)
        if result.first_oom is not None:
            a.axvline(result.first_oom, color="tab:red", ls=":", lw=1.2,
                      label=f"first OOM {result.first_oom:,}" if a is ax else None)
        a.set_xlim(lo / 1.3, hi * 1.3)


def _draw_rates(ax: Any, result: SweepResult, ran: list[SweepPoint], ooms: list[SweepPoint]) -> None:
    """Samples/s against batch size: the curve, its p10-p90 bars, the zone, the knee and the
    recommendation, the out-of-memory batches."""
    zone = result.thrash_zone
    xs = [p.batch_size for p in ran]
    if ran:
        ax.plot(xs, [p.samples_per_s for p in ran], "o-", color="tab:blue", lw=1.8, ms=5,
                label="samples/s (median)")
    else:
        ax.text(0.5, 0.5, "no batch ran: every trial ran out of memory" if ooms else "no trial finished",
                transform=ax.transAxes, ha="center", va="center", fontsize=12, color="tab:red")
        ax.set_yticks([])
    if zone is not None:
        hot = [p for p in ran if p.batch_size in zone]
        ax.plot([p.batch_size for p in hot], [p.samples_per_s for p in hot], "o", color="tab:orange",
                ms=8, ls="none", label="slower" if result.on_host else "in the thrash zone")
    errs = [(p.batch_size, p.step_ms_p10, p.step_ms_p90) for p in ran if p.step_ms_p10 and p.step_ms_p90]
    if errs:  # p10-p90 of the step time, as a rate
        ax.vlines([n for n, _, _ in errs], [n / p90 * 1e3 for n, _, p90 in errs],
                  [n / p10 * 1e3 for n, p10, _ in errs], color="tab:blue", alpha=0.5, lw=3)
    if ran:  # (every point of ran has samples/s: the filters below repeat it for the type checker)
        best = max(p.samples_per_s for p in ran if p.samples_per_s is not None)
        ax.axhline((1 - result.knee_within) * best, color="tab:green", lw=0.8, alpha=0.6,
                   label=f"{1 - result.knee_within:.0%} of the best samples/s")
    marks = [(result.knee, "knee", "tab:green", "*"), (result.recommended, "recommended", "black", "D")]
    if result.knee == result.recommended:
        marks = [(result.knee, "knee = recommended", "tab:green", "*")]
    for n, label, color, marker in marks:
        p = result.point(n) if n is not None else None
        if p is not None and p.samples_per_s is not None:
            ax.plot([n], [p.samples_per_s], marker, color=color, ms=14 if marker == "*" else 8,
                    mfc="none" if marker == "D" else color, mew=2, ls="none", label=f"{label} {n:,}")
    if ooms:
        ax.plot([p.batch_size for p in ooms], [0] * len(ooms), "x", color="tab:red", ms=9, mew=2,
                ls="none", label="out of memory", clip_on=False)
    ax.set_ylabel("samples/s")
    top_rate = max((p.batch_size / p.step_ms_p10 * 1e3 if p.step_ms_p10 else p.samples_per_s) for p in ran
                   if p.samples_per_s is not None) if ran else 1.0
    ax.set_ylim(0, top_rate * 1.12)


def _draw_memory(
    mem: Any, ax: Any, result: SweepResult, ran: list[SweepPoint], ooms: list[SweepPoint], lo: int, hi: int
) -> None:
    """Peak memory against batch size: the peaks, those held at out of memory, the fit's line,
    the allocator's capacity and ``predicted_max`` (which widens both axes)."""
    with_peak = [(p.batch_size, p.peak_allocated_bytes) for p in ran if p.peak_allocated_bytes is not None]
    if with_peak:
        mem.plot([n for n, _ in with_peak], [peak / GiB for _, peak in with_peak],
                 "s-", color="tab:purple", ms=4, label="peak allocated (GiB)")
    oom_peaks = [(p.batch_size, p.peak_allocated_bytes) for p in ooms if p.peak_allocated_bytes is not None]
    if oom_peaks:
        mem.plot([n for n, _ in oom_peaks], [peak / GiB for _, peak in oom_peaks],
                 "x", color="tab:red", ms=8, mew=2, ls="none", label="held when out of memory")
    if result.fit_bytes_per_sample and result.fit_base_bytes is not None:
        top = max(hi, result.predicted_max or hi)
        line_x = [lo * (top / lo) ** (i / 100) for i in range(101)]  # straight in n, curved on log x
        mem.plot(line_x, [(result.fit_base_bytes + result.fit_bytes_per_sample * x) / GiB for x in line_x],
                 "--", color="tab:purple", lw=1, alpha=0.6,
                 label=f"fit: {result.fit_base_bytes / GiB:.2f} GiB + "
                       f"{result.fit_bytes_per_sample / MiB:.2f} MiB x batch")
    if result.capacity_bytes is not None:
        mem.axhline(result.capacity_bytes / GiB, color="tab:red", lw=1, alpha=0.7,
                    label=f"usable by the allocator: {result.capacity_bytes / GiB:.1f} GiB")
    if result.predicted_max is not None:
        mem.axvline(result.predicted_max, color="tab:purple", ls="-.", lw=1,
                    label=f"predicted_max {result.predicted_max:,}")
        mem.set_xlim(lo / 1.3, max(hi, result.predicted_max) * 1.3)
        ax.set_xlim(lo / 1.3, max(hi, result.predicted_max) * 1.3)
    mem.set_ylabel("peak memory (GiB)")
    mem.set_ylim(bottom=0)


def legend_above(a: Any) -> None:
    """``a``'s legend in rows above its data area, where it covers nothing drawn; the figure's
    constrained layout makes room for it. The steps plot's too (stepprof/_plot.py)."""
    n = len(a.get_legend_handles_labels()[0])
    if n:
        a.legend(loc="lower left", bbox_to_anchor=(0, 1.01, 1, 0), mode="expand", ncols=min(n, 3),
                 borderaxespad=0, fontsize=9, frameon=False)

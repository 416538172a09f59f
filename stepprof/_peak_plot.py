"""``stepprof plot --peak``: the explained step's peak by category and module, and its memory timeline."""

from __future__ import annotations

import os
from typing import Any

from ._errors import ConfigError
from ._log import read
from ._plot import _matplotlib
from ._peak_record import peak_line
from ._units import GiB, printable

__all__ = ["plot_peak"]

_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868",
           "activations": "#c44e52", "temporaries": "#8172b3", "other": "#937860"}
_TOP = 10


def _last_peak(path: str) -> dict[str, Any]:
    found = None
    for r in read(path, kind="peak"):
        if isinstance(r.get("bytes_by_category"), dict):
            found = r
    if found is None:
        raise ConfigError(
            f"{path!r} has no explained peak (no kind: 'peak' record with figures); run with "
            f"stepprof.Profiler(..., explain_peak=True, model=model, optimizer=optimizer) on a GPU"
        )
    return found


def plot_peak(path: str, out: str) -> str:
    """Draw the log's last ``kind: "peak"`` record to the PNG ``out``; return its path.

    The record is as :func:`stepprof.read` gives it (a field of the wrong type is null); names
    from it are drawn through :func:`~stepprof._units.printable`.
    """
    fig = peak_figure(_last_peak(os.fspath(path)))
    fig.savefig(out, dpi=110)
    return os.fspath(out)


def peak_figure(rec: dict[str, Any]) -> Any:
    """The figure of one ``kind: "peak"`` record (see :func:`plot_peak`), not yet saved."""
    Figure, FigureCanvasAgg, _ = _matplotlib()
    cats: dict[str, Any] = rec["bytes_by_category"]
    # The constrained layout makes room for the category legend under the bar, above the timeline.
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, width_ratios=(1, 3), height_ratios=(3, 2))
    bar, mods, line = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    bottom = 0.0
    for c in _ORDER:
        v = cats.get(c) or 0
        if v:
            bar.bar(0, v / GiB, bottom=bottom, color=_COLORS[c], label=f"{c} {v / GiB:.2f} GiB")
            bottom += v / GiB
    bar.set_xticks([])
    bar.set_ylabel("GiB live at the peak")
    bar.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02))
    modules = [m for m in rec.get("modules") or () if isinstance(m, dict)][:_TOP][::-1]
    left = [0.0] * len(modules)
    for c in _ORDER:
        values = [((m.get("bytes_by_category") or {}).get(c) or 0) / GiB for m in modules]
        if any(values):
            mods.barh(range(len(modules)), values, left=left, color=_COLORS[c])
            left = [a + b for a, b in zip(left, values)]
    mods.set_yticks(range(len(modules)), [printable(str(m.get("module")))[:40] for m in modules], fontsize=8)
    mods.set_xlabel("GiB live at the peak, by the module that made it")
    if not modules:
        why = (rec.get("unavailable") or {}).get("modules") or "no module"
        mods.text(0.5, 0.5, printable(why), ha="center", va="center", fontsize=8, transform=mods.transAxes, wrap=True)
    points = [(t, b) for t, b in zip(rec.get("timeline_ms") or (), rec.get("timeline_bytes") or ())
              if t is not None and b is not None]  # a log may hold lists of unequal lengths
    line.plot([t for t, _ in points], [b / GiB for _, b in points], color="#333333", drawstyle="steps-post")
    at = rec.get("peak_at_ms")
    if at is not None:
        line.axvline(at, color="#c44e52", linestyle="--")
        label = f"peak at {at:.1f} ms" + (f" ({printable(rec['phase'])})" if rec.get("phase") else "")
        line.annotate(label, (at, max((b for _, b in points), default=0) / GiB), fontsize=8, color="#c44e52")
    line.set_xlabel(f"ms since the entry of step {rec.get('step')}")
    line.set_ylabel("GiB allocated")
    fig.suptitle(peak_line(rec), fontsize=8, wrap=True)
    return fig

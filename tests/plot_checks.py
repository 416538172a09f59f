"""Checks on a drawn matplotlib figure's artists, for the plot tests: where its legends sit, and
whether its tick labels name the ticks they sit on."""

from __future__ import annotations

from typing import Any

import numpy as np


def drawn(fig: Any) -> Any:
    """``fig``, drawn: the legends' and the ticks' places are known only then."""
    fig.canvas.draw()
    return fig


def legends(fig: Any) -> list[Any]:
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)


def _display_points(ax: Any) -> np.ndarray:
    """Every drawn point of ``ax``'s lines and markers, in display coordinates, with each line's
    segments sampled every few pixels (a legend over a segment covers it as much as over a point)."""
    from matplotlib.collections import LineCollection, PathCollection

    drawn = [(line.get_xydata(), line.get_transform(), line.get_linestyle() not in ("None", "none", "", " "),
              line.get_clip_on()) for line in ax.get_lines() if line.get_visible()]
    for coll in ax.collections:  # scatter's markers, vlines' lines (a band's or a span's shading is left out)
        if isinstance(coll, PathCollection):
            drawn.append((coll.get_offsets(), coll.get_offset_transform(), False, coll.get_clip_on()))
        elif isinstance(coll, LineCollection):
            drawn += [(seg, coll.get_transform(), True, coll.get_clip_on()) for seg in coll.get_segments()]
    out = [np.empty((0, 2))]
    for data, transform, joined, clipped in drawn:
        xy = transform.transform(np.asarray(data, dtype=float).reshape(-1, 2))
        xy = xy[np.isfinite(xy).all(axis=1)]
        if joined and len(xy) > 1:
            t = np.linspace(0, 1, 64)[:, None, None]
            xy = (xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2)
        if clipped:  # what the axes clip is not drawn
            xy = xy[_within(xy, ax.bbox.padded(1))]
        out.append(xy)
    return np.concatenate(out)


def _within(xy: np.ndarray, box: Any) -> np.ndarray:
    return (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)


def legend_clashes(fig: Any) -> list[str]:
    """What each legend of the drawn ``fig`` overlaps: a plotted point of any axes, any axes' data
    area, the figure's title, another legend; or the figure's edge, where it is cut off."""
    clashes = []
    boxes = [(leg, leg.get_window_extent()) for leg in legends(fig)]
    for n, (leg, box) in enumerate(boxes):
        name = f"legend {n} ({leg.get_texts()[0].get_text()!r}...)"
        if not fig.bbox.padded(1).contains(box.x0, box.y0) or not fig.bbox.padded(1).contains(box.x1, box.y1):
            clashes.append(f"{name} is cut off by the figure's edge: {box} not in {fig.bbox}")
        for i, ax in enumerate(fig.axes):
            covered = (xy := _display_points(ax))[_within(xy, box)]
            if len(covered):
                x, y = ax.transData.inverted().transform(covered[0])
                clashes.append(f"{name} covers {len(covered)} plotted point(s) of axes {i}, one at ({x:.1f}, {y:.1f})")
            if box.overlaps(ax.bbox):
                clashes.append(f"{name} overlaps the data area of axes {i}")
            for axis in (ax.xaxis, ax.yaxis):
                labels = axis.get_tightbbox()  # its tick labels and its label, as drawn
                if labels is not None and labels.width and box.overlaps(labels):
                    clashes.append(f"{name} overlaps the {axis.axis_name} tick labels of axes {i}")
        title = fig._suptitle
        if title is not None and box.overlaps(title.get_window_extent()):
            clashes.append(f"{name} overlaps the title")
        clashes += [f"{name} overlaps legend {m}" for m, (_, other) in enumerate(boxes) if m > n and box.overlaps(other)]
    return clashes


def off_integer_ticks(axis: Any) -> list[tuple[float, str]]:
    """The (location, label) of each major tick in ``axis``'s view that is not on a whole number,
    or whose label (thousands separators aside) is not that number."""
    lo, hi = sorted(axis.get_view_interval())
    wrong = []
    axis.get_majorticklabels()  # labels the ticks of the current locations
    locs = axis.get_majorticklocs()
    for loc, tick in zip(locs, axis.get_major_ticks(len(locs)), strict=True):
        loc, text = float(loc), tick.label1.get_text()
        if not lo <= loc <= hi:
            continue
        if not loc.is_integer() or text.replace(",", "").replace("\N{MINUS SIGN}", "-") != str(int(loc)):
            wrong.append((loc, text))
    return wrong

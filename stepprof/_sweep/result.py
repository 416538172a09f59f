"""The sweep's records: one :class:`SweepPoint` per batch size tried, and the
:class:`SweepResult` that :func:`stepprof.sweep` returns and logs."""

from __future__ import annotations

import os
from typing import Any

import attrs

from .._units import format_bytes, format_count, printable

__all__ = ["SweepPoint", "SweepResult"]


@attrs.frozen
class SweepPoint:
    """One batch size tried by :func:`stepprof.sweep`; logged as ``kind: "sweep_point"``.

    Timing figures cover the timed steps only (after ``warmup_steps``); ``step_ms``
    is their median, from CUDA events on a GPU and ``perf_counter`` on the CPU.
    ``peak_allocated_bytes`` covers the whole trial (the batch, warm-up and timed
    steps).  ``alloc_retries`` and ``device_allocs`` count allocator events during
    the timed steps, where a steady training loop makes none.  On an out-of-memory
    error ``oom`` is True, the timing figures are None, ``error`` holds the message
    and ``leaked_bytes`` the bytes still allocated after the clean-up beyond the
    pre-trial baseline (0 means it all came back).
    """

    trial: int
    phase: str
    batch_size: int
    oom: bool
    samples_per_s: float | None
    step_ms: float | None
    step_ms_p10: float | None
    step_ms_p90: float | None
    timed_steps: int
    warmup_steps: int
    peak_allocated_bytes: int | None
    alloc_retries: int | None
    device_allocs: int | None
    leaked_bytes: int | None
    error: str | None
    wall_s: float
    unavailable: dict[str, str] = attrs.field(factory=dict)

    def to_record(self) -> dict[str, Any]:
        """The JSON-lines form (without ``schema_version``, which the writer adds)."""
        return {"kind": "sweep_point", **attrs.asdict(self)}

    def __str__(self) -> str:
        if self.oom:
            leak = "" if not self.leaked_bytes else f", {format_bytes(self.leaked_bytes)} not freed"
            return f"batch {self.batch_size:,}: out of memory{leak}"
        parts = []
        if self.samples_per_s is not None and self.step_ms is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s, {self.step_ms:.3f} ms/step")
        if self.peak_allocated_bytes is not None:
            parts.append(f"peak {format_bytes(self.peak_allocated_bytes)}")
        if self.alloc_retries:
            parts.append(f"{self.alloc_retries} alloc retries")
        return f"batch {self.batch_size:,}: " + ", ".join(parts)


def _range_str(r: range | None) -> str:
    return "none" if r is None else f"{r.start:,}-{r[-1]:,}"


@attrs.frozen
class SweepResult:
    """What :func:`stepprof.sweep` returns; logged as ``kind: "sweep_result"``.

    ``points`` are sorted by batch size.  ``knee`` is the smallest batch within
    ``knee_within`` (10%) of the best samples/s of every batch that ran;
    ``recommended`` is the same rule applied outside the thrash zone, and
    ``reason`` says why in one sentence.  ``max_fit`` is the largest batch that
    ran and ``first_oom`` the smallest that ran out of memory; ``stopped`` says
    how the search ended (``"boundary"`` means ``max_fit`` is within 3% of the
    largest batch that fits).  ``thrash_zone`` is a ``range`` of batch sizes
    (``n in result.thrash_zone`` works), or None.

    Example:
        >>> import stepprof, torch
        >>> model = torch.nn.Linear(16, 4)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
        >>> def train_step(x):
        ...     model(x).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
        >>> result = stepprof.sweep(train_step, lambda n: torch.randn(n, 16), max_batch=8,
        ...                         restore=(model, opt), progress=False, min_time_s=0)
        >>> result.max_fit, result.first_oom, result.stopped
        (8, None, 'max_batch')
        >>> result.recommended in [p.batch_size for p in result.points]
        True
    """

    points: tuple[SweepPoint, ...]
    knee: int | None
    max_fit: int | None
    first_oom: int | None
    predicted_max: int | None
    thrash_zone: range | None
    recommended: int | None
    reason: str
    stopped: str
    device: str
    trials: int
    wall_s: float
    capacity_bytes: int | None
    fit_base_bytes: float | None
    fit_bytes_per_sample: float | None
    knee_within: float
    notes: tuple[str, ...] = ()
    unavailable: dict[str, str] = attrs.field(factory=dict)

    @property
    def on_host(self) -> bool:
        """The sweep ran on the CPU: no allocator limit, so its slower batches are no thrash."""
        return self.device == "cpu"

    def point(self, batch_size: int) -> SweepPoint | None:
        """The point measured at ``batch_size``, or None if it was not tried."""
        for p in self.points:
            if p.batch_size == batch_size:
                return p
        return None

    def to_record(self) -> dict[str, Any]:
        """The JSON-lines form; points are logged apart, as ``sweep_point`` records."""
        d = attrs.asdict(self, recurse=False, filter=lambda a, v: a.name != "points")
        z = self.thrash_zone
        d["thrash_zone"] = None if z is None else [z.start, z[-1]]
        d["notes"] = list(self.notes)
        return {"kind": "sweep_result", **d}

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Draw samples/s and peak memory against batch size to a PNG at ``path``.

        The knee, ``max_fit``, out-of-memory trials and the thrash zone are marked.
        Needs matplotlib (``pip install 'stepprof[plot]'``).

        Returns:
            The path written.
        """
        from .plot import plot_sweep  # the view, loaded when drawn (tests/test_layers.py allows it)

        return plot_sweep(self, path)

    def __str__(self) -> str:
        lines = [
            (
                f"stepprof.sweep on {self.device}: {self.trials} trials in {self.wall_s:.1f} s "
                f"(search stopped: {self.stopped})"
            ),
            (
                f"{'batch':>9} {'samples/s':>12} {'ms/step':>10} {'p10-p90 ms':>17} "
                f"{'peak alloc':>11} {'retries':>7}"
            ),
        ]
        zone = self.thrash_zone
        host = self.on_host
        zone_mark = "slower" if host else "thrash"
        # max_fit is the largest batch that fits only when the search bracketed the boundary.
        fit_mark = "max_fit" if self.stopped == "boundary" or self.first_oom is not None else "largest ran"
        for p in self.points:
            marks = []
            if p.batch_size == self.recommended:
                marks.append("recommended")
            if p.batch_size == self.knee and self.knee != self.recommended:
                marks.append("knee")
            if p.batch_size == self.max_fit:
                marks.append(fit_mark)
            if zone is not None and p.batch_size in zone:
                marks.append(zone_mark)
            if p.oom:
                marks.append("OOM" + (f", {format_bytes(p.leaked_bytes)} not freed" if p.leaked_bytes else ""))
            sps = "-" if p.samples_per_s is None else f"{p.samples_per_s:,.0f}"
            ms = "-" if p.step_ms is None else f"{p.step_ms:.3f}"
            spread = (
                "-" if p.step_ms_p10 is None or p.step_ms_p90 is None
                else f"{p.step_ms_p10:.3f}-{p.step_ms_p90:.3f}"
            )
            peak = "-" if p.peak_allocated_bytes is None else format_bytes(p.peak_allocated_bytes)
            retries = "-" if p.alloc_retries is None else str(p.alloc_retries)
            lines.append(
                f"{p.batch_size:>9,} {sps:>12} {ms:>10} {spread:>17} {peak:>11} {retries:>7}  "
                + ", ".join(marks)
            )
        if host:  # no allocator: no memory boundary, no prediction, no thrash
            lines.append(
                f"knee {format_count(self.knee)} | {fit_mark} {format_count(self.max_fit)} | "
                f"slower from {format_count(zone.start if zone is not None else None)} "
                f"(CPU: no memory limit searched)"
            )
        else:
            lines.append(
                f"knee {format_count(self.knee)} | {fit_mark} {format_count(self.max_fit)} | "
                f"first_oom {format_count(self.first_oom)} | predicted_max {format_count(self.predicted_max)} | "
                f"thrash zone {_range_str(zone)}"
            )
        lines.append(f"recommended {format_count(self.recommended)}: {self.reason}")
        lines.extend(f"note: {n}" for n in self.notes)
        # A result read back from a log may hold anything: each value stays on its line, escaped.
        return "\n".join(map(printable, lines))

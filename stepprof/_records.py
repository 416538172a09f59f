"""Frozen result records and the small statistics behind them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ._schema import summary_record
from ._stats import quantile
from ._units import format_bytes

#: What the compiled boundary saves per step against the Python one, in µs: the step record
#: on the launch-bound step of bench/overhead.py on an H200, `step-python` less `step`
#: (docs/benchmarks.md).
COMPILED_SAVES_US = 78.0

__all__ = ["Percentiles", "PhaseFigures", "Summary"]


#: How a summary's ``boundary`` reads in a sentence ("compiled" is stepprof's own, not torch.compile).
BOUNDARY_NAMES = {"compiled": "C", "python": "Python"}


def boundary_name(boundary: str | None) -> str:
    """``boundary`` as the summary, the report and the demo print it (None, in a log written
    before the CPU had a step core: the host's)."""
    return BOUNDARY_NAMES.get(boundary, boundary) if boundary is not None else "host"


#: What the compiled boundaries (the step core, stepprof/_core.c) save a step record on the
#: host, in µs: bench/floor.py's ``python`` less ``step`` on the 2-core CPU (docs/benchmarks.md).
CORE_SAVES_CPU_US = 2.3


def python_boundary_line(why: str | None, device: str | None = None) -> str:
    """The summary's and the report's line for a run on the Python boundary (``why``: the
    reason the compiled one was not used, when known; ``device``: the run's)."""
    saves = COMPILED_SAVES_US if device is None or device.startswith("cuda") else CORE_SAVES_CPU_US
    where = "an H200's launch-bound step" if saves is COMPILED_SAVES_US else "a near-empty step on a 2-core CPU"
    cost = f"about {saves:.0f} µs less per step on {where} (docs/benchmarks.md)"
    if why:
        return f"the Python boundary ran ({why}); the compiled one costs {cost}"
    return f"the Python boundary ran; `stepprof build` compiles the C one, {cost}"


@attrs.frozen
class Percentiles:
    """Median and spread of one figure over the measured steps (``Summary.wall_ms``, ``gpu_ms``).

    Attributes:
        median: the 50th percentile.
        p10, p90: the 10th and 90th percentiles, linearly interpolated between steps.

    Example:
        >>> from stepprof import Percentiles
        >>> print(Percentiles.of([1.0, 2.0, 3.0, 4.0]))
        2.500 [p10 1.300, p90 3.700]
    """

    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> Percentiles | None:
        """The percentiles of ``xs``, or None when it is empty."""
        if not xs:
            return None
        s = sorted(xs)
        return cls(median=quantile(s, 0.5), p10=quantile(s, 0.1), p90=quantile(s, 0.9))

    def __str__(self) -> str:
        return f"{self.median:.3f} [p10 {self.p10:.3f}, p90 {self.p90:.3f}]"


@attrs.frozen
class PhaseFigures:
    """One phase name's figures over a run's measured steps (``Summary.phases``).

    The same figures as the phase table of ``stepprof report``.  A figure that no step
    had (``gpu_ms`` without CUDA, say) is None; ``Summary.unavailable`` says why under
    ``phases.<field>``.

    Attributes:
        steps: measured steps in which the phase ran.
        runs_per_step: times it ran, per such step (its ``count``, on average).
        wall_ms_median, wall_ms_p90: of its per-step ``wall_ms`` (summed over its runs).
        gpu_ms_median, gpu_ms_p90: of its per-step ``gpu_ms``, over the steps that have one.
        peak_allocated_bytes_max: its largest ``peak_allocated_bytes``.
        syncs_per_step: its syncs, per step that counted them.
    """

    steps: int
    runs_per_step: float | None
    wall_ms_median: float | None
    wall_ms_p90: float | None
    gpu_ms_median: float | None
    gpu_ms_p90: float | None
    peak_allocated_bytes_max: int | None
    syncs_per_step: float | None


@attrs.frozen
class Summary:
    """What :meth:`stepprof.Profiler.close` returns and logs as ``kind: "summary"``.

    Figures are over the *timed* steps (``timed_steps``): the measured steps (past warm-up and
    without an error) but the one whose FLOPs were counted (it ran under ``FlopCounterMode``),
    the one ``explain_peak`` explained and those that compiled (``compile_steps``).  A
    figure that could not be measured is None, and ``unavailable`` says why.
    ``phases`` holds each phase's figures, by name, in the order they first finished.
    ``run_id`` is the profiler's id, which every record of its log carries.

    Example:
        >>> import stepprof
        >>> with stepprof.Profiler(None, warmup=1) as prof:
        ...     for _ in range(3):
        ...         with prof.step(batch_size=4):
        ...             pass
        >>> prof.summary.steps, prof.summary.warmup_steps, prof.summary.measured_steps
        (3, 1, 2)
    """

    steps: int
    warmup_steps: int
    error_steps: int
    measured_steps: int
    device: str
    wall_ms: Percentiles | None
    gpu_ms: Percentiles | None
    gpu_busy_median: float | None
    peak_allocated_bytes_max: int | None
    samples_per_s_median: float | None
    overhead_us_median: float | None
    log: str | None
    syncs_per_step_median: float | None = None
    sync_mechanism: str | None = None
    #: Waits on a thread with no open step while the profiler watched syncs (from its first
    #: step to its close), counted against no step.  None when syncs were not counted
    #: throughout (``unavailable`` says why).
    syncs_outside_steps: int | None = None
    tflops_per_s_median: float | None = None
    mfu_median: float | None = None
    #: The median step's FLOPs at the GPU's published dense peak for their dtypes (the MFU
    #: papers report), over its time; ``mfu_median`` is at the rate this GPU was measured at.
    mfu_datasheet_median: float | None = None
    #: The median step's tokens (given, or counted in its batch) over its span, when any step had them.
    tokens_per_s_median: float | None = None
    unavailable: dict[str, str] = attrs.field(factory=dict)
    phases: dict[str, PhaseFigures] = attrs.field(factory=dict)
    #: How the run ended: ``"close"``, ``"exception"`` (the ``with Profiler`` block raised),
    #: ``"exit"`` (still open at interpreter exit), ``"SIGTERM"`` or ``"SIGINT"``.
    ended_by: str | None = None
    #: The id of the run, on every record it wrote (``run_id``).
    run_id: str | None = None
    #: stepprof's cost per measured step, the mean of ``overhead_us`` (under
    #: ``overhead_budget`` the median is a light step's; the mean covers the full ones).
    overhead_us_mean: float | None = None
    #: Timed steps with GPU figures: all of them without ``overhead_budget`` (on CUDA; but a
    #: step the CUDA events missed), the sampled ones under it.
    gpu_steps: int | None = None
    #: Which boundary did the device work on CUDA: ``"compiled"`` or ``"python"`` (None: no CUDA).
    boundary: str | None = None
    #: Median host time before a step since the previous step's exit (``data_wait_ms``).
    data_wait_ms_median: float | None = None
    #: The share of the loop's time (data wait + step wall time) spent waiting before steps.
    input_wait_fraction: float | None = None
    #: Energy (NVML, CUDA only): the mean ``energy_j`` of the measured steps that have one,
    #: their joules over their spans' seconds, and their samples per joule.
    energy_j_per_step: float | None = None
    power_w_mean: float | None = None
    samples_per_j: float | None = None
    #: Measured steps in which torch.compile compiled (left out of the figures, like warm-up
    #: steps); None when no step of the run saw compilation.
    compile_steps: int | None = None
    #: The measured steps the figures are taken over: all but the FLOP-counted step and those
    #: explained or compiled (None in a summary read from a log that predates the field).
    timed_steps: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The JSON-lines form (without ``schema_version``, which the writer adds).

        ``wall_ms`` and ``gpu_ms`` are written as ``wall_ms_percentiles`` and
        ``gpu_ms_percentiles`` (docs/reference/schema.md).
        """
        return summary_record(self)

    def __str__(self) -> str:
        parts = [f"{self.measured_steps} measured steps ({self.warmup_steps} warm-up"]
        parts[0] += f", {self.error_steps} failed)" if self.error_steps else ")"
        parts.append(f"on {self.device}")
        if self.wall_ms is not None:
            parts.append(f"wall {self.wall_ms.median:.2f} ms")
        if self.gpu_ms is not None:
            parts.append(f"gpu {self.gpu_ms.median:.2f} ms")
        if self.gpu_busy_median is not None:
            parts.append(f"busy {self.gpu_busy_median:.0%}")
        if self.peak_allocated_bytes_max is not None:
            parts.append(f"peak {format_bytes(self.peak_allocated_bytes_max)}")
        if self.samples_per_s_median is not None:
            parts.append(f"{self.samples_per_s_median:,.0f} samples/s")
        if self.tokens_per_s_median is not None:
            parts.append(f"{self.tokens_per_s_median:,.0f} tokens/s")
        if self.syncs_per_step_median:
            parts.append(f"{self.syncs_per_step_median:g} syncs/step")
        if self.syncs_outside_steps:
            parts.append(f"{self.syncs_outside_steps} syncs outside steps")
        if self.tflops_per_s_median is not None:
            t = self.tflops_per_s_median  # a CPU's is well below 0.1: keep its digits
            parts.append(f"{t:.1f} TFLOP/s" if t >= 10 else f"{t:.3g} TFLOP/s")
        if self.mfu_median is not None:
            parts.append(f"MFU {self.mfu_median:.0%}")
        if self.mfu_datasheet_median is not None:
            parts.append(f"MFU {self.mfu_datasheet_median:.0%} of datasheet")
        if self.input_wait_fraction is not None and self.input_wait_fraction >= 0.05:
            parts.append(f"input wait {self.input_wait_fraction:.0%} of the loop")
        if self.energy_j_per_step is not None and self.power_w_mean is not None:
            parts.append(f"{self.energy_j_per_step:.3g} J/step ({self.power_w_mean:.0f} W)")
        if self.compile_steps:
            parts.append(f"{self.compile_steps} steps that compiled left out")
        timed = self.timed_steps
        if self.gpu_steps and timed is not None and self.gpu_steps < timed:
            parts.append(f"GPU figures on {self.gpu_steps} of {timed} timed steps")
        if self.overhead_us_mean is not None:
            parts.append(f"stepprof {self.overhead_us_mean:.0f} µs/step ({boundary_name(self.boundary)} boundary)")
        text = "stepprof: " + ", ".join(parts)
        if self.boundary == "python":
            text += "\nstepprof: " + python_boundary_line(self.unavailable.get("boundary"), self.device)
        return text

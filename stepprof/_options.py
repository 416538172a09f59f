"""The settings of a profiler, their defaults and their checks, written once.

:class:`stepprof.Profiler` builds a :class:`ProfilerOptions` from its arguments, and
:func:`stepprof.configure` passes its options through the same class, so both
take the same names with the same defaults and the same error messages.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._dist import RANKS_EVERY, check_log_ranks, check_ranks_every
from ._validate import (
    ENERGY_EVERY_S,
    FLUSH_EVERY_S,
    MEMORY_EVERY,
    PHASE_PEAKS_EVERY,
    check_boundary,
    check_device,
    check_energy_every_s,
    check_explain_peak,
    check_flops,
    check_flush_every_s,
    check_log,
    check_max_syncs,
    check_memory_every,
    check_model,
    check_nvtx,
    check_on_sync,
    check_optimizer,
    check_overhead_budget,
    check_phase_peaks_every,
    check_syncs,
    check_warmup,
)

__all__ = ["ENERGY_EVERY_S", "FLUSH_EVERY_S", "NAMES", "CaptureSettings", "ProfilerOptions", "SyncSettings"]


def _flops_mode(flops: Any) -> str | None:
    return check_flops(flops, None)[0]


def _flops_given(flops_per_step: Any) -> float | None:
    return check_flops(None, flops_per_step)[1]


def _one_source_of_flops(options: ProfilerOptions, _: attrs.Attribute[Any], flops_per_step: Any) -> None:
    check_flops(options.flops, flops_per_step)


@attrs.frozen
class ProfilerOptions:
    """The 21 settings of :class:`stepprof.Profiler` (documented there), checked.

    Each value is converted as the profiler uses it (``device`` to a
    ``torch.device``, ``log`` to a str, ``flops_per_step`` to a float); a bad one
    raises :class:`stepprof.ConfigError` naming it.  ``group`` is checked by the
    profiler, since whether this rank belongs to it depends on the run.
    """

    log: str | None = attrs.field(default=None, converter=check_log)
    warmup: int = attrs.field(default=0, converter=check_warmup)
    device: Any = attrs.field(default=None, converter=check_device)  # a torch.device or None
    nvtx: bool = attrs.field(default=True, converter=check_nvtx)
    syncs: str = attrs.field(default="warn", converter=check_syncs)
    max_syncs: int | None = attrs.field(default=None, converter=check_max_syncs)
    on_sync: str = attrs.field(default="count", converter=check_on_sync)
    memory_every: int = attrs.field(default=MEMORY_EVERY, converter=check_memory_every)
    phase_peaks_every: int = attrs.field(default=PHASE_PEAKS_EVERY, converter=check_phase_peaks_every)
    flops: str | None = attrs.field(default=None, converter=_flops_mode)
    flops_per_step: float | None = attrs.field(
        default=None, converter=_flops_given, validator=_one_source_of_flops
    )
    ranks_every: int = attrs.field(default=RANKS_EVERY, converter=check_ranks_every)
    log_ranks: str = attrs.field(default="all", converter=check_log_ranks)
    group: Any = None
    flush_every_s: float = attrs.field(default=FLUSH_EVERY_S, converter=check_flush_every_s)
    boundary: str = attrs.field(default="auto", converter=check_boundary)
    overhead_budget: float | None = attrs.field(default=None, converter=check_overhead_budget)
    energy_every_s: float | None = attrs.field(default=ENERGY_EVERY_S, converter=check_energy_every_s)
    explain_peak: bool | int = attrs.field(default=False, converter=check_explain_peak)
    model: Any = attrs.field(default=None, converter=check_model)
    optimizer: Any = attrs.field(default=None, converter=check_optimizer)


    @property
    def capture(self) -> CaptureSettings:
        """The settings of what each step boundary measures, grouped."""
        return CaptureSettings(self.device, self.nvtx, self.boundary, self.warmup, self.phase_peaks_every)

    @property
    def sync(self) -> SyncSettings:
        """The settings of sync counting, grouped."""
        return SyncSettings(self.syncs, self.max_syncs, self.on_sync)


@attrs.frozen
class CaptureSettings:
    """What each step boundary measures: :class:`ProfilerOptions`' fields of the same names, checked."""

    device: Any  # a torch.device, or None: CUDA once the training code initialised it
    nvtx: bool
    boundary: str
    warmup: int
    phase_peaks_every: int


@attrs.frozen
class SyncSettings:
    """How a step's syncs are counted (``syncs``, as ``mode``) and budgeted (``max_syncs``, ``on_sync``)."""

    mode: str
    max_syncs: int | None
    on_sync: str


#: The settings' names, in :class:`stepprof.Profiler`'s order.
NAMES = tuple(field.name for field in attrs.fields(ProfilerOptions))


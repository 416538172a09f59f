"""Reconcile what PyTorch holds with what nvidia-smi shows, and say the difference in words.

Four figures describe a process's GPU memory, each a superset of the one before:

- *allocated*: live tensors;
- *peak allocated*: the high-water mark of live tensors;
- *reserved*: what torch's caching allocator holds from the driver (live tensors
  plus cached blocks kept for reuse);
- *NVML's process figure* (nvidia-smi): reserved, plus the CUDA context, plus
  whatever was allocated outside torch's allocator (NCCL buffers, library
  handles, lazily loaded kernels, other libraries' ``cudaMalloc``).

So ``residual = process - reserved`` is the part outside PyTorch.  When NVML
cannot attribute memory to this process (in a container it reports host PIDs),
the device-wide figure from ``cudaMemGetInfo`` stands in, on the assumption that
no other process uses the GPU, and ``basis`` says so.

The reconciliation itself (:func:`reconcile`) is pure: it takes a
:class:`Snapshot` of readings and returns a :class:`MemoryReport`.  The
readings come from a backend (:mod:`stepprof._device.cuda`) and :mod:`stepprof._device.nvml`,
so tests drive every case on a CPU with fakes.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs

from ._errors import raised_by_user
from ._device import nvml as _nvml
from ._device.backend import AllocatorFigures, Backend
from ._device.nvml import NvmlReading
from ._registry import MEMORY_MARKS
from ._units import GiB, MiB, format_bytes_in, unit_for

__all__ = ["MemoryReport", "Snapshot", "reconcile", "report", "take_snapshot"]


PROCESS_BASIS = "process"
DEVICE_BASIS = "device (assumes exclusive GPU)"

#: The triggers of a memory record.
AFTER_WARMUP, PERIODIC, CLOSE, ON_DEMAND = "after_warmup", "periodic", "close", "on_demand"

#: The residual must grow at least this much past the reference record for the
#: "memory outside PyTorch is growing" note.  Kernels loaded lazily by a new code
#: path and new library handles add tens of MiB; 256 MiB is well above that.
GROWTH_NOTE_BYTES = 256 * MiB
#: "Reserved much larger than the peak": the gap must be at least this share of
#: reserved, and at least FRAGMENTATION_NOTE_MIN_BYTES.
FRAGMENTATION_NOTE_FRACTION = 0.25
FRAGMENTATION_NOTE_MIN_BYTES = 256 * MiB

_ALLOCATOR_FIELDS = (
    "allocated_bytes", "peak_allocated_bytes", "reserved_bytes", "fragmentation_bytes",
    "inactive_split_bytes", "num_ooms", "num_alloc_retries",
)
_FIGURE_FIELDS = _ALLOCATOR_FIELDS + (
    "nvml_process_bytes", "nvml_device_used_bytes", "mem_get_info_used_bytes", "total_bytes",
    "residual_bytes", "context_baseline_bytes", "basis", "power_limit_w", "other_processes",
)


@attrs.frozen
class MemoryReport:
    """One reconciliation of this process's GPU memory: what :func:`stepprof.memory_report`
    returns and a log's ``kind: "memory"`` record holds.

    Every figure is in bytes; one that could not be measured is None, and
    ``unavailable`` says why.  ``explanation`` says in one paragraph why
    nvidia-smi shows more than PyTorch does; ``notes`` flag what needs action.

    Example:
        >>> import stepprof
        >>> report = stepprof.memory_report("cpu")
        >>> report.residual_bytes is None, report.unavailable["residual_bytes"]
        (True, "device 'cpu' has no CUDA memory")
    """

    #: Why it was taken: "after_warmup", "periodic", "close" or "on_demand".
    trigger: str
    #: The latest step begun before it was taken (within the profiler), or None.
    step: int | None
    device: str
    unix_s: float
    allocated_bytes: int | None
    peak_allocated_bytes: int | None
    reserved_bytes: int | None
    fragmentation_bytes: int | None
    inactive_split_bytes: int | None
    nvml_process_bytes: int | None
    nvml_device_used_bytes: int | None
    mem_get_info_used_bytes: int | None
    total_bytes: int | None
    residual_bytes: int | None
    context_baseline_bytes: int | None
    num_ooms: int | None
    num_alloc_retries: int | None
    basis: str | None
    explanation: str
    notes: tuple[str, ...] = ()
    unavailable: dict[str, str] = attrs.field(factory=dict)
    #: The GPU's enforced power limit in W (NVML), or None.
    power_limit_w: float | None = None
    #: Compute processes on the GPU other than this one (NVML), or None: energy and
    #: device-wide figures include theirs.
    other_processes: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The JSON-lines form (without ``schema_version``, which the writer adds)."""
        d = attrs.asdict(self)
        d["notes"] = list(self.notes)
        return {"kind": "memory", **d}

    def __str__(self) -> str:
        where = f"stepprof memory on {self.device} ({self.trigger}"
        where += f", step {self.step})" if self.step is not None else ")"
        if self.allocated_bytes is None and self.residual_bytes is None:
            why = self.unavailable.get("allocated_bytes") or self.unavailable.get("residual_bytes")
            return f"{where}: unavailable ({why})"
        total = self.nvml_process_bytes if self.basis == PROCESS_BASIS else self.mem_get_info_used_bytes
        u = unit_for(total, self.reserved_bytes)
        parts = []
        if self.allocated_bytes is not None and self.fragmentation_bytes is not None:
            parts += [f"{format_bytes_in(self.allocated_bytes, u)} tensors", f"{format_bytes_in(self.fragmentation_bytes, u)} cached"]
        if self.residual_bytes is not None:
            parts.append(f"{format_bytes_in(self.residual_bytes, u)} context and other")
        if total is None:
            line = " + ".join(parts)
        else:
            label = "nvidia-smi" if self.basis == PROCESS_BASIS else "device (assumed exclusive)"
            line = f"{label} {format_bytes_in(total, u)} = " + " + ".join(parts)
        if self.peak_allocated_bytes is not None:
            line += f"; peak {format_bytes_in(self.peak_allocated_bytes, u)}"
        if self.notes:
            line += f"; {len(self.notes)} note{'s' if len(self.notes) > 1 else ''}"
        return f"{where}: {line}"


@attrs.frozen
class Snapshot:
    """Raw readings at one moment; a None reading has its reason in ``reasons``."""

    device: str
    unix_s: float
    allocator: AllocatorFigures | None
    #: (free, total) from ``cudaMemGetInfo``.
    free_total: tuple[int, int] | None
    nvml: NvmlReading
    #: "allocator" / "mem_get_info" -> why that reading is missing.
    reasons: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Mark:
    """A residual remembered for comparison: the context baseline, or the growth reference."""

    residual_bytes: int | None
    basis: str | None
    label: str
    reason: str | None = None
    after_warmup: bool = False


def take_snapshot(b: Backend) -> Snapshot:
    """Read the allocator, ``cudaMemGetInfo`` and NVML for ``b``'s device, now.

    Its cost, dominated by NVML's process query, is measured by bench/memory_costs.py
    (plus ``nvmlInit`` the first time).  Never raises: a failed reading is None with its reason.
    """
    reasons: dict[str, str] = {}
    allocator = free_total = None
    try:
        allocator = b.read_allocator()
    except Exception as e:  # noqa: BLE001 - a missing figure, never a crash
        if raised_by_user(e):
            raise
        reasons["allocator"] = f"reading torch's allocator statistics failed: {type(e).__name__}: {e}"
    try:
        free_total = b.mem_get_info()
    except Exception as e:  # noqa: BLE001
        if raised_by_user(e):
            raise
        reasons["mem_get_info"] = f"torch.cuda.mem_get_info failed: {type(e).__name__}: {e}"
    try:
        uuid, pci = b.identity()
    except Exception as e:  # noqa: BLE001
        if raised_by_user(e):
            raise
        why = f"torch could not report the device's UUID or PCI bus id: {type(e).__name__}: {e}"
        nvml = NvmlReading(None, None, why, why)
    else:
        nvml = _nvml.read(uuid, pci)
    return Snapshot(b.device, time.time(), allocator, free_total, nvml, reasons)


def _total(snap: Snapshot) -> tuple[int | None, str | None, str | None]:
    """(what the process is seen to use, basis, why there is none)."""
    if snap.nvml.process_bytes is not None:
        return snap.nvml.process_bytes, PROCESS_BASIS, None
    if snap.free_total is not None:
        free, total = snap.free_total
        return total - free, DEVICE_BASIS, None
    why = snap.nvml.process_reason or "NVML was not read"
    return None, None, f"{why}; and {snap.reasons.get('mem_get_info', 'cudaMemGetInfo was not read')}"


def residual_of(snap: Snapshot) -> tuple[int | None, str | None, str | None]:
    """(residual bytes, basis, why there is none) of a snapshot."""
    seen, basis, why = _total(snap)
    if snap.allocator is None:
        return None, basis, snap.reasons.get("allocator", "the allocator was not read")
    if seen is None:
        return None, None, why
    return seen - snap.allocator.reserved_bytes, basis, None


def reconcile(
    snap: Snapshot,
    *,
    trigger: str,
    step: int | None = None,
    peak_floor: int = -1,
    baseline: Mark | None = None,
    reference: Mark | None = None,
    alloc_conf: str | None = None,
) -> MemoryReport:
    """Build the report from one snapshot.  Pure: every input is an argument.

    Args:
        snap: the readings.
        trigger: why the report is made (see :data:`AFTER_WARMUP` and the others).
        step: the latest step begun, or None.
        peak_floor: the highest step peak the profiler has seen (its reset of the
            allocator's counter at every boundary hides earlier peaks), or -1.
        baseline: the residual when stepprof first saw CUDA initialised.
        reference: the residual that growth is measured from.
        alloc_conf: the allocator settings (``PYTORCH_CUDA_ALLOC_CONF``), for the
            fragmentation note.
    """
    un: dict[str, str] = {}
    notes = list(snap.nvml.notes)
    allocated, peak, reserved, cached, split, ooms, retries = _allocator_figures(snap, peak_floor, un)
    mgi_used, total = _device_figures(snap, un)
    seen, basis, why_total = _total(snap)
    residual, _, why_residual = residual_of(snap)
    if basis is None:
        un["basis"] = why_total or "no total was read"
    if residual is None:
        un["residual_bytes"] = why_residual or "not computed"
    if basis == DEVICE_BASIS:
        notes.append(
            f"nvidia-smi's figure for this process is unavailable ({un['nvml_process_bytes']}), so the "
            f"total is the device-wide use from cudaMemGetInfo: it counts every process on the GPU, "
            f"and stepprof assumes there is no other"
        )
    context = _context_baseline(baseline, basis, un, notes)
    u = unit_for(seen, reserved, residual)
    notes += [note for note in (
        _growth_note(residual, basis, reference, u),
        _fragmentation_note(peak, reserved, split, alloc_conf, u),
        _retries_note(ooms, retries),
        _negative_residual_note(residual, u),
    ) if note is not None]
    return MemoryReport(
        trigger=trigger,
        step=step,
        device=snap.device,
        unix_s=snap.unix_s,
        allocated_bytes=allocated,
        peak_allocated_bytes=peak,
        reserved_bytes=reserved,
        fragmentation_bytes=cached,
        inactive_split_bytes=split,
        nvml_process_bytes=snap.nvml.process_bytes,
        nvml_device_used_bytes=snap.nvml.device_used_bytes,
        mem_get_info_used_bytes=mgi_used,
        total_bytes=total,
        residual_bytes=residual,
        context_baseline_bytes=context,
        num_ooms=ooms,
        num_alloc_retries=retries,
        basis=basis,
        explanation=_explain(basis, seen, allocated, reserved, residual, why_total, un, u),
        notes=tuple(notes),
        unavailable=un,
        power_limit_w=snap.nvml.power_limit_w,
        other_processes=snap.nvml.other_processes,
    )


# -- the parts of reconcile: each returns its figures (or note) and adds the reasons of the
# figures it could not give to ``un`` -------------------------------------------------------


#: NVML's readings a report carries: (its field, the reading, the reading's reason when None).
_NVML_FIELDS = (
    ("nvml_process_bytes", "process_bytes", "process_reason"),
    ("nvml_device_used_bytes", "device_used_bytes", "device_reason"),
    ("power_limit_w", "power_limit_w", "power_limit_reason"),
    ("other_processes", "other_processes", "other_processes_reason"),
)


def _allocator_figures(snap: Snapshot, peak_floor: int, un: dict[str, str]) -> tuple[int | None, ...]:
    """(allocated, peak, reserved, cached, inactive split, OOMs, retries) from torch's allocator."""
    a = snap.allocator
    if a is None:
        for f in _ALLOCATOR_FIELDS:
            un[f] = snap.reasons.get("allocator", "the allocator was not read")
        return None, None, None, None, None, None, None
    return (a.allocated_bytes, max(a.peak_allocated_bytes, peak_floor), a.reserved_bytes,
            a.reserved_bytes - a.allocated_bytes, a.inactive_split_bytes, a.num_ooms, a.num_alloc_retries)


def _device_figures(snap: Snapshot, un: dict[str, str]) -> tuple[int | None, int | None]:
    """(the device's use, its total) from ``cudaMemGetInfo``; the reasons of NVML's missing readings."""
    mgi_used = total = None
    if snap.free_total is None:
        un["mem_get_info_used_bytes"] = un["total_bytes"] = snap.reasons.get(
            "mem_get_info", "cudaMemGetInfo was not read"
        )
    else:
        free, total = snap.free_total
        mgi_used = total - free
    for field, reading, reason in _NVML_FIELDS:
        if getattr(snap.nvml, reading) is None:
            un[field] = getattr(snap.nvml, reason) or "NVML was not read"
    return mgi_used, total


def _context_baseline(baseline: Mark | None, basis: str | None, un: dict[str, str], notes: list[str]) -> int | None:
    """The residual when stepprof first saw CUDA initialised (a note when its basis differs)."""
    if baseline is None:
        un["context_baseline_bytes"] = "stepprof had not seen CUDA initialised before this record"
        return None
    if baseline.residual_bytes is None:
        un["context_baseline_bytes"] = f"the baseline could not be measured: {baseline.reason}"
        return None
    if basis is not None and baseline.basis != basis:
        notes.append(
            f"context_baseline_bytes was measured on the {baseline.basis!r} basis, this record "
            f"on {basis!r}: compare them with care"
        )
    return baseline.residual_bytes


def _growth_note(residual: int | None, basis: str | None, reference: Mark | None, u: int) -> str | None:
    """The note that memory outside PyTorch grew past the reference record, if it did."""
    if (
        reference is None or residual is None or reference.residual_bytes is None
        or reference.basis != basis or residual - reference.residual_bytes < GROWTH_NOTE_BYTES
    ):
        return None
    grown = residual - reference.residual_bytes
    return (
        f"the residual grew by {format_bytes_in(grown, u)} since {reference.label} "
        f"({format_bytes_in(reference.residual_bytes, u)} to {format_bytes_in(residual, u)}): memory outside PyTorch's "
        f"allocator is growing (NCCL, cuDNN, another library, or CUDA memory allocated directly); "
        f"torch.cuda.empty_cache() cannot release it"
    )


def _fragmentation_note(peak: int | None, reserved: int | None, split: int | None, alloc_conf: str | None,
                        u: int) -> str | None:
    """The note that reserved is much larger than the peak of live tensors, if it is."""
    if peak is None or reserved is None:
        return None
    gap = reserved - peak
    if gap < max(FRAGMENTATION_NOTE_MIN_BYTES, FRAGMENTATION_NOTE_FRACTION * reserved):
        return None
    if "expandable_segments:true" in (alloc_conf or "").replace(" ", "").lower():
        hint = (
            "expandable_segments is already on, so the gap is more likely cached blocks of an "
            "earlier, larger peak than splintered ones"
        )
    else:
        hint = (
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts "
            "usually shrinks it"
        )
    return (
        f"reserved ({format_bytes_in(reserved, u)}) is {format_bytes_in(gap, u)} above the peak of live tensors "
        f"({format_bytes_in(peak, u)}): the allocator holds cached blocks it cannot reuse for the sizes "
        f"asked for (fragmentation; {format_bytes_in(split or 0, u)} in inactive split blocks); {hint}. "
        f"torch.cuda.empty_cache() only hides it, and costs speed"
    )


def _retries_note(ooms: int | None, retries: int | None) -> str | None:
    """The note that the allocator ran out of memory or retried, if it did."""
    if not (ooms or retries):
        return None
    return (
        f"the allocator has raised {ooms} out-of-memory error(s) and retried {retries} "
        f"allocation(s) after freeing its cache since the process started (each retry "
        f"synchronises the device and calls cudaFree): this run is at its memory limit, and a "
        f"smaller batch or expandable_segments can be faster"
    )


def _negative_residual_note(residual: int | None, u: int) -> str | None:
    """The note that the total is below what the allocator reserves, if it is."""
    if residual is None or residual >= 0:
        return None
    return (
        f"the total is {format_bytes_in(-residual, u)} below what the allocator reserves: the readings were "
        f"microseconds apart and the driver counts differently here (MPS, MIG or a driver "
        f"change); treat the residual as about zero"
    )


def _explain(
    basis: str | None, seen: int | None, allocated: int | None, reserved: int | None,
    residual: int | None, why_total: str | None, un: dict[str, str], u: int,
) -> str:
    if allocated is None or reserved is None:
        why = un.get("allocated_bytes", "not read")
        if seen is None:
            return f"No memory figure could be read: {why}; {why_total}."
        return (
            f"{_head(basis, seen, u)}, but PyTorch's allocator figures could not be read ({why}), "
            f"so stepprof cannot say how much of it is tensors."
        )
    tensors = (
        f"{format_bytes_in(allocated, u)} live tensors, {format_bytes_in(reserved - allocated, u)} cached by PyTorch's "
        f"allocator for reuse (not a leak)"
    )
    if seen is None or residual is None:
        return (
            f"PyTorch holds {format_bytes_in(allocated, u)} in live tensors and {format_bytes_in(reserved - allocated, u)} "
            f"cached by its allocator for reuse (not a leak); the total that nvidia-smi shows could "
            f"not be read ({why_total})."
        )
    if residual < 0:
        return (
            f"{_head(basis, seen, u)}: {tensors}; that is {format_bytes_in(-residual, u)} less than the allocator "
            f"reserves (see the notes)."
        )
    rest = "CUDA context and libraries" if basis == PROCESS_BASIS else (
        "CUDA context, libraries and anything else on the GPU"
    )
    return f"{_head(basis, seen, u)}: {tensors}, {format_bytes_in(residual, u)} {rest}."


def _head(basis: str | None, seen: int, u: int) -> str:
    if basis == PROCESS_BASIS:
        return f"nvidia-smi shows {format_bytes_in(seen, u)} for this process"
    return f"The GPU has {format_bytes_in(seen, u)} in use (device-wide; stepprof assumes this process is alone on it)"


def unavailable_report(device: str, reason: str, *, trigger: str, step: int | None = None) -> MemoryReport:
    """The report where there is no CUDA memory to read: every figure None, with ``reason``."""
    return MemoryReport(
        trigger=trigger, step=step, device=device, unix_s=time.time(),
        allocated_bytes=None, peak_allocated_bytes=None, reserved_bytes=None,
        fragmentation_bytes=None, inactive_split_bytes=None, nvml_process_bytes=None,
        nvml_device_used_bytes=None, mem_get_info_used_bytes=None, total_bytes=None,
        residual_bytes=None, context_baseline_bytes=None, num_ooms=None, num_alloc_retries=None,
        basis=None, explanation=f"No CUDA memory to reconcile: {reason}.",
        unavailable=dict.fromkeys(_FIGURE_FIELDS, reason),
    )


# -- the process's state (kept in stepprof._registry): one baseline and one growth
# reference per device --------------------------------------------------------------


def observe(b: Backend) -> None:
    """Take the context baseline for ``b``'s device, the first time stepprof sees it.

    The baseline is the residual (NVML's process figure, else the device's use,
    minus reserved) at that moment: the CUDA context plus whatever the process
    had already allocated outside torch.  Never raises.
    """
    if b.device in MEMORY_MARKS.baselines:
        return
    try:
        snap = take_snapshot(b)
        residual, basis, why = residual_of(snap)
        mark = Mark(residual, basis, "when stepprof first saw CUDA initialised", why)
    except Exception as e:  # noqa: BLE001 - a missing figure, never a crash
        if raised_by_user(e):
            raise
        mark = Mark(None, None, "", f"{type(e).__name__}: {e}")
    with MEMORY_MARKS.lock:
        MEMORY_MARKS.baselines.setdefault(b.device, mark)


def build(snap: Snapshot, *, trigger: str, step: int | None, peak_floor: int = -1) -> MemoryReport:
    """Reconcile ``snap`` against this process's baseline and reference, then update the reference.

    The reference, which residual growth is measured from, is the first
    after-warm-up record on the device, or until there is one the first record.
    """
    with MEMORY_MARKS.lock:
        baseline = MEMORY_MARKS.baselines.get(snap.device)
        reference = MEMORY_MARKS.references.get(snap.device)
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    rep = reconcile(
        snap, trigger=trigger, step=step, peak_floor=peak_floor, baseline=baseline,
        reference=reference, alloc_conf=alloc_conf,
    )
    if rep.residual_bytes is not None:
        warm = trigger == AFTER_WARMUP
        where = f"step {step}" if step is not None else "the first report"
        label = f"the after-warm-up record ({where})" if warm else f"the first memory record ({where})"
        with MEMORY_MARKS.lock:
            ref = MEMORY_MARKS.references.get(snap.device)
            if ref is None or (warm and not ref.after_warmup):
                MEMORY_MARKS.references[snap.device] = Mark(rep.residual_bytes, rep.basis, label, after_warmup=warm)
    return rep


def report(b: Backend, *, trigger: str, step: int | None = None, peak_floor: int = -1) -> MemoryReport:
    """Read and reconcile ``b``'s device now.  Never raises."""
    if b.memory_reason is not None:
        return unavailable_report(b.device, b.gpu_reason or b.memory_reason, trigger=trigger, step=step)
    try:
        observe(b)
        return build(take_snapshot(b), trigger=trigger, step=step, peak_floor=peak_floor)
    except Exception as e:  # noqa: BLE001 - stepprof never breaks training
        if raised_by_user(e):
            raise
        return unavailable_report(
            b.device, f"stepprof's memory reading failed: {type(e).__name__}: {e}", trigger=trigger, step=step
        )

"""The ``kind: "peak"`` record: what ``explain_peak`` returns, and its one line of text.

The replay that fills it is :mod:`stepprof._peak`; the report's table of it is
:mod:`stepprof._report.peak`.  :func:`peak_line` reads a plain record dict, defensively (a log
may be hand-edited or from another version): a field of the wrong type reads as missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ._units import format_bytes, printable

__all__ = [
    "CATEGORIES",
    "CATEGORY_LABELS",
    "ModuleBytes",
    "PeakExplanation",
    "SHOWN_CATEGORIES",
    "TOP_MODULES",
    "int_field",
    "peak_line",
    "top_modules",
    "unavailable_explanation",
]

#: The categories, in the order a byte is claimed (a parameter that is also saved for
#: backward counts as a parameter).  ``temporaries``: allocated during the step and none
#: of the above; ``other``: alive before the step and none of the above.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")

#: How many modules the record keeps, largest first.
TOP_MODULES = 20

#: The categories in the order the report shows them (a tie in :func:`peak_line` keeps it).
SHOWN_CATEGORIES = ("activations", "parameters", "gradients", "optimizer_state", "temporaries", "other")
#: A category's label where it is not its name.
CATEGORY_LABELS = {"optimizer_state": "optimizer state"}


@attrs.frozen
class ModuleBytes:
    """Live bytes at the peak that one module made: in all, and by category."""

    module: str
    total_bytes: int
    bytes_by_category: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "total_bytes": self.total_bytes,
                "bytes_by_category": dict(self.bytes_by_category)}


# The converters of the tuple fields (typed, where tuple's own would leave its item type open).
def _floats(xs: Iterable[float] | None) -> tuple[float, ...] | None:
    return None if xs is None else tuple(xs)


def _ints(xs: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if xs is None else tuple(xs)


def _strs(xs: Iterable[str]) -> tuple[str, ...]:
    return tuple(xs)


def _modules(raw: Any) -> tuple[ModuleBytes, ...] | None:
    if raw is None:
        return None
    return tuple(m if isinstance(m, ModuleBytes) else ModuleBytes(m["module"], m["total_bytes"],
                                                                  dict(m["bytes_by_category"]))
                 for m in raw)


@attrs.frozen
class PeakExplanation:
    """One step's peak, broken down: what the ``kind: "peak"`` record holds.

    Every figure may be None, with the reason in ``unavailable``.  ``bytes_by_category``
    has every category of :data:`CATEGORIES`; its values sum to ``live_bytes``, the live
    bytes at the replayed high-water mark, which matches ``peak_allocated_bytes`` (the
    allocator's own counter for the step) within the allocator's rounding.

    Attributes:
        step: the explained step's index (a one-off's: its ``warmup``).
        device: ``"cuda:N"``, or ``"cpu"``.
        peak_allocated_bytes: the allocator's high-water mark over the step.
        live_bytes: the bytes live at the replayed high-water mark.
        peak_at_ms: when the peak happened, from the step's entry.
        phase: the innermost stepprof phase open at the peak (``"outer/inner"``).
        op: the innermost annotation open at the allocation that set the peak (an aten op or
            your ``record_function`` range), else its innermost frame, ``name (file:line)``.
        user_frame: the innermost frame of that allocation outside torch, ``file:line``.
        bytes_by_category: live bytes at the peak per category.
        modules: up to :data:`TOP_MODULES` modules, largest first.
        outside_modules_bytes: live bytes made during the step outside any module's forward
            or backward (the loss, the optimizer step).
        reserved_bytes: what the allocator held from the driver at the peak.
        fragmentation_bytes: reserved minus live bytes at the peak.
        largest_free_block_bytes: the largest free range inside a segment at the peak.
        live_blocks: how many blocks were live at the peak.
        trace_entries: the allocator's history entries of the step.
        cost_ms: the host time explaining added: recording on and off, the two snapshots
            (outside the step's ``wall_ms``, inside its ``overhead_us``), the hooks with
            their markers (inside ``wall_ms``) and the replay.
        timeline_ms, timeline_bytes: live bytes over the step (at most 200 points, each
            a bucket's maximum).
        activations_from: ``"saved_tensors_hooks"`` or ``"stacks"``: how saved
            activations were told from temporaries.
        notes: sentences on what may mislead in this step's figures.
        unavailable: field name to the reason it is None.
        snapshot_path: where the step's allocator snapshot was written for pytorch.org/memory_viz
            (``explain_peak(snapshot=)``); None when none was asked (then the record lacks it) or
            the write failed (``unavailable`` says why).
    """

    step: int | None = None
    device: str = "cpu"
    peak_allocated_bytes: int | None = None
    live_bytes: int | None = None
    peak_at_ms: float | None = None
    phase: str | None = None
    op: str | None = None
    user_frame: str | None = None
    bytes_by_category: Mapping[str, int] | None = None
    modules: tuple[ModuleBytes, ...] | None = attrs.field(default=None, converter=_modules)
    outside_modules_bytes: int | None = None
    reserved_bytes: int | None = None
    fragmentation_bytes: int | None = None
    largest_free_block_bytes: int | None = None
    live_blocks: int | None = None
    trace_entries: int | None = None
    cost_ms: float | None = None
    timeline_ms: tuple[float, ...] | None = attrs.field(default=None, converter=_floats)
    timeline_bytes: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    activations_from: str | None = None
    notes: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    unavailable: Mapping[str, str] = attrs.field(factory=dict)
    snapshot_path: str | None = None

    def to_record(self) -> dict[str, Any]:
        """The ``kind: "peak"`` record (docs/reference/schema.md)."""
        out: dict[str, Any] = {"kind": "peak"}
        for field in attrs.fields(PeakExplanation):
            value = getattr(self, field.name)
            if field.name == "snapshot_path" and value is None and "snapshot_path" not in self.unavailable:
                continue  # (none was asked)
            if field.name == "modules":
                value = None if value is None else [m.to_dict() for m in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[field.name] = value
        return out

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PeakExplanation:
        """Back from a ``kind: "peak"`` record (fields it lacks keep their defaults)."""
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})

    def __str__(self) -> str:
        return peak_line(self.to_record())


def unavailable_explanation(reason: str, *, step: int | None, device: str,
                            peak_allocated_bytes: int | None = None,
                            cost_ms: float | None = None) -> PeakExplanation:
    """An explanation whose figures are all None, for ``reason``."""
    fields = [f.name for f in attrs.fields(PeakExplanation)
              if f.name not in ("step", "device", "notes", "unavailable", "cost_ms", "snapshot_path")]
    missing = {name: reason for name in fields}
    if peak_allocated_bytes is not None:
        missing.pop("peak_allocated_bytes")
    return PeakExplanation(step=step, device=device, peak_allocated_bytes=peak_allocated_bytes,
                           cost_ms=cost_ms, unavailable=missing)


def int_field(x: Any) -> int | None:
    """``x`` if it is an int (not a bool), else None."""
    return x if type(x) is int else None


#: A module is named among a category's top ones when it holds at least this share of the
#: category's live bytes (the model's root with a few KiB of 5 GiB read "(root) 0.0 MiB").
TOP_MODULE_SHARE = 0.01


def top_modules(record: dict[str, Any], category: str, n: int) -> list[tuple[str, int]]:
    """The ``n`` modules with the most live bytes of ``category``, each holding at least
    :data:`TOP_MODULE_SHARE` of the category's bytes (all of them when the record lacks that total)."""
    cats = record.get("bytes_by_category")
    total = int_field(cats.get(category)) if isinstance(cats, dict) else None
    least = TOP_MODULE_SHARE * total if total else 0
    out = []
    for m in record.get("modules") or ():
        if not isinstance(m, dict) or not isinstance(m.get("module"), str):
            continue
        by = m.get("bytes_by_category")
        size = int_field(by.get(category)) if isinstance(by, dict) else None
        if size and size >= least:
            out.append((m["module"], size))
    out.sort(key=lambda x: -x[1])
    return out[:n]


def peak_line(record: dict[str, Any]) -> str:
    """``peak 9.08 GiB in backward at mm (…): activations 5.10 GiB (h.11.mlp 0.60 GiB, …), …``."""
    peak = int_field(record.get("live_bytes")) or int_field(record.get("peak_allocated_bytes"))
    head = f"peak {format_bytes(peak)}"
    step = int_field(record.get("step"))
    if step is not None:
        head += f" in step {step}"
    if isinstance(record.get("phase"), str):
        head += f" in {printable(record['phase'])}"
    if isinstance(record.get("op"), str):
        head += f" at {printable(record['op'])}"
    cats = record.get("bytes_by_category")
    if not isinstance(cats, dict):
        why = (record.get("unavailable") or {}).get("bytes_by_category")
        return f"{head}: not explained ({printable(str(why))})" if why else head
    parts = []
    for c in sorted(SHOWN_CATEGORIES, key=lambda c: -(int_field(cats.get(c)) or 0)):
        size = int_field(cats.get(c))
        if not size:
            continue
        text = f"{CATEGORY_LABELS.get(c, c)} {format_bytes(size)}"
        mods = top_modules(record, c, 2)
        if mods:
            text += " (" + ", ".join(f"{printable(n)} {format_bytes(b)}" for n, b in mods) + ", …)"
        parts.append(text)
    return f"{head}: " + ", ".join(parts)

"""The ``kind: "peak"`` record as text: one line, then a table by category with its top modules.

Reads plain record dicts, defensively (a log may be hand-edited or from another version):
a field of the wrong type reads as missing.
"""

from __future__ import annotations

from typing import Any

from .._units import format_bytes, printable

__all__ = ["peak_line", "peak_lines"]

_CATEGORIES = ("activations", "parameters", "gradients", "optimizer_state", "temporaries", "other")
_LABELS = {"optimizer_state": "optimizer state"}


def _int(x: Any) -> int | None:
    return x if type(x) is int else None


def _modules_for(record: dict[str, Any], category: str, n: int) -> list[tuple[str, int]]:
    """The ``n`` modules with the most live bytes of ``category``."""
    out = []
    for m in record.get("modules") or ():
        if not isinstance(m, dict) or not isinstance(m.get("module"), str):
            continue
        by = m.get("bytes_by_category")
        size = _int(by.get(category)) if isinstance(by, dict) else None
        if size:
            out.append((m["module"], size))
    out.sort(key=lambda x: -x[1])
    return out[:n]


def peak_line(record: dict[str, Any]) -> str:
    """``peak 9.08 GiB in backward at mm (…): activations 5.10 GiB (h.11.mlp 0.60 GiB, …), …``."""
    peak = _int(record.get("live_bytes")) or _int(record.get("peak_allocated_bytes"))
    head = f"peak {format_bytes(peak)}"
    step = _int(record.get("step"))
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
    for c in sorted(_CATEGORIES, key=lambda c: -(_int(cats.get(c)) or 0)):
        size = _int(cats.get(c))
        if not size:
            continue
        text = f"{_LABELS.get(c, c)} {format_bytes(size)}"
        mods = _modules_for(record, c, 2)
        if mods:
            text += " (" + ", ".join(f"{printable(n)} {format_bytes(b)}" for n, b in mods) + ", …)"
        parts.append(text)
    return f"{head}: " + ", ".join(parts)


def peak_lines(record: dict[str, Any]) -> list[str]:
    """The report's block: the line, a table by category, the top modules, fragmentation."""
    out = [peak_line(record)]
    cats = record.get("bytes_by_category")
    if not isinstance(cats, dict):
        return out
    total = sum(v for v in cats.values() if type(v) is int) or 1
    out.append(f"   {'category':<16} {'live':>11} {'share':>6}  top modules")
    for c in _CATEGORIES:
        size = _int(cats.get(c))
        if size is None:
            continue
        mods = ", ".join(f"{printable(n)} {format_bytes(b)}" for n, b in _modules_for(record, c, 3))
        out.append(f"   {_LABELS.get(c, c):<16} {format_bytes(size):>11} {size / total:>6.0%}  {mods}")
    frag, largest = _int(record.get("fragmentation_bytes")), _int(record.get("largest_free_block_bytes"))
    reserved = _int(record.get("reserved_bytes"))
    if reserved is not None:
        out.append(f"   reserved {format_bytes(reserved)} at the peak: {format_bytes(frag)} cached, "
                   f"largest free block {format_bytes(largest)}")
    cost = record.get("cost_ms")
    if type(cost) in (int, float):
        out.append(f"   explaining cost {cost:.1f} ms in that step")
    return out

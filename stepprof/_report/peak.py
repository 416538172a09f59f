"""The ``kind: "peak"`` record as the report's block: its line, then a table by category with its top modules.

Reads plain record dicts, defensively (a log may be hand-edited or from another version):
a field of the wrong type reads as missing.  The one line is the record's own
(:func:`stepprof._peak_record.peak_line`).
"""

from __future__ import annotations

from typing import Any

from .._peak_record import CATEGORY_LABELS, SHOWN_CATEGORIES, int_field, peak_line, top_modules
from .._units import format_bytes, printable

__all__ = ["peak_line", "peak_lines"]


def peak_lines(record: dict[str, Any]) -> list[str]:
    """The report's block: the line, a table by category, the top modules, fragmentation."""
    out = [peak_line(record)]
    cats = record.get("bytes_by_category")
    if not isinstance(cats, dict):
        return out
    total = sum(v for v in cats.values() if type(v) is int) or 1
    out.append(f"   {'category':<16} {'live':>11} {'share':>6}  top modules")
    for c in SHOWN_CATEGORIES:
        size = int_field(cats.get(c))
        if size is None:
            continue
        mods = ", ".join(f"{printable(n)} {format_bytes(b)}" for n, b in top_modules(record, c, 3))
        out.append(f"   {CATEGORY_LABELS.get(c, c):<16} {format_bytes(size):>11} {size / total:>6.0%}  {mods}")
    frag, largest = int_field(record.get("fragmentation_bytes")), int_field(record.get("largest_free_block_bytes"))
    reserved = int_field(record.get("reserved_bytes"))
    if reserved is not None:
        out.append(f"   reserved {format_bytes(reserved)} at the peak: {format_bytes(frag)} cached, "
                   f"largest free block {format_bytes(largest)}")
    cost = record.get("cost_ms")
    if type(cost) in (int, float):
        out.append(f"   explaining cost {cost:.1f} ms in that step")
    return out

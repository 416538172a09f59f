"""Units and their formatting: the one place that turns a figure into text."""

from __future__ import annotations

__all__ = [
    "CONTROL_CHARACTERS", "GiB", "MiB", "format_bytes", "format_bytes_in", "format_count", "per_s", "printable",
    "printable_json", "unit_for",
]

MiB = 2**20
GiB = 2**30


def unit_for(*figures: int | float | None) -> int:
    """GiB when the largest figure reaches 1 GiB, else MiB: one unit for figures shown together."""
    return GiB if max((abs(f) for f in figures if f is not None), default=0) >= GiB else MiB


def format_bytes_in(n: int | float, unit: int) -> str:
    """``n`` bytes in ``unit`` (:data:`GiB` with two decimals, :data:`MiB` with one)."""
    return f"{n / GiB:.2f} GiB" if unit == GiB else f"{n / MiB:.1f} MiB"


def format_bytes(n: int | float | None) -> str:
    """``n`` bytes in GiB or MiB, whichever suits it; ``n/a`` for None."""
    return "n/a" if n is None else format_bytes_in(n, unit_for(n))


_INF = float("inf")


def per_s(amount: int | float, ms: float) -> float | None:
    """``amount`` per second over ``ms`` (> 0) milliseconds; None past a float's range (an
    amount over 1.8e308, or a rate that would be infinite), which JSON could only write as null."""
    try:
        rate = amount / (ms / 1e3)
    except OverflowError:  # an int too large for a float
        return None
    return rate if rate != _INF else None


def format_count(n: int | None) -> str:
    """An integer with thousands separators; ``n/a`` for None."""
    return "n/a" if n is None else f"{n:,}"


#: The control characters: C0, DEL and C1.  A terminal acts on them (ESC starts a sequence,
#: U+009B is a one-character CSI), so a string from a log never reaches one raw.
CONTROL_CHARACTERS = (*range(0x20), 0x7F, *range(0x80, 0xA0))
#: Each to its visible escape (``\\n``, ``\\r``, ``\\t``, else ``\\xNN``).
_CONTROL_ESCAPES = {
    **{c: f"\\x{c:02x}" for c in CONTROL_CHARACTERS},
    0x09: "\\t",
    0x0A: "\\n",
    0x0D: "\\r",
}
#: DEL and C1 as JSON escapes (JSON requires only C0 escaped, which every encoder does).
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in CONTROL_CHARACTERS if c >= 0x7F}


def printable(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1) as a visible escape, and U+FFFD
    for each lone surrogate.

    For text that comes from a log and is printed to a terminal: an escape sequence
    in a step name (``"\\x1b]0;title\\x07"``, ``"\\x1b[2J"``) shows as text instead of
    acting on the terminal.  Newlines are escaped too, so a value stays on its line;
    pass one line at a time.  A lone surrogate (a log path that is not UTF-8, as the
    command line gives it) would make printing fail on a terminal that is strict UTF-8.
    """
    text = text.translate(_CONTROL_ESCAPES)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def printable_json(text: str) -> str:
    """JSON ``text`` with DEL and the C1 controls escaped as ``\\u007f`` ... ``\\u009f``: the same
    JSON, safe to print to a terminal (an encoder escapes only C0).  They can only occur inside
    strings, where the escape means the same character."""
    return text.translate(_JSON_ESCAPES)

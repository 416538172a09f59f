"""JSON-lines log: one record per line, written whole; and its reader."""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Iterator
from typing import Any

import orjson

from ._errors import ConfigError, from_signal_handler, raised_by_user, warn
from ._sanitise import sanitise
from ._schema import RECORD_KINDS
from ._validate import check_log, check_read_kind, check_read_path

__all__ = ["LINE_MAX_BYTES", "VALUES_MAX", "JsonlWriter", "ScanStats", "check_log", "encodable", "read", "scan"]


#: Lines encoded and written together by :meth:`JsonlWriter.write_many`.
CHUNK_RECORDS = 64


class JsonlWriter:
    """Appends records to ``path``, one ``write()`` system call per whole line.

    The file is opened unbuffered at construction, so a path that cannot be
    written fails before training starts.  Each line goes out in one call and
    is in the page cache when :meth:`write` returns, so a crash loses nothing
    already written and never leaves half a line from stepprof.  A write that
    fails (disk full) sets :attr:`failed` and stops logging; it never raises.
    The profiler calls :meth:`write` from its collector thread, not from the
    training loop (a ``write()`` system call costs tens of µs; see bench/boundary_costs.py).
    """

    def __init__(self, path: str | os.PathLike[str], *, argument: str = "log") -> None:
        self.path: str = check_log(path, argument)  # type: ignore[assignment]
        try:
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
            )
        except OSError as e:
            if raised_by_user(e):
                raise
            raise ConfigError(
                f"{argument!r} cannot be written: {self.path!r} ({e.strerror}). "
                f"Pass a path in an existing, writable directory."
            ) from e
        #: Why logging stopped, or None while it works.
        self.failed: str | None = None
        self._end_torn_line(self._fd)

    def _end_torn_line(self, fd: int) -> None:
        """End a torn last line (a process that died mid-write) before appending to it.

        Otherwise the first record written here would be glued to the fragment and
        be unreadable; the fragment stays, on a line of its own, for :func:`read` to skip.
        """
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                return
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                last = f.read(1)
            if last and last != b"\n":
                os.write(fd, b"\n")
        except OSError as e:  # unreadable (write-only), or not a regular file: append as before
            if raised_by_user(e):
                raise

    def write(self, record: dict[str, Any]) -> None:
        self.write_many((record,))

    def write_many(self, records: Any) -> None:
        """Append several records, whole lines, in few ``write()`` calls.

        The collector thread writes all the steps it harvests at once: each system call
        drops and retakes the GIL, which the training thread may then have to give up.  They
        go in chunks of :data:`CHUNK_RECORDS` lines: a thousand encoded lines held at once
        cost glibc's malloc several times what encoding them does (bench/floor.py: 3.4 µs a
        record against 0.6 in chunks of 64).  An item that is ``bytes`` is lines
        :func:`encode_line` made already.
        """
        if self._fd is None:
            return
        if not isinstance(records, (list, tuple)):
            records = list(records)
        dumps, option = orjson.dumps, orjson.OPT_APPEND_NEWLINE
        for i in range(0, len(records), CHUNK_RECORDS):
            chunk = records[i:i + CHUNK_RECORDS]
            try:
                line = b"".join([r if type(r) is bytes else dumps(r, option=option) for r in chunk])
            except orjson.JSONEncodeError:  # a value JSON cannot hold: repair that record alone
                line = b"".join([r if type(r) is bytes else encode_line(r) for r in chunk])
            if not self._write(line):
                return

    def _write(self, line: bytes) -> bool:
        """Write whole lines; False once writing failed (the file is then closed)."""
        fd = self._fd  # read once: a close from another thread leaves this call a closed fd, never None
        if fd is None or not line:
            return fd is not None
        written = 0
        try:
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                written += n
                view = view[n:]
        except OSError as e:
            if raised_by_user(e):
                raise
            self.failed = f"writing {self.path!r} failed: {e.strerror}"
            self._cut_partial_line(line, written)
            self.close()
            return False
        return True

    def _cut_partial_line(self, line: bytes, written: int) -> None:
        """After a short write (disk full), remove the half line it left at the end of the file."""
        torn = written - (line.rfind(b"\n", 0, written) + 1)
        if torn <= 0 or self._fd is None:
            return
        try:
            os.ftruncate(self._fd, os.fstat(self._fd).st_size - torn)
        except OSError as e:  # pragma: no cover - not a regular file: nothing more to do
            if raised_by_user(e):
                raise

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as e:  # pragma: no cover - nothing useful to do
                if raised_by_user(e):
                    raise


# -- records that orjson refuses ---------------------------------------------------------

#: The ints orjson writes: from int64's least to uint64's greatest.
_INT_RANGE = (-(2**63), 2**64 - 1)
#: Containers nested deeper are written as a string (orjson stops at 255 levels).
_MAX_DEPTH = 128


def encode_line(record: Any) -> bytes:
    """One record as a line: as it is if orjson takes it, else repaired; never raises."""
    option = orjson.OPT_APPEND_NEWLINE
    try:
        return orjson.dumps(record, option=option)
    except orjson.JSONEncodeError:
        pass
    try:
        return orjson.dumps(encodable(record), option=option)
    except Exception as e:  # noqa: BLE001 - a repair that fails must not cost the other records
        if raised_by_user(e):
            raise
        kind = record.get("kind") if isinstance(record, dict) else None
        return orjson.dumps(
            {
                "kind": _text(kind) if isinstance(kind, str) else None,
                "encoding_replaced": [""],
                "unavailable": {"record": f"stepprof could not encode it: {type(e).__name__}"},
            },
            option=option,
        )


def encodable(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``record`` that JSON can hold, with the dotted paths of what changed in ``encoding_replaced``.

    A str with a lone surrogate (a non-UTF-8 file name from ``os.listdir``, say) gets U+FFFD for
    it; an int outside 64 bits becomes its decimal string; a key that is not a str becomes its
    ``str()`` (with ``_`` appended while it would take an existing key's place); a value of a
    type orjson does not write becomes its ``str()`` (a numpy scalar its Python number, unlisted).
    NaN and infinities need no repair: they are written as null, as on every record.
    ``record`` is not modified.  Paths join keys and list indices with dots (``phases.fwd�``).
    """
    replaced: list[str] = []
    out = _repaired(record, "", replaced, 0)
    if not isinstance(out, dict):  # pragma: no cover - the writer is only given dicts
        out = {"record": out}
    if replaced:
        earlier = out.get("encoding_replaced")
        out["encoding_replaced"] = [*(earlier if isinstance(earlier, list) else ()), *replaced]
    return out


def _text(s: str) -> str:
    """``s`` with U+FFFD for each lone surrogate (a surrogate pair becomes its character)."""
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _str_of(value: Any) -> str:
    try:
        return _text(str(value))
    except BaseException as e:  # noqa: BLE001 - its __str__ failing (or an int too long to print)
        if from_signal_handler(e):
            raise
        return f"<unprintable {type(value).__name__}>"


def _repaired(value: Any, path: str, replaced: list[str], depth: int) -> Any:
    if value is None or isinstance(value, (bool, float)):
        return value  # orjson writes NaN and the infinities as null
    if isinstance(value, str):
        if _is_utf8(value):
            return value
        replaced.append(path)
        return _text(value)
    if isinstance(value, int):
        if _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return value
        replaced.append(path)
        return _str_of(value)
    if isinstance(value, (dict, list, tuple)) and depth >= _MAX_DEPTH:
        replaced.append(path)
        return f"<{type(value).__name__} nested deeper than {_MAX_DEPTH} levels>"
    if isinstance(value, dict):
        taken = {k for k in value if type(k) is str and _is_utf8(k)}
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is str and k in taken:
                key = k
            else:
                key = _text(k) if isinstance(k, str) else _str_of(k)
                while key in taken or key in out:
                    key += "_"
                replaced.append(f"{path}.{key}" if path else key)
            out[key] = _repaired(v, f"{path}.{key}" if path else key, replaced, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_repaired(v, f"{path}.{i}" if path else str(i), replaced, depth + 1)
                for i, v in enumerate(value)]
    try:
        orjson.dumps(value)  # a type orjson writes itself: a dataclass, a datetime, an enum
        return value
    except orjson.JSONEncodeError:
        pass
    if isinstance(value, numbers.Integral):
        return _repaired(int(value), path, replaced, depth)
    if isinstance(value, numbers.Real):
        return float(value)
    replaced.append(path)
    return _str_of(value)


#: The longest line read: a step record with a thousand phases is under 200 KiB, a ranks record
#: of 100,000 ranks about 6 MiB.  A longer line is skipped unread, in pieces of this size.
LINE_MAX_BYTES = 8 * 2**20
#: A line past this length is parsed only if it holds at most :data:`VALUES_MAX` values (its
#: commas, braces and brackets): a parsed value costs 30 to 60 bytes of memory, many times its
#: text, so this bounds what one line can take.
_LONG_LINE = 64 * 2**10
VALUES_MAX = 1_000_000


class ScanStats:
    """What :func:`scan` met: lines read, and lines skipped because they are no stepprof record."""

    __slots__ = ("lines", "skipped")

    def __init__(self) -> None:
        self.lines = 0
        self.skipped = 0

    def foreign(self) -> str | None:
        """When no line is a stepprof record (another tool's log, say), what every view says of
        the log; else None."""
        if self.lines == 0 or self.skipped != self.lines:
            return None
        return f"not a stepprof log: none of its {self.lines:,} line(s) is a stepprof record"


#: Stands for a line over :data:`LINE_MAX_BYTES`: not a record (it does not begin with ``{``).
_TOO_LONG = b"\0"


def _rest_of_line(f: Any) -> int:
    """Read to the end of the current line, in pieces; how many bytes that was."""
    size = 0
    while True:
        piece = f.readline(LINE_MAX_BYTES)
        size += len(piece)
        if not piece or piece.endswith(b"\n"):
            return size


def _lines(f: Any, pos: int, end: int | None, stats: ScanStats) -> Iterator[bytes]:
    """The file's lines from byte ``pos``, those that begin before ``end``, counted into ``stats``;
    a line longer than :data:`LINE_MAX_BYTES` is read in pieces (never whole into memory) and
    given as :data:`_TOO_LONG`; empty lines are passed over in runs, as one read of the buffer."""
    readline, peek, read = f.readline, f.peek, f.read
    while end is None or pos < end:
        line = readline(LINE_MAX_BYTES + 1)
        if not line:
            return
        pos += len(line)
        stats.lines += 1
        if line == b"\n":
            ahead = peek(1)[:65536]
            run = len(ahead) - len(ahead.lstrip(b"\n"))
            if end is not None:
                run = min(run, max(0, end - pos))
            if run:
                read(run)
                pos += run
                stats.lines += run
            continue
        if len(line) > LINE_MAX_BYTES and not line.endswith(b"\n"):
            pos += _rest_of_line(f)
            line = _TOO_LONG
        yield line


def scan(
    path: str | os.PathLike[str], stats: ScanStats, start: int = 0, end: int | None = None, *,
    kind: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream the records of a log, made safe for the readers, counting the lines that are none into ``stats``.

    Blank lines are ignored.  A line is skipped and counted, never raised, when it does not
    begin with ``{`` (after blanks), is longer than :data:`LINE_MAX_BYTES` (never read whole)
    or holds more than :data:`VALUES_MAX` values, is not JSON (a torn line, bytes that are not
    UTF-8), or is no record: its ``kind`` is not a str, or a required field is unusable
    (:func:`stepprof._sanitise.sanitise`, which also reads every field of the wrong type or
    out of range as null).

    ``start`` and ``end`` (byte offsets) read the lines that *begin* in ``[start, end)``,
    so that consecutive ranges read every line exactly once.  ``kind``: only records of this
    kind are given; a line that cannot hold one (it has neither the kind's JSON string nor a
    ``\\u`` escape that could spell it) is passed over unparsed, and other records unsanitised,
    neither counted.
    """
    loads, error = orjson.loads, orjson.JSONDecodeError
    needle = orjson.dumps(kind) if kind is not None else None
    with open(path, "rb") as f:
        pos = 0
        if start > 0:
            f.seek(start - 1)
            pos = start if f.read(1) == b"\n" else start + _rest_of_line(f)
        for line in _lines(f, pos, end, stats):
            if line[:1] != b"{":  # a record's first byte, tested before anything is parsed
                if line.isspace():
                    continue
                if line.lstrip()[:1] != b"{":
                    stats.skipped += 1
                    continue
            if needle is not None and needle not in line and b"\\u" not in line:
                continue
            if len(line) > _LONG_LINE and (line.count(b",") + line.count(b"{") + line.count(b"[")) > VALUES_MAX:
                stats.skipped += 1
                continue
            try:
                record = loads(line)
            except error:
                stats.skipped += 1
                continue
            k = record.get("kind")
            if kind is not None and k != kind:
                continue
            record = sanitise(record)
            if record is None:
                stats.skipped += 1
                continue
            yield record


def read(path: str | os.PathLike[str], *, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Stream the records of a stepprof log as dicts, in file order.

    A log is read as untrusted input: a field whose value the log holds in the wrong type,
    or out of its range (a negative time, 1e306 ms, an int past int64), is read as null, and
    the record's ``unavailable`` says that the log held an invalid value there; strings are
    cut at 4,096 characters, and fields this version does not know are kept only when they
    are small and shallow (docs/reference/schema.md).  Lines that are no record (a torn last line after
    a crash, a line over 8 MiB, a record without a str ``kind`` or a step without a usable
    ``step``) are skipped, and one warning at the end says how many.  Records of schema
    version 1 (stepprof 0.1.0) are given as they were written: read 0.1.0 logs with 0.1.x.

    Args:
        path: a JSON-lines log written by stepprof.
        kind: keep only records of this kind, e.g. ``"step"`` or ``"summary"``
            (:data:`stepprof._schema.RECORD_KINDS`).  A kind that stepprof never writes and no record has
            (a typo) gets a warning that names the kinds the log holds.

    Raises:
        ConfigError: ``path`` is not a path, or ``kind`` not a string (at the call).

    Example:
        >>> import stepprof, tempfile, os
        >>> log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with stepprof.Profiler(log, device="cpu") as prof:
        ...     with prof.step(batch_size=8):
        ...         pass
        >>> [r["kind"] for r in stepprof.read(log)]
        ['step', 'summary']
    """
    return _read(check_read_path(path), check_read_kind(kind))


def _read(path: str | os.PathLike[str], kind: str | None) -> Iterator[dict[str, Any]]:
    stats = ScanStats()
    kinds: set[Any] = set()
    kept = 0
    # Records of another kind are passed over unsanitised, unless the kind is one stepprof
    # never writes: then the kinds the log holds are named, in case it was a typo.
    for record in scan(path, stats, kind=kind if kind is None or kind in RECORD_KINDS else None):
        k = record.get("kind")
        if kind is None or k == kind:
            kept += 1
            yield record
        elif not kept and len(kinds) < 50 and isinstance(k, str):
            kinds.add(k)
    if stats.skipped:
        warn(
            f"stepprof.read: skipped {stats.skipped} line(s) of {os.fspath(path)!r} that are not "
            f"stepprof records (not a JSON object, torn, over {LINE_MAX_BYTES // 2**20} MiB, or without a "
            f"usable kind or step index)", stacklevel=2)
    if kind is not None and not kept and kinds and kind not in RECORD_KINDS:  # a typo, likely
        warn(
            f"stepprof.read: no record of kind {kind!r} in {os.fspath(path)!r}, and stepprof "
            f"writes no such kind; its records are of kind {', '.join(map(repr, sorted(kinds)))}", stacklevel=2)

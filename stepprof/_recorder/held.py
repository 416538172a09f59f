"""Records that wait for a field known only later: energy, whose sample comes after the step.

A step's record is built once its events have completed; when a late field is not known yet,
it waits here as one flat tuple: its encoded line, its name, batch size and whether it is timed,
the lines of the records after it (memory), and the late hook's token (ints).  The GC untracks
such a tuple at its first young collection, so waiting records never trigger its full
collections, as steps that waited as objects did (bench/long_loop.py).  Every later record waits
behind the oldest, to keep the log's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

from .._log import CHUNK_RECORDS, encode_line
from .hooks import Hook
from .sinks import LogSink, SummarySink, Write
from .step import Step


class HeldRecords:
    """The waiting records, oldest first, and how they are completed and written.

    Args:
        log, summary: the collector's sinks.

    ``late`` is the hook whose fields come late (set by the collector's ``use``), or None.
    """

    def __init__(self, log: LogSink, summary: SummarySink) -> None:
        #: (line, name, batch_size, timed, lines after it, their count, *the late hook's token).
        self.entries: deque[tuple[Any, ...]] = deque()
        self.late: Hook | None = None
        self._log = log
        self._summary = summary

    def __bool__(self) -> bool:
        return bool(self.entries)

    def hold(self, s: Step, record: dict[str, Any], token: tuple[Any, ...] | None,
             after: Callable[[Step, Write], None] | None) -> None:
        """Keep a built record until its late fields are known: folded into the summary now,
        its line and those of the records after it (``after``: the after hooks') encoded now."""
        timed = self._summary.add_step(record)
        encode = self._log.encode
        entry: tuple[Any, ...] = (encode(record), s.name, s.batch_size, timed)
        if after is not None:
            records: list[dict[str, Any]] = []
            after(s, records.append)
            for r in records:
                self._summary.add(r)
            entry += (b"".join([encode(r) for r in records]), len(records))
        else:
            entry += (b"", 0)
        self.entries.append(entry + token if token is not None else entry)

    def write(self, final: bool, until: Any = None, why: str | None = None) -> bool:
        """Write the waiting records, oldest first, whose late fields are known now, in one
        batch of the log's; returns whether it stopped early, once ``until`` (a flag) was set.

        ``final``: all of them, a late field not known yet null (at close, after the hook's
        :meth:`~Hook.on_finish`; at a signal, for ``why``: the process may end before the
        sample that would complete them).  Never inside another batch of the log's.
        """
        log = self._log
        log.begin_batch()
        try:
            return self._write(final, until, why)
        finally:
            log.end_batch()

    def _write(self, final: bool, until: Any, why: str | None) -> bool:
        entries = self.entries
        log = self._log
        late = self.late
        n = 0
        while entries:
            if until is not None and until.is_set():
                return True
            if late is not None and why is None:  # the common records, as many as it can in one go
                out: list[bytes] = []
                done, lines = late.fill_many(entries, final, CHUNK_RECORDS - n % CHUNK_RECORDS,
                                             self._summary.add_late, out, self._summary.fold_plan())
                if done:
                    log.write_lines(b"".join(out), lines)
                    n += done
                    if not n % CHUNK_RECORDS:
                        log.end_batch()
                        log.begin_batch()
                    continue
            n += 1
            if not n % CHUNK_RECORDS:  # a long run of lines goes out as it goes
                log.end_batch()
                log.begin_batch()
            entry = entries[0]
            line, name, batch, timed, after, n_after = entry[:6]
            token = entry[6:]
            filled = late.fill(token, final, why) if token else ({}, {})  # type: ignore[union-attr]
            if filled is None:
                return False
            entries.popleft()
            fields, reasons = filled
            if reasons:  # (rare: a sampler that stopped) the reasons go inside "unavailable"
                record = orjson.loads(line)
                record.update(fields)
                record["unavailable"].update(reasons)
                line = encode_line(record)
            elif fields and line:  # '{...}\n' -> '{..., "energy_j": ...}\n'
                line = b"%b,%b\n" % (line[:-2], orjson.dumps(fields)[1:])
            if fields:
                self._summary.add_late({**fields, "unavailable": reasons}, name, batch, timed)
            log.write_lines(line + after, 1 + n_after)
        return False

    def clear(self) -> None:
        self.entries.clear()

"""JSON-lines log: one record per line, each written whole by a writer thread; and its reader."""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any

import orjson

from ._errors import ConfigError

__all__ = ["SCHEMA_VERSION", "JsonlWriter", "read"]

#: Version of the record schema; every line carries it as ``schema_version``.
SCHEMA_VERSION = 1



class JsonlWriter:
    """Appends records to ``path`` as JSON lines, off the training thread.

    The file is opened at construction, so a path that cannot be written fails
    before training starts.  :meth:`write` only queues the record (a deque
    append); a daemon thread serialises queued records every
    ``FLUSH_INTERVAL_S`` and writes each line with one ``write()`` system call,
    unbuffered, so a line is whole and in the page cache within that interval.
    A ``write()`` system call cost 25-30 µs on the H200 host, too much to pay on
    the training thread every step.  :meth:`close` drains everything.  A write
    that fails (disk full) warns once and stops logging; it never raises into
    the training loop.
    """

    #: Longest time a queued record waits before it is written.
    FLUSH_INTERVAL_S = 0.02

    def __init__(self, path: str | os.PathLike[str], *, argument: str = "log") -> None:
        self.path = os.fspath(path)
        try:
            self._fd: int | None = os.open(
                self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
            )
        except OSError as e:
            raise ConfigError(
                f"{argument!r} cannot be written: {self.path!r} ({e.strerror}). "
                f"Pass a path in an existing, writable directory."
            ) from e
        self.failed: str | None = None
        self._warned = False
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def write(self, record: dict[str, Any]) -> None:
        """Queue ``record``; it reaches the file within ``FLUSH_INTERVAL_S``."""
        if self.failed is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"stepprof: {self.failed}; logging stopped", RuntimeWarning, stacklevel=3)
            return
        if self._fd is None:
            return
        self._queue.append(record)
        if self._thread is None or self._pid != os.getpid():
            if self._pid != os.getpid():  # a forked child: no writer thread here
                self.flush()
                return
            self._thread = threading.Thread(target=self._run, name="stepprof-log", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.FLUSH_INTERVAL_S):
            self.flush()

    def flush(self) -> None:
        """Write every queued record now, one whole line per system call."""
        with self._lock:
            queue = self._queue
            while queue and self._fd is not None:
                line = orjson.dumps(queue.popleft(), option=orjson.OPT_APPEND_NEWLINE)
                try:
                    view = memoryview(line)
                    while view:
                        view = view[os.write(self._fd, view):]
                except OSError as e:
                    self.failed = f"writing {self.path!r} failed: {e.strerror}"
                    queue.clear()
                    self._close_fd()

    def close(self) -> None:
        """Stop the writer thread, write everything queued, close the file."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self.flush()
        with self._lock:
            self._close_fd()
        if self.failed is not None and not self._warned:
            self._warned = True
            warnings.warn(f"stepprof: {self.failed}; logging stopped", RuntimeWarning, stacklevel=2)

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:  # pragma: no cover - nothing useful to do
                pass


def read(path: str | os.PathLike[str], *, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Stream the records of a stepprof log as dicts, in file order.

    Lines that do not parse (a torn last line after a crash, say) are skipped,
    and one warning at the end says how many.

    Args:
        path: a JSON-lines log written by stepprof.
        kind: keep only records of this kind, e.g. ``"step"`` or ``"summary"``.

    Example:
        >>> import stepprof, tempfile, os
        >>> log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with stepprof.Profiler(log) as prof:
        ...     with prof.step(batch_size=8):
        ...         pass
        >>> [r["kind"] for r in stepprof.read(log)]
        ['step', 'summary']
    """
    skipped = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(record, dict):
                skipped += 1
                continue
            if kind is None or record.get("kind") == kind:
                yield record
    if skipped:
        warnings.warn(
            f"stepprof.read: skipped {skipped} line(s) of {os.fspath(path)!r} that are not JSON objects",
            RuntimeWarning,
            stacklevel=2,
        )

"""Where the reader tools write: paths derived from the user's arguments, never chosen by a log.

A log is untrusted (logs travel: they are attached to bug reports).  A name taken from it
(a ``run_id``, a rank, a step or phase name) is made into one path component of a fixed
alphabet and length by :func:`component`, a list of them is made unique by
:func:`components`, and :func:`inside` refuses a path that resolves outside the output
folder the user named (a name that sanitising missed, or a symbolic link placed there).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import IO, Final

from ._errors import ConfigError

__all__ = ["COMPONENT_MAX", "cache_root", "component", "components", "inside", "whole_file"]

#: Characters of a path component made from a log's name.
COMPONENT_MAX: Final = 64
_SAFE: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def component(text: str) -> str:
    """``text`` as one path component: ``[A-Za-z0-9._-]`` only (any other character becomes
    ``_``), no leading dot, at most :data:`COMPONENT_MAX` characters, never empty.

    Example:
        >>> component("../../etc/passwd"), component("/abs/run"), component("5f0c2e9a41b7")
        ('_._.._etc_passwd', '_abs_run', '5f0c2e9a41b7')
    """
    out = "".join(c if c in _SAFE else "_" for c in text[:COMPONENT_MAX])
    if out.startswith("."):
        out = "_" + out[1:]
    return out or "_"


def components(texts: Iterable[str]) -> list[str]:
    """Each of ``texts`` as a :func:`component`, made unique in order: a repeat gets ``-2``, ``-3``, ...

    Example:
        >>> components(["a/b", "a_b", "a?b"])
        ['a_b', 'a_b-2', 'a_b-3']
    """
    taken: set[str] = set()
    out = []
    for text in texts:
        base = name = component(text)
        n = 1
        while name in taken:
            n += 1
            suffix = f"-{n}"
            name = base[: COMPONENT_MAX - len(suffix)] + suffix
        taken.add(name)
        out.append(name)
    return out


def inside(folder: str, path: str, argument: str) -> str:
    """``path``, once it is sure to resolve inside ``folder`` (symbolic links followed); else
    :class:`~stepprof.ConfigError` naming ``argument``, the user's option that named ``folder``."""
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ConfigError(
            f"{argument!r} {folder!r}: {path!r} resolves to {real!r}, outside it (a symbolic link?); "
            f"pass a new, empty directory"
        )
    return path


def cache_root() -> str:
    """stepprof's cache directory: ``$STEPPROF_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepprof``,
    else ``~/.cache/stepprof`` (``%LOCALAPPDATA%\\stepprof`` on Windows)."""
    explicit = os.environ.get("STEPPROF_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "stepprof")
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):  # pragma: no cover - Windows
        return os.path.join(os.environ["LOCALAPPDATA"], "stepprof")
    return os.path.join(os.path.expanduser("~"), ".cache", "stepprof")


@contextlib.contextmanager
def whole_file(path: str) -> Iterator[IO[bytes]]:
    """A binary file to write ``path`` through, whole or not at all: written beside it and
    renamed over it once the block ends, removed if the block raises (a reader never sees half)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

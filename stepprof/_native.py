"""stepprof's C module: ``_fold.c`` (the summary's fold, a step's record, the readers' check)
and ``_core.c`` (the step core: the training thread's boundaries), built with the system's C
compiler into one extension, cached, loaded.

Both need only Python's headers (no torch), so the report loads it without torch.
:func:`build` compiles it into :func:`cache_dir` (per Python version and source); the
profiler's background build and ``stepprof build`` call it.  :func:`module` loads it, never
compiling, once per process; without it, the aggregate folds and the collector builds in
Python, with the same results (tests/test_fold.py); :func:`use` tells them when it changes.  What is cached: ``<stepprof's cache>/fold/<python tag>-<source hash>/``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from types import ModuleType

from ._errors import BuildError, raised_by_user
from ._paths import cache_root
from ._signals import start_thread

__all__ = ["ABI", "BUILD_ENV", "background_builds", "build", "build_in_background", "cache_dir", "child_env", "load_extension", "module", "reason", "reload", "reset", "use"]

#: The C API version this module speaks; ``_fold.c``'s ``ABI`` must equal it.
ABI = 1
_NAME = "stepprof_fold"
_SOURCES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("_fold.c", "_core.c"))


def cache_dir() -> str:
    """``<stepprof's cache>/fold/<python tag>-<sources' hash>``: a new Python or stepprof gets its own."""
    h = hashlib.sha256()
    for source in _SOURCES:
        with open(source, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:12]
    tag = f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
    return os.path.join(cache_root(), "fold", f"{tag}-{digest}")


def _path() -> str:
    return os.path.join(cache_dir(), _NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _compiler() -> list[str] | None:
    """The C compiler's command: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH."""
    explicit = os.environ.get("CC")
    if explicit:
        words = shlex.split(explicit)
        return words if words and shutil.which(words[0]) else None
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return [name, "-x", "c"]
    return None


def build() -> str:
    """Compile ``_fold.c`` and ``_core.c`` into :func:`cache_dir` (a no-op when it is there); returns its path.

    Raises:
        BuildError: no C compiler or Python headers (the message names the fix), or the compile failed.
    """
    path = _path()
    if os.path.isfile(path):
        reset()  # (an answer found before another process built it)
        return path
    cc = _compiler()  # (C++ compilers compile it as C)
    if cc is None:
        raise BuildError("cannot build the C fold: no C compiler (`apt-get install gcc`, or point $CC at one)")
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        raise BuildError(f"cannot build the C fold: no Python.h in {include} (`apt-get install python3-dev`)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    cmd = [*cc, "-O2", "-shared", "-fPIC", *flags, "-I", include, *_SOURCES, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise BuildError(f"compiling {' and '.join(_SOURCES)} failed ({shlex.join(cmd)}):\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or not at all: another process may be loading it
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    reset()
    return path


#: What uses the C module: each is called (with no argument) whenever it may have changed.
_USERS: list[Callable[[], object]] = []


def use(fn: Callable[[], object]) -> None:
    """Call ``fn()`` now, and again once a build has finished (:func:`reload`)."""
    _USERS.append(fn)
    fn()


def reload() -> None:
    """Look for the built module again, and tell its users (:func:`use`)."""
    reset()
    for fn in _USERS:
        fn()


#: ``STEPPROF_BUILD=0`` in the environment: profilers never build anything themselves.
BUILD_ENV = "STEPPROF_BUILD"


def background_builds() -> bool:
    """Whether a profiler may build in the background (``STEPPROF_BUILD`` is not ``0``)."""
    return os.environ.get(BUILD_ENV, "").strip() != "0"


def child_env() -> tuple[str, dict[str, str]]:
    """(the checkout's root, the environment) for a build's child process, which imports
    this stepprof (the root first on its ``PYTHONPATH``) whatever the caller's path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return root, env


def build_in_background() -> None:
    """Build in a child process (never on the calling thread), then :func:`reload`, from a
    thread that waits for it; best effort: a failure leaves the Python paths."""

    def wait() -> None:
        try:
            done = subprocess.run(
                [sys.executable, "-c", "from stepprof import _native; _native.build()"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=600, check=False, env=env,
                start_new_session=True,  # the user's Ctrl-C is not the build's
            )
        except Exception as e:  # noqa: BLE001 - the Python fold goes on
            if raised_by_user(e):
                raise
            return
        if done.returncode == 0:
            reload()

    _, env = child_env()
    start_thread(threading.Thread(target=wait, name="stepprof-build-fold", daemon=True))


class _Loaded:
    """:func:`module`'s answer, found once per process (:func:`reset` forgets it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answer: tuple[ModuleType | None, str | None] | None = None


_LOADED = _Loaded()


def load_extension(name: str, path: str) -> tuple[ModuleType | None, str | None]:
    """The extension module ``name`` at ``path``, or (None, the error, as "Type: message"):
    a corrupt or foreign library is a reason, never a crash."""
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        if spec is None:  # pragma: no cover - a path the import system refuses
            return None, "not an extension module"
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - a reason, not a crash
        if raised_by_user(e):
            raise
        return None, f"{type(e).__name__}: {e}"
    return mod, None


def _load() -> tuple[ModuleType | None, str | None]:
    path = _path()
    if not os.path.isfile(path):
        return None, "the C fold is not built for this Python: the summary and report fold in Python (`stepprof build`)"
    mod, error = load_extension(_NAME, path)
    if mod is None:
        return None, f"the C fold at {path} did not load ({error}): run `stepprof build`"
    if getattr(mod, "ABI", None) != ABI:
        return None, f"the C fold at {path} speaks C API {getattr(mod, 'ABI', None)}, not {ABI}: run `stepprof build`"
    return mod, None


def _answer() -> tuple[ModuleType | None, str | None]:
    answer = _LOADED.answer
    if answer is None:
        with _LOADED.lock:
            if _LOADED.answer is None:
                _LOADED.answer = _load()
            answer = _LOADED.answer
    return answer


def module() -> ModuleType | None:
    """The loaded C fold, or None (then :func:`reason` says why).  Never compiles, never raises."""
    return _answer()[0]


def reason() -> str | None:
    """Why :func:`module` is None (None when it loaded)."""
    return _answer()[1]


def reset() -> None:
    """Forget the answer: the next :func:`module` looks again (after a build)."""
    with _LOADED.lock:
        _LOADED.answer = None

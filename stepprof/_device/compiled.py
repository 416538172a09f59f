"""The compiled step boundary: :meth:`Backend.cross` as one C call.

A step's two boundaries make CUDA calls from Python (event records, the allocator's
stats as a nested dict, a peak reset, NVTX ranges) that cost about 18 µs of host time
on an H200; one C call per boundary does the same work in about 4.5 µs (see :data:`SAVING_US`).
``boundary.cpp``, a plain CPython extension (no pybind11), is that call; :func:`build`
compiles it once per torch, CUDA, Python and source version into :func:`cache_dir`, and
:func:`load` loads it, never compiling.  On a CPU torch the same source builds the host
core (``STEPPROF_CUDA=0``): the host boundary's RSS read, which keeps the GIL.

The first profiler that could use it builds it itself, in a child process
(:func:`build_in_background`): never on the training thread, once per cache key.  No
CUDA toolkit is needed: without complete runtime headers (the CUDA 13 wheels lack
``crt/``) the boundary declares the few runtime calls it makes and finds them in the
``libcudart`` that torch loads (:func:`_cuda_build`).  ``STEPPROF_BUILD=0`` turns that off;
``stepprof build`` builds it ahead of time.  :class:`CompiledCudaBackend` is
:class:`~stepprof._device.cuda.CudaBackend` with its per-boundary calls on the
extension: marks are ``cudaEvent_t`` handles, as ints, from a reusable pool.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs
import torch

from .. import _native, _registry
from .._errors import BuildError, raised_by_user
from .._records import COMPILED_SAVES_US
from .._roofline import cache_dir as _stepprof_cache_dir
from .._signals import start_thread
from .backend import MARK, POP, PUSH, READ, RESET, Memory
from .cuda import CudaBackend

__all__ = [
    "ABI",
    "SAVING_US",
    "BuildReport",
    "CompiledCudaBackend",
    "build",
    "build_in_background",
    "cache_dir",
    "load",
    "status",
]

#: The C API version this module speaks; ``boundary.cpp``'s ``ABI`` must equal it.
ABI = 2

#: Host time a profiled step saves with the compiled boundary, in µs, on an H200 (torch
#: 2.11.0+cu130, Python 3.12, 2026-12-01): in a tight loop, the median ``overhead_us`` of an
#: empty step, 21.3 (Python) vs 7.5 (compiled), the boundary calls alone (entry
#: MARK|RESET|PUSH plus exit MARK|READ|POP) 18.3 vs 4.5; in the launch-bound loop of
#: bench/overhead.py, the added time of a step record (:data:`stepprof._records.COMPILED_SAVES_US`).
SAVING_US = {"h200_tight_loop": 13.9, "h200_launch_bound_step": COMPILED_SAVES_US}

_NAME = "stepprof_boundary"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boundary.cpp")
_FLAGS = {"MARK": MARK, "READ": READ, "RESET": RESET, "PUSH": PUSH, "POP": POP}
_RANGES = PUSH | POP
#: What a boundary with nothing left to do returns (a top-level phase's entry without NVTX).
_NOTHING: tuple[None, None] = (None, None)


@attrs.frozen
class BuildReport:
    """Where :func:`build` put the compiled boundary, and how long it took."""

    path: str
    seconds: float


def cache_dir() -> str:
    """Where the boundary is built for this torch, CUDA, Python and ``boundary.cpp``.

    ``<stepprof's cache>/boundary/torch-<version>-cuda-<version>-<python tag>-<source hash>``,
    stepprof's cache being ``$STEPPROF_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepprof``, else
    ``~/.cache/stepprof``: a new torch, CUDA, Python or stepprof gets its own build.
    """
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    tag = f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}"
    key = f"torch-{torch.__version__}-cuda-{torch.version.cuda}-{tag}-{digest}"
    return os.path.join(_stepprof_cache_dir(), "boundary", key)


def _library_path(directory: str) -> str:
    return os.path.join(directory, _NAME + (".pyd" if os.name == "nt" else ".so"))


def _versions() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} (CPU)"
    return f"torch {torch.__version__} with CUDA {torch.version.cuda}"


def _mismatch(module: Any) -> str | None:
    """Why ``module`` is not the extension this stepprof speaks to, or None."""
    abi = getattr(module, "ABI", None)
    if abi != ABI:
        return f"it speaks C API {abi}, this stepprof needs {ABI}"
    for name, value in _FLAGS.items():
        if getattr(module, name, None) != value:
            return f"its flag {name} is {getattr(module, name, None)}, stepprof's is {value}"
    if getattr(module, "CUDA", True) != (torch.version.cuda is not None):
        return "it was built for another kind of torch (CUDA or CPU)"
    return None


def _complete(include: str) -> bool:
    """Whether a CUDA include folder has what ``cuda_runtime_api.h`` includes (the CUDA 13
    wheels ship it without ``crt/``, which comes with the compiler)."""
    return os.path.isfile(os.path.join(include, "cuda_runtime_api.h")) and os.path.isfile(
        os.path.join(include, "crt", "host_defines.h"))


def _wheel_cuda() -> tuple[list[str], str] | None:
    """The include folders and the ``libcudart`` of the nvidia-* wheels beside torch
    (``nvidia/cuda_runtime`` for CUDA 12, ``nvidia/cu13`` for CUDA 13), or None."""
    major = (torch.version.cuda or "").split(".")[0]
    for root in dict.fromkeys([os.path.dirname(os.path.dirname(torch.__file__)), *sys.path]):
        headers = sorted(glob.glob(os.path.join(root, "nvidia", "*", "include", "cuda_runtime_api.h")))
        for header in headers:
            base = os.path.dirname(os.path.dirname(header))
            libs = sorted(glob.glob(os.path.join(base, "lib", f"libcudart.so.{major}*")))
            if libs:
                own = os.path.join(base, "include")
                includes = sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")))
                return [own] + [i for i in includes if i != own], libs[0]
    return None


def _toolkit_cuda() -> tuple[list[str], str] | None:
    """The include folder and ``libcudart`` of a CUDA toolkit (``$CUDA_HOME``), or None."""
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None:
        return None
    for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        path = os.path.join(home, lib, "libcudart.so")
        if os.path.exists(path):
            return [os.path.join(home, "include")], path
    return None


@attrs.frozen
class _CudaBuild:
    """How the CUDA boundary is compiled here: against complete runtime headers (the wheels',
    else a toolkit's), or, without them, against the runtime that torch loads, by soname."""

    how: str
    cflags: list[str]
    includes: list[str]
    ldflags: list[str]


def _cuda_build() -> _CudaBuild:
    for found, how in ((_wheel_cuda(), "the nvidia-* wheels' headers"), (_toolkit_cuda(), "the CUDA toolkit's headers")):
        if found is not None and _complete(found[0][0]):
            includes, cudart = found
            return _CudaBuild(how, ["-DSTEPPROF_CUDA_HEADERS=1"], includes,
                              ["-lc10_cuda", cudart, f"-Wl,-rpath,{os.path.dirname(cudart)}"])
    major = int((torch.version.cuda or "0").split(".")[0])
    return _CudaBuild(f"no CUDA headers: the runtime torch loads (libcudart.so.{major})",
                      ["-DSTEPPROF_CUDA_HEADERS=0", f"-DSTEPPROF_CUDART_MAJOR={major}"], [], ["-ldl"])


def _missing_tool() -> str | None:
    """What :func:`build` lacks, in one sentence with the fix, or None."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or "c++"
    words = shlex.split(cxx) or ["c++"]
    if shutil.which(words[0]) is None:
        where = f"$CXX is {cxx!r}, not found" if os.environ.get("CXX") else "no `c++` on PATH"
        return (
            f"no C++ compiler ({where}): install one (`apt-get install g++`) "
            f"or point $CXX at it"
        )
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed: `pip install ninja`"
    return None


def _lock(directory: str) -> Any:
    """An exclusive lock beside ``directory`` (held until the returned file is closed): one
    build at a time per cache key, across processes (ranks of one job, say)."""
    import fcntl

    os.makedirs(os.path.dirname(directory), exist_ok=True)
    f = open(directory + ".lock", "w")  # noqa: SIM115 - closed by the caller
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _failed_path(directory: str) -> str:
    return directory + ".failed"


def build(verbose: bool = False) -> BuildReport:
    """Compile the boundary into :func:`cache_dir` (a no-op when it is up to date there).

    On a CUDA torch it is the CUDA boundary (:func:`_cuda_build`: no CUDA toolkit is
    needed); on a CPU torch, the host core.

    Raises:
        BuildError: a compiler or ninja is missing (the message names the fix), or the
            compile failed.
    """
    missing = _missing_tool()
    if missing is not None:
        raise BuildError(f"cannot build the compiled boundary: {missing}")
    from torch.utils import cpp_extension

    cflags = ["-O2", f"-DSTEPPROF_CUDA={0 if torch.version.cuda is None else 1}"]
    includes: list[str] = []
    ldflags: list[str] = []
    if torch.version.cuda is not None:
        how = _cuda_build()
        cflags += how.cflags
        includes, ldflags = how.includes, how.ldflags
    directory = cache_dir()
    start = time.perf_counter()
    with _lock(directory):
        os.makedirs(directory, exist_ok=True)
        stale = os.path.join(directory, "lock")  # torch's own baton, left by a killed build
        if os.path.exists(stale):
            os.remove(stale)
        try:
            module = cpp_extension.load(
                name=_NAME,
                sources=[_SOURCE],
                build_directory=directory,
                with_cuda=False,
                extra_cflags=cflags,
                extra_include_paths=includes,
                extra_ldflags=ldflags,
                verbose=verbose,
            )
        except Exception as e:  # noqa: BLE001 - the compiler's message, as one error
            if raised_by_user(e):
                raise
            raise BuildError(
                f"compiling {_SOURCE} for {_versions()} failed: {e}"
                + ("" if verbose else "\n(`stepprof build --verbose` shows every command)")
            ) from e
        if os.path.exists(_failed_path(directory)):
            os.remove(_failed_path(directory))
    seconds = time.perf_counter() - start
    wrong = _mismatch(module)
    if wrong is not None:
        raise BuildError(f"the boundary built in {directory} is not the one stepprof expects: {wrong}")
    _LOADED.set(module, None)
    return BuildReport(path=_library_path(directory), seconds=seconds)


class _Loaded:
    """:func:`load`'s answer, found once per process (reset by ``_registry.reset()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answer: tuple[ModuleType | None, str | None] | None = None

    def get(self) -> tuple[ModuleType | None, str | None]:
        answer = self._answer
        if answer is None:
            with self._lock:
                if self._answer is None:
                    try:
                        self._answer = _load()
                    except Exception as e:  # noqa: BLE001 - load() never raises
                        if raised_by_user(e):
                            raise
                        self._answer = (None, f"the compiled boundary could not be loaded ({type(e).__name__}: {e})")
                answer = self._answer
        return answer

    def set(self, module: ModuleType | None, reason: str | None) -> None:
        with self._lock:
            self._answer = (module, reason)

    def reset(self) -> None:
        with self._lock:
            self._answer = None


_LOADED = _registry.register_state(_Loaded())


def load() -> tuple[ModuleType | None, str | None]:
    """The compiled boundary, or (None, why not).  Never compiles, never raises.

    The answer is found once per process: the extension built by :func:`build` for this
    torch, CUDA and Python, if its C API and flags are the ones this module speaks.
    """
    return _LOADED.get()


def _load() -> tuple[ModuleType | None, str | None]:
    path = _library_path(cache_dir())
    if not os.path.isfile(path):
        return None, f"the compiled boundary is not built for {_versions()}: run `stepprof build`"
    module, error = _native.load_extension(_NAME, path)
    if module is None:
        return None, f"the compiled boundary for {_versions()} did not load ({error}): run `stepprof build`"
    wrong = _mismatch(module)
    if wrong is not None:
        return None, f"the compiled boundary at {path} is stale ({wrong}): run `stepprof build`"
    return module, None


def status() -> dict[str, Any]:
    """For ``stepprof env``: whether the compiled boundary is built and loads, where, or why not."""
    module, reason = load()
    return {
        "built": module is not None,
        "path": _library_path(cache_dir()) if module is not None else None,
        "reason": reason,
    }


#: ``STEPPROF_BUILD=0`` in the environment: profilers never build the boundary themselves.
BUILD_ENV = _native.BUILD_ENV


class _Background:
    """This process's background build: at most one, started by the first profiler that
    could use the compiled boundary (:func:`build_in_background`).

    ``module`` is set, from the thread that waits for the build, once the built library
    has loaded; a profiler takes it at a step boundary.  ``reason`` says why none runs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = False
        self.module: ModuleType | None = None
        self.reason: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: str | None = None

    def reset(self) -> None:
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        self.started, self.module, self.reason, self.proc, self.log = False, None, None, None, None

    def after_fork(self) -> None:
        """In a forked child: the parent's build is not this process's (and the lock may
        have been held by a parent thread at the fork)."""
        self._lock = threading.Lock()
        self._forget()

    def _wait(self, proc: subprocess.Popen[bytes], directory: str) -> None:
        """The waiting thread: once the child is done, load what it built (off the training thread)."""
        try:
            rc = proc.wait()
            if rc == 0:
                _LOADED.reset()
                _native.reload()  # the summary folds in C from its next record
                module, why = load()
            else:
                module, why = None, _failure(directory) or f"the background build exited with status {rc}"
        except Exception as e:  # noqa: BLE001 - a reason, never a crash
            if raised_by_user(e):
                raise
            module, why = None, f"the background build could not be waited for ({type(e).__name__}: {e})"
        with self._lock:
            self.module, self.reason = module, why


_BACKGROUND = _registry.register_state(_Background())
# A forked child's profilers are inert, and the build's waiting thread is the parent's.
os.register_at_fork(after_in_child=_BACKGROUND.after_fork)


def _failure(directory: str) -> str | None:
    """Why the last background build for this key failed (its marker), or None."""
    try:
        with open(_failed_path(directory), encoding="utf-8", errors="replace") as f:
            first = f.read(2000).strip().splitlines()
    except OSError as e:
        if raised_by_user(e):
            raise
        return None
    return (
        f"the background build failed ({first[0] if first else 'no message'}; the log: "
        f"{directory}.log): `stepprof build --verbose` shows why and retries"
    )


def build_in_background() -> tuple[_Background | None, str | None]:
    """Start building the boundary in a child process, unless it is built, being built,
    turned off or impossible here.

    Returns ``(state, None)`` while a build runs or once it is done (``state.module`` is
    set when it has loaded), or ``(None, why)`` when none will: ``STEPPROF_BUILD=0``, a
    missing compiler or ninja (the fix named), or an earlier background
    build for this key that failed (``stepprof build`` retries it).  Never raises, never
    compiles on the calling thread: the child runs ``stepprof build``, its output in
    ``<cache_dir()>.log``.
    """
    bg = _BACKGROUND
    with bg._lock:
        if bg.started:
            return (bg, None) if bg.reason is None else (None, bg.reason)
        bg.started = True
        try:
            why = _start(bg)
        except Exception as e:  # noqa: BLE001 - the Python boundary goes on
            if raised_by_user(e):
                raise
            why = f"the background build could not start ({type(e).__name__}: {e})"
        bg.reason = why
        return (bg, None) if why is None else (None, why)


def _start(bg: _Background) -> str | None:
    module, _ = load()
    if module is not None:
        bg.module = module
        if _native.module() is None and _native.background_builds():
            _native.build_in_background()  # (the boundary is built, the C fold is not)
        return None
    if not _native.background_builds():
        return f"{BUILD_ENV}=0 turned the background build off: `stepprof build` builds it"
    missing = _missing_tool()
    if missing is not None:
        return f"the boundary cannot be built here: {missing}"
    directory = cache_dir()
    failed = _failure(directory)
    if failed is not None:
        return failed
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    root, env = _native.child_env()
    bg.log = directory + ".log"
    with open(bg.log, "wb") as out:
        bg.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from stepprof._device.compiled import _child; sys.exit(_child())"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
            start_new_session=True,  # the user's Ctrl-C is not the build's
        )
    start_thread(threading.Thread(target=bg._wait, args=(bg.proc, directory),
                                  name="stepprof-build", daemon=True))
    return None


def _child() -> int:
    """The background build's process: build the C fold and the boundary, or leave a marker
    saying why not."""
    directory = cache_dir()
    try:  # (the fold's failure leaves the Python fold; the boundary is built all the same)
        print(f"stepprof build: the C fold is ready in {_native.build()}")
    except BuildError as e:
        print(f"stepprof build: {e}", file=sys.stderr)
    try:
        report = build()
    except BuildError as e:
        with open(_failed_path(directory), "w", encoding="utf-8") as f:
            f.write(str(e) + "\n")
        print(f"stepprof build: {e}", file=sys.stderr)
        return 1
    print(f"stepprof build: the compiled boundary is ready in {report.path} ({report.seconds:.1f} s)")
    return 0


class CompiledCudaBackend(CudaBackend):
    """:class:`CudaBackend` whose per-boundary work is one call into the compiled boundary.

    Marks are ``cudaEvent_t`` handles (ints) from a pool: an event goes back to it once
    the recorder has read it, or at once when a boundary recorded nothing (inside a CUDA
    graph capture).  NVTX ranges go through the extension too, unless it was built
    without NVTX headers (then through torch's bindings).
    """

    boundary = "compiled"

    def __init__(
        self, device_index: int, module: Any, *, nvtx: bool = True, syncs: str = "warn"
    ) -> None:
        super().__init__(device_index, nvtx=nvtx, syncs=syncs)
        self._use(module)

    @classmethod
    def adopt(cls, backend: CudaBackend, module: Any) -> CompiledCudaBackend:
        """``backend``'s successor on the compiled boundary, from the next step on.

        It keeps ``backend``'s device, settings and sync session (the same objects), so the
        run's figures go on as one; ``backend`` keeps its own events, for the steps that
        began on it (a step ends on the backend it began on).
        """
        new = cls.__new__(cls)
        new.__dict__.update(backend.__dict__)
        new._pool = []
        new._use(module)
        return new

    def _use(self, module: Any) -> None:
        nvtx = self._nvtx
        self._module = module
        self._boundary = module.boundary
        self._create = module.event_create
        self._query: Callable[[int], bool] = module.event_query
        self._elapsed: Callable[[int, int], float] = module.event_elapsed_ms
        self._synchronize = module.event_synchronize
        self._destroy = module.event_destroy
        # Backend.read_marks as the extension's own function: one C call per step, no frame.
        self.read_marks = module.read_marks  # type: ignore[method-assign]
        self._events: list[int] = []
        self.event_pool = self._events  # (release_marks: the distinct handles, into the pool)
        c_ranges = nvtx and bool(getattr(module, "NVTX", False))
        #: The flags the C call takes; ranges it cannot push go through torch (_py_ranges).
        self._mask = ~0 if c_ranges else ~_RANGES
        self._py_ranges = _RANGES if nvtx and not c_ranges else 0

    def cross(self, flags: int, name: str | None = None) -> tuple[Any | None, Memory | None]:
        if flags & self._py_ranges:
            return self._cross_with_torch_ranges(flags, name)
        flags &= self._mask
        if not flags & MARK:
            return self._boundary(self.index, 0, flags, name) if flags else _NOTHING
        events = self._events
        ev = events.pop() if events else self._create(self.index)
        try:
            mark, mem = self._boundary(self.index, ev, flags, name)
        except BaseException:
            events.append(ev)
            raise
        if mark is None:
            events.append(ev)
        return mark, mem

    def core_plan(self) -> tuple[Any, ...]:
        if type(self).cross is not CompiledCudaBackend.cross or self._py_ranges:
            return (2, self.cross)
        return (1, self._boundary, self._events, self._create, self.index, self._mask)

    def _cross_with_torch_ranges(self, flags: int, name: str | None) -> tuple[Any | None, Memory | None]:
        if flags & POP:
            self.range_pop()
        result = self.cross(flags & ~_RANGES, name)
        if flags & PUSH:
            self.range_push(name)  # type: ignore[arg-type]
        return result

    def mark(self) -> int | None:
        return self.cross(MARK)[0]

    def is_done(self, mark: Any) -> bool:
        return mark is None or self._query(mark)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return self._elapsed(start, end)

    def release(self, mark: Any) -> None:
        if mark is not None:
            self._events.append(mark)

    def release_marks(self, marks: tuple[Any, ...], keep: Any = None) -> None:
        # Handles are ints: a set gives each event back once.
        events = set(marks)
        events.discard(None)
        if keep is not None:
            events.discard(keep)
        self._events.extend(events)

    def wait(self, marks: list[Any]) -> None:
        """Block until these events have completed (``cudaEventSynchronize``, without the GIL)."""
        for m in marks:
            if m is not None:
                self._synchronize(m)

    def read_memory(self) -> Memory:
        mem: Memory = self._boundary(self.index, 0, READ, None)[1]
        return mem

    def reset_peak(self) -> None:
        self._boundary(self.index, 0, RESET, None)

    def __del__(self) -> None:
        # The pooled events (those in flight belong to the recorder until released).
        if sys.is_finalizing():
            return
        events, self._events = getattr(self, "_events", []), []
        self.event_pool = self._events
        for ev in events:
            try:
                self._destroy(ev)
            except Exception as e:  # noqa: BLE001 - a dying context: nothing to free
                if raised_by_user(e):
                    raise

"""The compiled step boundary: :meth:`Backend.cross` as one C call.

A step's two boundaries make CUDA calls from Python (event records, the allocator's
stats as a nested dict, a peak reset, NVTX ranges) that cost about 18 µs of host time
on an H200; one C call per boundary does the same work in about 4.5 µs (see :data:`SAVING_US`).
``boundary.cpp``, a plain CPython extension (no pybind11), is that call; :func:`build`
compiles it once per torch, CUDA, Python and source version (``stepprof build``) into
:func:`cache_dir`, and :func:`load` loads it, never compiling.  :class:`CompiledCudaBackend` is
:class:`~stepprof._device.cuda.CudaBackend` with its per-boundary calls on the
extension: marks are ``cudaEvent_t`` handles, as ints, from a reusable pool.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import sys
import threading
import time
from types import ModuleType
from typing import Any

import attrs
import torch

from .. import _registry
from .._errors import BuildError, raised_by_user
from .._records import COMPILED_SAVES_US
from .._roofline import cache_dir as _stepprof_cache_dir
from .backend import MARK, POP, PUSH, READ, RESET, Memory
from .cuda import CudaBackend

__all__ = [
    "ABI",
    "SAVING_US",
    "BuildReport",
    "CompiledCudaBackend",
    "NothingToBuild",
    "build",
    "cache_dir",
    "load",
    "status",
]

#: The C API version this module speaks; ``boundary.cpp``'s ``ABI`` must equal it.
ABI = 1

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


class NothingToBuild(BuildError):
    """This torch has no CUDA, so there is no compiled boundary to build (internal)."""


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
    return f"torch {torch.__version__} with CUDA {torch.version.cuda}"


def _mismatch(module: Any) -> str | None:
    """Why ``module`` is not the extension this stepprof speaks to, or None."""
    abi = getattr(module, "ABI", None)
    if abi != ABI:
        return f"it speaks C API {abi}, this stepprof needs {ABI}"
    for name, value in _FLAGS.items():
        if getattr(module, name, None) != value:
            return f"its flag {name} is {getattr(module, name, None)}, stepprof's is {value}"
    return None


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
    home = cpp_extension.CUDA_HOME
    if home is None or not os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
        found = "is not set and no toolkit was found" if home is None else f"is {home!r}, which has no include/cuda_runtime_api.h"
        return (
            f"no CUDA headers (CUDA_HOME {found}): install the CUDA {torch.version.cuda} "
            f"toolkit and set $CUDA_HOME to it"
        )
    return None


def build(verbose: bool = False) -> BuildReport:
    """Compile the boundary into :func:`cache_dir` (a no-op when it is up to date there).

    Raises:
        NothingToBuild: this torch is a CPU build.
        BuildError: a compiler, ninja or the CUDA headers are missing (the message names
            the fix), or the compile failed.
    """
    if torch.version.cuda is None:
        raise NothingToBuild(
            f"there is nothing to build: torch {torch.__version__} is a CPU build "
            f"(stepprof compiles its boundary for CUDA only)"
        )
    missing = _missing_tool()
    if missing is not None:
        raise BuildError(f"cannot build the compiled boundary: {missing}")
    from torch.utils import cpp_extension

    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    try:
        module = cpp_extension.load(
            name=_NAME,
            sources=[_SOURCE],
            build_directory=directory,
            with_cuda=True,
            extra_cflags=["-O2"],
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - the compiler's message, as one error
        if raised_by_user(e):
            raise
        raise BuildError(
            f"compiling {_SOURCE} for {_versions()} failed: {e}"
            + ("" if verbose else "\n(`stepprof build --verbose` shows every command)")
        ) from e
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
    if torch.version.cuda is None:
        return None, (
            f"this torch has no CUDA: torch {torch.__version__} is a CPU build, "
            f"so there is no compiled boundary"
        )
    path = _library_path(cache_dir())
    if not os.path.isfile(path):
        return None, f"the compiled boundary is not built for {_versions()}: run `stepprof build`"
    try:
        loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
        spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
        if spec is None:  # pragma: no cover - a path the import system refuses
            return None, f"{path} is not an extension module: run `stepprof build`"
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign library: a reason, not a crash
        if raised_by_user(e):
            raise
        return None, (
            f"the compiled boundary for {_versions()} did not load ({type(e).__name__}: {e}): "
            f"run `stepprof build`"
        )
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
        self._module = module
        self._boundary = module.boundary
        self._create = module.event_create
        self._query = module.event_query
        self._elapsed = module.event_elapsed_ms
        self._synchronize = module.event_synchronize
        self._destroy = module.event_destroy
        self._events: list[int] = []
        c_ranges = nvtx and bool(getattr(module, "NVTX", False))
        #: The flags the C call takes; ranges it cannot push go through torch (_py_ranges).
        self._mask = ~0 if c_ranges else ~_RANGES
        self._py_ranges = _RANGES if nvtx and not c_ranges else 0

    def cross(self, flags: int, name: str | None = None) -> tuple[Any | None, Memory | None]:
        if flags & self._py_ranges:
            return self._cross_with_torch_ranges(flags, name)
        flags &= self._mask
        if not flags & MARK:
            return self._boundary(self.index, 0, flags, name)
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

    def wait(self, marks: list[Any]) -> None:
        """Block until these events have completed (``cudaEventSynchronize``, without the GIL)."""
        for m in marks:
            if m is not None:
                self._synchronize(m)

    def read_memory(self) -> Memory:
        return self._boundary(self.index, 0, READ, None)[1]

    def reset_peak(self) -> None:
        self._boundary(self.index, 0, RESET, None)

    def __del__(self) -> None:
        # The pooled events (those in flight belong to the recorder until released).
        if sys.is_finalizing():
            return
        events, self._events = getattr(self, "_events", []), []
        for ev in events:
            try:
                self._destroy(ev)
            except Exception as e:  # noqa: BLE001 - a dying context: nothing to free
                if raised_by_user(e):
                    raise

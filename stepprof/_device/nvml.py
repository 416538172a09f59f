"""The one module that imports ``pynvml`` (the nvidia-ml-py distribution).

NVML is what nvidia-smi reads.  stepprof asks it about the GPU that torch trains
on: how much memory NVML attributes to *this process* (the figure nvidia-smi
prints next to the PID), how much the device has in use, its enforced power
limit and the other compute processes on it (:func:`read`), and its total
energy counter (:func:`energy_counter`, read by the energy sampler's thread).

- **Lazy.**  ``pynvml`` is imported and ``nvmlInit`` called at the first
  :func:`read`, behind a lock, never at import and never for a job without
  CUDA.  The outcome (a working library, or why not) is cached; ``nvmlShutdown``
  runs at interpreter exit, only if stepprof's ``nvmlInit`` succeeded.
- **Matched by identity, never by index.**  NVML numbers GPUs in PCI order and
  ignores ``CUDA_VISIBLE_DEVICES``; torch numbers the visible ones.  So the
  device is looked up by the UUID torch reports (``GPU-<uuid>``, or
  ``MIG-<uuid>`` for a MIG instance), else by its PCI bus id.
- **Errors become reasons.**  Every NVML call goes through :func:`_query`, which
  turns an ``NVMLError`` into a plain sentence with NVML's code name
  (NotSupported, NoPermission, NotFound, ...).  Nothing here raises.
- **Never per step.**  A process query costs tens of µs (see bench/memory_costs.py);
  the recorder calls :func:`read` only when a memory record is due.  The energy
  counter costs milliseconds: only the sampler thread reads it.
- **One state.**  What NVML gave this process (the library, or why not, and the
  devices matched) is one object, :data:`NVML`; :func:`shutdown` resets it.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import threading
from collections.abc import Callable
from typing import Any

import attrs

from .._errors import raised_by_user

__all__ = ["NVML", "NvmlReading", "energy_counter", "read", "shutdown", "status"]


@attrs.frozen
class NvmlReading:
    """What NVML says about one device and this process; a None figure has a reason."""

    process_bytes: int | None
    device_used_bytes: int | None
    process_reason: str | None = None
    device_reason: str | None = None
    #: The NVML UUID of the matched device ("GPU-..." or "MIG-..."), or None.
    device_uuid: str | None = None
    notes: tuple[str, ...] = ()
    #: The enforced power limit in W (nvmlDeviceGetEnforcedPowerLimit), or None with the reason.
    power_limit_w: float | None = None
    power_limit_reason: str | None = "NVML was not read"
    #: Compute processes on the device other than this one, or None with the reason.
    other_processes: int | None = None
    other_processes_reason: str | None = "NVML was not read"


# NVML's error constants -> (NVML's code name, plain words).  Codes not listed
# here get their name derived from the constant and pynvml's own message.
_WORDS = {
    "NVML_ERROR_UNINITIALIZED": ("Uninitialized", "NVML is not initialised"),
    "NVML_ERROR_NOT_SUPPORTED": ("NotSupported", "not supported on this GPU, driver or partition"),
    "NVML_ERROR_NO_PERMISSION": ("NoPermission", "permission denied to this user or container"),
    "NVML_ERROR_NOT_FOUND": ("NotFound", "no such device"),
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "LibraryNotFound", "libnvidia-ml.so.1 was not found: no NVIDIA driver is visible here",
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": ("DriverNotLoaded", "the NVIDIA driver is not loaded"),
    "NVML_ERROR_FUNCTION_NOT_FOUND": (
        "FunctionNotFound", "the driver's NVML is older than this call",
    ),
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": (
        "ArgumentVersionMismatch", "the driver does not know this version of the call",
    ),
    "NVML_ERROR_GPU_IS_LOST": ("GpuIsLost", "the GPU has fallen off the bus"),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "LibRmVersionMismatch", "NVML and the kernel driver versions differ (reboot after a driver update)",
    ),
    "NVML_ERROR_UNKNOWN": ("Unknown", "an unknown NVML error"),
}

#: nvmlDeviceGetMigMode's "enabled" value (NVML_DEVICE_MIG_ENABLE).
_MIG_ENABLED = 1

#: A matched device: (handle, is a MIG instance, parent GPU in MIG mode, NVML UUID, why not found).
_Match = tuple[Any, bool, bool, str | None, str | None]


class _NvmlState:
    """What NVML gave this process: the library once started (or why not), the devices matched.

    :meth:`reset` shuts NVML down (if stepprof started it) and forgets every cached answer.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        #: pynvml, once nvmlInit succeeded.
        self.module: Any = None
        #: Why NVML cannot be used, once tried.
        self.unavailable: str | None = None
        #: What is wrong with the installed pynvml package, if anything.
        self.package_note: str | None = None
        #: NVML's error value -> its NVML_ERROR_* name.
        self.codes: dict[Any, str] = {}
        #: torch's (UUID, PCI bus id) -> the matched device (see :func:`_device`).
        self.handles: dict[tuple[str | None, str | None], _Match] = {}

    def reset(self) -> None:
        """``nvmlShutdown`` if stepprof's ``nvmlInit`` succeeded; forget every cached answer."""
        with self.lock:
            m, self.module = self.module, None
            self.tried = False
            self.unavailable = self.package_note = None
            self.handles.clear()
            self.codes.clear()
        if m is not None:
            _query(m, "nvmlShutdown")

    def forget_in_child(self) -> None:
        """In a forked child: start over, without the parent's init or a lock held at the fork."""
        self.lock = threading.Lock()
        self.tried, self.module, self.unavailable, self.package_note = False, None, None, None
        self.handles.clear()


NVML = _NvmlState()


def _import_pynvml() -> Any:
    import pynvml  # optional: imported at the first read, never for a job without CUDA

    return pynvml


def _deprecated_distribution() -> str | None:
    """The version of the deprecated ``pynvml`` distribution, if it is installed."""
    try:
        return importlib.metadata.version("pynvml")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_package(m: Any) -> str | None:
    """A note when ``import pynvml`` is not (only) nvidia-ml-py's module."""
    fix = "run `pip uninstall pynvml` and `pip install nvidia-ml-py`"
    if not hasattr(m, "_nvmlGetFunctionPointer"):
        return (
            f"`import pynvml` found a module that is not nvidia-ml-py's (the deprecated `pynvml` "
            f"distribution provides it); {fix}"
        )
    version = _deprecated_distribution()
    if version is not None:
        return (
            f"the deprecated `pynvml` distribution ({version}) is installed next to nvidia-ml-py, "
            f"and both provide `import pynvml`; {fix}"
        )
    return None


def _translate(e: BaseException, m: Any) -> str:
    """An NVML error as words plus NVML's code name, e.g. ``"permission denied ... (NoPermission)"``."""
    value = getattr(e, "value", None)
    codes = NVML.codes
    if not codes:
        for attr in dir(m):
            if attr.startswith("NVML_ERROR_"):
                codes.setdefault(getattr(m, attr), attr)
    name = codes.get(value)
    if name in _WORDS:
        code, words = _WORDS[name]
    elif name is not None:
        code = "".join(w.capitalize() for w in name[len("NVML_ERROR_"):].split("_"))
        words = str(e)
    else:
        code, words = f"code {value}", str(e) or type(e).__name__
    return f"{words} ({code})"


def _query(m: Any, fn: str, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """Call ``m.<fn>``; return (value, None), or (None, why) for any failure."""
    try:
        return getattr(m, fn)(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - every failure becomes a reason
        if raised_by_user(e):
            raise
        error_cls = getattr(m, "NVMLError", None)
        if isinstance(error_cls, type) and isinstance(e, error_cls):
            return None, f"{fn}: {_translate(e, m)}"
        return None, f"{fn} failed: {type(e).__name__}: {e}"


def _code_of(why: str | None) -> str | None:
    return why.rsplit("(", 1)[-1].rstrip(")") if why and why.endswith(")") else None


def _load() -> tuple[Any, str | None]:
    """pynvml after a successful ``nvmlInit``, or (None, why not).  Tried once."""
    state = NVML
    with state.lock:
        if state.tried:
            return state.module, state.unavailable
        state.tried = True
        try:
            m = _import_pynvml()
        except ImportError as e:
            state.unavailable = f"nvidia-ml-py is not installed ({e}); `pip install nvidia-ml-py`"
            return None, state.unavailable
        except Exception as e:  # noqa: BLE001 - a broken install is a reason too
            if raised_by_user(e):
                raise
            state.unavailable = f"importing pynvml failed: {type(e).__name__}: {e}"
            return None, state.unavailable
        state.package_note = _check_package(m)
        state.codes.clear()
        _, why = _query(m, "nvmlInit")
        if why is not None:
            state.unavailable = f"NVML could not start: {why}"
            if state.package_note:
                state.unavailable += f"; {state.package_note}"
            return None, state.unavailable
        state.module = m
        return m, None


def _device(m: Any, uuid: str | None, pci: str | None) -> _Match:
    """(handle, is a MIG instance, parent GPU in MIG mode, NVML UUID, why not found).  Cached."""
    key = (uuid, pci)
    with NVML.lock:
        hit = NVML.handles.get(key)
    if hit is not None:
        return hit
    handle = None
    tried: list[str] = []
    if uuid is None and pci is None:
        tried.append("torch reports neither a UUID nor a PCI bus id for it (stepprof never matches by index)")
    if uuid is not None:
        for prefix in ("GPU-", "MIG-"):
            handle, why = _query(m, "nvmlDeviceGetHandleByUUID", prefix + uuid)
            if handle is not None:
                break
            tried.append(f"UUID {prefix}{uuid}: {why}")
    if handle is None and pci is not None:
        handle, why = _query(m, "nvmlDeviceGetHandleByPciBusId", pci)
        if handle is None:
            tried.append(f"PCI bus id {pci}: {why}")
    result: _Match
    if handle is None:
        result = (None, False, False, None, "NVML has no device matching torch's: " + "; ".join(tried))
    else:
        is_mig, _ = _query(m, "nvmlDeviceIsMigDeviceHandle", handle)
        is_mig = bool(getattr(is_mig, "value", is_mig))
        parent_mig = False
        if not is_mig:
            mode, _ = _query(m, "nvmlDeviceGetMigMode", handle)  # NotSupported: no MIG on this GPU
            parent_mig = bool(mode) and mode[0] == _MIG_ENABLED
        nvml_uuid, _ = _query(m, "nvmlDeviceGetUUID", handle)
        if isinstance(nvml_uuid, bytes):
            nvml_uuid = nvml_uuid.decode()
        result = (handle, is_mig, parent_mig, nvml_uuid, None)
    with NVML.lock:
        NVML.handles[key] = result
    return result


def _memory_info(m: Any, handle: Any) -> tuple[Any, str | None, bool]:
    """NVML's device memory info: (info, why not, whether it is the v1 struct)."""
    if hasattr(m, "nvmlMemory_v2"):
        info, why = _query(m, "nvmlDeviceGetMemoryInfo", handle, version=m.nvmlMemory_v2)
        if info is not None:
            return info, None, False
    info, why = _query(m, "nvmlDeviceGetMemoryInfo", handle)
    return info, why, True


def _processes(m: Any, handle: Any) -> tuple[Any, str | None]:
    procs, why = _query(m, "nvmlDeviceGetComputeRunningProcesses", handle)
    if procs is None and _code_of(why) in ("FunctionNotFound", "ArgumentVersionMismatch") and hasattr(
        m, "nvmlDeviceGetComputeRunningProcesses_v2"
    ):
        procs, why = _query(m, "nvmlDeviceGetComputeRunningProcesses_v2", handle)
    return procs, why


def read(uuid: str | None, pci: str | None, pid: int | None = None) -> NvmlReading:
    """NVML's figures for the device torch calls ``uuid``/``pci``, and for process ``pid``.

    Costs one memory-info and one process query (see bench/memory_costs.py) after the first call,
    which also pays for ``nvmlInit`` and the device lookup.  Never raises.

    Args:
        uuid: torch's device UUID, without NVML's ``GPU-``/``MIG-`` prefix.
        pci: the PCI bus id, ``"00000000:65:00.0"``.
        pid: the process to look for; default this one.
    """
    try:
        return _read(uuid, pci, os.getpid() if pid is None else pid)
    except Exception as e:  # noqa: BLE001 - stepprof never breaks training
        if raised_by_user(e):
            raise
        why = f"stepprof's NVML reading failed: {type(e).__name__}: {e}"
        return NvmlReading(None, None, why, why)


def _read(uuid: str | None, pci: str | None, pid: int) -> NvmlReading:
    m, why = _load()
    package_note = NVML.package_note
    notes: list[str] = [package_note] if package_note else []
    if m is None:
        return NvmlReading(None, None, why, why, notes=tuple(notes), power_limit_reason=why,
                           other_processes_reason=why)
    handle, is_mig, parent_mig, nvml_uuid, why = _device(m, uuid, pci)
    if handle is None:
        return NvmlReading(None, None, why, why, notes=tuple(notes), power_limit_reason=why,
                           other_processes_reason=why)
    if parent_mig:
        why = (
            f"the GPU {nvml_uuid} is partitioned into MIG instances and torch's device matched the "
            f"whole GPU, not an instance: NVML's figures would not be this process's"
        )
        return NvmlReading(None, None, why, why, device_uuid=nvml_uuid, notes=tuple(notes),
                           power_limit_reason=why, other_processes_reason=why)
    if is_mig:
        notes.append(
            f"this is a MIG instance ({nvml_uuid}): NVML's and cudaMemGetInfo's device figures "
            f"cover the instance, not the whole GPU"
        )

    device_used = process = None
    device_why = process_why = None
    info, device_why, v1 = _memory_info(m, handle)
    if info is not None:
        device_used = int(info.used)
        if v1:
            notes.append("NVML's device figure is the v1 one, which also counts memory the driver reserves")

    limit_mw, limit_why = _query(m, "nvmlDeviceGetEnforcedPowerLimit", handle)
    power_limit_w = int(limit_mw) / 1e3 if limit_mw is not None else None
    procs, process_why = _processes(m, handle)
    other_processes, others_why = None, process_why
    if procs is not None:
        mine = [p for p in procs if p.pid == pid]
        others = len(procs) - len(mine)
        if mine:
            other_processes, others_why = others, None
        else:
            others_why = (
                f"NVML does not list this process (PID {pid}) among the GPU's {len(procs)} compute "
                f"process(es), so which are others is unknown"
            )
        if not mine:
            listed = f"lists {len(procs)} compute process(es)" if procs else "lists no compute process"
            process_why = (
                f"NVML {listed} on this GPU but not this process (PID {pid}): inside a container "
                f"NVML reports host PIDs, or cannot see processes at all"
            )
            if others > 1:
                notes.append(
                    f"NVML lists {others} compute processes on this GPU: if some are not this process, "
                    f"the device-wide figures include their memory"
                )
        elif any(p.usedGpuMemory is None for p in mine):
            process_why = (
                "NVML lists this process but gives no memory figure for it (not available on "
                "this partition or driver model)"
            )
        else:
            process = sum(int(p.usedGpuMemory) for p in mine)
            if others:
                notes.append(f"{others} other process(es) also use this GPU")
    if process_why is not None and package_note:
        process_why += f"; {package_note}"
    return NvmlReading(
        process, device_used, process_why, device_why, device_uuid=nvml_uuid, notes=tuple(notes),
        power_limit_w=power_limit_w, power_limit_reason=limit_why,
        other_processes=other_processes, other_processes_reason=others_why,
    )


#: Reads the energy counter: (millijoules since the driver loaded, None) or (None, why not).
EnergyRead = Callable[[], tuple[int | None, str | None]]


def energy_counter(uuid: str | None, pci: str | None) -> tuple[EnergyRead | None, str | None]:
    """The device's total energy counter (``nvmlDeviceGetTotalEnergyConsumption``), or (None, why).

    One read costs about 3.4 ms on an H200 (../shared/FINDINGS.md): call it from a thread of its
    own, never on a step.  The first read is made here, so a GPU or driver without the
    counter (NotSupported) answers now.  Never raises; a later read that fails returns
    (None, why).

    Args:
        uuid, pci: torch's identity of the device, as for :func:`read`.
    """
    try:
        m, why = _load()
        if m is None:
            return None, why
        handle, is_mig, parent_mig, nvml_uuid, why = _device(m, uuid, pci)
        if handle is None:
            return None, why
        if is_mig or parent_mig:
            return None, (
                f"the GPU {nvml_uuid} is partitioned into MIG instances: its energy counter, if any, "
                f"covers every instance, not this process's"
            )

        def read_mj() -> tuple[int | None, str | None]:
            value, err = _query(m, "nvmlDeviceGetTotalEnergyConsumption", handle)
            if value is None:
                return None, err
            return int(value), None

        value, why = read_mj()
        if value is None:
            return None, why
        return read_mj, None
    except Exception as e:  # noqa: BLE001 - stepprof never breaks training
        if raised_by_user(e):
            raise
        return None, f"stepprof's NVML energy reading failed: {type(e).__name__}: {e}"


def status() -> dict[str, Any]:
    """For ``stepprof env``: the NVML package, whether NVML starts, and the driver version."""
    try:
        dist = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    m, why = _load()
    driver = None
    if m is not None:
        value, err = _query(m, "nvmlSystemGetDriverVersion")
        driver = value.decode() if isinstance(value, bytes) else value
        if err is not None:
            why = err
    return {
        "package": f"nvidia-ml-py {dist}" if dist else "nvidia-ml-py is not installed",
        "deprecated_pynvml": _deprecated_distribution(),
        "status": "ok" if m is not None else why,
        "note": NVML.package_note,
        "driver": driver,
    }


def shutdown() -> None:
    """``nvmlShutdown`` if stepprof's ``nvmlInit`` succeeded; forget every cached answer."""
    NVML.reset()


def _forget_in_child() -> None:
    # A forked child inherits NVML's library state but not its own init (nor a lock
    # another thread may have held at the fork): start over.
    NVML.forget_in_child()


# Registered at import, before stepprof._registry registers its close-at-exit, so
# (atexit runs last-in, first-out) profilers closing at exit can still read NVML.
atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

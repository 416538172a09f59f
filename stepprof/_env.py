"""``stepprof env``: what stepprof will find on this machine, in one look."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch

from ._validate import SYNC_MECHANISMS
from ._device.facts import allocator_facts, device_facts
from ._device.nvml import status as nvml_status
from ._roofline import cache_dir, calibration_path, load_calibration

__all__ = ["environment", "render_env"]


def environment() -> dict[str, Any]:
    """GPU, driver, CUDA, torch, the allocator, NVML, calibration, the step boundary and
    the sync mechanism.

    It initialises CUDA (to name the GPUs) when CUDA is available.
    """
    from . import __version__

    gpus: list[dict[str, Any]] = []
    cuda_reason = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                facts = device_facts(i)
            except Exception as e:  # noqa: BLE001 - report, never crash
                gpus.append({"index": i, "error": f"{type(e).__name__}: {e}"})
                continue
            calibration, why = load_calibration(facts["name"])
            facts["index"] = i
            facts.update(_power(i))
            facts["calibration"] = (
                {
                    "path": calibration_path(facts["name"]),
                    **{
                        k: calibration.get(k)
                        for k in ("matmul_tflops", "copy_gbps", "launch_us", "torch", "measured_unix_s")
                    },
                }
                if calibration is not None
                else {"path": None, "missing": why}
            )
            gpus.append(facts)
    else:
        cuda_reason = "CUDA is not available" + (
            " (this torch is a CPU build)" if torch.version.cuda is None else " (no GPU or driver is visible)"
        )
    nvml = (
        nvml_status()
        if torch.cuda.is_available()
        else {**nvml_status(), "note": "NVML is only read for CUDA runs"}
    )
    sync_api = hasattr(torch._C, "_cuda_set_sync_debug_mode")
    return {
        "stepprof": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "driver": nvml.get("driver"),
        "cuda_available": torch.cuda.is_available(),
        "cuda_reason": cuda_reason,
        "gpus": gpus,
        "allocator": allocator_facts(),
        "nvml": nvml,
        "calibration_dir": cache_dir(),
        "boundary": _boundary(cuda_reason),
        "fold": _fold(),
        "syncs": {
            "default": "warn",
            "mechanisms": list(SYNC_MECHANISMS),
            "used": (
                "warn: torch's sync-debug warnings plus wrappers for torch.cuda.synchronize and "
                "Event.synchronize"
                if sync_api and torch.cuda.is_available()
                else "none: syncs are counted on CUDA only"
            ),
            "trace": (
                "syncs='trace' is checked at the first step (private GPU-trace API) and falls back to 'warn'"
            ),
        },
        "environment": {
            k: os.environ.get(k)
            for k in ("STEPPROF_LOG", "STEPPROF_WARMUP", "STEPPROF_CACHE_DIR", "CUDA_VISIBLE_DEVICES")
        },
    }


def _power(index: int) -> dict[str, Any]:
    """NVML's enforced power limit of device ``index`` and the other processes on it (a None
    figure has its reason)."""
    from ._device import nvml

    try:
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        bus, dev, domain = (getattr(props, k, None) for k in ("pci_bus_id", "pci_device_id", "pci_domain_id"))
        pci = f"{domain:08X}:{bus:02X}:{dev:02X}.0" if None not in (bus, dev, domain) else None
        r = nvml.read(str(uuid) if uuid is not None else None, pci)
    except Exception as e:  # noqa: BLE001 - report, never crash
        why = f"{type(e).__name__}: {e}"
        return {"power_limit_w": None, "power_limit_reason": why, "other_processes": None,
                "other_processes_reason": why}
    return {"power_limit_w": r.power_limit_w, "power_limit_reason": r.power_limit_reason,
            "other_processes": r.other_processes, "other_processes_reason": r.other_processes_reason}


def _boundary(cuda_reason: str | None) -> dict[str, Any]:
    """Which step boundary a profiler would use here: "compiled" (built and loadable),
    "python", or "none" (no CUDA); the library's path, or why it is not used."""
    from ._device import compiled

    state = compiled.status()
    reason: str | None
    if cuda_reason is not None:
        used, reason = "none", cuda_reason
    else:
        used, reason = ("compiled", None) if state["built"] else ("python", state["reason"])
    return {
        "used": used,
        "path": state["path"],
        "reason": reason,
        "saving_us": compiled.SAVING_US,
    }


def _fold() -> dict[str, Any]:
    """Whether the summary and the report fold step records in C (stepprof/_fold.c), and the
    training thread's boundaries run in C (the step core, stepprof/_core.c), or why not."""
    from . import _native
    from ._recorder import core

    why = core.reason("auto")
    return {"used": "c" if _native.module() is not None else "python", "reason": _native.reason(),
            "core": "c" if why is None else "python", "core_reason": why}


def _boundary_row(b: dict[str, Any]) -> str:
    if b["used"] == "compiled":
        return f"compiled ({b['path']})"
    if b["used"] == "python":
        saving = b["saving_us"].get("h200_launch_bound_step")
        gain = (f"; `stepprof build` compiles one that saves ~{saving:.0f} µs a step on a host-bound "
                f"H200 loop" if saving else "")
        return f"python: {b['reason']}{gain}"
    return f"none: {b['reason']}"


def _num(x: Any, spec: str) -> str:
    """A calibration figure, or n/a where the file lacks it (never 0)."""
    return format(x, spec) if type(x) in (int, float) else "n/a"


def render_env(env: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("stepprof", env["stepprof"]),
        ("python", f"{env['python']} on {env['platform']}"),
        ("torch", env["torch"]),
        ("CUDA runtime", env["cuda_runtime"] or "none (CPU build)"),
        ("cuDNN", str(env["cudnn"]) if env["cudnn"] else "n/a"),
        ("driver", env["driver"] or "n/a"),
    ]
    if not env["gpus"]:
        rows.append(("GPU", env["cuda_reason"] or "none"))
    for g in env["gpus"]:
        if "error" in g:
            rows.append((f"GPU {g['index']}", g["error"]))
            continue
        rows.append(
            (
                f"GPU {g['index']}",
                f"{g['name']} (sm {g['capability']}, "
                f"{g['total_memory_bytes'] / 2**30:.0f} GiB, {g['multiprocessors']} SMs)",
            )
        )
        if "power_limit_w" in g:
            limit = g["power_limit_w"]
            others = g["other_processes"]
            rows.append((
                "  power limit, others",
                (f"{limit:.0f} W" if limit is not None else f"n/a ({g['power_limit_reason']})")
                + ", " + (f"{others} other process(es) on it" if others is not None
                          else f"other processes n/a ({g['other_processes_reason']})"),
            ))
        c = g["calibration"]
        if c.get("path"):
            t = c.get("matmul_tflops") or {}
            rows.append(
                (
                    "  calibration",
                    ", ".join(f"{k} {_num(v, ',.0f')} TFLOP/s" for k, v in t.items())
                    + f", copy {_num(c.get('copy_gbps'), ',.0f')} GB/s, {_num(c.get('launch_us'), '.1f')} µs/op"
                    + f" ({c['path']})",
                )
            )
        else:
            rows.append(("  calibration", c.get("missing") or "none"))
    a = env["allocator"]
    rows += [
        ("PYTORCH_CUDA_ALLOC_CONF", a["PYTORCH_CUDA_ALLOC_CONF"] or "(unset)"),
        ("allocator backend", a["backend"]),
        ("expandable segments", "on" if a["expandable_segments"] else "off"),
        (
            "NVML package",
            env["nvml"]["package"]
            + (
                f"; deprecated pynvml {env['nvml']['deprecated_pynvml']} is also installed"
                if env["nvml"].get("deprecated_pynvml")
                else ""
            ),
        ),
        (
            "NVML status",
            str(env["nvml"]["status"]) + (f" ({env['nvml']['note']})" if env["nvml"].get("note") else ""),
        ),
        ("calibration cache", env["calibration_dir"]),
        ("step boundary", _boundary_row(env["boundary"])),
        ("step core", "C" if env["fold"]["core"] == "c" else f"Python: {env['fold']['core_reason']}"),
        ("summary fold", "C" if env["fold"]["used"] == "c" else f"Python, about 3x the CPU a record: {env['fold']['reason']}"),
        ("sync detection", env["syncs"]["used"]),
        ("", env["syncs"]["trace"]),
    ]
    rows += [(k, v) for k, v in env["environment"].items() if v is not None]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n"

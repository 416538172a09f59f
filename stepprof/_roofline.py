"""FLOPs of a step, the calibration cache, MFU and the roofline class.

- **Counting.**  :class:`FlopCount` runs ``torch.utils.flop_counter.FlopCounterMode``
  around *one* step (the profiler picks the first step past warm-up) and also
  tallies, per operation, the dtype of the FLOPs, the non-view operations
  dispatched (about the kernel launches of an eager step) and the bytes their
  inputs and outputs occupy (what an eager step reads and writes at most).  It
  sets ``torch.compiler.set_stance("force_eager")`` for that step: dynamo never
  compiles under a dispatch mode and, in torch releases before mid-2026,
  remembered the skip for good, so counting inside a compiled step would leave
  the user's model uncompiled.  Forcing eager for one step leaves dynamo's
  caches as they were.
- **Calibration.**  ``stepprof calibrate`` measures the GPU's achieved dense
  matmul rate (bf16, tf32, fp32), its copy bandwidth and the host cost of one
  small operation (:func:`stepprof._device.calibrate.calibrate`), and :func:`save_calibration`
  caches them per GPU model under the user's cache directory.
- **MFU** is the time the step's FLOPs need at the *calibrated* rate of their
  dtype, over the step's time.  A datasheet table is never used: its peaks are
  not reachable, and tools that use them report MFU above 100% or flatter the
  step.  Without a calibration MFU is None with the reason.
- **The roofline class** compares three lower bounds on the step's time, each
  from a calibrated figure: FLOPs at the matmul rate (compute), bytes at the copy
  bandwidth (memory) and operations at the host's per-operation cost (host).  The
  bytes and operations are the eager step's: for a compiled step (torch.compile
  fuses kernels) those two are upper bounds, and the class says so (``compiled``).
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, cast

import orjson

from ._errors import raised_by_user
from ._paths import cache_root as cache_dir
from ._paths import whole_file

__all__ = [
    "CALIBRATED_DTYPES",
    "FlopCount",
    "cache_dir",
    "calibration_path",
    "ideal_ms",
    "load_calibration",
    "roofline",
    "save_calibration",
]

#: The dtypes whose matmul rate ``stepprof calibrate`` measures.
CALIBRATED_DTYPES = ("bf16", "tf32", "fp32")
#: fp16 runs on the same tensor cores at the bf16 rate on Ampere and Hopper.
_PEAK_OF = {"bf16": "bf16", "fp16": "bf16", "tf32": "tf32", "fp32": "fp32"}
CALIBRATION_VERSION = 1


# -- counting -----------------------------------------------------------------------


def _dtype_key(dtype: Any, conv: bool) -> str:
    import torch

    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        return "tf32" if _tf32(conv) else "fp32"
    if dtype == torch.float64:
        return "fp64"
    if "float8" in str(dtype):
        return "fp8"
    return str(dtype).replace("torch.", "")


def _tf32(conv: bool) -> bool:
    """Whether fp32 convolutions (``conv``) or matmuls run on the GPU in TF32 now."""
    import torch

    # torch >= 2.9: once its fp32_precision flags are used, the legacy getters
    # (torch.get_float32_matmul_precision, cudnn.allow_tf32) raise RuntimeError; the
    # flags themselves always answer, and follow the legacy setters too.
    flags = getattr(torch.backends.cudnn, "conv", None) if conv else torch.backends.cuda.matmul
    precision: str | None = getattr(flags, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    if conv:  # pragma: no cover - torch < 2.9
        return bool(torch.backends.cudnn.allow_tf32)
    return torch.get_float32_matmul_precision() != "highest"  # pragma: no cover - torch < 2.9


class FlopCount:
    """Counts one step: FLOPs by dtype, non-view operations and their bytes.

    :meth:`start` and :meth:`stop` must run on the same thread (the step's).
    Neither synchronises: the counter reads shapes and dtypes only.
    """

    def __init__(self) -> None:
        self.flops_by_dtype: dict[str, int] = {}
        self.ops = 0
        self.op_bytes = 0
        self.notes: list[str] = []
        #: Why the tally failed in the step, if it did (the step itself went on).
        self.error: str | None = None
        self._mode: Any = None
        self._stance: Any = None
        self._filter: Any = None

    def start(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        counter = self
        aliasing: dict[Any, bool] = {}

        class _Counting(FlopCounterMode):
            def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
                before = sum(self.flop_counts["Global"].values())
                result = FlopCounterMode._count_flops(self, func_packet, out, args, kwargs)
                if counter.error is None:
                    try:
                        counter._tally(self, func_packet, out, args, kwargs, before, aliasing)
                    except Exception as e:  # noqa: BLE001 - a reason, never the user's op failing
                        if raised_by_user(e):
                            raise
                        counter.error = f"{type(e).__name__}: {e}"
                return result

        import torch

        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None:
            self._stance = set_stance("force_eager")
        else:  # pragma: no cover - torch < 2.6
            self.notes.append(
                "this torch has no torch.compiler.set_stance: a compiled function called in the "
                "counted step was skipped by dynamo under the counter"
            )
        # The counter's module hooks make torch warn at each torch.compile'd module
        # call; the warning would point at the user's line about hooks they never set.
        self._filter = (
            "ignore",
            re.compile(r"Using `torch.compile\(module\)` when there are global hooks"),
            UserWarning,
            None,
            0,
        )
        cast("list[Any]", warnings.filters).insert(0, self._filter)  # a list (typeshed: a Sequence)
        try:
            mode: FlopCounterMode = _Counting(display=False)
            mode.__enter__()
        except BaseException:
            self._restore_stance()
            raise
        self._mode = mode

    def _tally(
        self, mode: Any, packet: Any, out: Any, args: Any, kwargs: Any, before: int, aliasing: dict[Any, bool]
    ) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        view = aliasing.get(packet)
        if view is None:
            view = aliasing[packet] = _is_view(packet)
        if view:
            return
        self.ops += 1
        nbytes = 0
        first = None
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                if first is None:
                    first = t
                try:
                    nbytes += t.numel() * t.element_size()
                except Exception as e:  # noqa: BLE001 - a tensor subclass without storage
                    if raised_by_user(e):
                        raise
        self.op_bytes += nbytes
        added = sum(mode.flop_counts["Global"].values()) - before
        if added and first is not None:
            key = _dtype_key(first.dtype, "conv" in str(packet))
            self.flops_by_dtype[key] = self.flops_by_dtype.get(key, 0) + added

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(None, None, None)
        finally:
            self._restore_stance()

    def _restore_stance(self) -> None:
        try:
            cast("list[Any]", warnings.filters).remove(self._filter)
        except ValueError:
            pass  # the user reset the filters meanwhile
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def flops(self) -> int:
        return sum(self.flops_by_dtype.values())


def _is_view(packet: Any) -> bool:
    """Whether an operator only makes views (no kernel, no bytes moved)."""
    try:
        overload = getattr(packet, packet.overloads()[0])
        returns = overload._schema.returns
        return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    except Exception as e:  # noqa: BLE001 - unknown: count it
        if raised_by_user(e):
            raise
        return False


# -- the calibration cache -----------------------------------------------------------


def calibration_path(device_name: str) -> str:
    """Where the calibration of a GPU model is cached."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "unknown"
    return os.path.join(cache_dir(), f"calibration-{slug}.json")


def save_calibration(record: dict[str, Any]) -> str:
    """Write a calibration (as :func:`stepprof._device.calibrate.calibrate` returns it) to the cache."""
    path = calibration_path(record["device_name"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with whole_file(path) as f:
        f.write(
            orjson.dumps({"calibration_version": CALIBRATION_VERSION, **record}, option=orjson.OPT_INDENT_2)
        )
    return path


def load_calibration(device_name: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the cached calibration of this GPU model, None) or (None, why there is none)."""
    path = calibration_path(device_name)
    try:
        with open(path, "rb") as f:
            record = orjson.loads(f.read())
    except FileNotFoundError:
        return None, (
            f"{device_name} has no calibration in {os.path.dirname(path)}: "
            f"run `stepprof calibrate` once on this machine"
        )
    except (OSError, orjson.JSONDecodeError) as e:
        if raised_by_user(e):
            raise
        return None, f"the calibration file {path!r} cannot be read ({e}): run `stepprof calibrate` again"
    if (
        not isinstance(record, dict)
        or record.get("calibration_version") != CALIBRATION_VERSION
        or not (isinstance(record.get("matmul_tflops"), dict))
    ):
        return (
            None,
            f"the calibration file {path!r} is from another stepprof version: run `stepprof calibrate` again",
        )
    return record, None


# -- MFU and the roofline ------------------------------------------------------------


def ideal_ms(
    flops_by_dtype: dict[str, Any], calibration: dict[str, Any] | None
) -> tuple[float | None, str | None]:
    """Time the FLOPs need at the calibrated matmul rate of their dtypes, in ms; or (None, why)."""
    if calibration is None:
        return None, "no calibration"
    peaks = calibration.get("matmul_tflops") or {}
    total = 0.0
    for key, n in flops_by_dtype.items():
        if not n:
            continue
        peak = peaks.get(_PEAK_OF.get(key, ""))
        if not isinstance(peak, (int, float)) or peak <= 0:
            return None, (
                f"the step does {key} matmuls, and stepprof calibrate measures only "
                f"{', '.join(CALIBRATED_DTYPES)} (fp16 at the bf16 rate)"
            )
        total += n / (peak * 1e12) * 1e3
    return total, None


def roofline(
    *,
    step_ms: float,
    flops_by_dtype: dict[str, Any],
    op_bytes: float | None,
    ops: int | None,
    calibration: dict[str, Any],
    compiled: bool = False,
) -> dict[str, Any]:
    """The step's class and the three lower bounds on its time (ms) behind it.

    ``compute_ms``: FLOPs at the calibrated matmul rates; ``memory_ms``: the
    operations' bytes at the calibrated copy bandwidth (an upper bound for fused
    or compiled kernels, which move less); ``host_ms``: operations times the
    calibrated host cost of one small operation.  The class is the largest bound;
    ``explained`` is that bound over the measured step time.

    ``compiled`` (the run compiled with torch.compile): the memory and host bounds count
    the eager operations, so for the fused kernels they are upper bounds, not lower
    ones.  Either names the class only if the compute bound explains less than half
    the step and the bound does not exceed the step (else the fused kernels did less
    than the count); when the compute bound explains half or more, the class is
    compute-bound.  ``caveat`` then says which rule applied.
    """
    compute_ms, why = ideal_ms(flops_by_dtype, calibration)
    bw = calibration.get("copy_gbps")
    launch = calibration.get("launch_us")
    memory_ms = op_bytes / (bw * 1e9) * 1e3 if op_bytes is not None and bw else None
    host_ms = ops * launch / 1e3 if ops is not None and launch else None
    bounds = {"compute": compute_ms, "memory": memory_ms, "host": host_ms}
    known = {k: v for k, v in bounds.items() if v is not None}
    out: dict[str, Any] = {
        "class": None,
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
        "host_ms": host_ms,
        "step_ms": step_ms,
        "explained": None,
        "arithmetic_intensity": None,
        "ridge": None,
        "reason": why,
        "caveat": None,
    }
    total_flops = sum(v for v in flops_by_dtype.values() if isinstance(v, (int, float)))
    if op_bytes:
        out["arithmetic_intensity"] = total_flops / op_bytes
    peak = (calibration.get("matmul_tflops") or {}).get("bf16")
    if peak and bw:
        out["ridge"] = peak * 1e12 / (bw * 1e9)
    # Without the compute bound (FLOPs in an uncalibrated dtype) the largest known bound
    # cannot name the class: the unknown one may be larger.  The reason says why.
    if known and compute_ms is not None:
        cls: str | None  # (None: _compiled_class names none)
        cls = max(known, key=lambda k: known[k])
        if compiled:
            cls, out["caveat"] = _compiled_class(cls, known, step_ms)
            if cls is None:
                out["reason"] = out["caveat"]
                return out
        out["class"] = f"{cls}-bound"
        out["explained"] = known[cls] / step_ms if step_ms > 0 else None
        out["reason"] = None
    return out


def _compiled_class(cls: str, known: dict[str, float], step_ms: float) -> tuple[str | None, str]:
    """The class of a compiled step, whose memory and host bounds are upper bounds (see :func:`roofline`)."""
    what = {"memory": "bytes", "host": "operations"}
    if cls == "compute":
        return cls, "the run compiled: the memory and host bounds count the eager operations (upper bounds)"
    bound, compute = known[cls], known["compute"]
    caveat = (
        f"the run compiled: the {cls} bound ({bound:.2f} ms) counts the eager step's {what[cls]}, "
        f"an upper bound for fused kernels"
    )
    if step_ms > 0 and compute >= 0.5 * step_ms:
        return "compute", (
            f"{caveat}; the compute bound alone explains {compute / step_ms:.0%} of the step, "
            f"so the step is classed compute-bound"
        )
    if bound > step_ms:
        return None, (
            f"{caveat}, and it exceeds the measured {step_ms:.2f} ms step: the fused kernels did "
            f"less than the eager count, so the class cannot be told"
        )
    return cls, f"{caveat}: the step is {cls}-bound at most to the extent shown"

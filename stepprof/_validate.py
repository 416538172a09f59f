"""Every argument check of stepprof, in attrs' style: ``'x' must be ... (got ...)``.

Each check returns the value as stepprof uses it (a path as a str, a device as a
``torch.device``...) or raises :class:`~stepprof.ConfigError` (a value stepprof
cannot use) or :class:`~stepprof.UsageError` (a call it does not support), naming
the argument, the value and the fix.

Sections: integers (shared), ``Profiler(...)`` and ``configure(...)``, a step, reading
a log (``read``, ``frame``), the sweep, and the command line.

This module does not import torch: :func:`check_log` runs in ``stepprof.read``,
which works without it.  The few checks that need torch import it when called
(when a profiler or a sweep is made, a memory report asked for, a trial's batch
checked, or the demo started), never on a step.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from ._errors import ConfigError, UsageError
from ._schema import RECORD_KINDS

#: ``Profiler(syncs=...)``: how sync points are detected: torch's sync-debug warnings (plus
#: wrappers for the device and event waits they miss), torch's GPU-trace callbacks, or not at all.
SYNC_MECHANISMS = ("warn", "trace", "off")

__all__ = [
    "MEMORY_EVERY",
    "ON_SYNC",
    "PHASE_PEAKS_EVERY",
    "check_batch_size",
    "check_budget",
    "check_calibrate_device",
    "check_callable",
    "check_choice",
    "check_count",
    "check_demo_options",
    "check_device",
    "check_energy_every_s",
    "check_explain_peak",
    "check_flops",
    "check_fraction",
    "check_frame_kind",
    "check_group",
    "check_int",
    "check_log",
    "check_log_ranks",
    "check_logs",
    "check_max_batch",
    "check_max_syncs",
    "check_memory_every",
    "check_model",
    "check_name",
    "check_nvtx",
    "check_on_sync",
    "check_option_names",
    "check_optimizer",
    "check_phase_peaks_every",
    "check_plot_run",
    "check_progress",
    "check_ranks_every",
    "check_read_kind",
    "check_read_path",
    "check_report_device",
    "check_restore",
    "check_seconds",
    "check_syncs",
    "check_tokens",
    "check_warmup",
    "check_warmup_variable",
]

#: Default of ``Profiler(memory_every=...)``: a memory record costs the training
#: thread about 100 µs (see bench/memory_costs.py), so every 1000 steps it adds under
#: 0.1 µs per step, and a run of 100k steps logs 100 of them.
MEMORY_EVERY = 1000

#: Default of ``Profiler(phase_peaks_every=...)``.  A phase's peak costs one raw
#: allocator-stats read at its exit (see bench/inloop_costs.py), so three phases read
#: on every step cost more than the rest of stepprof together.  While the step's own
#: peak (read on every step) holds steady, phase peaks are read on one step in this many.
PHASE_PEAKS_EVERY = 50

#: Policies for a step over its sync budget (``Profiler(on_sync=...)``).
ON_SYNC = ("count", "warn", "raise")


# -- integers ------------------------------------------------------------------------


def check_int(
    value: Any, argument: str, minimum: int, fix: str, *, fix_below: str | None = None,
    requirement: str | None = None,
) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``, else a ConfigError.

    The message names ``argument``, the value and what it must be: ``an int >= minimum``
    when it is not an int, ``>= minimum`` when it is one under ``minimum``, or
    ``requirement`` in both cases where given.  It ends with ``fix`` (what to pass
    instead), or ``fix_below`` for an int under ``minimum`` where given.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{argument!r} must be {requirement or f'an int >= {minimum}'} (got {value!r}); {fix}")
    if value < minimum:
        fix = fix if fix_below is None else fix_below
        if requirement is not None:
            raise ConfigError(f"{argument!r} must be {requirement} (got {value!r}); {fix}")
        raise ConfigError(f"{argument!r} must be >= {minimum} (got {value}); {fix}")
    return value


def check_count(value: object, argument: str, fix: str) -> int:
    """``value`` if it is an int >= 0 (not a bool), else a ConfigError naming ``argument``,
    the value and ``fix`` (what to pass instead), and saying "an int >= 0" in either case."""
    return check_int(value, argument, 0, fix, requirement="an int >= 0")


# -- Profiler(...) and configure(...) ------------------------------------------------


def check_option_names(options: dict[str, Any], names: Sequence[str], caller: str) -> dict[str, Any]:
    """``options`` if every key is one of ``names``, else a UsageError naming it and them."""
    for name in options:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"{caller} got an unknown option {name!r}; {hint}"
                f"the options are {', '.join(names)}"
            )
    return options


def check_log(path: Any, argument: str = "log") -> str | None:
    """``log=``: a path (:func:`check_path`) or None to keep no log."""
    return check_path(path, argument, f"{argument}='run.jsonl'", "to keep no log")


def check_path(path: Any, argument: str, example: str, none_means: str) -> str | None:
    """``path`` as a str the OS can open (None stays None), or a ConfigError naming ``argument``
    (``example``: a good value; ``none_means``: what None does).

    A bytes path would be opened, then fail at the first record (which holds it as ``log``).
    A str that is not UTF-8 but that the OS takes (``os.fsdecode(b"run_\\xff.jsonl")``, a
    name from ``os.listdir``) is accepted: the records that hold it get a replaced form
    (``_log.encodable``).  A str the OS cannot take (a NUL, a lone surrogate that no byte
    decodes to) is refused here, not with a bare ValueError from ``os.open``.
    """
    if path is None:
        return None
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise ConfigError(
            f"{argument!r} must be a path (a str or an os.PathLike) or None (got {path!r}); "
            f"pass e.g. {example}, or None {none_means}"
        )
    if "\x00" in text:
        raise ConfigError(
            f"{argument!r} must not hold a null character (got {path!r}); pass the path without it"
        )
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{argument!r} cannot be encoded as a file name (got {path!r}): {e.reason} at "
            f"{e.object[e.start:e.end]!r}; pass a path of valid characters (for a name that is not "
            f"UTF-8, pass os.fsdecode(the bytes name))"
        ) from None
    return text


def check_warmup(warmup: Any, argument: str = "warmup") -> int:
    return check_int(warmup, argument, 0, f"pass e.g. {argument}=3", fix_below="pass 0 to keep every step")


def check_warmup_variable(raw: str) -> int:
    """The ``STEPPROF_WARMUP`` environment variable's text as a warm-up step count."""
    try:
        warmup = int(raw)
    except ValueError:
        raise ConfigError(
            f"STEPPROF_WARMUP must be an int >= 0 (got {raw!r}); unset it or set e.g. STEPPROF_WARMUP=3"
        ) from None
    return check_warmup(warmup, "STEPPROF_WARMUP")


def check_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (None stays None), or a ConfigError naming it."""
    if device is None:
        return None
    import torch  # slow to import; see the module docstring

    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:  # ValueError: an index past 64 bits
        raise ConfigError(
            f"'device' must name a torch device such as 'cuda:0' or 'cpu' (got {device!r})"
        ) from e


def check_cuda_device(device: Any) -> None:
    """A CUDA ``torch.device`` the profiler was asked for exists here, or a ConfigError that says
    what is there: stepprof never records the CPU in its place."""
    if device is None or device.type != "cuda":
        return
    import torch  # slow to import; see the module docstring

    if not torch.cuda.is_available():
        raise ConfigError(
            f"'device' is {str(device)!r}, but CUDA is not available here (torch {torch.__version__}); "
            f"pass device='cpu', or device=None to profile CUDA when the training uses it"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"'device' is {str(device)!r}, but this process sees {count} CUDA device(s): "
            f"pass device='cuda:0' to 'cuda:{count - 1}'"
        )


def check_report_device(device: Any) -> Any:
    """``memory_report(device=...)``: a ``torch.device`` (None stays None); an int is a CUDA index."""
    if device is None:
        return None
    import torch  # slow to import; see the module docstring

    try:
        if isinstance(device, int) and not isinstance(device, bool):
            return torch.device("cuda", device)  # an index names a CUDA device, even without CUDA
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:  # ValueError: an index past 64 bits
        raise ConfigError(
            f"'device' must name a torch device such as 'cuda:0' or 0 (got {device!r}); "
            f"or pass nothing for the active profiler's device"
        ) from e


def check_nvtx(nvtx: Any) -> bool:
    if not isinstance(nvtx, bool):
        raise ConfigError(f"'nvtx' must be True or False (got {nvtx!r})")
    return nvtx


_C = TypeVar("_C")


def check_choice(value: Any, argument: str, choices: Sequence[_C], fix: str) -> _C:
    """``value`` if it is one of ``choices``, else a ConfigError listing them."""
    if value not in choices:
        raise ConfigError(
            f"{argument!r} must be one of {', '.join(map(repr, choices))} (got {value!r}); {fix}"
        )
    return cast(_C, value)


def check_syncs(syncs: Any) -> str:
    return check_choice(syncs, "syncs", SYNC_MECHANISMS, "'warn' is the cheap default")


def check_max_syncs(max_syncs: Any) -> int | None:
    if max_syncs is None:
        return None
    return check_int(
        max_syncs, "max_syncs", 0, "pass e.g. max_syncs=0 to require sync-free steps",
        requirement="an int >= 0 or None",
    )


def check_on_sync(on_sync: Any) -> str:
    return check_choice(
        on_sync, "on_sync", ON_SYNC,
        "'count' records, 'warn' warns once per site, 'raise' raises SyncBudgetExceeded",
    )


def check_memory_every(memory_every: Any, argument: str = "memory_every") -> int:
    return check_count(
        memory_every, argument,
        f"pass e.g. {argument}={MEMORY_EVERY}, or 0 to write no periodic memory record",
    )


def check_phase_peaks_every(n: Any, argument: str = "phase_peaks_every") -> int:
    return check_count(
        n, argument,
        f"pass 1 to read every phase's peak on every step, {PHASE_PEAKS_EVERY} (the default) to "
        f"read them on one step in {PHASE_PEAKS_EVERY} while the step's peak is steady, or 0 never "
        f"to read them",
    )


def check_explain_peak(explain_peak: Any) -> bool | int:
    """``Profiler(explain_peak=...)``: False, True (the first step after warm-up) or a step index."""
    if explain_peak is None or explain_peak is False or explain_peak is True:
        return bool(explain_peak)
    return check_int(
        explain_peak, "explain_peak", 0,
        "pass explain_peak=True to explain the first step after warm-up, or the index of the step "
        "to explain (e.g. explain_peak=10)",
        requirement="True, False or a step index (an int >= 0)",
    )


def check_model(model: Any, argument: str = "model") -> Any:
    """``model=``: None or a ``torch.nn.Module``."""
    import torch

    return _check_torch_object(model, argument, torch.nn.Module, "torch.nn.Module",
                               "the model whose parameters and modules explain_peak should name", "model")


def check_optimizer(optimizer: Any, argument: str = "optimizer") -> Any:
    """``optimizer=``: None or a ``torch.optim.Optimizer``."""
    import torch

    return _check_torch_object(optimizer, argument, torch.optim.Optimizer, "torch.optim.Optimizer",
                               "the optimizer whose state explain_peak should name", "optimizer")


def _check_torch_object(value: Any, argument: str, cls: type, cls_name: str, what: str, example: str) -> Any:
    """None, or an instance of ``cls``; else a ConfigError naming the argument, the type and the fix."""
    if value is None or isinstance(value, cls):
        return value
    raise ConfigError(
        f"{argument!r} must be a {cls_name} or None (got {type(value).__name__}); pass {what}, "
        f"e.g. {argument}={example}"
    )


def check_flops(flops: Any, flops_per_step: Any) -> tuple[str | None, float | None]:
    """Validate ``Profiler(flops=..., flops_per_step=...)``."""
    if flops not in ("auto", None):
        raise ConfigError(
            f"'flops' must be 'auto' or None (got {flops!r}); pass flops='auto' to count one "
            f"step's FLOPs, or flops_per_step=N if you know them"
        )
    if flops_per_step is not None:
        try:
            ok = (
                not isinstance(flops_per_step, bool)
                and isinstance(flops_per_step, (int, float))
                and math.isfinite(flops_per_step)
                and flops_per_step > 0
            )
        except OverflowError:  # an int past a float's range (> 1.8e308)
            ok = False
        if not ok:
            raise ConfigError(
                f"'flops_per_step' must be a positive number of FLOPs, finite as a float "
                f"(got {flops_per_step!r}); e.g. flops_per_step=6 * n_params * tokens_per_step"
            )
        if flops is not None:
            raise ConfigError("pass either flops='auto' (count them) or flops_per_step=N (given), not both")
    return flops, None if flops_per_step is None else float(flops_per_step)


#: The default of ``flush_every_s``: the most the log may lag behind the training thread.
FLUSH_EVERY_S = 1.0


def _in_range(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is a real number (not a bool), finite, from ``low`` to ``high``."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and low <= value <= high
    )


def check_flush_every_s(flush_every_s: Any) -> float:
    if not _in_range(flush_every_s, 0.001, 3600):
        raise ConfigError(
            f"'flush_every_s' must be a number of seconds from 0.001 to 3600 (got {flush_every_s!r}); "
            f"pass e.g. flush_every_s={FLUSH_EVERY_S} (the default)"
        )
    return float(flush_every_s)


#: The default of ``energy_every_s``: how often the energy sampler reads NVML's counter.
ENERGY_EVERY_S = 0.5


def check_energy_every_s(energy_every_s: Any) -> float | None:
    if energy_every_s is None:
        return None
    if not _in_range(energy_every_s, 0.05, 3600):
        raise ConfigError(
            f"'energy_every_s' must be a number of seconds from 0.05 to 3600, or None to turn energy "
            f"sampling off (got {energy_every_s!r}); pass e.g. energy_every_s={ENERGY_EVERY_S} (the default)"
        )
    return float(energy_every_s)


#: Where a step's device work is done (see docs/measurement.md).
BOUNDARIES = ("auto", "compiled", "python")


def check_boundary(boundary: Any) -> str:
    if boundary not in BOUNDARIES:
        raise ConfigError(
            f"'boundary' must be 'auto' (the compiled boundary if `stepprof build` has built it, "
            f"else Python), 'compiled' or 'python' (got {boundary!r})"
        )
    return cast(str, boundary)


def check_overhead_budget(overhead_budget: Any) -> float | None:
    if overhead_budget is None:
        return None
    if not _in_range(overhead_budget, 0.0001, 0.5):
        raise ConfigError(
            f"'overhead_budget' must be a fraction of step time from 0.0001 to 0.5, or None for "
            f"every step in full (got {overhead_budget!r}); pass e.g. overhead_budget=0.01 for 1%"
        )
    return float(overhead_budget)


# -- a step: Profiler.step(...), profile_step(...), measure(...) --------------------------


def check_name(name: Any, argument: str = "name") -> str | None:
    """``name`` as a plain str (a str subclass, such as a ``(str, Enum)`` member, as its value), or None."""
    if (type(name) is str and name) or name is None:
        return name
    if isinstance(name, str) and name:
        return str.__str__(name)
    if isinstance(name, str):
        raise UsageError(
            f"{argument!r} must not be empty (got ''); pass a name such as 'forward', or nothing for the default"
        )
    if callable(name):
        hint = "; to make a function a step, decorate it with @stepprof.measure"
    elif isinstance(name, int) and not isinstance(name, bool):
        hint = f"; to give the step's batch size, pass it by keyword: batch_size={name!r}"
    else:
        hint = "; pass a name such as 'train', or nothing for the default"
    raise UsageError(f"{argument!r} must be a str or None (got {name!r}){hint}")


def check_batch_size(batch_size: Any) -> int | None:
    if batch_size is None or (type(batch_size) is int and batch_size > 0):
        return batch_size  # (each step asks: the common cases first)
    fix = "pass the number of samples in the step, e.g. batch_size=x.shape[0], or batch=... to infer it, or None"
    if isinstance(batch_size, bool):
        raise ConfigError(f"'batch_size' must be a positive int or None (got {batch_size!r}); {fix}")
    try:
        n = int(batch_size.__index__())
    except (AttributeError, TypeError):
        raise ConfigError(
            f"'batch_size' must be a positive int or None (got {batch_size!r}); {fix}"
        ) from None
    if n <= 0:
        raise ConfigError(f"'batch_size' must be a positive int or None (got {n}); {fix}")
    return n


def check_tokens(tokens: Any) -> int | None:
    """``tokens=``: the step's token count, an int >= 0, or None (counted in its batch)."""
    if tokens is None or (type(tokens) is int and tokens >= 0):
        return tokens
    index = None if isinstance(tokens, bool) else getattr(type(tokens), "__index__", None)  # numpy's ints too
    fix = "pass the tokens the step trains on, e.g. tokens=input_ids.numel(), or None to count them in batch="
    return check_int(tokens if index is None else index(tokens), "tokens", 0, fix, requirement="an int >= 0 or None")


_NO_BUDGET: tuple[None, None] = (None, None)


def check_budget(max_syncs: Any, on_sync: Any) -> tuple[int | None, str | None]:
    """A step's own sync budget: None leaves the profiler's in force."""
    if max_syncs is None and on_sync is None:
        return _NO_BUDGET
    return check_max_syncs(max_syncs), None if on_sync is None else check_on_sync(on_sync)


# -- reading a log: read(...), frame(...) ----------------------------------------------


def check_read_path(path: Any) -> Any:
    """``read(path)``: ``path`` if it is a str, bytes or os.PathLike, else a ConfigError."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ConfigError(
            f"'path' must be the path of a stepprof log, a str or os.PathLike (got {path!r}); "
            f"e.g. stepprof.read('run.jsonl')"
        )
    return path


def check_read_kind(kind: Any) -> str | None:
    """``read(kind=...)``: a str or None; a kind no record has is warned about as it reads."""
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(
            f"'kind' must be a record kind such as 'step' or 'summary', or None for every "
            f"record (got {kind!r})"
        )
    return kind


def check_logs(log: Any) -> list[str | os.PathLike[str]]:
    """``frame(log)``: one path (a str or os.PathLike) or a non-empty list or tuple of them, as a list."""
    if isinstance(log, (str, os.PathLike)):
        return [log]
    if isinstance(log, (list, tuple)) and log and all(isinstance(p, (str, os.PathLike)) for p in log):
        return list(log)
    raise ConfigError(
        f"'log' must be the path of a stepprof log (a str or os.PathLike), or a non-empty list "
        f"of them (got {log!r}); e.g. stepprof.frame('run.jsonl') or "
        f"stepprof.frame(['run.rank0.jsonl', 'run.rank1.jsonl'])"
    )


def check_frame_kind(kind: Any) -> str:
    """``frame(kind=...)``: one of the kinds stepprof writes."""
    if not isinstance(kind, str) or kind not in RECORD_KINDS:
        raise ConfigError(
            f"'kind' must be a record kind, one of {', '.join(map(repr, sorted(RECORD_KINDS)))} "
            f"(got {kind!r}); e.g. stepprof.frame(log, kind='step')"
        )
    return kind


# -- the sweep: sweep(...) and the batches its make_batch returns ------------------------
# Its integers go through check_int: start, warmup, steps, max_steps.


def check_callable(fn: Any, name: str, example: str) -> None:
    """Raise a :class:`UsageError` (a TypeError) when ``fn`` is not callable."""
    if callable(fn):
        return
    import torch  # slow to import; see the module docstring

    hint = ""
    if isinstance(fn, torch.Tensor) or fn is None:
        hint = " (did you call it? pass the function itself, without brackets)"
    raise UsageError(f"{name!r} must be callable (got {fn!r}){hint}; {example}")


def check_max_batch(max_batch: Any, start: int) -> None:
    """``max_batch`` must be None, or an int >= 1 and >= ``start``."""
    if max_batch is None:
        return
    check_int(max_batch, "max_batch", 1, "pass None for no limit")
    if max_batch < start:
        raise ConfigError(
            f"'max_batch' must be >= 'start' ({start}) (got {max_batch}); raise max_batch, "
            f"lower start, or pass max_batch=None"
        )


def check_seconds(value: Any, name: str, *, allow_zero: bool) -> float:
    """``value`` as float seconds: finite, and > 0 (or >= 0 with ``allow_zero``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name!r} must be a finite number of seconds {bound} (got {value!r})")
    return float(value)


def check_fraction(value: Any, name: str, example: str) -> float:
    """``value`` as a float strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{name!r} must be a fraction between 0 and 1 (got {value!r}); e.g. {example}")
    return float(value)


def check_progress(progress: Any) -> None:
    """``progress`` must be True, False or a callable taking a line."""
    if not (isinstance(progress, bool) or callable(progress)):
        raise ConfigError(f"'progress' must be True, False or a callable taking a line (got {progress!r})")


def check_restore(restore: Any) -> tuple[Any, ...]:
    """The objects of ``restore`` (None, one, or a list or tuple), each with state dicts."""
    if restore is None:
        return ()
    objs = tuple(restore) if isinstance(restore, (list, tuple)) else (restore,)
    for obj in objs:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"'restore' takes objects with state_dict() and load_state_dict(), such as a "
                f"module or an optimizer (got {obj!r}); pass e.g. restore=(model, optimizer)"
            )
    return objs


# -- the command line: stepprof demo | plot | calibrate ----------------------------------
# The CLI shows a demo's or a plot's ConfigError as that subcommand's usage error (exit 2).


def check_demo_options(steps: int, warmup: int, device: str | None) -> None:
    """``stepprof demo``: steps >= 1, warmup >= 0, and a device it can train on (the CPU or
    a CUDA GPU here), refused before training starts."""
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1 (got {steps})")
    if warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 (got {warmup}); pass --warmup 0 to keep every step")
    if device is None:
        return
    import torch  # slow to import; see the module docstring

    fix = "pass --device cpu, or leave --device out to use CUDA if present"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r} is not a torch device; {fix}") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ConfigError(f"--device {device!r}: the demo runs on 'cpu' or 'cuda[:N]'; {fix}")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r} needs CUDA, which is not available here; {fix}")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"--device {device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
            f"pass one of those, or --device cpu"
        )


def check_plot_run(run: int) -> int:
    """``stepprof plot --run``: 1-based, or 0 (the default) for the last run."""
    if run < 0:
        raise ConfigError(f"--run must be >= 1 (got {run})")
    return run


def check_calibrate_device(device: int) -> int:
    """``stepprof calibrate --device``: the index of a CUDA device of this machine."""
    import torch  # slow to import; see the module docstring

    if not torch.cuda.is_available():
        raise ConfigError("calibrate measures a CUDA GPU, and CUDA is not available here")
    if not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"'--device' must be 0..{torch.cuda.device_count() - 1} (got {device})")
    return device

"""Every argument check of stepprof, in attrs' style: ``'x' must be ... (got ...)``.

Each check returns the value as stepprof uses it (a path as a str, a device as a
``torch.device``...) or raises :class:`~stepprof.ConfigError` (a value stepprof
cannot use) or :class:`~stepprof.UsageError` (a call it does not support), naming
the argument, the value and the fix.

This module does not import torch: :func:`check_log` runs in ``stepprof.read``,
which works without it.  The few checks that need torch import it when called
(when a profiler is made, or a memory report asked for), never on a step.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from typing import Any

from ._device.backend import SYNC_MECHANISMS
from ._dist import LOG_RANKS, RANKS_EVERY, Identity
from ._errors import ConfigError, UsageError

__all__ = [
    "MEMORY_EVERY",
    "ON_SYNC",
    "PHASE_PEAKS_EVERY",
    "check_batch_size",
    "check_budget",
    "check_count",
    "check_device",
    "check_flops",
    "check_group",
    "check_log",
    "check_log_ranks",
    "check_max_syncs",
    "check_memory_every",
    "check_name",
    "check_nvtx",
    "check_on_sync",
    "check_option_names",
    "check_phase_peaks_every",
    "check_ranks_every",
    "check_report_device",
    "check_syncs",
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


def check_count(value: object, argument: str, fix: str) -> int:
    """``value`` if it is an int >= 0 (not a bool), else a ConfigError naming ``argument``,
    the value and ``fix`` (what to pass instead)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{argument!r} must be an int >= 0 (got {value!r}); {fix}")
    return value


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
    """``path`` as a str (None stays None), or a ConfigError naming ``argument``.

    A bytes path would be opened, then fail at the first record (which holds it as ``log``).
    """
    if path is None:
        return None
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise ConfigError(
            f"{argument!r} must be a str path or None (got {path!r}); "
            f"pass e.g. {argument}='run.jsonl', or None to keep no log"
        )
    return text


def check_warmup(warmup: Any, argument: str = "warmup") -> int:
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise ConfigError(f"{argument!r} must be an int >= 0 (got {warmup!r}); pass e.g. {argument}=3")
    if warmup < 0:
        raise ConfigError(f"{argument!r} must be >= 0 (got {warmup}); pass 0 to keep every step")
    return warmup


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
    except (RuntimeError, TypeError) as e:
        raise ConfigError(
            f"'device' must name a torch device such as 'cuda:0' or 'cpu' (got {device!r})"
        ) from e


def check_report_device(device: Any) -> Any:
    """``memory_report(device=...)``: a ``torch.device`` (None stays None); an int is a CUDA index."""
    if device is None:
        return None
    import torch  # slow to import; see the module docstring

    try:
        if isinstance(device, int) and not isinstance(device, bool):
            return torch.device("cuda", device)  # an index names a CUDA device, even without CUDA
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(
            f"'device' must name a torch device such as 'cuda:0' or 0 (got {device!r}); "
            f"or pass nothing for the active profiler's device"
        ) from e


def check_nvtx(nvtx: Any) -> bool:
    if not isinstance(nvtx, bool):
        raise ConfigError(f"'nvtx' must be True or False (got {nvtx!r})")
    return nvtx


def check_syncs(syncs: Any) -> str:
    if syncs not in SYNC_MECHANISMS:
        raise ConfigError(
            f"'syncs' must be one of {', '.join(map(repr, SYNC_MECHANISMS))} (got {syncs!r}); "
            f"'warn' is the cheap default"
        )
    return syncs


def check_max_syncs(max_syncs: Any) -> int | None:
    if max_syncs is None:
        return None
    if isinstance(max_syncs, bool) or not isinstance(max_syncs, int) or max_syncs < 0:
        raise ConfigError(
            f"'max_syncs' must be an int >= 0 or None (got {max_syncs!r}); "
            f"pass e.g. max_syncs=0 to require sync-free steps"
        )
    return max_syncs


def check_on_sync(on_sync: Any) -> str:
    if on_sync not in ON_SYNC:
        raise ConfigError(
            f"'on_sync' must be one of {', '.join(map(repr, ON_SYNC))} (got {on_sync!r}); "
            f"'count' records, 'warn' warns once per site, 'raise' raises SyncBudgetExceeded"
        )
    return on_sync


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


def check_flops(flops: Any, flops_per_step: Any) -> tuple[str | None, float | None]:
    """Validate ``Profiler(flops=..., flops_per_step=...)``."""
    if flops not in ("auto", None):
        raise ConfigError(
            f"'flops' must be 'auto' or None (got {flops!r}); pass flops='auto' to count one "
            f"step's FLOPs, or flops_per_step=N if you know them"
        )
    if flops_per_step is not None:
        if (
            isinstance(flops_per_step, bool)
            or not isinstance(flops_per_step, (int, float))
            or not (math.isfinite(flops_per_step) and flops_per_step > 0)
        ):
            raise ConfigError(
                f"'flops_per_step' must be a positive number of FLOPs (got {flops_per_step!r}); "
                f"e.g. flops_per_step=6 * n_params * tokens_per_step"
            )
        if flops is not None:
            raise ConfigError("pass either flops='auto' (count them) or flops_per_step=N (given), not both")
    return flops, None if flops_per_step is None else float(flops_per_step)


def check_ranks_every(ranks_every: Any) -> int:
    return check_count(
        ranks_every, "ranks_every",
        f"pass e.g. ranks_every={RANKS_EVERY}, or 0 to turn the cross-rank exchange off",
    )


def check_log_ranks(log_ranks: Any) -> str:
    if log_ranks not in LOG_RANKS:
        raise ConfigError(
            f"'log_ranks' must be 'all' (each rank writes <stem>.rank<R><suffix>) or 'zero' "
            f"(only rank 0 writes a log) (got {log_ranks!r})"
        )
    return log_ranks


def check_group(group: Any, ident: Identity | None, ranks_every: int) -> Any:
    """``group`` if it is None or a process group this rank belongs to, else a ConfigError."""
    if group is None:
        return None
    import torch.distributed  # slow to import; see the module docstring

    dist = torch.distributed if torch.distributed.is_available() else None
    non_member = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if isinstance(group, int) and not isinstance(group, bool) and group == non_member:
        if ident is None or not ranks_every:
            return group  # no exchange: the group is not used
        raise ConfigError(
            f"this rank ({ident.rank}) is not a member of 'group' (got {group!r}: what "
            f"torch.distributed.new_group returns to the ranks outside the group); on those ranks "
            f"pass ranks_every=0 (or group=None to exchange on the default group)"
        )
    if dist is None or not isinstance(group, dist.ProcessGroup):
        raise ConfigError(
            f"'group' must be a torch.distributed process group (got {group!r}); pass the group "
            f"that torch.distributed.new_group(...) returns, or None for the default group"
        )
    return group


# -- a step: Profiler.step(...), profile_step(...), measure(...) --------------------------


def check_name(name: Any, argument: str = "name") -> str | None:
    if name is not None and not isinstance(name, str):
        if callable(name):
            hint = "; to make a function a step, decorate it with @stepprof.measure"
        elif isinstance(name, int) and not isinstance(name, bool):
            hint = f"; to give the step's batch size, pass it by keyword: batch_size={name!r}"
        else:
            hint = "; pass a name such as 'train', or nothing for the default"
        raise UsageError(f"{argument!r} must be a str or None (got {name!r}){hint}")
    return name


def check_batch_size(batch_size: Any) -> int | None:
    fix = "pass the number of samples in the step, e.g. batch_size=len(batch), or None"
    if batch_size is None:
        return None
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


def check_budget(max_syncs: Any, on_sync: Any) -> tuple[int | None, str | None]:
    """A step's own sync budget: None leaves the profiler's in force."""
    return check_max_syncs(max_syncs), None if on_sync is None else check_on_sync(on_sync)

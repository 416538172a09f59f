"""The module-level API: ``profile_step`` and ``measure`` act on the current profiler,
``configure`` sets the default one, ``memory_report`` reconciles memory now."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import _memory, _registry
from ._device.select import memory_backend
from ._errors import ConfigError, warn
from ._memory import MemoryReport
from ._options import NAMES
from ._recorder.profiler import Profiler
from ._scopes import IterateFunction, MeasureFunction, ProfileStepFunction
from ._validate import (
    check_callable,
    check_model,
    check_optimizer,
    check_option_names,
    check_path,
    check_report_device,
    check_warmup,
    check_warmup_variable,
)

if TYPE_CHECKING:
    from ._peak import PeakExplanation

__all__ = ["configure", "current", "explain_peak", "iterate", "measure", "memory_report", "profile_step"]

_T = TypeVar("_T")

profile_step = ProfileStepFunction("profile_step")
measure = MeasureFunction("measure")
iterate = IterateFunction("iterate")


def current() -> Profiler:
    """The profiler that ``profile_step``/``measure`` act on now.

    The calling thread's innermost active ``with Profiler(...)`` (a thread that has
    none uses the innermost one of another thread); else the default profiler, made
    by :func:`configure` or, on first use, from the ``STEPPROF_LOG`` and
    ``STEPPROF_WARMUP`` environment variables.
    """
    return _registry.current()  # type: ignore[no-any-return]


def _from_environment() -> Profiler:
    """The default profiler when :func:`configure` made none: ``STEPPROF_LOG``, ``STEPPROF_WARMUP``."""
    warmup = check_warmup_variable(os.environ.get("STEPPROF_WARMUP", "0"))
    log = os.environ.get("STEPPROF_LOG") or None
    if log is None and _registry.take_no_log_warning():
        warn(
            "stepprof: no Profiler is active and no log is configured, so steps are timed "
            "but nothing is written. Use `with stepprof.Profiler(path):`, stepprof.configure(log=path) "
            "or set STEPPROF_LOG.",
            stacklevel=4,  # the user's line that opened the step (through the scope and the registry)
        )
    try:
        return Profiler(log, warmup=warmup)
    except ConfigError as e:
        raise ConfigError(f"STEPPROF_LOG: {e}") from e


_registry.set_default_factory(_from_environment)


def configure(*, log: str | os.PathLike[str] | None = None, **options: Any) -> Profiler:
    """Set up the default profiler, used when no ``with Profiler(...)`` is active.

    A previous default profiler is closed (its summary written) first.  The
    default profiler is closed at interpreter exit.

    Args:
        log: path of the JSON-lines log, or None to keep no log.
        **options: any setting of :class:`stepprof.Profiler` (``warmup``, ``device``,
            ``syncs``, ...), with the same defaults.

    Returns:
        The new default profiler.

    Raises:
        UsageError: an option that :class:`stepprof.Profiler` does not take.
        ConfigError: a bad value, as :class:`stepprof.Profiler` raises it.
    """
    new = Profiler(log, **check_option_names(options, NAMES, "configure()"))
    old = _registry.replace_default(new)
    if old is not None:
        old.close()
    return new


def memory_report(device: str | int | torch.device | None = None) -> MemoryReport:
    """Reconcile this process's GPU memory now, and say why nvidia-smi shows more than PyTorch.

    It reads torch's allocator, ``cudaMemGetInfo`` and NVML (tens of µs: see bench/memory_costs.py;
    plus ``nvmlInit`` the first time) and returns a :class:`stepprof.MemoryReport`.
    While a profiler is active (the innermost ``with Profiler(...)``, else a
    default profiler already set up), the report is also written to its log as
    a ``kind: "memory"`` record.  It never initialises CUDA and never raises for
    a missing figure: without CUDA every figure is None with the reason.

    Args:
        device: ``"cuda:N"``, ``N`` or a ``torch.device``; None reads the active
            profiler's device, else the current CUDA device.

    Example:
        >>> import stepprof
        >>> report = stepprof.memory_report()
        >>> print(report.explanation)  # doctest: +SKIP
        nvidia-smi shows 3.91 GiB for this process: 1.60 GiB live tensors, 1.59 GiB cached by PyTorch's allocator for reuse (not a leak), 0.72 GiB CUDA context and libraries.
    """
    dev = check_report_device(device)
    prof = _registry.innermost()
    if prof is None:
        prof = _registry.default_profiler()
    if prof is not None and not prof.closed:
        return prof._memory_report(dev)  # type: ignore[no-any-return]
    return _memory.report(memory_backend(dev), trigger=_memory.ON_DEMAND)


def _owned(fn: Any, kind: type) -> Any:
    """The first attribute of ``fn``'s ``self`` (a bound method's) that is a ``kind``."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, kind):
        return fn
    if owner is None:
        return None
    if isinstance(owner, kind):
        return owner
    for value in vars(owner).values() if hasattr(owner, "__dict__") else ():
        if isinstance(value, kind):
            return value
    return None


def explain_peak(
    train_step: Callable[[_T], object],
    batch: _T,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    warmup: int = 0,
    device: str | int | torch.device | None = None,
    snapshot: str | os.PathLike[str] | None = None,
) -> PeakExplanation:
    """Run ``train_step(batch)`` once and say where its peak memory comes from.

    It runs the call as one step of a private :class:`stepprof.Profiler` (no log) with
    ``explain_peak``, and returns its :class:`stepprof.PeakExplanation`; ``print()`` it for
    one line.  The ``stepprof.measure`` phases inside the call name the phase of the peak.

    Args:
        train_step: the step, called as ``train_step(batch)``.
        batch: its argument.
        model, optimizer: what parameters, gradients, optimizer state and modules are
            named from.  Left out, they are looked for among the attributes of
            ``train_step``'s ``self`` (a bound method's), or ``train_step`` itself if it
            is a module.
        warmup: calls to run first, unexplained (the first call of a run often allocates
            what later ones reuse: the optimizer's state, cuBLAS workspaces).
        device: as for :class:`stepprof.Profiler`.
        snapshot: also write the explained call's allocator snapshot there, a pickle that
            pytorch.org/memory_viz opens (its path is the explanation's ``snapshot_path``; a
            failed write is a reason in ``unavailable``, never an exception).

    Example:
        >>> exp = stepprof.explain_peak(trainer.train_step, batch)  # doctest: +SKIP
        >>> print(exp)  # doctest: +SKIP
        peak 2.60 GiB in optimizer at _multi_tensor_adamw (torch/optim/adamw.py:600): ...
    """
    check_callable(train_step, "train_step", "stepprof.explain_peak(trainer.train_step, batch)")
    warmup = check_warmup(warmup)
    snapshot_path = check_path(snapshot, "snapshot", "snapshot='peak.pickle'", "to write none")
    model = check_model(model if model is not None else _owned(train_step, torch.nn.Module))
    optimizer = check_optimizer(optimizer if optimizer is not None else _owned(train_step, torch.optim.Optimizer))
    with Profiler(None, warmup=warmup, device=device, explain_peak=True, model=model, optimizer=optimizer,
                  syncs="off", nvtx=False, memory_every=0, energy_every_s=None) as prof:
        prof._peak.snapshot_path = snapshot_path
        for _ in range(warmup + 1):
            with prof.step():
                train_step(batch)
    explanation: PeakExplanation = prof._peak.explanation  # made at close, at the latest
    return explanation

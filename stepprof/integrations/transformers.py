"""stepprof inside Hugging Face's ``Trainer``: :class:`StepprofCallback` and :func:`sweep`.

The callback records one step per optimizer step, from the Trainer's own hooks:

- ``on_step_begin`` opens the step; ``on_step_end`` (after the optimizer step, the
  scheduler and ``zero_grad``) closes it.  Between the previous step's end and this one's
  begin lie the Trainer's logging, evaluation and checkpointing and the fetch of this
  step's micro-batches: the record's ``data_wait_ms`` (``data_ms``: the fetch alone).
- Phase ``forward_backward``: each ``trainer.training_step`` call (forward, loss, backward
  of one micro-batch); its ``count`` is the step's micro-batch count.
- Phase ``optimizer``: ``on_pre_optimizer_step`` to ``on_optimizer_step``, i.e.
  ``optimizer.step()`` (gradient clipping runs before it, outside any phase).
- ``batch_size``: the sum of the micro-batches' sizes, inferred from the batches the
  Trainer fetched for the step (``trainer.get_batch_samples``).

At ``on_train_begin`` the callback finds its Trainer (the caller of the hook) and wraps
``training_step``, ``get_batch_samples`` and ``log`` on that instance (restored at train
end): ``log`` adds the figures to the logs before the Trainer keeps them in
``state.log_history`` and hands them to every callback, ``report_to``'s included, so the
callbacks keep their order.  docs/howto/frameworks.md has the details.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - the extra is in dev
    from .._errors import MissingExtraError

    raise MissingExtraError(
        "stepprof.integrations.transformers needs transformers and accelerate, which are not "
        "installed. Install them with: pip install 'stepprof[transformers]'"
    ) from e

import torch

from .._errors import ConfigError, SyncBudgetExceeded, UsageError, raised_by_user, warn
from .._options import NAMES, ProfilerOptions
from .._recorder.profiler import Profiler
from .._records import Summary
from .._sweep.result import SweepResult
from .._validate import check_option_names
from ._close import close_quietly, on_device
from ._sweep_adapter import (
    apply_recommended,
    batch_maker,
    check_sweep_options,
    overridden,
    restored,
    run_sweep,
    step_optimizers,
)
from ._window import Window, figures

__all__ = ["StepprofCallback", "sweep"]

#: The phase around each ``training_step`` call, and the one around ``optimizer.step()``.
FORWARD_BACKWARD = "forward_backward"
OPTIMIZER = "optimizer"
#: How far up the stack ``on_train_begin`` looks for the Trainer that called it.
_FRAMES = 12
_MISSING = object()
_NO_TRAINER = (
    "not inferred: the callback's hooks were not called from a transformers.Trainer's training "
    "loop, so it could not see the batches"
)


#: What a run left open by a ``train()`` that raised outside ``training_step`` ended with.
_UNFINISHED = RuntimeError("the previous train() raised before the callback saw its end")


class StepprofCallback(TrainerCallback):
    """Profiles each optimizer step of ``Trainer.train()`` and adds the figures to its logs.

    Args:
        log: path of the JSON-lines log (appended to), or None for none; the figures still
            reach the Trainer's logs.  Under DDP each rank writes its own (``log_ranks``).
        profiler_options: any of :class:`stepprof.Profiler`'s settings (``warmup``,
            ``syncs``, ``overhead_budget``...), checked here.

    A :class:`stepprof.Profiler` opens at ``on_train_begin`` and closes at ``on_train_end``
    (``profiler``, then ``summary``).  An exception that leaves ``training_step`` records
    the step with its ``error`` and closes the profiler; one raised elsewhere leaves it
    open until the next ``train()`` with this callback or interpreter exit, which close it.
    An internal stepprof failure becomes a warning: training goes on unprofiled.

    Example::

        trainer = Trainer(model, args, train_dataset=ds,
                          callbacks=[StepprofCallback(log="run.jsonl", warmup=5)])
        trainer.train()  # logs gain stepprof/gpu_ms, stepprof/samples_per_s, ...
    """

    def __init__(self, log: str | os.PathLike[str] | None = None, **profiler_options: Any) -> None:
        check_option_names(profiler_options, NAMES, "StepprofCallback()")
        ProfilerOptions(log, **profiler_options)  # every setting checked now, before training
        self._log = log
        self._options = profiler_options
        self._prof: Profiler | None = None
        self._summary: Summary | None = None
        self._window = Window()
        self._trainer: Any = None  # the Trainer whose methods are wrapped, while training
        self._wrapped: dict[str, Any] = {}  # name -> the instance attribute it replaced (_MISSING: none)
        self._in_step = False
        self._phase: str | None = None
        self._thread = 0  # the training thread: hooks and wrappers elsewhere record nothing

    # -- public ---------------------------------------------------------------------

    @property
    def profiler(self) -> Profiler | None:
        """The profiler of the current (or last) ``train()``, or None before the first."""
        return self._prof

    @property
    def summary(self) -> Summary | None:
        """The last closed profiler's summary, or None."""
        return self._summary

    # -- the Trainer's hooks ------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(_UNFINISHED)  # a previous train() that raised outside training_step
        # The log is opened here: an unwritable path raises now, before the first step.
        prof = Profiler(self._log, **on_device(self._options, getattr(args, "device", None)))
        try:
            self._prof, self._summary, self._thread = prof, None, threading.get_ident()
            self._window.drain()
            prof.watch(self._window)
            trainer = _calling_trainer(self)
            if trainer is not None:
                self._wrap(trainer)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
            self._fail(e)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prof = self._recording()
        if prof is None:
            return
        try:
            if self._in_step:  # the previous step never reached on_step_end
                self._end_step(RuntimeError("on_step_end was not called for this step"))
            step = getattr(state, "global_step", None)  # the Trainer logs this step at the next one
            prof.begin_step(batch_reason=_NO_TRAINER if self._trainer is None else None,
                            global_step=step + 1 if type(step) is int and step >= 0 else None)
            self._in_step = True
            if self._trainer is None:  # the hooks alone: the phase starts with the step
                self._begin_phase(FORWARD_BACKWARD)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
            self._fail(e)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None and self._recording() is not None:  # next micro-batch
            self._guard(self._end_phase)
            self._guard(self._begin_phase, FORWARD_BACKWARD)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recording() is not None:
            self._guard(self._end_phase)
            self._guard(self._begin_phase, OPTIMIZER)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recording() is not None:
            self._guard(self._end_phase)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._recording() is not None and self._in_step:
            self._guard(self._end_step, None)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if logs is None or self._trainer is not None or self._prof is None or self._prof.closed:
            return  # with a Trainer, its wrapped log() added them
        try:
            got = self._figures()
            if not got:
                return
            # The hooks alone: the caller put a copy of these logs in state.log_history just before.
            last = state.log_history[-1] if getattr(state, "log_history", None) else None
            if isinstance(last, dict) and last.get("step") == state.global_step and set(last) - {"step"} == set(logs):
                last.update(got)
            logs.update(got)
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
            self._fail(e)

    def _figures(self) -> dict[str, float | int]:
        """The window's figures: the steps whose device work has completed are written now
        (never a wait), so the window holds them; on a GPU the last step or two may still run."""
        prof = self._prof
        if prof is None or prof.closed:
            return {}
        prof.flush()
        return figures(self._window.drain())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close(None)

    # -- the wrappers on the Trainer -----------------------------------------------------

    def _wrap(self, trainer: Any) -> None:
        """Wrap ``training_step`` and ``get_batch_samples`` on this Trainer instance."""
        self._trainer = trainer
        training_step = trainer.training_step
        get_batch_samples = trainer.get_batch_samples
        log = trainer.log

        def wrapped_training_step(*args: Any, **kwargs: Any) -> Any:
            phase = self._in_step and self._recording() is not None
            if phase:
                self._guard(self._begin_phase, FORWARD_BACKWARD)
            try:
                out = training_step(*args, **kwargs)
            except BaseException as e:
                if phase:
                    self._guard(self._end_step, e)
                    self._close(e)
                raise
            if phase:
                self._guard(self._end_phase)
            return out

        def wrapped_log(logs: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(logs, dict) and self._recording() is not None:
                self._guard(lambda: logs.update(self._figures()))
            return log(logs, *args, **kwargs)

        def wrapped_get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            out = get_batch_samples(*args, **kwargs)
            prof = self._recording()
            if prof is not None:
                self._guard(self._note_batches, prof, time.perf_counter_ns() - t0, out)
            return out

        wrapped_training_step.__wrapped__ = training_step  # type: ignore[attr-defined]
        wrapped_training_step._stepprof = True  # type: ignore[attr-defined]
        own = vars(trainer)
        self._wrapped = {name: own.get(name, _MISSING) for name in ("training_step", "get_batch_samples", "log")}
        trainer.training_step = wrapped_training_step
        trainer.get_batch_samples = wrapped_get_batch_samples
        trainer.log = wrapped_log

    def _unwrap(self) -> None:
        trainer, wrapped = self._trainer, self._wrapped
        self._trainer, self._wrapped = None, {}
        for name, before in wrapped.items():
            if before is not _MISSING:
                setattr(trainer, name, before)  # an instance attribute set before ours
            else:
                with contextlib.suppress(AttributeError):
                    delattr(trainer, name)  # the class's method shows through again

    def _note_batches(self, prof: Profiler, data_ns: int, out: Any) -> None:
        """The micro-batches of the next step: their summed size, for its ``batch_size``."""
        samples = out[0] if isinstance(out, tuple) and out else None
        if isinstance(samples, list) and samples:
            prof.add_batch(*samples, fetch_s=data_ns / 1e9)

    # -- steps and phases, guarded ----------------------------------------------------------

    def _recording(self) -> Profiler | None:
        """The open profiler, when called on the training thread."""
        prof = self._prof
        if prof is None or prof.closed or threading.get_ident() != self._thread:
            return None
        return prof

    def _begin_phase(self, name: str) -> None:
        prof = self._prof
        if prof is not None and self._in_step and self._phase is None:
            prof.begin_phase(name)
            self._phase = name

    def _end_phase(self) -> None:
        prof, self._phase, name = self._prof, None, self._phase
        if prof is not None and name is not None:
            prof.end_phase(name)

    def _end_step(self, error: BaseException | None) -> None:
        prof = self._prof
        self._in_step, self._phase = False, None
        if prof is not None and not prof.closed:
            prof.end_step(error)  # closes the phase still open

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except SyncBudgetExceeded as e:
            self._close(e)  # the Trainer has no exception hook to close the run later
            raise  # on_sync="raise": the user asked for it
        except Exception as e:  # noqa: BLE001 - stepprof never breaks training
            if raised_by_user(e):
                raise
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        """An internal failure: warn, and stop profiling this run (the log keeps what it has)."""
        warn(
            f"stepprof: the Hugging Face callback stopped profiling after an internal error "
            f"({type(e).__name__}: {e}); training goes on", stacklevel=3)
        self._close(e)

    def _close(self, error: BaseException | None) -> None:
        prof = self._prof
        self._in_step, self._phase = False, None
        with contextlib.suppress(Exception):
            self._unwrap()
        if prof is None or prof.closed:
            return
        summary = close_quietly(prof, error)
        if summary is not None:
            self._summary = summary


def _calling_trainer(callback: StepprofCallback) -> Any:
    """The Trainer whose training loop called this hook, if it holds ``callback``."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and any(cb is callback for cb in owner.callback_handler.callbacks):
            return owner
        frame = frame.f_back
    return None


# -- the sweep ---------------------------------------------------------------------------------


def sweep(trainer: Any, *, apply: bool = False, **sweep_options: Any) -> SweepResult:
    """:func:`stepprof.sweep` over the Trainer's own training step, data collator and train dataset.

    ``train_step(batch)`` is ``trainer.training_step(model, batch)`` (forward, loss and
    backward, under the Trainer's mixed precision) followed by gradient clipping as
    ``args.max_grad_norm`` asks, ``optimizer.step()`` and ``zero_grad``; ``make_batch(n)``
    collates ``n`` real samples of ``trainer.train_dataset`` (in order, cycling) with the
    Trainer's collator and moves them to ``args.device``.  The model and the optimizer
    (created with ``trainer.create_optimizer()`` if the Trainer has none yet, and dropped
    again afterwards) are restored exactly, also when the sweep raises.

    Args:
        trainer: a ``transformers.Trainer`` with a ``train_dataset``, on one device (no
            DeepSpeed or FSDP).
        apply: set ``trainer.args.per_device_train_batch_size`` (and the Trainer's own
            copy) to the recommended batch size.
        sweep_options: :func:`stepprof.sweep`'s options (``max_batch``, ``time_budget_s``,
            ``log``...) but ``restore``, which this function sets.  ``device`` defaults
            to ``trainer.args.device``.

    Returns:
        The :class:`stepprof.SweepResult`.
    """
    _check_sweep(trainer, apply, sweep_options)
    dataset = trainer.train_dataset
    if dataset is None:
        raise ConfigError(
            "sweep(trainer) draws its batches from trainer.train_dataset, which is None; "
            "pass train_dataset=... to the Trainer"
        )
    args = trainer.args
    device = torch.device(args.device)
    if device.type in ("cuda", "cpu"):
        sweep_options.setdefault("device", "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}")
    make_batch = _batch_maker(trainer, dataset)
    model = trainer.model
    with _one_step_per_batch(trainer) as optimizer:
        scaler = getattr(trainer.accelerator, "scaler", None)  # fp16: the loss is scaled in backward
        train_step = _train_step(trainer, optimizer, scaler)
        result = run_sweep(train_step, make_batch, restore=restored(model, [optimizer], scaler), **sweep_options)
    if apply:
        def set_batch(n: int) -> None:
            args.per_device_train_batch_size = n
            trainer._train_batch_size = args.train_batch_size  # what get_train_dataloader reads

        apply_recommended(result, set_batch, lambda reason: (
            f"stepprof: sweep(apply=True) left per_device_train_batch_size at "
            f"{args.per_device_train_batch_size}: no batch size is recommended ({reason})"))
    return result


def _check_sweep(trainer: Any, apply: Any, sweep_options: dict[str, Any]) -> None:
    """A UsageError or ConfigError for what :func:`sweep` cannot do."""
    if not isinstance(trainer, Trainer):
        raise UsageError(
            f"sweep() takes a transformers.Trainer (got {type(trainer).__name__}); "
            f"pass the Trainer you would call .train() on"
        )
    if not isinstance(apply, bool):
        raise ConfigError(f"'apply' must be True or False (got {apply!r}); pass apply=True to set the batch size")
    if "restore" in sweep_options:
        raise ConfigError(
            "sweep(trainer) restores the Trainer's model and optimizer itself and takes no 'restore' "
            f"(got restore={sweep_options['restore']!r}); leave it out"
        )
    check_sweep_options(sweep_options, "stepprof.integrations.transformers.sweep")
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError(
            "sweep(trainer) runs the model on one device, without DeepSpeed or FSDP "
            "(the Trainer has one of them on); sweep a Trainer built without them"
        )


@contextlib.contextmanager
def _one_step_per_batch(trainer: Any) -> Iterator[Any]:
    """The Trainer's optimizer (created if it has none, and dropped again afterwards), with
    one micro-batch per optimizer step; the model's train/eval mode as it was afterwards."""
    model = trainer.model
    created = trainer.optimizer is None
    optimizer = trainer.create_optimizer() if created else trainer.optimizer
    was_training = model.training
    try:
        # Set by the Trainer's loop for each step; training_step divides the loss by it.
        with overridden(trainer, current_gradient_accumulation_steps=1):
            yield optimizer
    finally:
        model.train(was_training)
        if created:
            trainer.optimizer = None


def _train_step(trainer: Any, optimizer: Any, scaler: Any) -> Callable[[Any], None]:
    """``train_step(batch)``: the Trainer's ``training_step`` under its mixed precision,
    gradient clipping as ``args.max_grad_norm`` asks, the optimizer step and ``zero_grad``."""
    model, accelerator, max_norm = trainer.model, trainer.accelerator, trainer.args.max_grad_norm
    training_step = trainer.training_step
    if getattr(training_step, "_stepprof", False):  # a callback's wrapper, left by a train() that raised
        training_step = training_step.__wrapped__

    def train_step(batch: Any) -> None:
        with accelerator.autocast():  # the Trainer's mixed precision, as in its own loop
            training_step(model, batch)
        if max_norm is not None and max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        step_optimizers([optimizer], scaler)
        model.zero_grad()

    return train_step


def _batch_maker(trainer: Any, dataset: Any) -> Callable[[int], Any]:
    """``make_batch(n)``: ``n`` real samples, collated and on the Trainer's device, as its
    training dataloader would give them (the unused columns removed the same way)."""
    collate = trainer.data_collator
    try:
        import datasets  # noqa: PLC0415 - optional, as in the Trainer

        is_hf_dataset = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf_dataset = False
    if is_hf_dataset:
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="training")
    return batch_maker(
        dataset, collate, trainer._prepare_inputs,
        "sweep(trainer): trainer.train_dataset has no sample; give the Trainer samples to train on",
    )

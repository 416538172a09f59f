"""stepprof in Lightning: :class:`StepprofCallback` for ``Trainer.fit``, and :func:`sweep`, the
knee-aware batch-size finder for a LightningModule.  docs/howto/frameworks.md explains both.

Imports ``lightning.pytorch``, else ``pytorch_lightning``; ``import stepprof`` imports neither.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError(
            "stepprof.integrations.lightning needs Lightning (lightning or pytorch_lightning); "
            "install it with: pip install 'stepprof[lightning]'"
        ) from None

from .._errors import ConfigError, SyncBudgetExceeded, UsageError, raised_by_user, warn
from .._options import NAMES, ProfilerOptions
from .._recorder.profiler import Profiler
from .._sweep.result import SweepResult
from .._validate import check_option_names, check_restore
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
from ._window import Window, figures, named

__all__ = ["StepprofCallback", "sweep"]

#: The phase between two micro-batches of one optimizer step (gradient accumulation): the wait
#: for the next one, part of the step's ``data_wait_ms`` (``data_wait_in_step_ms``).
BETWEEN = "between_micro_batches"


class StepprofCallback(pl.Callback):
    """Profile every optimizer step of ``Trainer.fit`` and log the median figures to ``trainer.logger``.

    One step record per optimizer step, with the phases ``forward`` (batch start to
    ``on_before_backward``), ``backward`` (to ``on_after_backward``) and ``optimizer``
    (``on_before_optimizer_step`` to the batch's end).  Under gradient accumulation the
    step spans its micro-batches: ``batch_size`` is their sum, each phase's ``count`` is
    the number of micro-batches, and the time between them is the phase
    ``between_micro_batches``, which the step's input wait (``data_wait_ms``) counts, as it
    counts the wait before the step.  The batch size is inferred from each batch; the
    record's ``global_step`` is the step Lightning logs this step's metrics at.  At each of Lightning's logging steps the
    callback logs ``stepprof/...`` figures (medians over the steps since the last) to every
    logger in ``trainer.loggers``, on rank zero.

    Args:
        log: the JSON-lines log (under DDP each rank writes its own, see
            :class:`stepprof.Profiler`), or None to keep none.
        profiler_options: :class:`stepprof.Profiler`'s other settings (``warmup``, ``syncs``,
            ``overhead_budget``...), checked here.

    Attributes:
        profiler: the :class:`stepprof.Profiler` of the current or last fit (None before).
    """

    def __init__(self, log: str | os.PathLike[str] | None, **profiler_options: Any) -> None:
        check_option_names(profiler_options, [n for n in NAMES if n != "log"], "StepprofCallback")
        ProfilerOptions(log, **profiler_options)  # a bad value raises here, not at fit
        self._log = log
        self._options = profiler_options
        self.profiler: Profiler | None = None
        self._window: Window | None = None
        self._reset()

    def _reset(self) -> None:
        self._open = False  # a step is open (begin_step ran, end_step not yet)
        self._phase: str | None = None  # the phase open in it
        self._stepped = False  # on_before_optimizer_step fired in this micro-batch
        self._micro = 0  # the micro-batches of the open step (gradient accumulation)
        self._gap_ns = 0  # when the last micro-batch of the open step ended
        self._broken: str | None = None

    @property
    def summary(self) -> Any:
        """The last fit's :class:`stepprof.Summary` once it has ended, else None."""
        return None if self.profiler is None else self.profiler.summary

    # -- the guard: stepprof never breaks training --------------------------------------

    @contextlib.contextmanager
    def _guarded(self, hook: str) -> Iterator[bool]:
        """Run a hook's profiler calls; an error in them becomes one warning and ends profiling."""
        active = self.profiler is not None and self._broken is None and not self.profiler.closed
        try:
            yield active
        except SyncBudgetExceeded:
            raise  # on_sync="raise": the user asked for it (Lightning's on_exception closes the run)
        except Exception as e:  # noqa: BLE001 - an internal failure must not stop training
            if raised_by_user(e):
                raise
            self._broken = f"{type(e).__name__}: {e}"
            warn(
                f"stepprof: the Lightning callback stopped profiling after an error in {hook} "
                f"({self._broken}); training goes on", stacklevel=3)

    def _begin(self, name: str) -> None:
        assert self.profiler is not None
        self._end_phase()
        self.profiler.begin_phase(name)
        self._phase = name

    def _end_phase(self) -> None:
        if self._phase is not None:
            assert self.profiler is not None
            self._phase = None
            self.profiler.end_phase()

    def _end_step(self, error: BaseException | None = None) -> None:
        prof = self.profiler
        assert prof is not None
        self._phase = None  # end_step closes it
        self._open, self._stepped, self._micro = False, False, 0
        prof.end_step(error)

    # -- the fit --------------------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Here, not in setup: the process group exists, and Lightning has put its signal
        # handlers in place, so the profiler's go in front of them and leave first (on_train_end).
        self._reset()
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        self.profiler = Profiler(self._log, **on_device(self._options, device))
        self._window = Window()
        self.profiler.watch(self._window)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        with self._guarded("on_train_batch_start") as active:
            if not active:
                return
            assert self.profiler is not None
            if not self._open:  # data_wait_ms: since the last step's end
                self.profiler.begin_step(batch=batch, global_step=_logged_step(trainer))
                self._open = True
            else:  # accumulation: batch_size is the micro-batches' sum; the wait for this one counts
                self._end_phase()
                self.profiler.add_batch(batch, wait_s=(time.perf_counter_ns() - self._gap_ns) / 1e9)
            self._micro += 1
            self._begin("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        with self._guarded("on_before_backward") as active:
            if active and self._open:
                self._begin("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        with self._guarded("on_after_backward") as active:
            if active and self._open and self._phase == "backward":
                self._end_phase()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        with self._guarded("on_before_optimizer_step") as active:
            if not (active and self._open):
                return
            self._stepped = True
            if pl_module.automatic_optimization:  # manual: no hook marks the step's end
                self._begin("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with self._guarded("on_train_batch_end") as active:
            if not (active and self._open):
                return
            self._end_phase()
            accumulating = (
                pl_module.automatic_optimization and not self._stepped
                and self._micro < max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
            )
            if accumulating:
                self._begin(BETWEEN)  # until the next micro-batch starts
                self._gap_ns = time.perf_counter_ns()
                return
            self._end_step()
        if self._should_log(trainer):
            self._log_window(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer, None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer, None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer, exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish(trainer, None)

    def _finish(self, trainer: Any, error: BaseException | None) -> None:
        """End the open step (with ``error``), close the profiler, log what the window holds."""
        prof = self.profiler
        if prof is None or prof.closed:
            return
        with self._guarded("the fit's end") as active:
            if active and self._open:
                self._end_step(error)
        close_quietly(prof, error)
        self._log_window(trainer)

    # -- logging ---------------------------------------------------------------------------

    @staticmethod
    def _should_log(trainer: Any) -> bool:
        """Lightning's own decision at this batch's end (its logger connector), else every
        ``log_every_n_steps`` optimizer steps."""
        decided = getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", None)
        if isinstance(decided, bool):
            return decided
        n = int(getattr(trainer, "log_every_n_steps", 0) or 0)
        return n > 0 and trainer.global_step % n == 0

    def _log_window(self, trainer: Any) -> None:
        if self._window is None:
            return
        with self._guarded("logging") as _:
            prof = self.profiler
            if prof is not None and not prof.closed:
                prof.flush()  # the steps whose device work has completed, now (never a wait)
            figs = figures(self._window.drain())  # every rank drains; rank zero logs
            if not figs or not getattr(trainer, "is_global_zero", True):
                return
            step = _logged_step(trainer)
            for logger in getattr(trainer, "loggers", None) or ():
                sep = getattr(logger, "group_separator", "/")  # as Lightning's own monitors name theirs
                logger.log_metrics(figs if sep == "/" else named(figs, sep), step=step)


def _logged_step(trainer: Any) -> int:
    """The step Lightning logs this optimizer step's metrics at (its loggers', checkpointed)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if type(step) is int else int(trainer.global_step)


# -- the sweep --------------------------------------------------------------------------------

def sweep(
    trainer: Any,
    model: Any,
    datamodule: Any = None,
    *,
    apply: bool = False,
    batch_arg_name: str = "batch_size",
    device: Any = None,
    **sweep_options: Any,
) -> SweepResult:
    """:func:`stepprof.sweep` over a LightningModule: the knee, the largest batch that fits, the
    thrash zone, and the recommended batch.

    ``train_step`` is one optimizer step as Lightning's automatic optimization runs it
    (``training_step`` under the trainer's precision context, ``zero_grad``, backward,
    ``step`` of each optimizer); ``make_batch(n)`` collates ``n`` real samples of the train
    dataloader's dataset (cycling through it) and moves them to the device through the
    module's batch-transfer hooks.  The model, its optimizers (the trainer's, once a fit made
    them, else ``configure_optimizers()``'s) and the precision plugin's grad scaler get their
    state back exactly, and the model returns to its device and train/eval mode.

    Args:
        trainer: the ``Trainer`` (its device, precision, and its optimizers after a fit).
        model: the ``LightningModule`` (automatic optimization).
        datamodule: the ``LightningDataModule`` whose ``train_dataloader()`` gives the data
            (``prepare_data()`` and ``setup("fit")`` are called first, as a fit would);
            default: the trainer's, else ``model.train_dataloader()``.
        apply: set the recommended batch where Lightning's batch-size finder does:
            ``batch_arg_name`` on the model, ``model.hparams``, the datamodule and its
            ``hparams`` (every one that has it).
        batch_arg_name: the attribute ``apply`` sets.
        device: the device to sweep on; default ``trainer.strategy.root_device``.
        sweep_options: :func:`stepprof.sweep`'s options (``max_batch``, ``time_budget_s``,
            ``log``...); ``restore`` adds objects to those restored.

    Returns:
        The :class:`stepprof.SweepResult`.
    """
    _check_sweep(model, sweep_options)
    datamodule = datamodule if datamodule is not None else getattr(trainer, "datamodule", None)
    holders = _batch_holders(model, datamodule, batch_arg_name)
    if apply and not holders:
        raise ConfigError(
            f"apply=True, but neither the model, model.hparams nor the datamodule has {batch_arg_name!r}; "
            f"call self.save_hyperparameters() with a {batch_arg_name} argument, give the datamodule a "
            f"{batch_arg_name} attribute, or pass apply=False and use result.recommended"
        )
    device = torch.device(device) if device is not None else torch.device(trainer.strategy.root_device)
    extra = check_restore(sweep_options.pop("restore", None))  # one, or a list or tuple, as stepprof.sweep

    with _prepared(trainer, model, device) as (optimizers, scaler):
        loader = _train_loader(model, datamodule)
        train_step = _train_step(trainer, model, optimizers, scaler)
        make_batch = _batch_maker(loader, model, device)
        restore = restored(model, optimizers, scaler, extra)
        result = run_sweep(train_step, make_batch, restore=restore, device=str(device), **sweep_options)

    if apply:
        def set_batch(n: int) -> None:
            for holder in holders:
                if isinstance(holder, dict):
                    holder[batch_arg_name] = n
                else:
                    setattr(holder, batch_arg_name, n)

        apply_recommended(result, set_batch, lambda reason: (
            f"stepprof: the sweep recommended no batch ({reason}); {batch_arg_name} was left as it was"))
    return result


def _check_sweep(model: Any, sweep_options: dict[str, Any]) -> None:
    """A UsageError or ConfigError for a model or an option :func:`sweep` cannot take."""
    if not isinstance(model, pl.LightningModule):
        raise UsageError(f"'model' must be a LightningModule (got {type(model).__name__}); pass the module you fit")
    if not model.automatic_optimization:
        raise ConfigError(
            "sweep needs automatic optimization (got model.automatic_optimization=False): with manual "
            "optimization only your training_step knows a step; call stepprof.sweep(train_step, make_batch) "
            "with your own train_step"
        )
    check_sweep_options(sweep_options, "stepprof.integrations.lightning.sweep", taken=("device",))


def _batch_holders(model: Any, datamodule: Any, name: str) -> list[Any]:
    """Where Lightning's batch-size finder reads and sets ``name`` (its ``lightning_setattr``)."""
    holders: list[Any] = []
    for obj in (model, datamodule):
        if obj is None:
            continue
        if hasattr(obj, name):
            holders.append(obj)
        hparams = getattr(obj, "hparams", None)
        if hparams is not None and name in hparams:
            holders.append(hparams)
    return holders


@contextlib.contextmanager
def _prepared(trainer: Any, model: Any, device: torch.device) -> Iterator[tuple[list[Any], Any]]:
    """The model on ``device`` in train mode, attached to the trainer, ``self.log`` muted, and its
    optimizers' state on the device; all as it was afterwards."""
    params = list(model.parameters())
    home = params[0].device if params else device
    was_training, had_trainer = model.training, model._trainer
    optimizers: list[Any] = []
    try:
        if had_trainer is None:
            model.trainer = trainer  # configure_optimizers and training_step may read self.trainer
        held = [getattr(o, "_optimizer", o) for o in (getattr(trainer, "optimizers", None) or ())]
        ids = {id(p) for p in params}
        if held and all(id(p) in ids for o in held for g in o.param_groups for p in g["params"]):
            optimizers = held  # a fit made them: their state is part of a real step
        else:
            optimizers = _optimizers_of(model.configure_optimizers())
        if not optimizers:
            raise ConfigError("configure_optimizers() returned no optimizer; the sweep needs one to take steps")
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        with overridden(model, log=_quiet, log_dict=_quiet):  # the sweep's steps are not training to log
            model.to(device)
            for o in optimizers:
                _optimizer_to(o, device)
            model.train()
            yield optimizers, scaler
    finally:
        model.to(home)
        for o in optimizers:
            _optimizer_to(o, home)
        model.train(was_training)
        if had_trainer is None:
            model.trainer = None


def _quiet(*_: Any, **__: Any) -> None:
    """``self.log`` and ``self.log_dict`` during the sweep."""


def _optimizer_to(optimizer: Any, device: torch.device) -> None:
    """An optimizer's state onto ``device``, but ``step`` (torch keeps it where it is)."""
    for state in optimizer.state.values():
        if isinstance(state, dict):
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device)


def _optimizers_of(conf: Any) -> list[Any]:
    """The optimizers in what ``configure_optimizers()`` returned (each of Lightning's forms)."""
    if conf is None:
        return []
    if isinstance(conf, torch.optim.Optimizer):
        return [conf]
    if isinstance(conf, Mapping):
        if "optimizer" not in conf:
            raise ConfigError(
                f"configure_optimizers() returned a dict without 'optimizer' (keys: {sorted(conf)}); "
                f"return {{'optimizer': opt, ...}}"
            )
        return [conf["optimizer"]]
    if isinstance(conf, (list, tuple)):
        if len(conf) == 2 and isinstance(conf[0], (list, tuple)):  # ([optimizers], [schedulers])
            return [o for c in conf[0] for o in _optimizers_of(c)]
        return [o for c in conf for o in _optimizers_of(c)]
    if hasattr(conf, "step") and hasattr(conf, "param_groups"):
        return [conf]  # an optimizer-like object
    return []  # a scheduler in a list


def _train_step(trainer: Any, model: Any, optimizers: list[Any], scaler: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    context = getattr(plugin, "train_step_context", None) or getattr(plugin, "forward_context", None)

    def train_step(batch: Any) -> None:
        with context() if context is not None else contextlib.nullcontext():
            out = model.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(
                f"training_step returned {type(out).__name__}, not a loss tensor or a dict with 'loss'; "
                f"the sweep needs the loss to take a step"
            )
        for o in optimizers:  # Lightning zeroes the gradients before backward
            o.zero_grad(set_to_none=True)
        (loss if scaler is None else scaler.scale(loss)).backward()
        step_optimizers(optimizers, scaler)

    return train_step


def _train_loader(model: Any, datamodule: Any) -> Any:
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
        return datamodule.train_dataloader()
    try:
        return model.train_dataloader()
    except Exception as e:  # noqa: BLE001 - said with the fix
        if raised_by_user(e):
            raise
        raise ConfigError(
            f"sweep found no data: no datamodule was given and model.train_dataloader() raised "
            f"{type(e).__name__}: {e}; pass datamodule=..."
        ) from e


def _batch_maker(loader: Any, model: Any, device: torch.device) -> Any:
    """``make_batch(n)``: ``n`` samples of the loader's dataset (cycled), collated, on the device."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if dataset is None or collate is None:
        raise ConfigError(
            f"the train dataloader ({type(loader).__name__}) has no dataset and collate_fn; the sweep "
            f"draws samples from a torch DataLoader's dataset"
        )
    if getattr(loader, "batch_size", 1) is None and getattr(loader, "batch_sampler", None) is None:
        raise ConfigError(
            "the train dataloader has batch_size=None (its dataset yields whole batches); the sweep "
            "needs a dataset of samples to make batches of any size"
        )

    def to_device(batch: Any) -> Any:
        batch = model.on_before_batch_transfer(batch, 0)
        batch = model.transfer_batch_to_device(batch, device, 0)
        return model.on_after_batch_transfer(batch, 0)

    return batch_maker(dataset, collate, to_device, "the train dataset has no sample; the sweep needs real samples")

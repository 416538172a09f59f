"""Saving and restoring the user's state around a sweep (the sweep trains: every
trial runs real steps), and the profiler stand-in that mutes ``profile_step`` and
``measure`` inside ``train_step`` meanwhile."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["MutedProfiler", "SavedRngState", "SavedState"]


def _to_host(x: Any) -> Any:
    """A copy of a state dict (or any value in it) with every tensor copied to host memory."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(x, OrderedDict) else {}
        for k, v in x.items():
            out[k] = _to_host(v)
        meta = getattr(x, "_metadata", None)
        if meta is not None:
            out._metadata = copy.deepcopy(meta)  # type: ignore[attr-defined]  # module versions
        return out
    if isinstance(x, list):
        return [_to_host(v) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_to_host(v) for v in x)
    return copy.deepcopy(x)


class SavedState:
    """State dicts (and a module's gradients) copied to host memory, put back by :meth:`restore`."""

    def __init__(self, objs: tuple[Any, ...]) -> None:
        self._items: list[tuple[Any, Any, list[tuple[torch.Tensor, torch.Tensor | None]] | None]] = []
        for obj in objs:
            grads: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
            if isinstance(obj, torch.nn.Module):
                grads = [
                    (p, None if p.grad is None else p.grad.detach().to("cpu", copy=True))
                    for p in obj.parameters()
                ]
            self._items.append((obj, _to_host(obj.state_dict()), grads))

    def restore(self) -> None:
        """Load the saved state dicts back, and put the gradients back in place."""
        for obj, state, grads in self._items:
            obj.load_state_dict(state)
            if grads is None:
                continue
            with torch.no_grad():
                for p, g in grads:
                    if g is None:
                        p.grad = None
                    elif p.grad is not None and p.grad.shape == g.shape:
                        p.grad.copy_(g)
                    else:
                        p.grad = g.to(p.device)


class SavedRngState:
    """torch's CPU random state, and CUDA device ``cuda_index``'s when given, put back by
    :meth:`restore`: the sweep's random draws are undone."""

    def __init__(self, cuda_index: int | None) -> None:
        self._cpu = torch.get_rng_state()
        self._cuda = None if cuda_index is None else (cuda_index, torch.cuda.get_rng_state(cuda_index))

    def restore(self) -> None:
        """Set the saved random states again."""
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state(self._cuda[1], self._cuda[0])


class MutedProfiler:
    """Stands in for the active profiler during a sweep: ``profile_step`` and ``measure``
    inside ``train_step`` record nothing (and do not reset the peak counter)."""

    closed = False

    def _enter(self, name: Any, batch_size: Any, step: bool, *_: Any, **__: Any) -> None:
        return None

    def _exit(self, token: Any, exc: Any) -> None:
        pass

    def _note_batch(self, data_ns: int, item: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "<stepprof.sweep: profiling muted>"

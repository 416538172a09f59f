"""Stands in for torch in the sync tests: its frames count as torch's own (internal).

A C++ op has no Python frame, so its waits come from the caller's frame
(``depth=2``); Python-level torch code (``Tensor.__str__``) waits from its own
frames, several times per call.
"""

from __future__ import annotations


class FakeTensor:
    def __init__(self, gpu, n: int = 4) -> None:
        self.gpu = gpu
        self.n = n

    # C++ ops that make the host wait once
    def item(self):
        self.gpu.sync(depth=2)
        return 1.0

    def tolist(self):
        self.gpu.sync(depth=2)
        return [1.0] * self.n

    def cpu(self):
        self.gpu.sync(depth=2)
        return self

    def cuda(self):
        self.gpu.sync(depth=2)
        return self

    def to(self, *args, **kwargs):
        if not kwargs.get("non_blocking"):
            self.gpu.sync(depth=2)
        return self

    def nonzero(self):
        self.gpu.sync(depth=2)
        return self

    def synchronize(self):  # like Stream.synchronize
        self.gpu.sync(depth=2)

    def __float__(self):
        self.gpu.sync(depth=2)
        return 1.0

    def __bool__(self):
        self.gpu.sync(depth=2)
        return True

    def __gt__(self, other):
        return FakeTensor(self.gpu, self.n)  # no wait: a comparison stays on the device

    def __getitem__(self, mask):
        self.gpu.sync(depth=2)
        return self

    def __setitem__(self, mask, value):
        pass  # index_put: no wait

    def repeat_interleave(self, repeats):
        self.gpu.sync(depth=2)  # one C++ op that waits twice (the check, the output size)
        self.gpu.sync(depth=2)
        return self

    # Python-level torch code that waits several times inside one call
    def __str__(self):
        return self._format()

    def __format__(self, spec):
        return self._format()

    def _format(self):
        for _ in range(3):
            self.gpu.sync(depth=1)
        return "tensor([...])"


def masked_select(x, mask):
    x.gpu.sync(depth=2)
    return x


def unique(x):
    return _unique_impl(x)  # torch.unique is Python around a C++ op


def _unique_impl(x):
    x.gpu.sync(depth=1)
    return x


def synchronize(gpu):  # like torch.cuda.synchronize as wrapped by stepprof
    gpu.sync("device_synchronize", depth=2)

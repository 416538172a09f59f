"""The exchange's process-wide side streams, on a CPU (torch's stream type is patched)."""

from __future__ import annotations

import torch

from stepprof._device import exchange


def test_one_side_stream_per_device_until_reset(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    streams = exchange._SideStreams()
    first = streams.get(torch.device("cuda", 0))
    assert streams.get(torch.device("cuda", 0)) is first
    assert streams.get(torch.device("cuda", 1)) is not first
    streams.reset()
    assert streams.get(torch.device("cuda", 0)) is not first
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]

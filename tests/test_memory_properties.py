"""Properties of the pure reconciliation, over arbitrary readings: never a crash, every
null figure has a reason, and the identities hold whenever their figures exist."""

from __future__ import annotations

import pytest

from stepprof import _memory
from stepprof._device.backend import AllocatorFigures
from stepprof._device.nvml import NvmlReading
from stepprof._memory import DEVICE_BASIS, PROCESS_BASIS, Mark, Snapshot, reconcile

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

size = st.integers(min_value=0, max_value=2**40)


@st.composite
def snapshots(draw):
    allocator = None
    if draw(st.booleans()):
        allocated, cached, peak_extra = draw(size), draw(size), draw(size)
        allocator = AllocatorFigures(
            allocated, allocated + peak_extra, allocated + cached, draw(size),
            draw(st.integers(0, 5)), draw(st.integers(0, 5)),
        )
    free_total = None
    if draw(st.booleans()):
        used, free = draw(size), draw(size)
        free_total = (free, used + free)
    process = draw(st.none() | size)
    device = draw(st.none() | size)
    nvml = NvmlReading(
        process, device,
        None if process is not None else draw(st.sampled_from(["NVML missing", "PID not visible"])),
        None if device is not None else "NotSupported",
    )
    reasons = {}
    if allocator is None:
        reasons["allocator"] = "allocator read failed"
    if free_total is None:
        reasons["mem_get_info"] = "mem_get_info failed"
    return Snapshot("cuda:0", 0.0, allocator, free_total, nvml, reasons)


marks = st.none() | st.builds(
    Mark, st.none() | st.integers(-(2**30), 2**40), st.sampled_from([None, PROCESS_BASIS, DEVICE_BASIS]),
    st.just("the reference"), st.just("why"),
)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(snapshots(), marks, marks, st.integers(-1, 2**40), st.sampled_from([None, "expandable_segments:True"]))
def test_every_null_figure_has_a_reason_and_the_identities_hold(snap, baseline, reference, floor, conf):
    r = reconcile(snap, trigger="periodic", step=3, peak_floor=floor, baseline=baseline,
                  reference=reference, alloc_conf=conf)
    for field in _memory._FIGURE_FIELDS:
        assert (getattr(r, field) is None) == (field in r.unavailable), field
        if field in r.unavailable:
            assert r.unavailable[field]
    assert set(r.unavailable) <= set(_memory._FIGURE_FIELDS)
    if r.residual_bytes is not None:
        total = r.nvml_process_bytes if r.basis == PROCESS_BASIS else r.mem_get_info_used_bytes
        assert total == r.reserved_bytes + r.residual_bytes
    if r.fragmentation_bytes is not None:
        assert r.reserved_bytes == r.allocated_bytes + r.fragmentation_bytes
    if r.peak_allocated_bytes is not None:
        assert r.peak_allocated_bytes >= max(floor, snap.allocator.peak_allocated_bytes)
    assert r.explanation.endswith(".") and "\n" not in str(r)
    assert r.to_record()["kind"] == "memory"

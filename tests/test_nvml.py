"""stepprof._device.nvml's process-wide state (:data:`NVML`), with a FakeNvml as ``pynvml``."""

from __future__ import annotations

from stepprof._device import nvml as nvml_lib


def test_reset_shuts_nvml_down_and_forgets_every_answer(nvml):
    reading = nvml_lib.read(str(nvml.gpu.uuid), nvml.gpu.pci_bus_id)
    assert reading.device_used_bytes is not None
    state = nvml_lib.NVML
    assert state.tried and state.module is nvml and state.handles
    nvml_lib.read(str(nvml.gpu.uuid), nvml.gpu.pci_bus_id)
    assert nvml.calls["nvmlInit"] == 1 and nvml.calls["nvmlDeviceGetHandleByUUID"] == 1  # cached
    state.reset()
    assert not state.tried and state.module is None and not state.handles and not state.codes
    assert nvml.initialised == 0 and nvml.calls["nvmlShutdown"] == 1
    nvml_lib.read(str(nvml.gpu.uuid), nvml.gpu.pci_bus_id)                        # starts over
    assert nvml.calls["nvmlInit"] == 2 and nvml.calls["nvmlDeviceGetHandleByUUID"] == 2


def test_a_forked_child_starts_over_without_shutting_the_parents_nvml_down(nvml):
    nvml_lib.read(str(nvml.gpu.uuid), nvml.gpu.pci_bus_id)
    lock = nvml_lib.NVML.lock
    nvml_lib._forget_in_child()
    state = nvml_lib.NVML
    assert state.lock is not lock and not state.tried and state.module is None and not state.handles
    assert nvml.calls.get("nvmlShutdown", 0) == 0


def test_why_nvml_is_unavailable_is_kept_until_reset():
    # conftest makes `import pynvml` fail outside cuda-marked tests
    reading = nvml_lib.read("00000000-0000-0000-0000-000000000000", None)
    assert reading.process_bytes is None and "nvidia-ml-py is not installed" in reading.process_reason
    assert nvml_lib.NVML.tried and nvml_lib.NVML.unavailable == reading.process_reason
    nvml_lib.NVML.reset()
    assert not nvml_lib.NVML.tried and nvml_lib.NVML.unavailable is None

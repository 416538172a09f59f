"""Energy per step (``Profiler(energy_every_s=...)``, stepprof/_recorder/energy.py) on the fake GPU.

The sampler's reads are gated by the test (:class:`Gate`): a sample is taken only when the
test lets one through, at the fake clock's time, so the attribution is deterministic.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import torch

import stepprof
from stepprof._recorder.energy import NOT_YET, ON_HOST, EnergyHook
from stepprof._recorder.profiler import _make_profiler

from .conftest import make, steps

pytestmark = pytest.mark.usefixtures("either_path")  # the C harvest holds the records too

class Gate:
    """An energy counter whose reads wait for the test (``sample``), on the fake device's power."""

    def __init__(self, nvml) -> None:
        self.nvml = nvml
        self.tokens: queue.Queue[int] = queue.Queue()
        self.open = False
        self.threads: list[str] = []

    def opener(self, b):
        return self.read, None

    def read(self):
        self.threads.append(threading.current_thread().name)
        if not self.open:
            self.tokens.get()
        return round(self.nvml.energy_mj()), None

    def sample(self, prof) -> None:
        """Let one read through, and wait until the sampler has stored it."""
        hook = prof._energy
        deadline = time.monotonic() + 10
        while hook.sampler is None:
            assert time.monotonic() < deadline, "the sampler did not start"
            time.sleep(0.001)
        n = len(hook.sampler.times)
        self.tokens.put(1)
        while len(hook.sampler.times) == n:
            assert time.monotonic() < deadline, "no sample came"
            time.sleep(0.001)

    def release(self) -> None:
        self.open = True
        self.tokens.put(1)


@pytest.fixture
def gated(nvml, monkeypatch):
    gate = Gate(nvml)
    monkeypatch.setattr("stepprof._recorder.energy.open_counter", gate.opener)
    monkeypatch.setattr(EnergyHook.__init__, "__defaults__", (gate.opener,))
    return gate


def run_step(prof, gpu, gpu_ms: float = 2.0, host_ms: float = 0.5, sync: bool = True) -> None:
    with prof.step(batch_size=4):
        gpu.host(host_ms)
        gpu.launch(gpu_ms)
        if sync:
            gpu.wait_idle()


def test_a_window_of_steps_sums_to_the_counter_and_one_step_is_interpolated(log, gated):
    """Samples only at the window's ends, the power changing in between: the steps' sum is the
    counter's difference, exactly; each step's share is the interpolation (the average power)."""
    nvml, gpu = gated.nvml, gated.nvml.gpu
    nvml.set_power(100.0)
    prof = make(log, gpu, energy_every_s=0.05)
    run_step(prof, gpu)
    run_step(prof, gpu)  # step 0 is harvested here: the sampler starts
    gated.sample(prof)  # at step 1's end: the window's start
    start_mj = nvml.energy_mj()
    for i in range(10):
        if i:
            gpu.host(0.3)  # between steps: goes to the next step
        if i == 5:
            nvml.set_power(400.0)  # no sample here: one step cannot know
        run_step(prof, gpu, gpu_ms=2.0 + i % 3)
    gated.sample(prof)  # at the last step's end: the window's end
    end_mj = nvml.energy_mj()
    gated.release()
    prof.close()
    recs = steps(log)
    assert recs[0]["energy_j"] is None and recs[0]["unavailable"]["energy_j"] == NOT_YET
    assert recs[1]["energy_j"] is None  # its span began before the first sample
    window = recs[2:]
    assert all(r["energy_j"] is not None for r in window)
    total = sum(r["energy_j"] for r in window)
    assert total == pytest.approx((end_mj - start_mj) / 1e3, rel=1e-6, abs=2e-3)
    spans = sum(r["energy_span_ms"] for r in window)
    mean_w = (end_mj - start_mj) / spans  # mJ per ms = W
    for r in window:  # one step: the window's average power times its span, not its own power
        assert r["energy_j"] == pytest.approx(mean_w * r["energy_span_ms"] / 1e3, rel=1e-3, abs=2e-3)
    s = prof.summary
    assert s.energy_j_per_step == pytest.approx(total / len(window), rel=1e-5)
    assert s.power_w_mean == pytest.approx(mean_w, rel=1e-3)
    assert s.samples_per_j == pytest.approx(4 * len(window) / total, rel=1e-5)


def sampling(log, gated, power_w: float):
    """A profiler on the fake GPU at ``power_w``, two steps in (they have no energy: they came
    before the sampler's first sample), and its first sample taken."""
    nvml, gpu = gated.nvml, gated.nvml.gpu
    nvml.set_power(power_w)
    prof = make(log, gpu, energy_every_s=0.05)
    run_step(prof, gpu)
    run_step(prof, gpu)
    gated.sample(prof)
    return prof, gpu


def test_spans_follow_the_gpu_when_it_lags_the_host(log, gated):
    """Queued GPU work runs after the host left the step: the span is the device's."""
    prof, gpu = sampling(log, gated, 200.0)
    for _ in range(4):  # 1 ms of host work, 5 ms of GPU work each: the GPU falls behind
        run_step(prof, gpu, gpu_ms=5.0, host_ms=1.0, sync=False)
    gpu.wait_idle()
    gated.sample(prof)
    gated.release()
    prof.close()
    window = steps(log)[2:]
    # The first waits 1 ms for its launch (the device was idle); then back to back, 5 ms each.
    assert [r["energy_span_ms"] for r in window] == pytest.approx([6.0, 5.0, 5.0, 5.0])
    assert [r["energy_j"] for r in window] == pytest.approx([200.0 * 6e-3] + [200.0 * 5e-3] * 3, abs=2e-3)
    assert all(r["wall_ms"] == pytest.approx(1.0) for r in window)


def test_records_wait_for_a_later_sample_and_stay_whole_and_in_order(log, gated):
    nvml, gpu = gated.nvml, gated.nvml.gpu
    nvml.set_power(300.0)
    prof = make(log, gpu, energy_every_s=0.05, memory_every=2)
    run_step(prof, gpu)
    run_step(prof, gpu)
    gated.sample(prof)
    for _ in range(5):
        run_step(prof, gpu)
    written = len(steps(log))
    assert written == 2  # steps 2.. wait for a sample after them (steps 0 and 1 did not)
    gated.sample(prof)
    run_step(prof, gpu)  # the inline harvest at this exit writes the held ones
    assert len(steps(log)) == 7
    gated.release()
    prof.close()
    with open(log, "rb") as f:
        lines = f.read().splitlines()
    recs = list(stepprof.read(log))
    assert len(lines) == len(recs)  # every line a whole record
    idx = [r["step"] for r in recs if r["kind"] == "step"]
    assert idx == sorted(idx) == list(range(8))
    kinds = [(r["kind"], r.get("step")) for r in recs]
    assert kinds.index(("memory", 2)) == kinds.index(("step", 2)) + 1  # its record still follows its step's
    assert all(r["energy_j"] is not None for r in steps(log)[2:])


def test_the_counter_is_read_only_on_the_sampler_thread(log, nvml, monkeypatch):
    """Through NVML (the fake): every read is on stepprof's energy thread, never the training thread."""
    gpu = nvml.gpu
    nvml.set_power(250.0)
    prof = _make_profiler(log, backend=gpu, clock=gpu.clock, energy_every_s=0.05)
    deadline = time.monotonic() + 10
    with prof:
        while len(nvml.energy_threads) < 3:
            assert time.monotonic() < deadline
            run_step(prof, gpu)
            time.sleep(0.01)
        sampler = prof._energy.sampler
        thread = sampler.thread
    assert set(nvml.energy_threads) == {"stepprof-energy"}
    assert threading.current_thread().name != "stepprof-energy"
    assert not thread.is_alive()  # stopped at close
    assert any(r["energy_j"] is not None for r in steps(log))


def test_a_counter_that_is_not_supported_gives_null_with_the_reason(log, nvml):
    gpu = nvml.gpu
    nvml.set_power(None)  # NVML_ERROR_NOT_SUPPORTED
    prof = make(log, gpu, energy_every_s=0.05)
    run_step(prof, gpu)
    run_step(prof, gpu)
    prof._energy.sampler.thread.join(10)
    run_step(prof, gpu)
    prof.close()
    last = steps(log)[-1]
    assert last["energy_j"] is None
    assert "NotSupported" in last["unavailable"]["energy_j"]
    assert "nvmlDeviceGetTotalEnergyConsumption" in last["unavailable"]["energy_j"]
    assert "NotSupported" in prof.summary.unavailable["energy_j_per_step"]
    assert prof.summary.energy_j_per_step is prof.summary.power_w_mean is None


def test_nvml_missing_gives_null_with_the_reason(log, gpu):
    prof = make(log, gpu, energy_every_s=0.05)  # conftest: import pynvml fails
    run_step(prof, gpu)
    run_step(prof, gpu)
    prof._energy.sampler.thread.join(10)
    run_step(prof, gpu)
    prof.close()
    last = steps(log)[-1]
    assert last["energy_j"] is None and "nvidia-ml-py is not installed" in last["unavailable"]["energy_j"]


def test_cpu_steps_have_null_energy_with_the_reason(log):
    with stepprof.Profiler(log, device="cpu") as prof:
        with prof.step():
            pass
    (r,) = steps(log)
    assert r["energy_j"] is None and r["unavailable"]["energy_j"] == ON_HOST
    assert prof._energy.sampler is None  # no thread on the host
    assert prof.summary.unavailable["energy_j_per_step"] == ON_HOST


def test_energy_off_adds_nothing(log, gpu):
    with make(log, gpu) as prof:  # conftest's make: energy_every_s=None
        run_step(prof, gpu)
    (r,) = steps(log)
    assert "energy_j" not in r and prof._energy is None
    assert prof.summary.unavailable["energy_j_per_step"] == "energy sampling is off (energy_every_s=None)"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_has_no_sampler_and_the_parent_keeps_its_own(log, gated):
    nvml, gpu = gated.nvml, gated.nvml.gpu
    nvml.set_power(100.0)
    prof = make(log, gpu, energy_every_s=0.05)
    run_step(prof, gpu)
    run_step(prof, gpu)
    gated.sample(prof)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the inherited profiler records nothing and starts no thread
        code = 1
        try:
            hook = prof._energy
            ok = hook.sampler is None and not any(t.name == "stepprof-energy" for t in threading.enumerate())
            prof.close()
            ok = ok and hook.sampler is None
            code = 0 if ok else 3
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00"
    assert prof._energy.sampler.thread.is_alive()  # the parent's sampler runs on
    gated.release()
    prof.close()
    assert not prof._energy.sampler.thread.is_alive()


def test_the_setting_is_checked():
    for bad in (0, 0.01, -1, 1e9, float("nan"), "0.5", True):
        with pytest.raises(stepprof.ConfigError, match=r"'energy_every_s' must be a number of seconds from 0.05 to 3600"):
            stepprof.Profiler(None, energy_every_s=bad)
    with stepprof.Profiler(None, energy_every_s=None) as off, stepprof.Profiler(None) as default:
        assert off.energy_every_s is None and default.energy_every_s == 0.5


def test_memory_records_state_the_power_limit_and_other_processes(log, nvml):
    nvml.other_pids = [4242]
    with make(log, nvml.gpu) as prof:
        run_step(prof, nvml.gpu)
    recs = [r for r in stepprof.read(log) if r["kind"] == "memory"]  # after warm-up, at close
    assert recs and all(r["power_limit_w"] == 700.0 and r["other_processes"] == 1 for r in recs)
    nvml.power_limit_w = None
    rep = stepprof._memory.report(prof._boundaries.backend, trigger="on_demand")
    assert rep.power_limit_w is None and "NotSupported" in rep.unavailable["power_limit_w"]


def test_the_summary_and_the_report_agree_on_energy(log, gated, capsys):
    from .test_summary_matches_report import _assert_shared_figures_equal, _report_run

    nvml, gpu = gated.nvml, gated.nvml.gpu
    nvml.set_power(150.0)
    prof = make(log, gpu, warmup=1, energy_every_s=0.05)
    run_step(prof, gpu)
    run_step(prof, gpu)
    gated.sample(prof)
    for i in range(6):
        run_step(prof, gpu, gpu_ms=1.0 + i)
        gated.sample(prof)
    gated.release()
    prof.close()
    s = prof.summary
    assert s.energy_j_per_step is not None and s.power_w_mean == pytest.approx(150.0, rel=1e-3)
    run = _report_run(capsys, log)
    _assert_shared_figures_equal(s, run, log)
    from stepprof._cli import main

    assert main(["report", log]) == 0
    text = capsys.readouterr().out
    assert "energy J/step (mean)" in text and "samples/J" in text
    assert any(line.split()[-1] == "150" for line in text.splitlines() if "power W (mean)" in line)


def test_stepprof_env_states_the_power_limit_and_other_processes(monkeypatch, nvml, gpu):
    from types import SimpleNamespace

    from stepprof import _env

    props = SimpleNamespace(uuid=gpu.uuid, pci_bus_id=0x65, pci_device_id=0, pci_domain_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    got = _env._power(0)
    assert got["power_limit_w"] == nvml.power_limit_w and got["power_limit_reason"] is None
    assert got["other_processes"] == 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: 1 / 0)
    assert _env._power(0)["power_limit_reason"].startswith("ZeroDivisionError")


def test_a_signal_writes_the_steps_waiting_for_their_sample_with_the_reason(log, gated):
    """SIGTERM writes the completed steps and a summary, also those whose records wait for
    the energy sample after them: the process may end before it comes.  Their energy is null
    with the reason; the run goes on, and later steps get theirs."""
    prof, gpu = sampling(log, gated, 300.0)
    for _ in range(3):
        run_step(prof, gpu)
    assert [r["step"] for r in steps(log)] == [0, 1]  # steps 2.. wait for a sample after them
    prof._on_signal("SIGTERM")
    recs = list(stepprof.read(log))
    assert [r["step"] for r in recs if r["kind"] == "step"] == [0, 1, 2, 3, 4]
    assert recs[-1]["kind"] == "summary" and recs[-1]["ended_by"] == "SIGTERM"
    for r in steps(log)[2:]:
        assert r["energy_j"] is None and r["energy_span_ms"] > 0
        assert r["unavailable"]["energy_j"] == "SIGTERM arrived before the energy sample after this step"
    run_step(prof, gpu)
    gated.sample(prof)
    run_step(prof, gpu)
    gated.release()
    prof.close()
    last = steps(log)
    assert [r["step"] for r in last] == list(range(7))
    assert last[5]["energy_j"] is not None and last[6]["energy_j"] is not None

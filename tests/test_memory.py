"""Memory reconciliation on a CPU: a FakeGpu for torch's side, a FakeNvml put where
stepprof._device.nvml imports ``pynvml``, and every failure the issue names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import stepprof
from stepprof import _memory
from stepprof._device import nvml as _nvml
from stepprof._device.backend import AllocatorFigures
from stepprof._device.nvml import NvmlReading
from stepprof._memory import DEVICE_BASIS, Mark, Snapshot, reconcile

from .conftest import make
from .fakes import FakeGpu, FakeNvml, GiB, MiB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def memory_records(log):
    return list(stepprof.read(log, kind="memory"))


def run_steps(prof, gpu, n, *, alloc=0):
    for _ in range(n):
        with prof.step():
            if alloc:
                gpu.alloc(alloc)
                gpu.free(alloc)


def issue_example(gpu: FakeGpu) -> FakeGpu:
    """The FINDINGS step: 1.60 GiB of tensors (peak 2.60), 3.19 GiB reserved, 0.72 GiB outside torch."""
    gpu.allocated = round(1.60 * GiB)
    gpu.peak = round(2.60 * GiB)
    gpu.reserved = round(3.19 * GiB)
    gpu.outside = round(0.72 * GiB)
    return gpu


# -- the reconciliation ---------------------------------------------------------


def test_the_issue_example_reconciles_and_reads_as_the_issue_says(log, nvml):
    gpu = issue_example(nvml.gpu)
    with make(log, gpu):
        r = stepprof.memory_report()
    assert r.basis == "process"
    assert r.nvml_process_bytes == gpu.reserved + gpu.outside
    assert r.residual_bytes == gpu.outside                      # process - reserved
    assert r.nvml_process_bytes == r.reserved_bytes + r.residual_bytes
    assert r.fragmentation_bytes == gpu.reserved - gpu.allocated
    assert r.mem_get_info_used_bytes == gpu.reserved + gpu.outside  # alone on the device
    assert r.total_bytes == gpu.total
    assert r.nvml_device_used_bytes == gpu.reserved + gpu.outside
    assert r.explanation == (
        "nvidia-smi shows 3.91 GiB for this process: 1.60 GiB live tensors, 1.59 GiB cached by "
        "PyTorch's allocator for reuse (not a leak), 0.72 GiB CUDA context and libraries."
    )
    assert r.notes == () and r.unavailable == {}
    assert str(r) == (
        "stepprof memory on cuda:0 (on_demand): nvidia-smi 3.91 GiB = 1.60 GiB tensors + "
        "1.59 GiB cached + 0.72 GiB context and other; peak 2.60 GiB"
    )


def test_the_record_holds_every_field_in_the_documented_order(log, nvml):
    with make(log, nvml.gpu) as prof:
        report = stepprof.memory_report()
    rec, close = memory_records(log)
    assert close["trigger"] == "close"
    assert list(rec) == [
        "schema_version", "kind", "trigger", "step", "device", "unix_s",
        "allocated_bytes", "peak_allocated_bytes", "reserved_bytes", "fragmentation_bytes",
        "inactive_split_bytes", "nvml_process_bytes", "nvml_device_used_bytes",
        "mem_get_info_used_bytes", "total_bytes", "residual_bytes", "context_baseline_bytes",
        "num_ooms", "num_alloc_retries", "basis", "explanation", "notes", "unavailable",
        "power_limit_w", "other_processes", "run_id",
    ]
    assert rec["power_limit_w"] == 700.0 and rec["other_processes"] == 0
    run_id = prof.summary.run_id
    assert rec == {"schema_version": stepprof.SCHEMA_VERSION, **report.to_record(), "run_id": run_id}


def test_records_after_warmup_every_n_steps_and_at_close_follow_their_steps(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=2, memory_every=3)
    run_steps(prof, gpu, 10)
    prof.close()
    recs = list(stepprof.read(log))
    where = [(r["kind"], r.get("step"), r.get("trigger")) for r in recs if r["kind"] != "step"]
    assert where == [
        ("memory", 2, "after_warmup"), ("memory", 5, "periodic"), ("memory", 8, "periodic"),
        ("memory", 9, "close"), ("summary", None, None),
    ]
    kinds = [(r["kind"], r.get("step")) for r in recs]
    for _, step, _ in where[:3]:       # each periodic record directly follows its step's record
        assert kinds[kinds.index(("memory", step)) - 1] == ("step", step)
    # NVML is never read per step: once for the baseline, then once per record.
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 1 + 4
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 1 + 4
    assert nvml.calls["nvmlInit"] == 1 and nvml.calls["nvmlDeviceGetHandleByUUID"] == 1


def test_steps_not_due_a_record_touch_neither_nvml_nor_the_extra_reads(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=1, memory_every=0)
    run_steps(prof, gpu, 200)
    prof.close()
    assert [r["trigger"] for r in memory_records(log)] == ["after_warmup", "close"]
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 3      # baseline + 2 records
    for extra in ("read_allocator", "mem_get_info", "identity"):
        assert gpu.calls.count(extra) == 3, extra


def test_peak_is_the_highest_step_peak_although_stepprof_resets_the_counter(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=1, memory_every=2)
    with prof.step():
        gpu.alloc(3 * GiB)          # a warm-up step with the run's highest peak
        gpu.free(3 * GiB)
    run_steps(prof, gpu, 3, alloc=GiB)
    prof.close()
    after_warmup, periodic, close = memory_records(log)
    assert after_warmup["peak_allocated_bytes"] == 3 * GiB
    assert periodic["peak_allocated_bytes"] == 3 * GiB
    assert close["peak_allocated_bytes"] == 3 * GiB
    assert gpu.peak == GiB         # the raw counter alone covers only the last step


def test_on_demand_report_counts_steps_still_running_on_the_gpu(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=5)
    with prof.step():
        gpu.alloc(2 * GiB)
        gpu.free(2 * GiB)
        gpu.launch(50.0)           # the step's events complete 50 ms later
    assert len(list(stepprof.read(log, kind="step"))) == 0
    with prof:
        r = stepprof.memory_report()
    assert r.trigger == "on_demand" and r.step == 0
    assert r.peak_allocated_bytes == 2 * GiB
    assert [m["trigger"] for m in memory_records(log)] == ["on_demand", "close"]


def test_context_baseline_is_the_residual_when_stepprof_first_saw_cuda(log, nvml):
    gpu = nvml.gpu
    gpu.outside = 600 * MiB                     # the CUDA context, at first sight
    prof = make(log, gpu, warmup=0, memory_every=0)
    gpu.alloc(GiB)                              # later allocations do not move it
    gpu.outside += 40 * MiB                     # nor lazily loaded kernels
    run_steps(prof, gpu, 2)
    prof.close()
    after_warmup, close = memory_records(log)
    assert after_warmup["context_baseline_bytes"] == close["context_baseline_bytes"] == 600 * MiB
    assert after_warmup["residual_bytes"] == 640 * MiB


def test_residual_growth_after_warmup_gets_the_note(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=2, memory_every=2)
    run_steps(prof, gpu, 3)
    gpu.outside += GiB                          # e.g. NCCL buffers, another library's cudaMalloc
    run_steps(prof, gpu, 2)
    prof.close()
    after_warmup, periodic, close = memory_records(log)
    assert periodic["residual_bytes"] - after_warmup["residual_bytes"] == GiB
    assert after_warmup["notes"] == []
    (note,) = periodic["notes"]
    assert note.startswith("the residual grew by 1.00 GiB since the after-warm-up record (step 2)")
    assert "outside PyTorch's allocator is growing" in note and "empty_cache() cannot" in note
    assert periodic["reserved_bytes"] == after_warmup["reserved_bytes"]
    assert close["notes"] == periodic["notes"]     # still measured from the after-warm-up record


def test_small_residual_growth_gets_no_note(log, nvml):
    gpu = nvml.gpu
    prof = make(log, gpu, warmup=0, memory_every=1)
    run_steps(prof, gpu, 1)
    gpu.outside += _memory.GROWTH_NOTE_BYTES - MiB      # lazily loaded kernels, say
    run_steps(prof, gpu, 1)
    prof.close()
    assert all(r["notes"] == [] for r in memory_records(log))


def test_fragmentation_note_names_the_allocator_setting(log, nvml, monkeypatch):
    gpu = nvml.gpu
    gpu.allocated = gpu.peak = 2 * GiB
    gpu.reserved = 10 * GiB
    gpu.inactive_split = 3 * GiB
    with make(log, gpu):
        r = stepprof.memory_report()
        (note,) = r.notes
        assert "reserved (10.00 GiB) is 8.00 GiB above the peak of live tensors (2.00 GiB)" in note
        assert "fragmentation; 3.00 GiB in inactive split blocks" in note
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in note
        assert r.fragmentation_bytes == 8 * GiB and r.inactive_split_bytes == 3 * GiB
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        (note,) = stepprof.memory_report().notes
        assert "expandable_segments is already on" in note


def test_reserved_near_the_peak_is_no_fragmentation(log, nvml):
    gpu = issue_example(nvml.gpu)         # gap 0.59 GiB: 18% of reserved, under the 25% bar
    with make(log, gpu):
        assert stepprof.memory_report().notes == ()


def test_ooms_and_alloc_retries_get_a_note(log, nvml):
    gpu = nvml.gpu
    gpu.num_ooms, gpu.num_alloc_retries = 1, 7
    with make(log, gpu):
        r = stepprof.memory_report()
    assert (r.num_ooms, r.num_alloc_retries) == (1, 7)
    (note,) = r.notes
    assert "1 out-of-memory error(s) and retried 7 allocation(s)" in note


def test_reconcile_is_pure_and_reports_a_negative_residual_honestly():
    snap = Snapshot(
        device="cuda:3", unix_s=0.0,
        allocator=AllocatorFigures(GiB, GiB, 2 * GiB, 0, 0, 0),
        free_total=(78 * GiB, 80 * GiB),
        nvml=NvmlReading(process_bytes=2 * GiB - 100 * MiB, device_used_bytes=2 * GiB),
    )
    r = reconcile(snap, trigger="periodic", step=7, peak_floor=int(1.5 * GiB),
                  baseline=Mark(500 * MiB, "process", "at start"))
    assert r.residual_bytes == -100 * MiB and r.basis == "process"
    assert r.peak_allocated_bytes == int(1.5 * GiB)        # the floor beats the raw counter
    assert r.context_baseline_bytes == 500 * MiB
    assert "less than the allocator reserves" in r.explanation
    assert any("below what the allocator reserves" in n for n in r.notes)
    assert reconcile(snap, trigger="periodic", step=7, peak_floor=int(1.5 * GiB),
                     baseline=Mark(500 * MiB, "process", "at start")) == r


# -- every failure: affected fields null with a reason, training goes on --------


def _run_and_report(log, gpu):
    """Train a few steps (records after warm-up and at close) and report on demand."""
    with make(log, gpu, warmup=1, memory_every=2) as prof:
        run_steps(prof, gpu, 4)
        report = stepprof.memory_report()
    recs = memory_records(log)
    assert [r["trigger"] for r in recs] == ["after_warmup", "periodic", "on_demand", "close"]
    assert prof.summary.steps == 4
    return report, recs


def _assert_device_basis(report, gpu, why):
    assert report.nvml_process_bytes is None
    assert why in report.unavailable["nvml_process_bytes"]
    assert report.basis == DEVICE_BASIS
    assert report.residual_bytes == report.mem_get_info_used_bytes - report.reserved_bytes == gpu.outside
    assert any("assumes there is no other" in n for n in report.notes)
    assert report.explanation.startswith("The GPU has ")


def test_nvml_missing(log, gpu):           # conftest makes `import pynvml` fail
    report, recs = _run_and_report(log, gpu)
    _assert_device_basis(report, gpu, "nvidia-ml-py is not installed")
    assert report.nvml_device_used_bytes is None
    assert "pip install nvidia-ml-py" in report.unavailable["nvml_device_used_bytes"]
    assert all(r["basis"] == DEVICE_BASIS for r in recs)


@pytest.mark.parametrize("code, words", [
    ("NVML_ERROR_DRIVER_NOT_LOADED", "the NVIDIA driver is not loaded (DriverNotLoaded)"),
    ("NVML_ERROR_LIBRARY_NOT_FOUND", "libnvidia-ml.so.1 was not found"),
    ("NVML_ERROR_NO_PERMISSION", "permission denied to this user or container (NoPermission)"),
])
def test_nvml_init_failing(log, nvml, code, words):
    nvml.fail["nvmlInit"] = getattr(FakeNvml, code)
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(report, nvml.gpu, f"NVML could not start: nvmlInit: {words}")
    assert nvml.calls["nvmlInit"] == 1           # tried once, the answer cached
    assert "nvmlShutdown" not in nvml.calls      # never shut down what did not start


@pytest.mark.parametrize("code, why", [
    ("NVML_ERROR_NOT_SUPPORTED", "not supported on this GPU, driver or partition (NotSupported)"),
    ("NVML_ERROR_NO_PERMISSION", "permission denied to this user or container (NoPermission)"),
])
def test_process_query_not_supported_or_denied(log, nvml, code, why):
    nvml.fail["nvmlDeviceGetComputeRunningProcesses"] = getattr(FakeNvml, code)
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(report, nvml.gpu, f"nvmlDeviceGetComputeRunningProcesses: {why}")
    assert report.nvml_device_used_bytes == nvml.gpu.process_bytes()   # the rest still works


def test_memory_info_not_supported_leaves_the_process_basis(log, nvml):
    nvml.fail["nvmlDeviceGetMemoryInfo"] = FakeNvml.NVML_ERROR_NOT_SUPPORTED
    report, _ = _run_and_report(log, nvml.gpu)
    assert report.nvml_device_used_bytes is None
    assert "(NotSupported)" in report.unavailable["nvml_device_used_bytes"]
    assert report.basis == "process" and report.residual_bytes == nvml.gpu.outside


def test_pid_not_visible_as_in_a_container(log, nvml):
    nvml.pid_visible = False
    nvml.other_pids = [11, 12]
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(report, nvml.gpu, f"not this process (PID {os.getpid()})")
    assert "inside a container NVML reports host PIDs" in report.unavailable["nvml_process_bytes"]
    assert any("NVML lists 3 compute processes on this GPU" in n for n in report.notes)


def test_other_processes_are_not_counted_as_this_one(log, nvml):
    nvml.other_pids = [11]
    nvml.gpu.others = GiB
    report, _ = _run_and_report(log, nvml.gpu)
    assert report.basis == "process" and report.residual_bytes == nvml.gpu.outside
    assert report.nvml_device_used_bytes == report.nvml_process_bytes + GiB
    assert "1 other process(es) also use this GPU" in report.notes


def test_a_mig_instance_is_found_by_its_mig_uuid(log, nvml):
    nvml.mig = True
    report, _ = _run_and_report(log, nvml.gpu)
    assert report.basis == "process" and report.residual_bytes == nvml.gpu.outside
    assert any(n.startswith(f"this is a MIG instance (MIG-{nvml.gpu.uuid})") for n in report.notes)


def test_a_mig_instance_without_a_process_figure(log, nvml):
    nvml.mig = True
    nvml.used_memory_available = False
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(report, nvml.gpu, "NVML lists this process but gives no memory figure")


def test_a_gpu_in_mig_mode_matched_as_a_whole_gives_no_nvml_figures(log, nvml):
    nvml.parent_in_mig = True
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(report, nvml.gpu, "partitioned into MIG instances")
    assert "partitioned into MIG instances" in report.unavailable["nvml_device_used_bytes"]


def test_the_device_is_matched_by_pci_bus_id_when_there_is_no_uuid(log, nvml):
    nvml.gpu.uuid = None
    report, _ = _run_and_report(log, nvml.gpu)
    assert report.basis == "process"
    assert nvml.calls["nvmlDeviceGetHandleByPciBusId"] == 1
    assert "nvmlDeviceGetHandleByUUID" not in nvml.calls


def test_the_device_is_never_matched_by_index(log, nvml):
    nvml.gpu.uuid = "00000000-0000-0000-0000-000000000000"   # not the GPU NVML knows
    nvml.gpu.pci_bus_id = "00000000:01:00.0"
    report, _ = _run_and_report(log, nvml.gpu)
    why = report.unavailable["nvml_process_bytes"]
    assert why.startswith("NVML has no device matching torch's: UUID GPU-00000000-")
    assert "MIG-00000000-" in why and "PCI bus id 00000000:01:00.0: " in why and "(NotFound)" in why
    assert report.basis == DEVICE_BASIS


def test_no_uuid_and_no_pci_bus_id(log, nvml):
    nvml.gpu.uuid = nvml.gpu.pci_bus_id = None
    report, _ = _run_and_report(log, nvml.gpu)
    assert "neither a UUID nor a PCI bus id" in report.unavailable["nvml_process_bytes"]


def test_the_deprecated_pynvml_module_is_named(log, gpu, monkeypatch):
    fake = FakeNvml(gpu, official=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    report, _ = _run_and_report(log, gpu)
    assert report.basis == "process"                 # it still works, and says so
    (note,) = report.notes
    assert "not nvidia-ml-py's (the deprecated `pynvml` distribution" in note
    assert "pip uninstall pynvml" in note


def test_the_deprecated_pynvml_distribution_next_to_nvidia_ml_py_is_named(log, nvml, monkeypatch):
    monkeypatch.setattr(_nvml, "_deprecated_distribution", lambda: "11.5.3")
    nvml.fail["nvmlInit"] = FakeNvml.NVML_ERROR_UNKNOWN
    report, _ = _run_and_report(log, nvml.gpu)
    why = report.unavailable["nvml_process_bytes"]
    assert "an unknown NVML error (Unknown)" in why
    assert "the deprecated `pynvml` distribution (11.5.3) is installed next to nvidia-ml-py" in why


def test_an_unexpected_exception_inside_pynvml_is_a_reason(log, nvml, monkeypatch):
    def broken(handle):
        raise OSError("ctypes went wrong")

    monkeypatch.setattr(nvml, "nvmlDeviceGetComputeRunningProcesses", broken)
    report, _ = _run_and_report(log, nvml.gpu)
    _assert_device_basis(
        report, nvml.gpu, "nvmlDeviceGetComputeRunningProcesses failed: OSError: ctypes went wrong"
    )


def test_allocator_reads_failing(log, nvml):
    nvml.gpu.fail_on = "read_allocator"
    report, recs = _run_and_report(log, nvml.gpu)
    for field in ("allocated_bytes", "peak_allocated_bytes", "reserved_bytes", "residual_bytes"):
        assert report.unavailable[field].startswith("reading torch's allocator statistics failed")
        assert getattr(report, field) is None
    assert report.nvml_process_bytes is not None
    assert "could not be read" in report.explanation and report.explanation.startswith("nvidia-smi shows")
    assert "could not be measured" in recs[-1]["unavailable"]["context_baseline_bytes"]


def test_no_total_at_all(log, gpu):             # no NVML, and cudaMemGetInfo fails
    gpu.fail_on = "mem_get_info"
    report, _ = _run_and_report(log, gpu)
    assert report.basis is None and report.residual_bytes is None
    assert "nvidia-ml-py is not installed" in report.unavailable["basis"]
    assert "torch.cuda.mem_get_info failed" in report.unavailable["basis"]
    assert report.allocated_bytes == gpu.allocated
    assert report.explanation.startswith("PyTorch holds ")


def test_torch_cannot_name_the_device(log, nvml):
    nvml.gpu.fail_on = "identity"
    report, _ = _run_and_report(log, nvml.gpu)
    assert "torch could not report the device's UUID" in report.unavailable["nvml_process_bytes"]
    assert "nvmlInit" not in nvml.calls


def test_a_failing_snapshot_never_stops_the_recorder(log, nvml, monkeypatch):
    def boom(b):
        raise RuntimeError("planted")

    monkeypatch.setattr(_memory, "take_snapshot", boom)
    prof = make(log, nvml.gpu, warmup=0, memory_every=1)
    run_steps(prof, nvml.gpu, 3)
    s = prof.close()
    assert s.steps == 3 and "stepprof" not in s.unavailable
    recs = memory_records(log)
    assert [r["step"] for r in recs] == [0, 1, 2, 2]
    assert recs[0]["unavailable"]["residual_bytes"] == "reading memory failed: RuntimeError: planted"


# -- NVML's lifetime ----------------------------------------------------------------


def test_nvml_starts_lazily_once_and_shuts_down(log, nvml):
    prof = make(log, nvml.gpu, warmup=3)        # the injected device is seen: baseline now
    assert nvml.initialised == 1
    run_steps(prof, nvml.gpu, 10)
    prof.close()
    assert nvml.calls["nvmlInit"] == 1 and nvml.initialised == 1
    _nvml.shutdown()
    assert nvml.initialised == 0 and nvml.calls["nvmlShutdown"] == 1
    _nvml.shutdown()                            # idempotent
    assert nvml.calls["nvmlShutdown"] == 1


def test_a_cpu_job_never_imports_pynvml(log, monkeypatch):
    touched: list[str] = []

    class Tripwire:                             # stepprof._device.nvml swallows errors: record instead
        def __getattr__(self, name):
            touched.append(name)
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "pynvml", Tripwire())
    with stepprof.Profiler(log, device="cpu", memory_every=1) as prof:
        run_steps(prof, None, 5)
        r = stepprof.memory_report("cpu")
    assert touched == []
    assert [m["trigger"] for m in memory_records(log)] == ["on_demand"]   # only the one asked for
    assert r.basis is None


def test_at_exit_the_last_records_read_nvml_before_it_shuts_down(tmp_path):
    path, marker = tmp_path / "exit.jsonl", tmp_path / "shutdown"
    code = (
        "import sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "import stepprof\n"
        "from stepprof._recorder.profiler import _make_profiler\n"
        "from tests.fakes import FakeGpu, FakeNvml\n"
        "gpu = FakeGpu(); fake = FakeNvml(gpu); sys.modules['pynvml'] = fake\n"
        f"fake.nvmlShutdown = lambda: open({str(marker)!r}, 'w').write('down')\n"
        f"prof = _make_profiler({str(path)!r}, backend=gpu, collect_every_s=None)\n"
        "for _ in range(2):\n"
        "    with prof.step():\n"
        "        pass\n"
    )                                           # never closed: stepprof closes it at exit
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    close = [r for r in stepprof.read(path, kind="memory") if r["trigger"] == "close"]
    assert close and close[0]["basis"] == "process" and close[0]["nvml_process_bytes"] > 0
    assert marker.read_text() == "down"


# -- without CUDA, and bad input -----------------------------------------------


def test_memory_report_without_cuda_returns_nulls_with_reasons_and_creates_no_context(tmp_path):
    code = (
        "import torch, stepprof\n"
        "r = stepprof.memory_report()\n"
        "assert not torch.cuda.is_initialized(), 'memory_report created a CUDA context'\n"
        "assert r.explanation == 'No CUDA memory to reconcile: CUDA is not available.', r.explanation\n"
        "assert r.basis is None and r.residual_bytes is None and r.allocated_bytes is None\n"
        "assert set(r.unavailable) >= {'allocated_bytes', 'nvml_process_bytes', 'residual_bytes',\n"
        "                              'context_baseline_bytes', 'basis'}\n"
        "assert set(r.unavailable.values()) == {'CUDA is not available'}\n"
        "assert stepprof.memory_report(0).unavailable['basis'] == 'CUDA is not available'\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(r)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "stepprof memory on cpu (on_demand): unavailable (CUDA is not available)"


def test_memory_report_inside_a_cpu_profiler_logs_the_nulls(log):
    with stepprof.Profiler(log, device="cpu") as prof:   # the host, also where CUDA is up
        run_steps(prof, None, 2)
        r = stepprof.memory_report("cpu")
    (rec,) = memory_records(log)
    assert rec["step"] == 1 and rec["residual_bytes"] is None
    assert rec["unavailable"]["residual_bytes"] == "device 'cpu' has no CUDA memory"
    assert r.explanation == "No CUDA memory to reconcile: device 'cpu' has no CUDA memory."


@pytest.mark.parametrize("bad", [-1, True, 2.5, "100", None])
def test_memory_every_must_be_a_non_negative_int(log, bad):
    with pytest.raises(stepprof.ConfigError, match=r"'memory_every' must be an int >= 0 \(got "):
        stepprof.Profiler(log, memory_every=bad)
    with pytest.raises(stepprof.ConfigError, match="or 0 to write no periodic memory record"):
        stepprof.configure(log=None, memory_every=bad)


def test_memory_report_rejects_a_device_that_is_not_one():
    with pytest.raises(stepprof.ConfigError, match=r"'device' must name a torch device .*'gpu please'"):
        stepprof.memory_report("gpu please")


def test_the_real_nvidia_ml_py_errors_are_translated(monkeypatch):
    monkeypatch.delitem(sys.modules, "pynvml")  # conftest hid it; import the installed one
    reading = _nvml.read("00000000-0000-0000-0000-000000000000", None)
    m = sys.modules.get("pynvml")
    assert m is not None and hasattr(m, "_nvmlGetFunctionPointer"), "nvidia-ml-py is not installed"
    if _nvml.NVML.module is None:   # no driver here: nvmlInit itself fails
        assert reading.process_reason.startswith("NVML could not start: nvmlInit: ")
        assert reading.process_reason.endswith(("(LibraryNotFound)", "(DriverNotLoaded)"))
    else:                       # a driver: the made-up UUID is not one of its GPUs
        assert reading.process_reason.startswith("NVML has no device matching torch's: UUID GPU-")
        assert "(NotFound)" in reading.process_reason or "(InvalidArgument)" in reading.process_reason

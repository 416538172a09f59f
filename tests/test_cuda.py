"""On a real GPU: no added syncs, event timing against an independent span, exact peaks."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest
import torch

import stepprof

pytestmark = pytest.mark.cuda

_SYNCS: list[str] = []
_TRACE = {"on": False}


def _count_syncs() -> list[str]:
    """Count every device/stream/event synchronisation via torch's GPU-trace callbacks.

    The callbacks cannot be removed, so they are registered once and gated by a flag.
    """
    if not _TRACE.get("installed"):
        import torch.cuda._gpu_trace as gt

        def hook(kind):
            return lambda *a: _SYNCS.append(kind) if _TRACE["on"] else None

        gt.register_callback_for_device_synchronization(hook("device"))
        gt.register_callback_for_stream_synchronization(hook("stream"))
        gt.register_callback_for_event_synchronization(hook("event"))
        torch._C._activate_gpu_trace()
        _TRACE["installed"] = True
        _TRACE["on"] = True
        torch.cuda.synchronize()
        assert _SYNCS == ["device"], "GPU-trace callbacks did not fire"
    _SYNCS.clear()
    return _SYNCS


def mlp(width, depth=4, dtype=torch.float32):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, dtype=dtype), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).cuda()


def train_parts(model, x, opt):
    def fwd():
        return model(x).float().pow(2).mean()

    def bwd(loss):
        loss.backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return fwd, bwd, step


def phased_step(prof, fwd, bwd, ostep, batch_size=None):
    with prof.step(batch_size=batch_size):
        with prof.measure("forward"):
            loss = fwd()
        with prof.measure("backward"):
            bwd(loss)
        with prof.measure("optimizer"):
            ostep()


def test_stepprof_adds_no_sync(tmp_path):
    model = mlp(1024, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    fwd, bwd, ostep = train_parts(model, x, opt)
    for _ in range(3):
        bwd(fwd()); ostep()
    torch.cuda.synchronize()
    log = tmp_path / "nosync.jsonl"
    prof = stepprof.Profiler(log, warmup=2)
    syncs = _count_syncs()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(50):
            phased_step(prof, fwd, bwd, ostep, batch_size=256)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert syncs == [], f"stepprof synchronised: {syncs}"
    # A step's record waits for the first energy sample after it (energy_every_s=0.5): give the
    # sampler its period, then write what has completed, without closing.
    time.sleep(1.2)
    prof.flush()
    written = len(list(stepprof.read(log)))
    assert written >= 40, "records were not harvested lazily during the run"
    prof.close()
    recs = list(stepprof.read(log, kind="step"))
    assert len(recs) == 50 and all(r["gpu_ms"] > 0 for r in recs)
    assert all(r["phases"]["optimizer"]["gpu_ms"] is not None for r in recs)


def test_gpu_ms_matches_an_independent_event_span(tmp_path):
    model = mlp(4096, depth=8, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    fwd, bwd, ostep = train_parts(model, x, opt)
    for _ in range(3):
        bwd(fwd()); ostep()
    log = tmp_path / "span.jsonl"
    prof = stepprof.Profiler(log)
    with prof.step(batch_size=4096):  # the first step sets the backend up (host time the GPU idles
        bwd(fwd()); ostep()  # through, before its start event): outside the span, as no step's
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(25):
        with prof.step(batch_size=4096):
            bwd(fwd()); ostep()
    b.record()
    prof.close()
    span = a.elapsed_time(b)
    total = sum(r["gpu_ms"] for r in list(stepprof.read(log, kind="step"))[1:])
    assert abs(total - span) / span < 0.02, (total, span)
    assert span / 25 > 2.0  # really compute-bound: milliseconds per step


def _peak_model():
    # Big weights, tiny batch: AdamW's foreach temporaries set the step's peak.
    torch.manual_seed(0)
    model = mlp(4096, depth=4)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(8, 4096, device="cuda")
    return train_parts(model, x, opt)


def test_peak_equals_max_memory_allocated_to_the_byte(tmp_path):
    fwd, bwd, ostep = _peak_model()
    for _ in range(2):
        loss = fwd()
        bwd(loss)
        ostep()
    log = tmp_path / "peak.jsonl"
    prof = stepprof.Profiler(log)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with prof.step():
        loss = fwd()
        bwd(loss)
        ostep()
    independent = torch.cuda.max_memory_allocated()
    # The same step again, with phases; then once more with no stepprof at all.
    # Spelled out (not phased_step): which `loss` tensors are alive must match the bare
    # step below to the byte.
    with prof.step():
        with prof.measure("forward"):
            loss = fwd()
        with prof.measure("backward"):
            bwd(loss)
        with prof.measure("optimizer"):
            ostep()
    torch.cuda.reset_peak_memory_stats()
    loss = fwd()
    bwd(loss)
    ostep()
    bare = torch.cuda.max_memory_allocated()
    prof.close()
    plain, phased = list(stepprof.read(log, kind="step"))
    assert plain["peak_allocated_bytes"] == independent
    assert phased["peak_allocated_bytes"] == bare == independent
    ph = phased["phases"]
    assert ph["optimizer"]["peak_allocated_bytes"] > ph["backward"]["peak_allocated_bytes"]
    assert ph["optimizer"]["peak_allocated_bytes"] == phased["peak_allocated_bytes"]
    assert phased["reserved_bytes"] >= phased["peak_allocated_bytes"]


def test_records_lag_until_the_gpu_finishes(tmp_path):
    log = tmp_path / "lag.jsonl"
    prof = stepprof.Profiler(log)
    with prof.step():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time at ~2 GHz
    prof.flush()
    assert list(stepprof.read(log)) == []   # not finished, and nobody waited
    torch.cuda.synchronize()
    with prof.step():
        pass
    prof.flush()
    assert [r["step"] for r in stepprof.read(log)][:1] == [0]
    prof.close()
    first = next(stepprof.read(log, kind="step"))
    assert first["gpu_ms"] > 20 and first["gpu_busy"] > 1


def test_failed_step_leaves_state_clean(tmp_path):
    log = tmp_path / "fail.jsonl"
    mode = torch.cuda.get_sync_debug_mode()
    prof = stepprof.Profiler(log)
    with pytest.raises(RuntimeError, match="planted"):
        with prof.step():
            with prof.measure("forward"):
                torch.ones(10, device="cuda").sum()
                raise RuntimeError("planted")
    with prof.step():
        torch.ones(10, device="cuda").sum()
    prof.close()
    a, b = list(stepprof.read(log, kind="step"))
    assert a["error"]["message"] == "planted" and b["error"] is None
    assert torch.cuda.get_sync_debug_mode() == mode


def test_compiled_autocast_and_accumulated_steps(tmp_path):
    model = mlp(512, depth=2)
    opt = torch.optim.AdamW(model.parameters())

    def fwd(x):
        with stepprof.measure("inside-compiled"):  # compiled away, no graph break
            return model(x).float().pow(2).mean()

    cfwd = torch.compile(fwd, fullgraph=True)
    xs = [torch.randn(32, 512, device="cuda") for _ in range(4)]
    log = tmp_path / "compiled.jsonl"
    with stepprof.Profiler(log, warmup=1) as prof:
        for _ in range(3):
            with prof.step(batch_size=128):
                for x in xs:  # gradient accumulation over four micro-batches
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        with prof.measure("forward"):
                            loss = cfwd(x) / len(xs)
                    with prof.measure("backward"):
                        loss.backward()
                with prof.measure("optimizer"):
                    opt.step()
                    opt.zero_grad()
    recs = list(stepprof.read(log, kind="step"))
    assert len(recs) == 3
    for r in recs:
        assert set(r["phases"]) == {"forward", "backward", "optimizer"}
        assert r["phases"]["forward"]["count"] == 4 and r["phases"]["forward"]["gpu_ms"] > 0
        assert r["gpu_ms"] > 0 and r["peak_allocated_bytes"] > 0


def test_no_cuda_context_for_a_cpu_job(tmp_path):
    code = (
        "import torch, stepprof\n"
        f"with stepprof.Profiler({str(tmp_path / 'cpu.jsonl')!r}) as p:\n"
        "    with p.step():\n"
        "        torch.ones(3).sum()\n"
        "assert not torch.cuda.is_initialized(), 'stepprof created a CUDA context'\n"
        "assert p.summary.device == 'cpu', p.summary\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cuda_graph_capture_inside_a_step_is_left_intact(tmp_path):
    x = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as torch.cuda.graph requires
        y = x @ x
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    log = tmp_path / "graph.jsonl"
    with stepprof.Profiler(log) as prof:
        with prof.step():
            with torch.cuda.graph(g):
                with prof.measure("captured"):
                    y = x @ x
            g.replay()
        with prof.step():
            with prof.measure("replay"):
                g.replay()
    torch.testing.assert_close(y, x @ x)
    captured, replayed = list(stepprof.read(log, kind="step"))
    assert captured["phases"]["captured"]["gpu_ms"] is None
    assert "capturing a CUDA graph" in captured["unavailable"]["phases.gpu_ms"]
    assert captured["gpu_ms"] > 0          # the step's own events are outside the capture
    assert replayed["phases"]["replay"]["gpu_ms"] > 0


def test_close_waits_for_the_steps_events_not_the_whole_device(tmp_path):
    """close() waits on the pending steps' own events: work on another stream (here a
    ~1 s spin; in a real job, a collective another rank never joins) does not hold it,
    and a sync-debug mode "error" left on does not make it drop the pending records."""
    import time

    log = tmp_path / "close.jsonl"
    x = torch.randn(1024, 1024, device="cuda")
    prof = stepprof.Profiler(log)
    for _ in range(3):
        with prof.step():
            x = torch.tanh(x @ x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about 1 s of spinning on the side stream
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        prof.close()
        waited_s = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side_done = side.query()
    torch.cuda.synchronize()
    steps = list(stepprof.read(log, kind="step"))
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["gpu_ms"] is not None for r in steps)
    assert not side_done, "the side stream finished before close returned: the test proves nothing"
    assert waited_s < 0.5, f"close() waited {waited_s:.2f} s: it waited for the side stream"


@pytest.mark.cuda
def test_a_step_name_nvtx_cannot_take_is_recorded_and_recording_goes_on(tmp_path, monkeypatch):
    """A lone surrogate in a step name (from a non-UTF-8 file name) reaches NVTX's C++ binding."""
    monkeypatch.setenv("NVTX_INJECTION64_PATH", str(tmp_path / "no-tool.so"))  # as if a tool were attached
    log = str(tmp_path / "names.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "stepprof stopped recording"
        with stepprof.Profiler(log, device="cuda") as prof:
            for name in ("a", "b\udcff", "c"):
                with prof.step(name=name):
                    torch.ones(8, device="cuda").sum()
    assert [r["name"] for r in stepprof.read(log, kind="step")] == ["a", "b\ufffd", "c"]


def test_a_step_with_thousands_of_phase_runs_is_read_whole(tmp_path):
    """A phase inside a long loop (a decode loop, say) makes one step of thousands of marks:
    they are read back in one go, and recording goes on (the compiled boundary once refused
    more than 4,096 marks, which stopped recording)."""
    log = str(tmp_path / "many.jsonl")
    x = torch.zeros(16, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "stepprof stopped recording" would be a warning
        with stepprof.Profiler(log, warmup=0, energy_every_s=None) as prof:
            for _ in range(2):
                with prof.step():
                    for _ in range(3000):
                        with prof.measure("token"):
                            x.add_(1.0)
    recs = list(stepprof.read(log, kind="step"))
    assert len(recs) == 2
    for r in recs:
        phase = r["phases"]["token"]
        assert phase["count"] == 3000 and phase["gpu_ms"] is not None and r["gpu_ms"] is not None
        assert phase["gpu_ms"] <= r["gpu_ms"] * 1.01


def test_a_torch_profiler_trace_around_the_loop_holds_its_steps_and_phases(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    log, trace = str(tmp_path / "run.jsonl"), tmp_path / "trace.json"
    x = torch.randn(256, 256, device="cuda")
    with stepprof.Profiler(log, warmup=0, energy_every_s=None) as prof:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
            for _ in range(3):
                with prof.step():
                    with prof.measure("forward"):
                        y = x @ x
                    with prof.measure("backward"):
                        y.sum()
        traced.export_chrome_trace(str(trace))
    text = trace.read_text()
    assert all(f'"ProfilerStep#{i}"' in text for i in range(3))
    assert '"forward"' in text and '"backward"' in text and "gemm" in text.lower()
    assert len(list(stepprof.read(log, kind="step"))) == 3

"""Profiler(explain_peak=...) on the fake device: the hook, its hooks, its record, its cost."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stepprof
from stepprof._recorder import peak as peak_module
from stepprof._recorder.peak import PeakHook
from tests.peak_snapshots import FakeAllocator, frame

from .conftest import make

FORWARD = frame("forward", "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125)


def _cpu_storage(fake: FakeAllocator):
    """The hook's storage reader, for CPU tensors: the fake allocator records their real addresses.

    Only storages the fake holds a block for are seen.  The fake pads each block to 512 bytes
    as the caching allocator does, but a host allocation is not padded: an unrecorded tensor
    (AdamW's 4-byte step counter) can sit inside a recorded block's padding, where no real
    device tensor could be.
    """
    def read(t, index):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        s = t.untyped_storage()
        if not fake.segments.get(s.data_ptr(), {}).get("allocated_size"):
            return None
        return s.data_ptr(), s.nbytes()
    return read


@pytest.fixture
def history(gpu, monkeypatch):
    gpu.index = 0
    gpu.history = FakeAllocator(t_us=None, gpu=gpu)
    monkeypatch.setattr(peak_module, "_storage", _cpu_storage(gpu.history))
    return gpu.history


class Net(nn.Module):
    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 8)
        # The fake allocator sees fc1's output from inside fc1 (a hook registered before stepprof's).
        # The fake never frees it, so the output is kept alive: freed, its host address could be
        # reused by a later tensor (AdamW's step counter), which the fake block would then hold.
        self.kept: list[torch.Tensor] = []
        self.fc1.register_forward_hook(
            lambda m, i, out: (self.kept.append(out), fake.alloc_tensor(out, [FORWARD])) and None
        )
        self.fake = [fake]

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(prof, fake, model, opt, x, steps=2):
    for _ in range(steps):
        with prof.step():
            with prof.measure("forward"):
                loss = model(x).square().mean()
            with prof.measure("backward"):
                loss.backward()
                for p in model.parameters():
                    fake.alloc_tensor(p.grad)
            with prof.measure("optimizer"):
                opt.step()
                for state in opt.state.values():
                    for t in state.values():
                        if t.dim():
                            fake.alloc_tensor(t)
            opt.zero_grad(set_to_none=True)


def _nbytes(ts):
    return sum(t.untyped_storage().nbytes() for t in ts)


def test_the_explained_step_gets_a_peak_record_after_its_own(log, gpu, history):
    model = Net(history)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    for p in model.parameters():
        history.alloc_tensor(p)
    history.alloc_tensor(x)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, x)
    prof.close()
    kinds = [(r["kind"], r.get("step")) for r in stepprof.read(log) if r["kind"] in ("step", "peak")]
    assert kinds == [("step", 0), ("peak", 0), ("step", 1)]
    rec = next(stepprof.read(log, kind="peak"))
    cats = rec["bytes_by_category"]
    params = list(model.parameters())
    assert cats["parameters"] == sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in params)
    assert cats["gradients"] == pytest.approx(_nbytes(p.grad for p in params) if params[0].grad is not None
                                              else cats["gradients"])
    state = [t for s in opt.state.values() for t in s.values() if t.dim()]
    assert cats["optimizer_state"] == sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in state)
    # The batch, alive before the step, is saved by fc1 for its weight's gradient: an activation.
    assert cats["activations"] == x.untyped_storage().nbytes() and cats["other"] == 0
    assert sum(cats.values()) == rec["live_bytes"]
    assert rec["phase"] == "optimizer"
    assert rec["activations_from"] == "saved_tensors_hooks"
    # fc1's output is saved by relu? No: relu saves its result; fc1's output is not saved, so it
    # is a temporary, made in fc1.
    fc1 = next(m for m in rec["modules"] if m["module"] == "fc1")
    assert fc1["total_bytes"] == 32 * 256 * 4
    assert rec["cost_ms"] > 0 and rec["step"] == 0
    first = next(stepprof.read(log, kind="step"))
    assert rec["peak_allocated_bytes"] == first["peak_allocated_bytes"] == rec["live_bytes"]


def test_the_explained_step_is_flagged_and_left_out_of_the_run_figures(log, gpu, history):
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=1, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=4)
    summary = prof.close()
    recs = list(stepprof.read(log, kind="step"))
    assert [r.get("explained") for r in recs] == [None, True, None, None]
    assert summary.measured_steps == 4
    # The figures come from the three steps that were not explained (as the report's do).
    walls = sorted(r["wall_ms"] for r in recs if not r.get("explained"))
    assert summary.wall_ms.median == walls[1]


def test_with_flops_auto_the_explained_step_is_not_the_counted_one(log, gpu, history):
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, flops="auto", warmup=1, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=4)
    prof.close()
    recs = list(stepprof.read(log, kind="step"))
    assert [r["step"] for r in recs if r.get("flops_counted")] == [1]
    assert [r["step"] for r in recs if r.get("explained")] == [2]
    assert next(stepprof.read(log, kind="peak"))["step"] == 2


def test_other_steps_pay_nothing_once_the_step_is_explained(log, gpu, history):
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=1, model=model, optimizer=opt, memory_every=0)
    hooks = prof._boundaries
    assert any(isinstance(h, PeakHook) for h in hooks.hooks.begin)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=3)
    assert not any(isinstance(h, PeakHook) for h in hooks.hooks.begin + hooks.hooks.end)
    assert "begin_phase" not in vars(hooks) and "end_phase" not in vars(hooks)
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert list(model.fc1._forward_hooks) and not model.fc2._forward_hooks  # the test's own stays
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert gpu.history_calls == ["begin 500000", "end"]
    prof.close()
    assert [r["step"] for r in stepprof.read(log, kind="peak")] == [1]


def test_your_own_saved_tensors_hooks_are_left_on_top(log, gpu, history):
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    packed = []
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        _train(prof, history, model, opt, torch.randn(4, 64), steps=1)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert packed  # theirs ran
    assert rec["activations_from"] == "stacks"
    assert any("saved_tensors_hooks of your own" in n for n in rec["notes"])


def test_on_the_cpu_the_record_says_why(log):
    with stepprof.Profiler(log, explain_peak=True, device="cpu", energy_every_s=None) as prof:
        with prof.step():
            torch.ones(3).sum()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["device"] == "cpu" and rec["bytes_by_category"] is None
    assert "no CUDA allocator to explain" in rec["unavailable"]["bytes_by_category"]


def test_a_history_already_recorded_is_left_alone(log, gpu):
    gpu.index = 0
    gpu.history_reason = "the allocator's history is already being recorded"
    prof = make(log, gpu, explain_peak=True, memory_every=0)
    with prof.step():
        gpu.alloc(1000)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["unavailable"]["live_bytes"] == "the allocator's history is already being recorded"
    assert rec["peak_allocated_bytes"] == 1000


def test_a_failing_history_never_breaks_the_step(log, gpu, history):
    gpu.fail_on = "end_history"
    prof = make(log, gpu, explain_peak=True, memory_every=0)
    with prof.step():
        pass
    with prof.step():
        pass
    prof.close()
    assert len(list(stepprof.read(log, kind="step"))) == 2
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["unavailable"]["bytes_by_category"].startswith("explaining the peak failed")


def test_a_run_that_ends_before_the_step_says_so(log, gpu, history):
    prof = make(log, gpu, explain_peak=5, memory_every=0)
    with prof.step():
        pass
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["step"] == 5
    assert "ended before step 5" in rec["unavailable"]["bytes_by_category"]
    assert gpu.history_calls == []


def test_without_a_model_parameters_come_from_the_optimizer(log, gpu, history):
    model = Net(history)
    for p in model.parameters():
        history.alloc_tensor(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=1)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["bytes_by_category"]["parameters"] > 0
    assert rec["modules"] is None and "pass model=" in rec["unavailable"]["modules"]


@pytest.mark.parametrize("kw, named", [
    ({"explain_peak": "yes"}, "'explain_peak' must be True, False or a step index"),
    ({"explain_peak": -1}, "'explain_peak' must be True, False or a step index"),
    ({"model": 3}, "'model' must be a torch.nn.Module or None (got int)"),
    ({"optimizer": "adam"}, "'optimizer' must be a torch.optim.Optimizer or None (got str)"),
])
def test_bad_arguments_name_themselves(kw, named):
    with pytest.raises(stepprof.ConfigError) as e:
        stepprof.Profiler(None, **kw)
    assert named in str(e.value)


def test_configure_takes_the_same_names(tmp_path):
    model = nn.Linear(2, 2)
    prof = stepprof.configure(log=str(tmp_path / "x.jsonl"), explain_peak=3, model=model)
    try:
        assert prof._peak is not None and prof._peak.target == 3
    finally:
        prof.close()



class Trainer:
    def __init__(self) -> None:
        self.net = nn.Linear(3, 2)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.calls = 0

    def train_step(self, batch):
        self.calls += 1
        self.net(batch).sum().backward()
        self.opt.step()


def test_explain_peak_one_off_on_the_cpu_returns_the_reason():
    t = Trainer()
    exp = stepprof.explain_peak(t.train_step, torch.ones(4, 3), warmup=1)
    assert t.calls == 2
    assert isinstance(exp, stepprof.PeakExplanation)
    assert exp.step == 1 and exp.bytes_by_category is None
    assert "no CUDA allocator to explain" in exp.unavailable["bytes_by_category"]
    assert "not explained (no CUDA allocator" in str(exp)


def test_explain_peak_finds_the_model_and_optimizer_on_self():
    from stepprof._api import _owned

    t = Trainer()
    assert _owned(t.train_step, nn.Module) is t.net
    assert _owned(t.train_step, torch.optim.Optimizer) is t.opt
    assert _owned(t.net, nn.Module) is t.net
    assert _owned(lambda b: b, nn.Module) is None


def test_explain_peak_checks_its_arguments():
    with pytest.raises(stepprof.UsageError, match="'train_step' must be callable"):
        stepprof.explain_peak(None, 1)
    with pytest.raises(stepprof.ConfigError, match="'warmup'"):
        stepprof.explain_peak(lambda b: b, 1, warmup=-1)


def _explained_log(log, gpu, history):
    model = Net(history)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        history.alloc_tensor(p)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(32, 64))
    prof.close()


def test_report_prints_the_peak(log, gpu, history, capsys):
    from .report_helpers import cli

    _explained_log(log, gpu, history)
    rc, out, _ = cli(capsys, "report", log)
    assert rc == 0
    line = next(x for x in out.splitlines() if x.strip().startswith("peak ") and "in step" in x)
    assert "in step 0 in optimizer" in line and "optimizer state" in line and "parameters" in line
    assert "optimizer state" in out and "explaining cost" in out
    rc, out, _ = cli(capsys, "report", "--json", log)
    import json

    assert json.loads(out)["logs"][0]["runs"][0]["peak"]["kind"] == "peak"


def test_plot_peak_writes_a_png(log, gpu, history, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from .report_helpers import cli

    _explained_log(log, gpu, history)
    png = str(tmp_path / "peak.png")
    rc, out, _ = cli(capsys, "plot", "--peak", log, "-o", png)
    assert rc == 0 and open(png, "rb").read(4) == b"\x89PNG"
    plain = str(tmp_path / "plain.jsonl")
    with stepprof.Profiler(plain, device="cpu", energy_every_s=None) as prof:
        with prof.step():
            pass
    rc, _, err = cli(capsys, "plot", "--peak", plain, "-o", png)
    assert rc == 2 and "has no explained peak" in err and "explain_peak=True" in err


# -- markers in the history's own clock --------------------------------------------------


@pytest.fixture
def marked(gpu, monkeypatch):
    """A history that records annotations, on a clock of its own (10 µs a record), and a host
    clock that says nothing (always 0): only in-clock markers can place the allocations."""
    gpu.index = 0
    fake = FakeAllocator(gpu=gpu)
    fake.annotating = True
    calls = []

    def enter(name):
        calls.append(name)
        fake.annotate(name, "START")
        return name

    monkeypatch.setattr(peak_module, "_storage", _cpu_storage(fake))
    monkeypatch.setattr(peak_module, "_enter", enter)
    monkeypatch.setattr(peak_module, "_exit", lambda h: fake.annotate(h, "END"))
    monkeypatch.setattr(peak_module, "_now_us", lambda: 0.0)
    gpu.history = fake
    fake.calls = calls
    return fake


class _Scores(torch.autograd.Function):
    """Attention's scores: their gradient (32 MiB, made on the autograd engine's side, with
    no Python frames) sets the peak in attention's backward."""

    @staticmethod
    def forward(ctx, x, fake):
        ctx.fake = fake
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.fake.free(ctx.fake.alloc(32 * 2**20))
        return g * 2, None


class _Attn(nn.Module):
    def __init__(self, fake):
        super().__init__()
        self.qkv = nn.Linear(16, 16)
        self.fake = [fake]

    def forward(self, x):
        self.fake[0].alloc(8 * 2**20, [FORWARD])  # attention's probabilities, kept
        return _Scores.apply(self.qkv(x), self.fake[0])


class _Block(nn.Module):
    def __init__(self, fake):
        super().__init__()
        self.attn = _Attn(fake)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        return self.mlp(self.attn(x))


def test_in_clock_markers_place_backward_allocations_without_the_host_clock(log, gpu, marked):
    model = _Block(marked)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    x = torch.randn(4, 16)
    for _ in range(2):
        with prof.step():
            with prof.measure("forward"):
                loss = model(x).square().mean()
            with prof.measure("backward"):
                loss.backward()
            with prof.measure("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["modules"][0]["module"] == "attn", rec
    assert rec["modules"][0]["total_bytes"] == 40 * 2**20  # the probabilities and the scores' gradient
    assert rec["phase"] == "backward"
    assert not any("approximate" in n for n in rec["notes"]), rec["notes"]
    assert "made in 'attn'" in rec["unavailable"]["op"]
    names = set(marked.calls)
    assert {"stepprof:fwd:(root)", "stepprof:fwd:attn.qkv", "stepprof:bwd:attn", "stepprof:bwd:mlp.2",
            "stepprof:bwd_end", "stepprof:phase:forward", "stepprof:phase:optimizer"} <= names
    # The markers were emitted in the explained step only.
    assert len(marked.calls) == len([a for a in marked.annotations if a["stage"] == "START"])
    assert rec["cost_ms"] > 0


def test_a_graph_kept_past_the_explained_step_emits_no_markers(log, gpu, marked):
    model = _Block(marked)
    prof = make(log, gpu, explain_peak=True, model=model, memory_every=0)
    x = torch.randn(4, 16)
    with prof.step():
        loss = model(x).sum()
        loss.backward(retain_graph=True)
    n = len(marked.calls)
    loss.backward()  # the output's gradient hook stepprof registered is still on the graph
    with prof.step():
        model(x).sum().backward()
    prof.close()
    assert len(marked.calls) == n


def _one_explained_step(log, gpu, history) -> dict:
    """The peak record of one explained step of ``Net`` with SGD."""
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=1)
    prof.close()
    return next(stepprof.read(log, kind="peak"))


def test_without_annotations_the_record_says_attribution_is_approximate(log, gpu, history):
    rec = _one_explained_step(log, gpu, history)
    assert any(n.startswith("module and phase attribution is approximate") and "global_record_annotations" in n
               for n in rec["notes"])
    assert rec["phase"] in ("backward", "optimizer") and rec["modules"]


def test_the_markers_are_record_function_ranges():
    """USER_SCOPE ranges (what global_record_annotations records), around what runs inside."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        h = peak_module._enter("stepprof:fwd:x")
        torch.ones(3).sum()
        peak_module._exit(h)
    events = p.events()
    marker = next(e for e in events if e.name == "stepprof:fwd:x")
    inner = next(e for e in events if e.name == "aten::sum")
    assert marker.scope == 7  # torch's RecordScope.USER_SCOPE, the scope of record_function
    assert marker.time_range.start <= inner.time_range.start <= inner.time_range.end <= marker.time_range.end


# -- recording stops on every path ---------------------------------------------------


def test_recording_stops_even_when_noting_the_end_raises(log, gpu, history, monkeypatch):
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    observe = peak_module.Explaining.observe

    def fail_at_end(self, when):
        if when == "end":
            raise RuntimeError("a storage that cannot be read")
        observe(self, when)

    monkeypatch.setattr(peak_module.Explaining, "observe", fail_at_end)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=2)
    prof.close()
    assert gpu.history_calls == ["begin 500000", "end"] and not history.recording
    assert all(not m._forward_pre_hooks for m in model.modules())
    rec = next(stepprof.read(log, kind="peak"))
    assert "a storage that cannot be read" in rec["unavailable"]["bytes_by_category"]
    assert len(list(stepprof.read(log, kind="step"))) == 2


def test_recording_stopped_inside_the_explained_step_still_writes_its_record(log, gpu, history):
    prof = make(log, gpu, explain_peak=True, memory_every=0)
    with pytest.warns(RuntimeWarning, match="stopped recording"):
        with prof.step():
            history.alloc(1000)
            gpu.fail_on = "mark"  # the exit boundary fails: recording stops, the step is dropped
    prof.close()
    assert gpu.history_calls == ["begin 500000", "end"] and not history.recording
    assert isinstance(prof._peak.explanation, stepprof.PeakExplanation)
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["step"] == 0
    assert "recording stopped during the explained step" in rec["unavailable"]["bytes_by_category"]


def test_a_close_from_another_thread_during_the_explained_step_stops_recording(log, gpu, history):
    import threading

    model = Net(history)
    prof = make(log, gpu, explain_peak=True, model=model, memory_every=0)
    with prof.step():
        model(torch.randn(4, 64))
        t = threading.Thread(target=prof.close)
        t.start()
        t.join()
        assert gpu.history_calls == ["begin 500000", "end"] and not history.recording
        assert all(not m._forward_pre_hooks for m in model.modules())
        model(torch.randn(4, 64)).sum().backward()  # the saved-tensor hook left on this thread is inert
    rec = next(stepprof.read(log, kind="peak"))
    assert "closed while the explained step was open" in rec["unavailable"]["bytes_by_category"]
    assert not any(isinstance(h, PeakHook) for h in prof._boundaries.hooks.begin)
    # The closing thread's saved-tensor hooks were not touched; this thread's stays, inert.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    torch._C._autograd._pop_saved_tensors_default_hooks()


def test_a_light_explained_step_says_why_its_counter_and_phases_are_null(log, gpu, history):
    prof = make(log, gpu, explain_peak=1, memory_every=0, overhead_budget=0.01)
    prof._collector.budget.interval = 2  # step 1 is light
    for _ in range(3):
        with prof.step():
            with prof.measure("forward"):
                history.free(history.alloc(1000))
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["live_bytes"] is not None  # the history was replayed all the same
    assert rec["peak_allocated_bytes"] is None and rec["phase"] is None
    assert "not sampled" in rec["unavailable"]["peak_allocated_bytes"]
    assert "not sampled" in rec["unavailable"]["phase"]


def test_a_forked_child_closing_mid_step_leaves_the_allocator_alone(log, gpu, history, monkeypatch):
    import os

    prof = make(log, gpu, explain_peak=True, memory_every=0)
    scope = prof.step()
    scope.__enter__()
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)  # as in a child forked inside the step
    prof._forked()
    prof.close()
    assert gpu.history_calls == ["begin 500000"]  # CUDA is not touched in a forked child
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # its own hooks are off


def test_the_explaining_work_is_stated_apart_not_spread_over_the_next_steps_cost(log, gpu, history, monkeypatch):
    """The replay of the explained step's history (on the collector) is the peak record's
    ``cost_ms``: the steps written after it do not carry it in their ``overhead_us``."""
    import time

    real = peak_module._peak.explain

    def slow_explain(*a, **k):  # 30 ms of the collector thread's CPU, as a long history's replay
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < 30_000_000:
            pass
        return real(*a, **k)

    monkeypatch.setattr(peak_module._peak, "explain", slow_explain)
    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=1, model=model, optimizer=opt, memory_every=0)
    prof._collector.builder.cost_clock = time.thread_time_ns  # (the fake device's clock times the steps, not the collector)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=6)
    summary = prof.close()
    peak = next(stepprof.read(log, kind="peak"))
    assert peak["cost_ms"] >= 30
    later = [r["overhead_us"] for r in stepprof.read(log, kind="step") if r["step"] > 1]
    assert later and max(later) < 10_000, later  # (30,000 µs, were the replay charged to them)
    assert summary.overhead_us_mean < 10_000


def test_without_a_model_or_optimizer_the_record_says_activations_include_the_saved_weights(log, gpu, history):
    """With neither ``model=`` nor ``optimizer=``, a weight autograd saved for backward counts as an
    activation: the record's notes say so, and so does the reason for the unknown parameters."""
    model = Net(history)
    for p in model.parameters():
        history.alloc_tensor(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, memory_every=0)
    _train(prof, history, model, opt, torch.randn(4, 64), steps=1)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    weights = model.fc2.weight.untyped_storage().nbytes()  # (saved by fc2 for the gradient of its input)
    # (the batch needs no gradient, so fc1 saved no weight; fc2's is all the fake saw saved)
    assert rec["bytes_by_category"]["parameters"] == 0 and rec["bytes_by_category"]["activations"] == weights
    assert peak_module.NO_MODEL_NOTE in rec["notes"]
    assert "count as activations where autograd saved them" in rec["unavailable"]["bytes_by_category.parameters"]


def test_the_explained_steps_snapshot_is_written_for_memory_viz(log, gpu, history, tmp_path):
    """``snapshot_path`` set: the step's end snapshot (``torch.cuda.memory._snapshot()``'s dict,
    which memory_viz opens) is pickled there whole, and the peak record names it; a write that
    fails is a reason, and the run goes on."""
    import pickle

    model = Net(history)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = make(log, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    path = str(tmp_path / "peak.pickle")
    prof._peak.snapshot_path = path
    _train(prof, history, model, opt, torch.randn(4, 64), steps=2)
    prof.close()
    rec = next(stepprof.read(log, kind="peak"))
    assert rec["snapshot_path"] == path and "snapshot_path" not in rec["unavailable"]
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    assert any(e.get("action") == "alloc" for e in snap["device_traces"][0])  # (the step's history)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []

    log2 = str(tmp_path / "two.jsonl")
    prof = make(log2, gpu, explain_peak=True, model=model, optimizer=opt, memory_every=0)
    prof._peak.snapshot_path = str(tmp_path / "no-such-dir" / "peak.pickle")
    _train(prof, history, model, opt, torch.randn(4, 64), steps=2)
    assert prof.close().steps == 2
    rec = next(stepprof.read(log2, kind="peak"))
    assert rec["snapshot_path"] is None and rec["bytes_by_category"] is not None
    assert "writing the snapshot to" in rec["unavailable"]["snapshot_path"] and "FileNotFoundError" in \
        rec["unavailable"]["snapshot_path"]


def test_a_peak_record_without_a_snapshot_asked_has_no_snapshot_field(log, gpu, history):
    rec = _one_explained_step(log, gpu, history)
    assert "snapshot_path" not in rec and "snapshot_path" not in rec["unavailable"]


def test_explain_peak_snapshot_on_the_cpu_says_why_none_was_written(tmp_path):
    path = tmp_path / "peak.pickle"
    exp = stepprof.explain_peak(Trainer().train_step, torch.ones(4, 3), snapshot=path)
    assert exp.snapshot_path is None and not path.exists()
    assert "no CUDA allocator to explain" in exp.unavailable["snapshot_path"]
    with pytest.raises(stepprof.ConfigError, match=r"'snapshot' must be a path .* snapshot='peak.pickle'"):
        stepprof.explain_peak(Trainer().train_step, torch.ones(4, 3), snapshot=3)

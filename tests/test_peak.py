"""explain_peak's pure logic (stepprof._peak) on synthetic snapshots in torch's format."""

from __future__ import annotations

import pytest

from stepprof._peak import (
    CATEGORIES,
    Event,
    Observation,
    PeakExplanation,
    explain,
    round_block,
    unavailable_explanation,
)
from tests.peak_snapshots import FakeAllocator, frame

MiB = 2**20
USER = frame("train_step", "/home/me/train.py", 42)
MM = frame("forward", "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125)
ADAM = frame("_multi_tensor_adamw", "/venv/lib/python3.11/site-packages/torch/optim/adamw.py", 600)


def test_round_block_is_the_allocators_granule() -> None:
    assert round_block(1) == 512
    assert round_block(512) == 512
    assert round_block(513) == 1024
    assert round_block(4 * MiB) == 4 * MiB


def _training_step() -> tuple[FakeAllocator, dict, dict, dict]:
    """Weights and Adam state before the step; forward saves an activation; backward makes
    a gradient; the optimizer's temporary sets the peak."""
    a = FakeAllocator()
    w = a.alloc(4 * MiB)              # parameter
    m = a.alloc(4 * MiB)              # optimizer state
    v = a.alloc(4 * MiB)              # optimizer state
    batch = a.alloc(1 * MiB + 100)    # the batch: other
    start = a.start()
    t0 = a.t_us
    ev: dict = {"modules": [], "phases": [], "obs": []}
    ev["phases"].append(Event(a.tick(1), "enter", "forward"))
    ev["modules"].append(Event(a.tick(1), "enter", "net"))
    ev["modules"].append(Event(a.tick(1), "enter", "net.fc"))
    act = a.alloc(2 * MiB, [MM, USER])          # saved for backward
    ev["obs"].append(Observation("activations", act, 2 * MiB, a.tick(1)))
    tmp = a.alloc(3 * MiB, [MM, USER])          # freed in forward
    a.free(tmp)
    ev["modules"].append(Event(a.tick(1), "exit", "net.fc"))
    ev["modules"].append(Event(a.tick(1), "exit", "net"))
    ev["phases"].append(Event(a.tick(1), "exit", "forward"))
    ev["phases"].append(Event(a.tick(1), "enter", "backward"))
    ev["modules"].append(Event(a.tick(1), "backward", "net.fc"))
    g = a.alloc(4 * MiB)                        # gradient, no Python frames (autograd thread)
    ev["obs"].append(Observation("gradients", g, 4 * MiB, a.tick(1)))
    ev["modules"].append(Event(a.tick(1), "backward_end", ""))
    a.free(act)
    ev["phases"].append(Event(a.tick(1), "exit", "backward"))
    ev["phases"].append(Event(a.tick(1), "enter", "optimizer"))
    step_tmp = a.alloc(4 * MiB + 7, [ADAM, USER])  # sets the peak
    peak_t = a.t_us
    a.free(step_tmp)
    ev["phases"].append(Event(a.tick(1), "exit", "optimizer"))
    for ptr, cat in ((w, "parameters"), (m, "optimizer_state"), (v, "optimizer_state")):
        ev["obs"].append(Observation(cat, ptr, 4 * MiB, "start"))
        ev["obs"].append(Observation(cat, ptr, 4 * MiB, "end"))
    end = a.snapshot()
    ev.update(t0=t0, peak_t=peak_t, peak=a.peak, batch=batch)
    return a, start, end, ev


def test_categories_sum_to_the_allocators_peak() -> None:
    a, start, end, ev = _training_step()
    exp = explain(start, end, device=0, step=3, t0_us=ev["t0"], observations=ev["obs"],
                  module_events=ev["modules"], phase_events=ev["phases"], peak_allocated_bytes=a.peak)
    cats = exp.bytes_by_category
    assert set(cats) == set(CATEGORIES)
    assert sum(cats.values()) == exp.live_bytes == a.peak
    assert cats["parameters"] == 4 * MiB
    assert cats["optimizer_state"] == 8 * MiB
    assert cats["gradients"] == 4 * MiB
    assert cats["temporaries"] == round_block(4 * MiB + 7)
    assert cats["other"] == round_block(MiB + 100)
    assert cats["activations"] == 0  # freed in backward, before the peak
    assert exp.phase == "optimizer"
    assert exp.op == "_multi_tensor_adamw (torch/optim/adamw.py:600)"
    assert exp.user_frame == "/home/me/train.py:42"
    assert exp.peak_at_ms == pytest.approx((ev["peak_t"] - ev["t0"]) / 1000, abs=0.002)
    assert exp.live_blocks == 6
    assert exp.notes == ()


def test_modules_get_the_blocks_they_made_and_backward_counts() -> None:
    a, start, end, ev = _training_step()
    exp = explain(start, end, device=0, observations=ev["obs"], module_events=ev["modules"],
                  phase_events=ev["phases"])
    names = [m.module for m in exp.modules]
    assert names == ["net.fc"]  # the gradient, made in net.fc's backward
    assert exp.modules[0].bytes_by_category == {"gradients": 4 * MiB}
    assert exp.outside_modules_bytes == round_block(4 * MiB + 7)  # the optimizer's temporary


def test_an_activation_alive_at_the_peak_is_named_with_its_innermost_module() -> None:
    a = FakeAllocator()
    start = a.start()
    mods = [Event(a.tick(), "enter", "block"), Event(a.tick(), "enter", "block.attn")]
    scores = a.alloc(8 * MiB, [MM])
    obs = [Observation("activations", scores, 8 * MiB, a.tick())]
    mods.append(Event(a.tick(), "exit", "block.attn"))
    mods.append(Event(a.tick(), "enter", "block.mlp"))
    h = a.alloc(2 * MiB, [MM])
    obs.append(Observation("activations", h, 2 * MiB, a.tick()))
    mods += [Event(a.tick(), "exit", "block.mlp"), Event(a.tick(), "exit", "block")]
    out = a.alloc(1 * MiB)  # outside modules: the loss
    end = a.snapshot()
    exp = explain(start, end, device=0, observations=obs, module_events=mods)
    assert [m.module for m in exp.modules] == ["block.attn", "block.mlp"]
    assert exp.modules[0].total_bytes == 8 * MiB
    assert exp.bytes_by_category["activations"] == 10 * MiB
    assert exp.bytes_by_category["temporaries"] == 1 * MiB
    assert exp.outside_modules_bytes == 1 * MiB
    assert "phase" in exp.unavailable  # no phases given
    del out


def test_a_tensor_inside_a_larger_block_and_a_block_with_two_tensors() -> None:
    a = FakeAllocator()
    flat = a.alloc(8 * MiB)  # one block holding two parameters
    start = a.start()
    big = a.alloc(6 * MiB)   # a gradient that is a view into the first 2 MiB of a bigger block
    obs = [Observation("parameters", flat, 3 * MiB, "start"),
           Observation("parameters", flat + 3 * MiB, 5 * MiB, "end"),
           Observation("gradients", big, 2 * MiB, "end"),
           Observation("activations", big, 6 * MiB, a.tick())]  # saved too: gradients claim first
    end = a.snapshot()
    exp = explain(start, end, device=0, observations=obs)
    cats = exp.bytes_by_category
    assert cats["parameters"] == 8 * MiB
    assert cats["gradients"] == 2 * MiB
    assert cats["activations"] == 4 * MiB
    assert sum(cats.values()) == 14 * MiB


def test_an_observation_of_an_earlier_block_at_a_reused_address_is_not_counted() -> None:
    a = FakeAllocator()
    start = a.start()
    x = a.alloc(MiB)
    early = a.tick()
    a.free(x)
    a.tick(10_000)
    # The fake never reuses addresses; make the next block reuse x's as torch would.
    a._next_addr = x
    y = a.alloc(2 * MiB)  # the peak: a new block at x's address
    assert y == x
    end = a.snapshot()
    exp = explain(start, end, device=0, observations=[Observation("activations", x, MiB, early)])
    assert exp.bytes_by_category["activations"] == 0
    assert exp.bytes_by_category["temporaries"] == 2 * MiB


def test_stacks_tell_activations_when_saved_tensors_were_not_seen() -> None:
    a = FakeAllocator()
    start = a.start()
    a.alloc(2 * MiB, [MM, USER])
    a.alloc(MiB, [USER])
    end = a.snapshot()
    exp = explain(start, end, device=0, activations_from="stacks")
    assert exp.bytes_by_category["activations"] == 2 * MiB
    assert exp.bytes_by_category["temporaries"] == MiB
    none = explain(start, end, device=0, activations_from=None)
    assert none.bytes_by_category["activations"] == 0
    assert "bytes_by_category.activations" in none.unavailable


def test_fragmentation_and_largest_free_block_at_the_peak() -> None:
    a = FakeAllocator()
    start = a.start()
    x = a.alloc(4 * MiB)
    y = a.alloc(2 * MiB)
    a.free(x)
    end = a.snapshot()
    exp = explain(start, end, device=0)
    assert exp.live_bytes == 6 * MiB  # the peak: both alive
    assert exp.reserved_bytes == 6 * MiB
    assert exp.fragmentation_bytes == 0
    assert exp.largest_free_block_bytes == 0
    # A later, smaller peak is not the peak; free space shows in a step whose peak is later.
    b = FakeAllocator()
    s2 = b.start()
    p = b.alloc(4 * MiB)
    b.free(p)
    b.alloc(5 * MiB)
    e2 = b.snapshot()
    exp2 = explain(s2, e2, device=0)
    assert exp2.live_bytes == 5 * MiB
    assert exp2.reserved_bytes == round_block(4 * MiB) + 5 * MiB
    assert exp2.fragmentation_bytes == 4 * MiB
    assert exp2.largest_free_block_bytes == 4 * MiB
    del y


def test_exact_sizes_from_the_end_snapshot_for_blocks_alive_at_the_end() -> None:
    a = FakeAllocator()
    start = a.start()
    addr = a.alloc(1000)
    end = a.snapshot()
    # The allocator gave a bigger block than the rounded request (not split).
    end["segments"][0]["blocks"][0]["size"] = 1536
    exp = explain(start, end, device=0)
    assert exp.live_bytes == 1536
    del addr


def test_without_a_start_snapshot_blocks_alive_before_come_from_frees_and_the_end() -> None:
    a = FakeAllocator()
    w = a.alloc(4 * MiB)
    old = a.alloc(MiB)
    a.recording = True
    a.free(old)            # alive before, freed in the step
    a.alloc(2 * MiB)
    end = a.snapshot()
    exp = explain(None, end, device=0, observations=[Observation("parameters", w, 4 * MiB, "end")])
    assert exp.bytes_by_category["parameters"] == 4 * MiB
    assert exp.live_bytes == 4 * MiB + 2 * MiB  # the peak, after the free
    assert exp.reserved_bytes is None and "reserved_bytes" in exp.unavailable
    assert any("no snapshot at the step's start" in n for n in exp.notes)


def test_an_overflowing_history_gives_null_figures_with_the_reason() -> None:
    a = FakeAllocator()
    start = a.start()
    for _ in range(5):
        a.free(a.alloc(MiB))
    end = a.snapshot()
    exp = explain(start, end, device=0, max_entries=len(end["device_traces"][0]),
                  peak_allocated_bytes=123)
    assert exp.bytes_by_category is None and exp.live_bytes is None
    assert exp.peak_allocated_bytes == 123
    assert "overflowed" in exp.unavailable["bytes_by_category"]


def test_a_history_without_the_start_marker_is_refused() -> None:
    a = FakeAllocator()
    start = a.start()
    a.alloc(MiB)
    end = a.snapshot()
    end["device_traces"][0] = [e for e in end["device_traces"][0] if e["action"] != "snapshot"]
    exp = explain(start, end, device=0)
    assert exp.bytes_by_category is None
    assert "marker" in exp.unavailable["bytes_by_category"]


def test_a_replay_far_from_the_counter_says_so() -> None:
    a = FakeAllocator()
    start = a.start()
    a.alloc(MiB)
    end = a.snapshot()
    exp = explain(start, end, device=0, peak_allocated_bytes=2 * MiB)
    assert any("differs from the allocator's counter" in n for n in exp.notes)


def test_the_peak_in_backward_has_no_op_and_says_why() -> None:
    a = FakeAllocator()
    start = a.start()
    a.alloc(MiB)  # no frames
    exp = explain(start, a.snapshot(), device=0)
    assert exp.op is None and "no Python frames" in exp.unavailable["op"]


def test_other_devices_entries_are_ignored() -> None:
    a = FakeAllocator(device=1)
    start = a.start()
    a.alloc(MiB)
    exp = explain(start, a.snapshot(), device=1)
    assert exp.device == "cuda:1" and exp.live_bytes == MiB


def test_the_timeline_keeps_the_peak_when_downsampled() -> None:
    a = FakeAllocator()
    start = a.start()
    for i in range(400):
        x = a.alloc(MiB * (3 if i == 250 else 1))
        a.free(x)
    exp = explain(start, a.snapshot(), device=0)
    assert len(exp.timeline_ms) <= 200
    assert max(exp.timeline_bytes) == 3 * MiB == exp.live_bytes


def test_record_round_trip_and_the_unavailable_record() -> None:
    a, start, end, ev = _training_step()
    exp = explain(start, end, device=0, step=3, observations=ev["obs"], module_events=ev["modules"],
                  phase_events=ev["phases"], cost_ms=1.5)
    rec = exp.to_record()
    assert rec["kind"] == "peak" and rec["step"] == 3 and rec["cost_ms"] == 1.5
    assert rec["modules"][0] == {"module": "net.fc", "total_bytes": 4 * MiB,
                                 "bytes_by_category": {"gradients": 4 * MiB}}
    assert PeakExplanation.from_record(rec) == exp
    none = unavailable_explanation("no CUDA", step=0, device="cpu")
    rec = none.to_record()
    assert rec["bytes_by_category"] is None and rec["unavailable"]["bytes_by_category"] == "no CUDA"
    assert rec["unavailable"]["peak_allocated_bytes"] == "no CUDA"
    with pytest.raises(attrs_frozen()):
        none.step = 1  # type: ignore[misc]


def attrs_frozen() -> type[BaseException]:
    import attrs

    return attrs.exceptions.FrozenInstanceError


# -- markers in the history's own clock (global_record_annotations) ----------------------


def _marked_step(a: FakeAllocator) -> tuple[dict, dict, dict]:
    """A forward through ``blk`` (``blk.attn`` inside it), then a backward in which each
    module's temporaries are made without Python frames, as on the autograd engine's thread.
    The markers are annotations in the trace's clock, in torch's format; no host time exists."""
    a.annotating = True
    start = a.start()
    got: dict = {}
    a.annotate("stepprof:phase:forward", "START")
    a.annotate("stepprof:fwd:blk", "START")
    got["blk_fwd"] = a.alloc(1 * MiB, [MM])
    a.annotate("stepprof:fwd:blk.attn", "START")
    got["attn_fwd"] = a.alloc(8 * MiB, [MM])
    a.annotate("stepprof:fwd:blk.attn", "END")
    got["blk_fwd_after"] = a.alloc(2 * MiB, [MM])     # blk again, after attn returned
    a.annotate("stepprof:fwd:blk", "END")
    a.annotate("stepprof:phase:forward", "END")
    a.annotate("stepprof:phase:backward", "START")
    for name in ("blk", "blk.mlp"):
        a.annotate(f"stepprof:bwd:{name}", "START")
        a.annotate(f"stepprof:bwd:{name}", "END")
    got["mlp_bwd"] = a.alloc(3 * MiB)
    a.annotate("stepprof:bwd:blk.attn", "START")
    a.annotate("stepprof:bwd:blk.attn", "END")
    got["attn_bwd"] = a.alloc(16 * MiB)                # the peak: attention's scores' gradient
    a.annotate("stepprof:bwd_end", "START")
    a.annotate("stepprof:bwd_end", "END")
    a.annotate("stepprof:phase:backward", "END")
    end = a.snapshot()
    return start, end, got


def test_markers_in_the_trace_clock_name_modules_forward_and_backward() -> None:
    from stepprof._peak import marker_events

    a = FakeAllocator()
    start, end, _ = _marked_step(a)
    mods, phases = marker_events(end["external_annotations"], 0)
    assert [e.action for e in phases] == ["enter", "exit", "enter", "exit"]
    exp = explain(start, end, device=0, module_events=mods, phase_events=phases,
                  annotations=end["external_annotations"], in_clock=True)
    by = {m.module: m.total_bytes for m in exp.modules}
    assert by == {"blk.attn": 24 * MiB, "blk": 3 * MiB, "blk.mlp": 3 * MiB}
    assert exp.modules[0].module == "blk.attn"
    assert exp.phase == "backward"
    # No frames and no annotation open at the peak: the reason names where it was made.
    assert exp.op is None and "made in 'blk.attn'" in exp.unavailable["op"]


def test_markers_of_another_device_are_not_this_ones() -> None:
    from stepprof._peak import marker_events

    anns = [{"name": "stepprof:fwd:m", "stage": "START", "device": 1, "time_us": 5},
            {"name": "stepprof:fwd:m", "stage": "START", "device": 0, "time_us": 6},
            {"name": "stepprof:bwd_end", "stage": "START", "device": 0, "time_us": 9},
            {"name": "aten::mm", "stage": "START", "device": 0, "time_us": 7}]
    mods, phases = marker_events(anns, 0)
    assert mods == [Event(6.0, "enter", "m"), Event(9.0, "backward_end", "")] and phases == []


def test_in_the_same_microsecond_an_opening_marker_precedes_the_allocation_and_a_closing_one_follows() -> None:
    a = FakeAllocator()
    a.annotating = True
    start = a.start()
    t = a.t_us + 10
    a.tick = lambda us=0.0: t  # type: ignore[method-assign]  # every record below: the same µs
    a.annotate("stepprof:fwd:m", "START")
    a.alloc(1 * MiB, [MM])
    a.annotate("stepprof:fwd:m", "END")
    end = a.snapshot()
    from stepprof._peak import marker_events

    mods, _ = marker_events(end["external_annotations"], 0)
    exp = explain(start, end, device=0, module_events=mods, in_clock=True)
    assert [m.module for m in exp.modules] == ["m"] and exp.outside_modules_bytes == 0


def _op_step(spans: list[tuple[str, str]]) -> tuple[dict, dict]:
    """One forward of ``m`` whose allocation sets the peak; every range in ``spans`` is open
    at it: ("before", name) encloses m's forward, ("in", name) nests inside it, and, as ranges
    of another thread may, ("crossing", name) opens before m and closes inside it, ("late",
    name) opens inside m and closes after it."""
    a = FakeAllocator()
    a.annotating = True
    start = a.start()

    def mark(where: str, stage: str, order=spans) -> None:
        for w, name in order:
            if w == where:
                a.annotate(name, stage)

    mark("before", "START")
    mark("crossing", "START")
    a.annotate("stepprof:fwd:m", "START")
    mark("late", "START")
    mark("in", "START")
    a.alloc(4 * MiB, [MM, USER])
    mark("in", "END", list(reversed(spans)))
    mark("crossing", "END")
    a.annotate("stepprof:fwd:m", "END")
    mark("late", "END")
    mark("before", "END")
    return start, a.snapshot()


def _op(spans: list[tuple[str, str]]) -> PeakExplanation:
    from stepprof._peak import marker_events

    start, end = _op_step(spans)
    mods, phases = marker_events(end["external_annotations"], 0)
    return explain(start, end, device=0, module_events=mods, phase_events=phases,
                   annotations=end["external_annotations"], in_clock=True)


def test_the_op_at_the_peak_is_the_innermost_annotation_open_inside_the_module() -> None:
    exp = _op([("before", "## step ##"), ("in", "my_block"), ("in", "aten::mm")])
    assert exp.op == "aten::mm"
    assert exp.user_frame == "/home/me/train.py:42"  # still from the frames


def test_another_threads_ranges_and_enclosing_ranges_are_not_the_op() -> None:
    # A range that encloses the module is context; ranges that cross its boundary are
    # another thread's (annotations carry no thread): the frames name the op.
    exp = _op([("before", "## step ##"), ("crossing", "pin_memory"), ("late", "prefetch")])
    assert exp.op == "forward (torch/nn/modules/linear.py:125)"
    exp = _op([("crossing", "pin_memory"), ("in", "aten::addmm"), ("late", "prefetch")])
    assert exp.op == "aten::addmm"


def test_an_annotation_of_another_device_is_not_the_op() -> None:
    start, end = _op_step([("in", "aten::mm")])
    for a in end["external_annotations"]:
        if a["name"] == "aten::mm":
            a["device"] = 1
    from stepprof._peak import marker_events

    mods, _ = marker_events(end["external_annotations"], 0)
    exp = explain(start, end, device=0, module_events=mods, annotations=end["external_annotations"],
                  in_clock=True)
    assert exp.op.startswith("forward (")


def test_a_module_with_a_sliver_of_a_category_is_not_among_its_top_modules() -> None:
    """The report's top modules leave out one under 1 % of the category's bytes (the model's
    root with a few KiB of GiBs printed as "(root) 0.0 MiB")."""
    from stepprof._peak_record import peak_line, top_modules
    from stepprof._report.peak import peak_lines

    gib = 2**30

    def module(name: str, activations: int) -> dict:
        by = dict.fromkeys(("parameters", "gradients", "optimizer_state", "temporaries", "other"), 0)
        return {"module": name, "total_bytes": activations, "bytes_by_category": {**by, "activations": activations}}

    record = {
        "kind": "peak", "step": 3, "peak_allocated_bytes": 5 * gib, "live_bytes": 5 * gib,
        "bytes_by_category": {"parameters": 0, "gradients": 0, "optimizer_state": 0, "activations": 5 * gib,
                              "temporaries": 0, "other": 0},
        "modules": [module("(root)", 12 * 1024), module("h.0", 3 * gib), module("h.1", gib // 2)],
    }
    assert top_modules(record, "activations", 3) == [("h.0", 3 * gib), ("h.1", gib // 2)]
    text = "\n".join(peak_lines(record))
    assert "h.0 3.00 GiB" in text and "(root)" not in text and "(root)" not in peak_line(record)
    del record["bytes_by_category"]  # (no total to weigh against: every module with bytes)
    assert [n for n, _ in top_modules(record, "activations", 3)] == ["h.0", "h.1", "(root)"]

"""What the report's text shows of a run (issue 28, item 2): every batch size, gradient
accumulation in the phase table, the compiled steps' wording, each n/a reason once."""

from __future__ import annotations

from stepprof._report import build_report, render

from . import logfixtures as fx


def _text(tmp_path, records):
    return render(build_report([fx.write(str(tmp_path / "run.jsonl"), records)]))


def _accumulating(n=20, batches=(16, 24)):
    out = []
    for i in range(n):
        r = fx.step_record(i, warmup=i < 3, wall=5.0, gpu=5.0, batch=batches[0] if i < n // 2 else batches[1])
        r["phases"]["forward"]["count"] = 4  # four micro-batches a step
        if i % 3:
            del r["phases"]["optimizer"]  # the optimizer steps on one step in three
        out.append(r)
    return out


def test_the_heading_names_every_batch_size_with_its_steps(tmp_path):
    head = next(line for line in _text(tmp_path, _accumulating()).splitlines() if line.startswith("--"))
    assert head.endswith("; batch 16 (7 steps), 24 (10 steps)")


def test_many_batch_sizes_give_their_range(tmp_path):
    records = [fx.step_record(i, warmup=False, wall=5.0, gpu=5.0, batch=8 * (1 + i % 6)) for i in range(30)]
    head = next(line for line in _text(tmp_path, records).splitlines() if line.startswith("--"))
    assert head.endswith("; batch 8 to 48 (6 sizes; most often 8)")


def test_the_phase_table_shows_which_steps_a_phase_ran_in_and_how_often(tmp_path):
    lines = _text(tmp_path, _accumulating()).splitlines()
    header = next(line for line in lines if line.strip().startswith("phase "))
    assert header.split()[:5] == ["phase", "in", "steps", "runs/step", "wall"]
    rows = {line.split()[0]: line.split() for line in lines if line.strip().split()[:1] in (["forward"], ["optimizer"])}
    assert rows["forward"][1:3] == ["17/17", "4"]
    assert rows["optimizer"][1:3] == ["6/17", "1"]


def test_a_reason_is_given_once_for_rows_that_share_it(tmp_path):
    lines = _text(tmp_path, _accumulating()).splitlines()
    energy = [line for line in lines if line.strip().startswith(("energy J/step", "power W", "samples/J"))]
    assert "no step record has energy_j" in energy[0]
    assert all(line.endswith("n/a  (as above)") for line in energy[1:])


def test_compiled_steps_are_counted_as_the_measured_they_are_part_of(tmp_path):
    records = [fx.step_record(i, warmup=i < 2, wall=50.0 if i == 2 else 5.0, gpu=5.0) for i in range(32)]
    for r in records:
        r.update(compiles=0, compile_ms=0.0, graph_breaks=0)
    records[2].update(compiles=1, compile_ms=45.0, compiled=True)
    text = _text(tmp_path, records)
    head = next(line for line in text.splitlines() if line.startswith("--"))
    assert "30 measured, 29 timed)" in head
    assert "compiled steps            1 of the measured, left out of the figures" in text

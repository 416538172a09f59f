"""stepprof plot: step and sweep logs to PNGs (matplotlib where installed)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import stepprof

from . import logfixtures as fx
from .report_helpers import cli, h200_log  # noqa: F401 - h200_log is a fixture


def test_plot_without_matplotlib_prints_a_one_line_hint(monkeypatch, capsys, h200_log, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rc, out, err = cli(capsys, "plot", h200_log, "-o", str(tmp_path / "x.png"))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'stepprof[plot]'" in err


def test_plot_step_and_sweep_logs(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = str(tmp_path / "steps.png")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_png)
    assert rc == 0, err
    with open(out_png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    big = fx.write(str(tmp_path / "big.jsonl"), fx.training_log(steps=9000, spikes=(50, 4000, 8000)))
    assert cli(capsys, "plot", big, "-o", str(tmp_path / "big.png"))[0] == 0
    log = str(tmp_path / "sweep.jsonl")
    model = torch.nn.Linear(16, 4)
    stepprof.sweep(
        lambda x: model(x).sum().backward(),
        lambda n: torch.randn(n, 16),
        max_batch=16,
        restore=(model,),
        progress=False,
        min_time_s=0,
        log=log,
    )
    assert cli(capsys, "plot", log, "-o", str(tmp_path / "sweep.png"))[0] == 0
    assert os.path.getsize(tmp_path / "sweep.png") > 10_000


def test_plot_sweep_of_a_log_without_a_sweep_says_so(capsys, h200_log, tmp_path):
    """The log has steps: the error must not say it has none, and must say how to plot them."""
    pytest.importorskip("matplotlib")
    rc, out, err = cli(capsys, "plot", h200_log, "--sweep", "-o", str(tmp_path / "x.png"))
    assert rc == 2 and "Traceback" not in err
    assert "no sweep records" in err and "no step" not in err and "without --sweep" in err
    assert not os.path.exists(tmp_path / "x.png")


def test_plot_to_a_path_without_extension_writes_the_path_it_names(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_path = str(tmp_path / "steps")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_path)
    assert rc == 0, err
    assert out == f"stepprof: wrote {out_path}\n"
    with open(out_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_to_a_format_matplotlib_cannot_write_is_a_clear_error(capsys, h200_log, tmp_path):
    pytest.importorskip("matplotlib")
    out_path = str(tmp_path / "steps.pgn")
    rc, out, err = cli(capsys, "plot", h200_log, "-o", out_path)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "-o" in err and repr(out_path) in err and ".png" in err
    assert not os.path.exists(out_path)


def _cpu_log(path: str, steps: int = 6) -> str:
    model = torch.nn.Linear(16, 4)
    with stepprof.Profiler(path, warmup=1, device="cpu") as prof:
        for _ in range(steps):
            with prof.step(batch_size=8):
                model(torch.randn(8, 16)).sum().backward()
    return path


def test_the_host_rss_line_lies_inside_the_axes(tmp_path):
    """On the CPU the memory panel draws the host's RSS, a nearly flat line: the y-limits leave
    room above it, so that it does not sit on the top frame."""
    pytest.importorskip("matplotlib")
    from stepprof._plot import _read, steps_figure

    log = _cpu_log(str(tmp_path / "cpu.jsonl"))
    runs, _, _ = _read(log)
    fig = steps_figure(log, runs[-1], -1, len(runs))
    mem = fig.axes[1]
    (line,) = [ln for ln in mem.get_lines() if "RSS" in ln.get_label()]
    bottom, top = mem.get_ylim()
    ys = [y for y in line.get_ydata() if y == y]
    assert ys and bottom <= 0 < min(ys)
    assert max(ys) <= 0.9 * top  # a visible margin under the frame


def test_plot_takes_several_logs_and_writes_each_beside_it(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    a = _cpu_log(str(tmp_path / "a.jsonl"))
    b = _cpu_log(str(tmp_path / "b.rank0"))
    rc, out, err = cli(capsys, "plot", a, b)
    assert rc == 0, err
    assert out.splitlines() == [f"stepprof: wrote {tmp_path / 'a.png'}", f"stepprof: wrote {b}.png"]
    for png in (tmp_path / "a.png", f"{b}.png"):
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exit_:
        cli(capsys, "plot", a, b, "-o", str(tmp_path / "one.png"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'-o'" in err and "2 logs" in err and "LOG.png" in err


def _drawn_steps(log: str):
    from stepprof._plot import _read, steps_figure

    from .plot_checks import drawn

    runs, _, _ = _read(log)
    return drawn(steps_figure(log, runs[-1], -1, len(runs)))


@pytest.mark.parametrize(
    ("steps", "spikes"),
    [(50, (45, 46)), (20, (5, 18, 19)), (9000, (50, 8990, 8995)), (0, ())],
    ids=["quickstart-like", "20-steps", "binned", "cpu"],
)
def test_the_legends_cover_no_step(tmp_path, steps, spikes):
    """quickstart.png (issue 28): the legend at the lower right covered the spikes at steps 45 and
    46 of 50, and the steps after them. No legend covers a plotted point or an axes' data area,
    and none is cut off by the figure's edge."""
    pytest.importorskip("matplotlib")
    from .plot_checks import legend_clashes, legends

    log = str(tmp_path / "run.jsonl")
    if steps:
        fx.write(log, fx.training_log(steps=steps, spikes=spikes))
    else:
        _cpu_log(log, steps=12)
    fig = _drawn_steps(log)
    assert len(legends(fig)) == 2
    assert legend_clashes(fig) == []


@pytest.mark.parametrize("steps", [1, 2, 3, 20, 50, 137])
def test_step_ticks_sit_on_the_steps_they_name(tmp_path, steps):
    """In a 20-step run the ticks were at 2.5, 7.5, 12.5, 17.5 and read 2, 8, 12, 18 (issue 28);
    in a 1-step run five ticks read -0, -0, 0, 0, 0. Each tick in view is on a whole step, and
    its label is that step."""
    pytest.importorskip("matplotlib")
    from .plot_checks import off_integer_ticks

    log = fx.write(str(tmp_path / "run.jsonl"), fx.training_log(steps=steps, warmup=min(3, steps - 1)))
    fig = _drawn_steps(log)
    mem = fig.axes[1]
    assert len(mem.get_xticks()) >= 1
    for ax in fig.axes:
        assert off_integer_ticks(ax.xaxis) == []


@pytest.mark.parametrize("modules", [True, False], ids=["modules", "no-modules"])
def test_the_peak_plots_category_legend_is_whole_and_clear_of_the_timeline(modules):
    """``stepprof plot --peak`` (issue 28): the category legend under the bar ran into the timeline
    panel below it. It lies within the figure and overlaps no other panel, its ticks or labels."""
    pytest.importorskip("matplotlib")
    from stepprof._peak_plot import _ORDER, peak_figure

    from .plot_checks import drawn, legend_clashes, legends
    from .readerlogs import peak_record

    rec = peak_record(20)
    if not modules:
        rec.update(modules=[], unavailable={"modules": "no model was given to stepprof.explain_peak"})
    fig = drawn(peak_figure(rec))
    (legend,) = legends(fig)
    assert [t.get_text().split()[0] for t in legend.get_texts()] == [c for c in _ORDER if rec["bytes_by_category"][c]]
    assert legend_clashes(fig) == []

"""stepprof._sweep.plot: SweepResult.plot draws a PNG."""

from __future__ import annotations

import pytest

import stepprof

from .sweep_helpers import run, setup


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    gpu, step = setup(thrash_from=3000, thrash_factor=1.3)
    r = run(step, gpu)
    out = r.plot(tmp_path / "sweep.png")
    data = (tmp_path / "sweep.png").read_bytes()
    assert out == str(tmp_path / "sweep.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_to_a_path_without_extension_writes_that_path(tmp_path):
    """The docstring's "a PNG at ``path``" and the returned path: matplotlib alone would write
    ``sweep.png`` next to it and the returned ``sweep`` would not exist."""
    pytest.importorskip("matplotlib")
    gpu, step = setup()
    r = run(step, gpu, progress=False, max_batch=8)
    out = r.plot(tmp_path / "sweep")
    assert out == str(tmp_path / "sweep")
    assert (tmp_path / "sweep").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_install_command(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    gpu, step = setup()
    r = run(step, gpu, max_batch=8)
    with pytest.raises(ImportError, match=r"pip install 'stepprof\[plot\]'") as info:
        r.plot(tmp_path / "x.png")
    assert isinstance(info.value, stepprof.StepprofError)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("kw", "setup_kw"), [({}, {"thrash_from": 3000, "thrash_factor": 1.3}), ({"max_batch": 8}, {})],
                         ids=["to-oom", "max-batch-8"])
def test_the_legends_cover_no_point_and_the_batch_ticks_are_whole(kw, setup_kw):
    """The legends at the upper left covered the allocator's capacity line and, up to batch 8,
    the "90% of the best" line (issue 28). No legend covers a plotted point or an axes' data
    area, and the batch axis's ticks are whole batch sizes, labelled as such."""
    pytest.importorskip("matplotlib")
    from stepprof._sweep.plot import sweep_figure

    from .plot_checks import drawn, legend_clashes, legends, off_integer_ticks

    gpu, step = setup(**setup_kw)
    fig = drawn(sweep_figure(run(step, gpu, **kw)))
    assert len(legends(fig)) == 2
    assert legend_clashes(fig) == []
    for ax in fig.axes:
        assert off_integer_ticks(ax.xaxis) == []

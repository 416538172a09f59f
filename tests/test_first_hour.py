"""What a newcomer meets in the first hour: the demo's output, --version, help() and dir()."""

from __future__ import annotations

import os
import pydoc
import re
import subprocess
import sys

import pytest
import torch

import stepprof
from stepprof._cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _demo(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # every warning shows, DeprecationWarning too
    return subprocess.run(
        [sys.executable, "-m", "stepprof", "demo", *args],  # the log: stepprof-demo.jsonl in the cwd
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )


def test_the_demo_labels_its_figures_and_ends_with_the_next_commands(tmp_path):
    """On the CPU: no warning from torch or numpy (nothing on stderr at all), medians labelled,
    one short line per missing figure group, the next commands last, no line over 120 characters."""
    done = _demo(tmp_path, "--steps", "12", "--warmup", "2")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, max(lines, key=len)
    assert "10 measured steps (2 warm-up) on cpu; medians over the measured steps:" in lines
    assert any(line.strip().startswith("wall time per step") and " ms (p10 " in line for line in lines)
    for group in ("GPU time", "GPU memory", "sync points", "energy"):
        assert sum(line.startswith(f"{group}: n/a on CPU") for line in lines) == 1
    assert "unavailable here" not in done.stdout and "CUDA is not available" not in done.stdout
    log = "stepprof-demo.jsonl"
    printed = _next_commands(lines)
    assert [c.split()[-2:] for c in printed[:2]] == [["report", log], ["plot", log]], printed
    assert any(line.endswith("to stepprof-demo.png") for line in lines[lines.index("next:"):])
    assert len(list(stepprof.read(tmp_path / log, kind="step"))) == 12


def _next_commands(lines: list[str]) -> list[str]:
    """The commands the demo prints after ``next:``, without what each does."""
    after = [line.strip() for line in lines[lines.index("next:") + 1:]]
    return [line.split("    ")[0] for line in after if line and not line.startswith("#")]


def _readme_demo_command() -> str:
    """The README's first set-up command: the one that runs the demo."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme.split("## Set-up", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "stepprof demo" in commands[0], commands
    return commands[0]


def _fresh_copy(dest: str) -> None:
    """The files git tracks, as this working tree has them: what a fresh clone holds."""
    import shutil

    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(dest, name))


def test_the_readmes_demo_and_each_command_it_prints_run_verbatim_in_a_fresh_checkout(tmp_path):
    """Issue 28, item 1: the README's demo command in a fresh checkout, then every command the
    demo prints as next, as printed, in the same shell (whose venv was never activated)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no fresh copy to make")
    checkout = str(tmp_path / "checkout")
    _fresh_copy(checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}

    def shell(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True,
                              text=True, timeout=1200)

    demo = shell(_readme_demo_command())
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    printed = _next_commands(demo.stdout.splitlines())
    assert len(printed) == 3 and printed[-1] == "stepprof.read('stepprof-demo.jsonl')", demo.stdout
    cli = printed[0].rsplit(" report ", 1)[0]
    if "pip install matplotlib" in printed[1]:  # the README's demo set-up has no [plot] extra
        printed.insert(2, f"{cli} plot stepprof-demo.jsonl")  # what the install line says it is for
    for command in printed[:-1]:
        done = shell(command)
        assert done.returncode == 0, f"{command}: {done.stdout[-1000:]}{done.stderr[-1000:]}"
    assert os.path.getsize(os.path.join(checkout, "stepprof-demo.png")) > 10_000
    in_python = shell(f".venv/bin/python -c \"import stepprof; print(len(list({printed[-1]})))\"")
    assert in_python.returncode == 0 and int(in_python.stdout) > 60, in_python.stderr


def test_the_demo_warns_when_every_step_is_warm_up(tmp_path):
    done = _demo(tmp_path, "--steps", "3", "--warmup", "5")
    assert done.returncode == 0, done.stderr
    assert "warning: --warmup 5 >= --steps 3" in done.stdout and "use a --warmup below 3" in done.stdout
    assert "0 measured steps" in done.stdout and "no figures" in done.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"stepprof {stepprof.__version__}\n"


def test_the_version_has_one_source():
    """pyproject.toml reads stepprof.__version__; the README names none; the installed
    metadata agrees; every released version in the changelog is older."""
    import importlib.metadata
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("stepprof") == stepprof.__version__
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert not re.search(r"\b[Vv]ersion \d", readme) and stepprof.__version__ not in readme
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        released = re.findall(r"^## \[(\d+)\.(\d+)\.(\d+)\]", f.read(), re.M)
    ours = tuple(int(n) for n in re.match(r"(\d+)\.(\d+)\.(\d+)", stepprof.__version__).groups())
    assert released and all(tuple(map(int, r)) < ours for r in released)


def test_dir_lists_no_private_name():
    names = dir(stepprof)
    assert not [n for n in names if n.startswith("_") and n != "__version__"]
    assert "_LAZY" not in names and "_TYPE_CHECKING" not in names and "_api" not in names


@pytest.mark.parametrize("name", stepprof.__all__)
def test_help_shows_a_docstring_and_no_private_class(name):
    """help() on every public name shows its docstring; the functions that are objects (so that
    `with stepprof.profile_step:` gets a hint) read as functions, with no private class or
    sentinel in their title or signature."""
    obj = getattr(stepprof, name)
    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    if name != "SCHEMA_VERSION":  # a constant: an int, documented in docs/reference/schema.md
        assert obj.__doc__ and obj.__doc__.strip().splitlines()[0] in text
    assert "Function" not in text.splitlines()[0] and "object at 0x" not in text
    if callable(obj) and not isinstance(obj, type):
        assert text.splitlines()[0].startswith(f"Python Library Documentation: function {name} in module")
        for private in ("StepScope", "MeasureScope", "Iterated", "_PublicFunction"):
            assert private not in text


def test_the_summary_line_keeps_a_small_tflops_figure(tmp_path):
    """A CPU's TFLOP/s is well below 0.1: the summary line gives its digits, not "0.0"."""
    model = torch.nn.Linear(16, 16)
    with stepprof.Profiler(None, flops="auto", device="cpu") as prof:
        for _ in range(4):
            with prof.step(batch_size=4):
                model(torch.randn(4, 16)).sum().backward()
    t = prof.summary.tflops_per_s_median
    assert t is not None and 0 < t < 0.05
    assert "0.0 TFLOP/s" not in str(prof.summary) and f"{t:.3g} TFLOP/s" in str(prof.summary)


def test_a_cpu_record_gives_reserved_bytes_its_own_reason(tmp_path):
    """reserved_bytes is not a peak: its reason says what it is, not that no peak counter exists."""
    log = str(tmp_path / "cpu.jsonl")
    with stepprof.Profiler(log, device="cpu") as prof:
        with prof.step():
            pass
    (rec,) = stepprof.read(log, kind="step")
    assert "peak" not in rec["unavailable"]["reserved_bytes"]
    assert "reserved by CUDA's caching allocator" in rec["unavailable"]["reserved_bytes"]


def _two_names(log: str) -> None:
    """Steps of two names, interleaved: a slow train_step and a fast eval_step."""
    import time

    with stepprof.Profiler(log, warmup=0, device="cpu") as prof:
        for _ in range(6):
            with prof.step("train_step", batch_size=8):
                time.sleep(0.004)
                with prof.measure("forward"):
                    pass
            with prof.step("eval_step", batch_size=2):
                pass


def test_the_report_gives_each_step_name_its_own_figures(tmp_path, capsys):
    """A run whose steps have two names: one entry per name (in --json and the text), each with
    only its steps' figures, never one median over both."""
    import orjson

    log = str(tmp_path / "names.jsonl")
    _two_names(log)
    assert main(["report", "--json", log]) == 0
    runs = orjson.loads(capsys.readouterr().out)["logs"][0]["runs"]
    by_name = {r["step_name"]: r for r in runs}
    assert set(by_name) == {"train_step", "eval_step"} and {r["run_id"] for r in runs} == {runs[0]["run_id"]}
    train, ev = by_name["train_step"], by_name["eval_step"]
    assert train["steps"] == ev["steps"] == 6
    assert train["figures"]["wall_ms"]["median"] > 3.5 > ev["figures"]["wall_ms"]["median"]
    assert train["batch_size"] == 8 and ev["batch_size"] == 2
    assert [p["name"] for p in train["phases"]] == ["forward"] and ev["phases"] == []
    assert main(["report", log]) == 0
    text = capsys.readouterr().out
    assert "steps named 'train_step'" in text and "steps named 'eval_step'" in text and "-- run" not in text


def test_a_run_with_several_names_splits_alike_when_read_in_parallel(tmp_path):
    """The parallel read merges byte ranges' aggregates: the name groups merge too."""
    from stepprof._report.build import report_log

    log = str(tmp_path / "names.jsonl")
    _two_names(log)
    serial = report_log(log, workers=1)
    parallel = report_log(log, workers=3)  # three byte ranges, merged

    def key(report):
        return [(r.step_name, r.steps, r.measured_steps, r.figures.wall_ms) for r in report.runs]

    assert key(serial) == key(parallel) and len(serial.runs) == 2


def test_a_run_with_several_names_keeps_its_peak_record_with_the_explained_steps_name(tmp_path):
    """explain_peak's record follows its step's record: the report shows it under that step's
    name (serial and parallel reads alike), not nowhere."""
    from stepprof._report.build import report_log

    log = str(tmp_path / "peak.jsonl")
    with stepprof.Profiler(log, warmup=0, device="cpu", explain_peak=3) as prof:
        for _ in range(4):
            for name in ("train_step", "eval_step"):  # indices 0, 1, 2, 3...: step 3 is an eval_step
                with prof.step(name):
                    pass
    for workers in (1, 3):
        runs = report_log(log, workers=workers).runs
        peaks = {r.step_name: r.peak for r in runs}
        assert peaks["train_step"] is None, workers
        assert isinstance(peaks["eval_step"], dict) and peaks["eval_step"]["step"] == 3, workers


def test_phase_syncs_are_na_when_the_steps_counted_none(tmp_path, capsys):
    """A step without a sync count (syncs null, with its reason) whose phases say 0: the phase
    table says n/a like the step line, not 0.00."""
    import orjson

    log = tmp_path / "syncs.jsonl"
    why = "CUDA is not available: there is no device for the host to wait on"
    recs = [
        {"schema_version": 2, "kind": "step", "step": i, "name": "step", "warmup": False, "device": "cpu",
         "wall_ms": 1.0, "syncs": None, "unavailable": {"syncs": why, "phases.syncs": why},
         "phases": {"forward": {"wall_ms": 0.5, "gpu_ms": None, "peak_allocated_bytes": None, "count": 1,
                                "syncs": 0}}}
        for i in range(4)
    ]
    log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    assert main(["report", str(log)]) == 0
    text = capsys.readouterr().out
    assert f"syncs/step                n/a  ({why})" in text
    (row,) = [line for line in text.splitlines() if line.strip().startswith("forward")]
    assert row.split()[-1] == "n/a" and "0.00" not in row


def test_a_cpu_sweep_says_what_its_curve_shows(tmp_path):
    """On the CPU there is no allocator: a slower large batch is not "thrash", and a batch that
    ran is not "max_fit" when no memory limit was searched."""
    import time

    def train_step(x):
        time.sleep(0.001 if len(x) <= 4 else 0.0005 * len(x) ** 2)  # samples/s falls past 4

    result = stepprof.sweep(train_step, lambda n: torch.zeros(n, 2), max_batch=32, device="cpu",
                            progress=False, min_time_s=0, steps=2)
    text = str(result)
    assert result.thrash_zone is not None and result.first_oom is None
    table = [line for line in text.splitlines() if not line.startswith("recommended")]
    assert "thrash" not in "\n".join(table) and "max_fit" not in text
    assert f"slower from {result.thrash_zone.start}" in text and "largest ran" in text
    assert "no memory thrash" in result.reason


README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_the_readme_is_short_and_its_first_code_block_runs_as_written(tmp_path):
    """Under 150 lines; its first code block is Python that runs on the CPU as written and writes
    the log it names; the two set-up commands are there verbatim, the test one as .ci/run runs it."""
    with open(README) as f:
        text = f.read()
    assert len(text.splitlines()) < 150
    first = text.split("```")[1]
    lang, code = first.split("\n", 1)
    assert lang == "python"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "measured steps" in done.stdout
    kinds = [r["kind"] for r in stepprof.read(tmp_path / "run.jsonl")]
    assert kinds.count("step") == 20 and kinds[-1] == "summary"
    demo = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && '
            '.venv/bin/python -m stepprof demo')
    test = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[dev]" && '
            '.venv/bin/python -m pytest -q')
    assert demo in text.splitlines() and test in text.splitlines()
    with open(os.path.join(os.path.dirname(README), ".ci", "run")) as f:
        assert test in f.read().splitlines()
    assert "find-links" not in text


def test_the_readme_names_every_public_name_and_links_every_example():
    with open(README) as f:
        text = f.read()
    assert not [n for n in stepprof.__all__ if f"`{n}" not in text and f"{n}(" not in text]
    examples = os.path.join(os.path.dirname(README), "examples")
    assert not [e for e in os.listdir(examples) if e.endswith(".py") and f"(examples/{e})" not in text]
    docs = os.path.join(os.path.dirname(README), "docs")
    assert not [d for d in os.listdir(docs) if d.endswith(".md") and f"(docs/{d})" not in text]


def _anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (code blocks left out)."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        anchor = "".join(c for c in heading.strip().lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
        found.add(anchor if anchor not in found else f"{anchor}-1")
    return found


def test_every_docs_page_is_linked_from_the_index_and_every_relative_link_resolves():
    """docs/index.md links every page under docs/; each relative link in docs/, README.md and
    CHANGELOG.md names a file that exists, and an anchor that one of its headings makes."""
    root = os.path.dirname(README)
    pages = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "docs")) for f in fs if f.endswith(".md")]
    with open(os.path.join(root, "docs", "index.md"), encoding="utf-8") as f:
        index = f.read()
    rel = [os.path.relpath(p, os.path.join(root, "docs")) for p in pages]
    assert not [p for p in rel if p != "index.md" and f"({p})" not in index]
    broken = []
    for path in [*pages, README, os.path.join(root, "CHANGELOG.md")]:
        with open(path, encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            missing = not os.path.exists(resolved)
            if missing or (anchor and resolved.endswith(".md") and anchor not in _anchors(resolved)):
                broken.append(f"{os.path.relpath(path, root)}: {target}")
    assert broken == []


def test_what_the_demo_and_the_docs_commands_write_is_ignored_by_git_and_the_docs_images_are_not():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    written = ["stepprof-demo.jsonl", "stepprof-demo.png", "trace.json", "tb/events.out", "lightning_logs/v0/x"]
    ignored = subprocess.run(["git", "check-ignore", *written], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == written
    kept = subprocess.run(["git", "check-ignore", "docs/images/report-h200.png"], cwd=ROOT, capture_output=True)
    assert kept.returncode == 1


def test_missing_extra_error_is_public():
    assert issubclass(stepprof.MissingExtraError, ImportError) and issubclass(stepprof.MissingExtraError, stepprof.StepprofError)

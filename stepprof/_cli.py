"""Command line: ``stepprof demo | report | plot | export | env | calibrate | build``."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepprof", description="Honest numbers about a PyTorch training step."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"stepprof {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small embedded model under stepprof and print the summary")
    demo.add_argument("--steps", type=int, default=60, help="steps to train (default 60)")
    demo.add_argument(
        "--warmup", type=int, default=5, help="warm-up steps left out of the summary (default 5)"
    )
    demo.add_argument("--log", default="stepprof-demo.jsonl", help="JSON-lines log to append to")
    demo.add_argument("--device", default=None, help="'cpu', 'cuda' or 'cuda:N' (default: CUDA if present)")
    report = sub.add_parser(
        "report", help="figures and diagnoses (with evidence and remedies) of one or more logs"
    )
    report.add_argument("logs", nargs="+", metavar="LOG", help="stepprof JSON-lines log(s)")
    report.add_argument("--json", action="store_true", help="print the report as one JSON object")
    plot = sub.add_parser("plot", help="draw step logs (times and memory per step) or sweep logs to PNGs")
    plot.add_argument("logs", nargs="+", metavar="LOG", help="stepprof JSON-lines log(s); one PNG each")
    plot.add_argument(
        "-o", "--output", default=None, help="PNG to write (one LOG only; default: beside each log, its .jsonl replaced by .png)"
    )
    plot.add_argument(
        "--run", type=int, default=0, help="which run of a log with several (1-based; default: last)"
    )
    plot.add_argument("--sweep", action="store_true", help="draw the log's sweep, not its steps")
    plot.add_argument("--peak", action="store_true", help="draw the log's explained peak (explain_peak)")
    export = sub.add_parser(
        "export",
        help="write one or more logs' steps as a Chrome/Perfetto trace or as TensorBoard scalars",
    )
    to = export.add_mutually_exclusive_group(required=True)
    to.add_argument("--chrome", metavar="PATH", help="trace-event JSON to write (opens in ui.perfetto.dev)")
    to.add_argument("--tensorboard", metavar="DIR", help="directory to write TensorBoard event files to")
    export.add_argument("logs", nargs="+", metavar="LOG", help="stepprof JSON-lines log(s), such as a run's per-rank logs")
    env = sub.add_parser("env", help="GPU, driver, CUDA, torch, allocator, NVML, calibration, sync detection")
    env.add_argument("--json", action="store_true", help="print as one JSON object")
    cal = sub.add_parser(
        "calibrate",
        help="measure this GPU's matmul peak and copy bandwidth (a few seconds), "
        "cached for MFU and the roofline",
    )
    cal.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    cal.add_argument("--json", action="store_true", help="print as one JSON object")
    build = sub.add_parser(
        "build",
        help="compile the step boundary (one C++ call per boundary instead of several from Python) "
        "ahead of time, cached per torch, CUDA and Python; a profiler otherwise builds it in the "
        "background on first use",
    )
    build.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    for subparser in sub.choices.values():
        subparser.set_defaults(subparser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from ._errors import StepprofError

    try:
        # The subcommand's own parser: its errors show its usage ("stepprof demo: error: ...").
        return _COMMANDS[args.command](args.subparser, args)
    except BrokenPipeError:  # `stepprof report --json LOG | head`: the reader has all it wanted
        _quiet_stdout()
        return PIPE_CLOSED
    except StepprofError as e:
        return _failed(args, str(e))
    except OSError as e:
        return _failed(args, f"{e.strerror or e}: {e.filename!r}" if e.filename else str(e))


def _failed(args: argparse.Namespace, why: str) -> int:
    """Say why the command failed: on stderr, and with ``--json`` as ``{"error": why}`` on
    stdout too, so that a script reading the JSON reads the failure; exit status 2."""
    print(f"stepprof: {why}", file=sys.stderr)
    if getattr(args, "json", False):
        print(_dumps({"error": why}))
    return 2


#: The exit status when stdout's reader closed the pipe early: a shell's for a process SIGPIPE
#: ended (128 + 13), as ``cat LOG | head`` gives.
PIPE_CLOSED = 141


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's flush at exit would fail on the closed pipe
    again, and print the error the user's ``| head`` did not ask for."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no descriptor (a test's capture): nothing to flush
        pass


def _dumps(obj: Any) -> str:
    """``obj`` as indented JSON for a terminal: strings from a log keep their values, their
    control characters escaped (C0 by the encoder, DEL and C1 by :func:`~stepprof._units.printable_json`)."""
    import orjson

    from ._units import printable_json

    option = orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS
    try:
        return printable_json(orjson.dumps(obj, option=option).decode())
    except orjson.JSONEncodeError:  # a log path that is not UTF-8, say: repaired as the log's records are
        from ._log import encodable

        return printable_json(orjson.dumps(encodable(obj), option=option).decode())


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._demo import run_demo
    from ._errors import ConfigError
    from ._validate import check_demo_options

    try:
        check_demo_options(args.steps, args.warmup, args.device)
    except ConfigError as e:
        parser.error(str(e))
    run_demo(steps=args.steps, warmup=args.warmup, log=args.log, device=args.device)
    return 0


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._report import build_report, render

    report = build_report(args.logs)
    if args.json:
        print(_dumps(report.to_dict()))
    else:
        _print(render(report))
    if not any(log.runs or log.sweeps for log in report.logs):  # as plot and export: nothing to show
        print("stepprof: no step, memory or sweep records to report in "
              + ", ".join(repr(log.path) for log in report.logs), file=sys.stderr)
        return 2
    return 0


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._errors import ConfigError
    from ._plot import default_png, plot_log
    from ._validate import check_plot_run

    try:
        check_plot_run(args.run)
        if args.output is not None and len(args.logs) > 1:
            raise ConfigError(
                f"'-o' {args.output!r} names one PNG for {len(args.logs)} logs; leave -o out to write "
                f"each log's plot beside it (LOG.png)"
            )
    except ConfigError as e:
        parser.error(str(e))
    for log in args.logs:
        out = args.output if args.output is not None else default_png(log, ".peak.png" if args.peak else ".png")
        if args.peak:
            from ._peak_plot import plot_peak

            out = plot_peak(log, out)
        else:
            out = plot_log(log, out, run=args.run - 1 if args.run else -1, sweep=args.sweep)
        print(f"stepprof: wrote {out}")
    return 0


def _export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import _export as export
    from ._units import format_count

    if args.chrome is not None:
        done = export.export_chrome(args.logs, args.chrome)
        where = f"{done.path}: open it in https://ui.perfetto.dev"
    else:
        done = export.export_tensorboard(args.logs, args.tensorboard)
        where = f"{done.path}: open it with `tensorboard --logdir {done.path}`"
    of = [f"{done.ranks} ranks" if done.ranks > 1 else "", f"{done.runs} runs" if done.runs > max(1, done.ranks) else ""]
    print(f"stepprof: wrote {format_count(done.steps)} step{'s' * (done.steps != 1)}"
          + (f" ({', '.join(x for x in of if x)})" if any(of) else "") + f" to {where}")
    if done.skipped:
        print(f"stepprof: skipped {format_count(done.skipped)} step record(s) without a usable "
              f"step, start_unix_s or wall_ms", file=sys.stderr)
    if done.runs_left_out:
        print(f"stepprof: left out the first {format_count(done.runs_left_out)} run(s): --tensorboard writes "
              f"at most the last {export.TB_RUNS_KEPT} runs, a directory each", file=sys.stderr)
    return 0


def _env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._env import environment, render_env

    env = environment()
    if args.json:
        print(_dumps(env))
    else:
        _print(render_env(env))
    return 0


def _calibrate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._validate import check_calibrate_device

    check_calibrate_device(args.device)
    from ._device.calibrate import calibrate
    from ._roofline import save_calibration

    def say(msg: str) -> None:
        if not args.json:
            print(f"  measuring {msg} ...", file=sys.stderr, flush=True)

    record = calibrate(args.device, progress=say)
    path = save_calibration(record)
    if args.json:
        print(_dumps({**record, "path": path}))
        return 0
    t = record["matmul_tflops"]
    print(f"stepprof calibrate: {record['device_name']} (cuda:{args.device})")
    for k in ("bf16", "tf32", "fp32"):
        print(f"  dense matmul {k}: {t[k]:8,.1f} TFLOP/s  (n={record['matmul_n'][k]})")
    print(f"  copy bandwidth:  {record['copy_gbps']:8,.0f} GB/s (read + write)")
    print(f"  host cost of one op: {record['launch_us']:.1f} µs")
    print(f"  ridge (bf16): {t['bf16'] * 1e3 / record['copy_gbps']:.0f} FLOP/byte")
    print(f"saved to {path}")
    return 0


def _build(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import _native
    from ._device.compiled import build
    from ._errors import BuildError

    failed = False
    try:
        print(f"stepprof build: the C module (the step core, the fold of the summary and report) is ready in {_native.build()}")
    except BuildError as e:  # (the boundary is still built: they need different compilers)
        print(f"stepprof build: {e}", file=sys.stderr)
        failed = True
    try:
        report = build(verbose=args.verbose)
    except BuildError as e:
        print(f"stepprof build: {e}", file=sys.stderr)
        return 1
    print(f"stepprof build: the compiled boundary is ready in {report.path} ({report.seconds:.1f} s)")
    return 1 if failed else 0


def _print(text: str) -> None:
    """Print, with rich's colours when it is installed and stdout is a terminal."""
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.markup import escape
        except ImportError:
            print(text, end="")
            return
        # The text is already printable (stepprof._units.printable); rich must not reinterpret
        # it either: markup is escaped below, and ":name:" stays text, not an emoji.
        console = Console(highlight=False, emoji=False)
        for line in text.splitlines():
            style = (
                "bold"
                if line.startswith(("==", "--"))
                else "bold yellow"
                if line.lstrip().startswith("* ")
                else "green"
                if "remedy:" in line
                else None
            )
            console.print(escape(line), style=style)
        return
    print(text, end="")


_COMMANDS = {"demo": _demo, "report": _report, "plot": _plot, "export": _export, "env": _env, "calibrate": _calibrate, "build": _build}

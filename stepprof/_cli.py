"""Command line: ``stepprof demo`` (more subcommands arrive with later features)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepprof", description="Honest numbers about a PyTorch training step.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small embedded model under stepprof and print the summary")
    demo.add_argument("--steps", type=int, default=60, help="steps to train (default 60)")
    demo.add_argument("--warmup", type=int, default=5, help="warm-up steps left out of the summary (default 5)")
    demo.add_argument("--log", default="stepprof-demo.jsonl", help="JSON-lines log to append to")
    demo.add_argument("--device", default=None, help="'cuda', 'cpu', ... (default: CUDA if present)")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from ._demo import run_demo
        from ._errors import StepprofError

        if args.steps < 1:
            parser.error(f"--steps must be >= 1 (got {args.steps})")
        try:
            run_demo(steps=args.steps, warmup=args.warmup, log=args.log, device=args.device)
        except StepprofError as e:
            print(f"stepprof: {e}", file=sys.stderr)
            return 2
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands

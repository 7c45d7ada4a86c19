"""The `pagoda` command line.

Each package contributes its own subcommands through a `register(commands, bench)` function in the
modules listed below, so this file never grows with every feature and `pagoda --help` stays cheap:
registering must not import torch or transformers (handlers import what they need when they run).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "laya.cli",
    "laya.train",
    "laya.calibrate",
    "distill.cli",
    "generation.cli",
    "serving.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Decisions and generation on hardware you own.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_parser = commands.add_parser("bench", help="benchmarks that print ratios against a baseline")
    bench = bench_parser.add_subparsers(dest="bench_target", required=True, metavar="TARGET")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that feature is not built yet; anything else missing is a real error
                continue
            raise
        module.register(commands, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

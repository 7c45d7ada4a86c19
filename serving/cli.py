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
        # No skipping: a listed module that fails to import is a broken install or a typo, and a
        # command that silently vanished from `pagoda --help` would hide it.
        importlib.import_module(name).register(commands, bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

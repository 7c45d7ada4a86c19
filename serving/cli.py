"""The `pagoda` command line, and serving's own commands: `pagoda serve` and `pagoda bench serve`.

Each package contributes its subcommands through a `register(commands, bench)` function in the modules
listed below, so this file never grows with every feature and `pagoda --help` stays cheap: registering
must not import torch or transformers (handlers import what they need when they run).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from serving.config import ServeConfig

COMMAND_MODULES = (
    "laya.cli",
    "distill.cli",
    "generation.cli",
    "serving.cli",
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


def register(commands, bench) -> None:
    serve = commands.add_parser("serve", help="serve the HTTP APIs: POST /decide and friends (gunicorn, "
                                              "cross-request batching)",
                                description="Start the server. Every flag also reads PAGODA_<FLAG> from the "
                                            "environment; PAGODA_API_KEY turns on bearer auth.")
    ServeConfig.add_arguments(serve)
    serve.set_defaults(func=_serve)

    b = bench.add_parser("serve", help="closed-loop HTTP clients against pagoda serve, batching on vs off")
    b.add_argument("--model", default=None, help="Laya checkpoint folder (default: the embedded laya-mini)")
    b.add_argument("--student", default=None, help="benchmark a distilled student instead")
    b.add_argument("--concurrency", default="1,4,16,32", help="comma list of client counts")
    b.add_argument("--seconds", type=float, default=5.0, help="measured seconds per (mode, concurrency)")
    b.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each measurement")
    b.add_argument("--preset", default="support-triage", help="question preset the clients ask")
    b.add_argument("--max-wait-ms", type=float, default=None, help="batcher wait (default: the server's)")
    b.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads in the server (0: torch default; 1 keeps runs comparable on a shared box)")
    b.add_argument("--plot", default=None, help="write a PNG of decisions/s by concurrency here")
    b.set_defaults(func=_bench)


def _serve(args: argparse.Namespace) -> int:
    from serving.app import build_apis

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    try:
        cfg = ServeConfig.from_sources(flags)
        build_apis(cfg)  # reads presets and policies here, before gunicorn forks: a bad file stops us, named
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    from serving.server import serve

    serve(cfg)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from serving.decide.bench import run_bench

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected a comma list of integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: give at least one positive client count")
    return run_bench(args, levels, out=sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

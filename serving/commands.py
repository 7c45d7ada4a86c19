"""`pagoda serve` and `pagoda bench serve`. Registering imports nothing heavy; handlers import on run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.config import ServeConfig


def register(commands, bench) -> None:
    serve = commands.add_parser("serve", help="serve POST /decide over HTTP (gunicorn, cross-request batching)",
                                description="Start the decision service. Every flag also reads PAGODA_<FLAG> "
                                            "from the environment; PAGODA_API_KEY turns on bearer auth.")
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


def _config(flags: dict) -> ServeConfig:
    try:
        cfg = ServeConfig.from_sources(flags)
        for path, what in ((cfg.model, "--model"), (cfg.student, "--student")):
            if path and not Path(path).is_dir():
                raise ValueError(f"{what} {path}: no such folder")
        from serving.policy import Policy
        from serving.presets import load_presets

        # Checked here, before gunicorn forks, so a bad file stops the server with an error naming it.
        if cfg.presets:
            load_presets(cfg.presets, cfg)
        if cfg.policy:
            Policy.load(cfg.policy)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    return cfg


def _serve(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    cfg = _config(flags)
    from serving.server import serve

    serve(cfg)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from serving.bench import run_bench

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: expected a comma list of integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency: give at least one positive client count")
    return run_bench(args, levels, out=sys.stdout)

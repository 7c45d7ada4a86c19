"""`pagoda gateway` and `pagoda bench gateway`. Registering imports neither torch nor the server."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from serving.gateway.config import GatewayConfig, add_arguments


def register(commands: Any, bench: Any) -> None:
    # conflict_handler="resolve": add_arguments declares --upstream again, as a repeatable flag.
    p = commands.add_parser("gateway", help="one endpoint in front of generation servers (pagoda, vLLM, SGLang, "
                                            "llama.cpp): pass-through, health checks, routing by a Laya decision",
                            description="Start the gateway. Every flag also reads PAGODA_<FLAG> from the "
                                        "environment, and a --config file under that; PAGODA_API_KEY turns on "
                                        "bearer auth.", conflict_handler="resolve")
    add_arguments(p)
    p.set_defaults(func=_gateway)

    b = bench.add_parser("gateway", help="added latency and streaming throughput of pagoda gateway vs calling "
                                         "the upstream directly, and the cost of a routing decision")
    b.add_argument("--generate-model", default=None, help="the upstream's LLM: HF folder or .gguf (default: the "
                                                         "embedded SmolLM2-135M-Instruct)")
    b.add_argument("--requests", type=int, default=300, help="requests per side of each latency row, alternating "
                                                             "direct and gateway one by one")
    b.add_argument("--rounds", type=int, default=8, help="alternating direct/gateway rounds of the throughput row")
    b.add_argument("--streams", type=int, default=64, help="concurrent streams of the throughput rounds")
    b.add_argument("--seconds", type=float, default=3.0, help="measured seconds per round")
    b.add_argument("--new-tokens", type=int, default=16, help="tokens per streamed request")
    b.add_argument("--model", default=None, help="Laya checkpoint for the decision rows (default: laya-mini)")
    b.add_argument("--student", default=None, help="a distilled student for the student decision row "
                                                   "(default: models/students/support-triage when built)")
    b.add_argument("--skip-decisions", action="store_true", help="only the pass-through rows")
    b.set_defaults(func=_bench)


def _gateway(args: argparse.Namespace) -> int:
    from serving.gateway.rules import Rules

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    try:
        cfg = GatewayConfig.load(flags)
        groups = list(dict.fromkeys(spec.group for spec in cfg.upstreams))
        rules = Rules.load(cfg.route, groups, _positions(cfg)) if cfg.route else Rules.plain(groups)
        _check_student(cfg, rules)
    except ValueError as exc:  # one line and exit 2, as every command answers a bad flag
        print(f"pagoda gateway: error: {exc}", file=sys.stderr)
        return 2
    from serving.gateway.server import GatewayServer

    GatewayServer(cfg, rules).run()
    return 0


def _positions(cfg: GatewayConfig) -> int | None:
    """The routing model's encoder positions from its config alone (None for a student, whose budgets are
    fixed, or where the folder cannot say): a route file's max_len past them is refused before any fork."""
    if cfg.student:
        return None
    from laya.layout import checkpoint_positions
    from laya.paths import default_model_dir

    return checkpoint_positions(cfg.model or default_model_dir())


def _check_student(cfg: GatewayConfig, rules) -> None:
    """A route file's questions and budgets against a student (`--student`), before any fork, from its student.json
    alone: a worker found them wrong only as it loaded, and the gateway exited 3 with the reason in its log."""
    if not cfg.student or not rules.asks:
        return
    from distill.questions import select
    from distill.student_folder import read_meta

    own = read_meta(cfg.student)["questions"]
    fixed = sorted(set(rules.budgets) - {"min_confidence"})
    if fixed:
        raise ValueError(f"route file {cfg.route}: budgets.{fixed[0]}: not taken with --student (a student's budgets "
                         "were fixed when it was distilled); only min_confidence is")
    for ask in rules.asks:
        try:
            select(own, ask.questions)
        except ValueError as exc:
            raise ValueError(f"route file {cfg.route}: {exc}") from None


def _bench(args: argparse.Namespace) -> int:
    from serving.gateway.bench import run_bench

    for flag in ("--requests", "--rounds", "--streams", "--new-tokens"):  # before any server starts
        if (value := getattr(args, flag[2:].replace("-", "_"))) < 1:
            print(f"pagoda bench gateway: error: {flag}: expected 1 or more, got {value}", file=sys.stderr)
            return 2
    if not 0 < args.seconds < math.inf:
        print(f"pagoda bench gateway: error: --seconds: expected a finite number > 0, got {args.seconds}",
              file=sys.stderr)
        return 2
    return run_bench(args, out=sys.stdout)

"""The `pagoda` command line, and serving's own commands: `pagoda serve` and `pagoda bench serve`.

Each package contributes its subcommands through a `register(commands, bench)` function in the modules
listed below, so this file never grows with every feature and `pagoda --help` stays cheap: registering
must not import torch or transformers (handlers import what they need when they run).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from generation.config import DTYPES
from serving.config import ServeConfig
from serving.flags import MAX_TORCH_THREADS

COMMAND_MODULES = (
    "laya.cli",
    "distill.cli",
    "generation.cli",
    "serving.cli",
    "serving.gateway.cli",
    "serving.soak",
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


# The modules only an extra installs (pyproject.toml), and the extra a command that needs one should name.
EXTRAS = {"torch": "laya", "transformers": "laya", "safetensors": "laya", "onnx": "laya", "matplotlib": "laya",
          "datasets": "distill", "sklearn": "distill", "skl2onnx": "distill", "gguf": "generation",
          "llguidance": "generation", "jsonschema": "generation"}


def main(argv: list[str] | None = None) -> int:
    """Runs a command. What a command did not turn into its own one-line error but is still the user's to mend
    (a path that is a file where a folder goes, a folder where a file goes, bytes that are not UTF-8, a value a
    validator refused: `OSError`s and `ValueError`s) prints as one line with exit 2 here rather than as a
    traceback; `PAGODA_TRACEBACK=1` shows the traceback."""
    args = build_parser().parse_args(argv)
    name = " ".join(str(v) for v in (args.command, getattr(args, "bench_target", None)) if v)
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as exc:  # the base install (an edge box: a student, no torch) lacks an extra's
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None or os.environ.get("PAGODA_TRACEBACK"):
            raise
        print(f"pagoda {name}: error: this needs {exc.name}, which this install lacks: "
              f"pip install 'pagoda[{extra}]'", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        if os.environ.get("PAGODA_TRACEBACK"):
            raise
        print(f"pagoda {name}: error: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 2


def register(commands, bench) -> None:
    serve = commands.add_parser("serve", help="serve the HTTP APIs: /decide and friends, and generation "
                                              "(OpenAI /v1/chat/completions, SGLang /generate) on one port",
                                description="Start the server. Every flag also reads PAGODA_<FLAG> from the "
                                            "environment; PAGODA_API_KEY turns on bearer auth.")
    ServeConfig.add_arguments(serve)
    serve.set_defaults(func=_serve)

    b = bench.add_parser("serve", help="closed-loop HTTP clients against pagoda serve: /decide batching on vs "
                                       "off, or (--generate) streaming chat vs transformers and llama.cpp")
    b.add_argument("--generate", action="store_true", help="benchmark the generation API instead of /decide")
    b.add_argument("--model", default=None, help="Laya checkpoint folder (default: the embedded laya-mini)")
    b.add_argument("--student", default=None, help="benchmark a distilled student instead")
    b.add_argument("--concurrency", default=None, help="comma list of client counts (default 1,4,16,32; "
                                                       "1,8,32 with --generate)")
    b.add_argument("--seconds", type=float, default=5.0, help="measured seconds per (mode, concurrency)")
    b.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each measurement")
    b.add_argument("--preset", default="support-triage", help="question preset the clients ask")
    b.add_argument("--max-wait-ms", type=float, default=None, help="batcher wait (default: the server's)")
    b.add_argument("--torch-threads", type=int, default=1,
                   help=f"torch threads in the server, 0-{MAX_TORCH_THREADS} (0: torch default; 1 keeps runs "
                        "comparable on a shared box)")
    b.add_argument("--workers", type=int, default=1,
                   help="worker processes of every pagoda server, each with --torch-threads (laya-serve gets "
                        "workers x torch-threads threads: the same cores)")
    b.add_argument("--precision", default=None,
                   help="comma list of our precisions to serve, each its own server (exact, int8, bf16, fast; "
                        "default: $PAGODA_PRECISION, else exact)")
    b.add_argument("--reference", default=None,
                   help="python of a venv with laya[serve]==0.4.15: its laya-serve is measured on the same checkpoint "
                        "(default: .refvenv's when it has one)")
    b.add_argument("--plot", default=None, help="write a PNG of throughput and latency by concurrency here")
    g = b.add_argument_group("--generate")
    g.add_argument("--generate-model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    g.add_argument("--generate-dtype", default="float32", choices=DTYPES,
                   help="compute dtype of our engine and of transformers (llama.cpp reads the GGUF's own types)")
    g.add_argument("--prefix-tokens", type=int, default=300, help="tokens of the system prompt every request shares")
    g.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request")
    g.add_argument("--hf-rounds", type=int, default=2, help="timed transformers batches per concurrency (0: "
                                                           "transformers is not measured)")
    g.add_argument("--single-rounds", type=int, default=5, help="alternating HTTP / in-process single-stream rounds")
    g.add_argument("--baseline-server", default=None, help="llama.cpp's llama-server binary (make llama-server): "
                                                           "the bench starts it on the same GGUF, one slot per client")
    g.add_argument("--baseline-python", default=None, help="a python with llama-cpp-python[server] (make llamavenv): "
                                                           "the bench starts its server on the same GGUF")
    g.add_argument("--baseline-url", default=None, help="a running OpenAI-compatible server on the same model")
    b.set_defaults(func=_bench)


def _serve(args: argparse.Namespace) -> int:
    from serving.app import checked_config

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    try:
        cfg = checked_config(flags)  # before gunicorn forks
    except ValueError as exc:  # one line and exit 2, as every command answers a bad flag
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 2
    from serving.server import serve

    serve(cfg)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from serving.app import check_serve_argv
    from serving.bench import ServerProcess

    if args.generate:
        from serving.generate.bench import run_bench, server_flags
    else:
        from serving.decide.bench import run_bench, server_flags

    for flag, value in (("--baseline-server", args.baseline_server), ("--baseline-python", args.baseline_python),
                        ("--reference", args.reference)):
        if value and not (os.path.isfile(value) and os.access(value, os.X_OK)):  # before the model loads
            print(f"pagoda bench serve: error: {flag}: {value} is not an executable file", file=sys.stderr)
            return 2
    if not 0 < args.seconds < math.inf or not 0 <= args.warmup < math.inf:  # NaN fails every comparison too
        flag, value = ("--seconds", args.seconds) if not 0 < args.seconds < math.inf else ("--warmup", args.warmup)
        print(f"pagoda bench serve: error: {flag}: expected a finite number of seconds, got {value}", file=sys.stderr)
        return 2
    for flag, value, least in (("--hf-rounds", args.hf_rounds, 0), ("--single-rounds", args.single_rounds, 1)):
        if args.generate and value < least:
            print(f"pagoda bench serve: error: {flag}: expected {least} or more, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.torch_threads <= MAX_TORCH_THREADS:  # --generate sets it here too, where torch would crash
        print(f"pagoda bench serve: error: --torch-threads: expected 0..{MAX_TORCH_THREADS}, got {args.torch_threads}",
              file=sys.stderr)
        return 2
    concurrency = args.concurrency or ("1,8,32" if args.generate else "1,4,16,32")
    try:
        levels = [int(x) for x in concurrency.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:  # one line naming the flag, rc 2, as argparse answers its own checks
        print(f"pagoda bench serve: error: --concurrency: expected a comma list of positive client counts, "
              f"got {concurrency!r}", file=sys.stderr)
        return 2
    for flags in server_flags(args, levels):  # what each server would refuse, before the first (or a model) loads
        check_serve_argv(ServerProcess.argv(flags))  # a ValueError: one line from main, naming this command
    return run_bench(args, levels, out=sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

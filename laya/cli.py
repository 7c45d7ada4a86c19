"""`pagoda decide` and `pagoda bench decide`.

Registering only adds parsers; torch and the model load inside the handlers, so `pagoda --help`
stays fast (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def register(commands: Any, bench: Any) -> None:
    decide = commands.add_parser("decide", help="answer typed questions about a state with a Laya checkpoint")
    decide.add_argument("--model", default=None, help="checkpoint folder (default: the embedded laya-mini)")
    decide.add_argument("--state", required=True, help="the state text, or @FILE (a .json file is read as JSON)")
    decide.add_argument("--questions", required=True, help="questions JSON file ({name: definition})")
    decide.add_argument("--max-len", type=int, default=None, help="token budget of a row (default: checkpoint's)")
    decide.add_argument("--head-max-len", type=int, default=None, help="token budget of the question part")
    decide.add_argument("--min-confidence", type=float, default=None, help="abstain below this answer_confidence")
    decide.add_argument("--device", default="cpu")
    decide.set_defaults(func=_decide)

    b = bench.add_parser("decide", help="p50/p95 latency of predict on the billing scenario")
    b.add_argument("--model", default=None, help="checkpoint folder (default: the embedded laya-mini)")
    b.add_argument("--iters", type=int, default=50, help="timed predict calls after 5 warm-up calls")
    b.add_argument("--device", default="cpu")
    b.add_argument("--reference", default=None,
                   help="python of a venv with the official laya runtime, timed as the baseline (default: .refvenv)")
    b.set_defaults(func=_bench)


def read_state(arg: str) -> Any:
    """`@FILE` reads a file (JSON when it ends in .json, else text without its final newline)."""
    if not arg.startswith("@"):
        return arg
    path = Path(arg[1:])
    if not path.is_file():
        raise FileNotFoundError(f"--state: file not found: {path}")
    text = path.read_text(encoding="utf-8")
    return json.loads(text) if path.suffix == ".json" else text.removesuffix("\n")


def read_questions(arg: str) -> Any:
    path = Path(arg)
    if not path.is_file():
        raise FileNotFoundError(f"--questions: file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--questions: {path} is not valid JSON: {exc}") from exc


def _decide(args: argparse.Namespace) -> int:
    import laya

    try:
        state, questions = read_state(args.state), read_questions(args.questions)
        agent = laya.load(args.model, device=args.device)
        out = agent.predict(state, questions, max_len=args.max_len, head_max_len=args.head_max_len,
                            min_confidence=args.min_confidence)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda decide: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from laya.bench import run

    return run(args.model, iters=args.iters, device=args.device, reference=args.reference)

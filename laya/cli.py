"""laya's commands: `decide`, `bench decide`, `train`, `calibrate`, `laya-mini build`, `laya-mini finetune`,
`laya-mini soup`, `laya-mini eval`.

Registering only adds parsers; torch and the model load inside the handlers, so `pagoda --help`
stays fast (docs/architecture.md). Defaults come from the config dataclasses, so a flag's default
cannot drift from the API's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from laya.checks import MAX_THREADS
from laya.precision import PRECISION_ENV, PRECISIONS, check_device


def register(commands: Any, bench: Any) -> None:
    decide = commands.add_parser("decide", help="answer typed questions about a state with a Laya checkpoint")
    decide.add_argument("--model", default=None, help="checkpoint folder (default: the embedded laya-mini)")
    decide.add_argument("--state", required=True, help="the state text, or @FILE (a .json file is read as JSON); "
                        "@@text for text that starts with @")
    decide.add_argument("--questions", required=True,
                        help="questions JSON ({name: definition}): a file, @FILE, or the JSON itself")
    decide.add_argument("--max-len", type=int, default=None, help="token budget of a row (default: checkpoint's)")
    decide.add_argument("--head-max-len", type=int, default=None, help="token budget of the question part")
    decide.add_argument("--min-confidence", type=float, default=None, help="abstain below this answer_confidence")
    decide.add_argument("--device", default="cpu")
    decide.add_argument("--precision", default=None, choices=PRECISIONS,
                        help=f"exact (default), int8, bf16 or fast (default: ${PRECISION_ENV}, else exact)")
    decide.set_defaults(func=_decide)

    b = bench.add_parser("decide", help="predict latency vs the official runtime and the fp32 GEMM rate; "
                                        "cold start, memory and int8 agreement on request")
    b.add_argument("--model", default=None, help="checkpoint folder (default: the embedded laya-mini)")
    b.add_argument("--iters", type=int, default=20, help="timed predict calls of each runtime after 5 warm-up calls")
    b.add_argument("--device", default="cpu")
    b.add_argument("--precision", default="exact,fast",
                   help="comma list of our precisions to time (exact, int8, bf16, fast)")
    b.add_argument("--threads", type=thread_count, default=1, help="intra-op threads of every runtime (the same for all)")
    b.add_argument("--reference", default=None,
                   help="python of a venv with the official laya runtime, timed as the baseline (default: .refvenv)")
    b.add_argument("--cold", type=int, default=0, metavar="N",
                   help="also time N fresh processes each (ours, official) to their first answer, with peak RSS")
    b.add_argument("--agreement", action="store_true",
                   help="also report fast vs exact on the embedded default over the shipped held-out set")
    b.add_argument("--no-gemm", action="store_true", help="skip the fp32 GEMM-rate probe")
    b.set_defaults(func=_bench)

    t = bench.add_parser("train", help="seconds per training step at fp32 and under bf16 autocast, both laya-mini "
                                       "recipes (from-scratch and finetune), one process")
    t.add_argument("--part", default="scratch,finetune", help="comma list of scratch, finetune")
    t.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    t.add_argument("--steps", type=int, default=30, help="timed steps of 32 per run (after --warmup steps)")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--threads", type=thread_count, default=2)
    t.add_argument("--data", default="../shared/data", help="folder holding clinc150/ and snips/")
    t.add_argument("--model", default=None, help="finetune: checkpoint to start from (default: the embedded laya-mini)")
    t.set_defaults(func=_bench_train)

    _register_train(commands)
    _register_calibrate(commands)
    _register_mini(commands)


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to read") from None


def _file_text(path: Path, flag: str) -> str:
    if str(path) in ("", "."):  # Path("") is ".": "file not found: ." named nothing the user wrote
        raise ValueError(f"{flag}: no file named (give a path, @PATH for --state)")
    if path.is_dir():
        raise IsADirectoryError(f"{flag}: {path} is a folder, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"{flag}: file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: {path} is not UTF-8 text ({exc})") from None


def read_state(arg: str) -> Any:
    """`@FILE` reads a file (JSON when it ends in .json, else text without its final newline); `@@...` is the
    text `@...` itself."""
    if arg.startswith("@@") or not arg.startswith("@"):
        return arg.removeprefix("@") if arg.startswith("@@") else arg
    path = Path(arg[1:])
    text = _file_text(path, "--state")
    return _json(text, f"--state: {path}") if path.suffix == ".json" else text.removesuffix("\n")


def read_questions(arg: str) -> Any:
    """A file, as ever; `@FILE` too, since `--state` reads files that way; or inline JSON (`{...}`, or `[...]`,
    which the questions' check then names) for a one-off question, so a shell line needs no scratch file."""
    path = Path(arg.removeprefix("@"))
    if arg.lstrip().startswith(("{", "[")) and not path.is_file():
        return _json(arg, "--questions")
    return _json(_file_text(path, "--questions"), f"--questions: {path}")


def _decide(args: argparse.Namespace) -> int:
    import laya

    try:
        state, questions = read_state(args.state), read_questions(args.questions)
        if args.model is not None and not Path(args.model).is_dir():  # laya.load names no flag: it is a library's
            raise ValueError(f"--model: {args.model}: no such checkpoint folder")
        agent = laya.load(args.model, device=check_device(args.device), precision=args.precision)
        out = agent.predict(state, questions, max_len=args.max_len, head_max_len=args.head_max_len,
                            min_confidence=args.min_confidence)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda decide: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from laya.bench import run

    precisions = tuple(p.strip() for p in args.precision.split(",") if p.strip())
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        print(f"pagoda bench decide: error: --precision: expected a comma list of {', '.join(PRECISIONS)}, "
              f"got {args.precision!r}", file=sys.stderr)
        return 2
    return run(args.model, iters=args.iters, device=args.device, reference=args.reference, precisions=precisions,
               threads=args.threads, cold=args.cold, agreement=args.agreement, gemm=not args.no_gemm)


def _bench_train(args: argparse.Namespace) -> int:
    from laya.training.bench import PARTS, run
    from laya.training.trainer import TRAIN_PRECISIONS

    parts = tuple(p.strip() for p in args.part.split(",") if p.strip())
    precisions = tuple(p.strip() for p in args.precision.split(",") if p.strip())
    for flag, got, allowed in (("--part", parts, PARTS), ("--precision", precisions, TRAIN_PRECISIONS)):
        if not got or any(g not in allowed for g in got):
            print(f"pagoda bench train: error: {flag}: expected a comma list of {', '.join(allowed)}, got "
                  f"{getattr(args, flag[2:])!r}", file=sys.stderr)
            return 2
    for flag in ("steps", "warmup", "threads"):
        if getattr(args, flag) < 1:
            print(f"pagoda bench train: error: --{flag}: must be >= 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if args.model and not (Path(args.model) / "rl_agent_config.json").is_file():
        print(f"pagoda bench train: error: --model: {args.model} is not a Laya checkpoint folder (no "
              "rl_agent_config.json)", file=sys.stderr)
        return 2
    try:
        return run(parts, precisions, args.steps, args.warmup, args.threads, args.data, args.model)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda bench train: error: {exc}", file=sys.stderr)
        return 2


def _register_train(commands: Any) -> None:
    from laya.training.trainer import TrainConfig

    d = TrainConfig()
    p = commands.add_parser("train", help="fine-tune a Laya checkpoint (or a fresh head on an encoder) on JSONL")
    p.add_argument("--data", required=True, help="JSONL of {state, questions, labels|targets}")
    p.add_argument("--out", required=True, help="output checkpoint folder (official layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--init", help="Laya checkpoint folder to fine-tune")
    src.add_argument("--encoder", help="pretrained transformers encoder folder; a fresh head is added")
    p.add_argument("--eval-data", help="JSONL evaluated every --eval-every steps")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--encoder-lr", type=float, default=d.encoder_lr, help="0 freezes the encoder (default)")
    p.add_argument("--encoder-layers", type=int, help="with --encoder-lr: train only the top N encoder layers")
    p.add_argument("--head-layers", type=int, default=d.head_layers, help="with --encoder: head transformer layers")
    p.add_argument("--spherical", type=float, default=d.loss.spherical, help="weight of the spherical score")
    p.add_argument("--rps", type=float, default=d.loss.rps,
                   help="weight of the ranked probability score (score questions)")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--head-max-len", type=int, default=d.head_max_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--resume", action="store_true",
                   help="continue from the last save in --out, with the settings it was started with")
    p.add_argument("--stop-at", type=int, help="stop after this step (saved), to continue later with --resume")
    p.add_argument("--threads", type=thread_count)
    p.add_argument("--device", default=d.device)
    p.add_argument("--precision", default=d.precision,
                   help="fp32 (default) or bf16: the forward under bf16 autocast (a CPU with AMX or AVX512-BF16, "
                        "or a GPU); weights, gradients and the optimizer stay fp32")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs)")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from laya.training.losses import LossWeights
    from laya.training.trainer import TrainConfig, train

    try:
        out_folders(**{"--out": args.out})
        cfg = TrainConfig(data=args.data, out=args.out, init=args.init, encoder=args.encoder,
                          head_layers=args.head_layers, eval_data=args.eval_data, epochs=args.epochs,
                          max_steps=args.max_steps, batch_size=args.batch_size, lr=args.lr,
                          encoder_lr=args.encoder_lr, encoder_layers=args.encoder_layers,
                          loss=LossWeights(1.0, args.spherical, args.rps), max_len=args.max_len,
                          head_max_len=args.head_max_len, seed=args.seed, eval_every=args.eval_every,
                          save_every=args.save_every, resume=args.resume, stop_at=args.stop_at,
                          threads=args.threads, device=args.device, precision=args.precision)
        summary = train(cfg, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return 0


def _register_calibrate(commands: Any) -> None:
    p = commands.add_parser("calibrate", help="fit temperatures on held-out decisions; report ECE/Brier/NLL")
    p.add_argument("--model", required=True, help="Laya checkpoint folder")
    p.add_argument("--data", required=True, help="held-out JSONL of {state, questions, labels|targets}")
    p.add_argument("--out", help="write the calibrated checkpoint here (default: update --model in place)")
    p.add_argument("--report", help="folder for calibration.md, calibration.json and reliability.png")
    p.add_argument("--min-bucket", type=int, default=10, help="questions needed for a per-bucket temperature")
    p.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from laya.training.calibrate import calibrate

    try:
        out_folders(**{"--out": args.out, "--report": args.report})
        fit, ev = calibrate(args.model, args.data, args.out, args.report, args.min_bucket)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda calibrate: error: {exc}", file=sys.stderr)
        return 2
    a = ev["all"]
    print(json.dumps({"temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options,
                      "ece15_before": a["before"]["ece15"], "ece15_after": a["after"]["ece15"],
                      "nll_before": a["before"]["nll"], "nll_after": a["after"]["nll"]}, indent=2))
    return 0


def _register_mini(commands: Any) -> None:
    p = commands.add_parser("laya-mini", help="the embedded default decision model (docs/laya-mini.md)")
    sub = p.add_subparsers(dest="mini_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="assemble laya-mini from the installed encoder and the shipped head "
                                     "(skips when built), or retrain the head with --from-scratch")
    b.add_argument("--out", help="checkpoint folder (default: the embedded default's location, or $PAGODA_LAYA_MINI)")
    b.add_argument("--from-scratch", action="store_true", help="retrain the head instead of using the shipped one")
    b.add_argument("--force", action="store_true", help="rebuild even if the checkpoint exists")
    b.add_argument("--work", default="runs/laya-mini", help="scratch folder for --from-scratch")
    b.add_argument("--head-dir", help="where the trained head is read/written (default: the package's)")
    b.add_argument("--figures", help="where --from-scratch writes reliability PNGs (default: --work)")
    b.add_argument("--threads", type=thread_count)
    b.add_argument("--device", default="cpu")
    b.add_argument("--precision", default="fp32", help="--from-scratch: fp32 (default) or bf16 autocast training")
    b.add_argument("--spec", help="JSON overrides of MiniSpec fields")
    b.add_argument("--no-assemble", action="store_true", help="--from-scratch: stop after writing the head folder")
    b.set_defaults(func=_mini_build)

    f = sub.add_parser("finetune", help="fine-tune a laya-mini checkpoint on real intents + the corpus with the "
                                        "cosine-teacher KL, then refit temperatures (how the shipped head was made)")
    f.add_argument("--init", help="checkpoint folder to start from (the shipped head: models/laya-mini)")
    f.add_argument("--out", help="folder for the fine-tuned checkpoint")
    f.add_argument("--steps", default="200", help="training steps of 32 (default 200; 0: only refit the "
                                                  "temperatures of --init)")
    f.add_argument("--data", default="../shared/data", help="folder holding clinc150/ and snips/")
    f.add_argument("--threads", default=None, help="torch threads (default: torch's)")
    f.add_argument("--precision", default="fp32",
                   help="fp32 (default) or bf16: train under bf16 autocast (a CPU with AMX or AVX512-BF16)")
    f.add_argument("--seed", default=None, help="seed of the corpus, the intent draws and the batches (default 0)")
    f.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="instead of --seed: one run per seed into OUT/members/seed-S, their weights averaged into "
                        "OUT (a model soup) and the temperatures fitted on their calib rows pooled")
    f.add_argument("--mix", default=None, metavar="SOURCE=W,...",
                   help="batches drawn per source, e.g. intents=0.5,tickets=0.35,reviews=0.075,dialogs=0.075 (the "
                        "default); handwritten=W adds the hand-written training tickets with their gold")
    f.add_argument("--train-tickets", nargs="+", default=None, metavar="FILE",
                   help="the hand-written training tickets handwritten=W draws, one or more JSONL files with gold "
                        "(default: datasets/handwritten_tickets_train.jsonl); FILE=department,churn_risk asks only "
                        "those of the support-triage questions of that file's tickets")
    f.add_argument("--encoder-layers", default="3", metavar="N",
                   help="top encoder layers that train (default 3; 6: all of laya-mini's; more than the "
                        "encoder has: all)")
    f.add_argument("--corpus-layers", default=None, metavar="N",
                   help="of the layers that train, the top N that the synthetic sources (tickets, reviews, dialogs) "
                        "train too; the ones below learn from intent batches only (default: all that train)")
    f.add_argument("--label-smoothing", default="0", metavar="E",
                   help="mix the targets of every source but the intents (the synthetic ones and the hand-written "
                        "tickets) with E of uniform over each row's options, so easy generated tickets do not teach a "
                        "confidence natural text does not earn (default 0)")
    f.add_argument("--kl-weight", default="1.0", metavar="W",
                   help="weight of the cosine-teacher KL on intent choices (default 1.0)")
    f.add_argument("--opaque-options", default="0", metavar="P",
                   help="share of the intent and generated-ticket choices whose options are named by codes (\"queue "
                        "A\", \"T-314\") with the meaning in their descriptions only, so the head learns to read "
                        "descriptions (default 0)")
    f.add_argument("--no-calib-tickets", action="store_true",
                   help="fit the temperatures without datasets/handwritten_tickets_calib.jsonl (the default "
                        "--calib-sources less handwritten)")
    f.add_argument("--calib-sources", default=None, metavar="SOURCE,...",
                   help="fit the temperatures on these sources' calib rows only, of tickets, reviews, dialogs "
                        "(the synthetic split), intents, handwritten (default: all)")
    f.add_argument("--head-dir", default="", help="also write the committed head here (laya/training/mini_head "
                                                  "replaces the shipped one; `make model` then assembles it)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar (logs)")
    f.set_defaults(func=_mini_finetune)

    s = sub.add_parser("soup", help="average finished laya-mini checkpoints (e.g. two fine-tunes of one parent) "
                                    "and refit the temperatures on their calib rows pooled (how round 6 was made)")
    s.add_argument("--members", nargs="+", required=True, metavar="DIR",
                   help="two or more checkpoint folders from one parent; the first's config and tokenizer are kept")
    s.add_argument("--out", required=True, help="folder for the averaged checkpoint")
    s.add_argument("--head-dir", default="", help="also write the committed head here (laya/training/mini_head "
                                                  "replaces the shipped one; `make model` then assembles it)")
    s.set_defaults(func=_mini_soup)

    e = sub.add_parser("eval", help="held-out-label intent accuracy vs the MiniLM cosine baseline (same run), "
                                    "hand-written tickets, the issue-15 acceptance sentences; JSON + PNG")
    e.add_argument("--model", default=None, help="checkpoint folder (default: the embedded laya-mini)")
    e.add_argument("--data", default="../shared/data", help="folder holding clinc150/ and snips/")
    e.add_argument("--tickets", default=None, help="hand-written tickets JSONL (default: datasets/handwritten_tickets.jsonl)")
    e.add_argument("--blind-tickets", default=None,
                   help="a second ticket file no choice has read (datasets/handwritten_tickets_blind.jsonl), "
                        "reported beside --tickets and pooled with it; only when given, so that judging runs "
                        "does not spend it (judge runs with --tickets datasets/handwritten_tickets_dev.jsonl)")
    e.add_argument("--n", type=int, default=300, help="utterances per held-out intent set")
    e.add_argument("--out", default="runs/laya-mini-eval", help="folder for eval.json and eval.png")
    e.add_argument("--threads", type=thread_count, default=1)
    e.set_defaults(func=_mini_eval)


def _mini_build(args: argparse.Namespace) -> int:
    import time

    from laya.training import mini

    head_dir = Path(args.head_dir) if args.head_dir else mini.HEAD_DIR
    out = Path(args.out) if args.out else mini.default_model_dir()
    if mini.is_built(out, head_dir) and not args.force and not args.from_scratch:
        print(f"laya-mini is built at {out} (use --force to rebuild)")
        return 0
    t = time.time()
    try:
        out_folders(**{"--out": args.out, "--head-dir": args.head_dir, "--work": args.work, "--figures": args.figures})
        if args.from_scratch:
            spec = _mini_spec(args.spec, mini.MiniSpec)
            work = Path(args.work)
            report = mini.build_from_scratch(spec, work, out, head_dir, Path(args.figures or work),
                                             args.threads, args.device, not args.no_assemble, args.precision)
            a = report["test"]["all"]["after"]
            print(f"laya-mini built from scratch in {report['times_s']['total']:.0f}s: test accuracy "
                  f"{a['accuracy']:.3f}, ECE15 {a['ece15']:.3f} -> {out}")
        else:
            mini.assemble(out, head_dir)
            print(f"laya-mini assembled in {time.time() - t:.1f}s from the installed encoder and {head_dir} -> {out}")
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda laya-mini build: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _mini_spec(text: str | None, cls: Any) -> Any:
    """`--spec`: a JSON object of `MiniSpec` fields; anything else is one line naming the flag."""
    if not text:
        return cls()
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--spec: not valid JSON: {exc}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--spec: expected a JSON object of MiniSpec fields, got {type(overrides).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"--spec: {unknown[0]!r} is not a MiniSpec field (known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _spec_value(name, value, hints[name]) for name, value in overrides.items()})


def _spec_value(name: str, value: Any, want: Any) -> Any:
    """`value` once it has its field's declared type (an integer does where a float goes: JSON writes 3.0 as 3);
    a string where a number goes used to pass and end the build in a TypeError traceback once training began."""
    origin, args = typing.get_origin(want) or want, typing.get_args(want)

    def fits(v: Any, t: Any) -> bool:
        return type(v) is t or (t is float and type(v) is int)

    if origin is dict:
        ok = isinstance(value, dict) and all(fits(k, args[0]) and fits(v, args[1]) for k, v in value.items())
    else:
        ok = fits(value, origin)
    if not ok:
        raise ValueError(f"--spec: {name}: expected {want if args else want.__name__}, got {value!r}")
    return float(value) if origin is float else value


def out_folders(**flags: str | None) -> None:
    """Output folders checked before any work: one given as a path to an existing file used to fail only when
    the first thing was written there, at the end of a run."""
    for flag, path in flags.items():
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"{flag}: {path} is a file; give a folder to write into")


def positive_int(value: str) -> int:
    """argparse's type for a count (torch refuses 0 threads and less with a traceback)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def thread_count(value: str) -> int:
    """argparse's type for every --threads: torch segfaults or hangs on absurd counts (`laya.checks.MAX_THREADS`)
    instead of refusing them."""
    n = positive_int(value)
    if n > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {n}")
    return n


def _int_flag(flag: str, value: str | None) -> int | None:
    """Integers parsed here, not by argparse, so a bad value is one line naming the flag (argparse prints usage)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag}: expected an integer, got {value!r}") from None


def _float_flag(flag: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{flag}: expected a number, got {value!r}") from None


def _mix_flag(value: str | None) -> dict[str, float] | None:
    if value is None:
        return None
    mix = {}
    for part in value.split(","):
        name, _, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"--mix: expected SOURCE=WEIGHT,..., got {value!r}") from None
    return mix


def _calib_sources_flag(value: str | None, no_calib_tickets: bool) -> list[str] | None:
    from laya.training.finetune import CALIB_SOURCES

    sources = [x.strip() for x in value.split(",")] if value is not None else None
    if no_calib_tickets:
        sources = [x for x in (sources or CALIB_SOURCES) if x != "handwritten"]
    return sources


def _mini_finetune(args: argparse.Namespace) -> int:
    from laya.training.finetune import MIX, FinetuneConfig, finetune
    from laya.training.soup import soup

    try:
        out_folders(**{"--out": args.out, "--head-dir": args.head_dir})
        if args.seed is not None and args.seeds is not None:
            raise ValueError("--seeds: give it or --seed, not both")
        seeds = None if args.seeds is None else [_int_flag("--seeds", x.strip()) for x in args.seeds.split(",")]
        cfg = FinetuneConfig(init=args.init or "", out=args.out or "", data=args.data,
                             steps=_int_flag("--steps", args.steps), seed=_int_flag("--seed", args.seed or "0"),
                             threads=_int_flag("--threads", args.threads), head_dir=args.head_dir,
                             mix=_mix_flag(args.mix) or dict(MIX),
                             precision=args.precision, encoder_layers=_int_flag("--encoder-layers", args.encoder_layers),
                             kl_weight=_float_flag("--kl-weight", args.kl_weight),
                             opaque_options=_float_flag("--opaque-options", args.opaque_options),
                             corpus_layers=_int_flag("--corpus-layers", args.corpus_layers),
                             label_smoothing=_float_flag("--label-smoothing", args.label_smoothing),
                             calib_sources=_calib_sources_flag(args.calib_sources, args.no_calib_tickets),
                             train_tickets=args.train_tickets)
        progress = not args.no_progress
        summary = soup(cfg, seeds, progress=progress) if seeds is not None else finetune(cfg, progress=progress)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda laya-mini finetune: error: {exc}", file=sys.stderr)
        return 2
    t = summary["times_s"]
    what = f"fine-tuned {summary['steps']} steps" if summary["steps"] else "temperatures refitted (0 steps)"
    if seeds is not None:
        what += f" per seed {seeds}, averaged"
    print(f"laya-mini {what} ({summary['threads']} threads) in {t['train']:.0f}s "
          f"(total {t['total']:.0f}s), calib ECE15 {summary['calib']['ece15_before']:.3f} -> "
          f"{summary['calib']['ece15_after']:.3f} -> {cfg.out}")
    return 0


def _mini_soup(args: argparse.Namespace) -> int:
    from laya.training.soup import soup_checkpoints

    try:
        out_folders(**{"--out": args.out, "--head-dir": args.head_dir})
        summary = soup_checkpoints([Path(m) for m in args.members], Path(args.out), args.head_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda laya-mini soup: error: {exc}", file=sys.stderr)
        return 2
    print(f"laya-mini soup of {len(summary['members'])} checkpoints in {summary['times_s']['total']:.0f}s, calib ECE15 "
          f"{summary['calib']['ece15_before']:.3f} -> {summary['calib']['ece15_after']:.3f} -> {args.out}")
    return 0


def _mini_eval(args: argparse.Namespace) -> int:
    from laya.training import mini_eval

    if args.n < 1:
        print(f"pagoda laya-mini eval: error: --n must be a positive integer, got {args.n}", file=sys.stderr)
        return 2
    try:
        out_folders(**{"--out": args.out})
        report = mini_eval.evaluate(args.model, Path(args.data), args.tickets, args.n, args.threads,
                                    Path(args.blind_tickets) if args.blind_tickets else None)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagoda laya-mini eval: error: {exc}", file=sys.stderr)
        return 2
    js, png = mini_eval.write(report, Path(args.out))
    print(mini_eval.summary(report))
    print(f"wrote {js} and {png}")
    return 0

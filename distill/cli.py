"""`pagoda distill` and `pagoda bench distill`.

Registering only adds parsers; torch, datasets and onnxruntime load inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


def register(commands: Any, bench: Any) -> None:
    p = commands.add_parser("distill", help="distil a Laya teacher into a small ONNX student for a task file",
                            description="label -> train -> calibrate -> export -> report; rerun the same "
                                        "command to resume after an interruption.")
    p.add_argument("--teacher", required=True, help="Laya checkpoint folder, or 'default' for the embedded laya-mini")
    p.add_argument("--task", required=True, help="task YAML (questions, text field, budgets, student kind and size)")
    p.add_argument("--data", required=True, help="corpus: .jsonl, .json, .csv or .parquet with the task's text field")
    p.add_argument("--out", required=True, help="student folder to write (also holds labels and work files)")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="label only shard I of N (chunks c with c %% N == I) and stop; merge labels/ folders, rerun")
    p.add_argument("--restart-from", default=None, choices=("label", "train", "calibrate", "export", "report"),
                   help="discard this stage's output and everything after it, then run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs)")
    p.add_argument("--eval-data", action="append", default=[], metavar="NAME=PATH",
                   help="also report agreement with the teacher on this file (the task's text field; never "
                        "trained on), e.g. handwritten=datasets/handwritten_tickets.jsonl; repeatable")
    p.add_argument("--eval-gold", action="append", default=[], metavar="QUESTION=COLUMN",
                   help="the --eval-data files' gold column for QUESTION where it is not the task's `gold` "
                        "column, e.g. department=department5; repeatable")
    p.set_defaults(func=_distill)

    b = bench.add_parser("distill", help="per-state latency of a student (int8, fp32, linear baseline) vs its teacher")
    b.add_argument("--student", required=True, help="student folder written by `pagoda distill`")
    b.add_argument("--teacher", default=None,
                   help="Laya checkpoint to time as the baseline ('default': laya-mini; 'none': no teacher, the "
                        "first student row is the baseline; omitted: the student's recorded teacher if it exists)")
    b.add_argument("--data", default=None, help="states to time (.jsonl with the task's text field); default: "
                                                "64 synthetic support tickets")
    b.add_argument("--singles", type=int, default=200, help="timed batch-1 calls per configuration")
    b.add_argument("--defer-below", default=None, metavar="T",
                   help="also time the int8 student with its answers under T (a number or QUESTION=NUMBER,...) "
                        "deferred to the teacher, and print its agreement with the teacher and the share deferred "
                        "on --data (docs/distill.md, deferring)")
    b.add_argument("--defer-to", default=None, metavar="URL",
                   help="with --defer-below: the deferred answers come from this Laya server's "
                        "/v1/systemone/batch (pagoda serve or laya-serve) instead of the teacher loaded here, which "
                        "stays the baseline and runs the same deferral first; the server's key, if any, from "
                        "$PAGODA_DEFER_API_KEY")
    b.add_argument("--defer-model", default=None, metavar="NAME",
                   help="with --defer-to: the checkpoint a laya-serve answers with")
    b.set_defaults(func=_bench)


def _distill(args: argparse.Namespace) -> int:
    from distill.export import ExportCheckError
    from distill.pipeline import distill

    try:
        eval_data = {}
        for item in args.eval_data:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--eval-data: expected NAME=PATH, got {item!r}")
            eval_data[name] = Path(path)
        eval_gold = {}
        for item in args.eval_gold:
            question, sep, column = item.partition("=")
            if not sep or not question or not column:
                raise ValueError(f"--eval-gold: expected QUESTION=COLUMN, got {item!r}")
            eval_gold[question] = column
        out = distill(args.task, args.teacher, args.data, args.out, shard=args.shard, restart_from=args.restart_from,
                      progress=not args.no_progress, eval_data=eval_data, eval_gold=eval_gold)
    except (ValueError, FileNotFoundError) as exc:  # a bad task, data file, teacher or mismatched labels
        print(f"pagoda distill: error: {exc}", file=sys.stderr)
        return 2
    except ExportCheckError as exc:  # an export past its tolerance: the stages before it are kept
        print(f"pagoda distill: error: {exc}; earlier stages are kept, rerun with --restart-from to retry",
              file=sys.stderr)
        return 1
    return 0 if out is not None or args.shard else 1


def _states(args: argparse.Namespace, text_field: str) -> list[str]:
    if args.data:
        from laya.rows import state_text

        with open(args.data, encoding="utf-8") as f:
            return [state_text(json.loads(line)[text_field]) for line in f if line.strip()][:256]
    from laya.corpus import tickets

    return [t["text"] for t in tickets.generate(64, seed=7)]


def _bench(args: argparse.Namespace) -> int:
    from distill.latency import student_latency, teacher_latency
    from distill.runtime import Student

    if args.singles < 1:
        print(f"pagoda bench distill: error: --singles: expected a positive integer, got {args.singles}",
              file=sys.stderr)
        return 2
    if args.teacher not in (None, "none", "default") and not (Path(args.teacher) / "rl_agent_config.json").is_file():
        # named, it must be timed: a silently missing baseline row reads as a run without one
        print(f"pagoda bench distill: error: --teacher: {args.teacher} is not a Laya checkpoint folder "
              "(no rl_agent_config.json)", file=sys.stderr)
        return 2
    path = Path(args.student)
    student = Student(path)
    if args.defer_to is not None and args.defer_below is None:
        print("pagoda bench distill: error: --defer-to needs --defer-below", file=sys.stderr)
        return 2
    if args.defer_below is not None:
        from distill.deferral import parse_below
        from distill.remote_teacher import RemoteTeacher

        try:
            parse_below(args.defer_below, student.questions, "--defer-below")
            if args.defer_to is not None:
                RemoteTeacher(args.defer_to, field="--defer-to")
        except ValueError as exc:
            print(f"pagoda bench distill: error: {exc}", file=sys.stderr)
            return 2
    states = _states(args, "text")
    cores = os.cpu_count() or 1
    rows: dict[str, dict[str, dict[str, float]]] = {}
    precisions = list(student.meta["models"])
    for precision in precisions:
        rows[f"{student.kind} {precision}"] = {
            "1 thread": student_latency(path, 1, precision, states, singles=args.singles),
            f"{cores} threads": student_latency(path, cores, precision, states, singles=args.singles)}
    baseline = path / "baseline-linear"
    if (baseline / "student.json").is_file():
        rows["linear"] = {"1 thread": student_latency(baseline, 1, None, states, singles=args.singles),
                          f"{cores} threads": student_latency(baseline, cores, None, states, singles=args.singles)}
    teacher = args.teacher or student.meta["provenance"].get("teacher")
    if teacher and teacher != "none" and (teacher == "default" or (Path(teacher) / "rl_agent_config.json").is_file()):
        source = None if teacher == "default" else teacher
        budgets = student.teacher_budgets
        rows["teacher"] = {"1 thread": teacher_latency(source, student.questions, 1, states, budgets,
                                                       singles=max(10, args.singles // 10), batches=2),
                           f"{cores} threads": teacher_latency(source, student.questions, cores, states, budgets,
                                                               singles=max(10, args.singles // 10), batches=2)}
    fidelity = None
    if args.defer_below is not None:
        if "teacher" not in rows:
            print("pagoda bench distill: error: --defer-below needs a teacher (--teacher, or the student's "
                  "recorded one)", file=sys.stderr)
            return 2
        from distill.latency import deferral_latency
        from distill.remote_teacher import TeacherUnavailable

        # With --defer-to, the same deferral in this process runs first: the pair shows what the network costs.
        fidelity = {}
        for name, remote in [("int8 deferred", None)] + ([("int8 remote", args.defer_to)] if args.defer_to else []):
            rows[name] = {}
            for tname, n in (("1 thread", 1), (f"{cores} threads", cores)):
                try:
                    rows[name][tname], fidelity[name] = deferral_latency(path, source, args.defer_below, n, states,
                                                                         remote=remote, singles=args.singles,
                                                                         api_key=os.environ.get("PAGODA_DEFER_API_KEY"),
                                                                         model=args.defer_model)
                except TeacherUnavailable as exc:
                    print(f"pagoda bench distill: error: --defer-to {remote}: {exc}", file=sys.stderr)
                    return 1
    base_name = "teacher" if "teacher" in rows else next(iter(rows))
    print(f"states: {len(states)}; ms per state; x = baseline ({base_name}) time / this time, same process, "
          "same thread count (shared machine: absolute numbers are noisy, ratios less so); cpu = process CPU "
          "ms per batch-1 call")
    print(f"{'model':<14} {'threads':<10} {'b1 p50':>8} {'b1 p99':>8} {'b1 cpu':>8} {'b32 p50':>8} {'x b1':>7} "
          f"{'x cpu':>7} {'x b32':>7}")
    for name, by_threads in rows.items():
        for tname, lat in by_threads.items():
            base = rows[base_name][tname]
            print(f"{name:<14} {tname:<10} {lat['b1_p50']:8.2f} {lat['b1_p99']:8.2f} {lat['b1_cpu_p50']:8.2f} "
                  f"{lat['b32_p50']:8.2f} {base['b1_p50'] / lat['b1_p50']:6.1f}x "
                  f"{base['b1_cpu_p50'] / lat['b1_cpu_p50']:6.1f}x {base['b32_p50'] / lat['b32_p50']:6.1f}x")
    for name, by_question in (fidelity or {}).items():
        by = "the teacher here" if name == "int8 deferred" else f"the server at {args.defer_to}"
        print(f"{name}: the int8 student, its answers under {args.defer_below} given by {by}; per "
              "question: agreement with the teacher / share of answers the teacher gave, on these states")
        for q, f in by_question.items():
            print(f"  {q:<14} {f['agreement']:.3f} / {f['deferred']:.2f}")
    return 0

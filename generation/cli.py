"""`pagoda generate` and `pagoda bench generate`. Registering imports nothing heavy; handlers do."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from generation.config import CACHE_BACKENDS, DTYPES, MAX_TORCH_THREADS, device_problem
from generation.lang import bench as lang_bench


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache-backend", default="radix", choices=list(CACHE_BACKENDS),
                   help="radix tree (SGLang-style), hashed blocks (vLLM-style automatic prefix caching), or none")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=None, help=f"torch CPU threads (1-{MAX_TORCH_THREADS})")


def register(commands, bench) -> None:
    p = commands.add_parser("generate", help="generate text with the bundled engine; --repeat shows prefix caching pay off")
    p.add_argument("-p", "--prompt", required=True, help="prompt text (a chat turn unless --raw)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as-is, without the chat template")
    p.add_argument("--repeat", type=int, default=1, help="run the same prompt N times (later runs hit the cache)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    _engine_args(p)
    p.set_defaults(func=_generate)

    b = bench.add_parser("generate", help="engine vs transformers generate: shared prefix, single stream, warm TTFT")
    _engine_args(b)
    b.add_argument("--requests", type=int, default=32)
    b.add_argument("--prefix-tokens", type=int, default=300)
    b.add_argument("--new-tokens", type=int, default=32)
    b.add_argument("--decode-tokens", type=int, default=128)
    b.add_argument("--ttft-tokens", type=int, default=1000)
    b.add_argument("--parts", default="abc", help="subset of a (shared prefix), b (single stream), c (warm TTFT), "
                   "d (per-step logit_bias and min_new_tokens vs plain decode), e (a short request behind a long "
                   "prefill, the scheduler's waiting share vs none); d and e are not in the default")
    b.add_argument("--plot", default=None, help="write a PNG bar chart of the ratios to this path")
    b.set_defaults(func=_bench)

    c = bench.add_parser("constraints", help="grammar engines on SmolLM2's vocabulary; constrained vs free decoding")
    c.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--part", default="all", choices=["engines", "decode", "all"])
    c.add_argument("--engines", default="xgrammar,llguidance,outlines-core", help="candidates to compare (installed ones)")
    c.add_argument("--steps", type=int, default=200, help="mask steps per schema at batch 1 (a quarter at batch 32)")
    c.add_argument("--new-tokens", type=int, default=32)
    c.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch size (the best counts)")
    c.add_argument("--threads", type=int, default=1, help=f"torch threads (1-{MAX_TORCH_THREADS})")
    c.add_argument("--json", default=None, help="also write the results to this file")
    c.set_defaults(func=_bench_constraints)

    lang_bench.register(bench)


class UsageError(ValueError):
    """A bad flag: the command prints one line naming it and exits 2, as argparse does for its own checks."""


def _fail(command: str, exc: Exception) -> int:
    print(f"pagoda {command}: error: {exc}", file=sys.stderr)
    return 2


def _check_model(model: str | None) -> None:
    """Before anything loads: a missing path is the operator's typo, not a traceback from a loader."""
    if model is not None and not Path(model).exists():
        raise UsageError(f"--model: {model}: no such model folder or .gguf file")


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be a positive integer, got {value}")


def _check_threads(args: argparse.Namespace) -> None:
    """Torch takes any count and then segfaults or hangs starting its pool: refused before it is set."""
    if args.threads is not None and args.threads > MAX_TORCH_THREADS:
        raise UsageError(f"--threads: must be at most {MAX_TORCH_THREADS}, got {args.threads}")


def _flag_error(exc: Exception) -> UsageError:
    """An engine setting refused by name (`SamplingParams.top_p: ...`) said as the flag that set it."""
    field = getattr(exc, "field", None)
    if field is None:
        return UsageError(str(exc))
    detail = str(exc).split(": ", 1)[-1]
    return UsageError(f"--{field.replace('_', '-')}: {detail}")


def _generate(args: argparse.Namespace) -> int:
    from generation.config import EngineConfig, SamplingParams

    try:
        _check_positive(args, "repeat", "threads")
        _check_threads(args)
        _check_model(args.model)
        try:
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=args.seed)
            config = EngineConfig(model=args.model, cache_backend=args.cache_backend, device=args.device,
                                  dtype=args.dtype, num_threads=args.threads)
        except ValueError as exc:
            raise _flag_error(exc) from None
        from generation.engine import Engine

        engine = Engine(config)
    except (ValueError, FileNotFoundError) as exc:   # also a model folder the loader cannot read
        return _fail("generate", exc)
    prompt = args.prompt if args.raw else engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    for run in range(1, args.repeat + 1):
        start = time.perf_counter()
        first = None
        if args.stream:
            for event in engine.stream(prompt, params):
                first = first or time.perf_counter()
                cached = event.cached_tokens
                sys.stdout.write(event.text)
                sys.stdout.flush()
            print()
        else:
            (out,) = engine.generate(prompt, params)
            cached = out.cached_tokens
            print(out.text)
        secs = time.perf_counter() - start
        st = engine.stats()
        ttft = f", first token {1000 * (first - start):.0f} ms" if first else ""
        print(f"[run {run}/{args.repeat}] {secs * 1000:.0f} ms{ttft}; cached prompt tokens {cached}; "
              f"compute_saved_tokens {st['compute_saved_tokens']}, prefill_skip_ratio {st['prefill_skip_ratio']:.2f}, "
              f"kv_utilization {st['kv_utilization']:.3f}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    try:
        _check_positive(args, "requests", "prefix_tokens", "new_tokens", "decode_tokens", "ttft_tokens", "threads")
        _check_threads(args)
        if not args.parts or set(args.parts) - set("abcde"):
            raise UsageError(f"--parts: a subset of 'abcde' (a shared prefix, b single stream, c warm TTFT, "
                             f"d per-step processors, e a short request behind a long prefill), got {args.parts!r}")
        _check_model(args.model)
        if problem := device_problem(args.device):  # before the model loads, not after
            raise UsageError(f"--device: {problem}")
    except UsageError as exc:
        return _fail("bench generate", exc)
    from generation.bench import plot, run

    results = run(args.model, requests=args.requests, prefix_tokens=args.prefix_tokens, new_tokens=args.new_tokens,
                  decode_tokens=args.decode_tokens, ttft_tokens=args.ttft_tokens, threads=args.threads,
                  dtype=args.dtype, parts=args.parts, device=args.device)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _bench_constraints(args: argparse.Namespace) -> int:
    import json

    try:
        _check_positive(args, "steps", "new_tokens", "rounds", "threads")
        _check_threads(args)
        _check_model(args.model)
        from generation.bench_constraints import CANDIDATES, compare_engines, run_decode

        unknown = [n for n in args.engines.split(",") if n not in CANDIDATES]
        if unknown:
            raise UsageError(f"--engines: {unknown[0]!r} is not one of {', '.join(CANDIDATES)}")
        if args.json and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):  # not after the run
            raise UsageError(f"--json: {args.json} is a folder or in no folder; give a file path to write")
    except UsageError as exc:
        return _fail("bench constraints", exc)

    results = {}
    if args.part in ("engines", "all"):
        results["engines"] = compare_engines(args.engines.split(","), steps=args.steps, threads=args.threads,
                                             model=args.model)
    if args.part in ("decode", "all"):
        results["decode"] = run_decode(args.model, new_tokens=args.new_tokens, rounds=args.rounds, threads=args.threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0

"""`pagoda bench train`: what a training step costs at fp32 and under bf16 autocast, measured in one process.

Both of laya-mini's recipes are timed, because their steps differ: `scratch` is `make model-scratch`'s loop
(`laya.training.trainer.train`: the top five encoder layers and the scorer trained on the corpus plus the
intent decisions) and `finetune` is `pagoda laya-mini finetune`'s (the top three layers, mixed sources,
the cosine-teacher KL). Each precision runs the same recipe on the same data and seed, so the batches are
identical and the ratio is the precision's alone. The precisions run one after the other per recipe, in the
order given (fp32 first by default), each after its own untimed warm-up run of a few steps (oneDNN builds
its kernels on first use of a shape).

What the numbers are for: the issue asks whether bf16 autocast cuts CPU build time where the CPU has bf16
units (AMX, AVX512-BF16). The loss after the timed steps is printed beside the time, so a precision that is
fast but learns differently shows it; the shipped head is always trained at fp32 unless a build says so.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from laya.checks import check_threads
from laya.precision import detect

PARTS = ("scratch", "finetune")


def _scratch_data(work: Path, steps: int, batch: int, data: str) -> Path:
    """A train file for `steps` batches of the from-scratch recipe, in its proportions: the corpus
    generators scaled down to what the timed steps read, plus the intent decisions when `data` has them."""
    from laya.corpus.build import CorpusConfig, build, write
    from laya.training.mini import MiniSpec, add_intents

    spec = MiniSpec()
    need = (steps + 1) * batch
    total = spec.corpus["tickets_train"] + spec.corpus["reviews_train"] + (spec.intents_train if data else 0)
    scale = min(1.0, 1.5 * need / total)
    corpus = {k: max(20, math.ceil(v * scale)) for k, v in spec.corpus.items()}
    ccfg = CorpusConfig(seed=spec.seed, **corpus)
    paths = write(build(ccfg), work / "data", ccfg)
    if data and Path(data, "clinc150").is_dir():
        spec = MiniSpec(data=data, intents_train=max(20, math.ceil(spec.intents_train * scale)), intents_calib=0)
        paths = add_intents(spec, paths, work / "data")
    return paths["train"]


def _time_scratch(train_file: Path, out: Path, steps: int, warmup: int, precision: str, threads: int) -> dict:
    from laya.training.mini import MiniSpec, minilm_dir
    from laya.training.trainer import TrainConfig, train

    spec = MiniSpec()
    common = dict(data=str(train_file), encoder=str(minilm_dir()), head_layers=spec.head_layers,
                  batch_size=spec.batch_size, lr=spec.lr, encoder_lr=spec.encoder_lr,
                  encoder_layers=spec.encoder_layers, max_len=spec.max_len, head_max_len=spec.head_max_len,
                  seed=spec.seed, save_every=10**9, threads=threads, precision=precision)
    # The warm-up is its own short run (same first batches), so the timed run's clock starts warm.
    train(TrainConfig(out=str(out / "warm"), max_steps=warmup, **common), progress=False)
    summary = train(TrainConfig(out=str(out / "timed"), max_steps=steps, **common), progress=False)
    # `seconds` includes the one checkpoint save at the end, as in every build.
    return {"seconds": summary["seconds"], "final_loss": summary["final_loss"]}


def _time_finetune(init: str, out: Path, steps: int, warmup: int, precision: str, threads: int, data: str) -> dict:
    from laya.training.finetune import CALIB_SOURCES, FinetuneConfig, finetune

    common = dict(init=init, data=data, threads=threads, precision=precision, intents_calib=0,
                  calib_sources=[s for s in CALIB_SOURCES if s != "handwritten"])
    finetune(FinetuneConfig(out=str(out / "warm"), steps=warmup, **common), progress=False)
    summary = finetune(FinetuneConfig(out=str(out / "timed"), steps=steps, **common), progress=False)
    return {"seconds": summary["times_s"]["train"], "final_loss": summary["final_loss"]}


def run(parts: tuple[str, ...] = PARTS, precisions: tuple[str, ...] = ("fp32", "bf16"), steps: int = 30,
        warmup: int = 3, threads: int = 2, data: str = "../shared/data", model: str | None = None) -> int:
    """Print seconds per step and the ratio to fp32 for each recipe and precision; a JSON line at the end."""
    import torch

    from laya.training.mini import default_model_dir
    from laya.training.trainer import check_precision

    check_threads(threads)   # 99999 segfaulted torch at the first op
    for p in precisions:
        try:
            check_precision(p, "cpu")
        except ValueError as exc:
            print(f"pagoda bench train: error: {exc}", file=sys.stderr)
            return 2
    torch.set_num_threads(threads)
    cpu = detect()
    print(f"machine: {cpu.model}, {cpu.cores} cores; bf16 units: {', '.join(cpu.bf16_units) or 'none'}; "
          f"torch {torch.__version__}, {threads} threads")
    print(f"{steps} timed steps of 32 per run, each after an untimed run of {warmup} warm-up steps")
    init = model or str(default_model_dir())
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pagoda-bench-train-") as tmp:
        work = Path(tmp)
        for part in parts:
            t = time.time()
            train_file = _scratch_data(work / "scratch", warmup + steps, 32, data) if part == "scratch" else None
            if train_file is not None:
                print(f"scratch: data for the timed steps built in {time.time() - t:.1f}s")
            results[part] = {}
            for p in precisions:
                out = work / part / p
                r = (_time_scratch(train_file, out, steps, warmup, p, threads) if part == "scratch"
                     else _time_finetune(init, out, steps, warmup, p, threads, data))
                results[part][p] = {**r, "s_per_step": r["seconds"] / steps}
    print(f"{'recipe':10} {'precision':10} {'s/step':>8} {'vs fp32':>8}  loss after the timed steps")
    for part, by in results.items():
        base = by.get("fp32", next(iter(by.values())))["s_per_step"]
        for p, r in by.items():
            loss = r["final_loss"]
            loss_s = (f"{loss:.4f}" if isinstance(loss, float)
                      else ", ".join(f"{k} {v:.4f}" for k, v in (loss or {}).items()))
            print(f"{part:10} {p:10} {r['s_per_step']:8.3f} {base / r['s_per_step']:7.2f}x  {loss_s}")
    print(json.dumps({"cpu": cpu.summary(), "threads": threads, "steps": steps, "results": results}))
    return 0

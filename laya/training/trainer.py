"""Fine-tune a Laya checkpoint, or a fresh head on a pretrained encoder, with a strictly proper loss.

Choices that matter:
- Rows are built by the same code inference uses (`laya.training.examples.encode` -> `laya.rows`), with a
  fresh random option order (and, for choices, option subset) every time a question is used.
- `encoder_lr=0` freezes the encoder: no encoder gradients are computed at all, which is what
  makes a useful head trainable in minutes on two CPU cores (`laya.training.mini` does this).
- Batches are drawn from a length-sorted window, so padding stays small without fixing the order.
- A run is a pure function of (data, config, seed): the plan of every epoch is regenerated from
  the seed, so `resume` replays the plan up to the saved step and continues bit-for-bit on the
  same machine and thread count. It refuses settings that would change that plan, the schedule or what the
  saved optimizer state is for (`RESUMED`, recorded in each save).
- `precision="bf16"` runs the forward under bf16 autocast where the hardware has bf16 units (AMX or
  AVX512-BF16 on CPU, any CUDA GPU); the weights, their gradients, the optimizer and the loss stay fp32,
  so a bf16 run saves the same checkpoint layout and only the forward's rounding differs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from laya.checks import check_threads
from laya.precision import check_device
from laya.training.losses import LossWeights

if TYPE_CHECKING:
    import torch

STATE_FILE = "trainer_state.pt"
TRAIN_PRECISIONS = ("fp32", "bf16")
# What a resumed run must share with its save, by the flag (or `TrainConfig` field) that sets it: the plan
# replayed to the saved step (seed, batch size, lengths, augmentation draws), the learning-rate schedule (its
# length and peak) and what the saved optimizer state is for (its groups and weight decay). A resume that changed
# one of these used to go on from a state that was not its own, exit 0. Threads, device, precision, dropout,
# the loss weights and the eval/save cadence may change.
RESUMED = {"batch_size": "--batch-size", "seed": "--seed", "epochs": "--epochs", "max_steps": "--max-steps",
           "lr": "--lr", "encoder_lr": "--encoder-lr", "encoder_layers": "--encoder-layers", "max_len": "--max-len",
           "head_max_len": "--head-max-len", "weight_decay": "train: weight_decay", "warmup": "train: warmup",
           "shuffle_options": "train: shuffle_options", "option_subsets": "train: option_subsets"}


def _device_type(device: str) -> str:
    return str(device).split(":")[0]


def check_precision(precision: str, device: str) -> None:
    """Refuse a training precision this machine cannot run fast: emulated bf16 on a CPU without bf16 units
    is slower than fp32, so asking for it is a mistake worth naming, not a silent slowdown."""
    if precision not in TRAIN_PRECISIONS:
        raise ValueError(f"--precision: expected one of {', '.join(TRAIN_PRECISIONS)}, got {precision!r}")
    if precision == "bf16" and _device_type(device) == "cpu":
        from laya.precision import BF16_UNITS, detect

        cpu = detect()
        if not cpu.bf16_units:
            raise ValueError(f"--precision: 'bf16' autocast needs a CPU with {' or '.join(BF16_UNITS)}; this CPU "
                             f"({cpu.model or 'unknown'}) has neither, and emulated bf16 is slower than fp32: "
                             "train with fp32")


def use_precision(model, precision: str, device: str) -> None:
    """Set the model up for `precision`: bf16 on a CPU trains with the encoder's eager attention, because
    torch's CPU flash-attention backward is slow in bf16 (MiniLM, 32 rows of ~100 tokens, AMX: 0.59 s
    against eager's 0.29 s, which held autocast to 1.2x over fp32). fp32 and GPUs keep SDPA, so an fp32 run
    stays bit for bit what it was."""
    if precision == "bf16" and _device_type(device) == "cpu":
        model.encoder.set_attn_implementation("eager")


def autocast(precision: str, device: str):
    """The context the training forward runs in: nothing for fp32, bf16 autocast otherwise."""
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=_device_type(device), dtype=torch.bfloat16)


@dataclass
class TrainConfig:
    data: str = ""
    out: str = ""
    init: str | None = None          # an official-layout checkpoint to fine-tune
    encoder: str | None = None       # or: a pretrained transformers encoder folder + a fresh head
    head_layers: int = 2
    act_costs: dict[str, float] = field(default_factory=lambda: {"ask": 0.1})
    eval_data: str | None = None
    epochs: float = 1.0
    max_steps: int | None = None
    batch_size: int = 16
    lr: float = 3e-4                 # head, scorer, type embeddings, act head
    encoder_lr: float = 0.0          # 0 freezes the encoder
    encoder_layers: int | None = None  # with encoder_lr > 0: train only the top N encoder layers (None: all)
    weight_decay: float = 0.01
    warmup: float = 0.06             # fraction of steps
    loss: LossWeights = field(default_factory=lambda: LossWeights(log=1.0, spherical=0.5, rps=1.0))
    act_weight: float = 0.1          # act head learns "answer now" = the top option is right
    shuffle_options: float = 1.0
    option_subsets: float = 0.3
    max_len: int = 256
    head_max_len: int = 128
    seed: int = 0
    eval_every: int = 200
    save_every: int = 200
    resume: bool = False
    stop_at: int | None = None       # end this invocation after that step (saved); `resume` continues
    threads: int | None = None
    dropout: float = 0.1
    device: str = "cpu"
    precision: str = "fp32"          # or "bf16": autocast forward where the hardware has bf16 units

    def validate(self) -> None:
        if not self.data:
            raise ValueError("train: --data is required")
        if not self.out:
            raise ValueError("train: --out is required")
        if (self.init is None) == (self.encoder is None):
            raise ValueError("train: give exactly one of --init (a Laya checkpoint) or --encoder (a pretrained folder)")
        for name, flag in (("batch_size", "--batch-size"), ("eval_every", "--eval-every"),
                           ("save_every", "--save-every"), ("max_len", "--max-len"), ("head_max_len", "--head-max-len")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{flag}: must be a positive integer, got {v!r}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"--max-steps: must be a positive integer, got {self.max_steps!r}")
        if self.encoder_layers is not None and (isinstance(self.encoder_layers, bool)
                                                or not isinstance(self.encoder_layers, int) or self.encoder_layers < 1):
            raise ValueError(f"train: encoder_layers must be a positive integer (or unset: all), "
                             f"got {self.encoder_layers!r}")
        if self.stop_at is not None and (isinstance(self.stop_at, bool) or not isinstance(self.stop_at, int)
                                         or self.stop_at < 1):  # 0 was ignored; -1 saved nothing, then failed
            raise ValueError(f"--stop-at: must be a step >= 1 (the run stops after it), got {self.stop_at!r}")
        if isinstance(self.head_layers, bool) or not isinstance(self.head_layers, int) or self.head_layers < 0:
            # the bound the checkpoint's loader holds it to (`LayaConfig.validate`), checked before training
            raise ValueError(f"--head-layers: must be an integer >= 0, got {self.head_layers!r}")
        if not 0 < self.epochs < math.inf:
            raise ValueError(f"train: epochs must be a finite number > 0, got {self.epochs!r}")
        for name in ("lr", "encoder_lr"):  # 1e308 is finite and trained a model of NaNs, exit 0
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be a learning rate in [0, 1], "
                                 f"got {getattr(self, name)!r}")
        for name in ("weight_decay", "act_weight"):  # inf trained a model of NaNs, exit 0
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"train: {name} must be a finite number >= 0, got {getattr(self, name)!r}")
        for name in ("warmup", "shuffle_options", "option_subsets", "dropout"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"train: {name} must be in [0, 1], got {getattr(self, name)!r}")
        check_threads(self.threads)
        check_device(self.device)
        check_precision(self.precision, self.device)


def check_loss(loss: float, step: int, where: str, lower: str) -> None:
    """Stops a run at its first NaN or infinite loss: every step after it trains on NaN, and such a run used to
    finish, exit 0 and save a model of NaNs. `lower` names the settings to lower, the usual cause."""
    if not math.isfinite(loss):
        raise ValueError(f"{where}: the loss is {loss} at step {step}, training diverged: lower {lower}")


def check_resume(cfg: TrainConfig, saved: dict[str, Any], items: int, total: int) -> None:
    """Refuse to resume the save in `cfg.out` under settings it was not made with (`RESUMED`), naming the flag
    and the saved value, or to stop or end at a step it is already past. `saved` is the trainer state; one saved
    before it recorded its settings is checked against the step it holds only."""
    run = saved.get("run", {})
    if "items" in run and run["items"] != items:
        raise ValueError(f"--data: the run in {cfg.out} was saved training on {run['items']} items, "
                         f"{cfg.data} holds {items}")
    for name, flag in RESUMED.items():
        if name == "epochs" and cfg.max_steps is not None and run.get("max_steps") == cfg.max_steps:
            continue  # --max-steps sets the schedule's length; --epochs then counts for nothing
        if name in run and run[name] != getattr(cfg, name):
            raise ValueError(f"{flag}: the run in {cfg.out} was saved with {run[name]!r}, got "
                             f"{getattr(cfg, name)!r}; resume with the settings it was started with")
    if cfg.stop_at is not None and cfg.stop_at <= saved["step"]:  # replayed to it, saved nothing, claimed it
        raise ValueError(f"--stop-at: step {cfg.stop_at} is not past step {saved['step']}, where the run in "
                         f"{cfg.out} was saved; give a later step, or none to run to the end")
    if total < saved["step"]:
        flag, value = ("--max-steps", cfg.max_steps) if cfg.max_steps is not None else ("--epochs", cfg.epochs)
        raise ValueError(f"{flag}: {value} ends the run at step {total}, before step {saved['step']}, where the run "
                         f"in {cfg.out} was saved")
    if total == saved["step"]:  # replaying it would only rewrite its summary, as a run that saw no example
        raise ValueError(f"--resume: the run in {cfg.out} already ended at step {total}; nothing to continue")


def check_positions(cfg: TrainConfig) -> None:
    """Refuse budgets past the encoder's positions before any work: a row that long failed deep in the encoder
    with a tensor-size traceback, and only once a long enough state came (short ones trained silently), where
    `predict` refuses the same budget by name."""
    from laya.layout import ENCODER_CONFIG, checkpoint_positions, encoder_positions, read_json

    if cfg.init is not None:
        positions, where = checkpoint_positions(cfg.init), os.path.join(cfg.init, ENCODER_CONFIG)
    else:
        where = os.path.join(cfg.encoder, "config.json")
        try:
            positions = encoder_positions(read_json(where))
        except (OSError, ValueError, AttributeError):
            return  # the encoder's load names what is wrong with its folder
    for name, flag in (("max_len", "--max-len"), ("head_max_len", "--head-max-len")):
        if positions is not None and getattr(cfg, name) > positions:
            raise ValueError(f"{flag}: {getattr(cfg, name)} is more than the encoder's {positions} positions "
                             f"(max_position_embeddings in {where})")


def build_model(cfg: TrainConfig):
    """(model, tokenizer, LayaConfig): the checkpoint to fine-tune, or a fresh head on the encoder."""
    from laya.checkpoint import load_checkpoint
    from laya.config import LayaConfig
    from laya.modeling_laya import LayaModel
    from laya.tokenizer import LayaTokenizer

    if cfg.init is not None:
        model, tok, config = load_checkpoint(cfg.init)
        return model, tok, config
    if not os.path.isdir(cfg.encoder):
        raise FileNotFoundError(f"train: encoder folder not found: {cfg.encoder}")
    if not os.path.isfile(os.path.join(cfg.encoder, "config.json")):  # transformers' own words name no flag
        raise FileNotFoundError(f"--encoder: {cfg.encoder} holds no config.json: not a pretrained encoder folder")
    import torch

    torch.manual_seed(cfg.seed)
    config = LayaConfig(encoder=_encoder_name(cfg.encoder), head_layers=cfg.head_layers,
                        act_costs=dict(cfg.act_costs), max_len=512, head_max_len=192)
    model = LayaModel.from_pretrained_encoder(cfg.encoder, config)
    # nn.Embedding's N(0, 1) init gives type embeddings a norm of ~sqrt(d) (~20 at d=384), more than
    # twice a MiniLM token state (~9); added at every position, they drown what the encoder read.
    torch.nn.init.normal_(model.type_emb.weight, std=0.02)
    tok = LayaTokenizer.from_dir(cfg.encoder)
    return model, tok, config


def _layer_list(model) -> tuple[str, int]:
    """Where the encoder's layers are (BERT `encoder.layer`, ModernBERT `layers`) and how many there are."""
    import torch

    for path in ("encoder.layer", "layers", "layer"):
        obj = model.encoder
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return path, len(obj)
    raise ValueError("train: cannot find the encoder's layer list to train only its top layers")


def encoder_layer_prefixes(model, n: int | None) -> list[str]:
    """State-dict prefixes of the top `n` encoder layers (all of them when `n` is None or more than there are)."""
    path, count = _layer_list(model)
    first = 0 if n is None else max(0, count - n)
    return [f"encoder.{path}.{i}." for i in range(first, count)]


def _encoder_name(folder: str) -> str:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("_name_or_path") or os.path.basename(os.path.normpath(folder))
    except (OSError, ValueError):
        return os.path.basename(os.path.normpath(folder))


def plan_batches(lengths: list[int], batch_size: int, rng: random.Random, window_batches: int = 50) -> list[list[int]]:
    """One epoch of batches of similar length: little padding, yet a different order every epoch.

    Shuffle, sort windows of `window_batches` batches by length, cut, shuffle the batches. Students are
    trained on the same plan (`distill.trainer`).
    """
    n_items = len(lengths)
    order = list(range(n_items))
    rng.shuffle(order)
    window = batch_size * window_batches
    batches = []
    for start in range(0, n_items, window):
        chunk = sorted(order[start:start + window], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def training_batch(tok, items: list, idx, budgets, rng, augment, device: str = "cpu") -> tuple[dict, torch.Tensor]:
    """The collated model inputs of `items[idx]` and their per-option targets, padded to the batch's widest
    row of options (zeros past a row's own). Shared with `laya.training.finetune`, whose mixed-source steps
    build the same tensors."""
    import torch

    from laya.batching import collate
    from laya.training.examples import encode

    rows, targets = [], []
    for i in idx:
        row, target = encode(tok, items[i], budgets, rng, augment)
        rows.append(row)
        targets.append(target)
    batch = collate(rows, tok.pad_token_id)
    t = torch.zeros(batch["marker_mask"].shape, dtype=torch.float32)
    for j, target in enumerate(targets):
        t[j, : len(target)] = torch.tensor(target)
    return {k: v.to(device) for k, v in batch.items()}, t.to(device)


def evaluate(model, tok, items, budgets, batch_size: int = 32, device: str = "cpu") -> dict[str, float]:
    """Accuracy and mean log loss at T=1 in the data's own option order (no augmentation)."""
    import torch

    from laya.training.losses import log_score

    model.eval()
    n, hits, nll = 0, 0, 0.0
    order = sorted(range(len(items)), key=lambda i: len(str(items[i].state)))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch, t = training_batch(tok, items, order[start:start + batch_size], budgets, None, None, device)
            logits, _ = model(**batch)
            nll += float(log_score(logits, t, batch["marker_mask"]).sum())
            hits += int((logits.argmax(-1) == t.argmax(-1)).sum())
            n += len(t)
    return {"accuracy": hits / max(1, n), "nll": nll / max(1, n), "n": n}


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) training; writes an official-layout checkpoint to `cfg.out` and returns a summary."""
    import torch
    from tqdm import tqdm

    from laya.checkpoint import save_checkpoint
    from laya.rows import Budgets
    from laya.training.examples import Augment, encode, read_jsonl
    from laya.training.losses import proper_loss

    cfg.validate()
    check_positions(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    items = read_jsonl(cfg.data)
    eval_items = read_jsonl(cfg.eval_data, "--eval-data") if cfg.eval_data else []
    steps_per_epoch = math.ceil(len(items) / cfg.batch_size)
    total = cfg.max_steps or max(1, round(cfg.epochs * steps_per_epoch))
    resume_state = None
    state_path = os.path.join(cfg.out, STATE_FILE)
    if cfg.resume and not os.path.isfile(state_path):  # a wrong --out would otherwise start a run over from step 0
        raise ValueError(f"--resume: {cfg.out} holds no save to continue from (no {STATE_FILE}); drop --resume to "
                         f"start a run there")
    if cfg.resume:
        resume_state = torch.load(state_path, weights_only=False)
        check_resume(cfg, resume_state, len(items), total)
        cfg_init = cfg.init
        cfg.init, cfg.encoder = cfg.out, None   # weights come from the last save
        model, tok, config = build_model(cfg)
        cfg.init = cfg_init
    else:
        model, tok, config = build_model(cfg)
    model.to(cfg.device)
    use_precision(model, cfg.precision, cfg.device)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = cfg.dropout
    frozen = cfg.encoder_lr == 0
    layers = _layer_list(model)[1] if cfg.encoder_layers is not None else 0
    if cfg.encoder_layers is not None and cfg.encoder_layers > layers:  # it trained all of them
        raise ValueError(f"--encoder-layers: {cfg.encoder_layers} is more than the encoder's {layers} layers")
    trained_prefixes = ["encoder."] if cfg.encoder_layers is None else encoder_layer_prefixes(model, cfg.encoder_layers)
    enc_params = []
    for n, p in model.encoder.named_parameters():
        train_it = not frozen and any(("encoder." + n).startswith(pre) for pre in trained_prefixes)
        p.requires_grad_(train_it)
        if train_it:
            enc_params.append(p)
    groups = [{"params": [p for n, p in model.named_parameters() if not n.startswith("encoder.")], "lr": cfg.lr}]
    if enc_params:
        groups.append({"params": enc_params, "lr": cfg.encoder_lr})
    whole_encoder = not frozen and cfg.encoder_layers is None
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)

    budgets = Budgets(cfg.max_len, cfg.head_max_len)
    augment = Augment(cfg.shuffle_options, cfg.option_subsets)
    # Length of each row in its data order, for batching similar lengths together.
    lengths = [encode(tok, it, budgets)[0].n_tokens for it in items]
    warm = max(1, round(cfg.warmup * total))

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    start = 0
    history: list[dict[str, Any]] = []
    if resume_state is not None:
        opt.load_state_dict(resume_state["optimizer"])
        start = resume_state["step"]
        history = resume_state["history"]
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    seen = 0
    bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    step, epoch, last = 0, 0, {}
    end = min(total, cfg.stop_at or total)  # the schedule always spans `total`; `end` only interrupts
    while step < end:
        rng = random.Random(cfg.seed * 100003 + epoch)
        for idx in plan_batches(lengths, cfg.batch_size, rng):
            if step >= end:
                break
            if step < start:  # replay the plan (and its augmentation draws) up to the resumed step
                for i in idx:
                    encode(tok, items[i], budgets, rng, augment)
                step += 1
                if step == start and resume_state is not None:
                    torch.set_rng_state(resume_state["torch_rng"])
                continue
            model.train()
            if not whole_encoder:
                model.encoder.eval()  # no dropout in a (partly) frozen encoder: its features stay the pretrained ones
            batch, target = training_batch(tok, items, idx, budgets, rng, augment, cfg.device)
            with autocast(cfg.precision, cfg.device):
                logits, act = model(**batch)
            logits, act = logits.float(), act.float()
            loss = proper_loss(logits, target, batch["marker_mask"], batch["qtype"], cfg.loss)
            if cfg.act_weight and act.size(-1) > 1:
                # index 0 = answer now; the right call is to answer when the top option is the target's.
                wrong = (logits.detach().argmax(-1) != target.argmax(-1)).long()
                loss = loss + cfg.act_weight * torch.nn.functional.cross_entropy(act, wrong)
            last = {"loss": float(loss.detach())}
            check_loss(last["loss"], step + 1, "train", f"--lr ({cfg.lr:g})" + (
                f" or --encoder-lr ({cfg.encoder_lr:g})" if enc_params else ""))
            for g, base in zip(opt.param_groups, [cfg.lr, cfg.encoder_lr]):
                g["lr"] = base * lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
            opt.step()
            step += 1
            seen += len(idx)
            bar.set_postfix(loss=f"{last['loss']:.3f}", ex_s=f"{seen / max(1e-9, time.time() - t0):.1f}")
            bar.update(1)
            if eval_items and (step % cfg.eval_every == 0 or step == total):
                ev = evaluate(model, tok, eval_items, budgets, device=cfg.device)
                history.append({"step": step, "train_loss": last["loss"], **ev})
                bar.write(f"step {step}: eval accuracy {ev['accuracy']:.3f} nll {ev['nll']:.3f} (n={ev['n']})")
            if step % cfg.save_every == 0 or step == end:
                _save(cfg, model, tok, config, opt, step, history, save_checkpoint, len(items))
        epoch += 1
    bar.close()
    elapsed = time.time() - t0
    # `steps` is where the run stands; what this process did (a resumed run's part) is counted from `resumed_from`
    summary = {"steps": step, "resumed_from": start, "examples_seen": seen, "seconds": elapsed,
               "examples_per_s": seen / max(1e-9, elapsed), "final_loss": last.get("loss"),
               "history": history}
    with open(os.path.join(cfg.out, "train_summary.json"), "w", encoding="utf-8") as f:
        json.dump({**summary, "config": _jsonable(cfg)}, f, indent=2)
    return summary


def _save(cfg, model, tok, config, opt, step, history, save_checkpoint, items: int) -> None:
    import torch

    config.extra["training"] = {"data": os.path.basename(cfg.data), "step": step, "seed": cfg.seed,
                                "encoder_lr": cfg.encoder_lr, "encoder_layers": cfg.encoder_layers}
    # fp32 while training so a resumed run continues from exactly what it had; `export` writes F16.
    save_checkpoint(cfg.out, model, tok, config, dtype=torch.float32)  # copies to CPU
    tmp = os.path.join(cfg.out, STATE_FILE + ".tmp")
    run = {"items": items, **{name: getattr(cfg, name) for name in RESUMED}}  # what `check_resume` holds it to
    torch.save({"step": step, "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                "history": history, "run": run}, tmp)
    os.replace(tmp, os.path.join(cfg.out, STATE_FILE))


def _jsonable(cfg: TrainConfig) -> dict[str, Any]:
    d = asdict(cfg)
    return d


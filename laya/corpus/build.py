"""Assemble the laya-mini splits: train, calib (temperature fitting) and test (never seen by any fit).

Tickets draw each split from its own seed; reviews and dialogs split by a hash of their text, so a
snippet stays in its split whatever the sizes. Two test sources hold whole label sets out of
training and calibration: tickets from the `security` and `sales` departments, and dialogs on five
chatterbot topics. No option naming those labels is ever shown before the test.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from laya.corpus import dialogs, forms, reviews, tickets

SPLITS = ("train", "calib", "test")


@dataclass
class CorpusConfig:
    seed: int = 0
    tickets_train: int = 2400
    tickets_calib: int = 500
    tickets_test: int = 500
    tickets_unseen: int = 200
    reviews_train: int = 1600
    reviews_calib: int = 400
    reviews_test: int = 500
    opaque_options: float = 0.0   # share of the train tickets' department choices named "queue A", "T-314", ...


def _bucket(key: str, seed: int) -> float:
    """A stable number in [0, 1) per item, so a text's split does not depend on what else was read."""
    return int(hashlib.sha1((f"{seed}:{key}").encode()).hexdigest()[:8], 16) / 2**32


def _split3(items: list[dict], seed: int, calib: float, test: float) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for it in items:
        u = _bucket(it["id"], seed)
        out["test" if u < test else "calib" if u < test + calib else "train"].append(it)
    return out


def build(cfg: CorpusConfig) -> dict[str, list[dict]]:
    """`{"train": [...], "calib": [...], "test": [...]}` of decision examples, each with a `source`."""
    s = cfg.seed
    seen_topics = tuple(t for t in dialogs.TOPICS if t not in dialogs.HELDOUT_TOPICS)
    out: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for i, (split, n) in enumerate((("train", cfg.tickets_train), ("calib", cfg.tickets_calib),
                                    ("test", cfg.tickets_test))):
        out[split] += forms.ticket_examples(tickets.generate(n, seed=1000 * s + i), seed=1000 * s + 10 + i,
                                            p_opaque=cfg.opaque_options if split == "train" else 0.0)
    unseen = tickets.generate(cfg.tickets_unseen, seed=1000 * s + 3, departments=tickets.HELDOUT_DEPARTMENTS)
    out["test"] += forms.heldout_department_examples(unseen, seed=1000 * s + 13)

    rev = _split3(reviews.load(), s, calib=0.1, test=0.15)
    sizes = {"train": cfg.reviews_train, "calib": cfg.reviews_calib, "test": cfg.reviews_test}
    for i, split in enumerate(SPLITS):
        items = random.Random(1000 * s + 20 + i).sample(rev[split], min(sizes[split], len(rev[split])))
        out[split] += forms.review_examples(items, seed=1000 * s + 30 + i)

    all_dialogs = dialogs.load()
    dia = _split3([d for d in all_dialogs if d["topic"] in seen_topics], s, calib=0.15, test=0.2)
    for i, split in enumerate(SPLITS):
        out[split] += forms.dialog_examples(dia[split], seed=1000 * s + 40 + i, pool=seen_topics)
    held = [d for d in all_dialogs if d["topic"] in dialogs.HELDOUT_TOPICS]
    out["test"] += forms.dialog_examples(held, seed=1000 * s + 50, pool=tuple(dialogs.TOPICS),
                                         source="dialogs-unseen-labels")
    for split in SPLITS:
        random.Random(1000 * s + 60).shuffle(out[split])
    return out


def write(splits: dict[str, list[dict]], directory: str | Path, cfg: CorpusConfig) -> dict[str, Path]:
    """One JSONL per split plus `corpus.json` (the config that rebuilds it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, examples in splits.items():
        paths[split] = directory / f"{split}.jsonl"
        with open(paths[split], "w", encoding="utf-8") as f:
            for ex in examples:
                f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    (directory / "corpus.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    return paths

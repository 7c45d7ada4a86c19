"""The project's own corpora as data files for `pagoda distill --data` (`python -m distill.corpus`).

The support tickets come from `laya.corpus.tickets` with their gold department/urgency/churn
labels; the seed differs from the one laya-mini is trained with, so the student is distilled and
evaluated on tickets the teacher never saw.

A student labelled on one generator's text learns that generator: on hand-written tickets it agreed with
its teacher 0.78-0.91 against 0.998+ on the generator's held-out rows. So the corpus can also carry text
the generator does not write: real user utterances from CLINC150 and Snips (read from the shared data
folder, never copied; no gold labels, the teacher's soft labels are the targets), tickets cut short
after their first sentence (gold dropped: the cut may remove the urgency or churn cue), and tickets
written by hand (`datasets/handwritten_tickets_student.jsonl`, never the evaluation file), each as
written and in perturbed copies (`handwritten_variants`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from laya.corpus import noise

DEFAULT_SEED = 2026


def utterances(data: str | os.PathLike, n: int, rng: random.Random) -> list[str]:
    """`n` distinct training utterances of CLINC150 (all 150 intents and out-of-scope) and Snips."""
    from laya.corpus import intents

    data = Path(data)
    pool = [t for t, _ in intents.clinc(data, "train")] + [t for t, _ in intents.clinc(data, "oos_train")]
    pool += [t for texts in intents.snips(data, "train").values() for t in texts]
    pool = sorted(set(pool))
    if n > len(pool):
        raise ValueError(f"--utterances: {n} asked, the shared data holds {len(pool)}")
    return rng.sample(pool, n)


def first_sentence(text: str) -> str | None:
    """The ticket up to its first sentence end after the greeting, or None when nothing would be cut."""
    lines = [line for line in text.split("\n") if line.strip()]
    body = lines[1] if len(lines) > 2 else text
    for end in (". ", "! ", "? "):
        i = body.find(end)
        if 0 < i < len(body) - 2:
            return body[:i + 1]
    return None


def handwritten_variants(texts: list[str], per_text: int, rng: random.Random) -> list[str]:
    """Each text as written plus up to `per_text` distinct copies, each with one to three of `laya.corpus.noise`'s
    edits (any kind: a copy may be cut to its first sentence or borrow another text's sentence). Why perturb rather
    than only add the texts: a few hundred tickets are few rows beside 9,000, and the student must follow its
    teacher on how people write (case, typos, two issues at once), which is what the evaluation tickets vary in."""
    out = []
    for t in texts:
        out.append(t)
        seen = {t}
        for _ in range(per_text):
            v = noise.perturb(t, rng, texts)
            if v not in seen:
                seen.add(v)
                out.append(v)
    return out


def write_corpus(path: str | os.PathLike, n: int, seed: int = DEFAULT_SEED, *, n_utterances: int = 0,
                 truncated: float = 0.0, data: str | os.PathLike = "../shared/data",
                 handwritten: str | os.PathLike | list[str | os.PathLike] | None = None, variants: int = 0) -> Path:
    """`n` generated tickets (a `truncated` share of them also cut to their first sentence, as extra rows)
    plus `n_utterances` shared-data utterances and the texts of the `handwritten` file(s) with `variants`
    perturbed copies each, shuffled; rows without gold carry null gold columns. Several files are one pool:
    a copy may borrow a sentence from any of their texts."""
    from laya.corpus import tickets

    if not 0 <= truncated <= 1:
        raise ValueError(f"--truncated: must be in [0, 1], got {truncated!r}")
    if n < 1 or n_utterances < 0:  # before any work (the sampler's own message names no flag)
        raise ValueError(f"--tickets: must be >= 1, got {n}" if n < 1 else
                         f"--utterances: must be >= 0, got {n_utterances}")
    if variants and not handwritten:
        raise ValueError("--handwritten-variants: copies of --handwritten texts, and no --handwritten file is given")
    if Path(path).is_dir():
        raise ValueError(f"--out: {path} is a folder; give the .jsonl file to write")
    rng = random.Random(seed + 1)
    rows = tickets.generate(n, seed=seed)
    cut = [first_sentence(t["text"]) for t in rows if rng.random() < truncated]
    rows += [{"text": c, "department": None, "urgency": None, "churn": None, "source": "tickets-cut"}
             for c in cut if c]
    rows += [{"text": u, "department": None, "urgency": None, "churn": None, "source": "utterances"}
             for u in (utterances(data, n_utterances, rng) if n_utterances else [])]
    if handwritten:
        from laya.corpus.handwritten import read_texts

        if variants < 0:
            raise ValueError(f"--handwritten-variants: must be >= 0, got {variants!r}")
        files = [handwritten] if isinstance(handwritten, (str, os.PathLike)) else handwritten
        texts = [t for f in files for t in read_texts(Path(f))]
        rows += [{"text": t, "department": None, "urgency": None, "churn": None, "source": "handwritten"}
                 for t in handwritten_variants(texts, variants, rng)]
    if len(rows) > n:
        rng.shuffle(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in rows:
            f.write(json.dumps({"source": "tickets", **t}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distill.corpus", description=__doc__.splitlines()[0])
    p.add_argument("--tickets", type=int, required=True, help="how many tickets to generate")
    p.add_argument("--utterances", type=int, default=0, help="CLINC150 + Snips utterances to add (default 0)")
    p.add_argument("--truncated", type=float, default=0.0,
                   help="share of tickets also added cut to their first sentence (default 0)")
    p.add_argument("--data", default="../shared/data", help="folder holding clinc150/ and snips/")
    p.add_argument("--handwritten", action="append", default=[],
                   help="a .jsonl of hand-written texts to add (its `text` field; repeatable), e.g. "
                        "datasets/handwritten_tickets_student.jsonl")
    p.add_argument("--handwritten-variants", type=int, default=0,
                   help="perturbed copies of each hand-written text to add as well (default 0)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--out", required=True, help=".jsonl file to write")
    args = p.parse_args(argv)
    try:
        out = write_corpus(args.out, args.tickets, args.seed, n_utterances=args.utterances,
                           truncated=args.truncated, data=args.data, handwritten=args.handwritten,
                           variants=args.handwritten_variants)
    except (ValueError, OSError) as exc:  # a folder given as --out, a file that is not UTF-8
        print(f"python -m distill.corpus: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The project's own corpora as data files for `pagoda distill --data` (`python -m distill.corpus`).

The support tickets come from `laya.corpus.tickets` with their gold department/urgency/churn
labels; the seed differs from the one laya-mini is trained with, so the student is distilled and
evaluated on tickets the teacher never saw.

A student labelled on one generator's text learns that generator: on hand-written tickets it agreed with
its teacher 0.78-0.91 against 0.998+ on the generator's held-out rows. So the corpus can also carry text
the generator does not write: real user utterances from CLINC150 and Snips (read from the shared data
folder, never copied; no gold labels, the teacher's soft labels are the targets), and tickets cut short
after their first sentence (gold dropped: the cut may remove the urgency or churn cue).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

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


def write_corpus(path: str | os.PathLike, n: int, seed: int = DEFAULT_SEED, *, n_utterances: int = 0,
                 truncated: float = 0.0, data: str | os.PathLike = "../shared/data") -> Path:
    """`n` generated tickets (a `truncated` share of them also cut to their first sentence, as extra rows)
    plus `n_utterances` shared-data utterances, shuffled; rows without gold carry null gold columns."""
    from laya.corpus import tickets

    if not 0 <= truncated <= 1:
        raise ValueError(f"--truncated: must be in [0, 1], got {truncated!r}")
    rng = random.Random(seed + 1)
    rows = tickets.generate(n, seed=seed)
    cut = [first_sentence(t["text"]) for t in rows if rng.random() < truncated]
    rows += [{"text": c, "department": None, "urgency": None, "churn": None, "source": "tickets-cut"}
             for c in cut if c]
    rows += [{"text": u, "department": None, "urgency": None, "churn": None, "source": "utterances"}
             for u in (utterances(data, n_utterances, rng) if n_utterances else [])]
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
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--out", required=True, help=".jsonl file to write")
    args = p.parse_args(argv)
    try:
        out = write_corpus(args.out, args.tickets, args.seed, n_utterances=args.utterances,
                           truncated=args.truncated, data=args.data)
    except (ValueError, FileNotFoundError) as exc:
        print(f"python -m distill.corpus: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

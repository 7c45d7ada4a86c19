"""The project's own corpora as data files for `pagoda distill --data` (`python -m distill.corpus`).

The support tickets come from `laya.corpus.tickets` with their gold department/urgency/churn
labels; the seed differs from the one laya-mini is trained with, so the student is distilled and
evaluated on tickets the teacher never saw.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DEFAULT_SEED = 2026


def write_tickets(path: str | os.PathLike, n: int, seed: int = DEFAULT_SEED) -> Path:
    from laya.corpus import tickets

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in tickets.generate(n, seed=seed):
            f.write(json.dumps(t, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distill.corpus", description=__doc__.splitlines()[0])
    p.add_argument("--tickets", type=int, required=True, help="how many tickets to write")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--out", required=True, help=".jsonl file to write")
    args = p.parse_args(argv)
    print(f"wrote {write_tickets(args.out, args.tickets, args.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

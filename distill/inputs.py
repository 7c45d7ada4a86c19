"""What a student reads: a state's token ids (encoder) or its normalised words (linear), torch-free.

Training, the export check and the edge runtime all feed a student through these functions, so the
student that was trained is the one that answers: same tokenizer settings, same truncation, same
text normalisation. `distill.runtime` imports this module, so it uses nothing beyond `tokenizers`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer

from laya.paths import minilm_dir

WORD = re.compile(r"(?u)\b\w\w+\b")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A WordPiece `tokenizer.json` with its own truncation and padding off: `encode` decides both."""
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    return tok


def encode(tok: Tokenizer, texts: list[str], max_len: int) -> tuple[list[list[int]], list[int]]:
    """(kept token ids, full token count) per text, cut to `max_len` keeping the head and the final [SEP].

    The full count is what `usage.state_tokens` reports; a cut state still ends in [SEP], the token
    the student always saw last in training.
    """
    kept, full = [], []
    for enc in tok.encode_batch(texts):
        ids = enc.ids
        kept.append(ids if len(ids) <= max_len else ids[:max_len - 1] + ids[-1:])
        full.append(len(ids))
    return kept, full


def minilm_tokenizer_file() -> Path:
    """The tokenizer every encoder student is trained with; export copies it into the student folder."""
    return minilm_dir() / "tokenizer.json"


@functools.cache
def minilm_tokenizer() -> Tokenizer:
    return load_tokenizer(minilm_tokenizer_file())


def minilm_ids(texts: list[str], max_len: int) -> list[list[int]]:
    """Training's token ids: `encode` with the MiniLM tokenizer, cut exactly as the runtime cuts."""
    return encode(minilm_tokenizer(), texts, max_len)[0]


def normalise_words(texts: list[str]) -> list[str]:
    """The linear student's input: lowercase `\\w\\w+` words joined by single spaces (`distill.linear`)."""
    return [" ".join(WORD.findall(t.lower())) for t in texts]

"""The base encoder's own text-label matching: cosine similarity of mean-pooled all-MiniLM-L6-v2 embeddings.

Two users: the zero-shot baseline of `pagoda laya-mini eval` and the teacher of the laya-mini build, whose
intent choices learn part of their target from this ranking so that fine-tuning keeps the encoder's general
matching (issue 15). The pooling is written here (mean over tokens, unit norm, as sentence-transformers'
all-MiniLM-L6-v2 config does) rather than taken from sentence-transformers, which `pagoda[laya]` does not depend on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from laya.calibration import softmax
from laya.paths import minilm_dir


class Cosine:
    """Sentence-transformers-style embeddings of the base encoder: [CLS] text [SEP], mean over tokens, unit norm."""

    def __init__(self, encoder: Path | None = None, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer

        enc = str(encoder or minilm_dir())
        self.model = AutoModel.from_pretrained(enc).eval()
        self.tok = AutoTokenizer.from_pretrained(enc)
        self.batch_size = batch_size
        self.cache: dict[str, np.ndarray] = {}

    def embed(self, texts: list[str], progress: bool = False) -> np.ndarray:
        import torch
        from tqdm import tqdm

        # Similar lengths: little padding. Ties by the text itself, not by set order (a process's string hashing).
        todo = sorted({t for t in texts if t not in self.cache}, key=lambda t: (len(t), t))
        with torch.inference_mode():
            for s in tqdm(range(0, len(todo), self.batch_size), desc="embed", unit="batch", disable=not progress):
                chunk = todo[s:s + self.batch_size]
                b = self.tok(chunk, padding=True, truncation=True, max_length=256, return_tensors="pt")
                h = self.model(**b).last_hidden_state
                m = b["attention_mask"][..., None].to(h.dtype)
                e = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
                self.cache.update(zip(chunk, e.numpy()))
        return np.stack([self.cache[t] for t in texts]) if texts else np.zeros((0, 0))

    def choose(self, text: str, options: list[str]) -> int:
        t, o = self.embed([text])[0], self.embed(options)
        return int(np.argmax(o @ t))

    def distribution(self, text: str, options: list[str], tau: float) -> np.ndarray:
        """softmax(cos(text, option) / tau) over the options: the teacher's ranking as probabilities."""
        return softmax((self.embed(options) @ self.embed([text])[0]).astype(np.float64), tau)
